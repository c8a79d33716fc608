"""The CUDA recurrent kernels (egraft/kernels/cuda/rnn.py): each case is a one-node LSTM, GRU
or RNN model whose kernel must compile with NVRTC for sm_90 without spills and, run in the
CPU emulator, agree with the registry's numpy semantics (``run_graph``) and, where it
implements the case, with onnxruntime: every direction, with and without ``B``, initial
states, every subset of the outputs, unequal ``sequence_lens`` (an empty one too), GRU's
``linear_before_reset`` 0 and 1, peepholes, ``clip``, ``layout=1``, other activations and
a symbolic sequence and batch bound to two sizes. Hidden sizes are small and no multiple
of 32 (the emulator runs one OS thread per CUDA thread: blocks stay at 128 threads)."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
from cuda_cases import HAVE_GXX, HAVE_NVRTC
from onnx import TensorProto, helper, numpy_helper

import egraft
from egraft.ir.interpreter import check_feeds, run_graph
from egraft.kernels.cuda import generate
from egraft.kernels.cuda.emit import Unsupported

RNG = np.random.default_rng(11)
GATES = {"LSTM": 4, "GRU": 3, "RNN": 1}
OUTPUTS = {"LSTM": ("Y", "Y_h", "Y_c"), "GRU": ("Y", "Y_h"), "RNN": ("Y", "Y_h")}


pytestmark = pytest.mark.skipif(not (HAVE_GXX or HAVE_NVRTC),
                                reason="needs g++ (the CUDA emulator) or CuPy's NVRTC (the compile checks)")
_COMPILER = ThreadPoolExecutor(1)  # NVRTC compiles while g++ builds the emulator's copy


def _f32(*shape, scale: float = 0.5) -> np.ndarray:
    return (RNG.normal(size=shape) * scale).astype(np.float32)


def _model(op: str, *, seq: int, batch: int, inputs: int, hidden: int, direction: str = "forward",
           bias: bool = True, lens: np.ndarray | None = None, initial: bool = False, peepholes: bool = False,
           outputs: tuple[bool, ...] | None = None, x_dims: list | None = None, layout: int = 0, **attrs):
    """A one-node ``op`` model and its feeds: ``X`` (and ``sequence_lens``, initial states) graph
    inputs, the weights initializers; ``outputs`` says which outputs exist."""
    num_dir = 2 if direction == "bidirectional" else 1
    gh = GATES[op] * hidden
    batch_major = (batch, seq) if layout else (seq, batch)
    state_shape = (batch, num_dir, hidden) if layout else (num_dir, batch, hidden)
    feeds = {"X": _f32(*batch_major, inputs, scale=1.0)}
    inits = {"W": _f32(num_dir, gh, inputs), "R": _f32(num_dir, gh, hidden)}
    if bias:
        inits["B"] = _f32(num_dir, 2 * gh)
    if lens is not None:
        feeds["sequence_lens"] = lens.astype(np.int32)
    if initial:
        feeds["initial_h"] = _f32(*state_shape, scale=1.0)
        if op == "LSTM":
            feeds["initial_c"] = _f32(*state_shape, scale=1.0)
    if peepholes:
        inits["P"] = _f32(num_dir, 3 * hidden)
    slots = ["X", "W", "R", "B", "sequence_lens", "initial_h", "initial_c", "P"][:8 if op == "LSTM" else 6]
    names = [s if s in feeds or s in inits else "" for s in slots]
    while names[-1] == "":
        names.pop()
    outs = [name if keep else "" for name, keep in zip(OUTPUTS[op], outputs or (True,) * len(OUTPUTS[op]))]
    node = helper.make_node(op, names, outs, hidden_size=hidden, direction=direction, layout=layout, **attrs)
    graph_inputs = [helper.make_tensor_value_info(k, TensorProto.INT32 if k == "sequence_lens" else TensorProto.FLOAT,
                                                  x_dims if k == "X" and x_dims else list(v.shape))
                    for k, v in feeds.items()]
    graph = helper.make_graph([node], "g", graph_inputs,
                              [helper.make_tensor_value_info(o, TensorProto.FLOAT, None) for o in outs if o],
                              [numpy_helper.from_array(v, k) for k, v in inits.items()])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    return model, feeds


def _compile_checked(source: str) -> dict:
    from egraft.kernels.cuda.nvrtc import compile_source

    module = compile_source(source, "sm_90", use_cache=False)
    for name, resources in module.resources.items():
        assert resources.spill_stores == resources.spill_loads == 0, (name, resources)
        assert resources.shared_bytes <= 48 * 1024, (name, resources)
    return module.resources


def _emulate(kernel, graph, feeds: dict) -> dict[str, np.ndarray]:
    """The node's present outputs by name, run in the emulator (``emulate_node`` expects every
    output slot to exist; a recurrent node's absent outputs are ``None``)."""
    from egraft.ir.dims import evaluate_dim
    from egraft.testing.cuda_emulator import emulator

    node = graph.nodes[0]
    values, bindings = check_feeds(graph, feeds)
    arrays = {("in", i): np.ascontiguousarray(values[v.name]) for i, v in enumerate(node.inputs)
              if v is not None and v.name in values}
    arrays |= {("in", i): np.ascontiguousarray(graph.constants[v.const]) for i, v in enumerate(node.inputs)
               if v is not None and v.const is not None}
    out = {}
    for i, v in enumerate(node.outputs):
        if v is not None:
            shape = tuple(int(evaluate_dim(d, bindings)) for d in v.type.shape)
            out[v.name] = arrays[("out", i)] = np.full(shape, np.nan, np.float32)
    emulator().run(kernel, arrays, bindings)
    return out


def check(op: str, *, more: list[dict] = (), onnxruntime: bool = True, **config) -> dict:
    """Generate the kernel of ``_model(op, **config)``, compile it (no spills) and emulate it on
    its feeds and each of ``more`` (feeds of other sizes); returns the ptxas resources."""
    model, feeds = _model(op, **config)
    graph = egraft.load(model)
    kernel = generate(graph.nodes[0], graph, 17)
    assert [launch.function for launch in kernel.launches] == [f"eg_{op.lower()}"]
    assert kernel.launches[0].block[0] <= 128  # the emulator runs a thread per CUDA thread
    compiled = _COMPILER.submit(_compile_checked, kernel.source) if HAVE_NVRTC else None
    for run in [feeds, *more]:
        if not HAVE_GXX:
            break
        got = _emulate(kernel, graph, run)
        want = run_graph(graph, run)
        for name, value in got.items():
            assert value.shape == want[name].shape, name
            np.testing.assert_allclose(value, want[name], rtol=1e-4, atol=1e-5, err_msg=name)
        if onnxruntime and not config.get("layout"):  # onnxruntime has no batch-major recurrences
            from conftest import run_onnxruntime

            theirs = run_onnxruntime(model, run)
            for name, value in got.items():
                np.testing.assert_allclose(value, theirs[name], rtol=1e-4, atol=1e-5, err_msg=f"{name} (onnxruntime)")
    return compiled.result() if compiled is not None else {}


# ---- LSTM -------------------------------------------------------------------------------------
@pytest.mark.parametrize("direction", ["forward", "reverse", "bidirectional"])
def test_lstm_directions(direction):
    check("LSTM", seq=4, batch=2, inputs=5, hidden=20, direction=direction, initial=True)


def test_lstm_output_subsets_without_bias():
    check("LSTM", seq=3, batch=2, inputs=7, hidden=12, bias=False, outputs=(False, True, False))
    check("LSTM", seq=3, batch=1, inputs=3, hidden=9, direction="reverse", outputs=(True, False, True))


def test_lstm_sequence_lens():
    lens = np.array([5, 2, 3])
    check("LSTM", seq=5, batch=3, inputs=6, hidden=20, direction="bidirectional", lens=lens, initial=True)


def test_lstm_empty_sequence_peepholes_clip():
    """An empty sequence's final states are zero (as onnxruntime writes them); peepholes and
    ``clip`` enter every gate."""
    check("LSTM", seq=4, batch=3, inputs=4, hidden=10, direction="bidirectional", lens=np.array([4, 0, 2]),
          initial=True, peepholes=True, clip=0.7, onnxruntime=False)


def test_lstm_input_forget_layout_1():
    check("LSTM", seq=3, batch=2, inputs=5, hidden=11, layout=1, initial=True, input_forget=1, onnxruntime=False)


def test_lstm_symbolic_sequence_and_batch():
    """One kernel for every length: the time loop runs inside, seq and batch are parameters."""
    check("LSTM", seq=3, batch=2, inputs=5, hidden=18, direction="bidirectional", x_dims=["seq", "batch", 5],
          more=[{"X": _f32(7, 1, 5)}, {"X": _f32(1, 3, 5)}])


# ---- GRU, RNN ---------------------------------------------------------------------------------
@pytest.mark.parametrize("linear_before_reset", [0, 1])
def test_gru_bidirectional(linear_before_reset):
    check("GRU", seq=4, batch=2, inputs=6, hidden=19, direction="bidirectional", initial=True,
          linear_before_reset=linear_before_reset)


@pytest.mark.parametrize("linear_before_reset", [0, 1])
def test_gru_sequence_lens_layout_1(linear_before_reset):
    check("GRU", seq=4, batch=3, inputs=5, hidden=13, lens=np.array([2, 4, 1]), layout=1,
          linear_before_reset=linear_before_reset, outputs=(True, False))


def test_gru_activations():
    check("GRU", seq=3, batch=2, inputs=4, hidden=9, activations=["HardSigmoid", "LeakyRelu"],
          activation_alpha=[0.3, 0.05], activation_beta=[0.4], clip=2.0, onnxruntime=False)


def test_rnn():
    check("RNN", seq=5, batch=2, inputs=6, hidden=21, direction="reverse", initial=True)
    check("RNN", seq=3, batch=2, inputs=4, hidden=8, direction="bidirectional", activations=["Relu", "Tanh"],
          lens=np.array([3, 2]), outputs=(False, True), onnxruntime=False)


# ---- sizes and refusals -----------------------------------------------------------------------
@pytest.mark.skipif(not HAVE_NVRTC, reason="needs CuPy's NVRTC")
@pytest.mark.parametrize("op, hidden", [("LSTM", 512), ("GRU", 1024)])
def test_large_hidden_compiles_without_spills(op, hidden):
    """A large layer (512 threads, several units per lane group) keeps to registers."""
    model, _ = _model(op, seq=2, batch=1, inputs=256, hidden=hidden, direction="bidirectional")
    graph = egraft.load(model)
    kernel = generate(graph.nodes[0], graph, 17)
    assert kernel.launches[0].block == (512, 1, 1)
    _compile_checked(kernel.source)


def test_refuses_float64():
    model, _ = _model("RNN", seq=2, batch=1, inputs=3, hidden=4)
    for v in model.graph.input:
        v.type.tensor_type.elem_type = TensorProto.DOUBLE
    for t in model.graph.initializer:
        t.CopyFrom(numpy_helper.from_array(numpy_helper.to_array(t).astype(np.float64), t.name))
    graph = egraft.load(model)
    with pytest.raises(Unsupported):
        generate(graph.nodes[0], graph, 17)

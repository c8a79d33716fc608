"""RNN, GRU, LSTM and DynamicQuantizeLSTM as generated kernels (egraft/kernels/cpu/rnn.py):
every node is a kernel step, not a fallback, and one build over symbolic ``seq`` and
``batch`` matches onnxruntime at several sizes, for each op with every direction, both
layouts, ``sequence_lens`` (an empty sequence included), initial states, ``clip``, LSTM
peepholes and ``input_forget``, GRU ``linear_before_reset`` and non-default activations
with their alphas and betas.

onnxruntime runs no ``layout=1`` layer, so a batch-major model is checked against
onnxruntime on its sequence-major twin, inputs and outputs transposed.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field, replace

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from conftest import SATURATING_REFERENCE, onnxruntime_saturates_integer_products, reference_options
from onnx import TensorProto, helper, numpy_helper

import egraft

GATES = {"RNN": 1, "GRU": 3, "LSTM": 4}
INPUT, HIDDEN = 6, 5
SIZES = [(1, 1), (5, 3), (9, 2), (4, 6)]  # (seq, batch), all from one build (batch 6: 4 entries per pass and 2)


@dataclass(frozen=True)
class Case:
    """One recurrent node: the op and what it uses."""

    op: str
    direction: str = "forward"
    layout: int = 0
    lens: bool = False
    initial: bool = False
    peepholes: bool = False
    outputs: tuple[str, ...] = ("y", "y_h", "y_c")
    attrs: dict = field(default_factory=dict)
    dtype: type = np.float32

    @property
    def num_dir(self) -> int:
        return 2 if self.direction == "bidirectional" else 1

    @property
    def label(self) -> str:
        parts = [self.op, self.direction, f"layout{self.layout}"]
        parts += [name for name in ("lens", "initial", "peepholes") if getattr(self, name)]
        parts += sorted(self.attrs) + ([] if self.dtype == np.float32 else ["float64"])
        parts += [] if self.outputs == ("y", "y_h", "y_c") else ["outputs=" + "+".join(o for o in self.outputs if o)]
        return "-".join(parts)


CASES = [
    Case("RNN"),
    Case("RNN", "reverse", layout=1, lens=True, initial=True, attrs={"clip": 0.6}),
    Case("RNN", "bidirectional", lens=True, attrs={"activations": ["Affine", "ScaledTanh"],
                                                   "activation_alpha": [0.7, 1.3], "activation_beta": [0.2, 0.8]}),
    Case("RNN", "bidirectional", layout=1, initial=True, attrs={"activations": ["Relu", "LeakyRelu"]}),
    Case("GRU"),
    Case("GRU", "reverse", layout=1, lens=True, initial=True, attrs={"linear_before_reset": 1}),
    Case("GRU", "bidirectional", lens=True, initial=True),
    Case("GRU", "bidirectional", layout=1, attrs={
        "linear_before_reset": 1, "clip": 0.9,
        "activations": ["HardSigmoid", "Softsign", "Sigmoid", "Softplus"], "activation_alpha": [0.3],
        "activation_beta": [0.4]}),
    Case("GRU", "forward", initial=True, outputs=("", "y_h"), attrs={"activations": ["Sigmoid", "Elu"]}),
    Case("LSTM", "bidirectional", lens=True, initial=True, peepholes=True, dtype=np.float64),
    Case("LSTM"),
    Case("LSTM", "reverse", lens=True, initial=True, peepholes=True),
    Case("LSTM", "bidirectional", layout=1, initial=True, peepholes=True, attrs={"clip": 0.8}),
    Case("LSTM", "bidirectional", lens=True, attrs={
        "activations": ["HardSigmoid", "Elu", "Softsign", "Sigmoid", "ThresholdedRelu", "Tanh"],
        "activation_alpha": [0.25, 0.9, 0.1], "activation_beta": [0.45]}),
    Case("LSTM", "forward", layout=1, lens=True, initial=True, outputs=("y", "", "y_c"), attrs={"input_forget": 1}),
]


def build(case: Case) -> onnx.ModelProto:
    """The one-node model of ``case``: ``x`` is ``[seq, batch, INPUT]`` (``[batch, seq, INPUT]``
    with layout 1), weights random constants."""
    twin = replace(case, layout=0, dtype=np.float32)  # the layout-0 and float32 twins have the same weights
    rng = np.random.default_rng(sum(map(ord, twin.label)))
    elem = helper.np_dtype_to_tensor_dtype(np.dtype(case.dtype))
    g, nd = GATES[case.op], case.num_dir
    # float32 values whatever the dtype: a float64 layer is checked against its float32 twin
    weight = lambda *shape: rng.normal(0, 0.5, shape).astype(np.float32).astype(case.dtype)  # noqa: E731
    inits = {"W": weight(nd, g * HIDDEN, INPUT), "R": weight(nd, g * HIDDEN, HIDDEN), "B": weight(nd, 2 * g * HIDDEN)}
    batch_major = case.layout == 1
    graph_inputs = [helper.make_tensor_value_info("x", elem, ["batch", "seq", INPUT] if batch_major
                                                  else ["seq", "batch", INPUT])]
    inputs = ["x", "W", "R", "B", "", "", ""]
    if case.lens:
        inputs[4] = "lens"
        graph_inputs.append(helper.make_tensor_value_info("lens", TensorProto.INT32, ["batch"]))
    state = ["batch", nd, HIDDEN] if batch_major else [nd, "batch", HIDDEN]
    if case.initial:
        inputs[5] = "h0"
        graph_inputs.append(helper.make_tensor_value_info("h0", elem, state))
        if case.op == "LSTM":
            inputs[6] = "c0"
            graph_inputs.append(helper.make_tensor_value_info("c0", elem, state))
    if case.peepholes:
        inits["P"] = weight(nd, 3 * HIDDEN)
        inputs.append("P")
    while inputs[-1] == "":
        inputs.pop()
    outputs = list(case.outputs[:3 if case.op == "LSTM" else 2])
    node = helper.make_node(case.op, inputs, outputs, hidden_size=HIDDEN, direction=case.direction,
                            layout=case.layout, **case.attrs)
    graph = helper.make_graph([node], case.label, graph_inputs,
                              [helper.make_tensor_value_info(o, elem, None) for o in outputs if o],
                              [numpy_helper.from_array(a, n) for n, a in inits.items()])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def feeds_for(case: Case, seq: int, batch: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seq * 10 + batch)
    x_shape = (batch, seq, INPUT) if case.layout else (seq, batch, INPUT)
    feeds = {"x": rng.normal(0, 1, x_shape).astype(np.float32).astype(case.dtype)}
    if case.lens:
        lens = rng.integers(0, seq + 1, batch)
        lens[0] = seq
        if batch > 1:
            lens[1] = 0  # an empty sequence: Y zero, final states zero
        feeds["lens"] = lens.astype(np.int32)
    if case.initial:
        state = (batch, case.num_dir, HIDDEN) if case.layout else (case.num_dir, batch, HIDDEN)
        feeds["h0"] = rng.normal(0, 1, state).astype(np.float32).astype(case.dtype)
        if case.op == "LSTM":
            feeds["c0"] = rng.normal(0, 1, state).astype(np.float32).astype(case.dtype)
    return feeds


def onnxruntime_outputs(case: Case, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """onnxruntime's outputs; a layout-1 case runs as its layout-0 twin, a float64 one (which
    onnxruntime does not run) as its float32 twin, its outputs cast back."""
    twin = replace(case, layout=0, dtype=np.float32)
    feeds = {k: v.astype(np.float32) if v.dtype == np.float64 else v for k, v in feeds.items()}
    session = ort.InferenceSession(build(twin).SerializeToString(), reference_options(),
                                   providers=["CPUExecutionProvider"])
    if case.layout:
        feeds = {k: v if k == "lens" else np.swapaxes(v, 0, 1) for k, v in feeds.items()}
    names = [o for o in case.outputs[:3 if case.op == "LSTM" else 2] if o]
    out = dict(zip(names, session.run(names, feeds)))
    if case.layout:  # Y: [seq, dir, batch, hidden] -> [batch, seq, dir, hidden]; states swap their first axes
        out = {k: v.transpose(2, 0, 1, 3) if k == "y" else np.swapaxes(v, 0, 1) for k, v in out.items()}
    return {k: v.astype(case.dtype) for k, v in out.items()}


@pytest.fixture(scope="module", params=CASES, ids=lambda c: c.label)
def compiled_case(request):
    case = request.param
    return case, egraft.compile(build(case).SerializeToString(), use_cache=False)


def test_the_layer_is_a_kernel_and_matches_onnxruntime_at_every_size(compiled_case):
    case, compiled = compiled_case
    assert compiled.report({"seq": 4, "batch": 2}).fallbacks == []
    assert [s.kind for s in compiled.steps if s.node.op == case.op] == ["kernel"]
    tolerance = 1e-5 if case.dtype == np.float64 else 2e-6  # float64 against float32
    for seq, batch in SIZES:
        feeds = feeds_for(case, seq, batch)
        got, want = compiled.run(feeds), onnxruntime_outputs(case, feeds)
        assert set(got) == set(want)
        for name, value in want.items():
            assert got[name].shape == value.shape, (name, seq, batch)
            assert got[name].dtype == value.dtype
            np.testing.assert_allclose(got[name], value, rtol=tolerance, atol=tolerance,
                                       err_msg=f"{name} at seq={seq}, batch={batch}")


@pytest.mark.parametrize("case", [Case("GRU", "bidirectional", lens=True, initial=True,
                                       attrs={"linear_before_reset": 1}),
                                  Case("LSTM", "bidirectional", layout=1, lens=True, peepholes=True)],
                         ids=lambda c: c.label)
@pytest.mark.parametrize("threads", [1, 2, 3])
def test_a_bidirectional_layer_splits_its_directions_over_threads(monkeypatch, case, threads):
    """Big enough to be split, each direction runs on its own part (a third part has none)."""
    from egraft.lowering.runtime import MIN_PARALLEL_WORK

    module = sys.modules[__name__]
    monkeypatch.setattr(module, "INPUT", 48)
    monkeypatch.setattr(module, "HIDDEN", 40)
    compiled = egraft.compile(build(case).SerializeToString(), use_cache=False)
    compiled.threads = threads
    seq, batch = 96, 3
    assert max(compiled.parallel_work({"seq": seq, "batch": batch}).values()) >= MIN_PARALLEL_WORK
    feeds = feeds_for(case, seq, batch)
    got, want = compiled.run(feeds), onnxruntime_outputs(case, feeds)
    for name, value in want.items():
        np.testing.assert_allclose(got[name], value, rtol=1e-5, atol=1e-5, err_msg=name)


def test_computed_weights_fall_back_with_the_reason():
    """A layer whose W is computed at run time is left to the reference kernel, and the
    report says why."""
    case = Case("GRU")
    model = build(case)
    w = next(i for i in model.graph.initializer if i.name == "W")
    model.graph.initializer.remove(w)
    model.graph.input.append(helper.make_tensor_value_info("W", TensorProto.FLOAT, list(w.dims)))
    compiled = egraft.compile(model.SerializeToString(), use_cache=False)
    reasons = [reason for *_, reason in compiled.report({"seq": 3, "batch": 1}).fallbacks]
    assert len(reasons) == 1 and "constant weights only" in reasons[0], reasons
    feeds = feeds_for(case, 3, 1) | {"W": numpy_helper.to_array(w)}
    want = ort.InferenceSession(model.SerializeToString(), reference_options(),
                                providers=["CPUExecutionProvider"]).run(["y"], feeds)[0]
    np.testing.assert_allclose(compiled.run(feeds)["y"], want, rtol=2e-6, atol=2e-6)


@pytest.mark.parametrize("per_column", [False, True])
def test_dynamic_quantize_lstm_is_a_kernel_and_matches_onnxruntime(per_column):
    """com.microsoft DynamicQuantizeLSTM, bidirectional with initial states, over symbolic
    seq and batch: X and each step's hidden state quantized as onnxruntime does (its
    single-threaded session: with more threads it quantizes chunks of the batch apart)."""
    if onnxruntime_saturates_integer_products():
        pytest.skip(SATURATING_REFERENCE)
    from egraft.testing.corpus.compare import judge_session

    rng = np.random.default_rng(3 + per_column)
    hidden, inputs, nd = 8, 12, 2
    scale_shape = (nd, 4 * hidden) if per_column else (nd,)
    arrays = {"W": rng.integers(-127, 128, (nd, inputs, 4 * hidden)).astype(np.int8),
              "R": rng.integers(-127, 128, (nd, hidden, 4 * hidden)).astype(np.int8),
              "B": rng.normal(size=(nd, 8 * hidden)).astype(np.float32),
              "ws": rng.uniform(0.001, 0.01, scale_shape).astype(np.float32),
              "wz": np.zeros(scale_shape, np.int8),
              "rs": rng.uniform(0.001, 0.01, scale_shape).astype(np.float32),
              "rz": np.zeros(scale_shape, np.int8)}
    node = helper.make_node("DynamicQuantizeLSTM", ["x", "W", "R", "B", "", "h0", "c0", "", "ws", "wz", "rs", "rz"],
                            ["y", "y_h", "y_c"], domain="com.microsoft", hidden_size=hidden, direction="bidirectional")
    graph_inputs = [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["seq", "batch", inputs])]
    graph_inputs += [helper.make_tensor_value_info(n, TensorProto.FLOAT, [nd, "batch", hidden]) for n in ("h0", "c0")]
    model = helper.make_model(helper.make_graph(
        [node], "dq_lstm", graph_inputs, [helper.make_tensor_value_info(n, TensorProto.FLOAT, None)
                                          for n in ("y", "y_h", "y_c")],
        [numpy_helper.from_array(a, n) for n, a in arrays.items()]),
        opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)])
    compiled = egraft.compile(model.SerializeToString(), use_cache=False)
    assert compiled.report({"seq": 4, "batch": 2}).fallbacks == []
    assert [s.kind for s in compiled.steps if s.node.op == "DynamicQuantizeLSTM"] == ["kernel"]
    session = judge_session(model)
    for seq, batch in SIZES:
        feeds = {"x": rng.normal(size=(seq, batch, inputs)).astype(np.float32),
                 "h0": rng.normal(size=(nd, batch, hidden)).astype(np.float32),
                 "c0": rng.normal(size=(nd, batch, hidden)).astype(np.float32)}
        want = dict(zip(["y", "y_h", "y_c"], session.run(["y", "y_h", "y_c"], feeds)))
        got = compiled.run(feeds)
        # the first step of each direction quantizes the same floats as onnxruntime
        np.testing.assert_allclose(got["y"][0, 0], want["y"][0, 0], rtol=0, atol=1e-5)
        np.testing.assert_allclose(got["y"][-1, 1], want["y"][-1, 1], rtol=0, atol=1e-5)
        # later steps quantize states computed with other tanh/sigmoid roundings: a value
        # on a rounding edge may move one quantum (1/255 of the state's range)
        for name, value in want.items():
            assert got[name].shape == value.shape
            assert np.abs(got[name] - value).max() <= 1e-2 * np.abs(value).max(), name


# The integer product forms of DynamicQuantizeLSTM (the host picks one; see test_quant_kernels).
DQ_FORMS = {"vpdpbusd": ("llvm.x86.avx512.vpdpbusd.512", 16, 8, 4, "+avx512vnni"),
            "avx512bw": ("llvm.x86.avx512.pmaddw.d.512", 16, 8, 2, "+avx512bw"),
            "avx2": ("llvm.x86.avx2.pmadd.wd", 8, 4, 2, "+avx2"),
            "generic": ("", 4, 4, 2, None)}


def _dq_lstm_model(rng, inputs: int, hidden: int, direction: str, w_dtype, per_column: bool, zero_points: bool,
                   lens: bool) -> onnx.ModelProto:
    """A DynamicQuantizeLSTM over symbolic seq and batch with initial states, int8 or uint8
    weights, scales and zero points per direction or per column."""
    nd = 2 if direction == "bidirectional" else 1
    info = np.iinfo(w_dtype)
    scale_shape = (nd, 4 * hidden) if per_column else (nd,)
    ints = lambda shape: rng.integers(info.min, int(info.max) + 1, shape).astype(w_dtype)  # noqa: E731
    zero = (lambda: ints(scale_shape)) if zero_points else (lambda: np.zeros(scale_shape, w_dtype))  # noqa: E731
    arrays = {"W": ints((nd, inputs, 4 * hidden)), "R": ints((nd, hidden, 4 * hidden)),
              "B": rng.normal(size=(nd, 8 * hidden)).astype(np.float32),
              "ws": rng.uniform(0.001, 0.01, scale_shape).astype(np.float32), "wz": zero(),
              "rs": rng.uniform(0.001, 0.01, scale_shape).astype(np.float32), "rz": zero()}
    node = helper.make_node("DynamicQuantizeLSTM", ["x", "W", "R", "B", "lens" if lens else "", "h0", "c0", "",
                                                    "ws", "wz", "rs", "rz"],
                            ["y", "y_h", "y_c"], domain="com.microsoft", hidden_size=hidden, direction=direction)
    graph_inputs = [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["seq", "batch", inputs])]
    graph_inputs += [helper.make_tensor_value_info(n, TensorProto.FLOAT, [nd, "batch", hidden]) for n in ("h0", "c0")]
    if lens:
        graph_inputs.append(helper.make_tensor_value_info("lens", TensorProto.INT32, ["batch"]))
    return helper.make_model(helper.make_graph(
        [node], "dq_lstm", graph_inputs, [helper.make_tensor_value_info(n, TensorProto.FLOAT, None)
                                          for n in ("y", "y_h", "y_c")],
        [numpy_helper.from_array(a, n) for n, a in arrays.items()]),
        opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)])


@pytest.mark.parametrize("form", list(DQ_FORMS))
@pytest.mark.parametrize(("inputs", "hidden", "direction", "w_dtype", "per_column", "zero_points", "lens"), [
    (12, 8, "bidirectional", np.int8, True, True, False),  # 4H = 32: one AVX-512 panel
    (37, 13, "reverse", np.uint8, True, True, True),  # 4H = 52: a partial panel, an odd depth
    (20, 5, "forward", np.int8, False, True, True),  # 4H = 20: less than a panel
    (33, 40, "bidirectional", np.uint8, False, False, True),  # 4H = 160: five panels
], ids=["h8-bidir", "h13-reverse-u8", "h5-forward", "h40-bidir-u8"])
@pytest.mark.parametrize("threads", [1, 2])
def test_dynamic_quantize_lstm_integer_products_match_the_reference(monkeypatch, split_every_parallel_kernel, form,
                                                                     inputs, hidden, direction, w_dtype, per_column,
                                                                     zero_points, lens, threads):
    """The int8 LSTM's integer products in every form, with zero points (per direction or
    per column, int8 or uint8 weights), hidden sizes that leave part of a panel empty,
    batches over a tile of rows, ``sequence_lens`` and both directions, against the
    reference kernel (egraft/ir/ops/contrib.py). One step from given states quantizes the
    same floats as the reference: equal to float rounding; later steps quantize states
    computed with other tanh/sigmoid roundings, so a value may move by a quantum."""
    from egraft.kernels.cpu import quant
    from egraft.kernels.cpu.llvm import host_cpu

    intrinsic, lanes, rows, depth, needs = DQ_FORMS[form]
    triple, _, features = host_cpu()
    if (needs and needs not in features.split(",")) or (intrinsic and not triple.startswith("x86_64")):
        pytest.skip(f"the host cannot run {intrinsic}")
    monkeypatch.setattr(quant.PairProduct, "for_host", staticmethod(lambda: quant.PairProduct(intrinsic, lanes, rows,
                                                                                                 depth)))
    rng = np.random.default_rng(inputs * 100 + hidden)
    model = _dq_lstm_model(rng, inputs, hidden, direction, w_dtype, per_column, zero_points, lens)
    compiled = egraft.compile(model.SerializeToString(), use_cache=False)
    compiled.threads = threads
    assert compiled.report({"seq": 4, "batch": 2}).fallbacks == []
    reference = egraft.load(model)
    nd = 2 if direction == "bidirectional" else 1
    for seq, batch in [(1, 3), (1, 9), (6, 2), (5, 11)]:
        feeds = {"x": rng.normal(size=(seq, batch, inputs)).astype(np.float32),
                 "h0": rng.normal(size=(nd, batch, hidden)).astype(np.float32),
                 "c0": rng.normal(size=(nd, batch, hidden)).astype(np.float32)}
        if lens:
            feeds["lens"] = rng.integers(0, seq + 1, batch).astype(np.int32)
            feeds["lens"][0] = seq
        got, want = compiled.run(feeds), reference.run(feeds)
        for name, value in want.items():
            assert got[name].shape == value.shape, name
            if seq == 1:
                np.testing.assert_allclose(got[name], value, rtol=0, atol=2e-5, err_msg=f"{name} at batch={batch}")
            else:
                assert np.abs(got[name] - value).max() <= 1e-2 * max(np.abs(value).max(), 1), (name, seq, batch)

"""CUDA kernels of the normalizations, pools and reductions (egraft/kernels/cuda/normalize.py,
pool.py, reduce.py): each case is a one-node model whose kernel NVRTC compiles for sm_90
with no register spills, and whose emulated run (egraft.testing.cuda_emulator) matches
the registry's numpy semantics (run_graph) and, for standard ops, onnxruntime. The cases
reach every thread mapping: rows by a warp, a block in registers or a block looping; columns
by a thread or a 32 x 8 tile; several reduced groups; symbolic dims bound to two sizes."""

from __future__ import annotations

import shutil
from dataclasses import dataclass, field

import numpy as np
import onnx
import pytest
from conftest import run_onnxruntime
from onnx import TensorProto, helper, numpy_helper

import egraft
from egraft.ir.infer import node_opset
from egraft.ir.interpreter import run_graph
from egraft.kernels.cuda import generate
from egraft.kernels.cuda.emit import Unsupported

pytest.importorskip("cupy", reason="NVRTC (CuPy) compiles the kernels for sm_90")
pytestmark = pytest.mark.skipif(shutil.which("g++") is None, reason="the CUDA emulator needs g++")

RNG = np.random.default_rng(5)


@dataclass
class Case:
    """One node: ``op`` on x of ``shape`` (strings are symbolic dims, bound by each of
    ``bindings``), constant ``params`` (None: an omitted optional input), ``outputs`` outputs;
    ``block`` is the expected thread block of the first launch."""

    op: str
    shape: list
    attrs: dict = field(default_factory=dict)
    params: dict = field(default_factory=dict)
    bindings: list = field(default_factory=lambda: [{}])
    opset: int = 17
    domain: str = ""
    outputs: int = 1
    rtol: float = 1e-5
    atol: float = 1e-6
    scale: float = 1.0
    block: tuple | None = None
    onnxruntime: bool = True
    id: str = ""


def _model(case: Case) -> onnx.ModelProto:
    names = ["x"] + ["" if v is None else k for k, v in case.params.items()]
    outs = [f"y{i}" for i in range(case.outputs)]
    node = helper.make_node(case.op, names, outs, domain=case.domain, **case.attrs)
    inits = [numpy_helper.from_array(v, k) for k, v in case.params.items() if v is not None]
    out_type = TensorProto.INT64 if case.op in ("ArgMax", "ArgMin") else TensorProto.FLOAT
    graph = helper.make_graph([node], "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, case.shape)],
                              [helper.make_tensor_value_info(o, out_type, None) for o in outs], inits)
    opsets = [helper.make_opsetid("", case.opset)] + ([helper.make_opsetid(case.domain, 1)] if case.domain else [])
    return helper.make_model(graph, opset_imports=opsets)


def _compile_check(source: str) -> dict:
    from egraft.kernels.cuda.nvrtc import compile_source

    module = compile_source(source, "sm_90", use_cache=False)
    for name, r in module.resources.items():
        assert r.spill_stores == 0 and r.spill_loads == 0, f"{name} spills: {r}"
        assert r.shared_bytes <= 48 * 1024, f"{name}: {r.shared_bytes} bytes of static shared memory"
    return module.resources


def run_case(case: Case) -> None:
    """Generate, compile (no spills), emulate at each binding and compare with the references."""
    from egraft.testing.cuda_emulator import emulate_node

    model = _model(case)
    graph = egraft.load(model)
    node = graph.nodes[0]
    assert (node.op, len(graph.nodes)) == (case.op, 1)
    kernel = generate(node, graph, node_opset(graph, node))
    _compile_check(kernel.source)
    if case.block is not None:
        assert kernel.launches[0].block == case.block, kernel.launches[0].block
    for bindings in case.bindings:
        shape = [bindings[d] if isinstance(d, str) else d for d in case.shape]
        x = (RNG.standard_normal(shape) * case.scale).astype(np.float32)
        inputs = [x] + [graph.constants[v.const] if v is not None and v.const is not None else None
                        for v in node.inputs[1:]]
        got = emulate_node(node, graph, inputs, bindings)
        want = run_graph(graph, {"x": x})
        names = [v.name for v in graph.outputs]
        for name, g in zip(names, got):
            np.testing.assert_allclose(g, want[name], rtol=case.rtol, atol=case.atol, err_msg=f"{name} at {bindings}")
        if case.onnxruntime and not case.domain:
            ort = run_onnxruntime(model, {"x": x})
            for name, g in zip(names, got):
                np.testing.assert_allclose(g, ort[name], rtol=case.rtol, atol=case.atol,
                                           err_msg=f"{name} vs onnxruntime at {bindings}")


def _f(*shape, low: float = -1.0, high: float = 1.0) -> np.ndarray:
    return RNG.uniform(low, high, shape).astype(np.float32)


def _ids(cases: list[Case]) -> list[str]:
    return [c.id or f"{c.op}-{c.shape}" for c in cases]


# ---- Softmax, LogSoftmax ------------------------------------------------------------------------
SOFTMAX = [
    Case("Softmax", [3, 5], {"axis": -1}, opset=13, block=(128, 1, 1), scale=4, id="warp rows shorter than a warp"),
    Case("LogSoftmax", [5, 200], {"axis": 1}, opset=13, block=(128, 1, 1), scale=4, id="warp rows, 7 values a lane"),
    Case("Softmax", [2, 1100], opset=13, block=(256, 1, 1), scale=4, id="block rows in registers"),
    Case("LogSoftmax", [2, 5000], opset=13, block=(256, 1, 1), scale=4, id="rows longer than the registers"),
    Case("Softmax", ["b", "s"], opset=13, bindings=[{"b": 2, "s": 300}, {"b": 3, "s": 7}], scale=4,
         id="symbolic rows, two sizes"),
    Case("Softmax", [2, 7, 3, 2], {"axis": 1}, opset=13, scale=4, id="middle axis"),
    Case("LogSoftmax", [3, 2, "w"], {"axis": 0}, opset=13, bindings=[{"w": 5}, {"w": 33}], scale=4,
         id="first axis, symbolic inner"),
    Case("LogSoftmax", [2, 3, 4], opset=11, scale=4, id="opset 11: coerced to 2-D at the default axis 1"),
]


@pytest.mark.parametrize("case", SOFTMAX, ids=_ids(SOFTMAX))
def test_softmax(case):
    run_case(case)


def test_softmax_of_infinities_matches_numpy():
    """-inf entries weigh 0; a row of only -inf is NaN, as numpy gives (exp(-inf - -inf))."""
    from egraft.testing.cuda_emulator import emulate_node

    for case in (Case("Softmax", [3, 40], opset=13), Case("Softmax", ["b", "s"], opset=13)):
        graph = egraft.load(_model(case))
        x = _f(3, 40)
        x[0, ::2] = -np.inf
        x[1, :] = -np.inf
        x[2, 5] = np.inf
        with np.errstate(invalid="ignore"):
            want = run_graph(graph, {"x": x})["y0"]
        got, = emulate_node(graph.nodes[0], graph, [x], {"b": 3, "s": 40})
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


# ---- LayerNormalization, LayerNorm, InstanceNormalization ------------------------------------------
LAYER_NORM = [
    Case("LayerNormalization", [5, 24], {"epsilon": 1e-3}, {"scale": _f(24), "bias": _f(24)}, outputs=3,
         block=(128, 1, 1), id="warp rows with Mean and InvStdDev"),
    Case("LayerNormalization", ["batch", "seq", 768], {}, {"scale": _f(768), "bias": _f(768)},
         bindings=[{"batch": 2, "seq": 3}, {"batch": 1, "seq": 1}], block=(128, 1, 1), scale=3,
         id="[batch, seq, 768] in registers"),
    Case("LayerNormalization", [2, "h"], {}, {"scale": _f(1)}, bindings=[{"h": 37}, {"h": 600}],
         block=(256, 1, 1), id="symbolic row length, no bias"),
    Case("LayerNormalization", [2, 3, 4, 50], {"axis": 1}, {"scale": _f(4, 1), "bias": _f(50)},
         id="axis 1, broadcast scale and bias"),
    Case("LayerNormalization", [3, 2000], {}, {"scale": _f(2000), "bias": _f(2000)}, scale=5, rtol=1e-4,
         id="block rows of 2000"),
    Case("LayerNorm", ["n", 40], {"axis": -1, "epsilon": 1e-6}, {"scale": _f(40)}, domain="com.egraft",
         bindings=[{"n": 9}], id="com.egraft LayerNorm"),
    Case("LayerNorm", [2, 3, 5000], {"axis": 1}, {"scale": _f(3, 5000), "bias": _f(3, 5000)}, domain="com.egraft",
         scale=2, rtol=1e-4, atol=1e-5, id="com.egraft LayerNorm over 15000"),
    Case("InstanceNormalization", [2, 3, 5, 7], {"epsilon": 1e-4}, {"scale": _f(3), "bias": _f(3)},
         id="instance norm, warp planes"),
    Case("InstanceNormalization", [1, 2, "h", "w"], {}, {"scale": _f(2), "bias": _f(2)},
         bindings=[{"h": 9, "w": 11}, {"h": 30, "w": 20}], id="instance norm, symbolic planes"),
]


@pytest.mark.parametrize("case", LAYER_NORM, ids=_ids(LAYER_NORM))
def test_layer_and_instance_norm(case):
    run_case(case)


# ---- BatchNormalization, LRN ----------------------------------------------------------------------
def _bn_params(c: int) -> dict:
    return {"scale": _f(c), "B": _f(c), "mean": _f(c), "var": _f(c, low=0.1, high=2.0)}


PER_CHANNEL = [
    Case("BatchNormalization", [3, 5, 4, 6], {"epsilon": 1e-3}, _bn_params(5), opset=15, id="BN, element threads"),
    Case("BatchNormalization", [2, 3], {}, _bn_params(3), opset=15, id="BN rank 2"),
    Case("BatchNormalization", ["n", 4, "h", "w"], {}, _bn_params(4), opset=9,
         bindings=[{"n": 2, "h": 30, "w": 40}, {"n": 1, "h": 3, "w": 5}], id="BN symbolic, plane blocks"),
    Case("LRN", [2, 7, 5, 5], {"size": 3, "alpha": 1e-3, "beta": 0.75, "bias": 2.0}, id="LRN size 3", scale=3),
    Case("LRN", [1, 9, "h", "w"], {"size": 5, "alpha": 1e-4, "beta": 0.75, "bias": 1.0},
         bindings=[{"h": 16, "w": 17}, {"h": 3, "w": 3}], scale=10, id="LRN size 5, symbolic"),
    Case("LRN", [2, 6, 4], {"size": 4}, scale=10, onnxruntime=False, id="LRN even size, 1-D (not in onnxruntime)"),
]


@pytest.mark.parametrize("case", PER_CHANNEL, ids=_ids(PER_CHANNEL))
def test_batch_norm_and_lrn(case):
    run_case(case)


# ---- pools ----------------------------------------------------------------------------------------
POOLS = [
    Case("MaxPool", [2, 3, 9, 9], {"kernel_shape": [3, 3], "strides": [2, 2], "pads": [1, 1, 1, 1]},
         id="max 3x3 s2 p1"),
    Case("MaxPool", [1, 2, 10, 11], {"kernel_shape": [3, 2], "strides": [2, 3], "dilations": [2, 1],
                                     "pads": [1, 0, 2, 1], "ceil_mode": 1}, id="max ceil_mode, dilations"),
    Case("MaxPool", ["n", 3, "h", "w"], {"kernel_shape": [3, 3], "strides": [2, 2], "auto_pad": "SAME_UPPER"},
         bindings=[{"n": 1, "h": 12, "w": 9}, {"n": 2, "h": 7, "w": 16}], id="max SAME_UPPER symbolic"),
    Case("MaxPool", [2, 3, 17], {"kernel_shape": [4], "strides": [3], "pads": [1, 2]}, id="max 1-D"),
    Case("AveragePool", [2, 3, 9, 9], {"kernel_shape": [3, 3], "strides": [2, 2], "pads": [1, 1, 1, 1],
                                       "count_include_pad": 1}, id="avg count_include_pad"),
    Case("AveragePool", [1, 3, 10, 11], {"kernel_shape": [3, 3], "strides": [2, 2], "pads": [1, 0, 1, 1],
                                         "ceil_mode": 1}, id="avg ceil_mode, pads excluded"),
    Case("AveragePool", [1, 2, 10, 11], {"kernel_shape": [3, 3], "strides": [2, 2], "pads": [1, 1, 0, 1],
                                         "ceil_mode": 1, "count_include_pad": 1}, opset=19,
         id="avg ceil_mode, pads included"),
    Case("AveragePool", [1, 2, "h", "w"], {"kernel_shape": [2, 3], "auto_pad": "SAME_LOWER"},
         bindings=[{"h": 8, "w": 7}, {"h": 5, "w": 13}], id="avg SAME_LOWER symbolic"),
    Case("AveragePool", [1, 2, 5, 6, 7], {"kernel_shape": [2, 3, 2], "strides": [1, 2, 2], "pads": [0, 1, 1, 1, 1, 0]},
         id="avg 3-D"),
    Case("GlobalAveragePool", [2, 5, 7, 7], block=(256, 1, 1), id="global avg, warp planes"),
    Case("GlobalMaxPool", [1, 3, 40, 41], block=(256, 1, 1), id="global max, block planes"),
    Case("GlobalAveragePool", ["n", 6, "h", "w"], bindings=[{"n": 2, "h": 5, "w": 9}, {"n": 1, "h": 33, "w": 31}],
         id="global avg symbolic"),
]


@pytest.mark.parametrize("case", POOLS, ids=_ids(POOLS))
def test_pools(case):
    run_case(case)


# ---- reductions ---------------------------------------------------------------------------------
def _axes(*axes: int) -> dict:
    return {"axes": np.array(axes, np.int64)}


REDUCE = [
    Case("ReduceSum", [3, 5, 7], {"keepdims": 0}, _axes(1), opset=18, id="sum middle axis, thread columns"),
    Case("ReduceMean", [3, 40, 37], {}, _axes(-2), opset=18, block=(32, 8, 1), id="mean middle axis, column tiles"),
    Case("ReduceMax", [600, 6], {"keepdims": 0}, _axes(0), opset=18, id="max first axis, long columns"),
    Case("ReduceMin", [7, 100], {}, _axes(1), opset=18, block=(256, 1, 1), id="min rows by warps"),
    Case("ReduceProd", [3, 9], {}, _axes(1), opset=18, id="prod short rows by threads"),
    Case("ReduceSumSquare", [4, 3000], {"keepdims": 0}, _axes(-1), opset=18, rtol=1e-4, id="sum square block rows"),
    Case("ReduceL2", [3, 4, 5, 6], {"keepdims": 0}, _axes(0, 2), opset=18, id="L2 over two separate axes"),
    Case("ReduceL1", [2, 3, 4, 5], {}, _axes(1, 2), opset=18, id="L1 over two neighbouring axes"),
    Case("ReduceLogSum", [2, 1, 30], {}, _axes(1, 2), opset=18, id="log sum, a size-1 axis"),
    Case("ReduceMean", [4, 6, 5], {"axes": [0, 2], "keepdims": 0}, opset=17, id="mean axes attribute (opset 17)"),
    Case("ReduceSum", [4, 6, 5], {}, {}, opset=13, id="sum of all (no axes)"),
    Case("ReduceSum", [4, 6], {"noop_with_empty_axes": 1}, {}, opset=13, id="noop with empty axes"),
    Case("ReduceMean", ["b", "s", 16], {"keepdims": 0}, _axes(1), opset=18,
         bindings=[{"b": 2, "s": 70}, {"b": 3, "s": 5}], id="mean over symbolic seq"),
    Case("ReduceSum", ["b", "s"], {}, _axes(1), opset=18, bindings=[{"b": 20, "s": 9}, {"b": 13, "s": 40}],
         block=(256, 1, 1), id="sum symbolic rows by warps"),
    Case("ReduceMax", [3, "s"], {"keepdims": 0}, _axes(-1), opset=18, bindings=[{"s": 1000}, {"s": 3}],
         id="max symbolic rows by blocks"),
    Case("ArgMax", [4, 50], {"axis": 1}, opset=13, id="argmax rows by warps"),
    Case("ArgMin", [3, 7, 5], {"axis": 1, "keepdims": 0}, opset=13, id="argmin middle axis"),
    Case("ArgMax", [5, "s"], {"axis": -1, "select_last_index": 1}, opset=13, bindings=[{"s": 60}],
         id="argmax last index, symbolic"),
]


@pytest.mark.parametrize("case", REDUCE, ids=_ids(REDUCE))
def test_reductions(case):
    if case.op.startswith("Arg"):
        case.scale = 0  # ties everywhere: the index rule decides
        run_case(case)
        case.scale = 1
    run_case(case)


def test_argmax_ties_and_nan_follow_numpy():
    """First (or last) index among equal values; a NaN wins, as np.argmax has it."""
    from egraft.testing.cuda_emulator import emulate_node

    for last in (0, 1):
        case = Case("ArgMax", [4, 50], {"axis": 1, "select_last_index": last}, opset=13)
        graph = egraft.load(_model(case))
        x = np.round(_f(4, 50) * 2).astype(np.float32)
        x[1, 7] = x[1, 30] = np.nan
        got, = emulate_node(graph.nodes[0], graph, [x])
        np.testing.assert_array_equal(got, run_graph(graph, {"x": x})["y0"])


# ---- what is refused ----------------------------------------------------------------------------
def test_refusals_are_unsupported():
    refused = [
        Case("MaxPool", [1, 1, 4, 4], {"kernel_shape": [2, 2]}, outputs=2),
        Case("BatchNormalization", [2, 3, 4], {"training_mode": 1}, _bn_params(3), opset=15, outputs=3),
        Case("LayerNormalization", [2, 4], {"stash_type": 1}, {"scale": _f(4)}, outputs=2),
    ]
    for case in refused:
        graph = egraft.load(_model(case))
        with pytest.raises(Unsupported):
            generate(graph.nodes[0], graph, node_opset(graph, graph.nodes[0]))
    # Axes computed at run time.
    node = helper.make_node("ReduceSum", ["x", "axes"], ["y"])
    graph = helper.make_graph([node], "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3]),
                                            helper.make_tensor_value_info("axes", TensorProto.INT64, [1])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)])
    loaded = egraft.load(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)]))
    with pytest.raises(Unsupported):
        generate(loaded.nodes[0], loaded, 18)
    # Other element types.
    node = helper.make_node("Softmax", ["x"], ["y"])
    graph = helper.make_graph([node], "g", [helper.make_tensor_value_info("x", TensorProto.DOUBLE, [2, 3])],
                              [helper.make_tensor_value_info("y", TensorProto.DOUBLE, None)])
    loaded = egraft.load(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]))
    with pytest.raises(Unsupported):
        generate(loaded.nodes[0], loaded, 17)

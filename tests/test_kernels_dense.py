"""Generated dense kernels (egraft/kernels/cpu/gemm.py, reduce.py) against onnxruntime:
MatMul (1-D, batched, broadcast, symbolic batch), Gemm (transposes, alpha/beta, C
broadcasting), the Reduce* ops, Softmax/LogSoftmax (opsets 11 and 13), LayerNormalization,
BatchNormalization, and egraft's fused FusedGemm, FusedMatMul, LayerNorm, Gelu and
Attention against the equivalent standard-ONNX models."""

from __future__ import annotations

import math

import numpy as np
import onnx
import pytest
from conftest import check_compiled, run_onnxruntime
from onnx import TensorProto, helper, numpy_helper

import egraft
from egraft.ir.graph import Graph, Node, Value
from egraft.ir.ops.fused import ACTIVATIONS
from egraft.ir.types import DType, TensorType
from egraft.kernels.cpu.reduce import axis_runs
from egraft.lowering.compile import compile_graph
from egraft.testing.models import scale_relative_error

RNG = np.random.default_rng(11)


def _f32(*shape) -> np.ndarray:
    return RNG.normal(size=shape).astype(np.float32)


def _model(op: str, inputs: dict[str, np.ndarray], opset: int = 17, dims: dict | None = None,
           initializers: dict | None = None, outputs: int = 1, **attrs) -> onnx.ModelProto:
    """One ``op`` node over graph inputs ``inputs`` (``dims`` overrides their declared
    shapes) and constant ``initializers``; outputs y (and y1, y2...)."""
    dims = dims or {}
    names = list(inputs) + list(initializers or {})
    out_names = ["y"] + [f"y{k}" for k in range(1, outputs)]
    node = helper.make_node(op, names, out_names, **attrs)
    graph_inputs = [helper.make_tensor_value_info(k, helper.np_dtype_to_tensor_dtype(a.dtype),
                                                  dims.get(k, list(a.shape))) for k, a in inputs.items()]
    inits = [numpy_helper.from_array(a, k) for k, a in (initializers or {}).items()]
    dtype = helper.np_dtype_to_tensor_dtype(next(iter(inputs.values())).dtype)
    outs = [helper.make_tensor_value_info(n, dtype, None) for n in out_names]
    return helper.make_model(helper.make_graph([node], "g", graph_inputs, outs, inits),
                             opset_imports=[helper.make_opsetid("", opset)])


def _chain(nodes: list, inputs: dict[str, np.ndarray], initializers: dict | None = None,
           opset: int = 18) -> onnx.ModelProto:
    """A standard-ONNX model of ``nodes`` whose last node's output is ``y``."""
    graph_inputs = [helper.make_tensor_value_info(k, helper.np_dtype_to_tensor_dtype(a.dtype), list(a.shape))
                    for k, a in inputs.items()]
    inits = [numpy_helper.from_array(a, k) for k, a in (initializers or {}).items()]
    return helper.make_model(helper.make_graph(nodes, "g", graph_inputs,
                                               [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
                                               inits), opset_imports=[helper.make_opsetid("", opset)])


def _run_fused(op: str, inputs: dict[str, np.ndarray | None], out_shape: tuple, **attrs) -> np.ndarray:
    """Compile one com.egraft ``op`` node (None inputs are omitted optional inputs); it must be
    one generated kernel. Returns its output on ``inputs``."""
    values = [None if a is None else Value(k, TensorType(DType.FLOAT32, a.shape)) for k, a in inputs.items()]
    while values and values[-1] is None:
        values.pop()
    y = Value("y", TensorType(DType.FLOAT32, out_shape))
    graph = Graph("g", [v for v in values if v is not None], [y],
                  [Node(op, tuple(values), (y,), attrs, domain="com.egraft")], opsets={"": 17, "com.egraft": 1})
    compiled = compile_graph(graph)
    assert [s.kind for s in compiled.steps] == ["kernel"], compiled.report().fallbacks
    return compiled.run({k: a for k, a in inputs.items() if a is not None})["y"]


# ---- MatMul ---------------------------------------------------------------------------------------
@pytest.mark.parametrize(("a_shape", "b_shape"), [
    ((3, 5), (5, 7)), ((5,), (5, 7)), ((3, 5), (5,)), ((5,), (5,)), ((1, 1), (1, 1)),
    ((2, 3, 5), (5, 7)), ((2, 1, 3, 5), (4, 5, 7)), ((3, 5), (2, 5, 9)), ((2, 3, 17), (17,)), ((9,), (2, 9, 4)),
    ((2, 4, 33, 40), (2, 4, 40, 19)), ((70, 300), (300, 600)), ((1, 513), (513, 260)),
])
def test_matmul(a_shape, b_shape):
    a, b = _f32(*a_shape), _f32(*b_shape)
    got = check_compiled(_model("MatMul", {"a": a, "b": b}), {"a": a, "b": b}, rtol=1e-3, atol=1e-3)
    assert scale_relative_error(got["y"], np.matmul(a.astype(np.float64), b)) <= 1e-5


def test_matmul_float64_and_constant_weights():
    a, w = RNG.normal(size=(6, 10)), RNG.normal(size=(10, 3))
    check_compiled(_model("MatMul", {"a": a}, initializers={"w": w}), {"a": a}, rtol=1e-12, atol=1e-12)


def test_matmul_symbolic_batch_runs_at_two_sizes():
    w = _f32(32, 24)
    model = _model("MatMul", {"x": _f32(1, 5, 32)}, dims={"x": ["batch", "seq", 32]}, initializers={"w": w})
    compiled = compile_graph(egraft.load(model))
    assert not compiled.report().fallbacks
    for batch, seq in ((1, 5), (3, 7)):
        x = _f32(batch, seq, 32)
        want = run_onnxruntime(model, {"x": x})["y"]
        np.testing.assert_allclose(compiled.run({"x": x})["y"], want, rtol=1e-4, atol=1e-5)


def test_batched_matmul_symbolic_batch_both_operands():
    model = _model("MatMul", {"a": _f32(2, 3, 8), "b": _f32(2, 8, 4)}, dims={"a": ["n", 3, 8], "b": ["n", 8, 4]})
    compiled = compile_graph(egraft.load(model))
    for n in (1, 4):
        feeds = {"a": _f32(n, 3, 8), "b": _f32(n, 8, 4)}
        np.testing.assert_allclose(compiled.run(feeds)["y"], feeds["a"] @ feeds["b"], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("trans_b", [0, 1])
def test_products_of_few_rows_take_the_short_tiles_and_stay_exact(trans_b):
    """A symbolic M goes to the GEMM library, whose tiles are MR rows; at run time M may be
    1..MR (a batch of one): each count of rows takes the shortest tile that holds it (1, 2,
    4, 8 rows) or the full one, with the bias and activation epilogue, against float64."""
    k, n = 70, 83  # a last panel of a few columns, and K not a multiple of the unrolling
    w, bias = _f32(*((n, k) if trans_b else (k, n))), _f32(n)
    node = helper.make_node("Gemm", ["x", "w", "b"], ["g"], transB=trans_b)
    graph = helper.make_graph([node, helper.make_node("Relu", ["g"], ["y"])], "rows",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["m", k])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["m", n])],
                              [numpy_helper.from_array(w, "w"), numpy_helper.from_array(bias, "b")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    compiled = egraft.compile(model, use_cache=False)
    assert not compiled.report().fallbacks
    weights = (w.T if trans_b else w).astype(np.float64)
    for m in (1, 2, 3, 4, 5, 8, 9, 12, 13, 25):
        x = _f32(m, k)
        want = np.maximum(x.astype(np.float64) @ weights + bias, 0)
        assert scale_relative_error(compiled.run({"x": x})["y"], want) < 1e-5, m


# ---- Gemm -----------------------------------------------------------------------------------------
@pytest.mark.parametrize("trans_a", [0, 1])
@pytest.mark.parametrize("trans_b", [0, 1])
@pytest.mark.parametrize("c_shape", [None, (), (1,), (11,), (1, 11), (9, 1), (9, 11)])
def test_gemm(trans_a, trans_b, c_shape):
    m, k, n = 9, 13, 11
    a = _f32(*((k, m) if trans_a else (m, k)))
    b = _f32(*((n, k) if trans_b else (k, n)))
    feeds = {"a": a, "b": b}
    if c_shape is not None:
        feeds["c"] = _f32(*c_shape)
    check_compiled(_model("Gemm", feeds, transA=trans_a, transB=trans_b, alpha=0.7, beta=-1.3), feeds,
                   rtol=1e-4, atol=1e-5)


def test_gemm_defaults_beta_zero_and_large():
    a, b, c = _f32(70, 300), _f32(130, 300), _f32(130)
    check_compiled(_model("Gemm", {"a": a, "b": b, "c": c}, transB=1), {"a": a, "b": b, "c": c}, rtol=1e-3, atol=1e-3)
    c_nan = np.full((130,), np.nan, np.float32)
    got = compile_graph(egraft.load(_model("Gemm", {"a": a, "b": b, "c": c_nan}, transB=1, beta=0.0))).run(
        {"a": a, "b": b, "c": c_nan})["y"]
    assert scale_relative_error(got, a @ b.T) <= 1e-5  # beta=0: C is not read
    a2, b2 = _f32(64, 200), _f32(200, 300)
    check_compiled(_model("Gemm", {"a": a2}, initializers={"b": b2}, alpha=2.0), {"a": a2}, rtol=1e-3, atol=1e-3)


@pytest.mark.usefixtures("split_every_parallel_kernel")
@pytest.mark.parametrize("m", [1, 3])
@pytest.mark.parametrize("n", [13, 64])
@pytest.mark.parametrize("c_shape", [None, "n", "1n", "mn", "scalar"])
def test_products_of_one_to_three_rows_split_their_columns_over_threads(m, n, c_shape):
    """A fully connected layer at batch 1 (Gemm(transB=1) of a weight [N, K]) runs as dot
    products whose columns the parts share, each finished where computed (alpha, beta * C,
    the activation); other addends keep the general epilogue. 1 and 2 threads, onnxruntime."""
    k = 37
    a, w = _f32(m, k), _f32(n, k)
    c = {"n": _f32(n), "1n": _f32(1, n), "mn": _f32(m, n), "scalar": _f32(1)}.get(c_shape)
    inputs = {"a": a, **({"c": c} if c is not None else {})}
    nodes = [helper.make_node("Gemm", ["a", "w"] + (["c"] if c is not None else []), ["g"], transB=1, alpha=0.7,
                              beta=-1.3), helper.make_node("Relu", ["g"], ["y"])]
    model = _chain(nodes, inputs, {"w": w})
    compiled = egraft.compile(model, use_cache=False, specialize="off")
    assert compiled.report().fallbacks == []
    (gemm,) = [s for s in compiled.steps if "Gemm" in s.node.op]
    per_column = c_shape in (None, "n", "1n") or (c_shape == "mn" and m == 1)
    assert gemm.parallel == per_column  # the split matrix-vector form
    want = run_onnxruntime(model, inputs)["y"]
    for threads in (1, 2):
        compiled.threads = threads
        np.testing.assert_allclose(compiled.run(inputs)["y"], want, rtol=1e-5, atol=1e-5)


# ---- reductions -----------------------------------------------------------------------------------
REDUCE_OPS = ["ReduceSum", "ReduceMean", "ReduceMax", "ReduceMin", "ReduceProd", "ReduceSumSquare", "ReduceL2",
              "ReduceL1", "ReduceLogSum"]


@pytest.mark.parametrize("op", REDUCE_OPS)
@pytest.mark.parametrize("axes", [None, [0], [1], [-1], [0, 2], [1, 2], [0, 1, 2]])
@pytest.mark.parametrize("keepdims", [0, 1])
@pytest.mark.parametrize("opset", [11, 18])
def test_reduce(op, axes, keepdims, opset):
    x = RNG.uniform(0.5, 1.5, size=(3, 4, 5)).astype(np.float32)
    if op in ("ReduceSum", "ReduceMax", "ReduceMin", "ReduceL1"):
        x = x * RNG.choice([-1, 1], size=x.shape).astype(np.float32)
    axes_as_input = opset >= (13 if op == "ReduceSum" else 18)
    if axes_as_input:
        inits = {} if axes is None else {"axes": np.array(axes, np.int64)}
        model = _model(op, {"x": x}, opset=opset, initializers=inits, keepdims=keepdims)
    else:
        model = _model(op, {"x": x}, opset=opset, keepdims=keepdims, **({} if axes is None else {"axes": axes}))
    check_compiled(model, {"x": x}, rtol=1e-5, atol=1e-6)


def test_reduce_long_rows_noop_and_computed_axes():
    x = _f32(4, 5000)
    got = check_compiled(_model("ReduceSum", {"x": x}, opset=13, initializers={"axes": np.array([1], np.int64)}),
                         {"x": x}, rtol=1e-3, atol=1e-3)
    assert scale_relative_error(got["y"], x.astype(np.float64).sum(1, keepdims=True)) <= 1e-4
    x3 = _f32(2, 3, 4)
    check_compiled(_model("ReduceMax", {"x": x3}, opset=18, noop_with_empty_axes=1), {"x": x3})
    check_compiled(_model("ReduceMean", {"x": x3}, dims={"x": ["n", 3, 4]}, opset=18,
                          initializers={"axes": np.array([1], np.int64)}, keepdims=0), {"x": x3})
    axes = np.array([1], np.int64)
    computed = _model("ReduceSum", {"x": x3, "axes": axes}, opset=13)
    compiled = compile_graph(egraft.load(computed))
    assert [f[2] for f in compiled.report().fallbacks] == ["axes computed at run time"]


def test_axis_runs():
    assert axis_runs((2, 3, 4, 5), (2, 3)) == [(False, 6), (True, 20)]
    assert axis_runs((2, 1, 4, 5), (0, 2)) == [(True, 8), (False, 5)]


# ---- Softmax, LogSoftmax --------------------------------------------------------------------------
@pytest.mark.parametrize("op", ["Softmax", "LogSoftmax"])
@pytest.mark.parametrize(("opset", "axis"), [(11, None), (11, 0), (11, 2), (11, -1), (13, None), (13, 0), (13, 1),
                                             (13, -2)])
def test_softmax(op, opset, axis):
    x = _f32(3, 4, 5) * 4
    x[0, 0, 0] = 80.0  # large values: the max is subtracted first
    attrs = {} if axis is None else {"axis": axis}
    check_compiled(_model(op, {"x": x}, opset=opset, **attrs), {"x": x}, rtol=1e-5, atol=1e-6)


@pytest.mark.usefixtures("split_every_parallel_kernel")
@pytest.mark.parametrize("axis", [-1, 1])
def test_softmax_rows_are_shared_over_threads(axis):
    """Attention scores [batch, heads, seq, seq]: the rows (any axis) are split over the parts."""
    x = _f32(2, 4, 33, 33) * 4
    compiled = compile_graph(egraft.load(_model("Softmax", {"x": x}, opset=13, axis=axis)))
    (step,) = compiled.steps
    assert step.parallel
    e = np.exp(x.astype(np.float64) - x.max(axis, keepdims=True))
    for threads in (1, 2):
        compiled.threads = threads
        np.testing.assert_allclose(compiled.run({"x": x})["y"], e / e.sum(axis, keepdims=True), rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("op", ["Softmax", "LogSoftmax"])
@pytest.mark.parametrize("n", [1, 7, 16, 17, 100, 1000])
def test_softmax_contiguous_rows_in_vectors(op, n):
    """Rows along the last axis run in host-wide vectors, the last one masked: every length
    around the vector width, a row with a NaN (all NaN), a row with -inf (exp 0) and a row
    far from 0 match float64, and no lane past the row is read or written."""
    x = _f32(5, n) * 6
    x[1, n // 2] = np.nan
    x[2, 0] = -np.inf
    x[3] += 1000.0
    model = _model(op, {"x": x}, opset=13)
    got = compile_graph(egraft.load(model)).run({"x": x})["y"]
    wide = x.astype(np.float64)
    shifted = wide - wide.max(-1, keepdims=True)
    total = np.exp(shifted).sum(-1, keepdims=True)
    want = shifted - np.log(total) if op == "LogSoftmax" else np.exp(shifted) / total
    assert np.isnan(got[1]).all()
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


def test_softmax_symbolic_rows():
    model = _model("Softmax", {"x": _f32(2, 10)}, dims={"x": ["n", 10]}, opset=13)
    compiled = compile_graph(egraft.load(model))
    for n in (1, 6):
        x = _f32(n, 10)
        np.testing.assert_allclose(compiled.run({"x": x})["y"], run_onnxruntime(model, {"x": x})["y"], rtol=1e-5,
                                   atol=1e-7)


# ---- normalization ----------------------------------------------------------------------------------
@pytest.mark.parametrize("axis", [-1, 1, 2])
@pytest.mark.parametrize("bias", [True, False])
def test_layer_normalization(axis, bias):
    x = _f32(2, 3, 16) * 3 + 1
    normalized = x.shape[axis:] if axis >= 0 else x.shape[axis:]
    inits = {"scale": _f32(*normalized)}
    if bias:
        inits["bias"] = _f32(*normalized)
    check_compiled(_model("LayerNormalization", {"x": x}, initializers=inits, axis=axis, epsilon=1e-3), {"x": x},
                   rtol=1e-4, atol=1e-5)


def test_layer_normalization_broadcast_scale_and_mean_output_falls_back():
    x = _f32(4, 3, 8)
    check_compiled(_model("LayerNormalization", {"x": x}, initializers={"scale": _f32(8), "bias": _f32(1)}, axis=1),
                   {"x": x}, rtol=1e-4, atol=1e-5)
    model = _model("LayerNormalization", {"x": x}, initializers={"scale": _f32(8)}, outputs=2)
    fallbacks = compile_graph(egraft.load(model)).report().fallbacks
    assert [f[1] for f in fallbacks] == ["LayerNormalization"]


@pytest.mark.parametrize(("shape", "opset"), [((2, 3, 4, 5), 15), ((2, 3), 9), ((4, 3, 7), 14), ((5,), 15)])
def test_batch_normalization(shape, opset):
    x = _f32(*shape)
    c = shape[1] if len(shape) > 1 else 1
    inits = {"scale": _f32(c), "bias": _f32(c), "mean": _f32(c),
             "var": RNG.uniform(0.5, 2, size=c).astype(np.float32)}
    check_compiled(_model("BatchNormalization", {"x": x}, opset=opset, initializers=inits, epsilon=1e-3), {"x": x},
                   rtol=1e-5, atol=1e-6)


def test_batch_normalization_training_falls_back():
    x = _f32(2, 3, 4)
    inits = {"scale": _f32(3), "bias": _f32(3), "mean": _f32(3), "var": np.ones(3, np.float32)}
    model = _model("BatchNormalization", {"x": x}, opset=15, initializers=inits, training_mode=1)
    reasons = [f[2] for f in compile_graph(egraft.load(model)).report().fallbacks]
    assert reasons == ["BatchNormalization in training mode"]


# ---- fused ops ------------------------------------------------------------------------------------
_ONNX_ACTIVATION = {"relu": ("Relu", {}), "sigmoid": ("Sigmoid", {}), "tanh": ("Tanh", {}),
                    "hard_swish": ("HardSwish", {}), "leaky_relu": ("LeakyRelu", {"alpha": 0.2}),
                    "hard_sigmoid": ("HardSigmoid", {"alpha": 0.3, "beta": 0.4})}
_PARAMS = {"leaky_relu": [0.2], "hard_sigmoid": [0.3, 0.4], "clip": [-0.5, 0.8]}


def _activation_nodes(activation: str, x: str) -> tuple[list, dict]:
    """Standard-ONNX nodes computing ``activation(x)`` into ``y``, and their constants."""
    if activation == "":
        return [helper.make_node("Identity", [x], ["y"])], {}
    if activation in _ONNX_ACTIVATION:
        op, attrs = _ONNX_ACTIVATION[activation]
        return [helper.make_node(op, [x], ["y"], **attrs)], {}
    if activation == "silu":
        return [helper.make_node("Sigmoid", [x], ["sig"]), helper.make_node("Mul", [x, "sig"], ["y"])], {}
    if activation == "clip":
        lo, hi = _PARAMS["clip"]
        return [helper.make_node("Clip", [x, "lo", "hi"], ["y"])], {"lo": np.array(lo, np.float32),
                                                                    "hi": np.array(hi, np.float32)}
    constants = {"half": np.array(0.5, np.float32), "one": np.array(1.0, np.float32)}
    if activation == "gelu":
        constants["root2"] = np.array(math.sqrt(2), np.float32)
        nodes = [helper.make_node("Div", [x, "root2"], ["g0"]), helper.make_node("Erf", ["g0"], ["phi"])]
    else:
        constants.update(c=np.array(0.044715, np.float32), k=np.array(math.sqrt(2 / math.pi), np.float32))
        nodes = [helper.make_node("Mul", [x, x], ["g0"]), helper.make_node("Mul", ["g0", x], ["g1"]),
                 helper.make_node("Mul", ["g1", "c"], ["g2"]), helper.make_node("Add", [x, "g2"], ["g3"]),
                 helper.make_node("Mul", ["g3", "k"], ["g4"]), helper.make_node("Tanh", ["g4"], ["phi"])]
    nodes += [helper.make_node("Mul", ["half", x], ["hx"]), helper.make_node("Add", ["phi", "one"], ["p1"]),
              helper.make_node("Mul", ["hx", "p1"], ["y"])]
    return nodes, constants


@pytest.mark.parametrize("activation", ACTIVATIONS)
def test_fused_gemm(activation):
    a, b, c, z = _f32(6, 9), _f32(7, 9), _f32(7), _f32(6, 7)
    attrs = {"alpha": 0.5, "beta": 2.0, "transB": 1, "activation": activation,
             "activation_params": _PARAMS.get(activation, [])}
    got = _run_fused("FusedGemm", {"A": a, "B": b, "C": c, "Z": z}, (6, 7), **attrs)
    act, constants = _activation_nodes(activation, "s")
    nodes = [helper.make_node("Gemm", ["A", "B", "C"], ["g"], alpha=0.5, beta=2.0, transB=1),
             helper.make_node("Add", ["g", "Z"], ["s"]), *act]
    want = run_onnxruntime(_chain(nodes, {"A": a, "B": b, "C": c, "Z": z}, constants), {"A": a, "B": b, "C": c,
                                                                                          "Z": z})["y"]
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_fused_gemm_without_addends():
    a, b = _f32(5, 4), _f32(5, 3)
    got = _run_fused("FusedGemm", {"A": a, "B": b}, (4, 3), transA=1, activation="relu")
    np.testing.assert_allclose(got, np.maximum(a.T @ b, 0), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("activation", ACTIVATIONS)
def test_fused_matmul(activation):
    a, b, bias, z = _f32(2, 5, 8), _f32(8, 6), _f32(6), _f32(5, 6)
    got = _run_fused("FusedMatMul", {"A": a, "B": b, "bias": bias, "Z": z}, (2, 5, 6), activation=activation,
                     activation_params=_PARAMS.get(activation, []))
    act, constants = _activation_nodes(activation, "s")
    nodes = [helper.make_node("MatMul", ["A", "B"], ["m"]), helper.make_node("Add", ["m", "bias"], ["m1"]),
             helper.make_node("Add", ["m1", "Z"], ["s"]), *act]
    feeds = {"A": a, "B": b, "bias": bias, "Z": z}
    want = run_onnxruntime(_chain(nodes, feeds, constants), feeds)["y"]
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_fused_matmul_residual_only():
    a, b, z = _f32(4, 8), _f32(2, 8, 3), _f32(1, 4, 1)
    got = _run_fused("FusedMatMul", {"A": a, "B": b, "bias": None, "Z": z}, (2, 4, 3))
    np.testing.assert_allclose(got, a @ b + z, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("axis", [-1, 1])
def test_fused_layer_norm(bias, axis):
    x = _f32(3, 4, 10) * 2 + 0.5
    normalized = x.shape[axis:]
    scale, b = _f32(*normalized), (_f32(*normalized) if bias else None)
    got = _run_fused("LayerNorm", {"X": x, "scale": scale, "bias": b}, x.shape, axis=axis, epsilon=1e-4)
    inits = {"scale": scale} | ({"bias": b} if bias else {})
    model = _model("LayerNormalization", {"x": x}, initializers=inits, axis=axis, epsilon=1e-4)
    np.testing.assert_allclose(got, run_onnxruntime(model, {"x": x})["y"], rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("approximate", ["none", "tanh"])
def test_fused_gelu(approximate):
    x = _f32(4, 33) * 3
    got = _run_fused("Gelu", {"X": x}, x.shape, approximate=approximate)
    nodes, constants = _activation_nodes("gelu" if approximate == "none" else "gelu_tanh", "X")
    want = run_onnxruntime(_chain(nodes, {"X": x}, constants), {"X": x})["y"]
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(("q_shape", "kt_shape", "v_shape", "mask_shape", "out_shape"), [
    ((2, 3, 4, 8), (2, 3, 8, 5), (2, 3, 5, 6), (4, 5), (2, 3, 4, 6)),
    ((3, 4, 8), (8, 5), (5, 6), (3, 1, 5), (3, 4, 6)),
    ((4, 8), (2, 8, 5), (5, 6), None, (2, 4, 6)),
    ((1, 2, 7, 16), (1, 2, 16, 9), (1, 2, 9, 16), (1, 1, 1, 9), (1, 2, 7, 16)),
    # keys a block of four vectors, one more vector and 5 one at a time; Dv of two vectors
    ((1, 3, 6, 12), (1, 3, 12, 45), (1, 3, 45, 16), (6, 45), (1, 3, 6, 16)),
    ((2, 5, 32), (2, 32, 64), (2, 64, 8), (2, 1, 64), (2, 5, 8)),
    # a head dim over 128: the scores one key at a time, the output rows still in registers
    ((1, 2, 3, 130), (1, 2, 130, 20), (1, 2, 20, 16), None, (1, 2, 3, 16)),
])
def test_fused_attention(q_shape, kt_shape, v_shape, mask_shape, out_shape):
    q, kt, v = _f32(*q_shape), _f32(*kt_shape), _f32(*v_shape)
    mask = None if mask_shape is None else np.where(RNG.random(mask_shape) < 0.2, -1e4, 0).astype(np.float32)
    got = _run_fused("Attention", {"Q": q, "Kt": kt, "V": v, "mask": mask}, out_shape, scale=0.25)
    feeds = {"Q": q, "Kt": kt, "V": v} | ({} if mask is None else {"mask": mask})
    nodes = [helper.make_node("MatMul", ["Q", "Kt"], ["qk"]), helper.make_node("Mul", ["qk", "scale"], ["s0"])]
    nodes += [helper.make_node("Add", ["s0", "mask"], ["s"])] if mask is not None else \
        [helper.make_node("Identity", ["s0"], ["s"])]
    nodes += [helper.make_node("Softmax", ["s"], ["p"], axis=-1), helper.make_node("MatMul", ["p", "V"], ["y"])]
    want = run_onnxruntime(_chain(nodes, feeds, {"scale": np.array(0.25, np.float32)}), feeds)["y"]
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(("k", "n"), [(256, 256), (8, 3)])  # the GEMM library, then the loops
def test_one_row_matmuls_folded_over_a_symbolic_batch(k, n):
    """``[b, 1, K] @ [K, N]`` folds the batch into b rows of a shared-weight product: the
    rows are K apart, not 0 (a decoder step at sequence 1 computed row 0 only)."""
    rng = np.random.default_rng(k)
    nodes = [helper.make_node("Unsqueeze", ["x", "axis"], ["u"]), helper.make_node("MatMul", ["u", "w"], ["y"])]
    model = helper.make_model(helper.make_graph(
        nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["b", k])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
        [numpy_helper.from_array(rng.normal(size=(k, n)).astype(np.float32), "w"),
         numpy_helper.from_array(np.array([1], np.int64), "axis")]), opset_imports=[helper.make_opsetid("", 17)])
    for compiled in (compile_graph(egraft.load(model)), egraft.compile(model, use_cache=False)):
        for b in (1, 3):
            x = rng.normal(size=(b, k)).astype(np.float32)
            want = run_onnxruntime(model, {"x": x})["y"]
            assert scale_relative_error(compiled.run({"x": x})["y"], want) < 1e-5


def test_softmax_of_equal_values_in_any_order_is_equal():
    """Columns that hold the same values in another order have equal softmaxes (the sum
    accumulates in double), so an ArgMin over them keeps onnxruntime's ties (fuzz seed 589)."""
    rng = np.random.default_rng(589)
    x = np.zeros((8, 8, 5), np.float32)
    for i in range(8):
        for k in range(5):
            x[i, rng.choice(8, size=2, replace=False), k] = 1.0
    nodes = [helper.make_node("Softmax", ["x"], ["s"], axis=-2), helper.make_node("ArgMin", ["s"], ["y"])]
    model = helper.make_model(helper.make_graph(
        nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [8, 8, 5])],
        [helper.make_tensor_value_info("y", TensorProto.INT64, None)]), opset_imports=[helper.make_opsetid("", 13)])
    got = compile_graph(egraft.load(model)).run({"x": x})["y"]
    np.testing.assert_array_equal(got, run_onnxruntime(model, {"x": x}, exact=True)["y"])


def test_layer_normalization_of_a_constant_row_is_exactly_zero():
    """A constant row's mean is the constant (summed in double): its normalized values are
    exact zeros as onnxruntime gives them, not rounding noise over sqrt(epsilon) (fuzz seed 1198)."""
    x = np.full((4, 7), 0.1, np.float32)
    x[1] = np.linspace(-1, 1, 7)
    x[3] = 3.3
    model = helper.make_model(helper.make_graph(
        [helper.make_node("LayerNormalization", ["x", "s"], ["y"])], "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4, 7])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
        [numpy_helper.from_array(np.full(7, 2.0, np.float32), "s")]), opset_imports=[helper.make_opsetid("", 17)])
    want = run_onnxruntime(model, {"x": x}, exact=True)["y"]
    for got in (egraft.load(model).run({"x": x})["y"], compile_graph(egraft.load(model)).run({"x": x})["y"]):
        np.testing.assert_array_equal(got[[0, 2, 3]], 0.0)
        np.testing.assert_allclose(got, want, rtol=0, atol=1e-6)


@pytest.mark.usefixtures("split_every_parallel_kernel")
@pytest.mark.parametrize("rows", [4, 13, 30])
@pytest.mark.parametrize("mask_shape", [None, (1, 1, 1, 70), (1, 2, 1, 70)])
def test_attention_query_rows_in_blocks_at_one_and_two_threads(rows, mask_shape):
    """The heads of a transformer take query rows four at a time, the rows left over one by
    one, and each thread's share of rows does the same: 70 keys are four vectors of 16, a
    vector of 8 and 6 one at a time (AVX2 or AVX-512); the mask per row or broadcast."""
    q, kt, v = _f32(1, 2, rows, 32), _f32(1, 2, 32, 70), _f32(1, 2, 70, 32)
    shape = mask_shape and (mask_shape[:2] + (rows,) + mask_shape[3:] if mask_shape[1] == 2 else mask_shape)
    mask = None if shape is None else np.where(RNG.random(shape) < 0.2, -1e4, RNG.normal(size=shape)).astype(np.float32)
    values = {"Q": q, "Kt": kt, "V": v, "mask": mask}
    graph_inputs = [Value(k, TensorType(DType.FLOAT32, a.shape)) for k, a in values.items() if a is not None]
    y = Value("y", TensorType(DType.FLOAT32, (1, 2, rows, 32)))
    graph = Graph("g", graph_inputs, [y], [Node("Attention", tuple(graph_inputs), (y,), {"scale": 0.3},
                                               domain="com.egraft")], opsets={"": 17, "com.egraft": 1})
    compiled = compile_graph(graph)
    s = q.astype(np.float64) @ kt * 0.3 + (0 if mask is None else mask)
    p = np.exp(s - s.max(-1, keepdims=True))
    want = (p / p.sum(-1, keepdims=True)) @ v
    for threads in (1, 2):
        compiled.threads = threads
        got = compiled.run({k: a for k, a in values.items() if a is not None})["y"]
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_fused_attention_row_with_a_nan_score_is_nan_and_others_are_not():
    """A NaN in one query's scores (a NaN in Q) makes that row's outputs NaN, as the
    reference softmax does; the vectorized row max may skip it, its exp still reaches the sum."""
    q, kt, v = _f32(1, 2, 4, 8), _f32(1, 2, 8, 40), _f32(1, 2, 40, 16)
    q[0, 1, 2, 3] = np.nan
    got = _run_fused("Attention", {"Q": q, "Kt": kt, "V": v}, (1, 2, 4, 16), scale=0.5)
    assert np.isnan(got[0, 1, 2]).all()
    assert not np.isnan(np.delete(got.reshape(8, 16), 6, axis=0)).any()
    s = q.astype(np.float64) @ kt * 0.5
    p = np.exp(s - s.max(-1, keepdims=True))
    want = (p / p.sum(-1, keepdims=True)) @ v
    np.testing.assert_allclose(np.nan_to_num(got, nan=7.0), np.nan_to_num(want, nan=7.0), rtol=1e-5, atol=1e-5)

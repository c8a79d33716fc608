"""egraft's fused ops (egraft/ir/ops/fused.py, domain com.egraft): FusedConv, FusedGemm, FusedMatMul,
LayerNorm, Gelu and Attention.

Each op is checked three ways: its kernel against the same computation written in standard ONNX
ops and run by onnxruntime; its export (a model-local function) run by onnxruntime against the
kernel; and its inference, with static dims against onnx's shape inference of the standard-op
model and with symbolic dims against the shapes of real runs.
"""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from conftest import run_onnxruntime
from onnx import TensorProto, helper, numpy_helper

import egraft
from egraft.errors import ShapeInferenceError
from egraft.ir.dims import evaluate_dim, sym
from egraft.ir.graph import Graph, Node, Value
from egraft.ir.infer import FreshDims, infer_node
from egraft.ir.ops.fused import ACTIVATIONS, DOMAIN
from egraft.ir.types import DType, TensorType

RNG = np.random.default_rng(0)
OPSETS = {"": 18, DOMAIN: 1}
#: The opset of the standard-op reference models (20 has Gelu, independent of the fused bodies).
REFERENCE_OPSET = 20

Feeds = list[tuple[str, np.ndarray | None]]


def randn(*shape, dtype=np.float32) -> np.ndarray:
    return RNG.normal(size=shape).astype(dtype)


# ---- building and running ------------------------------------------------------------------------
def fused_graph(op: str, inputs: list[tuple[str, TensorType | None]], attrs: dict | None = None) -> Graph:
    """A validated one-node IR graph of the egraft op ``op``; a ``None`` type is an omitted input.
    The output type is what the op's inference gives."""
    values = [Value(name, t) if t is not None else None for name, t in inputs]
    graph_inputs = [v for v in values if v is not None]
    node = Node(op, tuple(values), (Value("y", TensorType(DType.FLOAT32, None)),), dict(attrs or {}), domain=DOMAIN)
    probe = Graph("g", graph_inputs, [], [node], opsets=dict(OPSETS))
    y = Value("y", infer_node(probe, node, FreshDims())[0])
    graph = Graph("g", graph_inputs, [y], [node.replace(outputs=(y,))], opsets=dict(OPSETS))
    graph.validate()
    return graph


def types_of(feeds: Feeds, dims: dict[str, tuple] | None = None) -> list[tuple[str, TensorType | None]]:
    """The declared types of ``feeds``: each array's own, or the dims given for its name."""
    dims = dims or {}
    return [(name, None if a is None else TensorType(DType.from_numpy(a.dtype), dims.get(name, a.shape)))
            for name, a in feeds]


def present(feeds: Feeds) -> dict[str, np.ndarray]:
    return {name: a for name, a in feeds if a is not None}


def reference_model(nodes: list[onnx.NodeProto], feeds: dict[str, np.ndarray],
                    inits: dict[str, np.ndarray] | None = None) -> onnx.ModelProto:
    """A standard-op model computing output ``y`` from ``feeds`` (float32 inputs)."""
    inputs = [helper.make_tensor_value_info(k, TensorProto.FLOAT, list(v.shape)) for k, v in feeds.items()]
    initializers = [numpy_helper.from_array(v, k) for k, v in (inits or {}).items()]
    graph = helper.make_graph(nodes, "reference", inputs, [onnx.ValueInfoProto(name="y")], initializers)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", REFERENCE_OPSET)], ir_version=9)


def onnx_static_shape(model: onnx.ModelProto) -> list[int] | None:
    """The shape onnx's shape inference gives output ``y``, when fully static."""
    t = onnx.shape_inference.infer_shapes(model, strict_mode=True).graph.output[0].type.tensor_type
    if not t.HasField("shape") or any(not d.HasField("dim_value") for d in t.shape.dim):
        return None
    return [d.dim_value for d in t.shape.dim]


def ort(model: onnx.ModelProto, feeds: dict[str, np.ndarray]) -> np.ndarray:
    return run_onnxruntime(model, feeds, exact=True)["y"]


def check_export(graph: Graph, feeds: dict[str, np.ndarray], ours: np.ndarray) -> None:
    """The exported model passes onnx's checker and onnxruntime runs it to egraft's result."""
    model = egraft.to_onnx(graph)
    onnx.checker.check_model(model)
    assert len(model.functions) == 1 and model.functions[0].domain == DOMAIN
    got = ort(model, feeds)
    assert got.dtype == ours.dtype and got.shape == ours.shape
    assert_close_to_kernel(got, ours)


def assert_close_to_kernel(got: np.ndarray, ours: np.ndarray) -> None:
    """``got`` equals egraft's ``ours`` within 1e-5 relative to the largest magnitude (summation orders
    differ); in float16 within an ulp (both compute in float32 and round once)."""
    if ours.dtype == np.float16:
        rtol, atol = 2e-3, 2e-3
    else:
        rtol, atol = 1e-5, 1e-5 * max(1.0, float(np.abs(ours).max(initial=0)))
    np.testing.assert_allclose(got.astype(np.float64), ours.astype(np.float64), rtol=rtol, atol=atol)


def check_op(op: str, feeds: Feeds, attrs: dict, ref_nodes: list[onnx.NodeProto],
             ref_inits: dict[str, np.ndarray] | None = None, rtol: float = 1e-5, atol: float = 1e-5) -> np.ndarray:
    """Run the fused op on ``feeds``; compare with the standard-op reference run by onnxruntime
    (in float32: the fused kernels compute half precision in float32), check the export and the
    inferred shape (also against onnx's shape inference of the reference). Returns egraft's result."""
    graph = fused_graph(op, types_of(feeds), attrs)
    given = present(feeds)
    ours = graph.run(given)["y"]
    dtype = next(iter(given.values())).dtype
    assert ours.dtype == dtype
    f32_feeds = {k: v.astype(np.float32) for k, v in given.items()}
    reference = reference_model(ref_nodes, f32_feeds, ref_inits)
    want = ort(reference, f32_feeds)
    assert ours.shape == want.shape
    assert list(graph.outputs[0].type.shape) == list(want.shape)
    static = onnx_static_shape(reference)
    if static is not None:
        assert static == list(want.shape)
    if dtype == np.float16:
        want = want.astype(np.float16)
        rtol, atol = max(rtol, 2e-3), max(atol, 2e-3)
    np.testing.assert_allclose(ours.astype(np.float64), want.astype(np.float64), rtol=rtol, atol=atol)
    check_export(graph, given, ours)
    return ours


def check_symbolic(op: str, feeds_for, dims: dict[str, tuple], attrs: dict, bindings: list[dict[str, int]],
                   expected: str | None = None) -> None:
    """Inference with symbolic input dims: the output type prints ``expected`` (when given), and under
    each binding its dims equal the shape of a real run, which the exported model reproduces."""
    graph = fused_graph(op, types_of(feeds_for(bindings[0]), dims), attrs)
    out_type = graph.outputs[0].type
    if expected is not None:
        assert str(out_type) == expected
    model = egraft.to_onnx(graph)
    for binding in bindings:
        feeds = present(feeds_for(binding))
        ours = graph.run(feeds)["y"]
        assert [evaluate_dim(d, binding) for d in out_type.shape] == list(ours.shape)
        assert_close_to_kernel(ort(model, feeds), ours)


def assert_inference_fails(op: str, feeds: Feeds, attrs: dict, message: str) -> None:
    with pytest.raises(ShapeInferenceError, match=message):
        fused_graph(op, types_of(feeds), attrs)


# ---- activations in standard ops -----------------------------------------------------------------
#: (activation, activation_params) cases: every activation, with explicit and default parameters.
ACTIVATION_CASES = [(a, []) for a in ACTIVATIONS] + [
    ("leaky_relu", [0.2]), ("clip", [-0.5, 0.8]), ("clip", [-0.3]), ("hard_sigmoid", [0.3, 0.4]),
    ("hard_sigmoid", [0.1]),
]


def activation_nodes(activation: str, params: list[float], x: str, y: str = "y"):
    """``y = activation(x)`` in standard opset-20 ops (Gelu included), and the initializers it needs."""
    simple = {"": "Identity", "relu": "Relu", "sigmoid": "Sigmoid", "hard_swish": "HardSwish", "tanh": "Tanh"}
    if activation in simple:
        return [helper.make_node(simple[activation], [x], [y])], {}
    if activation in ("gelu", "gelu_tanh"):
        approximate = "tanh" if activation == "gelu_tanh" else "none"
        return [helper.make_node("Gelu", [x], [y], approximate=approximate)], {}
    if activation == "leaky_relu":
        return [helper.make_node("LeakyRelu", [x], [y], **({"alpha": params[0]} if params else {}))], {}
    if activation == "hard_sigmoid":
        attrs = dict(zip(["alpha", "beta"], params))
        return [helper.make_node("HardSigmoid", [x], [y], **attrs)], {}
    if activation == "silu":  # x * sigmoid(x)
        sigmoid = helper.make_node("Sigmoid", [x], ["silu_sigmoid"])
        return [sigmoid, helper.make_node("Mul", [x, "silu_sigmoid"], [y])], {}
    assert activation == "clip"
    inits = {name: np.array(p, np.float32) for name, p in zip(["clip_min", "clip_max"], params)}
    return [helper.make_node("Clip", [x, *inits], [y])], inits


def linear_then_activation(first: list[onnx.NodeProto], last: str, activation: str, params: list[float],
                           residual: str | None = None):
    """Reference nodes: ``first`` (ending in ``last``), plus ``residual`` when given, then the activation."""
    nodes = list(first)
    if residual is not None:
        nodes.append(helper.make_node("Add", [last, residual], ["with_residual"]))
        last = "with_residual"
    act, inits = activation_nodes(activation, params, last)
    return nodes + act, inits


# ---- FusedConv ----------------------------------------------------------------------------------
CONV_CASES = [
    dict(),
    dict(pads=[1, 1, 1, 1]),
    dict(pads=[0, 2, 1, 0], strides=[2, 1], dilations=[1, 2]),
    dict(auto_pad="SAME_UPPER", strides=[2, 2]),
    dict(auto_pad="VALID", group=2),
]


def conv_reference_attrs(attrs: dict) -> dict:
    return {k: v for k, v in attrs.items() if not k.startswith("activation")}


@pytest.mark.parametrize("conv_attrs", CONV_CASES)
@pytest.mark.parametrize("bias, residual", [(True, True), (False, True), (True, False), (False, False)])
def test_fused_conv_matches_conv_add_activation(conv_attrs, bias, residual):
    x, w = randn(2, 4, 9, 8), randn(6, 4 // conv_attrs.get("group", 1), 3, 3)
    b = randn(6) if bias else None
    out_shape = ort(reference_model([helper.make_node("Conv", ["x", "w"], ["y"], **conv_attrs)], {"x": x, "w": w}),
                    {"x": x, "w": w}).shape
    z = randn(*out_shape) if residual else None
    attrs = {**conv_attrs, "activation": "relu"}
    conv = helper.make_node("Conv", ["x", "w"] + (["b"] if bias else []), ["conv"], **conv_attrs)
    nodes, inits = linear_then_activation([conv], "conv", "relu", [], "z" if residual else None)
    check_op("FusedConv", [("x", x), ("w", w), ("b", b), ("z", z)], attrs, nodes, inits, rtol=1e-4)


@pytest.mark.parametrize("activation, params", ACTIVATION_CASES)
def test_fused_conv_activations(activation, params):
    x, w, b, z = randn(1, 3, 6, 6), randn(4, 3, 3, 3), randn(4), randn(1, 4, 1, 1)
    attrs = {"pads": [1, 1, 1, 1], "activation": activation, "activation_params": params}
    conv = helper.make_node("Conv", ["x", "w", "b"], ["conv"], pads=[1, 1, 1, 1])
    nodes, inits = linear_then_activation([conv], "conv", activation, params, "z")
    check_op("FusedConv", [("x", x), ("w", w), ("b", b), ("z", z)], attrs, nodes, inits, rtol=1e-4)


def test_fused_conv_1d_and_float16():
    x, w, z = randn(2, 3, 11, dtype=np.float16), randn(5, 3, 3, dtype=np.float16), randn(5, 1, dtype=np.float16)
    attrs = {"strides": [2], "activation": "gelu"}
    conv = helper.make_node("Conv", ["x", "w"], ["conv"], strides=[2])
    nodes, inits = linear_then_activation([conv], "conv", "gelu", [], "z")
    ours = check_op("FusedConv", [("x", x), ("w", w), ("b", None), ("z", z)], attrs, nodes, inits)
    assert ours.dtype == np.float16


def test_fused_conv_symbolic_batch():
    def feeds(binding):
        n = binding["batch"]
        return [("x", randn(n, 64, 56, 56)), ("w", randn(64, 64, 3, 3) * 0.05), ("b", randn(64)),
                ("z", randn(n, 64, 56, 56))]

    check_symbolic("FusedConv", feeds, {"x": (sym("batch"), 64, 56, 56), "z": (sym("batch"), 64, 56, 56)},
                   {"pads": [1, 1, 1, 1], "activation": "relu"}, [dict(batch=1), dict(batch=2)],
                   expected="f32[batch, 64, 56, 56]")


def test_fused_conv_symbolic_spatial_dims():
    def feeds(binding):
        return [("x", randn(binding["batch"], 3, binding["H"], binding["W"])), ("w", randn(8, 3, 3, 3))]

    graph = fused_graph("FusedConv", types_of(feeds(dict(batch=1, H=9, W=9)), {"x": (sym("batch"), 3, sym("H"),
                                                                                     sym("W"))}),
                        {"strides": [2, 2], "pads": [1, 1, 1, 1]})
    assert str(graph.outputs[0].type).startswith("f32[batch, 8, ")
    check_symbolic("FusedConv", feeds, {"x": (sym("batch"), 3, sym("H"), sym("W"))},
                   {"strides": [2, 2], "pads": [1, 1, 1, 1], "activation": "sigmoid"},
                   [dict(batch=2, H=15, W=16), dict(batch=1, H=32, W=9)])


def test_fused_conv_rejects_bad_inputs():
    x, w = randn(1, 4, 8, 8), randn(6, 4, 3, 3)
    assert_inference_fails("FusedConv", [("x", x), ("w", w), ("b", None), ("z", randn(1, 5, 6, 6))], {},
                           "does not broadcast")
    assert_inference_fails("FusedConv", [("x", x), ("w", w), ("b", randn(5))], {}, "bias")
    assert_inference_fails("FusedConv", [("x", x), ("w", w)], {"activation": "swish"}, "unknown activation")
    assert_inference_fails("FusedConv", [("x", x), ("w", w)], {"activation": "relu", "activation_params": [1.0]},
                           "at most 0 parameters")
    assert_inference_fails("FusedConv", [("x", x), ("w", randn(6, 3, 3, 3))], {}, "channels")


# ---- FusedGemm ----------------------------------------------------------------------------------
@pytest.mark.parametrize("gemm_attrs", [dict(), dict(transA=1), dict(transB=1, alpha=0.5, beta=2.0),
                                        dict(transA=1, transB=1, beta=0.0)])
@pytest.mark.parametrize("c_shape", [None, (), (7,), (1, 7), (5, 1), (5, 7)])
def test_fused_gemm_matches_gemm_add_activation(gemm_attrs, c_shape):
    a = randn(4, 5) if gemm_attrs.get("transA") else randn(5, 4)
    b = randn(7, 4) if gemm_attrs.get("transB") else randn(4, 7)
    c = None if c_shape is None else randn(*c_shape)
    z = randn(5, 7)
    gemm = helper.make_node("Gemm", ["a", "b"] + ([] if c is None else ["c"]), ["gemm"], **gemm_attrs)
    nodes, inits = linear_then_activation([gemm], "gemm", "leaky_relu", [0.1], "z")
    attrs = {**gemm_attrs, "activation": "leaky_relu", "activation_params": [0.1]}
    check_op("FusedGemm", [("a", a), ("b", b), ("c", c), ("z", z)], attrs, nodes, inits)


@pytest.mark.parametrize("activation, params", ACTIVATION_CASES)
def test_fused_gemm_activations(activation, params):
    a, b, c = randn(3, 6), randn(8, 6), randn(8)
    gemm = helper.make_node("Gemm", ["a", "b", "c"], ["gemm"], transB=1)
    nodes, inits = linear_then_activation([gemm], "gemm", activation, params)
    attrs = {"transB": 1, "activation": activation, "activation_params": params}
    check_op("FusedGemm", [("a", a), ("b", b), ("c", c)], attrs, nodes, inits)


def test_fused_gemm_float16():
    a, b, c, z = (randn(*s, dtype=np.float16) for s in [(6, 5), (5, 3), (3,), (6, 3)])
    gemm = helper.make_node("Gemm", ["a", "b", "c"], ["gemm"], alpha=0.7)
    nodes, inits = linear_then_activation([gemm], "gemm", "tanh", [], "z")
    check_op("FusedGemm", [("a", a), ("b", b), ("c", c), ("z", z)], {"alpha": 0.7, "activation": "tanh"},
             nodes, inits)


def test_fused_gemm_symbolic_batch():
    def feeds(binding):
        return [("a", randn(binding["batch"], 16)), ("b", randn(32, 16)), ("c", randn(32))]

    check_symbolic("FusedGemm", feeds, {"a": (sym("batch"), 16)}, {"transB": 1, "activation": "relu"},
                   [dict(batch=1), dict(batch=3)], expected="f32[batch, 32]")


def test_fused_gemm_rejects_bad_inputs():
    assert_inference_fails("FusedGemm", [("a", randn(3, 4)), ("b", randn(5, 6))], {}, "inner dims differ")
    assert_inference_fails("FusedGemm", [("a", randn(3, 4)), ("b", randn(4, 6)), ("c", randn(2, 6))], {},
                           "C of shape")
    assert_inference_fails("FusedGemm", [("a", randn(3, 4)), ("b", randn(4, 6)), ("c", None),
                                         ("z", randn(2, 3, 6))], {}, "Z of shape")
    assert_inference_fails("FusedGemm", [("a", randn(2, 3, 4)), ("b", randn(4, 6))], {}, "2-D")


# ---- FusedMatMul --------------------------------------------------------------------------------
@pytest.mark.parametrize("activation, params", ACTIVATION_CASES)
def test_fused_matmul_activations(activation, params):
    a, b, bias, z = randn(2, 3, 5, 8), randn(8, 6), randn(6), randn(3, 1, 6)
    matmul = [helper.make_node("MatMul", ["a", "b"], ["mm"]), helper.make_node("Add", ["mm", "bias"], ["biased"])]
    nodes, inits = linear_then_activation(matmul, "biased", activation, params, "z")
    attrs = {"activation": activation, "activation_params": params}
    check_op("FusedMatMul", [("a", a), ("b", b), ("bias", bias), ("z", z)], attrs, nodes, inits)


@pytest.mark.parametrize("a_shape, b_shape", [((4, 1, 5, 8), (3, 8, 6)), ((8,), (2, 8, 6)), ((3, 5, 8), (8,)),
                                              ((5, 8), (8, 6))])
@pytest.mark.parametrize("with_bias", [False, True])
def test_fused_matmul_batch_broadcast_and_vectors(a_shape, b_shape, with_bias):
    a, b = randn(*a_shape), randn(*b_shape)
    out = np.matmul(a, b)
    bias = randn(out.shape[-1]) if with_bias and out.ndim else None
    first = [helper.make_node("MatMul", ["a", "b"], ["mm"])]
    last = "mm"
    if bias is not None:
        first.append(helper.make_node("Add", ["mm", "bias"], ["biased"]))
        last = "biased"
    nodes, inits = linear_then_activation(first, last, "hard_swish", [])
    check_op("FusedMatMul", [("a", a), ("b", b), ("bias", bias)], {"activation": "hard_swish"}, nodes, inits)


def test_fused_matmul_residual_without_bias_and_float16():
    a, b, z = randn(4, 6, dtype=np.float16), randn(6, 3, dtype=np.float16), randn(4, 3, dtype=np.float16)
    nodes, inits = linear_then_activation([helper.make_node("MatMul", ["a", "b"], ["mm"])], "mm", "clip",
                                          [-1.0, 1.0], "z")
    check_op("FusedMatMul", [("a", a), ("b", b), ("bias", None), ("z", z)],
             {"activation": "clip", "activation_params": [-1.0, 1.0]}, nodes, inits)


def test_fused_matmul_float64_is_computed_in_float64():
    a, b, bias = randn(3, 5, dtype=np.float64), randn(5, 4, dtype=np.float64), randn(4, dtype=np.float64)
    nodes, inits = linear_then_activation([helper.make_node("MatMul", ["a", "b"], ["mm"])], "mm", "tanh", [], "bias")
    ours = check_op("FusedMatMul", [("a", a), ("b", b), ("bias", bias)], {"activation": "tanh"}, nodes, inits)
    np.testing.assert_allclose(ours, np.tanh(a @ b + bias), rtol=1e-12)


def test_fused_matmul_symbolic_dims():
    def feeds(binding):
        return [("a", randn(binding["batch"], binding["seq"], 64)), ("b", randn(64, 128)), ("bias", randn(128))]

    check_symbolic("FusedMatMul", feeds, {"a": (sym("batch"), sym("seq"), 64)}, {"activation": "gelu_tanh"},
                   [dict(batch=2, seq=3), dict(batch=1, seq=7)], expected="f32[batch, seq, 128]")


def test_fused_matmul_rejects_bad_inputs():
    assert_inference_fails("FusedMatMul", [("a", randn(3, 4)), ("b", randn(5, 6))], {}, "inner dims differ")
    assert_inference_fails("FusedMatMul", [("a", randn(2, 3, 4)), ("b", randn(3, 4, 6))], {}, "do not broadcast")
    assert_inference_fails("FusedMatMul", [("a", randn(3, 4)), ("b", randn(4, 6)), ("bias", randn(5))], {},
                           "bias of shape")
    assert_inference_fails("FusedMatMul", [("a", randn(3, 4)), ("b", randn(4, 6).astype(np.float64))], {},
                           "input 1 is f64")
    ints = [("a", np.ones((3, 4), np.int32)), ("b", np.ones((4, 6), np.int32))]
    assert_inference_fails("FusedMatMul", ints, {}, "float tensors")


# ---- LayerNorm ----------------------------------------------------------------------------------
@pytest.mark.parametrize("axis", [-1, 1, -2])
@pytest.mark.parametrize("with_bias", [False, True])
def test_layer_norm_matches_layer_normalization(axis, with_bias):
    x = randn(2, 3, 4, 5) * 3 + 1
    normalized = x.shape[axis:]
    scale, bias = randn(*normalized), (randn(*normalized) if with_bias else None)
    attrs = {"axis": axis, "epsilon": 1e-3}
    node = helper.make_node("LayerNormalization", ["x", "scale"] + (["bias"] if with_bias else []), ["y"], **attrs)
    check_op("LayerNorm", [("x", x), ("scale", scale), ("bias", bias)], attrs, [node])


def test_layer_norm_default_attributes_and_float16():
    x, scale, bias = randn(3, 7, 16, dtype=np.float16), randn(16, dtype=np.float16), randn(16, dtype=np.float16)
    node = helper.make_node("LayerNormalization", ["x", "scale", "bias"], ["y"])
    check_op("LayerNorm", [("x", x), ("scale", scale), ("bias", bias)], {}, [node])


def test_layer_norm_symbolic_dims():
    def feeds(binding):
        return [("x", randn(binding["batch"], binding["seq"], 32)), ("scale", randn(32)), ("bias", randn(32))]

    check_symbolic("LayerNorm", feeds, {"x": (sym("batch"), sym("seq"), 32)}, {},
                   [dict(batch=2, seq=5), dict(batch=1, seq=1)], expected="f32[batch, seq, 32]")


def test_layer_norm_rejects_bad_inputs():
    assert_inference_fails("LayerNorm", [("x", randn(2, 8)), ("scale", randn(7))], {}, "scale of shape")
    assert_inference_fails("LayerNorm", [("x", randn(2, 8)), ("scale", randn(8))], {"axis": 2}, "out of range")


# ---- Gelu ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("approximate", ["none", "tanh"])
@pytest.mark.parametrize("dtype", [np.float32, np.float16])
def test_gelu_matches_onnx_gelu(approximate, dtype):
    x = (randn(4, 33) * 3).astype(dtype)
    check_op("Gelu", [("x", x)], {"approximate": approximate},
             [helper.make_node("Gelu", ["x"], ["y"], approximate=approximate)])


def test_gelu_symbolic_dims():
    check_symbolic("Gelu", lambda b: [("x", randn(b["batch"], 64, 56, 56))], {"x": (sym("batch"), 64, 56, 56)}, {},
                   [dict(batch=1), dict(batch=2)], expected="f32[batch, 64, 56, 56]")


def test_gelu_rejects_unknown_approximation():
    assert_inference_fails("Gelu", [("x", randn(3))], {"approximate": "erf"}, "approximate")


# ---- Attention ----------------------------------------------------------------------------------
def attention_reference(scale: float, with_mask: bool) -> tuple[list[onnx.NodeProto], dict[str, np.ndarray]]:
    nodes = [helper.make_node("MatMul", ["q", "kt"], ["qk"]),
             helper.make_node("Mul", ["qk", "scale"], ["scores"])]
    last = "scores"
    if with_mask:
        nodes.append(helper.make_node("Add", ["scores", "mask"], ["masked"]))
        last = "masked"
    nodes += [helper.make_node("Softmax", [last], ["probs"], axis=-1),
              helper.make_node("MatMul", ["probs", "v"], ["y"])]
    return nodes, {"scale": np.array(scale, np.float32)}


@pytest.mark.parametrize("shapes", [
    ((2, 3, 4, 8), (2, 3, 8, 5), (2, 3, 5, 7), (2, 1, 4, 5)),
    ((2, 1, 4, 8), (3, 8, 5), (5, 7), (5,)),
    ((4, 8), (8, 6), (6, 3), None),
    ((2, 4, 8), (2, 8, 6), (1, 6, 3), (4, 6)),
])
def test_attention_matches_standard_ops(shapes):
    q_shape, kt_shape, v_shape, mask_shape = shapes
    q, kt, v = randn(*q_shape), randn(*kt_shape), randn(*v_shape)
    mask = None if mask_shape is None else np.where(RNG.random(mask_shape) < 0.3, -1e4, 0).astype(np.float32)
    scale = 1 / np.sqrt(q_shape[-1])
    nodes, inits = attention_reference(scale, mask is not None)
    check_op("Attention", [("q", q), ("kt", kt), ("v", v), ("mask", mask)], {"scale": float(scale)}, nodes, inits)


def test_attention_default_scale_and_float16():
    q, kt, v = (randn(*s, dtype=np.float16) for s in [(2, 5, 4), (2, 4, 6), (2, 6, 3)])
    nodes, inits = attention_reference(1.0, False)
    check_op("Attention", [("q", q), ("kt", kt), ("v", v)], {}, nodes, inits)


def test_attention_symbolic_dims():
    def feeds(binding):
        n, s = binding["batch"], binding["seq"]
        return [("q", randn(n, 8, s, 16)), ("kt", randn(n, 8, 16, s)), ("v", randn(n, 8, s, 16)),
                ("mask", randn(n, 1, 1, s))]

    seq, batch = sym("seq"), sym("batch")
    dims = {"q": (batch, 8, seq, 16), "kt": (batch, 8, 16, seq), "v": (batch, 8, seq, 16), "mask": (batch, 1, 1, seq)}
    check_symbolic("Attention", feeds, dims, {"scale": 0.25}, [dict(batch=2, seq=3), dict(batch=1, seq=9)],
                   expected="f32[batch, 8, seq, 16]")


def test_attention_rejects_bad_inputs():
    q, kt, v = randn(2, 4, 8), randn(2, 8, 6), randn(2, 6, 3)
    assert_inference_fails("Attention", [("q", q), ("kt", randn(2, 7, 6)), ("v", v)], {}, "differ in D")
    assert_inference_fails("Attention", [("q", q), ("kt", kt), ("v", randn(2, 5, 3))], {}, "differ in T")
    assert_inference_fails("Attention", [("q", q), ("kt", kt), ("v", v), ("mask", randn(3, 4, 6))], {},
                           "the mask of shape")
    assert_inference_fails("Attention", [("q", randn(8)), ("kt", kt), ("v", v)], {}, "rank >= 2")


@pytest.mark.parametrize("expr, keys", [
    ("mul(x0, add(x1, x2))", [30, 10, 20]),
    ("sub(relu(add(mul(x0, x1), x2)), x3)", [5, 9, 2, 5]),
    ("max(min(x0, x1), div(x2, x0))", [4, 4, 4]),
    ("sigmoid(add(mul(x1, -0.5), pow(x0, 2.0)))", [8, 3]),
])
def test_a_canonical_body_computes_the_same_values_bit_for_bit(expr, keys):
    # Elementwise's canonical form (inputs sorted by e-class, the arguments of add/mul/max/min
    # in text order) is the same function of the same tensors.
    from egraft.ir.ops.fused_elementwise import canonical_body, evaluate_expr

    rng = np.random.default_rng(len(expr))
    tensors = {k: rng.normal(size=(3, 5)) for k in set(keys)}
    positions, attrs = canonical_body({"expr": expr}, keys)
    kept = [keys[i] for i in positions]
    assert kept == sorted(keys)
    want = evaluate_expr(expr, [tensors[k] for k in keys])
    got = evaluate_expr(attrs["expr"], [tensors[k] for k in kept])
    np.testing.assert_array_equal(got, want)
    assert canonical_body(attrs, kept) == (list(range(len(kept))), attrs)  # canonical twice: the same

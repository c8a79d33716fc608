"""Generated convolution and pooling kernels (egraft/kernels/cpu/conv.py and pool.py) against
onnxruntime: Conv (groups, depthwise, strides, pads, dilations, auto_pad, 1-D), FusedConv
(residual, every activation), WinogradConv, MaxPool, AveragePool, the global pools and LRN,
and one compiled model serving several batch sizes.

The egraft-only ops are compared with an equivalent standard model (Conv + Add + the
activation op) run by onnxruntime.
"""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from conftest import check_compiled, run_onnxruntime
from onnx import TensorProto, helper, numpy_helper

import egraft
from egraft.ir.dims import sym
from egraft.ir.graph import Graph, Node, Value
from egraft.ir.infer import FreshDims, infer_node
from egraft.ir.ops.fused import ACTIVATIONS, DOMAIN
from egraft.ir.ops.winograd import winograd_weights
from egraft.ir.types import DType, TensorType
from egraft.kernels.cpu.conv import output_range, tap_range
from egraft.lowering.compile import compile_graph
from egraft.testing.models import scale_relative_error

RNG = np.random.default_rng(17)


def randn(*shape: int, dtype=np.float32) -> np.ndarray:
    return RNG.normal(size=shape).astype(dtype)


def op_model(op: str, x: np.ndarray, initializers: dict[str, np.ndarray] | None = None, opset: int = 18,
             x_dims: list | None = None, **attrs) -> onnx.ModelProto:
    """``y = op(x, *initializers) {attrs}``; an empty initializer name is an omitted input."""
    initializers = initializers or {}
    node = helper.make_node(op, ["x", *initializers], ["y"], **attrs)
    tensor = helper.np_dtype_to_tensor_dtype(x.dtype)
    inits = [numpy_helper.from_array(a, k) for k, a in initializers.items() if k]
    graph = helper.make_graph([node], "g", [helper.make_tensor_value_info("x", tensor, x_dims or list(x.shape))],
                              [helper.make_tensor_value_info("y", tensor, None)], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])


def check_against_reference(model: onnx.ModelProto, feeds: dict[str, np.ndarray], rtol: float,
                            atol: float) -> np.ndarray:
    """Compiled (all generated code) against egraft's numpy reference kernels, for the cases
    onnxruntime's CPU provider has no kernel for (float64 Conv and pools, 1-D or even LRN)."""
    graph = egraft.load(model)
    compiled = compile_graph(graph)
    assert not compiled.report().fallbacks, compiled.report().fallbacks
    got, want = compiled.run(feeds)["y"], graph.run(feeds)["y"]
    assert got.dtype == want.dtype and got.shape == want.shape
    np.testing.assert_allclose(got, want, rtol=rtol, atol=atol)
    return got


# ---- geometry helpers ------------------------------------------------------------------------------
def test_tap_and_output_ranges():
    assert tap_range(0, 5, 1, 1, 1, 3) == (1, 3)
    assert tap_range(4, 5, 1, 1, 1, 3) == (0, 2)
    assert tap_range(2, 5, 1, 2, 2, 3) == (0, 3)  # 2 - 2 + 2k in [0, 5) for k = 0, 1, 2
    assert tap_range(1, 5, 1, 2, 2, 3) == (1, 3)  # 1 - 2 + 2k: k = 0 reads -1
    assert output_range(0, 5, 5, 1, 1, 1) == (1, 5)
    assert output_range(2, 5, 5, 1, 1, 1) == (0, 4)
    assert output_range(0, 9, 5, 2, 1, 1) == (1, 5)
    for n, s, d, p, k, out in [(7, 2, 1, 3, 7, 4), (5, 1, 3, 0, 2, 2), (3, 3, 1, 2, 3, 2)]:
        for o in range(out):
            lo, hi = tap_range(o, n, s, d, p, k)
            assert [t for t in range(k) if 0 <= o * s - p + t * d < n] == list(range(lo, hi))
        for t in range(k):
            lo, hi = output_range(t, n, out, s, d, p)
            assert [o for o in range(out) if 0 <= o * s - p + t * d < n] == list(range(lo, hi))


# ---- Conv -----------------------------------------------------------------------------------------
CONV_CASES = [
    # (x shape, w shape, attrs)
    ((1, 3, 10, 12), (5, 3, 3, 3), dict(pads=[1, 1, 1, 1])),
    ((2, 4, 9, 8), (6, 4, 3, 3), dict()),
    ((1, 8, 17, 19), (8, 8, 3, 3), dict(strides=[2, 2], pads=[1, 1, 1, 1])),
    ((1, 4, 16, 30), (7, 4, 3, 3), dict(dilations=[2, 2], pads=[2, 2, 2, 2])),
    ((1, 4, 11, 13), (5, 4, 3, 3), dict(pads=[0, 2, 1, 0], strides=[2, 1], dilations=[1, 2])),
    ((2, 8, 20, 40), (6, 4, 3, 3), dict(group=2, pads=[1, 2, 0, 1])),
    ((1, 16, 14, 33), (16, 1, 3, 3), dict(group=16, pads=[1, 1, 1, 1])),  # depthwise
    ((1, 12, 15, 15), (24, 1, 3, 3), dict(group=12, strides=[2, 2], pads=[1, 1, 1, 1])),  # depthwise x2
    ((1, 6, 13, 11), (4, 6, 3, 3), dict(auto_pad="SAME_UPPER", strides=[2, 2])),
    ((1, 6, 12, 11), (4, 6, 4, 4), dict(auto_pad="SAME_LOWER")),
    ((1, 6, 12, 11), (4, 6, 2, 3), dict(auto_pad="VALID", strides=[1, 2])),
    ((2, 16, 9, 40), (13, 16, 1, 1), dict()),  # 1x1, 13 = 3 blocks of 4 and a tail
    ((1, 3, 30, 70), (9, 3, 5, 5), dict(pads=[2, 2, 2, 2])),  # several vector tiles per row
    ((1, 2, 5, 5), (3, 2, 7, 7), dict(pads=[3, 3, 3, 3])),  # the kernel wider than the image
    ((1, 2, 6, 6), (3, 2, 3, 3), dict(pads=[4, 0, 0, 5])),  # whole rows and columns of padding
    ((1, 3, 4, 5), (2, 3, 3, 3), dict(kernel_shape=[3, 3], pads=[1, 1, 1, 1], strides=[3, 3])),
    ((2, 4, 33), (6, 4, 3), dict(pads=[1, 1])),  # 1-D
    ((1, 6, 50), (4, 3, 5), dict(pads=[2, 1], strides=[2], dilations=[2], group=2)),  # 1-D strided, grouped
    # rows narrower than the host's vector (run on narrower vectors): 14, 7, 5 and 15 wide
    ((1, 24, 14, 14), (24, 1, 3, 3), dict(group=24, pads=[1, 1, 1, 1])),  # ShuffleNet's depthwise
    ((1, 16, 7, 7), (16, 1, 3, 3), dict(group=16, pads=[1, 1, 1, 1])),
    ((1, 8, 5, 15), (8, 1, 3, 3), dict(group=8, pads=[1, 1, 1, 1])),
    ((1, 12, 28, 28), (12, 1, 3, 3), dict(group=12, strides=[2, 2], pads=[1, 1, 1, 1])),  # 14 wide, strided
    ((1, 16, 7, 7), (24, 4, 1, 1), dict(group=4)),  # grouped 1x1 on a 7x7 map
]


@pytest.mark.parametrize("x_shape, w_shape, attrs", CONV_CASES)
@pytest.mark.parametrize("bias", [True, False])
def test_conv(x_shape, w_shape, attrs, bias):
    x, w = randn(*x_shape), randn(*w_shape)
    inits = {"w": w, **({"b": randn(w_shape[0])} if bias else {})}
    check_compiled(op_model("Conv", x, inits, **attrs), {"x": x}, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("x_shape, w_shape, attrs", [CONV_CASES[0], CONV_CASES[5], CONV_CASES[16]])
def test_conv_float64(x_shape, w_shape, attrs):
    x, w, b = randn(*x_shape, dtype=np.float64), randn(*w_shape, dtype=np.float64), randn(w_shape[0], dtype=np.float64)
    check_against_reference(op_model("Conv", x, {"w": w, "b": b}, **attrs), {"x": x}, rtol=1e-10, atol=1e-10)


def test_conv_with_computed_weights():
    """The weights as a graph input, not a constant: the kernel reads them from their buffer."""
    x, w, b = randn(2, 4, 10, 10), randn(6, 4, 3, 3), randn(6)
    node = helper.make_node("Conv", ["x", "w", "b"], ["y"], pads=[1, 1, 1, 1])
    graph = helper.make_graph([node], "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, list(x.shape)),
                                            helper.make_tensor_value_info("w", TensorProto.FLOAT, list(w.shape))],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
                              [numpy_helper.from_array(b, "b")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    check_compiled(model, {"x": x, "w": w}, rtol=1e-4, atol=1e-4)


def test_conv_symbolic_batch_one_compiled_model():
    w, b = randn(8, 4, 3, 3), randn(8)
    model = op_model("Conv", randn(1, 4, 12, 20), {"w": w, "b": b}, x_dims=["batch", 4, 12, 20],
                     pads=[1, 1, 1, 1], strides=[1, 1])
    compiled = compile_graph(egraft.load(model))
    assert not compiled.report().fallbacks
    for batch in (1, 3):
        x = randn(batch, 4, 12, 20)
        want = run_onnxruntime(model, {"x": x})["y"]
        got = compiled.run({"x": x})["y"]
        assert got.shape == want.shape == (batch, 8, 12, 20)
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)


def test_conv_3d_falls_back_with_a_reason():
    x, w = randn(1, 2, 4, 4, 4), randn(3, 2, 3, 3, 3)
    compiled = compile_graph(egraft.load(op_model("Conv", x, {"w": w})))
    (fallback,) = compiled.report().fallbacks
    assert "3-D convolution" in fallback[2]


def test_large_conv_scale_relative_error():
    x, w, b = randn(1, 64, 28, 28), randn(64, 64, 3, 3), randn(64)
    model = op_model("Conv", x, {"w": w, "b": b}, pads=[1, 1, 1, 1])
    got = check_compiled(model, {"x": x}, rtol=1e-3, atol=1e-3)["y"]
    assert scale_relative_error(got, run_onnxruntime(model, {"x": x})["y"]) <= 1e-5


# ---- FusedConv and WinogradConv (egraft ops: compared with standard models) -------------------------
def egraft_graph(op: str, inputs: list[tuple[str, np.ndarray | None]], attrs: dict,
                 dims: dict[str, tuple] | None = None) -> Graph:
    """A one-node IR graph ``y = op(inputs) {attrs}`` of a com.egraft op; a ``None`` array is an
    omitted input, ``dims`` overrides an input's declared shape (symbolic dims)."""
    dims = dims or {}
    values = [None if a is None else Value(name, TensorType(DType.from_numpy(a.dtype), dims.get(name, a.shape)))
              for name, a in inputs]
    node = Node(op, tuple(values), (Value("y", TensorType(DType.FLOAT32, None)),), dict(attrs), domain=DOMAIN)
    graph_inputs = [v for v in values if v is not None]
    probe = Graph("g", graph_inputs, [], [node], opsets={"": 18, DOMAIN: 1})
    y = Value("y", infer_node(probe, node, FreshDims())[0])
    graph = Graph("g", graph_inputs, [y], [node.replace(outputs=(y,))], opsets={"": 18, DOMAIN: 1})
    graph.validate()
    return graph


def activation_nodes(activation: str, params: list[float], x: str) -> tuple[list, dict]:
    """``y = activation(x)`` in standard opset-20 ops, and the initializers it needs."""
    simple = {"": "Identity", "relu": "Relu", "sigmoid": "Sigmoid", "hard_swish": "HardSwish", "tanh": "Tanh"}
    if activation in simple:
        return [helper.make_node(simple[activation], [x], ["y"])], {}
    if activation in ("gelu", "gelu_tanh"):
        return [helper.make_node("Gelu", [x], ["y"], approximate="tanh" if activation == "gelu_tanh" else "none")], {}
    if activation == "leaky_relu":
        return [helper.make_node("LeakyRelu", [x], ["y"], **({"alpha": params[0]} if params else {}))], {}
    if activation == "hard_sigmoid":
        return [helper.make_node("HardSigmoid", [x], ["y"], **dict(zip(["alpha", "beta"], params)))], {}
    if activation == "silu":  # x * sigmoid(x)
        sigmoid = helper.make_node("Sigmoid", [x], ["silu_sigmoid"])
        return [sigmoid, helper.make_node("Mul", [x, "silu_sigmoid"], ["y"])], {}
    assert activation == "clip"
    inits = {name: np.array(p, np.float32) for name, p in zip(["clip_min", "clip_max"], params)}
    return [helper.make_node("Clip", [x, *inits], ["y"])], inits


def reference_conv(feeds: dict[str, np.ndarray], bias: str | None, residual: str | None, conv_attrs: dict,
                   activation: str = "", params: list[float] | None = None) -> np.ndarray:
    """onnxruntime's ``activation(Conv(x, w, bias) + residual)``, every operand a graph input."""
    nodes = [helper.make_node("Conv", ["x", "w"] + ([bias] if bias else []), ["conv"], **conv_attrs)]
    last = "conv"
    if residual:
        nodes.append(helper.make_node("Add", ["conv", residual], ["sum"]))
        last = "sum"
    act, inits = activation_nodes(activation, params or [], last)
    inputs = [helper.make_tensor_value_info(k, TensorProto.FLOAT, list(v.shape)) for k, v in feeds.items()]
    graph = helper.make_graph(nodes + act, "reference", inputs, [onnx.ValueInfoProto(name="y")],
                              [numpy_helper.from_array(v, k) for k, v in inits.items()])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 20)], ir_version=9)
    return run_onnxruntime(model, feeds, exact=True)["y"]


def run_generated(graph: Graph, feeds: dict[str, np.ndarray]) -> np.ndarray:
    """Compile ``graph`` (every node must run generated code) and run it."""
    compiled = compile_graph(graph)
    assert not compiled.report().fallbacks, compiled.report().fallbacks
    assert [s.kind for s in compiled.steps] == ["kernel"]
    return compiled.run(feeds)["y"]


FUSED_GEOMETRY = [
    ((2, 4, 9, 17), (6, 4, 3, 3), dict(pads=[1, 1, 1, 1])),
    ((1, 4, 11, 13), (5, 4, 3, 3), dict(pads=[0, 2, 1, 0], strides=[2, 1], dilations=[1, 2])),
    ((1, 6, 13, 11), (6, 3, 3, 3), dict(auto_pad="SAME_UPPER", strides=[2, 2], group=2)),
    ((1, 8, 10, 20), (8, 1, 3, 3), dict(group=8, auto_pad="VALID")),
    ((2, 3, 21), (5, 3, 3), dict(strides=[2])),  # 1-D
]


@pytest.mark.parametrize("x_shape, w_shape, attrs", FUSED_GEOMETRY)
@pytest.mark.parametrize("bias, z_kind", [(True, "full"), (False, "full"), (True, "channel"), (True, None),
                                          (False, "row")])
def test_fused_conv_geometry_bias_and_residual(x_shape, w_shape, attrs, bias, z_kind):
    x, w = randn(*x_shape), randn(*w_shape)
    out_shape = reference_conv({"x": x, "w": w}, None, None, attrs).shape
    m, rank = w_shape[0], len(x_shape)
    z = {"full": lambda: randn(*out_shape), "channel": lambda: randn(m, *([1] * (rank - 2))),
         "row": lambda: randn(1, 1, out_shape[-1]), None: lambda: None}[z_kind]()
    b = randn(m) if bias else None
    graph = egraft_graph("FusedConv", [("x", x), ("w", w), ("b", b), ("z", z)], {**attrs, "activation": "relu"})
    feeds = {k: v for k, v in {"x": x, "w": w, "b": b, "z": z}.items() if v is not None}
    got = run_generated(graph, feeds)
    want = reference_conv(feeds, "b" if bias else None, "z" if z is not None else None, attrs, "relu")
    assert got.shape == want.shape
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("z_shape", [(6, 1, 1), (1, 6, 1, 1), (1, 1, 1), (1,)])
@pytest.mark.parametrize("bias", [True, False])
def test_fused_conv_constant_channel_residual_joins_the_bias(z_shape, bias):
    # A batch normalization's shift fused as a residual of one value per channel: the products
    # add it as their bias (one derived constant, bias + z), not as a broadcast residual.
    x, w, b, z = randn(2, 4, 9, 11), randn(6, 4, 3, 3), randn(6), randn(*z_shape)
    attrs = {"pads": [1, 1, 1, 1], "strides": [2, 1]}
    graph = Graph("g", [], [], [], opsets={"": 18, DOMAIN: 1})
    xv = Value("x", TensorType(DType.FLOAT32, x.shape))
    operands = (xv, graph.add_constant(w, "w"), graph.add_constant(b, "b") if bias else None,
                graph.add_constant(z, "z"))
    node = Node("FusedConv", operands, (Value("y", TensorType(DType.FLOAT32, None)),),
                {**attrs, "activation": "relu"}, domain=DOMAIN)
    probe = Graph("g", [xv], [], [node], constants=graph.constants, opsets=graph.opsets)
    y = Value("y", infer_node(probe, node, FreshDims())[0])
    graph = Graph("g", [xv], [y], [node.replace(outputs=(y,))], constants=graph.constants, opsets=graph.opsets)
    compiled = compile_graph(graph)
    assert any(name.endswith(".bias_and_residual") for name in compiled._lowered.slots), "not folded into the bias"
    got = compiled.run({"x": x})["y"]
    feeds = {"x": x, "w": w, **({"b": b} if bias else {}), "z": z}
    want = reference_conv(feeds, "b" if bias else None, "z", attrs, "relu")
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)


ACTIVATION_CASES = [(a, []) for a in ACTIVATIONS] + [
    ("leaky_relu", [0.2]), ("clip", [-0.5, 0.8]), ("clip", [-0.3]), ("hard_sigmoid", [0.3, 0.4])]


@pytest.mark.parametrize("activation, params", ACTIVATION_CASES)
def test_fused_conv_activations(activation, params):
    x, w, b, z = randn(1, 3, 7, 19), randn(4, 3, 3, 3), randn(4), randn(1, 4, 7, 19)
    attrs = {"pads": [1, 1, 1, 1]}
    graph = egraft_graph("FusedConv", [("x", x), ("w", w), ("b", b), ("z", z)],
                         {**attrs, "activation": activation, "activation_params": params})
    feeds = {"x": x, "w": w, "b": b, "z": z}
    got = run_generated(graph, feeds)
    want = reference_conv(feeds, "b", "z", attrs, activation, params)
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)


def test_fused_conv_symbolic_batch():
    w, b = randn(8, 4, 3, 3), randn(8)
    x1 = randn(1, 4, 10, 12)
    graph = egraft_graph("FusedConv", [("x", x1), ("w", w), ("b", b), ("z", randn(1, 8, 10, 12))],
                         {"pads": [1, 1, 1, 1], "activation": "relu"},
                         dims={"x": (sym("batch"), 4, 10, 12), "z": (sym("batch"), 8, 10, 12)})
    compiled = compile_graph(graph)
    assert not compiled.report().fallbacks
    for batch in (1, 3):
        x, z = randn(batch, 4, 10, 12), randn(batch, 8, 10, 12)
        feeds = {"x": x, "w": w, "b": b, "z": z}
        want = reference_conv(feeds, "b", "z", {"pads": [1, 1, 1, 1]}, "relu")
        np.testing.assert_allclose(compiled.run(feeds)["y"], want, rtol=1e-4, atol=1e-4)


WINOGRAD_CASES = [
    ((1, 3, 8, 8), 4, {}),
    ((2, 5, 7, 19), 3, {"pads": [1, 1, 1, 1]}),
    ((1, 4, 5, 6), 6, {"pads": [0, 2, 1, 0]}),
    ((1, 1, 1, 1), 2, {"pads": [1, 1, 1, 1]}),  # all padding around one pixel
    ((3, 6, 11, 4), 5, {"auto_pad": "SAME_UPPER"}),
    ((1, 7, 10, 25), 8, {"auto_pad": "VALID"}),
]


@pytest.mark.parametrize("x_shape, out_channels, attrs", WINOGRAD_CASES)
@pytest.mark.parametrize("given", ["transform and bias", "weights only"])
def test_winograd_conv(x_shape, out_channels, attrs, given):
    x, w = randn(*x_shape), randn(out_channels, x_shape[1], 3, 3)
    u, b = (winograd_weights(w), randn(out_channels)) if given == "transform and bias" else (None, None)
    graph = egraft_graph("WinogradConv", [("x", x), ("w", w), ("u", u), ("b", b)], attrs)
    feeds = {k: v for k, v in {"x": x, "w": w, "u": u, "b": b}.items() if v is not None}
    got = run_generated(graph, feeds)
    want = reference_conv({k: v for k, v in feeds.items() if k != "u"}, "b" if b is not None else None, None, attrs)
    assert got.shape == want.shape
    assert scale_relative_error(got, want) <= 1e-5


def test_winograd_conv_activation():
    x, w, b = randn(2, 4, 7, 16), randn(5, 4, 3, 3), randn(5)
    attrs = {"pads": [1, 1, 1, 1]}
    graph = egraft_graph("WinogradConv", [("x", x), ("w", w), ("u", winograd_weights(w)), ("b", b)],
                         {**attrs, "activation": "leaky_relu", "activation_params": [0.2]})
    got = run_generated(graph, {"x": x, "w": w, "u": winograd_weights(w), "b": b})
    want = reference_conv({"x": x, "w": w, "b": b}, "b", None, attrs, "leaky_relu", [0.2])
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)


# ---- pooling --------------------------------------------------------------------------------------
POOL_CASES = [
    # (x shape, attrs)
    ((2, 3, 9, 10), dict(kernel_shape=[3, 3])),
    ((1, 4, 12, 13), dict(kernel_shape=[3, 3], strides=[2, 2], pads=[1, 1, 1, 1])),
    ((1, 2, 11, 11), dict(kernel_shape=[2, 2], strides=[2, 2], ceil_mode=1)),
    ((1, 2, 10, 9), dict(kernel_shape=[3, 3], strides=[2, 2], pads=[1, 1, 1, 1], ceil_mode=1)),
    ((1, 3, 8, 15), dict(kernel_shape=[3, 2], pads=[0, 1, 2, 0], strides=[1, 2])),
    ((1, 3, 13, 13), dict(kernel_shape=[3, 3], auto_pad="SAME_UPPER", strides=[2, 2])),
    ((1, 3, 12, 12), dict(kernel_shape=[4, 4], auto_pad="SAME_LOWER", strides=[3, 3])),
    ((1, 3, 12, 11), dict(kernel_shape=[2, 3], auto_pad="VALID", strides=[2, 1])),
    ((2, 5, 40), dict(kernel_shape=[5], strides=[3], pads=[2, 2])),  # 1-D
    ((1, 2, 7, 30), dict(kernel_shape=[5, 5], pads=[2, 2, 2, 2])),
]


@pytest.mark.parametrize("x_shape, attrs", POOL_CASES + [
    ((1, 3, 12, 14), dict(kernel_shape=[3, 3], dilations=[2, 2], pads=[1, 1, 1, 1])),
    ((1, 3, 11, 14), dict(kernel_shape=[2, 2], dilations=[2, 3], strides=[2, 2], ceil_mode=1))])
def test_max_pool(x_shape, attrs):
    x = randn(*x_shape)
    check_compiled(op_model("MaxPool", x, **attrs), {"x": x}, rtol=0, atol=0)


@pytest.mark.parametrize("x_shape, attrs", POOL_CASES)
@pytest.mark.parametrize("count_include_pad", [0, 1])
def test_average_pool(x_shape, attrs, count_include_pad):
    x = randn(*x_shape)
    model = op_model("AveragePool", x, count_include_pad=count_include_pad, **attrs)
    check_compiled(model, {"x": x}, rtol=1e-5, atol=1e-6)


def lane_window(attrs: dict) -> dict:
    """A 2-D pool's attributes as the 3-D window of the blocked layout: the lane axis has window 1."""
    lanes = dict(kernel_shape=[*attrs["kernel_shape"], 1])
    for name, extra in (("strides", 1), ("dilations", 1)):
        if name in attrs:
            lanes[name] = [*attrs[name], extra]
    if "pads" in attrs:
        p = attrs["pads"]
        lanes["pads"] = [p[0], p[1], 0, p[2], p[3], 0]
    return {**attrs, **lanes}


@pytest.mark.parametrize("op", ["MaxPool", "AveragePool"])
@pytest.mark.parametrize("x_shape, attrs", [case for case in POOL_CASES
                                            if len(case[0]) == 4 and "auto_pad" not in case[1]])
def test_pools_on_the_blocked_layout_run_generated(op, x_shape, attrs):
    """A 3-D window whose last axis is 8 lanes with window 1 (pooling [N, C/8, H, W, 8]) is the
    2-D pool on vectors of lanes: generated code, equal to onnxruntime's 3-D pool."""
    x = randn(*x_shape[:3], x_shape[3], 8)
    extra = {"count_include_pad": 1} if op == "AveragePool" else {}
    model = op_model(op, x, **lane_window(attrs), **extra)
    check_compiled(model, {"x": x}, rtol=1e-6 if op == "AveragePool" else 0, atol=1e-6 if op == "AveragePool" else 0)


def test_pools_float64_and_symbolic_batch():
    model = op_model("MaxPool", randn(1, 3, 9, 9), x_dims=["batch", 3, 9, 9], kernel_shape=[3, 3], strides=[2, 2],
                     pads=[1, 1, 1, 1])
    compiled = compile_graph(egraft.load(model))
    assert not compiled.report().fallbacks
    for batch in (1, 3):
        x = randn(batch, 3, 9, 9)
        np.testing.assert_array_equal(compiled.run({"x": x})["y"], run_onnxruntime(model, {"x": x})["y"])
    x = randn(2, 3, 9, 8, dtype=np.float64)
    check_against_reference(op_model("AveragePool", x, kernel_shape=[3, 3], pads=[1, 1, 1, 1]), {"x": x},
                            rtol=1e-12, atol=0)


def test_max_pool_with_indices_falls_back():
    x = randn(1, 2, 6, 6)
    node = helper.make_node("MaxPool", ["x"], ["y", "i"], kernel_shape=[2, 2])
    graph = helper.make_graph([node], "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 2, 6, 6])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, None),
                               helper.make_tensor_value_info("i", TensorProto.INT64, None)])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    compiled = compile_graph(egraft.load(model))
    (fallback,) = compiled.report().fallbacks
    assert "Indices" in fallback[2]
    check_compiled(model, {"x": x}, generated=False, rtol=0, atol=0)


@pytest.mark.parametrize("op", ["GlobalAveragePool", "GlobalMaxPool"])
@pytest.mark.parametrize("shape", [(2, 5, 7, 9), (1, 3, 17), (1, 2, 3, 4, 5), (3, 64, 1, 1)])
def test_global_pools(op, shape):
    x = randn(*shape)
    check_compiled(op_model(op, x), {"x": x}, rtol=1e-5, atol=1e-6)


def test_global_pools_symbolic_batch_and_float64():
    model = op_model("GlobalAveragePool", randn(1, 8, 6, 6), x_dims=["batch", 8, 6, 6])
    compiled = compile_graph(egraft.load(model))
    assert not compiled.report().fallbacks
    for batch in (1, 3):
        x = randn(batch, 8, 6, 6)
        np.testing.assert_allclose(compiled.run({"x": x})["y"], run_onnxruntime(model, {"x": x})["y"], rtol=1e-5,
                                   atol=1e-6)
    x = randn(2, 4, 5, 5, dtype=np.float64)
    check_against_reference(op_model("GlobalMaxPool", x), {"x": x}, rtol=0, atol=0)


@pytest.mark.parametrize("shape, attrs", [
    ((2, 8, 5, 6), dict(size=3)),
    ((1, 10, 7, 7), dict(size=5, alpha=1e-3, beta=0.75, bias=2.0)),
    ((1, 6, 4, 9), dict(size=4, alpha=0.1, beta=0.5, bias=1.0)),  # an even window: one more channel after
    ((1, 5, 3, 3), dict(size=7, alpha=0.05, beta=1.0)),  # the window wider than the channels
    ((2, 4, 11), dict(size=3, alpha=0.2, beta=0.6, bias=0.5)),  # 1-D, a general power
])
def test_lrn(shape, attrs):
    x = randn(*shape)
    if len(shape) == 4 and attrs["size"] % 2:
        check_compiled(op_model("LRN", x, **attrs), {"x": x}, rtol=1e-5, atol=1e-6)
    else:  # onnxruntime's LRN takes 4-D inputs and odd sizes only
        check_against_reference(op_model("LRN", x, **attrs), {"x": x}, rtol=1e-5, atol=1e-6)


@pytest.mark.usefixtures("split_every_parallel_kernel")
def test_lrn_channels_are_shared_over_threads():
    """Inception-v1's LRNs: each part computes its share of the output channels, reading the
    window of input channels around them (shares of 7 and 6 of 13 channels here)."""
    x = randn(2, 13, 5, 6)
    compiled = compile_graph(egraft.load(op_model("LRN", x, size=5, alpha=1e-3, beta=0.75, bias=2.0)))
    (step,) = compiled.steps
    assert step.parallel
    want = run_onnxruntime(op_model("LRN", x, size=5, alpha=1e-3, beta=0.75, bias=2.0), {"x": x})["y"]
    for threads in (1, 2):
        compiled.threads = threads
        np.testing.assert_allclose(compiled.run({"x": x})["y"], want, rtol=1e-5, atol=1e-6)


def test_lrn_symbolic_batch():
    model = op_model("LRN", randn(1, 6, 4, 4), x_dims=["batch", 6, 4, 4], size=3, alpha=0.01)
    compiled = compile_graph(egraft.load(model))
    assert not compiled.report().fallbacks
    for batch in (1, 3):
        x = randn(batch, 6, 4, 4)
        np.testing.assert_allclose(compiled.run({"x": x})["y"], run_onnxruntime(model, {"x": x})["y"], rtol=1e-5,
                                   atol=1e-6)

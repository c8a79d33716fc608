"""Specialization: the Winograd F(2x2, 3x3) ops (egraft/ir/ops/winograd.py) against onnxruntime's Conv,
the rules that offer them (egraft/rules/specialization.rules), and binding symbolic dims, after which
the shape arithmetic folds away.

Example: the Winograd kernel against the reference convolution::

    y = winograd_graph(types, attrs).run(feeds)["y"]        # WinogradConv(x, w, U, b)
    scale_relative_error(y, ort(conv_model))  <= 1e-4
"""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from conftest import run_onnxruntime
from onnx import TensorProto, helper, numpy_helper

import egraft
from egraft.errors import ShapeInferenceError
from egraft.extract.cost import as_cost_model
from egraft.extract.extractor import extract
from egraft.extract.greedy import FREE_OPS, extract_graph
from egraft.extract.program import rebuild_graph, rebuild_outputs
from egraft.ir.graph import Graph, Node, Value
from egraft.ir.infer import FreshDims, infer_node
from egraft.ir.ops.fused import DOMAIN
from egraft.ir.ops.winograd import WINOGRAD_G, winograd_weights
from egraft.ir.types import DType, TensorType
from egraft.optimize import optimize
from egraft.rewrite.egraph import EGraphState, ENode
from egraft.rewrite.engine import saturate
from egraft.rewrite.load import load_rules
from egraft.testing.models import scale_relative_error

RNG = np.random.default_rng(11)
OPSETS = {"": 18, DOMAIN: 1}


def randn(*shape: int, dtype=np.float32) -> np.ndarray:
    return RNG.normal(size=shape).astype(dtype)


# ---- one-node graphs and reference models ---------------------------------------------------------
def op_graph(op: str, inputs: list[tuple[str, np.ndarray | None]], attrs: dict | None = None) -> Graph:
    """A validated one-node IR graph ``y = op(inputs) {attrs}`` of the egraft op ``op``; a ``None``
    array is an omitted input. Example: ``op_graph("WinogradWeights", [("w", w)])``."""
    values = [None if a is None else Value(name, TensorType(DType.from_numpy(a.dtype), a.shape)) for name, a in inputs]
    node = Node(op, tuple(values), (Value("y", TensorType(DType.FLOAT32, None)),), dict(attrs or {}), domain=DOMAIN)
    graph_inputs = [v for v in values if v is not None]
    probe = Graph("g", graph_inputs, [], [node], opsets=dict(OPSETS))
    y = Value("y", infer_node(probe, node, FreshDims())[0])
    graph = Graph("g", graph_inputs, [y], [node.replace(outputs=(y,))], opsets=dict(OPSETS))
    graph.validate()
    return graph


def conv_model(x: np.ndarray, w: np.ndarray, b: np.ndarray | None, attrs: dict, opset: int = 18) -> onnx.ModelProto:
    """``y = Conv(x, w, b) {attrs}`` with x a float32 input and w, b initializers."""
    inits = [numpy_helper.from_array(w, "w")] + ([numpy_helper.from_array(b, "b")] if b is not None else [])
    names = ["x", "w"] + (["b"] if b is not None else [])
    graph = helper.make_graph([helper.make_node("Conv", names, ["y"], **attrs)], "conv",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, list(x.shape))],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])


def onnxruntime_conv(x, w, b, attrs) -> np.ndarray:
    feeds = {"x": x.astype(np.float32)}
    return run_onnxruntime(conv_model(feeds["x"], w.astype(np.float32), None if b is None else b.astype(np.float32),
                                      attrs), feeds, exact=True)["y"]


# ---- the Winograd ops -----------------------------------------------------------------------------
WINOGRAD_CASES = [
    # (N, C, H, W, O, Conv attributes)
    (1, 3, 8, 8, 4, {}),
    (2, 5, 7, 9, 3, {"pads": [1, 1, 1, 1]}),
    (1, 4, 5, 6, 6, {"pads": [0, 2, 1, 0]}),
    (1, 2, 3, 3, 2, {}),  # one output pixel
    (1, 1, 1, 1, 2, {"pads": [1, 1, 1, 1]}),  # all padding around one pixel
    (3, 6, 11, 4, 5, {"auto_pad": "SAME_UPPER"}),
    (1, 3, 6, 13, 2, {"auto_pad": "SAME_LOWER", "kernel_shape": [3, 3]}),
    (1, 7, 10, 5, 8, {"auto_pad": "VALID", "strides": [1, 1], "dilations": [1, 1], "group": 1}),
]


@pytest.mark.parametrize("n,c,h,wd,o,attrs", WINOGRAD_CASES)
@pytest.mark.parametrize("given", ["transform", "weights only"])
def test_winograd_conv_equals_onnxruntime_conv(n, c, h, wd, o, attrs, given):
    x, w, b = randn(n, c, h, wd), randn(o, c, 3, 3), randn(o)
    u = winograd_weights(w) if given == "transform" else None
    graph = op_graph("WinogradConv", [("x", x), ("w", w), ("u", u), ("b", b)], attrs)
    feeds = {"x": x, "w": w, "b": b, **({"u": u} if u is not None else {})}
    ours = graph.run(feeds)["y"]
    want = onnxruntime_conv(x, w, b, attrs)
    assert ours.shape == want.shape == tuple(graph.outputs[0].type.shape)
    assert scale_relative_error(ours, want) <= 1e-4
    exported = run_onnxruntime(egraft.to_onnx(graph), feeds, exact=True)["y"]  # body: Conv(X, W, B)
    assert scale_relative_error(exported, want) <= 1e-5


@pytest.mark.parametrize("dtype", [np.float64, np.float16])
def test_winograd_conv_in_other_float_types(dtype):
    x, w = randn(2, 3, 6, 7, dtype=dtype), randn(4, 3, 3, 3, dtype=dtype)
    graph = op_graph("WinogradConv", [("x", x), ("w", w)], {"pads": [1, 1, 1, 1]})
    ours = graph.run({"x": x, "w": w})["y"]
    assert ours.dtype == dtype
    want = onnxruntime_conv(x, w, None, {"pads": [1, 1, 1, 1]})
    assert scale_relative_error(ours, want) <= (2e-3 if dtype == np.float16 else 1e-5)


@pytest.mark.parametrize(("activation", "params", "onnx_op", "onnx_attrs"), [
    ("relu", [], "Relu", {}),
    ("leaky_relu", [0.2], "LeakyRelu", {"alpha": 0.2}),
    ("clip", [-0.5, 0.7], None, {}),
])
def test_winograd_conv_with_an_activation_equals_onnxruntime(activation, params, onnx_op, onnx_attrs):
    x, w, b = randn(2, 4, 7, 6), randn(5, 4, 3, 3), randn(5)
    attrs = {"pads": [1, 1, 1, 1], "activation": activation, "activation_params": params}
    graph = op_graph("WinogradConv", [("x", x), ("w", w), ("u", winograd_weights(w)), ("b", b)], attrs)
    conv = onnxruntime_conv(x, w, b, {"pads": [1, 1, 1, 1]}).astype(np.float64)
    if onnx_op == "Relu":
        want = np.maximum(conv, 0)
    elif onnx_op == "LeakyRelu":
        want = np.where(conv < 0, 0.2 * conv, conv)
    else:
        want = np.clip(conv, -0.5, 0.7)
    feeds = {"x": x, "w": w, "u": winograd_weights(w), "b": b}
    assert scale_relative_error(graph.run(feeds)["y"], want) <= 1e-4
    exported = run_onnxruntime(egraft.to_onnx(graph), feeds, exact=True)["y"]  # body: act(Conv(X, W, B))
    assert scale_relative_error(exported, want) <= 1e-5


def test_a_fused_conv_gets_a_winograd_twin_with_its_activation():
    # Conv 3x3 -> BatchNormalization -> Relu: folding and fusion make one FusedConv {relu},
    # whose twin is one WinogradConv {relu}; a compute-poor profile picks it.
    from egraft.extract.cost import Roofline
    from egraft.extract.profiles import Profile

    # (an image large enough for Winograd's tiles to pay: the cost model prices the padded tiles)
    x, w = randn(1, 32, 40, 40), randn(32, 32, 3, 3)
    scale, shift, mean = randn(32), randn(32), randn(32)
    var = RNG.uniform(0.5, 1.5, 32).astype(np.float32)
    inits = [numpy_helper.from_array(a, k) for k, a in (("w", w), ("s", scale), ("t", shift), ("m", mean),
                                                         ("v", var))]
    nodes = [helper.make_node("Conv", ["x", "w"], ["c"], pads=[1, 1, 1, 1]),
             helper.make_node("BatchNormalization", ["c", "s", "t", "m", "v"], ["n"]),
             helper.make_node("Relu", ["n"], ["y"])]
    model = helper.make_model(helper.make_graph(
        nodes, "conv_bn_relu", [helper.make_tensor_value_info("x", TensorProto.FLOAT, list(x.shape))],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)], inits),
        opset_imports=[helper.make_opsetid("", 17)])
    slow_arithmetic = Roofline(Profile("slow", "cpu", peak_gflops=10.0, bandwidth_gbs=1000.0, launch_us=1.0))
    result = optimize(egraft.load(model), rules_off=["layout"], cost=slow_arithmetic, extractor="ilp")
    [node] = result.graph.nodes
    assert (node.op, node.attrs.get("activation")) == ("WinogradConv", "relu")
    assert result.saturation.rules["winograd_fused_conv"].applied == 1
    want = run_onnxruntime(model, {"x": x}, exact=True)["y"]
    assert scale_relative_error(result.graph.run({"x": x})["y"], want) <= 1e-4
    assert scale_relative_error(run_onnxruntime(egraft.to_onnx(result.graph), {"x": x}, exact=True)["y"], want) <= 1e-4


def test_winograd_weights_are_g_w_gt_and_export():
    w = randn(3, 2, 3, 3)
    graph = op_graph("WinogradWeights", [("w", w)])
    ours = graph.run({"w": w})["y"]
    assert str(graph.outputs[0].type) == "f32[3, 2, 4, 4]"
    g = WINOGRAD_G
    expected = np.einsum("ab,oibc,dc->oiad", g, w.astype(np.float64), g)
    np.testing.assert_allclose(ours, expected, rtol=1e-5, atol=1e-5)
    # the corners of G w G^T are the kernel's corners
    np.testing.assert_allclose(ours[..., 0, 0], w[..., 0, 0], rtol=1e-6)
    np.testing.assert_allclose(ours[..., 3, 3], w[..., 2, 2], rtol=1e-6)
    exported = run_onnxruntime(egraft.to_onnx(graph), {"w": w}, exact=True)["y"]
    np.testing.assert_allclose(exported, ours, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("w_shape,u_shape,attrs,message", [
    ((4, 3, 5, 5), None, {}, "3x3 filters"),
    ((4, 3, 3, 3), None, {"strides": [2, 2]}, "unit strides"),
    ((4, 3, 3, 3), None, {"dilations": [1, 2]}, "unit strides and dilations"),
    ((4, 3, 3, 3), (4, 3, 3, 3), {}, "it must be \\[4, 3, 4, 4\\]"),
])
def test_winograd_conv_inference_refuses_what_it_cannot_compute(w_shape, u_shape, attrs, message):
    inputs = [("x", randn(1, 3, 6, 6)), ("w", randn(*w_shape)), ("u", None if u_shape is None else randn(*u_shape))]
    with pytest.raises(ShapeInferenceError, match=message):
        op_graph("WinogradConv", inputs, attrs)


# ---- the rules --------------------------------------------------------------------------------------
def conv_net(opset: int = 17) -> onnx.ModelProto:
    """x -> Conv 3x3 (bias, pads 1) -> Conv 3x3 (no bias) -> Conv 3x3 stride 2 -> Conv 5x5 -> grouped Conv 3x3."""
    specs = [("a", 6, 3, True, {"pads": [1, 1, 1, 1]}), ("b", 6, 3, False, {}),
             ("c", 4, 3, True, {"strides": [2, 2], "pads": [1, 1, 1, 1]}), ("d", 4, 5, True, {"pads": [2, 2, 2, 2]}),
             ("e", 4, 3, True, {"group": 2, "pads": [1, 1, 1, 1]})]
    nodes, inits, prev, channels = [], [], "x", 3
    for name, out, k, bias, attrs in specs:
        inits.append(numpy_helper.from_array(randn(out, channels // attrs.get("group", 1), k, k) * 0.3, f"w_{name}"))
        inputs = [prev, f"w_{name}"]
        if bias:
            inits.append(numpy_helper.from_array(randn(out), f"b_{name}"))
            inputs.append(f"b_{name}")
        nodes.append(helper.make_node("Conv", inputs, [name], **attrs))
        prev, channels = name, out
    graph = helper.make_graph(nodes, "convs", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3, 9, 11])],
                              [helper.make_tensor_value_info("e", TensorProto.FLOAT, None)], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])


def winograd_cost(node: ENode) -> float:
    """Node count, with a WinogradConv at half the price of a Conv."""
    if node.op in FREE_OPS:
        return 0.0
    return 0.5 if node.op == "WinogradConv" else 1.0


@pytest.mark.parametrize("opset", [11, 17])
def test_3x3_stride_1_convs_get_a_winograd_twin_with_folded_weights(opset):
    model = conv_net(opset)
    rules = [r for f in load_rules() if f.ruleset in ("folding", "specialization") for r in f.rules]
    state = EGraphState.from_graph(egraft.load(model))
    report = saturate(state, rules)
    assert report.rules["winograd_conv"].applied == 1  # conv a (conv e is grouped, c strided, d 5x5)
    assert report.rules["winograd_conv_without_bias"].applied == 1  # conv b
    graph = extract_graph(state.snapshot(), cost=winograd_cost)
    assert graph.op_histogram() == {"WinogradConv": 2, "Conv": 3}
    for node in graph.nodes:
        if node.op == "WinogradConv":  # the transform was computed at compile time: a constant of G w G^T
            u, w = (graph.constants[node.inputs[i].const] for i in (2, 1))
            np.testing.assert_allclose(u, winograd_weights(w), rtol=1e-6)
    feeds = {"x": randn(2, 3, 9, 11)}
    reference = run_onnxruntime(model, feeds, exact=True)["e"]
    assert scale_relative_error(graph.run(feeds)["e"], reference) <= 1e-4
    exported = run_onnxruntime(egraft.to_onnx(graph), feeds, exact=True)["e"]
    assert scale_relative_error(exported, reference) <= 1e-5
    # by node count the plain Convs stay (a tie, broken towards the standard op)
    assert "WinogradConv" not in extract_graph(state.snapshot()).op_histogram()


@pytest.mark.parametrize("extractor", ["greedy", "ilp"])
def test_unfolded_winograd_weights_are_never_extracted(extractor):
    """A saturation that stops before folding G w G^T (a deadline, folding switched off) leaves
    WinogradConv(x, w, WinogradWeights(w)): extraction takes the plain Conv instead of running
    the transform on every call, however cheap the cost model calls WinogradConv."""
    model = conv_net(17)
    rules = [r for f in load_rules() if f.ruleset == "specialization" for r in f.rules]  # no folding
    state = EGraphState.from_graph(egraft.load(model))
    assert saturate(state, rules).rules["winograd_conv"].applied == 1
    snapshot = state.snapshot()
    roots = [c for c, _, _ in rebuild_outputs(snapshot)]
    cost = as_cost_model(lambda n: 0.0 if n.op == "WinogradWeights" else winograd_cost(n))  # free, if it could
    chosen = extract(snapshot, cost, extractor, roots)
    graph = rebuild_graph(snapshot, chosen.choice)
    assert graph.op_histogram() == {"Conv": 5}
    feeds = {"x": randn(2, 3, 9, 11)}
    assert scale_relative_error(graph.run(feeds)["e"], run_onnxruntime(model, feeds, exact=True)["e"]) <= 1e-5


def test_a_compile_without_folding_runs_every_node_on_generated_code():
    """64 -> 64 channels on 28x28, where the roofline model prefers Winograd once G w G^T is a
    constant (without the shipped profile's per-call cost of a Winograd kernel, which keeps it
    for large layers only); with folding off it is not, so the plain Conv is compiled."""
    from dataclasses import replace

    from egraft.extract.cost import Roofline
    from egraft.extract.profiles import load_profile

    flops_only = Roofline(replace(load_profile("cpu-host"), call_us={}))
    x, w = randn(1, 64, 28, 28), randn(64, 64, 3, 3)
    model = conv_model(x, w, randn(64), {"pads": [1, 1, 1, 1]})
    folded = egraft.compile(model, use_cache=False, specialize="off", cost=flops_only)
    assert "WinogradConv" in folded.graph.op_histogram()
    compiled = egraft.compile(model, rules_off=["folding"], use_cache=False, specialize="off", cost=flops_only)
    assert compiled.report().fallbacks == []
    assert not {"WinogradConv", "WinogradWeights"} & set(compiled.graph.op_histogram())
    reference = run_onnxruntime(model, {"x": x}, exact=True)["y"]
    assert scale_relative_error(compiled.run({"x": x})["y"], reference) <= 1e-4


# ---- binding symbolic dims --------------------------------------------------------------------------
def reshape_by_shape_model() -> onnx.ModelProto:
    """x f32[batch, 4, 6] -> Reshape(x, Concat(Gather(Shape(x), 0), [-1])) -> MatMul -> Expand to
    Concat(Gather(Shape(x), 0), [3, 5]): shape arithmetic that binding batch makes constant."""
    nodes = [
        helper.make_node("Shape", ["x"], ["s"]),
        helper.make_node("Gather", ["s", "zero"], ["n"], axis=0),
        helper.make_node("Unsqueeze", ["n", "axes0"], ["n1"]),
        helper.make_node("Concat", ["n1", "minus_one"], ["flat_shape"], axis=0),
        helper.make_node("Reshape", ["x", "flat_shape"], ["flat"]),
        helper.make_node("MatMul", ["flat", "w"], ["h"]),
        helper.make_node("Unsqueeze", ["h", "axes1"], ["h3"]),
        helper.make_node("Concat", ["n1", "three_five"], ["wide_shape"], axis=0),
        helper.make_node("Expand", ["h3", "wide_shape"], ["y"]),
    ]
    inits = {"zero": np.array(0, np.int64), "axes0": np.array([0], np.int64), "axes1": np.array([1], np.int64),
             "minus_one": np.array([-1], np.int64), "three_five": np.array([3, 5], np.int64), "w": randn(24, 5)}
    graph = helper.make_graph(nodes, "reshape_by_shape",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 4, 6])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 3, 5])],
                              [numpy_helper.from_array(v, k) for k, v in inits.items()])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


@pytest.mark.parametrize("batch", [1, 3])
def test_binding_the_batch_folds_the_shape_arithmetic(batch):
    model = reshape_by_shape_model()
    graph = egraft.load(model)
    generic = optimize(graph)
    assert "Shape" in generic.graph.op_histogram()  # the batch is unknown: the arithmetic stays
    special = optimize(graph, bindings={"batch": batch})
    # no Shape, Gather or Concat: the Reshape and Expand targets are constants (Unsqueeze(h) is data)
    assert special.graph.op_histogram() == {"Reshape": 1, "MatMul": 1, "Unsqueeze": 1, "Expand": 1}
    assert str(special.graph.outputs[0].type) == f"f32[{batch}, 3, 5]"
    x = randn(batch, 4, 6)
    reference = run_onnxruntime(model, {"x": x}, exact=True)["y"]
    assert scale_relative_error(special.graph.run({"x": x})["y"], reference) <= 1e-6
    assert scale_relative_error(generic.graph.run({"x": x})["y"], reference) <= 1e-6
    exported = run_onnxruntime(egraft.to_onnx(special.graph), {"x": x}, exact=True)["y"]
    assert scale_relative_error(exported, reference) <= 1e-6


def test_a_chain_of_constant_ops_folds_whole_before_saturation_rounds_run_out():
    """Binding n makes Range(0, n) and the 12 ops after it constants (T5's relative-position
    bias on [seq, seq]); they fold to one constant even when saturation gets 2 rounds, since
    the folding rules run to a fixpoint first. The result matches onnxruntime."""
    from egraft.rewrite.engine import Budget

    ints = {k: numpy_helper.from_array(np.array(v, np.int64), k) for k, v in (("zero", 0), ("one", 1), ("axis0", [0]),
                                                                                ("axis1", [1]))}
    nodes = [helper.make_node("Shape", ["x"], ["s"]), helper.make_node("Gather", ["s", "one"], ["n"]),
             helper.make_node("Range", ["zero", "n", "one"], ["r"]),
             helper.make_node("Unsqueeze", ["r", "axis0"], ["row"]),
             helper.make_node("Unsqueeze", ["r", "axis1"], ["col"]),
             helper.make_node("Sub", ["row", "col"], ["d"]), helper.make_node("Abs", ["d"], ["a"]),
             helper.make_node("Cast", ["a"], ["f"], to=TensorProto.FLOAT),
             helper.make_node("Add", ["f", "onef"], ["f1"]), helper.make_node("Log", ["f1"], ["l"]),
             helper.make_node("Mul", ["l", "half"], ["m"]), helper.make_node("Neg", ["m"], ["g"]),
             helper.make_node("Exp", ["g"], ["e"]), helper.make_node("Add", ["x", "e"], ["y"])]
    inits = [*ints.values(), numpy_helper.from_array(np.array(1.0, np.float32), "onef"),
             numpy_helper.from_array(np.array(0.5, np.float32), "half")]
    model = helper.make_model(helper.make_graph(
        nodes, "bias", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", "n"])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)], inits),
        opset_imports=[helper.make_opsetid("", 17)])
    result = optimize(egraft.load(model), bindings={"n": 12}, budget=Budget(iterations=2))
    assert [n.op for n in result.graph.nodes] == ["Add"]
    assert result.saturation.rules["fold_constants"].applied >= 10
    x = np.random.default_rng(3).normal(size=(12, 12)).astype(np.float32)
    want = run_onnxruntime(model, {"x": x})["y"]
    np.testing.assert_allclose(result.graph.run({"x": x})["y"], want, rtol=1e-6, atol=1e-6)

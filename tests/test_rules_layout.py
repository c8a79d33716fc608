"""The layout rules (egraft/rules/layout.rules) and their ops (egraft/ir/ops/layout.py): ConvNHWC,
LayoutToBlocked, LayoutFromBlocked and ConvNCHWc.

Each op's numpy kernel is checked against onnxruntime twice: against its own ONNX definition (the
exported model-local function) and against the standard Conv on the standard layout. Each rule is
checked on a small model written with onnx.helper: it fires, and the program extracted with a cost
that prefers the new form computes what onnxruntime computes on the original model.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import onnx
import pytest
from conftest import run_onnxruntime
from onnx import TensorProto, helper, numpy_helper

import egraft
from egraft.errors import ShapeInferenceError
from egraft.extract.greedy import FREE_OPS, extract_graph
from egraft.ir.dims import sym
from egraft.ir.graph import Graph, Node, Value
from egraft.ir.infer import FreshDims, infer_node
from egraft.ir.ops.layout import DOMAIN, from_blocked, to_blocked
from egraft.ir.types import DType, TensorType
from egraft.optimize import optimize
from egraft.rewrite.egraph import EGraphState, ENode
from egraft.rewrite.engine import SaturationReport, saturate
from egraft.rewrite.load import SHIPPED_DIR, load_rules

RNG = np.random.default_rng(0)
OPSETS = {"": 18, DOMAIN: 1}
F32 = DType.FLOAT32


def randn(*shape: int, dtype=np.float32) -> np.ndarray:
    return RNG.normal(size=shape).astype(dtype)


# ---- one-node graphs of the layout ops ----------------------------------------------------------
def layout_graph(op: str, inputs: list[tuple[str, TensorType]], attrs: dict | None = None) -> Graph:
    """A validated one-node IR graph ``y = com.egraft::op(inputs) {attrs}``, typed by the op's inference.

    Example: ``layout_graph("LayoutToBlocked", [("x", TensorType(F32, (1, 8, 2, 2)))])``.
    """
    values = [Value(name, t) for name, t in inputs]
    node = Node(op, tuple(values), (Value("y", TensorType(F32, None)),), dict(attrs or {}), domain=DOMAIN)
    probe = Graph("g", values, [], [node], opsets=dict(OPSETS))
    y = Value("y", infer_node(probe, node, FreshDims())[0])
    graph = Graph("g", values, [y], [node.replace(outputs=(y,))], opsets=dict(OPSETS))
    graph.validate()
    return graph


def typed(feeds: dict[str, np.ndarray]) -> list[tuple[str, TensorType]]:
    return [(name, TensorType.of(a)) for name, a in feeds.items()]


def run_kernel_and_export(graph: Graph, feeds: dict[str, np.ndarray]) -> np.ndarray:
    """egraft's kernel result, after checking that onnxruntime runs the exported function to it."""
    ours = graph.run(feeds)["y"]
    model = egraft.to_onnx(graph)
    onnx.checker.check_model(model)
    assert [f.domain for f in model.functions] == [DOMAIN]
    exported = run_onnxruntime(model, feeds, exact=True)["y"]
    assert exported.dtype == ours.dtype and exported.shape == ours.shape
    tolerance = 2e-3 if ours.dtype == np.float16 else 1e-5
    np.testing.assert_allclose(exported.astype(np.float64), ours.astype(np.float64), rtol=tolerance, atol=tolerance)
    return ours


def standard_conv(x: np.ndarray, w: np.ndarray, b: np.ndarray | None, attrs: dict) -> np.ndarray:
    """onnxruntime's Conv of NCHW ``x`` in float32 (the reference for the layout convolutions)."""
    feeds = {"x": x.astype(np.float32), "w": w.astype(np.float32)}
    if b is not None:
        feeds["b"] = b.astype(np.float32)
    graph = helper.make_graph([helper.make_node("Conv", list(feeds), ["y"], **attrs)], "conv",
                              [helper.make_tensor_value_info(k, TensorProto.FLOAT, v.shape) for k, v in feeds.items()],
                              [onnx.ValueInfoProto(name="y")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)], ir_version=9)
    return run_onnxruntime(model, feeds, exact=True)["y"]


def assert_close(got: np.ndarray, want: np.ndarray) -> None:
    if got.dtype == np.float16:
        rtol, atol = 5e-3, 5e-3 * max(1.0, float(np.abs(want).max()))
    else:
        rtol, atol = 1e-5, 1e-5 * max(1.0, float(np.abs(want).max()))
    np.testing.assert_allclose(got.astype(np.float64), want.astype(np.float64), rtol=rtol, atol=atol)


# ---- the ops -------------------------------------------------------------------------------------
CONV_CASES = [
    dict(),
    dict(pads=[1, 1, 1, 1]),
    dict(pads=[0, 2, 1, 0], strides=[2, 1], dilations=[1, 2]),
    dict(auto_pad="SAME_UPPER", strides=[2, 2]),
    dict(group=2),
]


@pytest.mark.parametrize("attrs", CONV_CASES)
@pytest.mark.parametrize("dtype", [np.float32, np.float16])
@pytest.mark.parametrize("bias", [True, False])
def test_conv_nhwc_is_conv_on_channels_last_tensors(attrs, dtype, bias):
    x, w = randn(2, 7, 6, 8, dtype=dtype), randn(16, 8 // attrs.get("group", 1), 3, 3, dtype=dtype)
    feeds = {"x": x, "w": w, **({"b": randn(16, dtype=dtype)} if bias else {})}
    ours = run_kernel_and_export(layout_graph("ConvNHWC", typed(feeds), attrs), feeds)
    want = standard_conv(x.transpose(0, 3, 1, 2), w, feeds.get("b"), attrs).transpose(0, 2, 3, 1)
    assert ours.dtype == dtype and ours.shape == want.shape
    assert_close(ours, want)


@pytest.mark.parametrize("shape", [(2, 16, 3, 5), (1, 8, 4), (3, 24, 2, 2, 2)])
def test_blocked_layout_puts_channel_c_in_block_c_div_8_lane_c_mod_8(shape):
    x = randn(*shape)
    blocked = run_kernel_and_export(layout_graph("LayoutToBlocked", typed({"x": x}), {"block": 8}), {"x": x})
    n, c = shape[:2]
    assert blocked.shape == (n, c // 8, *shape[2:], 8)
    for channel in (0, 5, c - 1):
        np.testing.assert_array_equal(blocked[:, channel // 8, ..., channel % 8], x[:, channel])
    back = run_kernel_and_export(layout_graph("LayoutFromBlocked", typed({"x": blocked}), {"block": 8}),
                                 {"x": blocked})
    np.testing.assert_array_equal(back, x)


@pytest.mark.parametrize("attrs", CONV_CASES)
@pytest.mark.parametrize("block", [4, 8])
def test_conv_nchwc_is_conv_on_blocked_tensors(attrs, block):
    x, w, b = randn(2, 8, 7, 6), randn(16, 8 // attrs.get("group", 1), 3, 3), randn(16)
    feeds = {"x": to_blocked(x, block), "w": w, "b": b}
    ours = run_kernel_and_export(layout_graph("ConvNCHWc", typed(feeds), {**attrs, "block": block}), feeds)
    want = standard_conv(x, w, b, attrs)
    assert ours.shape == to_blocked(want, block).shape
    assert_close(from_blocked(ours, block), want)


@pytest.mark.parametrize("activation, params", [("relu", []), ("clip", [-0.5, 0.5]), ("", [])])
@pytest.mark.parametrize("dtype", [np.float32, np.float16])
def test_conv_nchwc_applies_fused_convs_epilogue_in_the_blocked_layout(activation, params, dtype):
    x, w, b = randn(2, 8, 7, 6, dtype=dtype), randn(16, 8, 3, 3, dtype=dtype), randn(16, dtype=dtype)
    z = randn(2, 16, 7, 6, dtype=dtype)
    feeds = {"x": to_blocked(x, 8), "w": w, "b": b, "z": to_blocked(z, 8)}
    attrs = {"pads": [1, 1, 1, 1], "activation": activation, "activation_params": params}
    ours = run_kernel_and_export(layout_graph("ConvNCHWc", typed(feeds), attrs), feeds)
    want = standard_conv(x, w, b, {"pads": [1, 1, 1, 1]}) + z.astype(np.float32)
    if activation == "relu":
        want = np.maximum(want, 0)
    elif activation == "clip":
        want = np.clip(want, *params)
    assert ours.dtype == dtype
    assert_close(from_blocked(ours, 8), want.astype(dtype))


def test_layout_ops_keep_a_symbolic_batch():
    batch = sym("batch")
    nhwc = layout_graph("ConvNHWC", [("x", TensorType(F32, (batch, 7, 7, 8))), ("w", TensorType(F32, (16, 8, 3, 3)))],
                        {"pads": [1, 1, 1, 1]})
    assert str(nhwc.outputs[0].type) == "f32[batch, 7, 7, 16]"
    blocked = layout_graph("LayoutToBlocked", [("x", TensorType(F32, (batch, 16, 5, 5)))])
    assert str(blocked.outputs[0].type) == "f32[batch, 2, 5, 5, 8]"
    conv = layout_graph("ConvNCHWc", [("x", blocked.outputs[0].type), ("w", TensorType(F32, (24, 16, 3, 3)))],
                        {"strides": [2, 2]})
    assert str(conv.outputs[0].type) == "f32[batch, 3, 2, 2, 8]"
    back = layout_graph("LayoutFromBlocked", [("x", conv.outputs[0].type)])
    assert str(back.outputs[0].type) == "f32[batch, 24, 2, 2]"
    x = randn(3, 16, 5, 5)
    exported = run_onnxruntime(egraft.to_onnx(blocked), {"x": x}, exact=True)["y"]
    np.testing.assert_array_equal(exported, to_blocked(x, 8))


@pytest.mark.parametrize("op, inputs, attrs, message", [
    ("LayoutToBlocked", [(2, 12, 3, 3)], {}, "not a known multiple of block 8"),
    ("LayoutToBlocked", [(2, sym("c"), 3, 3)], {"block": 4}, "not a known multiple of block 4"),
    ("LayoutFromBlocked", [(2, 2, 3, 3, 4)], {}, "must be the block 8"),
    ("ConvNCHWc", [(1, 1, 5, 5, 8), (12, 8, 3, 3)], {}, "12 .* not a known multiple of block 8"),
    ("ConvNHWC", [(1, 5, 5, 6), (4, 8, 3, 3)], {}, "6 channels but the weights expect 8"),
    ("ConvNHWC", [(1, 5, 5, 8), (4, 8, 3, 3), (3,)], {}, "one entry per output channel"),
])
def test_layout_ops_refuse_shapes_that_do_not_fit(op, inputs, attrs, message):
    typed_inputs = [(f"i{k}", TensorType(F32, shape)) for k, shape in enumerate(inputs)]
    with pytest.raises(ShapeInferenceError, match=message):
        layout_graph(op, typed_inputs, attrs)


# ---- models and saturation -------------------------------------------------------------------------
def make_model(nodes: list[onnx.NodeProto], inputs: dict[str, list], output: str,
               inits: dict[str, np.ndarray] | None = None, opset: int = 17) -> onnx.ModelProto:
    """A float32 model of ``nodes`` with the given inputs (name -> dims), one output and initializers."""
    graph = helper.make_graph(
        nodes, "m", [helper.make_tensor_value_info(k, TensorProto.FLOAT, dims) for k, dims in inputs.items()],
        [onnx.ValueInfoProto(name=output)], [numpy_helper.from_array(v, k) for k, v in (inits or {}).items()])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])


def shipped_rules(*names: str):
    paths = [SHIPPED_DIR / f"{name}.rules" for name in names]
    return [rule for f in load_rules(paths, include_shipped=False) for rule in f.rules]


def saturated(model: onnx.ModelProto, rule_sets: tuple[str, ...] = ("layout",)) -> tuple[EGraphState, SaturationReport]:
    """The model's e-graph saturated under the shipped rule sets named (the layout rules alone by default)."""
    state = EGraphState.from_graph(egraft.load(model))
    report = saturate(state, shipped_rules(*rule_sets))
    assert report.stop_reason == "saturated"
    return state, report


def prefer(**costs: float) -> Callable[[ENode], float]:
    """A cost model: ``costs[op]`` for the ops named, 1 for every other op, 0 for leaves.

    Example: ``prefer(ConvNHWC=0, Conv=10)`` makes a channels-last Conv between two Transposes
    (cost 2) cheaper than the standard Conv (10).
    """
    def cost(node: ENode) -> float:
        return 0.0 if node.op in FREE_OPS else float(costs.get(node.op, 1.0))

    return cost


def assert_matches_onnxruntime(graph: Graph, model: onnx.ModelProto, feeds: dict[str, np.ndarray]) -> None:
    """``graph`` (run by egraft, and exported and run by onnxruntime) computes what onnxruntime
    computes on the original ``model``."""
    graph.validate()
    want = run_onnxruntime(model, feeds, exact=True)
    ours = graph.run(feeds)
    exported = run_onnxruntime(egraft.to_onnx(graph), feeds, exact=True)
    for name, ref in want.items():
        assert_close(ours[name], ref)
        assert_close(exported[name], ref)


def ops(graph: Graph) -> list[str]:
    return [n.op for n in graph.nodes]


def conv_weights(cin: int, cout: int, name: str, bias: bool = True) -> dict[str, np.ndarray]:
    return {f"w{name}": randn(cout, cin, 3, 3) * 0.3, **({f"b{name}": randn(cout)} if bias else {})}


def conv(x: str, name: str, bias: bool = True, **attrs) -> onnx.NodeProto:
    inputs = [x, f"w{name}"] + ([f"b{name}"] if bias else [])
    return helper.make_node("Conv", inputs, [f"conv{name}"], pads=[1, 1, 1, 1], **attrs)


# ---- conversions -------------------------------------------------------------------------------------
@pytest.mark.parametrize("bias", [True, False])
def test_conv_to_nhwc_gives_a_channels_last_conv(bias):
    model = make_model([conv("x", "1", bias, strides=[2, 1])], {"x": [2, 8, 7, 6]}, "conv1",
                       conv_weights(8, 12, "1", bias))
    state, report = saturated(model)
    assert report.rules["conv_to_nhwc" if bias else "conv_to_nhwc/without_b"].applied == 1
    graph = extract_graph(state.snapshot(), prefer(ConvNHWC=0, Conv=10))
    assert ops(graph) == ["Transpose", "ConvNHWC", "Transpose"]
    assert graph.nodes[0].attrs["perm"] == [0, 2, 3, 1] and graph.nodes[2].attrs["perm"] == [0, 3, 1, 2]
    assert graph.nodes[1].attrs["strides"] == [2, 1]
    assert_matches_onnxruntime(graph, model, {"x": randn(2, 8, 7, 6)})


@pytest.mark.parametrize("bias", [True, False])
def test_conv_to_blocked_gives_a_blocked_conv(bias):
    model = make_model([conv("x", "1", bias)], {"x": [2, 16, 5, 5]}, "conv1",
                       {"w1": randn(24, 16, 3, 3), **({"b1": randn(24)} if bias else {})})
    state, report = saturated(model)
    assert report.rules["conv_to_blocked" if bias else "conv_to_blocked/without_b"].applied == 1
    graph = extract_graph(state.snapshot(), prefer(ConvNCHWc=0, Conv=10))
    assert ops(graph) == ["LayoutToBlocked", "ConvNCHWc", "LayoutFromBlocked"]
    assert all(n.attrs["block"] == 8 for n in graph.nodes)
    assert_matches_onnxruntime(graph, model, {"x": randn(2, 16, 5, 5)})


def test_a_grouped_conv_stays_in_the_standard_layout():
    """The blocked kernels compute ungrouped and depthwise convolutions; another grouped one keeps NCHW."""
    model = make_model([conv("x", "1", group=2)], {"x": [2, 16, 5, 5]}, "conv1",
                       {"w1": randn(24, 8, 3, 3), "b1": randn(24)})
    _, report = saturated(model)
    assert report.rules["conv_to_blocked"].applied == 0
    assert report.rules["depthwise_conv_to_blocked"].applied == 0
    assert report.rules["conv_to_nhwc"].applied == 1


def test_a_depthwise_conv_and_its_hard_swish_go_blocked():
    """MobileNetV3's depthwise Conv + HardSwish: one blocked ConvNCHWc {group = C, activation =
    hard_swish} between the layout conversions, matching onnxruntime."""
    nodes = [conv("x", "1", group=16), helper.make_node("HardSwish", ["conv1"], ["y"])]
    model = make_model(nodes, {"x": [1, 16, 9, 9]}, "y", {"w1": randn(16, 1, 3, 3), "b1": randn(16)})
    state, report = saturated(model, ("fusion", "layout"))
    assert report.rules["depthwise_conv_to_blocked"].applied == 1
    assert report.rules["blocked_conv_activation/HardSwish"].applied == 1
    graph = extract_graph(state.snapshot(), prefer(ConvNCHWc=0, Conv=10, FusedConv=10, HardSwish=10))
    assert ops(graph) == ["LayoutToBlocked", "ConvNCHWc", "LayoutFromBlocked"]
    (blocked,) = [n for n in graph.nodes if n.op == "ConvNCHWc"]
    assert blocked.attrs["group"] == 16 and blocked.attrs["activation"] == "hard_swish"
    assert_matches_onnxruntime(graph, model, {"x": randn(1, 16, 9, 9)})
    compiled = egraft.compile(model)  # the cost model's pick (at this size, the standard layout)
    x = randn(1, 16, 9, 9)
    np.testing.assert_allclose(compiled.run({"x": x})["y"], run_onnxruntime(model, {"x": x})["y"], rtol=1e-4,
                               atol=1e-5)


@pytest.mark.parametrize("cin, cout", [(12, 16), (16, 12)])
def test_conv_to_blocked_needs_channels_in_blocks_of_8(cin, cout):
    model = make_model([conv("x", "1")], {"x": [1, cin, 5, 5]}, "conv1", conv_weights(cin, cout, "1"))
    _, report = saturated(model)
    assert report.rules["conv_to_blocked"].applied == 0
    assert report.rules["conv_to_blocked"].guard_refused >= 1
    assert report.rules["conv_to_nhwc"].applied == 1


def test_a_conv_that_folding_absorbs_is_converted_only_once_folded():
    """Conv -> BatchNormalization: the bias-less Conv feeds a BatchNormalization of constants, so only
    the Conv that folding makes of the two gets a channels-last form."""
    channels = 8
    stats = {name: RNG.uniform(0.5, 1.5, channels).astype(np.float32) for name in ("scale", "shift", "mean", "var")}
    nodes = [conv("x", "1", bias=False), helper.make_node("BatchNormalization", ["conv1", *stats], ["y"])]
    model = make_model(nodes, {"x": [2, 8, 5, 5]}, "y", {**conv_weights(8, channels, "1", bias=False), **stats})
    state, report = saturated(model, ("folding", "layout"))
    assert report.rules["fold_bn_into_conv_without_bias"].applied == 1
    assert report.rules["conv_to_nhwc/without_b"].applied == 0
    assert report.rules["conv_to_nhwc/without_b"].guard_refused >= 1
    assert report.rules["conv_to_nhwc"].applied == 1
    graph = extract_graph(state.snapshot(), prefer(ConvNHWC=0, Conv=10, BatchNormalization=10))
    assert ops(graph) == ["Transpose", "ConvNHWC", "Transpose"]
    assert_matches_onnxruntime(graph, model, {"x": randn(2, 8, 5, 5)})


def chain_model(batch="batch", residual: bool = False, final_relu: bool = False) -> onnx.ModelProto:
    """Conv -> Relu -> Conv (-> + the Relu's output when ``residual``, -> Relu when ``final_relu``)
    on x [batch, 8, 6, 6]."""
    nodes = [conv("x", "1"), helper.make_node("Relu", ["conv1"], ["relu1"]), conv("relu1", "2")]
    if residual:
        nodes.append(helper.make_node("Add", ["conv2", "relu1"], ["sum"]))
    output = "sum" if residual else "conv2"
    if final_relu:
        nodes.append(helper.make_node("Relu", [output], ["out"]))
        output = "out"
    inits = {**conv_weights(8, 16, "1"), **conv_weights(16, 16 if residual else 8, "2")}
    return make_model(nodes, {"x": [batch, 8, 6, 6]}, output, inits)


def test_a_conv_relu_conv_chain_runs_channels_last_with_only_the_edge_transposes():
    """Relu carries the first Conv's closing Transpose out, where it cancels against the second
    Conv's opening one. Conv costs 10 here: at 1, the two forms tie (3 each) and the tie goes to
    the standard Conv."""
    model = chain_model()
    state, report = saturated(model)
    assert report.rules["unary_through_transpose/Relu"].applied >= 1
    assert report.rules["cancel_inverse_transposes"].applied >= 1
    assert report.rules["cancel_inverse_transposes"].guard_refused >= 1  # known equalities are not restated
    graph = extract_graph(state.snapshot(), prefer(ConvNHWC=0, Conv=10))
    assert ops(graph) == ["Transpose", "ConvNHWC", "Relu", "ConvNHWC", "Transpose"]
    assert all(str(v.type).startswith("f32[batch,") for n in graph.nodes for v in n.outputs)
    assert str(graph.outputs[0].type) == "f32[batch, 8, 6, 6]"
    for batch in (1, 3):
        assert_matches_onnxruntime(graph, model, {"x": randn(batch, 8, 6, 6)})


def test_a_conv_relu_conv_chain_runs_blocked_with_only_the_edge_conversions():
    model = chain_model()
    state, report = saturated(model)
    assert report.rules["relu_through_unblock"].applied >= 1
    assert report.rules["cancel_round_trip/LayoutToBlocked"].applied >= 1
    graph = extract_graph(state.snapshot(), prefer(ConvNCHWc=0, Conv=10))
    assert ops(graph) == ["LayoutToBlocked", "ConvNCHWc", "Relu", "ConvNCHWc", "LayoutFromBlocked"]
    assert str(graph.nodes[2].outputs[0].type) == "f32[batch, 2, 6, 6, 8]"
    assert_matches_onnxruntime(graph, model, {"x": randn(2, 8, 6, 6)})


@pytest.mark.parametrize("costs, expected", [
    (dict(ConvNHWC=0, Conv=10), ["Transpose", "ConvNHWC", "Relu", "ConvNHWC", "Add", "Transpose"]),
    (dict(ConvNCHWc=0, Conv=10), ["LayoutToBlocked", "ConvNCHWc", "Relu", "ConvNCHWc", "Add", "LayoutFromBlocked"]),
])
def test_a_residual_add_stays_in_the_other_layout(costs, expected):
    model = chain_model(residual=True)
    state, report = saturated(model)
    assert report.rules["add_through_transposes"].applied >= 1
    assert report.rules["add_through_unblock/Add"].applied >= 1
    graph = extract_graph(state.snapshot(), prefer(**costs))
    assert ops(graph) == expected
    assert_matches_onnxruntime(graph, model, {"x": randn(2, 8, 6, 6)})


def test_a_residual_block_runs_as_two_fused_blocked_convs():
    """Conv -> Relu -> Conv -> Add -> Relu: with fusion, both Relus and the residual addition
    become the blocked convs' epilogues (blocked_conv_relu, blocked_conv_add_relu), the input
    and output converted once."""
    model = chain_model(residual=True, final_relu=True)
    state, report = saturated(model, ("layout", "fusion"))
    assert report.rules["blocked_conv_relu"].applied >= 1
    assert report.rules["blocked_conv_add_relu/Add"].applied >= 1
    graph = extract_graph(state.snapshot(), prefer(ConvNCHWc=0, Conv=10, FusedConv=10))
    assert ops(graph) == ["LayoutToBlocked", "ConvNCHWc", "ConvNCHWc", "LayoutFromBlocked"]
    first, second = graph.nodes[1], graph.nodes[2]
    assert first.attrs["activation"] == second.attrs["activation"] == "relu"
    assert second.inputs[3] is not None and second.inputs[3].name == first.outputs[0].name
    assert_matches_onnxruntime(graph, model, {"x": randn(2, 8, 6, 6)})


def test_layout_forms_stay_out_with_the_node_count_cost():
    model = chain_model(batch=2)
    state, report = saturated(model)
    assert report.rules["conv_to_nhwc"].applied == 2 and report.rules["conv_to_blocked"].applied == 2
    assert ops(extract_graph(state.snapshot())) == ["Conv", "Relu", "Conv"]


# ---- transposes ------------------------------------------------------------------------------------
def transpose(x: str, y: str, perm: list[int] | None) -> onnx.NodeProto:
    return helper.make_node("Transpose", [x], [y], **({"perm": perm} if perm is not None else {}))


@pytest.mark.parametrize("p, q, dims", [
    ([0, 2, 3, 1], [0, 3, 1, 2], [2, 3, 4, 5]),
    ([1, 0], [1, 0], [3, 4]),
    (None, None, ["batch", 3, 4]),
    (None, [2, 1, 0], [2, 3, 4]),
])
def test_inverse_transposes_cancel_with_the_default_cost(p, q, dims):
    nodes = [transpose("x", "t", p), transpose("t", "u", q), helper.make_node("Relu", ["u"], ["y"])]
    model = make_model(nodes, {"x": dims}, "y")
    result = optimize(egraft.load(model))
    assert result.saturation.rules["cancel_inverse_transposes"].applied >= 1
    assert ops(result.graph) == ["Relu"]
    assert str(result.graph.outputs[0].type) == str(result.source.outputs[0].type)
    feeds = {"x": randn(*[2 if d == "batch" else d for d in dims])}
    assert_matches_onnxruntime(result.graph, model, feeds)


@pytest.mark.parametrize("p, q, composed", [
    ([0, 2, 3, 1], [0, 2, 3, 1], [0, 3, 1, 2]),
    ([1, 0, 2], [0, 2, 1], [1, 2, 0]),
    (None, [1, 2, 0], [1, 0, 2]),
])
def test_two_transposes_compose_into_one(p, q, composed):
    nodes = [transpose("x", "t", p), transpose("t", "y", q)]
    model = make_model(nodes, {"x": [2, 3, 4, 5][: len(composed)]}, "y")
    result = optimize(egraft.load(model))
    assert result.saturation.rules["compose_transposes"].applied >= 1
    assert ops(result.graph) == ["Transpose"] and result.graph.nodes[0].attrs["perm"] == composed
    assert_matches_onnxruntime(result.graph, model, {"x": randn(*[2, 3, 4, 5][: len(composed)])})


ELEMENTWISE_CASES = [
    ("unary_through_transpose/Relu", "Relu", False),
    ("unary_through_transpose/Sigmoid", "Sigmoid", False),
    ("unary_through_transpose/Tanh", "Tanh", False),
    ("unary_through_transpose/Neg", "Neg", False),
    ("unary_through_transpose/Abs", "Abs", False),
    ("scalar_through_transpose/Mul", "Mul", "after"),
    ("scalar_through_transpose/Mul", "Mul", "before"),  # Mul is commutative: one rule, both orders
    ("scalar_through_transpose/Add", "Add", "after"),
    ("scalar_through_transpose/Add", "Add", "before"),
]


@pytest.mark.parametrize("rule, op, scalar", ELEMENTWISE_CASES)
def test_elementwise_ops_carry_a_transpose_out_to_its_inverse(rule, op, scalar):
    """Transpose(op(Transpose(x, p)), p^-1) -> op(x): the op carries the first Transpose out,
    where it cancels against the second."""
    inputs = {"t": ["t", "c"], "after": ["t", "c"], "before": ["c", "t"]}[scalar or "t"][: 2 if scalar else 1]
    nodes = [transpose("x", "t", [0, 2, 3, 1]), helper.make_node(op, inputs, ["e"]),
             transpose("e", "y", [0, 3, 1, 2])]
    model = make_model(nodes, {"x": ["batch", 3, 4, 5]}, "y", {"c": np.array(0.75, np.float32)} if scalar else {})
    result = optimize(egraft.load(model))
    assert result.saturation.rules[rule].applied == 1
    assert ops(result.graph) == [op]
    assert str(result.graph.outputs[0].type) == "f32[batch, 3, 4, 5]"
    assert_matches_onnxruntime(result.graph, model, {"x": randn(2, 3, 4, 5)})


def test_a_transpose_does_not_move_past_a_broadcasting_operand():
    nodes = [transpose("x", "t", [0, 2, 3, 1]), helper.make_node("Mul", ["t", "c"], ["e"]),
             transpose("e", "y", [0, 3, 1, 2])]
    model = make_model(nodes, {"x": [2, 3, 4, 5]}, "y", {"c": randn(3)})
    _, report = saturated(model)
    assert report.rules["scalar_through_transpose/Mul"].guard_refused >= 1
    assert report.rules["scalar_through_transpose/Mul"].applied == 0


# ---- MatMul and Gemm -------------------------------------------------------------------------------
@pytest.mark.parametrize("side", ["a", "b"])
def test_matmul_of_a_transpose_becomes_gemm(side):
    shapes = {"a": [6, 4], "b": [6, 5]} if side == "a" else {"a": [4, 6], "b": [5, 6]}
    nodes = [transpose(side, "t", [1, 0]),
             helper.make_node("MatMul", ["t", "b"] if side == "a" else ["a", "t"], ["y"])]
    model = make_model(nodes, shapes, "y")
    result = optimize(egraft.load(model))
    assert result.saturation.rules[f"matmul_transposed_{side}_to_gemm"].applied == 1
    assert ops(result.graph) == ["Gemm"]
    assert result.graph.nodes[0].attrs == {f"trans{side.upper()}": 1}
    assert_matches_onnxruntime(result.graph, model, {k: randn(*v) for k, v in shapes.items()})


def test_matmul_becomes_gemm_only_where_gemm_needs_no_c():
    nodes = [transpose("a", "t", [1, 0]), helper.make_node("MatMul", ["t", "b"], ["y"])]
    model = make_model(nodes, {"a": [6, 4], "b": [6, 5]}, "y", opset=9)
    result = optimize(egraft.load(model))
    assert result.saturation.rules["matmul_transposed_a_to_gemm"].guard_refused >= 1
    assert ops(result.graph) == ["Transpose", "MatMul"]


@pytest.mark.parametrize("side", ["A", "B"])
@pytest.mark.parametrize("trans", [0, 1])
@pytest.mark.parametrize("with_c", [True, False])
def test_gemm_absorbs_a_transposed_operand(side, trans, with_c):
    """Gemm(Transpose(a), b) {transA = t} -> Gemm(a, b) {transA = 1 - t}; the same for B."""
    shapes = {"a": [4, 6], "b": [6, 5], **({"c": [5]} if with_c else {})}  # op(A) [M, K], op(B) [K, N]
    operand = shapes[side.lower()] if trans == 0 else shapes[side.lower()][::-1]  # what Gemm is given
    shapes[side.lower()] = operand[::-1]  # ... is the Transpose of the model's input
    operands = ["t", "b"] if side == "A" else ["a", "t"]
    gemm = helper.make_node("Gemm", operands + (["c"] if with_c else []), ["y"], alpha=0.5, **{f"trans{side}": trans})
    nodes = [transpose(side.lower(), "t", [1, 0]), gemm]
    model = make_model(nodes, shapes, "y")
    result = optimize(egraft.load(model))
    rule = f"gemm_transposed_{side.lower()}" + ("" if with_c else "/without_c")
    assert result.saturation.rules[rule].applied == 1
    assert ops(result.graph) == ["Gemm"]
    assert result.graph.nodes[0].attrs[f"trans{side}"] == 1 - trans
    assert result.graph.nodes[0].attrs["alpha"] == pytest.approx(0.5)
    assert_matches_onnxruntime(result.graph, model, {k: randn(*v) for k, v in shapes.items()})


@pytest.mark.parametrize("branches, axis", [(2, 1), (3, -3), (4, 1)])
def test_a_channel_concat_of_blocked_branches_stays_blocked(branches, axis):
    """Concat of whole blocks of channels is the Concat of the blocked tensors along their
    block axis: a fire module's (or an Inception block's) branches meet without leaving the
    blocked layout, and the compiled model computes what onnxruntime does."""
    rng = np.random.default_rng(8)
    inits = [numpy_helper.from_array(rng.normal(0, 0.2, (32, 16, 1, 1)).astype(np.float32), "ws")]
    nodes = [helper.make_node("Conv", ["x", "ws"], ["s0"]), helper.make_node("Relu", ["s0"], ["s"])]
    for i in range(branches):
        k = 3 if i % 2 else 1
        inits.append(numpy_helper.from_array(rng.normal(0, 0.2, (16 + 8 * i, 32, k, k)).astype(np.float32), f"w{i}"))
        nodes += [helper.make_node("Conv", ["s", f"w{i}"], [f"c{i}"], pads=[k // 2] * 4),
                  helper.make_node("Relu", [f"c{i}"], [f"e{i}"])]
    width = sum(16 + 8 * i for i in range(branches))
    inits.append(numpy_helper.from_array(rng.normal(0, 0.2, (24, width, 1, 1)).astype(np.float32), "wo"))
    nodes += [helper.make_node("Concat", [f"e{i}" for i in range(branches)], ["cat"], axis=axis),
              helper.make_node("Conv", ["cat", "wo"], ["y"])]
    graph = helper.make_graph(nodes, "fire", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 16, 28, 28])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    name = {2: "concat_through_unblock", 3: "concat3_through_unblock", 4: "concat4_through_unblock"}[branches]
    assert optimize(egraft.load(model)).saturation.rules[name].applied
    compiled = egraft.compile(model)
    (concat,) = [s for s in compiled.steps if s.node.op == "Concat"]
    if all(v.type.rank == 5 for v in concat.node.inputs):  # the extractor's choice: blocked here, when it pays
        assert concat.node.attrs["axis"] == 1
    x = rng.normal(0, 1, (1, 16, 28, 28)).astype(np.float32)
    np.testing.assert_allclose(compiled.run({"x": x})["y"], run_onnxruntime(model, {"x": x})["y"], rtol=1e-4,
                               atol=1e-4)


def dense_block_model(layers: int = 3, growth: int = 16, width: int = 32, side: int = 28) -> onnx.ModelProto:
    """DenseNet's block: c_0 = Conv(x); c_i = Concat(c_i-1, Conv3x3(Relu(Conv1x1(Relu(BN(c_i-1)))))),
    then a BatchNormalization and ReLU of the last concatenation (x: f32[1, 16, side, side])."""
    rng = np.random.default_rng(11)
    nodes = [helper.make_node("Conv", ["x", "w0"], ["c0"], kernel_shape=[1, 1])]
    inits = {"w0": rng.normal(0, 0.3, (width, 16, 1, 1))}

    def batchnorm(source: str, channels: int, name: str) -> str:
        for p, a in {"s": rng.uniform(0.5, 2, channels), "t": rng.normal(size=channels),
                     "m": rng.normal(size=channels), "v": rng.uniform(0.2, 2, channels)}.items():
            inits[f"{name}_{p}"] = a
        nodes.append(helper.make_node("BatchNormalization", [source] + [f"{name}_{p}" for p in "stmv"], [name]))
        nodes.append(helper.make_node("Relu", [name], [name + "_r"]))
        return name + "_r"

    channels = width
    for i in range(1, layers + 1):
        normed = batchnorm(f"c{i - 1}", channels, f"bn{i}")
        inits[f"wa{i}"] = rng.normal(0, 0.2, (width, channels, 1, 1))
        inits[f"wb{i}"] = rng.normal(0, 0.1, (growth, width, 3, 3))
        nodes += [helper.make_node("Conv", [normed, f"wa{i}"], [f"a{i}"], kernel_shape=[1, 1]),
                  helper.make_node("Relu", [f"a{i}"], [f"ar{i}"]),
                  helper.make_node("Conv", [f"ar{i}", f"wb{i}"], [f"b{i}"], kernel_shape=[3, 3], pads=[1, 1, 1, 1]),
                  helper.make_node("Concat", [f"c{i - 1}", f"b{i}"], [f"c{i}"], axis=1)]
        channels += growth
    out = batchnorm(f"c{layers}", channels, "bn_out")
    nodes.append(helper.make_node("Identity", [out], ["y"]))
    return make_model(nodes, {"x": [1, 16, side, side]}, "y",
                      {k: np.asarray(v, np.float32) for k, v in inits.items()})


def test_a_dense_block_runs_blocked_from_its_first_conv_to_its_end():
    """The Concat chain goes blocked link by link in one round (concat_through_unblock_left), and
    each BatchNormalization of a concatenation, a per-channel x * k + t, with it
    (mul/add_channels_through_unblock): the compiled block converts its input once and its output
    once, every product, normalization and ReLU in between on blocked tensors (the first Conv's
    output, which the first layer reads normalized and the first Concat as it is, may be converted
    once more)."""
    model = dense_block_model()
    compiled = egraft.compile(model, use_cache=False)
    steps = [(s.node.op, s.node.outputs[0].type.rank) for s in compiled.steps]
    assert [op for op, _ in steps].count("LayoutFromBlocked") == 1 and steps[-1] == ("LayoutFromBlocked", 4), steps
    assert [op for op, _ in steps].count("LayoutToBlocked") <= 2, steps
    ops = [op for op, _ in steps]
    assert sorted(rank for op, rank in steps if op in ("Elementwise", "Concat")) == [5] * (ops.count("Elementwise") + 3)
    # each BatchNormalization and ReLU of a concatenation (the first layer's folds into the first Conv,
    # computed twice) a blocked pass of its own, or inside the 1x1 convolution after it
    assert ops.count("Elementwise") + ops.count("PreActConvNCHWc") == 3, steps
    assert ops.count("ConvNCHWc") + ops.count("PreActConvNCHWc") >= 6, steps
    x = randn(1, 16, 28, 28)
    np.testing.assert_allclose(compiled.run({"x": x})["y"], run_onnxruntime(model, {"x": x})["y"], rtol=1e-4, atol=1e-4)

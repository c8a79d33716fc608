"""The fusion rules on small models: epilogues, elementwise chains, and the Elementwise op."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from conftest import run_onnxruntime
from onnx import TensorProto, helper

import egraft
from egraft.ir.ops.fused_elementwise import ExprError, evaluate_expr, parse_expr
from egraft.optimize import optimize


def _model(nodes, inputs, outputs, inits=()):
    graph = helper.make_graph(nodes, "m", inputs, outputs, initializer=list(inits))
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def _chain_model():
    nodes = [helper.make_node("Mul", ["x", "w"], ["a"]), helper.make_node("Add", ["a", "b"], ["c"]),
             helper.make_node("Relu", ["c"], ["d"]), helper.make_node("Sub", ["d", "x"], ["e"]),
             helper.make_node("Sigmoid", ["e"], ["y"])]
    inputs = [helper.make_tensor_value_info(n, TensorProto.FLOAT, ["batch", 8]) for n in ("x", "w")]
    inputs.append(helper.make_tensor_value_info("b", TensorProto.FLOAT, [8]))
    return _model(nodes, inputs, [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 8])])


def test_elementwise_chain_becomes_one_op_with_the_same_values():
    model = _chain_model()
    result = optimize(egraft.load(model))
    assert [n.op for n in result.graph.nodes] == ["Elementwise"]
    node = result.graph.nodes[0]
    # the canonical body: inputs in the order of their e-classes (x's twice), then the body
    assert [v.name for v in node.inputs] == ["x", "x", "w", "b"]
    assert node.attrs["expr"] == "sigmoid(sub(relu(add(mul(x0, x2), x3)), x1))"
    assert str(result.graph.outputs[0].type) == "f32[batch, 8]"
    rng = np.random.default_rng(0)
    for batch in (1, 5):
        feeds = {"x": rng.normal(size=(batch, 8)).astype(np.float32),
                 "w": rng.normal(size=(batch, 8)).astype(np.float32),
                 "b": rng.normal(size=8).astype(np.float32)}
        reference = run_onnxruntime(model, feeds)["y"]
        np.testing.assert_allclose(result.graph.run(feeds)["y"], reference, rtol=1e-6, atol=1e-6)
        exported = run_onnxruntime(egraft.to_onnx(result.graph), feeds)["y"]
        np.testing.assert_allclose(exported, reference, rtol=1e-6, atol=1e-6)


def test_switching_fusion_off_keeps_the_chain():
    result = optimize(egraft.load(_chain_model()), rules_off=["fusion"])
    assert [n.op for n in result.graph.nodes] == ["Mul", "Add", "Relu", "Sub", "Sigmoid"]


def test_conv_relu_epilogue_matches_onnxruntime():
    rng = np.random.default_rng(1)
    w = rng.normal(size=(4, 3, 3, 3)).astype(np.float32)
    b = rng.normal(size=4).astype(np.float32)
    nodes = [helper.make_node("Conv", ["x", "w", "b"], ["c"], pads=[1, 1, 1, 1]),
             helper.make_node("Relu", ["c"], ["y"])]
    model = _model(nodes, [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", 3, 8, 8])],
                   [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["n", 4, 8, 8])],
                   [onnx.numpy_helper.from_array(w, "w"), onnx.numpy_helper.from_array(b, "b")])
    result = optimize(egraft.load(model))
    assert [n.op for n in result.graph.nodes] == ["FusedConv"]
    assert result.graph.nodes[0].attrs["activation"] == "relu"
    x = rng.normal(size=(2, 3, 8, 8)).astype(np.float32)
    np.testing.assert_allclose(result.graph.run({"x": x})["y"], run_onnxruntime(model, {"x": x})["y"],
                               rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("kernel, spatial, channels, order", [
    (3, ["h", "w"], 16, "conv_first"),  # symbolic spatial dims: FusedConv, then its Winograd twin
    (3, [12, 12], 16, "sigmoid_first"),
    (1, [12, 12], 16, "conv_first"),  # static, 8-channel blocks: ConvNCHWc {silu}
])
def test_conv_times_its_sigmoid_is_one_silu_convolution(kernel, spatial, channels, order):
    """YOLO's SiLU, Conv * Sigmoid(Conv), runs the convolution once, with x * sigmoid(x) in
    its epilogue (before, the extractor could pick a Conv and a Conv+Sigmoid: two
    convolutions), and matches onnxruntime."""
    rng = np.random.default_rng(2)
    w = (rng.normal(size=(channels, channels, kernel, kernel)) * 0.2).astype(np.float32)
    b = rng.normal(size=channels).astype(np.float32)
    pads = [kernel // 2] * 4
    mul_inputs = ["c", "s"] if order == "conv_first" else ["s", "c"]
    nodes = [helper.make_node("Conv", ["x", "w", "b"], ["c"], pads=pads), helper.make_node("Sigmoid", ["c"], ["s"]),
             helper.make_node("Mul", mul_inputs, ["y"])]
    model = _model(nodes, [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, channels, *spatial])],
                   [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
                   [onnx.numpy_helper.from_array(w, "w"), onnx.numpy_helper.from_array(b, "b")])
    result = optimize(egraft.load(model))
    convs = [n for n in result.graph.nodes if "Conv" in n.op]
    assert len(convs) == 1 and convs[0].attrs["activation"] == "silu"
    assert not [n for n in result.graph.nodes if n.op in ("Sigmoid", "Mul")]
    x = rng.normal(size=(1, channels, 12, 12)).astype(np.float32)
    reference = run_onnxruntime(model, {"x": x})["y"]
    np.testing.assert_allclose(result.graph.run({"x": x})["y"], reference, rtol=1e-4, atol=1e-5)
    compiled = egraft.compile(model)
    assert [s.kind for s in compiled.steps if s.kind != "view"].count("fallback") == 0
    np.testing.assert_allclose(compiled.run({"x": x})["y"], reference, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("gelu_order", ["pytorch", "written"])
def test_bias_first_linear_layer_and_its_gelu_are_one_product(gelu_order):
    """PyTorch exports a linear layer as ``Add(bias, MatMul(x, W))`` and GELU as
    ``Mul(Mul(x, Add(Erf(x / sqrt2), 1)), 0.5)`` with its products' inputs in either order. The
    rules are written ``Add(MatMul(a, w), bias)`` and ``Mul(Mul(x, ...), half)``: Add and Mul
    being commutative, they match both orders, and the layer is one FusedMatMul whose epilogue
    adds the bias and applies GELU (as onnxruntime's BiasGelu)."""
    rng = np.random.default_rng(3)
    w = (rng.normal(size=(16, 40)) * 0.3).astype(np.float32)
    b = rng.normal(size=40).astype(np.float32)
    consts = {"w": w, "b": b, "root2": np.array(np.sqrt(2), np.float32), "one": np.array(1, np.float32),
              "half": np.array(0.5, np.float32)}
    swap = (lambda a, c: [c, a]) if gelu_order == "pytorch" else (lambda a, c: [a, c])
    nodes = [helper.make_node("MatMul", ["x", "w"], ["m"]), helper.make_node("Add", ["b", "m"], ["h"]),
             helper.make_node("Div", ["h", "root2"], ["d"]), helper.make_node("Erf", ["d"], ["e"]),
             helper.make_node("Add", swap("e", "one"), ["p"]), helper.make_node("Mul", swap("h", "p"), ["q"]),
             helper.make_node("Mul", swap("q", "half"), ["y"])]
    model = _model(nodes, [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", "seq", 16])],
                   [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
                   [onnx.numpy_helper.from_array(v, k) for k, v in consts.items()])
    result = optimize(egraft.load(model))
    assert [(n.op, n.attrs.get("activation")) for n in result.graph.nodes] == [("FusedMatMul", "gelu")]
    compiled = egraft.compile(model)
    for shape in ((1, 5, 16), (2, 13, 16)):
        x = rng.normal(size=shape).astype(np.float32)
        np.testing.assert_allclose(compiled.run({"x": x})["y"], run_onnxruntime(model, {"x": x})["y"],
                                   rtol=1e-5, atol=1e-5)


def test_batchnorm_of_a_concatenation_is_one_elementwise_pass_with_its_relu():
    """DenseNet normalizes a concatenation (no convolution to fold into): the BatchNormalization
    becomes x * k + (shift - mean * k), which fuses with the ReLU after it into one pass; after a
    convolution it still folds into the weights (made_by). Both match onnxruntime."""
    rng = np.random.default_rng(4)
    c = 24
    params = {"s": rng.uniform(0.5, 2, c), "t": rng.normal(size=c), "m": rng.normal(size=c),
              "v": rng.uniform(0.1, 3, c), "w": rng.normal(size=(c, c, 1, 1)) * 0.2}
    inits = [onnx.numpy_helper.from_array(np.asarray(a, np.float32), k) for k, a in params.items()]
    nodes = [helper.make_node("Concat", ["a", "b"], ["x"], axis=1),
             helper.make_node("BatchNormalization", ["x", "s", "t", "m", "v"], ["n"], epsilon=1e-3),
             helper.make_node("Relu", ["n"], ["r"]), helper.make_node("Conv", ["r", "w"], ["y0"]),
             helper.make_node("BatchNormalization", ["y0", "s", "t", "m", "v"], ["y"])]
    inputs = [helper.make_tensor_value_info(k, TensorProto.FLOAT, [1, c // 2, 5, 7]) for k in ("a", "b")]
    model = _model(nodes, inputs, [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)], inits)
    result = optimize(egraft.load(model))
    ops = [n.op for n in result.graph.nodes]
    assert "BatchNormalization" not in ops and ops.count("Elementwise") == 1, ops
    feeds = {k: rng.normal(size=(1, c // 2, 5, 7)).astype(np.float32) for k in ("a", "b")}
    want = run_onnxruntime(model, feeds)["y"]
    np.testing.assert_allclose(result.graph.run(feeds)["y"], want, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(egraft.compile(model).run(feeds)["y"], want, rtol=1e-4, atol=1e-5)


def _gate_model():
    """A GRU-style blend: z = sigmoid(a + b) is read twice, y = (1 - z) * c + z * h; u = a * 2
    is read once, by the Add of its bias."""
    one = onnx.numpy_helper.from_array(np.ones(8, np.float32), "one")
    two = onnx.numpy_helper.from_array(np.full(8, 2, np.float32), "two")
    nodes = [helper.make_node("Add", ["a", "b"], ["s"]), helper.make_node("Sigmoid", ["s"], ["z"]),
             helper.make_node("Sub", ["one", "z"], ["zc"]), helper.make_node("Mul", ["zc", "c"], ["p"]),
             helper.make_node("Mul", ["z", "h"], ["q"]), helper.make_node("Add", ["p", "q"], ["y"]),
             helper.make_node("Mul", ["a", "two"], ["u"]), helper.make_node("Add", ["u", "b"], ["v"])]
    inputs = [helper.make_tensor_value_info(k, TensorProto.FLOAT, ["batch", 8]) for k in "abch"]
    outputs = [helper.make_tensor_value_info(k, TensorProto.FLOAT, ["batch", 8]) for k in ("y", "v")]
    return _model(nodes, inputs, outputs, [one, two])


def test_a_body_starts_at_a_shared_operand_and_not_at_one_read_once():
    """``ew_binary`` starts a body at a binary op only where each operand made by an elementwise op
    is ``shared`` (two nodes of the model read it): the gate z starts bodies (the plan may compute
    it once for both readers), u * 2's Add does not (the body of u grows by it instead), and both
    outputs still come out of one body each, equal to onnxruntime's."""
    from egraft.ir.infer import FreshDims
    from egraft.rewrite.builtins import BUILTINS, Handle
    from egraft.rewrite.egraph import EGraphState
    from egraft.rewrite.evaluate import Evaluator

    model = _gate_model()
    graph = egraft.load(model)
    state = EGraphState.from_graph(graph)
    snap = state.snapshot()
    evaluator = Evaluator(state, snap, 17, FreshDims("_e"))
    ref = {n.outputs[0].name: r for r, i in state.ref_source.items() for n in [graph.nodes[i]]}
    ref.update(state.input_refs)
    shared = {k: BUILTINS["shared"](evaluator, Handle(r)) for k, r in ref.items()}
    assert shared == {"s": False, "z": True, "zc": False, "p": False, "q": False, "y": False, "u": False,
                      "v": False, "a": True, "b": True, "c": False, "h": False}
    state.release()

    result = optimize(graph, cost="roofline")
    s = result.snapshot
    z_class = s.ref_class[ref["z"]]
    u_class = s.ref_class[ref["u"]]
    bodies = [n for nodes in s.classes.values() for n in nodes if n.op == "Elementwise"]
    assert any(z_class in n.children for n in bodies), "a body reads the shared gate z"
    assert not any(u_class in n.children for n in bodies), "no body reads u, which only u + b reads"
    rng = np.random.default_rng(5)
    feeds = {k: rng.normal(size=(3, 8)).astype(np.float32) for k in "abch"}
    want = run_onnxruntime(model, feeds)
    got = egraft.compile(model).run(feeds)
    for k in ("y", "v"):
        np.testing.assert_allclose(got[k], want[k], rtol=1e-5, atol=1e-6)


def test_commutative_nodes_match_their_other_order_only_where_no_rule_spells_it():
    """A rule whose mirror image (one commutative node's inputs swapped) is another rule, or
    itself, is matched in its written order at that node; the others in both orders."""
    from egraft.rewrite.load import load_rules
    from egraft.rewrite.match import fixed_order_nodes

    rules = {r.name: r for f in load_rules() for r in f.rules}
    fixed = fixed_order_nodes(list(rules.values()))
    root = lambda name: rules[name].roots[0]  # noqa: E731
    assert id(root("ew_binary_body_left/Add")) in fixed and id(root("ew_binary_body_right/Add")) in fixed  # mirrors
    assert id(root("ew_binary_bodies/Mul")) in fixed  # its own mirror
    assert id(root("ew_binary_body_left/Sub")) not in fixed  # Sub is not commutative
    assert id(root("conv_add_relu/Add").args[0]) not in fixed  # Relu(Add(z, Conv(...))) is spelled by no rule
    assert id(root("matmul_bias")) not in fixed  # Add(bias, MatMul(a, w)) is spelled by no rule


def test_expression_bodies_parse_and_evaluate():
    x, y = np.array([-2.0, 3.0]), np.array([1.0, 1.0])
    np.testing.assert_allclose(evaluate_expr("relu(add(x0, mul(x1, -0.5)))", [x, y]), [0.0, 2.5])
    assert parse_expr("neg(x2)") == ("call", "neg", (("input", 2),))
    with pytest.raises(ExprError, match="unknown function 'cube'"):
        parse_expr("cube(x0)")
    with pytest.raises(ExprError, match="add takes 2 arguments"):
        parse_expr("add(x0)")

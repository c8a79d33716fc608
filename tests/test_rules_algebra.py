"""The algebra rules (egraft/rules/algebra.rules) on small onnx.helper models: each rule fires, and
the program extracted (by node count, or with a cost that prefers the rule's form) computes what
onnxruntime computes on the original model, also once exported back to ONNX.

Example of the pattern every test follows::

    state, report = saturated(model)
    graph = extract_graph(state.snapshot(), cost=preferring({"Split": -0.5}))
    assert_matches_onnxruntime(graph, model, feeds)
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np
import onnx
import pytest
from conftest import run_onnxruntime
from onnx import TensorProto, helper, numpy_helper

import egraft
from egraft.extract.greedy import FREE_OPS, extract_graph
from egraft.ir.graph import Graph
from egraft.rewrite.egraph import EGraphState, ENode
from egraft.rewrite.engine import SaturationReport, saturate
from egraft.rewrite.load import load_rules
from egraft.rewrite.match import Matcher
from egraft.rewrite.parser import parse_rules
from egraft.testing.models import scale_relative_error

RNG = np.random.default_rng(7)


def randn(*shape: int) -> np.ndarray:
    return RNG.normal(size=shape).astype(np.float32)


# ---- models, saturation, extraction ---------------------------------------------------------------
def make_model(nodes: list[onnx.NodeProto], inputs: dict[str, list], outputs: Sequence[str],
               inits: dict[str, np.ndarray] | None = None, opset: int = 17) -> onnx.ModelProto:
    """A float32 model: ``inputs`` name -> shape, ``outputs`` by name (types left to inference).

    Example: ``make_model([helper.make_node("Relu", ["x"], ["y"])], {"x": [2]}, ["y"])``.
    """
    graph = helper.make_graph(
        nodes, "algebra",
        [helper.make_tensor_value_info(k, TensorProto.FLOAT, shape) for k, shape in inputs.items()],
        [helper.make_tensor_value_info(name, TensorProto.FLOAT, None) for name in outputs],
        [numpy_helper.from_array(v, k) for k, v in (inits or {}).items()])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])


def saturated(model: onnx.ModelProto, rulesets: Sequence[str] = ("folding", "algebra")
              ) -> tuple[EGraphState, SaturationReport]:
    """The model's e-graph saturated with the shipped rule sets named (and its report)."""
    rules = [r for f in load_rules() if f.ruleset in rulesets for r in f.rules]
    state = EGraphState.from_graph(egraft.load(model))
    return state, saturate(state, rules)


def preferring(costs: dict[str, float]) -> Callable[[ENode], float]:
    """The ``nodes`` cost with the ops of ``costs`` costing what it says: ``{"Split": -0.5}``
    makes a merged Conv and its Split cheaper (0.5 per output) than a Conv of its own (1)."""

    def cost(node: ENode) -> float:
        return 0.0 if node.op in FREE_OPS else costs.get(node.op, 1.0)

    return cost


def assert_matches_onnxruntime(graph: Graph, model: onnx.ModelProto, feeds: dict[str, np.ndarray],
                               tolerance: float = 1e-5) -> None:
    """``graph`` (run by egraft, and exported and run by onnxruntime) gives onnxruntime's outputs of
    the original ``model`` within ``tolerance``, relative to each output's largest magnitude."""
    graph.validate()
    reference = run_onnxruntime(model, feeds, exact=True)
    ours = graph.run(feeds)
    exported = run_onnxruntime(egraft.to_onnx(graph), feeds, exact=True)
    for name, want in reference.items():
        assert ours[name].shape == want.shape, name
        assert scale_relative_error(ours[name], want) <= tolerance, name
        assert scale_relative_error(exported[name], want) <= tolerance, name


def ops(graph: Graph) -> dict[str, int]:
    return graph.op_histogram()


# ---- reassociation and distribution -----------------------------------------------------------------
def test_matmul_chain_with_constants_becomes_one_matmul():
    c1, c2 = randn(4, 5), randn(5, 3)
    model = make_model([helper.make_node("MatMul", ["x", "c1"], ["t"]), helper.make_node("MatMul", ["t", "c2"], ["y"])],
                       {"x": [2, 6, 4]}, ["y"], {"c1": c1, "c2": c2})
    state, report = saturated(model)
    assert report.rules["matmul_constant_chain"].applied == 1
    graph = extract_graph(state.snapshot())
    assert ops(graph) == {"MatMul": 1}
    assert_matches_onnxruntime(graph, model, {"x": randn(2, 6, 4)})


def test_sum_of_products_with_one_input_factors():
    # x * c1 + x * c2 with c1 [3] and c2 [2, 1, 3] broadcasting x [4, 3] to [2, 4, 3]
    model = make_model([helper.make_node("Mul", ["x", "c1"], ["a"]), helper.make_node("Mul", ["x", "c2"], ["b"]),
                        helper.make_node("Add", ["a", "b"], ["y"])],
                       {"x": [4, 3]}, ["y"], {"c1": randn(3), "c2": randn(2, 1, 3)})
    state, report = saturated(model)
    assert report.rules["factor_mul_constants"].applied == 1
    graph = extract_graph(state.snapshot())
    assert ops(graph) == {"Mul": 1}
    assert_matches_onnxruntime(graph, model, {"x": randn(4, 3)})


def test_sum_of_matmuls_with_one_input_factors():
    model = make_model([helper.make_node("MatMul", ["x", "c1"], ["a"]), helper.make_node("MatMul", ["x", "c2"], ["b"]),
                        helper.make_node("Add", ["a", "b"], ["y"])],
                       {"x": [3, 8]}, ["y"], {"c1": randn(8, 5), "c2": randn(8, 5)})
    state, report = saturated(model)
    assert report.rules["factor_matmul_constants"].applied == 1
    graph = extract_graph(state.snapshot())
    assert ops(graph) == {"MatMul": 1}
    assert_matches_onnxruntime(graph, model, {"x": randn(3, 8)})


def test_distributing_a_scale_over_a_shift_lets_both_fold_into_the_conv():
    # (Conv(x) + c1) * c2 -> Conv(x) * c2 + c1 * c2, and then the folding rules take both into the Conv
    model = make_model([helper.make_node("Conv", ["x", "w", "b"], ["conv"]),
                        helper.make_node("Add", ["conv", "c1"], ["shifted"]),
                        helper.make_node("Mul", ["shifted", "c2"], ["y"])],
                       {"x": [1, 3, 6, 6]}, ["y"], {"w": randn(4, 3, 3, 3), "b": randn(4), "c1": randn(4, 1, 1),
                                                     "c2": randn(4, 1, 1)})
    state, report = saturated(model)
    assert report.rules["distribute_constant_mul"].applied == 1
    graph = extract_graph(state.snapshot())
    assert ops(graph) == {"Conv": 1}
    assert_matches_onnxruntime(graph, model, {"x": randn(1, 3, 6, 6)})


def test_distribution_alone_keeps_the_value():
    model = make_model([helper.make_node("Add", ["x", "c1"], ["t"]), helper.make_node("Mul", ["t", "c2"], ["y"])],
                       {"x": [2, 5]}, ["y"], {"c1": randn(5), "c2": randn(2, 1)})
    state, report = saturated(model)
    assert report.rules["distribute_constant_mul"].applied == 1
    snap = state.snapshot()
    nodes = preferring({})

    def cost(node: ENode) -> float:
        """Node count, plus a little for a Mul of an Add (the undistributed form)."""
        reads_add = node.op == "Mul" and any(n.op == "Add" for n in snap.classes[node.children[0]])
        return nodes(node) + (0.1 if reads_add else 0.0)

    graph = extract_graph(snap, cost=cost)
    assert [n.op for n in graph.nodes] == ["Mul", "Add"]
    assert_matches_onnxruntime(graph, model, {"x": randn(2, 5)})


# ---- merging parallel ops -------------------------------------------------------------------------
def _parallel_convs(opset: int, attrs: list[dict], out_channels: list[int], bias: bool = True) -> onnx.ModelProto:
    """Convs over one input x [1, 4, 7, 9] (kernels 3x3 over 4 // group channels), one output each."""
    nodes, inits = [], {}
    for i, (a, m) in enumerate(zip(attrs, out_channels)):
        inits[f"w{i}"] = randn(m, 4 // a.get("group", 1), 3, 3)
        names = ["x", f"w{i}"]
        if bias:
            inits[f"b{i}"] = randn(m)
            names.append(f"b{i}")
        nodes.append(helper.make_node("Conv", names, [f"y{i}"], **a))
    return make_model(nodes, {"x": [1, 4, 7, 9]}, [f"y{i}" for i in range(len(attrs))], inits, opset)


@pytest.mark.parametrize("opset", [11, 17])  # Split's sizes: an attribute at 11, an input from 13
@pytest.mark.parametrize("bias", [True, False])
def test_two_parallel_convs_merge_into_one_conv_and_a_split(opset, bias):
    pads = {"pads": [1, 0, 1, 2]}
    model = _parallel_convs(opset, [pads, pads], [5, 3], bias)
    state, report = saturated(model)
    rule = "merge_parallel_convs" if bias else "merge_parallel_convs_without_bias"
    assert report.rules[rule].applied == 1  # (p, q) only, not (q, p) too
    graph = extract_graph(state.snapshot(), cost=preferring({"Split": -0.5}))
    assert (ops(graph)["Conv"], ops(graph)["Split"]) == (1, 1)  # and Identity: outputs named after y0, y1
    (conv,) = [n for n in graph.nodes if n.op == "Conv"]
    assert conv.outputs[0].type.shape[1] == 8
    assert_matches_onnxruntime(graph, model, {"x": randn(1, 4, 7, 9)})
    # By node count the merged form (Conv + Split) ties with the two Convs; the Convs stay.
    assert ops(extract_graph(state.snapshot())) == {"Conv": 2}


def test_three_parallel_convs_merge_pairwise_once_and_merged_convs_do_not_merge_again():
    model = _parallel_convs(17, [{}, {}, {}, {"strides": [2, 2]}, {"group": 2}, {"group": 2}], [2, 3, 4, 2, 2, 2])
    state, report = saturated(model)
    # pairs of the first three (same attributes); not the strided one, not the grouped ones
    assert report.rules["merge_parallel_convs"].applied == 3
    assert report.stop_reason == "saturated"
    graph = extract_graph(state.snapshot(), cost=preferring({"Split": -0.5}))
    assert ops(graph)["Split"] >= 1
    assert_matches_onnxruntime(graph, model, {"x": randn(1, 4, 7, 9)})


def test_convs_in_a_chain_over_one_input_do_not_merge():
    # Conv -> Mul -> Add by constants: folding puts a Conv over x into all three e-classes, but
    # one is computed from the other, so none of them pairs with another.
    model = make_model([helper.make_node("Conv", ["x", "w", "b"], ["conv"]),
                        helper.make_node("Mul", ["conv", "k"], ["scaled"]),
                        helper.make_node("Add", ["scaled", "t"], ["y"])],
                       {"x": [1, 3, 5, 5]}, ["y"], {"w": randn(4, 3, 1, 1), "b": randn(4), "k": randn(4, 1, 1),
                                                     "t": randn(4, 1, 1)})
    state, report = saturated(model)
    assert report.rules["fold_mul_into_conv"].applied == 1 and report.rules["fold_add_into_conv"].applied == 1
    assert report.rules["merge_parallel_convs"].applied == 0
    assert_matches_onnxruntime(extract_graph(state.snapshot()), model, {"x": randn(1, 3, 5, 5)})


@pytest.mark.parametrize("opset", [11, 17])
def test_parallel_matmuls_merge_into_one_matmul_and_a_split(opset):
    model = make_model([helper.make_node("MatMul", ["x", "w1"], ["q"]), helper.make_node("MatMul", ["x", "w2"], ["k"]),
                        helper.make_node("MatMul", ["x", "w3"], ["v"]), helper.make_node("Relu", ["v"], ["r"])],
                       {"x": [2, 5, 8]}, ["q", "k", "r"],
                       {"w1": randn(8, 4), "w2": randn(8, 6), "w3": randn(8, 3)}, opset)
    state, report = saturated(model)
    assert report.rules["merge_parallel_matmuls"].applied == 3
    graph = extract_graph(state.snapshot(), cost=preferring({"Split": -0.5}))
    # Greedy extraction costs each output on its own: every MatMul is a merged pair's (4 + 6, 4 + 3 or 6 + 3).
    widths = sorted(n.outputs[0].type.shape[-1] for n in graph.nodes if n.op == "MatMul")
    assert ops(graph)["Split"] == len(widths) and set(widths) <= {10, 7, 9}
    assert_matches_onnxruntime(graph, model, {"x": randn(2, 5, 8)})


# ---- Split and Concat cancel ------------------------------------------------------------------------
def _split_of_concat(opset: int, sizes: list[int], form: str) -> onnx.ModelProto:
    """Split(Concat(a [2, 3, 4], b [2, 5, 4], axis = 1), axis = 1) with the sizes as ``form`` says:
    "input" (opset 13+), "attr" (opset < 13) or "halves" (num_outputs = 2, opset 18+)."""
    concat = helper.make_node("Concat", ["a", "b"], ["ab"], axis=1)
    if form == "input":
        split = helper.make_node("Split", ["ab", "sizes"], ["p", "q"], axis=1)
    elif form == "attr":
        split = helper.make_node("Split", ["ab"], ["p", "q"], axis=1, split=sizes)
    else:
        split = helper.make_node("Split", ["ab"], ["p", "q"], axis=1, num_outputs=2)
    inits = {"sizes": np.array(sizes, np.int64)} if form == "input" else {}
    b = 3 if form == "halves" else 5
    return make_model([concat, split, helper.make_node("Neg", ["q"], ["nq"])], {"a": [2, 3, 4], "b": [2, b, 4]},
                      ["p", "nq"], inits, opset)


@pytest.mark.parametrize("opset,form,rule", [(17, "input", "split_of_concat_second"),
                                             (11, "attr", "split_of_concat_second_attr"),
                                             (18, "halves", "split_of_concat_halves")])
def test_split_of_concat_gives_back_the_pieces(opset, form, rule):
    model = _split_of_concat(opset, [3, 5], form)
    state, report = saturated(model)
    # (a rule can apply again once its root's e-class has merged with the result: same equality)
    assert report.rules["split_of_concat_first"].applied >= 1 and report.rules[rule].applied >= 1
    graph = extract_graph(state.snapshot())
    assert ops(graph) == {"Identity": 1, "Neg": 1}  # p is the input a (an alias), -q is -b
    b = 3 if form == "halves" else 5
    assert_matches_onnxruntime(graph, model, {"a": randn(2, 3, 4), "b": randn(2, b, 4)})


@pytest.mark.parametrize("form", ["input", "attr"])
def test_split_of_concat_at_other_sizes_is_kept(form):
    model = _split_of_concat(17 if form == "input" else 11, [4, 4], form)
    state, report = saturated(model)
    assert report.rules["split_of_concat_first"].applied == 0
    assert report.rules["split_of_concat_second"].applied + report.rules["split_of_concat_second_attr"].applied == 0
    graph = extract_graph(state.snapshot())
    assert ops(graph)["Split"] == 1
    assert_matches_onnxruntime(graph, model, {"a": randn(2, 3, 4), "b": randn(2, 5, 4)})


@pytest.mark.parametrize("opset,form", [(17, "input"), (11, "attr"), (18, "halves")])
def test_concat_of_split_is_its_input(opset, form):
    if form == "input":
        split = helper.make_node("Split", ["x", "sizes"], ["p", "q"], axis=-1)
    elif form == "attr":
        split = helper.make_node("Split", ["x"], ["p", "q"], axis=-1, split=[2, 4])
    else:
        split = helper.make_node("Split", ["x"], ["p", "q"], axis=-1, num_outputs=2)
    nodes = [helper.make_node("Relu", ["x0"], ["x"]), split, helper.make_node("Concat", ["p", "q"], ["y"], axis=-1)]
    inits = {"sizes": np.array([2, 4], np.int64)} if form == "input" else {}
    model = make_model(nodes, {"x0": [3, 6]}, ["y"], inits, opset)
    state, report = saturated(model)
    rule = "concat_of_split" if form == "input" else "concat_of_split_attr"
    assert report.rules[rule].applied >= 1
    graph = extract_graph(state.snapshot())
    assert ops(graph) == {"Relu": 1}
    assert_matches_onnxruntime(graph, model, {"x0": randn(3, 6)})


def test_concat_of_split_pieces_in_another_order_is_kept():
    nodes = [helper.make_node("Split", ["x", "sizes"], ["p", "q"], axis=1),
             helper.make_node("Concat", ["q", "p"], ["y"], axis=1)]
    model = make_model(nodes, {"x": [2, 6]}, ["y"], {"sizes": np.array([3, 3], np.int64)})
    state, report = saturated(model)
    assert report.rules["concat_of_split"].applied == 0
    assert_matches_onnxruntime(extract_graph(state.snapshot()), model, {"x": randn(2, 6)})


# ---- the matcher's join --------------------------------------------------------------------------------
class _UnjoinedMatcher(Matcher):
    """The matcher without its join: every later root tries every e-node of its op."""

    def _join_candidates(self, root, candidates, subst):
        return candidates


@pytest.mark.parametrize("text", [
    "rule r: p = Conv(x, w1, b1) {attrs}; q = Conv(x, w2, b2) {attrs} => p, q",
    "rule r: p = Relu(x); q = Split(x, s) => p, q",  # output 0 of a multi-output node, through Out
    "rule r: p = Split(x, s)[1]; q = Neg(x) => p, q",
    "rule r: p = Relu(x); q = Mul(y, x) => p, q",  # the join variable is not the first input
])
def test_a_multi_root_join_finds_what_trying_every_pair_finds(text):
    (rule,) = parse_rules(text, "<test>").rules
    nodes = [helper.make_node("Conv", ["x", "w0", "b0"], ["c0"]), helper.make_node("Conv", ["x", "w1", "b1"], ["c1"]),
             helper.make_node("Relu", ["x"], ["r"]), helper.make_node("Neg", ["x"], ["n"]),
             helper.make_node("Split", ["x", "sizes"], ["s0", "s1"], axis=1),
             helper.make_node("Mul", ["r", "x"], ["m"]), helper.make_node("Mul", ["n", "x"], ["m2"])]
    inits = {"w0": randn(2, 4, 1, 1), "b0": randn(2), "w1": randn(3, 4, 1, 1), "b1": randn(3),
             "sizes": np.array([1, 3], np.int64)}
    model = make_model(nodes, {"x": [1, 4, 3, 3]}, ["c0", "c1", "s0", "s1", "m", "m2"], inits)
    snap = EGraphState.from_graph(egraft.load(model)).snapshot()
    joined = Matcher(snap, 17).match_rule(rule)
    assert joined and joined == _UnjoinedMatcher(snap, 17).match_rule(rule)


@pytest.mark.parametrize("exponent_shape, squared", [([], True), ([1], True), ([1, 1, 1], False)])
def test_a_square_is_a_product(exponent_shape, squared):
    """Pow(x, 2) becomes x * x (T5's RMSNorm: powf per element was a quarter of its time),
    bit for bit the same; an exponent that broadcasts x to a higher rank stays a Pow."""
    from egraft.optimize import optimize

    two = numpy_helper.from_array(np.full(exponent_shape, 2, np.float32), "two")
    graph = helper.make_graph([helper.make_node("Pow", ["x", "two"], ["y"])], "square",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", 8])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)], [two])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    result = optimize(egraft.load(model))
    # the product, as Mul(x, x) or as the one-input body mul(x0, x0) (Elementwise keeps an input once)
    plan = [(n.op, n.attrs.get("expr"), len(n.inputs)) for n in result.graph.nodes]
    assert plan in ([("Mul", None, 2)], [("Elementwise", "mul(x0, x0)", 1)]) if squared else plan == [("Pow", None, 2)]
    x = np.random.default_rng(4).normal(0, 10, (5, 8)).astype(np.float32)
    want = run_onnxruntime(model, {"x": x})["y"]
    got = egraft.compile(model).run({"x": x})["y"]
    assert got.shape == want.shape
    np.testing.assert_array_equal(got.reshape(5, 8) if squared else got, (x * x) if squared else want)


@pytest.mark.parametrize("kernel, strides, pads, separable", [
    ([13, 13], [1, 1], [6, 6, 6, 6], True),   # YOLO's SPPF: the compile picks the two pools
    ([9, 7], [1, 1], [4, 2, 3, 4], None),     # uneven window and pads: the cost model decides
    ([5, 5], [2, 2], [2, 2, 2, 2], False),    # strided: left alone
    ([3, 3], [1, 1], [1, 1, 1, 1], False),    # too small to pay
])
def test_a_big_max_pool_runs_as_two_one_dimensional_pools(kernel, strides, pads, separable):
    """MaxPool k x k = MaxPool 1 x k of MaxPool k x 1 (the max of column maxima), exactly,
    padding included; the compiled model picks it where it pays."""
    from egraft.optimize import optimize

    def pool_model(pools) -> onnx.ModelProto:
        nodes = [helper.make_node("MaxPool", [f"t{i}"], [f"t{i + 1}"], kernel_shape=k, strides=s, pads=p)
                 for i, (k, s, p) in enumerate(pools)]
        x_info = helper.make_tensor_value_info("t0", TensorProto.FLOAT, [1, 16, 13, 15])
        graph = helper.make_graph(nodes, "pool", [x_info],
                                  [helper.make_tensor_value_info(f"t{len(pools)}", TensorProto.FLOAT, None)])
        return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])

    model = pool_model([(kernel, strides, pads)])
    rule = optimize(egraft.load(model)).saturation.rules["separable_max_pool"]
    assert rule.applied == (separable is not False)
    x = np.random.default_rng(5).normal(0, 1, (1, 16, 13, 15)).astype(np.float32)
    want = run_onnxruntime(model, {"t0": x})["t1"]
    if separable is not False:  # the rewritten form is the pool, bit for bit
        two = pool_model([([kernel[0], 1], [1, 1], [pads[0], 0, pads[2], 0]),
                          ([1, kernel[1]], [1, 1], [0, pads[1], 0, pads[3]])])
        np.testing.assert_array_equal(run_onnxruntime(two, {"t0": x})["t2"], want)
    compiled = egraft.compile(model)
    kernels = [s.node.attrs["kernel_shape"] for s in compiled.steps if s.node.op == "MaxPool"]
    if separable is not None:
        assert kernels == ([[kernel[0], 1], [1, kernel[1]]] if separable else [kernel])
    np.testing.assert_array_equal(compiled.run({"t0": x})["t1"], want)


def test_a_two_operand_sum_residual_joins_the_blocked_convolution():
    """Sum(a, b) of equal shapes is a + b: ResNet's residual ``Relu(Sum(conv, x))`` (old
    exporters) meets the Add rules and stays in the blocked layout with the convolutions."""
    from egraft.optimize import optimize

    rng = np.random.default_rng(6)
    w1 = numpy_helper.from_array(rng.normal(0, 0.1, (64, 64, 1, 1)).astype(np.float32), "w1")
    w2 = numpy_helper.from_array(rng.normal(0, 0.1, (64, 64, 1, 1)).astype(np.float32), "w2")
    w0 = numpy_helper.from_array(rng.normal(0, 0.1, (64, 64, 1, 1)).astype(np.float32), "w0")
    nodes = [helper.make_node("Conv", ["x", "w0"], ["c0"]), helper.make_node("Relu", ["c0"], ["r0"]),
             helper.make_node("Conv", ["r0", "w1"], ["c1"]), helper.make_node("Relu", ["c1"], ["r1"]),
             helper.make_node("Conv", ["r1", "w2"], ["c2"]), helper.make_node("Sum", ["c2", "r0"], ["s"]),
             helper.make_node("Relu", ["s"], ["y"])]
    graph = helper.make_graph(nodes, "residual", [helper.make_tensor_value_info("x", TensorProto.FLOAT,
                                                                               [1, 64, 28, 28])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)], [w0, w1, w2])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 7)])
    assert optimize(egraft.load(model)).saturation.rules["sum_of_two_as_add"].applied
    compiled = egraft.compile(model)
    ops = [s.node.op for s in compiled.steps if s.kind != "view"]
    assert "Sum" not in ops and ops.count("LayoutFromBlocked") == 1 and ops[-1] == "LayoutFromBlocked", ops
    model.graph.node[5].op_type = "Add"  # the same block written with Add compiles to the same plan
    assert [s.node.op for s in egraft.compile(model).steps if s.kind != "view"] == ops
    model.graph.node[5].op_type = "Sum"
    x = rng.normal(0, 1, (1, 64, 28, 28)).astype(np.float32)
    np.testing.assert_allclose(compiled.run({"x": x})["y"], run_onnxruntime(model, {"x": x})["y"],
                               rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("index", [[-1], [1], 1])
def test_a_static_dim_of_a_symbolic_shape_folds(index):
    """Gather(Shape(x), i) picks x's static last dim while the batch is symbolic: it folds to
    a constant, so the Slice computed from it has constant bounds (a GRU cell's gate split)."""
    from egraft.optimize import optimize

    idx = numpy_helper.from_array(np.array(index, np.int64), "idx")
    two = numpy_helper.from_array(np.array(2, np.int64), "two")
    zero = numpy_helper.from_array(np.array([0], np.int64), "zero")
    axes = numpy_helper.from_array(np.array([1], np.int64), "axes")
    nodes = [helper.make_node("Shape", ["x"], ["s"]), helper.make_node("Gather", ["s", "idx"], ["d"], axis=0),
             helper.make_node("Div", ["d", "two"], ["h"]),
             helper.make_node("Reshape", ["h", "one"], ["end"]) if not isinstance(index, list) else
             helper.make_node("Identity", ["h"], ["end"]),
             helper.make_node("Slice", ["x", "zero", "end", "axes"], ["y"])]
    inits = [idx, two, zero, axes, numpy_helper.from_array(np.array([1], np.int64), "one")]
    graph = helper.make_graph(nodes, "gate_split", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", 12])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    result = optimize(egraft.load(model))
    assert [n.op for n in result.graph.nodes] == ["Slice"]
    assert all(v.const is not None for v in result.graph.nodes[0].inputs[1:])
    assert str(result.graph.outputs[0].type) == "f32[n, 6]"
    x = np.random.default_rng(5).normal(size=(3, 12)).astype(np.float32)
    np.testing.assert_array_equal(egraft.compile(model).run({"x": x})["y"], run_onnxruntime(model, {"x": x})["y"])

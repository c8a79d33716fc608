"""The rule language's shorthands: optional operands (``b?``), ``for`` templates and
``example:`` lines. Each is expanded at load time into the plain rules the engine runs;
these tests check the expansion, its load-time errors, and that the expanded rules rewrite
real models to what onnxruntime computes."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import pytest
from conftest import run_onnxruntime
from onnx import TensorProto, helper, numpy_helper

import egraft
from egraft.optimize import optimize
from egraft.rewrite.ast import ExampleAttrs, ExampleTensor, OpRef, PAbsent, PVar
from egraft.rewrite.load import check_rule_file, expand_associative, expand_optional, expand_templates, load_rules
from egraft.rewrite.parser import RuleError, parse_rules


def one_rule(text: str):
    rf = parse_rules(text, "t.rules")
    check_rule_file(rf)
    return rf.rules[0]


def error_of(text: str) -> str:
    with pytest.raises(RuleError) as e:
        check_rule_file(parse_rules(text, "t.rules"))
    return str(e.value)


# ---- optional operands ------------------------------------------------------------------
def test_an_optional_operand_makes_one_variant_per_subset_present():
    rule = one_rule('rule r: Relu(Conv(x, w, b?) {attrs})\n'
                    '    => com.egraft::FusedConv(x, w, b?) {attrs, activation = "relu"}')
    full, bare = expand_optional(rule)
    assert (full.name, bare.name, bare.variant_of) == ("r", "r/without_b", "r")
    assert [a.name for a in full.roots[0].args[0].args] == ["x", "w", "b"]
    assert [a.name for a in bare.roots[0].args[0].args] == ["x", "w"]  # the op's shorter form
    assert [a.name for a in bare.results[0].args] == ["x", "w"]
    assert not any(a.optional for a in full.roots[0].args[0].args)


def test_an_absent_inner_operand_is_a_position_that_must_hold_no_input():
    rule = one_rule("rule r: Relu(Clip(x, lo?, hi?)) => Clip(Relu(x), lo?, hi?)")
    variants = {v.name: v for v in expand_optional(rule)}
    assert sorted(variants) == ["r", "r/without_hi", "r/without_lo", "r/without_lo_hi"]
    args = variants["r/without_lo"].roots[0].args[0].args
    assert isinstance(args[0], PVar) and isinstance(args[1], PAbsent) and args[2].name == "hi"
    assert variants["r/without_lo"].results[0].args[1].value is None  # no input there
    assert len(variants["r/without_lo_hi"].roots[0].args[0].args) == 1


def clip_model(lo: float | None, hi: float | None) -> onnx.ModelProto:
    inputs = ["x", "lo" if lo is not None else "", "hi" if hi is not None else ""]
    while inputs[-1] == "":
        inputs.pop()
    consts = [numpy_helper.from_array(np.array(v, np.float32), n) for n, v in (("lo", lo), ("hi", hi)) if v is not None]
    nodes = [helper.make_node("Clip", inputs, ["c"]), helper.make_node("Neg", ["c"], ["y"])]
    graph = helper.make_graph(nodes, "clip", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [3, 5])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [3, 5])], consts)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


@pytest.mark.parametrize("lo, hi, variant", [(-0.5, 0.5, "r"), (None, 0.5, "r/without_lo"),
                                             (-0.5, None, "r/without_hi"), (None, None, "r/without_lo_hi")])
def test_each_variant_matches_the_nodes_with_its_operands_present(tmp_path, lo, hi, variant):
    """x = relu(x) - relu(-x) inside a Clip: only the variant whose operands the model's Clip
    has applies, and it builds the new Clip with the same inputs absent (the e-graph then holds
    two Clips of that arity); the extracted program computes what onnxruntime does."""
    rules = tmp_path / "clip.rules"
    rules.write_text("ruleset clip\nrule r: Neg(Clip(x, lo?, hi?)) where not made_by(x, \"Add\")\n"
                     "    => Neg(Clip(Add(Relu(x), Neg(Relu(Neg(x)))), lo?, hi?))\n")
    model = clip_model(lo, hi)
    result = optimize(egraft.load(model), [rules], include_shipped=False)
    applied = {k: v.applied for k, v in result.saturation.rules.items() if v.applied}
    assert applied == {variant: 1}
    clips = [n for nodes in result.snapshot.classes.values() for n in nodes if n.op == "Clip"]
    present = [c is not None and not result.snapshot.is_absent(c) for c in (list(clips[0].children) + [None] * 3)[1:3]]
    assert len(clips) == 2 and present == [lo is not None, hi is not None]
    assert len({tuple(not result.snapshot.is_absent(c) for c in n.children) for n in clips}) == 1
    x = np.random.default_rng(0).normal(size=(3, 5)).astype(np.float32)
    np.testing.assert_array_equal(result.graph.run({"x": x})["y"], run_onnxruntime(model, {"x": x})["y"])


def test_optional_operand_errors_name_the_place():
    assert error_of("rule r: Relu(Conv(x, w, b?)) => com.egraft::FusedConv(x, w, b)") == (
        "t.rules:1:61: 'b' is an optional operand (absent in some matches); write b? as an op's input")
    assert "can only be an op's input in a replacement" in error_of(
        "rule r: Relu(Conv(x, w, b?)) where rank(b?) == 1 => com.egraft::FusedConv(x, w, b?)")
    assert "binds 'b' as a required one" in error_of("rule r: Relu(Conv(x, w, b)) => com.egraft::FusedConv(x, w, b?)")
    assert "write b? everywhere or nowhere" in error_of("rule r: Add(Conv(x, w, b?), b) => Relu(x)")
    assert "'_?' is not an optional operand" in error_of("rule r: Relu(Conv(x, w, _?)) => x")


def test_a_bias_free_conv_with_a_residual_now_fuses_and_runs_as_onnxruntime_does():
    """``conv_add_relu`` is written once with ``b?``: the bias-free convolution's residual and
    ReLU (no rule matched it before: only the with-bias form was written) become one FusedConv
    with no bias input and the residual, compiled and run."""
    rng = np.random.default_rng(1)
    w = rng.normal(size=(4, 4, 3, 3)).astype(np.float32)
    nodes = [helper.make_node("Conv", ["x", "w"], ["c"], pads=[1, 1, 1, 1]), helper.make_node("Add", ["z", "c"], ["s"]),
             helper.make_node("Relu", ["s"], ["y"])]
    graph = helper.make_graph(nodes, "residual", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 4, 6, 6]),
                                                  helper.make_tensor_value_info("z", TensorProto.FLOAT, [1, 4, 6, 6])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 4, 6, 6])],
                              [numpy_helper.from_array(w, "w")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    result = optimize(egraft.load(model), rules_off=["layout"])
    assert result.saturation.rules["conv_add_relu/Add/without_b"].applied == 1
    fused = [n for n in result.graph.nodes if n.op == "FusedConv"]
    assert len(fused) == 1 and fused[0].inputs[2] is None and fused[0].inputs[3] is not None
    feeds = {k: rng.normal(size=(1, 4, 6, 6)).astype(np.float32) for k in ("x", "z")}
    want = run_onnxruntime(model, feeds)["y"]
    np.testing.assert_allclose(result.graph.run(feeds)["y"], want, rtol=1e-5, atol=1e-5)
    compiled = egraft.compile(model, rules_off=["layout"], use_cache=False)
    assert "fallback" not in [s.kind for s in compiled.steps]
    np.testing.assert_allclose(compiled.run(feeds)["y"], want, rtol=1e-5, atol=1e-5)


# ---- templates ---------------------------------------------------------------------------
def test_a_template_makes_one_rule_per_row_with_ops_and_values_put_in():
    rule = one_rule('rule act for (op, name) in [(Relu, "relu"), (com.egraft::Gelu, "gelu")]:\n'
                    '    op(Conv(x, w) {attrs}) => com.egraft::FusedConv(x, w) {attrs, activation = name}')
    relu, gelu = expand_templates(rule)
    assert (relu.name, gelu.name) == ("act/Relu", "act/Gelu")
    assert (relu.roots[0].op, relu.roots[0].domain) == ("Relu", "")
    assert (gelu.roots[0].op, gelu.roots[0].domain) == ("Gelu", "com.egraft")
    assert dict(gelu.results[0].kwargs)["activation"].value == "gelu"
    assert rule.template.rows[1][0] == OpRef("Gelu", "com.egraft")


def test_a_template_value_can_constrain_an_attribute():
    rule = one_rule('rule g for (approx, name) in [("none", "gelu"), ("tanh", "gelu_tanh")]:\n'
                    '    com.egraft::Gelu(x) {approximate = approx} => com.egraft::Gelu(x) {approximate = name}')
    tanh = expand_templates(rule)[1]
    assert tanh.name == "g/tanh"
    assert (tanh.roots[0].attrs[0].literal, tanh.roots[0].attrs[0].var) == ("tanh", None)


def test_template_errors_name_the_place():
    assert error_of("rule r for (op, f) in [(Relu, 1), Neg]: op(x) => x") == (
        "t.rules:1:8: a row of 1 item(s) for 2 name(s) (op, f); give each row one item per name")
    assert "stands for the op Relu" in error_of("rule r for op in [Relu]: Neg(x) => Add(x, op)")
    assert "not an op" in error_of('rule r for op in ["relu"]: op(x) => x')
    assert "a pattern variable needs another name" in error_of("rule r for x in [Relu]: Neg(x) => x")
    assert "unknown op 'Rleu'" in error_of("rule r for op in [Relu, Rleu]: op(x) => x")


def test_the_shipped_files_spell_each_family_once():
    """fusion and layout now write a family once (a template, b?, a commutative op's one
    order): 99 rules before (60 fusion, 39 layout), 50 now; the engine runs every variant."""
    files = load_rules()
    written = {Path(f.path).stem: len(parse_rules(Path(f.path).read_text(), f.path).rules) for f in files}
    assert written["fusion"] + written["fusion_elementwise"] == 27 and written["layout"] == 23
    names = {r.name for f in files for r in f.rules}
    assert {"conv_activation/Relu", "conv_activation/Relu/without_b", "ew_binary/Div", "unary_through_transpose/Abs",
            "gemm_transposed_a/without_c", "cancel_round_trip/LayoutFromBlocked"} <= names


# ---- examples ----------------------------------------------------------------------------
def test_examples_parse_into_values_attributes_and_an_opset():
    rule = one_rule("rule r: Relu(Conv(x, w, b?) {attrs}) => com.egraft::FusedConv(x, w, b?) {attrs}\n"
                    "    example: x = f32[1, 8, 9, 9], w = f32[16, 8, 3, 3], attrs = {pads = [1, 1, 1, 1]},"
                    " opset = 13\n"
                    "    example: x = f32[1, 2, 5, 5], w = f32[3, 2, 1, 1], b = [0.5, -1.0, 2.0]")
    first, second = rule.examples
    assert first.opset == 13 and first.get("x") == ExampleTensor("f32", (1, 8, 9, 9), first.get("x").loc)
    assert first.get("attrs") == ExampleAttrs((("pads", [1, 1, 1, 1]),), first.get("attrs").loc)
    assert second.get("b") == [0.5, -1.0, 2.0]
    full, bare = expand_optional(rule)
    assert full.examples == (second,) and bare.examples == (first,)  # each goes where its operands are


def test_example_errors_name_the_place():
    base = "rule r: Relu(Conv(x, w, b?) {attrs}) => com.egraft::FusedConv(x, w, b?) {attrs}\n    example: "
    assert error_of(base + "x = f32[1, 2, 3, 3]") == (
        "t.rules:2:5: example: no value for 'w'; give every pattern variable but the optional ones a value "
        "(x = f32[1, 8, 7, 7])")
    assert "'y' is not a variable of the pattern" in error_of(base + "x = f32[1, 2, 3, 3], w = f32[2, 2, 1, 1], y = 1")
    assert "unknown dtype 'f33'" in error_of(base + "x = f33[1, 2, 3, 3], w = f32[2, 2, 1, 1]")
    assert "is an attribute set" in error_of(base + "x = f32[1, 2, 3, 3], w = f32[2, 2, 1, 1], attrs = 1")
    assert "given twice" in error_of(base + "x = f32[1], x = f32[2], w = f32[2, 2, 1, 1]")
    assert "unexpected name 'x'; expected ':'" in error_of("rule r: Relu(x) => x example x = f32[1]")


# ---- associative ops ---------------------------------------------------------------------
def test_nested_associative_ops_match_however_grouped():
    """``gelu_erf`` is written ``(x * (1 + erf(x / sqrt2))) * 0.5``; Mul being associative (and
    commutative), its groupings are rules too, so an exporter's ``x * (0.5 * (1 + erf(...)))``
    (no rule spells it) is one Gelu, which computes what onnxruntime does."""
    rules = {r.name: r for f in load_rules() for r in f.rules}
    assert {"gelu_erf/grouping1", "gelu_erf/grouping2"} <= set(rules) and "gelu_erf/grouping3" not in rules
    consts = {"root2": np.array(np.sqrt(2), np.float32), "one": np.array(1, np.float32),
              "half": np.array(0.5, np.float32)}
    nodes = [helper.make_node("Div", ["x", "root2"], ["d"]), helper.make_node("Erf", ["d"], ["e"]),
             helper.make_node("Add", ["one", "e"], ["p"]), helper.make_node("Mul", ["half", "p"], ["q"]),
             helper.make_node("Mul", ["x", "q"], ["y"])]
    graph = helper.make_graph(nodes, "gelu", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", 16])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
                              [numpy_helper.from_array(v, k) for k, v in consts.items()])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    result = optimize(egraft.load(model))
    assert sum(v.applied for k, v in result.saturation.rules.items() if k.startswith("gelu_erf/grouping")) == 1
    assert [n.op for n in result.graph.nodes] == ["Gelu"]
    x = np.random.default_rng(2).normal(size=(5, 16)).astype(np.float32)
    np.testing.assert_allclose(result.graph.run({"x": x})["y"], run_onnxruntime(model, {"x": x})["y"],
                               rtol=1e-5, atol=1e-6)


def test_what_sees_the_grouping_is_not_regrouped():
    """A root keeps its name through a regrouping (the whole product is the same value), an
    inner node with attributes is left as written, and a non-associative op is never regrouped."""
    named = one_rule("rule r: p = Mul(Mul(x, h), Erf(x)) where rank(x) == 2 => x")
    assert [v.name for v in expand_associative(named)] == ["r", "r/grouping1", "r/grouping2"]
    assert all(v.roots[0].bind == "p" for v in expand_associative(named))
    attributed = one_rule("rule r: Max(com.egraft::Elementwise(x, h) {expr = e}, Erf(x)) => x")
    assert expand_associative(attributed) == [attributed]
    not_associative = one_rule("rule r: Sub(Sub(x, h), Erf(x)) => x")
    assert expand_associative(not_associative) == [not_associative]

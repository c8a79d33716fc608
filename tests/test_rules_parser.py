"""The rule language: parsing (egraft/rewrite/parser.py) and load-time checks
(egraft/rewrite/load.py). Each bad input is paired with its exact diagnostic."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from egraft.rewrite.ast import EBinary, ECall, EIndex, EList, ELit, EUnary, EVar, Let, Loc, POp, PVar
from egraft.rewrite.load import RuleError, check_rule_file, load_rules, shipped_rule_files
from egraft.rewrite.parser import parse_rules

EXAMPLE = """\
# Folding: constant subexpressions and identities.
ruleset folding

# x * 1 -> x
rule mul_by_one:
    Mul(x, c) where const(c) and all_equal(c, 1)
    => x

# BatchNormalization folds into the Conv before it when its parameters are constant.
rule fold_bn_into_conv:
    BatchNormalization(Conv(x, w, b) {attrs}, s, t, m, v) {epsilon = eps}
    where const(w, b, s, t, m, v)
    =>  k = s / Sqrt(v + eps)
        Conv(x, w * Unsqueeze(k, axes = [1, 2, 3]), (b - m) * k + t) {attrs}

# Two Convs over the same input become one wider Conv and a Split (two roots).
rule merge_parallel_convs:
    p = Conv(x, w1, b1) {attrs};  q = Conv(x, w2, b2) {attrs}
    where const(w1, w2, b1, b2) and shape(w1)[1:] == shape(w2)[1:]
    =>  y = Conv(x, Concat(w1, w2, axis = 0), Concat(b1, b2, axis = 0)) {attrs}
        p2, q2 = Split(y, [dim(w1, 0), dim(w2, 0)], axis = 1)
        p2, q2

# Fold any op whose inputs are all constant.
rule fold_constants:
    n = *(xs...) where const(xs) => fold(n)
"""


def at(line: int, col: int, file: str = "ex.rules") -> Loc:
    return Loc(file, line, col)


def error_of(text: str, path: str = "t.rules") -> str:
    """The diagnostic that parsing and checking ``text`` gives."""
    with pytest.raises(RuleError) as info:
        check_rule_file(parse_rules(text, path))
    return str(info.value)


# ---- the example file ------------------------------------------------------------------
@pytest.fixture(scope="module")
def example():
    rf = parse_rules(EXAMPLE, "ex.rules")
    check_rule_file(rf)
    return rf


def test_example_file(example):
    assert example.ruleset == "folding"
    assert example.doc == "Folding: constant subexpressions and identities."
    assert [r.name for r in example.rules] == ["mul_by_one", "fold_bn_into_conv", "merge_parallel_convs",
                                               "fold_constants"]
    assert [r.doc for r in example.rules] == [
        "x * 1 -> x",
        "BatchNormalization folds into the Conv before it when its parameters are constant.",
        "Two Convs over the same input become one wider Conv and a Split (two roots).",
        "Fold any op whose inputs are all constant.",
    ]
    assert all(r.ruleset == "folding" for r in example.rules)
    assert example.rules[0].loc == at(5, 1)


def test_mul_by_one(example):
    rule = example.rules[0]
    assert rule.roots == (POp("Mul", (PVar("x", at(6, 9)), PVar("c", at(6, 12))), at(6, 5)),)
    assert rule.guard == EBinary(
        "and",
        ECall("const", (EVar("c", at(6, 27)),), at(6, 21)),
        ECall("all_equal", (EVar("c", at(6, 44)), ELit(1, at(6, 47))), at(6, 34)),
        at(6, 21),
    )
    assert rule.lets == ()
    assert rule.results == (EVar("x", at(7, 8)),)


def test_fold_bn_into_conv(example):
    rule = example.rules[1]
    (bn,) = rule.roots
    assert bn.op == "BatchNormalization" and bn.attrs_rest is None and bn.bind is None
    assert [(a.name, a.var, a.literal) for a in bn.attrs] == [("epsilon", "eps", None)]
    conv = bn.args[0]
    assert conv.op == "Conv" and conv.attrs_rest == "attrs" and conv.attrs == ()
    assert [a.name for a in bn.args[1:]] == ["s", "t", "m", "v"]
    (let,) = rule.lets
    assert let == Let(("k",), EBinary("/", EVar("s", at(13, 13)),
                                      ECall("Sqrt", (EBinary("+", EVar("v", at(13, 22)), EVar("eps", at(13, 26)),
                                                             at(13, 22)),), at(13, 17)), at(13, 13)), at(13, 9))
    (result,) = rule.results
    assert result.func == "Conv" and result.attrs_spread == ("attrs",) and result.kwargs == ()
    unsqueeze = result.args[1].right
    assert unsqueeze.func == "Unsqueeze"
    assert unsqueeze.kwargs == (("axes", EList((ELit(1, at(14, 42)), ELit(2, at(14, 45)), ELit(3, at(14, 48))),
                                               at(14, 41))),)
    # (b - m) * k + t: * binds tighter than +, parentheses group
    bias = result.args[2]
    assert bias.op == "+" and bias.left.op == "*" and bias.left.left.op == "-"


def test_merge_parallel_convs(example):
    rule = example.rules[2]
    assert [(r.op, r.bind, r.attrs_rest) for r in rule.roots] == [("Conv", "p", "attrs"), ("Conv", "q", "attrs")]
    assert rule.roots[1].loc == at(18, 39)
    lhs = rule.guard.right.left
    assert lhs == EIndex(ECall("shape", (EVar("w1", at(19, 43)),), at(19, 37)), (ELit(1, at(19, 47)), None),
                         at(19, 37))
    assert [let.names for let in rule.lets] == [("y",), ("p2", "q2")]
    split = rule.lets[1].value
    assert split.func == "Split" and [k for k, _ in split.kwargs] == ["axis"]
    assert rule.results == (EVar("p2", at(22, 9)), EVar("q2", at(22, 13)))


def test_fold_constants(example):
    rule = example.rules[3]
    assert rule.roots == (POp(None, (), at(26, 9), rest="xs", bind="n"),)
    assert rule.results == (ECall("fold", (EVar("n", at(26, 42)),), at(26, 37)),)


# ---- smaller syntax --------------------------------------------------------------------
def test_ruleset_defaults_to_the_file_stem():
    rf = parse_rules("rule r: Neg(Neg(x)) => x", "some/dir/algebra.rules")
    assert rf.ruleset == "algebra" and rf.rules[0].ruleset == "algebra" and rf.doc == ""


def test_top_comment_directly_on_a_rule_is_the_rules_doc():
    rf = parse_rules("# -(-x) -> x\nrule r: Neg(Neg(x)) => x")
    assert rf.doc == "" and rf.rules[0].doc == "-(-x) -> x"


def test_patterns_literals_and_expressions():
    rf = parse_rules(
        'rule r: TopK(x, k)[1] {axis = -1, largest = true, mode = "a", pads = [0, 1], alpha = -inf, rest}'
        " => com.egraft::Foo(x[1:], -x[0], k % 2 != 0, not 1.5e3 < 2, f32, inf) {rest, beta = 1}"
    )
    (root,) = rf.rules[0].roots
    assert root.output == 1 and root.attrs_rest == "rest"
    assert [(a.name, a.literal) for a in root.attrs] == [
        ("axis", -1), ("largest", True), ("mode", "a"), ("pads", [0, 1]), ("alpha", -math.inf)]
    (call,) = rf.rules[0].results
    assert (call.domain, call.func, call.attrs_spread) == ("com.egraft", "Foo", ("rest",))
    assert [k for k, _ in call.kwargs] == ["beta"]
    slice_, neg, mod, not_, dtype, inf = call.args
    assert isinstance(slice_, EIndex) and slice_.index[1] is None
    assert isinstance(neg, EUnary) and neg.op == "-" and isinstance(neg.operand, EIndex)
    assert mod.op == "!=" and mod.left.op == "%"
    assert not_.op == "not" and not_.operand.op == "<" and not_.operand.left.value == 1500.0
    assert dtype == EVar("f32", at(1, 158, "<string>"))
    assert inf.value == math.inf


def test_domain_qualified_pattern_and_wildcards():
    rf = parse_rules("rule r: com.egraft::FusedConv(x, _, ws...) => x")
    (root,) = rf.rules[0].roots
    assert (root.domain, root.op, root.rest) == ("com.egraft", "FusedConv", "ws")
    assert root.args[1] == PVar("_", at(1, 34, "<string>"))


# ---- diagnostics -----------------------------------------------------------------------
def test_typo_in_an_op_name():
    assert error_of("rule r:\n    Relu(Rleu(x)) => x\n") == "t.rules:2:10: unknown op 'Rleu'; did you mean 'Relu'?"


def test_typo_in_a_replacement_op():
    assert error_of("rule r:\n    Relu(x) => Sqr(x)\n") == "t.rules:2:16: unknown op 'Sqr'; did you mean 'Sqrt'?"


def test_unknown_attribute():
    assert error_of("rule r:\n    Conv(x, w) {dilation = [1, 1]} => x\n") == (
        "t.rules:2:17: unknown attribute 'dilation' for Conv at opset 21; did you mean 'dilations'?")
    assert error_of("rule r:\n    Relu(x) => Relu(x, slope = 2)\n") == (
        "t.rules:2:32: unknown attribute 'slope' for Relu at opset 21; Relu takes no attributes")


@pytest.mark.parametrize("call", [
    "Unsqueeze(x, axes = [0])", "Squeeze(x, axes = [0])", "Split(x, split = [1, 1], axis = 0)",
    "ReduceSum(x, axes = [1], keepdims = 0)", "Pad(x, pads = [0, 0])", "Clip(x, min = 0.0, max = 6.0)",
    "Resize(x, scales = [1.0, 2.0])",
])
def test_keywords_that_are_inputs_at_this_opset_are_accepted(call: str):
    check_rule_file(parse_rules(f"rule r: Relu(x) => {call}"))


def test_unbound_variable():
    assert error_of("rule r:\n    Relu(x) where rank(y) == 2 => x\n") == (
        "t.rules:2:24: unbound variable 'y'; bind it in the pattern or in an earlier let")
    assert error_of("rule r:\n    Relu(x) => Neg(k)\n") == (
        "t.rules:2:20: unbound variable 'k'; bind it in the pattern or in an earlier let")


def test_let_is_bound_only_after_it():
    assert error_of("rule r:\n    Relu(x) => k = Neg(k) k\n") == (
        "t.rules:2:24: unbound variable 'k'; bind it in the pattern or in an earlier let")


def test_let_shadowing_a_pattern_variable():
    assert error_of("rule r:\n    Relu(x) => x = Neg(x) x\n") == (
        "t.rules:2:16: let 'x' shadows the pattern variable 'x' bound at t.rules:2:10; choose another name")


def test_syntax_error_in_the_middle_of_a_rule():
    assert error_of("rule r:\n    Mul(x c) => x\n") == (
        "t.rules:2:11: unexpected name 'c'; expected one of '(', ')', ',', '...' or '?'")
    assert error_of("rule r:\n    Mul(x, c) where => x\n") == "t.rules:2:21: unexpected '=>'; expected an expression"


def test_unexpected_end_of_file():
    assert error_of("rule r:\n    Mul(x, c) =>\n# nothing follows\n") == (
        "t.rules:2:17: unexpected end of file; expected an expression")


def test_unexpected_character():
    assert error_of("rule r: Relu(x) => x $") == (
        "t.rules:1:22: unexpected character '$'; a rule file holds names, numbers, \"strings\", operators "
        "and ( ) [ ] { } , ; : = => ... (see docs/rules.md)")


def test_keyword_as_a_name():
    assert error_of("rule where: Relu(x) => x") == "t.rules:1:6: unexpected 'where'; expected a name"


def test_wrong_result_count():
    assert error_of("rule r:\n    p = Relu(x); q = Neg(x) => x\n") == (
        "t.rules:2:32: rule 'r' has 2 roots but 1 result; give one result per root, separated by commas")


def test_two_attribute_captures():
    assert error_of("rule r: Conv(x, w) {a, b} => x") == (
        "t.rules:1:24: a second attribute capture 'b' in one pattern (the first is 'a'); "
        "capture the remaining attributes once")


def test_multi_root_rules_need_named_ops():
    assert error_of("rule r: p = *(xs...); q = Neg(x) => x, x") == (
        "t.rules:1:13: each root of a multi-root rule must be a named op, not '*'; write the op this root matches")
    assert error_of("rule r: x => x") == (
        "t.rules:1:9: the root of a rule must be an op pattern such as Relu(x), not the variable 'x'; "
        "write the op it matches")


def test_unknown_functions():
    assert error_of("rule r: Relu(x) where constt(x) => x") == (
        "t.rules:1:23: unknown function 'constt'; did you mean 'const'?")
    assert error_of("rule r: Relu(x) where fold(x) => x") == (
        "t.rules:1:23: 'fold' can only be used in a replacement; remove it from a where clause")
    assert error_of("rule r: Relu(x) => sqrt(x)") == (
        "t.rules:1:20: unknown function 'sqrt'; did you mean the op 'Sqrt'?")


def test_spreading_a_non_attribute_set():
    assert error_of("rule r: Softmax(x) {axis = a} => Softmax(x) {a}") == (
        "t.rules:1:34: 'a' is an attribute value, not an attribute set; "
        "only a pattern's {a} capture can be spread into an op")


def test_duplicate_rule_names_in_one_file():
    assert error_of("rule r: Relu(x) => x\nrule r: Neg(x) => x\n") == (
        "t.rules:2:1: duplicate rule name 'r', first defined at t.rules:1:1; rename one of them")


# ---- loading files ---------------------------------------------------------------------
def test_duplicate_rule_names_across_files(tmp_path: Path):
    a, b = tmp_path / "a.rules", tmp_path / "b.rules"
    a.write_text("rule neg_neg: Neg(Neg(x)) => x\n")
    b.write_text("# again\n\nrule neg_neg:\n    Neg(Neg(y)) => y\n")
    with pytest.raises(RuleError) as info:
        load_rules([a, b], include_shipped=False)
    assert str(info.value) == f"{b}:3:1: duplicate rule name 'neg_neg', first defined at {a}:1:1; rename one of them"
    assert info.value.loc == Loc(str(b), 3, 1)


def test_load_rules_reads_parses_and_checks(tmp_path: Path):
    (tmp_path / "folding.rules").write_text(EXAMPLE)
    (tmp_path / "bad.rules").write_text("rule r: Rleu(x) => x\n")
    (rf,) = load_rules([tmp_path / "folding.rules", tmp_path / "folding.rules"], include_shipped=False)
    assert rf.ruleset == "folding" and len(rf.rules) == 4 and len(rf.source_hash) == 64
    with pytest.raises(RuleError, match=r"bad\.rules:1:9: unknown op 'Rleu'; did you mean 'Relu'\?"):
        load_rules([tmp_path], include_shipped=False)


def test_missing_file(tmp_path: Path):
    with pytest.raises(RuleError, match="cannot read rule file .*nope.rules"):
        load_rules([tmp_path / "nope.rules"], include_shipped=False)


def test_shipped_rules_load():
    assert shipped_rule_files() == sorted(shipped_rule_files())
    assert all(p.suffix == ".rules" for p in shipped_rule_files())
    load_rules()


def test_the_example_in_the_docs_is_the_tested_one():
    docs = (Path(__file__).resolve().parent.parent / "docs" / "rules.md").read_text()
    section = docs.split("## An example, explained", 1)[1]
    block = section.split("```\n", 2)[1]
    assert block == EXAMPLE

"""The rule soundness checker: the shipped library checks out (every rule sound, none
unchecked), subtly wrong rules are caught with a counterexample whose error is what the algebra
says, counterexamples run in onnxruntime, examples are checked, and `egraft rules check` and
`egraft rules test` report."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np
import onnx
import pytest
from typer.testing import CliRunner

from egraft.cli import app
from egraft.extract.greedy import extract_refs
from egraft.ir.dtypes import DType
from egraft.ir.graph import Graph, Node, Value
from egraft.ir.types import TensorType
from egraft.rewrite.ast import Example, ExampleAttrs, ExampleTensor, Loc, PAbsent
from egraft.rewrite.egraph import EGraphState
from egraft.rewrite.load import expand_optional, load_rules
from egraft.rewrite.parser import parse_rules
from egraft.rewrite.soundness import check_examples, check_rule, check_rules
from egraft.rewrite.soundness_numeric import UNIT_ROUNDOFF, allowance

runner = CliRunner()
UNSOUND = Path(__file__).parent / "data" / "unsound.rules"
HERE = Loc("<test>", 1, 1)


def _rule(text: str):
    """The one rule of ``text``."""
    (rule,) = parse_rules(text, "<test>").rules
    return rule


def _dims(type_text: str) -> list[int]:
    """``"f64[2, 3, 7, 5]"`` -> ``[2, 3, 7, 5]``."""
    inside = type_text[type_text.index("[") + 1:-1]
    return [int(d) for d in inside.split(",")] if inside.strip() else []


@pytest.fixture(scope="module")
def shipped_checks():
    """Every shipped rule with its verdict (checked once for the module)."""
    return {c.rule: c for c in (check_rule(rule) for f in load_rules([], include_shipped=True) for rule in f.rules)}


@pytest.fixture(scope="module")
def unsound_checks(tmp_path_factory):
    """Every rule of the unsound suite with its verdict, counterexamples written."""
    folder = tmp_path_factory.mktemp("counterexamples")
    rules = [rule for f in load_rules([UNSOUND], include_shipped=False) for rule in f.rules]
    return folder, {rule.name: check_rule(rule, counterexamples=folder) for rule in rules}


# ---- the shipped library -----------------------------------------------------------------
def test_every_shipped_rule_is_sound_and_none_is_unchecked(shipped_checks):
    bad = [f"{c.rule} ({c.loc}): {c.status}: {c.reason}; {c.trial.describe() if c.trial else ''}"
           for c in shipped_checks.values() if c.status != "sound"]
    assert not bad, "shipped rules not sound:\n" + "\n".join(bad)
    failing = [f"{c.rule}: {e.loc}: {e.status}: {e.reason}" for c in shipped_checks.values()
               for e in c.failing_examples]
    assert not failing, "failing examples:\n" + "\n".join(failing)
    for c in shipped_checks.values():
        assert c.checked >= 1 and c.trial.ratio <= 1.0 and c.trial.max_abs_error <= c.trial.allowed
    # most rules are checked on several instances (families and attribute variants), not one
    assert sum(c.checked >= 3 for c in shipped_checks.values()) >= 0.9 * len(shipped_checks)


def test_shipped_batchnorm_folding_is_checked_on_distinct_dims_in_float64(shipped_checks):
    check = shipped_checks["fold_bn_into_conv"]
    assert check.status == "sound" and check.checked >= 3
    assert check.trial.precision == "float64"
    # a per-channel scale with as many entries as the convolution has output channels
    channels = _dims(check.trial.constants["w"].split()[0])[0]
    assert _dims(check.trial.constants["s"].split()[0]) == [channels]
    # a float64 bound: far below float32's rounding of results of magnitude ~1..100
    assert 0 < check.trial.allowed < 1e-10


@pytest.mark.parametrize("name", ["blocked_conv_pre_activation", "blocked_conv_pre_activation_scaled",
                                  "conv_from_nchw_to_blocked", "depthwise_conv_to_blocked",
                                  "concat_through_unblock", "separable_max_pool"])
def test_blocked_layout_rules_are_instantiated(shipped_checks, name):
    check = shipped_checks[name]
    assert check.status == "sound", check.reason
    if name.startswith("blocked_conv_pre"):
        x = _dims(check.trial.inputs["x"])
        assert len(x) == 5 and x[-1] == 8  # a blocked tensor: [N, C / 8, H, W, 8]


# ---- wrong rules and their counterexamples ------------------------------------------------
def test_dropping_a_relu_is_unsound_with_a_shrunk_counterexample():
    check = check_rule(_rule("rule relu_drop: Relu(x) => x"))
    assert check.status == "unsound"
    example = check.counterexample
    assert example is not None and set(example.inputs) == {"x"}
    assert np.prod(_dims(example.inputs["x"])) <= 16 and example.draws == 1  # shrunk: small, one draw
    # relu(x) - x = -min(x, 0): the error is the most negative input, far above the allowance.
    assert example.max_abs_error > 0.01 and example.max_abs_error > 1e6 * example.allowed


def test_swapping_a_subtraction_is_off_by_exactly_two():
    check = check_rule(_rule("rule sub_swap: Sub(a, b) => Sub(b, a)"))
    assert check.status == "unsound"
    # (b - a) - (a - b) = -2 (a - b): the relative error is 2 on any input.
    assert check.counterexample.max_rel_error == pytest.approx(2.0, rel=1e-9)
    assert set(check.counterexample.inputs) == {"a", "b"}


def test_a_constant_from_the_guard_sets_the_error():
    wrong = check_rule(_rule("rule r: Mul(x, c) where const(c) and all_equal(c, 3) => Add(x, x)"))
    assert wrong.status == "unsound"
    assert wrong.counterexample.constants["c"].endswith("all 3")
    # 3x - 2x = x, relative to max |3x|: one third.
    assert wrong.counterexample.max_rel_error == pytest.approx(1 / 3, rel=1e-9)
    right = check_rule(_rule("rule r: Mul(x, c) where const(c) and all_equal(c, 2) => Add(x, x)"))
    assert right.status == "sound" and right.counterexample is None


def test_folds_and_egraft_only_ops_are_checked():
    fold = check_rule(_rule("rule f: n = Mul(a, b) where const(a, b) => fold(n)"))
    assert fold.status == "sound"
    fused = check_rule(_rule('rule g: Relu(Conv(x, w, b) {attrs}) '
                             '=> com.egraft::FusedConv(x, w, b) {attrs, activation = "sigmoid"}'))
    assert fused.status == "unsound"  # relu is not sigmoid: the fused kernel ran


def test_a_guard_that_never_holds_is_unchecked_with_a_reason():
    check = check_rule(_rule("rule never: Relu(x) where rank(x) == 4 and rank(x) == 2 => x"))
    assert check.status == "unchecked"
    assert check.reason.startswith("no instance satisfied the guard in ")
    assert check.attempts > 0 and check.trial is None


def test_distinct_dims_catch_an_axis_mix_up():
    # H * H for H * W: with all dims equal it would agree on every input
    check = check_rule(_rule("rule gap: GlobalAveragePool(x) where rank(x) == 4 "
                             "=> ReduceSum(x, [2, 3]) {keepdims = 1} / (dim(x, 2) * dim(x, 2))"))
    assert check.status == "unsound"
    h, w = _dims(check.counterexample.inputs["x"])[2:]
    assert h != w
    assert check.counterexample.max_rel_error == pytest.approx(abs(1 - w / h), rel=1e-9)


def test_free_attributes_take_their_values():
    # alpha and beta are not in the pattern: the matcher ignores them and the replacement drops them
    check = check_rule(_rule("rule gemm: Gemm(a, b, c) {transA = 0, transB = 0} where rank(c) == 2 "
                             "=> Add(MatMul(a, b), c)"))
    assert check.status == "unsound"
    assert "alpha=" in check.counterexample.instance or "beta=" in check.counterexample.instance
    # the right one, with alpha and beta read, agrees on every variant (including transposed operands)
    right = check_rule(_rule("rule gemm_ok: Gemm(a, b, c) {transA = 0, transB = 0, alpha = p, beta = q} "
                             "where rank(c) == 2 => Add(MatMul(a, b) * p, c * q)"))
    assert right.status == "sound" and right.checked >= 6


def test_transpose_perms_are_enumerated():
    wrong = check_rule(_rule("rule t: Transpose(Transpose(x) {perm = p}) {perm = q} "
                             "where compose_perm(full_perm(p, rank(x)), full_perm(q, rank(x))) != range(rank(x)) "
                             "=> Transpose(x, perm = compose_perm(full_perm(q, rank(x)), full_perm(p, rank(x))))"))
    assert wrong.status == "unsound"  # right only for perms that commute, which the defaults are
    right = check_rule(_rule("rule t: Transpose(Transpose(x) {perm = p}) {perm = q} "
                             "where compose_perm(full_perm(p, rank(x)), full_perm(q, rank(x))) != range(rank(x)) "
                             "=> Transpose(x, perm = compose_perm(full_perm(p, rank(x)), full_perm(q, rank(x))))"))
    assert right.status == "sound" and right.checked >= 6


def test_a_batchnorm_fold_without_epsilon_is_unsound_in_float64():
    check = check_rule(_rule("rule bn: BatchNormalization(Conv(x, w, b) {attrs}, s, t, m, v) {epsilon = eps} "
                             "where const(w, b, s, t, m, v) and rank(w) == 4 "
                             "=> k = s / Sqrt(v) Conv(x, w * Unsqueeze(k, axes = [1, 2, 3]), (b - m) * k + t) {attrs}"))
    assert check.status == "unsound"
    example = check.counterexample
    assert example.precision == "float64"
    # about eps / (2 v) of the result: inside a flat 1e-4, far outside float64 rounding
    assert 1e-8 < example.max_rel_error < 1e-4
    assert example.max_abs_error > 1e3 * example.allowed


def test_the_tolerance_scales_with_the_measured_float32_error():
    assert allowance(0.0, 1.0, DType.FLOAT64) == pytest.approx(16 * UNIT_ROUNDOFF[DType.FLOAT64])
    # a float32 program that errs by 1e-6 allows 256 times that, scaled to float64's roundoff
    assert allowance(1e-6, 0.0, DType.FLOAT64) == pytest.approx(256 * 1e-6 * 2.0 ** -29)
    assert allowance(1e-6, 0.0, DType.FLOAT32) == pytest.approx(16 * 1e-6)


def test_the_unsound_suite_is_caught(unsound_checks):
    folder, checks = unsound_checks
    assert len(checks) >= 10
    missed = [f"{c.rule}: {c.status} {c.reason}" for c in checks.values() if c.status != "unsound"]
    assert not missed, "unsound rules not caught:\n" + "\n".join(missed)
    for c in checks.values():
        example = c.counterexample
        assert example is not None and example.draws == 1
        assert example.max_abs_error > example.allowed
        assert example.file.endswith(".onnx"), example.file
    # the subtle ones: below a flat 1e-4, caught by the float64 bound
    for name in ("bn_fold_forgets_epsilon", "div_by_three_rounded_reciprocal"):
        assert checks[name].counterexample.max_rel_error < 1e-4


@pytest.mark.parametrize("name", ["transposes_composed_backwards", "softmax_through_transpose_keeps_axis",
                                  "bn_fold_forgets_epsilon", "gemm_ignores_alpha_beta", "concat_of_split_swapped"])
def test_counterexample_models_show_the_difference_in_onnxruntime(unsound_checks, name):
    ort = pytest.importorskip("onnxruntime")
    folder, checks = unsound_checks
    path = Path(checks[name].counterexample.file)
    assert path.parent == folder
    model = onnx.load(path)
    onnx.checker.check_model(model)
    assert [o.name for o in model.graph.output] == ["before", "after"]
    feeds = dict(np.load(path.with_suffix(".inputs.npz")))
    assert set(feeds) == {i.name for i in model.graph.input}
    before, after = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"]).run(None, feeds)
    scale = float(np.max(np.abs(before)))
    # beyond float32 rounding of what onnxruntime computed (a few ulps of the largest value for these small sums)
    assert float(np.max(np.abs(after.astype(np.float64) - before))) > 8 * 2.0 ** -24 * scale


def test_counterexamples_with_egraft_ops_export_their_functions(tmp_path):
    ort = pytest.importorskip("onnxruntime")
    rule = _rule('rule g: Relu(Conv(x, w, b) {attrs}) '
                 '=> com.egraft::FusedConv(x, w, b) {attrs, activation = "sigmoid"}')
    check = check_rule(rule, counterexamples=tmp_path)
    path = Path(check.counterexample.file)
    model = onnx.load(path)
    onnx.checker.check_model(model)
    assert any(f.domain == "com.egraft" for f in model.functions)
    before, after = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"]).run(
        None, dict(np.load(path.with_suffix(".inputs.npz"))))
    assert np.all(before >= 0) and np.all((after > 0) & (after < 1))  # a relu, and a sigmoid
    assert not np.allclose(before, after)


# ---- optional operands and examples ---------------------------------------------------------
def test_an_absent_operand_in_the_middle_is_instantiated():
    rule = _rule("rule clip_hi: Clip(x, lo?, hi) where const(hi) => Min(x, hi)")
    variants = {v.name: v for v in expand_optional(rule)}
    without = variants["clip_hi/without_lo"]
    assert isinstance(without.roots[0].args[1], PAbsent)
    check = check_rule(without)
    assert check.status == "sound" and set(check.trial.inputs) == {"x"}
    # with a lower bound Min(x, hi) forgets it: the rule as a whole is unsound
    assert check_rule(variants["clip_hi"]).status == "unsound"
    assert check_rule(rule).status == "unsound"


def _conv_relu():
    return _rule('rule cr: Relu(Conv(x, w, b) {attrs}) => com.egraft::FusedConv(x, w, b) {attrs, activation = "relu"}')


def test_examples_are_checked_with_their_own_values():
    rule = dataclasses.replace(_conv_relu(), examples=(
        Example((("x", ExampleTensor("f32", (1, 8, 9, 7), HERE)), ("w", ExampleTensor("f32", (16, 8, 3, 3), HERE)),
                 ("b", ExampleTensor("f32", (16,), HERE)),
                 ("attrs", ExampleAttrs((("pads", [1, 1, 1, 1]), ("strides", [2, 1])), HERE))), Loc("<test>", 2, 5)),
        # the weights do not fit the input: the instance cannot be built
        Example((("x", ExampleTensor("f32", (1, 3, 5, 5), HERE)), ("w", ExampleTensor("f32", (4, 5, 1, 1), HERE)),
                 ("b", ExampleTensor("f32", (4,), HERE))), Loc("<test>", 3, 5)),
    ))
    first, second = check_examples(rule)
    # tensors are inputs (the guard asks const() of none), of the example's shapes
    assert first.status == "sound"
    assert first.trial.inputs == {"x": "f64[1, 8, 9, 7]", "w": "f64[16, 8, 3, 3]", "b": "f64[16]"}
    assert first.trial.constants == {} and first.trial.instance == "example"
    assert second.status == "failed" and "could not be built" in second.reason
    check = check_rule(rule)
    assert check.status == "sound" and [e.status for e in check.examples] == ["sound", "failed"]


def test_examples_the_guard_refuses_or_the_pattern_misses_fail_with_the_reason():
    rule = _rule("rule m: Mul(x, c) where const(c) and all_equal(c, 1) => x")
    rule = dataclasses.replace(rule, examples=(
        Example((("x", ExampleTensor("f32", (2, 3), HERE)), ("c", 1.0)), Loc("<test>", 2, 5)),
        Example((("x", ExampleTensor("f32", (2, 3), HERE)), ("c", 2.0)), Loc("<test>", 3, 5)),
    ))
    good, refused = check_examples(rule)
    assert good.status == "sound" and good.trial.constants["c"].endswith("all 1")
    assert refused.status == "failed" and refused.reason.startswith("the guard refuses the example")
    wrong = dataclasses.replace(_rule("rule hs: HardSigmoid(x) {alpha = a, beta = c} => Relu(x)"), examples=(
        Example((("x", ExampleTensor("f32", (4,), HERE)), ("a", 0.2), ("c", 0.5)), Loc("<test>", 2, 5)),))
    (unsound,) = check_examples(wrong)
    assert unsound.status == "unsound"
    assert check_rule(wrong).status == "unsound"


# ---- plumbing ----------------------------------------------------------------------------
def test_extract_refs_gives_the_programs_of_chosen_handles():
    x = Value("x", TensorType(DType.FLOAT32, (4,)))
    y = Value("y", TensorType(DType.FLOAT32, (4,)))
    state = EGraphState.from_graph(Graph("g", [x], [y], [Node("Relu", (x,), (y,))], opsets={"": 18}))
    graph = extract_refs(state.snapshot(), [state.output_refs[0], state.input_refs["x"]], ["relu", "same"])
    data = np.array([-2.0, -0.5, 0.5, 2.0], np.float32)
    out = graph.run({"x": data})
    np.testing.assert_array_equal(out["relu"], np.maximum(data, 0))
    np.testing.assert_array_equal(out["same"], data)


def test_check_rules_reads_files(tmp_path):
    path = tmp_path / "mine.rules"
    path.write_text("ruleset mine\n\n# -(-x) -> x\nrule neg_neg:\n    Neg(Neg(x)) => x\n")
    (check,) = check_rules([path])
    assert (check.rule, check.status, check.loc) == ("neg_neg", "sound", f"{path}:4:1")


def test_cli_rules_check_exits_1_on_an_unsound_rule_and_writes_its_counterexample(tmp_path):
    path = tmp_path / "bad.rules"
    path.write_text("ruleset bad\n\n# wrong\nrule drop:\n    Relu(x) => x\n\n# right\nrule negneg:\n"
                    "    Neg(Neg(x)) => x\n\n# never applies\nrule never:\n"
                    "    Relu(x) where rank(x) == 4 and rank(x) == 2 => x\n")
    out = tmp_path / "cex"
    result = runner.invoke(app, ["rules", "check", str(path), "--counterexamples", str(out)])
    assert result.exit_code == 1, result.output
    assert "rule soundness" in result.output and "1 sound, 1 unsound, 1 unchecked" in result.output
    for word in ("drop", "negneg", "never", "unsound", "unchecked"):
        assert word in result.output
    assert (out / "drop.onnx").exists() and (out / "drop.inputs.npz").exists()
    assert "written to" in result.output
    as_json = runner.invoke(app, ["rules", "check", str(path), "--json", "--counterexamples", str(out)])
    rows = {r["rule"]: r for r in json.loads(as_json.output)["rules"]}
    assert rows["drop"]["instance"]["file"] == str(out / "drop.onnx")


def test_cli_rules_check_exits_0_when_nothing_is_unsound(tmp_path):
    path = tmp_path / "good.rules"
    path.write_text("ruleset good\nrule negneg:\n    Neg(Neg(x)) => x\nrule never:\n"
                    "    Relu(x) where rank(x) == 4 and rank(x) == 2 => x\n")
    result = runner.invoke(app, ["rules", "check", str(path)])
    assert result.exit_code == 0, result.output
    assert "1 sound, 0 unsound, 1 unchecked" in result.output
    as_json = runner.invoke(app, ["rules", "check", str(path), "--json"])
    assert as_json.exit_code == 0
    assert '"sound": 1' in as_json.output
    strict = runner.invoke(app, ["rules", "check", str(path), "--strict"])  # an unchecked rule fails it
    assert strict.exit_code == 1 and "1 unchecked" in strict.output
    checked = tmp_path / "checked.rules"
    checked.write_text("ruleset checked\nrule negneg:\n    Neg(Neg(x)) => x\n")
    strict = runner.invoke(app, ["rules", "check", str(checked), "--strict"])
    assert strict.exit_code == 0 and "1 sound, 0 unsound, 0 unchecked" in strict.output
    assert strict.output.rstrip().endswith("all sound, 0 unchecked")


def test_cli_rules_test_runs_the_examples(tmp_path):
    path = tmp_path / "ex.rules"
    path.write_text("ruleset ex\n\nrule m:\n    Mul(x, c) where const(c) and all_equal(c, 1) => x\n"
                    "    example: x = f32[2, 3], c = 1.0\n")
    result = runner.invoke(app, ["rules", "test", str(path)])
    assert result.exit_code == 0, result.output
    assert "rule examples" in result.output and "1 example: 1 sound, 0 unsound, 0 failed" in result.output
    path.write_text(path.read_text() + "    example: x = f32[2, 3], c = 2.0\n"
                    "\nrule hs:\n    HardSigmoid(x) {alpha = a, beta = c} => Relu(x)\n"
                    "    example: x = f32[4], a = 0.2, c = 0.5\n")
    result = runner.invoke(app, ["rules", "test", str(path)])
    assert result.exit_code == 1, result.output
    assert "3 examples: 1 sound, 1 unsound, 1 failed" in result.output
    assert "guard refuses the example" in result.output.replace("\n", " ").replace("│", " ") or \
        "guard" in result.output


def test_cli_rules_test_names_a_missing_or_broken_file_in_one_line(tmp_path):
    missing = runner.invoke(app, ["rules", "test", str(tmp_path / "none.rules")])
    assert missing.exit_code != 0 and "Traceback" not in missing.output
    assert "cannot read rule file" in missing.output
    broken = tmp_path / "broken.rules"
    broken.write_text("ruleset broken\nrule r:\n    Relu(x =>\n")
    result = runner.invoke(app, ["rules", "test", str(broken)])
    assert result.exit_code != 0 and "Traceback" not in result.output
    assert "error:" in result.output and len(result.output.strip().splitlines()) <= 2

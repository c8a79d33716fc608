"""The rule soundness checker: the shipped library checks out, wrong rules are caught with
a counterexample whose error is what the algebra says, and `egraft rules check` reports."""

from __future__ import annotations

import numpy as np
import pytest
from typer.testing import CliRunner

from egraft.cli import app
from egraft.extract.greedy import extract_refs
from egraft.ir.dtypes import DType
from egraft.ir.graph import Graph, Node, Value
from egraft.ir.types import TensorType
from egraft.rewrite.egraph import EGraphState
from egraft.rewrite.load import load_rules
from egraft.rewrite.parser import parse_rules
from egraft.rewrite.soundness import TOLERANCE, check_rule, check_rules

runner = CliRunner()


def _rule(text: str):
    """The one rule of ``text``."""
    (rule,) = parse_rules(text, "<test>").rules
    return rule


@pytest.fixture(scope="module")
def shipped_checks():
    """Every shipped rule with its verdict (checked once for the module)."""
    return [check_rule(rule) for f in load_rules([], include_shipped=True) for rule in f.rules]


def test_shipped_rules_are_sound_or_unchecked_with_a_reason(shipped_checks):
    unsound = [f"{c.rule} ({c.loc}): {c.reason}; {c.trial.describe()}" for c in shipped_checks
               if c.status == "unsound"]
    assert not unsound, "unsound shipped rules:\n" + "\n".join(unsound)
    unchecked = [f"{c.rule} ({c.loc}): {c.reason}" for c in shipped_checks if c.status == "unchecked"]
    assert all(c.reason for c in shipped_checks if c.status == "unchecked")
    sound = [c for c in shipped_checks if c.status == "sound"]
    assert len(sound) >= 0.8 * len(shipped_checks), \
        f"{len(sound)} of {len(shipped_checks)} sound; unchecked:\n" + "\n".join(unchecked)
    assert all(c.trial.max_rel_error <= TOLERANCE for c in sound)


def test_shipped_batchnorm_folding_is_checked_on_a_real_instance(shipped_checks):
    by_name = {c.rule: c for c in shipped_checks}
    check = by_name["fold_bn_into_conv"]
    assert check.status == "sound"
    assert check.trial.inputs == {"x": "f32[3, 3, 3, 3]"}
    assert check.trial.constants["s"].startswith("f32[3] ")  # a per-channel scale, not a single channel


def test_dropping_a_relu_is_unsound_with_a_counterexample():
    check = check_rule(_rule("rule relu_drop: Relu(x) => x"))
    assert check.status == "unsound"
    example = check.counterexample
    assert example is not None and example.inputs == {"x": "f32[3, 3, 3, 3]"}
    # relu(x) - x = -min(x, 0): the error is the most negative input, far above the tolerance.
    assert example.max_abs_error > 0.5 and example.max_rel_error > 0.1


def test_swapping_a_subtraction_is_off_by_exactly_two():
    check = check_rule(_rule("rule sub_swap: Sub(a, b) => Sub(b, a)"))
    assert check.status == "unsound"
    # (b - a) - (a - b) = -2 (a - b): the relative error is 2 on any input.
    assert check.counterexample.max_rel_error == pytest.approx(2.0, rel=1e-6)
    assert set(check.counterexample.inputs) == {"a", "b"}


def test_a_constant_from_the_guard_sets_the_error():
    wrong = check_rule(_rule("rule r: Mul(x, c) where const(c) and all_equal(c, 3) => Add(x, x)"))
    assert wrong.status == "unsound"
    assert wrong.counterexample.constants["c"].endswith("all 3")
    # 3x - 2x = x, relative to max |3x|: one third.
    assert wrong.counterexample.max_rel_error == pytest.approx(1 / 3, rel=1e-5)
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


def test_cli_rules_check_exits_1_on_an_unsound_rule(tmp_path):
    path = tmp_path / "bad.rules"
    path.write_text("ruleset bad\n\n# wrong\nrule drop:\n    Relu(x) => x\n\n# right\nrule negneg:\n"
                    "    Neg(Neg(x)) => x\n\n# never applies\nrule never:\n"
                    "    Relu(x) where rank(x) == 4 and rank(x) == 2 => x\n")
    result = runner.invoke(app, ["rules", "check", str(path)])
    assert result.exit_code == 1, result.output
    assert "rule soundness" in result.output and "1 sound, 1 unsound, 1 unchecked" in result.output
    for word in ("drop", "negneg", "never", "unsound", "unchecked"):
        assert word in result.output


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

"""The rule soundness checker: does each rule's replacement compute what it replaces?

For a rule, the checker builds small concrete instances of its root pattern(s) as IR
graphs, matches and builds the rule on them exactly as :func:`egraft.rewrite.engine.saturate`
does but without the union (:mod:`egraft.rewrite.soundness_engine`), and runs the matched
program and the replacement with the reference executor on random inputs.

**Instances** (:mod:`egraft.rewrite.soundness_search`). Dims come from families: ``distinct``
(each axis a different small prime: a rule that confuses two axes is caught), ``blocked``
(channels in multiples of 8, rank-5 tensors ending in the block 8: the blocked-layout rules
instantiate), and ``equal d`` for d in 3, 8, 2, 4, 1. Shapes of later operands derive from
the inputs already placed at their op, and the guard's hints (:mod:`egraft.rewrite.soundness_hints`)
pin ranks, dims and attribute values. A variable is a constant when the guard asks
``const(...)`` of it or when it sits where the op takes integers. Each family gives a *base*
instance; its **variants** give the attributes the pattern leaves free (captured, in an
``{attrs}`` capture, or not mentioned) their meaningful values (:mod:`egraft.rewrite.soundness_attrs`:
Gemm's alpha and beta, every permutation of a Transpose, each Softmax axis, strides, pads,
groups...) and integer operands their other values. A rule is ``sound`` after
``SOUND_TARGET`` agreeing instances (or all there were, within ``trials`` attempts).

**Numbers** (:mod:`egraft.rewrite.soundness_numeric`). Values of four modes (normal, positive,
magnitudes over 1e-2..1e2 signed and positive) take turns. Both programs run in float64 (the
float32 instance lifted), falling back to float32 (and saying so) where an op or the guard
refuses float64. The tolerance is the matched program's own measured float32 rounding error
scaled to the precision, times ``NOISE_FACTOR``, plus a rounding floor: about 1e-13 of the
result in float64, so an epsilon-sized mistake (a BatchNorm fold without its 1e-5) is unsound.

**Counterexamples.** An unsound rule's failing instance is shrunk (the smallest family that
still fails, with the same variant; the one failing draw) and, when asked for, written as a
runnable ONNX model with outputs ``before`` and ``after`` (:mod:`egraft.rewrite.soundness_export`).

**Examples.** A rule's ``example:`` lines (:class:`egraft.rewrite.ast.Example`) are checked as
instances of their own (:func:`check_examples`); one the pattern does not match, the guard
refuses, or that cannot be built fails with the reason.

Example:
    >>> from egraft.rewrite.parser import parse_rules
    >>> rule = parse_rules("rule r: Relu(x) => x", "<string>").rules[0]
    >>> check_rule(rule).status
    'unsound'
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np

from egraft.ir.dtypes import DType
from egraft.ir.graph import Graph, Value
from egraft.ir.types import TensorType
from egraft.rewrite.ast import ECall, Example, ExampleAttrs, ExampleTensor, POp, PVar, Rule
from egraft.rewrite.builtins import DTYPE_NAMES
from egraft.rewrite.soundness_engine import Applied, apply_rule
from egraft.rewrite.soundness_hints import Hints, pattern_nodes, rule_hints, subexprs
from egraft.rewrite.soundness_numeric import (
    VALUE_MODES,
    Comparison,
    compare_runs,
    feeds,
    finite,
    lift,
    nudge_constants,
    realize,
)
from egraft.rewrite.soundness_search import FAMILIES, Draft, Family, Fixed, Instances, search_attr_names

__all__ = ["RuleCheck", "ExampleCheck", "Trial", "check_rule", "check_rules", "check_examples", "SOUND_TARGET"]

#: Agreeing instances (bases and variants) after which a rule is called sound.
SOUND_TARGET = 12
#: Base instances (one per family) before the variants take over.
MAX_BASES = 3
#: The (family, policy) pairs the search tries, in order.
PLAN = tuple((f, policy) for f in FAMILIES for policy in ("first", "vector"))
#: Older opsets tried when no instance could be checked at the one asked for (rules for
#: Split's ``split`` attribute, Unsqueeze's ``axes`` attribute...).
FALLBACK_OPSETS = (13, 11)
#: Instances a counterexample's shrinking checks at most.
SHRINK_CHECKS = 8


# ---- results -----------------------------------------------------------------------------
@dataclass(frozen=True)
class Trial:
    """One checked instance: its inputs and constants and the largest errors seen.

    Attributes:
        inputs: input name -> type text, e.g. ``{"x": "f64[2, 3, 7, 5]"}``.
        constants: constant name -> a summary of its type and values (``"f64[3] all 1"``).
        max_abs_error: max |after - before| over the draws and roots.
        max_rel_error: max |after - before| / max |before|.
        root: the root (0-based) where the error was furthest over its allowance.
        opset: the opset of the instance.
        allowed: the largest error a sound replacement may show there (the tolerance).
        ratio: error / allowed at that root (above 1: unsound).
        precision: ``"float64"``, or ``"float32 (why not float64)"``.
        instance: the family and the variant's changed attributes (``"distinct; perm=[1, 0]"``).
        mode: the value mode of the draws.
        draws: the number of input draws.
        file: the counterexample model written for it ("" when none).
    """

    inputs: dict[str, str]
    constants: dict[str, str]
    max_abs_error: float
    max_rel_error: float
    root: int = 0
    opset: int = 18
    allowed: float = 0.0
    ratio: float = 0.0
    precision: str = "float64"
    instance: str = ""
    mode: str = "signed"
    draws: int = 3
    file: str = ""

    def describe(self) -> str:
        """One line: ``x: f64[3, 3]; c: f64[3] all 1; distinct; float64, opset 18; abs err 0, ...``."""
        parts = [f"{k}: {v}" for k, v in self.inputs.items()] + [f"{k}: {v}" for k, v in self.constants.items()]
        if self.instance:
            parts.append(self.instance)
        parts.append(f"{self.precision}, opset {self.opset}, {self.mode} values, {self.draws} draw"
                     f"{'s' if self.draws != 1 else ''}")
        parts.append(f"abs err {self.max_abs_error:.3g}, rel err {self.max_rel_error:.3g}, allowed {self.allowed:.3g}")
        if self.file:
            parts.append(f"written to {self.file}")
        return "; ".join(parts)


@dataclass(frozen=True)
class ExampleCheck:
    """The verdict on one ``example:`` line of a rule.

    Attributes:
        loc: where the example is written.
        status: ``"sound"``, ``"unsound"`` or ``"failed"`` (the pattern did not match it,
            the guard refused it, or it or its replacement could not be built).
        reason: why it failed or is unsound.
        trial: the checked instance, or None.
    """

    loc: str
    status: str
    reason: str = ""
    trial: Trial | None = None


@dataclass(frozen=True)
class RuleCheck:
    """The verdict on one rule.

    Attributes:
        rule: the rule's name.
        loc: where it is written (``file:line:col``).
        status: ``"sound"``, ``"unsound"`` or ``"unchecked"``.
        reason: for ``unchecked``, why no instance could be checked; for ``unsound``, what
            went wrong (errors too large, or the replacement failed to run).
        trial: the instance checked (the counterexample when unsound), or None.
        attempts: instances matched and guarded before the verdict.
        checked: instances on which the replacement agreed.
        examples: the verdicts on the rule's examples.
    """

    rule: str
    loc: str
    status: str
    reason: str = ""
    trial: Trial | None = None
    attempts: int = 0
    checked: int = 0
    examples: tuple[ExampleCheck, ...] = ()

    @property
    def counterexample(self) -> Trial | None:
        """The instance on which the replacement differs (unsound rules only)."""
        return self.trial if self.status == "unsound" else None

    @property
    def failing_examples(self) -> list[ExampleCheck]:
        """The examples that are unsound or failed."""
        return [e for e in self.examples if e.status != "sound"]


# ---- one instance ------------------------------------------------------------------------
@dataclass
class _Outcome:
    """What one instance showed: a verdict, or why it could not give one."""

    status: str  # "sound", "unsound", "no match", "guard", "build", "nonfinite", "error"
    detail: str = ""
    trial: Trial | None = None
    attempt: bool = True  # the instance went through the matcher (counts against `trials`)
    graph: Graph | None = None  # the float32 instance
    feeds: list[dict] = field(default_factory=list)
    worst_draw: int = 0
    mode: str = "signed"


def _describe(array: np.ndarray) -> str:
    """``f32[3] all 1``, ``i64[2] = [3, 3]`` or ``f32[3, 3] in [-1.2, 0.87]``."""
    head = str(TensorType.of(array))
    flat = array.reshape(-1)
    if flat.size == 0:
        return head
    if np.all(flat == flat[0]):
        return f"{head} all {flat[0]:.6g}"
    if flat.size <= 8 and not np.issubdtype(array.dtype, np.floating):
        return f"{head} = {flat.tolist()}"
    return f"{head} in [{float(flat.min()):.3g}, {float(flat.max()):.3g}]"


def _named_constants(graph: Graph) -> list[Value]:
    """The constants that stand for pattern variables (named after them), once each."""
    seen: dict[str, Value] = {}
    for node in graph.nodes:
        for v in node.inputs:
            if v is not None and v.const is not None and "." not in v.name:
                seen.setdefault(v.name, v)
    return list(seen.values())


class _Checker:
    """Checks instances of one rule at one opset: values, precision (float64 while the rule
    applies to it), verdicts."""

    def __init__(self, rule: Rule, opset: int, hints: Hints, rng: np.random.Generator, draws: int,
                 rest_of: dict[str, str]):
        self.rule = rule
        self.opset = opset
        self.hints = hints
        self.rng = rng
        self.draws = draws
        self.rest_of = rest_of
        self.retry_guard = any(isinstance(e, ECall) and e.func in ("value", "all_equal") for e in subexprs(rule.guard))
        #: True once a float64 instance gave a verdict, False once only float32 ones do
        self.float64: bool | None = None
        self.float64_refusal = ""
        #: constants the guard compares with a decimal that float32 cannot hold exactly
        self.decimals = {rest_of.get(k, k) for k, v in hints.values.items() if float(np.float32(v)) != v}

    def check(self, draft: Draft, primary: str) -> Iterator[_Outcome]:
        """The outcomes of ``draft`` in value mode ``primary``, then while another mode could
        change the outcome: ``positive`` and ``wide+`` after inf or nan, ``random`` (constants
        not the guard's values) after a guard that reads values refused; none when it cannot run."""
        modes, tried = [primary], set()
        while modes:
            mode = modes.pop(0)
            graph = realize(draft, mode, self.hints, self.rng, self.opset, self.rest_of)
            drawn = [feeds(graph, mode, self.rng) for _ in range(self.draws)]
            try:
                reference = graph.run(drawn[0])
            except Exception:
                return  # every mode fails alike: the shapes are wrong
            if not finite(reference.values()):
                yield _Outcome("nonfinite", "the pattern computes inf or nan on every instance", attempt=False)
                outcome = None
            else:
                outcome = self.verdict_on(graph, drawn)
                outcome.graph, outcome.feeds, outcome.mode = graph, drawn, mode
                if outcome.trial is not None:
                    outcome.trial = replace(outcome.trial, instance=draft.describe(), mode=mode)
                yield outcome
            tried.add(mode)
            if outcome is None or outcome.status == "nonfinite":
                modes = [m for m in ("positive", "wide+") if m not in tried][:1]
            elif outcome.status == "guard" and self.retry_guard and "random" not in tried:
                modes = ["random"]

    def verdict_on(self, graph: Graph, drawn: list[dict]) -> _Outcome:
        """The verdict on the float32 instance ``graph`` and draws ``drawn``: in float64 while
        the rule applies there, else in float32."""
        why = self.float64_refusal
        if self.float64 is not False:
            try:
                lifted = lift(graph)
            except Exception as err:
                lifted, why = None, f"float64 refused: {str(err).splitlines()[0][:120]}"
            if lifted is not None:
                outcome = self._verdict(lifted, drawn, DType.FLOAT64)
                if outcome.status in ("sound", "unsound", "nonfinite") or self.float64:
                    self.float64 = True
                    return outcome
                why = f"float64: {outcome.detail}"
        outcome = self._verdict(graph, drawn, DType.FLOAT32)
        if outcome.status in ("sound", "unsound") and self.float64 is None:
            self.float64, self.float64_refusal = False, why
        if outcome.trial is not None:
            outcome.trial = replace(outcome.trial, precision=f"float32 ({why})")
        return outcome

    def _verdict(self, graph: Graph, drawn: list[dict], precision: DType) -> _Outcome:
        applied = apply_rule(self.rule, graph, self.opset)
        if not isinstance(applied, Applied):
            return _Outcome(applied.status, applied.detail)
        inputs = {v.name: str(v.type) for v in graph.inputs}
        constants = {v.name: _describe(graph.constants[v.const]) for v in _named_constants(graph)}
        nudged = None
        if self.decimals:
            moved = nudge_constants(graph, self.decimals)
            nudged = None if moved is None else (graph, moved)
        try:
            comparisons, checked = compare_runs(applied.before, applied.after, drawn, precision, self.rng, nudged)
        except Exception as err:
            trial = Trial(inputs, constants, float("inf"), float("inf"), 0, self.opset, 0.0, float("inf"),
                          precision=_precision_name(precision), draws=len(drawn))
            detail = f"the replacement failed to run: {str(err).splitlines()[0][:200]}"
            return _Outcome("unsound", detail, trial)
        if not checked:
            return _Outcome("nonfinite", "the matched root computes inf or nan on every draw")
        worst = max(range(len(comparisons)), key=lambda i: comparisons[i].ratio)
        c: Comparison = comparisons[worst]
        trial = Trial(inputs, constants, max(x.abs_error for x in comparisons),
                      max(x.rel_error for x in comparisons), worst, self.opset, c.allowed, c.ratio,
                      precision=_precision_name(precision), draws=len(drawn))
        if c.ratio <= 1.0:
            return _Outcome("sound", trial=trial)
        outcome = _Outcome("unsound", f"error {c.abs_error:.3g} > allowed {c.allowed:.3g} (relative error "
                                      f"{c.rel_error:.3g}) at root {worst}", trial)
        outcome.worst_draw = c.draw
        return outcome


def _precision_name(dtype: DType) -> str:
    return "float64" if dtype is DType.FLOAT64 else "float32"


# ---- rules -------------------------------------------------------------------------------
def check_rule(rule: Rule, opset: int = 18, trials: int = 40, seed: int = 0, draws: int = 3,
               counterexamples: str | Path | None = None, examples: bool = True) -> RuleCheck:
    """Check one rule on small random instances of its pattern, and on its examples.

    Args:
        rule: a parsed rule (one with optional operands ``b?`` is checked variant by variant).
        opset: the ONNX opset of the instances (attribute defaults, operand inputs).
        trials: instances to match and guard at most.
        seed: the random seed of constants and inputs.
        draws: input draws per instance.
        counterexamples: a folder to write an unsound rule's counterexample to
            (``<rule>.onnx`` and ``<rule>.inputs.npz``).
        examples: also check the rule's ``example:`` lines.

    Returns:
        A :class:`RuleCheck`: ``sound`` when the replacement agreed on every instance,
        ``unsound`` with the (shrunk) counterexample, or ``unchecked`` with why.

    Example:
        >>> rule = parse_rules("rule r: Sub(a, b) => Sub(b, a)", "<string>").rules[0]   # doctest: +SKIP
        >>> check_rule(rule).counterexample.max_rel_error > 1                           # doctest: +SKIP
        True
    """
    if _has_optional(rule):
        from egraft.rewrite.load import expand_optional

        checks = [check_rule(v, opset, trials, seed, draws, counterexamples, examples) for v in expand_optional(rule)]
        order = {"unsound": 0, "unchecked": 1, "sound": 2}
        worst = min(checks, key=lambda c: order[c.status])
        return replace(worst, rule=rule.name, examples=tuple(e for c in checks for e in c.examples))
    found = _check_at(rule, opset, trials, seed, draws, counterexamples)
    if found.status == "unchecked":
        for older in (o for o in FALLBACK_OPSETS if o < opset):
            again = _check_at(rule, older, trials, seed, draws, counterexamples)
            if again.status != "unchecked":
                found = again
                break
    if examples and rule.examples:
        results = tuple(check_examples(rule, opset, seed, draws))
        found = replace(found, examples=results)
        bad = [e for e in results if e.status == "unsound"]
        if bad and found.status != "unsound":
            found = replace(found, status="unsound", reason=f"example at {bad[0].loc}: {bad[0].reason}",
                            trial=bad[0].trial)
        elif found.status == "unchecked" and any(e.status == "sound" for e in results):
            found = replace(found, status="sound", reason="", trial=next(e.trial for e in results
                                                                          if e.status == "sound"))
    return found


def _has_optional(rule: Rule) -> bool:
    stack = list(rule.roots)
    while stack:
        p = stack.pop()
        if isinstance(p, PVar) and p.optional:
            return True
        if isinstance(p, POp):
            stack.extend(p.args)
    return False


def _check_at(rule: Rule, opset: int, trials: int, seed: int, draws: int,
              counterexamples: str | Path | None) -> RuleCheck:
    """:func:`check_rule` at one opset."""
    missing = _unknown_attributes(rule, opset)
    if missing:
        return RuleCheck(rule.name, str(rule.loc), "unchecked", f"no instance at opset {opset}: {missing}", None, 0)
    rng = np.random.default_rng(seed)
    hints = rule_hints(rule)
    search = Instances(rule, opset, hints, rng)
    checker = _Checker(rule, opset, hints, rng, draws, search.rest_of)
    primaries = itertools.cycle(VALUE_MODES)
    per_family = max(2, -(-trials // len(PLAN)))
    outcomes: list[_Outcome] = []
    bases: list[Draft] = []
    attempts = built = sound = 0
    last: Trial | None = None

    def run(draft: Draft) -> _Outcome | None:
        nonlocal attempts
        final = None
        for outcome in checker.check(draft, next(primaries)):
            attempts += outcome.attempt
            final = outcome
            if outcome.status not in ("sound", "unsound"):
                outcomes.append(outcome)
        return final

    based: set[str] = set()
    for family, policy in PLAN:
        if len(bases) >= MAX_BASES or attempts >= trials:
            break
        if family.name in based:
            continue  # one base per family
        start = attempts
        for draft in search.drafts(family, policy):
            built += 1
            outcome = run(draft)
            if outcome is not None and outcome.status == "unsound":
                return _unsound(rule, outcome, draft, search, checker, attempts, counterexamples)
            if outcome is not None and outcome.status == "sound":
                bases.append(draft)
                based.add(family.name)
                sound += 1
                last = last or outcome.trial
                break
            if attempts - start >= per_family or attempts >= trials:
                break
    if not bases:
        reason = _why(outcomes, attempts, built, search.refusal, opset)
        return RuleCheck(rule.name, str(rule.loc), "unchecked", reason, None, attempts)
    pools = [search.variants(b, SOUND_TARGET) for b in bases]
    while pools and sound < SOUND_TARGET and attempts < trials:
        for pool in list(pools):
            draft = next(pool, None)
            if draft is None:
                pools.remove(pool)
                continue
            outcome = run(draft)
            if outcome is not None and outcome.status == "unsound":
                return _unsound(rule, outcome, draft, search, checker, attempts, counterexamples)
            if outcome is not None and outcome.status == "sound":
                sound += 1
            if sound >= SOUND_TARGET or attempts >= trials:
                break
    return RuleCheck(rule.name, str(rule.loc), "sound", "", last, attempts, sound)


def _unknown_attributes(rule: Rule, opset: int) -> str:
    """A pattern's attribute that its standard op does not have at ``opset`` (``Split``'s
    ``split`` from opset 13), as ``"Split has no attribute 'split'"``; "" when none."""
    for p in pattern_nodes(rule):
        if p.op is None or p.domain:
            continue
        known = search_attr_names(p.op, p.domain, opset)
        for a in p.attrs:
            if known is not None and a.name not in known:
                return f"{p.op} has no attribute {a.name!r}"
    return ""


def _unsound(rule: Rule, outcome: _Outcome, draft: Draft, search: Instances, checker: _Checker, attempts: int,
             counterexamples: str | Path | None) -> RuleCheck:
    """The verdict on an unsound rule: its counterexample shrunk (:func:`_shrink`) and,
    when asked, written as an ONNX model."""
    outcome, draft = _shrink(outcome, draft, search, checker)
    trial = outcome.trial
    if len(outcome.feeds) > 1 and outcome.graph is not None:
        one = [outcome.feeds[min(outcome.worst_draw, len(outcome.feeds) - 1)]]
        again = checker.verdict_on(outcome.graph, one)
        if again.status == "unsound":
            again.graph, again.feeds, again.mode = outcome.graph, one, outcome.mode
            again.trial = replace(again.trial, instance=trial.instance, mode=outcome.mode)
            outcome, trial = again, again.trial
    if counterexamples is not None and outcome.graph is not None and outcome.feeds:
        from egraft.rewrite.soundness_export import write_counterexample

        try:
            path = write_counterexample(rule, outcome.graph, outcome.feeds[0], checker.opset, Path(counterexamples))
            trial = replace(trial, file=str(path))
        except Exception as err:
            trial = replace(trial, file=f"(not written: {str(err).splitlines()[0][:150]})")
    return RuleCheck(rule.name, str(rule.loc), "unsound", outcome.detail, trial, attempts)


def _shrink(outcome: _Outcome, draft: Draft, search: Instances, checker: _Checker) -> tuple[_Outcome, Draft]:
    """The smallest instance that still fails: the base instance of each smaller family
    (smallest first) with the failing variant's changes, checked in the failing value mode."""
    smaller = sorted((f for f in FAMILIES if _family_size(f) < draft.size()), key=_family_size)
    budget = SHRINK_CHECKS
    for family in smaller:
        for base in itertools.islice(search.drafts(family, "first"), 2):
            candidate = _same_changes(base, draft, search)
            if candidate is None or candidate.size() >= draft.size():
                continue
            budget -= 1
            found = next((o for o in checker.check(candidate, outcome.mode) if o.status in ("sound", "unsound")),
                         None)
            if found is not None and found.status == "unsound":
                return found, candidate
            if budget <= 0:
                return outcome, draft
    return outcome, draft


def _family_size(family: Family) -> int:
    return int(np.prod(family.shape(4)))


def _same_changes(base: Draft, failing: Draft, search: Instances) -> Draft | None:
    """``base`` with the attribute changes of the variant ``failing`` (None when they do not apply)."""
    if not failing.changes:
        return base
    slots = {s.label: s for s in search.slots(base)}
    changes = []
    for note in failing.changes:
        label, _, text = note.partition("=")
        slot = slots.get(label)
        if slot is None:
            return None
        value = next((v for v in slot.values if _text(v) == text), None)
        if value is None:
            return None
        changes.append((slot, value))
    return search.change(base, changes)


def _text(value) -> str:
    return str(value.tolist()) if isinstance(value, np.ndarray) else str(value)


def _why(outcomes: list[_Outcome], attempts: int, built: int, refusal: str, opset: int) -> str:
    """The reason a rule stayed unchecked, from the most telling outcome."""
    if not built:
        last = f" (last refusal: {refusal})" if refusal else ""
        return f"no instance of the pattern could be built at opset {opset}{last}"
    for status in ("build", "no match", "guard", "nonfinite"):
        found = [o for o in outcomes if o.status == status]
        if not found:
            continue
        if status == "guard":
            return f"no instance satisfied the guard in {attempts} attempts"
        if status == "build":
            return f"{found[-1].detail} ({len(found)} of {attempts} attempts)"
        return found[-1].detail
    return f"no instance could be run in {attempts} attempts"


# ---- examples ----------------------------------------------------------------------------
def _fixed(example: Example, hints: Hints) -> Fixed:
    """What ``example`` fixes of the instance (see :class:`egraft.rewrite.ast.Example`)."""
    types: dict[str, TensorType] = {}
    arrays: dict[str, np.ndarray] = {}
    attrs: dict = {}
    sets: dict[str, dict] = {}
    for name, value in example.values:
        if isinstance(value, ExampleTensor):
            types[name] = TensorType(DTYPE_NAMES[value.dtype], tuple(value.shape))
        elif isinstance(value, ExampleAttrs):
            sets[name] = dict(value.attrs)
        elif name in hints.attr_vars:
            attrs[name] = value
        else:
            array = np.asarray(value)
            kind = array.dtype.kind
            array = array.astype(np.float32 if kind == "f" else np.bool_ if kind == "b" else np.int64)
            arrays[name] = array
    return Fixed(types, arrays, attrs, sets)


def check_examples(rule: Rule, opset: int = 18, seed: int = 0, draws: int = 3) -> list[ExampleCheck]:
    """Check each ``example:`` of ``rule`` as an instance of its own: the example's tensors
    (inputs, or random constants where the guard asks ``const``), literals and attribute
    values; the attributes it does not give keep their defaults.

    Returns:
        One :class:`ExampleCheck` per example: ``sound``, ``unsound`` (with the trial), or
        ``failed`` with why (the instance cannot be built, the pattern does not match it,
        the guard refuses it, the replacement cannot be built).

    Example:
        >>> [c.status for c in check_examples(rule)]     # doctest: +SKIP
        ['sound', 'failed']
    """
    hints = rule_hints(rule)
    out = []
    for example in rule.examples:
        at = example.opset or opset
        rng = np.random.default_rng(seed)
        search = Instances(rule, at, hints, rng, _fixed(example, hints))
        checker = _Checker(rule, at, hints, rng, draws, search.rest_of)
        loc = str(example.loc)
        result = ExampleCheck(loc, "failed", "the example's instance could not be built"
                              + (f" ({search.refusal})" if search.refusal else ""))
        for draft in itertools.islice(search.drafts(FAMILIES[0]), 3):
            draft = replace(draft, family="example")
            outcomes = list(checker.check(draft, "signed"))
            if not outcomes:
                result = ExampleCheck(loc, "failed", "the example's instance does not run")
                continue
            last = outcomes[-1]
            if last.status in ("sound", "unsound"):
                result = ExampleCheck(loc, last.status, last.detail, last.trial)
                break
            result = ExampleCheck(loc, "failed", _example_failure(last))
        if search.refusal and result.reason.startswith("the example's instance could not be built"):
            result = replace(result, reason=f"the example's instance could not be built: {search.refusal}")
        out.append(result)
    return out


def _example_failure(outcome: _Outcome) -> str:
    if outcome.status == "no match":
        return "the pattern does not match the example"
    if outcome.status == "guard":
        return "the guard refuses the example" + (f": {outcome.detail}" if "failed" in outcome.detail else "")
    return outcome.detail


def check_rules(files: Sequence[str | Path] = (), opset: int = 18, trials: int = 40, seed: int = 0,
                counterexamples: str | Path | None = None) -> list[RuleCheck]:
    """Load rule files (the shipped library when ``files`` is empty) and check each rule.

    Example:
        >>> [c.status for c in check_rules(["mine.rules"])]      # doctest: +SKIP
        ['sound', 'unsound']
    """
    from egraft.rewrite.load import load_rules

    loaded = load_rules(list(files), include_shipped=not files)
    return [check_rule(rule, opset, trials, seed, counterexamples=counterexamples) for f in loaded for rule in f.rules]

"""Equality saturation under budgets, with a back-off scheduler and per-rule statistics.

Each iteration takes a snapshot of the e-graph, matches every active rule against it,
checks guards, builds replacements and unions them with what they replace. A rule that
matches more than its threshold in one iteration is banned for a few iterations and its
threshold doubles (egg's BackoffScheduler), so a few exploding rules (associativity,
commutativity) cannot starve the rest. Saturation stops when nothing changes, or at the
iteration, e-node or time budget; the report says which.

No round reads or rebuilds the whole e-graph:

- Snapshots come from the state's index (``egraft/rewrite/snapshot.py``), which computes egglog's
  congruence closure from the commands a round committed and updates only the e-classes they
  changed; egglog itself is sent the commands when something looks at it.
- Matching is semi-naive (``egraft/rewrite/match.py``, :class:`~egraft.rewrite.match.Delta`): a
  rule that matched completely against snapshot ``j`` next finds only the matches that use an
  e-node new since (a new term, or one whose inputs a merge renamed) or bind a variable to an
  e-class whose properties the rule's guard reads changed (a new constant for ``const``, new ops
  for ``made_by``, a merge for ``original``): every other match was a match then, with the same
  guard and the same replacement. Its roots are the e-classes from which the pattern can reach
  what is new, and the search passes over the parts that cannot be.
- Replacements run compiled, and what inference and folding compute is kept for the run
  (:class:`~egraft.rewrite.evaluate.Memo`).

All of it leaves the e-graph as it was: the same applications in the same order, so the same
handles and plans (all 41 bundled and corpus models; tests compare semi-naive with full
matching, compiled with interpreted replacements, and the index with egglog). DenseNet-121
optimized in 2.6-3.3 s on a 2-core host with them (9.6 s before; its 23 rounds had read and
re-matched the whole e-graph, up to 25,000 candidate roots and 5,500 matches a round, most of
them found before), Inception-v2 in 1.6-2.1 s (3.9 s). Since elementwise bodies start only at
the first op of a chain (``fusion_elementwise.rules``), DenseNet-121's e-graph holds 6,700
e-nodes instead of 10,200 and it optimizes in 2.2-3.3 s (3.3-4.6 s before, in the same minutes
of a host whose speed drifts), Inception-v2 in 1.2-1.5 s.

Example:
    >>> state = EGraphState.from_graph(graph)                        # doctest: +SKIP
    >>> report = saturate(state, rules, Budget(iterations=20))        # doctest: +SKIP
    >>> report.stop_reason                                            # doctest: +SKIP
    'saturated'
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial

from egraft import trace
from egraft.ir.infer import FreshDims
from egraft.rewrite.ast import Rule
from egraft.rewrite.egraph import EGraphState
from egraft.rewrite.evaluate import Evaluator, Memo, ReplacementFailed
from egraft.rewrite.match import (
    MATCHED,
    Delta,
    EClassId,
    Matcher,
    fixed_order_nodes,
    fresh_nodes,
    reads_classes,
    required_constants,
)
from egraft.rewrite.snapshot import Change

#: The clock that :attr:`Budget.seconds` is kept in: this thread's CPU time, not the wall's, so
#: that a busy machine (a test suite beside the compile, another compile) slows saturation down
#: without changing where it stops, and so which program is extracted. With a 4 s wall-clock
#: budget and both cores busy, DenseNet-121 stopped at round 8 of 27, and its plan kept 120
#: layout conversions instead of 62. (egglog runs in the calling thread.)
BUDGET_CLOCK = time.thread_time


class _Deadline:
    """Whether :data:`BUDGET_CLOCK` has passed ``at``, read only when the wall clock says it may
    have: a thread's CPU time cannot run ahead of the wall clock, and reading it is a system call
    (checked before each rule, it was 5% of DenseNet-121's saturation on a loaded host)."""

    def __init__(self, at: float):
        self.at = at
        self._cpu, self._wall = BUDGET_CLOCK(), time.perf_counter()

    def passed(self) -> bool:
        wall = time.perf_counter()
        if self._cpu + (wall - self._wall) <= self.at:
            return False
        self._cpu, self._wall = BUDGET_CLOCK(), wall
        return self._cpu > self.at


@dataclass(frozen=True)
class Budget:
    """Limits of one saturation run.

    Attributes:
        iterations: at most this many match-and-apply rounds.
        max_nodes: stop once the e-graph holds more e-nodes than this.
        seconds: stop once this much time has passed: CPU seconds of the saturating thread
            (:data:`BUDGET_CLOCK`), so that the same model stops at the same round on a busy machine.
        match_limit: a rule with more matches than this in one round is banned (back-off).
        ban_length: iterations a banned rule sits out (doubling each time it is banned).
    """

    iterations: int = 30
    max_nodes: int = 100_000
    #: 10 s, a guard more than a goal: every bundled and corpus model saturates well within it
    #: (densenet121 in 1.7-2.7 s of CPU on a 2-core host, 22 rounds: its Concat chains; the rest
    #: in under 1.5 s); a model that stops here extracts from what it has (any subset is sound)
    seconds: float = 10.0
    match_limit: int = 5000
    ban_length: int = 2


@dataclass
class RuleStats:
    """What one rule did: matches found, applied, refused by its guard or by the
    replacement (type mismatch, inference error), times banned, seconds spent."""

    matches: int = 0
    applied: int = 0
    guard_refused: int = 0
    build_failed: int = 0
    banned: int = 0
    seconds: float = 0.0
    last_failure: str = ""

    def add(self, other: RuleStats) -> None:
        """Count ``other``'s run in too (its last failure, if any, is the later one)."""
        for key in ("matches", "applied", "guard_refused", "build_failed", "banned", "seconds"):
            setattr(self, key, getattr(self, key) + getattr(other, key))
        self.last_failure = other.last_failure or self.last_failure


@dataclass
class SaturationReport:
    """The outcome of :func:`saturate`."""

    iterations: int
    stop_reason: str
    nodes_before: int
    nodes_after: int
    classes_after: int
    seconds: float
    rules: dict[str, RuleStats] = field(default_factory=dict)

    def top_rules(self, n: int = 10) -> list[tuple[str, RuleStats]]:
        """The rules that applied most, then by name."""
        active = [(k, v) for k, v in self.rules.items() if v.applied]
        return sorted(active, key=lambda kv: (-kv[1].applied, kv[0]))[:n]


def _match_key(rule: Rule, subst: dict) -> tuple:
    """What identifies a match across rounds: the rule and its bindings, e-classes by name
    (an e-class keeps its name, its smallest handle, until it merges into another)."""
    items = []
    for k in sorted(subst):
        if k == MATCHED:
            continue  # e-nodes of this snapshot: the bindings identify the match
        v = subst[k]
        if type(v) is EClassId:
            v = ("c", int(v))
        elif isinstance(v, list):
            v = tuple(("c", int(c)) if type(c) is EClassId else c for c in v)
        elif isinstance(v, dict):
            v = repr(sorted(v.items(), key=lambda kv: kv[0]))
        else:
            v = repr(v)
        items.append((k, v))
    return (rule.name, tuple(items))


def saturate(state: EGraphState, rules: list[Rule], budget: Budget | None = None,
             progress: Callable[[int, int], None] | None = None, incremental: bool = True) -> SaturationReport:
    """Run ``rules`` on ``state`` until saturation or a budget; return the report. With
    ``incremental`` off, every rule matches the whole e-graph every round (the reference that
    incremental matching must agree with)."""
    budget = budget or Budget()
    start, clock_start = time.perf_counter(), BUDGET_CLOCK()
    opset = state.opsets.get("", 21)
    fresh = FreshDims("_e")
    stats = {r.name: RuleStats() for r in rules}
    threshold = {r.name: budget.match_limit for r in rules}
    banned_until = {r.name: 0 for r in rules}
    ban_count = {r.name: 0 for r in rules}
    applied: set[tuple] = set()
    snapshot = state.snapshot()
    constants = {r.name: required_constants(r) for r in rules}  # what matching may skip early
    fixed_order = fixed_order_nodes(rules)  # commutative nodes whose other order a rule spells
    pattern_nodes: dict = {}  # what matching works out per pattern node, for every round
    memo = Memo()  # what replacement building found (inference, folds), for every round
    # Semi-naive matching (module docstring): a rule matched completely against snapshot j next
    # finds only the matches that use what is new since (Delta, from the snapshots after j).
    matched_at: dict[str, int] = {}  # rule -> the snapshot it last matched completely
    news: list[tuple[dict, Change]] = [({}, snapshot.change)]  # per snapshot: its fresh e-nodes and changes
    reads = {r.name: reads_classes(r) for r in rules}  # what a rule's guard reads of a bound e-class
    nodes_before = snapshot.num_nodes
    stop = "iteration limit"
    iteration = 0
    tracing = trace.enabled("rules")
    deadline, out_of_time = _Deadline(clock_start + budget.seconds), False
    for iteration in range(1, budget.iterations + 1):
        changed = False
        any_banned = False
        matcher = Matcher(snapshot, opset, fixed_order, pattern_nodes)
        evaluator = Evaluator(state, snapshot, opset, fresh, memo)
        deltas: dict[tuple, Delta] = {}  # (snapshot a rule last matched, what it reads) -> what changed since
        current = len(news) - 1
        for rule in rules:
            if deadline.passed():
                out_of_time = True  # the rest of the round waits: any subset of the rewrites is sound
                break
            name = rule.name
            if banned_until[name] > iteration:
                any_banned = True
                continue
            t0 = time.perf_counter()
            delta = None
            if name in matched_at:
                key = (matched_at[name], reads[name])
                if key not in deltas:
                    deltas[key] = Delta.since(news[key[0] + 1:current + 1], key[1])
                delta = deltas[key]
            # the guard filters matches as they are found, so only accepted ones count towards the
            # ban threshold. A refused match is found again when something its guard reads of it
            # changes (Delta): a new e-node in it, a bound e-class's new constant, ops or handles.
            accept = None if rule.guard is None else partial(evaluator.guard, rule)
            substs = matcher.match_rule(rule, limit=threshold[name] + 1, delta=delta, constants=constants[name],
                                        accept=accept)
            stats[name].guard_refused += matcher.refused
            stats[name].matches += matcher.refused
            if len(substs) > threshold[name]:
                ban_count[name] += 1
                banned_until[name] = iteration + budget.ban_length * 2 ** (ban_count[name] - 1)
                threshold[name] *= 2
                stats[name].banned += 1
                any_banned = True
                stats[name].seconds += time.perf_counter() - t0
                continue
            stats[name].matches += len(substs)
            if incremental:
                matched_at[name] = current
            for subst in substs:
                key = _match_key(rule, subst)
                if key in applied:
                    continue
                mark = len(state.pending)
                log_mark = len(state.term_log)
                state.begin_application(name, iteration, subst.get(MATCHED, ()))
                try:
                    pairs = evaluator.build(rule, subst)
                except ReplacementFailed as err:
                    applied.add(key)  # building fails the same way next time
                    del state.pending[mark:]
                    state.cancel_application(log_mark)
                    stats[name].build_failed += 1
                    stats[name].last_failure = str(err)
                    continue
                applied.add(key)
                state.end_application()
                for root_ref, new_ref in pairs:
                    state.union_refs(root_ref, new_ref)
                stats[name].applied += 1
                if tracing:
                    classes = ", ".join(str(root) for root, _ in pairs)
                    trace.emit("rules", f"{name}: round {iteration}, e-class {classes}")
                changed = True
            stats[name].seconds += time.perf_counter() - t0
        state.flush()
        snapshot = state.snapshot()
        if incremental:
            news.append((fresh_nodes(snapshot), snapshot.change))
        if progress is not None:
            progress(iteration, snapshot.num_nodes)
        if snapshot.num_nodes > budget.max_nodes:
            stop = "node limit"
            break
        if out_of_time or deadline.passed():
            stop = "time limit"
            break
        if not changed and not any_banned:
            stop = "saturated"
            break
        if not changed:  # only banned rules are left to run: they run next round (egg's back-off does the same)
            for name in banned_until:
                banned_until[name] = min(banned_until[name], iteration + 1)
    return SaturationReport(iteration, stop, nodes_before, snapshot.num_nodes, len(snapshot.classes),
                            time.perf_counter() - start, stats)

"""The optimization pipeline: IR graph -> e-graph -> saturation under the chosen rule
sets -> extraction under a cost model -> IR graph, with timings and statistics for every
stage. :func:`egraft.extract.plan.build_plan` turns the result into a plan document.

Example:
    >>> result = optimize(egraft.load("resnet50.onnx"), cost="roofline", extractor="ilp")   # doctest: +SKIP
    >>> result.graph.op_histogram()["com.egraft::FusedConv"]                              # doctest: +SKIP
"""

from __future__ import annotations

import gc
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from egraft.errors import EgraftError
from egraft.extract.cost import CostModel, cost_model
from egraft.extract.extractor import extract
from egraft.extract.program import Extraction, rebuild
from egraft.ir.graph import Graph
from egraft.ir.specialize import specialize
from egraft.rewrite.ast import ECall, Rule, RuleFile
from egraft.rewrite.egraph import EGraphState, Snapshot
from egraft.rewrite.engine import Budget, RuleStats, SaturationReport, saturate


@dataclass
class OptimizeResult:
    """What :func:`optimize` returns: the optimized graph and how it was obtained."""

    graph: Graph
    source: Graph
    saturation: SaturationReport
    rulesets: list[str]
    seconds: dict[str, float] = field(default_factory=dict)
    extraction: Extraction | None = None
    cost_model: CostModel | None = None
    snapshot: Snapshot | None = None
    node_classes: list[int] = field(default_factory=list)
    rule_files: list[RuleFile] = field(default_factory=list)
    rules_off: list[str] = field(default_factory=list)
    bindings: dict[str, int] = field(default_factory=dict)
    budget: Budget | None = None
    time_limit: float = 30.0

    def histogram_rows(self) -> list[tuple[str, int, int]]:
        """(op, count before, count after) for every op of either graph, by op name."""
        before, after = self.source.op_histogram(), self.graph.op_histogram()
        return [(op, before.get(op, 0), after.get(op, 0)) for op in sorted(set(before) | set(after))]


def select_rules(files: Sequence[RuleFile], rules_off: Sequence[str] = ()) -> tuple[list[Rule], list[str]]:
    """The rules of ``files`` whose rule set is not switched off; the rule sets kept."""
    known = sorted({f.ruleset for f in files})
    for name in rules_off:
        if name not in known:
            raise EgraftError(f"--rules-off {name}: no such rule set; the loaded sets are {known}")
    rules = [r for f in files if f.ruleset not in rules_off for r in f.rules]
    return rules, [s for s in known if s not in rules_off]


@contextmanager
def cycle_collector_paused() -> Iterator[None]:
    """Pause Python's cycle collector for the optimize stage, then restore it.

    Saturation allocates millions of objects that outlive a round (snapshots, match keys,
    the term log), and the collector's full passes re-traverse all of them as they pile up:
    7.4 s of t5_encoder_int8's first 11 rounds (23 s), 0.4 s of ResNet-50's 2.9 s. They find
    nothing: the stage makes no reference cycles (no self-calling closures in matching,
    attribute keys or Elementwise bodies; tests/test_optimize.py checks), so reference
    counting frees everything, and memory is the same. Cycles that other threads make
    meanwhile are collected once the stage ends.
    """
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def _folds(rule: Rule) -> bool:
    """A rule whose every replacement is ``fold(...)``: it evaluates a constant subexpression."""
    return all(isinstance(r, ECall) and r.func == "fold" for r in rule.results)


def _saturate_after_folding(state: EGraphState, rules: list[Rule], budget: Budget | None,
                            progress: Callable[[int, int], None] | None) -> SaturationReport:
    """Saturation, after the folding rules (:func:`_folds`) alone have run until nothing more
    folds: in the full rounds a chain of constant ops folds one op per round, and a large
    graph may reach its deadline first (T5's relative-position bias, 15 ops on [seq, seq]
    once seq is bound, folded 4 deep when saturation stopped). The report counts both runs."""
    folding = [r for r in rules if _folds(r)]
    if not folding:
        return saturate(state, rules, budget, progress)
    first = saturate(state, folding, Budget(iterations=100, seconds=2.0))
    report = saturate(state, rules, budget, progress)
    for name, stats in first.rules.items():
        report.rules.setdefault(name, RuleStats()).add(stats)
    report.seconds += first.seconds
    report.nodes_before = first.nodes_before
    return report


def optimize(graph: Graph, rule_paths: Sequence[str | Path] = (), rules_off: Sequence[str] = (),
             bindings: Mapping[str, int] | None = None, budget: Budget | None = None,
             include_shipped: bool = True,
             progress: Callable[[int, int], None] | None = None,
             cost: str | CostModel = "nodes", extractor: str = "greedy", time_limit: float = 30.0,
             target: str = "cpu", profile: str | None = None) -> OptimizeResult:
    """Optimize ``graph`` with the shipped rules (and any ``rule_paths``).

    Args:
        graph: the IR graph to optimize.
        rule_paths: extra ``.rules`` files.
        rules_off: rule sets to switch off (e.g. ``["layout"]``).
        bindings: symbolic dims to bind first (``{"batch": 1}``).
        budget: saturation limits.
        include_shipped: load ``egraft/rules/*.rules`` too.
        progress: called with (iteration, e-nodes) after each saturation round.
        cost: the cost model, by name (``nodes``, ``flops``, ``roofline``) or as an object.
        extractor: ``greedy`` or ``ilp``.
        time_limit: seconds the ``ilp`` extractor may take.
        target: ``cpu`` or ``cuda``: the roofline profile used when ``profile`` is not given.
        profile: a roofline profile name or TOML path.
    """
    from egraft.rewrite.load import load_rules

    seconds: dict[str, float] = {}
    model = cost if isinstance(cost, CostModel) else cost_model(cost, profile, target, bindings)
    t = time.perf_counter()
    files = load_rules(list(rule_paths), include_shipped=include_shipped)
    rules, rulesets = select_rules(files, rules_off)
    seconds["rules"] = time.perf_counter() - t
    source = graph
    if bindings:
        t = time.perf_counter()
        graph = specialize(graph, bindings)
        seconds["specialize"] = time.perf_counter() - t
    with cycle_collector_paused():
        t = time.perf_counter()
        state = EGraphState.from_graph(graph)
        seconds["load"] = time.perf_counter() - t
        t = time.perf_counter()
        report = _saturate_after_folding(state, rules, budget, progress)
        seconds["saturate"] = time.perf_counter() - t
        t = time.perf_counter()
        snapshot = state.snapshot()
        extraction = extract(snapshot, model, extractor, time_limit=time_limit)
        optimized, node_classes = rebuild(snapshot, extraction.choice)
        seconds["extract"] = time.perf_counter() - t
        state.release()  # freed here, not by the cycle collector on another thread
    return OptimizeResult(optimized, source, report, rulesets, seconds, extraction, model, snapshot, node_classes,
                          files, list(rules_off), dict(bindings or {}), budget or Budget(), time_limit)

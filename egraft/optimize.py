"""The optimization pipeline: IR graph -> e-graph -> saturation under the chosen rule
sets -> greedy extraction -> IR graph, with timings and statistics for every stage.

Example:
    >>> result = optimize(egraft.load("resnet50.onnx"))          # doctest: +SKIP
    >>> result.graph.op_histogram()["Conv"]                      # doctest: +SKIP
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from egraft.errors import EgraftError
from egraft.extract.greedy import extract_graph
from egraft.ir.graph import Graph
from egraft.ir.specialize import specialize
from egraft.rewrite.ast import Rule, RuleFile
from egraft.rewrite.egraph import EGraphState
from egraft.rewrite.engine import Budget, SaturationReport, saturate


@dataclass
class OptimizeResult:
    """What :func:`optimize` returns: the optimized graph and how it was obtained."""

    graph: Graph
    source: Graph
    saturation: SaturationReport
    rulesets: list[str]
    seconds: dict[str, float] = field(default_factory=dict)

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


def optimize(graph: Graph, rule_paths: Sequence[str | Path] = (), rules_off: Sequence[str] = (),
             bindings: Mapping[str, int] | None = None, budget: Budget | None = None,
             include_shipped: bool = True,
             progress: Callable[[int, int], None] | None = None) -> OptimizeResult:
    """Optimize ``graph`` with the shipped rules (and any ``rule_paths``).

    Args:
        graph: the IR graph to optimize.
        rule_paths: extra ``.rules`` files.
        rules_off: rule sets to switch off (e.g. ``["layout"]``).
        bindings: symbolic dims to bind first (``{"batch": 1}``).
        budget: saturation limits.
        include_shipped: load ``egraft/rules/*.rules`` too.
        progress: called with (iteration, e-nodes) after each saturation round.
    """
    from egraft.rewrite.load import load_rules

    seconds: dict[str, float] = {}
    t = time.perf_counter()
    files = load_rules(list(rule_paths), include_shipped=include_shipped)
    rules, rulesets = select_rules(files, rules_off)
    seconds["rules"] = time.perf_counter() - t
    source = graph
    if bindings:
        t = time.perf_counter()
        graph = specialize(graph, bindings)
        seconds["specialize"] = time.perf_counter() - t
    t = time.perf_counter()
    state = EGraphState.from_graph(graph)
    seconds["load"] = time.perf_counter() - t
    t = time.perf_counter()
    report = saturate(state, rules, budget, progress)
    seconds["saturate"] = time.perf_counter() - t
    t = time.perf_counter()
    optimized = extract_graph(state.snapshot())
    seconds["extract"] = time.perf_counter() - t
    return OptimizeResult(optimized, source, report, rulesets, seconds)

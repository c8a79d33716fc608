"""One instance through the rewrite engine, for the soundness checker
(:mod:`egraft.rewrite.soundness`): the rule is matched, guarded and built on the instance's
e-graph exactly as :func:`egraft.rewrite.engine.saturate` does (the same :class:`Matcher`
and :class:`Evaluator`) but without the union; the matched root(s) and the built
replacement(s) come back as two programs.

Example:
    >>> applied = apply_rule(rule, graph, 18)          # doctest: +SKIP
    >>> applied.before.run(feed), applied.after.run(feed)  # doctest: +SKIP
"""

from __future__ import annotations

from dataclasses import dataclass

from egraft.extract.cost import NodeCount
from egraft.extract.greedy import extract_refs
from egraft.ir.graph import Graph
from egraft.ir.infer import FreshDims
from egraft.rewrite.ast import Rule
from egraft.rewrite.egraph import EGraphState
from egraft.rewrite.evaluate import Evaluator
from egraft.rewrite.match import ROOT, Matcher

__all__ = ["Applied", "Refused", "apply_rule"]


@dataclass(frozen=True)
class Applied:
    """The rule applied: ``before`` computes the matched roots (outputs ``before0``...),
    ``after`` their replacements (``after0``...); ``both`` (when asked for) is one program
    with outputs ``before`` and ``after`` (``before1``, ``after1``... for more roots)."""

    before: Graph
    after: Graph
    both: Graph | None = None


@dataclass(frozen=True)
class Refused:
    """Why the rule did not apply: ``status`` ``no match``, ``guard`` or ``build``."""

    status: str
    detail: str


def apply_rule(rule: Rule, graph: Graph, opset: int, both: bool = False) -> Applied | Refused:
    """Match and build ``rule`` on ``graph`` as the engine does (no union), the instance's
    own roots first (other matches inside the instance count too), and extract the programs.

    Example: ``apply_rule(rule, graph, 18).status == "guard"`` when the guard refuses every match.
    """
    state = EGraphState.from_graph(graph)
    try:
        return _apply(state, rule, graph, opset, both)
    finally:
        state.release()  # freed on this thread, not by the cycle collector on another


def _apply(state: EGraphState, rule: Rule, graph: Graph, opset: int, both: bool) -> Applied | Refused:
    snapshot = state.snapshot()
    roots = [snapshot.ref_class[r] for r in state.output_refs]
    substs = Matcher(snapshot, opset).match_rule(rule, limit=64)
    substs.sort(key=lambda s: [s[ROOT.format(i)] for i in range(len(rule.roots))] != roots)
    if not substs:
        return Refused("no match", "the pattern did not match its own instance")
    evaluator = Evaluator(state, snapshot, opset, FreshDims("_e"))
    failure = Refused("guard", "the guard refused the instance")
    for subst in substs:
        try:
            if not evaluator.guard(rule, subst):
                continue
        except Exception as err:
            failure = Refused("guard", f"the guard failed: {type(err).__name__}: {err}")
            continue
        mark = len(state.pending)
        try:
            pairs = evaluator.build(rule, subst)
        except Exception as err:  # ReplacementFailed, or an error inside a builtin
            del state.pending[mark:]
            failure = Refused("build", f"the replacement could not be built: {err}")
            continue
        return _extract(state, graph, pairs, both)
    return failure


def _extract(state: EGraphState, graph: Graph, pairs: list[tuple[int, int]], both: bool) -> Applied:
    state.flush()
    snapshot = state.snapshot()
    n = len(pairs)
    as_built = NodeCount()
    as_built.picks_unfolded = True  # the replacement as the rule built it (WinogradWeights before its fold)
    before = extract_refs(snapshot, [r for r, _ in pairs], [f"before{i}" for i in range(n)], cost=as_built)
    after = extract_refs(snapshot, [r for _, r in pairs], [f"after{i}" for i in range(n)], cost=as_built)
    combined = None
    if both:
        names = [f"{side}{i if i else ''}" for i in range(n) for side in ("before", "after")]
        combined = extract_refs(snapshot, [r for pair in pairs for r in pair], names, cost=as_built,
                                name="counterexample")
    for g in (before, after, combined):
        if g is not None:
            g.opsets = dict(graph.opsets)
    return Applied(before, after, combined)

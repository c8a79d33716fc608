"""Choosing an extractor by name: ``greedy`` (fast, the default for large graphs) or
``ilp`` (exact within a time limit, never worse than greedy).

Example:
    >>> ex = extract(state.snapshot(), cost_model("nodes"), "ilp", time_limit=10)   # doctest: +SKIP
    >>> ex.cost <= extract(state.snapshot(), cost_model("nodes"), "greedy").cost    # doctest: +SKIP
    True
"""

from __future__ import annotations

from egraft import trace
from egraft.errors import EgraftError
from egraft.extract.cost import CostModel
from egraft.extract.greedy import extract_greedy
from egraft.extract.program import EXTRACTORS, Extraction, rebuild_outputs
from egraft.rewrite.egraph import Snapshot


def extract(snapshot: Snapshot, model: CostModel, extractor: str = "greedy", roots: list[int] | None = None,
            time_limit: float = 30.0) -> Extraction:
    """The cheapest program for ``roots`` (default: the source graph's outputs) under ``model``."""
    if extractor not in EXTRACTORS:
        raise EgraftError(f"--extractor {extractor}: unknown extractor; known: {', '.join(EXTRACTORS)}")
    roots = [c for c, _, _ in rebuild_outputs(snapshot)] if roots is None else roots
    greedy = extract_greedy(snapshot, model, roots)
    if extractor == "greedy":
        chosen = greedy
    else:
        from egraft.extract.ilp import extract_ilp  # scipy's HiGHS: imported only for the ILP (0.13 s)

        chosen = extract_ilp(snapshot, model, roots, time_limit=time_limit, greedy=greedy)
    if trace.enabled("extract"):
        trace.trace_extraction(snapshot, chosen, roots)
    return chosen

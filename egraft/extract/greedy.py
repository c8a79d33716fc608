"""Greedy DAG-aware extraction: the cheapest e-node per e-class by a bottom-up fixpoint.

The cost of an e-node is its own cost plus the costs of the distinct e-classes its
children's choices reach (a shared sub-expression counts once, as it runs once); leaves
(inputs, constants) and output projections cost nothing. Each e-class keeps the e-node
whose reached set is cheapest, repriced whenever a child improves. Greedy is fast and
usually good, but not optimal: two e-classes that would share a sub-expression are each
priced alone (the exact extractor, :mod:`egraft.extract.ilp`, sees the sharing).

Ties break on the number of inputs (fewer first), then standard ops before egraft ones,
then op name, attributes and children, so the same e-graph always gives the same program.

Example:
    >>> chosen = choose(state.snapshot(), NodeCount())          # doctest: +SKIP
"""

from __future__ import annotations

import heapq
import math
from collections import defaultdict

from egraft.extract.cost import FREE_OPS, CostModel, NodeCount, as_cost_model
from egraft.extract.program import CostTable, Extraction, dag_cost, rebuild_graph, rebuild_outputs
from egraft.ir.graph import Graph
from egraft.rewrite.egraph import ENode, Snapshot

__all__ = ["FREE_OPS", "node_count_cost", "choose", "greedy_choice", "extract_graph", "extract_refs"]


def node_count_cost(node: ENode) -> int:
    """The ``nodes`` cost of one e-node: every op costs 1; inputs, constants and projections 0."""
    return 0 if node.op in FREE_OPS else 1


def greedy_choice(snapshot: Snapshot, table: CostTable, max_passes: int = 50) -> tuple[dict[int, int], dict]:
    """The greedy choice, as class -> index of the chosen e-node in ``snapshot.classes[c]``,
    and per e-class and e-node index the DAG cost greedy saw (``(c, i) -> cost``).

    A worklist, cheapest first: an e-node is priced once all its children have a choice, and
    again whenever one of them improves (a class's best only ever improves, so an e-node
    priced since its children's last improvements would lose again). Sweeping the classes in
    order instead took one pass per level of a rewritten region whose new e-classes come
    after their parents, and DenseNet-121 stopped at the 50-pass limit unconverged (1.4 s).
    ``max_passes`` bounds the pricings at that many per e-node."""
    classes = snapshot.classes
    best: dict[int, tuple[tuple, int, dict[int, float]]] = {}
    seen: dict[tuple[int, int], float] = {}
    parents: dict[int, list[tuple[int, int]]] = defaultdict(list)
    heap: list[tuple[float, int, int]] = []
    nodes = 0
    for c in sorted(classes):
        for i, n in enumerate(classes[c]):
            nodes += 1
            if table[c][i] == math.inf:
                continue  # an e-node extraction must not pick
            if n.children:
                for ch in set(n.children):
                    parents[ch].append((c, i))
            else:
                heap.append((table[c][i], c, i))
    heapq.heapify(heap)
    tick = 0
    improved_at: dict[int, int] = {}  # e-class -> tick of its latest improvement
    priced_at: dict[tuple[int, int], int] = {}  # (e-class, e-node index) -> tick when last priced
    budget = max_passes * nodes
    while heap and budget > 0:
        _, c, i = heapq.heappop(heap)
        n = classes[c][i]
        last = priced_at.get((c, i))
        if last is not None and all(improved_at[ch] <= last for ch in n.children):
            continue
        if any(ch not in best for ch in n.children):
            continue  # priced again once the last child has a choice
        budget -= 1
        priced_at[(c, i)] = tick
        reached: dict[int, float] = {}
        for ch in n.children:
            reached.update(best[ch][2])
        if c in reached:
            continue  # the choice would reach its own class: a cycle
        reached[c] = table[c][i]
        total = sum(reached.values())
        seen[(c, i)] = total
        key = (total, len(n.children), n.domain != "", n.op, n.attrs, n.children)
        if c not in best or key < best[c][0]:
            best[c] = (key, i, reached)
            tick += 1
            improved_at[c] = tick
            for parent in parents.get(c, ()):
                heapq.heappush(heap, (total, *parent))
    return {c: v[1] for c, v in best.items()}, seen


def extract_greedy(snapshot: Snapshot, model: CostModel, roots: list[int]) -> Extraction:
    """Greedy extraction of the programs of ``roots`` under ``model``."""
    import time

    start = time.perf_counter()
    table = model.table(snapshot)
    choice, seen = greedy_choice(snapshot, table)
    missing = [r for r in roots if r not in choice]
    if missing:
        raise ValueError(f"e-classes {missing} have no acyclic program")
    total = dag_cost(snapshot, choice, roots, table)
    return Extraction(choice, total, "greedy", "heuristic", None, time.perf_counter() - start, table, seen)


def choose(snapshot: Snapshot, cost=node_count_cost, max_passes: int = 50) -> dict[int, ENode]:
    """The greedy choice as class -> e-node, under a cost model or an ``ENode -> cost`` function."""
    model = as_cost_model(cost)
    choice, _ = greedy_choice(snapshot, model.table(snapshot), max_passes)
    return {c: snapshot.classes[c][i] for c, i in choice.items()}


def extract_graph(snapshot: Snapshot, cost=None, name: str | None = None) -> Graph:
    """Rebuild the greedy-cheapest program for the source graph's outputs as an IR graph."""
    model = NodeCount() if cost is None else as_cost_model(cost)
    roots = [c for c, _, _ in rebuild_outputs(snapshot)]
    return rebuild_graph(snapshot, extract_greedy(snapshot, model, roots).choice, name=name)


def extract_refs(snapshot: Snapshot, refs: list[int], names: list[str], cost=None,
                 name: str | None = None) -> Graph:
    """Rebuild the cheapest program for the e-classes of the handles ``refs``, whose
    outputs are named ``names``; the graph takes every input of the source graph.

    Example:
        >>> g = extract_refs(state.snapshot(), [root_ref, new_ref], ["before", "after"])  # doctest: +SKIP
        >>> g.run(feeds)["after"]                                                         # doctest: +SKIP
    """
    model = NodeCount() if cost is None else as_cost_model(cost)
    outputs = [(snapshot.ref_class[r], n, snapshot.state.ref_types[r]) for r, n in zip(refs, names, strict=True)]
    choice = extract_greedy(snapshot, model, [c for c, _, _ in outputs]).choice
    return rebuild_graph(snapshot, choice, outputs, name)

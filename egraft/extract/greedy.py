"""Greedy DAG-aware extraction: the cheapest e-node per e-class by a bottom-up fixpoint,
then the chosen program rebuilt as an IR graph in which a shared e-class is computed once.

The cost of an e-node is ``cost(op)`` plus the costs of the distinct e-classes its
children's choices reach (a shared sub-expression counts once, as it runs once); leaves
(inputs, constants) and output projections cost nothing. Ties break on op name, attributes and
children, so the same e-graph always gives the same program (among equal costs, the
e-node with fewer inputs, then a standard op, is preferred).
"""

from __future__ import annotations

from collections.abc import Callable

from egraft.ir.graph import Graph, Node, Value
from egraft.ir.types import TensorType
from egraft.rewrite.egraph import ABSENT, CONST, INPUT, OUT, ENode, Snapshot

FREE_OPS = (CONST, INPUT, OUT, ABSENT)


def node_count_cost(node: ENode) -> int:
    """The ``nodes`` cost model: every op costs 1; inputs, constants and projections 0.

    Integers on purpose: tree costs count a shared sub-expression once per use, so on
    DenseNet's concatenations they reach 1e16, where float64 can no longer tell totals
    that differ by a few nodes apart (Python ints stay exact).
    """
    return 0 if node.op in FREE_OPS else 1


def choose(snapshot: Snapshot, cost: Callable[[ENode], float] = node_count_cost,
           max_passes: int = 50) -> dict[int, ENode]:
    """The cheapest e-node of every e-class, DAG-aware: an e-node's cost is the sum over
    the set of distinct e-classes its choice reaches, so a shared sub-expression is paid
    once (greedy: each class keeps its best set; passes repeat until nothing improves)."""
    best: dict[int, tuple[tuple, ENode, dict[int, float]]] = {}
    for _ in range(max_passes):
        changed = False
        for c in sorted(snapshot.classes):
            for n in snapshot.classes[c]:
                if any(ch not in best for ch in n.children):
                    continue
                reached: dict[int, float] = {}
                for ch in n.children:
                    reached.update(best[ch][2])
                if c in reached:
                    continue  # the choice would reach its own class: a cycle
                reached[c] = cost(n)
                # Ties prefer fewer inputs, then standard ops, then by name: deterministic.
                key = (sum(reached.values()), len(n.children), n.domain != "", n.op, n.attrs, n.children)
                if c not in best or key < best[c][0]:
                    best[c] = (key, n, reached)
                    changed = True
        if not changed:
            break
    return {c: v[1] for c, v in best.items()}


def extract_graph(snapshot: Snapshot, cost: Callable[[ENode], float] = node_count_cost,
                  name: str | None = None) -> Graph:
    """Rebuild the cheapest program for the source graph's outputs as an IR graph."""
    state = snapshot.state
    outputs = [(snapshot.ref_class[state.output_refs[i]], v.name, v.type) for i, v in enumerate(state.source.outputs)]
    return _rebuild(snapshot, outputs, cost, name)


def extract_refs(snapshot: Snapshot, refs: list[int], names: list[str],
                 cost: Callable[[ENode], float] = node_count_cost, name: str | None = None) -> Graph:
    """Rebuild the cheapest program for the e-classes of the handles ``refs``, whose
    outputs are named ``names``; the graph takes every input of the source graph.

    Example:
        >>> g = extract_refs(state.snapshot(), [root_ref, new_ref], ["before", "after"])  # doctest: +SKIP
        >>> g.run(feeds)["after"]                                                         # doctest: +SKIP
    """
    outputs = [(snapshot.ref_class[r], n, snapshot.state.ref_types[r]) for r, n in zip(refs, names, strict=True)]
    return _rebuild(snapshot, outputs, cost, name)


def _rebuild(snapshot: Snapshot, outputs: list[tuple[int, str, TensorType]],
             cost: Callable[[ENode], float], name: str | None) -> Graph:
    """The cheapest program computing the e-classes of ``outputs`` (class, name, type)."""
    state = snapshot.state
    source = state.source
    chosen = choose(snapshot, cost)
    graph = Graph(name or source.name, [], [], [], constants=state.constants, opsets=dict(state.opsets))
    values: dict[int, Value | list] = {}
    counter = [0]
    output_names = {c: out_name for c, out_name, _ in outputs}
    for v in source.inputs:
        c = snapshot.ref_class[state.input_refs[v.name]]
        values[c] = v
        graph.inputs.append(v)

    def fresh_name(c: int) -> str:
        if c in output_names:
            return output_names[c]
        counter[0] += 1
        return f"v{counter[0]}"

    origins: dict[int, str] = {}
    for ref, names in sorted(state.ref_origin.items()):
        origins.setdefault(snapshot.ref_class.get(ref, -1), names[0])

    def origin(c: int) -> str:
        return origins.get(c, "")

    def build(c: int):
        if c in values:
            return values[c]
        stack = [(c, False)]
        while stack:
            cls, ready = stack.pop()
            if cls in values:
                continue
            n = chosen[cls]
            if not ready:
                stack.append((cls, True))
                for ch in reversed(n.children):
                    if ch not in values:
                        stack.append((ch, False))
                continue
            values[cls] = emit(cls, n)
        return values[c]

    def emit(c: int, n: ENode):
        t = snapshot.type_of(c)
        if n.op == CONST:
            return Value(fresh_name(c) if c in output_names else f"c{n.attrs[:8]}", t, const=n.attrs)
        if n.op == ABSENT:
            return None
        if n.op == OUT:
            tup = values[n.children[0]]
            return tup[snapshot.attrs(n)["index"]]
        inputs = tuple(values[ch] for ch in n.children)
        if isinstance(t, tuple):
            outs = [Value(fresh_name(-1), ti) if ti is not None else None for ti in t]
            graph.nodes.append(Node(n.op, inputs, tuple(outs), dict(snapshot.attrs(n)), origin(c), n.domain))
            return outs
        out = Value(fresh_name(c), t)
        graph.nodes.append(Node(n.op, inputs, (out,), dict(snapshot.attrs(n)), origin(c), n.domain))
        return out

    for c, out_name, out_type in outputs:
        out = build(c)
        if out.name != out_name:  # an output that is also an input or another output
            alias = Value(out_name, out_type)
            graph.nodes.append(Node("Identity", (out,), (alias,)))
            out = alias
        graph.outputs.append(out)
    return graph

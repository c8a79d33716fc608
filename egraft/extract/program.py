"""What every extractor returns (:class:`Extraction`: one e-node per e-class and its cost)
and the chosen program rebuilt as an IR graph, each shared e-class computed once.

Example:
    >>> ex = extract(state.snapshot(), cost_model("roofline"), "ilp")    # doctest: +SKIP
    >>> graph, classes = rebuild(state.snapshot(), ex.choice)          # doctest: +SKIP
"""

from __future__ import annotations

from dataclasses import dataclass, field

from egraft.ir.graph import Graph, Node, Value
from egraft.ir.types import TensorType
from egraft.rewrite.egraph import ABSENT, CONST, OUT, Snapshot

#: class -> the costs of its e-nodes, in the order of ``snapshot.classes[c]``.
CostTable = dict[int, list[float]]
EXTRACTORS = ("greedy", "ilp")


@dataclass
class Extraction:
    """The chosen e-node of every needed e-class and what the choice costs.

    Attributes:
        choice: e-class -> index of its chosen e-node in ``snapshot.classes[c]``.
        cost: the DAG cost of the program (each reached e-class paid once).
        extractor: ``greedy`` or ``ilp``.
        status: ``heuristic`` (greedy), ``optimal``, ``time limit`` (the ILP stopped with
            a valid but possibly suboptimal program; ``time limit: greedy's program kept...``
            when greedy's was cheaper than the ILP's best so far), or ``greedy fallback: why``.
        gap: the ILP's relative optimality gap when a limit stopped it (0 when optimal).
        seconds: time spent extracting.
        table: the cost of every e-node.
        alternatives: (class, e-node index) -> the DAG cost greedy gave that e-node, for
            explaining what was rejected.
        lower_bound: the ILP's proven lower bound on the cost.
    """

    choice: dict[int, int]
    cost: float
    extractor: str
    status: str
    gap: float | None
    seconds: float
    table: CostTable = field(repr=False, default_factory=dict)
    alternatives: dict[tuple[int, int], float] = field(repr=False, default_factory=dict)
    lower_bound: float | None = None
    problem: dict = field(default_factory=dict)


def reachable(snapshot: Snapshot, choice: dict[int, int], roots: list[int]) -> list[int]:
    """The e-classes the chosen program computes, children before parents."""
    order: list[int] = []
    seen: set[int] = set()
    for root in roots:
        stack = [(root, False)]
        while stack:
            c, ready = stack.pop()
            if ready:
                order.append(c)
                continue
            if c in seen:
                continue
            seen.add(c)
            stack.append((c, True))
            for ch in reversed(snapshot.classes[c][choice[c]].children):
                if ch not in seen:
                    stack.append((ch, False))
    return order


def dag_cost(snapshot: Snapshot, choice: dict[int, int], roots: list[int], table: CostTable) -> float:
    """The cost of the chosen program: each e-class it computes paid once."""
    return sum(table[c][choice[c]] for c in reachable(snapshot, choice, roots))


def _body_value_names(graph: Graph) -> set[str]:
    """Every value name inside the control-flow bodies of ``graph`` (nested ones too)."""
    names: set[str] = set()
    for node in graph.nodes:
        for attr in node.attrs.values():
            for body in attr if isinstance(attr, list | tuple) else [attr]:
                if isinstance(body, Graph):
                    names |= {v.name for v in body.values()} | _body_value_names(body)
    return names


def rebuild_outputs(snapshot: Snapshot) -> list[tuple[int, str, TensorType]]:
    """(e-class, name, type) of every output of the source graph."""
    state = snapshot.state
    return [(snapshot.ref_class[state.output_refs[i]], v.name, v.type) for i, v in enumerate(state.source.outputs)]


def rebuild_graph(snapshot: Snapshot, choice: dict[int, int], outputs=None, name: str | None = None) -> Graph:
    """The chosen program as an IR graph (see :func:`rebuild`)."""
    return rebuild(snapshot, choice, outputs, name)[0]


def rebuild(snapshot: Snapshot, choice: dict[int, int], outputs: list[tuple[int, str, TensorType]] | None = None,
            name: str | None = None) -> tuple[Graph, list[int]]:
    """The program computing the e-classes of ``outputs`` (class, name, type; default the
    source graph's outputs) as an IR graph, and the e-class of each of its nodes (-1 for an
    Identity that renames an output)."""
    outputs = rebuild_outputs(snapshot) if outputs is None else outputs
    state = snapshot.state
    graph = Graph(name or state.source.name, [], [], [], constants=state.constants, opsets=dict(state.opsets))
    node_classes: list[int] = []
    values: dict[int, Value | list | None] = {}
    counter = [0]
    output_names = {c: out_name for c, out_name, _ in outputs}
    for v in state.source.inputs:
        values[snapshot.ref_class[state.input_refs[v.name]]] = v
        graph.inputs.append(v)

    # New values are named v1, v2...: never a name the graph keeps (its inputs and outputs)
    # or that a control-flow body uses, which would make two values one.
    taken = {v.name for v in state.source.inputs} | {out_name for _, out_name, _ in outputs}
    taken |= _body_value_names(state.source)

    def fresh_name(c: int) -> str:
        if c in output_names:
            return output_names[c]
        while True:
            counter[0] += 1
            if f"v{counter[0]}" not in taken:
                return f"v{counter[0]}"

    origins: dict[int, str] = {}
    for ref, names in sorted(state.ref_origin.items()):
        origins.setdefault(snapshot.ref_class.get(ref, -1), names[0])

    def emit(c: int):
        n = snapshot.classes[c][choice[c]]
        t = snapshot.type_of(c)
        if n.op == CONST:
            return Value(fresh_name(c) if c in output_names else f"c{n.attrs[:8]}", t, const=n.attrs)
        if n.op == ABSENT:
            return None
        if n.op == OUT:
            return values[n.children[0]][snapshot.attrs(n)["index"]]
        inputs = tuple(values[ch] for ch in n.children)
        if isinstance(t, tuple):
            outs = [Value(fresh_name(-1), ti) if ti is not None else None for ti in t]
            result = outs
        else:
            outs = [Value(fresh_name(c), t)]
            result = outs[0]
        graph.nodes.append(Node(n.op, inputs, tuple(outs), dict(snapshot.attrs(n)), origins.get(c, ""), n.domain))
        node_classes.append(c)
        return result

    for c in reachable(snapshot, choice, [c for c, _, _ in outputs]):
        if c not in values:
            values[c] = emit(c)
    for c, out_name, out_type in outputs:
        out = values[c]
        if out.name != out_name:  # an output that is also an input or another output
            alias = Value(out_name, out_type)
            graph.nodes.append(Node("Identity", (out,), (alias,)))
            node_classes.append(-1)
            out = alias
        graph.outputs.append(out)
    return graph, node_classes

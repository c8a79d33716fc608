"""Structural checks of an IR graph: every value defined once and before use, inputs
and outputs present, no cycles, types consistent with the op registry's inference."""

from __future__ import annotations

from egraft.errors import GraphError
from egraft.ir.graph import Graph, topological_order


def validate_graph(graph: Graph, outer: set[str] | None = None, check_types: bool = True) -> None:
    """Raise :class:`GraphError` naming the first problem found in ``graph``.

    Args:
        graph: the graph to check.
        outer: names visible from an enclosing graph (for If/Loop/Scan bodies).
        check_types: re-run shape inference and compare with the recorded types.
    """
    defined: dict[str, str] = {}
    visible = set(outer or ())
    for v in graph.inputs:
        if v.const is not None:
            raise GraphError(f"graph input %{v.name} is marked constant; constants are not inputs")
        if v.name in defined:
            raise GraphError(f"value %{v.name} is defined twice (both graph inputs)")
        defined[v.name] = "graph input"
    for node in graph.nodes:
        for v in node.inputs:
            if v is not None and v.const is not None and v.const not in graph.constants:
                raise GraphError(f"{node.label} reads constant %{v.name}, whose tensor is missing from the side table")
        for v in node.outputs:
            if v is None:
                continue
            if v.name in defined:
                raise GraphError(f"value %{v.name} is defined twice: by {defined[v.name]} and by {node.label}")
            defined[v.name] = node.label
    all_names = set(defined) | visible
    for node in graph.nodes:
        for v in node.inputs:
            if v is not None and v.const is None and v.name not in all_names:
                raise GraphError(f"{node.label} reads %{v.name}, which nothing defines (a dangling value)")
    topological_order(graph.nodes, set(graph_input_names(graph)) | visible)
    seen = set(graph_input_names(graph)) | visible
    for node in graph.nodes:
        for v in node.inputs:
            if v is not None and v.const is None and v.name not in seen:
                raise GraphError(f"{node.label} reads %{v.name} before it is computed: "
                                 "nodes are not in topological order")
        seen.update(v.name for v in node.outputs if v is not None)
    for v in graph.outputs:
        if v.const is None and v.name not in seen:
            raise GraphError(f"graph output %{v.name} is not computed by any node")
    if check_types:
        _check_types(graph, visible)


def graph_input_names(graph: Graph) -> list[str]:
    return [v.name for v in graph.inputs]


def _check_types(graph: Graph, visible: set[str]) -> None:
    from egraft.ir.graph import Graph as G
    from egraft.ir.infer import FreshDims, infer_node

    fresh = FreshDims("_check")
    types = {v.name: v.type for v in graph.inputs}
    for node in graph.nodes:
        for v in node.inputs:
            if v is not None and v.name in types and types[v.name] != v.type:
                raise GraphError(f"{node.label} reads %{v.name} as {v.type}, but it was defined as {types[v.name]}")
        captured = set()
        if any(isinstance(attr, G) for attr in node.attrs.values()):
            from egraft.ir.ops.control import node_captures

            captured = {v.name for v in node_captures(node)}  # fed by the node's trailing inputs
        for attr in node.attrs.values():
            if isinstance(attr, G):
                validate_graph(attr, visible | set(types) | {v.name for v in graph.inputs} | captured,
                               check_types=True)
        inferred = infer_node(graph, node, fresh)
        for v, t in zip(node.outputs, inferred):
            if v is None:
                continue
            if t is not None and not _compatible(t, v.type):
                raise GraphError(f"{node.label}: output %{v.name} is declared {v.type}, but the op gives {t}")
            types[v.name] = v.type


def _compatible(inferred, declared) -> bool:
    if inferred.dtype != declared.dtype:
        return False
    if inferred.shape is None or declared.shape is None:
        return True
    if len(inferred.shape) != len(declared.shape):
        return False
    for a, b in zip(inferred.shape, declared.shape):
        if isinstance(a, int) and isinstance(b, int) and a != b:
            return False
    return True

"""Binding symbolic dims: ``--shape batch=1`` gives a graph whose types are static
where they only depended on ``batch``, and whose shape arithmetic (``Shape(x)``, sizes
for Reshape) becomes known values that folding turns into constants."""

from __future__ import annotations

from collections.abc import Mapping

from egraft.errors import InputError
from egraft.ir.graph import Graph, Node, Value
from egraft.ir.infer import FreshDims, infer_node


def specialize(graph: Graph, bindings: Mapping[str, int]) -> Graph:
    """A copy of ``graph`` with the symbols in ``bindings`` replaced by their values and
    every node re-typed by the op registry.

    Example:
        >>> specialize(egraft.load("bert.onnx"), {"batch": 1, "seq": 128})  # doctest: +SKIP
    """
    known = set(graph.symbols())
    unknown = sorted(set(bindings) - known)
    if unknown:
        raise InputError(f"--shape {unknown[0]}=...: the model has no symbolic dim {unknown[0]!r}; "
                         f"its symbolic dims are {sorted(known) or 'none'}")
    out = Graph(graph.name, [], [], [], constants=graph.constants, opsets=dict(graph.opsets), doc=graph.doc)
    renamed: dict[str, Value] = {}
    for v in graph.inputs:
        nv = v.replace(type=v.type.bind(bindings))
        renamed[v.name] = nv
        out.inputs.append(nv)
    fresh = FreshDims("_s")
    for node in graph.nodes:
        inputs = tuple(None if v is None else renamed.get(v.name, v) for v in node.inputs)
        draft = node.replace(inputs=inputs)
        types = infer_node(out, draft, fresh)
        outputs = tuple(None if v is None else v.replace(type=t) for v, t in zip(node.outputs, types))
        for v in outputs:
            if v is not None:
                renamed[v.name] = v
        out.nodes.append(Node(node.op, inputs, outputs, node.attrs, node.name, node.domain))
    out.outputs = [renamed.get(v.name, v) for v in graph.outputs]
    return out

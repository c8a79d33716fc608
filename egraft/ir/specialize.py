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


def bind_values(graph: Graph, values: Mapping[str, int | bool]) -> Graph:
    """A copy of ``graph`` in which every use of the inputs named in ``values`` reads that
    value as a constant; the inputs stay (a call still gives them, and ignores them).
    Each must be an integer or bool input of one element: a flag or a setting (silero's
    sample rate) whose value decides an If. Folding then turns the condition into a
    constant, and lowering runs the branch it takes inline.

    Example:
        >>> bind_values(egraft.load("silero.onnx"), {"sr": 16000})  # doctest: +SKIP
    """
    import numpy as np

    inputs = {v.name: v for v in graph.inputs}
    constants: dict[str, Value] = {}
    out = Graph(graph.name, list(graph.inputs), [], [], constants=dict(graph.constants), opsets=dict(graph.opsets),
                known_values=dict(graph.known_values), doc=graph.doc)
    for name, value in values.items():
        v = inputs.get(name)
        shape = None if v is None else v.type.shape
        if v is None or shape is None or not all(isinstance(d, int) for d in shape) or int(np.prod(shape)) != 1 \
                or v.type.dtype.numpy.kind not in "iub":
            raise InputError(f"values: {name!r} is not an integer or bool input of one element; those are "
                             f"{sorted(n for n, i in inputs.items() if _one_integer(i)) or 'none'}")
        array = np.asarray(value).astype(v.type.dtype.numpy).reshape(shape)
        if array.item() != value:
            raise InputError(f"values: {name}={value!r} does not fit its dtype {v.type.dtype.short}")
        constants[name] = out.add_constant(array, f"{name}_bound")
    for node in graph.nodes:
        out.nodes.append(node.replace(inputs=tuple(None if v is None else constants.get(v.name, v)
                                                   for v in node.inputs)))
    out.outputs = list(graph.outputs)  # an output that is the input itself stays the fed value
    return out


def _one_integer(v: Value) -> bool:
    shape = v.type.shape
    return shape is not None and all(isinstance(d, int) for d in shape) and all(d == 1 for d in shape) \
        and v.type.dtype.numpy.kind in "iub"

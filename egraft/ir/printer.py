"""The deterministic text form of the IR (grammar in docs/ir.md).

Graph inputs and outputs keep their names; the printer numbers every other value in
order of definition (``%0``, ``%1``...) and every constant (``@0``, ``@1``...), sorts
attributes, and prints a node's source name as a trailing comment. Nothing depends on
object identity, so the same graph always prints the same text.

Example::

    graph main(%x: f32[batch, 3, 224, 224]) -> (%y) {
      %0: f32[batch, 64, 112, 112] = Conv(%x, @0, @1) {pads=[3, 3, 3, 3], strides=[2, 2]}  # conv1
      ...
    }
"""

from __future__ import annotations

import re
from typing import Any

import numpy as np

from egraft.ir.graph import Graph, Value

_PLAIN_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_.]*$")


def _quote_name(name: str) -> str:
    return name if _PLAIN_NAME.match(name) else '"' + name.replace('"', '\\"') + '"'


class _Namer:
    def __init__(self, graph: Graph, parent: _Namer | None = None, aliases: dict[str, str] | None = None):
        self.parent = parent
        self.names: dict[str, str] = dict(aliases or {})  # a body's captures print as the outer values
        self.count = parent.count if parent else [0, 0]
        self.const_lines: list[str] = parent.const_lines if parent else []
        self.const_names: dict[str, str] = parent.const_names if parent else {}
        self.graph = graph
        for v in (*graph.inputs, *graph.outputs):
            if v.const is None:
                self.names[v.name] = "%" + _quote_name(v.name)

    def name(self, v: Value | None) -> str:
        if v is None:
            return "_"
        if v.const is not None:
            key = v.const
            if key not in self.const_names:
                label = f"@{self.count[1]}"
                self.count[1] += 1
                self.const_names[key] = label
                self.const_lines.append(_const_line(label, self.graph.constants[key], v))
            return self.const_names[key]
        scope: _Namer | None = self
        while scope is not None:
            if v.name in scope.names:
                return scope.names[v.name]
            scope = scope.parent
        label = f"%{self.count[0]}"
        self.count[0] += 1
        self.names[v.name] = label
        return label


def _const_line(label: str, array: np.ndarray, v: Value) -> str:
    from egraft.ir.types import TensorType

    ttype = TensorType.of(array)
    if array.size <= 8:
        return f"  {label}: {ttype} = {_literal(array)}  # {v.name}"
    return f"  {label}: {ttype}  # {v.name}"


def _float(x) -> str:
    """The shortest text that reads back as the same float (``0.02``, ``1e-05``, ``nan``)."""
    text = str(x)
    return text + ".0" if text.lstrip("-").isdigit() else text


def _literal(array: np.ndarray) -> str:
    """A small array's values: ``[1, 18432]``, ``[0.5]`` (floats as float32 reprs when f32)."""
    values = array.ravel().tolist()
    if array.dtype.kind == "f":
        cast = np.float32 if array.dtype == np.float32 else np.float64
        values = [_float(cast(x)) for x in values]
        return "[" + ", ".join(values) + "]"
    return str(values)


def fmt_attr(value: Any, namer: _Namer | None = None, indent: str = "", aliases: dict[str, str] | None = None) -> str:
    """The printed form of one attribute value (``aliases``: a body's captured names -> printed names)."""
    if isinstance(value, Graph):
        return _print_body(value, _Namer(value, namer, aliases), indent + "  ", header=True)
    if isinstance(value, bool):
        return str(int(value))
    if isinstance(value, float):
        return _float(np.float32(value))
    if isinstance(value, str):
        return '"' + value.replace('"', '\\"') + '"'
    if isinstance(value, np.ndarray):
        from egraft.ir.types import TensorType

        if value.size <= 8:
            return f"tensor<{TensorType.of(value)}>{_literal(value)}"
        return f"tensor<{TensorType.of(value)}>"
    if isinstance(value, list | tuple):
        return "[" + ", ".join(fmt_attr(x, namer, indent, aliases) for x in value) + "]"
    return str(value)


def _print_body(graph: Graph, namer: _Namer, indent: str, header: bool) -> str:
    lines = []
    params = ", ".join(f"{namer.name(v)}: {v.type}" for v in graph.inputs)
    for node in graph.nodes:
        args = ", ".join(namer.name(v) for v in node.inputs)
        while args.endswith(", _"):
            args = args[:-3]
        attrs = ""
        if node.attrs:
            aliases = _capture_aliases(node, namer)
            attrs = " {" + ", ".join(f"{k}={fmt_attr(node.attrs[k], namer, indent, aliases)}"
                                     for k in sorted(node.attrs)) + "}"
        outs = [v for v in node.outputs]
        lhs = ", ".join(f"{namer.name(v)}: {v.type}" if v is not None else "_" for v in outs)
        op = f"{node.domain}::{node.op}" if node.domain else node.op
        comment = f"  # {node.name}" if node.name else ""
        lines.append(f"{indent}  {lhs} = {op}({args}){attrs}{comment}")
    rets = ", ".join(namer.name(v) for v in graph.outputs)
    lines.append(f"{indent}  return {rets}")
    head = f"graph {_quote_name(graph.name)}({params}) {{" if header else ""
    return head + "\n" + "\n".join(lines) + f"\n{indent}}}"


def _capture_aliases(node, namer: _Namer) -> dict[str, str] | None:
    """A control-flow node's captured values, by the bodies' names -> the printed names of
    the node's trailing inputs (the same values)."""
    if not any(isinstance(a, Graph) for a in node.attrs.values()):
        return None
    from egraft.ir.ops.control import node_captures

    captures = node_captures(node)
    outer = node.inputs[len(node.inputs) - len(captures):]
    return {v.name: namer.name(o) for v, o in zip(captures, outer)}


def print_graph(graph: Graph) -> str:
    """The IR text of ``graph``: its body, then the constants it uses."""
    namer = _Namer(graph)
    text = _print_body(graph, namer, "", header=True)
    if namer.const_lines:
        text += "\nconstants {\n" + "\n".join(namer.const_lines) + "\n}"
    return text

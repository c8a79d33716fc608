"""IR -> ONNX. Any graph becomes a model that onnxruntime can run: standard ops stay
standard, constants become initializers, symbolic dims become ``dim_param`` names, and
egraft-only ops become model-local functions whose bodies are their definitions."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import onnx
from onnx import helper, numpy_helper

from egraft.errors import GraphError
from egraft.ir.graph import Graph, content_hash
from egraft.ir.onnx_bridge import attr_to_onnx, type_to_onnx
from egraft.ir.ops.control import node_captures
from egraft.ir.registry import get_op


class _Exporter:
    def __init__(self) -> None:
        self.functions: dict[str, onnx.FunctionProto] = {}
        self.domains: dict[str, int] = {}

    def graph(self, graph: Graph, emitted: set[str]) -> onnx.GraphProto:
        inits = []
        emitted = set(emitted)
        nodes = []
        for node in graph.nodes:
            for v in node.inputs:
                if v is not None and v.const is not None and v.name not in emitted:
                    emitted.add(v.name)
                    inits.append(numpy_helper.from_array(np.asarray(graph.constants[v.const]), v.name))
            nodes.append(self.node(graph, node, emitted))
        outputs = []
        for v in graph.outputs:
            if v.const is not None and v.name not in emitted:
                emitted.add(v.name)
                inits.append(numpy_helper.from_array(np.asarray(graph.constants[v.const]), v.name))
            outputs.append(type_to_onnx(v.name, v.type))
        return helper.make_graph(nodes, graph.name, [type_to_onnx(v.name, v.type) for v in graph.inputs],
                                 outputs, initializer=inits)

    def node(self, graph: Graph, node, emitted: set[str]) -> onnx.NodeProto:
        op = get_op(node.op, node.domain)
        if op is None:
            raise GraphError(f"{node.label}: op {node.op!r} is not in the registry; it cannot be exported")
        inputs = [v.name if v is not None else "" for v in node.inputs]
        outputs = [v.name if v is not None else "" for v in node.outputs]
        renames: dict[str, str] = {}
        if any(isinstance(a, Graph) for a in node.attrs.values()):
            # Captures are explicit trailing inputs in the IR; in ONNX the bodies read the
            # outer values by name, which extraction may have changed.
            captures = node_captures(node)
            k = len(inputs) - len(captures)
            renames = {v.name: outer for v, outer in zip(captures, inputs[k:]) if v.name != outer}
            inputs = inputs[:k]
        while inputs and inputs[-1] == "":
            inputs.pop()
        while outputs and outputs[-1] == "":
            outputs.pop()
        scope = emitted | {v.name for v in graph.inputs} | {v.name for n in graph.nodes for v in n.outputs if v}

        def body(g: Graph) -> onnx.GraphProto:
            return _rename_reads(self.graph(g, scope), renames)

        attrs = [attr_to_onnx(k, v, body) for k, v in sorted(node.attrs.items())]
        if op.exports_as_itself:
            proto = helper.make_node(node.op, inputs, outputs, name=node.name or None,
                                     domain=node.domain or None)
            proto.attribute.extend(attrs)
            return proto
        if op.onnx_function is None:
            raise GraphError(f"{node.label}: egraft op {node.domain}::{node.op} has no ONNX definition to export")
        fn: onnx.FunctionProto = op.onnx_function(node)
        key = f"{node.op}_{content_hash(np.frombuffer(fn.SerializeToString(), np.uint8))[:8]}"
        fn.name = key
        fn.domain = node.domain
        self.functions.setdefault(key, fn)
        self.domains[node.domain] = 1
        return helper.make_node(key, inputs, outputs, name=node.name or None, domain=node.domain)


def _rename_reads(gp: onnx.GraphProto, renames: dict[str, str]) -> onnx.GraphProto:
    """``gp`` with its reads of outer values renamed (nested bodies included)."""
    if not renames:
        return gp
    for node in gp.node:
        for i, name in enumerate(node.input):
            if name in renames:
                node.input[i] = renames[name]
        for attr in node.attribute:
            for sub in ([attr.g] if attr.type == onnx.AttributeProto.GRAPH else list(attr.graphs)):
                _rename_reads(sub, renames)
    for out in gp.output:
        if out.name in renames and out.name not in {n for node in gp.node for n in node.output}:
            out.name = renames[out.name]
    return gp


def to_onnx(graph: Graph) -> onnx.ModelProto:
    """The ONNX model of an IR graph (see :func:`save_onnx`)."""
    exporter = _Exporter()
    gp = exporter.graph(graph, set())
    opsets = [helper.make_opsetid(d, v) for d, v in sorted(graph.opsets.items())]
    opsets += [helper.make_opsetid(d, v) for d, v in sorted(exporter.domains.items()) if d not in graph.opsets]
    model = helper.make_model(gp, opset_imports=opsets, producer_name="egraft",
                              functions=list(exporter.functions.values()))
    model.ir_version = max(7, min(model.ir_version, 10))
    return model


def save_onnx(graph: Graph, path: str | os.PathLike) -> None:
    """Write ``graph`` as an ONNX model file at ``path``.

    Example:
        >>> save_onnx(egraft.load("in.onnx"), "out.onnx")  # doctest: +SKIP
    """
    Path(path).write_bytes(to_onnx(graph).SerializeToString())

"""Conversions between IR pieces and ONNX protos that several stages share: types,
attributes, and single-node models (used by the onnx fallbacks and by export)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
import onnx
from onnx import helper, numpy_helper

from egraft.ir.dims import fmt_dim
from egraft.ir.types import TensorType


def type_to_onnx(name: str, ttype: TensorType | None) -> onnx.ValueInfoProto:
    """A ValueInfoProto for ``name``; symbolic dims become ``dim_param`` strings."""
    if ttype is None:
        return helper.make_empty_tensor_value_info(name)
    shape = None
    if ttype.shape is not None:
        shape = [d if isinstance(d, int) else fmt_dim(d) for d in ttype.shape]
    return helper.make_tensor_value_info(name, ttype.dtype.value, shape)


def attr_to_onnx(name: str, value: Any, graph_to_onnx=None) -> onnx.AttributeProto:
    """An AttributeProto from an IR attribute value (ints, floats, strings, lists,
    arrays, subgraphs; subgraphs need ``graph_to_onnx``)."""
    from egraft.ir.graph import Graph

    if isinstance(value, Graph):
        if graph_to_onnx is None:
            raise TypeError(f"attribute {name!r} is a subgraph and no converter was given")
        return helper.make_attribute(name, graph_to_onnx(value))
    if isinstance(value, list) and value and isinstance(value[0], Graph):
        return helper.make_attribute(name, [graph_to_onnx(g) for g in value])
    if isinstance(value, np.ndarray):
        return helper.make_attribute(name, numpy_helper.from_array(value))
    if isinstance(value, onnx.TypeProto | onnx.SparseTensorProto):
        return helper.make_attribute(name, value)
    if isinstance(value, list) and not value:
        # An empty list: ONNX needs its kind; ints is the common case.
        attr = onnx.AttributeProto(name=name, type=onnx.AttributeProto.INTS)
        return attr
    return helper.make_attribute(name, value)


def attr_from_onnx(attr: onnx.AttributeProto, graph_from_onnx=None) -> Any:
    """The IR value of an AttributeProto: Python scalars and lists, numpy arrays for
    tensors, IR graphs for subgraphs (through ``graph_from_onnx``)."""
    kind = attr.type
    A = onnx.AttributeProto
    if kind == A.GRAPH:
        return graph_from_onnx(attr.g)
    if kind == A.GRAPHS:
        return [graph_from_onnx(g) for g in attr.graphs]
    if kind == A.TENSOR:
        return numpy_helper.to_array(attr.t)
    if kind == A.TENSORS:
        return [numpy_helper.to_array(t) for t in attr.tensors]
    value = helper.get_attribute_value(attr)
    if isinstance(value, bytes):
        return value.decode("utf-8", errors="replace")
    if isinstance(value, list) and value and isinstance(value[0], bytes):
        return [v.decode("utf-8", errors="replace") for v in value]
    if isinstance(value, tuple):
        value = list(value)
    return value


def single_node_model(op: str, domain: str, opset: int, inputs: list[tuple[str, TensorType | None]],
                      outputs: list[str], attrs: Mapping[str, Any],
                      initializers: Mapping[str, np.ndarray] | None = None) -> onnx.ModelProto:
    """A model of one node; inputs with a value in ``initializers`` become initializers."""
    initializers = dict(initializers or {})
    node = helper.make_node(op, [n for n, _ in inputs], outputs, domain=domain or None,
                            **{})
    node.attribute.extend(attr_to_onnx(k, v) for k, v in sorted(attrs.items()))
    graph_inputs = [type_to_onnx(n, t) for n, t in inputs if n and n not in initializers]
    inits = [numpy_helper.from_array(np.asarray(a), n) for n, a in initializers.items()]
    graph = helper.make_graph([node], "node", graph_inputs,
                              [helper.make_empty_tensor_value_info(o) for o in outputs if o],
                              initializer=inits)
    opsets = [helper.make_opsetid("", opset if not domain else 21)]
    if domain:
        opsets.append(helper.make_opsetid(domain, opset))
    return helper.make_model(graph, opset_imports=opsets, ir_version=10)

"""ONNX -> IR. Reads a model (path, bytes or ModelProto) into a typed :class:`Graph`.

- Initializers and ``Constant`` nodes become constants in the side table. Old models
  (IR version 3) also list their initializers as graph inputs: those are constants too,
  not runtime inputs.
- ``dim_param`` dims become sympy symbols of the same name; unnamed unknown dims and
  placeholder names (``?``, ``-1``, ``None``: see :func:`dim_param_symbol`) become a fresh
  symbol at each place, ``_d0``, ``_d1``...
- Every node is typed by the op registry's inference as it is imported; then an
  anonymous dim (``_d0``, ``unk__12``) that meets another in a broadcast is unified with
  it (:mod:`egraft.ir.unify`).
- If/Loop/Scan bodies are imported as nested graphs that may read outer values.
"""

from __future__ import annotations

import keyword
import os
import re
from collections import Counter
from collections.abc import Mapping
from pathlib import Path

import numpy as np
import onnx
from onnx import numpy_helper

from egraft.errors import ModelError, UnsupportedOpError
from egraft.ir.dims import sym
from egraft.ir.dtypes import DType, UnsupportedDType
from egraft.ir.graph import Graph, Node, Value, topological_order
from egraft.ir.infer import FreshDims, infer_node
from egraft.ir.onnx_bridge import attr_from_onnx
from egraft.ir.registry import get_op
from egraft.ir.types import TensorType
from egraft.ir.unify import unify_dims

ModelSource = str | os.PathLike | bytes | onnx.ModelProto


def read_model(source: ModelSource) -> onnx.ModelProto:
    """Parse a model from a path, bytes or a ModelProto; a :class:`ModelError` if it is not one."""
    if isinstance(source, onnx.ModelProto):
        return source
    if isinstance(source, bytes | bytearray):
        where = "the given bytes"
        data = bytes(source)
    else:
        path = Path(source)
        where = str(path)
        if not path.exists():
            raise ModelError(f"{where}: no such file")
        if path.is_dir():
            raise ModelError(f"{where}: is a directory, not an ONNX model file")
        data = path.read_bytes()
    try:
        model = onnx.ModelProto.FromString(data)
    except Exception as e:
        raise ModelError(f"{where}: not a valid ONNX model (protobuf parse failed: {e})") from None
    if not model.HasField("graph") or len(model.graph.output) == 0:
        raise ModelError(f"{where}: not a valid ONNX model (it has no graph or no outputs)")
    if not isinstance(source, bytes | bytearray) and model.graph.initializer:
        base = Path(source).parent
        if any(t.data_location == onnx.TensorProto.EXTERNAL for t in model.graph.initializer):
            try:
                onnx.load_external_data_for_model(model, str(base))
            except Exception as e:
                raise ModelError(f"{where}: cannot load external weights: {e}") from None
    return model


def load(source: ModelSource) -> Graph:
    """Import an ONNX model into egraft's IR.

    Args:
        source: a path to an ``.onnx`` file, its bytes, or an ``onnx.ModelProto``.

    Returns:
        The typed :class:`Graph`.

    Raises:
        ModelError: the input is not a readable ONNX model.
        UnsupportedOpError: the model uses ops egraft does not support (all are named).

    Example:
        >>> g = load("resnet50.onnx")  # doctest: +SKIP
        >>> g.op_histogram()["Conv"]   # doctest: +SKIP
        53
    """
    model = read_model(source)
    opsets = {("" if o.domain == "ai.onnx" else o.domain): o.version for o in model.opset_import}
    opsets.setdefault("", 1)
    functions = {(f.domain, f.name) for f in model.functions}
    _check_supported(model.graph, opsets, functions)
    importer = _Importer(opsets)
    graph = importer.import_graph(model.graph, outer={})
    graph.doc = model.doc_string
    graph, _ = unify_dims(graph)  # an anonymous dim meeting another in a broadcast is that dim
    from egraft import trace

    if trace.enabled("shapes"):
        trace.trace_shapes(graph)
    return graph


def _iter_nodes(graph: onnx.GraphProto):
    for node in graph.node:
        yield node
        for attr in node.attribute:
            if attr.type == onnx.AttributeProto.GRAPH:
                yield from _iter_nodes(attr.g)
            elif attr.type == onnx.AttributeProto.GRAPHS:
                for g in attr.graphs:
                    yield from _iter_nodes(g)


def _check_supported(graph: onnx.GraphProto, opsets: Mapping[str, int], functions) -> None:
    """Raise one error naming every unsupported op, its opset, a node and the count."""
    missing: Counter = Counter()
    first: dict = {}
    for node in _iter_nodes(graph):
        domain = "" if node.domain == "ai.onnx" else node.domain
        if node.op_type == "Constant" and domain == "":
            continue
        if (node.domain, node.op_type) in functions:
            missing[(domain, node.op_type, "a model-local function")] += 1
            first.setdefault((domain, node.op_type, "a model-local function"), node.name)
            continue
        if get_op(node.op_type, domain) is None:
            key = (domain, node.op_type, f"opset {opsets.get(domain, '?')}")
            missing[key] += 1
            first.setdefault(key, node.name)
    if missing:
        parts = []
        for (domain, op, why), count in sorted(missing.items(), key=lambda kv: (-kv[1], kv[0])):
            name = f"{domain}::{op}" if domain else op
            node_name = first[(domain, op, why)] or "(unnamed)"
            parts.append(f"{name} ({why}): {count} node{'s' if count > 1 else ''}, first {node_name!r}")
        raise UnsupportedOpError("unsupported op" + ("s" if len(parts) > 1 else "") + ": " + "; ".join(parts))


class _Importer:
    def __init__(self, opsets: dict[str, int]):
        self.opsets = opsets
        self.fresh = FreshDims()

    # ---- types -------------------------------------------------------------
    def tensor_type(self, type_proto: onnx.TypeProto, what: str) -> TensorType:
        kind = type_proto.WhichOneof("value")
        if kind != "tensor_type":
            raise UnsupportedOpError(f"{what} is a {kind or 'untyped value'}; egraft supports tensor values only")
        tt = type_proto.tensor_type
        try:
            dtype = DType.from_onnx(tt.elem_type, f" ({what})")
        except UnsupportedDType as e:
            raise UnsupportedOpError(str(e)) from None
        if dtype is DType.STRING:
            raise UnsupportedOpError(f"{what} holds strings, which are not supported: "
                                     "egraft computes on numeric and bool tensors only")
        if not tt.HasField("shape"):
            return TensorType(dtype, None)
        dims = []
        for d in tt.shape.dim:
            if d.HasField("dim_value") and d.dim_value >= 0:
                dims.append(int(d.dim_value))
            elif d.HasField("dim_param") and (name := dim_param_symbol(d.dim_param)) is not None:
                dims.append(sym(name))
            else:
                dims.append(self.fresh())
        return TensorType(dtype, tuple(dims))

    def input_type(self, type_proto: onnx.TypeProto, what: str, hint: TensorType | None) -> TensorType:
        """The type of a graph input; a body input without a type or shape takes ``hint``."""
        if hint is not None:
            if type_proto.WhichOneof("value") is None:
                return hint
            declared = self.tensor_type(type_proto, what)
            if declared.shape is None and declared.dtype == hint.dtype:
                return hint
            return declared
        return self.tensor_type(type_proto, what)

    # ---- graphs ------------------------------------------------------------
    def import_graph(self, gp: onnx.GraphProto, outer: Mapping[str, Value],
                     constants: dict | None = None, input_hints: list | None = None) -> Graph:
        """Import ``gp``; ``input_hints`` types the inputs of a body that leaves them
        untyped or without a shape (from the If/Loop/Scan node's own inputs)."""
        graph = Graph(name=gp.name or "main", inputs=[], outputs=[], nodes=[], opsets=dict(self.opsets))
        if constants is not None:
            graph.constants = constants  # a body shares its parent's side table
        scope: dict[str, Value] = dict(outer)
        init_names = set()
        for t in gp.initializer:
            try:
                array = numpy_helper.to_array(t)
            except Exception as e:
                raise ModelError(f"initializer {t.name!r} cannot be read: {e}") from None
            if array.dtype.kind in "OSU":
                raise UnsupportedOpError(f"initializer {t.name!r} holds strings; egraft supports numeric tensors only")
            scope[t.name] = graph.add_constant(array, t.name)
            init_names.add(t.name)
        for t in gp.sparse_initializer:
            raise UnsupportedOpError(f"sparse initializer {t.values.name!r} is not supported")
        for k, vi in enumerate(gp.input):
            if vi.name in init_names:
                continue  # IR-3 style: initializers listed as inputs are constants
            hint = input_hints[k] if input_hints is not None and k < len(input_hints) else None
            v = Value(vi.name, self.input_type(vi.type, f"graph input {vi.name!r}", hint))
            graph.inputs.append(v)
            scope[vi.name] = v
        nodes = self._sorted_nodes(gp, set(scope))
        for np_node in nodes:
            self.import_node(graph, np_node, scope)
        for vi in gp.output:
            if vi.name not in scope:
                raise ModelError(f"graph output {vi.name!r} is not computed by any node")
            v = scope[vi.name]
            graph.outputs.append(scope[vi.name])
        return graph

    def _sorted_nodes(self, gp: onnx.GraphProto, available: set[str]):
        # Sort with the IR helper through lightweight stand-ins for the protos.
        fake = [Node(n.op_type, tuple(Value(i, _ANY) if i else None for i in n.input),
                     tuple(Value(o, _ANY) for o in n.output), name=str(k)) for k, n in enumerate(gp.node)]
        order = topological_order(fake, available)
        return [gp.node[int(f.name)] for f in order]

    def import_node(self, graph: Graph, np_node: onnx.NodeProto, scope: dict[str, Value]) -> None:
        domain = "" if np_node.domain == "ai.onnx" else np_node.domain
        label = f"{np_node.op_type} {np_node.name!r}" if np_node.name else f"{np_node.op_type} (unnamed)"
        if np_node.op_type == "Constant" and domain == "":
            array = _constant_value(np_node, label)
            scope[np_node.output[0]] = graph.add_constant(array, np_node.output[0])
            return
        inputs = []
        for name in np_node.input:
            if not name:
                inputs.append(None)
                continue
            if name not in scope:
                raise ModelError(f"{label} reads {name!r}, which no node, input or initializer defines")
            inputs.append(scope[name])
        attrs = {}
        hints = self._body_input_hints(graph, np_node, domain, inputs)
        for a in np_node.attribute:
            if a.ref_attr_name:
                raise UnsupportedOpError(f"{label}: attribute references (function bodies) are not supported")
            attrs[a.name] = attr_from_onnx(
                a, lambda g, name=a.name: self.import_graph(g, scope, graph.constants, hints.get(name)))
        placeholder = TensorType(DType.FLOAT32, None)
        outputs = tuple(Value(o, placeholder) if o else None for o in np_node.output)
        node = Node(np_node.op_type, tuple(inputs), outputs, attrs, np_node.name, domain)
        if any(isinstance(a, Graph) for a in attrs.values()):
            # What the bodies read from outside becomes explicit inputs (see ops/control.py).
            from egraft.ir.ops.control import node_captures

            node = node.replace(inputs=node.inputs + tuple(scope[v.name] for v in node_captures(node)))
        self._check_attrs(graph, node)
        types = infer_node(graph, node, self.fresh)
        outputs = tuple(v.replace(type=t) if v is not None else None for v, t in zip(outputs, types))
        node = node.replace(outputs=outputs)
        graph.nodes.append(node)
        for v in outputs:
            if v is not None:
                scope[v.name] = v

    def _body_input_hints(self, graph: Graph, np_node: onnx.NodeProto, domain: str, inputs: list) -> dict:
        """Attribute name -> types for the inputs of a control-flow body (see ``body_input_types``)."""
        if domain or np_node.op_type not in ("Loop", "Scan"):
            return {}
        from egraft.ir.ops.control import body_input_types

        plain = {a.name: attr_from_onnx(a) for a in np_node.attribute if a.type != onnx.AttributeProto.GRAPH}
        types = [v.type if v is not None else None for v in inputs]
        return body_input_types(np_node.op_type, plain, types, graph.opsets.get("", 1), self.fresh)

    def _check_attrs(self, graph: Graph, node: Node) -> None:
        op = get_op(node.op, node.domain)
        opset = graph.opsets.get(node.domain, 1)
        known = op.known_attrs(opset)
        if not known and op.is_standard and not node.attrs:
            return
        unknown = sorted(set(node.attrs) - known)
        if unknown and op.is_standard:
            raise ModelError(f"{node.label}: unknown attribute {unknown[0]!r} for {node.op} at opset {opset}; "
                             f"it accepts {sorted(known)}")


_ANY = TensorType(DType.FLOAT32, None)

#: dim_params that exporters write for "unknown" rather than as a name shared between places.
_PLACEHOLDER_DIMS = frozenset({"?", "-1", "none", "null", "nil", "unk", "unknown", "dynamic", "n/a", "*", "_"})


def dim_param_symbol(text: str) -> str | None:
    """The symbol name of a ``dim_param``, or None when it is a placeholder for "unknown".

    Some exporters write ``?`` (or ``-1``, ``None``, an empty string) for every unknown
    dim; one symbol per such name would force all of them equal. A placeholder is a fresh
    symbol at each place; a name with a letter in it is a real name that unifies with the
    same name elsewhere (characters a symbol cannot hold become ``_``).

    Example:
        >>> dim_param_symbol("batch"), dim_param_symbol("?"), dim_param_symbol("seq len")
        ('batch', None, 'seq_len')
    """
    text = text.strip()
    if text.lower() in _PLACEHOLDER_DIMS or not any(c.isalpha() for c in text):
        return None
    name = re.sub(r"\W", "_", text)
    if name[0].isdigit() or keyword.iskeyword(name):
        name = "_" + name
    return name


def _constant_value(node: onnx.NodeProto, label: str) -> np.ndarray:
    if not node.attribute:
        raise ModelError(f"{label} has no value attribute")
    a = node.attribute[0]
    if a.name == "sparse_value":
        raise UnsupportedOpError(f"{label}: sparse constants are not supported")
    value = attr_from_onnx(a)
    if a.name == "value":
        arr = value
    elif a.name == "value_float":
        arr = np.array(value, dtype=np.float32)
    elif a.name == "value_floats":
        arr = np.array(value, dtype=np.float32)
    elif a.name == "value_int":
        arr = np.array(value, dtype=np.int64)
    elif a.name == "value_ints":
        arr = np.array(value, dtype=np.int64)
    else:
        raise UnsupportedOpError(f"{label}: constant attribute {a.name!r} is not supported "
                                 "(strings are not tensors egraft computes on)")
    if arr.dtype.kind in "OSU":
        raise UnsupportedOpError(f"{label}: string constants are not supported")
    return arr

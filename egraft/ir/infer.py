"""Shape and dtype inference of one node, through the op registry, plus the
compile-time evaluation of shape arithmetic (``Shape(x)`` -> ``Gather`` -> ``Concat``
-> ``Reshape``) over symbolic dims."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import numpy as np
import sympy

from egraft.errors import ShapeInferenceError, UnsupportedOpError
from egraft.ir.dtypes import UnsupportedDType
from egraft.ir.graph import Graph, Node
from egraft.ir.registry import InferContext, OpDef, RunContext, get_op
from egraft.ir.types import TensorType

#: Known values larger than this are not tracked (they are not shape arithmetic).
MAX_KNOWN_ELEMENTS = 64
#: Import-time folding of non-shape ops reads at most this many input elements.
MAX_FOLDED_INPUT_ELEMENTS = 4096
#: Ops whose outputs are not a function of their inputs: never evaluated at compile time.
NEVER_FOLDED = frozenset({"RandomNormal", "RandomUniform", "RandomNormalLike", "RandomUniformLike", "Multinomial",
                          "Bernoulli", "Dropout"})


class FreshDims:
    """Makes new symbols for dims nothing can infer: ``_d0``, ``_d1``... (deterministic)."""

    def __init__(self, prefix: str = "_d") -> None:
        self.prefix = prefix
        self.count = 0

    def __call__(self) -> sympy.Symbol:
        from egraft.ir.dims import sym

        s = sym(f"{self.prefix}{self.count}")
        self.count += 1
        return s


def node_opset(graph: Graph, node: Node) -> int:
    domain = "" if node.domain == "ai.onnx" else node.domain
    return graph.opsets.get(domain, graph.opsets.get("", 21))


def resolve_op(node: Node, opset: int) -> OpDef:
    op = get_op(node.op, node.domain)
    if op is None:
        where = f" (domain {node.domain!r})" if node.domain else ""
        raise UnsupportedOpError(f"op {node.op}{where} at opset {opset} is not supported (node {node.label})")
    return op


def input_values(graph: Graph, node: Node) -> list[np.ndarray | None]:
    """Compile-time values of the node's inputs: constants and known shape arithmetic."""
    out = []
    for v in node.inputs:
        if v is None:
            out.append(None)
        elif v.const is not None:
            out.append(graph.constants[v.const])
        else:
            out.append(graph.known_values.get(v.name))
    return out


def infer_node(graph: Graph, node: Node, fresh: Callable[[], sympy.Symbol]) -> list[TensorType | None]:
    """The output types of ``node`` in ``graph`` (input types are read from the node).

    Records the known value of each output in ``graph.known_values`` when the op is
    shape arithmetic on known inputs.
    """
    from egraft.ir.onnx_fallback import onnx_infer

    opset = node_opset(graph, node)
    op = resolve_op(node, opset)
    types = [v.type if v is not None else None for v in node.inputs]
    while types and types[-1] is None:
        types.pop()
    values = input_values(graph, node)
    ctx = InferContext(node, op, opset, types, values, fresh, graph)
    try:
        out = (op.infer or onnx_infer)(ctx)
    except UnsupportedOpError:
        raise
    except UnsupportedDType as e:
        raise UnsupportedOpError(f"{node.label}: {e}") from None
    except Exception as e:  # a bug, an unexpected input, or an input whose rank is unknown
        if any(t is not None and t.shape is None for t in types):
            out = _types_of_unknown_rank(ctx, e)
        elif isinstance(e, ShapeInferenceError):
            raise
        else:  # name the node
            raise ShapeInferenceError(f"{node.label}: shape inference failed: {type(e).__name__}: {e}") from e
    out = list(out) + [None] * (len(node.outputs) - len(out))
    out = [t if node.outputs[i] is not None else None for i, t in enumerate(out[: len(node.outputs)])]
    _record_known_values(graph, node, op, opset, values, out)
    return out


def _types_of_unknown_rank(ctx: InferContext, error: Exception) -> list[TensorType | None]:
    """Output types when an input's rank is unknown (an If whose branches differ in rank):
    the dtypes from onnx's inference, shapes unknown until run time (each run binds them).
    ``error`` (the op's own inference failing on the unknown rank) is raised when even
    the dtypes cannot be inferred."""
    from egraft.ir.onnx_fallback import onnx_infer

    try:
        inferred = onnx_infer(ctx)
    except Exception:
        raise error from None
    if any(t is None for t, v in zip(inferred, ctx.node.outputs) if v is not None):
        raise error
    return [None if t is None else TensorType(t.dtype, None) for t in inferred]


def _record_known_values(graph: Graph, node: Node, op: OpDef, opset: int,
                         values: Sequence[np.ndarray | None], types) -> None:
    """Evaluate a node at compile time when its inputs are known (import-time folding).

    ``Shape`` and ``Size`` need only their input's type. ``symbolic`` ops also run on
    object arrays of sympy dims (shape arithmetic); any other op runs when every input it
    is given has a known numeric value of at most :data:`MAX_FOLDED_INPUT_ELEMENTS`
    (``Not``, ``ConstantOfShape``, ``Transpose``... of constants). Ops with subgraphs or
    random outputs never fold. Only small, statically shaped results are kept.
    """
    if op.compute is None or node.op in NEVER_FOLDED or any(isinstance(a, Graph) for a in node.attrs.values()):
        return
    if any(t is not None and (t.shape is None or not t.is_static) for t in types):
        return
    if any(t is not None and math.prod(t.shape) > MAX_KNOWN_ELEMENTS for t in types):  # (np.prod: 10x slower)
        return
    if node.op in ("Shape", "Size") and op.symbolic:
        x_type = node.inputs[0].type
        if x_type.shape is None:
            return
        args = [_ShapeOnly(x_type.shape)]
    else:
        if any(v is not None and values[i] is None for i, v in enumerate(node.inputs)):
            return
        if not any(v is not None for v in node.inputs):
            return
        numeric = all(a is None or a.dtype != object for a in values)
        if not op.symbolic and not numeric:
            return
        if numeric and sum(a.size for a in values if a is not None) > MAX_FOLDED_INPUT_ELEMENTS:
            return
        args = list(values)
    try:
        with np.errstate(all="ignore"):
            results = op.compute(RunContext(node, op, opset, symbolic=op.symbolic), *args)
    except Exception:  # not evaluable at compile time (an undecided comparison, a data-dependent branch)
        return
    for v, r in zip(node.outputs, results):
        if v is None or r is None:
            continue
        r = np.asarray(r)
        if r.dtype == object:
            r = _canonical_object_array(r)
        if r.size <= MAX_KNOWN_ELEMENTS:
            graph.known_values[v.name] = r


class _ShapeOnly:
    """Stands for a tensor of which only the shape is known (the input of Shape/Size)."""

    def __init__(self, shape):
        self.shape = tuple(shape)
        self.ndim = len(self.shape)
        self.size = sympy.Mul(*self.shape) if self.shape else 1


def _canonical_object_array(r: np.ndarray) -> np.ndarray:
    from egraft.ir.dims import simplify_dim

    flat = [simplify_dim(x) if isinstance(x, sympy.Basic | int | np.integer) else x for x in r.ravel()]
    if all(isinstance(x, int) for x in flat):
        return np.array(flat, dtype=np.int64).reshape(r.shape)
    out = np.empty(len(flat), dtype=object)
    out[:] = flat
    return out.reshape(r.shape)

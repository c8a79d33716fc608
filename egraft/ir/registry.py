"""The op registry: for each op, its attribute schema, shape/dtype inference and numpy
reference semantics. It is the one source of truth every stage asks.

An op is registered with :func:`register_op`::

    register_op(
        "Relu",
        infer=same_as(0),
        compute=lambda ctx, x: [np.maximum(x, 0).astype(x.dtype)],
        doc="max(x, 0)",
    )

``infer(ctx)`` returns the output :class:`TensorType` list; it reads the input types
(``ctx.types``), attributes with defaults (``ctx.attr("axis")``), the opset version
(``ctx.opset``) and, for shape computations, the compile-time values of inputs
(``ctx.value(i)``: a constant, or the known value of a ``Shape(x)`` computation whose
entries may be sympy expressions).

``compute(ctx, *inputs)`` returns the output arrays. Ops marked ``symbolic=True`` can
also be evaluated on object arrays of sympy expressions; shape inference uses that to
carry ``Shape`` arithmetic through ``Gather``, ``Concat``, ``Slice`` and friends.

Standard ONNX ops without an ``infer`` fall back to ``onnx.shape_inference`` and those
without ``compute`` to ``onnx.reference``; ``egraft show --ops`` lists which.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from functools import cache
from typing import Any

import numpy as np

from egraft.ir.types import TensorType


@dataclass(frozen=True)
class AttrSpec:
    """An attribute an egraft-only op accepts: its kind and default (``None`` = required)."""

    kind: str  # "int", "float", "string", "ints", "floats", "strings", "tensor", "graph"
    default: Any = None
    doc: str = ""


@dataclass(frozen=True)
class OpDef:
    """What the registry knows of one op.

    Attributes:
        name: the op name (ONNX spelling for standard ops).
        domain: "" for the default ONNX domain, else e.g. "com.egraft".
        infer: shape/dtype inference, or ``None`` to use onnx's shape inference.
        compute: the numpy reference implementation, or ``None`` to use onnx.reference.
        symbolic: True when ``compute`` also works on object arrays of sympy dims.
        attrs: the attribute schema of an egraft-only op (standard ops read onnx's).
        doc: one line on what the op computes.
        onnx_function: for an egraft-only op, ``node -> onnx.FunctionProto`` whose body
            is the op's definition in standard ops; export writes it as a model-local
            function so onnxruntime can run the exported model.
        work: ``WorkContext -> Work``: the arithmetic and memory traffic of one run of the
            op at given shapes, read by the cost models (see :mod:`egraft.ir.work`);
            ``None`` counts one operation per output element.
        folded_only: an op that rules build only for the folding rules to evaluate (its
            inputs are constants, it has no kernel): extraction never picks it unfolded
            (as egglog's ``:unextractable``), so a saturation stopped before the fold
            picks another alternative instead of running the op on every call.
        canonical: ``(attrs, keys) -> (positions, attrs)``, the one form of a node among
            those that compute the same function of the same inputs: given an identity
            (``keys``, e-classes) per input, which inputs to keep in which order and the
            attributes that go with them. Rewriting builds nodes through it, so that the
            forms become one e-node (``Elementwise`` sorts its inputs).
        infer_key: ``attrs -> key``, for an op whose type inference reads less than all its
            attributes: what it reads (``Elementwise``: the highest input its body reads, not the
            body). Rewriting memoizes inference by it, so the many bodies that fusion builds
            over the same input types are inferred once.
        commutative: a two-input node computes the same with its inputs swapped (``Add``,
            ``Mul``, ``Max``...): a rule's pattern ``Add(MatMul(a, w), bias)`` then also
            matches ``Add(bias, MatMul(a, w))`` (see :mod:`egraft.rewrite.match`).
        associative: two nested nodes compute the same however grouped (``(a + b) + c`` is
            ``a + (b + c)``): a rule's pattern ``Mul(Mul(x, a), b)`` also matches ``Mul(x, Mul(a,
            b))`` (:func:`egraft.rewrite.load.expand_associative`). Up to rounding, for floats:
            a rule that regroups must be sound at the checker's tolerance.
    """

    name: str
    domain: str = ""
    infer: Callable | None = None
    compute: Callable | None = None
    symbolic: bool = False
    attrs: dict[str, AttrSpec] = field(default_factory=dict)
    doc: str = ""
    onnx_function: Callable | None = None
    work: Callable | None = None
    folded_only: bool = False
    canonical: Callable | None = None
    commutative: bool = False
    associative: bool = False
    infer_key: Callable | None = None

    @property
    def is_standard(self) -> bool:
        return self.domain in ("", "ai.onnx", "ai.onnx.ml", "ai.onnx.preview.training", "ai.onnx.preview")

    @property
    def exports_as_itself(self) -> bool:
        """A standard op, or onnxruntime's own (``com.microsoft``): export writes the node as it
        is; egraft's ops export as model-local functions."""
        return self.is_standard or self.domain == "com.microsoft"

    def attr_defaults(self, opset: int) -> dict[str, Any]:
        """Attribute name -> default value at ``opset`` (``None`` when required/absent)."""
        if not self.is_standard:
            return {k: a.default for k, a in self.attrs.items()}
        return dict(_onnx_attr_defaults(self.name, self.domain, opset))

    def known_attrs(self, opset: int) -> set[str]:
        return set(self.attr_defaults(opset))


_REGISTRY: dict[tuple[str, str], OpDef] = {}


def register_op(
    name: str,
    *,
    infer: Callable | None = None,
    compute: Callable | None = None,
    symbolic: bool = False,
    domain: str = "",
    attrs: dict[str, AttrSpec] | None = None,
    doc: str = "",
    onnx_function: Callable | None = None,
    folded_only: bool = False,
    canonical: Callable | None = None,
    commutative: bool = False,
    associative: bool = False,
    infer_key: Callable | None = None,
) -> OpDef:
    """Add an op to the registry (or replace its entry) and return its definition."""
    op = OpDef(name, domain, infer, compute, symbolic, dict(attrs or {}), doc, onnx_function, folded_only=folded_only,
               canonical=canonical, commutative=commutative, associative=associative, infer_key=infer_key)
    _REGISTRY[(domain, name)] = op
    return op


def register_work(name: str, work: Callable, domain: str = "") -> None:
    """Attach the work formula of a registered op (see :mod:`egraft.ir.work`)."""
    key = (_normalize_domain(domain), name)
    if key not in _REGISTRY:
        raise KeyError(f"register_work: {domain + '::' if domain else ''}{name} is not a registered op")
    _REGISTRY[key] = replace(_REGISTRY[key], work=work)


def _normalize_domain(domain: str) -> str:
    return "" if domain == "ai.onnx" else domain


def get_op(name: str, domain: str = "") -> OpDef | None:
    """The definition of an op, or ``None``. Standard ONNX ops that egraft has no entry
    for still resolve (with onnx fallbacks for both inference and execution)."""
    if not _loaded:
        _ensure_loaded()
    domain = _normalize_domain(domain)
    op = _REGISTRY.get((domain, name))
    if op is not None:
        return op
    if _onnx_has_schema(name, domain):
        return _fallback_op(name, domain)
    return None


@cache
def _fallback_op(name: str, domain: str) -> OpDef:
    """The entry of a standard op egraft has none for (onnx's inference and reference run it)."""
    return OpDef(name, domain, doc="(onnx fallback)")


def all_ops() -> list[OpDef]:
    """Every registered op, sorted by domain and name."""
    _ensure_loaded()
    return [_REGISTRY[k] for k in sorted(_REGISTRY)]


_loaded = False


def _ensure_loaded() -> None:
    global _loaded
    import egraft.ir.ops  # noqa: F401  (registers the ops on import)

    _loaded = True  # (an import statement per lookup was 1% of saturation)


@cache
def _onnx_has_schema(name: str, domain: str) -> bool:
    import onnx.defs

    return onnx.defs.has(name, domain)


@cache
def _onnx_attr_defaults(name: str, domain: str, opset: int) -> tuple[tuple[str, Any], ...]:
    import onnx.defs
    from onnx import helper

    try:
        schema = onnx.defs.get_schema(name, opset, domain)
    except onnx.defs.SchemaError:
        return ()
    out = []
    for attr_name, attr in sorted(schema.attributes.items()):
        default = None
        if attr.default_value is not None and attr.default_value.type != 0:
            default = helper.get_attribute_value(attr.default_value)
            if isinstance(default, bytes):
                default = default.decode()
            elif isinstance(default, list) and default and isinstance(default[0], bytes):
                default = [d.decode() for d in default]
        out.append((attr_name, default))
    return tuple(out)


@cache
def onnx_since_version(name: str, domain: str, opset: int) -> int:
    """The version of the op's ONNX schema in force at ``opset`` (e.g. Softmax at 11 -> 11)."""
    import onnx.defs

    try:
        return onnx.defs.get_schema(name, opset, domain).since_version
    except onnx.defs.SchemaError:
        return opset


class NodeAttrs:
    """Attribute reading shared by every context that looks at one node (inference, the
    reference kernels, the CPU kernel generators): subclasses set ``node`` and
    ``_defaults`` (the op's defaults at the node's opset)."""

    node: Any
    _defaults: dict[str, Any]

    def attr(self, name: str, default: Any = None) -> Any:
        """The attribute's value, else the op's default at this opset, else ``default``."""
        if name in self.node.attrs:
            return self.node.attrs[name]
        d = self._defaults.get(name)
        return default if d is None else d


class InferContext(NodeAttrs):
    """What an op's ``infer`` function sees: input types, attributes, opset, known values."""

    def __init__(self, node, opdef: OpDef, opset: int, types: Sequence[TensorType | None],
                 values: Sequence[np.ndarray | None], fresh_dim: Callable[[], Any], graph=None):
        self.node = node
        self.opdef = opdef
        self.opset = opset
        self.types = list(types)
        self._values = list(values)
        self.fresh_dim = fresh_dim
        self.graph = graph
        self._defaults = opdef.attr_defaults(opset)

    @property
    def num_outputs(self) -> int:
        return len(self.node.outputs)

    @property
    def num_inputs(self) -> int:
        """The number of inputs given (trailing omitted optional inputs not counted)."""
        return len(self.types)

    def has_input(self, i: int) -> bool:
        return i < len(self.types) and self.types[i] is not None

    def value(self, i: int) -> np.ndarray | None:
        """The compile-time value of input ``i`` (constant or known shape arithmetic)."""
        if i >= len(self._values):
            return None
        return self._values[i]


class RunContext(NodeAttrs):
    """What an op's ``compute`` function sees: the node, attributes and opset."""

    def __init__(self, node, opdef: OpDef, opset: int, run_subgraph: Callable | None = None,
                 symbolic: bool = False):
        self.node = node
        self.opdef = opdef
        self.opset = opset
        self.run_subgraph = run_subgraph
        self.symbolic = symbolic
        self._defaults = opdef.attr_defaults(opset)

    @property
    def num_outputs(self) -> int:
        return len(self.node.outputs)

"""The work of one op at given shapes: arithmetic, memory traffic and kernel launches.

The cost models (:mod:`egraft.extract.cost`) price a candidate op by what it does, not by
its name: ``flops`` floating-point operations (a fused multiply-add counts 2), ``reads``
and ``writes`` bytes of memory traffic, ``launches`` kernels started, and the kernel
``family`` it runs in (a roofline profile may give each family its own efficiency).

Each op's formula lives in the op registry (``OpDef.work``, attached in
:mod:`egraft.ir.ops.work`); an op without one counts one operation per output element and
moves its inputs and outputs once. Symbolic dims take the values of ``bindings`` and,
when unbound, the documented defaults of :func:`default_dim`.

Example:
    >>> from egraft.ir.types import TensorType, DType
    >>> t = TensorType(DType.FLOAT32, (1, 64))
    >>> w = op_work("Relu", "", {}, [t], [t])
    >>> (w.flops, w.reads, w.writes, w.launches)
    (64.0, 256.0, 256.0, 1)
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

from egraft.ir.dims import dim_function, evaluate_dim
from egraft.ir.types import TensorType

#: The kernel families a roofline profile can weigh separately. ``gemm_fused``: a product
#: with its epilogue (bias, residual, activation) fused, which a profile may price apart
#: from a plain one (a GPU's plain products run on cuBLAS, the fused ones on egraft's tile
#: loop); a profile that does not name it prices it as ``gemm`` (:data:`PARENT_FAMILY`).
FAMILIES = ("conv", "conv_nhwc", "conv_nchwc", "winograd", "gemm", "gemm_fused", "attention", "elementwise", "reduce",
            "normalize", "pool", "layout", "data", "view", "other")

#: A family a profile leaves out takes these figures of its parent.
PARENT_FAMILY = {"gemm_fused": "gemm"}

#: Unbound symbols whose name says "batch" count as 1; any other unbound symbol as 128.
BATCH_DEFAULT, OTHER_DEFAULT = 1, 128


def default_dim(name: str) -> int:
    """The value an unbound symbolic dim takes in cost estimates (``--shape`` overrides it):
    1 for batch-like names (``batch``, ``N``, ``B``, ``batch_size``...), 128 for the rest
    (a typical sequence length).

    Example:
        >>> default_dim("batch"), default_dim("seq")
        (1, 128)
    """
    lowered = name.lower()
    return BATCH_DEFAULT if "batch" in lowered or lowered in ("n", "b", "bs") else OTHER_DEFAULT


@dataclass(frozen=True)
class Work:
    """What one run of an op costs the machine.

    Attributes:
        flops: floating-point (or integer) operations.
        family: the kernel family (one of :data:`FAMILIES`).
        reads: bytes read; ``None`` = every input once.
        writes: bytes written; ``None`` = every output once.
        launches: kernels started (0 for views: a Reshape moves nothing).
    """

    flops: float
    family: str = "elementwise"
    reads: float | None = None
    writes: float | None = None
    launches: int = 1


class WorkContext:
    """What a work formula sees: the op's attributes (defaults filled in) and its input and
    output shapes with every dim an int (``None`` for an absent input or an unknown rank).
    """

    def __init__(self, attrs: Mapping[str, Any], defaults: Mapping[str, Any],
                 inputs: Sequence[tuple[int, ...] | None], outputs: Sequence[tuple[int, ...] | None],
                 input_itemsizes: Sequence[int], output_itemsizes: Sequence[int]):
        self._attrs = attrs
        self._defaults = defaults
        self.inputs = list(inputs)
        self.outputs = list(outputs)
        self.input_itemsizes = list(input_itemsizes)
        self.output_itemsizes = list(output_itemsizes)

    def attr(self, name: str, default: Any = None) -> Any:
        if name in self._attrs:
            return self._attrs[name]
        d = self._defaults.get(name)
        return default if d is None else d

    def has_input(self, i: int) -> bool:
        return i < len(self.inputs) and self.inputs[i] is not None

    def input_elems(self, i: int) -> int:
        return numel(self.inputs[i]) if self.has_input(i) else 0

    def input_bytes(self, i: int) -> int:
        return self.input_elems(i) * self.input_itemsizes[i] if self.has_input(i) else 0

    @property
    def out_elems(self) -> int:
        """Elements of the first output."""
        return numel(self.outputs[0]) if self.outputs and self.outputs[0] is not None else 0

    @property
    def reads(self) -> int:
        """Bytes of every input, read once."""
        return sum(self.input_bytes(i) for i in range(len(self.inputs)))

    @property
    def writes(self) -> int:
        """Bytes of every output, written once."""
        return sum(numel(s) * b for s, b in zip(self.outputs, self.output_itemsizes) if s is not None)


def numel(shape: Sequence[int] | None) -> int:
    """The number of elements of a shape (1 for a scalar, 0 for ``None``)."""
    return 0 if shape is None else math.prod(shape)


def resolve_shape(t: TensorType | None, bindings: Mapping[str, int]) -> tuple[int, ...] | None:
    """``t``'s shape with every dim an int: bound symbols by ``bindings``, the others by
    :func:`default_dim`. ``None`` for an absent value or an unknown rank."""
    if t is None or not isinstance(t, TensorType) or t.shape is None:
        return None
    out = []
    key = None
    for d in t.shape:
        if isinstance(d, int):
            out.append(max(d, 0))
            continue
        if key is None:
            key = tuple(sorted(bindings.items()))
        out.append(_resolved_dim(d, key))
    return tuple(out)


@lru_cache(maxsize=65536)
def _resolved_dim(d, bindings: tuple[tuple[str, int], ...]) -> int:
    """A symbolic dim as an int under ``bindings``, the unbound symbols at :func:`default_dim`
    (memoized: extraction prices every e-node, and the same dims recur on all of them)."""
    values = dict(bindings)
    try:
        return max(int(dim_function(d)(values)), 0)  # every symbol bound: the fast path
    except KeyError:
        pass
    d = evaluate_dim(d, values)
    if not isinstance(d, int):
        d = evaluate_dim(d, {s.name: default_dim(s.name) for s in d.free_symbols})
    return max(int(d), 0) if isinstance(d, int) else 1


def op_work(op: str, domain: str, attrs: Mapping[str, Any], inputs: Sequence[TensorType | None],
            outputs: Sequence[TensorType | None], bindings: Mapping[str, int] | None = None,
            opset: int = 21) -> Work:
    """The :class:`Work` of ``op`` on values of these types (reads and writes filled in)."""
    from egraft.ir.registry import get_op

    bindings = bindings or {}
    opdef = get_op(op, domain)
    in_shapes = [resolve_shape(t, bindings) for t in inputs]
    out_shapes = [resolve_shape(t, bindings) for t in outputs]
    ctx = WorkContext(attrs, opdef.attr_defaults(opset) if opdef is not None else {}, in_shapes, out_shapes,
                      [_itemsize(t) for t in inputs], [_itemsize(t) for t in outputs])
    if opdef is not None and opdef.work is not None:
        work = opdef.work(ctx)
    else:
        work = Work(float(ctx.out_elems))
    reads = float(ctx.reads) if work.reads is None else float(work.reads)
    writes = float(ctx.writes) if work.writes is None else float(work.writes)
    return Work(float(work.flops), work.family, reads, writes, work.launches)


def value_bytes(t: TensorType | None, bindings: Mapping[str, int]) -> int:
    """The bytes of a tensor of type ``t`` at ``bindings`` (dims as :func:`resolve_shape`
    resolves them; 0 for an absent value or an unknown rank).

    Example:
        >>> from egraft.ir.dtypes import DType
        >>> value_bytes(TensorType(DType.FLOAT32, (768, 256)), {})
        786432
    """
    return numel(resolve_shape(t, bindings)) * _itemsize(t)


def _itemsize(t) -> int:
    if not isinstance(t, TensorType):
        return 0
    try:
        return int(t.dtype.numpy.itemsize)
    except (TypeError, ValueError):
        return 1

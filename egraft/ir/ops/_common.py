"""Helpers shared by op definitions: common inference rules and small numpy utilities."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import sympy

from egraft.errors import ShapeInferenceError
from egraft.ir.dims import broadcast_shapes
from egraft.ir.dtypes import DType
from egraft.ir.registry import InferContext
from egraft.ir.types import TensorType


def fail(ctx: InferContext, message: str) -> ShapeInferenceError:
    """A ShapeInferenceError naming the node."""
    return ShapeInferenceError(f"{ctx.node.label}: {message}")


def same_as(index: int = 0):
    """Inference: every output has the type of input ``index``."""

    def infer(ctx: InferContext) -> list[TensorType]:
        return [ctx.types[index]] * ctx.num_outputs

    return infer


def broadcast_of(*indices: int, dtype: DType | None = None, dtype_from: int = 0):
    """Inference: one output, the broadcast of the given inputs (all when none given)."""

    def infer(ctx: InferContext) -> list[TensorType]:
        chosen = [t for i, t in enumerate(ctx.types) if t is not None and (not indices or i in indices)]
        if any(t.shape is None for t in chosen):
            shape = None
        else:
            try:
                shape = broadcast_shapes(*(t.shape for t in chosen))
            except ValueError as e:
                raise fail(ctx, str(e)) from None
        out_dtype = dtype or ctx.types[dtype_from].dtype
        return [TensorType(out_dtype, shape)]

    return infer


def same_float_dtype(ctx: InferContext) -> DType:
    """Every given input is a float tensor of input 0's dtype; returns that dtype."""
    dtype = ctx.types[0].dtype
    if not dtype.is_float:
        raise fail(ctx, f"input 0 is {dtype.short}; {ctx.node.op} computes on float tensors")
    for i, t in enumerate(ctx.types):
        if t is not None and t.dtype != dtype:
            raise fail(ctx, f"input {i} is {t.dtype.short} but input 0 is {dtype.short}")
    return dtype


def normalize_axis(axis: int, rank: int, ctx=None) -> int:
    """``axis`` in ``[0, rank)``; negative axes count from the end."""
    if not -rank <= axis < max(rank, 1):
        msg = f"axis {axis} is out of range for rank {rank}"
        raise (fail(ctx, msg) if ctx is not None else ValueError(msg))
    return axis + rank if axis < 0 else axis


def require_shape(ctx: InferContext, index: int) -> tuple:
    t = ctx.types[index]
    if t is None or t.shape is None:
        raise fail(ctx, f"the rank of input {index} is unknown")
    return t.shape


def ints_of(ctx: InferContext, index: int) -> list | None:
    """The compile-time value of a 1-D (or scalar) integer input as a list of dims, or None."""
    v = ctx.value(index)
    if v is None:
        return None
    flat = np.asarray(v).ravel().tolist()
    return [x if isinstance(x, sympy.Basic) else int(x) for x in flat]


def to_dim(x):
    """An int or sympy value read from a known-values array, as a dim."""
    from egraft.ir.dims import simplify_dim

    return simplify_dim(x)


def is_symbolic(*arrays) -> bool:
    """True when any input is an object array of sympy values (symbolic evaluation)."""
    return any(isinstance(a, np.ndarray) and a.dtype == object for a in arrays)


def shape_list(values: Sequence) -> np.ndarray:
    """An int64 array of dims, or an object array when any dim is symbolic."""
    vals = [int(v) if isinstance(v, int | np.integer) else v for v in values]
    if all(isinstance(v, int) for v in vals):
        return np.array(vals, dtype=np.int64)
    out = np.empty(len(vals), dtype=object)
    out[:] = vals
    return out

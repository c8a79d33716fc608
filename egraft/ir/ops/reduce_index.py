"""Reductions and index ops: the Reduce* family, ArgMax/ArgMin, TopK, CumSum/CumProd,
gathers and scatters (GatherElements, GatherND, ScatterElements, ScatterND, Scatter),
OneHot, Trilu, EyeLike, ReverseSequence, Det, and the data-dependent ops whose output
sizes are only known at run time (NonZero, Compress, Unique, NonMaxSuppression), which
get a fresh dim from inference.

Float16 and bfloat16 inputs are computed in float32 and cast back. ReduceSum, ReduceProd,
ReduceMax and ReduceMin are ``symbolic``: shape inference evaluates them on sympy dims
(``ReduceProd(Shape(x)[1:])`` is ``c*h*w``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import sympy

from egraft.ir.dims import dim_product, simplify_dim
from egraft.ir.dtypes import DType
from egraft.ir.ops._common import fail, ints_of, is_symbolic, normalize_axis, require_shape, same_as
from egraft.ir.registry import register_op
from egraft.ir.types import TensorType


# ---- helpers -------------------------------------------------------------------------------
def _is_low_float(dtype: np.dtype) -> bool:
    """True for float16 and bfloat16, which are computed in float32."""
    return dtype == np.float16 or dtype.name == "bfloat16"


def _widen(x: np.ndarray) -> np.ndarray:
    """``x`` in a dtype numpy computes well in: float16/bfloat16 become float32."""
    return x.astype(np.float32) if _is_low_float(x.dtype) else x


def _scalar_int(value) -> int:
    """The one integer in a scalar or one-element tensor."""
    return int(np.asarray(value).ravel()[0])


def _fresh_shape(ctx, rank: int) -> tuple:
    return tuple(ctx.fresh_dim() for _ in range(rank))


# ---- Reduce* -------------------------------------------------------------------------------
@dataclass(frozen=True)
class _Reduction:
    """One reduction op: ``fn(x, axes, keepdims)`` on a widened array; ``axes_input_since``
    is the opset from which 'axes' is an input rather than an attribute."""

    name: str
    fn: Callable[[np.ndarray, tuple[int, ...], bool], np.ndarray]
    axes_input_since: int
    symbolic_fn: Callable[[np.ndarray, tuple[int, ...], bool], np.ndarray] | None = None
    doc: str = ""


def _count(x: np.ndarray, axes: tuple[int, ...]) -> int:
    return int(np.prod([x.shape[a] for a in axes], dtype=np.int64))


def _float_work(x: np.ndarray) -> np.ndarray:
    """Integer inputs of log/sqrt-based reductions are computed in float64."""
    return x.astype(np.float64) if x.dtype.kind in "iub" else x


def _reduce_sum(x, axes, keep):
    return np.sum(x, axis=axes, keepdims=keep, dtype=x.dtype)


def _reduce_mean(x, axes, keep):
    n = _count(x, axes)
    total = np.sum(x, axis=axes, keepdims=keep, dtype=x.dtype)
    if x.dtype.kind in "iu":
        if n == 0:
            return np.zeros_like(total)
        return _int_div(total, n)
    return total / x.dtype.type(n) if n else np.full_like(total, np.nan)


def _int_div(a: np.ndarray, n: int) -> np.ndarray:
    """a / n truncated toward zero, exact for 64-bit integers."""
    q = np.abs(a) // n
    return np.where(a < 0, -q, q).astype(a.dtype)


def _lowest(dtype: np.dtype):
    if dtype == np.bool_:
        return False
    return np.iinfo(dtype).min if dtype.kind in "iu" else -np.inf


def _highest(dtype: np.dtype):
    if dtype == np.bool_:
        return True
    return np.iinfo(dtype).max if dtype.kind in "iu" else np.inf


def _reduce_max(x, axes, keep):
    return np.max(x, axis=axes, keepdims=keep, initial=_lowest(x.dtype))


def _reduce_min(x, axes, keep):
    return np.min(x, axis=axes, keepdims=keep, initial=_highest(x.dtype))


def _reduce_prod(x, axes, keep):
    return np.prod(x, axis=axes, keepdims=keep, dtype=x.dtype)


def _reduce_l1(x, axes, keep):
    return np.sum(np.abs(x), axis=axes, keepdims=keep, dtype=x.dtype)


def _reduce_l2(x, axes, keep):
    return np.sqrt(_float_work(np.sum(x * x, axis=axes, keepdims=keep, dtype=x.dtype)))


def _reduce_log_sum(x, axes, keep):
    return np.log(_float_work(np.sum(x, axis=axes, keepdims=keep, dtype=x.dtype)))


def _reduce_log_sum_exp(x, axes, keep):
    """log(sum(exp(x))), computed as m + log(sum(exp(x - m))) with m the finite max."""
    x = _float_work(x)
    if _count(x, axes) == 0:
        return np.full(_reduced_shape(x.shape, axes, keep), -np.inf, dtype=x.dtype)
    m = np.max(x, axis=axes, keepdims=True)
    m = np.where(np.isfinite(m), m, 0).astype(x.dtype)
    out = np.log(np.sum(np.exp(x - m), axis=axes, keepdims=True)) + m
    return out if keep else np.squeeze(out, axis=axes)


def _reduce_sum_square(x, axes, keep):
    return np.sum(x * x, axis=axes, keepdims=keep, dtype=x.dtype)


def _reduced_shape(shape, axes, keep: bool) -> tuple:
    if keep:
        return tuple(1 if i in axes else d for i, d in enumerate(shape))
    return tuple(d for i, d in enumerate(shape) if i not in axes)


def _object_reduce(fn: Callable) -> Callable:
    """A reduction of object arrays of sympy values by ``fn(*values)`` (sympy.Max, Min)."""

    def reduce(x, axes, keep):
        if not axes:
            return x
        kept = [i for i in range(x.ndim) if i not in axes]
        moved = np.transpose(x, kept + list(axes))
        kept_shape = moved.shape[: len(kept)]
        flat = moved.reshape(kept_shape + (_count(x, axes),))
        out = np.empty(kept_shape, dtype=object)
        for idx in np.ndindex(*kept_shape):
            out[idx] = fn(*flat[idx])
        return out.reshape(_reduced_shape(x.shape, axes, keep))

    return reduce


def _object_sum(x, axes, keep):
    return np.sum(x, axis=axes, keepdims=keep)


def _object_prod(x, axes, keep):
    return np.prod(x, axis=axes, keepdims=keep)


_REDUCTIONS = [
    _Reduction("ReduceSum", _reduce_sum, 13, _object_sum, "the sum over 'axes'"),
    _Reduction("ReduceMean", _reduce_mean, 18, None, "the mean over 'axes'"),
    _Reduction("ReduceMax", _reduce_max, 18, _object_reduce(sympy.Max), "the max over 'axes' (-inf when empty)"),
    _Reduction("ReduceMin", _reduce_min, 18, _object_reduce(sympy.Min), "the min over 'axes' (+inf when empty)"),
    _Reduction("ReduceProd", _reduce_prod, 18, _object_prod, "the product over 'axes'"),
    _Reduction("ReduceL1", _reduce_l1, 18, None, "sum(|x|) over 'axes'"),
    _Reduction("ReduceL2", _reduce_l2, 18, None, "sqrt(sum(x^2)) over 'axes'"),
    _Reduction("ReduceLogSum", _reduce_log_sum, 18, None, "log(sum(x)) over 'axes'"),
    _Reduction("ReduceLogSumExp", _reduce_log_sum_exp, 18, None, "log(sum(exp(x))) over 'axes'"),
    _Reduction("ReduceSumSquare", _reduce_sum_square, 18, None, "sum(x^2) over 'axes'"),
]


def _reduce_axes(ctx, red: _Reduction, rank: int, axes_value) -> tuple[int, ...]:
    """The normalized, sorted axes to reduce; () means the identity (noop_with_empty_axes)."""
    if ctx.opset >= red.axes_input_since:
        axes = None if axes_value is None else [int(a) for a in np.asarray(axes_value).ravel()]
        if not axes:
            return () if ctx.attr("noop_with_empty_axes", 0) else tuple(range(rank))
    else:
        axes = ctx.attr("axes", None)
        if not axes:
            return tuple(range(rank))
    return tuple(sorted({normalize_axis(int(a), rank, ctx) for a in axes}))


def _reduce_infer(red: _Reduction):
    def infer(ctx):
        x = ctx.types[0]
        shape = require_shape(ctx, 0)
        keep = bool(ctx.attr("keepdims", 1))
        input_form = ctx.opset >= red.axes_input_since
        if input_form and ctx.has_input(1) and ctx.value(1) is None:
            n_axes = ctx.types[1].shape[0] if ctx.types[1].shape else None
            if n_axes != 0:
                if keep:
                    return [TensorType(x.dtype, _fresh_shape(ctx, len(shape)))]
                if isinstance(n_axes, int):
                    return [TensorType(x.dtype, _fresh_shape(ctx, len(shape) - n_axes))]
                return [TensorType(x.dtype, None)]
        axes = _reduce_axes(ctx, red, len(shape), ctx.value(1) if input_form else None)
        return [TensorType(x.dtype, _reduced_shape(shape, axes, keep))]

    return infer


def _reduce_compute(red: _Reduction):
    def compute(ctx, x, axes=None):
        keep = bool(ctx.attr("keepdims", 1))
        ax = _reduce_axes(ctx, red, x.ndim, axes)
        if is_symbolic(x):
            if red.symbolic_fn is None:
                raise TypeError(f"{red.name} cannot run on symbolic values")
            return [np.asarray(red.symbolic_fn(x, ax, keep), dtype=object)]
        out = red.fn(_widen(x), ax, keep)
        return [np.asarray(out).astype(x.dtype, copy=False)]

    return compute


for _red in _REDUCTIONS:
    register_op(_red.name, infer=_reduce_infer(_red), compute=_reduce_compute(_red),
                symbolic=_red.symbolic_fn is not None, doc=_red.doc)


# ---- ArgMax, ArgMin --------------------------------------------------------------------------
def _arg_infer(ctx):
    shape = require_shape(ctx, 0)
    axis = normalize_axis(ctx.attr("axis", 0), len(shape), ctx)
    return [TensorType(DType.INT64, _reduced_shape(shape, (axis,), bool(ctx.attr("keepdims", 1))))]


def _arg_compute(arg_fn: Callable):
    """ArgMax/ArgMin: the first index of the extreme value, or the last with select_last_index."""

    def compute(ctx, x):
        axis = normalize_axis(ctx.attr("axis", 0), x.ndim)
        xw = _widen(x)
        if ctx.opset >= 12 and ctx.attr("select_last_index", 0):
            idx = x.shape[axis] - 1 - arg_fn(np.flip(xw, axis), axis=axis)
        else:
            idx = arg_fn(xw, axis=axis)
        idx = np.asarray(idx, dtype=np.int64)
        return [np.expand_dims(idx, axis) if ctx.attr("keepdims", 1) else idx]

    return compute


register_op("ArgMax", infer=_arg_infer, compute=_arg_compute(np.argmax), doc="the index of the max along 'axis'")
register_op("ArgMin", infer=_arg_infer, compute=_arg_compute(np.argmin), doc="the index of the min along 'axis'")


# ---- TopK -------------------------------------------------------------------------------------
def _topk_infer(ctx):
    x = ctx.types[0]
    shape = require_shape(ctx, 0)
    axis = normalize_axis(ctx.attr("axis", -1), len(shape), ctx)
    if ctx.opset < 10:
        k = ctx.attr("k")
    else:
        ks = ints_of(ctx, 1)
        k = ctx.fresh_dim() if ks is None else simplify_dim(ks[0])
    if isinstance(k, int) and (k < 0 or (isinstance(shape[axis], int) and k > shape[axis])):
        raise fail(ctx, f"k={k} is out of range for axis {axis} of size {shape[axis]}")
    out = tuple(k if i == axis else d for i, d in enumerate(shape))
    return [TensorType(x.dtype, out), TensorType(DType.INT64, out)]


def _topk_order(x: np.ndarray, largest: bool) -> np.ndarray:
    """Indices sorting the last axis of x by value (descending when largest); equal values
    keep the lower index first."""
    if not largest:
        return np.argsort(x, axis=-1, kind="stable")
    n = x.shape[-1]
    # A stable ascending sort of the reversed row, read backwards: descending values with
    # ties in increasing original index (no negation, so unsigned ints are safe).
    return (n - 1 - np.argsort(x[..., ::-1], axis=-1, kind="stable"))[..., ::-1]


def _topk(ctx, x, k_input=None):
    axis = normalize_axis(ctx.attr("axis", -1), x.ndim)
    k = ctx.attr("k") if ctx.opset < 10 else _scalar_int(k_input)
    if not 0 <= k <= x.shape[axis]:
        raise ValueError(f"k={k} is out of range for axis {axis} of size {x.shape[axis]}")
    largest = bool(ctx.attr("largest", 1)) if ctx.opset >= 11 else True
    moved = np.moveaxis(x, axis, -1)
    order = _topk_order(_widen(moved), largest)[..., :k]
    values = np.take_along_axis(moved, order, axis=-1)
    return [np.moveaxis(values, -1, axis), np.moveaxis(order, -1, axis).astype(np.int64)]


register_op("TopK", infer=_topk_infer, compute=_topk,
            doc="the k largest (or smallest) entries along 'axis' and their indices")


# ---- CumSum, CumProd -------------------------------------------------------------------------
def _cumulative(ufunc: np.ufunc, identity: int):
    """CumSum/CumProd along the 'axis' input, with 'exclusive' and 'reverse'."""

    def compute(ctx, x, axis):
        ax = normalize_axis(_scalar_int(axis), x.ndim)
        xw = _widen(x)
        if ctx.attr("reverse", 0):
            xw = np.flip(xw, ax)
        if ctx.attr("exclusive", 0) and xw.shape[ax] > 0:
            first = np.full_like(np.take(xw, [0], axis=ax), identity)
            xw = np.concatenate([first, np.take(xw, np.arange(xw.shape[ax] - 1), axis=ax)], axis=ax)
        y = ufunc.accumulate(xw, axis=ax, dtype=xw.dtype)
        if ctx.attr("reverse", 0):
            y = np.flip(y, ax)
        return [y.astype(x.dtype, copy=False)]

    return compute


def _cumulative_infer(ctx):
    shape = require_shape(ctx, 0)
    axis = ints_of(ctx, 1)
    if axis is not None and isinstance(axis[0], int):
        normalize_axis(axis[0], len(shape), ctx)
    return [ctx.types[0]]


register_op("CumSum", infer=_cumulative_infer, compute=_cumulative(np.add, 0), doc="running sums along 'axis'")
register_op("CumProd", infer=_cumulative_infer, compute=_cumulative(np.multiply, 1),
            doc="running products along 'axis'")


# ---- GatherElements, GatherND -----------------------------------------------------------------
def _element_index(idx: np.ndarray, axis: int, dim: int) -> tuple:
    """The fancy index that addresses, for each entry of ``idx``, the element whose
    coordinate on ``axis`` is that entry and whose other coordinates are the entry's own."""
    idx = idx.astype(np.int64)
    idx = np.where(idx < 0, idx + dim, idx)
    grids = list(np.ogrid[tuple(slice(n) for n in idx.shape)])
    grids[axis] = idx
    return tuple(grids)


def _gather_elements_infer(ctx):
    data, idx = ctx.types[0], ctx.types[1]
    shape = require_shape(ctx, 0)
    normalize_axis(ctx.attr("axis", 0), len(shape), ctx)
    return [TensorType(data.dtype, idx.shape)]


def _gather_elements(ctx, data, indices):
    axis = normalize_axis(ctx.attr("axis", 0), data.ndim)
    return [data[_element_index(indices, axis, data.shape[axis])]]


register_op("GatherElements", infer=_gather_elements_infer, compute=_gather_elements,
            doc="data entries picked by indices along 'axis' (output shape = indices shape)")


def _gather_nd_infer(ctx):
    data = ctx.types[0]
    dshape = require_shape(ctx, 0)
    ishape = require_shape(ctx, 1)
    b = ctx.attr("batch_dims", 0)
    if not ishape or not isinstance(ishape[-1], int):
        return [TensorType(data.dtype, None)]
    k = ishape[-1]
    if b + k > len(dshape) or b >= min(len(dshape), len(ishape)):
        raise fail(ctx, f"indices of last dim {k} with batch_dims={b} do not fit data of rank {len(dshape)}")
    return [TensorType(data.dtype, tuple(ishape[:-1]) + tuple(dshape[b + k:]))]


def _gather_nd(ctx, data, indices):
    """data[batch, *index-tuple] for each index tuple of 'indices' (last axis), per batch."""
    b = ctx.attr("batch_dims", 0)
    k = indices.shape[-1]
    nb = int(np.prod(data.shape[:b], dtype=np.int64))
    m = int(np.prod(indices.shape[b:-1], dtype=np.int64))
    d = data.reshape((nb,) + data.shape[b:])
    idx = indices.astype(np.int64).reshape(nb, m, k)
    idx = np.where(idx < 0, idx + np.array(data.shape[b:b + k], dtype=np.int64), idx)
    picked = d[(np.arange(nb).reshape(nb, 1),) + tuple(idx[..., j] for j in range(k))]
    return [picked.reshape(indices.shape[:-1] + data.shape[b + k:])]


register_op("GatherND", infer=_gather_nd_infer, compute=_gather_nd,
            doc="slices of data addressed by the index tuples of 'indices' (with batch_dims)")


# ---- ScatterElements, ScatterND, Scatter ------------------------------------------------------
_SCATTER_UFUNCS = {"add": np.add, "mul": np.multiply, "max": np.maximum, "min": np.minimum}


def _scatter_reduction(ctx) -> str:
    return ctx.attr("reduction", "none") if ctx.opset >= 16 and ctx.node.op != "Scatter" else "none"


def _scatter_into(data: np.ndarray, index: tuple, updates: np.ndarray, reduction: str) -> np.ndarray:
    """A copy of data with updates written (or combined by 'reduction') at index."""
    out = _widen(data).copy()
    updates = updates.astype(out.dtype, copy=False)
    if reduction == "none":
        out[index] = updates
    elif reduction in _SCATTER_UFUNCS:
        _SCATTER_UFUNCS[reduction].at(out, index, updates)
    else:
        raise ValueError(f"unknown reduction {reduction!r}")
    return out.astype(data.dtype, copy=False)


def _scatter_elements_infer(ctx):
    shape = require_shape(ctx, 0)
    normalize_axis(ctx.attr("axis", 0), len(shape), ctx)
    return [ctx.types[0]]


def _scatter_elements(ctx, data, indices, updates):
    axis = normalize_axis(ctx.attr("axis", 0), data.ndim)
    index = _element_index(indices, axis, data.shape[axis])
    return [_scatter_into(data, index, updates, _scatter_reduction(ctx))]


register_op("ScatterElements", infer=_scatter_elements_infer, compute=_scatter_elements,
            doc="data with updates written at indices along 'axis' (reduction none/add/mul/max/min)")
register_op("Scatter", infer=_scatter_elements_infer, compute=_scatter_elements,
            doc="the deprecated form of ScatterElements (no reduction)")


def _scatter_nd(ctx, data, indices, updates):
    """data with updates written at the index tuples of 'indices' (last axis)."""
    k = indices.shape[-1]
    idx = indices.astype(np.int64).reshape(-1, k)
    idx = np.where(idx < 0, idx + np.array(data.shape[:k], dtype=np.int64), idx)
    upd = updates.reshape((idx.shape[0],) + data.shape[k:])
    index = tuple(idx[:, j] for j in range(k))
    return [_scatter_into(data, index, upd, _scatter_reduction(ctx))]


register_op("ScatterND", infer=same_as(0), compute=_scatter_nd,
            doc="data with update slices written at index tuples (reduction none/add/mul/max/min)")


# ---- OneHot, Trilu, EyeLike -------------------------------------------------------------------
def _onehot_infer(ctx):
    shape = require_shape(ctx, 0)
    axis = normalize_axis(ctx.attr("axis", -1), len(shape) + 1, ctx)
    depth = ctx.value(1)
    if depth is None:
        d = ctx.fresh_dim()
    elif is_symbolic(depth):
        d = simplify_dim(np.asarray(depth).ravel()[0])
    else:
        d = int(np.asarray(depth).ravel()[0])
    out = tuple(shape[:axis]) + (d,) + tuple(shape[axis:])
    return [TensorType(ctx.types[2].dtype, out)]


def _onehot(ctx, indices, depth, values):
    """values[1] where the index (negative counts from depth) equals the position on the
    new axis, values[0] elsewhere."""
    d = int(np.asarray(depth).ravel()[0])
    axis = normalize_axis(ctx.attr("axis", -1), indices.ndim + 1)
    idx = np.asarray(indices).astype(np.int64)
    if ctx.opset >= 11:
        idx = np.where(idx < 0, idx + d, idx)
    hot = np.moveaxis(idx[..., None] == np.arange(d), -1, axis)
    flat = np.asarray(values).ravel()
    return [np.where(hot, flat[1], flat[0]).astype(values.dtype)]


register_op("OneHot", infer=_onehot_infer, compute=_onehot, doc="one-hot encoding of indices along a new 'axis'")


def _trilu(ctx, x, k=None):
    kk = 0 if k is None else _scalar_int(k)
    return [np.triu(x, kk) if ctx.attr("upper", 1) else np.tril(x, kk)]


register_op("Trilu", infer=same_as(0), compute=_trilu, doc="the upper (or lower) triangle above diagonal k")


def _eyelike_dtype(ctx) -> DType:
    dtype = ctx.attr("dtype", None)
    return ctx.types[0].dtype if dtype is None else DType.from_onnx(dtype)


def _eyelike_infer(ctx):
    shape = require_shape(ctx, 0)
    if len(shape) != 2:
        raise fail(ctx, f"the input has rank {len(shape)}; EyeLike needs a matrix")
    return [TensorType(_eyelike_dtype(ctx), shape)]


def _eyelike(ctx, x):
    dtype = x.dtype if ctx.attr("dtype", None) is None else DType.from_onnx(ctx.attr("dtype")).numpy
    return [np.eye(x.shape[0], x.shape[1], k=ctx.attr("k", 0), dtype=dtype)]


register_op("EyeLike", infer=_eyelike_infer, compute=_eyelike, doc="ones on diagonal k, zeros elsewhere")


# ---- ReverseSequence, Det -------------------------------------------------------------------
def _reverse_sequence(ctx, x, sequence_lens):
    """For each batch entry b, the first sequence_lens[b] steps along the time axis reversed."""
    time_axis, batch_axis = ctx.attr("time_axis", 0), ctx.attr("batch_axis", 1)
    t = np.arange(x.shape[time_axis]).reshape(-1, 1)
    lens = np.asarray(sequence_lens, dtype=np.int64).reshape(1, -1)
    source = np.where(t < lens, lens - 1 - t, t)  # (time, batch)
    if time_axis > batch_axis:
        source = source.T
    shape = [1] * x.ndim
    shape[time_axis], shape[batch_axis] = x.shape[time_axis], x.shape[batch_axis]
    return [np.take_along_axis(x, source.reshape(shape), axis=time_axis)]


register_op("ReverseSequence", infer=same_as(0), compute=_reverse_sequence,
            doc="sequences reversed along the time axis up to each batch entry's length")


def _det_infer(ctx):
    shape = require_shape(ctx, 0)
    if len(shape) < 2:
        raise fail(ctx, f"the input has rank {len(shape)}; Det needs [*, M, M]")
    if isinstance(shape[-1], int) and isinstance(shape[-2], int) and shape[-1] != shape[-2]:
        raise fail(ctx, f"the matrices are {shape[-2]}x{shape[-1]}, not square")
    return [TensorType(ctx.types[0].dtype, tuple(shape[:-2]))]


register_op("Det", infer=_det_infer, compute=lambda ctx, x: [np.asarray(np.linalg.det(_widen(x))).astype(x.dtype)],
            doc="the determinant of each square matrix in the last two axes")


# ---- data-dependent sizes: NonZero, Compress, Unique, NonMaxSuppression ---------------------------
def _nonzero_infer(ctx):
    shape = require_shape(ctx, 0)
    return [TensorType(DType.INT64, (len(shape), ctx.fresh_dim()))]


def _nonzero(ctx, x):
    """The coordinates of the nonzero entries, one column each; (0, N) for a scalar."""
    xw = _widen(x)
    if x.ndim == 0:
        return [np.zeros((0, int(np.count_nonzero(xw))), dtype=np.int64)]
    return [np.array(np.nonzero(xw), dtype=np.int64).reshape(x.ndim, -1)]


register_op("NonZero", infer=_nonzero_infer, compute=_nonzero, doc="the indices of the nonzero entries")


def _compress_infer(ctx):
    shape = require_shape(ctx, 0)
    axis = ctx.attr("axis", None)
    cond = ctx.value(1)
    length = dim_product(shape) if axis is None else shape[normalize_axis(axis, len(shape), ctx)]
    if cond is not None and not is_symbolic(cond) and isinstance(length, int):
        kept = int(np.count_nonzero(np.asarray(cond).ravel()[:length]))
    else:
        kept = ctx.fresh_dim()
    if axis is None:
        return [TensorType(ctx.types[0].dtype, (kept,))]
    ax = normalize_axis(axis, len(shape), ctx)
    return [TensorType(ctx.types[0].dtype, tuple(kept if i == ax else d for i, d in enumerate(shape)))]


def _compress(ctx, x, condition):
    cond = np.asarray(condition, dtype=bool).ravel()
    axis = ctx.attr("axis", None)
    if axis is None:
        return [np.compress(cond, x.ravel())]
    return [np.compress(cond, x, axis=normalize_axis(axis, x.ndim))]


register_op("Compress", infer=_compress_infer, compute=_compress,
            doc="the slices along 'axis' (or entries of the flattened input) where condition is true")


def _unique_infer(ctx):
    x = ctx.types[0]
    shape = require_shape(ctx, 0)
    axis = ctx.attr("axis", None)
    n_unique = ctx.fresh_dim()
    if axis is None:
        y_shape, n_inverse = (n_unique,), dim_product(shape)
    else:
        ax = normalize_axis(axis, len(shape), ctx)
        y_shape = tuple(n_unique if i == ax else d for i, d in enumerate(shape))
        n_inverse = shape[ax]
    return [TensorType(x.dtype, y_shape), TensorType(DType.INT64, (n_unique,)),
            TensorType(DType.INT64, (n_inverse,)), TensorType(DType.INT64, (n_unique,))]


def _unique(ctx, x):
    """Unique values (or slices along 'axis'), sorted or in order of first occurrence, with
    the index of each one's first occurrence, the inverse map and the counts."""
    axis = ctx.attr("axis", None)
    ax = None if axis is None else normalize_axis(axis, x.ndim)
    source = x.ravel() if ax is None else x
    _, first, inverse, counts = np.unique(_widen(source), return_index=True, return_inverse=True,
                                          return_counts=True, axis=None if ax is None else ax)
    inverse = inverse.ravel()
    if not ctx.attr("sorted", 1):
        order = np.argsort(first, kind="stable")
        rank = np.empty_like(order)
        rank[order] = np.arange(order.size)
        first, counts, inverse = first[order], counts[order], rank[inverse]
    y = np.take(source, first, axis=0 if ax is None else ax)
    return [y, first.astype(np.int64), inverse.astype(np.int64), counts.astype(np.int64)]


register_op("Unique", infer=_unique_infer, compute=_unique, doc="the unique values or slices of x")


def _nms_infer(ctx):
    return [TensorType(DType.INT64, (ctx.fresh_dim(), 3))]


def _optional_scalar(value, default):
    if value is None or np.asarray(value).size == 0:
        return default
    return np.asarray(value).ravel()[0]


def _box_extents(boxes: np.ndarray, center_point_box: int) -> tuple[np.ndarray, ...]:
    """(x_min, x_max, y_min, y_max) of boxes [..., 4] given as corners or as centers."""
    if center_point_box:
        xc, yc, w, h = (boxes[..., i] for i in range(4))
        return xc - w / 2, xc + w / 2, yc - h / 2, yc + h / 2
    y1, x1, y2, x2 = (boxes[..., i] for i in range(4))
    return np.minimum(x1, x2), np.maximum(x1, x2), np.minimum(y1, y2), np.maximum(y1, y2)


def _suppressed(ext: tuple[np.ndarray, ...], i: int, others: np.ndarray, threshold) -> np.ndarray:
    """Which boxes ``others`` overlap box ``i`` with an IoU strictly above ``threshold``."""
    x0, x1, y0, y1 = ext
    ix0, ix1 = np.maximum(x0[i], x0[others]), np.minimum(x1[i], x1[others])
    iy0, iy1 = np.maximum(y0[i], y0[others]), np.minimum(y1[i], y1[others])
    inter = (ix1 - ix0) * (iy1 - iy0)
    area_i = (x1[i] - x0[i]) * (y1[i] - y0[i])
    area_o = (x1[others] - x0[others]) * (y1[others] - y0[others])
    union = area_i + area_o - inter
    valid = (ix1 > ix0) & (iy1 > iy0) & (inter > 0) & (area_i > 0) & (area_o > 0) & (union > 0)
    with np.errstate(all="ignore"):
        return valid & (inter / np.where(valid, union, 1) > threshold)


def _nms_select(ext, scores: np.ndarray, max_boxes: int, iou_threshold, score_threshold) -> list[int]:
    """Greedy NMS of one batch entry and class: the selected box indices in selection order."""
    candidates = np.arange(scores.size) if score_threshold is None else np.nonzero(scores > score_threshold)[0]
    remaining = candidates[np.argsort(-scores[candidates], kind="stable")]
    selected: list[int] = []
    while remaining.size and len(selected) < max_boxes:
        best, remaining = remaining[0], remaining[1:]
        selected.append(int(best))
        remaining = remaining[~_suppressed(ext, best, remaining, iou_threshold)]
    return selected


def _nms(ctx, boxes, scores, max_output=None, iou_threshold=None, score_threshold=None):
    """[batch, class, box] rows of the boxes greedy non-max suppression keeps, per batch
    and class, by descending score (ties: lower box index first)."""
    max_boxes = max(int(_optional_scalar(max_output, 0)), 0)
    iou_t = np.float32(_optional_scalar(iou_threshold, 0.0))
    score_t = _optional_scalar(score_threshold, None)
    score_t = None if score_t is None else np.float32(score_t)
    rows = []
    if max_boxes > 0:
        center = ctx.attr("center_point_box", 0)
        for b in range(boxes.shape[0]):
            ext = _box_extents(boxes[b].astype(np.float32), center)
            for c in range(scores.shape[1]):
                chosen = _nms_select(ext, scores[b, c].astype(np.float32), max_boxes, iou_t, score_t)
                rows.extend((b, c, i) for i in chosen)
    return [np.array(rows, dtype=np.int64).reshape(-1, 3)]


register_op("NonMaxSuppression", infer=_nms_infer, compute=_nms,
            doc="the [batch, class, box] indices kept by greedy non-max suppression")

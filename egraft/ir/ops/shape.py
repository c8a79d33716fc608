"""Shape ops and data movement that shape arithmetic flows through: Shape, Size,
Reshape, Flatten, Squeeze, Unsqueeze, Concat, Gather, Slice, Split, Expand, Tile,
Transpose, ConstantOfShape, Range.

These ops are ``symbolic``: inference evaluates them on known values whose entries may
be sympy dims, so ``Reshape(x, Concat(Shape(x)[0:1], [-1]))`` gets the type
``[batch, 12]`` rather than two unknown dims.
"""

from __future__ import annotations

import numpy as np
import sympy

from egraft.ir.dims import Dim, dim_product, simplify_dim
from egraft.ir.dtypes import DType
from egraft.ir.ops._common import fail, ints_of, is_symbolic, normalize_axis, require_shape, shape_list
from egraft.ir.registry import register_op
from egraft.ir.types import TensorType


# ---- Shape and Size ----------------------------------------------------------------------
def _shape_range(ctx, rank: int) -> tuple[int, int]:
    start = ctx.attr("start", 0) if ctx.opset >= 15 else 0
    end = ctx.attr("end", None) if ctx.opset >= 15 else None
    start = max(0, min(rank, start + rank if start < 0 else start))
    end = rank if end is None else max(0, min(rank, end + rank if end < 0 else end))
    return start, max(start, end)


def _shape_infer(ctx):
    shape = require_shape(ctx, 0)
    start, end = _shape_range(ctx, len(shape))
    return [TensorType(DType.INT64, (end - start,))]


def _shape(ctx, x):
    start, end = _shape_range(ctx, x.ndim)
    return [shape_list(x.shape[start:end])]


register_op("Shape", infer=_shape_infer, compute=_shape, symbolic=True, doc="the shape of x as an i64 vector")


def _size(ctx, x):
    size = x.size
    if isinstance(size, sympy.Basic) and not size.is_Integer:
        out = np.empty((), dtype=object)
        out[()] = simplify_dim(size)
        return [out]
    return [np.array(int(size), dtype=np.int64)]


register_op("Size", infer=lambda ctx: [TensorType(DType.INT64, ())], compute=_size, symbolic=True,
            doc="the number of elements of x")


# ---- Reshape and friends -------------------------------------------------------------------
def _reshape_dims(ctx, in_shape, target: list, allowzero: int) -> list[Dim]:
    out: list = []
    unknown = -1
    for i, d in enumerate(target):
        if isinstance(d, int | np.integer) and d == 0 and not allowzero:
            if i >= len(in_shape):
                raise fail(ctx, f"shape entry {i} is 0 (copy) but the input has rank {len(in_shape)}")
            out.append(in_shape[i])
        elif isinstance(d, int | np.integer) and d == -1:
            if unknown >= 0:
                raise fail(ctx, "the target shape has more than one -1")
            unknown = i
            out.append(None)
        else:
            out.append(simplify_dim(d))
    if unknown >= 0:
        known = dim_product([d for d in out if d is not None])
        total = dim_product(in_shape)
        if isinstance(known, int) and known == 0:
            out[unknown] = 0
        else:
            q = simplify_dim(sympy.sympify(total) / sympy.sympify(known))
            if isinstance(q, sympy.Rational) and not q.is_Integer:
                raise fail(ctx, f"cannot reshape {len(in_shape)}-D input of {total} elements into {target}")
            out[unknown] = q
    return out


def _reshape_infer(ctx):
    x = ctx.types[0]
    target = ints_of(ctx, 1)
    if target is None:
        rank_shape = require_shape(ctx, 1)
        if not isinstance(rank_shape[0], int):
            return [TensorType(x.dtype, None)]
        return [TensorType(x.dtype, tuple(ctx.fresh_dim() for _ in range(rank_shape[0])))]
    if x.shape is None:
        dims = tuple(ctx.fresh_dim() if isinstance(d, int) and d in (0, -1) else d for d in target)
        return [TensorType(x.dtype, dims)]
    dims = _reshape_dims(ctx, x.shape, target, ctx.attr("allowzero", 0))
    if all(isinstance(d, int) for d in dims) and all(isinstance(d, int) for d in x.shape):
        if dim_product(dims) != dim_product(x.shape):
            raise fail(ctx, f"cannot reshape {list(x.shape)} ({dim_product(x.shape)} elements) into {dims}")
    return [TensorType(x.dtype, tuple(dims))]


def _reshape(ctx, x, shape):
    target = [int(d) for d in np.asarray(shape).ravel()] if not is_symbolic(shape) else list(shape)
    if not ctx.attr("allowzero", 0):
        target = [x.shape[i] if (isinstance(d, int) and d == 0) else d for i, d in enumerate(target)]
    return [np.reshape(x, target)]


register_op("Reshape", infer=_reshape_infer, compute=_reshape, symbolic=True, doc="x with a new shape")


def _flatten_axis(axis: int, rank: int, ctx=None) -> int:
    """Flatten's axis lies in [-rank, rank]; a negative one counts from the end."""
    if not -rank <= axis <= rank:
        raise ValueError(f"axis {axis} is out of range for rank {rank}") if ctx is None else fail(
            ctx, f"axis {axis} is out of range for rank {rank}")
    return axis + rank if axis < 0 else axis


def _flatten_infer(ctx):
    shape = require_shape(ctx, 0)
    axis = _flatten_axis(ctx.attr("axis", 1), len(shape), ctx)
    return [TensorType(ctx.types[0].dtype, (dim_product(shape[:axis]), dim_product(shape[axis:])))]


def _flatten(ctx, x):
    axis = _flatten_axis(ctx.attr("axis", 1), x.ndim)
    return [np.reshape(x, (int(np.prod(x.shape[:axis])), int(np.prod(x.shape[axis:]))))]


register_op("Flatten", infer=_flatten_infer, compute=_flatten, symbolic=True, doc="x as a matrix split at 'axis'")


def _axes_arg(ctx, axes_input):
    """Axes from the 'axes' attribute (old opsets) or the second input (opset >= 13)."""
    if ctx.opset >= 13:
        return None if axes_input is None else [int(a) for a in np.asarray(axes_input).ravel()]
    axes = ctx.attr("axes", None)
    return None if axes is None else list(axes)


def _squeeze_axes(shape, axes, ctx=None):
    if axes is None:
        return [i for i, d in enumerate(shape) if isinstance(d, int) and d == 1]
    return sorted(normalize_axis(a, len(shape), ctx) for a in axes)


def _squeeze_infer(ctx):
    shape = require_shape(ctx, 0)
    axes = _axes_arg(ctx, ctx.value(1)) if ctx.opset >= 13 else _axes_arg(ctx, None)
    if ctx.opset >= 13 and ctx.has_input(1) and ctx.value(1) is None:
        return [TensorType(ctx.types[0].dtype, None)]  # which axes go is known only at run time
    if axes is None and not all(isinstance(d, int) for d in shape):
        return [TensorType(ctx.types[0].dtype, None)]  # which symbolic dims are 1 is known at run time
    norm = _squeeze_axes(shape, axes, ctx)
    for a in norm:
        if isinstance(shape[a], int) and shape[a] != 1:
            raise fail(ctx, f"cannot squeeze axis {a} of size {shape[a]}")
    return [TensorType(ctx.types[0].dtype, tuple(d for i, d in enumerate(shape) if i not in norm))]


def _squeeze(ctx, x, axes=None):
    norm = _squeeze_axes(x.shape, _axes_arg(ctx, axes))
    return [np.reshape(x, [d for i, d in enumerate(x.shape) if i not in norm])]


register_op("Squeeze", infer=_squeeze_infer, compute=_squeeze, symbolic=True, doc="x without size-1 axes")


def _unsqueeze_shape(shape, axes, ctx=None):
    rank = len(shape) + len(axes)
    norm = sorted(normalize_axis(a, rank, ctx) for a in axes)
    out = list(shape)
    for a in norm:
        out.insert(a, 1)
    return out


def _unsqueeze_infer(ctx):
    shape = require_shape(ctx, 0)
    axes = _axes_arg(ctx, ctx.value(1)) if ctx.opset >= 13 else _axes_arg(ctx, None)
    if axes is None:
        if ctx.has_input(1) and ctx.types[1].shape is not None and isinstance(ctx.types[1].shape[0], int):
            # The new axes are known only at run time; the rank is known.
            rank = len(shape) + ctx.types[1].shape[0]
            return [TensorType(ctx.types[0].dtype, tuple(ctx.fresh_dim() for _ in range(rank)))]
        if ctx.has_input(1) and ctx.types[1].shape == ():
            return [TensorType(ctx.types[0].dtype, tuple(ctx.fresh_dim() for _ in range(len(shape) + 1)))]
        raise fail(ctx, "the axes are not known at compile time")
    return [TensorType(ctx.types[0].dtype, tuple(_unsqueeze_shape(shape, axes, ctx)))]


def _unsqueeze(ctx, x, axes=None):
    return [np.reshape(x, _unsqueeze_shape(x.shape, _axes_arg(ctx, axes)))]


register_op("Unsqueeze", infer=_unsqueeze_infer, compute=_unsqueeze, symbolic=True, doc="x with new size-1 axes")


# ---- Concat, Split, Gather, Slice -----------------------------------------------------------
def _concat_infer(ctx):
    present = [t for t in ctx.types if t is not None]
    shapes = [t.shape for t in present]
    if any(s is None for s in shapes):
        return [TensorType(present[0].dtype, None)]
    rank = len(shapes[0])
    axis = normalize_axis(ctx.attr("axis"), rank, ctx)
    out = list(shapes[0])
    out[axis] = simplify_dim(sum(sympy.sympify(s[axis]) for s in shapes))
    for s in shapes:
        if len(s) != rank:
            raise fail(ctx, f"inputs have ranks {[len(x) for x in shapes]}; Concat needs equal ranks")
    return [TensorType(present[0].dtype, tuple(out))]


def _concat(ctx, *xs):
    xs = [x for x in xs if x is not None]
    axis = ctx.attr("axis")
    if is_symbolic(*xs):
        xs = [np.asarray(x, dtype=object) for x in xs]
    return [np.concatenate(xs, axis=axis)]


register_op("Concat", infer=_concat_infer, compute=_concat, symbolic=True, doc="inputs joined along 'axis'")


def _gather_infer(ctx):
    data, idx = ctx.types[0], ctx.types[1]
    shape = require_shape(ctx, 0)
    axis = normalize_axis(ctx.attr("axis", 0), len(shape), ctx)
    if idx.shape is None:
        return [TensorType(data.dtype, None)]
    return [TensorType(data.dtype, tuple(shape[:axis]) + tuple(idx.shape) + tuple(shape[axis + 1:]))]


def _gather(ctx, data, indices):
    axis = normalize_axis(ctx.attr("axis", 0), data.ndim)
    indices = np.asarray(indices)
    if indices.dtype == object:
        indices = indices.astype(np.int64)
    indices = indices.astype(np.int64)
    return [np.take(data, np.where(indices < 0, indices + data.shape[axis], indices), axis=axis)]


register_op("Gather", infer=_gather_infer, compute=_gather, symbolic=True, doc="entries of data along 'axis'")


def _slice_params(ctx, rank, starts, ends, axes, steps):
    starts = list(starts)
    ends = list(ends)
    axes = list(range(len(starts))) if axes is None else [normalize_axis(int(a), rank) for a in axes]
    steps = [1] * len(starts) if steps is None else [int(s) for s in steps]
    return starts, ends, axes, steps


def _slice_args(ctx, values):
    """(starts, ends, axes, steps) from attributes (opset < 10) or inputs."""
    if ctx.opset < 10:
        return ctx.attr("starts"), ctx.attr("ends"), ctx.attr("axes", None), None
    starts, ends = values[0], values[1]
    axes = values[2] if len(values) > 2 else None
    steps = values[3] if len(values) > 3 else None
    return starts, ends, axes, steps


def _slice_dim(d, start, end, step):
    """The length of ``d[start:end:step]``; any of them may be symbolic.

    Static operands clamp exactly as ONNX says. A symbolic end (``x[:seq]`` with ``seq``
    taken from another tensor's shape) is assumed in bounds; the executor checks the
    actual length at run time, so a wrong assumption fails loudly.
    """
    if all(isinstance(v, int) for v in (d, start, end, step)):
        return len(range(*onnx_slice(start, end, step, d).indices(d)))
    if not isinstance(step, int) or step <= 0:
        raise ValueError("negative or symbolic steps over symbolic operands")
    big = 2**62
    begin = start + d if isinstance(start, int) and start < 0 else start
    if isinstance(end, int) and end >= big // 2:
        stop = d
    elif isinstance(end, int) and end < 0:
        stop = end + d
    elif isinstance(end, int):
        stop = sympy.Min(end, d)  # an int end on a symbolic dim clamps
    else:
        stop = end
    length = sympy.sympify(stop) - begin
    return simplify_dim(length if step == 1 else sympy.ceiling(length / step))


def _slice_infer(ctx):
    shape = require_shape(ctx, 0)
    vals = [ctx.value(i) for i in range(1, ctx.num_inputs)]
    if ctx.opset >= 10 and (vals[0] is None or vals[1] is None or any(
            ctx.has_input(i + 1) and vals[i] is None for i in range(2, len(vals)))):
        n = ctx.types[1].shape[0] if ctx.types[1].shape else None
        out = list(shape)
        if ctx.has_input(3):  # explicit axes
            axes = ctx.value(3)
            if axes is None:  # any axis may be cut
                out = [ctx.fresh_dim() for _ in shape]
            else:
                for a in np.asarray(axes).ravel():
                    out[normalize_axis(int(a), len(shape))] = ctx.fresh_dim()
        elif isinstance(n, int):  # the first n axes
            for a in range(n):
                out[a] = ctx.fresh_dim()
        else:
            out = [ctx.fresh_dim() for _ in shape]
        return [TensorType(ctx.types[0].dtype, tuple(out))]
    starts, ends, axes, steps = _slice_args(ctx, vals)
    starts, ends, axes, steps = _slice_params(ctx, len(shape), np.asarray(starts).ravel().tolist(),
                                              np.asarray(ends).ravel().tolist(),
                                              None if axes is None else np.asarray(axes).ravel().tolist(),
                                              None if steps is None else np.asarray(steps).ravel().tolist())
    out = list(shape)
    for s, e, a, st in zip(starts, ends, axes, steps):
        try:
            out[a] = _slice_dim(shape[a], s, e, st)
        except (ValueError, TypeError):
            out[a] = ctx.fresh_dim()
    return [TensorType(ctx.types[0].dtype, tuple(out))]


def _slice(ctx, x, *rest):
    starts, ends, axes, steps = _slice_args(ctx, list(rest))
    starts, ends, axes, steps = _slice_params(ctx, x.ndim, np.asarray(starts).ravel().tolist(),
                                              np.asarray(ends).ravel().tolist(),
                                              None if axes is None else np.asarray(axes).ravel().tolist(),
                                              None if steps is None else np.asarray(steps).ravel().tolist())
    index = [slice(None)] * x.ndim
    for s, e, a, st in zip(starts, ends, axes, steps):
        index[a] = onnx_slice(int(s), int(e), int(st), x.shape[a])
    return [x[tuple(index)]]


def onnx_slice(start: int, end: int, step: int, dim: int) -> slice:
    """The Python slice of ONNX's ``start:end:step`` on an axis of ``dim`` elements.

    ONNX clamps after adding ``dim`` to negative indices: start to [0, dim-1] and end to
    [-1, dim-1] when stepping back, where -1 means "past the first element" (a Python -1
    would mean the last one: ``x[3:-1:-1]`` is empty, ONNX's reversal is not).

    Example:
        >>> onnx_slice(-1, -2**63 + 1, -1, 4), onnx_slice(0, 2**63 - 1, 2, 5)
        (slice(3, None, -1), slice(0, 5, 2))
    """
    if start < 0:
        start += dim
    if end < 0:
        end += dim
    if step > 0:
        return slice(min(max(start, 0), dim), min(max(end, 0), dim), step)
    start, end = min(max(start, 0), dim - 1), min(max(end, -1), dim - 1)
    return slice(start, None if end < 0 else end, step)


register_op("Slice", infer=_slice_infer, compute=_slice, symbolic=True, doc="x[starts:ends:steps] on 'axes'")


def _split_sizes(ctx, dim, split, n_out):
    if split is not None:
        return [simplify_dim(s) for s in split]
    num = ctx.attr("num_outputs", None) if ctx.opset >= 18 else None
    n = num or n_out
    if isinstance(dim, int):
        if num is not None and dim % n:
            chunk = -(-dim // n)
            return [chunk] * (n - 1) + [dim - chunk * (n - 1)]
        return [dim // n] * n
    return [simplify_dim(sympy.sympify(dim) / n)] * n


def _split_arg(ctx, values):
    if ctx.opset >= 13:
        if values is None:
            return None
        return [x if isinstance(x, sympy.Basic) else int(x) for x in np.asarray(values).ravel()]
    s = ctx.attr("split", None)
    return None if s is None else list(s)


def _split_infer(ctx):
    shape = require_shape(ctx, 0)
    axis = normalize_axis(ctx.attr("axis", 0), len(shape), ctx)
    if ctx.opset >= 13 and ctx.has_input(1) and ctx.value(1) is None:
        return [TensorType(ctx.types[0].dtype, tuple(ctx.fresh_dim() if i == axis else d for i, d in enumerate(shape)))
                for _ in range(ctx.num_outputs)]
    sizes = _split_sizes(ctx, shape[axis], _split_arg(ctx, ctx.value(1)), ctx.num_outputs)
    return [TensorType(ctx.types[0].dtype, tuple(s if i == axis else d for i, d in enumerate(shape))) for s in sizes]


def _split(ctx, x, split=None):
    axis = normalize_axis(ctx.attr("axis", 0), x.ndim)
    sizes = _split_sizes(ctx, x.shape[axis], _split_arg(ctx, split), ctx.num_outputs)
    bounds = np.cumsum([0] + [int(s) for s in sizes])
    return [np.take(x, np.arange(bounds[i], bounds[i + 1]), axis=axis) for i in range(len(sizes))]


register_op("Split", infer=_split_infer, compute=_split, symbolic=True, doc="x cut into pieces along 'axis'")


# ---- Expand, Tile, Transpose, ConstantOfShape, Range ------------------------------------------
def _expand_infer(ctx):
    from egraft.ir.dims import broadcast_shapes

    x = ctx.types[0]
    target = ints_of(ctx, 1)
    if target is None:
        n = require_shape(ctx, 1)[0]
        if not isinstance(n, int):
            return [TensorType(x.dtype, None)]
        rank = max(n, len(x.shape))
        return [TensorType(x.dtype, tuple(ctx.fresh_dim() for _ in range(rank)))]
    try:
        return [TensorType(x.dtype, broadcast_shapes(x.shape, tuple(simplify_dim(d) for d in target)))]
    except ValueError as e:
        raise fail(ctx, str(e)) from None


def _expand(ctx, x, shape):
    target = np.broadcast_shapes(x.shape, tuple(int(d) for d in np.asarray(shape).ravel()))
    return [np.broadcast_to(x, target).copy()]


register_op("Expand", infer=_expand_infer, compute=_expand, doc="x broadcast to 'shape'")


def _tile_infer(ctx):
    shape = require_shape(ctx, 0)
    reps = ints_of(ctx, 1)
    if reps is None:
        return [TensorType(ctx.types[0].dtype, tuple(ctx.fresh_dim() for _ in shape))]
    return [TensorType(ctx.types[0].dtype, tuple(simplify_dim(d * r) for d, r in zip(shape, reps)))]


register_op("Tile", infer=_tile_infer, compute=lambda ctx, x, reps: [np.tile(x, [int(r) for r in reps])],
            doc="x repeated 'repeats' times per axis")


def _perm(ctx, rank):
    perm = ctx.attr("perm", None)
    return list(range(rank))[::-1] if perm is None else [normalize_axis(p, rank) for p in perm]


def _transpose_infer(ctx):
    if ctx.types[0].shape is None and ctx.attr("perm", None) is not None:
        return [TensorType(ctx.types[0].dtype, tuple(ctx.fresh_dim() for _ in ctx.attr("perm")))]
    shape = require_shape(ctx, 0)
    perm = _perm(ctx, len(shape))
    if sorted(perm) != list(range(len(shape))):
        raise fail(ctx, f"perm {perm} is not a permutation of the {len(shape)} axes")
    return [TensorType(ctx.types[0].dtype, tuple(shape[p] for p in perm))]


register_op("Transpose", infer=_transpose_infer, compute=lambda ctx, x: [np.transpose(x, _perm(ctx, x.ndim))],
            symbolic=True, doc="x with its axes permuted by 'perm'")


def _cos_value(ctx):
    value = ctx.attr("value", None)
    return np.zeros(1, np.float32) if value is None else np.asarray(value)


def _constant_of_shape_infer(ctx):
    dtype = DType.from_numpy(_cos_value(ctx).dtype)
    shape = ints_of(ctx, 0)
    if shape is None:
        n = require_shape(ctx, 0)[0]
        if not isinstance(n, int):
            return [TensorType(dtype, None)]
        return [TensorType(dtype, tuple(ctx.fresh_dim() for _ in range(n)))]
    return [TensorType(dtype, tuple(simplify_dim(d) for d in shape))]


def _constant_of_shape(ctx, shape):
    value = _cos_value(ctx)
    return [np.full([int(d) for d in np.asarray(shape).ravel()], value.ravel()[0], dtype=value.dtype)]


register_op("ConstantOfShape", infer=_constant_of_shape_infer, compute=_constant_of_shape,
            doc="a tensor of 'shape' filled with 'value'")


def _range_infer(ctx):
    dtype = ctx.types[0].dtype
    vals = [ctx.value(i) for i in range(3)]
    if any(v is None for v in vals) or any(is_symbolic(v) for v in vals):
        return [TensorType(dtype, (ctx.fresh_dim(),))]
    start, limit, delta = (np.asarray(v).item() for v in vals)
    return [TensorType(dtype, (max(int(np.ceil((limit - start) / delta)), 0),))]


def _range(ctx, start, limit, delta):
    n = max(int(np.ceil((limit.item() - start.item()) / delta.item())), 0)
    return [(start + np.arange(n).astype(start.dtype) * delta).astype(start.dtype)]


register_op("Range", infer=_range_infer, compute=_range, doc="start, start+delta, ... below limit")

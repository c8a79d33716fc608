"""CUDA kernels of the index-addressed ops: GatherElements, GatherND, ScatterElements (and the
deprecated Scatter) and ScatterND, over symbolic dims.

The gathers are one thread per output element, a grid-stride loop of 256-thread blocks:
consecutive threads write consecutive outputs and read their indices coalesced; the data
read is where the indices point. Negative indices wrap once; an index still out of range
is clamped (a gather never reads outside ``data``).

A scatter is two functions run in order: a vectorised copy of ``data`` into the output,
then the updates. Updates that can land on the same element are applied by one thread,
in index order, so the result is deterministic and equals the reference's (numpy's
``out[index] = updates`` and ``ufunc.at``, which apply updates in order: the last of
several writes wins; add and mul accumulate in order):

- ScatterElements: a *line* is the updates that share every coordinate but ``axis``; only
  updates of one line can collide. One thread per line walks it along ``axis``;
  consecutive threads own neighbouring lines, so each step's reads coalesce (when ``axis``
  is not the innermost axis).
- ScatterND: the tuples address slices of ``prod(data.shape[k:])`` elements; one thread per
  position in a slice walks every tuple in order.

When the indices are a constant with no collision (checked while generating code), order
cannot matter and every update gets its own thread. With computed indices, the
parallelism is the number of lines (slice positions): a scatter of many updates into few
lines (``ScatterND`` of single elements, a message-passing sum over edges along axis 0)
runs long serial loops; no atomics are used. An index out of range after wrapping is
skipped.

Example:
    >>> kernel = generate(scatter_node, graph, 18)       # doctest: +SKIP
    >>> [launch.function for launch in kernel.launches]  # doctest: +SKIP
    ['eg_scatter_elements_copy', 'eg_scatter_elements']
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from egraft.ir.dtypes import DType
from egraft.kernels.cuda import register_kernel
from egraft.kernels.cuda.elementwise import (
    Operand,
    c_dim,
    decompose,
    dims_product,
    emit_broadcast,
    grid_stride,
    indent,
    static_int,
)
from egraft.kernels.cuda.emit import CudaContext, Unsupported

#: The reductions a scatter may apply (opset 16 adds add and mul, 18 max and min).
REDUCTIONS = ("none", "add", "mul", "max", "min")
#: Element types a scatter reduction combines (any type is copied).
REDUCIBLE = (DType.FLOAT32, DType.FLOAT64, DType.INT64, DType.INT32)


# ---- shared pieces --------------------------------------------------------------------------------
def strides_of(shape: Sequence) -> list:
    """Row-major element strides of ``shape`` (ints or sympy expressions).

    Example:
        >>> strides_of([2, 3, 4])
        [12, 4, 1]
    """
    return [dims_product(shape[k + 1:]) for k in range(len(shape))]


def normalize_axis(axis: int, rank: int) -> int:
    """``axis`` counted from 0; ``Unsupported`` when out of range.

    Example:
        >>> normalize_axis(-1, 3)
        2
    """
    if not -rank <= axis < max(rank, 1):
        raise Unsupported(f"axis {axis} for rank {rank}")
    return axis + rank if axis < 0 else axis


def require_indices(ctx: CudaContext, slot: int) -> None:
    """``Unsupported`` unless input ``slot`` holds int64 or int32 indices."""
    if ctx.in_dtype(slot) not in (DType.INT64, DType.INT32):
        raise Unsupported(f"{ctx.node.op} indices of {ctx.in_dtype(slot).short}")


def wrapped_index(pointer: str, offset: str, size: str, name: str) -> str:
    """A statement declaring ``name``: ``pointer[offset]`` as ``long long`` (an index never
    truncates), plus ``size`` when negative.

    Example:
        >>> wrapped_index("x1", "i", "5", "j")
        'long long j = (long long)x1[i]; j = j < 0 ? j + 5 : j;'
    """
    return f"long long {name} = (long long){pointer}[{offset}]; {name} = {name} < 0 ? {name} + {size} : {name};"


def clamped(name: str, size: str) -> str:
    """A statement clamping ``name`` into ``[0, size)`` (a gather never reads outside ``data``).

    Example:
        >>> clamped("j", "5")
        'j = j < 0 ? 0 : (j >= 5 ? 5 - 1 : j);'
    """
    return f"{name} = {name} < 0 ? 0 : ({name} >= {size} ? {size} - 1 : {name});"


def combine(reduction: str, old: str, new: str) -> str:
    """The C expression of ``old`` combined with ``new`` as numpy's ufuncs do (``max`` and
    ``min`` propagate NaN: ``u != u`` is false for integers).

    Example:
        >>> combine("add", "o", "u"), combine("max", "o", "u")
        ('o + u', '(u != u || u > o) ? u : o')
    """
    if reduction == "none":
        return new
    if reduction == "add":
        return f"{old} + {new}"
    if reduction == "mul":
        return f"{old} * {new}"
    if reduction == "max":
        return f"({new} != {new} || {new} > {old}) ? {new} : {old}"
    if reduction == "min":
        return f"({new} != {new} || {new} < {old}) ? {new} : {old}"
    raise Unsupported(f"reduction {reduction!r}")


# ---- gathers -----------------------------------------------------------------------------------------
@register_kernel("GatherElements")
def gather_elements(ctx: CudaContext) -> None:
    """``y[c] = data[c with c[axis] = indices[c]]`` over the indices' shape (the data may be
    larger on the other axes).

    Example:
        >>> generate(gather_elements_node, graph, 17).launches[0].function    # doctest: +SKIP
        'eg_gather_elements'
    """
    require_indices(ctx, 1)
    shape, index_shape = ctx.in_shape(0), ctx.in_shape(1)
    rank = len(shape)
    if len(index_shape) != rank:
        raise Unsupported(f"indices of rank {len(index_shape)} for data of rank {rank}")
    axis = normalize_axis(ctx.attr("axis", 0), rank)
    x, indices, y = ctx.x(0), ctx.x(1), ctx.y(0)
    strides = strides_of(shape)

    def body(itype: str) -> list[str]:
        size = c_dim(ctx, shape[axis], itype)
        terms = [f"c{k} * {c_dim(ctx, strides[k], itype)}" for k in range(rank) if k != axis]
        terms.append(f"j * {c_dim(ctx, strides[axis], itype)}")
        return [*decompose(ctx, index_shape, itype), wrapped_index(indices, "i", size, "j"),
                clamped("j", size), f"{y}[i] = {x}[{' + '.join(terms)}];"]

    grid_stride(ctx, "eg_gather_elements", dims_product(index_shape), [dims_product(shape)], body)


@register_kernel("GatherND")
def gather_nd(ctx: CudaContext) -> None:
    """``y[b, q, r] = data[b, *indices[b, q, :], r]``: per output element, its tuple's ``k``
    indices (shared by the ``r`` run, so cached) and one read.

    Example:
        >>> generate(gather_nd_node, graph, 17).launches[0].function    # doctest: +SKIP
        'eg_gather_nd'
    """
    require_indices(ctx, 1)
    shape, index_shape = ctx.in_shape(0), ctx.in_shape(1)
    b = int(ctx.attr("batch_dims", 0))
    if not index_shape or static_int(index_shape[-1]) is None:
        raise Unsupported("GatherND whose tuples' length (the indices' last dim) is not static")
    k = static_int(index_shape[-1])
    if b + k > len(shape) or b >= len(index_shape):
        raise Unsupported(f"GatherND of {k}-tuples with batch_dims={b} on data of rank {len(shape)}")
    tuples_per_batch = dims_product(index_shape[b:-1])
    run = dims_product(shape[b + k:])
    batch_stride = dims_product(shape[b:])
    strides = strides_of(shape[b:])
    x, indices, y = ctx.x(0), ctx.x(1), ctx.y(0)

    def body(itype: str) -> list[str]:
        def c(d) -> str:
            return c_dim(ctx, d, itype)

        lines = [f"const {itype} t = i / {c(run)}, r = i - t * {c(run)};"]
        terms = ["r"]
        if b:
            lines.append(f"const {itype} batch = t / {c(tuples_per_batch)};")
            terms.append(f"batch * {c(batch_stride)}")
        for j in range(k):
            size = c(shape[b + j])
            lines += [wrapped_index(indices, f"t * {k} + {j}", size, f"j{j}"), clamped(f"j{j}", size)]
            terms.append(f"j{j} * {c(strides[j])}")
        return [*lines, f"{y}[i] = {x}[{' + '.join(terms)}];"]

    grid_stride(ctx, "eg_gather_nd", dims_product(ctx.out_shape(0)), [dims_product(shape), dims_product(index_shape)],
                body)


# ---- scatters ----------------------------------------------------------------------------------------
def _reduction(ctx: CudaContext) -> str:
    if ctx.node.op == "Scatter" or ctx.opset < 16:
        return "none"
    reduction = ctx.attr("reduction", "none") or "none"
    reduction = reduction.decode() if isinstance(reduction, bytes) else reduction
    if reduction not in REDUCTIONS:
        raise Unsupported(f"reduction {reduction!r}")
    dtype = ctx.out_dtype(0)
    if reduction != "none" and dtype not in REDUCIBLE:
        raise Unsupported(f"{ctx.node.op} reduction {reduction} of {dtype.short}")
    return reduction


def _copy_data(ctx: CudaContext, name: str) -> None:
    """The output starts as a copy of ``data`` (the vectorised elementwise copy)."""
    ctx.ctype(ctx.in_dtype(0))
    if ctx.in_dtype(0) != ctx.out_dtype(0) or ctx.in_dtype(2) != ctx.out_dtype(0):
        raise Unsupported(f"{ctx.node.op} of {ctx.in_dtype(2).short} updates into {ctx.in_dtype(0).short}")
    emit_broadcast(ctx, f"{name}_copy", [Operand(0, tuple(ctx.out_shape(0)))], "a0")


def _constant_wrapped(ctx: CudaContext, slot: int, sizes: Sequence) -> np.ndarray | None:
    """Constant indices as int64 with negative ones wrapped (``sizes``: per index position,
    broadcast against the indices); ``None`` when computed or when a negative one meets a
    symbolic size."""
    value = ctx.constant(slot)
    if value is None:
        return None
    value = np.asarray(value, np.int64)
    if (value < 0).any() and any(static_int(s) is None for s in sizes):
        return None
    bound = np.array([static_int(s) or 0 for s in sizes], np.int64)
    return np.where(value < 0, value + bound, value)


@register_kernel("ScatterElements", "Scatter")
def scatter_elements(ctx: CudaContext) -> None:
    """The data, then the updates in order along ``axis`` (see the module docstring).

    Example:
        >>> [l.function for l in generate(scatter_node, graph, 18).launches]   # doctest: +SKIP
        ['eg_scatter_elements_copy', 'eg_scatter_elements']
    """
    require_indices(ctx, 1)
    shape, index_shape = ctx.in_shape(0), ctx.in_shape(1)
    rank = len(shape)
    if len(index_shape) != rank:
        raise Unsupported(f"indices of rank {len(index_shape)} for data of rank {rank}")
    axis = normalize_axis(ctx.attr("axis", 0), rank)
    reduction = _reduction(ctx)
    _copy_data(ctx, "eg_scatter_elements")
    constant = _constant_wrapped(ctx, 1, [shape[axis]])
    collide = constant is None or _collides_along(constant, axis)
    data_strides, update_strides = strides_of(shape), strides_of(index_shape)
    ctype = ctx.ctype(ctx.out_dtype(0))
    indices, updates, y = ctx.x(1), ctx.x(2), ctx.y(0)

    def update(itype: str, offset: str) -> list[str]:
        size = c_dim(ctx, shape[axis], itype)
        target = f"{y}[base + j * {c_dim(ctx, data_strides[axis], itype)}]"
        return [wrapped_index(indices, offset, size, "j"),
                f"if (j >= 0 && j < {size}) {{",
                f"    const {ctype} o = {target}, u = {updates}[{offset}];",
                f"    {target} = {combine(reduction, 'o', 'u')};",
                "}"]

    def base(itype: str, coords: Sequence[int], data: bool) -> str:
        strides = data_strides if data else update_strides
        terms = [f"c{k} * {c_dim(ctx, strides[k], itype)}" for k in coords]
        return " + ".join(terms) or "0"

    others = [k for k in range(rank) if k != axis]
    if not collide:  # every update has its own thread
        def body(itype: str) -> list[str]:
            return [*decompose(ctx, index_shape, itype), f"const {itype} base = {base(itype, others, True)};",
                    *update(itype, "i")]

        grid_stride(ctx, "eg_scatter_elements", dims_product(index_shape), [dims_product(shape)], body)
        return

    def line(itype: str) -> list[str]:
        return [*_decompose_named(ctx, [index_shape[k] for k in others], others, itype),
                f"const {itype} base = {base(itype, others, True)};",
                f"const {itype} first = {base(itype, others, False)};",
                f"for ({itype} t = 0; t < {c_dim(ctx, index_shape[axis], itype)}; ++t) {{",
                indent(update(itype, f"first + t * {c_dim(ctx, update_strides[axis], itype)}")),
                "}"]

    lines = dims_product([index_shape[k] for k in others])
    grid_stride(ctx, "eg_scatter_elements", lines, [dims_product(shape), dims_product(index_shape)], line)


def _decompose_named(ctx: CudaContext, dims: Sequence, names: Sequence[int], itype: str) -> list[str]:
    """:func:`decompose` of ``i`` over ``dims`` into coordinates named ``c<names[k]>``."""
    lines = decompose(ctx, dims, itype, prefix="q")
    return lines + [f"const {itype} c{n} = q{k};" for k, n in enumerate(names)]


def _collides_along(indices: np.ndarray, axis: int) -> bool:
    """Whether two entries of one line of ``indices`` (along ``axis``) are equal.

    Example:
        >>> _collides_along(np.array([[0, 1], [0, 2]]), 0), _collides_along(np.array([[0, 1], [1, 0]]), 0)
        (True, False)
    """
    if indices.size == 0:
        return False
    ordered = np.sort(indices, axis=axis)
    return bool((np.diff(ordered, axis=axis) == 0).any())


@register_kernel("ScatterND")
def scatter_nd(ctx: CudaContext) -> None:
    """The data, then each tuple's slice of updates in order (see the module docstring).

    Example:
        >>> [l.function for l in generate(scatter_nd_node, graph, 18).launches]   # doctest: +SKIP
        ['eg_scatter_nd_copy', 'eg_scatter_nd']
    """
    require_indices(ctx, 1)
    shape, index_shape = ctx.in_shape(0), ctx.in_shape(1)
    if not index_shape or static_int(index_shape[-1]) is None:
        raise Unsupported("ScatterND whose tuples' length (the indices' last dim) is not static")
    k = static_int(index_shape[-1])
    if k > len(shape):
        raise Unsupported(f"ScatterND of {k}-tuples on data of rank {len(shape)}")
    reduction = _reduction(ctx)
    _copy_data(ctx, "eg_scatter_nd")
    tuples, run = dims_product(index_shape[:-1]), dims_product(shape[k:])
    strides = strides_of(shape)
    constant = _constant_wrapped(ctx, 1, shape[:k])
    collide = constant is None or _tuples_repeat(constant.reshape(-1, k))
    ctype = ctx.ctype(ctx.out_dtype(0))
    indices, updates, y = ctx.x(1), ctx.x(2), ctx.y(0)

    def update(itype: str, t: str, r: str) -> list[str]:
        lines, inside, terms = [], [], [r]
        for j in range(k):
            size = c_dim(ctx, shape[j], itype)
            lines.append(wrapped_index(indices, f"{t} * {k} + {j}", size, f"j{j}"))
            inside.append(f"j{j} >= 0 && j{j} < {size}")
            terms.append(f"j{j} * {c_dim(ctx, strides[j], itype)}")
        target = f"{y}[{' + '.join(terms)}]"
        return [*lines, f"if ({' && '.join(inside) or 'true'}) {{",
                f"    const {ctype} o = {target}, u = {updates}[{t} * {c_dim(ctx, run, itype)} + {r}];",
                f"    {target} = {combine(reduction, 'o', 'u')};",
                "}"]

    if not collide:  # every (tuple, position) has its own thread
        def body(itype: str) -> list[str]:
            return [f"const {itype} t = i / {c_dim(ctx, run, itype)}, r = i - t * {c_dim(ctx, run, itype)};",
                    *update(itype, "t", "r")]

        grid_stride(ctx, "eg_scatter_nd", dims_product([tuples, run]), [dims_product(shape), dims_product(index_shape)],
                    body)
        return

    def position(itype: str) -> list[str]:
        return [f"for ({itype} t = 0; t < {c_dim(ctx, tuples, itype)}; ++t) {{",
                indent(update(itype, "t", "i")), "}"]

    counts = [dims_product(shape), dims_product([tuples, run]), dims_product(index_shape)]
    grid_stride(ctx, "eg_scatter_nd", run, counts, position)


def _tuples_repeat(tuples: np.ndarray) -> bool:
    """Whether two rows of ``tuples`` are equal.

    Example:
        >>> _tuples_repeat(np.array([[0, 1], [1, 0]])), _tuples_repeat(np.array([[0, 1], [0, 1]]))
        (False, True)
    """
    return len(np.unique(tuples, axis=0)) != len(tuples)


__all__ = ["gather_elements", "gather_nd", "scatter_elements", "scatter_nd", "grid_stride", "combine", "strides_of",
           "REDUCTIONS"]

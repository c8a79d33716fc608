"""Index-addressed gathers and scatters: GatherND, ScatterElements (and the deprecated
Scatter), ScatterND, over symbolic dims.

- ``GatherND``: for each index tuple of ``indices`` (its last axis, ``k`` entries, per batch
  when ``batch_dims`` > 0), one contiguous run of ``prod(data.shape[batch_dims + k:])``
  elements is copied.
- ``ScatterElements``: the output starts as a copy of ``data``; each entry of ``updates`` is
  written (or combined: ``add``, ``mul``, ``max``, ``min``) at its own coordinates with the one
  on ``axis`` replaced by the matching entry of ``indices``.
- ``ScatterND``: the output starts as a copy of ``data``; each index tuple addresses a run of
  ``prod(data.shape[k:])`` elements that the matching slice of ``updates`` is written into
  (or combined with).

Indices are int32 or int64, computed or constant; negative ones count from the end. An index
still out of range after that is clamped by the gathers (they never read outside ``data``) and
skipped by the scatters (they never write outside the output). Updates are applied in order,
so with ``reduction="none"`` the last of several updates to one element wins, as in the
reference and onnxruntime.

Example: ``ScatterElements(data: f32[n, 64], indices: i64[e, 64], updates: f32[e, 64],
axis=0, reduction="add")`` (a message-passing sum over ``e`` edges) copies ``data`` then runs
``e x 64`` read-add-writes.
"""

from __future__ import annotations

from collections.abc import Sequence

import sympy
from llvmlite import ir

from egraft.ir.dims import dim_product
from egraft.ir.dtypes import DType
from egraft.kernels.cpu import register_kernel
from egraft.kernels.cpu.data import contiguous_strides, copy_run
from egraft.kernels.cpu.emit import I64, KernelContext, MathEmitter, Unsupported, is_float, llvm_type

#: The reductions a scatter may apply (opset 16 adds them; 18 adds max and min).
REDUCTIONS = ("none", "add", "mul", "max", "min")
_UNSIGNED = {DType.UINT8, DType.BOOL}


def _index_type(ctx: KernelContext, i: int) -> None:
    dtype = ctx.in_type(i).dtype
    if dtype not in (DType.INT64, DType.INT32):
        raise Unsupported(f"{ctx.node.op} indices of dtype {dtype.short}")


def _same_data_dtype(ctx: KernelContext, *inputs: int) -> DType:
    dtype = ctx.out_type(0).dtype
    for i in inputs:
        if ctx.in_type(i).dtype != dtype:
            raise Unsupported(f"{ctx.node.op} of {ctx.in_type(i).dtype.short} into {dtype.short}")
    llvm_type(dtype)
    return dtype


def _load_index(ctx: KernelContext, pointer: ir.Value, offset: ir.Value, size: ir.Value) -> ir.Value:
    """``indices[offset]`` as an ``i64``, a negative one plus ``size``."""
    b = ctx.builder
    index = b.load(b.gep(pointer, [offset]))
    if index.type != I64:
        index = b.sext(index, I64)
    return b.select(b.icmp_signed("<", index, ir.Constant(I64, 0)), b.add(index, size), index)


def _in_range(b: ir.IRBuilder, index: ir.Value, size: ir.Value) -> ir.Value:
    """``0 <= index < size`` (one unsigned comparison)."""
    return b.icmp_unsigned("<", index, size)


def _reduction(ctx: KernelContext) -> str:
    if ctx.node.op == "Scatter" or ctx.opset < 16:
        return "none"
    reduction = ctx.attr("reduction", "none")
    reduction = reduction.decode() if isinstance(reduction, bytes) else reduction
    if reduction not in REDUCTIONS:
        raise Unsupported(f"reduction {reduction!r}")
    return reduction


def combine(b: ir.IRBuilder, math: MathEmitter, reduction: str, dtype: DType, old: ir.Value,
            new: ir.Value) -> ir.Value:
    """``old`` combined with ``new`` by ``reduction`` as numpy's ufuncs do: floats add and
    multiply in their own precision, ``max``/``min`` propagate NaN; ints wrap, uint8 and bool
    compare unsigned (bool ``add`` is ``or``, ``mul`` is ``and``)."""
    if reduction == "none":
        return new
    if is_float(old.type):
        if reduction == "add":
            return b.fadd(old, new)
        if reduction == "mul":
            return b.fmul(old, new)
        return math.maximum(old, new) if reduction == "max" else math.minimum(old, new)
    if dtype == DType.BOOL and reduction in ("add", "mul"):
        return b.or_(old, new) if reduction == "add" else b.and_(old, new)
    if reduction == "add":
        return b.add(old, new)
    if reduction == "mul":
        return b.mul(old, new)
    compare = b.icmp_unsigned if dtype in _UNSIGNED else b.icmp_signed
    return b.select(compare(">" if reduction == "max" else "<", new, old), new, old)


def _copy_data(ctx: KernelContext, shape: Sequence) -> None:
    """The output starts as a copy of input 0."""
    zero = ir.Constant(I64, 0)
    copy_run(ctx, ctx.out_ptr(0), zero, ctx.in_ptr(0), zero, dim_product(list(shape)))


# ---- GatherND ------------------------------------------------------------------------------------
@register_kernel("GatherND")
def gather_nd(ctx: KernelContext) -> None:
    """``y[batch, j] = data[batch, *indices[batch, j, :]]`` (a run of the trailing axes each)."""
    _same_data_dtype(ctx, 0)
    _index_type(ctx, 1)
    shape, index_shape = ctx.shape(ctx.in_type(0)), ctx.shape(ctx.in_type(1))
    batch = int(ctx.attr("batch_dims", 0))
    if not index_shape or not isinstance(index_shape[-1], int | sympy.Integer):
        raise Unsupported("the index tuples' length (the indices' last dim) is known only at run time")
    k = int(index_shape[-1])
    if batch + k > len(shape) or batch >= len(index_shape):
        raise Unsupported(f"indices of last dim {k} with batch_dims={batch} for data of rank {len(shape)}")
    strides = contiguous_strides(shape)
    batches = dim_product(list(shape[:batch]))
    tuples = dim_product(list(index_shape[batch:-1]))
    inner = dim_product(list(shape[batch + k:]))
    b = ctx.builder
    data, indices, out = ctx.in_ptr(0), ctx.in_ptr(1), ctx.out_ptr(0)
    zero, one = ir.Constant(I64, 0), ir.Constant(I64, 1)
    sizes = [ctx.dim(shape[batch + j]) for j in range(k)]
    with ctx.loop(ctx.dim(batches), name="batch") as n:
        src_batch = b.mul(n, ctx.dim(strides[batch - 1])) if batch else zero  # strides[batch - 1]: one batch
        with ctx.loop(ctx.dim(tuples), name="t") as t:
            row = b.add(b.mul(n, ctx.dim(tuples)), t)  # the tuple's number over all batches
            offset = src_batch
            for j in range(k):
                index = _load_index(ctx, indices, b.add(b.mul(row, ir.Constant(I64, k)), ir.Constant(I64, j)),
                                    sizes[j])
                index = b.select(b.icmp_signed("<", index, zero), zero, index)
                index = b.select(b.icmp_signed(">", index, b.sub(sizes[j], one)), b.sub(sizes[j], one), index)
                offset = b.add(offset, b.mul(index, ctx.dim(strides[batch + j])))
            copy_run(ctx, out, b.mul(row, ctx.dim(inner)), data, offset, inner)


# ---- ScatterElements, Scatter ----------------------------------------------------------------------
@register_kernel("ScatterElements", "Scatter")
def scatter_elements(ctx: KernelContext) -> None:
    """``y = data``, then ``y[i_0, .., indices[i], .., i_r] (op)= updates[i]`` for every index
    ``i`` of ``indices`` (one loop per axis, ``axis`` replaced by the index read)."""
    dtype = _same_data_dtype(ctx, 0, 2)
    _index_type(ctx, 1)
    reduction = _reduction(ctx)
    shape, index_shape = ctx.shape(ctx.in_type(0)), ctx.shape(ctx.in_type(1))
    rank = len(shape)
    axis = int(ctx.attr("axis", 0))
    if not -rank <= axis < max(rank, 1) or len(index_shape) != rank:
        raise Unsupported(f"axis {axis} or indices of rank {len(index_shape)} for data of rank {rank}")
    axis %= max(rank, 1)
    _copy_data(ctx, shape)
    if rank == 0:
        return
    out_strides = contiguous_strides(shape)
    in_strides = contiguous_strides(index_shape)
    b = ctx.builder
    out, indices, updates = ctx.out_ptr(0), ctx.in_ptr(1), ctx.in_ptr(2)
    size = ctx.dim(shape[axis])

    def nest(level: int, src: ir.Value, dst: ir.Value) -> None:
        with ctx.loop(ctx.dim(index_shape[level]), name=f"s{level}") as i:
            src_here = b.add(src, b.mul(i, ctx.dim(in_strides[level])))
            dst_here = dst if level == axis else b.add(dst, b.mul(i, ctx.dim(out_strides[level])))
            if level + 1 < rank:
                nest(level + 1, src_here, dst_here)
                return
            index = _load_index(ctx, indices, src_here, size)
            with b.if_then(_in_range(b, index, size)):
                target = b.gep(out, [b.add(dst_here, b.mul(index, ctx.dim(out_strides[axis])))])
                value = b.load(b.gep(updates, [src_here]))
                b.store(combine(b, ctx.math, reduction, dtype, b.load(target), value), target)

    nest(0, ir.Constant(I64, 0), ir.Constant(I64, 0))


# ---- ScatterND ----------------------------------------------------------------------------------
@register_kernel("ScatterND")
def scatter_nd(ctx: KernelContext) -> None:
    """``y = data``, then ``y[*indices[j, :]] (op)= updates[j]`` (a run of the trailing axes)
    for every index tuple ``j``, in order."""
    dtype = _same_data_dtype(ctx, 0, 2)
    _index_type(ctx, 1)
    reduction = _reduction(ctx)
    shape, index_shape = ctx.shape(ctx.in_type(0)), ctx.shape(ctx.in_type(1))
    if not index_shape or not isinstance(index_shape[-1], int | sympy.Integer) or int(index_shape[-1]) > len(shape):
        raise Unsupported("the index tuples' length (the indices' last dim) is known only at run time")
    k = int(index_shape[-1])
    _copy_data(ctx, shape)
    strides = contiguous_strides(shape)
    inner = dim_product(list(shape[k:]))
    b = ctx.builder
    out, indices, updates = ctx.out_ptr(0), ctx.in_ptr(1), ctx.in_ptr(2)
    sizes = [ctx.dim(shape[j]) for j in range(k)]
    with ctx.loop(ctx.dim(dim_product(list(index_shape[:-1]))), name="t") as t:
        offset, inside = ir.Constant(I64, 0), ir.Constant(ir.IntType(1), 1)
        for j in range(k):
            index = _load_index(ctx, indices, b.add(b.mul(t, ir.Constant(I64, k)), ir.Constant(I64, j)), sizes[j])
            inside = b.and_(inside, _in_range(b, index, sizes[j]))
            offset = b.add(offset, b.mul(index, ctx.dim(strides[j])))
        with b.if_then(inside):
            source = b.mul(t, ctx.dim(inner))
            if reduction == "none":
                copy_run(ctx, out, offset, updates, source, inner)
            else:
                with ctx.loop(ctx.dim(inner), name="e") as e:
                    target = b.gep(out, [b.add(offset, e)])
                    value = b.load(b.gep(updates, [b.add(source, e)]))
                    b.store(combine(b, ctx.math, reduction, dtype, b.load(target), value), target)

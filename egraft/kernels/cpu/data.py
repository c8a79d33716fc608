"""Data-movement and shape kernels: Transpose, Concat, Split, Slice, Gather, Pad, Expand, Tile,
Cast, Shape, Size, ConstantOfShape, Range, the comparisons and boolean logic, and egraft's blocked
layout conversions (``com.egraft::LayoutToBlocked`` / ``LayoutFromBlocked``).

Most of these ops are one *strided copy*: every output element reads one input element at
``offset + sum(index_k * stride_k)``. :func:`emit_strided_copy` drops size-1 axes and merges
adjacent axes that stay contiguous for both sides, then emits

- rows copied with ``llvm.memcpy`` when the innermost axis is contiguous on both sides
  (Concat, Split, Tile, a Slice of whole rows, Gather rows);
- a real transpose (the write contiguous, the read contiguous along another axis): 4-byte
  elements in 8 x 8 register blocks (eight vector loads, shuffles, eight vector stores),
  others in a tiled loop nest so both sides stay in cache;
- else one loop nest whose inner loop writes contiguously (broadcast reads, stepped slices).

Parameters that shape the loops (perm, axes, pads, repeats, split sizes) must be
compile-time constants; otherwise the generator raises :class:`Unsupported` and the node runs
on its reference kernel. Slice's starts and steps may be computed (read when the kernel runs).
Output dims that only input values decide (Expand to a computed shape, ConstantOfShape, Range,
a Slice with computed bounds) are bound by the runtime just before the kernel runs
(:data:`egraft.lowering.compile.SIZED_BY_INPUT_VALUES`).

Example: ``Transpose(x: f32[8, 64, 56, 56], perm=[0, 2, 3, 1])`` becomes 8 tiled copies of a
64 x 3,136 matrix into 3,136 x 64 (H and W merge into one axis).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import sympy
from llvmlite import ir

from egraft.ir.dims import dim_product, dim_symbols, dims_equal
from egraft.ir.dtypes import DType
from egraft.ir.ops.nn_dense import dropout_is_identity
from egraft.ir.ops.shape import onnx_slice
from egraft.kernels.cpu import register_kernel
from egraft.kernels.cpu.elementwise import broadcast_strides, collapse, emit_elementwise
from egraft.kernels.cpu.emit import (
    F32,
    F64,
    I1,
    I8,
    I8P,
    I32,
    I64,
    KernelContext,
    Unsupported,
    ceil_div,
    is_float,
    llvm_type,
)

Dim = int | sympy.Expr

#: Elements per side of one tile of a tiled transpose copy (float32: 16 x 64 bytes).
TILE_BYTES = 64


# ---- shapes and constants ----------------------------------------------------------------------
def contiguous_strides(shape: Sequence[Dim]) -> list[Dim]:
    """Element strides of a C-contiguous tensor of ``shape`` (dims may be sympy expressions).

    Example:
        >>> contiguous_strides((2, 3, 4))
        [12, 4, 1]
    """
    strides: list[Dim] = [1] * len(shape)
    acc: Dim = 1
    for k in reversed(range(len(shape))):
        strides[k] = acc
        acc = dim_product([acc, shape[k]])
    return strides


def _normalize_axis(axis: int, rank: int) -> int:
    if not -rank <= axis < max(rank, 1):
        raise Unsupported(f"axis {axis} is out of range for rank {rank}")
    return axis + rank if axis < 0 else axis


def constant_ints(ctx: KernelContext, index: int, what: str) -> list[int] | None:
    """Input ``index`` as a list of ints when the node has it; ``None`` when absent;
    :class:`Unsupported` (naming ``what``) when it is computed at run time.

    Example: a Slice at opset 13 with ``starts`` an initializer ``[0, -1]`` gives ``[0, -1]``.
    """
    if not ctx.has_input(index):
        return None
    value = ctx.constant(index)
    if value is None:
        raise Unsupported(f"{what} is computed at run time (only constant {what} has generated code)")
    return [int(v) for v in np.asarray(value).ravel()]


def require_bound_dims(ctx: KernelContext) -> None:
    """Every symbolic dim of the node's outputs must be known when the kernel runs: a dim of a
    graph input or of one of the node's inputs. A dim that inference minted for a data-dependent
    size (``Expand`` to a shape read at run time) is known only to the reference kernel.
    """
    known: set[str] = set()
    for v in [*ctx.graph.inputs, *(v for v in ctx.node.inputs if v is not None)]:
        if v.type.shape is not None:
            known |= dim_symbols(v.type.shape)
    for v in ctx.node.outputs:
        if v is None:
            continue
        if v.type.shape is None:
            raise Unsupported("an output of unknown rank")
        unknown = dim_symbols(v.type.shape) - known
        if unknown:
            raise Unsupported(f"output dims {sorted(unknown)} are known only when the node runs")


def scalar_constant(dtype: DType, value) -> ir.Constant:
    """``value`` converted to ``dtype`` (as numpy's ``astype`` does) as an LLVM constant.

    Example: ``scalar_constant(DType.UINT8, 200)`` is the ``i8`` constant ``-56`` (the same byte).
    """
    t = llvm_type(dtype)
    converted = np.asarray(value).astype(dtype.numpy)
    if is_float(t):
        return ir.Constant(t, float(converted))
    if dtype == DType.BOOL:
        return ir.Constant(t, int(bool(converted)))
    signed = converted.astype(np.dtype(f"i{dtype.numpy.itemsize}"))
    return ir.Constant(t, int(signed))


# ---- IR helpers --------------------------------------------------------------------------------
def _i64(ctx: KernelContext, d: Dim | ir.Value) -> ir.Value:
    return d if isinstance(d, ir.Value) else ctx.dim(d)


def _add_scaled(ctx: KernelContext, base: ir.Value, index: ir.Value, stride: Dim | ir.Value) -> ir.Value:
    """``base + index * stride`` (``base`` when the stride is the constant 0)."""
    if isinstance(stride, int | sympy.Integer) and int(stride) == 0:
        return base
    b = ctx.builder
    if isinstance(stride, int | sympy.Integer) and int(stride) == 1:
        return b.add(base, index)
    return b.add(base, b.mul(index, _i64(ctx, stride)))


def _smin(b: ir.IRBuilder, x: ir.Value, y: ir.Value) -> ir.Value:
    return b.select(b.icmp_signed("<", x, y), x, y)


def _smax(b: ir.IRBuilder, x: ir.Value, y: ir.Value) -> ir.Value:
    return b.select(b.icmp_signed(">", x, y), x, y)


def _element_bytes(pointer: ir.Value) -> int:
    t = pointer.type.pointee
    return 8 if t in (I64, F64) else 4 if t in (I32, F32) else 1


def copy_run(ctx: KernelContext, dst: ir.Value, dst_offset: ir.Value, src: ir.Value, src_offset: ir.Value,
             count: Dim | ir.Value) -> None:
    """``dst[dst_offset : dst_offset + count] = src[src_offset : ...]``: one ``llvm.memcpy``
    (LLVM inlines it as vector moves when ``count`` is a small constant).

    Example: a Concat of two ``f32[2, 3]`` on axis 1 copies runs of 3 floats, two per input.
    """
    if isinstance(count, int | sympy.Integer) and int(count) == 1:
        b = ctx.builder
        b.store(b.load(b.gep(src, [src_offset])), b.gep(dst, [dst_offset]))
        return
    if isinstance(count, int | sympy.Integer) and int(count) == 0:
        return
    b = ctx.builder
    memcpy = ctx.module.declare_intrinsic("llvm.memcpy", [I8P, I8P, I64])
    nbytes = b.mul(_i64(ctx, count), ir.Constant(I64, _element_bytes(dst)))
    b.call(memcpy, [b.bitcast(b.gep(dst, [dst_offset]), I8P), b.bitcast(b.gep(src, [src_offset]), I8P), nbytes,
                    ir.Constant(I1, 0)])


def fill_run(ctx: KernelContext, dst: ir.Value, offset: ir.Value, count: Dim | ir.Value, value: ir.Constant) -> None:
    """``dst[offset : offset + count] = value`` (a loop LLVM turns into memset or vector stores).

    Example: Pad's constant borders, ConstantOfShape.
    """
    if isinstance(count, int | sympy.Integer) and int(count) == 0:
        return
    b = ctx.builder
    with ctx.loop(_i64(ctx, count), name="fill") as i:
        b.store(value, b.gep(dst, [b.add(offset, i)]))


def emit_strided_copy(ctx: KernelContext, sizes: Sequence[Dim], dst: ir.Value, dst_strides: Sequence[Dim],
                      src: ir.Value, src_strides: Sequence[Dim], dst_offset: ir.Value | None = None,
                      src_offset: ir.Value | None = None, share: bool = False) -> None:
    """``dst[dst_offset + sum(i_k * dst_strides[k])] = src[src_offset + sum(i_k * src_strides[k])]``
    for every index ``i`` of ``sizes`` (dims and strides may be sympy expressions; strides may
    be 0 (broadcast) or negative (reversed slices)).

    Axes of size 1 go and adjacent axes contiguous on both sides merge; the innermost axis then
    decides the loop: contiguous on both sides, rows are memcpy'd; contiguous only on the
    destination with another axis contiguous on the source, the copy is tiled (a transpose);
    else a loop nest with the destination's innermost axis inside.

    With ``share`` (a kernel whose copies write disjoint regions and do nothing else) the
    outermost of two or more axes, or the elements of a single contiguous run, are shared
    over the kernel's parts, each copying its slices as above.

    Example (a transpose of ``f32[4, 5]``):
        ``emit_strided_copy(ctx, (5, 4), out, (4, 1), x, (1, 5))``
    """
    zero = ir.Constant(I64, 0)
    sizes, (dst_strides, src_strides) = collapse(list(sizes), [list(dst_strides), list(src_strides)])
    dst_offset = zero if dst_offset is None else dst_offset
    src_offset = zero if src_offset is None else src_offset
    if share and len(sizes) == 1 and _is_one(dst_strides[0]) and _is_one(src_strides[0]):  # one run: its parts
        b = ctx.builder
        lo, hi = ctx.share(ctx.dim(sizes[0]))
        copy_run(ctx, dst, b.add(dst_offset, lo), src, b.add(src_offset, lo), b.sub(hi, lo))
        return
    if share and len(sizes) >= 2:
        lo, hi = ctx.share(ctx.dim(sizes[0]))
        with ctx.loop(hi, name="part", start=lo) as i:
            emit_strided_copy(ctx, sizes[1:], dst, dst_strides[1:], src, src_strides[1:],
                              _add_scaled(ctx, dst_offset, i, dst_strides[0]),
                              _add_scaled(ctx, src_offset, i, src_strides[0]))
        return
    last = len(sizes) - 1
    if _is_one(dst_strides[last]) and _is_one(src_strides[last]):
        _copy_rows(ctx, sizes, dst, dst_strides, src, src_strides, dst_offset, src_offset)
        return
    tile = max(8, TILE_BYTES // _element_bytes(dst))
    across = [k for k in range(last) if _is_one(src_strides[k])]
    if _is_one(dst_strides[last]) and across and _element_bytes(dst) == 4 and \
            _worth_tiling(sizes[across[0]], REGISTER_BLOCK) and _worth_tiling(sizes[last], REGISTER_BLOCK):
        _copy_transposed(ctx, sizes, dst, dst_strides, src, src_strides, dst_offset, src_offset, across[0])
        return
    if _is_one(dst_strides[last]) and across and _worth_tiling(sizes[across[0]], tile) and \
            _worth_tiling(sizes[last], tile):
        _copy_tiled(ctx, sizes, dst, dst_strides, src, src_strides, dst_offset, src_offset, across[0], tile)
        return
    _copy_elements(ctx, sizes, dst, dst_strides, src, src_strides, dst_offset, src_offset)


def _is_one(d: Dim) -> bool:
    return isinstance(d, int | sympy.Integer) and int(d) == 1


def _worth_tiling(n: Dim, tile: int) -> bool:
    return not isinstance(n, int | sympy.Integer) or int(n) >= tile


def _copy_rows(ctx, sizes, dst, dst_strides, src, src_strides, dst_offset, src_offset) -> None:
    """Outer loops over every axis but the last; the last (contiguous on both sides) is one memcpy."""
    last = len(sizes) - 1

    def nest(level: int, d_off: ir.Value, s_off: ir.Value) -> None:
        if level == last:
            copy_run(ctx, dst, d_off, src, s_off, sizes[last])
            return
        with ctx.loop(ctx.dim(sizes[level]), name=f"r{level}") as i:
            nest(level + 1, _add_scaled(ctx, d_off, i, dst_strides[level]),
                 _add_scaled(ctx, s_off, i, src_strides[level]))

    nest(0, dst_offset, src_offset)


def _copy_elements(ctx, sizes, dst, dst_strides, src, src_strides, dst_offset, src_offset) -> None:
    """One loop per axis, element loads and stores in the innermost."""
    b = ctx.builder

    def nest(level: int, d_off: ir.Value, s_off: ir.Value) -> None:
        with ctx.loop(ctx.dim(sizes[level]), name=f"e{level}") as i:
            d_here = _add_scaled(ctx, d_off, i, dst_strides[level])
            s_here = _add_scaled(ctx, s_off, i, src_strides[level])
            if level + 1 < len(sizes):
                nest(level + 1, d_here, s_here)
                return
            b.store(b.load(b.gep(src, [s_here])), b.gep(dst, [d_here]))

    nest(0, dst_offset, src_offset)


def _over_outer_axes(ctx, sizes, outer: list[int], dst_strides, src_strides, d_off: ir.Value, s_off: ir.Value,
                     inner, name: str) -> None:
    """One loop per axis of ``outer`` (offsets advanced by each side's stride), then
    ``inner(d_off, s_off)`` in the innermost: the outer nest of the transposing copies."""
    if not outer:
        inner(d_off, s_off)
        return
    k = outer[0]
    with ctx.loop(ctx.dim(sizes[k]), name=f"{name}{k}") as i:
        _over_outer_axes(ctx, sizes, outer[1:], dst_strides, src_strides, _add_scaled(ctx, d_off, i, dst_strides[k]),
                         _add_scaled(ctx, s_off, i, src_strides[k]), inner, name)


#: Side of the register block of a transposing copy of 4-byte elements: 8 x 8 in eight vectors.
REGISTER_BLOCK = 8


def transpose_registers(b: ir.IRBuilder, rows: Sequence[ir.Value]) -> list[ir.Value]:
    """The 8 x 8 transpose of eight 8-lane vectors: ``result[j][i] == rows[i][j]``, in three
    rounds of two-vector shuffles (pairs of lanes, then of pairs, then of halves: 24 shuffles,
    the unpack / shuffle / permute2f128 sequence of AVX).

    Example: rows of pixels with 8 channels each become rows of channels with 8 pixels each.
    """
    def shuffle(x: ir.Value, y: ir.Value, mask: Sequence[int]) -> ir.Value:
        return b.shuffle_vector(x, y, ir.Constant(ir.VectorType(I32, len(mask)), list(mask)))

    lo, hi = (0, 8, 1, 9, 4, 12, 5, 13), (2, 10, 3, 11, 6, 14, 7, 15)
    t = [shuffle(rows[2 * i], rows[2 * i + 1], m) for i in range(4) for m in (lo, hi)]
    lo, hi = (0, 1, 8, 9, 4, 5, 12, 13), (2, 3, 10, 11, 6, 7, 14, 15)
    u = [shuffle(t[4 * q + p], t[4 * q + p + 2], m) for q in range(2) for p in range(2) for m in (lo, hi)]
    lo, hi = (0, 1, 2, 3, 8, 9, 10, 11), (4, 5, 6, 7, 12, 13, 14, 15)
    return [shuffle(u[j % 4], u[j % 4 + 4], lo if j < 4 else hi) for j in range(8)]


def _copy_transposed(ctx, sizes, dst, dst_strides, src, src_strides, dst_offset, src_offset, across: int) -> None:
    """A transpose of 4-byte elements in 8 x 8 register blocks: eight vector loads along axis
    ``across`` (contiguous in the source), :func:`transpose_registers`, eight vector stores along
    the last axis (contiguous in the destination). A side that is not a multiple of 8 ends
    with a block overlapping the one before it (a copy may write an element twice); a side
    that may be shorter than 8 (a symbolic dim) is checked at run time and copied element by
    element then. Small code: LLVM has nothing left to vectorize or unroll."""
    b = ctx.builder
    last = len(sizes) - 1
    outer = [k for k in range(last) if k != across]
    n_across, n_last = ctx.dim(sizes[across]), ctx.dim(sizes[last])
    block = ir.Constant(I64, REGISTER_BLOCK)
    vector = ir.VectorType(dst.type.pointee, REGISTER_BLOCK).as_pointer()

    def starts(i: ir.Value, n: ir.Value) -> ir.Value:  # min(8 i, n - 8): the last block overlaps
        return _smin(b, b.mul(i, block), b.sub(n, block))

    def blocks(d_off: ir.Value, s_off: ir.Value) -> None:
        with ctx.loop(ceil_div(b, n_across, REGISTER_BLOCK), name="ra") as ab:
            a0 = starts(ab, n_across)
            d_a = _add_scaled(ctx, d_off, a0, dst_strides[across])
            s_a = b.add(s_off, a0)
            with ctx.loop(ceil_div(b, n_last, REGISTER_BLOCK), name="rl") as lb:
                l0 = starts(lb, n_last)
                d_block = b.add(d_a, l0)
                s_block = _add_scaled(ctx, s_a, l0, src_strides[last])
                rows = [b.load(b.bitcast(b.gep(src, [_add_scaled(ctx, s_block, ir.Constant(I64, j),
                                                                   src_strides[last])]), vector), align=4)
                        for j in range(REGISTER_BLOCK)]
                for i, row in enumerate(transpose_registers(b, rows)):
                    at = _add_scaled(ctx, d_block, ir.Constant(I64, i), dst_strides[across])
                    b.store(row, b.bitcast(b.gep(dst, [at]), vector), align=4)

    def nest() -> None:
        _over_outer_axes(ctx, sizes, outer, dst_strides, src_strides, dst_offset, src_offset, blocks, "r")

    if all(isinstance(sizes[k], int | sympy.Integer) for k in (across, last)):
        nest()
        return
    enough = b.and_(b.icmp_signed(">=", n_across, block), b.icmp_signed(">=", n_last, block))
    with b.if_else(enough) as (blocked, short):
        with blocked:
            nest()
        with short:
            _copy_elements(ctx, sizes, dst, dst_strides, src, src_strides, dst_offset, src_offset)


def _copy_tiled(ctx, sizes, dst, dst_strides, src, src_strides, dst_offset, src_offset, across: int,
                tile: int) -> None:
    """A transpose: axis ``across`` is contiguous in the source, the last axis in the
    destination. Both are cut into ``tile``-sized blocks; inside a block the source rows and
    destination rows stay in cache."""
    b = ctx.builder
    last = len(sizes) - 1
    outer = [k for k in range(last) if k != across]
    t = ir.Constant(I64, tile)

    def tiles(d_off: ir.Value, s_off: ir.Value) -> None:
        with ctx.loop(ceil_div(b, ctx.dim(sizes[across]), tile), name="ta") as ab:
            with ctx.loop(ceil_div(b, ctx.dim(sizes[last]), tile), name="tl") as lb:
                a0, l0 = b.mul(ab, t), b.mul(lb, t)
                a_end = _smin(b, b.add(a0, t), ctx.dim(sizes[across]))
                l_end = _smin(b, b.add(l0, t), ctx.dim(sizes[last]))
                full = b.and_(b.icmp_signed("==", b.sub(a_end, a0), t), b.icmp_signed("==", b.sub(l_end, l0), t))
                with b.if_else(full) as (whole, partial):
                    with whole:  # constant trip counts: LLVM unrolls and vectorizes the tile
                        tile_block(d_off, s_off, a0, l0, t, t)
                    with partial:
                        tile_block(d_off, s_off, a0, l0, b.sub(a_end, a0), b.sub(l_end, l0))

    def tile_block(d_off: ir.Value, s_off: ir.Value, a0: ir.Value, l0: ir.Value, a_count: ir.Value,
                   l_count: ir.Value) -> None:
        d_off = _add_scaled(ctx, _add_scaled(ctx, d_off, a0, dst_strides[across]), l0, dst_strides[last])
        s_off = _add_scaled(ctx, _add_scaled(ctx, s_off, a0, src_strides[across]), l0, src_strides[last])
        with ctx.loop(a_count, name="a") as a:
            d_row = _add_scaled(ctx, d_off, a, dst_strides[across])
            s_row = _add_scaled(ctx, s_off, a, src_strides[across])
            with ctx.loop(l_count, name="l") as j:
                value = b.load(b.gep(src, [_add_scaled(ctx, s_row, j, src_strides[last])]))
                b.store(value, b.gep(dst, [_add_scaled(ctx, d_row, j, dst_strides[last])]))

    _over_outer_axes(ctx, sizes, outer, dst_strides, src_strides, dst_offset, src_offset, tiles, "t")


def _same_dtype(ctx: KernelContext) -> None:
    """Output 0 has input 0's dtype, and that dtype has generated code."""
    if ctx.in_type(0).dtype != ctx.out_type(0).dtype:
        raise Unsupported(f"{ctx.node.op} from {ctx.in_type(0).dtype.short} to {ctx.out_type(0).dtype.short}")
    llvm_type(ctx.out_type(0).dtype)


# ---- Transpose, Expand, Tile, layouts -------------------------------------------------------------
@register_kernel("Transpose")
def transpose(ctx: KernelContext) -> None:
    """``y = transpose(x, perm)`` (default perm: the axes reversed); axes that stay adjacent merge."""
    _same_dtype(ctx)
    shape = ctx.shape(ctx.in_type(0))
    perm = ctx.attr("perm", None)
    perm = list(range(len(shape)))[::-1] if perm is None else [_normalize_axis(p, len(shape)) for p in perm]
    if sorted(perm) != list(range(len(shape))):
        raise Unsupported(f"perm {perm} is not a permutation of {len(shape)} axes")
    out_shape = [shape[p] for p in perm]
    in_strides = contiguous_strides(shape)
    emit_strided_copy(ctx, out_shape, ctx.out_ptr(0), contiguous_strides(out_shape), ctx.in_ptr(0),
                      [in_strides[p] for p in perm])


@register_kernel("Expand")
def expand(ctx: KernelContext) -> None:
    """``y = broadcast_to(x, shape)``: a copy reading broadcast axes with stride 0. The shape
    input may be computed: output dims that only its value decides (``_d3``) are bound by the
    runtime before the kernel runs (``SIZED_BY_INPUT_VALUES``); an input dim that may or may not
    be 1 against such a dim gets its stride chosen at run time."""
    _same_dtype(ctx)
    out_shape = ctx.shape(ctx.out_type(0))
    in_shape = ctx.shape(ctx.in_type(0))
    try:
        src_strides: list = broadcast_strides(in_shape, out_shape)
    except Unsupported:
        src_strides = _runtime_broadcast_strides(ctx, in_shape, out_shape)
    copy_with_strides(ctx, out_shape, ctx.out_ptr(0), contiguous_strides(out_shape), ctx.in_ptr(0), src_strides)


def _runtime_broadcast_strides(ctx: KernelContext, shape: Sequence[Dim], out: Sequence[Dim]) -> list:
    """As :func:`broadcast_strides`, for dims whose broadcast is decided at run time: an input
    dim ``n`` against an output dim of another symbol reads with stride ``n == 1 ? 0 : stride``
    (an ``i64`` value)."""
    b = ctx.builder
    pad = len(out) - len(shape)
    strides: list = [0] * len(out)
    acc: Dim = sympy.Integer(1)
    for k in reversed(range(len(out))):
        if k < pad:
            continue
        d = shape[k - pad]
        if d == 1:
            strides[k] = 0
        elif isinstance(d, int | sympy.Integer) or dims_equal(d, out[k]):
            strides[k] = acc
        else:
            one = b.icmp_signed("==", ctx.dim(d), ir.Constant(I64, 1))
            strides[k] = b.select(one, ir.Constant(I64, 0), ctx.dim(acc))
        acc = dim_product([acc, d])
    return strides


def copy_with_strides(ctx: KernelContext, sizes: Sequence[Dim], dst: ir.Value, dst_strides: Sequence[Dim],
                      src: ir.Value, src_strides: Sequence, src_offset: ir.Value | None = None) -> None:
    """:func:`emit_strided_copy` where some source strides may be ``i64`` values computed at run
    time (a Slice's runtime steps, a broadcast decided at run time): those copies drop the
    size-1 axes and run one loop per axis (rows memcpy'd when the last axis is contiguous)."""
    if not any(isinstance(s, ir.Value) for s in src_strides):
        emit_strided_copy(ctx, sizes, dst, dst_strides, src, src_strides, src_offset=src_offset)
        return
    kept = [k for k in range(len(sizes)) if not (isinstance(sizes[k], int | sympy.Integer) and int(sizes[k]) == 1)]
    if not kept:
        kept = [len(sizes) - 1]
    sizes = [sizes[k] for k in kept]
    dst_strides = [dst_strides[k] for k in kept]
    src_strides = [src_strides[k] for k in kept]
    src_offset = ir.Constant(I64, 0) if src_offset is None else src_offset
    zero = ir.Constant(I64, 0)
    last = len(sizes) - 1
    if _is_one(dst_strides[last]) and not isinstance(src_strides[last], ir.Value) and _is_one(src_strides[last]):
        _copy_rows(ctx, sizes, dst, dst_strides, src, src_strides, zero, src_offset)
    else:
        _copy_elements(ctx, sizes, dst, dst_strides, src, src_strides, zero, src_offset)


@register_kernel("Tile")
def tile(ctx: KernelContext) -> None:
    """``y = tile(x, repeats)`` with constant repeats: output axis ``k`` of size ``r_k * n_k``
    is the pair of axes ``(r_k, n_k)``, the first read with stride 0."""
    _same_dtype(ctx)
    repeats = constant_ints(ctx, 1, "repeats")
    shape = ctx.shape(ctx.in_type(0))
    if repeats is None or len(repeats) != len(shape):
        raise Unsupported(f"repeats {repeats} for rank {len(shape)}")
    out_shape = [r * d for r, d in zip(repeats, shape)]
    out_strides = contiguous_strides(out_shape)
    in_strides = contiguous_strides(shape)
    sizes: list[Dim] = []
    dst_strides: list[Dim] = []
    src_strides: list[Dim] = []
    for r, n, os_, is_ in zip(repeats, shape, out_strides, in_strides):
        sizes += [r, n]
        dst_strides += [n * os_, os_]
        src_strides += [0, is_]
    emit_strided_copy(ctx, sizes, ctx.out_ptr(0), dst_strides, ctx.in_ptr(0), src_strides)


def _block(ctx: KernelContext) -> int:
    block = ctx.attr("block", 8)
    if not isinstance(block, int | np.integer) or block < 1:
        raise Unsupported(f"block {block!r} is not a positive integer")
    return int(block)


@register_kernel("LayoutToBlocked", domain="com.egraft")
def layout_to_blocked(ctx: KernelContext) -> None:
    """``[N, C, *S] -> [N, C/block, *S, block]``: ``y[n, c // block, *s, c % block] = x[n, c, *s]``."""
    _same_dtype(ctx)
    block = _block(ctx)
    shape = ctx.shape(ctx.in_type(0))
    if len(shape) < 2 or not isinstance(shape[1], int) or shape[1] % block:
        raise Unsupported(f"channels of {list(shape)} are not a known multiple of block {block}")
    n, c, spatial = shape[0], shape[1], list(shape[2:])
    plane = dim_product(spatial)
    sizes = [n, c // block, *spatial, block]
    src_strides = [c * plane, block * plane, *contiguous_strides(spatial), plane]
    emit_strided_copy(ctx, sizes, ctx.out_ptr(0), contiguous_strides(sizes), ctx.in_ptr(0), src_strides, share=True)


@register_kernel("LayoutFromBlocked", domain="com.egraft")
def layout_from_blocked(ctx: KernelContext) -> None:
    """``[N, C/block, *S, block] -> [N, C, *S]``: ``y[n, c, *s] = x[n, c // block, *s, c % block]``."""
    _same_dtype(ctx)
    block = _block(ctx)
    shape = ctx.shape(ctx.in_type(0))
    if len(shape) < 3 or shape[-1] != block:
        raise Unsupported(f"{list(shape)} is not a blocked shape of block {block}")
    n, cb, spatial = shape[0], shape[1], list(shape[2:-1])
    plane = dim_product(spatial)
    sizes = [n, cb, block, *spatial]  # y viewed as [N, C/block, block, *S]
    src_strides = [cb * plane * block, plane * block, 1, *(s * block for s in contiguous_strides(spatial))]
    emit_strided_copy(ctx, sizes, ctx.out_ptr(0), contiguous_strides(sizes), ctx.in_ptr(0), src_strides, share=True)


# ---- Concat, Split, Slice, Gather -------------------------------------------------------------
@register_kernel("Concat")
def concat(ctx: KernelContext) -> None:
    """``y = concatenate(inputs, axis)``: each input is rows copied into its place in ``y``."""
    out_shape = ctx.shape(ctx.out_type(0))
    axis = _normalize_axis(ctx.attr("axis"), len(out_shape))
    dtype = ctx.out_type(0).dtype
    llvm_type(dtype)
    out_strides = contiguous_strides(out_shape)
    out = ctx.out_ptr(0)
    start: Dim = 0
    for i in range(len(ctx.node.inputs)):
        if not ctx.has_input(i):
            continue
        if ctx.in_type(i).dtype != dtype:
            raise Unsupported("Concat of mixed dtypes")
        shape = ctx.shape(ctx.in_type(i))
        offset = ctx.dim(sympy.expand(start * out_strides[axis]))
        emit_strided_copy(ctx, shape, out, out_strides, ctx.in_ptr(i), contiguous_strides(shape), dst_offset=offset,
                          share=True)  # each input into its own region: every copy in parts
        start = start + shape[axis]


@register_kernel("Split")
def split(ctx: KernelContext) -> None:
    """``outputs = split(x, sizes, axis)``: sizes from the ``split`` attribute (opset < 13), a
    constant input (13+) or equal parts (``num_outputs`` at 18+), as inference typed the outputs."""
    _same_dtype(ctx)
    if ctx.opset >= 13:
        constant_ints(ctx, 1, "split sizes")
    shape = ctx.shape(ctx.in_type(0))
    axis = _normalize_axis(ctx.attr("axis", 0), len(shape))
    require_bound_dims(ctx)
    in_strides = contiguous_strides(shape)
    x = ctx.in_ptr(0)
    start: Dim = 0
    for j, v in enumerate(ctx.node.outputs):
        if v is None:
            continue
        out_shape = ctx.shape(v.type)
        offset = ctx.dim(sympy.expand(start * in_strides[axis]))
        emit_strided_copy(ctx, out_shape, ctx.out_ptr(j), contiguous_strides(out_shape), x, in_strides,
                          src_offset=offset)
        start = start + out_shape[axis]


def _slice_parameters(ctx: KernelContext, rank: int) -> list[tuple[int, int | ir.Value, int | ir.Value]]:
    """``(axis, start, step)`` per sliced axis, from attributes (opset < 10) or inputs: constant
    ones as ints, computed starts and steps as ``i64`` values loaded when the kernel runs (axes
    must be constant). The ends only decide the output's length, which inference typed (or
    the runtime bound from the inputs' values, ``SIZED_BY_INPUT_VALUES``)."""
    if ctx.opset < 10:
        starts, axes, steps = ctx.attr("starts"), ctx.attr("axes", None), None
        if starts is None or ctx.attr("ends") is None:
            raise Unsupported("Slice without starts/ends")
        starts = [int(v) for v in starts]
        axes = None if axes is None else list(axes)
    else:
        if not ctx.has_input(1) or not ctx.has_input(2):
            raise Unsupported("Slice without starts/ends")
        count = ctx.shape(ctx.in_type(1))
        if len(count) != 1 or not isinstance(count[0], int | sympy.Integer):
            raise Unsupported(f"starts of shape {list(count)}: the number of sliced axes is known only at run time")
        count = int(count[0])
        starts = _slice_ints(ctx, 1, count)
        axes = constant_ints(ctx, 3, "axes")
        steps = _slice_ints(ctx, 4, count) if ctx.has_input(4) else None
    axes = list(range(len(starts))) if axes is None else [_normalize_axis(int(a), rank) for a in axes]
    steps = [1] * len(starts) if steps is None else steps
    if any(isinstance(st, int) and st == 0 for st in steps):
        raise Unsupported("a Slice step of 0")
    return list(zip(axes, starts, steps))


def _slice_ints(ctx: KernelContext, index: int, count: int) -> list[int | ir.Value]:
    """The ``count`` entries of Slice input ``index``: ints when it is a constant, else ``i64``
    values loaded from its buffer (int32 or int64) when the kernel runs."""
    constant = ctx.constant(index)
    if constant is not None:
        return [int(v) for v in np.asarray(constant).ravel()]
    dtype = ctx.in_type(index).dtype
    if dtype not in (DType.INT64, DType.INT32):
        raise Unsupported(f"Slice parameters of dtype {dtype.short}")
    b = ctx.builder
    pointer = ctx.in_ptr(index)
    values = []
    for k in range(count):
        value = b.load(b.gep(pointer, [ir.Constant(I64, k)]))
        values.append(value if value.type == I64 else b.sext(value, I64))
    return values


def _slice_first(ctx: KernelContext, d: Dim, start: int | ir.Value, step: int | ir.Value) -> ir.Value:
    """The first index of ``range(d)[start::step]``, clamped as ONNX (and Python) clamp:
    into ``[0, d]`` for a positive step, ``[0, d - 1]`` for a negative one (start and step may
    be values computed at run time)."""
    if isinstance(start, int) and isinstance(step, int) and isinstance(d, int | sympy.Integer):
        first = onnx_slice(start, 0, step, int(d)).start  # Python's indices() gives -1 for start=-100 stepping back
        return ir.Constant(I64, first)
    b = ctx.builder
    zero = ir.Constant(I64, 0)
    n = ctx.dim(d)
    if isinstance(start, int):
        value = b.add(n, ir.Constant(I64, start)) if start < 0 else ir.Constant(I64, start)
    else:
        value = b.select(b.icmp_signed("<", start, zero), b.add(start, n), start)
    if isinstance(step, int):
        high = n if step > 0 else b.sub(n, ir.Constant(I64, 1))
    else:
        high = b.select(b.icmp_signed(">", step, zero), n, b.sub(n, ir.Constant(I64, 1)))
    return _smin(b, _smax(b, value, zero), high)


@register_kernel("Slice")
def slice_(ctx: KernelContext) -> None:
    """``y = x[starts:ends:steps]`` on ``axes`` (negative steps, out-of-range bounds clamped);
    the output's dims (as inference typed them, or as the runtime bound them from computed
    starts and ends) are the loop counts. Computed starts and steps are read when the kernel
    runs and clamped as ONNX says (the runtime checks the output length inferred from them
    against their values first: ``egraft.lowering.compile._length_assumes_computed_starts``)."""
    _same_dtype(ctx)
    shape = ctx.shape(ctx.in_type(0))
    parameters = _slice_parameters(ctx, len(shape))
    out_shape = ctx.shape(ctx.out_type(0))
    in_strides = contiguous_strides(shape)
    src_strides: list = list(in_strides)
    offset = ir.Constant(I64, 0)
    b = ctx.builder
    for axis, start, step in parameters:
        if isinstance(start, int) and start < 0 and not isinstance(shape[axis], int | sympy.Integer):
            raise Unsupported(f"start {start} on the symbolic axis {shape[axis]}: the output length assumes "
                              f"{shape[axis]} >= {-start}, which only the reference kernel checks")
        if isinstance(step, int):
            src_strides[axis] = in_strides[axis] * step
        else:
            src_strides[axis] = b.mul(ctx.dim(in_strides[axis]), step)
        offset = _add_scaled(ctx, offset, _slice_first(ctx, shape[axis], start, step), in_strides[axis])
    copy_with_strides(ctx, out_shape, ctx.out_ptr(0), contiguous_strides(out_shape), ctx.in_ptr(0), src_strides,
                      src_offset=offset)


@register_kernel("Gather")
def gather(ctx: KernelContext) -> None:
    """``y = take(data, indices, axis)``: for each outer index and each entry of ``indices``
    (int32 or int64, constant or computed; negative ones count from the end), one row of
    ``prod(data.shape[axis+1:])`` elements is copied. Computed indices out of range are clamped
    (the kernel never reads outside ``data``); constant ones out of range are refused."""
    _same_dtype(ctx)
    shape = ctx.shape(ctx.in_type(0))
    axis = _normalize_axis(ctx.attr("axis", 0), len(shape))
    index_type = ctx.in_type(1)
    if index_type.dtype not in (DType.INT64, DType.INT32):
        raise Unsupported(f"Gather indices of dtype {index_type.dtype.short}")
    index_shape = ctx.shape(index_type)
    constant = ctx.constant(1)
    if constant is not None and isinstance(shape[axis], int):
        flat = np.asarray(constant).ravel()
        if flat.size and (flat.min() < -shape[axis] or flat.max() >= shape[axis]):
            raise Unsupported(f"a constant index is out of range for axis {axis} of size {shape[axis]}")
    outer, inner = dim_product(shape[:axis]), dim_product(shape[axis + 1:])
    count = dim_product(index_shape)
    b = ctx.builder
    data, indices, out = ctx.in_ptr(0), ctx.in_ptr(1), ctx.out_ptr(0)
    size = ctx.dim(shape[axis])
    zero = ir.Constant(I64, 0)
    with ctx.loop(ctx.dim(outer), name="o") as o:
        src_base = b.mul(o, ctx.dim(sympy.expand(sympy.sympify(shape[axis]) * inner)))
        dst_base = b.mul(o, ctx.dim(sympy.expand(sympy.sympify(count) * inner)))
        with ctx.loop(ctx.dim(count), name="j") as j:
            index = b.load(b.gep(indices, [j]))
            if index.type != I64:
                index = b.sext(index, I64)
            index = b.select(b.icmp_signed("<", index, zero), b.add(index, size), index)
            index = _smin(b, _smax(b, index, zero), b.sub(size, ir.Constant(I64, 1)))
            copy_run(ctx, out, _add_scaled(ctx, dst_base, j, inner), data, _add_scaled(ctx, src_base, index, inner),
                     inner)


# ---- Pad ----------------------------------------------------------------------------------------
def _pad_parameters(ctx: KernelContext, rank: int) -> tuple[list[int], list[int], object]:
    """(begins, ends, constant value) per axis, from attributes (opset < 11) or constant inputs."""
    if ctx.opset < 11:
        pads = ctx.attr("paddings" if ctx.opset < 2 else "pads", None)
        if pads is None:
            raise Unsupported("Pad without pads")
        pads = [int(p) for p in pads]
        value = ctx.attr("value", 0.0)
        axes = list(range(rank))
    else:
        pads = constant_ints(ctx, 1, "pads")
        if pads is None:
            raise Unsupported("Pad without pads")
        value = 0
        if ctx.has_input(2):
            constant = ctx.constant(2)
            if constant is None:
                raise Unsupported("the pad value is computed at run time")
            value = 0 if np.asarray(constant).size == 0 else np.asarray(constant).ravel()[0]
        axes_given = constant_ints(ctx, 3, "axes")
        axes = list(range(rank)) if axes_given is None else [_normalize_axis(a, rank) for a in axes_given]
    if len(pads) != 2 * len(axes):
        raise Unsupported(f"{len(pads)} pads for {len(axes)} axes")
    begins, ends = [0] * rank, [0] * rank
    for i, a in enumerate(axes):
        begins[a], ends[a] = pads[i], pads[len(axes) + i]
    return begins, ends, value


@register_kernel("Pad")
def pad(ctx: KernelContext) -> None:
    """Pad in modes ``constant``, ``edge``, ``reflect`` and ``wrap``, with constant pads
    (negative pads crop). One loop per axis up to the last padded one; the axes after it are
    one contiguous row: in constant mode the borders are filled runs and the interior rows
    are memcpy'd; in the other modes each output index reads a mapped source index."""
    _same_dtype(ctx)
    mode = ctx.attr("mode", "constant")
    if isinstance(mode, bytes):
        mode = mode.decode()
    if mode not in ("constant", "edge", "reflect", "wrap"):
        raise Unsupported(f"Pad mode {mode!r}")
    shape = ctx.shape(ctx.in_type(0))
    rank = len(shape)
    begins, ends, value = _pad_parameters(ctx, rank)
    crop_begin = [max(0, -p) for p in begins]
    kept = [sympy.expand(n - max(0, -p) - max(0, -q)) if not isinstance(n, int) else n - max(0, -p) - max(0, -q)
            for n, p, q in zip(shape, begins, ends)]
    pad_begin, pad_end = [max(0, p) for p in begins], [max(0, q) for q in ends]
    for k in range(rank):
        if isinstance(kept[k], int) and kept[k] < 0:
            raise Unsupported(f"pads crop axis {k} below zero")
        if mode == "reflect" and isinstance(kept[k], int) and max(pad_begin[k], pad_end[k]) > kept[k] - 1 and \
                (pad_begin[k] or pad_end[k]):
            raise Unsupported(f"reflect pads of {pad_begin[k]}/{pad_end[k]} on an axis of {kept[k]}")
        if mode in ("edge", "wrap") and kept[k] == 0 and (pad_begin[k] or pad_end[k]):
            raise Unsupported(f"{mode} padding of an empty axis")
    out_shape = [p + m + q for p, m, q in zip(pad_begin, kept, pad_end)]
    in_strides, out_strides = contiguous_strides(shape), contiguous_strides(out_shape)
    src, dst = ctx.in_ptr(0), ctx.out_ptr(0)
    src_offset = ctx.dim(sympy.expand(sum((c * s for c, s in zip(crop_begin, in_strides)), sympy.Integer(0))))
    changed = [k for k in range(rank) if begins[k] or ends[k]]
    if not changed:
        emit_strided_copy(ctx, out_shape, dst, out_strides, src, in_strides, src_offset=src_offset)
        return
    last = changed[-1]
    inner = dim_product(out_shape[last + 1:])
    fill = scalar_constant(ctx.out_type(0).dtype, value)
    b = ctx.builder

    def level(k: int, d_off: ir.Value, s_off: ir.Value) -> None:
        if mode == "constant":
            fill_run(ctx, dst, d_off, sympy.expand(pad_begin[k] * out_strides[k]), fill)
            body_start = _add_scaled(ctx, d_off, ir.Constant(I64, pad_begin[k]), out_strides[k])
            if k == last:
                copy_run(ctx, dst, body_start, src, s_off, dim_product([kept[k], inner]))
            else:
                with ctx.loop(ctx.dim(kept[k]), name=f"p{k}") as i:
                    level(k + 1, _add_scaled(ctx, body_start, i, out_strides[k]),
                          _add_scaled(ctx, s_off, i, in_strides[k]))
            tail = _add_scaled(ctx, d_off, ctx.dim(pad_begin[k] + kept[k]), out_strides[k])
            fill_run(ctx, dst, tail, sympy.expand(pad_end[k] * out_strides[k]), fill)
            return
        if k == last:  # borders index by index, the interior as one run
            for first, count in ((0, pad_begin[k]), (pad_begin[k] + kept[k], pad_end[k])):
                if count:
                    with ctx.loop(ctx.dim(count), name=f"b{k}") as i:
                        o = b.add(i, ctx.dim(first))
                        source = _source_index(b, mode, b.sub(o, ir.Constant(I64, pad_begin[k])), ctx.dim(kept[k]))
                        copy_run(ctx, dst, _add_scaled(ctx, d_off, o, out_strides[k]), src,
                                 _add_scaled(ctx, s_off, source, in_strides[k]), inner)
            body_start = _add_scaled(ctx, d_off, ir.Constant(I64, pad_begin[k]), out_strides[k])
            copy_run(ctx, dst, body_start, src, s_off, dim_product([kept[k], inner]))
            return
        with ctx.loop(ctx.dim(out_shape[k]), name=f"p{k}") as o:
            source = _source_index(b, mode, b.sub(o, ir.Constant(I64, pad_begin[k])), ctx.dim(kept[k]))
            level(k + 1, _add_scaled(ctx, d_off, o, out_strides[k]), _add_scaled(ctx, s_off, source, in_strides[k]))

    level(0, ir.Constant(I64, 0), src_offset)


def _source_index(b: ir.IRBuilder, mode: str, r: ir.Value, n: ir.Value) -> ir.Value:
    """The source index of output position ``r`` (relative to the kept region of ``n``) in
    mode ``edge`` (clamp), ``reflect`` (mirror, edge excluded) or ``wrap`` (modulo)."""
    zero, one = ir.Constant(I64, 0), ir.Constant(I64, 1)
    if mode == "edge":
        return _smin(b, _smax(b, r, zero), b.sub(n, one))
    if mode == "reflect":
        r = b.select(b.icmp_signed("<", r, zero), b.neg(r), r)
        mirrored = b.sub(b.mul(b.sub(n, one), ir.Constant(I64, 2)), r)
        return b.select(b.icmp_signed(">=", r, n), mirrored, r)
    rem = b.srem(r, n)
    return b.select(b.icmp_signed("<", rem, zero), b.add(rem, n), rem)


# ---- Cast ---------------------------------------------------------------------------------------
_SIGNED = {DType.INT8, DType.INT32, DType.INT64}


def convert(b: ir.IRBuilder, x: ir.Value, source: DType, target: DType) -> ir.Value:
    """``x`` (of dtype ``source``) converted to ``target`` as numpy's ``astype`` converts:
    floats to ints truncate toward zero, anything to bool is ``x != 0`` (NaN is true), bool
    and uint8 widen with zeros, signed ints with their sign.

    Example: ``convert(b, x, DType.FLOAT32, DType.INT8)`` is ``trunc(fptosi(x) to i32)``.
    """
    t = llvm_type(target)
    if source == target:
        return x
    if target == DType.BOOL:
        if is_float(x.type):
            nonzero = b.fcmp_unordered("!=", x, ir.Constant(x.type, 0.0))
        else:
            nonzero = b.icmp_unsigned("!=", x, ir.Constant(x.type, 0))
        return b.zext(nonzero, I8)
    if is_float(x.type) and is_float(t):
        return b.fpext(x, t) if t == F64 else b.fptrunc(x, t)
    if is_float(x.type):
        if t.width >= 32:
            return b.fptosi(x, t)
        return b.trunc(b.fptosi(x, I32), t)  # as x86 numpy: through a 32-bit int, then the low byte
    if is_float(t):
        return b.sitofp(x, t) if source in _SIGNED else b.uitofp(x, t)
    if t.width > x.type.width:
        return b.sext(x, t) if source in _SIGNED else b.zext(x, t)
    if t.width < x.type.width:
        return b.trunc(x, t)
    return x


@register_kernel("Cast", "CastLike", in_place=True)
def cast(ctx: KernelContext) -> None:
    """``y = x.astype(to)`` between float32/float64/int64/int32/int8/uint8/bool (CastLike:
    the dtype of input 1)."""
    source, target = ctx.in_type(0).dtype, ctx.out_type(0).dtype
    llvm_type(source)
    llvm_type(target)
    emit_elementwise(ctx, lambda b, m, xs: convert(b, xs[0], source, target), [0])


# ---- Shape, Size, ConstantOfShape ------------------------------------------------------------------
@register_kernel("Shape")
def shape_(ctx: KernelContext) -> None:
    """``y = x.shape[start:end]`` as int64 (``start``/``end`` at opset 15+); symbolic dims are
    read from the kernel's ``dims`` argument."""
    from egraft.ir.ops.shape import _shape_range

    shape = ctx.shape(ctx.in_type(0))
    start, end = _shape_range(ctx, len(shape))
    b = ctx.builder
    out = ctx.out_ptr(0)
    for k in range(start, end):
        b.store(ctx.dim(shape[k]), b.gep(out, [ir.Constant(I64, k - start)]))


@register_kernel("Size")
def size_(ctx: KernelContext) -> None:
    """``y = x.size`` as an int64 scalar."""
    b = ctx.builder
    b.store(ctx.numel(ctx.shape(ctx.in_type(0))), b.gep(ctx.out_ptr(0), [ir.Constant(I64, 0)]))


@register_kernel("ConstantOfShape")
def constant_of_shape(ctx: KernelContext) -> None:
    """``y = full(shape, value)``; output dims that only the shape input's value decides are
    bound by the runtime before the kernel runs (``SIZED_BY_INPUT_VALUES``)."""
    value = ctx.attr("value", None)
    value = np.zeros(1, np.float32) if value is None else np.asarray(value)
    dtype = ctx.out_type(0).dtype
    fill = scalar_constant(dtype, value.ravel()[0])
    fill_run(ctx, ctx.out_ptr(0), ir.Constant(I64, 0), dim_product(ctx.shape(ctx.out_type(0))), fill)


@register_kernel("Range")
def range_(ctx: KernelContext) -> None:
    """``y[i] = start + i * delta`` for ``i < len(y)``, computed in the output's dtype as the
    reference does (``i`` converted first). The length is the output's dim: when it depends on
    the scalars' values (``_d0``) the runtime binds it from them before the kernel runs
    (``SIZED_BY_INPUT_VALUES``)."""
    dtype = ctx.out_type(0).dtype
    t = llvm_type(dtype)
    if dtype == DType.BOOL or any(ctx.in_type(i).dtype != dtype for i in range(3)):
        raise Unsupported(f"Range of {dtype.short}")
    (length,) = ctx.shape(ctx.out_type(0))
    b = ctx.builder
    zero = ir.Constant(I64, 0)
    start = b.load(b.gep(ctx.in_ptr(0), [zero]))
    delta = b.load(b.gep(ctx.in_ptr(2), [zero]))
    out = ctx.out_ptr(0)
    with ctx.loop(ctx.dim(length), name="r") as i:
        if is_float(t):
            value = b.fadd(start, b.fmul(b.sitofp(i, t), delta))
        else:
            step = i if t == I64 else b.trunc(i, t)
            value = b.add(start, b.mul(step, delta))
        b.store(value, b.gep(out, [i]))


# ---- comparisons and logic --------------------------------------------------------------------
_COMPARE = {"Equal": "==", "Less": "<", "Greater": ">", "LessOrEqual": "<=", "GreaterOrEqual": ">="}


@register_kernel(*_COMPARE, in_place=True)
def compare(ctx: KernelContext) -> None:
    """``y = a OP b`` as bool, broadcasting; floats compare ordered (NaN is never equal),
    uint8/bool unsigned, the other ints signed."""
    dtype = ctx.in_type(0).dtype
    if ctx.in_type(1).dtype != dtype:
        raise Unsupported(f"{ctx.node.op} of {dtype.short} and {ctx.in_type(1).dtype.short}")
    llvm_type(dtype)
    op = _COMPARE[ctx.node.op]

    def body(b: ir.IRBuilder, m, xs: list[ir.Value]) -> ir.Value:
        x, y = xs
        if is_float(x.type):
            result = b.fcmp_ordered(op, x, y)
        elif dtype in _SIGNED:
            result = b.icmp_signed(op, x, y)
        else:
            result = b.icmp_unsigned(op, x, y)
        return b.zext(result, I8)

    emit_elementwise(ctx, body, [0, 1])


def _truth(b: ir.IRBuilder, x: ir.Value) -> ir.Value:
    return b.icmp_unsigned("!=", x, ir.Constant(x.type, 0))


@register_kernel("Not", "And", "Or", "Xor", in_place=True)
def logic(ctx: KernelContext) -> None:
    """Boolean ``not``, ``and``, ``or``, ``xor`` (broadcasting), on bool tensors."""
    op = ctx.node.op
    for i in range(len(ctx.node.inputs)):
        if ctx.in_type(i).dtype != DType.BOOL:
            raise Unsupported(f"{op} on {ctx.in_type(i).dtype.short}")

    def body(b: ir.IRBuilder, m, xs: list[ir.Value]) -> ir.Value:
        truths = [_truth(b, x) for x in xs]
        if op == "Not":
            result = b.not_(truths[0])
        elif op == "And":
            result = b.and_(*truths)
        elif op == "Or":
            result = b.or_(*truths)
        else:
            result = b.xor(*truths)
        return b.zext(result, I8)

    emit_elementwise(ctx, body, list(range(len(ctx.node.inputs))))


@register_kernel("Reshape", "Squeeze", "Unsqueeze", "Flatten", "Dropout")
def copy_view(ctx: KernelContext) -> None:
    """The view ops as a copy, where they cannot share their input's buffer (a graph output):
    the elements in the same order."""
    outputs = [v for v in ctx.node.outputs if v is not None]
    if len(outputs) != 1 or ctx.node.outputs[0] is None:
        raise Unsupported("Dropout with its mask output has no generated code")
    if ctx.node.op == "Dropout" and ctx.has_input(2):
        ctx.constant(2)  # the code is for this training_mode only (a later Dropout reuses it on the same value)
    if ctx.node.op == "Dropout" and not dropout_is_identity(ctx.node, ctx.opset, ctx.graph.constants):
        raise Unsupported("Dropout in training mode (random) has no generated code")
    _same_dtype(ctx)
    require_bound_dims(ctx)
    count = dim_product(ctx.shape(ctx.out_type(0)))
    zero = ir.Constant(I64, 0)
    copy_run(ctx, ctx.out_ptr(0), zero, ctx.in_ptr(0), zero, count)


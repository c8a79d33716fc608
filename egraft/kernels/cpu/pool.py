"""Pooling and LRN kernels: ``MaxPool`` (no Indices output), ``AveragePool`` (1-D and 2-D,
pads, strides, dilations, ceil_mode, auto_pad, count_include_pad), ``GlobalAveragePool``,
``GlobalMaxPool`` (any rank) and ``LRN`` (across channels).

The windowed pools run one output row at a time, like the direct convolution in
:mod:`egraft.kernels.cpu.conv`: the valid kernel rows of each output row come from
compile-time tables. The interior columns (every tap inside the input) are computed a
vector of outputs at a time, each tap one load (every ``stride``-th lane of a wider load
for strides up to 3); at the borders each kernel column is combined into the output row
over the columns where it is inside the input (compile-time bounds), so those loops run
without a padding branch. AveragePool then divides by the window
counts, a compile-time table computed by the reference kernel's own helper.

With symbolic spatial dims, MaxPool and AveragePool (``count_include_pad = 0``) run the
runtime-bounds kernel of :mod:`egraft.kernels.cpu.pool_symbolic`.

A 3-D window whose last axis is a *lane* axis (window 1, stride 1, no padding: the
channel-blocked layout ``[N, C/8, H, W, 8]`` that egraft/rules/layout.rules pools in) runs
as the 2-D pool over ``(H, W)`` with each element a vector of the lanes.

Example: ``MaxPool(x: f32[batch, 64, 112, 112]) {kernel_shape = [3, 3], strides = [2, 2],
pads = [1, 1, 1, 1]}`` is, per (image, channel, output row), three kernel rows of three
strided max loops over 56 outputs.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
from llvmlite import ir

from egraft.ir.ops.nn_spatial import _pool_window, _Window, _window_counts
from egraft.kernels.cpu import pool_symbolic, register_kernel
from egraft.kernels.cpu.conv import affine, const64, constant_table, output_range, tap_range, vector_pointer
from egraft.kernels.cpu.emit import (
    KernelContext,
    Unsupported,
    is_float,
    llvm_type,
    masked_load,
    masked_store,
    splat,
)
from egraft.kernels.cpu.llvm import host_vector_bits

#: Float flags that let LLVM reorder a sum (vectorized reductions).
REASSOC = ("reassoc", "contract")


def _float_only(ctx: KernelContext) -> ir.Type:
    """The output's float type, when the input has the output's dtype."""
    dtype = ctx.out_type(0).dtype
    t = llvm_type(dtype)
    if not is_float(t) or ctx.in_type(0).dtype != dtype:
        raise Unsupported(f"{ctx.node.op} on {ctx.in_type(0).dtype.short} has no generated code")
    return t


@dataclass(frozen=True)
class PoolGeometry:
    """A 1-D or 2-D pooling window on static spatial dims (1-D: height 1, one kernel row).

    Attributes:
        batch_channels: N * C (an int or a sympy expression; N * C/8 for a blocked input).
        lanes: elements per position: 1, or the lane axis's size for a blocked input.
        in_h, in_w, k_h, k_w, out_h, out_w: spatial sizes of input, kernel and output.
        stride_h, stride_w, dil_h, dil_w, pad_h, pad_w: the window (pads are begin pads).
        window, begins, ends, spatial, outs: the reference's window and its resolution.
    """

    batch_channels: object
    in_h: int
    in_w: int
    k_h: int
    k_w: int
    out_h: int
    out_w: int
    stride_h: int
    stride_w: int
    dil_h: int
    dil_w: int
    pad_h: int
    pad_w: int
    window: _Window
    spatial: tuple[int, ...]
    outs: tuple[int, ...]
    begins: tuple[int, ...]
    ends: tuple[int, ...]
    lanes: int = 1

    def row_taps(self, oh: int) -> tuple[int, int]:
        """The kernel rows ``[lo, hi)`` inside the input for output row ``oh``."""
        return tap_range(oh, self.in_h, self.stride_h, self.dil_h, self.pad_h, self.k_h)

    def column_range(self, kw: int) -> tuple[int, int]:
        """The output columns ``[lo, hi)`` whose tap ``kw`` is inside the input."""
        return output_range(kw, self.in_w, self.out_w, self.stride_w, self.dil_w, self.pad_w)


def pool_geometry(ctx: KernelContext) -> PoolGeometry:
    """The window of a MaxPool/AveragePool node from its attributes and static spatial dims;
    :class:`Unsupported` for symbolic spatial dims or a 3-D (or higher) window.

    Example: ``MaxPool(f32[1, 8, 9, 9]) {kernel_shape = [3, 3], strides = [2, 2]}`` has
    ``out_h == out_w == 4``.
    """
    x_shape, out_shape = ctx.shape(ctx.in_type(0)), ctx.shape(ctx.out_type(0))
    if len(x_shape) not in (3, 4, 5):
        raise Unsupported(f"a {len(x_shape) - 2}-D pooling window has no generated code (1-D and 2-D only)")
    spatial = x_shape[2:]
    if not all(isinstance(d, int) for d in (*spatial, *out_shape[2:])):
        raise Unsupported(f"spatial dims {list(spatial)} are not static")
    try:
        win = _pool_window(ctx)
    except ValueError as e:
        raise Unsupported(str(e)) from None
    if win.rank != len(spatial):
        raise Unsupported(f"a {win.rank}-D kernel on {len(spatial)} spatial dims")
    outs, begins, ends = win.resolve(spatial)
    if list(outs) != list(out_shape[2:]):
        raise Unsupported(f"output spatial dims {list(out_shape[2:])} differ from the window's {outs}")
    lanes = 1
    if len(spatial) == 3:
        lanes = spatial[2]
        lane_axis = (win.kernel[2], win.strides[2], win.dilations[2], begins[2], ends[2], outs[2])
        if lane_axis != (1, 1, 1, 0, 0, lanes) or lanes not in (4, 8, 16):
            raise Unsupported("a 3-D pooling window has generated code only as a blocked layout's 2-D window "
                              "(last axis of 4, 8 or 16 lanes, window 1, stride 1, no padding)")
    batch_channels = x_shape[0] * x_shape[1]
    common = dict(window=win, spatial=tuple(spatial), outs=tuple(outs), begins=tuple(begins), ends=tuple(ends))
    if len(spatial) == 1:
        return PoolGeometry(batch_channels, 1, spatial[0], 1, win.kernel[0], 1, outs[0], 1, win.strides[0],
                            1, win.dilations[0], 0, begins[0], **common)
    return PoolGeometry(batch_channels, spatial[0], spatial[1], win.kernel[0], win.kernel[1], outs[0], outs[1],
                        win.strides[0], win.strides[1], win.dilations[0], win.dilations[1], begins[0], begins[1],
                        lanes=lanes, **common)


#: ``(builder, math, accumulated, value) -> combined``.
Combine = Callable[[ir.IRBuilder, object, ir.Value, ir.Value], ir.Value]


def emit_window_pool(ctx: KernelContext, t: ir.Type, geo: PoolGeometry, start: float, combine: Combine,
                     counts: np.ndarray | None = None) -> None:
    """``y[nc, oh, ow] = combine`` over the window's input elements, from ``start``; then, with
    ``counts`` (shape ``(out_h * out_w,)``), divided by the count of the output's window."""
    b = ctx.builder
    x, y = ctx.in_ptr(0), ctx.out_ptr(0)
    kh_lo = constant_table(ctx, "kh_lo", [geo.row_taps(oh)[0] for oh in range(geo.out_h)])
    kh_hi = constant_table(ctx, "kh_hi", [geo.row_taps(oh)[1] for oh in range(geo.out_h)])
    count_table = constant_table(ctx, "counts", counts.tolist(), t) if counts is not None else None
    # an element is one value, or a vector of the blocked layout's lanes
    et = t if geo.lanes == 1 else ir.VectorType(t, geo.lanes)
    first = ir.Constant(et, start if geo.lanes == 1 else [start] * geo.lanes)

    def element(ptr: ir.Value, index: ir.Value) -> ir.Value:
        """The pointer to element ``index`` (a position: ``lanes`` values) of ``ptr``."""
        if geo.lanes == 1:
            return b.gep(ptr, [index])
        return vector_pointer(b, ptr, b.mul(index, const64(geo.lanes)), geo.lanes)

    # the interior columns (every tap inside the input) go a vector of outputs at a time, the
    # last, partial vector with its lanes past the interior masked off
    width = host_vector_bits() // (8 * (4 if t == ir.FloatType() else 8))
    ranges = [geo.column_range(kw) for kw in range(geo.k_w)]
    vector_lo, vector_hi = max(r[0] for r in ranges), min(r[1] for r in ranges)
    if geo.stride_w > 3 or geo.dil_w != 1 or vector_hi - vector_lo < width or geo.lanes > 1:
        vector_lo = vector_hi = 0
    vectors, rest = divmod(vector_hi - vector_lo, width)
    planes_lo, planes_hi = ctx.share(ctx.dim(geo.batch_channels))  # planes are independent: split over threads
    with ctx.loop(planes_hi, name="nc", start=planes_lo) as nc:
        with ctx.loop(geo.out_h, name="oh") as oh:
            y_row = affine(b, [(nc, geo.out_h * geo.out_w), (oh, geo.out_w)])
            for init_lo, init_hi in ((0, vector_lo), (vector_hi, geo.out_w)):  # the columns the vectors leave
                if init_hi > init_lo:
                    with ctx.loop(init_hi, name="ow0", start=init_lo) as ow:
                        b.store(first, element(y, b.add(y_row, ow)), align=4)
            lo, hi = b.load(b.gep(kh_lo, [oh])), b.load(b.gep(kh_hi, [oh]))

            def x_row_at(kh: ir.Value) -> ir.Value:
                return affine(b, [(nc, geo.in_h * geo.in_w), (oh, geo.stride_h * geo.in_w),
                                  (kh, geo.dil_h * geo.in_w)], -geo.pad_h * geo.in_w)

            with ctx.loop(hi, name="kh", start=lo) as kh:
                x_row = x_row_at(kh)
                for kw in range(geo.k_w):
                    col_lo, col_hi = geo.column_range(kw)
                    x_tap = b.add(x_row, const64(kw * geo.dil_w - geo.pad_w))
                    for part_lo, part_hi in ((col_lo, min(col_hi, vector_lo)), (max(col_lo, vector_hi), col_hi)):
                        if part_hi <= part_lo:
                            continue
                        with ctx.loop(part_hi, name="ow", start=part_lo) as ow:
                            out = element(y, b.add(y_row, ow))
                            value = b.load(element(x, b.add(x_tap, affine(b, [(ow, geo.stride_w)]))), align=4)
                            b.store(combine(b, ctx.math, b.load(out, align=4), value), out, align=4)
            if vector_hi > vector_lo:
                vt = ir.VectorType(t, width)
                every = ir.Constant(ir.VectorType(ir.IntType(32), width), [i * geo.stride_w for i in range(width)])
                acc = ctx.alloca(vt, name="pool.acc")

                def taps_mask(outputs: int) -> ir.Constant:
                    """The lanes of a tap's ``stride * width`` wide load that ``outputs`` outputs read."""
                    span = (outputs - 1) * geo.stride_w + 1
                    return ir.Constant(ir.VectorType(ir.IntType(1), width * geo.stride_w),
                                       [int(i < span) for i in range(width * geo.stride_w)])

                def vector_of_outputs(ow0: ir.Value, outputs: int) -> None:
                    b.store(ir.Constant(vt, [start] * width), acc)
                    with ctx.loop(hi, name="khv", start=lo) as kh:
                        x_row = x_row_at(kh)
                        for kw in range(geo.k_w):
                            src = b.add(b.add(x_row, const64(kw * geo.dil_w - geo.pad_w)),
                                        b.mul(ow0, const64(geo.stride_w)))
                            if geo.stride_w == 1 and outputs == width:
                                lanes = b.load(b.bitcast(b.gep(x, [src]), vt.as_pointer()), align=4)
                            else:  # whole registers, the lanes past the last tap never read
                                lanes = masked_load(b, x, src, taps_mask(outputs))
                                if geo.stride_w > 1:
                                    wide = lanes.type
                                    lanes = b.shuffle_vector(lanes, ir.Constant(wide, None), every)
                            b.store(combine(b, ctx.math, b.load(acc), lanes), acc)
                    if outputs == width:
                        b.store(b.load(acc), b.bitcast(b.gep(y, [b.add(y_row, ow0)]), vt.as_pointer()), align=4)
                    else:
                        mask = ir.Constant(ir.VectorType(ir.IntType(1), width),
                                           [int(i < outputs) for i in range(width)])
                        masked_store(b, b.load(acc), y, b.add(y_row, ow0), mask)

                if vectors:
                    with ctx.loop(vectors, name="ov") as v:
                        vector_of_outputs(b.add(const64(vector_lo), b.mul(v, const64(width))), width)
                if rest:
                    vector_of_outputs(const64(vector_lo + vectors * width), rest)
            if count_table is not None:
                count_row = b.mul(oh, const64(geo.out_w))
                with ctx.loop(geo.out_w, name="ow1") as ow:
                    out = element(y, b.add(y_row, ow))
                    count = b.load(b.gep(count_table, [b.add(count_row, ow)]))
                    if geo.lanes > 1:
                        count = splat(b, count, geo.lanes)
                    b.store(b.fdiv(b.load(out, align=4), count), out, align=4)


@register_kernel("MaxPool")
def max_pool(ctx: KernelContext) -> None:
    """MaxPool (1-D or 2-D) without the Indices output: pads, strides, dilations, ceil_mode,
    auto_pad. NaN propagates (as the reference's ``np.maximum``).

    Example: ``MaxPool(x) {kernel_shape = [3, 3], strides = [2, 2], pads = [1, 1, 1, 1]}``.
    """
    if len(ctx.node.outputs) > 1 and ctx.node.outputs[1] is not None:
        raise Unsupported("MaxPool's Indices output has no generated code")
    t = _float_only(ctx)
    combine = lambda b, m, acc, v: m.maximum(acc, v)
    if pool_symbolic.has_symbolic_spatial_dims(ctx):
        pool_symbolic.emit_symbolic_pool(ctx, t, float("-inf"), combine, average=False)
        return
    emit_window_pool(ctx, t, pool_geometry(ctx), float("-inf"), combine)


@register_kernel("AveragePool")
def average_pool(ctx: KernelContext) -> None:
    """AveragePool (1-D or 2-D): pads, strides, dilations, ceil_mode, auto_pad and
    count_include_pad (the window counts are the reference kernel's).

    Example: ``AveragePool(x) {kernel_shape = [3, 3], pads = [1, 1, 1, 1], count_include_pad = 1}``.
    """
    t = _float_only(ctx)
    include_pad = bool(ctx.attr("count_include_pad", 0))
    if pool_symbolic.has_symbolic_spatial_dims(ctx) and not include_pad:
        pool_symbolic.emit_symbolic_pool(ctx, t, 0.0, lambda b, m, acc, v: b.fadd(acc, v), average=True)
        return
    geo = pool_geometry(ctx)
    counts = _window_counts(geo.window, geo.spatial, geo.outs, geo.begins, geo.ends, include_pad)
    counts = np.broadcast_to(counts, (1, 1, *geo.outs))
    if geo.lanes > 1:
        counts = counts[..., 0]  # the same for every lane
    counts = counts.reshape(-1)
    emit_window_pool(ctx, t, geo, 0.0, lambda b, m, acc, v: b.fadd(acc, v), counts)


def _global_pool(ctx: KernelContext, average: bool) -> None:
    t = _float_only(ctx)
    shape = ctx.shape(ctx.in_type(0))
    if len(shape) < 3:
        raise Unsupported(f"{ctx.node.op} needs N x C x D1 x ...; the input has rank {len(shape)}")
    b = ctx.builder
    x, y = ctx.in_ptr(0), ctx.out_ptr(0)
    size = ctx.numel(shape[2:])
    acc = ctx.alloca(t, name="acc")
    with ctx.loop(ctx.numel(shape[:2]), name="nc") as nc:
        b.store(ir.Constant(t, 0.0 if average else float("-inf")), acc)
        base = b.mul(nc, size)
        with ctx.loop(size, name="i") as i:
            value = b.load(b.gep(x, [b.add(base, i)]))
            total = b.load(acc)
            b.store(b.fadd(total, value, flags=REASSOC) if average else ctx.math.maximum(total, value), acc)
        result = b.load(acc)
        if average:
            result = b.fdiv(result, b.sitofp(size, t))
        b.store(result, b.gep(y, [nc]))


@register_kernel("GlobalAveragePool")
def global_average_pool(ctx: KernelContext) -> None:
    """The mean over every spatial axis (any rank; symbolic dims allowed).

    Example: ``GlobalAveragePool(f32[batch, 512, 7, 7]) -> f32[batch, 512, 1, 1]``.
    """
    _global_pool(ctx, average=True)


@register_kernel("GlobalMaxPool")
def global_max_pool(ctx: KernelContext) -> None:
    """The max over every spatial axis (any rank; symbolic dims allowed; NaN propagates).

    Example: ``GlobalMaxPool(f32[batch, 512, 7, 7]) -> f32[batch, 512, 1, 1]``.
    """
    _global_pool(ctx, average=False)


def _power(ctx: KernelContext, base: ir.Value, exponent: float) -> ir.Value:
    """``base ** exponent`` for a positive ``base``, with square roots for 0.5 and 0.75."""
    m, b = ctx.math, ctx.builder
    if exponent == 1.0:
        return base
    if exponent == 0.5:
        return m.sqrt(base)
    if exponent == 0.75:
        root = m.sqrt(base)
        return b.fmul(root, m.sqrt(root))
    return m._intrinsic("pow", base, ir.Constant(base.type, exponent))


@register_kernel("LRN")
def lrn(ctx: KernelContext) -> None:
    """LRN across channels: ``y = x / (bias + alpha / size * sum(x[c']^2))^beta`` with ``c'`` in
    ``[c - floor((size-1)/2), c + ceil((size-1)/2)]`` clipped to the channels. The window sum
    is accumulated in the output row, then turned into the result in place. The output
    channels are shared out over the kernel's parts (each reads its own window of inputs).

    Example: ``LRN(x: f32[batch, 96, 55, 55]) {size = 5, alpha = 1e-4, beta = 0.75, bias = 1}``.
    """
    t = _float_only(ctx)
    shape = ctx.shape(ctx.in_type(0))
    if len(shape) < 3 or not isinstance(shape[1], int):
        raise Unsupported(f"LRN needs a static channel dim; the input is {list(shape)}")
    size = int(ctx.attr("size"))
    alpha, beta, bias = float(ctx.attr("alpha", 1e-4)), float(ctx.attr("beta", 0.75)), float(ctx.attr("bias", 1.0))
    channels = int(shape[1])
    before, after = (size - 1) // 2, size - 1 - (size - 1) // 2
    b = ctx.builder
    x, y = ctx.in_ptr(0), ctx.out_ptr(0)
    plane = ctx.numel(shape[2:])
    zero, last = const64(0), const64(channels)
    first, stop = ctx.share(channels)
    with ctx.loop(ctx.dim(shape[0]), name="n") as n:
        with ctx.loop(stop, name="c", start=first) as c:
            lo = b.sub(c, const64(before))
            lo = b.select(b.icmp_signed("<", lo, zero), zero, lo)
            hi = b.add(c, const64(after + 1))
            hi = b.select(b.icmp_signed(">", hi, last), last, hi)
            image = b.mul(n, const64(channels))
            y_row = b.mul(b.add(image, c), plane)
            with ctx.loop(plane, name="i0") as i:
                b.store(ir.Constant(t, 0.0), b.gep(y, [b.add(y_row, i)]))
            with ctx.loop(hi, name="cc", start=lo) as cc:
                x_row = b.mul(b.add(image, cc), plane)
                with ctx.loop(plane, name="i1") as i:
                    value = b.load(b.gep(x, [b.add(x_row, i)]))
                    out = b.gep(y, [b.add(y_row, i)])
                    b.store(b.fadd(b.load(out), b.fmul(value, value, flags=REASSOC), flags=REASSOC), out)
            with ctx.loop(plane, name="i2") as i:
                out = b.gep(y, [b.add(y_row, i)])
                scaled = b.fadd(ir.Constant(t, bias), b.fmul(ir.Constant(t, alpha / size), b.load(out)))
                b.store(b.fdiv(b.load(b.gep(x, [b.add(y_row, i)])), _power(ctx, scaled, beta)), out)

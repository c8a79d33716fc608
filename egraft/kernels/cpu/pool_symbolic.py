"""MaxPool and AveragePool with symbolic spatial dims: one kernel for every input size.

The pools of :mod:`egraft.kernels.cpu.pool` plan their borders at compile time; this
kernel computes them at run time, as :mod:`egraft.kernels.cpu.conv_symbolic` does for the
convolution: per output row the valid kernel rows, per kernel column the output columns
whose tap is inside the input, and the innermost loop over contiguous output columns with
no branch. AveragePool divides by the number of taps inside the input
(``count_include_pad = 0``; with 1 the count depends on the pads' layout and the static
kernel serves it). A channel-blocked input (``[N, C/8, H, W, 8]``, the lane axis pooled by
a window of 1) pools a vector of lanes per position. Planes are split over threads.

Example: ``MaxPool(x: f32[1, 16, h, w]) {kernel_shape = [3, 3], strides = [2, 2]}`` gives
``f32[1, 16, floor(h/2 - 3/2) + 1, floor(w/2 - 3/2) + 1]`` from one compiled kernel.
"""

from __future__ import annotations

from llvmlite import ir

from egraft.ir.ops.nn_spatial import _pool_window
from egraft.kernels.cpu.conv import vector_pointer
from egraft.kernels.cpu.conv_symbolic import begin_pad, has_symbolic_spatial_dims, valid_range
from egraft.kernels.cpu.emit import I64, KernelContext, Unsupported, const64, splat


def emit_symbolic_pool(ctx: KernelContext, t: ir.Type, start: float, combine, average: bool) -> None:
    """``y = combine`` over each window's input elements from ``start`` (then, for ``average``,
    divided by the count of taps inside the input), with runtime spatial sizes."""
    x_shape, out_shape = ctx.shape(ctx.in_type(0)), ctx.shape(ctx.out_type(0))
    try:
        win = _pool_window(ctx)
    except ValueError as e:
        raise Unsupported(str(e)) from None
    spatial, outs = list(x_shape[2:]), list(out_shape[2:])
    if win.rank != len(spatial) or len(spatial) not in (1, 2, 3):
        raise Unsupported(f"a {win.rank}-D window on {len(spatial)} spatial dims has no generated code")
    lanes = 1
    if len(spatial) == 3:  # the channel-blocked layout: the last axis is lanes, pooled by a window of 1
        lanes = spatial[2]
        lane_axis = (win.kernel[2], win.strides[2], win.dilations[2], win.pads[2], win.pads[5])
        if not isinstance(lanes, int) or lanes not in (4, 8, 16) or lane_axis != (1, 1, 1, 0, 0) \
                or win.auto_pad != "NOTSET":
            raise Unsupported("a 3-D pooling window has generated code only as a blocked layout's 2-D window")
        spatial, outs = spatial[:2], outs[:2]
    pads = [begin_pad(win, i, n, o) for i, (n, o) in enumerate(zip(spatial, outs))]
    if len(spatial) == 1:
        spatial, outs, pads = [1, spatial[0]], [1, outs[0]], [0, pads[0]]
        kernel, strides, dilations = (1, win.kernel[0]), (1, win.strides[0]), (1, win.dilations[0])
    else:
        kernel, strides, dilations = win.kernel[:2], win.strides[:2], win.dilations[:2]
    b = ctx.builder
    x, y = ctx.in_ptr(0), ctx.out_ptr(0)
    in_h, in_w, out_h, out_w = (ctx.dim(d) for d in (*spatial, *outs))
    pad_h, pad_w = ctx.dim(pads[0]), ctx.dim(pads[1])
    et = t if lanes == 1 else ir.VectorType(t, lanes)
    first = ir.Constant(et, start if lanes == 1 else [start] * lanes)

    def element(ptr: ir.Value, index: ir.Value) -> ir.Value:
        return b.gep(ptr, [index]) if lanes == 1 else vector_pointer(b, ptr, b.mul(index, const64(lanes)), lanes)

    columns = []  # per kernel column: (input offset, first and last + 1 output column inside the input)
    for kw in range(kernel[1]):
        offset = b.sub(const64(kw * dilations[1]), pad_w)
        columns.append((offset, *valid_range(b, offset, strides[1], in_w, out_w)))
    planes_lo, planes_hi = ctx.share(ctx.dim(x_shape[0] * x_shape[1]))
    with ctx.loop(planes_hi, name="nc", start=planes_lo) as nc:
        with ctx.loop(out_h, name="oh") as oh:
            y_row = b.mul(b.add(b.mul(nc, out_h), oh), out_w)
            with ctx.loop(out_w, name="ow0") as ow:
                b.store(first, element(y, b.add(y_row, ow)), align=4)
            top = b.sub(b.mul(oh, const64(strides[0])), pad_h)
            kh_lo, kh_hi = valid_range(b, top, dilations[0], in_h, const64(kernel[0]))
            with ctx.loop(kh_hi, name="kh", start=kh_lo) as kh:
                ih = b.add(top, b.mul(kh, const64(dilations[0])))
                x_row = b.mul(b.add(b.mul(nc, in_h), ih), in_w)
                for offset, lo, hi in columns:
                    x_tap = b.add(x_row, offset)
                    with ctx.loop(hi, name="ow", start=lo) as ow:
                        out = element(y, b.add(y_row, ow))
                        value = b.load(element(x, b.add(x_tap, b.mul(ow, const64(strides[1])))), align=4)
                        b.store(combine(b, ctx.math, b.load(out, align=4), value), out, align=4)
            if average:
                rows = b.sub(kh_hi, kh_lo)
                rows = b.select(b.icmp_signed("<", rows, const64(0)), const64(0), rows)
                with ctx.loop(out_w, name="ow1") as ow:
                    taps = const64(0)
                    for _, lo, hi in columns:
                        inside = b.and_(b.icmp_signed(">=", ow, lo), b.icmp_signed("<", ow, hi))
                        taps = b.add(taps, b.zext(inside, I64))
                    count = b.sitofp(b.mul(rows, taps), t)
                    if lanes > 1:
                        count = splat(b, count, lanes)
                    out = element(y, b.add(y_row, ow))
                    b.store(b.fdiv(b.load(out, align=4), count), out, align=4)


__all__ = ["emit_symbolic_pool", "has_symbolic_spatial_dims"]

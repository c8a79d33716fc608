"""Convolution with symbolic spatial dims as products through ``egraft_sgemm``: the runtime
twin of :mod:`egraft.kernels.cpu.conv_gemm`.

The static path builds its implicit-im2col offset tables at compile time. Here the
heights and widths are known only when the kernel runs, so the kernel writes the tables
into its own scratch (after the library's packing buffers), from the bound dims:

- per tap ``k = (c, kh, kw)``, once per call: the tap's offset in the image
  ``c*H*W + kh*dil*W + kw*dil`` and its row and column shifts;
- per chunk of :data:`CHUNK` output pixels: each pixel's window corner (``n_h``, ``n_w``)
  and, per panel of ``NR`` pixels, the runs of output rows it spans (the library packs a
  panel of at most :data:`~egraft.kernels.cpu.sgemm.MAX_SEGMENTS` runs with vector loads).

Each chunk of each image and group is one product ``M x CHUNK x K`` with the bias and the
residual in the library's epilogue; an activation the library lacks (sigmoid, SiLU,
HardSwish...) is applied to the chunk right after, while it is in cache. The chunks are
shared over the kernel's parts, so a part never touches another part's pixels; when a call
has fewer chunks than parts, its pixels are cut into as many chunks as parts instead, of
whole panels (ddddocr_ocr's 3x3 convolutions on 16 x 16 and 8 x 8 ran whole on one part:
1.0x at 2 threads, now 1.8-1.9x).

Example: ppocr's ``Conv(x: f32[1, 240, 8, floor(w/4 - 1/4) + 1], w: f32[240, 240, 3, 3])`` is,
at ``w = 320``, 2 chunks of one ``240 x 512 x 2160`` product (the last one 128 wide).
"""

from __future__ import annotations

from llvmlite import ir

from egraft.kernels.cpu import conv_gemm  # also registers the "conv_gemm.panels" packing
from egraft.kernels.cpu.emit import I64, KernelContext, ceil_div, const64, imax, imin
from egraft.kernels.cpu.sgemm import BIAS_PER_ROW, KERNEL_SCRATCH_BYTES, MAX_SEGMENTS, Epilogue, blocking, emit_call

#: Output pixels per product (a multiple of every blocking's ``NR``): enough columns for the
#: micro-kernel to stream the packed weights well, small enough to share an image over threads.
CHUNK = 512


def table_bytes(taps: int) -> int:
    """Bytes of scratch the runtime tables take for ``taps`` taps (see the module docstring)."""
    panels = CHUNK // blocking().nr
    return 8 * (3 * taps + 2 * CHUNK + panels + panels * MAX_SEGMENTS * 4)


def fits(ctx: KernelContext, g, residual: int | None) -> bool:
    """Whether the convolution of geometry ``g`` (a :class:`~egraft.kernels.cpu.conv_symbolic.SymbolicGeometry`)
    runs as products: fp32 operands, not depthwise, a residual of the output's own shape,
    tables that fit the kernel's scratch."""
    if ctx.out_type(0).dtype.short != "f32" or any(ctx.in_type(i).dtype.short != "f32" for i in (0, 1)):
        return False
    if g.channels // g.group == 1 and g.group > 1:
        return False  # depthwise: nothing to reuse in a product
    if not conv_gemm.residual_fits(ctx, residual):
        return False
    return table_bytes(g.channels // g.group * g.k_h * g.k_w) <= KERNEL_SCRATCH_BYTES


def emit_symbolic_conv_gemm(ctx: KernelContext, g, bias: int | None, residual: int | None, activation: str,
                            params: tuple[float, ...]) -> None:
    """``y = act(conv(x, w) + bias + z)`` for the node as products with runtime tables;
    :func:`fits` must hold."""
    b = ctx.builder
    blk = blocking()
    group_in, go = g.channels // g.group, g.out_channels // g.group
    taps = g.k_h * g.k_w
    k = group_in * taps
    in_h, in_w, out_h, out_w = (ctx.dim(d) for d in (g.in_h, g.in_w, g.out_h, g.out_w))
    pad_h, pad_w = ctx.dim(g.pad_h), ctx.dim(g.pad_w)
    plane_in, pixels = b.mul(in_h, in_w), b.mul(out_h, out_w)

    if ctx.is_constant(1):
        a_base, _ = ctx.packed_constant("packed_w", "conv_gemm.panels", 1, group=g.group, mr=blk.mr)
        a_fields: dict = {"a_packed": 1}
        group_a = (-(-go // blk.mr)) * blk.mr * k
    else:
        a_base, a_fields, group_a = ctx.in_ptr(1), {"a_rs": k, "a_cs": 1}, go * k
    x, y = ctx.in_ptr(0), ctx.out_ptr(0)
    bias_ptr = ctx.in_ptr(bias) if bias is not None else None
    z = ctx.in_ptr(residual) if residual is not None else None

    # the tables, in the kernel's scratch after the library's packing buffers
    packing_bytes = 4 * (-(-blk.scratch_floats // 16) * 16)
    base = b.bitcast(b.gep(ctx.scratch, [const64(packing_bytes)]), I64.as_pointer())
    panels = CHUNK // blk.nr
    k_off, k_h, k_w = (b.gep(base, [const64(i * k)]) for i in range(3))
    n_h = b.gep(base, [const64(3 * k)])
    n_w = b.gep(n_h, [const64(CHUNK)])
    panel_run = b.gep(n_w, [const64(CHUNK)])
    segments = b.gep(panel_run, [const64(panels)])

    with ctx.loop(k, name="tap") as t:  # per tap: (c, kh, kw) -> offset and shifts
        c, r = b.sdiv(t, const64(taps)), b.srem(t, const64(taps))
        row_shift = b.mul(b.sdiv(r, const64(g.k_w)), const64(g.dil_h))
        column_shift = b.mul(b.srem(r, const64(g.k_w)), const64(g.dil_w))
        b.store(row_shift, b.gep(k_h, [t]))
        b.store(column_shift, b.gep(k_w, [t]))
        b.store(b.add(b.mul(c, plane_in), b.add(b.mul(row_shift, in_w), column_shift)), b.gep(k_off, [t]))

    # chunks of CHUNK pixels; with fewer chunks than parts (an OCR line's 16 x 16 pixels at 2
    # threads ran whole on one part), as many chunks as parts, of whole panels
    few = b.icmp_signed("<", b.mul(b.mul(ctx.dim(g.batch), const64(g.group)), ceil_div(b, pixels, CHUNK)), ctx.parts)
    per_part = b.sdiv(b.add(pixels, b.sub(ctx.parts, const64(1))), ctx.parts)
    shared = b.mul(ceil_div(b, per_part, blk.nr), const64(blk.nr))
    size = b.select(few, imin(b, imax(b, shared, const64(blk.nr)), const64(CHUNK)), const64(CHUNK))
    chunks = b.sdiv(b.add(pixels, b.sub(size, const64(1))), size)
    per_image = b.mul(chunks, const64(g.group))
    lo, hi = ctx.share(b.mul(ctx.dim(g.batch), per_image))
    library_act = activation if Epilogue.fits(activation) else ""
    with ctx.loop(hi, name="item", start=lo) as item:
        chunk, rest = b.srem(item, chunks), b.sdiv(item, chunks)
        grp, image = b.srem(rest, const64(g.group)), b.sdiv(rest, const64(g.group))
        p0 = b.mul(chunk, size)
        count = imin(b, size, b.sub(pixels, p0))
        with ctx.loop(count, name="pixel") as j:  # each pixel's window corner
            p = b.add(p0, j)
            oh = b.sdiv(p, out_w)
            ow = b.sub(p, b.mul(oh, out_w))
            b.store(b.sub(b.mul(oh, const64(g.stride_h)), pad_h), b.gep(n_h, [j]))
            b.store(b.sub(b.mul(ow, const64(g.stride_w)), pad_w), b.gep(n_w, [j]))
        _emit_runs(ctx, g, count, p0, out_w, pad_h, pad_w, panel_run, segments)
        x_at = b.mul(b.add(b.mul(image, const64(g.channels)), b.mul(grp, const64(group_in))), plane_in)
        y_at = b.add(b.mul(b.add(b.mul(image, const64(g.out_channels)), b.mul(grp, const64(go))), pixels), p0)
        epilogue = Epilogue(bias=b.gep(bias_ptr, [b.mul(grp, const64(go))]) if bias_ptr is not None else None,
                            bias_kind=BIAS_PER_ROW, res=b.gep(z, [y_at]) if z is not None else None, ldr=pixels,
                            activation=library_act, params=params if library_act else ())
        emit_call(ctx, {"m": go, "n": count, "k": k, "a": b.gep(a_base, [b.mul(grp, const64(group_a))]), **a_fields,
                        "b": b.gep(x, [x_at]), "conv": 1, "k_off": k_off, "k_h": k_h, "k_w": k_w, "n_h": n_h,
                        "n_w": n_w, "panel_run": panel_run, "segments": segments, "run_stride": g.stride_w,
                        "height": in_h, "width": in_w, "c": b.gep(y, [y_at]), "ldc": pixels}, epilogue,
                  parallel=False)
        if activation and not library_act:  # while the chunk is in cache
            with ctx.loop(go, name="row") as row:
                start = b.add(y_at, b.mul(row, pixels))
                with ctx.loop(count, name="column") as j:
                    at = b.gep(y, [b.add(start, j)])
                    b.store(ctx.math.activation(activation, list(params), b.load(at)), at)


def _emit_runs(ctx: KernelContext, g, count: ir.Value, p0: ir.Value, out_w: ir.Value, pad_h: ir.Value,
               pad_w: ir.Value, panel_run: ir.Value, segments: ir.Value) -> None:
    """Per panel of ``NR`` pixels of the chunk: the runs of output rows it spans (first and
    end lane, the row's window top and the first lane's window left), or 0 runs when there
    are more than :data:`MAX_SEGMENTS` or the stride is over 2 (the library then gathers the
    panel element by element), as :func:`egraft.kernels.cpu.conv_gemm.conv_tables` does."""
    b = ctx.builder
    nr = blocking().nr
    with ctx.loop(ceil_div(b, count, nr), name="panel") as q:
        first_lane = b.mul(q, const64(nr))
        end_lane = imin(b, b.add(first_lane, const64(nr)), count)
        first_row = b.sdiv(b.add(p0, first_lane), out_w)
        last_row = b.sdiv(b.sub(b.add(p0, end_lane), const64(1)), out_w)
        rows = b.add(b.sub(last_row, first_row), const64(1))
        ok = b.icmp_signed("<=", rows, const64(MAX_SEGMENTS))
        runs = b.select(ok, rows, const64(0)) if g.stride_w in (1, 2) else const64(0)
        b.store(runs, b.gep(panel_run, [q]))
        with ctx.loop(runs, name="run") as s:
            row = b.add(first_row, s)
            row_start = b.sub(b.mul(row, out_w), p0)  # the row's first pixel, as a lane of the chunk
            first = imax(b, first_lane, row_start)
            end = imin(b, end_lane, b.add(row_start, out_w))
            at = b.gep(segments, [b.mul(b.add(b.mul(q, const64(MAX_SEGMENTS)), s), const64(4))])
            b.store(b.sub(first, first_lane), at)
            b.store(b.sub(end, first_lane), b.gep(at, [const64(1)]))
            b.store(b.sub(b.mul(row, const64(g.stride_h)), pad_h), b.gep(at, [const64(2)]))
            b.store(b.sub(b.mul(b.sub(first, row_start), const64(g.stride_w)), pad_w), b.gep(at, [const64(3)]))


__all__ = ["CHUNK", "fits", "emit_symbolic_conv_gemm", "table_bytes"]

"""Depthwise convolution on channel-blocked tensors: egraft's ``ConvNCHWc`` with ``group ==
C == M`` (one filter per channel: the 3x3 and 5x5 layers of MobileNet, PP-LCNet,
ShuffleNet), ``act(conv + bias + Z)``.

In the blocked layout ``[N, C/8, H, W, 8]`` the 8 channels of a block sit side by side, so
each tap of a block is one vector multiply-add: ``acc[pixel] += x[row, column, 0:8] *
w[kh, kw, 0:8]``, with no reduction across lanes (the NCHW kernels vectorize along a row,
which wastes lanes on 7- and 14-pixel rows and needs a separate loop per channel). A work
item is one (channel block, output row); the parts share them out. Per item:

- the valid kernel rows ``[kh_lo, kh_hi)`` come from compile-time tables (no padding
  branch at the top and bottom);
- the interior columns (every tap inside the row) run :data:`TILE_PIXELS` output pixels
  at a time, their accumulators in registers, the kernel columns unrolled;
- the border columns (at most ``pad / stride`` of them on each side) are unrolled one
  pixel each with only their valid kernel columns, known at compile time.

The packed weights are ``[C/8, KH, KW, 8]`` (:func:`pack_depthwise`).

Example: ``ConvNCHWc(xb: f32[1, 32, 14, 14, 8], w: f32[256, 1, 5, 5]) {group = 256, pads = [2, 2, 2, 2]}``
runs 32 x 14 items; each has 10 interior columns (one tile of 8 and one of 2) and 2 + 2
border columns, each pixel 25 (or fewer) vector multiply-adds.
"""

from __future__ import annotations

import numpy as np
from llvmlite import ir

from egraft.kernels.cpu.conv import ConvGeometry, affine, const64, constant_table, fmuladd, vector_pointer
from egraft.kernels.cpu.emit import F32, KernelContext, Unsupported, register_packing

#: Channels per block (the blocked layout's).
BLOCK = 8
#: Output pixels per register tile of the interior columns.
TILE_PIXELS = 8


@register_packing("conv_nchwc.depthwise", gather=True)
def pack_depthwise(w: np.ndarray) -> np.ndarray:
    """Depthwise weights ``[C, 1, KH, KW]`` as ``[C/8, KH, KW, 8]``, flat: each tap of a
    channel block is one vector.

    Example:
        >>> w = np.arange(16 * 9, dtype=np.float32).reshape(16, 1, 3, 3)
        >>> pack_depthwise(w)[:8].tolist() == w[:8, 0, 0, 0].tolist()
        True
    """
    w = np.asarray(w, np.float32)
    c, _, kh, kw = w.shape
    return np.ascontiguousarray(w.reshape(c // BLOCK, BLOCK, kh, kw).transpose(0, 2, 3, 1)).reshape(-1)


def emit_depthwise(ctx: KernelContext, geo: ConvGeometry, bias: int | None, residual: int | None,
                   activation: str = "", params=()) -> None:
    """The kernel of a blocked depthwise convolution (see the module docstring)."""
    if geo.channels % BLOCK:
        raise Unsupported(f"{geo.channels} channels are not whole blocks of {BLOCK}")
    b = ctx.builder
    vector = ir.VectorType(F32, BLOCK)
    x, y = ctx.in_ptr(0), ctx.out_ptr(0)
    weights, _ = ctx.packed_constant("packed_dw", "conv_nchwc.depthwise", 1)
    bias_ptr = ctx.in_ptr(bias) if bias is not None else None
    z = ctx.in_ptr(residual) if residual is not None else None
    blocks = geo.channels // BLOCK
    kh_lo = constant_table(ctx, "kh_lo", [geo.row_taps(oh)[0] for oh in range(geo.out_h)])
    kh_hi = constant_table(ctx, "kh_hi", [geo.row_taps(oh)[1] for oh in range(geo.out_h)])
    ranges = [geo.column_range(kw) for kw in range(geo.k_w)]  # output columns where tap kw is inside
    inside_lo = min(max(lo for lo, _ in ranges), geo.out_w)
    inside_hi = max(min(hi for _, hi in ranges), inside_lo)
    in_plane, out_plane = geo.in_h * geo.in_w * BLOCK, geo.out_h * geo.out_w * BLOCK
    taps = geo.k_h * geo.k_w * BLOCK

    def vload(pointer: ir.Value, index: ir.Value) -> ir.Value:
        return b.load(vector_pointer(b, pointer, index, BLOCK), align=4)

    def vstore(value: ir.Value, pointer: ir.Value, index: ir.Value) -> None:
        b.store(value, vector_pointer(b, pointer, index, BLOCK), align=4)

    lo, hi = ctx.share(blocks * geo.out_h)
    with ctx.loop(ctx.dim(geo.batch), name="n") as n:
        with ctx.loop(hi, name="item", start=lo) as item:
            cb, oh = b.sdiv(item, const64(geo.out_h)), b.srem(item, const64(geo.out_h))
            image = b.add(b.mul(n, const64(blocks)), cb)
            x_plane = b.gep(x, [b.mul(image, const64(in_plane))])
            y_row = affine(b, [(image, out_plane), (oh, geo.out_w * BLOCK)])
            w_block = b.gep(weights, [b.mul(cb, const64(taps))])
            start = bias_ptr and vload(bias_ptr, b.mul(cb, const64(BLOCK)))
            first_kh, last_kh = b.load(b.gep(kh_lo, [oh])), b.load(b.gep(kh_hi, [oh]))
            top = b.sub(b.mul(oh, const64(geo.stride_h)), const64(geo.pad_h))

            def pixels(ow0: ir.Value, count: int, columns: list[list[int]]) -> None:
                """``count`` output pixels from column ``ow0``, pixel ``j`` over kernel columns
                ``columns[j]``: accumulated over the valid kernel rows, then the epilogue."""
                zero = ir.Constant(vector, [0.0] * BLOCK)
                slots = [ctx.alloca(vector, name=f"dw{j}") for j in range(count)]
                for slot in slots:
                    b.store(start if start is not None else zero, slot)
                left = b.sub(b.mul(ow0, const64(geo.stride_w)), const64(geo.pad_w))
                with ctx.loop(last_kh, name="kh", start=first_kh) as kh:
                    row = b.add(top, b.mul(kh, const64(geo.dil_h)))
                    x_row = b.gep(x_plane, [b.mul(b.add(b.mul(row, const64(geo.in_w)), left), const64(BLOCK))])
                    w_row = b.gep(w_block, [b.mul(kh, const64(geo.k_w * BLOCK))])
                    acc = [b.load(slot) for slot in slots]
                    for kw in range(geo.k_w):
                        w = vload(w_row, const64(kw * BLOCK))
                        for j in range(count):
                            if kw in columns[j]:
                                at = const64((j * geo.stride_w + kw * geo.dil_w) * BLOCK)
                                acc[j] = fmuladd(ctx, w, vload(x_row, at), acc[j])
                    for slot, value in zip(slots, acc):
                        b.store(value, slot)
                for j, slot in enumerate(slots):
                    at = b.add(y_row, b.mul(b.add(ow0, const64(j)), const64(BLOCK)))
                    value = b.load(slot)
                    if z is not None:
                        value = b.fadd(value, vload(z, at))
                    vstore(ctx.math.activation(activation, list(params), value), y, at)

            every = list(range(geo.k_w))
            full, rest = divmod(inside_hi - inside_lo, TILE_PIXELS)
            if full:
                with ctx.loop(const64(full), name="tile") as t:
                    pixels(b.add(const64(inside_lo), b.mul(t, const64(TILE_PIXELS))), TILE_PIXELS,
                           [every] * TILE_PIXELS)
            if rest:
                pixels(const64(inside_lo + full * TILE_PIXELS), rest, [every] * rest)
            for ow in [*range(inside_lo), *range(inside_hi, geo.out_w)]:  # the border columns
                valid = [kw for kw, (first, end) in enumerate(ranges) if first <= ow < end]
                pixels(const64(ow), 1, [valid])


__all__ = ["BLOCK", "TILE_PIXELS", "emit_depthwise", "pack_depthwise"]

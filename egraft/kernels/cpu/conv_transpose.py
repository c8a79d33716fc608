"""ConvTranspose (N-D, float32/float64) over any spatial dims, symbolic ones included: groups,
strides, dilations, pads, ``output_padding``, ``output_shape`` and ``auto_pad`` (the geometry
is the op registry's, :func:`egraft.ir.ops.nn_spatial._conv_transpose_geometry`).

Each input pixel ``i`` scatters ``x[n, c, i] * w[c, m, t]`` to the output pixel
``o = i * stride + t * dilation - pad_begin`` of every tap ``t``. The parallel unit is a block
of 4 output channels of one image and group: their planes start as the bias; then for each
tap (unrolled, the taps are constants) one pass over the input pixels whose ``o`` falls inside
the output. Those pixels form one box, ``[lo, hi)`` per axis with ``lo = max(0, ceil((pad - t *
dilation) / stride))`` and ``hi = min(in, floor((out - 1 + pad - t * dilation) / stride) + 1)``,
computed when the kernel runs. Along the last axis the box is cut into vectors of input
pixels (masked at its end): per input channel one vector load and one multiply-add into each
output channel's accumulator, then the sums are added into the output, lane by lane (``o``
steps by the stride).

Example: ppocr's detection head ``ConvTranspose(x: f32[1, 24, h, w], w: f32[24, 24, 2, 2],
strides=[2, 2])`` gives ``f32[1, 24, 2*h, 2*w]``: 6 blocks of 4 output channels, each 4 taps x ``h x w / 8``
vectors of 24 loads and 96 multiply-adds.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import sympy
from llvmlite import ir

from egraft.ir.dims import dim_product
from egraft.ir.ops.nn_spatial import _conv_transpose_geometry
from egraft.kernels.cpu import register_kernel
from egraft.kernels.cpu.data import contiguous_strides, fill_run
from egraft.kernels.cpu.emit import (
    F32,
    I32,
    I64,
    KernelContext,
    Unsupported,
    ceil_div,
    floor_div,
    imax,
    imin,
    is_float,
    llvm_type,
    masked_load,
    splat,
)


@register_kernel("ConvTranspose")
def conv_transpose(ctx: KernelContext) -> None:
    """``y[n, m, o] = b[m] + sum over c in m's group and taps t with o = i*s + t*d - p of
    x[n, c, i] * w[c, m mod M/group, t]``."""
    dtype = ctx.out_type(0).dtype
    element = llvm_type(dtype)
    if not is_float(element) or ctx.in_type(0).dtype != dtype or ctx.in_type(1).dtype != dtype:
        raise Unsupported(f"ConvTranspose of {ctx.in_type(0).dtype.short} into {dtype.short}")
    x_shape, w_shape = ctx.shape(ctx.in_type(0)), ctx.shape(ctx.in_type(1))
    out_shape = ctx.shape(ctx.out_type(0))
    nd = len(x_shape) - 2
    if nd < 1 or len(w_shape) != nd + 2 or len(out_shape) != nd + 2:
        raise Unsupported(f"ConvTranspose of x {list(x_shape)} and w {list(w_shape)}")
    kernel = list(w_shape[2:])
    if not all(isinstance(k, int | sympy.Integer) for k in kernel) or not isinstance(w_shape[1], int | sympy.Integer):
        raise Unsupported(f"weights of shape {list(w_shape)}: the taps and output channels must be known")
    kernel = [int(k) for k in kernel]
    group = int(ctx.attr("group", 1))
    channels = x_shape[1]
    if group != 1 and (not isinstance(channels, int | sympy.Integer) or int(channels) % group):
        raise Unsupported(f"{channels} input channels in {group} groups")
    group_channels = channels if group == 1 else int(channels) // group
    group_outputs = int(w_shape[1])
    strides = [int(s) for s in ctx.attr("strides", None) or [1] * nd]
    dilations = [int(d) for d in ctx.attr("dilations", None) or [1] * nd]
    if min(strides + dilations) < 1:
        raise Unsupported(f"strides {strides} and dilations {dilations} must be positive")
    try:
        _, begins, _ = _conv_transpose_geometry(ctx, list(x_shape[2:]), kernel)
    except ValueError as e:
        raise Unsupported(str(e)) from None

    b = ctx.builder
    x, w, y = ctx.in_ptr(0), ctx.in_ptr(1), ctx.out_ptr(0)
    bias = ctx.in_ptr(2) if ctx.has_input(2) else None
    in_spatial, out_spatial = list(x_shape[2:]), list(out_shape[2:])
    in_strides, out_strides = contiguous_strides(in_spatial), contiguous_strides(out_spatial)
    in_plane, out_plane = ctx.dim(dim_product(in_spatial)), ctx.dim(dim_product(out_spatial))
    taps = dim_product(kernel)
    blocks = -(-group_outputs // BLOCK)
    const = lambda v: ir.Constant(I64, v)  # noqa: E731
    geometry = _Geometry(in_spatial, out_spatial, in_strides, out_strides, strides, dilations, begins)

    first, last = ctx.share(ctx.dim(dim_product([x_shape[0], group, blocks])))
    with ctx.loop(last, name="unit", start=first) as unit:  # unit = (n * group + g) * blocks + block
        image_group, block = b.sdiv(unit, const(blocks)), b.srem(unit, const(blocks))
        n, g = b.sdiv(image_group, const(group)), b.srem(image_group, const(group))
        m_first = b.mul(block, const(BLOCK))  # in the group
        x_base = b.mul(b.add(b.mul(n, ctx.dim(channels)), b.mul(g, ctx.dim(group_channels))), in_plane)
        y_image = b.mul(b.add(b.mul(n, ctx.dim(out_shape[1])), b.mul(g, const(group_outputs))), out_plane)

        def channel_block(width: int) -> None:
            """Output channels ``m_first .. m_first + width`` of group ``g``: bias, then every tap."""
            y_planes = [b.add(y_image, b.mul(b.add(m_first, const(j)), out_plane)) for j in range(width)]
            for j in range(width):
                m = b.add(b.mul(g, const(group_outputs)), b.add(m_first, const(j)))
                value = ir.Constant(element, 0.0) if bias is None else b.load(b.gep(bias, [m]))
                fill_run(ctx, y, y_planes[j], dim_product(out_spatial), value)
            for number, tap in enumerate(itertools.product(*(range(k) for k in kernel))):
                w_at = [b.add(b.mul(b.add(m_first, const(j)), const(taps)), const(number))
                        for j in range(width)]  # w[c, m, tap] is w[c * group_outputs * taps + these]
                _tap_pass(ctx, geometry, tap, element, x, x_base, w, w_at, const(group_outputs * taps),
                          ctx.dim(group_channels), b.mul(g, ctx.dim(group_channels)), y, y_planes)

        rest = group_outputs % BLOCK
        if not rest:
            channel_block(BLOCK)
        else:
            full = b.icmp_signed("<=", b.add(m_first, const(BLOCK)), const(group_outputs))
            with b.if_else(full) as (whole, partial):
                with whole:
                    channel_block(BLOCK)
                with partial:
                    channel_block(rest)


#: Output channels computed together (one vector accumulator each, sharing the input's loads).
BLOCK = 4


@dataclass(frozen=True)
class _Geometry:
    in_spatial: list
    out_spatial: list
    in_strides: list
    out_strides: list
    strides: list
    dilations: list
    begins: list


def _tap_pass(ctx: KernelContext, geo: _Geometry, tap, element, x, x_base, w, w_at, w_channel_stride, channels,
              channel_first, y, y_planes) -> None:
    """``y[m][o(i)] += sum over c of w[c, m, tap] * x[c][i]`` for the block's output channels
    ``m``, over the box of input pixels ``i`` whose output pixel ``o(i) = i * stride + tap *
    dilation - pad`` lies inside the output: vectors of input pixels along the last axis (a
    masked load per channel, one accumulator per output channel), added into ``y`` lane by lane."""
    b = ctx.builder
    const = lambda v: ir.Constant(I64, v)  # noqa: E731
    bounds, y_shift = [], const(0)
    for axis, t in enumerate(tap):
        shift = b.sub(const(t * geo.dilations[axis]), ctx.dim(geo.begins[axis]))  # o = i * s + shift
        lo = imax(b, ceil_div(b, b.neg(shift), geo.strides[axis]), const(0))
        top = b.sub(b.sub(ctx.dim(geo.out_spatial[axis]), const(1)), shift)
        hi = imin(b, b.add(floor_div(b, top, geo.strides[axis]), const(1)), ctx.dim(geo.in_spatial[axis]))
        bounds.append((lo, hi))
        y_shift = b.add(y_shift, b.mul(shift, ctx.dim(geo.out_strides[axis])))
    lanes = 8 if element == F32 else 4
    vector = ir.VectorType(element, lanes)
    last = len(tap) - 1

    def row(x_row: ir.Value, y_row: ir.Value) -> None:
        lo, hi = bounds[last]
        count = b.sub(hi, lo)
        with ctx.loop(b.sdiv(b.add(count, const(lanes - 1)), const(lanes)), name="v") as v:
            i = b.add(lo, b.mul(v, const(lanes)))
            left = b.sub(hi, i)
            mask = b.icmp_signed(">", splat(b, left, lanes), ir.Constant(ir.VectorType(I64, lanes), list(range(lanes))))
            slots = [ctx.alloca(vector, name=f"acc{j}") for j in range(len(y_planes))]
            for slot in slots:
                b.store(ir.Constant(vector, [0.0] * lanes), slot)
            with ctx.loop(channels, name="c") as c:
                xv = masked_load(b, x, b.add(b.add(x_row, b.mul(c, ctx.dim(dim_product(geo.in_spatial)))), i), mask)
                w_c = b.mul(b.add(channel_first, c), w_channel_stride)
                for j, slot in enumerate(slots):
                    weight = splat(b, b.load(b.gep(w, [b.add(w_c, w_at[j])])), lanes)
                    b.store(b.fadd(b.load(slot), b.fmul(weight, xv)), slot)
            step = ctx.dim(geo.strides[last])
            for j, slot in enumerate(slots):
                acc = b.load(slot)
                for lane in range(lanes):
                    with b.if_then(b.icmp_signed(">", left, const(lane))):
                        o = b.add(y_row, b.mul(b.add(i, const(lane)), step))
                        target = b.gep(y, [b.add(y_planes[j], o)])
                        b.store(b.fadd(b.load(target), b.extract_element(acc, ir.Constant(I32, lane))), target)

    def nest(axis: int, x_at: ir.Value, y_at: ir.Value) -> None:
        if axis == last:
            row(x_at, y_at)
            return
        lo, hi = bounds[axis]
        with ctx.loop(hi, name=f"i{axis}", start=lo) as i:
            nest(axis + 1, b.add(x_at, b.mul(i, ctx.dim(geo.in_strides[axis]))),
                 b.add(y_at, b.mul(i, ctx.dim(sympy.expand(geo.out_strides[axis] * geo.strides[axis])))))

    nest(0, x_base, y_shift)

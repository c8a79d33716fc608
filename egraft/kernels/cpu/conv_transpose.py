"""ConvTranspose (N-D, float32/float64) over any spatial dims, symbolic ones included: groups,
strides, dilations, pads, ``output_padding``, ``output_shape`` and ``auto_pad`` (the geometry
is the op registry's, :func:`egraft.ir.ops.nn_spatial._conv_transpose_geometry`).

Each input pixel ``i`` scatters ``x[n, c, i] * w[c, m, t]`` to the output pixel
``o = i * stride + t * dilation - pad_begin`` of every tap ``t``. The kernel is output-plane
stationary: for one ``(n, m)`` plane (the parallel share), the plane starts as the bias;
then for each input channel ``c`` of ``m``'s group and each tap ``t`` (unrolled, the taps are
constants), one pass over the input pixels whose ``o`` falls inside the output adds
``w[c, m, t] * x[n, c, i]``. Those pixels form one box per tap, ``[lo, hi)`` per axis with
``lo = max(0, ceil((pad - t * dilation) / stride))`` and ``hi = min(in, floor((out - 1 + pad -
t * dilation) / stride) + 1)``, computed when the kernel runs, so the inner loop has no test.

Example: ppocr's detection head ``ConvTranspose(x: f32[1, 24, h, w], w: f32[24, 24, 2, 2],
strides=[2, 2])`` gives ``f32[1, 24, 2*h, 2*w]``: 24 planes, each 24 channels x 4 taps of
``h x w`` multiply-adds.
"""

from __future__ import annotations

import itertools

import sympy
from llvmlite import ir

from egraft.ir.dims import dim_product
from egraft.ir.ops.nn_spatial import _conv_transpose_geometry
from egraft.kernels.cpu import register_kernel
from egraft.kernels.cpu.data import contiguous_strides, fill_run
from egraft.kernels.cpu.emit import (
    I64,
    KernelContext,
    Unsupported,
    ceil_div,
    floor_div,
    imax,
    imin,
    is_float,
    llvm_type,
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
    planes = ctx.dim(dim_product([x_shape[0], out_shape[1]]))
    outputs = ctx.dim(out_shape[1])
    taps = dim_product(kernel)
    zero_value = ir.Constant(element, 0.0)

    first, last = ctx.share(planes)
    with ctx.loop(last, name="plane", start=first) as plane:  # plane = n * M + m
        n, m = b.sdiv(plane, outputs), b.srem(plane, outputs)
        g, m_in_group = b.sdiv(m, ir.Constant(I64, group_outputs)), b.srem(m, ir.Constant(I64, group_outputs))
        y_base = b.mul(plane, out_plane)
        start = zero_value if bias is None else b.load(b.gep(bias, [m]))
        fill_run(ctx, y, y_base, dim_product(out_spatial), start)
        with ctx.loop(ctx.dim(group_channels), name="c") as c_in_group:
            c = b.add(b.mul(g, ctx.dim(group_channels)), c_in_group)
            x_base = b.mul(b.add(b.mul(n, ctx.dim(channels)), c), in_plane)
            w_base = b.mul(b.add(b.mul(c, ir.Constant(I64, group_outputs)), m_in_group), ir.Constant(I64, taps))
            for number, tap in enumerate(itertools.product(*(range(k) for k in kernel))):
                weight = b.load(b.gep(w, [b.add(w_base, ir.Constant(I64, number))]))
                _tap_pass(ctx, tap, weight, x, x_base, y, y_base, in_spatial, out_spatial, in_strides, out_strides,
                          strides, dilations, begins)


def _tap_pass(ctx: KernelContext, tap, weight, x, x_base, y, y_base, in_spatial, out_spatial, in_strides,
              out_strides, strides, dilations, begins) -> None:
    """``y[o(i)] += weight * x[i]`` over the box of input pixels ``i`` whose output pixel
    ``o(i) = i * stride + tap * dilation - pad`` lies inside the output."""
    b = ctx.builder
    bounds = []
    y_offset = y_base
    for axis, t in enumerate(tap):
        shift = b.sub(ir.Constant(I64, t * dilations[axis]), ctx.dim(begins[axis]))  # o = i * s + shift
        lo = imax(b, ceil_div(b, b.neg(shift), strides[axis]), ir.Constant(I64, 0))
        hi = imin(b, b.add(floor_div(b, b.sub(b.sub(ctx.dim(out_spatial[axis]), ir.Constant(I64, 1)), shift),
                                     strides[axis]), ir.Constant(I64, 1)), ctx.dim(in_spatial[axis]))
        bounds.append((lo, hi))
        y_offset = b.add(y_offset, b.mul(shift, ctx.dim(out_strides[axis])))

    def nest(axis: int, x_at: ir.Value, y_at: ir.Value) -> None:
        lo, hi = bounds[axis]
        with ctx.loop(hi, name=f"i{axis}", start=lo) as i:
            x_here = b.add(x_at, b.mul(i, ctx.dim(in_strides[axis])))
            y_here = b.add(y_at, b.mul(i, ctx.dim(sympy.expand(out_strides[axis] * strides[axis]))))
            if axis + 1 < len(tap):
                nest(axis + 1, x_here, y_here)
                return
            target = b.gep(y, [y_here])
            b.store(b.fadd(b.load(target), b.fmul(weight, b.load(b.gep(x, [x_here])))), target)

    nest(0, x_base, y_offset)

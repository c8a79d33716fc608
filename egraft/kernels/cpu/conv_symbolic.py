"""Convolution with symbolic spatial dims: one kernel for every input size.

The direct convolution of :mod:`egraft.kernels.cpu.conv` plans its borders at compile time
(tables of valid kernel rows per output row, column tiles at fixed positions), so it needs
static spatial dims. This kernel computes the same borders at run time from the bound
dims: per output row, the valid kernel rows ``[kh_lo, kh_hi)``; per kernel column, the
output columns whose tap is inside the input ``[ow_lo, ow_hi)``; the innermost loop runs
over contiguous output columns with no branch (LLVM vectorizes it at unit stride). Input
and output heights and widths and the begin pads (``auto_pad`` SAME makes them depend on
the input) are ``i64`` values computed in the entry block (:meth:`KernelContext.dim`).
Channels, the kernel, strides and dilations stay static. FusedConv's residual and
activation are applied to each finished row; output channels are split over threads.
The same kernel serves ``ConvNCHWc`` (input, output and residual channel-blocked): only
where an element lives changes (:class:`_Layout`).

Example: ``Conv(x: f32[1, 3, h, w], w: f32[8, 3, 3, 3]) {strides = [2, 2], pads = [1, 1, 1, 1]}``
gives ``y: f32[1, 8, floor((h - 1)/2) + 1, floor((w - 1)/2) + 1]`` from one compiled kernel.
"""

from __future__ import annotations

from dataclasses import dataclass

import sympy
from llvmlite import ir

from egraft.ir.ops.layout import unblocked_shape
from egraft.ir.ops.nn_spatial import _SAME, _window
from egraft.kernels.cpu.elementwise import broadcast_strides
from egraft.kernels.cpu.emit import I64, KernelContext, Unsupported, floor_div

CONTRACT = ("contract",)


def _c(value: int) -> ir.Constant:
    return ir.Constant(I64, int(value))


@dataclass(frozen=True)
class SymbolicGeometry:
    """A 2-D convolution's window with runtime spatial sizes (a 1-D one has height 1).

    ``in_h``, ``in_w``, ``out_h``, ``out_w``, ``pad_h``, ``pad_w`` are sympy expressions (or
    ints) over the symbolic dims; the rest are ints.
    """

    batch: object
    channels: int
    out_channels: int
    group: int
    in_h: object
    in_w: object
    out_h: object
    out_w: object
    pad_h: object
    pad_w: object
    k_h: int
    k_w: int
    stride_h: int
    stride_w: int
    dil_h: int
    dil_w: int


def begin_pad(win, axis: int, n, out) -> object:
    """The begin pad along ``axis`` as a dim expression (``auto_pad`` SAME pads depend on ``n``)."""
    if win.auto_pad in _SAME:
        total = sympy.Max(0, (sympy.sympify(out) - 1) * win.strides[axis] + win.extent(axis) - sympy.sympify(n))
        return sympy.floor(total / 2) if win.auto_pad == "SAME_UPPER" else total - sympy.floor(total / 2)
    if win.auto_pad == "VALID":
        return 0
    return win.pads[axis]


def symbolic_geometry(ctx: KernelContext, block: int | None = None) -> SymbolicGeometry:
    """The geometry of the node's convolution when its spatial dims are symbolic; the
    channels and weights must be static (:class:`Unsupported` otherwise). ``block``: the
    input and output are channel-blocked (``[N, C/block, H, W, block]``)."""
    x_shape, w_shape = ctx.shape(ctx.in_type(0)), ctx.shape(ctx.in_type(1))
    out_shape = ctx.shape(ctx.out_type(0))
    if block is not None:
        try:
            x_shape, out_shape = unblocked_shape(x_shape, block), unblocked_shape(out_shape, block)
        except ValueError as e:
            raise Unsupported(str(e)) from None
    rank = len(x_shape)
    if rank not in (3, 4) or len(w_shape) != rank:
        raise Unsupported(f"a {rank - 2}-D convolution has no generated code (1-D and 2-D only)")
    if not all(isinstance(d, int) for d in (x_shape[1], *w_shape)):
        raise Unsupported(f"the channel dim {x_shape[1]} or the weight dims {list(w_shape)} are not static")
    channels, (out_channels, per_group, *kernel) = int(x_shape[1]), [int(d) for d in w_shape]
    given = ctx.attr("kernel_shape", None)
    if given and [int(k) for k in given] != kernel:
        raise Unsupported(f"kernel_shape {list(given)} differs from the weights' {kernel}")
    group = int(ctx.attr("group", 1))
    if group < 1 or channels % group or out_channels % group or per_group * group != channels:
        raise Unsupported(f"group {group} does not divide {channels} input / {out_channels} output channels")
    try:
        win = _window(ctx, kernel)
    except ValueError as e:
        raise Unsupported(str(e)) from None
    spatial, outs = list(x_shape[2:]), list(out_shape[2:])
    pads = [begin_pad(win, i, n, o) for i, (n, o) in enumerate(zip(spatial, outs))]
    if rank == 3:
        return SymbolicGeometry(x_shape[0], channels, out_channels, group, 1, spatial[0], 1, outs[0], 0, pads[0],
                                1, kernel[0], 1, win.strides[0], 1, win.dilations[0])
    return SymbolicGeometry(x_shape[0], channels, out_channels, group, spatial[0], spatial[1], outs[0], outs[1],
                            pads[0], pads[1], kernel[0], kernel[1], win.strides[0], win.strides[1],
                            win.dilations[0], win.dilations[1])


def ceil_div(b: ir.IRBuilder, n: ir.Value, d: int) -> ir.Value:
    """``ceil(n / d)`` for a positive constant ``d``."""
    return b.neg(floor_div(b, b.neg(n), d))


def imax(b: ir.IRBuilder, x: ir.Value, y: ir.Value) -> ir.Value:
    """The larger of two ``i64`` values."""
    return b.select(b.icmp_signed(">", x, y), x, y)


def imin(b: ir.IRBuilder, x: ir.Value, y: ir.Value) -> ir.Value:
    """The smaller of two ``i64`` values."""
    return b.select(b.icmp_signed("<", x, y), x, y)


class _Layout:
    """Where element ``(n, c, h, w)`` of an ``[N, C, H, W]`` tensor lives: plain NCHW, or
    channel-blocked (``[N, C/block, H, W, block]``): a row's base offset and the step
    between neighbouring columns."""

    def __init__(self, b: ir.IRBuilder, channels: int, height: ir.Value, width: ir.Value, block: int | None):
        self.b, self.channels, self.height, self.width, self.block = b, channels, height, width, block
        self.step = _c(block or 1)

    def row(self, n: ir.Value, c: ir.Value, h: ir.Value) -> ir.Value:
        b = self.b
        if self.block is None:
            plane = b.add(b.mul(n, _c(self.channels)), c)
            return b.mul(b.add(b.mul(plane, self.height), h), self.width)
        plane = b.add(b.mul(n, _c(self.channels // self.block)), b.sdiv(c, _c(self.block)))
        row = b.mul(b.add(b.mul(plane, self.height), h), b.mul(self.width, _c(self.block)))
        return b.add(row, b.srem(c, _c(self.block)))

    def at(self, row: ir.Value, column: ir.Value) -> ir.Value:
        return self.b.add(row, column if self.block is None else self.b.mul(column, self.step))


def emit_symbolic_conv(ctx: KernelContext, t: ir.Type, bias: int | None, residual: int | None,
                       activation: str, params: tuple[float, ...], block: int | None = None) -> None:
    """``y = act(conv(x, w) + bias + z)`` for the node, with runtime spatial sizes; ``block``:
    input, output and residual are channel-blocked (the residual then has the output's shape)."""
    g = symbolic_geometry(ctx, block)
    b = ctx.builder
    x, w, y = ctx.in_ptr(0), ctx.in_ptr(1), ctx.out_ptr(0)
    bias_ptr = ctx.in_ptr(bias) if bias is not None else None
    z = ctx.in_ptr(residual) if residual is not None else None
    in_h, in_w, out_h, out_w = (ctx.dim(d) for d in (g.in_h, g.in_w, g.out_h, g.out_w))
    pad_h, pad_w = ctx.dim(g.pad_h), ctx.dim(g.pad_w)
    x_layout = _Layout(b, g.channels, in_h, in_w, block)
    y_layout = _Layout(b, g.out_channels, out_h, out_w, block)
    group_in, group_out = g.channels // g.group, g.out_channels // g.group
    z_strides = None
    if z is not None and block is None:
        out_shape = ctx.shape(ctx.out_type(0))
        strides = broadcast_strides(ctx.shape(ctx.in_type(residual)), out_shape)
        z_strides = [ctx.dim(s) if s != 0 else None for s in strides]
        if len(out_shape) == 3:  # 1-D: (n, c, w) -> (n, c, h = 1, w)
            z_strides = [z_strides[0], z_strides[1], None, z_strides[2]]
    # the output columns [lo, hi) whose tap kw is inside the input, per kw (the same for every row)
    column_ranges = []
    for kw in range(g.k_w):
        offset = b.sub(_c(kw * g.dil_w), pad_w)  # input column = ow * stride + offset
        lo = imax(b, _c(0), ceil_div(b, b.neg(offset), g.stride_w))
        hi = imin(b, out_w, b.add(floor_div(b, b.sub(b.sub(in_w, _c(1)), offset), g.stride_w), _c(1)))
        column_ranges.append((offset, lo, hi))
    zero = ir.Constant(t, 0.0)
    oc_lo, oc_hi = ctx.share(g.out_channels)
    with ctx.loop(ctx.dim(g.batch), name="n") as n:
        with ctx.loop(oc_hi, name="oc", start=oc_lo) as oc:
            grp = b.sdiv(oc, _c(group_out))
            bias_value = b.load(b.gep(bias_ptr, [oc])) if bias_ptr is not None else zero
            with ctx.loop(out_h, name="oh") as oh:
                y_row = y_layout.row(n, oc, oh)
                with ctx.loop(out_w, name="ow0") as ow:
                    b.store(bias_value, b.gep(y, [y_layout.at(y_row, ow)]))
                top = b.sub(b.mul(oh, _c(g.stride_h)), pad_h)  # input row of kernel row 0
                kh_lo = imax(b, _c(0), ceil_div(b, b.neg(top), g.dil_h))
                kh_hi = imin(b, _c(g.k_h), b.add(floor_div(b, b.sub(b.sub(in_h, _c(1)), top), g.dil_h), _c(1)))
                with ctx.loop(group_in, name="ic") as ic:
                    channel = b.add(b.mul(grp, _c(group_in)), ic)
                    w_base = b.mul(b.add(b.mul(oc, _c(group_in)), ic), _c(g.k_h * g.k_w))
                    with ctx.loop(kh_hi, name="kh", start=kh_lo) as kh:
                        ih = b.add(top, b.mul(kh, _c(g.dil_h)))
                        x_row = x_layout.row(n, channel, ih)
                        w_row = b.add(w_base, b.mul(kh, _c(g.k_w)))
                        for kw, (offset, lo, hi) in enumerate(column_ranges):
                            weight = b.load(b.gep(w, [b.add(w_row, _c(kw))]))
                            with ctx.loop(hi, name="ow", start=lo) as ow:
                                out = b.gep(y, [y_layout.at(y_row, ow)])
                                iw = b.add(b.mul(ow, _c(g.stride_w)), offset)
                                value = b.load(b.gep(x, [x_layout.at(x_row, iw)]))
                                b.store(b.fadd(b.load(out), b.fmul(weight, value, flags=CONTRACT),
                                               flags=CONTRACT), out)
                if z is not None or activation:
                    z_row = None
                    if z_strides is not None:
                        z_row = _c(0)
                        for index, stride in zip((n, oc, oh), z_strides[:3]):
                            if stride is not None:
                                z_row = b.add(z_row, b.mul(index, stride))
                    with ctx.loop(out_w, name="owe") as ow:
                        at_y = y_layout.at(y_row, ow)
                        out = b.gep(y, [at_y])
                        value = b.load(out)
                        if z is not None and block is not None:  # a blocked residual has the output's shape
                            value = b.fadd(value, b.load(b.gep(z, [at_y])))
                        elif z_row is not None:
                            at = z_row if z_strides[3] is None else b.add(z_row, b.mul(ow, z_strides[3]))
                            value = b.fadd(value, b.load(b.gep(z, [at])))
                        b.store(ctx.math.activation(activation, list(params), value), out)


def has_symbolic_spatial_dims(ctx: KernelContext) -> bool:
    """Whether the node's input or output spatial dims are symbolic (the static kernels refuse those)."""
    return any(not isinstance(d, int) for shape in (ctx.shape(ctx.in_type(0)), ctx.shape(ctx.out_type(0)))
               for d in shape[2:])


__all__ = ["SymbolicGeometry", "symbolic_geometry", "emit_symbolic_conv", "has_symbolic_spatial_dims", "begin_pad",
           "ceil_div", "imax", "imin"]

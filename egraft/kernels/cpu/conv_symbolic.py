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
activation are applied to each finished row; blocks of output channels are split over
threads. At horizontal strides 1 and 2 in the plain layout every column runs in register
tiles: ``BLOCK_CHANNELS`` output channels times up to ``TILE_VECTORS`` vectors of columns
accumulated over input channels and taps, as the static kernel does. At stride 1 the
interior columns (every tap inside the input) take unmasked tiles and the columns around
them tiles whose taps read through runtime lane masks; at stride 2 every tile is masked and
a vector of outputs reads two vectors of input columns, keeping the even lanes. Elsewhere
(the blocked layout, larger strides) the columns take per-tap scalar loops.
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
from egraft.kernels.cpu.emit import (
    KernelContext,
    Unsupported,
    ceil_div,
    const64,
    floor_div,
    imax,
    imin,
    masked_load,
    masked_store,
    splat,
)
from egraft.kernels.cpu.llvm import host_vector_bits

CONTRACT = ("contract",)
#: Output channels per register block, and vectors of output columns per tile (interior columns).
BLOCK_CHANNELS = 4
TILE_VECTORS = 3


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


class _Layout:
    """Where element ``(n, c, h, w)`` of an ``[N, C, H, W]`` tensor lives: plain NCHW, or
    channel-blocked (``[N, C/block, H, W, block]``): a row's base offset and the step
    between neighbouring columns."""

    def __init__(self, b: ir.IRBuilder, channels: int, height: ir.Value, width: ir.Value, block: int | None):
        self.b, self.channels, self.height, self.width, self.block = b, channels, height, width, block
        self.step = const64(block or 1)

    def row(self, n: ir.Value, c: ir.Value, h: ir.Value) -> ir.Value:
        b = self.b
        if self.block is None:
            plane = b.add(b.mul(n, const64(self.channels)), c)
            return b.mul(b.add(b.mul(plane, self.height), h), self.width)
        plane = b.add(b.mul(n, const64(self.channels // self.block)), b.sdiv(c, const64(self.block)))
        row = b.mul(b.add(b.mul(plane, self.height), h), b.mul(self.width, const64(self.block)))
        return b.add(row, b.srem(c, const64(self.block)))

    def at(self, row: ir.Value, column: ir.Value) -> ir.Value:
        return self.b.add(row, column if self.block is None else self.b.mul(column, self.step))


def emit_symbolic_conv(ctx: KernelContext, t: ir.Type, bias: int | None, residual: int | None,
                       activation: str, params: tuple[float, ...], block: int | None = None) -> None:
    """``y = act(conv(x, w) + bias + z)`` for the node, with runtime spatial sizes; ``block``:
    input, output and residual are channel-blocked (the residual then has the output's shape)."""
    from egraft.kernels.cpu import conv_gemm_symbolic
    from egraft.kernels.cpu.conv import fmuladd, vector_pointer  # conv imports this module

    g = symbolic_geometry(ctx, block)
    if block is None and products_pay(g) and conv_gemm_symbolic.fits(ctx, g, residual):
        conv_gemm_symbolic.emit_symbolic_conv_gemm(ctx, g, bias, residual, activation, params)
        return
    check_direct_pays(ctx, block)
    ctx.llvm_unroll = False  # the tiles are unrolled here; LLVM's runtime unrolling of them took 1 s per kernel
    ctx.llvm_loop_vectorize = False  # the tiles are vector code; versions of the scalar loops took 0.4 s more
    b = ctx.builder
    x, w, y = ctx.in_ptr(0), ctx.in_ptr(1), ctx.out_ptr(0)
    bias_ptr = ctx.in_ptr(bias) if bias is not None else None
    z = ctx.in_ptr(residual) if residual is not None else None
    in_h, in_w, out_h, out_w = (ctx.dim(d) for d in (g.in_h, g.in_w, g.out_h, g.out_w))
    pad_h, pad_w = ctx.dim(g.pad_h), ctx.dim(g.pad_w)
    x_layout = _Layout(b, g.channels, in_h, in_w, block)
    y_layout = _Layout(b, g.out_channels, out_h, out_w, block)
    group_in, group_out = g.channels // g.group, g.out_channels // g.group
    z_strides = residual_strides(ctx, residual) if z is not None and block is None else None
    # the output columns [lo, hi) whose tap kw is inside the input, per kw (the same for every row)
    column_ranges = []
    for kw in range(g.k_w):
        offset = b.sub(const64(kw * g.dil_w), pad_w)  # input column = ow * stride + offset
        column_ranges.append((offset, *valid_range(b, offset, g.stride_w, in_w, out_w)))
    width = max(1, host_vector_bits() // (32 if str(t) == "float" else 64))
    span = TILE_VECTORS * width
    # at unit stride in the plain layout every column is in a vector tile: the interior in
    # unmasked tiles, the columns before and after it in one-vector tiles whose taps read
    # through lane masks (ddddocr_ocr's 32-column rows had left 14 of 32 columns to per-tap
    # scalar loops: its layers ran at 13 GFLOP/s)
    vector_rows = block is None and g.stride_w == 1
    # at stride 2 every column is in a masked tile: a vector of outputs reads two vectors of
    # input columns and keeps the even lanes (the first layer of an OCR model, one input
    # channel at stride 2, had run at 2.6 GFLOP/s in per-tap scalar loops)
    strided_rows = block is None and g.stride_w == 2
    # elsewhere (the blocked layout, strides above 2) every column takes per-tap scalar loops
    scalar_rows = not (vector_rows or strided_rows)
    if vector_rows:
        interior_lo = column_ranges[0][1]
        interior_hi = column_ranges[0][2]
        for _, lo, hi in column_ranges[1:]:
            interior_lo, interior_hi = imax(b, interior_lo, lo), imin(b, interior_hi, hi)
        interior_lo = imin(b, interior_lo, out_w)
        tiles = floor_div(b, imax(b, const64(0), b.sub(interior_hi, interior_lo)), span)
        wide_end = b.add(interior_lo, b.mul(tiles, const64(span)))
    zero = ir.Constant(t, 0.0)
    per_group = -(-group_out // BLOCK_CHANNELS)
    blocks_lo, blocks_hi = ctx.share(g.group * per_group)

    def emit_block(n: ir.Value, grp: ir.Value, oc0: ir.Value, size: int) -> None:
        """Output channels ``oc0 .. oc0 + size`` (of group ``grp``) of image ``n``, row by row."""
        channels = [b.add(oc0, const64(j)) for j in range(size)]
        biases = [b.load(b.gep(bias_ptr, [oc])) if bias_ptr is not None else zero for oc in channels]
        with ctx.loop(out_h, name="oh") as oh:
            y_rows = [y_layout.row(n, oc, oh) for oc in channels]
            top = b.sub(b.mul(oh, const64(g.stride_h)), pad_h)  # input row of kernel row 0
            kh_lo, kh_hi = valid_range(b, top, g.dil_h, in_h, const64(g.k_h))
            for oc, y_row, bias_value in zip(channels, y_rows if scalar_rows else [], biases):
                with ctx.loop(out_w, name="ow0") as ow:
                    b.store(bias_value, b.gep(y, [y_layout.at(y_row, ow)]))
                with ctx.loop(group_in, name="ic") as ic:
                    channel = b.add(b.mul(grp, const64(group_in)), ic)
                    w_base = b.mul(b.add(b.mul(oc, const64(group_in)), ic), const64(g.k_h * g.k_w))
                    with ctx.loop(kh_hi, name="kh", start=kh_lo) as kh:
                        x_row = x_layout.row(n, channel, b.add(top, b.mul(kh, const64(g.dil_h))))
                        w_row = b.add(w_base, b.mul(kh, const64(g.k_w)))
                        for kw, (offset, lo, hi) in enumerate(column_ranges):
                            weight = b.load(b.gep(w, [b.add(w_row, const64(kw))]))
                            with ctx.loop(hi, name="ow", start=lo) as ow:
                                out = b.gep(y, [y_layout.at(y_row, ow)])
                                iw = b.add(b.mul(ow, const64(g.stride_w)), offset)
                                value = b.load(b.gep(x, [x_layout.at(x_row, iw)]))
                                b.store(b.fadd(b.load(out), b.fmul(weight, value, flags=CONTRACT), flags=CONTRACT),
                                        out)
            if not scalar_rows:
                emit_tiles(n, grp, channels, biases, y_rows, top, kh_lo, kh_hi)
            if z is not None or activation:
                for oc, y_row in zip(channels, y_rows):
                    emit_epilogue(n, oc, oh, y_row)

    def emit_tiles(n, grp, channels, biases, y_rows, top, kh_lo, kh_hi) -> None:
        """Every column of the row in vector tiles, ``len(channels)`` output channels at a
        time, accumulated in registers over input channels and taps."""
        if strided_rows:
            whole = floor_div(b, out_w, span)
            emit_tile_loop(n, grp, channels, biases, y_rows, top, kh_lo, kh_hi, whole, const64(0), TILE_VECTORS,
                           out_w)
            emit_row_end(n, grp, channels, biases, y_rows, top, kh_lo, kh_hi, b.mul(whole, const64(span)))
            return
        # a row of at most TILE_VECTORS vectors is one masked tile of as many vectors as it
        # needs (more accumulators in flight than one-vector tiles); a wider row runs its
        # interior in unmasked tiles and the columns around it in masked one-vector tiles
        narrow = b.icmp_signed("<=", out_w, const64(span))
        with b.if_else(narrow) as (whole_row, wide_row):
            with whole_row:
                emit_row_end(n, grp, channels, biases, y_rows, top, kh_lo, kh_hi, const64(0))
            with wide_row:
                emit_tile_loop(n, grp, channels, biases, y_rows, top, kh_lo, kh_hi, tiles, interior_lo, TILE_VECTORS)
                for first, end in ((const64(0), interior_lo), (wide_end, out_w)):
                    count = ceil_div(b, imax(b, const64(0), b.sub(end, first)), width)
                    emit_tile_loop(n, grp, channels, biases, y_rows, top, kh_lo, kh_hi, count, first, 1, end)

    def emit_row_end(n, grp, channels, biases, y_rows, top, kh_lo, kh_hi, first: ir.Value) -> None:
        """The columns from ``first`` to the row's end, fewer than ``TILE_VECTORS`` vectors, as
        one masked tile of as many vectors as they need (more accumulators in flight than
        one-vector tiles)."""
        needed = ceil_div(b, b.sub(out_w, first), width)
        done = b.append_basic_block("row_done")
        cases = [b.append_basic_block(f"row_{v}") for v in range(1, TILE_VECTORS + 1)]
        switch = b.switch(needed, done)
        for v, case in enumerate(cases, start=1):
            switch.add_case(ir.Constant(needed.type, v), case)
            b.position_at_end(case)
            emit_tile_loop(n, grp, channels, biases, y_rows, top, kh_lo, kh_hi, const64(1), first, v, out_w)
            b.branch(done)
        b.position_at_end(done)

    def lane_masks(ow0: ir.Value, end: ir.Value) -> tuple[ir.Value, list[ir.Value]]:
        """For a vector at column ``ow0`` of a row that ends at ``end``: the lanes inside the
        row, and per tap the lanes of the input columns it reads that are inside the input
        (at stride 2, twice as many lanes: the input columns from ``2 * ow0 + offset`` on)."""
        stride = g.stride_w
        lanes = ir.VectorType(ir.IntType(64), width * stride)
        outputs = b.add(splat(b, ow0, width), ir.Constant(ir.VectorType(ir.IntType(64), width), list(range(width))))
        inside = b.icmp_signed("<", outputs, splat(b, end, width))
        # input lane p belongs to output lane p // stride
        spread = b.add(splat(b, ow0, width * stride), ir.Constant(lanes, [p // stride for p in range(width * stride)]))
        row = b.icmp_signed("<", spread, splat(b, end, width * stride))
        columns = b.add(splat(b, b.mul(ow0, const64(stride)), width * stride),
                        ir.Constant(lanes, list(range(width * stride))))
        masks = []
        for offset, _, _ in column_ranges:
            source = b.add(columns, splat(b, offset, width * stride))
            ok = b.and_(b.icmp_signed(">=", source, ir.Constant(lanes, [0] * (width * stride))),
                        b.icmp_signed("<", source, splat(b, in_w, width * stride)))
            masks.append(b.and_(ok, row))
        return inside, masks

    def emit_tile_loop(n, grp, channels, biases, y_rows, top, kh_lo, kh_hi, count, first, vectors,
                       end: ir.Value | None = None) -> None:
        """Tiles of ``vectors`` vectors from column ``first``; with ``end``, tiles whose lanes
        and taps are masked to the row and the input."""
        vt = ir.VectorType(t, width)
        slots = [[ctx.alloca(vt, name=f"acc{j}_{v}") for v in range(vectors)] for j in range(len(channels))]
        with ctx.loop(count, name="tile") as tile:
            ow0 = b.add(first, b.mul(tile, const64(vectors * width)))
            masked = [lane_masks(b.add(ow0, const64(v * width)), end) for v in range(vectors)] if end is not None \
                else None
            for bias_value, row_slots in zip(biases, slots):
                start = splat(b, bias_value, width)
                for slot in row_slots:
                    b.store(start, slot)
            with ctx.loop(group_in, name="tic") as ic:
                channel = b.add(b.mul(grp, const64(group_in)), ic)
                with ctx.loop(kh_hi, name="tkh", start=kh_lo) as kh:
                    x_row = b.add(x_layout.row(n, channel, b.add(top, b.mul(kh, const64(g.dil_h)))),
                                  b.mul(ow0, const64(g.stride_w)) if strided_rows else ow0)
                    w_rows = [b.mul(b.add(b.mul(b.add(b.mul(oc, const64(group_in)), ic), const64(g.k_h)), kh),
                                    const64(g.k_w)) for oc in channels]
                    acc = [[b.load(slot) for slot in row_slots] for row_slots in slots]
                    for kw, (offset, _, _) in enumerate(column_ranges):
                        at = b.add(x_row, offset)
                        if strided_rows:  # two vectors of input columns, the even lanes
                            evens = ir.Constant(ir.VectorType(ir.IntType(32), width), list(range(0, 2 * width, 2)))
                            xs = [masked_load(b, x, b.add(at, const64(2 * v * width)), masked[v][1][kw])
                                  for v in range(vectors)]
                            xs = [b.shuffle_vector(xv, xv, evens) for xv in xs]
                        elif masked is not None:
                            xs = [masked_load(b, x, b.add(at, const64(v * width)), masked[v][1][kw])
                                  for v in range(vectors)]
                        else:
                            xs = [b.load(vector_pointer(b, x, b.add(at, const64(v * width)), width), align=4)
                                  for v in range(vectors)]
                        for j, w_row in enumerate(w_rows):
                            weight = splat(b, b.load(b.gep(w, [b.add(w_row, const64(kw))])), width)
                            acc[j] = [fmuladd(ctx, weight, xv, a) for xv, a in zip(xs, acc[j])]
                    for values, row_slots in zip(acc, slots):
                        for value, slot in zip(values, row_slots):
                            b.store(value, slot)
            for y_row, row_slots in zip(y_rows, slots):
                for v, slot in enumerate(row_slots):
                    if masked is not None:
                        masked_store(b, b.load(slot), y, b.add(b.add(y_row, ow0), const64(v * width)), masked[v][0])
                        continue
                    b.store(b.load(slot), vector_pointer(b, y, b.add(b.add(y_row, ow0), const64(v * width)), width),
                            align=4)

    def emit_epilogue(n, oc, oh, y_row) -> None:
        """``y = act(y + z)`` over the finished row of output channel ``oc``."""
        z_row = None
        if z_strides is not None:
            z_row = const64(0)
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

    tail = group_out % BLOCK_CHANNELS
    with ctx.loop(ctx.dim(g.batch), name="n") as n:
        with ctx.loop(blocks_hi, name="blk", start=blocks_lo) as index:
            grp = b.sdiv(index, const64(per_group))
            first = b.mul(b.srem(index, const64(per_group)), const64(BLOCK_CHANNELS))
            oc0 = b.add(b.mul(grp, const64(group_out)), first)
            if tail == 0:
                emit_block(n, grp, oc0, min(BLOCK_CHANNELS, group_out))
            else:
                whole = b.icmp_signed("<=", b.add(first, const64(BLOCK_CHANNELS)), const64(group_out))
                with b.if_else(whole) as (full, part):
                    with full:
                        emit_block(n, grp, oc0, BLOCK_CHANNELS)
                    with part:
                        emit_block(n, grp, oc0, tail)


#: A convolution whose products have at least this many taps (input channels per group times
#: the kernel's size) and this many output channels per group runs as products with runtime
#: tables (:mod:`egraft.kernels.cpu.conv_gemm_symbolic`) when its spatial dims are symbolic:
#: measured on the corpus, the direct kernel is 2-5x slower there (YOLO- and CRNN-sized
#: layers); a blocked one that cannot take products stays on the reference kernel.
GEMM_TAPS, GEMM_CHANNELS = 128, 32


def products_pay(g: SymbolicGeometry) -> bool:
    """Whether geometry ``g`` is big enough for products (see :data:`GEMM_TAPS`)."""
    return g.channels // g.group * g.k_h * g.k_w >= GEMM_TAPS and g.out_channels // g.group >= GEMM_CHANNELS


def check_direct_pays(ctx: KernelContext, block: int | None = None) -> None:
    """:class:`Unsupported` for a convolution too large for the runtime-bounds direct kernel
    (see :data:`GEMM_TAPS`)."""
    g = symbolic_geometry(ctx, block)
    taps = g.channels // g.group * g.k_h * g.k_w
    if products_pay(g):
        raise Unsupported(f"symbolic spatial dims with {taps} taps x {g.out_channels // g.group} output channels: "
                          "the reference's im2col product (BLAS) is faster than the direct kernel here")


def valid_range(b: ir.IRBuilder, start: ir.Value, step: int, length: ir.Value,
                count: ir.Value) -> tuple[ir.Value, ir.Value]:
    """``[lo, hi)``: the ``k`` in ``[0, count)`` for which ``start + k * step`` is inside
    ``[0, length)``, computed at run time (the runtime twin of
    :func:`egraft.kernels.cpu.conv.tap_range`); empty when ``hi <= lo``."""
    lo = imax(b, const64(0), ceil_div(b, b.neg(start), step))
    hi = imin(b, count, b.add(floor_div(b, b.sub(b.sub(length, const64(1)), start), step), const64(1)))
    return lo, hi


def residual_strides(ctx: KernelContext, residual: int) -> list[ir.Value | None]:
    """The strides of the residual input (broadcast to the output) along (n, c, h, w) as
    ``i64`` values, ``None`` where it broadcasts; a 1-D convolution's height is ``None``."""
    out_shape = ctx.shape(ctx.out_type(0))
    strides = broadcast_strides(ctx.shape(ctx.in_type(residual)), out_shape)
    z_strides = [ctx.dim(s) if s != 0 else None for s in strides]
    if len(out_shape) == 3:  # 1-D: (n, c, w) -> (n, c, h = 1, w)
        z_strides = [z_strides[0], z_strides[1], None, z_strides[2]]
    return z_strides


def has_symbolic_spatial_dims(ctx: KernelContext) -> bool:
    """Whether the node's input or output spatial dims are symbolic (the static kernels refuse those)."""
    return any(not isinstance(d, int) for shape in (ctx.shape(ctx.in_type(0)), ctx.shape(ctx.out_type(0)))
               for d in shape[2:])


__all__ = ["SymbolicGeometry", "symbolic_geometry", "emit_symbolic_conv", "has_symbolic_spatial_dims", "begin_pad",
           "check_direct_pays", "products_pay", "residual_strides", "valid_range", "GEMM_TAPS", "GEMM_CHANNELS"]

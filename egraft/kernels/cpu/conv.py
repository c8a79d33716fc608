"""Convolution kernels: ONNX ``Conv`` (1-D and 2-D) and egraft's ``FusedConv`` and
``WinogradConv`` (computed here as a direct convolution from the 3x3 weights ``W``; the
transformed weights ``U`` are not read).

The convolution is direct, one output row at a time, with no padded copy of the input:

- the rows of the kernel that fall inside the input for output row ``oh`` come from two
  compile-time tables (first and last valid ``kh`` per ``oh``), so the top and bottom
  padding cost no branch;
- with a unit horizontal stride (and a row at least one vector wide), the row is computed
  by a vector micro-kernel: a block of ``BLOCK_CHANNELS`` output channels times up to
  ``TILE_VECTORS`` vectors of columns are accumulated in registers over (input channel,
  kh, kw), each input vector loaded once and multiplied by broadcast weights. Interior
  tiles (every tap inside the input) run in a loop; the border tiles sit at compile-time
  columns and read with masked loads (constant masks, zero outside the input);
- otherwise (strided rows, narrow rows) each tap accumulates into the output row over the
  columns where it is inside the input (compile-time bounds), so the innermost loop runs
  over contiguous outputs with no branch.

FusedConv's residual ``Z`` and the activation are applied to each finished output row while
it is in cache. Every dim but the batch must be static here (the batch is read from
``dims``); a convolution with symbolic spatial dims runs the runtime-bounds kernel of
:mod:`egraft.kernels.cpu.conv_symbolic`.

Example: ``Conv(x: f32[1, 64, 56, 56], w: f32[64, 64, 3, 3]) {pads = [1, 1, 1, 1]}`` runs, for
each block of 4 output channels and each of the 56 rows, two 24-column tiles over columns
1..48 and two masked 8-column tiles at columns 0 and 48 (12 or 4 accumulators each).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from llvmlite import ir

from egraft.ir.ops.nn_spatial import _window
from egraft.kernels.cpu import conv_symbolic, register_kernel, winograd
from egraft.kernels.cpu.emit import (
    I64,
    KernelContext,
    Unsupported,
    const64,
    is_float,
    llvm_type,
    masked_load,
    splat,
)
from egraft.kernels.cpu.llvm import host_vector_bits

#: Output channels per register block of the vector micro-kernel.
BLOCK_CHANNELS = 4
#: Vectors of output columns per register block (BLOCK_CHANNELS * TILE_VECTORS accumulators).
TILE_VECTORS = 3
#: Float flags that let LLVM contract a multiply and an add into one fma.
CONTRACT = ("contract",)


# ---- compile-time geometry ------------------------------------------------------------------------
def ceil_div(a: int, b: int) -> int:
    """ceil(a / b) for integers, ``b > 0``.

    Example:
        >>> ceil_div(-3, 2), ceil_div(3, 2)
        (-1, 2)
    """
    return -(-a // b)


def tap_range(position: int, length: int, stride: int, dilation: int, pad: int, taps: int) -> tuple[int, int]:
    """``[lo, hi)``: the kernel taps ``k`` for which output ``position`` reads inside an input of
    ``length`` (input index ``position * stride - pad + k * dilation``); empty as ``lo == hi``.

    Example: a 3-tap kernel with pad 1 at output 0 skips tap 0:
        >>> tap_range(0, 5, 1, 1, 1, 3)
        (1, 3)
    """
    start = position * stride - pad
    lo = max(0, ceil_div(-start, dilation))
    hi = min(taps, (length - 1 - start) // dilation + 1)
    return (lo, hi) if hi > lo else (lo, lo)


def output_range(tap: int, length: int, out: int, stride: int, dilation: int, pad: int) -> tuple[int, int]:
    """``[lo, hi)``: the outputs whose kernel tap ``tap`` reads inside an input of ``length``
    (input index ``o * stride - pad + tap * dilation``), among ``out`` outputs.

    Example: tap 0 of a pad-1 kernel is outside the input for output 0 only:
        >>> output_range(0, 5, 5, 1, 1, 1)
        (1, 5)
    """
    offset = tap * dilation - pad
    lo = max(0, ceil_div(-offset, stride))
    hi = min(out, (length - 1 - offset) // stride + 1)
    return (lo, hi) if hi > lo else (lo, lo)


@dataclass(frozen=True)
class ConvGeometry:
    """Shapes and window of a 2-D convolution (a 1-D one has height 1 and a 1-row kernel).

    Attributes:
        batch: the batch dim (an int or a sympy expression).
        channels, out_channels, group: C, M and the group count.
        in_h, in_w, k_h, k_w, out_h, out_w: the spatial sizes of input, kernel and output.
        stride_h, stride_w, dil_h, dil_w, pad_h, pad_w: the window (pads are begin pads).
    """

    batch: object
    channels: int
    out_channels: int
    group: int
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

    @property
    def group_in(self) -> int:
        """Input channels per group."""
        return self.channels // self.group

    @property
    def group_out(self) -> int:
        """Output channels per group."""
        return self.out_channels // self.group

    def row_taps(self, oh: int) -> tuple[int, int]:
        """The kernel rows ``[lo, hi)`` inside the input for output row ``oh``."""
        return tap_range(oh, self.in_h, self.stride_h, self.dil_h, self.pad_h, self.k_h)

    def column_range(self, kw: int) -> tuple[int, int]:
        """The output columns ``[lo, hi)`` whose tap ``kw`` is inside the input."""
        return output_range(kw, self.in_w, self.out_w, self.stride_w, self.dil_w, self.pad_w)

    def interior(self) -> tuple[int, int]:
        """The output columns ``[lo, hi)`` whose every tap is inside the input."""
        ranges = [self.column_range(kw) for kw in range(self.k_w)]
        lo, hi = max(r[0] for r in ranges), min(r[1] for r in ranges)
        return (lo, hi) if hi > lo else (lo, lo)


def _static(dims: Sequence, what: str) -> list[int]:
    if not all(isinstance(d, int) for d in dims):
        raise Unsupported(f"{what} {list(dims)} are not static")
    return [int(d) for d in dims]


def conv_geometry(ctx: KernelContext, x_shape: Sequence | None = None,
                  out_shape: Sequence | None = None) -> ConvGeometry:
    """The geometry of the node's convolution (inputs X and W, Conv's attributes), from the
    static shapes; :class:`Unsupported` for symbolic non-batch dims or a 3-D (or higher) conv.
    ``x_shape`` and ``out_shape`` (default: the node's) are the standard-layout shapes of X
    and Y, for a convolution in another layout.

    Example: for ``Conv(f32[N, 8, 10, 10], f32[4, 8, 3, 3]) {strides = [2, 2], pads = [1, 1, 1, 1]}``
    the geometry has ``out_h == out_w == 5`` and ``pad_h == pad_w == 1``.
    """
    x_shape = ctx.shape(ctx.in_type(0)) if x_shape is None else x_shape
    out_shape = ctx.shape(ctx.out_type(0)) if out_shape is None else out_shape
    w_shape = ctx.shape(ctx.in_type(1))
    rank = len(x_shape)
    if rank not in (3, 4) or len(w_shape) != rank:
        raise Unsupported(f"a {rank - 2}-D convolution has no generated code (1-D and 2-D only)")
    channels, *spatial = _static(x_shape[1:], "the channel and spatial dims")
    out_channels, _, *kernel = _static(w_shape, "the weight dims")
    out_spatial = _static(out_shape[2:], "the output spatial dims")
    given = ctx.attr("kernel_shape", None)
    if given and [int(k) for k in given] != kernel:
        raise Unsupported(f"kernel_shape {list(given)} differs from the weights' {kernel}")
    group = int(ctx.attr("group", 1))
    if group < 1 or channels % group or out_channels % group or w_shape[1] * group != channels:
        raise Unsupported(f"group {group} does not divide {channels} input / {out_channels} output channels")
    try:
        win = _window(ctx, kernel)
    except ValueError as e:
        raise Unsupported(str(e)) from None
    outs, begins, _ = win.resolve(spatial)
    if list(outs) != out_spatial:
        raise Unsupported(f"output spatial dims {out_spatial} differ from the window's {list(outs)}")
    if rank == 3:
        return ConvGeometry(x_shape[0], channels, out_channels, group, 1, spatial[0], 1, kernel[0], 1, outs[0],
                            1, win.strides[0], 1, win.dilations[0], 0, begins[0])
    return ConvGeometry(x_shape[0], channels, out_channels, group, spatial[0], spatial[1], kernel[0], kernel[1],
                        outs[0], outs[1], win.strides[0], win.strides[1], win.dilations[0], win.dilations[1],
                        begins[0], begins[1])


# ---- IR helpers ------------------------------------------------------------------------------------
def affine(b: ir.IRBuilder, terms: Sequence[tuple[ir.Value, int | ir.Value]], offset: int = 0) -> ir.Value:
    """``sum(value * coefficient) + offset`` as an ``i64`` (zero coefficients are skipped).

    Example: ``affine(b, [(n, 3136), (oh, 56)], -1)`` is ``n * 3136 + oh * 56 - 1``.
    """
    total: ir.Value = const64(offset)
    for value, coefficient in terms:
        if isinstance(coefficient, int):
            if coefficient == 0:
                continue
            term = value if coefficient == 1 else b.mul(value, const64(coefficient))
        else:
            term = b.mul(value, coefficient)
        total = b.add(total, term)
    return total


def constant_table(ctx: KernelContext, name: str, values: Sequence, element: ir.Type = I64) -> ir.Value:
    """A module-internal constant array of ``values``; returns a pointer to its first element.

    Example: ``constant_table(ctx, "kh_lo", [1, 0, 0])`` and ``b.load(b.gep(table, [oh]))``.
    """
    array_type = ir.ArrayType(element, len(values))
    table = ir.GlobalVariable(ctx.module, array_type, name=f"{ctx.function.name}.{name}")
    table.global_constant = True
    table.linkage = "internal"
    if is_float(element):
        table.initializer = ir.Constant(array_type, [ir.Constant(element, float(v)) for v in values])
    else:
        table.initializer = ir.Constant(array_type, [ir.Constant(element, int(v)) for v in values])
    return table.gep([const64(0), const64(0)])


def vector_pointer(b: ir.IRBuilder, base: ir.Value, index: ir.Value, width: int) -> ir.Value:
    """``&base[index]`` as a pointer to a vector of ``width`` elements (unaligned access)."""
    return b.bitcast(b.gep(base, [index]), ir.VectorType(base.type.pointee, width).as_pointer())


def fmuladd(ctx: KernelContext, a: ir.Value, x: ir.Value, acc: ir.Value) -> ir.Value:
    """``a * x + acc`` on vectors, fused where the CPU has fma (``llvm.fmuladd``)."""
    t = acc.type
    suffix = f"v{t.count}{'f32' if str(t.element) == 'float' else 'f64'}"
    name = f"llvm.fmuladd.{suffix}"
    fn = ctx.module.globals.get(name) or ir.Function(ctx.module, ir.FunctionType(t, [t, t, t]), name)
    return ctx.builder.call(fn, [a, x, acc])


# ---- the convolution --------------------------------------------------------------------------------
@dataclass(frozen=True)
class ConvOperands:
    """Which node inputs are the bias and the residual, and the trailing activation."""

    bias: int | None
    residual: int | None
    activation: str = ""
    params: tuple[float, ...] = ()


class ConvEmitter:
    """Emits ``y = act(conv(x, w) + bias + z)`` for one node (see the module docstring).

    Example::

        ConvEmitter(ctx, conv_geometry(ctx), ConvOperands(bias=2, residual=None)).emit()
    """

    def __init__(self, ctx: KernelContext, geo: ConvGeometry, operands: ConvOperands):
        self.ctx, self.geo, self.operands = ctx, geo, operands
        self.b = ctx.builder
        self.t = _float_type(ctx, [0, 1] + [i for i in (operands.bias, operands.residual) if i is not None])
        g = geo
        self.width = max(1, host_vector_bits() // (32 if str(self.t) == "float" else 64))
        # narrow rows on narrower vectors: 14 pixels ran scalar with 16 lanes (AVX-512); strided rows
        # keep at least two vectors of interior columns (the rest runs scalar)
        while self.width > 4 and g.out_w < self.width * (1 if g.stride_w == 1 else 2):
            self.width //= 2
        self.x, self.w, self.y = ctx.in_ptr(0), ctx.in_ptr(1), ctx.out_ptr(0)
        self.bias = ctx.in_ptr(operands.bias) if operands.bias is not None else None
        self.z = ctx.in_ptr(operands.residual) if operands.residual is not None else None
        g = geo
        self.kh_lo = constant_table(ctx, "kh_lo", [g.row_taps(oh)[0] for oh in range(g.out_h)])
        self.kh_hi = constant_table(ctx, "kh_hi", [g.row_taps(oh)[1] for oh in range(g.out_h)])
        self.vectorized = g.stride_w == 1 and g.out_w >= self.width
        # strides 2 and 3: the interior columns as vectors of strided lanes (depthwise convolutions)
        lo, hi = g.interior()
        self.strided_span = (lo, lo + (hi - lo) // self.width * self.width) \
            if 2 <= g.stride_w <= 3 and g.dil_w == 1 and hi - lo >= self.width else None

    # -- the loop nest
    def emit(self) -> None:
        """The whole kernel: batch, group, output-channel blocks, output rows."""
        g, ctx = self.geo, self.ctx
        full_blocks, tail = divmod(g.group_out, BLOCK_CHANNELS)
        groups_lo, groups_hi = (ctx.share(g.group) if g.group > 1  # depthwise: channels split over threads
                                else (const64(0), const64(1)))
        with ctx.loop(ctx.dim(g.batch), name="n") as n:
            with ctx.loop(groups_hi, name="g", start=groups_lo) as grp:
                first = self.b.mul(grp, const64(g.group_out))
                if full_blocks:
                    with ctx.loop(full_blocks, name="blk") as blk:
                        oc0 = self.b.add(first, self.b.mul(blk, const64(BLOCK_CHANNELS)))
                        self.emit_rows(n, grp, oc0, BLOCK_CHANNELS)
                if tail:
                    self.emit_rows(n, grp, self.b.add(first, const64(full_blocks * BLOCK_CHANNELS)), tail)

    def emit_rows(self, n: ir.Value, grp: ir.Value, oc0: ir.Value, block: int) -> None:
        """Every output row of output channels ``oc0 .. oc0 + block``."""
        g, b, ctx = self.geo, self.b, self.ctx
        with ctx.loop(g.out_h, name="oh") as oh:
            kh_lo = b.load(b.gep(self.kh_lo, [oh]))
            kh_hi = b.load(b.gep(self.kh_hi, [oh]))
            row = _Row(n, grp, oc0, block, oh, kh_lo, kh_hi)
            if self.vectorized:
                self.emit_tiles(row)
            elif self.strided_span is not None:
                lo, hi = self.strided_span
                self.emit_columns(row, 0, lo)
                self.emit_strided_vectors(row, lo, hi)
                self.emit_columns(row, hi, g.out_w)
            else:
                self.emit_columns(row, 0, g.out_w)
            if self.z is not None or self.operands.activation:
                self.emit_epilogue(row)

    # -- offsets
    def x_channel(self, row: _Row, ic: ir.Value) -> ir.Value:
        """The element offset of input channel ``ic`` of ``row``'s group and image."""
        g = self.geo
        return affine(self.b, [(row.n, g.channels * g.in_h * g.in_w), (row.grp, g.group_in * g.in_h * g.in_w),
                               (ic, g.in_h * g.in_w)])

    def y_row(self, row: _Row, oc: ir.Value) -> ir.Value:
        """The element offset of output row ``row.oh`` of output channel ``oc``."""
        g = self.geo
        return affine(self.b, [(row.n, g.out_channels * g.out_h * g.out_w), (oc, g.out_h * g.out_w),
                               (row.oh, g.out_w)])

    def weight_row(self, oc: ir.Value, ic: ir.Value, kh: ir.Value) -> ir.Value:
        """The element offset of ``w[oc, ic, kh, 0]``."""
        g = self.geo
        return affine(self.b, [(oc, g.group_in * g.k_h * g.k_w), (ic, g.k_h * g.k_w), (kh, g.k_w)])

    def input_row(self, row: _Row, x_channel: ir.Value, kh: ir.Value) -> ir.Value:
        """The element offset of the input row that kernel row ``kh`` of ``row`` reads."""
        g = self.geo
        ih = affine(self.b, [(row.oh, g.stride_h), (kh, g.dil_h)], -g.pad_h)
        return self.b.add(x_channel, self.b.mul(ih, const64(g.in_w)))

    def bias_value(self, oc: ir.Value) -> ir.Value:
        return self.b.load(self.b.gep(self.bias, [oc])) if self.bias is not None else ir.Constant(self.t, 0.0)

    # -- scalar columns: per-tap loops with compile-time column bounds
    def emit_columns(self, row: _Row, start: int, stop: int) -> None:
        """Output columns ``[start, stop)`` of ``row``: bias first, then each tap accumulated
        over the columns where it is inside the input."""
        if stop <= start:
            return
        g, b, ctx = self.geo, self.b, self.ctx
        with ctx.loop(row.block, name="j") as j:
            oc = b.add(row.oc0, j)
            y_row = self.y_row(row, oc)
            bias = self.bias_value(oc)
            with ctx.loop(stop, name="ow0", start=start) as ow:
                b.store(bias, b.gep(self.y, [b.add(y_row, ow)]))
            with ctx.loop(g.group_in, name="ic") as ic:
                x_channel = self.x_channel(row, ic)
                with ctx.loop(row.kh_hi, name="kh", start=row.kh_lo) as kh:
                    x_row = self.input_row(row, x_channel, kh)
                    w_row = self.weight_row(oc, ic, kh)
                    for kw in range(g.k_w):
                        lo, hi = g.column_range(kw)
                        lo, hi = max(lo, start), min(hi, stop)
                        if hi <= lo:
                            continue
                        weight = b.load(b.gep(self.w, [b.add(w_row, const64(kw))]))
                        x_tap = b.add(x_row, const64(kw * g.dil_w - g.pad_w))
                        with ctx.loop(hi, name="ow", start=lo) as ow:
                            out = b.gep(self.y, [b.add(y_row, ow)])
                            value = b.load(b.gep(self.x, [b.add(x_tap, affine(b, [(ow, g.stride_w)]))]))
                            b.store(b.fadd(b.load(out), b.fmul(weight, value, flags=CONTRACT), flags=CONTRACT), out)

    # -- vectors of strided lanes (horizontal stride 2 or 3), interior columns only
    def emit_strided_vectors(self, row: _Row, start: int, stop: int) -> None:
        """Output columns ``[start, stop)`` (every tap inside the input, a whole number of
        vectors) of ``row``: per vector, each tap is one load of ``(width - 1) * stride + 1``
        input elements whose every ``stride``-th lane is used, times the broadcast weight."""
        g, b, ctx, width = self.geo, self.b, self.ctx, self.width
        vt = ir.VectorType(self.t, width)
        wide = ir.VectorType(self.t, (width - 1) * g.stride_w + 1)
        lanes = ir.Constant(ir.VectorType(ir.IntType(32), width), [i * g.stride_w for i in range(width)])
        acc = ctx.alloca(vt, name="acc.strided")
        with ctx.loop(row.block, name="js") as j:
            oc = b.add(row.oc0, j)
            y_row = self.y_row(row, oc)
            bias = splat(b, self.bias_value(oc), width)
            with ctx.loop((stop - start) // width, name="vs") as v:
                ow0 = b.add(const64(start), b.mul(v, const64(width)))
                b.store(bias, acc)
                with ctx.loop(g.group_in, name="ics") as ic:
                    x_channel = self.x_channel(row, ic)
                    with ctx.loop(row.kh_hi, name="khs", start=row.kh_lo) as kh:
                        x_row = b.add(self.input_row(row, x_channel, kh), b.mul(ow0, const64(g.stride_w)))
                        w_row = self.weight_row(oc, ic, kh)
                        for kw in range(g.k_w):
                            weight = splat(b, b.load(b.gep(self.w, [b.add(w_row, const64(kw))])), width)
                            at = b.add(x_row, const64(kw * g.dil_w - g.pad_w))
                            loaded = b.load(b.bitcast(b.gep(self.x, [at]), wide.as_pointer()), align=self.t_size)
                            value = b.shuffle_vector(loaded, ir.Constant(wide, None), lanes)
                            b.store(fmuladd(ctx, weight, value, b.load(acc)), acc)
                b.store(b.load(acc), b.bitcast(b.gep(self.y, [b.add(y_row, ow0)]), vt.as_pointer()), align=self.t_size)

    # -- vector tiles (unit horizontal stride)
    def tile_plan(self) -> tuple[tuple[int, int], list[tuple[int, int]]]:
        """How the vector tiles cover the output columns: ``((start, count), static)``, where
        ``count`` tiles of ``TILE_VECTORS`` vectors from column ``start`` are a runtime loop over
        the interior (every tap inside the input), and ``static`` lists ``(first column,
        vectors)`` tiles at compile-time positions covering the rest (their loads are masked
        where a tap falls outside the input; a tile may overlap its neighbour, both write the
        same values). Needs ``out_w >= width``.

        Example: 56 columns, pad 1, 8-float vectors: ``((1, 2), [(0, 1), (48, 1)])``.
        """
        lo, hi = self.geo.interior()
        span = TILE_VECTORS * self.width
        count = (hi - lo) // span if hi > lo else 0
        start = lo if count else 0
        static: list[tuple[int, int]] = []
        for first, stop in ((0, start), (start + count * span, self.geo.out_w)):
            while stop - first >= self.width:
                vectors = min(TILE_VECTORS, (stop - first) // self.width)
                static.append((first, vectors))
                first += vectors * self.width
            if stop > first:
                static.append((max(0, stop - self.width), 1))
        return (start, count), static

    def emit_tiles(self, row: _Row) -> None:
        """Every column of ``row`` in vector tiles (see :meth:`tile_plan`)."""
        (start, count), static = self.tile_plan()
        span = TILE_VECTORS * self.width
        if count:
            with self.ctx.loop(count, name="tile") as tile:
                self.emit_tile(row, self.b.add(const64(start), self.b.mul(tile, const64(span))), TILE_VECTORS)
        for first, vectors in static:
            self.emit_tile(row, const64(first), vectors, first)

    def lane_mask(self, first: int | None, vector: int, kw: int) -> list[bool] | None:
        """Which lanes of vector ``vector`` of a tile at column ``first`` read inside the input
        at tap ``kw``; ``None`` when all do (or the tile is an interior runtime one)."""
        if first is None:
            return None
        g = self.geo
        base = first + vector * self.width - g.pad_w + kw * g.dil_w
        mask = [0 <= base + lane < g.in_w for lane in range(self.width)]
        return None if all(mask) else mask

    def load_vector(self, index: ir.Value, mask: list[bool] | None) -> ir.Value | None:
        """The vector of input elements from ``index``; masked lanes read as zero (and are
        not accessed); ``None`` when no lane is inside the input."""
        b, width = self.b, self.width
        pointer = vector_pointer(b, self.x, index, width)
        if mask is None:
            return b.load(pointer, align=self.t_size)
        if not any(mask):
            return None
        mask_type = ir.VectorType(ir.IntType(1), width)
        return masked_load(b, self.x, index, ir.Constant(mask_type, [int(m) for m in mask]))

    def emit_tile(self, row: _Row, ow0: ir.Value, vectors: int, first: int | None = None) -> None:
        """``row.block`` output channels times ``vectors`` vectors of columns from ``ow0``,
        accumulated in registers over input channels and kernel rows and columns; ``first``
        is ``ow0`` when known at compile time (the loads are then masked at the borders)."""
        g, b, ctx, width = self.geo, self.b, self.ctx, self.width
        vector_type = ir.VectorType(self.t, width)
        channels = [b.add(row.oc0, const64(j)) for j in range(row.block)]
        accumulators = [[ctx.alloca(vector_type, name=f"acc{j}_{v}") for v in range(vectors)]
                        for j in range(row.block)]
        for oc, slots in zip(channels, accumulators):
            start = splat(b, self.bias_value(oc), width)
            for slot in slots:
                b.store(start, slot)
        with ctx.loop(g.group_in, name="ic") as ic:
            x_channel = self.x_channel(row, ic)
            with ctx.loop(row.kh_hi, name="kh", start=row.kh_lo) as kh:
                x_row = b.add(self.input_row(row, x_channel, kh), b.sub(ow0, const64(g.pad_w)))
                w_rows = [self.weight_row(oc, ic, kh) for oc in channels]
                acc = [[b.load(slot) for slot in slots] for slots in accumulators]
                for kw in range(g.k_w):
                    xs = [self.load_vector(b.add(x_row, const64(kw * g.dil_w + v * width)),
                                           self.lane_mask(first, v, kw)) for v in range(vectors)]
                    if all(x is None for x in xs):
                        continue
                    for j, w_row in enumerate(w_rows):
                        weight = splat(b, b.load(b.gep(self.w, [b.add(w_row, const64(kw))])), width)
                        acc[j] = [a if x is None else fmuladd(ctx, weight, x, a) for x, a in zip(xs, acc[j])]
                for values, slots in zip(acc, accumulators):
                    for value, slot in zip(values, slots):
                        b.store(value, slot)
        for oc, slots in zip(channels, accumulators):
            y_row = b.add(self.y_row(row, oc), ow0)
            for v, slot in enumerate(slots):
                b.store(b.load(slot), vector_pointer(b, self.y, b.add(y_row, const64(v * width)), width),
                        align=self.t_size)

    @property
    def t_size(self) -> int:
        return 4 if str(self.t) == "float" else 8

    # -- FusedConv: residual and activation on each finished row
    def emit_epilogue(self, row: _Row) -> None:
        """``y = act(y + z)`` over the finished row of each channel of the block."""
        g, b, ctx = self.geo, self.b, self.ctx
        z_strides = conv_symbolic.residual_strides(ctx, self.operands.residual) if self.z is not None else None
        with ctx.loop(row.block, name="j") as j:
            oc = b.add(row.oc0, j)
            y_row = self.y_row(row, oc)
            z_row = None
            if z_strides is not None:
                z_row = const64(0)
                for index, stride in zip((row.n, oc, row.oh), z_strides[:3]):
                    if stride is not None:
                        z_row = b.add(z_row, b.mul(index, stride))
            with ctx.loop(g.out_w, name="ow") as ow:
                out = b.gep(self.y, [b.add(y_row, ow)])
                value = b.load(out)
                if z_row is not None:
                    z_at = z_row if z_strides[3] is None else b.add(z_row, b.mul(ow, z_strides[3]))
                    value = b.fadd(value, b.load(b.gep(self.z, [z_at])))
                value = ctx.math.activation(self.operands.activation, list(self.operands.params), value)
                b.store(value, out)


@dataclass(frozen=True)
class _Row:
    """One output row being emitted: image ``n``, group ``grp``, output channels
    ``oc0 .. oc0 + block``, row ``oh`` and its valid kernel rows ``[kh_lo, kh_hi)``."""

    n: ir.Value
    grp: ir.Value
    oc0: ir.Value
    block: int
    oh: ir.Value
    kh_lo: ir.Value
    kh_hi: ir.Value


def _float_type(ctx: KernelContext, inputs: Sequence[int]) -> ir.Type:
    """The float type of the output, when every input in ``inputs`` has the output's dtype."""
    dtype = ctx.out_type(0).dtype
    t = llvm_type(dtype)
    if not is_float(t):
        raise Unsupported(f"{ctx.node.op} on {dtype.short} has no generated code")
    for i in inputs:
        if ctx.in_type(i).dtype != dtype:
            raise Unsupported(f"{ctx.node.op} with mixed dtypes has no generated code")
    return t


def _activation(ctx: KernelContext) -> tuple[str, tuple[float, ...]]:
    from egraft.ir.ops.fused import ACTIVATIONS, activation_params

    name = ctx.attr("activation", "") or ""
    if name not in ACTIVATIONS:
        raise Unsupported(f"activation {name!r} has no generated code")
    return name, tuple(activation_params(name, ctx.attr("activation_params", [])))


def _emit(ctx: KernelContext, geo: ConvGeometry, operands: ConvOperands) -> None:
    """As products through egraft_sgemm where they fit (:mod:`egraft.kernels.cpu.conv_gemm`),
    else the direct convolution."""
    from egraft.kernels.cpu import conv_gemm

    if conv_gemm.fits(ctx, geo, operands.residual, operands.activation):
        conv_gemm.emit_conv_gemm(ctx, geo, operands.bias, operands.residual, operands.activation, operands.params)
    else:
        ConvEmitter(ctx, geo, operands).emit()


def _emit_any(ctx: KernelContext, operands: ConvOperands) -> None:
    """The node's convolution: with symbolic spatial dims by the runtime-bounds kernel
    (:mod:`egraft.kernels.cpu.conv_symbolic`), else as :func:`_emit` chooses."""
    if conv_symbolic.has_symbolic_spatial_dims(ctx):
        inputs = [0, 1] + [i for i in (operands.bias, operands.residual) if i is not None]
        conv_symbolic.emit_symbolic_conv(ctx, _float_type(ctx, inputs), operands.bias, operands.residual,
                                         operands.activation, operands.params)
    else:
        _emit(ctx, conv_geometry(ctx), operands)


# ---- the generators ----------------------------------------------------------------------------------
@register_kernel("Conv")
def conv(ctx: KernelContext) -> None:
    """ONNX Conv (1-D or 2-D): groups, strides, dilations, pads, auto_pad, optional bias.

    Example: ``Conv(x: f32[batch, 3, 32, 32], w: f32[8, 3, 3, 3], b: f32[8]) {pads = [1, 1, 1, 1]}``.
    """
    bias = 2 if ctx.has_input(2) else None
    _emit_any(ctx, ConvOperands(bias, None))


@register_kernel("FusedConv", domain="com.egraft")
def fused_conv(ctx: KernelContext) -> None:
    """egraft's ``act(Conv(X, W, B) + Z)``: Z broadcasts to the output, the activation is one of
    :data:`egraft.ir.ops.fused.ACTIVATIONS`.

    Example: ``FusedConv(x, w, b, z) {pads = [1, 1, 1, 1], activation = "relu"}``.
    """
    activation, params = _activation(ctx)
    operands = ConvOperands(2 if ctx.has_input(2) else None, 3 if ctx.has_input(3) else None, activation, params)
    _emit_any(ctx, operands)


@register_kernel("WinogradConv", domain="com.egraft")
def winograd_conv(ctx: KernelContext) -> None:
    """egraft's ``act(Conv(X, W, B))`` for a 3x3 stride-1 kernel, by Winograd F(2x2, 3x3)
    (:mod:`egraft.kernels.cpu.winograd`, its filter transform computed from the constant
    ``W`` at compile time), else (small outputs, weights computed at run time) as the
    convolution of ``W``; ``U`` (input 2) is not read.

    Example: ``WinogradConv(x, w, u, b) {pads = [1, 1, 1, 1]}`` equals ``Conv(x, w, b)``.
    """
    activation, params = _activation(ctx)
    operands = ConvOperands(3 if ctx.has_input(3) else None, None, activation, params)
    if conv_symbolic.has_symbolic_spatial_dims(ctx):
        _emit_any(ctx, operands)
        return
    geo = conv_geometry(ctx)
    if winograd.fits(ctx, geo, activation):
        winograd.emit_winograd(ctx, geo, operands.bias, activation, params)
    else:
        _emit(ctx, geo, operands)

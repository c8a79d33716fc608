"""Quantization kernels: QuantizeLinear, DequantizeLinear, DynamicQuantizeLinear, and the
integer products MatMulInteger and ConvInteger.

Semantics follow onnxruntime's CPU kernels bit for bit:

- quantizing is ``saturate(round_half_even(x / scale) + zero_point)`` in float32 (a
  division, not a multiplication by the reciprocal), clamped in float before the cast;
- DynamicQuantizeLinear maps ``[min(x, 0), max(x, 0)]`` onto ``[0, 255]``: ``scale =
  (max - min) / 255`` (1 when ``max == min``, as onnxruntime), ``zero_point =
  round_half_even(clamp(0 - min / scale, 0, 255))``;
- dequantizing is ``float(x - zero_point) * scale`` (the difference in int32);
- the integer products accumulate ``(a - a_zero_point) * (b - b_zero_point)`` exactly in
  int32 (no int16 saturation).

MatMulInteger needs a constant 2-D ``B`` and ``b_zero_point``; ConvInteger with one group
is the same product over the output pixels (rows) and the taps (depth), its weights the
constant. ``B`` is packed at compile time into panels of ``nr`` columns (two vectors of
int32 lanes). Per tile of ``rows`` rows, the rows of A (for ConvInteger, each pixel's taps)
are written to the thread's scratch; then every panel of the thread's share accumulates
the tile's ``rows x nr`` outputs in registers (:func:`emit_pair_gemm`), with one of the
forms of :class:`PairProduct`: ``vpdpbusd`` on the raw bytes with AVX-512 VNNI (the zero
points enter afterwards through row and column sums, :class:`ZeroPoints`), ``vpmaddwd``
on int16 pairs of the operands minus their zero points otherwise. Where the host has AMX,
MatMulInteger runs on its tile registers instead (:mod:`egraft.kernels.cpu.amx`, 16 x 16
outputs per instruction; ``EGRAFT_AMX=0`` turns them off).

Example: ``MatMulInteger(a: u8[batch, seq, 512], B: i8[512, 384] (constant), a_zp: u8[], b_zp: i8[])``
is one ``(batch*seq) x 512 @ 512 x 384`` product over 12 panels of 32 columns, 8 rows at a
time (AVX-512).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import sympy
from llvmlite import ir

from egraft.ir.dtypes import DType
from egraft.kernels.cpu import amx, register_kernel
from egraft.kernels.cpu.conv_symbolic import symbolic_geometry, valid_range
from egraft.kernels.cpu.emit import (
    F32,
    I8,
    I32,
    KernelContext,
    Unsupported,
    const64,
    imin,
    register_packing,
    splat,
)
from egraft.kernels.cpu.llvm import host_cpu, host_vector_bits
from egraft.kernels.cpu.sgemm import KERNEL_SCRATCH_BYTES

I16 = ir.IntType(16)
#: The integer types the quantized ops read and write, with their ranges.
RANGES = {DType.UINT8: (0, 255), DType.INT8: (-128, 127)}


# ---- shared pieces ------------------------------------------------------------------------------
def _roundeven(ctx: KernelContext, x: ir.Value) -> ir.Value:
    """Round half to even (``llvm.roundeven``; vectorizes to ``roundps``)."""
    return ctx.math._intrinsic("roundeven", x)


def _widen(b: ir.IRBuilder, value: ir.Value, dtype: DType, to: ir.Type = I32) -> ir.Value:
    """An element of ``dtype`` (u8/i8/i32) as ``to``: zero-extended for u8, sign-extended otherwise."""
    if value.type == to:
        return value
    return b.zext(value, to) if dtype == DType.UINT8 else b.sext(value, to)


def _int_dtype(ctx: KernelContext, i: int, allowed=(DType.UINT8, DType.INT8)) -> DType:
    dtype = ctx.in_type(i).dtype
    if dtype not in allowed:
        raise Unsupported(f"{ctx.node.op} on {dtype.short} input {i} has no generated code "
                          f"({', '.join(d.short for d in allowed)} only)")
    return dtype


def _numel(shape) -> object:
    total = sympy.Integer(1)
    for d in shape:
        total = total * d
    return sympy.expand(total)


def _is_scalar(shape) -> bool:
    return len(shape) == 0 or (len(shape) == 1 and shape[0] == 1)


def _param_layout(ctx: KernelContext, indices) -> int | None:
    """The axis along which the scale/zero point inputs ``indices`` vary (``None``: per tensor);
    :class:`Unsupported` for blocked or other layouts."""
    if ctx.opset >= 21 and int(ctx.attr("block_size", 0) or 0):
        raise Unsupported(f"blocked {ctx.node.op} (block_size) has no generated code")
    x_shape = ctx.shape(ctx.in_type(0))
    shapes = [ctx.shape(ctx.in_type(i)) for i in indices if ctx.has_input(i)]
    if all(_is_scalar(s) for s in shapes):
        return None
    if not x_shape or any(len(s) != 1 for s in shapes):
        raise Unsupported(f"{ctx.node.op} parameters of shapes {[list(s) for s in shapes]} have no generated code "
                          "(a scalar or a 1-D tensor along axis)")
    return int(ctx.attr("axis", 1)) % len(x_shape)


def _param_index(ctx: KernelContext, i: int, channel: ir.Value | None) -> ir.Value:
    """Where parameter input ``i`` is read for ``channel`` (0 for a per-tensor parameter)."""
    if channel is None or not ctx.has_input(i) or _is_scalar(ctx.shape(ctx.in_type(i))):
        return const64(0)
    return channel


def _per_axis_loops(ctx: KernelContext, axis: int | None, params, element) -> None:
    """``element(index, *params(channel))`` for every element of input 0: ``params`` loads the
    scale and zero point of a channel (its index along ``axis``; ``None`` per tensor), once
    per channel, or once for the whole tensor when ``axis`` is ``None``."""
    shape = ctx.shape(ctx.in_type(0))
    b = ctx.builder
    if axis is None:
        loaded = params(None)
        with ctx.loop(ctx.numel(shape), name="i") as i:
            element(i, *loaded)
        return
    outer, channels, inner = _numel(shape[:axis]), shape[axis], _numel(shape[axis + 1:])
    inner_v, channels_v = ctx.dim(inner), ctx.dim(channels)
    with ctx.loop(ctx.dim(outer), name="o") as o:
        with ctx.loop(channels_v, name="c") as c:
            base = b.mul(b.add(b.mul(o, channels_v), c), inner_v)
            loaded = params(c)
            with ctx.loop(inner_v, name="j") as j:
                element(b.add(base, j), *loaded)


# ---- QuantizeLinear, DequantizeLinear, DynamicQuantizeLinear ----------------------------------------
def quantize_element(ctx: KernelContext, x: ir.Value, scale: ir.Value, zero_point: ir.Value, dtype: DType) -> ir.Value:
    """``saturate(round_half_even(x / scale) + zero_point)`` as ``dtype`` (``zero_point`` a float);
    NaN saturates to the low end (as onnxruntime's vector path)."""
    b = ctx.builder
    lo, hi = (ir.Constant(F32, float(v)) for v in RANGES[dtype])
    q = b.fadd(_roundeven(ctx, b.fdiv(x, scale)), zero_point)
    q = b.select(b.fcmp_ordered(">", q, lo), q, lo)
    q = b.select(b.fcmp_ordered("<", q, hi), q, hi)
    return b.fptosi(q, I32) if dtype == DType.INT8 else b.fptoui(q, I32)


@register_kernel("QuantizeLinear")
def quantize_linear(ctx: KernelContext) -> None:
    """f32 -> u8/i8, scale and zero point per tensor or per axis (any of them computed at run time)."""
    if ctx.in_type(0).dtype != DType.FLOAT32 or ctx.in_type(1).dtype != DType.FLOAT32:
        raise Unsupported("QuantizeLinear of a non-f32 input or scale has no generated code")
    if ctx.opset >= 23 and int(ctx.attr("precision", 0) or 0) not in (0, 1):
        raise Unsupported("QuantizeLinear with a precision other than f32 has no generated code")
    dtype = ctx.out_type(0).dtype
    if dtype not in RANGES:
        raise Unsupported(f"QuantizeLinear to {dtype.short} has no generated code (u8 and i8 only)")
    axis = _param_layout(ctx, (1, 2))
    b = ctx.builder
    x, y, s = ctx.in_ptr(0), ctx.out_ptr(0), ctx.in_ptr(1)
    zp = ctx.in_ptr(2) if ctx.has_input(2) else None

    def params(c):
        at = [_param_index(ctx, i, c) for i in (1, 2)]
        scale = b.load(b.gep(s, [at[0]]))
        zero = ir.Constant(F32, 0.0) if zp is None else b.sitofp(_widen(b, b.load(b.gep(zp, [at[1]])), dtype), F32)
        return scale, zero

    def element(j, scale, zero):
        b.store(b.trunc(quantize_element(ctx, b.load(b.gep(x, [j])), scale, zero, dtype), I8), b.gep(y, [j]))

    _per_axis_loops(ctx, axis, params, element)


@register_kernel("DequantizeLinear")
def dequantize_linear(ctx: KernelContext) -> None:
    """u8/i8/i32 -> f32: ``float(x - zero_point) * scale``, per tensor or per axis."""
    dtype = _int_dtype(ctx, 0, (DType.UINT8, DType.INT8, DType.INT32))
    if ctx.in_type(1).dtype != DType.FLOAT32 or ctx.out_type(0).dtype != DType.FLOAT32:
        raise Unsupported("DequantizeLinear to a type other than f32 has no generated code")
    axis = _param_layout(ctx, (1, 2))
    b = ctx.builder
    x, y, s = ctx.in_ptr(0), ctx.out_ptr(0), ctx.in_ptr(1)
    zp = ctx.in_ptr(2) if ctx.has_input(2) else None

    def params(c):
        at = [_param_index(ctx, i, c) for i in (1, 2)]
        scale = b.load(b.gep(s, [at[0]]))
        zero = ir.Constant(I32, 0) if zp is None else _widen(b, b.load(b.gep(zp, [at[1]])), dtype)
        return scale, zero

    def element(j, scale, zero):
        diff = b.sub(_widen(b, b.load(b.gep(x, [j])), dtype), zero)
        b.store(b.fmul(b.sitofp(diff, F32), scale), b.gep(y, [j]))

    _per_axis_loops(ctx, axis, params, element)


def dynamic_parameters(ctx: KernelContext, x: ir.Value, count: ir.Value) -> tuple[ir.Value, ir.Value]:
    """The scale and zero point (a float holding an integer) that map the range of the
    ``count`` floats at ``x``, 0 included, onto ``[0, 255]``, as onnxruntime's
    GetQuantizationParameter: ``scale = (max - min) / 255`` (1 when ``max == min``),
    ``zero_point = round_half_even(clamp(0 - min / scale, 0, 255))``. The range in vectors
    of the host's width, then the tail."""
    b = ctx.builder
    zero = ir.Constant(F32, 0.0)
    width = max(4, host_vector_bits() // 32)
    vt = ir.VectorType(F32, width)
    lo_v, hi_v = ctx.alloca(vt, "lo.v"), ctx.alloca(vt, "hi.v")
    b.store(ir.Constant(vt, [0.0] * width), lo_v)
    b.store(ir.Constant(vt, [0.0] * width), hi_v)
    blocks = b.sdiv(count, const64(width))
    with ctx.loop(blocks, name="v") as v:
        xv = b.load(b.bitcast(b.gep(x, [b.mul(v, const64(width))]), vt.as_pointer()), align=4)
        b.store(ctx.math._intrinsic("minnum", b.load(lo_v), xv), lo_v)
        b.store(ctx.math._intrinsic("maxnum", b.load(hi_v), xv), hi_v)
    lo_s, hi_s = ctx.alloca(F32, "lo"), ctx.alloca(F32, "hi")
    lo_vec, hi_vec = b.load(lo_v), b.load(hi_v)
    lo_acc, hi_acc = zero, zero
    for lane in range(width):
        at = ir.Constant(I32, lane)
        lo_acc = ctx.math._intrinsic("minnum", lo_acc, b.extract_element(lo_vec, at))
        hi_acc = ctx.math._intrinsic("maxnum", hi_acc, b.extract_element(hi_vec, at))
    b.store(lo_acc, lo_s)
    b.store(hi_acc, hi_s)
    with ctx.loop(count, name="t", start=b.mul(blocks, const64(width))) as i:
        value = b.load(b.gep(x, [i]))
        b.store(ctx.math._intrinsic("minnum", b.load(lo_s), value), lo_s)
        b.store(ctx.math._intrinsic("maxnum", b.load(hi_s), value), hi_s)
    lo, hi = b.load(lo_s), b.load(hi_s)
    same = b.fcmp_ordered("==", hi, lo)
    scale = b.select(same, ir.Constant(F32, 1.0), b.fdiv(b.fsub(hi, lo), ir.Constant(F32, 255.0)))
    initial = b.fsub(zero, b.fdiv(lo, scale))
    clamped = b.select(b.fcmp_ordered("<", initial, ir.Constant(F32, 255.0)), initial, ir.Constant(F32, 255.0))
    clamped = b.select(b.fcmp_ordered(">", clamped, zero), clamped, zero)
    return scale, _roundeven(ctx, clamped)


@register_kernel("DynamicQuantizeLinear")
def dynamic_quantize_linear(ctx: KernelContext) -> None:
    """f32 -> u8 with the scale and zero point of x's range (two passes: :func:`dynamic_parameters`,
    then quantize)."""
    if ctx.in_type(0).dtype != DType.FLOAT32:
        raise Unsupported("DynamicQuantizeLinear of a non-f32 input has no generated code")
    b = ctx.builder
    x, y = ctx.in_ptr(0), ctx.out_ptr(0)
    count = ctx.numel(ctx.shape(ctx.in_type(0)))
    scale, zero_point = dynamic_parameters(ctx, x, count)
    b.store(scale, ctx.out_ptr(1))
    b.store(b.trunc(b.fptoui(zero_point, I32), I8), ctx.out_ptr(2))
    with ctx.loop(count, name="q") as i:
        q = quantize_element(ctx, b.load(b.gep(x, [i])), scale, zero_point, DType.UINT8)
        b.store(b.trunc(q, I8), b.gep(y, [i]))


# ---- MatMulInteger --------------------------------------------------------------------------------
@dataclass(frozen=True)
class PairProduct:
    """How the host multiplies small integers into int32 lanes: ``acc[j] + sum(a[d*j + i] *
    b[d*j + i] for i < d)`` for every int32 lane ``j`` of a vector of ``lanes``, ``d = depth``.

    Depth 4 (``vpdpbusd``, AVX-512 VNNI): ``a`` uint8, ``b`` int8, so the products run on the
    raw operands and the zero points enter as row and column sums afterwards. Depth 2: int16
    pairs of operands minus their zero points (``vpmaddwd`` plus an add with AVX-512BW, AVX2
    or SSE2, ``vpdpwssd`` when asked for, widening multiplies elsewhere). ``rows``: output
    rows per register tile (the accumulators fit the registers)."""

    intrinsic: str
    lanes: int
    rows: int
    depth: int = 2

    @staticmethod
    def for_host() -> PairProduct:
        triple, _, features = host_cpu()
        flags = set(features.split(","))
        if not triple.startswith(("x86_64", "i686", "i386")):
            return PairProduct("", 4, 4)
        if {"+avx512vnni", "+avx512bw"} <= flags:
            return PairProduct("llvm.x86.avx512.vpdpbusd.512", 16, 8, depth=4)
        if "+avx512bw" in flags:
            return PairProduct("llvm.x86.avx512.pmaddw.d.512", 16, 8)
        if "+avx2" in flags:
            return PairProduct("llvm.x86.avx2.pmadd.wd", 8, 4)
        return PairProduct("llvm.x86.sse2.pmadd.wd", 4, 4)

    @property
    def element(self) -> ir.Type:
        """The operands' element type: int8 for depth 4, int16 for depth 2."""
        return I8 if self.depth == 4 else I16

    def emit(self, b: ir.IRBuilder, acc: ir.Value, a: ir.Value, w: ir.Value) -> ir.Value:
        """``acc`` (``<lanes x i32>``) plus the products of ``a`` and ``w`` (``<depth*lanes x element>``)."""
        out, pairs = ir.VectorType(I32, self.lanes), ir.VectorType(self.element, self.depth * self.lanes)
        module = b.module
        if self.intrinsic.endswith(("vpdpwssd.512", "vpdpbusd.512")):
            fn = module.globals.get(self.intrinsic) or ir.Function(module, ir.FunctionType(out, [out, pairs, pairs]),
                                                                   self.intrinsic)
            return b.call(fn, [acc, a, w])
        if self.intrinsic:
            fn = module.globals.get(self.intrinsic) or ir.Function(module, ir.FunctionType(out, [pairs, pairs]),
                                                                   self.intrinsic)
            return b.add(acc, b.call(fn, [a, w]))
        total = acc
        for first in (0, 1):
            mask = ir.Constant(ir.VectorType(I32, self.lanes), [2 * j + first for j in range(self.lanes)])
            x, y = (b.sext(b.shuffle_vector(v, ir.Constant(pairs, None), mask), out) for v in (a, w))
            total = b.add(total, b.mul(x, y))
        return total


@register_packing("quant.integer_panels", gather=False)
def pack_integer_panels(b: np.ndarray, nr: int, zero_point: tuple[int, ...] = (0,)) -> np.ndarray:
    """``B - zero_point`` (``B`` [K, N] u8/i8; the zero point one value or one per column) as
    int16 panels of ``nr`` columns, rows in pairs: ``[ceil(N/nr), ceil(K/2), nr, 2]``, zero
    past N and K; returned as its bytes (int8; the kernel reads int16).

    Example:
        >>> pack_integer_panels(np.array([[1, 2, 3]], np.uint8), 2, (1,)).view(np.int16).tolist()
        [0, 0, 1, 0, 2, 0, 0, 0]
    """
    b = np.asarray(b).astype(np.int32)
    k, n = b.shape
    zp = np.asarray(zero_point, np.int32)
    b = b - (zp.reshape(1, -1) if zp.size > 1 else zp.reshape(()))
    panels, pairs = -(-n // nr), -(-k // 2)
    padded = np.zeros((2 * pairs, panels * nr), np.int16)
    padded[:k, :n] = b
    packed = padded.reshape(pairs, 2, panels, nr).transpose(2, 0, 3, 1)
    return np.ascontiguousarray(packed).reshape(-1).view(np.int8)


@register_packing("quant.integer_quads", gather=False)
def pack_integer_quads(b: np.ndarray, nr: int, zero_point: tuple[int, ...] = (0,)) -> np.ndarray:
    """``B`` [K, N] u8/i8 for the depth-4 products: as int8 (uint8 shifted by -128), panels of
    ``nr`` columns with rows in fours, ``[ceil(N/nr), ceil(K/4), nr, 4]``, zero past N and K;
    then each column's sum and its zero point (shifted alike; one value or one per column),
    int32, ``ceil(N/nr) * nr`` of each. Returned as bytes.

    Example:
        >>> packed = pack_integer_quads(np.array([[1], [2]], np.int8), 1, (3,))
        >>> packed[:4].tolist(), packed[4:].view(np.int32).tolist()
        ([1, 2, 0, 0], [3, 3])
    """
    b = np.asarray(b)
    shift = 128 if b.dtype == np.uint8 else 0
    shifted = b.astype(np.int32) - shift
    k, n = shifted.shape
    panels, quads = -(-n // nr), -(-k // 4)
    padded = np.zeros((4 * quads, panels * nr), np.int8)
    padded[:k, :n] = shifted
    packed = np.ascontiguousarray(padded.reshape(quads, 4, panels, nr).transpose(2, 0, 3, 1)).reshape(-1)
    sums, zeros = np.zeros(panels * nr, np.int32), np.zeros(panels * nr, np.int32)
    sums[:n] = shifted.sum(axis=0)
    zeros[:n] = np.broadcast_to(np.asarray(zero_point, np.int32) - shift, (n,))
    return np.concatenate([packed, sums.view(np.int8), zeros.view(np.int8)])


@register_packing("quant.integer_tiles", gather=False)
def pack_integer_tiles(b: np.ndarray, zero_point: tuple[int, ...] = (0,)) -> np.ndarray:
    """``B`` [K, N] u8/i8 for AMX tiles (:mod:`amx`): :func:`pack_integer_quads` with panels
    of 16 columns, each panel's quads padded with zeros to whole 64-deep steps
    (``[ceil(N/16), ceil(K/64) * 16, 16, 4]``: a step of a panel is one 1 KiB tile), then the
    column sums and zero points as there.

    Example:
        >>> packed = pack_integer_tiles(np.ones((3, 2), np.int8))
        >>> packed.size, packed[:8].tolist()
        (1152, [1, 1, 1, 0, 1, 1, 1, 0])
    """
    b = np.asarray(b)
    k, n = b.shape
    quads = pack_integer_quads(b, 16, zero_point)
    panels, groups, steps = -(-n // 16), -(-k // 4), -(-k // 64)
    body = quads[:panels * groups * 64].reshape(panels, groups, 64)
    padded = np.zeros((panels, steps * 16, 64), np.int8)
    padded[:, :groups] = body
    return np.concatenate([padded.reshape(-1), quads[panels * groups * 64:]])


def _constant_zero_point(ctx: KernelContext, i: int, count: int) -> tuple[int, ...]:
    """Constant zero point input ``i`` (per tensor, or ``count`` values) as a tuple of ints."""
    if not ctx.has_input(i):
        return (0,)
    value = ctx.constant(i)
    if value is None:
        raise Unsupported(f"{ctx.node.op} with a computed zero point for its constant operand has no generated code")
    flat = np.asarray(value).astype(np.int64).reshape(-1)
    if flat.size not in (1, count):
        raise Unsupported(f"{ctx.node.op} zero point of {flat.size} values for {count} columns")
    return tuple(int(v) for v in flat)


def emit_pair_gemm(ctx: KernelContext, product: PairProduct, panels_ptr: ir.Value, k: int, n: int,
                    rows: ir.Value, pack_row, store_row, finish=None,
                    share: tuple[ir.Value, ir.Value] | None = None) -> None:
    """``out[r, :n] = rows_of_A[r, :k] @ B`` over ``rows`` rows, B constant in the panels of
    :func:`pack_integer_panels` (depth 2) or :func:`pack_integer_quads` (depth 4) at
    ``panels_ptr``; the thread computes the panels ``share`` (``[lo, hi)``; by default its
    share of them, ``ctx.share(panels)``).

    Per tile of ``product.rows`` rows: ``pack_row(row, put, i)`` (``i``: the row's place in the
    tile, an ``i64`` value: the rows are packed in a loop) gives the row's ``k`` values of A
    by calling ``put(column, value_i32)`` (column an ``i64``), which writes them in the
    product's element type to the tile in the thread's scratch (little-endian: ``depth``
    columns read as one int32); then for each panel the tile's outputs accumulate in
    registers, ``finish(i, panel, vectors)`` may correct them (depth 4: the zero points), and
    ``store_row(row, column, valid, lanes)`` writes ``valid`` outputs of the row from
    ``column`` on (``lanes``: an ``i32*`` to the panel's ``nr`` values)."""
    b = ctx.builder
    width, mr, depth, vectors = product.lanes, product.rows, product.depth, 2
    nr, groups = vectors * width, -(-k // depth)
    tile_elements = b.bitcast(ctx.scratch, product.element.as_pointer())
    tile32 = b.bitcast(ctx.scratch, I32.as_pointer())
    panels = -(-n // nr)
    vt32, vt_in = ir.VectorType(I32, width), ir.VectorType(product.element, depth * width)
    bp = b.bitcast(panels_ptr, product.element.as_pointer())
    lo, hi = ctx.share(panels) if share is None else share

    def pack_rows(r0: ir.Value, size: int) -> None:
        # a loop over the tile's rows, not one copy of pack_row per row: with the tails' tiles
        # that was mr * (mr + 1) / 2 copies per product (an im2col ConvInteger's 200,000
        # instructions, 6.6 s of ddddocr_ocr_int8's lowering)
        with ctx.loop(const64(size), name="pack") as i:
            start = b.mul(i, const64(depth * groups))

            def put(column: ir.Value, value: ir.Value) -> None:
                b.store(b.trunc(value, product.element), b.gep(tile_elements, [b.add(start, column)]))

            pack_row(b.add(r0, i), put, i)
            for column in range(k, depth * groups):
                put(const64(column), ir.Constant(I32, 0))

    def tile(r0: ir.Value, size: int, panel: ir.Value) -> None:
        slots = [[ctx.alloca(vt32, name=f"acc{i}_{v}") for v in range(vectors)] for i in range(size)]
        for row in slots:
            for slot in row:
                b.store(ir.Constant(vt32, [0] * width), slot)
        base = b.mul(panel, const64(groups * nr * depth))
        with ctx.loop(const64(groups), name="k") as kk:
            at = b.add(base, b.mul(kk, const64(nr * depth)))
            ws = [b.load(b.bitcast(b.gep(bp, [b.add(at, const64(v * depth * width))]), vt_in.as_pointer()), align=1)
                  for v in range(vectors)]
            for i in range(size):
                group = b.bitcast(splat(b, b.load(b.gep(tile32, [b.add(const64(i * groups), kk)])), width), vt_in)
                for v in range(vectors):
                    b.store(product.emit(b, b.load(slots[i][v]), group, ws[v]), slots[i][v])
        column = b.mul(panel, const64(nr))
        valid = imin(b, const64(nr), b.sub(const64(n), column))
        lanes = b.bitcast(ctx.alloca(ir.ArrayType(I32, nr), name="lanes"), I32.as_pointer())
        for i in range(size):
            values = [b.load(slot) for slot in slots[i]]
            if finish is not None:
                values = finish(i, panel, values)
            for v, value in enumerate(values):
                b.store(value, b.bitcast(b.gep(lanes, [const64(v * width)]), vt32.as_pointer()), align=4)
            store_row(b.add(r0, const64(i)), column, valid, lanes)

    def rows_of(r0: ir.Value, size: int) -> None:
        pack_rows(r0, size)
        with ctx.loop(hi, start=lo, name="panel") as panel:
            tile(r0, size, panel)

    tiles = b.sdiv(rows, const64(mr))
    with ctx.loop(tiles, name="tile") as t:
        rows_of(b.mul(t, const64(mr)), mr)
    rest = b.sub(rows, b.mul(tiles, const64(mr)))
    for size in range(1, mr):
        with b.if_then(b.icmp_signed("==", rest, const64(size))):
            rows_of(b.mul(tiles, const64(mr)), size)


class ZeroPoints:
    """The depth-4 products' zero-point terms: the products run on ``a_u`` (A as uint8) and
    ``b_s`` (B as int8), so ``sum((a_u - za) * (b_s - zb)) = sum(a_u * b_s) - za * colsum(b_s)
    - zb * (rowsum(a_u) - k * za)``, all in wrapping int32 (exact: the result fits). Per row of
    the tile: ``za`` and ``rowsum(a_u) - k * za``, kept in stack slots while the row is packed."""

    def __init__(self, ctx: KernelContext, product: PairProduct, packed: ir.Value, k: int, n: int):
        self.ctx, self.product, self.k = ctx, product, k
        b = ctx.builder
        nr = 2 * product.lanes
        panels, groups = -(-n // nr), -(-k // 4)
        sums = b.bitcast(b.gep(packed, [const64(panels * groups * nr * 4)]), I32.as_pointer())
        self.sums, self.zeros = sums, b.gep(sums, [const64(panels * nr)])
        self.za = ctx.alloca(ir.ArrayType(I32, product.rows), name="za")
        self.shift = ctx.alloca(ir.ArrayType(I32, product.rows), name="zshift")

    def slot(self, array: ir.Value, i: int | ir.Value) -> ir.Value:
        index = ir.Constant(I32, i) if isinstance(i, int) else i
        return self.ctx.builder.gep(array, [ir.Constant(I32, 0), index])

    def row(self, i: int | ir.Value, zero: ir.Value, total: ir.Value) -> None:
        """Row ``i`` of the tile: its zero point (uint8 domain) and the sum of its values."""
        b = self.ctx.builder
        b.store(zero, self.slot(self.za, i))
        b.store(b.sub(total, b.mul(zero, ir.Constant(I32, self.k))), self.slot(self.shift, i))

    def finish(self, i: int, panel: ir.Value, values: list[ir.Value]) -> list[ir.Value]:
        b, width = self.ctx.builder, self.product.lanes
        vt32 = ir.VectorType(I32, width)
        za, shift = (splat(b, b.load(self.slot(array, i)), width) for array in (self.za, self.shift))
        out = []
        for v, value in enumerate(values):
            at = b.add(b.mul(panel, const64(2 * width)), const64(v * width))
            colsum = b.load(b.bitcast(b.gep(self.sums, [at]), vt32.as_pointer()), align=4)
            zb = b.load(b.bitcast(b.gep(self.zeros, [at]), vt32.as_pointer()), align=4)
            out.append(b.sub(b.sub(value, b.mul(za, colsum)), b.mul(zb, shift)))
        return out


def _as_unsigned(b: ir.IRBuilder, value: ir.Value, dtype: DType) -> ir.Value:
    """An element of u8/i8 ``dtype`` as the uint8 it maps to (int8 shifted by +128), in int32."""
    return _widen(b, value, dtype) if dtype == DType.UINT8 else b.add(_widen(b, value, dtype), ir.Constant(I32, 128))


def check_tile_fits(ctx: KernelContext, product: PairProduct, k: int) -> None:
    if product.rows * product.depth * -(-k // product.depth) * 4 > KERNEL_SCRATCH_BYTES:
        raise Unsupported(f"{ctx.node.op} with a depth of {k}: its row tile does not fit the scratch")


def _pack_weights(ctx: KernelContext, product: PairProduct, packing: str, zero_point: tuple[int, ...]) -> ir.Value:
    """The constant B (input 1) packed for ``product``: ``packing`` is the depth-2 one's name
    (``quant.integer_panels`` or ``quant.conv_integer_panels``), the depth-4 ones end in ``quads``."""
    name = packing if product.depth == 2 else packing.replace("panels", "quads")
    packed, _ = ctx.packed_constant("panels", name, 1, nr=2 * product.lanes, zero_point=zero_point)
    return packed


@register_kernel("MatMulInteger")
def matmul_integer(ctx: KernelContext) -> None:
    """``(A - a_zero_point) @ (B - b_zero_point)`` in int32 for a constant 2-D ``B``; A's zero
    point per tensor or per row, computed or constant; B's per tensor or per column.

    The rows of A (all batch dims folded in) in tiles through :func:`emit_pair_gemm`; a
    whole panel of a row is stored as vectors, the last (partial) one lane by lane."""
    a_dtype = _int_dtype(ctx, 0)
    _int_dtype(ctx, 1)
    if ctx.has_input(2) and ctx.in_type(2).dtype != a_dtype:
        raise Unsupported("MatMulInteger a_zero_point of another type than A")
    if not ctx.is_constant(1):
        raise Unsupported("MatMulInteger with a computed B has no generated code (B must be a constant)")
    w_shape = ctx.shape(ctx.in_type(1))
    a_shape = ctx.shape(ctx.in_type(0))
    if len(w_shape) != 2 or not a_shape:
        raise Unsupported(f"MatMulInteger with B of rank {len(w_shape)} (2 only) or a scalar A has no generated code")
    k, n = (int(d) for d in w_shape)
    if a_shape[-1] != k:
        raise Unsupported(f"MatMulInteger: A's last dim {a_shape[-1]} is not B's {k} at compile time")
    b_zero = _constant_zero_point(ctx, 3, n)
    if amx.available() and amx.scratch_bytes(k, n) <= KERNEL_SCRATCH_BYTES:
        _matmul_integer_tiles(ctx, a_dtype, a_shape, k, n, b_zero)
        return
    product = PairProduct.for_host()
    check_tile_fits(ctx, product, k)
    width = product.lanes
    nr = 2 * width
    packed = _pack_weights(ctx, product, "quant.integer_panels", b_zero)
    b = ctx.builder
    a, c = ctx.in_ptr(0), ctx.out_ptr(0)
    vt32 = ir.VectorType(I32, width)
    terms = ZeroPoints(ctx, product, packed, k, n) if product.depth == 4 else None
    zero_of = _a_zero_point(ctx, a_dtype, a_shape, unsigned=terms is not None)
    total = ctx.alloca(I32, name="rowsum")

    def pack_row(row: ir.Value, put, i: ir.Value) -> None:
        zero = zero_of(row)
        src = b.mul(row, const64(k))
        b.store(ir.Constant(I32, 0), total)
        with ctx.loop(const64(k), name="col") as j:
            value = b.load(b.gep(a, [b.add(src, j)]))
            if terms is None:
                put(j, b.sub(_widen(b, value, a_dtype), zero))
            else:
                value = _as_unsigned(b, value, a_dtype)
                b.store(b.add(b.load(total), value), total)
                put(j, value)
        if terms is not None:
            terms.row(i, zero, b.load(total))

    def store_row(row: ir.Value, column: ir.Value, valid: ir.Value, lanes: ir.Value) -> None:
        out = b.add(b.mul(row, const64(n)), column)
        with b.if_else(b.icmp_signed("==", valid, const64(nr))) as (whole, part):
            with whole:
                for v in range(2):
                    value = b.load(b.bitcast(b.gep(lanes, [const64(v * width)]), vt32.as_pointer()), align=4)
                    b.store(value, b.bitcast(b.gep(c, [b.add(out, const64(v * width))]), vt32.as_pointer()), align=4)
            with part:
                with ctx.loop(valid, name="j") as j:
                    b.store(b.load(b.gep(lanes, [j])), b.gep(c, [b.add(out, j)]))

    emit_pair_gemm(ctx, product, packed, k, n, ctx.dim(_numel(a_shape[:-1])), pack_row, store_row,
                    terms.finish if terms is not None else None)


def _a_zero_point(ctx: KernelContext, a_dtype: DType, a_shape,
                  unsigned: bool = True) -> Callable[[ir.Value], ir.Value]:
    """A's zero point for a row of A's rows (``i64``), in int32: none, per tensor (loaded
    once, here) or per row of A's last matrix. ``unsigned``: as the uint8 it maps to (int8
    shifted by 128; 128 for an int8 A without one), for the products on raw uint8 bytes;
    else as its own value (0 without one)."""
    b = ctx.builder
    if not ctx.has_input(2):
        fixed = ir.Constant(I32, 128 if unsigned and a_dtype == DType.INT8 else 0)
        return lambda row: fixed

    def widened(value: ir.Value) -> ir.Value:
        return _as_unsigned(b, value, a_dtype) if unsigned else _widen(b, value, a_dtype)

    zp_shape = ctx.shape(ctx.in_type(2))
    pointer = ctx.in_ptr(2)
    if _is_scalar(zp_shape):
        value = widened(b.load(pointer))
        return lambda row: value
    if len(zp_shape) == 1 and len(a_shape) >= 2:
        per = ctx.dim(a_shape[-2])
        return lambda row: widened(b.load(b.gep(pointer, [b.srem(row, per)])))
    raise Unsupported(f"MatMulInteger a_zero_point of shape {list(zp_shape)} has no generated code")


def _matmul_integer_tiles(ctx: KernelContext, a_dtype: DType, a_shape, k: int, n: int,
                          b_zero: tuple[int, ...]) -> None:
    """MatMulInteger on AMX tiles (:func:`amx.emit_tile_gemm`) on A as uint8 (int8 shifted by
    128) and B as int8, with the zero-point terms of :class:`ZeroPoints`: ``- za *
    colsum(B) - zb * (rowsum(A) - k * za)``. With one zero point for A and none for B, the
    first is one row every output row starts from; otherwise both are subtracted from each
    row after its products (the row sums taken per block of rows)."""
    b = ctx.builder
    packed, _ = ctx.packed_constant("tiles", "quant.integer_tiles", 1, zero_point=b_zero)
    a, c = ctx.in_ptr(0), ctx.out_ptr(0)
    count = -(-n // 16)
    steps = -(-k // 64)
    sums = b.bitcast(b.gep(packed, [const64(count * steps * 16 * 64)]), I32.as_pointer())
    zeros = b.gep(sums, [const64(count * 16)])
    shifted = any(b_zero) or ctx.in_type(1).dtype == DType.UINT8  # uint8 B: its zero point moves by -128
    per_row = ctx.has_input(2) and not _is_scalar(ctx.shape(ctx.in_type(2)))
    zero_of = _a_zero_point(ctx, a_dtype, a_shape)
    signed = a_dtype == DType.INT8
    rows = ctx.dim(_numel(a_shape[:-1]))
    if not shifted and not per_row:
        bias = amx.bias_row(ctx, k)
        za = zero_of(const64(0))
        with ctx.loop(const64(count * 16), name="bias") as j:
            b.store(b.sub(ir.Constant(I32, 0), b.mul(za, b.load(b.gep(sums, [j])))), b.gep(bias, [j]))
        amx.emit_tile_gemm(ctx, packed, k, n, rows, a, signed, c, bias)
        return
    rows_za = ctx.alloca(ir.ArrayType(I32, 2 * amx.TILE_ROWS), name="za")
    rows_shift = ctx.alloca(ir.ArrayType(I32, 2 * amx.TILE_ROWS), name="zshift")
    total = ctx.alloca(I32, name="rowsum")

    def slot(array: ir.Value, i: ir.Value) -> ir.Value:
        return b.gep(array, [ir.Constant(I32, 0), i])

    def row_terms(r0: ir.Value, valid_rows: ir.Value) -> None:
        with ctx.loop(valid_rows, name="terms") as i:
            row = b.add(r0, i)
            za = zero_of(row)
            b.store(za, slot(rows_za, i))
            b.store(ir.Constant(I32, 0), total)
            if shifted:
                with ctx.loop(const64(k), name="sum") as j:
                    value = _as_unsigned(b, b.load(b.gep(a, [b.add(b.mul(row, const64(k)), j)])), a_dtype)
                    b.store(b.add(b.load(total), value), total)
            b.store(b.sub(b.load(total), b.mul(za, ir.Constant(I32, k))), slot(rows_shift, i))

    def fix_row(row: ir.Value, i: ir.Value, column: ir.Value, end: ir.Value) -> None:
        za, shift = b.load(slot(rows_za, i)), b.load(slot(rows_shift, i))
        base = b.mul(row, const64(n))
        with ctx.loop(end, start=column, name="fix_col") as j:
            at = b.gep(c, [b.add(base, j)])
            value = b.sub(b.load(at), b.mul(za, b.load(b.gep(sums, [j]))))
            if shifted:
                value = b.sub(value, b.mul(b.load(b.gep(zeros, [j])), shift))
            b.store(value, at)

    amx.emit_tile_gemm(ctx, packed, k, n, rows, a, signed, c, row_terms=row_terms, fix_row=fix_row)


# ---- ConvInteger ----------------------------------------------------------------------------------
@register_packing("quant.conv_integer_weights", gather=False)
def pack_conv_integer_weights(w: np.ndarray, zero_point: tuple[int, ...] = (0,)) -> np.ndarray:
    """``w - zero_point`` (per tensor, or one value per output channel) as int32, same layout.

    Example:
        >>> pack_conv_integer_weights(np.array([[[[3]]], [[[5]]]], np.uint8), (1, 2)).ravel().tolist()
        [2, 3]
    """
    w = np.asarray(w).astype(np.int32)
    zp = np.asarray(zero_point, np.int32)
    shift = zp.reshape((-1,) + (1,) * (w.ndim - 1)) if zp.size > 1 else zp.reshape(())
    return np.ascontiguousarray(w - shift)


@register_packing("quant.conv_integer_panels", gather=False)
def pack_conv_integer_panels(w: np.ndarray, nr: int, zero_point: tuple[int, ...] = (0,)) -> np.ndarray:
    """The weights ``[M, C, *K]`` as the im2col product's constant B: ``[C * prod(K), M]`` (a
    column per output channel, taps in ``(c, kh, kw)`` order) in the panels of
    :func:`pack_integer_panels`, ``w_zero_point`` per tensor or per output channel."""
    w = np.asarray(w)
    return pack_integer_panels(w.reshape(w.shape[0], -1).T, nr, zero_point)


@register_packing("quant.conv_integer_quads", gather=False)
def pack_conv_integer_quads(w: np.ndarray, nr: int, zero_point: tuple[int, ...] = (0,)) -> np.ndarray:
    """The weights ``[M, C, *K]`` as :func:`pack_conv_integer_panels` lays them out, packed by
    :func:`pack_integer_quads` for the depth-4 products."""
    w = np.asarray(w)
    return pack_integer_quads(w.reshape(w.shape[0], -1).T, nr, zero_point)


def _im2col_conv_integer(ctx: KernelContext, g, x_dtype: DType, x_zero: ir.Value, w_zero: tuple[int, ...]) -> None:
    """ConvInteger (group 1) as a product: the output pixels of each image are the rows, the
    taps ``(c, kh, kw)`` the depth and the output channels the columns of
    :func:`emit_pair_gemm`; a row's taps are gathered from x (zero outside the input).
    ``x_zero``: x's zero point as int32 in x's type (depth 2) or as uint8 (depth 4)."""
    product = PairProduct.for_host()
    taps = g.channels * g.k_h * g.k_w
    check_tile_fits(ctx, product, taps)
    packed = _pack_weights(ctx, product, "quant.conv_integer_panels", w_zero)
    terms = ZeroPoints(ctx, product, packed, taps, g.out_channels) if product.depth == 4 else None
    total = ctx.alloca(I32, name="rowsum")
    b = ctx.builder
    x, y = ctx.in_ptr(0), ctx.out_ptr(0)
    in_h, in_w, out_h, out_w = (ctx.dim(d) for d in (g.in_h, g.in_w, g.out_h, g.out_w))
    pad_h, pad_w = ctx.dim(g.pad_h), ctx.dim(g.pad_w)
    pixels = b.mul(out_h, out_w)
    plane = b.mul(in_h, in_w)
    zero = ir.Constant(I32, 0)
    with ctx.loop(ctx.dim(g.batch), name="n") as image:
        x_image = b.mul(image, b.mul(plane, const64(g.channels)))
        y_image = b.mul(image, b.mul(pixels, const64(g.out_channels)))

        def pack_row(pixel: ir.Value, put, i: ir.Value) -> None:
            b.store(ir.Constant(I32, 0), total)
            oh, ow = b.sdiv(pixel, out_w), b.srem(pixel, out_w)
            top = b.sub(b.mul(oh, const64(g.stride_h)), pad_h)
            left = b.sub(b.mul(ow, const64(g.stride_w)), pad_w)
            with ctx.loop(const64(g.channels), name="ic") as ic:
                channel = b.add(x_image, b.mul(ic, plane))
                for kh in range(g.k_h):
                    ih = b.add(top, const64(kh * g.dil_h))
                    row_inside = b.and_(b.icmp_signed(">=", ih, const64(0)), b.icmp_signed("<", ih, in_h))
                    for kw in range(g.k_w):
                        iw = b.add(left, const64(kw * g.dil_w))
                        inside = b.and_(row_inside, b.and_(b.icmp_signed(">=", iw, const64(0)),
                                                           b.icmp_signed("<", iw, in_w)))
                        at = b.select(inside, b.add(channel, b.add(b.mul(ih, in_w), iw)), const64(0))
                        raw = b.load(b.gep(x, [at]))
                        if terms is None:
                            value = b.select(inside, b.sub(_widen(b, raw, x_dtype), x_zero), zero)
                        else:  # uint8 values; the padding is the zero point (zero once it is subtracted)
                            value = b.select(inside, _as_unsigned(b, raw, x_dtype), x_zero)
                            b.store(b.add(b.load(total), value), total)
                        put(b.add(b.mul(ic, const64(g.k_h * g.k_w)), const64(kh * g.k_w + kw)), value)
            if terms is not None:
                terms.row(i, x_zero, b.load(total))

        def store_row(pixel: ir.Value, column: ir.Value, valid: ir.Value, lanes: ir.Value) -> None:
            with ctx.loop(valid, name="j") as j:
                at = b.add(y_image, b.add(b.mul(b.add(column, j), pixels), pixel))
                b.store(b.load(b.gep(lanes, [j])), b.gep(y, [at]))

        emit_pair_gemm(ctx, product, packed, taps, g.out_channels, pixels, pack_row, store_row,
                        terms.finish if terms is not None else None)


@register_kernel("ConvInteger")
def conv_integer(ctx: KernelContext) -> None:
    """int32 convolution of ``x - x_zero_point`` (per tensor, computed or constant) with the
    constant ``w - w_zero_point`` (per tensor or per output channel), 1-D or 2-D, runtime
    spatial sizes (static channels and kernel); padding contributes zero. One group: an
    im2col product on int16 pair products (:func:`_im2col_conv_integer`); several groups: a
    direct loop nest, output channels split over threads, the innermost loop over contiguous
    output columns."""
    x_dtype, _ = _int_dtype(ctx, 0), _int_dtype(ctx, 1)
    if not ctx.is_constant(1):
        raise Unsupported("ConvInteger with computed weights has no generated code")
    g = symbolic_geometry(ctx)
    w_zero = _constant_zero_point(ctx, 3, g.out_channels)
    b = ctx.builder
    x_zero = ir.Constant(I32, 0)
    if ctx.has_input(2):
        if not _is_scalar(ctx.shape(ctx.in_type(2))):
            raise Unsupported("ConvInteger with a per-channel x_zero_point has no generated code")
        x_zero = _widen(b, b.load(ctx.in_ptr(2)), x_dtype)
    if g.group == 1:
        if PairProduct.for_host().depth == 4:
            x_zero = _as_unsigned(b, b.load(ctx.in_ptr(2)), x_dtype) if ctx.has_input(2) else \
                ir.Constant(I32, 0 if x_dtype == DType.UINT8 else 128)
        _im2col_conv_integer(ctx, g, x_dtype, x_zero, w_zero)
        return
    weights, _ = ctx.packed_constant("weights", "quant.conv_integer_weights", 1, zero_point=w_zero)
    x, y = ctx.in_ptr(0), ctx.out_ptr(0)
    in_h, in_w, out_h, out_w = (ctx.dim(d) for d in (g.in_h, g.in_w, g.out_h, g.out_w))
    pad_h, pad_w = ctx.dim(g.pad_h), ctx.dim(g.pad_w)
    group_in, group_out = g.channels // g.group, g.out_channels // g.group
    column_ranges = []
    for kw in range(g.k_w):
        offset = b.sub(const64(kw * g.dil_w), pad_w)
        column_ranges.append((offset, *valid_range(b, offset, g.stride_w, in_w, out_w)))
    lo, hi = ctx.share(g.out_channels)
    with ctx.loop(ctx.dim(g.batch), name="n") as n:
        with ctx.loop(hi, start=lo, name="oc") as oc:
            grp = b.sdiv(oc, const64(group_out))
            with ctx.loop(out_h, name="oh") as oh:
                y_row = b.mul(b.add(b.mul(b.add(b.mul(n, const64(g.out_channels)), oc), out_h), oh), out_w)
                with ctx.loop(out_w, name="ow0") as ow:
                    b.store(ir.Constant(I32, 0), b.gep(y, [b.add(y_row, ow)]))
                top = b.sub(b.mul(oh, const64(g.stride_h)), pad_h)
                kh_lo, kh_hi = valid_range(b, top, g.dil_h, in_h, const64(g.k_h))
                with ctx.loop(const64(group_in), name="ic") as ic:
                    channel = b.add(b.mul(grp, const64(group_in)), ic)
                    w_base = b.mul(b.add(b.mul(oc, const64(group_in)), ic), const64(g.k_h * g.k_w))
                    with ctx.loop(kh_hi, name="kh", start=kh_lo) as kh:
                        ih = b.add(top, b.mul(kh, const64(g.dil_h)))
                        x_row = b.mul(b.add(b.mul(b.add(b.mul(n, const64(g.channels)), channel), in_h), ih), in_w)
                        w_row = b.add(w_base, b.mul(kh, const64(g.k_w)))
                        for kw, (offset, c_lo, c_hi) in enumerate(column_ranges):
                            weight = b.load(b.gep(weights, [b.add(w_row, const64(kw))]))
                            with ctx.loop(c_hi, name="ow", start=c_lo) as ow:
                                iw = b.add(b.mul(ow, const64(g.stride_w)), offset)
                                value = b.sub(_widen(b, b.load(b.gep(x, [b.add(x_row, iw)])), x_dtype), x_zero)
                                out = b.gep(y, [b.add(y_row, ow)])
                                b.store(b.add(b.load(out), b.mul(weight, value)), out)


__all__ = ["pack_integer_panels", "pack_conv_integer_weights", "matmul_integer", "conv_integer", "quantize_linear",
           "dequantize_linear", "dynamic_parameters", "dynamic_quantize_linear", "PairProduct", "RANGES",
           "pack_integer_quads", "pack_conv_integer_panels", "pack_conv_integer_quads", "emit_pair_gemm",
           "ZeroPoints", "check_tile_fits", "quantize_element"]

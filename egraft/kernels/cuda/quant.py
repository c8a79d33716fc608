"""CUDA kernels of the quantized ops: ``QuantizeLinear``, ``DequantizeLinear``,
``DynamicQuantizeLinear`` and the integer products ``MatMulInteger``, ``ConvInteger``,
``QLinearMatMul``, ``QLinearConv`` (what dynamically quantized transformers and int8 OCR
models run). The numbers are the registry's (:mod:`egraft.ir.ops.quantize`) bit for bit.

Quantize and Dequantize are one broadcasting loop each (the elementwise module's
:func:`~egraft.kernels.cuda.elementwise.emit_broadcast`: vectorized, 32-bit indices where
they fit), the scale and zero point read per tensor or along ``axis``. Quantizing is
``saturate(rintf(x / scale) + zero_point)`` in float32 (a true division; ``rintf`` rounds
half to even; NaN gives 0). ``DynamicQuantizeLinear`` is two functions: one block of 1024
threads finds the range (16-byte loads, warp shuffles, the range includes 0) and writes the
scale and zero point into outputs 1 and 2; then a grid-stride loop quantizes four elements
a thread (a 16-byte load, a 4-byte store), reading the scale and zero point back.

The integer products share one tile loop, :func:`int_gemm_body`, the integer sibling of
:func:`egraft.kernels.cuda.gemm.gemm_body`: the same tiles (64x64, 32x128, 128x32 outputs,
256 threads, 4x4 / 2x8 / 8x2 a thread), double-buffered in shared memory, but a shared
element is a 32-bit word of four consecutive K bytes and a step of K is 16 words (64
bytes). The product of two words is one ``dp4a`` (four byte products summed into an int32
accumulator: exact, no int16 saturation) on the raw bytes; the zero points enter in the
epilogue, ``sum (a - za)(b - zb) = sum ab - zb sum a - za sum b + K za zb``, with the
row sums of A and the column sums of B taken from the shared tiles by 2 to 5 warps of the
block (only those a zero point needs), wrapping in 32 bits like the exact int32 result.
Bytes past K read as 0 on both sides; a convolution's padding reads as the input's zero
point (so that it contributes nothing). ``QLinear*`` requantize the exact sum in float64:
``saturate(rint(acc * (scale_a * scale_b / scale_y)) + zero_point_y)``.

MatMul shapes are MatMul's (``[batch, seq, K] @ [K, N]`` folds into one product; batched
and broadcast operands otherwise); convolutions are the implicit GEMM of
:mod:`egraft.kernels.cuda.conv` (weights as A, the virtual im2col matrix of the image as
B, the group the batch index), depthwise ones a direct kernel, one thread per output.

Example:
    >>> kernel = generate(matmul_integer_node, graph)         # doctest: +SKIP
    >>> [launch.function for launch in kernel.launches]       # doctest: +SKIP
    ['eg_matmul_integer']
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from egraft.ir.dims import dim_product, dims_equal
from egraft.ir.dtypes import DType
from egraft.kernels.cuda import register_kernel
from egraft.kernels.cuda.conv import ConvGeometry, conv_geometry
from egraft.kernels.cuda.elementwise import Operand as BroadcastOperand
from egraft.kernels.cuda.elementwise import emit_broadcast, vec4_type
from egraft.kernels.cuda.emit import C_TYPES, CudaContext, Unsupported
from egraft.kernels.cuda.gemm import (
    Term,
    Tile,
    batch_bases,
    broadcast_strides,
    gemm_grid,
    k_loop,
    pick_tile,
    strided,
    tile_coordinates,
    zeroed_accumulators,
)

#: Saturation ranges of the quantized types.
RANGES = {DType.UINT8: (0, 255), DType.INT8: (-128, 127), DType.UINT16: (0, 65535), DType.INT16: (-32768, 32767)}
#: The operand types of the integer products.
BYTES = (DType.UINT8, DType.INT8)
#: Threads of the block that finds DynamicQuantizeLinear's range.
RANGE_THREADS = 1024
#: Threads of a block of the elementwise loops here.
THREADS = 256
#: At most this many blocks for a grid-stride loop.
MAX_BLOCKS = 4096
#: Four ones, one per byte: ``dp4a(word, ONES)`` is the sum of the word's bytes.
ONES = "0x01010101u"


# ---- parameters: scales and zero points ----------------------------------------------------------
def _is_scalar(shape) -> bool:
    return len(shape) == 0 or all(isinstance(d, int) and d == 1 for d in shape)


def _param_axis(ctx: CudaContext, slots: tuple[int, ...]) -> int | None:
    """The axis of x along which the scale/zero point inputs ``slots`` vary (``None``: per
    tensor); ``Unsupported`` for blocked or other layouts."""
    if ctx.opset >= 21 and int(ctx.attr("block_size", 0) or 0):
        raise Unsupported(f"blocked {ctx.node.op} (block_size) has no CUDA kernel")
    shapes = [ctx.in_shape(i) for i in slots if ctx.has_input(i)]
    if all(_is_scalar(s) for s in shapes):
        return None
    rank = len(ctx.in_shape(0))
    if rank == 0 or any(len(s) != 1 for s in shapes):
        raise Unsupported(f"{ctx.node.op} parameters of shapes {[list(s) for s in shapes]} (a scalar or a 1-D "
                          "tensor along axis only)")
    return int(ctx.attr("axis", 1)) % rank


def _param_operand(ctx: CudaContext, slot: int, axis: int | None) -> BroadcastOperand:
    """A scale or zero point as an operand of the broadcasting loop: one element, or x's
    extent along ``axis`` (x's own dim: the registry checked the two agree)."""
    if axis is None or _is_scalar(ctx.in_shape(slot)):
        return BroadcastOperand(slot, ())
    x = ctx.in_shape(0)
    return BroadcastOperand(slot, tuple(x[d] if d == axis else 1 for d in range(len(x))))


def _require(ctx: CudaContext, slot: int, allowed: tuple, what: str) -> DType:
    dtype = ctx.in_dtype(slot)
    if dtype not in allowed:
        raise Unsupported(f"{ctx.node.op} {what} of type {dtype.short} has no CUDA kernel "
                          f"({', '.join(d.short for d in allowed)} only)")
    return dtype


def _float_literal(value: float) -> str:
    return f"{float(value)!r}f"


# ---- QuantizeLinear, DequantizeLinear ------------------------------------------------------------
def saturate_code(value: str, dtype: DType) -> str:
    """The C expression of the float ``value`` (already rounded) clamped to ``dtype``'s
    range and converted (NaN gives 0, as the registry's ``nan_to_num``).

    Example:
        >>> saturate_code("q", DType.INT8)
        '((signed char)(q != q ? 0.0f : fminf(fmaxf(q, -128.0f), 127.0f)))'
    """
    lo, hi = RANGES[dtype]
    return f"(({C_TYPES[dtype]})({value} != {value} ? 0.0f : fminf(fmaxf({value}, {lo}.0f), {hi}.0f)))"


@register_kernel("QuantizeLinear")
def quantize_linear(ctx: CudaContext) -> None:
    """f32 -> u8/i8/u16/i16, ``saturate(rintf(x / scale) + zero_point)``, per tensor or
    per axis: one broadcasting loop.

    Example:
        >>> generate(quantize_node, graph).launches[0].function      # doctest: +SKIP
        'eg_quantizelinear'
    """
    _require(ctx, 0, (DType.FLOAT32,), "input")
    _require(ctx, 1, (DType.FLOAT32,), "scale")
    if ctx.opset >= 23 and int(ctx.attr("precision", 0) or 0) not in (0, 1):
        raise Unsupported("QuantizeLinear with a precision other than f32 has no CUDA kernel")
    dtype = ctx.out_dtype(0)
    if dtype not in RANGES:
        raise Unsupported(f"QuantizeLinear to {dtype.short} has no CUDA kernel")
    axis = _param_axis(ctx, (1, 2))
    operands = [BroadcastOperand(0), _param_operand(ctx, 1, axis)]
    shift = ""
    if ctx.has_input(2):
        operands.append(_param_operand(ctx, 2, axis))
        shift = " + (float)a2"
    emit_broadcast(ctx, "eg_quantizelinear", operands, saturate_code("q", dtype),
                   prologue=[f"const float q = rintf(a0 / a1){shift};"])


@register_kernel("DequantizeLinear")
def dequantize_linear(ctx: CudaContext) -> None:
    """u8/i8/u16/i16/i32 -> f32, ``float(x - zero_point) * scale`` (the difference in 64
    bits for int32), per tensor or per axis: one broadcasting loop.

    Example:
        >>> generate(dequantize_node, graph).launches[0].function    # doctest: +SKIP
        'eg_dequantizelinear'
    """
    dtype = _require(ctx, 0, (*RANGES, DType.INT32), "input")
    _require(ctx, 1, (DType.FLOAT32,), "scale")
    if ctx.out_dtype(0) != DType.FLOAT32:
        raise Unsupported(f"DequantizeLinear to {ctx.out_dtype(0).short} has no CUDA kernel (f32 only)")
    axis = _param_axis(ctx, (1, 2))
    operands = [BroadcastOperand(0), _param_operand(ctx, 1, axis)]
    wide = "long long" if dtype == DType.INT32 else "int"
    diff = f"({wide})a0"
    if ctx.has_input(2):
        operands.append(_param_operand(ctx, 2, axis))
        diff = f"({wide})a0 - ({wide})a2"
    emit_broadcast(ctx, "eg_dequantizelinear", operands, f"(float)({diff}) * a1")


# ---- DynamicQuantizeLinear --------------------------------------------------------------------------
@register_kernel("DynamicQuantizeLinear")
def dynamic_quantize_linear(ctx: CudaContext) -> None:
    """f32 -> u8 with the scale and zero point of x's range: the range in one block
    (outputs 1 and 2 written), then the quantizing loop.

    Example:
        >>> [l.function for l in generate(node, graph).launches]    # doctest: +SKIP
        ['eg_dynamic_quantize_range', 'eg_dynamic_quantize_apply']
    """
    _require(ctx, 0, (DType.FLOAT32,), "input")
    n = ctx.numel(ctx.in_shape(0))
    x, y, scale, zero_point = ctx.x(0), ctx.y(0), ctx.y(1), ctx.y(2)
    f4, u4 = vec4_type(ctx, "float"), vec4_type(ctx, "unsigned char")
    ctx.helper(_QUANTIZE_U8)
    count = ctx.dim(n)
    ctx.function("eg_dynamic_quantize_range", f"""__shared__ float lows[{RANGE_THREADS // 32}];
__shared__ float highs[{RANGE_THREADS // 32}];
const long long n = {count};
const int t = (int)threadIdx.x;
float lo = 0.0f, hi = 0.0f;  /* the range includes 0 */
const long long n4 = ((unsigned long long){x} & 15ULL) == 0ULL ? n / 4 : 0LL;
for (long long i = t; i < n4; i += {RANGE_THREADS}) {{
    const {f4} v = reinterpret_cast<const {f4}*>({x})[i];
    lo = fminf(lo, fminf(fminf(v.v[0], v.v[1]), fminf(v.v[2], v.v[3])));
    hi = fmaxf(hi, fmaxf(fmaxf(v.v[0], v.v[1]), fmaxf(v.v[2], v.v[3])));
}}
for (long long i = n4 * 4 + t; i < n; i += {RANGE_THREADS}) {{
    lo = fminf(lo, {x}[i]);
    hi = fmaxf(hi, {x}[i]);
}}
lo = -eg_warp_max(-lo);
hi = eg_warp_max(hi);
if ((t & 31) == 0) {{
    lows[t >> 5] = lo;
    highs[t >> 5] = hi;
}}
__syncthreads();
if (t < 32) {{  /* one full warp finishes */
    lo = -eg_warp_max(-lows[t]);
    hi = eg_warp_max(highs[t]);
    if (t == 0) {{
        float s = (hi - lo) / 255.0f;
        float zp = 0.0f;
        if (s == 0.0f) s = 1.0f;  /* x is all zeros: y and the zero point are 0 */
        else zp = rintf(fminf(fmaxf(0.0f - lo / s, 0.0f), 255.0f));
        {scale}[0] = s;
        {zero_point}[0] = (unsigned char)zp;
    }}
}}""", grid=1, block=RANGE_THREADS)
    ctx.function("eg_dynamic_quantize_apply", f"""const long long n = {count};
const float s = {scale}[0], zp = (float){zero_point}[0];
const long long step = (long long)gridDim.x * {THREADS};
const long long first = (long long)blockIdx.x * {THREADS} + threadIdx.x;
const bool aligned = ((unsigned long long){x} & 15ULL) == 0ULL && ((unsigned long long){y} & 3ULL) == 0ULL;
const long long n4 = aligned ? n / 4 : 0LL;
for (long long i = first; i < n4; i += step) {{
    const {f4} v = reinterpret_cast<const {f4}*>({x})[i];
    {u4} q;
#pragma unroll
    for (int c = 0; c < 4; ++c) q.v[c] = eg_quantize_u8(v.v[c], s, zp);
    reinterpret_cast<{u4}*>({y})[i] = q;
}}
for (long long i = n4 * 4 + first; i < n; i += step) {y}[i] = eg_quantize_u8({x}[i], s, zp);""",
                 grid=ctx.blocks_for(_ceil_div(n, 4), THREADS, MAX_BLOCKS), block=THREADS)


_QUANTIZE_U8 = f"""__device__ __forceinline__ unsigned char eg_quantize_u8(float x, float scale, float zero_point) {{
    const float q = rintf(x / scale) + zero_point;
    return {saturate_code("q", DType.UINT8)};
}}"""


def _ceil_div(n, k: int):
    return -(-n // k) if isinstance(n, int) else (n + k - 1) // k


# ---- the integer tile loop -------------------------------------------------------------------------
@dataclass(frozen=True)
class ByteOperand:
    """How :func:`int_gemm_body` reads one operand: ``word(slot, w)`` is the C expression
    (``unsigned``) of bytes ``4w .. 4w + 3`` of K of row ``x`` (byte ``i`` in bits ``8i``;
    0 past K and outside the operand), after ``prepare(slot, x)``'s statements; ``along``
    says which index consecutive threads read (``"x"`` or ``"k"``, as
    :class:`egraft.kernels.cuda.gemm.Operand`); ``signed``: int8 bytes, else uint8."""

    along: str
    prepare: Callable[[str, str], str]
    word: Callable[[str, str], str]
    signed: bool


def dense_bytes(ctx: CudaContext, pointer: str, base: str, rows: str, depth: str, row_stride: str, k_stride: str,
                along: str, signed: bool) -> ByteOperand:
    """A strided byte matrix: element ``(k, x)`` at ``pointer[base + x * row_stride + k *
    k_stride]`` for ``x < rows`` and ``k < depth``. Contiguous rows (``k_stride`` 1) load a
    word at once where the row is 4-byte aligned.

    Example:
        >>> op = dense_bytes(CudaContext(None, None), "x0", "0LL", "M", "K", "K", "1LL", "k", True)
        >>> op.word("a0", "w")
        '(ok_a0 ? eg_bytes_contiguous(p_a0, 4LL * (w), K, al_a0) : 0u)'
    """
    contiguous = k_stride == "1LL"
    ctx.helper(_BYTES_CONTIGUOUS if contiguous else _BYTES_STRIDED)

    def prepare(slot: str, x: str) -> str:
        lines = [f"const bool ok_{slot} = ({x}) < {rows};",
                 f"const unsigned char* p_{slot} = reinterpret_cast<const unsigned char*>({pointer}) + {base} + "
                 f"(ok_{slot} ? ({x}) : 0LL) * {row_stride};"]
        if contiguous:
            lines.append(f"const bool al_{slot} = ((unsigned long long)p_{slot} & 3ULL) == 0ULL;")
        return "\n".join(lines)

    def word(slot: str, w: str) -> str:
        if contiguous:
            return f"(ok_{slot} ? eg_bytes_contiguous(p_{slot}, 4LL * ({w}), {depth}, al_{slot}) : 0u)"
        return f"(ok_{slot} ? eg_bytes_strided(p_{slot}, 4LL * ({w}), {depth}, {k_stride}) : 0u)"

    return ByteOperand(along, prepare, word, signed)


_BYTES_CONTIGUOUS = """__device__ __forceinline__ unsigned eg_bytes_contiguous(const unsigned char* __restrict__ p,
        long long k, long long depth, bool aligned) {
    if (aligned && k + 4 <= depth) return *reinterpret_cast<const unsigned*>(p + k);
    unsigned w = 0u;
#pragma unroll
    for (int i = 0; i < 4; ++i)
        if (k + i < depth) w |= (unsigned)p[k + i] << (8 * i);
    return w;
}"""

_BYTES_STRIDED = """__device__ __forceinline__ unsigned eg_bytes_strided(const unsigned char* __restrict__ p,
        long long k, long long depth, long long stride) {
    unsigned w = 0u;
#pragma unroll
    for (int i = 0; i < 4; ++i)
        if (k + i < depth) w |= (unsigned)p[(k + i) * stride] << (8 * i);
    return w;
}"""


def dot4(ctx: CudaContext, a_signed: bool, b_signed: bool) -> str:
    """The name of ``int f(unsigned a, unsigned b, int c)``: ``c`` plus the four byte
    products of ``a`` and ``b`` (int8 or uint8 bytes), added to the translation unit:
    ``dp4a`` on the GPU, plain C in the emulator (which defines no ``__CUDA_ARCH__``).

    Example:
        >>> dot4(CudaContext(None, None), False, True)
        'eg_dot4_us'
    """
    letters = ("s" if a_signed else "u") + ("s" if b_signed else "u")
    name = f"eg_dot4_{letters}"
    ptx = ".".join("s32" if s else "u32" for s in (a_signed, b_signed))
    byte = {True: "(int)(signed char)", False: "(int)(unsigned char)"}
    ctx.helper(f"""__device__ __forceinline__ int {name}(unsigned a, unsigned b, int c) {{
#ifdef __CUDA_ARCH__
    int d;
    asm("dp4a.{ptx} %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(c));
    return d;
#else
    unsigned s = (unsigned)c;
    for (int i = 0; i < 4; ++i) s += (unsigned)({byte[a_signed]}(a >> (8 * i)) * {byte[b_signed]}(b >> (8 * i)));
    return (int)s;
#endif
}}""")
    return name


@dataclass(frozen=True)
class IntEpilogue:
    """What :func:`int_gemm_body` does with the exact sum of row ``m`` and the thread's
    column ``j`` (``n_<j>``): A's zero point of row ``m`` and B's of column ``n_<j>`` (C int
    expressions of the given variable, ``None`` when absent or 0), statements per row and
    per column (``row_setup(m)``, ``column_setup(j)``), and ``value(v, j)``, the C
    expression stored at ``out`` for the exact int32 sum ``v``."""

    out: Term
    a_zero: Callable[[str], str] | None = None
    b_zero: Callable[[str], str] | None = None
    row_setup: Callable[[str], str] | None = None
    column_setup: Callable[[int], str] | None = None
    value: Callable[[str, int], str] = lambda v, j: v


def _word_loads(tile: Tile, operand: ByteOperand, name: str, extent: int) -> tuple[str, str, str]:
    """(prepare, load into registers, store into shared memory) of one operand's tile of
    ``tile.bk`` words of K by ``extent`` rows; consecutive threads read consecutive rows
    (``along == "x"``) or words."""
    per_thread = tile.bk * extent // tile.threads
    buffer, origin = ("As", "m0") if name == "a" else ("Bs", "n0")
    prepare, loads, stores = [], [], []
    if operand.along == "x":  # thread t: row t % extent, word t / extent + step * r
        step = tile.threads // extent
        prepare.append(operand.prepare(f"{name}0", f"{origin} + (long long)(t % {extent})"))
        for r in range(per_thread):
            w = f"(t / {extent} + {step * r})"
            loads.append(f"r{name}[{r}] = {operand.word(f'{name}0', f'k0 + {w}')};")
            stores.append(f"{buffer}[{{buf}}][{w}][t % {extent}] = r{name}[{r}];")
    else:  # thread t: word t % bk, row t / bk + step * r
        step = tile.threads // tile.bk
        for r in range(per_thread):
            x = f"(t / {tile.bk} + {step * r})"
            prepare.append(operand.prepare(f"{name}{r}", f"{origin} + (long long){x}"))
            loads.append(f"r{name}[{r}] = {operand.word(f'{name}{r}', f'k0 + t % {tile.bk}')};")
            stores.append(f"{buffer}[{{buf}}][t % {tile.bk}][{x}] = r{name}[{r}];")
    return "\n".join(prepare), "\n".join(loads), "\n".join(stores)


def _sums(ctx: CudaContext, tile: Tile, a: ByteOperand, b: ByteOperand, rows: bool, cols: bool) -> str:
    """Statements (in the K loop) adding the current tiles' column sums of B (threads
    ``t < bn``) and row sums of A (threads ``bn <= t < bn + bm``) to ``own``."""
    parts = []
    if cols:
        dot = dot4(ctx, b.signed, False)
        parts.append(f"if (t < {tile.bn}) {{\n#pragma unroll\nfor (int kk = 0; kk < {tile.bk}; ++kk) "
                     f"own = {dot}(Bs[cur][kk][t], {ONES}, own);\n}}")
    if rows:
        dot = dot4(ctx, a.signed, False)
        test = f"t >= {tile.bn} && t < {tile.bn + tile.bm}"
        parts.append(f"if ({test}) {{\n#pragma unroll\nfor (int kk = 0; kk < {tile.bk}; ++kk) "
                     f"own = {dot}(As[cur][kk][t - {tile.bn}], {ONES}, own);\n}}")
    return "\n".join(parts)


def _int_epilogue(tile: Tile, e: IntEpilogue) -> str:
    """Correct the thread's ``tm x tn`` sums for the zero points and store them."""
    columns = []
    for j in range(tile.tn):
        columns.append(f"const long long n_{j} = n0 + tx + {tile.threads_n * j};")
        if e.column_setup is not None:
            columns.append(e.column_setup(j))
        if e.b_zero is not None:
            columns.append(f"const int zb_{j} = n_{j} < N ? {e.b_zero(f'n_{j}')} : 0;")
        if e.a_zero is not None:
            columns.append(f"const int cs_{j} = sums[tx + {tile.threads_n * j}];")
        columns.append(f"const long long col_{j} = {e.out.col(j)};")
    row = [f"const long long row_y = {e.out.base} + {e.out.row('m')};"]
    if e.row_setup is not None:
        row.append(e.row_setup("m"))
    if e.a_zero is not None:
        row.append(f"const int za = {e.a_zero('m')};")
    if e.b_zero is not None:
        row.append(f"const int rs = sums[{tile.bn} + ty + {tile.threads_m} * i];")
    stores = []
    for j in range(tile.tn):
        exact = [f"(unsigned)acc[i][{j}]"]
        if e.b_zero is not None:
            exact.append(f"- (unsigned)zb_{j} * (unsigned)rs")
        if e.a_zero is not None:
            exact.append(f"- (unsigned)za * (unsigned)cs_{j}")
        if e.a_zero is not None and e.b_zero is not None:
            exact.append(f"+ (unsigned)K * (unsigned)za * (unsigned)zb_{j}")
        stores.append(f"if (n_{j} < N) {{\nconst int v = (int)({' '.join(exact)});\n"
                      f"{e.out.pointer}[row_y + col_{j}] = {e.value('v', j)};\n}}")
    newline = "\n"
    return f"""{newline.join(columns)}
#pragma unroll
for (int i = 0; i < {tile.tm}; ++i) {{
const long long m = m0 + ty + {tile.threads_m} * i;
if (m < M) {{
{newline.join(row)}
{newline.join(stores)}
}}
}}"""


def int_gemm_body(ctx: CudaContext, tile: Tile, m: str, n: str, k: str, prologue: str, a: ByteOperand,
                  b: ByteOperand, epilogue: IntEpilogue) -> str:
    """The body of a tile-loop kernel computing the exact int32 ``(A - za) @ (B - zb)``
    (``k`` bytes deep) for one block of a flat grid of ``tiles_m * tiles_n * batch`` blocks
    (``tile.bk`` is in words of 4 bytes), then ``epilogue``; ``prologue`` as
    :func:`egraft.kernels.cuda.gemm.gemm_body`'s ``batch_prologue``.

    Example:
        >>> ctx = CudaContext(None, None)
        >>> a = dense_bytes(ctx, "x0", "0LL", "M", "K", "K", "1LL", "k", False)
        >>> b = dense_bytes(ctx, "x1", "0LL", "N", "K", "1LL", "N", "x", True)
        >>> out = Term("y0", "0LL", strided("N"), lambda j: f"n_{j}")
        >>> "eg_dot4_us(a[i], b[j]" in int_gemm_body(ctx, pick_tile(64, 64), "M", "N", "K", "", a, b,
        ...                                          IntEpilogue(out))
        True
    """
    prep_a, load_a, store_a = _word_loads(tile, a, "a", tile.bm)
    prep_b, load_b, store_b = _word_loads(tile, b, "b", tile.bn)
    per_a, per_b = tile.bk * tile.bm // tile.threads, tile.bk * tile.bn // tile.threads
    rows, cols = epilogue.b_zero is not None, epilogue.a_zero is not None
    dot = dot4(ctx, a.signed, b.signed)
    sums = rows or cols
    shared_sums = f"__shared__ int sums[{tile.bn + tile.bm}];\n" if sums else ""
    own = "int own = 0;  /* this thread's column sum of B or row sum of A */\n" if sums else ""
    publish = f"if (t < {tile.bn + tile.bm}) sums[t] = own;\n__syncthreads();\n" if sums else ""
    after_tile = _sums(ctx, tile, a, b, rows, cols) + "\n"  # the sums of the tiles just multiplied
    return f"""__shared__ unsigned As[2][{tile.bk}][{tile.bm + 1}];
__shared__ unsigned Bs[2][{tile.bk}][{tile.bn + 1}];
{shared_sums}{tile_coordinates(tile, m, n, k)}
{prologue}
{prep_a}
{prep_b}
unsigned ra[{per_a}], rb[{per_b}];
{zeroed_accumulators(tile, "int", "0")}
{own}const int tiles_k = (int)eg_ceildiv(eg_ceildiv(K, 4LL), {tile.bk});
{k_loop(tile, load_a, load_b, store_a, store_b, "long long", "unsigned", dot, after_tile)}
{publish}{_int_epilogue(tile, epilogue)}"""


# ---- shared pieces of the products ------------------------------------------------------------------
def _zero_point(ctx: CudaContext, slot: int, extent, index: Callable[[str], str]) -> Callable[[str], str] | None:
    """A zero point input as ``var -> C int expression``: ``None`` when absent or a constant
    0, a literal for a constant scalar, ``x[0]`` per tensor, ``x[index(var)]`` for a 1-D
    tensor of ``extent`` entries (per row of A or column of B)."""
    if not ctx.has_input(slot):
        return None
    _require(ctx, slot, BYTES, "zero point")
    value = ctx.constant(slot)
    if value is not None and not np.any(value):
        return None
    if value is not None and value.size == 1:
        literal = int(value.reshape(-1)[0])
        return lambda var: str(literal)
    pointer = _vector_param(ctx, slot, extent, "zero point")
    if pointer is None:
        return lambda var: f"(int){ctx.x(slot)}[0]"
    return lambda var: f"(int){pointer}[{index(var)}]"


def _scale(ctx: CudaContext, slot: int, extent, index: Callable[[str], str]) -> Callable[[str], str]:
    """A float32 scale input as ``var -> C float expression`` (per tensor or a 1-D tensor
    of ``extent`` entries)."""
    _require(ctx, slot, (DType.FLOAT32,), "scale")
    pointer = _vector_param(ctx, slot, extent, "scale")
    if pointer is None:
        return lambda var: f"{ctx.x(slot)}[0]"
    return lambda var: f"{pointer}[{index(var)}]"


def _vector_param(ctx: CudaContext, slot: int, extent, what: str) -> str | None:
    """Input ``slot``'s C name when it has one entry per row/column (``extent``); ``None``
    for one element; ``Unsupported`` for other shapes."""
    shape = ctx.in_shape(slot)
    if _is_scalar(shape):
        return None
    if len(shape) != 1 or extent is None or not dims_equal(shape[0], extent):
        raise Unsupported(f"{ctx.node.op} {what} of shape {list(shape)} (a scalar or one per row/column only)")
    return ctx.x(slot)


@dataclass(frozen=True)
class Requantize:
    """The output stage of a ``QLinear*`` op: ``saturate(rint(acc * (sa * sb / sy)) + yzp)``
    in float64, ``sa`` per row, ``sb`` per column (or per tensor), an int32 bias per row."""

    dtype: DType
    row_scale: Callable[[str], str]
    col_scale: Callable[[str], str]
    y_scale: str
    y_zero: str
    bias: Callable[[str], str] | None = None

    def helper(self, ctx: CudaContext) -> str:
        """The name of the requantizing ``__device__`` function of the output type."""
        lo, hi = RANGES[self.dtype]
        ctype = C_TYPES[self.dtype]
        name = f"eg_requantize_{ctype.replace(' ', '_')}"
        ctx.helper(f"""__device__ __forceinline__ {ctype} {name}(double acc, float multiplier, int zero_point) {{
    const double q = rint(acc * (double)multiplier) + (double)zero_point;
    return ({ctype})fmin(fmax(q, {lo}.0), {hi}.0);
}}""")
        return name


def _requantize(ctx: CudaContext, slots: tuple[int, int, int, int], rows, cols, row_index, col_index,
                bias_slot: int | None = None) -> Requantize:
    """The :class:`Requantize` of inputs ``(row scale, column scale, y scale, y zero point)``."""
    row_scale_slot, col_scale_slot, y_scale_slot, y_zero_slot = slots
    dtype = ctx.out_dtype(0)
    if dtype not in RANGES:
        raise Unsupported(f"{ctx.node.op} to {dtype.short} has no CUDA kernel")
    y_scale = _scale(ctx, y_scale_slot, None, str)("0")
    y_zero = "0"
    if ctx.has_input(y_zero_slot):
        _require(ctx, y_zero_slot, tuple(RANGES), "output zero point")
        if not _is_scalar(ctx.in_shape(y_zero_slot)):
            raise Unsupported(f"{ctx.node.op} with a per-axis output zero point has no CUDA kernel")
        y_zero = f"(int){ctx.x(y_zero_slot)}[0]"
    bias = None
    if bias_slot is not None and ctx.has_input(bias_slot):
        _require(ctx, bias_slot, (DType.INT32,), "bias")
        pointer = _vector_param(ctx, bias_slot, rows, "bias")
        bias = (lambda var: f"(double){ctx.x(bias_slot)}[0]") if pointer is None else \
            (lambda var: f"(double){pointer}[{row_index(var)}]")
    return Requantize(dtype, _scale(ctx, row_scale_slot, rows, row_index), _scale(ctx, col_scale_slot, cols, col_index),
                      y_scale, y_zero, bias)


def _value_stage(ctx: CudaContext, requantize: Requantize | None) -> dict:
    """The :class:`IntEpilogue` fields (row and column setup, value) of the output stage:
    the exact sum itself, or requantized."""
    if requantize is None:
        return {}
    name = requantize.helper(ctx)
    bias = " + bias_r" if requantize.bias is not None else ""

    def row_setup(m: str) -> str:
        lines = [f"const float sa = {requantize.row_scale(m)};"]
        if requantize.bias is not None:
            lines.append(f"const double bias_r = {requantize.bias(m)};")
        return "\n".join(lines)

    def column_setup(j: int) -> str:
        return f"const float sb_{j} = n_{j} < N ? {requantize.col_scale(f'n_{j}')} : 0.0f;"

    def value(v: str, j: int) -> str:
        return f"{name}((double){v}{bias}, (sa * sb_{j}) / ({requantize.y_scale}), {requantize.y_zero})"

    return {"row_setup": row_setup, "column_setup": column_setup, "value": value}


# ---- MatMulInteger, QLinearMatMul ---------------------------------------------------------------------
@dataclass(frozen=True)
class ProductSlots:
    """Input slots of an integer product: A, B, their zero points, and for ``QLinear*`` the
    scales of A, B and Y and Y's zero point."""

    a: int
    b: int
    a_zero: int
    b_zero: int
    scales: tuple[int, int, int, int] | None = None


@register_kernel("MatMulInteger")
def matmul_integer(ctx: CudaContext) -> None:
    """``(A - a_zero_point) @ (B - b_zero_point)`` as exact int32 (u8/i8 operands, zero
    points per tensor, per row of A, per column of B): one integer tile-loop launch.

    Example:
        >>> generate(matmul_integer_node, graph).launches[0].block    # doctest: +SKIP
        (256, 1, 1)
    """
    _integer_matmul(ctx, ProductSlots(0, 1, 2, 3), "eg_matmul_integer")


@register_kernel("QLinearMatMul")
def qlinear_matmul(ctx: CudaContext) -> None:
    """``requantize((a - a_zp) @ (b - b_zp))`` with ``a_scale * b_scale / y_scale``: the
    integer tile loop, requantized in its epilogue.

    Example:
        >>> generate(qlinear_matmul_node, graph).launches[0].function    # doctest: +SKIP
        'eg_qlinear_matmul'
    """
    _integer_matmul(ctx, ProductSlots(0, 3, 2, 5, (1, 4, 6, 7)), "eg_qlinear_matmul")


def _integer_matmul(ctx: CudaContext, slots: ProductSlots, name: str) -> None:
    a_dtype = _require(ctx, slots.a, BYTES, "A")
    b_dtype = _require(ctx, slots.b, BYTES, "B")
    if slots.scales is None and ctx.out_dtype(0) != DType.INT32:
        raise Unsupported(f"{ctx.node.op} to {ctx.out_dtype(0).short} has no CUDA kernel")
    a_shape, b_shape, out_shape = ctx.in_shape(slots.a), ctx.in_shape(slots.b), ctx.out_shape(0)
    a2 = (1, *a_shape) if len(a_shape) == 1 else tuple(a_shape)
    b2 = (*b_shape, 1) if len(b_shape) == 1 else tuple(b_shape)
    m, k, n = a2[-2], a2[-1], b2[-1]
    batch = tuple(out_shape[:len(out_shape) - (len(a_shape) > 1) - (len(b_shape) > 1)])
    b_batched = any(not (isinstance(d, int) and d == 1) for d in b2[:-2])
    folded = bool(batch) and not b_batched and len(a2) - 2 == len(batch) and all(
        dims_equal(x, y) for x, y in zip(a2[:-2], batch))
    rows = dim_product((*batch, m)) if folded else m
    cm = ctx.dim(m)
    row_index = (lambda var: f"({var}) % {cm}") if folded else (lambda var: var)
    col_index = str
    row_extent = m if len(a_shape) >= 2 else None
    epilogue = dict(a_zero=_zero_point(ctx, slots.a_zero, row_extent, row_index),
                    b_zero=_zero_point(ctx, slots.b_zero, n if len(b_shape) >= 2 else None, col_index))
    if slots.scales is not None:
        epilogue.update(_value_stage(ctx, _requantize(ctx, slots.scales, row_extent, n, row_index, col_index)))
    signed_a, signed_b = a_dtype == DType.INT8, b_dtype == DType.INT8
    tile = pick_tile(rows, n)
    if folded or not batch:
        a = dense_bytes(ctx, ctx.x(slots.a), "0LL", "M", "K", "K", "1LL", "k", signed_a)
        b = dense_bytes(ctx, ctx.x(slots.b), "0LL", "N", "K", "1LL", "N", "x", signed_b)
        out = Term(ctx.y(0), "0LL", strided("N"), lambda j: f"n_{j}")
        body = int_gemm_body(ctx, tile, ctx.dim(rows), ctx.dim(n), ctx.dim(k), "", a, b, IntEpilogue(out, **epilogue))
        ctx.function(name, body, grid=gemm_grid(ctx, tile, rows, n), block=tile.threads)
        return
    full = (*batch, m, n)
    a_strides = broadcast_strides(a2, full[:-2] + (m, k))
    b_strides = broadcast_strides(b2, full[:-2] + (k, n))
    prologue = batch_bases(ctx, batch, {"a_base": a_strides[:len(batch)], "b_base": b_strides[:len(batch)]})
    a = dense_bytes(ctx, ctx.x(slots.a), "a_base", "M", "K", "K", "1LL", "k", signed_a)
    b = dense_bytes(ctx, ctx.x(slots.b), "b_base", "N", "K", "1LL", "N", "x", signed_b)
    out = Term(ctx.y(0), "z * M * N", strided("N"), lambda j: f"n_{j}")
    body = int_gemm_body(ctx, tile, cm, ctx.dim(n), ctx.dim(k), prologue, a, b, IntEpilogue(out, **epilogue))
    ctx.function(name, body, grid=gemm_grid(ctx, tile, m, n, dim_product(batch)), block=tile.threads)


# ---- ConvInteger, QLinearConv -------------------------------------------------------------------------
@register_kernel("ConvInteger")
def conv_integer(ctx: CudaContext) -> None:
    """The exact int32 convolution of ``x - x_zero_point`` with ``w - w_zero_point`` (per
    output channel or per tensor): the integer implicit GEMM, or the direct depthwise kernel.

    Example:
        >>> generate(conv_integer_node, graph).launches[0].function    # doctest: +SKIP
        'eg_conv_integer'
    """
    _integer_conv(ctx, ProductSlots(0, 1, 2, 3), None, "eg_conv_integer")


@register_kernel("QLinearConv")
def qlinear_conv(ctx: CudaContext) -> None:
    """``requantize(conv(x - x_zp, w - w_zp) + B)`` with ``x_scale * w_scale / y_scale``.

    Example:
        >>> generate(qlinear_conv_node, graph).launches[0].function    # doctest: +SKIP
        'eg_qlinear_conv'
    """
    _integer_conv(ctx, ProductSlots(0, 3, 2, 5, (4, 1, 6, 7)), 8, "eg_qlinear_conv")


class _WeightsAt:
    """``ctx`` as :func:`~egraft.kernels.cuda.conv.conv_geometry` reads it (the weights at
    input 1) when the weights are input ``slot``."""

    def __init__(self, ctx: CudaContext, slot: int):
        self._ctx, self._slot = ctx, slot

    def in_shape(self, i: int) -> tuple:
        return self._ctx.in_shape(self._slot if i == 1 else i)

    def __getattr__(self, name: str):
        return getattr(self._ctx, name)


def _integer_conv(ctx: CudaContext, slots: ProductSlots, bias_slot: int | None, name: str) -> None:
    x_dtype = _require(ctx, slots.a, BYTES, "x")
    w_dtype = _require(ctx, slots.b, BYTES, "w")
    if slots.scales is None and ctx.out_dtype(0) != DType.INT32:
        raise Unsupported(f"{ctx.node.op} to {ctx.out_dtype(0).short} has no CUDA kernel")
    g = conv_geometry(_WeightsAt(ctx, slots.b))
    mg = g.group_out_channels
    x_zero = None
    if ctx.has_input(slots.a_zero):
        if not _is_scalar(ctx.in_shape(slots.a_zero)):
            raise Unsupported(f"{ctx.node.op} with a per-channel x zero point has no CUDA kernel")
        x_zero = _zero_point(ctx, slots.a_zero, None, str)
    channel = (lambda var: f"(z * {mg}LL + ({var}))") if not g.depthwise else str
    w_zero = _zero_point(ctx, slots.b_zero, g.out_channels, channel)
    requantize = None
    if slots.scales is not None:
        requantize = _requantize(ctx, slots.scales, g.out_channels, None, channel, str, bias_slot)
    signed_x, signed_w = x_dtype == DType.INT8, w_dtype == DType.INT8
    if g.depthwise:
        _depthwise(ctx, g, slots, x_zero, w_zero, requantize, signed_x, signed_w, name)
    else:
        _implicit_gemm(ctx, g, slots, x_zero, w_zero, requantize, signed_x, signed_w, name)


def _conv_prologue(ctx: CudaContext, g: ConvGeometry, x_zero: Callable[[str], str] | None) -> str:
    """The sizes the conv kernels name, and ``pad_x``, the byte the padding reads as."""
    return (f"const long long IH = {ctx.dim(g.height)}, IW = {ctx.dim(g.width)};\n"
            f"const long long OH = {ctx.dim(g.out_height)}, OW = {ctx.dim(g.out_width)}, OHW = OH * OW;\n"
            f"const long long PT = {g.pad_top}, PL = {g.pad_left};\n"
            f"const unsigned pad_x = (unsigned)({x_zero('0') if x_zero else '0'}) & 255u;")


def _tap_bytes_helper(ctx: CudaContext, g: ConvGeometry) -> str:
    """A ``__device__`` function packing taps ``k .. k + 3`` of the window at ``(ih0, iw0)``
    into a word (``pad`` in the padding, 0 past the depth)."""
    kh, kw = g.kernel
    dh, dw = g.dilations
    name = f"eg_conv_bytes_{kh}x{kw}_d{dh}x{dw}"
    ctx.helper(f"""__device__ __forceinline__ unsigned {name}(const unsigned char* __restrict__ xp, long long k,
        long long ih0, long long iw0, long long ih_n, long long iw_n, long long depth, unsigned pad) {{
    unsigned w = 0u;
#pragma unroll
    for (int i = 0; i < 4; ++i) {{
        const int kk = (int)k + i;
        if (kk < depth) {{
            const int c = kk / {g.taps}, r = kk - c * {g.taps}, kh = r / {kw}, kw = r - kh * {kw};
            const long long ih = ih0 + kh * {dh}, iw = iw0 + kw * {dw};
            const unsigned v = (ih < 0 || ih >= ih_n || iw < 0 || iw >= iw_n) ? pad
                : (unsigned)xp[((long long)c * ih_n + ih) * iw_n + iw];
            w |= v << (8 * i);
        }}
    }}
    return w;
}}""")
    return name


def _image_bytes(ctx: CudaContext, g: ConvGeometry, slot: int, signed: bool) -> ByteOperand:
    """The virtual im2col matrix ``X'[(c, kh, kw), (img, oh, ow)]`` of group ``z``, in bytes."""
    x = ctx.x(slot)
    sh, sw = g.strides

    def prepare(s: str, n: str) -> str:
        lines = [f"const bool ok_{s} = ({n}) < N;",
                 f"const long long n_{s} = ok_{s} ? ({n}) : 0LL;",
                 f"const long long img_{s} = n_{s} / OHW, p_{s} = n_{s} % OHW;",
                 f"const unsigned char* xp_{s} = reinterpret_cast<const unsigned char*>({x}) + "
                 f"(img_{s} * {g.channels} + z * {g.group_channels}) * IH * IW;"]
        if not g.pointwise:
            lines.append(f"const long long ih_{s} = p_{s} / OW * {sh} - PT, iw_{s} = p_{s} % OW * {sw} - PL;")
        return "\n".join(lines)

    if g.pointwise:
        ctx.helper(_BYTES_STRIDED)

        def word(s: str, w: str) -> str:
            return f"(ok_{s} ? eg_bytes_strided(xp_{s} + p_{s}, 4LL * ({w}), K, OHW) : 0u)"
    else:
        tap = _tap_bytes_helper(ctx, g)

        def word(s: str, w: str) -> str:
            return f"(ok_{s} ? {tap}(xp_{s}, 4LL * ({w}), ih_{s}, iw_{s}, IH, IW, K, pad_x) : 0u)"

    return ByteOperand("x", prepare, word, signed)


def _column_pixel(j: int, step: int) -> str:
    """Declare ``img_<j>`` and ``pix_<j>`` of the thread's output column ``j``."""
    if j == 0:
        return "long long img_0 = n_0 / OHW, pix_0 = n_0 - img_0 * OHW;"
    return (f"long long img_{j} = img_{j - 1}, pix_{j} = pix_{j - 1} + {step};\n"
            f"while (pix_{j} >= OHW) {{ pix_{j} -= OHW; ++img_{j}; }}")


def _implicit_gemm(ctx: CudaContext, g: ConvGeometry, slots: ProductSlots, x_zero, w_zero,
                   requantize: Requantize | None, signed_x: bool, signed_w: bool, name: str) -> None:
    """``Y[oc, (img, oh, ow)] = (W - zw)[oc, (c, kh, kw)] @ (X' - zx)`` per group ``z``:
    the weights are A (zero point per row), the image B (zero point per tensor)."""
    mg, depth = g.group_out_channels, g.group_channels * g.taps
    pixels = dim_product((g.batch, g.out_height, g.out_width))
    tile = pick_tile(mg, pixels)
    weights = dense_bytes(ctx, ctx.x(slots.b), f"z * {mg * depth}LL", "M", "K", "K", "1LL", "k", signed_w)
    image = _image_bytes(ctx, g, slots.a, signed_x)
    out = Term(ctx.y(0), f"z * {mg}LL * OHW", strided("OHW"), lambda j: f"img_{j} * {g.out_channels}LL * OHW + pix_{j}")
    stage = _value_stage(ctx, requantize)
    pixel_setup = stage.get("column_setup")

    def column_setup(j: int) -> str:
        pixel = _column_pixel(j, tile.threads_n)
        return pixel if pixel_setup is None else pixel + "\n" + pixel_setup(j)

    stage["column_setup"] = column_setup
    epilogue = IntEpilogue(out, a_zero=w_zero, b_zero=x_zero, **stage)
    body = int_gemm_body(ctx, tile, f"{mg}LL", ctx.dim(pixels), f"{depth}LL", _conv_prologue(ctx, g, x_zero),
                         weights, image, epilogue)
    ctx.function(name, body, grid=gemm_grid(ctx, tile, mg, pixels, g.group), block=tile.threads)


def _depthwise(ctx: CudaContext, g: ConvGeometry, slots: ProductSlots, x_zero, w_zero,
               requantize: Requantize | None, signed_x: bool, signed_w: bool, name: str) -> None:
    """One thread per output element: its taps (valid ones only), unrolled, in int32."""
    kh, kw = g.kernel
    sh, sw = g.strides
    dh, dw = g.dilations
    multiplier = g.out_channels // g.group
    total = dim_product((g.batch, g.out_channels, g.out_height, g.out_width))
    x_type, w_type = ("signed char" if s else "unsigned char" for s in (signed_x, signed_w))
    value = "acc"
    if requantize is not None:
        bias = f" + {requantize.bias('oc')}" if requantize.bias is not None else ""
        value = (f"{requantize.helper(ctx)}((double)acc{bias}, ({requantize.col_scale('0')} * "
                 f"{requantize.row_scale('oc')}) / ({requantize.y_scale}), {requantize.y_zero})")
    body = f"""const long long index = (long long)blockIdx.x * {THREADS} + threadIdx.x;
{_conv_prologue(ctx, g, x_zero)}
const long long total = {ctx.dim(total)};
if (index < total) {{
const long long ow = index % OW, rest = index / OW, oh = rest % OH, rest2 = rest / OH;
const long long oc = rest2 % {g.out_channels}, img = rest2 / {g.out_channels};
const {x_type}* xp = {ctx.x(slots.a)} + (img * {g.channels} + oc / {multiplier}) * IH * IW;
const {w_type}* wp = {ctx.x(slots.b)} + oc * {g.taps};
const int zx = {x_zero('0') if x_zero else '0'}, zw = {w_zero('oc') if w_zero else '0'};
const long long ih0 = oh * {sh} - PT, iw0 = ow * {sw} - PL;
int acc = 0;
#pragma unroll
for (int kh = 0; kh < {kh}; ++kh) {{
const long long ih = ih0 + kh * {dh};
if (ih >= 0 && ih < IH) {{
#pragma unroll
for (int kw = 0; kw < {kw}; ++kw) {{
const long long iw = iw0 + kw * {dw};
if (iw >= 0 && iw < IW) acc += ((int)xp[ih * IW + iw] - zx) * ((int)wp[kh * {kw} + kw] - zw);
}}
}}
}}
{ctx.y(0)}[index] = {value};
}}"""
    ctx.function(f"{name}_depthwise", body, grid=ctx.blocks_for(total, THREADS), block=THREADS)


__all__ = ["ByteOperand", "IntEpilogue", "Requantize", "ProductSlots", "dense_bytes", "dot4", "int_gemm_body",
           "saturate_code", "quantize_linear", "dequantize_linear", "dynamic_quantize_linear", "matmul_integer",
           "qlinear_matmul", "conv_integer", "qlinear_conv", "RANGES"]

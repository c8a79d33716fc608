"""CUDA kernels of the matrix products: ``Gemm``, ``MatMul`` and egraft's ``FusedGemm`` and
``FusedMatMul`` (float32), all from one tile loop, :func:`gemm_body`, that the
convolutions (:mod:`egraft.kernels.cuda.conv`) reuse with another operand loader.

The tile loop: a block of 256 threads computes a ``BM x BN`` tile of ``Y = A @ B``
(64x64, or 32x128 / 128x32 when one side is small), each thread a ``TM x TN`` register
block (4x4, 2x8, 8x2) whose rows and columns are strided by 16 so that a warp reads
shared memory without bank conflicts and writes 16 consecutive floats of a row. K is
walked in steps of 16: the next step's ``A`` and ``B`` tiles are read from global memory
into registers while the current one (double-buffered in shared memory, rows padded by
one float) is multiplied, so each step costs one ``__syncthreads``. The readers are
:class:`Operand`\\ s: how to read element ``(k, x)`` of an operand (``x`` its row of ``A``
or column of ``B``) and which index is contiguous in memory, which decides the thread
mapping of the global reads (always coalesced). The epilogue scales, adds the
broadcast addends (Gemm's ``C``, a bias, the residual ``Z``), applies the activation
and stores, one column stride per thread so that stores coalesce.

A whole problem is one launch: a flat grid of ``tiles_m * tiles_n * batch`` blocks. A
MatMul whose ``B`` has no batch dims folds ``A``'s batch dims into M (``[batch, seq, K]
@ [K, N]`` is one ``batch*seq x N`` product); otherwise each block finds its batch
offsets of A, B and the addends from its batch index (broadcast dims have stride 0).

Example:
    >>> kernel = generate(graph.nodes[0], graph)       # doctest: +SKIP
    >>> kernel.launches[0].block                        # doctest: +SKIP
    (256, 1, 1)
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import sympy

from egraft.ir.dims import dim_product, dims_equal
from egraft.ir.dtypes import DType
from egraft.kernels.cuda import register_kernel
from egraft.kernels.cuda.emit import CudaContext, Unsupported, activation_code

FUSED_DOMAIN = "com.egraft"


# ---- tiles ------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Tile:
    """A block's share of the product: ``bm x bn`` outputs, ``tm x tn`` per thread, K in steps of ``bk``."""

    bm: int
    bn: int
    tm: int
    tn: int
    bk: int = 16

    @property
    def threads_m(self) -> int:
        return self.bm // self.tm

    @property
    def threads_n(self) -> int:
        return self.bn // self.tn

    @property
    def threads(self) -> int:
        return self.threads_m * self.threads_n

    @property
    def shared_bytes(self) -> int:
        """Static shared memory of the tile loop (two buffers of each operand's tile)."""
        return 2 * self.bk * (self.bm + 1 + self.bn + 1) * 4


SQUARE = Tile(64, 64, 4, 4)
#: For few rows (a convolution with few output channels, a product with a handful of rows).
WIDE = Tile(32, 128, 2, 8)
#: For few columns.
TALL = Tile(128, 32, 8, 2)


def pick_tile(m, n) -> Tile:
    """The tile for an ``m x n`` product: :data:`WIDE` or :data:`TALL` when one side is at
    most 32 (and known), else :data:`SQUARE`.

    Example:
        >>> pick_tile(16, 1000) == WIDE, pick_tile(sympy.Symbol("n"), 512) == SQUARE
        (True, True)
    """
    small_m = isinstance(m, int) and m <= 32
    small_n = isinstance(n, int) and n <= 32
    if small_m and not small_n:
        return WIDE
    if small_n and not small_m:
        return TALL
    return SQUARE


# ---- operands and epilogue terms ---------------------------------------------------------------
@dataclass(frozen=True)
class Operand:
    """How the tile loop reads one operand of the product.

    ``along`` is the index consecutive threads read: ``"x"`` (the operand's row of A / column
    of B, i.e. m or n, is contiguous in memory) or ``"k"``. ``prepare(slot, x)`` gives the
    statements run once per thread before the loop for a row ``x`` (a C expression), declaring
    variables suffixed with ``slot``; ``load(slot, k)`` the float expression of element
    ``(k, x)``, 0 outside the operand.
    """

    along: str
    prepare: Callable[[str, str], str]
    load: Callable[[str, str], str]


def dense_operand(pointer: str, base: str, rows: str, depth: str, row_stride: str, k_stride: str,
                  along: str) -> Operand:
    """A strided matrix: element ``(k, x)`` at ``pointer[base + x * row_stride + k * k_stride]``
    for ``x < rows`` and ``k < depth`` (C expressions).

    Example:
        >>> op = dense_operand("x0", "0LL", "M", "K", "K", "1LL", along="k")
        >>> op.load("a0", "k")
        '(ok_a0 && (k) < K ? p_a0[(k)] : 0.0f)'
    """
    def prepare(slot: str, x: str) -> str:
        return (f"const bool ok_{slot} = ({x}) < {rows};\n"
                f"const float* p_{slot} = {pointer} + {base} + (ok_{slot} ? ({x}) : 0LL) * {row_stride};")

    def load(slot: str, k: str) -> str:
        index = f"({k})" if k_stride == "1LL" else f"(long long)({k}) * {k_stride}"
        return f"(ok_{slot} && ({k}) < {depth} ? p_{slot}[{index}] : 0.0f)"

    return Operand(along, prepare, load)


@dataclass(frozen=True)
class Term:
    """An array the epilogue reads (an addend) or writes (the output): element ``(m, n_j)``
    at ``pointer[base + row(m) + col(j)]``, ``m`` a C expression and ``j`` the thread's
    column number (its index is the C variable ``n_<j>``, beside what the body's
    ``column_setup`` declares); an addend is multiplied by ``scale``."""

    pointer: str
    base: str
    row: Callable[[str], str]
    col: Callable[[str], str]
    scale: float = 1.0


def strided(stride: str) -> Callable[[str], str]:
    """``i -> i * stride`` (``0`` for a zero stride): a :class:`Term`'s rows.

    Example:
        >>> strided("N")("m")
        '(m) * N'
    """
    if stride == "0LL":
        return lambda i: "0LL"
    if stride == "1LL":
        return lambda i: f"({i})"
    return lambda i: f"({i}) * {stride}"


def strided_columns(stride: str) -> Callable[[int], str]:
    """``j -> n_j * stride``: a :class:`Term`'s columns.

    Example:
        >>> strided_columns("1LL")(2)
        '(n_2)'
    """
    rows = strided(stride)
    return lambda j: rows(f"n_{j}")


# ---- the tile loop -----------------------------------------------------------------------------
def _loads(tile: Tile, operand: Operand, name: str, extent: int, k0: str) -> tuple[str, str, str]:
    """(prepare, load into registers, store into shared memory) of one operand's tile."""
    per_thread = tile.bk * extent // tile.threads
    prepare, loads, stores = [], [], []
    buffer = "As" if name == "a" else "Bs"
    origin = "m0" if name == "a" else "n0"
    if operand.along == "x":  # thread t reads x = t % extent, k = t / extent + step * r
        step = tile.threads // extent
        prepare.append(operand.prepare(f"{name}0", f"{origin} + (long long)(t % {extent})"))
        for r in range(per_thread):
            k_local = f"(t / {extent} + {step * r})"
            loads.append(f"r{name}[{r}] = {operand.load(f'{name}0', f'{k0} + {k_local}')};")
            stores.append(f"{buffer}[{{buf}}][{k_local}][t % {extent}] = r{name}[{r}];")
    else:  # thread t reads k = t % bk, x = t / bk + step * r
        step = tile.threads // tile.bk
        for r in range(per_thread):
            x_local = f"(t / {tile.bk} + {step * r})"
            prepare.append(operand.prepare(f"{name}{r}", f"{origin} + (long long){x_local}"))
            loads.append(f"r{name}[{r}] = {operand.load(f'{name}{r}', f'{k0} + t % {tile.bk}')};")
            stores.append(f"{buffer}[{{buf}}][t % {tile.bk}][{x_local}] = r{name}[{r}];")
    return "\n".join(prepare), "\n".join(loads), "\n".join(stores)


def _epilogue(tile: Tile, out: Term, addends: Sequence[Term], alpha: float, activation: str,
              column_setup: Callable[[int], str] | None) -> str:
    """Scale, add the addends, activate and store the thread's ``tm x tn`` block."""
    terms = [("y", out), *((f"z{i}", a) for i, a in enumerate(addends))]
    cols = "\n".join(f"const long long col_{name}_{j} = {term.col(j)};" for j in range(tile.tn) for name, term in terms)
    columns = []
    for j in range(tile.tn):
        columns.append(f"const long long n_{j} = n0 + tx + {tile.threads_n * j};")
        if column_setup is not None:
            columns.append(column_setup(j))
    ns = "\n".join(columns)
    body = []
    for j in range(tile.tn):
        lines = [f"float v = acc[i][{j}];"]
        if alpha != 1.0:
            lines.append(f"v *= {float(alpha)!r}f;")
        for i, a in enumerate(addends):
            value = f"{a.pointer}[row_z{i} + col_z{i}_{j}]"
            lines.append(f"v += {value};" if a.scale == 1.0 else f"v += {float(a.scale)!r}f * {value};")
        if activation != "v":
            lines.append(f"v = {activation};")
        lines.append(f"{out.pointer}[row_y + col_y_{j}] = v;")
        body.append(f"if (n_{j} < N) {{\n" + "\n".join(lines) + "\n}")
    rows = "\n".join(f"const long long row_{name} = {term.base} + {term.row('m')};" for name, term in terms)
    return f"""{ns}
{cols}
#pragma unroll
for (int i = 0; i < {tile.tm}; ++i) {{
const long long m = m0 + ty + {tile.threads_m} * i;
if (m < M) {{
{rows}
{chr(10).join(body)}
}}
}}"""


def tile_coordinates(tile: Tile, m: str, n: str, k: str) -> str:
    """The statements that place a block of the flat grid: the extents ``M``, ``N``, ``K``,
    the tile's corner ``m0``, ``n0``, its batch index ``z``, and the thread's ``t``, ``tx``, ``ty``
    (shared by the float and the integer tile loops)."""
    return f"""const long long M = {m}, N = {n}, K = {k};
const long long tiles_n = eg_max(1LL, eg_ceildiv(N, {tile.bn})), tiles_m = eg_max(1LL, eg_ceildiv(M, {tile.bm}));
const long long block = (long long)blockIdx.x;
const long long m0 = (block / tiles_n) % tiles_m * {tile.bm}, n0 = block % tiles_n * {tile.bn};
const long long z = block / (tiles_n * tiles_m);
const int t = (int)threadIdx.x, tx = t % {tile.threads_n}, ty = t / {tile.threads_n};"""


def zeroed_accumulators(tile: Tile, ctype: str, zero: str) -> str:
    """The thread's ``acc[tm][tn]`` of ``ctype``, set to ``zero``."""
    return f"""{ctype} acc[{tile.tm}][{tile.tn}];
#pragma unroll
for (int i = 0; i < {tile.tm}; ++i) {{
#pragma unroll
for (int j = 0; j < {tile.tn}; ++j) acc[i][j] = {zero};
}}"""


def gemm_body(tile: Tile, m: str, n: str, k: str, batch_prologue: str, a: Operand, b: Operand,
              out: Term, addends: Sequence[Term] = (), alpha: float = 1.0, activation: str = "v",
              column_setup: Callable[[int], str] | None = None) -> str:
    """The body of a tile-loop kernel computing ``activation(alpha * A @ B + sum(addends))``
    into ``out`` for one block of a flat grid of ``tiles_m * tiles_n * batch`` blocks.

    ``m``, ``n``, ``k`` are C expressions of the product's extents; ``batch_prologue``
    statements may use the block's batch index ``z`` to declare the bases the operands and
    terms name. The activation is a C expression of the float ``v``. ``column_setup(j)``
    may declare variables of the thread's column ``j`` for the terms' ``col`` (after
    ``n_<j>``, with those of column ``j - 1`` in scope).

    Example:
        >>> a = dense_operand("x0", "0LL", "M", "K", "K", "1LL", along="k")
        >>> b = dense_operand("x1", "0LL", "N", "K", "1LL", "N", along="x")
        >>> out = Term("y0", "0LL", strided("N"), strided_columns("1LL"))
        >>> body = gemm_body(SQUARE, "64LL", "64LL", "64LL", "", a, b, out)
        >>> "__syncthreads();" in body
        True
    """
    prep_a, load_a, store_a = _loads(tile, a, "a", tile.bm, "k0")
    prep_b, load_b, store_b = _loads(tile, b, "b", tile.bn, "k0")
    per_a, per_b = tile.bk * tile.bm // tile.threads, tile.bk * tile.bn // tile.threads
    return f"""__shared__ float As[2][{tile.bk}][{tile.bm + 1}];
__shared__ float Bs[2][{tile.bk}][{tile.bn + 1}];
{tile_coordinates(tile, m, n, k)}
{batch_prologue}
{prep_a}
{prep_b}
float ra[{per_a}], rb[{per_b}];
{zeroed_accumulators(tile, "float", "0.0f")}
const int tiles_k = (int)eg_ceildiv(K, {tile.bk});
{k_loop(tile, load_a, load_b, store_a, store_b, "int", "float", "fmaf")}
{_epilogue(tile, out, addends, alpha, activation, column_setup)}"""


def k_loop(tile: Tile, load_a: str, load_b: str, store_a: str, store_b: str, k_type: str, value_type: str,
           fma: str, after_tile: str = "") -> str:
    """The K loop of a tile-loop kernel, double-buffered in shared memory: tile 0 is loaded and
    stored into buffer 0; then for each of the ``tiles_k`` tiles, the next one's loads into
    registers are issued, the current one's products are added (``acc[i][j] = fma(a[i], b[j],
    acc[i][j])`` over registers of ``value_type``), ``after_tile`` runs, and the next tile is
    stored into the other buffer. ``k0`` (a ``k_type``) is the first K index of the tile being
    loaded; ``store_a``/``store_b`` name the buffer ``{buf}``. :func:`gemm_body` and its integer
    sibling :func:`egraft.kernels.cuda.quant.int_gemm_body` share it.

    Example:
        >>> "acc[i][j] = fmaf(a[i], b[j], acc[i][j]);" in k_loop(SQUARE, "", "", "", "", "int", "float", "fmaf")
        True
    """
    cast = "" if k_type == "int" else f"({k_type})"
    return f"""{{
const {k_type} k0 = 0;
{load_a}
{load_b}
{store_a.format(buf=0)}
{store_b.format(buf=0)}
}}
__syncthreads();
for (int kt = 0; kt < tiles_k; ++kt) {{
const int cur = kt & 1;
const bool more = kt + 1 < tiles_k;
if (more) {{
const {k_type} k0 = {cast}(kt + 1) * {tile.bk};
{load_a}
{load_b}
}}
#pragma unroll
for (int kk = 0; kk < {tile.bk}; ++kk) {{
{value_type} a[{tile.tm}], b[{tile.tn}];
#pragma unroll
for (int i = 0; i < {tile.tm}; ++i) a[i] = As[cur][kk][ty + {tile.threads_m} * i];
#pragma unroll
for (int j = 0; j < {tile.tn}; ++j) b[j] = Bs[cur][kk][tx + {tile.threads_n} * j];
#pragma unroll
for (int i = 0; i < {tile.tm}; ++i) {{
#pragma unroll
for (int j = 0; j < {tile.tn}; ++j) acc[i][j] = {fma}(a[i], b[j], acc[i][j]);
}}
}}
{after_tile}if (more) {{
{store_a.format(buf="cur ^ 1")}
{store_b.format(buf="cur ^ 1")}
}}
__syncthreads();
}}"""


def gemm_grid(ctx: CudaContext, tile: Tile, m, n, batch=1):
    """The flat grid of :func:`gemm_body`: ``tiles_m * tiles_n * batch`` blocks."""
    return ctx.blocks_for(m, tile.bm) * ctx.blocks_for(n, tile.bn) * batch


# ---- shapes and broadcasting -------------------------------------------------------------------
def require_float32(ctx: CudaContext) -> None:
    """``Unsupported`` unless every present input and the output are float32."""
    dtypes = [ctx.in_dtype(i) for i in range(len(ctx.node.inputs)) if ctx.has_input(i)] + [ctx.out_dtype(0)]
    for dtype in dtypes:
        if dtype != DType.FLOAT32:
            raise Unsupported(f"{ctx.node.op} kernels are float32 only, not {dtype.short}")


def broadcast_strides(shape: Sequence, out_shape: Sequence) -> list:
    """The element stride of an array of ``shape`` along each dim of ``out_shape`` it
    broadcasts to (right-aligned; 0 along dims it lacks or has as 1).

    Example:
        >>> broadcast_strides((3, 1), (2, 3, 4))
        [0, 1, 0]
    """
    strides = [0] * len(out_shape)
    stride = 1
    for d in range(1, len(shape) + 1):
        dim = shape[-d]
        if not (isinstance(dim, int) and dim == 1):
            strides[len(out_shape) - d] = stride
        stride = stride * dim
    return strides


def batch_bases(ctx: CudaContext, batch: Sequence, strides: dict[str, Sequence]) -> str:
    """Statements declaring ``const long long <name>`` = the offset of batch index ``z``
    (decomposed over the dims ``batch``) for each ``name: per-dim strides``.

    Example:
        >>> print(batch_bases(CudaContext(None, None), (2, 3), {"a_base": [3, 1]}))
        long long zr = z;
        const long long zi1 = zr % 3LL; zr /= 3LL;
        const long long zi0 = zr;
        const long long a_base = zi0 * 3LL + zi1 * 1LL;
    """
    lines = ["long long zr = z;"]
    used = [d for d in range(len(batch)) if not (isinstance(batch[d], int) and batch[d] == 1)]
    for d in reversed(used):
        if d == used[0]:  # the outermost dim: what is left
            lines.append(f"const long long zi{d} = zr;")
        else:
            lines.append(f"const long long zi{d} = zr % {ctx.dim(batch[d])}; zr /= {ctx.dim(batch[d])};")
    for name, per_dim in strides.items():
        parts = [f"zi{d} * {ctx.dim(per_dim[d])}" for d in sorted(used) if not _is_zero(per_dim[d])]
        lines.append(f"const long long {name} = {' + '.join(parts) if parts else '0LL'};")
    return "\n".join(lines)


def _is_zero(d) -> bool:
    return isinstance(d, int) and d == 0


def _addend_input(ctx: CudaContext, i: int, out_shape: Sequence) -> list | None:
    """Input ``i``'s strides along ``out_shape`` (it must broadcast there), or ``None`` when absent."""
    if not ctx.has_input(i):
        return None
    shape = ctx.in_shape(i)
    if len(shape) > len(out_shape):
        raise Unsupported(f"input {i} of rank {len(shape)} does not broadcast to rank {len(out_shape)}")
    return broadcast_strides(shape, out_shape)


# ---- Gemm, FusedGemm ---------------------------------------------------------------------------
@register_kernel("Gemm")
@register_kernel("FusedGemm", domain=FUSED_DOMAIN)
def gemm_kernel(ctx: CudaContext) -> None:
    """``act(alpha * A' @ B' + beta * C + Z)``: one tile-loop launch.

    Example:
        >>> generate(gemm_node, graph).launches[0].function     # doctest: +SKIP
        'eg_gemm'
    """
    require_float32(ctx)
    a_shape, b_shape = ctx.in_shape(0), ctx.in_shape(1)
    if len(a_shape) != 2 or len(b_shape) != 2:
        raise Unsupported("Gemm needs 2-D A and B")
    trans_a, trans_b = bool(ctx.attr("transA", 0)), bool(ctx.attr("transB", 0))
    m, k = (a_shape[1], a_shape[0]) if trans_a else a_shape
    n = b_shape[0] if trans_b else b_shape[1]
    plain = ctx.node.domain in ("", "ai.onnx") and float(ctx.attr("alpha", 1.0)) == 1.0 and (
        not ctx.has_input(2) or float(ctx.attr("beta", 1.0)) == 0.0)
    if plain and _to_library(ctx, (a_shape, b_shape), (trans_a, trans_b)):
        return
    cm, cn, ck = ctx.dim(m), ctx.dim(n), ctx.dim(k)
    a = dense_operand(ctx.x(0), "0LL", "M", "K", "1LL" if trans_a else "K", "M" if trans_a else "1LL",
                      along="x" if trans_a else "k")
    b = dense_operand(ctx.x(1), "0LL", "N", "K", "K" if trans_b else "1LL", "1LL" if trans_b else "N",
                      along="k" if trans_b else "x")
    addends = []
    beta = float(ctx.attr("beta", 1.0))
    for i, scale in ((2, beta), (3, 1.0)):
        strides = _addend_input(ctx, i, (m, n))
        if strides is not None and scale != 0.0:
            addends.append(Term(ctx.x(i), "0LL", strided(ctx.dim(strides[0])), strided_columns(ctx.dim(strides[1])),
                                scale))
    activation = activation_code(ctx.attr("activation", ""), ctx.attr("activation_params", []), "v")
    if not trans_a and isinstance(m, int) and m <= GEMV_ROWS and not (isinstance(n, int) and n < 128):
        return _gemv(ctx, m, cn, ck, trans_b, addends, float(ctx.attr("alpha", 1.0)), activation)
    out = Term(ctx.y(0), "0LL", strided("N"), strided_columns("1LL"))
    tile = pick_tile(m, n)
    body = gemm_body(tile, cm, cn, ck, "", a, b, out, addends, float(ctx.attr("alpha", 1.0)), activation)
    ctx.function("eg_gemm", body, grid=gemm_grid(ctx, tile, m, n), block=tile.threads)


def _to_library(ctx: CudaContext, shapes: tuple, transpose: tuple) -> bool:
    """Hand a product with nothing to fuse to cuBLAS (:mod:`egraft.kernels.cuda.library`)
    when it is large enough at the dims' cost-model values (its flops as the op registry's
    work formula counts them, the ones extraction priced); True when it did."""
    import math

    from egraft.ir.work import op_work, resolve_shape
    from egraft.kernels.cuda.emit import LibraryCall
    from egraft.kernels.cuda.library import wants_library

    node = ctx.node
    out = node.outputs[0].type
    work = op_work(node.op, node.domain, node.attrs, [None if v is None else v.type for v in node.inputs], [out],
                   {}, ctx.opset)
    if not wants_library(work.flops, math.prod(resolve_shape(out, {})[:-1])):
        return False
    ctx.y(0), ctx.x(0), ctx.x(1)  # the operands, in parameter order: out, A, B
    ctx.library = LibraryCall("matmul", (ctx.out_shape(0), *shapes), (False, *transpose))
    return True


#: A Gemm with at most this many rows (a fully connected layer at a small batch) runs as
#: matrix-vector products: the tile loop would leave most of a 32-row tile idle and, with
#: one block per 128 columns, most of the GPU's SMs too.
GEMV_ROWS = 8


def _gemv(ctx: CudaContext, m: int, cn: str, ck: str, trans_b: bool, addends: list, alpha: float,
          activation: str) -> None:
    """``act(alpha * A @ B' + addends)`` for ``m <= GEMV_ROWS`` rows of A ``[m, K]``: each
    column of B' read once, coalesced. With ``transB`` (B is ``[N, K]``, PyTorch's Linear
    weight) a warp takes a column and its lanes stride K, summed by shuffles; otherwise (B
    is ``[K, N]``) a block takes 32 columns, its 8 warps 8 slices of K, summed in shared
    memory. Every row's accumulator stays in registers."""
    a, b, y = ctx.x(0), ctx.x(1), ctx.y(0)
    rows = range(m)
    zero = "\n".join(f"float acc{r} = 0.0f;" for r in rows)
    fma = "\n".join(f"acc{r} += {a}[{r}LL * K + kk] * w;" for r in rows)

    def epilogue(indent: str) -> str:
        lines = []
        for r in rows:
            lines.append(f"{{ float v = acc{r};")
            if alpha != 1.0:
                lines.append(f"v *= {alpha!r}f;")
            for term in addends:
                index = f"{term.base} + {term.row(str(r))} + {term.col(0)}"
                value = f"{term.pointer}[{index}]"
                lines.append(f"v += {value};" if term.scale == 1.0 else f"v += {float(term.scale)!r}f * {value};")
            if activation != "v":
                lines.append(f"v = {activation};")
            lines.append(f"{y}[{r}LL * N + n_0] = v; }}")
        return "\n".join(indent + line for line in lines)

    if trans_b:
        reduce = "\n".join(f"acc{r} = eg_warp_sum(acc{r});" for r in rows)
        body = f"""const long long N = {cn}, K = {ck};
const long long column = ((long long)blockIdx.x * blockDim.x + threadIdx.x) >> 5;
const int lane = threadIdx.x & 31;
const bool active = column < N;  /* no early return: the whole warp reduces */
const long long n_0 = active ? column : 0LL;
{zero}
if (active) {{
    const float* wrow = {b} + n_0 * K;
    for (long long kk = lane; kk < K; kk += 32) {{
        const float w = wrow[kk];
{fma}
    }}
}}
{reduce}
if (active && lane == 0) {{
{epilogue("    ")}
}}"""
        ctx.function("eg_gemv", body, grid=ctx.blocks_for(_columns(ctx), 8), block=256)
        return
    shared_rows = m * 8 * 33
    stash = "\n".join(f"part[({r} * 8 + slice) * 33 + lane] = acc{r};" for r in rows)
    gather = "\n".join(f"acc{r} = 0.0f; for (int s = 0; s < 8; ++s) acc{r} += part[({r} * 8 + s) * 33 + lane];"
                        for r in rows)
    body = f"""__shared__ float part[{shared_rows}];
const long long N = {cn}, K = {ck};
const int lane = threadIdx.x & 31, slice = threadIdx.x >> 5;
const long long n_0 = (long long)blockIdx.x * 32 + lane;
{zero}
if (n_0 < N) {{
    for (long long kk = slice; kk < K; kk += 8) {{
        const float w = {b}[kk * N + n_0];
{fma}
    }}
}}
{stash}
__syncthreads();
if (slice == 0 && n_0 < N) {{
{gather}
{epilogue("    ")}
}}"""
    ctx.function("eg_gemv", body, grid=ctx.blocks_for(_columns(ctx), 32), block=256)


def _columns(ctx: CudaContext):
    """N, the output's columns (a dim)."""
    return ctx.out_shape(0)[1]


# ---- MatMul, FusedMatMul -----------------------------------------------------------------------
@register_kernel("MatMul")
@register_kernel("FusedMatMul", domain=FUSED_DOMAIN)
def matmul_kernel(ctx: CudaContext) -> None:
    """``act(A @ B + bias + Z)`` with numpy matmul semantics (batch dims broadcast, rank-1
    operands promoted and their dim dropped): one tile-loop launch.

    Example:
        >>> generate(matmul_node, graph).launches[0].block      # doctest: +SKIP
        (256, 1, 1)
    """
    require_float32(ctx)
    a_shape, b_shape, out_shape = ctx.in_shape(0), ctx.in_shape(1), ctx.out_shape(0)
    a2 = (1, *a_shape) if len(a_shape) == 1 else tuple(a_shape)
    b2 = (*b_shape, 1) if len(b_shape) == 1 else tuple(b_shape)
    m, k, n = a2[-2], a2[-1], b2[-1]
    batch = tuple(out_shape[:len(out_shape) - (len(a_shape) > 1) - (len(b_shape) > 1)])
    full = (*batch, m, n)
    if ctx.node.op == "MatMul" and len(a_shape) >= 2 and len(b_shape) >= 2 and _to_library(
            ctx, (a_shape, b_shape), (False, False)):
        return
    addends = []
    for i in (2, 3):
        strides = _addend_input(ctx, i, out_shape)
        if strides is not None:  # strides along (*batch, m, n), 0 along a dropped rank-1 dim
            if len(a_shape) == 1:
                strides.insert(len(batch), 0)
            if len(b_shape) == 1:
                strides.append(0)
            addends.append((ctx.x(i), strides))
    activation = activation_code(ctx.attr("activation", ""), ctx.attr("activation_params", []), "v")
    b_batched = any(not (isinstance(d, int) and d == 1) for d in b2[:-2])
    foldable = batch and not b_batched and len(a2) - 2 == len(batch) and all(
        dims_equal(x, y) for x, y in zip(a2[:-2], batch))
    if foldable:
        _folded_matmul(ctx, batch, m, n, k, addends, activation)
    else:
        _batched_matmul(ctx, a2, b2, batch, full, addends, activation)


def _folded_matmul(ctx: CudaContext, batch: tuple, m, n, k, addends: list, activation: str) -> None:
    """``[*batch, m, k] @ [k, n]`` as one ``(prod(batch) * m) x n`` product."""
    rows = dim_product((*batch, m))
    cn, ck = ctx.dim(n), ctx.dim(k)
    a = dense_operand(ctx.x(0), "0LL", "M", "K", "K", "1LL", along="k")
    b = dense_operand(ctx.x(1), "0LL", "N", "K", "1LL", "N", along="x")
    terms = [Term(pointer, "0LL", _folded_rows(ctx, batch, m, strides), strided_columns(ctx.dim(strides[-1])))
             for pointer, strides in addends]
    tile = pick_tile(rows, n)
    body = gemm_body(tile, ctx.dim(rows), cn, ck, "", a, b, Term(ctx.y(0), "0LL", strided("N"), strided_columns("1LL")),
                     terms, activation=activation)
    ctx.function("eg_matmul", body, grid=gemm_grid(ctx, tile, rows, n), block=tile.threads)


def _folded_rows(ctx: CudaContext, batch: tuple, m, strides: list) -> Callable[[str], str]:
    """The row offset of an addend (``strides`` along ``(*batch, m, n)``) at folded row ``r``."""
    row_strides = strides[:-1]
    dims = (*batch, m)
    if not _is_zero(row_strides[-1]) and all(
            sympy.expand(sympy.sympify(row_strides[d]) - row_strides[-1] * dim_product(dims[d + 1:])) == 0
            for d in range(len(batch))):
        return strided(ctx.dim(row_strides[-1]))  # the addend has every row: r * stride

    def row(r: str) -> str:
        parts = []
        for d, stride in enumerate(row_strides):
            if _is_zero(stride):
                continue
            inner = dim_product(dims[d + 1:])
            index = f"({r})" if inner == 1 else f"({r}) / {ctx.dim(inner)}"
            if d > 0:
                index = f"({index} % {ctx.dim(dims[d])})"
            parts.append(f"{index} * {ctx.dim(stride)}")
        return " + ".join(parts) if parts else "0LL"
    return row


def _batched_matmul(ctx: CudaContext, a2: tuple, b2: tuple, batch: tuple, full: tuple, addends: list,
                    activation: str) -> None:
    """A batch of products, one block per tile and batch index (broadcast operands re-read)."""
    m, k, n = a2[-2], a2[-1], b2[-1]
    a_strides = broadcast_strides(a2, full[:-2] + (m, k))
    b_strides = broadcast_strides(b2, full[:-2] + (k, n))
    nb = len(batch)
    bases = {"a_base": a_strides[:nb], "b_base": b_strides[:nb],
             **{f"z{i}_base": s[:nb] for i, (_, s) in enumerate(addends)}}
    prologue = batch_bases(ctx, batch, bases)
    a = dense_operand(ctx.x(0), "a_base", "M", "K", "K", "1LL", along="k")
    b = dense_operand(ctx.x(1), "b_base", "N", "K", "1LL", "N", along="x")
    terms = [Term(pointer, f"z{i}_base", strided(ctx.dim(s[-2])), strided_columns(ctx.dim(s[-1])))
             for i, (pointer, s) in enumerate(addends)]
    out = Term(ctx.y(0), "z * M * N", strided("N"), strided_columns("1LL"))
    tile = pick_tile(m, n)
    body = gemm_body(tile, ctx.dim(m), ctx.dim(n), ctx.dim(k), prologue, a, b, out, terms, activation=activation)
    ctx.function("eg_matmul", body, grid=gemm_grid(ctx, tile, m, n, dim_product(batch)), block=tile.threads)


__all__ = ["Tile", "SQUARE", "WIDE", "TALL", "pick_tile", "Operand", "dense_operand", "Term", "strided",
           "strided_columns", "gemm_body", "k_loop", "gemm_grid", "require_float32", "broadcast_strides", "batch_bases",
           "gemm_kernel", "matmul_kernel"]

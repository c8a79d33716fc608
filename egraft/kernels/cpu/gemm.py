"""Dense linear-algebra kernels: MatMul (numpy semantics: 1-D operands, batched and
broadcast batch dims), Gemm, egraft's FusedGemm and FusedMatMul (bias, residual addend
and activation), and egraft's Attention.

Every product goes through :func:`emit_gemm`, ``out[i, j] = sum_k a[i, k] * b[k, j]``
over strided operands. fp32 products of more than a few rows and columns call
``egraft_sgemm`` (:mod:`egraft.kernels.cpu.sgemm`: packed panels, a register-blocked
micro-kernel, the epilogue applied in registers, split over threads); the others
(float64, matrix-vector products, tiny shapes) run one of two loop orders:

- **axpy** (``b`` contiguous along ``j``): blocked over ``j`` (:data:`BLOCK_N` columns)
  and ``k`` (:data:`BLOCK_K`) so the block of ``b`` stays in L2; inside, two rows of the
  output are updated with four ``k`` at a time, the innermost loop over contiguous
  output columns, which LLVM vectorizes (``contract`` lets it fuse multiply-adds);
- **dot** (``a`` and ``b`` contiguous along ``k``, as ``Gemm(transB=1)`` or a
  matrix-vector product): each output is a dot product over ``k``, four columns at a
  time sharing the loads of ``a``, reduced with reassociating adds (vectorized).

The epilogue (``alpha``, the addends ``beta * C``, bias, ``Z``, the activation) is one
pass over the output after the product, reading the addends with their broadcast strides.

Example: ``MatMul(x: f32[batch, 128, 768], W: f32[768, 3072])`` reads ``W`` with batch
stride 0 and ``x`` contiguously, so the batch is folded into the rows: one
``(batch*128) x 768 @ 768 x 3072`` product whose ``W`` blocks are reused by every row.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from typing import Any

import sympy
from llvmlite import ir

from egraft.ir.dims import dims_equal
from egraft.kernels.cpu import register_kernel
from egraft.kernels.cpu.elementwise import broadcast_strides, collapse
from egraft.kernels.cpu.emit import F32, I8P, I64, KernelContext, Unsupported, imin, is_float, llvm_type, splat
from egraft.kernels.cpu.llvm import host_vector_bits
from egraft.kernels.cpu.sgemm import BIAS_PER_COLUMN, BIAS_PER_ROW, Epilogue, blocking, emit_call

#: Output columns per cache block of the axpy form (a block of ``b`` is BLOCK_K x BLOCK_N).
BLOCK_N = 128
#: Depth of a cache block of the axpy form.
BLOCK_K = 256
#: Output rows updated together by the axpy form (each load of ``b`` serves them all).
ROWS_PER_STEP = 4
#: ``k`` steps per update of the axpy form (one load and store of the output serves them).
DEPTH_PER_STEP = 4
#: Output columns computed together by the dot form (each load of ``a`` serves them all).
COLS_PER_STEP = 4
#: Rows of ``b`` (output columns) per cache block of the dot form.
DOT_BLOCK_N = 64

#: ``a * b + c`` may become a fused multiply-add.
CONTRACT = ("contract",)
#: Sums may also be reassociated (vectorized reductions).
REASSOC = ("reassoc", "contract")

Dim = Any  # an int or a sympy expression over the symbolic dims


def dim_is(d: Dim, value: int) -> bool:
    """True when dim ``d`` is statically ``value``."""
    return sympy.sympify(d) == value


@dataclass(frozen=True)
class Matrix:
    """A strided matrix operand: element ``(r, c)`` of the matrix starting at element
    ``offset`` is ``ptr[offset + r * row_stride + c * col_stride]``.

    Example: ``A: f32[K, M]`` read as ``A'`` (``transA=1``) is ``Matrix(p, 1, M)``.
    """

    ptr: ir.Value
    row_stride: Dim
    col_stride: Dim


@dataclass(frozen=True)
class Addend:
    """A term added in the epilogue: node input ``index`` times ``scale``."""

    index: int
    scale: float = 1.0


# ---- helpers ------------------------------------------------------------------------------------
def float_type_of(ctx: KernelContext, inputs: Sequence[int] | None = None) -> ir.Type:
    """The LLVM float type of output 0, checking that the given inputs among ``inputs``
    (default: all) have its dtype.

    Raises :class:`Unsupported` for integer dtypes and mixed dtypes.

    Example: ``float_type_of(ctx, [0])`` for a ReduceSum whose input 1 is its int64 axes.
    """
    dtype = ctx.out_type(0).dtype
    t = llvm_type(dtype)
    if not is_float(t):
        raise Unsupported(f"{ctx.node.op} on {dtype.short} has no generated code")
    for i in range(len(ctx.node.inputs)) if inputs is None else inputs:
        if ctx.has_input(i) and ctx.in_type(i).dtype != dtype:
            raise Unsupported(f"{ctx.node.op} with mixed dtypes has no generated code")
    return t


def _cdiv(ctx: KernelContext, n: ir.Value, block: int) -> ir.Value:
    """``ceil(n / block)`` as an i64."""
    b = ctx.builder
    return b.sdiv(b.add(n, ir.Constant(I64, block - 1)), ir.Constant(I64, block))


def offset_of(ctx: KernelContext, base: ir.Value, *terms: tuple[ir.Value, Dim]) -> ir.Value:
    """``base + sum(i * stride)``, skipping terms whose stride is statically 0."""
    b = ctx.builder
    out = base
    for i, stride in terms:
        if dim_is(stride, 0):
            continue
        out = b.add(out, i if dim_is(stride, 1) else b.mul(i, ctx.dim(stride)))
    return out


def load_at(ctx: KernelContext, ptr: ir.Value, index: ir.Value) -> ir.Value:
    return ctx.builder.load(ctx.builder.gep(ptr, [index]))


def store_at(ctx: KernelContext, value: ir.Value, ptr: ir.Value, index: ir.Value) -> None:
    ctx.builder.store(value, ctx.builder.gep(ptr, [index]))


def _fma(ctx: KernelContext, a: ir.Value, b: ir.Value, c: ir.Value, flags: Sequence[str] = CONTRACT) -> ir.Value:
    """``a * b + c`` (a fused multiply-add where the target has one)."""
    return ctx.builder.fadd(ctx.builder.fmul(a, b, flags=CONTRACT), c, flags=flags)


@contextmanager
def strided_loops(ctx: KernelContext, sizes: Sequence[Dim], strides: Sequence[Sequence[Dim]],
                  starts: Sequence[ir.Value] | None = None) -> Iterator[list[ir.Value]]:
    """A loop nest over ``sizes`` (outermost first): yields each operand's element offset,
    ``starts[operand] + sum(index[d] * strides[operand][d])``; axes of size 1 get no loop.

    Example (a batch of two operands, the second broadcast over the first axis)::

        with strided_loops(ctx, [2, 3], [[3 * 64, 64], [0, 16]]) as (a_off, b_off):
            ...
    """
    offsets = list(starts) if starts is not None else [ir.Constant(I64, 0) for _ in strides]
    with ExitStack() as stack:
        for level, size in enumerate(sizes):
            if dim_is(size, 1):
                continue
            i = stack.enter_context(ctx.loop(ctx.dim(size), name=f"n{level}"))
            offsets = [offset_of(ctx, off, (i, st[level])) for off, st in zip(offsets, strides)]
        yield offsets


def heap_buffer(ctx: KernelContext, element: ir.Type, count: ir.Value) -> ir.Value:
    """``malloc(count * sizeof(element))`` as a typed pointer (free it with :func:`heap_free`).

    Kernels get no scratch space from the arena; this is for a row of scratch per call.
    """
    module = ctx.builder.module
    malloc = module.globals.get("malloc") or ir.Function(module, ir.FunctionType(I8P, [I64]), "malloc")
    size = ctx.builder.mul(count, ir.Constant(I64, 8 if element == ir.DoubleType() else 4))
    raw = ctx.builder.call(malloc, [size])
    return ctx.builder.bitcast(raw, element.as_pointer())


def heap_free(ctx: KernelContext, ptr: ir.Value) -> None:
    """``free(ptr)`` of a :func:`heap_buffer`."""
    module = ctx.builder.module
    free = module.globals.get("free") or ir.Function(module, ir.FunctionType(ir.VoidType(), [I8P]), "free")
    ctx.builder.call(free, [ctx.builder.bitcast(ptr, I8P)])


# ---- the product ----------------------------------------------------------------------------------
def uses_library(out: ir.Value, m: Dim, n: Dim, k: Dim) -> bool:
    """Whether a product of these dims goes to ``egraft_sgemm``: fp32, and enough rows and
    columns that packing pays (symbolic dims are assumed large)."""
    def at_least(d: Dim, floor: int) -> bool:
        d = sympy.sympify(d)
        return not d.is_Integer or int(d) >= floor

    return out.type.pointee == F32 and at_least(m, 4) and at_least(n, 8) and at_least(k, 1)


def emit_gemm(ctx: KernelContext, a: Matrix, a_offset: ir.Value, b: Matrix, b_offset: ir.Value,
              out: ir.Value, out_offset: ir.Value, m: Dim, n: Dim, k: Dim,
              epilogue: Epilogue | None = None, parallel: bool = False,
              b_weights: tuple[int, bool] | None = None) -> bool:
    """``out[out_offset + i * n + j] = sum_k a[i, k] * b[k, j]`` for ``i < m``, ``j < n``
    (the output block is contiguous, row-major).

    Args:
        a, b: the operands with their strides; ``a_offset`` / ``b_offset``: where their
            matrices start (i64 element offsets).
        out: the output's element pointer; ``out_offset``: where the block starts.
        m, n, k: the dims (ints or sympy expressions).
        epilogue: applied by the library to the finished tiles (its pointers address this
            block's bias and residual).
        parallel: the library call computes only the kernel's share (see
            :func:`egraft.kernels.cpu.sgemm.emit_call`).
        b_weights: ``(input index, transposed)`` when ``b`` is that constant input read
            whole (a weight ``[K, N]``, or ``[N, K]`` transposed, leading dims 1): the
            library then reads it packed at compile time (``b_packed``), not packed again
            on every call, and the kernel does not read the weight itself.

    Returns:
        True when the library computed the product (and applied ``epilogue``); False when
        loops were emitted (no epilogue: the caller applies it).

    Example: ``Gemm(transB=1)`` of ``A: f32[M, K]``, ``B: f32[N, K]``::

        emit_gemm(ctx, Matrix(pa, K, 1), zero, Matrix(pb, 1, K), zero, py, zero, M, N, K)
    """
    if uses_library(out, m, n, k):
        bld = ctx.builder
        b_fields = {"b": bld.gep(b.ptr, [b_offset]), "b_rs": b.row_stride, "b_cs": b.col_stride}
        if b_weights is not None and ctx.is_constant(b_weights[0]):
            index, transposed = b_weights
            packed, _ = ctx.packed_constant("packed_b", "sgemm.b_panels", index, transposed=transposed,
                                            nr=blocking().nr)
            b_fields = {"b": packed, "b_packed": 1}
            ctx.table_names.discard(ctx.node.inputs[index].name)  # read through its packed copy only
        emit_call(ctx, {"m": m, "n": n, "k": k, "a": bld.gep(a.ptr, [a_offset]), "a_rs": a.row_stride,
                        "a_cs": a.col_stride, **b_fields, "c": bld.gep(out, [out_offset]), "ldc": n},
                  epilogue or Epilogue(), parallel=parallel)
        return True
    dot_form = dim_is(a.col_stride, 1) and dim_is(b.row_stride, 1) and (not dim_is(b.col_stride, 1) or dim_is(n, 1))
    if dot_form:
        _gemm_dot(ctx, a, a_offset, b, b_offset, out, out_offset, m, n, k)
    else:
        _gemm_axpy(ctx, a, a_offset, b, b_offset, out, out_offset, m, n, k)
    return False


def _gemm_axpy(ctx: KernelContext, a: Matrix, a_offset: ir.Value, b: Matrix, b_offset: ir.Value,
               out: ir.Value, out_offset: ir.Value, m: Dim, n: Dim, k: Dim) -> None:
    """The blocked i-k-j order: ``out[i, j0:j1] += a[i, k] * b[k, j0:j1]``."""
    bld = ctx.builder
    t = out.type.pointee
    zero = ir.Constant(t, 0.0)
    m_, n_, k_ = ctx.dim(m), ctx.dim(n), ctx.dim(k)
    with ctx.loop(ctx.numel([m, n]), name="zero") as i:
        store_at(ctx, zero, out, bld.add(out_offset, i))

    def update(rows: list[ir.Value], ks: list[ir.Value], j0: ir.Value, j1: ir.Value) -> None:
        """out[r, j0:j1] += sum_u a[r, ks[u]] * b[ks[u], j0:j1] for each row r."""
        a_values = [[load_at(ctx, a.ptr, offset_of(ctx, a_offset, (r, a.row_stride), (kk, a.col_stride))) for kk in ks]
                    for r in rows]
        b_rows = [offset_of(ctx, b_offset, (kk, b.row_stride)) for kk in ks]
        out_rows = [bld.add(out_offset, bld.mul(r, n_)) for r in rows]
        with ctx.loop(j1, name="j", start=j0) as j:
            b_values = [load_at(ctx, b.ptr, offset_of(ctx, row, (j, b.col_stride))) for row in b_rows]
            for out_row, a_row in zip(out_rows, a_values):
                where = bld.add(out_row, j)
                acc = load_at(ctx, out, where)
                for av, bv in zip(a_row, b_values):
                    acc = _fma(ctx, av, bv, acc)
                store_at(ctx, acc, out, where)

    def depth(rows: list[ir.Value], k0: ir.Value, k1: ir.Value, j0: ir.Value, j1: ir.Value) -> None:
        """Every k of [k0, k1) for ``rows``: DEPTH_PER_STEP at a time, then the rest one by one."""
        steps = bld.sdiv(bld.sub(k1, k0), ir.Constant(I64, DEPTH_PER_STEP))
        with ctx.loop(steps, name="kk") as kk:
            base = bld.add(k0, bld.mul(kk, ir.Constant(I64, DEPTH_PER_STEP)))
            update(rows, [bld.add(base, ir.Constant(I64, u)) for u in range(DEPTH_PER_STEP)], j0, j1)
        tail = bld.add(k0, bld.mul(steps, ir.Constant(I64, DEPTH_PER_STEP)))
        with ctx.loop(k1, name="kt", start=tail) as kt:
            update(rows, [kt], j0, j1)

    with ctx.loop(_cdiv(ctx, n_, BLOCK_N), name="jb") as jb:
        j0 = bld.mul(jb, ir.Constant(I64, BLOCK_N))
        j1 = imin(ctx.builder, bld.add(j0, ir.Constant(I64, BLOCK_N)), n_)
        with ctx.loop(_cdiv(ctx, k_, BLOCK_K), name="kb") as kb:
            k0 = bld.mul(kb, ir.Constant(I64, BLOCK_K))
            k1 = imin(ctx.builder, bld.add(k0, ir.Constant(I64, BLOCK_K)), k_)
            row_steps = bld.sdiv(m_, ir.Constant(I64, ROWS_PER_STEP))
            with ctx.loop(row_steps, name="ib") as ib:
                first = bld.mul(ib, ir.Constant(I64, ROWS_PER_STEP))
                depth([bld.add(first, ir.Constant(I64, r)) for r in range(ROWS_PER_STEP)], k0, k1, j0, j1)
            with ctx.loop(m_, name="it", start=bld.mul(row_steps, ir.Constant(I64, ROWS_PER_STEP))) as it:
                depth([it], k0, k1, j0, j1)


def _gemm_dot(ctx: KernelContext, a: Matrix, a_offset: ir.Value, b: Matrix, b_offset: ir.Value,
              out: ir.Value, out_offset: ir.Value, m: Dim, n: Dim, k: Dim) -> None:
    """The i-j-k order for operands contiguous along k: ``out[i, j] = dot(a[i, :], b[:, j])``."""
    bld = ctx.builder
    t = out.type.pointee
    m_, n_, k_ = ctx.dim(m), ctx.dim(n), ctx.dim(k)

    def columns(i: ir.Value, js: list[ir.Value]) -> None:
        out_row = bld.add(out_offset, bld.mul(i, n_))
        for j, total in zip(js, _dots(ctx, t, a, offset_of(ctx, a_offset, (i, a.row_stride)), b, b_offset, js, k_)):
            store_at(ctx, total, out, bld.add(out_row, j))

    with ctx.loop(_cdiv(ctx, n_, DOT_BLOCK_N), name="jb") as jb:
        j0 = bld.mul(jb, ir.Constant(I64, DOT_BLOCK_N))
        j1 = imin(ctx.builder, bld.add(j0, ir.Constant(I64, DOT_BLOCK_N)), n_)
        with ctx.loop(m_, name="i") as i:
            steps = bld.sdiv(bld.sub(j1, j0), ir.Constant(I64, COLS_PER_STEP))
            with ctx.loop(steps, name="jj") as jj:
                base = bld.add(j0, bld.mul(jj, ir.Constant(I64, COLS_PER_STEP)))
                columns(i, [bld.add(base, ir.Constant(I64, u)) for u in range(COLS_PER_STEP)])
            tail = bld.add(j0, bld.mul(steps, ir.Constant(I64, COLS_PER_STEP)))
            with ctx.loop(j1, name="jt", start=tail) as jt:
                columns(i, [jt])


def _dots(ctx: KernelContext, t: ir.Type, a: Matrix, a_row: ir.Value, b: Matrix, b_offset: ir.Value,
          js: list[ir.Value], k_: ir.Value) -> list[ir.Value]:
    """``dot(a[row, :], b[:, j])`` for each column ``j`` of ``js``, one pass over the row of ``a``
    (starting at element ``a_row``) shared by the columns; reassociating adds (vectorized)."""
    bld = ctx.builder
    accs = [ctx.alloca(t, name="acc") for _ in js]
    for acc in accs:
        bld.store(ir.Constant(t, 0.0), acc)
    b_cols = [offset_of(ctx, b_offset, (j, b.col_stride)) for j in js]
    with ctx.loop(k_, name="k") as kk:
        av = load_at(ctx, a.ptr, offset_of(ctx, a_row, (kk, a.col_stride)))
        for acc, col in zip(accs, b_cols):
            bv = load_at(ctx, b.ptr, offset_of(ctx, col, (kk, b.row_stride)))
            bld.store(_fma(ctx, av, bv, bld.load(acc), flags=REASSOC), acc)
    return [bld.load(acc) for acc in accs]


#: Most rows of a product that runs as parallel matrix-vector products (:func:`emit_gemv`).
GEMV_ROWS = 3


def emit_gemv(ctx: KernelContext, a: Matrix, b: Matrix, m: Dim, n: Dim, k: Dim, alpha: float,
              column_addend: tuple[int, float] | None, activation: str, params: Sequence[float]) -> bool:
    """A product of at most :data:`GEMV_ROWS` rows whose operands are contiguous along ``k``
    (``Gemm(transB=1)`` of a weight ``[N, K]``: a fully connected layer at batch 1), as dot
    products whose output columns are shared over the kernel's parts, each column finished
    where it is computed: ``act(alpha * dot + scale * C[j])``. Such a product reads every
    weight once: a memory stream that one core cannot saturate (AlexNet's 4096 x 9216 layer
    streams 151 MB). False (nothing emitted) for other shapes.

    Example: ``FusedGemm(x: f32[1, 9216], W: f32[4096, 9216]) {transB = 1, activation = "relu"}``.
    """
    if not (isinstance(m, int | sympy.Integer) and 1 <= int(m) <= GEMV_ROWS):
        return False
    if not (dim_is(a.col_stride, 1) and dim_is(b.row_stride, 1)) or ctx.out_ptr(0).type.pointee != F32:
        return False
    bld = ctx.builder
    n_, k_ = ctx.dim(n), ctx.dim(k)
    out = ctx.out_ptr(0)
    addend = ctx.in_ptr(column_addend[0]) if column_addend else None
    step = ir.Constant(I64, COLS_PER_STEP)
    full = bld.sdiv(n_, step)
    lo, hi = ctx.share(full)  # whole steps of COLS_PER_STEP columns; the last part also takes the rest

    def finish(i: int, j: ir.Value, total: ir.Value) -> None:
        value = bld.fmul(total, ir.Constant(F32, alpha)) if alpha != 1.0 else total
        if addend is not None:
            c = load_at(ctx, addend, j)
            scale = column_addend[1]
            value = bld.fadd(value, bld.fmul(c, ir.Constant(F32, scale)) if scale != 1.0 else c)
        value = ctx.math.activation(activation, list(params), value) if activation else value
        store_at(ctx, value, out, bld.add(bld.mul(ir.Constant(I64, i), n_), j))

    zero = ir.Constant(I64, 0)

    def columns(js: list[ir.Value]) -> None:
        for i in range(int(m)):
            a_row = offset_of(ctx, zero, (ir.Constant(I64, i), a.row_stride))
            for j, total in zip(js, _dots(ctx, F32, a, a_row, b, zero, js, k_)):
                finish(i, j, total)

    with ctx.loop(hi, name="jj", start=lo) as jj:
        base = bld.mul(jj, step)
        columns([bld.add(base, ir.Constant(I64, u)) for u in range(COLS_PER_STEP)])
    with bld.if_then(bld.icmp_signed("==", hi, full)):
        with ctx.loop(n_, name="jt", start=bld.mul(full, step)) as jt:
            columns([jt])
    return True


# ---- the epilogue ---------------------------------------------------------------------------------
def emit_epilogue(ctx: KernelContext, alpha: float, addends: Sequence[Addend], activation: str = "",
                  params: Sequence[float] = ()) -> None:
    """``out = act(alpha * out + sum(scale * addend))`` over output 0, each addend read with
    its broadcast strides (it broadcasts *to* the output's shape). Emits nothing when
    there is nothing to do.

    Example: Gemm's ``beta * C`` with ``C: f32[N]`` is ``emit_epilogue(ctx, alpha, [Addend(2, beta)])``.
    """
    if alpha == 1.0 and not addends and activation == "":
        return
    out_shape = ctx.shape(ctx.out_type(0))
    own = broadcast_strides(out_shape, out_shape)
    sizes, strides = collapse(out_shape, [own] + [broadcast_strides(ctx.shape(ctx.in_type(x.index)), out_shape,
                                                                    ctx.broadcast_guards) for x in addends])
    bld = ctx.builder
    out = ctx.out_ptr(0)
    pointers = [out] + [ctx.in_ptr(x.index) for x in addends]
    t = out.type.pointee

    with strided_loops(ctx, sizes, strides) as here:
        y = load_at(ctx, out, here[0])
        if alpha != 1.0:
            y = bld.fmul(y, ir.Constant(t, alpha))
        for x, p, off in zip(addends, pointers[1:], here[1:]):
            v = load_at(ctx, p, off)
            y = bld.fadd(y, v if x.scale == 1.0 else bld.fmul(v, ir.Constant(t, x.scale)))
        store_at(ctx, ctx.math.activation(activation, list(params), y), out, here[0])


# ---- MatMul ---------------------------------------------------------------------------------------
def matmul_operands(ctx: KernelContext) -> tuple[list[Dim], list[list[Dim]], Matrix, Matrix, Dim, Dim, Dim]:
    """Inputs 0 and 1 of a MatMul-like node as numpy matmul reads them: the output's batch
    dims, each operand's batch strides (0 where it is broadcast), the two matrices, and
    ``m, n, k`` (a 1-D ``a`` is one row, a 1-D ``b`` one column).

    The output is contiguous ``[*batch, m, n]`` (dropping the 1-D sides changes no offset).
    """
    a_shape, b_shape = ctx.shape(ctx.in_type(0)), ctx.shape(ctx.in_type(1))
    out_shape = ctx.shape(ctx.out_type(0))
    if not a_shape or not b_shape:
        raise Unsupported("MatMul of a scalar")
    a2 = (1, *a_shape) if len(a_shape) == 1 else tuple(a_shape)
    b2 = (*b_shape, 1) if len(b_shape) == 1 else tuple(b_shape)
    m, k, n = a2[-2], a2[-1], b2[-1]
    batch = list(out_shape[: len(out_shape) - (len(a_shape) > 1) - (len(b_shape) > 1)])
    a_strides = broadcast_strides(a2, (*batch, m, k), ctx.broadcast_guards)  # batch dims may broadcast at run time
    b_strides = broadcast_strides(b2, (*batch, k, n), ctx.broadcast_guards)
    a_row, a_col = (a_strides[-2], a_strides[-1]) if not dim_is(m, 1) else (0, a_strides[-1])
    b_row, b_col = (b_strides[-2], b_strides[-1]) if not dim_is(n, 1) else (b_strides[-2], 0)
    return (batch, [a_strides[:-2], b_strides[:-2]], Matrix(ctx.in_ptr(0), a_row, a_col),
            Matrix(ctx.in_ptr(1), b_row, b_col), m, n, k)


def emit_matmul(ctx: KernelContext, epilogue: Epilogue | None = None) -> bool:
    """Output 0 = input 0 @ input 1 with numpy matmul semantics; ``epilogue`` (its pointers
    addressing the whole output) is applied by the library when the product is one call.
    Returns whether it was (else the caller applies it).

    When ``b`` is shared by every batch (batch strides 0) and ``a`` is a contiguous
    stack of matrices, the batch is folded into the rows: one larger product.
    """
    batch, (a_batch, b_batch), a, b, m, n, k = matmul_operands(ctx)
    b_shape = ctx.shape(ctx.in_type(1))
    weights = (1, False) if ctx.is_constant(1) and len(b_shape) >= 2 \
        and all(dim_is(d, 1) for d in b_shape[:-2]) else None  # one matrix, read by every batch
    out = ctx.out_ptr(0)
    zero = ir.Constant(I64, 0)
    a_shape = ctx.shape(ctx.in_type(0))
    a_stacked = len(a_shape) >= 2 and len(a_shape) - 2 == len(batch) and dim_is(a.col_stride, 1) \
        and all(sympy.expand(sympy.sympify(x) - sympy.sympify(y)) == 0 for x, y in zip(a_shape[:-2], batch))
    if batch and a_stacked and all(dim_is(s, 0) for s in b_batch):
        rows = sympy.expand(sympy.Mul(*batch, m))
        a = Matrix(a.ptr, k, a.col_stride)  # the folded rows are k apart (matmul_operands gives a one-row a stride 0)
        used = emit_gemm(ctx, a, zero, b, zero, out, zero, rows, n, k, epilogue, parallel=epilogue is not None,
                         b_weights=weights)
        return used and epilogue is not None
    if not batch:
        used = emit_gemm(ctx, a, zero, b, zero, out, zero, m, n, k, epilogue, parallel=epilogue is not None,
                         b_weights=weights)
        return used and epilogue is not None
    out_batch = broadcast_strides([*batch, m, n], [*batch, m, n])[:-2]
    plain = epilogue is not None and epilogue == Epilogue()
    with strided_loops(ctx, batch, [a_batch, b_batch, out_batch]) as (a_off, b_off, out_off):
        emit_gemm(ctx, a, a_off, b, b_off, out, out_off, m, n, k, None, parallel=plain, b_weights=weights)
    return plain


def _fused_epilogue(ctx: KernelContext, bias: int | None, residual: int | None, alpha: float = 1.0,
                    beta: float = 1.0) -> Epilogue | None:
    """The library form of ``act(alpha * product + input[bias] + beta * input[residual])``
    when it has one: the bias a row vector ``[n]`` (or ``[1, n]``) or a column ``[m, 1]``,
    the residual the output's own shape or one row broadcast over all, the activation
    relu / leaky_relu / clip or none. ``None`` otherwise."""
    activation = ctx.attr("activation", "") if ctx.node.domain == "com.egraft" else ""
    if not Epilogue.fits(activation or ""):
        return None
    out_shape = tuple(ctx.shape(ctx.out_type(0)))
    if len(out_shape) < 1:
        return None
    m = out_shape[-2] if len(out_shape) >= 2 else 1
    n = out_shape[-1]
    spec: dict = {"alpha": alpha, "beta": beta, "activation": activation or "",
                  "params": tuple(ctx.attr("activation_params", []) or ())}
    if bias is not None:
        shape = tuple(ctx.shape(ctx.in_type(bias)))
        if ctx.in_type(bias).dtype != ctx.out_type(0).dtype:
            return None
        if len(shape) >= 1 and all(dim_is(d, 1) for d in shape[:-1]) and dims_equal(shape[-1], n) \
                and not dim_is(n, 1):
            spec.update(bias=ctx.in_ptr(bias), bias_kind=BIAS_PER_COLUMN)
        elif len(shape) >= 2 and len(out_shape) == 2 and all(dim_is(d, 1) for d in shape[:-2]) \
                and dims_equal(shape[-2], m) and dim_is(shape[-1], 1):
            spec.update(bias=ctx.in_ptr(bias), bias_kind=BIAS_PER_ROW)
        else:
            return None
    if residual is not None:
        shape = tuple(ctx.shape(ctx.in_type(residual)))
        if ctx.in_type(residual).dtype != ctx.out_type(0).dtype:
            return None
        if len(shape) == len(out_shape) and all(dims_equal(x, y) for x, y in zip(shape, out_shape)):
            spec.update(res=ctx.in_ptr(residual), ldr=n)
        elif len(shape) >= 1 and all(dim_is(d, 1) for d in shape[:-1]) and dims_equal(shape[-1], n) \
                and not dim_is(n, 1):
            spec.update(res=ctx.in_ptr(residual), ldr=0)
        else:
            return None
    return Epilogue(**spec)


@register_kernel("MatMul")
def matmul(ctx: KernelContext) -> None:
    """``a @ b`` (float32/float64), numpy matmul semantics."""
    float_type_of(ctx)
    emit_matmul(ctx, Epilogue())


@register_kernel("FusedMatMul", domain="com.egraft")
def fused_matmul(ctx: KernelContext) -> None:
    """``act(a @ b + bias + Z)``, bias and Z broadcast to the result."""
    float_type_of(ctx)
    epilogue = _fused_epilogue(ctx, 2 if ctx.has_input(2) else None, 3 if ctx.has_input(3) else None)
    if not emit_matmul(ctx, epilogue):
        addends = [Addend(i) for i in (2, 3) if ctx.has_input(i)]
        emit_epilogue(ctx, 1.0, addends, ctx.attr("activation", ""), ctx.attr("activation_params", []))


# ---- Gemm -----------------------------------------------------------------------------------------
def emit_gemm_node(ctx: KernelContext) -> None:
    """``alpha * A' @ B' + beta * C`` (and, for FusedGemm, ``+ Z`` then the activation)."""
    float_type_of(ctx)
    a_shape, b_shape = ctx.shape(ctx.in_type(0)), ctx.shape(ctx.in_type(1))
    if len(a_shape) != 2 or len(b_shape) != 2:
        raise Unsupported("Gemm needs 2-D A and B")
    m, n = ctx.shape(ctx.out_type(0))
    k = a_shape[0] if ctx.attr("transA", 0) else a_shape[1]
    a = Matrix(ctx.in_ptr(0), 1, m) if ctx.attr("transA", 0) else Matrix(ctx.in_ptr(0), a_shape[1], 1)
    b = Matrix(ctx.in_ptr(1), 1, k) if ctx.attr("transB", 0) else Matrix(ctx.in_ptr(1), n, 1)
    zero = ir.Constant(I64, 0)
    alpha, beta = float(ctx.attr("alpha", 1.0)), float(ctx.attr("beta", 1.0))
    fused = ctx.node.domain == "com.egraft"
    has_c = ctx.has_input(2) and beta != 0.0
    has_z = fused and ctx.has_input(3)
    epilogue = None
    if not (has_c and has_z):
        if has_c and beta == 1.0:
            epilogue = _fused_epilogue(ctx, 2, None, alpha)
        if epilogue is None:  # C as a (scaled) residual, or Z
            epilogue = _fused_epilogue(ctx, None, 2 if has_c else (3 if has_z else None), alpha, beta if has_c else 1.0)
    activation = ctx.attr("activation", "") if fused else ""
    params = ctx.attr("activation_params", []) if fused else []
    if not has_z and not uses_library(ctx.out_ptr(0), m, n, k):  # a row or three: parallel dot products
        column = (2, beta) if has_c and _per_column(ctx.shape(ctx.in_type(2)), n) else None
        if (column is not None or not has_c) and emit_gemv(ctx, a, b, m, n, k, alpha, column, activation, params):
            return
    weights = (1, bool(ctx.attr("transB", 0))) if ctx.is_constant(1) else None
    if emit_gemm(ctx, a, zero, b, zero, ctx.out_ptr(0), zero, m, n, k, epilogue, parallel=epilogue is not None,
                 b_weights=weights) and epilogue is not None:
        return
    addends = []
    if has_c:
        addends.append(Addend(2, beta))
    if has_z:
        addends.append(Addend(3))
    emit_epilogue(ctx, alpha, addends, activation, params)


def _per_column(shape: Sequence[Dim], n: Dim) -> bool:
    """Whether an addend of ``shape`` holds one value per output column (``[N]`` or ``[1, N]``)."""
    return len(shape) in (1, 2) and all(dim_is(d, 1) for d in shape[:-1]) and dims_equal(shape[-1], n) \
        and not dim_is(n, 1)


@register_kernel("Gemm")
def gemm(ctx: KernelContext) -> None:
    """``alpha * A' @ B' + beta * C`` with ``transA``/``transB``, C broadcast to [M, N]."""
    emit_gemm_node(ctx)


@register_kernel("FusedGemm", domain="com.egraft")
def fused_gemm(ctx: KernelContext) -> None:
    """``act(alpha * A' @ B' + beta * C + Z)``."""
    emit_gemm_node(ctx)


# ---- Attention ------------------------------------------------------------------------------------
@register_kernel("Attention", domain="com.egraft")
def attention(ctx: KernelContext) -> None:
    """``Softmax(scale * Q @ Kt + mask, axis=-1) @ V``: the rows of scores live in a heap
    buffer of :data:`QUERY_ROWS` x T elements, each loop runs over a contiguous axis (T for
    the scores, Dv for the output row). With Kt's rows contiguous, D and Dv known (a
    transformer's heads), :data:`QUERY_ROWS` query rows at a time (:func:`_attention_rows`),
    so that each load of a key or of a value row serves them all; otherwise one at a time.

    Example: ``Q: f32[B, H, S, 64]``, ``Kt: f32[B, H, 64, T]``, ``V: f32[B, H, T, 64]``,
    ``mask: f32[S, T]`` (read with batch strides 0).
    """
    t = float_type_of(ctx)
    bld = ctx.builder
    q_shape, kt_shape, v_shape = (ctx.shape(ctx.in_type(i)) for i in range(3))
    out_shape = ctx.shape(ctx.out_type(0))
    if min(len(q_shape), len(kt_shape), len(v_shape)) < 2:
        raise Unsupported("Attention operands of rank < 2")
    batch = list(out_shape[:-2])
    s_len, d_len, t_len, dv_len = q_shape[-2], q_shape[-1], kt_shape[-1], v_shape[-1]
    guards = ctx.broadcast_guards  # batch dims (and the mask's) may broadcast at run time
    q = broadcast_strides(q_shape, (*batch, s_len, d_len), guards)
    kt = broadcast_strides(kt_shape, (*batch, d_len, t_len), guards)
    v = broadcast_strides(v_shape, (*batch, t_len, dv_len), guards)
    out = broadcast_strides(out_shape, out_shape)
    has_mask = ctx.has_input(3)
    mask = broadcast_strides(ctx.shape(ctx.in_type(3)), (*batch, s_len, t_len), guards) if has_mask \
        else [0] * (len(batch) + 2)
    pq, pk, pv, py = ctx.in_ptr(0), ctx.in_ptr(1), ctx.in_ptr(2), ctx.out_ptr(0)
    pm = ctx.in_ptr(3) if has_mask else None
    scale = ir.Constant(t, float(ctx.attr("scale", 1.0)))
    zero = ir.Constant(t, 0.0)
    t_ = ctx.dim(t_len)
    scores = heap_buffer(ctx, t, ctx.builder.mul(t_, ir.Constant(I64, QUERY_ROWS)))
    best, total = ctx.alloca(t, name="max"), ctx.alloca(t, name="sum")
    strides = [st[:-2] for st in (q, kt, v, mask, out)]
    rows_lo, rows_hi = ctx.share(ctx.dim(s_len))  # query rows are independent: split over threads
    # the output row in registers (vectors of the host's width, else of 8) when Dv is known and
    # V's rows are contiguous; the scores in vectors of the host's width
    lanes = max(8, host_vector_bits() // 32)
    out_lanes = lanes if isinstance(dv_len, int) and dv_len % lanes == 0 else 8
    registers = isinstance(dv_len, int) and dv_len % out_lanes == 0 and dv_len <= 16 * out_lanes \
        and dim_is(v[-1], 1) and dim_is(out[-1], 1) and t == F32
    # the scores a vector of keys at a time when Kt's rows are contiguous and D is known
    vector_scores = t == F32 and isinstance(d_len, int) and d_len <= 128 and dim_is(kt[-1], 1) \
        and (pm is None or dim_is(mask[-1], 1) or dim_is(mask[-1], 0))
    if vector_scores and registers:  # QUERY_ROWS rows at a time, then the rows left one by one
        with strided_loops(ctx, batch, strides) as (q_off, kt_off, v_off, mask_off, out_off):
            operands = (pq, q, d_len, pk, kt, pv, v, pm, mask, py, out, scale, lanes, out_lanes)
            offsets = (q_off, kt_off, v_off, mask_off, out_off)
            count = bld.sub(rows_hi, rows_lo)
            blocks = bld.sdiv(count, ir.Constant(I64, QUERY_ROWS))
            with ctx.loop(blocks, name="sb") as sb:
                first = bld.add(rows_lo, bld.mul(sb, ir.Constant(I64, QUERY_ROWS)))
                _attention_rows(ctx, t, [bld.add(first, ir.Constant(I64, r)) for r in range(QUERY_ROWS)],
                                scores, t_, operands, offsets, dv_len)
            with ctx.loop(rows_hi, name="s1", start=bld.add(rows_lo, bld.mul(blocks, ir.Constant(I64, QUERY_ROWS)))) \
                    as s:
                _attention_rows(ctx, t, [s], scores, t_, operands, offsets, dv_len)
    else:
        with strided_loops(ctx, batch, strides) as (q_off, kt_off, v_off, mask_off, out_off):
            with ctx.loop(rows_hi, name="s", start=rows_lo) as s:
                q_row = offset_of(ctx, q_off, (s, q[-2]))
                mask_row = offset_of(ctx, mask_off, (s, mask[-2]))
                if vector_scores:
                    _vector_softmax_scores(ctx, t, lanes, [scores], t_, (pq, [q_row], q[-1], d_len),
                                           (pk, kt_off, kt[-2]), (pm, [mask_row], mask[-1]), scale, [best], [total])
                else:
                    with ctx.loop(t_, name="t0") as j:
                        store_at(ctx, zero, scores, j)
                    with ctx.loop(ctx.dim(d_len), name="d") as d:
                        qv = load_at(ctx, pq, offset_of(ctx, q_row, (d, q[-1])))
                        kt_row = offset_of(ctx, kt_off, (d, kt[-2]))
                        with ctx.loop(t_, name="t1") as j:
                            acc = load_at(ctx, scores, j)
                            key = load_at(ctx, pk, offset_of(ctx, kt_row, (j, kt[-1])))
                            store_at(ctx, _fma(ctx, qv, key, acc), scores, j)
                    bld.store(ir.Constant(t, float("-inf")), best)
                    with ctx.loop(t_, name="t2") as j:
                        x = bld.fmul(load_at(ctx, scores, j), scale)
                        if pm is not None:
                            x = bld.fadd(x, load_at(ctx, pm, offset_of(ctx, mask_row, (j, mask[-1]))))
                        store_at(ctx, x, scores, j)
                        bld.store(ctx.math.maximum(bld.load(best), x), best)
                    bld.store(zero, total)
                    with ctx.loop(t_, name="t3") as j:
                        e = ctx.math.exp(bld.fsub(load_at(ctx, scores, j), bld.load(best)))
                        store_at(ctx, e, scores, j)
                        bld.store(bld.fadd(bld.load(total), e, flags=REASSOC), total)
                out_row = offset_of(ctx, out_off, (s, out[-2]))
                if registers:  # sum p_j * V[j] unnormalized in registers, then one multiply by 1 / total
                    _sum_values(ctx, t, [s], [scores], [total], t_, (pv, v, py, out, out_lanes), (v_off, out_off),
                                dv_len)
                else:
                    with ctx.loop(t_, name="t4") as j:
                        store_at(ctx, bld.fdiv(load_at(ctx, scores, j), bld.load(total)), scores, j)
                    dv_ = ctx.dim(dv_len)
                    with ctx.loop(dv_, name="v0") as c:
                        store_at(ctx, zero, py, bld.add(out_row, c))
                    with ctx.loop(t_, name="t5") as j:
                        p = load_at(ctx, scores, j)
                        v_row = offset_of(ctx, v_off, (j, v[-2]))
                        with ctx.loop(dv_, name="v1") as c:
                            where = bld.add(out_row, c)
                            acc = load_at(ctx, py, where)
                            store_at(ctx, _fma(ctx, p, load_at(ctx, pv, offset_of(ctx, v_row, (c, v[-1]))), acc), py,
                                     where)
    heap_free(ctx, scores)

#: Query rows the attention kernel computes together: each load of a key (or of a value row)
#: serves them all (one row at a time, every multiply-add loaded its own key).
QUERY_ROWS = 4


def _attention_rows(ctx: KernelContext, t: ir.Type, rows: list[ir.Value], scores: ir.Value, t_: ir.Value,
                    operands: tuple, offsets: tuple, dv_len: int) -> None:
    """Attention for the query rows ``rows`` (of one batch entry) together: their scores a
    vector of keys at a time (:func:`_vector_softmax_scores`), then ``sum_j p[r, j] * V[j]``
    with the output rows in registers, each row of V loaded once for all of them."""
    bld = ctx.builder
    pq, q, d_len, pk, kt, pv, v, pm, mask, py, out, scale, lanes, out_lanes = operands
    q_off, kt_off, v_off, mask_off, out_off = offsets
    n = len(rows)
    row_scores = [bld.gep(scores, [bld.mul(t_, ir.Constant(I64, r))]) for r in range(n)]
    bests = [ctx.alloca(t, name=f"max{r}") for r in range(n)]
    totals = [ctx.alloca(t, name=f"sum{r}") for r in range(n)]
    q_rows = [offset_of(ctx, q_off, (s, q[-2])) for s in rows]
    mask_rows = [offset_of(ctx, mask_off, (s, mask[-2])) for s in rows]
    _vector_softmax_scores(ctx, t, lanes, row_scores, t_, (pq, q_rows, q[-1], d_len), (pk, kt_off, kt[-2]),
                           (pm, mask_rows, mask[-1]), scale, bests, totals)
    _sum_values(ctx, t, rows, row_scores, totals, t_, (pv, v, py, out, out_lanes), (v_off, out_off), dv_len)


def _sum_values(ctx: KernelContext, t: ir.Type, rows: list[ir.Value], row_scores: list[ir.Value],
                totals: list[ir.Value], t_: ir.Value, operands: tuple, offsets: tuple, dv_len: int) -> None:
    """The output rows ``rows``: ``sum_j p[r, j] * V[j] / totals[r]``, the sums in registers
    (unnormalized, then one multiply by 1 / total), each row of V loaded once for all rows."""
    bld = ctx.builder
    pv, v, py, out, out_lanes = operands
    v_off, out_off = offsets
    n = len(rows)
    vt = ir.VectorType(t, out_lanes)
    width = dv_len // out_lanes
    copies = max(1, 8 // (width * n))  # keys per step, each into its own accumulators (latency)
    slots = [[[ctx.alloca(vt, name=f"out{c}_{r}_{k}") for k in range(width)] for r in range(n)] for c in range(copies)]
    for slot in (x for per_copy in slots for per_row in per_copy for x in per_row):
        bld.store(ir.Constant(vt, [0.0] * out_lanes), slot)

    def add_key(j: ir.Value, into: list) -> None:
        v_row = offset_of(ctx, v_off, (j, v[-2]))
        values = [bld.load(bld.bitcast(bld.gep(pv, [bld.add(v_row, ir.Constant(I64, k * out_lanes))]),
                                       vt.as_pointer()), align=4) for k in range(width)]
        for r in range(n):
            p = splat(bld, load_at(ctx, row_scores[r], j), out_lanes)
            for k, slot in enumerate(into[r]):
                bld.store(_fma(ctx, p, values[k], bld.load(slot)), slot)

    steps = bld.sdiv(t_, ir.Constant(I64, copies))
    with ctx.loop(steps, name="t5") as jj:
        for c in range(copies):
            add_key(bld.add(bld.mul(jj, ir.Constant(I64, copies)), ir.Constant(I64, c)), slots[c])
    with ctx.loop(t_, name="t6", start=bld.mul(steps, ir.Constant(I64, copies))) as j:
        add_key(j, slots[0])
    for r, s in enumerate(rows):
        inverse = splat(bld, bld.fdiv(ir.Constant(t, 1.0), bld.load(totals[r])), out_lanes)
        out_row = offset_of(ctx, out_off, (s, out[-2]))
        for k in range(width):
            value = bld.load(slots[0][r][k])
            for c in range(1, copies):
                value = bld.fadd(value, bld.load(slots[c][r][k]))
            at = bld.gep(py, [bld.add(out_row, ir.Constant(I64, k * out_lanes))])
            bld.store(bld.fmul(value, inverse), bld.bitcast(at, vt.as_pointer()), align=4)


def _vector_softmax_scores(ctx: KernelContext, t: ir.Type, lanes: int, scores: list[ir.Value], t_: ir.Value, q_rows,
                           kt_rows, mask_rows, scale: ir.Value, best: list[ir.Value], total: list[ir.Value]) -> None:
    """Query rows' ``exp(scale * q @ Kt + mask - max)``, row ``r`` into ``scores[r]`` (T floats),
    its max into ``best[r]`` and its sum into ``total[r]``: ``lanes`` keys at a time (the dot
    products over D accumulated in registers; each load of Kt's row d serves every query
    row, each broadcast of q[r, d] every vector of keys), the keys past the last whole vector
    one at a time. The max may skip a NaN score: the NaN reaches the sum through its own exp,
    and every output of the row is NaN as it must be."""
    bld = ctx.builder
    pq, q_ats, q_step, d_len = q_rows
    pk, kt_at, kt_row_stride = kt_rows
    pm, mask_ats, mask_step = mask_rows
    n = len(scores)
    vt = ir.VectorType(t, lanes)
    qs = [[load_at(ctx, pq, offset_of(ctx, q_at, (ir.Constant(I64, d), q_step))) for d in range(d_len)]
          for q_at in q_ats]
    vectors = bld.sdiv(t_, ir.Constant(I64, lanes))
    vbests = [ctx.alloca(vt, name=f"vmax{r}") for r in range(n)]
    for vbest in vbests:
        bld.store(ir.Constant(vt, [float("-inf")] * lanes), vbest)

    def keys(j0: ir.Value, width: int, count: int = 1) -> list[list[ir.Value]]:
        """The scaled, masked scores of ``count`` groups of ``width`` keys from ``j0`` for each
        row (vectors, or scalars when ``width`` is 1): ``n * count`` independent multiply-add
        chains over D."""
        zero_acc = ir.Constant(vt, [0.0] * lanes) if width > 1 else ir.Constant(t, 0.0)
        accs = [[zero_acc] * count for _ in range(n)]
        starts = [bld.add(j0, ir.Constant(I64, u * width)) for u in range(count)]
        for d in range(d_len):
            row = offset_of(ctx, kt_at, (ir.Constant(I64, d), kt_row_stride))
            q_d = [splat(bld, qs[r][d], lanes) if width > 1 else qs[r][d] for r in range(n)]
            for u in range(count):
                at = bld.gep(pk, [bld.add(row, starts[u])])
                key = bld.load(bld.bitcast(at, vt.as_pointer()), align=4) if width > 1 else bld.load(at)
                for r in range(n):
                    accs[r][u] = _fma(ctx, q_d[r], key, accs[r][u])
        out = []
        for r in range(n):
            per_row = []
            for u in range(count):
                x = bld.fmul(accs[r][u], splat(bld, scale, lanes) if width > 1 else scale)
                if pm is not None:
                    if dim_is(mask_step, 0):
                        m = load_at(ctx, pm, mask_ats[r])
                        m = splat(bld, m, lanes) if width > 1 else m
                    else:
                        at = bld.gep(pm, [bld.add(mask_ats[r], starts[u])])
                        m = bld.load(bld.bitcast(at, vt.as_pointer()), align=4) if width > 1 else bld.load(at)
                    x = bld.fadd(x, m)
                per_row.append(x)
            out.append(per_row)
        return out

    def vector_block(j0: ir.Value, count: int) -> None:
        for r, per_row in enumerate(keys(j0, lanes, count)):
            for u, x in enumerate(per_row):
                at = bld.gep(scores[r], [bld.add(j0, ir.Constant(I64, u * lanes))])
                bld.store(x, bld.bitcast(at, vt.as_pointer()), align=4)
                bld.store(_larger(bld, bld.load(vbests[r]), x), vbests[r])

    # vectors of keys per step: independent chains hide the multiply-add latency (with several
    # rows, fewer: their accumulators and the keys must stay in registers)
    unroll = 4 if n == 1 else (2 if lanes >= 16 else 1)
    blocks = bld.sdiv(vectors, ir.Constant(I64, unroll))
    with ctx.loop(blocks, name="kb") as jb:
        vector_block(bld.mul(jb, ir.Constant(I64, unroll * lanes)), unroll)
    with ctx.loop(vectors, name="kv", start=bld.mul(blocks, ir.Constant(I64, unroll))) as jv:
        vector_block(bld.mul(jv, ir.Constant(I64, lanes)), 1)
    for r in range(n):
        folded = bld.load(vbests[r])
        value = bld.extract_element(folded, ir.Constant(ir.IntType(32), 0))
        for i in range(1, lanes):
            value = _larger(bld, value, bld.extract_element(folded, ir.Constant(ir.IntType(32), i)))
        bld.store(value, best[r])
    with ctx.loop(t_, name="kt", start=bld.mul(vectors, ir.Constant(I64, lanes))) as j:
        for r, per_row in enumerate(keys(j, 1)):
            store_at(ctx, per_row[0], scores[r], j)
            bld.store(_larger(bld, bld.load(best[r]), per_row[0]), best[r])
    for r in range(n):
        vsum = ctx.alloca(vt, name=f"vsum{r}")
        bld.store(ir.Constant(vt, [0.0] * lanes), vsum)
        top = splat(bld, bld.load(best[r]), lanes)
        with ctx.loop(vectors, name="ev") as jv:
            at = bld.bitcast(bld.gep(scores[r], [bld.mul(jv, ir.Constant(I64, lanes))]), vt.as_pointer())
            e = ctx.math.exp(bld.fsub(bld.load(at, align=4), top))
            bld.store(e, at, align=4)
            bld.store(bld.fadd(bld.load(vsum), e), vsum)
        folded = bld.load(vsum)
        value = bld.extract_element(folded, ir.Constant(ir.IntType(32), 0))
        for i in range(1, lanes):
            value = bld.fadd(value, bld.extract_element(folded, ir.Constant(ir.IntType(32), i)))
        bld.store(value, total[r])
        with ctx.loop(t_, name="et", start=bld.mul(vectors, ir.Constant(I64, lanes))) as j:
            e = ctx.math.exp(bld.fsub(load_at(ctx, scores[r], j), bld.load(best[r])))
            store_at(ctx, e, scores[r], j)
            bld.store(bld.fadd(bld.load(total[r]), e), total[r])


def _larger(bld: ir.IRBuilder, a: ir.Value, b: ir.Value) -> ir.Value:
    """``max(a, b)`` by one compare and blend (a NaN may be skipped: see :func:`_vector_softmax_scores`)."""
    return bld.select(bld.fcmp_ordered(">", b, a), b, a)


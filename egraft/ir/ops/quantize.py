"""Quantization: QuantizeLinear, DequantizeLinear, DynamicQuantizeLinear, QLinearMatMul,
QLinearConv and ConvInteger (MatMulInteger lives with MatMul in ``nn_dense``).

Integer quantized types only (int8, uint8, int16, uint16; int32 for DequantizeLinear
inputs): float8 and 4-bit types have no numpy representation and the importer reports
them as unsupported.

Quantization is ``saturate(round(x / scale) + zero_point)`` with rounding half to even;
the scale and zero point are per tensor (a scalar), per axis (a 1-D tensor along
``axis``) or blocked (``block_size`` consecutive elements along ``axis`` share one).
Integer products are accumulated exactly (in float64, exact for these magnitudes) and
requantized with the float32 multiplier ``scale_a * scale_b / scale_y``.
"""

from __future__ import annotations

import itertools
import math

import numpy as np
import sympy

from egraft.errors import UnsupportedOpError
from egraft.ir.dims import BroadcastError, Dim, broadcast_shapes, simplify_dim
from egraft.ir.dtypes import DType, UnsupportedDType
from egraft.ir.ops._common import fail, normalize_axis, require_shape
from egraft.ir.registry import InferContext, register_op
from egraft.ir.types import TensorType

#: Saturation ranges of the quantized integer types.
_RANGES: dict[DType, tuple[int, int]] = {
    DType.UINT8: (0, 255),
    DType.INT8: (-128, 127),
    DType.UINT16: (0, 65535),
    DType.INT16: (-32768, 32767),
}


def _saturate(q: np.ndarray, dtype: DType) -> np.ndarray:
    """``q`` (already rounded, in float64) clamped to ``dtype``'s range and cast to it."""
    lo, hi = _RANGES[dtype]
    return np.clip(np.nan_to_num(q, nan=0.0), lo, hi).astype(dtype.numpy)


def _dtype_attr(ctx, value: int, what: str) -> DType:
    try:
        return DType.from_onnx(int(value), f" ({what} of {ctx.node.label})")
    except UnsupportedDType as e:
        raise UnsupportedOpError(str(e)) from None


# ---- scale and zero-point layouts -----------------------------------------------------------------
def _block_size(ctx) -> int:
    return int(ctx.attr("block_size", 0)) if ctx.opset >= 21 else 0


def _check_param_shape(ctx: InferContext, index: int, what: str) -> None:
    """Check a scale/zero-point shape against x's: scalar, 1-D along ``axis``, or blocked."""
    t = ctx.types[index] if ctx.has_input(index) else None
    x = ctx.types[0]
    if t is None or t.shape is None or x.shape is None:
        return
    p, xs = t.shape, x.shape
    block = _block_size(ctx)
    if len(p) == 0 or (len(p) == 1 and isinstance(p[0], int) and p[0] == 1):
        return
    if not xs:
        raise fail(ctx, f"{what} has shape {list(p)} but x is a scalar")
    axis = normalize_axis(int(ctx.attr("axis", 1)), len(xs), ctx)
    if block:
        if len(p) != len(xs):
            raise fail(ctx, f"blocked {what} must have x's rank {len(xs)}, got shape {list(p)}")
        for i, (pd, xd) in enumerate(zip(p, xs)):
            want = -(-xd // block) if isinstance(xd, int) and i == axis else (xd if i != axis else None)
            if isinstance(pd, int) and isinstance(want, int) and pd != want:
                raise fail(ctx, f"blocked {what} has shape {list(p)}; axis {i} should be {want} "
                                f"(x shape {list(xs)}, block_size {block})")
        return
    if len(p) != 1:
        raise fail(ctx, f"{what} must be a scalar or a 1-D tensor, got shape {list(p)}")
    if isinstance(p[0], int) and isinstance(xs[axis], int) and p[0] != xs[axis]:
        raise fail(ctx, f"{what} has {p[0]} entries but x has {xs[axis]} along axis {axis}")


def _expand_param(p: np.ndarray, x_shape: tuple, axis: int, block_size: int) -> np.ndarray:
    """A scale or zero point reshaped (and, when blocked, repeated) to broadcast against x."""
    p = np.asarray(p)
    if p.ndim == 0 or p.size == 1:
        return p.reshape(())
    axis = normalize_axis(axis, len(x_shape))
    if block_size and p.ndim == len(x_shape):
        p = np.repeat(p, block_size, axis=axis)
        return np.take(p, np.arange(x_shape[axis]), axis=axis)
    shape = [1] * len(x_shape)
    shape[axis] = p.size
    return p.reshape(shape)


# ---- QuantizeLinear ---------------------------------------------------------------------------
def _quantize_dtype(ctx: InferContext) -> DType:
    """The output type: the zero point's, else ``output_dtype``, else uint8."""
    attr = int(ctx.attr("output_dtype", 0)) if ctx.opset >= 21 else 0
    if ctx.has_input(2):
        dtype = ctx.types[2].dtype
        if attr and _dtype_attr(ctx, attr, "output_dtype") != dtype:
            raise fail(ctx, f"output_dtype {_dtype_attr(ctx, attr, 'output_dtype').short} differs from the "
                            f"zero point's type {dtype.short}")
        return dtype
    return _dtype_attr(ctx, attr, "output_dtype") if attr else DType.UINT8


def _quantize_linear_infer(ctx: InferContext) -> list[TensorType]:
    x = ctx.types[0]
    dtype = _quantize_dtype(ctx)
    if dtype not in _RANGES:
        raise UnsupportedOpError(f"{ctx.node.label}: quantizing to {dtype.short} is not supported "
                                 f"(egraft supports {', '.join(d.short for d in _RANGES)})")
    _check_param_shape(ctx, 1, "y_scale")
    _check_param_shape(ctx, 2, "y_zero_point")
    return [TensorType(dtype, x.shape)]


def _division_dtype(ctx, scale: np.ndarray) -> np.dtype:
    """The precision of ``x / y_scale``: the ``precision`` attribute, else the scale's type."""
    precision = int(ctx.attr("precision", 0)) if ctx.opset >= 23 else 0
    if precision:
        return DType.from_onnx(precision).numpy
    return scale.dtype if scale.dtype.kind == "f" or scale.dtype.name == "bfloat16" else np.dtype(np.float32)


def _quantize_linear(ctx, x, y_scale, y_zero_point=None):
    axis = int(ctx.attr("axis", 1))
    block = _block_size(ctx)
    if y_zero_point is not None:
        dtype = DType.from_numpy(y_zero_point.dtype)
    else:
        attr = int(ctx.attr("output_dtype", 0)) if ctx.opset >= 21 else 0
        dtype = DType.from_onnx(attr) if attr else DType.UINT8
    work = _division_dtype(ctx, y_scale)
    scale = _expand_param(y_scale, x.shape, axis, block).astype(work)
    q = np.rint((x.astype(work) / scale).astype(np.float64))
    if y_zero_point is not None:
        q = q + _expand_param(y_zero_point, x.shape, axis, block).astype(np.float64)
    return [_saturate(q, dtype)]


register_op("QuantizeLinear", infer=_quantize_linear_infer, compute=_quantize_linear,
            doc="saturate(round_half_even(x / y_scale) + y_zero_point), per tensor, axis or block")


# ---- DequantizeLinear -------------------------------------------------------------------------
def _dequantize_dtype(ctx) -> DType:
    attr = int(ctx.attr("output_dtype", 0)) if ctx.opset >= 23 else 0
    return _dtype_attr(ctx, attr, "output_dtype") if attr else ctx.types[1].dtype


def _dequantize_linear_infer(ctx: InferContext) -> list[TensorType]:
    x = ctx.types[0]
    if x.dtype not in _RANGES and x.dtype is not DType.INT32:
        raise UnsupportedOpError(f"{ctx.node.label}: dequantizing {x.dtype.short} is not supported")
    if ctx.has_input(2) and ctx.types[2].dtype != x.dtype:
        raise fail(ctx, f"x is {x.dtype.short} but x_zero_point is {ctx.types[2].dtype.short}")
    dtype = _dequantize_dtype(ctx)
    if not dtype.is_float:
        raise fail(ctx, f"the output type must be a float type, not {dtype.short}")
    _check_param_shape(ctx, 1, "x_scale")
    _check_param_shape(ctx, 2, "x_zero_point")
    return [TensorType(dtype, x.shape)]


def _dequantize_linear(ctx, x, x_scale, x_zero_point=None):
    """``(x - x_zero_point) * x_scale``, multiplied in the output type."""
    axis = int(ctx.attr("axis", 1))
    block = _block_size(ctx)
    attr = int(ctx.attr("output_dtype", 0)) if ctx.opset >= 23 else 0
    out = DType.from_onnx(attr).numpy if attr else x_scale.dtype
    diff = x.astype(np.int64)
    if x_zero_point is not None:
        diff = diff - _expand_param(x_zero_point, x.shape, axis, block).astype(np.int64)
    scale = _expand_param(x_scale, x.shape, axis, block).astype(out)
    return [np.asarray(diff.astype(out) * scale, dtype=out)]


register_op("DequantizeLinear", infer=_dequantize_linear_infer, compute=_dequantize_linear,
            doc="(x - x_zero_point) * x_scale, per tensor, axis or block")


# ---- DynamicQuantizeLinear ----------------------------------------------------------------------
def _dynamic_quantize_infer(ctx: InferContext) -> list[TensorType]:
    x = ctx.types[0]
    if x.dtype is not DType.FLOAT32:
        raise fail(ctx, f"x must be f32, not {x.dtype.short}")
    return [TensorType(DType.UINT8, x.shape), TensorType(DType.FLOAT32, ()), TensorType(DType.UINT8, ())]


def _dynamic_quantize_linear(ctx, x):
    """uint8 quantization with the range [min(x, 0), max(x, 0)] mapped onto [0, 255].

    ``y_scale = (max - min) / 255``; ``y_zero_point = round(clip(-min / y_scale, 0, 255))``;
    ``y = saturate(round(x / y_scale) + y_zero_point)``, all in float32 with rounding half
    to even. When x is all zeros the formula's scale is 0; the scale is then 1, as
    onnxruntime gives (a scale of 0 would make every later dequantization a division by
    zero), and y and the zero point are 0.
    """
    x = x.astype(np.float32)
    lo = np.float32(min(0.0, float(x.min()))) if x.size else np.float32(0)
    hi = np.float32(max(0.0, float(x.max()))) if x.size else np.float32(0)
    scale = np.float32((hi - lo) / np.float32(255))
    if scale == 0:
        return [np.zeros(x.shape, np.uint8), np.array(1, np.float32), np.array(0, np.uint8)]
    zero_point = np.rint(np.clip(np.float32(0) - lo / scale, np.float32(0), np.float32(255)))
    q = np.rint(x / scale).astype(np.float64) + float(zero_point)
    return [_saturate(q, DType.UINT8), np.array(scale, np.float32), np.array(zero_point, np.uint8)]


register_op("DynamicQuantizeLinear", infer=_dynamic_quantize_infer, compute=_dynamic_quantize_linear,
            doc="uint8 quantization of x with a scale and zero point computed from its range")


# ---- QLinearMatMul ----------------------------------------------------------------------------
def _matmul_shape(ctx: InferContext, a: tuple, b: tuple) -> tuple:
    """The output shape of numpy matmul of shapes ``a`` and ``b`` (symbolic dims allowed)."""
    if not a or not b:
        raise fail(ctx, "matmul inputs must have rank >= 1")
    a2 = (1,) + tuple(a) if len(a) == 1 else tuple(a)
    b2 = tuple(b) + (1,) if len(b) == 1 else tuple(b)
    ka, kb = a2[-1], b2[-2]
    if isinstance(ka, int) and isinstance(kb, int) and ka != kb:
        raise fail(ctx, f"cannot multiply shapes {list(a)} and {list(b)} ({ka} != {kb})")
    try:
        batch = broadcast_shapes(a2[:-2], b2[:-2])
    except BroadcastError as e:
        raise fail(ctx, str(e)) from None
    rows = (a2[-2],) if len(a) > 1 else ()
    cols = (b2[-1],) if len(b) > 1 else ()
    return tuple(batch) + rows + cols


def _qlinear_matmul_infer(ctx: InferContext) -> list[TensorType]:
    a, b = require_shape(ctx, 0), require_shape(ctx, 3)
    for i, zp in ((0, 2), (3, 5)):
        if ctx.types[i].dtype not in (DType.UINT8, DType.INT8):
            raise UnsupportedOpError(f"{ctx.node.label}: input {i} is {ctx.types[i].dtype.short}; "
                                     f"egraft supports u8 and i8")
        if ctx.has_input(zp) and ctx.types[zp].dtype != ctx.types[i].dtype:
            raise fail(ctx, f"input {i} is {ctx.types[i].dtype.short} but its zero point is "
                            f"{ctx.types[zp].dtype.short}")
    dtype = ctx.types[7].dtype if ctx.has_input(7) else ctx.types[0].dtype
    if dtype not in _RANGES:
        raise UnsupportedOpError(f"{ctx.node.label}: the output type {dtype.short} is not supported")
    return [TensorType(dtype, _matmul_shape(ctx, a, b))]


def _per_row(p: np.ndarray | None, a: np.ndarray) -> np.ndarray | float:
    """A per-tensor or per-row parameter of matmul's left input, shaped to broadcast on it."""
    if p is None:
        return 0.0
    p = np.asarray(p)
    if p.ndim == 1 and p.size > 1 and a.ndim >= 2:
        return p.reshape(-1, 1)
    return p


def _requantize(acc: np.ndarray, multiplier: np.ndarray, zero_point: np.ndarray | None, dtype: DType) -> np.ndarray:
    """``saturate(round(acc * multiplier) + zero_point)`` in ``dtype``."""
    q = np.rint(acc * multiplier.astype(np.float64))
    if zero_point is not None:
        q = q + np.asarray(zero_point).astype(np.float64)
    return _saturate(q, dtype)


def _qlinear_matmul(ctx, a, a_scale, a_zero_point, b, b_scale, b_zero_point, y_scale, y_zero_point=None):
    acc = np.matmul(a.astype(np.float64) - _per_row(a_zero_point, a),
                    b.astype(np.float64) - (0.0 if b_zero_point is None else b_zero_point.astype(np.float64)))
    f32 = np.float32
    multiplier = _per_row(a_scale, a).astype(f32) * b_scale.astype(f32) / y_scale.astype(f32)
    dtype = DType.from_numpy(y_zero_point.dtype) if y_zero_point is not None else DType.from_numpy(a.dtype)
    return [_requantize(acc, multiplier, y_zero_point, dtype)]


register_op("QLinearMatMul", infer=_qlinear_matmul_infer, compute=_qlinear_matmul,
            doc="quantized a @ b: requantize((a - a_zp) @ (b - b_zp) * a_scale * b_scale / y_scale) + y_zp")


# ---- convolutions: ConvInteger, QLinearConv ---------------------------------------------------------
def _conv_attrs(ctx, kernel: tuple) -> tuple[list, list, list, str]:
    """(kernel, strides, dilations, auto_pad) with defaults filled in."""
    nd = len(kernel)
    kernel_attr = ctx.attr("kernel_shape", None)
    kernel = list(kernel_attr) if kernel_attr else list(kernel)
    strides = list(ctx.attr("strides", None) or [1] * nd)
    dilations = list(ctx.attr("dilations", None) or [1] * nd)
    auto_pad = ctx.attr("auto_pad", "NOTSET") or "NOTSET"
    if len(kernel) != nd or len(strides) != nd or len(dilations) != nd:
        raise ValueError(f"kernel_shape, strides and dilations must have {nd} entries")
    return kernel, strides, dilations, auto_pad


def _explicit_pads(ctx, nd: int) -> list[int]:
    pads = ctx.attr("pads", None)
    if not pads:
        return [0] * (2 * nd)
    if len(pads) != 2 * nd:
        raise ValueError(f"pads must have {2 * nd} entries, got {list(pads)}")
    return [int(p) for p in pads]


def _out_dim(size: Dim, k: int, s: int, d: int, pad_total: int, auto_pad: str) -> Dim:
    """One output dim of a convolution (``size`` may be symbolic)."""
    extent = d * (k - 1) + 1
    if auto_pad in ("SAME_UPPER", "SAME_LOWER"):
        if isinstance(size, int):
            return -(-size // s)
        return simplify_dim(sympy.ceiling(sympy.Rational(1, s) * size))
    if auto_pad == "VALID":
        pad_total = 0
    if isinstance(size, int):
        return (size + pad_total - extent) // s + 1
    return simplify_dim(sympy.floor((size + pad_total - extent) * sympy.Rational(1, s)) + 1)


def _conv_pads(ctx, spatial: tuple[int, ...], kernel, strides, dilations, auto_pad) -> tuple[list, list]:
    """(pads at the start, pads at the end) of each spatial axis, as the run-time sizes need."""
    nd = len(spatial)
    if auto_pad in ("SAME_UPPER", "SAME_LOWER"):
        begin, end = [], []
        for size, k, s, d in zip(spatial, kernel, strides, dilations):
            out = -(-size // s)
            total = max(0, (out - 1) * s + d * (k - 1) + 1 - size)
            small = total // 2
            begin.append(small if auto_pad == "SAME_UPPER" else total - small)
            end.append(total - begin[-1])
        return begin, end
    if auto_pad == "VALID":
        return [0] * nd, [0] * nd
    pads = _explicit_pads(ctx, nd)
    return pads[:nd], pads[nd:]


def _conv_infer_shape(ctx: InferContext, x_index: int, w_index: int) -> tuple:
    x, w = require_shape(ctx, x_index), require_shape(ctx, w_index)
    if len(x) < 3 or len(w) != len(x):
        raise fail(ctx, f"x and w must have the same rank >= 3, got shapes {list(x)} and {list(w)}")
    group = int(ctx.attr("group", 1))
    try:
        kernel, strides, dilations, auto_pad = _conv_attrs(ctx, w[2:])
        pads = _explicit_pads(ctx, len(kernel)) if auto_pad == "NOTSET" else [0] * (2 * len(kernel))
    except ValueError as e:
        raise fail(ctx, str(e)) from None
    if not all(isinstance(k, int) for k in kernel):
        raise fail(ctx, "the kernel shape must be static")
    if isinstance(x[1], int) and isinstance(w[1], int) and x[1] != w[1] * group:
        raise fail(ctx, f"x has {x[1]} channels but w expects {w[1]} x group {group}")
    if isinstance(w[0], int) and w[0] % group:
        raise fail(ctx, f"w has {w[0]} output channels, not a multiple of group {group}")
    nd = len(kernel)
    spatial = [_out_dim(size, k, s, d, pads[i] + pads[i + nd], auto_pad)
               for i, (size, k, s, d) in enumerate(zip(x[2:], kernel, strides, dilations))]
    return (x[0], w[0], *spatial)


#: Largest im2col matrix (elements) built in one piece; bigger convolutions loop over kernel offsets.
_IM2COL_LIMIT = 1 << 25


def _correlate(x: np.ndarray, w: np.ndarray, strides, dilations, begin, end, group: int) -> np.ndarray:
    """Grouped N-D cross-correlation of x [N, C, *S] with w [M, C/group, *K] in float64,
    zero padded: one batched matrix product per kernel offset."""
    n = x.shape[0]
    m, cg = w.shape[:2]
    kernel = w.shape[2:]
    xp = np.pad(x, [(0, 0), (0, 0)] + list(zip(begin, end)))
    out = [max(0, (size - d * (k - 1) - 1) // s + 1) for size, k, s, d in zip(xp.shape[2:], kernel, strides, dilations)]
    xg = xp.reshape(n, group, cg, *xp.shape[2:])
    wg = w.reshape(group, m // group, cg, *kernel)
    y = np.zeros((n, group, m // group, math.prod(out)), dtype=np.float64)
    if not all(out):
        return y.reshape(n, m, *out)
    lead = (slice(None),) * 3
    offsets = list(itertools.product(*(range(k) for k in kernel)))

    def patch(offset) -> np.ndarray:
        window = tuple(slice(o * d, o * d + s * (size - 1) + 1, s)
                       for o, d, s, size in zip(offset, dilations, strides, out))
        return xg[lead + window].reshape(n, group, cg, -1)

    if n * group * cg * len(offsets) * y.shape[-1] <= _IM2COL_LIMIT:
        # im2col: all kernel offsets side by side, one matrix product
        cols = np.concatenate([patch(o) for o in offsets], axis=2)  # [n, group, K*cg, P]
        wcols = np.concatenate([wg[lead + o] for o in offsets], axis=2)  # [group, m/group, K*cg]
        return np.matmul(wcols, cols).reshape(n, m, *out)
    for offset in offsets:
        y += np.matmul(wg[lead + offset], patch(offset))
    return y.reshape(n, m, *out)


def _run_conv(ctx, x: np.ndarray, w: np.ndarray) -> np.ndarray:
    kernel, strides, dilations, auto_pad = _conv_attrs(ctx, w.shape[2:])
    begin, end = _conv_pads(ctx, x.shape[2:], kernel, strides, dilations, auto_pad)
    return _correlate(x, w, strides, dilations, begin, end, int(ctx.attr("group", 1)))


def _per_channel(p: np.ndarray | None, rank: int) -> np.ndarray | float:
    """A per-tensor or per-output-channel parameter shaped to broadcast on [M, ...] (rank ``rank``)."""
    if p is None:
        return 0.0
    p = np.asarray(p).astype(np.float64)
    if p.ndim == 1 and p.size > 1:
        return p.reshape((-1,) + (1,) * (rank - 1))
    return p.reshape(())


def _check_int8(ctx: InferContext, *indices: int) -> None:
    for i in indices:
        if ctx.has_input(i) and ctx.types[i].dtype not in (DType.UINT8, DType.INT8):
            raise UnsupportedOpError(f"{ctx.node.label}: input {i} is {ctx.types[i].dtype.short}; "
                                     f"egraft supports u8 and i8")


def _conv_integer_infer(ctx: InferContext) -> list[TensorType]:
    _check_int8(ctx, 0, 1, 2, 3)
    return [TensorType(DType.INT32, _conv_infer_shape(ctx, 0, 1))]


def _conv_integer(ctx, x, w, x_zero_point=None, w_zero_point=None):
    """int32 convolution of ``x - x_zero_point`` with ``w - w_zero_point`` (zero point per
    tensor, or per output channel for w); padding contributes zero."""
    xs = x.astype(np.float64) - (0.0 if x_zero_point is None else float(np.asarray(x_zero_point).reshape(-1)[0]))
    ws = w.astype(np.float64) - _per_channel(w_zero_point, w.ndim)
    acc = _run_conv(ctx, xs, ws)
    return [acc.astype(np.int64).astype(np.int32)]


register_op("ConvInteger", infer=_conv_integer_infer, compute=_conv_integer,
            doc="int32 convolution of (x - x_zero_point) with (w - w_zero_point)")


def _qlinear_conv_infer(ctx: InferContext) -> list[TensorType]:
    _check_int8(ctx, 0, 2, 3, 5, 7)
    dtype = ctx.types[7].dtype if ctx.has_input(7) else ctx.types[0].dtype
    return [TensorType(dtype, _conv_infer_shape(ctx, 0, 3))]


def _qlinear_conv(ctx, x, x_scale, x_zero_point, w, w_scale, w_zero_point, y_scale, y_zero_point=None, bias=None):
    """requantize(conv(x - x_zp, w - w_zp) + B) with multiplier x_scale * w_scale / y_scale
    (per tensor or per output channel)."""
    xs = x.astype(np.float64) - (0.0 if x_zero_point is None else float(np.asarray(x_zero_point).reshape(-1)[0]))
    ws = w.astype(np.float64) - _per_channel(w_zero_point, w.ndim)
    acc = _run_conv(ctx, xs, ws)
    spatial = acc.ndim - 2
    if bias is not None:
        acc = acc + bias.astype(np.float64).reshape((-1,) + (1,) * spatial)
    f32 = np.float32
    w_scale = np.asarray(w_scale).astype(f32)
    if w_scale.ndim == 1 and w_scale.size > 1:
        w_scale = w_scale.reshape((-1,) + (1,) * spatial)
    else:
        w_scale = w_scale.reshape(())
    multiplier = np.asarray(x_scale).astype(f32).reshape(()) * w_scale / np.asarray(y_scale).astype(f32).reshape(())
    dtype = DType.from_numpy(y_zero_point.dtype) if y_zero_point is not None else DType.from_numpy(x.dtype)
    zp = None if y_zero_point is None else np.asarray(y_zero_point).reshape(())
    return [_requantize(acc, multiplier, zp, dtype)]


register_op("QLinearConv", infer=_qlinear_conv_infer, compute=_qlinear_conv,
            doc="quantized convolution: requantize(conv(x - x_zp, w - w_zp) + B) with x_scale * w_scale / y_scale")

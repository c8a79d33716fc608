"""Spatial neural-network ops over ``N x C x D1 x ... x Dn`` tensors: Conv, ConvTranspose,
the pooling family (MaxPool, AveragePool, LpPool, GlobalAveragePool, GlobalMaxPool),
Pad, Resize/Upsample, DepthToSpace, SpaceToDepth, LRN and CenterCropPad.

Output spatial dims are computed with sympy arithmetic, so ``Conv`` of ``f32[batch, 3, H, W]``
gets dims such as ``floor((H - 1)/2) + 1``. The kernels are vectorized: Conv is im2col
(a strided window view copied once) times the weights as one batched matmul per group;
pooling reduces one spatial axis at a time with a loop over that axis's kernel taps;
ConvTranspose is a matmul followed by a col2im scatter-add over the kernel taps; Resize
resamples one axis at a time with per-output tap indices and weights.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import sympy
from numpy.lib.stride_tricks import sliding_window_view

from egraft.ir.dims import Dim
from egraft.ir.dtypes import DType
from egraft.ir.ops._common import fail, ints_of, normalize_axis, require_shape, same_as
from egraft.ir.registry import register_op
from egraft.ir.types import TensorType

_SAME = ("SAME_UPPER", "SAME_LOWER")

#: im2col buffers above this many bytes are built one batch chunk at a time.
_COLS_BYTES = 1 << 28


# ---- dim arithmetic (ints or sympy) -------------------------------------------------------
# sympy's automatic evaluation keeps these expressions canonical (floor of a linear form plus a
# constant); TensorType simplifies each output dim once more, so no sympy.simplify is run here.
def _dim(e) -> Dim:
    if isinstance(e, int):
        return e
    e = sympy.sympify(e)
    return int(e) if e.is_Integer else e


def _unfloor(e: sympy.Expr) -> sympy.Expr:
    """``u + c`` for ``e == floor(u) + c`` (integer ``c``), else ``e``: inside a floor division by an
    integer the inner floor can go, since floor(floor(v) / b) == floor(v / b)."""
    const, rest = 0, e
    if isinstance(e, sympy.Add):
        terms = [t for t in e.args if not t.is_Integer]
        if len(terms) == 1:
            const, rest = e - terms[0], terms[0]
    if isinstance(rest, sympy.floor):
        return rest.args[0] + const
    return e


def _floor_div(a: Dim, b: int) -> Dim:
    """floor(a / b) for a dim ``a`` (an integer); nested floors are flattened so that chains of
    strided layers give ``floor(H/4 + 3/4)`` rather than a tower of floors."""
    if isinstance(a, int):
        return a // b
    if b == 1:
        return a
    return _dim(sympy.floor(_unfloor(sympy.sympify(a)) / b))


def _ceil_div(a: Dim, b: int) -> Dim:
    """ceil(a / b) for a dim ``a``: floor((a + b - 1) / b), as dims are integers."""
    if isinstance(a, int):
        return -(-a // b)
    return _floor_div(_add(a, b - 1), b)


def _min_dim(a: Dim, b: Dim) -> Dim:
    if isinstance(a, int) and isinstance(b, int):
        return min(a, b)
    return _dim(sympy.Min(a, b))


def _mul_dim(d: Dim, k: int) -> Dim:
    return d * k if isinstance(d, int) else _dim(d * k)


def _add(*terms: Dim) -> Dim:
    if all(isinstance(t, int) for t in terms):
        return sum(terms)
    return _dim(sum(sympy.sympify(t) for t in terms))


def _work_dtype(dtype: np.dtype) -> np.dtype:
    """The float type to compute in: f16 (and other narrow floats) widen to f32."""
    return np.dtype(np.float64) if dtype == np.float64 else np.dtype(np.float32)


def _axis_slice(ndim: int, axis: int, s: slice) -> tuple:
    index = [slice(None)] * ndim
    index[axis] = s
    return tuple(index)


# ---- sliding-window geometry shared by Conv and the pools ------------------------------------
@dataclass(frozen=True)
class _Window:
    """Kernel, strides, dilations, pads and auto_pad of a sliding-window op, per spatial axis."""

    kernel: tuple[int, ...]
    strides: tuple[int, ...]
    dilations: tuple[int, ...]
    pads: tuple[int, ...]  # [x1_begin, x2_begin, ..., x1_end, x2_end, ...]
    auto_pad: str = "NOTSET"
    ceil_mode: bool = False

    @property
    def rank(self) -> int:
        return len(self.kernel)

    def extent(self, i: int) -> int:
        """The span of the dilated kernel along axis ``i``: ``(k - 1) * d + 1``."""
        return (self.kernel[i] - 1) * self.dilations[i] + 1

    def out_dim(self, i: int, n: Dim) -> Dim:
        """The output length along spatial axis ``i`` for an input of length ``n``."""
        ext, s = self.extent(i), self.strides[i]
        if self.auto_pad in _SAME:
            return _ceil_div(n, s)
        if self.auto_pad == "VALID":
            return _add(_floor_div(_add(n, -ext), s), 1)
        pb, pe = self.pads[i], self.pads[self.rank + i]
        if not self.ceil_mode:
            return _add(_floor_div(_add(n, pb + pe - ext), s), 1)
        out = _add(_ceil_div(_add(n, pb + pe - ext), s), 1)
        if pe + s > ext:  # the last window could start in the end padding: such windows are dropped
            out = _min_dim(out, _ceil_div(_add(n, pb), s))
        return out

    def resolve(self, shape: Sequence[int]) -> tuple[list[int], list[int], list[int]]:
        """(output lengths, begin pads, end pads) for a concrete spatial shape."""
        outs, begins, ends = [], [], []
        for i, n in enumerate(shape):
            out = self.out_dim(i, int(n))
            if self.auto_pad in _SAME:
                total = max(0, (out - 1) * self.strides[i] + self.extent(i) - n)
                pb = total // 2 if self.auto_pad == "SAME_UPPER" else total - total // 2
                pe = total - pb
            elif self.auto_pad == "VALID":
                pb = pe = 0
            else:
                pb, pe = self.pads[i], self.pads[self.rank + i]
            outs.append(max(int(out), 0))
            begins.append(pb)
            ends.append(pe)
        return outs, begins, ends


def _auto_pad(ctx) -> str:
    value = ctx.attr("auto_pad", "NOTSET") or "NOTSET"
    if value not in ("NOTSET", "VALID", *_SAME):
        raise ValueError(f"unknown auto_pad {value!r}")
    return value


def _window(ctx, kernel: Sequence[int], ceil_mode: bool = False) -> _Window:
    nd = len(kernel)
    strides = ctx.attr("strides", None) or [1] * nd
    dilations = ctx.attr("dilations", None) or [1] * nd
    pads = ctx.attr("pads", None) or [0] * (2 * nd)
    if len(strides) != nd or len(dilations) != nd or len(pads) != 2 * nd:
        raise ValueError(f"strides {strides}, dilations {dilations} and pads {pads} do not fit a "
                         f"{nd}-D kernel {list(kernel)}")
    return _Window(tuple(int(k) for k in kernel), tuple(int(s) for s in strides),
                   tuple(int(d) for d in dilations), tuple(int(p) for p in pads), _auto_pad(ctx), ceil_mode)


def _check_out_dims(ctx, dims: Sequence[Dim]) -> None:
    for d in dims:
        if isinstance(d, int) and d < 1:
            raise fail(ctx, f"the input is too small for the kernel (output spatial dims {list(dims)})")


def _pad_input(x: np.ndarray, begins: Sequence[int], needed: Sequence[int], fill) -> np.ndarray:
    """``x`` with ``begins`` leading fill values per spatial axis, and enough trailing ones that
    each spatial axis is at least ``needed`` long."""
    widths = [(0, 0), (0, 0)]
    for pb, need, n in zip(begins, needed, x.shape[2:]):
        widths.append((pb, max(0, need - pb - n)))
    if all(w == (0, 0) for w in widths):
        return x
    return np.pad(x, widths, mode="constant", constant_values=fill)


# ---- Conv ------------------------------------------------------------------------------------
def _conv_kernel(ctx, w_shape) -> list[Dim] | None:
    kernel = ctx.attr("kernel_shape", None)
    if kernel:
        return [int(k) for k in kernel]
    if w_shape is None:
        return None
    return list(w_shape[2:])


def _conv_infer(ctx):
    x, w = ctx.types[0], ctx.types[1]
    if x.shape is None:
        return [TensorType(x.dtype, None)]
    nd = len(x.shape) - 2
    if nd < 1:
        raise fail(ctx, f"the input has rank {len(x.shape)}; Conv needs N x C x D1 x ...")
    group = ctx.attr("group", 1)
    m = w.shape[0] if w.shape is not None else ctx.fresh_dim()
    if w.shape is not None:
        c, cg = x.shape[1], w.shape[1]
        if isinstance(c, int) and isinstance(cg, int) and c != cg * group:
            raise fail(ctx, f"the input has {c} channels but the weights expect {cg} x group {group}")
    kernel = _conv_kernel(ctx, w.shape)
    if kernel is None or not all(isinstance(k, int) for k in kernel):
        return [TensorType(x.dtype, (x.shape[0], m, *(ctx.fresh_dim() for _ in range(nd))))]
    try:
        win = _window(ctx, kernel)
    except ValueError as e:
        raise fail(ctx, str(e)) from None
    spatial = [win.out_dim(i, d) for i, d in enumerate(x.shape[2:])]
    _check_out_dims(ctx, spatial)
    return [TensorType(x.dtype, (x.shape[0], m, *spatial))]


def conv_nd(x: np.ndarray, w: np.ndarray, group: int, win: _Window) -> np.ndarray:
    """The N-D cross-correlation of ``x`` (N, C, *S) with ``w`` (M, C/group, *K), no bias.

    im2col: a strided view of every window (no copy) is copied once into
    (N, group, C/group * prod(K), prod(out)) and multiplied by the weights as one batched
    matmul, which gives (N, group, M/group, prod(out)), already the output layout.
    """
    n, c = x.shape[:2]
    m = w.shape[0]
    nd = x.ndim - 2
    outs, begins, _ = win.resolve(x.shape[2:])
    cg, mg = c // group, m // group
    taps = int(np.prod(w.shape[2:], dtype=np.int64))
    size = int(np.prod(outs, dtype=np.int64))
    weights = w.reshape(group, mg, cg * taps)
    if size == 0 or n == 0:
        return np.zeros((n, m, *outs), dtype=x.dtype)
    pointwise = taps == 1 and all(s == 1 for s in win.strides) and all(p == 0 for p in begins) \
        and list(outs) == list(x.shape[2:])
    if pointwise:  # 1x1 convolution: no windows to gather
        cols = x.reshape(n, group, cg, size)
        return np.matmul(weights, cols).reshape(n, m, *outs)
    needed = [(o - 1) * s + win.extent(i) for i, (o, s) in enumerate(zip(outs, win.strides))]
    xp = _pad_input(x, begins, needed, 0)
    view = sliding_window_view(xp, [win.extent(i) for i in range(nd)], axis=tuple(range(2, 2 + nd)))
    select = (slice(None), slice(None)) + tuple(slice(0, (o - 1) * s + 1, s) for o, s in zip(outs, win.strides)) \
        + tuple(slice(None, None, d) for d in win.dilations)
    view = view[select].reshape(n, group, cg, *outs, *w.shape[2:])
    order = (0, 1, 2, *range(3 + nd, 3 + 2 * nd), *range(3, 3 + nd))
    y = np.empty((n, group, mg, size), dtype=x.dtype)
    chunk = max(1, _COLS_BYTES // max(1, c * taps * size * x.itemsize))
    for start in range(0, n, chunk):
        part = view[start:start + chunk].transpose(order).reshape(-1, group, cg * taps, size)
        np.matmul(weights, part, out=y[start:start + chunk])
    return y.reshape(n, m, *outs)


def _conv(ctx, x, w, b=None):
    work = _work_dtype(x.dtype)
    win = _window(ctx, list(w.shape[2:]))
    y = conv_nd(x.astype(work, copy=False), w.astype(work, copy=False), ctx.attr("group", 1), win)
    if b is not None:
        y += b.astype(work, copy=False).reshape((1, -1) + (1,) * (x.ndim - 2))
    return [y.astype(x.dtype, copy=False)]


register_op("Conv", infer=_conv_infer, compute=_conv,
            doc="N-D convolution (cross-correlation) with groups, strides, dilations, pads and bias")


# ---- ConvTranspose -----------------------------------------------------------------------------
def _split_total_pad(total: Dim, upper: bool) -> tuple[Dim, Dim]:
    """Begin/end pads from a total: SAME_UPPER puts the odd pixel at the end, else at the start."""
    half = _floor_div(total, 2)
    rest = _add(total, -half)
    return (half, rest) if upper else (rest, half)


def _conv_transpose_geometry(ctx, in_dims: Sequence[Dim], kernel: Sequence[int]):
    """(output lengths, begin pads, end pads) of ConvTranspose, per the ONNX formulas."""
    nd = len(kernel)
    strides = ctx.attr("strides", None) or [1] * nd
    dilations = ctx.attr("dilations", None) or [1] * nd
    out_pad = ctx.attr("output_padding", None) or [0] * nd
    pads = ctx.attr("pads", None) or [0] * (2 * nd)
    output_shape = ctx.attr("output_shape", None)
    auto_pad = _auto_pad(ctx)
    if output_shape:
        output_shape = list(output_shape)[-nd:]
    outs, begins, ends = [], [], []
    for i, n in enumerate(in_dims):
        full = _add(_mul_dim(_add(n, -1), strides[i]), out_pad[i], (kernel[i] - 1) * dilations[i] + 1)
        if output_shape or auto_pad in _SAME:
            out = int(output_shape[i]) if output_shape else _mul_dim(n, strides[i])
            pb, pe = _split_total_pad(_add(full, -out), upper=auto_pad == "SAME_UPPER")
        else:
            pb, pe = (0, 0) if auto_pad == "VALID" else (pads[i], pads[nd + i])
            out = _add(full, -pb, -pe)
        outs.append(out)
        begins.append(pb)
        ends.append(pe)
    return outs, begins, ends


def _conv_transpose_infer(ctx):
    x, w = ctx.types[0], ctx.types[1]
    if x.shape is None:
        return [TensorType(x.dtype, None)]
    nd = len(x.shape) - 2
    group = ctx.attr("group", 1)
    m = ctx.fresh_dim() if w.shape is None else _mul_dim(w.shape[1], group)
    kernel = _conv_kernel(ctx, w.shape)
    if kernel is None or not all(isinstance(k, int) for k in kernel):
        return [TensorType(x.dtype, (x.shape[0], m, *(ctx.fresh_dim() for _ in range(nd))))]
    outs, _, _ = _conv_transpose_geometry(ctx, x.shape[2:], kernel)
    _check_out_dims(ctx, outs)
    return [TensorType(x.dtype, (x.shape[0], m, *outs))]


def _conv_transpose(ctx, x, w, b=None):
    """Each input pixel scatters ``x[c] * w[c]`` into the output; computed as one matmul
    (weights^T @ input) followed by a col2im scatter-add over the kernel taps."""
    work = _work_dtype(x.dtype)
    xw, ww = x.astype(work, copy=False), w.astype(work, copy=False)
    group = ctx.attr("group", 1)
    n, c = x.shape[:2]
    nd = x.ndim - 2
    in_dims, kernel = list(x.shape[2:]), list(w.shape[2:])
    strides = ctx.attr("strides", None) or [1] * nd
    dilations = ctx.attr("dilations", None) or [1] * nd
    outs, begins, _ = _conv_transpose_geometry(ctx, in_dims, kernel)
    cg, mg = c // group, w.shape[1]
    m = mg * group
    taps = int(np.prod(kernel, dtype=np.int64))
    weights = ww.reshape(group, cg, mg * taps).transpose(0, 2, 1)
    cols = np.matmul(weights, xw.reshape(n, group, cg, -1)).reshape(n, m, *kernel, *in_dims)
    full_dims = [(d - 1) * s + (k - 1) * dl + 1 for d, s, k, dl in zip(in_dims, strides, kernel, dilations)]
    # The buffer covers both the full result and the requested window [pb, pb + out).
    lead = [max(0, -pb) for pb in begins]
    size = [lo + max(f, pb + o) for lo, f, pb, o in zip(lead, full_dims, begins, outs)]
    buf = np.zeros((n, m, *size), dtype=work)
    for tap in itertools.product(*(range(k) for k in kernel)):
        dst = tuple(slice(lo + t * dl, lo + t * dl + (d - 1) * s + 1, s)
                    for lo, t, dl, d, s in zip(lead, tap, dilations, in_dims, strides))
        buf[(slice(None), slice(None), *dst)] += cols[(slice(None), slice(None), *tap)]
    window = tuple(slice(lo + pb, lo + pb + o) for lo, pb, o in zip(lead, begins, outs))
    y = buf[(slice(None), slice(None), *window)]
    if b is not None:
        y = y + b.astype(work, copy=False).reshape((1, -1) + (1,) * nd)
    return [np.ascontiguousarray(y).astype(x.dtype, copy=False)]


register_op("ConvTranspose", infer=_conv_transpose_infer, compute=_conv_transpose,
            doc="N-D transposed convolution (output_padding, output_shape, groups, dilations)")


# ---- pooling ---------------------------------------------------------------------------------
def _pool_window(ctx) -> _Window:
    kernel = ctx.attr("kernel_shape", None)
    if not kernel:
        raise ValueError("the kernel_shape attribute is required")
    ceil_mode = bool(ctx.attr("ceil_mode", 0)) if ctx.opset >= 10 else False
    return _window(ctx, kernel, ceil_mode)


def _pool_infer(ctx):
    x = ctx.types[0]
    if x.shape is None:
        return [TensorType(x.dtype, None), TensorType(DType.INT64, None)][:ctx.num_outputs]
    try:
        win = _pool_window(ctx)
    except ValueError as e:
        raise fail(ctx, str(e)) from None
    if len(x.shape) != win.rank + 2:
        raise fail(ctx, f"a {win.rank}-D kernel on an input of rank {len(x.shape)}")
    spatial = [win.out_dim(i, d) for i, d in enumerate(x.shape[2:])]
    _check_out_dims(ctx, spatial)
    shape = (*x.shape[:2], *spatial)
    out = [TensorType(x.dtype, shape)]
    if ctx.num_outputs > 1:
        out.append(TensorType(DType.INT64, shape))
    return out


def _taps(arr: np.ndarray, axis: int, out: int, kernel: int, stride: int, dilation: int):
    """The ``kernel`` strided slices of ``arr`` along ``axis`` whose j-th element of tap t is
    ``arr[j * stride + t * dilation]``."""
    for t in range(kernel):
        start = t * dilation
        yield arr[_axis_slice(arr.ndim, axis, slice(start, start + (out - 1) * stride + 1, stride))]


def _reduce_windows(xp: np.ndarray, win: _Window, outs: Sequence[int], combine) -> np.ndarray:
    """Reduce every window of a padded input, one spatial axis at a time (windows are boxes)."""
    acc = xp
    for i in range(win.rank):
        axis = 2 + i
        parts = _taps(acc, axis, outs[i], win.kernel[i], win.strides[i], win.dilations[i])
        result = next(parts).copy()
        for part in parts:
            combine(result, part, out=result)
        acc = result
    return acc


def _window_counts(win: _Window, shape, outs, begins, ends, include_pad: bool) -> np.ndarray:
    """How many positions of each window are counted by AveragePool, as a broadcastable array.

    Positions in the input always count; positions in the explicit (or auto) padding count
    when ``include_pad``; positions past the end padding (ceil_mode overhang) never do."""
    counts = np.ones((1, 1) + (1,) * win.rank)
    for i, n in enumerate(shape):
        length = max((outs[i] - 1) * win.strides[i] + win.extent(i), begins[i] + n + ends[i])
        pos = np.arange(length)
        if include_pad:
            valid = pos < begins[i] + n + ends[i]
        else:
            valid = (pos >= begins[i]) & (pos < begins[i] + n)
        per_axis = sum(_taps(valid.astype(np.float64), 0, outs[i], win.kernel[i], win.strides[i],
                             win.dilations[i]))
        counts = counts * per_axis.reshape((1, 1) + tuple(-1 if j == i else 1 for j in range(win.rank)))
    return counts


def _padded_for_pool(x: np.ndarray, win: _Window, fill):
    outs, begins, ends = win.resolve(x.shape[2:])
    needed = [(o - 1) * s + win.extent(i) for i, (o, s) in enumerate(zip(outs, win.strides))]
    return _pad_input(x, begins, needed, fill), outs, begins, ends


def _lowest(dtype: np.dtype):
    return -np.inf if np.issubdtype(dtype, np.floating) else np.iinfo(dtype).min


def _max_pool_indices(x: np.ndarray, xp: np.ndarray, win: _Window, outs, begins, storage_order: int):
    """Max pooling with the flat input index of each maximum (the first one in row-major
    window order). Reducing the last spatial axis first keeps that order."""
    spatial = x.shape[2:]
    if storage_order:  # column-major over the spatial axes
        steps = [int(np.prod(spatial[:i], dtype=np.int64)) for i in range(win.rank)]
    else:
        steps = [int(np.prod(spatial[i + 1:], dtype=np.int64)) for i in range(win.rank)]
    per_image = int(np.prod(spatial, dtype=np.int64))
    index = (np.arange(x.shape[0] * x.shape[1], dtype=np.int64) * per_image).reshape(
        (x.shape[0], x.shape[1]) + (1,) * win.rank)
    for i, n in enumerate(spatial):
        coord = np.clip(np.arange(xp.shape[2 + i]) - begins[i], 0, n - 1) * steps[i]
        index = index + coord.reshape(tuple(-1 if j == i else 1 for j in range(win.rank)))
    index = np.broadcast_to(index, xp.shape)
    values = xp
    for i in reversed(range(win.rank)):
        axis = 2 + i
        args = (outs[i], win.kernel[i], win.strides[i], win.dilations[i])
        best, best_index = None, None
        for v, k in zip(_taps(values, axis, *args), _taps(index, axis, *args)):
            if best is None:
                best, best_index = v.copy(), k.copy()
                continue
            better = v > best
            best = np.where(better, v, best)
            best_index = np.where(better, k, best_index)
        values, index = best, best_index
    return values, index


def _max_pool(ctx, x):
    win = _pool_window(ctx)
    xp, outs, begins, _ = _padded_for_pool(x, win, _lowest(x.dtype))
    if ctx.num_outputs > 1 and ctx.node.outputs[1] is not None:
        values, index = _max_pool_indices(x, xp, win, outs, begins, ctx.attr("storage_order", 0))
        return [values.astype(x.dtype, copy=False), index.astype(np.int64, copy=False)]
    return [_reduce_windows(xp, win, outs, np.maximum)]


def _average_pool(ctx, x):
    win = _pool_window(ctx)
    work = _work_dtype(x.dtype)
    xp, outs, begins, ends = _padded_for_pool(x.astype(work, copy=False), win, 0)
    total = _reduce_windows(xp, win, outs, np.add)
    include_pad = bool(ctx.attr("count_include_pad", 0))
    counts = _window_counts(win, x.shape[2:], outs, begins, ends, include_pad)
    return [(total / counts.astype(work)).astype(x.dtype, copy=False)]


def _lp_pool(ctx, x):
    win = _pool_window(ctx)
    p = float(ctx.attr("p", 2))
    work = _work_dtype(x.dtype)
    magnitude = np.abs(x.astype(work, copy=False))
    powered = magnitude * magnitude if p == 2 else magnitude ** p
    xp, outs, _, _ = _padded_for_pool(powered, win, 0)
    total = _reduce_windows(xp, win, outs, np.add)
    result = np.sqrt(total) if p == 2 else total ** (1.0 / p)
    return [result.astype(x.dtype, copy=False)]


register_op("MaxPool", infer=_pool_infer, compute=_max_pool,
            doc="max over sliding windows (ceil_mode, dilations, pads; optional flat argmax Indices)")
register_op("AveragePool", infer=_pool_infer, compute=_average_pool,
            doc="mean over sliding windows (count_include_pad, ceil_mode, dilations)")
register_op("LpPool", infer=_pool_infer, compute=_lp_pool, doc="(sum |x|^p)^(1/p) over sliding windows")


def _global_pool_infer(ctx):
    x = ctx.types[0]
    if x.shape is None:
        return [TensorType(x.dtype, None)]
    return [TensorType(x.dtype, (*x.shape[:2], *([1] * (len(x.shape) - 2))))]


def _global_average_pool(ctx, x):
    axes = tuple(range(2, x.ndim))
    return [np.mean(x, axis=axes, keepdims=True, dtype=_work_dtype(x.dtype)).astype(x.dtype, copy=False)]


def _global_max_pool(ctx, x):
    return [np.max(x, axis=tuple(range(2, x.ndim)), keepdims=True)]


register_op("GlobalAveragePool", infer=_global_pool_infer, compute=_global_average_pool,
            doc="mean over all spatial axes (kept as size 1)")
register_op("GlobalMaxPool", infer=_global_pool_infer, compute=_global_max_pool,
            doc="max over all spatial axes (kept as size 1)")


# ---- Pad ---------------------------------------------------------------------------------------
def _pad_axes(ctx, rank: int, axes) -> list[int]:
    if axes is None:
        return list(range(rank))
    return [normalize_axis(int(a), rank, ctx) for a in np.asarray(axes).ravel()]


def _pad_infer(ctx):
    x = ctx.types[0]
    if x.shape is None:
        return [TensorType(x.dtype, None)]
    rank = len(x.shape)
    if ctx.opset < 11:
        pads = ctx.attr("paddings" if ctx.opset < 2 else "pads", None)
        axes = list(range(rank))
    else:
        pads = ints_of(ctx, 1)
        axes_given = ctx.has_input(3)
        axes_value = ctx.value(3) if axes_given else None
        if axes_given and axes_value is None:
            return [TensorType(x.dtype, tuple(ctx.fresh_dim() for _ in range(rank)))]
        axes = _pad_axes(ctx, rank, axes_value)
    out = list(x.shape)
    if pads is None:
        for a in axes:
            out[a] = ctx.fresh_dim()
        return [TensorType(x.dtype, tuple(out))]
    if len(pads) != 2 * len(axes):
        raise fail(ctx, f"{len(pads)} pads for {len(axes)} axes (need two per axis)")
    for i, a in enumerate(axes):
        out[a] = _add(out[a], pads[i], pads[len(axes) + i])
        if isinstance(out[a], int) and out[a] < 0:
            raise fail(ctx, f"pads {list(pads)} shrink axis {a} of size {x.shape[a]} below zero")
    return [TensorType(x.dtype, tuple(out))]


def pad_array(x: np.ndarray, begins: Sequence[int], ends: Sequence[int], mode: str, value=0) -> np.ndarray:
    """``x`` padded by ``begins``/``ends`` per axis; negative pads crop first."""
    crop = tuple(slice(max(0, -b), n - max(0, -e)) for b, e, n in zip(begins, ends, x.shape))
    x = x[crop]
    widths = [(max(0, b), max(0, e)) for b, e in zip(begins, ends)]
    if all(w == (0, 0) for w in widths):
        return x.copy()
    if mode == "constant":
        return np.pad(x, widths, mode="constant", constant_values=np.asarray(value).astype(x.dtype))
    if mode not in ("reflect", "edge", "wrap"):
        raise ValueError(f"unknown pad mode {mode!r}")
    return np.pad(x, widths, mode=mode)


def _pad(ctx, x, pads=None, constant_value=None, axes=None):
    mode = ctx.attr("mode", "constant")
    if ctx.opset < 11:
        pads = ctx.attr("paddings" if ctx.opset < 2 else "pads")
        value = ctx.attr("value", 0.0)
        axes_list = list(range(x.ndim))
    else:
        value = 0 if constant_value is None or np.asarray(constant_value).size == 0 \
            else np.asarray(constant_value).ravel()[0]
        axes_list = _pad_axes(ctx, x.ndim, axes)
    pads = [int(p) for p in np.asarray(pads).ravel()]
    begins, ends = [0] * x.ndim, [0] * x.ndim
    for i, a in enumerate(axes_list):
        begins[a], ends[a] = pads[i], pads[len(axes_list) + i]
    return [pad_array(x, begins, ends, mode, value)]


register_op("Pad", infer=_pad_infer, compute=_pad,
            doc="pad (or crop, for negative pads) with modes constant, reflect, edge, wrap")


# ---- Resize and Upsample -----------------------------------------------------------------------
@dataclass(frozen=True)
class _ResizeOptions:
    """The attributes of one Resize/Upsample node, with each opset's defaults applied."""

    mode: str = "nearest"
    coordinate_mode: str = "half_pixel"
    nearest_mode: str = "round_prefer_floor"
    cubic_a: float = -0.75
    exclude_outside: bool = False
    extrapolation_value: float = 0.0
    antialias: bool = False
    legacy: bool = False  # Upsample and Resize-10: asymmetric; nearest rounds up when downsampling, else down


def _resize_options(ctx, op: str) -> _ResizeOptions:
    mode = ctx.attr("mode", "nearest")
    if mode == "bilinear":
        mode = "linear"
    if op == "Upsample" or ctx.opset < 11:
        return _ResizeOptions(mode=mode, coordinate_mode="asymmetric", legacy=True)
    return _ResizeOptions(
        mode=mode,
        coordinate_mode=ctx.attr("coordinate_transformation_mode", "half_pixel"),
        nearest_mode=ctx.attr("nearest_mode", "round_prefer_floor"),
        cubic_a=float(ctx.attr("cubic_coeff_a", -0.75)),
        exclude_outside=bool(ctx.attr("exclude_outside", 0)),
        extrapolation_value=float(ctx.attr("extrapolation_value", 0.0)),
        antialias=bool(ctx.attr("antialias", 0)) if ctx.opset >= 18 else False,
    )


def _resize_axes(ctx, rank: int) -> list[int]:
    axes = ctx.attr("axes", None) if ctx.opset >= 18 else None
    if not axes:
        return list(range(rank))
    return [normalize_axis(int(a), rank) for a in axes]


def _input_slots(ctx, op: str) -> tuple[int | None, int | None, int | None]:
    """(roi, scales, sizes) input positions of Resize/Upsample at this opset."""
    if op == "Upsample":
        return None, (1 if ctx.opset >= 9 else None), None
    if ctx.opset < 11:
        return None, 1, None
    return 1, 2, 3


def _scaled_dim(n: Dim, scale: float) -> Dim:
    """floor(n * scale), exact for the float32 scale (as the spec and onnx's inference do)."""
    if isinstance(n, int):
        return int(math.floor(n * float(scale)))
    return _dim(sympy.floor(sympy.sympify(n) * sympy.Rational(float(scale))))


def _resize_plan(shape: Sequence[int], axes: Sequence[int], scales, sizes, policy: str):
    """(output shape, per-axis scale factors) of a concrete Resize."""
    rank = len(shape)
    out = list(shape)
    factors = [1.0] * rank
    if sizes is not None:
        for i, a in enumerate(axes):
            out[a] = int(sizes[i])
            factors[a] = out[a] / shape[a] if shape[a] else 1.0
        if policy != "stretch":
            ratios = [int(sizes[i]) / shape[a] for i, a in enumerate(axes)]
            common = min(ratios) if policy == "not_larger" else max(ratios)
            for a in axes:
                factors[a] = common
                out[a] = int(common * shape[a] + 0.5)
    else:
        for i, a in enumerate(axes):
            factors[a] = float(scales[i])
            out[a] = _scaled_dim(shape[a], factors[a])
    return out, factors


def _present(ctx, slot: int | None) -> bool:
    """True when an optional tensor input is given and not empty."""
    if slot is None or not ctx.has_input(slot):
        return False
    shape = ctx.types[slot].shape
    return not (shape is not None and len(shape) == 1 and shape[0] == 0)


def _resize_infer_for(op: str):
    def infer(ctx):
        x = ctx.types[0]
        if x.shape is None:
            return [TensorType(x.dtype, None)]
        rank = len(x.shape)
        axes = _resize_axes(ctx, rank) if op == "Resize" else list(range(rank))
        _, scales_slot, sizes_slot = _input_slots(ctx, op)
        out = list(x.shape)
        if _present(ctx, sizes_slot):
            sizes = ints_of(ctx, sizes_slot)
            policy = ctx.attr("keep_aspect_ratio_policy", "stretch") if ctx.opset >= 18 else "stretch"
            if sizes is not None and len(sizes) != len(axes):
                raise fail(ctx, f"{len(sizes)} sizes for {len(axes)} axes")
            if sizes is None or (policy != "stretch" and not all(
                    isinstance(v, int) for v in [*sizes, *(x.shape[a] for a in axes)])):
                for a in axes:
                    out[a] = ctx.fresh_dim()
            elif policy == "stretch":
                for i, a in enumerate(axes):
                    out[a] = sizes[i]
            else:
                out, _ = _resize_plan(x.shape, axes, None, sizes, policy)
            return [TensorType(x.dtype, tuple(out))]
        if scales_slot is None:
            scales = ctx.attr("scales", None)
        else:
            value = ctx.value(scales_slot)
            scales = None if value is None else np.asarray(value, dtype=np.float32).ravel().tolist()
        if scales is None or len(scales) == 0:
            for a in axes:
                out[a] = ctx.fresh_dim()
            return [TensorType(x.dtype, tuple(out))]
        if len(scales) != len(axes):
            raise fail(ctx, f"{len(scales)} scales for {len(axes)} axes")
        for i, a in enumerate(axes):
            out[a] = _scaled_dim(x.shape[a], float(np.float32(scales[i])))
        return [TensorType(x.dtype, tuple(out))]

    return infer


def _source_coords(opts: _ResizeOptions, out_len: int, in_len: int, scale: float,
                   roi: tuple[float, float]) -> np.ndarray:
    """x_original for every output index along one axis (coordinate_transformation_mode)."""
    x = np.arange(out_len, dtype=np.float64)
    mode = opts.coordinate_mode
    if mode == "asymmetric":
        return x / scale
    if mode == "half_pixel":
        return (x + 0.5) / scale - 0.5
    if mode == "pytorch_half_pixel":
        return (x + 0.5) / scale - 0.5 if out_len > 1 else np.zeros(out_len)
    if mode == "half_pixel_symmetric":
        offset = in_len / 2 * (1 - out_len / (scale * in_len))
        return offset + (x + 0.5) / scale - 0.5
    if mode == "tf_half_pixel_for_nn":
        return (x + 0.5) / scale
    if mode == "align_corners":
        # The ONNX test suite divides by the fractional target width scale * in_len.
        width = scale * in_len
        return np.zeros(out_len) if width == 1 else x * (in_len - 1) / (width - 1)
    if mode == "tf_crop_and_resize":
        # The roi is float32: its start offset and span are float32 values (as in onnxruntime and
        # onnx.reference), so a start of 0.1 on 6 pixels lands exactly on 0.5.
        start, end = np.float32(roi[0]), np.float32(roi[1])
        origin, span = float(start * np.float32(in_len - 1)), float(end - start)
        if out_len == 1:
            return np.full(out_len, origin + span * (in_len - 1) / 2)
        return origin + x * span * (in_len - 1) / (out_len - 1)
    raise ValueError(f"unknown coordinate_transformation_mode {mode!r}")


def _nearest_index(opts: _ResizeOptions, coords: np.ndarray, scale: float) -> np.ndarray:
    if opts.legacy:  # Upsample / Resize-10: round up when downsampling, truncate when upsampling
        index = np.ceil(coords) if scale < 1 else np.floor(coords)
    elif opts.nearest_mode == "round_prefer_floor":
        index = np.ceil(coords - 0.5)
    elif opts.nearest_mode == "round_prefer_ceil":
        index = np.floor(coords + 0.5)
    elif opts.nearest_mode == "floor":
        index = np.floor(coords)
    elif opts.nearest_mode == "ceil":
        index = np.ceil(coords)
    else:
        raise ValueError(f"unknown nearest_mode {opts.nearest_mode!r}")
    return index.astype(np.int64)


def _cubic_kernel(a: float) -> Callable[[np.ndarray], np.ndarray]:
    def kernel(t: np.ndarray) -> np.ndarray:
        t = np.abs(t)
        near = ((a + 2) * t - (a + 3)) * t * t + 1
        far = ((a * t - 5 * a) * t + 8 * a) * t - 4 * a
        return np.where(t <= 1, near, np.where(t < 2, far, 0.0))

    return kernel


def _linear_kernel(t: np.ndarray) -> np.ndarray:
    return np.clip(1 - np.abs(t), 0, 1)


def _interpolation_taps(opts: _ResizeOptions, coords: np.ndarray, in_len: int, scale: float):
    """(indices, weights), both (out_len, taps): the input positions each output reads and
    their weights, for linear or cubic (antialiased: the kernel stretched by 1/scale)."""
    support, kernel = (1, _linear_kernel) if opts.mode == "linear" else (2, _cubic_kernel(opts.cubic_a))
    stretch = min(scale, 1.0) if opts.antialias else 1.0
    if opts.mode == "linear" and not opts.antialias:
        # Beyond the edge linear reads the edge value: clamping the coordinate gives it exactly
        # (as onnxruntime does), where two taps on the same clamped index would round it.
        coords = np.clip(coords, 0, max(in_len - 1, 0))
    start = math.floor(-support / stretch) + 1
    count = 2 - 2 * start
    base = np.floor(coords)
    base = np.where(base == coords, coords - 1, base)  # an exact integer reads with ratio 1
    ratio = coords - base
    offsets = np.arange(start, start + count, dtype=np.float64)
    weights = kernel((offsets[None, :] - ratio[:, None]) * stretch)
    if opts.antialias:
        weights = weights / weights.sum(axis=1, keepdims=True)
    index = base.astype(np.int64)[:, None] + offsets.astype(np.int64)[None, :]
    if opts.exclude_outside:
        weights = np.where((index < 0) | (index >= in_len), 0.0, weights)
        total = weights.sum(axis=1, keepdims=True)
        weights = weights / np.where(total == 0, 1.0, total)
    return np.clip(index, 0, in_len - 1), weights


def _resample_axis(x: np.ndarray, axis: int, out_len: int, scale: float, roi: tuple[float, float],
                   opts: _ResizeOptions, work: np.dtype) -> tuple[np.ndarray, np.ndarray | None]:
    """Resize ``x`` along one axis; also the mask of outputs outside the input (crop mode)."""
    in_len = x.shape[axis]
    coords = _source_coords(opts, out_len, in_len, scale, roi)
    outside = None
    if opts.coordinate_mode == "tf_crop_and_resize":
        outside = (coords < 0) | (coords > in_len - 1)
    if opts.mode == "nearest":
        index = np.clip(_nearest_index(opts, coords, scale), 0, max(in_len - 1, 0))
        return np.take(x, index, axis=axis), outside
    index, weights = _interpolation_taps(opts, coords, in_len, scale)
    shape = [1] * x.ndim
    shape[axis] = out_len
    result = None
    for t in range(index.shape[1]):
        term = np.take(x, index[:, t], axis=axis) * weights[:, t].astype(work).reshape(shape)
        result = term if result is None else result + term
    return result, outside


def resize_array(x: np.ndarray, out_shape: Sequence[int], factors: Sequence[float], opts: _ResizeOptions,
                 roi: Sequence[float] | None = None) -> np.ndarray:
    """``x`` resized to ``out_shape`` with the per-axis ``factors`` (roi: starts then ends)."""
    rank = x.ndim
    roi = list(roi) if roi is not None and len(roi) == 2 * rank else [0.0] * rank + [1.0] * rank
    nearest = opts.mode == "nearest"
    work = x.dtype if nearest else (np.dtype(np.float64) if x.dtype == np.float64 or not np.issubdtype(
        x.dtype, np.floating) else np.dtype(np.float32))
    y = x if nearest else x.astype(work, copy=False)
    outside_masks = []
    for axis in range(rank):
        span = (float(roi[axis]), float(roi[rank + axis]))
        crop = opts.coordinate_mode == "tf_crop_and_resize"
        if out_shape[axis] == x.shape[axis] and factors[axis] == 1.0 and (not crop or span == (0.0, 1.0)):
            continue
        y, outside = _resample_axis(y, axis, int(out_shape[axis]), float(factors[axis]), span, opts, work)
        if outside is not None and outside.any():
            outside_masks.append(outside.reshape([-1 if j == axis else 1 for j in range(rank)]))
    if outside_masks:
        mask = np.logical_or.reduce(np.broadcast_arrays(*outside_masks)) if len(outside_masks) > 1 \
            else outside_masks[0]
        y = np.where(mask, np.asarray(opts.extrapolation_value, dtype=y.dtype), y)
    if y.dtype != x.dtype:
        if np.issubdtype(x.dtype, np.integer):
            info = np.iinfo(x.dtype)
            y = np.clip(np.round(y), info.min, info.max)
        y = y.astype(x.dtype)
    return y


def _resize_for(op: str):
    def compute(ctx, x, *rest):
        opts = _resize_options(ctx, op)
        roi_slot, scales_slot, sizes_slot = _input_slots(ctx, op)

        def arg(slot):
            if slot is None or slot - 1 >= len(rest) or rest[slot - 1] is None:
                return None
            value = np.asarray(rest[slot - 1]).ravel()
            return value if value.size else None

        axes = _resize_axes(ctx, x.ndim) if op == "Resize" else list(range(x.ndim))
        sizes = arg(sizes_slot)
        scales = ctx.attr("scales") if scales_slot is None else arg(scales_slot)
        policy = ctx.attr("keep_aspect_ratio_policy", "stretch") if op == "Resize" and ctx.opset >= 18 \
            else "stretch"
        if sizes is not None:
            out, factors = _resize_plan(x.shape, axes, None, [int(v) for v in sizes], policy)
        elif scales is None:
            raise ValueError("neither scales nor sizes is given")
        else:
            scales32 = [float(np.float32(s)) for s in scales]
            out, factors = _resize_plan(x.shape, axes, scales32, None, "stretch")
        roi = arg(roi_slot)
        full_roi = None
        if roi is not None and opts.coordinate_mode == "tf_crop_and_resize":
            full_roi = [0.0] * x.ndim + [1.0] * x.ndim
            k = len(axes)
            for i, a in enumerate(axes):
                full_roi[a], full_roi[x.ndim + a] = float(roi[i]), float(roi[k + i])
        return [resize_array(x, out, factors, opts, full_roi)]

    return compute


register_op("Resize", infer=_resize_infer_for("Resize"), compute=_resize_for("Resize"),
            doc="resample with scales or sizes: nearest/linear/cubic, coordinate modes, antialias, axes")
register_op("Upsample", infer=_resize_infer_for("Upsample"), compute=_resize_for("Upsample"),
            doc="resample by scales (asymmetric nearest or linear); Resize's predecessor")


# ---- DepthToSpace and SpaceToDepth ------------------------------------------------------------
def _div_dim(ctx, d: Dim, k: int, what: str) -> Dim:
    if isinstance(d, int):
        if d % k:
            raise fail(ctx, f"{what} {d} is not divisible by {k}")
        return d // k
    return _dim(sympy.sympify(d) / k)


def _depth_to_space_infer(ctx):
    shape = require_shape(ctx, 0)
    if len(shape) != 4:
        raise fail(ctx, f"the input has rank {len(shape)}; DepthToSpace needs N x C x H x W")
    b = ctx.attr("blocksize")
    n, c, h, w = shape
    return [TensorType(ctx.types[0].dtype, (n, _div_dim(ctx, c, b * b, "the channel count"), _mul_dim(h, b),
                                             _mul_dim(w, b)))]


def _depth_to_space(ctx, x):
    b = ctx.attr("blocksize")
    n, c, h, w = x.shape
    mode = ctx.attr("mode", "DCR")
    if mode == "DCR":
        tmp = x.reshape(n, b, b, c // (b * b), h, w).transpose(0, 3, 4, 1, 5, 2)
    else:
        tmp = x.reshape(n, c // (b * b), b, b, h, w).transpose(0, 1, 4, 2, 5, 3)
    return [tmp.reshape(n, c // (b * b), h * b, w * b)]


def _space_to_depth_infer(ctx):
    shape = require_shape(ctx, 0)
    if len(shape) != 4:
        raise fail(ctx, f"the input has rank {len(shape)}; SpaceToDepth needs N x C x H x W")
    b = ctx.attr("blocksize")
    n, c, h, w = shape
    return [TensorType(ctx.types[0].dtype, (n, _mul_dim(c, b * b), _div_dim(ctx, h, b, "the height"),
                                             _div_dim(ctx, w, b, "the width")))]


def _space_to_depth(ctx, x):
    b = ctx.attr("blocksize")
    n, c, h, w = x.shape
    order = (0, 3, 5, 1, 2, 4) if ctx.attr("mode", "DCR") == "DCR" else (0, 1, 3, 5, 2, 4)
    tmp = x.reshape(n, c, h // b, b, w // b, b).transpose(order)
    return [tmp.reshape(n, c * b * b, h // b, w // b)]


register_op("DepthToSpace", infer=_depth_to_space_infer, compute=_depth_to_space,
            doc="move channel blocks into blocksize x blocksize spatial tiles (DCR or CRD order)")
register_op("SpaceToDepth", infer=_space_to_depth_infer, compute=_space_to_depth,
            doc="move blocksize x blocksize spatial tiles into channels (DCR or CRD order)")


# ---- LRN -----------------------------------------------------------------------------------------
def _lrn(ctx, x):
    """y = x / (bias + alpha/size * sum of x^2 over the channel window)^beta, where the window
    of channel c is [c - floor((size-1)/2), c + ceil((size-1)/2)] clipped to the channels."""
    size = int(ctx.attr("size"))
    alpha, beta, bias = float(ctx.attr("alpha", 1e-4)), float(ctx.attr("beta", 0.75)), float(ctx.attr("bias", 1.0))
    work = _work_dtype(x.dtype)
    xw = x.astype(work, copy=False)
    squares = xw * xw
    before, after = (size - 1) // 2, size - 1 - (size - 1) // 2
    widths = [(0, 0)] * x.ndim
    widths[1] = (before, after)
    padded = np.pad(squares, widths)
    channels = x.shape[1]
    total = np.zeros_like(squares)
    for t in range(size):
        total += padded[:, t:t + channels]
    return [(xw / (bias + (alpha / size) * total) ** beta).astype(x.dtype, copy=False)]


register_op("LRN", infer=same_as(0), compute=_lrn, doc="local response normalization across channels")


# ---- CenterCropPad -------------------------------------------------------------------------------
def _crop_axes(ctx, rank: int) -> list[int]:
    axes = ctx.attr("axes", None)
    if not axes:
        return list(range(rank))
    return [normalize_axis(int(a), rank) for a in axes]


def _center_crop_pad_infer(ctx):
    x = ctx.types[0]
    if x.shape is None:
        return [TensorType(x.dtype, None)]
    rank = len(x.shape)
    target = ints_of(ctx, 1)
    axes = _crop_axes(ctx, rank)
    out = list(x.shape)
    if target is None:
        for a in axes:
            out[a] = ctx.fresh_dim()
        return [TensorType(x.dtype, tuple(out))]
    if len(target) != len(axes):
        raise fail(ctx, f"{len(target)} target dims for {len(axes)} axes")
    for a, t in zip(axes, target):
        out[a] = t
    return [TensorType(x.dtype, tuple(out))]


def _center_crop_pad(ctx, x, shape):
    """Center each listed axis in its target length: crop (start rounded down) or zero-pad
    (the odd pixel at the end)."""
    target = [int(t) for t in np.asarray(shape).ravel()]
    axes = _crop_axes(ctx, x.ndim)
    out_shape = list(x.shape)
    src, dst = [slice(None)] * x.ndim, [slice(None)] * x.ndim
    for a, t in zip(axes, target):
        n = x.shape[a]
        out_shape[a] = t
        if t <= n:
            start = (n - t) // 2
            src[a] = slice(start, start + t)
        else:
            start = (t - n) // 2
            dst[a] = slice(start, start + n)
    y = np.zeros(out_shape, dtype=x.dtype)
    y[tuple(dst)] = x[tuple(src)]
    return [y]


register_op("CenterCropPad", infer=_center_crop_pad_infer, compute=_center_crop_pad,
            doc="center-crop or zero-pad the listed axes to the target shape")


# ---- public entry points for ops built on Conv (the com.egraft FusedConv in fused.py) -------------
def conv_infer(ctx) -> list[TensorType]:
    """Conv's shape inference on inputs X, W, reading Conv's attributes from ``ctx``."""
    return _conv_infer(ctx)


def conv_compute(ctx, x: np.ndarray, w: np.ndarray, b: np.ndarray | None = None) -> list[np.ndarray]:
    """Conv's kernel (the result in ``x``'s dtype), reading Conv's attributes from ``ctx``."""
    return _conv(ctx, x, w, b)

"""Winograd F(2x2, 3x3) convolution, egraft-only ops (domain ``com.egraft``) that the
``specialization`` rules offer as an alternative form of a 3x3 stride-1 Conv:

- ``WinogradWeights(W)``: the transformed filters ``U = G W G^T`` per (output, input) channel
  pair, ``[O, I, 3, 3] -> [O, I, 4, 4]``. Its input is a constant in practice, so the folding
  rules evaluate it at compile time.
- ``WinogradConv(X, W, U?, B?)``: ``act(Conv(X, W, B))`` for a 2-D 3x3 kernel with unit strides
  and dilations and one group (``activation`` as FusedConv's, default none), computed by
  Winograd's algorithm: each 4x4 input tile ``d`` becomes
  ``V = B^T d B``, the elementwise products ``U * V`` are summed over the input channels (16
  matrix products) and each sum ``M`` gives a 2x2 output tile ``A^T M A``. ``U`` is
  ``WinogradWeights(W)``; when it is omitted the kernel computes it from ``W``.

WinogradConv keeps the ORIGINAL 3x3 weights as input 1 because the transform cannot be undone
(``U`` has 16 entries per filter, ``W`` 9): its ONNX definition (the exported function body) is
the plain ``Conv(X, W, B)``, and ``U`` is an unused input of that function. ``U`` comes before
the optional bias so that a rule can build the bias-less form ``WinogradConv(x, w, U)``. Example::

    y = WinogradConv(x, w, WinogradWeights(w), b) {pads = [1, 1, 1, 1]}   # == Conv(x, w, b) {pads}
"""

from __future__ import annotations

import numpy as np
import onnx
from numpy.lib.stride_tricks import sliding_window_view

from egraft.ir.dims import dims_conflict
from egraft.ir.ops._common import fail, same_float_dtype
from egraft.ir.ops.fused import (
    CONV_ATTR_SPECS,
    CONV_ATTRS,
    DOMAIN,
    _activate,
    _activation_attrs,
    _Body,
    _check_activation,
    _set_attrs,
    _work_dtype,
)
from egraft.ir.ops.nn_spatial import _window, conv_infer
from egraft.ir.registry import InferContext, register_op
from egraft.ir.types import TensorType

#: F(2x2, 3x3) transforms (Lavin & Gray, 2016): input ``B^T``, filter ``G``, output ``A^T``.
WINOGRAD_BT = np.array([[1, 0, -1, 0], [0, 1, 1, 0], [0, -1, 1, 0], [0, 1, 0, -1]], dtype=np.float64)
WINOGRAD_G = np.array([[1, 0, 0], [0.5, 0.5, 0.5], [0.5, -0.5, 0.5], [0, 0, 1]], dtype=np.float64)
WINOGRAD_AT = np.array([[1, 1, 1, 0], [0, 1, -1, -1]], dtype=np.float64)
#: Output tile and input tile sizes of F(2x2, 3x3).
TILE_OUT, TILE_IN = 2, 4



# ---- numpy ------------------------------------------------------------------------------------
def winograd_weights(w: np.ndarray) -> np.ndarray:
    """``G w G^T`` for every 3x3 filter of ``w`` ([O, I, 3, 3] -> [O, I, 4, 4]), in ``w``'s dtype
    (computed in float32, or float64 for float64).

    Example:
        >>> float(winograd_weights(np.ones((1, 1, 3, 3), np.float32))[0, 0, 1, 1])
        2.25
    """
    work = _work_dtype(w.dtype)
    # one product of the 9 taps of every filter by the 9 x 16 matrix kron(G, G)^T: no transposed
    # copies (512 x 512 filters: 6 ms, against 56-130 ms for two tensordots; ResNet-50's
    # saturation folds 52 of them)
    kron = np.einsum("ia,jb->abij", WINOGRAD_G, WINOGRAD_G).reshape(9, 16).astype(work)
    out = w.astype(work, copy=False).reshape(-1, 9) @ kron
    return out.reshape(*w.shape[:2], 4, 4).astype(w.dtype, copy=False)


def winograd_conv2d(x: np.ndarray, u: np.ndarray, outs: tuple[int, int], begins: tuple[int, int]) -> np.ndarray:
    """The 3x3 stride-1 cross-correlation of ``x`` [N, C, H, W] by the filters whose transforms are
    ``u`` [O, C, 4, 4], for output size ``outs`` with ``begins`` zero rows/columns padded first.

    The input is zero-padded to whole 4x4 tiles overlapping by 2; the extra output rows and columns
    of the last tiles are cropped. Computes in ``x``'s dtype.
    """
    n, c, h, wdt = x.shape
    o = u.shape[0]
    tiles_h, tiles_w = -(-outs[0] // TILE_OUT), -(-outs[1] // TILE_OUT)
    need_h, need_w = TILE_OUT * tiles_h + 2, TILE_OUT * tiles_w + 2
    widths = ((0, 0), (0, 0), (begins[0], max(0, need_h - begins[0] - h)),
              (begins[1], max(0, need_w - begins[1] - wdt)))
    xp = np.pad(x, widths)[:, :, :need_h, :need_w]
    d = sliding_window_view(xp, (TILE_IN, TILE_IN), axis=(2, 3))[:, :, ::TILE_OUT, ::TILE_OUT]
    bt = WINOGRAD_BT.astype(x.dtype)
    v = bt @ d @ bt.T  # [N, C, th, tw, 4, 4]
    v = v.transpose(4, 5, 1, 0, 2, 3).reshape(TILE_IN * TILE_IN, c, n * tiles_h * tiles_w)
    uu = u.astype(x.dtype, copy=False).transpose(2, 3, 0, 1).reshape(TILE_IN * TILE_IN, o, c)
    m = np.matmul(uu, v).reshape(TILE_IN, TILE_IN, o, n, tiles_h, tiles_w).transpose(3, 2, 4, 5, 0, 1)
    at = WINOGRAD_AT.astype(x.dtype)
    y = at @ m @ at.T  # [N, O, th, tw, 2, 2]
    y = y.transpose(0, 1, 2, 4, 3, 5).reshape(n, o, TILE_OUT * tiles_h, TILE_OUT * tiles_w)
    return np.ascontiguousarray(y[:, :, :outs[0], :outs[1]])


# ---- WinogradWeights ----------------------------------------------------------------------------
def _weights_infer(ctx: InferContext) -> list[TensorType]:
    dtype = same_float_dtype(ctx)
    shape = ctx.types[0].shape
    if shape is None:
        return [TensorType(dtype, None)]
    if len(shape) != 4 or dims_conflict(shape[2], 3) or dims_conflict(shape[3], 3):
        raise fail(ctx, f"W has shape {list(shape)}; WinogradWeights takes 3x3 filters [O, I, 3, 3]")
    return [TensorType(dtype, (shape[0], shape[1], TILE_IN, TILE_IN))]


def _weights_compute(ctx, w):
    return [winograd_weights(w)]


def _weights_function(node) -> onnx.FunctionProto:
    body = _Body(node, ["W"])
    g = body.add("Constant", value=onnx.numpy_helper.from_array(WINOGRAD_G.astype(body.work.numpy)))
    gt = body.add("Constant", value=onnx.numpy_helper.from_array(WINOGRAD_G.T.astype(body.work.numpy)))
    return body.function(body.add("MatMul", body.add("MatMul", g, body.input(0)), gt))


register_op(
    "WinogradWeights", domain=DOMAIN,
    infer=_weights_infer, compute=_weights_compute, onnx_function=_weights_function, folded_only=True,
    doc="G W G^T per 3x3 filter ([O, I, 3, 3] -> [O, I, 4, 4]): the Winograd F(2x2, 3x3) filter transform")


# ---- WinogradConv -------------------------------------------------------------------------------
def _check_geometry(ctx: InferContext) -> None:
    """3x3 kernel, unit strides and dilations, one group: what F(2x2, 3x3) computes."""
    w = ctx.types[1].shape
    if w is not None and (len(w) != 4 or dims_conflict(w[2], 3) or dims_conflict(w[3], 3)):
        raise fail(ctx, f"W has shape {list(w)}; WinogradConv takes 3x3 filters [O, I, 3, 3]")
    kernel = ctx.attr("kernel_shape", None)
    strides, dilations = ctx.attr("strides", None), ctx.attr("dilations", None)
    if (kernel and list(kernel) != [3, 3]) or (strides and list(strides) != [1, 1]) \
            or (dilations and list(dilations) != [1, 1]) or ctx.attr("group", 1) != 1:
        raise fail(ctx, f"kernel_shape {kernel}, strides {strides}, dilations {dilations}, group "
                        f"{ctx.attr('group', 1)}: WinogradConv needs a 3x3 kernel, unit strides and "
                        "dilations and one group")


def _conv_infer(ctx: InferContext) -> list[TensorType]:
    same_float_dtype(ctx)
    _check_geometry(ctx)
    _check_activation(ctx)
    out = conv_infer(ctx)[0]
    if ctx.has_input(3) and ctx.types[3].shape is not None:
        b = ctx.types[3].shape
        if len(b) != 1 or (out.shape is not None and dims_conflict(b[0], out.shape[1])):
            raise fail(ctx, f"the bias has shape {list(b)}; it must be 1-D with one entry per output channel")
    w, u = ctx.types[1].shape, ctx.types[2].shape if ctx.has_input(2) else None
    if w is not None and u is not None and (len(u) != 4 or any(dims_conflict(a, b) for a, b in
                                                               zip(u, (w[0], w[1], TILE_IN, TILE_IN)))):
        raise fail(ctx, f"U has shape {list(u)}; for W of shape {list(w)} it must be "
                        f"[{w[0]}, {w[1]}, {TILE_IN}, {TILE_IN}] (WinogradWeights(W))")
    return [out]


def _conv_compute(ctx, x, w, u=None, b=None):
    """act(Conv(X, W, B)) by F(2x2, 3x3), with ``u`` = WinogradWeights(W) when given."""
    work = _work_dtype(x.dtype)
    outs, begins, _ = _window(ctx, [3, 3]).resolve(x.shape[2:])
    u = winograd_weights(w.astype(work, copy=False)) if u is None else u.astype(work, copy=False)
    y = winograd_conv2d(x.astype(work, copy=False), u, (outs[0], outs[1]), (begins[0], begins[1]))
    if b is not None:
        y += b.astype(work, copy=False).reshape(1, -1, 1, 1)
    return [_activate(ctx, y).astype(x.dtype, copy=False)]


def _conv_function(node) -> onnx.FunctionProto:
    body = _Body(node, ["X", "W", "U", "B"])
    inputs = [body.input(0), body.input(1)] + ([body.input(3)] if body.has(3) else [])
    return body.function(body.activation(body.add("Conv", *inputs, **_set_attrs(node, CONV_ATTRS))))


register_op(
    "WinogradConv", domain=DOMAIN,
    attrs={**CONV_ATTR_SPECS, **_activation_attrs()},  # inference accepts only 3x3, stride 1, dilation 1, group 1
    infer=_conv_infer, compute=_conv_compute, onnx_function=_conv_function,
    doc="act(Conv(X, W, B)) with a 3x3 stride-1 kernel by Winograd F(2x2, 3x3); U = WinogradWeights(W) "
        "optional")

"""egraft-only layout ops (domain ``com.egraft``): the same convolution over other memory layouts,
created by egraft/rules/layout.rules as alternatives beside the standard NCHW Conv:

- ``ConvNHWC(X, W, B?)``: Conv on channels-last tensors, ``X [N, *S, C] -> Y [N, *S', M]``; the
  weights stay in ONNX layout ``[M, C/group, *K]``; every Conv attribute;
- ``LayoutToBlocked(X) {block}``: ``[N, C, *S] -> [N, C/block, *S, block]``, channel ``c`` going to
  block ``c // block``, lane ``c % block`` (C must be a known multiple of ``block``);
- ``LayoutFromBlocked(Y) {block}``: its inverse, ``[N, C/block, *S, block] -> [N, C, *S]``;
- ``ConvNCHWc(Xb, W, B?, Z?) {block, activation}``: Conv on channel-blocked input and output,
  ``[N, C/block, *S, block] -> [N, M/block, *S', block]`` (M must be a multiple of ``block`` too),
  with FusedConv's epilogue: ``act(Conv(Xb, W, B) + Z)``, ``Z`` in the output's blocked layout, so a
  chain of fused convolutions can stay blocked;
- ``PreActConvNCHWc(Xb, W, S, T, B?) {block, activation}``: ConvNCHWc of ``Relu(Xb * S + T)``, ``S`` and
  ``T`` per-channel constants in the blocked layout (``[1, C/block, 1, 1, block]``): a pre-activation
  (BatchNormalization and ReLU, as DenseNet and pre-activation ResNets apply them before each
  convolution) computed as the convolution reads its input, instead of by a pass of its own.

The convolutions reuse Conv's own inference and kernel (``conv_infer``/``conv_compute`` of
nn_spatial) on the standard layout, with the layout changes around them, so no shape rule is
written twice. Each op's ``onnx_function`` is the same in standard opset-18 ops: Transpose, Conv,
Transpose; Reshape and Transpose for the blocked conversions. For a half-precision conv the body
casts to float32 and back, as the kernel computes.

Example:
    >>> blocked_shape((sym("batch"), 16, 7, 7), 8)
    (batch, 2, 7, 7, 8)
"""

from __future__ import annotations

import copy
from collections.abc import Sequence

import numpy as np
import onnx
from onnx import helper, numpy_helper

from egraft.ir.dims import Dim, dims_conflict
from egraft.ir.ops._common import fail, same_float_dtype
from egraft.ir.ops.fused import (
    CONV_ATTR_SPECS,
    CONV_ATTRS,
    _activate,
    _activation_attrs,
    _add_to,
    _as_work,
    _check_activation,
    _check_addend,
    _node_attr,
    _work_dtype,
)
from egraft.ir.ops.fused import _Body as _FusedBody
from egraft.ir.ops.nn_spatial import conv_compute, conv_infer
from egraft.ir.registry import AttrSpec, InferContext, register_op
from egraft.ir.types import TensorType

DOMAIN = "com.egraft"
#: The default-domain opset the function bodies are written in.
FUNCTION_OPSET = 18
#: The default channel block of the blocked layout (8 float32 lanes: one AVX2 register).
DEFAULT_BLOCK = 8

_BLOCK_SPEC = AttrSpec("int", DEFAULT_BLOCK, "channels per block (the last axis of the blocked layout)")


# ---- permutations and shapes --------------------------------------------------------------------
def to_channels_last(rank: int) -> list[int]:
    """The Transpose perm from ``[N, C, *S]`` to ``[N, *S, C]``: ``to_channels_last(4) == [0, 2, 3, 1]``."""
    return [0, *range(2, rank), 1]


def to_channels_first(rank: int) -> list[int]:
    """The Transpose perm from ``[N, *S, C]`` to ``[N, C, *S]``: ``to_channels_first(4) == [0, 3, 1, 2]``."""
    return [0, rank - 1, *range(1, rank - 1)]


def blocked_shape(shape: Sequence[Dim], block: int) -> tuple[Dim, ...]:
    """``[N, C, *S] -> [N, C/block, *S, block]``; raises ValueError unless C is a known multiple of block.

    Example: ``blocked_shape((2, 16, 5, 5), 8) == (2, 2, 5, 5, 8)``.
    """
    if len(shape) < 2:
        raise ValueError(f"the blocked layout needs [N, C, ...], got shape {list(shape)}")
    c = shape[1]
    if not isinstance(c, int) or c % block:
        raise ValueError(f"the channel dim {c} of shape {list(shape)} is not a known multiple of block {block}")
    return (shape[0], c // block, *shape[2:], block)


def unblocked_shape(shape: Sequence[Dim], block: int) -> tuple[Dim, ...]:
    """``[N, C/block, *S, block] -> [N, C, *S]``; raises ValueError unless the last dim is ``block``.

    Example: ``unblocked_shape((2, 2, 5, 5, 8), 8) == (2, 16, 5, 5)``.
    """
    if len(shape) < 3:
        raise ValueError(f"a blocked tensor is [N, C/block, ..., block], got shape {list(shape)}")
    if dims_conflict(shape[-1], block) or not isinstance(shape[-1], int):
        raise ValueError(f"the last dim of the blocked shape {list(shape)} must be the block {block}")
    return (shape[0], shape[1] * block, *shape[2:-1])


def to_blocked(x: np.ndarray, block: int) -> np.ndarray:
    """``x [N, C, *S]`` as ``[N, C/block, *S, block]``: ``y[n, c // block, *s, c % block] = x[n, c, *s]``."""
    n, c = x.shape[:2]
    if c % block:
        raise ValueError(f"{c} channels are not a multiple of block {block}")
    split = x.reshape(n, c // block, block, *x.shape[2:])
    return np.ascontiguousarray(np.moveaxis(split, 2, -1))


def from_blocked(y: np.ndarray, block: int) -> np.ndarray:
    """The inverse of :func:`to_blocked`: ``[N, C/block, *S, block] -> [N, C, *S]``."""
    if y.ndim < 3 or y.shape[-1] != block:
        raise ValueError(f"a blocked array of block {block} must end in {block}, got shape {list(y.shape)}")
    lanes = np.moveaxis(y, -1, 2)
    return np.ascontiguousarray(lanes.reshape(y.shape[0], y.shape[1] * block, *y.shape[2:-1]))


# ---- inference helpers --------------------------------------------------------------------------
def _block(ctx) -> int:
    block = ctx.attr("block", DEFAULT_BLOCK)
    if not isinstance(block, int | np.integer) or block < 1:
        raise fail(ctx, f"block must be a positive integer, got {block!r}")
    return int(block)


def _shape_of(ctx: InferContext, index: int, min_rank: int, what: str) -> tuple[Dim, ...]:
    shape = ctx.types[index].shape
    if shape is None:
        raise fail(ctx, f"the rank of {what} must be known")
    if len(shape) < min_rank:
        raise fail(ctx, f"{what} has shape {list(shape)}; it needs rank >= {min_rank}")
    return shape


def _standard_conv_shape(ctx: InferContext, x_nchw: tuple[Dim, ...]) -> tuple[Dim, ...]:
    """Conv's inferred output shape for an NCHW input of shape ``x_nchw`` (the node's W, B and attrs)."""
    standard = copy.copy(ctx)
    standard.types = [TensorType(ctx.types[0].dtype, x_nchw), *ctx.types[1:]]
    out = conv_infer(standard)[0]
    if ctx.has_input(2) and ctx.types[2].shape is not None:
        b = ctx.types[2].shape
        if len(b) != 1 or dims_conflict(b[0], out.shape[1]):
            raise fail(ctx, f"the bias has shape {list(b)}; it must be 1-D with one entry per output channel")
    return out.shape


def _permute(shape: Sequence[Dim], perm: Sequence[int]) -> tuple[Dim, ...]:
    return tuple(shape[p] for p in perm)


# ---- ONNX function bodies -----------------------------------------------------------------------
class _Body(_FusedBody):
    """A FunctionProto under construction (FusedConv's, with the layout changes and an ``output``)."""

    def ints(self, values: Sequence[int]) -> str:
        """A constant int64 vector."""
        return self.add("Constant", value=numpy_helper.from_array(np.array(values, dtype=np.int64)))

    def to_blocked(self, x: str, shape: Sequence[Dim], block: int) -> str:
        """``[N, C, *S] -> [N, C/block, *S, block]`` (``shape`` is x's): Reshape to
        ``[N, C/block, block, *S]``, then Transpose."""
        rank = len(shape)
        if all(isinstance(d, int) for d in shape[1:]):  # a constant target: valid at every opset
            split = self.add("Reshape", x, self.ints([0, shape[1] // block, block, *shape[2:]]))
        else:
            target = self.add("Concat", self.add("Shape", x, end=1), self.ints([-1, block]),
                              self.add("Shape", x, start=2), axis=0)
            split = self.add("Reshape", x, target)
        return self.add("Transpose", split, perm=[0, 1, *range(3, rank + 1), 2])

    def from_blocked(self, y: str, shape: Sequence[Dim]) -> str:
        """``[N, C/block, *S, block] -> [N, C, *S]`` (``shape`` is y's, blocked)."""
        rank = len(shape)
        lanes = self.add("Transpose", y, perm=[0, 1, rank - 1, *range(2, rank - 1)])
        if all(isinstance(d, int) for d in shape[1:]):  # a constant target: valid at every opset
            return self.add("Reshape", lanes, self.ints([0, shape[1] * shape[-1], *shape[2:-1]]))
        target = self.add("Concat", self.add("Shape", lanes, end=1), self.ints([-1]), self.add("Shape", lanes, start=3),
                          axis=0)
        return self.add("Reshape", lanes, target)

    def conv(self, x: str, keep_work: bool = False) -> str:
        """Conv of ``x`` (NCHW) with the node's W, B and Conv attributes, computed in float32 for
        half precision and rounded back once (left in float32 with ``keep_work``, for an epilogue)."""
        half = self.dtype is not self.work
        operands = [self.add("Cast", x, to=self.work.value) if half else x]
        operands += [self.input(i) for i in (1, 2) if self.has(i)]
        attrs = {k: self.node.attrs[k] for k in CONV_ATTRS if self.node.attrs.get(k) not in (None, [], ())}
        y = self.add("Conv", *operands, **attrs)
        return self.add("Cast", y, to=self.dtype.value) if half and not keep_work else y

    def epilogue(self, y: str) -> str:
        """``act(y + Z)`` of the work-dtype ``y``, rounded to the node's dtype."""
        y = self.activation(self.add_optional(y, 3))
        return self.add("Cast", y, to=self.dtype.value) if self.dtype is not self.work else y

    def function(self, result: str) -> onnx.FunctionProto:
        self.nodes.append(helper.make_node("Identity", [result], ["output"]))
        return helper.make_function(DOMAIN, self.node.op, self.formals, ["output"], self.nodes,
                                    [helper.make_opsetid("", FUNCTION_OPSET)], attributes=sorted(self.node.attrs))


def _shape_for_export(node, index: int = 0) -> tuple[Dim, ...]:
    """Input ``index``'s shape, which must have a known rank to export the node."""
    shape = node.inputs[index].type.shape
    if shape is None:
        raise ValueError(f"{node.op}: the rank of input {index} must be known to export it")
    return tuple(shape)


def _rank_of(node, index: int = 0) -> int:
    return len(_shape_for_export(node, index))


# ---- ConvNHWC -----------------------------------------------------------------------------------
def _conv_nhwc_infer(ctx: InferContext) -> list[TensorType]:
    dtype = same_float_dtype(ctx)
    x = _shape_of(ctx, 0, 3, "X [N, *S, C]")
    out = _standard_conv_shape(ctx, _permute(x, to_channels_first(len(x))))
    return [TensorType(dtype, _permute(out, to_channels_last(len(out))))]


def _conv_nhwc(ctx, x, w, b=None):
    """Conv(X [N, *S, C], W [M, C/group, *K], B) -> [N, *S', M]."""
    y = conv_compute(ctx, np.transpose(x, to_channels_first(x.ndim)), w, b)[0]
    return [np.ascontiguousarray(np.transpose(y, to_channels_last(y.ndim)))]


def _conv_nhwc_function(node) -> onnx.FunctionProto:
    body = _Body(node, ["X", "W", "B"])
    rank = _rank_of(node)
    y = body.conv(body.add("Transpose", "X", perm=to_channels_first(rank)))
    return body.function(body.add("Transpose", y, perm=to_channels_last(rank)))


register_op(
    "ConvNHWC", domain=DOMAIN, attrs=dict(CONV_ATTR_SPECS),
    infer=_conv_nhwc_infer, compute=_conv_nhwc, onnx_function=_conv_nhwc_function,
    doc="Conv on channels-last tensors: X [N, *S, C], W [M, C/group, *K] -> [N, *S', M]")


# ---- LayoutToBlocked and LayoutFromBlocked ------------------------------------------------------
def _to_blocked_infer(ctx: InferContext) -> list[TensorType]:
    x = _shape_of(ctx, 0, 2, "X [N, C, ...]")
    try:
        return [TensorType(ctx.types[0].dtype, blocked_shape(x, _block(ctx)))]
    except ValueError as e:
        raise fail(ctx, str(e)) from None


def _from_blocked_infer(ctx: InferContext) -> list[TensorType]:
    y = _shape_of(ctx, 0, 3, "Y [N, C/block, ..., block]")
    try:
        return [TensorType(ctx.types[0].dtype, unblocked_shape(y, _block(ctx)))]
    except ValueError as e:
        raise fail(ctx, str(e)) from None


def _to_blocked_function(node) -> onnx.FunctionProto:
    body = _Body(node, ["X"])
    return body.function(body.to_blocked("X", _shape_for_export(node, 0), int(_node_attr(node, "block"))))


def _from_blocked_function(node) -> onnx.FunctionProto:
    body = _Body(node, ["Xb"])
    return body.function(body.from_blocked("Xb", _shape_for_export(node, 0)))


register_op(
    "LayoutToBlocked", domain=DOMAIN, attrs={"block": _BLOCK_SPEC},
    infer=_to_blocked_infer, compute=lambda ctx, x: [to_blocked(x, _block(ctx))],
    onnx_function=_to_blocked_function,
    doc="[N, C, *S] -> [N, C/block, *S, block]: channel c in block c // block, lane c % block")

register_op(
    "LayoutFromBlocked", domain=DOMAIN, attrs={"block": _BLOCK_SPEC},
    infer=_from_blocked_infer, compute=lambda ctx, y: [from_blocked(y, _block(ctx))],
    onnx_function=_from_blocked_function,
    doc="[N, C/block, *S, block] -> [N, C, *S]: the inverse of LayoutToBlocked")


# ---- ConvNCHWc ----------------------------------------------------------------------------------
def _nchw_input(xb_rank: int, w_rank: int | None) -> bool:
    """Whether ConvNCHWc's input is NCHW (``[N, C, *S]``, the rank of W) rather than blocked."""
    return w_rank is not None and xb_rank == w_rank


def _conv_nchwc_infer(ctx: InferContext) -> list[TensorType]:
    dtype = same_float_dtype(ctx)
    _check_activation(ctx)
    block = _block(ctx)
    xb = _shape_of(ctx, 0, 3, "Xb [N, C/block, *S, block] or X [N, C, *S]")
    w = ctx.types[1].shape
    try:
        x = tuple(xb) if _nchw_input(len(xb), None if w is None else len(w)) else unblocked_shape(xb, block)
        out = blocked_shape(_standard_conv_shape(ctx, x), block)
    except ValueError as e:
        raise fail(ctx, str(e)) from None
    _check_addend(ctx, 3, out, "Z")
    return [TensorType(dtype, out)]


def _conv_nchwc(ctx, xb, w, b=None, z=None):
    """act(Conv(Xb, W, B) + Z) into blocked tensors: Xb [N, C/block, *S, block] (or an NCHW
    X [N, C, *S]) -> [N, M/block, *S', block]."""
    block = _block(ctx)
    work = _work_dtype(xb.dtype)
    x = xb if _nchw_input(xb.ndim, w.ndim) else from_blocked(xb, block)
    y = conv_compute(ctx, _as_work(x, work), _as_work(w, work), _as_work(b, work))[0]
    y = _add_to(to_blocked(y, block), _as_work(z, work), "Z")
    return [_activate(ctx, y).astype(xb.dtype, copy=False)]


def _conv_nchwc_function(node) -> onnx.FunctionProto:
    body = _Body(node, ["Xb", "W", "B", "Z"])
    xb = _shape_for_export(node, 0)
    block = int(_node_attr(node, "block"))
    w = node.inputs[1].type.shape
    x = "Xb" if _nchw_input(len(xb), None if w is None else len(w)) else body.from_blocked("Xb", xb)
    y = body.conv(x, keep_work=True)
    y = body.to_blocked(y, unblocked_shape(node.outputs[0].type.shape, block), block)
    return body.function(body.epilogue(y))


register_op(
    "ConvNCHWc", domain=DOMAIN, attrs={**CONV_ATTR_SPECS, "block": _BLOCK_SPEC, **_activation_attrs()},
    infer=_conv_nchwc_infer, compute=_conv_nchwc, onnx_function=_conv_nchwc_function,
    doc="act(Conv(Xb, W, B) + Z) on channel-blocked tensors: Xb [N, C/block, *S, block] -> [N, M/block, *S', block]; "
        "X may also be NCHW [N, C, *S] (an image's few channels, read as they are)")


# ---- PreActConvNCHWc ----------------------------------------------------------------------------
def _channel_constant_shape(xb: Sequence[Dim]) -> tuple[Dim, ...]:
    """The blocked per-channel shape of ``Xb [N, C/block, *S, block]``: ``[1, C/block, 1.., block]``."""
    return (1, xb[1], *[1] * (len(xb) - 3), xb[-1])


def _pre_act_conv_infer(ctx: InferContext) -> list[TensorType]:
    dtype = same_float_dtype(ctx)
    _check_activation(ctx)
    block = _block(ctx)
    xb = _shape_of(ctx, 0, 3, "Xb [N, C/block, *S, block]")
    want = _channel_constant_shape(xb)
    for index, what in ((2, "the scale S"), (3, "the shift T")):
        shape = ctx.types[index].shape
        if shape is not None and (len(shape) != len(want) or any(dims_conflict(a, b) for a, b in zip(shape, want))):
            raise fail(ctx, f"{what} has shape {list(shape)}; it must be {list(want)} (one value per input channel, "
                            f"blocked)")
    standard = copy.copy(ctx)
    standard.types = [ctx.types[0], ctx.types[1], ctx.types[4] if ctx.has_input(4) else None]
    try:
        out = blocked_shape(_standard_conv_shape(standard, unblocked_shape(xb, block)), block)
    except ValueError as e:
        raise fail(ctx, str(e)) from None
    return [TensorType(dtype, out)]


def _pre_act_conv(ctx, xb, w, s, t, b=None):
    """act(Conv(Relu(Xb * S + T), W, B)) on blocked tensors."""
    work = _work_dtype(xb.dtype)
    pre = np.maximum(_as_work(xb, work) * _as_work(s, work) + _as_work(t, work), 0)
    return [y.astype(xb.dtype, copy=False) for y in _conv_nchwc(ctx, pre, w, b)]


def _pre_act_conv_function(node) -> onnx.FunctionProto:
    body = _Body(node, ["Xb", "W", "S", "T", "B"])
    xb = _shape_for_export(node, 0)
    pre = body.add("Relu", body.add("Add", body.add("Mul", body.input(0), body.input(2)), body.input(3)))
    x = body.from_blocked(pre, xb)
    attrs = {k: node.attrs[k] for k in CONV_ATTRS if node.attrs.get(k) not in (None, [], ())}
    y = body.add("Conv", x, body.input(1), *([body.input(4)] if body.has(4) else []), **attrs)
    block = int(_node_attr(node, "block"))
    y = body.to_blocked(y, unblocked_shape(node.outputs[0].type.shape, block), block)
    y = body.activation(y)
    return body.function(body.add("Cast", y, to=body.dtype.value) if body.dtype is not body.work else y)


register_op(
    "PreActConvNCHWc", domain=DOMAIN, attrs={**CONV_ATTR_SPECS, "block": _BLOCK_SPEC, **_activation_attrs()},
    infer=_pre_act_conv_infer, compute=_pre_act_conv, onnx_function=_pre_act_conv_function,
    doc="act(Conv(Relu(Xb * S + T), W, B)) on channel-blocked tensors, S and T per-channel constants "
        "[1, C/block, 1, 1, block]: ConvNCHWc with its input's BatchNormalization and ReLU computed as it reads it")

"""egraft-only fused ops (domain ``com.egraft``), created by the rewrite rules when they fuse a
pattern of standard ops into one node:

- ``FusedConv(X, W, B?, Z?)``: ``act(Conv(X, W, B) + Z)``, with every Conv attribute;
- ``FusedGemm(A, B, C?, Z?)``: ``act(alpha * A' @ B' + beta * C + Z)``, with Gemm's attributes;
- ``FusedMatMul(A, B, bias?, Z?)``: ``act(A @ B + bias + Z)`` (numpy matmul semantics);
- ``LayerNorm(X, scale, bias?)``: LayerNormalization-17 over the axes ``[axis, rank)``;
- ``Gelu(X)``: ``x * Phi(x)``, exact (erf) or with the tanh approximation;
- ``Attention(Q, Kt, V, mask?)``: ``Softmax(scale * Q @ Kt + mask, axis=-1) @ V`` (K given transposed).

The fused linear ops end in an optional activation (``activation`` attribute, parameters in
``activation_params``), applied as the ONNX op of the same name does. An optional addend (bias,
C, the residual Z, the attention mask) must broadcast *to* the main result, as Gemm's C does:
the output always has the main result's shape.

Each op has native symbolic inference, a numpy kernel (float16 and bfloat16 are computed in
float32 and rounded once at the end) and an ONNX definition: ``onnx_function(node)`` is a
FunctionProto whose body is the op in standard opset-18 ops with the node's attribute values
baked in; for a half-precision node the body casts to float32 and back, as the kernel does.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
import onnx
from onnx import helper, numpy_helper

from egraft.ir.dims import BroadcastError, broadcast_shapes, dims_conflict
from egraft.ir.dtypes import DType
from egraft.ir.ops._common import fail, normalize_axis, same_float_dtype
from egraft.ir.ops.nn_dense import gemm_shape, matmul_shape
from egraft.ir.ops.nn_spatial import conv_compute, conv_infer
from egraft.ir.registry import AttrSpec, InferContext, get_op, register_op
from egraft.ir.types import TensorType

DOMAIN = "com.egraft"
#: The default-domain opset the function bodies are written in.
FUNCTION_OPSET = 18

ACTIVATIONS = ("", "relu", "leaky_relu", "clip", "sigmoid", "silu", "hard_sigmoid", "hard_swish", "gelu",
               "gelu_tanh", "tanh")
#: Parameters of the activations that take some, in order, with the ONNX ops' defaults.
_PARAM_DEFAULTS: dict[str, list[float]] = {
    "leaky_relu": [0.01],  # alpha
    "clip": [-math.inf, math.inf],  # min, max
    "hard_sigmoid": [0.2, 0.5],  # alpha, beta
}
_SQRT_2_OVER_PI = math.sqrt(2 / math.pi)
_GELU_CUBIC = 0.044715


# ---- activations ------------------------------------------------------------------------------
def activation_params(activation: str, params: Sequence[float] | None) -> list[float]:
    """The parameters of ``activation`` with the missing trailing ones set to their defaults.

    Raises ValueError for an unknown activation or too many parameters.
    """
    if activation not in ACTIVATIONS:
        raise ValueError(f"unknown activation {activation!r} (expected one of {', '.join(map(repr, ACTIVATIONS))})")
    defaults = _PARAM_DEFAULTS.get(activation, [])
    given = [float(p) for p in (params or [])]
    if len(given) > len(defaults):
        raise ValueError(f"activation {activation!r} takes at most {len(defaults)} parameters, got {given}")
    return given + defaults[len(given):]


def _gelu(x: np.ndarray, tanh: bool) -> np.ndarray:
    """x * Phi(x): the erf form, or 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))."""
    if tanh:
        return 0.5 * x * (1 + np.tanh(_SQRT_2_OVER_PI * (x + _GELU_CUBIC * x * x * x)))
    from scipy.special import erf  # imported when first used: scipy.special takes 0.2 s

    return 0.5 * x * (1 + erf(x / math.sqrt(2)))


def apply_activation(y: np.ndarray, activation: str, params: Sequence[float] | None = None) -> np.ndarray:
    """``activation`` applied to ``y`` (a float32/float64 array) as the ONNX op of that name does."""
    from scipy.special import expit

    p = activation_params(activation, params)
    if activation == "":
        return y
    if activation == "relu":
        return np.maximum(y, 0)
    if activation == "leaky_relu":
        return np.where(y >= 0, y, p[0] * y)
    if activation == "clip":
        return np.minimum(np.maximum(y, p[0]), p[1])
    if activation == "sigmoid":
        return expit(y)
    if activation == "silu":  # x * sigmoid(x), YOLO's and EfficientNet's Swish
        return y * expit(y)
    if activation == "hard_sigmoid":
        return np.clip(p[0] * y + p[1], 0, 1)
    if activation == "hard_swish":
        return y * np.clip(y / 6 + 0.5, 0, 1)
    if activation in ("gelu", "gelu_tanh"):
        return _gelu(y, activation == "gelu_tanh")
    return np.tanh(y)  # "tanh"


def _activate(ctx, y: np.ndarray) -> np.ndarray:
    return apply_activation(y, ctx.attr("activation", ""), ctx.attr("activation_params", []))


def _activation_attrs() -> dict[str, AttrSpec]:
    return {
        "activation": AttrSpec("string", "", "the trailing activation: " + ", ".join(repr(a) for a in ACTIVATIONS)),
        "activation_params": AttrSpec("floats", [], "leaky_relu [alpha], clip [min, max], hard_sigmoid [alpha, beta]"),
    }


# ---- inference helpers ------------------------------------------------------------------------
def _check_activation(ctx: InferContext) -> None:
    try:
        activation_params(ctx.attr("activation", ""), ctx.attr("activation_params", []))
    except ValueError as e:
        raise fail(ctx, str(e)) from None


def _check_addend(ctx: InferContext, index: int, out: tuple | None, what: str) -> None:
    """Input ``index``, when given, must broadcast to the result shape ``out`` (unidirectionally)."""
    if not ctx.has_input(index) or out is None or ctx.types[index].shape is None:
        return
    shape = ctx.types[index].shape
    ok = len(shape) <= len(out) and all(
        (isinstance(s, int) and s == 1) or not dims_conflict(s, o) for s, o in zip(reversed(shape), reversed(out)))
    if not ok:
        raise fail(ctx, f"{what} of shape {list(shape)} does not broadcast to the result shape {list(out)}")


def _broadcast(ctx: InferContext, *shapes: tuple) -> tuple:
    try:
        return broadcast_shapes(*shapes)
    except BroadcastError as e:
        raise fail(ctx, f"batch dims do not broadcast: {e}") from None


# ---- compute helpers ----------------------------------------------------------------------------
def _work_dtype(dtype: np.dtype) -> np.dtype:
    """The dtype the kernels compute in: float64 for float64, else float32."""
    return np.dtype(np.float64) if np.dtype(dtype) == np.float64 else np.dtype(np.float32)


def _as_work(x: np.ndarray | None, work: np.dtype) -> np.ndarray | None:
    return None if x is None else np.asarray(x).astype(work, copy=False)


def _add_to(y: np.ndarray, addend: np.ndarray | None, what: str) -> np.ndarray:
    """``y + addend``, where ``addend`` must broadcast to ``y``'s shape."""
    if addend is None:
        return y
    out = y + addend
    if out.shape != y.shape:
        raise ValueError(f"{what} of shape {list(addend.shape)} does not broadcast to the result shape "
                         f"{list(y.shape)}")
    return out


# ---- ONNX function bodies ---------------------------------------------------------------------
def _node_attr(node, name: str):
    """The node's attribute ``name``, else the op's default."""
    if name in node.attrs:
        return node.attrs[name]
    return get_op(node.op, node.domain or DOMAIN).attrs[name].default


class _Body:
    """The FunctionProto of one node under construction.

    Its formal inputs are ``formals`` up to the node's last given input (the body reads only the
    given ones); inputs of a half-precision node are cast to float32 and the result cast back.
    """

    def __init__(self, node, formals: Sequence[str]) -> None:
        self.node = node
        given = list(node.inputs)
        while given and given[-1] is None:
            given.pop()
        self.given = [v is not None for v in given]
        self.formals = list(formals[: len(given)])
        self.dtype: DType = node.inputs[0].type.dtype
        self.work = DType.FLOAT64 if self.dtype is DType.FLOAT64 else DType.FLOAT32
        self.nodes: list[onnx.NodeProto] = []
        self._inputs: dict[int, str] = {}

    def has(self, i: int) -> bool:
        return i < len(self.given) and self.given[i]

    def input(self, i: int) -> str:
        """Input ``i`` in the work dtype."""
        if i not in self._inputs:
            name = self.formals[i]
            self._inputs[i] = name if self.dtype is self.work else self.add("Cast", name, to=self.work.value)
        return self._inputs[i]

    def add(self, op: str, *inputs: str, **attrs) -> str:
        """Append an ``op`` node; returns its (fresh) output name."""
        out = f"t{len(self.nodes)}"
        self.nodes.append(helper.make_node(op, list(inputs), [out], **attrs))
        return out

    def const(self, value: float) -> str:
        """A scalar constant in the work dtype."""
        array = np.array(value, dtype=self.work.numpy)
        return self.add("Constant", value=numpy_helper.from_array(array))

    def add_optional(self, y: str, i: int) -> str:
        """``y + input i`` when input ``i`` is given, else ``y``."""
        return self.add("Add", y, self.input(i)) if self.has(i) else y

    def activation(self, x: str) -> str:
        """The node's ``activation`` applied to ``x``."""
        activation = _node_attr(self.node, "activation")
        p = activation_params(activation, _node_attr(self.node, "activation_params"))
        if activation == "":
            return x
        simple = {"relu": "Relu", "sigmoid": "Sigmoid", "hard_swish": "HardSwish", "tanh": "Tanh"}
        if activation in simple:
            return self.add(simple[activation], x)
        if activation == "silu":
            return self.add("Mul", x, self.add("Sigmoid", x))
        if activation == "leaky_relu":
            return self.add("LeakyRelu", x, alpha=p[0])
        if activation == "hard_sigmoid":
            return self.add("HardSigmoid", x, alpha=p[0], beta=p[1])
        if activation == "clip":
            lo = self.const(p[0]) if p[0] > -math.inf else ""
            hi = self.const(p[1]) if p[1] < math.inf else ""
            return self.add("Clip", x, lo, hi)
        return self.gelu(x, activation == "gelu_tanh")

    def gelu(self, x: str, tanh: bool) -> str:
        """x * Phi(x) in basic ops (opset 18 has no Gelu)."""
        if tanh:
            cube = self.add("Mul", self.add("Mul", x, x), x)
            inner = self.add("Add", x, self.add("Mul", cube, self.const(_GELU_CUBIC)))
            phi = self.add("Tanh", self.add("Mul", inner, self.const(_SQRT_2_OVER_PI)))
        else:
            phi = self.add("Erf", self.add("Div", x, self.const(math.sqrt(2))))
        half_x = self.add("Mul", self.const(0.5), x)
        return self.add("Mul", half_x, self.add("Add", phi, self.const(1.0)))

    def function(self, result: str) -> onnx.FunctionProto:
        """The finished FunctionProto, with ``result`` (rounded to the node's dtype) as output Y."""
        if self.dtype is self.work:
            self.nodes.append(helper.make_node("Identity", [result], ["Y"]))
        else:
            self.nodes.append(helper.make_node("Cast", [result], ["Y"], to=self.dtype.value))
        return helper.make_function(DOMAIN, self.node.op, self.formals, ["Y"], self.nodes,
                                    [helper.make_opsetid("", FUNCTION_OPSET)], attributes=sorted(self.node.attrs))


def _set_attrs(node, names: Sequence[str]) -> dict:
    """The attributes among ``names`` that the node sets to a non-empty value."""
    return {k: node.attrs[k] for k in names if k in node.attrs and node.attrs[k] not in ([], (), None)}


# ---- FusedConv ---------------------------------------------------------------------------------
#: Conv's attributes, as the Conv-like egraft ops (FusedConv, ConvNHWC, ConvNCHWc,
#: WinogradConv) declare them.
CONV_ATTR_SPECS = {
    "auto_pad": AttrSpec("string", "NOTSET", "NOTSET, SAME_UPPER, SAME_LOWER or VALID, as Conv"),
    "dilations": AttrSpec("ints", [], "per spatial axis (default 1)"),
    "group": AttrSpec("int", 1, "number of channel groups"),
    "kernel_shape": AttrSpec("ints", [], "the kernel's spatial shape (default: from W)"),
    "pads": AttrSpec("ints", [], "begin pads then end pads per spatial axis (default 0)"),
    "strides": AttrSpec("ints", [], "per spatial axis (default 1)"),
}
CONV_ATTRS = tuple(CONV_ATTR_SPECS)


def _fused_conv_infer(ctx: InferContext) -> list[TensorType]:
    same_float_dtype(ctx)
    _check_activation(ctx)
    out = conv_infer(ctx)[0]
    if ctx.has_input(2) and ctx.types[2].shape is not None:
        b = ctx.types[2].shape
        if len(b) != 1 or (out.shape is not None and dims_conflict(b[0], out.shape[1])):
            raise fail(ctx, f"the bias has shape {list(b)}; it must be 1-D with one entry per output channel")
    _check_addend(ctx, 3, out.shape, "Z")
    return [out]


def _fused_conv(ctx, x, w, b=None, z=None):
    """act(Conv(X, W, B) + Z)."""
    work = _work_dtype(x.dtype)
    y = conv_compute(ctx, x.astype(work, copy=False), w.astype(work, copy=False), _as_work(b, work))[0]
    y = _add_to(y, _as_work(z, work), "Z")
    return [_activate(ctx, y).astype(x.dtype, copy=False)]


def _fused_conv_function(node) -> onnx.FunctionProto:
    body = _Body(node, ["X", "W", "B", "Z"])
    inputs = [body.input(0), body.input(1)] + ([body.input(2)] if body.has(2) else [])
    y = body.add("Conv", *inputs, **_set_attrs(node, CONV_ATTRS))
    return body.function(body.activation(body.add_optional(y, 3)))


register_op(
    "FusedConv", domain=DOMAIN,
    attrs={**CONV_ATTR_SPECS, **_activation_attrs()},
    infer=_fused_conv_infer, compute=_fused_conv, onnx_function=_fused_conv_function,
    doc="act(Conv(X, W, B) + Z): a convolution with bias, residual addend and activation")


# ---- FusedGemm ---------------------------------------------------------------------------------
def _fused_gemm_infer(ctx: InferContext) -> list[TensorType]:
    dtype = same_float_dtype(ctx)
    _check_activation(ctx)
    m, n = gemm_shape(ctx)
    _check_addend(ctx, 2, (m, n), "C")
    _check_addend(ctx, 3, (m, n), "Z")
    return [TensorType(dtype, (m, n))]


def _fused_gemm(ctx, a, b, c=None, z=None):
    """act(alpha * A' @ B' + beta * C + Z)."""
    work = _work_dtype(a.dtype)
    alpha, beta = float(ctx.attr("alpha", 1.0)), float(ctx.attr("beta", 1.0))
    wa, wb = a.astype(work, copy=False), b.astype(work, copy=False)
    if ctx.attr("transA", 0):
        wa = wa.T
    if ctx.attr("transB", 0):
        wb = wb.T
    y = wa @ wb
    if alpha != 1:
        y = y * alpha
    if c is not None and beta != 0:
        cw = c.astype(work, copy=False)
        y = _add_to(y, cw if beta == 1 else cw * beta, "C")
    y = _add_to(y, _as_work(z, work), "Z")
    return [_activate(ctx, y).astype(a.dtype, copy=False)]


def _fused_gemm_function(node) -> onnx.FunctionProto:
    body = _Body(node, ["A", "B", "C", "Z"])
    inputs = [body.input(0), body.input(1)] + ([body.input(2)] if body.has(2) else [])
    attrs = {k: _node_attr(node, k) for k in ("alpha", "beta", "transA", "transB")}
    y = body.add("Gemm", *inputs, alpha=float(attrs["alpha"]), beta=float(attrs["beta"]),
                 transA=int(attrs["transA"]), transB=int(attrs["transB"]))
    return body.function(body.activation(body.add_optional(y, 3)))


register_op(
    "FusedGemm", domain=DOMAIN,
    attrs={
        "alpha": AttrSpec("float", 1.0, "multiplier of A' @ B'"),
        "beta": AttrSpec("float", 1.0, "multiplier of C"),
        "transA": AttrSpec("int", 0, "transpose A first"),
        "transB": AttrSpec("int", 0, "transpose B first"),
        **_activation_attrs(),
    },
    infer=_fused_gemm_infer, compute=_fused_gemm, onnx_function=_fused_gemm_function,
    doc="act(alpha * A' @ B' + beta * C + Z): Gemm with residual addend and activation")


# ---- FusedMatMul -------------------------------------------------------------------------------
def _fused_matmul_infer(ctx: InferContext) -> list[TensorType]:
    dtype = same_float_dtype(ctx)
    _check_activation(ctx)
    a, b = ctx.types[0].shape, ctx.types[1].shape
    if a is None or b is None:
        return [TensorType(dtype, None)]
    out = matmul_shape(ctx, a, b)
    _check_addend(ctx, 2, out, "bias")
    _check_addend(ctx, 3, out, "Z")
    return [TensorType(dtype, out)]


def _fused_matmul(ctx, a, b, bias=None, z=None):
    """act(A @ B + bias + Z)."""
    work = _work_dtype(a.dtype)
    y = np.matmul(a.astype(work, copy=False), b.astype(work, copy=False))
    y = _add_to(y, _as_work(bias, work), "bias")
    y = _add_to(y, _as_work(z, work), "Z")
    return [np.asarray(_activate(ctx, y)).astype(a.dtype, copy=False)]


def _fused_matmul_function(node) -> onnx.FunctionProto:
    body = _Body(node, ["A", "B", "bias", "Z"])
    y = body.add("MatMul", body.input(0), body.input(1))
    y = body.add_optional(body.add_optional(y, 2), 3)
    return body.function(body.activation(y))


register_op(
    "FusedMatMul", domain=DOMAIN, attrs=_activation_attrs(),
    infer=_fused_matmul_infer, compute=_fused_matmul, onnx_function=_fused_matmul_function,
    doc="act(A @ B + bias + Z): MatMul with bias, residual addend and activation")


# ---- LayerNorm ---------------------------------------------------------------------------------
def _layer_norm_infer(ctx: InferContext) -> list[TensorType]:
    same_float_dtype(ctx)
    x = ctx.types[0]
    if x.shape is None:
        return [x]
    axis = normalize_axis(ctx.attr("axis", -1), len(x.shape), ctx)
    normalized = tuple(x.shape[axis:])
    _check_addend(ctx, 1, normalized, "scale")
    _check_addend(ctx, 2, normalized, "bias")
    return [x]


def _layer_norm(ctx, x, scale, bias=None):
    """(X - mean) / sqrt(var + epsilon) * scale + bias, the statistics over the axes [axis, rank)."""
    work = _work_dtype(x.dtype)
    axes = tuple(range(normalize_axis(ctx.attr("axis", -1), x.ndim), x.ndim))
    xw = x.astype(work, copy=False)
    centered = xw - xw.mean(axis=axes, keepdims=True)
    variance = np.mean(np.square(centered), axis=axes, keepdims=True)
    y = centered / np.sqrt(variance + float(ctx.attr("epsilon", 1e-5)))
    y = _add_to(y * scale.astype(work, copy=False), _as_work(bias, work), "bias")
    return [y.astype(x.dtype, copy=False)]


def _layer_norm_function(node) -> onnx.FunctionProto:
    body = _Body(node, ["X", "scale", "bias"])
    inputs = [body.input(0), body.input(1)] + ([body.input(2)] if body.has(2) else [])
    y = body.add("LayerNormalization", *inputs, axis=int(_node_attr(node, "axis")),
                 epsilon=float(_node_attr(node, "epsilon")))
    return body.function(y)


register_op(
    "LayerNorm", domain=DOMAIN,
    attrs={
        "axis": AttrSpec("int", -1, "the first normalized axis; the axes [axis, rank) are normalized"),
        "epsilon": AttrSpec("float", 1e-5, "added to the variance"),
    },
    infer=_layer_norm_infer, compute=_layer_norm, onnx_function=_layer_norm_function,
    doc="layer normalization over the axes [axis, rank), then scale and bias (LayerNormalization-17)")


# ---- Gelu --------------------------------------------------------------------------------------
_GELU_APPROXIMATIONS = ("none", "tanh")


def _gelu_infer(ctx: InferContext) -> list[TensorType]:
    same_float_dtype(ctx)
    if ctx.attr("approximate", "none") not in _GELU_APPROXIMATIONS:
        raise fail(ctx, f"approximate is {ctx.attr('approximate')!r}; expected 'none' or 'tanh'")
    return [ctx.types[0]]


def _gelu_compute(ctx, x):
    y = _gelu(x.astype(_work_dtype(x.dtype), copy=False), ctx.attr("approximate", "none") == "tanh")
    return [np.asarray(y).astype(x.dtype, copy=False)]


def _gelu_function(node) -> onnx.FunctionProto:
    body = _Body(node, ["X"])
    return body.function(body.gelu(body.input(0), _node_attr(node, "approximate") == "tanh"))


register_op(
    "Gelu", domain=DOMAIN,
    attrs={"approximate": AttrSpec("string", "none", "'none' (the erf form) or 'tanh'")},
    infer=_gelu_infer, compute=_gelu_compute, onnx_function=_gelu_function,
    doc="x * Phi(x): the exact (erf) form or the tanh approximation")


# ---- Attention ---------------------------------------------------------------------------------
def _attention_infer(ctx: InferContext) -> list[TensorType]:
    dtype = same_float_dtype(ctx)
    q, kt, v = (ctx.types[i].shape for i in range(3))
    if q is None or kt is None or v is None:
        return [TensorType(dtype, None)]
    if min(len(q), len(kt), len(v)) < 2:
        raise fail(ctx, f"Q, Kt and V must have rank >= 2, got shapes {list(q)}, {list(kt)} and {list(v)}")
    if dims_conflict(q[-1], kt[-2]):
        raise fail(ctx, f"Q [..., S, D] of shape {list(q)} and Kt [..., D, T] of shape {list(kt)} differ in D")
    if dims_conflict(kt[-1], v[-2]):
        raise fail(ctx, f"Kt [..., D, T] of shape {list(kt)} and V [..., T, Dv] of shape {list(v)} differ in T")
    scores = (*_broadcast(ctx, q[:-2], kt[:-2]), q[-2], kt[-1])
    _check_addend(ctx, 3, scores, "the mask")
    return [TensorType(dtype, (*_broadcast(ctx, scores[:-2], v[:-2]), q[-2], v[-1]))]


def _attention(ctx, q, kt, v, mask=None):
    """Softmax(scale * Q @ Kt + mask, axis=-1) @ V."""
    work = _work_dtype(q.dtype)
    scores = np.matmul(q.astype(work, copy=False), kt.astype(work, copy=False)) * float(ctx.attr("scale", 1.0))
    scores = _add_to(scores, _as_work(mask, work), "the mask")
    e = np.exp(scores - scores.max(axis=-1, keepdims=True))
    probs = e / e.sum(axis=-1, keepdims=True)
    return [np.matmul(probs, v.astype(work, copy=False)).astype(q.dtype, copy=False)]


def _attention_function(node) -> onnx.FunctionProto:
    body = _Body(node, ["Q", "Kt", "V", "mask"])
    scores = body.add("Mul", body.add("MatMul", body.input(0), body.input(1)),
                      body.const(float(_node_attr(node, "scale"))))
    probs = body.add("Softmax", body.add_optional(scores, 3), axis=-1)
    return body.function(body.add("MatMul", probs, body.input(2)))


register_op(
    "Attention", domain=DOMAIN,
    attrs={"scale": AttrSpec("float", 1.0, "multiplier of the scores Q @ Kt")},
    infer=_attention_infer, compute=_attention, onnx_function=_attention_function,
    doc="Softmax(scale * Q @ Kt + mask, axis=-1) @ V, with K given transposed")

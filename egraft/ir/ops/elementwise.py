"""Elementwise and broadcasting ops: arithmetic, comparisons, logic, activations, Cast.

Float results keep the input's dtype (f16 stays f16). Arithmetic ops are ``symbolic``:
shape inference evaluates them on sympy dims (``Shape(x)[0] * 2``).
"""

from __future__ import annotations

import numpy as np

from egraft.ir.dims import UnknownComparison, compare_dims
from egraft.ir.dtypes import DType
from egraft.ir.ops._common import broadcast_of, is_symbolic, same_as
from egraft.ir.registry import register_op
from egraft.ir.types import TensorType


def _keep(fn):
    """Wrap a float function of one array so its result keeps the input's dtype; half
    precision inputs are computed in float32 and rounded once at the end."""

    def compute(ctx, x):
        half = (x.dtype.kind == "f" and x.dtype.itemsize < 4) or x.dtype.name == "bfloat16"
        wide = x.astype(np.float32) if half else x
        return [np.asarray(fn(ctx, wide)).astype(x.dtype, copy=False)]

    return compute


def _unary(name: str, fn, doc: str) -> None:
    register_op(name, infer=same_as(0), compute=_keep(lambda ctx, x: fn(x)), doc=doc)


def _erf(x):
    from scipy.special import erf

    return erf(x)


_unary("Abs", np.abs, "|x|")
_unary("Neg", np.negative, "-x")
_unary("Exp", np.exp, "e^x")
_unary("Log", np.log, "ln x")
_unary("Sqrt", np.sqrt, "sqrt(x)")
_unary("Reciprocal", lambda x: 1 / x, "1 / x")
_unary("Floor", np.floor, "floor(x)")
_unary("Ceil", np.ceil, "ceil(x)")
_unary("Round", np.round, "round half to even")
_unary("Sign", np.sign, "sign(x)")
_unary("Relu", lambda x: np.maximum(x, 0), "max(x, 0)")
_unary("Sigmoid", lambda x: 1 / (1 + np.exp(-x)), "1 / (1 + e^-x)")
_unary("Tanh", np.tanh, "tanh(x)")
_unary("Erf", _erf, "the error function")
_unary("Sin", np.sin, "sin(x)")
_unary("Cos", np.cos, "cos(x)")
_unary("Tan", np.tan, "tan(x)")
_unary("Asin", np.arcsin, "asin(x)")
_unary("Acos", np.arccos, "acos(x)")
_unary("Atan", np.arctan, "atan(x)")
_unary("Sinh", np.sinh, "sinh(x)")
_unary("Cosh", np.cosh, "cosh(x)")
_unary("Asinh", np.arcsinh, "asinh(x)")
_unary("Acosh", np.arccosh, "acosh(x)")
_unary("Atanh", np.arctanh, "atanh(x)")
_unary("Softsign", lambda x: x / (1 + np.abs(x)), "x / (1 + |x|)")
_unary("Softplus", lambda x: np.logaddexp(0, x), "ln(1 + e^x)")
_unary("Mish", lambda x: x * np.tanh(np.logaddexp(0, x)), "x * tanh(softplus(x))")
_unary("HardSwish", lambda x: x * np.clip(x / 6 + 0.5, 0, 1), "x * clip(x/6 + 1/2, 0, 1)")


def _with_attrs(name: str, fn, doc: str) -> None:
    register_op(name, infer=same_as(0), compute=_keep(fn), doc=doc)


def _elu(c, x):
    return np.where(x > 0, x, c.attr("alpha", 1.0) * (np.exp(x) - 1))


def _celu(c, x):
    alpha = c.attr("alpha", 1.0)
    return np.maximum(x, 0) + np.minimum(0, alpha * (np.exp(x / alpha) - 1))


def _selu(c, x):
    return c.attr("gamma") * np.where(x > 0, x, c.attr("alpha") * (np.exp(x) - 1))


def _leaky_relu(c, x):
    return np.where(x >= 0, x, c.attr("alpha", 0.01) * x)


def _thresholded_relu(c, x):
    return np.where(x > c.attr("alpha", 1.0), x, 0)


def _hard_sigmoid(c, x):
    return np.clip(c.attr("alpha", 0.2) * x + c.attr("beta", 0.5), 0, 1)


def _shrink(c, x):
    lambd, bias = c.attr("lambd", 0.5), c.attr("bias", 0.0)
    return np.where(x < -lambd, x + bias, np.where(x > lambd, x - bias, 0))


def _swish(c, x):
    return x / (1 + np.exp(-c.attr("alpha", 1.0) * x))


_with_attrs("Elu", _elu, "x if x > 0 else alpha*(e^x - 1)")
_with_attrs("Celu", _celu, "max(0, x) + min(0, alpha*(e^(x/alpha) - 1))")
_with_attrs("Selu", _selu, "gamma * elu(x, alpha)")
_with_attrs("LeakyRelu", _leaky_relu, "x if x >= 0 else alpha*x")
_with_attrs("ThresholdedRelu", _thresholded_relu, "x if x > alpha else 0")
_with_attrs("HardSigmoid", _hard_sigmoid, "clip(alpha*x + beta, 0, 1)")
_with_attrs("Shrink", _shrink, "x + bias below -lambd, x - bias above lambd, else 0")
_with_attrs("Swish", _swish, "x * sigmoid(alpha*x)")


def _gelu(ctx, x):
    if ctx.attr("approximate", "none") == "tanh":
        return 0.5 * x * (1 + np.tanh(np.sqrt(2 / np.pi) * (x + 0.044715 * x**3)))
    return 0.5 * x * (1 + _erf(x / np.sqrt(2)))


_with_attrs("Gelu", _gelu, "x * Phi(x) (erf form, or the tanh approximation)")


def _identity(ctx, x):
    return [x]


register_op("Identity", infer=same_as(0), compute=_identity, symbolic=True, doc="x")


def _not(ctx, x):
    return [np.logical_not(x)]


register_op("Not", infer=same_as(0), compute=_not, doc="logical not")
register_op("BitwiseNot", infer=same_as(0), compute=lambda ctx, x: [np.invert(x)], doc="~x")
register_op("IsNaN", infer=lambda ctx: [TensorType(DType.BOOL, ctx.types[0].shape)],
            compute=lambda ctx, x: [np.isnan(x)], doc="x is NaN")


def _isinf(ctx, x):
    pos, neg = ctx.attr("detect_positive", 1), ctx.attr("detect_negative", 1)
    return [(np.isposinf(x) & bool(pos)) | (np.isneginf(x) & bool(neg))]


register_op("IsInf", infer=lambda ctx: [TensorType(DType.BOOL, ctx.types[0].shape)], compute=_isinf, doc="x is +-inf")


# ---- binary arithmetic --------------------------------------------------------------
def _int_div(a, b):
    """Integer division truncating toward zero, as C and onnxruntime do."""
    q = np.floor_divide(a, b)
    fix = (np.remainder(a, b) != 0) & ((a < 0) != (b < 0))
    return q + fix.astype(q.dtype)


def _arith(fn, int_fn=None):
    def compute(ctx, a, b):
        if is_symbolic(a, b):
            return [np.asarray(fn(a, b) if int_fn is None else _sym_floor_div(a, b))]
        kind = np.result_type(a, b).kind
        if int_fn is not None and kind in "iu":
            return [int_fn(a, b).astype(a.dtype, copy=False)]
        return [np.asarray(fn(a, b)).astype(a.dtype, copy=False)]

    return compute


def _sym_floor_div(a, b):
    return np.asarray(a, dtype=object) // np.asarray(b, dtype=object)


register_op("Add", infer=broadcast_of(), compute=_arith(np.add), symbolic=True, doc="a + b", commutative=True,
            associative=True)
register_op("Sub", infer=broadcast_of(), compute=_arith(np.subtract), symbolic=True, doc="a - b")
register_op("Mul", infer=broadcast_of(), compute=_arith(np.multiply), symbolic=True, doc="a * b",
            commutative=True, associative=True)
register_op("Div", infer=broadcast_of(), compute=_arith(np.true_divide, _int_div), symbolic=True,
            doc="a / b (integer division truncates toward zero)")


def _pow(ctx, a, b):
    if a.dtype.kind in "iu":
        return [np.power(a.astype(np.float64), b).astype(a.dtype)]
    return [np.power(a, b.astype(a.dtype) if b.dtype.kind == "f" else b).astype(a.dtype, copy=False)]


register_op("Pow", infer=broadcast_of(0, 1, dtype_from=0), compute=_pow, doc="a ** b (the result has a's type)")


def _mod(ctx, a, b):
    if ctx.attr("fmod", 0):
        return [np.fmod(a, b).astype(a.dtype, copy=False)]
    return [np.mod(a, b).astype(a.dtype, copy=False)]


register_op("Mod", infer=broadcast_of(), compute=_mod, symbolic=True, doc="a mod b (sign of b; fmod=1: sign of a)")


def _bitshift(ctx, a, b):
    if ctx.attr("direction") == "LEFT":
        return [np.left_shift(a, b).astype(a.dtype)]
    return [np.right_shift(a, b).astype(a.dtype)]


register_op("BitShift", infer=broadcast_of(), compute=_bitshift, doc="a << b or a >> b")
register_op("BitwiseAnd", infer=broadcast_of(), compute=lambda ctx, a, b: [np.bitwise_and(a, b)], doc="a & b",
            commutative=True, associative=True)
register_op("BitwiseOr", infer=broadcast_of(), compute=lambda ctx, a, b: [np.bitwise_or(a, b)], doc="a | b",
            commutative=True, associative=True)
register_op("BitwiseXor", infer=broadcast_of(), compute=lambda ctx, a, b: [np.bitwise_xor(a, b)], doc="a ^ b",
            commutative=True, associative=True)


def _compare(fn, relation: str):
    def compute(ctx, a, b):
        if is_symbolic(a, b):
            return [np.vectorize(lambda x, y: _decided(x, y, relation), otypes=[bool])(a, b)]
        return [fn(a, b)]

    return compute


def _decided(a, b, relation: str) -> bool:
    """A comparison of (possibly symbolic) dims that holds for every binding; raises
    :class:`UnknownComparison` when only the run time knows (the value stays unknown)."""
    result = compare_dims(a, b, relation)
    if result is None:
        raise UnknownComparison(f"{a} {relation} {b} is not decided before run time")
    return result


for _name, _fn, _relation in [("Equal", np.equal, "eq"), ("Less", np.less, "lt"), ("LessOrEqual", np.less_equal, "le"),
                              ("Greater", np.greater, "gt"), ("GreaterOrEqual", np.greater_equal, "ge")]:
    register_op(_name, infer=broadcast_of(dtype=DType.BOOL), compute=_compare(_fn, _relation), symbolic=True,
                doc=f"a {_name} b, elementwise, as bool (three-valued on symbolic dims: only a proof decides)",
                commutative=_name == "Equal")

for _name, _fn in [("And", np.logical_and), ("Or", np.logical_or), ("Xor", np.logical_xor)]:
    register_op(_name, infer=broadcast_of(dtype=DType.BOOL), compute=lambda ctx, a, b, _f=_fn: [_f(a, b)],
                doc=f"logical {_name.lower()}", commutative=True, associative=True)


def _where(ctx, c, a, b):
    return [np.where(c, a, b)]


register_op("Where", infer=broadcast_of(0, 1, 2, dtype_from=1), compute=_where, symbolic=True,
            doc="a where cond else b")


# ---- variadic --------------------------------------------------------------------------
def _variadic(fn, mean=False):
    def compute(ctx, *xs):
        out = xs[0]
        for x in xs[1:]:
            out = fn(out, x)
        if mean:
            out = out / len(xs)
        return [np.asarray(out).astype(xs[0].dtype, copy=False)]

    return compute


register_op("Max", infer=broadcast_of(), compute=_variadic(np.maximum), symbolic=False, doc="elementwise max",
            commutative=True, associative=True)
register_op("Min", infer=broadcast_of(), compute=_variadic(np.minimum), symbolic=False, doc="elementwise min",
            commutative=True, associative=True)
register_op("Sum", infer=broadcast_of(), compute=_variadic(np.add), doc="elementwise sum",
            commutative=True, associative=True)
register_op("Mean", infer=broadcast_of(), compute=_variadic(np.add, mean=True), doc="elementwise mean",
            commutative=True)


def _clip(ctx, x, lo=None, hi=None):
    if ctx.opset < 11:
        lo = ctx.attr("min", None)
        hi = ctx.attr("max", None)
    out = x
    if lo is not None:
        out = np.maximum(out, np.asarray(lo, dtype=x.dtype))
    if hi is not None:
        out = np.minimum(out, np.asarray(hi, dtype=x.dtype))
    return [np.asarray(out).astype(x.dtype, copy=False)]


register_op("Clip", infer=same_as(0), compute=_clip, doc="min(max(x, lo), hi)")


def _prelu(ctx, x, slope):
    return [np.where(x < 0, x * slope, x).astype(x.dtype, copy=False)]


register_op("PRelu", infer=broadcast_of(0, 1), compute=_prelu, doc="x if x >= 0 else slope*x")


# ---- casts --------------------------------------------------------------------------------
def _cast_to(x, dtype: DType):
    if is_symbolic(x):
        return x
    target = dtype.numpy
    if x.dtype.kind == "f" and target.kind in "iu":
        with np.errstate(all="ignore"):
            return np.trunc(x).astype(target)
    return x.astype(target)


def _cast(ctx, x):
    return [_cast_to(x, DType(ctx.attr("to")))]


def _cast_infer(ctx):
    return [TensorType(DType.from_onnx(ctx.attr("to"), f" (the target of {ctx.node.label})"), ctx.types[0].shape)]


register_op("Cast", infer=_cast_infer, compute=_cast, symbolic=True, doc="x converted to the type 'to'")
register_op("CastLike", infer=lambda ctx: [TensorType(ctx.types[1].dtype, ctx.types[0].shape)],
            compute=lambda ctx, x, like: [_cast_to(x, DType.from_numpy(like.dtype))], symbolic=False,
            doc="x converted to the type of 'like'")

"""Elementwise kernels: unary and broadcasting binary ops, variadic Sum/Max/Min/Mean,
Clip, Where, and egraft's fused ``Elementwise`` whose whole expression body becomes one
loop nest.

Every operand is read with its broadcast strides (0 on a broadcast axis); adjacent axes
that are contiguous for every operand are merged first, so the common cases (same
shapes, a per-channel bias) become one or two loops whose inner loop LLVM vectorizes.

Example: ``Add(x: f32[8, 64, 56, 56], b: f32[64, 1, 1])`` is two loops: 8*64 rows of
3,136 contiguous elements, ``b`` read with stride 0 in the inner loop.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np
import sympy
from llvmlite import ir

from egraft.ir.dims import dims_equal
from egraft.ir.dtypes import DType
from egraft.ir.ops.fused_elementwise import parse_expr
from egraft.kernels.cpu import register_kernel
from egraft.kernels.cpu.emit import I64, KernelContext, Unsupported, is_float, llvm_type

#: ``(builder, math, operands) -> result``: the scalar body of an elementwise kernel.
Body = Callable[[ir.IRBuilder, object, list[ir.Value]], ir.Value]


def broadcast_strides(shape: Sequence, out: Sequence, guards: list | None = None) -> list:
    """Element strides of an operand of ``shape`` read at the indices of ``out`` (right
    aligned; 0 on broadcast axes).

    Where no proof decides whether an axis broadcasts (``a`` against ``Max(a, b)``, a
    data-dependent ``_d0`` against 3), the stride is chosen at run time:
    ``Min(d - 1, 1) * acc`` is 0 when the operand's dim ``d`` is 1 and ``acc`` otherwise,
    which is right whenever ``d`` is 1 or the result's dim. That condition is appended to
    ``guards`` as ``(axis, d, out[axis])`` for the runtime to check before the kernel runs;
    without ``guards`` such an axis raises :class:`Unsupported`.

    Example:
        >>> broadcast_strides((3, 1), (2, 3, 4))
        [0, 1, 0]
        >>> a, b = sympy.symbols("a b", positive=True, integer=True)
        >>> broadcast_strides((a, 4), (sympy.Max(a, b), 4), guards := [])
        [4*Min(1, a - 1), 1]
    """
    pad = len(out) - len(shape)
    strides: list = [0] * len(out)
    acc = sympy.Integer(1)
    for k in reversed(range(len(out))):
        if k < pad:
            continue
        d = shape[k - pad]
        if d != 1 and not dims_equal(d, out[k]):
            if guards is None:
                # e.g. a data-dependent _d0 against 3: broadcast or not is only known at run time
                raise Unsupported(f"operand dim {d} against result dim {out[k]}: whether it broadcasts is known "
                                  "only at run time")
            guards.append((k, d, out[k]))
            strides[k] = acc * sympy.Min(d - 1, 1)
        else:
            strides[k] = 0 if (d == 1 and out[k] != 1) else acc
        acc = acc * d
    return strides


def collapse(out: Sequence, operand_strides: list[list]) -> tuple[list, list[list]]:
    """Drop size-1 axes and merge adjacent axes that are contiguous for every operand.

    Example:
        >>> collapse((2, 3, 4), [[12, 4, 1], [0, 1, 0]])
        ([2, 3, 4], [[12, 4, 1], [0, 1, 0]])
        >>> collapse((2, 3, 4), [[12, 4, 1], [12, 4, 1]])
        ([24], [[1], [1]])
    """
    sizes: list = []
    strides: list[list] = [[] for _ in operand_strides]
    for k, n in enumerate(out):
        if n == 1:
            continue
        if sizes and all(dims_equal(s[-1], op[k] * n) for s, op in zip(strides, operand_strides)):
            sizes[-1] = sizes[-1] * n
            for s, op in zip(strides, operand_strides):
                s[-1] = op[k]
            continue
        sizes.append(n)
        for s, op in zip(strides, operand_strides):
            s.append(op[k])
    if not sizes:
        return [sympy.Integer(1)], [[0] for _ in operand_strides]
    return sizes, strides


def emit_elementwise(ctx: KernelContext, body: Body, inputs: Sequence[int]) -> None:
    """``out[idx] = body(in_0[idx'], in_1[idx''], ...)`` over output 0's shape, reading the
    node inputs ``inputs`` with broadcasting (operands in their own element types). The
    outermost loop is shared over the kernel's parts (each element is read and written by
    one part, so an output in place of an input is safe): the kernel is the whole op."""
    out_shape = ctx.shape(ctx.out_type(0))
    shapes = [ctx.shape(ctx.in_type(i)) for i in inputs]
    operand_strides = [broadcast_strides(out_shape, out_shape)] + [broadcast_strides(s, out_shape, ctx.broadcast_guards)
                                                                   for s in shapes]
    sizes, strides = collapse(out_shape, operand_strides)
    b = ctx.builder
    pointers = [ctx.out_ptr(0)] + [ctx.in_ptr(i) for i in inputs]

    def nest(level: int, offsets: list[ir.Value]) -> None:
        lo, hi = ctx.share(ctx.dim(sizes[level])) if level == 0 else (ir.Constant(I64, 0), ctx.dim(sizes[level]))
        with ctx.loop(hi, name=f"i{level}", start=lo) as i:
            here = [b.add(off, b.mul(i, ctx.dim(st[level]))) if st[level] != 0 else off
                    for off, st in zip(offsets, strides)]
            if level + 1 < len(sizes):
                nest(level + 1, here)
                return
            values = [b.load(b.gep(p, [off])) for p, off in zip(pointers[1:], here[1:])]
            result = body(b, ctx.math, values)
            b.store(result, b.gep(pointers[0], [here[0]]))

    nest(0, [ir.Constant(I64, 0)] * len(pointers))


# ---- the scalar bodies ------------------------------------------------------------------------
def _float_only(ctx: KernelContext) -> ir.Type:
    t = llvm_type(ctx.out_type(0).dtype)
    if not is_float(t):
        raise Unsupported(f"{ctx.node.op} on {ctx.out_type(0).dtype.short} has no generated code")
    for i in range(len(ctx.node.inputs)):
        if ctx.has_input(i) and ctx.in_type(i).dtype != ctx.out_type(0).dtype and ctx.node.op not in ("Clip",):
            raise Unsupported(f"{ctx.node.op} with mixed dtypes has no generated code")
    return t


def _unary(name: str, fn: Callable) -> Callable[[KernelContext], None]:
    def generate(ctx: KernelContext) -> None:
        dtype = ctx.out_type(0).dtype
        if name == "Identity":  # a copy, any dtype
            llvm_type(dtype)
            emit_elementwise(ctx, lambda b, m, xs: xs[0], [0])
            return
        if name in INT_UNARY and not is_float(llvm_type(dtype)) and dtype != DType.BOOL:
            if ctx.in_type(0).dtype != dtype:
                raise Unsupported(f"{name} with mixed dtypes has no generated code")
            body = INT_UNARY[name]
            signed = dtype != DType.UINT8
            emit_elementwise(ctx, lambda b, m, xs: body(b, xs[0], signed), [0])
            return
        _float_only(ctx)
        emit_elementwise(ctx, lambda b, m, xs: fn(ctx, b, m, xs[0]), [0])
    return generate


def _float_sign(b: ir.IRBuilder, x: ir.Value) -> ir.Value:
    """-1, 0 or 1 (NaN and -0 kept, as numpy's sign)."""
    zero, one = ir.Constant(x.type, 0.0), ir.Constant(x.type, 1.0)
    negative = b.select(b.fcmp_ordered("<", x, zero), ir.Constant(x.type, -1.0), x)
    return b.select(b.fcmp_ordered(">", x, zero), one, negative)


def _int_sign(b: ir.IRBuilder, x: ir.Value, signed: bool) -> ir.Value:
    zero = ir.Constant(x.type, 0)
    positive = b.zext(b.icmp_unsigned("!=", x, zero) if not signed else b.icmp_signed(">", x, zero), x.type)
    return positive if not signed else b.sub(positive, b.zext(b.icmp_signed("<", x, zero), x.type))


#: Unary ops on integers: ``(builder, x, signed) -> result`` (wrapping, as numpy and onnxruntime:
#: ``Abs(-128) == -128`` in int8).
INT_UNARY: dict[str, Callable] = {
    "Abs": lambda b, x, signed: b.select(b.icmp_signed("<", x, ir.Constant(x.type, 0)), b.neg(x), x) if signed else x,
    "Neg": lambda b, x, signed: b.neg(x),
    "Sign": _int_sign,
}


UNARY = {
    "Relu": lambda ctx, b, m, x: m.relu(x),
    "Neg": lambda ctx, b, m, x: b.fneg(x),
    "Abs": lambda ctx, b, m, x: m.fabs(x),
    "Exp": lambda ctx, b, m, x: m.exp(x),
    "Log": lambda ctx, b, m, x: m.log(x),
    "Sqrt": lambda ctx, b, m, x: m.sqrt(x),
    "Tanh": lambda ctx, b, m, x: m.tanh(x),
    "Erf": lambda ctx, b, m, x: m.erf(x),
    "Sigmoid": lambda ctx, b, m, x: m.sigmoid(x),
    "Reciprocal": lambda ctx, b, m, x: b.fdiv(m.const(x.type, 1.0), x),
    "Identity": lambda ctx, b, m, x: x,
    "Floor": lambda ctx, b, m, x: m._intrinsic("floor", x),
    "Ceil": lambda ctx, b, m, x: m._intrinsic("ceil", x),
    "Round": lambda ctx, b, m, x: m._intrinsic("roundeven", x),
    "Sign": lambda ctx, b, m, x: _float_sign(b, x),
    "LeakyRelu": lambda ctx, b, m, x: b.select(
        b.fcmp_ordered("<", x, m.const(x.type, 0)), b.fmul(x, m.const(x.type, ctx.attr("alpha", 0.01))), x),
    "HardSigmoid": lambda ctx, b, m, x: m.minimum(m.maximum(
        b.fadd(b.fmul(x, m.const(x.type, ctx.attr("alpha", 0.2))), m.const(x.type, ctx.attr("beta", 0.5))),
        m.const(x.type, 0)), m.const(x.type, 1)),
    "HardSwish": lambda ctx, b, m, x: b.fmul(x, m.minimum(m.maximum(
        b.fadd(b.fmul(x, m.const(x.type, 1 / 6)), m.const(x.type, 0.5)), m.const(x.type, 0)), m.const(x.type, 1))),
}
for _name, _fn in UNARY.items():
    register_kernel(_name, in_place=True)(_unary(_name, _fn))


@register_kernel("IsNaN", "IsInf", in_place=True)
def is_nan_or_inf(ctx: KernelContext) -> None:
    """x is NaN / x is +inf (``detect_positive``) or -inf (``detect_negative``), as a bool byte."""
    t = llvm_type(ctx.in_type(0).dtype)
    if not is_float(t):
        raise Unsupported(f"{ctx.node.op} on {ctx.in_type(0).dtype.short} has no generated code")
    positive, negative = bool(ctx.attr("detect_positive", 1)), bool(ctx.attr("detect_negative", 1))

    def body(b, m, xs):
        x = xs[0]
        if ctx.node.op == "IsNaN":
            flag = b.fcmp_unordered("uno", x, x)
        else:
            flag = ir.Constant(ir.IntType(1), 0)
            if positive:
                flag = b.or_(flag, b.fcmp_ordered("==", x, ir.Constant(t, float("inf"))))
            if negative:
                flag = b.or_(flag, b.fcmp_ordered("==", x, ir.Constant(t, float("-inf"))))
        return b.zext(flag, ir.IntType(8))

    emit_elementwise(ctx, body, [0])


def _binary_float(op: str) -> Callable:
    return {"Add": lambda b, m, x, y: b.fadd(x, y), "Sub": lambda b, m, x, y: b.fsub(x, y),
            "Mul": lambda b, m, x, y: b.fmul(x, y), "Div": lambda b, m, x, y: b.fdiv(x, y),
            "Max": lambda b, m, x, y: m.maximum(x, y), "Min": lambda b, m, x, y: m.minimum(x, y),
            "Sum": lambda b, m, x, y: b.fadd(x, y), "Mean": lambda b, m, x, y: b.fadd(x, y),
            "Pow": lambda b, m, x, y: m._intrinsic("pow", x, y)}[op]


def _binary_int(op: str, signed: bool) -> Callable:
    if op in ("Add", "Sum"):
        return lambda b, m, x, y: b.add(x, y)
    if op == "Sub":
        return lambda b, m, x, y: b.sub(x, y)
    if op == "Mul":
        return lambda b, m, x, y: b.mul(x, y)
    if op == "Div":
        return lambda b, m, x, y: _int_divide(b, x, y, signed)
    if op in ("Max", "Min"):
        compare = ">" if op == "Max" else "<"
        if signed:
            return lambda b, m, x, y: b.select(b.icmp_signed(compare, x, y), x, y)
        return lambda b, m, x, y: b.select(b.icmp_unsigned(compare, x, y), x, y)
    raise Unsupported(f"integer {op} has no generated code")


def _safe_divisor(b: ir.IRBuilder, x: ir.Value, y: ir.Value, signed: bool) -> tuple[ir.Value, ir.Value]:
    """(y with 0 and, for signed types, -1 replaced by 1; the y == 0 flag): division by zero
    traps in hardware, and MIN / -1 overflows."""
    zero, one = ir.Constant(y.type, 0), ir.Constant(y.type, 1)
    is_zero = b.icmp_unsigned("==", y, zero)
    unsafe = b.or_(is_zero, b.icmp_signed("==", y, ir.Constant(y.type, -1))) if signed else is_zero
    return b.select(unsafe, one, y), is_zero


def _int_divide(b: ir.IRBuilder, x: ir.Value, y: ir.Value, signed: bool) -> ir.Value:
    """x / y truncated toward zero (as C and onnxruntime; egraft's reference agrees); 0 for y == 0,
    -x (wrapping) for y == -1."""
    divisor, is_zero = _safe_divisor(b, x, y, signed)
    zero = ir.Constant(y.type, 0)
    if not signed:
        return b.select(is_zero, zero, b.udiv(x, divisor))
    quotient = b.sdiv(x, divisor)
    quotient = b.select(b.icmp_signed("==", y, ir.Constant(y.type, -1)), b.sub(zero, x), quotient)
    return b.select(is_zero, zero, quotient)


def _int_remainder(b: ir.IRBuilder, x: ir.Value, y: ir.Value, signed: bool, fmod: bool) -> ir.Value:
    """x mod y with the sign of y (numpy's mod) or, with ``fmod``, of x (C's %); 0 for y == 0."""
    divisor, is_zero = _safe_divisor(b, x, y, signed)
    zero = ir.Constant(y.type, 0)
    if not signed:
        return b.select(is_zero, zero, b.urem(x, divisor))
    r = b.srem(x, divisor)  # sign of x; y == -1 gives 0, as it should
    if not fmod:
        fix = b.and_(b.icmp_signed("!=", r, zero), b.xor(b.icmp_signed("<", r, zero), b.icmp_signed("<", y, zero)))
        r = b.select(fix, b.add(r, y), r)
    return b.select(is_zero, zero, r)


def _float_remainder(b: ir.IRBuilder, x: ir.Value, y: ir.Value, fmod: bool) -> ir.Value:
    """fmod(x, y) (``fmod``), or numpy's mod: the remainder takes y's sign."""
    r = b.frem(x, y)
    if fmod:
        return r
    zero = ir.Constant(x.type, 0.0)
    fix = b.and_(b.fcmp_ordered("!=", r, zero),
                 b.xor(b.fcmp_ordered("<", r, zero), b.fcmp_ordered("<", y, zero)))
    return b.select(fix, b.fadd(r, y), r)


@register_kernel("Add", "Sub", "Mul", "Div", "Pow", "Max", "Min", "Sum", "Mean", in_place=True)
def binary(ctx: KernelContext) -> None:
    """Binary ops, and the variadic Sum/Max/Min/Mean folded left over their inputs."""
    op = ctx.node.op
    out_dtype = ctx.out_type(0).dtype
    n = len(ctx.node.inputs)
    if any(ctx.in_type(i).dtype != out_dtype for i in range(n)):
        raise Unsupported(f"{op} with mixed dtypes has no generated code")
    t = llvm_type(out_dtype)
    if out_dtype == DType.BOOL:
        raise Unsupported(f"{op} on {out_dtype.short} has no generated code")
    fn = _binary_float(op) if is_float(t) else _binary_int(op, signed=out_dtype != DType.UINT8)

    def body(b, m, xs):
        acc = xs[0]
        for x in xs[1:]:
            acc = fn(b, m, acc, x)
        if op == "Mean" and n > 1:
            acc = b.fdiv(acc, m.const(t, n)) if is_float(t) else b.sdiv(acc, m.const(t, n))
        return acc

    if op == "Mean" and not is_float(t):
        raise Unsupported("integer Mean has no generated code")
    if op == "Pow" and is_float(t) and _squares(ctx):  # x ** 2 as x * x: exact, and no libm call per element
        emit_elementwise(ctx, lambda b, m, xs: b.fmul(xs[0], xs[0]), [0])
        return
    emit_elementwise(ctx, body, list(range(n)))


def _squares(ctx: KernelContext) -> bool:
    """Whether a Pow's exponent is the constant 2 (one element) and its output has the base's
    shape: T5's RMSNorm squares through Pow, which LLVM left a powf call per element (0.5 ms
    for 65,536 floats). The square is correctly rounded either way."""
    exponent = ctx.constant(1)
    if exponent is None or np.asarray(exponent).size != 1 or float(np.asarray(exponent).reshape(-1)[0]) != 2.0:
        return False
    x, y = ctx.shape(ctx.in_type(0)), ctx.shape(ctx.out_type(0))
    return len(x) == len(y) and all(a == b for a, b in zip(x, y))


@register_kernel("Mod", in_place=True)
def mod(ctx: KernelContext) -> None:
    """a mod b with b's sign (``fmod=0``, integers) or a's (``fmod=1``), broadcasting."""
    dtype = ctx.out_type(0).dtype
    if ctx.in_type(0).dtype != dtype or ctx.in_type(1).dtype != dtype or dtype == DType.BOOL:
        raise Unsupported(f"Mod on {dtype.short} (or mixed dtypes) has no generated code")
    fmod = bool(ctx.attr("fmod", 0))
    if is_float(llvm_type(dtype)):
        emit_elementwise(ctx, lambda b, m, xs: _float_remainder(b, xs[0], xs[1], fmod), [0, 1])
    else:
        emit_elementwise(ctx, lambda b, m, xs: _int_remainder(b, xs[0], xs[1], dtype != DType.UINT8, fmod), [0, 1])


@register_kernel("Clip", in_place=True)
def clip(ctx: KernelContext) -> None:
    """min(max(x, lo), hi) with lo/hi as inputs (opset 11+; constant, or computed scalars read
    once when the kernel runs) or attributes; floats and integers."""
    dtype = ctx.out_type(0).dtype
    t = llvm_type(dtype)
    if dtype == DType.BOOL or any(ctx.has_input(i) and ctx.in_type(i).dtype != dtype for i in range(3)):
        raise Unsupported(f"Clip on {dtype.short} (or mixed dtypes) has no generated code")
    bounds: list[ir.Value | None] = []
    for index, attr in ((1, "min"), (2, "max")):
        if ctx.has_input(index):
            value = ctx.constant(index)
            if value is not None:
                bounds.append(ctx.math.const(t, value.reshape(-1)[0].item()))
            elif any(d != 1 for d in ctx.shape(ctx.in_type(index))):
                raise Unsupported(f"Clip bound of shape {list(ctx.shape(ctx.in_type(index)))} (a scalar only)")
            else:
                bounds.append(ctx.builder.load(ctx.in_ptr(index)))
        else:
            value = ctx.attr(attr, None)
            bounds.append(None if value is None else ctx.math.const(t, value))
    signed = dtype != DType.UINT8

    def less(b, x, y):
        if is_float(t):
            return b.fcmp_ordered("<", x, y)
        return b.icmp_signed("<", x, y) if signed else b.icmp_unsigned("<", x, y)

    def body(b, m, xs):
        x = xs[0]
        if bounds[0] is not None:
            x = b.select(less(b, x, bounds[0]), bounds[0], x)
        if bounds[1] is not None:
            x = b.select(less(b, bounds[1], x), bounds[1], x)
        return x

    emit_elementwise(ctx, body, [0])


@register_kernel("Where", in_place=True)
def where(ctx: KernelContext) -> None:
    """cond ? a : b with broadcasting; cond is bool (one byte)."""
    if ctx.in_type(1).dtype != ctx.out_type(0).dtype or ctx.in_type(2).dtype != ctx.out_type(0).dtype:
        raise Unsupported("Where with mixed dtypes has no generated code")
    llvm_type(ctx.out_type(0).dtype)

    def body(b, m, xs):
        return b.select(b.icmp_unsigned("!=", xs[0], ir.Constant(xs[0].type, 0)), xs[1], xs[2])

    emit_elementwise(ctx, body, [0, 1, 2])


@register_kernel("Elementwise", domain="com.egraft", in_place=True)
def fused_elementwise(ctx: KernelContext) -> None:
    """egraft's fused chain: the ``expr`` body (``relu(add(mul(x0, x1), x2))``) in one loop."""
    t = _float_only(ctx)
    tree = parse_expr(ctx.attr("expr", "x0"))
    n = len(ctx.node.inputs)
    calls = {
        "add": lambda b, m, a: b.fadd(*a), "sub": lambda b, m, a: b.fsub(*a), "mul": lambda b, m, a: b.fmul(*a),
        "div": lambda b, m, a: b.fdiv(*a), "pow": lambda b, m, a: m._intrinsic("pow", *a),
        "max": lambda b, m, a: m.maximum(*a), "min": lambda b, m, a: m.minimum(*a),
        "neg": lambda b, m, a: b.fneg(a[0]), "abs": lambda b, m, a: m.fabs(a[0]),
        "relu": lambda b, m, a: m.relu(a[0]), "sigmoid": lambda b, m, a: m.sigmoid(a[0]),
        "tanh": lambda b, m, a: m.tanh(a[0]), "exp": lambda b, m, a: m.exp(a[0]), "log": lambda b, m, a: m.log(a[0]),
        "sqrt": lambda b, m, a: m.sqrt(a[0]), "erf": lambda b, m, a: m.erf(a[0]),
    }

    def body(b, m, xs):
        def walk(node):
            kind = node[0]
            if kind == "input":
                return xs[node[1]]
            if kind == "number":
                return m.const(t, node[1])
            return calls[node[1]](b, m, [walk(a) for a in node[2]])
        return walk(tree)

    emit_elementwise(ctx, body, list(range(n)))

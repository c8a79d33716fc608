"""The generator's op specs: for each op kind, which inputs it may take (dtype, rank, which
dims must be fixed), which attributes it may draw, and the shape and bounds of what it
makes. A spec is a function ``spec(b: Builder) -> bool`` that adds the op (and any
conditioning nodes it needs: ``|x| + c`` before Log, a scale before Exp) reading values of
the builder's pool, or returns False when no value in the pool fits.

:data:`SPECS` maps each op kind to its spec; :data:`WEIGHTS` how often it is drawn.
"""

from __future__ import annotations

import math

import numpy as np

from egraft.testing.fuzz.builder import (
    BOOL,
    FLOAT,
    INT64,
    MAX_ELEMENTS,
    Builder,
    Dim,
    Val,
    broadcast,
    derive,
    elements,
    fixed,
    product,
)

INT64_MAX = 2**63 - 1
INT64_MIN = -(2**63)


def _sig(x: float) -> float:
    return 1 / (1 + math.exp(-max(min(x, 50), -50)))


# op kind -> (bounds of the result from the input's (lo, hi) and the attrs, attrs drawn by rng,
#             what the input must satisfy: None, ("exp", limit) or ("pos", margin))
def _unary_table(b: Builder):
    r = b.rng
    alpha = float(np.round(r.uniform(0.01, 0.5), 3))
    beta = float(np.round(r.uniform(0.3, 0.7), 3))
    return {
        "Relu": (lambda lo, hi: (max(lo, 0), max(hi, 0)), {}, None),
        "Sigmoid": (lambda lo, hi: (_sig(lo), _sig(hi)), {}, None),
        "Tanh": (lambda lo, hi: (math.tanh(lo), math.tanh(hi)), {}, None),
        "Abs": (lambda lo, hi: (0.0, max(abs(lo), abs(hi))), {}, None),
        "Neg": (lambda lo, hi: (-hi, -lo), {}, None),
        "Erf": (lambda lo, hi: (math.erf(lo), math.erf(hi)), {}, None),
        "Softplus": (lambda lo, hi: (0.0, max(hi, 0) + 0.7), {}, ("exp", 15.0)),
        "Softsign": (lambda lo, hi: (-1.0, 1.0), {}, None),
        "LeakyRelu": (lambda lo, hi: (min(lo, lo * alpha), hi), {"alpha": alpha}, None),
        "Elu": (lambda lo, hi: (max(min(lo, 0), -alpha), hi), {"alpha": alpha}, ("exp", 20.0)),
        "Selu": (lambda lo, hi: (-1.76, max(hi, 0) * 1.06), {}, ("exp", 20.0)),
        "HardSigmoid": (lambda lo, hi: (0.0, 1.0), {"alpha": alpha, "beta": beta}, None),
        "HardSwish": (lambda lo, hi: (-0.5, max(hi, 0)), {}, None),
        "Floor": (lambda lo, hi: (math.floor(lo), math.floor(hi)), {}, None),
        "Ceil": (lambda lo, hi: (math.ceil(lo), math.ceil(hi)), {}, None),
        "Round": (lambda lo, hi: (round(lo) - 1, round(hi) + 1), {}, None),
        "Sign": (lambda lo, hi: (-1.0, 1.0), {}, None),
        "Sin": (lambda lo, hi: (-1.0, 1.0), {}, ("exp", 50.0)),
        "Cos": (lambda lo, hi: (-1.0, 1.0), {}, ("exp", 50.0)),
        "Exp": (lambda lo, hi: (math.exp(lo), math.exp(hi)), {}, ("exp", 4.0)),
        "Log": (lambda lo, hi: (math.log(lo), math.log(hi)), {}, ("pos", 0.1)),
        "Sqrt": (lambda lo, hi: (math.sqrt(lo), math.sqrt(hi)), {}, ("pos", 0.01)),
        "Reciprocal": (lambda lo, hi: (1 / hi, 1 / lo), {}, ("pos", 0.25)),
        "Identity": (lambda lo, hi: (lo, hi), {}, None),
        "ThresholdedRelu": (lambda lo, hi: (min(lo, 0), max(hi, 0)), {"alpha": alpha}, None),
    }


UNARY = ("Relu", "Sigmoid", "Tanh", "Abs", "Neg", "Erf", "Softplus", "Softsign", "LeakyRelu", "Elu", "Selu",
         "HardSigmoid", "HardSwish", "Floor", "Ceil", "Round", "Sign", "Sin", "Cos", "Exp", "Log", "Sqrt",
         "Reciprocal", "Identity", "ThresholdedRelu")


def unary(op: str):
    def spec(b: Builder) -> bool:
        x = b.pick()
        if x is None:
            return False
        bounds, attrs, need = _unary_table(b)[op]
        if need and need[0] == "exp":
            x = b.bounded(x, need[1])
        elif need and need[0] == "pos":
            x = b.positive(x, need[1])
        lo, hi = bounds(x.lo, x.hi)
        y = b.value(FLOAT, x.shape, lo, hi)
        b.node(op, [x], [y], **attrs)
        return True

    spec.__name__ = op
    return spec


def clip(b: Builder) -> bool:
    x = b.pick()
    if x is None:
        return False
    lo, hi = sorted(np.round(b.rng.uniform(-1.5, 1.5, 2), 3).tolist())
    hi = max(hi, lo + 0.1)
    ins = [x, b.scalar(lo) if b.chance(0.8) else "", b.scalar(hi) if b.chance(0.8) else ""]
    while ins[-1] == "":
        ins.pop()
    y_lo = max(x.lo, lo) if len(ins) > 1 and ins[1] else x.lo
    y_hi = min(x.hi, hi) if len(ins) > 2 else x.hi
    y = b.value(FLOAT, x.shape, min(y_lo, y_hi), max(y_lo, y_hi))
    b.node("Clip", ins, [y])
    return True


def _operand(b: Builder, x: Val, dtype: int = FLOAT,
             nonzero: bool = False) -> tuple[str | Val, tuple, float, float] | None:
    """A second operand broadcasting with ``x``: another value of the pool, or a new
    initializer whose shape keeps some of ``x``'s fixed trailing dims and sets others to 1.
    Returns it, the broadcast shape and its bounds."""
    if b.chance(0.45):
        y = b.pick(lambda v: v is not x and broadcast(x.shape, v.shape) is not None
                   and elements(broadcast(x.shape, v.shape)) <= MAX_ELEMENTS, dtype)
        if y is not None:
            return y, broadcast(x.shape, y.shape), y.lo, y.hi
    keep = int(b.rng.integers(0, x.rank + 1))
    shape = [d.a if d.static and b.chance(0.7) else 1 for d in x.shape[x.rank - keep:]]
    if b.chance(0.15):
        shape = [int(b.rng.integers(2, 4))] + shape  # the constant adds a leading dim
    out = broadcast(x.shape, tuple(fixed(s) for s in shape))
    if out is None or elements(out) > MAX_ELEMENTS:
        return None
    if nonzero:  # |c| in [0.5, 2]
        arr = (b.rng.choice([-1, 1], size=shape) * b.rng.uniform(0.5, 2.0, size=shape)).astype(np.float32)
    elif dtype == FLOAT:
        arr = b.rng.uniform(-1.5, 1.5, size=shape).astype(np.float32)
    else:
        arr = b.rng.integers(-3, 4, size=shape).astype(np.int64)
    return b.const(arr), out, float(arr.min(initial=0)), float(arr.max(initial=0))


def _interval(op: str, a: tuple[float, float], c: tuple[float, float]) -> tuple[float, float]:
    if op in ("Add", "Sum"):
        return a[0] + c[0], a[1] + c[1]
    if op == "Sub":
        return a[0] - c[1], a[1] - c[0]
    if op in ("Mul", "Div"):
        if op == "Div":
            c = (1 / c[1], 1 / c[0])
        p = [a[0] * c[0], a[0] * c[1], a[1] * c[0], a[1] * c[1]]
        return min(p), max(p)
    if op == "Max":
        return max(a[0], c[0]), max(a[1], c[1])
    if op == "Min":
        return min(a[0], c[0]), min(a[1], c[1])
    if op == "Mean":
        return (a[0] + c[0]) / 2, (a[1] + c[1]) / 2
    raise ValueError(op)


def binary(op: str):
    def spec(b: Builder) -> bool:
        dtype = INT64 if op in ("Add", "Sub", "Mul", "Max", "Min") and b.chance(0.1) else FLOAT
        x = b.pick(dtype=dtype)
        if x is None:
            return False
        got = _operand(b, x, dtype, nonzero=op == "Div")
        if got is None:
            return False
        y, shape, lo, hi = got
        if op == "Div":  # the denominator away from 0: |y| + c, or a constant with |c| in [0.5, 2]
            if isinstance(y, Val):
                y = b.positive(y, 0.5)
                lo, hi = y.lo, y.hi
            else:
                lo, hi = 0.5, 2.0  # bounds of |c|: x / c lies within |x| / 0.5
                z = b.value(FLOAT, shape, -2 * x.mag, 2 * x.mag)
                b.node("Div", [x, y], [z])
                return True
        ins = [x, y] if b.chance(0.7) or op == "Div" else [y, x]
        z_lo, z_hi = _interval(op, (x.lo, x.hi), (lo, hi))
        if dtype == INT64 and max(abs(z_lo), abs(z_hi)) > 1e6:
            return False
        z = b.value(dtype, shape, z_lo, z_hi)
        b.node(op, ins, [z])
        return True

    spec.__name__ = op
    return spec


def variadic(op: str):
    def spec(b: Builder) -> bool:
        x = b.pick()
        if x is None:
            return False
        ins, shape, lo, hi = [x], x.shape, x.lo, x.hi
        for _ in range(int(b.rng.integers(1, 3))):
            got = _operand(b, x)
            if got is None:
                break
            y, s, y_lo, y_hi = got
            s = broadcast(shape, s)
            if s is None or elements(s) > MAX_ELEMENTS:
                break
            ins.append(y)
            shape = s
            lo, hi = _interval("Sum" if op in ("Sum",) else op, (lo, hi), (y_lo, y_hi)) if op != "Mean" else (
                min(lo, y_lo), max(hi, y_hi))
        z = b.value(FLOAT, shape, lo, hi)
        b.node(op, ins, [z])
        return True

    spec.__name__ = op
    return spec


def pow_(b: Builder) -> bool:
    x = b.pick()
    if x is None:
        return False
    x = b.positive(b.bounded(x, 3.0), 0.2)
    if b.chance(0.5):
        e = b.choice([2.0, 3.0, 0.5, -1.0, 1.5, -0.5])
        y = b.scalar(e)
        es = [e]
    else:
        size = [x.shape[-1].a] if x.shape and x.shape[-1].static else [1]
        arr = np.round(b.rng.uniform(-1.5, 2.5, size=size), 2).astype(np.float32)
        y = b.const(arr)
        es = arr.tolist()
    cands = [x.lo ** e for e in es] + [x.hi ** e for e in es]
    z = b.value(FLOAT, x.shape, min(cands), max(cands))
    b.node("Pow", [x, y], [z])
    return True


def prelu(b: Builder) -> bool:
    x = b.pick(lambda v: v.rank >= 1)
    if x is None:
        return False
    shape = [d.a if d.static and b.chance(0.6) else 1 for d in x.shape[1:]] if x.rank > 1 else [1]
    slope = b.rng.uniform(0.0, 0.5, size=shape).astype(np.float32)
    z = b.value(FLOAT, x.shape, min(x.lo * 0.5, x.lo), x.hi)
    b.node("PRelu", [x, b.const(slope)], [z])
    return True


def _condition(b: Builder, x: Val) -> Val:
    """A bool value broadcasting with ``x``: one from the pool, else a comparison of ``x``."""
    c = b.pick(lambda v: broadcast(x.shape, v.shape) == x.shape, BOOL)
    if c is not None:
        return c
    c = b.value(BOOL, x.shape, 0, 1)
    b.node(b.choice(["Less", "Greater"]), [x, b.scalar(float(np.round(b.rng.uniform(x.lo, x.hi), 3)))], [c])
    return c


def where(b: Builder) -> bool:
    x = b.pick()
    if x is None:
        return False
    got = _operand(b, x)
    if got is None:
        return False
    y, shape, lo, hi = got
    c = _condition(b, x)
    z = b.value(FLOAT, shape, min(lo, x.lo), max(hi, x.hi))
    b.node("Where", [c, x, y] if b.chance(0.5) else [c, y, x], [z])
    return True


def compare(op: str):
    def spec(b: Builder) -> bool:
        dtype = INT64 if op == "Equal" else b.choice([FLOAT, FLOAT, FLOAT, INT64])
        x = b.pick(dtype=dtype)
        if x is None:
            return False
        got = _operand(b, x, dtype)
        if got is None:
            return False
        y, shape, _, _ = got
        z = b.value(BOOL, shape, 0, 1)
        b.node(op, [x, y], [z])
        return True

    spec.__name__ = op
    return spec


def logical(op: str):
    def spec(b: Builder) -> bool:
        x = b.pick(dtype=BOOL)
        if x is None:
            return False
        if op == "Not":
            z = b.value(BOOL, x.shape, 0, 1)
            b.node("Not", [x], [z])
            return True
        y = b.pick(lambda v: broadcast(x.shape, v.shape) is not None, BOOL)
        if y is None:
            return False
        z = b.value(BOOL, broadcast(x.shape, y.shape), 0, 1)
        b.node(op, [x, y], [z])
        return True

    spec.__name__ = op
    return spec


def cast(b: Builder) -> bool:
    x = b.pick(lambda v: v.dtype != FLOAT or v.mag < 1000, None)
    if x is None:
        return False
    if x.dtype == FLOAT:
        to = b.choice([INT64, BOOL, FLOAT])
    elif x.dtype == BOOL:
        to = b.choice([FLOAT, INT64])
    else:
        to = b.choice([FLOAT, BOOL])
    lo, hi = (0, 1) if to == BOOL else (math.trunc(x.lo), math.trunc(x.hi)) if to == INT64 else (x.lo, x.hi)
    z = b.value(to, x.shape, lo, hi)
    b.node("Cast", [x], [z], to=to)
    return True


def _axes(b: Builder, rank: int, at_least: int = 1) -> list[int]:
    k = int(b.rng.integers(at_least, rank + 1))
    axes = sorted(b.rng.choice(rank, size=k, replace=False).tolist())
    return [a - rank if b.chance(0.3) else a for a in axes]


REDUCE_BOUNDS = {
    "ReduceSum": lambda lo, hi, n: (min(lo * n, lo), max(hi * n, hi)),
    "ReduceMean": lambda lo, hi, n: (lo, hi),
    "ReduceMax": lambda lo, hi, n: (lo, hi),
    "ReduceMin": lambda lo, hi, n: (lo, hi),
    "ReduceL1": lambda lo, hi, n: (0, n * max(abs(lo), abs(hi))),
    "ReduceL2": lambda lo, hi, n: (0, math.sqrt(n) * max(abs(lo), abs(hi))),
    "ReduceSumSquare": lambda lo, hi, n: (0, n * max(abs(lo), abs(hi)) ** 2),
    "ReduceLogSumExp": lambda lo, hi, n: (lo, hi + math.log(n)),
    "ReduceProd": lambda lo, hi, n: (-max(abs(lo), abs(hi)) ** n, max(abs(lo), abs(hi)) ** n),
}


def reduce(op: str):
    def spec(b: Builder) -> bool:
        x = b.pick(lambda v: v.rank >= 1)
        if x is None:
            return False
        if op == "ReduceLogSumExp":
            x = b.bounded(x, 10.0)
        if op == "ReduceProd":
            x = b.bounded(x, 1.2)
        axes = _axes(b, x.rank) if b.chance(0.85) else None
        keep = int(b.chance(0.5))
        reduced = set(range(x.rank)) if axes is None else {a % x.rank for a in axes}
        n = math.prod(x.shape[a].hi for a in reduced)
        if op == "ReduceProd" and n > 16:
            return False
        shape = [fixed(1) if i in reduced else d for i, d in enumerate(x.shape) if keep or i not in reduced]
        lo, hi = REDUCE_BOUNDS[op](x.lo, x.hi, n)
        z = b.value(FLOAT, shape, lo, hi)
        axes_input = b.opset >= 18 or op == "ReduceSum"
        if axes is None:
            b.node(op, [x], [z], keepdims=keep)
        elif axes_input:
            b.node(op, [x, b.ints(axes)], [z], keepdims=keep)
        else:
            b.node(op, [x], [z], keepdims=keep, axes=axes)
        return True

    spec.__name__ = op
    return spec


def softmax(op: str):
    def spec(b: Builder) -> bool:
        x = b.pick(lambda v: v.rank >= 1)
        if x is None:
            return False
        axis = int(b.rng.integers(-x.rank, x.rank))
        n = x.shape[axis].hi
        lo, hi = {"Softmax": (0, 1), "Hardmax": (0, 1), "LogSoftmax": (x.lo - x.hi - math.log(n) - 1, 0)}[op]
        z = b.value(FLOAT, x.shape, lo, hi)
        b.node(op, [x], [z], axis=axis if b.chance(0.8) else None)
        return True

    spec.__name__ = op
    return spec


def matmul(b: Builder) -> bool:
    x = b.pick(lambda v: v.rank >= 1 and v.rank <= 4)
    if x is None:
        return False
    k = x.shape[-1]
    if k.static and b.chance(0.7):
        n = int(b.rng.integers(1, 9))
        batch = [] if x.rank < 2 or b.chance(0.7) else [d.a if d.static else 1 for d in x.shape[:-2]]
        w, s = b.weights([*batch, k.a, n], 1 / math.sqrt(k.a))
        wshape = tuple(fixed(d) for d in [*batch, k.a, n])
        y_shape, y_lo, y_hi = wshape, -s, s
        y = w
    else:
        cand = b.pick(lambda v: v.rank >= 2 and v.shape[-2].label == k.label and v is not x)
        if cand is not None:
            y, y_shape, y_lo, y_hi = cand, cand.shape, cand.lo, cand.hi
        elif x.rank >= 2:  # x @ x^T
            perm = list(range(x.rank))
            perm[-1], perm[-2] = perm[-2], perm[-1]
            t_shape = tuple(x.shape[p] for p in perm)
            y = b.value(FLOAT, t_shape, x.lo, x.hi)
            b.node("Transpose", [x], [y], perm=perm)
            y_shape, y_lo, y_hi = t_shape, x.lo, x.hi
        else:
            return False
    xs = x.shape if x.rank >= 2 else (fixed(1), *x.shape)
    ys = y_shape if len(y_shape) >= 2 else (*y_shape, fixed(1))
    batch = broadcast(xs[:-2], ys[:-2])
    if batch is None:
        return False
    shape = (*batch, *(xs[-2:-1] if x.rank >= 2 else ()), *(ys[-1:] if len(y_shape) >= 2 else ()))
    if elements(shape) > MAX_ELEMENTS:
        return False
    bound = k.hi * x.mag * max(abs(y_lo), abs(y_hi))
    z = b.value(FLOAT, shape, -bound, bound)
    b.node("MatMul", [x, y], [z])
    return True


def gemm(b: Builder) -> bool:
    trans_a = b.chance(0.3)
    x = b.pick(lambda v: v.rank == 2 and v.shape[0 if trans_a else 1].static)
    if x is None:
        return False
    m, k = (x.shape[1], x.shape[0]) if trans_a else x.shape
    n = int(b.rng.integers(1, 9))
    trans_b = b.chance(0.5)
    w, s = b.weights([n, k.a] if trans_b else [k.a, n], 1 / math.sqrt(k.a))
    alpha = b.choice([1.0, 0.5, 2.0, -1.0])
    beta = b.choice([1.0, 0.5, 0.0, -2.0])
    ins = [x, w]
    if b.chance(0.7):
        shapes = [[n], [1, n], []] + ([[m.a, n], [m.a, 1]] if m.static else [])
        ins.append(b.const(b.rng.uniform(-1, 1, size=b.choice(shapes)).astype(np.float32)))
    bound = abs(alpha) * k.a * x.mag * s + abs(beta)
    z = b.value(FLOAT, (m, fixed(n)), -bound, bound)
    b.node("Gemm", ins, [z], alpha=alpha if b.chance(0.5) else None, beta=beta if len(ins) == 3 else None,
           transA=int(trans_a) if trans_a or b.chance(0.2) else None, transB=int(trans_b))
    return True


def _spatial(b: Builder, max_rank: int = 4):
    return b.pick(lambda v: 3 <= v.rank <= max_rank and v.shape[1].static)


def _window_out(d: Dim, k: int, s: int, dil: int, pb: int, pe: int, ceil: bool = False) -> Dim | None:
    def size(i: int) -> int:
        span = i + pb + pe - ((k - 1) * dil + 1)
        return (-(-span // s) if ceil else span // s) + 1

    if d.lo + pb + pe < (k - 1) * dil + 1:
        return None
    out = derive(f"win{k}s{s}d{dil}p{pb}_{pe}{'c' if ceil else ''}", [d], size)
    return out if out.lo >= 1 else None


def conv(b: Builder) -> bool:
    x = _spatial(b)
    if x is None:
        return False
    c = x.shape[1].a
    groups = b.choice([g for g in (1, 1, 2, 3, 4, c) if c % g == 0])
    m = groups * int(b.rng.integers(1, 4 if groups > 1 else 9))
    nsp = x.rank - 2
    ks = [int(b.rng.integers(1, 4)) for _ in range(nsp)]
    strides = [int(b.rng.integers(1, 3)) for _ in range(nsp)]
    dil = [int(b.rng.integers(1, 3)) if b.chance(0.2) else 1 for _ in range(nsp)]
    auto_pad = b.choice(["NOTSET"] * 6 + ["SAME_UPPER", "SAME_LOWER", "VALID"])
    if auto_pad.startswith("SAME"):  # onnxruntime refuses dilations with SAME padding
        dil = [1] * nsp
    if auto_pad == "NOTSET":
        pads = [int(b.rng.integers(0, k)) if b.chance(0.6) else 0 for k in ks for _ in (0,)]
        pads = pads + [p if b.chance(0.7) else int(b.rng.integers(0, k)) for p, k in zip(pads, ks)]
    else:
        pads = None
    out = []
    for i, d in enumerate(x.shape[2:]):
        if auto_pad.startswith("SAME"):
            o = derive(f"same{strides[i]}", [d], lambda v, s=strides[i]: -(-v // s))
            total = [max(0, (o.at(j) - 1) * strides[i] + (ks[i] - 1) * dil[i] + 1 - d.at(j)) for j in (0, 1)]
            o = o if o.lo >= 1 and d.lo >= 1 and min(total) >= 0 else None
        else:
            pb, pe = (pads[i], pads[i + nsp]) if pads else (0, 0)
            o = _window_out(d, ks[i], strides[i], dil[i], pb, pe)
        if o is None:
            return False
        out.append(o)
    shape = (x.shape[0], fixed(m), *out)
    if elements(shape) > MAX_ELEMENTS:
        return False
    fan = (c // groups) * math.prod(ks)
    w, s = b.weights([m, c // groups, *ks], 1 / math.sqrt(fan))
    ins = [x, w]
    if b.chance(0.6):
        ins.append(b.const(b.rng.uniform(-0.5, 0.5, size=[m]).astype(np.float32)))
    bound = fan * x.mag * s + 0.5
    z = b.value(FLOAT, shape, -bound, bound)
    b.node("Conv", ins, [z], kernel_shape=ks if b.chance(0.7) else None,
           strides=strides if any(v > 1 for v in strides) or b.chance(0.3) else None,
           pads=pads if pads and any(pads) else None, dilations=dil if any(v > 1 for v in dil) else None,
           group=groups if groups > 1 or b.chance(0.2) else None,
           auto_pad=auto_pad if auto_pad != "NOTSET" else None)
    return True


def pool(op: str):
    def spec(b: Builder) -> bool:
        x = _spatial(b)
        if x is None:
            return False
        nsp = x.rank - 2
        ks = [int(b.rng.integers(1, 4)) for _ in range(nsp)]
        strides = [int(b.rng.integers(1, 3)) for _ in range(nsp)]
        dil = [int(b.rng.integers(1, 3)) if op == "MaxPool" and b.chance(0.15) else 1 for _ in range(nsp)]
        pads = [int(b.rng.integers(0, (k + 1) // 2)) if b.chance(0.5) else 0 for k in ks for _ in (0,)]
        pads = pads + pads
        ceil = b.chance(0.2)
        out = []
        for i, d in enumerate(x.shape[2:]):
            o = _window_out(d, ks[i], strides[i], dil[i], pads[i], pads[i + nsp], ceil)
            if o is None:
                return False
            if ceil:  # the last window must start inside the input or its left pad
                if any((o.at(j) - 1) * strides[i] >= d.at(j) + pads[i] for j in (0, 1)):
                    return False
            out.append(o)
        z = b.value(FLOAT, (*x.shape[:2], *out), x.lo, x.hi)
        attrs = {"kernel_shape": ks, "strides": strides if any(v > 1 for v in strides) or b.chance(0.3) else None,
                 "pads": pads if any(pads) else None, "ceil_mode": 1 if ceil else None}
        if op == "MaxPool":
            attrs["dilations"] = dil if any(v > 1 for v in dil) else None
        else:
            attrs["count_include_pad"] = 1 if any(pads) and b.chance(0.5) else None
        b.node(op, [x], [z], **attrs)
        return True

    spec.__name__ = op
    return spec


def global_pool(op: str):
    def spec(b: Builder) -> bool:
        x = _spatial(b, 5)
        if x is None:
            return False
        z = b.value(FLOAT, (*x.shape[:2], *(fixed(1) for _ in x.shape[2:])), x.lo, x.hi)
        b.node(op, [x], [z])
        return True

    spec.__name__ = op
    return spec


def batchnorm(b: Builder) -> bool:
    x = b.pick(lambda v: 2 <= v.rank <= 4 and v.shape[1].static)
    if x is None:
        return False
    c = x.shape[1].a
    r = b.rng
    scale, bias = r.uniform(0.5, 1.5, c), r.uniform(-0.5, 0.5, c)
    mean, var = r.uniform(-0.5, 0.5, c), r.uniform(0.5, 2.0, c)
    eps = b.choice([1e-5, 1e-3, 0.1])
    ins = [x] + [b.const(a.astype(np.float32)) for a in (scale, bias, mean, var)]
    bound = 1.5 * (x.mag + 0.5) / math.sqrt(0.5) + 0.5
    z = b.value(FLOAT, x.shape, -bound, bound)
    b.node("BatchNormalization", ins, [z], epsilon=eps if b.chance(0.5) else None)
    return True


def instancenorm(b: Builder) -> bool:
    x = b.pick(lambda v: 3 <= v.rank <= 4 and v.shape[1].static and elements(v.shape[2:]) > 1
               and all(d.lo > 1 for d in v.shape[2:]) is not None and math.prod(d.lo for d in v.shape[2:]) >= 2)
    if x is None:
        return False
    c = x.shape[1].a
    eps = b.choice([1e-5, 1e-3, 0.01])
    ins = [x, b.const(b.rng.uniform(0.5, 1.5, c).astype(np.float32)),
           b.const(b.rng.uniform(-.5, .5, c).astype(np.float32))]
    n = elements(x.shape[2:])
    bound = 1.5 * math.sqrt(n) + 0.5
    z = b.value(FLOAT, x.shape, -bound, bound)
    b.node("InstanceNormalization", ins, [z], epsilon=eps)
    return True


def layernorm(b: Builder) -> bool:
    if b.opset < 17:
        return False
    x = b.pick(lambda v: v.rank >= 1 and v.shape[-1].static and v.shape[-1].a >= 2)
    if x is None:
        return False
    first = x.rank - 1
    while first > 0 and x.shape[first - 1].static and b.chance(0.4):
        first -= 1
    norm = [d.a for d in x.shape[first:]]
    axis = first - x.rank if b.chance(0.5) else first
    ins = [x, b.const(b.rng.uniform(0.5, 1.5, norm).astype(np.float32))]
    if b.chance(0.7):
        ins.append(b.const(b.rng.uniform(-.5, .5, norm).astype(np.float32)))
    bound = 1.5 * math.sqrt(math.prod(norm)) + 0.5
    z = b.value(FLOAT, x.shape, -bound, bound)
    b.node("LayerNormalization", ins, [z], axis=axis if axis != -1 or b.chance(0.3) else None,
           epsilon=b.choice([1e-5, 1e-3, None]))
    return True


def transpose(b: Builder) -> bool:
    x = b.pick(lambda v: v.rank >= 2, None)
    if x is None:
        return False
    perm = b.rng.permutation(x.rank).tolist() if b.chance(0.85) else None
    order = perm if perm is not None else list(reversed(range(x.rank)))
    z = b.value(x.dtype, tuple(x.shape[p] for p in order), x.lo, x.hi)
    b.node("Transpose", [x], [z], perm=perm)
    return True


def _factor(b: Builder, n: int) -> list[int]:
    """``n`` split into 1-3 factors, in a random order."""
    out = []
    while n > 1 and len(out) < 2 and b.chance(0.6):
        divs = [d for d in range(2, n + 1) if n % d == 0]
        d = b.choice(divs)
        out.append(d)
        n //= d
    out.append(n)
    b.rng.shuffle(out)
    return out


def reshape(b: Builder) -> bool:
    x = b.pick(lambda v: v.rank >= 1, None)
    if x is None:
        return False
    sym = [i for i, d in enumerate(x.shape) if not d.static]
    if not sym:
        sizes = _factor(b, math.prod(d.a for d in x.shape))
        target = list(sizes)
        if b.chance(0.4):
            target[int(b.rng.integers(len(target)))] = -1
        shape = tuple(fixed(s) for s in sizes)
    elif b.chance(0.3):  # everything into one dim
        target, shape = [-1], (product(x.shape),)
    else:  # keep the dims up to the last symbolic one (0 copies them), refactor the rest
        last = sym[-1]
        tail = math.prod(d.a for d in x.shape[last + 1:])
        sizes = _factor(b, tail) if tail > 1 else ([1] if b.chance(0.3) else [])
        head = list(x.shape[:last + 1])
        if len(sym) == 1 and b.chance(0.4):  # the symbolic dim by -1
            target = [0 if i != last else -1 for i in range(last + 1)] + sizes
        else:
            target = [0] * (last + 1) + sizes
        if b.chance(0.3) and last >= 1 and x.shape[last - 1].static and len(sym) == 1:
            target = [0] * (last - 1) + [-1] + sizes  # merge the dim before the symbolic one into it
            head = head[:last - 1] + [product(head[last - 1:])]
        shape = (*head, *(fixed(s) for s in sizes))
    z = b.value(x.dtype, shape, x.lo, x.hi)
    b.node("Reshape", [x, b.ints(target)], [z])
    return True


def flatten(b: Builder) -> bool:
    x = b.pick(lambda v: v.rank >= 1, None)
    if x is None:
        return False
    axis = int(b.rng.integers(0, x.rank + 1))
    shape = (product(x.shape[:axis]), product(x.shape[axis:]))
    z = b.value(x.dtype, shape, x.lo, x.hi)
    b.node("Flatten", [x], [z], axis=axis - x.rank if axis < x.rank and b.chance(0.3) else axis)
    return True


def squeeze(b: Builder) -> bool:
    x = b.pick(lambda v: any(d.label == "1" for d in v.shape), None)
    if x is None:
        return False
    ones = [i for i, d in enumerate(x.shape) if d.label == "1"]
    if all(d.static for d in x.shape) and b.chance(0.3):
        axes = None
    else:
        axes = sorted(b.rng.choice(ones, size=int(b.rng.integers(1, len(ones) + 1)), replace=False).tolist())
    drop = set(ones if axes is None else axes)
    z = b.value(x.dtype, tuple(d for i, d in enumerate(x.shape) if i not in drop), x.lo, x.hi)
    if axes is not None:
        axes = [a - x.rank if b.chance(0.3) else a for a in axes]
    b.node("Squeeze", [x] + ([b.ints(axes)] if axes is not None else []), [z])
    return True


def unsqueeze(b: Builder) -> bool:
    x = b.pick(lambda v: v.rank <= 4, None)
    if x is None:
        return False
    out_rank = x.rank + int(b.rng.integers(1, 3))
    axes = sorted(b.rng.choice(out_rank, size=out_rank - x.rank, replace=False).tolist())
    it = iter(x.shape)
    shape = tuple(fixed(1) if i in axes else next(it) for i in range(out_rank))
    z = b.value(x.dtype, shape, x.lo, x.hi)
    b.node("Unsqueeze", [x, b.ints([a - out_rank if b.chance(0.3) else a for a in axes])], [z])
    return True


def concat(b: Builder) -> bool:
    x = b.pick(lambda v: v.rank >= 1, None)
    if x is None:
        return False
    axis = int(b.rng.integers(0, x.rank))
    parts = [x]
    for _ in range(int(b.rng.integers(1, 3))):
        y = b.pick(lambda v: v.rank == x.rank and all(
            v.shape[i].label == x.shape[i].label for i in range(x.rank) if i != axis), x.dtype)
        if y is not None and b.chance(0.6):
            parts.append(y)
        elif all(d.static for i, d in enumerate(x.shape) if i != axis) and x.dtype == FLOAT:
            shape = [d.a for d in x.shape]
            shape[axis] = int(b.rng.integers(1, 4))
            parts.append(b.const(b.rng.uniform(x.lo, x.hi, shape).astype(np.float32)))
        else:
            parts.append(x)
    dims = []
    for p in parts:
        if isinstance(p, Val):
            dims.append(p.shape[axis])
        else:
            dims.append(fixed(next(t for t in b.initializers if t.name == p).dims[axis]))
    shape = list(x.shape)
    shape[axis] = derive("add", dims, lambda *s: sum(s))
    if elements(shape) > MAX_ELEMENTS:
        return False
    lo = min(p.lo for p in parts if isinstance(p, Val))
    hi = max(p.hi for p in parts if isinstance(p, Val))
    z = b.value(x.dtype, shape, lo, hi)
    b.node("Concat", parts, [z], axis=axis - x.rank if b.chance(0.3) else axis)
    return True


def split(b: Builder) -> bool:
    x = b.pick(lambda v: any(d.static and d.a >= 2 for d in v.shape), None)
    if x is None:
        return False
    axis = b.choice([i for i, d in enumerate(x.shape) if d.static and d.a >= 2])
    size = x.shape[axis].a
    k = int(b.rng.integers(2, min(size, 4) + 1))
    if size % k == 0 and b.chance(0.4):
        sizes, explicit = [size // k] * k, False
    else:
        cuts = sorted(b.rng.choice(range(1, size), size=k - 1, replace=False).tolist())
        sizes, explicit = [e - s for s, e in zip([0, *cuts], [*cuts, size])], True
    outs = []
    for s in sizes:
        shape = list(x.shape)
        shape[axis] = fixed(s)
        outs.append(b.value(x.dtype, shape, x.lo, x.hi))
    attrs = {"axis": axis}
    if explicit:
        ins = [x, b.ints(sizes)]
    else:
        ins = [x]
        if b.opset >= 18:
            attrs["num_outputs"] = k
    b.node("Split", ins, outs, **attrs)
    return True


def slice_(b: Builder) -> bool:
    x = b.pick(lambda v: v.rank >= 1, None)
    if x is None:
        return False
    axes = _axes(b, x.rank)[:2]
    starts, ends, steps, shape = [], [], [], list(x.shape)
    for a in axes:
        d = x.shape[a]
        if d.static:
            for _ in range(20):
                step = b.choice([1, 1, 1, 2, 3, -1, -2])
                start = int(b.rng.integers(-d.a - 1, d.a + 2))
                end = b.choice([int(b.rng.integers(-d.a - 1, d.a + 2)), INT64_MAX, INT64_MIN])
                n = len(range(d.a)[slice(max(min(start, 2 * d.a), -2 * d.a), max(min(end, 2 * d.a), -2 * d.a), step)])
                if n >= 1:
                    break
            else:
                return False
            shape[a] = fixed(n)
        else:
            start, end, step = b.choice([(0, INT64_MAX, 1), (-1, INT64_MIN, -1), (1, INT64_MAX, 1), (0, -1, 1)])
            if start == 1 or end == -1:
                if d.lo < 2:
                    return False
                shape[a] = derive("dec", [d], lambda v: v - 1)
        starts.append(start)
        ends.append(end)
        steps.append(step)
    z = b.value(x.dtype, shape, x.lo, x.hi)
    ins = [x, b.ints(starts), b.ints(ends)]
    if b.chance(0.8) or any(s != 1 for s in steps):
        ins.append(b.ints(axes))
        if any(s != 1 for s in steps) or b.chance(0.5):
            ins.append(b.ints(steps))
    elif sorted(a % x.rank for a in axes) != list(range(len(axes))) or axes != sorted(axes) or any(a < 0 for a in axes):
        ins.append(b.ints(axes))
    b.node("Slice", ins, [z])
    return True


def gather(b: Builder) -> bool:
    x = b.pick(lambda v: v.rank >= 1, None)
    if x is None:
        return False
    axis = int(b.rng.integers(0, x.rank))
    d = x.shape[axis]
    ishape = b.choice([[], [int(b.rng.integers(1, 5))], [2, int(b.rng.integers(1, 4))]])
    idx = b.rng.integers(-d.lo, d.lo, size=ishape).astype(np.int64)
    shape = (*x.shape[:axis], *(fixed(s) for s in ishape), *x.shape[axis + 1:])
    if elements(shape) > MAX_ELEMENTS:
        return False
    z = b.value(x.dtype, shape, x.lo, x.hi)
    b.node("Gather", [x, b.const(idx)], [z], axis=axis - x.rank if b.chance(0.3) else axis)
    return True


def pad(b: Builder) -> bool:
    x = b.pick(lambda v: v.rank >= 1)
    if x is None:
        return False
    mode = b.choice(["constant", "constant", "reflect", "edge"])
    before, after = [], []
    for d in x.shape:
        limit = d.lo - 1 if mode == "reflect" else 2
        lo_pad = -1 if mode == "constant" and d.static and d.a >= 3 and b.chance(0.1) else 0
        before.append(int(b.rng.integers(lo_pad, max(0, min(limit, 2)) + 1)) if b.chance(0.6) else 0)
        after.append(int(b.rng.integers(lo_pad, max(0, min(limit, 2)) + 1)) if b.chance(0.6) else 0)
    shape = [derive(f"pad{p}_{q}", [d], lambda v, p=p, q=q: v + p + q) if p or q else d
             for d, p, q in zip(x.shape, before, after)]
    if any(s.lo < 1 for s in shape) or elements(shape) > MAX_ELEMENTS:
        return False
    value = float(np.round(b.rng.uniform(-1, 1), 2))
    ins = [x, b.ints(before + after)]
    if mode == "constant" and b.chance(0.6):
        ins.append(b.scalar(value))
    lo, hi = (min(x.lo, value, 0), max(x.hi, value, 0)) if mode == "constant" else (x.lo, x.hi)
    z = b.value(FLOAT, shape, lo, hi)
    b.node("Pad", ins, [z], mode=mode if mode != "constant" or b.chance(0.3) else None)
    return True


def expand(b: Builder) -> bool:
    x = b.pick(lambda v: v.rank <= 4, None)
    if x is None:
        return False
    if b.chance(0.3):  # Expand(x, Shape(y)) for a y that x broadcasts to
        y = b.pick(lambda v: v.rank >= x.rank and broadcast(x.shape, v.shape) == v.shape and v is not x, None)
        if y is not None:
            s = b.value(INT64, (fixed(y.rank),), 1, MAX_ELEMENTS, dims=y.shape)
            b.node("Shape", [y], [s])
            z = b.value(x.dtype, y.shape, x.lo, x.hi)
            b.node("Expand", [x, s], [z])
            return True
    lead = [int(b.rng.integers(1, 4)) for _ in range(int(b.rng.integers(0, 3)))]
    target = [int(b.rng.integers(2, 5)) if d.label == "1" and b.chance(0.7) else 1 for d in x.shape]
    if b.chance(0.2) and x.rank:
        target = target[int(b.rng.integers(0, x.rank)):]  # a shorter shape broadcasts too
    shape = broadcast(x.shape, tuple(fixed(s) for s in lead + target))
    if shape is None or elements(shape) > MAX_ELEMENTS:
        return False
    z = b.value(x.dtype, shape, x.lo, x.hi)
    b.node("Expand", [x, b.ints(lead + target)], [z])
    return True


def tile(b: Builder) -> bool:
    x = b.pick(lambda v: v.rank >= 1, None)
    if x is None:
        return False
    reps = [int(b.rng.integers(1, 4)) if b.chance(0.5) else 1 for _ in x.shape]
    shape = [derive(f"rep{r}", [d], lambda v, r=r: v * r) if r > 1 else d for d, r in zip(x.shape, reps)]
    if elements(shape) > MAX_ELEMENTS:
        return False
    z = b.value(x.dtype, shape, x.lo, x.hi)
    b.node("Tile", [x, b.ints(reps)], [z])
    return True


def shape_arith(b: Builder) -> bool:
    """Shape, Size, Gather/Slice/Concat on shapes, Range and ConstantOfShape, in a few forms
    that feed a shape computed at run time back into the float graph."""
    x = b.pick(lambda v: v.rank >= 1, None)
    if x is None:
        return False
    form = b.choice(["reshape", "size", "dim", "range", "constant_of_shape", "shape_slice"])
    if form == "reshape" and x.rank >= 2:  # Reshape(x, Concat(Shape(x)[:k], [-1]))
        k = int(b.rng.integers(1, x.rank))
        s = b.value(INT64, (fixed(x.rank),), 1, MAX_ELEMENTS, dims=x.shape)
        b.node("Shape", [x], [s])
        head = b.value(INT64, (fixed(k),), 1, MAX_ELEMENTS, dims=x.shape[:k])
        b.node("Slice", [s, b.ints([0]), b.ints([k])], [head])
        t = b.value(INT64, (fixed(k + 1),), -1, MAX_ELEMENTS)
        b.node("Concat", [head, b.ints([-1])], [t], axis=0)
        z = b.value(x.dtype, (*x.shape[:k], product(x.shape[k:])), x.lo, x.hi)
        b.node("Reshape", [x, t], [z])
        return True
    if x.dtype != FLOAT:
        return False
    if form == "size":  # x / Size(x)
        s = b.value(INT64, (), 1, MAX_ELEMENTS)
        b.node("Size", [x], [s])
        f = b.value(FLOAT, (), 1, MAX_ELEMENTS)
        b.node("Cast", [s], [f], to=FLOAT)
        z = b.value(FLOAT, x.shape, min(x.lo, 0), max(x.hi, 0))
        b.node("Div", [x, f], [z])
        return True
    if form in ("dim", "range"):
        axis = int(b.rng.integers(0, x.rank))
        if b.opset >= 15 and b.chance(0.5):
            s = b.value(INT64, (fixed(1),), 1, MAX_ELEMENTS, dims=x.shape[axis:axis + 1])
            b.node("Shape", [x], [s], start=axis, end=axis + 1 if b.chance(0.5) else (axis + 1 - x.rank or None))
            d = b.value(INT64, (), 1, MAX_ELEMENTS)
            b.node("Squeeze", [s, b.ints([0])], [d])
        else:
            s = b.value(INT64, (fixed(x.rank),), 1, MAX_ELEMENTS, dims=x.shape)
            b.node("Shape", [x], [s])
            d = b.value(INT64, (), 1, MAX_ELEMENTS)
            b.node("Gather", [s, b.const(np.asarray(axis, np.int64))], [d], axis=0)
        n = x.shape[axis]
        if form == "dim":  # x * dim
            f = b.value(FLOAT, (), n.lo, n.hi)
            b.node("Cast", [d], [f], to=FLOAT)
            z = b.value(FLOAT, x.shape, min(x.lo * n.hi, x.lo), max(x.hi * n.hi, x.hi))
            b.node("Mul", [x, f], [z])
            return True
        # Range(0, dim, 1) as a float row, added along that axis
        r = b.value(INT64, (n,), 0, n.hi)
        b.node("Range", [b.const(np.asarray(0, np.int64)), d, b.const(np.asarray(1, np.int64))], [r])
        f = b.value(FLOAT, (n,), 0, n.hi)
        b.node("Cast", [r], [f], to=FLOAT)
        if axis != x.rank - 1:
            u = b.value(FLOAT, (n, *(fixed(1) for _ in x.shape[axis + 1:])), 0, n.hi)
            b.node("Unsqueeze", [f, b.ints(list(range(1, x.rank - axis)))], [u])
            f = u
        z = b.value(FLOAT, x.shape, x.lo, x.hi + n.hi)
        b.node("Add", [x, f], [z])
        return True
    if form == "constant_of_shape":
        s = b.value(INT64, (fixed(x.rank),), 1, MAX_ELEMENTS, dims=x.shape)
        b.node("Shape", [x], [s])
        value = float(np.round(b.rng.uniform(-1, 1), 2))
        c = b.value(FLOAT, x.shape, value, value)
        from onnx import helper
        b.node("ConstantOfShape", [s], [c], value=helper.make_tensor("value", FLOAT, [1], [value]))
        z = b.value(FLOAT, x.shape, x.lo + value, x.hi + value)
        b.node("Sub", [x, c], [z])
        return True
    if form == "shape_slice" and x.rank >= 2:  # Expand a row of x's last dim back to x's shape
        s = b.value(INT64, (fixed(x.rank),), 1, MAX_ELEMENTS, dims=x.shape)
        b.node("Shape", [x], [s])
        row_shape = tuple(fixed(1) for _ in x.shape[:-1]) + x.shape[-1:]
        r = b.value(FLOAT, row_shape, x.lo, x.hi)
        axes = list(range(x.rank - 1))
        if b.opset < 18:
            b.node("ReduceMax", [x], [r], axes=axes)
        else:
            b.node("ReduceMin", [x, b.ints(axes)], [r])
        z = b.value(FLOAT, x.shape, x.lo, x.hi)
        b.node("Expand", [r, s], [z])
        return True
    return False


def resize(b: Builder) -> bool:
    x = b.pick(lambda v: v.rank == 4)
    if x is None:
        return False
    mode = b.choice(["nearest", "linear", "linear", "cubic"])
    ctm = b.choice(["half_pixel", "asymmetric", "align_corners", "pytorch_half_pixel"])
    scales, shape = [1.0, 1.0], list(x.shape[:2])
    for d in x.shape[2:]:
        s = b.choice([1.0, 2.0, 3.0, 0.5, 1.5])
        o = derive(f"scale{s}", [d], lambda v, s=s: int(math.floor(v * s)))
        if o.lo < 1:
            return False
        scales.append(s)
        shape.append(o)
    if elements(shape) > MAX_ELEMENTS:
        return False
    attrs = {"mode": mode, "coordinate_transformation_mode": ctm}
    if mode == "nearest":
        attrs["nearest_mode"] = b.choice(["round_prefer_floor", "floor", "ceil", "round_prefer_ceil", None])
    if mode == "cubic":
        attrs["cubic_coeff_a"] = b.choice([-0.75, -0.5, None])
    grow = 1.5 if mode == "cubic" else 1.0
    z = b.value(FLOAT, shape, x.lo * grow - (x.mag * 0.5 if mode == "cubic" else 0), x.hi * grow + (
        x.mag * 0.5 if mode == "cubic" else 0))
    b.node("Resize", [x, "", b.const(np.asarray(scales, np.float32))], [z], **attrs)
    return True


def argmax(op: str):
    def spec(b: Builder) -> bool:
        x = b.pick(lambda v: v.rank >= 1)
        if x is None:
            return False
        axis = int(b.rng.integers(-x.rank, x.rank))
        keep = int(b.chance(0.5))
        shape = [fixed(1) if i == axis % x.rank else d for i, d in enumerate(x.shape) if keep or i != axis % x.rank]
        z = b.value(INT64, shape, 0, x.shape[axis].hi - 1)
        b.node(op, [x], [z], axis=axis, keepdims=keep, select_last_index=1 if b.chance(0.2) else None)
        return True

    spec.__name__ = op
    return spec


def topk(b: Builder) -> bool:
    x = b.pick(lambda v: v.rank >= 1)
    if x is None:
        return False
    axis = int(b.rng.integers(-x.rank, x.rank))
    d = x.shape[axis]
    k = int(b.rng.integers(1, d.lo + 1))
    shape = list(x.shape)
    shape[axis] = fixed(k)
    vals = b.value(FLOAT, shape, x.lo, x.hi)
    idx = b.value(INT64, shape, 0, d.hi - 1)
    b.node("TopK", [x, b.ints([k])], [vals, idx], axis=axis if axis != -1 or b.chance(0.3) else None,
           largest=0 if b.chance(0.3) else None)
    return True


def cumsum(b: Builder) -> bool:
    x = b.pick(lambda v: v.rank >= 1, None)
    if x is None or x.dtype == BOOL:
        return False
    axis = int(b.rng.integers(-x.rank, x.rank))
    n = x.shape[axis].hi
    z = b.value(x.dtype, x.shape, min(x.lo * n, x.lo, 0), max(x.hi * n, x.hi, 0))
    b.node("CumSum", [x, b.const(np.asarray(axis, np.int64))], [z], exclusive=1 if b.chance(0.3) else None,
           reverse=1 if b.chance(0.3) else None)
    return True


def depth_space(op: str):
    def spec(b: Builder) -> bool:
        if op == "DepthToSpace":
            x = b.pick(lambda v: v.rank == 4 and v.shape[1].static and v.shape[1].a % 4 == 0)
        else:
            x = b.pick(lambda v: v.rank == 4 and v.shape[1].static and all(
                d.static and d.a % 2 == 0 for d in v.shape[2:]))
        if x is None:
            return False
        n, c, h, w = x.shape
        if op == "DepthToSpace":
            shape = (n, fixed(c.a // 4), derive("x2", [h], lambda v: 2 * v), derive("x2", [w], lambda v: 2 * v))
            attrs = {"blocksize": 2, "mode": b.choice(["DCR", "CRD", None])}
        else:
            shape = (n, fixed(c.a * 4), fixed(h.a // 2), fixed(w.a // 2))
            attrs = {"blocksize": 2}
        z = b.value(FLOAT, shape, x.lo, x.hi)
        b.node(op, [x], [z], **attrs)
        return True

    spec.__name__ = op
    return spec


def trilu(b: Builder) -> bool:
    x = b.pick(lambda v: v.rank >= 2)
    if x is None:
        return False
    ins = [x]
    if b.chance(0.6):
        ins.append(b.const(np.asarray(int(b.rng.integers(-2, 3)), np.int64)))
    z = b.value(FLOAT, x.shape, min(x.lo, 0), max(x.hi, 0))
    b.node("Trilu", ins, [z], upper=0 if b.chance(0.5) else None)
    return True


SPECS = {
    **{op: unary(op) for op in UNARY},
    "Clip": clip,
    **{op: binary(op) for op in ("Add", "Sub", "Mul", "Div", "Max", "Min")},
    **{op: variadic(op) for op in ("Sum", "Mean")},
    "Pow": pow_, "PRelu": prelu, "Where": where,
    **{op: compare(op) for op in ("Equal", "Less", "Greater", "LessOrEqual", "GreaterOrEqual")},
    **{op: logical(op) for op in ("And", "Or", "Xor", "Not")},
    "Cast": cast,
    **{op: reduce(op) for op in REDUCE_BOUNDS},
    **{op: softmax(op) for op in ("Softmax", "LogSoftmax", "Hardmax")},
    "MatMul": matmul, "Gemm": gemm, "Conv": conv,
    **{op: pool(op) for op in ("MaxPool", "AveragePool")},
    **{op: global_pool(op) for op in ("GlobalAveragePool", "GlobalMaxPool")},
    "BatchNormalization": batchnorm, "InstanceNormalization": instancenorm, "LayerNormalization": layernorm,
    "Transpose": transpose, "Reshape": reshape, "Flatten": flatten, "Squeeze": squeeze, "Unsqueeze": unsqueeze,
    "Concat": concat, "Split": split, "Slice": slice_, "Gather": gather, "Pad": pad, "Expand": expand,
    "Tile": tile, "Shape": shape_arith, "Resize": resize,
    **{op: argmax(op) for op in ("ArgMax", "ArgMin")},
    "TopK": topk, "CumSum": cumsum,
    **{op: depth_space(op) for op in ("DepthToSpace", "SpaceToDepth")},
    "Trilu": trilu,
}

#: The first opset that has each op kind (the rest are in opset 13).
MIN_OPSET = {"HardSwish": 14, "Trilu": 14}

#: How often each op kind is drawn (relative); the rest weigh 1.
WEIGHTS = {op: 2.0 for op in ("Add", "Mul", "MatMul", "Conv", "Reshape", "Transpose", "Relu", "Concat", "Slice",
                                "Shape", "Where", "Gemm", "Softmax", "ReduceSum", "ReduceMean")}
for _op in ("Floor", "Ceil", "Round", "Sign", "Identity", "Hardmax", "ThresholdedRelu", "Xor"):
    WEIGHTS[_op] = 0.5

__all__ = ["SPECS", "WEIGHTS", "MIN_OPSET", "Dim"]

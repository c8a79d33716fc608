"""CUDA kernels of the elementwise and broadcasting ops: arithmetic, comparisons, logic,
activations, Cast, Where, and ``com.egraft::Elementwise`` bodies.

Every op here is one C expression over its operands' values (``a0``, ``a1``...), put in a
``__device__`` function, and one generic broadcasting loop around it (:func:`emit_broadcast`):
a grid-stride loop of 256-thread blocks, one output element per iteration. Each operand is
read by how it broadcasts, decided while generating code:

- an operand of the output's own shape is read at the output's linear index ``i``;
- a one-element operand is loaded once, before the loop;
- any other operand is read at ``sum(c_k * stride_k)``, where ``c_k`` are the output's
  coordinates over its axes *collapsed* (adjacent axes that every operand broadcasts the
  same way merge into one, so ``[2,3,4] + [4]`` divides once) and ``stride_k`` is 0 on a
  broadcast axis. Static dims become constants (the compiler turns the divisions into
  multiplications); symbolic ones are ``d_<name>`` parameters.

Elements of at most 4 bytes move four at a time (one 16-byte ``float4``-like load per
operand for floats) when no operand is strided, or when the innermost dim is a multiple of
4 and each strided operand reads four consecutive elements there (a bias row) or one (a
column broadcast), and every pointer is aligned at run time; a one-at-a-time loop finishes
the tail (and does everything when a pointer is not aligned). Indices are ``int`` (32-bit
division is several times cheaper) when every count fits: decided while generating code for
static counts, by a test at run time between two copies of the loops for symbolic ones.

Example:
    >>> kernel = generate(graph.nodes[0], graph, 17)     # doctest: +SKIP
    >>> "eg_add_op(x0[i], x1[" in kernel.source          # doctest: +SKIP
    True
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import sympy

from egraft.ir.dtypes import DType
from egraft.kernels.cuda import register_kernel
from egraft.kernels.cuda.emit import C_TYPES, PRELUDE, CudaContext, Unsupported, activation_code

#: Threads per block of every loop here.
BLOCK = 256
#: At most this many blocks: enough for many waves on 132 SMs; bigger tensors loop.
MAX_BLOCKS = 4096
#: NaN as C expressions (neither NVRTC nor the emulator has a NAN macro without a header).
_NAN32 = "__int_as_float(0x7fc00000)"
FLOATS = (DType.FLOAT32, DType.FLOAT64)
INTS = (DType.INT64, DType.INT32, DType.INT16, DType.INT8, DType.UINT8, DType.UINT16, DType.UINT32, DType.UINT64)


# ---- small pieces of C -------------------------------------------------------------------------
def static_int(d) -> int | None:
    """``d`` as a Python int when it is a constant, else ``None``.

    Example:
        >>> static_int(sympy.Integer(4)), static_int(sympy.Symbol("n"))
        (4, None)
    """
    if isinstance(d, int | np.integer):
        return int(d)
    if isinstance(d, sympy.Basic) and d.is_Integer:
        return int(d)
    return None


def c_literal(value, dtype: DType) -> str:
    """``value`` as a C literal of ``dtype``.

    Example:
        >>> c_literal(0.5, DType.FLOAT32), c_literal(-3, DType.INT64), c_literal(float("inf"), DType.FLOAT32)
        ('0.5f', '(-3LL)', 'EG_INF')
    """
    if dtype is DType.BOOL:
        return "true" if bool(value) else "false"
    if dtype in FLOATS:
        v = float(np.float32(value)) if dtype is DType.FLOAT32 else float(value)
        if math.isnan(v):
            return _NAN32 if dtype is DType.FLOAT32 else f"((double){_NAN32})"
        if math.isinf(v):
            inf = "EG_INF" if dtype is DType.FLOAT32 else "((double)EG_INF)"
            return inf if v > 0 else f"(-{inf})"
        return f"{v!r}f" if dtype is DType.FLOAT32 else repr(v)
    v = int(value)
    if dtype is DType.UINT64:
        return f"{v}ULL"
    if v == -(2**63):
        return "(-9223372036854775807LL - 1)"
    return f"({v}LL)" if dtype is DType.INT64 else f"(({C_TYPES[dtype]}){v}LL)"




def math_fn(name: str, dtype: DType) -> str:
    """The C math function ``name`` for ``dtype``: ``expf`` for float32, ``exp`` for float64.

    Example:
        >>> math_fn("exp", DType.FLOAT32), math_fn("exp", DType.FLOAT64)
        ('expf', 'exp')
    """
    if dtype is DType.FLOAT32:
        return name + "f"
    if dtype is DType.FLOAT64:
        return name
    raise Unsupported(f"{name} on {dtype.short} tensors")


#: The largest count indexed with ``int``: a grid-stride step past it stays below 2**31.
INT_LIMIT = 2**31 - 1 - BLOCK * MAX_BLOCKS * 4


def index_variants(ctx: CudaContext, counts: Sequence, build: Callable[[str], list[str]]) -> list[str]:
    """The lines of ``build(index_type)`` for indices that reach ``counts`` (element counts
    of the operands): with ``int`` when every count is static and at most
    :data:`INT_LIMIT` (32-bit division is several times cheaper), with ``long long`` when
    one is larger, and both, chosen at run time, when a count is symbolic.

    Example:
        >>> index_variants(CudaContext(None, None), [sympy.Symbol("n")], lambda t: [f"{t} i;"])
        ['if (d_n <= 2143289343LL) {', '    int i;', '} else {', '    long long i;', '}']
    """
    statics = [static_int(c) for c in counts]
    if any(s is not None and s > INT_LIMIT for s in statics):
        return build("long long")
    symbolic = list(dict.fromkeys(c for c, s in zip(counts, statics) if s is None))
    if not symbolic:
        return build("int")
    test = " && ".join(f"{ctx.dim(c)} <= {INT_LIMIT}LL" for c in symbolic)
    return [f"if ({test}) {{", indent(build("int")), "} else {", indent(build("long long")), "}"]


def c_dim(ctx: CudaContext, d, itype: str) -> str:
    """A dim in C for index arithmetic of type ``itype`` (a static dim is a plain literal
    with ``int`` indices: a ``LL`` constant would widen the arithmetic to 64 bits).

    Example:
        >>> ctx = CudaContext(None, None)
        >>> c_dim(ctx, 4, "int"), c_dim(ctx, 4, "long long"), c_dim(ctx, sympy.Symbol("n"), "int")
        ('4', '4LL', '((int)d_n)')
    """
    s = static_int(d)
    if itype == "int":
        return str(s) if s is not None else f"((int){ctx.dim(d)})"
    return ctx.dim(d)


def vec4_type(ctx: CudaContext, ctype: str) -> str:
    """The name of a struct of four ``ctype`` aligned to its size (a 16-byte load for floats),
    added to the translation unit."""
    name = "eg_vec4_" + ctype.replace(" ", "_")
    size = {"float": 4, "int": 4, "unsigned int": 4, "bool": 1, "signed char": 1, "unsigned char": 1,
            "short": 2, "unsigned short": 2}[ctype]
    ctx.helper(f"struct __align__({4 * size}) {name} {{ {ctype} v[4]; }};")
    return name


def decompose(ctx: CudaContext, dims: Sequence, itype: str, index: str = "i", prefix: str = "c") -> list[str]:
    """Lines that split the linear ``index`` over ``dims`` (row-major) into coordinates
    ``c0``, ``c1``...; the first coordinate needs no modulo (``index`` is in range).

    Example:
        >>> decompose(CudaContext(None, None), [6, 4], "int")
        ['int r_ = i;', 'const int c1 = r_ % 4; r_ /= 4;', 'const int c0 = r_;']
    """
    if not dims:
        return []
    lines = [f"{itype} r_ = {index};"]
    for k in range(len(dims) - 1, 0, -1):
        d = c_dim(ctx, dims[k], itype)
        lines.append(f"const {itype} {prefix}{k} = r_ % {d}; r_ /= {d};")
    lines.append(f"const {itype} {prefix}0 = r_;")
    return lines


def function_name(op: str) -> str:
    """The name of ``op``'s kernel function: ``eg_<op>``, but never the name of one of the
    :data:`PRELUDE`'s helpers (``eg_max``, ``eg_sigmoid``...).

    Example:
        >>> function_name("Relu"), function_name("Max")
        ('eg_relu', 'eg_max_elementwise')
    """
    name = f"eg_{op.lower()}"
    return name + "_elementwise" if name in _PRELUDE_NAMES else name


_PRELUDE_NAMES = frozenset(re.findall(r"\beg_\w+", PRELUDE))


def indent(lines: Sequence[str], depth: int = 1) -> str:
    """``lines`` (each may hold several) joined, each line indented ``depth`` levels."""
    return "\n".join("    " * depth + part for line in lines for part in line.split("\n"))


def grid_stride(ctx: CudaContext, name: str, count, counts: Sequence, body: Callable[[str], list[str]],
                prelude: Sequence[str] = ()) -> None:
    """Write ``name``: a grid-stride loop of :data:`BLOCK`-thread blocks over ``count``
    running ``body(index_type)`` for each index ``i``; ``counts`` are the other element
    counts the indices reach (``int`` indices when all fit).

    Example:
        >>> grid_stride(ctx, "eg_fill", 10, [], lambda t: ["y0[i] = 0.0f;"])   # doctest: +SKIP
    """
    def loop(itype: str) -> list[str]:
        return [f"const {itype} n = {c_dim(ctx, count, itype)};",
                f"const {itype} step = ({itype})gridDim.x * {BLOCK};",
                f"for ({itype} i = ({itype})blockIdx.x * {BLOCK} + threadIdx.x; i < n; i += step) {{",
                indent(body(itype)),
                "}"]

    lines = [*prelude, *index_variants(ctx, [count, *counts], loop)]
    ctx.function(name, indent(lines), grid=ctx.blocks_for(count, BLOCK, MAX_BLOCKS), block=BLOCK)


# ---- the broadcasting layout ----------------------------------------------------------------------
def same_dim(a, b) -> bool:
    """Whether two dims are equal for every binding of their symbols."""
    if static_int(a) is not None or static_int(b) is not None:
        return static_int(a) == static_int(b)
    a, b = sympy.sympify(a), sympy.sympify(b)
    return a == b or sympy.expand(a - b) == 0


@dataclass(frozen=True)
class Layout:
    """How operands broadcast to an output: the output's collapsed ``dims`` and, per
    operand, ``"full"`` (the output's shape), ``"scalar"`` (one element) or a tuple of
    strides over ``dims`` (0 where it broadcasts)."""

    dims: tuple
    reads: tuple


def broadcast_layout(out_shape: Sequence, shapes: Sequence[Sequence], assume_equal: bool = False,
                     guards: list | None = None) -> Layout:
    """The :class:`Layout` of operands of ``shapes`` read for an output of ``out_shape``;
    with ``assume_equal``, an operand dim other than 1 is taken for the output's even when
    the two are not provably equal (Expand to a shape known only at run time, whose dims are
    fresh symbols: broadcasting makes them equal). With ``guards`` (a list), an operand dim
    that is neither 1 nor provably the output's (``floor(h/32 - 1/32) + 1`` against the
    same size reached by another path) is read as the output's and the pair is appended:
    the runtime checks them equal for each binding of the dims (:meth:`CudaContext.guard`).

    Example:
        >>> broadcast_layout([2, 3, 4], [[2, 3, 4], [4], []])
        Layout(dims=(6, 4), reads=('full', (0, 1), 'scalar'))
        >>> broadcast_layout([2, 3, 4], [[2, 1, 4], [3, 1]]).reads
        ((4, 0, 1), (0, 1, 0))
    """
    rank = len(out_shape)
    padded = []
    for shape in shapes:
        if len(shape) > rank:
            raise Unsupported(f"an operand of rank {len(shape)} for an output of rank {rank}")
        padded.append((1,) * (rank - len(shape)) + tuple(shape))
    axes, patterns = [], []
    for k, d in enumerate(out_shape):
        if static_int(d) == 1:
            continue
        pattern = []
        for shape in padded:
            e = shape[k]
            if static_int(e) == 1:
                pattern.append(True)
            elif assume_equal or same_dim(e, d):
                pattern.append(False)
            elif guards is not None:
                guards.append((e, d))
                pattern.append(False)
            else:
                raise Unsupported(f"an operand dim {e} that does not broadcast to {d}")
        axes.append(k)
        patterns.append(tuple(pattern))
    groups: list[list[int]] = []
    for k, pattern in zip(axes, patterns):
        if groups and patterns[axes.index(groups[-1][-1])] == pattern:
            groups[-1].append(k)
        else:
            groups.append([k])
    dims = tuple(dims_product(out_shape[k] for k in g) for g in groups)
    reads = []
    for j, shape in enumerate(padded):
        if all(static_int(e) == 1 for e in shape):
            reads.append("scalar")
            continue
        broadcast = [patterns[axes.index(g[0])][j] for g in groups]
        if not any(broadcast):
            reads.append("full")
            continue
        reads.append(tuple(0 if b else dims_product(shape[g[-1] + 1:]) for g, b in zip(groups, broadcast)))
    return Layout(dims, tuple(reads))


def dims_product(dims) -> object:
    """The product of ``dims`` (ints or sympy expressions): an int when it is constant.

    Example:
        >>> dims_product([2, sympy.Symbol("n"), 3])
        6*n
    """
    p = sympy.Integer(1)
    for d in dims:
        p = p * sympy.sympify(d)
    p = sympy.expand(p)
    return int(p) if p.is_Integer else p


# ---- the broadcasting kernel -----------------------------------------------------------------------
@dataclass(frozen=True)
class Operand:
    """An input read by a broadcasting kernel: its slot, the shape it is read with (its own
    unless told), and its pointer in C (``x<slot>`` unless told, e.g. ``x0 + 8``)."""

    slot: int
    shape: tuple | None = None
    pointer: str | None = None


def emit_broadcast(ctx: CudaContext, name: str, operands: Sequence[Operand | int], expr: str,
                   out_shape: Sequence | None = None, out_slot: int = 0, prologue: Sequence[str] = (),
                   assume_equal: bool = False) -> None:
    """Write ``name``: ``y[i] = expr(a0, a1...)`` over the output, where ``aj`` is operand
    ``j``'s value broadcast to the output (see the module docstring); ``prologue`` are
    statements before ``expr`` (temporaries it reads); ``assume_equal`` as
    :func:`broadcast_layout` says.

    Example:
        >>> emit_broadcast(ctx, "eg_add", [0, 1], "a0 + a1")     # doctest: +SKIP
    """
    ops = [Operand(o) if isinstance(o, int) else o for o in operands]
    out_shape = tuple(ctx.out_shape(out_slot) if out_shape is None else out_shape)
    shapes = [o.shape if o.shape is not None else ctx.in_shape(o.slot) for o in ops]
    unproven: list = []
    layout = broadcast_layout(out_shape, shapes, assume_equal, unproven)
    for e, d in unproven:
        ctx.guard(e, d)
    n = dims_product(out_shape)
    out_ctype = ctx.ctype(ctx.out_dtype(out_slot))
    in_ctypes = [ctx.ctype(ctx.in_dtype(o.slot)) for o in ops]
    params = ", ".join(f"{t} a{j}" for j, t in enumerate(in_ctypes))
    statements = "".join(f"\n    {line}" for line in (*prologue, f"return {expr};"))
    kernel = _Broadcast(ctx, layout, f"{name}_op", ctx.y(out_slot), out_ctype,
                        [o.pointer or ctx.x(o.slot) for o in ops], in_ctypes)
    for o in ops:
        ctx.x(o.slot)
    ctx.helper(f"__device__ __forceinline__ {out_ctype} {kernel.op}({params}) {{{statements}\n}}")
    vector = kernel.vector_mode(n)
    lines = [f"const {t} s{j} = {kernel.pointers[j]}[0];" for j, (t, r) in enumerate(zip(in_ctypes, layout.reads))
             if r == "scalar"]
    lines += index_variants(ctx, [n, *(dims_product(s) for s in shapes)], lambda itype: kernel.loops(n, itype, vector))
    grid = ctx.blocks_for(_ceil_div(n, 4 if vector else 1), BLOCK, MAX_BLOCKS)
    ctx.function(name, indent(lines), grid=grid, block=BLOCK)


#: Element types moved four at a time (a vector of four is at most 16 bytes).
_SMALL = {"float", "int", "unsigned int", "bool", "signed char", "unsigned char", "short", "unsigned short"}


@dataclass
class _Broadcast:
    """The loops of :func:`emit_broadcast`: the names they use and how each operand is read."""

    ctx: CudaContext
    layout: Layout
    op: str
    y: str
    out_ctype: str
    pointers: list[str]
    in_ctypes: list[str]

    def vector_mode(self, n) -> str | None:
        """``"flat"`` when no operand is strided (four consecutive elements of each),
        ``"rows"`` when the strided ones read four consecutive elements or one (the
        innermost dim is a multiple of 4 and their innermost stride is 1 or 0), else ``None``."""
        reads = self.layout.reads
        if static_int(n) is not None and static_int(n) < 4 * BLOCK:
            return None  # one block does it all: no gain
        if self.out_ctype not in _SMALL or any(t not in _SMALL for t, r in zip(self.in_ctypes, reads) if r != "scalar"):
            return None
        strided = [r for r in reads if isinstance(r, tuple)]
        if not strided:
            return "flat"
        inner = static_int(self.layout.dims[-1])
        if inner is not None and inner % 4 == 0 and all(static_int(r[-1]) in (0, 1) for r in strided):
            return "rows"
        return None

    def loops(self, n, itype: str, vector: str | None) -> list[str]:
        """The grid-stride loops with indices of ``itype``: four at a time when ``vector``
        (and every pointer is aligned), then one at a time from ``tail``."""
        lines = [f"const {itype} n = {c_dim(self.ctx, n, itype)};",
                 f"const {itype} step = ({itype})gridDim.x * {BLOCK};",
                 f"const {itype} first = ({itype})blockIdx.x * {BLOCK} + threadIdx.x;"]
        lines += self._vector_loop(itype, vector) if vector else [f"const {itype} tail = 0;"]
        strided = any(isinstance(r, tuple) for r in self.layout.reads)
        body = decompose(self.ctx, self.layout.dims, itype) if strided else []
        args = []
        for j, r in enumerate(self.layout.reads):
            if r == "scalar":
                args.append(f"s{j}")
            elif r == "full":
                args.append(f"{self.pointers[j]}[i]")
            else:
                args.append(f"{self.pointers[j]}[{self._offset(r, itype)}]")
        body.append(f"{self.y}[i] = {self.op}({', '.join(args)});")
        return lines + [f"for ({itype} i = tail + first; i < n; i += step) {{", indent(body), "}"]

    def _offset(self, strides: tuple, itype: str) -> str:
        terms = []
        for k, s in enumerate(strides):
            if static_int(s) == 0:
                continue
            terms.append(f"c{k}" if static_int(s) == 1 else f"c{k} * {c_dim(self.ctx, s, itype)}")
        return " + ".join(terms) or "0"

    def _vector_loop(self, itype: str, vector: str) -> list[str]:
        """The four-at-a-time loop (when every pointer it loads four from is aligned) and
        ``tail``, where the one-at-a-time loop starts."""
        vec = [vec4_type(self.ctx, t) if t in _SMALL else None for t in self.in_ctypes]
        out_vec = vec4_type(self.ctx, self.out_ctype)
        body = [f"const {itype} i = q * 4;", *decompose(self.ctx, self.layout.dims, itype)] if vector == "rows" else []
        checks = [f"((unsigned long long)({self.y}) % sizeof({out_vec})) == 0"]
        lanes = []
        for j, r in enumerate(self.layout.reads):
            p = self.pointers[j]
            if r == "scalar":
                lanes.append(None)
                continue
            if isinstance(r, tuple) and static_int(r[-1]) == 0:  # one element for the four
                body.append(f"const {self.in_ctypes[j]} b{j} = {p}[{self._offset(r, itype)}];")
                lanes.append(f"b{j}")
                continue
            at = "q" if r == "full" else f"({self._offset(r, itype)}) / 4"
            body.append(f"const {vec[j]} v{j} = reinterpret_cast<const {vec[j]}*>({p})[{at}];")
            checks.append(f"((unsigned long long)({p}) % sizeof({vec[j]})) == 0")
            lanes.append(f"v{j}.v[#]")
        body.append(f"{out_vec} r;")
        for lane in range(4):
            args = [f"s{j}" if a is None else a.replace("#", str(lane)) for j, a in enumerate(lanes)]
            body.append(f"r.v[{lane}] = {self.op}({', '.join(args)});")
        body.append(f"reinterpret_cast<{out_vec}*>({self.y})[q] = r;")
        return [f"const bool aligned = {' && '.join(checks)};",
                f"const {itype} n4 = n / 4;",
                f"const {itype} tail = aligned ? n4 * 4 : 0;",
                "if (aligned) {",
                indent([f"for ({itype} q = first; q < n4; q += step) {{", indent(body), "}"]),
                "}"]


def _ceil_div(n, k: int):
    if k == 1:
        return n
    s = static_int(n)
    return -(-s // k) if s is not None else sympy.ceiling(sympy.sympify(n) / k)


# ---- the ops ------------------------------------------------------------------------------------
def _float_only(op: str, dtype: DType) -> None:
    if dtype not in FLOATS:
        raise Unsupported(f"{op} on {dtype.short} tensors")


def _nan_max(dtype: DType, a: str, b: str) -> str:
    """max(a, b) that keeps a NaN of either (``np.maximum``); plain for integers."""
    if dtype in FLOATS:
        return f"(({a}) > ({b}) || ({a}) != ({a}) ? ({a}) : ({b}))"
    return f"(({a}) > ({b}) ? ({a}) : ({b}))"


def _nan_min(dtype: DType, a: str, b: str) -> str:
    if dtype in FLOATS:
        return f"(({a}) < ({b}) || ({a}) != ({a}) ? ({a}) : ({b}))"
    return f"(({a}) < ({b}) ? ({a}) : ({b}))"


def _clamp(dtype: DType, x: str, lo: str | None, hi: str | None) -> str:
    """``x`` clamped (a NaN stays NaN, as ``np.clip`` keeps it)."""
    if lo is not None:
        x = f"(({x}) < ({lo}) ? ({lo}) : ({x}))"
    if hi is not None:
        x = f"(({x}) > ({hi}) ? ({hi}) : ({x}))"
    return x


def _no_attrs(name: str, default=None):
    return default


def _unary_expr(op: str, t: DType, a: str = "a0", attr: Callable = _no_attrs) -> str:
    """The C expression of unary op ``op`` on ``a`` of type ``t`` (``attr(name, default)``
    gives its attributes)."""
    def lit(v) -> str:
        return c_literal(v, t)

    def f(name: str) -> str:
        return math_fn(name, t)

    if op == "Relu":
        return f"({a} < {lit(0)} ? {lit(0)} : {a})"
    if op == "Neg":
        return f"-{a}"
    if op == "Abs":
        return f"{f('fabs')}({a})" if t in FLOATS else f"({a} < 0 ? -{a} : {a})"
    if op == "Sign":
        return f"({a} > {lit(0)} ? {lit(1)} : ({a} < {lit(0)} ? {lit(-1)} : {a}))"
    if op == "Not":
        return f"!{a}"
    if op == "IsNaN":
        _float_only(op, t)
        return f"({a} != {a})"
    if op == "IsInf":
        _float_only(op, t)
        pos, neg = attr("detect_positive", 1), attr("detect_negative", 1)
        tests = ([f"{a} == {lit(math.inf)}"] if pos else []) + ([f"{a} == {lit(-math.inf)}"] if neg else [])
        return "(" + " || ".join(tests) + ")" if tests else "false"
    _float_only(op, t)
    simple = {"Exp": "exp", "Log": "log", "Sqrt": "sqrt", "Tanh": "tanh", "Erf": "erf", "Floor": "floor",
              "Ceil": "ceil", "Round": "rint", "Sin": "sin", "Cos": "cos"}
    if op in simple:
        return f"{f(simple[op])}({a})"
    if op == "Reciprocal":
        return f"({lit(1)} / {a})"
    if op == "Sigmoid":
        return f"({lit(1)} / ({lit(1)} + {f('exp')}(-{a})))"
    if op == "Softsign":
        return f"({a} / ({lit(1)} + {f('fabs')}({a})))"
    if op == "Softplus":  # np.logaddexp(0, x), stable for large |x|
        return f"({_nan_max(t, a, lit(0))} + {f('log1p')}({f('exp')}(-{f('fabs')}({a}))))"
    if op == "HardSwish":
        return f"({a} * {_clamp(t, f'{a} / {lit(6)} + {lit(0.5)}', lit(0), lit(1))})"
    if op == "HardSigmoid":
        alpha, beta = lit(attr("alpha", 0.2)), lit(attr("beta", 0.5))
        return _clamp(t, f"{alpha} * {a} + {beta}", lit(0), lit(1))
    if op == "LeakyRelu":
        return f"({a} >= {lit(0)} ? {a} : {lit(attr('alpha', 0.01))} * {a})"
    if op == "Elu":
        return f"({a} > {lit(0)} ? {a} : {lit(attr('alpha', 1.0))} * ({f('exp')}({a}) - {lit(1)}))"
    if op == "Selu":
        alpha, gamma = lit(attr("alpha", 1.67326319217681884765625)), lit(attr("gamma", 1.05070102214813232421875))
        return f"({gamma} * ({a} > {lit(0)} ? {a} : {alpha} * ({f('exp')}({a}) - {lit(1)})))"
    if op == "ThresholdedRelu":
        return f"({a} > {lit(attr('alpha', 1.0))} ? {a} : {lit(0)})"
    if op == "Gelu":
        if t is not DType.FLOAT32:
            raise Unsupported("Gelu on non-float32 tensors")
        approximate = attr("approximate", "none")
        if approximate not in ("none", "tanh"):
            raise Unsupported(f"Gelu approximate={approximate!r}")
        return activation_code("gelu" if approximate == "none" else "gelu_tanh", [], a)
    raise Unsupported(f"no CUDA expression for {op}")


UNARY = ("Relu", "Neg", "Abs", "Sign", "Not", "IsNaN", "IsInf", "Exp", "Log", "Sqrt", "Tanh", "Erf", "Floor", "Ceil",
         "Round", "Sin", "Cos", "Reciprocal", "Sigmoid", "Softsign", "Softplus", "HardSwish", "HardSigmoid",
         "LeakyRelu", "Elu", "Selu", "ThresholdedRelu", "Gelu")


@register_kernel(*UNARY)
def unary(ctx: CudaContext) -> None:
    """``y = f(x)`` for the unary ops of :data:`UNARY`."""
    _check_dtype(ctx.in_dtype(0))
    emit_broadcast(ctx, function_name(ctx.node.op), [0], _unary_expr(ctx.node.op, ctx.in_dtype(0), "a0", ctx.attr))


@register_kernel("Gelu", domain="com.egraft")
def gelu(ctx: CudaContext) -> None:
    """com.egraft::Gelu: the erf form or the tanh approximation."""
    emit_broadcast(ctx, "eg_gelu", [0], _unary_expr("Gelu", ctx.in_dtype(0), "a0", ctx.attr))


def _check_dtype(dtype: DType) -> None:
    if dtype not in C_TYPES:
        raise Unsupported(f"no CUDA kernels for {dtype.short} tensors")


def _binary_expr(op: str, t: DType, a: str, b: str) -> str:
    """The C expression of binary op ``op`` on values of type ``t``."""
    arith = {"Add": "+", "Sub": "-", "Mul": "*", "Div": "/"}
    if op in arith:  # integer Div truncates toward zero in C, as in onnxruntime
        return f"({a} {arith[op]} {b})"
    if op in ("Max", "Min"):
        return (_nan_max if op == "Max" else _nan_min)(t, a, b)
    compare = {"Equal": "==", "Less": "<", "Greater": ">", "LessOrEqual": "<=", "GreaterOrEqual": ">="}
    if op in compare:
        return f"({a} {compare[op]} {b})"
    logic = {"And": "&&", "Or": "||", "Xor": "!="}
    if op in logic:
        return f"(({a}) {logic[op]} ({b}))"
    if op == "PRelu":
        return f"({a} < {c_literal(0, t)} ? {a} * {b} : {a})"
    raise Unsupported(f"no CUDA expression for {op}")


BINARY = ("Add", "Sub", "Mul", "Div", "Equal", "Less", "Greater", "LessOrEqual", "GreaterOrEqual", "And", "Or", "Xor",
          "PRelu")


@register_kernel(*BINARY)
def binary(ctx: CudaContext) -> None:
    """``y = a op b`` with numpy broadcasting."""
    t = ctx.in_dtype(0)
    _check_dtype(t)
    if ctx.node.op in ("Add", "Sub", "Mul", "Div", "PRelu") and t is DType.BOOL:
        raise Unsupported(f"{ctx.node.op} on bool tensors")
    emit_broadcast(ctx, function_name(ctx.node.op), [0, 1], _binary_expr(ctx.node.op, t, "a0", "a1"))


@register_kernel("Max", "Min", "Sum", "Mean")
def variadic(ctx: CudaContext) -> None:
    """Max, Min, Sum, Mean over any number of broadcast inputs (left to right, as numpy)."""
    t = ctx.in_dtype(0)
    _check_dtype(t)
    slots = [i for i in range(len(ctx.node.inputs)) if ctx.has_input(i)]
    fold = {"Max": "Max", "Min": "Min", "Sum": "Add", "Mean": "Add"}[ctx.node.op]
    expr = "a0"
    for j in range(1, len(slots)):
        expr = _binary_expr(fold, t, expr, f"a{j}")
    if ctx.node.op == "Mean":
        expr = f"({expr} / {c_literal(len(slots), t)})"
    emit_broadcast(ctx, function_name(ctx.node.op), slots, expr)


@register_kernel("Pow")
def power(ctx: CudaContext) -> None:
    """``a ** b``, of ``a``'s type; a constant exponent 2 is ``a * a``; integer bases are
    computed in double (as the registry does)."""
    t = ctx.in_dtype(0)
    exponent = ctx.constant(1)
    if exponent is not None and exponent.size == 1 and float(exponent.ravel()[0]) == 2.0 and t in FLOATS:
        emit_broadcast(ctx, "eg_pow", [Operand(0)], "a0 * a0", out_shape=ctx.out_shape(0))
        return
    _check_dtype(t)
    if t in FLOATS:
        expr = f"{math_fn('pow', t)}(a0, ({C_TYPES[t]})a1)"
    elif t in INTS:
        expr = f"({C_TYPES[t]})pow((double)a0, (double)a1)"
    else:
        raise Unsupported(f"Pow on {t.short} tensors")
    emit_broadcast(ctx, "eg_pow", [0, 1], expr)


@register_kernel("Mod")
def mod(ctx: CudaContext) -> None:
    """``a mod b``: the sign of ``b`` (numpy's mod), or of ``a`` with ``fmod=1``."""
    t = ctx.in_dtype(0)
    _check_dtype(t)
    if t in FLOATS:
        r = f"{math_fn('fmod', t)}(a0, a1)"
    elif t in INTS:
        r = "(a0 % a1)"
    else:
        raise Unsupported("Mod on bool tensors")
    if ctx.attr("fmod", 0):
        expr = r
    else:
        ctx.helper(f"__device__ __forceinline__ {C_TYPES[t]} eg_mod_{t.short}({C_TYPES[t]} r, {C_TYPES[t]} b) "
                   f"{{ return (r != 0 && ((r < 0) != (b < 0))) ? ({C_TYPES[t]})(r + b) : r; }}")
        expr = f"eg_mod_{t.short}({r}, a1)"
    emit_broadcast(ctx, function_name("Mod"), [0, 1], expr)


@register_kernel("Clip")
def clip(ctx: CudaContext) -> None:
    """``min(max(x, lo), hi)``: constant bounds (inputs, or attributes before opset 11) are
    literals, others operands; a NaN stays NaN."""
    t = ctx.in_dtype(0)
    _check_dtype(t)
    operands: list[int] = [0]
    bounds: list[str | None] = []
    for slot, name in ((1, "min"), (2, "max")):
        if ctx.opset < 11:
            value = ctx.attr(name, None)
            bounds.append(None if value is None else c_literal(value, t))
        elif not ctx.has_input(slot):
            bounds.append(None)
        elif (value := ctx.constant(slot)) is not None:
            bounds.append(c_literal(value.ravel()[0], t) if value.size else None)
        else:
            bounds.append(f"a{len(operands)}")
            operands.append(slot)
    emit_broadcast(ctx, "eg_clip", operands, _clamp(t, "a0", bounds[0], bounds[1]))


@register_kernel("Where")
def where(ctx: CudaContext) -> None:
    """``cond ? a : b`` with the three broadcast."""
    _check_dtype(ctx.in_dtype(1))
    emit_broadcast(ctx, "eg_where", [0, 1, 2], "(a0 ? a1 : a2)")


@register_kernel("Cast", "CastLike")
def cast(ctx: CudaContext) -> None:
    """A C conversion: floats to integers truncate (as ONNX says), anything nonzero is true."""
    src, dst = ctx.in_dtype(0), ctx.out_dtype(0)
    _check_dtype(src)
    _check_dtype(dst)
    emit_broadcast(ctx, "eg_cast", [0], f"({C_TYPES[dst]})(a0)")


# ---- com.egraft::Elementwise ---------------------------------------------------------------------
_EXPR_BINARY = {"add": "Add", "sub": "Sub", "mul": "Mul", "div": "Div", "max": "Max", "min": "Min"}
_EXPR_UNARY = {"neg": "Neg", "abs": "Abs", "relu": "Relu", "sigmoid": "Sigmoid", "tanh": "Tanh", "exp": "Exp",
               "log": "Log", "sqrt": "Sqrt", "erf": "Erf"}


def expr_code(tree, t: DType, lines: list[str] | None = None) -> str:
    """The C of a parsed Elementwise body (``parse_expr``) over ``a0``, ``a1``...: each call
    becomes a temporary appended to ``lines``; returns the name of the result.

    Example:
        >>> from egraft.ir.ops.fused_elementwise import parse_expr
        >>> lines = []
        >>> expr_code(parse_expr("relu(add(x0, 0.5))"), DType.FLOAT32, lines), lines
        ('t1', ['const float t0 = (a0 + 0.5f);', 'const float t1 = (t0 < 0.0f ? 0.0f : t0);'])
    """
    lines = [] if lines is None else lines
    kind = tree[0]
    if kind == "input":
        return f"a{tree[1]}"
    if kind == "number":
        return c_literal(tree[1], t)
    name, args = tree[1], [expr_code(a, t, lines) for a in tree[2]]
    if name in _EXPR_BINARY:
        code = _binary_expr(_EXPR_BINARY[name], t, *args)
    elif name == "pow":
        code = f"{math_fn('pow', t)}({args[0]}, {args[1]})"
    elif name in _EXPR_UNARY:
        code = _unary_expr(_EXPR_UNARY[name], t, args[0])
    else:
        raise Unsupported(f"no CUDA code for Elementwise function {name!r}")
    result = f"t{sum(line.startswith('const ') for line in lines)}"
    lines.append(f"const {C_TYPES[t]} {result} = {code};")
    return result


@register_kernel("Elementwise", domain="com.egraft")
def elementwise(ctx: CudaContext) -> None:
    """A fused body: one C function of temporaries, one broadcasting loop over all the inputs."""
    from egraft.ir.ops.fused_elementwise import ExprError, parse_expr

    t = ctx.out_dtype(0)
    _float_only("Elementwise", t)
    try:
        tree = parse_expr(ctx.attr("expr"))
    except ExprError as e:
        raise Unsupported(str(e)) from None
    lines: list[str] = []
    result = expr_code(tree, t, lines)
    emit_broadcast(ctx, "eg_elementwise", list(range(len(ctx.node.inputs))), result, prologue=lines)


__all__ = ["broadcast_layout", "c_dim", "c_literal", "decompose", "dims_product", "emit_broadcast", "expr_code",
           "function_name", "indent", "index_variants", "math_fn", "same_dim", "static_int", "vec4_type", "Layout",
           "Operand", "BLOCK", "INT_LIMIT", "MAX_BLOCKS"]

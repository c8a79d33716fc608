"""What a CUDA kernel generator writes into: :class:`CudaContext` (the node, its types, the
names of its operands and dims in C) and what comes out, :class:`CudaKernel` (one CUDA C
translation unit and the launches that run it).

The one ABI of every generated function::

    extern "C" __global__ void eg_relu(float* __restrict__ y0, const float* __restrict__ x0, long long d_batch)

- parameters: the outputs the generator asked for (``y0``, ``y1``...), then the inputs
  (``x0``, ``x1``...), each a device pointer, then the dim symbols its code names
  (``d_<symbol>``, ``long long``), in sorted order;
- a step's kernel may be several functions run one after the other (a two-pass reduction),
  all with that same parameter list;
- a launch's grid is a dim expression (an int, or sympy over the model's symbols) that
  the runtime evaluates per call; the block is fixed; dynamic shared memory is a byte count.

Generated code may use only what both NVRTC and the CPU emulator
(:mod:`egraft.testing.cuda_emulator`) provide: the helpers of :data:`PRELUDE`, the float
math functions (``expf``, ``tanhf``, ``erff``, ``sqrtf``, ``rsqrtf``, ``fmaxf``...),
``__syncthreads``, ``__shfl_xor_sync``/``__shfl_down_sync`` on full warps,
``atomicAdd``, ``__shared__`` arrays declared at the top of a function, and
``EG_DYNAMIC_SHARED(type, name)`` for dynamic shared memory.

Example:
    >>> ctx = CudaContext(node, graph, opset=17)                            # doctest: +SKIP
    >>> n = ctx.numel(ctx.out_shape(0))                                     # doctest: +SKIP
    >>> ctx.function("eg_relu", body, grid=ctx.blocks_for(n, 256), block=256)  # doctest: +SKIP
    >>> kernel = ctx.finish()                                               # doctest: +SKIP
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np
import sympy

from egraft.ir.dims import dim_function, dim_product, integer_fraction
from egraft.ir.dtypes import DType
from egraft.ir.graph import Graph, Node
from egraft.kernels.cpu.emit import Unsupported

#: C type of each element type a CUDA kernel can read or write.
C_TYPES = {
    DType.FLOAT32: "float", DType.FLOAT64: "double", DType.INT64: "long long", DType.INT32: "int",
    DType.INT16: "short", DType.INT8: "signed char", DType.UINT8: "unsigned char", DType.UINT16: "unsigned short",
    DType.UINT32: "unsigned int", DType.UINT64: "unsigned long long", DType.BOOL: "bool",
}

#: Helpers every translation unit starts with (NVRTC has no standard headers: nothing here
#: includes one).
PRELUDE = r"""
#ifndef EG_DYNAMIC_SHARED
#define EG_DYNAMIC_SHARED(type, name) extern __shared__ __align__(16) unsigned char eg_smem_[]; \
    type* name = reinterpret_cast<type*>(eg_smem_)
#endif
#define EG_INF __int_as_float(0x7f800000)
__device__ __forceinline__ long long eg_floordiv(long long a, long long b) {
    long long q = a / b; return (q * b != a && ((a < 0) != (b < 0))) ? q - 1 : q;
}
__device__ __forceinline__ long long eg_ceildiv(long long a, long long b) { return -eg_floordiv(-a, b); }
__device__ __forceinline__ long long eg_mod(long long a, long long b) { long long r = a % b; return r < 0 ? r + b : r; }
__device__ __forceinline__ long long eg_min(long long a, long long b) { return a < b ? a : b; }
__device__ __forceinline__ long long eg_max(long long a, long long b) { return a > b ? a : b; }
__device__ __forceinline__ float eg_sigmoid(float x) { return 1.0f / (1.0f + expf(-x)); }
__device__ __forceinline__ float eg_warp_sum(float v) {
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}
__device__ __forceinline__ float eg_warp_max(float v) {
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}
"""


@dataclass(frozen=True)
class Launch:
    """One launch of a function of the kernel's source: ``grid`` (three dims: ints or sympy
    expressions over the model's symbols), ``block`` (threads, three ints) and dynamic
    shared memory in bytes."""

    function: str
    grid: tuple
    block: tuple[int, int, int]
    shared_bytes: int = 0

    def grid_at(self, bindings: dict[str, int]) -> tuple[int, int, int]:
        """The grid with the symbols bound.

        Example:
            >>> Launch("f", (sympy.Symbol("n") * 2, 1, 1), (256, 1, 1)).grid_at({"n": 3})
            (6, 1, 1)
        """
        return tuple(g if isinstance(g, int) else int(dim_function(g)(bindings)) for g in self.grid)


@dataclass(frozen=True)
class Param:
    """A parameter of the kernel's functions: an operand (``("in", i)`` or ``("out", i)``)
    with its C name and element type, or a dim symbol (``role = ("dim", name)``)."""

    role: tuple
    name: str
    ctype: str


@dataclass(frozen=True)
class LibraryCall:
    """A step a vendor library runs instead of generated code (:mod:`egraft.kernels.cuda.library`):
    ``kind`` (``matmul``: cuBLAS through ``cupy.matmul``), the shape of each pointer operand
    in parameter order (dims: ints or sympy), and how to read them (``transpose``: per
    operand, whether to use its transpose)."""

    kind: str
    shapes: tuple
    transpose: tuple = ()


@dataclass(frozen=True)
class CudaKernel:
    """What a generator made for one step: a translation unit and its launches in order
    (or, for a :class:`LibraryCall`, no code: ``library`` says what runs)."""

    source: str
    launches: tuple[Launch, ...]
    params: tuple[Param, ...]
    #: pairs of dims the code takes for equal that inference could not prove equal: the
    #: runtime checks them for each binding of the dims (:meth:`CudaContext.guard`)
    guards: tuple = ()
    library: LibraryCall | None = None

    @property
    def operands(self) -> tuple[tuple, ...]:
        """The operand roles in parameter order (the dims excluded)."""
        return tuple(p.role for p in self.params if p.role[0] != "dim")

    @property
    def symbols(self) -> tuple[str, ...]:
        """The dim symbols passed after the pointers, in order."""
        return tuple(p.role[1] for p in self.params if p.role[0] == "dim")


@dataclass
class CudaContext:
    """A generator's view of one node: its types, the C names of its operands and dims,
    and the functions it has written so far."""

    node: Node
    graph: Graph
    opset: int = 21
    functions: list[str] = field(default_factory=list)
    launches: list[Launch] = field(default_factory=list)
    used: set = field(default_factory=set)
    symbols: set = field(default_factory=set)
    helpers: list[str] = field(default_factory=list)
    guards: list = field(default_factory=list)
    #: set by a generator whose step a library runs (no function is written then)
    library: LibraryCall | None = None

    # ---- the node ------------------------------------------------------------------------
    def attr(self, name: str, default=None):
        from egraft.ir.registry import get_op

        if name in self.node.attrs:
            return self.node.attrs[name]
        op = get_op(self.node.op, self.node.domain)
        spec = op.attrs.get(name) if op is not None else None
        return default if spec is None or spec.default is None else spec.default

    def has_input(self, i: int) -> bool:
        return i < len(self.node.inputs) and self.node.inputs[i] is not None

    def in_shape(self, i: int) -> tuple:
        shape = self.node.inputs[i].type.shape
        if shape is None:
            raise Unsupported(f"input {i} has an unknown rank")
        return tuple(shape)

    def out_shape(self, i: int = 0) -> tuple:
        shape = self.node.outputs[i].type.shape
        if shape is None:
            raise Unsupported(f"output {i} has an unknown rank")
        return tuple(shape)

    def in_dtype(self, i: int) -> DType:
        return self.node.inputs[i].type.dtype

    def out_dtype(self, i: int = 0) -> DType:
        return self.node.outputs[i].type.dtype

    def constant(self, i: int) -> np.ndarray | None:
        """Input ``i``'s value when it is a constant (read while generating code), else ``None``."""
        if not self.has_input(i) or self.node.inputs[i].const is None:
            return None
        return self.graph.constants[self.node.inputs[i].const]

    # ---- names in C ----------------------------------------------------------------------
    def x(self, i: int) -> str:
        """The C name of input ``i`` (a pointer parameter ``x<i>``)."""
        if not self.has_input(i):
            raise Unsupported(f"input {i} is absent")
        self.used.add(("in", i))
        return f"x{i}"

    def y(self, i: int = 0) -> str:
        """The C name of output ``i`` (a pointer parameter ``y<i>``)."""
        self.used.add(("out", i))
        return f"y{i}"

    def ctype(self, dtype: DType) -> str:
        if dtype not in C_TYPES:
            raise Unsupported(f"no CUDA kernels for {dtype.short} tensors")
        return C_TYPES[dtype]

    def dim(self, d) -> str:
        """A dim (int or sympy expression) as a C ``long long`` expression over the dim parameters.

        Example:
            >>> CudaContext(None, None).dim(sympy.floor(sympy.Symbol("h") / 2) + 1)
            '(1LL + eg_floordiv(d_h, 2))'
        """
        if isinstance(d, int | np.integer):
            return f"{int(d)}LL"
        return self._c(sympy.sympify(d))

    def numel(self, shape) -> object:
        """The element count of ``shape`` (an int or a sympy expression)."""
        return dim_product(shape)

    @staticmethod
    def blocks_for(count, per_block: int, cap: int | None = None):
        """``ceil(count / per_block)`` (at most ``cap``), as a grid dim."""
        if isinstance(count, int | np.integer):
            n = max(1, -(-int(count) // per_block))
            return min(n, cap) if cap else n
        n = sympy.Max(1, sympy.ceiling(sympy.sympify(count) / per_block))
        return sympy.Min(n, cap) if cap else n

    def _c(self, e: sympy.Expr) -> str:
        if e.is_Integer:
            return f"{int(e)}LL"
        if e.is_Symbol:
            self.symbols.add(e.name)
            return f"d_{e.name}"
        if isinstance(e, sympy.floor | sympy.ceiling):
            num, den = integer_fraction(e.args[0])
            if den is None:
                raise Unsupported(f"dim {e} has no integer form")
            fn = "eg_floordiv" if isinstance(e, sympy.floor) else "eg_ceildiv"
            return f"{fn}({self._c(num)}, {den})"
        if isinstance(e, sympy.Mod) and e.args[1].is_Integer:
            return f"eg_mod({self._c(e.args[0])}, {int(e.args[1])})"
        if isinstance(e, sympy.Max | sympy.Min):
            fn = "eg_max" if isinstance(e, sympy.Max) else "eg_min"
            out = self._c(e.args[0])
            for a in e.args[1:]:
                out = f"{fn}({out}, {self._c(a)})"
            return out
        if e.is_Pow and e.exp.is_Integer and int(e.exp) > 0:
            base = self._c(e.base)
            return "(" + " * ".join([base] * int(e.exp)) + ")"
        if e.is_Add or e.is_Mul or e.is_Rational:
            num, den = integer_fraction(e)
            if den is None:
                raise Unsupported(f"dim {e} has no integer form")
            if den != 1:
                return f"eg_floordiv({self._c(num)}, {den})"
            return "(" + (" + " if e.is_Add else " * ").join(self._c(a) for a in e.args) + ")"
        raise Unsupported(f"dim {e} has no C form")

    def guard(self, dim, equals) -> None:
        """Generate code that takes ``dim`` for ``equals`` (an operand dim for the result's,
        which inference could not prove equal); the runtime refuses a binding where they differ."""
        if (dim, equals) not in self.guards:
            self.guards.append((dim, equals))

    # ---- writing -------------------------------------------------------------------------
    def helper(self, code: str) -> None:
        """Add a ``__device__`` helper to the translation unit (once)."""
        if code not in self.helpers:
            self.helpers.append(code)

    def function(self, name: str, body: str, grid, block, shared_bytes: int = 0) -> None:
        """Add ``__global__ void name(<params>) { body }``, launched once, in order, with
        ``grid`` (a dim or a tuple of up to three) and ``block`` (an int or a tuple)."""
        grid = tuple(grid) if isinstance(grid, tuple | list) else (grid,)
        block = tuple(block) if isinstance(block, tuple | list) else (block,)
        grid = tuple(int(g) if isinstance(g, int | np.integer) or (hasattr(g, "is_Integer") and g.is_Integer)
                     else g for g in grid) + (1,) * (3 - len(grid))
        block = tuple(int(b) for b in block) + (1,) * (3 - len(block))
        if math.prod(block) > 1024:
            raise ValueError(f"{name}: a block of {math.prod(block)} threads (at most 1024)")
        for g in grid:  # the grid's symbols are parameters too (the runtime binds them)
            if not isinstance(g, int):
                self.symbols |= {s.name for s in g.free_symbols}
        self.functions.append((name, body))
        self.launches.append(Launch(name, grid, block, int(shared_bytes)))

    def params(self) -> tuple[Param, ...]:
        out = []
        for role in sorted(self.used, key=lambda r: (r[0] != "out", r[1])):
            kind, i = role
            if kind == "out":
                out.append(Param(role, f"y{i}", self.ctype(self.out_dtype(i))))
            else:
                out.append(Param(role, f"x{i}", self.ctype(self.in_dtype(i))))
        out += [Param(("dim", s), f"d_{s}", "long long") for s in sorted(self.symbols)]
        return tuple(out)

    def finish(self) -> CudaKernel:
        """The translation unit: :data:`PRELUDE`, the helpers, then every function."""
        params = self.params()
        if self.library is not None:
            if self.functions:
                raise ValueError("a library step writes no function")
            return CudaKernel("", (), params, tuple(self.guards), self.library)
        if not self.functions:
            raise ValueError("the generator wrote no function")
        signature = ", ".join(
            f"{p.ctype} {p.name}" if p.role[0] == "dim"
            else f"{'const ' if p.role[0] == 'in' else ''}{p.ctype}* __restrict__ {p.name}" for p in params)
        parts = [PRELUDE.strip(), *self.helpers]
        for name, body in self.functions:
            parts.append(f'extern "C" __global__ void {name}({signature}) {{\n{body.strip(chr(10))}\n}}')
        return CudaKernel("\n\n".join(parts) + "\n", tuple(self.launches), params, tuple(self.guards))


def activation_code(activation: str, params, y: str) -> str:
    """The C expression of ``activation`` (a fused op's ``activation`` attribute, with its
    ``activation_params``) applied to the float expression ``y``; ``y`` itself for none.

    Example:
        >>> activation_code("leaky_relu", [0.1], "v")
        '(v >= 0.0f ? v : 0.1f * v)'
    """
    from egraft.ir.ops.fused import activation_params

    p = activation_params(activation, params)
    f = [_float(v) for v in p]
    if activation == "":
        return y
    if activation == "relu":
        return f"fmaxf({y}, 0.0f)"
    if activation == "leaky_relu":
        return f"({y} >= 0.0f ? {y} : {f[0]} * {y})"
    if activation == "clip":
        return f"fminf(fmaxf({y}, {f[0]}), {f[1]})"
    if activation == "sigmoid":
        return f"eg_sigmoid({y})"
    if activation == "silu":
        return f"({y} * eg_sigmoid({y}))"
    if activation == "hard_sigmoid":
        return f"fminf(fmaxf({f[0]} * {y} + {f[1]}, 0.0f), 1.0f)"
    if activation == "hard_swish":
        return f"({y} * fminf(fmaxf({y} / 6.0f + 0.5f, 0.0f), 1.0f))"
    if activation == "gelu":
        return f"(0.5f * {y} * (1.0f + erff({y} * 0.70710678118654752f)))"
    if activation == "gelu_tanh":
        return f"(0.5f * {y} * (1.0f + tanhf(0.79788456080286536f * ({y} + 0.044715f * {y} * {y} * {y}))))"
    if activation == "tanh":
        return f"tanhf({y})"
    raise Unsupported(f"no CUDA code for activation {activation!r}")


def _float(v: float) -> str:
    """A float literal in C (``EG_INF`` for infinities)."""
    if math.isinf(v):
        return "EG_INF" if v > 0 else "(-EG_INF)"
    return f"{float(v)!r}f"


__all__ = ["activation_code", "LibraryCall", "CudaContext", "CudaKernel", "Launch", "Param", "PRELUDE", "C_TYPES",
           "Unsupported"]

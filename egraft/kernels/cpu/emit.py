"""What a CPU kernel generator works with: :class:`KernelContext`, one LLVM function being
emitted for one IR node, and the IR helpers every generator shares (loops, dims, math).

The kernel ABI is one signature for every kernel::

    void kernel(i8** table, i64* dims, i64 part, i64 parts, i8* scratch)

``table`` holds the addresses of the kernel's operands and ``dims`` the values of the
symbolic dims its shapes read, each numbered in the order the generator first asks for
them (:attr:`KernelContext.operands`, :attr:`KernelContext.dim_operands`), so a call
passes two pointers, whatever the op. The kernel's code names no model slot, dim or
step: two nodes of the same op, attributes and types emit the same text, compiled once
(:mod:`egraft.lowering.kernels` links each step to its kernel through a small call stub
that gathers the step's operands from the model's table). A kernel that declares itself
parallel (``ctx.parallel = True``) computes share ``part`` of ``parts`` of its output, so
the runtime can run its parts on several threads at once; every other kernel is called
with ``part = 0, parts = 1``. ``scratch`` is :data:`egraft.kernels.cpu.sgemm.SCRATCH_BYTES`
of 64-byte aligned memory owned by the calling thread (packing buffers). Shapes whose dims are all integers
become constants in the code (LLVM then unrolls and vectorizes with known trip counts);
symbolic dims are read from ``dims``, so one compiled kernel serves every value of them.

A generator that cannot handle a node (a dtype, an attribute value) raises
:class:`Unsupported` with the reason; the node then runs on its reference kernel and the
compile report says why.

Example (a generator)::

    @register_kernel("Relu")
    def relu(ctx: KernelContext) -> None:
        emit_elementwise(ctx, lambda b, xs: ctx.math.relu(xs[0]), [0])
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

import numpy as np
import sympy
from llvmlite import ir

from egraft.ir.dims import integer_fraction
from egraft.ir.dtypes import DType
from egraft.ir.graph import Graph, Node
from egraft.ir.registry import NodeAttrs, OpDef
from egraft.ir.types import TensorType

I1 = ir.IntType(1)
I8 = ir.IntType(8)
I32 = ir.IntType(32)
I64 = ir.IntType(64)
F32 = ir.FloatType()
F64 = ir.DoubleType()
I8P = I8.as_pointer()
KERNEL_TYPE = ir.FunctionType(ir.VoidType(), [I8P.as_pointer(), I64.as_pointer(), I64, I64, I8P])
#: The name every kernel function is emitted under (its module holds it alone); the
#: lowering renames it after the kernel's content (:func:`egraft.lowering.kernels.kernel_symbol`).
KERNEL_SYMBOL = "egraft.kernel"

#: The LLVM type of each dtype a kernel can compute in.
LLVM_TYPES: dict[DType, ir.Type] = {
    DType.FLOAT32: F32, DType.FLOAT64: F64,
    DType.INT64: I64, DType.INT32: I32, DType.INT8: I8, DType.UINT8: I8, DType.BOOL: I8,
}


# ---- weight packings: how a kernel's derived constants were made ------------------------------
@dataclass(frozen=True)
class Packing:
    """A weight packing a kernel generator uses: ``function(weight, **params)``, plain numpy,
    gives the packed array. ``gather`` says that every packed element is one of the weight's
    elements or zero (padding), so the weight can be read back out of it
    (:meth:`PackedFrom.unpack`)."""

    name: str
    function: Callable[..., np.ndarray]
    gather: bool


_PACKINGS: dict[str, Packing] = {}


def flush_subnormals(a: np.ndarray) -> np.ndarray:
    """``a`` with its subnormal floats (nonzero, below the smallest normal) as zeros: packed
    weights only. Such a weight times any activation is below every normal output's rounding,
    and on Intel cores each multiply-add that reads one takes a microcode assist: ppocr_v5_det's
    384 x 192 1x1 convolution (8% of its weights subnormal) took 940 us instead of 16.

    Example:
        >>> flush_subnormals(np.array([1e-39, 1.0, -1e-40], np.float32)).tolist()
        [0.0, 1.0, -0.0]
    """
    if a.dtype.kind != "f" or a.size == 0:
        return a
    tiny = np.finfo(a.dtype).tiny
    magnitude = np.abs(a)
    subnormal = (magnitude < tiny) & (magnitude > 0)
    if not subnormal.any():
        return a
    return np.where(subnormal, np.copysign(np.zeros((), a.dtype), a), a).astype(a.dtype, copy=False)


def register_packing(name: str, *, gather: bool) -> Callable[[Callable], Callable]:
    """Decorator: ``fn(weight, **params) -> packed`` is the packing ``name`` (a kernel module's
    own, used through :meth:`KernelContext.packed_constant`); ``gather`` as for :class:`Packing`.

    Example::

        @register_packing("conv_nchwc.blocked", gather=True)
        def pack_weights(w): ...
    """
    def wrap(fn: Callable) -> Callable:
        if name in _PACKINGS and _PACKINGS[name].function is not fn:
            raise ValueError(f"packing {name!r} is registered twice")
        _PACKINGS[name] = Packing(name, fn, gather)
        return fn
    return wrap


def find_packing(name: str) -> Packing:
    """The registered packing ``name`` (every kernel module is imported first, so a cache
    hit that runs no generator finds them)."""
    if name not in _PACKINGS:
        from egraft.kernels.cpu import kernel_ops

        kernel_ops()  # imports every generator module: each registers its packings
    if name not in _PACKINGS:
        raise KeyError(f"no weight packing {name!r}; known: {', '.join(sorted(_PACKINGS))}")
    return _PACKINGS[name]


@dataclass(frozen=True)
class PackedFrom:
    """How a derived constant was made: the packing ``packing`` applied to the constant
    ``source`` (its key in ``graph.constants``) with the keyword arguments ``params``
    (``(name, value)`` pairs, sorted). Recorded by :meth:`KernelContext.packed_constant`, so
    whoever holds the packed array (the compile cache) can make it again from the weight, or
    the weight from it, without guessing.

    Example: ``PackedFrom("conv_gemm.panels", "w", (("group", 1), ("mr", 6)))``.
    """

    packing: str
    source: str
    params: tuple[tuple[str, Any], ...] = ()

    @property
    def gather(self) -> bool:
        return find_packing(self.packing).gather

    def apply(self, weight) -> np.ndarray:
        """The packed array of ``weight`` (the source constant's value), its subnormal floats
        flushed to zero (:func:`flush_subnormals`)."""
        return flush_subnormals(find_packing(self.packing).function(weight, **dict(self.params)))

    def unpack(self, packed, shape: tuple, dtype) -> np.ndarray:
        """The weight (of ``shape`` and ``dtype``) that ``packed`` was packed from, for a
        gather packing: the packing applied to the weight's own indices (plus one, as
        float32 while that is exact, else as two exact halves; padding reads 0) says where
        each element went."""
        if not self.gather:
            raise ValueError(f"packing {self.packing!r} is not a gather: its weight cannot be unpacked")
        size = int(np.prod(shape))
        weight = np.empty(size, np.dtype(dtype))
        if size < 2**24:  # every index + 1 is exact in float32: one packing says where each went
            where = self.apply(np.arange(1, size + 1, dtype=np.float32).reshape(shape))
            present = where != 0
            weight[where[present].astype(np.int64) - 1] = np.asarray(packed)[present]
            return weight.reshape(shape)
        index = np.arange(size, dtype=np.int64)
        low = self.apply((index % 4096).astype(np.float32).reshape(shape))
        high = self.apply((index // 4096).astype(np.float32).reshape(shape))
        present = self.apply(np.ones(shape, np.float32)) != 0
        weight[high[present].astype(np.int64) * 4096 + low[present].astype(np.int64)] = np.asarray(packed)[present]
        return weight.reshape(shape)


class Unsupported(Exception):
    """A generator cannot compile this node; the message says why (shown in the report)."""


def llvm_type(dtype: DType) -> ir.Type:
    """The LLVM element type of ``dtype``; :class:`Unsupported` for the others."""
    if dtype not in LLVM_TYPES:
        raise Unsupported(f"dtype {dtype.short} has no generated code")
    return LLVM_TYPES[dtype]


def is_float(t: ir.Type) -> bool:
    return isinstance(t, ir.FloatType | ir.DoubleType)


class KernelContext(NodeAttrs):
    """One kernel being emitted: the node, its operand types and attributes, and an
    ``ir.IRBuilder`` positioned inside ``void name(i8** table, i64* dims)``.

    Attributes:
        node: the IR node.
        graph: the graph it belongs to (for its constants).
        builder: where code goes.
        math: :class:`MathEmitter` for exp, log, tanh, erf...
    """

    def __init__(self, module: ir.Module, name: str, node: Node, graph: Graph, opdef: OpDef, opset: int,
                 slots: dict[str, int], dim_index: Mapping[str, int], derived: dict | None = None):
        self.module = module
        self._derived = derived if derived is not None else {}
        self.name = name
        self.node = node
        self.graph = graph
        self.opdef = opdef
        self.opset = opset
        self._slots = slots
        self._dim_index = dim_index
        self._defaults = opdef.attr_defaults(opset)
        self.function = ir.Function(module, KERNEL_TYPE, KERNEL_SYMBOL)
        self.table, self.dims, self.part, self.parts, self.scratch = self.function.args
        for arg, arg_name in zip(self.function.args, ("table", "dims", "part", "parts", "scratch")):
            arg.name = arg_name
        #: Set by a generator whose code computes only share ``part`` of ``parts``.
        self.parallel = False
        #: Cleared by a generator that unrolls its own loops (register tiles): LLVM's unroller
        #: then only multiplies the code it compiles (``egraft.kernels.cpu.llvm.pipeline_header``).
        self.llvm_unroll = True
        #: Cleared by a generator whose code is vector code already: LLVM's loop vectorizer then
        #: only adds versions of the scalar loops around it.
        self.llvm_loop_vectorize = True
        #: ``(axis, operand dim, result dim)`` whose broadcast the code decides at run time
        #: (``broadcast_strides``): the runtime checks that each operand dim is 1 or the result's.
        self.broadcast_guards: list[tuple] = []
        self._entry = self.function.append_basic_block("entry")
        self._start = self.function.append_basic_block("start")
        self.builder = ir.IRBuilder(self._start)
        self.math = MathEmitter(module, self.builder)
        self._dim_cache: dict[Any, ir.Value] = {}
        #: The table entries (by value or derived constant name) whose pointer the code
        #: loads: what the kernel reads or writes at run time. A constant input that is
        #: not here (its weights were packed into a derived constant) is dead at run time.
        self.table_names: set[str] = set()
        #: The table slot names of the kernel's operands, in the order of its ``table`` argument.
        self.operands: list[str] = []
        #: The symbols of the dims the kernel reads, in the order of its ``dims`` argument.
        self.dim_operands: list[str] = []
        #: How each packed derived constant (by table slot name) was made from a constant
        #: input (:meth:`packed_constant`); derived constants not here (offset tables) are
        #: made from the shapes alone.
        self.packed_from: dict[str, PackedFrom] = {}
        #: ``(slot name, array)`` of every derived constant, in the order they were made.
        self.derived_made: list[tuple[str, Any]] = []
        #: The inputs whose constant values the generator read (:meth:`constant`): the
        #: emitted code may depend on them (:mod:`egraft.lowering.kernel_memo`).
        self.values_read: set[int] = set()

    # ---- the node (``attr`` comes from NodeAttrs) ------------------------------------------
    def has_input(self, i: int) -> bool:
        return i < len(self.node.inputs) and self.node.inputs[i] is not None

    def in_type(self, i: int) -> TensorType:
        return self.node.inputs[i].type

    def out_type(self, j: int = 0) -> TensorType:
        return self.node.outputs[j].type

    def constant(self, i: int):
        """The array of input ``i`` when it is a constant (weights), else ``None``. The code
        emitted may depend on its values: a generator that only asks whether input ``i`` is
        a constant calls :meth:`is_constant`."""
        v = self.node.inputs[i]
        if v is None or v.const is None:
            return None
        self.values_read.add(i)
        return self.graph.constants[v.const]

    def is_constant(self, i: int) -> bool:
        """Whether input ``i`` is a constant (its values are not read)."""
        return i < len(self.node.inputs) and self.node.inputs[i] is not None and self.node.inputs[i].const is not None

    def shape(self, t: TensorType) -> tuple:
        if t.shape is None:
            raise Unsupported("an operand of unknown rank")
        return tuple(t.shape)

    # ---- operands -----------------------------------------------------------------------------
    def _pointer(self, value_name: str, element: ir.Type) -> ir.Value:
        slot = self._slots[value_name]
        self.table_names.add(value_name)
        # Operands are numbered by table slot: an in-place kernel's input and output share
        # a slot, so the code loads one pointer for both (LLVM then knows they are the same
        # buffer, not two that might overlap, and vectorizes without runtime checks).
        slots = [self._slots[name] for name in self.operands]
        if slot not in slots:
            self.operands.append(value_name)
            slots.append(slot)
        index = slots.index(slot)
        with self._at_entry():
            raw = self._entry_builder.load(self._entry_builder.gep(self.table, [ir.Constant(I64, index)]))
            return self._entry_builder.bitcast(raw, element.as_pointer(), name=f"p{index}")

    def in_ptr(self, i: int) -> ir.Value:
        """Input ``i``'s buffer, typed as a pointer to its element type."""
        v = self.node.inputs[i]
        return self._pointer(v.name, llvm_type(v.type.dtype))

    def derived_constant(self, tag: str, array) -> ir.Value:
        """A constant computed at compile time from the node's constants (weights packed
        for a kernel), given its own table slot; returns its element pointer.

        Example: ``ctx.derived_constant("packed_w", pack_a_constant(w))``.
        """
        name = f"{self.name}.{tag}"
        self._derived[name] = array
        self.derived_made.append((name, array))
        self._slots.setdefault(name, len(self._slots))
        return self._pointer(name, llvm_type(DType.from_numpy(array.dtype)))

    def packed_constant(self, tag: str, packing: str, i: int, **params) -> tuple[ir.Value, np.ndarray]:
        """Constant input ``i`` packed by the registered packing ``packing`` (with ``params``)
        as a derived constant, recorded in :attr:`packed_from`; returns its element pointer
        and the packed array.

        Example: ``ptr, packed = ctx.packed_constant("packed_w", "conv_nchwc.blocked", 1)``.
        """
        made = PackedFrom(packing, self.node.inputs[i].const, tuple(sorted(params.items())))
        array = made.apply(self.graph.constants[made.source])
        pointer = self.derived_constant(tag, array)
        self.packed_from[f"{self.name}.{tag}"] = made
        return pointer, array

    def out_ptr(self, j: int = 0) -> ir.Value:
        """Output ``j``'s buffer, typed as a pointer to its element type."""
        v = self.node.outputs[j]
        return self._pointer(v.name, llvm_type(v.type.dtype))

    # ---- dims ---------------------------------------------------------------------------------
    def dim(self, d) -> ir.Value:
        """An ``i64`` holding dim ``d`` (an int or a sympy expression over the symbolic dims).

        Integer dims become constants; symbols are read once, in the entry block, from the
        ``dims`` argument.
        """
        if isinstance(d, int | sympy.Integer):
            return ir.Constant(I64, int(d))
        key = sympy.sympify(d)
        if key in self._dim_cache:
            return self._dim_cache[key]
        with self._at_entry():
            value = self._dim_expr(key, self._entry_builder)
        self._dim_cache[key] = value
        return value

    def _dim_expr(self, e: sympy.Expr, b: ir.IRBuilder) -> ir.Value:
        """``e`` computed in ``b``: integers, symbols read from ``dims``, sums, products,
        powers, exact divisions (``n*(n + 1)/2``), floor and ceiling of rational expressions
        (``floor(height/32 - 1/32)``: floor division of ``height - 1`` by 32), ``Mod``,
        ``Max`` and ``Min``; :class:`Unsupported` for anything else."""
        if e.is_Integer:
            return ir.Constant(I64, int(e))
        if e.is_Symbol:
            if e.name not in self._dim_index:
                raise Unsupported(f"dim {e.name} is not known when the kernel runs")
            if e.name not in self.dim_operands:
                self.dim_operands.append(e.name)
            index = self.dim_operands.index(e.name)
            return b.load(b.gep(self.dims, [ir.Constant(I64, index)]), name=f"d{index}")
        if isinstance(e, sympy.floor | sympy.ceiling):
            num, den = integer_fraction(e.args[0])
            if den is None:
                raise Unsupported(f"dim expression {e} has no generated code")
            n = self._dim_expr(num, b)
            return floor_div(b, n, den) if isinstance(e, sympy.floor) else ceil_div(b, n, den)
        if isinstance(e, sympy.Mod) and e.args[1].is_Integer and int(e.args[1]) > 0:
            n, m = self._dim_expr(e.args[0], b), int(e.args[1])
            return b.sub(n, b.mul(floor_div(b, n, m), ir.Constant(I64, m)))
        if e.is_Add or e.is_Mul or e.is_Rational:
            num, den = integer_fraction(e)
            if den is None:
                raise Unsupported(f"dim expression {e} has no generated code")
            if den != 1:  # an integer-valued quotient (n*(n + 1)/2): the division is exact
                return b.sdiv(self._dim_expr(num, b), ir.Constant(I64, den))
            parts = [self._dim_expr(a, b) for a in e.args]
            out = parts[0]
            for p in parts[1:]:
                out = b.add(out, p) if e.is_Add else b.mul(out, p)
            return out
        if e.is_Pow and e.exp.is_Integer and int(e.exp) > 0:
            base = self._dim_expr(e.base, b)
            out = base
            for _ in range(int(e.exp) - 1):
                out = b.mul(out, base)
            return out
        if isinstance(e, sympy.Max | sympy.Min):
            pick = imax if isinstance(e, sympy.Max) else imin
            parts = [self._dim_expr(a, b) for a in e.args]
            out = parts[0]
            for p in parts[1:]:
                out = pick(b, out, p)
            return out
        raise Unsupported(f"dim expression {e} has no generated code")

    def numel(self, shape: Sequence) -> ir.Value:
        """The product of ``shape``'s dims as an ``i64``."""
        total = sympy.Integer(1)
        for d in shape:
            total = total * d
        return self.dim(sympy.expand(total))

    # ---- control flow --------------------------------------------------------------------------
    @contextmanager
    def _at_entry(self) -> Iterator[None]:
        if not hasattr(self, "_entry_builder"):
            self._entry_builder = ir.IRBuilder(self._entry)
        yield

    def alloca(self, t: ir.Type, name: str = "") -> ir.Value:
        """A stack slot in the entry block (LLVM promotes it to a register)."""
        with self._at_entry():
            return self._entry_builder.alloca(t, name=name)

    @contextmanager
    def loop(self, count: ir.Value | int, name: str = "i", start: ir.Value | int = 0) -> Iterator[ir.Value]:
        """``for i in range(start, count)``: yields the ``i64`` index; code emitted inside
        the ``with`` block is the body."""
        b = self.builder
        count = ir.Constant(I64, count) if isinstance(count, int) else count
        start = ir.Constant(I64, start) if isinstance(start, int) else start
        var = self.alloca(I64, name=f"{name}.var")
        b.store(start, var)
        cond = self.function.append_basic_block(f"{name}.cond")
        body = self.function.append_basic_block(f"{name}.body")
        done = self.function.append_basic_block(f"{name}.end")
        b.branch(cond)
        b.position_at_end(cond)
        i = b.load(var, name=name)
        b.cbranch(b.icmp_signed("<", i, count), body, done)
        b.position_at_end(body)
        yield i
        b.store(b.add(i, ir.Constant(I64, 1)), var)
        b.branch(cond)
        b.position_at_end(done)

    def share(self, count: ir.Value | int) -> tuple[ir.Value, ir.Value]:
        """This call's share ``[lo, hi)`` of ``range(count)`` (the kernel's ``part`` of
        ``parts``), and the kernel declared parallel: loop over the share instead of the whole
        range, and make sure nothing else the kernel writes depends on the other shares.

        Example: ``lo, hi = ctx.share(channels)`` then ``with ctx.loop(hi, start=lo) as c: ...``.
        """
        b = self.builder
        count = ir.Constant(I64, count) if isinstance(count, int) else count
        lo = b.sdiv(b.mul(count, self.part), self.parts)
        hi = b.sdiv(b.mul(count, b.add(self.part, ir.Constant(I64, 1))), self.parts)
        self.parallel = True
        return lo, hi

    def finish(self) -> None:
        """Close the function: the entry block falls through to the code."""
        with self._at_entry():
            self._entry_builder.branch(self._start)
        if not self.builder.block.is_terminated:
            self.builder.ret_void()


def splat(b: ir.IRBuilder, value: ir.Value, width: int) -> ir.Value:
    """A vector of ``width`` copies of the scalar ``value``."""
    vector_type = ir.VectorType(value.type, width)
    one = b.insert_element(ir.Constant(vector_type, None), value, ir.Constant(ir.IntType(32), 0))
    mask = ir.Constant(ir.VectorType(ir.IntType(32), width), [0] * width)
    return b.shuffle_vector(one, ir.Constant(vector_type, None), mask)


def concat(b: ir.IRBuilder, low: ir.Value, high: ir.Value) -> ir.Value:
    """One vector of ``low``'s lanes then ``high``'s (two blocks as one 16-lane vector)."""
    n = low.type.count
    return b.shuffle_vector(low, high, ir.Constant(ir.VectorType(ir.IntType(32), 2 * n), list(range(2 * n))))


def halves(b: ir.IRBuilder, v: ir.Value) -> tuple[ir.Value, ir.Value]:
    """The first and the second half of the lanes of ``v`` (a 16-lane vector as two blocks)."""
    n = v.type.count // 2
    undef = ir.Constant(v.type, None)
    mask = [ir.Constant(ir.VectorType(ir.IntType(32), n), list(range(k * n, (k + 1) * n))) for k in (0, 1)]
    return b.shuffle_vector(v, undef, mask[0]), b.shuffle_vector(v, undef, mask[1])


def prefetch(b: ir.IRBuilder, pointer: ir.Value, write: bool = False) -> None:
    """Ask for the cache line at ``pointer`` (any pointer type) ahead of its use, kept in every
    cache level (``llvm.prefetch``: never faults, whatever the address)."""
    module = b.module
    fn = module.globals.get("llvm.prefetch.p0") or ir.Function(
        module, ir.FunctionType(ir.VoidType(), [I8P, I32, I32, I32]), "llvm.prefetch.p0")
    b.call(fn, [b.bitcast(pointer, I8P), ir.Constant(I32, int(write)), ir.Constant(I32, 3), ir.Constant(I32, 1)])


def _vector_suffix(element: ir.Type) -> str:
    """The element part of an overloaded intrinsic's name (``f32``, ``f64``, ``i32``)."""
    return {F32: "f32", F64: "f64"}.get(element) or f"i{element.width}"


def masked_load(b: ir.IRBuilder, ptr: ir.Value, index: ir.Value, mask: ir.Value) -> ir.Value:
    """``len(mask)`` elements of ``ptr[index..]`` where ``mask`` is set, zero elsewhere;
    masked lanes are not read (they may lie outside the buffer): ``llvm.masked.load``.

    Example: the columns of an image row inside ``[0, width)``, at the padding.
    """
    element = ptr.type.pointee
    lanes = mask.type.count
    vt = ir.VectorType(element, lanes)
    pointer = b.bitcast(b.gep(ptr, [index]), vt.as_pointer())
    size = 4 if element == F32 else 8
    name = f"llvm.masked.load.v{lanes}{'f32' if element == F32 else 'f64'}.p0"
    module = b.module
    fn = module.globals.get(name) or ir.Function(module, ir.FunctionType(vt, [pointer.type, I32, mask.type, vt]),
                                                 name)
    return b.call(fn, [pointer, ir.Constant(I32, size), mask, ir.Constant(vt, [0.0] * lanes)])


def masked_store(b: ir.IRBuilder, value: ir.Value, ptr: ir.Value, index: ir.Value, mask: ir.Value) -> None:
    """Store the lanes of ``value`` where ``mask`` is set to ``ptr[index..]``; the others are
    not written (they may lie outside the buffer): ``llvm.masked.store``.

    Example: the last, partial vector of an output row.
    """
    element = ptr.type.pointee
    vt = value.type
    pointer = b.bitcast(b.gep(ptr, [index]), vt.as_pointer())
    size = 8 if element == F64 else 4
    name = f"llvm.masked.store.v{vt.count}{_vector_suffix(element)}.p0"
    module = b.module
    fn = module.globals.get(name) or ir.Function(module, ir.FunctionType(ir.VoidType(), [vt, pointer.type, I32,
                                                                                        mask.type]), name)
    b.call(fn, [value, pointer, ir.Constant(I32, size), mask])


#: Cephes' float32 ``e^r = 1 + r + r^2 * P(r)`` on ``|r| <= ln(2)/2``, highest power first.
EXP_POLYNOMIAL = (1.9875691500e-4, 1.3981999507e-3, 8.3334519073e-3, 4.1665795894e-2, 1.6666665459e-1,
                  5.0000001201e-1)
#: float32 ``tanh(x) = x * P(x^2) / Q(x^2)`` on ``[-TANH_CLAMP, TANH_CLAMP]`` (Eigen's rational
#: approximation), highest power first.
TANH_NUMERATOR = (-2.76076847742355e-16, 2.00018790482477e-13, -8.60467152213735e-11, 5.12229709037114e-08,
                  1.48572235717979e-05, 6.37261928875436e-04, 4.89352455891786e-03)
TANH_DENOMINATOR = (1.19825839466702e-06, 1.18534705686654e-04, 2.26843463243900e-03, 4.89352518554385e-03)
#: Where tanh's argument is clamped (onnxruntime's MLAS clamps there too; the rational
#: function reaches 1 in float32 at 7.9 and stays within 2.4e-7 of it up to 9).
TANH_CLAMP = 9.0
#: float32 ``sigmoid(x) = x * P(x^2) / Q(x^2) + 1/2`` on ``[-SIGMOID_CLAMP, SIGMOID_CLAMP]``
#: (onnxruntime's MLAS logistic), highest power first.
SIGMOID_NUMERATOR = (4.37031012579801e-11, 1.15627324459942e-07, 6.08574864600143e-05, 8.51377133304701e-03,
                     2.48287947061529e-01)
SIGMOID_DENOMINATOR = (6.10247389755681e-13, 5.76102136993427e-09, 6.29106785017040e-06, 1.70198817374094e-03,
                       1.16817656904453e-01, 9.93151921023180e-01)
SIGMOID_CLAMP = 18.0
#: float32 ``erf(x) = x * P(x^2) / Q(x^2)`` on ``[-4, 4]`` (Eigen's), highest power first.
ERF_NUMERATOR = (-2.72614225801306e-10, 2.77068142495902e-08, -2.10102402082508e-06, -5.69250639462346e-05,
                 -7.34990630326855e-04, -2.95459980854025e-03, -1.60960333262415e-02)
ERF_DENOMINATOR = (-1.45660718464996e-05, -2.13374055278905e-04, -1.68282697438203e-03, -7.37332916720468e-03,
                   -1.42647390514189e-02)


@lru_cache(maxsize=4096)
def constant(t: ir.Type, v: float) -> ir.Constant:
    """``v`` as a constant of ``t`` (a scalar type, or a vector type: ``v`` in every lane),
    one object per type and value: a constant formats its text once, on first use, and a
    splat of 16 lanes is costly to build and to format (a SiLU epilogue asks for its
    polynomial's coefficients per accumulator: 74,000 constants in ddddocr_det's lowering).

    Example:
        >>> constant(ir.VectorType(ir.FloatType(), 2), 1.5) is constant(ir.VectorType(ir.FloatType(), 2), 1.5)
        True
    """
    if isinstance(t, ir.VectorType):
        return ir.Constant(t, [constant(t.element, v).constant] * t.count)
    return ir.Constant(t, float(v)) if is_float(t) else ir.Constant(t, int(v))


class MathEmitter:
    """Math in LLVM IR on scalars or vectors.

    float32 ``exp``, ``tanh``, ``erf`` and ``sigmoid`` are plain arithmetic (a range
    reduction and a polynomial, or a rational function), so the loops that use them
    vectorize: LLVM has no vector ``expf`` here and would call libm lane by lane (about
    14 ns an element for ``tanhf``). Each is within 2 ulp (``exp``; 5e-7 absolute for
    ``tanh``, ``erf`` and ``sigmoid``) of the float64 result and keeps NaN and the
    infinities; ``tanh`` and ``sigmoid`` are onnxruntime's (MLAS's) to the bit, so a
    quantized model that rounds their outputs rounds as onnxruntime does. float64 goes to libm and LLVM's intrinsics.

    Example: ``math.exp(x)`` on a ``<8 x float>`` is 8 lanes of the polynomial, no call.
    """

    def __init__(self, module: ir.Module, builder: ir.IRBuilder):
        self.module = module
        self.b = builder

    def _function(self, name: str, t: ir.Type, arity: int = 1) -> ir.Function:
        if name in self.module.globals:
            return self.module.globals[name]
        return ir.Function(self.module, ir.FunctionType(t, [t] * arity), name)

    def _intrinsic(self, base: str, x: ir.Value, *more: ir.Value) -> ir.Value:
        """``llvm.<base>`` on scalars or vectors (the name's suffix follows the type)."""
        t = x.type
        element = t.element if isinstance(t, ir.VectorType) else t
        suffix = "f32" if element == F32 else "f64"
        if isinstance(t, ir.VectorType):
            suffix = f"v{t.count}{suffix}"
        return self.b.call(self._function(f"llvm.{base}.{suffix}", x.type, 1 + len(more)), [x, *more])

    def _libm(self, base: str, x: ir.Value) -> ir.Value:
        """libm's ``base`` (``basef`` for float32); on a vector, lane by lane."""
        t = x.type
        element = t.element if isinstance(t, ir.VectorType) else t
        fn = self._function(base + ("f" if element == F32 else ""), element)
        if not isinstance(t, ir.VectorType):
            return self.b.call(fn, [x])
        out = ir.Constant(t, None)
        for lane in range(t.count):
            i = ir.Constant(ir.IntType(32), lane)
            out = self.b.insert_element(out, self.b.call(fn, [self.b.extract_element(x, i)]), i)
        return out

    def const(self, t: ir.Type, v: float) -> ir.Value:
        """``v`` as a constant of ``t`` (a scalar type, or a vector type: ``v`` in every lane)."""
        return constant(t, v)

    @staticmethod
    def _is_f32(x: ir.Value) -> bool:
        t = x.type
        return (t.element if isinstance(t, ir.VectorType) else t) == F32

    def _same_shape_int(self, x: ir.Value) -> ir.Type:
        t = x.type
        return ir.VectorType(I32, t.count) if isinstance(t, ir.VectorType) else I32

    def _clamp(self, x: ir.Value, lo: float, hi: float) -> ir.Value:
        """``x`` within ``[lo, hi]``; NaN stays NaN (the comparisons are false)."""
        b, t = self.b, x.type
        x = b.select(b.fcmp_ordered("<", x, self.const(t, lo)), self.const(t, lo), x)
        return b.select(b.fcmp_ordered(">", x, self.const(t, hi)), self.const(t, hi), x)

    def _horner(self, x: ir.Value, coefficients: tuple[float, ...]) -> ir.Value:
        """``c[0] * x^(n-1) + ... + c[n-1]`` (highest power first), fused multiply-adds."""
        b, t = self.b, x.type
        out = self.const(t, coefficients[0])
        for c in coefficients[1:]:
            out = b.fadd(b.fmul(out, x, flags=("contract",)), self.const(t, c), flags=("contract",))
        return out

    def exp(self, x):
        """e^x. float32: ``2^n * e^r`` with ``n = rint(x / ln 2)``, ``|r| <= ln(2)/2`` split
        off in two parts (Cody and Waite) and Cephes' degree-7 polynomial for ``e^r``; ``2^n``
        built from exponent bits in two halves, so results down to the subnormals and up to
        infinity come out of the multiplications."""
        if not self._is_f32(x):
            return self._intrinsic("exp", x)
        b, t = self.b, x.type
        it = self._same_shape_int(x)
        clamped = self._clamp(x, -104.0, 88.8)
        n = self._intrinsic("rint", b.fmul(clamped, self.const(t, 1.4426950408889634)))
        r = b.fsub(clamped, b.fmul(n, self.const(t, 0.693359375)))
        r = b.fsub(r, b.fmul(n, self.const(t, -2.12194440e-4)))
        p = self._horner(r, EXP_POLYNOMIAL)
        p = b.fadd(b.fmul(b.fmul(p, r), r), b.fadd(r, self.const(t, 1.0)))
        ni = b.fptosi(n, it)
        half = b.ashr(ni, self.const(it, 1))

        def power_of_two(k: ir.Value) -> ir.Value:
            return b.bitcast(b.shl(b.add(k, self.const(it, 127)), self.const(it, 23)), t)

        value = b.fmul(b.fmul(p, power_of_two(half)), power_of_two(b.sub(ni, half)))
        return b.select(b.fcmp_unordered("uno", x, x), x, value)

    def log(self, x):
        return self._intrinsic("log", x)

    def sqrt(self, x):
        return self._intrinsic("sqrt", x)

    def fabs(self, x):
        return self._intrinsic("fabs", x)

    def maximum(self, a, b):
        """max(a, b) propagating NaN, as numpy's maximum: two compares and two blends (a
        constant operand folds its NaN test away). ``llvm.maximum`` says the same but also
        orders -0 below +0, which AVX2 has no instruction for: its lowering made a stride-2
        3x3 MaxPool 2.6x slower. Equal values (zeros of either sign) give ``b``, as numpy's do."""
        bld = self.b
        larger = bld.select(bld.fcmp_ordered(">", a, b), a, b)  # b when it is not smaller, or NaN
        return bld.select(bld.fcmp_unordered("uno", a, a), a, larger)

    def minimum(self, a, b):
        """min(a, b) propagating NaN (see :meth:`maximum`)."""
        bld = self.b
        smaller = bld.select(bld.fcmp_ordered("<", a, b), a, b)  # b when it is not larger, or NaN
        return bld.select(bld.fcmp_unordered("uno", a, a), a, smaller)

    def tanh(self, x):
        """tanh. float32: ``x * P(x^2) / Q(x^2)`` on ``[-TANH_CLAMP, TANH_CLAMP]`` (Eigen's
        rational approximation, within 4e-7), evaluated as onnxruntime's MLAS evaluates it
        (same clamp, same multiply-adds), so the two agree bit for bit: a quantized model
        that rounds tanh's output to uint8 (tashkeel's attention) then rounds alike."""
        if not self._is_f32(x):
            return self._libm("tanh", x)
        b = self.b
        clamped = self._clamp(x, -TANH_CLAMP, TANH_CLAMP)
        x2 = b.fmul(clamped, clamped)
        return b.fdiv(b.fmul(clamped, self._horner(x2, TANH_NUMERATOR)), self._horner(x2, TANH_DENOMINATOR))

    def erf(self, x):
        """erf. float32: ``x * P(x^2) / Q(x^2)`` on ``[-4, 4]`` (Eigen's rational
        approximation, within 5e-7, kept within [-1, 1]; erf is +-1 in float32 beyond)."""
        if not self._is_f32(x):
            return self._libm("erf", x)
        b = self.b
        clamped = self._clamp(x, -4.0, 4.0)
        x2 = b.fmul(clamped, clamped)
        ratio = b.fdiv(b.fmul(self._horner(x2, ERF_NUMERATOR), clamped), self._horner(x2, ERF_DENOMINATOR))
        return self._clamp(ratio, -1.0, 1.0)  # the rational function overshoots 1 by an ulp near 4

    def relu(self, x):
        """max(x, 0), NaN kept (as numpy's maximum)."""
        zero = self.const(x.type, 0)
        if is_float(x.type.element if isinstance(x.type, ir.VectorType) else x.type):
            return self.b.select(self.b.fcmp_ordered("<", x, zero), zero, x)
        return self.b.select(self.b.icmp_signed("<", x, zero), zero, x)

    def sigmoid(self, x):
        """1 / (1 + e^-x). float32: ``x * P(x^2) / Q(x^2) + 1/2`` on ``[-SIGMOID_CLAMP,
        SIGMOID_CLAMP]``, kept within ``[0, 1]``: onnxruntime's MLAS logistic, evaluated as
        it evaluates it (within 1.2e-7 absolute; the two agree bit for bit)."""
        if not self._is_f32(x):
            one = self.const(x.type, 1.0)
            return self.b.fdiv(one, self.b.fadd(one, self.exp(self.b.fneg(x))))
        b, t = self.b, x.type
        clamped = self._clamp(x, -SIGMOID_CLAMP, SIGMOID_CLAMP)
        x2 = b.fmul(clamped, clamped)
        ratio = b.fdiv(b.fmul(self._horner(x2, SIGMOID_NUMERATOR), clamped), self._horner(x2, SIGMOID_DENOMINATOR))
        return self._clamp(b.fadd(ratio, self.const(t, 0.5)), 0.0, 1.0)

    #: Activations whose code is long (a rational function and clamps: 30-40 instructions a
    #: vector): :meth:`activation_in_place` gives them a function of their own.
    OUT_OF_LINE = frozenset({"sigmoid", "silu", "tanh", "gelu", "gelu_tanh"})

    def activation_in_place(self, name: str, params, pointer: ir.Value, count: int, lanes: int) -> None:
        """Apply :meth:`activation` to the ``count`` floats at ``pointer`` (a multiple of
        ``lanes``), through a function of the module's own that runs it on ``lanes``-wide
        vectors. For a generator that applies a long activation (:data:`OUT_OF_LINE`) to every
        register of many unrolled tiles: inlined per accumulator, a blocked convolution's SiLU
        epilogue made up to 1 MB of IR per kernel. Called once the tile is stored, so no
        register is live across the call.

        Example: ``ctx.math.activation_in_place("silu", [], row_pointer, 48, 8)``."""
        from egraft.ir.ops.fused import activation_params

        t = ir.VectorType(F32, lanes)
        p = activation_params(name, params)
        symbol = f"egraft.act.{name}.{'_'.join(repr(float(v)) for v in p)}.x{lanes}"
        fn = self.module.globals.get(symbol)
        if fn is None:
            fn = ir.Function(self.module, ir.FunctionType(ir.VoidType(), [F32.as_pointer(), I64]), symbol)
            fn.linkage = "internal"
            fn.calling_convention = "fastcc"
            fn.attributes.add("noinline")
            data, n = fn.args
            entry, loop, done = (fn.append_basic_block(x) for x in ("entry", "loop", "done"))
            body = ir.IRBuilder(entry)
            body.branch(loop)
            body.position_at_end(loop)
            i = body.phi(I64)
            i.add_incoming(ir.Constant(I64, 0), entry)
            at = body.bitcast(body.gep(data, [i]), t.as_pointer())
            value = MathEmitter(self.module, body).activation(name, params, body.load(at, align=4))
            body.store(value, at, align=4)
            following = body.add(i, ir.Constant(I64, lanes))
            i.add_incoming(following, loop)
            body.cbranch(body.icmp_signed("<", following, n), loop, done)
            body.position_at_end(done)
            body.ret_void()
        self.b.call(fn, [pointer, ir.Constant(I64, count)], cconv="fastcc")

    def activation(self, name: str, params, x: ir.Value) -> ir.Value:
        """The fused ops' trailing ``activation`` (see :data:`egraft.ir.ops.fused.ACTIVATIONS`)
        applied to ``x``, with ``params`` as ``activation_params`` (defaults filled in)."""
        from egraft.ir.ops.fused import activation_params

        p = activation_params(name, params)
        b, t = self.b, x.type
        c = lambda v: self.const(t, v)  # noqa: E731
        if name == "":
            return x
        if name == "relu":
            return self.relu(x)
        if name == "leaky_relu":
            return b.select(b.fcmp_ordered("<", x, c(0)), b.fmul(x, c(p[0])), x)
        if name == "clip":
            lo, hi = p
            if lo != float("-inf"):
                x = b.select(b.fcmp_ordered("<", x, c(lo)), c(lo), x)
            if hi != float("inf"):
                x = b.select(b.fcmp_ordered(">", x, c(hi)), c(hi), x)
            return x
        if name == "sigmoid":
            return self.sigmoid(x)
        if name == "silu":
            return b.fmul(x, self.sigmoid(x))
        if name == "tanh":
            return self.tanh(x)
        if name == "hard_sigmoid":
            return self.minimum(self.maximum(b.fadd(b.fmul(x, c(p[0])), c(p[1])), c(0)), c(1))
        if name == "hard_swish":
            return b.fmul(x, self.minimum(self.maximum(b.fadd(b.fmul(x, c(1 / 6)), c(0.5)), c(0)), c(1)))
        if name == "gelu":
            return b.fmul(b.fmul(c(0.5), x), b.fadd(c(1), self.erf(b.fmul(x, c(0.7071067811865476)))))
        if name == "gelu_tanh":
            cubic = b.fmul(b.fmul(b.fmul(x, x), x), c(0.044715))
            inner = b.fmul(c(0.7978845608028654), b.fadd(x, cubic))
            return b.fmul(b.fmul(c(0.5), x), b.fadd(c(1), self.tanh(inner)))
        raise Unsupported(f"activation {name!r} has no generated code")


def const64(value: int) -> ir.Constant:
    """An ``i64`` constant."""
    return ir.Constant(I64, int(value))


def imax(b: ir.IRBuilder, x: ir.Value, y: ir.Value) -> ir.Value:
    """The larger of two ``i64`` values."""
    return b.select(b.icmp_signed(">", x, y), x, y)


def imin(b: ir.IRBuilder, x: ir.Value, y: ir.Value) -> ir.Value:
    """The smaller of two ``i64`` values."""
    return b.select(b.icmp_signed("<", x, y), x, y)


def ceil_div(b: ir.IRBuilder, n: ir.Value, d: int) -> ir.Value:
    """``ceil(n / d)`` for a positive constant ``d``."""
    return b.neg(floor_div(b, b.neg(n), d))


def floor_div(b: ir.IRBuilder, n: ir.Value, d: int) -> ir.Value:
    """``floor(n / d)`` for a positive constant ``d`` (``sdiv`` truncates toward zero: one
    less when the remainder is negative)."""
    divisor = ir.Constant(I64, d)
    q = b.sdiv(n, divisor)
    negative = b.icmp_signed("<", b.srem(n, divisor), ir.Constant(I64, 0))
    return b.sub(q, b.zext(negative, I64))

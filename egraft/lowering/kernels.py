"""Kernels shared by content: each generated kernel is one small LLVM module named after
its own text, so the steps that emit the same code (ResNet-50's 16 bottleneck blocks have
a dozen distinct convolutions between them) share one compiled function, and a kernel
compiled for one model is a cache hit for the next (:func:`egraft.kernels.cpu.llvm.compile_objects`).

A kernel's code names no model slot, dim or step (:class:`egraft.kernels.cpu.emit.KernelContext`
numbers its operands itself). Each kernel step gets a *call stub* under the step's own
name, ``k<n>_<op>``: it gathers the step's operands from the model's table (and its dims)
into two small arrays on its stack and calls the shared kernel with them::

    define void @"k12_ConvNCHWc"(i8** %table, i64* %dims, i64 %part, i64 %parts, i8* %scratch) {
      ; operands: table[31], table[7], table[32], table[33] -> ops[0..3]
      call void @"kernel.3f9c..."(i8** %ops, i64* %dims, i64 %part, i64 %parts, i8* %scratch)
    }

The runtime calls the stubs exactly as it called kernels before; a stub costs a few loads.

Example:
    >>> kernels = KernelSet()                                       # doctest: +SKIP
    >>> symbol = kernels.add(str(scratch_module))                   # doctest: +SKIP
    >>> kernels.call("k12_ConvNCHWc", symbol, slots=(31, 7), dims=())  # doctest: +SKIP
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field

from llvmlite import ir

from egraft.kernels.cpu.emit import I8P, I32, I64, KERNEL_SYMBOL, KERNEL_TYPE
from egraft.kernels.cpu.llvm import host_cpu

#: A kernel's symbol: this prefix and the first hex digits of its text's SHA-256.
SYMBOL_PREFIX = "kernel."
_DIGITS = 20


def kernel_symbol(text: str) -> tuple[str, str]:
    """The symbol of the kernel module ``text`` (emitted under :data:`KERNEL_SYMBOL`) and
    its text renamed to it: a digest of the text, so equal kernels get equal symbols.

    Example:
        >>> kernel_symbol('define void @"egraft.kernel"() { ret void }')[0][:7]
        'kernel.'
    """
    symbol = SYMBOL_PREFIX + hashlib.sha256(text.encode()).hexdigest()[:_DIGITS]
    return symbol, text.replace(f'@"{KERNEL_SYMBOL}', f'@"{symbol}')


@dataclass(frozen=True)
class KernelCall:
    """Step ``stub`` runs kernel ``kernel`` on table slots ``slots`` and dims entries ``dims``."""

    stub: str
    kernel: str
    slots: tuple[int, ...]
    dims: tuple[int, ...]


@dataclass
class KernelSet:
    """The distinct kernels of a model (module text by symbol) and the steps' calls of them."""

    modules: dict[str, str] = field(default_factory=dict)
    calls: list[KernelCall] = field(default_factory=list)

    def add(self, text: str) -> str:
        """Add the kernel module ``text`` (a duplicate is kept once); returns its symbol."""
        symbol, renamed = kernel_symbol(text)
        self.modules.setdefault(symbol, renamed)
        return symbol

    def call(self, stub: str, kernel: str, slots: tuple[int, ...], dims: tuple[int, ...]) -> None:
        """Step function ``stub`` calls ``kernel`` with these table slots and dims entries."""
        self.calls.append(KernelCall(stub, kernel, tuple(slots), tuple(dims)))

    def stubs_text(self) -> str:
        """The module of every step's call stub (the kernels declared, defined elsewhere)."""
        module = ir.Module(name="stubs")
        module.triple = host_cpu()[0]
        declared: dict[str, ir.Function] = {}
        for call in self.calls:
            kernel = declared.get(call.kernel) or ir.Function(module, KERNEL_TYPE, call.kernel)
            declared[call.kernel] = kernel
            stub = ir.Function(module, KERNEL_TYPE, call.stub)
            table, dims, part, parts, scratch = stub.args
            b = ir.IRBuilder(stub.append_basic_block("entry"))
            b.call(kernel, [_gathered(b, table, call.slots, I8P), _gathered(b, dims, call.dims, I64), part, parts,
                            scratch], tail=False)
            b.ret_void()
        return str(module)

    @property
    def text(self) -> str:
        """The stubs and every kernel linked into one module (``module.ll``: what ``llc`` or
        ``opt`` read)."""
        import llvmlite.binding as llvm

        from egraft.kernels.cpu.llvm import LOCK, initialized

        initialized()
        with LOCK:
            context = llvm.create_context()
            linked = llvm.parse_assembly(self.stubs_text(), context=context)
            for text in self.modules.values():
                linked.link_in(llvm.parse_assembly(text, context=context))
            return str(linked)


def _gathered(b: ir.IRBuilder, source: ir.Value, indices: tuple[int, ...], element: ir.Type) -> ir.Value:
    """A stack array of ``source[i]`` for each of ``indices``, as a pointer to its first
    element; ``source`` itself when there are none."""
    if not indices:
        return source
    array = b.alloca(ir.ArrayType(element, len(indices)))
    for k, index in enumerate(indices):
        value = b.load(b.gep(source, [ir.Constant(I64, index)]))
        b.store(value, b.gep(array, [ir.Constant(I32, 0), ir.Constant(I32, k)]))
    return b.gep(array, [ir.Constant(I32, 0), ir.Constant(I32, 0)])


__all__ = ["KernelSet", "KernelCall", "kernel_symbol", "SYMBOL_PREFIX"]

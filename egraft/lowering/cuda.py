"""CUDA lowering: the same schedule, storage and memory plan as the CPU's
(:func:`egraft.lowering.compile.lower`: views, Concats written in place, lifetimes, arena
offsets), with each kernel step rendered as CUDA C by :mod:`egraft.kernels.cuda` instead
of LLVM IR. :class:`CudaRenderer` is the sibling of :class:`~egraft.lowering.compile.CpuRenderer`.

Each step's translation unit is named after its content (equal kernels compile once) and
compiled by NVRTC for an explicit architecture (:mod:`egraft.kernels.cuda.nvrtc`), so a
CUDA build needs no GPU; :func:`cuda_report` is what ``egraft compile --target cuda``
prints: per kernel its op, registers, spills and shared memory.

Example:
    >>> program = compile_cuda(lower_cuda(graph), arch="sm_90")   # doctest: +SKIP
    >>> program.report()["kernels"][0]["registers"]               # doctest: +SKIP
    40
"""

from __future__ import annotations

import hashlib
import time
from dataclasses import dataclass, field

from egraft.ir.graph import Graph, Node
from egraft.ir.infer import node_opset
from egraft.kernels.cuda import find_kernel
from egraft.kernels.cuda.emit import CudaContext, CudaKernel, Unsupported
from egraft.kernels.cuda.nvrtc import DEFAULT_ARCH, CompiledModule, check_arch, compile_sources
from egraft.lowering.compile import Lowered, Step, _length_assumes_computed_starts, _lower


@dataclass(frozen=True)
class CudaCall:
    """Step ``step`` (named ``name``) runs module ``module``'s launches on these values
    (by operand, in the kernel's parameter order) and dim symbols."""

    step: int
    name: str
    module: str
    operands: tuple[str, ...]
    symbols: tuple[str, ...]


@dataclass
class CudaKernelSet:
    """The distinct translation units of a model (by digest) and each kernel step's call."""

    kernels: dict[str, CudaKernel] = field(default_factory=dict)
    calls: list[CudaCall] = field(default_factory=list)
    #: kernel steps whose output dims the values of small inputs decide (a Slice to
    #: ``Shape(x)[1]``, a ``Range(0, Shape(x)[2])``), with the nodes that compute those values
    #: from input shapes alone: the runtime derives the dims on the host once per binding,
    #: binding the fresh ones (``_d0``) and checking the others
    host_checks: dict[int, tuple[Node, ...]] = field(default_factory=dict)
    #: kernel steps whose code takes two dims for equal that inference could not prove
    #: equal: step index -> ((dim, dim), ...), checked per binding by the runtime
    guards: dict[int, tuple] = field(default_factory=dict)

    @property
    def modules(self) -> dict[str, str]:
        """Digest -> CUDA C source."""
        return {digest: k.source for digest, k in self.kernels.items()}

    def add(self, kernel: CudaKernel) -> str:
        text = kernel.source or repr((kernel.library, kernel.params))  # a library step: what it calls
        digest = "cu." + hashlib.sha256(text.encode()).hexdigest()[:20]
        self.kernels.setdefault(digest, kernel)
        return digest

    @property
    def text(self) -> str:
        """Every distinct translation unit, one after the other (``kernels.cu``)."""
        return "\n".join(f"// ---- {digest}\n{kernel.source}" for digest, kernel in sorted(self.kernels.items()))


class CudaRenderer:
    """Kernels as CUDA C (:mod:`egraft.kernels.cuda`), for the schedule loop of :func:`_lower`."""

    target = "cuda"
    reused_emissions = 0

    def __init__(self, storage, sharing, output_names, input_symbols):
        self.kernels = CudaKernelSet()
        self.derived: dict = {}
        self.packed_from: dict = {}
        self._producers: dict[str, Node] | None = None

    def kernel_step(self, index: int, node: Node, graph: Graph, slots: dict[str, int], dim_index: dict[str, int],
                    learned: list[str], runtime_constants: set[str]) -> Step | str:
        generator = find_kernel(node.op, node.domain)
        if generator is None:
            return "no CUDA kernel for this op"
        checks = None
        if learned or _length_assumes_computed_starts(graph, node):
            # the CPU runtime computes such dims from the input values before the kernel runs; on
            # a GPU that would read values back to the host mid-run, unless they come from shapes
            checks = self._from_shapes(graph, node)
            if checks is None:
                return "its output dims depend on input values (computed on the host)"
        ctx = CudaContext(node, graph, node_opset(graph, node))
        try:
            generator(ctx)
            kernel = ctx.finish()
        except Unsupported as e:
            return str(e)
        name = f"k{index}_{node.op}"
        operands = [(node.inputs if kind == "in" else node.outputs)[i] for kind, i in kernel.operands]
        values = [v.name for v in operands]
        runtime_constants.update(v.name for v in operands if v.const is not None)
        self.kernels.calls.append(CudaCall(index, name, self.kernels.add(kernel), tuple(values), kernel.symbols))
        if checks is not None:
            self.kernels.host_checks[index] = checks
        if kernel.guards:
            self.kernels.guards[index] = kernel.guards
        return Step(index, node, "kernel", function=name)

    def _from_shapes(self, graph: Graph, node: Node) -> tuple[Node, ...] | None:
        """The nodes (in graph order) that compute ``node``'s computed inputs beyond the first
        from constants and input *shapes* only (through Shape or Size), or ``None`` when one
        of them reads an input's values."""
        if self._producers is None:
            self._producers = {v.name: n for n in graph.nodes for v in n.outputs if v is not None}
        needed: dict[int, Node] = {}
        order = {id(n): k for k, n in enumerate(graph.nodes)}
        sizing = node.inputs if node.op in ("Range", "ConstantOfShape") else node.inputs[1:]
        stack = [v for v in sizing if v is not None and v.const is None]
        while stack:
            v = stack.pop()
            producer = self._producers.get(v.name)
            if producer is None:
                return None  # a graph input's values
            if id(producer) in needed:
                continue
            needed[id(producer)] = producer
            if producer.op not in ("Shape", "Size"):
                stack.extend(u for u in producer.inputs if u is not None and u.const is None)
        return tuple(sorted(needed.values(), key=lambda n: order[id(n)]))


def lower_cuda(graph: Graph) -> Lowered:
    """Schedule ``graph`` and render its kernels as CUDA C (nothing compiled yet)."""
    return _lower(graph, CudaRenderer)


@dataclass
class CudaProgram:
    """A lowered graph with its kernels compiled for ``arch``: what a CUDA runtime loads."""

    lowered: Lowered
    arch: str
    modules: dict[str, CompiledModule]
    seconds: dict[str, float]

    @property
    def kernels(self) -> CudaKernelSet:
        return self.lowered.kernels

    def report(self) -> dict:
        """``kernels`` (per step: name, op, the functions' registers, spill bytes, static and
        dynamic shared memory), ``fallbacks`` (op and reason), ``arch``, compile seconds."""
        rows = []
        for call in self.kernels.calls:
            kernel = self.kernels.kernels[call.module]
            module = self.modules[call.module]
            node = self.lowered.graph.nodes[call.step]
            if kernel.library is not None:
                rows.append({"name": call.name, "op": node.op, "function": f"library:{kernel.library.kind}",
                             "module": call.module, "registers": None, "spill_bytes": 0, "shared_bytes": 0,
                             "threads": 0, "library": True})
            for launch in kernel.launches:
                r = module.resources.get(launch.function)
                rows.append({"name": call.name, "op": node.op if node.domain in ("", "ai.onnx")
                             else f"{node.domain}::{node.op}", "function": launch.function, "module": call.module,
                             "registers": r.registers if r else None, "spill_bytes": r.spill_bytes if r else None,
                             "shared_bytes": (r.shared_bytes if r else 0) + launch.shared_bytes,
                             "threads": launch.block[0] * launch.block[1] * launch.block[2]})
        fallbacks = [{"step": s.index, "op": s.node.op, "reason": s.reason} for s in self.lowered.steps
                     if s.kind == "fallback"]
        return {"target": "cuda", "arch": self.arch, "kernels": rows, "fallbacks": fallbacks,
                "modules": len(self.modules), "compiled": sum(not m.cached for m in self.modules.values()),
                "seconds": {k: round(v, 3) for k, v in self.seconds.items()}}


def compile_cuda(lowered: Lowered, arch: str = DEFAULT_ARCH, use_cache: bool = True) -> CudaProgram:
    """Compile every distinct translation unit of ``lowered`` (a :func:`lower_cuda` result)
    for ``arch`` with NVRTC."""
    check_arch(arch)
    start = time.perf_counter()
    kernels = lowered.kernels.kernels
    coded = sorted(d for d, k in kernels.items() if k.library is None)
    modules = dict(zip(coded, compile_sources([kernels[d].source for d in coded], arch, use_cache)))
    modules |= {d: CompiledModule(b"", arch) for d, k in kernels.items() if k.library is not None}  # no code of ours
    seconds = dict(lowered.seconds)
    seconds["nvrtc"] = time.perf_counter() - start
    return CudaProgram(lowered, arch, modules, seconds)


__all__ = ["CudaRenderer", "CudaKernelSet", "CudaCall", "CudaProgram", "lower_cuda", "compile_cuda", "DEFAULT_ARCH"]

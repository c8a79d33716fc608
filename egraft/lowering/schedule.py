"""The native schedule: a run of a compiled program as one foreign call.

For each distinct binding of the symbolic dims the runtime builds a :class:`RunSchedule`
(once; the calls at that binding reuse it):

- every table slot as a *root* and a byte offset: the arena, an input, an output array,
  or an absolute address (a constant). Views (Reshape, Squeeze, contiguous Slices) are
  folded into their root's offset, so they cost nothing at run time;
- the steps grouped into *segments*: maximal runs of kernels that need nothing from
  Python, run by ``egraft_run_steps`` in one native call (each kernel's address and the
  parts it is split into), and the steps Python runs between them: reference kernels,
  control steps, kernels sized by their input values or with data-dependent outputs,
  and views of values that only a run places.

A call then fills its table with one vectorized add (root address + offset per slot) and
makes one native call per native segment: one in all for a fully compiled model.

Example (a model of kernels and views only)::

    schedule.segments == [NativeSegment(kernels=array([...]), parts=array([1, 2, ...]))]
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import numpy as np

from egraft.ir.graph import Graph, Value
from egraft.lowering.compile import Lowered, Step
from egraft.lowering.guards import check_broadcasts
from egraft.lowering.memory import MemoryPlan

#: Root codes of the table slots: an absolute address (or a slot a run fills), the arena;
#: then one per input and one per output array (``INPUTS + i``, ``INPUTS + inputs + j``).
ABSOLUTE, ARENA, INPUTS = 0, 1, 2


@dataclass(frozen=True)
class NativeSegment:
    """Kernels run one after the other by one native call: their addresses and parts, and
    the steps they stand for (the kernels and the views folded into the table)."""

    steps: tuple[Step, ...]
    kernels: np.ndarray  # int64 addresses
    parts: np.ndarray  # int64: 1 runs the kernel on the calling thread alone

    def __post_init__(self):
        object.__setattr__(self, "count", len(self.kernels))
        object.__setattr__(self, "kernels_address", self.kernels.ctypes.data)
        object.__setattr__(self, "parts_address", self.parts.ctypes.data)


@dataclass(frozen=True)
class RunSchedule:
    """How a call at one binding runs (see the module docstring).

    Attributes:
        offsets / roots: per table slot, the byte offset from its root and the root's code.
        outputs: the graph outputs a call allocates (name, shape, dtype), in root-code order.
        segments: :class:`NativeSegment` or the :class:`Step` Python runs, in order.
        locate: value name -> (root name, byte offset) for every value with a fixed place;
            the root name is ``""`` for the arena. Python reads values through it.
        graph_outputs: per graph output, ``("result", j)`` (the j-th output array) or
            ``("other", -1)`` (a constant, an input, or a value a Python step made).
        reads: per step Python runs (by step index), the values with a fixed place it
            reads or writes, as ``(name, dtype, shape)`` at this binding (``shape`` ``None``
            when only the run knows it): what the call makes arrays of before the step.
    """

    offsets: np.ndarray
    roots: np.ndarray
    outputs: list[tuple[str, tuple[int, ...], np.dtype]]
    segments: list
    locate: dict[str, tuple[str, int]]
    graph_outputs: list[tuple[str, int]]
    reads: dict[int, list[tuple[str, np.dtype, tuple[int, ...] | None]]]


def build_schedule(lowered: Lowered, graph: Graph, constants: Mapping[str, np.ndarray], plan: MemoryPlan,
                   bound: Mapping[str, int], shape_of: Callable[[Value], tuple[int, ...]],
                   addresses: Mapping[int, int], parts_of: Callable[[Step], int]) -> RunSchedule:
    """The :class:`RunSchedule` of ``lowered`` at the dims ``bound`` (with the arena layout
    ``plan``): ``addresses`` are the kernels' by step index, ``parts_of`` the parts each
    parallel kernel is split into at these dims. Raises the broadcast guards' error when
    the dims do not broadcast (so no schedule is kept for them)."""
    slots = lowered.slots
    size = len(slots)
    offsets = np.zeros(size, np.int64)
    roots = np.zeros(size, np.intp)
    locate: dict[str, tuple[str, int]] = {}
    n_inputs = len(graph.inputs)
    output_names = {v.name for v in graph.outputs}

    def put(name: str, code: int, root: str, offset: int) -> None:
        offsets[slots[name]] = offset
        roots[slots[name]] = code
        locate[name] = (root, offset)

    for i, v in enumerate(graph.inputs):
        put(v.name, INPUTS + i, v.name, 0)
    for name, array in constants.items():
        offsets[slots[name]] = array.ctypes.data
        roots[slots[name]] = ABSOLUTE
        locate[name] = (name, 0)
    outputs: list[tuple[str, tuple[int, ...], np.dtype]] = []
    segments: list = []
    run: list[Step] = []  # the native run being gathered

    def close() -> None:
        if run:
            kernels = [s for s in run if s.kind == "kernel"]
            segments.append(NativeSegment(tuple(run), np.array([addresses[s.index] for s in kernels], np.int64),
                                          np.array([parts_of(s) for s in kernels], np.int64)))
            run.clear()

    for step in lowered.steps:
        node = step.node
        if step.kind == "placed":  # a Concat its inputs' kernels wrote in place: nothing runs
            for v in node.outputs:
                put(v.name, ARENA, "", plan.offsets[v.name])
            run.append(step)
            continue
        if step.kind == "view":
            source, out = node.inputs[0], node.outputs[0]
            if source.name in locate:
                root, offset = locate[source.name]
                offset += step.offset * source.type.dtype.numpy.itemsize
                slot = slots[source.name]
                offsets[slots[out.name]] = offsets[slot] + (offset - locate[source.name][1])
                roots[slots[out.name]] = roots[slot]
                locate[out.name] = (root, offset)
                run.append(step)
                continue
            close()
            segments.append(step)  # a view of a value only the run places
            continue
        native = step.kind == "kernel" and not step.sized_by_inputs
        for v in node.outputs:
            if v is None:
                continue
            if v.name in plan.offsets:
                put(v.name, ARENA, "", plan.offsets[v.name])
            elif v.name in lowered.dynamic:
                native = False  # allocated when it runs
            elif step.kind == "kernel" and lowered.storage.get(v.name, v.name) != v.name:
                locate[v.name] = locate[lowered.storage[v.name]]  # in place: the same slot
            elif step.kind == "kernel" and v.name in output_names:
                code = INPUTS + n_inputs + len(outputs)
                outputs.append((v.name, shape_of(v), v.type.dtype.numpy))
                put(v.name, code, v.name, 0)
        if native and step.guards:
            if not _guards_bound(step, bound):
                native = False  # dims a run binds: Python checks them just before the kernel
            else:
                check_broadcasts(node.label, step.guards, bound)
        if native:
            run.append(step)
        else:
            close()
            segments.append(step)
    close()
    results = {name: j for j, (name, _, _) in enumerate(outputs)}
    graph_outputs = [("result", results[v.name]) if v.name in results else ("other", -1) for v in graph.outputs]
    reads: dict[int, list] = {}
    for step in segments:
        if isinstance(step, NativeSegment):
            continue
        found = []
        for v in (*step.node.inputs, *step.node.outputs):
            if v is not None and v.name in locate and all(v.name != f[0] for f in found):
                found.append((v.name, v.type.dtype.numpy, _shape_or_none(shape_of, v)))
        reads[step.index] = found
    return RunSchedule(offsets, roots, outputs, segments, locate, graph_outputs, reads)


def _shape_or_none(shape_of: Callable[[Value], tuple[int, ...]], v: Value) -> tuple[int, ...] | None:
    if v.type.shape is None:
        return None
    try:
        return shape_of(v)
    except (KeyError, TypeError, ValueError):  # a dim only the run binds
        return None


def _guards_bound(step: Step, bound: Mapping[str, int]) -> bool:
    import sympy

    for _, d, out in step.guards:
        for x in (d, out):
            if isinstance(x, sympy.Basic) and any(s.name not in bound for s in x.free_symbols):
                return False
    return True


def materialize(schedule: RunSchedule, name: str, roots: Mapping[str, np.ndarray], dtype: np.dtype,
                shape: Callable[[], tuple[int, ...]] | tuple[int, ...]) -> np.ndarray:
    """The array of value ``name`` at its fixed place: a view of its root (``roots``: the
    arena under ``""``, the inputs, output arrays and constants by name) of the ``shape()``
    it has at this run's dims (or a function that gives it)."""
    root, offset = schedule.locate[name]
    base = roots[root]
    if root == name:  # an input, a constant or an output array: the value's own array
        return base
    dims = shape if isinstance(shape, tuple) else shape()
    count = math.prod(dims)
    flat = base.reshape(-1).view(np.uint8)
    return flat[offset:offset + count * dtype.itemsize].view(dtype).reshape(dims)


__all__ = ["NativeSegment", "RunSchedule", "build_schedule", "materialize"]

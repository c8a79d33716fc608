"""Memory planning: which intermediate values share storage in one arena.

Each intermediate buffer lives from the step that writes it to the last step that reads
it (directly or through a view: a Reshape, Squeeze... output shares its input's storage
and keeps it alive). Two buffers whose lifetimes overlap never overlap in memory; the
others may. Offsets are chosen greedily by size (largest first, each at the lowest
64-byte-aligned offset that fits among the buffers it overlaps in time), the "greedy by
size" planner of TFLite's arena.

Sizes may hold symbolic dims: the lifetimes are fixed at compile time, the offsets are
computed once per distinct set of bound dims (and cached by the runtime).

Example:
    >>> assign_offsets([100, 100, 100], [(0, 1), (1, 2), (2, 3)])
    ([0, 128, 0], 256)
"""

from __future__ import annotations

from dataclasses import dataclass

import sympy

from egraft.ir.dims import dim_function

ALIGNMENT = 64


@dataclass(frozen=True)
class BufferSpec:
    """One arena buffer: the value that owns the storage, its size in bytes (an int or a
    sympy expression of the symbolic dims) and its lifetime in steps (inclusive)."""

    value: str
    nbytes: object
    first: int
    last: int


def _align(n: int) -> int:
    return (n + ALIGNMENT - 1) // ALIGNMENT * ALIGNMENT


def assign_offsets(sizes: list[int], lifetimes: list[tuple[int, int]]) -> tuple[list[int], int]:
    """Offsets for buffers of ``sizes`` bytes alive over ``lifetimes`` (first, last step,
    inclusive) and the arena size they need."""
    order = sorted(range(len(sizes)), key=lambda k: (-sizes[k], lifetimes[k][0], k))
    offsets = [0] * len(sizes)
    placed: list[int] = []
    peak = 0
    for k in order:
        first, last = lifetimes[k]
        busy = sorted((offsets[j], offsets[j] + _align(sizes[j])) for j in placed
                      if lifetimes[j][0] <= last and first <= lifetimes[j][1])
        offset = 0
        for begin, end in busy:
            if offset + sizes[k] <= begin:
                break
            offset = max(offset, end)
        offsets[k] = offset
        placed.append(k)
        peak = max(peak, offset + _align(sizes[k]))
    return offsets, peak


@dataclass(frozen=True)
class MemoryPlan:
    """Offsets of every arena buffer for one set of bound dims.

    Attributes:
        offsets: value name -> byte offset in the arena.
        sizes: value name -> bytes.
        peak: the arena's size in bytes.
        no_reuse: the bytes every buffer would need with no sharing.
    """

    offsets: dict[str, int]
    sizes: dict[str, int]
    peak: int
    no_reuse: int


def plan_memory(buffers: list[BufferSpec], bindings: dict[str, int],
                parts: dict[str, tuple[str, int, int]] | None = None) -> MemoryPlan:
    """The arena layout of ``buffers`` with the symbolic dims bound to ``bindings``; each of
    ``parts`` (value -> (owner, byte offset, bytes): a Concat's inputs written in place) at
    its offset in its owner's buffer."""
    sizes = []
    for b in buffers:
        try:
            nbytes = b.nbytes if isinstance(b.nbytes, int) else sympy.sympify(b.nbytes)
            sizes.append(int(dim_function(nbytes)(bindings)))
        except KeyError:
            raise ValueError(f"the size of %{b.value} ({b.nbytes} bytes) depends on an unbound dim") from None
    offsets, peak = assign_offsets(sizes, [(b.first, b.last) for b in buffers])
    placed = {b.value: o for b, o in zip(buffers, offsets)}
    nbytes = {b.value: s for b, s in zip(buffers, sizes)}
    for name, (owner, offset, size) in (parts or {}).items():
        placed[name], nbytes[name] = placed[owner] + offset, size
    return MemoryPlan(placed, nbytes, peak, sum(_align(s) for s in sizes))

"""Kernels emitted once per distinct node: a step whose node looks, to its generator, like one
already emitted reuses that emission instead of running the generator again.

ResNet-50's 16 bottleneck blocks repeat a dozen convolutions; a T5 encoder's layers repeat
the same integer products. Emitting each (an LLVM IR module built instruction by instruction
in Python, then printed) was most of the lower stage. Kernels were already *shared* by their
text (:mod:`egraft.lowering.kernels`); this skips *building* the text again.

What a generator sees of a node, and so what the key holds: the op, domain, opset and
attributes; each operand's dtype and shape and whether it is a constant; which operands
share a table slot (in place). A generator that reads a constant's values (``ctx.constant``:
axes, zero points, a Resize's scales) makes the emission depend on them: the record keeps
their side-table keys (content digests), and a later node matches only with the same values. Weights a generator
packs (``ctx.packed_constant``) are packed again from the new node's own weights; other
derived constants (offset tables) depend on the key alone.

Example:
    >>> memo = KernelMemo()                                 # doctest: +SKIP
    >>> key = memo.key(node, opset, slots)                  # doctest: +SKIP
    >>> emission = memo.find(key, node)                     # doctest: +SKIP
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from egraft.ir.graph import Graph, Node, content_hash


@dataclass(frozen=True)
class Emission:
    """One generator run, its operands by *role*: ``("in", i)``, ``("out", j)`` or ``("derived", tag)``.

    Attributes:
        derived: the derived constants in the order the generator made them, each
            ``(tag, ("packed", PackedFrom, input index))`` (packed again from the new node's
            input) or ``(tag, ("array", array))`` (the same array: it depends on the key alone).
        values_read: ``(input index, side-table key)`` of the constants whose values it read
            (the key is the array's content digest: equal keys, equal values).
    """

    text: str
    operands: tuple[tuple[str, Any], ...]
    table_roles: tuple[tuple[str, Any], ...]
    dim_operands: tuple[str, ...]
    parallel: bool
    guards: tuple
    derived: tuple[tuple[str, tuple], ...]
    values_read: tuple[tuple[int, str], ...]


def _attr_key(value) -> Any:
    """A hashable, exact form of an attribute; ``None`` when there is none (no reuse)."""
    if isinstance(value, np.ndarray):
        return ("array", content_hash(value))
    if isinstance(value, list | tuple):
        parts = tuple(_attr_key(v) for v in value)
        return None if any(p is None for p in parts) else parts
    if isinstance(value, int | float | str | bytes | bool) or value is None:
        return (type(value).__name__, value)
    text = repr(value)
    return None if " at 0x" in text else (type(value).__name__, text)


class KernelMemo:
    """The emissions of one :func:`egraft.lowering.compile.lower` run, by node key."""

    def __init__(self) -> None:
        self._records: dict[tuple, list[Emission]] = {}
        self.hits = 0

    def key(self, node: Node, opset: int, slots: dict[str, int]) -> tuple | None:
        """What the generator sees of ``node``; ``None`` for a node never reused."""
        attrs = []
        for name in sorted(node.attrs):
            part = _attr_key(node.attrs[name])
            if part is None:
                return None
            attrs.append((name, part))
        operands, first_slot = [], {}
        for role, values in (("in", node.inputs), ("out", node.outputs)):
            for v in values:
                if v is None:
                    operands.append(None)
                    continue
                shape = None if v.type.shape is None else tuple(str(d) for d in v.type.shape)
                slot = slots.get(v.name)
                alias = first_slot.setdefault(slot, len(first_slot)) if slot is not None else None
                operands.append((role, v.type.dtype.short, shape, v.const is not None, alias))
        return (node.op, node.domain, opset, tuple(attrs), tuple(operands))

    def find(self, key: tuple | None, node: Node) -> Emission | None:
        """A recorded emission for ``key`` whose constants read by value match ``node``'s."""
        if key is None:
            return None
        for emission in self._records.get(key, ()):
            if all(node.inputs[i].const == digest for i, digest in emission.values_read):
                self.hits += 1
                return emission
        return None

    def record(self, key: tuple | None, ctx, text: str) -> Emission:
        """The emission ``ctx`` just finished (its module printed as ``text``), kept for
        later nodes of the same ``key`` (none when ``key`` is ``None``)."""
        node = ctx.node
        roles: dict[str, Any] = {}
        for j, v in reversed(list(enumerate(node.outputs))):
            if v is not None:
                roles[v.name] = ("out", j)
        for i, v in reversed(list(enumerate(node.inputs))):
            if v is not None:
                roles[v.name] = ("in", i)
        prefix = f"{ctx.name}."
        derived = []
        for name, array in ctx.derived_made:
            tag = name[len(prefix):]
            roles[name] = ("derived", tag)
            made = ctx.packed_from.get(name)
            if made is None:
                derived.append((tag, ("array", array)))
            else:
                index = next(i for i, v in enumerate(node.inputs) if v is not None and v.const == made.source)
                derived.append((tag, ("packed", made, index)))
        read = [(i, node.inputs[i].const) for i in sorted(ctx.values_read)]  # the side table's key: its digest
        emission = Emission(text, tuple(roles[n] for n in ctx.operands),
                            tuple(sorted(roles[n] for n in ctx.table_names)), tuple(ctx.dim_operands),
                            ctx.parallel, tuple(ctx.broadcast_guards), tuple(derived), tuple(read))
        if key is not None:
            self._records.setdefault(key, []).append(emission)
        return emission


def replay(emission: Emission, node: Node, graph: Graph, name: str) -> tuple[dict, dict, dict]:
    """``emission`` for ``node`` (step name ``name``).

    Returns ``(names, derived, packed_from)``: the value or derived-constant name of each
    role, the derived constants by name (packed again from the node's own weights) in the
    order the generator made them, and how each packed one was made.
    """
    from egraft.kernels.cpu.emit import PackedFrom

    names: dict[tuple, str] = {}
    for role, values in (("out", node.outputs), ("in", node.inputs)):
        for k, v in enumerate(values):
            if v is not None:
                names[(role, k)] = v.name
    derived: dict[str, Any] = {}
    packed_from: dict[str, PackedFrom] = {}
    for tag, how in emission.derived:
        full = f"{name}.{tag}"
        names[("derived", tag)] = full
        if how[0] == "packed":
            _, record, index = how
            made = PackedFrom(record.packing, node.inputs[index].const, record.params)
            derived[full] = made.apply(graph.constants[made.source])
            packed_from[full] = made
        else:
            derived[full] = how[1]
    return names, derived, packed_from

"""Symbol unification: anonymous dims that meet a dim in a broadcast are taken to be that dim.

Shape inference gives a broadcast of two symbolic dims the type ``Max(a, b)``: at run
time ``a`` and ``b`` are equal, or one of them is 1. When one of the two is *anonymous*
(a dim no one named: the importer's fresh ``_d0`` for a data-dependent or unnamed dim,
an exporter's placeholder ``unk__12``), the model almost always means "the same dim":
``attention_mask``'s ``unk__12`` is ``input_ids``'s ``seq``; the ``_d1`` of a ``Range``
over ``Shape(x)[1]`` is ``x``'s ``seq``. Saying so collapses the ``Max(...)`` dims (and the
reshapes computed from them) before they reach code generation, as TVM's and onnxruntime's
symbolic shape inference do. Each assumption is checked when the model runs:

- a dim that the graph's inputs do not bind (data-dependent: ``_d0``) is replaced by
  :func:`unify_dims` through the whole graph when it is imported; the node that makes it
  (a ``Range``, an ``Expand``) has its output shape computed from its inputs' values and
  checked at run time (``egraft.lowering.compile``: ``sized_by_inputs``), or runs on its
  reference kernel, whose output shape is checked too;
- a graph input's own anonymous dim (``unk__12``) becomes a shape assumption
  (:func:`input_assumptions`: ``"unk__12 == seq"``) that ``egraft.compile`` compiles with
  (:mod:`egraft.ir.assume`): every type after the inputs writes ``seq`` for it, and a call
  whose ``unk__12`` is not its ``seq`` is refused naming the assumption.

Two *named* dims (``a`` and ``b``, both the user's) are never unified: either may be 1
at run time, so their broadcast stays ``Max(a, b)`` and the kernels choose the strides
at run time (``egraft.kernels.cpu.elementwise.broadcast_strides``, checked by
``egraft.lowering.guards``). Nor are two named dims unified through an anonymous one that
meets both.

Example:
    ``Add(x: f32[seq, 4], r: f32[_d0, 4])`` with ``r`` a ``Range``'s output is typed
    ``f32[Max(_d0, seq), 4]``; after ``unify_dims`` every ``_d0`` is ``seq`` and the sum is
    ``f32[seq, 4]``. With ``y: f32[unk__12, 4]`` as an input instead,
    ``input_assumptions(graph) == ["unk__12 == seq"]``.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import replace

import numpy as np
import sympy

from egraft.ir.dims import Dim, dim_symbols, simplify_dim
from egraft.ir.graph import Graph, Node, Value
from egraft.ir.types import TensorType

#: Names of dims no one chose: the importer's fresh dims, tf2onnx's unknown-dim placeholders.
ANONYMOUS = re.compile(r"_d\d+|unk__\d+")


#: Ops whose data-dependent output dims the runtime computes from their input values and
#: checks against the type before their kernel runs (``egraft.lowering.compile``'s
#: ``SIZED_BY_INPUT_VALUES``), or whose reference kernel's output is checked: a dim they make
#: may be unified, since a run that breaks the assumption is refused there.
CHECKED_PRODUCERS = frozenset({"Range", "Expand", "ConstantOfShape", "Slice"})


def is_anonymous(symbol: sympy.Symbol) -> bool:
    """True for a dim that no one named (``_d3``, ``unk__12``), False for ``batch``."""
    return ANONYMOUS.fullmatch(symbol.name) is not None


def broadcast_meetings(graph: Graph) -> list[tuple[sympy.Symbol, ...]]:
    """The groups of bare symbols that meet in a broadcast: the arguments of every
    ``Max(s1, s2, ...)`` of symbols in a node's output type, in graph order."""
    out: list[tuple[sympy.Symbol, ...]] = []
    seen: set = set()
    for node in graph.nodes:
        for v in node.outputs:
            if v is None or v.type.shape is None:
                continue
            for d in v.type.shape:
                if isinstance(d, int):
                    continue
                for m in d.atoms(sympy.Max):
                    if m not in seen and all(isinstance(a, sympy.Symbol) for a in m.args):
                        seen.add(m)
                        out.append(tuple(sorted(m.args, key=lambda s: s.name)))
    return out


class _Classes:
    """Union-find over symbols; a class holds at most one named (not anonymous) symbol, and
    its representative is, in this order of preference, named, a graph input's, first by name."""

    def __init__(self, input_symbols: set[str]) -> None:
        self.parent: dict[sympy.Symbol, sympy.Symbol] = {}
        self.input_symbols = input_symbols

    def find(self, s: sympy.Symbol) -> sympy.Symbol:
        while self.parent.get(s, s) != s:
            s = self.parent[s]
        return s

    def rank(self, s: sympy.Symbol) -> tuple:
        return is_anonymous(s), s.name not in self.input_symbols, s.name

    def union(self, a: sympy.Symbol, b: sympy.Symbol) -> None:
        ra, rb = self.find(a), self.find(b)
        if ra == rb or (not is_anonymous(ra) and not is_anonymous(rb)):
            return  # two named dims: each may be 1 at run time
        if self.rank(rb) < self.rank(ra):
            ra, rb = rb, ra
        self.parent[rb] = ra

    def substitution(self) -> dict[sympy.Symbol, sympy.Symbol]:
        return {s: self.find(s) for s in self.parent if self.find(s) != s}


def producers(graph: Graph) -> dict[str, Node]:
    """Symbol name -> the first node whose outputs have it and whose inputs do not (the node
    that makes a data-dependent dim)."""
    out: dict[str, Node] = {}
    for node in graph.nodes:
        seen = {s for v in node.inputs if v is not None and v.type.shape is not None for s in dim_symbols(v.type.shape)}
        for v in node.outputs:
            if v is not None and v.type.shape is not None:
                for s in dim_symbols(v.type.shape) - seen:
                    out.setdefault(s, node)
    return out


def _unifications(graph: Graph) -> tuple[dict[sympy.Symbol, sympy.Symbol], set[str]]:
    """Every unification (anonymous symbol -> representative) and the graph inputs' symbols.

    A symbol that neither an input has nor a node of :data:`CHECKED_PRODUCERS` makes (a
    ``Reshape`` to a computed shape, a dim of a control-flow body) is left alone: nothing
    would check the assumption when the model runs."""
    input_symbols = {s for v in graph.inputs if v.type.shape is not None for s in dim_symbols(v.type.shape)}
    made_by = producers(graph)

    def checked(s: sympy.Symbol) -> bool:
        node = made_by.get(s.name)
        return s.name in input_symbols or not is_anonymous(s) or (
            node is not None and node.op in CHECKED_PRODUCERS and node.domain in ("", "ai.onnx"))

    classes = _Classes(input_symbols)
    for group in broadcast_meetings(graph):
        group = tuple(s for s in group if checked(s))
        for other in group[1:]:
            if is_anonymous(group[0]) or is_anonymous(other):
                classes.union(group[0], other)
    return classes.substitution(), input_symbols


def unify_dims(graph: Graph) -> tuple[Graph, dict[sympy.Symbol, sympy.Symbol]]:
    """``graph`` with each anonymous symbol that the graph's inputs do not bind (a
    data-dependent ``_d0``) and that meets another in a broadcast replaced by it (see the
    module's doc), and the substitution made. The graph is returned unchanged (the same
    object) when nothing unifies. An input's own dim (``unk__12`` of an input) is left to
    :func:`input_assumptions`: the caller binds it, so the runtime can check it."""
    everything, input_symbols = _unifications(graph)
    substitution = {s: r for s, r in everything.items() if s.name not in input_symbols}
    if not substitution:
        return graph, {}
    return substitute_dims(graph, substitution), substitution


def input_assumptions(graph: Graph) -> list[str]:
    """The unifications of the graph inputs' anonymous dims, as shape assumptions
    (:mod:`egraft.ir.assume`) for ``egraft.compile``: ``["unk__12 == seq"]``. Compiled with
    them, every type after the inputs writes ``seq`` for ``unk__12``, and a call whose
    ``unk__12`` differs from its ``seq`` is refused naming the assumption."""
    everything, input_symbols = _unifications(graph)
    return [f"{s.name} == {r.name}" for s, r in sorted(everything.items(), key=lambda kv: kv[0].name)
            if s.name in input_symbols]


def substitute_dims(graph: Graph, substitution: Mapping[sympy.Symbol, Dim]) -> Graph:
    """``graph`` with every symbol of ``substitution`` replaced, in every value's type
    (inputs, outputs, nested bodies) and in the known values of shape arithmetic."""

    def dim(d: Dim) -> Dim:
        return d if isinstance(d, int) else simplify_dim(d.xreplace(substitution))

    def value(v: Value | None) -> Value | None:
        if v is None or v.type.shape is None:
            return v
        shape = tuple(dim(d) for d in v.type.shape)
        return v if shape == v.type.shape else v.replace(type=TensorType(v.type.dtype, shape))

    def attr(a):
        return substitute_dims(a, substitution) if isinstance(a, Graph) else a

    def node(n: Node) -> Node:
        attrs = {k: attr(a) for k, a in n.attrs.items()} if any(isinstance(a, Graph) for a in n.attrs.values()) \
            else n.attrs
        return n.replace(inputs=tuple(value(v) for v in n.inputs), outputs=tuple(value(v) for v in n.outputs),
                         attrs=attrs)

    known = {name: _substitute_array(array, dim) for name, array in graph.known_values.items()}
    return replace(graph, inputs=[value(v) for v in graph.inputs], outputs=[value(v) for v in graph.outputs],
                   nodes=[node(n) for n in graph.nodes], known_values=known)


def _substitute_array(array: np.ndarray, dim) -> np.ndarray:
    """A known value with ``dim`` applied to its symbolic entries (ints when all become ints)."""
    if array.dtype != object:
        return array
    flat = [dim(x) if isinstance(x, sympy.Basic) else x for x in array.ravel()]
    if all(isinstance(x, int | np.integer) for x in flat):
        return np.array(flat, dtype=np.int64).reshape(array.shape)
    out = np.empty(len(flat), dtype=object)
    out[:] = flat
    return out.reshape(array.shape)

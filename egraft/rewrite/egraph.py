"""The e-graph: an IR graph loaded into egglog, and snapshots of it for matching.

Encoding (see ../shared/EGGLOG_NOTES.md for why): one egglog sort ``T`` for tensor
e-classes with two constructors, ``Op(name, attrs, args)`` for every op (args a cons list)
and a handle ``Ref(i)``. Every e-class holds at least one handle; new terms name existing
e-classes through their handles, and each IR node is loaded as ``union(Ref(i), Op(...))``.
Op names and attribute keys go in as interned integers: egglog only compares them, and the
text of every term stays in the Python term log (``EGraphState.term_log``).

Weights stay out: a constant is ``Op("Const", <content hash>, [])`` and its array lives
in the side table. A graph input is ``Op("Input", <name>, [])``. A node with several
outputs is a tuple e-class ``Op(op, attrs, args)`` whose outputs are ``Op("Out", "<i>", [tuple])``.

Every handle has a known type (a TensorType, or a tuple of them for a tuple e-class),
set from the IR up front or inferred by the op registry for the terms rules create.

Commands reach egglog as rows, not as program text: three request relations (a list cell,
a term, a union) are filled from tab-separated files by egglog's ``input`` command, and one
ruleset declared up front turns each new row into its union (``load``, run once per batch).
Every earlier way compiled a rule per batch: each top-level command is a rule of its own
(0.4-1.5 ms), and a rule of 16 actions took 1.2 ms to declare, so commands cost
80-160 us each (2.1 s of DenseNet-121's saturation under the profiler); as rows they
cost about 9 us.

Snapshots do not read egglog back: the state's :class:`~egraft.rewrite.snapshot.EGraphIndex`
takes in the commands each :meth:`~EGraphState.flush` commits and computes the same congruence
closure (``egraft/rewrite/snapshot.py``). egglog gets the commands, in the same order, when it is
looked at (:attr:`EGraphState.egraph`); :meth:`EGraphState.egglog_classes` reads its partition
for the tests that check the two agree.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import weakref
from dataclasses import dataclass
from json.encoder import encode_basestring_ascii as _quote
from typing import Any

import numpy as np
from egglog import EGraph as EgglogGraph

from egraft.ir.graph import Graph, Node, Value, content_hash
from egraft.ir.types import TensorType
from egraft.rewrite.snapshot import ABSENT, CONST, INPUT, LEAF_OPS, OUT, EGraphIndex, ENode, Snapshot

#: egglog's name for the handle constructor (its rows are what a snapshot reads).
_REF = "egraft_Ref"
#: The schema: sorts, constructors, request relations and the ruleset that applies them.
#: ``Cell(c)`` names list cell ``c`` (0 is the empty list) so that a request can name a list.
_SCHEMA = """
(sort egraft_T)
(sort egraft_TList)
(constructor egraft_Ref (i64) egraft_T)
(constructor egraft_Op (i64 i64 egraft_TList) egraft_T)
(constructor egraft_Nil () egraft_TList)
(constructor egraft_Cons (egraft_TList egraft_T) egraft_TList)
(constructor egraft_Cell (i64) egraft_TList)
(relation egraft_NewCell (i64 i64 i64))
(relation egraft_NewTerm (i64 i64 i64 i64))
(relation egraft_NewUnion (i64 i64))
(ruleset egraft_load)
(rule ((egraft_NewCell c tail head))
      ((union (egraft_Cell c) (egraft_Cons (egraft_Cell tail) (egraft_Ref head)))) :ruleset egraft_load)
(rule ((egraft_NewTerm r name key cell))
      ((union (egraft_Ref r) (egraft_Op name key (egraft_Cell cell)))) :ruleset egraft_load)
(rule ((egraft_NewUnion a b)) ((union (egraft_Ref a) (egraft_Ref b))) :ruleset egraft_load)
(union (egraft_Cell 0) (egraft_Nil))
"""
#: The request relations, by the tag of their rows: ``c`` (cell, tail, head), ``t`` (ref, name id,
#: key id, cell), ``u`` (a, b). Queued commands are ``("t", ref)`` (a term, its rows made when
#: egglog is sent them) and ``("u", a, b)``.
_RELATIONS = {"c": "egraft_NewCell", "t": "egraft_NewTerm", "u": "egraft_NewUnion"}
#: Queued commands sent per ``input``-and-run (egglog's memory grows with the rows of one batch).
CHUNK = 4096


def _string(text: str) -> str:
    """An egglog string literal."""
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"') + '"'


def attrs_key(attrs: dict[str, Any]) -> str:
    """A deterministic text key for an attribute dict (arrays by content hash): its JSON with
    sorted keys. Strings, ints and bools are written here as ``json.dumps`` writes them (a
    third of its cost, which builds an encoder per call)."""
    parts = []
    for k in sorted(attrs):
        v = attrs[k]
        kind = type(v)
        if kind is str:
            parts.append(f"{_quote(k)}: {_quote(v)}")
        elif kind is int:
            parts.append(f"{_quote(k)}: {int.__repr__(v)}")
        elif kind is bool:
            parts.append(f"{_quote(k)}: {'true' if v else 'false'}")
        elif (kind is list or kind is tuple) and all(type(x) is int for x in v):  # axes, perm, pads
            parts.append(f"{_quote(k)}: [{', '.join(map(int.__repr__, v))}]")
        else:
            return json.dumps({k: _encode_attr(v) for k, v in attrs.items()}, sort_keys=True)
    return "{" + ", ".join(parts) + "}"


def _encode_attr(v):
    """An attribute value as JSON data for :func:`attrs_key` (a module function, not a
    closure that calls itself: that would be a reference cycle per key)."""
    if isinstance(v, np.ndarray):
        return {"tensor": content_hash(v)}
    if isinstance(v, Graph):
        return {"graph": id(v)}
    if isinstance(v, list | tuple):
        return [_encode_attr(x) for x in v]
    if isinstance(v, float | np.floating):
        return {"f": repr(float(v))}
    return v


@dataclass(frozen=True)
class Application:
    """One rule application, for provenance: the rule, the saturation round, and the
    e-nodes it matched as ``(class handle, op name, attrs key, child handles)``."""

    rule: str
    iteration: int
    matched: tuple[tuple[int, str, str, tuple[int, ...]], ...]


#: ``term_log`` entries of the loaded graph carry this application number.
SOURCE = -1


class EGraphState:
    """An egglog e-graph plus the Python side tables that give every e-class its type.

    Example:
        >>> state = EGraphState.from_graph(egraft.load("m.onnx"))   # doctest: +SKIP
        >>> snap = state.snapshot()                                   # doctest: +SKIP
    """

    def __init__(self, graph: Graph):
        self._egraph: EgglogGraph | None = EgglogGraph()
        raw = self._egraph._egraph
        raw.run_program(*raw.parse_program(_SCHEMA))
        self.source = graph
        self.constants = graph.constants
        self.opsets = dict(graph.opsets)
        self.ref_types: list[TensorType | tuple | None] = []
        self.ref_node_attrs: dict[str, dict] = {}  # attrs key -> attrs dict
        self.known_values: dict[int, np.ndarray] = {}  # ref -> compile-time value
        self.ref_const: dict[int, str] = {}  # ref -> constant hash
        self.ref_origin: dict[int, tuple[str, ...]] = {}  # ref -> source node names it covers
        self.ref_source: dict[int, int] = {}  # ref -> index of the source node that computes it
        # Provenance: every term added, (ref, op name, attrs key, arg refs, application or SOURCE).
        self.term_log: list[tuple[int, str, str, tuple[int, ...], int]] = []
        self.applications: list[Application] = []
        self._application = SOURCE
        self.pending: list = []
        self._interned: dict[str, int] = {}  # op names and attribute keys -> the ids egglog sees
        self._cells = 0  # list cells made (cell 0 is the empty list)
        self._files: str | None = None  # a private folder for the request files
        self._backlog: list = []  # flushed commands not yet sent to egglog (:attr:`egraph`)
        self._index = EGraphIndex()  # the e-classes as of the last snapshot
        self._sent_refs: list[int] = []  # handles whose term was flushed since the last snapshot
        self._sent_unions: list[tuple[int, int]] = []  # unions flushed since the last snapshot
        self.output_refs: list[int] = []
        self.input_refs: dict[str, int] = {}
        self.absent_ref: int | None = None

    def release(self) -> None:
        """Free the egglog e-graph now, on this thread. egglog's e-graph may only be freed on
        the thread that made it, and the Python wrapper around it sits in reference cycles:
        left to the cycle collector it may be freed on whatever thread collects (a server's
        worker, a runtime thread), which egglog reports as an error. The state is unusable
        afterwards (its snapshot stays valid)."""
        inner = getattr(self._egraph, "_state", None)
        if inner is not None and hasattr(inner, "egraph"):
            inner.egraph = None  # the wrapper's only reference to the native e-graph (egglog pinned)
        self._egraph = None
        self._backlog = []
        if self._files is not None:
            shutil.rmtree(self._files, ignore_errors=True)

    # ---- building ------------------------------------------------------------------
    def new_ref(self, ttype) -> int:
        self.ref_types.append(ttype)
        return len(self.ref_types) - 1

    def _intern(self, text: str) -> int:
        i = self._interned.get(text)
        if i is None:
            i = self._interned[text] = len(self._interned)
        return i

    def _term_rows(self, ref: int, rows: dict[str, list[str]]) -> None:
        """The request rows of handle ``ref``'s term: a list cell per argument, the first the
        outermost, then the term naming its op, attribute key and first cell."""
        op, domain, key, args = self._index.term[ref]
        cell = 0
        for a in reversed(args):
            self._cells += 1
            rows["c"].append(f"{self._cells}\t{cell}\t{a}")
            cell = self._cells
        name = f"{domain}::{op}" if domain else op
        rows["t"].append(f"{ref}\t{self._intern(name)}\t{self._intern(key)}\t{cell}")

    def add_term(self, op: str, domain: str, attrs: dict, args: list[int], ttype, key: str | None = None) -> int:
        """Queue ``op(args) {attrs}`` with a new handle of type ``ttype``; return the handle.
        ``key``: :func:`attrs_key` of ``attrs``, when the caller has it."""
        if key is None:
            key = attrs_key(attrs)
        if key not in self.ref_node_attrs:
            self.ref_node_attrs[key] = dict(attrs)
        return self._queue_term(op, domain, key, tuple(args), ttype)

    def add_leaf(self, op: str, key: str, ttype) -> int:
        return self._queue_term(op, "", key, (), ttype)

    def _queue_term(self, op: str, domain: str, key: str, args: tuple[int, ...], ttype) -> int:
        """A new handle of type ``ttype`` for the term ``op(args) {key}``, queued (its rows for
        egglog are made when egglog is sent them) and logged."""
        ref = self.new_ref(ttype)
        self._index.term[ref] = (op, domain, key, args)
        self.pending.append(("t", ref))
        self.term_log.append((ref, f"{domain}::{op}" if domain else op, key, args, self._application))
        return ref

    # ---- provenance ------------------------------------------------------------------
    def begin_application(self, rule: str, iteration: int, matched) -> None:
        """Terms added until :meth:`end_application` were built by ``rule`` from the e-nodes
        ``matched`` (``(class, ENode)`` pairs of a snapshot: an e-class is named by its first
        handle)."""
        record = tuple((c, f"{n.domain}::{n.op}" if n.domain else n.op, n.attrs, n.children) for c, n in matched)
        self.applications.append(Application(rule, iteration, record))
        self._application = len(self.applications) - 1

    def end_application(self) -> None:
        self._application = SOURCE

    def cancel_application(self, log_mark: int) -> None:
        """Forget the terms of an application whose replacement could not be built."""
        del self.term_log[log_mark:]
        self.applications.pop()
        self._application = SOURCE

    def add_const(self, array: np.ndarray, key: str | None = None) -> int:
        """Queue a constant with a new handle; ``key``: its :func:`content_hash`, when known."""
        if key is None:
            key = content_hash(array)
        self.constants.setdefault(key, array)
        ref = self.add_leaf(CONST, key, TensorType.of(array))
        self.ref_const[ref] = key
        self.known_values[ref] = array
        return ref

    def union_refs(self, a: int, b: int) -> None:
        self.pending.append(("u", a, b))

    def flush(self) -> None:
        """Commit the queued commands: the next :meth:`snapshot` takes them in, and egglog does
        when it is next looked at (:attr:`egraph`)."""
        for command in self.pending:
            if command[0] == "t":
                self._sent_refs.append(command[1])
            else:
                self._sent_unions.append((command[1], command[2]))
        self._backlog += self.pending
        self.pending.clear()

    @property
    def egraph(self) -> EgglogGraph | None:
        """The egglog e-graph, sent every committed command first (as rows of its request
        relations, :data:`CHUNK` at a time; module docstring). Nothing in optimizing reads it
        (snapshots come from the index, which computes what egglog does): sending as the
        commands came cost 7-10% of a saturation."""
        if self._backlog and self._egraph is not None:
            raw = self._egraph._egraph
            if self._files is None:
                self._files = tempfile.mkdtemp(prefix="egraft-egraph-")
                weakref.finalize(self, shutil.rmtree, self._files, True)
            for start in range(0, len(self._backlog), CHUNK):
                rows: dict[str, list[str]] = {tag: [] for tag in _RELATIONS}
                for command in self._backlog[start:start + CHUNK]:
                    if command[0] == "u":
                        rows["u"].append(f"{command[1]}\t{command[2]}")
                    else:
                        self._term_rows(command[1], rows)
                program = []
                for tag, lines in rows.items():
                    if lines:
                        path = os.path.join(self._files, _RELATIONS[tag] + ".tsv")
                        with open(path, "w", encoding="utf-8") as f:
                            f.write("\n".join(lines) + "\n")
                        program.append(f"(input {_RELATIONS[tag]} {_string(path)})")
                program.append("(run egraft_load 1)")
                raw.run_program(*raw.parse_program("\n".join(program)))
            self._backlog = []
        return self._egraph

    @classmethod
    def from_graph(cls, graph: Graph) -> EGraphState:
        """Load an IR graph: one handle per IR value, one union per node."""
        state = cls(graph)
        refs: dict[str, int] = {}
        for v in graph.inputs:
            refs[v.name] = state.add_leaf(INPUT, v.name, v.type)
            state.input_refs[v.name] = refs[v.name]

        def ref_of(v: Value | None) -> int:
            if v is None:
                if state.absent_ref is None:
                    state.absent_ref = state.add_leaf(ABSENT, "", None)
                return state.absent_ref
            if v.name not in refs:
                if v.const is None:
                    raise KeyError(v.name)
                refs[v.name] = state.add_leaf(CONST, v.const, v.type)
                state.ref_const[refs[v.name]] = v.const
                state.known_values[refs[v.name]] = graph.constants[v.const]
            return refs[v.name]

        for index, node in enumerate(graph.nodes):
            args = [ref_of(v) for v in node.inputs]
            outputs = [v for v in node.outputs]
            if len(outputs) == 1 and outputs[0] is not None:
                ref = state.add_term(node.op, node.domain, dict(node.attrs), args, outputs[0].type)
                refs[outputs[0].name] = ref
                state.ref_origin[ref] = (node.name,)
                state.ref_source[ref] = index
            else:
                types = tuple(v.type if v is not None else None for v in outputs)
                tup = state.add_term(node.op, node.domain, dict(node.attrs), args, types)
                state.ref_origin[tup] = (node.name,)
                state.ref_source[tup] = index
                for i, v in enumerate(outputs):
                    if v is not None:
                        refs[v.name] = state.add_term(OUT, "", {"index": i}, [tup], v.type)
            for v in outputs:
                if v is not None and v.name in graph.known_values:
                    state.known_values[refs[v.name]] = graph.known_values[v.name]
        state.output_refs = [ref_of(v) for v in graph.outputs]
        state.flush()
        return state

    # ---- reading ---------------------------------------------------------------------
    def snapshot(self) -> Snapshot:
        """The e-graph as of the last flush, as plain Python data: the index's congruence closure
        of what egglog was sent, updated with what was sent since the last snapshot
        (``egraft/rewrite/snapshot.py``). egglog is not read back."""
        change = self._index.update(self._sent_refs, self._sent_unions, self._is_tuple)
        self._sent_refs, self._sent_unions = [], []
        return Snapshot(self, self._index, change)

    def _is_tuple(self, c: int) -> bool:
        return isinstance(self.ref_types[c], tuple)

    def egglog_classes(self) -> dict[int, int]:
        """Handle -> e-class (its smallest handle) as egglog's own handle table holds them (for
        checking the index against egglog; a snapshot does not read it)."""
        raw = self.egraph._egraph
        pairs = [(raw.value_to_i64(row.inputs[0]), row.output) for row in raw.freeze().functions[_REF].rows]
        smallest: dict = {}
        for ref, value in pairs:
            if ref >= 0 and ref < smallest.get(value, ref + 1):
                smallest[value] = ref
        return {ref: smallest[value] for ref, value in pairs if ref >= 0}


def value_name(ref: int) -> str:
    return f"r{ref}"


def ir_value(snapshot: Snapshot, c: int) -> Value:
    """An IR Value standing for e-class ``c`` (for inference over e-classes)."""
    ref = snapshot.class_ref[c]
    return Value(value_name(ref), snapshot.type_of(c), const=snapshot.const_class.get(c))


__all__ = ["ABSENT", "CONST", "INPUT", "LEAF_OPS", "OUT", "EGraphState", "ENode", "Node", "Snapshot"]

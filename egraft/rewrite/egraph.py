"""The e-graph: an IR graph loaded into egglog, and snapshots of it for matching.

Encoding (see ../shared/EGGLOG_NOTES.md for why): one egglog sort ``T`` for tensor
e-classes with two constructors, ``T.op(name, attrs_key, args)`` for every op (args a
cons list) and an unextractable handle ``T.ref(i)``. Every e-class holds at least one
handle; new terms name existing e-classes through their handles, and each IR node is
loaded as ``union(T.ref(i), T.op(...))`` in small batches.

Weights stay out: a constant is ``T.op("Const", <content hash>, [])`` and its array lives
in the side table. A graph input is ``T.op("Input", <name>, [])``. A node with several
outputs is a tuple e-class ``T.op(op, attrs, args)`` whose outputs are
``T.op("Out", "<i>", [tuple])``.

Every handle has a known type (a TensorType, or a tuple of them for a tuple e-class),
set from the IR up front or inferred by the op registry for the terms rules create.

Commands go to egglog as program text: building them through the Python expression API
cost 2.4 s for DenseNet-121's 1,746 nodes, the text 0.2 s. egglog runs each top-level
command as a rule of its own (~130 us each), so a batch of commands is sent as the actions
of one rule with no premises, in a ruleset of its own, run once: inception_v2's 13,127
commands took 1.7 s one by one, 0.85 s as rules of 16 actions. A rule's cost grows
quadratically with its actions (200 per rule took 6.5 s), hence the small batches.
"""

from __future__ import annotations

import json
import time
from collections import defaultdict
from dataclasses import dataclass
from typing import Any

import numpy as np
from egglog import EGraph as EgglogGraph
from egglog import Expr, StringLike, i64Like, union

from egraft.ir.graph import Graph, Node, Value
from egraft.ir.types import TensorType


class TList(Expr):
    """A cons list of tensor e-classes (an op's inputs)."""

    def __init__(self) -> None: ...

    def cons(self, head: T) -> TList: ...


class T(Expr):
    """A tensor e-class."""

    @classmethod
    def ref(cls, i: i64Like) -> T: ...

    @classmethod
    def op(cls, name: StringLike, attrs: StringLike, args: TList) -> T: ...


#: Placeholder inputs (omitted optional inputs) are this op with no args.
ABSENT = "Absent"
CONST = "Const"
INPUT = "Input"
OUT = "Out"
LEAF_OPS = (ABSENT, CONST, INPUT)
BATCH = 16
#: egglog's names for the constructors above (declared by :func:`_declare`).
_REF = "egraft_rewrite_egraph_T_ref"
_OP = "egraft_rewrite_egraph_T_op"
_CONS = "egraft_rewrite_egraph_TList_cons"
_NIL = "(egraft_rewrite_egraph_TList___init__)"
_DECLARE = "#declare"


def _string(text: str) -> str:
    """An egglog string literal."""
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"') + '"'


def attrs_key(attrs: dict[str, Any]) -> str:
    """A deterministic text key for an attribute dict (arrays by content hash)."""
    return json.dumps({k: _encode_attr(attrs[k]) for k in sorted(attrs)}, sort_keys=True)


def _encode_attr(v):
    """An attribute value as JSON data for :func:`attrs_key` (a module function, not a
    closure that calls itself: that would be a reference cycle per key)."""
    from egraft.ir.graph import content_hash

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


@dataclass(frozen=True)
class ENode:
    """One e-node of a snapshot: op name and domain, attribute key, child e-classes."""

    op: str
    domain: str
    attrs: str
    children: tuple[int, ...]


class EGraphState:
    """An egglog e-graph plus the Python side tables that give every e-class its type.

    Example:
        >>> state = EGraphState.from_graph(egraft.load("m.onnx"))   # doctest: +SKIP
        >>> snap = state.snapshot()                                   # doctest: +SKIP
    """

    def __init__(self, graph: Graph):
        self.egraph = EgglogGraph()
        # Declares the constructors, so that text commands can name them.
        self.egraph.register(union(T.ref(-1)).with_(T.op(_DECLARE, "", TList().cons(T.ref(-1)))))
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
        self._batches = 0  # rulesets made by flush()
        self.output_refs: list[int] = []
        self.input_refs: dict[str, int] = {}
        self.absent_ref: int | None = None

    def release(self) -> None:
        """Free the egglog e-graph now, on this thread. egglog's e-graph may only be freed on
        the thread that made it, and the Python wrapper around it sits in reference cycles:
        left to the cycle collector it may be freed on whatever thread collects (a server's
        worker, a runtime thread), which egglog reports as an error. The state is unusable
        afterwards (its snapshot stays valid)."""
        inner = getattr(self.egraph, "_state", None)
        if inner is not None and hasattr(inner, "egraph"):
            inner.egraph = None  # the wrapper's only reference to the native e-graph (egglog pinned)
        self.egraph = None

    # ---- building ------------------------------------------------------------------
    def new_ref(self, ttype) -> int:
        self.ref_types.append(ttype)
        return len(self.ref_types) - 1

    @staticmethod
    def _list(refs: list[int]) -> str:
        text = _NIL
        for r in reversed(refs):  # the first argument is the outermost cell
            text = f"({_CONS} {text} ({_REF} {r}))"
        return text

    def add_term(self, op: str, domain: str, attrs: dict, args: list[int], ttype) -> int:
        """Queue ``op(args) {attrs}`` with a new handle of type ``ttype``; return the handle."""
        key = attrs_key(attrs)
        self.ref_node_attrs.setdefault(key, dict(attrs))
        ref = self.new_ref(ttype)
        name = f"{domain}::{op}" if domain else op
        self.pending.append(f"(union ({_REF} {ref}) ({_OP} {_string(name)} {_string(key)} {self._list(args)}))")
        self.term_log.append((ref, name, key, tuple(args), self._application))
        return ref

    def add_leaf(self, op: str, key: str, ttype) -> int:
        ref = self.new_ref(ttype)
        self.pending.append(f"(union ({_REF} {ref}) ({_OP} {_string(op)} {_string(key)} {_NIL}))")
        self.term_log.append((ref, op, key, (), self._application))
        return ref

    # ---- provenance ------------------------------------------------------------------
    def begin_application(self, rule: str, iteration: int, snapshot: Snapshot, matched) -> None:
        """Terms added until :meth:`end_application` were built by ``rule`` from the e-nodes
        ``matched`` (``(class, ENode)`` pairs of ``snapshot``)."""
        cref = snapshot.class_ref
        record = tuple((cref[c], f"{n.domain}::{n.op}" if n.domain else n.op, n.attrs,
                        tuple(cref[ch] for ch in n.children)) for c, n in matched)
        self.applications.append(Application(rule, iteration, record))
        self._application = len(self.applications) - 1

    def end_application(self) -> None:
        self._application = SOURCE

    def cancel_application(self, log_mark: int) -> None:
        """Forget the terms of an application whose replacement could not be built."""
        del self.term_log[log_mark:]
        self.applications.pop()
        self._application = SOURCE

    def add_const(self, array: np.ndarray) -> int:
        from egraft.ir.graph import content_hash

        key = content_hash(array)
        self.constants.setdefault(key, array)
        ref = self.add_leaf(CONST, key, TensorType.of(array))
        self.ref_const[ref] = key
        self.known_values[ref] = array
        return ref

    def union_refs(self, a: int, b: int) -> None:
        self.pending.append(f"(union ({_REF} {a}) ({_REF} {b}))")

    def flush(self, deadline: float | None = None) -> bool:
        """Send the queued commands to egglog, each batch as one rule run once (module docstring).
        Past ``deadline`` (``time.perf_counter()``) the rest is dropped: True then. Each command
        is whole (a term names only handles made before it), so a cut leaves at worst the terms
        of one rewrite without their union: e-classes nothing reads."""
        raw = self.egraph._egraph
        for start in range(0, len(self.pending), BATCH):
            if deadline is not None and time.perf_counter() > deadline:
                self.pending.clear()
                return True
            name = f"flush{self._batches}"
            self._batches += 1
            actions = " ".join(self.pending[start:start + BATCH])
            raw.run_program(*raw.parse_program(f"(ruleset {name})\n(rule () ({actions}) :ruleset {name})\n"
                                               f"(run {name} 1)"))
        self.pending.clear()
        return False

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
        """The current e-graph as plain Python data (e-classes numbered 0..n-1).

        Read from egglog's frozen tables (``freeze()``: the rows of each constructor, in
        table order, e-classes as canonical ids) rather than its JSON serialization, which
        cost ten times as much (7.5 s of t5_encoder_int8's 31 s of saturation). The rows
        come in the order the serialization lists them, so the numbering is the same: an
        e-class is numbered when first met, handles first, then each ``T.op`` row's
        children before its own class."""
        raw = self.egraph._egraph
        functions = raw.freeze().functions
        class_ids: dict[Any, int] = {}  # egglog value of a T e-class -> its number

        def cid(value) -> int:
            c = class_ids.get(value)
            if c is None:
                c = class_ids[value] = len(class_ids)
            return c

        ref_class: dict[int, int] = {}
        for row in functions[_REF].rows:
            ref = raw.value_to_i64(row.inputs[0])
            if ref >= 0:
                ref_class[ref] = cid(row.output)
        lists = _ListReader(functions[_CONS].rows)
        texts: dict[Any, str] = {}  # egglog string value -> text: op names and attribute keys repeat

        def text(value) -> str:
            t = texts.get(value)
            if t is None:
                t = texts[value] = raw.value_to_string(value)
            return t

        classes: dict[int, list[ENode]] = defaultdict(list)
        for row in functions[_OP].rows:
            name_value, attrs_value, list_value = row.inputs
            name = text(name_value)
            if name == _DECLARE:
                continue
            key = text(attrs_value)
            children = tuple(cid(c) for c in lists.items(list_value))
            domain, _, op_name = name.rpartition("::")
            classes[cid(row.output)].append(ENode(op_name, domain, key, children))
        return Snapshot(self, dict(classes), ref_class)


class _ListReader:
    """The items of egglog ``TList`` values, from the rows of the ``cons`` constructor
    (one row per list: a cons cell is a function of its tail and head)."""

    def __init__(self, cons_rows):
        self.cells = {row.output: row.inputs for row in cons_rows}  # list -> (tail, head)
        self.memo: dict[Any, list] = {}

    def items(self, value) -> list:
        """The T e-class values of the list ``value``, first argument first."""
        out = self.memo.get(value)
        if out is None:
            out = self.memo[value] = []
            cell = self.cells.get(value)
            while cell is not None:
                tail, head = cell
                out.append(head)
                cell = self.cells.get(tail)
        return out


class Snapshot:
    """A frozen view of the e-graph: e-classes, their e-nodes, types and handles."""

    def __init__(self, state: EGraphState, classes: dict[int, list[ENode]], ref_class: dict[int, int]):
        self.state = state
        self.classes = classes
        self.ref_class = ref_class
        self.class_ref: dict[int, int] = {}
        for ref, c in sorted(ref_class.items()):
            self.class_ref.setdefault(c, ref)
        self.by_op: dict[str, list[tuple[int, ENode]]] = defaultdict(list)
        for c, enodes in classes.items():
            for n in enodes:
                self.by_op[n.op].append((c, n))
        self.const_class: dict[int, str] = {c: n.attrs for c, n in self.by_op.get(CONST, ())}
        #: The e-classes of omitted optional inputs (matching and costing ask for every input).
        self.absent: set[int] = {c for c, _ in self.by_op.get(ABSENT, ())}
        #: The e-classes of multi-output nodes (matching asks for every e-class it visits).
        self.tuples: set[int] = {c for c, ref in self.class_ref.items() if isinstance(state.ref_types[ref], tuple)}
        #: The e-classes holding an output projection ``Out`` (of a multi-output node).
        self.projected: set[int] = {c for c, _ in self.by_op.get(OUT, ())}
        self.known: dict[int, np.ndarray] = {}
        for ref, value in state.known_values.items():
            if ref in ref_class:
                self.known.setdefault(ref_class[ref], value)

    @property
    def num_nodes(self) -> int:
        return sum(len(v) for v in self.classes.values())

    def type_of(self, c: int):
        return self.state.ref_types[self.class_ref[c]]

    def signatures(self) -> dict[int, tuple]:
        """Each e-class's identity across snapshots, keyed by its first handle: how many handles
        it holds and its e-nodes with children named by their first handles. An e-class whose
        signature is in the previous snapshot's table is unchanged (no merge, no new e-node),
        which is what incremental matching asks (``egraft/rewrite/engine.py``)."""
        sizes: dict[int, int] = defaultdict(int)
        for c in self.ref_class.values():
            sizes[c] += 1
        ref = self.class_ref
        return {ref[c]: (sizes[c], frozenset((n.op, n.domain, n.attrs, tuple(ref[ch] for ch in n.children))
                                             for n in nodes))
                for c, nodes in self.classes.items()}

    def attrs(self, n: ENode) -> dict:
        return self.state.ref_node_attrs.get(n.attrs, {}) if n.op not in LEAF_OPS else {}

    def constant(self, c: int) -> np.ndarray | None:
        key = self.const_class.get(c)
        return None if key is None else self.state.constants[key]

    def is_tuple(self, c: int) -> bool:
        return c in self.tuples

    def is_absent(self, c: int) -> bool:
        """True when e-class ``c`` stands for an omitted optional input."""
        return c in self.absent


def value_name(ref: int) -> str:
    return f"r{ref}"


def ir_value(snapshot: Snapshot, c: int) -> Value:
    """An IR Value standing for e-class ``c`` (for inference over e-classes)."""
    ref = snapshot.class_ref[c]
    return Value(value_name(ref), snapshot.type_of(c), const=snapshot.const_class.get(c))


__all__ = ["EGraphState", "Snapshot", "ENode", "Node"]

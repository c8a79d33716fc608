"""Snapshots: the e-graph as plain Python data for matching and extraction, and the index that
keeps it up to date between saturation rounds without reading the e-graph back.

egglog receives every command: ``union(T.ref(i), T.op(name, attrs, [T.ref(a), ...]))`` for each
new handle, ``union(T.ref(a), T.ref(b))`` for each rewrite (``egraft/rewrite/egraph.py``). Its
partition of the handles is the congruence closure of those unions: two handles share an e-class
when a union says so, or when their terms have the same op and attributes and inputs in the same
e-classes. :class:`EGraphIndex` computes that same closure in Python from the commands each flush
sent, incrementally (egg's rebuild): a union moves the handles of the e-class with the larger name
into the other and re-canonicalizes the terms that read them; a term whose canonical form (its
inputs named by their e-classes) is already hash-consed merges into that e-class, which may merge
further e-classes in turn. Reading egglog's handle table back instead cost 25-80 ms a round at
6,900-10,000 e-nodes (the rows cross into Python one by one), most of DenseNet-121's rounds
after the twentieth; the index's work is proportional to what changed. A test checks after every
round that egglog's own tables hold the same e-nodes in the same e-classes.

An e-class is named by its smallest handle and keeps its name until it merges into one with a
smaller handle, so names are stable across rounds and independent of egglog's ids; an e-class's
e-nodes are its handles' canonical terms in the order of the handles, duplicates dropped
(congruence put equal terms in one e-class). Besides the e-classes the index keeps what matching
asks of every snapshot: each e-class's e-nodes by op, the e-classes holding each op, the users of
each e-class (the e-nodes that read it), constants, placeholders, tuples and projections. A
:class:`Snapshot` is a frozen copy: it copies the index's tables (shallow), and the index replaces
an inner container instead of changing it, so a snapshot stays valid after later rounds.

Example:
    >>> snap = state.snapshot()                       # doctest: +SKIP
    >>> snap.classes[snap.ref_class[state.output_refs[0]]]   # doctest: +SKIP
    [ENode(op='Relu', domain='', attrs='{}', children=(7,))]
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, NamedTuple

import numpy as np

if TYPE_CHECKING:
    from egraft.rewrite.egraph import EGraphState

#: Placeholder inputs (omitted optional inputs) are this op with no args.
ABSENT = "Absent"
CONST = "Const"
INPUT = "Input"
OUT = "Out"
LEAF_OPS = (ABSENT, CONST, INPUT)
#: The e-node ops that no constants compute.
_NOT_COMPUTED = (INPUT, ABSENT)


class ENode(NamedTuple):
    """One e-node of a snapshot: op name and domain, attribute key, child e-classes. (A named
    tuple: the index makes and hashes one per term it canonicalizes, three times faster than as
    a frozen dataclass.)"""

    op: str
    domain: str
    attrs: str
    children: tuple[int, ...]


@dataclass
class Change:
    """What one :meth:`EGraphIndex.update` changed.

    A variable bound to an e-class whose name is new needs no mark of its own: the e-node that
    reads it (a matched one) names it, so that e-node is new too (``added``). The marks below
    are for what a guard or a replacement reads of an e-class that keeps its name.

    Attributes:
        new_const: e-classes whose constant changed (that became constant, mostly).
        joined: e-classes that took in an e-class held before (the handles they hold: what
            ``original`` reads).
        new_ops: e-classes whose e-nodes' ops changed (what ``made_by`` reads).
        changed: the e-classes that took in handles or whose e-nodes differ.
        previous: for each e-class of ``changed`` held before under the same name, its e-nodes
            before.
        added: for each e-class of ``changed``, the e-nodes it did not hold before (all of a
            new name's): what semi-naive matching takes for new.
    """

    new_const: set[int] = field(default_factory=set)
    joined: set[int] = field(default_factory=set)
    new_ops: set[int] = field(default_factory=set)
    changed: set[int] = field(default_factory=set)
    previous: dict[int, list[ENode]] = field(default_factory=dict)
    added: dict[int, list[ENode]] = field(default_factory=dict)


class EGraphIndex:
    """The e-classes of one e-graph, kept by congruence closure over the commands sent to egglog.

    Example:
        >>> index = EGraphIndex()
        >>> index.term.update({0: ("Input", "", "x", ()), 1: ("Relu", "", "{}", (0,)), 2: ("Relu", "", "{}", (0,))})
        >>> sorted(index.update([0, 1, 2], [], lambda c: False).changed)   # the two Relu(x) are one e-class
        [0, 1]
        >>> index.classes[1]
        [ENode(op='Relu', domain='', attrs='{}', children=(0,))]
        >>> index.term[3] = ("Exp", "", "{}", (1,))
        >>> change = index.update([3], [(0, 2)], lambda c: False)   # x = Relu(x): one e-class, named 0
        >>> sorted(change.changed), sorted(change.joined), sorted(change.new_ops)   # 0 took in e-class 1; 3 is new
        ([0, 3], [0], [0])
        >>> index.classes[0]
        [ENode(op='Input', domain='', attrs='x', children=()), ENode(op='Relu', domain='', attrs='{}', children=(0,))]
    """

    def __init__(self) -> None:
        #: handle -> (op, domain, attrs key, input handles): every term made, sent to egglog or not
        self.term: dict[int, tuple[str, str, str, tuple[int, ...]]] = {}
        self.ref_class: dict[int, int] = {}  # handle -> e-class, for the handles egglog holds
        self.members: dict[int, list[int]] = {}  # e-class -> its handles
        self.classes: dict[int, list[ENode]] = {}  # e-class -> its e-nodes
        self.class_ops: dict[int, dict[str, tuple[ENode, ...]]] = {}  # e-class -> op -> its e-nodes of op
        #: e-class -> {(e-class of an e-node reading it, that e-node's op): how many such inputs}
        self.uses: dict[int, dict[tuple[int, str], int]] = {}
        self.op_classes: dict[str, set[int]] = {}  # op -> the e-classes with an e-node of op
        self.const_class: dict[int, str] = {}  # e-class -> the key of its constant
        self.absent: set[int] = set()  # e-classes of omitted optional inputs
        self.projected: set[int] = set()  # e-classes holding an output projection (Out)
        self.tuples: set[int] = set()  # e-classes of multi-output nodes
        #: e-classes that hold a constant or an e-node computed from constants only (folded or not)
        self.constant: set[int] = set()
        self.num_nodes = 0
        self._users: dict[int, list[int]] = defaultdict(list)  # handle -> the sent terms that read it
        self._canonical: dict[int, ENode] = {}  # handle -> its term with inputs named by e-classes
        self._memo: dict[ENode, int] = {}  # canonical term -> a handle that has it (hash-consing)
        self._copied: set = set()  # inner containers replaced during this update (copy on write)
        self._pending_uses: dict[int, dict[tuple[int, str], int]] = {}  # this update's changes to ``uses``

    def _canon(self, ref: int) -> ENode:
        op, domain, key, args = self.term[ref]
        ref_class = self.ref_class
        return ENode(op, domain, key, tuple([ref_class[a] for a in args]))

    def update(self, new_refs: list[int], unions: list[tuple[int, int]], is_tuple: Callable[[int], bool]) -> Change:
        """Take in the terms of ``new_refs`` and the ``unions`` that egglog was sent (in the order
        sent, though the closure does not depend on it); close under congruence; rebuild the
        e-classes that changed and say what changed (:class:`Change`). ``is_tuple(c)``: whether an
        e-class named ``c`` holds a multi-output node."""
        ref_class, members, canonical, memo = self.ref_class, self.members, self._canonical, self._memo
        users = self._users
        moved: list[int] = []
        pending: list[tuple[int, int]] = []
        for r in new_refs:
            ref_class[r] = r
            members[r] = [r]
            moved.append(r)
            for a in self.term[r][3]:
                users[a].append(r)
        for r in new_refs:
            node = canonical[r] = self._canon(r)
            other = memo.setdefault(node, r)
            if other != r:
                pending.append((other, r))
        pending.extend(unions)
        gone: list[int] = []
        joined: list[int] = []  # e-classes that took in an e-class held before this update
        while pending:
            a, b = pending.pop()
            ca, cb = ref_class[a], ref_class[b]
            if ca == cb:
                continue
            if cb < ca:
                ca, cb = cb, ca
            losers = members.pop(cb)  # e-class cb merges into ca, the smaller name
            members[ca].extend(losers)
            for m in losers:
                ref_class[m] = ca
            moved.extend(losers)
            gone.append(cb)
            if cb in self.classes:
                joined.append(ca)
            for m in losers:  # the terms that read a moved handle: their canonical form changed
                for u in users.get(m, ()):
                    old = canonical[u]
                    node = self._canon(u)
                    if node == old:
                        continue
                    if memo.get(old) == u:
                        del memo[old]
                    canonical[u] = node
                    other = memo.setdefault(node, u)
                    if other != u and ref_class[other] != ref_class[u]:
                        pending.append((other, u))  # congruence: equal terms, one e-class
        change = Change(joined={ref_class[c] for c in joined})
        affected: set[int] = set()
        for m in moved:
            change.changed.add(ref_class[m])
            for u in users.get(m, ()):
                affected.add(ref_class[u])
        affected |= change.changed
        self._copied = set()
        for c in gone:
            nodes = self.classes.pop(c, None)
            if nodes is not None:
                self._enter(c, None, nodes, ())
        for c in affected:
            ms = members[c]
            ms.sort()
            listed = list(dict.fromkeys([canonical[m] for m in ms]))
            old = self.classes.get(c)
            if old is None:
                added, removed = listed, ()
            else:
                if c not in change.changed and listed == old:
                    continue
                was, now = set(old), set(listed)
                added = [n for n in listed if n not in was]
                removed = [n for n in old if n not in now]
                change.previous[c] = old
                const, ops = self.const_class.get(c), self.class_ops[c].keys()
            change.changed.add(c)
            change.added[c] = added
            self.classes[c] = listed
            self._enter(c, listed, removed, added)
            if old is None:
                if is_tuple(c):  # a name keeps its type: only a new one is looked at
                    self.tuples.add(c)
            elif const != self.const_class.get(c):
                change.new_const.add(c)
            elif ops != self.class_ops[c].keys():
                change.new_ops.add(c)
        self._apply_uses()  # a gone e-class's users were all re-canonicalized: it leaves the table
        self._copied = set()
        self.constant.difference_update(gone)  # what they held, the e-classes they joined hold
        self._find_constants(change.added)
        return change

    def _find_constants(self, added: dict[int, list[ENode]]) -> None:
        """Add to :attr:`constant` the e-classes it now holds: those with an ``added`` e-node whose
        inputs are all in it, then their users in turn, every e-node of those looked at (it only
        grows: a least fixpoint over what changed, where passes over every e-class until nothing
        changed cost 4% of DenseNet-121's saturation)."""
        constant, classes, uses = self.constant, self.classes, self.uses
        work: list[tuple[int, list[ENode] | None]] = list(added.items())
        while work:
            c, nodes = work.pop()
            if c in constant:
                continue
            for n in classes.get(c, ()) if nodes is None else nodes:
                if n.op not in _NOT_COMPUTED and all(ch in constant for ch in n.children):
                    constant.add(c)
                    work.extend((parent, None) for parent, _ in uses.get(c, ()))
                    break

    def _own(self, table: dict, key, empty):
        """``table[key]``, replaced by a copy the first time this update changes it (a snapshot
        may hold the one it replaces)."""
        tag = (id(table), key)
        if tag not in self._copied:
            self._copied.add(tag)
            table[key] = type(empty)(table.get(key, empty))
        return table[key]

    def _count_uses(self, c: int, nodes: list[ENode], sign: int) -> None:
        """Count e-class ``c``'s e-nodes ``nodes`` in (``sign`` 1) or out (-1) of the users of
        their inputs, as changes that :meth:`_apply_uses` makes once per input."""
        pending = self._pending_uses
        for n in nodes:
            key = (c, n.op)
            for ch in n.children:
                counts = pending.get(ch)
                if counts is None:
                    counts = pending[ch] = {}
                counts[key] = counts.get(key, 0) + sign

    def _apply_uses(self) -> None:
        for ch, counts in self._pending_uses.items():
            uses = dict(self.uses.get(ch, ()))  # a copy: a snapshot may hold the one it replaces
            for key, k in counts.items():
                if k:
                    k += uses.get(key, 0)
                    if k:
                        uses[key] = k
                    else:
                        del uses[key]
            if uses:
                self.uses[ch] = uses
            else:
                self.uses.pop(ch, None)
        self._pending_uses = {}

    def _enter(self, c: int, nodes: list[ENode] | None, removed, added) -> None:
        """Bring e-class ``c``'s entries up to date: it now holds ``nodes`` (None: it is gone),
        having lost ``removed`` and gained ``added`` (only those change the users of inputs)."""
        self.num_nodes += len(added) - len(removed)
        self._count_uses(c, removed, -1)
        self._count_uses(c, added, 1)
        before = self.class_ops.pop(c, {})
        appended = nodes is not None and not removed and nodes[len(nodes) - len(added):] == added
        ops: dict[str, list[ENode]] = {}
        for n in added if appended else nodes or ():  # (e-nodes appended: the others stay as they were)
            found = ops.get(n.op)
            if found is None:
                ops[n.op] = [n]
            else:
                found.append(n)
        if appended:
            ops = {**before, **{op: before.get(op, ()) + tuple(found) for op, found in ops.items()}}
        if nodes is not None:
            self.class_ops[c] = {op: tuple(found) for op, found in ops.items()}
        for op in before.keys() - ops.keys():
            self._own(self.op_classes, op, set()).discard(c)
        for op in ops.keys() - before.keys():
            self._own(self.op_classes, op, set()).add(c)
        const = ops.get(CONST)
        if const is not None:
            self.const_class[c] = const[-1].attrs
        else:
            self.const_class.pop(c, None)
        if ABSENT in ops:
            self.absent.add(c)
        else:
            self.absent.discard(c)
        if OUT in ops:
            self.projected.add(c)
        else:
            self.projected.discard(c)
        if nodes is None:
            self.tuples.discard(c)


class _ByOp(Mapping):
    """``snapshot.by_op[op]``: the ``(e-class, e-node)`` pairs of an op, e-classes in name order,
    listed on first use (from the snapshot's tables, not the snapshot: no reference cycle)."""

    def __init__(self, op_classes: dict[str, set[int]], class_ops: dict[int, dict[str, tuple[ENode, ...]]]):
        self._op_classes = op_classes
        self._class_ops = class_ops
        self._listed: dict[str, list[tuple[int, ENode]]] = {}

    def __getitem__(self, op: str) -> list[tuple[int, ENode]]:
        listed = self._listed.get(op)
        if listed is None:
            if op not in self._op_classes:
                raise KeyError(op)
            listed = self._listed[op] = [(c, n) for c in sorted(self._op_classes[op]) for n in self._class_ops[c][op]]
        return listed

    def __iter__(self) -> Iterator[str]:
        return iter(self._op_classes)

    def __len__(self) -> int:
        return len(self._op_classes)


class Snapshot:
    """A frozen view of the e-graph: e-classes, their e-nodes, types and handles. An e-class is
    named by its smallest handle (``class_ref[c] == c``); ``changed`` names the e-classes that
    differ from the state's previous snapshot (all of them in the first)."""

    def __init__(self, state: EGraphState, index: EGraphIndex, change: Change):
        self.state = state
        self.classes: dict[int, list[ENode]] = dict(index.classes)
        self.ref_class: dict[int, int] = dict(index.ref_class)
        #: what changed since the state's previous snapshot (everything, in the first)
        self.change = change
        self.changed = change.changed
        self.class_ref: dict[int, int] = {c: c for c in self.classes}  # the first handle of each e-class
        #: e-class -> op -> its e-nodes of that op (matching looks a pattern's op up in each e-class)
        self.class_ops: dict[int, dict[str, tuple[ENode, ...]]] = dict(index.class_ops)
        #: op -> the e-classes with an e-node of that op (a root pattern's candidates)
        self.op_classes: dict[str, set[int]] = dict(index.op_classes)
        #: e-class -> {(e-class of an e-node that reads it, that e-node's op): count}
        self.uses: dict[int, dict[tuple[int, str], int]] = dict(index.uses)
        self.by_op: Mapping[str, list[tuple[int, ENode]]] = _ByOp(self.op_classes, self.class_ops)
        self.const_class: dict[int, str] = dict(index.const_class)
        #: The e-classes of omitted optional inputs (matching and costing ask for every input).
        self.absent: set[int] = set(index.absent)
        #: The e-classes of multi-output nodes (matching asks for every e-class it visits).
        self.tuples: set[int] = set(index.tuples)
        #: The e-classes holding an output projection ``Out`` (of a multi-output node).
        self.projected: set[int] = set(index.projected)
        #: The e-classes that hold a constant or an e-node computed from constants only (folded or
        #: not yet; ``feeds_const``).
        self.constant_classes: frozenset[int] = frozenset(index.constant)
        self.num_nodes: int = index.num_nodes
        self.known: dict[int, np.ndarray] = {}
        ref_class = self.ref_class
        for ref, value in state.known_values.items():
            if ref in ref_class:
                self.known.setdefault(ref_class[ref], value)

    def type_of(self, c: int):
        return self.state.ref_types[self.class_ref[c]]

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

    def parents(self, c: int) -> set[int]:
        """The e-classes with an e-node that takes e-class ``c`` as an input."""
        return {p for p, _ in self.uses.get(c, ())}

"""Snapshots: the e-graph as plain Python data for matching and extraction, kept up to date
between saturation rounds instead of re-read whole.

egglog holds the truth: which handles (``T.ref(i)``) share an e-class after its unions and
congruence closure. The e-nodes are ours: every handle was made by one command,
``union(T.ref(i), T.op(name, attrs, [T.ref(a), ...]))``, logged in ``EGraphState.term_log``.
So a snapshot reads only egglog's handle table (one row per handle) and names each e-class by
its smallest handle; an e-class's e-nodes are its handles' terms with the children named by
their e-classes, duplicates dropped (congruence put equal terms in one e-class).

:class:`ClassTracker` keeps the e-classes from one snapshot to the next and rebuilds only
those that changed: an e-class that took in handles (a merge, a new term) and the parents of a
handle whose e-class got a new name. Read whole from egglog's tables, snapshots were 28% of
DenseNet-121's saturation under the profiler; kept, one costs about 25 ms at 6,900 e-nodes,
most of it reading the handle table. An e-class keeps its name until it merges into one with a
smaller handle, so names are stable across rounds and independent of egglog's ids; an
e-class's e-nodes are listed in the order of their handles (deterministic).

Example:
    >>> snap = state.snapshot()                       # doctest: +SKIP
    >>> snap.classes[snap.ref_class[state.output_refs[0]]]   # doctest: +SKIP
    [ENode(op='Relu', domain='', attrs='{}', children=(7,))]
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from egraft.rewrite.egraph import EGraphState

#: Placeholder inputs (omitted optional inputs) are this op with no args.
ABSENT = "Absent"
CONST = "Const"
INPUT = "Input"
OUT = "Out"
LEAF_OPS = (ABSENT, CONST, INPUT)


@dataclass(frozen=True)
class ENode:
    """One e-node of a snapshot: op name and domain, attribute key, child e-classes."""

    op: str
    domain: str
    attrs: str
    children: tuple[int, ...]


class ClassTracker:
    """The e-classes of one e-graph as of its last snapshot, updated from egglog's handle table.

    Example:
        >>> tracker = ClassTracker()
        >>> tracker.add_terms([(0, "Input", "x", (), -1), (1, "Relu", "{}", (0,), -1)])
        >>> changed = tracker.update([(0, "a"), (1, "b")])
        >>> tracker.classes[1], sorted(changed)
        ([ENode(op='Relu', domain='', attrs='{}', children=(0,))], [0, 1])
        >>> sorted(tracker.update([(0, "a"), (1, "a")]))   # union(x, relu(x)): one e-class, named 0
        [0]
        >>> tracker.classes[0]
        [ENode(op='Input', domain='', attrs='x', children=()), ENode(op='Relu', domain='', attrs='{}', children=(0,))]
    """

    def __init__(self) -> None:
        self.terms_read = 0  # entries of the term log taken in
        self.term: dict[int, tuple[str, str, str, tuple[int, ...]]] = {}  # handle -> (op, domain, attrs, args)
        self.users: dict[int, list[int]] = defaultdict(list)  # handle -> handles of the terms naming it
        self.ref_class: dict[int, int] = {}  # handle -> e-class (its smallest handle)
        self.members: dict[int, list[int]] = {}  # e-class -> its handles
        self.classes: dict[int, list[ENode]] = {}  # e-class -> its e-nodes

    def add_terms(self, log) -> None:
        """Take in the term-log entries ``(handle, name, attrs, args, application)`` not seen yet
        (the log only grows past what was read: a cancelled application is always a new one)."""
        for ref, name, key, args, _ in log[self.terms_read:]:
            domain, _, op = name.rpartition("::")
            self.term[ref] = (op, domain, key, args)
            for a in args:
                self.users[a].append(ref)
        self.terms_read = len(log)

    def update(self, handle_rows) -> set[int]:
        """Read the partition ``(handle, egglog e-class)`` (every handle egglog holds) and rebuild
        the e-classes it changed; return the names of those that changed (merged, new, or with
        an e-node whose children were renamed)."""
        smallest: dict = {}
        pairs = []
        for ref, value in handle_rows:
            pairs.append((ref, value))
            m = smallest.get(value)
            if m is None or ref < m:
                smallest[value] = ref
        new = {ref: smallest[value] for ref, value in pairs}
        old = self.ref_class
        moved = [r for r, c in new.items() if old.get(r) != c]
        for r in moved:  # the e-classes that merged into one with a smaller handle are gone
            before = old.get(r)
            if before is not None:
                self.members.pop(before, None)
                self.classes.pop(before, None)
        changed: set[int] = set()
        affected: set[int] = set()
        for r in moved:
            c = new[r]
            self.members.setdefault(c, []).append(r)
            changed.add(c)
            affected.add(c)
            for user in self.users.get(r, ()):
                uc = new.get(user)
                if uc is not None:
                    affected.add(uc)
        for c in affected:
            members = self.members[c]
            members.sort()
            nodes: dict[ENode, None] = {}
            for r in members:
                op, domain, key, args = self.term[r]
                nodes[ENode(op, domain, key, tuple([new[a] for a in args]))] = None
            listed = list(nodes)
            if c not in changed and listed != self.classes.get(c):
                changed.add(c)
            self.classes[c] = listed
        self.ref_class = new
        return changed


class Snapshot:
    """A frozen view of the e-graph: e-classes, their e-nodes, types and handles. An e-class is
    named by its smallest handle (``class_ref[c] == c``); ``changed`` names the e-classes that
    differ from the state's previous snapshot (all of them in the first)."""

    def __init__(self, state: EGraphState, classes: dict[int, list[ENode]], ref_class: dict[int, int],
                 changed: set[int] | None = None):
        self.state = state
        self.classes = classes
        self.ref_class = ref_class
        self.changed = set(classes) if changed is None else changed
        self.class_ref: dict[int, int] = {c: c for c in classes}  # the first handle of each e-class
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

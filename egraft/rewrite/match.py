"""E-matching: find the substitutions under which a rule's patterns occur in a snapshot.

A substitution maps pattern variables to e-classes (tensor variables), to lists of
e-classes (``xs...``), to attribute values (``{epsilon = eps}``) or to attribute dicts
(``{attrs}``). Roots are matched in order; a later root must agree with the variables
earlier roots bound (multi-root rules join on shared variables).

A two-input node of a commutative op (``OpDef.commutative``: Add, Mul, Max...) matches
its pattern in both input orders, so ``Add(MatMul(a, w), bias)`` also finds
``Add(bias, MatMul(a, w))``, as PyTorch exports a linear layer. Where the rule set
already spells the other order (a rule whose pattern is this one with that node's inputs
swapped, or this very rule when its pattern is symmetric there), the node is matched in
its written order only (:func:`fixed_order_nodes`): the elementwise fusion rules, written
in both orders, would otherwise build each fused body twice over.

Semi-naive matching (the engine's rounds after a rule's first): given a :class:`Delta`, the
e-nodes new since the rule last matched completely and the e-classes whose properties its guard
reads changed, only the matches that use one or bind one are found. Roots come from
:meth:`Matcher.reach` (the e-classes with a new e-node of the root's op, or an e-node of the op
over an input's reach), and the search carries ``need`` down: where nothing matched so far is
new and no input left to match can be (it lies outside its pattern's reach), the part being
matched must be new, and an e-node that cannot be is passed over before its substitution is made.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from functools import cache
from typing import Any

from egraft.ir.registry import get_op
from egraft.rewrite.ast import EBinary, ECall, EIndex, EList, EUnary, EVar, PAbsent, POp, PVar, Rule
from egraft.rewrite.builtins import READS
from egraft.rewrite.egraph import ABSENT, OUT, ENode, Snapshot
from egraft.rewrite.snapshot import Change

Subst = dict[str, Any]


class EClassId(int):
    """An e-class bound to a pattern variable (an int that is known not to be an
    attribute value)."""


#: E-nodes that an interior variadic pattern node (``Elementwise(xs...)``) tries in one e-class,
#: those with the fewest inputs first. The elementwise fusion gives a class many equivalent
#: bodies (one per order of fusing), and ``Add(Elementwise(xs...), Elementwise(ys...))`` tried
#: every pair: minimol_v1 and t5_encoder_int8 took 5.4 and 4.4 s to saturate, now 2.1 and 1.5 s,
#: for the same plans (t5's 0.01% dearer; at 4 or 8 alternatives, minimol's was 2% dearer).
#: Leaving some matches out is sound: any subset of the rewrites is.
INTERIOR_ALTERNATIVES = 16


#: Names under which the matcher records each root's e-class (``$root0``...).
ROOT = "$root{}"
#: The key under which a substitution lists the e-nodes it matched, ``((class, ENode), ...)``
#: in pattern order (provenance: which e-nodes a rule rewrote).
MATCHED = "$matched"


@cache
def _attr_default(op: str, domain: str, name: str, opset: int):
    opdef = get_op(op, domain)
    if opdef is None:
        return None
    return opdef.attr_defaults(opset).get(name)


def _same(a, b) -> bool:
    if isinstance(a, list | tuple) and isinstance(b, list | tuple):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if isinstance(a, float) or isinstance(b, float):
        try:
            return abs(float(a) - float(b)) <= 1e-6 * max(1.0, abs(float(b)))
        except (TypeError, ValueError):
            return False
    return a == b


def _same_attrs(a: dict, b: dict, op: str, domain: str, opset: int) -> bool:
    """Two captured attribute sets of ``op`` are equal, an unset attribute counting as
    its default (``pads = [0, 0, 0, 0]`` equals no pads)."""
    for k in set(a) | set(b):
        default = _attr_default(op, domain, k, opset)
        if not _same(a.get(k, default), b.get(k, default)):
            return False
    return True


def fresh_nodes(snapshot: Snapshot) -> dict[int, set[ENode]]:
    """Per e-class that ``snapshot`` changed, its e-nodes that a match could not use against the
    state's previous snapshot: those the e-class did not hold (all of a new name's), and those
    that entered the :data:`INTERIOR_ALTERNATIVES` an interior variadic pattern tries (two e-nodes
    that became one make room for another)."""
    change = snapshot.change
    fresh: dict[int, set[ENode]] = {}
    for c, added in change.added.items():
        new = set(added)
        old = change.previous.get(c)
        if old is not None and max(len(old), len(snapshot.classes[c])) > INTERIOR_ALTERNATIVES:
            nodes = snapshot.classes[c]
            for op in {n.op for n in nodes} | {None}:
                listed, was = ([n for n in x if (n.op == op if op is not None else n.op not in _NOT_ANY)]
                               for x in (nodes, old))
                new |= set(_window(listed)) - set(_window(was))
        if new:
            fresh[c] = new
    return fresh


def _window(nodes: list) -> list:
    """The e-nodes (or ``(e-node, e-class)`` pairs) that an interior variadic pattern tries: at most
    :data:`INTERIOR_ALTERNATIVES`, those with the fewest inputs first (the most room to fuse)."""
    if len(nodes) <= INTERIOR_ALTERNATIVES:
        return nodes
    return sorted(nodes, key=lambda n: len((n if isinstance(n, ENode) else n[0]).children))[:INTERIOR_ALTERNATIVES]


class Delta:
    """What changed since a rule last matched completely (semi-naive matching): per e-class the
    e-nodes a match could not use then (:func:`fresh_nodes` of each snapshot since), and the
    e-classes whose properties that the rule's guard reads changed (``dirty``; :func:`reads_classes`):
    a variable bound to one may pass a guard that refused it. A match that uses none of those
    e-nodes and binds none of those e-classes was a match then, with the same guard and the same
    replacement (an e-class with a new name is read through an e-node that names it: a fresh one;
    a replacement that failed fails again, and one that was built is not built twice). Per pattern
    shape, the e-classes from which a match could reach them (:meth:`Matcher.reach`), shared by
    the rules matched with the same delta."""

    def __init__(self, fresh: dict[int, set[ENode]], dirty: set[int]):
        self.fresh = fresh
        self.dirty = dirty
        self.fresh_ops: dict[str, set[int]] = {}  # op -> the e-classes with a fresh e-node of op
        for c, nodes in fresh.items():
            for n in nodes:
                self.fresh_ops.setdefault(n.op, set()).add(c)
        self.reach: dict[tuple, set[int]] = {}
        self.users: dict[tuple | str, dict[str, set[int]]] = {}  # shape -> op -> users of its reach

    @classmethod
    def since(cls, rounds: list[tuple[dict[int, set[ENode]], Change]], reads: frozenset[str] = frozenset()) -> Delta:
        """The delta of several snapshots' :func:`fresh_nodes` and changes together, for a rule
        whose guard reads ``reads`` of a bound e-class (:func:`reads_classes`)."""
        fresh: dict[int, set[ENode]] = {}
        dirty: set[int] = set()
        for nodes_of, change in rounds:
            if len(rounds) == 1:
                fresh = nodes_of
            else:
                for c, nodes in nodes_of.items():
                    fresh.setdefault(c, set()).update(nodes)
            for kind in reads:
                dirty |= getattr(change, _CHANGES[kind])
        return cls(fresh, dirty)


#: The :class:`~egraft.rewrite.snapshot.Change` field of each kind of read.
_CHANGES = {"const": "new_const", "ops": "new_ops", "handles": "joined"}


def reads_classes(rule: Rule) -> frozenset[str]:
    """What the rule's guard reads of a bound e-class beyond its type: "const", "ops", "handles"
    (:data:`egraft.rewrite.builtins.READS`; a builtin it does not list counts as reading all three). An e-class
    whose such property changed is new to the rule (:class:`Delta`); a compile-time value is read
    only by replacements, and the rewrites of a match are built once."""
    found: set[str] = set()
    stack = [rule.guard]
    while stack:
        e = stack.pop()
        if isinstance(e, ECall):
            if e.func not in READS:
                found.update(_CHANGES)
            elif READS[e.func] is not None:
                found.add(READS[e.func])
            stack += [*e.args, *(v for _, v in e.kwargs)]
        elif isinstance(e, EBinary):
            stack += [e.left, e.right]
        elif isinstance(e, EUnary):
            stack.append(e.operand)
        elif isinstance(e, EList):
            stack += e.items
        elif isinstance(e, EIndex):
            stack += [e.base, *(e.index if isinstance(e.index, tuple) else (e.index,))]
    return frozenset(found)


#: The key under which a partial substitution records that it uses a fresh e-node or binds a dirty
#: e-class (semi-naive matching; removed from the substitutions :meth:`Matcher.match_rule` returns).
NEW = "$new"
#: The e-node ops that a pattern of any op (``*``) does not stand for.
_NOT_ANY = (OUT, ABSENT)
#: The e-node ops that no op pattern matches (leaves; a variable stands for them).
_LEAVES = ("Const", "Input")


@cache
def _commutative(op: str, domain: str) -> bool:
    opdef = get_op(op, domain)
    return opdef is not None and opdef.commutative


def _shape(pattern) -> tuple | str | None:
    """What of a pattern decides where a match of it can reach a :class:`Delta`'s e-nodes and
    e-classes: its ops, outputs and bindings, where it binds variables (``"v"``), not attributes or
    variable names; None for a position that binds nothing (``_``, an absent input)."""
    if isinstance(pattern, PVar):
        return None if pattern.name == "_" else "v"
    if isinstance(pattern, PAbsent):
        return None
    return (pattern.op, pattern.output, tuple(_shape(a) for a in pattern.args), pattern.rest is not None,
            pattern.bind is not None)


class _Node:
    """What matching reads of one pattern node, worked out once: its shape (:func:`_shape`), the
    attribute names it constrains, whether a commutative e-node is also tried with its inputs
    swapped (two inputs of a commutative op, not both plain variables: those bind the other way
    round, which a rule written for one order does not need), and the ops its inputs' patterns need."""

    __slots__ = ("shape", "constrained", "swappable", "child_ops")

    def __init__(self, pattern, fixed_order: frozenset[int]):
        self.shape = _shape(pattern)
        if isinstance(pattern, POp):
            self.constrained = frozenset(ap.name for ap in pattern.attrs)
            self.swappable = (len(pattern.args) == 2 and pattern.rest is None and id(pattern) not in fixed_order
                              and not all(isinstance(a, PVar) for a in pattern.args))
            #: the inputs that must hold an e-node of an op of their own: (position, op)
            self.child_ops = tuple((i, a.op) for i, a in enumerate(pattern.args)
                                   if isinstance(a, POp) and a.op is not None and a.output == 0)


class Matcher:
    """Matches patterns against one snapshot. ``opset`` gives attribute defaults. ``nodes``: what
    is worked out per pattern node (by ``id``), shared by the matchers of one saturation run."""

    def __init__(self, snapshot: Snapshot, opset: int, fixed_order: frozenset[int] = frozenset(),
                 nodes: dict[int, tuple[Any, _Node]] | None = None):
        self.snap = snapshot
        self.opset = opset
        #: the pattern nodes (by ``id``) matched in their written input order only
        self.fixed_order = fixed_order
        self._nodes = {} if nodes is None else nodes
        self._candidates: dict[tuple[str | None, int], set[int]] = {}
        #: the variables the rule being matched requires constant (:func:`required_constants`)
        self._constant_vars: frozenset[str] = frozenset()
        #: while matching with a delta: the delta, and per pattern node (by ``id``) its reach
        self._delta: Delta | None = None
        self._reach: dict[int, set[int]] = {}
        #: the matches the last :meth:`match_rule` call's ``accept`` turned down
        self.refused = 0

    def _node(self, pattern) -> _Node:
        entry = self._nodes.get(id(pattern))
        if entry is None:  # the pattern is kept with its entry, so that its id is not reused
            entry = self._nodes[id(pattern)] = (pattern, _Node(pattern, self.fixed_order))
        return entry[1]

    # ---- single patterns ----------------------------------------------------------------
    def match_class(self, pattern, c: int, subst: Subst, interior: bool = False, need: bool = False) -> Iterator[Subst]:
        """Every extension of ``subst`` under which ``pattern`` matches e-class ``c`` (an
        ``interior`` variadic pattern node tries at most :data:`INTERIOR_ALTERNATIVES` of the
        class's e-nodes of its op). With ``need`` (semi-naive matching: nothing else in the match
        can be new), only the extensions whose part here is (:class:`Delta`)."""
        if type(pattern) is PVar:
            bound = self._bind(pattern, c, subst, need)
            if bound is not None:
                yield bound
            return
        if need and c not in self._reach[id(pattern)]:
            return
        snap = self.snap
        if pattern.output == 0 and pattern.op is not None and c not in snap.projected and c not in snap.tuples:
            nodes = snap.class_ops[c].get(pattern.op, ())  # the common case: the e-class's own e-nodes of the op
            if interior and pattern.rest is not None:
                nodes = _window(nodes)
            for node in nodes:
                yield from self._match_node(pattern, node, c, subst, need)
            return
        found = self._op_nodes(pattern, c)
        if interior and pattern.rest is not None:
            found = iter(_window(list(found)))
        for node, node_class, via in found:
            yield from self._match_node(pattern, node, node_class, subst, need, via)

    def _op_nodes(self, pattern: POp, c: int) -> Iterator[tuple[ENode, int, tuple | None]]:
        """The e-nodes in class ``c`` (or, through ``Out``, its tuple class) that could match, each
        with its e-class and, for one seen through ``Out``, the ``(e-class, Out e-node)`` pair."""
        snap = self.snap
        if pattern.output == 0 and c not in snap.tuples:
            if pattern.op is None:
                for n in snap.classes.get(c, ()):
                    if n.op not in _NOT_ANY:
                        yield n, c, None
            else:
                for n in snap.class_ops[c].get(pattern.op, ()):
                    yield n, c, None
        if c not in snap.projected:
            return
        for out in snap.class_ops[c][OUT]:
            if snap.attrs(out).get("index") == pattern.output:
                tup = out.children[0]
                nodes = snap.classes.get(tup, ()) if pattern.op is None else snap.class_ops[tup].get(pattern.op, ())
                for tn in nodes:
                    yield tn, tup, (c, out)

    def _match_node(self, pattern: POp, node: ENode, node_class: int, subst: Subst,
                    need: bool = False, via: tuple | None = None) -> Iterator[Subst]:
        if node.op in _LEAVES:
            return
        snap = self.snap
        args = pattern.args
        n_args = len(args)
        children = node.children
        if pattern.rest is None and len(children) > n_args:
            # Trailing omitted optional inputs may be present as Absent.
            absent = snap.absent
            for c in children[n_args:]:
                if c not in absent:
                    return
            children = children[:n_args]
        elif len(children) < n_args:
            children = children + (None,) * (n_args - len(children))
        rest = children[n_args:]
        if rest and pattern.rest in self._constant_vars:
            const_class = snap.const_class
            for c in rest:
                if c not in const_class:
                    return  # the guard's const() would refuse it
        info = self._node(pattern)
        # three in four e-nodes an input pattern looked at lacked its op (DenseNet-121): look first
        direct = self._holds_ops(info, children)
        swapped = (info.swappable and n_args == 2 and children[0] != children[1] and _commutative(node.op, node.domain)
                   and self._holds_ops(info, (children[1], children[0])))
        if not direct and not swapped:
            return
        new = False
        delta = self._delta
        if delta is not None and NEW not in subst:
            fresh = delta.fresh.get(node_class)
            new = ((fresh is not None and node in fresh) or (via is not None and self._is_fresh(*via))
                   or (pattern.bind is not None and node_class in delta.dirty)
                   or (pattern.rest is not None and not delta.dirty.isdisjoint(rest)))
            if need and not new:  # only an input can be new: is one in its pattern's reach?
                reach = self._reach
                if not any(cl is not None and cl in reach[id(p)] for p in args for cl in children[:n_args]):
                    return
        attrs = snap.attrs(node)
        base = dict(subst)
        base[MATCHED] = subst.get(MATCHED, ()) + ((node_class, node),)
        if pattern.bind is not None:
            if pattern.bind in base and base[pattern.bind] != node_class:
                return
            base[pattern.bind] = EClassId(node_class)
        for ap in pattern.attrs:
            value = attrs[ap.name] if ap.name in attrs else _attr_default(node.op, node.domain, ap.name, self.opset)
            if ap.var is not None:
                if ap.var in base and not _same(base[ap.var], value):
                    return
                base[ap.var] = value
            elif not _same(value, ap.literal):
                return
        if pattern.attrs_rest is not None:
            constrained = info.constrained
            captured = {k: v for k, v in attrs.items() if k not in constrained}
            if pattern.attrs_rest in base and not _same_attrs(base[pattern.attrs_rest], captured, node.op,
                                                                   node.domain, self.opset):
                return  # the same capture twice: the attribute sets must be equal
            base[pattern.attrs_rest] = captured
        if pattern.rest is not None:
            base[pattern.rest] = list(map(EClassId, rest))
        if new:
            base[NEW] = True
            need = False
        if direct:
            yield from self._match_args(args, children, base, need)
        if swapped:
            yield from self._match_args(args, (children[1], children[0]), base, need)

    def _holds_ops(self, info: _Node, children: Sequence) -> bool:
        """Whether each input that an op pattern stands for holds an e-node of that op (an e-class
        seen through ``Out`` counts as holding it: its tuple class is looked at later)."""
        snap = self.snap
        for i, op in info.child_ops:
            c = children[i]
            if c is None:
                return False
            if op not in snap.class_ops[c] and c not in snap.projected:
                return False
        return True

    def _is_fresh(self, c: int, node: ENode) -> bool:
        fresh = self._delta.fresh.get(c)
        return fresh is not None and node in fresh

    def _bind(self, pattern: PVar, c: int, subst: Subst, need: bool) -> Subst | None:
        """``subst`` with variable ``pattern`` bound to e-class ``c`` (itself, for ``_`` or a
        variable bound to ``c`` already), or None where they disagree or, with ``need``, where
        the binding is not new (:class:`Delta`)."""
        delta = self._delta
        name = pattern.name
        if name == "_":
            return None if need else subst
        if need and c not in delta.dirty:
            return None
        bound = subst.get(name)
        if bound is not None:
            return subst if bound == c else None
        snap = self.snap
        if c in snap.tuples or c in snap.absent:
            return None
        if name in self._constant_vars and c not in snap.const_class:
            return None  # the guard's const() would refuse it
        out = dict(subst)
        out[name] = EClassId(c)
        if delta is not None and c in delta.dirty:
            out[NEW] = True
        return out

    def _match_args(self, patterns: Sequence, classes: Sequence, subst: Subst, need: bool = False) -> Iterator[Subst]:
        """The extensions of ``subst`` under which each of ``patterns`` matches the e-class beside
        it (``classes`` may run on past them); with ``need``, only those in which one of them is
        new (:class:`Delta`). A variable binds here, without a generator of its own."""
        if not patterns:
            yield subst
            return
        first, c = patterns[0], classes[0]
        last = len(patterns) == 1
        need_here = need and NEW not in subst
        if need_here and not last:  # unless an input after this one could still be new
            reach = self._reach
            need_here = not any(cl is not None and cl in reach[id(p)] for p, cl in zip(patterns[1:], classes[1:]))
        kind = type(first)
        if c is None or c in self.snap.absent:
            if not need_here and (kind is PAbsent or (kind is PVar and first.name == "_")):
                if last:
                    yield subst
                else:
                    yield from self._match_args(patterns[1:], classes[1:], subst, need)
            return
        if kind is PAbsent:
            return  # an input is there where the pattern wants none
        if kind is PVar:
            bound = self._bind(first, c, subst, need_here)
            if bound is not None:
                if last:
                    yield bound
                else:
                    yield from self._match_args(patterns[1:], classes[1:], bound, need)
            return
        if last:
            yield from self.match_class(first, c, subst, interior=True, need=need_here)
            return
        for s in self.match_class(first, c, subst, interior=True, need=need_here):
            yield from self._match_args(patterns[1:], classes[1:], s, need)

    # ---- semi-naive matching ------------------------------------------------------------
    def reach(self, pattern, delta: Delta) -> set[int]:
        """The e-classes at which a match of ``pattern`` could use a fresh e-node or bind a dirty
        e-class of ``delta``: a variable's are the dirty ones; an op's, those with a fresh e-node
        of the op (or a fresh projection), the dirty ones if it binds a name, and those with an
        e-node of the op that reads an e-class in one of its inputs' reach (and the projections of
        such a tuple e-class). Only a root in this set can match differently since the delta's
        snapshot; matching prunes the inputs outside their sets. A superset (attributes and
        repeated variables are not looked at), memoized per pattern shape in ``delta``."""
        return self._reach_of(self._node(pattern).shape, delta)

    def _reach_of(self, shape, delta: Delta) -> set[int]:
        if shape is None:
            return set()
        if shape == "v":
            return delta.dirty
        found = delta.reach.get(shape)
        if found is not None:
            return found
        op, _, args, rest, bind = shape
        if op is None:
            found = set().union(*(cs for o, cs in delta.fresh_ops.items() if o not in _NOT_ANY))
        else:
            found = set(delta.fresh_ops.get(op, ()))
        found |= delta.fresh_ops.get(OUT, set())
        if bind:
            found |= delta.dirty
        for arg in {*args, *(("v",) if rest else ())} - {None}:
            users = self._users_of(arg, delta)
            if op is None:
                for o, parents in users.items():
                    if o not in _NOT_ANY:
                        found |= parents
            else:
                found |= users.get(op, set())
        uses = self.snap.uses
        for tup in found & self.snap.tuples:  # matched at the projections of its outputs
            for parent, parent_op in uses.get(tup, ()):
                if parent_op == OUT:
                    found.add(parent)
        delta.reach[shape] = found
        return found

    def _users_of(self, shape, delta: Delta) -> dict[str, set[int]]:
        """Per op, the e-classes with an e-node of that op reading an e-class in ``shape``'s reach
        (one pass over their users serves every pattern with an input of that shape)."""
        found = delta.users.get(shape)
        if found is None:
            found = delta.users[shape] = {}
            uses = self.snap.uses
            for c in self._reach_of(shape, delta):
                for parent, op in uses.get(c, ()):
                    parents = found.get(op)
                    if parents is None:
                        found[op] = {parent}
                    else:
                        parents.add(parent)
        return found

    def _enter(self, rule: Rule, delta: Delta | None) -> None:
        """Record the delta, and the reach of each pattern node of ``rule``."""
        self._reach = {}
        self._delta = delta
        if delta is None:
            return
        stack: list = list(rule.roots)
        while stack:
            p = stack.pop()
            self._reach[id(p)] = self.reach(p, delta)
            if type(p) is POp:
                stack.extend(p.args)

    # ---- rules --------------------------------------------------------------------------
    def candidates(self, pattern: POp) -> list[int]:
        """E-classes whose e-nodes could match a root pattern, deterministic order."""
        return sorted(self._candidates_of(pattern))

    def _candidates_of(self, pattern: POp) -> set[int]:
        """:meth:`candidates` as a set, memoized by the pattern's op and output: many rules share a
        root op (every rule of this snapshot asks), and the set depends on nothing else."""
        key = (pattern.op, pattern.output)
        found = self._candidates.get(key)
        if found is None:
            found = self._candidates[key] = self._find_candidates(pattern)
        return found

    def _find_candidates(self, pattern: POp) -> set[int]:
        snap = self.snap
        if pattern.op is None:
            return set(snap.classes)
        found = snap.op_classes.get(pattern.op, set())
        direct = found - snap.tuples if pattern.output == 0 else set()
        projections = set()  # the outputs of multi-output nodes: Out(i) of a tuple class
        for tup in found & snap.tuples:
            for c, op in snap.uses.get(tup, ()):
                if op == OUT and any(n.children[0] == tup and snap.attrs(n).get("index") == pattern.output
                                     for n in snap.class_ops[c][OUT]):
                    projections.add(c)
        return direct | projections

    def parents(self, c: int) -> set[int]:
        """The e-classes with an e-node that takes e-class ``c`` as an input."""
        return self.snap.parents(c)

    def _join_candidates(self, root: POp, candidates: list[int], subst: Subst) -> list[int]:
        """``candidates`` (sorted) of a later root, narrowed to the parents of an input that an
        earlier root bound (a multi-root rule joins on it) instead of every e-node of the op."""
        if root.output != 0:
            return candidates
        for arg in root.args:
            bound = subst.get(arg.name) if isinstance(arg, PVar) else None
            if isinstance(bound, EClassId):
                users = set(self.parents(bound))
                for tup in [c for c in users if c in self.snap.tuples]:
                    users |= self.parents(tup)  # output 0 of a multi-output node (through Out)
                return sorted(users.intersection(candidates))
        return candidates

    def match_rule(self, rule: Rule, limit: int | None = None, delta: Delta | None = None,
                   constants: frozenset[str] | None = None,
                   accept: Callable[[Subst], bool] | None = None) -> list[Subst]:
        """All substitutions for the rule's roots (at most ``limit``); with ``delta``, only those
        that use one of its fresh e-nodes or bind one of its dirty e-classes (semi-naive matching:
        every other match was one against the delta's snapshot). Multi-root rules: search ``i``
        takes root ``i`` inside its :meth:`reach`, the roots before it outside theirs (where
        nothing is new), so no match is found twice. ``constants``:
        :func:`required_constants` of the rule, when known.

        ``accept`` (the rule's guard) filters the matches as they are found, so that only the
        ones it accepts count towards ``limit``: ``Mul(Elementwise(xs...), Elementwise(ys...))
        where len(xs) + len(ys) <= 8`` matched 120,000 pairs of bodies on t5_encoder_int8 and
        its guard refused 94% of them, which had banned the rule round after round.
        :attr:`refused` counts the matches ``accept`` turned down in this call."""
        found = [self._candidates_of(root) for root in rule.roots]
        self.refused = 0
        if not all(found):
            return []  # a root's op is nowhere in the e-graph (no MatMul in a CNN): no reach to compute
        if delta is not None and all(self.reach(root, delta).isdisjoint(c) for root, c in zip(rule.roots, found)):
            return []  # no root can be new: the cheap answer for most rules in most rounds
        self._constant_vars = required_constants(rule) if constants is None else constants
        self._enter(rule, delta)
        try:
            n = len(rule.roots)
            if delta is None:
                return self._search(rule, limit, [sorted(c) for c in found], list(range(n)), accept)
            results: list[Subst] = []
            reach = [self._reach[id(root)] for root in rule.roots]
            for first in range(n):
                inside = sorted(reach[first] & found[first])
                if not inside:
                    continue
                narrowed = [inside if i == first else sorted(found[i] - reach[i]) if i < first else sorted(found[i])
                            for i in range(n)]
                order = [first] + [i for i in range(n) if i != first]
                left = None if limit is None else limit - len(results)
                results += self._search(rule, left, [narrowed[i] for i in order], order, accept, first)
                if limit is not None and len(results) >= limit:
                    break
            return results
        finally:
            self._constant_vars = frozenset()
            self._delta = None
            self._reach = {}

    def _search(self, rule: Rule, limit: int | None, candidates: list[list[int]], order: list[int],
                accept: Callable[[Subst], bool] | None = None, first: int | None = None) -> list[Subst]:
        """The matches of the rule's roots taken in ``order`` among ``candidates`` (in that order);
        with a delta, ``first`` is the root taken inside its reach (:meth:`match_rule`)."""
        search = _Search(rule, limit, candidates, order, accept, first)
        self._extend(search, 0, {})
        self.refused += search.refused
        return search.results

    def _extend(self, search: _Search, i: int, subst: Subst) -> bool:
        """Add the matches of roots ``i``... that extend ``subst``; True once the limit is reached.
        (A method, not a recursive closure: a closure that calls itself is a reference cycle,
        which kept every match of every rule alive until the cycle collector ran.)"""
        names = search.names
        if i == len(names):
            if self._delta is not None and subst.pop(NEW, None) is None:
                return False  # a match against the delta's snapshot already
            if search.accept is not None and not search.accept(subst):
                search.refused += 1
                return False
            search.results.append(subst)
            return search.limit is not None and len(search.results) >= search.limit
        root = search.roots[i]
        candidates = search.candidates[i]
        if i > 0:
            candidates = self._join_candidates(root, candidates, subst)
        earlier = [subst[names[j]] for j in range(i)]
        const_class = self.snap.const_class
        # semi-naive: this root must be new where no later one can
        need = self._delta is not None and NEW not in subst and not search.later_may_reach[i]
        for c in candidates:
            if c in earlier:
                continue  # two roots of one match are different nodes
            if search.single_root and c in const_class:
                continue  # a constant e-class costs nothing: no rewrite can improve it
            for s in self.match_class(root, c, subst, need=need):
                s = dict(s)
                s[names[i]] = EClassId(c)
                if self._extend(search, i + 1, s):
                    return True
        return False


def required_constants(rule: Rule) -> frozenset[str]:
    """The pattern variables that the rule's guard requires constant: the arguments of a
    ``const(...)`` that the guard's top-level ``and`` chain asserts. Matching skips an e-class
    that is not constant in the snapshot for them, instead of building the match for the guard
    to refuse (``fold_constants``, ``*(xs...) where const(xs)``, matched every e-node).

    Example: for ``Add(a, b) where const(b) and rank(a) == 2`` it is ``{"b"}``.
    """
    names: set[str] = set()
    pending = [rule.guard] if rule.guard is not None else []
    while pending:
        e = pending.pop()
        if isinstance(e, EBinary) and e.op == "and":
            pending += [e.left, e.right]
        elif isinstance(e, ECall) and e.func == "const" and not e.kwargs:
            names.update(a.name for a in e.args if isinstance(a, EVar))
    return frozenset(names)


class _Search:
    """The state of one :meth:`Matcher.match_rule` call: the rule, the limit, each root's
    candidate e-classes and root names, the guard, and the matches found so far."""

    def __init__(self, rule: Rule, limit: int | None, candidates: list[list[int]], order: list[int],
                 accept: Callable[[Subst], bool] | None = None, first: int | None = None):
        self.rule = rule
        self.limit = limit
        self.accept = accept  # the rule's guard, when matching filters by it
        self.refused = 0  # matches the guard turned down
        self.candidates = candidates  # per root, in the order searched
        self.roots = [rule.roots[i] for i in order]  # the roots in the order searched
        self.names = [ROOT.format(i) for i in order]  # each root's own name, whatever the order
        self.single_root = len(rule.roots) == 1
        self.results: list[Subst] = []
        #: per position searched: whether a root searched after it may be new (one after ``first``
        #: in the rule's order; those before it lie outside their reach)
        self.later_may_reach = [first is not None and any(j > first for j in order[k + 1:]) for k in range(len(order))]


def _is_commutative_pair(p: POp) -> bool:
    opdef = get_op(p.op, p.domain) if p.op is not None else None
    return opdef is not None and opdef.commutative and len(p.args) == 2 and p.rest is None \
        and not all(isinstance(a, PVar) for a in p.args)


def _renamed(names: dict[str, str], n: str | None) -> str:
    if n is None or n == "_":
        return str(n)
    return names.setdefault(n, f"v{len(names)}")


def _pattern_text(p, names: dict[str, str], swapped: POp | None) -> str:
    """``p``'s structure, its variables renamed in order of appearance (a module function,
    not a self-calling closure: that would make a reference cycle per call)."""
    if isinstance(p, PVar):
        return _renamed(names, p.name)
    if isinstance(p, PAbsent):
        return "<absent>"
    args = list(p.args)
    if p is swapped:
        args.reverse()
    attrs = ",".join(f"{a.name}={a.literal!r}" if a.var is None else f"{a.name}={_renamed(names, a.var)}"
                     for a in sorted(p.attrs, key=lambda a: a.name))
    inner = ",".join(_pattern_text(a, names, swapped) for a in args)
    return (f"{_renamed(names, p.bind)}={p.domain}::{p.op}[{p.output}]({inner};{_renamed(names, p.rest)})"
            f"{{{attrs};{_renamed(names, p.attrs_rest)}}}")


def _pattern_key(roots: Sequence, swapped: POp | None = None) -> str:
    """The roots' structure with variables renamed in order of appearance (so that two rules
    that differ only in names give one key), ``swapped``'s inputs taken in the other order."""
    names: dict[str, str] = {}
    return "|".join(_pattern_text(r, names, swapped) for r in roots)


def fixed_order_nodes(rules: Sequence[Rule]) -> frozenset[int]:
    """The commutative pattern nodes (by ``id``) whose other input order the rule set spells
    already: a rule of the same pattern with that node's inputs swapped (``ew_add_body_left``
    and ``ew_add_body_right``), or the rule itself when swapping gives its own pattern
    (``Mul(Elementwise(xs...), Elementwise(ys...))``). The matcher tries both orders only at
    the other commutative nodes."""
    keys = {_pattern_key(r.roots) for r in rules}
    fixed = set()
    for rule in rules:
        stack = list(rule.roots)
        while stack:
            p = stack.pop()
            if not isinstance(p, POp):
                continue
            stack.extend(p.args)
            if _is_commutative_pair(p) and _pattern_key(rule.roots, swapped=p) in keys:
                fixed.add(id(p))
    return frozenset(fixed)

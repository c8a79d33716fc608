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
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import Any

from egraft.ir.registry import get_op
from egraft.rewrite.ast import EBinary, ECall, EVar, PAbsent, POp, PVar, Rule
from egraft.rewrite.egraph import ABSENT, OUT, ENode, Snapshot

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


class Matcher:
    """Matches patterns against one snapshot. ``opset`` gives attribute defaults."""

    def __init__(self, snapshot: Snapshot, opset: int, fixed_order: frozenset[int] = frozenset()):
        self.snap = snapshot
        self.opset = opset
        #: the pattern nodes (by ``id``) matched in their written input order only
        self.fixed_order = fixed_order
        self._parents: dict[int, set[int]] | None = None
        self._candidates: dict[tuple[str | None, int], list[int]] = {}
        #: the variables the rule being matched requires constant (:func:`required_constants`)
        self._constant_vars: frozenset[str] = frozenset()
        #: the matches the last :meth:`match_rule` call's ``accept`` turned down
        self.refused = 0

    # ---- single patterns ----------------------------------------------------------------
    def match_class(self, pattern, c: int, subst: Subst, interior: bool = False) -> Iterator[Subst]:
        """Every extension of ``subst`` under which ``pattern`` matches e-class ``c`` (an
        ``interior`` variadic pattern node tries at most :data:`INTERIOR_ALTERNATIVES` of the
        class's e-nodes of its op)."""
        if isinstance(pattern, PVar):
            if pattern.name == "_":
                yield subst
                return
            bound = subst.get(pattern.name)
            if bound is None:
                if self.snap.is_tuple(c) or self.snap.is_absent(c):
                    return
                if pattern.name in self._constant_vars and c not in self.snap.const_class:
                    return  # the guard's const() would refuse it
                out = dict(subst)
                out[pattern.name] = EClassId(c)
                yield out
            elif bound == c:
                yield subst
            return
        nodes = self._op_nodes(pattern, c)
        if interior and pattern.rest is not None:
            found = list(nodes)
            if len(found) > INTERIOR_ALTERNATIVES:  # the ones with the fewest inputs: the most room to fuse
                found = sorted(found, key=lambda item: len(item[0].children))[:INTERIOR_ALTERNATIVES]
            nodes = iter(found)
        for node, node_class in nodes:
            yield from self._match_node(pattern, node, node_class, subst)

    def _op_nodes(self, pattern: POp, c: int) -> Iterator[tuple[ENode, int]]:
        """The e-nodes in class ``c`` (or, through ``Out``, its tuple class) that could match."""
        if pattern.output == 0 and not self.snap.is_tuple(c):
            for n in self.snap.classes.get(c, ()):
                if n.op not in (OUT, ABSENT) and (pattern.op is None or n.op == pattern.op):
                    yield n, c
        if c not in self.snap.projected:
            return
        for n in self.snap.classes.get(c, ()):
            if n.op == OUT and self.snap.attrs(n).get("index") == pattern.output:
                tup = n.children[0]
                for tn in self.snap.classes.get(tup, ()):
                    if pattern.op is None or tn.op == pattern.op:
                        yield tn, tup

    def _match_node(self, pattern: POp, node: ENode, node_class: int, subst: Subst) -> Iterator[Subst]:
        if node.op in ("Const", "Input"):
            return
        args = pattern.args
        children = node.children
        if pattern.rest is None and len(children) > len(args):
            # Trailing omitted optional inputs may be present as Absent.
            extra = children[len(args):]
            if not all(self.snap.is_absent(c) for c in extra):
                return
            children = children[:len(args)]
        if len(children) < len(args):
            padded = list(children) + [None] * (len(args) - len(children))
        else:
            padded = list(children)
        attrs = self.snap.attrs(node)
        base = dict(subst)
        base[MATCHED] = subst.get(MATCHED, ()) + ((node_class, node),)
        if pattern.bind is not None:
            if pattern.bind in base and base[pattern.bind] != node_class:
                return
            base[pattern.bind] = EClassId(node_class)
        constrained = set()
        for ap in pattern.attrs:
            constrained.add(ap.name)
            value = attrs[ap.name] if ap.name in attrs else _attr_default(node.op, node.domain, ap.name, self.opset)
            if ap.var is not None:
                if ap.var in base and not _same(base[ap.var], value):
                    return
                base[ap.var] = value
            elif not _same(value, ap.literal):
                return
        if pattern.attrs_rest is not None:
            rest = {k: v for k, v in attrs.items() if k not in constrained}
            if pattern.attrs_rest in base and not _same_attrs(base[pattern.attrs_rest], rest, node.op,
                                                                   node.domain, self.opset):
                return  # the same capture twice: the attribute sets must be equal
            base[pattern.attrs_rest] = rest
        if pattern.rest is not None:
            rest = padded[len(args):]  # padding stops at len(args)
            if pattern.rest in self._constant_vars and not all(c in self.snap.const_class for c in rest):
                return  # the guard's const() would refuse it
            base[pattern.rest] = list(map(EClassId, rest))
        yield from self._match_args(list(args), padded[:len(args)], base)
        if self._swaps(pattern, node, padded):
            yield from self._match_args(list(args), [padded[1], padded[0]], base)

    def _swaps(self, pattern: POp, node: ENode, children: list) -> bool:
        """Whether a two-input commutative node is matched with its inputs swapped too: when
        they differ and the pattern's arguments are not both plain variables (those bind the
        other way round, which a rule written for one order does not need)."""
        if len(pattern.args) != 2 or pattern.rest is not None or len(children) != 2 or children[0] == children[1]:
            return False
        if id(pattern) in self.fixed_order or all(isinstance(a, PVar) for a in pattern.args):
            return False
        opdef = get_op(node.op, node.domain)
        return opdef is not None and opdef.commutative

    def _match_args(self, patterns: list, classes: list, subst: Subst) -> Iterator[Subst]:
        if not patterns:
            yield subst
            return
        first, c = patterns[0], classes[0]
        if c is None or self.snap.is_absent(c):
            if type(first) is PAbsent or (isinstance(first, PVar) and first.name == "_"):
                yield from self._match_args(patterns[1:], classes[1:], subst)
            return
        if type(first) is PAbsent:
            return  # an input is there where the pattern wants none
        for s in self.match_class(first, c, subst, interior=True):
            yield from self._match_args(patterns[1:], classes[1:], s)

    # ---- rules --------------------------------------------------------------------------
    def candidates(self, pattern: POp) -> list[int]:
        """E-classes whose e-nodes could match a root pattern, deterministic order.
        Memoized by the pattern's op and output: many rules share a root op (every rule of
        this snapshot asks), and the list depends on nothing else."""
        key = (pattern.op, pattern.output)
        if key not in self._candidates:
            self._candidates[key] = self._find_candidates(pattern)
        return self._candidates[key]

    def _find_candidates(self, pattern: POp) -> list[int]:
        if pattern.op is None:
            return sorted(self.snap.classes)
        found = {c for c, _ in self.snap.by_op.get(pattern.op, ())}
        direct = {c for c in found if not self.snap.is_tuple(c)} if pattern.output == 0 else set()
        projections = set()  # the outputs of multi-output nodes: Out(i) of a tuple class
        for c, n in self.snap.by_op.get(OUT, ()):
            if n.children[0] in found and self.snap.attrs(n).get("index") == pattern.output:
                projections.add(c)
        return sorted(direct | projections)

    def parents(self, c: int) -> set[int]:
        """The e-classes with an e-node that takes e-class ``c`` as an input."""
        if self._parents is None:
            self._parents = {}
            for cls, enodes in self.snap.classes.items():
                for n in enodes:
                    for ch in n.children:
                        self._parents.setdefault(ch, set()).add(cls)
        return self._parents.get(c, set())

    def region(self, seeds: set[int], depth: int) -> set[int]:
        """The e-classes from which a pattern of ``depth`` levels could reach one of ``seeds``:
        the seeds and their users up to ``depth`` e-nodes above (a tuple class, seen through
        ``Out``, adds no level). Only a root in this region can match differently after the
        seeds changed."""
        left = dict.fromkeys(seeds, depth)  # e-class -> the most levels left on reaching it
        frontier = list(seeds)
        while frontier:
            c = frontier.pop()
            if left[c] == 0:
                continue
            for p in self.parents(c):
                more = left[c] - (0 if self.snap.is_tuple(p) else 1)
                if left.get(p, -1) < more:
                    left[p] = more
                    frontier.append(p)
        return set(left)

    def _join_candidates(self, root: POp, candidates: list[int], subst: Subst) -> list[int]:
        """``candidates`` (sorted) of a later root, narrowed to the parents of an input that an
        earlier root bound (a multi-root rule joins on it) instead of every e-node of the op."""
        if root.output != 0:
            return candidates
        for arg in root.args:
            bound = subst.get(arg.name) if isinstance(arg, PVar) else None
            if isinstance(bound, EClassId):
                users = set(self.parents(bound))
                for tup in [c for c in users if self.snap.is_tuple(c)]:
                    users |= self.parents(tup)  # output 0 of a multi-output node (through Out)
                return sorted(users.intersection(candidates))
        return candidates

    def match_rule(self, rule: Rule, limit: int | None = None, within: Sequence[set[int]] | None = None,
                   constants: frozenset[str] | None = None,
                   accept: Callable[[Subst], bool] | None = None) -> list[Subst]:
        """All substitutions for the rule's roots (at most ``limit``); with ``within`` (a set of
        e-classes per root), only those where some root ``i`` is in ``within[i]`` (incremental
        matching: a match whose every root lies outside was found before). Semi-naive: search
        ``i`` takes root ``i`` inside its set, the roots before it outside theirs, so no match is
        found twice. ``constants``: :func:`required_constants` of the rule, when known.

        ``accept`` (the rule's guard) filters the matches as they are found, so that only the
        ones it accepts count towards ``limit``: ``Mul(Elementwise(xs...), Elementwise(ys...))
        where len(xs) + len(ys) <= 8`` matched 120,000 pairs of bodies on t5_encoder_int8 and
        its guard refused 94% of them, which had banned the rule round after round.
        :attr:`refused` counts the matches ``accept`` turned down in this call."""
        candidates = [self.candidates(root) for root in rule.roots]
        self._constant_vars = required_constants(rule) if constants is None else constants
        self.refused = 0
        try:
            if within is None:
                return self._search(rule, limit, candidates, list(range(len(candidates))), accept)
            results: list[Subst] = []
            for first in range(len(within)):
                narrowed = [[c for c in candidates[i] if (c in within[i]) == (i == first)] if i <= first
                            else candidates[i] for i in range(len(candidates))]
                order = [first] + [i for i in range(len(candidates)) if i != first]
                left = None if limit is None else limit - len(results)
                results += self._search(rule, left, [narrowed[i] for i in order], order, accept)
                if limit is not None and len(results) >= limit:
                    break
            return results
        finally:
            self._constant_vars = frozenset()

    def _search(self, rule: Rule, limit: int | None, candidates: list[list[int]], order: list[int],
                accept: Callable[[Subst], bool] | None = None) -> list[Subst]:
        """The matches of the rule's roots taken in ``order`` among ``candidates`` (in that order)."""
        search = _Search(rule, limit, candidates, order, accept)
        self._extend(search, 0, {})
        self.refused += search.refused
        return search.results

    def _extend(self, search: _Search, i: int, subst: Subst) -> bool:
        """Add the matches of roots ``i``... that extend ``subst``; True once the limit is reached.
        (A method, not a recursive closure: a closure that calls itself is a reference cycle,
        which kept every match of every rule alive until the cycle collector ran.)"""
        names = search.names
        if i == len(names):
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
        for c in candidates:
            if c in earlier:
                continue  # two roots of one match are different nodes
            if search.single_root and c in const_class:
                continue  # a constant e-class costs nothing: no rewrite can improve it
            for s in self.match_class(root, c, subst):
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


def pattern_depth(pattern) -> int:
    """Levels of e-nodes a pattern reads: ``Relu(Conv(x, w))`` is 2, ``x`` is 0."""
    return 0 if isinstance(pattern, PVar | PAbsent) else 1 + max((pattern_depth(a) for a in pattern.args), default=0)


class _Search:
    """The state of one :meth:`Matcher.match_rule` call: the rule, the limit, each root's
    candidate e-classes and root names, the guard, and the matches found so far."""

    def __init__(self, rule: Rule, limit: int | None, candidates: list[list[int]], order: list[int],
                 accept: Callable[[Subst], bool] | None = None):
        self.rule = rule
        self.limit = limit
        self.accept = accept  # the rule's guard, when matching filters by it
        self.refused = 0  # matches the guard turned down
        self.candidates = candidates  # per root, in the order searched
        self.roots = [rule.roots[i] for i in order]  # the roots in the order searched
        self.names = [ROOT.format(i) for i in order]  # each root's own name, whatever the order
        self.single_root = len(rule.roots) == 1
        self.results: list[Subst] = []


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

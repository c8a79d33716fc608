"""Pruning for exact extraction: the e-nodes the ILP (:mod:`egraft.extract.ilp`) needs to
choose among, fewer than the e-graph holds, without ever losing the optimum.

Every step removes only e-nodes that some optimal program can do without, so the cheapest
program over what is left costs what the cheapest program over the whole e-graph costs
(``tests/test_ilp.py`` checks it against the unpruned ILP and brute force). The first
three steps remove e-nodes no acyclic program can hold; the next two need an exchange:

- **self-loops** (a child is the e-node's own class) and **unusable** e-nodes, which
  extraction must not pick (infinite cost: ``unextractable``, or a family the target lacks);
- **unbuildable**: an e-node with a child e-class that has no acyclic program at all
  (least fixpoint from the leaves: a class is buildable when one of its e-nodes has only
  buildable children);
- **cycle only**: an e-node of class ``c`` with a child that has no program avoiding ``c``
  (``y = Out(Dropout(y))``: every program of the child computes ``y`` first), checked in
  each small cyclic component of the class graph;
- **subsumed**: an e-node ``b`` when an e-node ``a`` of the same e-class costs no more and
  needs a subset of ``b``'s child e-classes. Swapping ``b`` for ``a`` in any program keeps it
  valid (fewer edges: no new cycle, no missing child) and no dearer; among equals the order
  (cost, number of children, index) keeps one;
- **dominated by greedy**: an e-node ``n`` when another e-node ``m`` of its e-class, with
  the greedy choices below it (a program ``R(m)`` closed under those choices, not reaching
  the class), costs in all ``cost(m) + cost(R(m)) <= cost(n)``. Swapping ``n`` for ``m`` and
  the classes of ``R(m)`` for greedy's choices stays valid (``R(m)`` is closed and acyclic,
  so no new edge leaves it) and pays at most ``cost(m) + cost(R(m))`` while saving at least
  ``cost(n)``. It mostly removes dear e-nodes near the inputs (a Winograd or im2col form of
  a first convolution); a deep class's ``R(m)`` is the whole model below it;
- **unreachable**: e-classes that no remaining e-node of the outputs' programs reaches.

The greedy program's e-nodes are never pruned, so it stays a feasible start for the ILP;
the dominance step keeps every greedy choice (the witnesses' programs are made of them); and
the exchanges above only ever move a program onto unpruned e-nodes (the swaps strictly lower
the number of pruned e-nodes it uses, or move an e-node down the subsumption order), so an
optimal program survives.

:func:`candidates` also reports the e-classes every program computes (``forced``: the
outputs and, below a forced class, the child classes all its e-nodes share) and the
e-classes settled without a choice (``fixed``: a single free leaf, an input or constant).

On densenet121 under ``nodes``, 3,000 of the 10,236 e-nodes are subsumed and 12 dominated; 6,849
are left, 449 of them inputs and constants without a choice.

Example:
    >>> cands = candidates(snapshot, table, roots, keep=greedy_program, greedy_choice=choice)  # doctest: +SKIP
    >>> cands.stats["subsumed"], cands.stats["enodes"]                                        # doctest: +SKIP
    (3000, 6849)
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from egraft.extract.program import CostTable
from egraft.rewrite.egraph import Snapshot

#: The largest cyclic component whose classes are checked one by one (``cycle_only``).
MAX_COMPONENT = 12


@dataclass
class Candidates:
    """What is left to choose from after pruning.

    Attributes:
        nodes: e-class -> the indices (in ``snapshot.classes[c]``) of its remaining e-nodes,
            for every e-class the outputs' programs can reach through them.
        children: (e-class, index) -> the distinct child e-classes of that e-node, sorted.
        forced: the e-classes every program computes.
        fixed: the e-classes whose only e-node is a free leaf (no choice, no cost).
        stats: how many e-nodes each step removed (``self_loops``, ``unusable``,
            ``unbuildable``, ``subsumed``, ``dominated``) and what is left (``enodes``,
            ``eclasses``).
    """

    nodes: dict[int, list[int]]
    children: dict[tuple[int, int], tuple[int, ...]]
    forced: set[int] = field(default_factory=set)
    fixed: dict[int, int] = field(default_factory=dict)
    stats: dict[str, int] = field(default_factory=dict)


def program_closure(snapshot: Snapshot, choice: dict[int, int], start: list[int],
                    avoid: int | None = None) -> set[int] | None:
    """The e-classes the program ``choice`` computes below ``start`` (``start`` included), or
    None when it is not a program there: a class without a choice, a cycle, or (``avoid``)
    the class ``avoid`` reached."""
    walked = _walk_program(snapshot, choice, start, avoid)
    return None if walked is None else walked[0]


def _walk_program(snapshot: Snapshot, choice: dict[int, int], start, avoid: int | None,
                  table: CostTable | None = None, limit: float = math.inf) -> tuple[set[int], float] | None:
    """The classes the program ``choice`` computes below ``start`` and (with ``table``) their
    cost, depth first; None when it is not a program there (a class without a choice, a cycle,
    ``avoid`` reached) or its cost passes ``limit``."""
    total = 0.0
    done: set[int] = set()
    on_path: set[int] = set()
    stack: list[tuple[int, bool]] = [(c, False) for c in reversed(list(start))]
    while stack:
        c, leaving = stack.pop()
        if leaving:
            on_path.discard(c)
            done.add(c)
            continue
        if c in done:
            continue
        if c in on_path or c == avoid or c not in choice:
            return None
        if table is not None:
            total += table[c][choice[c]]
            if total > limit:
                return None
        on_path.add(c)
        stack.append((c, True))
        for ch in snapshot.classes[c][choice[c]].children:
            if ch not in done:
                if ch in on_path:
                    return None
                stack.append((ch, False))
    return done, total


def candidates(snapshot: Snapshot, table: CostTable, roots: list[int], keep: set[tuple[int, int]] = frozenset(),
               greedy_choice: dict[int, int] | None = None, dominance: bool = True) -> Candidates:
    """The e-nodes left for exact extraction of ``roots`` (see the module docstring).

    Args:
        snapshot: the e-graph.
        table: the cost of every e-node (``math.inf``: never pick).
        roots: the output e-classes.
        keep: e-nodes ``(class, index)`` never pruned (greedy's program: the ILP's start).
        greedy_choice: greedy's choice of every e-class, the witnesses of the dominance step
            (skipped without it).
        dominance: whether to run the subsumption and dominance steps (off: only what can
            never be in a program goes; tests compare both).
    """
    stats = {"self_loops": 0, "unusable": 0, "unbuildable": 0, "cycle_only": 0, "subsumed": 0, "dominated": 0}
    classes = snapshot.classes
    # Every e-class the roots can reach through usable e-nodes, and those e-nodes.
    nodes: dict[int, list[int]] = {}
    stack = list(dict.fromkeys(roots))
    while stack:
        c = stack.pop()
        if c in nodes:
            continue
        usable = []
        for i, n in enumerate(classes[c]):
            if c in n.children:
                stats["self_loops"] += 1
            elif table[c][i] == math.inf:
                stats["unusable"] += 1
            else:
                usable.append(i)
                stack.extend(ch for ch in n.children if ch not in nodes)
        nodes[c] = usable
    children = {(c, i): tuple(sorted(set(classes[c][i].children))) for c, idx in nodes.items() for i in idx}

    while True:
        dropped = _drop_unbuildable(nodes, children, stats)
        dropped += _drop_cycle_only(nodes, children, stats)
        if not dropped:
            break

    if dominance:
        for c, idx in nodes.items():
            nodes[c] = _unsubsumed(c, idx, table, children, keep, stats)
        if greedy_choice is not None:
            witness_cost = _witness_costs(snapshot, table, nodes, greedy_choice)
            protected = set(keep) | {(c, i) for c, i in greedy_choice.items() if i in nodes.get(c, ())}
            for c, idx in nodes.items():
                best = min((w for i in idx if (w := witness_cost.get((c, i))) is not None), default=None)
                if best is None:
                    continue
                owner = min(i for i in idx if witness_cost.get((c, i)) == best)
                kept = [i for i in idx if i == owner or (c, i) in protected or table[c][i] < best]
                stats["dominated"] += len(idx) - len(kept)
                nodes[c] = kept

    # What the roots still reach.
    reached: dict[int, list[int]] = {}
    stack = list(dict.fromkeys(roots))
    while stack:
        c = stack.pop()
        if c in reached:
            continue
        reached[c] = nodes[c]
        for i in nodes[c]:
            stack.extend(ch for ch in children[(c, i)] if ch not in reached)
    children = {(c, i): children[(c, i)] for c, idx in reached.items() for i in idx}

    forced: set[int] = set()
    stack = list(dict.fromkeys(roots))
    while stack:
        c = stack.pop()
        if c in forced or not reached[c]:
            continue
        forced.add(c)
        shared = set(children[(c, reached[c][0])])
        for i in reached[c][1:]:
            shared &= set(children[(c, i)])
        stack.extend(shared - forced)
    fixed = {c: idx[0] for c, idx in reached.items()
             if len(idx) == 1 and not children[(c, idx[0])] and table[c][idx[0]] == 0}
    stats["enodes"] = sum(len(idx) for idx in reached.values())
    stats["eclasses"] = len(reached)
    return Candidates(reached, children, forced, fixed, stats)


def _drop_unbuildable(nodes: dict[int, list[int]], children: dict[tuple[int, int], tuple[int, ...]],
                      stats: dict[str, int]) -> int:
    """Drop the e-nodes with a child class that has no acyclic program (the buildable classes
    are a least fixpoint from the leaves); return how many."""
    parents: dict[int, list[tuple[int, int]]] = {}
    missing: dict[tuple[int, int], int] = {}
    ready: list[int] = []
    buildable: set[int] = set()
    for c, idx in nodes.items():
        for i in idx:
            chs = children[(c, i)]
            missing[(c, i)] = len(chs)
            for ch in chs:
                parents.setdefault(ch, []).append((c, i))
            if not chs and c not in buildable:
                buildable.add(c)
                ready.append(c)
    while ready:
        ch = ready.pop()
        for c, i in parents.get(ch, ()):
            missing[(c, i)] -= 1
            if missing[(c, i)] == 0 and c not in buildable:
                buildable.add(c)
                ready.append(c)
    dropped = 0
    for c, idx in nodes.items():
        kept = [i for i in idx if all(ch in buildable for ch in children[(c, i)])]
        dropped += len(idx) - len(kept)
        nodes[c] = kept
    stats["unbuildable"] += dropped
    return dropped


def _drop_cycle_only(nodes: dict[int, list[int]], children: dict[tuple[int, int], tuple[int, ...]],
                     stats: dict[str, int]) -> int:
    """Drop the e-nodes of a class ``c`` with a child that has no program without ``c`` (every
    way to compute the child goes through ``c``: ``y = Out(Dropout(y))``), found within each
    cyclic component of at most :data:`MAX_COMPONENT` classes; return how many."""
    classes = list(nodes)
    edges = {c: {ch for i in nodes[c] for ch in children[(c, i)]} for c in classes}
    comp, _ = components(classes, edges)
    members: dict[int, list[int]] = {}
    for c in classes:
        members.setdefault(comp[c], []).append(c)
    dropped = 0
    for group in members.values():
        if len(group) < 2 or len(group) > MAX_COMPONENT:
            continue
        inside = set(group)
        for c in group:
            # The classes of the component buildable without c (outside it: all, by now).
            built: set[int] = set()
            grown = True
            while grown:
                grown = False
                for e in group:
                    if e != c and e not in built and any(
                            all(ch not in inside or ch in built for ch in children[(e, i)]) for i in nodes[e]):
                        built.add(e)
                        grown = True
            kept = [i for i in nodes[c] if all(ch not in inside or ch in built for ch in children[(c, i)])]
            dropped += len(nodes[c]) - len(kept)
            nodes[c] = kept
    stats["cycle_only"] += dropped
    return dropped


def components(classes: list[int], edges: dict[int, set[int]]) -> tuple[dict[int, int], list[int]]:
    """Strongly connected component id of every class (Tarjan's algorithm, iterative), and the
    component ids children first (each component after every component it reaches)."""
    index: dict[int, int] = {}
    low: dict[int, int] = {}
    on_stack: set[int] = set()
    stack: list[int] = []
    comp: dict[int, int] = {}
    order: list[int] = []
    counter = 0
    for start in classes:
        if start in index:
            continue
        work = [(start, iter(sorted(edges.get(start, ()))))]
        index[start] = low[start] = counter
        counter += 1
        stack.append(start)
        on_stack.add(start)
        while work:
            v, it = work[-1]
            advanced = False
            for w in it:
                if w not in index:
                    index[w] = low[w] = counter
                    counter += 1
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, iter(sorted(edges.get(w, ())))))
                    advanced = True
                    break
                if w in on_stack:
                    low[v] = min(low[v], index[w])
            if advanced:
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                order.append(v)
                while True:
                    w = stack.pop()
                    on_stack.discard(w)
                    comp[w] = v
                    if w == v:
                        break
    return comp, order


def _unsubsumed(c: int, idx: list[int], table: CostTable, children: dict[tuple[int, int], tuple[int, ...]],
                keep: set[tuple[int, int]], stats: dict[str, int]) -> list[int]:
    """The e-nodes of class ``c`` that no other e-node subsumes (no dearer, a subset of the
    child classes), the e-nodes of ``keep`` always."""
    if len(idx) < 2:
        return idx
    order = sorted(idx, key=lambda i: (table[c][i], len(children[(c, i)]), i))
    kept: list[int] = []
    for b in order:
        mine = set(children[(c, b)])
        subsumed = any(table[c][a] <= table[c][b] and mine.issuperset(children[(c, a)]) for a in kept)
        if subsumed and (c, b) not in keep:
            stats["subsumed"] += 1
            continue
        kept.append(b)
    return sorted(kept)


def _witness_costs(snapshot: Snapshot, table: CostTable, nodes: dict[int, list[int]],
                   greedy_choice: dict[int, int]) -> dict[tuple[int, int], float]:
    """For each remaining e-node ``m`` of a class with several, ``cost(m) + cost(R(m))`` where
    ``R(m)`` is greedy's program below ``m``'s children, when that is at most the dearest
    e-node of the class (else it could prune nothing); absent when that program is not there
    (a choice missing or pruned, a cycle, or the class itself reached). Each walk stops once
    its cost passes that bound, so it stays short (a program below a deep class is the whole
    model below it)."""
    out: dict[tuple[int, int], float] = {}
    valid = {c: i for c, i in greedy_choice.items() if i in nodes.get(c, ())}
    for c, idx in nodes.items():
        if len(idx) < 2:
            continue
        limit = max(table[c][i] for i in idx)
        for m in idx:
            total = _bounded_program_cost(snapshot, table, valid, snapshot.classes[c][m].children, c,
                                          limit - table[c][m])
            if total is not None:
                out[(c, m)] = table[c][m] + total
    return out


def _bounded_program_cost(snapshot: Snapshot, table: CostTable, choice: dict[int, int], start: tuple[int, ...],
                          avoid: int, limit: float) -> float | None:
    """The cost of the program ``choice`` computes below ``start``, or None when it passes
    ``limit``, is not a program there, or reaches ``avoid``."""
    if limit < 0:
        return None
    walked = _walk_program(snapshot, choice, start, avoid, table, limit)
    return None if walked is None else walked[1]

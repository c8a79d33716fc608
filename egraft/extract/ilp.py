"""Exact DAG extraction as a 0/1 integer program, solved by HiGHS (scipy's copy of it).

**Pruning** (:mod:`egraft.extract.prune`) first drops the e-nodes some optimal program can
do without: self-loops and unextractable e-nodes, those with a child that has no acyclic
program (at all, or without their own class), those subsumed by a no-dearer e-node of their
class with a subset of its children, and those dearer alone than another e-node of their
class together with greedy's program below it. Classes that are a single free leaf (inputs,
constants) get no variable. Greedy's program is never pruned: it is the solver's start.

**Formulation.** One binary ``x_n`` per remaining e-node; ``a_c = sum_{n in c} x_n`` says
whether class ``c`` is computed.

- Classes: ``a_c = 1`` for the outputs and the classes every program computes (below);
  ``a_c <= 1`` for the others.
- Children: for each class ``c`` and child class ``d`` of its e-nodes,
  ``sum_{n in c, d child of n} x_n <= sum_{m in d, c not a child of m} x_m`` (one row per
  pair: ``c`` picks at most one of those e-nodes). Leaving out ``d``'s e-nodes that point
  back at ``c`` rules out every two-class cycle (``A = FromBlocked(B)``, ``B = ToBlocked(A)``:
  the layout conversions; transpose pairs) in the rows themselves, at full LP strength.
- Longer cycles: every simple cycle ``c_1 -> ... -> c_k -> c_1`` (k >= 3) of the class
  graph gets ``sum_i sum_{n in c_i, c_{i+1} child of n} x_n <= k - 1``. With the child rows
  these exclude exactly the cyclic choices. A strongly connected component with more than
  :data:`MAX_CYCLES` simple cycles takes order variables instead (``t_c - t_d >= 1 - M (1 -
  x_n)`` for ``n`` of ``c`` with child ``d`` in the component; weaker in the LP, always few).
- Requirements (valid for every acyclic program, there only to tighten the LP): classes are
  grouped (strongly connected components, joined across conversions: e-nodes whose kernel
  family is a layout change or a view restate their input). A group computed at all has an
  *entry* chosen: an e-node with no child in the group (the program restricted to the group
  has a sink). :func:`requirements` finds the groups every program of the outputs computes
  (``sum_{entries of g} x_n >= 1``; ``a_c = 1`` for a one-class group), ties every class of
  a group to its entries (``sum_{entries} x_n >= a_c``), and for the other classes the
  nearby groups all their programs compute (``sum_{entries of g} x_n >= a_c``).
- Objective: ``sum cost(n) x_n``. A shared class is one set of variables, so it is paid
  once: the objective is the DAG cost.

Why the requirements: the child rows only say ``a_d >= x_n`` for each e-node ``n`` needing
``d``. Where a class's alternatives reach the same class by different paths
(``Relu(Conv(x))`` against ``FusedConv(x)``, NCHW against blocked), the LP takes part of
each and needs the shared class only at the largest part; level after level its bound
shrinks. The former formulation (these child rows per e-node, order variables on every
cyclic component, which let the two-class conversion cycles stand in for real programs
nearly for free) had root LP bounds of 3.5 for vgg19 under ``nodes`` (optimum 26), 3.2 for
densenet121 (186) and 0.5% of the optimum for resnet50 under the CPU roofline; HiGHS could
not close those gaps within 30 s on most bundled models once the blocked Sum rules were in.
This one's bounds: 26, 185 and 48%.

**Solving.** HiGHS starts from greedy's program (an incumbent from the first node: the
search prunes against it, and a stopped search holds a program at least that cheap),
through scipy's bundled HiGHS bindings; where those are missing, ``scipy.optimize.milp``
(no start: greedy's program is kept when the ILP's is not cheaper). The answer is
``optimal`` when the relative gap is under :data:`MIP_REL_GAP`; when the time limit stops
HiGHS the status says so and ``gap`` is the relative gap between the program's cost and the
proven lower bound. The chosen program is checked (every chosen e-node's children chosen,
no cycle) and priced again by :func:`egraft.extract.program.dag_cost`; it is never dearer
than greedy's.

Example:
    >>> ex = extract_ilp(snapshot, NodeCount(), roots, time_limit=30)   # doctest: +SKIP
    >>> ex.status, ex.gap, ex.problem["warm_start"]                     # doctest: +SKIP
    ('optimal', 0.0, True)
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
from scipy.sparse import coo_matrix, csc_matrix

from egraft.extract import prune as pruning
from egraft.extract.cost import FREE_OPS, CostModel
from egraft.extract.greedy import extract_greedy
from egraft.extract.program import Extraction, dag_cost
from egraft.extract.prune import Candidates, candidates, components, program_closure
from egraft.rewrite.egraph import Snapshot

#: HiGHS stops when the relative gap falls under this (the answer is then called optimal).
MIP_REL_GAP = 1e-6
#: Simple cycles enumerated per strongly connected component before order variables take over.
MAX_CYCLES = 200
#: How many levels below a class :func:`requirements` looks for the groups it requires.
REQUIREMENT_DEPTH = 4


@dataclass
class Formulation:
    """The integer program: ``min cost @ x`` subject to ``lower <= matrix @ x <= upper`` and
    ``bounds``, the first ``len(nodes)`` variables binary (one per e-node), the rest the
    order variables of large cyclic components.

    Attributes:
        nodes: (e-class, e-node index) of each binary variable.
        start: greedy's program as a solution vector (None when greedy's is not one).
        stats: sizes, for ``Extraction.problem``.
    """

    cost: np.ndarray
    matrix: csc_matrix
    lower: np.ndarray
    upper: np.ndarray
    bounds: tuple[np.ndarray, np.ndarray]
    integrality: np.ndarray
    nodes: list[tuple[int, int]]
    start: np.ndarray | None = None
    stats: dict = field(default_factory=dict)


class _Rows:
    """Sparse rows ``low <= sum val * x[col] <= high``, gathered as COO triplets."""

    def __init__(self) -> None:
        self.rows: list[int] = []
        self.cols: list[int] = []
        self.vals: list[float] = []
        self.lo: list[float] = []
        self.hi: list[float] = []

    def add(self, entries: list[tuple[int, float]], low: float, high: float) -> None:
        r = len(self.lo)
        for col, val in entries:
            self.rows.append(r)
            self.cols.append(col)
            self.vals.append(val)
        self.lo.append(low)
        self.hi.append(high)


def requirements(cands: Candidates, classes: list[int], comp: dict[int, int], order: list[int],
                 group: dict[int, int], depth: int = REQUIREMENT_DEPTH) -> tuple[dict[int, list[int]], list[int]]:
    """What every program computes, by groups of classes (``group``: class -> group id, a
    partition coarser than the strongly connected components ``comp``, whose ids ``order``
    lists children first): the groups every program of the outputs computes a class of, and
    for each other class ``c``, the groups every program of ``c`` computes a class of, found
    within ``depth`` levels below ``c`` and not already implied by a child all of ``c``'s
    e-nodes share or by another such group.

    ``R(c) = AND_{n in c} OR_{d child of n} ({group(d)} | R(d))`` (bit sets over the groups,
    children first): a program of ``c`` picks some ``n``, computes each child ``d`` and a
    program of ``d``. Within a cyclic component the programs of a child avoid the classes
    above it (a program is acyclic), so ``A = FromBlocked(B)`` sees only the e-nodes of ``B``
    other than ``ToBlocked(A)``; a component of more than
    :data:`egraft.extract.prune.MAX_COMPONENT` classes takes the plain least fixpoint
    (sound, weaker)."""
    is_var = set(classes)
    comp_members: dict[int, list[int]] = {}
    group_members: dict[int, list[int]] = {}
    for c in classes:
        comp_members.setdefault(comp[c], []).append(c)
        group_members.setdefault(group[c], []).append(c)
    gids = sorted(group_members)
    bit = {g: 1 << k for k, g in enumerate(gids)}
    req: dict[int, int] = {}
    memo: dict[tuple[int, frozenset[int]], int] = {}

    def needs(c: int, i: int, path: frozenset[int]) -> int:
        """What e-node ``i`` of ``c`` requires (its child classes' groups and theirs)."""
        out = 0
        for d in cands.children[(c, i)]:
            if d in is_var:
                out |= bit[group[d]] | (within(d, path | {c}) if comp[d] == comp[c] else req[d])
        return out

    def within(c: int, path: frozenset[int]) -> int:
        """``R(c)`` over the programs of ``c`` that avoid the classes of ``path`` (its
        ancestors in its own component); -1 (every bit: no constraint on an intersection)
        when there is none."""
        key = (c, path)
        if key not in memo:
            total = -1
            for i in cands.nodes[c]:
                if not path.intersection(cands.children[(c, i)]):
                    total &= needs(c, i, path)
            memo[key] = total
        return memo[key]

    for cid in order:
        members = comp_members[cid]
        if len(members) <= pruning.MAX_COMPONENT:
            for c in members:
                req[c] = within(c, frozenset())
            for c in members:
                req[c] = 0 if req[c] == -1 else req[c]
            continue
        for c in members:  # a large component: the least fixpoint
            req[c] = 0
        changed = True
        while changed:
            changed = False
            for c in members:
                total = -1
                for i in cands.nodes[c]:
                    q = 0
                    for d in cands.children[(c, i)]:
                        if d in is_var:
                            q |= bit[group[d]] | req[d]
                    total &= q
                total = 0 if total == -1 else total
                if total != req[c]:
                    req[c] = total
                    changed = True

    def entries(g: int) -> list[tuple[int, int]]:
        inside = set(group_members[g])
        return [(e, i) for e in group_members[g] for i in cands.nodes[e]
                if not inside.intersection(cands.children[(e, i)])]

    # The groups every program of the outputs computes a class of: those of the forced classes
    # and what every entry e-node of such a group needs (a group computed at all has an
    # entry chosen: the program restricted to the group has a sink).
    touched = 0
    work = []
    for c in cands.forced:
        if c in is_var and not touched & bit[group[c]]:
            touched |= bit[group[c]]
            work.append(group[c])
    while work:
        g = work.pop()
        common = -1
        for e, i in entries(g):
            common &= needs(e, i, frozenset())
        if common == -1:
            continue
        new = common & ~touched
        touched |= common
        work.extend(h for h in gids if new & bit[h])
    forced_groups = [g for g in gids if touched & bit[g]]

    group_req: dict[int, int] = {}  # group -> what every class of it requires, and itself
    for g, members in group_members.items():
        r = -1
        for c in members:
            r &= req[c]
        group_req[g] = r | bit[g]
    by_bit = {b.bit_length() - 1: g for g, b in bit.items()}
    out: dict[int, list[int]] = {}
    for c in classes:
        if req[c] == 0 or c in cands.forced or (len(group_members[group[c]]) == 1 and touched & bit[group[c]]):
            continue
        near = 0  # the groups within ``depth`` levels
        frontier = {c}
        seen = {c}
        for _ in range(depth):
            nxt = set()
            for a in frontier:
                for i in cands.nodes[a]:
                    for d in cands.children[(a, i)]:
                        if d in is_var and d not in seen:
                            seen.add(d)
                            nxt.add(d)
                            near |= bit[group[d]]
            frontier = nxt
        common_kids = None
        for i in cands.nodes[c]:
            kids = {d for d in cands.children[(c, i)] if d in is_var}
            common_kids = kids if common_kids is None else common_kids & kids
        implied = 0
        for d in common_kids or ():
            implied |= bit[group[d]] | req[d]
        candidates_ = req[c] & near & ~implied & ~bit[group[c]] & ~touched
        picked = []
        while candidates_:
            low = candidates_ & -candidates_
            picked.append(by_bit[low.bit_length() - 1])
            candidates_ ^= low
        below = 0
        for g in picked:
            below |= group_req[g] & ~bit[g]
        picked = [g for g in picked if not below & bit[g]]
        if picked:
            out[c] = picked
    return out, forced_groups


def simple_cycles(members: list[int], edges: dict[int, set[int]], limit: int = 200) -> list[list[int]] | None:
    """Every simple cycle of length >= 3 within ``members`` (one strongly connected component),
    each listed once from its smallest class; None when there are more than ``limit`` or the
    search takes more than ``100 * limit`` steps.

    Example:
        >>> simple_cycles([1, 2, 3], {1: {2}, 2: {1, 3}, 3: {1}})
        [[1, 2, 3]]
    """
    inside = set(members)
    cycles: list[list[int]] = []
    steps = 0
    for s in sorted(members):
        path = [s]
        on_path = {s}
        work = [iter(sorted(w for w in edges.get(s, ()) if w in inside and w >= s))]
        while work:
            steps += 1
            if steps > 100 * limit:
                return None
            w = next(work[-1], None)
            if w is None:
                work.pop()
                on_path.discard(path.pop())
                continue
            if w == s:
                if len(path) >= 3:
                    cycles.append(list(path))
                    if len(cycles) > limit:
                        return None
                continue
            if w in on_path:
                continue
            path.append(w)
            on_path.add(w)
            work.append(iter(sorted(x for x in edges.get(w, ()) if x in inside and x >= s)))
    return cycles


def _groups(classes: list[int], comp: dict[int, int], cands: Candidates,
            same_value: Callable[[int, int], bool] | None) -> dict[int, int]:
    """A partition of ``classes``: their strongly connected components, joined where an e-node
    ``(c, i)`` with one child class ``d`` holds ``same_value(c, i)`` (union-find; a group is
    named by its smallest class)."""
    parent = {c: c for c in classes}

    def find(c: int) -> int:
        while parent[c] != c:
            parent[c] = parent[parent[c]]
            c = parent[c]
        return c

    def union(a: int, b: int) -> None:
        ra, rb = find(a), find(b)
        if ra != rb:
            parent[max(ra, rb)] = min(ra, rb)

    for c in classes:
        union(c, comp[c])
    if same_value is not None:
        for c in classes:
            for i in cands.nodes[c]:
                kids = [d for d in cands.children[(c, i)] if d in parent]
                if len(kids) == 1 and same_value(c, i):
                    union(c, kids[0])
    return {c: find(c) for c in classes}


def formulate(table: dict[int, list[float]], cands: Candidates, start_choice: dict[int, int] | None = None,
              max_cycles: int | None = None, same_value: Callable[[int, int], bool] | None = None,
              require: bool = True) -> Formulation:
    """The integer program over ``cands`` (see the module docstring), and ``start_choice``
    (greedy's program: class -> e-node index) as a start vector when it is one of its
    solutions."""
    var_classes = [c for c in sorted(cands.nodes) if c not in cands.fixed]
    var_of: dict[tuple[int, int], int] = {}
    nodes: list[tuple[int, int]] = []
    for c in var_classes:
        for i in cands.nodes[c]:
            var_of[(c, i)] = len(nodes)
            nodes.append((c, i))
    is_var = set(var_classes)
    edges: dict[int, set[int]] = {c: set() for c in var_classes}
    for c, i in nodes:
        edges[c].update(ch for ch in cands.children[(c, i)] if ch in is_var)
    comp, order = components(var_classes, edges)
    members: dict[int, list[int]] = {}
    for c in var_classes:
        members.setdefault(comp[c], []).append(c)
    cyclic = {c for group in members.values() if len(group) > 1 for c in group}

    def activity(c: int, skip: int | None = None) -> list[tuple[int, float]]:
        """``sum_{n in c} x_n`` (leaving out the e-nodes with child ``skip``) as row entries."""
        return [(var_of[(c, i)], 1.0) for i in cands.nodes[c] if skip is None or skip not in cands.children[(c, i)]]

    rows = _Rows()
    class_row: dict[int, int] = {}
    for c in var_classes:
        class_row[c] = len(rows.lo)
        rows.add(activity(c), 1.0 if c in cands.forced else 0.0, 1.0)
    two_cycle_rows = 0
    for c in var_classes:
        users: dict[int, list[int]] = {}  # child class -> the e-nodes of c that need it
        for i in cands.nodes[c]:
            for d in cands.children[(c, i)]:
                if d in is_var:
                    users.setdefault(d, []).append(var_of[(c, i)])
        for d, vs in sorted(users.items()):
            safe = activity(d, skip=c)
            if len(safe) == len(cands.nodes[d]):
                if d in cands.forced:
                    continue  # d is always chosen: the row holds
            else:
                two_cycle_rows += 1
            rows.add(safe + [(v, -1.0) for v in vs], 0.0, np.inf)
    # Requirements, by groups of classes: the components, joined where an e-node converts one
    # class into another (``same_value``: a layout change, a view).
    group = _groups(var_classes, comp, cands, same_value)
    group_members: dict[int, list[int]] = {}
    for c in var_classes:
        group_members.setdefault(group[c], []).append(c)
    needed, forced_groups = requirements(cands, var_classes, comp, order, group) if require else ({}, [])
    entry_rows: dict[int, list[tuple[int, float]]] = {}
    for g, members_ in group_members.items():
        inside = set(members_)
        entry_rows[g] = [(var_of[(e, i)], 1.0) for e in members_ for i in cands.nodes[e]
                         if not inside.intersection(cands.children[(e, i)])]
    requirement_rows = 0
    for g in forced_groups:
        if len(group_members[g]) == 1:
            c = group_members[g][0]
            rows.lo[class_row[c]] = 1.0
        else:
            rows.add(entry_rows[g], 1.0, np.inf)
            requirement_rows += 1
    for g, members_ in group_members.items():
        if len(members_) > 1 and require:
            for e in members_:
                rows.add(entry_rows[g] + [(v, -1.0) for v, _ in activity(e)], 0.0, np.inf)
                requirement_rows += 1
    for c, groups in needed.items():
        for g in groups:
            rows.add(entry_rows[g] + [(v, -1.0) for v, _ in activity(c)], 0.0, np.inf)
            requirement_rows += 1

    cycle_rows = 0
    ordered: list[list[int]] = []  # components left to order variables
    for group in members.values():
        if len(group) < 3:
            continue  # a two-class component's only cycle is ruled out by its child rows
        cycles = simple_cycles(group, edges, MAX_CYCLES if max_cycles is None else max_cycles)
        if cycles is None:
            ordered.append(sorted(group))
            continue
        for cycle in cycles:
            entries = []
            for k, a in enumerate(cycle):
                b = cycle[(k + 1) % len(cycle)]
                entries += [(var_of[(a, i)], 1.0) for i in cands.nodes[a] if b in cands.children[(a, i)]]
            rows.add(entries, -np.inf, float(len(cycle) - 1))
            cycle_rows += 1
    order_var: dict[int, int] = {}
    order_upper: list[float] = []
    for group in ordered:
        for c in group:
            order_var[c] = len(nodes) + len(order_upper)
            order_upper.append(float(len(group) - 1))
    for c, i in nodes:
        if c not in order_var:
            continue
        big = float(len(members[comp[c]]))
        for d in cands.children[(c, i)]:
            if d in order_var and comp[d] == comp[c]:
                # t_c - t_d - big * x_n >= 1 - big
                rows.add([(order_var[c], 1.0), (order_var[d], -1.0), (var_of[(c, i)], -big)], 1.0 - big, np.inf)

    n_vars = len(nodes) + len(order_upper)
    cost = np.zeros(n_vars)
    for v, (c, i) in enumerate(nodes):
        cost[v] = float(table[c][i])
    matrix = coo_matrix((rows.vals, (rows.rows, rows.cols)), shape=(len(rows.lo), n_vars)).tocsc()
    upper_bounds = np.concatenate([np.ones(len(nodes)), np.array(order_upper)])
    integrality = np.concatenate([np.ones(len(nodes)), np.zeros(len(order_upper))])
    stats = {"variables": n_vars, "constraints": len(rows.lo), "cyclic_eclasses": len(cyclic),
             "two_cycle_rows": two_cycle_rows, "cycle_rows": cycle_rows,
             "requirement_rows": requirement_rows, "order_variables": len(order_upper)}
    form = Formulation(cost, matrix, np.array(rows.lo), np.array(rows.hi), (np.zeros(n_vars), upper_bounds),
                       integrality, nodes, None, stats)
    if start_choice is not None:
        form.start = _start_vector(form, var_of, order_var, start_choice, cands)
    return form


def _start_vector(form: Formulation, var_of: dict[tuple[int, int], int], order_var: dict[int, int],
                  choice: dict[int, int], cands: Candidates) -> np.ndarray | None:
    """``choice`` (a program: class -> e-node index) as a solution of ``form``, its order
    variables set to each class's height in the program; None if it is not a solution."""
    x = np.zeros(len(form.cost))
    for c, i in choice.items():
        if c in cands.fixed:
            continue
        v = var_of.get((c, i))
        if v is None:
            return None
        x[v] = 1.0
    height: dict[int, int] = {}
    # Heights in the program, children first (the program is acyclic).
    pending = [c for c in order_var if c in choice]
    while pending:
        c = pending[-1]
        kids = [d for d in cands.children[(c, choice[c])] if d in order_var and d in choice and d not in height]
        if kids:
            pending.extend(kids)
            continue
        pending.pop()
        height[c] = 1 + max((height[d] for d in cands.children[(c, choice[c])] if d in order_var and d in height),
                            default=-1)
    for c, v in order_var.items():
        x[v] = float(height.get(c, 0))
    activity = form.matrix @ x
    tol = 1e-9
    if np.any(activity < form.lower - tol) or np.any(activity > form.upper + tol):
        return None
    return x


@dataclass
class _Outcome:
    """What HiGHS returned: a solution (or None), whether the time limit stopped it, its
    proven lower bound and, when it failed, why."""

    x: np.ndarray | None
    limited: bool
    bound: float | None
    message: str = ""
    started: bool = False


def _highs_bindings():
    """scipy's bundled HiGHS bindings (``scipy.optimize._highspy._core``, scipy >= 1.15: the
    one way to hand HiGHS a start from scipy), or None."""
    try:
        from scipy.optimize._highspy import _core
    except ImportError:
        return None
    return _core if hasattr(_core._Highs, "setSolution") else None


def solve(form: Formulation, time_limit: float) -> _Outcome:
    """Solve ``form`` with HiGHS from its start vector (scipy's bundled bindings), or with
    ``scipy.optimize.milp`` and no start where those are missing."""
    if form.matrix.shape[1] == 0:
        return _Outcome(np.zeros(0), False, 0.0)  # nothing to choose: the outputs are leaves
    highs = _highs_bindings()
    if highs is None:
        return _solve_milp(form, time_limit)
    h = highs._Highs()
    for name, value in (("output_flag", False), ("time_limit", float(time_limit)), ("mip_rel_gap", MIP_REL_GAP),
                        ("random_seed", 0)):
        h.setOptionValue(name, value)
    lp = highs.HighsLp()
    n_rows, n_cols = form.matrix.shape
    lp.num_col_ = n_cols
    lp.num_row_ = n_rows
    lp.col_cost_ = form.cost
    lp.col_lower_ = form.bounds[0]
    lp.col_upper_ = form.bounds[1]
    lp.row_lower_ = form.lower
    lp.row_upper_ = form.upper
    lp.a_matrix_.format_ = highs.MatrixFormat.kColwise
    lp.a_matrix_.num_col_ = n_cols
    lp.a_matrix_.num_row_ = n_rows
    lp.a_matrix_.start_ = form.matrix.indptr
    lp.a_matrix_.index_ = form.matrix.indices
    lp.a_matrix_.value_ = form.matrix.data
    lp.integrality_ = [highs.HighsVarType.kInteger if k else highs.HighsVarType.kContinuous
                       for k in form.integrality]
    if h.passModel(lp) == highs.HighsStatus.kError:
        return _Outcome(None, False, None, "HiGHS refused the model")
    started = False
    if form.start is not None:
        solution = highs.HighsSolution()
        solution.col_value = list(form.start)
        started = h.setSolution(solution) != highs.HighsStatus.kError
    h.run()
    status = h.getModelStatus()
    info = h.getInfo()
    bound = float(info.mip_dual_bound) if np.isfinite(info.mip_dual_bound) else None
    limited = status in (highs.HighsModelStatus.kTimeLimit, highs.HighsModelStatus.kIterationLimit,
                         highs.HighsModelStatus.kSolutionLimit, highs.HighsModelStatus.kInterrupt)
    has_x = info.primal_solution_status == highs.kSolutionStatusFeasible
    if status != highs.HighsModelStatus.kOptimal and not (limited and has_x):
        return _Outcome(None, limited, bound, h.modelStatusToString(status), started)
    return _Outcome(np.array(h.getSolution().col_value), limited, bound, "", started)


def _solve_milp(form: Formulation, time_limit: float) -> _Outcome:
    from scipy.optimize import Bounds, LinearConstraint, milp

    result = milp(form.cost, constraints=LinearConstraint(form.matrix, form.lower, form.upper),
                  integrality=form.integrality, bounds=Bounds(*form.bounds),
                  options={"time_limit": time_limit, "disp": False, "mip_rel_gap": MIP_REL_GAP})
    bound = getattr(result, "mip_dual_bound", None)
    bound = None if bound is None or not np.isfinite(bound) else float(bound)
    return _Outcome(result.x, result.status == 1, bound, "" if result.x is not None else result.message)


#: Kernel families whose ops give their input again in another form (a layout, a shape).
SAME_VALUE_FAMILIES = ("layout", "view")


def conversions(snapshot: Snapshot, model: CostModel) -> Callable[[int, int], bool]:
    """Whether e-node ``i`` of class ``c`` only restates its input (its kernel family, as
    ``model`` prices it, is one of :data:`SAME_VALUE_FAMILIES`: ``LayoutToBlocked``,
    ``Transpose``, ``Reshape``...), asked once per op."""
    families: dict[tuple[str, str], bool] = {}

    def test(c: int, i: int) -> bool:
        n = snapshot.classes[c][i]
        key = (n.op, n.domain)
        if key not in families:
            families[key] = n.op not in FREE_OPS and model.work(snapshot, c, n).family in SAME_VALUE_FAMILIES
        return families[key]

    return test


def extract_ilp(snapshot: Snapshot, model: CostModel, roots: list[int], time_limit: float = 30.0,
                greedy: Extraction | None = None, prune: bool = True,
                same_value: Callable[[int, int], bool] | None = None) -> Extraction:
    """The cheapest program of ``roots`` under ``model``, exactly (or the best HiGHS finds
    within ``time_limit`` seconds, never worse than greedy).

    Args:
        snapshot: the e-graph.
        model: the cost model (also says which e-nodes are conversions: :func:`conversions`).
        roots: the output e-classes.
        time_limit: seconds for everything (pruning, formulating and HiGHS).
        greedy: greedy's extraction, when the caller has it already.
        prune: False keeps every e-node that can be in a program (tests compare the two).
        same_value: whether e-node ``i`` of class ``c`` restates its one child class, for
            grouping the requirement rows (default: :func:`conversions` under ``model``).

    ``problem`` in the answer records the sizes: variables, constraints, e-classes (and those
    in cycles), what each pruning step removed, the rows of each kind, whether HiGHS took
    greedy's program as its start (all of it the same from run to run: plans record it)."""
    start = time.perf_counter()
    greedy = greedy or extract_greedy(snapshot, model, roots)
    table = greedy.table
    program = program_closure(snapshot, greedy.choice, list(roots))
    start_choice = None if program is None else {c: greedy.choice[c] for c in program}
    keep = set() if start_choice is None else set(start_choice.items())
    cands = candidates(snapshot, table, roots, keep, greedy.choice if prune else None, dominance=prune)
    if same_value is None and model is not None and isinstance(snapshot, Snapshot):
        same_value = conversions(snapshot, model)
    form = formulate(table, cands, start_choice, same_value=same_value)
    problem = {"variables": form.stats["variables"], "constraints": form.stats["constraints"],
               "eclasses": cands.stats["eclasses"], "cyclic_eclasses": form.stats["cyclic_eclasses"],
               "pruned_self_loops": cands.stats["self_loops"], "pruned": {k: v for k, v in cands.stats.items()
                                                                         if k not in ("enodes", "eclasses")},
               "enodes": cands.stats["enodes"], "fixed_eclasses": len(cands.fixed),
               "two_cycle_rows": form.stats["two_cycle_rows"], "cycle_rows": form.stats["cycle_rows"],
               "order_variables": form.stats["order_variables"], "requirement_rows": form.stats["requirement_rows"],
               "warm_start": False}
    if any(not cands.nodes.get(r) for r in roots):
        return _greedy_kept(greedy, "greedy fallback: an output has no acyclic program", None, start, problem)
    remaining = max(time_limit - (time.perf_counter() - start), 0.1)
    outcome = solve(form, remaining)
    problem["warm_start"] = outcome.started
    limited, bound = outcome.limited, outcome.bound
    if outcome.x is None:
        status = ("time limit: no program found yet, greedy's kept" if limited
                  else f"greedy fallback: HiGHS: {outcome.message}")
        return _greedy_kept(greedy, status, bound, start, problem)
    choice: dict[int, int] = dict(greedy.choice)  # classes the ILP leaves unchosen keep greedy's pick
    choice.update(cands.fixed)
    for v in np.flatnonzero(outcome.x[: len(form.nodes)] > 0.5):
        c, i = form.nodes[v]
        choice[c] = i
    if program_closure(snapshot, choice, list(roots)) is None:
        return _greedy_kept(greedy, "greedy fallback: the ILP's program was not valid", bound, start, problem)
    total = dag_cost(snapshot, choice, roots, table)
    if total > greedy.cost:
        if total - greedy.cost <= 1e-9 * max(1.0, abs(float(greedy.cost))):
            # The same cost, summed in another order: keep greedy's program.
            return _greedy_kept(greedy, "time limit" if limited else "optimal", bound, start, problem,
                                gap=None if limited else 0.0)
        status = ("time limit: greedy's program kept, cheaper than the ILP's best so far" if limited
                  else "greedy fallback: the ILP's program was dearer")
        return _greedy_kept(greedy, status, bound, start, problem)
    return Extraction(choice, total, "ilp", "time limit" if limited else "optimal",
                      _gap(total, bound) if limited else 0.0, time.perf_counter() - start, table,
                      greedy.alternatives, bound, problem)


def _greedy_kept(greedy: Extraction, status: str, bound: float | None, start: float, problem: dict,
                 gap: float | None = None) -> Extraction:
    """Greedy's program as the ILP's answer, with why."""
    return Extraction(greedy.choice, greedy.cost, "ilp", status, _gap(greedy.cost, bound) if gap is None else gap,
                      time.perf_counter() - start, greedy.table, greedy.alternatives, bound, problem)


def _gap(cost: float, bound: float | None) -> float | None:
    """The relative gap between a program's cost and a proven lower bound."""
    if bound is None:
        return None
    return max(0.0, (float(cost) - bound) / max(abs(float(cost)), 1e-12))

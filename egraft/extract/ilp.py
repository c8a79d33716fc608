"""Exact DAG extraction as a 0/1 integer program, solved by HiGHS (``scipy.optimize.milp``).

One binary ``x_n`` per e-node of the e-classes the outputs can reach:

- each output e-class chooses exactly one e-node: ``sum_{n in c} x_n = 1``;
- every other e-class chooses at most one: ``sum_{n in c} x_n <= 1``;
- a chosen e-node needs each child e-class chosen: ``sum_{m in child} x_m >= x_n``;
- objective: ``sum cost(n) x_n``. A shared e-class is one set of variables, so it is
  paid once: the objective is the DAG cost.

Cycles: an e-node whose child is its own e-class is pruned up front (it can never be in
a program); the e-classes of every other cycle (strongly connected components of the
class graph) get an order variable ``t_c`` and a chosen e-node must sit strictly above
its children of the same component: ``t_c - t_child >= 1 - M (1 - x_n)``.

Fallback: scipy's HiGHS interface takes no initial solution, so the greedy program (which
is always feasible) is returned when the time limit stops HiGHS before it has a program,
and wins when the ILP's program is not cheaper. (A cut-off row ``cost <= greedy cost`` was
tried as a substitute warm start: it made HiGHS 1.2-7x slower on the bundled models, a
dense row that weakens its cuts, and is not used.) When the limit stops HiGHS, the status
says so and ``gap`` is the relative gap between the program's cost and HiGHS's proven
lower bound.

Example:
    >>> ex = extract_ilp(snapshot, NodeCount(), roots, time_limit=30)   # doctest: +SKIP
    >>> ex.status, ex.gap                                               # doctest: +SKIP
    ('optimal', 0.0)
"""

from __future__ import annotations

import math
import time

import numpy as np
from scipy.optimize import Bounds, LinearConstraint, milp
from scipy.sparse import coo_matrix

from egraft.extract.cost import CostModel
from egraft.extract.greedy import extract_greedy
from egraft.extract.program import Extraction, dag_cost
from egraft.rewrite.egraph import Snapshot

#: HiGHS stops when the relative gap falls under this (the answer is then called optimal).
MIP_REL_GAP = 1e-6


def _reachable_classes(snapshot: Snapshot, roots: list[int]) -> list[int]:
    seen: set[int] = set()
    stack = list(roots)
    while stack:
        c = stack.pop()
        if c in seen:
            continue
        seen.add(c)
        for n in snapshot.classes[c]:
            stack.extend(ch for ch in n.children if ch not in seen)
    return sorted(seen)


def _components(classes: list[int], edges: dict[int, set[int]]) -> dict[int, int]:
    """Strongly connected component id of every class (Tarjan's algorithm, iterative)."""
    index: dict[int, int] = {}
    low: dict[int, int] = {}
    on_stack: set[int] = set()
    stack: list[int] = []
    comp: dict[int, int] = {}
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
                while True:
                    w = stack.pop()
                    on_stack.discard(w)
                    comp[w] = v
                    if w == v:
                        break
    return comp


def extract_ilp(snapshot: Snapshot, model: CostModel, roots: list[int], time_limit: float = 30.0,
                greedy: Extraction | None = None) -> Extraction:
    """The cheapest program of ``roots`` under ``model``, exactly (or the best HiGHS finds
    within ``time_limit`` seconds, never worse than greedy)."""
    start = time.perf_counter()
    greedy = greedy or extract_greedy(snapshot, model, roots)
    table = greedy.table
    classes = _reachable_classes(snapshot, roots)
    # Variables: e-nodes that are not self-loops.
    var_of: dict[tuple[int, int], int] = {}
    nodes: list[tuple[int, int]] = []
    self_loops = 0
    for c in classes:
        for i, n in enumerate(snapshot.classes[c]):
            if c in n.children:
                self_loops += 1
                continue
            if table[c][i] == math.inf:
                continue  # an e-node extraction must not pick (cost.unextractable)
            var_of[(c, i)] = len(nodes)
            nodes.append((c, i))
    class_vars: dict[int, list[int]] = {c: [] for c in classes}
    for (c, _), v in var_of.items():
        class_vars[c].append(v)
    edges: dict[int, set[int]] = {c: set() for c in classes}
    for c, i in nodes:
        edges[c].update(snapshot.classes[c][i].children)
    comp = _components(classes, edges)
    comp_size: dict[int, int] = {}
    for c in classes:
        comp_size[comp[c]] = comp_size.get(comp[c], 0) + 1
    cyclic = [c for c in classes if comp_size[comp[c]] > 1]
    order_var = {c: len(nodes) + k for k, c in enumerate(cyclic)}
    n_vars = len(nodes) + len(cyclic)

    rows, cols, vals, lo, hi = [], [], [], [], []

    def add_row(entries: list[tuple[int, float]], low: float, high: float) -> None:
        r = len(lo)
        for col, val in entries:
            rows.append(r)
            cols.append(col)
            vals.append(val)
        lo.append(low)
        hi.append(high)

    root_set = set(roots)
    for c in classes:
        entries = [(v, 1.0) for v in class_vars[c]]
        add_row(entries, 1.0 if c in root_set else 0.0, 1.0)
    for (c, i), v in var_of.items():
        for ch in sorted(set(snapshot.classes[c][i].children)):
            add_row([(m, 1.0) for m in class_vars[ch]] + [(v, -1.0)], 0.0, np.inf)
            if ch in order_var and comp[ch] == comp[c]:
                big = float(comp_size[comp[c]])
                # t_c - t_ch - big * x_n >= 1 - big
                add_row([(order_var[c], 1.0), (order_var[ch], -1.0), (v, -big)], 1.0 - big, np.inf)
    cost = np.zeros(n_vars)
    for (c, i), v in var_of.items():
        cost[v] = float(table[c][i])
    matrix = coo_matrix((vals, (rows, cols)), shape=(len(lo), n_vars)).tocsr()
    integrality = np.concatenate([np.ones(len(nodes)), np.zeros(len(cyclic))])
    upper = np.concatenate([np.ones(len(nodes)), np.full(len(cyclic), float(max(comp_size.values(), default=1)))])
    problem = {"variables": n_vars, "constraints": len(lo), "eclasses": len(classes), "cyclic_eclasses": len(cyclic),
               "pruned_self_loops": self_loops}
    remaining = max(time_limit - (time.perf_counter() - start), 0.1)
    result = milp(cost, constraints=LinearConstraint(matrix, lo, hi), integrality=integrality,
                  bounds=Bounds(np.zeros(n_vars), upper),
                  options={"time_limit": remaining, "disp": False, "mip_rel_gap": MIP_REL_GAP})
    seconds = time.perf_counter() - start
    bound = getattr(result, "mip_dual_bound", None)
    bound = None if bound is None or not np.isfinite(bound) else float(bound)
    limited = result.status == 1  # HiGHS stopped at the time limit
    if result.x is None:
        status = ("time limit: no program found yet, greedy's kept" if limited
                  else f"greedy fallback: HiGHS: {result.message}")
        return Extraction(greedy.choice, greedy.cost, "ilp", status, _gap(greedy.cost, bound), seconds, table,
                          greedy.alternatives, bound, problem)
    chosen = result.x[: len(nodes)] > 0.5
    choice: dict[int, int] = dict(greedy.choice)  # classes the ILP leaves unchosen keep greedy's pick
    for v in np.flatnonzero(chosen):
        c, i = nodes[v]
        choice[c] = i
    total = dag_cost(snapshot, choice, roots, table)
    if total > greedy.cost:
        if total - greedy.cost <= 1e-9 * max(1.0, abs(float(greedy.cost))):
            # The same cost, summed in another order: keep greedy's program.
            return Extraction(greedy.choice, greedy.cost, "ilp", "time limit" if limited else "optimal",
                              _gap(greedy.cost, bound) if limited else 0.0, seconds, table, greedy.alternatives,
                              bound, problem)
        status = ("time limit: greedy's program kept, cheaper than the ILP's best so far" if limited
                  else "greedy fallback: the ILP's program was dearer")
        return Extraction(greedy.choice, greedy.cost, "ilp", status, _gap(greedy.cost, bound), seconds, table,
                          greedy.alternatives, bound, problem)
    return Extraction(choice, total, "ilp", "time limit" if limited else "optimal",
                      _gap(total, bound) if limited else 0.0, seconds, table, greedy.alternatives, bound, problem)


def _gap(cost: float, bound: float | None) -> float | None:
    """The relative gap between a program's cost and a proven lower bound."""
    if bound is None:
        return None
    return max(0.0, (float(cost) - bound) / max(abs(float(cost)), 1e-12))

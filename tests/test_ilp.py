"""The exact extractor's pruning and formulation (egraft/extract/prune.py, egraft/extract/ilp.py):
pruning never loses the optimum and the strengthened rows never cut off a program, checked
against brute force and the unpruned ILP on random e-graphs (with cycles, layout-conversion
pairs and fusion shortcuts), also through scipy.optimize.milp where scipy's HiGHS bindings
are missing; the LP relaxation's bound is the optimum on a chain of layout and fusion choices
(under a quarter of it without the requirement rows); each pruning step on an e-graph made
for it; a bundled model solved to optimality from greedy's start."""

from __future__ import annotations

import itertools
import math
import random
from types import SimpleNamespace

import numpy as np
import onnx
import pytest
from scipy.optimize import Bounds, LinearConstraint, milp

import egraft
from egraft.extract import ilp, prune
from egraft.extract.cost import cost_model
from egraft.extract.extractor import extract
from egraft.extract.greedy import greedy_choice
from egraft.extract.program import Extraction, dag_cost, rebuild_graph
from egraft.extract.prune import candidates, program_closure
from egraft.optimize import optimize
from egraft.rewrite.egraph import ENode


def _egraph(classes: dict[int, list[tuple]], roots: list[int]):
    """An e-graph from ``class -> [(op, cost, children)]``: a stand-in snapshot (the extractors
    read only its classes), the cost table and the roots."""
    snap = SimpleNamespace(classes={c: [ENode(op, "", f"{c}.{k}", tuple(kids)) for k, (op, _, kids) in enumerate(ns)]
                                    for c, ns in classes.items()})
    table = {c: [cost for _, cost, _ in ns] for c, ns in classes.items()}
    return snap, table, roots


def _greedy(snap, table, roots) -> Extraction:
    choice, seen = greedy_choice(snap, table)
    return Extraction(choice, dag_cost(snap, choice, roots, table), "greedy", "heuristic", None, 0.0, table, seen)


def _brute_force(snap, table, roots) -> float:
    """The cheapest acyclic program, by trying every choice of every e-class."""
    classes = sorted(snap.classes)
    best = math.inf
    for picks in itertools.product(*(range(len(snap.classes[c])) for c in classes)):
        choice = dict(zip(classes, picks, strict=True))
        if program_closure(snap, choice, roots) is not None:
            best = min(best, dag_cost(snap, choice, roots, table))
    return best


def _random_egraph(rng: random.Random):
    """Classes with one to three e-nodes over any classes (cycles of every length)."""
    n = rng.randint(3, 7)
    classes = {}
    for c in range(n):
        nodes = []
        for j in range(rng.randint(1, 3)):
            if rng.random() < 0.15:
                nodes.append(("Input", 0, ()))
            else:
                kids = tuple(rng.sample(range(n), rng.randint(1, min(2, n))))
                cost = rng.choice([0, 1, 1, 2, 3, 5, 8, math.inf if rng.random() < 0.05 else 4])
                nodes.append((f"Op{j}", cost, kids))
        classes[c] = nodes
    return _egraph(classes, rng.sample(range(n), rng.randint(1, 2)))


def _some(rng: random.Random, classes: list[int]) -> tuple[int, ...]:
    """One or two of ``classes``."""
    return tuple(rng.sample(classes, rng.randint(1, min(2, len(classes)))))


def _layered_egraph(rng: random.Random):
    """Values in levels, each held in one or two layouts joined by conversions, e-nodes over
    any lower level (fusion skips a level), now and then an e-node pointing anywhere (longer
    cycles)."""
    classes: dict[int, list[tuple]] = {0: [("Input", 0, ())]}
    values = [[0]]
    n = 1
    for _ in range(rng.randint(2, 4)):
        for _ in range(rng.randint(1, 2)):
            layouts = [n] if rng.random() < 0.4 else [n, n + 1]
            n += len(layouts)
            values.append(layouts)
    for v, layouts in enumerate(values[1:], start=1):
        lower = [c for value in values[:v] for c in value]
        for k, c in enumerate(layouts):
            nodes = [(f"Op{k}{j}", rng.choice([1, 2, 3, 3, 5]), _some(rng, lower))
                     for j in range(rng.randint(1, 2))]
            if len(layouts) == 2:
                nodes.append(("ToBlocked" if k else "FromBlocked", rng.choice([0, 1, 1]), (layouts[1 - k],)))
            if rng.random() < 0.15:
                nodes.append(("Up", rng.choice([0, 1]), (rng.randrange(n),)))
            classes[c] = nodes
    tops = [value[0] for value in values[-2:]]
    return _egraph(classes, rng.sample(tops, rng.randint(1, len(tops))))


def _cases(count: int):
    """Seeded random e-graphs small enough for brute force, with a program."""
    for seed in range(count):
        rng = random.Random(seed)
        snap, table, roots = (_layered_egraph if seed % 2 else _random_egraph)(rng)
        if math.prod(len(ns) for ns in snap.classes.values()) > 4000:
            continue
        choice, _ = greedy_choice(snap, table)
        if program_closure(snap, choice, roots) is None:
            continue  # no program at all (or greedy found none): nothing to compare
        yield seed, snap, table, roots


def _check(snap, table, roots, ex: Extraction, optimum: float, greedy: Extraction) -> None:
    assert ex.status == "optimal", ex.status
    assert program_closure(snap, ex.choice, roots) is not None  # every child chosen, no cycle
    assert ex.cost == dag_cost(snap, ex.choice, roots, table)
    assert ex.cost == pytest.approx(optimum, abs=1e-9)
    assert ex.cost <= greedy.cost


@pytest.mark.parametrize("variant", ["plain", "order variables", "large components", "grouped"])
def test_pruned_ilp_keeps_the_optimum_of_brute_force_and_of_the_unpruned_ilp(monkeypatch, variant):
    """Pruning (unusable, unbuildable, cycle-only, subsumed, dominated by greedy) and every row
    family (two-class cycles, cycle rows or order variables, requirements by any grouping of
    classes) keep the cheapest program: the pruned ILP, the unpruned ILP and brute force agree
    on the 190 of 300 random e-graphs that have a program, half of them cyclic."""
    if variant == "order variables":
        monkeypatch.setattr(ilp, "MAX_CYCLES", 0)  # every longer cycle through order variables
    if variant == "large components":
        monkeypatch.setattr(prune, "MAX_COMPONENT", 1)  # least fixpoints, no cycle-only pruning
    compared = cyclic = better_than_greedy = 0
    for seed, snap, table, roots in _cases(300):
        optimum = _brute_force(snap, table, roots)
        greedy = _greedy(snap, table, roots)
        same_value = None
        if variant == "grouped":  # any partition of the classes gives valid requirement rows
            picked = random.Random(seed).random
            same_value = lambda c, i, picked=picked: picked() < 0.5  # noqa: E731
        pruned = ilp.extract_ilp(snap, None, roots, greedy=greedy, same_value=same_value)
        unpruned = ilp.extract_ilp(snap, None, roots, greedy=greedy, prune=False, same_value=same_value)
        _check(snap, table, roots, pruned, optimum, greedy)
        _check(snap, table, roots, unpruned, optimum, greedy)
        assert pruned.problem["enodes"] <= unpruned.problem["enodes"]
        compared += 1
        cyclic += pruned.problem["cyclic_eclasses"] > 0
        better_than_greedy += optimum < greedy.cost
    assert compared > 150 and cyclic > 50 and better_than_greedy > 10, (compared, cyclic, better_than_greedy)


def _layout_chain(levels: int):
    """A chain of conv layers, each one computed in NCHW (Conv then Relu, or FusedConv) or in
    the blocked layout (ConvNCHWc then Relu), with conversions both ways at every level: the
    structure the layout and fusion rules build. Every op costs 1 (the ``nodes`` model)."""
    classes: dict[int, list[tuple]] = {0: [("Input", 0, ())], 1: [("ToBlocked", 1, (0,))]}
    nchw, blocked = 0, 1
    n = 2
    for _ in range(levels):
        conv, conv_b, relu, relu_b = n, n + 1, n + 2, n + 3
        n += 4
        classes[conv] = [("Conv", 1, (nchw,)), ("FromBlocked", 1, (conv_b,))]
        classes[conv_b] = [("ConvNCHWc", 1, (blocked,)), ("ToBlocked", 1, (conv,))]
        classes[relu] = [("Relu", 1, (conv,)), ("FusedConv", 1, (nchw,)), ("FromBlocked", 1, (relu_b,))]
        classes[relu_b] = [("Relu", 1, (conv_b,)), ("ToBlocked", 1, (relu,))]
        nchw, blocked = relu, relu_b
    return _egraph(classes, [nchw])


def _lp_bound(form: ilp.Formulation) -> float:
    relaxed = milp(form.cost, constraints=LinearConstraint(form.matrix, form.lower, form.upper),
                   bounds=Bounds(*form.bounds), integrality=np.zeros(len(form.cost)))
    assert relaxed.status == 0
    return float(relaxed.fun)


def test_the_lp_relaxation_stays_tight_on_a_chain_of_layout_and_fusion_choices():
    """On 12 levels of NCHW/blocked/fused choices the optimum is 12 (a FusedConv per level);
    the LP relaxation's bound is the optimum. Without the requirement rows the LP splits
    each level between alternatives that share the level below, which each then need only in
    part, level after level: its bound is under a quarter of the optimum."""
    snap, table, roots = _layout_chain(12)
    greedy = _greedy(snap, table, roots)
    program = program_closure(snap, greedy.choice, roots)
    cands = candidates(snap, table, roots, {(c, greedy.choice[c]) for c in program}, greedy.choice)
    form = ilp.formulate(table, cands, {c: greedy.choice[c] for c in program})
    assert form.stats["order_variables"] == 0 and form.stats["two_cycle_rows"] > 0
    ex = ilp.extract_ilp(snap, None, roots, greedy=greedy)
    assert ex.cost == 12 and ex.status == "optimal"
    assert _lp_bound(form) == pytest.approx(12.0)
    # The same rows without the requirement rows: the bound collapses.
    assert _lp_bound(ilp.formulate(table, cands, None, require=False)) < 3.0


def test_each_pruning_step_removes_what_it_should_and_keeps_greedys_program():
    # y (class 1, the output) = Sigmoid(x) {10}, Neg(m) {1}, Identity(y) {a self-loop}, Out(t) {t = Dropout(y):
    # every program of t computes y first}, Exp(x, m) {20: subsumed by Neg(m), fewer children and cheaper};
    # m (class 2) = Relu(x) {3}, Abs(x) {4: subsumed by Relu(x)}, Elu(x) {unusable: infinite cost}.
    snap, table, roots = _egraph({
        0: [("Input", 0, ())],
        1: [("Sigmoid", 10, (0,)), ("Neg", 1, (2,)), ("Identity", 0, (1,)), ("Out", 0, (3,)), ("Exp", 20, (0, 2))],
        2: [("Relu", 3, (0,)), ("Abs", 4, (0,)), ("Elu", math.inf, (0,))],
        3: [("Dropout", 1, (1,))],
    }, [1])
    greedy = _greedy(snap, table, roots)
    assert greedy.choice[1] == 1 and greedy.cost == 4  # Neg(Relu(x))
    program = program_closure(snap, greedy.choice, roots)
    keep = {(c, greedy.choice[c]) for c in program}
    cands = candidates(snap, table, roots, keep, greedy.choice)
    assert {k: cands.stats[k] for k in ("self_loops", "unusable", "cycle_only", "subsumed", "dominated")} == {
        "self_loops": 1, "unusable": 1, "cycle_only": 1, "subsumed": 2,
        # Sigmoid(x) alone (10) costs more than Neg(m) with greedy's program below it (1 + 3).
        "dominated": 1}
    assert cands.nodes == {1: [1], 2: [0], 0: [0]}  # t is no longer reached
    assert keep <= {(c, i) for c, idx in cands.nodes.items() for i in idx}
    assert cands.fixed == {0: 0} and cands.forced == {0, 1, 2}
    without = candidates(snap, table, roots, keep, greedy.choice, dominance=False)
    assert without.nodes[1] == [0, 1, 4] and without.nodes[2] == [0, 1]
    ex = ilp.extract_ilp(snap, None, roots, greedy=greedy)
    assert ex.cost == 4 == _brute_force(snap, table, roots) and ex.status == "optimal"


def test_without_scipys_highs_bindings_milp_solves_the_same_program_without_a_start(monkeypatch):
    """Where scipy has no bundled HiGHS bindings (before 1.15), scipy.optimize.milp solves the
    same integer program, with no start: the same optimum, no warm start."""
    monkeypatch.setattr(ilp, "_highs_bindings", lambda: None)
    for _, snap, table, roots in itertools.islice(_cases(60), 25):
        greedy = _greedy(snap, table, roots)
        ex = ilp.extract_ilp(snap, None, roots, greedy=greedy)
        _check(snap, table, roots, ex, _brute_force(snap, table, roots), greedy)
        assert not ex.problem["warm_start"]
    snap, table, roots = _layout_chain(12)
    assert ilp.extract_ilp(snap, None, roots, greedy=_greedy(snap, table, roots)).cost == 12


def test_a_bundled_model_is_solved_to_optimality_from_greedys_start():
    from egraft.extract.program import rebuild_outputs
    from egraft.testing.models import light_model_path

    result = optimize(egraft.load(onnx.load(light_model_path("squeezenet"))))
    snapshot = result.snapshot
    roots = [c for c, _, _ in rebuild_outputs(snapshot)]
    for name, profile in (("nodes", None), ("roofline", "cpu-host")):
        model = cost_model(name, profile)
        greedy = extract(snapshot, model, "greedy")
        exact = extract(snapshot, model, "ilp", time_limit=30)
        assert exact.status == "optimal" and exact.gap == 0.0
        assert exact.problem["warm_start"] and exact.problem["order_variables"] == 0
        assert exact.problem["two_cycle_rows"] > 0  # the layout conversions' pairs
        assert exact.cost <= greedy.cost
        assert exact.cost == dag_cost(snapshot, exact.choice, roots, exact.table)
        rebuild_graph(snapshot, exact.choice).validate()

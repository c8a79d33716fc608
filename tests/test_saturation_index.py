"""The saturation's Python side of the e-graph: the index that follows egglog's congruence closure
without reading egglog back (egraft/rewrite/snapshot.py), and semi-naive matching over what changed
(egraft/rewrite/match.py). Each is checked against what it replaces: egglog's own partition of the
handles after random unions and terms, the fixpoint that the constant e-classes are, and matching
the whole e-graph every round."""

from __future__ import annotations

import random

import onnx
import pytest
from onnx import TensorProto, helper

import egraft
from egraft.rewrite.egraph import EGraphState
from egraft.rewrite.engine import Budget, saturate
from egraft.testing.models import light_model_path


def _chain_model(n: int) -> onnx.ModelProto:
    """x -> Relu -> Neg -> Relu -> ... (n ops) -> y, one input and one output of f32[4]."""
    ops = ["Relu", "Neg", "Exp", "Abs"]
    nodes = [helper.make_node(ops[i % len(ops)], [f"v{i}"], [f"v{i + 1}"]) for i in range(n)]
    nodes[0].input[0] = "x"
    nodes[-1].output[0] = "y"
    graph = helper.make_graph(nodes, "chain", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [4])])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


@pytest.mark.parametrize("seed", range(6))
def test_the_index_partitions_handles_as_egglog_does_after_random_unions_and_terms(seed):
    # Terms over random e-classes and unions of random handles, in rounds: merges rename inputs,
    # equal terms become one e-class by congruence (an op over merged inputs twice). After each
    # round the index's partition and e-nodes must be egglog's own.
    from egraft.ir.types import DType, TensorType

    rng = random.Random(seed)
    state = EGraphState.from_graph(egraft.load(_chain_model(12)))
    f32 = TensorType(DType.FLOAT32, (4,))
    for _ in range(5):
        refs = sorted(state.snapshot().ref_class)
        for _ in range(rng.randrange(3, 12)):  # new terms, some repeating an op over the same e-classes
            op = rng.choice(["Relu", "Neg", "Add", "Mul"])
            args = [rng.choice(refs) for _ in range(2 if op in ("Add", "Mul") else 1)]
            refs.append(state.add_term(op, "", {}, args, f32))
        for _ in range(rng.randrange(1, 5)):
            state.union_refs(rng.choice(refs), rng.choice(refs))
        state.flush()
        snapshot = state.snapshot()
        assert snapshot.ref_class == state.egglog_classes()
        for c, nodes in snapshot.classes.items():
            assert len(set(nodes)) == len(nodes) and c == min(r for r, k in snapshot.ref_class.items() if k == c)
        canonical = {(state._index.term[r][0], tuple(snapshot.ref_class[a] for a in state._index.term[r][3]))
                     for r in snapshot.ref_class}
        assert canonical == {(n.op, n.children) for nodes in snapshot.classes.values() for n in nodes}
    assert len(snapshot.classes) < len(snapshot.ref_class) - 5  # unions and congruence did merge
    state.release()


def _constant_fixpoint(snapshot) -> set[int]:
    """The e-classes that hold a constant or an e-node computed from constants only, by passes
    over every e-class until nothing changes (what the index keeps incrementally)."""
    constant = set(snapshot.const_class)
    changed = True
    while changed:
        changed = False
        for c, nodes in snapshot.classes.items():
            if c not in constant and any(n.op not in ("Input", "Absent") and all(ch in constant for ch in n.children)
                                         for n in nodes):
                constant.add(c)
                changed = True
    return constant


@pytest.mark.parametrize("name", ["squeezenet", "resnet50"])
def test_the_index_keeps_the_constant_classes_and_old_snapshots_stay_as_they_were(name):
    from egraft.optimize import select_rules
    from egraft.rewrite.load import load_rules

    rules, _ = select_rules(load_rules([], include_shipped=True))
    state = EGraphState.from_graph(egraft.load(onnx.load(light_model_path(name))))
    first = state.snapshot()
    frozen = ({c: list(nodes) for c, nodes in first.classes.items()}, dict(first.ref_class),
              {c: dict(u) for c, u in first.uses.items()}, {op: set(cs) for op, cs in first.op_classes.items()})
    grew = False
    for _ in range(6):
        saturate(state, rules, Budget(iterations=1, seconds=600.0))
        snapshot = state.snapshot()
        assert set(snapshot.constant_classes) == _constant_fixpoint(snapshot)
        users: dict[int, dict] = {}
        for c, nodes in snapshot.classes.items():
            for n in nodes:
                for ch in n.children:
                    users.setdefault(ch, {}).setdefault((c, n.op), 0)
                    users[ch][(c, n.op)] += 1
        assert users == snapshot.uses
        assert snapshot.num_nodes == sum(map(len, snapshot.classes.values()))
        grew = grew or snapshot.num_nodes > first.num_nodes
    assert grew
    assert ({c: list(nodes) for c, nodes in first.classes.items()}, dict(first.ref_class),
            {c: dict(u) for c, u in first.uses.items()}, {op: set(cs) for op, cs in first.op_classes.items()}) == frozen
    state.release()


@pytest.mark.parametrize("name", ["resnet50", "densenet121"])
def test_semi_naive_matching_finds_what_matching_everything_finds_in_the_first_rounds(name):
    # tests/test_optimize.py runs both ways to saturation on four models; these two larger ones,
    # whose e-classes hold more than INTERIOR_ALTERNATIVES bodies and whose guards ask made_by and
    # feeds_const, for their first rounds (matching everything every round takes long there).
    from egraft.optimize import select_rules
    from egraft.rewrite.load import load_rules

    rules, _ = select_rules(load_rules([], include_shipped=True))
    budget = Budget(iterations=12, seconds=600.0, match_limit=10**9)
    outcomes = []
    for incremental in (True, False):
        state = EGraphState.from_graph(egraft.load(onnx.load(light_model_path(name))))
        report = saturate(state, rules, budget, incremental=incremental)
        snapshot = state.snapshot()
        outcomes.append((report.iterations, report.nodes_after, report.classes_after,
                         {k: v.applied for k, v in report.rules.items()},
                         sorted((c, nodes) for c, nodes in snapshot.classes.items())))
        state.release()
    assert outcomes[0] == outcomes[1]
    assert sum(outcomes[0][3].values()) > 200


@pytest.mark.parametrize("name", ["inception_v1", "encoder", "resnet50"])
def test_compiled_replacements_build_what_the_interpreter_builds(name):
    # Two states of one model. Each round, every match of every rule is built on both: compiled
    # on one, by walking the syntax tree (the reference) on the other. The terms, their order
    # (their handles), their types and the failures must be the same.
    from egraft.ir.infer import FreshDims
    from egraft.optimize import select_rules
    from egraft.rewrite.evaluate import Evaluator, ReplacementFailed
    from egraft.rewrite.load import load_rules
    from egraft.rewrite.match import Matcher
    from egraft.testing.encoder import encoder_model

    model = encoder_model() if name == "encoder" else onnx.load(light_model_path(name))
    rules, _ = select_rules(load_rules([], include_shipped=True))
    states = [EGraphState.from_graph(egraft.load(model)) for _ in range(2)]
    fresh = [FreshDims("_e"), FreshDims("_e")]
    built = 0
    for _ in range(4):
        snapshots = [state.snapshot() for state in states]
        evaluators = [Evaluator(state, snap, 17, f) for state, snap, f in zip(states, snapshots, fresh)]
        matcher = Matcher(snapshots[0], 17)
        for rule in rules:
            for subst in matcher.match_rule(rule, limit=200, accept=lambda s, r=rule: evaluators[0].guard(r, s)):
                outcomes = []
                for state, evaluator, build in zip(states, evaluators, ("build", "interpret")):
                    mark = len(state.term_log)
                    try:
                        pairs = getattr(evaluator, build)(rule, dict(subst))
                    except ReplacementFailed as err:
                        pairs = str(err)
                    terms = state.term_log[mark:]
                    outcomes.append((pairs, terms, [str(state.ref_types[t[0]]) for t in terms]))
                    for pair in pairs if isinstance(pairs, list) else ():
                        state.union_refs(*pair)
                assert outcomes[0] == outcomes[1], rule.name
                built += 1
        for state in states:
            state.flush()
    assert built > 100
    for state in states:
        state.release()


def test_elementwise_inference_is_shared_across_bodies_but_not_their_values_or_their_errors():
    # Inference of an Elementwise reads the highest input its body reads, not the body
    # (OpDef.infer_key): bodies over the same input types share one entry of the memo. What
    # inference evaluates at compile time (the outputs of small known inputs) reads the body:
    # the second body over two constants must get its own value, and a body that reads an input
    # the node lacks must still fail after a valid one was inferred.
    import numpy as np

    from egraft.ir.infer import FreshDims
    from egraft.rewrite.builtins import Handle
    from egraft.rewrite.evaluate import Evaluator, ReplacementFailed

    state = EGraphState.from_graph(egraft.load(_chain_model(3)))
    a = Handle(state.add_const(np.array([1.0, 2.0, 3.0, 4.0], np.float32)))
    b = Handle(state.add_const(np.array([5.0, 6.0, 7.0, 8.0], np.float32)))
    x = Handle(state.snapshot().class_ref[state.snapshot().ref_class[0]])
    evaluator = Evaluator(state, state.snapshot(), 17, FreshDims("_e"))
    built = {}
    for expr in ("add(x0, x1)", "mul(x0, x1)", "sub(x0, x1)"):
        built[expr] = evaluator.make_op("Elementwise", [a, b], {"expr": expr}, domain="com.egraft")
    values = {expr: state.known_values.get(h.ref) for expr, h in built.items()}
    np.testing.assert_array_equal(values["add(x0, x1)"], [6, 8, 10, 12])
    np.testing.assert_array_equal(values["mul(x0, x1)"], [5, 12, 21, 32])
    np.testing.assert_array_equal(values["sub(x0, x1)"], [-4, -4, -4, -4])
    hits = len(evaluator.memo.inferred)
    for expr in ("relu(add(x0, x1))", "mul(add(x0, x1), x1)"):
        h = evaluator.make_op("Elementwise", [x, b], {"expr": expr}, domain="com.egraft")
        assert str(state.ref_types[h.ref]) == "f32[4]"
    assert len(evaluator.memo.inferred) == hits + 1  # one entry for both bodies over (x, b)
    with pytest.raises(ReplacementFailed, match="x2"):
        evaluator.make_op("Elementwise", [x, b], {"expr": "add(x0, x2)"}, domain="com.egraft")
    state.release()

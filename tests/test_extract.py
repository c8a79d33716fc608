"""Extraction: the exact (ILP) and greedy extractors against brute force on hand-built
e-graphs, and the cost models (nodes, flops, roofline with profiles) on small models whose
best plan is known, each plan run against onnxruntime."""

from __future__ import annotations

import itertools
import re

import numpy as np
import onnx
import pytest
from conftest import run_onnxruntime
from onnx import TensorProto, helper, numpy_helper

import egraft
from egraft.errors import EgraftError
from egraft.extract.cost import NodeCount, Roofline, as_cost_model, cost_model
from egraft.extract.extractor import extract
from egraft.extract.profiles import Profile, load_profile
from egraft.extract.program import dag_cost, rebuild_graph
from egraft.ir.types import DType, TensorType
from egraft.ir.work import Work
from egraft.optimize import optimize
from egraft.rewrite.egraph import EGraphState


def _one_op_model(op: str, shape=(4,)) -> onnx.ModelProto:
    """x -> op(x) = y1 and x -> Tanh(x) = y2: two outputs over one input."""
    nodes = [helper.make_node(op, ["x"], ["y1"]), helper.make_node("Tanh", ["x"], ["y2"])]
    return helper.make_model(helper.make_graph(
        nodes, "two_outputs", [helper.make_tensor_value_info("x", TensorProto.FLOAT, list(shape))],
        [helper.make_tensor_value_info("y1", TensorProto.FLOAT, list(shape)),
         helper.make_tensor_value_info("y2", TensorProto.FLOAT, list(shape))]),
        opset_imports=[helper.make_opsetid("", 17)])


def _brute_force(snapshot, table, roots) -> float:
    """The cheapest acyclic program by trying every choice of every reachable e-class."""
    classes = sorted(snapshot.classes)
    options = [range(len(snapshot.classes[c])) for c in classes]
    best = float("inf")
    for picks in itertools.product(*options):
        choice = dict(zip(classes, picks))
        try:
            best = min(best, _acyclic_cost(snapshot, choice, roots, table))
        except RecursionError:
            continue
    return best


def _acyclic_cost(snapshot, choice, roots, table) -> float:
    """dag_cost, refusing a choice whose program reaches its own e-class (a cycle)."""
    def visit(c, path):
        if c in path:
            raise RecursionError
        for ch in snapshot.classes[c][choice[c]].children:
            visit(ch, path | {c})
    for r in roots:
        visit(r, frozenset())
    return dag_cost(snapshot, choice, roots, table)


def _shared_subexpression_egraph():
    """y1 = Sigmoid(x) = Neg(s), y2 = Tanh(x) = Abs(s), s = Exp(x).

    Priced Sigmoid 10, Tanh 10, Exp 12, Neg 1, Abs 1: each output alone is cheapest
    without s (10 < 13), so greedy pays 20; computing s once for both pays 14.
    """
    state = EGraphState.from_graph(egraft.load(_one_op_model("Sigmoid")))
    t = TensorType(DType.FLOAT32, (4,))
    x = state.input_refs["x"]
    s = state.add_term("Exp", "", {}, [x], t)
    state.union_refs(state.add_term("Neg", "", {}, [s], t), state.output_refs[0])
    state.union_refs(state.add_term("Abs", "", {}, [s], t), state.output_refs[1])
    state.flush()
    snapshot = state.snapshot()
    roots = [snapshot.ref_class[r] for r in state.output_refs]
    prices = {"Sigmoid": 10, "Tanh": 10, "Exp": 12, "Neg": 1, "Abs": 1}
    return snapshot, roots, as_cost_model(lambda n: prices.get(n.op, 0))


def test_exact_extraction_finds_the_optimum_where_greedy_does_not():
    snapshot, roots, model = _shared_subexpression_egraph()
    greedy = extract(snapshot, model, "greedy", roots)
    exact = extract(snapshot, model, "ilp", roots)
    optimum = _brute_force(snapshot, greedy.table, roots)
    assert optimum == 14
    assert greedy.cost == 20
    assert exact.cost == optimum
    assert exact.status == "optimal" and exact.gap == 0.0
    graph = rebuild_graph(snapshot, exact.choice)
    assert sorted(n.op for n in graph.nodes) == ["Abs", "Exp", "Neg"]


def test_exact_extraction_rules_out_cycles():
    # y1 = Sigmoid(x) (price 10) and also y1 = Neg(m), m = Neg(y1) (price 1 each): the cheap
    # pair is a cycle and can never be computed; a self-loop Identity(y1) is pruned outright.
    state = EGraphState.from_graph(egraft.load(_one_op_model("Sigmoid")))
    t = TensorType(DType.FLOAT32, (4,))
    y1 = state.output_refs[0]
    m = state.add_term("Neg", "", {}, [y1], t)
    state.union_refs(state.add_term("Neg", "", {}, [m], t), y1)
    state.union_refs(state.add_term("Identity", "", {}, [y1], t), y1)
    # m also has an acyclic form of its own: Relu(x), price 3.
    state.union_refs(state.add_term("Relu", "", {}, [state.input_refs["x"]], t), m)
    state.flush()
    snapshot = state.snapshot()
    roots = [snapshot.ref_class[r] for r in state.output_refs]
    prices = {"Sigmoid": 10, "Tanh": 10, "Neg": 1, "Identity": 0, "Relu": 3}
    model = as_cost_model(lambda n: prices.get(n.op, 0))
    exact = extract(snapshot, model, "ilp", roots)
    optimum = _brute_force(snapshot, exact.table, roots)
    assert optimum == 10 + 1 + 3  # y1 = Neg(Relu(x)), y2 = Tanh(x)
    assert exact.cost == optimum and exact.status == "optimal"
    assert exact.problem["pruned_self_loops"] == 1 and exact.problem["cyclic_eclasses"] == 2
    graph = rebuild_graph(snapshot, exact.choice)
    x = np.linspace(-1, 1, 4).astype(np.float32)
    out = graph.run({"x": x})  # the program is acyclic and runs
    np.testing.assert_allclose(out["y1"], -np.maximum(x, 0))
    np.testing.assert_allclose(out["y2"], np.tanh(x), rtol=1e-6)


def test_ilp_time_limit_keeps_a_valid_program_and_reports_its_gap():
    from egraft.testing.models import light_model_path

    result = optimize(egraft.load(onnx.load(light_model_path("resnet50"))), cost="roofline", extractor="ilp",
                      time_limit=30.0)
    ex = result.extraction
    assert ex.status == "optimal" or ex.status.startswith("time limit"), ex.status
    assert ex.seconds <= 30.0 + 5.0
    assert ex.gap is not None and (ex.status.startswith("time limit") or ex.gap == 0.0)
    greedy = extract(result.snapshot, result.cost_model, "greedy")
    assert ex.cost <= greedy.cost * (1 + 1e-9)
    assert ex.lower_bound is None or ex.lower_bound <= ex.cost * (1 + 1e-6)
    result.graph.validate()


def _set_cover_egraph(elements: int = 120, sets: int = 200, per_set: int = 6):
    """A weighted set cover as an e-graph: output e-class y_e = LeakyRelu(x) {alpha=e}
    (price 1000) or Elu(s_j) {alpha=e} (free) for each of the random sets j holding e,
    where s_j = HardSigmoid(x) {alpha=j} costs 10..26. Hard for an exact solver."""
    import zlib

    nodes = [helper.make_node("LeakyRelu", ["x"], [f"y{e}"], alpha=float(e + 1)) for e in range(elements)]
    model = helper.make_model(helper.make_graph(
        nodes, "cover", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4])],
        [helper.make_tensor_value_info(f"y{e}", TensorProto.FLOAT, [4]) for e in range(elements)]),
        opset_imports=[helper.make_opsetid("", 17)])
    state = EGraphState.from_graph(egraft.load(model))
    t = TensorType(DType.FLOAT32, (4,))
    rng = np.random.default_rng(0)
    for j in range(sets):
        s = state.add_term("HardSigmoid", "", {"alpha": float(j + 1)}, [state.input_refs["x"]], t)
        for e in rng.choice(elements, size=per_set, replace=False):
            state.union_refs(state.add_term("Elu", "", {"alpha": float(e + 1)}, [s], t), state.output_refs[e])
    state.flush()
    snapshot = state.snapshot()

    def price(n) -> int:
        if n.op == "LeakyRelu":
            return 1000
        return 10 + zlib.crc32(n.attrs.encode()) % 17 if n.op == "HardSigmoid" else 0

    return snapshot, [snapshot.ref_class[r] for r in state.output_refs], as_cost_model(price)


def test_ilp_stopped_by_its_time_limit_returns_a_valid_program_and_its_gap():
    snapshot, roots, model = _set_cover_egraph()
    greedy = extract(snapshot, model, "greedy", roots)
    limited = extract(snapshot, model, "ilp", roots, time_limit=0.5)
    # Stopped at the limit: HiGHS's best program so far, or greedy's when that is cheaper.
    assert limited.status.startswith("time limit"), limited.status
    assert limited.seconds < 5.0
    assert limited.cost <= greedy.cost
    assert limited.lower_bound is not None and limited.lower_bound <= limited.cost
    assert limited.gap == pytest.approx((limited.cost - limited.lower_bound) / limited.cost)
    assert limited.gap > 0
    assert limited.cost == dag_cost(snapshot, limited.choice, roots, limited.table)
    graph = rebuild_graph(snapshot, limited.choice)  # every output computed, no cycle
    graph.validate()
    assert [v.name for v in graph.outputs] == [f"y{e}" for e in range(120)]
    # The program's cost is its sets (10..26 each) and its outputs paid for alone (1000 each).
    ops = graph.op_histogram()
    alone, sets = ops.get("LeakyRelu", 0), ops.get("HardSigmoid", 0)
    assert alone + ops.get("Elu", 0) == 120
    assert 10 * sets + 1000 * alone <= limited.cost <= 26 * sets + 1000 * alone


def test_nodes_cost_model_extracts_the_fewest_ops():
    snapshot, roots, _ = _shared_subexpression_egraph()
    exact = extract(snapshot, NodeCount(), "ilp", roots)
    assert exact.cost == _brute_force(snapshot, exact.table, roots) == 2  # Sigmoid(x), Tanh(x)
    assert sorted(n.op for n in rebuild_graph(snapshot, exact.choice).nodes) == ["Sigmoid", "Tanh"]


def _chain_model(n: int = 1 << 16) -> onnx.ModelProto:
    """A memory-bound chain: y = Sigmoid(Relu(x * a + b) - c) over n elements."""
    rng = np.random.default_rng(0)
    inits = [numpy_helper.from_array(rng.normal(size=(n,)).astype(np.float32), k) for k in "abc"]
    nodes = [helper.make_node("Mul", ["x", "a"], ["t1"]), helper.make_node("Add", ["t1", "b"], ["t2"]),
             helper.make_node("Relu", ["t2"], ["t3"]), helper.make_node("Sub", ["t3", "c"], ["t4"]),
             helper.make_node("Sigmoid", ["t4"], ["y"])]
    return helper.make_model(helper.make_graph(
        nodes, "chain", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [n])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [n])], inits),
        opset_imports=[helper.make_opsetid("", 17)])


def test_roofline_fuses_a_memory_bound_chain():
    model = _chain_model()
    roofline = cost_model("roofline", "cpu-host")
    fused = optimize(egraft.load(model), cost=roofline, extractor="ilp")
    unfused = optimize(egraft.load(model), rules_off=["fusion"], cost=roofline, extractor="ilp")
    assert [n.op for n in fused.graph.nodes] == ["Elementwise"]
    assert [n.op for n in unfused.graph.nodes] == ["Mul", "Add", "Relu", "Sub", "Sigmoid"]
    # Five kernels each reading and writing the whole tensor against one: the traffic
    # dominates (the chain does 5 flops per 36 bytes moved), so fusion is about 3x cheaper.
    assert fused.extraction.cost * 2.5 < unfused.extraction.cost
    x = np.linspace(-2, 2, 1 << 16).astype(np.float32)
    want = run_onnxruntime(model, {"x": x})["y"]
    np.testing.assert_allclose(fused.graph.run({"x": x})["y"], want, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(run_onnxruntime(egraft.to_onnx(fused.graph), {"x": x})["y"], want,
                               rtol=1e-5, atol=1e-6)


def _conv3x3_model(channels: int = 32, size: int = 28) -> onnx.ModelProto:
    rng = np.random.default_rng(1)
    w = rng.normal(size=(channels, channels, 3, 3)).astype(np.float32) * 0.1
    b = rng.normal(size=(channels,)).astype(np.float32)
    nodes = [helper.make_node("Conv", ["x", "w", "b"], ["y"], pads=[1, 1, 1, 1], kernel_shape=[3, 3])]
    return helper.make_model(helper.make_graph(
        nodes, "conv3x3", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, channels, size, size])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, channels, size, size])],
        [numpy_helper.from_array(w, "w"), numpy_helper.from_array(b, "b")]),
        opset_imports=[helper.make_opsetid("", 17)])


@pytest.mark.parametrize(("peak_gflops", "bandwidth_gbs", "expected"), [
    (10.0, 1000.0, "WinogradConv"),   # compute-poor: 2.25x fewer multiplications pay for the buffers
    (1000.0, 1.0, "Conv"),            # bandwidth-poor: the transform buffers' traffic does not pay
])
def test_winograd_is_chosen_or_refused_by_the_profiles_balance(peak_gflops, bandwidth_gbs, expected):
    model = _conv3x3_model()
    profile = Profile("balance", "cpu", peak_gflops=peak_gflops, bandwidth_gbs=bandwidth_gbs, launch_us=1.0)
    result = optimize(egraft.load(model), rules_off=["layout"], cost=Roofline(profile), extractor="ilp")
    assert [n.op for n in result.graph.nodes] == [expected]
    x = np.random.default_rng(2).normal(size=(1, 32, 28, 28)).astype(np.float32)
    want = run_onnxruntime(model, {"x": x})["y"]
    got = run_onnxruntime(egraft.to_onnx(result.graph), {"x": x})["y"]
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)


def test_roofline_cost_is_the_slower_of_compute_and_traffic_plus_launch():
    profile = Profile("toy", "cpu", peak_gflops=2.0, bandwidth_gbs=4.0, launch_us=0.5)
    snapshot = EGraphState.from_graph(egraft.load(_one_op_model("Relu", (1000,)))).snapshot()
    model = Roofline(profile)
    relu = next((c, n) for c, ns in snapshot.classes.items() for n in ns if n.op == "Relu")
    work = model.work(snapshot, *relu)
    assert (work.flops, work.reads, work.writes) == (1000.0, 4000.0, 4000.0)
    # compute: 1000 flop / 2 GFLOP/s = 0.5 us; traffic 8000 B / 4 GB/s = 2 us; plus 0.5 us launch.
    assert model.cost(snapshot, *relu) == pytest.approx(2.5)


def test_a_familys_call_cost_is_added_per_launch_and_read_back(tmp_path):
    """``[call_us]``: microseconds a call of a family costs beyond its roofline, added once per
    launch; it survives a write and read, and a negative or unknown one is refused by name."""
    profile = Profile("calls", "cpu", peak_gflops=1000.0, bandwidth_gbs=1000.0, launch_us=1.0,
                      call_us={"winograd": 250.0})
    model = Roofline(profile)
    assert model.op_cost(Work(1e6, "winograd", reads=0.0, writes=0.0), None) == pytest.approx(1.0 + 1.0 + 250.0)
    assert model.op_cost(Work(1e6, "conv_nchwc", reads=0.0, writes=0.0), None) == pytest.approx(1.0 + 1.0)
    path = tmp_path / "calls.toml"
    path.write_text(profile.to_toml())
    assert load_profile(str(path)).call_us == {"winograd": 250.0}
    for bad, message in (("winograd = -1.0", "call_us.winograd = -1.0; expected a number of microseconds >= 0"),
                         ("wingrad = 1.0", "call_us.wingrad: unknown kernel family")):
        path.write_text(profile.to_toml().replace("winograd = 250.0", bad))
        with pytest.raises(EgraftError, match=re.escape(message)):
            load_profile(str(path))


def test_a_copied_and_edited_profile_is_read_back(tmp_path):
    text = load_profile("cuda-h200").to_toml().replace("bandwidth_gbs = 4800.0", "bandwidth_gbs = 100.0")
    path = tmp_path / "slow.toml"
    path.write_text(text)
    profile = load_profile(str(path))
    assert profile.bandwidth_gbs == 100.0 and profile.peak_gflops == 67000.0 and profile.target == "cuda"


@pytest.mark.parametrize(("body", "message"), [
    ('name = "x"\ntarget = "cpu"\npeak_gflops = 1.0\nbandwidth_gbs = 1.0\n', "missing launch_us"),
    ('name = "x"\ntarget = "cpu"\npeak_gflops = -1.0\nbandwidth_gbs = 1.0\nlaunch_us = 1.0\n',
     "peak_gflops = -1.0; expected a positive number"),
    ('name = "x"\ntarget = "cpu"\npeak_gflop = 1.0\n', "unknown key 'peak_gflop'"),
    ('name = "x"\ntarget = "cpu"\npeak_gflops = 1.0\nbandwidth_gbs = 1.0\nlaunch_us = 1.0\n'
     '[efficiency]\ngemmm = 0.5\n', "efficiency.gemmm: unknown kernel family"),
    ("peak_gflops = = 1\n", "not valid TOML"),
])
def test_a_bad_profile_is_refused_by_file_and_key(tmp_path, body, message):
    path = tmp_path / "bad.toml"
    path.write_text(body)
    with pytest.raises(EgraftError, match=message.replace("(", r"\(").replace(")", r"\)")) as info:
        load_profile(str(path))
    assert str(path) in str(info.value)


def test_unknown_cost_model_and_extractor_are_refused():
    with pytest.raises(EgraftError, match="--cost-model speed: unknown cost model; known: nodes, flops, roofline"):
        cost_model("speed")
    snapshot, roots, model = _shared_subexpression_egraph()
    with pytest.raises(EgraftError, match="--extractor exact: unknown extractor; known: greedy, ilp"):
        extract(snapshot, model, "exact", roots)

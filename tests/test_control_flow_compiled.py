"""Control flow compiled (issue 15, item 4): the bodies of If, Loop and Scan nodes run as
compiled sub-programs (egraft/lowering/control.py), with the outer values they capture
as explicit inputs; the node is one ``control`` step, not a fallback. Each model is built
with symbolic dims and compared with onnxruntime at several sizes from one build."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper

import egraft

F, I64, B = TensorProto.FLOAT, TensorProto.INT64, TensorProto.BOOL


def _model(nodes, name, inputs, outputs, initializers=(), opset=17) -> onnx.ModelProto:
    graph = helper.make_graph(nodes, name, inputs, outputs, initializer=list(initializers))
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])


def _ort(model: onnx.ModelProto, feeds: dict) -> list[np.ndarray]:
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return session.run(None, feeds)


def _assert_bodies_compiled(compiled, controls: int) -> None:
    """Every control-flow node is a control step, and every node of every body (nested
    ones too) runs generated code or is a view: nothing falls back."""
    report = compiled.report()
    assert report.controls == controls, [(s.node.label, s.kind, s.reason) for s in compiled.steps]
    assert report.fallbacks == [], report.fallbacks
    assert not [s for s in compiled.steps if s.kind == "fallback"]
    for name, body in compiled.bodies().items():
        kinds = {s.kind for s in body.steps}
        assert kinds <= {"kernel", "view", "control"}, (name, kinds)
        assert "kernel" in kinds or "control" in kinds, (name, [(s.node.label, s.kind) for s in body.steps])
        _assert_bodies_compiled(body, sum(s.kind == "control" for s in body.steps))


# ---- If ---------------------------------------------------------------------------------------
def if_with_captures() -> onnx.ModelProto:
    """y = If(sum(x) > 0) then tanh(x * w) + b else (x - b) * (x - b), where x: f32[n, 8]
    and the branches read x, w and the outer value b (captures); z = y * 2 after the If."""
    then_branch = helper.make_graph(
        [helper.make_node("Mul", ["x", "w"], ["xw"]), helper.make_node("Tanh", ["xw"], ["t"]),
         helper.make_node("Add", ["t", "b"], ["then_out"])],
        "then", [], [helper.make_tensor_value_info("then_out", F, ["n", 8])])
    else_branch = helper.make_graph(
        [helper.make_node("Sub", ["x", "b"], ["d"]), helper.make_node("Mul", ["d", "d"], ["else_out"])],
        "else", [], [helper.make_tensor_value_info("else_out", F, ["n", 8])])
    nodes = [
        helper.make_node("Exp", ["bias"], ["b"]),  # a computed outer value the branches capture
        helper.make_node("ReduceSum", ["x"], ["s"], keepdims=0),
        helper.make_node("Greater", ["s", "zero"], ["c"]),
        helper.make_node("If", ["c"], ["y"], then_branch=then_branch, else_branch=else_branch),
        helper.make_node("Mul", ["y", "two"], ["z"]),
    ]
    inits = [helper.make_tensor("w", F, [8], np.linspace(-1, 1, 8).tolist()),
             helper.make_tensor("zero", F, [], [0.0]), helper.make_tensor("two", F, [], [2.0])]
    return _model(nodes, "if_captures",
                  [helper.make_tensor_value_info("x", F, ["n", 8]), helper.make_tensor_value_info("bias", F, [8])],
                  [helper.make_tensor_value_info("z", F, ["n", 8])], inits)


@pytest.fixture(scope="module")
def compiled_if():
    model = if_with_captures()
    return model, egraft.compile(model.SerializeToString(), use_cache=False)


def test_if_branches_are_compiled_sub_programs(compiled_if):
    _, compiled = compiled_if
    kinds = {s.node.op: s.kind for s in compiled.steps}
    assert kinds["If"] == "control"
    _assert_bodies_compiled(compiled, 1)
    then_body = compiled.bodies()[next(k for k in compiled.bodies() if k.endswith("then_branch"))]
    # the captured outer values are explicit inputs of the branch's program
    assert {"x", "w", "b"} >= set(then_body.input_names) - {"xw", "t"} and "b" in then_body.input_names
    assert "with compiled bodies" in repr(compiled)


@pytest.mark.parametrize("n", [1, 3, 17])
@pytest.mark.parametrize("sign", [1.0, -1.0])
def test_if_matches_onnxruntime_at_every_size(compiled_if, n, sign):
    model, compiled = compiled_if
    rng = np.random.default_rng(n)
    x = (np.abs(rng.normal(0, 1, (n, 8))) * sign).astype(np.float32)  # the sign picks the branch
    bias = rng.normal(0, 0.5, 8).astype(np.float32)
    (want,) = _ort(model, {"x": x, "bias": bias})
    got = compiled.run({"x": x, "bias": bias})["z"]
    assert got.shape == want.shape == (n, 8)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


def test_a_profiled_run_times_the_steps_of_the_branch_that_ran(compiled_if):
    """A control step's profile holds the steps of the body that ran, one level deeper,
    named by the node and the body, inside the control step's own interval."""
    _, compiled = compiled_if
    x, bias = np.ones((4, 8), np.float32), np.zeros(8, np.float32)  # sum > 0: the then branch
    profile: list = []
    compiled.run({"x": x, "bias": bias}, profile=profile)
    [control] = [t for t in profile if t.kind == "control"]
    nested = [t for t in profile if t.depth == 1]
    assert nested and all(t.label.startswith(f"{control.label} / then_branch: ") for t in nested)
    assert any(t.kind == "kernel" for t in nested)  # the branch's kernels (fused as the rules chose)
    assert all(control.start_ns <= t.start_ns <= t.end_ns <= control.end_ns for t in nested)
    assert [t.index for t in profile if t.depth == 0] == [s.index for s in compiled.steps]


def if_with_different_ranks() -> onnx.ModelProto:
    """y = If(c) then Squeeze(x, 0) else Relu(x), x: f32[1, n]: the output's rank is known
    only at run time; the branches still compile, and the If runs as a control step."""
    then_branch = helper.make_graph([helper.make_node("Squeeze", ["x", "axis0"], ["sq"])], "then", [],
                                    [helper.make_tensor_value_info("sq", F, ["n"])])
    else_branch = helper.make_graph([helper.make_node("Relu", ["x"], ["r"])], "else", [],
                                    [helper.make_tensor_value_info("r", F, [1, "n"])])
    nodes = [helper.make_node("If", ["c"], ["y"], then_branch=then_branch, else_branch=else_branch)]
    return _model(nodes, "if_ranks", [helper.make_tensor_value_info("x", F, [1, "n"]),
                                      helper.make_tensor_value_info("c", B, [])],
                  [helper.make_tensor_value_info("y", F, None)],
                  [helper.make_tensor("axis0", I64, [1], [0])])


def test_if_whose_branches_differ_in_rank():
    model = if_with_different_ranks()
    compiled = egraft.compile(model.SerializeToString(), use_cache=False)
    assert [s.kind for s in compiled.steps] == ["control"]
    _assert_bodies_compiled(compiled, 1)
    for n in (2, 5):
        x = np.random.default_rng(n).normal(0, 1, (1, n)).astype(np.float32)
        for c in (True, False):
            (want,) = _ort(model, {"x": x, "c": np.array(c)})
            got = compiled.run({"x": x, "c": np.array(c)})["y"]
            assert got.shape == want.shape
            np.testing.assert_allclose(got, want, rtol=1e-6)


# ---- Loop -------------------------------------------------------------------------------------
def loop_with_nested_if() -> onnx.ModelProto:
    """A Loop over at most M iterations while acc's sum stays under a limit: acc (f32[n])
    is carried, acc = acc * 0.9 + x + i (x captured from outside), a nested If adds
    acc or subtracts it depending on the iteration's parity; the scan output stacks each
    iteration's acc * w (w captured)."""
    odd_then = helper.make_graph([helper.make_node("Add", ["next", "x"], ["odd_out"])], "odd", [],
                                 [helper.make_tensor_value_info("odd_out", F, ["n"])])
    odd_else = helper.make_graph([helper.make_node("Sub", ["next", "x"], ["even_out"])], "even", [],
                                 [helper.make_tensor_value_info("even_out", F, ["n"])])
    body = helper.make_graph(
        [
            helper.make_node("Mul", ["acc_in", "decay"], ["scaled"]),
            helper.make_node("Cast", ["i"], ["i_f"], to=F),
            helper.make_node("Add", ["scaled", "i_f"], ["next"]),
            helper.make_node("Mod", ["i", "two_i"], ["parity"]),
            helper.make_node("Equal", ["parity", "one_i"], ["odd"]),
            helper.make_node("If", ["odd"], ["acc_out"], then_branch=odd_then, else_branch=odd_else),
            helper.make_node("Mul", ["acc_out", "w"], ["scan_out"]),
            helper.make_node("ReduceSum", ["acc_out"], ["total"], keepdims=0),
            helper.make_node("Less", ["total", "limit"], ["cond_out"]),
        ],
        "body",
        [helper.make_tensor_value_info("i", I64, []), helper.make_tensor_value_info("cond_in", B, []),
         helper.make_tensor_value_info("acc_in", F, ["n"])],
        [helper.make_tensor_value_info("cond_out", B, []), helper.make_tensor_value_info("acc_out", F, ["n"]),
         helper.make_tensor_value_info("scan_out", F, ["n"])],
        initializer=[helper.make_tensor("decay", F, [], [0.9]), helper.make_tensor("two_i", I64, [], [2]),
                     helper.make_tensor("one_i", I64, [], [1])])
    nodes = [
        helper.make_node("Neg", ["x0"], ["x"]),
        helper.make_node("Loop", ["M", "cond", "acc0"], ["acc", "scans"], body=body),
        helper.make_node("Abs", ["acc"], ["y"]),
    ]
    return _model(nodes, "loop_nested_if",
                  [helper.make_tensor_value_info("x0", F, ["n"]), helper.make_tensor_value_info("acc0", F, ["n"]),
                   helper.make_tensor_value_info("w", F, ["n"]), helper.make_tensor_value_info("M", I64, []),
                   helper.make_tensor_value_info("cond", B, []), helper.make_tensor_value_info("limit", F, [])],
                  [helper.make_tensor_value_info("y", F, ["n"]), helper.make_tensor_value_info("scans", F, None)])


@pytest.fixture(scope="module")
def compiled_loop():
    model = loop_with_nested_if()
    return model, egraft.compile(model.SerializeToString(), use_cache=False)


def test_loop_body_and_nested_if_are_compiled(compiled_loop):
    _, compiled = compiled_loop
    assert {s.node.op: s.kind for s in compiled.steps}["Loop"] == "control"
    _assert_bodies_compiled(compiled, 1)
    (body,) = compiled.bodies().values()
    assert [s.kind for s in body.steps if s.node.op == "If"] == ["control"]  # the nested If
    assert set(body.input_names) >= {"i", "cond_in", "acc_in", "x", "w", "limit"}


@pytest.mark.parametrize("n, trips, limit", [(1, 0, 1e9), (4, 5, 1e9), (9, 7, 1e9), (6, 20, 40.0), (3, 4, -1e9)])
def test_loop_matches_onnxruntime(compiled_loop, n, trips, limit):
    """Zero trips (the initial values come out, the scan output is empty), a for loop that
    runs to M, a loop that the condition stops early, and one whose first condition is false."""
    model, compiled = compiled_loop
    rng = np.random.default_rng(n * 31 + trips)
    feeds = {"x0": rng.normal(0, 1, n).astype(np.float32), "acc0": rng.normal(0, 1, n).astype(np.float32),
             "w": rng.normal(0, 1, n).astype(np.float32), "M": np.array(trips, np.int64),
             "cond": np.array(limit > 0), "limit": np.array(limit, np.float32)}
    want_y, want_scans = _ort(model, feeds)
    got = compiled.run(feeds)
    if want_scans.size == 0:  # no iteration: onnxruntime stacks nothing as [0, 0]; the output's type is [0, n]
        assert got["scans"].shape == (0, n)
    else:
        assert got["scans"].shape == want_scans.shape
    assert got["y"].shape == want_y.shape
    np.testing.assert_allclose(got["y"], want_y, rtol=1e-5, atol=1e-5)
    if want_scans.size:
        np.testing.assert_allclose(got["scans"], want_scans, rtol=1e-5, atol=1e-5)


# ---- Scan -------------------------------------------------------------------------------------
def scan_model() -> onnx.ModelProto:
    """A Scan over xs: f32[batch, seq, 4] along axis 1, backwards: state h (f32[batch, 4]) is
    h = tanh(h @ u + x_t + b) with u, b read from outside (b computed: a capture); the scan
    output h * 2 is stacked along axis 1 (scan_output_axes), forwards."""
    body = helper.make_graph(
        [
            helper.make_node("MatMul", ["h_in", "u"], ["hu"]),
            helper.make_node("Add", ["hu", "x_t"], ["pre"]),
            helper.make_node("Add", ["pre", "b"], ["pre_b"]),
            helper.make_node("Tanh", ["pre_b"], ["h_out"]),
            helper.make_node("Add", ["h_out", "h_out"], ["y_t"]),
        ],
        "step",
        [helper.make_tensor_value_info("h_in", F, ["batch", 4]), helper.make_tensor_value_info("x_t", F, ["batch", 4])],
        [helper.make_tensor_value_info("h_out", F, ["batch", 4]),
         helper.make_tensor_value_info("y_t", F, ["batch", 4])])
    nodes = [
        helper.make_node("Sigmoid", ["b0"], ["b"]),
        helper.make_node("Scan", ["h0", "xs"], ["h", "ys"], body=body, num_scan_inputs=1, scan_input_axes=[1],
                         scan_input_directions=[1], scan_output_axes=[1]),
    ]
    rng = np.random.default_rng(0)
    inits = [helper.make_tensor("u", F, [4, 4], rng.normal(0, 0.5, 16).tolist())]
    return _model(nodes, "scan", [helper.make_tensor_value_info("h0", F, ["batch", 4]),
                                  helper.make_tensor_value_info("xs", F, ["batch", "seq", 4]),
                                  helper.make_tensor_value_info("b0", F, [4])],
                  [helper.make_tensor_value_info("h", F, ["batch", 4]),
                   helper.make_tensor_value_info("ys", F, ["batch", "seq", 4])], inits)


@pytest.fixture(scope="module")
def compiled_scan():
    model = scan_model()
    return model, egraft.compile(model.SerializeToString(), use_cache=False)


def test_scan_body_is_compiled(compiled_scan):
    _, compiled = compiled_scan
    assert {s.node.op: s.kind for s in compiled.steps}["Scan"] == "control"
    _assert_bodies_compiled(compiled, 1)


@pytest.mark.parametrize("batch, seq", [(1, 1), (2, 5), (3, 12)])  # seq 0 crashes onnxruntime (SIGFPE)
def test_scan_matches_onnxruntime(compiled_scan, batch, seq):
    model, compiled = compiled_scan
    rng = np.random.default_rng(batch * 10 + seq)
    feeds = {"h0": rng.normal(0, 1, (batch, 4)).astype(np.float32),
             "xs": rng.normal(0, 1, (batch, seq, 4)).astype(np.float32),
             "b0": rng.normal(0, 1, 4).astype(np.float32)}
    want_h, want_ys = _ort(model, feeds)
    got = compiled.run(feeds)
    assert got["ys"].shape == want_ys.shape == (batch, seq, 4)
    np.testing.assert_allclose(got["h"], want_h, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(got["ys"], want_ys, rtol=1e-5, atol=1e-6)


# ---- the compiled-model cache keeps the bodies ------------------------------------------------
def test_bodies_survive_the_compile_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("EGRAFT_CACHE_DIR", str(tmp_path))
    model = loop_with_nested_if().SerializeToString()
    first = egraft.compile(model)
    second = egraft.compile(model)
    assert second.cache_hit and not first.cache_hit
    _assert_bodies_compiled(second, 1)
    feeds = {"x0": np.arange(3, dtype=np.float32), "acc0": np.ones(3, np.float32), "w": np.full(3, 0.5, np.float32),
             "M": np.array(4, np.int64), "cond": np.array(True), "limit": np.array(1e9, np.float32)}
    np.testing.assert_array_equal(first.run(feeds)["scans"], second.run(feeds)["scans"])


def test_a_body_that_cannot_be_compiled_falls_back_with_the_reason(monkeypatch):
    """When lowering a body fails, the node runs on the interpreter, and the report says why."""
    from egraft.errors import EgraftError
    from egraft.lowering import compile as lowering

    real_lower = lowering.lower

    def lower(graph):
        if graph.name.startswith("If"):
            raise EgraftError("no luck")
        return real_lower(graph)

    monkeypatch.setattr(lowering, "lower", lower)
    model = if_with_captures()
    graph = egraft.load(model.SerializeToString())
    compiled = lowering.compile_lowered(real_lower(graph), use_cache=False)
    (fallback,) = compiled.report().fallbacks
    assert fallback[1] == "If" and "its else_branch cannot be compiled: no luck" in fallback[2]
    x = np.ones((2, 8), np.float32)
    bias = np.zeros(8, np.float32)
    (want,) = _ort(model, {"x": x, "bias": bias})
    np.testing.assert_allclose(compiled.run({"x": x, "bias": bias})["z"], want, rtol=1e-5)


# ---- bodies typed again with the outer types; constants folded in bodies --------------------------
def rank_by_length() -> onnx.ModelProto:
    """y = Squeeze(x, 1) if x's length n is 1 else x (x: f32[1, n]): y's rank is known only
    at run time. Then z = If(flag) with a then_branch that reads y, asks its rank (Size of
    Shape) and makes it 2-D again by a nested If, then Tanh; else_branch: Neg(y) as one row. Bound
    with ``shape={"n": ...}``, the conditions are known when compiling and every node is
    typed (the nested If too, once the branch is typed again with y's type), and an If whose
    condition is known is replaced by its branch."""
    y_then = helper.make_graph([helper.make_node("Squeeze", ["x", "axis1"], ["sq"])], "squeeze", [],
                               [helper.make_tensor_value_info("sq", F, None)])
    y_else = helper.make_graph([helper.make_node("Identity", ["x"], ["same"])], "same", [],
                               [helper.make_tensor_value_info("same", F, None)])
    two_d = helper.make_graph([helper.make_node("Identity", ["y"], ["y2"])], "two_d", [],
                              [helper.make_tensor_value_info("y2", F, None)])
    one_d = helper.make_graph([helper.make_node("Unsqueeze", ["y", "axis1"], ["y1"])], "one_d", [],
                              [helper.make_tensor_value_info("y1", F, None)])
    z_then = helper.make_graph(
        [helper.make_node("Shape", ["y"], ["ys"]), helper.make_node("Size", ["ys"], ["rank"]),
         helper.make_node("Equal", ["rank", "two"], ["is2"]),
         helper.make_node("If", ["is2"], ["w"], then_branch=two_d, else_branch=one_d),
         helper.make_node("Tanh", ["w"], ["zt"])],
        "z_then", [], [helper.make_tensor_value_info("zt", F, None)])
    z_else = helper.make_graph([helper.make_node("Neg", ["y"], ["ny"]),
                                helper.make_node("Reshape", ["ny", "row"], ["ze"])],
                               "z_else", [], [helper.make_tensor_value_info("ze", F, None)])
    nodes = [
        helper.make_node("Shape", ["x"], ["xs"]),
        helper.make_node("Gather", ["xs", "one"], ["n"]),
        helper.make_node("Equal", ["n", "one"], ["n_is_1"]),
        helper.make_node("If", ["n_is_1"], ["y"], then_branch=y_then, else_branch=y_else),
        helper.make_node("If", ["flag"], ["z"], then_branch=z_then, else_branch=z_else),
        helper.make_node("Mul", ["z", "half"], ["out"]),
    ]
    inits = [helper.make_tensor("axis1", I64, [1], [1]), helper.make_tensor("one", I64, [], [1]),
             helper.make_tensor("two", I64, [], [2]), helper.make_tensor("half", F, [], [0.5]),
             helper.make_tensor("row", I64, [2], [1, -1])]
    return _model(nodes, "rank_by_length", [helper.make_tensor_value_info("x", F, [1, "n"]),
                                            helper.make_tensor_value_info("flag", B, [])],
                  [helper.make_tensor_value_info("out", F, None)], inits)


@pytest.mark.parametrize("n", [1, 6])
def test_bound_dims_type_the_bodies_again(n):
    model = rank_by_length()
    generic = egraft.compile(model.SerializeToString(), use_cache=False)
    assert any("known only at run time" in reason for _, _, reason in generic.report().fallbacks)  # Mul
    bound = egraft.compile(model.SerializeToString(), use_cache=False, shape={"n": n})
    # the If on n's value is known: its branch is inlined; z's If stays, its nested If is inlined
    _assert_bodies_compiled(bound, 1)
    assert [s.node.op for s in bound.steps].count("If") == 1
    assert {s.node.op: s.kind for s in bound.steps}["Mul"] == "kernel"
    then_body = bound.bodies()[next(k for k in bound.bodies() if k.endswith("then_branch"))]
    assert "If" not in {s.node.op for s in then_body.steps} and "Tanh" in {s.node.op for s in then_body.steps}
    x = np.random.default_rng(n).normal(0, 1, (1, n)).astype(np.float32)
    for flag in (True, False):
        feeds = {"x": x, "flag": np.array(flag)}
        (want,) = _ort(model, feeds)
        for compiled in (generic, bound):
            got = compiled.run(feeds)["out"]
            assert got.shape == want.shape
            np.testing.assert_allclose(got, want, rtol=1e-6)


def test_ifs_inside_an_inlined_branch_are_inlined_too():
    """silero's LSTM state checks: an If whose condition shape arithmetic decides holds
    another such If in its branch. Bound, both are known: the whole model is one native
    schedule with no control step (the inner If used to stay: inlining was one round)."""
    rank_two = helper.make_graph([helper.make_node("Tanh", ["x"], ["t"])], "rank_two", [],
                                 [helper.make_tensor_value_info("t", F, None)])
    other_rank = helper.make_graph([helper.make_node("Neg", ["x"], ["g"])], "other_rank", [],
                                   [helper.make_tensor_value_info("g", F, None)])
    outer_then = helper.make_graph(
        [helper.make_node("Shape", ["x"], ["xs2"]), helper.make_node("Size", ["xs2"], ["rank"]),
         helper.make_node("Equal", ["rank", "two"], ["is2"]),
         helper.make_node("If", ["is2"], ["inner"], then_branch=rank_two, else_branch=other_rank)],
        "outer_then", [], [helper.make_tensor_value_info("inner", F, None)])
    outer_else = helper.make_graph([helper.make_node("Identity", ["x"], ["same"])], "outer_else", [],
                                   [helper.make_tensor_value_info("same", F, None)])
    nodes = [helper.make_node("Shape", ["x"], ["xs"]), helper.make_node("Gather", ["xs", "one"], ["n"]),
             helper.make_node("Equal", ["n", "four"], ["n_is_4"]),
             helper.make_node("If", ["n_is_4"], ["y"], then_branch=outer_then, else_branch=outer_else),
             helper.make_node("Mul", ["y", "half"], ["out"])]
    inits = [helper.make_tensor("one", I64, [], [1]), helper.make_tensor("two", I64, [], [2]),
             helper.make_tensor("four", I64, [], [4]), helper.make_tensor("half", F, [], [0.5])]
    model = _model(nodes, "nested_known", [helper.make_tensor_value_info("x", F, [1, "n"])],
                   [helper.make_tensor_value_info("out", F, None)], inits)
    for n in (4, 3):
        bound = egraft.compile(model.SerializeToString(), use_cache=False, shape={"n": n}, specialize="off")
        assert bound.report().controls == 0 and not bound.bodies()
        assert {s.node.op for s in bound.steps} & {"Tanh", "Identity"}
        x = np.random.default_rng(n).normal(0, 1, (1, n)).astype(np.float32)
        (want,) = _ort(model, {"x": x})
        np.testing.assert_allclose(bound.run({"x": x})["out"], want, rtol=1e-6)
        assert len(bound.run_schedule({"n": n}).segments) == 1  # one native call


def test_waiting_for_a_specialized_variant_waits_for_its_rank_variants():
    """A specialized variant whose If outputs still have a rank only runs know (the If is on
    the data: x's sum) builds its rank variant after its first run; ``wait`` covers that
    build too, so a benchmark that waits times the program that will serve."""
    rows = helper.make_graph([helper.make_node("Identity", ["x"], ["kept"])], "rows", [],
                             [helper.make_tensor_value_info("kept", F, None)])
    flat = helper.make_graph([helper.make_node("Squeeze", ["x", "axis0"], ["flat"])], "flat", [],
                             [helper.make_tensor_value_info("flat", F, None)])
    model = _model([helper.make_node("ReduceSum", ["x"], ["total"], keepdims=0),
                    helper.make_node("Greater", ["total", "zero"], ["flag"]),
                    helper.make_node("If", ["flag"], ["y"], then_branch=rows, else_branch=flat),
                    helper.make_node("Mul", ["y", "half"], ["out"])], "rank_by_sum",
                   [helper.make_tensor_value_info("x", F, [1, "n"])], [helper.make_tensor_value_info("out", F, None)],
                   [helper.make_tensor("axis0", I64, [1], [0]), helper.make_tensor("half", F, [], [0.5]),
                    helper.make_tensor("zero", F, [], [0.0])])
    compiled = egraft.compile(model.SerializeToString(), use_cache=False, specialize="auto")
    x = np.abs(np.random.default_rng(3).normal(0, 1, (1, 6))).astype(np.float32)
    feeds = {"x": x}
    (want,) = _ort(model, feeds)
    for _ in range(2):  # the first call asks for the variant; the second runs it and asks for its rank variant
        np.testing.assert_allclose(compiled.run(feeds)["out"], want, rtol=1e-6)
        compiled.wait(timeout=300)
    (variant,) = compiled.built.values()
    assert len(variant.variants()) == 1
    np.testing.assert_allclose(compiled.run(feeds)["out"], want, rtol=1e-6)


def test_constant_computations_in_a_body_are_folded():
    """A Loop body multiplies its state by Transpose(Concat(a, b)) of constants: computed once
    when compiling (the body's program has no Transpose or Concat step)."""
    body = helper.make_graph(
        [helper.make_node("Concat", ["a", "b"], ["ab"], axis=0), helper.make_node("Transpose", ["ab"], ["abt"]),
         helper.make_node("MatMul", ["h_in", "abt"], ["h_out"]),
         helper.make_node("Identity", ["cond_in"], ["cond_out"])],
        "body", [helper.make_tensor_value_info("i", I64, []), helper.make_tensor_value_info("cond_in", B, []),
                 helper.make_tensor_value_info("h_in", F, ["batch", 4])],
        [helper.make_tensor_value_info("cond_out", B, []), helper.make_tensor_value_info("h_out", F, ["batch", 4])],
        initializer=[helper.make_tensor("a", F, [2, 4], np.linspace(-0.5, 0.5, 8).tolist()),
                     helper.make_tensor("b", F, [2, 4], np.linspace(0.6, -0.4, 8).tolist())])
    model = _model([helper.make_node("Loop", ["M", "", "h0"], ["h"], body=body)], "folded",
                   [helper.make_tensor_value_info("M", I64, []), helper.make_tensor_value_info("h0", F, ["batch", 4])],
                   [helper.make_tensor_value_info("h", F, ["batch", 4])])
    compiled = egraft.compile(model.SerializeToString(), use_cache=False)
    _assert_bodies_compiled(compiled, 1)
    (program,) = compiled.bodies().values()
    assert not {"Concat", "Transpose"} & {s.node.op for s in program.steps}
    for batch, trips in ((1, 3), (5, 4)):
        feeds = {"M": np.array(trips, np.int64), "h0": np.random.default_rng(batch).normal(0, 1, (batch, 4))
                 .astype(np.float32)}
        (want,) = _ort(model, feeds)
        np.testing.assert_allclose(compiled.run(feeds)["h"], want, rtol=1e-5, atol=1e-6)


def test_ranks_a_run_shows_give_a_variant():
    """Without bound dims y's rank is known only at run time, so the nodes after it fall back
    in the generic build. A run notes y's rank and compiles a variant typed with it (every
    node then has generated code); a call where y has the other rank fails the variant's
    check, runs generically and adds the second variant, each built in the background while
    the generic program serves. Every result matches onnxruntime."""
    model = rank_by_length()
    compiled = egraft.compile(model.SerializeToString(), use_cache=False)
    assert compiled.variants() == []
    for n, flag in [(6, True), (6, False), (1, True), (1, False), (9, True)]:
        x = np.random.default_rng(n).normal(0, 1, (1, n)).astype(np.float32)
        feeds = {"x": x, "flag": np.array(flag)}
        (want,) = _ort(model, feeds)
        got = compiled.run(feeds)["out"]
        assert got.shape == want.shape
        np.testing.assert_allclose(got, want, rtol=1e-6)
        compiled.wait(timeout=300)  # variants build in a worker process: the call did not wait for it
    variants = compiled.variants()
    assert len(variants) == 2  # y: f32[1, n] (n > 1) and f32[1] (n == 1)
    for variant in variants:
        _assert_bodies_compiled(variant, 2)
        assert {s.node.op: s.kind for s in variant.steps}["Mul"] == "kernel"


def test_opset8_scan_with_sequence_lengths():
    """Opset-8 Scan: batched, each batch entry scanned over its own length (sequence_lens);
    the body (a running sum times a captured scale) is compiled."""
    body = helper.make_graph(
        [helper.make_node("Add", ["s_in", "x_t"], ["s_out"]), helper.make_node("Mul", ["s_out", "scale"], ["y_t"])],
        "sum", [helper.make_tensor_value_info("s_in", F, [3]), helper.make_tensor_value_info("x_t", F, [3])],
        [helper.make_tensor_value_info("s_out", F, [3]), helper.make_tensor_value_info("y_t", F, [3])])
    nodes = [helper.make_node("Abs", ["scale0"], ["scale"]),
             helper.make_node("Scan", ["lens", "s0", "xs"], ["s", "ys"], body=body, num_scan_inputs=1)]
    model = _model(nodes, "scan8", [helper.make_tensor_value_info("lens", I64, ["batch"]),
                                    helper.make_tensor_value_info("s0", F, ["batch", 3]),
                                    helper.make_tensor_value_info("xs", F, ["batch", "seq", 3]),
                                    helper.make_tensor_value_info("scale0", F, [3])],
                   [helper.make_tensor_value_info("s", F, ["batch", 3]),
                    helper.make_tensor_value_info("ys", F, ["batch", "seq", 3])], opset=8)
    compiled = egraft.compile(model.SerializeToString(), use_cache=False)
    _assert_bodies_compiled(compiled, 1)
    for batch, seq in ((1, 4), (3, 6)):
        rng = np.random.default_rng(batch)
        feeds = {"lens": rng.integers(1, seq + 1, batch).astype(np.int64),
                 "s0": rng.normal(0, 1, (batch, 3)).astype(np.float32),
                 "xs": rng.normal(0, 1, (batch, seq, 3)).astype(np.float32),
                 "scale0": rng.normal(0, 1, 3).astype(np.float32)}
        want_s, want_ys = _ort(model, feeds)
        got = compiled.run(feeds)
        np.testing.assert_allclose(got["s"], want_s, rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(got["ys"], want_ys, rtol=1e-5, atol=1e-6)

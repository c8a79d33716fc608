"""If, Loop and Scan: egraft against onnxruntime, and inference of the body types."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from conftest import check_against_onnxruntime
from onnx import TensorProto, helper

import egraft
from egraft.errors import ShapeInferenceError

F, I64, B = TensorProto.FLOAT, TensorProto.INT64, TensorProto.BOOL


def _vi(name: str, elem: int = F, shape=None) -> onnx.ValueInfoProto:
    return helper.make_tensor_value_info(name, elem, shape)


def _untyped(name: str) -> onnx.ValueInfoProto:
    return onnx.ValueInfoProto(name=name)


def _model(nodes, inputs, outputs, opset: int, initializers=None) -> onnx.ModelProto:
    graph = helper.make_graph(nodes, "main", inputs, outputs, initializer=initializers or [])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])


def _check(model: onnx.ModelProto, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Run with egraft and onnxruntime; the outputs must agree."""
    return check_against_onnxruntime(model, feeds, rtol=1e-6, atol=1e-6)


# ---- If ----------------------------------------------------------------------------------------
def _if_model(x_shape, then_nodes, then_out, else_nodes, else_out, opset=13, cond_init=None):
    then_g = helper.make_graph(then_nodes, "then", [], [then_out])
    else_g = helper.make_graph(else_nodes, "else", [], [else_out])
    node = helper.make_node("If", ["cond"], ["y"], then_branch=then_g, else_branch=else_g)
    inputs = [_vi("x", F, x_shape)]
    inits = []
    if cond_init is None:
        inputs.append(_vi("cond", B, []))
    else:
        inits.append(onnx.numpy_helper.from_array(np.array(cond_init), "cond"))
    return _model([node], inputs, [_vi("y", F, None)], opset, inits)


def test_if_branches_of_different_shapes():
    then_nodes = [helper.make_node("Mul", ["x", "x"], ["t"])]
    else_nodes = [helper.make_node("Concat", ["x", "x"], ["e"], axis=0)]
    model = _if_model([3], then_nodes, _vi("t"), else_nodes, _vi("e"))
    graph = egraft.load(model)
    (dim,) = graph.outputs[0].type.shape
    assert not isinstance(dim, int)  # 3 or 6: a fresh symbol
    x = np.array([1.0, -2.0, 3.0], np.float32)
    for cond in (True, False):
        _check(model, {"x": x, "cond": np.array(cond)})


def test_if_keeps_dims_the_branches_agree_on():
    then_nodes = [helper.make_node("Relu", ["x"], ["t"])]
    else_nodes = [helper.make_node("Neg", ["x"], ["e"])]
    model = _if_model(["batch", 4], then_nodes, _vi("t"), else_nodes, _vi("e"))
    graph = egraft.load(model)
    assert str(graph.outputs[0].type) == "f32[batch, 4]"
    x = np.random.default_rng(0).standard_normal((2, 4)).astype(np.float32)
    for cond in (True, False):
        _check(model, {"x": x, "cond": np.array(cond)})


def test_if_with_a_constant_condition_takes_that_branch_type():
    then_nodes = [helper.make_node("Relu", ["x"], ["t"])]
    else_nodes = [helper.make_node("Concat", ["x", "x"], ["e"], axis=1)]
    model = _if_model([2, 3], then_nodes, _vi("t"), else_nodes, _vi("e"), cond_init=False)
    graph = egraft.load(model)
    assert str(graph.outputs[0].type) == "f32[2, 6]"
    _check(model, {"x": np.ones((2, 3), np.float32)})


def test_if_branches_of_different_dtypes_are_rejected():
    then_nodes = [helper.make_node("Relu", ["x"], ["t"])]
    else_nodes = [helper.make_node("Cast", ["x"], ["e"], to=TensorProto.INT64)]
    model = _if_model([2], then_nodes, _vi("t"), else_nodes, _vi("e", I64))
    with pytest.raises(ShapeInferenceError, match="i64"):
        egraft.load(model)


# ---- Loop --------------------------------------------------------------------------------------
def _loop_body(extra_nodes, outputs, carried_inputs):
    """A body (iter, cond, carried...) -> (cond_out, ...); cond_out = cond unless nodes define it."""
    inputs = [_vi("i", I64, []), _vi("c", B, [])]
    nodes = list(extra_nodes)
    if not any("c_out" in n.output for n in nodes):
        nodes.append(helper.make_node("Identity", ["c"], ["c_out"]))
    return helper.make_graph(nodes, "body", inputs + carried_inputs, [_vi("c_out", B, [])] + outputs)


def _accumulate_body(typed=True):
    """acc += x * i (x read from the enclosing graph); scan output: acc at each iteration."""
    nodes = [
        helper.make_node("Cast", ["i"], ["fi"], to=F),
        helper.make_node("Mul", ["x", "fi"], ["xi"]),
        helper.make_node("Add", ["acc", "xi"], ["acc_out"]),
        helper.make_node("Identity", ["acc_out"], ["scan"]),
    ]
    carried = [_vi("acc", F, [2]) if typed else _untyped("acc")]
    return _loop_body(nodes, [_vi("acc_out"), _vi("scan")], carried)


@pytest.mark.parametrize("trips", [0, 1, 4])
def test_loop_for(trips):
    node = helper.make_node("Loop", ["M", "", "acc0"], ["acc", "scan"], body=_accumulate_body())
    model = _model([node], [_vi("M", I64, []), _vi("x", F, [2]), _vi("acc0", F, [2])],
                   [_vi("acc", F, None), _vi("scan", F, None)], 13)
    feeds = {"M": np.array(trips, np.int64), "x": np.array([1.5, -2], np.float32),
             "acc0": np.array([0.25, 4], np.float32)}
    got = _check(model, feeds)
    assert got["scan"].shape == (trips, 2)


def test_loop_for_with_a_constant_trip_count_gives_a_static_scan_dim():
    node = helper.make_node("Loop", ["M", "", "acc0"], ["acc", "scan"], body=_accumulate_body())
    m = onnx.numpy_helper.from_array(np.array(5, np.int64), "M")
    model = _model([node], [_vi("x", F, [2]), _vi("acc0", F, [2])], [_vi("acc"), _vi("scan")], 13, [m])
    graph = egraft.load(model)
    assert [str(v.type) for v in graph.outputs] == ["f32[2]", "f32[5, 2]"]
    _check(model, {"x": np.array([1, 2], np.float32), "acc0": np.zeros(2, np.float32)})


def test_loop_while_stops_on_the_body_condition():
    # while acc < limit: acc += x; cond_out = (acc_out < limit)
    nodes = [
        helper.make_node("Add", ["acc", "x"], ["acc_out"]),
        helper.make_node("Less", ["acc_out", "limit"], ["c_out"]),
        helper.make_node("Identity", ["acc_out"], ["scan"]),
    ]
    body = _loop_body(nodes, [_vi("acc_out", F, []), _vi("scan", F, [])], [_vi("acc", F, [])])
    node = helper.make_node("Loop", ["", "cond", "acc0"], ["acc", "scan"], body=body)
    model = _model([node], [_vi("cond", B, []), _vi("x", F, []), _vi("limit", F, []), _vi("acc0", F, [])],
                   [_vi("acc"), _vi("scan")], 11)
    for cond in (True, False):
        feeds = {"cond": np.array(cond), "x": np.array(1.5, np.float32), "limit": np.array(7, np.float32),
                 "acc0": np.array(0, np.float32)}
        got = _check(model, feeds)
        assert got["scan"].shape == ((5,) if cond else (0,))


def test_loop_with_trip_count_and_condition():
    nodes = [
        helper.make_node("Add", ["acc", "x"], ["acc_out"]),
        helper.make_node("Less", ["acc_out", "limit"], ["c_out"]),
    ]
    body = _loop_body(nodes, [_vi("acc_out", F, [])], [_vi("acc", F, [])])
    node = helper.make_node("Loop", ["M", "cond", "acc0"], ["acc"], body=body)
    model = _model([node], [_vi("M", I64, []), _vi("cond", B, []), _vi("x", F, []), _vi("limit", F, []),
                            _vi("acc0", F, [])], [_vi("acc")], 16)
    for m in (2, 10):
        feeds = {"M": np.array(m, np.int64), "cond": np.array(True), "x": np.array(1.0, np.float32),
                 "limit": np.array(4.5, np.float32), "acc0": np.array(0, np.float32)}
        _check(model, feeds)


def test_loop_with_untyped_body_inputs():
    # like the expanded Range function: the body declares no type for its loop-carried input
    node = helper.make_node("Loop", ["M", "", "acc0"], ["acc", "scan"], body=_accumulate_body(typed=False))
    model = _model([node], [_vi("M", I64, []), _vi("x", F, [2]), _vi("acc0", F, [2])], [_vi("acc"), _vi("scan")], 13)
    graph = egraft.load(model)
    assert str(graph.outputs[0].type) == "f32[2]"
    _check(model, {"M": np.array(3, np.int64), "x": np.array([1, 2], np.float32), "acc0": np.ones(2, np.float32)})


def test_loop_carried_value_that_grows():
    nodes = [helper.make_node("Concat", ["seq", "x"], ["seq_out"], axis=0)]
    body = _loop_body(nodes, [_vi("seq_out", F, [None])], [_vi("seq", F, [None])])
    node = helper.make_node("Loop", ["M", "", "seq0"], ["seq"], body=body)
    model = _model([node], [_vi("M", I64, []), _vi("x", F, [2]), _vi("seq0", F, [1])], [_vi("seq")], 13)
    graph = egraft.load(model)
    (dim,) = graph.outputs[0].type.shape
    assert not isinstance(dim, int)
    feeds = {"M": np.array(3, np.int64), "x": np.array([1, 2], np.float32), "seq0": np.zeros(1, np.float32)}
    got = _check(model, feeds)
    assert got["seq"].shape == (7,)


def test_loop_symbolic_carried_shape():
    nodes = [helper.make_node("Add", ["h", "x"], ["h_out"]), helper.make_node("Relu", ["h_out"], ["scan"])]
    body = _loop_body(nodes, [_vi("h_out"), _vi("scan")], [_vi("h", F, None)])
    node = helper.make_node("Loop", ["M", "", "h0"], ["h", "scan"], body=body)
    m = onnx.numpy_helper.from_array(np.array(3, np.int64), "M")
    model = _model([node], [_vi("x", F, ["batch", 4]), _vi("h0", F, ["batch", 4])], [_vi("h"), _vi("scan")], 13, [m])
    graph = egraft.load(model)
    assert [str(v.type) for v in graph.outputs] == ["f32[batch, 4]", "f32[3, batch, 4]"]
    rng = np.random.default_rng(1)
    _check(model, {"x": rng.standard_normal((2, 4)).astype(np.float32),
                   "h0": rng.standard_normal((2, 4)).astype(np.float32)})


def test_nested_if_in_loop_reads_outer_values():
    # acc += x if i is even else -x: the If branch reads x (main graph) and acc (the body)
    then_g = helper.make_graph([helper.make_node("Add", ["acc", "x"], ["t"])], "then", [], [_vi("t")])
    else_g = helper.make_graph([helper.make_node("Sub", ["acc", "x"], ["e"])], "else", [], [_vi("e")])
    two = helper.make_tensor("two", I64, [], [2])
    zero = helper.make_tensor("zero", I64, [], [0])
    nodes = [
        helper.make_node("Constant", [], ["k2"], value=two),
        helper.make_node("Constant", [], ["k0"], value=zero),
        helper.make_node("Mod", ["i", "k2"], ["r"]),
        helper.make_node("Equal", ["r", "k0"], ["even"]),
        helper.make_node("If", ["even"], ["acc_out"], then_branch=then_g, else_branch=else_g),
    ]
    body = _loop_body(nodes, [_vi("acc_out", F, [2])], [_vi("acc", F, [2])])
    node = helper.make_node("Loop", ["M", "", "acc0"], ["acc"], body=body)
    model = _model([node], [_vi("M", I64, []), _vi("x", F, [2]), _vi("acc0", F, [2])], [_vi("acc")], 13)
    graph = egraft.load(model)
    assert str(graph.outputs[0].type) == "f32[2]"
    _check(model, {"M": np.array(5, np.int64), "x": np.array([1, 3], np.float32), "acc0": np.zeros(2, np.float32)})


# ---- Scan --------------------------------------------------------------------------------------
def _sum_body(state_shape, slice_shape):
    """state += slice; scan outputs: the running sum and the slice times two."""
    nodes = [helper.make_node("Add", ["s", "v"], ["s_out"]), helper.make_node("Identity", ["s_out"], ["run"]),
             helper.make_node("Add", ["v", "v"], ["twice"])]
    return helper.make_graph(nodes, "body", [_vi("s", F, state_shape), _vi("v", F, slice_shape)],
                             [_vi("s_out", F, state_shape), _vi("run", F, state_shape), _vi("twice", F, slice_shape)])


SCAN_AXES = [(0, 0, [0, 0], [0, 0]), (1, 1, [1, 1], [1, 0]), (1, 0, [0, 1], [0, 1])]
NEGATIVE_SCAN_AXES = [(-1, 1, [1, -1], [1, 0]), (-2, 0, [-2, -1], [0, 1])]  # from opset 11
SCAN_CASES = [(9, *a) for a in SCAN_AXES] + [(o, *a) for o in (11, 16) for a in SCAN_AXES + NEGATIVE_SCAN_AXES]


@pytest.mark.parametrize(("opset", "in_axis", "in_dir", "out_axes", "out_dirs"), SCAN_CASES)
def test_scan(opset, in_axis, in_dir, out_axes, out_dirs):
    x_shape = [4, 3]
    slice_shape = [x_shape[1 - (in_axis % 2)]]
    node = helper.make_node("Scan", ["s0", "x"], ["s", "run", "twice"], body=_sum_body(slice_shape, slice_shape),
                            num_scan_inputs=1, scan_input_axes=[in_axis], scan_input_directions=[in_dir],
                            scan_output_axes=out_axes, scan_output_directions=out_dirs)
    model = _model([node], [_vi("s0", F, slice_shape), _vi("x", F, x_shape)], [_vi("s"), _vi("run"), _vi("twice")],
                   opset)
    rng = np.random.default_rng(2)
    feeds = {"s0": rng.standard_normal(slice_shape).astype(np.float32),
             "x": rng.standard_normal(x_shape).astype(np.float32)}
    graph = egraft.load(model)
    inferred = onnx.shape_inference.infer_shapes(model, strict_mode=True)
    onnx_shapes = [[d.dim_value for d in vi.type.tensor_type.shape.dim] for vi in inferred.graph.output]
    assert [list(v.type.shape) for v in graph.outputs] == onnx_shapes
    _check(model, feeds)


def test_scan_symbolic_sequence():
    node = helper.make_node("Scan", ["s0", "x"], ["s", "run", "twice"], body=_sum_body([3], [3]), num_scan_inputs=1)
    model = _model([node], [_vi("s0", F, [3]), _vi("x", F, ["seq", 3])], [_vi("s"), _vi("run"), _vi("twice")], 11)
    graph = egraft.load(model)
    assert [str(v.type) for v in graph.outputs] == ["f32[3]", "f32[seq, 3]", "f32[seq, 3]"]
    rng = np.random.default_rng(3)
    feeds = {"s0": rng.standard_normal(3).astype(np.float32), "x": rng.standard_normal((5, 3)).astype(np.float32)}
    _check(model, feeds)


def test_scan_untyped_body_inputs():
    nodes = [helper.make_node("Add", ["s", "v"], ["s_out"]), helper.make_node("Identity", ["s_out"], ["run"])]
    body = helper.make_graph(nodes, "body", [_untyped("s"), _untyped("v")], [_vi("s_out"), _vi("run")])
    node = helper.make_node("Scan", ["s0", "x"], ["s", "run"], body=body, num_scan_inputs=1, scan_input_axes=[1])
    model = _model([node], [_vi("s0", F, [4]), _vi("x", F, [4, 6])], [_vi("s"), _vi("run")], 11)
    graph = egraft.load(model)
    assert [str(v.type) for v in graph.outputs] == ["f32[4]", "f32[6, 4]"]
    rng = np.random.default_rng(4)
    feeds = {"s0": rng.standard_normal(4).astype(np.float32), "x": rng.standard_normal((4, 6)).astype(np.float32)}
    _check(model, feeds)


@pytest.mark.parametrize("with_lens", [False, True])
def test_scan8_batched(with_lens):
    node = helper.make_node("Scan", ["lens" if with_lens else "", "s0", "x"], ["s", "run", "twice"],
                            body=_sum_body([3], [3]), num_scan_inputs=1, directions=[1])
    inputs = [_vi("s0", F, ["batch", 3]), _vi("x", F, ["batch", 5, 3])]
    if with_lens:
        inputs.insert(0, _vi("lens", I64, ["batch"]))
    model = _model([node], inputs, [_vi("s"), _vi("run"), _vi("twice")], 8)
    graph = egraft.load(model)
    assert [str(v.type) for v in graph.outputs] == ["f32[batch, 3]", "f32[batch, 5, 3]", "f32[batch, 5, 3]"]
    rng = np.random.default_rng(5)
    feeds = {"s0": rng.standard_normal((2, 3)).astype(np.float32),
             "x": rng.standard_normal((2, 5, 3)).astype(np.float32)}
    if with_lens:
        feeds["lens"] = np.array([5, 3], np.int64)
    _check(model, feeds)


def test_scan_wrong_body_arity_is_reported():
    node = helper.make_node("Scan", ["s0", "x"], ["s", "run", "twice"], body=_sum_body([3], [3]), num_scan_inputs=3)
    model = _model([node], [_vi("s0", F, [3]), _vi("x", F, [4, 3])], [_vi("s"), _vi("run"), _vi("twice")], 11)
    with pytest.raises(ShapeInferenceError, match="num_scan_inputs|inputs"):
        egraft.load(model)


# ---- dims named inside a body ------------------------------------------------------------------
def _check_both_backends(model: onnx.ModelProto, feeds: dict[str, np.ndarray]) -> None:
    """The reference executor and the compiled model agree with onnxruntime."""
    from conftest import run_onnxruntime

    want = run_onnxruntime(model, feeds)
    for backend, got in (("reference", egraft.load(model).run(feeds)),
                         ("compiled", egraft.compile(model, use_cache=False).run(feeds))):
        for name, value in want.items():
            assert got[name].shape == value.shape, (backend, name)
            np.testing.assert_allclose(got[name], value, rtol=1e-6, atol=1e-6, err_msg=f"{backend} {name}")


def _tf2onnx_style_loop(x: str, out_final: str, out_scan: str) -> onnx.NodeProto:
    """A Loop over 3 iterations whose body declares its carried value with its own dim name
    (``unk__5``, as tf2onnx writes): v += 1, scan output 2 v."""
    body = helper.make_graph(
        [helper.make_node("Add", ["v", "one"], ["v_out"]), helper.make_node("Mul", ["v", "two"], ["w"]),
         helper.make_node("Identity", ["c"], ["c_out"])], "body",
        [_vi("i", I64, []), _vi("c", B, []), _vi("v", F, ["unk__5"])],
        [_vi("c_out", B, []), _vi("v_out", F, ["unk__5"]), _vi("w", F, ["unk__6"])],
        [helper.make_tensor("one", F, [], [1.0]), helper.make_tensor("two", F, [], [2.0])])
    return helper.make_node("Loop", ["M", "", x], [out_final, out_scan], body=body)


def test_a_body_local_dim_name_does_not_leak_into_the_outer_graph():
    nodes = [_tf2onnx_style_loop("x", "v_final", "scan"), helper.make_node("Add", ["scan", "x"], ["y"]),
             helper.make_node("Add", ["v_final", "x"], ["z"])]
    model = _model(nodes, [_vi("x", F, ["n"])], [_vi("y"), _vi("z")], 13, [helper.make_tensor("M", I64, [], [3])])
    graph = egraft.load(model)
    outer = " ".join(str(v.type) for node in graph.nodes for v in node.outputs)
    assert "unk__" not in outer, outer
    assert str(graph.outputs[1].type) == "f32[n]"
    for n in (4, 7):
        _check_both_backends(model, {"x": np.arange(n, dtype=np.float32)})


def test_two_bodies_that_use_one_dim_name_for_different_dims():
    """Both loops call their dim ``unk__5``; outside, they are two unrelated dims."""
    nodes = [_tf2onnx_style_loop("x", "xf", "xs"), _tf2onnx_style_loop("z", "zf", "zs"),
             helper.make_node("Concat", ["xs", "zs"], ["y"], axis=1)]
    model = _model(nodes, [_vi("x", F, ["n"]), _vi("z", F, ["m"])], [_vi("y")], 13,
                   [helper.make_tensor("M", I64, [], [3])])
    _check_both_backends(model, {"x": np.arange(4, dtype=np.float32), "z": np.arange(2, dtype=np.float32)})


# ---- captured outer values ---------------------------------------------------------------------
def _capturing_model() -> onnx.ModelProto:
    """A Loop body, an If's branches and an If nested in the Loop body read ``t``, computed
    by a Transpose in the main graph that nothing else reads."""
    inner_then = helper.make_graph([helper.make_node("Add", ["acc", "t"], ["it"])], "inner_then", [], [_vi("it")])
    inner_else = helper.make_graph([helper.make_node("Sub", ["acc", "t"], ["ie"])], "inner_else", [], [_vi("ie")])
    body = helper.make_graph(
        [helper.make_node("If", ["c"], ["acc_out"], then_branch=inner_then, else_branch=inner_else),
         helper.make_node("Identity", ["c"], ["c_out"])], "body",
        [_vi("i", I64, []), _vi("c", B, []), _vi("acc", F, None)], [_vi("c_out", B, []), _vi("acc_out")])
    then_g = helper.make_graph([helper.make_node("Relu", ["t"], ["tr"])], "then", [], [_vi("tr")])
    else_g = helper.make_graph([helper.make_node("Neg", ["t"], ["tn"])], "else", [], [_vi("tn")])
    nodes = [helper.make_node("Transpose", ["x"], ["t"], perm=[1, 0]),
             helper.make_node("Mul", ["x0", "zero"], ["acc0"]),
             helper.make_node("Loop", ["M", "", "acc0"], ["acc"], body=body),
             helper.make_node("If", ["cond"], ["u"], then_branch=then_g, else_branch=else_g),
             helper.make_node("Add", ["acc", "u"], ["y"])]
    return _model(nodes, [_vi("x", F, ["n", 3]), _vi("x0", F, [3, "n"]), _vi("cond", B, [])], [_vi("y")], 13,
                  [helper.make_tensor("M", I64, [], [3]), helper.make_tensor("zero", F, [], [0.0])])


@pytest.mark.parametrize("cond", [True, False])
def test_captured_values_are_explicit_inputs_through_rewrite_extraction_and_lowering(cond):
    from egraft.optimize import optimize

    model = _capturing_model()
    graph = egraft.load(model)
    loop = next(node for node in graph.nodes if node.op == "Loop")
    assert [v.name for v in loop.inputs[-1:]] == ["t"]  # the capture is an input of the node
    optimized = optimize(graph).graph  # extraction renames every value
    text = str(optimized)
    transposed = next(line for line in text.splitlines() if "Transpose" in line).split(":")[0].strip()
    assert f"Relu({transposed})" in text and f"Add(%acc, {transposed})" in text  # bodies print the outer name
    for n in (4, 1):
        feeds = {"x": np.random.default_rng(n).normal(size=(n, 3)).astype(np.float32),
                 "x0": np.ones((3, n), np.float32), "cond": np.array(cond)}
        _check_both_backends(model, feeds)
        exported = egraft.to_onnx(optimized)  # bodies read the renamed outer values by name
        from conftest import run_onnxruntime

        np.testing.assert_allclose(run_onnxruntime(exported, feeds)["y"], run_onnxruntime(model, feeds)["y"],
                                   rtol=1e-6)


# ---- unknown rank --------------------------------------------------------------------------------
@pytest.mark.parametrize("cond", [True, False])
def test_an_if_whose_branches_differ_in_rank_flows_as_unknown_rank(cond):
    """PyTorch's ``If(rank(x) != 3) Unsqueeze else Identity`` on a condition only the run
    knows: the merged rank is unknown; the ops after it are typed with unknown rank and
    resolved at run time on both backends."""
    then_g = helper.make_graph([helper.make_node("Unsqueeze", ["x", "zero"], ["tu"])], "then", [], [_vi("tu")])
    else_g = helper.make_graph([helper.make_node("Identity", ["x"], ["ti"])], "else", [], [_vi("ti")])
    nodes = [helper.make_node("If", ["cond"], ["u"], then_branch=then_g, else_branch=else_g),
             helper.make_node("Unsqueeze", ["u", "zero"], ["u2"]),
             helper.make_node("Relu", ["u2"], ["r"]),
             helper.make_node("Shape", ["r"], ["s"]),
             helper.make_node("ReduceSum", ["r"], ["y"], keepdims=0),
             helper.make_node("Mul", ["r", "two"], ["z"]),
             helper.make_node("Reshape", ["z", "flat"], ["w"])]
    model = _model(nodes, [_vi("x", F, ["n", 3]), _vi("cond", B, [])], [_vi("y"), _vi("s", I64), _vi("w")], 13,
                   [helper.make_tensor("zero", I64, [1], [0]), helper.make_tensor("two", F, [], [2.0]),
                    helper.make_tensor("flat", I64, [1], [-1])])
    graph = egraft.load(model)
    assert str(graph.nodes[0].outputs[0].type) == "f32[?]" and str(graph.outputs[2].type).startswith("f32[")
    for n in (4, 1):
        _check_both_backends(model, {"x": np.random.default_rng(n).normal(size=(n, 3)).astype(np.float32),
                                     "cond": np.array(cond)})

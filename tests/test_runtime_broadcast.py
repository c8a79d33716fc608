"""Broadcasting decided at run time (issue 15, item 2): where inference cannot prove two
symbolic dims equal or one of them 1, the kernels read each operand with strides computed
from the actual dims (0 where it broadcasts) and the runtime refuses dims that do not
broadcast; anonymous dims (``unk__12``, a data-dependent ``_d0``) that meet a named dim in
a broadcast are unified with it (``egraft.ir.unify``). Every compiled model is checked
against onnxruntime at several bindings from one build."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import sympy
from onnx import TensorProto, helper

import egraft
from egraft.errors import InputError
from egraft.ir.dims import sym
from egraft.ir.unify import input_assumptions, is_anonymous, unify_dims

F = TensorProto.FLOAT


def model(nodes, inputs, outputs, name="m") -> onnx.ModelProto:
    graph = helper.make_graph(nodes, name, [helper.make_tensor_value_info(n, F, s) for n, s in inputs],
                              [helper.make_tensor_value_info(n, F, None) for n in outputs])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def ort_run(m: onnx.ModelProto, feeds):
    session = ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"])
    return dict(zip([o.name for o in session.get_outputs()], session.run(None, feeds)))


def rand(seed, *shape):
    return np.random.default_rng(seed).normal(0, 1, shape).astype(np.float32)


def check(m, compiled, feeds):
    want = ort_run(m, feeds)
    got = compiled.run(feeds)
    for name, value in want.items():
        assert got[name].shape == value.shape, name
        np.testing.assert_allclose(got[name], value, rtol=1e-5, atol=1e-5)


# ---- elementwise ----------------------------------------------------------------------------------
def add_of_two_named_dims() -> onnx.ModelProto:
    """``relu(x + y) * x`` with x: f32[a, 4], y: f32[b, 4]: the sum is f32[Max(a, b), 4]."""
    return model([helper.make_node("Add", ["x", "y"], ["s"]), helper.make_node("Relu", ["s"], ["r"]),
                  helper.make_node("Mul", ["r", "x"], ["z"])],
                 [("x", ["a", 4]), ("y", ["b", 4])], ["z"])


@pytest.fixture(scope="module")
def compiled_add():
    m = add_of_two_named_dims()
    return m, egraft.compile(m.SerializeToString(), use_cache=False)


def test_named_dims_are_not_unified_and_nothing_falls_back(compiled_add):
    _, compiled = compiled_add
    assert [str(v.type) for v in compiled.graph.inputs] == ["f32[a, 4]", "f32[b, 4]"]
    for a, b in [(1, 5), (5, 1), (5, 5)]:
        assert compiled.report({"a": a, "b": b}).fallbacks == []
    assert any(step.guards for step in compiled.steps if step.kind == "kernel")


@pytest.mark.parametrize("a, b", [(1, 5), (5, 1), (5, 5), (1, 1), (7, 1)])
def test_add_broadcasts_at_run_time_like_onnxruntime(compiled_add, a, b):
    m, compiled = compiled_add
    check(m, compiled, {"x": rand(a * 10 + b, a, 4), "y": rand(a + 10 * b, b, 4)})


def test_dims_that_do_not_broadcast_are_refused(compiled_add):
    _, compiled = compiled_add
    with pytest.raises(InputError, match=r"dim a = 3 \(axis 0\) is neither 1 nor the result's dim Max\(a, b\) = 5: "
                                         r"the inputs do not broadcast"):
        compiled.run({"x": rand(0, 3, 4), "y": rand(1, 5, 4)})


def test_three_operands_and_an_inner_axis():
    """Where(c, x, y) over [a, 1, n], [1, b, n], [a, b, 1] with a rank-3 result of run-time dims."""
    m = model([helper.make_node("Greater", ["x", "y"], ["c"]), helper.make_node("Where", ["c", "x", "w"], ["s"]),
               helper.make_node("Sub", ["s", "y"], ["z"])],
              [("x", ["a", "k", 3]), ("y", ["b", 1, 3]), ("w", ["a", "k", "n"])], ["z"])
    compiled = egraft.compile(m.SerializeToString(), use_cache=False)
    for a, b, k, n in [(1, 4, 2, 3), (4, 1, 2, 1), (4, 4, 1, 3), (1, 1, 5, 3)]:
        assert compiled.report({"a": a, "b": b, "k": k, "n": n}).fallbacks == []
        check(m, compiled, {"x": rand(a, a, k, 3), "y": rand(b, b, 1, 3), "w": rand(n, a, k, n)})


# ---- MatMul ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("a_shape, b_shape, bindings", [
    (["a", 1, 3, 8], [1, "b", 8, 5], [(1, 1), (2, 3), (1, 4), (3, 1)]),
    (["a", 3, 8], ["b", 8, 5], [(1, 4), (4, 1), (4, 4)]),
    (["a", 2, 3, 8], ["b", 1, 8, 5], [(1, 4), (4, 1), (3, 3)]),
])
def test_matmul_batch_dims_broadcast_at_run_time(a_shape, b_shape, bindings):
    m = model([helper.make_node("MatMul", ["p", "q"], ["y"]), helper.make_node("Relu", ["y"], ["z"])],
              [("p", a_shape), ("q", b_shape)], ["z"])
    compiled = egraft.compile(m.SerializeToString(), use_cache=False)
    for a, b in bindings:
        assert compiled.report({"a": a, "b": b}).fallbacks == []
        shape_p = [a if d == "a" else d for d in a_shape]
        shape_q = [b if d == "b" else d for d in b_shape]
        check(m, compiled, {"p": rand(a, *shape_p), "q": rand(b + 7, *shape_q)})
    if a_shape[0] == "a" and b_shape[0] == "b" and len(a_shape) == 3:
        with pytest.raises(InputError, match="do not broadcast"):
            compiled.run({"p": rand(0, 2, 3, 8), "q": rand(1, 3, 8, 5)})


def test_matmul_with_a_bias_that_broadcasts_at_run_time():
    """MatMul then Add of a bias [b, 1, 5] (FusedMatMul's addend read with run-time strides)."""
    m = model([helper.make_node("MatMul", ["p", "q"], ["y"]), helper.make_node("Add", ["y", "c"], ["z"])],
              [("p", ["a", 3, 8]), ("q", [8, 5]), ("c", ["b", 1, 5])], ["z"])
    compiled = egraft.compile(m.SerializeToString(), use_cache=False)
    for a, b in [(1, 3), (3, 1), (3, 3)]:
        assert compiled.report({"a": a, "b": b}).fallbacks == []
        check(m, compiled, {"p": rand(a, a, 3, 8), "q": rand(2, 8, 5), "c": rand(b, b, 1, 5)})


# ---- unification ----------------------------------------------------------------------------------
def test_an_exporters_unknown_dim_is_unified_with_the_named_dim_it_meets():
    m = model([helper.make_node("Add", ["x", "mask"], ["s"]), helper.make_node("Relu", ["s"], ["z"])],
              [("x", ["batch", "seq", 4]), ("mask", ["batch", "unk__12", 1])], ["z"])
    graph = egraft.load(m.SerializeToString())
    assert input_assumptions(graph) == ["unk__12 == seq"]
    compiled = egraft.compile(m.SerializeToString(), use_cache=False)
    assert [str(v.type) for v in compiled.graph.inputs] == ["f32[batch, seq, 4]", "f32[batch, unk__12, 1]"]
    assert all("Max" not in str(v.type) for node in compiled.graph.nodes for v in (*node.inputs, *node.outputs))
    assert not any(step.guards for step in compiled.steps)  # nothing is left to decide at run time
    for batch, seq in [(1, 1), (2, 7), (3, 16)]:
        assert compiled.report({"batch": batch, "seq": seq, "unk__12": seq}).fallbacks == []
        check(m, compiled, {"x": rand(seq, batch, seq, 4), "mask": rand(batch, batch, seq, 1)})
    # the assumption unk__12 == seq is checked on every call: a feed that breaks it is refused, naming it
    with pytest.raises(InputError, match=r"seq=7, unk__12=5 \(from the inputs\) breaks the assumption "
                                         r"'unk__12 == seq' the model was compiled with"):
        compiled.run({"x": rand(0, 2, 7, 4), "mask": rand(1, 2, 5, 1)})
    with pytest.raises(InputError, match="breaks the assumption 'unk__12 == seq'"):  # even where ONNX broadcasts
        compiled.run({"x": rand(0, 2, 7, 4), "mask": rand(1, 2, 1, 1)})


def test_a_data_dependent_dim_is_unified_with_the_named_dim_it_meets():
    """Range(0, n) (n an input scalar: its length is a data-dependent _d0) added to x: f32[seq]."""
    nodes = [helper.make_node("Range", ["zero", "n", "one"], ["r"]), helper.make_node("Cast", ["r"], ["rf"], to=F),
             helper.make_node("Add", ["x", "rf"], ["z"])]
    graph = helper.make_graph(
        nodes, "m", [helper.make_tensor_value_info("x", F, ["seq"]),
                     helper.make_tensor_value_info("n", TensorProto.INT64, [])],
        [helper.make_tensor_value_info("z", F, None)],
        initializer=[helper.make_tensor("zero", TensorProto.INT64, [], [0]),
                     helper.make_tensor("one", TensorProto.INT64, [], [1])])
    m = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    loaded = egraft.load(m.SerializeToString())
    assert str(loaded.nodes[-1].outputs[0].type) == "f32[seq]"
    compiled = egraft.compile(m.SerializeToString(), use_cache=False)
    for seq in (3, 8):
        check(m, compiled, {"x": rand(seq, seq), "n": np.array(seq, np.int64)})
    with pytest.raises(egraft.errors.EgraftError, match="seq"):
        compiled.run({"x": rand(0, 4), "n": np.array(6, np.int64)})


def test_unify_leaves_two_named_dims_and_never_joins_them_through_an_anonymous_one():
    m = model([helper.make_node("Add", ["x", "u"], ["s"]), helper.make_node("Add", ["y", "u"], ["t"]),
               helper.make_node("Add", ["x", "y"], ["z"])],
              [("x", ["a"]), ("y", ["b"]), ("u", ["unk__3"])], ["s", "t", "z"])
    graph = egraft.load(m.SerializeToString())
    assert input_assumptions(graph) == ["unk__3 == a"]  # the first named dim it meets; never also b
    assert str(graph.nodes[2].outputs[0].type) == "f32[Max(a, b)]"
    compiled = egraft.compile(m.SerializeToString(), use_cache=False)
    check(m, compiled, {"x": rand(0, 4), "y": rand(1, 1), "u": rand(2, 4)})
    check(m, compiled, {"x": rand(0, 1), "y": rand(1, 4), "u": rand(2, 1)})


def test_a_data_dependent_dim_prefers_an_inputs_dim_as_its_representative():
    """Range(0, n) + y: f32[unk__7]: the data-dependent _d0 becomes unk__7 (the input's dim, bound
    by every call), never the other way round."""
    nodes = [helper.make_node("Range", ["zero", "n", "one"], ["r"]), helper.make_node("Cast", ["r"], ["rf"], to=F),
             helper.make_node("Add", ["y", "rf"], ["z"])]
    graph = helper.make_graph(
        nodes, "m", [helper.make_tensor_value_info("y", F, ["unk__7"]),
                     helper.make_tensor_value_info("n", TensorProto.INT64, [])],
        [helper.make_tensor_value_info("z", F, None)],
        initializer=[helper.make_tensor("zero", TensorProto.INT64, [], [0]),
                     helper.make_tensor("one", TensorProto.INT64, [], [1])])
    loaded = egraft.load(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]).SerializeToString())
    assert str(loaded.nodes[0].outputs[0].type) == "i64[unk__7]"
    assert input_assumptions(loaded) == []


def test_is_anonymous():
    assert is_anonymous(sym("_d3")) and is_anonymous(sym("unk__12"))
    assert not is_anonymous(sym("batch")) and not is_anonymous(sym("unk")) and not is_anonymous(sym("_dx"))


def test_unify_dims_returns_the_same_graph_when_nothing_meets():
    graph = egraft.load(add_of_two_named_dims().SerializeToString())
    assert unify_dims(graph) == (graph, {})
    assert any(isinstance(d, sympy.Max) for d in graph.nodes[0].outputs[0].type.shape)


def test_a_dim_nothing_checks_at_run_time_is_not_unified():
    """Reshape(x, s) with s an input: its output dim _d0 is not recomputed before a view runs,
    so it stays apart from y's m (the sum is Max(_d0, m), broadcast at run time)."""
    graph = helper.make_graph(
        [helper.make_node("Reshape", ["x", "s"], ["r"]), helper.make_node("Add", ["r", "y"], ["z"])], "m",
        [helper.make_tensor_value_info("x", F, ["n"]), helper.make_tensor_value_info("s", TensorProto.INT64, [1]),
         helper.make_tensor_value_info("y", F, ["m"])],
        [helper.make_tensor_value_info("z", F, None)])
    m = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    loaded = egraft.load(m.SerializeToString())
    assert "Max" in str(loaded.nodes[-1].outputs[0].type)
    compiled = egraft.compile(m.SerializeToString(), use_cache=False)
    for n, mm in [(4, 4), (4, 1), (1, 4)]:
        check(m, compiled, {"x": rand(n, n), "s": np.array([n], np.int64), "y": rand(mm, mm)})


def test_the_producers_unify_trusts_are_the_ones_lowering_checks():
    from egraft.ir.unify import CHECKED_PRODUCERS
    from egraft.lowering.compile import SIZED_BY_INPUT_VALUES

    assert CHECKED_PRODUCERS <= SIZED_BY_INPUT_VALUES


def test_attention_whose_mask_and_batch_broadcast_at_run_time():
    """egraft's Attention(Q, Kt, V, mask) = Softmax(Q @ Kt / 8 + mask) @ V with Q: [b, 2, s, 8] and
    mask: [m, 1, s, s] (m is 1 or b, decided per call; the result is typed [b, 2, s, 8]), against
    numpy in float64."""
    node = helper.make_node("Attention", ["q", "kt", "v", "mask"], ["y"], domain="com.egraft", scale=1 / 8)
    inputs = [("q", ["b", 2, "s", 8]), ("kt", ["b", 2, 8, "s"]), ("v", ["b", 2, "s", 8]), ("mask", ["m", 1, "s", "s"])]
    graph = helper.make_graph([node], "attention", [helper.make_tensor_value_info(n, F, shape) for n, shape in inputs],
                              [helper.make_tensor_value_info("y", F, None)])
    m = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("com.egraft", 1)])
    compiled = egraft.compile(m.SerializeToString(), use_cache=False, rewrite=False)
    for b, mm, s in [(1, 1, 5), (3, 1, 5), (3, 3, 4)]:
        assert compiled.report({"b": b, "m": mm, "s": s}).fallbacks == []
        feeds = {"q": rand(b, b, 2, s, 8), "kt": rand(b + 1, b, 2, 8, s), "v": rand(b + 2, b, 2, s, 8),
                 "mask": rand(mm, mm, 1, s, s)}
        q, kt, v, mask = (feeds[k].astype(np.float64) for k in ("q", "kt", "v", "mask"))
        scores = q @ kt / 8 + mask
        p = np.exp(scores - scores.max(-1, keepdims=True))
        want = (p / p.sum(-1, keepdims=True)) @ v
        got = compiled.run(feeds)["y"]
        assert got.shape == want.shape
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    with pytest.raises(InputError, match=r"Attention \(unnamed\): an operand's dim m = 3 \(axis 0\) is neither 1 nor "
                                         r"the result's dim b = 1"):
        compiled.run({"q": rand(0, 1, 2, 4, 8), "kt": rand(1, 1, 2, 8, 4), "v": rand(2, 1, 2, 4, 8),
                      "mask": rand(3, 3, 1, 4, 4)})

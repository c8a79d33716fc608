"""Compile-time values: shape arithmetic on symbolic dims, three-valued comparisons,
import-time folding of any op on known inputs. Each model also runs in onnxruntime."""

from __future__ import annotations

import numpy as np
import pytest
import sympy
from conftest import run_onnxruntime
from onnx import TensorProto, helper

import egraft
from egraft.ir.dims import compare_dims, sym

F, I64 = TensorProto.FLOAT, TensorProto.INT64


def _model(nodes, inputs, outputs, initializers=(), opset=17):
    graph = helper.make_graph(nodes, "g", inputs, outputs, list(initializers))
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])


def _branch(name, node, out):
    return helper.make_graph([node], name, [], [helper.make_tensor_value_info(out, F, None)])


def test_comparisons_of_symbolic_dims_are_decided_only_by_a_proof():
    n, m = sym("n"), sym("m")
    assert compare_dims(n, n, "eq") is True
    assert compare_dims(n + 1, 1, "eq") is False  # n >= 1
    assert compare_dims(n, 1, "eq") is None  # n may be 1
    assert compare_dims(sympy.floor(n / 256 - sympy.Rational(1, 2)) + 1, 1, "eq") is None
    assert compare_dims(n, m, "lt") is None
    assert compare_dims(n, 0, "gt") is True and compare_dims(n, 0, "le") is False
    assert compare_dims(3, 4, "lt") is True and compare_dims(4, 4, "ge") is True


@pytest.mark.parametrize("n", [100, 600])
def test_an_undecided_symbolic_equal_types_the_if_with_both_branches(n):
    """``Equal(floor(n/256 - 1/2) + 1, 1)`` is true for n < 384: folding it to False by
    structural equality typed the graph with the else branch only."""
    nodes = [
        helper.make_node("Shape", ["x"], ["s"]),
        helper.make_node("Gather", ["s", "one"], ["w"], axis=0),
        helper.make_node("Sub", ["w", "c128"], ["w1"]),
        helper.make_node("Div", ["w1", "c256"], ["w2"]),
        helper.make_node("Add", ["w2", "one"], ["blocks"]),
        helper.make_node("Equal", ["blocks", "one"], ["single"]),
        helper.make_node("If", ["single"], ["y"],
                         then_branch=_branch("then", helper.make_node("Identity", ["x"], ["t"]), "t"),
                         else_branch=_branch("else", helper.make_node("Concat", ["x", "x"], ["e"], axis=1), "e")),
    ]
    inits = [helper.make_tensor("one", I64, [], [1]), helper.make_tensor("c128", I64, [], [128]),
             helper.make_tensor("c256", I64, [], [256])]
    model = _model(nodes, [helper.make_tensor_value_info("x", F, [1, "n"])],
                   [helper.make_tensor_value_info("y", F, None)], inits)
    graph = egraft.load(model)
    assert graph.outputs[0].type.shape[0] == 1 and not isinstance(graph.outputs[0].type.shape[1], int)
    x = np.random.default_rng(n).normal(size=(1, n)).astype(np.float32)
    want = run_onnxruntime(model, {"x": x})["y"]
    np.testing.assert_array_equal(graph.run({"x": x})["y"], want)
    np.testing.assert_array_equal(egraft.compile(model, use_cache=False).run({"x": x})["y"], want)


def test_a_provable_symbolic_comparison_picks_the_branch_at_import():
    nodes = [
        helper.make_node("Shape", ["x"], ["s"]),
        helper.make_node("Size", ["s"], ["rank"]),
        helper.make_node("Equal", ["rank", "three"], ["is3"]),
        helper.make_node("Not", ["is3"], ["not3"]),
        helper.make_node("If", ["not3"], ["y"],
                         then_branch=_branch("then", helper.make_node("Unsqueeze", ["x", "zero"], ["t"]), "t"),
                         else_branch=_branch("else", helper.make_node("Identity", ["x"], ["e"]), "e")),
    ]
    inits = [helper.make_tensor("three", I64, [], [3]), helper.make_tensor("zero", I64, [1], [0])]
    model = _model(nodes, [helper.make_tensor_value_info("x", F, ["b", 4])],
                   [helper.make_tensor_value_info("y", F, None)], inits)
    graph = egraft.load(model)
    assert str(graph.outputs[0].type) == "f32[1, b, 4]"  # Not of a known value is folded too


def test_any_op_on_known_inputs_is_folded_at_import():
    """The all-constant pads of a Pad come through Transpose and ConstantOfShape, which are
    not shape arithmetic: folding them keeps the output dims exact instead of fresh."""
    nodes = [
        helper.make_node("ConstantOfShape", ["two"], ["zeros"], value=helper.make_tensor("v", I64, [1], [0])),
        helper.make_node("Transpose", ["grid"], ["grid_t"], perm=[1, 0]),
        helper.make_node("Reshape", ["grid_t", "minus_one"], ["ends"]),
        helper.make_node("Slice", ["ends", "start", "stop"], ["ends2"]),
        helper.make_node("Concat", ["zeros", "ends2"], ["pads"], axis=0),
        helper.make_node("Pad", ["x", "pads"], ["y"], mode="reflect"),
    ]
    inits = [helper.make_tensor("two", I64, [1], [2]), helper.make_tensor("grid", I64, [2, 2], [0, 1, 0, 2]),
             helper.make_tensor("minus_one", I64, [1], [-1]), helper.make_tensor("start", I64, [1], [2]),
             helper.make_tensor("stop", I64, [1], [4])]
    model = _model(nodes, [helper.make_tensor_value_info("x", F, ["n", 16])],
                   [helper.make_tensor_value_info("y", F, None)], inits)
    graph = egraft.load(model)
    assert str(graph.outputs[0].type) == "f32[n + 1, 18]"
    x = np.random.default_rng(0).normal(size=(3, 16)).astype(np.float32)
    want = run_onnxruntime(model, {"x": x})["y"]
    np.testing.assert_array_equal(graph.run({"x": x})["y"], want)
    np.testing.assert_array_equal(egraft.compile(model, use_cache=False).run({"x": x})["y"], want)


def test_random_ops_are_never_folded():
    nodes = [helper.make_node("RandomUniformLike", ["c"], ["r"], seed=1.0),
             helper.make_node("Add", ["x", "r"], ["y"])]
    model = _model(nodes, [helper.make_tensor_value_info("x", F, [2])], [helper.make_tensor_value_info("y", F, None)],
                   [helper.make_tensor("c", F, [2], [0.0, 0.0])])
    graph = egraft.load(model)
    assert not any(name in graph.known_values for name in ("r", "y"))


@pytest.mark.parametrize(("start", "end", "step"), [(-1, -2**63 + 1, -1), (-1, -2**63, -1), (3, -1, -1),
                                                    (2**63 - 1, -2**63, -2), (-100, -2**63, -1), (1, 100, 2),
                                                    (-3, -1, 1), (0, -1, -1)])
@pytest.mark.parametrize("rows", [5, "n"])
def test_slice_clamps_as_onnx_says(start, end, step, rows):
    """A reversal to the first element (end -2**63 + 1, silero's reflected pads) is not
    Python's ``x[3:-1:-1]``, which is empty; folded at import as well as run."""
    model = _model([helper.make_node("Slice", ["x", "s", "e", "a", "st"], ["y"])],
                   [helper.make_tensor_value_info("x", F, [rows, 3])], [helper.make_tensor_value_info("y", F, None)],
                   [helper.make_tensor("s", I64, [1], [start]), helper.make_tensor("e", I64, [1], [end]),
                    helper.make_tensor("a", I64, [1], [0]), helper.make_tensor("st", I64, [1], [step])])
    x = np.arange(15, dtype=np.float32).reshape(5, 3)
    want = run_onnxruntime(model, {"x": x})["y"]
    graph = egraft.load(model)
    if rows == 5:
        assert graph.outputs[0].type.shape == want.shape
    np.testing.assert_array_equal(graph.run({"x": x})["y"], want)
    np.testing.assert_array_equal(egraft.compile(model, use_cache=False).run({"x": x})["y"], want)

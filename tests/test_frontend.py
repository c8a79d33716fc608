"""ONNX import: models written with onnx.helper, symbolic dims, old-style models, errors."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from conftest import run_onnxruntime
from onnx import TensorProto, helper

import egraft
from egraft.errors import InputError, ModelError, UnsupportedOpError


def test_symbolic_batch_prints_and_runs(batch_model):
    graph = egraft.load(batch_model)
    assert str(graph.inputs[0].type) == "f32[batch, 2, 3]"
    assert str(graph.outputs[0].type) == "f32[batch, 4]"
    assert graph.symbols() == ["batch"]
    text = str(graph)
    assert "f32[batch, 6] = Reshape" in text
    for batch in (1, 7):
        x = np.random.default_rng(batch).normal(size=(batch, 2, 3)).astype(np.float32)
        ours = graph.run({"x": x})["y"]
        ref = run_onnxruntime(batch_model, {"x": x})["y"]
        assert ours.shape == (batch, 4)
        np.testing.assert_allclose(ours, ref, rtol=1e-5, atol=1e-6)


def test_wrong_rank_is_refused_with_the_expected_shape(batch_model):
    graph = egraft.load(batch_model)
    with pytest.raises(InputError) as info:
        graph.run({"x": np.zeros((2, 6), np.float32)})
    assert str(info.value) == "input 'x' has rank 2 (shape [2, 6]), expected rank 3 ([batch, 2, 3])"


def test_wrong_dtype_is_refused(batch_model):
    graph = egraft.load(batch_model)
    with pytest.raises(InputError) as info:
        graph.run({"x": np.zeros((2, 2, 3), np.float64)})
    assert str(info.value) == "input 'x' has dtype float64, expected float32 (f32[batch, 2, 3])"


def test_wrong_static_dim_and_unknown_input_are_refused(batch_model):
    graph = egraft.load(batch_model)
    with pytest.raises(InputError, match=r"input 'x' has shape \[2, 5, 3\], expected \[batch, 2, 3\] \(axis 1\)"):
        graph.run({"x": np.zeros((2, 5, 3), np.float32)})
    with pytest.raises(InputError, match="unknown input 'z'"):
        graph.run({"x": np.zeros((2, 2, 3), np.float32), "z": np.zeros(1)})
    with pytest.raises(InputError, match="missing input 'x'"):
        graph.run({})


def test_inconsistent_symbol_binding_is_refused():
    model = helper.make_model(helper.make_graph(
        [helper.make_node("Add", ["a", "b"], ["c"])], "g",
        [helper.make_tensor_value_info("a", TensorProto.FLOAT, ["n"]),
         helper.make_tensor_value_info("b", TensorProto.FLOAT, ["n"])],
        [helper.make_tensor_value_info("c", TensorProto.FLOAT, ["n"])]), opset_imports=[helper.make_opsetid("", 17)])
    graph = egraft.load(model)
    with pytest.raises(InputError, match=r"input 'b' has shape \[4\], expected \[n\] with n=3"):
        graph.run({"a": np.zeros(3, np.float32), "b": np.zeros(4, np.float32)})


def test_unsupported_op_names_op_opset_node_and_count():
    nodes = [helper.make_node("FancyOp", ["x"], ["y"], name="first_fancy", domain="com.example"),
             helper.make_node("FancyOp", ["y"], ["z"], name="second", domain="com.example")]
    model = helper.make_model(helper.make_graph(
        nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2])],
        [helper.make_tensor_value_info("z", TensorProto.FLOAT, [2])]),
        opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("com.example", 3)])
    with pytest.raises(UnsupportedOpError) as info:
        egraft.load(model)
    assert str(info.value) == "unsupported op: com.example::FancyOp (opset 3): 2 nodes, first 'first_fancy'"


def test_corrupt_and_missing_files(tmp_path):
    bad = tmp_path / "bad.onnx"
    bad.write_bytes(b"\x00\x01not a model at all\xff")
    with pytest.raises(ModelError, match="bad.onnx: not a valid ONNX model"):
        egraft.load(bad)
    with pytest.raises(ModelError, match="no such file"):
        egraft.load(tmp_path / "missing.onnx")
    with pytest.raises(ModelError, match="not a valid ONNX model"):
        egraft.load(b"")


def test_ir3_initializers_listed_as_inputs_are_constants():
    w = np.arange(6, dtype=np.float32).reshape(2, 3)
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "w"], ["y"])], "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 2]),
         helper.make_tensor_value_info("w", TensorProto.FLOAT, [2, 3])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 3])],
        initializer=[onnx.numpy_helper.from_array(w, "w")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 7)], ir_version=3)
    g = egraft.load(model)
    assert [v.name for v in g.inputs] == ["x"]
    assert g.nodes[0].inputs[1].const is not None
    x = np.array([[1.0, 2.0]], np.float32)
    np.testing.assert_allclose(g.run({"x": x})["y"], x @ w)


def test_constant_nodes_become_constants_in_the_side_table():
    nodes = [helper.make_node("Constant", [], ["c"], value=onnx.numpy_helper.from_array(np.float32([1, 2, 3]))),
             helper.make_node("Constant", [], ["k"], value_float=2.0),
             helper.make_node("Mul", ["x", "c"], ["m"]),
             helper.make_node("Add", ["m", "k"], ["y"])]
    model = helper.make_model(helper.make_graph(
        nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [3])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [3])]), opset_imports=[helper.make_opsetid("", 17)])
    g = egraft.load(model)
    assert [n.op for n in g.nodes] == ["Mul", "Add"]
    assert len(g.constants) == 2
    np.testing.assert_allclose(g.run({"x": np.float32([1, 1, 1])})["y"], [3, 4, 5])


def test_unknown_attribute_is_an_error():
    model = helper.make_model(helper.make_graph(
        [helper.make_node("Relu", ["x"], ["y"], alpha=1.0)], "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [3])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [3])]), opset_imports=[helper.make_opsetid("", 17)])
    with pytest.raises(ModelError, match=r"Relu \(unnamed\): unknown attribute 'alpha' for Relu at opset 17"):
        egraft.load(model)


def test_sequence_inputs_are_unsupported_with_a_clear_message():
    seq = helper.make_tensor_sequence_value_info("s", TensorProto.FLOAT, [2])
    model = helper.make_model(helper.make_graph(
        [helper.make_node("SequenceLength", ["s"], ["n"])], "g", [seq],
        [helper.make_tensor_value_info("n", TensorProto.INT64, [])]), opset_imports=[helper.make_opsetid("", 17)])
    with pytest.raises(UnsupportedOpError, match="graph input 's' is a sequence_type; egraft supports tensor values"):
        egraft.load(model)


@pytest.mark.parametrize("placeholder", ["?", "-1", "None", "", "unk"])
def test_placeholder_dim_names_are_a_fresh_symbol_at_each_place(placeholder):
    """An exporter that writes ``?`` for every unknown dim does not mean H == W."""
    model = helper.make_model(helper.make_graph(
        [helper.make_node("Relu", ["x"], ["r"]), helper.make_node("ReduceSum", ["r", "axes"], ["y"], keepdims=0)], "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [placeholder, 3, placeholder, placeholder])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [placeholder])],
        [helper.make_tensor("axes", TensorProto.INT64, [3], [1, 2, 3])]), opset_imports=[helper.make_opsetid("", 13)])
    graph = egraft.load(model)
    shape = graph.inputs[0].type.shape
    assert len(set(map(str, shape))) == 4 and shape[1] == 3
    x = np.random.default_rng(0).normal(size=(2, 3, 48, 192)).astype(np.float32)
    ours = graph.run({"x": x})["y"]
    np.testing.assert_allclose(ours, run_onnxruntime(model, {"x": x})["y"], rtol=1e-5, atol=1e-5)


def test_real_dim_names_still_unify_and_odd_characters_are_kept_as_one_name():
    model = helper.make_model(helper.make_graph(
        [helper.make_node("Add", ["a", "b"], ["c"])], "g",
        [helper.make_tensor_value_info("a", TensorProto.FLOAT, ["seq len", "n"]),
         helper.make_tensor_value_info("b", TensorProto.FLOAT, ["seq len", "n"])],
        [helper.make_tensor_value_info("c", TensorProto.FLOAT, None)]), opset_imports=[helper.make_opsetid("", 17)])
    graph = egraft.load(model)
    assert str(graph.inputs[0].type) == "f32[seq_len, n]" == str(graph.inputs[1].type)
    with pytest.raises(InputError, match=r"input 'b' has shape \[4, 2\], expected \[seq_len, n\] with seq_len=3"):
        graph.run({"a": np.zeros((3, 2), np.float32), "b": np.zeros((4, 2), np.float32)})

"""ONNX export: symbolic dims, subgraphs, egraft-only ops as model-local functions."""

from __future__ import annotations

import numpy as np
import onnx
from conftest import run_onnxruntime, symbolic_batch_model
from onnx import TensorProto, helper

import egraft
from egraft.ir.graph import Graph, Node, Value
from egraft.ir.ops._common import same_as
from egraft.ir.registry import register_op
from egraft.ir.types import DType, TensorType


def test_symbolic_dims_export_as_dim_params_and_run_at_any_batch():
    graph = egraft.load(symbolic_batch_model())
    model = egraft.to_onnx(graph)
    onnx.checker.check_model(model)
    dims = [d.dim_param or d.dim_value for d in model.graph.input[0].type.tensor_type.shape.dim]
    assert dims == ["batch", 2, 3]
    for batch in (1, 5):
        x = np.random.default_rng(batch).normal(size=(batch, 2, 3)).astype(np.float32)
        np.testing.assert_allclose(run_onnxruntime(model, {"x": x})["y"], graph.run({"x": x})["y"], rtol=1e-5)


def _silu_function(node: Node) -> onnx.FunctionProto:
    body = [helper.make_node("Sigmoid", ["x"], ["s"]), helper.make_node("Mul", ["x", "s"], ["y"])]
    return helper.make_function("com.egraft.test", "Silu", ["x"], ["y"], body,
                                [helper.make_opsetid("", 17)])


register_op("Silu", domain="com.egraft.test", infer=same_as(0),
            compute=lambda ctx, x: [(x / (1 + np.exp(-x))).astype(x.dtype)],
            onnx_function=_silu_function, doc="x * sigmoid(x) (a test-only egraft op)")


def test_egraft_only_op_exports_as_a_local_function_onnxruntime_runs():
    t = TensorType(DType.FLOAT32, (4,))
    x, h, y = Value("x", t), Value("h", t), Value("y", t)
    graph = Graph("g", [x], [y], [Node("Silu", (x,), (h,), domain="com.egraft.test"),
                                 Node("Relu", (h,), (y,))], opsets={"": 17})
    graph.validate()
    model = egraft.to_onnx(graph)
    assert [f.name for f in model.functions][0].startswith("Silu_")
    xs = np.linspace(-3, 3, 4).astype(np.float32)
    ours = graph.run({"x": xs})["y"]
    np.testing.assert_allclose(ours, np.maximum(xs / (1 + np.exp(-xs)), 0), rtol=1e-6)
    np.testing.assert_allclose(run_onnxruntime(model, {"x": xs})["y"], ours, rtol=1e-6)


def test_if_subgraph_reading_outer_values_round_trips():
    then_graph = helper.make_graph([helper.make_node("Add", ["x", "w"], ["t"])], "then", [],
                                   [helper.make_tensor_value_info("t", TensorProto.FLOAT, [2])])
    else_graph = helper.make_graph([helper.make_node("Sub", ["x", "w"], ["e"])], "else", [],
                                   [helper.make_tensor_value_info("e", TensorProto.FLOAT, [2])])
    graph = helper.make_graph(
        [helper.make_node("If", ["c"], ["y"], then_branch=then_graph, else_branch=else_graph)], "g",
        [helper.make_tensor_value_info("c", TensorProto.BOOL, []),
         helper.make_tensor_value_info("x", TensorProto.FLOAT, [2])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2])],
        initializer=[onnx.numpy_helper.from_array(np.float32([10, 20]), "w")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    ir = egraft.load(model)
    exported = egraft.to_onnx(ir)
    x = np.float32([1, 2])
    for cond in (True, False):
        feeds = {"c": np.array(cond), "x": x}
        expected = run_onnxruntime(model, feeds)["y"]
        np.testing.assert_allclose(ir.run(feeds)["y"], expected)
        np.testing.assert_allclose(run_onnxruntime(exported, feeds)["y"], expected)

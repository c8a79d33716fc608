"""PreActConvNCHWc: a 1x1 convolution that computes its input's BatchNormalization and ReLU
as it reads it (DenseNet's pre-activation). Its kernel against float64 numpy at 1 and 2
threads on both register widths, its reference kernel and its ONNX function (run by
onnxruntime) against the same, and the rules that make it (blocked_conv_pre_activation, and
blocked_conv_pre_activation_scaled after Caffe's BatchNorm then Scale) on a dense layer against
onnxruntime."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from conftest import run_onnxruntime
from onnx import TensorProto, helper, numpy_helper

import egraft
from egraft.ir.ops.layout import DOMAIN, to_blocked
from egraft.lowering.compile import compile_graph
from egraft.testing.models import scale_relative_error

RNG = np.random.default_rng(5)
BLOCK = 8

#: every parallel kernel runs in parts here, however small its test shape
pytestmark = pytest.mark.usefixtures("split_every_parallel_kernel")


def randn(*shape: int, scale: float = 1.0) -> np.ndarray:
    return (RNG.normal(size=shape) * scale).astype(np.float32)


def pre_act_model(c: int, m: int, x_dims: list, with_bias: bool, activation: str):
    """``y = PreActConvNCHWc(xb, w, s, t, [b]) {kernel_shape = [1, 1], activation}``: the
    constants as initializers; returns the model and the unblocked ``w, s, t, b``."""
    w, s, t = randn(m, c, 1, 1, scale=0.2), RNG.uniform(0.5, 2, c).astype(np.float32), randn(c)
    b = randn(m) if with_bias else None
    inits = {"w": w, "s": to_blocked(s.reshape(1, c, 1, 1), BLOCK), "t": to_blocked(t.reshape(1, c, 1, 1), BLOCK)}
    if b is not None:
        inits["b"] = b
    node = helper.make_node("PreActConvNCHWc", ["xb", "w", "s", "t"] + (["b"] if with_bias else []), ["y"],
                            domain=DOMAIN, kernel_shape=[1, 1], activation=activation)
    graph = helper.make_graph([node], "g", [helper.make_tensor_value_info("xb", TensorProto.FLOAT, x_dims)],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
                              [numpy_helper.from_array(v, k) for k, v in inits.items()])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18), helper.make_opsetid(DOMAIN, 1)])
    return model, (w, s, t, b)


def reference(x: np.ndarray, w, s, t, b, activation: str) -> np.ndarray:
    """act(Conv1x1(max(x * s + t, 0), w) + b) in float64, blocked."""
    pre = np.maximum(x.astype(np.float64) * s[:, None, None] + t[:, None, None], 0)
    y = np.einsum("mc,nchw->nmhw", w[:, :, 0, 0].astype(np.float64), pre)
    if b is not None:
        y += b[:, None, None]
    return to_blocked(np.maximum(y, 0) if activation == "relu" else y, BLOCK)


CASES = [
    ("DenseNet's 14x14: four channel tiles a row", (1, 256, 14, 14), 128, True, "relu"),
    ("batch 2, odd width, M = 24, no bias", (2, 24, 9, 13), 24, False, ""),
    ("weights beyond L2: blocks of 8 rows, chunks of input blocks", (1, 512, 9, 6), 136, True, "relu"),
    ("7x7 rows: eight-block tiles", (1, 64, 7, 7), 128, False, "relu"),
]


@pytest.mark.parametrize("label, x_shape, m, with_bias, activation", CASES, ids=[c[0] for c in CASES])
def test_the_kernel_matches_float64_at_1_and_2_threads(label, x_shape, m, with_bias, activation, registers):
    """Each part stages the pre-activation of its rows once per row block and runs every channel
    tile of them over it: parts that start inside a row block stage it too."""
    x = randn(*x_shape)
    xb = to_blocked(x, BLOCK)
    model, (w, s, t, b) = pre_act_model(x_shape[1], m, list(xb.shape), with_bias, activation)
    compiled = compile_graph(egraft.load(model))
    (step,) = compiled.steps
    assert step.kind == "kernel" and step.parallel, step.reason
    want = reference(x, w, s, t, b, activation)
    for threads in (1, 2):
        compiled.threads = threads
        assert scale_relative_error(compiled.run({"xb": xb})["y"], want) <= 1e-5, threads


def test_the_reference_kernel_and_the_onnx_function_agree_with_float64():
    """The op's numpy kernel (the interpreter's) and its ONNX function, which onnxruntime runs
    from the exported model: both compute Relu(x * s + t) before the convolution."""
    x = randn(2, 16, 5, 7)
    xb = to_blocked(x, BLOCK)
    model, (w, s, t, b) = pre_act_model(16, 24, list(xb.shape), True, "relu")
    graph = egraft.load(model)
    want = reference(x, w, s, t, b, "relu")
    assert scale_relative_error(graph.run({"xb": xb})["y"], want) <= 1e-6
    assert scale_relative_error(run_onnxruntime(egraft.to_onnx(graph), {"xb": xb})["y"], want) <= 1e-5


def test_a_shift_of_the_wrong_shape_is_refused_naming_it():
    x_dims = [1, 2, 4, 4, 8]
    model, _ = pre_act_model(16, 8, x_dims, False, "")
    model.graph.initializer[2].CopyFrom(numpy_helper.from_array(np.zeros((1, 16, 1, 1), np.float32), "t"))
    with pytest.raises(egraft.EgraftError, match=r"shift T has shape \[1, 16, 1, 1\]"):
        egraft.load(model)


def dense_layer_model(caffe_scale: bool) -> onnx.ModelProto:
    """DenseNet's layer and transition on a concatenation of two convolutions' outputs:
    Relu(BN(Concat(Conv(a), Conv(b)))), then a 1x1
    Conv with bias, a ReLU and a 3x3 Conv, and the same normalized input through a 1x1 Conv
    without bias and an AveragePool. With ``caffe_scale`` each BN is followed by a Mul and
    an Add of per-channel constants (Caffe's Scale layer, as in the ONNX zoo's DenseNet-121)."""
    c, m = 64, 128
    params = {"s": RNG.uniform(0.5, 2, c), "t": RNG.normal(size=c), "m": RNG.normal(size=c),
              "v": RNG.uniform(0.2, 2, c), "k": RNG.uniform(0.5, 1.5, (c, 1, 1)), "h": RNG.normal(size=(c, 1, 1)),
              "w1": RNG.normal(size=(m, c, 1, 1)) * 0.2, "b1": RNG.normal(size=m),
              "w3": RNG.normal(size=(32, m, 3, 3)) * 0.1, "w2": RNG.normal(size=(32, c, 1, 1)) * 0.2,
              "wa": RNG.normal(size=(c // 2, 16, 3, 3)) * 0.2, "wb": RNG.normal(size=(c // 2, 16, 3, 3)) * 0.2}
    nodes = [helper.make_node("Conv", ["a", "wa"], ["ca"], kernel_shape=[3, 3], pads=[1, 1, 1, 1]),
             helper.make_node("Conv", ["b", "wb"], ["cb"], kernel_shape=[3, 3], pads=[1, 1, 1, 1]),
             helper.make_node("Concat", ["ca", "cb"], ["x"], axis=1),
             helper.make_node("BatchNormalization", ["x", "s", "t", "m", "v"], ["n"], epsilon=1e-5)]
    normed = "n"
    if caffe_scale:
        nodes += [helper.make_node("Mul", ["n", "k"], ["nk"]), helper.make_node("Add", ["nk", "h"], ["nh"])]
        normed = "nh"
    nodes += [helper.make_node("Relu", [normed], ["r"]),
              helper.make_node("Conv", ["r", "w1", "b1"], ["c1"], kernel_shape=[1, 1]),
              helper.make_node("Relu", ["c1"], ["r1"]),
              helper.make_node("Conv", ["r1", "w3"], ["y1"], kernel_shape=[3, 3], pads=[1, 1, 1, 1]),
              helper.make_node("Conv", ["r", "w2"], ["c2"], kernel_shape=[1, 1]),
              helper.make_node("AveragePool", ["c2"], ["y2"], kernel_shape=[2, 2], strides=[2, 2])]
    inputs = [helper.make_tensor_value_info(k, TensorProto.FLOAT, [1, 16, 28, 28]) for k in ("a", "b")]
    outputs = [helper.make_tensor_value_info(k, TensorProto.FLOAT, None) for k in ("y1", "y2")]
    inits = [numpy_helper.from_array(np.asarray(v, np.float32), k) for k, v in params.items()]
    graph = helper.make_graph(nodes, "dense_layer", inputs, outputs, inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


@pytest.mark.parametrize("caffe_scale", [False, True], ids=["BN", "BN then Scale"])
def test_a_dense_layers_normalization_runs_inside_its_1x1_convolutions(caffe_scale):
    """Both 1x1 convolutions that read the normalized concatenation compute its normalization and
    ReLU themselves: no elementwise pass is left, and the outputs match onnxruntime. After BatchNorm
    then Scale the input is x * k1 * k2 + t1 + t2, and the convolution's S and T are k1 * k2 and t1 + t2."""
    model = dense_layer_model(caffe_scale)
    compiled = egraft.compile(model, use_cache=False)
    ops = [s.node.op for s in compiled.steps]
    assert ops.count("PreActConvNCHWc") == 2 and "Elementwise" not in ops, ops
    assert all(s.kind == "kernel" for s in compiled.steps if s.node.op == "PreActConvNCHWc")
    feeds = {k: randn(1, 16, 28, 28) for k in ("a", "b")}
    want = run_onnxruntime(model, feeds)
    got = compiled.run(feeds)
    for name in ("y1", "y2"):
        assert scale_relative_error(got[name], want[name]) <= 1e-5, name

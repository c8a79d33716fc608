"""The direct convolution on channel-blocked tensors (egraft/kernels/cpu/conv_nchwc.py) against
onnxruntime's Conv on the unblocked tensors: kernel sizes, strides, pads, output widths that
are not a multiple of the tile, one-vector channel tails, bias or none, 1 and 2 threads,
a symbolic batch, the residual and the activation; and the nodes it leaves to the reference.
"""

from __future__ import annotations

import re

import numpy as np
import onnx
import pytest
from conftest import run_onnxruntime
from onnx import TensorProto, helper, numpy_helper

import egraft
from egraft.ir.ops.layout import DOMAIN, from_blocked, to_blocked
from egraft.kernels.cpu.conv_nchwc import pack_weights, plan_columns
from egraft.lowering.compile import compile_graph
from egraft.testing.models import scale_relative_error

RNG = np.random.default_rng(11)
BLOCK = 8


#: every parallel kernel runs in parts here, however small its test shape
pytestmark = pytest.mark.usefixtures("split_every_parallel_kernel")


def randn(*shape: int) -> np.ndarray:
    return RNG.normal(size=shape).astype(np.float32)


def nchwc_model(w: np.ndarray, b: np.ndarray | None, attrs: dict, x_dims: list, z_dims: list | None = None,
                weights_as_input: bool = False) -> onnx.ModelProto:
    """``y = ConvNCHWc(xb, w, [b], [z])`` with ``w`` and ``b`` as initializers (``w`` a graph
    input with ``weights_as_input``) and ``z`` a graph input."""
    inits = {} if weights_as_input else {"w": w}
    if b is not None:
        inits["b"] = b
    names = ["xb", "w", "b" if b is not None else ""] + (["z"] if z_dims is not None else [])
    inputs = [helper.make_tensor_value_info("xb", TensorProto.FLOAT, x_dims)]
    if weights_as_input:
        inputs.append(helper.make_tensor_value_info("w", TensorProto.FLOAT, list(w.shape)))
    if z_dims is not None:
        inputs.append(helper.make_tensor_value_info("z", TensorProto.FLOAT, z_dims))
    while names[-1] == "":
        names.pop()
    node = helper.make_node("ConvNCHWc", names, ["y"], domain=DOMAIN, **attrs)
    graph = helper.make_graph([node], "g", inputs, [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
                              [numpy_helper.from_array(v, k) for k, v in inits.items()])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18), helper.make_opsetid(DOMAIN, 1)])


def reference(x: np.ndarray, w: np.ndarray, b: np.ndarray | None, attrs: dict,
              z: np.ndarray | None = None) -> np.ndarray:
    """onnxruntime's Conv (+ Z) on the unblocked ``x``, blocked again."""
    b = b if b is not None else np.zeros(w.shape[0], np.float32)
    nodes = [helper.make_node("Conv", ["x", "w", "b"], ["c"], **attrs)]
    feeds = {"x": x, "w": w, "b": b}
    last = "c"
    if z is not None:
        nodes.append(helper.make_node("Add", [last, "z"], ["s"]))
        last, feeds["z"] = "s", z
    nodes.append(helper.make_node("Identity", [last], ["y"]))
    inputs = [helper.make_tensor_value_info(k, TensorProto.FLOAT, list(v.shape)) for k, v in feeds.items()]
    graph = helper.make_graph(nodes, "ref", inputs, [onnx.ValueInfoProto(name="y")])
    y = run_onnxruntime(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)]), feeds)["y"]
    return to_blocked(y, BLOCK)


def assert_matches_at_1_and_2_threads(compiled, xb: np.ndarray, want: np.ndarray) -> None:
    for threads in (1, 2):
        compiled.threads = threads
        got = compiled.run({"xb": xb})["y"]
        assert got.shape == want.shape
        assert scale_relative_error(got, want) <= 1e-5, threads


def compiled_kernel(model: onnx.ModelProto):
    compiled = compile_graph(egraft.load(model))
    (step,) = compiled.steps
    assert step.kind == "kernel", step.reason
    assert step.parallel
    return compiled


CASES = [
    ("3x3 pad 1", (1, 16, 12, 14), 32, {"pads": [1, 1, 1, 1]}),
    ("3x3 stride 2", (1, 8, 20, 21), 16, {"strides": [2, 2], "pads": [1, 1, 1, 1]}),
    ("1x1, M = 24", (2, 16, 9, 13), 24, {}),
    ("1x1 stride 2", (1, 16, 15, 15), 16, {"strides": [2, 2]}),
    ("7x7 pad 3 stride 2", (1, 8, 30, 31), 16, {"strides": [2, 2], "pads": [3, 3, 3, 3]}),
    ("7x7 output, M = 8", (1, 16, 7, 7), 8, {"pads": [1, 1, 1, 1]}),
    ("C = 8, M = 24, no pad", (1, 8, 10, 19), 24, {}),
    ("uneven pads", (1, 8, 11, 17), 16, {"pads": [0, 2, 1, 0]}),
    ("5x5 pad 2 on a tiny image", (1, 8, 3, 4), 40, {"pads": [2, 2, 2, 2]}),
    ("3x1 kernel, wide row", (1, 24, 4, 61), 16, {"pads": [1, 0, 1, 0]}),
    ("3x3, input blocks in two chunks", (2, 32, 9, 7), 24, {"pads": [1, 1, 1, 1]}),
    ("7x7 stride 2, one input block per chunk", (1, 16, 17, 23), 16, {"strides": [2, 2], "pads": [3, 3, 3, 3]}),
    ("3x3, weights beyond L2: an item per channel tile", (1, 128, 5, 6), 72, {"pads": [1, 1, 1, 1]}),
    ("5x1 kernel down a one-pixel column (run as a row)", (1, 16, 40, 1), 24, {}),
    ("5x1 kernel, column, stride 2 and pads", (2, 16, 37, 1), 16, {"strides": [2, 1], "pads": [2, 0, 1, 0]}),
]


@pytest.mark.parametrize("label, x_shape, out_channels, attrs", CASES, ids=[c[0] for c in CASES])
@pytest.mark.parametrize("with_bias", [True, False], ids=["bias", "no bias"])
def test_matches_onnxruntime(label, x_shape, out_channels, attrs, with_bias, registers):
    c = x_shape[1]
    kernel = (7, 7) if "7x7" in label else (1, 1) if "1x1" in label else (5, 5) if "5x5" in label else \
        (3, 1) if "3x1" in label else (5, 1) if "5x1" in label else (3, 3)
    x, w = randn(*x_shape), randn(out_channels, c, *kernel)
    b = randn(out_channels) if with_bias else None
    xb = to_blocked(x, BLOCK)
    compiled = compiled_kernel(nchwc_model(w, b, attrs, list(xb.shape)))
    want = reference(x, w, b, attrs)
    assert_matches_at_1_and_2_threads(compiled, xb, want)


NCHW_INPUT_CASES = [
    ("ResNet's 7x7 stride 2 on RGB", (1, 3, 37, 35), 64, (7, 7), {"strides": [2, 2], "pads": [3, 3, 3, 3]}),
    ("3x3 stride 2 no pad on RGB, M = 24", (1, 3, 29, 30), 24, (3, 3), {"strides": [2, 2]}),
    ("one channel, 3x3 pad 1, batch 2", (2, 1, 11, 13), 16, (3, 3), {"pads": [1, 1, 1, 1]}),
    ("seven channels, 5x5 uneven pads, M = 8", (1, 7, 9, 17), 8, (5, 5), {"pads": [2, 0, 1, 2]}),
    ("RGB 1x1", (1, 3, 6, 19), 16, (1, 1), {}),
]


@pytest.mark.parametrize("label, x_shape, out_channels, kernel, attrs", NCHW_INPUT_CASES,
                         ids=[c[0] for c in NCHW_INPUT_CASES])
def test_an_nchw_input_of_few_channels_is_read_in_place(label, x_shape, out_channels, kernel, attrs):
    """ConvNCHWc on an NCHW input (C < 8, an image's channels): the blocked kernel broadcasts
    each channel from its plane and blocks the output; padded taps read zeros; at 1 and 2
    threads, with and without a bias, against onnxruntime's Conv."""
    x, w = randn(*x_shape), randn(out_channels, x_shape[1], *kernel)
    for b in (randn(out_channels), None):
        compiled = compiled_kernel(nchwc_model(w, b, attrs, list(x.shape)))
        assert_matches_at_1_and_2_threads(compiled, x, reference(x, w, b, attrs))


def test_rgb_convolutions_take_the_nchw_input_kernel():
    """The layout rules give an image's first convolution (3 channels, 64 filters, a 96-pixel
    image) the blocked kernel on its NCHW input, with no LayoutToBlocked before it, and the
    output matches onnxruntime."""
    w, b = randn(64, 3, 3, 3), randn(64)
    nodes = [helper.make_node("Conv", ["x", "w", "b"], ["c"], pads=[1, 1, 1, 1], strides=[2, 2]),
             helper.make_node("Relu", ["c"], ["y"])]
    model = helper.make_model(helper.make_graph(
        nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, 96, 96])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
        [numpy_helper.from_array(w, "w"), numpy_helper.from_array(b, "b")]),
        opset_imports=[helper.make_opsetid("", 13)])
    compiled = egraft.compile(model, use_cache=False, specialize="off")
    ops = [s.node.op for s in compiled.steps if s.kind == "kernel"]
    assert ops == ["ConvNCHWc", "LayoutFromBlocked"], ops
    x = randn(1, 3, 96, 96)
    want = run_onnxruntime(model, {"x": x})["y"]
    assert scale_relative_error(compiled.run({"x": x})["y"], want) <= 1e-5


def test_symbolic_batch():
    w, b = randn(16, 8, 3, 3), randn(16)
    attrs = {"pads": [1, 1, 1, 1]}
    compiled = compiled_kernel(nchwc_model(w, b, attrs, ["batch", 1, 9, 13, BLOCK]))
    for batch in (1, 3):
        x = randn(batch, 8, 9, 13)
        got = compiled.run({"xb": to_blocked(x, BLOCK)})["y"]
        assert scale_relative_error(got, reference(x, w, b, attrs)) <= 1e-5


#: sigmoid, silu, tanh, gelu and gelu_tanh run on the stored tile through a helper function
#: (``MathEmitter.activation_in_place``); the others on the registers.
ACTIVATION_CASES = [("relu", []), ("leaky_relu", [0.1]), ("clip", [-0.5, 0.5]), ("sigmoid", []), ("silu", []),
                    ("hard_sigmoid", [0.2, 0.5]), ("hard_swish", []), ("tanh", []), ("gelu", []), ("gelu_tanh", [])]


@pytest.mark.parametrize("activation, params", ACTIVATION_CASES)
def test_residual_and_activation(activation, params, registers):
    """Every activation on the vectors of the epilogue (the fused op's reference computes it)."""
    x, w, b = randn(2, 32, 10, 15), randn(24, 32, 3, 3), randn(24)  # two chunks of input blocks
    attrs = {"pads": [1, 1, 1, 1], "strides": [1, 1]}
    z = randn(2, 24, 10, 15)
    act = {"activation": activation, **({"activation_params": params} if params else {})}
    model = nchwc_model(w, b, {**attrs, **act}, [2, 4, 10, 15, BLOCK], z_dims=[2, 3, 10, 15, BLOCK])
    compiled = compiled_kernel(model)
    feeds = {"xb": to_blocked(x, BLOCK), "z": to_blocked(z, BLOCK)}
    want = egraft.load(model).run(feeds)["y"]  # the op's reference kernel: act(Conv + B + Z)
    pre = to_blocked(from_blocked(reference(x, w, b, attrs, z), BLOCK), BLOCK)
    assert not np.allclose(want, pre)  # the activation changed the values
    for threads in (1, 2):
        compiled.threads = threads
        got = compiled.run(feeds)["y"]
        # the rounding of the sums, at the scale of the values before the activation
        assert np.abs(got - want).max() <= 1e-5 * np.abs(pre).max()


def test_nodes_left_to_the_reference_say_why():
    x = randn(1, 16, 6, 6)
    xb = to_blocked(x, BLOCK)
    grouped = compile_graph(egraft.load(nchwc_model(randn(16, 8, 3, 3), None, {"group": 2}, list(xb.shape))))
    runtime_weights = compile_graph(egraft.load(nchwc_model(randn(16, 16, 3, 3), None, {}, list(xb.shape),
                                                            weights_as_input=True)))
    (step,) = grouped.steps
    assert step.kind == "fallback" and "group 2" in step.reason
    (step,) = runtime_weights.steps
    assert step.kind == "fallback" and "not a constant" in step.reason


def test_weights_are_packed_in_the_order_the_inner_loop_reads_them():
    w = randn(24, 16, 3, 2)
    packed = pack_weights(w)
    wide = packed[:16 * 16 * 6].reshape(2, 3, 2, BLOCK, 16)  # [cb][kh][kw][lane][o] of channels 0..15
    assert wide[1, 2, 0, 5, 7] == w[7, 1 * BLOCK + 5, 2, 0]
    narrow = packed[16 * 16 * 6:].reshape(2, 3, 2, BLOCK, BLOCK)  # channels 16..23
    assert narrow[0, 1, 1, 3, 2] == w[18, 3, 1, 1]


def test_column_plan_covers_every_column_once():
    from egraft.kernels.cpu.conv import ConvGeometry

    for tile in (6, 7):
        for out_w, k, stride, pad in [(56, 3, 1, 1), (7, 3, 1, 1), (112, 7, 2, 3), (5, 5, 1, 2), (61, 1, 1, 0),
                                      (14, 3, 1, 1), (13, 1, 1, 0)]:
            in_w = (out_w - 1) * stride + k - 2 * pad
            geo = ConvGeometry(1, 8, 8, 1, 1, in_w, 1, k, 1, out_w, 1, stride, 1, 1, 0, pad)
            plan = plan_columns(geo, tile)
            columns = [c for first, pixels in plan.edges for c in range(first, first + pixels)]
            columns += list(range(plan.loop_start, plan.loop_start + tile * plan.loop_count))
            assert sorted(columns) == list(range(out_w))
            assert all(pixels <= tile for _, pixels in plan.edges)


# ---- depthwise (group == C == M): one vector multiply-add per tap --------------------------------
DEPTHWISE_CASES = [
    ("3x3 pad 1", (1, 16, 14, 14), {"pads": [1, 1, 1, 1]}),
    ("3x3 stride 2", (1, 24, 15, 16), {"strides": [2, 2], "pads": [1, 1, 1, 1]}),
    ("5x5 pad 2, 7 columns", (2, 16, 7, 7), {"pads": [2, 2, 2, 2]}),
    ("5x5 pad 2 on a 3x2 image (no interior column)", (1, 8, 3, 2), {"pads": [2, 2, 2, 2]}),
    ("3x3 dilation 2, uneven pads", (1, 8, 19, 23), {"dilations": [2, 2], "pads": [2, 1, 0, 3]}),
    ("3x3 no pad, 40 columns", (1, 32, 6, 40), {}),
]


@pytest.mark.parametrize("label, x_shape, attrs", DEPTHWISE_CASES, ids=[c[0] for c in DEPTHWISE_CASES])
@pytest.mark.parametrize("activation", ["", "hard_swish"])
def test_depthwise_matches_onnxruntime(label, x_shape, attrs, activation):
    c = x_shape[1]
    kernel = (5, 5) if "5x5" in label else (3, 3)
    x, w, b = randn(*x_shape), randn(c, 1, *kernel), randn(c)
    attrs = {**attrs, "group": c}
    xb = to_blocked(x, BLOCK)
    act = {"activation": activation} if activation else {}
    compiled = compiled_kernel(nchwc_model(w, b, {**attrs, **act}, list(xb.shape)))
    assert re.search(r'%"?dw0\b', compiled.module_text)  # the depthwise kernel's accumulators
    want = reference(x, w, b, attrs)
    if activation:
        want = want * np.clip(want / 6 + 0.5, 0, 1)
    assert_matches_at_1_and_2_threads(compiled, xb, want)


def test_depthwise_with_a_residual_and_no_bias():
    x, w = randn(1, 16, 9, 11), randn(16, 1, 3, 3)
    attrs = {"pads": [1, 1, 1, 1], "group": 16}
    z = randn(1, 16, 9, 11)
    model = nchwc_model(w, None, {**attrs, "activation": "relu"}, [1, 2, 9, 11, BLOCK], z_dims=[1, 2, 9, 11, BLOCK])
    compiled = compiled_kernel(model)
    got = compiled.run({"xb": to_blocked(x, BLOCK), "z": to_blocked(z, BLOCK)})["y"]
    want = np.maximum(reference(x, w, None, attrs, z), 0)
    assert scale_relative_error(got, want) <= 1e-5

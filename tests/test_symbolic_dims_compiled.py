"""Symbolic dims all the way down (issue 15): dim expressions that only a run time binding
decides (floor and ceiling of rational expressions, as strided pools and convolutions
make them) are computed inside generated kernels, and the compiled model matches
onnxruntime at every size from one build."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper

import egraft


def strided_pools() -> onnx.ModelProto:
    """Two pools over x: f32[1, 4, h, w] whose output dims are floor((h - 3)/2) + 1 (MaxPool)
    and, with ceil_mode, Min(floor(h/3) + 1, floor(h/3 + 2/3)) (AveragePool: ceil((h - 2)/3)
    + 1 unless the last window would start past the input), each followed by elementwise ops."""
    nodes = [
        helper.make_node("MaxPool", ["x"], ["p"], kernel_shape=[3, 3], strides=[2, 2]),
        helper.make_node("Sigmoid", ["p"], ["s"]),
        helper.make_node("Mul", ["p", "s"], ["y"]),  # SiLU on floor dims
        helper.make_node("AveragePool", ["x"], ["q"], kernel_shape=[2, 2], strides=[3, 3], ceil_mode=1),
        helper.make_node("Neg", ["q"], ["nq"]),
        helper.make_node("Relu", ["nq"], ["z"]),
    ]
    graph = helper.make_graph(nodes, "strided_pools",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 4, "h", "w"])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, None),
                               helper.make_tensor_value_info("z", TensorProto.FLOAT, None)])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


@pytest.fixture(scope="module")
def compiled_pools():
    return strided_pools(), egraft.compile(strided_pools().SerializeToString(), use_cache=False)


def test_floor_and_ceiling_dims_have_generated_code(compiled_pools):
    _, compiled = compiled_pools
    reasons = [reason for _, _, reason in compiled.report({"h": 9, "w": 11}).fallbacks]
    assert not [r for r in reasons if "dim expression" in r], reasons
    kernel_ops = {s.node.op for s in compiled.steps if s.kind == "kernel"}
    assert kernel_ops & {"Sigmoid", "Mul", "Neg", "Relu", "Elementwise"}, kernel_ops
    assert {"MaxPool", "AveragePool"} <= kernel_ops, kernel_ops  # the runtime-bounds pools
    assert not reasons, reasons


@pytest.mark.parametrize("h, w", [(3, 3), (7, 9), (8, 8), (33, 17), (64, 5)])
def test_one_build_matches_onnxruntime_at_every_size(compiled_pools, h, w):
    model, compiled = compiled_pools
    x = np.random.default_rng(h * 100 + w).normal(0, 1, (1, 4, h, w)).astype(np.float32)
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    y, z = session.run(None, {"x": x})
    out = compiled.run({"x": x})
    assert out["y"].shape == y.shape == (1, 4, (h - 3) // 2 + 1, (w - 3) // 2 + 1)
    assert out["z"].shape == z.shape  # ceil_mode: Min(floor(h/3) + 1, floor(h/3 + 2/3)), the last window inside
    np.testing.assert_allclose(out["y"], y, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(out["z"], z, rtol=1e-5, atol=1e-6)


def convolutions() -> onnx.ModelProto:
    """Over x: f32[n, 4, h, w]: a strided padded Conv with bias, a grouped dilated Conv, a
    depthwise SAME_UPPER Conv, and a FusedConv-able Conv + Add + Relu (a residual), every
    spatial dim symbolic."""
    rng = np.random.default_rng(7)
    weights = {"w1": (6, 4, 3, 3), "b1": (6,), "w2": (6, 2, 3, 3), "w3": (6, 1, 3, 3), "w4": (6, 6, 1, 1),
               "b4": (6,)}
    inits = [onnx.numpy_helper.from_array(rng.normal(0, 0.5, s).astype(np.float32), n) for n, s in weights.items()]
    nodes = [
        helper.make_node("Conv", ["x", "w1", "b1"], ["c1"], strides=[2, 2], pads=[1, 1, 1, 1]),
        helper.make_node("Conv", ["x", "w2"], ["c2"], group=2, dilations=[2, 1], pads=[2, 0, 1, 1]),
        helper.make_node("Conv", ["c2", "w3"], ["c3"], group=6, auto_pad="SAME_UPPER", strides=[2, 1]),
        helper.make_node("Conv", ["c1", "w4", "b4"], ["c4"]),
        helper.make_node("Add", ["c4", "c1"], ["s4"]),
        helper.make_node("Relu", ["s4"], ["y1"]),
    ]
    graph = helper.make_graph(nodes, "convolutions",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", 4, "h", "w"])],
                              [helper.make_tensor_value_info("y1", TensorProto.FLOAT, None),
                               helper.make_tensor_value_info("c3", TensorProto.FLOAT, None)], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


@pytest.fixture(scope="module")
def compiled_convolutions():
    return convolutions(), egraft.compile(convolutions().SerializeToString(), use_cache=False)


def test_convolutions_with_symbolic_spatial_dims_have_generated_code(compiled_convolutions):
    _, compiled = compiled_convolutions
    fallbacks = compiled.report({"n": 1, "h": 9, "w": 11}).fallbacks
    assert not [f for f in fallbacks if "Conv" in f[1]], fallbacks


@pytest.mark.parametrize("n, h, w", [(1, 5, 5), (1, 9, 11), (2, 16, 7), (1, 33, 40), (1, 6, 130)])
def test_one_convolution_build_matches_onnxruntime_at_every_size(compiled_convolutions, n, h, w):
    model, compiled = compiled_convolutions
    x = np.random.default_rng(h * 1000 + w).normal(0, 1, (n, 4, h, w)).astype(np.float32)
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    expected = dict(zip(["y1", "c3"], session.run(None, {"x": x})))
    out = compiled.run({"x": x})
    for name, want in expected.items():
        assert out[name].shape == want.shape, name
        np.testing.assert_allclose(out[name], want, rtol=1e-4, atol=1e-5, err_msg=name)


def blocked_convolutions() -> onnx.ModelProto:
    """y = maxpool(relu(conv(relu(conv(x)), w2) + relu(conv(x)))) over x: f32[1, 8, h, w]:
    channels in multiples of 8, so the layout rules run them channel-blocked (ConvNCHWc with a
    residual, a blocked MaxPool)."""
    rng = np.random.default_rng(3)
    weights = {"w1": (16, 8, 3, 3), "b1": (16,), "w2": (16, 16, 3, 3), "b2": (16,)}
    inits = [onnx.numpy_helper.from_array(rng.normal(0, 0.3, s).astype(np.float32), n) for n, s in weights.items()]
    nodes = [
        helper.make_node("Conv", ["x", "w1", "b1"], ["c1"], pads=[1, 1, 1, 1], strides=[2, 2]),
        helper.make_node("Relu", ["c1"], ["r1"]),
        helper.make_node("Conv", ["r1", "w2", "b2"], ["c2"], pads=[1, 1, 1, 1]),
        helper.make_node("Add", ["c2", "r1"], ["s"]),
        helper.make_node("Relu", ["s"], ["r2"]),
        helper.make_node("MaxPool", ["r2"], ["y"], kernel_shape=[3, 3], strides=[2, 2], pads=[1, 1, 1, 1]),
    ]
    graph = helper.make_graph(nodes, "blocked_convolutions",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 8, "h", "w"])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


UNGUARDED_BLOCKING = """ruleset blocking_anyway

# Conv(x, w, b) -> FromBlocked(ConvNCHWc(ToBlocked(x), w, b)), whatever the spatial dims
rule conv_to_blocked_anyway:
    Conv(x, w, b) {group = 1, attrs}
    where rank(x) == 4 and dim(x, 1) % 8 == 0 and dim(w, 0) % 8 == 0
    => xb = com.egraft::LayoutToBlocked(x) {block = 8}
       com.egraft::LayoutFromBlocked(com.egraft::ConvNCHWc(xb, w, b) {attrs, block = 8}) {block = 8}
"""


def test_the_shipped_rules_keep_symbolic_spatial_convolutions_unblocked():
    compiled = egraft.compile(blocked_convolutions().SerializeToString(), use_cache=False)
    ops = [s.node.op for s in compiled.steps]
    assert "ConvNCHWc" not in ops and "LayoutToBlocked" not in ops, ops


def test_blocked_convolutions_with_symbolic_spatial_dims_match_onnxruntime(tmp_path):
    """A rule author who blocks convolutions whatever their dims still gets correct kernels."""
    model = blocked_convolutions()
    rules = tmp_path / "blocking.rules"
    rules.write_text(UNGUARDED_BLOCKING)
    compiled = egraft.compile(model.SerializeToString(), rules=[rules], use_cache=False)
    kernels = [s.node.op for s in compiled.steps if s.kind == "kernel"]
    assert "ConvNCHWc" in kernels, kernels
    assert not compiled.report({"h": 12, "w": 9}).fallbacks
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    for h, w in [(4, 4), (12, 9), (31, 20)]:
        x = np.random.default_rng(h + w).normal(0, 1, (1, 8, h, w)).astype(np.float32)
        np.testing.assert_allclose(compiled.run({"x": x})["y"], session.run(None, {"x": x})[0], rtol=1e-4, atol=1e-5)


def upsample_nearest(scales=(1.0, 1.0, 2.0, 3.0), coordinate_mode: str = "asymmetric") -> onnx.ModelProto:
    """y = Resize(x, scales) + 1 over x: f32[n, 3, h, w], nearest with floor rounding."""
    nodes = [helper.make_node("Resize", ["x", "", "scales"], ["r"], mode="nearest", nearest_mode="floor",
                              coordinate_transformation_mode=coordinate_mode),
             helper.make_node("Add", ["r", "one"], ["y"])]
    inits = [onnx.numpy_helper.from_array(np.array(scales, np.float32), "scales"),
             onnx.numpy_helper.from_array(np.array(1.0, np.float32), "one")]
    graph = helper.make_graph(nodes, "upsample",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", 3, "h", "w"])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def test_nearest_upsampling_of_symbolic_dims_matches_onnxruntime():
    model = upsample_nearest()
    compiled = egraft.compile(model.SerializeToString(), use_cache=False)
    assert not compiled.report({"n": 1, "h": 4, "w": 5}).fallbacks
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    for n, h, w in [(1, 1, 1), (1, 4, 5), (2, 7, 3)]:
        x = np.random.default_rng(h * w).normal(0, 1, (n, 3, h, w)).astype(np.float32)
        want = session.run(None, {"x": x})[0]
        got = compiled.run({"x": x})["y"]
        assert got.shape == want.shape == (n, 3, 2 * h, 3 * w)
        np.testing.assert_array_equal(got, want)


def test_other_resizes_of_symbolic_dims_fall_back_and_stay_correct():
    model = upsample_nearest(scales=(1.0, 1.0, 1.5, 2.0), coordinate_mode="half_pixel")
    compiled = egraft.compile(model.SerializeToString(), use_cache=False)
    reasons = [r for _, op, r in compiled.report({"n": 1, "h": 4, "w": 4}).fallbacks if op == "Resize"]
    assert reasons and "nearest, asymmetric, floor" in reasons[0]
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    x = np.random.default_rng(0).normal(0, 1, (1, 3, 6, 5)).astype(np.float32)
    np.testing.assert_array_equal(compiled.run({"x": x})["y"], session.run(None, {"x": x})[0])


def large_convolutions() -> onnx.ModelProto:
    """Convolutions big enough for products (>= 128 taps, >= 32 output channels) over
    x: f32[n, 32, h, w]: 3x3 stride 1 (+ bias, ReLU), 3x3 stride 2 dilation 1 followed by SiLU
    (an activation the product library applies in a second pass), 1x1 with a residual, two
    groups of 5x5 with dilation 2, and a 1-D convolution over the rows."""
    rng = np.random.default_rng(5)

    def weight(name, shape):
        return onnx.numpy_helper.from_array(rng.normal(0, 0.1, shape).astype(np.float32), name)

    nodes = [
        helper.make_node("Conv", ["x", "w1", "b1"], ["c1"], pads=[1, 1, 1, 1]),
        helper.make_node("Relu", ["c1"], ["y1"]),
        helper.make_node("Conv", ["y1", "w2"], ["c2"], pads=[1, 1, 1, 1], strides=[2, 2]),
        helper.make_node("Sigmoid", ["c2"], ["s2"]),
        helper.make_node("Mul", ["c2", "s2"], ["y2"]),
        helper.make_node("Concat", ["y1", "y1", "y1"], ["y1x3"], axis=1),
        helper.make_node("Conv", ["y1x3", "w3", "b3"], ["c3"]),
        helper.make_node("Add", ["c3", "y1"], ["y3"]),
        helper.make_node("Conv", ["x", "w4"], ["y4"], pads=[4, 4, 4, 4], dilations=[2, 2], group=2),
        helper.make_node("Reshape", ["x", "rows"], ["x1"]),
        helper.make_node("Conv", ["x1", "w5"], ["y5"], pads=[1, 1], strides=[2]),
    ]
    inits = [weight("w1", (48, 32, 3, 3)), weight("b1", (48,)), weight("w2", (40, 48, 3, 3)),
             weight("w3", (48, 144, 1, 1)), weight("b3", (48,)), weight("w4", (64, 16, 5, 5)),
             weight("w5", (36, 32, 5)), onnx.numpy_helper.from_array(np.array([0, 32, -1], np.int64), "rows")]
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", 32, "h", "w"])
    outputs = [helper.make_tensor_value_info(y, TensorProto.FLOAT, None) for y in ("y2", "y3", "y4", "y5")]
    graph = helper.make_graph(nodes, "large", [x], outputs, inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


@pytest.fixture(scope="module")
def compiled_large_convolutions():
    model = large_convolutions()
    return model, egraft.compile(model.SerializeToString(), use_cache=False)


def test_large_symbolic_convolutions_run_as_products(compiled_large_convolutions):
    _, compiled = compiled_large_convolutions
    assert not compiled.report({"n": 1, "h": 8, "w": 8}).fallbacks
    convolutions = [s for s in compiled.steps if "Conv" in s.node.op]
    assert len(convolutions) >= 5, [s.node.op for s in compiled.steps]
    # products read their weights packed at compile time; the direct kernel reads them as they are
    packed = {name.split(".")[0] for name in compiled._lowered.derived if name.endswith(".packed_w")}
    assert {s.function for s in convolutions} <= packed, (packed, [s.function for s in convolutions])


@pytest.mark.parametrize("n, h, w", [(1, 1, 3), (1, 8, 8), (2, 5, 37), (1, 23, 61), (1, 40, 3)])
def test_one_build_of_large_convolutions_matches_onnxruntime(compiled_large_convolutions, n, h, w):
    model, compiled = compiled_large_convolutions
    x = np.random.default_rng(n * h * w).normal(0, 1, (n, 32, h, w)).astype(np.float32)
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    want = dict(zip(("y2", "y3", "y4", "y5"), session.run(None, {"x": x})))
    got = compiled.run({"x": x})
    for name, expected in want.items():
        assert got[name].shape == expected.shape, name
        np.testing.assert_allclose(got[name], expected, rtol=1e-4, atol=1e-4, err_msg=name)


@pytest.mark.parametrize("n, h, w", [(1, 8, 8), (1, 16, 16), (2, 5, 37)])
def test_an_image_of_fewer_chunks_than_parts_shares_its_pixels(compiled_large_convolutions, n, h, w,
                                                               split_every_parallel_kernel):
    """A product's image of at most one chunk of pixels (an OCR line's 16 x 16) is cut into as
    many chunks as parts, of whole panels, so that 2 threads share it: the same values at 1
    and 2 threads as onnxruntime's."""
    model, compiled = compiled_large_convolutions
    x = np.random.default_rng(h * w).normal(0, 1, (n, 32, h, w)).astype(np.float32)
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    want = dict(zip(("y2", "y3", "y4", "y5"), session.run(None, {"x": x})))
    before = compiled.threads
    try:
        for threads in (1, 2):
            compiled.threads = threads
            got = compiled.run({"x": x})
            for name, expected in want.items():
                np.testing.assert_allclose(got[name], expected, rtol=1e-4, atol=1e-4, err_msg=f"{name} {threads}")
    finally:
        compiled.threads = before


@pytest.mark.parametrize("stride", [1, 2])
@pytest.mark.parametrize("w", [1, 3, 16, 17, 40, 99])
def test_a_wide_dilated_kernel_over_narrow_symbolic_rows_matches_onnxruntime(w, stride):
    # Conv 1x5, dilation 2, pads 4 + 4 over rows of w columns, then Relu: the taps of a row's
    # first and last columns read the padding (lane masks), rows narrower than the kernel
    # have no interior columns at all, and at stride 2 a vector of outputs reads two of inputs.
    rng = np.random.default_rng(w)
    inits = [onnx.numpy_helper.from_array(rng.normal(0, 0.5, (5, 3, 1, 5)).astype(np.float32), "k"),
             onnx.numpy_helper.from_array(rng.normal(0, 0.5, (5,)).astype(np.float32), "b")]
    nodes = [helper.make_node("Conv", ["x", "k", "b"], ["c"], dilations=[1, 2], pads=[0, 4, 0, 4], strides=[1, stride]),
             helper.make_node("Relu", ["c"], ["y"])]
    x_info = helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, "h", "w"])
    graph = helper.make_graph(nodes, "wide_kernel", [x_info],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    compiled = egraft.compile(model.SerializeToString(), use_cache=False)
    assert not [f for f in compiled.report({"h": 2, "w": w}).fallbacks if "Conv" in f[1]]
    x = rng.normal(0, 1, (1, 3, 2, w)).astype(np.float32)
    want = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
    got = compiled.run({"x": x})["y"]
    assert got.shape == want.shape
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)

"""Quantization ops: egraft's kernels against onnxruntime (u8 x s8 products against onnx's
reference evaluator, see _check), and shape inference."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from conftest import check_against_onnxruntime
from onnx import TensorProto, helper

import egraft
from egraft.errors import ShapeInferenceError
from egraft.ir.dims import sym


def _model(op: str, feeds: dict[str, np.ndarray], node_inputs: list[str], outputs: list[tuple[str, int]],
           opset: int, dims: dict[str, list] | None = None, initializers: dict | None = None,
           **attrs) -> onnx.ModelProto:
    """A one-node model; ``feeds`` become graph inputs, ``initializers`` constants."""
    dims = dims or {}
    node = helper.make_node(op, node_inputs, [name for name, _ in outputs], **attrs)
    inputs = [helper.make_tensor_value_info(n, helper.np_dtype_to_tensor_dtype(a.dtype), dims.get(n, list(a.shape)))
              for n, a in feeds.items()]
    inits = [onnx.numpy_helper.from_array(a, n) for n, a in (initializers or {}).items()]
    graph = helper.make_graph([node], "g", inputs, [helper.make_tensor_value_info(n, t, None) for n, t in outputs],
                              initializer=inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])


def _check(model: onnx.ModelProto, feeds: dict[str, np.ndarray], tol: float = 0.0) -> dict[str, np.ndarray]:
    """Run the model with egraft and onnxruntime; the outputs must agree (exactly by default).

    uint8 activations times int8 weights (QLinearConv, QLinearMatMul) are checked against
    onnx's reference evaluator instead: on CPUs without VNNI, onnxruntime's u8s8 kernels
    add pairs of products in saturating int16 (vpmaddubsw) and are off by up to ~110 on
    full-range weights, where the ONNX spec computes in int32 (seen with onnxruntime 1.32
    on an AVX2-only EPYC; exact on a Zen 4 with AVX-512 VNNI).
    """
    if _u8s8(model, feeds):
        return _check_against_onnx_reference(model, feeds)
    return check_against_onnxruntime(model, feeds, rtol=tol, atol=tol)


def _u8s8(model: onnx.ModelProto, feeds: dict[str, np.ndarray]) -> bool:
    node = model.graph.node[0]
    if node.op_type not in ("QLinearConv", "QLinearMatMul"):
        return False
    activations, weights = feeds.get(node.input[0]), feeds.get(node.input[3])
    return activations is not None and weights is not None and activations.dtype == np.uint8 \
        and weights.dtype == np.int8


def _check_against_onnx_reference(model: onnx.ModelProto, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    from onnx.reference import ReferenceEvaluator

    got = egraft.load(model).run(feeds)
    names = [o.name for o in model.graph.output]
    for name, want in zip(names, ReferenceEvaluator(model).run(None, feeds)):
        assert got[name].dtype == want.dtype and got[name].shape == want.shape, name
        np.testing.assert_array_equal(got[name], want, err_msg=name)
    return got


def _elem(dtype) -> int:
    return helper.np_dtype_to_tensor_dtype(np.dtype(dtype))


def _onnx_shapes(model: onnx.ModelProto) -> dict[str, list[int]]:
    inferred = onnx.shape_inference.infer_shapes(model, strict_mode=True)
    return {vi.name: [d.dim_value for d in vi.type.tensor_type.shape.dim] for vi in inferred.graph.output}


RNG = np.random.default_rng(0)


# ---- QuantizeLinear ------------------------------------------------------------------------
@pytest.mark.parametrize("zp_dtype", [np.uint8, np.int8])
def test_quantize_per_tensor_rounds_half_to_even_and_saturates(zp_dtype):
    scale = np.array(0.5, np.float32)
    # x / scale hits every .5 tie in [-300, 300] and goes past both ends of the range
    x = (np.arange(-600, 601, dtype=np.float32) / 4).reshape(1, -1)
    zp = np.array(3 if zp_dtype == np.uint8 else -2, zp_dtype)
    feeds = {"x": x, "s": scale, "zp": zp}
    model = _model("QuantizeLinear", feeds, ["x", "s", "zp"], [("y", _elem(zp_dtype))], 13)
    got = _check(model, feeds)["y"]
    assert got.min() == np.iinfo(zp_dtype).min and got.max() == np.iinfo(zp_dtype).max


def test_quantize_without_zero_point_is_uint8():
    x = RNG.standard_normal((3, 4)).astype(np.float32) * 100
    feeds = {"x": x, "s": np.array(0.7, np.float32)}
    model = _model("QuantizeLinear", feeds, ["x", "s"], [("y", TensorProto.UINT8)], 10)
    _check(model, feeds)


@pytest.mark.parametrize("axis", [1, -1, 0])
def test_quantize_per_axis(axis):
    x = RNG.standard_normal((3, 4, 5)).astype(np.float32) * 10
    n = x.shape[axis]
    feeds = {"x": x, "s": RNG.uniform(0.05, 0.3, n).astype(np.float32),
             "zp": RNG.integers(-20, 20, n).astype(np.int8)}
    model = _model("QuantizeLinear", feeds, ["x", "s", "zp"], [("y", TensorProto.INT8)], 13, axis=axis)
    _check(model, feeds)


@pytest.mark.parametrize("dtype", [np.int16, np.uint16])
def test_quantize_16_bit(dtype):
    x = RNG.standard_normal((4, 6)).astype(np.float32) * 5000
    feeds = {"x": x, "s": np.array(0.25, np.float32), "zp": np.array(100, dtype)}
    model = _model("QuantizeLinear", feeds, ["x", "s", "zp"], [("y", _elem(dtype))], 21)
    _check(model, feeds)


def test_quantize_output_dtype_attribute():
    x = RNG.standard_normal((2, 5)).astype(np.float32) * 100
    feeds = {"x": x, "s": np.array(0.3, np.float32)}
    model = _model("QuantizeLinear", feeds, ["x", "s"], [("y", TensorProto.INT8)], 21, output_dtype=TensorProto.INT8)
    graph = egraft.load(model)
    assert str(graph.outputs[0].type) == "i8[2, 5]"
    _check(model, feeds)


def test_quantize_blocked_against_onnxruntime():
    x = RNG.standard_normal((3, 8)).astype(np.float32) * 10
    feeds = {"x": x, "s": RNG.uniform(0.05, 0.3, (3, 4)).astype(np.float32),
             "zp": RNG.integers(-5, 5, (3, 4)).astype(np.int8)}
    model = _model("QuantizeLinear", feeds, ["x", "s", "zp"], [("y", TensorProto.INT8)], 21, axis=1, block_size=2)
    _check(model, feeds)


def test_quantize_blocked_with_a_partial_last_block():
    # 7 columns in blocks of 3: the last block has one column (onnxruntime rejects it; use numpy)
    x = RNG.standard_normal((2, 7)).astype(np.float32) * 10
    s = RNG.uniform(0.05, 0.3, (2, 3)).astype(np.float32)
    feeds = {"x": x, "s": s}
    model = _model("QuantizeLinear", feeds, ["x", "s"], [("y", TensorProto.UINT8)], 21, axis=1, block_size=3)
    got = egraft.load(model).run(feeds)["y"]
    full_scale = np.repeat(s, 3, axis=1)[:, :7]
    np.testing.assert_array_equal(got, np.clip(np.rint(x / full_scale), 0, 255).astype(np.uint8))


def test_quantize_float16_input():
    x = (RNG.standard_normal((4, 4)) * 20).astype(np.float16)
    feeds = {"x": x, "s": np.array(0.3, np.float16), "zp": np.array(10, np.uint8)}
    model = _model("QuantizeLinear", feeds, ["x", "s", "zp"], [("y", TensorProto.UINT8)], 19)
    _check(model, feeds)


def test_quantize_bad_scale_shape_is_reported():
    feeds = {"x": np.zeros((3, 4), np.float32), "s": np.ones(3, np.float32)}
    model = _model("QuantizeLinear", feeds, ["x", "s"], [("y", TensorProto.UINT8)], 13, axis=1)
    with pytest.raises(ShapeInferenceError, match="axis 1"):
        egraft.load(model)


# ---- DequantizeLinear ---------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [np.uint8, np.int8, np.int16, np.uint16])
def test_dequantize_per_tensor(dtype):
    info = np.iinfo(dtype)
    x = RNG.integers(info.min, info.max, (3, 5), endpoint=True).astype(dtype)
    feeds = {"x": x, "s": np.array(0.37, np.float32), "zp": np.array(info.min // 2 + info.max // 3, dtype)}
    model = _model("DequantizeLinear", feeds, ["x", "s", "zp"], [("y", TensorProto.FLOAT)], 21)
    _check(model, feeds)


def test_dequantize_per_axis_and_int32():
    x = RNG.integers(-128, 128, (2, 3, 4)).astype(np.int8)
    feeds = {"x": x, "s": RNG.uniform(0.01, 1, 3).astype(np.float32), "zp": np.array([1, -3, 7], np.int8)}
    _check(_model("DequantizeLinear", feeds, ["x", "s", "zp"], [("y", TensorProto.FLOAT)], 13, axis=1), feeds)
    x32 = RNG.integers(-(2**20), 2**20, (5,)).astype(np.int32)
    feeds32 = {"x": x32, "s": np.array(0.001, np.float32)}
    _check(_model("DequantizeLinear", feeds32, ["x", "s"], [("y", TensorProto.FLOAT)], 13), feeds32)


def test_dequantize_blocked():
    x = RNG.integers(0, 256, (4, 6)).astype(np.uint8)
    feeds = {"x": x, "s": RNG.uniform(0.01, 1, (2, 6)).astype(np.float32),
             "zp": RNG.integers(0, 256, (2, 6)).astype(np.uint8)}
    model = _model("DequantizeLinear", feeds, ["x", "s", "zp"], [("y", TensorProto.FLOAT)], 21, axis=0, block_size=2)
    _check(model, feeds)


def test_dequantize_float16_scale():
    x = RNG.integers(-128, 128, (3, 4)).astype(np.int8)
    feeds = {"x": x, "s": np.array(0.0371, np.float16), "zp": np.array(-4, np.int8)}
    model = _model("DequantizeLinear", feeds, ["x", "s", "zp"], [("y", TensorProto.FLOAT16)], 19)
    got = _check(model, feeds)["y"]
    assert got.dtype == np.float16


def test_dequantize_output_dtype_attribute():
    x = RNG.integers(0, 256, (3, 4)).astype(np.uint8)
    feeds = {"x": x, "s": np.array(0.5, np.float32), "zp": np.array(128, np.uint8)}
    model = _model("DequantizeLinear", feeds, ["x", "s", "zp"], [("y", TensorProto.FLOAT16)], 23,
                   output_dtype=TensorProto.FLOAT16)
    graph = egraft.load(model)
    assert str(graph.outputs[0].type) == "f16[3, 4]"
    got = graph.run(feeds)["y"]
    want = ((x.astype(np.int64) - 128).astype(np.float16) * np.float16(0.5))
    np.testing.assert_array_equal(got, want)


# ---- DynamicQuantizeLinear -------------------------------------------------------------------
@pytest.mark.parametrize("shift", [0.0, 3.0, -3.0])
def test_dynamic_quantize(shift):
    x = (RNG.standard_normal((4, 7)) + shift).astype(np.float32)
    feeds = {"x": x}
    outputs = [("y", TensorProto.UINT8), ("s", TensorProto.FLOAT), ("zp", TensorProto.UINT8)]
    model = _model("DynamicQuantizeLinear", feeds, ["x"], outputs, 11)
    graph = egraft.load(model)
    assert [str(v.type) for v in graph.outputs] == ["u8[4, 7]", "f32[]", "u8[]"]
    _check(model, feeds)


def test_dynamic_quantize_of_zeros_gives_onnxruntimes_unit_scale():
    feeds = {"x": np.zeros((2, 3), np.float32)}
    outputs = [("y", TensorProto.UINT8), ("s", TensorProto.FLOAT), ("zp", TensorProto.UINT8)]
    model = _model("DynamicQuantizeLinear", feeds, ["x"], outputs, 11)
    got = egraft.load(model).run(feeds)
    want = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, feeds)
    for name, expected in zip(("y", "s", "zp"), want):
        np.testing.assert_array_equal(got[name], expected)
    assert got["s"] == 1  # the formula's (0 - 0) / 255 would make dequantizing divide by zero


# ---- QLinearMatMul ---------------------------------------------------------------------------
QMM_INPUTS = ["a", "sa", "za", "b", "sb", "zb", "sy", "zy"]


@pytest.mark.parametrize(("opset", "a_dtype", "b_dtype", "y_dtype"),
                         [(10, np.uint8, np.uint8, np.uint8), (10, np.int8, np.int8, np.int8),
                          (10, np.uint8, np.int8, np.uint8), (21, np.uint8, np.uint8, np.uint8),
                          (21, np.int8, np.int8, np.int8)])
def test_qlinear_matmul(opset, a_dtype, b_dtype, y_dtype):
    def q(dtype, shape):
        info = np.iinfo(dtype)
        return RNG.integers(info.min, info.max, shape, endpoint=True).astype(dtype)

    feeds = {"a": q(a_dtype, (2, 3, 8)), "sa": np.array(0.02, np.float32), "za": q(a_dtype, ()),
             "b": q(b_dtype, (8, 5)), "sb": np.array(0.03, np.float32), "zb": np.array(0, b_dtype),
             "sy": np.array(0.9, np.float32), "zy": q(y_dtype, ())}
    model = _model("QLinearMatMul", feeds, QMM_INPUTS, [("y", _elem(y_dtype))], opset)
    graph = egraft.load(model)
    assert list(graph.outputs[0].type.shape) == _onnx_shapes(model)["y"] == [2, 3, 5]
    _check(model, feeds)


def test_qlinear_matmul_per_column_b():
    feeds = {"a": RNG.integers(0, 256, (4, 6)).astype(np.uint8), "sa": np.array(0.05, np.float32),
             "za": np.array(120, np.uint8), "b": RNG.integers(-128, 128, (6, 3)).astype(np.int8),
             "sb": RNG.uniform(0.01, 0.05, 3).astype(np.float32), "zb": np.zeros(3, np.int8),
             "sy": np.array(0.5, np.float32), "zy": np.array(100, np.uint8)}
    model = _model("QLinearMatMul", feeds, QMM_INPUTS, [("y", TensorProto.UINT8)], 10)
    _check(model, feeds)


# ---- ConvInteger and QLinearConv ---------------------------------------------------------------
CONV_CASES = [
    # (x shape, w shape, attributes)
    ((1, 3, 7, 7), (4, 3, 3, 3), {}),
    ((2, 4, 9, 8), (6, 2, 3, 2), {"group": 2, "pads": [1, 0, 2, 1], "strides": [2, 1]}),
    ((1, 2, 10, 10), (3, 2, 3, 3), {"dilations": [2, 2], "strides": [3, 2], "pads": [1, 1, 1, 1]}),
    ((1, 3, 7, 6), (3, 1, 3, 3), {"group": 3, "auto_pad": "SAME_UPPER", "strides": [2, 2]}),
    ((1, 2, 6, 7), (2, 2, 2, 2), {"auto_pad": "SAME_LOWER"}),
    ((2, 3, 11), (4, 3, 4), {"auto_pad": "VALID", "strides": [3]}),
    ((1, 2, 4, 5, 5), (2, 2, 2, 3, 2), {"pads": [0, 1, 1, 1, 0, 0]}),
]


@pytest.mark.parametrize(("x_shape", "w_shape", "attrs"), CONV_CASES)
def test_conv_integer(x_shape, w_shape, attrs):
    feeds = {"x": RNG.integers(0, 256, x_shape).astype(np.uint8), "w": RNG.integers(0, 256, w_shape).astype(np.uint8),
             "xz": np.array(131, np.uint8), "wz": np.array(17, np.uint8)}
    model = _model("ConvInteger", feeds, ["x", "w", "xz", "wz"], [("y", TensorProto.INT32)], 10, **attrs)
    graph = egraft.load(model)
    assert list(graph.outputs[0].type.shape) == _onnx_shapes(model)["y"]
    _check(model, feeds)


def test_conv_integer_without_zero_points():
    feeds = {"x": RNG.integers(0, 256, (1, 2, 5, 5)).astype(np.uint8),
             "w": RNG.integers(0, 256, (3, 2, 2, 2)).astype(np.uint8)}
    _check(_model("ConvInteger", feeds, ["x", "w"], [("y", TensorProto.INT32)], 10, pads=[1, 1, 1, 1]), feeds)


@pytest.mark.parametrize(("x_shape", "w_shape", "attrs"), CONV_CASES[:5])
@pytest.mark.parametrize("per_channel", [False, True])
def test_qlinear_conv(x_shape, w_shape, attrs, per_channel):
    m = w_shape[0]
    w_scale = RNG.uniform(0.002, 0.01, m) if per_channel else np.array(0.005)
    feeds = {"x": RNG.integers(0, 256, x_shape).astype(np.uint8), "sx": np.array(0.03, np.float32),
             "zx": np.array(128, np.uint8), "w": RNG.integers(-128, 128, w_shape).astype(np.int8),
             "sw": w_scale.astype(np.float32), "zw": np.zeros(w_scale.shape, np.int8),
             "sy": np.array(0.05, np.float32), "zy": np.array(120, np.uint8),
             "b": RNG.integers(-2000, 2000, m).astype(np.int32)}
    names = ["x", "sx", "zx", "w", "sw", "zw", "sy", "zy", "b"]
    model = _model("QLinearConv", feeds, names, [("y", TensorProto.UINT8)], 10, **attrs)
    graph = egraft.load(model)
    assert list(graph.outputs[0].type.shape) == _onnx_shapes(model)["y"]
    _check(model, feeds)


def test_qlinear_conv_int8_without_bias():
    feeds = {"x": RNG.integers(-128, 128, (2, 3, 6, 6)).astype(np.int8), "sx": np.array(0.05, np.float32),
             "zx": np.array(-3, np.int8), "w": RNG.integers(-128, 128, (5, 3, 3, 3)).astype(np.int8),
             "sw": np.array(0.01, np.float32), "zw": np.array(0, np.int8),
             "sy": np.array(0.2, np.float32), "zy": np.array(5, np.int8)}
    model = _model("QLinearConv", feeds, ["x", "sx", "zx", "w", "sw", "zw", "sy", "zy"], [("y", TensorProto.INT8)],
                   10, pads=[1, 1, 1, 1])
    _check(model, feeds)


def test_qlinear_conv_input_channel_mismatch_is_reported():
    feeds = {"x": np.zeros((1, 4, 5, 5), np.uint8), "w": np.zeros((2, 3, 3, 3), np.uint8)}
    model = _model("ConvInteger", feeds, ["x", "w"], [("y", TensorProto.INT32)], 10)
    with pytest.raises(ShapeInferenceError, match="channels"):
        egraft.load(model)


# ---- symbolic dims ---------------------------------------------------------------------------
def test_symbolic_quantize_dequantize():
    feeds = {"x": RNG.standard_normal((3, 4)).astype(np.float32), "s": np.array(0.1, np.float32),
             "zp": np.array(7, np.int8)}
    model = _model("QuantizeLinear", feeds, ["x", "s", "zp"], [("y", TensorProto.INT8)], 13,
                   dims={"x": ["batch", 4]})
    graph = egraft.load(model)
    assert str(graph.outputs[0].type) == "i8[batch, 4]"
    _check(model, feeds)
    qfeeds = {"x": RNG.integers(-128, 128, (2, 4)).astype(np.int8), "s": np.array(0.1, np.float32)}
    model = _model("DequantizeLinear", qfeeds, ["x", "s"], [("y", TensorProto.FLOAT)], 13, dims={"x": ["n", "k"]})
    assert str(egraft.load(model).outputs[0].type) == "f32[n, k]"


def test_symbolic_qlinear_matmul():
    feeds = {"a": RNG.integers(0, 256, (5, 6)).astype(np.uint8), "sa": np.array(0.05, np.float32),
             "za": np.array(120, np.uint8), "b": RNG.integers(0, 256, (6, 3)).astype(np.uint8),
             "sb": np.array(0.02, np.float32), "zb": np.array(3, np.uint8),
             "sy": np.array(0.5, np.float32), "zy": np.array(100, np.uint8)}
    model = _model("QLinearMatMul", feeds, QMM_INPUTS, [("y", TensorProto.UINT8)], 10, dims={"a": ["rows", 6]})
    graph = egraft.load(model)
    assert str(graph.outputs[0].type) == "u8[rows, 3]"
    _check(model, feeds)


def test_symbolic_qlinear_conv():
    feeds = {"x": RNG.integers(0, 256, (2, 3, 9, 8)).astype(np.uint8), "sx": np.array(0.03, np.float32),
             "zx": np.array(128, np.uint8), "w": RNG.integers(-128, 128, (8, 3, 3, 3)).astype(np.int8),
             "sw": np.array(0.004, np.float32), "zw": np.array(0, np.int8),
             "sy": np.array(0.05, np.float32), "zy": np.array(120, np.uint8)}
    names = ["x", "sx", "zx", "w", "sw", "zw", "sy", "zy"]
    same = _model("QLinearConv", feeds, names, [("y", TensorProto.UINT8)], 10, dims={"x": ["batch", 3, "h", "w"]},
                  pads=[1, 1, 1, 1])
    assert str(egraft.load(same).outputs[0].type) == "u8[batch, 8, h, w]"
    _check(same, feeds)
    strided = _model("QLinearConv", feeds, names, [("y", TensorProto.UINT8)], 10, dims={"x": ["batch", 3, "h", "w"]},
                     strides=[2, 3])
    out = egraft.load(strided).outputs[0].type
    bound = out.bind({"batch": 2, "h": 9, "w": 8})
    assert list(bound.shape) == list(_check(strided, feeds)["y"].shape)
    assert out.shape[2].free_symbols == {sym("h")}
    feeds_same_upper = dict(feeds)
    upper = _model("QLinearConv", feeds_same_upper, names, [("y", TensorProto.UINT8)], 10,
                   dims={"x": ["batch", 3, "h", "w"]}, auto_pad="SAME_UPPER", strides=[2, 2])
    out = egraft.load(upper).outputs[0].type
    assert list(out.bind({"batch": 2, "h": 9, "w": 8}).shape) == list(_check(upper, feeds)["y"].shape)

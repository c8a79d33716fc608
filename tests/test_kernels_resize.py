"""Generated Resize and Upsample kernels (egraft/kernels/cpu/resize.py) against onnxruntime:
nearest (every rounding), linear and cubic, coordinate modes, sizes and scales, axes,
antialiasing, crop-and-resize with extrapolation."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from conftest import check_compiled
from onnx import TensorProto, helper, numpy_helper

RNG = np.random.default_rng(8)


def _resize_model(x: np.ndarray, scales=None, sizes=None, roi=None, opset: int = 19, **attrs) -> onnx.ModelProto:
    inits, names = [], ["x", "", "", ""]
    for k, (name, value, dtype) in enumerate((("roi", roi, np.float32), ("scales", scales, np.float32),
                                              ("sizes", sizes, np.int64)), start=1):
        if value is not None:
            inits.append(numpy_helper.from_array(np.array(value, dtype), name))
            names[k] = name
    while names[-1] == "":
        names.pop()
    node = helper.make_node("Resize", names, ["y"], **attrs)
    return helper.make_model(helper.make_graph(
        [node], "resize", [helper.make_tensor_value_info("x", helper.np_dtype_to_tensor_dtype(x.dtype), x.shape)],
        [helper.make_tensor_value_info("y", helper.np_dtype_to_tensor_dtype(x.dtype), None)], inits),
        opset_imports=[helper.make_opsetid("", opset)])


@pytest.mark.parametrize("nearest_mode", ["round_prefer_floor", "round_prefer_ceil", "floor", "ceil"])
@pytest.mark.parametrize("coordinate_mode", ["half_pixel", "asymmetric", "align_corners", "pytorch_half_pixel"])
@pytest.mark.parametrize("scales", [[1, 1, 2, 2], [1, 1, 0.75, 1.75]])  # exact in binary: ties round alike
def test_nearest(nearest_mode, coordinate_mode, scales):
    if coordinate_mode == "align_corners" and scales[2] != int(scales[2]):
        pytest.skip("align_corners with a fractional scale: onnxruntime divides by the output length, the ONNX "
                    "spec (and egraft's reference) by scale * input length")
    x = RNG.normal(size=(1, 2, 5, 6)).astype(np.float32)
    model = _resize_model(x, scales=scales, mode="nearest", nearest_mode=nearest_mode,
                          coordinate_transformation_mode=coordinate_mode)
    check_compiled(model, {"x": x}, rtol=0, atol=0)


@pytest.mark.parametrize("mode", ["linear", "cubic"])
@pytest.mark.parametrize("coordinate_mode", ["half_pixel", "asymmetric", "align_corners", "pytorch_half_pixel"])
@pytest.mark.parametrize("sizes", [[2, 3, 9, 11], [2, 3, 3, 4]])
def test_linear_and_cubic_by_sizes(mode, coordinate_mode, sizes):
    x = RNG.normal(size=(2, 3, 6, 7)).astype(np.float32)
    model = _resize_model(x, sizes=sizes, mode=mode, coordinate_transformation_mode=coordinate_mode)
    check_compiled(model, {"x": x}, rtol=1e-5, atol=1e-5)


def test_cubic_with_exclude_outside_and_antialiased_downsampling():
    x = RNG.normal(size=(1, 1, 12, 10)).astype(np.float32)
    check_compiled(_resize_model(x, scales=[1, 1, 1.5, 0.8], mode="cubic", exclude_outside=1, cubic_coeff_a=-0.5),
                   {"x": x}, rtol=1e-5, atol=1e-5)
    check_compiled(_resize_model(x, scales=[1, 1, 0.5, 0.4], mode="linear", antialias=1), {"x": x},
                   rtol=1e-5, atol=1e-5)


def test_axes_and_keep_aspect_ratio():
    x = RNG.normal(size=(1, 2, 6, 8)).astype(np.float32)
    check_compiled(_resize_model(x, sizes=[9, 5], axes=[2, 3], mode="linear",
                                 keep_aspect_ratio_policy="not_larger"), {"x": x}, rtol=1e-5, atol=1e-5)


def test_crop_and_resize_extrapolates():
    x = RNG.normal(size=(1, 1, 6, 6)).astype(np.float32)
    model = _resize_model(x, roi=[0, 0, -0.2, 0.1, 1, 1, 0.9, 1.3], sizes=[1, 1, 5, 7], mode="linear",
                          coordinate_transformation_mode="tf_crop_and_resize", extrapolation_value=-7.0)
    check_compiled(model, {"x": x}, rtol=1e-5, atol=1e-5)


def test_nearest_on_integers_and_the_old_upsample():
    x = RNG.integers(-50, 50, size=(1, 2, 3, 4)).astype(np.int32)  # onnxruntime has no int64 Resize
    check_compiled(_resize_model(x, scales=[1, 1, 2, 1.5], mode="nearest"), {"x": x}, rtol=0, atol=0)
    f = RNG.normal(size=(1, 2, 3, 4)).astype(np.float32)
    upsample = helper.make_model(helper.make_graph(
        [helper.make_node("Upsample", ["x", "scales"], ["y"], mode="nearest")], "up",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, f.shape)],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
        [numpy_helper.from_array(np.array([1, 1, 2, 3], np.float32), "scales")]),
        opset_imports=[helper.make_opsetid("", 9)])
    check_compiled(upsample, {"x": f}, rtol=0, atol=0)

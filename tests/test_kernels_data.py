"""Generated data-movement and shape kernels (egraft/kernels/cpu/data.py) against onnxruntime:
Transpose, Concat, Split, Slice, Gather, Pad, Expand, Tile, Cast, Shape, Size, ConstantOfShape,
comparisons and boolean logic, across shapes, dtypes, attributes and opsets; symbolic dims run
at several sizes from one compiled model; the com.egraft blocked layouts against numpy."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from conftest import check_compiled, run_onnxruntime
from onnx import TensorProto, helper, numpy_helper

import egraft
from egraft.lowering.compile import compile_graph

RNG = np.random.default_rng(11)


def _elem(dtype) -> int:
    return helper.np_dtype_to_tensor_dtype(np.dtype(dtype))


def _model(op: str, inputs: dict[str, np.ndarray], out_dtypes, opset: int = 17, dims: dict | None = None,
           initializers: dict | None = None, order: list[str] | None = None, **attrs) -> onnx.ModelProto:
    """One ``op`` node over graph inputs ``inputs`` and constant ``initializers`` (in ``order``
    when given, "" for an omitted optional input), one output per dtype of ``out_dtypes``."""
    dims = dims or {}
    initializers = initializers or {}
    names = order if order is not None else list(inputs) + list(initializers)
    out_dtypes = out_dtypes if isinstance(out_dtypes, list) else [out_dtypes]
    outputs = ["y"] if len(out_dtypes) == 1 else [f"y{j}" for j in range(len(out_dtypes))]
    node = helper.make_node(op, names, outputs, **attrs)
    graph_inputs = [helper.make_tensor_value_info(k, _elem(a.dtype), dims.get(k, list(a.shape)))
                    for k, a in inputs.items()]
    inits = [numpy_helper.from_array(a, k) for k, a in initializers.items()]
    graph_outputs = [helper.make_tensor_value_info(name, _elem(t), None) for name, t in zip(outputs, out_dtypes)]
    return helper.make_model(helper.make_graph([node], "g", graph_inputs, graph_outputs, inits),
                             opset_imports=[helper.make_opsetid("", opset)])


def _exact(model: onnx.ModelProto, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    return check_compiled(model, feeds, rtol=0, atol=0)


def _kinds(model: onnx.ModelProto) -> list[str]:
    return [s.kind for s in compile_graph(egraft.load(model)).steps]


def _check_sizes(model: onnx.ModelProto, make_feeds, sizes=(2, 5)) -> None:
    """One compiled model run at each symbolic size, compared with onnxruntime each time."""
    compiled = compile_graph(egraft.load(model))
    assert not compiled.report().fallbacks, compiled.report().fallbacks
    for n in sizes:
        feeds = make_feeds(n)
        got = compiled.run(feeds)
        for name, want in run_onnxruntime(model, feeds).items():
            assert got[name].dtype == want.dtype and got[name].shape == want.shape, (name, n)
            np.testing.assert_array_equal(got[name], want, err_msg=f"{name} at size {n}")


def _values(shape, dtype) -> np.ndarray:
    dtype = np.dtype(dtype)
    if dtype == np.bool_:
        return RNG.random(shape) > 0.5
    if dtype.kind == "f":
        return RNG.normal(size=shape).astype(dtype)
    return RNG.integers(-100, 100, size=shape).astype(dtype) if dtype.kind == "i" else \
        RNG.integers(0, 200, size=shape).astype(dtype)


# ---- Transpose --------------------------------------------------------------------------------
@pytest.mark.parametrize(("shape", "perm"), [
    ((2, 3, 4), None), ((2, 3, 4), [1, 0, 2]), ((2, 3, 4), [2, 1, 0]), ((2, 3, 4), [0, 2, 1]),
    ((2, 3, 4, 5), [0, 2, 3, 1]), ((2, 3, 4, 5), [0, 3, 1, 2]), ((2, 3, 4, 5), [3, 2, 1, 0]),
    ((3, 40, 37), [0, 2, 1]), ((50, 70), [1, 0]), ((1, 5, 1, 6), [3, 1, 2, 0]), ((7,), [0]),
])
@pytest.mark.parametrize("dtype", [np.float32, np.int64])
def test_transpose(shape, perm, dtype):
    x = _values(shape, dtype)
    attrs = {} if perm is None else {"perm": perm}
    _exact(_model("Transpose", {"x": x}, dtype, **attrs), {"x": x})


@pytest.mark.parametrize("dtype", [np.float64, np.int32, np.int8, np.uint8, np.bool_])
def test_transpose_dtypes(dtype):
    x = _values((33, 20, 3), dtype)
    _exact(_model("Transpose", {"x": x}, dtype, perm=[1, 2, 0]), {"x": x})


def test_transpose_symbolic_batch_one_model_two_sizes():
    model = _model("Transpose", {"x": np.zeros((1, 3, 20, 18), np.float32)}, np.float32,
                   dims={"x": ["batch", 3, 20, 18]}, perm=[0, 2, 3, 1])
    _check_sizes(model, lambda n: {"x": _values((n, 3, 20, 18), np.float32)})
    model = _model("Transpose", {"x": np.zeros((1, 19), np.float32)}, np.float32, dims={"x": ["batch", 19]})
    _check_sizes(model, lambda n: {"x": _values((n * 9, 19), np.float32)})  # tiled with a symbolic axis


@pytest.mark.parametrize(("shape", "perm"), [((8, 8), [1, 0]), ((13, 21), [1, 0]), ((2, 9, 3, 17), [0, 3, 2, 1]),
                                            ((64, 3136), [1, 0])])
@pytest.mark.parametrize("dtype", [np.float32, np.int32])
def test_transpose_in_register_blocks(shape, perm, dtype):
    """4-byte transposes with both sides >= 8 run in 8 x 8 register blocks, a side not a
    multiple of 8 ending in an overlapping block: every element lands where numpy puts it."""
    x = _values(shape, dtype)
    _exact(_model("Transpose", {"x": x}, dtype, perm=perm), {"x": x})


def test_transpose_in_register_blocks_symbolic_sides_long_and_short():
    """A symbolic side is checked at run time: 8 x 8 blocks when both sides have 8, element
    copies when one is shorter."""
    model = _model("Transpose", {"x": np.zeros((1, 12), np.float32)}, np.float32, dims={"x": ["rows", 12]})
    _check_sizes(model, lambda n: {"x": _values((n, 12), np.float32)}, sizes=(5, 8, 21))


# ---- Concat and Split -------------------------------------------------------------------------
@pytest.mark.parametrize("axis", [0, 1, 2, -1, -3])
@pytest.mark.parametrize("dtype", [np.float32, np.int64])
def test_concat(axis, dtype):
    base = [2, 3, 4]
    xs = {}
    for k, extra in enumerate([1, 3, 2]):
        shape = list(base)
        shape[axis] = extra
        xs[f"x{k}"] = _values(shape, dtype)
    _exact(_model("Concat", xs, dtype, axis=axis), xs)


def test_concat_with_a_constant_and_a_symbolic_dim():
    model = _model("Concat", {"a": np.zeros((1, 4), np.float32), "b": np.zeros((1, 4), np.float32)}, np.float32,
                   dims={"a": ["n", 4], "b": ["m", 4]}, initializers={"c": np.ones((2, 4), np.float32)}, axis=0)
    _check_sizes(model, lambda n: {"a": _values((n, 4), np.float32), "b": _values((n + 1, 4), np.float32)})
    model = _model("Concat", {"a": np.zeros((1, 4), np.float32)}, np.float32, dims={"a": ["batch", 4]},
                   initializers={"c": np.ones((1, 4), np.float32)}, order=["c", "a", "c"], axis=0)
    _check_sizes(model, lambda n: {"a": _values((n, 4), np.float32)})


@pytest.mark.parametrize(("axis", "sizes"), [(0, [2, 3, 1]), (1, [1, 4]), (-1, [5, 2, 3]), (1, None)])
@pytest.mark.parametrize("opset", [11, 13])
def test_split(axis, sizes, opset):
    shape = {0: (6, 4, 10), 1: (2, 5, 10) if sizes else (2, 4, 10), -1: (2, 3, 10)}[axis]
    x = _values(shape, np.float32)
    n = len(sizes) if sizes else 2
    if sizes is None:
        model = _model("Split", {"x": x}, [np.float32] * n, opset=opset, axis=axis)
    elif opset < 13:
        model = _model("Split", {"x": x}, [np.float32] * n, opset=opset, axis=axis, split=sizes)
    else:
        model = _model("Split", {"x": x}, [np.float32] * n, opset=opset, axis=axis,
                       initializers={"s": np.array(sizes, np.int64)})
    _exact(model, {"x": x})


def test_split_num_outputs_uneven_and_int64():
    x = _values((3, 7), np.int64)
    _exact(_model("Split", {"x": x}, [np.int64] * 3, opset=18, axis=1, num_outputs=3), {"x": x})


def test_split_symbolic_batch():
    model = _model("Split", {"x": np.zeros((1, 6), np.float32)}, [np.float32] * 2, dims={"x": ["batch", 6]},
                   axis=1, initializers={"s": np.array([4, 2], np.int64)})
    _check_sizes(model, lambda n: {"x": _values((n, 6), np.float32)})


# ---- Slice ------------------------------------------------------------------------------------
SLICES = [
    # starts, ends, axes, steps
    ([1], [3], [1], None),
    ([0, 1], [2, 4], [0, 2], [1, 2]),
    ([-1], [-1000], [1], [-1]),
    ([4, -2], [0, 1], [2, 1], [-2, -1]),
    ([-100], [100], [-1], None),
    ([2], [2**62], [2], [3]),
    ([10], [20], [0], None),  # empty: start past the end
    ([1, 0, 0], [-1, 5, 9223372036854775807], None, [1, 2, 2]),
]


@pytest.mark.parametrize(("starts", "ends", "axes", "steps"), SLICES)
@pytest.mark.parametrize("dtype", [np.float32, np.int64])
def test_slice(starts, ends, axes, steps, dtype):
    x = _values((3, 5, 6), dtype)
    inits = {"starts": np.array(starts, np.int64), "ends": np.array(ends, np.int64)}
    order = ["x", "starts", "ends"]
    if axes is not None:
        inits["axes"] = np.array(axes, np.int64)
        order.append("axes")
    if steps is not None:
        if axes is None:
            order.append("")
        inits["steps"] = np.array(steps, np.int64)
        order.append("steps")
    _exact(_model("Slice", {"x": x}, dtype, opset=13, initializers=inits, order=order), {"x": x})


def test_slice_runs_a_kernel_when_not_contiguous():
    x = _values((3, 5, 6), np.float32)
    model = _model("Slice", {"x": x}, np.float32, initializers={"s": np.array([1], np.int64),
                                                                "e": np.array([4], np.int64),
                                                                "a": np.array([2], np.int64)})
    assert _kinds(model) == ["kernel"]
    _exact(model, {"x": x})


def test_slice_opset9_attributes():
    x = _values((4, 6), np.float32)
    _exact(_model("Slice", {"x": x}, np.float32, opset=9, starts=[1, -4], ends=[100, -1], axes=[0, 1]), {"x": x})
    _exact(_model("Slice", {"x": x}, np.float32, opset=9, starts=[0, 2], ends=[3, 5]), {"x": x})


def test_slice_symbolic_batch():
    inits = {"s": np.array([1, 1], np.int64), "e": np.array([-1, 7], np.int64), "a": np.array([0, 1], np.int64),
             "st": np.array([1, 2], np.int64)}
    model = _model("Slice", {"x": np.zeros((4, 8), np.float32)}, np.float32, dims={"x": ["batch", 8]},
                   initializers=inits)
    _check_sizes(model, lambda n: {"x": _values((n, 8), np.float32)}, sizes=(3, 6))
    inits = {"s": np.array([2, 1], np.int64), "e": np.array([2**62, 1000], np.int64), "a": np.array([0, 1], np.int64),
             "st": np.array([1, 3], np.int64)}
    model = _model("Slice", {"x": np.zeros((4, 8), np.float32)}, np.float32, dims={"x": ["batch", 8]},
                   initializers=inits)
    _check_sizes(model, lambda n: {"x": _values((n, 8), np.float32)}, sizes=(3, 6))


def test_slice_negative_start_on_a_symbolic_axis_falls_back():
    """x[-3:] on a symbolic axis is typed as 3 long, true only when the axis has 3 or more: the
    reference kernel checks that at run time, a generated one could not."""
    inits = {"s": np.array([-3], np.int64), "e": np.array([2**62], np.int64), "a": np.array([0], np.int64)}
    model = _model("Slice", {"x": np.zeros((4, 8), np.float32)}, np.float32, dims={"x": ["batch", 8]},
                   initializers=inits)
    fallbacks = compile_graph(egraft.load(model)).report().fallbacks
    assert len(fallbacks) == 1 and "assumes batch >= 3" in fallbacks[0][2]
    x = _values((5, 8), np.float32)
    check_compiled(model, {"x": x}, generated=False, rtol=0, atol=0)


# ---- Gather -----------------------------------------------------------------------------------
@pytest.mark.parametrize("axis", [0, 1, -1])
@pytest.mark.parametrize("index_dtype", [np.int64, np.int32])
@pytest.mark.parametrize("index_shape", [(), (4,), (2, 3)])
def test_gather_runtime_indices(axis, index_dtype, index_shape):
    data = _values((5, 6, 7), np.float32)
    size = data.shape[axis]
    indices = RNG.integers(-size, size, size=index_shape).astype(index_dtype)
    _exact(_model("Gather", {"data": data, "i": indices}, np.float32, axis=axis), {"data": data, "i": indices})


def test_gather_constant_indices_and_int64_data():
    data = _values((4, 3), np.int64)
    model = _model("Gather", {"data": data}, np.int64, initializers={"i": np.array([3, -1, 0, 0], np.int64)}, axis=0)
    _exact(model, {"data": data})
    model = _model("Gather", {"data": data}, np.int64, initializers={"i": np.array(-2, np.int32)}, axis=1)
    _exact(model, {"data": data})


def test_gather_symbolic_batch():
    model = _model("Gather", {"data": np.zeros((1, 5), np.float32), "i": np.zeros(3, np.int64)}, np.float32,
                   dims={"data": ["batch", 5]}, axis=1)
    _check_sizes(model, lambda n: {"data": _values((n, 5), np.float32), "i": np.array([-1, 0, 4], np.int64)})


# ---- Pad --------------------------------------------------------------------------------------
PADS = [[0, 1, 2, 0, 2, 1], [1, 0, 0, 1, 0, 0], [0, 0, 3, 0, 0, 0], [0, -1, 1, 0, 2, -2], [0, 0, 0, 0, 0, 0],
        [2, 2, 2, 2, 2, 2]]


@pytest.mark.parametrize("pads", PADS)
@pytest.mark.parametrize("mode", ["constant", "edge", "reflect", "wrap"])
def test_pad_modes(pads, mode):
    x = _values((3, 4, 5), np.float32)
    inits = {"pads": np.array(pads, np.int64)}
    if mode == "constant":
        inits["value"] = np.array(1.5, np.float32)
    _exact(_model("Pad", {"x": x}, np.float32, opset=19, initializers=inits, mode=mode), {"x": x})


def test_pad_int64_default_value_axes_and_old_opsets():
    x = _values((2, 3, 4), np.int64)
    _exact(_model("Pad", {"x": x}, np.int64, opset=13, initializers={"pads": np.array([1, 0, 2, 0, 1, 1], np.int64)}),
           {"x": x})
    _exact(_model("Pad", {"x": x}, np.int64, opset=18,
                  initializers={"pads": np.array([2, 1, 0, 3], np.int64), "v": np.array(-7, np.int64),
                                "axes": np.array([-1, 0], np.int64)}), {"x": x})
    y = _values((2, 3), np.float32)
    _exact(_model("Pad", {"x": y}, np.float32, opset=2, pads=[1, 0, 0, 2], value=-3.0), {"x": y})
    _exact(_model("Pad", {"x": y}, np.float32, opset=10, pads=[0, 1, 1, 1], mode="edge"), {"x": y})


def test_pad_symbolic_batch():
    model = _model("Pad", {"x": np.zeros((1, 3, 4), np.float32)}, np.float32, dims={"x": ["batch", 3, 4]},
                   initializers={"pads": np.array([0, 1, 1, 0, 1, 2], np.int64), "v": np.array(9, np.float32)})
    _check_sizes(model, lambda n: {"x": _values((n, 3, 4), np.float32)})
    model = _model("Pad", {"x": np.zeros((1, 3, 4), np.float32)}, np.float32, dims={"x": ["batch", 3, 4]},
                   initializers={"pads": np.array([0, 1, 1, 0, 1, 2], np.int64)}, mode="reflect")
    _check_sizes(model, lambda n: {"x": _values((n, 3, 4), np.float32)})


# ---- Expand and Tile --------------------------------------------------------------------------
@pytest.mark.parametrize(("shape", "target"), [((3, 1), (2, 3, 4)), ((1,), (5,)), ((2, 1, 4), (2, 3, 4)),
                                               ((4,), (3, 1, 4)), ((3, 1), (1, 5))])
@pytest.mark.parametrize("dtype", [np.float32, np.int64, np.bool_])
def test_expand(shape, target, dtype):
    x = _values(shape, dtype)
    _exact(_model("Expand", {"x": x}, dtype, initializers={"shape": np.array(target, np.int64)}), {"x": x})


def test_expand_symbolic_batch():
    model = _model("Expand", {"x": np.zeros((1, 1, 4), np.float32)}, np.float32, dims={"x": ["batch", 1, 4]},
                   initializers={"shape": np.array([1, 3, 1], np.int64)})
    _check_sizes(model, lambda n: {"x": _values((n, 1, 4), np.float32)})


@pytest.mark.parametrize(("shape", "repeats"), [((2, 3), (1, 3)), ((2, 3), (2, 1)), ((2, 3, 4), (2, 1, 3)),
                                                ((5,), (4,)), ((2, 3), (1, 1))])
@pytest.mark.parametrize("dtype", [np.float32, np.int64])
def test_tile(shape, repeats, dtype):
    x = _values(shape, dtype)
    _exact(_model("Tile", {"x": x}, dtype, initializers={"r": np.array(repeats, np.int64)}), {"x": x})


def test_tile_symbolic_batch():
    model = _model("Tile", {"x": np.zeros((1, 3), np.float32)}, np.float32, dims={"x": ["batch", 3]},
                   initializers={"r": np.array([2, 2], np.int64)})
    _check_sizes(model, lambda n: {"x": _values((n, 3), np.float32)})


# ---- Cast ---------------------------------------------------------------------------------------
CAST_TYPES = [np.float32, np.float64, np.int32, np.int64, np.int8, np.uint8, np.bool_]


def _cast_source(source, target) -> np.ndarray:
    if np.dtype(source) == np.bool_:
        return RNG.random((4, 9)) > 0.5
    if np.dtype(source).kind == "f":
        low = 0.0 if np.dtype(target) == np.uint8 else -100.0
        x = RNG.uniform(low, 100.0, size=(4, 9)).astype(source)
        x[0, :4] = [0.0, 2.7, 0.5, 99.9]
        if low < 0:
            x[1, :3] = [-2.7, -0.5, -99.9]
        return x
    x = RNG.integers(0 if np.dtype(source) == np.uint8 else -100, 100, size=(4, 9)).astype(source)
    x[0, 0] = 0
    return x


@pytest.mark.parametrize("source", CAST_TYPES)
@pytest.mark.parametrize("target", CAST_TYPES)
def test_cast_every_pair(source, target):
    x = _cast_source(source, target)
    _exact(_model("Cast", {"x": x}, target, to=_elem(target)), {"x": x})


def test_cast_float_to_bool_nan_and_like():
    x = np.array([0.0, -0.0, np.nan, 1e-30, -3.0], np.float32)
    _exact(_model("Cast", {"x": x}, np.bool_, to=TensorProto.BOOL), {"x": x})
    y = _cast_source(np.float64, np.int32)
    _exact(_model("CastLike", {"x": y}, np.int32, initializers={"like": np.zeros(1, np.int32)}), {"x": y})


def test_cast_symbolic_batch():
    model = _model("Cast", {"x": np.zeros((1, 3), np.float32)}, np.int64, dims={"x": ["batch", 3]},
                   to=TensorProto.INT64)
    _check_sizes(model, lambda n: {"x": _values((n, 3), np.float32) * 10})


# ---- Shape, Size, ConstantOfShape ------------------------------------------------------------------
@pytest.mark.parametrize(("opset", "attrs"), [(13, {}), (15, {"start": 1}), (15, {"end": -1}),
                                              (15, {"start": -2, "end": 10}), (15, {"start": 2, "end": 1})])
def test_shape(opset, attrs):
    x = _values((2, 3, 4), np.float32)
    _exact(_model("Shape", {"x": x}, np.int64, opset=opset, **attrs), {"x": x})


def test_shape_and_size_of_symbolic_dims():
    model = _model("Shape", {"x": np.zeros((1, 3, 2), np.float32)}, np.int64, dims={"x": ["batch", 3, "seq"]})
    _check_sizes(model, lambda n: {"x": np.zeros((n, 3, n + 1), np.float32)})
    model = _model("Size", {"x": np.zeros((1, 3, 2), np.float32)}, np.int64, dims={"x": ["batch", 3, "seq"]})
    _check_sizes(model, lambda n: {"x": np.zeros((n, 3, n + 1), np.float32)})
    x = _values((2, 3), np.int64)
    _exact(_model("Size", {"x": x}, np.int64), {"x": x})


@pytest.mark.parametrize("value", [None, np.array([2.5], np.float32), np.array([-3], np.int64),
                                   np.array([1], np.bool_), np.array([7], np.int32)])
def test_constant_of_shape(value, tmp_path):
    attrs = {} if value is None else {"value": numpy_helper.from_array(value)}
    dtype = np.float32 if value is None else value.dtype
    x = _values((2, 3), np.float32)
    nodes = [helper.make_node("Shape", ["x"], ["s"]), helper.make_node("ConstantOfShape", ["s"], ["y"], **attrs)]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 3])],
                              [helper.make_tensor_value_info("y", _elem(dtype), None)])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    _check_sizes(model, lambda n: {"x": np.zeros((n, 3), np.float32)})
    _exact(_model("ConstantOfShape", {}, dtype, initializers={"s": np.array([2, 0, 3], np.int64)}, **attrs), {})
    del x


# ---- comparisons and logic -------------------------------------------------------------------------
@pytest.mark.parametrize("op", ["Equal", "Less", "Greater", "LessOrEqual", "GreaterOrEqual"])
@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.int64, np.int32, np.uint8])
@pytest.mark.parametrize(("a_shape", "b_shape"), [((3, 4), (3, 4)), ((2, 3, 4), (4,)), ((3, 1), (1, 5))])
def test_compare(op, dtype, a_shape, b_shape):
    a = np.round(_values(a_shape, dtype) / 30).astype(dtype)  # small values: ties happen
    b = np.round(_values(b_shape, dtype) / 30).astype(dtype)
    if np.dtype(dtype).kind == "f":
        a.flat[0] = np.nan
    _exact(_model(op, {"a": a, "b": b}, np.bool_), {"a": a, "b": b})


def test_equal_on_bool_and_uint8_order():
    a, b = _values((5, 6), np.bool_), _values((6,), np.bool_)
    _exact(_model("Equal", {"a": a, "b": b}, np.bool_), {"a": a, "b": b})
    a, b = np.array([200, 3, 128], np.uint8), np.array([100, 3, 127], np.uint8)
    _exact(_model("Greater", {"a": a, "b": b}, np.bool_), {"a": a, "b": b})


@pytest.mark.parametrize("op", ["And", "Or", "Xor"])
def test_bool_logic(op):
    a, b = _values((3, 4), np.bool_), _values((2, 3, 1), np.bool_)
    _exact(_model(op, {"a": a, "b": b}, np.bool_), {"a": a, "b": b})


def test_not_and_a_symbolic_batch():
    a = _values((3, 4), np.bool_)
    _exact(_model("Not", {"a": a}, np.bool_), {"a": a})
    model = _model("Less", {"a": np.zeros((1, 4), np.float32), "b": np.zeros(4, np.float32)}, np.bool_,
                   dims={"a": ["batch", 4]})
    _check_sizes(model, lambda n: {"a": _values((n, 4), np.float32), "b": _values((4,), np.float32)})


# ---- com.egraft blocked layouts -------------------------------------------------------------------
def _numpy_to_blocked(x: np.ndarray, block: int) -> np.ndarray:
    """``[N, C, *S] -> [N, C/block, *S, block]`` written out: split C, move the lanes last."""
    n, c, spatial = x.shape[0], x.shape[1], x.shape[2:]
    split = x.reshape(n, c // block, block, *spatial)
    return split.transpose(0, 1, *range(3, 3 + len(spatial)), 2).copy()


def _numpy_from_blocked(y: np.ndarray, block: int) -> np.ndarray:
    n, cb, spatial = y.shape[0], y.shape[1], y.shape[2:-1]
    lanes = y.transpose(0, 1, y.ndim - 1, *range(2, y.ndim - 1))
    return lanes.reshape(n, cb * block, *spatial).copy()


def _layout_graph(op: str, in_shape, out_shape, block: int, dtype):
    from egraft.ir.graph import Graph, Node, Value
    from egraft.ir.types import DType, TensorType

    x = Value("x", TensorType(DType.from_numpy(np.dtype(dtype)), tuple(in_shape)))
    y = Value("y", TensorType(DType.from_numpy(np.dtype(dtype)), tuple(out_shape)))
    return Graph("g", [x], [y], [Node(op, (x,), (y,), {"block": block}, domain="com.egraft")],
                 opsets={"": 17, "com.egraft": 1})


@pytest.mark.parametrize(("shape", "block"), [((2, 16, 5, 5), 8), ((1, 8, 7), 4), ((3, 12, 2, 3, 4), 4),
                                              ((2, 32, 9, 9), 16), ((1, 8, 1, 1), 8), ((1, 24, 3, 5), 8)])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_layout_to_and_from_blocked(shape, block, dtype):
    from egraft.ir.dims import sym

    x = _values(shape, dtype)
    blocked = _numpy_to_blocked(x, block)
    compiled = compile_graph(_layout_graph("LayoutToBlocked", shape, blocked.shape, block, dtype))
    assert [s.kind for s in compiled.steps] == ["kernel"]
    np.testing.assert_array_equal(compiled.run({"x": x})["y"], blocked)
    back = compile_graph(_layout_graph("LayoutFromBlocked", blocked.shape, shape, block, dtype))
    assert [s.kind for s in back.steps] == ["kernel"]
    np.testing.assert_array_equal(back.run({"x": blocked})["y"], _numpy_from_blocked(blocked, block))
    np.testing.assert_array_equal(back.run({"x": blocked})["y"], x)
    batch = sym("batch")
    symbolic = compile_graph(_layout_graph("LayoutToBlocked", (batch, *shape[1:]), (batch, *blocked.shape[1:]),
                                           block, dtype))
    for n in (1, 3):
        xs = _values((n, *shape[1:]), dtype)
        np.testing.assert_array_equal(symbolic.run({"x": xs})["y"], _numpy_to_blocked(xs, block))


# ---- what stays on the reference kernels ---------------------------------------------------------
def test_runtime_parameters_fall_back_with_a_reason():
    x = _values((3, 4), np.float32)
    model = _model("Slice", {"x": x, "s": np.array([1], np.int64), "e": np.array([3], np.int64)}, np.float32)
    assert not compile_graph(egraft.load(model)).report().fallbacks  # computed starts: read when the kernel runs
    feeds = {"x": x, "s": np.array([1], np.int64), "e": np.array([3], np.int64)}
    check_compiled(model, feeds, rtol=0, atol=0)
    model = _model("Tile", {"x": x, "r": np.array([2, 1], np.int64)}, np.float32)
    fallbacks = compile_graph(egraft.load(model)).report().fallbacks
    assert len(fallbacks) == 1 and "repeats" in fallbacks[0][2]

"""Reductions and index ops (egraft/ir/ops/reduce_index.py): one-node models run by egraft
and by onnxruntime (or numpy where onnxruntime departs from the ONNX spec), and egraft's
inferred types against onnx.shape_inference and with symbolic dims."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto as TP
from onnx import helper

import egraft
from egraft.ir.registry import get_op

RNG = np.random.default_rng(0)
F32, F16, F64, I32, I64, U8, BOOL = TP.FLOAT, TP.FLOAT16, TP.DOUBLE, TP.INT32, TP.INT64, TP.UINT8, TP.BOOL


def _np_dtype(elem_type: int) -> np.dtype:
    return np.dtype(helper.tensor_dtype_to_np_dtype(elem_type))


def make_model(op: str, inputs: list, outputs: list, opset: int, consts: dict | None = None,
               **attrs) -> onnx.ModelProto:
    """A one-node model. ``inputs``: (name, elem_type, shape) or "" for an omitted input;
    ``outputs``: (name, elem_type); ``consts``: name -> array stored as initializers."""
    consts = consts or {}
    names = [i if i == "" else i[0] for i in inputs]
    graph_inputs = [helper.make_tensor_value_info(n, t, s) for i in inputs if i != "" for n, t, s in [i]
                    if n not in consts]
    graph = helper.make_graph(
        [helper.make_node(op, names, [o[0] for o in outputs], **attrs)], op.lower(), graph_inputs,
        [helper.make_tensor_value_info(n, t, None) for n, t in outputs],
        initializer=[onnx.numpy_helper.from_array(v, n) for n, v in consts.items()])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])


def run_ort(model: onnx.ModelProto, feeds: dict) -> list[np.ndarray]:
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.log_severity_level = 3
    session = ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
    return session.run(None, feeds)


def run_egraft(model: onnx.ModelProto, feeds: dict) -> list[np.ndarray]:
    graph = egraft.load(model)
    out = graph.run(feeds)
    return [out[v.name] for v in graph.outputs]


def assert_same(actual: list, expected: list, rtol: float = 1e-5, atol: float = 1e-6) -> None:
    assert len(actual) == len(expected)
    for a, e in zip(actual, expected):
        e = np.asarray(e)
        assert a.dtype == e.dtype, (a.dtype, e.dtype)
        assert a.shape == e.shape, (a.shape, e.shape)
        if e.dtype.kind in "fc":
            np.testing.assert_allclose(a.astype(np.float64), e.astype(np.float64), rtol=rtol, atol=atol)
        else:
            np.testing.assert_array_equal(a, e)


def check_against_ort(model: onnx.ModelProto, feeds: dict, **tol) -> list[np.ndarray]:
    """egraft's outputs equal onnxruntime's; egraft's inferred types equal onnx's static ones."""
    actual = run_egraft(model, feeds)
    assert_same(actual, run_ort(model, feeds), **tol)
    check_types_against_onnx(model)
    return actual


def check_types_against_onnx(model: onnx.ModelProto) -> None:
    """Every output type that onnx.shape_inference infers statically equals egraft's."""
    inferred = onnx.shape_inference.infer_shapes(model, strict_mode=True)
    graph = egraft.load(model)
    for vi, value in zip(inferred.graph.output, graph.outputs):
        tt = vi.type.tensor_type
        assert value.type.dtype.value == tt.elem_type
        if tt.HasField("shape") and all(d.HasField("dim_value") for d in tt.shape.dim):
            assert value.type.shape == tuple(d.dim_value for d in tt.shape.dim)


def out_type(model: onnx.ModelProto, index: int = 0) -> str:
    return str(egraft.load(model).outputs[index].type)


def rand(shape, elem_type=F32, low=-3, high=3) -> np.ndarray:
    dtype = _np_dtype(elem_type)
    if dtype.kind == "f":
        return RNG.uniform(low, high, size=shape).astype(dtype)
    if dtype == np.bool_:
        return RNG.integers(0, 2, size=shape).astype(bool)
    return RNG.integers(max(low, np.iinfo(dtype).min), high, size=shape).astype(dtype)


# ---- Reduce* -------------------------------------------------------------------------------------
REDUCE_OPS = ["ReduceSum", "ReduceMean", "ReduceMax", "ReduceMin", "ReduceProd", "ReduceL1", "ReduceL2",
              "ReduceLogSum", "ReduceLogSumExp", "ReduceSumSquare"]


def _axes_input_since(op: str) -> int:
    return 13 if op == "ReduceSum" else 18


def reduce_model(op: str, shape, elem_type=F32, axes=None, opset: int = 18, **attrs) -> onnx.ModelProto:
    if opset >= _axes_input_since(op):
        inputs = [("x", elem_type, shape)]
        consts = {}
        if axes is not None:
            inputs.append(("axes", I64, [len(axes)]))
            consts["axes"] = np.array(axes, np.int64)
        return make_model(op, inputs, [("y", elem_type)], opset, consts, **attrs)
    if axes is not None:
        attrs["axes"] = axes
    return make_model(op, [("x", elem_type, shape)], [("y", elem_type)], opset, **attrs)


def _positive_if_log(op: str, x: np.ndarray) -> np.ndarray:
    return np.abs(x) + 0.5 if op == "ReduceLogSum" else x


@pytest.mark.parametrize("op", REDUCE_OPS)
@pytest.mark.parametrize("axes,keepdims", [([1], 1), ([0, 2], 0), ([-1], 1), (None, 0), (None, 1)])
def test_reduce_axes_input_matches_onnxruntime(op, axes, keepdims):
    x = _positive_if_log(op, rand((3, 4, 5)))
    model = reduce_model(op, [3, 4, 5], axes=axes, keepdims=keepdims)
    check_against_ort(model, {"x": x}, rtol=1e-4)


@pytest.mark.parametrize("op", REDUCE_OPS)
def test_reduce_axes_attribute_before_opset_18(op):
    x = _positive_if_log(op, rand((2, 3, 4)))
    model = reduce_model(op, [2, 3, 4], axes=[0, -1], opset=11, keepdims=0)
    assert out_type(model) == "f32[3]"
    check_against_ort(model, {"x": x}, rtol=1e-4)


@pytest.mark.parametrize("op", REDUCE_OPS)
def test_reduce_noop_with_empty_axes_applies_only_the_elementwise_part(op):
    x = _positive_if_log(op, rand((2, 3)))
    model = reduce_model(op, [2, 3], axes=None, noop_with_empty_axes=1, keepdims=0)
    assert out_type(model) == "f32[2, 3]"
    check_against_ort(model, {"x": x}, rtol=1e-4)


@pytest.mark.parametrize("op", REDUCE_OPS)
def test_reduce_float16_keeps_dtype(op):
    x = _positive_if_log(op, rand((4, 6), F16, -1, 1)).astype(np.float16)
    model = reduce_model(op, [4, 6], F16, axes=[1])
    check_against_ort(model, {"x": x}, rtol=2e-3, atol=2e-3)


@pytest.mark.parametrize("op", ["ReduceSum", "ReduceMean", "ReduceMax", "ReduceMin", "ReduceProd", "ReduceL1",
                                "ReduceSumSquare"])
@pytest.mark.parametrize("elem_type", [I32, I64])
def test_reduce_integers(op, elem_type):
    x = rand((3, 5), elem_type, -9, 9)
    check_against_ort(reduce_model(op, [3, 5], elem_type, axes=[1]), {"x": x})


def test_reduce_mean_of_integers_truncates_toward_zero():
    x = np.array([[-7, 3, -3], [5, -4, 1]], np.int32)
    actual = check_against_ort(reduce_model("ReduceMean", [2, 3], I32, axes=[1], keepdims=0), {"x": x})
    np.testing.assert_array_equal(actual[0], np.trunc(x.sum(axis=1) / 3).astype(np.int32))


# Values of reductions over an empty set, from the ONNX spec.
EMPTY_SET = {"ReduceSum": 0, "ReduceMax": -np.inf, "ReduceMin": np.inf, "ReduceProd": 1, "ReduceL1": 0,
             "ReduceL2": 0, "ReduceLogSum": -np.inf, "ReduceLogSumExp": -np.inf, "ReduceSumSquare": 0}


@pytest.mark.parametrize("op", sorted(EMPTY_SET))
def test_reduce_empty_set(op):
    model = reduce_model(op, [2, 0, 4], axes=[1], keepdims=1)
    (y,) = run_egraft(model, {"x": np.zeros((2, 0, 4), np.float32)})
    np.testing.assert_array_equal(y, np.full((2, 1, 4), EMPTY_SET[op], np.float32))
    check_types_against_onnx(model)


@pytest.mark.parametrize("elem_type", [I32, U8, BOOL])
def test_reduce_max_min_empty_set_of_non_floats(elem_type):
    dtype = _np_dtype(elem_type)
    x = np.zeros((3, 0), dtype)
    (mx,) = run_egraft(reduce_model("ReduceMax", [3, 0], elem_type, axes=[1], opset=20, keepdims=0), {"x": x})
    (mn,) = run_egraft(reduce_model("ReduceMin", [3, 0], elem_type, axes=[1], opset=20, keepdims=0), {"x": x})
    lo, hi = (False, True) if dtype == np.bool_ else (np.iinfo(dtype).min, np.iinfo(dtype).max)
    np.testing.assert_array_equal(mx, np.full(3, lo, dtype))
    np.testing.assert_array_equal(mn, np.full(3, hi, dtype))


def test_reduce_max_of_bools_matches_onnxruntime():
    x = rand((4, 5), BOOL)
    check_against_ort(reduce_model("ReduceMax", [4, 5], BOOL, axes=[1], opset=20), {"x": x})


def test_reduce_log_sum_exp_is_stable_for_large_values():
    x = np.array([[1000.0, 1000.0], [-1000.0, -np.inf]], np.float32)
    (y,) = run_egraft(reduce_model("ReduceLogSumExp", [2, 2], axes=[1], keepdims=0), {"x": x})
    np.testing.assert_allclose(y, [1000 + np.log(2), -1000], rtol=1e-6)


@pytest.mark.parametrize("op", REDUCE_OPS)
def test_reduce_symbolic_batch(op):
    model = reduce_model(op, ["batch", 3, 4], axes=[2], keepdims=1)
    assert out_type(model) == "f32[batch, 3, 1]"
    model = reduce_model(op, ["batch", 3, 4], axes=[1], keepdims=0)
    assert out_type(model) == "f32[batch, 4]"
    check_against_ort(model, {"x": _positive_if_log(op, rand((2, 3, 4)))}, rtol=1e-4)


def test_reduce_with_runtime_axes_gives_fresh_dims():
    model = make_model("ReduceSum", [("x", F32, [2, 3]), ("axes", I64, [1])], [("y", F32)], 13, keepdims=0)
    graph = egraft.load(model)
    assert len(graph.outputs[0].type.shape) == 1
    check_against_ort(model, {"x": rand((2, 3)), "axes": np.array([0], np.int64)})


def _shape_reduce_model(op: str, x_shape: list) -> onnx.ModelProto:
    """ConstantOfShape(op(Shape(x))): the output's type shows the symbolic value of op."""
    nodes = [helper.make_node("Shape", ["x"], ["s"]),
             helper.make_node(op, ["s"], ["r"], keepdims=1),
             helper.make_node("ConstantOfShape", ["r"], ["y"])]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", F32, x_shape)],
                              [helper.make_tensor_value_info("y", F32, None)])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])


@pytest.mark.parametrize("op,x_shape,expected", [
    ("ReduceSum", ["batch", 3], "f32[batch + 3]"),
    ("ReduceProd", ["batch", 3, 4], "f32[12*batch]"),
    ("ReduceMax", ["batch", 1], "f32[batch]"),
    ("ReduceMin", ["batch", 1], "f32[1]"),
])
def test_symbolic_reductions_of_shapes(op, x_shape, expected):
    assert get_op(op).symbolic
    model = _shape_reduce_model(op, x_shape)
    assert out_type(model) == expected
    x = np.zeros([2 if d == "batch" else d for d in x_shape], np.float32)
    assert_same(run_egraft(model, {"x": x}), run_ort(model, {"x": x}))


# ---- ArgMax, ArgMin ------------------------------------------------------------------------------
@pytest.mark.parametrize("op", ["ArgMax", "ArgMin"])
@pytest.mark.parametrize("axis,keepdims,last", [(0, 1, 0), (1, 0, 0), (-1, 1, 1), (1, 0, 1)])
def test_arg_max_min(op, axis, keepdims, last):
    x = rand((3, 4, 5), I32, 0, 3)  # many ties
    model = make_model(op, [("x", I32, [3, 4, 5])], [("y", I64)], 13, axis=axis, keepdims=keepdims,
                       select_last_index=last)
    check_against_ort(model, {"x": x})


@pytest.mark.parametrize("op", ["ArgMax", "ArgMin"])
def test_arg_max_min_float16_and_symbolic(op):
    model = make_model(op, [("x", F16, ["batch", 7])], [("y", I64)], 13, axis=1)
    assert out_type(model) == "i64[batch, 1]"
    check_against_ort(model, {"x": rand((3, 7), F16)})


# ---- TopK ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("largest,elem_type", [(1, F32), (0, F32), (1, I32), (0, I64), (1, F16)])
def test_topk_with_ties_keeps_lower_index_first(largest, elem_type):
    x = rand((4, 9), elem_type, 0, 3) if elem_type in (I32, I64) else np.round(rand((4, 9), elem_type))
    model = make_model("TopK", [("x", elem_type, [4, 9]), ("k", I64, [1])], [("v", elem_type), ("i", I64)], 11,
                       {"k": np.array([5], np.int64)}, axis=1, largest=largest)
    v, i = check_against_ort(model, {"x": x})
    order = np.argsort(-x.astype(np.float64) if largest else x, axis=1, kind="stable")[:, :5]
    np.testing.assert_array_equal(i, order)


def test_topk_opset1_attribute_k_and_axis0():
    x = rand((6, 3))
    model = make_model("TopK", [("x", F32, [6, 3])], [("v", F32), ("i", I64)], 1, axis=0, k=2)
    assert out_type(model) == "f32[2, 3]"
    check_against_ort(model, {"x": x})


def test_topk_symbolic_batch_and_runtime_k():
    model = make_model("TopK", [("x", F32, ["batch", 10]), ("k", I64, [1])], [("v", F32), ("i", I64)], 11,
                       {"k": np.array([3], np.int64)})
    assert out_type(model) == "f32[batch, 3]" and out_type(model, 1) == "i64[batch, 3]"
    runtime_k = make_model("TopK", [("x", F32, ["batch", 10]), ("k", I64, [1])], [("v", F32), ("i", I64)], 11)
    check_against_ort(runtime_k, {"x": rand((2, 10)), "k": np.array([4], np.int64)})


# ---- CumSum, CumProd -----------------------------------------------------------------------------
@pytest.mark.parametrize("op", ["CumSum", "CumProd"])
@pytest.mark.parametrize("exclusive,reverse", [(0, 0), (1, 0), (0, 1), (1, 1)])
@pytest.mark.parametrize("elem_type,axis", [(F32, 1), (I32, -1), (F64, 0)])
def test_cumulative(op, exclusive, reverse, elem_type, axis):
    opset = 14 if op == "CumSum" else 26
    x = rand((3, 5), elem_type, 1, 4)
    model = make_model(op, [("x", elem_type, ["batch", 5]), ("axis", I64, [])], [("y", elem_type)], opset,
                       exclusive=exclusive, reverse=reverse)
    assert out_type(model).endswith("[batch, 5]")
    check_against_ort(model, {"x": x, "axis": np.array(axis, np.int64)})


# ---- GatherElements, GatherND --------------------------------------------------------------------
@pytest.mark.parametrize("axis", [0, 1, -1])
def test_gather_elements_with_negative_indices(axis):
    data = rand((4, 5))
    n = data.shape[axis]
    indices = RNG.integers(-n, n, size=(3, 2) if axis == 0 else (2, 3))
    model = make_model("GatherElements", [("d", F32, [4, 5]), ("i", I64, list(indices.shape))], [("y", F32)], 13,
                       axis=axis)
    check_against_ort(model, {"d": data, "i": indices})


@pytest.mark.parametrize("op", ["GatherElements", "ScatterElements"])
@pytest.mark.parametrize("dshape,ishape,axis", [([6], [4], 0), ([3, 4, 5], [2, 6, 3], 1), ([3, 4, 5], [1, 2, 5], -1)])
def test_elements_ops_with_indices_smaller_than_data(op, dshape, ishape, axis):
    inputs = [("d", F32, dshape), ("i", I64, ishape)]
    feeds = {"d": rand(dshape), "i": RNG.integers(-dshape[axis], dshape[axis], size=ishape)}
    attrs = {"axis": axis}
    if op == "ScatterElements":
        inputs.append(("u", F32, ishape))
        feeds["u"] = rand(ishape)
        attrs["reduction"] = "add"
    check_against_ort(make_model(op, inputs, [("y", F32)], 18, **attrs), feeds)


def test_gather_elements_symbolic():
    model = make_model("GatherElements", [("d", F32, ["batch", 5]), ("i", I64, ["batch", 2])], [("y", F32)], 13,
                       axis=1)
    assert out_type(model) == "f32[batch, 2]"


@pytest.mark.parametrize("dshape,ishape,batch_dims", [
    ([2, 3, 4], [5, 2], 0), ([2, 3, 4], [2, 3], 0), ([2, 3, 4], [2, 1], 1), ([2, 3, 4], [2, 6, 2], 1),
    ([2, 3, 4, 2], [2, 3, 1], 2),
])
def test_gather_nd(dshape, ishape, batch_dims):
    data = rand(dshape)
    k = ishape[-1]
    sizes = dshape[batch_dims:batch_dims + k]
    indices = np.stack([RNG.integers(-s, s, size=ishape[:-1]) for s in sizes], axis=-1).astype(np.int64)
    model = make_model("GatherND", [("d", F32, dshape), ("i", I64, ishape)], [("y", F32)], 13,
                       batch_dims=batch_dims)
    check_against_ort(model, {"d": data, "i": indices})


def test_gather_nd_symbolic():
    model = make_model("GatherND", [("d", F32, ["batch", 3, 4]), ("i", I64, ["batch", 7, 1])], [("y", F32)], 13,
                       batch_dims=1)
    assert out_type(model) == "f32[batch, 7, 4]"


# ---- ScatterElements, ScatterND, Scatter -----------------------------------------------------------
@pytest.mark.parametrize("reduction", ["none", "add", "mul", "max", "min"])
@pytest.mark.parametrize("axis", [0, 1])
def test_scatter_elements(reduction, axis):
    data = rand((4, 5))
    ushape = (3, 5) if axis == 0 else (4, 3)
    n = data.shape[axis]
    if reduction == "none":  # distinct targets per line
        perm = np.argsort(RNG.random((n, ushape[1 - axis])), axis=0)[: ushape[axis]]
        indices = perm if axis == 0 else perm.T
        indices = indices - n * (RNG.random(indices.shape) < 0.5)  # some negative
    else:
        indices = RNG.integers(-n, n, size=ushape)
    model = make_model("ScatterElements", [("d", F32, [4, 5]), ("i", I64, list(ushape)), ("u", F32, list(ushape))],
                       [("y", F32)], 18, axis=axis, reduction=reduction)
    check_against_ort(model, {"d": data, "i": indices.astype(np.int64), "u": rand(ushape)})


def test_scatter_deprecated_form():
    data = np.zeros((3, 3), np.float32)
    indices = np.array([[1, 0, 2], [0, 2, 1]], np.int32)
    updates = rand((2, 3))
    model = make_model("Scatter", [("d", F32, [3, 3]), ("i", I32, [2, 3]), ("u", F32, [2, 3])], [("y", F32)], 10)
    (y,) = check_against_ort(model, {"d": data, "i": indices, "u": updates})
    expected = data.copy()
    np.put_along_axis(expected, indices.astype(np.int64), updates, axis=0)
    np.testing.assert_array_equal(y, expected)


@pytest.mark.parametrize("reduction", ["none", "add", "mul", "max", "min"])
@pytest.mark.parametrize("ishape,ushape", [([3, 1], [3, 4, 5]), ([2, 2], [2, 5]), ([2, 2, 3], [2, 2])])
def test_scatter_nd(reduction, ishape, ushape):
    dshape = [4, 4, 5]
    k = ishape[-1]
    count = int(np.prod(ishape[:-1]))
    flat = RNG.choice(int(np.prod(dshape[:k])), size=count, replace=reduction != "none")
    indices = np.stack(np.unravel_index(flat, dshape[:k]), axis=-1).reshape(ishape).astype(np.int64)
    model = make_model("ScatterND", [("d", F32, dshape), ("i", I64, ishape), ("u", F32, ushape)], [("y", F32)], 18,
                       reduction=reduction)
    check_against_ort(model, {"d": rand(dshape), "i": indices, "u": rand(ushape)})


def test_scatter_nd_duplicate_indices_accumulate():
    indices = np.array([[1], [1], [-3]], np.int64)
    model = make_model("ScatterND", [("d", F32, ["n", 2]), ("i", I64, [3, 1]), ("u", F32, [3, 2])], [("y", F32)],
                       18, reduction="add")
    assert out_type(model) == "f32[n, 2]"
    check_against_ort(model, {"d": rand((4, 2)), "i": indices, "u": rand((3, 2))})


# ---- OneHot, Trilu, EyeLike --------------------------------------------------------------------------
@pytest.mark.parametrize("axis", [-1, 0, 1, -2])
def test_onehot(axis):
    indices = RNG.integers(-6, 7, size=(3, 4)).astype(np.int64)  # includes out-of-range values
    model = make_model("OneHot", [("i", I64, [3, 4]), ("depth", I64, []), ("v", F32, [2])], [("y", F32)], 11,
                       {"depth": np.array(5, np.int64)}, axis=axis)
    check_against_ort(model, {"i": indices, "v": np.array([-1.0, 2.5], np.float32)})


def test_onehot_symbolic_and_float_indices():
    model = make_model("OneHot", [("i", F32, ["batch"]), ("depth", F32, [1]), ("v", F32, [2])], [("y", F32)], 11,
                       {"depth": np.array([4.0], np.float32)})
    assert out_type(model) == "f32[batch, 4]"
    check_against_ort(model, {"i": np.array([0, 3, -1, 7, 2], np.float32), "v": np.array([0, 1], np.float32)})


@pytest.mark.parametrize("upper", [0, 1])
@pytest.mark.parametrize("k", [None, -1, 0, 2, -5, 6])
def test_trilu(upper, k):
    inputs = [("x", F32, ["batch", 4, 5])]
    consts = {}
    if k is not None:
        inputs.append(("k", I64, []))
        consts["k"] = np.array(k, np.int64)
    model = make_model("Trilu", inputs, [("y", F32)], 14, consts, upper=upper)
    assert out_type(model) == "f32[batch, 4, 5]"
    check_against_ort(model, {"x": rand((2, 4, 5))})


@pytest.mark.parametrize("k,dtype", [(0, None), (1, TP.INT32), (-2, TP.DOUBLE)])
def test_eyelike(k, dtype):
    attrs = {"k": k} if dtype is None else {"k": k, "dtype": dtype}
    model = make_model("EyeLike", [("x", F32, [3, 5])], [("y", dtype or F32)], 9, **attrs)
    (y,) = check_against_ort(model, {"x": rand((3, 5))})
    np.testing.assert_array_equal(y, np.eye(3, 5, k))


def test_eyelike_symbolic():
    model = make_model("EyeLike", [("x", I64, ["n", "m"])], [("y", TP.FLOAT)], 9, dtype=TP.FLOAT)
    assert out_type(model) == "f32[n, m]"


# ---- ReverseSequence, Det -------------------------------------------------------------------------
@pytest.mark.parametrize("time_axis,batch_axis", [(0, 1), (1, 0)])
def test_reverse_sequence(time_axis, batch_axis):
    shape = [5, 4, 3] if time_axis == 0 else [4, 5, 3]
    lens = np.array([5, 1, 3, 2], np.int64)
    model = make_model("ReverseSequence", [("x", F32, shape), ("l", I64, [4])], [("y", F32)], 10,
                       time_axis=time_axis, batch_axis=batch_axis)
    check_against_ort(model, {"x": rand(shape), "l": lens})


def test_reverse_sequence_symbolic():
    model = make_model("ReverseSequence", [("x", F32, ["time", "batch"]), ("l", I64, ["batch"])], [("y", F32)], 10)
    assert out_type(model) == "f32[time, batch]"


@pytest.mark.parametrize("shape", [[3, 3], [2, 4, 4], [2, 1, 2, 2]])
def test_det(shape):
    model = make_model("Det", [("x", F32, shape)], [("y", F32)], 11)
    check_against_ort(model, {"x": rand(shape)}, rtol=1e-4, atol=1e-5)


def test_det_symbolic():
    model = make_model("Det", [("x", F32, ["batch", 3, 3])], [("y", F32)], 11)
    assert out_type(model) == "f32[batch]"


# ---- NonZero, Compress, Unique, NonMaxSuppression ---------------------------------------------------
def test_nonzero():
    model = make_model("NonZero", [("x", F32, ["batch", 4])], [("y", I64)], 13)
    shape = egraft.load(model).outputs[0].type.shape
    assert shape[0] == 2 and not isinstance(shape[1], int)  # a fresh, data-dependent dim
    x = rand((3, 4)) * (RNG.random((3, 4)) < 0.5)
    check_against_ort(model, {"x": x})


def test_nonzero_of_scalar_has_no_rows():
    """The ONNX spec says (0, N) for a scalar (onnxruntime returns (1, N))."""
    model = make_model("NonZero", [("x", I32, [])], [("y", I64)], 13)
    for value, n in [(3, 1), (0, 0)]:
        (y,) = run_egraft(model, {"x": np.array(value, np.int32)})
        assert y.shape == (0, n) and y.dtype == np.int64


@pytest.mark.parametrize("axis,cond", [(None, [0, 1, 1, 0, 1]), (0, [1, 0, 1]), (1, [1, 0, 1]), (-1, [0, 1])])
def test_compress(axis, cond):
    """Without axis the input is flattened; a condition shorter than the axis selects a prefix."""
    cond = np.array(cond, bool)
    attrs = {} if axis is None else {"axis": axis}
    model = make_model("Compress", [("x", F32, [4, 3]), ("c", BOOL, [len(cond)])], [("y", F32)], 11, **attrs)
    check_against_ort(model, {"x": rand((4, 3)), "c": cond})


def test_compress_types():
    model = make_model("Compress", [("x", F32, ["batch", 3]), ("c", BOOL, [3])], [("y", F32)], 11, axis=1)
    shape = egraft.load(model).outputs[0].type.shape
    assert str(shape[0]) == "batch" and not isinstance(shape[1], int)
    known = make_model("Compress", [("x", F32, ["batch", 3]), ("c", BOOL, [3])], [("y", F32)], 11,
                       {"c": np.array([True, False, True])}, axis=1)
    assert out_type(known) == "f32[batch, 2]"
    check_against_ort(known, {"x": rand((2, 3))})


@pytest.mark.parametrize("sorted_", [0, 1])
@pytest.mark.parametrize("axis", [None, 0, 1, -1])
def test_unique(sorted_, axis):
    x = rand((4, 6), I64, 0, 2)  # repeated rows and columns
    x[2] = x[0]
    x[:, 4] = x[:, 1]
    attrs = {"sorted": sorted_} if axis is None else {"sorted": sorted_, "axis": axis}
    model = make_model("Unique", [("x", I64, [4, 6])], [("y", I64), ("idx", I64), ("inv", I64), ("cnt", I64)], 11,
                       **attrs)
    y, first, inverse, counts = check_against_ort(model, {"x": x})
    ax = 0 if axis is None else axis
    source = x.ravel() if axis is None else x
    np.testing.assert_array_equal(np.take(y, inverse, axis=ax), source)  # inverse reconstructs x
    np.testing.assert_array_equal(np.take(source, first, axis=ax), y)
    if not sorted_:
        assert (np.diff(first) > 0).all()  # first-occurrence order


def test_unique_types_are_symbolic():
    model = make_model("Unique", [("x", F32, ["batch", 3])], [("y", F32), ("idx", I64), ("inv", I64), ("cnt", I64)],
                       11)
    types = [v.type for v in egraft.load(model).outputs]
    u = types[0].shape[0]
    assert not isinstance(u, int) and types[1].shape == (u,) and types[3].shape == (u,)
    assert str(types[2]) == "i64[3*batch]"
    with_axis = make_model("Unique", [("x", F32, ["batch", 3])], [("y", F32), ("idx", I64), ("inv", I64)], 11,
                           axis=0)
    assert str(egraft.load(with_axis).outputs[2].type) == "i64[batch]"


def _random_boxes(n: int, center: bool) -> np.ndarray:
    """Boxes on a small grid so many overlap (and some coordinates are flipped)."""
    a = RNG.integers(0, 6, size=(n, 2)).astype(np.float32)
    size = RNG.integers(1, 4, size=(n, 2)).astype(np.float32)
    if center:
        return np.concatenate([a + size / 2, size], axis=1)
    boxes = np.concatenate([a, a + size], axis=1)
    flip = RNG.random(n) < 0.3
    boxes[flip] = boxes[flip][:, [2, 3, 0, 1]]
    return boxes


@pytest.mark.parametrize("center", [0, 1])
@pytest.mark.parametrize("max_out,iou,score", [(3, 0.3, None), (10, 0.0, 0.4), (2, 0.5, 0.1), (0, 0.5, None)])
def test_non_max_suppression(center, max_out, iou, score):
    batches, classes, n = 2, 3, 12
    boxes = np.stack([_random_boxes(n, bool(center)) for _ in range(batches)])
    scores = np.round(RNG.random((batches, classes, n)), 1).astype(np.float32)  # ties
    inputs = [("b", F32, ["batch", n, 4]), ("s", F32, ["batch", classes, n]), ("m", I64, [1]), ("iou", F32, [1])]
    feeds = {"b": boxes, "s": scores, "m": np.array([max_out], np.int64), "iou": np.array([iou], np.float32)}
    if score is not None:
        inputs.append(("st", F32, [1]))
        feeds["st"] = np.array([score], np.float32)
    model = make_model("NonMaxSuppression", inputs, [("y", I64)], 11, center_point_box=center)
    shape = egraft.load(model).outputs[0].type.shape
    assert shape[1] == 3 and not isinstance(shape[0], int)
    check_against_ort(model, feeds)


def test_non_max_suppression_without_optional_inputs_selects_nothing():
    model = make_model("NonMaxSuppression", [("b", F32, [1, 3, 4]), ("s", F32, [1, 1, 3])], [("y", I64)], 10)
    feeds = {"b": _random_boxes(3, False)[None], "s": rand((1, 1, 3))}
    (y,) = check_against_ort(model, feeds)
    assert y.shape == (0, 3)

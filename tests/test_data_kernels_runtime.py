"""Data-movement ops whose output dims or parameters are known only when the model runs
(issue 15): Range, Expand, ConstantOfShape and Slice with computed starts/ends/steps run as
generated kernels (the runtime binds their data-dependent dims from the input values just
before the kernel runs), and ScatterElements, GatherND, ScatterND and ConvTranspose have
generated code over symbolic dims. Every model is built once and checked against
onnxruntime at several sizes and input values."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

import egraft

I64, F32 = TensorProto.INT64, TensorProto.FLOAT


def _model(nodes, inputs, outputs, inits=(), opset: int = 18) -> onnx.ModelProto:
    graph = helper.make_graph(nodes, "data_kernels", inputs, outputs, list(inits))
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])


def _build(model: onnx.ModelProto, kernel_ops: set[str]):
    """The compiled model, after checking that each op of ``kernel_ops`` runs as generated code."""
    compiled = egraft.compile(model.SerializeToString(), use_cache=False)
    kinds = {}
    for step in compiled.steps:
        kinds.setdefault(step.node.op, set()).add(step.kind)
    for op in kernel_ops:
        assert kinds.get(op) == {"kernel"}, (op, kinds.get(op), compiled.report().fallbacks)
    assert not compiled.report().fallbacks, compiled.report().fallbacks
    return compiled


def _check(model: onnx.ModelProto, compiled, feeds: dict, rtol: float = 1e-6, atol: float = 1e-6) -> None:
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    expected = session.run(None, feeds)
    got = compiled.run(feeds)
    for name, want in zip(compiled.output_names, expected):
        assert got[name].shape == want.shape, (name, got[name].shape, want.shape)
        assert got[name].dtype == want.dtype, (name, got[name].dtype, want.dtype)
        np.testing.assert_allclose(got[name], want, rtol=rtol, atol=atol, err_msg=name)


def _scalar(value, dtype=np.int64) -> np.ndarray:
    return np.array(value, dtype)


# ---- Range -------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def ranges():
    nodes = [
        helper.make_node("Range", ["start", "limit", "delta"], ["r"]),
        helper.make_node("Range", ["fstart", "flimit", "fdelta"], ["f"]),
        helper.make_node("Mul", ["f", "f"], ["f2"]),  # a consumer of the data-dependent length
    ]
    inputs = [helper.make_tensor_value_info(n, I64, []) for n in ("start", "limit", "delta")]
    inputs += [helper.make_tensor_value_info(n, F32, []) for n in ("fstart", "flimit", "fdelta")]
    outputs = [helper.make_tensor_value_info("r", I64, None), helper.make_tensor_value_info("f2", F32, None)]
    model = _model(nodes, inputs, outputs)
    return model, _build(model, {"Range"})


@pytest.mark.parametrize("start, limit, delta, fstart, flimit, fdelta", [
    (0, 7, 1, 0.0, 3.0, 0.5), (5, -4, -3, 1.5, -2.0, -0.25), (3, 3, 2, 0.0, 100.0, 1.0), (-10, 40, 7, 2.0, 1.0, 1.0),
])
def test_range_length_from_its_scalars(ranges, start, limit, delta, fstart, flimit, fdelta):
    model, compiled = ranges
    feeds = {"start": _scalar(start), "limit": _scalar(limit), "delta": _scalar(delta),
             "fstart": _scalar(fstart, np.float32), "flimit": _scalar(flimit, np.float32),
             "fdelta": _scalar(fdelta, np.float32)}
    _check(model, compiled, feeds)


# ---- Expand, ConstantOfShape ------------------------------------------------------------------------
@pytest.fixture(scope="module")
def expands():
    nodes = [
        helper.make_node("Expand", ["x", "shape"], ["y"]),
        helper.make_node("Expand", ["v", "shape2"], ["w"]),
        helper.make_node("ConstantOfShape", ["shape2"], ["c"],
                         value=numpy_helper.from_array(np.array([2.5], np.float32))),
        helper.make_node("ConstantOfShape", ["shape"], ["k"],
                         value=numpy_helper.from_array(np.array([7], np.int64))),
    ]
    inputs = [helper.make_tensor_value_info("x", F32, ["a", 1, "b"]),
              helper.make_tensor_value_info("shape", I64, [3]),
              helper.make_tensor_value_info("v", F32, ["n"]),  # n may be 1 (broadcast) or the target
              helper.make_tensor_value_info("shape2", I64, [2])]
    outputs = [helper.make_tensor_value_info(n, t, None) for n, t in (("y", F32), ("w", F32), ("c", F32), ("k", I64))]
    model = _model(nodes, inputs, outputs)
    return model, _build(model, {"Expand", "ConstantOfShape"})


@pytest.mark.parametrize("a, b, shape, n, shape2", [
    (2, 3, [2, 4, 3], 5, [3, 5]), (1, 5, [6, 1, 5], 1, [4, 6]), (3, 1, [1, 2, 8], 1, [1, 1]),
    (4, 2, [4, 1, 1], 7, [2, 1]),
])
def test_expand_and_constant_of_shape_to_computed_shapes(expands, a, b, shape, n, shape2):
    model, compiled = expands
    rng = np.random.default_rng(a * 10 + b)
    feeds = {"x": rng.normal(0, 1, (a, 1, b)).astype(np.float32), "shape": np.array(shape, np.int64),
             "v": rng.normal(0, 1, (n,)).astype(np.float32), "shape2": np.array(shape2, np.int64)}
    _check(model, compiled, feeds)


# ---- Slice with computed starts, ends and steps --------------------------------------------------------
@pytest.fixture(scope="module")
def slices():
    nodes = [
        helper.make_node("Slice", ["x", "starts", "ends", "axes"], ["y"]),
        helper.make_node("Slice", ["x", "starts", "ends", "axes", "steps"], ["z"]),
        helper.make_node("Relu", ["z"], ["rz"]),
    ]
    inputs = [helper.make_tensor_value_info("x", F32, ["n", "m", 3]),
              helper.make_tensor_value_info("starts", I64, [2]),
              helper.make_tensor_value_info("ends", I64, [2]),
              helper.make_tensor_value_info("steps", I64, [2])]
    inits = [numpy_helper.from_array(np.array([0, 1], np.int64), "axes")]
    outputs = [helper.make_tensor_value_info("y", F32, None), helper.make_tensor_value_info("rz", F32, None)]
    model = _model(nodes, inputs, outputs, inits)
    return model, _build(model, {"Slice"})


@pytest.mark.parametrize("n, m, starts, ends, steps", [
    (5, 7, [1, 2], [4, 6], [1, 2]),
    (5, 7, [-2, -100], [100, -1], [1, 3]),
    (6, 4, [5, -1], [-100, 0], [-2, -1]),  # stepping back, clamped ends
    (3, 9, [2, 8], [0, -100], [-1, -3]),
    (4, 4, [3, 0], [1, 4], [1, 1]),  # empty on axis 0
    (2, 10, [-7, 100], [9, 2], [1, -4]),
])
def test_slice_with_computed_bounds(slices, n, m, starts, ends, steps):
    model, compiled = slices
    x = np.random.default_rng(n * m).normal(0, 1, (n, m, 3)).astype(np.float32)
    feeds = {"x": x, "starts": np.array(starts, np.int64), "ends": np.array(ends, np.int64),
             "steps": np.array(steps, np.int64)}
    _check(model, compiled, feeds)


# ---- ScatterElements, GatherND, ScatterND -----------------------------------------------------------------
@pytest.fixture(scope="module")
def scatters():
    nodes = [helper.make_node("ScatterElements", ["data", "idx", "upd"], [f"se_{r}"], axis=0, reduction=r)
             for r in ("none", "add", "mul", "max", "min")]
    nodes += [
        helper.make_node("ScatterElements", ["data", "idx2", "upd2"], ["se_axis1"], axis=-1, reduction="add"),
        helper.make_node("GatherND", ["data", "gidx"], ["gnd"]),
        helper.make_node("GatherND", ["data", "bidx"], ["gnd_batch"], batch_dims=1),
        helper.make_node("ScatterND", ["data", "sidx", "supd"], ["snd"]),
        helper.make_node("ScatterND", ["data", "sidx", "supd"], ["snd_add"], reduction="add"),
    ]
    inputs = [helper.make_tensor_value_info("data", F32, ["n", 4]),
              helper.make_tensor_value_info("idx", I64, ["e", 4]),
              helper.make_tensor_value_info("upd", F32, ["e", 4]),
              helper.make_tensor_value_info("idx2", I64, ["n", "k"]),
              helper.make_tensor_value_info("upd2", F32, ["n", "k"]),
              helper.make_tensor_value_info("gidx", I64, ["g", 2]),
              helper.make_tensor_value_info("bidx", I64, ["n", "g", 1]),
              helper.make_tensor_value_info("sidx", I64, ["s", 1]),
              helper.make_tensor_value_info("supd", F32, ["s", 4])]
    names = [f"se_{r}" for r in ("none", "add", "mul", "max", "min")] + \
        ["se_axis1", "gnd", "gnd_batch", "snd", "snd_add"]
    model = _model(nodes, inputs, [helper.make_tensor_value_info(n, F32, None) for n in names])
    return model, _build(model, {"ScatterElements", "GatherND", "ScatterND"})


@pytest.mark.parametrize("n, e, k, g, s", [(5, 9, 3, 4, 2), (1, 1, 1, 1, 1), (12, 40, 4, 7, 5), (7, 3, 2, 13, 7)])
def test_scatters_and_gathers_over_symbolic_dims(scatters, n, e, k, g, s):
    model, compiled = scatters
    rng = np.random.default_rng(n * 1000 + e)
    feeds = {"data": rng.normal(0, 1, (n, 4)).astype(np.float32), "idx": rng.integers(-n, n, (e, 4)),
             "upd": rng.normal(0, 1, (e, 4)).astype(np.float32),  # repeated targets: the last update wins
             "idx2": rng.integers(-4, 4, (n, k)), "upd2": rng.normal(0, 1, (n, k)).astype(np.float32),
             "gidx": np.stack([rng.integers(-n, n, g), rng.integers(-4, 4, g)], 1),
             "bidx": rng.integers(-4, 4, (n, g, 1)),
             "sidx": (rng.permutation(n)[:s] - n * rng.integers(0, 2, s))[:, None],  # distinct rows
             "supd": rng.normal(0, 1, (s, 4)).astype(np.float32)}
    _check(model, compiled, feeds, rtol=1e-5, atol=1e-6)


# ---- ConvTranspose -------------------------------------------------------------------------------------
def _conv_transposes() -> onnx.ModelProto:
    """Over x: f32[n, 4, h, w] (every dim symbolic): ppocr's 2x2 stride-2 upsampling with a
    bias, a grouped dilated padded one with output_padding, a SAME_UPPER one and a 1-D one."""
    rng = np.random.default_rng(3)
    weights = {"w1": (4, 3, 2, 2), "b1": (3,), "w2": (4, 3, 3, 2), "w3": (4, 2, 3, 3), "w4": (4, 5, 3)}
    inits = [numpy_helper.from_array(rng.normal(0, 0.5, s).astype(np.float32), n) for n, s in weights.items()]
    nodes = [
        helper.make_node("ConvTranspose", ["x", "w1", "b1"], ["y1"], strides=[2, 2], kernel_shape=[2, 2]),
        helper.make_node("ConvTranspose", ["x", "w2"], ["y2"], group=2, strides=[3, 2], dilations=[2, 1],
                         pads=[1, 0, 2, 1], output_padding=[1, 0]),
        helper.make_node("ConvTranspose", ["x", "w3"], ["y3"], strides=[2, 2], auto_pad="SAME_UPPER"),
        helper.make_node("Reshape", ["x", "flat"], ["x1"]),
        helper.make_node("ConvTranspose", ["x1", "w4"], ["y4"], strides=[3], pads=[1, 0]),
    ]
    inits.append(numpy_helper.from_array(np.array([0, 4, -1], np.int64), "flat"))
    inputs = [helper.make_tensor_value_info("x", F32, ["n", 4, "h", "w"])]
    outputs = [helper.make_tensor_value_info(f"y{k}", F32, None) for k in range(1, 5)]
    return _model(nodes, inputs, outputs, inits, opset=17)


@pytest.fixture(scope="module")
def conv_transposes():
    model = _conv_transposes()
    return model, _build(model, {"ConvTranspose"})


@pytest.mark.parametrize("n, h, w", [(1, 1, 1), (2, 5, 7), (1, 16, 9), (3, 4, 12)])
def test_conv_transpose_over_symbolic_spatial_dims(conv_transposes, n, h, w):
    model, compiled = conv_transposes
    x = np.random.default_rng(n * 100 + h * 10 + w).normal(0, 1, (n, 4, h, w)).astype(np.float32)
    _check(model, compiled, {"x": x}, rtol=1e-5, atol=1e-5)


def test_expand_to_an_incompatible_computed_shape_is_refused_naming_the_node(expands):
    _, compiled = expands
    feeds = {"x": np.zeros((2, 1, 3), np.float32), "shape": np.array([5, 4, 3], np.int64),
             "v": np.zeros(5, np.float32), "shape2": np.array([3, 5], np.int64)}
    message = r"^Expand .*: shapes \[2, 1, 3\], \[5, 4, 3\] do not broadcast"
    with pytest.raises(egraft.errors.ExecutionError, match=message):
        compiled.run(feeds)


def test_slice_length_inferred_from_computed_starts_is_checked_before_the_kernel_runs():
    """``x[:, m - 2:]`` with ``m - 2`` computed from x's shape: inference types it 2 long,
    which holds only when ``m >= 2``; the kernel runs on the checked length, and a call that
    breaks the assumption is refused (the kernel never reads outside x)."""
    inits = [numpy_helper.from_array(np.array([v], np.int64), name)
             for name, v in (("one", 1), ("two", 2), ("big", 2**62))]
    nodes = [helper.make_node("Shape", ["x"], ["s"]), helper.make_node("Slice", ["s", "one", "two"], ["m"]),
             helper.make_node("Sub", ["m", "two"], ["start"]),
             helper.make_node("Slice", ["x", "start", "big", "one"], ["y"])]
    model = _model(nodes, [helper.make_tensor_value_info("x", F32, ["n", "m"])],
                   [helper.make_tensor_value_info("y", F32, None)], inits)
    compiled = egraft.compile(model.SerializeToString(), use_cache=False)
    (step,) = [s for s in compiled.steps if s.node.outputs[0].name == "y"]
    assert step.kind == "kernel" and step.sized_by_inputs, step
    for n, m in ((3, 5), (1, 2), (4, 9)):
        _check(model, compiled, {"x": np.random.default_rng(m).normal(0, 1, (n, m)).astype(np.float32)})
    with pytest.raises(egraft.errors.ExecutionError, match=r"Slice .*output 0 has shape \[3, 1\], expected"):
        compiled.run({"x": np.zeros((3, 1), np.float32)})


@pytest.mark.parametrize("dtype", [np.int64, np.int32, np.float64])
def test_scatter_and_gather_of_other_dtypes(dtype):
    elem = helper.np_dtype_to_tensor_dtype(np.dtype(dtype))
    nodes = [helper.make_node("ScatterElements", ["data", "idx", "upd"], [f"se_{r}"], axis=1, reduction=r)
             for r in ("add", "max", "min")]
    nodes.append(helper.make_node("GatherND", ["data", "gidx"], ["gnd"], batch_dims=1))
    inputs = [helper.make_tensor_value_info("data", elem, ["n", 5]),
              helper.make_tensor_value_info("idx", TensorProto.INT32, ["n", "k"]),
              helper.make_tensor_value_info("upd", elem, ["n", "k"]),
              helper.make_tensor_value_info("gidx", I64, ["n", 1])]
    outputs = [helper.make_tensor_value_info(n, elem, None) for n in ("se_add", "se_max", "se_min", "gnd")]
    model = _model(nodes, inputs, outputs)
    compiled = _build(model, {"ScatterElements", "GatherND"})
    for n, k in ((3, 7), (6, 2)):
        rng = np.random.default_rng(n * k)
        feeds = {"data": (rng.normal(0, 50, (n, 5))).astype(dtype), "idx": rng.integers(-5, 5, (n, k)).astype(np.int32),
                 "upd": (rng.normal(0, 50, (n, k))).astype(dtype), "gidx": rng.integers(-5, 5, (n, 1))}
        _check(model, compiled, feeds)

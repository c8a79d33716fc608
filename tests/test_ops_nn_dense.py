"""Tests of the dense NN ops (egraft/ir/ops/nn_dense.py): one-node models run through
egraft and compared with onnxruntime (or numpy where onnxruntime has no kernel or
disagrees with the spec), inferred types compared with onnx.shape_inference, and
symbolic dims carried through inference.
"""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from conftest import run_onnxruntime
from onnx import helper

import egraft
from egraft.errors import ShapeInferenceError
from egraft.testing.models import (
    backend_input,
    light_model_path,
    reweight,
    scale_relative_error,
    softmax_logits,
    with_outputs,
)

RNG = np.random.default_rng(1234)


# ---- helpers ------------------------------------------------------------------------------
def one_node(op: str, opset: int, inputs: dict, outputs: list[str], **attrs) -> onnx.ModelProto:
    """A one-node model. ``inputs`` maps names to arrays (their dtype and shape declared) or
    to (numpy dtype, shape) pairs whose shape may name symbolic dims."""
    infos = []
    for name, spec in inputs.items():
        dtype, shape = (spec.dtype, spec.shape) if isinstance(spec, np.ndarray) else spec
        infos.append(helper.make_tensor_value_info(name, helper.np_dtype_to_tensor_dtype(np.dtype(dtype)), shape))
    node = helper.make_node(op, [n for n in inputs], outputs, **attrs)
    graph = helper.make_graph([node], op.lower(), infos,
                              [helper.make_empty_tensor_value_info(o) for o in outputs])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])


def run_egraft(model: onnx.ModelProto, feeds: dict) -> list[np.ndarray]:
    graph = egraft.load(model)
    out = graph.run(feeds)
    return [out[v.name] for v in graph.outputs]


def run_ort(model: onnx.ModelProto, feeds: dict) -> list[np.ndarray]:
    out = run_onnxruntime(model, feeds)
    return [out[o.name] for o in model.graph.output]


def onnx_static_types(model: onnx.ModelProto) -> list[tuple[int, tuple] | None]:
    """What onnx.shape_inference infers for each graph output: (elem type, dims) when static."""
    inferred = onnx.shape_inference.infer_shapes(model, strict_mode=False)
    out = []
    for vi in inferred.graph.output:
        tt = vi.type.tensor_type
        if tt.elem_type and tt.HasField("shape") and all(d.HasField("dim_value") for d in tt.shape.dim):
            out.append((tt.elem_type, tuple(d.dim_value for d in tt.shape.dim)))
        else:
            out.append(None)
    return out


def assert_inference_matches_onnx(model: onnx.ModelProto) -> None:
    graph = egraft.load(model)
    for v, want in zip(graph.outputs, onnx_static_types(model)):
        if want is not None:
            assert (v.type.dtype.value, tuple(v.type.shape)) == want, f"{v.name}: {v.type} vs onnx {want}"


def check_vs_ort(op: str, opset: int, feeds: dict, n_out: int = 1, rtol: float = 1e-5, atol: float = 1e-6,
                 **attrs) -> list[np.ndarray]:
    """Run a one-node model in egraft and onnxruntime; the outputs and their types must agree."""
    model = one_node(op, opset, feeds, [f"y{i}" for i in range(n_out)], **attrs)
    feeds = {k: v for k, v in feeds.items() if k}
    ours, ref = run_egraft(model, feeds), run_ort(model, feeds)
    for i, (a, r) in enumerate(zip(ours, ref)):
        assert a.dtype == r.dtype and a.shape == r.shape, f"output {i}: {a.dtype}{a.shape} vs {r.dtype}{r.shape}"
        np.testing.assert_allclose(a.astype(np.float64), r.astype(np.float64), rtol=rtol, atol=atol)
    assert_inference_matches_onnx(model)
    return ours


def output_type(op: str, opset: int, inputs: dict, n_out: int = 1, index: int = 0, **attrs) -> str:
    graph = egraft.load(one_node(op, opset, inputs, [f"y{i}" for i in range(n_out)], **attrs))
    return str(graph.outputs[index].type)


def f32(*shape, low=None, high=None) -> np.ndarray:
    if low is not None:
        return RNG.uniform(low, high, size=shape).astype(np.float32)
    return RNG.normal(size=shape).astype(np.float32)


# ---- MatMul, MatMulInteger ----------------------------------------------------------------
@pytest.mark.parametrize("a_shape,b_shape", [
    ((3, 4), (4, 5)), ((4,), (4, 5)), ((3, 4), (4,)), ((4,), (4,)), ((2, 1, 3, 4), (5, 4, 6)),
    ((3, 4), (2, 4, 5)), ((2, 3, 4), (4,)), ((7,), (2, 7, 3)),
])
def test_matmul_matches_onnxruntime(a_shape, b_shape):
    check_vs_ort("MatMul", 13, {"a": f32(*a_shape), "b": f32(*b_shape)})


@pytest.mark.parametrize("dtype", [np.float64, np.float16, np.int32, np.int64])
def test_matmul_dtypes(dtype):
    a = (RNG.normal(size=(2, 3, 4)) * 3).astype(dtype)
    b = (RNG.normal(size=(4, 5)) * 3).astype(dtype)
    rtol = 2e-3 if dtype == np.float16 else 1e-7
    check_vs_ort("MatMul", 13, {"a": a, "b": b}, rtol=rtol, atol=rtol)


def test_matmul_symbolic_and_bad_inner_dims():
    assert output_type("MatMul", 13, {"a": (np.float32, ["batch", "seq", 64]), "b": (np.float32, [64, 32])}) == \
        "f32[batch, seq, 32]"
    assert output_type("MatMul", 13, {"a": (np.float32, ["batch", 1, "m", 8]), "b": (np.float32, [5, 8, "n"])}) == \
        "f32[batch, 5, m, n]"
    assert output_type("MatMul", 9, {"a": (np.float32, ["k"]), "b": (np.float32, ["batch", "k", 3])}) == \
        "f32[batch, 3]"
    with pytest.raises(ShapeInferenceError, match="inner dims"):
        egraft.load(one_node("MatMul", 13, {"a": (np.float32, [3, 4]), "b": (np.float32, [5, 6])}, ["y"]))


def test_matmul_integer_matches_onnxruntime():
    a = RNG.integers(0, 256, (2, 3, 4)).astype(np.uint8)
    b = RNG.integers(-128, 128, (4, 5)).astype(np.int8)
    check_vs_ort("MatMulInteger", 10, {"a": a, "b": b, "az": np.array(131, np.uint8),
                                       "bz": RNG.integers(-5, 5, (5,)).astype(np.int8)})
    check_vs_ort("MatMulInteger", 10, {"a": a, "b": b.view(np.uint8)})


def test_matmul_integer_per_row_zero_point_and_symbolic():
    a = RNG.integers(0, 256, (3, 4)).astype(np.uint8)
    b = RNG.integers(0, 256, (4, 2)).astype(np.uint8)
    az = RNG.integers(0, 256, (3,)).astype(np.uint8)
    bz = RNG.integers(0, 256, (2,)).astype(np.uint8)
    model = one_node("MatMulInteger", 10, {"a": a, "b": b, "az": az, "bz": bz}, ["y"])
    (y,) = run_egraft(model, {"a": a, "b": b, "az": az, "bz": bz})
    expected = (a.astype(np.int64) - az[:, None].astype(np.int64)) @ (b.astype(np.int64) - bz.astype(np.int64))
    assert y.dtype == np.int32
    np.testing.assert_array_equal(y, expected)
    assert output_type("MatMulInteger", 10, {"a": (np.uint8, ["batch", "seq", 16]), "b": (np.int8, [16, 8])}) == \
        "i32[batch, seq, 8]"


# ---- Gemm -----------------------------------------------------------------------------------
@pytest.mark.parametrize("trans_a,trans_b", [(0, 0), (1, 0), (0, 1), (1, 1)])
@pytest.mark.parametrize("c_shape", [None, (), (5,), (1, 5), (3, 1), (3, 5)])
def test_gemm_matches_onnxruntime(trans_a, trans_b, c_shape):
    a = f32(*((4, 3) if trans_a else (3, 4)))
    b = f32(*((5, 4) if trans_b else (4, 5)))
    feeds = {"a": a, "b": b}
    if c_shape is not None:
        feeds["c"] = f32(*c_shape)
    check_vs_ort("Gemm", 13, feeds, transA=trans_a, transB=trans_b, alpha=0.7, beta=-1.5)


def test_gemm_opset_7_and_9_defaults():
    feeds = {"a": f32(3, 4), "b": f32(4, 5), "c": f32(5)}
    check_vs_ort("Gemm", 7, feeds)
    check_vs_ort("Gemm", 9, feeds, beta=0.0)


def test_gemm_legacy_broadcast_attribute():
    a, b, c = f32(3, 4), f32(5, 4), f32(5)
    model = one_node("Gemm", 6, {"a": a, "b": b, "c": c}, ["y"], transB=1, broadcast=1, alpha=2.0)
    (y,) = run_egraft(model, {"a": a, "b": b, "c": c})
    np.testing.assert_allclose(y, 2.0 * a @ b.T + c, rtol=1e-5, atol=1e-6)
    with pytest.raises(ShapeInferenceError, match="broadcast=0"):
        egraft.load(one_node("Gemm", 6, {"a": a, "b": b, "c": c}, ["y"], transB=1))
    full = f32(3, 5)
    model = one_node("Gemm", 1, {"a": a, "b": b, "c": full}, ["y"], transB=1, beta=0.5)
    (y,) = run_egraft(model, {"a": a, "b": b, "c": full})
    np.testing.assert_allclose(y, a @ b.T + 0.5 * full, rtol=1e-5, atol=1e-6)


def test_gemm_integer_and_symbolic():
    a = RNG.integers(-50, 50, (3, 4)).astype(np.int64)
    b = RNG.integers(-50, 50, (4, 2)).astype(np.int64)
    c = RNG.integers(-50, 50, (2,)).astype(np.int64)
    (y,) = run_egraft(one_node("Gemm", 13, {"a": a, "b": b, "c": c}, ["y"], alpha=3.0, beta=2.0),
                      {"a": a, "b": b, "c": c})
    assert y.dtype == np.int64
    np.testing.assert_array_equal(y, 3 * (a @ b) + 2 * c)
    assert output_type("Gemm", 13, {"a": (np.float32, ["batch", 64]), "w": (np.float32, [10, 64]),
                                    "c": (np.float32, [10])}, transB=1) == "f32[batch, 10]"
    assert output_type("Gemm", 11, {"a": (np.float32, [64, "batch"]), "w": (np.float32, [64, "n"])},
                       transA=1) == "f32[batch, n]"


# ---- Einsum ---------------------------------------------------------------------------------
@pytest.mark.parametrize("equation,shapes", [
    ("ij,jk->ik", [(3, 4), (4, 5)]),
    ("bij,bjk->bik", [(2, 3, 4), (2, 4, 5)]),
    ("...ij,...jk", [(2, 3, 4), (1, 4, 5)]),
    ("...ij,jk->...ik", [(2, 3, 3, 4), (4, 5)]),
    ("ii->i", [(4, 4)]),
    ("ij->", [(3, 4)]),
    ("i,i", [(5,), (5,)]),
    ("bhqd,bhkd->bhqk", [(2, 3, 4, 8), (2, 3, 5, 8)]),
    ("ij,jk,kl->il", [(2, 3), (3, 4), (4, 5)]),
    ("i j , j k -> k i", [(2, 3), (3, 4)]),
])
def test_einsum_matches_onnxruntime(equation, shapes):
    feeds = {f"x{i}": f32(*s) for i, s in enumerate(shapes)}
    check_vs_ort("Einsum", 12, feeds, equation=equation, rtol=1e-5, atol=1e-5)


def test_einsum_implicit_output_sorts_upper_case_first():
    """Implicit mode: the labels seen once, in ASCII order ("A" < "B" < "a"); onnxruntime
    rejects upper-case labels here, so numpy is the reference."""
    feeds = {"a": f32(3, 4, 2), "b": f32(4, 5)}
    model = one_node("Einsum", 12, feeds, ["y"], equation="Bja,jA")
    (y,) = run_egraft(model, feeds)
    np.testing.assert_allclose(y, np.einsum("Bja,jA->ABa", feeds["a"], feeds["b"]), rtol=1e-5, atol=1e-6)
    assert y.shape == (5, 3, 2)
    assert_inference_matches_onnx(model)


def test_einsum_integers_and_symbolic():
    feeds = {"a": RNG.integers(-9, 9, (3, 4)).astype(np.int32), "b": RNG.integers(-9, 9, (4, 2)).astype(np.int32)}
    check_vs_ort("Einsum", 12, feeds, equation="ij,jk->ki")
    qk = {"q": (np.float32, ["batch", 4, "seq", 8]), "k": (np.float32, ["batch", 4, "kv", 8])}
    assert output_type("Einsum", 12, qk, equation="bhqd,bhkd->bhqk") == "f32[batch, 4, seq, kv]"
    assert output_type("Einsum", 12, {"x": (np.float32, ["batch", "seq", 16]), "w": (np.float32, [16, 4])},
                       equation="...d,de") == "f32[batch, seq, 4]"
    with pytest.raises(ShapeInferenceError):
        egraft.load(one_node("Einsum", 12, {"a": (np.float32, [3, 4]), "b": (np.float32, [5, 2])}, ["y"],
                             equation="ij,jk->ik"))


# ---- Softmax, LogSoftmax, Hardmax -------------------------------------------------------------
SOFTMAX_OPS = ["Softmax", "LogSoftmax", "Hardmax"]


@pytest.mark.parametrize("op", SOFTMAX_OPS)
@pytest.mark.parametrize("axis", [0, 1, 2, -1])
def test_softmax_family_opset13_matches_onnxruntime(op, axis):
    check_vs_ort(op, 13, {"x": f32(2, 3, 4, 5)}, axis=axis)


@pytest.mark.parametrize("op", SOFTMAX_OPS)
@pytest.mark.parametrize("opset,axis", [(11, 0), (11, 1), (11, 2), (11, 3), (11, -1), (11, -3), (1, 1), (1, 2)])
def test_softmax_family_legacy_coerces_to_2d(op, opset, axis):
    """Before opset 13 the 4-D input is flattened to 2-D at axis and normalized over all of
    the second part (onnx.reference gets this wrong; onnxruntime follows the spec)."""
    x = f32(2, 3, 4, 5)
    (y,) = check_vs_ort(op, opset, {"x": x}, axis=axis)
    if op == "Softmax":
        a = axis % 4
        flat = x.reshape(int(np.prod(x.shape[:a])), -1).astype(np.float64)
        e = np.exp(flat - flat.max(axis=1, keepdims=True))
        np.testing.assert_allclose(y, (e / e.sum(axis=1, keepdims=True)).reshape(x.shape), rtol=1e-5, atol=1e-7)


def test_softmax_legacy_default_axis_and_symbolic():
    check_vs_ort("Softmax", 11, {"x": f32(2, 3, 4)})
    check_vs_ort("LogSoftmax", 9, {"x": f32(1, 1000, 1, 1)})
    for op in SOFTMAX_OPS:
        for opset in (11, 13):
            assert output_type(op, opset, {"x": (np.float32, ["batch", "seq", 10])}) == "f32[batch, seq, 10]"
    with pytest.raises(ShapeInferenceError):
        egraft.load(one_node("Softmax", 13, {"x": (np.float32, [2, 3])}, ["y"], axis=2))


def test_hardmax_ties_pick_the_first_maximum():
    x = np.array([[1, 3, 3, 0], [2, 2, 2, 2]], np.float32)
    (y,) = check_vs_ort("Hardmax", 13, {"x": x})
    np.testing.assert_array_equal(y, [[0, 1, 0, 0], [1, 0, 0, 0]])


def test_softmax_float16():
    x = (RNG.normal(size=(3, 7)) * 3).astype(np.float16)
    for op in SOFTMAX_OPS:
        check_vs_ort(op, 13, {"x": x}, rtol=2e-3, atol=2e-3)


# ---- BatchNormalization -------------------------------------------------------------------------
def bn_feeds(x: np.ndarray, param_shape: tuple, dtype=np.float32) -> dict:
    return {"x": x, "scale": f32(*param_shape).astype(dtype), "bias": f32(*param_shape).astype(dtype),
            "mean": f32(*param_shape).astype(dtype), "var": f32(*param_shape, low=0.1, high=2.0).astype(dtype)}


def bn_numpy(feeds: dict, eps: float = 1e-5, mean=None, var=None) -> np.ndarray:
    x = feeds["x"].astype(np.float64)
    shape = (-1,) + (1,) * (x.ndim - 2) if feeds["scale"].ndim == 1 else feeds["scale"].shape
    m = (feeds["mean"] if mean is None else mean).reshape(shape)
    v = (feeds["var"] if var is None else var).reshape(shape)
    return (x - m) / np.sqrt(v + eps) * feeds["scale"].reshape(shape) + feeds["bias"].reshape(shape)


@pytest.mark.parametrize("opset", [7, 9, 14])
@pytest.mark.parametrize("shape", [(2, 3, 5, 6), (4, 3), (2, 3, 4, 5, 2)])
def test_batchnorm_inference_matches_onnxruntime(opset, shape):
    feeds = bn_feeds(f32(*shape), (shape[1],))
    (y,) = check_vs_ort("BatchNormalization", opset, feeds, epsilon=1e-3)
    np.testing.assert_allclose(y, bn_numpy(feeds, 1e-3), rtol=1e-5, atol=1e-5)


def test_batchnorm_opset7_per_activation_and_float64():
    feeds = bn_feeds(f32(2, 3, 4, 5), (3, 4, 5))
    check_vs_ort("BatchNormalization", 7, feeds, spatial=0)
    check_vs_ort("BatchNormalization", 9, bn_feeds(f32(2, 3, 4).astype(np.float64), (3,), np.float64))


def test_batchnorm_opset9_training_outputs():
    """With its optional outputs an opset 7-13 node is in training mode: batch statistics
    normalize, running statistics are updated (the saved variance is the batch variance,
    as the spec says; onnxruntime emits an inverse standard deviation there)."""
    feeds = bn_feeds(f32(4, 3, 5, 5), (3,))
    model = one_node("BatchNormalization", 9, feeds, ["y", "rm", "rv", "sm", "sv"], momentum=0.8)
    y, rm, rv, sm, sv = run_egraft(model, feeds)
    for ours, ref in zip([y, rm, rv, sm], run_ort(model, feeds)):
        np.testing.assert_allclose(ours, ref, rtol=1e-4, atol=1e-5)
    x = feeds["x"].astype(np.float64)
    bm, bv = x.mean(axis=(0, 2, 3)), x.var(axis=(0, 2, 3))
    np.testing.assert_allclose(y, bn_numpy(feeds, mean=bm, var=bv), rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(rm, 0.8 * feeds["mean"] + 0.2 * bm, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(rv, 0.8 * feeds["var"] + 0.2 * bv, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(sm, bm, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(sv, bv, rtol=1e-5, atol=1e-6)


def test_batchnorm_opset14_training_mode_matches_onnxruntime():
    feeds = bn_feeds(f32(4, 3, 6), (3,))
    check_vs_ort("BatchNormalization", 14, feeds, n_out=3, training_mode=1, rtol=1e-4, atol=1e-5)


def test_batchnorm_opset15_mixed_types():
    """Opset 15: scale/bias and mean/var may have other float types than X; Y has X's."""
    x = f32(2, 3, 4).astype(np.float16)
    feeds = {"x": x, "scale": f32(3), "bias": f32(3), "mean": f32(3).astype(np.float64),
             "var": f32(3, low=0.5, high=2).astype(np.float64)}
    model = one_node("BatchNormalization", 15, feeds, ["y", "rm", "rv"], training_mode=1)
    y, rm, rv = run_egraft(model, feeds)
    assert (y.dtype, rm.dtype, rv.dtype) == (np.float16, np.float64, np.float64)
    xw = x.astype(np.float64)
    bm, bv = xw.mean(axis=(0, 2)), xw.var(axis=(0, 2))
    np.testing.assert_allclose(y, bn_numpy(feeds, mean=bm, var=bv), rtol=5e-3, atol=5e-3)
    np.testing.assert_allclose(rm, 0.9 * feeds["mean"] + 0.1 * bm, rtol=1e-6, atol=1e-7)  # a mean near 0: no rtol
    assert_inference_matches_onnx(model)


def test_batchnorm_legacy_is_test_and_spatial():
    feeds = bn_feeds(f32(2, 3, 4, 4), (3,))
    model = one_node("BatchNormalization", 6, feeds, ["y"], is_test=1, epsilon=1e-4)
    (y,) = run_egraft(model, feeds)
    np.testing.assert_allclose(y, bn_numpy(feeds, 1e-4), rtol=1e-5, atol=1e-5)
    # is_test=0 (the default) trains: per-channel batch statistics
    (y,) = run_egraft(one_node("BatchNormalization", 6, feeds, ["y"]), feeds)
    x = feeds["x"].astype(np.float64)
    np.testing.assert_allclose(y, bn_numpy(feeds, mean=x.mean(axis=(0, 2, 3)), var=x.var(axis=(0, 2, 3))),
                               rtol=1e-4, atol=1e-5)
    # spatial=0: per-activation parameters and, in training, per-activation statistics
    feeds = bn_feeds(f32(5, 3, 4), (3, 4))
    (y,) = run_egraft(one_node("BatchNormalization", 1, feeds, ["y"], spatial=0, is_test=1,
                               consumed_inputs=[0, 0, 0, 1, 1]), feeds)
    np.testing.assert_allclose(y, bn_numpy(feeds), rtol=1e-5, atol=1e-5)
    (y,) = run_egraft(one_node("BatchNormalization", 6, feeds, ["y"], spatial=0), feeds)
    x = feeds["x"].astype(np.float64)
    np.testing.assert_allclose(y, bn_numpy(feeds, mean=x.mean(axis=0), var=x.var(axis=0)), rtol=1e-4, atol=1e-5)


def test_batchnorm_float16_and_symbolic():
    feeds = bn_feeds(f32(2, 3, 4).astype(np.float16), (3,), np.float16)
    (y,) = run_egraft(one_node("BatchNormalization", 9, feeds, ["y"]), feeds)
    assert y.dtype == np.float16
    np.testing.assert_allclose(y, bn_numpy({k: v.astype(np.float64) for k, v in feeds.items()}),
                               rtol=3e-3, atol=3e-3)
    params = {k: (np.float32, [64]) for k in ("scale", "bias", "mean", "var")}
    assert output_type("BatchNormalization", 9, {"x": (np.float32, ["batch", 64, 56, 56]), **params}) == \
        "f32[batch, 64, 56, 56]"
    assert output_type("BatchNormalization", 14, {"x": (np.float32, ["batch", 64, "h", "w"]), **params},
                       n_out=3, index=1, training_mode=1) == "f32[64]"
    with pytest.raises(ShapeInferenceError, match="channels"):
        egraft.load(one_node("BatchNormalization", 9, {"x": (np.float32, [1, 3, 2, 2]), **params}, ["y"]))


# ---- InstanceNormalization, LayerNormalization, GroupNormalization, RMSNormalization ---------------
@pytest.mark.parametrize("shape", [(2, 3, 5, 4), (3, 4, 7)])
def test_instance_norm_matches_onnxruntime(shape):
    c = shape[1]
    feeds = {"x": f32(*shape) * 3 + 1, "scale": f32(c), "bias": f32(c)}
    check_vs_ort("InstanceNormalization", 6, feeds, epsilon=1e-3, rtol=1e-4, atol=1e-5)
    assert output_type("InstanceNormalization", 22, {"x": (np.float32, ["batch", c, "h"]), "scale": (np.float32, [c]),
                                                     "bias": (np.float32, [c])}) == f"f32[batch, {c}, h]"


@pytest.mark.parametrize("axis", [-1, -2, 1, 0])
@pytest.mark.parametrize("with_bias", [True, False])
def test_layer_norm_matches_onnxruntime(axis, with_bias):
    x = f32(2, 3, 4, 5) * 2 + 0.5
    norm_shape = x.shape[axis:] if axis < 0 else x.shape[axis:]
    feeds = {"x": x, "scale": f32(*norm_shape)}
    if with_bias:
        feeds["bias"] = f32(*norm_shape)
    check_vs_ort("LayerNormalization", 17, feeds, n_out=3, axis=axis, epsilon=1e-3, rtol=1e-4, atol=1e-5)


def test_layer_norm_float16_stash_and_symbolic():
    x = (f32(3, 8) * 2).astype(np.float16)
    feeds = {"x": x, "scale": f32(8).astype(np.float16), "bias": f32(8).astype(np.float16)}
    y, mean, inv_std = check_vs_ort("LayerNormalization", 17, feeds, n_out=3, rtol=2e-3, atol=2e-3)
    assert (y.dtype, mean.dtype, inv_std.dtype) == (np.float16, np.float32, np.float32)
    xs = x.astype(np.float32)
    np.testing.assert_allclose(mean[:, 0], xs.mean(axis=1), rtol=1e-6)
    inputs = {"x": (np.float32, ["batch", "seq", 16]), "scale": (np.float32, [16])}
    assert output_type("LayerNormalization", 17, inputs, n_out=3) == "f32[batch, seq, 16]"
    assert output_type("LayerNormalization", 17, inputs, n_out=3, index=2, axis=1) == "f32[batch, 1, 1]"


@pytest.mark.parametrize("opset,groups", [(18, 2), (18, 4), (21, 2), (21, 4)])
def test_group_norm_matches_onnxruntime(opset, groups):
    x = f32(2, 4, 3, 5) * 2 + 1
    param = 4 if opset >= 21 else groups
    feeds = {"x": x, "scale": f32(param), "bias": f32(param)}
    (y,) = check_vs_ort("GroupNormalization", opset, feeds, num_groups=groups, epsilon=1e-3, rtol=1e-4, atol=1e-5)
    xg = x.reshape(2, groups, -1).astype(np.float64)
    norm = ((xg - xg.mean(axis=2, keepdims=True)) / np.sqrt(xg.var(axis=2, keepdims=True) + 1e-3)).reshape(x.shape)
    reps = 4 // param
    s, b = np.repeat(feeds["scale"], reps), np.repeat(feeds["bias"], reps)
    np.testing.assert_allclose(y, norm * s[:, None, None] + b[:, None, None], rtol=1e-4, atol=1e-5)


def test_group_norm_shapes():
    inputs = {"x": (np.float32, ["batch", 6, "h", "w"]), "scale": (np.float32, [6]), "bias": (np.float32, [6])}
    assert output_type("GroupNormalization", 21, inputs, num_groups=3) == "f32[batch, 6, h, w]"
    with pytest.raises(ShapeInferenceError, match="expected \\[3\\]"):
        egraft.load(one_node("GroupNormalization", 18, inputs, ["y"], num_groups=3))
    with pytest.raises(ShapeInferenceError, match="groups"):
        egraft.load(one_node("GroupNormalization", 21, inputs, ["y"], num_groups=4))


@pytest.mark.parametrize("axis", [-1, -2, 1])
def test_rms_norm_matches_onnxruntime(axis):
    x = f32(2, 3, 4, 5)
    check_vs_ort("RMSNormalization", 23, {"x": x, "scale": f32(*x.shape[axis:])}, axis=axis, rtol=1e-5)


def test_rms_norm_output_has_scale_type_and_symbolic():
    x = f32(3, 8).astype(np.float16)
    scale = f32(8)
    (y,) = run_egraft(one_node("RMSNormalization", 23, {"x": x, "scale": scale}, ["y"]), {"x": x, "scale": scale})
    xs = x.astype(np.float64)
    assert y.dtype == np.float32
    np.testing.assert_allclose(y, xs / np.sqrt((xs**2).mean(axis=1, keepdims=True) + 1e-5) * scale, rtol=1e-5)
    assert output_type("RMSNormalization", 23, {"x": (np.float32, ["batch", "seq", 16]), "scale": (np.float32, [16])}) \
        == "f32[batch, seq, 16]"


# ---- MeanVarianceNormalization, LpNormalization ------------------------------------------------------
@pytest.mark.parametrize("opset,axes", [(9, None), (13, None), (13, [1]), (13, [0, 1, 2, 3]), (13, [-1, -2])])
def test_mvn_matches_onnxruntime(opset, axes):
    """Both engines against the spec's formula in float64, within its float32 error bound: the spec
    computes E[X^2] - E[X]^2, whose rounding error relative to the variance is about
    eps * E[X^2] / Var[X]; over 3 channels of a shifted input a variance can be small, and then
    egraft and onnxruntime differ from each other by 1e-3 (seen in the suite)."""
    attrs = {} if axes is None else {"axes": axes}
    x = f32(2, 3, 4, 5) * 2 + 3
    model = one_node("MeanVarianceNormalization", opset, {"x": x}, ["y"], **attrs)
    reduced = tuple(sorted({a % 4 for a in (attrs.get("axes") or [0, 2, 3])}))
    x64 = x.astype(np.float64)
    mean, mean_sq = x64.mean(axis=reduced, keepdims=True), np.square(x64).mean(axis=reduced, keepdims=True)
    variance = mean_sq - np.square(mean)
    want = (x64 - mean) / (np.sqrt(variance) + 1e-9)
    bound = 1e-5 + np.abs(want) * (1e-5 + 32 * np.finfo(np.float32).eps * mean_sq / variance)
    for engine, (y,) in (("egraft", run_egraft(model, {"x": x})), ("onnxruntime", run_ort(model, {"x": x}))):
        assert y.dtype == np.float32 and y.shape == x.shape, engine
        excess = np.abs(y.astype(np.float64) - want) - bound
        worst = np.unravel_index(excess.argmax(), x.shape)
        assert excess.max() <= 0, f"{engine}: {excess.max()} over the bound at {worst}"
    assert output_type("MeanVarianceNormalization", opset, {"x": (np.float32, ["batch", 3, "h", "w"])}, **attrs) == \
        "f32[batch, 3, h, w]"


@pytest.mark.parametrize("p", [1, 2])
@pytest.mark.parametrize("axis", [-1, 0, 1])
def test_lp_norm_matches_onnxruntime(p, axis):
    x = f32(3, 4, 5)
    x[1] = 0  # a zero slice along every axis choice but 0: its norm is 0 and the output 0
    opset = 22 if axis else 1
    (y,) = check_vs_ort("LpNormalization", opset, {"x": x}, p=p, axis=axis)
    norm = np.linalg.norm(x.astype(np.float64), ord=p, axis=axis, keepdims=True)
    with np.errstate(invalid="ignore", divide="ignore"):
        np.testing.assert_allclose(y, np.where(norm == 0, 0, x / norm), rtol=1e-6, atol=1e-7)


def test_lp_norm_symbolic_and_bad_p():
    assert output_type("LpNormalization", 22, {"x": (np.float32, ["batch", 7])}) == "f32[batch, 7]"
    with pytest.raises(ShapeInferenceError, match="p must be"):
        egraft.load(one_node("LpNormalization", 22, {"x": (np.float32, [2, 3])}, ["y"], p=3))


# ---- Dropout -----------------------------------------------------------------------------------------
@pytest.mark.parametrize("opset", [7, 10, 12, 13, 22])
def test_dropout_inference_is_identity(opset):
    x = f32(3, 4)
    model = one_node("Dropout", opset, {"x": x}, ["y", "mask"])
    y, mask = run_egraft(model, {"x": x})
    ref_y, ref_mask = run_ort(model, {"x": x})
    np.testing.assert_array_equal(y, ref_y)
    np.testing.assert_array_equal(y, x)
    # the mask keeps every element: all True (bool) from opset 10, ones of X's type before.
    # (onnxruntime fills it with zeros before opset 12.)
    assert mask.dtype == ref_mask.dtype == (np.bool_ if opset >= 10 else np.float32)
    assert np.all(mask == 1)
    assert_inference_matches_onnx(one_node("Dropout", opset, {"x": x}, ["y"]))


def test_dropout_legacy_is_test_and_mask_type():
    x = f32(3, 4).astype(np.float64)
    y, mask = run_egraft(one_node("Dropout", 6, {"x": x}, ["y", "mask"], is_test=1, ratio=0.3), {"x": x})
    np.testing.assert_array_equal(y, x)
    assert mask.dtype == np.float64 and np.all(mask == 1)
    # is_test=0 (the default) trains: kept elements are scaled by 1 / (1 - ratio)
    x = f32(200, 50) + 5
    y, mask = run_egraft(one_node("Dropout", 6, {"x": x}, ["y", "mask"], ratio=0.25), {"x": x})
    assert mask.dtype == np.float32 and set(np.unique(mask)) <= {0.0, 1.0}
    np.testing.assert_allclose(y, x * mask / 0.75, rtol=1e-6)
    assert 0.2 < 1 - mask.mean() < 0.3


def test_dropout_training_mode_with_seed():
    x = f32(30, 40)
    feeds = {"x": x, "ratio": np.array(0.4, np.float32), "training_mode": np.array(True)}
    model = one_node("Dropout", 13, feeds, ["y", "mask"], seed=7)
    y, mask = run_egraft(model, feeds)
    expected_mask = np.random.RandomState(7).uniform(0, 1, x.shape) >= 0.4
    np.testing.assert_array_equal(mask, expected_mask)
    np.testing.assert_allclose(y, x * expected_mask / 0.6, rtol=1e-6)
    y2, _ = run_egraft(model, feeds)
    np.testing.assert_array_equal(y, y2)
    # ratio 0 in training mode keeps everything
    feeds["ratio"] = np.array(0.0, np.float32)
    y, mask = run_egraft(model, feeds)
    np.testing.assert_array_equal(y, x)
    assert mask.all()
    # no seed: numpy's RNG, still the training formula
    feeds["ratio"] = np.array(0.5, np.float32)
    y, mask = run_egraft(one_node("Dropout", 12, feeds, ["y", "mask"]), feeds)
    np.testing.assert_allclose(y, x * mask * 2, rtol=1e-6)
    assert 0.4 < mask.mean() < 0.6
    # training_mode false: identity, whatever the ratio
    feeds["training_mode"] = np.array(False)
    y, mask = run_egraft(model, feeds)
    np.testing.assert_array_equal(y, x)
    assert mask.all()


def test_dropout_symbolic():
    assert output_type("Dropout", 13, {"x": (np.float32, ["batch", 128])}, n_out=2, index=1) == "bool[batch, 128]"
    assert output_type("Dropout", 9, {"x": (np.float16, ["batch", 128])}, n_out=2, index=1) == "f16[batch, 128]"


# ---- old-opset CNNs --------------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["squeezenet", "resnet50"])
def test_light_models_match_onnxruntime(name):
    """The opset-9 light models (legacy Softmax, BatchNormalization, Gemm, Dropout with a
    mask) as shipped, and re-weighted with their logits exposed, against onnxruntime."""
    model = onnx.load(light_model_path(name))
    feeds = backend_input(model)
    out = egraft.load(light_model_path(name)).run(feeds)
    ref = run_onnxruntime(model, feeds)
    for key, r in ref.items():
        assert scale_relative_error(out[key], r) <= 1e-3
    reweighted = with_outputs(reweight(model, seed=3), softmax_logits(model))
    out = egraft.load(reweighted).run(feeds)
    ref = run_onnxruntime(reweighted, feeds)
    for key, r in ref.items():
        assert np.std(r) > 0
        assert scale_relative_error(out[key], r) <= 1e-3, key


# ---- Attention --------------------------------------------------------------------------------------
def attention_numpy(q, k, v, scale=None, bias=None):
    """softmax(q k^T * scale + bias) v over 4-D (batch, heads, seq, size) arrays, in float64."""
    q, k, v = (x.astype(np.float64) for x in (q, k, v))
    scale = 1 / np.sqrt(q.shape[-1]) if scale is None else scale
    scores = q @ k.transpose(0, 1, 3, 2) * scale + (0 if bias is None else bias)
    e = np.exp(scores - scores.max(axis=-1, keepdims=True))
    return (e / e.sum(axis=-1, keepdims=True)) @ v


def test_attention_4d_matches_onnxruntime_and_numpy():
    q, k, v = f32(2, 4, 3, 8), f32(2, 4, 5, 8), f32(2, 4, 5, 6)
    (y,) = check_vs_ort("Attention", 23, {"q": q, "k": k, "v": v})
    np.testing.assert_allclose(y, attention_numpy(q, k, v), rtol=1e-5, atol=1e-6)
    check_vs_ort("Attention", 23, {"q": q, "k": k, "v": v}, scale=0.3, softcap=1.5)


def test_attention_gqa_bool_mask_matches_onnxruntime():
    feeds = {"q": f32(2, 6, 3, 8), "k": f32(2, 2, 5, 8), "v": f32(2, 2, 5, 8), "mask": RNG.random((3, 5)) > 0.3}
    feeds["mask"][:, 0] = True
    check_vs_ort("Attention", 23, feeds)


def test_attention_3d_with_cache_and_causal_matches_onnxruntime():
    feeds = {"q": f32(2, 3, 32), "k": f32(2, 3, 16), "v": f32(2, 3, 16), "mask": f32(3, 7),
             "past_key": f32(2, 2, 4, 8), "past_value": f32(2, 2, 4, 8)}
    y, present_key, present_value = check_vs_ort("Attention", 23, feeds, n_out=3, q_num_heads=4, kv_num_heads=2,
                                                 is_causal=1)
    np.testing.assert_array_equal(present_key[:, :, :4], feeds["past_key"])
    np.testing.assert_array_equal(present_key[:, :, 4:], feeds["k"].reshape(2, 3, 2, 8).transpose(0, 2, 1, 3))
    assert y.shape == (2, 3, 32) and present_value.shape == (2, 2, 7, 8)


@pytest.mark.parametrize("mode", [0, 1, 2, 3])
def test_attention_qk_matmul_output_modes(mode):
    """Mode 0 is the raw product, 1 after softcap, 2 with the mask added, 3 after softmax."""
    feeds = {"q": f32(1, 2, 3, 4), "k": f32(1, 2, 5, 4), "v": f32(1, 2, 5, 4), "mask": f32(3, 5)}
    ours = check_vs_ort("Attention", 23, feeds, n_out=4, softcap=2.0, qk_matmul_output_mode=mode)
    raw = feeds["q"].astype(np.float64) @ feeds["k"].transpose(0, 1, 3, 2) / 2
    capped = 2 * np.tanh(raw / 2)
    expected = {0: raw, 1: capped, 2: capped + feeds["mask"]}.get(mode)
    if expected is not None:
        np.testing.assert_allclose(ours[3], expected, rtol=1e-5, atol=1e-6)
    else:
        np.testing.assert_allclose(ours[3].sum(axis=-1), 1, rtol=1e-6)


def test_attention_fully_masked_row_is_zero_and_nonpad_lengths():
    q, k, v = f32(2, 2, 3, 4), f32(2, 2, 5, 4), f32(2, 2, 5, 4)
    mask = np.ones((3, 5), bool)
    mask[1] = False
    feeds = {"q": q, "k": k, "v": v, "mask": mask}
    (y,) = run_egraft(one_node("Attention", 23, feeds, ["y"]), feeds)
    np.testing.assert_array_equal(y[:, :, 1], 0)
    np.testing.assert_allclose(y[:, :, 0], attention_numpy(q, k, v)[:, :, 0], rtol=1e-5, atol=1e-6)
    # opset 24: keys past nonpad_kv_seqlen[b] are padding
    lengths = np.array([2, 5], np.int64)
    feeds = {"q": q, "k": k, "v": v, "lengths": lengths}
    model = one_node("Attention", 24, feeds, ["y"])
    model.graph.node[0].input[:] = ["q", "k", "v", "", "", "", "lengths"]  # no mask, no cache
    (y,) = run_egraft(model, feeds)
    for b, n in enumerate(lengths):
        want = attention_numpy(q[b:b + 1], k[b:b + 1, :, :n], v[b:b + 1, :, :n])
        np.testing.assert_allclose(y[b:b + 1], want, rtol=1e-5, atol=1e-6)


def test_attention_symbolic_shapes():
    inputs = {"q": (np.float32, ["batch", 8, "seq", 64]), "k": (np.float32, ["batch", 2, "seq", 64]),
              "v": (np.float32, ["batch", 2, "seq", 32]), "mask": (np.bool_, ["seq", "total"]),
              "past_key": (np.float32, ["batch", 2, "past", 64]), "past_value": (np.float32, ["batch", 2, "past", 32])}
    graph = egraft.load(one_node("Attention", 23, inputs, ["y", "pk", "pv", "qk"]))
    assert [str(v.type) for v in graph.outputs] == [
        "f32[batch, 8, seq, 32]", "f32[batch, 2, past + seq, 64]", "f32[batch, 2, past + seq, 32]",
        "f32[batch, 8, seq, past + seq]"]
    inputs = {"q": (np.float16, ["batch", "seq", 512]), "k": (np.float16, ["batch", "kv", 128]),
              "v": (np.float16, ["batch", "kv", 128])}
    assert output_type("Attention", 23, inputs, q_num_heads=8, kv_num_heads=2) == "f16[batch, seq, 512]"
    with pytest.raises(ShapeInferenceError, match="heads"):
        egraft.load(one_node("Attention", 23, inputs, ["y"], q_num_heads=8, kv_num_heads=3))

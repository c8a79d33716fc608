"""Generated elementwise kernels (egraft/kernels/cpu/elementwise.py) against onnxruntime:
unary ops, broadcasting binary and variadic ops, Clip, Where, fused Elementwise bodies,
symbolic dims."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from conftest import check_compiled, run_onnxruntime
from onnx import TensorProto, helper, numpy_helper

import egraft
from egraft.kernels.cpu.elementwise import broadcast_strides, collapse
from egraft.lowering.compile import compile_graph

RNG = np.random.default_rng(5)


def _model(op: str, inputs: dict[str, np.ndarray], opset: int = 17, dims: dict | None = None,
           initializers: dict | None = None, out_dtype=TensorProto.FLOAT, **attrs) -> onnx.ModelProto:
    dims = dims or {}
    names = list(inputs) + list(initializers or {})
    node = helper.make_node(op, names, ["y"], **attrs)
    graph_inputs = [helper.make_tensor_value_info(k, helper.np_dtype_to_tensor_dtype(a.dtype),
                                                  dims.get(k, list(a.shape)))
                    for k, a in inputs.items()]
    inits = [numpy_helper.from_array(a, k) for k, a in (initializers or {}).items()]
    return helper.make_model(helper.make_graph([node], "g", graph_inputs,
                                               [helper.make_tensor_value_info("y", out_dtype, None)], inits),
                             opset_imports=[helper.make_opsetid("", opset)])


UNARY = ["Relu", "Neg", "Abs", "Exp", "Sqrt", "Tanh", "Erf", "Sigmoid", "Reciprocal", "Identity", "HardSwish"]


#: onnxruntime's CPU provider has no float64 kernel for these.
NO_ORT_FLOAT64 = {"Erf", "HardSwish"}


@pytest.mark.parametrize("op", UNARY)
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_unary(op, dtype):
    x = RNG.normal(size=(3, 7, 5)).astype(dtype)
    if op in ("Sqrt",):
        x = np.abs(x)
    model = _model(op, {"x": x}, out_dtype=helper.np_dtype_to_tensor_dtype(np.dtype(dtype)))
    if dtype == np.float64 and op in NO_ORT_FLOAT64:
        import math

        reference = {"Erf": np.vectorize(math.erf), "HardSwish": lambda v: v * np.clip(v / 6 + 0.5, 0, 1)}[op]
        got = compile_graph(egraft.load(model)).run({"x": x})["y"]
        assert got.dtype == np.float64
        np.testing.assert_allclose(got, reference(x), rtol=1e-12, atol=1e-15)
        return
    check_compiled(model, {"x": x}, rtol=2e-6 if dtype == np.float32 else 1e-12, atol=1e-7)


@pytest.mark.parametrize("op", ["Exp", "Tanh", "Erf", "Sigmoid"])
def test_float32_transcendentals_are_arithmetic_and_accurate_over_their_whole_range(op):
    """float32 exp/tanh/erf/sigmoid are polynomials (no libm call per lane, so the loop
    vectorizes), within a few ulp (tanh, erf, sigmoid: 1.5e-7 absolute) of float64 from
    underflow to overflow, NaN and the infinities kept; tanh and sigmoid are onnxruntime's
    bit for bit."""
    import math

    wide = np.linspace(-110.0, 95.0, 40_001)
    specials = [0.0, -0.0, 1e-30, -1e-30, 3e-4, -3e-4, 88.7, 88.73, -87.4, -103.9, -104.5, np.inf, -np.inf, np.nan]
    x = np.concatenate([wide, RNG.normal(size=2000) * 3, specials]).astype(np.float32)
    compiled = compile_graph(egraft.load(_model(op, {"x": x})))
    assert compiled.steps[0].kind == "kernel"
    text = compiled.module_text
    assert not any(f"@{name}f(" in text for name in ("exp", "tanh", "erf")) and "@llvm.exp." not in text
    with np.errstate(over="ignore", under="ignore"):
        got = compiled.run({"x": x})["y"].astype(np.float64)
        x64 = x.astype(np.float64)
        reference = {"Exp": np.exp, "Tanh": np.tanh, "Erf": np.vectorize(math.erf),
                     "Sigmoid": lambda v: 1 / (1 + np.exp(-v))}[op](x64)
    nan = np.isnan(x)
    assert np.isnan(got[nan]).all() and not np.isnan(got[~nan]).any()
    if op in ("Tanh", "Sigmoid"):  # onnxruntime's MLAS forms, to the bit
        np.testing.assert_array_equal(got.astype(np.float32), run_onnxruntime(_model(op, {"x": x}), {"x": x})["y"])
    if op == "Sigmoid":
        np.testing.assert_allclose(got[~nan], reference[~nan], rtol=0, atol=1.5e-7)
        assert np.all((got[~nan] >= 0) & (got[~nan] <= 1))
    elif op == "Exp":  # relative, where float32 holds the value as a normal number
        normal = (reference > 1.2e-38) & (reference < 3.4e38)
        assert np.max(np.abs(got - reference)[normal] / reference[normal]) < 3e-7
        assert (got[reference >= 3.5e38] == np.inf).all() and (got[reference < 1e-46] == 0).all()
    else:
        np.testing.assert_allclose(got[~nan], reference[~nan], rtol=1e-6, atol=6e-7)
        assert np.all(np.abs(got[~nan]) <= (1 if op == "Erf" else 1 + 2.4e-7))  # tanh: MLAS's, up to 1 + 2 ulp


def test_unary_with_attributes_and_nan():
    x = RNG.normal(size=(4, 9)).astype(np.float32)
    x[0, 0] = np.nan
    check_compiled(_model("LeakyRelu", {"x": x}, alpha=0.3), {"x": x})
    check_compiled(_model("HardSigmoid", {"x": x}, alpha=0.25, beta=0.4), {"x": x})
    check_compiled(_model("Relu", {"x": x}), {"x": x})  # NaN stays NaN, as in onnxruntime


@pytest.mark.parametrize("op", ["Add", "Sub", "Mul", "Div", "Pow", "Max", "Min"])
@pytest.mark.parametrize(("a_shape", "b_shape"), [((2, 3, 4), (2, 3, 4)), ((2, 3, 4), (4,)), ((2, 3, 4), (3, 1)),
                                                  ((1, 3, 1), (2, 1, 4)), ((5,), ())])
def test_binary_broadcasting(op, a_shape, b_shape):
    a = RNG.uniform(0.5, 2.0, size=a_shape).astype(np.float32)
    b = RNG.uniform(0.5, 2.0, size=b_shape).astype(np.float32)
    check_compiled(_model(op, {"a": a, "b": b}), {"a": a, "b": b}, rtol=3e-6)


@pytest.mark.parametrize("op", ["Add", "Sub", "Mul"])
def test_integer_binary(op):
    a = RNG.integers(-100, 100, size=(3, 4)).astype(np.int64)
    b = RNG.integers(-100, 100, size=(4,)).astype(np.int64)
    check_compiled(_model(op, {"a": a, "b": b}, out_dtype=TensorProto.INT64), {"a": a, "b": b}, rtol=0, atol=0)


@pytest.mark.parametrize("op", ["Sum", "Max", "Min", "Mean"])
def test_variadic(op):
    xs = {f"x{k}": RNG.normal(size=s).astype(np.float32) for k, s in enumerate([(2, 3), (3,), (2, 1)])}
    check_compiled(_model(op, xs), xs)


def test_clip_where_and_a_constant_operand():
    x = RNG.normal(size=(3, 8)).astype(np.float32)
    check_compiled(_model("Clip", {"x": x}, initializers={"lo": np.array(-0.5, np.float32),
                                                           "hi": np.array(0.7, np.float32)}), {"x": x})
    c = RNG.random((3, 1)) > 0.5
    a, b = RNG.normal(size=(3, 8)).astype(np.float32), RNG.normal(size=(8,)).astype(np.float32)
    check_compiled(_model("Where", {"c": c, "a": a, "b": b}), {"c": c, "a": a, "b": b}, rtol=0, atol=0)
    w = RNG.normal(size=(8,)).astype(np.float32)
    check_compiled(_model("Mul", {"x": x}, initializers={"w": w}), {"x": x})


def test_fused_elementwise_body_is_one_kernel():
    from egraft.ir.graph import Graph, Node, Value
    from egraft.ir.types import DType, TensorType

    t = TensorType(DType.FLOAT32, (4, 6))
    xs = [Value(f"x{k}", t) for k in range(3)]
    y = Value("y", t)
    expr = "sigmoid(sub(relu(add(mul(x0, x1), x2)), tanh(x0)))"
    graph = Graph("g", xs, [y], [Node("Elementwise", tuple(xs), (y,), {"expr": expr}, domain="com.egraft")],
                  opsets={"": 17, "com.egraft": 1})
    compiled = compile_graph(graph)
    assert [s.kind for s in compiled.steps] == ["kernel"]
    feeds = {f"x{k}": RNG.normal(size=(4, 6)).astype(np.float32) for k in range(3)}
    x0, x1, x2 = feeds["x0"], feeds["x1"], feeds["x2"]
    want = 1 / (1 + np.exp(-(np.maximum(x0 * x1 + x2, 0) - np.tanh(x0))))
    np.testing.assert_allclose(compiled.run(feeds)["y"], want, rtol=2e-6)


def test_one_compiled_kernel_serves_every_batch_and_refuses_a_wrong_shape():
    b = RNG.normal(size=(4, 1)).astype(np.float32)
    model = _model("Add", {"x": np.zeros((1, 4, 5), np.float32)}, dims={"x": ["batch", 4, 5]},
                   initializers={"b": b})
    compiled = compile_graph(egraft.load(model))
    for batch in (1, 3, 8):
        x = RNG.normal(size=(batch, 4, 5)).astype(np.float32)
        np.testing.assert_allclose(compiled.run({"x": x})["y"], x + b, rtol=1e-6)
    with pytest.raises(egraft.EgraftError, match=r"input 'x' has shape \[2, 5, 4\], expected \[batch, 4, 5\]"):
        compiled.run({"x": np.zeros((2, 5, 4), np.float32)})
    with pytest.raises(egraft.EgraftError, match="input 'x' has dtype float64, expected float32"):
        compiled.run({"x": np.zeros((2, 4, 5))})


def test_broadcast_strides_and_collapse():
    assert broadcast_strides((3, 1), (2, 3, 4)) == [0, 1, 0]
    assert broadcast_strides((2, 3, 4), (2, 3, 4)) == [12, 4, 1]
    sizes, strides = collapse((2, 3, 4), [[12, 4, 1], [12, 4, 1]])
    assert sizes == [24] and strides == [[1], [1]]
    sizes, strides = collapse((8, 64, 56, 56), [[200704, 3136, 56, 1], [0, 1, 0, 0]])
    assert sizes == [8, 64, 3136] and strides == [[200704, 3136, 1], [0, 1, 0]]


@pytest.mark.parametrize("dtype", [np.int64, np.int32, np.uint8])
def test_integer_division_truncates_and_survives_zero(dtype):
    info = np.iinfo(dtype)
    a = RNG.integers(max(info.min, -100), min(info.max, 100), size=(6, 7)).astype(dtype)
    b = RNG.integers(max(info.min, -9), 10, size=(7,)).astype(dtype)
    b[b == 0] = 3
    check_compiled(_model("Div", {"a": a, "b": b}, out_dtype=helper.np_dtype_to_tensor_dtype(np.dtype(dtype))),
                   {"a": a, "b": b}, rtol=0, atol=0)
    # Division by zero: egraft's reference gives 0 (onnxruntime's is undefined), and no trap.
    zero = np.zeros(7, dtype)
    got = compile_graph(egraft.load(_model("Div", {"a": a, "b": zero},
                                           out_dtype=helper.np_dtype_to_tensor_dtype(np.dtype(dtype))))).run(
        {"a": a, "b": zero})["y"]
    np.testing.assert_array_equal(got, np.zeros_like(a))


@pytest.mark.parametrize("fmod", [0, 1])
@pytest.mark.parametrize("dtype", [np.int64, np.int32, np.float32])
def test_mod(fmod, dtype):
    if dtype == np.float32 and not fmod:
        pytest.skip("Mod with fmod=0 is defined for integers only")
    a = (RNG.integers(-50, 50, size=(5, 6)) + (0.25 if dtype == np.float32 else 0)).astype(dtype)
    b = RNG.integers(1, 9, size=(6,)).astype(dtype) * np.where(RNG.random(6) < 0.5, -1, 1).astype(dtype)
    check_compiled(_model("Mod", {"a": a, "b": b}, fmod=fmod,
                          out_dtype=helper.np_dtype_to_tensor_dtype(np.dtype(dtype))), {"a": a, "b": b},
                   rtol=0, atol=1e-6)


def test_a_view_op_that_is_a_graph_output_is_copied_by_a_kernel():
    x = RNG.normal(size=(2, 3, 4)).astype(np.float32)
    model = _model("Reshape", {"x": x}, initializers={"s": np.array([4, -1], np.int64)})
    compiled = compile_graph(egraft.load(model))
    assert [s.kind for s in compiled.steps] == ["kernel"]
    check_compiled(model, {"x": x}, rtol=0, atol=0)


@pytest.mark.parametrize("exponent_shape", [(), (1,)])
def test_pow_of_a_constant_two_is_the_exact_square(exponent_shape):
    """``Pow(x, 2)`` with a constant one-element exponent runs as ``x * x`` (no libm call per
    element): bit for bit numpy's square and onnxruntime's Pow, NaN, infinities and -0 included."""
    x = np.random.default_rng(5).normal(size=(3, 70)).astype(np.float32) * 40
    x.reshape(-1)[:4] = [np.nan, np.inf, -np.inf, -0.0]
    graph = helper.make_graph(
        [helper.make_node("Pow", ["x", "e"], ["y"])], "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [3, 70])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
        [numpy_helper.from_array(np.full(exponent_shape, 2.0, np.float32), "e")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    compiled = compile_graph(egraft.load(model))
    assert [s.kind for s in compiled.steps] == ["kernel"]
    got = compiled.run({"x": x})["y"]
    np.testing.assert_array_equal(got, x * x)
    np.testing.assert_array_equal(got, run_onnxruntime(model, {"x": x})["y"])
    assert np.signbit(got.reshape(-1)[3]) == np.signbit(np.float32(-0.0) * np.float32(-0.0))

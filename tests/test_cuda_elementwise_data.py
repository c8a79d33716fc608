"""The CUDA kernels of elementwise ops and data movement (egraft/kernels/cuda/elementwise.py,
data.py): each case is a one-node ONNX model whose kernel must compile with NVRTC for
sm_90 without spilling, and whose numbers, run by the CPU emulator, must match the
registry's numpy semantics (``run_graph``) and, for standard ops, onnxruntime: exactly for
integers and bools, to 1e-6 relative for arithmetic, 1e-5 for transcendental functions.

The emulator compiles each translation unit with g++ in more than a second; a hundred
cases one by one would take minutes. So the cases that share dim bindings run as one
*batch*: their kernels are renamed apart (every function, helper and operand gets a
``_k<j>`` suffix) into one translation unit whose functions all take every operand, and one
emulator run launches them all. Each case is still checked on its own, and the per-case
kernel (unrenamed) is what NVRTC compiles; a batch that fails falls back to running its
cases one by one, so a failure names its case.
"""

from __future__ import annotations

import cuda_cases
import numpy as np
import pytest
from cuda_cases import (
    HAVE_GXX,
    Case,
    Const,
    In,
    compare,
    emulate_cases,
    feeds_of,
    kernel_of,
    run_batch,
    run_onnxruntime,
)
from onnx import helper, numpy_helper

from egraft.ir.interpreter import run_graph
from egraft.kernels.cuda.emit import Unsupported

pytestmark = pytest.mark.skipif(not HAVE_GXX, reason="the CUDA emulator needs g++")
HAS_NVRTC = cuda_cases.HAVE_NVRTC
if HAS_NVRTC:
    from egraft.kernels.cuda.nvrtc import compile_source

RNG = np.random.default_rng(7)
TRANSCENDENTAL = 1e-5
ARITHMETIC = 1e-6


def case(*args, ir_version: int = 8, **kwargs) -> Case:
    """A case (:func:`cuda_cases.case`) at IR version 8, which onnxruntime reads for every opset here."""
    return cuda_cases.case(*args, ir_version=ir_version, **kwargs)


# ---- the cases --------------------------------------------------------------------------------------------
F32, I64, I32, BOOL = np.float32, np.int64, np.int32, np.bool_
SYMBOLIC = [{"batch": 2, "seq": 3}, {"batch": 1, "seq": 5}]
FRESH = {"_d0": 3, "_d1": 4}
#: Values with negatives, zeros (both signs), halves and large magnitudes.
SPECIAL = np.array([-7.5, -2.5, -1.0, -0.5, -0.0, 0.0, 0.25, 0.5, 1.0, 1.5, 2.5, 3.0, 9.0, -30.0, 30.0], np.float32)


def _unary_values(shape, rng):
    x = (rng.standard_normal(shape) * 3).astype(np.float32)
    flat = x.reshape(-1)
    flat[:len(SPECIAL)] = SPECIAL
    return x


def _cases() -> list[Case]:
    cases = []
    add = cases.append
    # -- broadcasting
    add(case("add_2x3x4_4", "Add", [In("a", [2, 3, 4]), In("b", [4])]))
    add(case("mul_2x1x4_3x1", "Mul", [In("a", [2, 1, 4]), In("b", [3, 1])]))
    add(case("sub_scalar", "Sub", [In("a", [5, 7]), In("b", [])]))
    add(case("add_symbolic", "Add", [In("a", ["batch", "seq", 8]), In("b", [8])], bindings=SYMBOLIC))
    add(case("mul_symbolic_same_shape", "Mul", [In("a", ["batch", "seq", 300]), In("b", ["batch", "seq", 300])],
             bindings=SYMBOLIC))
    add(case("div_vector_tail", "Div", [In("a", [2, 601]),
                                        In("b", [2, 601], values=lambda s, r: r.uniform(0.5, 3, s))]))
    add(case("add_rows_vector", "Add", [In("a", [4, 2, 256]), In("b", [256])]))
    add(case("mul_column_vector", "Mul", [In("a", [4, 64, 8]), In("b", [4, 64, 1])]))
    add(case("add_i64", "Add", [In("a", [3, 4], I64), In("b", [4], I64)]))
    add(case("div_i64_truncates", "Div", [In("a", [4, 5], I64), In("b", [5], I64, values=np.array([3, -3, 7, -2, 1]))]))
    add(case("div_i32_truncates", "Div", [In("a", [6], I32, values=np.array([-7, 7, -8, 8, -1, 0])),
                                          In("b", [], I32, values=np.array(3))]))
    add(case("pow", "Pow", [In("a", [3, 5], values=lambda s, r: r.uniform(0.1, 3, s)), In("b", [5])],
             rtol=TRANSCENDENTAL))
    add(case("pow_square", "Pow", [In("a", [3, 5]), Const("b", np.array(2.0, np.float32))]))
    add(case("pow_i64", "Pow", [In("a", [6], I64, values=np.array([-3, -2, 0, 1, 2, 5])),
                                In("b", [6], I64, values=np.array([3, 2, 4, 7, 10, 3]))]))
    add(case("max_3_nan", "Max", [In("a", [2, 3], values=np.array([[1, np.nan, -2], [0, 5, -1]])),
                                  In("b", [3]), In("c", [2, 1])], onnxruntime=False))
    add(case("min_3", "Min", [In("a", [2, 3]), In("b", [3]), In("c", [2, 1])]))
    add(case("min_i64", "Min", [In("a", [2, 3], I64), In("b", [3], I64)]))
    add(case("sum_3", "Sum", [In("a", [2, 3]), In("b", [3]), In("c", [])]))
    add(case("mean_3", "Mean", [In("a", [4, 3]), In("b", [4, 3]), In("c", [3])]))
    add(case("mod_i64", "Mod", [In("a", [8], I64, values=np.array([-7, 7, -8, 8, 5, -5, 0, 3])),
                                In("b", [8], I64, values=np.array([3, -3, 3, -3, 5, 2, 4, -2]))]))
    add(case("fmod_f32", "Mod", [In("a", [8], values=np.array([-7.5, 7.5, -8, 8, 5, -5, 0, 3.25])),
                                 In("b", [8], values=np.array([3, -3, 3, -3, 5, 2, 4, -2]))], attrs={"fmod": 1}))
    add(case("prelu", "PRelu", [In("a", [2, 3, 4]), In("slope", [3, 1])]))
    # -- unary ops, on [2, 601] (the vector loop and a tail of 2)
    for op, rtol in [("Relu", 0), ("Neg", 0), ("Abs", 0), ("Sign", 0), ("Floor", 0), ("Ceil", 0), ("Round", 0),
                     ("Reciprocal", ARITHMETIC), ("Sqrt", ARITHMETIC), ("Exp", TRANSCENDENTAL),
                     ("Log", TRANSCENDENTAL), ("Tanh", TRANSCENDENTAL), ("Erf", TRANSCENDENTAL),
                     ("Sigmoid", TRANSCENDENTAL), ("Sin", TRANSCENDENTAL), ("Cos", TRANSCENDENTAL),
                     ("Softsign", ARITHMETIC), ("Softplus", TRANSCENDENTAL), ("HardSwish", ARITHMETIC)]:
        add(case(op.lower(), op, [In("x", [2, 601], values=_unary_values)], rtol=rtol))
    for op, attrs in [("LeakyRelu", {"alpha": 0.07}), ("HardSigmoid", {"alpha": 0.3, "beta": 0.4}),
                      ("Elu", {"alpha": 0.8}), ("Selu", {}), ("ThresholdedRelu", {"alpha": 0.5})]:
        add(case(op.lower(), op, [In("x", [3, 37], values=_unary_values)], attrs=attrs, rtol=TRANSCENDENTAL))
    add(case("gelu_erf", "Gelu", [In("x", [3, 37], values=_unary_values)], domain="com.egraft", rtol=TRANSCENDENTAL))
    add(case("gelu_tanh", "Gelu", [In("x", [3, 37], values=_unary_values)], attrs={"approximate": "tanh"},
             domain="com.egraft", rtol=TRANSCENDENTAL))
    add(case("gelu_opset20", "Gelu", [In("x", [3, 37], values=_unary_values)], opset=20, rtol=TRANSCENDENTAL,
             onnxruntime=False))
    add(case("relu_i64", "Relu", [In("x", [9], I64)], onnxruntime=False))
    add(case("abs_neg_i32", "Abs", [In("x", [9], I32)]))
    add(case("exp_f64", "Exp", [In("x", [9], np.float64)], rtol=1e-12))
    nan_values = np.array([1.0, np.nan, -np.inf, np.inf, 0.0, -3.0], np.float32)
    add(case("isnan", "IsNaN", [In("x", [6], values=nan_values)]))
    add(case("isinf_positive", "IsInf", [In("x", [6], values=nan_values)], attrs={"detect_negative": 0}))
    add(case("not", "Not", [In("x", [3, 5], BOOL)]))
    # -- Clip: constant inputs, attributes (opset 6), an input bound
    add(case("clip_constants", "Clip", [In("x", [4, 9], values=_unary_values), Const("lo", np.array(-1.0, F32)),
                                        Const("hi", np.array(2.0, F32))]))
    add(case("clip_max_only", "Clip", [In("x", [4, 9], values=_unary_values), "",
                                       Const("hi", np.array(0.5, np.float32))]))
    add(case("clip_attrs_opset6", "Clip", [In("x", [4, 9], values=_unary_values)], attrs={"min": -0.5, "max": 1.5},
             opset=6))
    add(case("clip_input_bound", "Clip", [In("x", [4, 9], values=_unary_values), In("lo", [])]))
    add(case("clip_i64", "Clip", [In("x", [9], I64), Const("lo", np.array(-3, np.int64)),
                                  Const("hi", np.array(4, np.int64))]))
    # -- comparisons, logic, Where
    for op in ("Equal", "Less", "Greater", "LessOrEqual", "GreaterOrEqual"):
        values = lambda s, r: r.integers(-2, 3, s).astype(np.float32)  # noqa: E731  (ties)
        add(case(op.lower(), op, [In("a", [3, 4], values=values), In("b", [4], values=values)]))
    add(case("equal_i64", "Equal", [In("a", [3, 4], I64, values=lambda s, r: r.integers(-2, 3, s)),
                                    In("b", [4], I64, values=lambda s, r: r.integers(-2, 3, s))]))
    for op in ("And", "Or", "Xor"):
        add(case(op.lower(), op, [In("a", [3, 4], BOOL), In("b", [3, 1], BOOL)]))
    add(case("where", "Where", [In("c", [3, 1], BOOL), In("a", [3, 4]), In("b", [4])]))
    add(case("where_symbolic", "Where", [In("c", ["batch", "seq", 1], BOOL), In("a", ["batch", "seq", 8]),
                                         In("b", [])], bindings=SYMBOLIC))
    add(case("where_i64", "Where", [In("c", [5], BOOL), In("a", [5], I64), In("b", [], I64)]))
    # -- Cast matrix
    dtypes = [np.float32, np.float64, np.int64, np.int32, np.int8, np.uint8, np.bool_]
    for src in dtypes:
        for dst in dtypes:
            if src is dst:
                continue
            values = np.array([-3.7, -1.5, -0.0, 0.0, 0.4, 1.9, 7.5, 100.9, 127.0, -128.0])
            if np.dtype(dst).kind == "u" or np.dtype(src).kind == "u":
                values = np.abs(values)
            add(case(f"cast_{np.dtype(src).name}_{np.dtype(dst).name}", "Cast",
                     [In("x", [10], src, values=values.astype(src) if src is not np.bool_ else values != 0)],
                     attrs={"to": helper.np_dtype_to_tensor_dtype(np.dtype(dst))}, onnxruntime=False))
    # -- com.egraft::Elementwise
    add(case("expr_relu_fma", "Elementwise", [In("x0", [2, 3, 4]), In("x1", [4]), In("x2", [3, 1])],
             attrs={"expr": "relu(add(mul(x0, x1), x2))"}, domain="com.egraft"))
    add(case("expr_scale", "Elementwise", [In("x0", [2, 601])], attrs={"expr": "mul(x0, 0.5)"}, domain="com.egraft"))
    add(case("expr_all_functions", "Elementwise", [In("x0", ["batch", "seq", 6], values=_unary_values),
                                                   In("x1", [6], values=lambda s, r: r.uniform(0.5, 2, s))],
             attrs={"expr": "max(min(sub(div(tanh(x0), x1), sigmoid(neg(x0))), exp(abs(x0))), "
                            "add(erf(sqrt(x1)), mul(log(x1), pow(x1, -1.5))))"},
             domain="com.egraft", rtol=TRANSCENDENTAL, bindings=SYMBOLIC))
    # -- data movement
    for axis, shapes in [(0, ([2, 3, 4], [1, 3, 4], [3, 3, 4])), (1, ([2, 1, 4], [2, 3, 4], [2, 2, 4])),
                         (-1, ([2, 3, 5], [2, 3, 1], [2, 3, 2]))]:
        add(case(f"concat_axis{axis}", "Concat", [In(f"x{k}", s) for k, s in enumerate(shapes)], attrs={"axis": axis}))
    add(case("concat_symbolic", "Concat", [In("a", ["batch", "seq", 4]), In("b", ["batch", 2, 4]),
                                           In("c", ["batch", "seq", 4])], attrs={"axis": 1}, bindings=SYMBOLIC))
    add(case("concat_i64", "Concat", [In("a", [2], I64), In("b", [1], I64), In("c", [3], I64)], attrs={"axis": 0}))
    add(case("transpose_10_tiled", "Transpose", [In("x", [40, 33])], attrs={"perm": [1, 0]}))
    add(case("transpose_0213", "Transpose", [In("x", [2, 3, 4, 5])], attrs={"perm": [0, 2, 1, 3]}))
    add(case("transpose_3120", "Transpose", [In("x", [2, 3, 4, 5])], attrs={"perm": [3, 1, 2, 0]}))
    add(case("transpose_3120_tiled", "Transpose", [In("x", [17, 2, 3, 20])], attrs={"perm": [3, 1, 2, 0]}))
    add(case("transpose_default_perm", "Transpose", [In("x", [3, 4, 5], I64)]))
    add(case("transpose_symbolic_tiled", "Transpose", [In("x", ["batch", "seq", 24])], attrs={"perm": [0, 2, 1]},
             bindings=[{"batch": 2, "seq": 17}, {"batch": 1, "seq": 40}]))
    add(case("gather_axis0", "Gather", [In("x", [5, 4]),
                                        In("i", [2, 3], I64, values=np.array([[0, -1, 2], [4, -5, 1]]))]))
    add(case("gather_axis1_i32", "Gather", [In("x", [2, 5, 3]), In("i", [4], I32, values=np.array([-1, 0, 3, -2]))],
             attrs={"axis": 1}))
    add(case("gather_constant_scalar", "Gather", [In("x", [3, 5, 2]), Const("i", np.array(-2, np.int64))],
             attrs={"axis": 1}))
    add(case("gather_symbolic", "Gather", [In("x", ["batch", "seq", 6]),
                                           In("i", [3], I64, values=np.array([5, 0, -1]))],
             attrs={"axis": 2}, bindings=SYMBOLIC))
    add(case("slice_step2", "Slice", [In("x", [6, 9]), Const("s", np.array([1, 0])), Const("e", np.array([6, 9])),
                                      Const("a", np.array([0, 1])), Const("st", np.array([2, 2]))]))
    add(case("slice_reverse", "Slice", [In("x", [4, 5, 3]), Const("s", np.array([-1])),
                                        Const("e", np.array([-2**63 + 1])), Const("a", np.array([1])),
                                        Const("st", np.array([-1]))]))
    add(case("slice_rows_contiguous", "Slice", [In("x", [6, 4]), Const("s", np.array([2])), Const("e", np.array([5]))]))
    add(case("slice_symbolic", "Slice", [In("x", ["batch", "seq", 8]), Const("s", np.array([1, -6])),
                                         Const("e", np.array([2**63 - 1, -1])), Const("a", np.array([1, 2]))],
             bindings=SYMBOLIC))
    add(case("split_3", "Split", [In("x", [2, 9, 3]), Const("sizes", np.array([2, 3, 4]))], attrs={"axis": 1},
             outputs=3))
    add(case("split_equal_last", "Split", [In("x", [4, 6])], attrs={"axis": -1}, outputs=3))
    for mode in ("constant", "reflect", "edge"):
        add(case(f"pad_{mode}", "Pad", [In("x", [3, 4, 5]), Const("p", np.array([0, 2, 1, 1, -1, 2])),
                                        Const("v", np.array(1.5, np.float32))], attrs={"mode": mode}))
    add(case("pad_wrap_axes_opset19", "Pad", [In("x", [3, 4]), Const("p", np.array([2, 1])), "",
                                              Const("a", np.array([-1]))], attrs={"mode": "wrap"}, opset=19))
    add(case("pad_value_input", "Pad", [In("x", [2, 3], I64), Const("p", np.array([1, 0, 0, 2])), In("v", [], I64)]))
    add(case("expand", "Expand", [In("x", [3, 1]), Const("s", np.array([2, 3, 4]))]))
    add(case("expand_symbolic", "Expand", [In("x", ["batch", 1, 8]), Const("s", np.array([1, 3, 1]))],
             bindings=SYMBOLIC))
    add(case("expand_shape_input", "Expand", [In("x", [3, 1]), In("s", [2], I64, values=np.array([3, 4]))],
             bindings=[FRESH]))
    add(case("tile", "Tile", [In("x", [2, 1, 3]), Const("r", np.array([2, 3, 2]))]))
    add(case("shape_symbolic", "Shape", [In("x", ["batch", "seq", 8])], bindings=SYMBOLIC))
    add(case("shape_start_end", "Shape", [In("x", ["batch", "seq", 8])], attrs={"start": 1, "end": -1},
             bindings=SYMBOLIC))
    add(case("size_symbolic", "Size", [In("x", ["batch", "seq", 8])], bindings=SYMBOLIC))
    add(case("reshape_copy", "Reshape", [In("x", ["batch", "seq", 8]), Const("s", np.array([0, -1]))],
             bindings=SYMBOLIC))
    add(case("identity_bool_vector", "Identity", [In("x", [40, 30], BOOL)]))
    add(case("flatten_i32", "Flatten", [In("x", [2, 3, 4], I32)], attrs={"axis": 2}))
    add(case("constant_of_shape", "ConstantOfShape", [Const("s", np.array([2, 3]))],
             attrs={"value": numpy_helper.from_array(np.array([2.5], np.float32))}))
    add(case("constant_of_shape_i64", "ConstantOfShape", [Const("s", np.array([4]))],
             attrs={"value": numpy_helper.from_array(np.array([-7], np.int64))}))
    add(case("range_f32", "Range", [Const("a", np.array(-1.5, np.float32)), Const("b", np.array(4.0, np.float32)),
                                    Const("d", np.array(0.75, np.float32))]))
    add(case("range_i64", "Range", [Const("a", np.array(10, np.int64)), Const("b", np.array(-3, np.int64)),
                                    Const("d", np.array(-4, np.int64))]))
    # outputs whose dims are fresh symbols (known from values at run time), bound alike: one batch
    add(case("constant_of_shape_input", "ConstantOfShape", [In("s", [2], I64, values=np.array([3, 4]))],
             attrs={"value": numpy_helper.from_array(np.array([True]))}, bindings=[FRESH]))
    add(case("range_inputs", "Range", [In("a", [], I64, values=np.array(2)), In("b", [], I64, values=np.array(13)),
                                       In("d", [], I64, values=np.array(4))], bindings=[FRESH]))
    return cases


CASES = _cases()
BY_ID = {c.id: c for c in CASES}
assert len(BY_ID) == len(CASES), "case ids must be unique"


@pytest.fixture(scope="module")
def emulated() -> dict[tuple, list[np.ndarray]]:
    """(case id, bindings index) -> outputs (:func:`cuda_cases.emulate_cases`)."""
    return emulate_cases(CASES)


@pytest.mark.parametrize("case_id", [c.id for c in CASES])
def test_kernel(case_id: str, emulated) -> None:
    """NVRTC compiles the kernel for sm_90 with no spills and at most 48 KiB of static
    shared memory; the emulator's numbers match the registry (and onnxruntime)."""
    c = BY_ID[case_id]
    kernel = kernel_of(c)
    if HAS_NVRTC:
        module = compile_source(kernel.source, "sm_90", use_cache=False)
        for launch in kernel.launches:
            r = module.resources[launch.function]
            assert r.spill_stores == r.spill_loads == 0, f"{launch.function} spills: {r}"
            assert r.shared_bytes + launch.shared_bytes <= 48 * 1024
    for k, bindings in enumerate(c.bindings):
        outs = emulated[c.id, k]
        if isinstance(outs, Exception):
            raise outs
        feeds = feeds_of(c, bindings)
        want = run_graph(c.graph, feeds)
        for v, got in zip(c.node.outputs, outs):
            compare(got, want[v.name], c.rtol, f"{c.id} {v.name} at {bindings} (registry)")
        if c.onnxruntime:
            for v, got, ort in zip(c.node.outputs, outs, run_onnxruntime(c.model, feeds)):
                compare(got, ort, max(c.rtol, ARITHMETIC), f"{c.id} {v.name} at {bindings} (onnxruntime)")


def test_nvrtc_is_available() -> None:
    """Says so when the cases above could not check the compiled kernels."""
    if not HAS_NVRTC:
        pytest.skip("CuPy/NVRTC missing: the kernels were run in the emulator but not compiled for sm_90")


# ---- what the kernels look like --------------------------------------------------------------------------
def test_same_shape_operands_move_four_at_a_time_and_fall_back_when_misaligned() -> None:
    """A same-shape float kernel loads 16 bytes per operand when aligned; misaligned
    pointers (a view one element in) take the scalar loop with the same numbers."""
    from egraft.testing.cuda_emulator import emulator

    c = BY_ID["div_vector_tail"]
    kernel = kernel_of(c)
    assert "eg_vec4_float" in kernel.source and "aligned" in kernel.source
    a = np.zeros(1203, np.float32)
    b = np.zeros(1203, np.float32)
    a[1:] = RNG.standard_normal(1202)
    b[1:] = RNG.uniform(0.5, 3, 1202)
    y = np.zeros(1203, np.float32)
    views = {("in", 0): a[1:].reshape(2, 601), ("in", 1): b[1:].reshape(2, 601), ("out", 0): y[1:].reshape(2, 601)}
    emulator().run(kernel, views, {})
    np.testing.assert_array_equal(y[1:], a[1:] / b[1:])


def test_sixty_four_bit_indices(monkeypatch) -> None:
    """Symbolic counts choose 32-bit indices at run time when they fit: with the limit
    lowered to 10, these cases run their 64-bit loops, with the same numbers."""
    from egraft.kernels.cuda import elementwise

    monkeypatch.setattr(elementwise, "INT_LIMIT", 10)
    ids = ["add_symbolic", "mul_symbolic_same_shape", "where_symbolic", "concat_symbolic", "gather_symbolic",
           "slice_symbolic", "transpose_symbolic_tiled", "expand_symbolic", "reshape_copy"]
    bindings = {"batch": 2, "seq": 17}
    cases = [BY_ID[i] for i in ids]
    assert all("long long n = " in kernel_of(c).source or "long long b_" in kernel_of(c).source for c in cases)
    outs = run_batch(cases, bindings)
    for c in cases:
        want = run_graph(c.graph, feeds_of(c, bindings))
        for v, got in zip(c.node.outputs, outs[c.id]):
            compare(got, want[v.name], c.rtol, f"{c.id} (64-bit indices)")


def test_broadcast_kernel_specialises_operands() -> None:
    """The full-shape operand is read at i, the scalar once before the loop, the strided one
    through one collapsed coordinate with constant strides; static counts index with int."""
    kernel = kernel_of(case("spec", "Where", [In("c", [2, 3, 4], BOOL), In("a", []), In("b", [3, 4])]))
    assert "const float s1 = x1[0];" in kernel.source
    assert "eg_where_op(x0[i], s1, x2[c1])" in kernel.source
    assert "const int c1 = r_ % 12;" in kernel.source


def test_rows_vectorise_when_the_inner_dim_is_a_multiple_of_four() -> None:
    """A bias row ([.., 256] + [256]) loads four of it at a time; a column broadcast
    ([.., 8] * [.., 1]) loads one of it for four outputs."""
    rows = kernel_of(BY_ID["add_rows_vector"]).source
    assert "reinterpret_cast<const eg_vec4_float*>(x1)[(c1) / 4]" in rows
    column = kernel_of(BY_ID["mul_column_vector"]).source
    assert "const float b1 = x1[c0];" in column and "eg_mul_op(v0.v[3], b1)" in column


def test_transpose_kernels() -> None:
    """Moving the innermost axis uses the shared-memory tile; keeping it, a mapped copy."""
    tiled = kernel_of(BY_ID["transpose_10_tiled"])
    assert "__shared__ float tile[32][33];" in tiled.source and tiled.launches[0].block == (32, 8, 1)
    mapped = kernel_of(BY_ID["transpose_0213"])
    assert "tile[" not in mapped.source


@pytest.mark.parametrize("model_case, reason", [
    (lambda: case("slice_input_starts", "Slice", [In("x", [4, 4]), In("s", [1], I64), Const("e", np.array([3]))]),
     "non-constant starts"),
    (lambda: case("pad_input_pads", "Pad", [In("x", [4, 4]), In("p", [4], I64)]), "non-constant pads"),
    (lambda: case("add_f16", "Add", [In("a", [4], np.float16), In("b", [4], np.float16)]), "f16"),
    (lambda: case("exp_i64", "Exp", [In("a", [4], I64)]), "Exp on i64"),
])
def test_refusals(model_case, reason) -> None:
    """What the kernels do not take is refused, naming why (lowering falls back)."""
    with pytest.raises(Unsupported, match=reason.split()[-1]):
        kernel_of(model_case())

"""Generated CPU kernels for quantization (egraft/kernels/cpu/quant.py) and the integer and
rounding elementwise gaps (egraft/kernels/cpu/elementwise.py): every op against onnxruntime,
exactly, at several sizes from one build with symbolic dims, no node on a reference kernel;
and the int8 corpus models' fallbacks for these ops gone."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from conftest import SATURATING_REFERENCE, onnxruntime_saturates_integer_products, reference_options
from onnx import TensorProto, helper, numpy_helper

import egraft

U8, I8, I32, I64, F32, BOOL = (TensorProto.UINT8, TensorProto.INT8, TensorProto.INT32, TensorProto.INT64,
                               TensorProto.FLOAT, TensorProto.BOOL)
QUANT_OPS = {"MatMulInteger", "DynamicQuantizeLinear", "ConvInteger", "QuantizeLinear", "DequantizeLinear", "Floor"}


def _model(nodes, inputs, outputs, initializers=(), opset: int = 13) -> onnx.ModelProto:
    graph = helper.make_graph(nodes, "quant", [helper.make_tensor_value_info(*i) for i in inputs],
                              [helper.make_tensor_value_info(*o) for o in outputs], list(initializers))
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])


def _check(model: onnx.ModelProto, runs: list[tuple[dict, dict]], exact: bool = True) -> egraft.CompiledModel:
    """Compile ``model`` once; for each ``(bindings, feeds)`` no node falls back and every
    output equals onnxruntime's (bit for bit with ``exact``)."""
    compiled = egraft.compile(model.SerializeToString(), use_cache=False)
    session = ort.InferenceSession(model.SerializeToString(), reference_options(), providers=["CPUExecutionProvider"])
    names = [o.name for o in model.graph.output]
    for bindings, feeds in runs:
        assert not compiled.report(bindings).fallbacks, compiled.report(bindings).fallbacks
        got = compiled.run(feeds)
        for name, want in zip(names, session.run(None, feeds)):
            assert got[name].dtype == want.dtype and got[name].shape == want.shape, (name, got[name].shape, want.shape)
            if exact:
                np.testing.assert_array_equal(got[name], want, err_msg=f"{name} at {bindings}")
            else:
                np.testing.assert_allclose(got[name], want, rtol=1e-6, atol=0, err_msg=f"{name} at {bindings}")
    return compiled


def _ints(rng, dtype, shape) -> np.ndarray:
    info = np.iinfo(dtype)
    return rng.integers(info.min, int(info.max) + 1, shape).astype(dtype)


# ---- DynamicQuantizeLinear ------------------------------------------------------------------------
def test_dynamic_quantize_linear_matches_onnxruntime():
    model = _model([helper.make_node("DynamicQuantizeLinear", ["x"], ["y", "s", "z"])],
                   [("x", F32, ["n", "m"])], [("y", U8, ["n", "m"]), ("s", F32, []), ("z", U8, [])])
    rng = np.random.default_rng(0)
    cases = [rng.normal(0, 3, (1, 7)), rng.normal(1, 2, (5, 37)), rng.uniform(0.5, 9, (3, 64)),  # all positive
             rng.uniform(-4, -1, (2, 19)), np.zeros((4, 5)), rng.normal(0, 1, (33, 17)),
             np.round(rng.normal(0, 8, (6, 40))) / 2]  # ties at x / scale
    _check(model, [({"n": x.shape[0], "m": x.shape[1]}, {"x": x.astype(np.float32)}) for x in cases])


# ---- QuantizeLinear, DequantizeLinear -------------------------------------------------------------
@pytest.mark.parametrize("dtype", [U8, I8], ids=["u8", "i8"])
@pytest.mark.parametrize("per_axis", [False, True])
def test_quantize_linear_matches_onnxruntime(dtype, per_axis):
    np_dtype = np.uint8 if dtype == U8 else np.int8
    rng = np.random.default_rng(1)
    shape = [4] if per_axis else []
    scale = numpy_helper.from_array(rng.uniform(0.01, 0.2, shape).astype(np.float32), "scale")
    zero = numpy_helper.from_array(_ints(rng, np_dtype, shape) // 2, "zero")
    model = _model([helper.make_node("QuantizeLinear", ["x", "scale", "zero"], ["y"], axis=1),
                    helper.make_node("QuantizeLinear", ["x", "scale"], ["q"], axis=1)],
                   [("x", F32, ["n", 4, "m"])], [("y", dtype, ["n", 4, "m"]), ("q", U8, ["n", 4, "m"])],
                   [scale, zero])
    runs = []
    for n, m in [(1, 1), (2, 9), (3, 40)]:
        x = rng.normal(0, 10, (n, 4, m)).astype(np.float32)
        x.flat[::7] = np.round(x.flat[::7])  # exact values and ties
        runs.append(({"n": n, "m": m}, {"x": x}))
    _check(model, runs)


def test_quantize_linear_with_a_computed_scale_and_zero_point():
    model = _model([helper.make_node("QuantizeLinear", ["x", "s", "z"], ["y"])],
                   [("x", F32, ["n"]), ("s", F32, []), ("z", I8, [])], [("y", I8, ["n"])])
    rng = np.random.default_rng(2)
    runs = [({"n": n}, {"x": rng.normal(0, 5, n).astype(np.float32), "s": np.array(s, np.float32),
                        "z": np.array(z, np.int8)}) for n, s, z in [(3, 0.1, -3), (50, 0.03, 7), (17, 1.0, 0)]]
    _check(model, runs)


@pytest.mark.parametrize("dtype", [U8, I8, I32], ids=["u8", "i8", "i32"])
@pytest.mark.parametrize("per_axis", [False, True])
def test_dequantize_linear_matches_onnxruntime(dtype, per_axis):
    np_dtype = {U8: np.uint8, I8: np.int8, I32: np.int32}[dtype]
    rng = np.random.default_rng(3)
    shape = [3] if per_axis else []
    scale = numpy_helper.from_array(rng.uniform(0.001, 0.5, shape).astype(np.float32), "scale")
    zp_values = _ints(rng, np.int8, shape).astype(np_dtype) if dtype != U8 else _ints(rng, np.uint8, shape)
    if dtype == I32:
        zp_values = np.zeros(shape, np.int32)  # onnxruntime: an int32 zero point must be 0
    zero = numpy_helper.from_array(zp_values, "zero")
    model = _model([helper.make_node("DequantizeLinear", ["x", "scale", "zero"], ["y"], axis=0)],
                   [("x", dtype, [3, "n"])], [("y", F32, [3, "n"])], [scale, zero])
    _check(model, [({"n": n}, {"x": _ints(rng, np_dtype, (3, n))}) for n in (1, 8, 31)])


# ---- MatMulInteger --------------------------------------------------------------------------------
@pytest.mark.parametrize(("a_type", "b_type"), [(U8, I8), (U8, U8), (I8, I8)], ids=["u8i8", "u8u8", "i8i8"])
@pytest.mark.parametrize("n", [40, 64])
@pytest.mark.parametrize("per_column", [False, True])
def test_matmul_integer_matches_onnxruntime(a_type, b_type, n, per_column):
    """A [batch, seq, 48] with a computed zero point, B [48, n] constant with its zero point per
    tensor or per column; seq across the 4-row tiles and their tail; extreme values (int16
    products would saturate)."""
    a_np, b_np = (np.uint8 if t == U8 else np.int8 for t in (a_type, b_type))
    rng = np.random.default_rng(n + 7 * a_type + b_type)
    k = 48
    w = _ints(rng, b_np, (k, n))
    w[0] = np.iinfo(b_np).min
    b_zero = _ints(rng, b_np, (n,) if per_column else ())
    model = _model([helper.make_node("MatMulInteger", ["a", "w", "a_zero", "w_zero"], ["y"])],
                   [("a", a_type, ["batch", "seq", k]), ("a_zero", a_type, [])], [("y", I32, ["batch", "seq", n])],
                   [numpy_helper.from_array(w, "w"), numpy_helper.from_array(b_zero, "w_zero")])
    runs = []
    for batch, seq in [(1, 1), (1, 7), (2, 9), (3, 4)]:
        a = _ints(rng, a_np, (batch, seq, k))
        a[0, 0] = np.iinfo(a_np).max
        runs.append(({"batch": batch, "seq": seq}, {"a": a, "a_zero": _ints(rng, a_np, ())}))
    _check(model, runs)


FORMS = [("", 4, 4, 2), ("llvm.x86.sse2.pmadd.wd", 4, 4, 2), ("llvm.x86.avx2.pmadd.wd", 8, 4, 2),
         ("llvm.x86.avx512.pmaddw.d.512", 16, 8, 2), ("llvm.x86.avx512.vpdpwssd.512", 16, 8, 2),
         ("llvm.x86.avx512.vpdpbusd.512", 16, 8, 4)]
FORM_NAMES = ["generic", "sse2", "avx2", "avx512bw", "vpdpwssd", "vpdpbusd"]


def _force_form(monkeypatch, intrinsic: str, lanes: int, rows: int, depth: int) -> None:
    """Make the kernels use this product form (skip when the host cannot run it)."""
    from egraft.kernels.cpu import quant
    from egraft.kernels.cpu.llvm import host_cpu

    needs = {"avx2": "+avx2", "avx512": "+avx512bw", "vpdp": "+avx512vnni"}
    triple, _, features = host_cpu()
    if any(key in intrinsic and flag not in features.split(",") for key, flag in needs.items()) or \
            (intrinsic and not triple.startswith("x86_64")):
        pytest.skip(f"the host cannot run {intrinsic}")
    form = quant.PairProduct(intrinsic, lanes, rows, depth)
    monkeypatch.setattr(quant.PairProduct, "for_host", staticmethod(lambda: form))
    monkeypatch.setenv("EGRAFT_AMX", "0")  # the tile products take precedence where the host has them


@pytest.mark.parametrize("form", FORMS, ids=FORM_NAMES)
@pytest.mark.parametrize(("a_type", "b_type"), [(U8, I8), (U8, U8), (I8, I8)], ids=["u8i8", "u8u8", "i8i8"])
def test_matmul_integer_product_forms(monkeypatch, form, a_type, b_type):
    """Every form of the product (the host picks one) gives the exact product, with zero
    points per tensor and per column; an odd depth (the last pair or quad part empty)."""
    _force_form(monkeypatch, *form)
    a_np, b_np = (np.uint8 if t == U8 else np.int8 for t in (a_type, b_type))
    rng = np.random.default_rng(form[1] + a_type)
    w = _ints(rng, b_np, (37, 70))
    for b_zero in (_ints(rng, b_np, ()), _ints(rng, b_np, (70,))):
        model = _model([helper.make_node("MatMulInteger", ["a", "w", "a_zero", "w_zero"], ["y"])],
                       [("a", a_type, ["m", 37]), ("a_zero", a_type, [])], [("y", I32, ["m", 70])],
                       [numpy_helper.from_array(w, "w"), numpy_helper.from_array(b_zero, "w_zero")])
        _check(model, [({"m": m}, {"a": _ints(rng, a_np, (m, 37)), "a_zero": _ints(rng, a_np, ())})
                       for m in (1, 11, 16)])


def _needs_tiles() -> None:
    from egraft.kernels.cpu import amx

    if not amx.host_has_tiles():
        pytest.skip("the host has no AMX int8 tiles (Intel Sapphire Rapids and later)")
    if not amx.available():
        pytest.skip("Linux did not lend this process the AMX tile registers")


@pytest.mark.usefixtures("split_every_parallel_kernel")
@pytest.mark.parametrize(("a_type", "b_type"), [(U8, I8), (U8, U8), (I8, I8)], ids=["u8i8", "u8u8", "i8i8"])
@pytest.mark.parametrize(("k", "n"), [(64, 32), (37, 70), (128, 17), (200, 1)])
@pytest.mark.parametrize("b_zero_kind", ["none", "tensor", "column"])
def test_matmul_integer_on_amx_tiles(a_type, b_type, k, n, b_zero_kind):
    """The AMX tile product (the host's pick where it has one) is exact against int64 numpy:
    rows across the 16-row tiles and 32-row blocks (1 to 70), depths whole and partial 64-deep
    steps, columns across the 16-column panels and their pairs, B's zero point none, per tensor
    or per column, extreme values, at 1 and 2 threads (the column pairs split)."""
    _needs_tiles()
    a_np, b_np = (np.uint8 if t == U8 else np.int8 for t in (a_type, b_type))
    rng = np.random.default_rng(k + n + a_type)
    w = _ints(rng, b_np, (k, n))
    w[0] = np.iinfo(b_np).min
    b_zero = {"none": np.zeros((), b_np), "tensor": _ints(rng, b_np, ()), "column": _ints(rng, b_np, (n,))}[b_zero_kind]
    model = _model([helper.make_node("MatMulInteger", ["a", "w", "a_zero", "w_zero"], ["y"])],
                   [("a", a_type, ["m", k]), ("a_zero", a_type, [])], [("y", I32, ["m", n])],
                   [numpy_helper.from_array(w, "w"), numpy_helper.from_array(b_zero, "w_zero")])
    compiled = egraft.compile(model.SerializeToString(), use_cache=False)
    for m in (1, 15, 16, 17, 32, 33, 70):
        a, zero = _ints(rng, a_np, (m, k)), _ints(rng, a_np, ())
        a[0] = np.iinfo(a_np).max
        want = (a.astype(np.int64) - np.int64(zero)) @ (w.astype(np.int64) - b_zero.astype(np.int64))
        for threads in (1, 2):
            compiled.threads = threads
            np.testing.assert_array_equal(compiled.run({"a": a, "a_zero": zero})["y"], want.astype(np.int32),
                                          err_msg=f"m={m} threads={threads}")


def test_matmul_integer_on_amx_tiles_is_the_hosts_pick_and_can_be_turned_off(monkeypatch):
    """Where the host has AMX, the kernel's code holds tile products; ``EGRAFT_AMX=0`` gives
    the vector products instead, with the same exact result."""
    _needs_tiles()
    from egraft.kernels.cpu.emit import KernelContext

    texts = []
    original = KernelContext.finish

    def keep(self):
        original(self)
        texts.append(str(self.module))

    monkeypatch.setattr(KernelContext, "finish", keep)
    rng = np.random.default_rng(3)
    w = _ints(rng, np.int8, (96, 48))
    model = _model([helper.make_node("MatMulInteger", ["a", "w"], ["y"])], [("a", U8, ["m", 96])],
                   [("y", I32, ["m", 48])], [numpy_helper.from_array(w, "w")])
    a = _ints(rng, np.uint8, (20, 96))
    want = (a.astype(np.int64) @ w.astype(np.int64)).astype(np.int32)
    for setting, marker in (("1", "llvm.x86.tdpbusd"), ("0", "vpdpbusd")):
        monkeypatch.setenv("EGRAFT_AMX", setting)
        texts.clear()
        got = egraft.compile(model.SerializeToString(), use_cache=False).run({"a": a})["y"]
        np.testing.assert_array_equal(got, want)
        assert any(marker in text for text in texts), setting


@pytest.mark.parametrize("form", FORMS, ids=FORM_NAMES)
def test_conv_integer_product_forms(monkeypatch, form):
    """ConvInteger's im2col product in every form: 27 taps, padding, stride 2."""
    _force_form(monkeypatch, *form)
    rng = np.random.default_rng(form[1])
    w = _ints(rng, np.uint8, (5, 3, 3, 3))
    model = _model([helper.make_node("ConvInteger", ["x", "w", "x_zero", "w_zero"], ["y"], pads=[1, 1, 1, 1],
                                     strides=[2, 2])],
                   [("x", U8, [1, 3, "h", "w"]), ("x_zero", U8, [])], [("y", I32, None)],
                   [numpy_helper.from_array(w, "w"), numpy_helper.from_array(np.array(200, np.uint8), "w_zero")])
    _check(model, [({"h": h, "w": wd}, {"x": _ints(rng, np.uint8, (1, 3, h, wd)), "x_zero": np.array(zp, np.uint8)})
                   for h, wd, zp in [(5, 7, 0), (12, 9, 255)]])


def test_matmul_integer_per_row_a_zero_point_and_no_zero_points():
    """onnxruntime takes only a per-tensor a_zero_point: a per-row one (the ONNX spec allows it)
    is checked against int64 numpy; a product without zero points against onnxruntime."""
    rng = np.random.default_rng(5)
    w = _ints(rng, np.int8, (24, 33))
    model = _model([helper.make_node("MatMulInteger", ["a", "w", "a_zero"], ["y"])],
                   [("a", U8, ["m", 24]), ("a_zero", U8, ["m"])], [("y", I32, ["m", 33])],
                   [numpy_helper.from_array(w, "w")])
    compiled = egraft.compile(model.SerializeToString(), use_cache=False)
    for m in (1, 5, 12):
        assert not compiled.report({"m": m}).fallbacks
        a, zero = _ints(rng, np.uint8, (m, 24)), _ints(rng, np.uint8, (m,))
        want = (a.astype(np.int64) - zero[:, None].astype(np.int64)) @ w.astype(np.int64)
        np.testing.assert_array_equal(compiled.run({"a": a, "a_zero": zero})["y"], want.astype(np.int32))
    plain = _model([helper.make_node("MatMulInteger", ["a", "w"], ["y"])], [("a", U8, ["m", 24])],
                   [("y", I32, ["m", 33])], [numpy_helper.from_array(w, "w")])
    _check(plain, [({"m": m}, {"a": _ints(rng, np.uint8, (m, 24))}) for m in (2, 6)])


# ---- ConvInteger ----------------------------------------------------------------------------------
@pytest.mark.parametrize(("kernel", "stride", "pad", "group"), [(3, 1, 1, 1), (3, 2, 1, 1), (1, 1, 0, 1), (3, 1, 0, 2)])
def test_conv_integer_matches_onnxruntime(kernel, stride, pad, group):
    """x u8 [1, 4, h, w] (symbolic h, w) with a computed zero point, w u8 constant with its zero
    point; the output spatial dims are floor expressions of h and w."""
    rng = np.random.default_rng(kernel * 10 + stride + group)
    w = _ints(rng, np.uint8, (6, 4 // group, kernel, kernel))
    model = _model([helper.make_node("ConvInteger", ["x", "w", "x_zero", "w_zero"], ["y"], kernel_shape=[kernel] * 2,
                                     strides=[stride] * 2, pads=[pad] * 4, group=group)],
                   [("x", U8, [1, 4, "h", "w"]), ("x_zero", U8, [])], [("y", I32, None)],
                   [numpy_helper.from_array(w, "w"), numpy_helper.from_array(np.array(7, np.uint8), "w_zero")])
    runs = [({"h": h, "w": wd}, {"x": _ints(rng, np.uint8, (1, 4, h, wd)), "x_zero": np.array(zp, np.uint8)})
            for h, wd, zp in [(3, 3, 0), (8, 13, 128), (17, 6, 255)]]
    _check(model, runs)


def test_conv_integer_1d_matches_onnxruntime():
    rng = np.random.default_rng(21)
    w = _ints(rng, np.uint8, (7, 5, 4))
    model = _model([helper.make_node("ConvInteger", ["x", "w", "x_zero"], ["y"], pads=[2, 1], dilations=[2])],
                   [("x", U8, ["n", 5, "t"]), ("x_zero", U8, [])], [("y", I32, None)],
                   [numpy_helper.from_array(w, "w")])
    _check(model, [({"n": n, "t": t}, {"x": _ints(rng, np.uint8, (n, 5, t)), "x_zero": np.array(zp, np.uint8)})
                   for n, t, zp in [(1, 6, 0), (2, 19, 131)]])


def test_conv_integer_per_channel_weight_zero_point_against_numpy():
    """A per-output-channel w_zero_point (the ONNX spec allows it; onnxruntime takes a scalar
    one) against the int64 definition; 27 taps (an odd depth)."""
    rng = np.random.default_rng(9)
    w = _ints(rng, np.int8, (3, 3, 3, 3))
    w_zero = np.array([-5, 0, 9], np.int8)
    model = _model([helper.make_node("ConvInteger", ["x", "w", "", "w_zero"], ["y"], pads=[1, 1, 1, 1])],
                   [("x", I8, [1, 3, "h", "w"])], [("y", I32, None)],
                   [numpy_helper.from_array(w, "w"), numpy_helper.from_array(w_zero, "w_zero")])
    compiled = egraft.compile(model.SerializeToString(), use_cache=False)
    for h, wd in [(4, 5), (9, 2)]:
        assert not compiled.report({"h": h, "w": wd}).fallbacks
        x = _ints(rng, np.int8, (1, 3, h, wd))
        xp = np.pad(x.astype(np.int64), [(0, 0), (0, 0), (1, 1), (1, 1)])
        ws = w.astype(np.int64) - w_zero.astype(np.int64)[:, None, None, None]
        want = np.zeros((1, 3, h, wd), np.int64)
        for i in range(3):
            for j in range(3):
                want[0] += np.einsum("oc,chw->ohw", ws[:, :, i, j], xp[0, :, i:i + h, j:j + wd])
        np.testing.assert_array_equal(compiled.run({"x": x})["y"], want.astype(np.int32))


# ---- elementwise gaps: rounding, integer unary and binary ops, IsNaN/IsInf, Identity, Clip ----------
def test_rounding_and_sign_on_floats():
    ops = ["Floor", "Ceil", "Round", "Sign", "Reciprocal"]
    model = _model([helper.make_node(op, ["x"], [op.lower()]) for op in ops], [("x", F32, ["n"])],
                   [(op.lower(), F32, ["n"]) for op in ops])
    rng = np.random.default_rng(11)
    runs = []
    for n in (1, 9, 70):
        x = (rng.normal(0, 4, n) if n > 1 else np.array([2.5])).astype(np.float32)
        x[::3] = np.round(x[::3] * 2) / 2  # halves: round half to even
        x[::5] = 0
        runs.append(({"n": n}, {"x": x}))
    _check(model, runs)


@pytest.mark.parametrize("dtype", [I64, I32, I8, U8], ids=["i64", "i32", "i8", "u8"])
def test_integer_abs_neg_sign_max_min(dtype):
    np_dtype = {I64: np.int64, I32: np.int32, I8: np.int8, U8: np.uint8}[dtype]
    ops = ["Abs", "Neg", "Sign"] if dtype != U8 else ["Abs", "Sign"]
    nodes = [helper.make_node(op, ["x"], [op.lower()]) for op in ops]
    nodes += [helper.make_node("Max", ["x", "y"], ["max"]), helper.make_node("Min", ["x", "y"], ["min"])]
    outputs = [(op.lower(), dtype, ["n", 3]) for op in ops] + [("max", dtype, ["n", 3]), ("min", dtype, ["n", 3])]
    model = _model(nodes, [("x", dtype, ["n", 3]), ("y", dtype, [3])], outputs, opset=14)
    rng = np.random.default_rng(12)
    info = np.iinfo(np_dtype)
    runs = []
    for n in (1, 4, 23):
        x = _ints(rng, np_dtype, (n, 3)) if dtype in (I8, U8) else rng.integers(-1000, 1000, (n, 3)).astype(np_dtype)
        x[0, 0] = info.min if dtype != U8 else 0
        runs.append(({"n": n}, {"x": x, "y": _ints(rng, np_dtype, (3,)) if dtype in (I8, U8)
                               else rng.integers(-500, 500, 3).astype(np_dtype)}))
    _check(model, runs)


def test_isnan_isinf_and_identity_copies():
    nodes = [helper.make_node("IsNaN", ["x"], ["nan"]), helper.make_node("IsInf", ["x"], ["inf"]),
             helper.make_node("IsInf", ["x"], ["posinf"], detect_negative=0),
             helper.make_node("IsInf", ["x"], ["neginf"], detect_positive=0),
             helper.make_node("Identity", ["i"], ["i_copy"]), helper.make_node("Identity", ["nan"], ["b_copy"])]
    model = _model(nodes, [("x", F32, ["n"]), ("i", I64, ["n", 2])],
                   [("nan", BOOL, ["n"]), ("inf", BOOL, ["n"]), ("posinf", BOOL, ["n"]), ("neginf", BOOL, ["n"]),
                    ("i_copy", I64, ["n", 2]), ("b_copy", BOOL, ["n"])], opset=20)
    rng = np.random.default_rng(13)
    runs = []
    for n in (4, 11):
        x = rng.normal(0, 1, n).astype(np.float32)
        x[:4] = [np.nan, np.inf, -np.inf, 0]
        runs.append(({"n": n}, {"x": x, "i": rng.integers(-(2**40), 2**40, (n, 2))}))
    _check(model, runs)


@pytest.mark.parametrize("dtype", [F32, I64], ids=["f32", "i64"])
def test_clip_with_computed_bounds(dtype):
    np_dtype = np.float32 if dtype == F32 else np.int64
    nodes = [helper.make_node("Clip", ["x", "lo", "hi"], ["y"]), helper.make_node("Clip", ["x", "", "hi"], ["z"])]
    model = _model(nodes, [("x", dtype, ["n"]), ("lo", dtype, []), ("hi", dtype, [])],
                   [("y", dtype, ["n"]), ("z", dtype, ["n"])])
    rng = np.random.default_rng(14)
    runs = [({"n": n}, {"x": rng.integers(-50, 50, n).astype(np_dtype), "lo": np.array(lo, np_dtype),
                        "hi": np.array(hi, np_dtype)}) for n, lo, hi in [(5, -3, 4), (40, 10, -10), (9, 0, 0)]]
    _check(model, runs)


# ---- the int8 corpus models ---------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["ddddocr_ocr_int8", "t5_encoder_int8"])
def test_corpus_int8_models_run_quantization_on_generated_code(name):
    if name == "t5_encoder_int8" and onnxruntime_saturates_integer_products():
        pytest.skip(SATURATING_REFERENCE)  # its MatMulIntegers multiply computed u8 activations by s8 weights
    from egraft.testing import corpus
    from egraft.testing.corpus import compare_outputs, entry, make_feeds
    from egraft.testing.corpus.compare import ort_outputs

    path = corpus.fetch([name], progress=None)[name]
    e = entry(name)
    compiled = egraft.compile(str(path), use_cache=False)
    for binding in e.bindings:
        left = [(label, op, reason) for label, op, reason in compiled.report(binding.dims).fallbacks
                if op in QUANT_OPS or "i64 has no generated code" in reason or "integer" in reason]
        assert not left, left
    feeds = make_feeds(e, e.bindings[0])
    result = compare_outputs(compiled.run(feeds), ort_outputs(path, feeds))
    assert result.error <= e.tolerance, (result.error, e.tolerance)


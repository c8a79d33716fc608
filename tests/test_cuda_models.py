"""The CUDA backend on whole models, without a GPU: every bundled model and the test
encoder compile for sm_90 (NVRTC) with every op on a generated kernel and no register
spills; small models run end to end on the emulated device (the same CUDA C compiled for
this CPU) and match onnxruntime; running on the GPU where there is none is refused by
name. The numbers on a real GPU come from ``benchmarks/gpu_check.py``."""

from __future__ import annotations

import shutil

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

import egraft
from egraft.errors import EgraftError
from egraft.testing.encoder import encoder_inputs, encoder_model
from egraft.testing.models import LIGHT_MODELS, light_model_path

cupy = pytest.importorskip("cupy", reason="the CUDA backend compiles with CuPy's NVRTC (pip install 'egraft[cuda]')")
needs_gxx = pytest.mark.skipif(shutil.which("g++") is None, reason="the CUDA emulator compiles kernels with g++")


def _cuda(model, **kw):
    return egraft.compile(model, target="cuda", arch="sm_90", **kw)


def _ort(model: onnx.ModelProto, feeds: dict) -> list[np.ndarray]:
    """onnxruntime's outputs with its graph rewrites off: on the encoder they move the
    outputs by 7e-3 (its own fusions approximate), while the unrewritten graph agrees with
    egraft's float64-checked reference to 1e-6."""
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.intra_op_num_threads = 1
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    session = ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
    return session.run(None, feeds)


def _assert_all_compiled(compiled, what: str) -> dict:
    report = compiled.report()
    assert report["fallbacks"] == [], f"{what}: ops left on the host: {report['fallbacks']}"
    assert report["kernels"], f"{what}: no kernel"
    for k in report["kernels"]:
        if k.get("library"):
            continue  # cuBLAS: no code of ours
        assert k["registers"] is not None and k["registers"] > 0, f"{what}: {k['function']} has no ptxas report"
        assert k["spill_bytes"] == 0, f"{what}: {k['name']} ({k['op']}) spills {k['spill_bytes']} bytes"
        assert k["shared_bytes"] <= 48 * 1024, f"{what}: {k['name']} uses {k['shared_bytes']} bytes of shared memory"
        assert k["threads"] <= 1024
    return report


@pytest.mark.parametrize("name", LIGHT_MODELS)
def test_every_bundled_model_compiles_for_sm90_with_no_fallback_and_no_spill(name):
    compiled = _cuda(str(light_model_path(name)))
    report = _assert_all_compiled(compiled, name)
    assert report["arch"] == "sm_90"
    ops = {k["op"] for k in report["kernels"]}
    assert ops & {"com.egraft::FusedConv", "Conv"}, f"{name}: no convolution kernel in {sorted(ops)}"


def test_the_encoder_compiles_for_sm90_with_symbolic_batch_and_seq():
    compiled = _cuda(encoder_model())
    _assert_all_compiled(compiled, "encoder")
    symbols = {s for call in compiled.program.kernels.calls for s in call.symbols}
    assert {"batch", "seq"} <= symbols, "one build serves every batch and sequence length"


def _small_cnn() -> onnx.ModelProto:
    """Conv+BN+Relu, MaxPool, a residual block, a grouped conv, global pooling, Gemm, Softmax."""
    rng = np.random.default_rng(0)

    def w(name, *shape, scale=0.3):
        return numpy_helper.from_array((rng.normal(0, scale, shape)).astype(np.float32), name)

    inits = [w("w1", 16, 3, 3, 3), w("b1", 16), w("w2", 16, 16, 3, 3, scale=0.1), w("w3", 16, 4, 1, 1),
             w("fc", 10, 16), w("fcb", 10),
             numpy_helper.from_array(rng.uniform(0.5, 1.5, 16).astype(np.float32), "s"),
             w("t", 16), w("m", 16), numpy_helper.from_array(rng.uniform(0.5, 2, 16).astype(np.float32), "v")]
    nodes = [
        helper.make_node("Conv", ["x", "w1", "b1"], ["c1"], pads=[1, 1, 1, 1]),
        helper.make_node("BatchNormalization", ["c1", "s", "t", "m", "v"], ["n1"]),
        helper.make_node("Relu", ["n1"], ["r1"]),
        helper.make_node("MaxPool", ["r1"], ["p1"], kernel_shape=[3, 3], strides=[2, 2], pads=[1, 1, 1, 1]),
        helper.make_node("Conv", ["p1", "w2"], ["c2"], pads=[1, 1, 1, 1]),
        helper.make_node("Add", ["c2", "p1"], ["a2"]),
        helper.make_node("Relu", ["a2"], ["r2"]),
        helper.make_node("Conv", ["r2", "w3"], ["c3"], group=4),
        helper.make_node("GlobalAveragePool", ["c3"], ["g"]),
        helper.make_node("Flatten", ["g"], ["f"]),
        helper.make_node("Gemm", ["f", "fc", "fcb"], ["logits"], transB=1),
        helper.make_node("Softmax", ["logits"], ["prob"], axis=1),
    ]
    graph = helper.make_graph(nodes, "small_cnn", [helper.make_tensor_value_info("x", TensorProto.FLOAT,
                                                                                 ["batch", 3, 13, 11])],
                              [helper.make_tensor_value_info("prob", TensorProto.FLOAT, None)], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


@needs_gxx
def test_a_small_cnn_runs_on_the_emulated_device_as_onnxruntime_does():
    model = _small_cnn()
    compiled = _cuda(model, device="emulator")
    _assert_all_compiled(compiled, "small_cnn")
    for batch in (1, 3):
        x = np.random.default_rng(batch).normal(size=(batch, 3, 13, 11)).astype(np.float32)
        got = compiled.run({"x": x})["prob"]
        np.testing.assert_allclose(got, _ort(model, {"x": x})[0], rtol=1e-4, atol=1e-6)


@needs_gxx
def test_the_encoder_runs_on_the_emulated_device_as_onnxruntime_does():
    model = encoder_model()
    compiled = _cuda(model, device="emulator")
    for batch, seq in ((1, 5), (2, 9)):
        feeds = encoder_inputs(batch, seq)
        got = compiled.run(feeds)
        want = _ort(model, feeds)
        for name, expected in zip([o.name for o in model.graph.output], want):
            np.testing.assert_allclose(got[name], expected, rtol=1e-4, atol=1e-5, err_msg=name)


def test_running_on_a_gpu_where_there_is_none_names_the_missing_device():
    try:
        count = cupy.cuda.runtime.getDeviceCount()
    except Exception:
        count = 0
    if count:
        pytest.skip("this machine has a CUDA device: nothing is missing")
    compiled = _cuda(_small_cnn())
    with pytest.raises(EgraftError, match="no CUDA device.*sm_90.*emulator"):
        compiled.run({"x": np.zeros((1, 3, 13, 11), np.float32)})


def test_a_bad_arch_and_a_bad_device_are_refused_by_name():
    with pytest.raises(EgraftError, match="--arch sm90: not a CUDA architecture"):
        egraft.compile(_small_cnn(), target="cuda", arch="sm90")
    with pytest.raises(EgraftError, match="device 'tpu'"):
        egraft.compile(_small_cnn(), target="cuda", device="tpu")
    with pytest.raises(EgraftError, match="only for target='cuda'"):
        egraft.compile(_small_cnn(), arch="sm_90")


def test_a_slice_sized_by_a_shape_is_checked_on_the_host_per_binding():
    """The encoder slices its position table to ``Shape(input_ids)[1]``: a kernel, not a
    fallback; its length is re-derived on the host from the input shapes (no device read), so
    a sequence longer than the table (64) is refused naming the Slice, as on the CPU."""
    from egraft.errors import ExecutionError
    from egraft.ir.interpreter import Bindings
    from egraft.lowering.cuda_runtime import CudaModel

    compiled = _cuda(encoder_model())
    checked = compiled.program.kernels.host_checks
    assert [compiled.graph.nodes[i].op for i in checked] == ["Slice"]
    assert {n.op for nodes in checked.values() for n in nodes} >= {"Shape"}
    with pytest.raises(ExecutionError, match="Slice.*seq=70"):
        CudaModel(compiled.program, device="emulator")._check_host_sized(Bindings(batch=1, seq=70))
    CudaModel(compiled.program, device="emulator")._check_host_sized(Bindings(batch=1, seq=64))


def test_the_cli_writes_the_cuda_build_and_reports_it(tmp_path):
    """``egraft compile --target cuda -o DIR --json``: the sources, one cubin per module and a
    report whose kernels carry ptxas' figures; an existing build is not overwritten without
    --force; --arch needs --target cuda."""
    import json

    from typer.testing import CliRunner

    from egraft.cli import app

    runner = CliRunner()
    model = tmp_path / "small.onnx"
    onnx.save(_small_cnn(), model)
    out = tmp_path / "build"
    result = runner.invoke(app, ["compile", str(model), "--target", "cuda", "--arch", "sm_80", "-o", str(out),
                                 "--json"])
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    assert report["arch"] == "sm_80" and report["fallbacks"] == []
    assert {"name", "op", "registers", "spill_bytes", "shared_bytes"} <= set(report["kernels"][0])
    assert json.loads((out / "report.json").read_text())["kernels"] == report["kernels"]
    cubins = sorted((out / "cubins").glob("*.cubin"))
    assert len(cubins) == report["modules"] and all(c.read_bytes()[:4] == b"\x7fELF" for c in cubins)
    assert "__global__" in (out / "kernels.cu").read_text()
    again = runner.invoke(app, ["compile", str(model), "--target", "cuda", "-o", str(out)])
    assert again.exit_code != 0 and "--force" in again.output
    wrong = runner.invoke(app, ["compile", str(model), "--arch", "sm_90"])
    assert wrong.exit_code != 0 and "only with --target cuda" in wrong.output


def _gpu_count() -> int:
    try:
        return cupy.cuda.runtime.getDeviceCount()
    except Exception:
        return 0


@pytest.mark.skipif(_gpu_count() == 0, reason="needs a CUDA device (benchmarks/gpu_check.py runs it where one is)")
def test_small_models_on_the_gpu_match_onnxruntime():
    """On a real GPU: the small CNN and the encoder, eagerly, with CuPy arrays in, and replayed
    as a CUDA graph, all as onnxruntime computes them."""
    from egraft.lowering.cuda_runtime import CudaModel

    model = _small_cnn()
    arch = "sm_{}{}".format(*cupy.cuda.Device().compute_capability)
    compiled = egraft.compile(model, target="cuda", arch=arch)
    x = np.random.default_rng(5).normal(size=(2, 3, 13, 11)).astype(np.float32)
    want = _ort(model, {"x": x})[0]
    np.testing.assert_allclose(compiled.run({"x": x})["prob"], want, rtol=1e-4, atol=1e-6)
    np.testing.assert_allclose(compiled.run({"x": cupy.asarray(x)})["prob"].get(), want, rtol=1e-4, atol=1e-6)
    graphed = CudaModel(compiled.program, cuda_graph=True)
    for _ in range(3):
        np.testing.assert_allclose(graphed.run({"x": x})["prob"], want, rtol=1e-4, atol=1e-6)
    encoder = encoder_model()
    compiled = egraft.compile(encoder, target="cuda", arch=arch)
    feeds = encoder_inputs(2, 9)
    for name, expected in zip([o.name for o in encoder.graph.output], _ort(encoder, feeds)):
        np.testing.assert_allclose(compiled.run(feeds)[name], expected, rtol=1e-4, atol=1e-5, err_msg=name)


def test_docstring_examples_of_the_cuda_modules():
    import doctest

    from egraft.kernels.cuda import emit, nvrtc

    for module in (emit, nvrtc):
        result = doctest.testmod(module)
        assert result.attempted > 0 and result.failed == 0, module.__name__


def test_a_profile_can_mark_kernel_families_unavailable(tmp_path):
    """The cuda profile has no NCHW8c, NHWC or Winograd kernels: their cost is infinite, so a
    convolution never extracts as one; a family name that does not exist is refused."""
    import math

    from egraft.extract.cost import Roofline
    from egraft.extract.profiles import load_profile
    from egraft.ir.work import Work

    cuda = load_profile("cuda-h200")
    assert set(cuda.unavailable) == {"conv_nchwc", "conv_nhwc", "winograd"}
    assert math.isinf(Roofline(cuda).op_cost(Work(1e6, "winograd"), None))
    assert Roofline(cuda).op_cost(Work(1e6, "conv"), None) < 100
    assert load_profile(str(_saved(tmp_path, cuda))).unavailable == cuda.unavailable
    bad = tmp_path / "bad.toml"
    bad.write_text(cuda.to_toml().replace('"winograd"', '"wingrad"'))
    with pytest.raises(EgraftError, match="unavailable.*wingrad"):
        load_profile(str(bad))


def _saved(folder, profile):
    path = folder / "copy.toml"
    path.write_text(profile.to_toml())
    return path


@needs_gxx
def test_a_range_sized_by_a_shape_runs_on_the_device_with_its_length_bound_on_the_host():
    """``Range(0, Shape(x)[1])`` has a fresh length ``_d0`` on the CPU, bound only when it runs;
    its CUDA kernel's length is derived on the host from the input shapes when a binding is
    first seen, so the run has no fallback and no device-to-host read; so is a
    ``ConstantOfShape(Shape(x))``'s shape (its sizing input is its first)."""
    nodes = [
        helper.make_node("Shape", ["x"], ["s"]),
        helper.make_node("Gather", ["s", "one"], ["n"], axis=0),
        helper.make_node("Range", ["zero", "n", "step"], ["r"]),
        helper.make_node("Cast", ["r"], ["rf"], to=TensorProto.FLOAT),
        helper.make_node("Add", ["x", "rf"], ["xr"]),
        helper.make_node("ConstantOfShape", ["s"], ["c"], value=numpy_helper.from_array(np.array([1.5], np.float32))),
        helper.make_node("Mul", ["xr", "c"], ["y"]),
    ]
    inits = [numpy_helper.from_array(np.array(v, np.int64), k) for k, v in (("one", 1), ("zero", 0), ("step", 1))]
    model = helper.make_model(helper.make_graph(
        nodes, "ranged", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["b", "n"])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)], inits),
        opset_imports=[helper.make_opsetid("", 17)])
    compiled = _cuda(model, device="emulator", rewrite=False)
    assert compiled.report()["fallbacks"] == []
    for shape in ((2, 5), (3, 9)):
        x = np.random.default_rng(0).normal(size=shape).astype(np.float32)
        np.testing.assert_allclose(compiled.run({"x": x})["y"], _ort(model, {"x": x})[0], rtol=1e-6)


def test_egraft_run_checks_the_cuda_build_on_the_emulated_device(tmp_path):
    """``egraft run --backend cuda-emulated --check``: the CUDA build's numbers against
    onnxruntime from the command line; ``--backend cuda`` without a GPU is one error line."""
    from typer.testing import CliRunner

    from egraft.cli import app

    runner = CliRunner()
    model = tmp_path / "small.onnx"
    onnx.save(_small_cnn(), model)
    if shutil.which("g++") is not None:
        result = runner.invoke(app, ["run", str(model), "--shape", "batch=2", "--backend", "cuda-emulated", "--check"])
        assert result.exit_code == 0, result.output
        assert "compiled for sm_90" in result.output and "0 ops on the host" in result.output
    if _gpu_count() == 0:
        result = runner.invoke(app, ["run", str(model), "--shape", "batch=1", "--backend", "cuda"])
        assert result.exit_code != 0 and "no CUDA device" in result.output and "Traceback" not in result.output


@needs_gxx
def test_a_large_product_with_nothing_to_fuse_goes_to_cublas(monkeypatch):
    """A plain MatMul and Gemm large enough run on cuBLAS (``cupy.matmul``; numpy on the emulated
    device) and match onnxruntime; a product with a fused epilogue, or ``EGRAFT_CUBLAS=0``,
    keeps the generated tile loop."""
    rng = np.random.default_rng(0)
    w1 = numpy_helper.from_array(rng.normal(0, 0.05, (256, 512)).astype(np.float32), "w1")
    w2 = numpy_helper.from_array(rng.normal(0, 0.05, (384, 512)).astype(np.float32), "w2")
    nodes = [helper.make_node("MatMul", ["x", "w1"], ["h"]),
             helper.make_node("Reshape", ["h", "flat"], ["h2"]),
             helper.make_node("Gemm", ["h2", "w2"], ["y"], transB=1)]
    flat = numpy_helper.from_array(np.array([-1, 512], np.int64), "flat")
    model = helper.make_model(helper.make_graph(
        nodes, "products", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["b", 256, 256])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)], [w1, w2, flat]),
        opset_imports=[helper.make_opsetid("", 17)])
    compiled = _cuda(model, device="emulator", rewrite=False)
    functions = [k["function"] for k in compiled.report()["kernels"]]
    assert functions == ["library:matmul", "library:matmul"], functions
    for batch in (2, 3):
        x = rng.normal(size=(batch, 256, 256)).astype(np.float32)
        np.testing.assert_allclose(compiled.run({"x": x})["y"], _ort(model, {"x": x})[0], rtol=1e-4, atol=1e-5)
    monkeypatch.setenv("EGRAFT_CUBLAS", "0")
    tiled = _cuda(model, device="emulator", rewrite=False, use_cache=False)
    assert [k["function"] for k in tiled.report()["kernels"]] == ["eg_matmul", "eg_gemm"]


def test_extraction_prices_cublas_apart_from_the_fused_tile_loop():
    """On the cuda profile a plain product runs on cuBLAS (0.75 of the peak) and a fused one on
    egraft's tile loop (0.36): a large MatMul + bias + ReLU extracts unfused (cuBLAS, then one
    elementwise pass), a small one fused (one launch); on the CPU both fuse (one GEMM library,
    epilogue in registers)."""
    from egraft.optimize import optimize

    def model(m: int, k: int, n: int) -> onnx.ModelProto:
        rng = np.random.default_rng(0)
        inits = [numpy_helper.from_array(rng.normal(size=(k, n)).astype(np.float32), "w"),
                 numpy_helper.from_array(rng.normal(size=(n,)).astype(np.float32), "b")]
        nodes = [helper.make_node("MatMul", ["x", "w"], ["p"]), helper.make_node("Add", ["p", "b"], ["s"]),
                 helper.make_node("Relu", ["s"], ["y"])]
        return helper.make_model(helper.make_graph(
            nodes, "linear", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [m, k])],
            [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)], inits),
            opset_imports=[helper.make_opsetid("", 17)])

    def ops(m, k, n, target):
        graph = optimize(egraft.load(model(m, k, n)), cost="roofline", target=target).graph
        return sorted(node.op for node in graph.nodes)

    assert "MatMul" in ops(4096, 2048, 2048, "cuda") and "FusedMatMul" not in ops(4096, 2048, 2048, "cuda")
    assert ops(8, 64, 64, "cuda") == ["FusedMatMul"]
    assert ops(4096, 2048, 2048, "cpu") == ["FusedMatMul"]


@needs_gxx
@pytest.mark.parametrize("name", ["squeezenet", "shufflenet"])
def test_a_bundled_model_runs_on_the_emulated_device_as_onnxruntime_does(name):
    """A whole bundled CNN (re-weighted, its logits an output) through its CUDA build on the
    emulated device: SqueezeNet's fire modules and Concats written in place, ShuffleNet's
    grouped convolutions and channel shuffles. The other seven: ``benchmarks/cuda_compile.py
    --emulate``."""
    from egraft.testing.models import reweight, softmax_logits, with_outputs

    proto = onnx.load(light_model_path(name))
    model = with_outputs(reweight(proto, seed=0), softmax_logits(proto))
    compiled = _cuda(model, device="emulator")
    _assert_all_compiled(compiled, name)
    graph = egraft.load(model)
    feeds = {v.name: np.random.default_rng(1).normal(size=[int(d) for d in v.type.shape]).astype(np.float32)
             for v in graph.inputs}
    got = compiled.run(feeds)
    for output, expected in zip([o.name for o in model.graph.output], _ort(model, feeds)):
        np.testing.assert_allclose(got[output], expected, rtol=1e-4, atol=1e-5 * np.abs(expected).max(),
                                   err_msg=output)


@needs_gxx
def test_values_of_unknown_rank_stay_on_the_host_with_the_steps_that_read_them():
    """An If whose branches differ in rank (silero's decoders): its output has no rank until it
    runs, so it lives on the host and the Relu that reads it runs its reference kernel too;
    the rest of the model runs on the device."""
    then_branch = helper.make_graph([helper.make_node("Unsqueeze", ["x2", "zero_axis"], ["t"])], "then", [],
                                    [helper.make_tensor_value_info("t", TensorProto.FLOAT, None)])
    else_branch = helper.make_graph([helper.make_node("Identity", ["x2"], ["e"])], "else", [],
                                    [helper.make_tensor_value_info("e", TensorProto.FLOAT, None)])
    nodes = [
        helper.make_node("Mul", ["x", "two"], ["x2"]),
        helper.make_node("ReduceSum", ["x"], ["total"], keepdims=0),
        helper.make_node("Greater", ["total", "zero"], ["positive"]),
        helper.make_node("If", ["positive"], ["branch"], then_branch=then_branch, else_branch=else_branch),
        helper.make_node("Relu", ["branch"], ["y"]),
    ]
    inits = [numpy_helper.from_array(np.array(2.0, np.float32), "two"),
             numpy_helper.from_array(np.array(0.0, np.float32), "zero"),
             numpy_helper.from_array(np.array([0], np.int64), "zero_axis")]
    model = helper.make_model(helper.make_graph(
        nodes, "ranks", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n"])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)], inits),
        opset_imports=[helper.make_opsetid("", 17)])
    compiled = _cuda(model, device="emulator", rewrite=False)
    assert {f["op"] for f in compiled.report()["fallbacks"]} >= {"If"}
    for x in (np.array([1.0, -0.5, 2.0], np.float32), np.array([-1.0, -0.5, 0.25, 0.1], np.float32)):
        got = compiled.run({"x": x})["y"]
        want = _ort(model, {"x": x})[0]
        assert got.shape == want.shape
        np.testing.assert_allclose(got, want, rtol=1e-6)

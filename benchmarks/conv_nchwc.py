"""The blocked direct convolution (``com.egraft::ConvNCHWc``, egraft/kernels/cpu/conv_nchwc.py)
against egraft's standard NCHW ``Conv`` kernel (products through egraft_sgemm,
egraft/kernels/cpu/conv_gemm.py), at 1 thread, on ResNet-50 and VGG convolutions (batch 1,
bias, no activation).

Each variant is one compiled one-node model; "call" times whole model calls (input checks,
a fresh output array), "kernel" the convolution step alone (from the call's profile), both
medians of rounds that run every variant once (so a slow spell of the shared machine hits
them alike). "numpy GEMM" is OpenBLAS's product of the same shape (M = output channels,
N = output pixels, K = input channels x kernel area) on a ready im2col matrix, in the same
rounds: the convolution's work as a bare GEMM, without the im2col egraft's kernels never
build. GFLOP/s count a multiply-add as 2; the ratios are NCHWc's kernel over the others.

Run: python benchmarks/conv_nchwc.py [--repeat 7] [--threads 1] [--only res5 vgg]
"""

from __future__ import annotations

import os

for _var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ[_var] = "1"
os.environ.pop("OPENBLAS_CORETYPE", None)  # it pins OpenBLAS to an older, slower kernel

import argparse  # noqa: E402
import math  # noqa: E402
import statistics  # noqa: E402

import numpy as np  # noqa: E402
import onnx  # noqa: E402
from onnx import TensorProto, helper, numpy_helper  # noqa: E402
from rich.console import Console  # noqa: E402
from rich.table import Table  # noqa: E402

import egraft  # noqa: E402
from egraft.ir.ops.layout import DOMAIN, to_blocked  # noqa: E402
from egraft.kernels.cpu.llvm import host_cpu  # noqa: E402
from egraft.lowering.compile import compile_graph  # noqa: E402
from egraft.testing.bench import temporary_cache  # noqa: E402
from egraft.testing.timing import interleaved_medians_ms  # noqa: E402

#: (name, C, M, H = W, kernel, pad, stride)
SHAPES = [
    ("res2 3x3 64", 64, 64, 56, 3, 1, 1),
    ("res3 3x3 128", 128, 128, 28, 3, 1, 1),
    ("res4 3x3 256", 256, 256, 14, 3, 1, 1),
    ("res5 3x3 512", 512, 512, 7, 3, 1, 1),
    ("res2 1x1 64->64", 64, 64, 56, 1, 0, 1),
    ("res2 1x1 64->256", 64, 256, 56, 1, 0, 1),
    ("res2 1x1 256->64", 256, 64, 56, 1, 0, 1),
    ("res5 1x1 512->2048", 512, 2048, 7, 1, 0, 1),
    ("vgg 3x3 64 224", 64, 64, 224, 3, 1, 1),
]


def conv_model(op: str, x_dims: list[int], w: np.ndarray, b: np.ndarray, pad: int, stride: int) -> onnx.ModelProto:
    """``y = op(x, w, b)`` (``Conv`` or ``ConvNCHWc``) with the weights and bias as initializers."""
    attrs = {"pads": [pad] * 4, "strides": [stride] * 2}
    node = helper.make_node(op, ["x", "w", "b"], ["y"], domain=DOMAIN if op == "ConvNCHWc" else "", **attrs)
    graph = helper.make_graph([node], op, [helper.make_tensor_value_info("x", TensorProto.FLOAT, x_dims)],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
                              [numpy_helper.from_array(w, "w"), numpy_helper.from_array(b, "b")])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18), helper.make_opsetid(DOMAIN, 1)])


class Timed:
    """One compiled variant: calling it runs the model once and records its kernel step's time."""

    def __init__(self, model: onnx.ModelProto, x: np.ndarray, threads: int):
        self.compiled = compile_graph(egraft.load(model))
        self.compiled.threads = threads
        (step,) = self.compiled.steps
        assert step.kind == "kernel", step.reason
        self.feeds = {"x": x}
        self.kernel_ms: list[float] = []

    def __call__(self) -> np.ndarray:
        profile: list = []
        y = self.compiled.run(self.feeds, profile=profile)["y"]
        (step,) = [t for t in profile if t.kind == "kernel"]
        self.kernel_ms.append((step.end_ns - step.start_ns) / 1e6)
        return y


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeat", type=int, default=7)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--only", nargs="*", default=[], help="shapes whose name contains one of these")
    args = parser.parse_args()
    temporary_cache()
    table = Table(title=f"Convolutions at {args.threads} thread(s), GFLOP/s (medians of {args.repeat}, "
                        f"{host_cpu()[1]}): blocked NCHWc direct kernel vs NCHW Conv (products)")
    for col in ("shape", "C -> M, HxW, k/s", "NCHW call", "NCHWc call", "NCHW kernel", "NCHWc kernel",
                "numpy GEMM", "NCHWc/NCHW kernel", "NCHWc/numpy"):
        table.add_column(col, justify="left" if col == "shape" else "right")
    rng = np.random.default_rng(0)
    ratios, to_numpy = [], []
    for name, c, m, size, k, pad, stride in SHAPES:
        if args.only and not any(word in name for word in args.only):
            continue
        x = rng.standard_normal((1, c, size, size), dtype=np.float32)
        w = rng.standard_normal((m, c, k, k), dtype=np.float32) / math.sqrt(c * k * k)
        b = rng.standard_normal(m, dtype=np.float32)
        nchw = Timed(conv_model("Conv", list(x.shape), w, b, pad, stride), x, args.threads)
        xb = to_blocked(x, 8)
        nchwc = Timed(conv_model("ConvNCHWc", list(xb.shape), w, b, pad, stride), xb, args.threads)
        want = nchw()
        got = nchwc()
        assert np.abs(to_blocked(want, 8) - got).max() <= 1e-4 * np.abs(want).max(), name
        nchw.kernel_ms.clear()
        nchwc.kernel_ms.clear()
        out = (size + 2 * pad - k) // stride + 1
        weights = w.reshape(m, c * k * k)
        columns = rng.standard_normal((c * k * k, out * out), dtype=np.float32)
        product = np.empty((m, out * out), np.float32)
        calls = interleaved_medians_ms({"nchw": nchw, "nchwc": nchwc,
                                        "numpy": lambda: np.matmul(weights, columns, out=product)}, args.repeat)
        gflop = 2.0 * m * out * out * c * k * k / 1e9
        kernel_nchw = gflop / (statistics.median(nchw.kernel_ms) / 1e3)
        kernel_nchwc = gflop / (statistics.median(nchwc.kernel_ms) / 1e3)
        numpy_gemm = gflop / (calls["numpy"] / 1e3)
        ratios.append(kernel_nchwc / kernel_nchw)
        to_numpy.append(kernel_nchwc / numpy_gemm)
        table.add_row(name, f"{c} -> {m}, {size}x{size}, {k}x{k}/{stride}", f"{gflop / (calls['nchw'] / 1e3):.1f}",
                      f"{gflop / (calls['nchwc'] / 1e3):.1f}", f"{kernel_nchw:.1f}", f"{kernel_nchwc:.1f}",
                      f"{numpy_gemm:.1f}", f"{kernel_nchwc / kernel_nchw:.2f}", f"{kernel_nchwc / numpy_gemm:.2f}")
    table.add_section()

    def geomean(xs: list[float]) -> str:
        return f"{math.exp(sum(math.log(r) for r in xs) / len(xs)):.2f}"

    table.add_row("geometric mean", "", "", "", "", "", "", geomean(ratios), geomean(to_numpy))
    Console(width=160).print(table)


if __name__ == "__main__":
    main()

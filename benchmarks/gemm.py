"""fp32 GEMM throughput at 1 thread: egraft's compiled MatMul (egraft_sgemm) against numpy
(OpenBLAS) and onnxruntime, for square sizes and for ResNet-50's convolutions seen as
GEMMs (M = output channels, N = output pixels, K = input channels x kernel area), with
this machine's FMA peak measured by the same script (a generated loop of 12 independent
vector FMA chains at the host's vector width); then egraft at 2 threads and its speedup.
"egraft" times whole compiled-model calls (input checks, a fresh output array); "kernel"
times the MatMul kernel's own step (from the call's profile).
GFLOP/s are medians; ratios are egraft's over the peer's. numpy and onnxruntime run at
1 thread throughout (OPENBLAS_NUM_THREADS is fixed when numpy loads).

Run: python benchmarks/gemm.py [--repeat 5] [--sizes 256 512 1024 2048]
"""

from __future__ import annotations

import os

os.environ.pop("OPENBLAS_CORETYPE", None)  # it pins OpenBLAS to an older, slower kernel
for _var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ[_var] = "1"

import argparse  # noqa: E402
import ctypes  # noqa: E402
import math  # noqa: E402
import statistics  # noqa: E402

import numpy as np  # noqa: E402
import onnxruntime as ort  # noqa: E402
from onnx import TensorProto, helper  # noqa: E402
from rich.console import Console  # noqa: E402
from rich.table import Table  # noqa: E402

import egraft  # noqa: E402
from egraft.kernels.cpu.llvm import JitModule, host_cpu, host_vector_bits  # noqa: E402
from egraft.lowering.compile import compile_graph  # noqa: E402
from egraft.testing.timing import median_ms  # noqa: E402

#: ResNet-50's convolutions at batch 1 as (name, M, N, K).
RESNET50_GEMMS = [
    ("conv1 7x7/2", 64, 112 * 112, 3 * 49),
    ("res2 1x1 64", 64, 56 * 56, 64),
    ("res2 3x3 64", 64, 56 * 56, 64 * 9),
    ("res2 1x1 256", 256, 56 * 56, 64),
    ("res3 3x3 128", 128, 28 * 28, 128 * 9),
    ("res4 3x3 256", 256, 14 * 14, 256 * 9),
    ("res5 3x3 512", 512, 7 * 7, 512 * 9),
    ("res5 1x1 2048", 2048, 7 * 7, 512),
]

FMA_CHAINS = 12


def fma_peak_gflops(repeat: int) -> float:
    """GFLOP/s of ``FMA_CHAINS`` independent vector FMA chains (a multiply-add counts 2)."""
    width = host_vector_bits() // 32
    vec = f"<{width} x float>"
    lines = [f"declare {vec} @llvm.fma.v{width}f32({vec}, {vec}, {vec})",
             "define void @fma_loop(i64 %n, float* %out) {",
             "entry:", "  br label %loop", "loop:",
             "  %i = phi i64 [0, %entry], [%next, %loop]"]
    for c in range(FMA_CHAINS):
        lines.append(f"  %a{c} = phi {vec} [zeroinitializer, %entry], [%b{c}, %loop]")
    splat = f"<{width} x float> <" + ", ".join(["float 0x3FF0000000000000"] * width) + ">"
    small = f"<{width} x float> <" + ", ".join(["float 0x3EB0C6F7A0000000"] * width) + ">"
    for c in range(FMA_CHAINS):
        lines.append(f"  %b{c} = call {vec} @llvm.fma.v{width}f32({vec} %a{c}, {splat}, {small})")
    lines += ["  %next = add i64 %i, 1", "  %done = icmp eq i64 %next, %n", "  br i1 %done, label %end, label %loop",
              "end:"]
    total = "%b0"
    for c in range(1, FMA_CHAINS):
        lines.append(f"  %s{c} = fadd {vec} {total}, %b{c}")
        total = f"%s{c}"
    lines += [f"  %lane = extractelement {vec} {total}, i32 0", "  store float %lane, float* %out",
              "  ret void", "}"]
    module = JitModule(f'target triple = "{host_cpu()[0]}"\n' + "\n".join(lines), use_cache=False)
    function = ctypes.CFUNCTYPE(None, ctypes.c_int64, ctypes.c_void_p)(module.address("fma_loop"))
    out = np.zeros(1, np.float32)
    iterations = 20_000_000
    ms = median_ms(lambda: function(iterations, out.ctypes.data), repeat)
    return iterations * FMA_CHAINS * width * 2 / (ms * 1e-3) / 1e9


def kernel_ms(compiled, feeds: dict, repeat: int) -> float:
    """Milliseconds of the MatMul kernel's own step (the call's profile), without the
    call's input checks and output allocation: the median of ``repeat`` runs."""
    compiled.run(feeds)
    times = []
    for _ in range(repeat):
        profile: list = []
        compiled.run(feeds, profile=profile)
        (step,) = [t for t in profile if t.kind == "kernel"]
        times.append((step.end_ns - step.start_ns) / 1e6)
    return statistics.median(times)


def matmul_model(m: int, n: int, k: int):
    graph = helper.make_graph([helper.make_node("MatMul", ["a", "b"], ["y"])], "gemm",
                              [helper.make_tensor_value_info("a", TensorProto.FLOAT, [m, k]),
                               helper.make_tensor_value_info("b", TensorProto.FLOAT, [k, n])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [m, n])])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--sizes", type=int, nargs="*", default=[256, 512, 1024, 2048])
    args = parser.parse_args()
    peak = fma_peak_gflops(args.repeat)
    cases = [(f"{s}^3", s, s, s) for s in args.sizes] + RESNET50_GEMMS
    table = Table(title=f"fp32 GEMM at 1 thread, GFLOP/s (median of {args.repeat}); FMA peak {peak:.1f} GFLOP/s "
                        f"({host_cpu()[1]}, {host_vector_bits()}-bit vectors)")
    for col in ("shape", "M x N x K", "egraft", "kernel", "numpy", "onnxruntime", "egraft/numpy", "kernel/numpy",
                "egraft/ort", "egraft/peak", "egraft 2 threads", "2 threads / 1"):
        table.add_column(col, justify="left" if col == "shape" else "right")
    options = ort.SessionOptions()
    options.intra_op_num_threads = 1
    options.inter_op_num_threads = 1
    options.log_severity_level = 3
    ratios, kernel_ratios, speedups = [], [], []
    rng = np.random.default_rng(0)
    for name, m, n, k in cases:
        a = rng.standard_normal((m, k), dtype=np.float32)
        b = rng.standard_normal((k, n), dtype=np.float32)
        model = matmul_model(m, n, k)
        compiled = compile_graph(egraft.load(model))
        compiled.threads = 1
        got = compiled.run({"a": a, "b": b})["y"]
        want = a @ b
        assert np.abs(got - want).max() <= 1e-4 * np.abs(want).max() * math.sqrt(k), name
        session = ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
        out = np.empty((m, n), np.float32)
        flops = 2.0 * m * n * k
        ours = flops / median_ms(lambda: compiled.run({"a": a, "b": b}), args.repeat) / 1e6
        kernel = flops / kernel_ms(compiled, {"a": a, "b": b}, args.repeat) / 1e6
        blas = flops / median_ms(lambda: np.matmul(a, b, out=out), args.repeat) / 1e6
        theirs = flops / median_ms(lambda: session.run(None, {"a": a, "b": b}), args.repeat) / 1e6
        compiled.threads = 2
        two = flops / median_ms(lambda: compiled.run({"a": a, "b": b}), args.repeat) / 1e6
        ratios.append(ours / blas)
        kernel_ratios.append(kernel / blas)
        speedups.append(two / ours)
        table.add_row(name, f"{m} x {n} x {k}", f"{ours:.1f}", f"{kernel:.1f}", f"{blas:.1f}", f"{theirs:.1f}",
                      f"{ours / blas:.2f}", f"{kernel / blas:.2f}", f"{ours / theirs:.2f}", f"{ours / peak:.2f}",
                      f"{two:.1f}", f"{two / ours:.2f}")
    table.add_section()
    geomean = math.exp(sum(math.log(r) for r in ratios) / len(ratios))
    speedup = math.exp(sum(math.log(r) for r in speedups) / len(speedups))
    kernel_geomean = math.exp(sum(math.log(r) for r in kernel_ratios) / len(kernel_ratios))
    table.add_row("geometric mean", "", "", "", "", "", f"{geomean:.2f}", f"{kernel_geomean:.2f}", "", "", "",
                  f"{speedup:.2f}")
    Console(width=200).print(table)


if __name__ == "__main__":
    main()

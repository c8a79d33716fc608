"""Compile time and latency of egraft's compiled CPU code against onnxruntime, per light
model and the test encoder, at 1 thread, in one run.

Per model (compiled from an .onnx file, as `egraft compile` does): the first compile
(rewrite + lower + LLVM -O3, with an empty cache), the second compile (from the cache),
how many nodes run on generated code and on reference kernels, the median latency of
egraft and of onnxruntime (ORT_ENABLE_ALL, 1 intra-op thread) on the same inputs, and
their ratio. Outputs are checked against onnxruntime on re-weighted weights first
(scale-relative error), so a fast wrong answer cannot hide.

Run: python benchmarks/compile_latency.py [--repeat 10] [--models resnet50 ...]
"""

from __future__ import annotations

import argparse
import math
import os
import time

os.environ.setdefault("OMP_NUM_THREADS", "1")

import onnx  # noqa: E402
from rich.console import Console  # noqa: E402
from rich.table import Table  # noqa: E402

import egraft  # noqa: E402
from egraft.testing.bench import ZOO, ort_session, reference_outputs, temporary_cache, zoo_model  # noqa: E402
from egraft.testing.models import scale_relative_error  # noqa: E402
from egraft.testing.timing import median_ms  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeat", type=int, default=10)
    parser.add_argument("--models", nargs="*", default=None)
    args = parser.parse_args()
    names = args.models or list(ZOO)
    folder = temporary_cache()
    table = Table(title=f"egraft compiled (1 thread) vs onnxruntime (1 thread): median of {args.repeat} runs")
    for col in ("model", "compile s", "cached s", "kernels", "fallbacks", "error", "egraft ms", "ort ms",
                "egraft/ort"):
        table.add_column(col, justify="left" if col == "model" else "right")
    ratios = []
    for name in names:
        model, feeds = zoo_model(name)
        path = folder / f"{name}.onnx"
        onnx.save(model, path)  # compiled from a file, as `egraft compile` does
        t = time.perf_counter()
        compiled = egraft.compile(path)
        first = time.perf_counter() - t
        t = time.perf_counter()
        egraft.compile(path)
        second = time.perf_counter() - t
        compiled.threads = 1  # the table compares at 1 thread (egraft defaults to every core)
        report = compiled.report()
        session = ort_session(model, threads=1)
        want = reference_outputs(model, feeds)
        got = compiled.run(feeds)
        error = max(scale_relative_error(got[k], v) for k, v in want.items())
        ours = median_ms(lambda: compiled.run(feeds), args.repeat)
        theirs = median_ms(lambda: session.run(None, feeds), args.repeat)
        ratios.append(ours / theirs)
        table.add_row(name, f"{first:.2f}", f"{second:.3f}", str(report.kernels), str(len(report.fallbacks)),
                      f"{error:.1e}", f"{ours:.2f}", f"{theirs:.2f}", f"{ours / theirs:.2f}")
    table.add_section()
    geomean = math.exp(sum(math.log(r) for r in ratios) / len(ratios))
    table.add_row("geometric mean", "", "", "", "", "", "", "", f"{geomean:.2f}")
    Console(width=150).print(table)


if __name__ == "__main__":
    main()

"""egraft against onnxruntime on the zoo (the light models and the test encoder), at 1 and
2 threads in the same run, and what each rule family is worth.

Per model: the median latency of egraft's compiled code and of onnxruntime
(ORT_ENABLE_ALL) at each ``--threads`` count (egraft: ``CompiledModel.threads``;
onnxruntime: ``intra_op_num_threads``), their ratio, and egraft compiled with the
``fusion`` rules off and with the ``layout`` rules off (at the first thread count), each
with its ratio to full egraft (above 1: the rule family makes the model faster). Every
compiled variant's outputs are checked against onnxruntime first (basic optimizations,
re-weighted weights, scale-relative error), so a fast wrong answer cannot hide: an error
above 1e-3 is flagged. The last row is the geometric mean of every ratio column.

Run: python benchmarks/zoo.py [--repeat 10] [--models resnet50 encoder] [--threads 1 2]
"""

from __future__ import annotations

import argparse
import math
import os
from functools import partial
from pathlib import Path

for _var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):  # numpy stays out of the way
    os.environ.setdefault(_var, "1")

import onnx  # noqa: E402
from rich.console import Console  # noqa: E402
from rich.table import Table  # noqa: E402

import egraft  # noqa: E402
from egraft.testing.bench import ZOO, ort_session, reference_outputs, temporary_cache, zoo_model  # noqa: E402
from egraft.testing.models import LIGHT_MODELS, scale_relative_error  # noqa: E402
from egraft.testing.timing import interleaved_medians_ms, median_ms  # noqa: E402

#: Rule families switched off one at a time (column name -> ``rules_off``).
ABLATIONS = {"no fusion": ["fusion"], "no layout": ["layout"]}
#: Scale-relative error above which a model's outputs are called wrong.
TOLERANCE = 1e-3


def geomean(values: list[float]) -> float:
    """The geometric mean (``nan`` for no values)."""
    return math.exp(sum(math.log(v) for v in values) / len(values)) if values else math.nan


def bench_model(name: str, threads: list[int], repeat: int, folder: Path) -> dict:
    """One row: the worst error of the compiled variants, and every timing in ms."""
    model, feeds = zoo_model(name)
    path = folder / f"{name}.onnx"
    onnx.save(model, path)  # compiled from a file, as `egraft compile` does
    want = reference_outputs(model, feeds)
    variants = {"full": egraft.compile(path)}
    variants.update({label: egraft.compile(path, rules_off=off) for label, off in ABLATIONS.items()})
    error = 0.0
    for compiled in variants.values():
        got = compiled.run(feeds)
        error = max(error, *(scale_relative_error(got[k], v) for k, v in want.items()))
    row: dict = {"error": error}
    full = variants["full"]
    for n in threads:
        for compiled in variants.values():
            compiled.threads = n
        if n == threads[0]:  # the ablations in the same rounds as the full build
            times = interleaved_medians_ms({label: lambda c=c: c.run(feeds) for label, c in variants.items()}, repeat)
            row[("egraft", n)] = times.pop("full")
            row.update(times)
        else:
            row[("egraft", n)] = median_ms(lambda: full.run(feeds), repeat)
        # onnxruntime's session (and its spinning threads) exists only while it is timed
        row[("ort", n)] = median_ms(partial(ort_session(model, threads=n).run, None, feeds), repeat)
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeat", type=int, default=10, help="timed runs per measurement (median)")
    parser.add_argument("--models", nargs="*", default=None, help=f"default: {' '.join(ZOO)}")
    parser.add_argument("--threads", nargs="*", type=int, default=[1, 2], help="thread counts to compare")
    args = parser.parse_args()
    names = args.models or list(ZOO)
    folder = temporary_cache()
    first = args.threads[0]
    table = Table(title=f"egraft vs onnxruntime: median ms of {args.repeat} runs; ablations at {first} thread(s)")
    table.add_column("model")
    table.add_column("error", justify="right")
    for n in args.threads:
        for col in (f"egraft {n}t", f"ort {n}t", f"egraft/ort {n}t"):
            table.add_column(col, justify="right")
    for label in ABLATIONS:
        table.add_column(f"{label} ms", justify="right")
        table.add_column(f"{label}/full", justify="right")
    ratios: dict[str, list[float]] = {}
    light: dict[str, list[float]] = {}  # the nine light models (issue 6's goal is stated over them)
    console = Console(width=200)
    for name in names:
        console.print(f"{name}...", style="dim")
        row = bench_model(name, args.threads, args.repeat, folder)
        cells = [name, f"{row['error']:.1e}" + (" WRONG" if row["error"] > TOLERANCE else "")]
        for n in args.threads:
            ratio = row[("egraft", n)] / row[("ort", n)]
            ratios.setdefault(f"t{n}", []).append(ratio)
            if name in LIGHT_MODELS:
                light.setdefault(f"t{n}", []).append(ratio)
            cells += [f"{row[('egraft', n)]:.2f}", f"{row[('ort', n)]:.2f}", f"{ratio:.2f}"]
        for label in ABLATIONS:
            ratio = row[label] / row[("egraft", first)]
            ratios.setdefault(label, []).append(ratio)
            if name in LIGHT_MODELS:
                light.setdefault(label, []).append(ratio)
            cells += [f"{row[label]:.2f}", f"{ratio:.2f}"]
        table.add_row(*cells)
    table.add_section()
    for title, figures in (("geometric mean", ratios), ("geometric mean, light models", light)):
        if not figures:
            continue
        cells = [title, ""]
        for n in args.threads:
            cells += ["", "", f"{geomean(figures[f't{n}']):.2f}"]
        for label in ABLATIONS:
            cells += ["", f"{geomean(figures[label]):.2f}"]
        table.add_row(*cells)
    console.print(table)


if __name__ == "__main__":
    main()

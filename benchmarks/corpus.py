"""Every model of the real-model corpus (egraft/testing/corpus/manifest.toml) on both egraft
backends, at every binding of its dims, judged against onnxruntime.

Per model and binding: the scale-relative error (scale floored at 1e-3; integer outputs
exact) of the reference executor (``egraft.load(path).run``) and of the compiled model
(``egraft.compile(path)``, built once into a temporary cache, then ``.run``), the compiled
model's nodes left on reference kernels (fallbacks), the compile time, and pass/fail
against the entry's tolerance (default 1e-3; a looser one cites the "ort vs itself" column:
onnxruntime against itself with float inputs and weights moved one ulp). Each model and backend runs in its own
process with a time limit, so an exception, a crash or a hang is a failed row with the
error's first line (and the egraft file:line it came from, listed under the table),
never the end of the run. Missing models are fetched first.

Run: python benchmarks/corpus.py [--only NAME...] [--fast] [--json FILE] [--timeout 900]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

for _var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):  # numpy stays out of the way
    os.environ.setdefault(_var, "1")

from egraft.testing.bench import temporary_cache  # noqa: E402
from egraft.testing.corpus import entries, fetch, make_feeds, model_path  # noqa: E402
from egraft.testing.corpus.compare import ort_sensitivity  # noqa: E402
from egraft.testing.corpus.run import ALL_BACKENDS, BACKENDS, Result, run_model  # noqa: E402

MARK = "@@corpus-result@@"
#: Rows whose error is above this also show how far onnxruntime moves from itself on data
#: nudged by one ulp (``ort_sensitivity``): the measure a looser tolerance cites.
DEFAULT_TOLERANCE = 1e-3


def _worker(name: str, backend: str, seed: int) -> int:
    results = run_model(name, backend, seed=seed)
    print(MARK + json.dumps([r.as_dict() for r in results]), flush=True)
    return 0


def _run_isolated(e, backend: str, seed: int, timeout: float) -> list[Result]:
    command = [sys.executable, __file__, "--worker", e.name, backend, "--seed", str(seed)]
    start = time.perf_counter()
    base = dict(model=e.name, backend=backend, tolerance=e.tolerance)
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return [
            Result(
                **base,
                binding=b.label,
                failure=f"Timeout: no result after {timeout:.0f} s",
                compile_seconds=time.perf_counter() - start,
            )
            for b in e.bindings
        ]
    for line in done.stdout.splitlines():
        if line.startswith(MARK):
            fields = json.loads(line[len(MARK) :])
            return [Result(**{k: v for k, v in f.items() if k != "passed"}) for f in fields]
    tail = (done.stderr.strip().splitlines() or ["(no output)"])[-1]
    return [Result(**base, binding=b.label, failure=f"Crash: exit code {done.returncode}: {tail}") for b in e.bindings]


def _error_cell(r: Result | None) -> str:
    if r is None:
        return "-"
    if r.failure:
        return "FAIL " + r.failure.split(":")[0]
    return f"{r.error:.2e}" + ("" if r.passed else " >tol")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", nargs="+", metavar="NAME", help="these models only")
    parser.add_argument("--fast", action="store_true", help="the fast (CI) subset only")
    parser.add_argument("--backends", nargs="+", default=list(BACKENDS), choices=ALL_BACKENDS,
                        help="cuda-emulated: the CUDA build on the emulated device (slow)")
    parser.add_argument("--json", metavar="FILE", help="also write every result as JSON")
    parser.add_argument("--seed", type=int, default=0, help="seed of the generated inputs (default 0)")
    parser.add_argument("--timeout", type=float, default=900, help="seconds per model and backend (default 900)")
    parser.add_argument("--worker", nargs=2, metavar=("NAME", "BACKEND"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        sys.exit(_worker(*args.worker, args.seed))

    chosen = entries(args.only, fast=args.fast)
    fetch([e.name for e in chosen], progress=lambda line: print(line, file=sys.stderr))
    temporary_cache()
    results: list[Result] = []
    for e in chosen:
        for backend in args.backends:
            start = time.perf_counter()
            rows = _run_isolated(e, backend, args.seed, args.timeout)
            results.extend(rows)
            verdict = "ok" if all(r.passed for r in rows) else "FAIL"
            print(f"{e.name} {backend}: {verdict} ({time.perf_counter() - start:.0f} s)", file=sys.stderr, flush=True)

    from rich.console import Console
    from rich.table import Table

    table = Table(title="egraft on the real-model corpus (error: scale-relative vs onnxruntime basic, 1 thread)")
    built = [b for b in args.backends if b != "reference"]  # the backends that compile: fallbacks, seconds
    columns = ["model", "task", "exporter", "binding", *(f"{b} err" for b in args.backends)]
    for b in built:
        columns += [f"{b} fallbacks", f"{b} compile s"]
    columns += ["tolerance", "ort vs itself", "result"]
    for column in columns:
        table.add_column(column, justify="right" if column.endswith(("fallbacks", "compile s")) else "left")
    by_key = {(r.model, r.backend, r.binding): r for r in results}
    passed = total = 0
    for e in chosen:
        for b in e.bindings:
            runs = {backend: by_key.get((e.name, backend, b.label)) for backend in args.backends}
            ran = [r for r in runs.values() if r is not None]
            ok = all(r.passed for r in ran)
            passed += sum(r.passed for r in ran)
            total += len(ran)
            cells = [_error_cell(runs[backend]) for backend in args.backends]
            for backend in built:
                r = runs[backend]
                cells.append(str(r.fallbacks) if r and r.fallbacks is not None else "-")
                cells.append(f"{r.compile_seconds:.1f}" if r and r.compile_seconds is not None else "-")
            errors = [r.error for r in ran if r.error is not None]
            itself = "-"
            if errors and max(errors) > DEFAULT_TOLERANCE:  # is the model this sensitive to rounding?
                itself = f"{ort_sensitivity(model_path(e.name), make_feeds(e, b, args.seed)):.2e}"
            table.add_row(e.name, e.task, e.exporter, b.label, *cells, f"{e.tolerance:g}", itself,
                          "pass" if ok else "FAIL")
    console = Console(width=220)
    console.print(table)
    console.print(f"{passed} of {total} model/backend/binding runs pass")
    failures = {}
    for r in results:
        if r.failure:
            failures.setdefault((r.model, r.backend, r.failure, r.where), []).append(r.binding)
        elif not r.passed:
            failures.setdefault(
                (r.model, r.backend, f"error {r.error:.3g} > {r.tolerance:g} (output {r.worst})", None), []
            ).append(r.binding)
    if failures:
        console.print("Failures:")
        for (model, backend, failure, where), bindings in failures.items():
            console.print(
                f"  {model} [{backend}] {'; '.join(bindings)}: {failure}" + (f"  ({where})" if where else ""),
                markup=False,
                soft_wrap=True,
            )
    if args.json:
        with open(args.json, "w") as f:
            json.dump([r.as_dict() for r in results], f, indent=1)


if __name__ == "__main__":
    main()

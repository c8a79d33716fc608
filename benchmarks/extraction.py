"""Greedy against exact (ILP) extraction on every light model and the test encoder (and,
with ``--corpus``, the fetched real models): the cost each finds under each cost model,
their ratio, the ILP's status and gap, its size after pruning and the time each takes
(median of --repeat runs). Each model is saturated once with the shipped rules; both
extractors then read the same e-graph. Every ILP program is checked: its cost is priced
again by ``dag_cost`` and compared with what the extractor reported (``check``), and it is
never dearer than greedy's.

Issue 18 asks the ILP to finish within its 30 s on every bundled model; a row over the
time limit is marked with ✗. The machine's load average is printed with the table (the
times are wall-clock seconds, noisy on a shared machine).

Run: python benchmarks/extraction.py [--repeat 3] [--time-limit 30] [--models resnet50 ...]
                                     [--corpus [minimol_v1 t5_encoder_int8 ...]] [--no-bundled] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from collections.abc import Callable

import onnx
from rich.console import Console
from rich.table import Table

import egraft
from egraft.extract.cost import cost_model
from egraft.extract.extractor import extract
from egraft.extract.program import dag_cost, rebuild_outputs
from egraft.optimize import optimize
from egraft.testing.encoder import encoder_model
from egraft.testing.models import LIGHT_MODELS, light_model_path

COST_MODELS = (("nodes", None), ("flops", None), ("roofline", "cpu-host"), ("roofline", "cuda-h200"))


def models(names: list[str] | None, corpus: list[str] | None) -> list[tuple[str, str, Callable[[], onnx.ModelProto]]]:
    """(name, set, loader) of the models to run: the bundled ones (or ``names``) and, when
    ``corpus`` is given, those fetched corpus models (all of them for an empty list)."""
    found: list[tuple[str, str, Callable[[], onnx.ModelProto]]] = []
    for name in [*LIGHT_MODELS, "encoder"]:
        if names is None or name in names:
            found.append((name, "bundled", encoder_model if name == "encoder"
                          else lambda n=name: onnx.load(light_model_path(n))))
    if corpus is not None:
        from egraft.testing.corpus import CorpusError, entries, model_path

        for e in entries(corpus or None):
            try:
                path = model_path(e.name)
            except CorpusError:
                continue  # not fetched: `python -m egraft.testing.corpus fetch`
            found.append((e.name, "corpus", lambda p=path: onnx.load(str(p))))
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--time-limit", type=float, default=30.0)
    parser.add_argument("--models", nargs="*", default=None, help="bundled models to run (default: all)")
    parser.add_argument("--corpus", nargs="*", default=None, metavar="NAME",
                        help="fetched corpus models too (no name: every fetched one)")
    parser.add_argument("--no-bundled", action="store_true", help="skip the bundled models")
    parser.add_argument("--json", metavar="FILE", help="write the figures as JSON")
    args = parser.parse_args()
    names = [] if args.no_bundled else (args.models or None)
    table = Table(title=f"greedy vs exact extraction (times: median of {args.repeat} runs; ILP limit "
                        f"{args.time_limit:g} s; load average {os.getloadavg()[0]:.1f})")
    for col in ("model", "e-nodes", "cost model", "greedy", "ilp", "ilp/greedy", "status", "gap", "ILP vars",
                "pruned", "check", "greedy s", "ilp s"):
        table.add_column(col, justify="left" if col in ("model", "cost model", "status") else "right",
                         no_wrap=col in ("model", "cost model", "status"))
    console = Console(width=240)
    out: list[dict] = []
    for name, kind, load in models(names, args.corpus):
        result = optimize(egraft.load(load()))
        snapshot = result.snapshot
        roots = [c for c, _, _ in rebuild_outputs(snapshot)]
        for model_name, profile in COST_MODELS:
            cm = cost_model(model_name, profile)
            greedy_runs, ilp_runs = [], []
            greedy = exact = None
            for _ in range(args.repeat):
                t = time.perf_counter()
                greedy = extract(snapshot, cm, "greedy")
                greedy_runs.append(time.perf_counter() - t)
                t = time.perf_counter()
                exact = extract(snapshot, cm, "ilp", time_limit=args.time_limit)
                ilp_runs.append(time.perf_counter() - t)
            label = f"{model_name} ({profile})" if profile else model_name
            ratio = exact.cost / greedy.cost if greedy.cost else 1.0
            priced = dag_cost(snapshot, exact.choice, roots, exact.table)
            check = abs(priced - exact.cost) <= 1e-9 * max(1.0, abs(priced)) and exact.cost <= greedy.cost * (1 + 1e-12)
            ilp_s = statistics.median(ilp_runs)
            pruned = sum(exact.problem.get("pruned", {}).values())
            table.add_row(name, str(snapshot.num_nodes), label, f"{greedy.cost:.6g}", f"{exact.cost:.6g}",
                          f"{ratio:.4f}", exact.status, "" if exact.gap is None else f"{exact.gap:.2%}",
                          str(exact.problem.get("variables", "")), str(pruned), "✓" if check else "✗",
                          f"{statistics.median(greedy_runs):.2f}",
                          f"{ilp_s:.2f}" + (" ✗" if ilp_s > args.time_limit else ""))
            out.append({"model": name, "set": kind, "enodes": snapshot.num_nodes, "cost_model": label,
                        "greedy": greedy.cost, "ilp": exact.cost, "ratio": ratio, "status": exact.status,
                        "gap": exact.gap, "problem": exact.problem, "check": check,
                        "greedy_s": statistics.median(greedy_runs), "ilp_s": ilp_s})
        table.add_section()
    console.print(table)
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"time_limit": args.time_limit, "load": os.getloadavg()[0], "rows": out}, fh, indent=1,
                      default=str)


if __name__ == "__main__":
    main()

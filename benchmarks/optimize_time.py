"""Optimization time and plan cost per model: load into the e-graph, saturate with the
shipped rules, extract under the compile pipeline's defaults (roofline cost on this CPU's
profile, greedy extractor, no dims bound). Medians of --repeat runs, one table, for the
bundled models, the test encoder and (``--corpus``) every fetched real model.

``--json FILE`` keeps the figures; ``--before FILE`` (an earlier run's JSON) adds the
before/after columns: time ratio and plan cost ratio (a plan cost above 1.0 got dearer).

Run: python benchmarks/optimize_time.py [--repeat 3] [--corpus] [--json after.json] [--before before.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import onnx
from rich.console import Console
from rich.table import Table

import egraft
from egraft.optimize import optimize
from egraft.rewrite.load import load_rules
from egraft.testing.encoder import encoder_model
from egraft.testing.models import LIGHT_MODELS, light_model_path

#: what issue 18 asks: every bundled model within 3 s, every corpus model within 5 s
TARGET_BUNDLED, TARGET_CORPUS = 3.0, 5.0


def measure(model: onnx.ModelProto, repeat: int) -> dict:
    runs, result = [], None
    for _ in range(repeat):
        graph = egraft.load(model)
        start = time.perf_counter()
        result = optimize(graph, cost="roofline")
        runs.append({**result.seconds, "total": time.perf_counter() - start})
    figures = {k: statistics.median(r.get(k, 0.0) for r in runs) for k in ("load", "saturate", "extract", "total")}
    figures.update(nodes=len(result.source.nodes), after=len(result.graph.nodes), cost=result.extraction.cost,
                   iterations=result.saturation.iterations, stop=result.saturation.stop_reason,
                   enodes=result.saturation.nodes_after)
    return figures


def models(corpus: bool, only: list[str] | None):
    found = [(name, "bundled", lambda n=name: onnx.load(light_model_path(n))) for name in LIGHT_MODELS]
    found.append(("encoder", "bundled", encoder_model))
    if corpus:
        from egraft.testing.corpus import CorpusError, entries, model_path

        for e in entries():
            try:
                path = model_path(e.name)
            except CorpusError:
                continue  # not fetched: `python -m egraft.testing.corpus fetch`
            found.append((e.name, "corpus", lambda p=path: onnx.load(str(p))))
    return [m for m in found if not only or m[0] in only]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--corpus", action="store_true", help="the fetched real-model corpus too")
    parser.add_argument("--only", nargs="+", metavar="NAME")
    parser.add_argument("--json", metavar="FILE", help="write the figures as JSON")
    parser.add_argument("--before", metavar="FILE", help="an earlier --json run to compare with")
    args = parser.parse_args()
    before = json.load(open(args.before))["models"] if args.before else {}
    files = load_rules([], include_shipped=True)
    n_rules = sum(len(f.rules) for f in files)
    table = Table(title=f"egraft optimize ({n_rules} shipped rules, roofline cost, greedy): "
                        f"median of {args.repeat} runs (seconds)")
    columns = ["model", "set", "nodes", "after", "e-nodes", "saturate", "extract", "total", "target", "rounds", "stop",
               "plan cost"]
    if before:
        columns += ["total before", "time ratio", "cost ratio"]
    for col in columns:
        table.add_column(col, justify="left" if col in ("model", "set", "stop") else "right")
    out = {"rules": n_rules, "models": {}}
    for name, kind, load in models(args.corpus, args.only):
        f = measure(load(), args.repeat)
        out["models"][name] = f
        target = TARGET_BUNDLED if kind == "bundled" else TARGET_CORPUS
        row = [name, kind, str(f["nodes"]), str(f["after"]), str(f["enodes"]), f"{f['saturate']:.2f}",
               f"{f['extract']:.2f}", f"{f['total']:.2f}", f"≤ {target:.0f}" + ("" if f["total"] <= target else " ✗"),
               str(f["iterations"]), f["stop"], f"{f['cost']:.6g}"]
        if before:
            b = before.get(name)
            row += ([f"{b['total']:.2f}", f"{f['total'] / b['total']:.2f}", f"{f['cost'] / b['cost']:.4f}"] if b
                    else ["", "", ""])
        table.add_row(*row)
    Console(width=200).print(table)
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(out, fh, indent=1)


if __name__ == "__main__":
    main()

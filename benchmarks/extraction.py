"""Greedy against exact (ILP) extraction on every light model and the test encoder: the
cost each finds under each cost model, their ratio, the ILP's status and gap, and the
time each takes (median of --repeat runs). Each model is saturated once with the shipped
rules; both extractors then read the same e-graph.

Run: python benchmarks/extraction.py [--repeat 3] [--time-limit 30] [--models resnet50 ...]
"""

from __future__ import annotations

import argparse
import statistics
import time

import onnx
from rich.console import Console
from rich.table import Table

import egraft
from egraft.extract.cost import cost_model
from egraft.extract.extractor import extract
from egraft.optimize import optimize
from egraft.testing.encoder import encoder_model
from egraft.testing.models import LIGHT_MODELS, light_model_path

COST_MODELS = (("nodes", None), ("flops", None), ("roofline", "cpu-host"), ("roofline", "cuda-h200"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--time-limit", type=float, default=30.0)
    parser.add_argument("--models", nargs="*", default=None)
    args = parser.parse_args()
    names = args.models or [*LIGHT_MODELS, "encoder"]
    table = Table(title=f"greedy vs exact extraction (times: median of {args.repeat} runs)")
    for col in ("model", "e-nodes", "cost model", "greedy", "ilp", "ilp/greedy", "status", "gap", "ILP vars",
                "greedy s", "ilp s"):
        table.add_column(col, justify="left" if col in ("model", "cost model", "status") else "right")
    console = Console(width=160)
    for name in names:
        model = encoder_model() if name == "encoder" else onnx.load(light_model_path(name))
        result = optimize(egraft.load(model))
        snapshot = result.snapshot
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
            table.add_row(name, str(snapshot.num_nodes), label, f"{greedy.cost:.6g}", f"{exact.cost:.6g}",
                          f"{ratio:.4f}", exact.status, "" if exact.gap is None else f"{exact.gap:.2%}",
                          str(exact.problem.get("variables", "")), f"{statistics.median(greedy_runs):.2f}",
                          f"{statistics.median(ilp_runs):.2f}")
        table.add_section()
    console.print(table)


if __name__ == "__main__":
    main()

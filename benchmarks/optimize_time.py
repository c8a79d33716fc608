"""Optimization time per light model (and the test encoder): load into the e-graph,
saturate with the shipped rules, extract. Medians of --repeat runs, one table.

Run: python benchmarks/optimize_time.py [--repeat 3]
"""

from __future__ import annotations

import argparse
import statistics
import time

import onnx
from rich.console import Console
from rich.table import Table

import egraft
from egraft.optimize import optimize
from egraft.testing.encoder import encoder_model
from egraft.testing.models import LIGHT_MODELS, light_model_path

TARGETS = {"resnet50": 3.0, "densenet121": 10.0}


def measure(model: onnx.ModelProto, repeat: int) -> tuple[dict[str, float], object]:
    runs = []
    result = None
    for _ in range(repeat):
        graph = egraft.load(model)
        start = time.perf_counter()
        result = optimize(graph)
        total = time.perf_counter() - start
        runs.append({**result.seconds, "total": total})
    keys = runs[0].keys()
    return {k: statistics.median(r[k] for r in runs) for k in keys}, result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    table = Table(title=f"egraft optimize: median of {args.repeat} runs (seconds)")
    for col in ("model", "nodes", "after", "load", "saturate", "extract", "total", "target", "iterations", "stop"):
        table.add_column(col, justify="left" if col in ("model", "stop") else "right")
    models = [(name, onnx.load(light_model_path(name))) for name in LIGHT_MODELS] + [("encoder", encoder_model())]
    for name, model in models:
        seconds, result = measure(model, args.repeat)
        target = TARGETS.get(name)
        table.add_row(name, str(len(result.source.nodes)), str(len(result.graph.nodes)),
                      f"{seconds['load']:.2f}", f"{seconds['saturate']:.2f}", f"{seconds['extract']:.2f}",
                      f"{seconds['total']:.2f}", f"< {target:.0f}" if target else "",
                      str(result.saturation.iterations), result.saturation.stop_reason)
    Console(width=150).print(table)


if __name__ == "__main__":
    main()

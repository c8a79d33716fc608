"""Optimization time and plan cost per model: load into the e-graph, saturate with the
shipped rules, extract under the compile pipeline's defaults (roofline cost on this CPU's
profile, greedy extractor, no dims bound). Medians of --repeat runs, one table, for the
bundled models, the test encoder and (``--corpus``) every fetched real model.

``--json FILE`` keeps the figures; ``--before FILE`` (an earlier run's JSON) adds the
before/after columns: time ratio and plan cost ratio (a plan cost above 1.0 got dearer).

``--against DIR`` times this checkout against another one (a ``git worktree`` of an earlier
revision) in the same minutes: one worker process per checkout, and per model ``--rounds``
rounds of a block of ``--repeat`` optimizes in each, the order swapped every round. The host's
speed drifts by a third or more over minutes, so two runs made minutes apart compare spells as
much as code; the time ratio is the median over rounds of the two blocks' medians
(:func:`egraft.testing.timing.paired_ratio`).

Run: python benchmarks/optimize_time.py [--repeat 3] [--corpus] [--json after.json] [--before before.json]
     python benchmarks/optimize_time.py --against /tmp/before [--rounds 3] [--corpus] [--only densenet121]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import onnx
from rich.console import Console
from rich.table import Table

import egraft
from egraft.optimize import optimize
from egraft.rewrite.load import load_rules
from egraft.testing.encoder import encoder_model
from egraft.testing.models import LIGHT_MODELS, light_model_path
from egraft.testing.timing import medians_ms, paired_ratio

#: what issue 18 asks: every bundled model within 3 s, every corpus model within 5 s
TARGET_BUNDLED, TARGET_CORPUS = 3.0, 5.0


def measure(model: onnx.ModelProto, repeat: int) -> dict:
    """The medians of ``repeat`` optimizes of ``model`` by stage, each run's total (``seconds``)
    and the plan's figures."""
    runs, result = [], None
    for _ in range(repeat):
        graph = egraft.load(model)
        start = time.perf_counter()
        result = optimize(graph, cost="roofline")
        runs.append({**result.seconds, "total": time.perf_counter() - start})
    figures = {k: statistics.median(r.get(k, 0.0) for r in runs) for k in ("load", "saturate", "extract", "total")}
    figures.update(nodes=len(result.source.nodes), after=len(result.graph.nodes), cost=result.extraction.cost,
                   iterations=result.saturation.iterations, stop=result.saturation.stop_reason,
                   enodes=result.saturation.nodes_after, seconds=[r["total"] for r in runs])
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


#: A worker: reads ``[model path, runs]`` lines and answers each with :func:`measure`'s figures,
#: run with the ``egraft`` that its ``PYTHONPATH`` names (this script's imports included).
_WORKER = r"""
import json, sys, onnx
sys.path.insert(0, sys.argv[1])
from optimize_time import measure
for line in sys.stdin:
    path, runs = json.loads(line)
    print(json.dumps(measure(onnx.load(path), runs)), flush=True)
"""


class _Worker:
    """A process that optimizes models with the ``egraft`` of checkout ``root``."""

    def __init__(self, root: Path):
        env = {**os.environ, "PYTHONPATH": str(root)}
        self.process = subprocess.Popen([sys.executable, "-c", _WORKER, str(Path(__file__).resolve().parent)],
                                        stdin=subprocess.PIPE,
                                        stdout=subprocess.PIPE, text=True, env=env, cwd=root)

    def optimize(self, path: Path, runs: int) -> dict:
        self.process.stdin.write(json.dumps([str(path), runs]) + "\n")
        self.process.stdin.flush()
        line = self.process.stdout.readline()
        if not line:
            raise SystemExit(f"the worker of {self.process.args} ended; its stderr says why")
        return json.loads(line)

    def close(self) -> None:
        self.process.stdin.close()
        self.process.wait()


def against(other: Path, models_: list, rounds: int, repeat: int) -> None:
    """This checkout's optimize time and plan against ``other``'s, model by model, in
    alternating blocks (module docstring)."""
    if not (other / "egraft" / "__init__.py").is_file():
        raise SystemExit(f"--against {other}: no egraft package there (give a checkout, e.g. a git worktree)")
    here = Path(__file__).resolve().parent.parent
    workers = {"this": _Worker(here), "other": _Worker(other)}
    table = Table(title=f"egraft optimize, this checkout against {other}: {rounds} rounds of {repeat} runs "
                        "each, alternating (seconds)")
    for col in ("model", "set", "e-nodes", "other e-nodes", "total", "other total", "time ratio", "cost ratio",
                "target"):
        table.add_column(col, justify="left" if col in ("model", "set") else "right")
    with tempfile.TemporaryDirectory() as tmp:
        try:
            for name, kind, load in models_:
                path = Path(tmp) / f"{name}.onnx"
                onnx.save(load(), path)
                for worker in workers.values():
                    worker.optimize(path, 1)  # untimed: first-call costs (rules parsed, memory faulted in)
                times: dict[str, list[list[float]]] = {"this": [], "other": []}
                found = {}
                for r in range(rounds):
                    for side in (("this", "other") if r % 2 == 0 else ("other", "this")):
                        found[side] = workers[side].optimize(path, repeat)
                        times[side].append(found[side]["seconds"])
                median = {side: ms / 1e3 for side, ms in medians_ms(times).items()}
                target = TARGET_BUNDLED if kind == "bundled" else TARGET_CORPUS
                table.add_row(name, kind, str(found["this"]["enodes"]), str(found["other"]["enodes"]),
                              f"{median['this']:.2f}", f"{median['other']:.2f}",
                              f"{paired_ratio(times, 'this', 'other'):.2f}",
                              f"{found['this']['cost'] / found['other']['cost']:.4f}",
                              f"≤ {target:.0f}" + ("" if median["this"] <= target else " ✗"))
        finally:
            for worker in workers.values():
                worker.close()
    Console(width=200).print(table)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--corpus", action="store_true", help="the fetched real-model corpus too")
    parser.add_argument("--only", nargs="+", metavar="NAME")
    parser.add_argument("--json", metavar="FILE", help="write the figures as JSON")
    parser.add_argument("--before", metavar="FILE", help="an earlier --json run to compare with")
    parser.add_argument("--against", metavar="DIR", type=Path,
                        help="another checkout to time against, in alternating blocks")
    parser.add_argument("--rounds", type=int, default=3, help="with --against: rounds of blocks per model")
    args = parser.parse_args()
    if args.against is not None:
        against(args.against.resolve(), models(args.corpus, args.only), args.rounds, args.repeat)
        return
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

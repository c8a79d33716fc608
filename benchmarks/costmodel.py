"""How well the roofline cost model ranks egraft's kernels: Spearman rank correlation
between the predicted and the measured time of every kernel of the zoo.

Per model (the light models and the test encoder, compiled by egraft.compile with the
default roofline extraction): each kernel step's predicted time is the roofline's cost
of its node (``CostModel.node_cost``: what extraction priced it at, with the model's
symbolic dims bound to the inputs' sizes), on the ``cpu-host`` profile egraft uses (the
calibrated one from the user's config dir when ``egraft calibrate`` saved one: the title
says which); its measured time is the median over ``--repeat`` runs of the step's
timing (``CompiledModel.run(feeds, profile=...)``, 1 thread). Printed: the correlation per
model and pooled over every kernel (steps on reference fallbacks are counted and timed
apart: they are not egraft's kernels, but a plan that picks them pays for them), per
family how far off the prediction typically is, and the kernels whose prediction is most
off (measured / predicted, either way).

Run: python benchmarks/costmodel.py [--repeat 10] [--models resnet50 encoder] [--top 15]
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
from dataclasses import dataclass
from pathlib import Path

for _var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_var, "1")

import onnx  # noqa: E402
from rich.console import Console  # noqa: E402
from rich.table import Table  # noqa: E402
from scipy.stats import spearmanr  # noqa: E402

import egraft  # noqa: E402
from egraft.extract.calibrate_kernels import kernel_step_times  # noqa: E402
from egraft.extract.cost import cost_model  # noqa: E402
from egraft.extract.profiles import config_dir, load_profile  # noqa: E402
from egraft.ir.interpreter import check_feeds  # noqa: E402
from egraft.testing.bench import ZOO, temporary_cache, zoo_model  # noqa: E402


@dataclass(frozen=True)
class Kernel:
    """One kernel step of a compiled model: where it is, what it is, predicted and measured."""

    model: str
    label: str
    op: str
    family: str
    predicted_us: float
    measured_us: float

    @property
    def ratio(self) -> float:
        """measured / predicted (above 1: slower than the model says)."""
        return self.measured_us / self.predicted_us if self.predicted_us > 0 else math.inf

    @property
    def off(self) -> float:
        """How many times off the prediction is, either way (1.0 = exact)."""
        return max(self.ratio, 1 / self.ratio) if self.ratio > 0 else math.inf


def model_kernels(name: str, profile, repeat: int, folder: Path) -> tuple[list[Kernel], list[Kernel]]:
    """Every kernel step of ``name`` compiled as egraft.compile does, predicted and measured,
    and the same for its reference fallbacks (not egraft's kernels, but part of the time)."""
    model, feeds = zoo_model(name)
    path = folder / f"{name}.onnx"
    onnx.save(model, path)
    compiled = egraft.compile(path)
    compiled.threads = 1
    _, bindings = check_feeds(compiled.graph, feeds)
    roofline = cost_model("roofline", profile, bindings={str(k): int(v) for k, v in bindings.items()})
    measured = kernel_step_times(compiled, feeds, min_runs=repeat, max_runs=repeat, kinds=("kernel", "fallback"))
    kernels, fallbacks = [], []
    for step in compiled.steps:
        if step.index in measured:
            work = roofline.node_work(compiled.graph, step.node)
            (kernels if step.kind == "kernel" else fallbacks).append(
                Kernel(name, step.node.label, step.node.op, work.family, roofline.node_cost(compiled.graph, step.node),
                       measured[step.index]))
    return kernels, fallbacks


def rank_correlation(kernels: list[Kernel]) -> float:
    """Spearman's rho between predicted and measured times."""
    predicted, measured = [k.predicted_us for k in kernels], [k.measured_us for k in kernels]
    if len(kernels) < 3 or len(set(predicted)) < 2 or len(set(measured)) < 2:
        return math.nan  # undefined for constant inputs
    return float(spearmanr([k.predicted_us for k in kernels], [k.measured_us for k in kernels]).statistic)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeat", type=int, default=10, help="timed runs per model (median per kernel)")
    parser.add_argument("--models", nargs="*", default=None, help=f"default: {' '.join(ZOO)}")
    parser.add_argument("--top", type=int, default=15, help="mispredicted kernels to list")
    args = parser.parse_args()
    names = args.models or list(ZOO)
    folder = temporary_cache()
    profile = load_profile("cpu-host")
    calibrated = Path(profile.path).is_relative_to(config_dir())
    console = Console(width=160)
    console.print(f"profile: {profile.path} ({'calibrated' if calibrated else 'shipped placeholder'}; "
                  f"source: {profile.source})", markup=False)
    kernels: list[Kernel] = []
    table = Table(title=f"roofline prediction vs measured kernel time (1 thread, median of {args.repeat} runs)")
    for col in ("model", "kernels", "measured ms", "predicted ms", "spearman", "fallbacks", "fallback ms"):
        table.add_column(col, justify="left" if col == "model" else "right")
    fallbacks: list[Kernel] = []
    for name in names:
        console.print(f"{name}...", style="dim")
        found, slow = model_kernels(name, profile, args.repeat, folder)
        kernels += found
        fallbacks += slow
        table.add_row(name, str(len(found)), f"{sum(k.measured_us for k in found) / 1e3:.2f}",
                      f"{sum(k.predicted_us for k in found) / 1e3:.2f}", f"{rank_correlation(found):.3f}",
                      str(len(slow)), f"{sum(k.measured_us for k in slow) / 1e3:.2f}")
    table.add_section()
    table.add_row("pooled", str(len(kernels)), f"{sum(k.measured_us for k in kernels) / 1e3:.2f}",
                  f"{sum(k.predicted_us for k in kernels) / 1e3:.2f}", f"{rank_correlation(kernels):.3f}",
                  str(len(fallbacks)), f"{sum(k.measured_us for k in fallbacks) / 1e3:.2f}")
    console.print(table)
    if fallbacks:
        ops = ", ".join(sorted({k.op for k in fallbacks}))
        console.print(f"fallbacks (reference kernels, left out of the correlations): {ops}", markup=False)

    families = Table(title="per family (pooled): measured / predicted")
    for col in ("family", "kernels", "share of time", "median ratio", "spearman"):
        families.add_column(col, justify="left" if col == "family" else "right")
    total = sum(k.measured_us for k in kernels)
    for family in sorted({k.family for k in kernels}):
        group = [k for k in kernels if k.family == family]
        families.add_row(family, str(len(group)), f"{sum(k.measured_us for k in group) / total:.1%}",
                         f"{statistics.median(k.ratio for k in group):.2f}", f"{rank_correlation(group):.3f}")
    console.print(families)

    free = [k for k in kernels if k.predicted_us == 0]
    if free:
        ops = ", ".join(sorted({k.op for k in free}))
        console.print(f"{len(free)} kernels priced 0 (views to the cost model, run as kernels: {ops}) take "
                      f"{sum(k.measured_us for k in free):.1f} us in all; left out of the list below", markup=False)
    worst = Table(title=f"the {args.top} most mispredicted kernels")
    for col in ("model", "node", "op", "family", "predicted us", "measured us", "measured/predicted"):
        worst.add_column(col, justify="right" if "us" in col or "/" in col else "left")
    for k in sorted((k for k in kernels if k.predicted_us > 0), key=lambda k: (-k.off, k.model, k.label))[:args.top]:
        worst.add_row(k.model, k.label, k.op, k.family, f"{k.predicted_us:.1f}", f"{k.measured_us:.1f}",
                      f"{k.ratio:.2f}")
    console.print(worst)


if __name__ == "__main__":
    main()

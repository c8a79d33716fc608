"""``egraft calibrate --kernels``: time the kernels egraft generates and fit the roofline
profile's per-family parameters to them (measured operators, as TASO does).

The plain calibration (:mod:`egraft.extract.calibrate`) measures the machine: peak
GFLOP/s, bandwidth, launch cost. This one compiles the small graphs of
:mod:`egraft.extract.kernel_cases` (no rewriting), runs each several times with
per-step timing, and keeps, per kernel step, the median time next to the step's
:class:`~egraft.ir.work.Work` (flops, bytes, launches: what the cost model prices).
:func:`fit_families` then fits, per family, the two numbers the roofline leaves free:

    time = max(flops / (peak * efficiency), bytes / (bandwidth * bandwidth_efficiency))
           + launches * launch_us

minimizing the mean absolute log error (a kernel 2x too slow counts as much as one 2x
too fast, and one kernel 20x off, such as a transcendental function among additions, does
not drag the whole family); among near-equal fits the one nearest to 1 wins, so that a
number the samples cannot see (the efficiency of a family whose kernels are all
memory-bound) stays near 1. Families with no flops (layout, data) get a bandwidth
efficiency only; an unmeasured variant family takes its parent's fit (:data:`VARIANT_OF`).

Example:
    >>> from egraft.extract.profiles import Profile
    >>> truth = Profile("t", "cpu", 100.0, 20.0, 1.0, {"gemm": 0.4}, {"gemm": 2.0})
    >>> samples = synthetic_samples(truth, "gemm", [(1e8, 1e6), (1e6, 1e7), (1e7, 1e5)])
    >>> fit = fit_families(samples, Profile("t", "cpu", 100.0, 20.0, 1.0))["gemm"]
    >>> round(fit.efficiency, 2), round(fit.bandwidth_efficiency, 2)
    (0.4, 2.0)
"""

from __future__ import annotations

import datetime
import math
import statistics
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, replace

import numpy as np

from egraft.extract.kernel_cases import KernelCase, kernel_cases
from egraft.extract.profiles import Profile
from egraft.ir.work import Work

#: The fitted efficiency stays in [EFFICIENCY_RANGE] (a profile's efficiency is a fraction
#: of the peak), the bandwidth efficiency in [BANDWIDTH_RANGE] (above 1: data in cache).
EFFICIENCY_RANGE = (1e-3, 1.0)
BANDWIDTH_RANGE = (1e-2, 16.0)
#: Among near-equal fits, the loss still breaks ties between equally near-to-1 points.
PRIOR_WEIGHT = 1e-4
#: Seconds each case is timed for (at least MIN_RUNS, at most MAX_RUNS runs).
SECONDS_PER_CASE, MIN_RUNS, MAX_RUNS = 0.25, 5, 40
#: What a kernel-measured profile records in its ``source``.
SOURCE_TAG = "kernels measured"
#: A family with no samples takes the fit of the family it is a variant of, so that the
#: two keep their relative cost (an unmeasured variant left at 1.0 would look cheap).
VARIANT_OF = {"conv_nhwc": "conv", "conv_nchwc": "conv", "winograd": "conv", "attention": "gemm", "gemm_fused": "gemm"}


@dataclass(frozen=True)
class KernelSample:
    """One kernel step timed: what the cost model knows of it, and how long it took.

    Attributes:
        case: the :class:`KernelCase` it comes from.
        op: the step's op (``Conv``).
        family: its kernel family.
        flops / bytes: arithmetic and memory traffic (reads plus writes) of the step.
        launches: kernels it starts.
        measured_us: median microseconds over the timed runs.
        kind: ``kernel`` (generated code) or ``fallback`` (a reference kernel).
    """

    case: str
    op: str
    family: str
    flops: float
    bytes: float
    launches: int
    measured_us: float
    kind: str = "kernel"


@dataclass(frozen=True)
class FamilyFit:
    """The fitted parameters of one family and how well they describe its samples.

    Attributes:
        family: the kernel family.
        samples: kernel steps the fit used.
        efficiency: fraction of the peak (``[efficiency]``).
        bandwidth_efficiency: multiple of the bandwidth (``[bandwidth_efficiency]``).
        error: geometric mean of ``max(measured/predicted, predicted/measured)`` after the
            fit (1.0 = exact; 1.5 = typically off by 50%): what the fit minimizes.
        error_before: the same with the profile's parameters before the fit.
    """

    family: str
    samples: int
    efficiency: float
    bandwidth_efficiency: float
    error: float
    error_before: float


def predict_us(profile: Profile, sample: KernelSample | Work, family: str | None = None) -> float:
    """The roofline's microseconds for a sample (the formula of :class:`egraft.extract.cost.Roofline`)."""
    from egraft.extract.cost import Roofline

    if isinstance(sample, KernelSample):
        sample = Work(sample.flops, sample.family, reads=sample.bytes, writes=0.0, launches=sample.launches)
    return Roofline(profile).op_cost(sample, None)


def synthetic_samples(profile: Profile, family: str, works: Iterable[tuple[float, float]],
                      noise: float = 0.0, seed: int = 0) -> list[KernelSample]:
    """Samples a machine described by ``profile`` would measure for kernels of ``family``
    doing ``(flops, bytes)`` each, with multiplicative log-normal ``noise`` (tests)."""
    rng = np.random.default_rng(seed)
    out = []
    for i, (flops, nbytes) in enumerate(works):
        sample = KernelSample(f"synthetic {i}", "Synthetic", family, float(flops), float(nbytes), 1, 0.0)
        measured = predict_us(profile, sample) * math.exp(noise * rng.standard_normal())
        out.append(replace(sample, measured_us=measured))
    return out


def _log_grid(lo: float, hi: float, points: int) -> np.ndarray:
    return np.linspace(math.log(lo), math.log(hi), points)


#: The fit's grids: (points per axis, loss tolerance). Among the points whose loss is within
#: the tolerance of the best, the one nearest to 1 wins, so that a number the samples do
#: not determine (one sample fits a whole curve of pairs) stays near 1, not wherever the
#: grid happened to fall.
_STAGES = ((161, 0.02), (41, 2e-3), (41, 1e-4), (41, 1e-5))


def _fit_one(samples: Sequence[KernelSample], base: Profile) -> tuple[float, float]:
    """(efficiency, bandwidth efficiency) minimizing the mean absolute log error: a grid
    over both logs, then finer grids around the chosen point."""
    flops = np.array([s.flops for s in samples])
    traffic = np.array([s.bytes for s in samples])
    fixed = np.array([s.launches * base.launch_us for s in samples])
    measured = np.log(np.array([max(s.measured_us, 1e-3) for s in samples]))
    compute_us = flops / (base.peak_gflops * 1e3)
    traffic_us = traffic / (base.bandwidth_gbs * 1e3)
    has_flops = bool(np.any(flops > 0))
    e_range = [math.log(v) for v in EFFICIENCY_RANGE] if has_flops else [0.0, 0.0]
    b_range = [math.log(v) for v in BANDWIDTH_RANGE]
    for points, tolerance in _STAGES:
        e_axis = np.linspace(*e_range, points if has_flops else 1)
        b_axis = np.linspace(*b_range, points)
        le, lb = np.meshgrid(e_axis, b_axis, indexing="ij")
        predicted = np.maximum(compute_us[None, None, :] / np.exp(le)[..., None],
                               traffic_us[None, None, :] / np.exp(lb)[..., None]) + fixed[None, None, :]
        loss = np.abs(np.log(np.maximum(predicted, 1e-9)) - measured).mean(axis=-1)
        prior = le ** 2 + lb ** 2
        near_best = loss <= loss.min() + tolerance
        i, j = np.unravel_index(int(np.argmin(np.where(near_best, prior + PRIOR_WEIGHT * loss, np.inf))), loss.shape)
        best_e, best_b = float(e_axis[i]), float(b_axis[j])
        e_step = (e_range[1] - e_range[0]) / max(points - 1, 1)
        b_step = (b_range[1] - b_range[0]) / (points - 1)
        if has_flops:
            e_range = [max(best_e - 2 * e_step, math.log(EFFICIENCY_RANGE[0])),
                       min(best_e + 2 * e_step, math.log(EFFICIENCY_RANGE[1]))]
        b_range = [max(best_b - 2 * b_step, math.log(BANDWIDTH_RANGE[0])),
                   min(best_b + 2 * b_step, math.log(BANDWIDTH_RANGE[1]))]
    return math.exp(best_e), math.exp(best_b)


def fit_error(profile: Profile, samples: Sequence[KernelSample]) -> float:
    """How far ``profile``'s predictions are from the measured times: the geometric mean
    of ``max(measured/predicted, predicted/measured)`` (1.0 = exact)."""
    logs = [abs(math.log(max(s.measured_us, 1e-3) / max(predict_us(profile, s), 1e-9))) for s in samples]
    return math.exp(sum(logs) / len(logs))


def fit_families(samples: Sequence[KernelSample], base: Profile) -> dict[str, FamilyFit]:
    """Per family of ``samples``: the efficiency and bandwidth efficiency that make the
    roofline of ``base`` (its peak, bandwidth and launch cost kept) closest to the measured
    times. A family of kernels without flops keeps ``base``'s efficiency. Pure: no timing,
    no files; the result is ordered as :data:`egraft.ir.work.FAMILIES`."""
    from egraft.ir.work import FAMILIES

    fits = {}
    for family in FAMILIES:
        group = [s for s in samples if s.family == family]
        if not group:
            continue
        efficiency, bandwidth = _fit_one(group, base)
        if not any(s.flops > 0 for s in group):
            efficiency = base.family_efficiency(family)
        fitted = replace(base, efficiency={**base.efficiency, family: efficiency},
                         bandwidth_efficiency={**base.bandwidth_efficiency, family: bandwidth})
        fits[family] = FamilyFit(family, len(group), efficiency, bandwidth, fit_error(fitted, group),
                                 fit_error(base, group))
    return fits


def fitted_profile(base: Profile, fits: Mapping[str, FamilyFit], threads: int,
                   date: str | None = None) -> Profile:
    """``base`` with the fitted families' parameters (rounded to 3 digits; an unmeasured
    variant family takes its parent's, see :data:`VARIANT_OF`, and a variant measured once
    its parent's bandwidth efficiency) and a record of the measurement appended to its
    ``source``."""
    date = date or datetime.date.today().isoformat()
    efficiency = dict(base.efficiency)
    bandwidth = dict(base.bandwidth_efficiency)
    for family, fit in fits.items():
        efficiency[family] = float(f"{fit.efficiency:.3g}")
        bandwidth[family] = float(f"{fit.bandwidth_efficiency:.3g}")
    for family, parent in VARIANT_OF.items():
        if family not in fits and parent in fits:
            efficiency[family], bandwidth[family] = efficiency[parent], bandwidth[parent]
        elif family in fits and fits[family].samples < 2 and parent in fits:
            # one sample cannot tell its two numbers apart (its fit is the point of a curve
            # nearest to 1): the memory side is the parent's, so that the variant does not
            # look cheaper wherever its parent is memory-bound
            bandwidth[family] = bandwidth[parent]
    plain = base.source.split(f"; {SOURCE_TAG}")[0]
    kernels = sum(f.samples for f in fits.values())
    record = f"{SOURCE_TAG} {date}: {kernels} kernels in {len(fits)} families at {threads} thread(s)"
    return replace(base, efficiency=efficiency, bandwidth_efficiency=bandwidth,
                   source=f"{plain}; {record}" if plain else record)


def has_kernel_fit(profile: Profile) -> bool:
    """Whether ``profile`` already holds efficiencies fitted by ``calibrate --kernels``."""
    return SOURCE_TAG in profile.source


def time_case(case: KernelCase, threads: int = 1, seconds: float = SECONDS_PER_CASE,
              cost=None) -> list[KernelSample]:
    """Compile ``case`` (no rewriting) and time it: one sample per step that computes
    (generated kernels and reference fallbacks; views are left out), its time the median
    over the runs."""
    import egraft
    from egraft.extract.cost import cost_model

    cost = cost or cost_model("flops")
    compiled = egraft.compile(case.model, rewrite=False, specialize="off")
    compiled.threads = threads
    steps = [s for s in compiled.steps if s.kind in ("kernel", "fallback")]
    medians = kernel_step_times(compiled, case.feeds, MIN_RUNS, MAX_RUNS, seconds, kinds=("kernel", "fallback"))
    samples = []
    for step in steps:
        work = cost.node_work(compiled.graph, step.node)
        samples.append(KernelSample(case.name, step.node.op, work.family, work.flops,
                                    (work.reads or 0.0) + (work.writes or 0.0), work.launches,
                                    medians[step.index], step.kind))
    return samples


def kernel_step_times(compiled, feeds: Mapping[str, np.ndarray], min_runs: int = MIN_RUNS,
                      max_runs: int = MAX_RUNS, seconds: float = SECONDS_PER_CASE,
                      kinds: Sequence[str] = ("kernel",)) -> dict[int, float]:
    """Microseconds each step of ``compiled`` of one of ``kinds`` (``kernel``,
    ``fallback``, ``view``) takes on ``feeds``: the median over at least ``min_runs`` runs,
    more while under ``seconds`` (at most ``max_runs``), after two untimed ones. Keyed by
    step index.

    Example:
        >>> kernel_step_times(egraft.compile("model.onnx"), feeds, min_runs=5)   # doctest: +SKIP
        {0: 812.5, 2: 40.1}
    """
    durations: dict[int, list[float]] = {s.index: [] for s in compiled.steps if s.kind in kinds}
    for _ in range(2):
        compiled.run(feeds)
    started = time.perf_counter()
    runs = 0
    while runs < min_runs or (runs < max_runs and time.perf_counter() - started < seconds):
        profile: list = []
        compiled.run(feeds, profile=profile)
        for timing in profile:
            if timing.depth == 0 and timing.index in durations:
                durations[timing.index].append((timing.end_ns - timing.start_ns) / 1e3)
        runs += 1
    return {index: statistics.median(times) for index, times in durations.items()}


def measure_kernels(cases: Sequence[KernelCase] | None = None, threads: int = 1, quick: bool = False,
                    progress: Callable[[KernelCase], None] | None = None) -> list[KernelSample]:
    """Time every case (default: :func:`kernel_cases`); ``progress`` is called after each."""
    samples = []
    for case in cases if cases is not None else kernel_cases(quick):
        samples += time_case(case, threads, seconds=SECONDS_PER_CASE / 4 if quick else SECONDS_PER_CASE)
        if progress is not None:
            progress(case)
    return samples


__all__ = ["KernelSample", "FamilyFit", "fit_error", "fit_families", "fitted_profile", "has_kernel_fit",
           "kernel_step_times", "measure_kernels", "predict_us", "synthetic_samples", "time_case"]

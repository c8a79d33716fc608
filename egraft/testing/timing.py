"""Timing for benchmarks and ``egraft bench``: the median of repeated runs (the machines
are shared and noisy, so medians, never means).

Example:
    >>> median_ms(lambda: sum(range(1000)), repeat=5) > 0
    True
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable


def median_ms(fn: Callable[[], object], repeat: int, warmup: int = 2) -> float:
    """Milliseconds ``fn()`` takes: the median of ``repeat`` timed calls after ``warmup`` untimed ones."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def interleaved_medians_ms(fns: dict[str, Callable[[], object]], repeat: int, warmup: int = 2) -> dict[str, float]:
    """Milliseconds each of ``fns`` takes, timed in rounds (one call of each per round) so
    that a slow spell of a shared machine hits every variant alike: the median per name.

    Example:
        >>> sorted(interleaved_medians_ms({"a": lambda: None, "b": lambda: None}, repeat=3))
        ['a', 'b']
    """
    for _ in range(warmup):
        for fn in fns.values():
            fn()
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(repeat):
        for name, fn in fns.items():
            start = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - start)
    return {name: statistics.median(values) * 1e3 for name, values in times.items()}


def alternating_blocks_ms(fns: dict[str, Callable[[], object]], budget_s: float = 2.0, rounds: int = 5,
                          max_block: int = 50, gap_s: float = 0.05) -> dict[str, float]:
    """Milliseconds each of ``fns`` takes, timed in alternating blocks: ``k`` calls of the
    first, then ``k`` of the next, ..., for ``rounds`` rounds; the median of every timed call
    per name. ``k`` is chosen from one untimed warm call of each so that the whole takes
    about ``budget_s`` (at least 1, at most ``max_block``).

    Blocks rather than single calls in turn, with ``gap_s`` of idle time before each block:
    onnxruntime's pool threads spin for tens of milliseconds after a run and steal a core
    from whatever runs right after it. Measured on DenseNet-121 at 2 threads, egraft's first
    call after an onnxruntime block took 60 ms, its others 36 ms; after a 50 ms gap, 36 ms.
    Each engine then starts its block with its own threads asleep, as after any pause.

    Example:
        >>> sorted(alternating_blocks_ms({"a": lambda: None, "b": lambda: None}, budget_s=0.01))
        ['a', 'b']
    """
    first = {}
    for name, fn in fns.items():
        fn()  # warm-up: first-call costs (arena allocation, lazy init)
        start = time.perf_counter()
        fn()
        first[name] = time.perf_counter() - start
    per_round = max(sum(first.values()), 1e-6)
    block = max(1, min(max_block, int(budget_s / rounds / per_round)))
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            time.sleep(gap_s)
            for _ in range(block):
                start = time.perf_counter()
                fn()
                times[name].append(time.perf_counter() - start)
    return {name: statistics.median(values) * 1e3 for name, values in times.items()}


def against_onnxruntime(compiled, session, feeds: dict, budget_s: float = 2.0) -> dict[str, float]:
    """egraft's and onnxruntime's median milliseconds on ``feeds`` (alternating blocks, see
    :func:`alternating_blocks_ms`) and egraft's overhead share: (latency - time inside
    kernels) / latency, the kernel time (control-step bodies included) the median over
    profiled runs, clamped at 0.

    Example:
        >>> against_onnxruntime(compiled, session, feeds)     # doctest: +SKIP
        {'egraft_ms': 1.3, 'ort_ms': 1.2, 'kernels_ms': 1.25, 'overhead': 0.04}
    """
    import numpy as np

    times = alternating_blocks_ms({"egraft": lambda: compiled.run(feeds),
                                   "onnxruntime": lambda: session.run(None, feeds)}, budget_s=budget_s)
    inside = []
    for _ in range(max(3, min(50, int(0.3 / max(times["egraft"] / 1e3, 1e-6))))):
        profile: list = []
        compiled.run(feeds, profile=profile)
        inside.append(sum(t.end_ns - t.start_ns for t in profile if t.kind == "kernel") / 1e6)
    kernels_ms = float(np.median(inside))
    return dict(egraft_ms=times["egraft"], ort_ms=times["onnxruntime"], kernels_ms=kernels_ms,
                overhead=max(0.0, (times["egraft"] - kernels_ms) / times["egraft"]))


def thread_counts_ms(compiled, feeds: dict, counts: list[int], budget_s: float = 2.0) -> dict[int, float]:
    """egraft's median milliseconds on ``feeds`` at each of ``counts`` threads, timed against
    itself in alternating blocks (:func:`alternating_blocks_ms`): whether threads pay is then
    not hidden by the machine's drift between two separate measurements. Leaves
    ``compiled.threads`` as it found it.

    Example:
        >>> thread_counts_ms(compiled, feeds, [1, 2])     # doctest: +SKIP
        {1: 0.48, 2: 0.31}
    """
    before = compiled.threads

    def at(count: int) -> Callable[[], object]:
        def call() -> object:
            compiled.threads = count
            return compiled.run(feeds)
        return call

    try:
        times = alternating_blocks_ms({str(c): at(c) for c in counts}, budget_s=budget_s)
    finally:
        compiled.threads = before
    return {c: times[str(c)] for c in counts}

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

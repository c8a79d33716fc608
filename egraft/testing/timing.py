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

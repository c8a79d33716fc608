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


def alternating_blocks(fns: dict[str, Callable[[], object]], budget_s: float = 2.0, rounds: int = 9,
                       max_block: int = 50, gap_s: float = 0.05) -> dict[str, list[list[float]]]:
    """Seconds of every timed call of each of ``fns``, per round, timed in alternating blocks:
    ``k`` calls of the first, then ``k`` of the next, ..., for ``rounds`` rounds. ``k`` is
    chosen from one untimed warm call of each so that the whole takes about ``budget_s`` (at
    least 1, at most ``max_block``).

    Blocks rather than single calls in turn, with ``gap_s`` of idle time before each block:
    onnxruntime's pool threads spin for tens of milliseconds after a run and steal a core
    from whatever runs right after it. Measured on DenseNet-121 at 2 threads, egraft's first
    call after an onnxruntime block took 60 ms, its others 36 ms; after a 50 ms gap, 36 ms.
    Each engine then starts its block with its own threads asleep, as after any pause.

    Example:
        >>> times = alternating_blocks({"a": lambda: None, "b": lambda: None}, budget_s=0.01, rounds=3)
        >>> sorted(times), len(times["a"])
        (['a', 'b'], 3)
    """
    first = {}
    for name, fn in fns.items():
        fn()  # warm-up: first-call costs (arena allocation, lazy init)
        start = time.perf_counter()
        fn()
        first[name] = time.perf_counter() - start
    per_round = max(sum(first.values()), 1e-6)
    block = max(1, min(max_block, int(budget_s / rounds / per_round)))
    times: dict[str, list[list[float]]] = {name: [] for name in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            time.sleep(gap_s)
            calls = []
            for _ in range(block):
                start = time.perf_counter()
                fn()
                calls.append(time.perf_counter() - start)
            times[name].append(calls)
    return times


def medians_ms(times: dict[str, list[list[float]]]) -> dict[str, float]:
    """The median milliseconds of every timed call per name (all rounds together)."""
    return {name: statistics.median(t for block in blocks for t in block) * 1e3 for name, blocks in times.items()}


def paired_ratio(times: dict[str, list[list[float]]], a: str, b: str) -> float:
    """``a``'s time over ``b``'s, as the median over rounds of the ratio of their block medians
    in that round: a round's two blocks run within a fraction of a second of each other, so
    the host's drift (its speed moved by 2x over minutes on a shared 2-core machine) cancels in
    each ratio, where the ratio of the overall medians mixes slow and fast spells unevenly.

    Example:
        >>> paired_ratio({"a": [[2.0], [4.0], [2.2]], "b": [[1.0], [2.0], [1.0]]}, "a", "b")
        2.0
    """
    return statistics.median(statistics.median(x) / statistics.median(y) for x, y in zip(times[a], times[b],
                                                                                          strict=True))


def alternating_blocks_ms(fns: dict[str, Callable[[], object]], budget_s: float = 2.0, rounds: int = 9,
                          max_block: int = 50, gap_s: float = 0.05) -> dict[str, float]:
    """Milliseconds each of ``fns`` takes: the median of every call timed by
    :func:`alternating_blocks`.

    Example:
        >>> sorted(alternating_blocks_ms({"a": lambda: None, "b": lambda: None}, budget_s=0.01))
        ['a', 'b']
    """
    return medians_ms(alternating_blocks(fns, budget_s, rounds, max_block, gap_s))


def against_onnxruntime(compiled, session, feeds: dict, budget_s: float = 2.0) -> dict[str, float]:
    """egraft's and onnxruntime's median milliseconds on ``feeds`` (alternating blocks, see
    :func:`alternating_blocks`), egraft's time over onnxruntime's (:func:`paired_ratio`) and
    egraft's overhead share: (latency - time inside kernels) / latency, the kernel time
    (control-step bodies included) the median over profiled runs, clamped at 0.

    Example:
        >>> against_onnxruntime(compiled, session, feeds)     # doctest: +SKIP
        {'egraft_ms': 1.3, 'ort_ms': 1.2, 'ratio': 1.07, 'kernels_ms': 1.25, 'overhead': 0.04}
    """
    import numpy as np

    blocks = alternating_blocks({"egraft": lambda: compiled.run(feeds),
                                 "onnxruntime": lambda: session.run(None, feeds)}, budget_s=budget_s)
    times = medians_ms(blocks)
    inside = []
    for _ in range(max(3, min(50, int(0.3 / max(times["egraft"] / 1e3, 1e-6))))):
        profile: list = []
        compiled.run(feeds, profile=profile)
        inside.append(sum(t.end_ns - t.start_ns for t in profile if t.kind == "kernel") / 1e6)
    kernels_ms = float(np.median(inside))
    return dict(egraft_ms=times["egraft"], ort_ms=times["onnxruntime"],
                ratio=paired_ratio(blocks, "egraft", "onnxruntime"), kernels_ms=kernels_ms,
                overhead=max(0.0, (times["egraft"] - kernels_ms) / times["egraft"]))


def thread_counts(compiled, feeds: dict, counts: list[int], budget_s: float = 2.0,
                  sessions: dict[int, object] | None = None) -> dict[int, dict[str, float]]:
    """egraft at each of ``counts`` threads on ``feeds``, timed against itself in alternating
    blocks (:func:`alternating_blocks`): per count its median milliseconds (``ms``) and its
    time over the first count's (``ratio``, :func:`paired_ratio`). Whether threads pay is then
    not hidden by the machine's drift between two separate measurements. With ``sessions``
    (onnxruntime sessions by thread count) they run in the same blocks, and each count also
    gets onnxruntime's own ratio (``ort_ratio``): what the host gave a mature engine's threads
    in the same seconds (a 2-vCPU host whose other vCPU is busy gives neither 2x). Leaves
    ``compiled.threads`` as it found it.

    Example:
        >>> thread_counts(compiled, feeds, [1, 2])     # doctest: +SKIP
        {1: {'ms': 0.48, 'ratio': 1.0}, 2: {'ms': 0.31, 'ratio': 0.65}}
    """
    before = compiled.threads

    def at(count: int) -> Callable[[], object]:
        def call() -> object:
            compiled.threads = count
            return compiled.run(feeds)
        return call

    fns = {str(c): at(c) for c in counts}
    for c, session in (sessions or {}).items():
        fns[f"ort{c}"] = lambda session=session: session.run(None, feeds)
    try:
        blocks = alternating_blocks(fns, budget_s=budget_s * len(fns) / len(counts))
    finally:
        compiled.threads = before
    ms = medians_ms(blocks)
    result = {c: dict(ms=ms[str(c)], ratio=paired_ratio(blocks, str(c), str(counts[0]))) for c in counts}
    if sessions and all(c in sessions for c in counts):
        for c in counts:
            result[c]["ort_ratio"] = paired_ratio(blocks, f"ort{c}", f"ort{counts[0]}")
    return result

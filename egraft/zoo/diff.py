"""Compare two zoo runs model by model: statuses, latency, optimize time and program size.

:func:`diff_runs` pairs the rows of run A and run B (as :meth:`ZooStore.rows` returns
them) by model name; :func:`regressions` lists the models B made worse (slower than a
threshold, or ``ok`` in A and failing or missing in B); :func:`geomean` is the geometric
mean that ``zoo report`` and ``zoo diff`` print.

Example:
    >>> a = [{"model": "m", "status": "ok", "egraft_ms": 2.0, "optimize_s": 1.0, "nodes_after": 10}]
    >>> b = [{"model": "m", "status": "ok", "egraft_ms": 1.0, "optimize_s": 3.0, "nodes_after": 8}]
    >>> entry, = diff_runs(a, b)
    >>> entry["speed_ratio"], entry["optimize_ratio"], entry["nodes_ratio"]
    (2.0, 3.0, 0.8)
    >>> regressions(diff_runs(b, a), fail_below=0.95)
    [('m', 'slower: speed ratio 0.500 < 0.95 (1 ms -> 2 ms)')]
"""

from __future__ import annotations

import math
from collections.abc import Iterable

#: The keys of every entry :func:`diff_runs` returns, in order.
DIFF_FIELDS = (
    "model", "status_a", "status_b", "status_changed",
    "egraft_ms_a", "egraft_ms_b", "speed_ratio",
    "optimize_s_a", "optimize_s_b", "optimize_ratio",
    "nodes_after_a", "nodes_after_b", "nodes_ratio",
)


def geomean(values: Iterable[float | None]) -> float | None:
    """The geometric mean of ``values``, skipping ``None``; ``None`` when no value is left.

    A value that is not a finite positive number raises ``ValueError`` (a ratio or a
    speed-up of 0 means a measurement went wrong, and would hide every other value).

    >>> geomean([1.0, 4.0, None])
    2.0
    >>> geomean([None]) is None
    True
    >>> geomean([2.0, 0.0])
    Traceback (most recent call last):
    ...
    ValueError: geomean of a value that is not a finite positive number: 0.0
    """
    logs = []
    for v in values:
        if v is None:
            continue
        if not (isinstance(v, (int, float)) and math.isfinite(v) and v > 0):
            raise ValueError(f"geomean of a value that is not a finite positive number: {v!r}")
        logs.append(math.log(v))
    return math.exp(math.fsum(logs) / len(logs)) if logs else None


def ratio(num: float | None, den: float | None) -> float | None:
    """``num / den`` when both are finite positive numbers, else ``None``.

    >>> ratio(3.0, 2.0), ratio(None, 2.0), ratio(1.0, 0.0)
    (1.5, None, None)
    """
    if not all(isinstance(v, (int, float)) and math.isfinite(v) and v > 0 for v in (num, den)):
        return None
    return num / den


def diff_runs(rows_a: list[dict], rows_b: list[dict]) -> list[dict]:
    """One entry per model of either run, by model name, with the keys of :data:`DIFF_FIELDS`.

    ``speed_ratio`` is ``egraft_ms_a / egraft_ms_b`` (above 1: B is faster),
    ``optimize_ratio`` is ``optimize_s_b / optimize_s_a`` and ``nodes_ratio``
    ``nodes_after_b / nodes_after_a`` (above 1: B takes longer, B's program is larger);
    a ratio is ``None`` when either side lacks a positive value. A model that only one run
    has gets ``None`` for every field of the other side, its status included.

    >>> d = diff_runs([{"model": "x", "status": "ok"}], [{"model": "y", "status": "error"}])
    >>> [(e["model"], e["status_a"], e["status_b"], e["status_changed"]) for e in d]
    [('x', 'ok', None, True), ('y', None, 'error', True)]
    """
    by_a = {r["model"]: r for r in rows_a}
    by_b = {r["model"]: r for r in rows_b}
    out = []
    for model in sorted(by_a.keys() | by_b.keys()):
        a, b = by_a.get(model, {}), by_b.get(model, {})
        entry = {"model": model, "status_a": a.get("status"), "status_b": b.get("status")}
        entry["status_changed"] = entry["status_a"] != entry["status_b"]
        for field, key, flip in (("egraft_ms", "speed_ratio", True), ("optimize_s", "optimize_ratio", False),
                                 ("nodes_after", "nodes_ratio", False)):
            va, vb = a.get(field), b.get(field)
            entry[f"{field}_a"], entry[f"{field}_b"] = va, vb
            entry[key] = ratio(va, vb) if flip else ratio(vb, va)
        out.append({k: entry[k] for k in DIFF_FIELDS})
    return out


def regressions(entries: list[dict], fail_below: float) -> list[tuple[str, str]]:
    """``(model, reason)`` for each model of ``entries`` (from :func:`diff_runs`) that B made
    worse: its ``speed_ratio`` is below ``fail_below``, or it was ``ok`` in A and is not in B
    (another status, or missing). A model with both gets one tuple, the reasons joined by ``; ``.

    >>> regressions([{"model": "m", "status_a": "ok", "status_b": "timeout", "speed_ratio": None}], 0.95)
    [('m', 'ok -> timeout')]
    >>> regressions([{"model": "m", "status_a": "ok", "status_b": None, "speed_ratio": None}], 0.95)
    [('m', 'ok -> missing')]
    """
    out = []
    for e in entries:
        reasons = []
        if e["status_a"] == "ok" and e["status_b"] != "ok":
            reasons.append(f"ok -> {e['status_b'] or 'missing'}")
        r = e.get("speed_ratio")
        if r is not None and r < fail_below:
            reasons.append(f"slower: speed ratio {r:.3f} < {fail_below:g} "
                           f"({e['egraft_ms_a']:.4g} ms -> {e['egraft_ms_b']:.4g} ms)")
        if reasons:
            out.append((e["model"], "; ".join(reasons)))
    return out


__all__ = ["DIFF_FIELDS", "diff_runs", "geomean", "ratio", "regressions"]

"""Judging a corpus model's outputs against onnxruntime.

onnxruntime runs with basic graph optimizations only (``ORT_ENABLE_BASIC``: the extended
ones include lossy rewrites) on one intra-op thread. Float outputs are compared by
scale-relative error with the scale floored at 1e-3,
``max|a - r| / max(max|r|, 1e-3)`` (the idea of
:func:`egraft.testing.models.scale_relative_error`, floored so that an output near zero,
such as a voice-activity probability of silence, does not turn rounding into a failure);
integer and bool outputs must be equal element for element; shapes must match.

Example:
    >>> import numpy as np
    >>> compare_outputs({"y": np.array([1.0, 2.5])}, {"y": np.array([1.0, 2.0])}).error
    0.25
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

#: The floor under the scale of a float output.
SCALE_FLOOR = 1e-3


def output_error(actual: np.ndarray, reference: np.ndarray) -> tuple[float, str]:
    """The error of one output and a few words on it. Floats: scale-relative error, the
    scale floored at :data:`SCALE_FLOOR` (NaN where the reference has none counts as
    infinite); integers and bools: 0 if equal, else infinite. A shape mismatch raises
    ``AssertionError`` with both shapes."""
    actual = np.asarray(actual)
    reference = np.asarray(reference)
    if actual.shape != reference.shape:
        raise AssertionError(f"shape {actual.shape} != reference shape {reference.shape}")
    if reference.size == 0:
        return 0.0, "empty"
    if not np.issubdtype(reference.dtype, np.inexact):
        wrong = int(np.count_nonzero(actual != reference))
        return (0.0, "exact") if wrong == 0 else (float("inf"), f"{wrong} of {reference.size} elements differ")
    a = actual.astype(np.float64)
    r = reference.astype(np.float64)
    both_nan = np.isnan(a) & np.isnan(r)
    if np.isnan(a[~both_nan]).any() or np.isnan(r[~both_nan]).any():
        return float("inf"), "NaN where the other has a number"
    finite = np.isfinite(r) & ~both_nan
    if (a[~finite & ~both_nan] != r[~finite & ~both_nan]).any():
        return float("inf"), "infinities differ"
    if not finite.any():
        return 0.0, "no finite elements"
    scale = max(float(np.max(np.abs(r[finite]))), SCALE_FLOOR)
    return float(np.max(np.abs(a[finite] - r[finite])) / scale), f"scale {scale:.3g}"


@dataclass(frozen=True)
class Comparison:
    """The outcome of comparing a run's outputs with the reference's.

    Attributes:
        error: the largest error over the outputs (see :func:`output_error`).
        worst: the output it comes from.
        per_output: output name -> (error, note).
    """

    error: float
    worst: str
    per_output: dict[str, tuple[float, str]] = field(default_factory=dict)

    def passes(self, tolerance: float) -> bool:
        """Every output within ``tolerance``."""
        return self.error <= tolerance


def compare_outputs(actual: Mapping[str, np.ndarray], reference: Mapping[str, np.ndarray]) -> Comparison:
    """Compare every reference output with the output of the same name in ``actual``.
    A missing output or a shape mismatch raises ``AssertionError`` naming the output."""
    per_output: dict[str, tuple[float, str]] = {}
    for name, ref in reference.items():
        if name not in actual:
            raise AssertionError(f"output {name!r} missing; got {sorted(actual)}")
        try:
            per_output[name] = output_error(actual[name], ref)
        except AssertionError as err:
            raise AssertionError(f"output {name!r}: {err}") from None
    worst = max(per_output, key=lambda n: per_output[n][0]) if per_output else ""
    return Comparison(per_output[worst][0] if worst else 0.0, worst, per_output)


def judge_session(model):
    """The judge's session on an ``onnx.ModelProto``: :func:`egraft.testing.bench.ort_session`
    with basic optimizations on one thread."""
    from egraft.testing.bench import ort_session as session_of

    return session_of(model, threads=1, exact=True)


def ort_session(path: str | Path):
    """An onnxruntime CPU session on ``path``: basic optimizations, one intra-op thread."""
    import onnx

    return judge_session(onnx.load(str(path)))


def ort_outputs(path: str | Path, feeds: Mapping[str, np.ndarray], session=None) -> dict[str, np.ndarray]:
    """The judge's outputs for ``feeds``, by output name (``session`` reuses one)."""
    session = session or ort_session(path)
    names = [o.name for o in session.get_outputs()]
    return dict(zip(names, session.run(names, dict(feeds))))


def ort_sensitivity(path: str | Path, feeds: Mapping[str, np.ndarray], seeds: int = 3) -> float:
    """How far onnxruntime moves from itself when the float inputs and float weights move
    by one unit in the last place (half of the elements, ``seeds`` draws): the largest
    error, measured as :func:`output_error` measures egraft's.

    A dynamically quantized model amplifies rounding: a 1-ulp difference upstream puts an
    activation on the other side of a ``DynamicQuantizeLinear`` rounding step, a whole
    quantum (1/255 of the range) moves, and the integer products after it carry that
    on. No engine that does not reproduce onnxruntime's float rounding bit for bit can
    be held closer to it than onnxruntime is to itself on nudged data: this is the
    measure a model's documented tolerance cites.
    """
    import onnx
    from onnx import numpy_helper

    model = onnx.load(str(path))
    base = ort_outputs(path, feeds)
    worst = 0.0
    for seed in range(seeds):
        rng = np.random.default_rng(seed)

        def nudge(a: np.ndarray) -> np.ndarray:
            if a.dtype not in (np.float32, np.float64):
                return a
            return np.where(rng.random(a.shape) < 0.5, np.nextafter(a, np.inf).astype(a.dtype), a)

        nudged = onnx.ModelProto.FromString(model.SerializeToString())
        for k, t in enumerate(nudged.graph.initializer):
            array = numpy_helper.to_array(t)
            if array.size > 16:
                nudged.graph.initializer[k].CopyFrom(numpy_helper.from_array(nudge(array), t.name))
        session = judge_session(nudged)
        names = [o.name for o in session.get_outputs()]
        moved = dict(zip(names, session.run(names, {k: nudge(np.asarray(v)) for k, v in feeds.items()})))
        worst = max(worst, compare_outputs(moved, base).error)
    return worst


__all__ = ["SCALE_FLOOR", "output_error", "Comparison", "compare_outputs", "judge_session", "ort_session",
           "ort_outputs", "ort_sensitivity"]

"""Running one corpus model on one egraft backend at every binding of its manifest entry,
each run judged against onnxruntime (:mod:`egraft.testing.corpus.compare`).

The backends: ``reference``, egraft's numpy executor (``egraft.load(path).run(feeds)``),
and ``compiled``, native code (``egraft.compile(path)`` once, then ``.run(feeds)`` per
binding). A failure is a result, never an exception: its ``failure`` holds the error's
type and first line, ``where`` the innermost egraft source line it came from.

Example:
    >>> results = run_model(entry("akiki_vad"), "compiled")       # doctest: +SKIP
    >>> results[0].passed, results[0].error                       # doctest: +SKIP
    (True, 2.1e-07)
"""

from __future__ import annotations

import time
import traceback
from dataclasses import asdict, dataclass
from pathlib import Path

from egraft.testing.corpus import Binding, Entry, entry, make_feeds, model_path
from egraft.testing.corpus.compare import compare_outputs, ort_outputs, ort_session

#: The egraft backends a corpus model runs on.
BACKENDS = ("reference", "compiled")
#: Also: the CUDA build run on the emulated device (the CUDA C compiled for this CPU: slow).
ALL_BACKENDS = (*BACKENDS, "cuda-emulated")


@dataclass(frozen=True)
class Result:
    """One model on one backend at one binding.

    Attributes:
        model / backend / binding: what ran (``binding`` as :attr:`Binding.label`).
        error: the scale-relative error against onnxruntime (``None`` if it did not run).
        worst: the output with that error.
        tolerance: the entry's tolerance.
        fallbacks: nodes left on reference kernels (compiled backend; ``None`` otherwise).
        compile_seconds: ``egraft.compile``'s time (``egraft.load``'s for the reference).
        run_seconds: the run's time.
        failure: ``Type: first line`` of the error that stopped it, else ``None``.
        where: the innermost egraft ``file:line`` in that error's traceback.
    """

    model: str
    backend: str
    binding: str
    error: float | None = None
    worst: str = ""
    tolerance: float = 1e-3
    fallbacks: int | None = None
    compile_seconds: float | None = None
    run_seconds: float | None = None
    failure: str | None = None
    where: str | None = None

    @property
    def passed(self) -> bool:
        """It ran, and every output is within the tolerance."""
        return self.failure is None and self.error is not None and self.error <= self.tolerance

    def as_dict(self) -> dict:
        """The fields and ``passed``, for JSON."""
        return {**asdict(self), "passed": self.passed}


def describe(err: BaseException) -> tuple[str, str | None]:
    """``(Type: first line, egraft/file.py:line)`` of an error: the innermost frame inside
    the egraft package (not this corpus tooling), or ``None`` when there is none."""
    lines = str(err).strip().splitlines()
    head = f"{type(err).__name__}: {lines[0] if lines else ''}".rstrip(": ")
    where = None
    for frame in traceback.extract_tb(err.__traceback__):
        path = Path(frame.filename).as_posix()
        if "/egraft/" in path and "/egraft/testing/corpus/" not in path and "/benchmarks/" not in path:
            where = f"egraft/{path.rsplit('/egraft/', 1)[1]}:{frame.lineno}"
    return head, where


def _prepare(backend: str, path: Path):
    import egraft

    if backend == "reference":
        return egraft.load(path)
    if backend == "compiled":
        return egraft.compile(path, specialize="off")  # the generic build: what the corpus judges
    if backend == "cuda-emulated":
        return egraft.compile(path, target="cuda", device="emulator")
    raise ValueError(f"backend {backend!r}; known: {', '.join(ALL_BACKENDS)}")


def _fallbacks(runner, binding: Binding) -> int | None:
    if hasattr(runner, "program"):  # a CUDA model: the same fallbacks at every binding
        return len(runner.report()["fallbacks"])
    try:
        return len(runner.report(binding.dims).fallbacks)
    except Exception:  # a report is a nicety; the run decides
        return None


def run_model(e: Entry | str, backend: str, seed: int = 0, path: Path | None = None) -> list[Result]:
    """Run ``e`` on ``backend`` at each of its bindings; one :class:`Result` per binding."""
    e = entry(e) if isinstance(e, str) else e
    path = Path(path) if path else model_path(e.name)
    base = dict(model=e.name, backend=backend, tolerance=e.tolerance)
    start = time.perf_counter()
    try:
        runner = _prepare(backend, path)
    except Exception as err:
        failure, where = describe(err)
        seconds = time.perf_counter() - start
        return [
            Result(**base, binding=b.label, compile_seconds=seconds, failure=failure, where=where) for b in e.bindings
        ]
    prepare_seconds = time.perf_counter() - start
    session = ort_session(path)
    results = []
    for binding in e.bindings:
        feeds = make_feeds(e, binding, seed)
        fallbacks = _fallbacks(runner, binding) if backend != "reference" else None
        row = dict(base, binding=binding.label, fallbacks=fallbacks, compile_seconds=prepare_seconds)
        try:
            reference = ort_outputs(path, feeds, session)
        except Exception as err:
            failure, _ = describe(err)
            results.append(Result(**row, failure=f"judge (onnxruntime) failed: {failure}"))
            continue
        start = time.perf_counter()
        try:
            outputs = runner.run(feeds)
            seconds = time.perf_counter() - start
            comparison = compare_outputs(outputs, reference)
        except Exception as err:
            failure, where = describe(err)
            results.append(Result(**row, failure=failure, where=where))
            continue
        results.append(Result(**row, error=comparison.error, worst=comparison.worst, run_seconds=seconds))
    return results


__all__ = ["BACKENDS", "ALL_BACKENDS", "Result", "describe", "run_model"]

"""The judge of a generated case: onnxruntime (basic graph optimizations only) runs it at
both bindings, and each egraft backend's outputs must match: floats by scale-relative
error ``max|a - r| / max(max|r|, 1e-3) <= 1e-3``, integers and bools exactly.

When a backend disagrees with onnxruntime, a float64 evaluation (the model with every
float32 made float64, run by ``onnx.reference``, which is independent of egraft) decides:
if the backend matches it and onnxruntime does not, onnxruntime was the one off
(``ok``, noted); if neither matches it the graph is too ill-conditioned to judge
(``ill-conditioned``); otherwise it is the backend's ``mismatch``.

Outcomes: ``ok``, ``mismatch``, ``crash`` (egraft raised something other than a clean
refusal), ``refusal`` (an :class:`~egraft.errors.EgraftError` saying an op or attribute is
unsupported; :func:`refusal_reason` names it), ``invalid`` (onnxruntime rejects the graph:
the generator's fault), ``ill-conditioned``.

Example:
    >>> results = check(generate(3))                   # doctest: +SKIP
    >>> {r.backend: r.outcome for r in results}        # doctest: +SKIP
    {'reference': 'ok', 'compiled': 'ok'}
"""

from __future__ import annotations

import re
import traceback
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import onnx

from egraft.errors import EgraftError, UnsupportedOpError

BACKENDS = ("reference", "compiled")
#: Backends :func:`check` knows: the two above and the compiled one without rewriting.
ALL_BACKENDS = (*BACKENDS, "compiled-norewrite")
TOLERANCE = 1e-3
OUTCOMES = ("ok", "mismatch", "crash", "refusal", "invalid", "ill-conditioned")


@dataclass
class Result:
    """How one backend did on one case: ``outcome`` (one of :data:`OUTCOMES`); for a
    mismatch the ``output``, ``binding`` (0 or 1) and ``error``; for a crash or refusal the
    error text in ``detail``."""

    backend: str
    outcome: str
    detail: str = ""
    output: str | None = None
    binding: int | None = None
    error: float | None = None

    @property
    def signature(self) -> tuple:
        """What a minimized model must keep failing with: the backend, the outcome and, for
        a crash, the exception type."""
        kind = self.detail.split(":", 1)[0] if self.outcome in ("crash", "refusal") else ""
        return self.backend, self.outcome, kind


def ort_run(model: onnx.ModelProto, feeds: Sequence[dict[str, np.ndarray]]) -> list[dict[str, np.ndarray]]:
    """onnxruntime's outputs (basic optimizations, 1 thread) for each of ``feeds``."""
    from egraft.testing.bench import ort_session

    session = ort_session(model, threads=1, exact=True)
    names = [o.name for o in session.get_outputs()]
    return [dict(zip(names, session.run(None, f))) for f in feeds]


def to_float64(model: onnx.ModelProto) -> onnx.ModelProto:
    """``model`` with every float32 tensor, value and Cast made float64 (Resize's scales
    stay float32: the op requires it)."""
    m = onnx.ModelProto()
    m.CopyFrom(model)
    g = m.graph
    keep = {n.input[2] for n in g.node if n.op_type == "Resize" and len(n.input) > 2}
    for v in [*g.input, *g.output, *g.value_info]:
        if v.type.tensor_type.elem_type == onnx.TensorProto.FLOAT:
            v.type.tensor_type.elem_type = onnx.TensorProto.DOUBLE
    for i, t in enumerate(g.initializer):
        if t.data_type == onnx.TensorProto.FLOAT and t.name not in keep:
            arr = onnx.numpy_helper.to_array(t).astype(np.float64)
            g.initializer[i].CopyFrom(onnx.numpy_helper.from_array(arr, t.name))
    for n in g.node:
        for a in n.attribute:
            if n.op_type == "Cast" and a.name == "to" and a.i == onnx.TensorProto.FLOAT:
                a.i = onnx.TensorProto.DOUBLE
            if a.type == onnx.AttributeProto.TENSOR and a.t.data_type == onnx.TensorProto.FLOAT:
                arr = onnx.numpy_helper.to_array(a.t).astype(np.float64)
                a.t.CopyFrom(onnx.numpy_helper.from_array(arr, a.t.name))
    return m


def float64_run(model: onnx.ModelProto, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The outputs of ``model`` evaluated in float64 by onnx's reference evaluator."""
    from onnx.reference import ReferenceEvaluator

    wide = to_float64(model)
    session = ReferenceEvaluator(wide)
    feeds64 = {k: v.astype(np.float64) if v.dtype == np.float32 else v for k, v in feeds.items()}
    names = [o.name for o in wide.graph.output]
    return dict(zip(names, session.run(None, feeds64)))


def difference(got: np.ndarray, want: np.ndarray) -> float:
    """0 when ``got`` matches ``want``; else the scale-relative error (floats) or 1 (a
    differing integer, bool, NaN position, dtype or shape) or inf (a shape mismatch)."""
    got, want = np.asarray(got), np.asarray(want)
    if got.shape != want.shape:
        return float("inf")
    if want.dtype.kind not in "fc":
        return 0.0 if np.array_equal(got, want) else 1.0
    g, w = got.astype(np.float64), want.astype(np.float64)
    finite = np.isfinite(w)
    if not np.array_equal(np.isnan(g), np.isnan(w)) or not np.array_equal(g[np.isinf(w)], w[np.isinf(w)]):
        return 1.0
    if not finite.any():
        return 0.0
    scale = max(float(np.abs(w[finite]).max()), 1e-3)
    return float(np.abs(g[finite] - w[finite]).max()) / scale


def classify_error(e: BaseException) -> tuple[str, str]:
    """``("refusal", reason)`` for an error that says egraft does not support something,
    else ``("crash", "Type: message")``."""
    text = f"{type(e).__name__}: {e}"
    if isinstance(e, UnsupportedOpError) or (
            isinstance(e, EgraftError) and re.search(r"not supported|unsupported|not implemented", str(e))):
        return "refusal", text
    return "crash", text


def refusal_reason(detail: str) -> str:
    """A refusal's message without node names, numbers and value names, so that refusals
    of one kind tally together."""
    text = detail.split(": ", 1)[-1].splitlines()[0]
    text = re.sub(r"\bn\d+_(\w+)", r"\1", text)
    text = re.sub(r"'[^']*'|\"[^\"]*\"", "'_'", text)
    text = re.sub(r"%\w+|@\w+|\b[vcwx]\d+\b", "_", text)
    text = re.sub(r"-?\d+(\.\d+)?", "#", text)
    return text[:120]


def _build(backend: str, model: onnx.ModelProto):
    import egraft

    if backend == "reference":
        return egraft.load(model)
    if backend == "compiled-norewrite":  # tells a rewrite's bug from a kernel's
        return egraft.compile(model, use_cache=False, rewrite=False, specialize="off")
    return egraft.compile(model, use_cache=False, specialize="off")


def check(case, backends: Sequence[str] = BACKENDS, expected: Sequence[dict] | None = None) -> list[Result]:
    """Run ``case`` (a :class:`~egraft.testing.fuzz.generate.FuzzCase` or anything with
    ``model`` and ``feeds``) on each backend and judge it; one :class:`Result` per backend.
    ``expected`` gives onnxruntime's outputs when they are already known."""
    if expected is None:
        try:
            expected = ort_run(case.model, case.feeds)
        except Exception as e:  # onnxruntime rejects the graph: the generator's fault
            return [Result(b, "invalid", f"{type(e).__name__}: {str(e).splitlines()[0][:300]}") for b in backends]
    wide: list = [None, None]
    return [_check_backend(b, case, expected, wide) for b in backends]


def _check_backend(backend: str, case, expected, wide) -> Result:
    try:
        runner = _build(backend, case.model)
    except Exception as e:
        outcome, detail = classify_error(e)
        return Result(backend, outcome, detail + _where(e, outcome))
    noted = ""
    for k, feeds in enumerate(case.feeds):
        try:
            got = runner.run(feeds)
        except Exception as e:
            outcome, detail = classify_error(e)
            return Result(backend, outcome, detail + _where(e, outcome), binding=k)
        for name, want in expected[k].items():
            if name not in got:
                return Result(backend, "mismatch", f"output {name} missing", name, k, float("inf"))
            a = np.asarray(got[name])
            if a.dtype != want.dtype:
                return Result(backend, "mismatch", f"dtype {a.dtype} != {want.dtype}", name, k, float("inf"))
            err = difference(a, want)
            if err <= TOLERANCE:
                continue
            if err == float("inf"):
                return Result(backend, "mismatch", f"shape {a.shape} != {want.shape}", name, k, err)
            if wide[k] is None:
                try:
                    wide[k] = float64_run(case.model, feeds)
                except Exception as e:
                    wide[k] = f"{type(e).__name__}: {e}"
            if isinstance(wide[k], str):
                return Result(backend, "mismatch", f"error {err:.3g} (float64 check failed: {wide[k][:100]})",
                              name, k, err)
            truth = wide[k][name]
            mine, theirs = difference(a, truth.astype(a.dtype) if a.dtype.kind not in "fc" else truth), difference(
                want, truth.astype(want.dtype) if want.dtype.kind not in "fc" else truth)
            if mine <= TOLERANCE < theirs:
                noted = f"onnxruntime off on {name}: {theirs:.3g} from float64, egraft {mine:.3g}"
                continue
            if theirs > TOLERANCE:
                return Result(backend, "ill-conditioned", f"error {err:.3g}; float64: egraft {mine:.3g}, "
                              f"onnxruntime {theirs:.3g}", name, k, err)
            return Result(backend, "mismatch", f"error {err:.3g} (float64 agrees with onnxruntime: {theirs:.3g})",
                          name, k, err)
    return Result(backend, "ok", noted)


def _where(e: BaseException, outcome: str) -> str:
    """For a crash, the innermost frames of the traceback inside egraft."""
    if outcome != "crash":
        return ""
    frames = [f for f in traceback.extract_tb(e.__traceback__) if "/egraft/" in f.filename]
    return "".join(f"\n  at {f.filename.split('/egraft/')[-1]}:{f.lineno} {f.name}" for f in frames[-3:])

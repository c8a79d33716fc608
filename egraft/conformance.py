"""The ONNX backend node conformance suite, run through egraft.

Every case that ``onnx.backend.test.case.node.collect_testcases()`` generates is
imported with :func:`egraft.load` and run with the reference executor; its outputs are
compared with the case's expected outputs at the case's own tolerances.

A case is one of:
- ``pass``: every output matches;
- ``wrong``: it ran and some output differs (wrong values, shape or dtype);
- ``unsupported``: egraft refused it (an unsupported op, dtype or value kind);
- ``error``: egraft failed while importing or running it (a bug to fix).

The *core* subset holds the cases whose graph inputs and outputs are all tensors of
float32, float64, float16, int8/16/32/64, uint8 or bool.
"""

from __future__ import annotations

import warnings
from collections import defaultdict
from dataclasses import asdict, dataclass

import numpy as np
import onnx

from egraft.errors import EgraftError, UnsupportedOpError

CORE_DTYPES = {
    onnx.TensorProto.FLOAT, onnx.TensorProto.DOUBLE, onnx.TensorProto.FLOAT16, onnx.TensorProto.INT8,
    onnx.TensorProto.INT16, onnx.TensorProto.INT32, onnx.TensorProto.INT64, onnx.TensorProto.UINT8,
    onnx.TensorProto.BOOL,
}


@dataclass(frozen=True)
class CaseResult:
    """The outcome of one conformance case."""

    name: str
    ops: tuple[str, ...]
    core: bool
    status: str  # pass | wrong | unsupported | error
    detail: str = ""
    #: backend cpu: True when some node ran on its reference kernel (no generated code).
    fallback: bool = False
    #: backend cpu: the ops that ran on reference kernels.
    fallback_ops: tuple[str, ...] = ()


def collect_cases():
    """The node test cases of the installed onnx package."""
    from onnx.backend.test.case.node import collect_testcases

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with np.errstate(all="ignore"):
            return collect_testcases()


def is_core(model: onnx.ModelProto) -> bool:
    """True when all graph inputs and outputs are tensors of a core dtype."""
    for v in list(model.graph.input) + list(model.graph.output):
        if not v.type.HasField("tensor_type") or v.type.tensor_type.elem_type not in CORE_DTYPES:
            return False
    return True


def case_ops(model: onnx.ModelProto) -> tuple[str, ...]:
    """The op types a case tests: its non-Constant top-level nodes, or all when only Constants."""
    ops = sorted({n.op_type for n in model.graph.node if n.op_type != "Constant"})
    return tuple(ops) or ("Constant",)


def _close(expected: np.ndarray, actual: np.ndarray, rtol: float, atol: float) -> str | None:
    expected = np.asarray(expected)
    actual = np.asarray(actual)
    if expected.dtype != actual.dtype:
        return f"dtype {actual.dtype}, expected {expected.dtype}"
    if expected.shape != actual.shape:
        return f"shape {list(actual.shape)}, expected {list(expected.shape)}"
    if expected.dtype.kind in "OSU":
        return None if np.array_equal(expected, actual) else "values differ"
    if expected.dtype.kind == "b" or expected.dtype.kind in "iu":
        return None if np.array_equal(expected, actual) else "values differ"
    e = expected.astype(np.float64)
    a = actual.astype(np.float64)
    ok = np.isclose(a, e, rtol=rtol, atol=atol, equal_nan=True)
    if ok.all():
        return None
    err = np.nanmax(np.abs(a - e)[~ok]) if (~ok).any() else 0.0
    return f"max abs error {err:.3g} (rtol={rtol}, atol={atol})"


def run_case(case, backend: str = "reference") -> CaseResult:
    """Run one conformance case through egraft: with the reference executor, or compiled
    for the CPU (``backend="cpu"``: the model as loaded, no rewriting, so each case tests
    the generated kernels of its ops)."""
    import egraft

    model = case.model
    core = is_core(model)
    ops = case_ops(model)
    fallback = False
    fallback_ops: tuple[str, ...] = ()
    try:
        graph = egraft.load(model)
        run = graph.run
        if backend == "cpu":
            from egraft.lowering.compile import compile_graph

            compiled = compile_graph(graph)
            fallback_ops = tuple(sorted({op for _, op, _ in compiled.report().fallbacks}))
            fallback = bool(fallback_ops)
            run = compiled.run
        for inputs, expected in case.data_sets:
            # A few cases store their data as TensorProtos (e.g. float16 casts).
            inputs = [onnx.numpy_helper.to_array(x) if isinstance(x, onnx.TensorProto) else x for x in inputs]
            feeds = {v.name: x for v, x in zip(graph.inputs, inputs)}
            if len(inputs) != len(graph.inputs):
                # Cases may omit optional inputs; feed by declared position in the model.
                names = [i.name for i in model.graph.input]
                feeds = {n: x for n, x in zip(names, inputs) if n in {v.name for v in graph.inputs}}
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                outputs = run(feeds)
            for i, (v, want) in enumerate(zip(graph.outputs, expected)):
                if isinstance(want, onnx.TensorProto):  # a few cases store their expected outputs as protos
                    want = onnx.numpy_helper.to_array(want)
                problem = _close(want, outputs[v.name], case.rtol, case.atol)
                if problem:
                    return CaseResult(case.name, ops, core, "wrong", f"output {i}: {problem}", fallback, fallback_ops)
        return CaseResult(case.name, ops, core, "pass", "", fallback, fallback_ops)
    except UnsupportedOpError as e:
        return CaseResult(case.name, ops, core, "unsupported", str(e), fallback, fallback_ops)
    except EgraftError as e:
        return CaseResult(case.name, ops, core, "error", f"{type(e).__name__}: {e}", fallback, fallback_ops)
    except Exception as e:  # a bug in egraft: count it, never hide it
        return CaseResult(case.name, ops, core, "error", f"{type(e).__name__}: {e}", fallback, fallback_ops)


def run_conformance(name_filter: str | None = None, progress=None, backend: str = "reference") -> list[CaseResult]:
    """Run every case (or those whose name contains ``name_filter``) on ``backend``
    (``reference`` or ``cpu``)."""
    cases = [c for c in collect_cases() if c.kind == "node"]
    if name_filter:
        cases = [c for c in cases if name_filter in c.name]
    results = []
    for case in cases:
        results.append(run_case(case, backend))
        if progress is not None:
            progress(case.name)
    return results


def summarize(results: list[CaseResult]) -> dict:
    """Counts for the full suite and the core subset, per status and per op, and pass rates."""

    def counts(rs):
        c = {"pass": 0, "wrong": 0, "unsupported": 0, "error": 0}
        for r in rs:
            c[r.status] += 1
        total = len(rs)
        c["total"] = total
        c["pass_rate"] = round(c["pass"] / total, 4) if total else 0.0
        c["pass_generated"] = sum(r.status == "pass" and not r.fallback for r in rs)
        c["pass_fallback"] = sum(r.status == "pass" and r.fallback for r in rs)
        return c

    per_op: dict[str, list[CaseResult]] = defaultdict(list)
    for r in results:
        for op in r.ops:
            per_op[op].append(r)
    core = [r for r in results if r.core]
    fallback_ops: dict[str, int] = defaultdict(int)
    for r in results:
        for op in r.fallback_ops:
            fallback_ops[op] += 1
    return {
        "fallback_ops": dict(sorted(fallback_ops.items(), key=lambda kv: (-kv[1], kv[0]))),
        "full": counts(results),
        "core": counts(core),
        "per_op": {op: counts(rs) for op, rs in sorted(per_op.items())},
        "failures": [asdict(r) for r in results if r.status != "pass"],
    }


def main(argv: list[str] | None = None) -> None:
    """``python -m egraft.conformance [FILTER]``: a quick text report (the CLI has the table)."""
    import sys

    argv = sys.argv[1:] if argv is None else argv
    results = run_conformance(argv[0] if argv else None)
    summary = summarize(results)
    for r in results:
        if r.status != "pass":
            print(f"{r.status:12s} {r.name}: {r.detail[:200]}")
    print("full:", summary["full"])
    print("core:", summary["core"])


if __name__ == "__main__":
    main()

"""One model of a zoo run, inside its own process: the stages, in order, and the row they fill.

Stages (each needs the one before it; ``--stages`` names those wanted and the
prerequisites join them: ``check`` and ``bench`` need ``compile``, which needs ``optimize``):

- optimize: ``egraft.load`` and :func:`egraft.optimize.optimize` (node counts, e-graph
  size, stop reason, rules fired, the predicted latency under a roofline cost model, the
  plan document);
- compile: the extracted graph to native code (``use_cache=False``: a cold compile is
  measured), kernels and fallbacks with their reasons;
- check: the compiled model against onnxruntime (basic optimizations, one thread) at every
  binding of the model, scale-relative error (:mod:`egraft.testing.corpus.compare`);
  ``mismatch`` above the model's tolerance;
- bench: egraft and onnxruntime (all graph optimizations) at ``threads``, at the first
  binding, in alternating blocks of runs (:func:`egraft.testing.timing.alternating_blocks_ms`).

A failure stops the stages: the row says which stage and the error's type and message.

Run by :mod:`egraft.zoo.isolate` (``python -m egraft.zoo.job TASK.json RESULT.json``, after
the limits are set);
:func:`run_job` is the same thing in this process (tests use it on small models).
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Iterable
from pathlib import Path

STAGES = ("optimize", "compile", "check", "bench")
#: The stage each stage needs first.
_NEEDS = {"compile": "optimize", "check": "compile", "bench": "compile"}


def expand_stages(stages: Iterable[str]) -> list[str]:
    """The stages to run for ``stages``, prerequisites added, in pipeline order.

    Example:
        >>> expand_stages(["check"])
        ['optimize', 'compile', 'check']
    """
    from egraft.errors import EgraftError

    wanted = set()
    for s in stages:
        if s not in STAGES:
            raise EgraftError(f"--stages {s}: unknown stage; known: {','.join(STAGES)}")
        while s:
            wanted.add(s)
            s = _NEEDS.get(s)
    return [s for s in STAGES if s in wanted]


def _bindings(spec: dict, specs, shape: dict[str, int]):
    """The bindings the check and bench stages run at: the spec's (``--shape`` values
    replacing theirs), or one binding of every dim name at ``--shape`` or its default."""
    from egraft.testing.corpus import Binding
    from egraft.zoo.inputs import binding_for

    if not spec["bindings"]:
        return [binding_for(specs, {k: v for k, v in shape.items()})]
    out: list[Binding] = []
    for b in spec["bindings"]:
        dims = {k: shape.get(k, v) for k, v in b["dims"].items()}
        binding = Binding(dims, dict(b.get("values", {})))
        if binding not in out:
            out.append(binding)
    return out


def run_job(spec: dict, settings: dict) -> tuple[dict, str | None]:
    """Run the stages of ``settings["stages"]`` on the model ``spec`` (a
    :meth:`egraft.zoo.sources.ZooModel.spec`); returns the measured fields of its row
    (with ``status``, ``error``, ``stage``) and the plan JSON (or ``None``)."""
    row: dict = {"status": "ok", "error": None, "stage": None, "tolerance": spec["tolerance"],
                 "threads": settings["threads"]}
    plan = None
    stage = "load"
    try:
        import numpy as np

        import egraft
        import egraft.frontend.onnx_import
        from egraft.extract.cost import cost_model
        from egraft.testing.corpus import feeds_from_specs
        from egraft.testing.corpus.run import describe
        from egraft.zoo.inputs import generated_specs

        stages = expand_stages(settings["stages"])
        path = Path(spec["path"])
        t = time.perf_counter()
        proto = egraft.frontend.onnx_import.read_model(path)  # read once: egraft, the inputs and onnxruntime
        graph = egraft.load(proto)
        row["load_s"] = round(time.perf_counter() - t, 4)
        row["nodes_before"] = len(graph.nodes)
        shape = {k: v for k, v in settings["shape"].items() if k in set(graph.symbols())}
        specs = generated_specs(proto, spec["inputs"])
        bindings = _bindings(spec, specs, settings["shape"])
        row["bindings"] = bindings[0].dims
        compiled = None
        if "optimize" in stages:
            stage = "optimize"
            from egraft.extract.plan import build_plan, plan_json
            from egraft.optimize import optimize

            cost = cost_model(settings["cost_model"], None, "cpu", {**bindings[0].dims, **shape})
            t = time.perf_counter()
            result = optimize(graph, settings["rules"], settings["rules_off"], shape, cost=cost,
                              extractor=settings["extractor"])
            row["optimize_s"] = round(time.perf_counter() - t, 4)
            report = result.saturation
            row.update(nodes_after=len(result.graph.nodes), enodes=report.nodes_after,
                       eclasses=report.classes_after, iterations=report.iterations, stop_reason=report.stop_reason,
                       rules={name: s.applied for name, s in sorted(report.rules.items()) if s.applied})
            if result.cost_model.unit == "us":
                row["predicted_ms"] = round(result.extraction.cost / 1e3, 6)
            plan = plan_json(build_plan(result, model_label=spec["name"]))
            graph = result.graph
        if "compile" in stages:
            stage = "compile"
            t = time.perf_counter()
            compiled = egraft.compile(graph, rewrite=False, use_cache=False, threads=settings["threads"],
                                      specialize="off")
            row["compile_s"] = round(time.perf_counter() - t, 4)
            rep = compiled.report(bindings[0].dims)
            row.update(kernels=rep.kernels, fallbacks=len(rep.fallbacks),
                       fallback_reasons=[list(f) for f in rep.fallbacks])
        if "check" in stages:
            stage = "check"
            from egraft.testing.corpus.compare import compare_outputs, judge_session

            judge = judge_session(proto)
            names = [o.name for o in judge.get_outputs()]
            worst, where = 0.0, ""
            for binding in bindings:
                feeds = feeds_from_specs(specs, binding, seed=0)
                outputs = compiled.run(feeds)  # egraft first: a failure here is egraft's own
                try:
                    reference = dict(zip(names, judge.run(names, feeds)))
                except Exception as err:
                    why = describe(err)[0]
                    raise RuntimeError(f"onnxruntime (the judge) failed at {binding.label}: {why}") from None
                try:
                    comparison = compare_outputs(outputs, reference)
                except AssertionError as err:  # a shape or integer-value mismatch is a wrong answer
                    row.update(status="mismatch", stage="check", error=f"{err} at {binding.label}")
                    return row, plan
                if not comparison.error <= worst:
                    worst, where = comparison.error, f"output {comparison.worst!r} at {binding.label}"
                if not np.isfinite(worst):
                    break
            row["max_error"] = float(worst) if np.isfinite(worst) else None
            if not worst <= spec["tolerance"]:
                row.update(status="mismatch", stage="check",
                           error=f"scale-relative error {worst:.3g} > tolerance {spec['tolerance']:g} ({where})")
                return row, plan
        if "bench" in stages:
            stage = "bench"
            from egraft.testing.bench import ort_session
            from egraft.testing.timing import alternating_blocks_ms

            feeds = feeds_from_specs(specs, bindings[0], seed=0)
            session = ort_session(proto, threads=settings["threads"])
            medians = alternating_blocks_ms({"egraft": lambda: compiled.run(feeds),
                                             "onnxruntime": lambda: session.run(None, feeds)},
                                            budget_s=settings.get("bench_seconds", 2.0))
            row.update(egraft_ms=_sig(medians["egraft"]), onnxruntime_ms=_sig(medians["onnxruntime"]),
                       speedup=_sig(medians["onnxruntime"] / medians["egraft"]))
    except MemoryError as err:
        row.update(status="error", stage=stage, error=f"MemoryError: out of memory{_memory_note(err)}")
    except Exception as err:
        row.update(status="error", stage=stage, error=describe(err)[0])
    return row, plan


def _sig(x: float, digits: int = 6) -> float:
    """``x`` to ``digits`` significant digits (a 5 µs latency keeps its precision)."""
    return float(f"{x:.{digits}g}")


def _memory_note(err: MemoryError) -> str:
    cap = os.environ.get("EGRAFT_ZOO_MAX_MEMORY_GB")
    detail = f" ({err})" if str(err) else ""
    return detail + (f" under --max-memory {cap} GB" if cap else "")


def main(argv: list[str]) -> int:
    """``python -m egraft.zoo.job TASK.json RESULT.json``: read the task, run it, write the
    result (``{"row": ..., "plan": ...}``) atomically; exit 0 whatever the model did."""
    task_path, result_path = Path(argv[0]), Path(argv[1])
    task = json.loads(task_path.read_text())
    row, plan = run_job(task["model"], task["settings"])
    partial = result_path.with_suffix(".partial")
    partial.write_text(json.dumps({"row": row, "plan": plan}))
    partial.replace(result_path)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

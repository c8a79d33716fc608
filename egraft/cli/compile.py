"""The compiled-code commands of the ``egraft`` CLI: ``compile``, ``bench`` and ``profile``.

Output paths: ``compile -o DIR`` writes three files into a folder, ``profile -o FILE`` one
file; missing parent folders are created, existing files are refused unless ``--force``
is given, and a path of the wrong kind (a file for ``compile -o``, a folder for
``profile -o``) is refused even with it.

Examples:
    egraft compile resnet50 -o build/
    egraft bench resnet50 --threads 1
    egraft profile resnet50 -o trace.json
"""

from __future__ import annotations

import json
import statistics
import time
from pathlib import Path
from typing import Annotated

import typer
from rich.table import Table

from egraft.cli.common import (
    check_bindings,
    console,
    err_console,
    fail,
    load_model,
    parse_bindings,
    prepare_output,
    read_inputs,
    refuse_overwrite,
    resolve_model,
    write_output,
)
from egraft.errors import EgraftError
from egraft.testing.timing import median_ms

ModelArgument = Annotated[str, typer.Argument(
    help="ONNX file, a bundled model name such as resnet50, or a plan (.json) from egraft plan.")]
ShapeOption = Annotated[list[str] | None, typer.Option(
    "--shape", help="Bind a symbolic dim: NAME=INT (at compile time for compile, for the inputs otherwise).")]
RulesOption = Annotated[list[Path] | None, typer.Option("--rules", help="Extra rule file (repeatable).")]
RulesOffOption = Annotated[list[str] | None, typer.Option("--rules-off", help="Rule set to switch off.")]
NoRewriteOption = Annotated[bool, typer.Option("--no-rewrite", help="Compile the model as loaded, without rules.")]
NoCacheOption = Annotated[bool, typer.Option("--no-cache", help="Neither read nor write the compile cache.")]
AssumeOption = Annotated[list[str] | None, typer.Option(
    "--assume", help="A shape assumption the build may use and every run checks, e.g. 'seq <= 512' or "
                     "'height % 32 == 0' (repeatable).")]


def _compile(model: str, shape, rules, rules_off, no_rewrite: bool, no_cache: bool, specialize: bool = False,
             assume: list[str] | None = None):
    """Compile ``model`` (a path, a bundled name or a plan) with a spinner; returns a
    function giving the ONNX model (parsed only when asked: the cache key reads the file's
    bytes) and the compiled model."""
    import egraft
    from egraft.frontend.onnx_import import read_model

    if model.endswith(".json"):  # a plan: its model, extracted again with its settings
        with err_console.status("compiling the plan: rewrite, extract, generate kernels, LLVM -O3", spinner="dots"):
            compiled = egraft.compile(model, use_cache=not no_cache, specialize="off")
        return (lambda: egraft.to_onnx(compiled.graph)), compiled
    path = resolve_model(model)
    if specialize and shape:
        check_bindings(parse_bindings(shape), load_model(model), model)  # before the compile, not after it
    with err_console.status("compiling: rewrite, extract, generate kernels, LLVM -O3", spinner="dots"):
        compiled = egraft.compile(path, shape=parse_bindings(shape) if specialize else None,
                                  rules=[str(r) for r in rules or []], rules_off=list(rules_off or []),
                                  rewrite=not no_rewrite, use_cache=not no_cache, assume=list(assume or []),
                                  specialize="off")  # one process, one run: no background variants
    return (lambda: read_model(path)), compiled


def _inputs_first(model: str, shape, quiet: bool = False):
    """The generated inputs of ``model`` at ``--shape``, made (and ``--shape`` checked)
    before anything is compiled; ``None`` for a plan, whose model is known only once it is
    compiled."""
    if model.endswith(".json"):
        return None
    graph = load_model(model)
    bindings = parse_bindings(shape)
    check_bindings(bindings, graph, model)
    return read_inputs(graph, None, bindings, quiet=quiet)


def _report_table(compiled, seconds: float) -> None:
    report = compiled.report()
    table = Table(title="compiled")
    table.add_column("what")
    table.add_column("value", justify="right")
    table.add_row("kernels (generated code)", str(report.kernels))
    table.add_row("views (no data moved)", str(report.views))
    if report.controls:
        table.add_row("If/Loop/Scan with compiled bodies", str(report.controls))
    table.add_row("on reference kernels", str(len(report.fallbacks)))
    if report.peak_bytes is not None:
        at = ", ".join(f"{k}={v}" for k, v in report.bindings.items())
        ratio = report.peak_bytes / report.no_reuse_bytes if report.no_reuse_bytes else 1.0
        table.add_row(f"arena peak{f' at {at}' if at else ''}", f"{report.peak_bytes / 2**20:.2f} MiB")
        table.add_row("without buffer reuse",
                      f"{report.no_reuse_bytes / 2**20:.2f} MiB (the peak is {ratio:.2f} of it)")
    table.add_row("compile time", f"{seconds:.2f} s" + (" (from the cache)" if compiled.cache_hit else ""))
    for stage, s in report.seconds.items():
        table.add_row(f"  {stage}", f"{s:.2f} s")
    console.print(table)
    if report.fallbacks:
        fallback = Table(title="nodes on reference kernels")
        for col in ("node", "op", "why"):
            fallback.add_column(col)
        for label, op, reason in report.fallbacks:
            fallback.add_row(label, op, reason)
        console.print(fallback)


def compile_command(
    model: ModelArgument,
    output: Annotated[Path | None, typer.Option(
        "--output", "-o", help="Write the build here: module.ll (LLVM IR), model.opt.onnx, report.json.")] = None,
    shape: ShapeOption = None,
    rules: RulesOption = None,
    rules_off: RulesOffOption = None,
    no_rewrite: NoRewriteOption = False,
    no_cache: NoCacheOption = False,
    assume: AssumeOption = None,
    force: Annotated[bool, typer.Option("--force", help="Overwrite the files in --output.")] = False,
    as_json: Annotated[bool, typer.Option("--json", help="Print the report as JSON.")] = False,
    target: Annotated[str, typer.Option(
        "--target", help="cpu (LLVM for this CPU) or cuda (CUDA C through NVRTC; no GPU needed).")] = "cpu",
    arch: Annotated[str | None, typer.Option(
        "--arch", help="--target cuda: the GPU architecture, sm_XX (default sm_90: H100, H200).")] = None,
) -> None:
    """Compile a model to native code for this CPU (or CUDA kernels for a GPU) and report what
    was generated: kernels, ops left on reference kernels (and why), the memory plan and
    the time per stage; for CUDA, each kernel's registers, spills and shared memory.

    Example: egraft compile resnet50 --shape batch=1 -o build/
    """
    import egraft

    if target not in ("cpu", "cuda"):
        raise fail(f"--target {target}: unknown target; known: cpu, cuda")
    if target == "cuda":
        from egraft.cli.cuda import compile_cuda_command

        return compile_cuda_command(model, output, shape, rules, rules_off, no_rewrite, no_cache, force, as_json,
                                    arch)
    if arch is not None:
        raise fail(f"--arch {arch}: only with --target cuda")
    try:
        if output is not None:
            refuse_overwrite(output, force, kind="folder")
            for name in ("module.ll", "model.opt.onnx", "report.json"):
                refuse_overwrite(output / name, force)
        start = time.perf_counter()
        _, compiled = _compile(model, shape, rules, rules_off, no_rewrite, no_cache, specialize=True, assume=assume)
        seconds = time.perf_counter() - start
        report = compiled.report()
        document = {
            "model": model, "kernels": report.kernels, "views": report.views, "controls": report.controls,
            "fallbacks": [{"node": n, "op": o, "reason": r} for n, o, r in report.fallbacks],
            "peak_bytes": report.peak_bytes, "no_reuse_bytes": report.no_reuse_bytes, "bindings": report.bindings,
            "seconds": round(seconds, 4), "stages": {k: round(v, 4) for k, v in report.seconds.items()},
            "cache_hit": compiled.cache_hit,
        }
        if output is not None:
            try:
                prepare_output(output / "module.ll").write_text(compiled.module_text)
                egraft.save_onnx(compiled.graph, output / "model.opt.onnx")
                (output / "report.json").write_text(json.dumps(document, indent=1) + "\n")
            except OSError as e:
                raise EgraftError(f"{output}: cannot write the build: {e.strerror}") from None
    except EgraftError as e:
        raise fail(str(e)) from None
    if as_json:
        print(json.dumps(document, indent=1))
        return
    _report_table(compiled, seconds)
    if output is not None:
        console.print(f"wrote {output}/module.ll, model.opt.onnx, report.json")


def bench(
    model: ModelArgument,
    threads: Annotated[int | None, typer.Option(help="Threads for egraft and for onnxruntime (default: every "
                                                     "core, or $EGRAFT_NUM_THREADS).")] = None,
    repeat: Annotated[int, typer.Option(help="Timed runs (the median is reported).")] = 20,
    warmup: Annotated[int, typer.Option(help="Untimed runs first.")] = 3,
    shape: ShapeOption = None,
    no_cache: NoCacheOption = False,
    assume: AssumeOption = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON.")] = False,
) -> None:
    """Median latency of the compiled model and of onnxruntime on the same inputs, in one run.

    Example: egraft bench resnet50 --threads 1
    """

    try:
        import onnxruntime as ort
    except ImportError:
        raise fail("bench needs onnxruntime: pip install 'egraft[dev]'") from None
    try:
        feeds = _inputs_first(model, shape, quiet=as_json)
        source, compiled = _compile(model, shape, None, None, False, no_cache, assume=assume)
        proto = source()
        if feeds is None:
            feeds = read_inputs(compiled.graph, None, parse_bindings(shape), quiet=as_json)
    except EgraftError as e:
        raise fail(str(e)) from None
    from egraft.lowering.runtime import default_threads

    if threads is not None and threads < 1:
        raise fail(f"--threads {threads}: give 1 or more")
    threads = threads or default_threads()
    compiled.threads = threads
    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    options.inter_op_num_threads = 1
    options.log_severity_level = 3
    session = ort.InferenceSession(proto.SerializeToString(), options, providers=["CPUExecutionProvider"])
    ours = median_ms(lambda: compiled.run(feeds), repeat, warmup)
    theirs = median_ms(lambda: session.run(None, feeds), repeat, warmup)
    result = {"model": model, "threads": threads, "repeat": repeat, "egraft_ms": float(f"{ours:.6g}"),
              "onnxruntime_ms": float(f"{theirs:.6g}"), "ratio": float(f"{ours / theirs:.6g}"),
              "fallbacks": len(compiled.report().fallbacks)}
    if as_json:
        print(json.dumps(result, indent=1))
        return
    table = Table(title=f"{model}: median of {repeat} runs, egraft and onnxruntime at {threads} thread(s)")
    for col in ("egraft ms", "onnxruntime ms", "egraft / onnxruntime", "ops on reference kernels"):
        table.add_column(col, justify="right")
    table.add_row(f"{ours:.3f}", f"{theirs:.3f}", f"{ours / theirs:.2f}", str(result["fallbacks"]))
    console.print(table)


def profile(
    model: ModelArgument,
    output: Annotated[Path, typer.Option("--output", "-o", help="The Chrome trace (JSON) to write.")],
    runs: Annotated[int, typer.Option(help="Profiled runs (each one a row of the timeline).")] = 5,
    top: Annotated[int, typer.Option(help="How many of the slowest kernels to list.")] = 10,
    shape: ShapeOption = None,
    force: Annotated[bool, typer.Option("--force", help="Overwrite --output.")] = False,
) -> None:
    """Time every step of the compiled model and write a Chrome trace (opens in Perfetto or
    chrome://tracing); print the kernels that take the most time.

    Example: egraft profile resnet50 -o trace.json
    """

    try:
        refuse_overwrite(output, force)
        feeds = _inputs_first(model, shape)
        _, compiled = _compile(model, shape, None, None, False, False)
        if feeds is None:
            feeds = read_inputs(compiled.graph, None, parse_bindings(shape))
        compiled.run(feeds)  # warm up
        timings = []
        for _ in range(runs):
            record: list = []
            compiled.run(feeds, profile=record)
            timings.append(record)
    except EgraftError as e:
        raise fail(str(e)) from None
    origin = timings[0][0].start_ns if timings and timings[0] else 0
    events = [{"name": t.label, "cat": t.kind, "ph": "X", "pid": 1, "tid": run + 1,
               "ts": (t.start_ns - origin) / 1e3, "dur": (t.end_ns - t.start_ns) / 1e3,
               "args": {"op": t.op, "node": t.index, "kind": t.kind}}
              for run, record in enumerate(timings) for t in record]
    events += [{"name": "thread_name", "ph": "M", "pid": 1, "tid": run + 1, "args": {"name": f"run {run + 1}"}}
               for run in range(len(timings))]
    try:
        write_output(output, json.dumps({"traceEvents": events, "displayTimeUnit": "ms"}) + "\n")
    except EgraftError as e:
        raise fail(str(e)) from None
    per_step: dict[int, list[float]] = {}
    for record in timings:
        for t in record:
            if t.depth == 0:  # a body's steps are inside their control step's time
                per_step.setdefault(t.index, []).append((t.end_ns - t.start_ns) / 1e6)
    labels = {t.index: (t.label, t.op, t.kind) for t in timings[0] if t.depth == 0} if timings else {}
    total = sum(statistics.median(v) for v in per_step.values()) or 1.0
    ranked = sorted(per_step.items(), key=lambda kv: -statistics.median(kv[1]))[:top]
    table = Table(title=f"the {len(ranked)} slowest steps (median of {runs} runs; all steps {total:.3f} ms)")
    for col in ("node", "op", "kind", "ms", "share"):
        table.add_column(col, justify="right" if col in ("ms", "share") else "left")
    for index, values in ranked:
        label, op, kind = labels[index]
        ms = statistics.median(values)
        table.add_row(label, op, kind, f"{ms:.3f}", f"{ms / total:.1%}")
    console.print(table)
    console.print(f"wrote {output} ({len(events)} events): open it in https://ui.perfetto.dev")


__all__ = ["compile_command", "bench", "profile"]

"""``egraft compile --target cuda``: compile a model's kernels as CUDA C for an explicit
architecture (NVRTC, no GPU needed) and report each kernel's registers, spills and shared
memory; ``-o DIR`` writes the sources, the cubins and the report.

Example:
    egraft compile resnet50 --target cuda --arch sm_90 -o build-cuda/
"""

from __future__ import annotations

import json
import time
from pathlib import Path

from rich.markup import escape
from rich.table import Table

from egraft.cli.common import (
    console,
    err_console,
    fail,
    parse_bindings,
    prepare_output,
    refuse_overwrite,
    resolve_model,
)
from egraft.errors import EgraftError

#: What ``-o DIR`` holds.
OUTPUT_FILES = ("kernels.cu", "model.opt.onnx", "report.json", "cubins")


def compile_cuda_command(model: str, output: Path | None, shape, rules, rules_off, no_rewrite: bool, no_cache: bool,
                         force: bool, as_json: bool, arch: str | None) -> None:
    import egraft

    try:
        if output is not None:
            refuse_overwrite(output, force, kind="folder")
            for name in OUTPUT_FILES[:3]:
                refuse_overwrite(output / name, force)
        if model.endswith(".json"):
            raise EgraftError(f"{model}: compiling a plan for --target cuda is not supported yet; give the model")
        path = resolve_model(model)
        start = time.perf_counter()
        with err_console.status("compiling for CUDA: rewrite, extract, generate CUDA C, NVRTC", spinner="dots"):
            compiled = egraft.compile(path, target="cuda", arch=arch, shape=parse_bindings(shape),
                                      rules=[str(r) for r in rules or []], rules_off=list(rules_off or []),
                                      rewrite=not no_rewrite, use_cache=not no_cache)
        seconds = time.perf_counter() - start
        document = {"model": model, **compiled.report(), "total_seconds": round(seconds, 3)}
        if output is not None:
            try:
                prepare_output(output / "kernels.cu").write_text(compiled.program.kernels.text)
                egraft.save_onnx(compiled.graph, output / "model.opt.onnx")
                cubins = output / "cubins"
                cubins.mkdir(exist_ok=True)
                for digest, module in compiled.program.modules.items():
                    (cubins / f"{digest}.cubin").write_bytes(module.cubin)
                (output / "report.json").write_text(json.dumps(document, indent=1) + "\n")
            except OSError as e:
                raise EgraftError(f"{output}: cannot write the build: {e.strerror}") from None
    except EgraftError as e:
        raise fail(str(e)) from None
    if as_json:
        print(json.dumps(document, indent=1))
        return
    _print_report(document)
    if output is not None:
        console.print(f"wrote {escape(str(output))}/kernels.cu, cubins/, model.opt.onnx, report.json")


def _print_report(document: dict) -> None:
    kernels = document["kernels"]
    table = Table(title=f"CUDA kernels for {document['arch']}")
    for col in ("step", "op", "function", "threads", "registers", "spill bytes", "shared bytes"):
        table.add_column(col, justify="right" if col in ("threads", "registers", "spill bytes", "shared bytes")
                         else "left")
    for k in kernels:
        table.add_row(k["name"], escape(k["op"]), k["function"], str(k["threads"]), str(k["registers"]),
                      str(k["spill_bytes"]), str(k["shared_bytes"]))
    console.print(table)
    summary = Table(title="compiled")
    summary.add_column("what")
    summary.add_column("value", justify="right")
    summary.add_row("kernel launches per run", str(len(kernels)))
    summary.add_row("distinct modules (compiled now)", f"{document['modules']} ({document['compiled']})")
    summary.add_row("most registers", str(max((k["registers"] or 0 for k in kernels), default=0)))
    summary.add_row("spill bytes (all kernels)", str(sum(k["spill_bytes"] or 0 for k in kernels)))
    summary.add_row("on reference kernels (host)", str(len(document["fallbacks"])))
    summary.add_row("compile time", f"{document['total_seconds']:.2f} s")
    for stage, s in document["seconds"].items():
        summary.add_row(f"  {stage}", f"{s:.2f} s")
    console.print(summary)
    if document["fallbacks"]:
        fallback = Table(title="nodes on reference kernels (run on the host)")
        for col in ("step", "op", "why"):
            fallback.add_column(col)
        for f in document["fallbacks"]:
            fallback.add_row(str(f["step"]), escape(f["op"]), escape(f["reason"]))
        console.print(fallback)

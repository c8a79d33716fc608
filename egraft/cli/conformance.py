"""The ``egraft conformance`` command: the ONNX backend node test cases through egraft
(the reference executor, or each case compiled for this CPU).

Example:
    egraft conformance --backend cpu --failures
"""

from __future__ import annotations

import json
from typing import Annotated

import typer
from rich.table import Table

from egraft.cli.common import console, err_console, fail


# ---- conformance -----------------------------------------------------------------------------
def conformance(
    as_json: Annotated[bool, typer.Option("--json", help="Print the summary as JSON.")] = False,
    filter: Annotated[str | None, typer.Option("--filter", "-k", help="Only cases whose name contains this.")] = None,
    failures: Annotated[bool, typer.Option("--failures", help="List every case that did not pass.")] = False,
    backend: Annotated[str, typer.Option(
        "--backend", help="reference: egraft's numpy executor; cpu: each case compiled to native code.")]
        = "reference",
) -> None:
    """Run the ONNX backend node test cases through egraft; counts per op and pass rates.

    Example: egraft conformance --backend cpu --failures
    """
    from rich.progress import Progress

    from egraft.conformance import collect_cases, run_conformance, summarize

    if backend not in ("reference", "cpu"):
        raise fail(f"--backend {backend}: unknown backend; known: reference, cpu")
    if as_json:
        results = run_conformance(filter, backend=backend)
    else:
        total = len([c for c in collect_cases() if c.kind == "node" and (not filter or filter in c.name)])
        with Progress(console=err_console, transient=True) as progress:
            task = progress.add_task(f"conformance ({backend})", total=total)
            results = run_conformance(filter, progress=lambda name: progress.advance(task), backend=backend)
    summary = summarize(results)
    if as_json:
        print(json.dumps(summary, indent=2))
        return
    table = Table(title="per op")
    for col in ("op", "pass", "wrong", "unsupported", "error", "rate"):
        table.add_column(col, justify="left" if col == "op" else "right")
    for op, c in summary["per_op"].items():
        table.add_row(op, str(c["pass"]), str(c["wrong"]), str(c["unsupported"]), str(c["error"]),
                      f"{c['pass_rate']:.2f}")
    console.print(table)
    if failures:
        for f in summary["failures"]:
            console.print(f"{f['status']:12s} {f['name']}: {f['detail'][:300]}")
    totals = Table(title=f"ONNX backend node tests through egraft ({backend})")
    columns = ["subset", "cases", "pass", "wrong", "unsupported", "error", "pass rate"]
    if backend == "cpu":
        columns[3:3] = ["pass: generated code", "pass: with fallbacks"]
    for col in columns:
        totals.add_column(col, justify="left" if col == "subset" else "right")
    for subset in ("core", "full"):
        c = summary[subset]
        split = [str(c["pass_generated"]), str(c["pass_fallback"])] if backend == "cpu" else []
        totals.add_row(subset, str(c["total"]), str(c["pass"]), *split, str(c["wrong"]), str(c["unsupported"]),
                       str(c["error"]), f"{c['pass_rate']:.3f}")
    console.print(totals)
    if backend == "cpu" and summary["fallback_ops"]:
        top = list(summary["fallback_ops"].items())[:15]
        console.print("ops on reference kernels (cases): " + ", ".join(f"{op} {n}" for op, n in top))


__all__ = ["conformance"]

"""``egraft zoo``: batch optimization of model zoos (:mod:`egraft.zoo`).

- ``zoo run SOURCE...``: every model in its own process (timeout, memory cap), rows written
  to an SQLite store as each finishes; a rerun of the same ``--name`` skips finished rows
  whose key is unchanged. Exit 0 when every model is ``ok``, 1 otherwise, 2 on bad usage.
- ``zoo show [RUN]``, ``zoo runs``: what a store holds (``--json`` for scripts).
- ``zoo report RUN [RUN...] -o FILE.html``: a self-contained HTML report and its Markdown twin.
- ``zoo diff A B``: per-model ratios and status changes; ``--fail-below`` is a CI gate.

Examples:
    egraft zoo run corpus bundled --jobs 2 --name nightly
    egraft zoo run models/ --rules-off fusion --name nofusion
    egraft zoo report nightly nofusion -o report.html
    egraft zoo diff nightly nofusion --fail-below 0.95
"""

from __future__ import annotations

import json
import os
import sys
import time
from datetime import datetime
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.table import Table

from egraft.cli.common import console, err_console, fail, parse_bindings, refuse_overwrite
from egraft.errors import EgraftError
from egraft.zoo.charts import shorten

zoo_app = typer.Typer(help="Batch optimization of model zoos: run, show, runs, report, diff.",
                      no_args_is_help=True)

DEFAULT_DB = Path("egraft-zoo.sqlite")
DbOption = Annotated[Path, typer.Option("--db", help="The SQLite result store.")]
JsonOption = Annotated[bool, typer.Option("--json", help="A JSON array, one object per model.")]


def _total_memory_gb() -> float | None:
    try:
        return round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1)
    except (ValueError, OSError, AttributeError):  # pragma: no cover
        return None


def _store(db: Path, create: bool = False):
    from egraft.zoo.store import ZooStore

    return ZooStore(db, create=create)


def _fmt(value, spec: str = ".3g", missing: str = "-") -> str:
    return missing if value is None else format(value, spec)


def _row_line(row: dict, skipped: bool) -> str:
    status = row["status"]
    head = f"{'kept' if skipped else status:>8}  {row['model']}"
    if status == "ok":
        parts = []
        if row.get("speedup") is not None:
            parts.append(f"{row['egraft_ms']:.2f} ms vs onnxruntime {row['onnxruntime_ms']:.2f} ms "
                         f"({row['speedup']:.2f}x)")
        if row.get("nodes_after") is not None:
            parts.append(f"nodes {row['nodes_before']} -> {row['nodes_after']}")
        if row.get("optimize_s") is not None:
            parts.append(f"optimize {row['optimize_s']:.1f} s")
        if row.get("compile_s") is not None:
            parts.append(f"compile {row['compile_s']:.1f} s")
        if row.get("fallbacks"):
            parts.append(f"{row['fallbacks']} fallbacks")
        if row.get("max_error") is not None:
            parts.append(f"error {row['max_error']:.1e}")
        return head + ("  " + ", ".join(parts) if parts else "")
    stage = f" [{row['stage']}]" if row.get("stage") else ""
    return f"{head}{stage}: {shorten(row.get('error'), 160)}" + (f" ({status})" if skipped else "")


@zoo_app.command("run")
def run_command(
    sources: Annotated[list[str], typer.Argument(
        help="Folders (every *.onnx below), .onnx files, .toml manifests, 'corpus' (or corpus:fast, corpus:NAME), "
             "'bundled' or bundled model names.", show_default=False)],
    db: DbOption = DEFAULT_DB,
    name: Annotated[str | None, typer.Option("--name", help="The run's name (default: the time now).")] = None,
    jobs: Annotated[int | None, typer.Option("--jobs", "-j", help="Models run at once here (default 1).")] = None,
    dask: Annotated[str | None, typer.Option(
        "--dask", help="A Dask scheduler address (default $DASK_SCHEDULER_ADDRESS when --jobs is not given): "
                       "one task per model on that cluster.")] = None,
    timeout: Annotated[float, typer.Option("--timeout", help="Seconds a model may take, all stages.")] = 900.0,
    max_memory: Annotated[float | None, typer.Option(
        "--max-memory", help="GB of address space a model's process may use (default: this machine's memory).")] = None,
    stages: Annotated[str, typer.Option(
        "--stages", help="Comma-separated: optimize, compile, check, bench (prerequisites are added).")]
        = "optimize,compile,check,bench",
    threads: Annotated[int, typer.Option("--threads", help="Threads for both engines in the bench stage.")] = 1,
    rules: Annotated[list[Path] | None, typer.Option("--rules", help="Extra rule file (repeatable).")] = None,
    rules_off: Annotated[list[str] | None, typer.Option("--rules-off", help="Rule set to switch off.")] = None,
    cost_model: Annotated[str, typer.Option("--cost-model", help="nodes, flops or roofline.")] = "roofline",
    extractor: Annotated[str, typer.Option("--extractor", help="greedy or ilp.")] = "greedy",
    shape: Annotated[list[str] | None, typer.Option(
        "--shape", help="Bind a symbolic dim NAME=INT in every model that has it (compile and inputs).")] = None,
    bench_seconds: Annotated[float, typer.Option(
        "--bench-seconds", help="About how long the bench stage times each model.")] = 2.0,
    force: Annotated[bool, typer.Option("--force", help="Recompute models whose finished rows could be kept.")]
        = False,
) -> None:
    """Optimize, compile, check and benchmark every model of the SOURCEs, each in its own
    process, into an SQLite store.

    Example: egraft zoo run corpus bundled --jobs 2 --name nightly
    """
    from egraft.zoo.run import ZooSettings
    from egraft.zoo.sources import resolve_sources

    try:
        if jobs is not None and dask is not None:
            raise EgraftError("give --jobs or --dask, not both")
        if dask is None and jobs is None:
            dask = os.environ.get("DASK_SCHEDULER_ADDRESS") or None
        settings = ZooSettings(
            stages=[s.strip() for s in stages.split(",") if s.strip()], threads=threads,
            rules=[str(p) for p in rules or []], rules_off=list(rules_off or []), cost_model=cost_model,
            extractor=extractor, shape=parse_bindings(shape), timeout=timeout,
            max_memory_gb=max_memory if max_memory is not None else _total_memory_gb(), bench_seconds=bench_seconds)
        _check_pipeline_settings(settings)
        store = _store(db, create=True)
        run_name = name or datetime.now().strftime("%Y-%m-%dT%H-%M-%S")
        models = resolve_sources(sources, say=lambda line: err_console.print(line))
    except EgraftError as e:
        raise fail(str(e)) from None
    rows = _run_with_progress(models, settings, store, run_name, jobs or 1, dask, force, sources)
    bad = [r for r in rows if r["status"] != "ok"]
    _print_rows(rows, title=f"run {run_name}: {len(rows) - len(bad)} of {len(rows)} ok")
    raise typer.Exit(code=1 if bad else 0)


def _check_pipeline_settings(settings) -> None:
    """Refuse what would fail every model alike, before any process starts: an unknown
    cost model or extractor, a rule file that does not parse, an unknown rule set."""
    from egraft.extract.cost import cost_model
    from egraft.extract.program import EXTRACTORS
    from egraft.optimize import select_rules
    from egraft.rewrite.load import load_rules

    if settings.extractor not in EXTRACTORS:
        raise EgraftError(f"--extractor {settings.extractor}: unknown extractor; known: {', '.join(EXTRACTORS)}")
    cost_model(settings.cost_model)
    select_rules(load_rules(settings.rules), settings.rules_off)


def _run_with_progress(models, settings, store, run_name, jobs, dask, force, sources) -> list[dict]:
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        TextColumn,
        TimeElapsedColumn,
        TimeRemainingColumn,
    )

    from egraft.zoo.run import run_zoo

    counts = {"ok": 0, "failed": 0}
    progress = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                        TextColumn("ok {task.fields[ok]}  failed {task.fields[failed]}"),
                        TimeElapsedColumn(), TextColumn("ETA"), TimeRemainingColumn(),
                        console=err_console, transient=False)
    task = progress.add_task(f"zoo run {run_name}", total=None, ok=0, failed=0)
    start = time.perf_counter()

    def on_plan(to_run: int, skipped: int) -> None:
        progress.update(task, total=to_run + skipped)
        where = f"on the Dask cluster at {dask}" if dask else f"{jobs} at a time"
        progress.console.print(f"run {run_name} in {store.path}: {len(models)} models, {to_run} to run ({where}), "
                               f"{skipped} finished and kept", markup=False, soft_wrap=True)

    def on_row(row: dict, skipped: bool) -> None:
        counts["ok" if row["status"] == "ok" else "failed"] += 1
        progress.update(task, advance=1, ok=counts["ok"], failed=counts["failed"])
        progress.console.print(_row_line(row, skipped), markup=False, soft_wrap=True)

    try:
        with progress:
            rows = run_zoo(models, settings, store, run_name, jobs=jobs, dask=dask, force=force, sources=sources,
                           on_plan=on_plan, on_row=on_row,
                           say=lambda line: progress.console.print(line, markup=False, soft_wrap=True))
    except EgraftError as e:
        raise fail(str(e)) from None
    except KeyboardInterrupt:
        err_console.print(f"interrupted: the finished rows are in {store.path}; run the same command again to "
                          "finish the rest", markup=False, soft_wrap=True)
        sys.exit(130)
    err_console.print(f"wall time {time.perf_counter() - start:.1f} s", markup=False)
    return rows


def _wide() -> Console:
    """The stdout console, 150 columns wide when it is not a terminal (rich's 80 would fold
    every cell of a zoo table)."""
    return console if console.is_terminal else Console(highlight=False, markup=False, width=max(console.width, 150))


def _print_rows(rows: list[dict], title: str) -> None:
    """The rows as a table (the widest a pipe gets is 150 columns, not rich's 80), then the
    error of every row that is not ok, in full, then the geometric-mean speed-up."""
    from egraft.zoo.diff import geomean

    table = Table(title=title)
    columns = ("model", "status", "nodes", "optimize s", "compile s", "fallbacks", "egraft ms", "onnxruntime ms",
               "speed-up", "max error")
    for col in columns:
        table.add_column(col, justify="left" if col in ("model", "status") else "right")
    for r in rows:
        nodes = "-" if r.get("nodes_before") is None else \
            f"{r['nodes_before']} -> {_fmt(r.get('nodes_after'), 'd')}"
        table.add_row(r["model"], r["status"], nodes, _fmt(r.get("optimize_s"), ".2f"), _fmt(r.get("compile_s"), ".2f"),
                      _fmt(r.get("fallbacks"), "d"), _fmt(r.get("egraft_ms"), ".2f"),
                      _fmt(r.get("onnxruntime_ms"), ".2f"), _fmt(r.get("speedup"), ".2f"),
                      _fmt(r.get("max_error"), ".1e"))
    _wide().print(table)
    for r in rows:
        if r["status"] != "ok":
            stage = f" [{r['stage']}]" if r.get("stage") else ""
            console.print(f"{r['status']}: {r['model']}{stage}: {r.get('error') or ''}", soft_wrap=True)
    speedups = [r["speedup"] for r in rows if r.get("speedup")]
    if speedups:
        console.print(f"geometric-mean speed-up vs onnxruntime: {geomean(speedups):.3f}x over {len(speedups)} "
                      f"models (above 1: egraft is faster)", soft_wrap=True)


@zoo_app.command("show")
def show_command(
    run: Annotated[str | None, typer.Argument(help="The run (default: the one written last).")] = None,
    db: DbOption = DEFAULT_DB,
    as_json: JsonOption = False,
    plan: Annotated[str | None, typer.Option(
        "--plan", help="Print the plan the optimize stage stored for this model (JSON, as egraft plan writes it).")]
        = None,
) -> None:
    """The rows of a run: a table, or JSON for scripts; or one model's stored plan.

    Examples: egraft zoo show nightly --json; egraft zoo show nightly --plan resnet50 > resnet50.plan.json
    """
    try:
        store = _store(db)
        run = run or store.latest_run()
        info = store.run(run)
        rows = store.rows(run)
        if plan is not None:
            if plan not in {r["model"] for r in rows}:
                raise EgraftError(f"run {run!r} has no model {plan!r}; its models: "
                                  f"{', '.join(r['model'] for r in rows)}")
            document = store.plan(run, plan)
            if document is None:
                raise EgraftError(f"run {run!r} stored no plan for {plan!r} (its optimize stage did not finish)")
            print(json.dumps(document, indent=2))
            return
    except EgraftError as e:
        raise fail(str(e)) from None
    if as_json:
        print(json.dumps(rows, indent=2))
        return
    bad = sum(r["status"] != "ok" for r in rows)
    _print_rows(rows, title=f"run {info.name}: {len(rows) - bad} of {len(rows)} ok")


@zoo_app.command("runs")
def runs_command(db: DbOption = DEFAULT_DB) -> None:
    """Every run of a store: when, how many models, how many ok, its settings.

    Example: egraft zoo runs --db nightly.sqlite
    """
    try:
        runs = _store(db).runs()
    except EgraftError as e:
        raise fail(str(e)) from None
    table = Table(title=f"{len(runs)} runs in {db}")
    for col in ("run", "created", "updated", "models", "ok", "not ok", "settings"):
        table.add_column(col, justify="right" if col in ("models", "ok", "not ok") else "left")
    for r in runs:
        s = r.settings
        described = f"stages {','.join(s.get('stages', []))}; threads {s.get('threads')}; " \
                    f"{s.get('cost_model')}/{s.get('extractor')}" + \
                    (f"; rules off {','.join(s['rules_off'])}" if s.get("rules_off") else "") + \
                    (f"; rules {','.join(Path(p).name for p in s['rules'])}" if s.get("rules") else "")
        created, updated = (t.replace("+00:00", "Z") for t in (r.created, r.updated))
        table.add_row(r.name, created, updated, str(r.total), str(r.counts.get("ok", 0)),
                      str(r.total - r.counts.get("ok", 0)), described)
    _wide().print(table)


@zoo_app.command("report")
def report_command(
    runs: Annotated[list[str], typer.Argument(help="One run, or several: later ones are compared to the first.",
                                              show_default=False)],
    output: Annotated[Path, typer.Option("--output", "-o", help="The HTML file (the Markdown twin goes beside it).",
                                         show_default=False)],
    db: DbOption = DEFAULT_DB,
    force: Annotated[bool, typer.Option("--force", help="Overwrite the report files if they exist.")] = False,
) -> None:
    """A self-contained HTML report (charts inline, nothing fetched) and a Markdown twin.

    Example: egraft zoo report nightly nofusion -o report.html
    """
    from egraft.zoo.report import write_report

    try:
        if output.suffix.lower() not in (".html", ".htm"):
            raise EgraftError(f"-o {output}: give an .html file (its Markdown twin is written beside it)")
        refuse_overwrite(output, force)
        refuse_overwrite(output.with_suffix(".md"), force)
        store = _store(db)
        for run in runs:
            store.run(run)
        html_path, md_path = write_report(store, list(runs), output)
    except EgraftError as e:
        raise fail(str(e)) from None
    console.print(f"wrote {html_path} and {md_path}")


@zoo_app.command("diff")
def diff_command(
    run_a: Annotated[str, typer.Argument(help="The baseline run.", show_default=False)],
    run_b: Annotated[str, typer.Argument(help="The run compared to it.", show_default=False)],
    db: DbOption = DEFAULT_DB,
    as_json: JsonOption = False,
    fail_below: Annotated[float | None, typer.Option(
        "--fail-below", help="Exit 1 when a model's speed ratio (A ms / B ms) is below this, or it stopped being ok.")]
        = None,
) -> None:
    """Per model: the speed ratio (A ms / B ms: above 1, B is faster), optimize-time and
    node-count ratios, and status changes.

    Example: egraft zoo diff nightly-old nightly --fail-below 0.95
    """
    from egraft.zoo.diff import diff_runs, geomean, regressions

    try:
        store = _store(db)
        entries = diff_runs(store.rows(store.run(run_a).name), store.rows(store.run(run_b).name))
    except EgraftError as e:
        raise fail(str(e)) from None
    failing = regressions(entries, fail_below) if fail_below is not None else []
    if as_json:
        print(json.dumps(entries, indent=2))
    else:
        table = Table(title=f"{run_a} -> {run_b}")
        for col in ("model", "status", "egraft ms", "speed ratio", "optimize s", "optimize ratio", "nodes after"):
            table.add_column(col, justify="left" if col in ("model", "status") else "right")
        for e in entries:
            a, b = e["status_a"] or "-", e["status_b"] or "-"
            status = f"{a} -> {b}" if e["status_changed"] else a
            table.add_row(e["model"], status, f"{_fmt(e['egraft_ms_a'], '.2f')} -> {_fmt(e['egraft_ms_b'], '.2f')}",
                          _fmt(e["speed_ratio"], ".3f"),
                          f"{_fmt(e['optimize_s_a'], '.2f')} -> {_fmt(e['optimize_s_b'], '.2f')}",
                          _fmt(e["optimize_ratio"], ".3f"),
                          f"{_fmt(e['nodes_after_a'], 'd')} -> {_fmt(e['nodes_after_b'], 'd')}")
        _wide().print(table)
        ratios = [e["speed_ratio"] for e in entries if e["speed_ratio"]]
        if ratios:
            console.print(f"geometric-mean speed ratio: {geomean(ratios):.3f} over {len(ratios)} models "
                          f"(above 1: {run_b} is faster)", soft_wrap=True)
    for model, reason in failing:
        err_console.print(f"regression: {model}: {reason}", markup=False, soft_wrap=True)
    if failing:
        raise typer.Exit(code=1)


__all__ = ["zoo_app"]

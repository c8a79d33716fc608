"""The ``egraft`` command: a thin layer over the Python API.

Commands: ``show`` (IR text, op histogram, symbolic dims; ``--ops`` lists the op
registry), ``run`` (the reference executor, ``--check`` against onnxruntime) and
``conformance`` (the ONNX backend node test suite through egraft).

Every command that takes a MODEL accepts a path to an ``.onnx`` file or the name of a
model bundled with the onnx package (``resnet50``, ``squeezenet``...). Bad input exits
with status 2 and a one-line ``error:`` message.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Annotated

import numpy as np
import typer
from rich.console import Console
from rich.table import Table

from egraft.errors import EgraftError, InputError

app = typer.Typer(
    help="egraft: an equality-saturation compiler for ONNX models.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    context_settings={"help_option_names": ["-h", "--help"]},
)
console = Console(highlight=False)
err_console = Console(stderr=True, highlight=False)


def _fail(message: str) -> typer.Exit:
    err_console.print(f"[bold red]error:[/] {message}", markup=True, soft_wrap=True)
    return typer.Exit(code=2)


def resolve_model(model: str) -> Path:
    """A model path, or the path of a light model bundled with onnx when ``model`` names one."""
    from egraft.testing.models import model_path

    return model_path(model)


def parse_bindings(shape: list[str] | None) -> dict[str, int]:
    """``["batch=1", "seq=128"]`` -> ``{"batch": 1, "seq": 128}``."""
    out: dict[str, int] = {}
    for item in shape or []:
        name, sep, value = item.partition("=")
        if not sep or not name.strip() or not value.strip().isdigit():
            raise InputError(f"--shape {item!r}: expected NAME=INT, e.g. --shape batch=1")
        out[name.strip()] = int(value)
    return out


def _load(model: str):
    import egraft

    return egraft.load(resolve_model(model))


# ---- show ------------------------------------------------------------------------------------
@app.command()
def show(
    model: Annotated[str | None, typer.Argument(
        help="ONNX file, a bundled model name such as resnet50, or a plan (.json) from egraft plan.")] = None,
    ops: Annotated[bool, typer.Option("--ops", help="List the op registry instead of a model.")] = False,
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON instead of text.")] = False,
    text: Annotated[bool, typer.Option("--text/--no-text", help="Print the IR text.")] = True,
) -> None:
    """Print a model's IR text, its op histogram and its symbolic dims (or a plan's chosen graph).

    Example: egraft show resnet50;  egraft show resnet50.plan.json
    """
    try:
        if ops:
            _show_ops(as_json)
            return
        if model is None:
            raise _fail("give a MODEL (a path or a bundled name such as resnet50), a PLAN (.json), or --ops")
        if model.endswith(".json"):
            from egraft.cli_plan import show_plan

            show_plan(Path(model), as_json, text)
            return
        graph = _load(model)
    except EgraftError as e:
        raise _fail(str(e)) from None
    info = {
        "name": graph.name,
        "inputs": {v.name: str(v.type) for v in graph.inputs},
        "outputs": {v.name: str(v.type) for v in graph.outputs},
        "nodes": len(graph.nodes),
        "constants": len(graph.constants),
        "symbols": graph.symbols(),
        "ops": graph.op_histogram(),
    }
    if as_json:
        info["ir"] = str(graph)
        print(json.dumps(info, indent=2))
        return
    if text:
        print(str(graph))
    table = Table(title=f"{graph.name}: {len(graph.nodes)} nodes, {len(graph.constants)} constants")
    table.add_column("op")
    table.add_column("count", justify="right")
    for op, count in info["ops"].items():
        table.add_row(op, str(count))
    console.print(table)
    symbols = ", ".join(info["symbols"]) or "none (all dims static)"
    console.print(f"symbolic dims: {symbols}", markup=False)


def _show_ops(as_json: bool) -> None:
    import onnx.defs

    from egraft.ir.registry import all_ops
    from egraft.kernels.cpu import kernel_ops
    from egraft.lowering.compile import VIEW_OPS

    generated = set(kernel_ops())
    rows = []
    registered = set()
    for op in all_ops():
        registered.add((op.domain, op.name))
        cpu = "generated" if (op.domain, op.name) in generated else (
            "view" if not op.domain and op.name in VIEW_OPS else "reference")
        rows.append({
            "op": f"{op.domain}::{op.name}" if op.domain else op.name,
            "inference": "native" if op.infer else "onnx.shape_inference",
            "execution": "numpy" if op.compute else "onnx.reference",
            "cpu": cpu,
            "doc": op.doc,
        })
    for schema in sorted(onnx.defs.get_all_schemas(), key=lambda s: (s.domain, s.name)):
        domain = "" if schema.domain == "ai.onnx" else schema.domain
        if (domain, schema.name) in registered or schema.deprecated or domain not in ("", "ai.onnx.ml"):
            continue
        rows.append({
            "op": f"{domain}::{schema.name}" if domain else schema.name,
            "inference": "onnx.shape_inference",
            "execution": "onnx.reference",
            "cpu": "reference",
            "doc": "(no egraft entry yet: both fall back to onnx)",
        })
    if as_json:
        print(json.dumps(rows, indent=2))
        return
    native = sum(r["execution"] == "numpy" for r in rows)
    compiled = sum(r["cpu"] != "reference" for r in rows)
    table = Table(title=f"{len(rows)} ops: {native} run on egraft's numpy kernels, the rest fall back to "
                        f"onnx.reference; {compiled} have generated CPU code or run as views")
    for col in ("op", "inference", "execution", "cpu", "doc"):
        table.add_column(col)
    for r in rows:
        table.add_row(r["op"], r["inference"], r["execution"], r["cpu"], r["doc"])
    console.print(table)


# ---- run -------------------------------------------------------------------------------------
def _read_inputs(graph, items: list[str] | None, bindings: dict[str, int],
                 quiet: bool = False) -> dict[str, np.ndarray]:
    from egraft.ir.dims import evaluate_dim

    feeds: dict[str, np.ndarray] = {}
    names = [v.name for v in graph.inputs]
    for item in items or []:
        name, sep, file = item.partition("=")
        if not sep:
            raise InputError(f"--input {item!r}: expected NAME=FILE.npy")
        if name not in names:
            raise InputError(f"--input {item!r}: the model has no input {name!r}; its inputs are {names}")
        try:
            feeds[name] = np.load(file, allow_pickle=False)
        except (OSError, ValueError) as e:
            raise InputError(f"--input {item!r}: cannot read {file}: {e}") from None
    for v in graph.inputs:
        if v.name in feeds:
            continue
        shape = [evaluate_dim(d, bindings) for d in (v.type.shape or ())]
        if v.type.shape is None or not all(isinstance(d, int) for d in shape):
            free = sorted({str(d) for d in shape if not isinstance(d, int)})
            raise InputError(f"input {v.name!r} ({v.type}) was not given and has unbound dims {free}: "
                             f"pass --input {v.name}=FILE.npy or --shape {free[0]}=N" if free else
                             f"input {v.name!r} has an unknown rank: pass --input {v.name}=FILE.npy")
        n = int(np.prod(shape))
        feeds[v.name] = (np.arange(n).reshape(shape) / max(n, 1)).astype(v.type.dtype.numpy)
        (err_console if quiet else console).print(
            f"input {v.name}: generated arange(n)/n with shape {shape} ({v.type.dtype.short})", markup=False)
    return feeds


@app.command()
def run(
    model: Annotated[str, typer.Argument(help="ONNX file, or a bundled model name such as resnet50.")],
    input: Annotated[list[str] | None, typer.Option("--input", "-i", help="NAME=FILE.npy (repeat per input).")] = None,
    shape: Annotated[list[str] | None,
                     typer.Option("--shape", help="Bind a symbolic dim for generated inputs: NAME=INT.")] = None,
    check: Annotated[bool, typer.Option("--check", help="Compare every output with onnxruntime.")] = False,
    output_dir: Annotated[Path | None,
                          typer.Option("--output-dir", "-o", help="Save each output as NAME.npy here.")] = None,
    reweight: Annotated[int | None, typer.Option(
        "--reweight", metavar="SEED",
        help="Replace ConstantOfShape weight fills with seeded random weights first and also return the logits "
             "before a final Softmax (the bundled models' weights are constant fills: uniform outputs prove "
             "little).")] = None,
    backend: Annotated[str, typer.Option(
        "--backend", help="cpu: rewrite and compile to native code (cached); reference: egraft's numpy "
                          "executor on the model as loaded.")] = "cpu",
    threads: Annotated[int | None, typer.Option(
        "--threads", help="Threads the compiled model may use (default: every core, or $EGRAFT_NUM_THREADS).")] = None,
) -> None:
    """Run a model, compiled for this CPU (or with the reference executor); inputs not
    given are generated (arange(n)/n).

    Example: egraft run resnet50 --reweight 0 --check
    """
    try:
        bindings = parse_bindings(shape)
        path = resolve_model(model)
        import egraft
        from egraft.frontend.onnx_import import read_model

        proto = read_model(path)
        if reweight is not None:
            from egraft.testing.models import reweight as reweight_model
            from egraft.testing.models import softmax_logits, with_outputs

            logits = softmax_logits(proto)
            proto = with_outputs(reweight_model(proto, seed=reweight), logits)
            console.print(f"weights: ConstantOfShape fills replaced by random values (seed {reweight}); "
                          f"the logits before the final Softmax are outputs too: {logits}", markup=False)
        if backend not in ("cpu", "reference"):
            raise InputError(f"--backend {backend}: unknown backend; known: cpu, reference")
        graph = egraft.load(proto)
        feeds = _read_inputs(graph, input, bindings)
        if backend == "reference":
            outputs = graph.run(feeds)
        else:
            with err_console.status("compiling", spinner="dots"):
                compiled = egraft.compile(proto, threads=threads)
            report = compiled.report()
            console.print(f"compiled: {report.kernels} kernels, {report.views} views, {len(report.fallbacks)} on "
                          f"reference kernels{' (from the cache)' if compiled.cache_hit else ''}", markup=False)
            outputs = compiled.run(feeds)
    except EgraftError as e:
        raise _fail(str(e)) from None
    table = Table(title=f"{path.name}: outputs")
    for col in ("output", "type", "min", "max", "mean"):
        table.add_column(col, justify="left" if col in ("output", "type") else "right")
    for name, value in outputs.items():
        stats = ("", "", "") if value.size == 0 or value.dtype.kind not in "biuf" else (
            f"{value.min():.6g}", f"{value.max():.6g}", f"{value.astype(np.float64).mean():.6g}")
        table.add_row(name, f"{value.dtype}{list(value.shape)}", *stats)
    console.print(table)
    if output_dir is not None:
        output_dir.mkdir(parents=True, exist_ok=True)
        for name, value in outputs.items():
            target = output_dir / (name.replace("/", "_") + ".npy")
            np.save(target, value)
        console.print(f"saved {len(outputs)} outputs to {output_dir}", markup=False)
    if check:
        _check_with_onnxruntime(proto, feeds, outputs)


def _check_with_onnxruntime(model, feeds: dict, outputs: dict) -> None:
    try:
        import onnxruntime as ort
    except ImportError:
        raise _fail("--check needs onnxruntime: pip install 'egraft[dev]'") from None
    options = ort.SessionOptions()
    options.log_severity_level = 3
    session = ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
    names = [o.name for o in session.get_outputs()]
    reference = dict(zip(names, session.run(names, feeds)))
    table = Table(title="egraft vs onnxruntime")
    for col in ("output", "max abs error", "max rel error", "scale-relative", "ok (<= 1e-3)"):
        table.add_column(col, justify="left" if col == "output" else "right")
    worst = 0.0
    for name, ref in reference.items():
        ours = outputs[name].astype(np.float64)
        ref = ref.astype(np.float64)
        if ours.shape != ref.shape:
            raise _fail(f"output {name!r}: egraft shape {list(ours.shape)}, onnxruntime {list(ref.shape)}")
        diff = np.abs(ours - ref)
        abs_err = float(diff.max()) if diff.size else 0.0
        rel_err = float((diff / np.maximum(np.abs(ref), 1e-12)).max()) if diff.size else 0.0
        scale = float(np.abs(ref).max()) if ref.size else 0.0
        scaled = abs_err / scale if scale else abs_err
        worst = max(worst, scaled)
        table.add_row(name, f"{abs_err:.3g}", f"{rel_err:.3g}", f"{scaled:.3g}", "yes" if scaled <= 1e-3 else "NO")
    console.print(table)
    if worst > 1e-3:
        err_console.print(f"outputs differ from onnxruntime (scale-relative error {worst:.3g} > 1e-3)")
        raise typer.Exit(code=1)


# ---- conformance -----------------------------------------------------------------------------
@app.command()
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
        raise _fail(f"--backend {backend}: unknown backend; known: reference, cpu")
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
            console.print(f"{f['status']:12s} {f['name']}: {f['detail'][:300]}", markup=False)
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
        console.print("ops on reference kernels (cases): " + ", ".join(f"{op} {n}" for op, n in top), markup=False)


def main() -> None:  # pragma: no cover - the console script
    try:
        app()
    except KeyboardInterrupt:
        sys.exit(130)



# ---- optimize and rules ------------------------------------------------------------------------
rules_app = typer.Typer(help="Rule files: list them, check them.", no_args_is_help=True)
app.add_typer(rules_app, name="rules")


@app.command()
def optimize(
    model: Annotated[str, typer.Argument(help="ONNX file, or a bundled model name such as resnet50.")],
    rules: Annotated[list[Path] | None, typer.Option("--rules", help="Extra rule file (repeatable).")] = None,
    rules_off: Annotated[list[str] | None, typer.Option("--rules-off", help="Rule set to switch off.")] = None,
    shape: Annotated[list[str] | None, typer.Option("--shape", help="Bind a symbolic dim: NAME=INT.")] = None,
    iterations: Annotated[int, typer.Option(help="Saturation rounds at most.")] = 30,
    max_nodes: Annotated[int, typer.Option(help="Stop when the e-graph has more e-nodes.")] = 100_000,
    timeout: Annotated[float, typer.Option(help="Stop saturating after this many seconds.")] = 30.0,
    cost_model: Annotated[str, typer.Option("--cost-model", help="nodes, flops or roofline.")] = "roofline",
    target: Annotated[str, typer.Option("--target", help="cpu or cuda: picks the roofline profile.")] = "cpu",
    profile: Annotated[str | None, typer.Option(
        "--profile", help="Roofline profile: a name (cpu-host, cuda-h200) or a .toml file.")] = None,
    extractor: Annotated[str, typer.Option("--extractor", help="greedy (fast) or ilp (exact, HiGHS).")] = "greedy",
    time_limit: Annotated[float, typer.Option("--time-limit", help="Seconds the ilp extractor may take.")] = 30.0,
    output: Annotated[Path | None, typer.Option(
        "--output", "-o", help="Write the optimized model here (egraft-only ops as ONNX local functions).")] = None,
    plan_path: Annotated[Path | None, typer.Option("--plan", help="Also write the plan (JSON) here.")] = None,
    force: Annotated[bool, typer.Option("--force", help="Overwrite --output / --plan if they exist.")] = False,
    as_json: Annotated[bool, typer.Option("--json", help="Print the summary as JSON.")] = False,
) -> None:
    """Rewrite a model with the rule library and extract the cheapest equivalent program
    under a cost model; write it as an ONNX model that onnxruntime runs.

    Example: egraft optimize resnet50 -o resnet50.opt.onnx --extractor ilp
    """
    from egraft.cli_plan import run_pipeline

    try:
        for path in (output, plan_path):
            if path is not None and path.exists() and not force:
                raise EgraftError(f"{path} exists; pass --force to overwrite it or choose another path")
        result = run_pipeline(model, rules, rules_off, shape, iterations, max_nodes, timeout, cost_model, target,
                              profile, extractor, time_limit)
        if output is not None:
            import egraft

            egraft.save_onnx(result.graph, output)
        if plan_path is not None:
            from egraft.extract.plan import build_plan, plan_json

            plan_path.write_text(plan_json(build_plan(result, model_label=model)))
    except EgraftError as e:
        raise _fail(str(e)) from None
    report = result.saturation
    summary = {
        "nodes_before": len(result.source.nodes),
        "nodes_after": len(result.graph.nodes),
        "ops": {op: [b, a] for op, b, a in result.histogram_rows()},
        "egraph": {"iterations": report.iterations, "stop_reason": report.stop_reason,
                   "enodes": report.nodes_after, "eclasses": report.classes_after},
        "seconds": {k: round(v, 4) for k, v in result.seconds.items()},
        "rulesets": result.rulesets,
        "cost": {"model": result.cost_model.name, "total": result.extraction.cost, "unit": result.cost_model.unit,
                 "extractor": result.extraction.extractor, "status": result.extraction.status},
        "rules": {k: {"applied": v.applied, "matches": v.matches, "seconds": round(v.seconds, 4)}
                  for k, v in sorted(report.rules.items())},
    }
    if as_json:
        print(json.dumps(summary, indent=2))
        return
    table = Table(title=f"{len(result.source.nodes)} nodes -> {len(result.graph.nodes)} nodes")
    for col in ("op", "before", "after"):
        table.add_column(col, justify="left" if col == "op" else "right")
    for op, before, after in result.histogram_rows():
        table.add_row(op, str(before), str(after))
    console.print(table)
    console.print(f"e-graph: {report.nodes_after} e-nodes in {report.classes_after} e-classes after "
                  f"{report.iterations} iterations ({report.stop_reason}); rule sets: {', '.join(result.rulesets)}",
                  markup=False)
    ex = result.extraction
    console.print(f"estimated cost: {ex.cost:.6g} {result.cost_model.unit} ({result.cost_model.name}; "
                  f"{ex.extractor}: {ex.status})", markup=False)
    console.print("time: " + ", ".join(f"{k} {v:.2f}s" for k, v in result.seconds.items()), markup=False)
    top = Table(title="top rules")
    for col in ("rule", "applied", "matches", "seconds"):
        top.add_column(col, justify="left" if col == "rule" else "right")
    for name, stats in report.top_rules(10):
        top.add_row(name, str(stats.applied), str(stats.matches), f"{stats.seconds:.3f}")
    console.print(top)
    for path in (output, plan_path):
        if path is not None:
            console.print(f"wrote {path}", markup=False)


@rules_app.command("list")
def rules_list(
    files: Annotated[list[Path] | None, typer.Argument(help="Rule files (default: the shipped library).")] = None,
) -> None:
    """List rule sets and rules with their one-line descriptions."""
    from egraft.rewrite.load import load_rules

    try:
        loaded = load_rules(files or [], include_shipped=not files)
    except EgraftError as e:
        raise _fail(str(e)) from None
    table = Table(title="rules")
    for col in ("set", "rule", "what it does", "where"):
        table.add_column(col)
    for f in loaded:
        for r in f.rules:
            table.add_row(f.ruleset, r.name, r.doc.splitlines()[0] if r.doc else "", str(r.loc))
    console.print(table)


@rules_app.command("check")
def rules_check(
    files: Annotated[list[Path] | None, typer.Argument(help="Rule files (default: the shipped library).")] = None,
    opset: Annotated[int, typer.Option(help="The ONNX opset of the instances.")] = 18,
    trials: Annotated[int, typer.Option(help="Instances to match per rule at most.")] = 40,
    seed: Annotated[int, typer.Option(help="Seed of the random constants and inputs.")] = 0,
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON instead of a table.")] = False,
) -> None:
    """Check that each rule's replacement computes what it replaces, on small random
    instances of its pattern run by the reference executor. Exits 1 when a rule is unsound.

    Example: egraft rules check my.rules
    """
    from rich.text import Text

    from egraft.rewrite.soundness import check_rules

    try:
        results = check_rules(files or [], opset=opset, trials=trials, seed=seed)
    except EgraftError as e:
        raise _fail(str(e)) from None
    counts = {s: sum(c.status == s for c in results) for s in ("sound", "unsound", "unchecked")}
    if as_json:
        rows = [{"rule": c.rule, "where": c.loc, "status": c.status, "reason": c.reason,
                 "instance": None if c.trial is None else {
                     "inputs": c.trial.inputs, "constants": c.trial.constants, "opset": c.trial.opset,
                     "max_abs_error": c.trial.max_abs_error, "max_rel_error": c.trial.max_rel_error}}
                for c in results]
        print(json.dumps({"rules": rows, "counts": counts}, indent=2))
    else:
        table = Table(title="rule soundness")
        for col in ("rule", "status", "evidence", "where"):
            table.add_column(col)
        styles = {"sound": "green", "unsound": "bold red", "unchecked": "yellow"}
        for c in results:
            evidence = c.trial.describe() if c.trial is not None else ""
            if c.reason:
                evidence = f"{c.reason}; {evidence}" if evidence else c.reason
            table.add_row(c.rule, Text(c.status, style=styles[c.status]), Text(evidence), c.loc)
        console.print(table)
        console.print(", ".join(f"{n} {s}" for s, n in counts.items()), markup=False)
    if counts["unsound"]:
        raise typer.Exit(code=1)


from egraft import cli_compile, cli_plan  # noqa: E402,F401  (register plan, diff, explain, calibrate, compile...)

if __name__ == "__main__":  # pragma: no cover
    main()

"""The optimization and plan commands of the ``egraft`` CLI: ``optimize``, ``plan``,
``diff``, ``explain``, ``calibrate`` (and the plan form of ``show``).

Output files (``-o``, ``--plan``) are refused when they exist unless ``--force`` is given,
refused even with it when the path is a folder; missing parent folders are created.

Examples:
    egraft optimize resnet50 -o resnet50.opt.onnx
    egraft plan resnet50 -o resnet50.plan.json --cost-model roofline --extractor ilp
    egraft diff full.plan.json nofusion.plan.json
    egraft explain resnet50.plan.json n3
    egraft calibrate --show
"""

from __future__ import annotations

import json
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
    refuse_overwrite,
    write_output,
)
from egraft.errors import EgraftError

CostModelOption = Annotated[str, typer.Option("--cost-model", help="nodes, flops or roofline.")]
TargetOption = Annotated[str, typer.Option("--target", help="cpu or cuda: picks the roofline profile.")]
ProfileOption = Annotated[str | None, typer.Option(
    "--profile", help="Roofline profile: a name (cpu-host, cuda-h200) or a .toml file. Default: the target's.")]
ExtractorOption = Annotated[str, typer.Option("--extractor", help="greedy (fast) or ilp (exact, HiGHS).")]
TimeLimitOption = Annotated[float, typer.Option("--time-limit", help="Seconds the ilp extractor may take.")]


def run_pipeline(model: str, rules, rules_off, shape, iterations: int, max_nodes: int, timeout: float | None,
                 cost_model: str, target: str, profile: str | None, extractor: str, time_limit: float):
    """Load, saturate (with a progress line on stderr) and extract; EgraftError on bad input."""
    from egraft.extract.cost import cost_model as make_cost_model
    from egraft.extract.program import EXTRACTORS
    from egraft.optimize import optimize
    from egraft.rewrite.engine import Budget

    if extractor not in EXTRACTORS:
        raise EgraftError(f"--extractor {extractor}: unknown extractor; known: {', '.join(EXTRACTORS)}")
    bindings = parse_bindings(shape)
    model_cost = make_cost_model(cost_model, profile, target, bindings)
    graph = load_model(model)
    check_bindings(bindings, graph, model)
    budget = Budget(iterations=iterations, max_nodes=max_nodes, **({} if timeout is None else {"seconds": timeout}))
    with err_console.status("saturating", spinner="dots") as status:
        def progress(iteration: int, enodes: int) -> None:
            status.update(f"saturating: round {iteration}, {enodes} e-nodes")
        result = optimize(graph, rules or [], rules_off or [], bindings, budget, progress=progress, cost=model_cost,
                          extractor=extractor, time_limit=time_limit)
    return result


def optimize(
    model: Annotated[str, typer.Argument(help="ONNX file, or a bundled model name such as resnet50.")],
    rules: Annotated[list[Path] | None, typer.Option("--rules", help="Extra rule file (repeatable).")] = None,
    rules_off: Annotated[list[str] | None, typer.Option("--rules-off", help="Rule set to switch off.")] = None,
    shape: Annotated[list[str] | None, typer.Option("--shape", help="Bind a symbolic dim: NAME=INT.")] = None,
    iterations: Annotated[int, typer.Option(help="Saturation rounds at most.")] = 30,
    max_nodes: Annotated[int, typer.Option(help="Stop when the e-graph has more e-nodes.")] = 100_000,
    timeout: Annotated[float | None, typer.Option(
        help="Stop saturating after this many CPU seconds (default: the engine's budget, 10).")] = None,
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
    try:
        for path in (output, plan_path):
            refuse_overwrite(path, force)
        result = run_pipeline(model, rules, rules_off, shape, iterations, max_nodes, timeout, cost_model, target,
                              profile, extractor, time_limit)
        if output is not None:
            import egraft

            try:
                egraft.save_onnx(result.graph, prepare_output(output))
            except OSError as e:
                raise EgraftError(f"{output}: cannot write it: {e.strerror}") from None
        if plan_path is not None:
            from egraft.extract.plan import build_plan, plan_json

            write_output(plan_path, plan_json(build_plan(result, model_label=model)))
    except EgraftError as e:
        raise fail(str(e)) from None
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
                  f"{report.iterations} iterations ({report.stop_reason}); rule sets: {', '.join(result.rulesets)}")
    ex = result.extraction
    console.print(f"estimated cost: {ex.cost:.6g} {result.cost_model.unit} ({result.cost_model.name}; "
                  f"{ex.extractor}: {ex.status})")
    console.print("time: " + ", ".join(f"{k} {v:.2f}s" for k, v in result.seconds.items()))
    top = Table(title="top rules")
    for col in ("rule", "applied", "matches", "seconds"):
        top.add_column(col, justify="left" if col == "rule" else "right")
    for name, stats in report.top_rules(10):
        top.add_row(name, str(stats.applied), str(stats.matches), f"{stats.seconds:.3f}")
    console.print(top)
    for path in (output, plan_path):
        if path is not None:
            console.print(f"wrote {path}")


def plan(
    model: Annotated[str, typer.Argument(help="ONNX file, or a bundled model name such as resnet50.")],
    output: Annotated[Path | None, typer.Option("--output", "-o", help="Write the plan (JSON) here.")] = None,
    rules: Annotated[list[Path] | None, typer.Option("--rules", help="Extra rule file (repeatable).")] = None,
    rules_off: Annotated[list[str] | None, typer.Option("--rules-off", help="Rule set to switch off.")] = None,
    shape: Annotated[list[str] | None, typer.Option("--shape", help="Bind a symbolic dim: NAME=INT.")] = None,
    cost_model: CostModelOption = "roofline",
    target: TargetOption = "cpu",
    profile: ProfileOption = None,
    extractor: ExtractorOption = "greedy",
    time_limit: TimeLimitOption = 30.0,
    iterations: Annotated[int, typer.Option(help="Saturation rounds at most.")] = 30,
    max_nodes: Annotated[int, typer.Option(help="Stop when the e-graph has more e-nodes.")] = 100_000,
    timeout: Annotated[float | None, typer.Option(
        help="Stop saturating after this many CPU seconds (default: the engine's budget, 10).")] = None,
    reproducible: Annotated[bool, typer.Option(
        "--reproducible",
        help="Leave out what measures the run (timings; a time-limited ILP's gap and bound): the file is "
             "then the same, byte for byte, on every run.")] = False,
    force: Annotated[bool, typer.Option("--force", help="Overwrite --output if it exists.")] = False,
    as_json: Annotated[bool, typer.Option("--json", help="Print the plan as JSON.")] = False,
) -> None:
    """Optimize a model and write the extraction as a plan: the chosen graph, the cost of
    each node and in total, provenance, settings and timings.

    Example: egraft plan resnet50 -o resnet50.plan.json --extractor ilp
    """
    from egraft.extract.plan import build_plan, plan_json

    try:
        refuse_overwrite(output, force)
        result = run_pipeline(model, rules, rules_off, shape, iterations, max_nodes, timeout, cost_model, target,
                              profile, extractor, time_limit)
        document = build_plan(result, model_label=model)
        text = plan_json(document, timings=not reproducible)
        if output is not None:
            write_output(output, text)
    except EgraftError as e:
        raise fail(str(e)) from None
    if as_json:
        print(text, end="")
        return
    _print_plan_summary(document)
    if output is not None:
        console.print(f"wrote {output}")


def _print_plan_summary(document: dict) -> None:
    ex, cost = document["extraction"], document["cost"]
    eg = document["egraph"]
    gap = f", gap {ex['gap']:.2%}" if ex.get("gap") else ""
    console.print(f"{document['model']['name']}: {document['model']['nodes']} nodes -> "
                  f"{len(document['graph']['nodes'])} nodes; estimated cost {cost['total']} {cost['unit']} "
                  f"({document['settings']['cost_model']['name']}, {ex['extractor']}: {ex['status']}{gap})")
    console.print(f"e-graph: {eg['enodes']} e-nodes in {eg['eclasses']} e-classes after {eg['iterations']} rounds "
                  f"({eg['stop_reason']})")
    if "timings" in document:
        console.print("time: " + ", ".join(f"{k} {v:.2f}s" for k, v in document["timings"].items()))
    table = Table(title="chosen ops")
    table.add_column("op")
    table.add_column("count", justify="right")
    for op, count in document["graph"]["ops"].items():
        table.add_row(op, str(count))
    console.print(table)


def diff(
    plan_a: Annotated[Path, typer.Argument(help="The first plan (JSON).")],
    plan_b: Annotated[Path, typer.Argument(help="The second plan (JSON).")],
    top: Annotated[int, typer.Option(help="How many of the most different regions to list.")] = 5,
    as_json: Annotated[bool, typer.Option("--json", help="Print the comparison as JSON.")] = False,
) -> None:
    """Compare two plans: total cost, op counts, nodes and rules on one side only, and the
    nodes whose cost differs most (matched through the source nodes they cover).

    Example: egraft diff full.plan.json nofusion.plan.json
    """
    from egraft.extract.compare import diff_plans
    from egraft.extract.plan import load_plan

    try:
        a, b = load_plan(plan_a), load_plan(plan_b)
    except EgraftError as e:
        raise fail(str(e)) from None
    d = diff_plans(a, b, top)
    if as_json:
        print(json.dumps(d, indent=1))
        return
    if not d["same_model"]:
        err_console.print("warning: the plans come from different models; nodes are matched by source index")
    name_a, name_b = plan_a.name, plan_b.name
    summary = Table(title="plans")
    for col in ("", name_a, name_b):
        summary.add_column(col)
    for key, (va, vb) in d["settings"].items():
        summary.add_row(key, str(va), str(vb))
    c = d["cost"]
    summary.add_row("estimated cost", f"{c['a']} {c['unit_a']}", f"{c['b']} {c['unit_b']}")
    if c["difference"] is not None:
        ratio = f" ({c['b'] / c['a']:.3f}x)" if c["a"] else ""
        summary.add_row("difference (b - a)", "", f"{c['difference']:+.6g} {c['unit_b']}{ratio}")
    console.print(summary)
    ops = Table(title="op counts")
    for col in ("op", name_a, name_b, "change"):
        ops.add_column(col, justify="left" if col == "op" else "right")
    for row in d["ops"]:
        change = row["b"] - row["a"]
        ops.add_row(row["op"], str(row["a"]), str(row["b"]), f"{change:+d}" if change else "")
    console.print(ops)
    for side, name in (("only_a", name_a), ("only_b", name_b)):
        nodes = d[side]
        if nodes:
            listed = ", ".join(f"{n['id']} {n['op']}" for n in nodes[:12]) + (" ..." if len(nodes) > 12 else "")
            console.print(f"only in {name} ({len(nodes)}): {listed}")
    console.print(f"rules used only in {name_a}: {', '.join(d['rules_only_a']) or '-'}")
    console.print(f"rules used only in {name_b}: {', '.join(d['rules_only_b']) or '-'}")
    top_table = Table(title=f"the {len(d['top_differences'])} regions whose cost differs most")
    for col in ("source nodes", name_a, name_b, "cost a", "cost b", "b - a"):
        top_table.add_column(col, justify="right" if col.startswith(("cost", "b -")) else "left")
    for r in d["top_differences"]:
        sources = ", ".join(f"#{s}" for s in r["sources"][:6]) + (" ..." if len(r["sources"]) > 6 else "")
        top_table.add_row(sources, " + ".join(r["a"]), " + ".join(r["b"]), f"{r['cost_a']:.6g}", f"{r['cost_b']:.6g}",
                          f"{r['difference']:+.6g}")
    console.print(top_table)


def explain(
    plan_file: Annotated[Path, typer.Argument(metavar="PLAN", help="A plan (JSON).")],
    node: Annotated[str, typer.Argument(help="A node id (n3), an output name, or source:INDEX.")],
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON.")] = False,
) -> None:
    """Where a plan node came from: the source nodes it covers, the chain of rules that
    built it, and the alternatives the extractor rejected with their costs.

    Example: egraft explain resnet50.plan.json n3
    """
    from egraft.extract.compare import derivation_lines, explain_node
    from egraft.extract.plan import find_node, load_plan

    try:
        document = load_plan(plan_file)
        found = find_node(document, node)
    except EgraftError as e:
        raise fail(str(e)) from None
    info = explain_node(document, found)
    if as_json:
        print(json.dumps(info, indent=1))
        return
    unit = info["unit"]
    outputs = ", ".join(f"{o['name']}: {o['type']}" for o in info["outputs"])
    console.print(f"{info['id']} = {info['op']} -> {outputs}")
    work = info.get("work") or {}
    console.print(f"cost {info['cost']} {unit} (this node), {info['subtree_cost']} {unit} with what it needs; "
                  f"{work.get('flops', 0):.4g} flop, {work.get('bytes', 0):.4g} bytes, family {work.get('family')}")
    covers = ", ".join(f"#{s['index']} {s['op']}" + (f" {s['name']!r}" if s["name"] else "") for s in info["covers"])
    console.print(f"covers source nodes: {covers or '(none: built by rules alone)'}")
    console.print(f"rules, first applied first: {' -> '.join(info['rules']) or '(none: as in the model)'}")
    console.print("derivation:")
    for line in derivation_lines(info["derivation"], document["source"], "  "):
        console.print(line)
    alternatives = info["alternatives"]
    table = Table(title=f"alternatives the extractor rejected ({len(alternatives)} shown)")
    for col in ("op", f"cost ({unit})", f"with inputs ({unit})", "rules"):
        table.add_column(col, justify="right" if "cost" in col or "inputs" in col else "left")
    for alt in alternatives:
        subtree = "cycle" if alt["subtree_cost"] is None else str(alt["subtree_cost"])
        table.add_row(alt["op"], str(alt["cost"]), subtree, ", ".join(alt["rules"]) or "(model)")
    console.print(table)


def show_plan(path: Path, as_json: bool, text: bool) -> None:
    """``egraft show PLAN``: the chosen graph's IR text and its op counts."""
    from egraft.extract.plan import load_plan

    document = load_plan(path)
    if as_json:
        print(json.dumps({"ir": document["graph"]["ir"], "ops": document["graph"]["ops"],
                          "cost": document["cost"]}, indent=2))
        return
    if text:
        print(document["graph"]["ir"])
    _print_plan_summary(document)


def calibrate(
    show: Annotated[bool, typer.Option("--show", help="Print the cpu-host profile in use; measure nothing.")] = False,
    threads: Annotated[int, typer.Option(help="Threads the micro-benchmarks and kernels use.")] = 1,
    force: Annotated[bool, typer.Option("--force", help="Replace a saved profile (or its kernel fit).")] = False,
    kernels: Annotated[bool, typer.Option(
        "--kernels", help="Time egraft's own kernels per family and fit [efficiency] and [bandwidth_efficiency] "
                          "(measures the machine first when no profile is saved).")] = False,
    quick: Annotated[bool, typer.Option("--quick", help="With --kernels: one shape per family (a few seconds).")]
    = False,
) -> None:
    """Measure this machine (fp32 FMA throughput, memory bandwidth, kernel launch cost) and
    save the cpu-host roofline profile in the user's config dir; with --kernels, also time
    the kernels egraft generates and fit each kernel family's efficiency to them.

    Example: egraft calibrate && egraft calibrate --kernels && egraft calibrate --show
    """
    from egraft.extract.calibrate import calibrate as measure
    from egraft.extract.profiles import load_profile, save_profile, user_profile_path

    try:
        if show:
            profile = load_profile("cpu-host")
            console.print(f"# {profile.path}")
            console.print(Path(profile.path).read_text(), end="")
            return
        saved = user_profile_path("cpu-host").exists()
        if kernels:
            _calibrate_kernels(threads, force, quick)
            return
        if saved and not force:
            raise EgraftError(f"{user_profile_path('cpu-host')} exists (a saved profile); pass --force to "
                              "measure again and replace it")
        with err_console.status("measuring: fp32 GEMM, memory copy, call overhead"):
            profile = measure(threads=threads)
        path = save_profile(profile, force=force)
    except EgraftError as e:
        raise fail(str(e)) from None
    _print_machine(profile, threads)
    console.print(f"saved {path}")


def _print_machine(profile, threads: int) -> None:
    table = Table(title=f"cpu-host at {threads} thread(s)")
    for col in ("figure", "value"):
        table.add_column(col)
    table.add_row("peak fp32", f"{profile.peak_gflops:.4g} GFLOP/s")
    table.add_row("memory bandwidth", f"{profile.bandwidth_gbs:.4g} GB/s")
    table.add_row("kernel launch", f"{profile.launch_us:.3g} us")
    console.print(table)


def _calibrate_kernels(threads: int, force: bool, quick: bool) -> None:
    """``calibrate --kernels``: the saved machine figures (measured first when absent), the
    kernels timed with a progress bar, the fit saved and shown as a table."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from egraft.extract.calibrate import calibrate as measure
    from egraft.extract.calibrate_kernels import fit_families, fitted_profile, has_kernel_fit, measure_kernels
    from egraft.extract.kernel_cases import kernel_cases
    from egraft.extract.profiles import load_profile, save_profile, user_profile_path

    path = user_profile_path("cpu-host")
    if path.exists():
        base = load_profile(str(path))
        if has_kernel_fit(base) and not force:
            raise EgraftError(f"{path} already holds kernel-fitted efficiencies ({base.source}); pass --force to "
                              "time the kernels again and replace them")
    else:
        with err_console.status("measuring the machine first: fp32 GEMM, memory copy, call overhead"):
            base = measure(threads=threads)
        _print_machine(base, threads)
    cases = kernel_cases(quick)
    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    with Progress(*columns, console=err_console, transient=True) as progress:
        task = progress.add_task("timing kernels", total=len(cases))

        def advance(case) -> None:
            progress.update(task, advance=1, description=f"timing kernels: {case.name}")
        samples = measure_kernels(cases, threads=threads, quick=quick, progress=advance)
    fits = fit_families(samples, base)
    profile = fitted_profile(base, fits, threads)
    saved = save_profile(profile, force=True)
    table = Table(title=f"kernel families at {threads} thread(s): roofline fitted to {len(samples)} kernels")
    for col in ("family", "samples", "efficiency", "bandwidth x", "error before", "error after"):
        table.add_column(col, justify="left" if col == "family" else "right")
    for fit in fits.values():
        table.add_row(fit.family, str(fit.samples), f"{profile.efficiency[fit.family]:.3g}",
                      f"{profile.bandwidth_efficiency[fit.family]:.3g}", f"{fit.error_before:.2f}x",
                      f"{fit.error:.2f}x")
    console.print(table)
    console.print("error: geometric mean of how far predicted and measured kernel times are apart (1.00x = exact)")
    console.print(f"saved {saved}")


__all__ = ["run_pipeline", "optimize", "plan", "diff", "explain", "calibrate", "show_plan"]

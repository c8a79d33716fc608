"""The model commands of the ``egraft`` CLI: ``show`` (IR text, op histogram, symbolic
dims; ``--ops`` lists the op registry) and ``run`` (compiled for this CPU or with the
reference executor, ``--check`` against onnxruntime).

Every command that takes a MODEL accepts a path to an ``.onnx`` file or the name of a
model bundled with the onnx package (``resnet50``, ``squeezenet``...). Bad input exits
with status 2 and a one-line ``error:`` message.

Examples:
    egraft show resnet50
    egraft run resnet50 --reweight 0 --check
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import numpy as np
import typer
from rich.table import Table

from egraft.cli.common import (
    check_bindings,
    console,
    err_console,
    fail,
    load_model,
    parse_bindings,
    read_inputs,
    refuse_overwrite,
    resolve_model,
)
from egraft.errors import EgraftError, InputError


# ---- show ------------------------------------------------------------------------------------
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
            raise fail("give a MODEL (a path or a bundled name such as resnet50), a PLAN (.json), or --ops")
        if model.endswith(".json"):
            from egraft.cli.plan import show_plan

            show_plan(Path(model), as_json, text)
            return
        graph = load_model(model)
    except EgraftError as e:
        raise fail(str(e)) from None
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
    console.print(f"symbolic dims: {symbols}")


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
#: Where ``egraft run`` runs a model.
BACKENDS = ("cpu", "reference", "cuda", "cuda-emulated")


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
                          "executor on the model as loaded; cuda: compile for the GPU and run there; "
                          "cuda-emulated: the same CUDA build run on this CPU (slow: to check its numbers).")] = "cpu",
    threads: Annotated[int | None, typer.Option(
        "--threads", help="Threads the compiled model may use (default: every core, or $EGRAFT_NUM_THREADS).")] = None,
    force: Annotated[bool, typer.Option("--force", help="Overwrite NAME.npy files in --output-dir.")] = False,
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
                          f"the logits before the final Softmax are outputs too: {logits}")
        if backend not in BACKENDS:
            raise InputError(f"--backend {backend}: unknown backend; known: {', '.join(BACKENDS)}")
        graph = egraft.load(proto)
        check_bindings(bindings, graph, model)
        targets = _output_files(graph, output_dir, force)
        feeds = read_inputs(graph, input, bindings)  # checked before anything is compiled
        if backend == "reference":
            outputs = graph.run(feeds)
        elif backend in ("cuda", "cuda-emulated"):
            with err_console.status("compiling for CUDA: rewrite, extract, generate CUDA C, NVRTC", spinner="dots"):
                compiled = egraft.compile(proto, target="cuda", device="emulator" if backend == "cuda-emulated"
                                          else "cuda")
            report = compiled.report()
            console.print(f"compiled for {report['arch']}: {len(report['kernels'])} kernel launches, "
                          f"{len(report['fallbacks'])} ops on the host")
            with err_console.status("running" + (" on the emulated device" if backend == "cuda-emulated" else ""),
                                    spinner="dots"):
                outputs = compiled.run(feeds)
        else:
            with err_console.status("compiling", spinner="dots"):
                compiled = egraft.compile(proto, threads=threads, specialize="off")
            report = compiled.report()
            console.print(f"compiled: {report.kernels} kernels, {report.views} views, {len(report.fallbacks)} on "
                          f"reference kernels{' (from the cache)' if compiled.cache_hit else ''}")
            outputs = compiled.run(feeds)
    except EgraftError as e:
        raise fail(str(e)) from None
    table = Table(title=f"{path.name}: outputs")
    for col in ("output", "type", "min", "max", "mean"):
        table.add_column(col, justify="left" if col in ("output", "type") else "right")
    for name, value in outputs.items():
        stats = ("", "", "") if value.size == 0 or value.dtype.kind not in "biuf" else (
            f"{value.min():.6g}", f"{value.max():.6g}", f"{value.astype(np.float64).mean():.6g}")
        table.add_row(name, f"{value.dtype}{list(value.shape)}", *stats)
    console.print(table)
    if output_dir is not None:
        try:
            output_dir.mkdir(parents=True, exist_ok=True)
            for name, value in outputs.items():
                np.save(targets[name], value)
        except OSError as e:
            raise fail(f"{output_dir}: cannot write the outputs: {e.strerror}") from None
        console.print(f"saved {len(outputs)} outputs to {output_dir}")
    if check:
        _check_with_onnxruntime(proto, feeds, outputs)


def _output_files(graph, output_dir: Path | None, force: bool) -> dict[str, Path]:
    """The NAME.npy file of each output in ``output_dir``, checked before the run: the folder
    must be one (or missing: it is created), and existing files need ``--force``."""
    if output_dir is None:
        return {}
    refuse_overwrite(output_dir, force, kind="folder")
    targets = {v.name: output_dir / (v.name.replace("/", "_") + ".npy") for v in graph.outputs}
    for target in targets.values():
        refuse_overwrite(target, force)
    return targets


def _check_with_onnxruntime(model, feeds: dict, outputs: dict) -> None:
    try:
        import onnxruntime as ort
    except ImportError:
        raise fail("--check needs onnxruntime: pip install 'egraft[dev]'") from None
    from egraft.testing.bench import exact_integer_products

    options = ort.SessionOptions()
    options.log_severity_level = 3
    exact_integer_products(options)  # the reference: exact u8 x s8 products on hosts without VNNI
    session = ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
    names = [o.name for o in session.get_outputs()]
    reference = dict(zip(names, session.run(names, feeds)))
    table = Table(title="egraft vs onnxruntime")
    for col in ("output", "max abs error", "max rel error", "scale-relative", "ok (<= 1e-3)"):
        table.add_column(col, justify="left" if col == "output" else "right")
    worst = 0.0
    nonfinite: list[str] = []
    for name, ref in reference.items():
        ours = outputs[name].astype(np.float64)
        ref = ref.astype(np.float64)
        if ours.shape != ref.shape:
            raise fail(f"output {name!r}: egraft shape {list(ours.shape)}, onnxruntime {list(ref.shape)}")
        # NaN/Inf compare false with everything: count the places where egraft's and
        # onnxruntime's non-finite values disagree, and measure the error on the rest.
        same = (np.isnan(ours) & np.isnan(ref)) | (np.isinf(ours) & (ours == ref))
        finite = np.isfinite(ours) & np.isfinite(ref)
        wrong = int((~same & ~finite).sum())
        diff = np.abs(ours - ref)[finite]
        abs_err = float(diff.max()) if diff.size else 0.0
        rel_err = float((diff / np.maximum(np.abs(ref[finite]), 1e-12)).max()) if diff.size else 0.0
        scale = float(np.abs(ref[finite]).max()) if diff.size else 0.0
        scaled = abs_err / scale if scale else abs_err
        worst = max(worst, scaled)
        if wrong:
            nonfinite.append(f"output {name!r}: {wrong} NaN/Inf values where onnxruntime's differ")
        ok = scaled <= 1e-3 and not wrong
        table.add_row(name, f"{abs_err:.3g}", f"{rel_err:.3g}", f"{scaled:.3g}", "yes" if ok else "NO")
    console.print(table)
    for line in nonfinite:
        err_console.print(line)
    if worst > 1e-3 or nonfinite:
        reason = f"scale-relative error {worst:.3g} > 1e-3" if worst > 1e-3 else "non-finite values"
        err_console.print(f"outputs differ from onnxruntime ({reason})")
        raise typer.Exit(code=1)


__all__ = ["show", "run"]

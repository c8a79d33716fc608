"""The rule-file commands of the ``egraft`` CLI: ``rules list``, ``rules check`` and ``rules test``.

Examples:
    egraft rules list
    egraft rules check mine.rules --counterexamples out/
    egraft rules test mine.rules
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer
from rich.table import Table
from rich.text import Text

from egraft.cli.common import console, fail
from egraft.errors import EgraftError

rules_app = typer.Typer(help="Rule files: list them, check them, test their examples.", no_args_is_help=True)


@rules_app.command("list")
def rules_list(
    files: Annotated[list[Path] | None, typer.Argument(help="Rule files (default: the shipped library).")] = None,
) -> None:
    """List rule sets and rules with their one-line descriptions."""
    from egraft.rewrite.load import load_rules

    try:
        loaded = load_rules(files or [], include_shipped=not files)
    except EgraftError as e:
        raise fail(str(e)) from None
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
    strict: Annotated[bool, typer.Option(
        "--strict", help="Also exit 1 when a rule is unchecked (no instance of its pattern could be built).")] = False,
    counterexamples: Annotated[Path | None, typer.Option(
        "--counterexamples", help="Write each unsound rule's counterexample to DIR/<rule>.onnx (outputs "
                                  "before and after) with its inputs in DIR/<rule>.inputs.npz.",
        metavar="DIR")] = None,
) -> None:
    """Check that each rule's replacement computes what it replaces, on small random
    instances of its pattern (and its examples) run by the reference executor in float64.
    Exits 1 when a rule is unsound or an example fails (with --strict, also when a rule is
    unchecked).

    Example: egraft rules check my.rules --counterexamples out/
    """
    from egraft.rewrite.soundness import check_rules

    if counterexamples is not None and counterexamples.exists() and not counterexamples.is_dir():
        raise fail(f"--counterexamples {counterexamples}: not a folder; give a folder to write the models to")
    try:
        results = check_rules(files or [], opset=opset, trials=trials, seed=seed, counterexamples=counterexamples)
    except EgraftError as e:
        raise fail(str(e)) from None
    counts = {s: sum(c.status == s for c in results) for s in ("sound", "unsound", "unchecked")}
    failing = sum(len(c.failing_examples) for c in results)
    if as_json:
        rows = [{"rule": c.rule, "where": c.loc, "status": c.status, "reason": c.reason, "instances": c.checked,
                 "instance": _trial_json(c.trial),
                 "examples": [{"where": e.loc, "status": e.status, "reason": e.reason, "instance": _trial_json(e.trial)}
                              for e in c.examples]}
                for c in results]
        print(json.dumps({"rules": rows, "counts": counts, "failing_examples": failing}, indent=2))
    else:
        table = Table(title="rule soundness")
        for col in ("rule", "status", "evidence", "where"):
            table.add_column(col)
        styles = {"sound": "green", "unsound": "bold red", "unchecked": "yellow"}
        for c in results:
            table.add_row(c.rule, Text(c.status, style=styles[c.status]), Text(_evidence(c)), c.loc)
        console.print(table)
        summary = ", ".join(f"{n} {s}" for s, n in counts.items())
        if failing:
            summary += f"; {failing} failing example{'s' if failing != 1 else ''}"
        console.print(summary)
        if not counts["unsound"] and not counts["unchecked"] and not failing:
            console.print("all sound, 0 unchecked")
    if counts["unsound"] or failing or (strict and counts["unchecked"]):
        raise typer.Exit(code=1)


def _trial_json(trial) -> dict | None:
    if trial is None:
        return None
    return {"inputs": trial.inputs, "constants": trial.constants, "opset": trial.opset, "instance": trial.instance,
            "precision": trial.precision, "mode": trial.mode, "draws": trial.draws,
            "max_abs_error": trial.max_abs_error, "max_rel_error": trial.max_rel_error, "allowed": trial.allowed,
            "file": trial.file or None}


def _evidence(check) -> str:
    """The table's evidence cell: the reason, the instance (for a sound rule, how many
    agreed), the failing examples."""
    parts = []
    if check.reason:
        parts.append(check.reason)
    if check.trial is not None:
        parts.append(check.trial.describe())
    if check.status == "sound" and check.checked:
        parts.append(f"{check.checked} instance{'s' if check.checked != 1 else ''} agreed")
    for example in check.failing_examples:
        parts.append(f"example at {example.loc}: {example.status}: {example.reason}")
    return "; ".join(parts)


def _line(loc: str) -> str:
    """``"egraft/rules/layout.rules:41:5"`` -> ``"layout.rules:41"`` (the example's file and line)."""
    path, _, rest = loc.rpartition(":")
    path, _, line = path.rpartition(":")
    return f"{Path(path).name}:{line}" if path and line.isdigit() else loc


@rules_app.command("test")
def rules_test(
    files: Annotated[list[Path], typer.Argument(help="Rule files whose examples to run.")],
    opset: Annotated[int, typer.Option(help="The ONNX opset of examples that do not give one.")] = 18,
    seed: Annotated[int, typer.Option(help="Seed of the random constants and inputs.")] = 0,
) -> None:
    """Run each rule's ``example:`` lines (only those, not the random search): the pattern
    must match the example, the guard accept it, and the replacement compute what it
    replaces. Exits 1 when an example is unsound or does not match or build.

    Example: egraft rules test my.rules
    """
    from egraft.rewrite.load import load_rules
    from egraft.rewrite.soundness import check_examples

    try:
        loaded = load_rules(list(files), include_shipped=False)
    except EgraftError as e:
        raise fail(str(e)) from None
    table = Table(title="rule examples")
    for col in ("rule", "example", "verdict", "error"):
        table.add_column(col, overflow="fold")
    styles = {"sound": "green", "unsound": "bold red", "failed": "bold red"}
    counts = {"sound": 0, "unsound": 0, "failed": 0}
    for f in loaded:
        for rule in f.rules:
            for check in check_examples(rule, opset=opset, seed=seed):
                counts[check.status] += 1
                error = check.reason
                if check.status == "unsound" and check.trial is not None:
                    error = f"{error}; {check.trial.describe()}"
                table.add_row(rule.name, _line(check.loc), Text(check.status, style=styles[check.status]), Text(error))
    console.print(table)
    total = sum(counts.values())
    console.print(f"{total} example{'s' if total != 1 else ''}: " + ", ".join(f"{n} {s}" for s, n in counts.items()))
    if counts["unsound"] or counts["failed"]:
        raise typer.Exit(code=1)


__all__ = ["rules_app", "rules_list", "rules_check", "rules_test"]

"""The rule-file commands of the ``egraft`` CLI: ``rules list`` and ``rules check``.

Examples:
    egraft rules list
    egraft rules check mine.rules
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer
from rich.table import Table

from egraft.cli.common import console, fail
from egraft.errors import EgraftError

rules_app = typer.Typer(help="Rule files: list them, check them.", no_args_is_help=True)


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
) -> None:
    """Check that each rule's replacement computes what it replaces, on small random
    instances of its pattern run by the reference executor. Exits 1 when a rule is unsound
    (with --strict, also when one is unchecked).

    Example: egraft rules check my.rules
    """
    from rich.text import Text

    from egraft.rewrite.soundness import check_rules

    try:
        results = check_rules(files or [], opset=opset, trials=trials, seed=seed)
    except EgraftError as e:
        raise fail(str(e)) from None
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
        console.print(", ".join(f"{n} {s}" for s, n in counts.items()))
    if counts["unsound"] or (strict and counts["unchecked"]):
        raise typer.Exit(code=1)


__all__ = ["rules_app", "rules_list", "rules_check"]

"""The ``egraft`` command: a thin layer over the Python API.

One module per command group, each importing only :mod:`egraft.cli.common` (consoles,
the one-line error, model names, ``--shape``, inputs, output paths); this module builds
:data:`app` and registers their commands:

- :mod:`egraft.cli.model`: ``show``, ``run``
- :mod:`egraft.cli.conformance`: ``conformance``
- :mod:`egraft.cli.plan`: ``optimize``, ``plan``, ``diff``, ``explain``, ``calibrate``
- :mod:`egraft.cli.compile`: ``compile``, ``bench``, ``profile``
- :mod:`egraft.cli.rules`: ``rules list``, ``rules check``
- :mod:`egraft.cli.cache`: ``cache show``, ``cache clear``
- :mod:`egraft.cli.zoo`: ``zoo run``, ``zoo show``, ``zoo runs``, ``zoo report``, ``zoo diff``

Every command that takes a MODEL accepts a path to an ``.onnx`` file or the name of a
model bundled with the onnx package (``resnet50``, ``squeezenet``...). Bad input exits
with status 2 and a one-line ``error:`` message.

Example:
    egraft show squeezenet
"""

from __future__ import annotations

import sys

import typer

from egraft.cli import cache, compile, conformance, model, plan, rules, zoo

app = typer.Typer(
    help="egraft: an equality-saturation compiler for ONNX models.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    context_settings={"help_option_names": ["-h", "--help"]},
)
app.command()(model.show)
app.command()(model.run)
app.command()(conformance.conformance)
app.command()(plan.optimize)
app.add_typer(rules.rules_app, name="rules")
app.command("compile")(compile.compile_command)
app.command()(compile.bench)
app.command()(compile.profile)
app.add_typer(cache.cache_app, name="cache")
app.add_typer(zoo.zoo_app, name="zoo")
app.command()(plan.plan)
app.command()(plan.diff)
app.command()(plan.explain)
app.command()(plan.calibrate)


def main() -> None:  # pragma: no cover - the console script
    """Run :data:`app`; Ctrl-C exits with status 130."""
    try:
        app()
    except KeyboardInterrupt:
        sys.exit(130)


__all__ = ["app", "main"]

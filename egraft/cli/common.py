"""What the ``egraft`` commands share: the consoles, the one-line error, model names,
``--shape`` bindings, generated inputs and the checks on output paths.

Nothing here imports a command module, so every command module imports this one and
none imports another at load time.

The consoles print text as it is (``markup=False``): a model's names, IR text and rule
text often hold brackets (``f32[batch, 4]``, ``[w]``) that rich would otherwise take for
markup and drop. The only markup is the red ``error:`` of :func:`fail`, whose message is
escaped.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import typer
from rich.console import Console
from rich.markup import escape

from egraft.errors import EgraftError, InputError

console = Console(highlight=False, markup=False)
err_console = Console(stderr=True, highlight=False, markup=False)


def fail(message: str) -> typer.Exit:
    """Print ``error: message`` (one line, the message taken literally) on stderr and
    return the exit (status 2) to raise.

    Example: ``raise fail("--threads 0: give 1 or more")``
    """
    err_console.print(f"[bold red]error:[/] {escape(message)}", markup=True, soft_wrap=True)
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


def check_bindings(bindings: dict[str, int], graph, where: str) -> None:
    """Refuse a ``--shape`` name that is none of ``graph``'s symbolic dims (it would bind
    nothing and be silently ignored). ``where`` names the model in the message."""
    from egraft.compiler import unknown_dims_message

    problem = unknown_dims_message(bindings, graph, where, option="--shape")
    if problem:
        raise InputError(problem)


def load_model(model: str):
    """The IR graph of ``model`` (a path or a bundled name)."""
    import egraft

    return egraft.load(resolve_model(model))


def refuse_overwrite(path: Path | None, force: bool, kind: str = "file") -> None:
    """Check an output path before any work is done: a path of the wrong kind (a folder
    where a file goes, or a file where a folder goes) is refused even with ``--force``;
    an existing file is refused without ``--force``. Missing parent folders are fine: the
    writer creates them (:func:`prepare_output`).

    ``kind`` is ``"file"`` or ``"folder"``.
    """
    if path is None:
        return
    if kind == "file":
        if path.is_dir():
            raise EgraftError(f"{path} is a folder; give a file path for this output")
        for parent in path.parents:
            if parent.exists() and not parent.is_dir():
                raise EgraftError(f"{parent} is a file, not a folder; cannot write {path}")
        if path.exists() and not force:
            raise EgraftError(f"{path} exists; pass --force to overwrite it or choose another path")
    else:
        if path.exists() and not path.is_dir():
            raise EgraftError(f"{path} is a file; give a folder for this output (-o DIR)")
        for parent in path.parents:
            if parent.exists() and not parent.is_dir():
                raise EgraftError(f"{parent} is a file, not a folder; cannot write {path}")


def prepare_output(path: Path) -> Path:
    """Create the missing parent folders of an output file; returns ``path``. Every
    command that writes a file creates its folder the same way."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise EgraftError(f"{path}: cannot create its folder: {e.strerror}") from None
    return path


def write_output(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` (creating missing folders); an OS error is an
    :class:`EgraftError` naming the path."""
    try:
        prepare_output(path).write_text(text)
    except OSError as e:
        raise EgraftError(f"{path}: cannot write it: {e.strerror}") from None


def read_inputs(graph, items: list[str] | None, bindings: dict[str, int],
                quiet: bool = False) -> dict[str, np.ndarray]:
    """The feeds of ``graph``: ``--input NAME=FILE.npy`` items read and checked against the
    declared inputs (name, dtype, rank, fixed dims), the others generated (arange(n)/n) at
    ``bindings``."""
    from egraft.ir.dims import evaluate_dim
    from egraft.ir.interpreter import check_feeds

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
            f"input {v.name}: generated arange(n)/n with shape {shape} ({v.type.dtype.short})")
    check_feeds(graph, feeds)  # name, dtype, rank and fixed dims, before anything is compiled
    return feeds


__all__ = ["console", "err_console", "fail", "resolve_model", "parse_bindings", "check_bindings", "load_model",
           "refuse_overwrite", "prepare_output", "write_output", "read_inputs"]

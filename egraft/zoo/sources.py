"""What ``egraft zoo run SOURCE...`` runs: each SOURCE becomes a list of :class:`ZooModel`.

A SOURCE is one of:

- a folder: every ``*.onnx`` below it, named by its path relative to the folder
  (``vision/resnet``), inputs generated (:mod:`egraft.zoo.inputs`);
- a ``.onnx`` file: that model, named by its file stem;
- a manifest (``.toml``): ``[[model]]`` tables with ``path`` (relative to the manifest),
  and optionally ``name``, ``tolerance``, ``shapes`` (bindings of the symbolic dims to
  check at; the first is benchmarked) and ``[[model.input]]`` specs as in the real-model
  corpus (``docs/zoo.md`` shows one);
- ``corpus``, ``corpus:fast`` or ``corpus:NAME``: the real-model corpus (fetched when
  missing), with its manifest's inputs, bindings and tolerances;
- ``bundled`` or a bundled model's name (``resnet50``...): the light models of the onnx
  package as the benchmarks run them (re-weighted, the softmax logits an extra output:
  :func:`egraft.testing.models.reweighted_model_path`), inputs generated.

Example:
    >>> [m.name for m in resolve_sources(["squeezenet", "resnet50"])]
    ['squeezenet', 'resnet50']
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

from egraft.errors import EgraftError

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

DEFAULT_TOLERANCE = 1e-3
_MANIFEST_FIELDS = {"path", "name", "tolerance", "shapes", "input"}


@dataclass(frozen=True)
class ZooModel:
    """One model of a zoo run.

    Attributes:
        name: its name in the run (unique within it).
        path: the ONNX file.
        inputs: input specs (:class:`egraft.testing.corpus.InputSpec` fields as dicts);
            inputs not listed are generated from the graph.
        bindings: the dims to check at, each ``{"dims": {...}, "values": {...}}``; the first is
            benchmarked. Empty: every symbolic dim at ``--shape`` or its default.
        tolerance: the scale-relative error the check stage accepts.
        problem: why the model cannot run (a corpus model that could not be fetched): it
            becomes an ``error`` row without a process.
    """

    name: str
    path: Path
    inputs: tuple[dict, ...] = ()
    bindings: tuple[dict, ...] = ()
    tolerance: float = DEFAULT_TOLERANCE
    problem: str | None = None
    origin: str = "file"
    extra: dict = field(default_factory=dict)

    def spec(self) -> dict:
        """The JSON-able description an isolated process runs from."""
        d = asdict(self)
        d["path"] = str(self.path)
        return d


def _bundled(names: Sequence[str]) -> list[ZooModel]:
    from egraft.testing.models import reweighted_model_path

    return [ZooModel(name, reweighted_model_path(name), origin="bundled") for name in names]


def _corpus(selector: str, say: Callable[[str], None]) -> list[ZooModel]:
    from egraft.testing.corpus import CorpusError, entries, entry, fetch, model_path

    try:
        chosen = entries(fast=True) if selector == "fast" else [entry(selector)] if selector else entries()
    except CorpusError as e:
        raise EgraftError(f"corpus:{selector}: {e}") from None
    problems: dict[str, str] = {}
    missing = []
    for e in chosen:
        try:
            model_path(e.name)
        except CorpusError:
            missing.append(e.name)
    if missing:
        say(f"fetching {len(missing)} corpus model(s) into the corpus folder")
        for name in missing:
            try:
                fetch([name], progress=say)
            except CorpusError as err:
                problems[name] = f"fetch failed: {err}"
    out = []
    for e in chosen:
        inputs = tuple(asdict(spec) for spec in e.inputs)
        bindings = tuple({"dims": dict(b.dims), "values": dict(b.values)} for b in e.bindings)
        path = Path(model_path(e.name)) if e.name not in problems else Path(e.path)
        out.append(ZooModel(e.name, path, inputs, bindings, e.tolerance, problems.get(e.name), origin="corpus"))
    return out


def _folder(folder: Path) -> list[ZooModel]:
    files = sorted(p for p in folder.rglob("*.onnx") if p.is_file())
    if not files:
        raise EgraftError(f"{folder}: no .onnx files below this folder")
    return [ZooModel(p.relative_to(folder).with_suffix("").as_posix(), p) for p in files]


def _manifest(path: Path) -> list[ZooModel]:
    from egraft.testing.corpus import CorpusError, parse_input_spec

    try:
        with open(path, "rb") as f:
            data = tomllib.load(f)
    except OSError as e:
        raise EgraftError(f"{path}: cannot read it: {e.strerror}") from None
    except tomllib.TOMLDecodeError as e:
        raise EgraftError(f"{path}: not valid TOML: {e}") from None
    raws = data.get("model")
    if not isinstance(raws, list) or not raws:
        raise EgraftError(f"{path}: no [[model]] tables; each needs at least path = \"model.onnx\"")
    out = []
    for i, raw in enumerate(raws, 1):
        where = f"{path}: model {i}"
        unknown = sorted(set(raw) - _MANIFEST_FIELDS)
        if unknown:
            raise EgraftError(f"{where}: unknown field(s) {unknown}; known: {sorted(_MANIFEST_FIELDS)}")
        if "path" not in raw:
            raise EgraftError(f"{where}: no path")
        file = (path.parent / raw["path"]).resolve()
        name = str(raw.get("name") or Path(raw["path"]).stem)
        where = f"{path}: model {name!r}"
        try:
            inputs = [asdict(parse_input_spec(spec, where)) for spec in raw.get("input", [])]
        except CorpusError as e:
            raise EgraftError(str(e)) from None
        shapes = raw.get("shapes", [])
        if not isinstance(shapes, list) or not all(isinstance(s, dict) for s in shapes):
            raise EgraftError(f"{where}: shapes must be a list of tables, e.g. shapes = [{{batch = 1, seq = 16}}]")
        for s in shapes:
            bad = [f"{k}={v!r}" for k, v in s.items() if not isinstance(v, int) or isinstance(v, bool) or v < 0]
            if bad:
                raise EgraftError(f"{where}: shapes: {', '.join(bad)} is not a dim size (an integer >= 0)")
        tolerance = raw.get("tolerance", DEFAULT_TOLERANCE)
        if not isinstance(tolerance, int | float) or tolerance < 0:
            raise EgraftError(f"{where}: tolerance {tolerance!r} is not a non-negative number")
        out.append(ZooModel(name, file, tuple(inputs), tuple({"dims": dict(s), "values": {}} for s in shapes),
                            float(tolerance), origin="manifest"))
    return out


def resolve_sources(sources: Sequence[str], say: Callable[[str], None] = lambda _: None) -> list[ZooModel]:
    """The models of every SOURCE, in order; EgraftError for a source that is none of the
    kinds above, and for two models with the same name."""
    from egraft.testing.models import LIGHT_MODELS

    models: list[ZooModel] = []
    for source in sources:
        path = Path(source)
        if source == "corpus" or source.startswith("corpus:"):
            models += _corpus(source.partition(":")[2], say)
        elif source == "bundled":
            models += _bundled(LIGHT_MODELS)
        elif path.is_dir():
            models += _folder(path)
        elif path.suffix == ".toml":
            if not path.is_file():
                raise EgraftError(f"{source}: no such manifest")
            models += _manifest(path)
        elif path.suffix == ".onnx" or path.exists():
            if not path.is_file():
                raise EgraftError(f"{source}: no such file")
            models.append(ZooModel(path.stem, path))
        elif source.removeprefix("light_") in LIGHT_MODELS:
            models += _bundled([source.removeprefix("light_")])
        else:
            raise EgraftError(f"{source}: not a folder, an .onnx file, a .toml manifest, 'corpus[:fast|:NAME]', "
                              f"'bundled' or a bundled model ({', '.join(LIGHT_MODELS)})")
    models = [replace(m, path=m.path.resolve()) for m in models]  # Dask workers run elsewhere
    seen: dict[str, ZooModel] = {}
    for m in models:
        if m.name in seen:
            raise EgraftError(f"two models are named {m.name!r} ({seen[m.name].path} and {m.path}); "
                              "give them different names in a manifest")
        seen[m.name] = m
    return models


__all__ = ["ZooModel", "resolve_sources", "DEFAULT_TOLERANCE"]

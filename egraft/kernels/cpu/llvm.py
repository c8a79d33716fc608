"""llvmlite set-up: the host target machine, the -O3 pipeline and JIT compilation of a
module, with the compiled object code cached on disk.

The cache (:func:`cache_dir`) keeps each entry as its files (``KEY.o`` here,
``KEY.pkl``/``KEY.bin`` for :mod:`egraft.compiler`) and ``KEY.json``, their SHA-256
checksums, written last: an entry whose files do not match is damaged, removed with a
warning and rebuilt (LLVM would abort on damaged object code). The cache holds at most
``$EGRAFT_CACHE_MAX`` bytes (default 4 GiB): writing an entry evicts the least recently
used ones (:func:`evict`).

One :class:`JitModule` owns one MCJIT engine; its functions stay callable as long as the
object lives. Compilation optimizes for the host CPU's real features (AVX-512 where
present, AVX2 elsewhere) with loop and SLP vectorization on.

Example:
    >>> mod = jit_compile(module_text)                       # doctest: +SKIP
    >>> address = mod.address("relu_0")                      # doctest: +SKIP
"""

from __future__ import annotations

import hashlib
import os
import threading
from functools import cache
from pathlib import Path

import llvmlite
import llvmlite.binding as llvm

_LOCK = threading.Lock()


@cache
def _initialized() -> bool:
    llvm.initialize_native_target()
    llvm.initialize_native_asmprinter()
    return True


@cache
def host_cpu() -> tuple[str, str, str]:
    """(triple, cpu name, feature string) of this machine, as LLVM sees it."""
    _initialized()
    return llvm.get_process_triple(), llvm.get_host_cpu_name(), llvm.get_host_cpu_features().flatten()


def host_vector_bits() -> int:
    """The widest float vector the host has: 512 with AVX-512F, 256 with AVX, else 128."""
    features = host_cpu()[2].split(",")
    if "+avx512f" in features:
        return 512
    if "+avx" in features:
        return 256
    return 128


def _target_machine():
    triple, cpu, features = host_cpu()
    target = llvm.Target.from_triple(triple)
    return target.create_target_machine(cpu=cpu, features=features, opt=3, jit=True)


def cache_dir() -> Path:
    """Where compiled objects are kept: ``$EGRAFT_CACHE_DIR``, else ``$XDG_CACHE_HOME/egraft``,
    else ``~/.cache/egraft`` (``objects/`` below it)."""
    if os.environ.get("EGRAFT_CACHE_DIR"):
        return Path(os.environ["EGRAFT_CACHE_DIR"])
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "egraft"


#: The cache's size cap when ``$EGRAFT_CACHE_MAX`` is not set (4 GiB).
DEFAULT_CACHE_MAX = 4 * 2**30
_UNITS = {"": 1, "B": 1, "K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}


def cache_max_bytes() -> int:
    """The cache's size cap: ``$EGRAFT_CACHE_MAX`` (bytes, or with a unit: ``500M``,
    ``2G``, ``1.5G``; ``0`` keeps nothing), else :data:`DEFAULT_CACHE_MAX`. An unreadable
    value is an :class:`EgraftError` naming it."""
    from egraft.errors import EgraftError

    text = os.environ.get("EGRAFT_CACHE_MAX", "").strip()
    if not text:
        return DEFAULT_CACHE_MAX
    number, unit = text.upper().rstrip("IB") or "0", ""
    if number[-1:] in _UNITS and not number[-1:].isdigit():
        number, unit = number[:-1], number[-1]
    try:
        value = float(number) * _UNITS[unit]
    except (ValueError, KeyError):
        raise EgraftError(f"EGRAFT_CACHE_MAX={text!r}: expected a size such as 500M, 2G or 1073741824") from None
    if value < 0:
        raise EgraftError(f"EGRAFT_CACHE_MAX={text!r}: a size cannot be negative")
    return int(value)


def file_digest(path: Path) -> str:
    """The SHA-256 of a file's bytes (hex)."""
    with path.open("rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def write_meta(meta_path: Path, files: dict[str, Path], **extra) -> None:
    """Write a cache entry's metadata (last: its presence means the entry is complete):
    the SHA-256 and size of each of its ``files`` (by role), plus ``extra`` fields."""
    import json

    document = {"files": {role: {"name": f.name, "sha256": file_digest(f), "bytes": f.stat().st_size}
                          for role, f in files.items()}, **extra}
    tmp = meta_path.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_text(json.dumps(document, indent=1) + "\n")
    tmp.replace(meta_path)


def verify_meta(meta_path: Path) -> tuple[dict | None, str | None]:
    """``(metadata, None)`` when every file the entry's metadata lists has its recorded
    size and SHA-256, else ``(None, what is wrong)``; a missing metadata file is
    ``(None, None)`` (no entry). A verified entry is marked used now (least-recently-used
    eviction reads the metadata file's time)."""
    import json

    if not meta_path.is_file():
        return None, None
    try:
        document = json.loads(meta_path.read_text())
        for info in document["files"].values():
            f = meta_path.parent / info["name"]
            if not f.is_file():
                return None, f"{f.name} is missing"
            if f.stat().st_size != info["bytes"] or file_digest(f) != info["sha256"]:
                return None, f"{f.name} does not match its checksum"
        os.utime(meta_path)
    except (OSError, ValueError, KeyError, TypeError) as e:
        return None, f"{meta_path.name} is unreadable ({type(e).__name__})"
    return document, None


def damaged(meta_path: Path, problem: str) -> None:
    """Warn that a cache entry is damaged and remove its files (it is rebuilt)."""
    import warnings

    warnings.warn(f"egraft cache: the entry {meta_path.with_suffix('')} is damaged ({problem}); rebuilding it",
                  RuntimeWarning, stacklevel=3)
    for f in meta_path.parent.glob(meta_path.stem.split(".")[0] + ".*"):
        try:
            f.unlink()
        except OSError:
            pass


def evict(keep: Path | None = None, limit: int | None = None) -> int:
    """Remove least-recently-used cache entries until the cache (compiled models and object
    files) holds at most ``limit`` bytes (default :func:`cache_max_bytes`); the entry whose
    metadata is ``keep`` (just written) stays. Returns the bytes removed. An entry is the
    files of one key (``KEY.*``); its last use is its metadata file's time."""
    if limit is None:
        from egraft.errors import EgraftError

        try:
            limit = cache_max_bytes()
        except EgraftError as e:
            import warnings

            warnings.warn(f"{e}; using the default cap", RuntimeWarning, stacklevel=2)
            limit = DEFAULT_CACHE_MAX
    entries: dict[Path, list[Path]] = {}
    for sub in ("compiled", "objects"):
        folder = cache_dir() / sub
        if folder.is_dir():
            for f in folder.iterdir():
                if f.is_file():
                    entries.setdefault(folder / f.name.split(".")[0], []).append(f)

    def size(files):
        return sum(f.stat().st_size for f in files if f.exists())

    def last_used(stem: Path) -> float:
        meta = stem.with_suffix(".json")
        try:
            return meta.stat().st_mtime
        except OSError:
            return 0.0  # no metadata: incomplete or foreign, the first to go

    total = sum(size(files) for files in entries.values())
    removed = 0
    keep_stem = None if keep is None else keep.parent / keep.name.split(".")[0]
    for stem in sorted(entries, key=last_used):
        if total <= limit:
            break
        if stem == keep_stem:
            continue
        freed = size(entries[stem])
        for f in entries[stem]:
            try:
                f.unlink()
            except OSError:
                pass
        total -= freed
        removed += freed
    return removed


def object_key(module_text: str) -> str:
    """The cache key of a module's object code: its IR, the host CPU and llvmlite's version."""
    h = hashlib.sha256()
    for part in (module_text, *host_cpu(), llvmlite.__version__):
        h.update(part.encode())
        h.update(b"\0")
    return h.hexdigest()


class JitModule:
    """A compiled module: function addresses by name; keep it alive while they are called.

    Attributes:
        cached: True when the object code came from the disk cache (no LLVM passes ran).
        seconds: time spent parsing, optimizing and generating code.
    """

    def __init__(self, module_text: str, use_cache: bool = True):
        import time

        _initialized()
        start = time.perf_counter()
        self.key = object_key(module_text)
        path = cache_dir() / "objects" / f"{self.key}.o"
        self._object = self._verified_object(path) if use_cache else None
        self.cached = self._object is not None
        with _LOCK:
            module = llvm.parse_assembly(module_text)
            module.verify()
            self._tm = _target_machine()
            if not self.cached:
                pto = llvm.create_pipeline_tuning_options(speed_level=3)
                pto.loop_vectorization = True
                pto.slp_vectorization = True
                pto.loop_unrolling = True
                pto.loop_interleaving = True
                builder = llvm.create_pass_builder(self._tm, pto)
                builder.getModulePassManager().run(module, builder)
            self._engine = llvm.create_mcjit_compiler(module, self._tm)
            if use_cache:
                self._engine.set_object_cache(self._store(path), self._load())
            self._engine.finalize_object()
        self.seconds = time.perf_counter() - start

    @staticmethod
    def _verified_object(path: Path) -> bytes | None:
        """The cached object code at ``path`` when its checksum (in ``KEY.json``) matches;
        a damaged one (LLVM would abort on it) is removed with a warning and rebuilt."""
        meta = path.with_suffix(".json")
        document, problem = verify_meta(meta)
        if problem:
            damaged(meta, problem)
        if document is None:
            return None
        try:
            data = path.read_bytes()
        except OSError:
            return None
        if hashlib.sha256(data).hexdigest() != document["files"]["object"]["sha256"]:
            damaged(meta, f"{path.name} changed while it was read")
            return None
        return data

    @staticmethod
    def _store(path: Path):
        def notify(module, buffer: bytes) -> None:
            try:
                path.parent.mkdir(parents=True, exist_ok=True)
                tmp = path.with_suffix(f".{os.getpid()}.tmp")
                tmp.write_bytes(buffer)
                tmp.replace(path)  # atomic: a reader never sees half a file
                meta = path.with_suffix(".json")
                write_meta(meta, {"object": path})
                evict(keep=meta)
            except OSError:
                pass  # a read-only cache only costs the next compile its time
        return notify

    def _load(self):
        def getbuffer(module) -> bytes | None:
            return self._object  # verified before LLVM sees it, or None: compile it
        return getbuffer

    def address(self, name: str) -> int:
        """The address of function ``name`` (0 when the module has none)."""
        return self._engine.get_function_address(name)

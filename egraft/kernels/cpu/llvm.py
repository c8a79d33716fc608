"""llvmlite set-up: the host target machine, the -O3 pipeline, and modules compiled to
object code (cached on disk, compiled in parallel processes) then linked in one JIT engine.

Each module compiles to one object (:func:`object_code`); the cache (:func:`cache_dir`)
keeps it as ``KEY.o`` (``KEY.pkl``/``KEY.bin`` for :mod:`egraft.compiler`'s compiled
models), keyed by the module's text, the host CPU and llvmlite's version
(:func:`object_key`), so a kernel compiled for one model is found by the next. Modules
not in the cache are shared out between this process and helper processes
(:func:`compile_objects`). ``KEY.json`` holds the entry's SHA-256 checksums, written
last: an entry whose files do not match is damaged, removed with a warning and rebuilt
(LLVM would abort on damaged object code). The cache holds at most ``$EGRAFT_CACHE_MAX``
bytes (default 4 GiB): writing an entry evicts the least recently used ones (:func:`evict`).

One :class:`JitModule` owns one MCJIT engine holding its objects, which may call each
other; its functions stay callable as long as the object lives. Compilation optimizes
for the host CPU's real features (AVX-512 where present, AVX2 elsewhere) with loop and
SLP vectorization on.

Example:
    >>> mod = JitModule([stubs_text, *kernel_texts])         # doctest: +SKIP
    >>> address = mod.address("k0_Relu")                     # doctest: +SKIP
"""

from __future__ import annotations

import contextvars
import hashlib
import os
import threading
from collections.abc import Callable, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import llvmlite
import llvmlite.binding as llvm

from egraft.kernels.cpu import early_compile

LOCK = threading.Lock()


@cache
def initialized() -> bool:
    llvm.initialize_native_target()
    llvm.initialize_native_asmprinter()
    return True


@cache
def host_cpu() -> tuple[str, str, str]:
    """(triple, cpu name, feature string) of this machine, as LLVM sees it."""
    initialized()
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


#: The cache folder of a background build, fixed when it was asked for (:func:`pinned_cache_dir`).
_PINNED_CACHE_DIR: contextvars.ContextVar[Path | None] = contextvars.ContextVar("egraft_cache_dir", default=None)


def cache_dir() -> Path:
    """Where compiled objects are kept: ``$EGRAFT_CACHE_DIR``, else ``$XDG_CACHE_HOME/egraft``,
    else ``~/.cache/egraft`` (``objects/`` below it); within :func:`pinned_cache_dir`, its folder."""
    pinned = _PINNED_CACHE_DIR.get()
    if pinned is not None:
        return pinned
    if os.environ.get("EGRAFT_CACHE_DIR"):
        return Path(os.environ["EGRAFT_CACHE_DIR"])
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "egraft"


@contextmanager
def pinned_cache_dir(folder: Path):
    """Within the block, :func:`cache_dir` is ``folder`` whatever the environment says since:
    a variant built in the background goes to (and is read back from) the cache of the
    compile that asked for it, not wherever ``$EGRAFT_CACHE_DIR`` points by the time it runs.

    Example:
        >>> with pinned_cache_dir(Path("/tmp/c")):
        ...     str(cache_dir())
        '/tmp/c'
    """
    token = _PINNED_CACHE_DIR.set(Path(folder))
    try:
        yield Path(folder)
    finally:
        _PINNED_CACHE_DIR.reset(token)


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


def write_meta(meta_path: Path, files: dict[str, Path], **extra) -> int:
    """Write a cache entry's metadata (last: its presence means the entry is complete):
    the SHA-256 and size of each of its ``files`` (by role), plus ``extra`` fields. Returns
    the entry's bytes, its metadata's included (what :func:`evict_if_full` adds to its count)."""
    import json

    document = {"files": {role: {"name": f.name, "sha256": file_digest(f), "bytes": f.stat().st_size}
                          for role, f in files.items()}, **extra}
    text = json.dumps(document, indent=1) + "\n"
    tmp = meta_path.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_text(text)
    tmp.replace(meta_path)
    return len(text.encode()) + sum(info["bytes"] for info in document["files"].values())


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


#: The cache's bytes as this process last counted them, per folder, plus what it wrote since, and
#: when it counted: a write scans the folder (every file's size) only when that estimate passes
#: the cap or the count is older than :data:`RECOUNT_SECONDS` (other processes write too).
#: Scanning on every write made a run of many small compiles quadratic: the conformance suite's
#: 1,500 models spent a fifth of their time listing the cache.
_COUNTED: dict[str, tuple[int, float]] = {}
_COUNTED_LOCK = threading.Lock()
RECOUNT_SECONDS = 60.0


def _cap() -> int:
    """:func:`cache_max_bytes`, or the default with a warning when ``$EGRAFT_CACHE_MAX`` is not a size."""
    from egraft.errors import EgraftError

    try:
        return cache_max_bytes()
    except EgraftError as e:
        import warnings

        warnings.warn(f"{e}; using the default cap", RuntimeWarning, stacklevel=3)
        return DEFAULT_CACHE_MAX


def evict_if_full(meta: Path, added: int) -> int:
    """After an entry of ``added`` bytes was written (``meta``, its metadata; what
    :func:`write_meta` returned): :func:`evict` when the cache may hold more than its cap (this
    process's count of it, see :data:`_COUNTED`); the bytes removed."""
    import time

    limit = _cap()
    folder, now = str(cache_dir()), time.monotonic()
    with _COUNTED_LOCK:
        counted = _COUNTED.get(folder)
        if counted is not None and counted[0] + added <= limit and now - counted[1] < RECOUNT_SECONDS:
            _COUNTED[folder] = (counted[0] + added, counted[1])
            return 0
    return evict(keep=meta, limit=limit)


def evict(keep: Path | None = None, limit: int | None = None) -> int:
    """Remove least-recently-used cache entries until the cache (compiled models and object
    files) holds at most ``limit`` bytes (default :func:`cache_max_bytes`); the entry whose
    metadata is ``keep`` (just written) stays. Returns the bytes removed. An entry is the
    files of one key (``KEY.*``); its last use is its metadata file's time."""
    import time

    if limit is None:
        limit = _cap()
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
    with _COUNTED_LOCK:
        _COUNTED[str(cache_dir())] = (total, time.monotonic())
    return removed


def object_path(key: str) -> Path:
    """Where the disk cache keeps the object code of :func:`object_key` ``key``."""
    return cache_dir() / "objects" / f"{key}.o"


def object_key(module_text: str) -> str:
    """The cache key of a module's object code: its IR, the host CPU and llvmlite's version."""
    h = hashlib.sha256()
    for part in (module_text, *host_cpu(), llvmlite.__version__):
        h.update(part.encode())
        h.update(b"\0")
    return h.hexdigest()


#: ``$EGRAFT_COMPILE_JOBS``: how many processes compile a model's kernels (default: every
#: core this process may use; 1 compiles in this process only).
_JOBS_VARIABLE = "EGRAFT_COMPILE_JOBS"
#: Helper processes are started only for at least this much IR still to compile (a helper
#: starts in about 80 ms; one kernel of that size compiles in about as long).
PARALLEL_MIN_CHARS = 200_000


def compile_jobs() -> int:
    """The processes :func:`compile_objects` may use: ``$EGRAFT_COMPILE_JOBS``, else the cores."""
    value = os.environ.get(_JOBS_VARIABLE, "")
    return int(value) if value.isdigit() and int(value) > 0 else cpu_count()


def cpu_count() -> int:
    """The cores this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


#: The first line of a module whose generator asks for a lighter pipeline, with the words of
#: :func:`pipeline_header`: ``no-unroll`` when it unrolled its loops already (register tiles: a
#: symbolic-size blocked convolution took 1.3 s to compile with LLVM's runtime unrolling of its
#: tile loops, 0.25 s without, and ran no faster with it); ``no-loop-vectorize`` when its code
#: is vector code already (the loop vectorizer and interleaver then only add versions of the
#: scalar loops around it: ppocr_v4_det's symbolic convolutions took 0.7-0.97 s each with them,
#: 0.25-0.4 s without).
PIPELINE_HEADER = "; egraft llvm:"
_NO_UNROLL, _NO_LOOP_VECTORIZE = "no-unroll", "no-loop-vectorize"


def pipeline_header(unroll: bool = True, loop_vectorize: bool = True) -> str:
    """The first line that asks :func:`object_code` to leave out LLVM's loop unrolling or its
    loop vectorizer (empty when both stay).

    Example:
        >>> pipeline_header(unroll=False, loop_vectorize=False)
        '; egraft llvm: no-unroll no-loop-vectorize\\n'
    """
    words = [w for w, keep in ((_NO_UNROLL, unroll), (_NO_LOOP_VECTORIZE, loop_vectorize)) if not keep]
    return f"{PIPELINE_HEADER} {' '.join(words)}\n" if words else ""


def _pipeline_tuning(module_text: str = ""):
    first = module_text[:120].split("\n", 1)[0] if module_text.startswith(PIPELINE_HEADER) else ""
    words = set(first[len(PIPELINE_HEADER):].split())
    pto = llvm.create_pipeline_tuning_options(speed_level=3)
    pto.loop_vectorization = pto.loop_interleaving = _NO_LOOP_VECTORIZE not in words
    pto.slp_vectorization = True
    pto.loop_unrolling = _NO_UNROLL not in words
    return pto


def object_code(module_text: str) -> bytes:
    """``module_text`` parsed, verified, optimized at -O3 for the host CPU and compiled to
    object code (in a context of its own, freed after)."""
    initialized()
    with LOCK:
        context = llvm.create_context()
        module = llvm.parse_assembly(module_text, context=context)
        module.verify()
        machine = _target_machine()
        builder = llvm.create_pass_builder(machine, _pipeline_tuning(module_text))
        builder.getModulePassManager().run(module, builder)
        return machine.emit_object(module)


def _store_object(path: Path, data: bytes) -> None:
    """Write one object into the cache (atomically, metadata last); a read-only cache only
    costs the next compile its time."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_bytes(data)
        tmp.replace(path)  # atomic: a reader never sees half a file
        meta = path.with_suffix(".json")
        evict_if_full(meta, write_meta(meta, {"object": path}))
    except OSError:
        pass


@dataclass(frozen=True)
class DeferredModule:
    """A module whose text is costly to build (the GEMM library: half a second of Python):
    ``key`` names everything the text depends on (the generator's source and parameters),
    ``build`` makes the text, only when the disk cache has no object for the key."""

    key: str
    build: Callable[[], str]


@cache
def source_digest() -> str:
    """SHA-256 of egraft's own Python sources (what a generated module's text depends on)."""
    h = hashlib.sha256()
    root = Path(__file__).resolve().parents[2]
    for path in sorted(root.rglob("*.py")):
        h.update(path.relative_to(root).as_posix().encode())
        h.update(path.read_bytes())
    return h.hexdigest()


def compile_objects(modules: Sequence[str | DeferredModule], use_cache: bool = True,
                    early: early_compile.Session | None = None) -> tuple[list[bytes], list[bool]]:
    """The object code of each module and whether it came from the disk cache (keyed by
    :func:`object_key`: a module compiled for any model before is not compiled again).

    The modules to compile are shared out, largest first, between this process and up to
    :func:`compile_jobs` - 1 helper processes (:mod:`egraft.kernels.cpu.object_worker`;
    llvmlite serializes every call into LLVM, so threads would not run in parallel); each
    takes the next module as soon as it is done with one. ``early``: the session of the
    lowering that made the modules (:mod:`egraft.kernels.cpu.early_compile`), whose helper
    started on them already.
    """
    objects: list[bytes | None] = [None] * len(modules)
    keys = [object_key(m) if isinstance(m, str) else object_key(m.key) for m in modules]
    paths = [object_path(key) for key in keys]
    if use_cache:
        for i, path in enumerate(paths):
            objects[i] = _verified_object(path)
    hits = [o is not None for o in objects]
    module_texts = [m if isinstance(m, str) or objects[i] is not None else m.build() for i, m in enumerate(modules)]
    first: dict[str, int] = {}  # equal modules compile once
    for i, key in enumerate(keys):
        if objects[i] is None:
            first.setdefault(key, i)
    pending = sorted(first.values(), key=lambda i: -len(module_texts[i]))
    done: dict[int, bytes] = {}
    if pending and early is not None:  # begun while the model was lowered
        made = early.take_all(object_code)
        done = {i: made[keys[i]] for i in pending if keys[i] in made}
        pending = [i for i in pending if i not in done]
    if pending:
        helpers = min(compile_jobs(), len(pending)) - 1
        if sum(len(module_texts[i]) for i in pending) < PARALLEL_MIN_CHARS:
            helpers = 0
        done.update(_compile_shared(module_texts, pending, helpers))
    if use_cache:
        for i, data in done.items():
            _store_object(paths[i], data)
    for i, key in enumerate(keys):
        if objects[i] is None:
            objects[i] = done[first[key]]
    return objects, hits  # type: ignore[return-value]


def submit_early(module_text: str) -> None:
    """Start compiling ``module_text`` now when a lowering's session is under way
    (:mod:`egraft.kernels.cpu.early_compile`) and the disk cache has no object for it."""
    session = early_compile.current()
    if session is None:
        return
    key = object_key(module_text)
    if not object_path(key).exists():
        session.submit(key, module_text)


def _compile_shared(module_texts: Sequence[str], pending: list[int], helpers: int) -> dict[int, bytes]:
    """Compile ``pending`` (indices into ``module_texts``) here and in ``helpers`` processes."""
    import queue

    jobs: queue.SimpleQueue[int] = queue.SimpleQueue()
    for i in pending:
        jobs.put(i)
    done: dict[int, bytes] = {}

    def next_job() -> int | None:
        try:
            return jobs.get_nowait()
        except queue.Empty:
            return None

    def helper() -> None:
        from egraft.kernels.cpu.object_worker import Helper

        try:
            process = Helper()
        except OSError:
            return  # no helper: this process compiles everything
        try:
            while (i := next_job()) is not None:
                reply = process.compile(module_texts[i])
                if reply is None:  # the helper failed: compile it here (and raise its error here)
                    jobs.put(i)
                    break
                done[i] = reply
        finally:
            process.close()

    threads = [threading.Thread(target=helper, daemon=True) for _ in range(helpers)]
    for t in threads:
        t.start()
    while (i := next_job()) is not None:
        done[i] = object_code(module_texts[i])
    for t in threads:
        t.join()
    while (i := next_job()) is not None:  # a helper gave back what it could not compile
        done[i] = object_code(module_texts[i])
    return done


def _verified_object(path: Path) -> bytes | None:
    """The cached object code at ``path`` when its checksum (in ``KEY.json``) matches; a
    damaged one (LLVM would abort on it) is removed with a warning and rebuilt."""
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


class JitModule:
    """Compiled modules linked in one engine: function addresses by name; keep it alive
    while they are called. The modules may call each other's functions.

    Attributes:
        cached: True when every object came from the disk cache (no LLVM passes ran).
        compiled: how many modules were compiled (not found in the cache).
        seconds: time spent compiling (or loading) and linking.
    """

    def __init__(self, modules: str | DeferredModule | Sequence[str | DeferredModule], use_cache: bool = True,
                 compiled: tuple[list[bytes], list[bool]] | None = None,
                 early: early_compile.Session | None = None):
        """``compiled``: what :func:`compile_objects` returned for ``modules`` when the caller
        already ran it (with more modules beside: the library), so nothing is read twice;
        ``early``: see :func:`compile_objects`."""
        import time

        from egraft.kernels.cpu import amx

        initialized()
        amx.enable()  # a cached kernel may use the tile registers: Linux lends them on request
        start = time.perf_counter()
        texts = [modules] if isinstance(modules, str | DeferredModule) else list(modules)
        objects, hits = compiled if compiled is not None else compile_objects(texts, use_cache, early)
        self.cached = all(hits)
        self.compiled = len(texts) - sum(hits)
        with LOCK:
            self._tm = _target_machine()
            empty = llvm.parse_assembly(f'target triple = "{host_cpu()[0]}"')
            self._engine = llvm.create_mcjit_compiler(empty, self._tm)
            self._objects = [llvm.ObjectFileRef.from_data(data) for data in objects]
            for obj in self._objects:
                self._engine.add_object_file(obj)
            self._engine.finalize_object()
        self.seconds = time.perf_counter() - start

    def address(self, name: str) -> int:
        """The address of function ``name`` (0 when no module has it)."""
        return self._engine.get_function_address(name)

"""The compile cache's entries: one compiled model on disk, read back without rewriting,
LLVM or any kernel generator (the object code is cached by :mod:`egraft.kernels.cpu.llvm`).

An entry is ``compiled/KEY.*``, KEY the SHA-256 of all that decides the result (:func:`entry_path`):
``KEY.bin``, the constants a hit's steps read at run time (packed weights included), 64-byte aligned,
memory-mapped on a hit; ``KEY.pkl``, the lowered schedule (its LLVM IR zlib-compressed), where each
constant lies in the blob and the entry's :class:`EntryPlan` less what the blob holds; ``KEY.json``,
written last, the SHA-256 of both (checked before anything is read: a damaged entry is rebuilt).
The plan says what the blob leaves out and how a hit gets it back, from the kernels' records
(:class:`~egraft.kernels.cpu.emit.PackedFrom`: which packing made which derived constant from which
weight), never by guessing: a packed copy packed again from its stored weight (``recompute``), a weight
only its packed copy is read through unpacked from it on demand (``restore``, :class:`RestoredConstants`).
``$EGRAFT_CACHE_MAX`` caps the whole cache; writing an entry evicts the least recently used ones.
"""

from __future__ import annotations

import contextvars
import copy
import hashlib
import os
import pickle
import shutil
import threading
import zlib
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from egraft.errors import EgraftError
from egraft.ir.graph import Graph

if TYPE_CHECKING:
    from egraft.kernels.cpu.emit import PackedFrom

#: The entries' format: an entry of another format is rebuilt (4: the plan holds PackedFrom
#: records; 5: kernels are modules of their own, called through stubs).
CACHE_FORMAT = 5

#: An entry's constants (``KEY.bin``) hold at most this multiple of the model's weights'
#: bytes (the constants the nodes read, less those computed from others); the schedule
#: and the object code take the rest of the 1.2x.
CONSTANTS_BUDGET = 1.1


# ---- the key ---------------------------------------------------------------------------------------
@cache
def _source_digest() -> str:
    """SHA-256 over egraft's own .py, .rules and .toml files, or ``$EGRAFT_SOURCE_DIGEST``:
    a worker that builds for its parent process (:mod:`egraft.specializing`) keys its
    entries as the parent does, even if egraft's files changed since the parent started."""
    if os.environ.get("EGRAFT_SOURCE_DIGEST"):
        return os.environ["EGRAFT_SOURCE_DIGEST"]
    root = Path(__file__).resolve().parent
    h = hashlib.sha256()
    for path in sorted(root.rglob("*")):
        if path.suffix in (".py", ".rules", ".toml") and "__pycache__" not in path.parts:
            h.update(str(path.relative_to(root)).encode())
            h.update(path.read_bytes())
    return h.hexdigest()


def model_digest(model) -> tuple[str, Graph | None]:
    """SHA-256 of the model's content (a file's bytes, read without parsing them), and the
    graph when the model is one already. A model whose weights live in external data files
    is keyed by its .onnx file alone: edit those files and clear the cache."""
    import onnx

    if isinstance(model, Graph):
        return hashlib.sha256(pickle.dumps((str(model), sorted(model.constants)))).hexdigest(), model
    if isinstance(model, onnx.ModelProto):
        return hashlib.sha256(model.SerializeToString(deterministic=True)).hexdigest(), None
    if isinstance(model, bytes | bytearray):
        return hashlib.sha256(bytes(model)).hexdigest(), None
    path = Path(model)
    try:
        with path.open("rb") as f:
            return hashlib.file_digest(f, "sha256").hexdigest(), None
    except OSError as e:
        raise EgraftError(f"{path}: cannot read the model: {e.strerror}") from None


def entry_path(digest: str, settings: Sequence[str], rule_texts: Sequence[bytes]) -> Path:
    """Where the entry of the model of ``digest`` compiled with ``settings`` (each as text)
    and the rule files ``rule_texts`` lies: the key adds the format, egraft's version and
    sources, llvmlite's version and the host CPU (name and features)."""
    import llvmlite

    from egraft import __version__
    from egraft.kernels.cpu.llvm import host_cpu

    h = hashlib.sha256()
    for part in (str(CACHE_FORMAT), __version__, _source_digest(), llvmlite.__version__, *host_cpu(), *settings):
        h.update(part.encode())
        h.update(b"\0")
    for text in rule_texts:
        h.update(hashlib.sha256(text).digest())
    h.update(digest.encode())
    return cache_root() / f"{h.hexdigest()}.pkl"


def cache_root() -> Path:
    """The folder of compiled models in the cache."""
    from egraft.kernels.cpu.llvm import cache_dir

    return cache_dir() / "compiled"


def clear_cache() -> int:
    """Delete every cached compiled model, object file and parsed rule file; returns the
    number of files removed."""
    from egraft.kernels.cpu.llvm import cache_dir

    wait_for_writes()
    removed = 0
    for sub in ("compiled", "objects", "rules"):
        folder = cache_dir() / sub
        if folder.is_dir():
            removed += sum(1 for p in folder.rglob("*") if p.is_file())
            shutil.rmtree(folder)
    return removed


# ---- what an entry stores --------------------------------------------------------------------------
def _node_constants(graph: Graph) -> set[str]:
    """The keys of the constants that the graph's nodes (and subgraphs) and outputs read."""
    keys: set[str] = {v.const for v in graph.outputs if v.const is not None}
    stack = [graph]
    while stack:
        g = stack.pop()
        for node in g.nodes:
            keys.update(v.const for v in node.inputs if v is not None and v.const is not None)
            stack.extend(_bodies(node))
    return keys


def _bodies(node) -> list[Graph]:
    """The subgraphs of an If/Loop/Scan node."""
    return [a for a in node.attrs.values() if isinstance(a, Graph)] + \
        [x for a in node.attrs.values() if isinstance(a, list | tuple) for x in a if isinstance(x, Graph)]


def _subgraph_constants(graph: Graph) -> set[str]:
    """The keys of the constants that the bodies of If/Loop/Scan nodes read (run by the
    executor at run time)."""
    return {key for node in graph.nodes for body in _bodies(node) for key in _node_constants(body)}


def _same(a, b) -> bool:
    a, b = np.asarray(a), np.asarray(b)
    return a.dtype == b.dtype and a.shape == b.shape and np.array_equal(a, b)


def _transformed_filters(graph: Graph) -> dict[str, PackedFrom]:
    """Constants of the graph itself (not a kernel's) that are a cheap function of another:
    the transformed Winograd filters ``U = G w G^T`` of a ``WinogradConv(x, w, U)`` (16 numbers
    per filter against w's 9), by U's key, kept only when computing them again gives the same
    bytes (rewriting made them: no record says so)."""
    from egraft.kernels.cpu.emit import PackedFrom

    found: dict[str, PackedFrom] = {}
    for node in graph.nodes:
        if node.op != "WinogradConv" or node.domain != "com.egraft" or len(node.inputs) < 3:
            continue
        w, u = node.inputs[1], node.inputs[2]
        if w is None or u is None or w.const is None or u.const is None or u.const in found:
            continue
        source = np.asarray(graph.constants[w.const])
        if source.ndim != 4 or source.shape[2:] != (3, 3):
            continue
        made = PackedFrom("winograd.transform", w.const)
        if _same(made.apply(source), graph.constants[u.const]):
            found[u.const] = made
    return found


@dataclass(frozen=True)
class EntryPlan:
    """What an entry stores and how a hit gets the rest back.

    Attributes:
        stored: the keys of the graph's constants in the blob.
        derived: the names of the derived constants (packed weights, tables) in the blob.
        recompute: ``{derived name: record}``, packed copies a hit packs again from their
            stored weight (``record.apply``).
        restore: ``{key: (record, derived name or None)}``, constants no step reads at run
            time, given back on demand: unpacked from the derived constant ``name``
            (``record.unpack``), or, without one, computed from the stored ``record.source``.
        weights: the bytes of the weights the nodes read (the budget's measure).
    """

    stored: list[str]
    derived: list[str]
    recompute: dict[str, PackedFrom]
    restore: dict[str, tuple[PackedFrom, str | None]]
    weights: int


def entry_plan(lowered) -> EntryPlan:
    """What an entry of ``lowered`` stores, by the rule: a hit reads every constant a step reads
    at run time as it is (packed weights included), in as few bytes as it can. Left out: the
    constants no step reads at run time that a stored one gives back; then, the largest first
    and only while the blob would be over :data:`CONSTANTS_BUDGET` times the weights, packed
    copies larger than their weight (Winograd's 16/9), packed again on a hit."""
    graph, derived = lowered.graph, lowered.derived
    used = _node_constants(graph)
    names = {v.name: v.const for v in graph.values() if v.const is not None}
    runtime = lowered.runtime_constants
    runtime_keys = used if runtime is None else {names[n] for n in runtime if n in names}
    runtime_keys = runtime_keys | {v.const for v in graph.outputs if v.const is not None} | _subgraph_constants(graph)
    packings = {} if runtime is None else \
        {name: made for name, made in lowered.packed_from.items() if made.source not in runtime_keys}
    transformed = _transformed_filters(graph)
    weights = sum(np.asarray(graph.constants[k]).nbytes for k in used if k not in transformed)
    recompute: dict[str, PackedFrom] = {}
    unpacks: dict[str, tuple[PackedFrom, str | None]] = {}  # a dead weight that a stored packed copy gives back

    def unpack_of(name: str):
        made = packings[name]
        if not made.gather:
            return None
        w = np.asarray(graph.constants[made.source])
        if made.source not in unpacks and _same(made.unpack(derived[name], w.shape, w.dtype), w):
            unpacks[made.source] = (made, name)
        return unpacks.get(made.source)

    def plan() -> EntryPlan:
        restore = {u: (made, None) for u, made in transformed.items() if u not in runtime_keys}
        for name in sorted(packings):
            if name not in recompute and packings[name].source not in restore and unpack_of(name) is not None:
                restore[packings[name].source] = unpacks[packings[name].source]
        needed = {made.source for made in recompute.values()}  # the sources of what a hit packs again
        restore = {k: r for k, r in restore.items() if k not in needed}
        return EntryPlan(sorted(k for k in used if k not in restore), sorted(n for n in derived if n not in recompute),
                         dict(recompute), restore, weights)

    def blob_bytes(p: EntryPlan) -> int:
        return sum(np.asarray(graph.constants[k]).nbytes for k in p.stored) + \
            sum(np.asarray(derived[n]).nbytes for n in p.derived)

    current = plan()
    for name in sorted(packings, key=lambda n: -np.asarray(derived[n]).nbytes):
        if blob_bytes(current) <= CONSTANTS_BUDGET * weights:
            break
        if np.asarray(derived[name]).nbytes <= np.asarray(graph.constants[packings[name].source]).nbytes:
            continue  # computing it again would not make the entry smaller
        recompute[name] = packings[name]
        current = plan()
    return current


class RestoredConstants(dict):
    """A cache hit's ``graph.constants``: the constants the entry stores, and those it left out
    because no step reads them at run time (weights that only their packed copies are read
    through), given back when first asked for by key (``graph.constants[key]``, as
    :func:`egraft.to_onnx` does) as :attr:`EntryPlan.restore` says: unpacked from the packed
    copy, or ``G w G^T`` again. ``key in constants`` is true once a constant is there."""

    def __init__(self, stored: dict, restore: dict[str, tuple[PackedFrom, str | None]], types: dict, derived: dict):
        super().__init__(stored)
        self._restore, self._types, self._derived = restore, types, derived

    def __missing__(self, key):
        if key not in self._restore:
            raise KeyError(key)
        made, name = self._restore[key]
        if name is None:
            value = made.apply(self[made.source])
        else:
            shape, dtype = self._types[key]
            value = made.unpack(self._derived[name], shape, dtype)
        self[key] = value
        return value

    def restorable(self) -> set[str]:
        """The keys that are given back on demand, not yet asked for."""
        return {k for k in self._restore if not dict.__contains__(self, k)}

    def __reduce__(self):  # a pickle holds the constants, every one computed
        return dict, (dict((k, self[k]) for k in (*dict.keys(self), *self.restorable())),)


# ---- writing and reading ---------------------------------------------------------------------------
def write_entry(entry: Path, lowered) -> None:
    """``lowered`` as the entry ``entry`` (``KEY.pkl``; see the module docstring), then evict
    the least recently used entries while the cache is over ``$EGRAFT_CACHE_MAX``."""
    from egraft.kernels.cpu.llvm import evict_if_full, write_meta

    constants, derived = lowered.graph.constants, lowered.derived
    if any(np.asarray(a).dtype == object for a in (*constants.values(), *derived.values())):
        index, blob, kept, kept_derived, stored_plan = None, b"", constants, derived, None
    else:
        plan = entry_plan(lowered)
        types = {k: (np.asarray(constants[k]).shape, np.asarray(constants[k]).dtype.str) for k in plan.restore}
        stored_plan = (plan.recompute, plan.restore, types)
        arrays = [("constant", k, constants[k]) for k in plan.stored] + \
            [("derived", n, derived[n]) for n in plan.derived]
        index, parts, offset, kept, kept_derived = {}, [], 0, {}, {}
        for kind, key, value in arrays:
            array = np.asarray(value)
            data = array.tobytes()
            pad = (-offset) % 64
            parts.append(b"\0" * pad)
            offset += pad
            index[kind, key] = (offset, array.dtype.str, array.shape)
            parts.append(data)
            offset += len(data)
        blob = b"".join(parts)
    entry.parent.mkdir(parents=True, exist_ok=True)
    modules = lowered.kernels.modules  # LLVM IR text, 99% of the schedule: compressed 10x
    lowered.graph.constants, lowered.derived, lowered.kernels.modules = kept, kept_derived, {}
    try:
        packed = zlib.compress(pickle.dumps(modules, protocol=pickle.HIGHEST_PROTOCOL), 6)
        payload = pickle.dumps((lowered, index, stored_plan, packed), protocol=pickle.HIGHEST_PROTOCOL)
    finally:
        lowered.graph.constants, lowered.derived, lowered.kernels.modules = constants, derived, modules
    files = {}
    for suffix, data in ((".bin", blob), (".pkl", payload)):
        tmp = entry.with_suffix(f"{suffix}.tmp")
        tmp.write_bytes(data)
        tmp.replace(entry.with_suffix(suffix))
        files[suffix[1:]] = entry.with_suffix(suffix)
    meta = entry.with_suffix(".json")
    # last: its presence means the entry is complete
    written = write_meta(meta, files, format=CACHE_FORMAT, constants_bytes=len(blob))
    evict_if_full(meta, written)


#: Whether :func:`write_entry_in_background` writes on a thread of its own (tests that damage
#: an entry right after a compile turn it off: ``tests/conftest.py``).
WRITE_IN_BACKGROUND = True
_PENDING: dict[Path, threading.Thread] = {}
_PENDING_LOCK = threading.Lock()


def write_entry_in_background(entry: Path, lowered) -> None:
    """:func:`write_entry` on a thread of its own, so that the compile returns as soon as the
    model runs (ResNet-50's entry took 0.7 s to write, VGG-19's 5 s). The thread is not a
    daemon: the interpreter waits for it at exit. A compile of the same entry, and
    :func:`clear_cache`, wait for it first (:func:`wait_for_writes`). The thread writes a
    shallow copy of ``lowered`` (write_entry swaps fields while it pickles); an entry it
    fails to write only costs the next compile its time.

    Example:
        >>> write_entry_in_background(entry, lowered); wait_for_writes(entry)   # doctest: +SKIP
    """
    if not WRITE_IN_BACKGROUND:
        try:
            write_entry(entry, lowered)
        except OSError:
            pass  # an unwritable cache only costs the next compile its time
        return
    detached = copy.copy(lowered)
    detached.graph = copy.copy(lowered.graph)
    detached.kernels = copy.copy(lowered.kernels)

    def write() -> None:
        try:
            write_entry(entry, detached)
        except Exception:  # noqa: BLE001 (disk full, unpicklable state: the next compile rebuilds the entry)
            pass
        finally:
            with _PENDING_LOCK:
                if _PENDING.get(entry) is threading.current_thread():
                    del _PENDING[entry]

    # in the caller's context: eviction sees the folder it wrote to (llvm.pinned_cache_dir)
    thread = threading.Thread(target=contextvars.copy_context().run, args=(write,),
                              name=f"egraft-cache-write-{entry.stem[:8]}")
    with _PENDING_LOCK:
        previous = _PENDING.get(entry)
        _PENDING[entry] = thread
    if previous is not None:
        previous.join()
    thread.start()


def wait_for_writes(entry: Path | None = None) -> None:
    """Wait until the entry writes under way (or only that of ``entry``) are done."""
    with _PENDING_LOCK:
        threads = list(_PENDING.values()) if entry is None else [t for e, t in _PENDING.items() if e == entry]
    for thread in threads:
        thread.join()


def read_entry(entry: Path):
    """The lowered model of the entry ``entry``, its constants and packed weights memory-mapped
    from the blob (read-only: nothing is copied until a kernel reads it), the packed copies the
    entry left out packed again in numpy (no kernel generator runs); ``None`` when there is no
    entry. A damaged entry (a file that does not match its checksum, another format, or one that
    does not read back) is removed with a warning, and ``None`` returned: the caller rebuilds it."""
    from egraft.kernels.cpu.llvm import damaged, verify_meta

    meta = entry.with_suffix(".json")
    document, problem = verify_meta(meta)
    if problem is None and document is not None and document.get("format") != CACHE_FORMAT:
        problem = f"format {document.get('format')}, expected {CACHE_FORMAT}"
    if problem:
        damaged(meta, problem)
        return None
    if document is None:
        return None
    try:
        lowered, index, stored_plan, packed = pickle.loads(entry.read_bytes())
        lowered.kernels.modules = pickle.loads(zlib.decompress(packed))
        if index is not None:
            recompute, restore, types = stored_plan
            blob_path = entry.with_suffix(".bin")
            blob = np.memmap(blob_path, mode="r") if blob_path.stat().st_size else np.zeros(0, np.uint8)
            arrays: dict = {"constant": {}, "derived": {}}
            for (kind, key), (offset, dtype, shape) in index.items():
                dt = np.dtype(dtype)
                count = int(np.prod(shape)) * dt.itemsize
                arrays[kind][key] = blob[offset:offset + count].view(dt).reshape(shape)
            derived = arrays["derived"]
            constants = RestoredConstants(arrays["constant"], restore, types, derived)
            for name, made in recompute.items():
                derived[name] = made.apply(constants[made.source])
            lowered.graph.constants, lowered.derived = constants, derived
    except Exception as e:  # checksums matched, yet it does not read back: never trusted
        damaged(meta, f"{type(e).__name__}: {e}")
        return None
    return lowered


__all__ = ["CACHE_FORMAT", "CONSTANTS_BUDGET", "model_digest", "entry_path", "cache_root", "clear_cache",
           "EntryPlan", "entry_plan", "RestoredConstants", "write_entry", "read_entry",
           "write_entry_in_background", "wait_for_writes"]

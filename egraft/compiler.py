"""``egraft.compile``: a model to a :class:`~egraft.lowering.runtime.CompiledModel` in one
call: load, rewrite and extract (:func:`egraft.optimize.optimize`), lower, generate and
compile the kernels.

Compiled models are cached on disk (``$EGRAFT_CACHE_DIR``, else ``~/.cache/egraft``,
under ``compiled/``). The key is the SHA-256 of everything that decides the result: the
model's bytes, the rule files' contents, the settings (rule sets off, bound dims, cost
model, extractor, rewriting on or off), egraft's own source files (so an edited egraft
never reads an entry an older one wrote), llvmlite's version and the host CPU (name and
features). A hit skips rewriting and LLVM: it reads the lowered schedule and the object
code back. :func:`clear_cache` empties the cache; ``use_cache=False`` neither reads nor
writes it. Entries are Python pickles of egraft's own data: the cache dir must be as
trusted as egraft's install. Every entry records the SHA-256 of its files; a damaged one
is rebuilt with a warning. ``$EGRAFT_CACHE_MAX`` caps the cache's size (default 4 GiB;
least recently used entries go first), see :mod:`egraft.kernels.cpu.llvm`.

Example:
    >>> compiled = egraft.compile("model.onnx", shape={"batch": 1})    # doctest: +SKIP
    >>> compiled.run({"x": x})                                         # doctest: +SKIP
"""

from __future__ import annotations

import hashlib
import pickle
import shutil
import time
import zlib
from collections.abc import Mapping, Sequence
from functools import cache
from pathlib import Path

from egraft.errors import EgraftError, InputError
from egraft.ir.graph import Graph

TARGETS = ("cpu",)
CACHE_FORMAT = 3


@cache
def _source_digest() -> str:
    """SHA-256 over egraft's own .py, .rules and .toml files."""
    root = Path(__file__).resolve().parent
    h = hashlib.sha256()
    for path in sorted(root.rglob("*")):
        if path.suffix in (".py", ".rules", ".toml") and "__pycache__" not in path.parts:
            h.update(str(path.relative_to(root)).encode())
            h.update(path.read_bytes())
    return h.hexdigest()


def _model_digest(model) -> tuple[str, Graph | None]:
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


def unknown_dims_message(bindings: Mapping[str, int], graph: Graph, where: str, option: str = "shape") -> str | None:
    """The error for bound names that are none of ``graph``'s symbolic dims (binding them
    would do nothing), or ``None`` when every name is one. ``where`` names the model,
    ``option`` how the user wrote the binding (``shape`` for the API, ``--shape`` for the CLI).

    Example: ``--shape nosuchdim=3: model.onnx has no symbolic dim 'nosuchdim'; its
    symbolic dims: batch``
    """
    from egraft.ir.dims import dim_symbols

    declared = graph.symbols()
    known = set(declared)
    for node in graph.nodes:  # dims that only inner values have (data-dependent ones) bind too
        for v in node.outputs:
            if v is not None and v.type.shape is not None:
                known |= dim_symbols(v.type.shape)
    unknown = [name for name in bindings if name not in known]
    if not unknown:
        return None
    name = unknown[0]
    listed = f"its symbolic dims: {', '.join(declared)}" if declared else "it has none (all its dims are static)"
    binding = f"--shape {name}={bindings[name]}" if option == "--shape" else f"{option}={{{name!r}: {bindings[name]}}}"
    return f"{binding}: {where} has no symbolic dim {name!r}; {listed}"


def _node_constants(graph: Graph) -> set[str]:
    """The keys of the constants that the graph's nodes (and subgraphs) and outputs read."""
    keys: set[str] = {v.const for v in graph.outputs if v.const is not None}
    stack = [graph]
    while stack:
        g = stack.pop()
        for node in g.nodes:
            keys.update(v.const for v in node.inputs if v is not None and v.const is not None)
            stack.extend(a for a in node.attrs.values() if isinstance(a, Graph))
            stack.extend(x for a in node.attrs.values() if isinstance(a, list | tuple) for x in a
                         if isinstance(x, Graph))
    return keys


def _recomputable(graph: Graph) -> dict[str, str]:
    """Constants that a cache entry need not store because they are cheap functions of
    another constant it stores: ``{derived key: source key}``. Today: the transformed
    Winograd filters ``U = WinogradWeights(w)`` of a ``WinogradConv(x, w, U)`` (16 numbers per
    filter against w's 9), kept only when computing them again gives the same bytes."""
    import numpy as np

    from egraft.ir.ops.winograd import winograd_weights

    found: dict[str, str] = {}
    for node in graph.nodes:
        if node.op != "WinogradConv" or node.domain != "com.egraft" or len(node.inputs) < 3:
            continue
        w, u = node.inputs[1], node.inputs[2]
        if w is None or u is None or w.const is None or u.const is None or u.const in found:
            continue
        source, target = np.asarray(graph.constants[w.const]), np.asarray(graph.constants[u.const])
        if source.ndim != 4 or source.shape[2:] != (3, 3):
            continue
        again = winograd_weights(source)
        if again.dtype == target.dtype and again.shape == target.shape and np.array_equal(again, target):
            found[u.const] = w.const
    return found


# ---- packed weights: how the kernels pack them, in numpy ------------------------------------------
def _gemm_panels(w, node):
    """A convolution's weights as :mod:`egraft.kernels.cpu.conv_gemm` packs them: per group,
    the ``[M/group, K]`` matrix in panels of ``MR`` rows (``pack_a_constant``)."""
    import numpy as np

    from egraft.kernels.cpu.sgemm import blocking, pack_a_constant

    group = int(node.attrs.get("group", 1) or 1)
    rows = np.asarray(w, np.float32).reshape(group, w.shape[0] // group, -1)
    return np.concatenate([pack_a_constant(rows[g], blocking().mr) for g in range(group)])


def _blocked(w, node):
    """A convolution's weights as :mod:`egraft.kernels.cpu.conv_nchwc` reads them."""
    import numpy as np

    from egraft.kernels.cpu.conv_nchwc import pack_weights

    return pack_weights(np.asarray(w, np.float32))


def _winograd_points(w, node):
    """``U = G w G^T`` packed as :mod:`egraft.kernels.cpu.winograd` reads it: per point of the
    4x4 tile, the ``[O, C]`` matrix in panels of ``MR`` rows."""
    import numpy as np

    from egraft.ir.ops.winograd import winograd_weights
    from egraft.kernels.cpu.sgemm import blocking, pack_a_constant

    u = winograd_weights(np.asarray(w, np.float32))
    points = u.transpose(2, 3, 0, 1).reshape(16, u.shape[0], u.shape[1])
    return np.concatenate([pack_a_constant(points[p], blocking().mr) for p in range(16)])


#: Packings a cache entry can compute again from a weight without the kernel generator
#: (no LLVM IR): ``name -> (function(weight, node) -> packed, a pure gather of the weight)``.
#: Which one made a packed constant is found by trying them (the bytes must match).
PACKINGS = {"gemm_panels": (_gemm_panels, True), "blocked": (_blocked, True), "winograd": (_winograd_points, False)}


def _unpack(packing: str, packed, shape: tuple, dtype, node):
    """The weight ``packed`` was packed from, for a gather packing: the packing applied to
    the weights' own indices (as two exact float32 halves) says where each one went."""
    import numpy as np

    pack = PACKINGS[packing][0]
    index = np.arange(int(np.prod(shape)), dtype=np.int64)
    low = pack((index % 4096).astype(np.float32).reshape(shape), node)
    high = pack((index // 4096).astype(np.float32).reshape(shape), node)
    present = pack(np.ones(shape, np.float32), node) != 0
    weight = np.empty(index.size, np.dtype(dtype))
    weight[high[present].astype(np.int64) * 4096 + low[present].astype(np.int64)] = np.asarray(packed)[present]
    return weight.reshape(shape)


def _same(a, b) -> bool:
    import numpy as np

    a, b = np.asarray(a), np.asarray(b)
    return a.dtype == b.dtype and a.shape == b.shape and np.array_equal(a, b)


def _packing_of(name: str, array, node, graph: Graph, runtime_keys: set[str]):
    """``(packing, source key)`` when the derived constant ``name`` of ``node``'s kernel is one
    of :data:`PACKINGS` applied to a constant input that no step reads at run time; else ``None``."""
    import numpy as np

    from egraft.kernels.cpu.sgemm import blocking

    order = ("winograd", "gemm_panels", "blocked") if name.endswith(".packed_u") else \
        ("gemm_panels", "blocked", "winograd")
    mr = blocking().mr
    for v in node.inputs:
        if v is None or v.const is None or v.const in runtime_keys:
            continue
        w = np.asarray(graph.constants[v.const])
        if w.ndim != 4 or w.dtype != np.float32:
            continue
        group = int(node.attrs.get("group", 1) or 1)
        sizes = {"gemm_panels": group * -(-w.shape[0] // group // mr) * mr * (w.size // w.shape[0]) if
                 w.shape[0] % group == 0 else -1,
                 "blocked": w.size, "winograd": 16 * -(-w.shape[0] // mr) * mr * w.shape[1]}
        for packing in order:
            if sizes[packing] != np.asarray(array).size:
                continue
            try:
                again = PACKINGS[packing][0](w, node)
            except (ValueError, ImportError):
                continue
            if _same(again, array):
                return packing, v.const
    return None


#: An entry's constants (``KEY.bin``) hold at most this multiple of the model's weights'
#: bytes (the constants the nodes read, less those computed from others); the schedule
#: and the object code take the rest of the 1.2x.
CONSTANTS_BUDGET = 1.1


def _entry_plan(lowered):
    """What an entry stores, by the rule: a hit reads every constant a step reads at run
    time as it is (packed weights included), in as few bytes as it can.

    Returns ``(stored keys, stored derived names, recompute, restore, weights' bytes)``:
    ``recompute`` ``{derived name: (packing, source key, kernel function)}``, the packed
    constants a hit computes again in numpy (the largest first, only while the constants
    would be over :data:`CONSTANTS_BUDGET` times the weights: Winograd's 16/9); ``restore``
    ``{key: (how, ...)}``, the constants no step reads at run time that an entry leaves out
    because a stored one gives them back (``("unpack", derived name, packing, function)``,
    ``("winograd", source key)``), computed only when something asks for them
    (``egraft.to_onnx(compiled.graph)``)."""
    import numpy as np

    graph, derived = lowered.graph, lowered.derived
    used = _node_constants(graph)
    names = {v.name: v.const for v in graph.values() if v.const is not None}
    runtime = lowered.runtime_constants
    runtime_keys = used if runtime is None else {names[n] for n in runtime if n in names}
    runtime_keys = runtime_keys | {v.const for v in graph.outputs if v.const is not None} | _subgraph_constants(graph)
    nodes = {step.function: step.node for step in lowered.steps if step.kind == "kernel"}
    packings = {}
    for name, array in derived.items():
        node = nodes.get(name.split(".")[0])
        found = None if node is None or runtime is None else _packing_of(name, array, node, graph, runtime_keys)
        if found is not None:
            packings[name] = (*found, name.split(".")[0])
    recomputable = _recomputable(graph)
    weights = sum(np.asarray(graph.constants[k]).nbytes for k in used if k not in recomputable)
    recompute: dict = {}
    unpacks: dict[str, tuple] = {}  # verified: a dead weight given back by a stored packed copy

    def unpack_of(name):
        packing, key, function = packings[name]
        if not PACKINGS[packing][1] or key in runtime_keys:
            return None
        w = np.asarray(graph.constants[key])
        if key not in unpacks and _same(_unpack(packing, derived[name], w.shape, w.dtype, nodes[function]), w):
            unpacks[key] = ("unpack", name, packing, function)
        return unpacks.get(key)

    def plan():
        restore = {u: ("winograd", w) for u, w in recomputable.items() if u not in runtime_keys}
        for name in sorted(packings):
            if name not in recompute and packings[name][1] not in restore and unpack_of(name) is not None:
                restore[packings[name][1]] = unpacks[packings[name][1]]
        needed = {key for _, key, _ in recompute.values()}  # the sources of what a hit packs again
        restore = {k: r for k, r in restore.items() if k not in needed}
        stored = sorted(k for k in used if k not in restore)
        kept = sorted(n for n in derived if n not in recompute)
        total = sum(np.asarray(graph.constants[k]).nbytes for k in stored) + \
            sum(np.asarray(derived[n]).nbytes for n in kept)
        return stored, kept, restore, total

    stored, kept, restore, total = plan()
    for name in sorted(packings, key=lambda n: -np.asarray(derived[n]).nbytes):
        if total <= CONSTANTS_BUDGET * weights:
            break
        source = np.asarray(graph.constants[packings[name][1]]).nbytes
        if np.asarray(derived[name]).nbytes <= source:
            continue  # computing it again would not make the entry smaller
        recompute[name] = packings[name]
        stored, kept, restore, total = plan()
    return stored, kept, recompute, restore, weights


def _subgraph_constants(graph: Graph) -> set[str]:
    """The keys of the constants that the bodies of If/Loop/Scan nodes read (run by the
    executor at run time)."""
    keys: set[str] = set()
    for node in graph.nodes:
        bodies = [a for a in node.attrs.values() if isinstance(a, Graph)]
        bodies += [x for a in node.attrs.values() if isinstance(a, list | tuple) for x in a if isinstance(x, Graph)]
        for body in bodies:
            keys |= _node_constants(body)
    return keys


class RestoredConstants(dict):
    """A cache hit's ``graph.constants``: the constants the entry stores, and those it left out
    because no step reads them at run time (weights that only their packed copies are read
    through), given back when first asked for by key (``graph.constants[key]``, as
    :func:`egraft.to_onnx` does): unpacked from the packed copy, or ``G w G^T`` again.
    ``key in constants`` is true once a constant is there."""

    def __init__(self, stored: dict, restore: dict, types: dict, derived: dict, nodes: dict):
        super().__init__(stored)
        self._restore, self._types, self._derived, self._nodes = restore, types, derived, nodes

    def __missing__(self, key):
        how = self._restore.get(key)
        if how is None:
            raise KeyError(key)
        if how[0] == "winograd":
            from egraft.ir.ops.winograd import winograd_weights

            value = winograd_weights(self[how[1]])
        else:
            _, name, packing, function = how
            shape, dtype = self._types[key]
            value = _unpack(packing, self._derived[name], shape, dtype, self._nodes[function])
        self[key] = value
        return value

    def restorable(self) -> set[str]:
        """The keys that are given back on demand, not yet asked for."""
        return {k for k in self._restore if not dict.__contains__(self, k)}

    def __reduce__(self):  # a pickle holds the constants, every one computed
        return dict, (dict((k, self[k]) for k in (*dict.keys(self), *self.restorable())),)


def _write_entry(entry: Path, lowered) -> None:
    """The lowered model as three files: ``KEY.bin``, the constants a hit needs, back to back
    and 64-byte aligned; ``KEY.pkl``, everything else (the LLVM IR zlib-compressed) with the
    constants' places in the blob; ``KEY.json`` (written last), the SHA-256 of both, checked when the entry is read.

    What goes in the blob (:func:`_entry_plan`): every constant a step reads at run time,
    the kernels' packed weights included, so a hit maps them and runs no generator; not the
    weights that only their packed copies are read through (nor the ones rewriting replaced),
    which :class:`RestoredConstants` gives back if asked. A packed copy much larger than its
    weight (Winograd's ``G w G^T``: 16/9) is left out instead when the blob would be over
    :data:`CONSTANTS_BUDGET` times the weights, and packed again in numpy on a hit."""
    import numpy as np

    from egraft.kernels.cpu.llvm import evict, write_meta

    constants, derived = lowered.graph.constants, lowered.derived
    if any(np.asarray(a).dtype == object for a in (*constants.values(), *derived.values())):
        index, blob, kept, kept_derived, plan = None, b"", constants, derived, None
    else:
        stored, stored_derived, recompute, restore, weights = _entry_plan(lowered)
        types = {k: (np.asarray(constants[k]).shape, np.asarray(constants[k]).dtype.str) for k in restore}
        plan = (recompute, restore, types)
        arrays = [("constant", k, constants[k]) for k in stored] + [("derived", n, derived[n]) for n in stored_derived]
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
    module_text = lowered.module_text  # LLVM IR text, 99% of the schedule: compressed 10x
    lowered.graph.constants, lowered.derived, lowered.module_text = kept, kept_derived, ""
    try:
        payload = pickle.dumps((lowered, index, plan, zlib.compress(module_text.encode(), 6)),
                               protocol=pickle.HIGHEST_PROTOCOL)
    finally:
        lowered.graph.constants, lowered.derived, lowered.module_text = constants, derived, module_text
    files = {}
    for suffix, data in ((".bin", blob), (".pkl", payload)):
        tmp = entry.with_suffix(f"{suffix}.tmp")
        tmp.write_bytes(data)
        tmp.replace(entry.with_suffix(suffix))
        files[suffix[1:]] = entry.with_suffix(suffix)
    meta = entry.with_suffix(".json")
    write_meta(meta, files, format=CACHE_FORMAT, constants_bytes=len(blob))  # last: its presence means complete
    evict(keep=meta)


def _read_entry(entry: Path):
    """The lowered model of a cache entry, its constants and packed weights memory-mapped
    from the blob (read-only: nothing is copied until a kernel reads it); the packed copies
    the entry left out are packed again in numpy (no kernel generator runs); ``None`` when
    there is no entry. A damaged entry (a file that does not match its checksum, or one that
    does not read back) is removed with a warning, and ``None`` returned: the caller
    rebuilds it."""
    import numpy as np

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
        lowered, index, plan, module_text = pickle.loads(entry.read_bytes())
        lowered.module_text = zlib.decompress(module_text).decode()
        if index is not None:
            recompute, restore, types = plan
            blob_path = entry.with_suffix(".bin")
            blob = np.memmap(blob_path, mode="r") if blob_path.stat().st_size else np.zeros(0, np.uint8)
            arrays: dict = {"constant": {}, "derived": {}}
            for (kind, key), (offset, dtype, shape) in index.items():
                dt = np.dtype(dtype)
                count = int(np.prod(shape)) * dt.itemsize
                arrays[kind][key] = blob[offset:offset + count].view(dt).reshape(shape)
            nodes = {step.function: step.node for step in lowered.steps if step.kind == "kernel"}
            constants = RestoredConstants(arrays["constant"], restore, types, arrays["derived"], nodes)
            derived = arrays["derived"]
            for name, (packing, source, function) in recompute.items():
                derived[name] = PACKINGS[packing][0](constants[source], nodes[function])
            lowered.graph.constants, lowered.derived = constants, derived
    except Exception as e:  # checksums matched, yet it does not read back: never trusted
        damaged(meta, f"{type(e).__name__}: {e}")
        return None
    return lowered


def cache_root() -> Path:
    """The folder of compiled models in the cache."""
    from egraft.kernels.cpu.llvm import cache_dir

    return cache_dir() / "compiled"


def clear_cache() -> int:
    """Delete every cached compiled model and object file; returns the number of files removed."""
    from egraft.kernels.cpu.llvm import cache_dir

    removed = 0
    for sub in ("compiled", "objects"):
        folder = cache_dir() / sub
        if folder.is_dir():
            removed += sum(1 for p in folder.rglob("*") if p.is_file())
            shutil.rmtree(folder)
    return removed


def compile(model, target: str = "cpu", *, shape: Mapping[str, int] | None = None,
            rules: Sequence[str | Path] = (), rules_off: Sequence[str] = (), rewrite: bool = True,
            cost="roofline", extractor: str = "greedy", use_cache: bool = True, threads: int | None = None):
    """Compile ``model`` for ``target``.

    Args:
        model: an ONNX path, ``onnx.ModelProto``, serialized bytes, an IR :class:`Graph`, or
            a plan (``.json`` from ``egraft plan``): its model is optimized again with the
            plan's settings, and the chosen graph must be the plan's, else the plan is
            refused as stale.
        target: ``cpu`` (CUDA comes with the CUDA backend).
        shape: symbolic dims to bind at compile time (``{"batch": 1}``): a specialized build.
            Unbound dims stay symbolic; one compiled model serves every value of them.
        rules / rules_off: extra rule files and rule sets to switch off, as for optimize.
        rewrite: run the rewrite rules and extraction first (``False`` compiles the graph as is).
        cost / extractor: the extraction's cost model (a name or a CostModel) and extractor.
        use_cache: read and write the compiled-model cache.
        threads: how many threads a call may use (default ``$EGRAFT_NUM_THREADS``, else
            every core this process may run on); ``compiled.threads`` changes it later.
            It does not change the compiled code.

    Returns:
        A :class:`egraft.lowering.runtime.CompiledModel`; ``.report()`` says what ran where.
    """
    if target not in TARGETS:
        raise EgraftError(f"target {target!r}: not available; known: {', '.join(TARGETS)}")
    if threads is not None and threads < 1:
        raise EgraftError(f"threads={threads}: give 1 or more")
    if isinstance(model, str | Path) and str(model).endswith(".json"):
        compiled = _compile_plan(Path(model), target, use_cache)
    else:
        compiled = _compile(model, target, shape, rules, rules_off, rewrite, cost, extractor, use_cache)
    if threads is not None:
        compiled.threads = threads
    return compiled


def _compile_plan(path: Path, target: str, use_cache: bool):
    from egraft.extract.plan import load_plan, plan_settings

    plan = load_plan(path)
    settings = plan_settings(plan, path)
    compiled = _compile(settings["model"], target, settings["bindings"], settings["rules"], settings["rules_off"],
                        True, settings["cost"], settings["extractor"], use_cache, budget=settings["budget"],
                        time_limit=settings["time_limit"])
    if str(compiled.graph) != plan["graph"]["ir"]:
        raise EgraftError(f"{path}: the graph this egraft extracts from {plan['model']['name']} differs from the "
                          f"plan's (made by egraft {plan['settings']['egraft_version']}); make the plan again "
                          "(egraft plan)")
    return compiled


def _compile(model, target: str, shape, rules, rules_off, rewrite: bool, cost, extractor: str, use_cache: bool,
             budget=None, time_limit: float = 30.0):
    import llvmlite

    from egraft import __version__
    from egraft.kernels.cpu.llvm import host_cpu
    from egraft.lowering.compile import compile_lowered, lower

    start = time.perf_counter()
    digest, graph = _model_digest(model)
    bindings = dict(sorted((shape or {}).items()))
    rule_texts = [Path(p).read_bytes() for p in rules]
    h = hashlib.sha256()
    cost_key = cost if isinstance(cost, str) else repr(cost.settings())
    for part in (str(CACHE_FORMAT), __version__, _source_digest(), llvmlite.__version__, *host_cpu(), repr(bindings),
                 repr(sorted(rules_off)), repr(rewrite), cost_key, extractor, target, repr(budget), repr(time_limit)):
        h.update(part.encode())
        h.update(b"\0")
    for text in rule_texts:
        h.update(hashlib.sha256(text).digest())
    h.update(digest.encode())
    key = h.hexdigest()
    entry = cache_root() / f"{key}.pkl"
    if use_cache:
        lowered = _read_entry(entry)
        if lowered is not None:
            lowered.seconds = {"cache read": time.perf_counter() - start}
            compiled = compile_lowered(lowered, use_cache=True)
            compiled.cache_hit = True
            return compiled
    seconds: dict[str, float] = {}
    if graph is None:
        import egraft

        t = time.perf_counter()
        graph = egraft.load(model if not isinstance(model, str) else Path(model))
        seconds["load"] = time.perf_counter() - t
    problem = unknown_dims_message(bindings, graph, str(model) if isinstance(model, str | Path) else "the model")
    if problem:
        raise InputError(problem)
    if rewrite:
        from egraft.optimize import optimize

        t = time.perf_counter()
        graph = optimize(graph, list(rules), list(rules_off), bindings, budget=budget, cost=cost,
                         extractor=extractor, time_limit=time_limit).graph
        seconds["optimize"] = time.perf_counter() - t
    elif bindings:
        from egraft.ir.specialize import specialize

        graph = specialize(graph, bindings)
    lowered = lower(graph)
    seconds.update(lowered.seconds)
    lowered.seconds = seconds
    compiled = compile_lowered(lowered, use_cache=use_cache)
    compiled.cache_hit = False
    if use_cache:
        try:
            _write_entry(entry, lowered)
        except OSError:
            pass  # an unwritable cache only costs the next compile its time
    return compiled

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
from collections.abc import Mapping, Sequence
from functools import cache
from pathlib import Path

from egraft.errors import EgraftError, InputError
from egraft.ir.graph import Graph

TARGETS = ("cpu",)
CACHE_FORMAT = 2


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


def _write_entry(entry: Path, lowered) -> None:
    """The lowered model as three files: ``KEY.bin``, the constants its nodes read, back to
    back and 64-byte aligned; ``KEY.pkl``, everything else with the constants' places in the
    blob; ``KEY.json`` (written last), the SHA-256 of both, checked when the entry is read.

    Kept out: constants no node reads any more (weights the rewrite replaced by folded
    ones), constants that are cheap functions of stored ones (:func:`_recomputable`) and
    the kernels' derived constants (packed weights, about twice the weights they pack):
    :func:`_read_entry` computes them again, which costs far less than the compile they
    save. A ResNet-50 entry is about 0.6x its weights' bytes (1.05x with random weights)."""
    import numpy as np

    from egraft.kernels.cpu.llvm import evict, write_meta

    constants, derived = lowered.graph.constants, lowered.derived
    used = _node_constants(lowered.graph)
    recomputed = _recomputable(lowered.graph)
    arrays = {key: value for key, value in constants.items() if key in used and key not in recomputed}
    if any(np.asarray(a).dtype == object for a in arrays.values()):
        index, blob, kept, recomputed = None, b"", constants, {}
    else:
        index, parts, offset, kept = {}, [], 0, {}
        for key in sorted(arrays):
            array = np.asarray(arrays[key])
            data = array.tobytes()
            pad = (-offset) % 64
            parts.append(b"\0" * pad)
            offset += pad
            index[key] = (offset, array.dtype.str, array.shape)
            parts.append(data)
            offset += len(data)
        blob = b"".join(parts)
    entry.parent.mkdir(parents=True, exist_ok=True)
    lowered.graph.constants, lowered.derived = kept, {}
    try:
        payload = pickle.dumps((lowered, index, sorted(derived), recomputed), protocol=pickle.HIGHEST_PROTOCOL)
    finally:
        lowered.graph.constants, lowered.derived = constants, derived
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
    """The lowered model of a cache entry, its constants memory-mapped from the blob
    (read-only: nothing is copied until a kernel reads it) and its derived constants
    computed again; ``None`` when there is no entry. A damaged entry (a file that does not
    match its checksum, or derived constants that do not come back) is removed with a
    warning, and ``None`` returned: the caller rebuilds it."""
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
        lowered, index, derived_names, recomputed = pickle.loads(entry.read_bytes())
        if index is not None:
            blob_path = entry.with_suffix(".bin")
            blob = np.memmap(blob_path, mode="r") if blob_path.stat().st_size else np.zeros(0, np.uint8)
            constants = {}
            for key, (offset, dtype, shape) in index.items():
                dt = np.dtype(dtype)
                count = int(np.prod(shape)) * dt.itemsize
                constants[key] = blob[offset:offset + count].view(dt).reshape(shape)
            if recomputed:
                from egraft.ir.ops.winograd import winograd_weights

                for key, source in recomputed.items():
                    constants[key] = winograd_weights(np.asarray(constants[source]))
            lowered.graph.constants = constants
        lowered.derived = _derive_again(lowered, set(derived_names))
    except Exception as e:  # checksums matched, yet it does not read back: never trusted
        damaged(meta, f"{type(e).__name__}: {e}")
        return None
    return lowered


def _derive_again(lowered, names: set[str]) -> dict:
    """The derived constants ``names`` (packed weights, named ``KERNEL.tag``) computed again
    by the generators of the kernels that made them; their code is thrown away (the object
    code of the entry is what runs)."""
    from llvmlite import ir

    from egraft.ir.infer import node_opset, resolve_op
    from egraft.kernels.cpu import find_kernel
    from egraft.kernels.cpu.emit import KernelContext

    functions = {name.split(".")[0] for name in names}
    dim_index = {s: k for k, s in enumerate(lowered.symbols)}
    derived: dict = {}
    for step in lowered.steps:
        if step.kind != "kernel" or step.function not in functions:
            continue
        node = step.node
        opset = node_opset(lowered.graph, node)
        ctx = KernelContext(ir.Module(name=step.function), step.function, node, lowered.graph,
                            resolve_op(node, opset), opset, dict(lowered.slots), dim_index, derived)
        find_kernel(node.op, node.domain)(ctx)
    if set(derived) != names:
        raise ValueError(f"derived constants {sorted(names ^ set(derived))[:3]} do not come back")
    return derived


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

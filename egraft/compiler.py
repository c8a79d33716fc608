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
least recently used entries go first). What an entry holds: :mod:`egraft.compile_cache`.

Example:
    >>> compiled = egraft.compile("model.onnx", shape={"batch": 1})    # doctest: +SKIP
    >>> compiled.run({"x": x})                                         # doctest: +SKIP
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from pathlib import Path

from egraft.compile_cache import (
    cache_root,
    clear_cache,
    entry_path,
    model_digest,
    read_entry,
    wait_for_writes,
    write_entry_in_background,
)
from egraft.errors import EgraftError, InputError
from egraft.ir.assume import assume_graph, check_assumptions, parse_assumptions
from egraft.ir.graph import Graph
from egraft.ir.unify import input_assumptions

TARGETS = ("cpu", "cuda")


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


def compile(model, target: str = "cpu", *, shape: Mapping[str, int] | None = None,
            rules: Sequence[str | Path] = (), rules_off: Sequence[str] = (), rewrite: bool = True,
            cost="roofline", extractor: str = "greedy", use_cache: bool = True, threads: int | None = None,
            specialize: str | None = None, assume: Sequence[str] = (), values: Mapping[str, int] | None = None,
            arch: str | None = None, device: str = "cuda"):
    """Compile ``model`` for ``target``.

    Args:
        model: an ONNX path, ``onnx.ModelProto``, serialized bytes, an IR :class:`Graph`, or
            a plan (``.json`` from ``egraft plan``): its model is optimized again with the
            plan's settings, and the chosen graph must be the plan's, else the plan is
            refused as stale.
        target: ``cpu`` (LLVM, this machine) or ``cuda`` (CUDA C compiled by NVRTC for ``arch``,
            no GPU needed to compile; :class:`egraft.lowering.cuda_runtime.CudaModel`).
        shape: symbolic dims to bind at compile time (``{"batch": 1}``): a specialized build.
            Unbound dims stay symbolic; one compiled model serves every value of them.
        rules / rules_off: extra rule files and rule sets to switch off, as for optimize.
        rewrite: run the rewrite rules and extraction first (``False`` compiles the graph as is).
        cost / extractor: the extraction's cost model (a name or a CostModel) and extractor.
        use_cache: read and write the compiled-model cache.
        threads: how many threads a call may use (default ``$EGRAFT_NUM_THREADS``, else
            every core this process may run on); ``compiled.threads`` changes it later.
            It does not change the compiled code.
        specialize: ``"auto"`` (the default, or ``$EGRAFT_SPECIALIZE``): also build a variant
            for each binding of the inputs' symbolic dims the model is called with, in the
            background, and run it once it is ready (:mod:`egraft.specializing`; variants go
            through the compile cache); ``"off"``: the one generic build serves every shape.
        assume: shape assumptions (:mod:`egraft.ir.assume`), e.g. ``["seq <= 512",
            "height % 32 == 0"]``: the compile may use them, every call checks them and
            refuses dims that break one, naming it.

        values: integer or bool inputs of one element to bind to a value (``{"sr": 16000}``):
            their uses read the constant, so an If that they decide runs its branch inline;
            calls still give them and the value given is not checked (``specialize="auto"``
            builds such variants itself, guarded by the value).
        arch: ``target="cuda"`` only: the GPU architecture (``sm_90``, the default: H100/H200).
        device: ``target="cuda"`` only: where calls run, ``cuda`` (CuPy's current GPU) or
            ``emulator`` (the CUDA C compiled for this CPU: slow, to check numbers).

    Returns:
        A :class:`egraft.lowering.runtime.CompiledModel` (with ``specialize="auto"`` and
        symbolic input dims, a :class:`egraft.specializing.SpecializingModel` around one);
        ``.report()`` says what ran where.
    """
    from egraft.specializing import SPECIALIZE, SpecializingModel

    if target not in TARGETS:
        raise EgraftError(f"target {target!r}: not available; known: {', '.join(TARGETS)}")
    if threads is not None and threads < 1:
        raise EgraftError(f"threads={threads}: give 1 or more")
    if target == "cuda":
        return _compile_cuda(model, shape, rules, rules_off, rewrite, cost, extractor, use_cache, arch, device)
    if arch is not None:
        raise EgraftError(f"arch={arch!r}: only for target='cuda'")
    source = "specialize"
    if specialize is None:
        specialize, source = default_specialize(), "$EGRAFT_SPECIALIZE"
    if specialize not in SPECIALIZE:
        raise EgraftError(f"{source}={specialize!r}: give one of {', '.join(SPECIALIZE)}")
    if isinstance(model, str | Path) and str(model).endswith(".json"):
        compiled = _compile_plan(Path(model), target, use_cache)
    else:
        compiled = _compile(model, target, shape, rules, rules_off, rewrite, cost, extractor, use_cache,
                            assume=tuple(assume), values=dict(values or {}))
    if threads is not None:
        compiled.threads = threads
    is_plan = isinstance(model, str | Path) and str(model).endswith(".json")
    if specialize == "auto" and not is_plan:
        wrapped = SpecializingModel(compiled, model, dict(shape or {}), dict(
            rules=[str(p) for p in rules], rules_off=list(rules_off), rewrite=rewrite, cost=cost, extractor=extractor,
            assume=list(assume), **({"values": dict(values)} if values else {})))
        if wrapped.guard_symbols or wrapped.guard_values:
            return wrapped
    return compiled


def default_specialize() -> str:
    """``$EGRAFT_SPECIALIZE`` when set (``off`` or ``auto``), else ``auto``: a model with
    symbolic input dims builds variants for the shapes it is called with."""
    import os

    value = os.environ.get("EGRAFT_SPECIALIZE", "").strip()
    return value or "auto"


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


def _rewritten(graph: Graph, bindings: dict, rules, rules_off, rewrite: bool, cost, extractor: str, target: str,
               seconds: dict[str, float], budget=None, time_limit: float = 30.0) -> Graph:
    """``graph`` rewritten and extracted for ``target`` (its seconds in ``seconds``), or with
    ``rewrite`` off only its dims bound."""
    if rewrite:
        from egraft.optimize import optimize

        t = time.perf_counter()
        graph = optimize(graph, list(rules), list(rules_off), bindings, budget=budget, cost=cost,
                         extractor=extractor, time_limit=time_limit, target=target).graph
        seconds["optimize"] = time.perf_counter() - t
    elif bindings:
        from egraft.ir.specialize import specialize

        graph = specialize(graph, bindings)
    return graph


def _compile_cuda(model, shape, rules, rules_off, rewrite: bool, cost, extractor: str, use_cache: bool,
                  arch: str | None, device: str):
    """Load, optimize under the CUDA profile, lower to CUDA C and compile it with NVRTC."""
    from egraft.kernels.cuda.nvrtc import DEFAULT_ARCH, check_arch, nvrtc
    from egraft.lowering.cuda import compile_cuda, lower_cuda
    from egraft.lowering.cuda_runtime import DEVICES, CudaModel

    arch = check_arch(arch or DEFAULT_ARCH)
    if device not in DEVICES:
        raise EgraftError(f"device {device!r}: expected one of {', '.join(DEVICES)}")
    if isinstance(model, str | Path) and str(model).endswith(".json"):
        raise EgraftError(f"{model}: compiling a plan for target cuda is not supported yet; give the model")
    nvrtc()  # a missing toolkit is named before minutes of rewriting
    import egraft

    seconds: dict[str, float] = {}
    t = time.perf_counter()
    graph = model if isinstance(model, Graph) else egraft.load(model if not isinstance(model, str) else Path(model))
    seconds["load"] = time.perf_counter() - t
    bindings = dict(sorted((shape or {}).items()))
    problem = unknown_dims_message(bindings, graph, str(model) if isinstance(model, str | Path) else "the model")
    if problem:
        raise InputError(problem)
    graph = _rewritten(graph, bindings, rules, rules_off, rewrite, cost, extractor, "cuda", seconds)
    lowered = lower_cuda(graph)
    seconds.update(lowered.seconds)
    lowered.seconds = seconds
    return CudaModel(compile_cuda(lowered, arch, use_cache=use_cache), device)


def _compile(model, target: str, shape, rules, rules_off, rewrite: bool, cost, extractor: str, use_cache: bool,
             budget=None, time_limit: float = 30.0, assume: tuple[str, ...] = (),
             values: Mapping[str, int] | None = None):
    from egraft.lowering.compile import compile_lowered, lower

    start = time.perf_counter()
    values = dict(values or {})
    digest, graph = model_digest(model)
    bindings = dict(sorted((shape or {}).items()))
    cost_key = cost if isinstance(cost, str) else repr(cost.settings())
    settings = (repr(bindings), repr(sorted(rules_off)), repr(rewrite), cost_key, extractor, target, repr(budget),
                repr(time_limit)) + ((repr(list(assume)),) if assume else ()) + \
        ((repr(sorted(values.items())),) if values else ())
    entry = entry_path(digest, settings, [Path(p).read_bytes() for p in rules])
    if use_cache:
        wait_for_writes(entry)  # this entry's write, still under way (a compile of the same model just before)
        lowered = read_entry(entry)
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
    if values:
        from egraft.ir.specialize import bind_values

        graph = bind_values(graph, values)
    # an input's anonymous dim that meets a dim in a broadcast is that dim, checked on every call
    assume = tuple(assume) + tuple(a for a in input_assumptions(graph) if a not in assume)
    assumptions = parse_assumptions(assume, graph.symbols())
    check_assumptions(assumptions, bindings, what="bound by shape")
    graph = _rewritten(graph, bindings, rules, rules_off, rewrite, cost, extractor, "cpu", seconds, budget,
                       time_limit)
    if assumptions:
        graph = assume_graph(graph, assumptions)
    lowered = lower(graph)
    lowered.assumptions = tuple(assumptions)
    seconds.update(lowered.seconds)
    lowered.seconds = seconds
    compiled = compile_lowered(lowered, use_cache=use_cache)
    compiled.cache_hit = False
    if use_cache:
        write_entry_in_background(entry, lowered)
    return compiled


__all__ = ["TARGETS", "compile", "unknown_dims_message", "cache_root", "clear_cache"]

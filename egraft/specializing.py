"""Specialization with guards: one generic build serves every shape at once; variants for
the shapes a model actually sees are built in the background and picked by a guard.

``egraft.compile(model, specialize="auto")`` returns a :class:`SpecializingModel`. A call
whose input dims (the binding of the inputs' symbolic dims) have a finished variant runs
the variant: the model compiled with those dims bound (``compile(model, shape=...)``,
static shapes, so the layout rules and the static kernels apply). Any other call runs
the generic build at once and, the first time that binding is seen, asks for its variant.

Variants are built in a separate process (:func:`egraft.background.call_in_worker`: a
fresh ``python`` at low priority that compiles into the compile cache), never in the
calling process: a compile there would hold the interpreter lock and slow the very calls
it should speed up. A thread waits for the worker and then reads the finished build from
the cache (milliseconds), so no call waits for a compile.
At most :data:`MAX_VARIANTS` bindings get variants; later ones stay on the generic build.

Example:
    >>> compiled = egraft.compile("ocr.onnx", specialize="auto")        # doctest: +SKIP
    >>> compiled.run({"x": image_32x320})    # generic kernels; the 32x320 variant starts building
    >>> compiled.wait()                        # (only for tests and benchmarks)
    >>> compiled.run({"x": image_32x320})    # the variant
    >>> compiled.variants                      # {(('h', 32), ('w', 320)): 'ready'}
"""

from __future__ import annotations

import threading
import time
from collections.abc import Mapping
from pathlib import Path

import numpy as np
import sympy

from egraft.kernels.cpu.llvm import cache_dir, pinned_cache_dir

#: Bindings that get their own variant, per compiled model.
MAX_VARIANTS = 8
#: The ``specialize`` settings ``egraft.compile`` takes.
SPECIALIZE = ("off", "auto")
#: One variant builds at a time, process-wide (each build is a whole compile).
_ONE_BUILD = threading.Lock()

def deciding_inputs(graph) -> list[str]:
    """The graph's one-element integer or bool inputs that an If's condition is computed
    from (through any nodes), in input order.

    Example: silero's ``If(Equal(sr, 16000))`` gives ``["sr"]``.
    """
    from egraft.lowering.control import is_control

    producers = {v.name: node for node in graph.nodes for v in node.outputs if v is not None}
    candidates = {v.name for v in graph.inputs if v.type.shape is not None and v.type.is_static
                  and int(np.prod(v.type.shape)) == 1 and v.type.dtype.numpy.kind in "iub"}
    found: set[str] = set()
    for node in graph.nodes:
        if node.op != "If" or not is_control(node) or not node.inputs or node.inputs[0] is None:
            continue
        todo, seen = [node.inputs[0].name], set()
        while todo:
            name = todo.pop()
            if name in seen:
                continue
            seen.add(name)
            if name in candidates:
                found.add(name)
            producer = producers.get(name)
            if producer is not None:
                todo.extend(v.name for v in producer.inputs if v is not None and v.const is None)
    return [v.name for v in graph.inputs if v.name in found]


def build_variant_into_cache(model, shape: dict[str, int], options: dict) -> None:
    """In a worker process (:func:`egraft.background.call_in_worker`): compile ``model``
    specialized to ``shape`` into the compile cache."""
    import egraft

    egraft.compile(model, shape=shape, use_cache=True, specialize="off", **options)


class SpecializingModel:
    """A generic compiled model plus the variants built for the bindings it has seen.

    It runs and reports like a :class:`~egraft.lowering.runtime.CompiledModel` (the report,
    steps and graph are the generic build's); :attr:`variants` says which bindings have a
    variant and in what state; :meth:`wait` blocks until the variants asked for so far are
    done.
    """

    def __init__(self, generic, model, shape: Mapping[str, int], options: Mapping[str, object]):
        self.generic = generic
        self._shape = dict(shape)  # dims the caller bound at compile time: every variant binds them too
        self._options = dict(options)
        self._inputs = [(v.name, [int(d) if isinstance(d, int | sympy.Integer) else d for d in v.type.shape])
                        for v in generic.graph.inputs if v.type.shape is not None]
        self._symbols = [(v.name, k, d.name) for v in generic.graph.inputs for k, d in enumerate(v.type.shape or ())
                         if isinstance(d, sympy.Symbol)]
        #: one-element integer inputs whose value decides an If (silero's sample rate): a
        #: variant binds their value too, so the branch runs inline in its native schedule
        self._deciding = [] if "values" in self._options else deciding_inputs(generic.graph)
        self._model = bytes(model) if isinstance(model, bytes | bytearray) else model
        if isinstance(model, str | Path):
            self._model = str(model)
        elif hasattr(model, "SerializeToString") and (self._symbols or self._deciding):
            self._model = model.SerializeToString()  # a copy: what the caller does to theirs later is theirs
        self._ready: dict[tuple, object] = {}
        self._state: dict[tuple, str] = {}
        self._lock = threading.Lock()

    # ---- the guard ------------------------------------------------------------------------------
    @property
    def guard_symbols(self) -> list[str]:
        """The inputs' symbolic dims a binding (and so a variant) is keyed by."""
        return sorted({symbol for _, _, symbol in self._symbols})

    @property
    def guard_values(self) -> list[str]:
        """The inputs whose values a binding is keyed by too (one-element integer inputs
        that decide an If): ``=name`` entries in the binding."""
        return list(self._deciding)

    def guard(self, feeds: Mapping[str, np.ndarray]) -> tuple | None:
        """The binding ``((symbol, value), ...)`` the feeds give the inputs' symbolic dims
        (sorted by name), or ``None`` when they give one symbol two values or miss an input
        (the generic build then says what is wrong)."""
        bound: dict[str, int] = {}
        for name, dims in self._inputs:
            shape = getattr(feeds.get(name), "shape", None)
            if shape is None or len(shape) != len(dims) or any(
                    isinstance(d, int) and d != n for d, n in zip(dims, shape)):
                return None  # not this model's input: the generic build refuses it by name
        for name, axis, symbol in self._symbols:
            shape = feeds[name].shape
            if bound.setdefault(symbol, int(shape[axis])) != int(shape[axis]):
                return None
        for name in self._deciding:
            array = feeds[name]
            if getattr(array, "size", 0) != 1 or np.asarray(array).dtype.kind not in "iub":
                return None  # the generic build names what is wrong
            bound["=" + name] = np.asarray(array).reshape(-1)[0].item()
        return tuple(sorted(bound.items()))

    def run(self, feeds: Mapping[str, np.ndarray], profile: list | None = None) -> dict[str, np.ndarray]:
        """Run on ``feeds``: the variant of their binding when it is ready, else the generic
        build (asking for the variant the first time the binding is seen)."""
        key = self.guard(feeds)
        if key is not None:
            variant = self._ready.get(key)
            if variant is not None:
                return variant.run(feeds, profile=profile)
            if key not in self._state:
                self._request(key)
        return self.generic.run(feeds, profile=profile)

    def _request(self, key: tuple) -> None:
        with self._lock:
            if key in self._state:
                return
            if len(self._state) >= MAX_VARIANTS:
                self._state[key] = "generic (variant limit reached)"
                return
            self._state[key] = "building"
        folder = cache_dir()  # the cache of the compile that asks, even if $EGRAFT_CACHE_DIR changes meanwhile
        threading.Thread(target=self._build, args=(key, folder), daemon=True, name="egraft-variant").start()

    def _build(self, key: tuple, folder: Path) -> None:
        """On a thread of its own: the worker builds the variant into the cache ``folder``, then it is
        read from there."""
        with pinned_cache_dir(folder):
            self._build_pinned(key)

    def _build_pinned(self, key: tuple) -> None:
        import egraft
        from egraft.background import call_in_worker

        shape = {**self._shape, **{k: v for k, v in key if not k.startswith("=")}}
        options = dict(self._options)
        if self._deciding:
            options["values"] = {k[1:]: v for k, v in key if k.startswith("=")}
        try:
            with _ONE_BUILD:
                call_in_worker("egraft.specializing:build_variant_into_cache", self._model, shape, options)
            variant = egraft.compile(self._model, shape=shape, use_cache=True, specialize="off", **options)
            variant.threads = self.generic.threads
        except Exception as e:  # a variant is an optimization: the generic build keeps serving
            self._state[key] = f"failed: {type(e).__name__}: {e}"
            return
        self._ready[key] = variant
        self._state[key] = "ready"

    def wait(self, timeout: float | None = None) -> None:
        """Block until every variant asked for so far is ready (or failed), the If-rank
        variants of the generic build and of the specialized ones included."""
        self.generic.wait(timeout)  # the generic build's own (If rank) variants
        deadline = None if timeout is None else time.monotonic() + timeout
        while any(s == "building" for s in self._state.values()):
            if deadline is not None and time.monotonic() > deadline:
                return
            time.sleep(0.01)  # the worker builds, or the loader reads the cache
        for variant in list(self._ready.values()):  # and the variants' own (If rank) variants
            variant.wait(None if deadline is None else max(deadline - time.monotonic(), 0))

    @property
    def built(self) -> dict[tuple, object]:
        """The variants ready to run, by binding (each a
        :class:`~egraft.lowering.runtime.CompiledModel`)."""
        return dict(self._ready)

    @property
    def variants(self) -> dict[tuple, str]:
        """Each binding seen: ``building``, ``ready``, ``failed: ...`` or ``generic (...)``."""
        return dict(self._state)

    # ---- the generic build's face ---------------------------------------------------------------
    @property
    def threads(self) -> int:
        return self.generic.threads

    @threads.setter
    def threads(self, value: int) -> None:
        self.generic.threads = value
        for variant in list(self._ready.values()):
            variant.threads = value

    def __getattr__(self, name: str):
        if name.startswith("__") or name == "generic":
            raise AttributeError(name)
        return getattr(self.generic, name)

    def __repr__(self) -> str:
        ready = sum(s == "ready" for s in self._state.values())
        return f"{self.generic!r}\nspecialize: auto ({ready} variant(s) ready of {len(self._state)} binding(s) seen)"


__all__ = ["SpecializingModel", "MAX_VARIANTS", "SPECIALIZE"]

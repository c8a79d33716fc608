"""Control flow compiled: If, Loop and Scan nodes whose bodies run as compiled sub-programs.

Lowering turns each body of a control-flow node (If's ``then_branch`` and
``else_branch``, Loop's and Scan's ``body``) into a graph of its own
(:func:`body_graph`): its inputs are the body's inputs followed by the outer values it
captures, which become explicit inputs. That graph is lowered like any other (its own
kernels, views, fallbacks and memory plan; nested If/Loop/Scan nodes recursively) and
compiled once. The node becomes one ``control`` step.

At run time the step runs the op's reference compute (:mod:`egraft.ir.ops.control`), so
the ONNX semantics are the reference's own (the condition, ``M`` and ``cond`` of a Loop,
``v_initial``, Scan's axes and directions, opset-8 Scan): the condition and the trip count
are read in Python, and each run of a body is a call of its compiled sub-program
(:class:`ControlBodies`). A sub-program keeps its arena between calls, so the iterations
of a Loop or Scan reuse one arena; loop-carried values are the previous iteration's
outputs, passed on without a copy.

A body that cannot be lowered makes the node a fallback (the interpreter runs the body)
with the reason; a body's own fallbacks are listed in the model's report, named
``If 'x' / then_branch: Foo 'n3'``.

Example:
    >>> compiled = egraft.compile(model_with_a_loop)                 # doctest: +SKIP
    >>> [s.kind for s in compiled.steps]                            # doctest: +SKIP
    ['kernel', 'control', 'kernel']
    >>> compiled.bodies()["Loop 'loop' / body"].report().fallbacks  # doctest: +SKIP
    []
"""

from __future__ import annotations

import dataclasses
import hashlib
import threading
from collections.abc import Callable, Mapping
from pathlib import Path

import numpy as np

from egraft.errors import EgraftError, ExecutionError
from egraft.ir.dims import evaluate_dim
from egraft.ir.graph import Graph, Node, Value
from egraft.ir.infer import FreshDims, infer_node
from egraft.ir.ops.control import node_captures, onnx_input_count
from egraft.ir.types import TensorType
from egraft.kernels.cpu.emit import Unsupported
from egraft.kernels.cpu.llvm import cache_dir, pinned_cache_dir

#: Ops whose bodies are compiled into sub-programs.
CONTROL_OPS = frozenset({"If", "Loop", "Scan"})


def is_control(node: Node) -> bool:
    """True for an If, Loop or Scan node (of the default domain) with graph attributes."""
    return node.op in CONTROL_OPS and node.domain in ("", "ai.onnx") and \
        any(isinstance(a, Graph) for a in node.attrs.values())


def node_bodies(node: Node) -> list[tuple[str, Graph]]:
    """(attribute name, body) of each body of ``node``, by attribute name."""
    return [(name, body) for name, body in sorted(node.attrs.items()) if isinstance(body, Graph)]


def body_graph(node: Node, attr: str, body: Graph, where: str = "") -> Graph:
    """``body`` as a standalone graph: inputs are the body's own inputs, then the outer
    values it captures (by the body's names for them).

    A captured value takes the type its outer value has now (rewriting or ``shape=``
    bindings may have made it more precise than the type the body saw when imported: a
    rank that was known only at run time, a static dim); the body is then re-typed by the
    op registry, its new symbols named after ``where`` (unique per body, so that they never
    meet the enclosing graph's).

    Example: a Loop body ``(i, cond, acc) -> (cond, acc + x)`` that reads the outer ``x``
    becomes the graph ``(i, cond, acc, x) -> (cond, acc + x)``.
    """
    own = {v.name for v in body.inputs}
    first = onnx_input_count(node)
    outer_types = {v.name: outer.type for v, outer in zip(node_captures(node), node.inputs[first:])
                   if outer is not None}
    captures = [v for v in body.captures() if v.name not in own]
    retyped = [v.replace(type=outer_types.get(v.name, v.type)) for v in captures]
    graph = Graph(name=f"{node.label} / {attr}", inputs=[*body.inputs, *captures], outputs=list(body.outputs),
                  nodes=list(body.nodes), constants=body.constants, opsets=dict(body.opsets),
                  known_values=dict(body.known_values), doc=body.doc)
    if any(a.type != b.type for a, b in zip(captures, retyped)):
        prefix = "_b" + hashlib.blake2b(f"{where} / {graph.name}".encode(), digest_size=3).hexdigest() + "_"
        try:
            graph = _retyped(graph, [*body.inputs, *retyped], FreshDims(prefix))
        except EgraftError:
            pass  # the body's own types still hold
    return _folded(graph)


#: Rounds of :func:`inline_constant_ifs` (an inlined branch may hold Ifs of its own).
MAX_INLINED_DEPTH = 8


def inline_constant_ifs(graph: Graph) -> Graph:
    """``graph`` with each If whose condition is known when compiling (a constant, or shape
    arithmetic that inference evaluated) replaced by the nodes of the branch it takes, the
    captured values read from the node's inputs, and an Identity per output (a view). Only
    when the branch's output types are the If's (else the If stays a control step). The Ifs
    an inlined branch brings are inlined in turn (silero's LSTM state checks sit three Ifs
    deep), up to :data:`MAX_INLINED_DEPTH` levels.

    Example: ``y = If(true) {then: Squeeze(x, -1)}`` becomes ``t = Squeeze(x, -1); y = Identity(t)``.
    """
    for _ in range(MAX_INLINED_DEPTH):
        inlined = _inline_known_ifs(graph)
        if inlined is graph:
            break
        graph = inlined
    return graph


def _inline_known_ifs(graph: Graph) -> Graph:
    """One round of :func:`inline_constant_ifs`: ``graph`` itself when no If is known."""
    nodes: list[Node] = []
    constants, known = graph.constants, graph.known_values
    for index, node in enumerate(graph.nodes):
        cond = _known_condition(graph, node)
        if cond is None:
            nodes.append(node)
            continue
        attr = "then_branch" if cond else "else_branch"
        branch = body_graph(node, attr, node.attrs[attr], f"{graph.name}#{index}")
        outer = {v.name: o for v, o in zip(node_captures(node), node.inputs[onnx_input_count(node):])}
        if len(branch.outputs) != len(node.outputs) or any(v.name not in outer for v in branch.inputs) or any(
                o is not None and b.type != o.type for b, o in zip(branch.outputs, node.outputs)):
            nodes.append(node)
            continue
        if constants is graph.constants:  # copies, once: the branch may bring folded constants
            constants, known = dict(graph.constants), dict(graph.known_values)
        constants.update(branch.constants)
        known.update(branch.known_values)
        rename = {v.name: outer[v.name] for v in branch.inputs}
        for inner in branch.nodes:
            inputs = tuple(None if v is None else rename.get(v.name, v) for v in inner.inputs)
            nodes.append(inner.replace(inputs=inputs))
        for k, (b, o) in enumerate(zip(branch.outputs, node.outputs)):
            if o is not None:
                nodes.append(Node("Identity", (rename.get(b.name, b),), (o,), {}, f"{node.name or 'If'}/{attr}/{k}"))
    if len(nodes) == len(graph.nodes) and all(a is b for a, b in zip(nodes, graph.nodes)):
        return graph
    return Graph(graph.name, list(graph.inputs), list(graph.outputs), nodes, constants=constants,
                 opsets=dict(graph.opsets), known_values=known, doc=graph.doc)


def _known_condition(graph: Graph, node: Node) -> bool | None:
    """The condition of an If node when it is known when compiling, else ``None``."""
    if node.op != "If" or not is_control(node) or not node.inputs or node.inputs[0] is None:
        return None
    v = node.inputs[0]
    value = graph.constants[v.const] if v.const is not None else graph.known_values.get(v.name)
    if value is None or value.dtype == object or value.size != 1:
        return None
    return bool(np.asarray(value).reshape(-1)[0])


#: A body's constant computations larger than this (elements) are left to run time.
MAX_FOLDED_ELEMENTS = 1 << 24


def _folded(graph: Graph) -> Graph:
    """``graph`` with the nodes whose inputs are all constants computed now, by their
    reference kernels, their outputs becoming constants (rewriting folds these in the
    main graph, not in bodies: an LSTM's weights sliced and concatenated from constants).
    The constants go into a copy of the side table."""
    constants = dict(graph.constants)
    out = Graph(graph.name, list(graph.inputs), [], [], constants=constants, opsets=dict(graph.opsets),
                known_values=dict(graph.known_values), doc=graph.doc)
    folded: dict[str, Value] = {}
    for node in graph.nodes:
        inputs = tuple(None if v is None else folded.get(v.name, v) for v in node.inputs)
        node = node.replace(inputs=inputs)
        results = _fold(out, node)
        if results is None:
            out.nodes.append(node)
            continue
        for v, array in zip(node.outputs, results):
            if v is not None:
                folded[v.name] = out.add_constant(np.asarray(array, v.type.dtype.numpy), v.name)
    out.outputs = [folded.get(v.name, v) for v in graph.outputs]
    return out


def _fold(graph: Graph, node: Node) -> list[np.ndarray] | None:
    """The outputs of ``node`` when every input it has is a constant and it may run now."""
    from egraft.ir.infer import NEVER_FOLDED, node_opset
    from egraft.ir.registry import RunContext, get_op

    given = [v for v in node.inputs if v is not None]
    op = get_op(node.op, node.domain)
    if not given or any(v.const is None for v in given) or op is None or op.compute is None \
            or node.op in NEVER_FOLDED or any(isinstance(a, Graph) for a in node.attrs.values()):
        return None
    if any(v is not None and (v.type.shape is None or not v.type.is_static
                              or int(np.prod(v.type.shape)) > MAX_FOLDED_ELEMENTS) for v in node.outputs):
        return None
    args = [None if v is None else graph.constants[v.const] for v in node.inputs]
    try:
        with np.errstate(all="ignore"):
            results = list(op.compute(RunContext(node, op, node_opset(graph, node)), *args))
    except Exception:  # not computable now: it runs with the body
        return None
    for v, r in zip(node.outputs, results):
        if v is not None and (r is None or tuple(np.shape(r)) != tuple(v.type.shape)):
            return None
    return results


def _retyped(graph: Graph, inputs: list[Value], fresh: FreshDims) -> Graph:
    """``graph`` with new ``inputs`` (same names) and every node re-typed by the op registry."""
    out = Graph(graph.name, list(inputs), [], [], constants=graph.constants, opsets=dict(graph.opsets),
                doc=graph.doc)
    renamed: dict[str, Value] = {v.name: v for v in inputs}
    for node in graph.nodes:
        ins = tuple(None if v is None else renamed.get(v.name, v) for v in node.inputs)
        types = infer_node(out, node.replace(inputs=ins), fresh)
        outs = tuple(None if v is None else v.replace(type=t) for v, t in zip(node.outputs, types))
        renamed.update((v.name, v) for v in outs if v is not None)
        out.nodes.append(node.replace(inputs=ins, outputs=outs))
    out.outputs = [renamed.get(v.name, v) for v in graph.outputs]
    return out


def lower_bodies(node: Node, lower: Callable[[Graph], object], where: str = "") -> dict[str, object]:
    """Each body of ``node`` lowered by ``lower`` (the lowering of a whole graph), by
    attribute name; ``where`` names the node in its graph (see :func:`body_graph`). Raises
    :class:`Unsupported` naming the body when one cannot be lowered."""
    lowered = {}
    for attr, body in node_bodies(node):
        try:
            lowered[attr] = lower(body_graph(node, attr, body, where))
        except Unsupported:
            raise
        except EgraftError as e:
            raise Unsupported(f"its {attr} cannot be compiled: {e}") from None
    return lowered


class ControlBodies:
    """The compiled bodies of one control-flow node, called by the op's reference compute
    through ``RunContext.run_subgraph``: each call runs the compiled sub-program of the
    body it is given (the same graph object as in the node's attributes).

    Args:
        node: the If/Loop/Scan node.
        compiled: attribute name -> the body's :class:`~egraft.lowering.runtime.CompiledModel`.
    """

    def __init__(self, node: Node, compiled: Mapping[str, object]):
        self.node = node
        self.compiled = dict(compiled)
        self._by_body = {id(body): (attr, self.compiled[attr]) for attr, body in node_bodies(node)}

    def runner(self, bound: Mapping[str, int],
               profile: list | None = None) -> Callable[[Graph, Mapping[str, np.ndarray]], dict]:
        """The ``run_subgraph`` of one run of the node: the outer graph's bound dims are
        given to the bodies (a captured value's dims may be expressions of them). With
        ``profile``, each body run's step timings are added to it one level deeper, named
        by the node and the body (``If 'x' / then_branch: Conv 'y'``)."""

        def run_subgraph(body: Graph, feeds: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
            found = self._by_body.get(id(body))
            if found is None:
                raise ExecutionError(f"{self.node.label}: a body that was not compiled was called")
            attr, program = found
            if profile is None:
                return program.run_body(feeds, bound)
            inner: list = []
            outputs = program.run_body(feeds, bound, inner)
            profile.extend(dataclasses.replace(t, label=f"{self.node.label} / {attr}: {t.label}", depth=t.depth + 1)
                           for t in inner)
            return outputs

        return run_subgraph


def empty_like_type(result: np.ndarray, ttype: TensorType, bound: Mapping[str, int]) -> np.ndarray:
    """An empty ``result`` (a Loop or Scan that ran no iteration stacks nothing: the
    reference gives 0 for the dims it cannot know) reshaped to the dims that ``ttype``
    gives under ``bound``; the dims it leaves unbound keep ``result``'s.

    Example: zero iterations of a scan output ``f32[_d0, n]`` with n=3: ``f32[0, 0]`` -> ``f32[0, 3]``.
    """
    if ttype.shape is None or len(ttype.shape) != result.ndim:
        return result
    shape = []
    for d, n in zip(ttype.shape, result.shape):
        value = evaluate_dim(d, bound)
        shape.append(int(value) if isinstance(value, int) or getattr(value, "is_Integer", False) else n)
    return np.zeros(shape, result.dtype) if 0 in shape else result


# ---- variants typed with the ranks a run showed --------------------------------------------------
class RankGuard(ExecutionError):
    """A control step's output has another rank than the variant that ran it assumed: the
    call is run again on the generic program."""


#: At most this many rank variants per compiled graph.
MAX_VARIANTS = 4


def ranked_graph(graph: Graph, ranks: Mapping[str, int], prefix: str = "_v") -> Graph:
    """``graph`` with the values in ``ranks`` (outputs of If nodes whose branches differ in
    rank) given that rank, with a fresh symbol per dim, and every node typed again: the
    nodes after them get ranks, and may run generated code."""
    fresh = FreshDims(prefix)
    out = Graph(graph.name, list(graph.inputs), [], [], constants=graph.constants, opsets=dict(graph.opsets),
                doc=graph.doc)
    renamed: dict[str, Value] = {v.name: v for v in graph.inputs}
    for node in graph.nodes:
        ins = tuple(None if v is None else renamed.get(v.name, v) for v in node.inputs)
        draft = node.replace(inputs=ins)
        types = infer_node(out, draft, fresh)
        types = [TensorType(t.dtype, tuple(fresh() for _ in range(ranks[v.name])))
                 if v is not None and v.name in ranks and t is not None and t.shape is None else t
                 for v, t in zip(node.outputs, types)]
        outs = tuple(None if v is None else v.replace(type=t) for v, t in zip(node.outputs, types))
        renamed.update((v.name, v) for v in outs if v is not None)
        out.nodes.append(draft.replace(outputs=outs))
    out.outputs = [renamed.get(v.name, v) for v in graph.outputs]
    return out


class RankedVariants:
    """Programs of one graph typed with the ranks that its If outputs of unknown rank had in
    a run (:func:`ranked_graph`), so that the nodes after them run generated code.

    A run of the generic program notes the rank of each such output (:meth:`observe`);
    after it, :meth:`learn` has the variant of those ranks built (once per set of ranks, at
    most :data:`MAX_VARIANTS`) in the background: lowered and compiled by a worker process
    (:func:`egraft.background.call_in_worker`), loaded here from the object cache, so no
    call waits for a compile. Once ready, calls run the latest variant; its control steps
    check each output's rank and raise :class:`RankGuard` when it differs, and the call is
    run again generically. :meth:`wait` blocks until the builds asked for are done.
    """

    def __init__(self, graph: Graph):
        self.graph = graph
        self.unranked = {v.name for node in graph.nodes if is_control(node) for v in node.outputs
                         if v is not None and v.type.shape is None}
        self.seen: dict[str, int] = {}
        self.variants: dict[tuple, object] = {}
        self.current = None
        self._lock = threading.Lock()
        self._building: list[threading.Thread] = []

    def observe(self, name: str, ndim: int) -> None:
        if name in self.unranked:
            self.seen[name] = ndim

    def learn(self) -> None:
        """Compile (or pick) the variant for the ranks the last generic run saw."""
        key = tuple(sorted(self.seen.items()))
        if not key:
            return
        with self._lock:
            if key in self.variants:
                self.current = self.variants[key] or self.current
                return
            if len(self.variants) >= MAX_VARIANTS:
                return
            self.variants[key] = None  # tried: a failure is not tried again
            thread = threading.Thread(target=self._build, args=(key, cache_dir()), daemon=True,
                                      name="egraft-ranked-variant")
            self._building.append(thread)
        thread.start()

    def _build(self, key: tuple, folder: Path) -> None:
        """On a thread of its own, in the cache ``folder`` of the run that asked."""
        from egraft.background import call_in_worker
        from egraft.lowering.compile import compile_lowered

        try:
            with pinned_cache_dir(folder):
                tag = hashlib.blake2b(repr(key).encode(), digest_size=3).hexdigest()
                lowered = call_in_worker("egraft.lowering.control:lower_ranked", self.graph, dict(key), f"_v{tag}_")
                variant = compile_lowered(lowered)  # the worker's object code, from the cache
        except Exception:  # a variant only saves time: whatever stops it, the generic program keeps serving
            return
        with self._lock:
            self.variants[key] = self.current = variant

    def wait(self, timeout: float | None = None) -> None:
        """Block until every variant asked for so far is built (or failed)."""
        for thread in list(self._building):
            thread.join(timeout)


def lower_ranked(graph: Graph, ranks: dict[str, int], prefix: str):
    """In a worker process: the graph typed with ``ranks`` (:func:`ranked_graph`), lowered,
    its object code compiled into the cache; returns the lowered program."""
    from egraft.lowering.compile import compile_lowered, lower

    lowered = lower(ranked_graph(graph, ranks, prefix))
    compile_lowered(lowered)
    return lowered


__all__ = ["CONTROL_OPS", "MAX_VARIANTS", "ControlBodies", "RankGuard", "RankedVariants", "body_graph",
           "empty_like_type", "inline_constant_ifs", "is_control", "lower_bodies", "lower_ranked", "node_bodies",
           "ranked_graph"]

"""The reference executor: runs any IR graph on numpy arrays, op by op, with each op's
numpy reference implementation from the registry (or ``onnx.reference`` for standard
ops that have none yet).

Inputs are checked against the declared types; symbolic dims are bound from the input
arrays, and every output is checked against its inferred type under those bindings, so
a wrong shape rule is caught where it happens rather than three ops later.

Example:
    >>> from egraft.ir.interpreter import run_graph
    >>> run_graph(graph, {"x": np.ones((2, 3), np.float32)})  # doctest: +SKIP
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
import sympy

from egraft.errors import EgraftError, ExecutionError, InputError
from egraft.ir.dims import fmt_shape
from egraft.ir.graph import Graph, Node, Value
from egraft.ir.infer import node_opset, resolve_op
from egraft.ir.registry import RunContext
from egraft.ir.types import TensorType


class Bindings(dict):
    """Symbol name -> int, filled as input and output shapes are seen."""

    def unify(self, declared: TensorType, array: np.ndarray, what: str, strict: bool) -> str | None:
        """Bind the symbols of ``declared`` from ``array``; a message when they disagree."""
        if declared.shape is None:
            return None
        if len(declared.shape) != array.ndim:
            return (f"{what} has rank {array.ndim} (shape {list(array.shape)}), "
                    f"expected rank {len(declared.shape)} ({fmt_shape(declared.shape)})")
        pending = []
        for axis, (d, n) in enumerate(zip(declared.shape, array.shape)):
            if isinstance(d, int):
                if d != n:
                    return f"{what} has shape {list(array.shape)}, expected {fmt_shape(declared.shape)} (axis {axis})"
            elif isinstance(d, sympy.Symbol):
                bound = self.get(d.name)
                if bound is None:
                    self[d.name] = int(n)
                elif bound != n:
                    return (f"{what} has shape {list(array.shape)}, expected {fmt_shape(declared.shape)} "
                            f"with {d.name}={bound} (axis {axis})")
            else:
                pending.append((axis, d, n))
        for axis, d, n in pending:
            subs = {s: self[s.name] for s in d.free_symbols if s.name in self}
            if len(subs) < len(d.free_symbols):
                free = [s for s in d.free_symbols if s.name not in self]
                if len(free) == 1 and not strict:
                    try:
                        sol = sympy.solve(sympy.Eq(d.xreplace(subs), n), free[0])
                    except (NotImplementedError, ValueError, TypeError):  # Max, Min, floor...: unsolvable
                        sol = []
                    if len(sol) == 1 and sol[0].is_Integer:
                        self[free[0].name] = int(sol[0])
                continue
            want = d.xreplace(subs)
            if want.is_number and int(want) != n:
                return (f"{what} has shape {list(array.shape)}, "
                        f"expected {fmt_shape(declared.shape)} = {want} on axis {axis}")
        return None


def check_feeds(graph: Graph, feeds: Mapping[str, np.ndarray]) -> tuple[dict[str, np.ndarray], Bindings]:
    """Check the feeds against the graph's inputs; return them as arrays and the bound dims."""
    names = [v.name for v in graph.inputs]
    unknown = sorted(set(feeds) - set(names))
    if unknown:
        raise InputError(f"unknown input {unknown[0]!r}; the graph's inputs are {names}")
    bindings = Bindings()
    arrays: dict[str, np.ndarray] = {}
    for v in graph.inputs:
        if v.name not in feeds:
            raise InputError(f"missing input {v.name!r} ({v.type}); the graph's inputs are {names}")
        a = feeds[v.name]
        if not isinstance(a, np.ndarray):
            a = np.asarray(a)
        if a.dtype != v.type.dtype.numpy:
            raise InputError(f"input {v.name!r} has dtype {a.dtype}, expected {v.type.dtype.numpy} ({v.type})")
        problem = bindings.unify(v.type, a, f"input {v.name!r}", strict=True)
        if problem:
            raise InputError(problem)
        arrays[v.name] = a
    return arrays, bindings


def run_graph(graph: Graph, feeds: Mapping[str, np.ndarray], *, outer: Mapping[str, np.ndarray] | None = None,
              check_outputs: bool = True) -> dict[str, np.ndarray]:
    """Run ``graph`` on ``feeds`` and return its outputs by name.

    Args:
        graph: the graph to run.
        feeds: input name -> array.
        outer: values of an enclosing graph that a subgraph may read (If/Loop/Scan).
        check_outputs: check each node's outputs against their inferred types.
    """
    if outer is None:
        arrays, bindings = check_feeds(graph, feeds)
        env: dict[str, np.ndarray] = dict(arrays)
    else:
        env = dict(outer)
        env.update(feeds)
        bindings = Bindings()
    for node in graph.nodes:
        _run_node(graph, node, env, bindings, check_outputs)
    return {v.name: _lookup(env, graph, v) for v in graph.outputs}


def _lookup(env: dict, graph: Graph, v: Value) -> np.ndarray:
    if v.const is not None:
        return graph.constants[v.const]
    try:
        return env[v.name]
    except KeyError:
        raise ExecutionError(f"value %{v.name} is read before it is computed") from None


def _run_node(graph: Graph, node: Node, env: dict, bindings: Bindings, check_outputs: bool) -> None:
    from egraft.ir.onnx_fallback import onnx_compute

    opset = node_opset(graph, node)
    op = resolve_op(node, opset)
    args = [_lookup(env, graph, v) if v is not None else None for v in node.inputs]
    while args and args[-1] is None and len(args) > 0 and node.inputs and node.inputs[len(args) - 1] is None:
        args.pop()

    def run_subgraph(sub: Graph, sub_feeds: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        return run_graph(sub, sub_feeds, outer=env, check_outputs=check_outputs)

    ctx = RunContext(node, op, opset, run_subgraph=run_subgraph)
    compute = op.compute or onnx_compute
    try:
        with np.errstate(all="ignore"):
            results = compute(ctx, *args)
    except EgraftError:
        raise
    except Exception as e:
        raise ExecutionError(f"{node.label} failed: {type(e).__name__}: {e}") from e
    results = list(results)
    for i, v in enumerate(node.outputs):
        if v is None:
            continue
        if i >= len(results) or results[i] is None:
            raise ExecutionError(f"{node.label} produced no output {i}")
        r = results[i]
        if not isinstance(r, np.ndarray):
            r = np.asarray(r, dtype=v.type.dtype.numpy)
        if check_outputs:
            if r.dtype != v.type.dtype.numpy:
                raise ExecutionError(
                    f"{node.label}: output {i} has dtype {r.dtype}, but shape inference said {v.type}")
            problem = bindings.unify(v.type, r, f"{node.label}: output {i}", strict=False)
            if problem:
                raise ExecutionError(f"{problem}, as shape inference said")
        env[v.name] = r

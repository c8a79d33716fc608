"""``EGRAFT_TRACE``: what the compiler decided, one line per event on stderr.

Set ``EGRAFT_TRACE`` to a comma list of categories (or ``all``):

- ``shapes``: every node's output types as the import inferred them
  (``%y = Reshape(%x, %target) -> f32[batch, 6]``), and where each
  symbolic dim that no graph input declares first appears
  (``new dim _d3: output 0 of NonZero 'n12'``);
- ``rules``: every rule application: rule, saturation round, e-class;
- ``lower``: every node's step: kernel, view, or fallback with its reason.

Each line starts with ``[egraft:CATEGORY]``. An unknown category is named once on stderr
with the known ones; tracing then goes on for the known ones.

Example:
    EGRAFT_TRACE=shapes egraft show docs/examples/mlp.onnx
    EGRAFT_TRACE=rules egraft optimize resnet50
"""

from __future__ import annotations

import os
import sys

CATEGORIES = ("shapes", "rules", "lower")
_warned: set[str] = set()


def enabled(category: str) -> bool:
    """Whether ``category`` is traced (``$EGRAFT_TRACE`` read at each call: cheap, and a test
    or a user may set it at any time)."""
    raw = os.environ.get("EGRAFT_TRACE", "")
    if not raw:
        return False
    names = {n.strip().lower() for n in raw.split(",") if n.strip()}
    unknown = sorted(names - set(CATEGORIES) - {"all"} - _warned)
    if unknown:
        _warned.update(unknown)
        print(f"[egraft:trace] EGRAFT_TRACE: unknown categor{'y' if len(unknown) == 1 else 'ies'} "
              f"{', '.join(unknown)}; known: {', '.join(CATEGORIES)}, all", file=sys.stderr, flush=True)
    return category in names or "all" in names


def emit(category: str, line: str) -> None:
    """Print ``line`` on stderr as an event of ``category``."""
    print(f"[egraft:{category}] {line}", file=sys.stderr, flush=True)


def trace_shapes(graph) -> None:
    """The ``shapes`` events of an imported graph (its nodes in order, bodies not entered)."""
    from egraft.ir.dims import dim_symbols

    known = {s for v in graph.inputs if v.type.shape is not None for s in dim_symbols(v.type.shape)}
    for node in graph.nodes:
        names = ", ".join(f"%{v.name}" for v in node.outputs if v is not None)
        types = ", ".join(str(v.type) for v in node.outputs if v is not None)
        args = ", ".join("_" if v is None else f"%{v.name}" for v in node.inputs)
        op = f"{node.domain}::{node.op}" if node.domain else node.op
        emit("shapes", f"{names} = {op}({args}) -> {types}")
        for k, v in enumerate(node.outputs):
            if v is None or v.type.shape is None:
                continue
            for symbol in sorted(dim_symbols(v.type.shape) - known):
                emit("shapes", f"new dim {symbol}: output {k} of {node.label}")
                known.add(symbol)


__all__ = ["CATEGORIES", "enabled", "emit", "trace_shapes"]

"""``EGRAFT_TRACE``: what the compiler decided, one line per event on stderr.

Set ``EGRAFT_TRACE`` to a comma list of categories (or ``all``):

- ``shapes``: every node's output types as the import inferred them
  (``%y = Reshape(%x, %target) -> f32[batch, 6]``), and where each
  symbolic dim that no graph input declares first appears
  (``new dim _d3: output 0 of NonZero 'n12'``);
- ``rules``: every rule application: rule, saturation round, e-class;
- ``extract``: every e-class of the extracted program that had a choice: the e-node
  taken and its cost (its own and with everything it reaches, as greedy priced it)
  against each alternative's, in the cost model's units (``e-class e13:
  com.egraft::FusedMatMul(e8, e9, e11) 2.409 (own 0.806) over Relu(e12) 3.211``);
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

CATEGORIES = ("shapes", "rules", "extract", "lower")
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


def trace_extraction(snapshot, extraction, roots: list[int]) -> None:
    """The ``extract`` events of one extraction: per e-class of the chosen program with
    more than one e-node, the choice and the alternatives, cheapest first (their costs as
    greedy's bottom-up pass saw them; ``-`` for an e-node that pass never priced: it
    reaches its own e-class)."""
    from egraft.extract.program import reachable

    table, seen = extraction.table, extraction.alternatives

    def label(c: int, i: int) -> str:
        n = snapshot.classes[c][i]
        op = f"{n.domain}::{n.op}" if n.domain else n.op
        return f"{op}({', '.join(f'e{ch}' for ch in n.children)})"

    def priced(c: int, i: int) -> str:
        total = seen.get((c, i))
        return "-" if total is None else f"{total:.4g}"

    chosen_total = 0
    for c in reachable(snapshot, extraction.choice, roots):
        nodes = snapshot.classes[c]
        if len(nodes) < 2:
            continue
        chosen_total += 1
        i = extraction.choice[c]
        others = sorted((k for k in range(len(nodes)) if k != i), key=lambda k: (seen.get((c, k), float("inf")), k))
        rejected = ", ".join(f"{label(c, k)} {priced(c, k)}" for k in others)
        emit("extract", f"e-class e{c}: {label(c, i)} {priced(c, i)} (own {table[c][i]:.4g}) over {rejected}")
    emit("extract", f"{extraction.extractor} ({extraction.status}): program cost {extraction.cost:.6g}, "
                    f"{chosen_total} e-class(es) with a choice")


__all__ = ["CATEGORIES", "enabled", "emit", "trace_shapes", "trace_extraction"]

"""Random valid ONNX graphs from a seed: :func:`generate`.

A graph has 1-3 float inputs whose dims are fixed or symbolic (``n``, ``s``), 3-25 nodes drawn
from :data:`egraft.testing.fuzz.ops.SPECS`, initializers, and every value no node reads as
an output. Each graph comes with two bindings of its symbols (different sizes, 1 among them
sometimes) and random feeds for each; the same seed always gives the same case.

Example:
    >>> case = generate(7)
    >>> len(case.feeds)
    2
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import onnx

from egraft.testing.fuzz.builder import FLOAT, MAX_ELEMENTS, Builder, Dim, elements, feeds_for, fixed
from egraft.testing.fuzz.ops import MIN_OPSET, SPECS, WEIGHTS

OPSETS = (13, 17, 18)
SYMBOLS = ("n", "s")


@dataclass
class FuzzCase:
    """A generated model, its two input bindings (``feeds[0]``, ``feeds[1]``) and the symbol
    sizes each binding gives (``bindings``)."""

    seed: int
    model: onnx.ModelProto
    feeds: list[dict[str, np.ndarray]]
    bindings: list[dict[str, int]] = field(default_factory=list)

    @property
    def ops(self) -> list[str]:
        return [n.op_type for n in self.model.graph.node]


def _symbols(rng: np.random.Generator) -> dict[str, tuple[int, int]]:
    out = {}
    for name in SYMBOLS:
        a = int(rng.integers(1, 6))
        b = int(rng.choice([1, 2, 3, 4, 5, 6]))
        while b == a:
            b = int(rng.integers(1, 7))
        out[name] = (a, b)
    return out


def _input_shape(b: Builder) -> tuple[Dim, ...]:
    rank = int(b.rng.choice([1, 2, 2, 3, 3, 4, 4, 4]))
    dims = []
    for i in range(rank):
        if b.chance(0.3) and b.symbols:
            name = "n" if i == 0 and b.chance(0.7) else b.choice(list(b.symbols))
            a, c = b.symbols[name]
            dims.append(Dim(name, a, c))
        else:
            dims.append(fixed(int(b.rng.choice([1, 2, 3, 4, 5, 6, 8]))))
    return tuple(dims)


def generate(seed: int, max_nodes: int = 25) -> FuzzCase:
    """The case of ``seed``: a model of 3 to ``max_nodes`` nodes and its two bindings' feeds."""
    rng = np.random.default_rng(seed)
    symbols = _symbols(rng) if rng.random() < 0.8 else {}
    b = Builder(rng, int(rng.choice(OPSETS)), symbols)
    for i in range(int(rng.integers(1, 4))):
        shape = _input_shape(b)
        while elements(shape) > MAX_ELEMENTS // 4:
            shape = _input_shape(b)
        lo = float(rng.choice([-2.0, -1.0, 0.1]))
        v = b.value(FLOAT, shape, lo, lo + float(rng.choice([2.0, 3.0, 4.0])), name=f"x{i}")
        b.inputs.append(v)
    ops = [op for op in SPECS if MIN_OPSET.get(op, 13) <= b.opset]
    weights = np.array([WEIGHTS.get(op, 1.0) for op in ops])
    target = int(rng.integers(3, max_nodes + 1))
    tries = 0
    while len(b.nodes) < target and tries < 400:
        tries += 1
        before = (len(b.nodes), len(b.values), len(b.initializers))
        op = ops[int(rng.choice(len(ops), p=weights / weights.sum()))]
        if not SPECS[op](b) or len(b.nodes) > max_nodes:
            del b.nodes[before[0]:], b.values[before[1]:], b.initializers[before[2]:]
            for v in b.values:  # forget the uses of nodes taken back
                v.uses = sum(v.name in n.input for n in b.nodes)
    produced = {o for n in b.nodes for o in n.output}
    leaves = [v for v in b.values if v.uses == 0 and v.name in produced]
    outputs = leaves[-6:] if leaves else b.values[-1:]
    if rng.random() < 0.2:  # an intermediate value as an output too
        inner = [v for v in b.values if v.name in produced and v not in outputs]
        if inner:
            outputs.append(inner[int(rng.integers(len(inner)))])
    model = b.model(outputs)
    feeds = [feeds_for(b.inputs, k, np.random.default_rng([seed, k])) for k in (0, 1)]
    bindings = [{s: v[k] for s, v in symbols.items()} for k in (0, 1)]
    return FuzzCase(seed, model, feeds, bindings)

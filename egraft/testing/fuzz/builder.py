"""The generator's bookkeeping: dims that are symbolic or fixed, the values a graph has made
so far (dtype, shape, a bound on their range), and a :class:`Builder` that adds nodes and
initializers to an ONNX graph while it tracks them.

A dim is the same dim as another when their labels are equal; a fixed dim's label is its
size. Every dim also carries its size under each of the two bindings a graph is run at
(``a`` and ``b``), so that a generator can check that a window fits or an index is in range
under both.

Example:
    >>> n = Dim("n", 3, 1)
    >>> fixed(4).static, n.static, n.lo
    (True, False, 1)
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

FLOAT, INT64, BOOL, INT32 = TensorProto.FLOAT, TensorProto.INT64, TensorProto.BOOL, TensorProto.INT32
#: Most elements a value may hold under either binding (keeps compiles and runs fast).
MAX_ELEMENTS = 4096


@dataclass(frozen=True)
class Dim:
    """One axis: ``label`` names it (a fixed dim's label is its size), ``a`` and ``b`` are
    its sizes under the two bindings."""

    label: str
    a: int
    b: int

    @property
    def static(self) -> bool:
        return self.label.isdigit()

    @property
    def lo(self) -> int:
        return min(self.a, self.b)

    @property
    def hi(self) -> int:
        return max(self.a, self.b)

    def at(self, k: int) -> int:
        return (self.a, self.b)[k]


def fixed(size: int) -> Dim:
    """The fixed dim of ``size``."""
    return Dim(str(size), size, size)


def derive(tag: str, dims: Sequence[Dim], fn: Callable[..., int]) -> Dim:
    """The dim ``fn(*sizes)`` computed from ``dims`` under each binding; fixed when they are."""
    a, b = fn(*(d.a for d in dims)), fn(*(d.b for d in dims))
    if all(d.static for d in dims):
        return fixed(a)
    return Dim(f"{tag}({','.join(d.label for d in dims)})", a, b)


def product(dims: Sequence[Dim]) -> Dim:
    """The dim holding every element of ``dims`` (as Flatten or Reshape merges them)."""
    dims = [d for d in dims if d.label != "1"]
    if not dims:
        return fixed(1)
    if len(dims) == 1:
        return dims[0]
    return derive("mul", dims, lambda *s: math.prod(s))


def broadcast(x: Sequence[Dim], y: Sequence[Dim]) -> tuple[Dim, ...] | None:
    """The numpy broadcast of two shapes, or None when a pair of dims may differ (dims
    broadcast only when equal or when one is a fixed 1)."""
    out = []
    for i in range(1, max(len(x), len(y)) + 1):
        p = x[-i] if i <= len(x) else fixed(1)
        q = y[-i] if i <= len(y) else fixed(1)
        if p.label == q.label:
            out.append(p)
        elif p.label == "1":
            out.append(q)
        elif q.label == "1":
            out.append(p)
        else:
            return None
    return tuple(reversed(out))


def elements(shape: Sequence[Dim]) -> int:
    """How many elements a value of ``shape`` holds under its larger binding."""
    return max(math.prod(d.a for d in shape), math.prod(d.b for d in shape))


@dataclass
class Val:
    """A value of the graph: name, dtype, shape and bounds ``lo <= x <= hi`` (loose; used to
    keep Exp, Log, Div and Pow in their safe domains). ``dims`` holds the dims a 1-D int64
    value lists when it came from Shape."""

    name: str
    dtype: int
    shape: tuple[Dim, ...]
    lo: float = -1.0
    hi: float = 1.0
    dims: tuple[Dim, ...] | None = None
    uses: int = 0

    @property
    def rank(self) -> int:
        return len(self.shape)

    @property
    def mag(self) -> float:
        return max(abs(self.lo), abs(self.hi))

    @property
    def is_float(self) -> bool:
        return self.dtype == FLOAT


@dataclass
class Builder:
    """An ONNX graph being generated: nodes, initializers, inputs and the pool of values."""

    rng: np.random.Generator
    opset: int
    symbols: dict[str, tuple[int, int]]
    nodes: list = field(default_factory=list)
    initializers: list = field(default_factory=list)
    inputs: list[Val] = field(default_factory=list)
    values: list[Val] = field(default_factory=list)
    counter: int = 0

    def fresh(self, prefix: str = "v") -> str:
        self.counter += 1
        return f"{prefix}{self.counter}"

    def value(self, dtype: int, shape: Sequence[Dim], lo: float, hi: float, dims=None, name: str | None = None) -> Val:
        """A new value in the pool."""
        lo, hi = float(lo), float(hi)
        if not (math.isfinite(lo) and math.isfinite(hi)):
            lo, hi = -1e30, 1e30
        v = Val(name or self.fresh(), dtype, tuple(shape), min(lo, hi), max(lo, hi), dims)
        self.values.append(v)
        return v

    def const(self, array: np.ndarray, prefix: str = "c") -> str:
        """An initializer holding ``array``; returns its name."""
        name = self.fresh(prefix)
        self.initializers.append(numpy_helper.from_array(np.asarray(array), name))
        return name

    def ints(self, values: Sequence[int]) -> str:
        return self.const(np.asarray(values, np.int64))

    def scalar(self, x: float) -> str:
        return self.const(np.asarray(x, np.float32))

    def weights(self, shape: Sequence[int], scale: float = 1.0) -> tuple[str, float]:
        """A float initializer of ``shape`` uniform in ±scale; returns its name and bound."""
        return self.const(self.rng.uniform(-scale, scale, size=tuple(shape)).astype(np.float32), "w"), scale

    def node(self, op: str, inputs: Sequence[str | Val], outputs: Sequence[Val], **attrs) -> None:
        """Append ``op`` reading ``inputs`` (values or initializer names) and writing ``outputs``."""
        names = []
        for x in inputs:
            if isinstance(x, Val):
                x.uses += 1
                names.append(x.name)
            else:
                names.append(x)
        attrs = {k: v for k, v in attrs.items() if v is not None}
        self.nodes.append(helper.make_node(op, names, [o.name for o in outputs], name=f"n{len(self.nodes)}_{op}",
                                           **attrs))

    def pick(self, ok: Callable[[Val], bool] = lambda v: True, dtype: int | None = FLOAT) -> Val | None:
        """A value of the pool that ``ok`` accepts, recent ones and unused ones likelier."""
        cands = [v for v in self.values if (dtype is None or v.dtype == dtype) and v.mag < 1e4 and ok(v)]
        if not cands:
            return None
        weights = np.array([(1 + i) * (3 if v.uses == 0 else 1) for i, v in enumerate(cands)], float)
        return cands[int(self.rng.choice(len(cands), p=weights / weights.sum()))]

    def choice(self, options):
        return options[int(self.rng.integers(len(options)))]

    def chance(self, p: float) -> bool:
        return bool(self.rng.random() < p)

    # conditioning: each returns a value in the domain an op needs, adding nodes when needed

    def bounded(self, x: Val, limit: float) -> Val:
        """``x`` scaled so that ``|x| <= limit`` (keeps Exp and LogSumExp from overflowing)."""
        if x.mag <= limit:
            return x
        k = limit / x.mag
        y = self.value(FLOAT, x.shape, x.lo * k, x.hi * k)
        self.node("Mul", [x, self.scalar(k)], [y])
        return y

    def positive(self, x: Val, margin: float) -> Val:
        """``x`` made ``>= margin``: ``|x| + c`` unless it already is."""
        if x.lo >= margin:
            return x
        a = self.value(FLOAT, x.shape, 0, x.mag)
        self.node("Abs", [x], [a])
        c = float(self.rng.uniform(margin, 2 * margin))
        y = self.value(FLOAT, x.shape, c, x.mag + c)
        self.node("Add", [a, self.scalar(c)], [y])
        return y

    def model(self, outputs: Sequence[Val]) -> onnx.ModelProto:
        """The ONNX model: the pool's graph inputs, nodes and initializers, ``outputs`` out."""

        def info(v: Val):
            return helper.make_tensor_value_info(v.name, v.dtype, [d.a if d.static else d.label for d in v.shape])

        graph = helper.make_graph(self.nodes, "fuzz", [info(v) for v in self.inputs],
                                  [helper.make_tensor_value_info(v.name, v.dtype, [None] * v.rank) for v in outputs],
                                  self.initializers)
        model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", self.opset)],
                                  producer_name="egraft.testing.fuzz")
        model.ir_version = 8
        return model


def feeds_for(inputs: Sequence[Val], binding: int, rng: np.random.Generator) -> dict[str, np.ndarray]:
    """Random feeds for ``inputs`` under binding 0 or 1, uniform in each input's bounds."""
    feeds = {}
    for v in inputs:
        shape = tuple(d.at(binding) for d in v.shape)
        feeds[v.name] = rng.uniform(v.lo, v.hi, size=shape).astype(np.float32)
    return feeds

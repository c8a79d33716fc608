"""The IR: values, nodes and graphs.

A :class:`Graph` holds its inputs, its outputs, its nodes in topological order and a
side table of constant tensors keyed by content hash. A :class:`Value` is an SSA name
with a :class:`TensorType`; a constant value names its tensor by that hash, so weights
never travel with the graph structure. A :class:`Node` is one op application.

Example:
    >>> import egraft
    >>> g = egraft.load("model.onnx")          # doctest: +SKIP
    >>> print(g)                               # the IR text, see docs/ir.md
    >>> g.run({"x": x})["y"]                   # the reference executor
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from egraft.ir.types import TensorType


@dataclass(frozen=True)
class Value:
    """An SSA value: a unique ``name`` in its graph and a ``type``.

    ``const`` is the content hash of the constant tensor this value stands for (its
    array lives in :attr:`Graph.constants`), or ``None`` for computed values and inputs.
    """

    name: str
    type: TensorType
    const: str | None = None

    def replace(self, **changes) -> Value:
        return replace(self, **changes)

    def __str__(self) -> str:
        return f"%{self.name}: {self.type}"


@dataclass(frozen=True, eq=False)
class Node:
    """One op application.

    Attributes:
        op: the op name, as in ONNX (``Conv``) or an egraft-only op name.
        inputs: the input values; ``None`` stands for an omitted optional input.
        outputs: the output values (``None`` for an omitted optional output).
        attrs: the attributes the node sets (defaults are not filled in: ask
            :meth:`egraft.ir.registry.OpDef.attr_default`).
        name: the node's name in the source model ("" when it had none).
        domain: the operator-set domain ("" is the default ONNX domain).
    """

    op: str
    inputs: tuple[Value | None, ...]
    outputs: tuple[Value | None, ...]
    attrs: Mapping[str, Any] = field(default_factory=dict)
    name: str = ""
    domain: str = ""

    def replace(self, **changes) -> Node:
        return replace(self, **changes)

    @property
    def label(self) -> str:
        """How errors name this node: ``Conv 'conv1'`` or ``Conv (unnamed)``."""
        return f"{self.op} {self.name!r}" if self.name else f"{self.op} (unnamed)"


def _byte_view(arr: np.ndarray):
    """The bytes of a contiguous array without copying them where the buffer protocol allows."""
    try:
        return memoryview(arr).cast("B")
    except (TypeError, ValueError, NotImplementedError):  # empty arrays, dtypes without a buffer format
        return arr.tobytes()


def content_hash(array: np.ndarray) -> str:
    """The side-table key of a constant: its dtype, shape and bytes, hashed (SHA-256, which runs
    on the CPU's SHA instructions at twice blake2b's rate; ResNet-50's weights and their folded
    forms hash ~200 MB per compile), truncated to 80 bits."""
    h = hashlib.sha256()
    h.update(str(array.dtype).encode())
    h.update(str(array.shape).encode())  # before ascontiguousarray, which makes 0-d arrays 1-d
    arr = np.ascontiguousarray(array)
    if arr.dtype == object:
        h.update(repr(arr.tolist()).encode())
    else:
        h.update(_byte_view(arr))
    return h.hexdigest()[:20]


@dataclass(eq=False)
class Graph:
    """A dataflow graph in egraft's IR.

    Attributes:
        name: the graph's name.
        inputs: runtime inputs (constants are never inputs).
        outputs: the values the graph returns, in order.
        nodes: nodes in topological order.
        constants: content hash -> numpy array (the weights side table).
        opsets: operator-set domain -> version, as imported ("" -> 13 ...).
        known_values: value name -> small array whose entries are ints or sympy
            expressions; the value of a shape computation (``Shape(x)`` of a symbolic
            shape) known at compile time. Filled by shape inference.
        doc: free text carried from the source model.
    """

    name: str
    inputs: list[Value]
    outputs: list[Value]
    nodes: list[Node]
    constants: dict[str, np.ndarray] = field(default_factory=dict)
    opsets: dict[str, int] = field(default_factory=lambda: {"": 21})
    known_values: dict[str, np.ndarray] = field(default_factory=dict)
    doc: str = ""

    # ----- construction helpers -------------------------------------------------
    def add_constant(self, array: np.ndarray, name: str) -> Value:
        """Put ``array`` in the side table and return a constant value named ``name``."""
        array = np.asarray(array)
        key = content_hash(array)
        self.constants.setdefault(key, array)
        return Value(name, TensorType.of(array), const=key)

    def constant(self, value: Value) -> np.ndarray | None:
        """The array of a constant value, or ``None`` when ``value`` is not constant."""
        if value is None or value.const is None:
            return None
        return self.constants[value.const]

    # ----- queries -------------------------------------------------------------
    def values(self) -> Iterator[Value]:
        """Every value: inputs, then node inputs and outputs in order, each once."""
        seen: set[str] = set()
        for v in self.inputs:
            seen.add(v.name)
            yield v
        for node in self.nodes:
            for v in (*node.inputs, *node.outputs):
                if v is not None and v.name not in seen:
                    seen.add(v.name)
                    yield v

    def captures(self) -> list[Value]:
        """The values of enclosing graphs that this graph (a control-flow body) reads by
        name, its nested bodies included, in first-read order: what the body needs from
        outside besides its inputs and constants.

        Example:
            >>> body.captures()  # doctest: +SKIP
            [Value('x', f32[n])]
        """
        defined = {v.name for v in self.inputs}
        found: dict[str, Value] = {}
        for node in self.nodes:
            reads = [v for v in node.inputs if v is not None and v.const is None]
            for attr in node.attrs.values():
                for sub in (attr if isinstance(attr, list | tuple) else [attr]):
                    if isinstance(sub, Graph):
                        reads.extend(sub.captures())
            for v in reads:
                if v.name not in defined:
                    found.setdefault(v.name, v)
            defined.update(v.name for v in node.outputs if v is not None)
        return list(found.values())

    def producers(self) -> dict[str, Node]:
        """Value name -> the node that computes it."""
        return {v.name: n for n in self.nodes for v in n.outputs if v is not None}

    def consumers(self) -> dict[str, list[Node]]:
        """Value name -> the nodes that read it."""
        out: dict[str, list[Node]] = {}
        for n in self.nodes:
            for v in n.inputs:
                if v is not None:
                    out.setdefault(v.name, []).append(n)
        return out

    def op_histogram(self) -> dict[str, int]:
        """Op name -> number of nodes, most frequent first, ties by name."""
        counts: dict[str, int] = {}
        for n in self.nodes:
            counts[n.op] = counts.get(n.op, 0) + 1
        return dict(sorted(counts.items(), key=lambda kv: (-kv[1], kv[0])))

    def symbols(self) -> list[str]:
        """Names of the symbolic dims of the graph's inputs and outputs, sorted."""
        from egraft.ir.dims import dim_symbols

        names: set[str] = set()
        for v in (*self.inputs, *self.outputs):
            if v.type.shape is not None:
                names |= dim_symbols(v.type.shape)
        return sorted(names)

    # ----- the public API --------------------------------------------------------
    def run(self, feeds: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        """Run the graph on numpy arrays with the reference executor.

        Args:
            feeds: input name -> array. Dtypes and shapes are checked against the
                declared input types; symbolic dims are bound from the arrays.

        Returns:
            Output name -> array, in the graph's output order.

        Example:
            >>> g.run({"x": np.zeros((1, 3), np.float32)})  # doctest: +SKIP
            {'y': array(...)}
        """
        from egraft.ir.interpreter import run_graph

        return run_graph(self, feeds)

    def validate(self) -> None:
        """Check the graph's structure; raises :class:`egraft.errors.GraphError`."""
        from egraft.ir.validate import validate_graph

        validate_graph(self)

    def __str__(self) -> str:
        from egraft.ir.printer import print_graph

        return print_graph(self)

    def __repr__(self) -> str:
        return f"<Graph {self.name!r}: {len(self.inputs)} inputs, {len(self.nodes)} nodes>"


def topological_order(nodes: Sequence[Node], available: set[str]) -> list[Node]:
    """``nodes`` sorted so each comes after the producers of its inputs (stable)."""
    producers = {v.name: i for i, n in enumerate(nodes) for v in n.outputs if v is not None}
    order: list[Node] = []
    state = [0] * len(nodes)  # 0 new, 1 on stack, 2 done
    for start in range(len(nodes)):
        if state[start]:
            continue
        stack = [(start, False)]
        while stack:
            i, expanded = stack.pop()
            if expanded:
                state[i] = 2
                order.append(nodes[i])
                continue
            if state[i] == 2:
                continue
            if state[i] == 1:
                from egraft.errors import GraphError

                raise GraphError(f"the graph has a cycle through node {nodes[i].label}")
            state[i] = 1
            stack.append((i, True))
            for v in reversed(nodes[i].inputs):
                if v is None or v.name in available:
                    continue
                j = producers.get(v.name)
                if j is not None and state[j] != 2:
                    if state[j] == 1:
                        from egraft.errors import GraphError

                        raise GraphError(f"the graph has a cycle through node {nodes[j].label}")
                    stack.append((j, False))
    return order

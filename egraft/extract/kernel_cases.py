"""The small graphs ``egraft calibrate --kernels`` times: one (or a few) ops per kernel
family at shapes taken from the model zoo (ResNet, Inception, VGG, ShuffleNet, the
encoder), so that the fitted efficiencies describe the kernels the zoo runs.

Every family the rewrite rules can choose is here, also those without a generated kernel
yet (``conv_nhwc``, ``conv_nchwc``): they are timed however they run (a reference
fallback), since that is what extraction's choice costs. Each :class:`KernelCase` is an
ONNX model of one node with random weights and inputs
(seeded: the same case is the same model every time). ``quick=True`` keeps one shape per
family (for tests and a first look).

Example:
    >>> cases = kernel_cases(quick=True)
    >>> sorted({c.family for c in cases})[:3]
    ['attention', 'conv', 'conv_nchwc']
    >>> cases[0].name
    'conv 3x3 64->64 28x28'
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

EGRAFT = "com.egraft"
OPSET = 17


@dataclass(frozen=True)
class KernelCase:
    """One graph to time.

    Attributes:
        name: what it computes, for tables (``conv 3x3 64->64 28x28``).
        family: the kernel family its op belongs to (``egraft.ir.work.FAMILIES``).
        model: the ONNX model (one node, weights as initializers).
        feeds: its inputs.
    """

    name: str
    family: str
    model: onnx.ModelProto = field(repr=False)
    feeds: dict[str, np.ndarray] = field(repr=False)


class _Graph:
    """Builds a one-node model: inputs fed at run time, weights stored as initializers."""

    def __init__(self, seed: int):
        self.rng = np.random.default_rng(seed)
        self.inputs: list[onnx.ValueInfoProto] = []
        self.inits: list[onnx.TensorProto] = []
        self.feeds: dict[str, np.ndarray] = {}

    def feed(self, name: str, shape: Sequence[int]) -> str:
        self.feeds[name] = self.rng.standard_normal(shape).astype(np.float32)
        self.inputs.append(helper.make_tensor_value_info(name, TensorProto.FLOAT, list(shape)))
        return name

    def weight(self, name: str, array: np.ndarray) -> str:
        self.inits.append(numpy_helper.from_array(array, name))
        return name

    def random_weight(self, name: str, shape: Sequence[int], scale: float = 0.1) -> str:
        return self.weight(name, (scale * self.rng.standard_normal(shape)).astype(np.float32))

    def model(self, op: str, inputs: list[str], domain: str = "", **attrs) -> onnx.ModelProto:
        node = helper.make_node(op, inputs, ["y"], domain=domain, **attrs)
        graph = helper.make_graph([node], op.lower(), self.inputs,
                                  [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)], initializer=self.inits)
        opsets = [helper.make_opsetid("", OPSET)] + ([helper.make_opsetid(EGRAFT, 1)] if domain else [])
        return helper.make_model(graph, opset_imports=opsets)


def _conv(c: int, m: int, hw: int, k: int, stride: int = 1, group: int = 1, op: str = "Conv") -> KernelCase:
    g = _Graph(seed=c * 7 + m + hw + k)
    x = g.feed("x", (1, c, hw, hw))
    w = g.random_weight("W", (m, c // group, k, k))
    b = g.random_weight("B", (m,))
    args = [x, w, "", b] if op == "WinogradConv" else [x, w, b]  # WinogradConv(X, W, U?, B?)
    model = g.model(op, args, domain=EGRAFT if op != "Conv" else "", kernel_shape=[k, k], pads=[k // 2] * 4,
                    strides=[stride, stride], group=group)
    kind = "depthwise " if group == c and group > 1 else ("grouped " if group > 1 else "")
    step = f" /{stride}" if stride > 1 else ""
    family = "winograd" if op == "WinogradConv" else "conv"
    label = "winograd" if op == "WinogradConv" else "conv"
    return KernelCase(f"{label} {kind}{k}x{k}{step} {c}->{m} {hw}x{hw}", family, model, g.feeds)


def _conv_layout(op: str, c: int, m: int, hw: int, k: int) -> KernelCase:
    """ConvNHWC (input [1, H, W, C]) or ConvNCHWc (input [1, C/8, H, W, 8])."""
    g = _Graph(seed=c + m + hw + k + len(op))
    shape = (1, hw, hw, c) if op == "ConvNHWC" else (1, c // 8, hw, hw, 8)
    args = [g.feed("x", shape), g.random_weight("W", (m, c, k, k)), g.random_weight("B", (m,))]
    model = g.model(op, args, domain=EGRAFT, kernel_shape=[k, k], pads=[k // 2] * 4, strides=[1, 1])
    family = "conv_nhwc" if op == "ConvNHWC" else "conv_nchwc"
    return KernelCase(f"{op} {k}x{k} {c}->{m} {hw}x{hw}", family, model, g.feeds)


def _matmul(m: int, k: int, n: int) -> KernelCase:
    g = _Graph(seed=m + k + n)
    return KernelCase(f"matmul {m}x{k} @ {k}x{n}", "gemm",
                      g.model("MatMul", [g.feed("a", (m, k)), g.random_weight("B", (k, n))]), g.feeds)


def _gemm(m: int, k: int, n: int) -> KernelCase:
    g = _Graph(seed=m + k + n + 1)
    model = g.model("Gemm", [g.feed("a", (m, k)), g.random_weight("B", (n, k)), g.random_weight("C", (n,))], transB=1)
    return KernelCase(f"gemm {m}x{k} @ {k}x{n} + bias", "gemm", model, g.feeds)


def _attention(heads: int, seq: int, dim: int) -> KernelCase:
    g = _Graph(seed=heads + seq + dim)
    q, kt, v = g.feed("q", (1, heads, seq, dim)), g.feed("kt", (1, heads, dim, seq)), g.feed("v", (1, heads, seq, dim))
    return KernelCase(f"attention {heads} heads {seq}x{dim}", "attention",
                      g.model("Attention", [q, kt, v], domain=EGRAFT, scale=dim ** -0.5), g.feeds)


def _unary(op: str, shape: Sequence[int], family: str = "elementwise", domain: str = "", **attrs) -> KernelCase:
    g = _Graph(seed=len(op) + sum(shape))
    return KernelCase(f"{op.lower()} {'x'.join(map(str, shape))}", family,
                      g.model(op, [g.feed("x", shape)], domain=domain, **attrs), g.feeds)


def _binary(op: str, shape: Sequence[int], other: Sequence[int]) -> KernelCase:
    g = _Graph(seed=len(op) + sum(shape) + len(other))
    name = f"{op.lower()} {'x'.join(map(str, shape))}" + (" (broadcast)" if tuple(other) != tuple(shape) else "")
    return KernelCase(name, "elementwise", g.model(op, [g.feed("x", shape), g.random_weight("w", other)]), g.feeds)


def _layernorm(rows: int, hidden: int) -> KernelCase:
    g = _Graph(seed=rows + hidden)
    model = g.model("LayerNormalization", [g.feed("x", (rows, hidden)), g.random_weight("gamma", (hidden,)),
                                           g.random_weight("beta", (hidden,))], axis=-1, epsilon=1e-5)
    return KernelCase(f"layernorm {rows}x{hidden}", "normalize", model, g.feeds)


def _batchnorm(c: int, hw: int) -> KernelCase:
    g = _Graph(seed=c + hw)
    args = [g.feed("x", (1, c, hw, hw)), g.random_weight("scale", (c,)), g.random_weight("bias", (c,)),
            g.random_weight("mean", (c,)), g.weight("var", np.ones(c, np.float32))]
    return KernelCase(f"batchnorm 1x{c}x{hw}x{hw}", "normalize", g.model("BatchNormalization", args), g.feeds)


def _pool(op: str, c: int, hw: int, k: int, stride: int, pad: int) -> KernelCase:
    g = _Graph(seed=c + hw + k)
    model = g.model(op, [g.feed("x", (1, c, hw, hw))], kernel_shape=[k, k], strides=[stride, stride], pads=[pad] * 4)
    return KernelCase(f"{op.lower()} {k}x{k}/{stride} 1x{c}x{hw}x{hw}", "pool", model, g.feeds)


def _reduce(op: str, shape: Sequence[int], **attrs) -> KernelCase:
    return _unary(op, shape, "reduce", **attrs)


def _concat(parts: int, c: int, hw: int) -> KernelCase:
    g = _Graph(seed=parts + c + hw)
    names = [g.feed(f"x{i}", (1, c, hw, hw)) for i in range(parts)]
    return KernelCase(f"concat {parts} x 1x{c}x{hw}x{hw}", "data", g.model("Concat", names, axis=1), g.feeds)


def _pad(c: int, hw: int) -> KernelCase:
    g = _Graph(seed=c + hw + 3)
    pads = g.weight("pads", np.array([0, 0, 1, 1, 0, 0, 1, 1], np.int64))
    model = g.model("Pad", [g.feed("x", (1, c, hw, hw)), pads])
    return KernelCase(f"pad 1x{c}x{hw}x{hw} by 1", "data", model, g.feeds)


def _gather(vocab: int, hidden: int, tokens: int) -> KernelCase:
    g = _Graph(seed=vocab + hidden + tokens)
    table = g.random_weight("table", (vocab, hidden))
    g.feeds["ids"] = g.rng.integers(0, vocab, size=(1, tokens)).astype(np.int64)
    g.inputs.append(helper.make_tensor_value_info("ids", TensorProto.INT64, [1, tokens]))
    return KernelCase(f"gather {tokens} rows of {vocab}x{hidden}", "data",
                      g.model("Gather", [table, "ids"], axis=0), g.feeds)


def _transpose(shape: Sequence[int], perm: Sequence[int]) -> KernelCase:
    g = _Graph(seed=sum(shape) + sum(perm))
    model = g.model("Transpose", [g.feed("x", shape)], perm=list(perm))
    return KernelCase(f"transpose {'x'.join(map(str, shape))} {tuple(perm)}", "layout", model, g.feeds)


def _to_blocked(c: int, hw: int) -> KernelCase:
    return KernelCase(f"to blocked 1x{c}x{hw}x{hw}", "layout",
                      *_one_input_model("LayoutToBlocked", (1, c, hw, hw), EGRAFT, block=8))


def _one_input_model(op: str, shape: Sequence[int], domain: str, **attrs) -> tuple[onnx.ModelProto, dict]:
    g = _Graph(seed=sum(shape))
    return g.model(op, [g.feed("x", shape)], domain=domain, **attrs), g.feeds


def kernel_cases(quick: bool = False) -> list[KernelCase]:
    """The graphs to time, grouped by family; ``quick`` keeps the first of each family."""
    cases = [
        # conv: ResNet/Inception 3x3 and 1x1, strided, the 7x7 stem, ShuffleNet's depthwise and grouped
        _conv(64, 64, 28, 3), _conv(128, 128, 14, 3), _conv(256, 64, 28, 1), _conv(64, 256, 28, 1),
        _conv(128, 256, 28, 3, stride=2), _conv(3, 64, 56, 7, stride=2), _conv(128, 128, 28, 3, group=128),
        _conv(240, 240, 14, 1, group=3),
        _conv(64, 64, 28, 3, op="WinogradConv"), _conv(128, 128, 14, 3, op="WinogradConv"),
        # the layout variants the layout rules offer (measured however they run: kernel or fallback)
        _conv_layout("ConvNHWC", 64, 64, 28, 3), _conv_layout("ConvNCHWc", 64, 64, 28, 3),
        # gemm: the classifiers (matrix-vector products) and the encoder's projections
        _matmul(128, 256, 256), _gemm(1, 2048, 1000), _matmul(64, 32, 128), _matmul(256, 512, 512),
        _gemm(1, 4096, 1024),
        _attention(4, 64, 8), _attention(8, 128, 64),
        # elementwise: activations, residual adds, bias broadcasts, the encoder's GELU
        _unary("Relu", (1, 64, 56, 56)), _binary("Add", (1, 256, 28, 28), (1, 256, 28, 28)),
        _binary("Mul", (1, 128, 28, 28), (1, 128, 1, 1)), _unary("Sigmoid", (1, 64, 56, 56)),
        _unary("Gelu", (64, 512), domain=EGRAFT), _unary("Relu", (1, 512, 7, 7)),
        # reduce
        _reduce("GlobalAveragePool", (1, 1024, 7, 7)), _reduce("ReduceMean", (128, 768), axes=[-1]),
        _reduce("GlobalAveragePool", (1, 256, 56, 56)),
        # normalize
        _unary("Softmax", (4, 64, 64), "normalize", axis=-1), _layernorm(64, 768), _batchnorm(64, 56),
        _unary("LRN", (1, 64, 55, 55), "normalize", size=5), _unary("Softmax", (1, 1000), "normalize", axis=-1),
        # pool
        _pool("MaxPool", 64, 112, 3, 2, 1), _pool("AveragePool", 256, 14, 3, 1, 1), _pool("MaxPool", 128, 56, 2, 2, 0),
        # layout
        _transpose((1, 64, 56, 56), (0, 2, 3, 1)), _transpose((1, 64, 4, 8), (0, 2, 1, 3)), _to_blocked(256, 28),
        # data
        _concat(4, 64, 28), _pad(64, 56), _gather(8192, 256, 128), _concat(2, 256, 7),
    ]
    if not quick:
        return cases
    seen: set[str] = set()
    return [c for c in cases if not (c.family in seen or seen.add(c.family))]


__all__ = ["KernelCase", "kernel_cases"]

"""The meaningful values of an attribute that a rule's pattern leaves free, for the soundness
checker (:mod:`egraft.rewrite.soundness`): Gemm's alpha, beta, transA and transB, every
permutation of a small Transpose, each axis of a Softmax or Concat, strides, pads, dilations
and groups of a convolution, a pool's window, epsilons, keepdims...

A free attribute is one the pattern captures (``{perm = p}``, ``{attrs}``) or does not
mention at all (the matcher ignores it; a replacement that does not copy it drops it). The
checker's instances take these values besides the op's default, so a rule that forgets
an attribute (a Gemm rewrite that ignores alpha) meets an instance where it matters.

Example:
    >>> from egraft.ir.graph import Value
    >>> from egraft.ir.types import DType, TensorType
    >>> x = Value("x", TensorType(DType.FLOAT32, (2, 3)))
    >>> attr_values("Transpose", "", "perm", "ints", [x])
    [[0, 1], [1, 0]]
    >>> attr_values("Gemm", "", "alpha", "float", [x, x])
    [0.5, -1.5]
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence

from egraft.ir.graph import Value

__all__ = ["attr_values", "required_values", "CONV_OPS", "POOL_OPS", "BLOCKED_OPS"]

#: Ops whose input 1 is a convolution weight ``[M, C / group, kh, kw]``.
CONV_OPS = frozenset({"Conv", "ConvInteger", "FusedConv", "ConvNHWC", "ConvNCHWc", "PreActConvNCHWc", "WinogradConv",
                      "QLinearConv", "ConvTranspose"})
#: Pooling ops (a window over the spatial dims).
POOL_OPS = frozenset({"MaxPool", "AveragePool", "LpPool"})
#: egraft's blocked-layout ops: a rank-5 input ``[N, C / 8, H, W, 8]`` has two spatial dims.
BLOCKED_OPS = frozenset({"ConvNCHWc", "PreActConvNCHWc"})
#: Ops whose ``axis`` may also be the rank itself (Flatten's axis counts the dims before the cut).
_AXIS_UP_TO_RANK = frozenset({"Flatten"})
#: Per-op values of float attributes (the op's default not included).
_FLOATS = {
    ("Gemm", "alpha"): [0.5, -1.5], ("Gemm", "beta"): [2.0, 0.0, -0.5],
    ("FusedGemm", "alpha"): [0.5, -1.5], ("FusedGemm", "beta"): [2.0, 0.0],
    ("LeakyRelu", "alpha"): [0.2, 1.5], ("Elu", "alpha"): [0.5, 2.0], ("Celu", "alpha"): [0.5, 2.0],
    ("Selu", "alpha"): [1.2], ("Selu", "gamma"): [1.5], ("HardSigmoid", "alpha"): [0.3, 0.05],
    ("HardSigmoid", "beta"): [0.4, 0.1], ("ThresholdedRelu", "alpha"): [0.5, -0.5],
}


def _rank(inputs: Sequence[Value | None], i: int = 0) -> int | None:
    if len(inputs) <= i or inputs[i] is None or inputs[i].type.shape is None:
        return None
    return len(inputs[i].type.shape)


def _spatial(op: str, domain: str, inputs: Sequence[Value | None]) -> int:
    """The number of spatial dims of a convolution's or pool's input."""
    r = _rank(inputs) or 4
    return 2 if op in BLOCKED_OPS and r == 5 else max(r - 2, 1)


def _channels(op: str, inputs: Sequence[Value | None]) -> int | None:
    """The input channels of a convolution's input (NCHW, NHWC or blocked)."""
    if not inputs or inputs[0] is None or not inputs[0].type.is_static:
        return None
    shape = [int(d) for d in inputs[0].type.shape]
    if len(shape) < 3:
        return None
    if op in BLOCKED_OPS and len(shape) == 5:
        return shape[1] * shape[4]
    return shape[-1] if op == "ConvNHWC" else shape[1]


def _perms(n: int) -> list[list[int]]:
    """Permutations of ``n`` axes: all of them up to 4 axes, a spread of 8 beyond."""
    if n <= 4:
        return [list(p) for p in itertools.permutations(range(n))]
    base = list(range(n))
    picks = [base, base[::-1], [0, *base[2:], 1], [0, n - 1, *base[1:-1]], [1, 0, *base[2:]], base[1:] + base[:1],
             [0, 2, 1, *base[3:]], [n - 1, *base[:-1]]]
    return [list(p) for p in dict.fromkeys(tuple(p) for p in picks)]


def _axes(r: int) -> list[int]:
    """Each axis of a rank-``r`` tensor, the channel axis and the last first."""
    order = [1, -1, 0, 2, -2, 3, -3, 4]
    return [a for a in order if -r <= a < r]


def _window(k: int) -> list[list[int]]:
    return [[3] * k, [2] * k, [5] * k, [3, 1, 1][:k] if k > 1 else [1], [1] * k]


def _ints(op: str, domain: str, name: str, inputs: Sequence[Value | None]) -> list:
    r = _rank(inputs)
    if name == "perm" and r is not None:
        return _perms(r)
    if name == "axes" and r is not None:
        picks = [[1], [-1], [0], [1, 2], [0, 2], [-2, -1]]
        return [p for p in picks if all(-r <= a < r for a in p)]
    k = _spatial(op, domain, inputs)
    if name == "strides":
        return [[2] * k, [2] + [1] * (k - 1), [1] * k]
    if name == "pads":
        return [[1] * (2 * k), [1] * k + [0] * k, [0, 1] * k, [2, 1] * k, [0] * (2 * k)]
    if name == "dilations":
        return [[2] * k, [1, 2][:k] + [1] * (k - 2), [1] * k]
    if name == "kernel_shape":
        if op in POOL_OPS:
            return _window(k)
        weight = inputs[1] if len(inputs) > 1 else None
        if op in CONV_OPS and weight is not None and weight.type.is_static and len(weight.type.shape) >= 3:
            return [[int(d) for d in weight.type.shape[2:]]]  # explicit: the weight's window
    if name == "split" and inputs and inputs[0] is not None and inputs[0].type.is_static and r:
        n = int(inputs[0].type.shape[0])
        return [[n // 2, n - n // 2]] if n >= 2 else []
    return []


def _group(op: str, inputs: Sequence[Value | None]) -> list[int]:
    """A convolution's groups: one per input channel (depthwise), two, one."""
    c = _channels(op, inputs)
    if not c:
        return [1]
    out = [c] if c > 1 else []
    if c % 2 == 0 and c > 2:
        out.append(2)
    return out + [1]


_SPECIAL: dict[str, Callable[[str, str, Sequence[Value | None]], list]] = {
    "keepdims": lambda op, d, xs: [0, 1],
    "transA": lambda op, d, xs: [1, 0],
    "transB": lambda op, d, xs: [1, 0],
    "epsilon": lambda op, d, xs: [1e-3, 0.25, 1e-5],
    "auto_pad": lambda op, d, xs: ["SAME_UPPER", "SAME_LOWER", "VALID"],
    "ceil_mode": lambda op, d, xs: [1, 0],
    "count_include_pad": lambda op, d, xs: [1, 0],
    "select_last_index": lambda op, d, xs: [1, 0],
    "noop_with_empty_axes": lambda op, d, xs: [1, 0],
    "group": lambda op, d, xs: _group(op, xs) if op in CONV_OPS else [],
    "activation": lambda op, d, xs: ["relu", "sigmoid", "tanh"] if d == "com.egraft" else [],
    "blocksize": lambda op, d, xs: [2],
    "mode": lambda op, d, xs: {"Pad": ["reflect", "edge"], "DepthToSpace": ["CRD", "DCR"]}.get(op, []),
}


def attr_values(op: str, domain: str, name: str, kind: str, inputs: Sequence[Value | None]) -> list:
    """The values worth trying for attribute ``name`` of ``op`` besides leaving it unset (its
    default), for a node on ``inputs``; empty when there is nothing to try (``to``, ``seed``).

    Example: ``attr_values("Softmax", "", "axis", "int", [x])`` for a rank-3 ``x`` is
    ``[1, -1, 0, 2, -2, -3]``.
    """
    if (op, name) in _FLOATS:
        return list(_FLOATS[(op, name)])
    if name in _SPECIAL:
        return _SPECIAL[name](op, domain, inputs)
    if name == "axis":
        r = _rank(inputs)
        if r is None:
            return []
        axes = _axes(r)
        return axes + [r] if op in _AXIS_UP_TO_RANK else axes
    if kind == "ints":
        return _ints(op, domain, name, inputs)
    if kind == "float" and name in ("alpha", "beta", "gamma", "bias", "lambd", "scale"):
        return [0.5, 2.0]
    return []


def required_values(op: str, domain: str, name: str, kind: str, inputs: Sequence[Value | None],
                    examples: dict[tuple[str, str, str], Callable[[int], str]]) -> list:
    """Values for an attribute that the op requires (no default): Cast's ``to`` keeps the
    input's type, ``examples`` gives egraft-only ones (an Elementwise body), the rest come
    from :func:`attr_values` (a pool's window, a Transpose's perm).

    Example: ``required_values("MaxPool", "", "kernel_shape", "ints", [x], {})[0] == [3, 3]``
    for a rank-4 ``x``.
    """
    example = examples.get((domain, op, name))
    if example is not None:
        return [example(len(inputs))]
    first = inputs[0] if inputs and inputs[0] is not None else None
    if name == "to" and first is not None:
        return [first.type.dtype.value]
    found = attr_values(op, domain, name, kind, inputs)
    if found:
        return found
    return [v for v in ({"int": 0, "float": 1.0, "string": "", "floats": [], "ints": []}.get(kind),) if v is not None]

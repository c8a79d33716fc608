"""How the soundness checker (:mod:`egraft.rewrite.soundness`) fills an instance with numbers,
runs the matched program and its replacement, and decides whether they agree.

**Precision.** An instance is built in float32 (as models are) and then *lifted* to float64:
its float32 inputs, constants and types become float64 (Cast to float becomes Cast to double)
and every node is typed again. The rule is matched, guarded and built on the float64 instance,
so the folds its replacement computes are float64 too, and both programs run in float64. Where
an op has no float64 kernel, or the rule does not apply to float64 (``dtype(x) == f32``), the
instance stays float32 and the trial says so (:attr:`Trial.precision`).

**Tolerance.** A sound replacement differs from what it replaces only by rounding, and
rounding errors scale with the unit roundoff ``u`` (2^-24 in float32, 2^-53 in float64) times
the computation's sensitivity to it (how much its intermediate results cancel, how many
terms a sum has). Rather than bound that sensitivity a priori for every op, the checker
*measures* it: it also runs the matched program in float32 on the same values (exactly
representable in both) and takes ``noise = max |before32 - before64|`` over each root, the
float32 program's own rounding error. The float64 program's error is that times
``u64 / u32``; a differently ordered computation of the same function (a fold, a Winograd
transform, a reassociated sum) may err by a modest multiple of it. So the replacement is sound
on a draw when, for each root::

    max |after - before64| <= NOISE_FACTOR * noise * u_p / u32 + ROUND_FACTOR * u_p * max |before64|

with ``u_p`` the unit roundoff of the precision the replacement ran in (float64, or float32
for a float32 instance) and the second term the rounding floor of a result that float32
happens to compute exactly. In float64 this allows about 1e-13 of the result where a
flat 1e-4 allowed 1e-4: a BatchNormalization fold that forgets its ``epsilon = 1e-5``
(variances near 1: a relative error near 5e-6) is far outside it, and every shipped rule
far inside. Integer and boolean results must agree exactly (their noise is 0).

**Values.** A value mode fills constants and inputs: ``signed`` normal values (constants the
guard compares, ``all_equal(c, 1)``, take that value), ``positive`` ones in [0.5, 1.5]
(variances, epsilons, logarithms), ``wide`` ones of magnitudes spread over 1e-2..1e2 with
random signs, ``wide+`` those positive.

Example:
    >>> allowance(noise=1e-7, scale=1.0, precision=DType.FLOAT64) < 1e-12
    True
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np

from egraft.ir.dtypes import DType
from egraft.ir.graph import Graph, Value
from egraft.ir.infer import FreshDims, infer_node
from egraft.ir.types import TensorType
from egraft.rewrite.soundness_hints import Hints
from egraft.rewrite.soundness_search import Draft, random_array

__all__ = ["NOISE_FACTOR", "ROUND_FACTOR", "UNIT_ROUNDOFF", "VALUE_MODES", "allowance", "realize", "feeds", "lift",
           "Comparison", "compare_runs", "finite", "nudge_constants", "CONST_FACTOR"]

#: Unit roundoff of each float precision.
UNIT_ROUNDOFF = {DType.FLOAT64: 2.0 ** -53, DType.FLOAT32: 2.0 ** -24, DType.FLOAT16: 2.0 ** -11}
#: How many times the before-program's own (scaled) rounding error the replacement may err by, in
#: float64 (where a differently ordered computation is still far inside) and in float32 (where
#: the allowance must stay below the epsilon-sized mistakes it is there to catch).
NOISE_FACTOR = {DType.FLOAT64: 256.0, DType.FLOAT32: 16.0}
#: The rounding floor, in unit roundoffs of the result's largest magnitude.
ROUND_FACTOR = 16.0
#: How many times the effect of moving the guard's decimal constants one float32 ulp is allowed.
CONST_FACTOR = 4.0
#: The value modes, in the order an instance's draws try them when one computes inf or nan.
VALUE_MODES = ("signed", "positive", "wide", "wide+")


def allowance(noise: float, scale: float, precision: DType) -> float:
    """The largest error a sound replacement may show on a root (see the module docstring):
    ``noise`` the float32 program's measured error, ``scale`` the root's largest magnitude.

    Example: ``allowance(0.0, 1.0, DType.FLOAT32) == 16 * 2 ** -24``.
    """
    u = UNIT_ROUNDOFF.get(precision, UNIT_ROUNDOFF[DType.FLOAT32])
    factor = NOISE_FACTOR.get(precision, NOISE_FACTOR[DType.FLOAT32])
    return factor * noise * u / UNIT_ROUNDOFF[DType.FLOAT32] + ROUND_FACTOR * u * scale


def realize(draft: Draft, mode: str, hints: Hints, rng: np.random.Generator, opset: int,
            rest_of: Mapping[str, str]) -> Graph:
    """The draft as a float32 IR graph whose float constants are filled per ``mode``: the
    guard's values (``all_equal(c, 1)``) where it has them, else random.

    Example: ``realize(draft, "positive", hints, rng, 18, {}).inputs`` -> ``[%x: f32[2, 3, 7, 5]]``.
    """
    graph = Graph("instance", [], [], [], opsets={"": opset})
    values: dict[str, Value] = {}
    for var in draft.vars.values():
        if var.role == "input":
            graph.inputs.append(var.value)
            values[var.name] = var.value
            continue
        array = var.array
        if array is None:
            fill = hints.values.get(rest_of.get(var.name, var.name))
            dtype = var.value.type.dtype
            array = np.full(var.value.type.shape, fill, dtype.numpy) if fill is not None else \
                random_array(rng, var.value.type.shape, dtype, mode)
        values[var.name] = graph.add_constant(array, var.name)
    fresh = FreshDims("_r")
    for node in draft.nodes:
        node = node.replace(inputs=tuple(values[v.name] if v is not None else None for v in node.inputs))
        infer_node(graph, node, fresh)  # records the known values of shape arithmetic
        graph.nodes.append(node)
        values.update({v.name: v for v in node.outputs if v is not None})
    graph.outputs = [values[v.name] for v in draft.roots]
    return graph


def feeds(graph: Graph, mode: str, rng: np.random.Generator) -> dict[str, np.ndarray]:
    """Random inputs for ``graph`` in value mode ``mode``.

    Example: ``feeds(graph, "signed", rng)`` -> ``{"x": array(..., dtype=float32)}``.
    """
    return {v.name: random_array(rng, v.type.shape, v.type.dtype, mode) for v in graph.inputs}


def _cast_dtype(t: DType, src: DType, dst: DType) -> DType:
    return dst if t is src else t


#: Ops that compute in float32 whatever their inputs' type (the attribute test says when):
#: the float64 instance would be no more exact than float32, so the instance stays float32.
FLOAT32_INSIDE = {("", "LayerNormalization"): lambda attrs: attrs.get("stash_type", 1) == 1}


def lift(graph: Graph, src: DType = DType.FLOAT32, dst: DType = DType.FLOAT64) -> Graph:
    """``graph`` with its ``src`` inputs and constants made ``dst`` (and Cast to ``src`` made
    Cast to ``dst``), every node typed again; raises when a node refuses.

    Example: ``lift(graph).inputs[0].type`` is ``f64[2, 3]`` for an input ``f32[2, 3]``.
    """
    out = Graph(graph.name, [], [], [], opsets=dict(graph.opsets))
    values: dict[str, Value] = {}
    for v in graph.inputs:
        nv = Value(v.name, TensorType(_cast_dtype(v.type.dtype, src, dst), v.type.shape))
        out.inputs.append(nv)
        values[v.name] = nv

    def value_of(v: Value) -> Value:
        if v.name not in values and v.const is not None:
            array = graph.constants[v.const]
            if array.dtype == src.numpy:
                array = array.astype(dst.numpy)
            values[v.name] = out.add_constant(array, v.name)
        return values[v.name]

    fresh = FreshDims("_l")
    for node in graph.nodes:
        attrs = dict(node.attrs)
        inside = FLOAT32_INSIDE.get((node.domain, node.op))
        if dst is DType.FLOAT64 and inside is not None and inside(attrs):
            raise ValueError(f"{node.op} computes in float32 (stash_type = 1)")
        if node.op == "Cast" and attrs.get("to") == src.value:
            attrs["to"] = dst.value
        inputs = tuple(value_of(v) if v is not None else None for v in node.inputs)
        draft = node.replace(inputs=inputs, attrs=attrs)
        types = infer_node(out, draft, fresh)
        outputs = tuple(None if o is None else Value(o.name, t) for o, t in zip(node.outputs, types))
        new = draft.replace(outputs=outputs)
        out.nodes.append(new)
        values.update({v.name: v for v in outputs if v is not None})
    out.outputs = [value_of(v) for v in graph.outputs]
    return out


def cast_feeds(feed: Mapping[str, np.ndarray], graph: Graph) -> dict[str, np.ndarray]:
    """``feed`` cast to the dtypes of ``graph``'s inputs.

    Example: ``cast_feeds({"x": x32}, lift(graph))["x"].dtype == np.float64``.
    """
    return {v.name: np.asarray(feed[v.name]).astype(v.type.dtype.numpy) for v in graph.inputs if v.name in feed}


def finite(arrays) -> bool:
    """Every float array is free of inf and nan.

    Example: ``finite([np.array([1.0, np.inf])])`` is False.
    """
    return all(not np.issubdtype(a.dtype, np.inexact) or bool(np.all(np.isfinite(a))) for a in arrays)


@dataclass
class Comparison:
    """The errors of one root over the draws: the largest ``error / allowance`` (above 1:
    unsound), the largest absolute and relative (to the root's largest magnitude) errors,
    and the allowance where the ratio was largest."""

    ratio: float = -1.0  # none yet
    abs_error: float = 0.0
    rel_error: float = 0.0
    allowed: float = 0.0
    draw: int = 0

    def add(self, got: np.ndarray, want: np.ndarray, want32: np.ndarray | None, precision: DType, draw: int,
            slack: float = 0.0) -> None:
        """Fold in one draw's outputs: ``got`` the replacement's, ``want`` the matched
        program's in the instance's precision, ``want32`` the matched program's in float32;
        ``slack`` is added to the allowance (the effect of constants' float32 rounding)."""
        got = np.asarray(got)
        want = np.asarray(want)
        if got.shape != want.shape:
            self._worst(float("inf"), float("inf"), float("inf"), 0.0, draw)
            return
        g, w = got.astype(np.float64), want.astype(np.float64)
        if not w.size:
            self._worst(0.0, 0.0, 0.0, 0.0, draw)
            return
        err = float(np.max(np.abs(g - w)))
        if np.isnan(err):
            err = float("inf")
        scale = float(np.max(np.abs(w)))
        exact = not np.issubdtype(want.dtype, np.floating)
        noise = 0.0
        if want32 is not None and not exact:
            noise = float(np.max(np.abs(np.asarray(want32, np.float64) - w)))
            noise = noise if np.isfinite(noise) else float("inf")
        allowed = 0.0 if exact else allowance(noise, scale, precision) + slack
        ratio = (err / allowed if allowed > 0 else float("inf")) if err > 0 else 0.0
        self._worst(ratio, err, err / scale if scale > 0 else err, allowed, draw)

    def _worst(self, ratio: float, abs_error: float, rel_error: float, allowed: float, draw: int) -> None:
        if ratio > self.ratio or (ratio == self.ratio and abs_error > self.abs_error):
            self.ratio, self.allowed, self.draw = ratio, allowed, draw
        self.abs_error = max(self.abs_error, abs_error)
        self.rel_error = max(self.rel_error, rel_error)


def nudge_constants(graph: Graph, names: set[str]) -> Graph | None:
    """``graph`` with its constants named ``names`` moved one float32 ulp up (None when it
    has none of them): a constant the guard compares with a decimal (``1.4142135`` for the
    square root of 2) holds that decimal rounded to float32, and a replacement may use the
    exact value, so the difference this makes is allowed.

    Example: ``nudge_constants(graph, {"r2"})`` has ``r2`` 1.4142137 where ``graph`` has 1.4142135.
    """
    moved: dict[str, Value] = {}
    out = Graph(graph.name, list(graph.inputs), list(graph.outputs), [], dict(graph.constants), dict(graph.opsets),
                dict(graph.known_values))
    for node in graph.nodes:
        inputs = []
        for v in node.inputs:
            if v is not None and v.const is not None and v.name in names:
                if v.name not in moved:
                    array = graph.constants[v.const]
                    up = np.nextafter(array.astype(np.float32), np.float32(np.inf)).astype(array.dtype)
                    moved[v.name] = out.add_constant(up, v.name)
                v = moved[v.name]
            inputs.append(v)
        out.nodes.append(node.replace(inputs=tuple(inputs)))
    return out if moved else None


def _lifted(graph: Graph, src: DType, dst: DType) -> Graph | None:
    try:
        return lift(graph, src, dst)
    except Exception:
        return None


def _nudged(feed: Mapping[str, np.ndarray], rng: np.random.Generator) -> dict[str, np.ndarray]:
    """``feed`` with every float moved one ulp up or down at random (a float32 program's
    sensitivity to rounding, where no float64 program can measure it)."""
    out = {}
    for name, a in feed.items():
        a = np.asarray(a)
        if np.issubdtype(a.dtype, np.floating):
            toward = np.where(rng.random(a.shape) < 0.5, -np.inf, np.inf).astype(a.dtype)
            a = np.nextafter(a, toward)
        out[name] = a
    return out


def compare_runs(before: Graph, after: Graph, feed_list: list[dict], precision: DType,
                 rng: np.random.Generator, nudged: tuple[Graph, Graph] | None = None) -> tuple[list[Comparison], int]:
    """Run the matched program ``before`` and its replacement ``after`` (both in ``precision``)
    on each feed and compare root by root against the best reference: ``before`` itself in
    float64, else ``before`` lifted to float64. The float32 noise comes from ``before`` run in
    float32 (lowered from float64, or as it is), else from ``before`` on inputs nudged by an
    ulp. ``nudged``, the instance and the instance with its decimal constants moved one float32
    ulp, measures what the constants' rounding may change (:func:`nudge_constants`); that times
    ``CONST_FACTOR`` is allowed too. Returns the comparisons and how many draws were finite;
    raises when ``after`` fails.

    Example: ``compare_runs(before, after, [feed], DType.FLOAT64, rng)[0][0].ratio <= 1`` for a
    sound replacement.
    """
    if precision is DType.FLOAT64:
        reference, low, nudge = before, _lifted(before, DType.FLOAT64, DType.FLOAT32), False
    else:
        reference, low, nudge = _lifted(before, DType.FLOAT32, DType.FLOAT64), before, False
        if reference is None:
            reference, low, nudge = before, before, True
    n = len(before.outputs)
    comparisons = [Comparison() for _ in range(n)]
    checked = 0
    for k, feed in enumerate(feed_list):
        want = reference.run(cast_feeds(feed, reference))
        if not finite(want.values()):
            continue
        checked += 1
        got = after.run(cast_feeds(feed, after))
        want32 = None
        if low is not None:
            try:
                low_feed = cast_feeds(feed, low)
                want32 = low.run(_nudged(low_feed, rng) if nudge else low_feed)
            except Exception:
                want32 = None
        slack = [0.0] * n
        if nudged is not None and len(nudged[0].outputs) == n:
            plain, moved = (g.run(cast_feeds(feed, g)) for g in nudged)
            for i in range(n):
                a, b = plain[nudged[0].outputs[i].name], moved[nudged[1].outputs[i].name]
                dev = float(np.max(np.abs(np.asarray(a, np.float64) - np.asarray(b, np.float64)))) if a.size else 0.0
                slack[i] = CONST_FACTOR * dev if np.isfinite(dev) else float("inf")
        for i in range(n):
            w32 = None if want32 is None else want32[low.outputs[i].name]
            comparisons[i].add(got[after.outputs[i].name], want[reference.outputs[i].name], w32, precision, k,
                               slack[i])
    return comparisons, checked

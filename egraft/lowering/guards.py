"""Run-time checks of the broadcasts that the kernels decide at run time.

Where shape inference cannot prove whether an operand's dim broadcasts (``a`` against a
result dim ``Max(a, b)``), the kernel reads it with the stride ``Min(d - 1, 1) * acc``
(0 when ``d`` is 1): right when ``d`` is 1 or the result's dim, as ONNX broadcasting
requires. :func:`check_broadcasts` checks that condition at the actual dims before the
kernel runs, so inputs that do not broadcast (``a = 3`` against ``b = 5``) are refused
with an error naming the node and the dims, never computed out of bounds.

Example:
    ``Add(x: f32[a, 4], y: f32[b, 4])`` fed ``a = 3, b = 5``::

        InputError: Add 'n0': an operand's dim a = 3 (axis 0) is neither 1 nor the
        result's dim Max(a, b) = 5: the inputs do not broadcast
"""

from __future__ import annotations

from collections.abc import Mapping
from functools import lru_cache

import sympy

from egraft.errors import InputError
from egraft.ir.dims import evaluate_dim


@lru_cache(maxsize=4096)
def _symbols(guards: tuple) -> tuple[str, ...]:
    names: set[str] = set()
    for _, d, out in guards:
        for x in (d, out):
            if isinstance(x, sympy.Basic):
                names |= {s.name for s in x.free_symbols}
    return tuple(sorted(names))


@lru_cache(maxsize=65536)
def _violation(guards: tuple, names: tuple[str, ...], values: tuple[int | None, ...]) -> str | None:
    bound = {n: v for n, v in zip(names, values) if v is not None}
    for axis, d, out in guards:
        dv, ov = evaluate_dim(d, bound), evaluate_dim(out, bound)
        if not isinstance(dv, int) or not isinstance(ov, int):
            continue  # a dim the run has not bound yet: the kernel cannot run either
        if dv != 1 and dv != ov:
            return (f"an operand's dim {d} = {dv} (axis {axis}) is neither 1 nor the result's dim {out} = {ov}: "
                    "the inputs do not broadcast")
    return None


def check_broadcasts(label: str, guards: tuple, bound: Mapping[str, int]) -> None:
    """Raise :class:`InputError` when, at the dims ``bound``, an operand dim of ``guards``
    (``(axis, operand dim, result dim)``, see ``Step.guards``) is neither 1 nor the
    result's dim. Each distinct binding is evaluated once."""
    names = _symbols(guards)
    problem = _violation(guards, names, tuple(bound.get(n) for n in names))
    if problem:
        raise InputError(f"{label}: {problem}")

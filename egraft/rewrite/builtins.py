"""The builtin functions of the rule language (guards and replacements), in one table
that the evaluator calls and the rule-file checker reads, so the two cannot disagree.

A builtin takes the evaluator first (for the types and constant values of tensor
arguments) and then the evaluated arguments. Add one here, with a one-line docstring,
and it is available in every rule file.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from egraft.ir.dtypes import DType

if TYPE_CHECKING:
    from egraft.rewrite.evaluate import Evaluator

#: Names that are constants in expressions: the dtypes (``f32``, ``i64``, ``bool``...).
DTYPE_NAMES = {d.short: d for d in DType}


class GuardFailed(Exception):
    """A guard could not be evaluated (e.g. ``dim`` of an unknown rank): the match is skipped."""


@dataclass(frozen=True)
class Handle:
    """A tensor in a replacement: an e-class handle (``T.ref``)."""

    ref: int


# ---- guard builtins ------------------------------------------------------------------------
def _flat(args):
    for a in args:
        if isinstance(a, list):
            yield from a
        else:
            yield a


def _const(ev: Evaluator, *args) -> bool:
    return all(isinstance(h, Handle) and ev.const_of(h) is not None for h in _flat(args))


def _rank(ev: Evaluator, x) -> int:
    t = ev.type_of(x)
    if t.shape is None:
        raise GuardFailed("unknown rank")
    return len(t.shape)


def _shape(ev: Evaluator, x) -> list:
    t = ev.type_of(x)
    if t.shape is None:
        raise GuardFailed("unknown rank")
    return list(t.shape)


def _dim(ev: Evaluator, x, i: int):
    return _shape(ev, x)[i]


def _dtype(ev: Evaluator, x) -> DType:
    return ev.type_of(x).dtype


def _static(ev: Evaluator, *xs) -> bool:
    return all(ev.type_of(x).is_static for x in _flat(xs))


def _numel(ev: Evaluator, x):
    from egraft.ir.dims import dim_product

    return dim_product(_shape(ev, x))


def _value_of(ev: Evaluator, x) -> np.ndarray:
    v = ev.const_of(x)
    if v is None:
        raise GuardFailed("not a constant")
    return v


def _all_equal(ev: Evaluator, x, number) -> bool:
    v = ev.const_of(x) if isinstance(x, Handle) else np.asarray(x)
    return v is not None and v.size > 0 and bool(np.all(v == number))


def _is_symbolic(ev: Evaluator, x) -> bool:
    return not ev.type_of(x).is_static


BUILTINS = {
    "const": _const,
    "rank": _rank,
    "shape": _shape,
    "dim": _dim,
    "dtype": _dtype,
    "static": _static,
    "numel": _numel,
    "value": _value_of,
    "all_equal": _all_equal,
    "is_symbolic": _is_symbolic,
    "len": lambda ev, x: len(x),
    "range": lambda ev, n: list(range(int(n))),
    "abs": lambda ev, x: abs(x),
    "min": lambda ev, *x: min(_flat(x)),
    "max": lambda ev, *x: max(_flat(x)),
    "int": lambda ev, x: int(x),
    "float": lambda ev, x: float(x),
}

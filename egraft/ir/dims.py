"""Dimensions: a dim is a non-negative ``int`` or a sympy expression over named symbols.

Symbolic dims are first-class, as in TVM Relax: ``batch``, ``2*seq``, ``floor(n/2)``.
Every symbol is a positive integer sympy ``Symbol``; expressions are kept simplified so
that equal dims compare equal.

Example:
    >>> b = sym("batch")
    >>> fmt_dim(simplify_dim(b * 2 + 0))
    '2*batch'
    >>> broadcast_shapes((b, 1, 3), (4, 1))
    (batch, 4, 3)
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable, Mapping
from functools import lru_cache

import sympy

Dim = int | sympy.Expr
Shape = tuple[Dim, ...]

_SYMBOLS: dict[str, sympy.Symbol] = {}


def sym(name: str) -> sympy.Symbol:
    """The symbol ``name`` (a positive integer); the same object for the same name."""
    if name not in _SYMBOLS:
        _SYMBOLS[name] = sympy.Symbol(name, integer=True, positive=True)
    return _SYMBOLS[name]


def simplify_dim(d) -> Dim:
    """A dim in canonical form: a Python int when it is a constant, else a sympy expression."""
    if isinstance(d, bool):
        raise TypeError("a bool is not a dim")
    if isinstance(d, int):
        return d
    if hasattr(d, "item") and not isinstance(d, sympy.Basic):  # numpy scalar
        return int(d)
    if isinstance(d, sympy.Symbol):
        return d
    e = _canonical(d)
    if e.is_Integer:
        return int(e)
    return e


#: The sympy functions a dim's canonical form keeps as opaque terms of a rational function.
_OPAQUE = (sympy.floor, sympy.ceiling, sympy.Min, sympy.Max, sympy.Mod)

#: Opaque terms already in canonical form (each came out of ``sympy.simplify``).
_CANONICAL_TERMS: set[sympy.Expr] = set()


def _opaque_terms(expr: sympy.Expr) -> set[sympy.Expr]:
    """The outermost floor, ceiling, Min, Max and Mod terms of ``expr``."""
    found: set[sympy.Expr] = set()
    stack = [expr]
    while stack:
        e = stack.pop()
        if isinstance(e, _OPAQUE):
            found.add(e)
        else:
            stack.extend(e.args)
    return found


@lru_cache(maxsize=65536)
def _canonical(expr: sympy.Expr) -> sympy.Expr:
    """``sympy.simplify``, memoized: the same dims recur on every layer of a network, and
    simplify is the slowest step of importing a model with symbolic spatial dims.

    An expression whose floors and maxima are all canonical already (a product of a
    detector's feature-map sides, a stride) is a rational function of those terms: it is
    cancelled with each term held as a symbol, not simplified (seconds on nested maxima).
    """
    if not expr.has(*_OPAQUE):
        return sympy.cancel(expr) if expr.is_rational_function() else expr
    terms = _opaque_terms(expr)
    for term in terms - _CANONICAL_TERMS:
        if _built_from_canonical(term):
            _CANONICAL_TERMS.add(term)
    if terms <= _CANONICAL_TERMS:
        held = {t: sympy.Symbol(f"_egraft_term{i}", integer=True) for i, t in enumerate(sorted(terms, key=str))}
        rational = expr.xreplace(held)
        if rational.is_rational_function():
            return sympy.cancel(rational).xreplace({v: t for t, v in held.items()})
    result = sympy.simplify(expr)
    _CANONICAL_TERMS.update(_opaque_terms(result))
    return result


def _built_from_canonical(term: sympy.Expr) -> bool:
    """A maximum or minimum whose arguments are each in canonical form already is canonical as
    sympy built it: ``simplify`` returned every such term of the corpus unchanged, and took
    1.2 s of ppocr_v4_det's import on its nested maxima of feature-map sides."""
    if not isinstance(term, sympy.Max | sympy.Min):
        return False
    return all(isinstance(a, sympy.Integer) or _canonical(a) == a for a in term.args)


def is_static(d: Dim) -> bool:
    """True when ``d`` is a known integer."""
    return isinstance(d, int)


def shape_is_static(shape: Iterable[Dim]) -> bool:
    return all(isinstance(d, int) for d in shape)


def fmt_dim(d: Dim) -> str:
    """The printed form of a dim: ``7``, ``batch``, ``2*seq``."""
    return str(d)


def parse_dim(text: str) -> Dim:
    """Parse a printed dim back: ``"7"`` -> 7, ``"batch"`` -> Symbol, ``"2*n"`` -> expression."""
    text = text.strip()
    if text.lstrip("-").isdigit():
        return int(text)
    names = {}
    expr = sympy.sympify(text, locals={"floor": sympy.floor, "ceiling": sympy.ceiling})
    for s in expr.free_symbols:
        names[s] = sym(s.name)
    return simplify_dim(expr.xreplace(names))


def dim_symbols(shape: Iterable[Dim]) -> set[str]:
    """Names of the symbols that appear in a shape."""
    out: set[str] = set()
    for d in shape:
        if not isinstance(d, int):
            out.update(s.name for s in d.free_symbols)
    return out


def evaluate_dim(d: Dim, bindings: Mapping[str, int]) -> Dim:
    """``d`` with the bound symbols replaced by their values (an int when all are bound)."""
    if isinstance(d, int):
        return d
    subs = {s: bindings[s.name] for s in d.free_symbols if s.name in bindings}
    return simplify_dim(d.xreplace(subs)) if subs else d


@lru_cache(maxsize=65536)
def integer_fraction(e: sympy.Expr) -> tuple[sympy.Expr, int | None]:
    """``e`` as ``numerator / d`` with an integer-coefficient numerator and a positive
    integer ``d`` (``h/32 - 1/32`` -> ``(h - 1, 32)``); ``d`` is ``None`` when the
    denominator is not an integer (a symbol divides). Memoized: ``together`` costs about a
    millisecond, and every kernel of a model with symbolic spatial dims asks for the same few
    (ppocr_v4_det: 2,391 calls, 2.3 s of its lowering).

    Example:
        >>> integer_fraction(sym("h") / 32 - sympy.Rational(1, 32))
        (h - 1, 32)
    """
    num, den = sympy.fraction(sympy.together(e))
    if not den.is_Integer or int(den) == 0:
        return e, None
    if int(den) < 0:
        num, den = -num, -den
    return sympy.expand(num), int(den)


def _python(e: sympy.Expr) -> str:
    """``e`` as Python integer arithmetic over ``b["name"]`` (:func:`dim_function`)."""
    if e.is_Integer:
        return str(int(e))
    if e.is_Symbol:
        return f"b[{e.name!r}]"
    if isinstance(e, sympy.floor | sympy.ceiling):
        num, den = integer_fraction(e.args[0])
        if den is None:
            raise ValueError(e)
        return f"(({_python(num)}) // {den})" if isinstance(e, sympy.floor) else f"(-((-({_python(num)})) // {den}))"
    if isinstance(e, sympy.Mod) and e.args[1].is_Integer:
        return f"(({_python(e.args[0])}) % {int(e.args[1])})"
    if isinstance(e, sympy.Max | sympy.Min):
        return f"{'max' if isinstance(e, sympy.Max) else 'min'}({', '.join(_python(a) for a in e.args)})"
    if e.is_Pow and e.exp.is_Integer and int(e.exp) > 0:
        return f"(({_python(e.base)}) ** {int(e.exp)})"
    if e.is_Add or e.is_Mul or e.is_Rational:
        num, den = integer_fraction(e)
        if den is None:
            raise ValueError(e)
        if den != 1:
            return f"(({_python(num)}) // {den})"  # an integer-valued quotient: exact
        return "(" + (" + " if e.is_Add else " * ").join(_python(a) for a in e.args) + ")"
    raise ValueError(e)


@lru_cache(maxsize=65536)
def dim_function(d: Dim) -> Callable[[Mapping[str, int]], int]:
    """``d`` as a function of the bound dims, compiled once: evaluating a dim per call
    binding costs a Python expression, not a sympy substitution (the first call at a new
    shape evaluates every dim of the model). ``KeyError`` when a symbol is unbound.

    Example:
        >>> dim_function(sympy.floor(sym("h") / 2 - sympy.Rational(1, 2)) + 1)({"h": 9})
        5
    """
    if isinstance(d, int):
        return lambda b: d
    try:
        return eval(f"lambda b: {_python(d)}", {"max": max, "min": min})  # noqa: S307 (our own expression text)
    except ValueError:  # an expression with no integer form: substitute
        def substitute(b: Mapping[str, int]) -> int:
            value = evaluate_dim(d, b)
            if not isinstance(value, int):
                raise KeyError(next(iter(dim_symbols([value]) - set(b)), str(value)))
            return value
        return substitute


def dims_equal(a: Dim, b: Dim) -> bool:
    """True when two dims are provably equal."""
    if isinstance(a, int) and isinstance(b, int):
        return a == b
    if a == b:  # the same expression: its difference is 0 (rewriting compares the same dims over and over)
        return True
    return _symbolic_dims_equal(a, b)


@lru_cache(maxsize=65536)
def _symbolic_dims_equal(a: Dim, b: Dim) -> bool:
    """:func:`dims_equal` of two different dims, one symbolic, memoized: the answer depends
    on the two (immutable) expressions alone, and the same pairs recur on every layer when
    rewrites infer broadcasts."""
    difference = sympy.sympify(a) - sympy.sympify(b)
    if sympy.expand(difference) == 0:
        return True
    if _nonzero_somewhere(difference):  # refuted in microseconds: no proof to attempt
        return False
    proved = _zero_by_residues(difference)
    if proved is not None:
        return proved
    if difference.has(sympy.Min, sympy.Max):  # simplify takes seconds on maxima and does not decide them
        return False
    return sympy.simplify(difference) == 0


#: The most residue classes :func:`_zero_by_residues` evaluates a difference on.
_MAX_RESIDUE_CLASSES = 512


def _zero_by_residues(difference: sympy.Expr) -> bool | None:
    """Whether a difference of floors, maxima and linear terms is 0 for every positive
    integer value of its symbols: True or False when decided, None when not.

    With ``L`` the common denominator of its rational numbers, each symbol ``x`` is written
    ``L*k + r`` (``k >= 0``, ``r`` in ``1..L``): every ``floor((a*x + b)/q)`` becomes linear
    in ``k`` and a maximum of linear terms resolves on ``k >= 0``, so each residue class
    reduces to a polynomial in the ``k``s, zero or not. Exact: the classes cover every value.

    Example:
        >>> x = sym("x")
        >>> a = 2 * sympy.floor(x / 32 - sympy.Rational(1, 32)) + 2
        >>> _zero_by_residues(sympy.Max(a, sympy.floor(x / 16 - sympy.Rational(1, 16)) + 1) - a)
        True
    """
    if not difference.has(*_OPAQUE):
        return None
    symbols = sorted(difference.free_symbols, key=str)
    period = 1
    for q in difference.atoms(sympy.Rational):
        period = sympy.ilcm(period, int(q.q))
    if not symbols or period ** len(symbols) > _MAX_RESIDUE_CLASSES:
        return None
    quotients = [sympy.Symbol(f"_egraft_k{i}", integer=True, nonnegative=True) for i in range(len(symbols))]
    for residues in itertools.product(range(1, period + 1), repeat=len(symbols)):
        point = {s: period * k + r for s, k, r in zip(symbols, quotients, residues)}
        value = sympy.expand(difference.xreplace(point))
        if value == 0:
            continue
        if value.is_number:
            return False
        return None  # a floor or maximum that did not resolve: undecided
    return True


#: Values the dims' symbols take where a difference of dims is evaluated before any proof
#: is attempted (dims are positive integers; varied so that floors and maxima differ).
_SAMPLES = ((7, 13, 29, 3, 64, 11), (224, 5, 17, 96, 2, 41), (1, 33, 8, 150, 19, 6))


def _nonzero_somewhere(difference: sympy.Expr) -> bool:
    """Whether ``difference`` (of two dims) is nonzero at some sample point: then the dims are
    not equal, and ``sympy.simplify`` (seconds on the floors and maxima of a detector's
    resized feature maps) is not needed to say so. Sound: equal dims agree everywhere."""
    symbols = sorted(difference.free_symbols, key=str)
    for sample in _SAMPLES:
        point = {s: sympy.Integer(sample[k % len(sample)] + k // len(sample)) for k, s in enumerate(symbols)}
        try:
            value = difference.xreplace(point)
        except (TypeError, ValueError, ZeroDivisionError):
            continue
        if value.is_number and value.is_finite and value != 0:
            return True
    return False


class UnknownComparison(ValueError):
    """A comparison of symbolic dims that no proof decides: its value is known only at run time."""


#: relation name -> (decide on a number, decide on the difference's sympy assumptions)
_RELATIONS = {
    "eq": (lambda d: d == 0, lambda d: True if d.is_zero else (False if d.is_zero is False else None)),
    "lt": (lambda d: d < 0, lambda d: True if d.is_negative else (False if d.is_nonnegative else None)),
    "le": (lambda d: d <= 0, lambda d: True if d.is_nonpositive else (False if d.is_positive else None)),
    "gt": (lambda d: d > 0, lambda d: True if d.is_positive else (False if d.is_nonpositive else None)),
    "ge": (lambda d: d >= 0, lambda d: True if d.is_nonnegative else (False if d.is_negative else None)),
}


def compare_dims(a: Dim, b: Dim, relation: str) -> bool | None:
    """``a <relation> b`` for ``relation`` in eq, lt, le, gt, ge: True or False when it is
    proved for every binding of the symbols (positive integers), None when it is not known.

    Structural equality is no proof: ``floor(n/256 - 1/2) + 1`` may or may not be 1.

    Example:
        >>> n = sym("n")
        >>> compare_dims(n + 1, 1, "gt"), compare_dims(n, 1, "eq"), compare_dims(2 * n, n, "eq")
        (True, None, False)
    """
    on_number, on_symbols = _RELATIONS[relation]
    if isinstance(a, int | float) and isinstance(b, int | float):
        return bool(on_number(a - b))
    difference = simplify_dim(sympy.sympify(a) - sympy.sympify(b))
    if isinstance(difference, int) or difference.is_number:
        return bool(on_number(difference))
    decided = on_symbols(difference)
    return None if decided is None else bool(decided)


def dims_conflict(a: Dim, b: Dim) -> bool:
    """True when two dims are provably different (both known integers that differ)."""
    return isinstance(a, int) and isinstance(b, int) and a != b


class BroadcastError(ValueError):
    """Two shapes that numpy-style broadcasting cannot combine."""


def broadcast_dim(a: Dim, b: Dim) -> Dim:
    """The broadcast of two dims: 1 yields to the other; equal dims stay; else an error."""
    if isinstance(a, int) and a == 1:
        return b
    if isinstance(b, int) and b == 1:
        return a
    if dims_equal(a, b):
        return a
    if isinstance(a, int) and isinstance(b, int):
        raise BroadcastError(f"dims {a} and {b} do not broadcast")
    # One symbolic dim against another: at run time one of them must be 1 or they
    # must agree. Keep the static one when there is one, as onnxruntime does.
    if isinstance(a, int):
        return a
    if isinstance(b, int):
        return b
    return sympy.Max(a, b)


def broadcast_shapes(*shapes: Shape) -> Shape:
    """Multidirectional (numpy) broadcasting over symbolic shapes."""
    rank = max((len(s) for s in shapes), default=0)
    out: list[Dim] = [1] * rank
    for s in shapes:
        padded = (1,) * (rank - len(s)) + tuple(s)
        for i, d in enumerate(padded):
            if type(d) is int and type(out[i]) is int and (d == 1 or d == out[i]):
                continue  # what broadcast_dim keeps, without its calls (the common case, on every inference)
            try:
                out[i] = broadcast_dim(out[i], d)
            except BroadcastError:
                raise BroadcastError(
                    f"shapes {', '.join(fmt_shape(x) for x in shapes)} do not broadcast (axis {i})"
                ) from None
    return tuple(out)


def fmt_shape(shape: Iterable[Dim]) -> str:
    return "[" + ", ".join(fmt_dim(d) for d in shape) + "]"


def dim_product(shape: Iterable[Dim]) -> Dim:
    """The number of elements of a shape."""
    p: Dim = 1
    for d in shape:
        p = p * d
    return simplify_dim(p)

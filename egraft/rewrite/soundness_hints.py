"""What a rule's text says about its instances, for the soundness checker
(:mod:`egraft.rewrite.soundness`): which variables its guard wants constant, their ranks,
dims and values, and the values its guard pins attributes to.

Only the positive part of the guard is read (nothing under ``not``); under ``or`` every
alternative is a candidate (``ax == 1 or ax == -3`` gives ``ax`` the values 1 and -3). A
hint only steers the instance search: the guard itself is still evaluated on every instance,
so a hint read wrongly costs attempts, never a wrong verdict.

Example:
    >>> from egraft.rewrite.parser import parse_rules
    >>> rule = parse_rules("rule r: Mul(x, c) where const(c) and all_equal(c, 1) => x", "<s>").rules[0]
    >>> hints = rule_hints(rule)
    >>> hints.const, hints.values
    ({'c'}, {'c': 1})
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from egraft.ir.dtypes import DType
from egraft.rewrite.ast import EBinary, ECall, EIndex, EList, ELit, EUnary, EVar, Expr, POp, Rule
from egraft.rewrite.builtins import DTYPE_NAMES

__all__ = ["Hints", "rule_hints", "subexprs", "literal", "pattern_nodes"]

_COMPARISONS = ("==", "!=", "<", "<=", ">", ">=")


@dataclass
class Hints:
    """What the guard (and replacement) ask of each variable.

    Attributes:
        const: variables the guard asks ``const(...)`` of.
        ranks: ``rank(v) == n``.
        values: ``all_equal(v, n)`` or ``value(v)`` compared with ``n``: the value to fill ``v`` with.
        scalar: variables read as ``float(value(v))`` (a scalar first).
        dtypes: ``dtype(v) == f32``.
        dim_mod: ``dim(v, i) % k == 0``, keyed by ``(v, i)``.
        dim_below: ``dim(v, i) < k`` (``<= k`` is ``< k + 1``).
        dim_equal: ``dim(v, i) == n``.
        attr_values: an attribute variable and the values the guard compares it to (``ks == [1, 1]``).
        attr_dims: an attribute variable equal to a dim (``g == dim(x, 1)``).
        fixed: ``get(attrs, "strides", [1, 1]) == [1, 1]``: a key of an ``{attrs}`` capture the
            guard pins, keyed by ``(capture, name)``.
        shapes: ``shape(v) == [1, dim(x, 1), 1]``: each dim a number or a ``(variable, axis)``.
        same_shape: ``shape(a) == shape(b)``, both ways.
        attr_vars: the variables that capture an attribute value (``{perm = p}``).
        attr_sets: the ``{attrs}`` captures.
    """

    const: set[str] = field(default_factory=set)
    ranks: dict[str, int] = field(default_factory=dict)
    values: dict[str, float] = field(default_factory=dict)
    scalar: set[str] = field(default_factory=set)
    dtypes: dict[str, DType] = field(default_factory=dict)
    dim_mod: dict[tuple[str, int], int] = field(default_factory=dict)
    dim_below: dict[tuple[str, int], int] = field(default_factory=dict)
    dim_equal: dict[tuple[str, int], int] = field(default_factory=dict)
    attr_values: dict[str, list] = field(default_factory=dict)
    attr_dims: dict[str, tuple[str, int]] = field(default_factory=dict)
    fixed: dict[tuple[str, str], Any] = field(default_factory=dict)
    shapes: dict[str, list] = field(default_factory=dict)
    same_shape: dict[str, list[str]] = field(default_factory=dict)
    attr_vars: set[str] = field(default_factory=set)
    attr_sets: set[str] = field(default_factory=set)

    def shape_ok(self, name: str, shape: tuple[int, ...]) -> bool:
        """``shape`` breaks none of the rank and dim hints on ``name``.

        Example: with ``dim(w, 0) % 8 == 0``, ``shape_ok("w", (16, 3, 3, 3))`` is True and
        ``shape_ok("w", (3, 3, 3, 3))`` False.
        """
        if name in self.ranks and len(shape) != self.ranks[name]:
            return False
        for table, holds in ((self.dim_mod, lambda d, k: d % k == 0), (self.dim_below, lambda d, k: d < k),
                             (self.dim_equal, lambda d, k: d == k)):
            for (var, axis), k in table.items():
                if var == name and -len(shape) <= axis < len(shape) and not holds(shape[axis], k):
                    return False
        return True

    def template(self, name: str, known: Callable[[str], tuple[int, ...] | None],
                 seen: tuple[str, ...] = ()) -> tuple[int, ...] | None:
        """The shape the guard gives ``name`` in terms of known shapes (``known(v)`` is the
        shape of variable ``v`` or None), or None.

        Example: with ``shape(s) == [1, dim(x, 1), 1, 1, dim(x, 4)]`` and ``x: [2, 2, 7, 5, 8]``,
        ``template("s", known) == (1, 2, 1, 1, 8)``.
        """
        if name in seen:
            return None
        dims = []
        for item in self.shapes.get(name, ()):
            if isinstance(item, int):
                dims.append(item)
                continue
            shape = known(item[0])
            if shape is None or not -len(shape) <= item[1] < len(shape):
                break
            dims.append(shape[item[1]])
        else:
            if name in self.shapes:
                return tuple(dims)
        for other in self.same_shape.get(name, ()):
            if known(other) is not None:
                return known(other)
        for other in self.same_shape.get(name, ()):  # shape(s2) == shape(s1), s1 sized by the guard
            if other != name and other in self.shapes:
                found = self.template(other, known, (*seen, name))
                if found is not None:
                    return found
        return None

    def adjust(self, name: str, shape: tuple[int, ...]) -> tuple[int, ...]:
        """``shape`` with the dims that the hints on ``name`` pin set to fitting values: a
        multiple of ``k`` for ``% k == 0`` (``k`` itself or twice it), 3 (or 1) for ``< k``,
        ``n`` for ``== n``.

        Example: with ``dim(x, 1) % 8 == 0``, ``adjust("x", (2, 3, 7, 5)) == (2, 8, 7, 5)``.
        """
        dims = list(shape)
        for (var, axis), k in self.dim_mod.items():
            if var == name and -len(dims) <= axis < len(dims) and dims[axis] % k:
                dims[axis] = k * (2 if dims[axis] > k else 1)
        for (var, axis), k in self.dim_below.items():
            if var == name and -len(dims) <= axis < len(dims) and dims[axis] >= k:
                dims[axis] = 3 if k > 3 else 1
        for (var, axis), n in self.dim_equal.items():
            if var == name and -len(dims) <= axis < len(dims):
                dims[axis] = n
        return tuple(dims)


def subexprs(e: Expr | None, skip_not: bool = False) -> Iterator[Expr]:
    """``e`` and all its subexpressions (not those under ``not`` when ``skip_not``)."""
    if e is None or (skip_not and isinstance(e, EUnary) and e.op == "not"):
        return
    yield e
    if isinstance(e, EBinary):
        yield from subexprs(e.left, skip_not)
        yield from subexprs(e.right, skip_not)
    elif isinstance(e, EUnary):
        yield from subexprs(e.operand, skip_not)
    elif isinstance(e, EList):
        for item in e.items:
            yield from subexprs(item, skip_not)
    elif isinstance(e, EIndex):
        for index in e.index if isinstance(e.index, tuple) else (e.index,):
            yield from subexprs(index, skip_not)
        yield from subexprs(e.base, skip_not)
    elif isinstance(e, ECall):
        for arg in (*e.args, *(v for _, v in e.kwargs)):
            yield from subexprs(arg, skip_not)


class _NotLiteral(Exception):
    pass


def literal(e: Expr) -> Any:
    """The Python value of a literal expression (``2``, ``-1``, ``0.5``, ``"x"``, ``[1, 1]``);
    raises ValueError for anything else.

    Example: ``literal(EList((ELit(1), ELit(1))))`` -> ``[1, 1]``.
    """
    try:
        return _literal(e)
    except _NotLiteral:
        raise ValueError("not a literal") from None


def _literal(e: Expr) -> Any:
    if isinstance(e, ELit) and not (isinstance(e.value, str) and e.value in DTYPE_NAMES):
        return e.value
    if isinstance(e, EUnary) and e.op == "-":
        inner = _literal(e.operand)
        if isinstance(inner, int | float) and not isinstance(inner, bool):
            return -inner
    if isinstance(e, EList):
        return [_literal(item) for item in e.items]
    raise _NotLiteral


def _number(e: Expr) -> float | None:
    try:
        value = literal(e)
    except ValueError:
        return None
    return value if isinstance(value, int | float) and not isinstance(value, bool) else None


def _var_in_call(e: Expr, func: str) -> str | None:
    """``v`` when ``e`` is ``func(v)`` (also through ``float(...)``/``int(...)``)."""
    if isinstance(e, ECall) and e.func in ("float", "int") and len(e.args) == 1:
        return _var_in_call(e.args[0], func)
    if isinstance(e, ECall) and e.func == func and len(e.args) == 1 and isinstance(e.args[0], EVar):
        return e.args[0].name
    return None


def _dim_of(e: Expr) -> tuple[str, int] | None:
    """``(v, i)`` when ``e`` is ``dim(v, i)`` with a literal ``i``."""
    if isinstance(e, ECall) and e.func == "dim" and len(e.args) == 2 and isinstance(e.args[0], EVar):
        i = _number(e.args[1])
        if isinstance(i, int):
            return e.args[0].name, i
    return None


def pattern_nodes(rule: Rule) -> Iterator[POp]:
    """Every op pattern of the rule's roots, outermost first."""
    stack = list(reversed(rule.roots))
    while stack:
        p = stack.pop()
        if isinstance(p, POp):
            yield p
            stack.extend(reversed(p.args))


def rule_hints(rule: Rule) -> Hints:
    """Read the rule's guard for hints on its instances (see :class:`Hints`).

    Example: ``where const(c) and all_equal(c, 1)`` -> ``const={"c"}, values={"c": 1}``.
    """
    hints = Hints()
    for p in pattern_nodes(rule):
        hints.attr_vars |= {a.var for a in p.attrs if a.var}
        if p.attrs_rest:
            hints.attr_sets.add(p.attrs_rest)
    for e in subexprs(rule.guard, skip_not=True):
        if isinstance(e, ECall) and e.func == "const":
            hints.const |= {a.name for a in e.args if isinstance(a, EVar)}
        elif isinstance(e, ECall) and e.func == "all_equal" and len(e.args) == 2 and isinstance(e.args[0], EVar):
            number = _number(e.args[1])
            if number is not None:
                hints.values[e.args[0].name] = number
        elif isinstance(e, EBinary) and e.op in (*_COMPARISONS, "-", "+"):
            for side, other in ((e.left, e.right), (e.right, e.left)):
                _compare_hint(hints, e.op, side, other)
    expressions = [rule.guard, *(let.value for let in rule.lets), *rule.results]
    for e in (sub for top in expressions for sub in subexprs(top)):
        if isinstance(e, ECall) and e.func in ("float", "int") and e.args:
            var = _var_in_call(e.args[0], "value")
            if var is not None:
                hints.scalar.add(var)
    return hints


def _compare_hint(hints: Hints, op: str, side: Expr, other: Expr) -> None:
    number = _number(other)
    value_var = _var_in_call(side, "value")
    if value_var is not None and number is not None:
        hints.values[value_var] = number
        hints.scalar.add(value_var)
    rank_var = _var_in_call(side, "rank")
    if op == "==" and rank_var is not None and number is not None:
        hints.ranks[rank_var] = int(number)
    dtype_var = _var_in_call(side, "dtype")
    if op == "==" and dtype_var is not None and isinstance(other, EVar) and other.name in DTYPE_NAMES:
        hints.dtypes.setdefault(dtype_var, DTYPE_NAMES[other.name])
    dim = _dim_of(side)
    if dim is not None and isinstance(number, int):
        if op == "==":
            hints.dim_equal[dim] = number
        elif op in ("<", "<="):
            hints.dim_below[dim] = number + (op == "<=")
    if op == "==" and isinstance(side, EBinary) and side.op == "%" and number == 0:
        dim, k = _dim_of(side.left), _number(side.right)
        if dim is not None and isinstance(k, int) and k > 0:
            hints.dim_mod[dim] = k
    if op == "==" and isinstance(side, EVar) and side.name in hints.attr_vars:
        try:
            value = literal(other)
        except ValueError:
            value = None
        if value is not None:
            known = hints.attr_values.setdefault(side.name, [])
            if value not in known:
                known.append(value)
        elif _dim_of(other) is not None:
            hints.attr_dims[side.name] = _dim_of(other)
    shape_var = _var_in_call(side, "shape")
    if op == "==" and shape_var is not None:
        other_var = _var_in_call(other, "shape")
        if other_var is not None:
            hints.same_shape.setdefault(shape_var, []).append(other_var)
        elif isinstance(other, EList):
            items = []
            for item in other.items:
                number, dim = _number(item), _dim_of(item)
                if isinstance(number, int):
                    items.append(number)
                elif dim is not None:
                    items.append(dim)
                else:
                    break
            else:
                hints.shapes[shape_var] = items
    if op == "==" and isinstance(side, ECall) and side.func == "get" and len(side.args) == 3 \
            and isinstance(side.args[0], EVar) and isinstance(side.args[1], ELit):
        try:
            hints.fixed[(side.args[0].name, str(side.args[1].value))] = literal(other)
        except ValueError:
            pass

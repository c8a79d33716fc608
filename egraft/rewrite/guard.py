r"""A rule's guard compiled once into nested Python closures, one per syntax node.

Matching calls a guard for every match it finds (``ew_mul_bodies`` on t5_encoder_int8:
half a million times), and walking the syntax tree for each call, dispatching on the node's
class, was most of the saturation's time. A compiled guard computes the same values as
:meth:`Evaluator.eval` with ``build`` off, with the same errors: tensor arithmetic, ``fold``
and op calls raise :class:`GuardFailed` when reached, so the guard refuses the match.

``len(xs)`` of a bound variable counts the bound list (or string) as it is, without making
handles of its e-classes first.

Example:
    >>> from egraft.rewrite.parser import parse_rules
    >>> text = "rule r:\n    Concat(xs...) {axis = k} where len(xs) <= 3 and k > 0\n    => xs[0]\n"
    >>> check = compile_guard(parse_rules(text).rules[0].guard)
    >>> check(None, {"xs": [1, 2], "k": 1}), check(None, {"xs": [1, 2, 3, 4], "k": 1})
    (True, False)
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from egraft.rewrite.ast import EBinary, ECall, EIndex, EList, ELit, EUnary, EVar
from egraft.rewrite.builtins import BUILTINS, GuardFailed, Handle
from egraft.rewrite.match import EClassId

#: ``(evaluator, substitution) -> value``
Compiled = Callable[[Any, dict], Any]

_NO_ENV: dict = {}
_MISSING = object()
_COMPILED: dict[int, tuple[object, Compiled]] = {}


def guard_function(guard) -> Compiled:
    """The compiled form of ``guard`` (a rule's guard expression), compiled on first use."""
    entry = _COMPILED.get(id(guard))
    if entry is None or entry[0] is not guard:
        entry = (guard, compile_guard(guard))
        _COMPILED[id(guard)] = entry
    return entry[1]


def compile_guard(e) -> Compiled:
    """``e`` as a function of the evaluator and the substitution (see the module docstring)."""
    if isinstance(e, ELit):
        value = e.value
        return lambda ev, s: value
    if isinstance(e, EVar):
        name = e.name

        def var(ev, s):  # an attribute's value as bound; e-classes become handles
            v = s.get(name, _MISSING)
            if v is _MISSING or isinstance(v, EClassId | list):
                return ev._value(name, s, _NO_ENV)
            return v

        return var
    if isinstance(e, EList):
        items = [compile_guard(x) for x in e.items]
        return lambda ev, s: [f(ev, s) for f in items]
    if isinstance(e, EUnary):
        return _unary(e.op, compile_guard(e.operand))
    if isinstance(e, EBinary):
        return _binary(e.op, compile_guard(e.left), compile_guard(e.right))
    if isinstance(e, EIndex):
        return _index(e)
    if isinstance(e, ECall):
        return _call(e)
    kind = type(e).__name__
    return lambda ev, s: _fail(f"cannot evaluate {kind}")


def _fail(message: str):
    raise GuardFailed(message)


def _unary(op: str, f: Compiled) -> Compiled:
    if op == "not":
        return lambda ev, s: not f(ev, s)

    def negate(ev, s):
        v = f(ev, s)
        if isinstance(v, Handle):
            raise GuardFailed("tensor arithmetic in a guard")
        return -v

    return negate


def _binary(op: str, f: Compiled, g: Compiled) -> Compiled:
    from egraft.rewrite.evaluate import _python_binary

    if op == "and":
        return lambda ev, s: bool(f(ev, s)) and bool(g(ev, s))
    if op == "or":
        return lambda ev, s: bool(f(ev, s)) or bool(g(ev, s))

    def apply(ev, s):
        a, b = f(ev, s), g(ev, s)
        if isinstance(a, Handle) or isinstance(b, Handle):
            raise GuardFailed("tensor arithmetic in a guard")
        return _python_binary(op, a, b)

    return apply


def _index(e: EIndex) -> Compiled:
    base = compile_guard(e.base)
    if isinstance(e.index, tuple):
        lo, hi = (None if x is None else compile_guard(x) for x in e.index)
        return lambda ev, s: list(base(ev, s))[None if lo is None else lo(ev, s):None if hi is None else hi(ev, s)]
    index = compile_guard(e.index)
    return lambda ev, s: base(ev, s)[index(ev, s)]


def _call(e: ECall) -> Compiled:
    builtin = BUILTINS.get(e.func)
    if builtin is None:
        message = "fold in a guard" if e.func == "fold" else f"op {e.func} in a guard"
        return lambda ev, s: _fail(message)
    if e.func == "len" and len(e.args) == 1 and isinstance(e.args[0], EVar):
        name = e.args[0].name

        def length(ev, s):  # a bound list's length is its e-classes' count: no handles needed
            v = s.get(name, _MISSING)
            return len(ev._value(name, s, _NO_ENV) if v is _MISSING else v)

        return length
    args = [compile_guard(a) for a in e.args]
    if len(args) == 1:
        (a,) = args
        return lambda ev, s: builtin(ev, a(ev, s))
    return lambda ev, s: builtin(ev, *[a(ev, s) for a in args])

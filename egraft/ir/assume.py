"""Shape assumptions (the seed's ``R.assert_shape`` / ``match_cast``): facts about symbolic
dims that the user vouches for, checked on every call.

``egraft.compile(model, assume=["seq <= 512", "height % 32 == 0", "unk__12 == seq"])``.
An assumption is ``EXPR OP EXPR`` with ``OP`` one of ``<= < >= > == !=`` over the model's
symbolic dims, integers, ``+ - * // %`` and parentheses. Two kinds are also *used*:

- ``a == EXPR`` (``a`` a dim): every type after the inputs writes ``EXPR`` for ``a``, so
  ``Max(a, b)`` with ``b == a`` is just ``a`` and the runtime-broadcast checks vanish;
- ``a % k == 0``: every type after the inputs writes ``k*a_q{k}`` for ``a``, with
  ``a_q{k} = a // k`` bound at run time: ``floor(a/k - 1/k) + 1`` becomes ``a_q{k}`` and
  kernels see exact multiples (no remainder to plan for).

The others (bounds) are checked only. A call whose dims break an assumption is refused
naming it; a typo or an unknown dim is refused when compiling.

Example:
    >>> a = parse_assumptions(["h % 32 == 0", "w <= 1024"], {"h", "w"})
    >>> [str(x) for x in a], substitutions(a)
    (['h % 32 == 0', 'w <= 1024'], {h: 32*h_q32})
    >>> check_assumptions(a, {"h": 64, "w": 640})
    {'h': 64, 'w': 640, 'h_q32': 2}
"""

from __future__ import annotations

import ast
import operator
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import sympy

from egraft.errors import InputError
from egraft.ir.dims import sym

_RELATIONS = {"<=": operator.le, "<": operator.lt, ">=": operator.ge, ">": operator.gt, "==": operator.eq,
              "!=": operator.ne}
_SPLIT = re.compile(r"^(.*?)(<=|>=|==|!=|<|>)(.*)$")
_BINARY = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.FloorDiv: operator.floordiv,
           ast.Mod: operator.mod}


@dataclass(frozen=True)
class Assumption:
    """One fact: ``left relation right`` as written (``text``) and as Python ASTs."""

    text: str
    left: ast.expr
    relation: str
    right: ast.expr

    def holds(self, bound: Mapping[str, int]) -> bool:
        """Whether the fact holds at these dims (every dim it names must be bound)."""
        return _RELATIONS[self.relation](_evaluate(self.left, bound), _evaluate(self.right, bound))

    def symbols(self) -> set[str]:
        return {n.id for side in (self.left, self.right) for n in ast.walk(side) if isinstance(n, ast.Name)}

    def __str__(self) -> str:
        return self.text


def _evaluate(node: ast.expr, bound: Mapping[str, int]) -> int:
    if isinstance(node, ast.Constant):
        return node.value
    if isinstance(node, ast.Name):
        return bound[node.id]
    if isinstance(node, ast.UnaryOp):
        return -_evaluate(node.operand, bound)
    return _BINARY[type(node.op)](_evaluate(node.left, bound), _evaluate(node.right, bound))


def _sympy(node: ast.expr) -> sympy.Expr:
    if isinstance(node, ast.Constant):
        return sympy.Integer(node.value)
    if isinstance(node, ast.Name):
        return sym(node.id)
    if isinstance(node, ast.UnaryOp):
        return -_sympy(node.operand)
    left, right = _sympy(node.left), _sympy(node.right)
    if isinstance(node.op, ast.FloorDiv):
        return sympy.floor(left / right)
    if isinstance(node.op, ast.Mod):
        return sympy.Mod(left, right)
    return _BINARY[type(node.op)](left, right)


_ALLOWED = (ast.BinOp, ast.UnaryOp, ast.Name, ast.Constant, ast.Load, ast.USub, *_BINARY)


def _check_expression(node: ast.expr, text: str, known: set[str]) -> None:
    for n in ast.walk(node):
        if not isinstance(n, _ALLOWED):
            raise InputError(f"assumption {text!r}: only dims, integers, + - * // % and parentheses may appear")
        if isinstance(n, ast.Name) and n.id not in known:
            raise InputError(f"assumption {text!r}: the model has no symbolic dim {n.id!r}; its symbolic dims "
                             f"are {sorted(known) or 'none'}")
        if isinstance(n, ast.Constant) and type(n.value) is not int:
            raise InputError(f"assumption {text!r}: {n.value!r} is not an integer")


def parse_assumptions(texts: Iterable[str], known: Iterable[str]) -> list[Assumption]:
    """The assumptions ``texts`` over the dims ``known``; :class:`InputError` naming the
    first one that does not parse or names an unknown dim."""
    known = set(known)
    out = []
    for text in texts:
        text = " ".join(str(text).split())
        match = _SPLIT.match(text)
        if not match or not match.group(1).strip() or not match.group(3).strip():
            raise InputError(f"assumption {text!r}: write EXPR OP EXPR with OP one of <= < >= > == != "
                             "(e.g. 'seq <= 512', 'height % 32 == 0')")
        sides = []
        for part in (match.group(1), match.group(3)):
            try:
                node = ast.parse(part.strip(), mode="eval").body
            except SyntaxError:
                raise InputError(f"assumption {text!r}: {part.strip()!r} is not an expression of dims") from None
            _check_expression(node, text, known)
            sides.append(node)
        if not (set().union(*(_names(s) for s in sides))):
            raise InputError(f"assumption {text!r} names no symbolic dim")
        out.append(Assumption(text, sides[0], match.group(2), sides[1]))
    return out


def _names(node: ast.expr) -> set[str]:
    return {n.id for n in ast.walk(node) if isinstance(n, ast.Name)}


def assume_graph(graph, assumptions: Iterable[Assumption]):
    """A copy of ``graph`` whose nodes see the used assumptions (:func:`substitutions`) in
    their input types and are re-typed by the op registry; the graph's inputs keep their
    declared types (a call binds their dims as given, then :func:`check_assumptions`).

    Example: with ``h % 32 == 0``, ``MaxPool(x: f32[1, 3, h, w]) {strides = [32, 32],
    kernel_shape = [32, 32]}`` gives ``f32[1, 3, h_q32, floor(w/32)]``.
    """
    from egraft.ir.graph import Graph, Node
    from egraft.ir.infer import FreshDims, infer_node

    subs = substitutions(assumptions)
    if not subs:
        return graph
    out = Graph(graph.name, list(graph.inputs), [], [], constants=graph.constants, opsets=dict(graph.opsets),
                doc=graph.doc)
    renamed = {}
    for v in graph.inputs:
        shape = v.type.shape
        if shape is not None:
            shape = [d if isinstance(d, int) else d.xreplace(subs) for d in shape]
        renamed[v.name] = v.replace(type=v.type.with_shape(shape))
    fresh = FreshDims("_a")
    for node in graph.nodes:
        inputs = tuple(None if v is None else renamed.get(v.name, v) for v in node.inputs)
        types = infer_node(out, node.replace(inputs=inputs), fresh)
        outputs = tuple(None if v is None else v.replace(type=t) for v, t in zip(node.outputs, types))
        renamed.update((v.name, v) for v in outputs if v is not None)
        out.nodes.append(Node(node.op, inputs, outputs, node.attrs, node.name, node.domain))
    out.outputs = [renamed.get(v.name, v) if v.name not in {i.name for i in graph.inputs} else v
                   for v in graph.outputs]
    return out


def quotient_symbol(name: str, k: int) -> sympy.Symbol:
    """The dim ``name // k`` of an assumption ``name % k == 0``."""
    return sym(f"{name}_q{k}")


def substitutions(assumptions: Iterable[Assumption]) -> dict[sympy.Symbol, sympy.Expr]:
    """What the used assumptions (module docstring) write for a dim, in the order given:
    ``{a: EXPR}`` for ``a == EXPR``, ``{a: k*a_qk}`` for ``a % k == 0``."""
    subs: dict[sympy.Symbol, sympy.Expr] = {}
    for a in assumptions:
        if a.relation != "==":
            continue
        left, right = _sympy(a.left), _sympy(a.right)
        if right.is_Symbol and not left.is_Symbol and not isinstance(left, sympy.Mod):
            left, right = right, left
        if isinstance(left, sympy.Mod) and left.args[0].is_Symbol and left.args[1].is_Integer and right == 0:
            name, k = left.args[0], int(left.args[1])
            if name not in subs and k > 1:
                subs[name] = k * quotient_symbol(name.name, k)
        elif left.is_Symbol and left not in subs and left not in right.free_symbols:
            subs[left] = right.xreplace(subs)
    return {k: v.xreplace(subs) if k not in v.free_symbols else v for k, v in subs.items()}


def check_assumptions(assumptions: Iterable[Assumption], bound: Mapping[str, int],
                      what: str = "from the inputs") -> dict[str, int]:
    """``bound`` plus the quotient dims (``a_qk``) of divisibility assumptions; :class:`InputError`
    naming the first assumption the dims break (assumptions over unbound dims are skipped)."""
    out = dict(bound)
    for a in assumptions:
        names = a.symbols()
        if not names <= out.keys():
            continue
        if not a.holds(out):
            dims = ", ".join(f"{n}={out[n]}" for n in sorted(names))
            raise InputError(f"{dims} ({what}) breaks the assumption {a.text!r} the model was compiled with")
        left = _sympy(a.left)
        if a.relation == "==" and isinstance(left, sympy.Mod) and left.args[0].is_Symbol and left.args[1].is_Integer:
            k = int(left.args[1])
            if k > 1:
                out[quotient_symbol(left.args[0].name, k).name] = out[left.args[0].name] // k
    return out


__all__ = ["Assumption", "assume_graph", "parse_assumptions", "substitutions", "check_assumptions", "quotient_symbol"]

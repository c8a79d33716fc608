"""The rule language's syntax tree: what the parser (``egraft/rewrite/parser.py``) builds
from a ``.rules`` file and what the matcher, the engine and the soundness checker read.

Data only: frozen dataclasses, no behaviour. Every node carries its source location so
that load-time checks (unknown op, unbound variable) can name ``file:line:col``.

A rule, as written::

    # x * 1 -> x
    rule mul_by_one:
        Mul(x, c) where const(c) and all_equal(c, 1)
        => x

parses to ``Rule(name="mul_by_one", roots=(POp("Mul", (PVar("x"), PVar("c"))),),
guard=EBinary("and", ...), lets=(), results=(EVar("x"),))``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Loc:
    """A source position: file path (or "<string>"), 1-based line and column."""

    file: str
    line: int
    col: int

    def __str__(self) -> str:
        return f"{self.file}:{self.line}:{self.col}"


# ---- patterns (left-hand side) ---------------------------------------------------------
@dataclass(frozen=True)
class PVar:
    """A variable: binds the e-class (tensor) at this position. The same name twice must
    bind the same e-class. ``_`` is a wildcard (``PVar("_")``) that binds nothing."""

    name: str
    loc: Loc


@dataclass(frozen=True)
class AttrPat:
    """One attribute in a pattern: ``name = literal`` must equal (with the op's default
    when the node does not set it); ``name = var`` captures the value into ``var``."""

    name: str
    literal: Any = None  # int, float, str, list; None when `var` is set
    var: str | None = None
    loc: Loc | None = None


@dataclass(frozen=True)
class POp:
    """An op application pattern: ``Conv(x, w, b) {group = 1, attrs}``.

    Attributes:
        op: the op name (ONNX spelling), or ``None`` for ``*`` (any op).
        args: the input patterns, in order. ``_`` matches an omitted optional input too.
        rest: ``xs...`` after the args captures the remaining inputs as a list variable.
        attrs: attribute constraints and captures.
        attrs_rest: ``{..., attrs}``: a name that captures all the node's set attributes
            not constrained by ``attrs`` (used to copy them into the replacement).
        bind: ``p = Conv(...)`` names the matched node's e-class ``p``.
        output: for a multi-output op, which output the pattern stands for
            (``TopK(x, k)[1]``); 0 by default.
        domain: the op's domain, "" for standard ONNX (``com.egraft::FusedConv(...)``).
        loc: where the pattern starts.
    """

    op: str | None
    args: tuple[Pattern, ...]
    loc: Loc
    rest: str | None = None
    attrs: tuple[AttrPat, ...] = ()
    attrs_rest: str | None = None
    bind: str | None = None
    output: int = 0
    domain: str = ""


Pattern = PVar | POp


# ---- expressions (guards and right-hand sides) -----------------------------------------
@dataclass(frozen=True)
class ELit:
    """A literal: int, float, string, bool or a dtype name such as ``f32``."""

    value: Any
    loc: Loc


@dataclass(frozen=True)
class EVar:
    """A variable bound by the pattern or by an earlier ``let`` in the replacement."""

    name: str
    loc: Loc


@dataclass(frozen=True)
class EList:
    """``[a, b, c]``."""

    items: tuple[Expr, ...]
    loc: Loc


@dataclass(frozen=True)
class EBinary:
    """``a op b`` with op one of ``+ - * / % == != < <= > >= and or``."""

    op: str
    left: Expr
    right: Expr
    loc: Loc


@dataclass(frozen=True)
class EUnary:
    """``-a`` or ``not a``."""

    op: str
    operand: Expr
    loc: Loc


@dataclass(frozen=True)
class EIndex:
    """``a[i]`` or ``a[lo:hi]`` (``index`` is an Expr, or a ``(lo, hi)`` pair of Expr|None)."""

    base: Expr
    index: Any
    loc: Loc


@dataclass(frozen=True)
class ECall:
    """``name(args, key = value) {attrs}``.

    In a replacement, a name that is an op builds a new node: positional ``args`` are its
    inputs; keyword arguments and the ``{...}`` block are its attributes;
    ``attrs_spread`` names captured attribute sets to copy in first (``{attrs, k = v}``).
    Otherwise (and always in guards) it is a builtin function (``const``, ``rank``,
    ``shape``, ``dim``, ``dtype``, ``fold``...).
    """

    func: str
    args: tuple[Expr, ...]
    loc: Loc
    kwargs: tuple[tuple[str, Expr], ...] = ()
    attrs_spread: tuple[str, ...] = ()
    domain: str = ""


Expr = ELit | EVar | EList | EBinary | EUnary | EIndex | ECall


# ---- rules and files -------------------------------------------------------------------
@dataclass(frozen=True)
class Let:
    """``y = expr`` or ``p, q = Split(...)`` in a replacement (several names take the
    outputs of a multi-output op in order)."""

    names: tuple[str, ...]
    value: Expr
    loc: Loc


@dataclass(frozen=True)
class Rule:
    """One named rewrite.

    Attributes:
        name: unique across all loaded files.
        ruleset: the set it belongs to (the file's ``ruleset`` line).
        roots: one pattern per root (two or more: a multi-root rule).
        guard: the ``where`` condition, or None.
        lets: the replacement's bindings, in order.
        results: one expression per root: what each matched root becomes.
        doc: the comment lines right above the rule (its algebra, e.g. ``x * 1 -> x``).
        loc: where ``rule`` is written.
    """

    name: str
    ruleset: str
    roots: tuple[POp, ...]
    guard: Expr | None
    lets: tuple[Let, ...]
    results: tuple[Expr, ...]
    loc: Loc
    doc: str = ""


@dataclass(frozen=True)
class RuleFile:
    """A parsed ``.rules`` file: its path, its rule set, its opening comment, its rules."""

    path: str
    ruleset: str
    rules: tuple[Rule, ...]
    doc: str = ""
    source_hash: str = ""

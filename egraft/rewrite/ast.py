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
    #: ``b?``: an optional operand. The loader expands a rule with optional operands into one
    #: variant per subset of them present (:func:`egraft.rewrite.load.expand_optional`); no
    #: variant the matcher sees has an optional variable left.
    optional: bool = False


@dataclass(frozen=True)
class PAbsent:
    """An operand position that must hold no input (an omitted optional input): what an absent
    ``b?`` becomes in a variant where a later operand is present."""

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


Pattern = PVar | POp | PAbsent


# ---- expressions (guards and right-hand sides) -----------------------------------------
@dataclass(frozen=True)
class ELit:
    """A literal: int, float, string, bool or a dtype name such as ``f32``."""

    value: Any
    loc: Loc


@dataclass(frozen=True)
class EVar:
    """A variable bound by the pattern or by an earlier ``let`` in the replacement. ``b?``
    (``optional``) names an optional operand: an input of a new node that is left out
    (absent) in the variants where the pattern's ``b?`` was absent."""

    name: str
    loc: Loc
    optional: bool = False


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


# ---- examples ---------------------------------------------------------------------------
@dataclass(frozen=True)
class ExampleTensor:
    """``x = f32[1, 8, 7, 7]`` in an example: a tensor of that dtype and shape, drawn at random
    (an input, or a constant where the rule's guard asks ``const(x)``)."""

    dtype: str
    shape: tuple[int, ...]
    loc: Loc


@dataclass(frozen=True)
class ExampleAttrs:
    """``attrs = {pads = [1, 1, 1, 1], strides = [2, 2]}`` in an example: the attributes an
    ``{attrs}`` capture holds (the node's other attributes keep their defaults)."""

    attrs: tuple[tuple[str, Any], ...]
    loc: Loc


@dataclass(frozen=True)
class Example:
    """An ``example:`` line under a rule: concrete values for its pattern's variables.

    ``values`` maps a variable to an :class:`ExampleTensor`, an :class:`ExampleAttrs` (an
    ``{attrs}`` capture) or a literal: for a tensor variable, a constant of that value (a float
    is an f32 scalar, an int an i64 scalar, nested lists a tensor of their shape); for an
    attribute capture (``{epsilon = eps}``), the attribute's value. ``opset`` picks the opset
    the instance is built at. An optional operand (``b?``) left out is absent. Example::

        example: x = f32[1, 8, 9, 9], w = f32[16, 8, 3, 3], b = f32[16], attrs = {strides = [2, 2]}
    """

    values: tuple[tuple[str, Any], ...]
    loc: Loc
    opset: int | None = None

    def get(self, name: str, default: Any = None) -> Any:
        """The value given for ``name``, or ``default``."""
        for k, v in self.values:
            if k == name:
                return v
        return default


# ---- templates ---------------------------------------------------------------------------
@dataclass(frozen=True)
class OpRef:
    """An op named in a template's row (``Relu``, ``com.egraft::Gelu``)."""

    op: str
    domain: str = ""


@dataclass(frozen=True)
class Template:
    """``for (op, f) in [(Relu, "relu"), (Sigmoid, "sigmoid")]`` after a rule's name: the rule
    stands for one rule per row, each name replaced by the row's item: an :class:`OpRef` where
    the name is an op (a pattern's or a replacement's), a literal where it is a value (an
    attribute, an expression). :func:`egraft.rewrite.load.expand_templates` makes the rows'
    rules, named ``rule/item`` after each row's first item."""

    names: tuple[str, ...]
    rows: tuple[tuple[Any, ...], ...]
    loc: Loc


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
        examples: the ``example:`` lines under the rule (:class:`Example`).
        template: the ``for ... in [...]`` the rule is written with, or None.
        variant_of: for a variant that :func:`egraft.rewrite.load.expand_optional` made of a
            rule with optional operands, the rule's name as written (``""`` otherwise).
    """

    name: str
    ruleset: str
    roots: tuple[POp, ...]
    guard: Expr | None
    lets: tuple[Let, ...]
    results: tuple[Expr, ...]
    loc: Loc
    doc: str = ""
    examples: tuple[Example, ...] = ()
    variant_of: str = ""
    template: Template | None = None


@dataclass(frozen=True)
class RuleFile:
    """A parsed ``.rules`` file: its path, its rule set, its opening comment, its rules."""

    path: str
    ruleset: str
    rules: tuple[Rule, ...]
    doc: str = ""
    source_hash: str = ""

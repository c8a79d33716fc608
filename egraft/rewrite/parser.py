"""The parser of egraft's rule language: ``.rules`` text -> :class:`~egraft.rewrite.ast.RuleFile`.

A lark LALR(1) grammar (below) and a transformer that builds the syntax tree of
``egraft/rewrite/ast.py``. Whitespace and newlines are not significant; ``#`` starts a
comment. The comment lines directly above a ``rule`` become its ``doc``, and the comment
paragraph that opens the file becomes the file's ``doc``. The grammar is written down in
``docs/rules.md``.

Example::

    >>> rf = parse_rules("ruleset demo\\n# x * 1 -> x\\nrule mul_by_one: Mul(x, c) where const(c) => x")
    >>> rf.rules[0].name, rf.rules[0].doc, rf.rules[0].roots[0].op
    ('mul_by_one', 'x * 1 -> x', 'Mul')

Syntax errors raise :class:`RuleError` with ``file:line:col`` and what was expected.
Semantic checks (unknown ops, unbound variables...) live in ``egraft/rewrite/load.py``.
"""

from __future__ import annotations

import ast as pyast
import hashlib
import math
from dataclasses import replace
from functools import cache
from pathlib import Path
from typing import Any

from lark import Lark, Token, Transformer, v_args
from lark.exceptions import UnexpectedCharacters, UnexpectedInput, UnexpectedToken, VisitError

from egraft.errors import EgraftError
from egraft.rewrite.ast import (
    AttrPat,
    EBinary,
    ECall,
    EIndex,
    EList,
    ELit,
    EUnary,
    EVar,
    Example,
    ExampleAttrs,
    ExampleTensor,
    Expr,
    Let,
    Loc,
    OpRef,
    POp,
    PVar,
    Rule,
    RuleFile,
    Template,
)


class RuleError(EgraftError):
    """A rule file that cannot be parsed or fails a load-time check.

    ``str(err)`` is ``"{file}:{line}:{col}: {what}; {what to do}"``; ``err.loc`` is the
    :class:`Loc` (``None`` for an error about a whole file, such as one that cannot be read).
    Re-exported by ``egraft.rewrite.load``.
    """

    def __init__(self, message: str, loc: Loc | None = None):
        self.loc = loc
        self.message = message
        super().__init__(f"{loc}: {message}" if loc is not None else message)


GRAMMAR = r"""
start: ruleset_decl? rule*
ruleset_decl: _RULESET NAME

rule: RULE NAME template? COLON roots (_WHERE expr)? _ARROW replacement example*
template: _FOR template_names _IN _LSQB template_row (_COMMA template_row)* _RSQB
template_names: NAME | _LPAR NAME (_COMMA NAME)+ _RPAR
template_row: template_item | _LPAR template_item (_COMMA template_item)+ _RPAR
template_item: NAME -> template_op
             | QNAME -> template_op
             | literal -> template_value

roots: root (_SEMI root)*
root: NAME _EQ pattern -> bound_root
    | pattern

?pattern: NAME -> pvar
        | NAME _QMARK -> pvar_optional
        | op_pattern
op_pattern: op_head _LPAR pattern_args _RPAR output? attr_pats?
op_head: NAME | QNAME | STAR
pattern_args:
            | rest
            | pattern (_COMMA pattern)* (_COMMA rest)?
rest: NAME _ELLIPSIS
output: _LSQB INT _RSQB
attr_pats: _LBRACE attr_pat (_COMMA attr_pat)* _RBRACE
attr_pat: NAME _EQ literal -> attr_literal
        | NAME _EQ NAME -> attr_var
        | NAME -> attr_rest
literal: INT -> lit_int
       | FLOAT -> lit_float
       | STRING -> lit_str
       | TRUE -> lit_true
       | FALSE -> lit_false
       | MINUS (INT | FLOAT | NAME) -> lit_neg
       | _LSQB (literal (_COMMA literal)*)? _RSQB -> lit_list

replacement: let* exprs
let: exprs _EQ expr
exprs: expr (_COMMA expr)*

?expr: or_expr
?or_expr: and_expr | or_expr OR and_expr -> binary
?and_expr: not_expr | and_expr AND not_expr -> binary
?not_expr: cmp_expr | NOT not_expr -> unary
?cmp_expr: sum | sum CMP_OP sum -> binary
?sum: product | sum (PLUS | MINUS) product -> binary
?product: unary | product (STAR | SLASH | PERCENT) unary -> binary
?unary: postfix | MINUS unary -> unary
?postfix: atom
        | postfix _LSQB expr _RSQB -> index
        | postfix _LSQB expr? COLON expr? _RSQB -> slice
?atom: INT -> int_lit
     | FLOAT -> float_lit
     | STRING -> str_lit
     | TRUE -> true_lit
     | FALSE -> false_lit
     | NAME -> var
     | NAME _QMARK -> var_optional
     | call
     | _LSQB (expr (_COMMA expr)*)? _RSQB -> list
     | _LPAR expr _RPAR
call: (NAME | QNAME) _LPAR (arg (_COMMA arg)*)? _RPAR attr_block?
arg: expr -> pos_arg
   | NAME _EQ expr -> kw_arg
attr_block: _LBRACE attr_item (_COMMA attr_item)* _RBRACE
attr_item: NAME _EQ expr -> attr_set
         | NAME -> attr_spread

example: _EXAMPLE COLON example_item (_COMMA example_item)*
example_item: NAME _EQ example_value
example_value: NAME _LSQB (INT (_COMMA INT)*)? _RSQB -> ex_tensor
             | NAME -> ex_name
             | literal -> ex_literal
             | _LBRACE (ex_attr (_COMMA ex_attr)*)? _RBRACE -> ex_attrs
ex_attr: NAME _EQ literal

RULE: "rule"
_RULESET: "ruleset"
_WHERE: "where"
_EXAMPLE: "example"
_FOR: "for"
_IN: "in"
AND: "and"
OR: "or"
NOT: "not"
TRUE: "true"
FALSE: "false"
QNAME.2: /[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*::[A-Za-z_][A-Za-z0-9_]*/
NAME: /[A-Za-z_][A-Za-z0-9_]*/
FLOAT.2: /[0-9]+\.[0-9]+([eE][+-]?[0-9]+)?|[0-9]+[eE][+-]?[0-9]+/
INT: /[0-9]+/
STRING: /"([^"\\\n]|\\.)*"/
_ARROW: "=>"
CMP_OP: "==" | "!=" | "<=" | ">=" | "<" | ">"
_EQ: "="
COLON: ":"
_SEMI: ";"
_COMMA: ","
_ELLIPSIS: "..."
_QMARK: "?"
_LPAR: "("
_RPAR: ")"
_LSQB: "["
_RSQB: "]"
_LBRACE: "{"
_RBRACE: "}"
PLUS: "+"
MINUS: "-"
STAR: "*"
SLASH: "/"
PERCENT: "%"
COMMENT: /#[^\n]*/
%import common.WS
%ignore WS
%ignore COMMENT
"""

# Names that are literals wherever an expression or an attribute value is expected.
LITERAL_NAMES: dict[str, float] = {"inf": math.inf, "nan": math.nan}

# How a terminal reads in "expected ..." (operators are summed up as "an operator").
_TERMINAL_WORDS: dict[str, str] = {
    "NAME": "a name",
    "QNAME": "a domain-qualified op name",
    "INT": "an integer",
    "FLOAT": "a number",
    "STRING": "a string",
    "RULE": "'rule'",
    "_RULESET": "'ruleset'",
    "_WHERE": "'where'",
    "_EXAMPLE": "'example'",
    "_FOR": "'for'",
    "_IN": "'in'",
    "_QMARK": "'?'",
    "TRUE": "'true'",
    "FALSE": "'false'",
    "NOT": "'not'",
    "_ARROW": "'=>'",
    "_EQ": "'='",
    "COLON": "':'",
    "_SEMI": "';'",
    "_COMMA": "','",
    "_ELLIPSIS": "'...'",
    "_LPAR": "'('",
    "_RPAR": "')'",
    "_LSQB": "'['",
    "_RSQB": "']'",
    "_LBRACE": "'{'",
    "_RBRACE": "'}'",
    "$END": "the end of the file",
}
_OPERATORS = {"AND", "OR", "CMP_OP", "PLUS", "MINUS", "STAR", "SLASH", "PERCENT"}
# The terminals an expression can start with (summed up as "an expression").
_EXPRESSION_START = {"INT", "FLOAT", "STRING", "TRUE", "FALSE", "NAME", "QNAME", "_LPAR", "_LSQB", "MINUS", "NOT"}


def parse_rules(text: str, path: str = "<string>") -> RuleFile:
    """Parse the text of a ``.rules`` file.

    Args:
        text: the file's contents.
        path: the file name used in locations; its stem is the rule set when the file
            has no ``ruleset`` line.

    Returns:
        The :class:`RuleFile`. Nothing is checked beyond syntax: call
        ``egraft.rewrite.load.check_rule_file`` for that.

    Raises:
        RuleError: ``file:line:col: unexpected ...; expected ...`` on a syntax error.

    Example::

        >>> parse_rules("rule r: Neg(Neg(x)) => x", "algebra.rules").rules[0].ruleset
        'algebra'
    """
    try:
        tree = _lark().parse(text)
    except UnexpectedInput as e:
        raise _syntax_error(e, text, path) from None
    try:
        ruleset, rules = _Build(path).transform(tree)
    except VisitError as e:
        if isinstance(e.orig_exc, RuleError):
            raise e.orig_exc from None
        raise
    ruleset = ruleset or Path(path).stem
    lines = text.splitlines()
    rules = tuple(replace(r, ruleset=ruleset, doc=_doc_above(lines, r.loc.line)) for r in rules)
    return RuleFile(path, ruleset, rules, _file_doc(lines), hashlib.sha256(text.encode()).hexdigest())


@cache
def _lark() -> Lark:
    return Lark(GRAMMAR, parser="lalr", lexer="basic", propagate_positions=True)


# ---- syntax errors ---------------------------------------------------------------------
def _syntax_error(e: UnexpectedInput, text: str, path: str) -> RuleError:
    if isinstance(e, UnexpectedCharacters):
        char = text[e.pos_in_stream] if e.pos_in_stream < len(text) else ""
        return RuleError(f"unexpected character {char!r}; a rule file holds names, numbers, \"strings\", "
                         "operators and ( ) [ ] { } , ; : = => ... (see docs/rules.md)", Loc(path, e.line, e.column))
    assert isinstance(e, UnexpectedToken)
    expected = _expected_words(e.accepts or e.expected)
    if e.token.type == "$END":  # lark places it on the last token: point just after that token
        line, col = e.token.end_line or 1, e.token.end_column or 1
        return RuleError(f"unexpected end of file; expected {expected}", Loc(path, line, col))
    what = {"NAME": "name ", "INT": "integer ", "FLOAT": "number ", "STRING": "string "}.get(e.token.type, "")
    return RuleError(f"unexpected {what}{str(e.token)!r}; expected {expected}", Loc(path, e.line, e.column))


def _expected_words(terminals: set[str]) -> str:
    """``{"_COMMA", "_RPAR"}`` -> ``"',' or ')'"``; the many terminals that can start an
    expression or be an operator read as "an expression" and "an operator"."""
    terminals = set(terminals)
    words = []
    if terminals >= _EXPRESSION_START - {"NOT"}:  # after a unary minus, 'not' cannot follow
        terminals -= _EXPRESSION_START
        words.append("an expression")
    if "FLOAT" in terminals:
        terminals.discard("INT")
    if terminals & _OPERATORS:
        terminals -= _OPERATORS
        words.append("an operator")
    words = sorted({_TERMINAL_WORDS.get(t, f"'{t.lower()}'") for t in terminals}) + words
    if len(words) == 1:
        return words[0]
    if len(words) == 2:
        return f"{words[0]} or {words[1]}"
    return "one of " + ", ".join(words[:-1]) + " or " + words[-1]


# ---- doc comments ----------------------------------------------------------------------
def _is_comment(line: str) -> bool:
    return line.lstrip().startswith("#")


def _comment_text(line: str) -> str:
    text = line.lstrip()[1:]
    return text[1:] if text.startswith(" ") else text


def _doc_above(lines: list[str], line: int) -> str:
    """The comment lines directly above 1-based ``line`` (no blank line in between)."""
    i = line - 2
    while i >= 0 and _is_comment(lines[i]):
        i -= 1
    return "\n".join(_comment_text(x) for x in lines[i + 1: line - 1])


def _file_doc(lines: list[str]) -> str:
    """The comment paragraph that opens the file, unless it sits directly on a rule."""
    start = 0
    while start < len(lines) and not lines[start].strip():
        start += 1
    end = start
    while end < len(lines) and _is_comment(lines[end]):
        end += 1
    if end < len(lines) and lines[end].split()[:1] == ["rule"]:
        return ""
    return "\n".join(_comment_text(x) for x in lines[start:end])


# ---- tree -> syntax tree ---------------------------------------------------------------
def _literal_of_name(token: Token, loc: Loc) -> Any:
    if token in LITERAL_NAMES:
        return LITERAL_NAMES[token]
    raise RuleError(f"{str(token)!r} is not a literal; write a number, a string, true, false, inf, nan "
                    "or a list", loc)


@v_args(meta=True)
class _Build(Transformer):
    """Builds the syntax tree. Every method receives lark's ``meta`` (positions) first."""

    def __init__(self, path: str):
        super().__init__()
        self.path = path

    def _loc(self, x: Any) -> Loc:
        return Loc(self.path, x.line, x.column)

    # file and rules
    def start(self, meta, children):
        ruleset = None
        if children and isinstance(children[0], str):
            ruleset, children = children[0], children[1:]
        return ruleset, children

    def ruleset_decl(self, meta, children):
        return str(children[0])

    def rule(self, meta, children):
        examples = tuple(c for c in children if isinstance(c, Example))
        template = next((c for c in children if isinstance(c, Template)), None)
        children = [c for c in children if not isinstance(c, Example | Template)]
        keyword, name, _colon, roots = children[:4]
        guard = children[4] if len(children) == 6 else None
        lets, results = children[-1]
        return Rule(str(name), "", tuple(roots), guard, lets, results, self._loc(keyword), examples=examples,
                    template=template)

    # templates
    def template(self, meta, children):
        names, rows = children[0], children[1:]
        for row in rows:
            if len(row) != len(names):
                raise RuleError(f"a row of {len(row)} item(s) for {len(names)} name(s) ({', '.join(names)}); "
                                "give each row one item per name", self._loc(meta))
        return Template(tuple(names), tuple(rows), self._loc(meta))

    def template_names(self, meta, children):
        names = [str(c) for c in children]
        for i, n in enumerate(names):
            if n in names[:i]:
                raise RuleError(f"{n!r} named twice in a rule's for; give each name once", self._loc(meta))
        return tuple(names)

    def template_row(self, meta, children):
        return tuple(children)

    def template_op(self, meta, children):
        token = children[0]
        if token.type == "QNAME":
            domain, op = str(token).split("::")
            return OpRef(op, domain)
        if token in LITERAL_NAMES:
            return LITERAL_NAMES[token]
        return OpRef(str(token))

    def template_value(self, meta, children):
        return children[0]

    # examples
    def example(self, meta, children):
        values, opset, seen = [], None, {}
        for name, value, loc in (c for c in children if not isinstance(c, Token)):  # not the ':'
            if name in seen:
                raise RuleError(f"{name!r} given twice in one example (first at {seen[name]}); give it once", loc)
            seen[name] = loc
            if name == "opset":
                if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                    raise RuleError(f"an example's opset is a positive integer, not {value!r}", loc)
                opset = value
            else:
                values.append((name, value))
        return Example(tuple(values), self._loc(meta), opset)

    def example_item(self, meta, children):
        name, value = children
        return str(name), value, self._loc(name)

    def ex_tensor(self, meta, children):
        dtype, dims = children[0], children[1:]
        return ExampleTensor(str(dtype), tuple(int(d) for d in dims), self._loc(dtype))

    def ex_name(self, meta, children):
        return _literal_of_name(children[0], self._loc(children[0]))

    def ex_literal(self, meta, children):
        return children[0]

    def ex_attrs(self, meta, children):
        return ExampleAttrs(tuple(children), self._loc(meta))

    def ex_attr(self, meta, children):
        name, value = children
        return str(name), value

    def roots(self, meta, children):
        return children

    def root(self, meta, children):
        pattern = children[0]
        if isinstance(pattern, PVar):
            raise RuleError(f"the root of a rule must be an op pattern such as Relu({pattern.name}), "
                            f"not the variable {pattern.name!r}; write the op it matches", pattern.loc)
        return pattern

    def bound_root(self, meta, children):
        name, pattern = children
        return replace(self.root(meta, [pattern]), bind=str(name))

    # patterns
    def pvar(self, meta, children):
        return PVar(str(children[0]), self._loc(children[0]))

    def pvar_optional(self, meta, children):
        name = str(children[0])
        if name == "_":
            raise RuleError("'_?' is not an optional operand; '_' already matches an input or none", self._loc(meta))
        return PVar(name, self._loc(children[0]), optional=True)

    def op_pattern(self, meta, children):
        (op, domain, loc), (args, rest) = children[0], children[1]
        output, attrs, attrs_rest = 0, (), None
        for child in children[2:]:
            if isinstance(child, int):
                output = child
            else:
                attrs, attrs_rest = child
        return POp(op, args, loc, rest, attrs, attrs_rest, None, output, domain)

    def op_head(self, meta, children):
        token = children[0]
        loc = self._loc(token)
        if token.type == "STAR":
            return None, "", loc
        if token.type == "QNAME":
            domain, op = str(token).split("::")
            return op, domain, loc
        return str(token), "", loc

    def pattern_args(self, meta, children):
        rest = None
        if children and isinstance(children[-1], str):
            rest, children = children[-1], children[:-1]
        return tuple(children), rest

    def rest(self, meta, children):
        return str(children[0])

    def output(self, meta, children):
        return int(children[0])

    def attr_pats(self, meta, children):
        attrs, rest = [], None
        for child in children:
            if isinstance(child, AttrPat):
                attrs.append(child)
            elif rest is None:
                rest = child[0]
            else:
                raise RuleError(f"a second attribute capture {child[0]!r} in one pattern (the first is "
                                f"{rest!r}); capture the remaining attributes once", child[1])
        return tuple(attrs), rest

    def attr_literal(self, meta, children):
        name, value = children
        return AttrPat(str(name), literal=value, loc=self._loc(name))

    def attr_var(self, meta, children):
        name, var = children
        if var in LITERAL_NAMES:
            return AttrPat(str(name), literal=LITERAL_NAMES[var], loc=self._loc(name))
        return AttrPat(str(name), var=str(var), loc=self._loc(name))

    def attr_rest(self, meta, children):
        return str(children[0]), self._loc(children[0])

    # literals in attribute patterns
    def lit_int(self, meta, children):
        return int(children[0])

    def lit_float(self, meta, children):
        return float(children[0])

    def lit_str(self, meta, children):
        return pyast.literal_eval(children[0])

    def lit_true(self, meta, children):
        return True

    def lit_false(self, meta, children):
        return False

    def lit_neg(self, meta, children):
        token = children[1]
        if token.type == "NAME":
            return -_literal_of_name(token, self._loc(token))
        return -(int(token) if token.type == "INT" else float(token))

    def lit_list(self, meta, children):
        return list(children)

    # replacement
    def replacement(self, meta, children):
        return tuple(children[:-1]), tuple(children[-1])

    def let(self, meta, children):
        targets, value = children
        for target in targets:
            if not isinstance(target, EVar):
                raise RuleError("a let can only bind names (y = ... or p, q = ...); "
                                "write a name left of '='", target.loc)
        return Let(tuple(t.name for t in targets), value, targets[0].loc)

    def exprs(self, meta, children):
        return children

    # expressions
    def binary(self, meta, children):
        left, op, right = children
        return EBinary(str(op), left, right, left.loc)

    def unary(self, meta, children):
        op, operand = children
        return EUnary(str(op), operand, self._loc(op))

    def index(self, meta, children):
        base, index = children
        return EIndex(base, index, base.loc)

    def slice(self, meta, children):
        base, lo, hi = children[0], None, None
        parts = children[1:]
        colon = next(i for i, p in enumerate(parts) if isinstance(p, Token) and p.type == "COLON")
        if colon == 1:
            lo = parts[0]
        if len(parts) > colon + 1:
            hi = parts[colon + 1]
        return EIndex(base, (lo, hi), base.loc)

    def int_lit(self, meta, children):
        return ELit(int(children[0]), self._loc(children[0]))

    def float_lit(self, meta, children):
        return ELit(float(children[0]), self._loc(children[0]))

    def str_lit(self, meta, children):
        return ELit(pyast.literal_eval(children[0]), self._loc(children[0]))

    def true_lit(self, meta, children):
        return ELit(True, self._loc(children[0]))

    def false_lit(self, meta, children):
        return ELit(False, self._loc(children[0]))

    def var(self, meta, children):
        token = children[0]
        if token in LITERAL_NAMES:
            return ELit(LITERAL_NAMES[token], self._loc(token))
        return EVar(str(token), self._loc(token))

    def var_optional(self, meta, children):
        return EVar(str(children[0]), self._loc(children[0]), optional=True)

    def list(self, meta, children):
        return EList(tuple(children), self._loc(meta))

    def call(self, meta, children):
        head, rest = children[0], children[1:]
        func, domain = str(head), ""
        if head.type == "QNAME":
            domain, func = func.split("::")
        args: list[Expr] = []
        kwargs: list[tuple[str, Expr]] = []
        spread: list[str] = []
        for child in rest:
            if isinstance(child, tuple) and child[0] == "kw":
                kwargs.append((child[1], child[2]))
            elif isinstance(child, list):  # the {...} block
                for kind, name, value in child:
                    if kind == "kw":
                        kwargs.append((name, value))
                    else:
                        spread.append(name)
            else:
                args.append(child)
        return ECall(func, tuple(args), self._loc(head), tuple(kwargs), tuple(spread), domain)

    def pos_arg(self, meta, children):
        return children[0]

    def kw_arg(self, meta, children):
        return "kw", str(children[0]), children[1]

    def attr_block(self, meta, children):
        return list(children)

    def attr_set(self, meta, children):
        return "kw", str(children[0]), children[1]

    def attr_spread(self, meta, children):
        return "spread", str(children[0]), None




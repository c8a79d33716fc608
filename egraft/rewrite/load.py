"""Loading rule files: read, parse, check. A rule file that loads is free of unknown ops,
unknown attributes, unbound variables and unknown functions, and its rule names are
unique across every file loaded with it.

Example::

    >>> from egraft.rewrite.load import load_rules
    >>> files = load_rules(["my.rules"])                     # doctest: +SKIP
    >>> [r.name for f in files for r in f.rules]             # doctest: +SKIP
    ['mul_by_one', ...]

Every problem is a :class:`RuleError` whose text is
``"{file}:{line}:{col}: {what}; {what to do}"``, e.g.
``my.rules:3:5: unknown op 'Rleu'; did you mean 'Relu'?``.
"""

from __future__ import annotations

import difflib
import itertools
import os
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, replace
from functools import cache, lru_cache
from pathlib import Path

from egraft.ir.registry import OpDef, all_ops, get_op
from egraft.rewrite.ast import (
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
    PAbsent,
    Pattern,
    POp,
    PVar,
    Rule,
    RuleFile,
)
from egraft.rewrite.builtins import BUILTINS
from egraft.rewrite.builtins import DTYPE_NAMES as BUILTIN_DTYPES
from egraft.rewrite.parser import LITERAL_NAMES, RuleError, parse_rules

__all__ = ["RuleError", "check_rule_file", "expand_associative", "expand_optional", "expand_templates", "load_rules",
           "shipped_rule_files", "GUARD_FUNCTIONS", "REPLACEMENT_FUNCTIONS", "DTYPE_NAMES"]

#: Functions a ``where`` clause can call (the evaluator's table).
GUARD_FUNCTIONS = frozenset(BUILTINS)
#: Functions a replacement can call (besides ops).
REPLACEMENT_FUNCTIONS = GUARD_FUNCTIONS | {"fold"}
#: Names that are constants in expressions: the dtypes (``f32``, ``i64``, ``bool``...).
DTYPE_NAMES = frozenset(BUILTIN_DTYPES)

SHIPPED_DIR = Path(__file__).resolve().parent.parent / "rules"


def shipped_rule_files() -> list[Path]:
    """The rule files that ship with egraft (``egraft/rules/*.rules``), sorted by name."""
    return sorted(SHIPPED_DIR.glob("*.rules"))


def load_rules(paths: Iterable[str | Path] | None = None, include_shipped: bool = True,
               opset: int = 21) -> list[RuleFile]:
    """Read, parse and check rule files.

    Args:
        paths: rule files (or folders of ``*.rules`` files) to load after the shipped ones.
        include_shipped: load ``egraft/rules/*.rules`` first.
        opset: the ONNX opset that attribute names are checked against.

    Returns:
        The files in load order (a file named twice is loaded once), each rule written with
        ``for``, optional operands or nested associative ops expanded into the rules it stands for
        (:func:`expand_templates`, :func:`expand_optional`, :func:`expand_associative`).

    Raises:
        RuleError: a file that cannot be read, a syntax error, a failed check, or a rule
            name used twice (the message names both places).

    Example::

        >>> [f.ruleset for f in load_rules()]    # the shipped rule sets   # doctest: +SKIP
    """
    files = list(shipped_rule_files()) if include_shipped else []
    for path in paths or ():
        path = Path(path)
        files.extend(sorted(path.glob("*.rules")) if path.is_dir() else [path])
    seen: set[Path] = set()
    loaded: list[RuleFile] = []
    defined: dict[str, Loc] = {}
    for path in files:
        if path.resolve() in seen:
            continue
        seen.add(path.resolve())
        try:
            text = path.read_text()
        except OSError as e:
            raise RuleError(f"cannot read rule file '{path}': {e.strerror or e}; check the path") from None
        rf = _checked_and_expanded(text, str(path), opset)
        for rule in rf.rules:
            if rule.name in defined:
                raise RuleError(f"duplicate rule name {rule.name!r}, first defined at {defined[rule.name]}; "
                                "rename one of them", rule.loc)
            defined[rule.name] = rule.loc
        loaded.append(rf)
    return loaded


@lru_cache(maxsize=64)
def _checked_and_expanded(text: str, name: str, opset: int) -> RuleFile:
    """A rule file's text parsed (:func:`parsed_rules`), checked and expanded, kept for the
    process (the syntax tree is immutable): checking and expanding the shipped files took
    30-70 ms of every optimize, more than all the rest of a small model's."""
    rf = parsed_rules(text, name)
    check_rule_file(rf, opset)
    return replace(rf, rules=tuple(g for r in rf.rules for t in expand_templates(r) for v in expand_optional(t)
                                   for g in expand_associative(v)))


def parsed_rules(text: str, name: str) -> RuleFile:
    """``parse_rules(text, name)``, kept in the cache folder (``rules/``, one file per rule
    file's name and text, outside the size cap: a few kilobytes each) with the digest of
    egraft's sources it was parsed by: parsing the shipped rules took half a second of every
    compile's process. A cached file from another egraft, or one that cannot be read back,
    is parsed again and replaced.

    Example::

        >>> parsed_rules("rule r: Relu(Relu(x)) -> Relu(x)", "r.rules").rules[0].name   # doctest: +SKIP
        'r'
    """
    import hashlib
    import pickle

    from egraft.kernels.cpu.llvm import cache_dir, source_digest

    sources = source_digest()
    key = hashlib.sha256((name + "\0" + text).encode()).hexdigest()[:32]
    path = cache_dir() / "rules" / f"{key}.pkl"
    try:
        digest, rf = pickle.loads(path.read_bytes())
        if digest == sources and isinstance(rf, RuleFile):
            return rf
    except Exception:  # noqa: BLE001 (missing, damaged or from another egraft: parse it again)
        pass
    rf = parse_rules(text, name)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        temporary = path.with_suffix(f".{os.getpid()}.tmp")
        temporary.write_bytes(pickle.dumps((sources, rf), protocol=pickle.HIGHEST_PROTOCOL))
        temporary.replace(path)
    except OSError:
        pass  # an unwritable cache only costs the next process the parse
    return rf


def check_rule_file(rf: RuleFile, opset: int = 21) -> None:
    """Check a parsed file; raise :class:`RuleError` at the first problem.

    Checks: ops exist (with a did-you-mean); attribute names exist for the op at
    ``opset`` (or at an earlier opset, or are an input of the op at ``opset``, which the
    engine passes as a constant input); every variable used is bound by the pattern or an
    earlier ``let``; a ``let`` does not rebind a name; functions are known (``fold`` only
    in a replacement); one result per root; the roots of a multi-root rule are named ops;
    rule names are unique within the file.

    Example::

        >>> from egraft.rewrite.parser import parse_rules
        >>> check_rule_file(parse_rules("rule r: Rleu(x) => x", "a.rules"))
        Traceback (most recent call last):
        ...
        egraft.rewrite.parser.RuleError: a.rules:1:9: unknown op 'Rleu'; did you mean 'Relu'?
    """
    names: dict[str, Loc] = {}
    for rule in rf.rules:
        if rule.name in names:
            raise RuleError(f"duplicate rule name {rule.name!r}, first defined at {names[rule.name]}; "
                            "rename one of them", rule.loc)
        names[rule.name] = rule.loc
        for each in expand_templates(rule):
            _RuleChecker(each, opset).check()


# ---- one rule --------------------------------------------------------------------------
@dataclass(frozen=True)
class _Binding:
    kind: str  # "tensor", "inputs" (xs...), "attr" ({axis = a}), "attrs" ({attrs}), "let"
    loc: Loc


_KIND_WORDS = {"tensor": "a tensor", "inputs": "an input list", "attr": "an attribute value",
               "attrs": "an attribute set", "let": "a let"}


class _RuleChecker:
    def __init__(self, rule: Rule, opset: int):
        self.rule = rule
        self.opset = opset
        self.bound: dict[str, _Binding] = {}
        #: variables the pattern writes ``b?`` (optional operands), and those it writes plainly
        self.optional: dict[str, Loc] = {}
        self.plain: dict[str, Loc] = {}
        #: the pattern's leaf variables, which an example must give
        self.leaves: dict[str, Loc] = {}

    def check(self) -> None:
        rule = self.rule
        for root in rule.roots:
            if len(rule.roots) > 1 and root.op is None:
                raise RuleError("each root of a multi-root rule must be a named op, not '*'; "
                                "write the op this root matches", root.loc)
            self._pattern(root)
        if rule.guard is not None:
            self._expr(rule.guard, GUARD_FUNCTIONS, "a where clause")
        for let in rule.lets:
            self._expr(let.value, REPLACEMENT_FUNCTIONS, "a replacement")
            for name in let.names:
                self._bind_let(name, let.loc)
        for result in rule.results:
            self._expr(result, REPLACEMENT_FUNCTIONS, "a replacement")
        for name, loc in self.optional.items():
            if name in self.plain:
                raise RuleError(f"{name!r} is an optional operand here ({name}?) but a required one at "
                                f"{self.plain[name]}; write {name}? everywhere or nowhere", loc)
        for example in rule.examples:
            self._example(example)
        if len(rule.results) != len(rule.roots):
            roots = _count(len(rule.roots), "root")
            results = _count(len(rule.results), "result")
            raise RuleError(f"rule {rule.name!r} has {roots} but {results}; "
                            "give one result per root, separated by commas", rule.results[0].loc)

    # patterns bind names
    def _bind(self, name: str, kind: str, loc: Loc) -> None:
        if name == "_":
            return
        if name in LITERAL_NAMES or name in DTYPE_NAMES:
            raise RuleError(f"{name!r} is a constant, not a variable name; choose another name", loc)
        old = self.bound.get(name)
        if old is not None and old.kind != kind:
            raise RuleError(f"{name!r} is bound as {_KIND_WORDS[kind]} here but as {_KIND_WORDS[old.kind]} "
                            f"at {old.loc}; use two names", loc)
        if old is None:
            self.bound[name] = _Binding(kind, loc)

    def _pattern(self, p: Pattern) -> None:
        if isinstance(p, PVar):
            self._bind(p.name, "tensor", p.loc)
            if p.name != "_":
                (self.optional if p.optional else self.plain).setdefault(p.name, p.loc)
                self.leaves.setdefault(p.name, p.loc)
            return
        if isinstance(p, PAbsent):
            return
        if p.op is not None:
            opdef = _resolve_op(p.op, p.domain, p.loc)
            for attr in p.attrs:
                _check_attr(opdef, attr.name, self.opset, attr.loc or p.loc)
        if p.bind is not None:
            self._bind(p.bind, "tensor", p.loc)
        for arg in p.args:
            self._pattern(arg)
        if p.rest is not None:
            self._bind(p.rest, "inputs", p.loc)
        for attr in p.attrs:
            if attr.var is not None:
                self._bind(attr.var, "attr", attr.loc or p.loc)
        if p.attrs_rest is not None:
            self._bind(p.attrs_rest, "attrs", p.loc)

    def _bind_let(self, name: str, loc: Loc) -> None:
        if name == "_":
            return
        if name in LITERAL_NAMES or name in DTYPE_NAMES:
            raise RuleError(f"{name!r} is a constant, not a variable name; choose another name", loc)
        old = self.bound.get(name)
        if old is not None:
            what = "an earlier let" if old.kind == "let" else "the pattern variable"
            raise RuleError(f"let {name!r} shadows {what} {name!r} bound at {old.loc}; choose another name", loc)
        self.bound[name] = _Binding("let", loc)

    # expressions use names
    def _expr(self, e: Expr, functions: frozenset[str], where: str) -> None:
        operands = set()  # the b? written as an op's input, where an optional operand may stand
        for sub in _walk(e):
            if isinstance(sub, ECall) and (sub.domain or get_op(sub.func, sub.domain) is not None):
                operands.update(id(a) for a in sub.args if isinstance(a, EVar) and a.optional)
        for sub in _walk(e):
            if isinstance(sub, EVar):
                self._use(sub.name, sub.loc)
                self._use_optional(sub, id(sub) in operands, where)
            elif isinstance(sub, ECall):
                self._call(sub, functions, where)

    def _use_optional(self, var: EVar, operand: bool, where: str) -> None:
        """``b?`` only as an op's input in a replacement, and only for a pattern's ``b?``; a
        pattern's ``b?`` is written ``b?`` wherever it is used."""
        name = var.name
        if var.optional:
            if name not in self.optional:
                raise RuleError(f"{name}? names an optional operand, but the pattern binds {name!r} as a required "
                                f"one; write {name} here, or {name}? in the pattern", var.loc)
            if not operand or where != "a replacement":
                raise RuleError(f"the optional operand {name}? can only be an op's input in a replacement "
                                f"(it is absent in some matches); not in {where} or a function's argument",
                                var.loc)
        elif name in self.optional and self.bound.get(name, _Binding("", var.loc)).kind == "tensor":
            raise RuleError(f"{name!r} is an optional operand (absent in some matches); write {name}? as an "
                            "op's input", var.loc)

    def _example(self, example: Example) -> None:
        """An example gives every leaf variable of the pattern but its optional operands a
        value of the variable's kind."""
        given = dict(example.values)
        for name, value in example.values:
            binding = self.bound.get(name)
            if binding is None or binding.kind == "let":
                raise RuleError(f"example: {name!r} is not a variable of the pattern; give values to "
                                f"{', '.join(sorted(self.leaves))}", example.loc)
            if binding.kind == "inputs":
                raise RuleError(f"example: {name!r} is an input list ({name}...); examples cannot give one yet",
                                example.loc)
            if isinstance(value, ExampleTensor):
                if binding.kind != "tensor":
                    raise RuleError(f"example: {name!r} is {_KIND_WORDS[binding.kind]}, not a tensor; give it "
                                    "a value", value.loc)
                if value.dtype not in DTYPE_NAMES:
                    raise RuleError(f"example: unknown dtype {value.dtype!r}; write one of "
                                    f"{', '.join(sorted(DTYPE_NAMES))}", value.loc)
            elif isinstance(value, ExampleAttrs):
                if binding.kind != "attrs":
                    raise RuleError(f"example: {name!r} is {_KIND_WORDS[binding.kind]}, not an attribute set; "
                                    "{...} gives an {attrs} capture", value.loc)
            elif binding.kind == "attrs":
                raise RuleError(f"example: {name!r} is an attribute set; give it as {{name = value, ...}}",
                                example.loc)
        missing = [n for n in self.leaves if n not in given and n not in self.optional]
        if missing:
            raise RuleError(f"example: no value for {', '.join(repr(n) for n in missing)}; give every pattern "
                            "variable but the optional ones a value (x = f32[1, 8, 7, 7])", example.loc)

    def _use(self, name: str, loc: Loc) -> None:
        if name == "_":
            raise RuleError("'_' is the wildcard; it matches without binding, so it cannot be used here; "
                            "give the matched value a name", loc)
        if name not in self.bound and name not in DTYPE_NAMES:
            raise RuleError(f"unbound variable {name!r}; bind it in the pattern or in an earlier let", loc)

    def _call(self, call: ECall, functions: frozenset[str], where: str) -> None:
        if call.func in functions and not call.domain:
            if call.kwargs or call.attrs_spread:
                raise RuleError(f"{call.func!r} is a function; it takes no keyword arguments or attributes; "
                                "pass positional arguments only", call.loc)
            return
        if call.func in REPLACEMENT_FUNCTIONS and not call.domain:
            raise RuleError(f"{call.func!r} can only be used in a replacement; remove it from {where}", call.loc)
        if where == "a where clause":
            if get_op(call.func, call.domain) is not None:
                raise RuleError(f"op {call.func!r} in a where clause; a where clause can call only "
                                f"{', '.join(sorted(functions))}", call.loc)
            raise _unknown_function(call, functions, where)
        if call.func[:1].islower() and not call.domain and get_op(call.func, call.domain) is None:
            raise _unknown_function(call, functions, where)
        opdef = _resolve_op(call.func, call.domain, call.loc)
        seen: set[str] = set()
        for name, value in call.kwargs:
            if name in seen:
                raise RuleError(f"attribute {name!r} given twice to {call.func}; give it once", value.loc)
            seen.add(name)
            _check_attr(opdef, name, self.opset, value.loc)
        for name in call.attrs_spread:
            binding = self.bound.get(name)
            if binding is None:
                raise RuleError(f"unbound attribute set {name!r}; capture it in the pattern, "
                                f"e.g. Conv(x, w) {{{name}}}", call.loc)
            if binding.kind != "attrs":
                raise RuleError(f"{name!r} is {_KIND_WORDS[binding.kind]}, not an attribute set; "
                                f"only a pattern's {{{name}}} capture can be spread into an op", call.loc)


# ---- templates ---------------------------------------------------------------------------
def _row_label(item) -> str:
    return item.op if isinstance(item, OpRef) else str(item)


class _Substitute:
    """One row of a template put into a rule: each template name becomes the row's item."""

    def __init__(self, rule: Rule, row: dict):
        self.rule = rule
        self.row = row

    def _op(self, op: str | None, domain: str, loc: Loc) -> tuple[str | None, str]:
        item = self.row.get(op) if op is not None and not domain else None
        if item is None:
            return op, domain
        if not isinstance(item, OpRef):
            raise RuleError(f"{op!r} stands for {item!r} in this row of the rule's for, not an op; "
                            "give an op name there", loc)
        return item.op, item.domain

    def _value(self, name: str, loc: Loc):
        item = self.row[name]
        if isinstance(item, OpRef):
            raise RuleError(f"{name!r} stands for the op {item.op} in this row of the rule's for; it can only "
                            f"be used as an op, {name}(...)", loc)
        return item

    def pattern(self, p: Pattern) -> Pattern:
        if isinstance(p, PVar):
            if p.name in self.row:
                raise RuleError(f"{p.name!r} is a name of the rule's for; a pattern variable needs another name",
                                p.loc)
            return p
        if not isinstance(p, POp):
            return p
        op, domain = self._op(p.op, p.domain, p.loc)
        attrs = tuple(replace(a, var=None, literal=self._value(a.var, a.loc or p.loc)) if a.var in self.row else a
                      for a in p.attrs)
        return replace(p, op=op, domain=domain, attrs=attrs, args=tuple(self.pattern(a) for a in p.args))

    def expr(self, e: Expr) -> Expr:
        if isinstance(e, EVar):
            return ELit(self._value(e.name, e.loc), e.loc) if e.name in self.row else e
        if isinstance(e, EBinary):
            return replace(e, left=self.expr(e.left), right=self.expr(e.right))
        if isinstance(e, EUnary):
            return replace(e, operand=self.expr(e.operand))
        if isinstance(e, EList):
            return replace(e, items=tuple(self.expr(x) for x in e.items))
        if isinstance(e, EIndex):
            index = (tuple(None if i is None else self.expr(i) for i in e.index) if isinstance(e.index, tuple)
                     else self.expr(e.index))
            return replace(e, base=self.expr(e.base), index=index)
        if isinstance(e, ECall):
            func, domain = self._op(e.func, e.domain, e.loc)
            return replace(e, func=func, domain=domain, args=tuple(self.expr(a) for a in e.args),
                           kwargs=tuple((k, self.expr(v)) for k, v in e.kwargs))
        return e


def expand_templates(rule: Rule) -> list[Rule]:
    """``rule`` as the rules its ``for`` stands for, one per row, named after the row's first
    item (``ew_unary/Relu``); a rule without ``for`` as itself. A name of the ``for`` is replaced
    by the row's item: an op where it stands as one (a pattern's or a replacement's op), a
    literal where it is a value (an attribute, a term of an expression).

    Example::

        >>> from egraft.rewrite.parser import parse_rules
        >>> text = "rule act for (op, a) in [(Relu, 1), (Neg, 2)]: op(Abs(x)) => op(x)"
        >>> [(r.name, r.roots[0].op) for r in expand_templates(parse_rules(text).rules[0])]
        [('act/Relu', 'Relu'), ('act/Neg', 'Neg')]
    """
    template = rule.template
    if template is None:
        return [rule]
    out, seen = [], set()
    for row in template.rows:
        label = _row_label(row[0])
        name = f"{rule.name}/{label}" if label not in seen else f"{rule.name}/{label}_{len(out)}"
        seen.add(label)
        sub = _Substitute(rule, dict(zip(template.names, row)))
        out.append(replace(
            rule, name=name, template=None, variant_of=rule.name,
            roots=tuple(sub.pattern(r) for r in rule.roots),
            guard=None if rule.guard is None else sub.expr(rule.guard),
            lets=tuple(Let(let.names, sub.expr(let.value), let.loc) for let in rule.lets),
            results=tuple(sub.expr(r) for r in rule.results)))
    return out


# ---- optional operands ------------------------------------------------------------------
def _optional_names(rule: Rule) -> list[str]:
    """The pattern's optional operands (``b?``), in order of first appearance."""
    names: list[str] = []
    stack: list = list(reversed(rule.roots))
    while stack:
        p = stack.pop()
        if isinstance(p, PVar) and p.optional and p.name not in names:
            names.append(p.name)
        elif isinstance(p, POp):
            stack.extend(reversed(p.args))
    return names


def _pattern_variant(p: Pattern, absent: frozenset[str]) -> Pattern:
    if isinstance(p, PVar):
        return replace(p, optional=False) if p.optional else p
    if not isinstance(p, POp):
        return p
    args = [PAbsent(a.loc) if isinstance(a, PVar) and a.optional and a.name in absent else _pattern_variant(a, absent)
            for a in p.args]
    while p.rest is None and args and isinstance(args[-1], PAbsent):
        args.pop()  # a trailing omitted input: the op's shorter form (which also matches an explicit Absent)
    return replace(p, args=tuple(args))


#: What an absent ``b?`` becomes in a replacement: no input at that position.
_NO_INPUT = None


def _expr_variant(e: Expr, absent: frozenset[str]) -> Expr:
    if isinstance(e, EVar):
        return replace(e, optional=False) if e.optional else e
    if isinstance(e, EBinary):
        return replace(e, left=_expr_variant(e.left, absent), right=_expr_variant(e.right, absent))
    if isinstance(e, EUnary):
        return replace(e, operand=_expr_variant(e.operand, absent))
    if isinstance(e, EList):
        return replace(e, items=tuple(_expr_variant(x, absent) for x in e.items))
    if isinstance(e, EIndex):
        index = (tuple(None if i is None else _expr_variant(i, absent) for i in e.index)
                 if isinstance(e.index, tuple) else _expr_variant(e.index, absent))
        return replace(e, base=_expr_variant(e.base, absent), index=index)
    if isinstance(e, ECall):
        args = [ELit(_NO_INPUT, a.loc) if isinstance(a, EVar) and a.optional and a.name in absent
                else _expr_variant(a, absent) for a in e.args]
        while args and isinstance(args[-1], ELit) and args[-1].value is _NO_INPUT:
            args.pop()
        return replace(e, args=tuple(args), kwargs=tuple((k, _expr_variant(v, absent)) for k, v in e.kwargs))
    return e


def expand_optional(rule: Rule) -> list[Rule]:
    """``rule`` as the rules the matcher runs: one variant per subset of its optional operands
    present. The variant with all present keeps the rule's name; another is named after what
    it lacks (``conv_relu/without_b``) and records ``variant_of``. In a variant, an absent
    operand leaves the pattern (a trailing one: the op's shorter form; an inner one: a
    position that must hold no input) and the replacement (the new op gets no input there).
    An example goes to the variant whose present operands are those it gives.

    Example::

        >>> from egraft.rewrite.parser import parse_rules
        >>> rule = parse_rules("rule r: Relu(Conv(x, w, b?)) => com.egraft::FusedConv(x, w, b?)").rules[0]
        >>> [v.name for v in expand_optional(rule)]
        ['r', 'r/without_b']
    """
    names = _optional_names(rule)
    if not names:
        return [rule]
    variants = []
    for k in range(len(names) + 1):
        for absent_names in itertools.combinations(names, k):
            absent = frozenset(absent_names)
            name = rule.name if not absent else f"{rule.name}/without_{'_'.join(absent_names)}"
            examples = tuple(x for x in rule.examples if all((x.get(n) is None) == (n in absent) for n in names))
            variants.append(replace(
                rule, name=name, variant_of=(rule.variant_of or rule.name) if absent else rule.variant_of,
                roots=tuple(_pattern_variant(r, absent) for r in rule.roots),
                lets=tuple(Let(let.names, _expr_variant(let.value, absent), let.loc) for let in rule.lets),
                results=tuple(_expr_variant(r, absent) for r in rule.results), examples=examples))
    return variants


# ---- associative ops ---------------------------------------------------------------------
#: At most this many groupings of one pattern node (and of one rule: the written one first).
MAX_GROUPINGS = 6


def _binary_of(p, op: str, domain: str) -> bool:
    """``p`` is a plain two-input node of ``op`` that a regrouping may move (no name, no
    attribute, no output index: nothing that sees the grouping)."""
    return (isinstance(p, POp) and p.op == op and p.domain == domain and p.bind is None and not p.attrs
            and p.attrs_rest is None and p.output == 0 and p.rest is None and len(p.args) == 2)


def _rotations(p: POp) -> list[POp]:
    """``p``'s regroupings at its own node: ``(x op y) op c`` -> ``x op (y op c)`` (and, the op
    being commutative too, ``y op (x op c)``), and the mirror for a nested right operand."""
    opdef = get_op(p.op, p.domain) if p.op is not None else None
    if opdef is None or not opdef.associative or p.rest is not None or len(p.args) != 2 or p.attrs \
            or p.attrs_rest is not None or p.output != 0:
        return []
    left, right = p.args
    out = []
    if _binary_of(left, p.op, p.domain):
        pairs = [left.args, left.args[::-1]] if opdef.commutative else [left.args]
        out += [replace(p, args=(x, replace(left, args=(y, right)))) for x, y in pairs]
    if _binary_of(right, p.op, p.domain):
        pairs = [right.args, right.args[::-1]] if opdef.commutative else [right.args]
        out += [replace(p, args=(replace(right, args=(left, x)), y)) for x, y in pairs]
    return out


def _structure(p) -> tuple:
    """A pattern's structure without source locations, a commutative node's two operands in one
    order (the matcher tries both): two groupings with one structure match the same."""
    if isinstance(p, PVar):
        return ("var", p.name)
    if isinstance(p, PAbsent):
        return ("absent",)
    args = tuple(_structure(a) for a in p.args)
    opdef = get_op(p.op, p.domain) if p.op is not None else None
    if opdef is not None and opdef.commutative and len(args) == 2 and p.rest is None:
        args = tuple(sorted(args, key=repr))
    return (p.op, p.domain, p.bind, p.output, p.rest, p.attrs_rest,
            tuple((a.name, repr(a.literal), a.var) for a in p.attrs), args)


def _groupings(p) -> list:
    """``p`` and its regroupings at every associative node, the written one first (at most
    :data:`MAX_GROUPINGS`)."""
    if not isinstance(p, POp):
        return [p]
    options = [_groupings(a) for a in p.args]
    frontier = [replace(p, args=tuple(c)) for c in itertools.islice(itertools.product(*options), MAX_GROUPINGS)]
    found, seen = [], set()
    while frontier and len(found) < MAX_GROUPINGS:
        q = frontier.pop(0)
        key = _structure(q)
        if key not in seen:
            seen.add(key)
            found.append(q)
            frontier.extend(_rotations(q))
    return found


def expand_associative(rule: Rule) -> list[Rule]:
    """``rule`` and the rules that match its patterns regrouped at nested nodes of an
    associative op (the op registry's ``associative``: ``Add``, ``Mul``, ``Max``, ``Min``,
    ``Sum``, ``And``, ``Or``, ``Xor``, the ``Bitwise`` ops), named ``rule/grouping1``... The
    matcher tries each commutative node in both orders, so with these a pattern of three
    operands of one op finds them however an exporter grouped them. A node that is named
    (``p = Add(...)``), has attributes or an output index is not regrouped.

    Example::

        >>> from egraft.rewrite.parser import parse_rules
        >>> rule = parse_rules("rule r: Mul(Mul(x, h), Erf(x)) => x").rules[0]
        >>> [(r.name, getattr(r.roots[0].args[0], "name", "Mul(...)")) for r in expand_associative(rule)]
        [('r', 'Mul(...)'), ('r/grouping1', 'x'), ('r/grouping2', 'h')]
    """
    options = [_groupings(r) for r in rule.roots]
    if all(len(o) == 1 for o in options):
        return [rule]
    combos = list(itertools.islice(itertools.product(*options), MAX_GROUPINGS))
    return [rule] + [replace(rule, name=f"{rule.name}/grouping{i}", variant_of=rule.variant_of or rule.name,
                             roots=tuple(roots)) for i, roots in enumerate(combos[1:], 1)]


def _walk(e: Expr) -> Iterator[Expr]:
    """``e`` and its subexpressions, in source order."""
    yield e
    if isinstance(e, EBinary):
        yield from _walk(e.left)
        yield from _walk(e.right)
    elif isinstance(e, EUnary):
        yield from _walk(e.operand)
    elif isinstance(e, EList):
        for item in e.items:
            yield from _walk(item)
    elif isinstance(e, EIndex):
        yield from _walk(e.base)
        for index in e.index if isinstance(e.index, tuple) else (e.index,):
            if index is not None:
                yield from _walk(index)
    elif isinstance(e, ECall):
        for arg in e.args:
            yield from _walk(arg)
        for _, value in e.kwargs:
            yield from _walk(value)
    else:
        assert isinstance(e, ELit | EVar), e


def _count(n: int, word: str) -> str:
    return f"{n} {word}" if n == 1 else f"{n} {word}s"


# ---- ops and attributes ----------------------------------------------------------------
def _resolve_op(name: str, domain: str, loc: Loc) -> OpDef:
    opdef = get_op(name, domain)
    if opdef is not None:
        return opdef
    qualified = f"{domain}::{name}" if domain else name
    close = difflib.get_close_matches(name, _op_names(domain), n=1)
    hint = f"did you mean {close[0]!r}?" if close else "`egraft show --ops` lists the ops egraft knows"
    raise RuleError(f"unknown op {qualified!r}; {hint}", loc)


def _unknown_function(call: ECall, functions: frozenset[str], where: str) -> RuleError:
    close = difflib.get_close_matches(call.func, sorted(functions), n=1)
    same_op = [op for op in _op_names("") if op.lower() == call.func.lower()]
    if close:
        hint = f"did you mean {close[0]!r}?"
    elif same_op and where != "a where clause":
        hint = f"did you mean the op {same_op[0]!r}?"
    else:
        hint = f"{where} can call {', '.join(sorted(functions))}"
    return RuleError(f"unknown function {call.func!r}; {hint}", call.loc)


def _check_attr(opdef: OpDef, name: str, opset: int, loc: Loc) -> None:
    accepted = _accepted_keywords(opdef.name, opdef.domain, opset) if opdef.is_standard else set(opdef.attrs)
    if accepted is None or name in accepted:
        return
    close = difflib.get_close_matches(name, sorted(accepted), n=1)
    if close:
        hint = f"did you mean {close[0]!r}?"
    else:
        current = sorted(opdef.known_attrs(opset)) if opdef.is_standard else sorted(accepted)
        hint = f"{opdef.name} takes {', '.join(current)}" if current else f"{opdef.name} takes no attributes"
    raise RuleError(f"unknown attribute {name!r} for {opdef.name} at opset {opset}; {hint}", loc)


@cache
def _accepted_keywords(op: str, domain: str, opset: int) -> frozenset[str] | None:
    """Attribute names of a standard op at ``opset`` or earlier, plus its input names at
    ``opset`` (``Unsqueeze(x, axes = [1])`` works on both sides of opset 13). ``None``
    when onnx has no schema for the op (nothing to check against)."""
    import onnx.defs

    try:
        schema = onnx.defs.get_schema(op, opset, domain)
    except onnx.defs.SchemaError:
        return None
    names = {i.name for i in schema.inputs}
    for version in range(1, opset + 1):
        try:
            names |= set(onnx.defs.get_schema(op, version, domain).attributes)
        except onnx.defs.SchemaError:
            continue
    return frozenset(names)


@cache
def _op_names(domain: str) -> tuple[str, ...]:
    import onnx.defs

    names = {op.name for op in all_ops() if op.domain == domain}
    if domain in ("", "ai.onnx", "ai.onnx.ml"):
        names |= {s.name for s in onnx.defs.get_all_schemas() if s.domain == domain}
    return tuple(sorted(names))

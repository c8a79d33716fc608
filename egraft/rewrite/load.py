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
import os
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from functools import cache
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
    Expr,
    Loc,
    Pattern,
    PVar,
    Rule,
    RuleFile,
)
from egraft.rewrite.builtins import BUILTINS
from egraft.rewrite.builtins import DTYPE_NAMES as BUILTIN_DTYPES
from egraft.rewrite.parser import LITERAL_NAMES, RuleError, parse_rules

__all__ = ["RuleError", "check_rule_file", "load_rules", "shipped_rule_files", "GUARD_FUNCTIONS",
           "REPLACEMENT_FUNCTIONS", "DTYPE_NAMES"]

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
        The files in load order (a file named twice is loaded once).

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
        rf = parsed_rules(text, str(path))
        check_rule_file(rf, opset)
        for rule in rf.rules:
            if rule.name in defined:
                raise RuleError(f"duplicate rule name {rule.name!r}, first defined at {defined[rule.name]}; "
                                "rename one of them", rule.loc)
            defined[rule.name] = rule.loc
        loaded.append(rf)
    return loaded


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
        _RuleChecker(rule, opset).check()


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
        for sub in _walk(e):
            if isinstance(sub, EVar):
                self._use(sub.name, sub.loc)
            elif isinstance(sub, ECall):
                self._call(sub, functions, where)

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

"""The rule soundness checker: does each rule's replacement compute what it replaces?

For a rule, the checker builds small concrete instances of its root pattern(s) as IR
graphs, matches and builds the rule on them exactly as :func:`egraft.rewrite.engine.saturate`
does (the same :class:`Matcher` and :class:`Evaluator`) but without the union, extracts
the matched root and the built replacement as two programs and runs both with the
reference executor on random inputs. The replacement is sound on the instance when
``max|after - before| / max|before| <= 1e-4`` on every draw.

Instances: every pattern variable becomes a graph input, or a constant when the guard
asks ``const(...)`` of it or when it sits where the op takes an integer operand
(Reshape's shape, ReduceMean's axes). Shapes come from simple families (every dim equal
to ``d`` for ``d`` in 3, 2, 4, 8, 1; a later operand's rank first that of the op's first
input, or first a vector) with the rank of each variable searched depth first. Each
candidate node is typed by the op registry (and by onnx's strict inference, for
standard ops) and run once by its kernel; a candidate that any of them refuses is
dropped. Constants take the value that the guard compares them to (``all_equal(c, 1)``,
``float(value(s)) == 2``), random values, or random positive values (variances and
epsilons). Literal attributes take their literal, captured attributes the op's default
(or, without one, an example value or none), ``{attrs}`` captures stay empty. A rule
that cannot be checked at the opset asked for is tried at opsets 13 and 11.

Example:
    >>> from egraft.rewrite.parser import parse_rules
    >>> rule = parse_rules("rule r: Relu(x) => x", "<string>").rules[0]
    >>> check_rule(rule).status
    'unsound'
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field, replace
from functools import cache
from pathlib import Path

import numpy as np
import onnx.defs

from egraft.extract.cost import NodeCount
from egraft.extract.greedy import extract_refs
from egraft.ir.dtypes import DType
from egraft.ir.graph import Graph, Node, Value, content_hash
from egraft.ir.infer import FreshDims, infer_node
from egraft.ir.registry import RunContext, get_op
from egraft.ir.types import TensorType
from egraft.rewrite.ast import EBinary, ECall, EIndex, EList, ELit, EUnary, EVar, Expr, POp, PVar, Rule
from egraft.rewrite.builtins import DTYPE_NAMES
from egraft.rewrite.egraph import EGraphState
from egraft.rewrite.evaluate import Evaluator
from egraft.rewrite.match import ROOT, Matcher
from egraft.testing.models import scale_relative_error

__all__ = ["RuleCheck", "Trial", "check_rule", "check_rules", "TOLERANCE"]

#: A replacement is sound on an instance when max|after - before| / max|before| <= this.
TOLERANCE = 1e-4
#: The dim of every axis, one family of instances per value, in this order (8 for the
#: blocked layouts' multiples of 8).
FAMILY_DIMS = (3, 2, 4, 8, 1)
#: Ranks tried for a variable with no rank in its guard, in this order.
RANKS = (4, 2, 3, 1, 0)
#: How a later operand's rank is chosen first: the rank of the op's first input (a
#: MatMul's second matrix, an Add's same-shape addend), or a vector (a Conv's bias,
#: BatchNormalization's scale, a per-channel constant). Each is a family of its own.
POLICIES = ("first", "vector")
#: The ops (and their input counts) that a ``*`` pattern is instantiated as.
ANY_OPS = (("Add", 2), ("Mul", 2), ("Neg", 1))
#: The extra inputs tried for an ``xs...`` list after named arguments.
REST_COUNTS = (1, 2, 0)
#: Older opsets tried when no instance could be checked at the one asked for (rules for
#: Split's ``split`` attribute, Unsqueeze's ``axes`` attribute...).
FALLBACK_OPSETS = (13, 11)
#: Candidate nodes typed per family before the search gives up.
MAX_STEPS = 400
#: How an instance is filled: constants with the guard's values and the rest normal random;
#: the same with positive constants and inputs; every constant normal random.
VALUE_MODES = ("signed", "positive", "random")

_INT_TYPES = frozenset(f"tensor({t})" for t in ("int8", "int16", "int32", "int64", "uint8", "uint16",
                                                 "uint32", "uint64"))
_TYPE_PREFERENCE = (("tensor(float)", DType.FLOAT32), ("tensor(int64)", DType.INT64),
                    ("tensor(int32)", DType.INT32), ("tensor(bool)", DType.BOOL),
                    ("tensor(double)", DType.FLOAT64), ("tensor(float16)", DType.FLOAT16),
                    ("tensor(uint8)", DType.UINT8), ("tensor(int8)", DType.INT8))
_COMPARISONS = ("==", "!=", "<", "<=", ">", ">=")


# ---- results -----------------------------------------------------------------------------
@dataclass(frozen=True)
class Trial:
    """One checked instance: its inputs and constants and the largest errors seen.

    Attributes:
        inputs: input name -> type text, e.g. ``{"x": "f32[3, 3, 3, 3]"}``.
        constants: constant name -> a summary of its type and values (``"f32[3] all 1"``).
        max_abs_error: max |after - before| over the draws and roots.
        max_rel_error: max |after - before| / max |before| (the project's tolerance measure).
        root: the root (0-based) where the largest relative error was seen.
        opset: the opset of the instance.
    """

    inputs: dict[str, str]
    constants: dict[str, str]
    max_abs_error: float
    max_rel_error: float
    root: int = 0
    opset: int = 18

    def describe(self) -> str:
        """One line: ``x: f32[3, 3]; c: f32[3] all 1; opset 18; abs err 0, rel err 0``."""
        parts = [f"{k}: {v}" for k, v in self.inputs.items()] + [f"{k}: {v}" for k, v in self.constants.items()]
        parts.append(f"opset {self.opset}; abs err {self.max_abs_error:.3g}, rel err {self.max_rel_error:.3g}")
        return "; ".join(parts)


@dataclass(frozen=True)
class RuleCheck:
    """The verdict on one rule.

    Attributes:
        rule: the rule's name.
        loc: where it is written (``file:line:col``).
        status: ``"sound"``, ``"unsound"`` or ``"unchecked"``.
        reason: for ``unchecked``, why no instance could be checked; for ``unsound``, what
            went wrong (errors too large, or the replacement failed to run).
        trial: the instance checked (the counterexample when unsound), or None.
        attempts: instances matched and guarded before the verdict.
    """

    rule: str
    loc: str
    status: str
    reason: str = ""
    trial: Trial | None = None
    attempts: int = 0

    @property
    def counterexample(self) -> Trial | None:
        """The instance on which the replacement differs (unsound rules only)."""
        return self.trial if self.status == "unsound" else None


# ---- what the rule's text says about its instances ------------------------------------------
@dataclass
class _Hints:
    """What the guard (and replacement) ask of each variable."""

    const: set[str] = field(default_factory=set)
    ranks: dict[str, int] = field(default_factory=dict)
    values: dict[str, float] = field(default_factory=dict)
    scalar: set[str] = field(default_factory=set)
    dtypes: dict[str, DType] = field(default_factory=dict)


def _subexprs(e: Expr | None, skip_not: bool = False) -> Iterator[Expr]:
    """``e`` and all its subexpressions (not those under ``not`` when ``skip_not``)."""
    if e is None or (skip_not and isinstance(e, EUnary) and e.op == "not"):
        return
    yield e
    if isinstance(e, EBinary):
        yield from _subexprs(e.left, skip_not)
        yield from _subexprs(e.right, skip_not)
    elif isinstance(e, EUnary):
        yield from _subexprs(e.operand, skip_not)
    elif isinstance(e, EList):
        for item in e.items:
            yield from _subexprs(item, skip_not)
    elif isinstance(e, EIndex):
        yield from _subexprs(e.base, skip_not)
        for index in e.index if isinstance(e.index, tuple) else (e.index,):
            yield from _subexprs(index, skip_not)
    elif isinstance(e, ECall):
        for arg in (*e.args, *(v for _, v in e.kwargs)):
            yield from _subexprs(arg, skip_not)


def _number(e: Expr) -> float | None:
    """The value of a numeric literal (``2``, ``-1``, ``0.5``), else None."""
    if isinstance(e, ELit) and isinstance(e.value, int | float) and not isinstance(e.value, bool):
        return e.value
    if isinstance(e, EUnary) and e.op == "-":
        inner = _number(e.operand)
        return None if inner is None else -inner
    return None


def _var_in_call(e: Expr, func: str) -> str | None:
    """``v`` when ``e`` is ``func(v)`` (also through ``float(...)``/``int(...)``)."""
    if isinstance(e, ECall) and e.func in ("float", "int") and len(e.args) == 1:
        return _var_in_call(e.args[0], func)
    if isinstance(e, ECall) and e.func == func and len(e.args) == 1 and isinstance(e.args[0], EVar):
        return e.args[0].name
    return None


def _rule_hints(rule: Rule) -> _Hints:
    """Read the guard for ``const`` (not under ``not``), ``rank(v) == n``, ``dtype(v) == t``,
    ``all_equal(v, n)`` and ``value(v)`` compared with a number; read the whole rule for
    ``float(value(v))`` (a scalar).

    Example: ``where const(c) and all_equal(c, 1)`` -> ``const={"c"}, values={"c": 1}``.
    """
    hints = _Hints()
    for e in _subexprs(rule.guard, skip_not=True):
        if isinstance(e, ECall) and e.func == "const":
            hints.const |= {a.name for a in e.args if isinstance(a, EVar)}
    for e in _subexprs(rule.guard):
        if isinstance(e, ECall) and e.func == "all_equal" and len(e.args) == 2 and isinstance(e.args[0], EVar):
            number = _number(e.args[1])
            if number is not None:
                hints.values[e.args[0].name] = number
        elif isinstance(e, EBinary) and e.op in (*_COMPARISONS, "-", "+"):
            for side, other in ((e.left, e.right), (e.right, e.left)):
                _compare_hint(hints, e.op, side, other)
    expressions = [rule.guard, *(let.value for let in rule.lets), *rule.results]
    for e in (sub for top in expressions for sub in _subexprs(top)):
        if isinstance(e, ECall) and e.func in ("float", "int") and e.args:
            var = _var_in_call(e.args[0], "value")
            if var is not None:
                hints.scalar.add(var)
    return hints


def _compare_hint(hints: _Hints, op: str, side: Expr, other: Expr) -> None:
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
        hints.dtypes[dtype_var] = DTYPE_NAMES[other.name]


# ---- what the op registry and onnx say about operands ------------------------------------------
def _schema(op: str, domain: str, opset: int):
    try:
        return onnx.defs.get_schema(op, opset, domain)
    except Exception:
        return None


@cache
def _operand_types(op: str, domain: str, opset: int, index: int) -> frozenset[str] | None:
    """The type strings onnx allows for input ``index`` of a standard op, else None."""
    schema = _schema(op, domain, opset)
    if schema is None or not schema.inputs:
        return None
    return frozenset(schema.inputs[min(index, len(schema.inputs) - 1)].types)


@cache
def _operand_optional(op: str, domain: str, opset: int, index: int) -> bool:
    """Input ``index`` of a standard op may be omitted."""
    schema = _schema(op, domain, opset)
    if schema is None or index >= len(schema.inputs):
        return False
    return schema.inputs[index].option == onnx.defs.OpSchema.FormalParameterOption.Optional


@cache
def _output_count(op: str, domain: str, opset: int, output: int) -> int:
    """Outputs to give a node whose pattern takes output ``output``: two at least for an op
    with variadic outputs (a Split into one piece is rarely what a rule means)."""
    schema = _schema(op, domain, opset)
    variadic = schema is not None and schema.outputs and \
        schema.outputs[-1].option == onnx.defs.OpSchema.FormalParameterOption.Variadic
    return max(output + 1, 2) if variadic else output + 1


@cache
def _required_attrs(op: str, domain: str, opset: int) -> tuple[tuple[str, str], ...]:
    """(name, kind) of the attributes the op requires (kind: "int", "ints", "float", ...)."""
    opdef = get_op(op, domain)
    if opdef is None:
        return ()
    if not opdef.is_standard:
        return tuple((k, a.kind) for k, a in sorted(opdef.attrs.items()) if a.default is None)
    schema = _schema(op, domain, opset)
    if schema is None:
        return ()
    return tuple((k, a.type.name.lower()) for k, a in sorted(schema.attributes.items()) if a.required)


@cache
def _attr_kind(op: str, domain: str, opset: int, name: str) -> str:
    """The kind of an attribute ("int", "ints", "string"...), "" when unknown."""
    opdef = get_op(op, domain)
    if opdef is not None and not opdef.is_standard:
        spec = opdef.attrs.get(name)
        return spec.kind if spec is not None else ""
    schema = _schema(op, domain, opset)
    attr = schema.attributes.get(name) if schema is not None else None
    return attr.type.name.lower() if attr is not None else ""


def _pick_dtype(types: frozenset[str] | None) -> DType:
    """f32 when the operand allows it, else the first of i64, i32, bool... it allows."""
    if types is None:
        return DType.FLOAT32
    for name, dtype in _TYPE_PREFERENCE:
        if name in types:
            return dtype
    return DType.FLOAT32


def _example_body(n_inputs: int) -> str:
    """An ``Elementwise`` body over ``n_inputs`` inputs: ``tanh(x0)``, ``add(x0, x1)``..."""
    if n_inputs <= 1:
        return "tanh(x0)"
    body = f"x{n_inputs - 1}"
    for i in range(n_inputs - 2, -1, -1):
        body = f"add(x{i}, {body})"
    return body


#: Example values of required attributes of egraft-only ops, from the node's input count.
EXAMPLE_ATTRS = {("com.egraft", "Elementwise", "expr"): _example_body}


def _fillers(op: str, domain: str, name: str, kind: str, inputs: Sequence[Value | None]) -> list:
    """Values for an attribute that the pattern leaves open and the op has no default
    for: Cast's ``to`` keeps the input's type; a list of ints is the identity permutation
    or the first dim in two halves (Split's ``split``); EXAMPLE_ATTRS gives the
    egraft-only ones.

    Example: ``_fillers("Transpose", "", "perm", "ints", [x])`` -> ``[[0, 1, 2, 3], [1, 2]]``
    for ``x: f32[3, 3, 3, 3]``.
    """
    example = EXAMPLE_ATTRS.get((domain, op, name))
    if example is not None:
        return [example(len(inputs))]
    first = inputs[0] if inputs and inputs[0] is not None else None
    if name == "to" and first is not None:
        return [first.type.dtype.value]
    if kind == "ints":
        if first is None or first.type.shape is None:
            return [[]]
        out = [list(range(len(first.type.shape)))]
        if first.type.shape and isinstance(first.type.shape[0], int) and first.type.shape[0] >= 2:
            n = first.type.shape[0]
            out.append([n // 2, n - n // 2])
        return out
    value = {"int": 0, "float": 1.0, "string": "", "floats": []}.get(kind)
    return [] if value is None else [value]


# ---- instances -----------------------------------------------------------------------------
@dataclass(frozen=True)
class _Var:
    """A pattern variable in an instance: an input, or a constant (``array`` fixed for
    integer operands; float constants are filled per value mode)."""

    name: str
    value: Value
    role: str  # "input" or "const"
    array: np.ndarray | None = None


@dataclass(frozen=True)
class _Draft:
    """A typed instance under construction: variables, nodes, roots, and one probe
    array per value (what the kernels computed on it)."""

    vars: dict[str, _Var] = field(default_factory=dict)
    nodes: tuple[Node, ...] = ()
    roots: tuple[Value, ...] = ()
    probes: dict[str, np.ndarray] = field(default_factory=dict)
    count: int = 0

    def add_var(self, var: _Var, probe: np.ndarray) -> _Draft:
        return replace(self, vars={**self.vars, var.name: var}, probes={**self.probes, var.name: probe},
                       count=self.count + 1)

    def add_node(self, node: Node, probes: Sequence[np.ndarray]) -> _Draft:
        new = {v.name: p for v, p in zip(node.outputs, probes) if v is not None}
        return replace(self, nodes=(*self.nodes, node), probes={**self.probes, **new}, count=self.count + 1)


@dataclass(frozen=True)
class _Site:
    """Where a variable first occurs: input ``index`` of ``op``, after ``inputs``."""

    op: str
    domain: str
    index: int
    inputs: tuple[Value | None, ...]


class _OutOfSteps(Exception):
    """The search typed MAX_STEPS candidate nodes without finishing."""


class _Instances:
    """Depth-first search for typed, runnable instances of a rule's roots.

    Example:
        >>> search = _Instances(rule, 18, _rule_hints(rule), np.random.default_rng(0))   # doctest: +SKIP
        >>> next(search.drafts(3, "first")).roots                                         # doctest: +SKIP
        (Value(name='Relu.1.0', type=f32[3, 3, 3, 3], const=None),)
    """

    def __init__(self, rule: Rule, opset: int, hints: _Hints, rng: np.random.Generator):
        self.rule = rule
        self.opset = opset
        self.hints = hints
        self.rng = rng
        self.scratch = Graph("soundness", [], [], [], opsets={"": opset})
        self.fresh = FreshDims("_s")
        self.rest_of: dict[str, str] = {}
        self.dim = 3
        self.policy = POLICIES[0]
        self.unset_first = False
        self.steps = 0
        self.refusal = ""  # why the last candidate node was dropped

    def drafts(self, dim: int, policy: str, unset_first: bool = False) -> Iterator[_Draft]:
        """Instances whose dims all equal ``dim`` (except ones the ops compute), ranks
        chosen by ``policy`` (see POLICIES), open attributes unset first or last."""
        self.dim = dim
        self.policy = policy
        self.unset_first = unset_first
        self.steps = 0
        try:
            yield from self._roots(0, _Draft())
        except _OutOfSteps:
            return

    def _roots(self, i: int, draft: _Draft) -> Iterator[_Draft]:
        if i == len(self.rule.roots):
            yield draft
            return
        for value, found in self._pattern(self.rule.roots[i], draft, None):
            yield from self._roots(i + 1, replace(found, roots=(*found.roots, value)))

    def _pattern(self, p, draft: _Draft, site: _Site | None) -> Iterator[tuple[Value | None, _Draft]]:
        if isinstance(p, PVar):
            if p.name != "_" and p.name in draft.vars:
                yield draft.vars[p.name].value, draft
                return
            if p.name == "_" and site is not None and _operand_optional(site.op, site.domain, self.opset, site.index):
                yield None, draft  # first omitted, as `_` also matches an absent input
            name = p.name if p.name != "_" else f"_.{draft.count}"
            for var, probe in self._var_candidates(name, site):
                yield var.value, draft.add_var(var, probe)
            return
        yield from self._op(p, draft)

    def _op(self, p: POp, draft: _Draft) -> Iterator[tuple[Value, _Draft]]:
        for op, domain, args in self._op_choices(p):
            for inputs, found in self._args(op, domain, args, (), draft):
                for attrs in self._attr_choices(p, op, domain, inputs):
                    result = self._node(op, domain, inputs, attrs, p.output, found)
                    if result is not None:
                        yield result

    def _op_choices(self, p: POp) -> Iterator[tuple[str, str, list]]:
        """(op, domain, argument patterns) for a pattern: ``*`` tries ANY_OPS, and an
        ``xs...`` list gets REST_COUNTS extra variables ``xs0``, ``xs1``..."""
        if p.op is None:
            choices = [(op, "", n - len(p.args)) for op, n in ANY_OPS if n >= len(p.args)]
        else:
            choices = [(p.op, p.domain, n) for n in (REST_COUNTS if p.rest else (0,))]
        for op, domain, extra in choices:
            if extra and p.rest is None:
                continue
            items = [PVar(f"{p.rest}{k}", p.loc) for k in range(extra)]
            self.rest_of.update({item.name: p.rest for item in items})
            yield op, domain, [*p.args, *items]

    def _args(self, op: str, domain: str, patterns: list, done: tuple, draft: _Draft):
        if len(done) == len(patterns):
            yield done, draft
            return
        site = _Site(op, domain, len(done), done)
        for value, found in self._pattern(patterns[len(done)], draft, site):
            yield from self._args(op, domain, patterns, (*done, value), found)

    def _attr_choices(self, p: POp, op: str, domain: str, inputs: tuple) -> Iterator[dict]:
        """Literal attributes as written; a required attribute takes each of
        :func:`_fillers`' values; a captured attribute without a default is left unset or
        takes them (unset first when ``self.unset_first``)."""
        opdef = get_op(op, domain)
        defaults = opdef.attr_defaults(self.opset) if opdef is not None else {}
        attrs: dict = {}
        open_attrs: list[tuple[str, list]] = []
        for ap in p.attrs:
            if ap.var is None:
                attrs[ap.name] = int(ap.literal) if isinstance(ap.literal, bool) else ap.literal
            elif defaults.get(ap.name) is None:
                values = _fillers(op, domain, ap.name, _attr_kind(op, domain, self.opset, ap.name), inputs)
                open_attrs.append((ap.name, [None, *values] if self.unset_first else [*values, None]))
        for name, kind in _required_attrs(op, domain, self.opset):
            if name not in attrs and name not in dict(open_attrs):
                open_attrs.append((name, _fillers(op, domain, name, kind, inputs) or [None]))
        for values in itertools.product(*(v for _, v in open_attrs)):
            chosen = {name: v for (name, _), v in zip(open_attrs, values) if v is not None}
            yield {**attrs, **chosen}

    # ---- variables ----------------------------------------------------------------------
    def _var_candidates(self, name: str, site: _Site | None) -> Iterator[tuple[_Var, np.ndarray]]:
        base = self.rest_of.get(name, name)
        types = _operand_types(site.op, site.domain, self.opset, site.index) if site else None
        dtype = self.hints.dtypes.get(base) or _pick_dtype(types)
        if types and types <= _INT_TYPES:
            for array in self._int_values(base, site, dtype):
                yield _Var(name, self._const_value(name, array), "const", array), array
            return
        role = "const" if base in self.hints.const else "input"
        for shape in self._shapes(base, site):
            probe = _random_array(self.rng, shape, dtype, positive=False)
            if role == "const":
                fill = self.hints.values.get(base)
                probe = probe if fill is None else np.full(shape, fill, dtype.numpy)
                yield _Var(name, self._const_value(name, probe), "const"), probe
            else:
                yield _Var(name, Value(name, TensorType(dtype, shape)), "input"), probe

    def _const_value(self, name: str, array: np.ndarray) -> Value:
        key = content_hash(array)
        self.scratch.constants.setdefault(key, array)
        return Value(name, TensorType.of(array), const=key)

    def _shapes(self, base: str, site: _Site | None) -> list[tuple[int, ...]]:
        """Candidate shapes: the guard's rank, else RANKS with the rank of the op's first
        input first; all dims ``self.dim``, then per-channel shapes ``[d, 1, 1]``; scalars
        first for a variable read as ``float(value(v))``."""
        d = self.dim
        if base in self.hints.ranks:
            ranks = [self.hints.ranks[base]]
        else:
            first = site.inputs[0] if site is not None and site.inputs and site.inputs[0] is not None else None
            ranks = list(RANKS)
            if first is not None and first.type.shape is not None and len(first.type.shape) in ranks:
                ranks.remove(len(first.type.shape))
                ranks.insert(0, len(first.type.shape))
                if self.policy == "vector":
                    ranks.remove(1)
                    ranks.insert(0, 1)
        shapes = [(d,) * r for r in ranks] + [(d,) + (1,) * (r - 1) for r in ranks if r >= 2]
        if base in self.hints.scalar and base not in self.hints.ranks:
            shapes = [(), (1,)] + shapes
        return list(dict.fromkeys(shapes))

    def _int_values(self, base: str, site: _Site, dtype: DType) -> list[np.ndarray]:
        """Integer operands: the guard's value, else the first input's shape (a no-op
        Reshape or Expand), its first dim in two halves (a Split), ``[0]``, ``[-1]``, ones."""
        np_type = dtype.numpy
        if base in self.hints.values:
            return [np.array([self.hints.values[base]], np_type)]
        first = site.inputs[0] if site.inputs and site.inputs[0] is not None else None
        out = []
        if first is not None and site.index > 0 and first.type.is_static:
            out.append(np.array([int(d) for d in first.type.shape], np_type))
            if first.type.shape and first.type.shape[0] >= 2:
                n = int(first.type.shape[0])
                out.append(np.array([n // 2, n - n // 2], np_type))
        out += [np.array([0], np_type), np.array([-1], np_type)]
        if first is not None and first.type.shape:
            out.append(np.ones(len(first.type.shape), np_type))
        unique = {(a.shape, a.tobytes()): a for a in out}
        return list(unique.values())

    # ---- nodes --------------------------------------------------------------------------
    def _node(self, op: str, domain: str, inputs: tuple, attrs: dict, output: int,
              draft: _Draft) -> tuple[Value, _Draft] | None:
        """Type the node with the registry (and onnx's strict inference for standard ops)
        and run its kernel on the probes; None when any of them refuses."""
        self.steps += 1
        if self.steps > MAX_STEPS:
            raise _OutOfSteps
        label = f"{op}.{self.steps}"  # unique across the whole search
        placeholder = TensorType(DType.FLOAT32, None)
        n_outputs = _output_count(op, domain, self.opset, output)
        outs = tuple(Value(f"{label}.{j}", placeholder) for j in range(n_outputs))
        node = Node(op, inputs, outs, attrs, name=label, domain=domain)
        opdef = get_op(op, domain)
        try:
            types = infer_node(self.scratch, node, self.fresh)
            if opdef.is_standard and opdef.infer is not None:
                _onnx_agrees(self.scratch, node, opdef, self.opset, self.fresh)
            if any(t is None or not t.is_static for t in types):
                raise ValueError(f"inferred {types}, not static")
            node = node.replace(outputs=tuple(Value(o.name, t) for o, t in zip(outs, types)))
            probes = _run_node(node, opdef, self.opset, [draft.probes[v.name] if v else None for v in inputs])
        except Exception as err:
            self.refusal = f"{op}: {err}".splitlines()[0][:200]
            return None
        return node.outputs[output], draft.add_node(node, probes)


def _onnx_agrees(graph: Graph, node: Node, opdef, opset: int, fresh: FreshDims) -> None:
    """Raise when onnx's strict shape inference refuses the node (a second opinion: it
    checks, e.g., that BatchNormalization's scale is a vector)."""
    from egraft.ir.infer import input_values
    from egraft.ir.onnx_fallback import onnx_infer
    from egraft.ir.registry import InferContext

    types = [v.type if v is not None else None for v in node.inputs]
    onnx_infer(InferContext(node, opdef, opset, types, input_values(graph, node), fresh, graph))


def _run_node(node: Node, opdef, opset: int, arrays: list[np.ndarray | None]) -> list[np.ndarray]:
    """The node's kernel on ``arrays``; raise when an output's shape or dtype is not the
    inferred one."""
    from egraft.ir.onnx_fallback import onnx_compute

    while arrays and arrays[-1] is None:
        arrays = arrays[:-1]
    with np.errstate(all="ignore"):
        results = list((opdef.compute or onnx_compute)(RunContext(node, opdef, opset), *arrays))
    for v, r in zip(node.outputs, results):
        r = np.asarray(r)
        if r.shape != tuple(v.type.shape) or r.dtype != v.type.dtype.numpy:
            raise ValueError(f"{node.op} gave {r.dtype}{list(r.shape)}, inferred {v.type}")
    return results


def _random_array(rng: np.random.Generator, shape, dtype: DType, positive: bool) -> np.ndarray:
    """Random values of ``dtype``: normal floats (in [0.5, 1.5] when ``positive``), small
    ints, random bools."""
    if dtype.is_float:
        data = rng.uniform(0.5, 1.5, size=shape) if positive else rng.normal(size=shape)
    elif dtype is DType.BOOL:
        data = rng.random(size=shape) < 0.5
    else:
        data = rng.integers(1 if positive else 0, 3, size=shape)
    return np.asarray(data).astype(dtype.numpy)


def _realize(draft: _Draft, mode: str, hints: _Hints, rng: np.random.Generator, opset: int,
             rest_of: dict[str, str]) -> Graph:
    """The draft as an IR graph whose float constants are filled per ``mode``."""
    graph = Graph("instance", [], [], [], opsets={"": opset})
    values: dict[str, Value] = {}
    for var in draft.vars.values():
        if var.role == "input":
            graph.inputs.append(var.value)
            values[var.name] = var.value
            continue
        array = var.array
        if array is None:
            base = rest_of.get(var.name, var.name)
            fill = hints.values.get(base) if mode != "random" else None
            dtype = var.value.type.dtype
            array = np.full(var.value.type.shape, fill, dtype.numpy) if fill is not None else \
                _random_array(rng, var.value.type.shape, dtype, positive=mode == "positive")
        values[var.name] = graph.add_constant(array, var.name)
    fresh = FreshDims("_r")
    for node in draft.nodes:
        node = node.replace(inputs=tuple(values[v.name] if v is not None else None for v in node.inputs))
        infer_node(graph, node, fresh)  # records the known values of shape arithmetic
        graph.nodes.append(node)
        values.update({v.name: v for v in node.outputs if v is not None})
    graph.outputs = [values[v.name] for v in draft.roots]
    return graph


def _feeds(graph: Graph, mode: str, rng: np.random.Generator) -> dict[str, np.ndarray]:
    return {v.name: _random_array(rng, v.type.shape, v.type.dtype, positive=mode == "positive")
            for v in graph.inputs}


def _finite(arrays) -> bool:
    return all(not np.issubdtype(a.dtype, np.inexact) or bool(np.all(np.isfinite(a))) for a in arrays)


def _describe(array: np.ndarray) -> str:
    """``f32[3] all 1``, ``i64[2] = [3, 3]`` or ``f32[3, 3] in [-1.2, 0.87]``."""
    head = str(TensorType.of(array))
    flat = array.reshape(-1)
    if flat.size == 0:
        return head
    if np.all(flat == flat[0]):
        return f"{head} all {flat[0]:.6g}"
    if flat.size <= 8 and not np.issubdtype(array.dtype, np.floating):
        return f"{head} = {flat.tolist()}"
    return f"{head} in [{float(flat.min()):.3g}, {float(flat.max()):.3g}]"


# ---- one instance through the engine -------------------------------------------------------------
@dataclass
class _Outcome:
    """What one instance showed: a verdict, or why it could not give one."""

    status: str  # "sound", "unsound", "no match", "guard", "build", "nonfinite"
    detail: str = ""
    trial: Trial | None = None
    attempt: bool = True  # the instance went through the matcher (counts against `trials`)


def _check_instance(rule: Rule, graph: Graph, feeds: list[dict], opset: int) -> _Outcome:
    """Match and build ``rule`` on ``graph`` as the engine does (no union), extract the
    root and its replacement and compare them on each of ``feeds``."""
    state = EGraphState.from_graph(graph)
    try:
        return _check_in(state, rule, graph, feeds, opset)
    finally:
        state.release()  # freed on this thread, not by the cycle collector on another


def _check_in(state: EGraphState, rule: Rule, graph: Graph, feeds: list[dict], opset: int) -> _Outcome:
    snapshot = state.snapshot()
    roots = [snapshot.ref_class[r] for r in state.output_refs]
    substs = Matcher(snapshot, opset).match_rule(rule, limit=64)
    # The instance's own roots first; other matches inside the instance count too.
    substs.sort(key=lambda s: [s[ROOT.format(i)] for i in range(len(rule.roots))] != roots)
    if not substs:
        return _Outcome("no match", "the pattern did not match its own instance")
    evaluator = Evaluator(state, snapshot, opset, FreshDims("_e"))
    failure = _Outcome("guard", "the guard refused the instance")
    for subst in substs:
        try:
            if not evaluator.guard(rule, subst):
                continue
        except Exception as err:
            failure = _Outcome("guard", f"the guard failed: {type(err).__name__}: {err}")
            continue
        mark = len(state.pending)
        try:
            pairs = evaluator.build(rule, subst)
        except Exception as err:  # ReplacementFailed, or an error inside a builtin
            del state.pending[mark:]
            failure = _Outcome("build", f"the replacement could not be built: {err}")
            continue
        return _compare(state, graph, pairs, feeds, opset)
    return failure


def _compare(state: EGraphState, graph: Graph, pairs: list[tuple[int, int]], feeds: list[dict],
             opset: int) -> _Outcome:
    """Extract the roots and their replacements as two programs and run both on ``feeds``."""
    state.flush()
    snapshot = state.snapshot()
    n = len(pairs)
    as_built = NodeCount()
    as_built.picks_unfolded = True  # the replacement as the rule built it (WinogradWeights before its fold)
    before = extract_refs(snapshot, [r for r, _ in pairs], [f"before{i}" for i in range(n)], cost=as_built)
    after = extract_refs(snapshot, [r for _, r in pairs], [f"after{i}" for i in range(n)], cost=as_built)
    inputs = {v.name: str(v.type) for v in graph.inputs}
    constants = {v.name: _describe(graph.constants[v.const]) for v in _named_constants(graph)}
    max_abs, max_rel, worst_root = 0.0, 0.0, 0
    checked = 0
    for feed in feeds:
        want = before.run(feed)
        if not _finite(want.values()):
            continue
        checked += 1
        try:
            got = after.run(feed)
        except Exception as err:
            trial = Trial(inputs, constants, float("inf"), float("inf"), 0, opset)
            return _Outcome("unsound", f"the replacement failed to run: {err}", trial)
        for i in range(n):
            abs_err, rel_err = _errors(got[f"after{i}"], want[f"before{i}"])
            max_abs = max(max_abs, abs_err)
            if rel_err > max_rel:
                max_rel, worst_root = rel_err, i
    if not checked:
        return _Outcome("nonfinite", "the matched root computes inf or nan on every draw")
    trial = Trial(inputs, constants, max_abs, max_rel, worst_root, opset)
    if max_rel <= TOLERANCE:
        return _Outcome("sound", trial=trial)
    return _Outcome("unsound", f"relative error {max_rel:.3g} > {TOLERANCE:g}", trial)


def _named_constants(graph: Graph) -> list[Value]:
    """The constants that stand for pattern variables (named after them), once each."""
    seen: dict[str, Value] = {}
    for node in graph.nodes:
        for v in node.inputs:
            if v is not None and v.const is not None and "." not in v.name:
                seen.setdefault(v.name, v)
    return list(seen.values())


def _errors(got: np.ndarray, want: np.ndarray) -> tuple[float, float]:
    """(max abs error, max abs error / max |want|); inf for a shape mismatch, nan as inf."""
    try:
        rel = scale_relative_error(got, want)
    except AssertionError:
        return float("inf"), float("inf")
    a, b = np.asarray(got, np.float64), np.asarray(want, np.float64)
    abs_err = float(np.max(np.abs(a - b))) if b.size else 0.0
    fix = (lambda x: float("inf") if np.isnan(x) else x)
    return fix(abs_err), fix(rel)


# ---- rules -------------------------------------------------------------------------------------
def check_rule(rule: Rule, opset: int = 18, trials: int = 40, seed: int = 0, draws: int = 3) -> RuleCheck:
    """Check one rule on small random instances of its pattern.

    Args:
        rule: a parsed rule.
        opset: the ONNX opset of the instances (attribute defaults, operand inputs).
        trials: instances to match and guard at most (spread over the shape families).
        seed: the random seed of constants and inputs.
        draws: input draws per instance.

    Returns:
        A :class:`RuleCheck`: ``sound`` when the replacement matched its root on an
        instance, ``unsound`` with the counterexample, or ``unchecked`` with why.

    Example:
        >>> rule = parse_rules("rule r: Sub(a, b) => Sub(b, a)", "<string>").rules[0]   # doctest: +SKIP
        >>> check_rule(rule).counterexample.max_rel_error > 1                           # doctest: +SKIP
        True
    """
    first = _check_at(rule, opset, trials, seed, draws)
    if first.status != "unchecked":
        return first
    for older in (o for o in FALLBACK_OPSETS if o < opset):
        found = _check_at(rule, older, trials, seed, draws)
        if found.status != "unchecked":
            return found
    return first


def _check_at(rule: Rule, opset: int, trials: int, seed: int, draws: int) -> RuleCheck:
    """:func:`check_rule` at one opset."""
    rng = np.random.default_rng(seed)
    hints = _rule_hints(rule)
    search = _Instances(rule, opset, hints, rng)
    modes = VALUE_MODES if hints.values else VALUE_MODES[:2]
    retry_guard = _guard_reads_values(rule)
    families = [(dim, policy, unset) for dim in FAMILY_DIMS for policy in POLICIES
                for unset in ((False, True) if _captures_attributes(rule) else (False,))]
    per_family = max(2, -(-trials // len(families)))
    outcomes: list[_Outcome] = []
    attempts = built = 0
    for dim, policy, unset_first in families:
        used = 0
        for draft in search.drafts(dim, policy, unset_first):
            built += 1
            for outcome in _try_draft(rule, draft, search, modes, draws, rng, retry_guard):
                attempts += outcome.attempt
                used += outcome.attempt
                if outcome.status in ("sound", "unsound"):
                    return RuleCheck(rule.name, str(rule.loc), outcome.status, outcome.detail, outcome.trial,
                                     attempts)
                outcomes.append(outcome)
            if used >= per_family or attempts >= trials:
                break
        if attempts >= trials:
            break
    reason = _why(outcomes, attempts, built, search.refusal, opset)
    return RuleCheck(rule.name, str(rule.loc), "unchecked", reason, None, attempts)


def _captures_attributes(rule: Rule) -> bool:
    """A root pattern binds an attribute value (``{perm = p}``)."""
    def walk(p) -> bool:
        return isinstance(p, POp) and (any(a.var for a in p.attrs) or any(walk(a) for a in p.args))
    return any(walk(root) for root in rule.roots)


def _guard_reads_values(rule: Rule) -> bool:
    """The guard looks at constant values (so other values could satisfy it)."""
    return any(isinstance(e, ECall) and e.func in ("value", "all_equal") for e in _subexprs(rule.guard))


def _try_draft(rule: Rule, draft: _Draft, search: _Instances, modes: Sequence[str], draws: int,
               rng: np.random.Generator, retry_guard: bool) -> Iterator[_Outcome]:
    """The outcomes of one draft under each value mode, while another mode could change
    the outcome (inf or nan, or a guard that reads values); none when it cannot run."""
    for mode in modes:
        graph = _realize(draft, mode, search.hints, rng, search.opset, search.rest_of)
        feeds = [_feeds(graph, mode, rng) for _ in range(draws)]
        try:
            reference = graph.run(feeds[0])
        except Exception:
            return  # every mode fails alike: the shapes are wrong
        if not _finite(reference.values()):
            yield _Outcome("nonfinite", "the pattern computes inf or nan on every instance", attempt=False)
            continue
        outcome = _check_instance(rule, graph, feeds, search.opset)
        yield outcome
        if outcome.status != "nonfinite" and not (outcome.status == "guard" and retry_guard):
            return


def _why(outcomes: list[_Outcome], attempts: int, built: int, refusal: str, opset: int) -> str:
    """The reason a rule stayed unchecked, from the most telling outcome."""
    if not built:
        last = f" (last refusal: {refusal})" if refusal else ""
        return f"no instance of the pattern could be built at opset {opset}{last}"
    for status in ("build", "no match", "guard", "nonfinite"):
        found = [o for o in outcomes if o.status == status]
        if not found:
            continue
        if status == "guard":
            return f"no instance satisfied the guard in {attempts} attempts"
        if status == "build":
            return f"{found[-1].detail} ({len(found)} of {attempts} attempts)"
        return found[-1].detail
    return f"no instance could be run in {attempts} attempts"


def check_rules(files: Sequence[str | Path] = (), opset: int = 18, trials: int = 40,
                seed: int = 0) -> list[RuleCheck]:
    """Load rule files (the shipped library when ``files`` is empty) and check each rule.

    Example:
        >>> [c.status for c in check_rules(["mine.rules"])]      # doctest: +SKIP
        ['sound', 'unsound']
    """
    from egraft.rewrite.load import load_rules

    loaded = load_rules(list(files), include_shipped=not files)
    return [check_rule(rule, opset, trials, seed) for f in loaded for rule in f.rules]

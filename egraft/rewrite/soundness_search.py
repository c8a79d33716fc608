"""The instance search of the soundness checker (:mod:`egraft.rewrite.soundness`): small typed,
runnable IR programs that a rule's root patterns match.

A **family** gives the dims of the variables the search invents: ``distinct`` gives each axis a
different small prime (``f32[2, 3, 7, 5]``), so a rule that confuses two axes computes the
wrong thing; ``blocked`` has channels in multiples of 8 and rank-5 tensors ending in the block
8 (``f32[2, 2, 7, 5, 8]``), for the blocked-layout ops; ``equal d`` has every dim ``d``
(``d`` in 3, 8, 2, 4, 1), the widest net for what the others miss. An operand after the
first takes its shape from the inputs already placed at its op (the same shape, one channel's
``[C, 1, 1]``, a vector of one of their dims, a MatMul's ``[K, N]``, a convolution's weight
``[M, C / group, k, k]``), then from the family; the ops of a pattern are placed before its
variables, so ``Add(z, Conv(...))`` gives ``z`` the convolution's shape. The guard's hints
(:mod:`egraft.rewrite.soundness_hints`) pin ranks and dims (``dim(x, 1) % 8 == 0``) and
attribute values (``ks == [1, 1]``, ``g == dim(x, 1)``).

Each candidate node is typed by the op registry (and by onnx's strict inference, for standard
ops) and run once by its kernel on probe arrays; a candidate that any of them refuses is
dropped. A found instance (a :class:`Draft`) then has **variants**: the free attributes
(:mod:`egraft.rewrite.soundness_attrs`) and integer operands take their other meaningful
values, one at a time and then a few at once (:meth:`Instances.variants`).

Example:
    >>> search = Instances(rule, 18, rule_hints(rule), np.random.default_rng(0))   # doctest: +SKIP
    >>> next(search.drafts(FAMILIES[0], "first")).roots                              # doctest: +SKIP
    (Value(name='Relu.1.0', type=f32[2, 3, 7, 5], const=None),)
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field, replace
from functools import cache
from typing import Any

import numpy as np
import onnx.defs

from egraft.ir.dtypes import DType
from egraft.ir.graph import Graph, Node, Value, content_hash
from egraft.ir.infer import FreshDims, infer_node
from egraft.ir.registry import RunContext, get_op
from egraft.ir.types import TensorType
from egraft.rewrite.ast import PAbsent, POp, PVar, Rule
from egraft.rewrite.soundness_attrs import BLOCKED_OPS, CONV_OPS, attr_values, required_values
from egraft.rewrite.soundness_hints import Hints

__all__ = ["Family", "FAMILIES", "Draft", "Var", "Instances", "Fixed", "random_array", "search_attr_names"]


# ---- families ------------------------------------------------------------------------------
@dataclass(frozen=True)
class Family:
    """The dims the search gives new variables: ``shapes[r]`` for a rank-``r`` variable with
    nothing to derive its shape from, ``fresh`` for a new dim next to derived ones (a
    convolution's output channels, a MatMul's N).

    Example: ``FAMILIES[0].shape(4) == (2, 3, 7, 5)``.
    """

    name: str
    shapes: tuple[tuple[int, ...], ...]  # by rank 0..5
    fresh: int

    def shape(self, rank: int) -> tuple[int, ...]:
        if rank < len(self.shapes):
            return self.shapes[rank]
        return self.shapes[-1] + (self.fresh,) * (rank - len(self.shapes) + 1)


def _equal(d: int) -> Family:
    return Family(f"equal {d}", tuple((d,) * r for r in range(6)), d)


#: The families, in the order the search tries them.
FAMILIES = (
    Family("distinct", ((), (5,), (3, 5), (3, 7, 5), (2, 3, 7, 5), (2, 3, 7, 5, 11)), 11),
    _equal(3),
    Family("blocked", ((), (16,), (5, 16), (16, 7, 5), (2, 16, 7, 5), (2, 2, 7, 5, 8)), 16),
    _equal(8), _equal(2), _equal(4), _equal(1),
)
#: Ranks tried for a variable with no rank in its guard and nothing to derive it from.
RANKS = (4, 2, 3, 1, 0, 5)
#: The ops (and their input counts) that a ``*`` pattern is instantiated as.
ANY_OPS = (("Add", 2), ("Mul", 2), ("Neg", 1))
#: The extra inputs tried for an ``xs...`` list after named arguments.
REST_COUNTS = (1, 2, 0)
#: Candidate nodes typed per search before it gives up.
MAX_STEPS = 300
#: Values of one open attribute the search itself tries (the variants try the rest).
SEARCH_VALUES = 4
#: Values of one slot the variants try at most.
SLOT_VALUES = 12
#: Operands that must be scalars (a Clip's bounds).
SCALAR_OPERANDS = {("", "Clip"): (1, 2)}
#: Operands that must be vectors of the first input's channels (a BatchNormalization's scale, bias,
#: mean and variance): any other shape fails, and trying them all for each would not end.
CHANNEL_OPERANDS = {("", "BatchNormalization"): (1, 2, 3, 4), ("", "InstanceNormalization"): (1, 2)}

_INT_TYPES = frozenset(f"tensor({t})" for t in ("int8", "int16", "int32", "int64", "uint8", "uint16",
                                                 "uint32", "uint64"))
_TYPE_PREFERENCE = (("tensor(float)", DType.FLOAT32), ("tensor(int64)", DType.INT64),
                    ("tensor(int32)", DType.INT32), ("tensor(bool)", DType.BOOL),
                    ("tensor(double)", DType.FLOAT64), ("tensor(float16)", DType.FLOAT16),
                    ("tensor(uint8)", DType.UINT8), ("tensor(int8)", DType.INT8))


# ---- what onnx says about operands ------------------------------------------------------------
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
def _attr_kinds(op: str, domain: str, opset: int) -> tuple[tuple[str, str, bool], ...]:
    """(name, kind, required) of each attribute of the op at ``opset``."""
    opdef = get_op(op, domain)
    if opdef is None:
        return ()
    if not opdef.is_standard:
        return tuple((k, a.kind, a.default is None) for k, a in sorted(opdef.attrs.items()))
    schema = _schema(op, domain, opset)
    if schema is None:
        return ()
    return tuple((k, a.type.name.lower(), bool(a.required)) for k, a in sorted(schema.attributes.items()))


def search_attr_names(op: str, domain: str, opset: int) -> frozenset[str] | None:
    """The attribute names of a standard op at ``opset`` (None when onnx has no schema).

    Example: ``"split" in search_attr_names("Split", "", 11)`` and not at opset 18.
    """
    schema = _schema(op, domain, opset)
    return None if schema is None else frozenset(schema.attributes)


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


def random_array(rng: np.random.Generator, shape, dtype: DType, mode: str = "signed") -> np.ndarray:
    """Random values of ``dtype`` for a value mode: ``signed`` normal floats, ``positive`` in
    [0.5, 1.5], ``wide`` normal with magnitudes spread over 1e-2..1e2, ``wide+`` those
    positive; small ints (from 1 when positive), random bools.

    Example: ``random_array(rng, (2,), DType.FLOAT32, "positive")`` -> ``array([0.77, 1.21], f32)``.
    """
    if dtype.is_float:
        if mode == "positive":
            data = rng.uniform(0.5, 1.5, size=shape)
        elif mode in ("wide", "wide+"):
            data = 10.0 ** rng.uniform(-2, 2, size=shape)
            if mode == "wide":
                data = data * rng.choice([-1.0, 1.0], size=shape)
        else:
            data = rng.normal(size=shape)
    elif dtype is DType.BOOL:
        data = rng.random(size=shape) < 0.5
    else:
        data = rng.integers(1 if mode in ("positive", "wide+") else 0, 3, size=shape)
    return np.asarray(data).astype(dtype.numpy)


# ---- instances -----------------------------------------------------------------------------
@dataclass(frozen=True)
class Var:
    """A pattern variable in an instance: an input, or a constant (``array`` fixed for
    integer operands and examples' literals; float constants are filled per value mode).
    ``choices`` lists the other integer values the variants may give it."""

    name: str
    value: Value
    role: str  # "input" or "const"
    array: np.ndarray | None = None
    choices: tuple[np.ndarray, ...] = ()


@dataclass(frozen=True)
class Draft:
    """A typed instance: variables, nodes (each with the op pattern it stands for), roots,
    one probe array per value (what the kernels computed on it), and where it came from.

    Example: ``draft.describe()`` -> ``"distinct; Transpose perm=[0, 2, 1]"``.
    """

    vars: dict[str, Var] = field(default_factory=dict)
    nodes: tuple[Node, ...] = ()
    origins: tuple[POp, ...] = ()
    roots: tuple[Value, ...] = ()
    probes: dict[str, np.ndarray] = field(default_factory=dict)
    count: int = 0
    family: str = ""
    changes: tuple[str, ...] = ()

    def add_var(self, var: Var, probe: np.ndarray) -> Draft:
        return replace(self, vars={**self.vars, var.name: var}, probes={**self.probes, var.name: probe},
                       count=self.count + 1)

    def add_node(self, node: Node, origin: POp, probes: Sequence[np.ndarray]) -> Draft:
        new = {v.name: p for v, p in zip(node.outputs, probes) if v is not None}
        return replace(self, nodes=(*self.nodes, node), origins=(*self.origins, origin),
                       probes={**self.probes, **new}, count=self.count + 1)

    def size(self) -> int:
        """Elements in the variables (how big the instance is)."""
        return sum(int(np.prod(v.value.type.shape)) for v in self.vars.values())

    def describe(self) -> str:
        """The family and the attributes the variant changed."""
        return "; ".join((self.family, *self.changes)) if self.changes else self.family


@dataclass(frozen=True)
class Fixed:
    """What an example fixes: tensor types, literal constants, attribute values, captured
    attribute sets (see :class:`egraft.rewrite.ast.Example`)."""

    types: dict[str, TensorType] = field(default_factory=dict)
    arrays: dict[str, np.ndarray] = field(default_factory=dict)
    attrs: dict[str, Any] = field(default_factory=dict)
    sets: dict[str, dict] = field(default_factory=dict)


@dataclass(frozen=True)
class _Site:
    """Where a variable first occurs: input ``index`` of ``op``, next to ``inputs`` (those
    placed so far; None where not yet placed or absent)."""

    op: str
    domain: str
    index: int
    inputs: tuple[Value | None, ...]


@dataclass(frozen=True)
class _Slot:
    """Something a variant may change: an attribute of the nodes ``nodes`` (one captured
    variable, one key of an ``{attrs}`` capture, or one attribute a node's pattern does not
    mention), or an integer constant ``var``; and the values to try."""

    label: str
    nodes: tuple[tuple[int, str], ...]  # (node index, attribute name)
    values: tuple
    var: str = ""


class _OutOfSteps(Exception):
    """The search typed MAX_STEPS candidate nodes without finishing."""


def _static(v: Value | None) -> tuple[int, ...] | None:
    if v is None or not v.type.is_static:
        return None
    return tuple(int(d) for d in v.type.shape)


class Instances:
    """Depth-first search for typed, runnable instances of a rule's roots, and their variants.

    Example:
        >>> search = Instances(rule, 18, rule_hints(rule), np.random.default_rng(0))   # doctest: +SKIP
        >>> draft = next(search.drafts(FAMILIES[0], "first"))                            # doctest: +SKIP
        >>> [d.describe() for d in search.variants(draft, 3)]                            # doctest: +SKIP
        ['distinct; perm=[0, 2, 1, 3]', 'distinct; perm=[0, 1, 3, 2]', ...]
    """

    def __init__(self, rule: Rule, opset: int, hints: Hints, rng: np.random.Generator, fixed: Fixed | None = None):
        self.rule = rule
        self.opset = opset
        self.hints = hints
        self.rng = rng
        self.fixed = fixed
        self.scratch = Graph("soundness", [], [], [], opsets={"": opset})
        self.fresh = FreshDims("_s")
        self.rest_of: dict[str, str] = {}
        self.family = FAMILIES[0]
        self.policy = "first"
        self.steps = 0
        self.refusal = ""  # why the last candidate node was dropped
        self._probes: dict[tuple, np.ndarray] = {}
        #: variables the guard gives others' shapes in terms of (``shape(s) == [1, dim(x, 1)]``)
        self.anchors = {item[0] for items in hints.shapes.values() for item in items if isinstance(item, tuple)}
        self._probe_rng = np.random.default_rng(1)

    def drafts(self, family: Family, policy: str = "first") -> Iterator[Draft]:
        """Instances of ``family``'s dims, later operands' shapes in ``policy``'s order
        (``first``: the same shape first; ``vector``: per-channel shapes first)."""
        self.family = family
        self.policy = policy
        self.steps = 0
        try:
            yield from self._roots(0, Draft(family=family.name))
        except _OutOfSteps:
            return

    def _roots(self, i: int, draft: Draft) -> Iterator[Draft]:
        if i == len(self.rule.roots):
            yield draft
            return
        for value, found in self._pattern(self.rule.roots[i], draft, None):
            yield from self._roots(i + 1, replace(found, roots=(*found.roots, value)))

    def _pattern(self, p, draft: Draft, site: _Site | None) -> Iterator[tuple[Value | None, Draft]]:
        if isinstance(p, PAbsent):
            yield None, draft
            return
        if isinstance(p, PVar):
            if p.name != "_" and p.name in draft.vars:
                yield draft.vars[p.name].value, draft
                return
            if p.name == "_" and site is not None and _operand_optional(site.op, site.domain, self.opset, site.index):
                yield None, draft  # first omitted, as `_` also matches an absent input
            name = p.name if p.name != "_" else f"_.{draft.count}"
            for var, probe in self._var_candidates(name, site, draft):
                yield var.value, draft.add_var(var, probe)
            return
        yield from self._op(p, draft)

    def _op(self, p: POp, draft: Draft) -> Iterator[tuple[Value, Draft]]:
        for op, domain, args in self._op_choices(p):
            # first what holds a variable that the guard sizes others by (shape(s) == [1, dim(x, 1)]),
            # then ops: a variable next to an op's output takes its shape from it
            order = sorted(range(len(args)), key=lambda i: (not self._holds_anchor(args[i], draft),
                                                            not isinstance(args[i], POp)))
            for inputs, found in self._args(op, domain, args, order, 0, (None,) * len(args), draft):
                for attrs in self._attr_choices(p, op, domain, inputs, found):
                    result = self._node(p, op, domain, inputs, attrs, p.output, found)
                    if result is not None:
                        yield result

    def _holds_anchor(self, p, draft: Draft) -> bool:
        """``p`` holds a variable not yet placed that the guard sizes another by."""
        if isinstance(p, PVar):
            return p.name in self.anchors and p.name not in draft.vars
        return isinstance(p, POp) and any(self._holds_anchor(a, draft) for a in p.args)

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

    def _args(self, op: str, domain: str, patterns: list, order: list[int], k: int, done: tuple, draft: Draft):
        if k == len(order):
            yield done, draft
            return
        i = order[k]
        site = _Site(op, domain, i, done)
        for value, found in self._pattern(patterns[i], draft, site):
            yield from self._args(op, domain, patterns, order, k + 1, (*done[:i], value, *done[i + 1:]), found)

    # ---- attributes -----------------------------------------------------------------------
    def _attr_choices(self, p: POp, op: str, domain: str, inputs: tuple, draft: Draft) -> Iterator[dict]:
        """Literal attributes as written; a captured one takes the guard's values, else its
        default (an example's value in an example); a required one the first values of
        :func:`required_values`; a convolution's free ``group`` follows its weight."""
        opdef = get_op(op, domain)
        defaults = opdef.attr_defaults(self.opset) if opdef is not None else {}
        attrs: dict = {}
        open_attrs: list[tuple[str, list]] = []
        kinds = {name: (kind, required) for name, kind, required in _attr_kinds(op, domain, self.opset)}
        for ap in p.attrs:
            if ap.var is None:
                attrs[ap.name] = int(ap.literal) if isinstance(ap.literal, bool) else ap.literal
            elif self.fixed is not None and ap.var in self.fixed.attrs:
                attrs[ap.name] = self.fixed.attrs[ap.var]
            elif ap.var in self.hints.attr_values:
                open_attrs.append((ap.name, list(self.hints.attr_values[ap.var])))
            elif ap.var in self.hints.attr_dims:
                var, axis = self.hints.attr_dims[ap.var]
                shape = _static(draft.vars[var].value) if var in draft.vars else None
                open_attrs.append((ap.name, [shape[axis]] if shape and -len(shape) <= axis < len(shape) else [None]))
            elif defaults.get(ap.name) is None:
                kind = kinds.get(ap.name, ("", False))[0]
                values = required_values(op, domain, ap.name, kind, inputs, EXAMPLE_ATTRS)[:SEARCH_VALUES]
                open_attrs.append((ap.name, [None, *values]))
        if p.attrs_rest and self.fixed is not None:
            attrs.update({k: v for k, v in self.fixed.sets.get(p.attrs_rest, {}).items() if k not in attrs})
        taken = set(attrs) | {name for name, _ in open_attrs}
        for name, (kind, required) in kinds.items():
            if required and name not in taken:
                values = required_values(op, domain, name, kind, inputs, EXAMPLE_ATTRS)[:SEARCH_VALUES]
                open_attrs.append((name, values or [None]))
        if op in CONV_OPS and "group" not in taken and (p.attrs_rest or self.fixed is None):
            group = _weight_group(op, inputs)
            if group not in (None, 1):
                attrs["group"] = group
        for values in itertools.product(*(v for _, v in open_attrs)):
            chosen = {name: v for (name, _), v in zip(open_attrs, values) if v is not None}
            yield {**attrs, **chosen}

    # ---- variables ----------------------------------------------------------------------
    def _var_candidates(self, name: str, site: _Site | None, draft: Draft) -> Iterator[tuple[Var, np.ndarray]]:
        base = self.rest_of.get(name, name)
        types = _operand_types(site.op, site.domain, self.opset, site.index) if site else None
        role = "const" if base in self.hints.const else "input"
        if self.fixed is not None and (name in self.fixed.arrays or name in self.fixed.types):
            if name in self.fixed.arrays:
                array = self.fixed.arrays[name]
                if array.dtype.kind == "f" and types is not None and "tensor(float)" not in types:
                    array = array.astype(_pick_dtype(types).numpy)
                yield Var(name, self._const_value(name, array), "const", array), array
                return
            ttype = self.fixed.types[name]
            probe = self._probe(ttype.shape, ttype.dtype)
            value = self._const_value(name, probe) if role == "const" else Value(name, ttype)
            yield Var(name, value, role), probe
            return
        dtype = self.hints.dtypes.get(base) or _pick_dtype(types)
        if types and types <= _INT_TYPES:
            arrays = self._int_values(base, site, dtype)
            for i, array in enumerate(arrays):
                others = tuple(a for j, a in enumerate(arrays) if j != i)
                yield Var(name, self._const_value(name, array), "const", array, others), array
            return
        for shape in self._shapes(base, site, draft):
            probe = self._probe(shape, dtype)
            if role == "const":
                fill = self.hints.values.get(base)
                probe = probe if fill is None else np.full(shape, fill, dtype.numpy)
                yield Var(name, self._const_value(name, probe), "const"), probe
            else:
                yield Var(name, Value(name, TensorType(dtype, shape)), "input"), probe

    def _probe(self, shape: tuple[int, ...], dtype: DType) -> np.ndarray:
        """Random values of a shape and dtype for the kernels to type-check on (one array per
        shape and dtype: the values only need to be valid)."""
        key = (tuple(shape), dtype)
        if key not in self._probes:
            self._probes[key] = random_array(self._probe_rng, shape, dtype)
        return self._probes[key]

    def _const_value(self, name: str, array: np.ndarray) -> Value:
        key = content_hash(array)
        self.scratch.constants.setdefault(key, array)
        return Value(name, TensorType.of(array), const=key)

    def _shapes(self, base: str, site: _Site | None, draft: Draft) -> list[tuple[int, ...]]:
        """Candidate shapes: the guard's (``shape(s) == [1, dim(x, 1), 1]``, ``shape(a) ==
        shape(b)``) when it gives one; else derived from the inputs already placed at the op
        (see :func:`_derived_shapes`), then the family's shape of each rank adjusted to the
        guard's dims; scalars first for a variable read as ``float(value(v))``; none that
        breaks the guard's rank and dim hints."""
        template = self.hints.template(base, lambda v: _static(draft.vars[v].value) if v in draft.vars else None)
        if template is not None:
            return [template]
        if site is not None and site.index in SCALAR_OPERANDS.get((site.domain, site.op), ()):
            return [()]
        first = _static(site.inputs[0]) if site is not None and site.inputs else None
        if first and len(first) >= 2 and site.index in CHANNEL_OPERANDS.get((site.domain, site.op), ()):
            return [(first[1],)]
        fam = self.family
        placed = [_static(v) for v in site.inputs] if site is not None else []
        placed = [s for s in placed if s is not None]
        shapes: list[tuple[int, ...]] = []
        if base in self.hints.scalar and base not in self.hints.ranks:
            shapes += [(), (1,)]
        if placed:
            previous = _static(site.inputs[site.index - 1]) if site.index >= 2 else None
            if previous is not None and not (site.op in CONV_OPS and site.index == 2):
                shapes.append(previous)  # BatchNormalization's scale, bias, mean, variance: alike
            shapes += _derived_shapes(site.op, site.index, placed, fam.fresh, self.policy)
        ranks = [self.hints.ranks[base]] if base in self.hints.ranks else list(RANKS)
        if placed and base not in self.hints.ranks and len(placed[0]) in ranks:
            ranks.remove(len(placed[0]))
            ranks.insert(0, len(placed[0]))
        own = [self.hints.adjust(base, fam.shape(r)) for r in ranks]
        own += [self.hints.adjust(base, (fam.shape(r)[1],) + (1,) * (r - 1)) for r in ranks if r >= 2]
        shapes += own
        return [s for s in dict.fromkeys(shapes) if self.hints.shape_ok(base, s)]

    def _int_values(self, base: str, site: _Site, dtype: DType) -> list[np.ndarray]:
        """Integer operands: the guard's value, else the first input's shape (a no-op
        Reshape or Expand) and that shape flattened from axis 1, its first dim in two
        halves (a Split), ``[1]``, ``[-1]``, ``[0]``, ``[1, 2]``, ones."""
        np_type = dtype.numpy
        if base in self.hints.values:
            return [np.array([self.hints.values[base]], np_type)]
        first = next((v for v in site.inputs if v is not None), None)
        out = []
        shape = _static(first)
        if shape is not None and site.index > 0:
            out.append(np.array(shape, np_type))
            if len(shape) >= 2:
                out.append(np.array([shape[0], -1], np_type))
            if shape and shape[0] >= 2:
                out.append(np.array([shape[0] // 2, shape[0] - shape[0] // 2], np_type))
        out += [np.array([0], np_type), np.array([-1], np_type), np.array([1], np_type)]
        if shape is not None and len(shape) >= 3:
            out.append(np.array([1, 2], np_type))
        if shape:
            out.append(np.ones(len(shape), np_type))
        unique = {(a.shape, a.tobytes()): a for a in out}
        return list(unique.values())

    # ---- nodes --------------------------------------------------------------------------
    def _node(self, p: POp, op: str, domain: str, inputs: tuple, attrs: dict, output: int,
              draft: Draft) -> tuple[Value, Draft] | None:
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
        typed = self._typed(node, draft.probes)
        if typed is None:
            return None
        node, probes = typed
        return node.outputs[output], draft.add_node(node, p, probes)

    def _typed(self, node: Node, probes: dict[str, np.ndarray]) -> tuple[Node, list[np.ndarray]] | None:
        opdef = get_op(node.op, node.domain)
        try:
            types = infer_node(self.scratch, node, self.fresh)
            if opdef.is_standard and opdef.infer is not None:
                _onnx_agrees(self.scratch, node, opdef, self.opset, self.fresh)
            if any(t is None or not t.is_static for t in types):
                raise ValueError(f"inferred {types}, not static")
            node = node.replace(outputs=tuple(Value(o.name, t) for o, t in zip(node.outputs, types)))
            out = _run_node(node, opdef, self.opset, [probes[v.name] if v else None for v in node.inputs])
        except Exception as err:
            self.refusal = f"{node.op}: {err}".splitlines()[0][:200]
            return None
        return node, out

    # ---- variants -----------------------------------------------------------------------
    def slots(self, draft: Draft) -> list[_Slot]:
        """What the variants of ``draft`` may change (see :class:`_Slot`): every free attribute
        with values to try, and every integer constant with other values."""
        groups: dict[str, list[tuple[int, str]]] = {}
        firsts: dict[str, tuple[int, str]] = {}
        for j, (node, p) in enumerate(zip(draft.nodes, draft.origins)):
            literal = {a.name for a in p.attrs if a.var is None}
            captured = {a.name: a.var for a in p.attrs if a.var is not None}
            for name, _kind, _required in _attr_kinds(node.op, node.domain, self.opset):
                if name in literal:
                    continue
                if name in captured:
                    var = captured[name]
                    if var in self.hints.attr_dims:
                        continue
                    label = var
                elif p.attrs_rest:
                    if (p.attrs_rest, name) in self.hints.fixed:
                        continue
                    label = f"{p.attrs_rest}.{name}"
                else:
                    label = f"{node.op}#{j}.{name}"
                groups.setdefault(label, []).append((j, name))
                firsts.setdefault(label, (j, name))
        slots = []
        kinds = {}
        for label, members in groups.items():
            j, name = firsts[label]
            node = draft.nodes[j]
            kinds = {n: k for n, k, _ in _attr_kinds(node.op, node.domain, self.opset)}
            values = attr_values(node.op, node.domain, name, kinds.get(name, ""), node.inputs)
            var = label if label in self.hints.attr_values else ""
            if var:
                values = [*self.hints.attr_values[var], *values]
            current = node.attrs.get(name)
            values = [v for v in _unique(values) if not _same_value(v, current)]
            if values:
                slots.append(_Slot(label, tuple(members), tuple(values)))
        for var in draft.vars.values():
            if var.choices and self.fixed is None:
                slots.append(_Slot(var.name, (), var.choices, var=var.name))
        return slots

    def variants(self, draft: Draft, limit: int) -> Iterator[Draft]:
        """Up to ``limit`` typed variants of ``draft``: first every slot at its first value at
        once (where attributes interact: keepdims and the axes), then each slot's values in
        turn (one slot changed at a time, the slots taking turns) with, after every third, a
        random change of two or three slots at once."""
        slots = []
        for slot in self.slots(draft):  # each value that types on its own
            values = tuple(v for v in slot.values[:SLOT_VALUES] if self.change(draft, [(slot, v)]) is not None)
            if values:
                slots.append(replace(slot, values=values))
        if not slots:
            return
        singles = [[(s, s.values[k])] for k in range(max(len(s.values) for s in slots)) for s in slots
                   if k < len(s.values)]
        combos = []
        if len(slots) >= 2:
            for _ in range(limit):
                picked = self.rng.choice(len(slots), size=min(len(slots), int(self.rng.integers(2, 4))),
                                         replace=False)
                combos.append([(slots[i], slots[i].values[int(self.rng.integers(len(slots[i].values)))])
                               for i in picked])
        first = [[(s, s.values[0]) for s in slots]] if len(slots) >= 2 else []
        made = 0
        for changes in (*first, *_interleave(singles, combos)):
            variant = self.change(draft, changes)
            if variant is not None:
                yield variant
                made += 1
                if made >= limit:
                    return

    def change(self, draft: Draft, changes: Sequence[tuple[_Slot, Any]]) -> Draft | None:
        """``draft`` with each slot set to its value, typed and run again; None when a node
        refuses."""
        attrs = {j: dict(node.attrs) for j, node in enumerate(draft.nodes)}
        arrays: dict[str, np.ndarray] = {}
        notes = []
        for slot, value in changes:
            if slot.var:
                arrays[slot.var] = value
                notes.append(f"{slot.label}={value.tolist()}")
                continue
            for j, name in slot.nodes:
                if value is None:
                    attrs[j].pop(name, None)
                else:
                    attrs[j][name] = value
            notes.append(f"{slot.label}={value}")
        values: dict[str, Value] = {}
        new_vars = dict(draft.vars)
        probes = dict(draft.probes)
        for name, array in arrays.items():
            var = draft.vars[name]
            new_vars[name] = replace(var, value=self._const_value(name, array), array=array)
            probes[name] = array
        for var in new_vars.values():
            values[var.name] = var.value
        nodes = []
        for j, node in enumerate(draft.nodes):
            fresh = node.replace(inputs=tuple(values.get(v.name, v) if v is not None else None for v in node.inputs),
                                 attrs=attrs[j])
            typed = self._typed(fresh, probes)
            if typed is None:
                return None
            fresh, out = typed
            nodes.append(fresh)
            for v, probe in zip(fresh.outputs, out):
                if v is not None:
                    values[v.name] = v
                    probes[v.name] = probe
        roots = tuple(values[v.name] for v in draft.roots)
        return replace(draft, vars=new_vars, nodes=tuple(nodes), roots=roots, probes=probes,
                       changes=(*draft.changes, *notes))


def _interleave(a: list, b: list) -> Iterator:
    """All of ``a`` with one of ``b`` after every third."""
    bi = iter(b)
    for k, item in enumerate(a):
        yield item
        if k % 3 == 2:
            nxt = next(bi, None)
            if nxt is not None:
                yield nxt
    yield from bi


def _unique(values: list) -> list:
    out = []
    for v in values:
        if not any(_same_value(v, u) for u in out):
            out.append(v)
    return out


def _same_value(a, b) -> bool:
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        return isinstance(a, np.ndarray) and isinstance(b, np.ndarray) and a.shape == b.shape and \
            bool(np.all(a == b))
    return a == b


def _weight_group(op: str, inputs: Sequence[Value | None]) -> int | None:
    """The ``group`` that makes a convolution's weight fit its input: C / (weight's dim 1)."""
    if len(inputs) < 2:
        return None
    x, w = _static(inputs[0]), _static(inputs[1])
    if x is None or w is None or len(x) < 3 or len(w) < 3 or op == "ConvTranspose":
        return None
    c = x[1] * x[4] if op in BLOCKED_OPS and len(x) == 5 else (x[-1] if op == "ConvNHWC" else x[1])
    if w[1] and c % w[1] == 0 and w[0] % (c // w[1]) == 0:
        return c // w[1]
    return None


def _derived_shapes(op: str, index: int, placed: list[tuple[int, ...]], fresh: int,
                    policy: str) -> list[tuple[int, ...]]:
    """Shapes for an operand of ``op`` next to inputs of shapes ``placed`` (the first one
    ``S``): a convolution's weights ``[M, C, k, k]`` and depthwise ``[C, 1, k, k]``; ``S``
    itself; one channel's ``[C, 1, 1]`` and ``[1, C, 1, 1]`` (``[1, C/8, 1, 1, 8]`` blocked);
    vectors of the placed inputs' first, channel and last dims; a MatMul's ``[K, N]`` and
    ``[N, K]``; scalars. ``policy`` ``vector`` puts the per-channel ones before ``S``.

    Example: ``_derived_shapes("Add", 1, [(2, 3, 7, 5)], 11, "first")[:3]`` ->
    ``[(2, 3, 7, 5), (3, 1, 1), (1, 3, 1, 1)]``.
    """
    s = placed[0]
    q = len(s)
    if op in CONV_OPS and index == 2 and len(placed) >= 2 and placed[1]:
        return [(placed[1][0],)]  # a convolution's bias: one per output channel
    conv: list[tuple[int, ...]] = []
    if op in CONV_OPS and index == 1 and q >= 3:
        c = s[1] * s[4] if op in BLOCKED_OPS and q == 5 else (s[-1] if op == "ConvNHWC" else s[1])
        k = 2 if op in BLOCKED_OPS and q == 5 else q - 2
        for m in dict.fromkeys((fresh, 8)):
            conv += [(m, c) + (3,) * k, (m, c) + (1,) * k]
        conv += [(c, 1) + (3,) * k, (c, 1) + (1,) * k]
    channel: list[tuple[int, ...]] = []
    if q >= 3:
        channel += [(s[1],) + (1,) * (q - 2), (1, s[1]) + (1,) * (q - 2)]
    if q == 5:
        channel.append((1, s[1], 1, 1, s[4]))
    vectors = [(x[i],) for x in placed for i in (-1, 1, 0) if -len(x) <= i < len(x)]
    matmul = [(s[-1], fresh), (fresh, s[-1])] if q >= 1 else []
    if q >= 3:
        matmul.append(s[:-2] + (s[-1], fresh))
    scalars = [(), (1,)]
    if policy == "vector":
        out = conv + vectors + channel + [s] + scalars + matmul
    else:
        out = conv + [s] + channel + vectors + scalars + matmul
    return list(dict.fromkeys(out))


_ONNX_VERDICTS: dict[tuple, str] = {}


def _onnx_agrees(graph: Graph, node: Node, opdef, opset: int, fresh: FreshDims) -> None:
    """Raise when onnx's strict shape inference refuses the node (a second opinion: it
    checks, e.g., that BatchNormalization's scale is a vector). Verdicts are remembered by
    op, attributes, input types and known input values."""
    from egraft.ir.infer import input_values
    from egraft.ir.onnx_fallback import onnx_infer
    from egraft.ir.registry import InferContext

    types = [v.type if v is not None else None for v in node.inputs]
    values = input_values(graph, node)
    key = (node.op, node.domain, opset, repr(sorted(node.attrs.items())), tuple(map(str, types)),
           tuple(None if v is None or v.dtype == object or v.size > 64 else (v.dtype.str, v.shape, v.tobytes())
                 for v in values))
    if key not in _ONNX_VERDICTS:
        try:
            onnx_infer(InferContext(node, opdef, opset, types, values, fresh, graph))
            _ONNX_VERDICTS[key] = ""
        except Exception as err:
            _ONNX_VERDICTS[key] = str(err) or type(err).__name__
        if len(_ONNX_VERDICTS) > 50000:
            _ONNX_VERDICTS.clear()
    if _ONNX_VERDICTS[key]:
        raise ValueError(_ONNX_VERDICTS[key])


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
        if v is not None and (r.shape != tuple(v.type.shape) or r.dtype != v.type.dtype.numpy):
            raise ValueError(f"{node.op} gave {r.dtype}{list(r.shape)}, inferred {v.type}")
    return results

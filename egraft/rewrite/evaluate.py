"""Evaluating a rule's guard and building its replacement under one substitution.

Guards see tensor variables through their e-class's type and, for constants, value:
``const(w)``, ``rank(x)``, ``shape(x)``, ``dim(x, 1)``, ``dtype(x) == f32``,
``all_equal(c, 1)``... A replacement builds new terms: a call to an op makes a node
whose output types the op registry infers (the one source of truth); ``+ - * /`` on
tensors are Add/Sub/Mul/Div; numbers next to a tensor become constants of its dtype;
keyword arguments become attributes, or constant inputs where the op takes that
operand as an input at the graph's opset; ``fold(n)`` evaluates a node whose inputs are
all constants with the reference kernels.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from functools import lru_cache, partial
from typing import Any

import numpy as np
import onnx.defs
import sympy

from egraft.ir.dims import dims_equal
from egraft.ir.dtypes import DType
from egraft.ir.graph import Graph, Node, Value, content_hash
from egraft.ir.infer import FreshDims, infer_node
from egraft.ir.registry import RunContext, get_op
from egraft.ir.types import TensorType
from egraft.rewrite.ast import EBinary, ECall, EIndex, EList, ELit, EUnary, EVar, Rule
from egraft.rewrite.builtins import BUILTINS, DTYPE_NAMES, GuardFailed, Handle
from egraft.rewrite.egraph import CONST, EGraphState, Snapshot, attrs_key, value_name
from egraft.rewrite.guard import guard_function
from egraft.rewrite.match import ROOT, EClassId, Subst


class ReplacementFailed(Exception):
    """The replacement could not be built (inference refused it, or its type differs)."""


@dataclass
class Memo:
    """What the evaluators of one saturation run (one per snapshot) share.

    Attributes:
        inferred: the output types (and compile-time values) inferred per op, attributes and
            inputs' types, constants and values: DenseNet-121's 12,400 replacement nodes have
            7,000 distinct ones. Not kept when inference made a new dim symbol.
        folded: the constant (content key and array) that ``fold`` computed per op, attributes,
            input constants and output type: Inception-v2 folds 623 nodes, 427 distinct.
        replacements: per rule (by ``id``, kept with it), its compiled replacement
            (:func:`compile_replacement`).
    """

    inferred: dict[tuple, tuple[list, list]] = field(default_factory=dict)
    folded: dict[tuple, tuple[str, np.ndarray]] = field(default_factory=dict)
    replacements: dict[int, tuple[Rule, tuple]] = field(default_factory=dict)


class Evaluator:
    """Evaluates guards and builds replacements for one snapshot."""

    def __init__(self, state: EGraphState, snapshot: Snapshot, opset: int, fresh: FreshDims,
                 memo: Memo | None = None):
        self.state = state
        self.snap = snapshot
        self.opset = opset
        self.fresh = fresh
        self.memo = Memo() if memo is None else memo
        self.scratch = Graph("egraph", [], [], [], constants=state.constants, opsets=state.opsets)

    # ---- values of variables ----------------------------------------------------------------
    def _value(self, name: str, subst: Subst, env: dict):
        if name in env:
            return env[name]
        if name in subst:
            v = subst[name]
            if isinstance(v, EClassId):
                return Handle(self.snap.class_ref[v])
            if isinstance(v, list) and v and all(isinstance(c, EClassId) for c in v):
                return [Handle(self.snap.class_ref[c]) for c in v]
            return v
        if name in DTYPE_NAMES:
            return DTYPE_NAMES[name]
        if name in ("inf", "nan"):
            return float(name)
        raise GuardFailed(f"unbound variable {name}")

    # ---- types of handles ---------------------------------------------------------------------
    def type_of(self, h: Handle) -> TensorType:
        t = self.state.ref_types[h.ref]
        if not isinstance(t, TensorType):
            raise GuardFailed("not a tensor")
        return t

    def const_of(self, h: Handle) -> np.ndarray | None:
        key = self.state.ref_const.get(h.ref)
        if key is None:
            c = self.snap.ref_class.get(h.ref)
            key = self.snap.const_class.get(c) if c is not None else None
        return None if key is None else self.state.constants[key]

    # ---- expressions -------------------------------------------------------------------------
    def eval(self, e, subst: Subst, env: dict, build: bool = False) -> Any:
        if isinstance(e, ELit):
            return e.value
        if isinstance(e, EVar):
            return self._value(e.name, subst, env)
        if isinstance(e, EList):
            return [self.eval(x, subst, env, build) for x in e.items]
        if isinstance(e, EUnary):
            v = self.eval(e.operand, subst, env, build)
            if e.op == "not":
                return not v
            if isinstance(v, Handle):
                return self.make_op("Neg", [v], {})
            return -v
        if isinstance(e, EBinary):
            return self._binary(e, subst, env, build)
        if isinstance(e, EIndex):
            base = self.eval(e.base, subst, env, build)
            if isinstance(e.index, tuple):
                lo, hi = (None if x is None else self.eval(x, subst, env, build) for x in e.index)
                return list(base)[lo:hi]
            return base[self.eval(e.index, subst, env, build)]
        if isinstance(e, ECall):
            return self._call(e, subst, env, build)
        raise GuardFailed(f"cannot evaluate {type(e).__name__}")

    def _binary(self, e: EBinary, subst, env, build):
        if e.op == "and":
            return bool(self.eval(e.left, subst, env, build)) and bool(self.eval(e.right, subst, env, build))
        if e.op == "or":
            return bool(self.eval(e.left, subst, env, build)) or bool(self.eval(e.right, subst, env, build))
        a = self.eval(e.left, subst, env, build)
        b = self.eval(e.right, subst, env, build)
        if isinstance(a, Handle) or isinstance(b, Handle):
            if not build:
                raise GuardFailed("tensor arithmetic in a guard")
            op = {"+": "Add", "-": "Sub", "*": "Mul", "/": "Div"}.get(e.op)
            if op is None:
                raise ReplacementFailed(f"operator {e.op} on tensors")
            a, b = self._tensorize(a, b), self._tensorize(b, a)
            return self.make_op(op, [a, b], {})
        return _python_binary(e.op, a, b)

    def _tensorize(self, x, like) -> Handle:
        if isinstance(x, Handle):
            return x
        dtype = self.type_of(like).dtype.numpy
        return Handle(self.state.add_const(np.asarray(x, dtype=dtype)))

    def _call(self, e: ECall, subst, env, build):
        builtin = BUILTINS.get(e.func)
        if builtin is not None and not (build and get_op(e.func, e.domain) is not None):
            args = [self.eval(a, subst, env, build) for a in e.args]
            return builtin(self, *args)
        if e.func == "fold":
            if not build:
                raise GuardFailed("fold in a guard")
            return self.fold(self.eval(e.args[0], subst, env, build))
        if not build:
            raise GuardFailed(f"op {e.func} in a guard")
        args = [self.eval(a, subst, env, build) for a in e.args]
        attrs: dict[str, Any] = {}
        for spread in e.attrs_spread:
            attrs.update(self._value(spread, subst, env))
        kwargs = {k: self.eval(v, subst, env, build) for k, v in e.kwargs}
        return self.call_op(e.func, e.domain, args, kwargs, attrs)

    # ---- building terms ----------------------------------------------------------------------
    def call_op(self, op: str, domain: str, args: list, kwargs: dict, attrs: dict, n_outputs: int = 1):
        """Build ``op(args, **kwargs) {attrs}``; keyword operands the op takes as inputs
        at this opset become constant inputs."""
        inputs: list[Any] = list(args)
        input_names = _schema_inputs(op, domain, self.opset)
        for key, value in kwargs.items():
            if key in input_names:
                pos = input_names.index(key)
                while len(inputs) <= pos:
                    inputs.append(None)
                inputs[pos] = value
            else:
                attrs[key] = _attr_value(value)
        handles = []
        for x in _splat(inputs):
            if x is None or isinstance(x, Handle):
                handles.append(x)
            else:
                array = np.asarray(x)
                if array.dtype.kind == "f":
                    array = array.astype(np.float32)
                elif array.dtype.kind in "iub" and array.dtype != np.bool_:
                    array = array.astype(np.int64)
                handles.append(Handle(self.state.add_const(array)))
        return self.make_op(op, handles, attrs, domain=domain, n_outputs=n_outputs)

    def make_op(self, op: str, inputs: list, attrs: dict, domain: str = "", n_outputs: int = 1):
        opdef = get_op(op, domain)
        if opdef is not None and opdef.canonical is not None and inputs and None not in inputs:
            # an input's identity is its e-class (a term built in this replacement: its handle,
            # which names no e-class of the snapshot)
            keys = [self.snap.ref_class.get(h.ref, h.ref) for h in inputs]
            try:
                positions, attrs = opdef.canonical(attrs, keys)
            except ValueError as err:
                raise ReplacementFailed(f"{op}: {err}") from None
            inputs = [inputs[i] for i in positions]
        facts = [None if h is None else self._facts(h) for h in inputs]
        key = attrs_key(attrs)
        known = self.scratch.known_values
        # a type by its dtype's id (a singleton: DType's hash is Python code) and its shape
        inputs_seen = tuple(None if f is None else (id(f[0].dtype), f[0].shape, f[1], id(f[2])) for f in facts)
        signature = (op, domain, key, n_outputs, inputs_seen)
        reduced = None
        if opdef is not None and opdef.infer_key is not None:
            # inference reads only part of the attributes: one entry serves every node that agrees
            # on it, unless inference also evaluated the outputs (that reads all of them)
            try:
                reduced = (op, domain, ("infer_key", opdef.infer_key(attrs)), n_outputs, inputs_seen)
            except Exception as err:
                raise ReplacementFailed(f"{op}: {err}") from None
        inferred = self.memo.inferred.get(signature if reduced is None else reduced)
        if inferred is None and reduced is not None:
            inferred = self.memo.inferred.get(signature)
        if inferred is None:
            values = []
            for h, f in zip(inputs, facts):
                if f is None:
                    values.append(None)
                    continue
                name = value_name(h.ref)
                if f[2] is not None:
                    known[name] = f[2]
                values.append(Value(name, f[0], const=f[1]))
            node = Node(op, tuple(values), _placeholders(n_outputs), dict(attrs), domain=domain)
            made = self.fresh.count
            for i in range(n_outputs):
                known.pop(f"new{i}", None)
            try:
                types = infer_node(self.scratch, node, self.fresh)
            except Exception as err:
                raise ReplacementFailed(f"{op}: {err}") from None
            inferred = (types, [known.get(f"new{i}") for i in range(n_outputs)])
            if self.fresh.count == made:  # no new dim symbol: the same inputs give the same types
                values_known = any(v is not None for v in inferred[1])
                self.memo.inferred[signature if reduced is None or values_known else reduced] = inferred
        types, values_out = inferred
        for i, value in enumerate(values_out):
            if value is not None:
                known[f"new{i}"] = value
        args = [h.ref if h is not None else self._absent() for h in inputs]
        while args and inputs and inputs[-1] is None:
            args.pop()
            inputs = inputs[:-1]
        if n_outputs == 1:
            ref = self.state.add_term(op, domain, attrs, args, types[0], key)
            self._keep_known("new0", ref)
            return Handle(ref)
        tup = self.state.add_term(op, domain, attrs, args, tuple(types), key)
        handles = []
        for i, t in enumerate(types):
            ref = self.state.add_term("Out", "", {"index": i}, [tup], t)
            self._keep_known(f"new{i}", ref)
            handles.append(Handle(ref))
        return handles

    def _absent(self) -> int:
        if self.state.absent_ref is None:
            self.state.absent_ref = self.state.add_leaf("Absent", "", None)
        return self.state.absent_ref

    def _keep_known(self, name: str, ref: int) -> None:
        value = self.scratch.known_values.pop(name, None)
        if value is not None:
            self.state.known_values[ref] = value
            self.scratch.known_values[value_name(ref)] = value

    def _facts(self, h: Handle) -> tuple[TensorType, str | None, np.ndarray | None]:
        """What inference reads of an input besides its name: its type, its constant (content
        key) and its compile-time value, if any."""
        ref = h.ref
        key = self.state.ref_const.get(ref)
        c = self.snap.ref_class.get(ref)
        if key is None and c is not None:
            key = self.snap.const_class.get(c)
        known = self.state.known_values.get(ref)
        if known is None and c is not None:
            known = self.snap.known.get(c)
        return self.type_of(h), key, known

    def fold(self, target) -> Handle:
        """Evaluate a node of e-class ``target`` whose inputs are all constants."""
        if not isinstance(target, Handle):
            raise ReplacementFailed("fold needs a tensor")
        c = self.snap.ref_class.get(target.ref)
        known = self.snap.known.get(c)
        if known is not None and known.dtype != object:  # shape arithmetic already evaluated
            return Handle(self.state.add_const(np.asarray(known)))
        for n in self.snap.classes.get(c, ()):
            if n.op in (CONST, "Input", "Absent", "Out"):
                continue
            keys = tuple(self.snap.const_class.get(ch) for ch in n.children)
            if None in keys or self.snap.is_tuple(c):
                continue
            opdef = get_op(n.op, n.domain)
            if opdef is None or opdef.compute is None:
                continue
            ttype = self.type_of(target)
            signature = (n.op, n.domain, n.attrs, keys, id(ttype.dtype), ttype.shape)
            folded = self.memo.folded.get(signature)
            if folded is None:
                arrays = [self.state.constants[k] for k in keys]
                fake = Node(n.op, (), (Value("y", ttype),), self.snap.attrs(n), domain=n.domain)
                try:
                    with np.errstate(all="ignore"):
                        result = np.asarray(opdef.compute(RunContext(fake, opdef, self.opset), *arrays)[0])
                except Exception as err:
                    raise ReplacementFailed(f"fold {n.op}: {err}") from None
                folded = self.memo.folded[signature] = (content_hash(result), result)
            return Handle(self.state.add_const(folded[1], folded[0]))
        raise ReplacementFailed("no foldable node")

    # ---- whole rules -----------------------------------------------------------------------
    def guard(self, rule: Rule, subst: Subst) -> bool:
        if rule.guard is None:
            return True
        try:
            return bool(guard_function(rule.guard)(self, subst))
        except GuardFailed:
            return False
        except (TypeError, ValueError, IndexError, KeyError, ZeroDivisionError):
            return False

    def build(self, rule: Rule, subst: Subst) -> list[tuple[int, int]]:
        """Build the replacement; return (root class handle, replacement handle) pairs. The
        rule's replacement runs compiled (:func:`compile_replacement`, once per rule and run):
        what :meth:`eval` with ``build`` computes, in the same order."""
        compiled = self.memo.replacements.get(id(rule))
        if compiled is None or compiled[0] is not rule:
            compiled = self.memo.replacements[id(rule)] = (rule, compile_replacement(rule))
        return self._built(*compiled[1], subst)

    def interpret(self, rule: Rule, subst: Subst) -> list[tuple[int, int]]:
        """:meth:`build` by walking the syntax tree (:meth:`eval`): the reference that compiled
        replacements are checked against."""
        lets = [(let.names, partial(self._interpret_let, let)) for let in rule.lets]
        results = [partial(self._interpret, result) for result in rule.results]
        return self._built(lets, results, subst)

    def _interpret(self, e, ev, subst, env):
        return self.eval(e, subst, env, build=True)

    def _interpret_let(self, let, ev, subst, env):
        return self.eval(let.value, subst, env, build=True) if len(let.names) == 1 else \
            self._eval_multi(let, subst, env)

    def _eval_multi(self, let, subst, env):
        call = let.value
        if not isinstance(call, ECall):
            return self.eval(call, subst, env, build=True)
        args = [self.eval(a, subst, env, True) for a in call.args]
        attrs: dict[str, Any] = {}
        for spread in call.attrs_spread:
            attrs.update(self._value(spread, subst, env))
        kwargs = {k: self.eval(v, subst, env, True) for k, v in call.kwargs}
        return self.call_op(call.func, call.domain, args, kwargs, attrs, n_outputs=len(let.names))

    def _built(self, lets, results, subst: Subst) -> list[tuple[int, int]]:
        env: dict[str, Any] = {}
        for names, value_of in lets:
            value = value_of(self, subst, env)
            if len(names) == 1:
                env[names[0]] = value
            else:
                if not isinstance(value, list) or len(value) != len(names):
                    raise ReplacementFailed(f"{', '.join(names)}: expected {len(names)} outputs")
                env.update(zip(names, value))
        pairs = []
        ref_types = self.state.ref_types
        for i, value_of in enumerate(results):
            value = value_of(self, subst, env)
            if not isinstance(value, Handle):
                raise ReplacementFailed("a result is not a tensor")
            root_ref = self.snap.class_ref[subst[ROOT.format(i)]]
            want, got = ref_types[root_ref], ref_types[value.ref]
            if not same_type(want, got):
                raise ReplacementFailed(f"type {got} differs from the root's {want}")
            pairs.append((root_ref, value.ref))
        return pairs


#: ``(evaluator, substitution, the lets' values) -> value``: a replacement expression compiled.
Built = Callable[[Evaluator, Subst, dict], Any]
#: The op that ``+ - * /`` between tensors builds.
_TENSOR_OPS = {"+": "Add", "-": "Sub", "*": "Mul", "/": "Div"}


def compile_replacement(rule: Rule) -> tuple[list[tuple[tuple[str, ...], Built]], list[Built]]:
    """The rule's lets (names and value) and results compiled into nested closures, one per syntax
    node: each computes what :meth:`Evaluator.eval` with ``build`` computes, evaluating operands
    in the same order (the order in which terms get their handles). Walking the syntax tree and
    dispatching on each node's class was a quarter of building a replacement.

    Example:
        >>> from egraft.rewrite.parser import parse_rules
        >>> rule = parse_rules("rule r:\\n    Relu(x) => y = Neg(x)\\n        Neg(y)\\n").rules[0]
        >>> lets, results = compile_replacement(rule)
        >>> [names for names, _ in lets], len(results)
        ([('y',)], 1)
    """
    lets = [(let.names, _compile(let.value) if len(let.names) == 1 else _compile_multi(let)) for let in rule.lets]
    return lets, [_compile(result) for result in rule.results]


def _compile(e) -> Built:
    if isinstance(e, ELit):
        value = e.value
        return lambda ev, s, env: value
    if isinstance(e, EVar):
        name = e.name
        return lambda ev, s, env: ev._value(name, s, env)
    if isinstance(e, EList):
        items = [_compile(x) for x in e.items]
        return lambda ev, s, env: [f(ev, s, env) for f in items]
    if isinstance(e, EUnary):
        return _compile_unary(e.op, _compile(e.operand))
    if isinstance(e, EBinary):
        return _compile_binary(e.op, _compile(e.left), _compile(e.right))
    if isinstance(e, EIndex):
        return _compile_index(_compile(e.base), e.index)
    if isinstance(e, ECall):
        return _compile_call(e)
    message = f"cannot evaluate {type(e).__name__}"

    def fail(ev, s, env):
        raise GuardFailed(message)

    return fail


def _compile_unary(op: str, f: Built) -> Built:
    if op == "not":
        return lambda ev, s, env: not f(ev, s, env)

    def negate(ev, s, env):
        v = f(ev, s, env)
        return ev.make_op("Neg", [v], {}) if isinstance(v, Handle) else -v

    return negate


def _compile_binary(op: str, f: Built, g: Built) -> Built:
    if op == "and":
        return lambda ev, s, env: bool(f(ev, s, env)) and bool(g(ev, s, env))
    if op == "or":
        return lambda ev, s, env: bool(f(ev, s, env)) or bool(g(ev, s, env))
    tensor_op = _TENSOR_OPS.get(op)

    def apply(ev, s, env):
        a = f(ev, s, env)
        b = g(ev, s, env)
        if isinstance(a, Handle) or isinstance(b, Handle):
            if tensor_op is None:
                raise ReplacementFailed(f"operator {op} on tensors")
            a, b = ev._tensorize(a, b), ev._tensorize(b, a)
            return ev.make_op(tensor_op, [a, b], {})
        return _python_binary(op, a, b)

    return apply


def _compile_index(base: Built, index) -> Built:
    if isinstance(index, tuple):
        lo, hi = (None if x is None else _compile(x) for x in index)

        def sliced(ev, s, env):
            items = base(ev, s, env)
            start = None if lo is None else lo(ev, s, env)
            return list(items)[start:None if hi is None else hi(ev, s, env)]

        return sliced
    at = _compile(index)
    return lambda ev, s, env: base(ev, s, env)[at(ev, s, env)]


def _compile_call(e: ECall) -> Built:
    builtin = BUILTINS.get(e.func)
    args = [_compile(a) for a in e.args]
    if builtin is not None and get_op(e.func, e.domain) is None:  # an op of that name is built instead
        return lambda ev, s, env: builtin(ev, *[a(ev, s, env) for a in args])
    if e.func == "fold":
        return lambda ev, s, env: ev.fold(args[0](ev, s, env))
    return _compile_op(e, args, 1)


def _compile_multi(let) -> Built:
    """A let of several names: an op call builds a node of that many outputs."""
    if not isinstance(let.value, ECall):
        return _compile(let.value)
    return _compile_op(let.value, [_compile(a) for a in let.value.args], len(let.names))


def _compile_op(e: ECall, args: list[Built], n_outputs: int) -> Built:
    func, domain, spreads = e.func, e.domain, e.attrs_spread
    kwargs = [(k, _compile(v)) for k, v in e.kwargs]

    def call(ev, s, env):
        values = [a(ev, s, env) for a in args]
        attrs: dict[str, Any] = {}
        for spread in spreads:
            attrs.update(ev._value(spread, s, env))
        return ev.call_op(func, domain, values, {k: f(ev, s, env) for k, f in kwargs}, attrs, n_outputs=n_outputs)

    return call


@lru_cache(maxsize=16)
def _placeholders(n: int) -> tuple[Value, ...]:
    """The output values of a node being inferred, ``new0``... (values are immutable)."""
    return tuple(Value(f"new{i}", TensorType(DType.FLOAT32, None)) for i in range(n))


def _splat(values: list) -> list:
    """Positional arguments with input lists (``xs``) spread in place."""
    out = []
    for v in values:
        if isinstance(v, list) and v and all(isinstance(x, Handle) for x in v):
            out.extend(v)
        else:
            out.append(v)
    return out


def same_type(a, b) -> bool:
    """Two e-class types are interchangeable: same dtype, same rank, provably equal dims."""
    if not isinstance(a, TensorType) or not isinstance(b, TensorType):
        return False
    if a.dtype != b.dtype or a.shape is None or b.shape is None or len(a.shape) != len(b.shape):
        return False
    return all(dims_equal(x, y) for x, y in zip(a.shape, b.shape))


def _python_binary(op: str, a, b):
    if op == "+":
        return a + b
    if op == "-":
        return a - b
    if op == "*":
        return a * b
    if op == "/":
        return a / b
    if op == "%":
        return a % b
    if op == "==":
        return _eq(a, b)
    if op == "!=":
        return not _eq(a, b)
    if op == "<":
        return a < b
    if op == "<=":
        return a <= b
    if op == ">":
        return a > b
    if op == ">=":
        return a >= b
    raise GuardFailed(f"operator {op}")


def _eq(a, b) -> bool:
    if isinstance(a, list | tuple) and isinstance(b, list | tuple):
        return len(a) == len(b) and all(_eq(x, y) for x, y in zip(a, b))
    if isinstance(a, sympy.Basic) or isinstance(b, sympy.Basic):
        return dims_equal(a, b)
    return a == b


def _attr_value(v):
    if isinstance(v, np.ndarray):
        return v
    if isinstance(v, tuple):
        return list(v)
    if isinstance(v, list):
        return [int(x) if isinstance(x, np.integer | sympy.Integer) else x for x in v]
    return v


@lru_cache(maxsize=1024)
def _schema_inputs(op: str, domain: str, opset: int) -> tuple[str, ...]:
    """The input names of ``op``'s ONNX schema at ``opset`` (none for ops without one).
    Memoized by the three: the schemas are fixed, and every replacement asks."""
    try:
        return tuple(i.name for i in onnx.defs.get_schema(op, opset, domain).inputs)
    except Exception:
        return ()



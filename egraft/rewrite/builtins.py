"""The builtin functions of the rule language (guards and replacements), in one table
that the evaluator calls and the rule-file checker reads, so the two cannot disagree.

A builtin takes the evaluator first (for the types and constant values of tensor
arguments) and then the evaluated arguments. Add one here, with a one-line docstring,
and it is available in every rule file.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from egraft.ir.dtypes import DType

if TYPE_CHECKING:
    from egraft.rewrite.evaluate import Evaluator

#: Names that are constants in expressions: the dtypes (``f32``, ``i64``, ``bool``...).
DTYPE_NAMES = {d.short: d for d in DType}


class GuardFailed(Exception):
    """A guard could not be evaluated (e.g. ``dim`` of an unknown rank): the match is skipped."""


@dataclass(frozen=True)
class Handle:
    """A tensor in a replacement: an e-class handle (``T.ref``)."""

    ref: int


# ---- guard builtins ------------------------------------------------------------------------
def _flat(args):
    for a in args:
        if isinstance(a, list):
            yield from a
        else:
            yield a


def _const(ev: Evaluator, *args) -> bool:
    return all(isinstance(h, Handle) and ev.const_of(h) is not None for h in _flat(args))


def _rank(ev: Evaluator, x) -> int:
    t = ev.type_of(x)
    if t.shape is None:
        raise GuardFailed("unknown rank")
    return len(t.shape)


def _shape(ev: Evaluator, x) -> list:
    t = ev.type_of(x)
    if t.shape is None:
        raise GuardFailed("unknown rank")
    return list(t.shape)


def _dim(ev: Evaluator, x, i: int):
    return _shape(ev, x)[i]


def _dtype(ev: Evaluator, x) -> DType:
    return ev.type_of(x).dtype


def _static(ev: Evaluator, *xs) -> bool:
    return all(ev.type_of(x).is_static for x in _flat(xs))


def _numel(ev: Evaluator, x):
    from egraft.ir.dims import dim_product

    return dim_product(_shape(ev, x))


def _value_of(ev: Evaluator, x) -> np.ndarray:
    v = ev.const_of(x)
    if v is None:
        raise GuardFailed("not a constant")
    return v


def _all_equal(ev: Evaluator, x, number) -> bool:
    v = ev.const_of(x) if isinstance(x, Handle) else np.asarray(x)
    return v is not None and v.size > 0 and bool(np.all(v == number))


def _dims_at(ev: Evaluator, x, indices) -> np.ndarray:
    """The dims of ``x`` at ``indices`` (an int64 array, negative ones counted from the end),
    as an int64 array of the indices' shape; :class:`GuardFailed` when one of them is
    symbolic or out of range (``dims_at(x, [-1])`` of ``x: f32[batch, 768]`` is ``[768]``)."""
    shape = _shape(ev, x)
    picked = np.asarray(indices, dtype=np.int64)
    if np.any(picked < -len(shape)) or np.any(picked >= len(shape)):
        raise GuardFailed("index out of range")
    dims = [shape[int(i)] for i in picked.reshape(-1)]
    if not all(isinstance(d, int | np.integer) for d in dims):
        raise GuardFailed("a symbolic dim")
    return np.asarray(dims, dtype=np.int64).reshape(picked.shape)


def _is_symbolic(ev: Evaluator, x) -> bool:
    return not ev.type_of(x).is_static


BUILTINS = {
    "const": _const,
    "rank": _rank,
    "shape": _shape,
    "dim": _dim,
    "dtype": _dtype,
    "static": _static,
    "numel": _numel,
    "value": _value_of,
    "all_equal": _all_equal,
    "is_symbolic": _is_symbolic,
    "dims_at": _dims_at,
    "known_dims": lambda ev, x, indices: _dims_at(ev, x, indices) is not None,
    "len": lambda ev, x: len(x),
    "range": lambda ev, n: list(range(int(n))),
    "abs": lambda ev, x: abs(x),
    "min": lambda ev, *x: min(_flat(x)),
    "max": lambda ev, *x: max(_flat(x)),
    "int": lambda ev, x: int(x),
    "float": lambda ev, x: float(x),
}


# ---- layout builtins (egraft/rules/layout.rules) ---------------------------------------------------
import weakref  # noqa: E402  (appended section: the table above is append-only)


def _perm_list(p) -> list[int]:
    if p is None or not isinstance(p, list | tuple):
        raise GuardFailed("a permutation must be a list of axes")
    return [int(i) for i in p]


def _full_perm(ev: Evaluator, p, n) -> list[int]:
    """Transpose's ``perm``, or its default (the axes reversed) when unset: ``full_perm(p, rank(x))``."""
    return list(range(int(n)))[::-1] if p is None else _perm_list(p)


def _compose_perm(ev: Evaluator, p, q) -> list[int]:
    """The perm of ``Transpose(Transpose(x, p), q)`` as one Transpose: ``[p[i] for i in q]``;
    ``compose_perm([0, 2, 3, 1], [0, 3, 1, 2]) == [0, 1, 2, 3]``."""
    p, q = _perm_list(p), _perm_list(q)
    if sorted(p) != list(range(len(p))) or sorted(q) != list(range(len(p))):
        raise GuardFailed(f"{p} and {q} are not permutations of the same axes")
    return [p[i] for i in q]


def _inverse_perm(ev: Evaluator, p) -> list[int]:
    """The perm that undoes ``p``: ``inverse_perm([0, 2, 3, 1]) == [0, 3, 1, 2]``."""
    p = _perm_list(p)
    inverse = [0] * len(p)
    for i, axis in enumerate(p):
        inverse[axis] = i
    return inverse


def _opset(ev: Evaluator) -> int:
    """The model's default-domain opset: ``opset() >= 11`` (Gemm's C is optional from opset 11)."""
    return int(ev.opset)


BUILTINS["full_perm"] = _full_perm
BUILTINS["compose_perm"] = _compose_perm
BUILTINS["inverse_perm"] = _inverse_perm
BUILTINS["opset"] = _opset



def _constant_classes(snap) -> frozenset[int]:
    """The e-classes of ``snap`` that hold a constant or a node computed from constants only
    (folded or not yet): kept by the snapshot's index as the e-graph grows."""
    return snap.constant_classes


def _const_fed_classes(snap, ops: tuple[str, ...]) -> frozenset[int]:
    """The e-classes that are the one non-constant input of a node of one of ``ops`` in ``snap``."""
    constant = _constant_classes(snap)
    fed: set[int] = set()
    for op in ops:
        for _, node in snap.by_op.get(op, ()):
            others = {c for c in node.children
                      if c not in constant and all(n.op != "Absent" for n in snap.classes.get(c, ()))}
            if len(others) == 1:
                fed |= others
    return frozenset(fed)


def _feeds_const(ev: Evaluator, x, *ops: str) -> bool:
    """A node of one of ``ops`` takes ``x`` and otherwise only constants (or constant expressions
    not folded yet): true for a Conv that a
    BatchNormalization, or a Mul or Add by a constant, follows (folding merges those into a new Conv):
    ``feeds_const(p, "BatchNormalization", "Mul", "Add")``."""
    if not isinstance(x, Handle):
        raise GuardFailed("feeds_const() asks about a tensor")
    per_snapshot = _FED_CLASSES.setdefault(ev.snap, {})
    if ops not in per_snapshot:
        per_snapshot[ops] = _const_fed_classes(ev.snap, ops)
    return ev.snap.ref_class.get(x.ref) in per_snapshot[ops]


def _made_by(ev: Evaluator, x, *ops: str) -> bool:
    """Some node of ``x``'s e-class is one of ``ops``: ``made_by(x, "Conv")`` for a tensor
    that a convolution computes (a BatchNormalization after it folds into it instead)."""
    if not isinstance(x, Handle):
        raise GuardFailed("made_by() asks about a tensor")
    c = ev.snap.ref_class.get(x.ref)
    return any(n.op in ops for n in ev.snap.classes.get(c, ()))


BUILTINS["made_by"] = _made_by


#: snapshot -> {ops: the classes feeding those ops with constants}, computed once per snapshot.
_FED_CLASSES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
BUILTINS["feeds_const"] = _feeds_const


def _distinct(ev: Evaluator, a, b) -> bool:
    """``a`` and ``b`` are different e-classes (not yet known equal): a rule that would only
    restate a known equality can skip it. ``distinct(p, x)``."""
    if not isinstance(a, Handle) or not isinstance(b, Handle):
        raise GuardFailed("distinct() compares two tensors")
    return ev.snap.ref_class.get(a.ref) != ev.snap.ref_class.get(b.ref)


BUILTINS["distinct"] = _distinct


# ---- algebra and specialization builtins (egraft/rules/algebra.rules, specialization.rules) ----------
import weakref  # noqa: E402  (appended section: the table above is append-only)


def _before(ev: Evaluator, a, b) -> bool:
    """``a``'s e-class comes before ``b``'s in a fixed order (their handles): a multi-root rule over
    two interchangeable roots applies once per pair instead of twice. ``before(p, q)``."""
    if not isinstance(a, Handle) or not isinstance(b, Handle):
        raise GuardFailed("before() compares two tensors")
    return a.ref < b.ref


def _original_classes(ev: Evaluator) -> frozenset[int]:
    """The e-classes of the current snapshot that hold a tensor of the source model: a node's
    output, a graph input or an initializer (cached per snapshot)."""
    snap = ev.snap
    cached = _ORIGINAL_CLASSES.get(snap)
    if cached is None:
        state = ev.state
        source_consts = {v.const for n in state.source.nodes for v in (*n.inputs, *n.outputs)
                         if v is not None and v.const is not None}
        refs = [*state.ref_origin, *state.input_refs.values()]
        classes = {snap.ref_class[r] for r in refs if r in snap.ref_class}
        classes.update(c for c, key in snap.const_class.items() if key in source_consts)
        cached = frozenset(classes)
        _ORIGINAL_CLASSES[snap] = cached
    return cached


def _original(ev: Evaluator, *xs) -> bool:
    """Every argument's e-class holds a tensor of the source model (a node's output, an input or
    an initializer), not only terms that rules built: ``original(w1, w2)`` holds for a model's own
    weights, not for weights that folding scaled or that a merge concatenated."""
    return _all_in(ev, xs, _original_classes(ev))


def _all_in(ev: Evaluator, xs, classes: frozenset[int]) -> bool:
    """Every tensor argument among ``xs`` (lists spread) lies in one of ``classes``."""
    return all(isinstance(h, Handle) and ev.snap.ref_class.get(h.ref) in classes for h in _flat(xs))


def _shared_classes(ev: Evaluator) -> frozenset[int]:
    """The e-classes of the current snapshot that hold a tensor of the source model which two or
    more of its nodes read, or a graph output that a node reads too (cached per snapshot)."""
    snap = ev.snap
    cached = _SHARED_CLASSES.get(snap)
    if cached is None:
        refs = _SHARED_REFS.get(ev.state)
        if refs is None:  # the source model's, once per e-graph
            state = ev.state
            readers = {name: len({id(n) for n in nodes}) for name, nodes in state.source.consumers().items()}
            for v in state.source.outputs:
                readers[v.name] = readers.get(v.name, 0) + 1
            nodes = state.source.nodes
            refs = [r for r, i in state.ref_source.items()
                    if len(nodes[i].outputs) == 1 and readers.get(nodes[i].outputs[0].name, 0) >= 2]
            refs += [r for name, r in state.input_refs.items() if readers.get(name, 0) >= 2]
            _SHARED_REFS[state] = refs
        cached = frozenset(snap.ref_class[r] for r in refs if r in snap.ref_class)
        _SHARED_CLASSES[snap] = cached
    return cached


def _shared(ev: Evaluator, *xs) -> bool:
    """Every argument's e-class holds a tensor of the source model that several of its nodes read
    (a layer norm's centred input, read by the variance and by the normalization): a tensor the
    model computes once for several consumers, which a fused body may keep rather than recompute."""
    return _all_in(ev, xs, _shared_classes(ev))


def _descendants(ev: Evaluator) -> dict[int, int]:
    """For each e-class of the current snapshot, the bitset of the e-classes that some e-node
    below it reads (cached per snapshot; a cycle is cut where the walk meets it)."""
    snap = ev.snap
    cached = _DESCENDANTS.get(snap)
    if cached is not None:
        return cached
    below: dict[int, int] = {}
    for root in snap.classes:
        if root in below:
            continue
        stack = [(root, False)]
        while stack:
            c, done = stack.pop()
            if done:
                bits = 0
                for n in snap.classes.get(c, ()):
                    for ch in n.children:
                        bits |= (1 << ch) | below.get(ch, 0)
                below[c] = bits
                continue
            if c in below:
                continue
            below[c] = 0  # on the stack: a cycle back here reads no further
            stack.append((c, True))
            stack.extend((ch, False) for n in snap.classes.get(c, ()) for ch in n.children if ch not in below)
    _DESCENDANTS[snap] = below
    return below


def _independent(ev: Evaluator, a, b) -> bool:
    """Neither tensor is computed from the other (no e-node below one reads the other), so
    both are needed: ``independent(p, q)`` tells two parallel ops from a chain."""
    if not isinstance(a, Handle) or not isinstance(b, Handle):
        raise GuardFailed("independent() compares two tensors")
    ca, cb = ev.snap.ref_class[a.ref], ev.snap.ref_class[b.ref]
    below = _descendants(ev)
    return ca != cb and not (below[ca] >> cb) & 1 and not (below[cb] >> ca) & 1


def _get(ev: Evaluator, attrs, name: str, default):
    """The value of attribute ``name`` in a captured attribute set, else ``default``:
    ``get(attrs, "strides", [1, 1]) == [1, 1]``."""
    if not isinstance(attrs, dict):
        raise GuardFailed("get() reads a captured attribute set ({attrs})")
    value = attrs.get(name)
    return default if value is None else value


_ORIGINAL_CLASSES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_SHARED_CLASSES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_SHARED_REFS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_DESCENDANTS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
BUILTINS["before"] = _before
BUILTINS["original"] = _original
BUILTINS["shared"] = _shared
BUILTINS["independent"] = _independent
BUILTINS["get"] = _get


# ---- Elementwise bodies (com.egraft::Elementwise) ------------------------------------------
def _shift_inputs(ev: Evaluator, expr: str, offset) -> str:
    """``expr`` with every input ``xi`` renamed ``x(i + offset)`` (to append another body's inputs)."""
    import re

    return re.sub(r"\bx(\d+)\b", lambda m: f"x{int(m.group(1)) + int(offset)}", expr)


def _str(ev: Evaluator, value) -> str:
    """A number or name as text, for building Elementwise bodies (``"x" + str(len(xs))``)."""
    return repr(float(value)) if isinstance(value, float) else str(value)


BUILTINS["shift_inputs"] = _shift_inputs
BUILTINS["str"] = _str


def _is_float(ev: Evaluator, *xs) -> bool:
    """True when every tensor has a floating-point dtype."""
    return all(ev.type_of(x).dtype.is_float for x in _flat(xs))


BUILTINS["is_float"] = _is_float


def _static_spatial(ev: Evaluator, *xs) -> bool:
    """True when every dim after the batch and channel dims is a number (``[N, C, 64, 64]``,
    not ``[N, C, h, w]``): the blocked-layout kernels plan their windows at compile time."""
    return all(isinstance(d, int) for x in _flat(xs) for d in _shape(ev, x)[2:])


BUILTINS["static_spatial"] = _static_spatial


#: What each builtin reads of a bound e-class beyond its type (which the e-class's name fixes), so
#: that semi-naive matching finds a refused match again when that changes
#: (:func:`egraft.rewrite.match.reads_classes`): "const" its constant, "ops" its e-nodes' ops,
#: "handles" the handles it holds (a merge brings in more). ``None``: nothing of it (values, types),
#: or only what cannot turn a refusal into an acceptance as the e-graph grows (``distinct`` and
#: ``independent`` only turn false, ``before`` compares handles, ``feeds_const``, written ``not
#: feeds_const``, only refuses more). A builtin not listed counts as reading all three.
READS: dict[str, str | None] = {
    "const": "const", "value": "const", "all_equal": "const", "made_by": "ops", "original": "handles",
    "shared": "handles",
    **dict.fromkeys(("rank", "shape", "dim", "dtype", "static", "numel", "is_symbolic", "dims_at", "known_dims",
                     "is_float", "static_spatial", "abs", "float", "int", "len", "max", "min", "range", "str", "get",
                     "full_perm", "compose_perm", "inverse_perm", "shift_inputs", "opset", "distinct", "independent",
                     "before", "feeds_const")),
}

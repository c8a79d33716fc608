"""``com.egraft::Elementwise``: a chain of elementwise and broadcasting ops as one op
whose ``expr`` attribute is the body, over the inputs ``x0``, ``x1``...

The body is a call expression: ``relu(add(mul(x0, x1), x2))``, with numbers allowed as
arguments (``mul(x0, 0.5)``). The functions are those of :data:`FUNCTIONS`. The fusion
rules grow bodies by composition; lowering compiles a body into one loop nest.

Example:
    >>> evaluate_expr("relu(add(x0, x1))", [np.array([-1.0, 2.0]), np.array([0.5, 0.5])])
    array([0. , 2.5])
"""

from __future__ import annotations

import ast
from functools import lru_cache

import numpy as np
from onnx import helper, numpy_helper

from egraft.ir.dims import broadcast_shapes
from egraft.ir.ops._common import fail
from egraft.ir.registry import AttrSpec, register_op
from egraft.ir.types import TensorType

#: name -> (ONNX op, arity, numpy function)
FUNCTIONS = {
    "add": ("Add", 2, np.add),
    "sub": ("Sub", 2, np.subtract),
    "mul": ("Mul", 2, np.multiply),
    "div": ("Div", 2, np.divide),
    "pow": ("Pow", 2, np.power),
    "max": ("Max", 2, np.maximum),
    "min": ("Min", 2, np.minimum),
    "neg": ("Neg", 1, np.negative),
    "abs": ("Abs", 1, np.abs),
    "relu": ("Relu", 1, lambda x: np.maximum(x, 0)),
    "sigmoid": ("Sigmoid", 1, lambda x: 1 / (1 + np.exp(-x))),
    "tanh": ("Tanh", 1, np.tanh),
    "exp": ("Exp", 1, np.exp),
    "log": ("Log", 1, np.log),
    "sqrt": ("Sqrt", 1, np.sqrt),
    "erf": ("Erf", 1, None),
}


class ExprError(ValueError):
    """An ``expr`` that is not a valid Elementwise body."""


@lru_cache(maxsize=4096)
def parse_expr(text: str):
    """The body as nested tuples: ``("call", name, args)``, ``("input", i)``, ``("number", v)``."""
    try:
        tree = ast.parse(text, mode="eval").body
    except SyntaxError as e:
        raise ExprError(f"expr {text!r} is not a call expression: {e.msg}") from None

    return _walk(tree, text)


def _walk(node, text: str):
    """The tuple form of a parsed body (:func:`parse_expr`; a module function, not a closure
    that calls itself, which would be a reference cycle per parse)."""
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and not node.keywords:
        name = node.func.id
        if name not in FUNCTIONS:
            raise ExprError(f"expr {text!r}: unknown function {name!r}; known: {sorted(FUNCTIONS)}")
        if len(node.args) != FUNCTIONS[name][1]:
            raise ExprError(f"expr {text!r}: {name} takes {FUNCTIONS[name][1]} arguments")
        return ("call", name, tuple(_walk(a, text) for a in node.args))
    if isinstance(node, ast.Name) and node.id.startswith("x") and node.id[1:].isdigit():
        return ("input", int(node.id[1:]))
    if isinstance(node, ast.Constant) and isinstance(node.value, int | float) and not isinstance(node.value, bool):
        return ("number", float(node.value))
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub) and isinstance(node.operand, ast.Constant):
        return ("number", -float(node.operand.value))
    raise ExprError(f"expr {text!r}: unexpected {ast.unparse(node)!r}")


def max_input(tree) -> int:
    """The highest input index the body reads (-1 when none)."""
    if tree[0] == "input":
        return tree[1]
    if tree[0] == "call":
        return max((max_input(a) for a in tree[2]), default=-1)
    return -1


#: Functions whose two arguments commute exactly (in IEEE arithmetic too: ``a + b == b + a``).
COMMUTATIVE = frozenset({"add", "mul", "max", "min"})


def render_expr(tree) -> str:
    """The text of a parsed body (:func:`parse_expr`'s inverse, numbers as Python floats).

    Example:
        >>> render_expr(parse_expr("mul(x1, add(x0, 2))"))
        'mul(x1, add(x0, 2.0))'
    """
    if tree[0] == "input":
        return f"x{tree[1]}"
    if tree[0] == "number":
        return repr(tree[1])
    return f"{tree[1]}({', '.join(render_expr(a) for a in tree[2])})"


def canonical_body(attrs: dict, keys: list) -> tuple[list[int], dict]:
    """The canonical form of an Elementwise node whose inputs are ``keys`` (e-classes): the
    inputs in the order of their keys (stable), and the arguments of a commutative function
    in the order of their text. Returns the positions of the inputs, in their new order, and
    the attributes.

    The fusion rules reach one body along many paths (``mul(x0, add(x1, x2))`` over ``(c, a,
    b)`` and ``mul(add(x0, x1), x2)`` over ``(a, b, c)``); in one form they are one e-node:
    t5_encoder_int8's e-graph holds 10% fewer. An input that appears twice stays twice:
    merging them let the fusion rules' limit of 8 inputs admit many more bodies (ppocr_v4_rec
    then ran out of time with 3x the e-nodes) for plans 0.2-1% cheaper.

    Example:
        >>> canonical_body({"expr": "mul(x0, add(x1, x2))"}, [30, 10, 20])
        ([1, 2, 0], {'expr': 'mul(add(x0, x1), x2)'})
        >>> canonical_body({"expr": "sub(x1, x0)"}, [7, 7])
        ([0, 1], {'expr': 'sub(x1, x0)'})
    """
    positions = sorted(range(len(keys)), key=lambda i: keys[i])
    index = [0] * len(keys)
    for new, old in enumerate(positions):
        index[old] = new
    return positions, {**attrs, "expr": _canonical_text(attrs["expr"], tuple(index))}


@lru_cache(maxsize=65536)
def _canonical_text(text: str, index: tuple[int, ...]) -> str:
    """The text of body ``text`` with input ``i`` read as ``index[i]``, commutative arguments
    sorted: memoized, since the fusion rules extend the same bodies on every layer."""
    reads = _reads(text)
    if reads >= len(index):
        raise ExprError(f"expr reads x{reads} but the node has {len(index)} inputs")
    return render_expr(_renamed(parse_expr(text), index))


def _renamed(tree, index: list[int]):
    """``tree`` with input ``i`` read as input ``index[i]``, commutative arguments sorted."""
    if tree[0] == "input":
        return ("input", index[tree[1]])
    if tree[0] == "number":
        return tree
    args = tuple(_renamed(a, index) for a in tree[2])
    if tree[1] in COMMUTATIVE:
        args = tuple(sorted(args, key=render_expr))
    return ("call", tree[1], args)


def evaluate_expr(text: str, inputs: list[np.ndarray]) -> np.ndarray:
    """The body evaluated on numpy arrays (in float32 for half precision inputs)."""
    return np.asarray(_run(parse_expr(text), inputs))


def _run(tree, inputs: list[np.ndarray]):
    """:func:`evaluate_expr` of a parsed body (a module function, not a closure that calls
    itself: that reference cycle kept the inputs alive until the cycle collector ran)."""
    kind = tree[0]
    if kind == "input":
        return inputs[tree[1]]
    if kind == "number":
        return tree[1]
    args = [_run(a, inputs) for a in tree[2]]
    if tree[1] == "erf":
        from scipy.special import erf

        return erf(*args)
    return FUNCTIONS[tree[1]][2](*args)


def _infer(ctx):
    try:
        return [_output_type(ctx.attr("expr"), tuple(ctx.types))]
    except ExprError as e:
        raise fail(ctx, str(e)) from None


@lru_cache(maxsize=65536)
def _reads(text: str) -> int:
    """The highest input the body ``text`` reads: all that its type inference reads of it."""
    return max_input(parse_expr(text))


@lru_cache(maxsize=65536)
def _output_type(text: str, types: tuple[TensorType | None, ...]) -> TensorType:
    """The output type of the body ``text`` over inputs of ``types`` (the broadcast of
    them all); :class:`ExprError` says what does not fit, the body or the types.

    Memoized by the two, which are all that inference reads (no other attribute, no input
    value): the fusion rules infer the same bodies over the same types on every layer
    (t5_encoder_int8: 21k of 23k inferences in 11 rounds)."""
    reads = _reads(text)
    if reads >= len(types):
        raise ExprError(f"expr reads x{reads} but the node has {len(types)} inputs")
    if any(t is None or not t.dtype.is_float or t.dtype != types[0].dtype for t in types):
        raise ExprError("Elementwise computes on float tensors of one dtype")
    if any(t.shape is None for t in types):
        return TensorType(types[0].dtype, None)
    try:
        return TensorType(types[0].dtype, broadcast_shapes(*(t.shape for t in types)))
    except ValueError as e:
        raise ExprError(str(e)) from None


def _compute(ctx, *xs):
    dtype = xs[0].dtype
    wide = [x.astype(np.float32) if x.dtype.itemsize < 4 else x for x in xs]
    with np.errstate(all="ignore"):
        out = evaluate_expr(ctx.attr("expr"), wide)
    shape = np.broadcast_shapes(*(x.shape for x in xs))
    return [np.broadcast_to(out, shape).astype(dtype)]


def _function(node):
    """The body as standard ONNX ops (numbers become constants of the inputs' dtype)."""
    dtype = node.inputs[0].type.dtype
    nodes = []
    count = [0]

    def emit(tree) -> str:
        kind = tree[0]
        if kind == "input":
            return f"x{tree[1]}"
        count[0] += 1
        name = f"t{count[0]}"
        if kind == "number":
            value = numpy_helper.from_array(np.array(tree[1], dtype=dtype.numpy))
            nodes.append(helper.make_node("Constant", [], [name], value=value))
            return name
        args = [emit(a) for a in tree[2]]
        nodes.append(helper.make_node(FUNCTIONS[tree[1]][0], args, [name]))
        return name

    result = emit(parse_expr(node.attrs["expr"]))
    nodes.append(helper.make_node("Identity", [result], ["y"]))
    inputs = [f"x{i}" for i in range(len(node.inputs))]
    return helper.make_function("com.egraft", "Elementwise", inputs, ["y"], nodes, [helper.make_opsetid("", 18)])


register_op(
    "Elementwise", domain="com.egraft",
    attrs={"expr": AttrSpec("string", None, "the body over x0, x1...: relu(add(x0, x1))")},
    infer=_infer, compute=_compute, onnx_function=_function, canonical=canonical_body,
    infer_key=lambda attrs: _reads(attrs["expr"]),
    doc="a fused chain of elementwise ops; the body is the expr attribute",
)

"""Control flow: If, Loop and Scan.

Their bodies are IR graphs stored in the node's attributes (``then_branch`` and
``else_branch``, ``body``). A body may read values of the enclosing graph by name (its
captures). In the IR those reads are explicit: the node's inputs are its ONNX inputs
followed by the values its bodies capture (:func:`node_captures`, in a fixed order), so
every stage (the e-graph, extraction, scheduling, memory planning) sees the edges, and
the outer values may be renamed. The executor feeds each body its captures by the
body's own names through :meth:`RunContext.run_subgraph`.

Inference reads the types of the body's outputs. Dims that cannot be known before the
body runs (the trip count of a Loop, a dim on which the two branches of an If differ,
a loop-carried dim that changes from one iteration to the next) become fresh symbols.

Only tensor values are supported; sequence and optional values are reported as
unsupported by the importer.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Sequence

import numpy as np

from egraft.ir.dims import Dim, dim_symbols, dims_equal, sym
from egraft.ir.dtypes import DType
from egraft.ir.graph import Graph
from egraft.ir.ops._common import fail, normalize_axis
from egraft.ir.registry import InferContext, RunContext, register_op
from egraft.ir.types import TensorType


# ---- helpers shared by the three ops -----------------------------------------------------------
def _body(ctx, name: str) -> Graph:
    body = ctx.node.attrs.get(name)
    if not isinstance(body, Graph):
        raise fail(ctx, f"the attribute {name!r} is missing or is not a graph")
    return body


def _merge_types(ctx, a: TensorType, b: TensorType, what: str) -> TensorType:
    """The type of a value that is ``a`` or ``b``: dims that differ become fresh symbols."""
    if a.dtype != b.dtype:
        raise fail(ctx, f"{what} is {a.dtype.short} on one path and {b.dtype.short} on the other")
    if a.shape is None or b.shape is None or len(a.shape) != len(b.shape):
        return TensorType(a.dtype, None)
    return TensorType(a.dtype, tuple(x if dims_equal(x, y) else ctx.fresh_dim() for x, y in zip(a.shape, b.shape)))


def _carried_type(ctx, initial: TensorType | None, body_in: TensorType, body_out: TensorType,
                  what: str) -> TensorType:
    """The final type of a loop-carried value (Loop) or state (Scan).

    A dim the body keeps (its output dim is its input dim) keeps the initial value's dim;
    a dim the body sets to the initial dim again keeps it too; any other dim may change
    from one iteration to the next and becomes a fresh symbol.
    """
    if initial is None:
        return body_out
    if initial.dtype != body_out.dtype:
        raise fail(ctx, f"{what} starts as {initial.dtype.short} but the body makes it {body_out.dtype.short}")
    if initial.shape is None or body_out.shape is None or len(initial.shape) != len(body_out.shape):
        return TensorType(initial.dtype, None)
    same_rank_in = body_in.shape is not None and len(body_in.shape) == len(body_out.shape)
    dims = []
    for axis, (init, out) in enumerate(zip(initial.shape, body_out.shape)):
        if dims_equal(out, init):
            dims.append(init)
        elif same_rank_in and dims_equal(out, body_in.shape[axis]):
            dims.append(init)
        else:
            dims.append(ctx.fresh_dim())
    return TensorType(initial.dtype, tuple(dims))


def node_captures(node) -> list:
    """The values an If/Loop/Scan node's bodies read from outside, as the bodies name them
    (nested bodies included; bodies in attribute-name order, each in first-read order).
    Remembered per node (a body is not changed once its node is made: a Loop's compute
    asks on every iteration)."""
    known = _CAPTURES.get(node)
    if known is None:
        known = _CAPTURES[node] = _node_captures(node)
    return list(known)


_CAPTURES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _node_captures(node) -> list:
    found: dict = {}
    for _, body in sorted(node.attrs.items()):
        if isinstance(body, Graph):
            for v in body.captures():
                found.setdefault(v.name, v)
    return list(found.values())


def onnx_input_count(node) -> int:
    """The number of the node's inputs that are its ONNX inputs (the rest are captures)."""
    return len(node.inputs) - len(node_captures(node))


def _split_captures(ctx: RunContext, args: Sequence) -> tuple[list, dict[str, np.ndarray]]:
    """(the ONNX arguments, body name -> array of each captured value)."""
    names = [v.name for v in node_captures(ctx.node)]
    k = len(ctx.node.inputs) - len(names)
    return list(args[:k]), dict(zip(names, args[k:]))


def _type_symbols(t: TensorType | None) -> set[str]:
    return set() if t is None or t.shape is None else dim_symbols(t.shape)


def _graph_symbols(body: Graph) -> set[str]:
    """The name of every symbol in the types of ``body``'s values, nested bodies included."""
    found: set[str] = set()
    for v in body.values():
        found |= _type_symbols(v.type)
    for node in body.nodes:
        for attr in node.attrs.values():
            for sub in (attr if isinstance(attr, list | tuple) else [attr]):
                if isinstance(sub, Graph):
                    found |= _graph_symbols(sub)
    return found


def _without_body_local_dims(ctx, types: list[TensorType | None], bodies: Sequence[Graph]) -> list[TensorType | None]:
    """``types`` with the body-local symbols of ``bodies`` replaced by fresh symbols.

    A body may name its own dims (tf2onnx's ``unk__1889``). Outside the node nothing binds
    them, and two bodies may use one name for unrelated dims, so a body-local symbol in
    the node's output types becomes a fresh symbol of this node (one per name: the outputs
    of one run of the body agree with each other). Symbols of the node's inputs and of
    the outer values the bodies read are not body-local.
    """
    outer = set()
    for t in ctx.types:
        outer |= _type_symbols(t)
    local = set()
    for body in bodies:
        for v in body.captures():
            outer |= _type_symbols(v.type)
        local |= _graph_symbols(body)
    local -= outer
    renamed: dict = {}
    out = []
    for t in types:
        if t is None or not (_type_symbols(t) & local):
            out.append(t)
            continue
        for name in sorted(_type_symbols(t) & local):
            if sym(name) not in renamed:
                renamed[sym(name)] = ctx.fresh_dim()
        out.append(TensorType(t.dtype, tuple(d if isinstance(d, int) else d.xreplace(renamed) for d in t.shape)))
    return out


def _outputs_of(ctx: RunContext, body: Graph, feeds: dict[str, np.ndarray],
                captured: dict[str, np.ndarray]) -> list[np.ndarray]:
    if ctx.run_subgraph is None:
        raise RuntimeError(f"{ctx.node.label}: no subgraph runner was given")
    results = ctx.run_subgraph(body, {**captured, **feeds})
    return [results[v.name] for v in body.outputs]


def _stack(parts: list[np.ndarray], axis: int, ttype: TensorType) -> np.ndarray:
    """``parts`` stacked along a new ``axis``; an empty stack takes its shape from ``ttype``."""
    if parts:
        return np.stack(parts, axis=axis)
    shape = [d if isinstance(d, int) else 0 for d in (ttype.shape or (0,))]
    shape[axis] = 0
    return np.zeros(shape, dtype=ttype.dtype.numpy)


def _insert_dim(shape: tuple | None, axis: int, dim: Dim) -> tuple | None:
    if shape is None:
        return None
    return tuple(shape[:axis]) + (dim,) + tuple(shape[axis:])


def _drop_dims(t: TensorType | None, *axes: int) -> TensorType | None:
    if t is None or t.shape is None:
        return t
    return TensorType(t.dtype, tuple(d for i, d in enumerate(t.shape) if i not in axes))


def _with_fresh_dims(t: TensorType | None, fresh: Callable[[], Dim]) -> TensorType | None:
    """``t`` with its static dims replaced by fresh symbols: a loop-carried value may change
    shape from one iteration to the next (symbolic dims are bound anew on each run of the body)."""
    if t is None or t.shape is None:
        return t
    return TensorType(t.dtype, tuple(fresh() if isinstance(d, int) else d for d in t.shape))


# ---- If ---------------------------------------------------------------------------------------
def _if_infer(ctx: InferContext) -> list[TensorType]:
    then_b, else_b = _body(ctx, "then_branch"), _body(ctx, "else_branch")
    for name, b in (("then_branch", then_b), ("else_branch", else_b)):
        if len(b.outputs) != ctx.num_outputs:
            raise fail(ctx, f"{name} has {len(b.outputs)} outputs but the node has {ctx.num_outputs}")
    cond = ctx.value(0)
    if cond is not None and cond.dtype != object and cond.size == 1:
        chosen = then_b if bool(np.asarray(cond).reshape(-1)[0]) else else_b
        return _without_body_local_dims(ctx, _branch_types(ctx, chosen), [chosen])
    merged = [_merge_types(ctx, t, e, f"output {i}")
              for i, (t, e) in enumerate(zip(_branch_types(ctx, then_b), _branch_types(ctx, else_b)))]
    return _without_body_local_dims(ctx, merged, [then_b, else_b])


def _branch_types(ctx: InferContext, body: Graph) -> list[TensorType]:
    """The types of ``body``'s outputs when the outer values it captures have the types
    the node's inputs have now. Rewriting and ``shape=`` bindings may have made them more
    precise than when the body was imported (a rank known only at run time then, a static
    dim now): the body's nodes are then typed again, which may give its outputs a rank
    (e.g. a nested If whose condition is now known). Its own types when nothing changed,
    or when typing it again fails."""
    from egraft.ir.infer import infer_node

    captures = node_captures(ctx.node)
    first = len(ctx.node.inputs) - len(captures)
    now = {v.name: ctx.types[first + j] for j, v in enumerate(captures)
           if first + j < len(ctx.types) and ctx.types[first + j] is not None}
    seen = body.captures()
    if all(now.get(v.name, v.type) == v.type for v in seen):
        return [v.type for v in body.outputs]
    values = {v.name: v.replace(type=now.get(v.name, v.type)) for v in seen}
    scratch = Graph(body.name, list(body.inputs), [], [], constants=body.constants, opsets=dict(body.opsets))
    try:
        for node in body.nodes:
            inputs = tuple(None if v is None else values.get(v.name, v) for v in node.inputs)
            types = infer_node(scratch, node.replace(inputs=inputs), ctx.fresh_dim)
            outputs = tuple(None if v is None else v.replace(type=t) for v, t in zip(node.outputs, types))
            values.update((v.name, v) for v in outputs if v is not None)
            scratch.nodes.append(node.replace(inputs=inputs, outputs=outputs))
    except Exception:  # typing it again is a refinement: the body's own types still hold
        return [v.type for v in body.outputs]
    return [values.get(v.name, v).type for v in body.outputs]


def _if(ctx: RunContext, cond: np.ndarray, *captures) -> list[np.ndarray]:
    _, captured = _split_captures(ctx, (cond, *captures))
    if np.size(cond) != 1:
        raise ValueError(f"the condition must have one element, got shape {list(np.shape(cond))}")
    branch = ctx.attr("then_branch") if bool(np.asarray(cond).reshape(-1)[0]) else ctx.attr("else_branch")
    return _outputs_of(ctx, branch, {}, captured)


register_op("If", infer=_if_infer, compute=_if, doc="the outputs of then_branch if cond else of else_branch")


# ---- Loop -------------------------------------------------------------------------------------
def _loop_counts(ctx, body: Graph) -> tuple[int, int]:
    """(N loop-carried values, K scan outputs) of a Loop node."""
    n = max(onnx_input_count(ctx.node) - 2, 0)
    if len(body.inputs) != n + 2:
        raise ValueError(f"the body has {len(body.inputs)} inputs, expected {n + 2} (iteration, condition "
                         f"and {n} loop-carried values)")
    k = len(body.outputs) - 1 - n
    if k < 0:
        raise ValueError(f"the body has {len(body.outputs)} outputs, expected at least {n + 1}")
    return n, k


def _loop_infer(ctx: InferContext) -> list[TensorType]:
    body = _body(ctx, "body")
    try:
        n, k = _loop_counts(ctx, body)
    except ValueError as e:
        raise fail(ctx, str(e)) from None
    if ctx.num_outputs != n + k:
        raise fail(ctx, f"the node has {ctx.num_outputs} outputs, expected {n} loop-carried + {k} scan outputs")
    carried = []
    for j in range(n):
        initial = ctx.types[2 + j] if 2 + j < len(ctx.types) else None
        carried.append(_carried_type(ctx, initial, body.inputs[2 + j].type, body.outputs[1 + j].type,
                                     f"loop-carried value {j}"))
    trips: Dim = ctx.fresh_dim()
    m = ctx.value(0) if ctx.has_input(0) else None
    if m is not None and m.dtype != object and not ctx.has_input(1):
        trips = max(int(np.asarray(m).reshape(-1)[0]), 0)  # a for loop: exactly M iterations
    scans = [TensorType(v.type.dtype, _insert_dim(v.type.shape, 0, trips)) for v in body.outputs[1 + n:]]
    return _without_body_local_dims(ctx, carried + scans, [body])


def _loop(ctx: RunContext, *args) -> list[np.ndarray]:
    """Run the body while ``i < M`` and ``cond`` (each when given); stack the scan outputs.

    Without a ``cond`` input the body's condition output is ignored (a for loop).
    """
    args, captured = _split_captures(ctx, args)
    args += [None] * (2 - len(args))
    m, cond, initial = args[0], args[1], args[2:]
    body: Graph = ctx.attr("body")
    n = len(initial)
    trip_limit = None if m is None else int(np.asarray(m).reshape(-1)[0])
    keep_going = True if cond is None else bool(np.asarray(cond).reshape(-1)[0])
    carried = list(initial)
    scans: list[list[np.ndarray]] = [[] for _ in body.outputs[1 + n:]]
    names = [v.name for v in body.inputs]
    i = 0
    while keep_going and (trip_limit is None or i < trip_limit):
        feeds = {names[0]: np.array(i, dtype=np.int64), names[1]: np.array(keep_going)}
        feeds.update(zip(names[2:], carried))
        outs = _outputs_of(ctx, body, feeds, captured)
        if cond is not None:
            keep_going = bool(np.asarray(outs[0]).reshape(-1)[0])
        carried = outs[1:1 + n]
        for parts, value in zip(scans, outs[1 + n:]):
            parts.append(value)
        i += 1
    types = [v.type if v is not None else None for v in ctx.node.outputs[n:]]
    stacked = [_stack(parts, 0, _scan_type(types, j, body.outputs[1 + n + j].type)) for j, parts in enumerate(scans)]
    return carried + stacked


def _scan_type(node_types: Sequence, j: int, body_type: TensorType) -> TensorType:
    """The type an empty stack of scan output ``j`` gets (the node's, else the body's plus one axis)."""
    t = node_types[j] if j < len(node_types) else None
    if t is not None:
        return t
    return TensorType(body_type.dtype, _insert_dim(body_type.shape, 0, 0))


register_op("Loop", infer=_loop_infer, compute=_loop,
            doc="run body while i < M and cond; outputs the final loop-carried values and stacked scan outputs")


# ---- Scan -------------------------------------------------------------------------------------
def _scan_layout(ctx, body: Graph) -> tuple[int, int, int]:
    """(N states, M scan inputs, K scan outputs) of a Scan node."""
    m = int(ctx.attr("num_scan_inputs"))
    first = 1 if ctx.opset < 9 else 0  # opset 8: sequence_lens comes first
    n = onnx_input_count(ctx.node) - first - m
    if n < 0:
        raise ValueError(f"num_scan_inputs is {m} but the node has only {onnx_input_count(ctx.node) - first} inputs")
    if len(body.inputs) != n + m:
        raise ValueError(f"the body has {len(body.inputs)} inputs, expected {n} states + {m} scan inputs")
    k = len(body.outputs) - n
    if k < 0:
        raise ValueError(f"the body has {len(body.outputs)} outputs, expected at least {n}")
    return n, m, k


def _axes_attr(ctx, name: str, count: int) -> list[int]:
    values = ctx.attr(name, None)
    if values is None:
        return [0] * count
    if len(values) != count:
        raise ValueError(f"{name} has {len(values)} entries, expected {count}")
    return [int(v) for v in values]


def _scan_infer(ctx: InferContext) -> list[TensorType]:
    body = _body(ctx, "body")
    try:
        n, m, k = _scan_layout(ctx, body)
        if ctx.opset < 9:
            return _scan8_infer(ctx, body, n, m, k)
        in_axes = _axes_attr(ctx, "scan_input_axes", m)
        out_axes = _axes_attr(ctx, "scan_output_axes", k)
        _axes_attr(ctx, "scan_input_directions", m)
        _axes_attr(ctx, "scan_output_directions", k)
    except ValueError as e:
        raise fail(ctx, str(e)) from None
    states = [_carried_type(ctx, ctx.types[j], body.inputs[j].type, body.outputs[j].type, f"state {j}")
              for j in range(n)]
    seq: Dim = ctx.fresh_dim()
    if m:
        first = ctx.types[n]
        if first is not None and first.shape is not None:
            seq = first.shape[normalize_axis(in_axes[0], len(first.shape), ctx)]
    scans = []
    for j, v in enumerate(body.outputs[n:]):
        shape = v.type.shape
        if shape is not None:
            shape = _insert_dim(shape, normalize_axis(out_axes[j], len(shape) + 1, ctx), seq)
        scans.append(TensorType(v.type.dtype, shape))
    return _without_body_local_dims(ctx, states + scans, [body])


def _scan8_infer(ctx: InferContext, body: Graph, n: int, m: int, k: int) -> list[TensorType]:
    """Opset 8: every input and output has a leading batch axis; scan axes are axis 1."""
    count = onnx_input_count(ctx.node)
    types = ctx.types[1:count] + [None] * (count - len(ctx.types))
    batch: Dim = ctx.fresh_dim()
    seq: Dim = ctx.fresh_dim()
    for t in types[: n + m]:
        if t is not None and t.shape:
            batch = t.shape[0]
            break
    if m and types[n] is not None and types[n].shape is not None and len(types[n].shape) >= 2:
        seq = types[n].shape[1]
    states = []
    for j in range(n):
        state = _carried_type(ctx, _drop_dims(types[j], 0), body.inputs[j].type, body.outputs[j].type,
                              f"state {j}")
        states.append(TensorType(state.dtype, _insert_dim(state.shape, 0, batch)))
    scans = [TensorType(v.type.dtype, _insert_dim(_insert_dim(v.type.shape, 0, seq), 0, batch))
             for v in body.outputs[n:]]
    return _without_body_local_dims(ctx, states + scans, [body])


def _scan_steps(ctx: RunContext, body: Graph, states: list[np.ndarray], xs: list[np.ndarray],
                axes: list[int], reverse: list[bool], length: int, k: int, captured: dict[str, np.ndarray]):
    """Run the body ``length`` times; return the final states and each scan output's parts."""
    n = len(states)
    names = [v.name for v in body.inputs]
    parts: list[list[np.ndarray]] = [[] for _ in range(k)]
    for t in range(length):
        feeds = dict(zip(names[:n], states))
        for j, (x, axis, rev) in enumerate(zip(xs, axes, reverse)):
            feeds[names[n + j]] = np.take(x, length - 1 - t if rev else t, axis=axis)
        outs = _outputs_of(ctx, body, feeds, captured)
        states = outs[:n]
        for p, value in zip(parts, outs[n:]):
            p.append(value)
    return states, parts


def _scan(ctx: RunContext, *inputs) -> list[np.ndarray]:
    body: Graph = ctx.attr("body")
    m = int(ctx.attr("num_scan_inputs"))
    inputs, captured = _split_captures(ctx, inputs)
    if ctx.opset < 9:
        return _scan8(ctx, body, inputs[0] if inputs else None, list(inputs[1:]), m, captured)
    n = len(inputs) - m
    k = len(body.outputs) - n
    states, xs = list(inputs[:n]), list(inputs[n:])
    in_axes = [normalize_axis(a, x.ndim) for a, x in zip(_axes_attr(ctx, "scan_input_axes", m), xs)]
    in_rev = [bool(d) for d in _axes_attr(ctx, "scan_input_directions", m)]
    lengths = {x.shape[a] for x, a in zip(xs, in_axes)}
    if len(lengths) > 1:
        raise ValueError(f"the scan inputs have different sequence lengths {sorted(lengths)}")
    length = lengths.pop() if lengths else 0
    states, parts = _scan_steps(ctx, body, states, xs, in_axes, in_rev, length, k, captured)
    out_axes = _axes_attr(ctx, "scan_output_axes", k)
    out_rev = _axes_attr(ctx, "scan_output_directions", k)
    outputs = list(states)
    for j, p in enumerate(parts):
        out = ctx.node.outputs[n + j] if n + j < len(ctx.node.outputs) else None
        ttype = out.type if out is not None else body.outputs[n + j].type
        rank = len(ttype.shape) if ttype.shape is not None else (p[0].ndim + 1 if p else 1)
        axis = normalize_axis(out_axes[j], rank)
        outputs.append(_stack(p[::-1] if out_rev[j] else p, axis, ttype))
    return outputs


def _scan8(ctx: RunContext, body: Graph, sequence_lens, rest: list[np.ndarray], m: int,
           captured: dict[str, np.ndarray]) -> list[np.ndarray]:
    """Opset-8 Scan: each batch entry is scanned on its own over its sequence length; scan
    outputs past a sequence's end are zero."""
    n = len(rest) - m
    k = len(body.outputs) - n
    states, xs = rest[:n], rest[n:]
    batch = (states + xs)[0].shape[0]
    max_len = xs[0].shape[1] if xs else 0
    lens = np.full(batch, max_len) if sequence_lens is None else np.asarray(sequence_lens).reshape(-1)
    reverse = [bool(d) for d in _axes_attr(ctx, "directions", m)]
    final_states: list[list[np.ndarray]] = [[] for _ in range(n)]
    outs: list[list[np.ndarray]] = [[] for _ in range(k)]
    for b in range(batch):
        length = int(lens[b])
        s, parts = _scan_steps(ctx, body, [x[b] for x in states], [x[b, :length] for x in xs], [0] * m,
                               reverse, length, k, captured)
        for j in range(n):
            final_states[j].append(s[j])
        for j, p in enumerate(parts):
            body_type = body.outputs[n + j].type
            stacked = _stack(p, 0, TensorType(body_type.dtype, _insert_dim(body_type.shape, 0, 0)))
            padded = np.zeros((max_len,) + stacked.shape[1:], dtype=stacked.dtype)
            padded[:length] = stacked
            outs[j].append(padded)
    return [np.stack(s) for s in final_states] + [np.stack(o) for o in outs]


register_op("Scan", infer=_scan_infer, compute=_scan,
            doc="run body over slices of the scan inputs, carrying states; stack the scan outputs")


# ---- body input types for the importer ------------------------------------------------------------
def body_input_types(op: str, attrs: dict, input_types: Sequence[TensorType | None], opset: int,
                     fresh: Callable[[], Dim]) -> dict[str, list[TensorType | None]]:
    """Types for the inputs of an If/Loop/Scan body that the model leaves untyped, by
    attribute name; the importer uses them for body inputs without a type or shape.

    Loop-carried values and Scan states get their initial type with fresh symbols for its
    static dims (they may change shape from one iteration to the next); scan slices get
    the scan input's shape less the scan axis.
    """
    types = list(input_types)
    if op == "Loop":
        carried = [_with_fresh_dims(t, fresh) for t in types[2:]]
        return {"body": [TensorType(DType.INT64, ()), TensorType(DType.BOOL, ()), *carried]}
    if op == "Scan":
        m = int(attrs.get("num_scan_inputs", 0))
        if opset < 9:
            rest = types[1:]
            n = len(rest) - m
            states = [_with_fresh_dims(_drop_dims(t, 0), fresh) for t in rest[:n]]
            slices = [_drop_dims(t, 0, 1) for t in rest[n:]]
            return {"body": states + slices}
        n = len(types) - m
        axes = list(attrs.get("scan_input_axes") or [0] * m)
        states = [_with_fresh_dims(t, fresh) for t in types[:n]]
        slices = []
        for t, axis in zip(types[n:], axes):
            if t is None or t.shape is None or not -len(t.shape) <= axis < len(t.shape):
                slices.append(t)
            else:
                slices.append(_drop_dims(t, axis % len(t.shape)))
        return {"body": states + slices}
    return {}

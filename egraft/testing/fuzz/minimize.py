"""A delta-debugging minimizer: :func:`minimize` shrinks a failing case while it keeps
failing the same way (same backend, same outcome, for a crash the same exception type) and
onnxruntime keeps accepting it.

Reductions, repeated until none applies: keep only the failing output; drop one of the two
bindings; remove a node by routing its output to an input of the same dtype and shape, or
by making its outputs graph inputs (fed with the values onnxruntime computed there); drop
dead nodes; delete attributes (back to their defaults); replace float initializers by
simpler ones. :func:`save_case` writes the result as a runnable ``.onnx`` with its feeds.

Example:
    >>> small = minimize(case, result)                  # doctest: +SKIP
    >>> save_case(small, "/tmp/fuzz_failures/seed7")     # doctest: +SKIP
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np
import onnx
from onnx import helper, numpy_helper

from egraft.testing.fuzz.oracle import Result, check, ort_run


@dataclass
class Case:
    """A model and the feeds of each binding (what :func:`minimize` shrinks)."""

    model: onnx.ModelProto
    feeds: list[dict[str, np.ndarray]]
    bindings: list[dict[str, int]] = field(default_factory=list)
    seed: int | None = None


def _copy(model: onnx.ModelProto) -> onnx.ModelProto:
    m = onnx.ModelProto()
    m.CopyFrom(model)
    return m


def _dead_code(model: onnx.ModelProto) -> onnx.ModelProto:
    """``model`` without the nodes, initializers and inputs no output depends on."""
    g = model.graph
    live = {o.name for o in g.output}
    keep = []
    for n in reversed(g.node):
        if any(o in live for o in n.output):
            keep.append(n)
            live.update(i for i in n.input if i)
    m = _copy(model)
    del m.graph.node[:]
    m.graph.node.extend(reversed(keep))
    inits = [t for t in g.initializer if t.name in live]
    del m.graph.initializer[:]
    m.graph.initializer.extend(inits)
    inputs = [i for i in g.input if i.name in live]
    del m.graph.input[:]
    m.graph.input.extend(inputs)
    return m


def _prune_feeds(case: Case) -> Case:
    names = {i.name for i in case.model.graph.input}
    return replace(case, feeds=[{k: v for k, v in f.items() if k in names} for f in case.feeds])


def _values(case: Case) -> list[dict[str, np.ndarray]]:
    """Every node output's value under each binding, as onnxruntime computes them."""
    m = _copy(case.model)
    inferred = onnx.shape_inference.infer_shapes(m)
    types = {v.name: v.type.tensor_type.elem_type for v in inferred.graph.value_info}
    have = {o.name for o in m.graph.output}
    for n in m.graph.node:
        for o in n.output:
            if o and o not in have and types.get(o):
                m.graph.output.append(helper.make_tensor_value_info(o, types[o], None))
    return ort_run(m, case.feeds)


def _dim_names(case: Case) -> dict[tuple[int, ...], str]:
    """A symbol name per tuple of sizes (one size per binding) the bindings give."""
    names = {}
    for s in (case.bindings[0] if case.bindings else {}):
        sizes = tuple(b[s] for b in case.bindings[:len(case.feeds)])
        if len(set(sizes)) > 1:
            names.setdefault(sizes, s)
    return names


def _input_info(name: str, arrays: list[np.ndarray], dims: dict) -> onnx.ValueInfoProto:
    shape = []
    for axis in range(arrays[0].ndim):
        sizes = tuple(a.shape[axis] for a in arrays)
        if len(set(sizes)) == 1:
            shape.append(sizes[0])
        else:
            shape.append(dims.setdefault(sizes, f"d{'_'.join(map(str, sizes))}"))
    return helper.make_tensor_value_info(name, helper.np_dtype_to_tensor_dtype(arrays[0].dtype), shape)


def _rename_uses(model: onnx.ModelProto, old: str, new: str) -> None:
    for n in model.graph.node:
        for i, x in enumerate(n.input):
            if x == old:
                n.input[i] = new
    for o in model.graph.output:
        if o.name == old:
            o.name = new


def _bypass(case: Case, index: int, values) -> list[Case]:
    """Ways to remove node ``index`` by routing each output to one of its inputs of the same
    dtype and shapes."""
    node = case.model.graph.node[index]
    known = {**{k: v for k, v in case.feeds[0].items()}, **values[0],
             **{t.name: numpy_helper.to_array(t) for t in case.model.graph.initializer}}
    knowns = [{**known, **f, **v} for f, v in zip(case.feeds, values)]
    plan = {}
    for o in node.output:
        if not o:
            continue
        if o not in known:
            return []
        for i in node.input:
            if i and i in known and all(k[i].shape == k[o].shape and k[i].dtype == k[o].dtype for k in knowns
                                        if i in k and o in k):
                plan[o] = i
                break
        else:
            return []
    m = _copy(case.model)
    del m.graph.node[index]
    for o, i in plan.items():
        _rename_uses(m, o, i)
    outs = []  # an output listed twice after the renaming is listed once
    for o in m.graph.output:
        if o.name not in {x.name for x in outs}:
            outs.append(o)
    del m.graph.output[:]
    m.graph.output.extend(outs)
    return [_prune_feeds(replace(case, model=_dead_code(m)))]


def _typed(model: onnx.ModelProto, name: str) -> onnx.ValueInfoProto:
    """An output entry for ``name`` with its dtype and rank (from onnx's inference)."""
    inferred = onnx.shape_inference.infer_shapes(model)
    for v in [*inferred.graph.value_info, *inferred.graph.input]:
        if v.name == name:
            t = v.type.tensor_type
            rank = len(t.shape.dim) if t.HasField("shape") else None
            return helper.make_tensor_value_info(name, t.elem_type, None if rank is None else [None] * rank)
    return onnx.ValueInfoProto(name=name)


def _drop_last(case: Case, index: int) -> list[Case]:
    """Remove node ``index`` when only graph outputs read it, its inputs (those that are no
    initializers) becoming the outputs instead."""
    g = case.model.graph
    node = g.node[index]
    if any(o in n.input for n in g.node for o in node.output if o):
        return []
    inits = {t.name for t in g.initializer}
    new = [i for i in node.input if i and i not in inits]
    if not new:
        return []
    m = _copy(case.model)
    del m.graph.node[index]
    outs = [o for o in m.graph.output if o.name not in node.output]
    del m.graph.output[:]
    m.graph.output.extend(outs)
    if new[0] not in {o.name for o in outs}:
        m.graph.output.append(_typed(case.model, new[0]))
    return [_prune_feeds(replace(case, model=_dead_code(m)))]


def _cut(case: Case, index: int, values) -> list[Case]:
    """Remove node ``index``, its outputs becoming graph inputs fed with their values."""
    node = case.model.graph.node[index]
    if any(o and o not in values[0] for o in node.output):
        return []
    m = _copy(case.model)
    del m.graph.node[index]
    dims = _dim_names(case)
    feeds = [dict(f) for f in case.feeds]
    for o in node.output:
        if not o:
            continue
        arrays = [v[o] for v in values]
        m.graph.input.append(_input_info(o, arrays, dims))
        for f, a in zip(feeds, arrays):
            f[o] = a
    return [_prune_feeds(replace(case, model=_dead_code(m), feeds=feeds))]


def _without_attribute(case: Case, index: int) -> list[Case]:
    out = []
    for k in range(len(case.model.graph.node[index].attribute)):
        m = _copy(case.model)
        del m.graph.node[index].attribute[k]
        out.append(replace(case, model=m))
    return out


def _simpler_initializers(case: Case) -> list[Case]:
    out = []
    for k, t in enumerate(case.model.graph.initializer):
        arr = numpy_helper.to_array(t)
        if arr.dtype != np.float32 or arr.size <= 1 or np.all(arr == arr.flat[0]):
            continue
        m = _copy(case.model)
        m.graph.initializer[k].CopyFrom(numpy_helper.from_array(np.full_like(arr, 0.5), t.name))
        out.append(replace(case, model=m))
    return out


def _outputs(case: Case, result: Result) -> list[Case]:
    outs = list(case.model.graph.output)
    if len(outs) <= 1:
        return []
    order = sorted(outs, key=lambda o: o.name != result.output)
    cands = []
    for keep in [[o] for o in order] + [[o for o in outs if o is not drop] for drop in reversed(order)]:
        m = _copy(case.model)
        del m.graph.output[:]
        m.graph.output.extend(keep)
        cands.append(_prune_feeds(replace(case, model=_dead_code(m))))
    return cands


def _bindings(case: Case, result: Result) -> list[Case]:
    if len(case.feeds) < 2:
        return []
    order = [result.binding, 1 - result.binding] if result.binding in (0, 1) else [0, 1]
    return [replace(case, feeds=[case.feeds[k]], bindings=case.bindings[k:k + 1]) for k in order]


def _serve(conn) -> None:
    """The isolated checker's loop: a case and a backend in, its :class:`Result` out."""
    while True:
        try:
            case, backend, expected = conn.recv()
        except EOFError:
            return
        conn.send(check(case, [backend], expected=expected)[0])


_checker: list = []  # [process, connection] of the running isolated checker


def check_isolated(case, backend: str, expected=None) -> Result:
    """:func:`~egraft.testing.fuzz.oracle.check` of one backend in a child process (spawned
    once and reused): a crash that kills the process (a segfault in compiled code) is
    ``crash`` ``ProcessDied``. The child is replaced after any failure, so that a heap a
    failing case corrupted cannot fail the next one."""
    import multiprocessing

    if not _checker or not _checker[0].is_alive():
        ctx = multiprocessing.get_context("spawn")  # fork could deadlock on another thread's lock
        mine, theirs = ctx.Pipe()
        p = ctx.Process(target=_serve, args=(theirs,), daemon=True)
        p.start()
        theirs.close()
        _checker[:] = [p, mine]
    p, conn = _checker
    plain = Case(case.model, list(case.feeds), list(getattr(case, "bindings", []) or []), getattr(case, "seed", None))
    try:
        conn.send((plain, backend, expected))
        result = conn.recv()
    except (EOFError, OSError):
        result = None
    if result is None or result.outcome != "ok":
        conn.close()
        p.kill()
        p.join()
        _checker.clear()
    if result is None:
        code = p.exitcode
        return Result(backend, "crash", f"ProcessDied: signal {-code if code and code < 0 else code}")
    return result


def minimize(case, result: Result, seconds: float = 120.0, log=None, isolated: bool = False) -> Case:
    """The smallest case this search finds that fails like ``result`` (a :class:`Result` of
    :func:`~egraft.testing.fuzz.oracle.check` on ``case``), within ``seconds``. With
    ``isolated`` each check runs in a child process (for failures that kill the process)."""
    deadline = time.monotonic() + seconds
    target = result.signature
    current = Case(case.model, list(case.feeds), list(getattr(case, "bindings", []) or []), getattr(case, "seed", None))
    last = result

    def fails(c: Case) -> Result | None:
        try:
            expected = ort_run(c.model, c.feeds)
        except Exception:
            return None
        if isolated:
            r = check_isolated(c, result.backend, expected)
        else:
            r = check(c, [result.backend], expected=expected)[0]
        return r if r.signature == target else None

    def first(cands) -> bool:
        nonlocal current, last
        for c in cands:
            if time.monotonic() > deadline:
                return False
            r = fails(c)
            if r is not None:
                current, last = c, r
                if log:
                    log(f"  {len(c.model.graph.node)} nodes, {len(c.feeds)} binding(s)")
                return True
        return False

    changed = True
    while changed and time.monotonic() < deadline:
        changed = first(_outputs(current, last)) or first(_bindings(current, last))
        try:
            values = _values(current)
        except Exception:
            values = None
        if values is not None:
            for k in range(len(current.model.graph.node) - 1, -1, -1):
                if k < len(current.model.graph.node) and (first(_bypass(current, k, values))
                                                         or first(_drop_last(current, k))):
                    changed = True
                    break
            else:
                for k in range(len(current.model.graph.node)):
                    if first(_cut(current, k, values)):
                        changed = True
                        break
        if not changed:
            for k in range(len(current.model.graph.node)):
                if first(_without_attribute(current, k)):
                    changed = True
                    break
        if not changed:
            changed = first(_simpler_initializers(current))
    return current


def save_case(case: Case, folder: str | Path, result: Result | None = None) -> Path:
    """Write ``case`` to ``folder``: ``model.onnx``, ``feeds<k>.npz`` per binding and
    ``failure.json`` (the result it fails with, the bindings); returns the model's path."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "model.onnx"
    onnx.save(case.model, path)
    for k, f in enumerate(case.feeds):
        np.savez(folder / f"feeds{k}.npz", **f)
    info = {"seed": case.seed, "bindings": case.bindings, "nodes": [n.op_type for n in case.model.graph.node]}
    if result is not None:
        info.update(backend=result.backend, outcome=result.outcome, detail=result.detail, output=result.output,
                    binding=result.binding, error=result.error)
    (folder / "failure.json").write_text(json.dumps(info, indent=1, default=str) + "\n")
    (folder / "model.txt").write_text(onnx.printer.to_text(case.model.graph) + "\n")
    return path


def load_case(folder: str | Path) -> Case:
    """A case :func:`save_case` wrote."""
    folder = Path(folder)
    model = onnx.load(folder / "model.onnx")
    feeds = []
    k = 0
    while (folder / f"feeds{k}.npz").exists():
        with np.load(folder / f"feeds{k}.npz") as z:
            feeds.append({n: z[n] for n in z.files})
        k += 1
    info = json.loads((folder / "failure.json").read_text())
    return Case(model, feeds, info.get("bindings", []), info.get("seed"))

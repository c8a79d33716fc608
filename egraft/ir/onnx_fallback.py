"""Fallbacks for standard ONNX ops that egraft has no native entry for yet:
shape/dtype inference by ``onnx.shape_inference`` and execution by ``onnx.reference``.

Both build a one-node model. Symbolic dims go in as ``dim_param`` names and come back
as the same sympy expressions; a dim onnx cannot infer becomes a fresh symbol.
"""

from __future__ import annotations

import numpy as np
import onnx

from egraft.errors import ShapeInferenceError, UnsupportedOpError
from egraft.ir.dims import fmt_dim
from egraft.ir.dtypes import DType
from egraft.ir.onnx_bridge import single_node_model
from egraft.ir.registry import InferContext, RunContext
from egraft.ir.types import TensorType


def _input_names(n: int) -> list[str]:
    return [f"in{i}" for i in range(n)]


def _refuse_subgraphs(node) -> None:
    from egraft.ir.graph import Graph

    for name, value in node.attrs.items():
        if isinstance(value, Graph) or (isinstance(value, list) and value and isinstance(value[0], Graph)):
            raise UnsupportedOpError(f"{node.label}: attribute {name!r} is a subgraph, which is not supported "
                                     "here: egraft runs subgraphs only for If, Loop and Scan")


def onnx_infer(ctx: InferContext) -> list[TensorType]:
    """Infer output types with onnx's own shape inference (data propagation on)."""
    node = ctx.node
    _refuse_subgraphs(node)
    names = _input_names(len(ctx.types))
    inputs = [(n if t is not None else "", t) for n, t in zip(names, ctx.types)]
    inits = {}
    back: dict[str, object] = {}
    for i, t in enumerate(ctx.types):
        if t is None:
            continue
        if t.shape is not None:
            for d in t.shape:
                if not isinstance(d, int):
                    back[fmt_dim(d)] = d
        v = ctx.value(i)
        if v is not None and v.dtype != object and v.size <= 1 << 16:
            inits[names[i]] = v
    outputs = [f"out{i}" if v is not None else "" for i, v in enumerate(node.outputs)]
    model = single_node_model(node.op, node.domain, ctx.opset, inputs, outputs, node.attrs, inits)
    try:
        inferred = onnx.shape_inference.infer_shapes(model, strict_mode=True, data_prop=True)
    except Exception as e:  # onnx raises several error types
        msg = str(e).strip().splitlines()[-1] if str(e).strip() else type(e).__name__
        raise ShapeInferenceError(f"{node.label}: {msg}") from None
    found = {vi.name: vi for vi in inferred.graph.output}
    found.update({vi.name: vi for vi in inferred.graph.value_info})
    result = []
    for out in outputs:
        if not out:
            result.append(None)
            continue
        vi = found.get(out)
        kind = vi.type.WhichOneof("value") if vi is not None else None
        if kind in ("sequence_type", "optional_type", "map_type", "sparse_tensor_type"):
            raise UnsupportedOpError(f"{node.label}: output {out[3:]} is a {kind}; egraft supports tensor values only")
        if vi is None or not vi.type.HasField("tensor_type") or vi.type.tensor_type.elem_type == 0:
            raise ShapeInferenceError(f"{node.label}: cannot infer the type of output {out[3:]}")
        tt = vi.type.tensor_type
        dtype = DType.from_onnx(tt.elem_type, f" (output of {node.label})")
        if not tt.HasField("shape"):
            result.append(TensorType(dtype, None))
            continue
        dims = []
        for d in tt.shape.dim:
            if d.HasField("dim_value"):
                dims.append(d.dim_value)
            elif d.HasField("dim_param") and d.dim_param in back:
                dims.append(back[d.dim_param])
            else:
                dims.append(ctx.fresh_dim())
        result.append(TensorType(dtype, tuple(dims)))
    return result


_EVALUATORS: dict[int, tuple[object, object]] = {}


def onnx_compute(ctx: RunContext, *inputs: np.ndarray | None) -> list[np.ndarray]:
    """Run the node with ``onnx.reference.ReferenceEvaluator``."""
    from onnx.reference import ReferenceEvaluator

    node = ctx.node
    _refuse_subgraphs(node)
    cached = _EVALUATORS.get(id(node))
    if cached is None or cached[0] is not node:
        names = _input_names(len(inputs))
        types = [TensorType.of(x) if x is not None else None for x in inputs]
        model_inputs = [(n if t is not None else "", t) for n, t in zip(names, types)]
        outputs = [f"out{i}" if v is not None else "" for i, v in enumerate(node.outputs)]
        model = single_node_model(node.op, node.domain, ctx.opset, model_inputs, outputs, node.attrs)
        try:
            evaluator = ReferenceEvaluator(model)
        except ImportError as e:
            raise UnsupportedOpError(f"{node.label} is not supported here: onnx.reference needs "
                                     f"a missing package: {e}") from None
        cached = (node, evaluator)
        if len(_EVALUATORS) > 4096:
            _EVALUATORS.clear()
        _EVALUATORS[id(node)] = cached
    evaluator = cached[1]
    feeds = {f"in{i}": x for i, x in enumerate(inputs) if x is not None}
    try:
        results = evaluator.run(None, feeds)
    except ImportError as e:
        raise UnsupportedOpError(f"{node.label} is not supported here: onnx.reference needs "
                                     f"a missing package: {e}") from None
    out = []
    it = iter(results)
    for v in node.outputs:
        out.append(next(it) if v is not None else None)
    return out

"""Shape and dtype inference of every registered op, against onnx.shape_inference.

For each op with native inference, every ONNX backend node case that tests it (a
one-op model) is imported; each output type egraft infers must equal the type
``onnx.shape_inference`` infers where onnx gives a static answer, and the shape the
executor actually produces (the executor checks that on every run).
"""

from __future__ import annotations

from collections import defaultdict

import onnx
import pytest

import egraft
from egraft.conformance import collect_cases, is_core
from egraft.errors import UnsupportedOpError
from egraft.ir.registry import all_ops


def _cases_by_op():
    by_op = defaultdict(list)
    for case in collect_cases():
        ops = {n.op_type for n in case.model.graph.node if n.op_type != "Constant"}
        if len(ops) == 1 and is_core(case.model):
            by_op[ops.pop()].append(case)
    return by_op


CASES = _cases_by_op()
NATIVE = sorted(op.name for op in all_ops() if op.infer is not None and op.domain == "")
#: Registered ops that no one-op core conformance case exercises; their own tests cover them.
NO_CASE = {"Upsample", "Scatter", "Attention"}
#: Ops whose output sizes depend on the data: onnx infers no static shape to compare with.
DATA_DEPENDENT = {"NonZero", "Compress", "Unique", "NonMaxSuppression", "Loop"}
#: Ops whose one-op cases onnx's own inference fails on (GroupNormalization-18 is deprecated,
#: MeanVarianceNormalization's default-axes function body trips it); tests/test_ops_nn_dense.py covers them.
ONNX_CANNOT_INFER = {"GroupNormalization", "MeanVarianceNormalization"}


def _onnx_static_types(model: onnx.ModelProto) -> dict[str, tuple[int, tuple[int, ...] | None]]:
    """What onnx infers for each value, from the inputs alone (declared output shapes removed)."""
    model = onnx.ModelProto.FromString(model.SerializeToString())
    for out in model.graph.output:
        out.type.tensor_type.ClearField("shape")
    inferred = onnx.shape_inference.infer_shapes(model, strict_mode=False, data_prop=True)
    out = {}
    for vi in list(inferred.graph.value_info) + list(inferred.graph.output):
        tt = vi.type.tensor_type
        if not vi.type.HasField("tensor_type") or not tt.HasField("shape"):
            continue
        dims = tt.shape.dim
        if all(d.HasField("dim_value") for d in dims):
            out[vi.name] = (tt.elem_type, tuple(d.dim_value for d in dims))
    return out


def _with_constant_inputs(case) -> onnx.ModelProto | None:
    """The case's model with every input turned into an initializer holding the case's
    data, so shape operands (Reshape's shape, Range's limits...) are known; None when
    onnx cannot store the data (exotic dtypes)."""
    model = onnx.ModelProto.FromString(case.model.SerializeToString())
    inputs, _ = case.data_sets[0]
    try:
        tensors = [onnx.numpy_helper.from_array(value, vi.name) for vi, value in zip(model.graph.input, inputs)]
    except Exception:
        return None
    model.graph.initializer.extend(tensors)
    del model.graph.input[:]
    return model


@pytest.mark.parametrize("op", NATIVE)
def test_inferred_types_match_onnx_shape_inference(op):
    cases = CASES.get(op, [])
    if not cases:
        assert op in NO_CASE, f"{op} has native inference but no conformance case; add it to NO_CASE with a test"
        pytest.skip(f"no one-op core conformance case exercises {op}; its family's tests cover it")
    compared = 0
    models = [(case.name, case.model) for case in cases]
    models += [(case.name + " (constant inputs)", _with_constant_inputs(case)) for case in cases if case.data_sets]
    for case_name, model in models:
        if model is None:
            continue
        try:
            graph = egraft.load(model)
        except UnsupportedOpError:
            continue
        static = _onnx_static_types(model)
        node_outputs = {v.name: v for n in graph.nodes for v in n.outputs if v is not None}
        for name, (elem_type, shape) in static.items():
            value = node_outputs.get(name)
            if value is None:
                continue
            assert value.type.dtype.value == elem_type, f"{case_name}: %{name} dtype {value.type}"
            assert value.type.shape == shape, f"{case_name}: %{name} is {value.type}, onnx says {list(shape)}"
            compared += 1
    if compared == 0 and op in DATA_DEPENDENT:
        pytest.skip(f"onnx infers no static output shape for the data-dependent op {op}")
    if compared == 0 and op in ONNX_CANNOT_INFER:
        pytest.skip(f"onnx's shape inference fails on the one-op cases of {op}")
    assert compared > 0, f"no output of {op} could be compared"

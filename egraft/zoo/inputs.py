"""Inputs for a model nobody described: specs generated from the graph, so that the check
and bench stages feed values the model accepts.

- Float inputs: uniform in [0, 1) (an image, an audio frame, a feature vector).
- Integer inputs that index a table (a ``Gather`` of an initializer, through ``Cast``,
  ``Reshape``, ``Unsqueeze``, ``Squeeze``, ``Flatten`` or ``Identity``): integers below
  the table's size along the gathered axis (token ids stay in the vocabulary).
- Other integer inputs: ones when the name says mask, zeros when it says type (token type
  ids), ones otherwise (a valid index, count, length and mask alike).
- Bool inputs: all true.
- Dims: ``dim_param`` names bind to the run's ``--shape`` values, else
  :func:`egraft.ir.work.default_dim` (1 for batch-like names, 128 otherwise); a dim with
  neither value nor name is 1 on axis 0 and 128 elsewhere.

A manifest's ``[[model.input]]`` specs replace the generated ones, input by input.

Example:
    >>> from onnx import TensorProto, helper, numpy_helper
    >>> import numpy as np
    >>> g = helper.make_graph(
    ...     [helper.make_node("Gather", ["table", "ids"], ["y"])], "g",
    ...     [helper.make_tensor_value_info("ids", TensorProto.INT64, ["batch", "seq"])],
    ...     [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
    ...     [numpy_helper.from_array(np.zeros((500, 8), np.float32), "table")])
    >>> spec, = generated_specs(helper.make_model(g))
    >>> spec.kind, spec.low, spec.high, spec.shape
    ('integers', 0, 500, ('batch', 'seq'))
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import onnx

from egraft.ir.dtypes import DType
from egraft.testing.corpus import _DTYPES, Binding, InputSpec

#: Ops an index passes through unchanged in value.
_PASS_THROUGH = {"Cast", "Reshape", "Unsqueeze", "Squeeze", "Flatten", "Identity"}


def _table_size(model: onnx.ModelProto, name: str) -> int | None:
    """The smallest table size a Gather reached from value ``name`` reads with it."""
    graph = model.graph
    initializers = {t.name: tuple(t.dims) for t in graph.initializer}
    consumers: dict[str, list[onnx.NodeProto]] = {}
    for node in graph.node:
        for i in node.input:
            consumers.setdefault(i, []).append(node)
    sizes: list[int] = []
    frontier, seen = [name], {name}
    while frontier:
        value = frontier.pop()
        for node in consumers.get(value, []):
            if node.op_type in ("Gather", "GatherElements") and len(node.input) > 1 and node.input[1] == value:
                shape = initializers.get(node.input[0])
                if shape:
                    axis = next((a.i for a in node.attribute if a.name == "axis"), 0)
                    sizes.append(shape[axis % len(shape)])
            elif node.op_type in _PASS_THROUGH and node.input[0] == value:
                for out in node.output:
                    if out not in seen:
                        seen.add(out)
                        frontier.append(out)
    return min(sizes) if sizes else None


def generated_specs(model: onnx.ModelProto, given: Iterable[dict] = ()) -> list[InputSpec]:
    """A spec for every runtime input of ``model`` (those that are not initializers):
    ``given`` ones (dicts of :class:`InputSpec` fields) by name, the others generated."""
    from egraft.errors import ModelError

    by_name = {g["name"]: InputSpec(**{**g, "shape": tuple(g["shape"])}) for g in given}
    initializers = {t.name for t in model.graph.initializer}
    specs = []
    for vi in model.graph.input:
        if vi.name in initializers:
            continue
        if vi.name in by_name:
            specs.append(by_name[vi.name])
            continue
        tensor = vi.type.tensor_type
        dtype = DType.from_onnx(tensor.elem_type, f" (input {vi.name!r})").numpy.name
        if dtype not in _DTYPES:
            raise ModelError(f"input {vi.name!r}: {dtype} values cannot be generated; give them in a manifest")
        shape: list[int | str] = []
        for axis, d in enumerate(tensor.shape.dim if tensor.HasField("shape") else ()):
            if d.HasField("dim_value"):
                shape.append(int(d.dim_value))
            elif d.dim_param:
                shape.append(d.dim_param)
            else:
                shape.append(1 if axis == 0 else 128)
        lowered = vi.name.lower()
        if dtype.startswith("float"):
            spec = InputSpec(vi.name, dtype, tuple(shape), "uniform", 0.0, 1.0)
        elif dtype == "bool":
            spec = InputSpec(vi.name, dtype, tuple(shape), "ones")
        else:
            table = _table_size(model, vi.name)
            if table:
                spec = InputSpec(vi.name, dtype, tuple(shape), "integers", 0, table)
            elif "type" in lowered and "mask" not in lowered:
                spec = InputSpec(vi.name, dtype, tuple(shape), "zeros")
            else:
                spec = InputSpec(vi.name, dtype, tuple(shape), "ones")
        specs.append(spec)
    return specs


def binding_for(specs: Iterable[InputSpec], shape: Mapping[str, int]) -> Binding:
    """Values for every dim name of ``specs``: ``shape``'s, else the default of the name."""
    from egraft.ir.work import default_dim

    names = sorted({d for s in specs for d in s.shape if isinstance(d, str)})
    return Binding({n: int(shape.get(n, default_dim(n))) for n in names})


__all__ = ["generated_specs", "binding_for"]

"""Models that must not take a batch down: what ``egraft zoo``'s isolation is tested on.

- :func:`corrupt_model`: bytes that are not an ONNX model (an ``error`` row);
- :func:`endless_loop_model`: a valid Loop whose condition never turns false and that has
  no trip count: it runs until it is killed (a ``timeout`` row);
- :func:`huge_intermediate_model`: a valid model whose one intermediate needs 64 GiB
  (``Expand`` of a scalar to 131072 x 131072 floats, then ``ReduceSum``): an ``error``
  (MemoryError under ``--max-memory``) or ``crashed`` (the kernel's OOM killer) row.

Example:
    >>> import onnx
    >>> onnx.checker.check_model(endless_loop_model())
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper


def corrupt_model() -> bytes:
    """Bytes that look like a model file to a folder scan and are not one."""
    return b"\x08\x07\x12\x04junk" + bytes(range(256)) * 4


def endless_loop_model() -> onnx.ModelProto:
    """``y = Loop(no trip count, cond=true){ v + 1 }`` on ``x: f32[1]``: never ends."""
    body = helper.make_graph(
        [helper.make_node("Identity", ["cond_in"], ["cond_out"]),
         helper.make_node("Add", ["v_in", "one"], ["v_out"])],
        "body",
        [helper.make_tensor_value_info("i", TensorProto.INT64, []),
         helper.make_tensor_value_info("cond_in", TensorProto.BOOL, []),
         helper.make_tensor_value_info("v_in", TensorProto.FLOAT, [1])],
        [helper.make_tensor_value_info("cond_out", TensorProto.BOOL, []),
         helper.make_tensor_value_info("v_out", TensorProto.FLOAT, [1])],
        [numpy_helper.from_array(np.ones(1, np.float32), "one")])
    graph = helper.make_graph(
        [helper.make_node("Loop", ["", "keep_going", "x"], ["y"], body=body)],
        "endless_loop",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1])],
        [numpy_helper.from_array(np.array(True), "keep_going")])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def huge_intermediate_model(side: int = 131072) -> onnx.ModelProto:
    """``y = ReduceSum(Expand(x, [side, side]))`` on ``x: f32[1]``: one intermediate of
    ``4 * side**2`` bytes (64 GiB at the default side)."""
    graph = helper.make_graph(
        [helper.make_node("Expand", ["x", "shape"], ["big"]),
         helper.make_node("ReduceSum", ["big"], ["y"], keepdims=0)],
        "huge_intermediate",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [])],
        [numpy_helper.from_array(np.array([side, side], np.int64), "shape")])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def write_broken_models(folder: str | Path) -> dict[str, Path]:
    """Write the three into ``folder`` as ``corrupt.onnx``, ``endless_loop.onnx`` and
    ``huge_intermediate.onnx``; their paths by name."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    paths = {"corrupt": folder / "corrupt.onnx", "endless_loop": folder / "endless_loop.onnx",
             "huge_intermediate": folder / "huge_intermediate.onnx"}
    paths["corrupt"].write_bytes(corrupt_model())
    onnx.save(endless_loop_model(), paths["endless_loop"])
    onnx.save(huge_intermediate_model(), paths["huge_intermediate"])
    return paths


__all__ = ["corrupt_model", "endless_loop_model", "huge_intermediate_model", "write_broken_models"]

"""egraft: an equality-saturation compiler for ONNX models.

The public API:

- :func:`load` -- an ONNX model (path, bytes or ModelProto) -> :class:`Graph`
- :meth:`Graph.run` -- run a graph on numpy arrays with the reference executor
- :func:`save_onnx` -- write any graph as an ONNX model
- :func:`compile` -- a model to native CPU code: ``compile(m).run(feeds)``

Example:
    >>> import egraft, numpy as np
    >>> g = egraft.load("model.onnx")                      # doctest: +SKIP
    >>> outputs = g.run({"x": np.zeros((1, 3), np.float32)})  # doctest: +SKIP
    >>> egraft.save_onnx(g, "copy.onnx")                   # doctest: +SKIP
"""

from egraft.errors import EgraftError
from egraft.frontend.onnx_export import save_onnx, to_onnx
from egraft.frontend.onnx_import import load
from egraft.ir.graph import Graph, Node, Value
from egraft.ir.types import DType, TensorType

__version__ = "0.1.0"

from egraft.compiler import compile  # noqa: E402  (needs __version__)

__all__ = ["load", "compile", "save_onnx", "to_onnx", "Graph", "Node", "Value", "TensorType", "DType", "EgraftError",
           "__version__"]

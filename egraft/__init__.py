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

__version__ = "0.1.0"

#: The public names and the modules that define them, imported on first use (PEP 562):
#: ``import egraft`` (and the CLI's ``--help``) does not pay for onnx, sympy or LLVM.
_LAZY = {
    "load": "egraft.frontend.onnx_import", "save_onnx": "egraft.frontend.onnx_export",
    "to_onnx": "egraft.frontend.onnx_export", "compile": "egraft.compiler", "Graph": "egraft.ir.graph",
    "Node": "egraft.ir.graph", "Value": "egraft.ir.graph", "TensorType": "egraft.ir.types", "DType": "egraft.ir.types",
}


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        value = getattr(importlib.import_module(_LAZY[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'egraft' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))


__all__ = ["load", "compile", "save_onnx", "to_onnx", "Graph", "Node", "Value", "TensorType", "DType", "EgraftError",
           "__version__"]

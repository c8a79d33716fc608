"""ONNX in and out: :func:`load` imports a model into the IR, :func:`save_onnx` exports one."""

from egraft.frontend.onnx_import import load, read_model

__all__ = ["load", "read_model"]

"""The errors egraft raises for things a user can cause. Each says what, where and what to do.

The CLI prints ``error: <message>`` for any :class:`EgraftError` and exits with status 2.
"""


class EgraftError(Exception):
    """Base class of every error caused by a user's input."""


class ModelError(EgraftError):
    """A model file that cannot be read or is not a valid ONNX model."""


class UnsupportedOpError(EgraftError):
    """An op that egraft does not support yet."""


class GraphError(EgraftError):
    """An ill-formed IR graph: a dangling value, a cycle, a type mismatch."""


class ShapeInferenceError(EgraftError):
    """Shape or dtype inference failed for a node (the message names it)."""


class InputError(EgraftError):
    """A feed that does not match the graph's declared inputs (name, dtype or shape)."""


class ExecutionError(EgraftError):
    """An op failed while the reference executor ran it."""

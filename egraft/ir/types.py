"""Tensor types: an element type and a shape of (possibly symbolic) dims.

Example:
    >>> TensorType(DType.FLOAT32, (sym("batch"), 3, 224, 224))
    f32[batch, 3, 224, 224]
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace

import numpy as np

from egraft.ir.dims import Dim, evaluate_dim, fmt_shape, shape_is_static, simplify_dim, sym
from egraft.ir.dtypes import DType

__all__ = ["TensorType", "DType", "sym"]


@dataclass(frozen=True)
class TensorType:
    """The type of a tensor value: ``dtype`` and ``shape`` (ints or sympy expressions).

    ``shape`` is ``None`` when even the rank is unknown (rare: only for outputs of
    data-dependent ops whose rank cannot be inferred).
    """

    dtype: DType
    shape: tuple[Dim, ...] | None

    def __post_init__(self) -> None:
        if self.shape is not None:
            object.__setattr__(self, "shape", tuple(simplify_dim(d) for d in self.shape))

    @property
    def rank(self) -> int:
        if self.shape is None:
            raise ValueError(f"the rank of {self} is unknown")
        return len(self.shape)

    @property
    def is_static(self) -> bool:
        return self.shape is not None and shape_is_static(self.shape)

    def with_shape(self, shape) -> TensorType:
        return replace(self, shape=None if shape is None else tuple(shape))

    def with_dtype(self, dtype: DType) -> TensorType:
        return replace(self, dtype=dtype)

    def bind(self, bindings: Mapping[str, int]) -> TensorType:
        """This type with the symbols in ``bindings`` replaced by their values."""
        if self.shape is None:
            return self
        return replace(self, shape=tuple(evaluate_dim(d, bindings) for d in self.shape))

    @classmethod
    def of(cls, array: np.ndarray) -> TensorType:
        """The (static) type of a numpy array."""
        return cls(DType.from_numpy(array.dtype), tuple(int(d) for d in array.shape))

    def __str__(self) -> str:
        shape = "[?]" if self.shape is None else fmt_shape(self.shape)
        return f"{self.dtype.short}{shape}"

    __repr__ = __str__

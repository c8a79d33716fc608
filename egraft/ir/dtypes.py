"""Element types of tensors: the one table that maps ONNX, numpy and printed names.

Example:
    >>> from egraft.ir.dtypes import DType
    >>> DType.FLOAT32.short
    'f32'
    >>> DType.from_numpy(np.dtype("int64")) is DType.INT64
    True
"""

from __future__ import annotations

import enum

import numpy as np
from onnx import TensorProto, helper


class DType(enum.Enum):
    """An element type. The value is the ONNX ``TensorProto`` data-type number."""

    FLOAT32 = TensorProto.FLOAT
    FLOAT64 = TensorProto.DOUBLE
    FLOAT16 = TensorProto.FLOAT16
    BFLOAT16 = TensorProto.BFLOAT16
    INT8 = TensorProto.INT8
    INT16 = TensorProto.INT16
    INT32 = TensorProto.INT32
    INT64 = TensorProto.INT64
    UINT8 = TensorProto.UINT8
    UINT16 = TensorProto.UINT16
    UINT32 = TensorProto.UINT32
    UINT64 = TensorProto.UINT64
    BOOL = TensorProto.BOOL
    STRING = TensorProto.STRING
    COMPLEX64 = TensorProto.COMPLEX64
    COMPLEX128 = TensorProto.COMPLEX128

    @property
    def short(self) -> str:
        """The printed name, e.g. ``f32`` or ``i64``."""
        return _SHORT[self]

    @property
    def numpy(self) -> np.dtype:
        """The numpy dtype that holds values of this type."""
        if self is DType.BFLOAT16:
            import ml_dtypes

            return np.dtype(ml_dtypes.bfloat16)
        return np.dtype(helper.tensor_dtype_to_np_dtype(self.value))

    @property
    def is_float(self) -> bool:
        return self in (DType.FLOAT32, DType.FLOAT64, DType.FLOAT16, DType.BFLOAT16)

    @property
    def is_int(self) -> bool:
        return self.short[0] in "iu" and self is not DType.BOOL

    @classmethod
    def from_onnx(cls, elem_type: int, where: str = "") -> DType:
        """The DType of an ONNX element-type number; a clear error for unsupported ones."""
        try:
            return cls(elem_type)
        except ValueError:
            name = TensorProto.DataType.Name(elem_type) if elem_type in TensorProto.DataType.values() else elem_type
            raise UnsupportedDType(f"element type {name} is not supported by egraft{where}") from None

    @classmethod
    def from_numpy(cls, dtype: np.dtype) -> DType:
        """The DType of a numpy dtype."""
        dtype = np.dtype(dtype)
        if dtype.name == "bfloat16":
            return cls.BFLOAT16
        try:
            return cls(helper.np_dtype_to_tensor_dtype(dtype))
        except (KeyError, ValueError, TypeError):
            if dtype.kind in "US":
                return cls.STRING
            raise UnsupportedDType(f"numpy dtype {dtype} has no egraft element type") from None

    @classmethod
    def from_short(cls, short: str) -> DType:
        """The DType printed as ``short`` (``f32``, ``i64``, ``bool``...)."""
        for dtype, name in _SHORT.items():
            if name == short:
                return dtype
        raise ValueError(f"unknown element type {short!r}; expected one of {sorted(_SHORT.values())}")


class UnsupportedDType(ValueError):
    """An element type egraft cannot represent (e.g. float8, int4)."""


_SHORT = {
    DType.FLOAT32: "f32",
    DType.FLOAT64: "f64",
    DType.FLOAT16: "f16",
    DType.BFLOAT16: "bf16",
    DType.INT8: "i8",
    DType.INT16: "i16",
    DType.INT32: "i32",
    DType.INT64: "i64",
    DType.UINT8: "u8",
    DType.UINT16: "u16",
    DType.UINT32: "u32",
    DType.UINT64: "u64",
    DType.BOOL: "bool",
    DType.STRING: "str",
    DType.COMPLEX64: "c64",
    DType.COMPLEX128: "c128",
}

"""Steps a vendor library runs instead of generated code: large products with nothing to
fuse go to cuBLAS (through ``cupy.matmul``), the bar for plain GEMM that a hand-written
tile loop reaches about half of; products with an epilogue (bias, residual, activation)
stay on egraft's own kernels (:mod:`egraft.kernels.cuda.gemm`), which fuse it.

The runtime hands :func:`run_library` the operands as arrays of the device's array module:
CuPy views of device memory on a GPU, numpy views of host memory on the emulated device
(numpy's matmul standing in for cuBLAS there). ``$EGRAFT_CUBLAS=0`` keeps every product on
the tile loop.

Example:
    >>> wants_library(2 * 512 * 768 * 768, rows=512)
    True
"""

from __future__ import annotations

import os

from egraft.kernels.cuda.emit import LibraryCall

#: A product goes to cuBLAS from this many flops (at the dims' cost-model values) ...
LIBRARY_FLOPS = 1 << 26
#: ... and this many rows (fewer: the matrix-vector kernel, which fuses its epilogue anyway).
LIBRARY_ROWS = 64


def wants_library(flops: float, rows: float) -> bool:
    """Whether a product of ``flops`` over ``rows`` rows goes to cuBLAS (and cuBLAS is not off)."""
    if os.environ.get("EGRAFT_CUBLAS", "1").strip() == "0":
        return False
    return flops >= LIBRARY_FLOPS and rows >= LIBRARY_ROWS


def run_library(call: LibraryCall, xp, arrays: list) -> None:
    """Run ``call`` on ``arrays`` (one per pointer operand, in parameter order: the output
    first), with ``xp`` the array module (``cupy`` or ``numpy``)."""
    if call.kind != "matmul":
        raise ValueError(f"unknown library call {call.kind!r}")
    out, a, b = arrays
    _, ta, tb = call.transpose or (False, False, False)
    xp.matmul(a.T if ta else a, b.T if tb else b, out=out)


def shapes_at(call: LibraryCall, bindings) -> list[tuple[int, ...]]:
    """Each operand's shape with the dims bound."""
    from egraft.ir.dims import dim_function

    return [tuple(int(dim_function(d)(bindings)) for d in shape) for shape in call.shapes]


def host_views(call: LibraryCall, addresses: list[int], bindings) -> list:
    """numpy views of host memory at ``addresses`` (float32, the call's shapes): the
    emulated device's operands."""
    import ctypes

    import numpy as np

    views = []
    for address, shape in zip(addresses, shapes_at(call, bindings)):
        count = int(np.prod(shape)) if shape else 1
        buffer = (ctypes.c_float * count).from_address(address)
        views.append(np.ctypeslib.as_array(buffer).reshape(shape))
    return views


__all__ = ["LibraryCall", "wants_library", "run_library", "shapes_at", "host_views", "LIBRARY_FLOPS", "LIBRARY_ROWS"]

"""onnxruntime's own ops (domain ``com.microsoft``) that its tools write into models.

``DynamicQuantizeLSTM`` is what onnxruntime's dynamic quantizer makes of an LSTM: int8
weights with a scale and zero point per direction (or per gate column), and the
activations quantized to uint8 as the layer runs. The reference kernel computes what
onnxruntime computes, not an idealized float LSTM: each product ``A @ W`` quantizes
``A`` over the whole matrix (range [min(A, 0), max(A, 0)] onto [0, 255], rounding half
to even), multiplies the integers exactly, and scales the int32 sums by
``a_scale * w_scale``. The input product covers every time step at once; the recurrent
one quantizes each step's hidden state. Otherwise the layer is the ONNX LSTM (gates
i, o, f, c), with ``W`` as ``[num_directions, input_size, 4*hidden_size]`` and ``R`` as
``[num_directions, hidden_size, 4*hidden_size]`` (transposed from LSTM's).

Example (numpy semantics of one product)::

    >>> a = np.array([[0.5, -1.0]], np.float32); w = np.array([[2], [1]], np.int8)
    >>> float(quantized_product(w, np.float32(0.5), np.int8(0))(a)[0, 0])  # 0.5*(0.5*2 - 1*1)
    0.0
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from egraft.ir.ops._common import fail, require_shape
from egraft.ir.ops.recurrent import _LSTM, _check_dim, _num_directions, _run_layer, layer_output_types
from egraft.ir.registry import AttrSpec, register_op
from egraft.ir.types import TensorType

CONTRIB = "com.microsoft"


def dynamic_quantization(a: np.ndarray) -> tuple[np.ndarray, np.float32, int]:
    """``a`` as uint8 with onnxruntime's dynamic parameters: ``(q, scale, zero_point)``.

    The range always holds 0; a constant matrix gets scale 1 (onnxruntime's choice).
    """
    a = np.asarray(a, np.float32)
    lo = np.float32(min(0.0, float(a.min()))) if a.size else np.float32(0)
    hi = np.float32(max(0.0, float(a.max()))) if a.size else np.float32(0)
    scale = np.float32(1) if hi == lo else np.float32((hi - lo) / np.float32(255))
    zero_point = int(np.rint(np.clip(np.float32(0) - lo / scale, np.float32(0), np.float32(255))))
    q = np.clip(np.rint(a / scale) + zero_point, 0, 255).astype(np.int64)
    return q, scale, zero_point


def quantized_product(w: np.ndarray, w_scale: np.ndarray, w_zero_point: np.ndarray
                      ) -> Callable[[np.ndarray], np.ndarray]:
    """``a -> a @ W`` for int8/uint8 ``w`` ``[K, N]`` with a scale and zero point per tensor
    or per column, ``a`` quantized dynamically (see :func:`dynamic_quantization`)."""
    w_centered = w.astype(np.int64) - np.asarray(w_zero_point, np.int64)
    w_scale = np.asarray(w_scale, np.float32)

    def product(a: np.ndarray) -> np.ndarray:
        rows = a.reshape(-1, a.shape[-1])
        q, a_scale, a_zero_point = dynamic_quantization(rows)
        sums = (q - a_zero_point) @ w_centered  # exact in int64
        out = (sums.astype(np.float32) * (a_scale * w_scale)).astype(np.float32)
        return out.reshape(*a.shape[:-1], w.shape[-1])

    return product


def _per_direction(value: np.ndarray, d: int) -> np.ndarray:
    value = np.asarray(value)
    return value.reshape(-1)[0] if value.ndim == 0 else value[d]


def _dq_lstm_infer(ctx) -> list[TensorType]:
    x_shape, w_shape, r_shape = require_shape(ctx, 0), require_shape(ctx, 1), require_shape(ctx, 2)
    if len(x_shape) != 3 or len(w_shape) != 3 or len(r_shape) != 3:
        raise fail(ctx, f"X, W and R must have rank 3, got {list(x_shape)}, {list(w_shape)} and {list(r_shape)}")
    hidden = ctx.attr("hidden_size", None)
    hidden = r_shape[1] if hidden is None else int(hidden)
    _check_dim(ctx, "W.shape[0] (num_directions)", w_shape[0], _num_directions(ctx))
    _check_dim(ctx, "W.shape[1] (input_size)", w_shape[1], x_shape[2])
    _check_dim(ctx, "W.shape[2] (4*hidden_size)", w_shape[2], 4 * hidden)
    _check_dim(ctx, "R.shape[1] (hidden_size)", r_shape[1], hidden)
    _check_dim(ctx, "R.shape[2] (4*hidden_size)", r_shape[2], 4 * hidden)
    return layer_output_types(ctx, _LSTM, hidden)  # the domain's opset is 1: no layout attribute


def _dq_lstm(ctx, x, w, r, b=None, sequence_lens=None, initial_h=None, initial_c=None, p=None,
             w_scale=None, w_zero_point=None, r_scale=None, r_zero_point=None) -> list[np.ndarray]:
    if w_scale is None or r_scale is None:
        raise ValueError("W_scale and R_scale are required")
    w_zero_point = np.zeros_like(w_scale, w.dtype) if w_zero_point is None else w_zero_point
    r_zero_point = np.zeros_like(r_scale, r.dtype) if r_zero_point is None else r_zero_point

    def products(d: int):
        return (quantized_product(w[d], _per_direction(w_scale, d), _per_direction(w_zero_point, d)),
                quantized_product(r[d], _per_direction(r_scale, d), _per_direction(r_zero_point, d)))

    # The layer reads W and R in LSTM's layout only for their shapes; the products use the ints.
    w_shape, r_shape = np.swapaxes(w, 1, 2), np.swapaxes(r, 1, 2)
    return _run_layer(ctx, _LSTM, x, w_shape, r_shape, b, sequence_lens, initial_h, initial_c, p,
                      products=products)


register_op(
    "DynamicQuantizeLSTM", domain=CONTRIB, infer=_dq_lstm_infer, compute=_dq_lstm,
    attrs={"direction": AttrSpec("string", "forward", "forward, reverse or bidirectional"),
           "hidden_size": AttrSpec("int", None, "the number of hidden units"),
           "activations": AttrSpec("strings", [], "as LSTM"),
           "activation_alpha": AttrSpec("floats", [], "as LSTM"),
           "activation_beta": AttrSpec("floats", [], "as LSTM"),
           "clip": AttrSpec("float", None, "as LSTM"),
           "input_forget": AttrSpec("int", 0, "as LSTM")},
    doc="onnxruntime's LSTM with int8 weights and dynamically quantized uint8 activations")

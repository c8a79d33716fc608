"""Recurrent layers: LSTM, GRU and RNN (one layer each).

Every op runs forward, reverse or bidirectional (``direction``), with optional
``sequence_lens`` (per batch entry; steps past a sequence's end leave the state alone
and write zeros to ``Y``; an empty sequence's final states are zero, as in
onnxruntime), initial states, ``clip`` on the pre-activations, custom
``activations`` with ``activation_alpha``/``activation_beta``, LSTM peepholes and
``input_forget``, GRU ``linear_before_reset``, and the opset-14 ``layout`` attribute
(``layout=1``: batch-major inputs and outputs).

Shapes (``layout=0``): ``X`` is ``[seq, batch, input]``; ``Y`` is
``[seq, num_directions, batch, hidden]``; ``Y_h`` and ``Y_c`` are
``[num_directions, batch, hidden]``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from egraft.ir.ops._common import fail, require_shape
from egraft.ir.registry import register_op
from egraft.ir.types import TensorType

Activation = Callable[[np.ndarray], np.ndarray]


@dataclass(frozen=True)
class _Kind:
    """What distinguishes the three layers: gate count, default activations, outputs."""

    name: str
    gates: int
    default_activations: tuple[str, ...]
    num_outputs: int


_LSTM = _Kind("LSTM", 4, ("Sigmoid", "Tanh", "Tanh"), 3)
_GRU = _Kind("GRU", 3, ("Sigmoid", "Tanh"), 2)
_RNN = _Kind("RNN", 1, ("Tanh",), 2)


# ---- activations ----------------------------------------------------------------------------
#: Activation name (lower case) -> (default alpha, default beta); None = the parameter is unused.
_ACTIVATION_PARAMS: dict[str, tuple[float | None, float | None]] = {
    "sigmoid": (None, None),
    "tanh": (None, None),
    "relu": (None, None),
    "softsign": (None, None),
    "softplus": (None, None),
    "affine": (1.0, 0.0),
    "leakyrelu": (0.01, None),
    "thresholdedrelu": (1.0, None),
    "scaledtanh": (1.0, 1.0),
    "hardsigmoid": (0.2, 0.5),
    "elu": (1.0, None),
}


def _sigmoid(x: np.ndarray) -> np.ndarray:
    # 1 / (1 + e^-x) without overflow warnings for large |x|
    e = np.exp(-np.abs(x))
    return np.where(x >= 0, 1 / (1 + e), e / (1 + e))


def _make_activation(name: str, alpha: float | None, beta: float | None) -> Activation:
    """The activation function ``name`` with its parameters bound."""
    key = name.lower()
    table: dict[str, Activation] = {
        "sigmoid": _sigmoid,
        "tanh": np.tanh,
        "relu": lambda x: np.maximum(x, 0),
        "softsign": lambda x: x / (1 + np.abs(x)),
        "softplus": lambda x: np.logaddexp(0, x),
        "affine": lambda x: alpha * x + beta,
        "leakyrelu": lambda x: np.where(x >= 0, x, alpha * x),
        "thresholdedrelu": lambda x: np.where(x > alpha, x, 0),
        "scaledtanh": lambda x: alpha * np.tanh(beta * x),
        "hardsigmoid": lambda x: np.clip(alpha * x + beta, 0, 1),
        "elu": lambda x: np.where(x >= 0, x, alpha * np.expm1(np.minimum(x, 0))),
    }
    return table[key]


def _activation_names(ctx, kind: _Kind, num_dir: int) -> list[str]:
    """The activation names for every direction, forward's first (``gates``-many each)."""
    per_dir = len(kind.default_activations)
    names = ctx.attr("activations", None)
    if not names:
        names = list(kind.default_activations)
    names = list(names)
    if len(names) >= per_dir * num_dir:
        names = names[: per_dir * num_dir]
    elif len(names) == per_dir:
        names = names * num_dir
    else:
        raise ValueError(f"{kind.name} needs {per_dir * num_dir} activations, got {names}")
    for n in names:
        if n.lower() not in _ACTIVATION_PARAMS:
            raise ValueError(f"unknown activation {n!r}; expected one of {sorted(_ACTIVATION_PARAMS)}")
    return names


def _activations(ctx, kind: _Kind, num_dir: int) -> list[list[Activation]]:
    """The activation functions per direction.

    ``activation_alpha``/``activation_beta`` are consumed in the order of the activation
    functions, each value by the next function that takes that parameter (as
    onnxruntime does); a function with no value left uses its default.
    """
    names = _activation_names(ctx, kind, num_dir)
    alphas = list(ctx.attr("activation_alpha", None) or [])
    betas = list(ctx.attr("activation_beta", None) or [])
    funcs = []
    for name in names:
        default_alpha, default_beta = _ACTIVATION_PARAMS[name.lower()]
        alpha = beta = None
        if default_alpha is not None:
            alpha = alphas.pop(0) if alphas else default_alpha
        if default_beta is not None:
            beta = betas.pop(0) if betas else default_beta
        funcs.append(_make_activation(name, alpha, beta))
    per_dir = len(kind.default_activations)
    return [funcs[d * per_dir:(d + 1) * per_dir] for d in range(num_dir)]


# ---- shape inference ------------------------------------------------------------------------
def _direction(ctx) -> str:
    direction = ctx.attr("direction", "forward")
    return "forward" if direction == "foward" else direction  # opset-1 GRU's default is misspelt


def _num_directions(ctx) -> int:
    direction = _direction(ctx)
    if direction not in ("forward", "reverse", "bidirectional"):
        raise fail(ctx, f"direction must be forward, reverse or bidirectional, not {direction!r}")
    return 2 if direction == "bidirectional" else 1


def _layout(ctx) -> int:
    return int(ctx.attr("layout", 0)) if ctx.opset >= 14 else 0


def _check_dim(ctx, what: str, got, want) -> None:
    """Fail when two dims are known integers that differ (symbolic ones are checked at run time)."""
    if isinstance(got, int) and isinstance(want, int) and got != want:
        raise fail(ctx, f"{what} is {got}, expected {want}")


def _hidden_size(ctx, kind: _Kind):
    hidden = ctx.attr("hidden_size", None)
    if hidden is not None:
        return int(hidden)
    r_shape = require_shape(ctx, 2)
    if len(r_shape) != 3:
        raise fail(ctx, f"R must have rank 3, got shape {list(r_shape)}")
    return r_shape[2]


def _recurrent_infer(kind: _Kind):
    def infer(ctx) -> list[TensorType]:
        x_shape = require_shape(ctx, 0)
        if len(x_shape) != 3:
            raise fail(ctx, f"X must have rank 3, got shape {list(x_shape)}")
        num_dir = _num_directions(ctx)
        hidden = _hidden_size(ctx, kind)
        w_shape = require_shape(ctx, 1)
        if len(w_shape) != 3:
            raise fail(ctx, f"W must have rank 3, got shape {list(w_shape)}")
        _check_dim(ctx, "W.shape[0] (num_directions)", w_shape[0], num_dir)
        _check_dim(ctx, f"W.shape[1] ({kind.gates}*hidden_size)", w_shape[1], kind.gates * hidden)
        _check_dim(ctx, "W.shape[2] (input_size)", w_shape[2], x_shape[2])
        r_shape = require_shape(ctx, 2)
        if len(r_shape) != 3:
            raise fail(ctx, f"R must have rank 3, got shape {list(r_shape)}")
        _check_dim(ctx, f"R.shape[1] ({kind.gates}*hidden_size)", r_shape[1], kind.gates * hidden)
        _check_dim(ctx, "R.shape[2] (hidden_size)", r_shape[2], hidden)
        if ctx.has_input(3):
            b_shape = require_shape(ctx, 3)
            if len(b_shape) != 2:
                raise fail(ctx, f"B must have rank 2, got shape {list(b_shape)}")
            _check_dim(ctx, f"B.shape[1] ({2 * kind.gates}*hidden_size)", b_shape[1], 2 * kind.gates * hidden)
        return layer_output_types(ctx, kind, hidden)

    return infer


def layer_output_types(ctx, kind: _Kind, hidden) -> list[TensorType]:
    """``Y`` and the final states of a layer over input 0 (after its weights are checked);
    the activations are checked too."""
    x_shape = require_shape(ctx, 0)
    layout = _layout(ctx)
    seq, batch = (x_shape[1], x_shape[0]) if layout else (x_shape[0], x_shape[1])
    num_dir = _num_directions(ctx)
    try:
        _activation_names(ctx, kind, num_dir)
    except ValueError as e:
        raise fail(ctx, str(e)) from None
    dtype = ctx.types[0].dtype
    if layout:
        y = TensorType(dtype, (batch, seq, num_dir, hidden))
        state = TensorType(dtype, (batch, num_dir, hidden))
    else:
        y = TensorType(dtype, (seq, num_dir, batch, hidden))
        state = TensorType(dtype, (num_dir, batch, hidden))
    return [y] + [state] * (kind.num_outputs - 1)


# ---- cells: one time step, all batch entries at once ---------------------------------------------
@dataclass
class _Weights:
    """One direction's parameters: ``w``/``r`` transposed for ``x @ w``; biases split."""

    w: np.ndarray  # [input, gates*hidden]
    r: np.ndarray  # [hidden, gates*hidden]
    wb: np.ndarray  # [gates*hidden]
    rb: np.ndarray  # [gates*hidden]
    p: np.ndarray | None  # LSTM peepholes [3*hidden] (i, o, f)
    #: ``a -> a @ w`` and ``h -> h @ r`` when they are not plain products (int8 weights)
    w_product: Callable[[np.ndarray], np.ndarray] | None = None
    r_product: Callable[[np.ndarray], np.ndarray] | None = None

    def times_w(self, x: np.ndarray) -> np.ndarray:
        return x @ self.w if self.w_product is None else self.w_product(x)

    def times_r(self, h: np.ndarray) -> np.ndarray:
        return h @ self.r if self.r_product is None else self.r_product(h)


def _clipper(clip: float | None) -> Callable[[np.ndarray], np.ndarray]:
    if clip is None:
        return lambda x: x
    return lambda x: np.clip(x, -clip, clip)


def _lstm_cell(acts: Sequence[Activation], wts: _Weights, clip, input_forget: bool):
    f, g, h = acts
    hidden = wts.r.shape[0]
    pi, po, pf = (np.split(wts.p, 3) if wts.p is not None else (0, 0, 0))

    def step(xw: np.ndarray, h_prev: np.ndarray, c_prev: np.ndarray):
        gates = xw + wts.times_r(h_prev) + wts.rb
        gi, go, gf, gc = (gates[:, k * hidden:(k + 1) * hidden] for k in range(4))
        i = f(clip(gi + pi * c_prev))
        forget = 1 - i if input_forget else f(clip(gf + pf * c_prev))
        c = forget * c_prev + i * g(clip(gc))
        o = f(clip(go + po * c))
        return o * h(c), c

    return step


def _gru_cell(acts: Sequence[Activation], wts: _Weights, clip, linear_before_reset: bool):
    f, g = acts
    hidden = wts.r.shape[0]
    r_zr, r_h = wts.r[:, :2 * hidden], wts.r[:, 2 * hidden:]
    rb_zr, rb_h = wts.rb[:2 * hidden], wts.rb[2 * hidden:]

    def step(xw: np.ndarray, h_prev: np.ndarray, c_prev):
        zr = xw[:, :2 * hidden] + h_prev @ r_zr + rb_zr
        z = f(clip(zr[:, :hidden]))
        r = f(clip(zr[:, hidden:]))
        if linear_before_reset:
            cand = xw[:, 2 * hidden:] + r * (h_prev @ r_h + rb_h)
        else:
            cand = xw[:, 2 * hidden:] + (r * h_prev) @ r_h + rb_h
        ht = g(clip(cand))
        return (1 - z) * ht + z * h_prev, None

    return step


def _rnn_cell(acts: Sequence[Activation], wts: _Weights, clip):
    (f,) = acts

    def step(xw: np.ndarray, h_prev: np.ndarray, c_prev):
        return f(clip(xw + h_prev @ wts.r + wts.rb)), None

    return step


# ---- the driver -----------------------------------------------------------------------------
def _reverse_index(lens: np.ndarray, seq: int) -> np.ndarray:
    """``idx[t, b]``: the time step that reversed step ``t`` of batch entry ``b`` reads.

    Each sequence is reversed within its own length; padding steps map to themselves.
    The map is its own inverse, so it also puts reversed outputs back in order.
    """
    t = np.arange(seq)[:, None]
    return np.where(t < lens[None, :], lens[None, :] - 1 - t, t)


def _run_direction(step, xw: np.ndarray, h0: np.ndarray, c0: np.ndarray | None, lens: np.ndarray):
    """Run ``step`` over the time axis of ``xw`` ([seq, batch, gates*hidden])."""
    seq = xw.shape[0]
    ys = np.zeros((seq,) + h0.shape, dtype=h0.dtype)
    h, c = h0, c0
    full = bool(np.all(lens >= seq))
    steps = seq if full else int(lens.max(initial=0))
    for t in range(steps):
        h_new, c_new = step(xw[t], h, c)
        if full:
            h, c = h_new, c_new
            ys[t] = h
            continue
        live = (t < lens)[:, None]
        h = np.where(live, h_new, h)
        if c is not None:
            c = np.where(live, c_new, c)
        ys[t] = np.where(live, h_new, 0)
    if not full:  # an empty sequence's final state is zero (as onnxruntime writes it), not the initial one
        empty = (lens == 0)[:, None]
        h = np.where(empty, 0, h)
        c = None if c is None else np.where(empty, 0, c)
    return ys, h, c


def _work_dtype(dtype: np.dtype) -> np.dtype:
    return np.dtype(np.float64) if dtype == np.float64 else np.dtype(np.float32)


def _recurrent_compute(kind: _Kind):
    def compute(ctx, x, w, r, b=None, sequence_lens=None, initial_h=None, initial_c=None, p=None):
        return _run_layer(ctx, kind, x, w, r, b, sequence_lens, initial_h, initial_c, p)

    return compute


def _run_layer(ctx, kind: _Kind, x, w, r, b=None, sequence_lens=None, initial_h=None, initial_c=None, p=None,
               products=None) -> list[np.ndarray]:
    """One recurrent layer over the sequence; ``products(d)``, when given, returns the
    ``(a -> a @ W^T, h -> h @ R^T)`` of direction ``d`` (int8 weights)."""
    out_dtype = x.dtype
    dt = _work_dtype(x.dtype)
    layout = _layout(ctx)
    if layout:
        x = np.swapaxes(x, 0, 1)
        initial_h = None if initial_h is None else np.swapaxes(initial_h, 0, 1)
        initial_c = None if initial_c is None else np.swapaxes(initial_c, 0, 1)
    x, w, r = x.astype(dt), w.astype(dt), r.astype(dt)
    seq, batch, _ = x.shape
    num_dir, hidden = w.shape[0], r.shape[-1]
    gh = kind.gates * hidden
    b = np.zeros((num_dir, 2 * gh), dt) if b is None else b.astype(dt)
    h0 = np.zeros((num_dir, batch, hidden), dt) if initial_h is None else initial_h.astype(dt)
    c0 = None
    if kind is _LSTM:
        c0 = np.zeros((num_dir, batch, hidden), dt) if initial_c is None else initial_c.astype(dt)
    lens = np.full(batch, seq, np.int64) if sequence_lens is None else sequence_lens.astype(np.int64)
    lens = np.clip(lens, 0, seq)
    acts = _activations(ctx, kind, num_dir)
    clip_value = ctx.attr("clip", None)
    clip = _clipper(None if clip_value is None else float(clip_value))
    direction = _direction(ctx)
    batch_index = np.arange(batch)[None, :]
    ys, hs, cs = [], [], []
    for d in range(num_dir):
        wts = _Weights(w[d].T, r[d].T, b[d, :gh], b[d, gh:],
                       None if p is None or kind is not _LSTM else p[d].astype(dt),
                       *(products(d) if products is not None else (None, None)))
        step = _cell(ctx, kind, acts[d], wts, clip)
        reverse = direction == "reverse" or d == 1
        xs = x[_reverse_index(lens, seq), batch_index] if reverse else x
        xw = wts.times_w(xs) + wts.wb
        y, h, c = _run_direction(step, xw, h0[d], None if c0 is None else c0[d], lens)
        if reverse:
            y = y[_reverse_index(lens, seq), batch_index]
        ys.append(y)
        hs.append(h)
        cs.append(c)
    y = np.stack(ys, axis=1).astype(out_dtype)  # [seq, num_dir, batch, hidden]
    y_h = np.stack(hs).astype(out_dtype)
    states = [y_h] if kind is not _LSTM else [y_h, np.stack(cs).astype(out_dtype)]
    if layout:
        y = np.transpose(y, (2, 0, 1, 3))
        states = [np.swapaxes(s, 0, 1) for s in states]
    return [y, *states]


def _cell(ctx, kind: _Kind, acts, wts: _Weights, clip):
    if kind is _LSTM:
        return _lstm_cell(acts, wts, clip, bool(ctx.attr("input_forget", 0)))
    if kind is _GRU:
        return _gru_cell(acts, wts, clip, bool(ctx.attr("linear_before_reset", 0)))
    return _rnn_cell(acts, wts, clip)


register_op("LSTM", infer=_recurrent_infer(_LSTM), compute=_recurrent_compute(_LSTM),
            doc="one LSTM layer: Y, Y_h, Y_c over the sequence (gates i, o, f, c)")
register_op("GRU", infer=_recurrent_infer(_GRU), compute=_recurrent_compute(_GRU),
            doc="one GRU layer: Y, Y_h over the sequence (gates z, r, h)")
register_op("RNN", infer=_recurrent_infer(_RNN), compute=_recurrent_compute(_RNN),
            doc="one simple RNN layer: Y, Y_h with H = f(X W^T + H R^T + Wb + Rb)")

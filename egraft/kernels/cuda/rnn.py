"""CUDA kernels of the recurrent layers: ONNX ``LSTM``, ``GRU`` and ``RNN`` (one layer each),
with the semantics of the registry's reference (:mod:`egraft.ir.ops.recurrent`): forward,
reverse or bidirectional, optional ``B``, ``sequence_lens`` (rows past their length write
zeros to ``Y``, the final states stop at the last valid step, an empty sequence's are
zero), ``initial_h``/``initial_c``, any subset of ``Y``/``Y_h``/``Y_c``, ``layout`` 0 and 1,
``clip``, every activation of the ONNX list with its alphas and betas, LSTM peepholes and
``input_forget``, GRU ``linear_before_reset`` 0 and 1.

A recurrence is sequential in time, so the kernel is one launch of one block per
(batch entry, direction) that runs the whole time loop (``seq`` may be symbolic). The
block's threads work in groups of :data:`LANES` lanes, each group owning one hidden unit
at a time (units ``group``, ``group + groups``...): per step, the lanes of a group split
the dot products of the unit's gate rows of ``W`` with ``x_t`` and of ``R`` with
``h_{t-1}`` (lane ``l`` takes ``k = l, l + 8...``: a warp reads 32-byte runs of four rows),
sum them with three xor shuffles, and the group's first lane runs the cell. ``h`` lives in
shared memory, double-buffered so that a step costs one ``__syncthreads`` (two for GRU with
``linear_before_reset=0``, whose candidate product needs every unit's reset gate first);
LSTM's ``c`` lives in shared memory beside it, owned by the unit's group. After the barrier
the block copies the new ``h`` to ``Y`` (coalesced). The input projection is recomputed per
step rather than stored (the ABI has no scratch buffer): for the hidden sizes of the
recurrent models this backend meets (64-512) a step is a few hundred FMAs per thread.
Float32 only; hidden sizes up to :data:`MAX_HIDDEN`.

Example:
    >>> kernel = generate(lstm_node, graph, 17)        # doctest: +SKIP
    >>> kernel.launches[0].grid, kernel.launches[0].block      # doctest: +SKIP
    ((batch, 2, 1), (128, 1, 1))
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from egraft.ir.dtypes import DType
from egraft.ir.ops.recurrent import _ACTIVATION_PARAMS, _GRU, _LSTM, _RNN, _activation_names, _direction, _layout
from egraft.kernels.cuda import register_kernel
from egraft.kernels.cuda.emit import CudaContext, Unsupported, _float

#: Lanes that share one hidden unit's dot products (a divisor of 32).
LANES = 8
#: Lane groups per block: at least this many...
MIN_GROUPS = 16
#: ...and at most this many (512 threads).
MAX_GROUPS = 64
#: The largest hidden size (GRU's shared state, 5 * hidden floats, stays under 48 KiB).
MAX_HIDDEN = 2048


@dataclass(frozen=True)
class Activation:
    """One activation of the list with its parameters bound (``None``: unused)."""

    name: str  # lower case
    alpha: float | None
    beta: float | None

    def code(self, v: str) -> str:
        """The C expression of the activation of ``v`` (a variable).

        Example:
            >>> Activation("leakyrelu", 0.1, None).code("v")
            '(v >= 0.0f ? v : 0.1f * v)'
        """
        a = _float(self.alpha) if self.alpha is not None else None
        b = _float(self.beta) if self.beta is not None else None
        table = {
            "sigmoid": f"eg_sigmoid({v})",
            "tanh": f"tanhf({v})",
            "relu": f"fmaxf({v}, 0.0f)",
            "softsign": f"({v} / (1.0f + fabsf({v})))",
            "softplus": f"(fmaxf({v}, 0.0f) + logf(1.0f + expf(-fabsf({v}))))",
            "affine": f"({a} * {v} + {b})",
            "leakyrelu": f"({v} >= 0.0f ? {v} : {a} * {v})",
            "thresholdedrelu": f"({v} > {a} ? {v} : 0.0f)",
            "scaledtanh": f"({a} * tanhf({b} * {v}))",
            "hardsigmoid": f"fminf(fmaxf({a} * {v} + {b}, 0.0f), 1.0f)",
            "elu": f"({v} >= 0.0f ? {v} : {a} * (expf({v}) - 1.0f))",
        }
        if self.name not in table:
            raise Unsupported(f"no CUDA code for the recurrent activation {self.name!r}")
        return table[self.name]


def activation_list(ctx: CudaContext, kind, num_dir: int) -> list[list[Activation]]:
    """The activations per direction; alphas and betas consumed in order, as the reference does.

    Example:
        >>> activation_list(ctx, _GRU, 1)           # doctest: +SKIP
        [[Activation(name='sigmoid', alpha=None, beta=None), Activation(name='tanh', alpha=None, beta=None)]]
    """
    try:
        names = _activation_names(ctx, kind, num_dir)
    except ValueError as e:
        raise Unsupported(str(e)) from None
    alphas = [float(a) for a in ctx.attr("activation_alpha", None) or []]
    betas = [float(b) for b in ctx.attr("activation_beta", None) or []]
    acts = []
    for name in names:
        default_alpha, default_beta = _ACTIVATION_PARAMS[name.lower()]
        alpha = (alphas.pop(0) if alphas else default_alpha) if default_alpha is not None else None
        beta = (betas.pop(0) if betas else default_beta) if default_beta is not None else None
        acts.append(Activation(name.lower(), alpha, beta))
    per_dir = len(kind.default_activations)
    return [acts[d * per_dir:(d + 1) * per_dir] for d in range(num_dir)]


# ---- what the kernel needs of the node ------------------------------------------------------
@dataclass(frozen=True)
class Layer:
    """One recurrent node as the generator sees it (sizes known; seq and batch C expressions)."""

    kind: str  # "LSTM", "GRU" or "RNN"
    gates: int
    hidden: int
    inputs: int
    num_dir: int
    direction: str
    layout: int
    seq: str
    batch: str
    activations: list  # per direction: list[Activation]
    clip: float | None
    input_forget: bool
    linear_before_reset: bool

    @property
    def groups(self) -> int:
        """Lane groups per block: about two units each, a whole number of warps."""
        groups = min(max(math.ceil(self.hidden / 2), MIN_GROUPS), MAX_GROUPS)
        per_warp = 32 // LANES
        return -(-groups // per_warp) * per_warp

    @property
    def threads(self) -> int:
        return self.groups * LANES

    def x_row(self, t: str) -> str:
        """Where ``x_t`` of the block's batch entry starts in ``X``."""
        if self.layout:
            return f"(b * {self.seq} + ({t})) * {self.inputs}LL"
        return f"(({t}) * {self.batch} + b) * {self.inputs}LL"

    def y_index(self, t: str, j: str) -> str:
        if self.layout:  # [batch, seq, num_dir, hidden]
            return f"((b * {self.seq} + ({t})) * {self.num_dir}LL + d) * {self.hidden}LL + ({j})"
        return f"((({t}) * {self.num_dir}LL + d) * {self.batch} + b) * {self.hidden}LL + ({j})"

    def state_index(self, j: str) -> str:
        if self.layout:  # [batch, num_dir, hidden]
            return f"(b * {self.num_dir}LL + d) * {self.hidden}LL + ({j})"
        return f"(d * {self.batch} + b) * {self.hidden}LL + ({j})"


def _known(value, what: str) -> int:
    if not isinstance(value, int | np.integer):
        raise Unsupported(f"recurrent layer with a symbolic {what} ({value})")
    return int(value)


def read_layer(ctx: CudaContext, kind) -> Layer:
    """The :class:`Layer` of ``ctx``'s node; :class:`Unsupported` for what the kernel does not take."""
    for i in (0, 1, 2, 3, 6, 7):
        if ctx.has_input(i) and ctx.in_dtype(i) != DType.FLOAT32:
            raise Unsupported(f"{kind.name}: CUDA kernels take float32, not {ctx.in_dtype(i).short}")
    direction = _direction(ctx)
    if direction not in ("forward", "reverse", "bidirectional"):
        raise Unsupported(f"{kind.name} direction {direction!r}")
    num_dir = 2 if direction == "bidirectional" else 1
    w_shape, r_shape, x_shape = ctx.in_shape(1), ctx.in_shape(2), ctx.in_shape(0)
    hidden = _known(ctx.attr("hidden_size", None) or r_shape[2], "hidden size")
    inputs = _known(w_shape[2], "input size")
    if hidden > MAX_HIDDEN:
        raise Unsupported(f"{kind.name} hidden size {hidden} (at most {MAX_HIDDEN} in shared memory)")
    if tuple(w_shape[:2]) != (num_dir, kind.gates * hidden) or tuple(r_shape) != (num_dir, kind.gates * hidden, hidden):
        raise Unsupported(f"{kind.name} weights of shapes {w_shape} and {r_shape}")
    layout = _layout(ctx)
    seq, batch = (x_shape[1], x_shape[0]) if layout else (x_shape[0], x_shape[1])
    clip = ctx.attr("clip", None)
    return Layer(
        kind=kind.name, gates=kind.gates, hidden=hidden, inputs=inputs, num_dir=num_dir, direction=direction,
        layout=layout, seq=ctx.dim(seq), batch=ctx.dim(batch), activations=activation_list(ctx, kind, num_dir),
        clip=None if clip is None else float(clip),
        input_forget=kind is _LSTM and bool(ctx.attr("input_forget", 0)),
        linear_before_reset=kind is _GRU and bool(ctx.attr("linear_before_reset", 0)))


# ---- code ------------------------------------------------------------------------------------
class Writer:
    """Writes the kernel's C: the block's setup, the dot products of a unit, its cell, the
    time loop and the final states."""

    def __init__(self, ctx: CudaContext, layer: Layer):
        self.ctx, self.layer = ctx, layer
        self.outputs = [i < len(ctx.node.outputs) and ctx.node.outputs[i] is not None
                        for i in range(3 if layer.kind == "LSTM" else 2)]
        self.names: dict[Activation, str] = {}

    # ---- small pieces ------------------------------------------------------------------------
    def act(self, role: int, v: str) -> str:
        """Activation ``role`` (0: f, 1: g, 2: h) of the block's direction applied to ``v``."""
        per_dir = [self._act_helper(acts[role]) for acts in self.layer.activations]
        if len(set(per_dir)) == 1:
            return f"{per_dir[0]}({v})"
        return f"(d == 0 ? {per_dir[0]}({v}) : {per_dir[1]}({v}))"

    def _act_helper(self, a: Activation) -> str:
        if a not in self.names:
            name = f"eg_rnn_act{len(self.names)}"
            self.ctx.helper(f"__device__ __forceinline__ float {name}(float v) {{ return {a.code('v')}; }}")
            self.names[a] = name
        return self.names[a]

    def clip(self, v: str) -> str:
        if self.layer.clip is None:
            return v
        c = _float(self.layer.clip)
        return f"fminf(fmaxf({v}, -{c}), {c})"

    def bias(self, gate: int, recurrent: bool) -> str:
        """``Wb`` (or ``Rb``) of gate ``gate`` at unit ``j``; ``0.0f`` without ``B``."""
        if not self.ctx.has_input(3):
            return "0.0f"
        offset = (self.layer.gates * (1 if recurrent else 0) + gate) * self.layer.hidden
        return f"bias[{offset} + j]"

    def dots(self, accumulators: list[tuple[str, int | None, int | None]], h_source: str) -> str:
        """Declares the accumulators ``(name, W gate, R gate)``, sums the group lane's share of
        their dot products over ``x_t`` and ``h_source`` (shared memory), then over the group."""
        H, inp = self.layer.hidden, self.layer.inputs
        lines = [f"float {name} = 0.0f;" for name, _, _ in accumulators]
        body = []
        w_gates = [(name, g) for name, g, _ in accumulators if g is not None]
        r_gates = [(name, g) for name, _, g in accumulators if g is not None]
        if w_gates:
            rows = "".join(f"const float* w_{name} = w + (long long)({g * H} + j) * {inp};\n"
                           for name, g in w_gates)
            fmas = "".join(f"{name} = fmaf(w_{name}[k], xv, {name});\n" for name, _ in w_gates)
            body.append(f"{rows}#pragma unroll 4\nfor (int k = sub; k < {inp}; k += {LANES}) {{\n"
                        f"const float xv = xt[k];\n{fmas}}}")
        if r_gates:
            rows = "".join(f"const float* r_{name} = r + (long long)({g * H} + j) * {H};\n" for name, g in r_gates)
            fmas = "".join(f"{name} = fmaf(r_{name}[k], hv, {name});\n" for name, _ in r_gates)
            body.append(f"{rows}#pragma unroll 4\nfor (int k = sub; k < {H}; k += {LANES}) {{\n"
                        f"const float hv = {h_source}[k];\n{fmas}}}")
        lines.append("if (unit) {\n" + "\n".join(body) + "\n}")
        for name, _, _ in accumulators:  # every lane of the warp takes part (no early exit above)
            lines.append(f"{name} = eg_rnn_group_sum({name});")
        return "\n".join(lines)

    def unit_loop(self, body: str) -> str:
        """``body`` for each of the group's units ``j`` (warp-uniform trip count)."""
        return (f"for (int j0 = 0; j0 < {self.layer.hidden}; j0 += {self.layer.groups}) {{\n"
                f"const int j = j0 + group;\n"
                f"const bool unit = j < {self.layer.hidden};\n{body}\n}}")

    # ---- cells -------------------------------------------------------------------------------
    def lstm_cell(self) -> str:
        H = self.layer.hidden
        gate = [f"a{g} + {self.bias(g, False)} + {self.bias(g, True)}" for g in range(4)]  # i, o, f, c
        if self.ctx.has_input(7):  # peepholes P = [i, o, f]: i and f see c_{t-1}, o sees c_t
            gate[0] += " + peep[j] * cp"
            gate[1] += f" + peep[{H} + j] * cn"
            gate[2] += f" + peep[{2 * H} + j] * cp"
        f_gate = "1.0f - gi" if self.layer.input_forget else self.act(0, self.clip(gate[2]))
        return self.dots([(f"a{g}", g, g) for g in range(4)], "hp") + f"""
if (unit && sub == 0) {{
    const float cp = eg_c[j];
    const float gi = {self.act(0, self.clip(gate[0]))};
    const float gf = {f_gate};
    const float cn = gf * cp + gi * {self.act(1, self.clip(gate[3]))};
    const float go = {self.act(0, self.clip(gate[1]))};
    eg_c[j] = cn;
    hn[j] = go * {self.act(2, "cn")};
}}"""

    def gru_cells(self) -> list[str]:
        """The GRU step's phases (one, or two around a barrier without ``linear_before_reset``)."""
        z = self.act(0, self.clip(f"az + {self.bias(0, False)} + {self.bias(0, True)}"))
        r = self.act(0, self.clip(f"ar + {self.bias(1, False)} + {self.bias(1, True)}"))
        if self.layer.linear_before_reset:
            cand = f"axh + {self.bias(2, False)} + gr * (arh + {self.bias(2, True)})"
            return [self.dots([("az", 0, 0), ("ar", 1, 1), ("axh", 2, None), ("arh", None, 2)], "hp") + f"""
if (unit && sub == 0) {{
    const float gz = {z};
    const float gr = {r};
    const float hh = {self.act(1, self.clip(cand))};
    hn[j] = (1.0f - gz) * hh + gz * hp[j];
}}"""]
        first = self.dots([("az", 0, 0), ("ar", 1, 1), ("axh", 2, None)], "hp") + f"""
if (unit && sub == 0) {{
    const float gr = {r};
    eg_z[j] = {z};
    eg_xh[j] = axh + {self.bias(2, False)};
    eg_rh[j] = gr * hp[j];
}}"""
        cand = f"eg_xh[j] + arh + {self.bias(2, True)}"
        second = self.dots([("arh", None, 2)], "eg_rh") + f"""
if (unit && sub == 0) {{
    const float gz = eg_z[j];
    const float hh = {self.act(1, self.clip(cand))};
    hn[j] = (1.0f - gz) * hh + gz * hp[j];
}}"""
        return [first, second]

    def rnn_cell(self) -> str:
        pre = self.clip(f"a0 + {self.bias(0, False)} + {self.bias(0, True)}")
        return self.dots([("a0", 0, 0)], "hp") + f"""
if (unit && sub == 0) hn[j] = {self.act(0, pre)};"""

    def phases(self) -> list[str]:
        if self.layer.kind == "LSTM":
            return [self.lstm_cell()]
        if self.layer.kind == "GRU":
            return self.gru_cells()
        return [self.rnn_cell()]

    # ---- the kernel --------------------------------------------------------------------------
    def shared(self) -> str:
        H = self.layer.hidden
        lines = [f"__shared__ float eg_h[2][{H}];"]
        if self.layer.kind == "LSTM":
            lines.append(f"__shared__ float eg_c[{H}];")
        if self.layer.kind == "GRU" and not self.layer.linear_before_reset:
            lines.append(f"__shared__ float eg_z[{H}];\n__shared__ float eg_xh[{H}];\n__shared__ float eg_rh[{H}];")
        return "\n".join(lines)

    def setup(self) -> str:
        L, ctx = self.layer, self.ctx
        G, H = L.gates, L.hidden
        reverse = {"forward": "false", "reverse": "true", "bidirectional": "d == 1"}[L.direction]
        length = (f"eg_max(0LL, eg_min((long long){ctx.x(4)}[b], {L.seq}))" if ctx.has_input(4) else L.seq)
        lines = [
            "const long long b = blockIdx.x;",
            "const long long d = blockIdx.y;",
            f"const bool reverse = {reverse};",
            "const int tid = threadIdx.x;",
            f"const int sub = tid % {LANES};",
            f"const int group = tid / {LANES};",
            f"const long long len = {length};",
            f"const float* __restrict__ w = {ctx.x(1)} + d * {G * H * L.inputs}LL;",
            f"const float* __restrict__ r = {ctx.x(2)} + d * {G * H * H}LL;",
        ]
        if ctx.has_input(3):
            lines.append(f"const float* __restrict__ bias = {ctx.x(3)} + d * {2 * G * H}LL;")
        if L.kind == "LSTM" and ctx.has_input(7):
            lines.append(f"const float* __restrict__ peep = {ctx.x(7)} + d * {3 * H}LL;")
        h0 = f"{ctx.x(5)}[{L.state_index('j')}]" if ctx.has_input(5) else "0.0f"
        init = [f"eg_h[0][j] = {h0};"]
        if L.kind == "LSTM":
            c0 = f"{ctx.x(6)}[{L.state_index('j')}]" if ctx.has_input(6) else "0.0f"
            init.append(f"eg_c[j] = {c0};")
        lines.append(f"for (int j = tid; j < {H}; j += {L.threads}) {{ {' '.join(init)} }}")
        if self.outputs[0] and ctx.has_input(4):  # steps past the sequence's end are zeros
            lines.append(f"for (long long e = tid; e < ({L.seq} - len) * {H}LL; e += {L.threads}) {{\n"
                         f"    const long long t = len + e / {H}LL;\n"
                         f"    {ctx.y(0)}[{L.y_index('t', f'e % {H}LL')}] = 0.0f;\n}}")
        lines.append("__syncthreads();")
        return "\n".join(lines)

    def time_loop(self) -> str:
        L, ctx = self.layer, self.ctx
        steps = [self.unit_loop(phase) for phase in self.phases()]
        store = (f"for (int j = tid; j < {L.hidden}; j += {L.threads}) "
                 f"{ctx.y(0)}[{L.y_index('t', 'j')}] = hn[j];") if self.outputs[0] else ""
        return (f"for (long long s = 0; s < len; ++s) {{\n"
                f"const long long t = reverse ? len - 1 - s : s;\n"
                f"const float* __restrict__ xt = {ctx.x(0)} + {L.x_row('t')};\n"
                f"const float* hp = eg_h[s & 1];\n"
                f"float* hn = eg_h[(s & 1) ^ 1];\n"
                + "\n__syncthreads();\n".join(steps) + "\n__syncthreads();\n" + store + "\n}")

    def final_states(self) -> str:
        L, ctx = self.layer, self.ctx
        writes = []
        if self.outputs[1]:
            writes.append(f"{ctx.y(1)}[{L.state_index('j')}] = len > 0 ? eg_h[len & 1][j] : 0.0f;")
        if len(self.outputs) > 2 and self.outputs[2]:
            writes.append(f"{ctx.y(2)}[{L.state_index('j')}] = len > 0 ? eg_c[j] : 0.0f;")
        if not writes:
            return ""
        return f"for (int j = tid; j < {L.hidden}; j += {L.threads}) {{ {' '.join(writes)} }}"

    def write(self) -> None:
        if not any(self.outputs):
            raise Unsupported(f"{self.layer.kind} with no output")
        self.ctx.helper(GROUP_SUM)
        body = "\n".join(part for part in (self.shared(), self.setup(), self.time_loop(), self.final_states()) if part)
        name = f"eg_{self.layer.kind.lower()}"
        self.ctx.function(name, _indent(body), grid=(self.ctx.in_shape(0)[0 if self.layer.layout else 1],
                                                     self.layer.num_dir), block=self.layer.threads)


#: The sum over a group of :data:`LANES` lanes (every lane of the warp calls it).
GROUP_SUM = f"""__device__ __forceinline__ float eg_rnn_group_sum(float v) {{
    for (int o = {LANES // 2}; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}}"""


def _indent(body: str) -> str:
    """Four spaces per open brace (the generated code is read in error logs)."""
    out, depth = [], 1
    for line in body.splitlines():
        line = line.strip()
        if not line:
            continue
        if line.startswith("}"):
            depth -= 1
        out.append("    " * depth + line if not line.startswith("#") else line)
        depth += line.count("{") - line.count("}") + (1 if line.startswith("}") else 0)
    return "\n".join(out)


def _layer_kernel(kind):
    def generate(ctx: CudaContext) -> None:
        Writer(ctx, read_layer(ctx, kind)).write()

    generate.__doc__ = f"The CUDA kernel of ONNX {kind.name}: one block per (batch entry, direction)."
    return generate


register_kernel("LSTM")(_layer_kernel(_LSTM))
register_kernel("GRU")(_layer_kernel(_GRU))
register_kernel("RNN")(_layer_kernel(_RNN))

__all__ = ["Activation", "activation_list", "Layer", "read_layer", "Writer", "LANES", "MAX_HIDDEN"]

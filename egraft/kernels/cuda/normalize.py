"""CUDA kernels of the normalizations: Softmax and LogSoftmax, LayerNormalization and
com.egraft LayerNorm, InstanceNormalization, BatchNormalization (inference) and LRN.

Row kernels (softmax along the last axis or over the input coerced to 2-D, layer norms over
the trailing dims, instance norm over each (n, c) plane) give each row to one group of
threads and pick the group from the row length L:

- L <= 256 (a Python int): one warp per row, 4 rows per 128-thread block, each lane keeping
  its ceil(L / 32) values in registers; reductions are xor shuffles;
- L <= 4096: one 128-thread (L <= 1024) or 256-thread block per row, each thread keeping at
  most 16 values in registers; reductions are shuffles and 32 partials in shared memory;
- longer or symbolic rows: one 256-thread block per row and thread-strided loops that read
  the row again (from L2) per pass: softmax keeps an online (max, sum) pair so it reads
  twice, the layer norms read three times (mean, then the centered variance, as numpy does).

Softmax along another axis walks (outer, L, inner) with one thread per column (coalesced over
inner) and the same online (max, sum). BatchNormalization and LRN are elementwise over
(n, c, spatial...): with 256 or more spatial positions (or a symbolic count) a block covers
1024 positions of one plane and reads its channel's parameters once, else one thread per
element. Float32 only, float32 accumulation.

Example:
    >>> kernel = generate(node, graph, 17)       # doctest: +SKIP
    >>> [launch.block for launch in kernel.launches]       # doctest: +SKIP
    [(128, 1, 1)]
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from egraft.ir.dims import dim_product
from egraft.ir.dtypes import DType
from egraft.kernels.cuda import register_kernel
from egraft.kernels.cuda.emit import CudaContext, Unsupported, _float
from egraft.kernels.cuda.reduce import MAX, SUM, block_reduce, warp_reduce

#: Rows up to this long go to one warp each, values in registers.
WARP_ROW = 256
#: Warps (rows) per block of the warp-per-row kernels.
WARPS_PER_BLOCK = 4
#: Rows up to this long go to one block each, values in registers; longer ones are re-read.
REGISTER_ROW = 4096
#: Threads of the elementwise and looping kernels.
THREADS = 256
#: Spatial positions per block of the per-plane elementwise kernels (4 per thread).
PLANE_CHUNK = 1024


def _require_float32(ctx: CudaContext, *inputs: int) -> None:
    for i in inputs:
        if ctx.has_input(i) and ctx.in_dtype(i) != DType.FLOAT32:
            raise Unsupported(f"{ctx.node.op}: CUDA kernels take float32, not {ctx.in_dtype(i).short}")


def _is_int(d) -> bool:
    return isinstance(d, int | np.integer)


# ---- rows ---------------------------------------------------------------------------------------
@dataclass(frozen=True)
class RowPlan:
    """How one row of length L is spread: ``threads`` per row (32: a warp), ``rows`` per
    block, ``values`` per thread kept in registers (0: loop over the row in memory)."""

    threads: int
    rows: int
    values: int

    @property
    def warp(self) -> bool:
        return self.threads == 32

    @property
    def block(self) -> int:
        return self.threads * self.rows


def row_plan(length) -> RowPlan:
    """The thread group of a row of ``length`` (an int, or a sympy dim).

    Example:
        >>> row_plan(768)
        RowPlan(threads=128, rows=1, values=6)
    """
    if not _is_int(length) or int(length) > REGISTER_ROW:
        return RowPlan(THREADS, 1, 0)
    n = max(int(length), 1)
    if n <= WARP_ROW:
        return RowPlan(32, WARPS_PER_BLOCK, math.ceil(n / 32))
    threads = 128 if n <= 1024 else 256
    return RowPlan(threads, 1, math.ceil(n / threads))


class RowWriter:
    """Writes a row kernel's body: the row and thread indices, loops over the thread's values
    (registers or memory) and reductions over the row's threads."""

    def __init__(self, ctx: CudaContext, plan: RowPlan, rows, length):
        self.ctx, self.plan = ctx, plan
        self.rows, self.n = ctx.dim(rows), ctx.dim(length)
        self.grid = ctx.blocks_for(rows, plan.rows)

    def head(self) -> str:
        """Declares ``row``, ``t`` (the thread in its row), ``live`` and the scratch memory."""
        if self.plan.warp:
            return (f"const long long row = (long long)blockIdx.x * {self.plan.rows} + (threadIdx.x >> 5);\n"
                    f"    const int t = threadIdx.x & 31;\n"
                    f"    const bool live = row < {self.rows};")
        return (f"__shared__ float eg_scratch[64];\n"
                f"    const long long row = blockIdx.x;\n"
                f"    const int t = threadIdx.x;\n"
                f"    const bool live = row < {self.rows};")

    def load(self, src: str) -> str:
        """Registers ``v[k]``: the thread's values of row ``src`` (a pointer); nothing when looping."""
        if not self.plan.values:
            return ""
        return (f"float v[{self.plan.values}];\n"
                f"    #pragma unroll\n"
                f"    for (int k = 0; k < {self.plan.values}; ++k) {{\n"
                f"        const long long j = t + (long long)k * {self.plan.threads};\n"
                f"        v[k] = live && j < {self.n} ? {src}[j] : 0.0f;\n"
                f"    }}")

    def each(self, statement: str, src: str) -> str:
        """``statement`` for each of the thread's values ``{v}`` at row index ``j`` (a register,
        or ``xv`` read from ``src`` in a loop)."""
        if self.plan.values:
            return (f"#pragma unroll\n"
                    f"    for (int k = 0; k < {self.plan.values}; ++k) {{\n"
                    f"        const long long j = t + (long long)k * {self.plan.threads};\n"
                    f"        if (live && j < {self.n}) {{ {statement.format(v='v[k]')} }}\n"
                    f"    }}")
        return (f"for (long long j = t; live && j < {self.n}; j += {self.plan.threads}) {{\n"
                f"        const float xv = {src}[j];\n"
                f"        {statement.format(v='xv')}\n"
                f"    }}")

    def reduce(self, combine, value: str) -> str:
        """``value = <its reduction over the row's threads>;``."""
        if self.plan.warp:
            return f"{value} = {warp_reduce(self.ctx, combine)}({value});"
        return f"{value} = {block_reduce(self.ctx, combine)}({value}, eg_scratch);"

    def function(self, name: str, body: str) -> None:
        self.ctx.function(name, body, grid=self.grid, block=self.plan.block)


# ---- Softmax, LogSoftmax ------------------------------------------------------------------------
ONLINE_SOFTMAX = r"""
__device__ __forceinline__ void eg_softmax_add(float& m, float& s, float v) {
    // exp(v - v) is 1, or NaN for v = +inf (as numpy's exp(inf - max) makes the whole row NaN)
    if (v > m) { s = s * expf(m - v) + (v == EG_INF ? __int_as_float(0x7fc00000) : 1.0f); m = v; }
    else s += v == -EG_INF ? 0.0f : expf(v - m);
}
__device__ __forceinline__ void eg_softmax_merge(float& m, float& s, float m2, float s2) {
    const float mm = fmaxf(m, m2);
    s = (m == mm ? s : s * expf(m - mm)) + (m2 == mm ? s2 : s2 * expf(m2 - mm));
    m = mm;
}
__device__ __forceinline__ void eg_warp_softmax_merge(float& m, float& s) {
    for (int o = 16; o > 0; o >>= 1) {
        const float m2 = __shfl_xor_sync(0xffffffffu, m, o), s2 = __shfl_xor_sync(0xffffffffu, s, o);
        eg_softmax_merge(m, s, m2, s2);
    }
}
__device__ __forceinline__ void eg_block_softmax_merge(float& m, float& s, float* scratch) {
    eg_warp_softmax_merge(m, s);
    __syncthreads();
    if ((threadIdx.x & 31u) == 0u) { scratch[threadIdx.x >> 5] = m; scratch[32 + (threadIdx.x >> 5)] = s; }
    __syncthreads();
    const bool has = (threadIdx.x & 31u) < (blockDim.x >> 5);
    m = has ? scratch[threadIdx.x & 31u] : -EG_INF;
    s = has ? scratch[32 + (threadIdx.x & 31u)] : 0.0f;
    eg_warp_softmax_merge(m, s);
}
""".strip()


def _softmax_rows(ctx: CudaContext, rows, length, log: bool) -> None:
    """Softmax of contiguous rows: max, sum of exp(v - max), then exp(v - max) / sum
    (or v - max - log(sum)), in registers or with the online (max, sum) pair."""
    plan = row_plan(length)
    w = RowWriter(ctx, plan, rows, length)
    x, y, n = ctx.x(0), ctx.y(0), ctx.dim(length)
    head = f"""
    {w.head()}
    const float* src = {x} + (live ? row : 0) * {n};
    float* dst = {y} + (live ? row : 0) * {n};"""
    if plan.values:
        write = "dst[j] = {v} - m - logs;" if log else "dst[j] = {v} / s;"
        body = f"""{head}
    {w.load("src")}
    float m = -EG_INF;
    {w.each("m = fmaxf(m, {v});", "src")}
    {w.reduce(MAX, "m")}
    float s = 0.0f;
    {w.each("const float e = expf({v} - m); s += e;" + ("" if log else " {v} = e;"), "src")}
    {w.reduce(SUM, "s")}
    const float logs = logf(s);
    {w.each(write, "src")}"""
    else:
        ctx.helper(ONLINE_SOFTMAX)
        merge = "eg_warp_softmax_merge(m, s);" if plan.warp else "eg_block_softmax_merge(m, s, eg_scratch);"
        write = "dst[j] = {v} - m - logs;" if log else "dst[j] = expf({v} - m) / s;"
        body = f"""{head}
    float m = -EG_INF, s = 0.0f;
    {w.each("eg_softmax_add(m, s, {v});", "src")}
    {merge}
    const float logs = logf(s);
    {w.each(write, "src")}"""
    w.function("eg_log_softmax" if log else "eg_softmax", body)


def _softmax_columns(ctx: CudaContext, outer, length, inner, log: bool) -> None:
    """Softmax along a middle axis: one thread per (outer, inner) column, online (max, sum)."""
    ctx.helper(ONLINE_SOFTMAX)
    x, y = ctx.x(0), ctx.y(0)
    cols, n, s = ctx.dim(dim_product([outer, inner])), ctx.dim(length), ctx.dim(inner)
    write = "yc[r * {s}] = v - m - logs;" if log else "yc[r * {s}] = expf(v - m) / s;"
    body = f"""
    const long long q = (long long)blockIdx.x * {THREADS} + threadIdx.x;
    if (q < {cols}) {{
        const long long o = q / {s};
        const long long base = o * {n} * {s} + (q - o * {s});
        const float* xc = {x} + base;
        float* yc = {y} + base;
        float m = -EG_INF, s = 0.0f;
        for (long long r = 0; r < {n}; ++r) eg_softmax_add(m, s, xc[r * {s}]);
        const float logs = logf(s);
        for (long long r = 0; r < {n}; ++r) {{ const float v = xc[r * {s}]; {write.format(s=s)} }}
    }}"""
    ctx.function("eg_log_softmax" if log else "eg_softmax", body,
                 grid=ctx.blocks_for(dim_product([outer, inner]), THREADS), block=THREADS)


@register_kernel("Softmax", "LogSoftmax")
def softmax_kernel(ctx: CudaContext) -> None:
    """Softmax/LogSoftmax: along ``axis`` (opset >= 13), or over the input coerced to 2-D at
    ``axis`` (before 13).

    Example:
        >>> kernel = generate(node, graph, 13)       # doctest: +SKIP
    """
    _require_float32(ctx, 0)
    shape = ctx.in_shape(0)
    rank, log = len(shape), ctx.node.op == "LogSoftmax"
    if ctx.opset < 13:
        axis = int(ctx.attr("axis", 1))
        axis = axis + rank if axis < 0 else axis
        return _softmax_rows(ctx, dim_product(shape[:axis]), dim_product(shape[axis:]), log)
    axis = int(ctx.attr("axis", -1))
    axis = axis + rank if axis < 0 else axis
    inner = dim_product(shape[axis + 1:])
    outer, length = dim_product(shape[:axis]), shape[axis]
    if _is_int(inner) and int(inner) == 1:
        return _softmax_rows(ctx, outer, length, log)
    _softmax_columns(ctx, outer, length, inner, log)


# ---- layer and instance norms ------------------------------------------------------------------
def param_index(ctx: CudaContext, param_shape, shape, j: str) -> str:
    """The C index into a parameter of ``param_shape`` broadcast (numpy rules) to ``shape``,
    for the flat index ``j`` into ``shape``.

    Example:
        >>> param_index(CudaContext(None, None), (3, 1), (3, 4), "j")
        '(j / 4LL)'
        >>> param_index(CudaContext(None, None), (4,), (3, 4), "j")
        '(j % 4LL)'
    """
    param_shape = (1,) * (len(shape) - len(param_shape)) + tuple(param_shape)
    full = [not (_is_int(p) and int(p) == 1) for p in param_shape]
    if all(f or (_is_int(d) and int(d) == 1) for f, d in zip(full, shape)):
        return j
    if not any(full):
        return "0"
    terms = []
    for i, f in enumerate(full):
        if not f:
            continue
        after = dim_product(shape[i + 1:])
        coordinate = j if i == 0 else f"({j} % {ctx.dim(dim_product(shape[i:]))})"
        if not (_is_int(after) and int(after) == 1):
            coordinate = f"({coordinate} / {ctx.dim(after)})"
        pstride = dim_product(param_shape[i + 1:])
        terms.append(coordinate if _is_int(pstride) and int(pstride) == 1 else f"{coordinate} * {ctx.dim(pstride)}")
    return terms[0] if len(terms) == 1 else "(" + " + ".join(terms) + ")"


def _normalize_rows(ctx: CudaContext, name: str, rows, length, epsilon: float, scale: str, bias: str | None,
                    stats: bool = False) -> None:
    """Rows normalized to mean 0, variance 1 (the mean first, then the mean of the squared
    centered values), then ``* scale + bias``: C expressions of ``j`` (the row index) or of
    ``row``; ``stats`` also writes each row's mean (y1) and 1/std (y2)."""
    plan = row_plan(length)
    w = RowWriter(ctx, plan, rows, length)
    x, y, n = ctx.x(0), ctx.y(0), ctx.dim(length)
    eps = _float(epsilon)
    affine = f"* {scale}" + (f" + {bias}" if bias else "")
    if plan.values:
        passes = f"""
    {w.load("src")}
    float sum = 0.0f;
    {w.each("sum += {v};", "src")}
    {w.reduce(SUM, "sum")}
    const float mean = sum / (float){n};
    float sq = 0.0f;
    {w.each("{v} -= mean; sq += {v} * {v};", "src")}
    {w.reduce(SUM, "sq")}
    const float inv = 1.0f / sqrtf(sq / (float){n} + {eps});
    {w.each("dst[j] = {v} * inv " + affine + ";", "src")}"""
    else:
        passes = f"""
    float sum = 0.0f;
    {w.each("sum += {v};", "src")}
    {w.reduce(SUM, "sum")}
    const float mean = sum / (float){n};
    float sq = 0.0f;
    {w.each("const float c = {v} - mean; sq += c * c;", "src")}
    {w.reduce(SUM, "sq")}
    const float inv = 1.0f / sqrtf(sq / (float){n} + {eps});
    {w.each("dst[j] = ({v} - mean) * inv " + affine + ";", "src")}"""
    out_stats = ""
    if stats:
        out_stats = f"\n    if (live && t == 0) {{ {ctx.y(1)}[row] = mean; {ctx.y(2)}[row] = inv; }}"
    body = f"""
    {w.head()}
    const float* src = {x} + (live ? row : 0) * {n};
    float* dst = {y} + (live ? row : 0) * {n};{passes}{out_stats}"""
    w.function(name, body)


def _layer_norm(ctx: CudaContext, stats: bool) -> None:
    _require_float32(ctx, 0, 1, 2)
    shape = ctx.in_shape(0)
    axis = int(ctx.attr("axis", -1))
    axis = axis + len(shape) if axis < 0 else axis
    normalized = shape[axis:]
    scale = f"{ctx.x(1)}[{param_index(ctx, ctx.in_shape(1), normalized, 'j')}]"
    bias = f"{ctx.x(2)}[{param_index(ctx, ctx.in_shape(2), normalized, 'j')}]" if ctx.has_input(2) else None
    _normalize_rows(ctx, "eg_layer_norm", dim_product(shape[:axis]), dim_product(normalized),
                    float(ctx.attr("epsilon", 1e-5)), scale, bias, stats)


@register_kernel("LayerNormalization")
def layer_normalization_kernel(ctx: CudaContext) -> None:
    """LayerNormalization-17 over the dims from ``axis``; Mean and InvStdDev when asked for
    (stash_type 1, float32).

    Example:
        >>> kernel = generate(node, graph, 17)       # doctest: +SKIP
    """
    outputs = [i for i, v in enumerate(ctx.node.outputs) if v is not None]
    stats = any(i > 0 for i in outputs)
    if stats and (int(ctx.attr("stash_type", 1)) != 1 or outputs != [0, 1, 2]):
        raise Unsupported("LayerNormalization: Mean and InvStdDev are written only together, in float32")
    _layer_norm(ctx, stats)


@register_kernel("LayerNorm", domain="com.egraft")
def layer_norm_kernel(ctx: CudaContext) -> None:
    """com.egraft LayerNorm (axis, epsilon, scale, optional bias).

    Example:
        >>> kernel = generate(node, graph, 1)        # doctest: +SKIP
    """
    _layer_norm(ctx, False)


@register_kernel("InstanceNormalization")
def instance_normalization_kernel(ctx: CudaContext) -> None:
    """InstanceNormalization: each (n, c) plane is a row; scale[c] and B[c].

    Example:
        >>> kernel = generate(node, graph, 17)       # doctest: +SKIP
    """
    _require_float32(ctx, 0, 1, 2)
    shape = ctx.in_shape(0)
    if len(shape) < 3:
        raise Unsupported("InstanceNormalization: an input of rank < 3 has no spatial dims")
    channel = f"(row % {ctx.dim(shape[1])})"
    _normalize_rows(ctx, "eg_instance_norm", dim_product(shape[:2]), dim_product(shape[2:]),
                    float(ctx.attr("epsilon", 1e-5)), f"{ctx.x(1)}[{channel}]", f"{ctx.x(2)}[{channel}]")


# ---- per-channel elementwise: BatchNormalization, LRN -------------------------------------------
def _per_channel(ctx: CudaContext, name: str, setup: str, element: str) -> None:
    """An elementwise kernel over (n, c, spatial...) that knows each element's channel:
    ``setup`` (C statements of ``c``) runs once per thread, ``element`` (C statements of
    ``xv`` = x[i], ``i``, ``j`` the spatial index, ``c``) per element, writing ``out``."""
    shape = ctx.in_shape(0)
    x, y = ctx.x(0), ctx.y(0)
    channels, inner = shape[1], dim_product(shape[2:])
    c_dim, s_dim = ctx.dim(channels), ctx.dim(inner)
    if _is_int(inner) and int(inner) < THREADS:
        total = dim_product(shape)
        body = f"""
    const long long i = (long long)blockIdx.x * {THREADS} + threadIdx.x;
    if (i < {ctx.dim(total)}) {{
        const long long j = i % {s_dim};
        const long long c = (i / {s_dim}) % {c_dim};
        {setup}
        const float xv = {x}[i];
        {element}
        {y}[i] = out;
    }}"""
        ctx.function(name, body, grid=ctx.blocks_for(total, THREADS), block=THREADS)
        return
    per_thread = PLANE_CHUNK // THREADS
    chunks = ctx.blocks_for(inner, PLANE_CHUNK)
    body = f"""
    const long long chunks = {ctx.dim(chunks)};
    const long long plane = blockIdx.x / chunks;
    const long long start = (blockIdx.x - plane * chunks) * {PLANE_CHUNK} + threadIdx.x;
    const long long c = plane % {c_dim};
    {setup}
    #pragma unroll
    for (int u = 0; u < {per_thread}; ++u) {{
        const long long j = start + u * {THREADS};
        if (j < {s_dim}) {{
            const long long i = plane * {s_dim} + j;
            const float xv = {x}[i];
            {element}
            {y}[i] = out;
        }}
    }}"""
    ctx.function(name, body, grid=dim_product([shape[0], channels, chunks]), block=THREADS)


def _batch_norm_training(ctx: CudaContext) -> bool:
    if ctx.opset >= 14:
        return bool(ctx.attr("training_mode", 0))
    if ctx.opset < 7:
        return not ctx.attr("is_test", 0)
    return sum(v is not None for v in ctx.node.outputs) > 1


@register_kernel("BatchNormalization")
def batch_normalization_kernel(ctx: CudaContext) -> None:
    """BatchNormalization in inference mode: (x - mean[c]) * (scale[c] / sqrt(var[c] + eps)) + B[c].
    Training mode, extra outputs and per-position (spatial=0) parameters are refused.

    Example:
        >>> kernel = generate(node, graph, 15)       # doctest: +SKIP
    """
    _require_float32(ctx, 0, 1, 2, 3, 4)
    if _batch_norm_training(ctx) or any(v is not None for v in ctx.node.outputs[1:]):
        raise Unsupported("BatchNormalization: only inference mode (one output) has a CUDA kernel")
    if len(ctx.in_shape(0)) < 2 or any(len(ctx.in_shape(i)) != 1 for i in range(1, 5)):
        raise Unsupported("BatchNormalization: needs rank >= 2 and per-channel (1-D) parameters")
    scale, bias, mean, var = (ctx.x(i) for i in range(1, 5))
    eps = _float(float(ctx.attr("epsilon", 1e-5)))
    setup = (f"const float k = {scale}[c] / sqrtf({var}[c] + {eps});\n"
             f"    const float m = {mean}[c], b = {bias}[c];")
    _per_channel(ctx, "eg_batch_norm", setup, "const float out = (xv - m) * k + b;")


@register_kernel("LRN")
def lrn_kernel(ctx: CudaContext) -> None:
    """LRN across channels: x / (bias + alpha / size * sum of x^2 over channels
    [c - (size-1)//2, c + size//2 ... ])^beta, one thread per element.

    Example:
        >>> kernel = generate(node, graph, 13)       # doctest: +SKIP
    """
    _require_float32(ctx, 0)
    shape = ctx.in_shape(0)
    if len(shape) < 3:
        raise Unsupported("LRN: needs an (N, C, D1, ...) input")
    size = int(ctx.attr("size"))
    alpha, beta, bias = float(ctx.attr("alpha", 1e-4)), float(ctx.attr("beta", 0.75)), float(ctx.attr("bias", 1.0))
    before, after = (size - 1) // 2, size - 1 - (size - 1) // 2
    x, c_dim, s_dim = ctx.x(0), ctx.dim(shape[1]), ctx.dim(dim_product(shape[2:]))
    element = f"""float sq = 0.0f;
            for (long long cc = c - {before}; cc <= c + {after}; ++cc) {{
                if (cc >= 0 && cc < {c_dim}) {{ const float u = {x}[i + (cc - c) * {s_dim}]; sq += u * u; }}
            }}
            const float out = xv / powf({_float(bias)} + {_float(np.float32(alpha / size))} * sq, {_float(beta)});"""
    _per_channel(ctx, "eg_lrn", "", element)


__all__ = ["RowPlan", "RowWriter", "row_plan", "param_index", "softmax_kernel", "layer_normalization_kernel",
           "layer_norm_kernel", "instance_normalization_kernel", "batch_normalization_kernel", "lrn_kernel"]

"""CUDA kernel of egraft's ``Attention`` (float32): ``Softmax(scale * Q @ Kt + mask) @ V``
with ``Q [..., S, D]``, ``Kt [..., D, T]``, ``V [..., T, Dv]``, the mask broadcast to
``[..., S, T]`` and every leading dim broadcast, in one launch and without a ``T``-sized
buffer (flash-attention style: an online softmax over tiles of 32 keys).

A block of 128 threads (4 warps) takes ``4 * R`` query rows of one batch index, ``R`` per
warp (8, or fewer when ``D`` and ``Dv`` are large, to stay within 48 KiB of shared
memory). Its queries sit in shared memory; per tile of 32 keys the block stages that
tile of ``Kt`` and ``V`` (coalesced rows), then each warp, lane ``j`` holding key ``j``:
computes its rows' scores, takes each row's running maximum with a warp reduction,
rescales its accumulators, writes the probabilities to a per-warp shared row and adds
``P @ V`` (lane ``j`` owns output columns ``j, j + 32, ...``). The row sums are kept per
lane and reduced once at the end. Keys past ``T`` and queries past ``S`` are masked,
not skipped, so every thread reaches every barrier. ``D`` and ``Dv`` must be static.

Example:
    >>> kernel = generate(attention_node, graph)            # doctest: +SKIP
    >>> kernel.launches[0].block                            # doctest: +SKIP
    (128, 1, 1)
"""

from __future__ import annotations

from egraft.ir.dims import dim_product
from egraft.kernels.cuda import register_kernel
from egraft.kernels.cuda.emit import CudaContext, Unsupported
from egraft.kernels.cuda.gemm import FUSED_DOMAIN, batch_bases, broadcast_strides, require_float32

WARPS = 4
#: Keys per tile: one per lane.
KEYS = 32
#: Static shared memory a block may use.
SHARED_LIMIT = 48 * 1024


def rows_per_warp(depth: int, value_depth: int) -> int:
    """The query rows per warp (8, 4, 2 or 1) whose shared memory fits :data:`SHARED_LIMIT`;
    ``Unsupported`` when none does.

    Example:
        >>> rows_per_warp(64, 64), rows_per_warp(128, 128)
        (8, 4)
    """
    for rows in (8, 4, 2, 1):
        if _shared_floats(rows * WARPS, depth, value_depth) * 4 <= SHARED_LIMIT:
            return rows
    raise Unsupported(f"attention heads of D={depth}, Dv={value_depth} do not fit in shared memory")


def _shared_floats(queries: int, depth: int, value_depth: int) -> int:
    return queries * depth + depth * KEYS + KEYS * value_depth + queries * KEYS


@register_kernel("Attention", domain=FUSED_DOMAIN)
def attention_kernel(ctx: CudaContext) -> None:
    """One launch of ``ceil(S / (4 R)) * batch`` blocks of 128 threads.

    Example:
        >>> generate(attention_node, graph).launches[0].function    # doctest: +SKIP
        'eg_attention'
    """
    require_float32(ctx)
    q, kt, v, out = ctx.in_shape(0), ctx.in_shape(1), ctx.in_shape(2), ctx.out_shape(0)
    if min(len(q), len(kt), len(v)) < 2:
        raise Unsupported("attention operands need rank >= 2")
    depth, value_depth = q[-1], v[-1]
    if not isinstance(depth, int) or not isinstance(value_depth, int):
        raise Unsupported(f"attention heads of symbolic size (D={depth}, Dv={value_depth})")
    queries_dim, keys_dim = q[-2], kt[-1]
    batch = tuple(out[:-2])
    nb = len(batch)
    strides = {"q_base": broadcast_strides(q, (*batch, queries_dim, depth))[:nb],
               "k_base": broadcast_strides(kt, (*batch, depth, keys_dim))[:nb],
               "v_base": broadcast_strides(v, (*batch, keys_dim, value_depth))[:nb]}
    mask = None
    if ctx.has_input(3):
        if len(ctx.in_shape(3)) > len(out):
            raise Unsupported("the mask has more dims than the output")
        mask = broadcast_strides(ctx.in_shape(3), (*batch, queries_dim, keys_dim))
        strides["m_base"] = mask[:nb]
    rows = rows_per_warp(depth, value_depth)
    body = _body(ctx, batch, strides, mask, rows, depth, value_depth, queries_dim, keys_dim)
    grid = ctx.blocks_for(queries_dim, rows * WARPS) * dim_product(batch)
    ctx.function("eg_attention", body, grid=grid, block=WARPS * 32)


def _body(ctx: CudaContext, batch: tuple, strides: dict, mask: list | None, rows: int, depth: int,
          value_depth: int, queries_dim, keys_dim) -> str:
    queries = rows * WARPS
    columns = -(-value_depth // 32)  # output columns per lane
    scale = float(ctx.attr("scale", 1.0))
    q, k, v, y = ctx.x(0), ctx.x(1), ctx.x(2), ctx.y(0)
    if mask is None:
        add_mask = ""
    else:
        sq, st = (ctx.dim(s) for s in mask[-2:])
        index = " + ".join(p for p, s in ((f"query * {sq}", mask[-2]), (f"key * {st}", mask[-1])) if s != 0)
        add_mask = f"if (valid && query < S) x += {ctx.x(3)}[m_base{' + ' + index if index else ''}];"
    guard = "" if value_depth % 32 == 0 else f"if (lane + 32 * j < {value_depth}) "
    value_read = "Vs[c][lane + 32 * j]" if not guard else \
        f"(lane + 32 * j < {value_depth} ? Vs[c][lane + 32 * j] : 0.0f)"
    return f"""__shared__ float Qs[{queries}][{depth}];
__shared__ float Ks[{depth}][{KEYS}];
__shared__ float Vs[{KEYS}][{value_depth}];
__shared__ float Ps[{queries}][{KEYS}];
const long long S = {ctx.dim(queries_dim)}, T = {ctx.dim(keys_dim)};
const long long blocks_q = eg_max(1LL, eg_ceildiv(S, {queries}));
const long long block = (long long)blockIdx.x;
const long long q0 = block % blocks_q * {queries}, z = block / blocks_q;
const int t = (int)threadIdx.x, warp = t / 32, lane = t % 32;
{batch_bases(ctx, batch, strides)}
for (int i = t; i < {queries * depth}; i += {WARPS * 32}) {{
const int r = i / {depth}, d = i % {depth};
Qs[r][d] = q0 + r < S ? {q}[q_base + (q0 + r) * {depth} + d] : 0.0f;
}}
float m_run[{rows}], l_run[{rows}], o[{rows}][{columns}];
#pragma unroll
for (int r = 0; r < {rows}; ++r) {{
m_run[r] = -EG_INF;
l_run[r] = 0.0f;
#pragma unroll
for (int j = 0; j < {columns}; ++j) o[r][j] = 0.0f;
}}
for (long long t0 = 0; t0 < T; t0 += {KEYS}) {{
__syncthreads();
for (int i = t; i < {depth * KEYS}; i += {WARPS * 32}) {{
const int d = i / {KEYS}, c = i % {KEYS};
Ks[d][c] = t0 + c < T ? {k}[k_base + d * T + t0 + c] : 0.0f;
}}
for (int i = t; i < {KEYS * value_depth}; i += {WARPS * 32}) {{
const int c = i / {value_depth}, e = i % {value_depth};
Vs[c][e] = t0 + c < T ? {v}[v_base + (t0 + c) * {value_depth} + e] : 0.0f;
}}
__syncthreads();
float s[{rows}];
#pragma unroll
for (int r = 0; r < {rows}; ++r) s[r] = 0.0f;
#pragma unroll 8
for (int d = 0; d < {depth}; ++d) {{
const float kd = Ks[d][lane];
#pragma unroll
for (int r = 0; r < {rows}; ++r) s[r] = fmaf(Qs[warp * {rows} + r][d], kd, s[r]);
}}
const long long key = t0 + lane;
const bool valid = key < T;
#pragma unroll
for (int r = 0; r < {rows}; ++r) {{
const long long query = q0 + warp * {rows} + r;
float x = s[r] * {scale!r}f;
{add_mask}
x = valid ? x : -EG_INF;
const float m_new = fmaxf(m_run[r], eg_warp_max(x));
const float base = m_new == -EG_INF ? 0.0f : m_new;
const float correction = expf(m_run[r] - base);
const float p = expf(x - base);
m_run[r] = m_new;
l_run[r] = l_run[r] * correction + p;
#pragma unroll
for (int j = 0; j < {columns}; ++j) o[r][j] *= correction;
Ps[warp * {rows} + r][lane] = p;
}}
__syncwarp();
#pragma unroll 4
for (int c = 0; c < {KEYS}; ++c) {{
float vc[{columns}];
#pragma unroll
for (int j = 0; j < {columns}; ++j) vc[j] = {value_read};
#pragma unroll
for (int r = 0; r < {rows}; ++r) {{
const float p = Ps[warp * {rows} + r][c];
#pragma unroll
for (int j = 0; j < {columns}; ++j) o[r][j] = fmaf(p, vc[j], o[r][j]);
}}
}}
}}
const long long y_base = z * S * {value_depth};
#pragma unroll
for (int r = 0; r < {rows}; ++r) {{
const float l = eg_warp_sum(l_run[r]);
const long long query = q0 + warp * {rows} + r;
if (query < S) {{
#pragma unroll
for (int j = 0; j < {columns}; ++j) {{
{guard}{y}[y_base + query * {value_depth} + lane + 32 * j] = o[r][j] / l;
}}
}}
}}"""


__all__ = ["attention_kernel", "rows_per_warp", "WARPS", "KEYS"]

"""CUDA kernels of the reductions (ReduceSum, ReduceMean, ReduceMax, ReduceMin, ReduceProd,
ReduceSumSquare, ReduceL1, ReduceL2, ReduceLogSum over any axes; ArgMax, ArgMin), and the
warp and block reduction helpers that :mod:`.normalize` and :mod:`.pool` share.

The input's dims are simplified first: dims of size 1 drop out and neighbours that are both
kept or both reduced merge, so most reductions become ``(outer, R, inner)``:

- ``inner == 1`` (rows of R contiguous values): one thread per output for R <= 16, one warp
  per output (8 per 256-thread block, lane-strided loads, shuffle reduction) for R <= 1024
  or many outputs, one 256-thread block per output (shuffles, then 32 partials in shared
  memory) for long rows or few outputs;
- ``inner > 1`` (columns at stride inner): one thread per output for R <= 32, else a
  32 x 8 block per 32 outputs: the 32 lanes read 32 neighbouring columns (coalesced), the
  8 rows of threads split R and meet in a 8 x 33 shared tile;
- several reduced groups (axes 0 and 2 of a rank-3 input): one thread per output with one
  loop per reduced group.

Float32 only; everything accumulates in float32, in a fixed order (deterministic, no atomics).

Example:
    >>> kernel = generate(node, graph, 18)       # doctest: +SKIP
    >>> kernel.launches[0].block                 # doctest: +SKIP
    (256, 1, 1)
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from egraft.ir.dims import dim_product
from egraft.ir.dtypes import DType
from egraft.kernels.cuda import register_kernel
from egraft.kernels.cuda.emit import CudaContext, Unsupported

#: Threads of a one-dimensional block.
THREADS = 256
#: Rows up to this long are reduced by one thread (inner == 1) ...
THREAD_ROW = 16
#: ... up to this long by one warp, longer ones by a block.
WARP_ROW = 1024
#: Fewer rows than this (4 per SM of an H200) get a block each when they are longer than 256.
FEW_ROWS = 528
#: Columns (inner > 1) up to this long are reduced by one thread, longer ones by a 32 x 8 tile.
THREAD_COLUMN = 32
#: The rows of threads of a column tile.
TILE_ROWS = 8


# ---- combining values ---------------------------------------------------------------------------
@dataclass(frozen=True)
class Combine:
    """How two partial results merge: ``template`` is C with ``{a}`` and ``{b}``."""

    name: str
    identity: str
    template: str

    def __call__(self, a: str, b: str) -> str:
        """The C expression of ``a`` combined with ``b``.

        Example:
            >>> SUM("acc", "v")
            'acc + v'
        """
        return self.template.format(a=a, b=b)


SUM = Combine("sum", "0.0f", "{a} + {b}")
MAX = Combine("max", "(-EG_INF)", "eg_nanmax({a}, {b})")
MIN = Combine("min", "EG_INF", "eg_nanmin({a}, {b})")
PROD = Combine("prod", "1.0f", "{a} * {b}")

#: max and min that keep a NaN, as numpy's do.
NAN_MINMAX = r"""
__device__ __forceinline__ float eg_nanmax(float a, float b) { return (b > a || b != b) ? b : a; }
__device__ __forceinline__ float eg_nanmin(float a, float b) { return (b < a || b != b) ? b : a; }
""".strip()


def warp_reduce(ctx: CudaContext, combine: Combine) -> str:
    """Add ``eg_warp_all_<name>(v)`` (every lane gets the warp's result; xor butterfly) and
    return its name.

    Example:
        >>> warp_reduce(ctx, SUM)        # doctest: +SKIP
        'eg_warp_all_sum'
    """
    ctx.helper(NAN_MINMAX)
    name = f"eg_warp_all_{combine.name}"
    ctx.helper(f"__device__ __forceinline__ float {name}(float v) {{\n"
               f"    for (int o = 16; o > 0; o >>= 1) {{ const float t = __shfl_xor_sync(0xffffffffu, v, o); "
               f"v = {combine('v', 't')}; }}\n"
               f"    return v;\n}}")
    return name


def block_reduce(ctx: CudaContext, combine: Combine) -> str:
    """Add ``eg_block_<name>(v, scratch)`` for one-dimensional blocks of whole warps (every
    thread gets the block's result; ``scratch`` is 32 floats of shared memory, free again when
    it returns) and return its name. All threads must call it.

    Example:
        >>> block_reduce(ctx, MAX)       # doctest: +SKIP
        'eg_block_max'
    """
    warp = warp_reduce(ctx, combine)
    name = f"eg_block_{combine.name}"
    ctx.helper(f"""__device__ __forceinline__ float {name}(float v, float* scratch) {{
    v = {warp}(v);
    __syncthreads();
    if ((threadIdx.x & 31u) == 0u) scratch[threadIdx.x >> 5] = v;
    __syncthreads();
    v = (threadIdx.x & 31u) < (blockDim.x >> 5) ? scratch[threadIdx.x & 31u] : {combine.identity};
    return {warp}(v);
}}""")
    return name


# ---- the ops ------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Reduction:
    """One Reduce* op: its combine, the C of each value read (``{v}``), of the result
    (``{acc}``, ``{n}`` the reduced count) and the opset from which axes is an input."""

    combine: Combine
    load: str
    finish: str
    axes_input_since: int


REDUCTIONS = {
    "ReduceSum": Reduction(SUM, "{v}", "{acc}", 13),
    "ReduceMean": Reduction(SUM, "{v}", "{acc} / (float)({n})", 18),
    "ReduceMax": Reduction(MAX, "{v}", "{acc}", 18),
    "ReduceMin": Reduction(MIN, "{v}", "{acc}", 18),
    "ReduceProd": Reduction(PROD, "{v}", "{acc}", 18),
    "ReduceSumSquare": Reduction(SUM, "{v} * {v}", "{acc}", 18),
    "ReduceL1": Reduction(SUM, "fabsf({v})", "{acc}", 18),
    "ReduceL2": Reduction(SUM, "{v} * {v}", "sqrtf({acc})", 18),
    "ReduceLogSum": Reduction(SUM, "{v}", "logf({acc})", 18),
}


def reduction_axes(ctx: CudaContext, axes_input_since: int) -> tuple[int, ...] | None:
    """The node's sorted, normalized reduced axes; ``None`` for the identity
    (noop_with_empty_axes with no axes). Axes given as a non-constant input are refused.

    Example:
        >>> reduction_axes(ctx, 18)      # doctest: +SKIP
        (1, 2)
    """
    rank = len(ctx.in_shape(0))
    if ctx.opset >= axes_input_since:
        if ctx.has_input(1) and ctx.constant(1) is None:
            raise Unsupported("the reduced axes are not a constant")
        value = ctx.constant(1)
        axes = [] if value is None else [int(a) for a in np.asarray(value).ravel()]
        if not axes:
            return None if ctx.attr("noop_with_empty_axes", 0) else tuple(range(rank))
    else:
        axes = list(ctx.attr("axes", None) or [])
        if not axes:
            return tuple(range(rank))
    return tuple(sorted({a + rank if a < 0 else a for a in axes}))


def merged_groups(shape, axes) -> list[tuple[object, bool]]:
    """``(dim, reduced)`` runs of ``shape``: size-1 dims dropped, neighbours of the same kind merged.

    Example:
        >>> merged_groups((2, 1, 3, 4, 5), (1, 2, 3))
        [(2, False), (12, True), (5, False)]
    """
    groups: list[tuple[object, bool]] = []
    for i, d in enumerate(shape):
        if isinstance(d, int) and d == 1:
            continue
        reduced = i in axes
        if groups and groups[-1][1] == reduced:
            groups[-1] = (dim_product([groups[-1][0], d]), reduced)
        else:
            groups.append((d, reduced))
    return groups


def _is_int(d, limit: int | None = None) -> bool:
    return isinstance(d, int | np.integer) and (limit is None or int(d) <= limit)


def emit_reduction(ctx: CudaContext, op: str, axes: tuple[int, ...] | None, name: str = "eg_reduce") -> None:
    """Write the kernel of Reduce* ``op`` of input 0 over ``axes`` (``None``: the identity) into ``ctx``.

    Example:
        >>> emit_reduction(ctx, "ReduceMean", (2, 3))       # doctest: +SKIP
    """
    if ctx.in_dtype(0) != DType.FLOAT32:
        raise Unsupported(f"{op}: CUDA reductions take float32, not {ctx.in_dtype(0).short}")
    red = REDUCTIONS[op]
    if red.combine in (MAX, MIN):
        ctx.helper(NAN_MINMAX)
    shape = ctx.in_shape(0)
    groups = merged_groups(shape, axes if axes is not None else ())
    if axes is None:
        groups = [(dim_product(shape), False)]
        red = Reduction(red.combine, "{v}", "{acc}", red.axes_input_since)
    count = dim_product([shape[a] for a in axes]) if axes else 1
    reduced = [d for d, r in groups if r]
    out = dim_product([d for d, r in groups if not r])
    if len(reduced) > 1:
        return _emit_nested(ctx, red, groups, out, count, name)
    first = next((i for i, (_, r) in enumerate(groups) if r), len(groups))
    outer = dim_product([d for d, _ in groups[:first]])
    length = reduced[0] if reduced else 1
    inner = dim_product([d for d, _ in groups[first + 1:]]) if reduced else 1
    if _is_int(inner) and int(inner) == 1:
        if _is_int(length, THREAD_ROW):
            return _emit_thread(ctx, red, out, length, 1, count, name)
        few_rows = _is_int(outer) and int(outer) < FEW_ROWS
        if _is_int(length):
            by_warp = int(length) <= WARP_ROW and not (few_rows and int(length) > 256)
        else:
            by_warp = not few_rows
        if by_warp:
            return _emit_warp_rows(ctx, red, out, length, count, name)
        return _emit_block_rows(ctx, red, out, length, count, name)
    if _is_int(length, THREAD_COLUMN):
        return _emit_thread(ctx, red, out, length, inner, count, name)
    return _emit_column_tiles(ctx, red, out, length, inner, count, name)


def _load(red: Reduction, v: str) -> str:
    return red.load.format(v=v)


def _finish(ctx: CudaContext, red: Reduction, acc: str, count) -> str:
    return red.finish.format(acc=acc, n=ctx.dim(count))


def _emit_thread(ctx, red, out, length, inner, count, name) -> None:
    """One thread per output: a loop over its R values at stride inner."""
    x, y, n_out, n, s = ctx.x(0), ctx.y(0), ctx.dim(out), ctx.dim(length), ctx.dim(inner)
    where = "q * " + n if _is_int(inner) and int(inner) == 1 else f"(q / {s}) * {n} * {s} + q % {s}"
    body = f"""
    const long long q = (long long)blockIdx.x * {THREADS} + threadIdx.x;
    if (q < {n_out}) {{
        const float* src = {x} + {where};
        float acc = {red.combine.identity};
        for (long long r = 0; r < {n}; ++r) {{
            const float v = src[r * {s}];
            acc = {red.combine("acc", _load(red, "v"))};
        }}
        {y}[q] = {_finish(ctx, red, "acc", count)};
    }}"""
    ctx.function(name, body, grid=ctx.blocks_for(out, THREADS), block=THREADS)


def _emit_warp_rows(ctx, red, out, length, count, name) -> None:
    """One warp per output row (8 rows per block): lane-strided loads, then shuffles."""
    warp = warp_reduce(ctx, red.combine)
    x, y, n_out, n = ctx.x(0), ctx.y(0), ctx.dim(out), ctx.dim(length)
    rows = THREADS // 32
    body = f"""
    const long long q = (long long)blockIdx.x * {rows} + (threadIdx.x >> 5);
    const unsigned lane = threadIdx.x & 31u;
    float acc = {red.combine.identity};
    if (q < {n_out}) {{
        const float* src = {x} + q * {n};
        for (long long r = lane; r < {n}; r += 32) {{
            const float v = src[r];
            acc = {red.combine("acc", _load(red, "v"))};
        }}
    }}
    acc = {warp}(acc);
    if (q < {n_out} && lane == 0u) {y}[q] = {_finish(ctx, red, "acc", count)};"""
    ctx.function(name, body, grid=ctx.blocks_for(out, rows), block=THREADS)


def _emit_block_rows(ctx, red, out, length, count, name) -> None:
    """One block per output row: thread-strided loads, then a block reduction."""
    block = block_reduce(ctx, red.combine)
    x, y, n_out, n = ctx.x(0), ctx.y(0), ctx.dim(out), ctx.dim(length)
    body = f"""
    __shared__ float eg_scratch[32];
    const long long q = blockIdx.x;
    float acc = {red.combine.identity};
    if (q < {n_out}) {{
        const float* src = {x} + q * {n};
        for (long long r = threadIdx.x; r < {n}; r += {THREADS}) {{
            const float v = src[r];
            acc = {red.combine("acc", _load(red, "v"))};
        }}
    }}
    acc = {block}(acc, eg_scratch);
    if (q < {n_out} && threadIdx.x == 0) {y}[q] = {_finish(ctx, red, "acc", count)};"""
    ctx.function(name, body, grid=ctx.blocks_for(out, 1), block=THREADS)


def _emit_column_tiles(ctx, red, out, length, inner, count, name) -> None:
    """32 x 8 threads per 32 outputs: lanes over neighbouring columns, rows of threads split R."""
    x, y, n_out, n, s = ctx.x(0), ctx.y(0), ctx.dim(out), ctx.dim(length), ctx.dim(inner)
    body = f"""
    __shared__ float eg_tile[{TILE_ROWS}][33];
    const long long q = (long long)blockIdx.x * 32 + threadIdx.x;
    float acc = {red.combine.identity};
    if (q < {n_out}) {{
        const long long o = q / {s};
        const float* src = {x} + o * {n} * {s} + (q - o * {s});
        for (long long r = threadIdx.y; r < {n}; r += {TILE_ROWS}) {{
            const float v = src[r * {s}];
            acc = {red.combine("acc", _load(red, "v"))};
        }}
    }}
    eg_tile[threadIdx.y][threadIdx.x] = acc;
    __syncthreads();
    if (threadIdx.y == 0) {{
        for (int k = 1; k < {TILE_ROWS}; ++k) acc = {red.combine("acc", "eg_tile[k][threadIdx.x]")};
        if (q < {n_out}) {y}[q] = {_finish(ctx, red, "acc", count)};
    }}"""
    ctx.function(name, body, grid=ctx.blocks_for(out, 32), block=(32, TILE_ROWS))


def _emit_nested(ctx, red, groups, out, count, name) -> None:
    """One thread per output; its kept coordinates give the base, one loop per reduced group."""
    x, y, n_out = ctx.x(0), ctx.y(0), ctx.dim(out)
    strides = [dim_product([d for d, _ in groups[i + 1:]]) for i in range(len(groups))]
    decode, loops, offset = [], [], []
    for (d, reduced), stride in reversed(list(zip(groups, strides))):
        if not reduced:
            decode.append(f"base += (rest % {ctx.dim(d)}) * {ctx.dim(stride)}; rest /= {ctx.dim(d)};")
    for k, ((d, reduced), stride) in enumerate(zip(groups, strides)):
        if reduced:
            loops.append(f"for (long long r{k} = 0; r{k} < {ctx.dim(d)}; ++r{k})")
            offset.append(f"r{k} * {ctx.dim(stride)}")
    loop_head = "\n        ".join(loops)
    body = f"""
    const long long q = (long long)blockIdx.x * {THREADS} + threadIdx.x;
    if (q < {n_out}) {{
        long long rest = q, base = 0;
        {" ".join(decode)}
        float acc = {red.combine.identity};
        {loop_head} {{
            const float v = {x}[base + {" + ".join(offset)}];
            acc = {red.combine("acc", _load(red, "v"))};
        }}
        {y}[q] = {_finish(ctx, red, "acc", count)};
    }}"""
    ctx.function(name, body, grid=ctx.blocks_for(out, THREADS), block=THREADS)


@register_kernel(*REDUCTIONS)
def reduce_kernel(ctx: CudaContext) -> None:
    """Reduce* over constant axes (attribute, or input 1 from opset 13/18).

    Example:
        >>> kernel = generate(node, graph, 18)       # doctest: +SKIP
    """
    axes = reduction_axes(ctx, REDUCTIONS[ctx.node.op].axes_input_since)
    emit_reduction(ctx, ctx.node.op, axes, name=f"eg_{ctx.node.op.lower()}")


# ---- ArgMax, ArgMin -----------------------------------------------------------------------------
def _arg_helpers(ctx: CudaContext, greater: bool, last: bool) -> str:
    """Add ``eg_arg_better(a, ia, b, ib)``: whether value ``a`` at index ``ia`` beats ``b`` at
    ``ib`` (a NaN beats numbers, as in numpy; ties go to the first index, or the last with
    select_last_index; index -1 is no value) and the warp reduction over (value, index) pairs."""
    cmp, tie = (">" if greater else "<"), ("ia > ib" if last else "ia < ib")
    ctx.helper(f"""__device__ __forceinline__ bool eg_arg_better(float a, long long ia, float b, long long ib) {{
    if (ib < 0) return true;
    if (ia < 0) return false;
    const bool an = a != a, bn = b != b;
    if (an || bn) return an && (!bn || {tie});
    return a {cmp} b || (a == b && {tie});
}}""")
    return "eg_arg_better"


@register_kernel("ArgMax", "ArgMin")
def arg_kernel(ctx: CudaContext) -> None:
    """ArgMax/ArgMin along one axis (keepdims either way; select_last_index): one warp per
    row for contiguous rows longer than 32 or of symbolic length, else one thread per output.

    Example:
        >>> kernel = generate(node, graph, 13)       # doctest: +SKIP
    """
    if ctx.in_dtype(0) != DType.FLOAT32:
        raise Unsupported(f"{ctx.node.op}: CUDA kernels take float32, not {ctx.in_dtype(0).short}")
    shape = ctx.in_shape(0)
    axis = int(ctx.attr("axis", 0))
    axis = axis + len(shape) if axis < 0 else axis
    last = bool(ctx.attr("select_last_index", 0)) and ctx.opset >= 12
    better = _arg_helpers(ctx, ctx.node.op == "ArgMax", last)
    outer, length, inner = dim_product(shape[:axis]), shape[axis], dim_product(shape[axis + 1:])
    out = dim_product([outer, inner])
    x, y, n_out, n, s = ctx.x(0), ctx.y(0), ctx.dim(out), ctx.dim(length), ctx.dim(inner)
    contiguous = _is_int(inner) and int(inner) == 1
    if contiguous and not _is_int(length, THREAD_COLUMN):
        rows = THREADS // 32
        body = f"""
    const long long q = (long long)blockIdx.x * {rows} + (threadIdx.x >> 5);
    const unsigned lane = threadIdx.x & 31u;
    float best = 0.0f;
    long long at = -1;
    if (q < {n_out}) {{
        const float* src = {x} + q * {n};
        for (long long r = lane; r < {n}; r += 32) {{
            const float v = src[r];
            if ({better}(v, r, best, at)) {{ best = v; at = r; }}
        }}
    }}
    for (int o = 16; o > 0; o >>= 1) {{
        const float b = __shfl_xor_sync(0xffffffffu, best, o);
        const long long ib = __shfl_xor_sync(0xffffffffu, at, o);
        if ({better}(b, ib, best, at)) {{ best = b; at = ib; }}
    }}
    if (q < {n_out} && lane == 0u) {y}[q] = at < 0 ? 0 : at;"""
        ctx.function(f"eg_{ctx.node.op.lower()}", body, grid=ctx.blocks_for(out, rows), block=THREADS)
        return
    where = "q * " + n if contiguous else f"(q / {s}) * {n} * {s} + q % {s}"
    body = f"""
    const long long q = (long long)blockIdx.x * {THREADS} + threadIdx.x;
    if (q < {n_out}) {{
        const float* src = {x} + {where};
        float best = 0.0f;
        long long at = -1;
        for (long long r = 0; r < {n}; ++r) {{
            const float v = src[r * {s}];
            if ({better}(v, r, best, at)) {{ best = v; at = r; }}
        }}
        {y}[q] = at < 0 ? 0 : at;
    }}"""
    ctx.function(f"eg_{ctx.node.op.lower()}", body, grid=ctx.blocks_for(out, THREADS), block=THREADS)


__all__ = ["Combine", "SUM", "MAX", "MIN", "PROD", "REDUCTIONS", "Reduction", "block_reduce", "warp_reduce",
           "emit_reduction", "merged_groups", "reduction_axes"]

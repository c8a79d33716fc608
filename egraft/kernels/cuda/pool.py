"""CUDA kernels of pooling: MaxPool and AveragePool (1-3 spatial dims: kernel_shape, strides,
pads or auto_pad, dilations, ceil_mode, count_include_pad), GlobalAveragePool and GlobalMaxPool.

Windowed pools run one thread per output element, 256 per block: neighbouring threads
compute neighbouring outputs of a row, so their window reads are stride-apart and served
by L1. The window is a loop per spatial axis with constant trip counts (unrolled), skipping
taps outside the input; AveragePool counts per axis the taps inside the input (or inside
input + pads with count_include_pad; ceil_mode's overhang never counts) and sums in the
reference's order (the first spatial axis innermost), so results match numpy bit for bit
on most inputs. Begin pads of auto_pad SAME_* are computed at run time for symbolic dims.

Global pools are ReduceMean/ReduceMax over the spatial dims (:mod:`.reduce`): a warp per
(n, c) plane for planes up to 1024 values, a block per plane beyond.

Example:
    >>> kernel = generate(node, graph, 17)       # doctest: +SKIP
    >>> kernel.launches[0].block                 # doctest: +SKIP
    (256, 1, 1)
"""

from __future__ import annotations

import numpy as np

from egraft.ir.dims import dim_product
from egraft.ir.dtypes import DType
from egraft.kernels.cuda import register_kernel
from egraft.kernels.cuda.emit import CudaContext, Unsupported
from egraft.kernels.cuda.reduce import NAN_MINMAX, emit_reduction

#: Threads per block of the windowed pools.
THREADS = 256


def _is_int(d) -> bool:
    return isinstance(d, int | np.integer)


def begin_pads(ctx: CudaContext, in_dims, out_dims, kernel, strides, dilations) -> tuple[list[str], list[str]]:
    """C expressions of each spatial axis' begin and end pads (explicit, VALID, or SAME_*
    from the input and output lengths, at run time when they are symbolic).

    Example:
        >>> begin_pads(ctx, [7, 7], [4, 4], [3, 3], [2, 2], [1, 1])      # doctest: +SKIP
        (['1LL', '1LL'], ['1LL', '1LL'])
    """
    rank = len(kernel)
    auto_pad = ctx.attr("auto_pad", "NOTSET") or "NOTSET"
    if auto_pad not in ("SAME_UPPER", "SAME_LOWER"):
        pads = [0] * (2 * rank) if auto_pad == "VALID" else list(ctx.attr("pads", None) or [0] * (2 * rank))
        return [f"{int(p)}LL" for p in pads[:rank]], [f"{int(p)}LL" for p in pads[rank:]]
    begins, ends = [], []
    for i in range(rank):
        extent = (kernel[i] - 1) * dilations[i] + 1
        total = f"eg_max(0LL, ({ctx.dim(out_dims[i])} - 1) * {strides[i]} + {extent} - {ctx.dim(in_dims[i])})"
        half = f"({total} / 2)"
        begin = half if auto_pad == "SAME_UPPER" else f"({total} - {half})"
        begins.append(begin)
        ends.append(f"({total} - {begin})")
    return begins, ends


@register_kernel("MaxPool", "AveragePool")
def pool_kernel(ctx: CudaContext) -> None:
    """MaxPool (the Indices output refused) and AveragePool over 1 to 3 spatial dims.

    Example:
        >>> kernel = generate(node, graph, 17)       # doctest: +SKIP
    """
    if ctx.in_dtype(0) != DType.FLOAT32:
        raise Unsupported(f"{ctx.node.op}: CUDA kernels take float32, not {ctx.in_dtype(0).short}")
    if any(v is not None for v in ctx.node.outputs[1:]):
        raise Unsupported("MaxPool: the Indices output has no CUDA kernel")
    kernel = [int(k) for k in ctx.attr("kernel_shape", None) or []]
    shape, out_shape = ctx.in_shape(0), ctx.out_shape(0)
    rank = len(kernel)
    if not 1 <= rank <= 3 or len(shape) != rank + 2:
        raise Unsupported(f"{ctx.node.op}: {rank}-D windows on a rank-{len(shape)} input")
    strides = [int(s) for s in ctx.attr("strides", None) or [1] * rank]
    dilations = [int(d) for d in ctx.attr("dilations", None) or [1] * rank]
    in_dims, out_dims = shape[2:], out_shape[2:]
    begins, ends = begin_pads(ctx, in_dims, out_dims, kernel, strides, dilations)
    x, y = ctx.x(0), ctx.y(0)
    n = [ctx.dim(d) for d in in_dims]
    decode = []
    for i in reversed(range(rank)):
        o = ctx.dim(out_dims[i])
        decode.append(f"const long long o{i} = rest % {o}; rest /= {o};")
        decode.append(f"const long long b{i} = o{i} * {strides[i]} - {begins[i]};")
    tap = " + ".join(" * ".join([f"p{i}", *n[i + 1:]]) for i in range(rank))
    if ctx.node.op == "AveragePool":
        window = _average_window(rank, kernel, dilations, begins, ends, n, bool(ctx.attr("count_include_pad", 0)), tap)
        window += f"\n        {y}[q] = s{rank - 1} / (float)({' * '.join(f'cnt{i}' for i in range(rank))});"
    else:
        ctx.helper(NAN_MINMAX)
        window = _max_window(rank, kernel, dilations, n, tap) + f"\n        {y}[q] = acc;"
    plane = dim_product(in_dims)
    total = dim_product(out_shape)
    body = f"""
    const long long q = (long long)blockIdx.x * {THREADS} + threadIdx.x;
    if (q < {ctx.dim(total)}) {{
        long long rest = q;
        {" ".join(decode)}
        const float* xp = {x} + rest * {ctx.dim(plane)};
        {window}
    }}"""
    ctx.function(f"eg_{ctx.node.op.lower()}", body, grid=ctx.blocks_for(total, THREADS), block=THREADS)


def _tap_loop(i: int, kernel, dilations) -> str:
    return f"for (int k{i} = 0; k{i} < {kernel[i]}; ++k{i}) {{ const long long p{i} = b{i} + k{i} * {dilations[i]}; "


def _max_window(rank, kernel, dilations, n, tap) -> str:
    """MaxPool's window: taps outside the input skipped; a NaN wins, as in numpy."""
    loops = "".join(_tap_loop(i, kernel, dilations) + f"if (p{i} < 0 || p{i} >= {n[i]}) continue; "
                    for i in range(rank))
    return f"float acc = -EG_INF;\n        {loops}acc = eg_nanmax(acc, xp[{tap}]);{' }' * rank}"


def _average_window(rank, kernel, dilations, begins, ends, n, include_pad, tap) -> str:
    """AveragePool's window: per-axis counts ``cnt<i>`` of the taps that count, and nested
    sums ``s<i>``, the first spatial axis innermost (the reference reduces one axis at a
    time, the first one first, so each level's partial sum is added to the next)."""
    lines = []
    for i in range(rank):
        inside = f"p{i} >= 0 && p{i} < {n[i]}"
        counted = f"p{i} >= -{begins[i]} && p{i} < {n[i]} + {ends[i]}" if include_pad else inside
        lines.append(f"long long cnt{i} = 0;\n        {_tap_loop(i, kernel, dilations)}cnt{i} += ({counted}); }}")

    def level(i: int) -> str:
        inside = f"p{i} >= 0 && p{i} < {n[i]}"
        if i == 0:
            return f"float s0 = 0.0f; {_tap_loop(0, kernel, dilations)}if ({inside}) s0 += xp[{tap}]; }}"
        inner = f"{{ {level(i - 1)} s{i} += s{i - 1}; }}"
        return f"float s{i} = 0.0f; {_tap_loop(i, kernel, dilations)}if ({inside}) {inner} }}"

    lines.append(level(rank - 1))
    return "\n        ".join(lines)


@register_kernel("GlobalAveragePool", "GlobalMaxPool")
def global_pool_kernel(ctx: CudaContext) -> None:
    """GlobalAveragePool/GlobalMaxPool: ReduceMean/ReduceMax over the dims from 2 on.

    Example:
        >>> kernel = generate(node, graph, 17)       # doctest: +SKIP
    """
    axes = tuple(range(2, len(ctx.in_shape(0))))
    op = "ReduceMean" if ctx.node.op == "GlobalAveragePool" else "ReduceMax"
    emit_reduction(ctx, op, axes if axes else None, name=f"eg_{ctx.node.op.lower()}")


__all__ = ["pool_kernel", "global_pool_kernel", "begin_pads"]

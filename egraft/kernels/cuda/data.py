"""CUDA kernels of data movement: copies (Identity, Reshape and friends when they are not
views), Expand, Slice, Pad, Tile, Transpose, Gather, Concat, Split, and the small shape
ops (Shape, Size, ConstantOfShape, Range).

Most of them are one *mapped copy* (:func:`emit_mapped_copy`): a grid-stride loop of
256-thread blocks over the output, one element per iteration, reading the input at an
offset built per output axis: ``start + c * stride`` (Slice, Expand, Transpose), ``c %
dim`` (Tile) or a padded coordinate that may fall outside (Pad). Adjacent affine axes that
are contiguous in the input collapse into one before any code is written, so a Slice on
one axis divides by two dims however high the rank; a copy that collapses to one
contiguous axis becomes the vectorised elementwise copy of :mod:`.elementwise`.

Transposes that move the input's innermost axis use a tiled kernel: 32x8 threads move a
32x32 tile through shared memory (``[32][33]``, no bank conflicts), reading rows of the
input and writing rows of the output, both coalesced; the other axes are the block's
batch coordinates. Concat and Split are one launch each whatever the number of pieces: per
element, a chain of comparisons of the position within an output (input) row picks the
piece. Gather reads its index once per element and wraps negative ones.

Example:
    >>> kernel = generate(graph.nodes[0], graph, 17)     # doctest: +SKIP
    >>> [launch.function for launch in kernel.launches]  # doctest: +SKIP
    ['eg_transpose']
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

import numpy as np
import sympy

from egraft.ir.dtypes import DType
from egraft.ir.ops.shape import onnx_slice
from egraft.kernels.cuda import register_kernel
from egraft.kernels.cuda.elementwise import (
    Operand,
    c_dim,
    c_literal,
    decompose,
    dims_product,
    emit_broadcast,
    grid_stride,
    indent,
    index_variants,
    same_dim,
    static_int,
)
from egraft.kernels.cuda.emit import CudaContext, Unsupported

#: Side of a transpose tile, and the rows of threads that move it (TILE x TILE_ROWS threads).
TILE = 32
TILE_ROWS = 8
#: Transposes whose tiled axes are both static and shorter than this use the mapped copy.
MIN_TILED = 16


def _normalize_axis(axis: int, rank: int) -> int:
    if not -rank <= axis < max(rank, 1):
        raise Unsupported(f"axis {axis} for rank {rank}")
    return axis + rank if axis < 0 else axis


def _strides(shape: Sequence) -> list:
    """Row-major strides of ``shape`` (ints or sympy expressions)."""
    out = []
    for k in range(len(shape)):
        out.append(dims_product(shape[k + 1:]))
    return out


def _ints(ctx: CudaContext, slot: int, what: str) -> list[int] | None:
    """The ints of constant input ``slot``; ``None`` when the input is absent;
    ``Unsupported`` when it is not a constant."""
    if not ctx.has_input(slot):
        return None
    value = ctx.constant(slot)
    if value is None:
        raise Unsupported(f"{ctx.node.op} with non-constant {what}")
    return [int(v) for v in np.asarray(value).ravel()]


# ---- the mapped copy -------------------------------------------------------------------------------
@dataclass(frozen=True)
class AxisMap:
    """How one output axis of ``dim`` elements reads the input: at ``c * stride`` (affine),
    ``(c % in_dim) * stride`` (tile) or at a padded coordinate ``c - begin`` of an axis of
    ``in_dim`` elements that starts ``crop`` elements in (pad, with ``mode`` constant,
    reflect, edge or wrap)."""

    dim: object
    stride: object
    kind: str = "affine"
    in_dim: object = None
    begin: object = 0
    crop: object = 0
    mode: str = "constant"


def collapse(axes: Sequence[AxisMap]) -> list[AxisMap]:
    """``axes`` without static size-1 affine axes, adjacent affine axes merged where the
    input is contiguous across them.

    Example:
        >>> [(a.dim, a.stride) for a in collapse([AxisMap(2, 12), AxisMap(3, 4), AxisMap(4, 1)])]
        [(24, 1)]
        >>> [(a.dim, a.stride) for a in collapse([AxisMap(4, 1), AxisMap(1, 7), AxisMap(3, 4)])]
        [(4, 1), (3, 4)]
    """
    out: list[AxisMap] = []
    for a in axes:
        if a.kind == "affine" and static_int(a.dim) == 1:
            continue
        last = out[-1] if out else None
        contiguous = last is not None and same_dim(last.stride, dims_product([a.dim, a.stride]))
        if contiguous and last.kind == a.kind == "affine":
            out[-1] = replace(a, dim=dims_product([last.dim, a.dim]))
        else:
            out.append(a)
    return out


def emit_mapped_copy(ctx: CudaContext, name: str, axes: Sequence[AxisMap], base=0, fill: str | None = None,
                     slot: int = 0) -> None:
    """Write ``name``: ``y[i] = x[base + sum(axis offsets)]`` over the output whose axes are
    ``axes`` (row-major); ``fill`` is the value of a constant-mode pad outside the input.

    Example:
        >>> emit_mapped_copy(ctx, "eg_slice", [AxisMap(4, 8), AxisMap(3, 1)], base=2)   # doctest: +SKIP
    """
    axes = collapse(axes)
    out_shape = ctx.out_shape(0)
    if all(a.kind == "affine" for a in axes) and (not axes or (len(axes) == 1 and static_int(axes[0].stride) == 1)):
        pointer = ctx.x(slot) if static_int(base) == 0 else f"({ctx.x(slot)} + {ctx.dim(base)})"
        emit_broadcast(ctx, name, [Operand(slot, tuple(out_shape), pointer)], "a0")
        return
    x, y = ctx.x(slot), ctx.y(0)

    def body(itype: str) -> list[str]:
        lines = decompose(ctx, [a.dim for a in axes], itype)
        terms = [] if static_int(base) == 0 else [c_dim(ctx, base, itype)]
        inside = []
        for k, a in enumerate(axes):
            stride = "" if static_int(a.stride) == 1 else f" * {c_dim(ctx, a.stride, itype)}"
            if a.kind == "affine":
                if static_int(a.stride) != 0:
                    terms.append(f"c{k}{stride}")
                continue
            lines.extend(_unmapped(ctx, k, a, itype, inside))
            terms.append(f"j{k}{stride}")
        read = f"{x}[{' + '.join(terms) or '0'}]"
        if inside:
            read = f"({' && '.join(inside)}) ? {read} : {fill}"
        return [*lines, f"{y}[i] = {read};"]

    grid_stride(ctx, name, dims_product(out_shape), [dims_product(ctx.in_shape(slot))], body)


def _unmapped(ctx: CudaContext, k: int, a: AxisMap, itype: str, inside: list[str]) -> list[str]:
    """The lines that compute ``j<k>``, the input coordinate of a tile or pad axis (a
    constant pad's bounds test goes to ``inside``)."""
    d = c_dim(ctx, a.in_dim, itype)
    if a.kind == "tile":
        return [f"const {itype} j{k} = c{k} % {d};"]
    lines = [f"{itype} j{k} = c{k}" + ("" if static_int(a.begin) == 0 else f" - {c_dim(ctx, a.begin, itype)}") + ";"]
    if a.mode == "constant":
        inside.append(f"j{k} >= 0 && j{k} < {d}")
    elif a.mode == "edge":
        lines.append(f"j{k} = j{k} < 0 ? 0 : (j{k} >= {d} ? {d} - 1 : j{k});")
    elif a.mode == "reflect":
        lines.append(f"j{k} = j{k} < 0 ? -j{k} : j{k};")
        lines.append(f"j{k} = j{k} >= {d} ? 2 * ({d} - 1) - j{k} : j{k};")
    elif a.mode == "wrap":
        lines.append(f"j{k} = ({itype})eg_mod(j{k}, {d});")
    else:
        raise Unsupported(f"Pad mode {a.mode!r}")
    if static_int(a.crop) != 0:
        lines.append(f"j{k} += {c_dim(ctx, a.crop, itype)};")
    return lines


# ---- copies and Expand -------------------------------------------------------------------------------
@register_kernel("Identity", "Reshape", "Flatten", "Squeeze", "Unsqueeze")
def copy(ctx: CudaContext) -> None:
    """The input's elements, in order, into the output (when lowering could not make a view)."""
    emit_broadcast(ctx, f"eg_{ctx.node.op.lower()}", [Operand(0, tuple(ctx.out_shape(0)))], "a0")


@register_kernel("Expand")
def expand(ctx: CudaContext) -> None:
    """The input broadcast to the output's (inferred) shape; when the shape is not a
    constant, the output's dims may be fresh symbols, equal to the input's where that is
    not 1."""
    emit_broadcast(ctx, "eg_expand", [0], "a0", assume_equal=ctx.constant(1) is None)


# ---- Slice, Pad, Tile -------------------------------------------------------------------------------
def _slice_start(start: int, step: int, d):
    """Where ONNX's ``start`` lands on an axis of ``d`` elements (clamped as ONNX says)."""
    s = static_int(d)
    if s is not None:
        return onnx_slice(start, 0, step, s).start if s > 0 else 0
    d = sympy.sympify(d)
    if step > 0:
        return sympy.Max(start + d, 0) if start < 0 else sympy.Min(start, d)
    return sympy.Max(start + d, 0) if start < 0 else sympy.Min(start, d - 1)


@register_kernel("Slice")
def slice_(ctx: CudaContext) -> None:
    """``x[starts:ends:steps]`` on constant starts, axes and steps (any sign). The ends may be
    computed: the output's (inferred) dims already say how many elements each axis keeps
    (lowering refuses the Slices whose lengths only the values can tell)."""
    shape = ctx.in_shape(0)
    if ctx.opset < 10:
        starts = list(ctx.attr("starts"))
        axes, steps = ctx.attr("axes", None), None
    else:
        starts = _ints(ctx, 1, "starts")
        axes, steps = _ints(ctx, 3, "axes"), _ints(ctx, 4, "steps")
    axes = list(range(len(starts))) if axes is None else [_normalize_axis(a, len(shape)) for a in axes]
    steps = [1] * len(starts) if steps is None else steps
    strides = _strides(shape)
    starts_at = [0] * len(shape)
    step_of = [1] * len(shape)
    for a, s, st in zip(axes, starts, steps):
        if st == 0:
            raise Unsupported("Slice with a zero step")
        starts_at[a], step_of[a] = _slice_start(int(s), int(st), shape[a]), int(st)
    base = dims_product([0]) + sum(sympy.sympify(s) * sympy.sympify(t) for s, t in zip(starts_at, strides))
    maps = [AxisMap(d, dims_product([st, t])) for d, st, t in zip(ctx.out_shape(0), step_of, strides)]
    emit_mapped_copy(ctx, "eg_slice", maps, _simplified(base))


def _simplified(e):
    e = sympy.expand(sympy.sympify(e))
    return int(e) if e.is_Integer else e


@register_kernel("Pad")
def pad(ctx: CudaContext) -> None:
    """Constant, edge, reflect or wrap padding (negative pads crop) with constant pads."""
    shape = ctx.in_shape(0)
    rank = len(shape)
    dtype = ctx.in_dtype(0)
    mode = ctx.attr("mode", "constant")
    if isinstance(mode, bytes):
        mode = mode.decode()
    if ctx.opset < 11:
        pads = list(ctx.attr("paddings" if ctx.opset < 2 else "pads"))
        fill = c_literal(ctx.attr("value", 0.0), dtype)
        axes = list(range(rank))
    else:
        pads = _ints(ctx, 1, "pads")
        fill = c_literal(0, dtype)
        if ctx.has_input(2):
            value = ctx.constant(2)
            if value is None:
                fill = f"{ctx.x(2)}[0]"
            elif value.size:
                fill = c_literal(value.ravel()[0], dtype)
        axes = list(range(rank)) if not ctx.has_input(3) else [_normalize_axis(a, rank) for a in _ints(ctx, 3, "axes")]
    begins, ends = [0] * rank, [0] * rank
    for i, a in enumerate(axes):
        begins[a], ends[a] = int(pads[i]), int(pads[len(axes) + i])
    maps = []
    for d, o, t, b, e in zip(shape, ctx.out_shape(0), _strides(shape), begins, ends):
        if b == 0 and e == 0:
            maps.append(AxisMap(d, t))
            continue
        kept = _simplified(sympy.sympify(d) - max(0, -b) - max(0, -e))
        if mode == "reflect" and static_int(kept) is not None and max(b, e) >= static_int(kept):
            raise Unsupported(f"reflect pads {b}, {e} of an axis of {kept}")
        maps.append(AxisMap(o, t, "pad", kept, max(0, b), max(0, -b), mode))
    emit_mapped_copy(ctx, "eg_pad", maps, fill=fill)


@register_kernel("Tile")
def tile(ctx: CudaContext) -> None:
    """The input repeated along each axis: the coordinate modulo the input's dim."""
    shape = ctx.in_shape(0)
    repeats = ctx.constant(1)
    repeats = None if repeats is None else [int(r) for r in np.asarray(repeats).ravel()]
    maps = []
    for k, (d, o, t) in enumerate(zip(shape, ctx.out_shape(0), _strides(shape))):
        if static_int(d) == 1:
            maps.append(AxisMap(o, 0))
        elif repeats is not None and repeats[k] == 1:
            maps.append(AxisMap(d, t))
        else:
            maps.append(AxisMap(o, t, "tile", d))
    emit_mapped_copy(ctx, "eg_tile", maps)


# ---- Transpose -------------------------------------------------------------------------------------
def reduce_permutation(shape: Sequence, perm: Sequence[int]) -> tuple[list, list[int]]:
    """``shape`` and ``perm`` without static size-1 axes and with the input axes that stay
    adjacent (and in order) merged.

    Example:
        >>> reduce_permutation([2, 3, 4, 5], [0, 3, 1, 2])
        ([2, 12, 5], [0, 2, 1])
        >>> reduce_permutation([1, 8, 1, 6], [3, 1, 2, 0])
        ([8, 6], [1, 0])
    """
    kept = [a for a in range(len(shape)) if static_int(shape[a]) != 1]
    perm = [a for a in perm if a in kept]
    groups: list[list[int]] = []
    for a in perm:
        if groups and kept.index(a) == kept.index(groups[-1][-1]) + 1:
            groups[-1].append(a)
        else:
            groups.append([a])
    order = sorted(range(len(groups)), key=lambda g: groups[g][0])
    dims = [dims_product([shape[a] for a in groups[g]]) for g in order]
    rank_of = {g: r for r, g in enumerate(order)}
    return dims, [rank_of[g] for g in range(len(groups))]


@register_kernel("Transpose")
def transpose(ctx: CudaContext) -> None:
    """Axes permuted: a tiled kernel when the innermost axis moves, a mapped copy otherwise."""
    shape = ctx.in_shape(0)
    perm = ctx.attr("perm", None)
    perm = list(range(len(shape)))[::-1] if perm is None else [_normalize_axis(p, len(shape)) for p in perm]
    dims, perm = reduce_permutation(shape, perm)
    strides = _strides(dims)
    r = len(dims)
    if r >= 2 and perm[-1] != r - 1:
        inner, moved = dims[r - 1], dims[perm[-1]]
        small = [static_int(d) is not None and static_int(d) < MIN_TILED for d in (inner, moved)]
        if not any(small):
            _tiled_transpose(ctx, dims, perm)
            return
    emit_mapped_copy(ctx, "eg_transpose", [AxisMap(dims[p], strides[p]) for p in perm])


def _tiled_transpose(ctx: CudaContext, dims: list, perm: list[int]) -> None:
    """One block per 32x32 tile of (the output's innermost axis ``p``, the input's ``a``)
    and per coordinate of the other axes."""
    r = len(dims)
    a, p = r - 1, perm[-1]
    in_strides = _strides(dims)
    out_strides = _strides([dims[q] for q in perm])
    out_stride_of = {perm[q]: out_strides[q] for q in range(r)}
    batch = [b for b in perm if b not in (a, p)]
    tiles_a, tiles_p = _ceil(dims[a], TILE), _ceil(dims[p], TILE)
    x, y = ctx.x(0), ctx.y(0)

    def tile(itype: str) -> list[str]:
        def c(d) -> str:
            return c_dim(ctx, d, itype)

        lines = [f"{itype} b_ = blockIdx.x;"]
        for name, tiles in (("a0", tiles_a), ("p0", tiles_p)):
            lines.append(f"const {itype} {name} = 0;" if static_int(tiles) == 1 else
                         f"const {itype} {name} = (b_ % {c(tiles)}) * {TILE}; b_ /= {c(tiles)};")
        in_base, out_base = [], []
        for k in range(len(batch) - 1, -1, -1):
            b = batch[k]
            lines.append(f"const {itype} e{k} = b_ % {c(dims[b])}; b_ /= {c(dims[b])};" if k
                         else f"const {itype} e{k} = b_;")
            in_base.append(f"e{k} * {c(in_strides[b])}")
            out_base.append(f"e{k} * {c(out_stride_of[b])}")
        tx, ty = f"({itype})threadIdx.x", f"({itype})threadIdx.y"
        return lines + [
            f"const {itype} in_base = {' + '.join(in_base) or '0'};",
            f"const {itype} out_base = {' + '.join(out_base) or '0'};",
            f"for ({itype} k = {ty}; k < {TILE}; k += {TILE_ROWS}) {{",
            f"    if (p0 + k < {c(dims[p])} && a0 + {tx} < {c(dims[a])})",
            f"        tile[k][threadIdx.x] = {x}[in_base + (p0 + k) * {c(in_strides[p])} + a0 + {tx}];",
            "}",
            "__syncthreads();",
            f"for ({itype} k = {ty}; k < {TILE}; k += {TILE_ROWS}) {{",
            f"    if (a0 + k < {c(dims[a])} && p0 + {tx} < {c(dims[p])})",
            f"        {y}[out_base + (a0 + k) * {c(out_stride_of[a])} + p0 + {tx}] = tile[threadIdx.x][k];",
            "}"]

    lines = [f"__shared__ {ctx.ctype(ctx.in_dtype(0))} tile[{TILE}][{TILE + 1}];",
             *index_variants(ctx, [dims_product(dims)], tile)]
    blocks = dims_product([tiles_a, tiles_p, *(dims[b] for b in batch)])
    ctx.function("eg_transpose", indent(lines), grid=blocks, block=(TILE, TILE_ROWS))


def _ceil(d, k: int):
    s = static_int(d)
    return -(-s // k) if s is not None else sympy.ceiling(sympy.sympify(d) / k)


# ---- Gather, Concat, Split -----------------------------------------------------------------------------
@register_kernel("Gather")
def gather(ctx: CudaContext) -> None:
    """``y[o, j, k] = x[o, idx[j] (wrapped when negative), k]`` over the collapsed
    (before, indices, after) axes; a constant one-element index is a Slice."""
    shape = ctx.in_shape(0)
    axis = _normalize_axis(ctx.attr("axis", 0), len(shape))
    if ctx.in_dtype(1) not in (DType.INT64, DType.INT32):
        raise Unsupported(f"Gather indices of {ctx.in_dtype(1).short}")
    outer, along, inner = dims_product(shape[:axis]), shape[axis], dims_product(shape[axis + 1:])
    constant = ctx.constant(1)
    if constant is not None and constant.size == 1:
        j = int(constant.ravel()[0])
        start = j + along if j < 0 else j
        emit_mapped_copy(ctx, "eg_gather", [AxisMap(outer, dims_product([along, inner])), AxisMap(inner, 1)],
                         dims_product([start, inner]))
        return
    count = dims_product(ctx.in_shape(1))
    x, indices, y = ctx.x(0), ctx.x(1), ctx.y(0)

    def body(itype: str) -> list[str]:
        a = c_dim(ctx, along, itype)
        return [*decompose(ctx, [outer, count, inner], itype),
                f"{itype} j = ({itype}){indices}[c1];",
                f"j = j < 0 ? j + {a} : j;",
                f"{y}[i] = {x}[(c0 * {a} + j) * {c_dim(ctx, inner, itype)} + c2];"]

    grid_stride(ctx, "eg_gather", dims_product(ctx.out_shape(0)), [dims_product(shape)], body)


def _pieces_chain(sizes: Sequence, itype: str, ctx: CudaContext, action) -> list[str]:
    """``if (r < e1) action(0, offset 0) else if (r < e2) action(1, e1) ...``: which piece of
    ``sizes`` (each a row length) the row position ``r`` falls in."""
    lines, end = [], sympy.Integer(0)
    pieces = [(k, s) for k, s in enumerate(sizes) if static_int(s) != 0]
    for n, (k, size) in enumerate(pieces):
        start = _simplified(end)
        end = end + sympy.sympify(size)
        test = "" if n == len(pieces) - 1 else f"if (r < {c_dim(ctx, _simplified(end), itype)}) "
        lines.append(("" if n == 0 else "else ") + test + action(k, start))
    return lines


@register_kernel("Concat")
def concat(ctx: CudaContext) -> None:
    """All inputs in one launch: output row ``o`` (the axes before ``axis``) is the inputs'
    rows side by side."""
    slots = [i for i in range(len(ctx.node.inputs)) if ctx.has_input(i)]
    out = ctx.out_shape(0)
    axis = _normalize_axis(ctx.attr("axis"), len(out))
    after = dims_product(out[axis + 1:])
    outer = dims_product(out[:axis])
    rows = [dims_product([ctx.in_shape(s)[axis], after]) for s in slots]
    row = dims_product(out[axis:])
    y = ctx.y(0)
    xs = [ctx.x(slot) for slot in slots]

    def body(itype: str) -> list[str]:
        def read(k: int, start) -> str:
            offset = "" if static_int(start) == 0 else f" - {c_dim(ctx, start, itype)}"
            return f"{y}[i] = {xs[k]}[o * {c_dim(ctx, rows[k], itype)} + r{offset}];"

        return _row_split(ctx, outer, row, itype) + _pieces_chain(rows, itype, ctx, read)

    grid_stride(ctx, "eg_concat", dims_product(out), [], body)


def _row_split(ctx: CudaContext, outer, row, itype: str) -> list[str]:
    if static_int(outer) == 1:
        return [f"const {itype} o = 0;", f"const {itype} r = i;"]
    return [f"const {itype} o = i / {c_dim(ctx, row, itype)};",
            f"const {itype} r = i - o * {c_dim(ctx, row, itype)};"]


@register_kernel("Split")
def split(ctx: CudaContext) -> None:
    """Every output in one launch over the input: the inverse of :func:`concat`; the pieces'
    sizes are the outputs' (inferred) dims."""
    shape = ctx.in_shape(0)
    axis = _normalize_axis(ctx.attr("axis", 0), len(shape))
    after = dims_product(shape[axis + 1:])
    rows = [dims_product([ctx.out_shape(k)[axis], after]) for k in range(len(ctx.node.outputs))]
    x, ys = ctx.x(0), [ctx.y(k) for k in range(len(rows))]
    ctype = ctx.ctype(ctx.in_dtype(0))

    def body(itype: str) -> list[str]:
        def write(k: int, start) -> str:
            offset = "" if static_int(start) == 0 else f" - {c_dim(ctx, start, itype)}"
            return f"{ys[k]}[o * {c_dim(ctx, rows[k], itype)} + r{offset}] = v;"

        return [f"const {ctype} v = {x}[i];",
                *_row_split(ctx, dims_product(shape[:axis]), dims_product(shape[axis:]), itype),
                *_pieces_chain(rows, itype, ctx, write)]

    grid_stride(ctx, "eg_split", dims_product(shape), [], body)


# ---- Shape, Size, ConstantOfShape, Range ------------------------------------------------------------------
def _one_thread(ctx: CudaContext, name: str, lines: Sequence[str]) -> None:
    ctx.function(name, indent(["if (threadIdx.x == 0 && blockIdx.x == 0) {", indent(lines), "}"]), grid=1, block=1)


@register_kernel("Shape")
def shape(ctx: CudaContext) -> None:
    """The input's dims (``start``/``end`` from opset 15) as int64, by one thread."""
    dims = ctx.in_shape(0)
    rank = len(dims)
    start, end = (ctx.attr("start", 0), ctx.attr("end", None)) if ctx.opset >= 15 else (0, None)
    start = max(0, min(rank, start + rank if start < 0 else start))
    end = rank if end is None else max(0, min(rank, end + rank if end < 0 else end))
    lines = [f"{ctx.y(0)}[{k}] = {ctx.dim(d)};" for k, d in enumerate(dims[start:end])]
    _one_thread(ctx, "eg_shape", lines or ["(void)0;"])


@register_kernel("Size")
def size(ctx: CudaContext) -> None:
    """The input's element count as an int64 scalar."""
    _one_thread(ctx, "eg_size", [f"{ctx.y(0)}[0] = {ctx.dim(dims_product(ctx.in_shape(0)))};"])


@register_kernel("ConstantOfShape")
def constant_of_shape(ctx: CudaContext) -> None:
    """The output (its inferred shape) filled with ``value``."""
    value = ctx.attr("value", None)
    value = 0 if value is None else np.asarray(value).ravel()[0]
    emit_broadcast(ctx, "eg_constant_of_shape", [], c_literal(value, ctx.out_dtype(0)))


@register_kernel("Range")
def range_(ctx: CudaContext) -> None:
    """``y[i] = start + i * delta`` (``i`` converted to the output type first, as numpy's
    ``arange(n).astype(t) * delta``); the length is the output's (inferred) dim."""
    dtype = ctx.out_dtype(0)
    ctype = ctx.ctype(dtype)
    if dtype is DType.BOOL:
        raise Unsupported("Range of bool")
    prelude = []
    for slot, name in ((0, "start"), (2, "delta")):
        value = ctx.constant(slot)
        literal = c_literal(np.asarray(value).ravel()[0], dtype) if value is not None else f"{ctx.x(slot)}[0]"
        prelude.append(f"const {ctype} {name} = {literal};")
    count = dims_product(ctx.out_shape(0))
    y = ctx.y(0)
    grid_stride(ctx, "eg_range", count, [], lambda itype: [f"{y}[i] = ({ctype})(start + ({ctype})i * delta);"], prelude)


__all__ = ["AxisMap", "collapse", "emit_mapped_copy", "reduce_permutation", "TILE", "TILE_ROWS"]

"""Winograd F(2x2, 3x3) convolution for egraft's ``WinogradConv`` (3x3, unit strides and
dilations, one group): 2.25x fewer multiplications than the direct form, paid for with
two cheap transforms.

Per image, the output's 2x2 tiles are taken a chunk of tile rows at a time (so the
transformed data stays within the thread's scratch), and for each chunk:

1. **input transform**: every 4x4 input patch ``d`` (overlapping by 2, zero in the
   padding) becomes ``V = B^T d B``, 16 numbers stored as 16 matrices ``V[xi][c][t]``
   (channel by tile). ``VW`` neighbouring tiles are transformed together: each patch row
   is two masked vector loads, split into its four columns by even/odd shuffles;
2. **products**: ``M[xi] = U[xi] @ V[xi]`` for the 16 points ``xi``, each one call of
   ``egraft_sgemm`` (:mod:`egraft.kernels.cpu.sgemm`) with ``U = G W G^T`` transformed and
   packed at compile time;
3. **output transform**: ``Y = A^T M A`` gives each 2x2 output tile, the bias and the
   activation are applied in registers, and the two output rows are stored interleaved
   (masked at the right and bottom edges).

Threads: the chunks are shared out over the kernel's parts, each with its own scratch;
an image with fewer chunks than parts is shared by output channels instead (each part
transforms the input itself: it is the cheap step).

Example: VGG-19's ``WinogradConv(f32[1, 64, 224, 224], ...) {pads = [1, 1, 1, 1]}`` has
112 x 112 tiles, taken 4 tile rows (448 tiles) per chunk: 16 products of
``64 x 448 x 64`` per chunk instead of one of ``64 x 50176 x 576``.
"""

from __future__ import annotations

import numpy as np
from llvmlite import ir

from egraft.ir.ops.winograd import winograd_weights
from egraft.kernels.cpu.emit import F32, I32, I64, KernelContext, masked_load, register_packing, splat
from egraft.kernels.cpu.sgemm import KERNEL_SCRATCH_BYTES, Epilogue, blocking, emit_call, pack_a_constant

#: Bytes of each thread's scratch given to the transformed input and the products.
WINOGRAD_BYTES = KERNEL_SCRATCH_BYTES
#: Points of the transformed 4x4 tile.
POINTS = 16
#: Fewest tiles per product worth it: below (a 7x7 output has 16 tiles) the 16 products are
#: too narrow to run at speed and the convolution runs as one product instead.
MIN_TILES = 32


#: ``U = G w G^T`` of a ``WinogradConv(x, w, U)``'s filters, as rewriting made its third input
#: (the kernel reads ``w``; a cache entry gives ``U`` back from it).
register_packing("winograd.transform", gather=False)(winograd_weights)


@register_packing("winograd.packed_u", gather=False)
def pack_filters(w: np.ndarray, mr: int) -> np.ndarray:
    """3x3 filters ``w [O, C, 3, 3]`` as the products read them: ``U = G w G^T`` per point of
    the 4x4 tile, the ``[O, C]`` matrix in panels of ``mr`` rows
    (:func:`~egraft.kernels.cpu.sgemm.pack_a_constant`), the 16 points back to back."""
    u = winograd_weights(np.asarray(w, np.float32))  # [O, C, 4, 4]
    u_points = u.transpose(2, 3, 0, 1).reshape(POINTS, u.shape[0], u.shape[1])
    return np.concatenate([pack_a_constant(u_points[xi], mr) for xi in range(POINTS)])


def chunk_rows(geo, threads_hint: int = 2) -> int | None:
    """Tile rows per chunk for ``geo`` so that ``V`` and ``M`` fit :data:`WINOGRAD_BYTES`
    (and there are at least ``threads_hint`` chunks when the image has that many tile
    rows); ``None`` when not even one tile row fits."""
    vw = blocking().vw
    tiles_h, tiles_w = -(-geo.out_h // 2), -(-geo.out_w // 2)
    per_tile = POINTS * (geo.channels + geo.out_channels) * 4
    budget_tiles = WINOGRAD_BYTES // per_tile - 2 * vw
    if budget_tiles < tiles_w:
        return None
    rows = min(budget_tiles // tiles_w, tiles_h)
    shared = -(-tiles_h // threads_hint)
    if tiles_h >= threads_hint and shared * tiles_w >= MIN_TILES:
        rows = min(rows, shared)
    return max(rows, 1)


def tile_layout(geo) -> tuple[int, int, int] | None:
    """``(rows per chunk, chunks, ld)`` of ``geo``'s tiles: ``ld`` is the row stride of V and
    M, a chunk's tiles rounded up to whole vectors plus one (room for a spilled vector). The
    products run over ``chunks * ld`` tile columns, however many tiles are real: the cost
    model prices those (:func:`padded_tiles`). ``None`` when not even one tile row fits."""
    rows = chunk_rows(geo)
    if rows is None:
        return None
    vw = blocking().vw
    tiles_h, tiles_w = -(-geo.out_h // 2), -(-geo.out_w // 2)
    return rows, -(-tiles_h // rows), -(-rows * tiles_w // vw) * vw + vw


def padded_tiles(out_h: int, out_w: int, channels: int, out_channels: int) -> int | None:
    """The tile columns the products of a Winograd convolution with these sizes run over (a
    13x13 output has 49 tiles; with 16 lanes, two chunks of 48 columns: 96).

    Example:
        >>> padded_tiles(56, 56, 64, 64) >= 28 * 28
        True
    """
    from types import SimpleNamespace

    layout = tile_layout(SimpleNamespace(out_h=out_h, out_w=out_w, channels=channels, out_channels=out_channels))
    return None if layout is None else layout[1] * layout[2]


def fits(ctx: KernelContext, geo, activation: str) -> bool:
    """Whether the Winograd kernel computes this node (fp32, constant weights, a 2-D 3x3
    stride-1 one-group conv, an activation the products' library form takes)."""
    if ctx.out_type(0).dtype.short != "f32" or any(ctx.in_type(i).dtype.short != "f32" for i in (0, 1)):
        return False
    if not ctx.is_constant(1) or len(ctx.shape(ctx.in_type(0))) != 4:
        return False
    shape = (geo.k_h, geo.k_w, geo.stride_h, geo.stride_w, geo.dil_h, geo.dil_w, geo.group)
    if shape != (3, 3, 1, 1, 1, 1, 1) or not Epilogue.fits(activation):
        return False
    if -(-geo.out_h // 2) * -(-geo.out_w // 2) < MIN_TILES:
        return False
    return chunk_rows(geo) is not None


class _Vectors:
    """Vector helpers on the kernel's builder (``width`` floats per vector)."""

    def __init__(self, ctx: KernelContext, width: int):
        self.ctx, self.b, self.width = ctx, ctx.builder, width

    def vtype(self, width: int | None = None) -> ir.VectorType:
        return ir.VectorType(F32, width or self.width)

    def splat(self, value: ir.Value, width: int | None = None) -> ir.Value:
        return splat(self.b, value, width or self.width)

    def lane_mask(self, first: ir.Value, limit: ir.Value, width: int, extra: ir.Value | None = None) -> ir.Value:
        """Lanes ``first + lane`` inside ``[0, limit)`` (and ``extra``)."""
        b = self.b
        vi = ir.VectorType(I64, width)
        lanes = b.add(self.splat(first, width), ir.Constant(vi, list(range(width))))
        mask = b.and_(b.icmp_signed(">=", lanes, ir.Constant(vi, [0] * width)),
                      b.icmp_signed("<", lanes, self.splat(limit, width)))
        return b.and_(mask, self.splat(extra, width)) if extra is not None else mask

    def _intrinsic(self, name: str, ret: ir.Type, args: list[ir.Type]) -> ir.Function:
        module = self.ctx.module
        return module.globals.get(name) or ir.Function(module, ir.FunctionType(ret, args), name)

    def masked_store(self, value: ir.Value, ptr: ir.Value, index: ir.Value, mask: ir.Value) -> None:
        b, vt = self.b, value.type
        pointer = b.bitcast(b.gep(ptr, [index]), vt.as_pointer())
        fn = self._intrinsic(f"llvm.masked.store.v{vt.count}f32.p0", ir.VoidType(), [vt, pointer.type, I32, mask.type])
        b.call(fn, [value, pointer, ir.Constant(I32, 4), mask])

    def load(self, ptr: ir.Value, index: ir.Value) -> ir.Value:
        return self.b.load(self.b.bitcast(self.b.gep(ptr, [index]), self.vtype().as_pointer()), align=4)

    def store(self, value: ir.Value, ptr: ir.Value, index: ir.Value) -> None:
        self.b.store(value, self.b.bitcast(self.b.gep(ptr, [index]), self.vtype().as_pointer()), align=4)

    def pick(self, wide: ir.Value, start: int) -> ir.Value:
        """Lanes ``start, start + 2, ...`` of a vector twice as wide (its evens or odds)."""
        indices = ir.Constant(ir.VectorType(I32, self.width), [start + 2 * i for i in range(self.width)])
        return self.b.shuffle_vector(wide, ir.Constant(wide.type, None), indices)

    def interleave(self, even: ir.Value, odd: ir.Value) -> ir.Value:
        indices = [i // 2 + (self.width if i % 2 else 0) for i in range(2 * self.width)]
        return self.b.shuffle_vector(even, odd, ir.Constant(ir.VectorType(I32, 2 * self.width), indices))


def emit_winograd(ctx: KernelContext, geo, bias: int | None, activation: str, params: tuple[float, ...]) -> None:
    """Emit the node's convolution by Winograd F(2x2, 3x3) (see the module docstring);
    :func:`fits` must hold."""
    b = ctx.builder
    blk = blocking()
    vw = blk.vw
    vec = _Vectors(ctx, vw)
    c_in, c_out = geo.channels, geo.out_channels
    tiles_h, tiles_w = -(-geo.out_h // 2), -(-geo.out_w // 2)
    rows_per_chunk, chunks, ld = tile_layout(geo)
    groups = -(-tiles_w // vw)

    u_ptr, packed = ctx.packed_constant("packed_u", "winograd.packed_u", 1, mr=blk.mr)
    u_stride = len(packed) // POINTS
    x, y = ctx.in_ptr(0), ctx.out_ptr(0)
    bias_ptr = ctx.in_ptr(bias) if bias is not None else None

    def const(v: int) -> ir.Constant:
        return ir.Constant(I64, v)

    scratch = b.bitcast(ctx.scratch, F32.as_pointer())
    v_base = b.gep(scratch, [const(-(-blk.scratch_floats // 16) * 16)])
    m_base = b.gep(v_base, [const(POINTS * c_in * ld)])
    plane_in, plane_out = geo.in_h * geo.in_w, geo.out_h * geo.out_w

    with ctx.loop(ctx.dim(geo.batch), name="image") as image:
        x_image = b.gep(x, [b.mul(image, const(c_in * plane_in))])
        y_image = b.gep(y, [b.mul(image, const(c_out * plane_out))])
        # Parts take whole chunks when there are enough; else (a small image) every part takes
        # every chunk for its share of the output channels, transforming the input itself.
        by_chunks = b.icmp_signed(">=", const(chunks), ctx.parts)
        one = const(1)
        step_size = b.select(by_chunks, ctx.parts, one)
        first_chunk = b.select(by_chunks, ctx.part, const(0))
        channel_tiles = -(-c_out // blk.mr)
        o_lo = b.select(by_chunks, const(0), b.mul(b.sdiv(b.mul(const(channel_tiles), ctx.part), ctx.parts),
                                                     const(blk.mr)))
        o_hi = b.select(by_chunks, const(c_out),
                        b.mul(b.sdiv(b.mul(const(channel_tiles), b.add(ctx.part, one)), ctx.parts), const(blk.mr)))
        o_lo = b.select(b.icmp_signed("<", o_lo, const(c_out)), o_lo, const(c_out))
        o_hi = b.select(b.icmp_signed("<", o_hi, const(c_out)), o_hi, const(c_out))
        mine = b.sdiv(b.add(b.sub(const(chunks), first_chunk), b.sub(step_size, one)), step_size)
        with ctx.loop(mine, name="chunk") as step:
            chunk = b.add(first_chunk, b.mul(step, step_size))
            ty0 = b.mul(chunk, const(rows_per_chunk))
            rows = b.select(b.icmp_signed("<", b.sub(const(tiles_h), ty0), const(rows_per_chunk)),
                            b.sub(const(tiles_h), ty0), const(rows_per_chunk))
            tiles = b.mul(rows, const(tiles_w))
            _input_transform(ctx, vec, geo, x_image, v_base, ty0, rows, ld, groups, tiles_w)
            for xi in range(POINTS):  # rows o_lo.. of U (a whole number of packed panels)
                emit_call(ctx, {"m": b.sub(o_hi, o_lo), "n": tiles, "k": c_in,
                                "a": b.gep(u_ptr, [b.add(const(xi * u_stride), b.mul(o_lo, const(c_in)))]),
                                "a_packed": 1, "b": b.gep(v_base, [const(xi * c_in * ld)]), "b_rs": ld, "b_cs": 1,
                                "c": b.gep(m_base, [b.add(const(xi * c_out * ld), b.mul(o_lo, const(ld)))]),
                                "ldc": ld}, Epilogue(), parallel=False)
            _output_transform(ctx, vec, geo, y_image, m_base, bias_ptr, activation, params, ty0, rows, ld, groups,
                              tiles_w, o_lo, o_hi)
    ctx.parallel = True


def _input_transform(ctx, vec: _Vectors, geo, x_image, v_base, ty0, rows, ld: int, groups: int, tiles_w: int) -> None:
    """``V[xi][c][t] = (B^T d B)[xi]`` for the chunk's tiles, ``VW`` tiles at a time."""
    b, vw = ctx.builder, vec.width
    const = lambda v: ir.Constant(I64, v)  # noqa: E731
    width, height = const(geo.in_w), const(geo.in_h)
    with ctx.loop(const(geo.channels), name="wc") as c:
        channel = b.gep(x_image, [b.mul(c, const(geo.in_h * geo.in_w))])
        with ctx.loop(rows, name="wr") as r:
            y0 = b.sub(b.mul(b.add(ty0, r), const(2)), const(geo.pad_h))
            with ctx.loop(const(groups), name="wg") as g:
                tx0 = b.mul(g, const(vw))
                x0 = b.sub(b.mul(tx0, const(2)), const(geo.pad_w))
                d = []  # d[i][j]: row i, column j of each tile's patch
                for i in range(4):
                    row = b.add(y0, const(i))
                    inside = b.and_(b.icmp_signed(">=", row, const(0)), b.icmp_signed("<", row, height))
                    start = b.mul(b.select(inside, row, const(0)), width)
                    a = masked_load(b, channel, b.add(start, x0), vec.lane_mask(x0, width, 2 * vw, inside))
                    x2 = b.add(x0, const(2))
                    a2 = masked_load(b, channel, b.add(start, x2), vec.lane_mask(x2, width, 2 * vw, inside))
                    d.append([vec.pick(a, 0), vec.pick(a, 1), vec.pick(a2, 0), vec.pick(a2, 1)])
                t = [[b.fsub(d[0][j], d[2][j]) for j in range(4)], [b.fadd(d[1][j], d[2][j]) for j in range(4)],
                     [b.fsub(d[2][j], d[1][j]) for j in range(4)], [b.fsub(d[1][j], d[3][j]) for j in range(4)]]
                at = b.add(b.mul(r, const(tiles_w)), tx0)
                for i in range(4):
                    v = [b.fsub(t[i][0], t[i][2]), b.fadd(t[i][1], t[i][2]), b.fsub(t[i][2], t[i][1]),
                         b.fsub(t[i][1], t[i][3])]
                    for j in range(4):
                        plane = b.add(b.mul(const(i * 4 + j), const(geo.channels)), c)
                        vec.store(v[j], v_base, b.add(b.mul(plane, const(ld)), at))


def _output_transform(ctx, vec: _Vectors, geo, y_image, m_base, bias_ptr, activation: str, params, ty0, rows,
                      ld: int, groups: int, tiles_w: int, o_lo: ir.Value, o_hi: ir.Value) -> None:
    """``Y = act(A^T M A + bias)`` for the chunk's tiles, stored as two interleaved rows."""
    b, vw = ctx.builder, vec.width
    const = lambda v: ir.Constant(I64, v)  # noqa: E731
    out_w, out_h = const(geo.out_w), const(geo.out_h)
    with ctx.loop(o_hi, name="oc", start=o_lo) as o:
        channel = b.gep(y_image, [b.mul(o, const(geo.out_h * geo.out_w))])
        bias = vec.splat(b.load(b.gep(bias_ptr, [o]))) if bias_ptr is not None else None
        with ctx.loop(rows, name="or") as r:
            oy = b.mul(b.add(ty0, r), const(2))
            with ctx.loop(const(groups), name="og") as g:
                tx0 = b.mul(g, const(vw))
                at = b.add(b.mul(r, const(tiles_w)), tx0)
                m = [[vec.load(m_base, b.add(b.mul(b.add(b.mul(const(i * 4 + j), const(geo.out_channels)), o),
                                                   const(ld)), at)) for j in range(4)] for i in range(4)]
                s = [[b.fadd(b.fadd(m[0][j], m[1][j]), m[2][j]) for j in range(4)],
                     [b.fsub(b.fsub(m[1][j], m[2][j]), m[3][j]) for j in range(4)]]
                ox = b.mul(tx0, const(2))
                mask = vec.lane_mask(ox, out_w, 2 * vw)
                for i in range(2):
                    pair = [b.fadd(b.fadd(s[i][0], s[i][1]), s[i][2]), b.fsub(b.fsub(s[i][1], s[i][2]), s[i][3])]
                    if bias is not None:
                        pair = [b.fadd(v, bias) for v in pair]
                    pair = [ctx.math.activation(activation, params, v) for v in pair]
                    row = b.add(oy, const(i))
                    with b.if_then(b.icmp_signed("<", row, out_h)):
                        vec.masked_store(vec.interleave(*pair), channel, b.add(b.mul(row, out_w), ox), mask)


__all__ = ["WINOGRAD_BYTES", "pack_filters", "chunk_rows", "tile_layout", "padded_tiles", "fits", "emit_winograd"]

"""Direct convolution on channel-blocked tensors, egraft's ``ConvNCHWc`` (the MLAS way: no
packing of the activations, no im2col).

Layouts (block 8: one AVX2 register of floats):

- input ``Xb [N, C/8, H, W, 8]``: channel ``c`` in block ``c // 8``, lane ``c % 8``;
- output ``Y [N, M/8, OH, OW, 8]`` and the residual ``Z`` (the output's shape);
- weights ``W [M, C, KH, KW]`` (ONNX), packed at compile time (:func:`pack_weights`) into
  one panel per tile of 16 output channels, ``[C/8][KH][KW][8][16]``: the order the inner
  loop reads them in, two 8-float vectors per step.

An output tile is 16 output channels (two output blocks) times 6 consecutive pixels of one
output row: 12 vector accumulators, kept in registers over input blocks, taps and lanes.
On hosts with 512-bit registers two blocks are one 16-lane vector and a tile is four blocks
(32 channels: two 16-lane vectors per pixel, still 12 accumulators; the weights are packed
in panels of 32, :func:`tile_blocks`), the sums split back into blocks for the epilogue.
Per input lane ``jj`` of a tap, the step loads the two weight vectors, broadcasts the 6
input scalars ``Xb[n, cb, ih, iw_j, jj]`` and issues 12 fused multiply-adds (the loop over
taps stays a loop: see :meth:`NCHWcEmitter.emit_tile`). The epilogue runs on the
registers: bias vector, residual vector, the activation, then contiguous 8-float stores.

Padding costs no checks in the inner loop:

- kernel rows outside the input are skipped for the whole tile (one row per tile): the
  valid ``[kh_lo, kh_hi)`` of each output row come from two compile-time tables;
- the columns of a row are covered by tiles planned at compile time
  (:func:`plan_columns`): interior tiles, whose every tap is inside the input, run in a
  loop; the tiles at the edges sit at compile-time columns, and a pixel of theirs that
  can read the padding picks, per tap, its input or a block of zeros (one select per tap).

On 512-bit hosts a tile of two 16-lane vectors is 7 pixels (:func:`tile_pixels`: 14
accumulators of 32 registers; rows of 56, 28 and 14 columns are whole tiles).

Tails: a row's last tile may have fewer pixels (and is balanced with the one before
it); when ``M % 16 == 8`` the last tile of channels is one vector wide. A tile of few
pixels has few independent accumulator chains (a fused multiply-add waits 4 cycles for
its previous result), so it keeps several copies of its accumulators, used in turn and
summed at the end (:func:`accumulator_copies`).

Caches: when a channel tile's weights outgrow L1 (many input channels), the input blocks
are taken a chunk at a time (:data:`CHUNK_WEIGHT_BYTES` of weights), each over several
output rows, the partial sums going through the output. The work items are
(channel tile, block of output rows), in row-major order when all the weights stay in L2.

Threads: the work items of each image are shared over the kernel's parts (``ctx.share``);
the runtime splits the call when the op's work formula says it is worth it.

Example: ResNet-50's ``ConvNCHWc(f32[1, 8, 56, 56, 8], W f32[64, 64, 3, 3]) {pads = [1, 1, 1, 1]}``
runs 4 channel tiles x 56 rows; each row is a 6-pixel edge tile at column 0, 7 interior
tiles in a loop (columns 6..47) and two edge tiles of 4 pixels at columns 48 and 52, over
the input blocks in chunks of 3.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

import numpy as np
from llvmlite import ir

from egraft.ir.dims import dims_equal
from egraft.ir.ops.layout import unblocked_shape
from egraft.kernels.cpu import conv_depthwise, conv_symbolic, register_kernel
from egraft.kernels.cpu.conv import (
    ConvGeometry,
    _activation,
    affine,
    const64,
    constant_table,
    conv_geometry,
    fmuladd,
    vector_pointer,
)
from egraft.kernels.cpu.emit import (
    F32,
    KernelContext,
    Unsupported,
    concat,
    halves,
    llvm_type,
    prefetch,
    register_packing,
    splat,
)
from egraft.kernels.cpu.llvm import host_vector_bits
from egraft.kernels.cpu.sgemm import KERNEL_SCRATCH_BYTES

#: Channels per block of the layouts this kernel reads and writes (floats per vector).
BLOCK = 8
#: Vectors of output channels per tile (16 channels).
TILE_VECTORS = 2
#: Output pixels per tile (12 accumulators with TILE_VECTORS); see :func:`tile_pixels`.
TILE_PIXELS = 6
#: Output pixels per tile of two 16-lane vectors on a 512-bit host (14 accumulators of its 32
#: registers): rows of 7 x 2^k columns (ResNet's and Inception's 56, 28, 14) split into whole
#: tiles, where tiles of 6 left tiles of 4 and 2. At 1 thread, against 6: ResNet-50 0.96x,
#: Inception-v1/v2 0.97x, SqueezeNet 0.92x, DenseNet-121 0.95x, ddddocr_det 0.96x, the
#: other bundled and corpus CNNs within 2.5%.
WIDE_TILE_PIXELS = 7
#: Bytes of packed weights that stay in L2 (half of Zen 3's 512 KiB) while input rows stream past.
RESIDENT_WEIGHT_BYTES = 256 * 1024
#: Bytes of packed weights of one chunk of input blocks of a channel tile (half of Zen 3's 32 KiB L1).
CHUNK_WEIGHT_BYTES = 16 * 1024
#: Column tiles a work item runs over each chunk's weights (its rows are chosen to have as many).
MIN_TILES_PER_CHUNK = 8
#: Fewest work items per image when the weights outgrow L2 (for the thread split).
MIN_ITEMS = 16
#: Fewest pixels of a row's last tile (a narrower one is merged with the one before, see plan_columns).
BALANCED_PIXELS = 4
#: Independent accumulator chains that keep the FMA units busy (2 units x 4 cycles latency).
CHAINS = 8
#: Accumulator registers a tile may use (16 ymm: the rest hold the weights and a broadcast).
MAX_ACCUMULATORS = 12
#: Bytes of a part's scratch that a pre-activation's staged input rows may take.
STAGE_BYTES = KERNEL_SCRATCH_BYTES


# ---- compile-time plans -----------------------------------------------------------------------------
def unblocked_geometry(ctx: KernelContext) -> ConvGeometry:
    """Conv's geometry (:func:`~egraft.kernels.cpu.conv.conv_geometry`) of a 2-D ``ConvNCHWc``
    on its unblocked shapes, any groups and dilations; :class:`Unsupported` for another
    block than :data:`BLOCK` or another rank."""
    x_shape, out_shape = ctx.shape(ctx.in_type(0)), ctx.shape(ctx.out_type(0))
    block = int(ctx.attr("block", BLOCK))
    if block != BLOCK:
        raise Unsupported(f"block {block} has no generated code (block {BLOCK} only)")
    if len(x_shape) not in (4, 5) or len(out_shape) != 5:
        raise Unsupported("only 2-D blocked convolutions have generated code")
    if nchw_input(ctx) and not (isinstance(x_shape[1], int) and x_shape[1] < BLOCK):
        raise Unsupported(f"an NCHW input of {x_shape[1]} channels (the blocked kernel reads fewer than {BLOCK})")
    try:
        x = x_shape if nchw_input(ctx) else unblocked_shape(x_shape, BLOCK)
        return conv_geometry(ctx, x, unblocked_shape(out_shape, BLOCK))
    except ValueError as e:
        raise Unsupported(str(e)) from None


def nchw_input(ctx: KernelContext) -> bool:
    """Whether the node's input is NCHW (``[N, C, H, W]``, C < 8: an image's channels, read
    in place) rather than channel-blocked."""
    return len(ctx.shape(ctx.in_type(0))) == 4


def input_lanes(channels: int) -> int:
    """The input channels one step of the kernel broadcasts: a block's 8, or all of an NCHW
    input's fewer."""
    return BLOCK if channels % BLOCK == 0 else channels


def blocked_geometry(ctx: KernelContext) -> ConvGeometry:
    """The geometry of a ``ConvNCHWc`` node in channel terms (C and M, not blocks): Conv's
    (:func:`~egraft.kernels.cpu.conv.conv_geometry`) on the unblocked shapes;
    :class:`Unsupported` for another block than :data:`BLOCK`, a rank other than 2-D, groups
    or dilations.

    Example: ``ConvNCHWc(f32[N, 2, 10, 10, 8], W f32[8, 16, 3, 3]) {strides = [2, 2], pads = [1, 1, 1, 1]}``
    has ``channels == 16``, ``out_channels == 8`` and ``out_h == out_w == 5``.
    """
    geo = unblocked_geometry(ctx)
    if geo.group != 1:
        raise Unsupported(f"group {geo.group} has no generated code (one group only)")
    if (geo.dil_h, geo.dil_w) != (1, 1):
        raise Unsupported(f"dilations {[geo.dil_h, geo.dil_w]} have no generated code (1 only)")
    return geo


@dataclass(frozen=True)
class ColumnPlan:
    """How the tiles cover an output row: ``loop_count`` interior tiles of ``pixels`` from
    column ``loop_start`` run in a loop; ``edges`` lists the other tiles as ``(first column,
    pixels)``, at compile-time columns."""

    loop_start: int
    loop_count: int
    edges: tuple[tuple[int, int], ...]
    pixels: int = TILE_PIXELS


def tile_pixels(tile: int) -> int:
    """Output pixels per tile of ``tile`` output blocks (:func:`tile_blocks`): 7 for two
    16-lane vectors per pixel on a 512-bit host, else :data:`TILE_PIXELS` (AVX2's 16 registers
    hold 12 accumulators; a 512-bit tile of four vectors per pixel already has 24)."""
    return WIDE_TILE_PIXELS if host_vector_bits() >= 512 and tile == 2 * TILE_VECTORS else TILE_PIXELS


def plan_columns(geo: ConvGeometry, pixels: int = TILE_PIXELS) -> ColumnPlan:
    """The tiles of an output row of ``geo`` (see :class:`ColumnPlan`): edge tiles of
    ``pixels`` from column 0 until every later tile's taps are inside the input, the
    interior in a loop, then edge tiles over the rest. A last tile of fewer than
    :data:`BALANCED_PIXELS` is merged with the one before and the two split evenly: a narrow
    tile streams the weights for few multiply-adds.

    Example: 56 columns, a 3x3 kernel with pad 1: column 0 reads the padding, and the last 8
    columns are two tiles of 4 (not 6 and 2):
        >>> geo = ConvGeometry(1, 8, 8, 1, 56, 56, 3, 3, 56, 56, 1, 1, 1, 1, 1, 1)
        >>> plan_columns(geo)
        ColumnPlan(loop_start=6, loop_count=7, edges=((0, 6), (48, 4), (52, 4)), pixels=6)

    In tiles of 7 (:func:`tile_pixels` on a 512-bit host) the row is 8 whole tiles, the last
    one an edge tile (its last column reads the padding):
        >>> plan_columns(geo, 7)
        ColumnPlan(loop_start=7, loop_count=6, edges=((0, 7), (49, 7)), pixels=7)
    """
    lo, hi = geo.interior()
    start = min(-(-lo // pixels) * pixels, geo.out_w)
    count = max(hi - start, 0) // pixels
    edges = [(first, min(pixels, geo.out_w - first)) for first in range(0, start, pixels)]
    edges += [(first, min(pixels, geo.out_w - first))
              for first in range(start + count * pixels, geo.out_w, pixels)]
    if edges and edges[-1][1] < BALANCED_PIXELS and edges[-1][0] > 0:
        last_first, _ = edges.pop()
        if count and last_first == start + count * pixels:
            count -= 1  # the loop's last tile joins the remainder
        else:
            edges.pop()
        merged_first = last_first - pixels
        merged = geo.out_w - merged_first
        half = -(-merged // 2)
        edges += [(merged_first, half), (merged_first + half, merged - half)]
    return ColumnPlan(start, count, tuple(edges), pixels)


def accumulator_copies(pixels: int, vectors: int) -> int:
    """How many copies of a ``pixels x vectors`` tile's accumulators keep :data:`CHAINS`
    independent chains in flight within :data:`MAX_ACCUMULATORS` registers.

    Example: a one-pixel tile of two vectors keeps four copies (8 chains):
        >>> accumulator_copies(1, 2), accumulator_copies(3, 2), accumulator_copies(6, 2)
        (4, 2, 1)
    """
    per_copy = pixels * vectors
    return max(1, min(-(-CHAINS // per_copy), MAX_ACCUMULATORS // per_copy))


#: Input lanes per iteration of a tile's lane loop, at least (a multiple of the accumulator
#: copies, dividing the lanes; else every lane unrolled). Two lanes per iteration, and LLVM
#: not unrolling the loop, ran ResNet-50, Inception-v2, DenseNet-121 and SqueezeNet as fast
#: as all 8 unrolled (within 2%), with 40% less IR and half the LLVM time (cold compile of
#: ResNet-50: lowering 1.9 -> 1.2 s, LLVM 2.1-2.6 -> 1.2-1.5 s).
LANE_GROUP = 2


def lane_unroll(lanes: int, copies: int) -> int:
    """How many input lanes one iteration of the lane loop runs: the fewest, at least
    :data:`LANE_GROUP`, that are a multiple of ``copies`` (each copy takes a lane in turn)
    and divide ``lanes``; ``lanes`` (no loop) when none does.

    Example:
        >>> lane_unroll(8, 1), lane_unroll(8, 4), lane_unroll(8, 3), lane_unroll(3, 1)
        (2, 4, 8, 3)
    """
    for unroll in range(max(copies, LANE_GROUP), lanes):
        if unroll % copies == 0 and lanes % unroll == 0:
            return unroll
    return lanes


def scaled(b: ir.IRBuilder, index: ir.Value, factor: int) -> ir.Value:
    """``index * factor`` as ``i64``, folded when ``index`` is a constant."""
    if isinstance(index, ir.Constant):
        return const64(index.constant * factor)
    return index if factor == 1 else b.mul(index, const64(factor))


def offset(b: ir.IRBuilder, index: ir.Value, delta: int) -> ir.Value:
    """``index + delta`` as ``i64``, folded when ``index`` is a constant."""
    if isinstance(index, ir.Constant):
        return const64(index.constant + delta)
    return index if delta == 0 else b.add(index, const64(delta))


def channel_tiles(out_channels: int, tile: int = TILE_VECTORS) -> list[int]:
    """The blocks of each tile of output channels: ``tile`` per tile (two, or four on 512-bit
    hosts: :func:`tile_blocks`), the rest in a last, narrower one.

    Example:
        >>> channel_tiles(24), channel_tiles(64), channel_tiles(56, 4)
        ([2, 1], [2, 2, 2, 2], [4, 3])
    """
    blocks = out_channels // BLOCK
    return [tile] * (blocks // tile) + [blocks % tile] * (blocks % tile > 0)


#: Output columns up to which a 512-bit host takes channel tiles of 8 blocks (narrow rows:
#: their tiles have few pixels, so more channels keep enough accumulators in flight). On
#: 14-column rows the gain was 1-3% for twice the code per tile (ResNet-50's cold compile
#: +0.8 s with 14, +0.1-0.5 s with 7).
NARROW_COLUMNS = 7


def tile_blocks(out_w: int | None = None) -> int:
    """Output blocks per channel tile on this host: with 512-bit registers 4 (two 16-lane
    vectors per pixel), or 8 for rows of at most :data:`NARROW_COLUMNS` output columns (four
    vectors: 24 accumulators of 32 registers where a 7-column row's tiles have 3 or 4 pixels;
    ResNet-50's 1x1 convolutions on 7 x 7: 0.87-0.92x the time of 4 blocks); else
    :data:`TILE_VECTORS` (two 8-lane vectors)."""
    if host_vector_bits() < 512:
        return TILE_VECTORS
    return 4 * TILE_VECTORS if isinstance(out_w, int) and out_w <= NARROW_COLUMNS else 2 * TILE_VECTORS


def vector_parts(blocks: int, paired: bool) -> list[tuple[int, int]]:
    """How a tile of ``blocks`` output blocks is held per pixel: ``(first block, lanes)`` of
    each vector, two blocks to a 16-lane vector when ``paired``.

    Example:
        >>> vector_parts(3, True), vector_parts(2, False)
        ([(0, 16), (2, 8)], [(0, 8), (1, 8)])
    """
    if not paired:
        return [(v, BLOCK) for v in range(blocks)]
    return [(v, 2 * BLOCK) for v in range(0, blocks - 1, 2)] + [(blocks - 1, BLOCK)] * (blocks % 2)


@register_packing("conv_nchwc.blocked", gather=True)
def pack_weights(w: np.ndarray, tile: int = TILE_VECTORS) -> np.ndarray:
    """ONNX weights ``[M, C, KH, KW]`` as the kernel reads them: per tile of output channels
    (:func:`channel_tiles` of ``tile`` blocks), ``[C/8][KH][KW][8][width]`` with ``width`` its
    channels (16 or 32, fewer for a last narrower tile), the tiles one after the other, flat;
    with fewer than 8 input channels (an NCHW input), ``[1][KH][KW][C][width]``.

    Example: the first 16 floats are the weights of input channel 0, tap (0, 0), for
    output channels 0..15:
        >>> w = np.arange(24 * 8 * 1 * 1, dtype=np.float32).reshape(24, 8, 1, 1)
        >>> packed = pack_weights(w)
        >>> bool((packed[:16] == w[:16, 0, 0, 0]).all()), packed.shape
        (True, (192,))
    """
    w = np.asarray(w, np.float32)
    m, c, kh, kw = w.shape
    lanes = input_lanes(c)  # an NCHW input's few channels: one block of them
    panels, first = [], 0
    for vectors in channel_tiles(m, tile):
        width = vectors * BLOCK
        tile = w[first:first + width].reshape(width, c // lanes, lanes, kh, kw)
        panels.append(np.ascontiguousarray(tile.transpose(1, 3, 4, 2, 0)).reshape(-1))
        first += width
    return np.concatenate(panels).astype(np.float32)


# ---- the emitter ------------------------------------------------------------------------------------
@dataclass(frozen=True)
class _Chunk:
    """The input blocks ``[cb_lo, cb_hi)`` being accumulated; ``first`` and ``last`` say
    whether it is the first chunk (the accumulators start at zero, else from the partial sums
    in the output) and the last one (the epilogue runs, else the partial sums are stored):
    ``True`` when known at compile time, else an ``i1``."""

    cb_lo: ir.Value
    cb_hi: ir.Value
    first: ir.Value | bool
    last: ir.Value | bool


@dataclass(frozen=True)
class _Row:
    """One output row of one channel tile being emitted: image ``n``, first output block
    ``block0``, ``vectors`` output blocks, the tile's packed weights ``weights``, row ``oh``
    and its valid kernel rows ``[kh_lo, kh_hi)``, over the input blocks of ``chunk``."""

    n: ir.Value
    block0: ir.Value
    vectors: int
    weights: ir.Value
    oh: ir.Value
    kh_lo: ir.Value
    kh_hi: ir.Value
    chunk: _Chunk
    oh0: ir.Value | None = None  # the row block's first row (a pre-activation's staged rows start there)


class NCHWcEmitter:
    """Emits ``y = act(conv(xb, w) + bias + z)`` on blocked tensors (see the module docstring).

    Example::

        NCHWcEmitter(ctx, blocked_geometry(ctx), bias=2, residual=None, activation="relu").emit()
    """

    def __init__(self, ctx: KernelContext, geo: ConvGeometry, bias: int | None, residual: int | None,
                 activation: str = "", params: Sequence[float] = (), prologue: tuple[int, int] | None = None):
        """``prologue``: the operands ``(S, T)`` of a pre-activation ``Relu(Xb * S + T)`` (a 1x1,
        stride-1, unpadded convolution only), staged row block by row block in the scratch."""
        self.ctx, self.geo, self.b = ctx, geo, ctx.builder
        self.activation, self.params = activation, list(params)
        self.x, self.y = ctx.in_ptr(0), ctx.out_ptr(0)
        #: the input's layout: channels per step (``lanes``), elements between two of them
        #: and between two pixels (blocked: 8, 1, 8; NCHW: C, H * W, 1), and input blocks
        self.nchw = nchw_input(ctx)
        self.lanes = input_lanes(geo.channels)
        self.lane_stride = geo.in_h * geo.in_w if self.nchw else 1
        self.pixel = 1 if self.nchw else BLOCK
        self.in_blocks = max(1, geo.channels // BLOCK)
        #: output blocks per channel tile; with 512-bit registers two blocks are one 16-lane
        #: vector (one weight load and one multiply-add per pixel and input lane instead of two),
        #: and a tile is four blocks: 2 vectors x 6 pixels = 12 accumulators, as with 8 lanes
        #: (eight on narrow rows, see tile_blocks)
        self.tile = tile_blocks(geo.out_w)
        self.paired = self.tile > TILE_VECTORS
        self.w, packed = ctx.packed_constant("packed_w", "conv_nchwc.blocked", 1,
                                             **({"tile": self.tile} if self.tile != TILE_VECTORS else {}))
        #: the work items in row-major order (every channel tile of a row, then the next row)
        #: when all the weights stay in L2: each input row is then read once from memory
        self.rows_outer = packed.nbytes <= RESIDENT_WEIGHT_BYTES
        #: weights beyond L2 come from memory once per run: each step also asks for the line
        #: it will read at the next chunk of input blocks, so the stream overlaps the
        #: multiply-adds (ResNet-50's 512 x 512 3x3 on 7x7 with cold weights: 1.75 -> 1.44-1.50 ms)
        self.prefetch_weights = not self.rows_outer
        #: input blocks per chunk: the chunk's weights of a channel tile stay in L1 while the
        #: tiles of the item's rows run over them (partial sums go through the output)
        chunk_bytes = geo.k_h * geo.k_w * self.lanes * self.tile * BLOCK * 4
        self.chunk_blocks = max(1, min(self.in_blocks, CHUNK_WEIGHT_BYTES // chunk_bytes))
        self.columns = plan_columns(geo, tile_pixels(self.tile))
        tiles_per_row = self.columns.loop_count + len(self.columns.edges)
        chunked = self.chunk_blocks < self.in_blocks
        #: output rows per work item: enough tiles to reuse each chunk's weights (one row
        #: unchunked); when the weights outgrow L2, as many as leave MIN_ITEMS items, so that
        #: they are read from memory as few times as that allows
        rows = -(-MIN_TILES_PER_CHUNK // tiles_per_row) if chunked else 1
        if not self.rows_outer:
            rows = max(rows, geo.out_h // -(-MIN_ITEMS // len(channel_tiles(geo.out_channels, self.tile))))
        self.rows_per_item = max(1, min(geo.out_h, rows))
        #: a pre-activation's scale and shift: each part computes Relu(Xb * S + T) of the rows of
        #: its items into its scratch, once per row block, and the tiles read it from there
        self.prologue = None if prologue is None else tuple(ctx.in_ptr(i) for i in prologue)
        if self.prologue is not None:
            row_bytes = geo.channels * geo.in_w * 4
            if row_bytes > STAGE_BYTES:
                raise Unsupported(f"an input row of {row_bytes} bytes outgrows the pre-activation's scratch")
            self.rows_per_item = max(1, min(self.rows_per_item, STAGE_BYTES // row_bytes))
            self.stage = ctx.builder.bitcast(ctx.scratch, F32.as_pointer())
        #: items in row-major order: every channel tile of a row block, then the next block
        self.items_by_row = self.rows_outer or self.prologue is not None
        self.bias = ctx.in_ptr(bias) if bias is not None else None
        self.z = ctx.in_ptr(residual) if residual is not None else None
        self.kh_lo = constant_table(ctx, "kh_lo", [geo.row_taps(oh)[0] for oh in range(geo.out_h)])
        self.kh_hi = constant_table(ctx, "kh_hi", [geo.row_taps(oh)[1] for oh in range(geo.out_h)])
        taps = [(kh, kw) for kh in range(geo.k_h) for kw in range(geo.k_w)]
        self.tap_offset = constant_table(ctx, "tap_offset", [(kh * geo.in_w + kw) * self.pixel for kh, kw in taps])
        self.tap_column = constant_table(ctx, "tap_column", [kw for _, kw in taps])
        self.zeros = constant_table(ctx, "zeros", [0.0] * BLOCK, F32)
        self.tiles = channel_tiles(geo.out_channels, self.tile)
        self.panel = geo.channels * geo.k_h * geo.k_w  # floats of packed weights per output channel
        self._outside: dict[int, ir.Value] = {}  # an NCHW padded pixel's pointer -> "outside the input"

    # -- the loop nest
    def emit(self) -> None:
        """Every image; this part's share of the (channel tile, block of output rows) items of each."""
        geo, b, ctx = self.geo, self.b, self.ctx
        wide = self.tiles.count(self.tile)
        tiles = len(self.tiles)
        row_blocks = -(-geo.out_h // self.rows_per_item)
        lo, hi = ctx.share(tiles * row_blocks)
        with ctx.loop(ctx.dim(geo.batch), name="n") as n:
            with ctx.loop(hi, name="item", start=lo) as item:
                if self.items_by_row:
                    rows, tile = b.sdiv(item, const64(tiles)), b.srem(item, const64(tiles))
                else:
                    tile, rows = b.sdiv(item, const64(row_blocks)), b.srem(item, const64(row_blocks))
                if self.prologue is not None:  # a row block's first item in this part stages its rows
                    with b.if_then(b.or_(b.icmp_signed("==", tile, const64(0)), b.icmp_signed("==", item, lo))):
                        self.emit_staging(n, rows)
                if wide == len(self.tiles):
                    self.emit_item(n, tile, rows, self.tile)
                else:  # the last tile is narrower
                    with b.if_else(b.icmp_signed("<", tile, const64(wide))) as (then, otherwise):
                        with then:
                            self.emit_item(n, tile, rows, self.tile)
                        with otherwise:
                            self.emit_item(n, tile, rows, self.tiles[-1])

    def emit_staging(self, n: ir.Value, rows: ir.Value) -> None:
        """``Relu(Xb * S + T)`` of the input rows of row block ``rows`` (those of its output rows:
        a 1x1, stride-1, unpadded convolution) into the scratch, ``[C/8][rows][W][8]``."""
        geo, b, ctx = self.geo, self.b, self.ctx
        scale, shift = self.prologue
        oh_lo, oh_hi = self.row_range(rows)
        row_floats = geo.in_w * BLOCK
        zero = ir.Constant(ir.VectorType(F32, BLOCK), [0.0] * BLOCK)
        with ctx.loop(self.in_blocks, name="stage_cb") as cb:
            s = b.load(vector_pointer(b, scale, b.mul(cb, const64(BLOCK)), BLOCK), align=4)
            t = b.load(vector_pointer(b, shift, b.mul(cb, const64(BLOCK)), BLOCK), align=4)
            with ctx.loop(oh_hi, name="stage_row", start=oh_lo) as oh:
                source = affine(b, [(n, self.in_blocks * geo.in_h * row_floats), (cb, geo.in_h * row_floats),
                                    (oh, row_floats)])
                target = affine(b, [(cb, self.rows_per_item * row_floats), (b.sub(oh, oh_lo), row_floats)])
                with ctx.loop(geo.in_w, name="stage_pixel") as iw:
                    at = b.mul(iw, const64(BLOCK))
                    v = b.load(vector_pointer(b, self.x, b.add(source, at), BLOCK), align=4)
                    v = fmuladd(ctx, v, s, t)
                    v = b.select(b.fcmp_ordered(">", v, zero), v, zero)  # ReLU (0 for a NaN, as max)
                    b.store(v, vector_pointer(b, self.stage, b.add(target, at), BLOCK), align=4)

    def row_range(self, rows: ir.Value) -> tuple[ir.Value, ir.Value]:
        """The output rows ``[oh_lo, oh_hi)`` of row block ``rows``."""
        b = self.b
        oh_lo = b.mul(rows, const64(self.rows_per_item))
        oh_hi = b.add(oh_lo, const64(self.rows_per_item))
        return oh_lo, b.select(b.icmp_signed("<", oh_hi, const64(self.geo.out_h)), oh_hi, const64(self.geo.out_h))

    def emit_item(self, n: ir.Value, tile: ir.Value, rows: ir.Value, vectors: int) -> None:
        """Channel tile ``tile`` (of ``vectors`` blocks) over the output rows of row block
        ``rows``, one chunk of input blocks after the other."""
        b, ctx = self.b, self.ctx
        block0 = b.mul(tile, const64(self.tile))
        weights = b.gep(self.w, [b.mul(block0, const64(BLOCK * self.panel))])
        in_blocks = self.in_blocks
        chunks = -(-in_blocks // self.chunk_blocks)
        if chunks == 1:
            self.emit_rows(n, block0, vectors, weights, rows, _Chunk(const64(0), const64(in_blocks), True, True))
            return
        with ctx.loop(chunks, name="chunk") as chunk:
            cb_lo = b.mul(chunk, const64(self.chunk_blocks))
            cb_hi = b.add(cb_lo, const64(self.chunk_blocks))
            cb_hi = b.select(b.icmp_signed("<", cb_hi, const64(in_blocks)), cb_hi, const64(in_blocks))
            first = b.icmp_signed("==", chunk, const64(0))
            last = b.icmp_signed("==", chunk, const64(chunks - 1))
            self.emit_rows(n, block0, vectors, weights, rows, _Chunk(cb_lo, cb_hi, first, last))

    def emit_rows(self, n: ir.Value, block0: ir.Value, vectors: int, weights: ir.Value, rows: ir.Value,
                  chunk: _Chunk) -> None:
        """The output rows of row block ``rows``, every column, over the input blocks of ``chunk``."""
        b = self.b
        oh_lo, oh_hi = self.row_range(rows)
        with self.ctx.loop(oh_hi, name="oh", start=oh_lo) as oh:
            row = _Row(n, block0, vectors, weights, oh, b.load(b.gep(self.kh_lo, [oh])),
                       b.load(b.gep(self.kh_hi, [oh])), chunk, oh_lo)
            plan = self.columns
            if plan.loop_count:
                with self.ctx.loop(plan.loop_count, name="tile") as t:
                    ow0 = b.add(const64(plan.loop_start), b.mul(t, const64(plan.pixels)))
                    self.emit_tile(row, ow0, plan.pixels)
            for first, pixels in plan.edges:
                self.emit_tile(row, const64(first), pixels, first)

    # -- offsets
    def input_corner(self, row: _Row, cb: ir.Value, ow0: ir.Value) -> ir.Value:
        """``&Xb[n, cb, oh * stride - pad, ow0 * stride - pad, 0]``: where tap (0, 0) of the
        tile's first pixel reads (it may lie in the padding: the taps that would read there
        are not run, or read zeros)."""
        geo, b = self.geo, self.b
        if self.prologue is not None:  # the staged rows of the pre-activation
            row_floats = geo.in_w * BLOCK
            terms = [(cb, self.rows_per_item * row_floats), (b.sub(row.oh, row.oh0), row_floats), (ow0, BLOCK)]
            return b.gep(self.stage, [affine(b, terms)])
        plane = geo.in_h * geo.in_w * BLOCK  # one input block (an NCHW input has one block)
        image = geo.channels * geo.in_h * geo.in_w
        terms = [(row.n, image), (cb, plane), (row.oh, geo.stride_h * geo.in_w * self.pixel),
                 (ow0, geo.stride_w * self.pixel)]
        offset = affine(b, terms, -(geo.pad_h * geo.in_w + geo.pad_w) * self.pixel)
        return b.gep(self.x, [offset])

    def output_at(self, row: _Row, ow0: ir.Value) -> ir.Value:
        """The element offset of ``Y[n, block0, oh, ow0, 0]``."""
        geo = self.geo
        plane = geo.out_h * geo.out_w * BLOCK
        return affine(self.b, [(row.n, geo.out_channels // BLOCK * plane), (row.block0, plane),
                               (row.oh, geo.out_w * BLOCK), (ow0, BLOCK)])

    def padded_pixels(self, first: int | None, pixels: int) -> list[int]:
        """The pixels of a tile at column ``first`` that read the padding at some kernel
        column (none for an interior tile, ``first is None``)."""
        if first is None:
            return []
        geo = self.geo
        return [j for j in range(pixels)
                if not all(0 <= (first + j) * geo.stride_w - geo.pad_w + kw < geo.in_w for kw in range(geo.k_w))]

    def pixel_pointers(self, x_tap: ir.Value, kw: ir.Value, pixels: int, first: int | None) -> list[ir.Value]:
        """Where each pixel of the tile reads its 8 lanes at the current tap: ``x_tap`` plus
        the pixel's column, or the zero block for a padded pixel whose column is outside."""
        geo, b = self.geo, self.b
        pointers = [b.gep(x_tap, [const64(j * geo.stride_w * self.pixel)]) for j in range(pixels)]
        for j in self.padded_pixels(first, pixels):
            column = b.add(kw, const64((first + j) * geo.stride_w - geo.pad_w))
            inside = b.icmp_unsigned("<", column, const64(geo.in_w))
            # a blocked pixel outside reads the block of zeros; an NCHW one reads the image's
            # first element of each channel (inside the buffer), and pixel_value zeroes it
            pointers[j] = b.select(inside, pointers[j], self.x if self.nchw else self.zeros)
            if self.nchw:
                self._outside[id(pointers[j])] = b.not_(inside)
        return pointers

    def pixel_value(self, pointer: ir.Value, lane: ir.Value) -> ir.Value:
        """Input channel ``lane`` of the pixel at ``pointer`` (0 for an NCHW pixel outside)."""
        b = self.b
        value = b.load(b.gep(pointer, [scaled(b, lane, self.lane_stride)]))
        outside = self._outside.get(id(pointer))
        return value if outside is None else b.select(outside, ir.Constant(F32, 0.0), value)

    # -- one tile
    def emit_tile(self, row: _Row, ow0: ir.Value, pixels: int, first: int | None = None) -> None:
        """``row.vectors`` output blocks x ``pixels`` pixels from column ``ow0``, accumulated in
        registers over input blocks, the taps of the valid kernel rows and the input lanes;
        ``first`` is ``ow0`` when known at compile time (an edge tile, whose padded pixels
        read zeros at the taps outside the input).

        The taps are a runtime loop, not unrolled: unrolled, the same input element is read by
        pixel ``j`` at tap ``kw`` and by pixel ``j + 1`` at tap ``kw - 1`` (unit stride), and
        LLVM keeps each broadcast alive from one to the other, spilling registers."""
        geo, b, ctx = self.geo, self.b, self.ctx
        vectors = row.vectors
        width = vectors * BLOCK
        parts = vector_parts(vectors, self.paired)  # (first block, lanes) of each vector of a pixel
        copies = accumulator_copies(pixels, len(parts))
        slots = [[[ctx.alloca(ir.VectorType(F32, n), name=f"acc{c}_{j}_{v}") for v, n in parts]
                  for j in range(pixels)] for c in range(copies)]
        for c in range(copies):
            for j in range(pixels):
                for (_, n), slot in zip(parts, slots[c][j]):
                    b.store(ir.Constant(ir.VectorType(F32, n), [0.0] * n), slot)
        chunk = row.chunk
        if chunk.first is not True:  # a later chunk: start from the partial sums
            with b.if_then(b.not_(chunk.first)):
                partial = {(j, v): b.load(vector_pointer(b, self.y, at, BLOCK), align=4)
                           for j, v, at in self.output_vectors(row, ow0, pixels)}
                for j in range(pixels):
                    for (v, n), slot in zip(parts, slots[0][j]):
                        value = partial[j, v] if n == BLOCK else concat(b, partial[j, v], partial[j, v + 1])
                        b.store(value, slot)
        taps = geo.k_h * geo.k_w
        first_tap, end_tap = b.mul(row.kh_lo, const64(geo.k_w)), b.mul(row.kh_hi, const64(geo.k_w))
        lanes = self.lanes
        with ctx.loop(chunk.cb_hi, name="cb", start=chunk.cb_lo) as cb:
            weights_cb = b.gep(row.weights, [b.mul(cb, const64(taps * lanes * width))])
            corner = self.input_corner(row, cb, ow0)
            with ctx.loop(end_tap, name="tap", start=first_tap) as tap:
                x_tap = b.gep(corner, [b.load(b.gep(self.tap_offset, [tap]))])
                w_tap = b.gep(weights_cb, [b.mul(tap, const64(lanes * width))])
                kw = b.load(b.gep(self.tap_column, [tap])) if self.padded_pixels(first, pixels) else None
                pointers = self.pixel_pointers(x_tap, kw, pixels, first)
                unroll = lane_unroll(lanes, copies)
                if unroll == lanes:
                    self.emit_lanes(slots, parts, pointers, w_tap, [const64(lane) for lane in range(lanes)])
                else:  # a runtime loop over groups of lanes: an 8th of the code, as fast
                    with ctx.loop(lanes // unroll, name="lanes") as group:
                        lane0 = b.mul(group, const64(unroll))
                        self.emit_lanes(slots, parts, pointers, w_tap,
                                        [lane0] + [b.add(lane0, const64(u)) for u in range(1, unroll)])
        sums = []  # per pixel, per output block: 8-lane vectors
        for j in range(pixels):
            per_block = []
            for k, (_, n) in enumerate(parts):
                total = self.sum_copies(slots, j, k)
                per_block.extend(halves(b, total) if n > BLOCK else (total,))
            sums.append(per_block)
        if chunk.last is True:
            self.emit_epilogue(row, ow0, pixels, sums)
            return
        with b.if_else(chunk.last) as (then, otherwise):
            with then:
                self.emit_epilogue(row, ow0, pixels, sums)
            with otherwise:  # partial sums, for the next chunk
                for j, v, at in self.output_vectors(row, ow0, pixels):
                    b.store(sums[j][v], vector_pointer(b, self.y, at, BLOCK), align=4)

    def emit_lanes(self, slots, parts, pointers: list[ir.Value], w_tap: ir.Value, lanes: list[ir.Value]) -> None:
        """Multiply-add input lanes ``lanes`` (``i64`` indices, constants when unrolled) of each
        pixel at ``pointers`` into the accumulators in ``slots``; lane ``k`` of the list goes
        to copy ``k % copies``."""
        b, ctx = self.b, self.ctx
        width = sum(n for _, n in parts)
        ahead = self.chunk_blocks * self.geo.k_h * self.geo.k_w * self.lanes * width
        copies = len(slots)
        acc = [[[b.load(slot) for slot in per_pixel] for per_pixel in per_copy] for per_copy in slots]
        for k, lane in enumerate(lanes):
            row = scaled(b, lane, width)
            ws = [b.load(vector_pointer(b, w_tap, offset(b, row, v * BLOCK), n), align=4) for v, n in parts]
            if self.prefetch_weights:  # the next chunk's weights, from memory meanwhile
                for v, _ in parts:
                    prefetch(b, b.gep(w_tap, [offset(b, row, ahead + v * BLOCK)]))
            c = k % copies
            for j, pointer in enumerate(pointers):
                value = self.pixel_value(pointer, lane)
                xs = {n: splat(b, value, n) for n in {n for _, n in parts}}
                acc[c][j] = [fmuladd(ctx, w, xs[n], a) for w, (_, n), a in zip(ws, parts, acc[c][j])]
        for per_copy, values in zip(slots, acc):
            for per_pixel, pixel_values in zip(per_copy, values):
                for slot, value in zip(per_pixel, pixel_values):
                    b.store(value, slot)

    def sum_copies(self, slots, j: int, v: int) -> ir.Value:
        """The accumulator of pixel ``j``, vector ``v``: the sum of its copies."""
        value = self.b.load(slots[0][j][v])
        for copy in slots[1:]:
            value = self.b.fadd(value, self.b.load(copy[j][v]))
        return value

    def output_vectors(self, row: _Row, ow0: ir.Value, pixels: int) -> list[tuple[int, int, ir.Value]]:
        """``(pixel, vector, element offset)`` of each output vector of a tile at column ``ow0``."""
        plane = self.geo.out_h * self.geo.out_w * BLOCK
        base = self.output_at(row, ow0)
        return [(j, v, self.b.add(base, const64(v * plane + j * BLOCK)))
                for j in range(pixels) for v in range(row.vectors)]

    def emit_epilogue(self, row: _Row, ow0: ir.Value, pixels: int, sums: list[list[ir.Value]]) -> None:
        """Add the bias and the residual to the tile's sums, apply the activation and store
        each ``(pixel, block)`` vector."""
        b = self.b
        biases = []
        for v in range(row.vectors):
            if self.bias is None:
                biases.append(None)
                continue
            channel = b.mul(b.add(row.block0, const64(v)), const64(BLOCK))
            biases.append(b.load(vector_pointer(b, self.bias, channel, BLOCK), align=4))
        math = self.ctx.math
        apart = self.activation in math.OUT_OF_LINE  # applied to the stored tile, by a call per block row
        starts = []
        for j, v, at in self.output_vectors(row, ow0, pixels):
            value = sums[j][v]
            if biases[v] is not None:
                value = b.fadd(value, biases[v])
            if self.z is not None:
                value = b.fadd(value, b.load(vector_pointer(b, self.z, at, BLOCK), align=4))
            if apart:
                if j == 0:
                    starts.append(at)
            else:
                value = math.activation(self.activation, self.params, value)
            b.store(value, vector_pointer(b, self.y, at, BLOCK), align=4)
        for at in starts:  # a block's pixels are contiguous: BLOCK floats each
            math.activation_in_place(self.activation, self.params, b.gep(self.y, [at]), pixels * BLOCK, BLOCK)


# ---- the generator ----------------------------------------------------------------------------------
def _check_operands(ctx: KernelContext, residual: int | None) -> None:
    """fp32 everywhere, constant weights, a residual of the output's own shape."""
    inputs = [0, 1] + [i for i in (2, residual) if i is not None and ctx.has_input(i)]
    if ctx.out_type(0).dtype.short != "f32" or any(ctx.in_type(i).dtype.short != "f32" for i in inputs):
        raise Unsupported("ConvNCHWc has generated code for float32 only")
    if not ctx.is_constant(1):
        raise Unsupported("the weights are not a constant (they are packed at compile time)")
    if residual is not None:
        z, y = ctx.shape(ctx.in_type(residual)), ctx.shape(ctx.out_type(0))
        if len(z) != len(y) or not all(dims_equal(a, b) for a, b in zip(z, y)):
            raise Unsupported(f"the residual's shape {list(z)} is not the output's {list(y)}")


@register_kernel("ConvNCHWc", domain="com.egraft")
def conv_nchwc(ctx: KernelContext) -> None:
    """egraft's ``ConvNCHWc``: ``act(Conv(Xb, W, B) + Z)`` on channel-blocked tensors, one group,
    unit dilations, constant weights; the residual ``Z`` (input 3) and the activation are
    optional.

    Example: ``ConvNCHWc(xb: f32[1, 8, 56, 56, 8], w: f32[64, 64, 3, 3], b: f32[64]) {pads = [1, 1, 1, 1]}``.
    """
    activation, params = _activation(ctx)
    residual = 3 if ctx.has_input(3) else None
    _check_operands(ctx, residual)
    ctx.llvm_unroll = False  # the lane loop, the only short one, runs as fast rolled; unrolled it doubled LLVM's time
    ctx.llvm_loop_vectorize = False  # the tiles are vector code already
    if conv_symbolic.has_symbolic_spatial_dims(ctx):  # runtime bounds, the same blocked layout
        if nchw_input(ctx):
            raise Unsupported("an NCHW input with symbolic spatial dims has no generated code (blocked only)")
        block = int(ctx.attr("block", BLOCK))
        if block != BLOCK:
            raise Unsupported(f"block {block} has no generated code (block {BLOCK} only)")
        conv_symbolic.emit_symbolic_conv(ctx, llvm_type(ctx.out_type(0).dtype), 2 if ctx.has_input(2) else None,
                                         residual, activation, params, block=block)
        return
    geo = unblocked_geometry(ctx)
    if geo.group > 1 and geo.group == geo.channels == geo.out_channels:  # depthwise: a vector multiply-add per tap
        conv_depthwise.emit_depthwise(ctx, geo, 2 if ctx.has_input(2) else None, residual, activation, params)
        return
    geo = column_as_row(blocked_geometry(ctx))
    NCHWcEmitter(ctx, geo, 2 if ctx.has_input(2) else None, residual, activation, params).emit()


@register_kernel("PreActConvNCHWc", domain="com.egraft")
def pre_act_conv_nchwc(ctx: KernelContext) -> None:
    """egraft's ``PreActConvNCHWc``: ``act(Conv(Relu(Xb * S + T), W, B))`` on channel-blocked
    tensors, a 1x1, stride-1, unpadded convolution of one group: each part stages the
    pre-activation of its rows in its scratch (:meth:`NCHWcEmitter.emit_staging`).

    Example: ``PreActConvNCHWc(xb: f32[1, 32, 56, 56, 8], w: f32[128, 256, 1, 1], s, t: f32[1, 32, 1, 1, 8])``.
    """
    activation, params = _activation(ctx)
    _check_operands(ctx, None)  # fp32 (every input: the op's inference), constant weights; S, T: [1, C/8, 1, 1, 8]
    if conv_symbolic.has_symbolic_spatial_dims(ctx) or nchw_input(ctx):
        raise Unsupported("PreActConvNCHWc has generated code for blocked inputs of static spatial dims only")
    geo = blocked_geometry(ctx)
    if (geo.k_h, geo.k_w, geo.stride_h, geo.stride_w, geo.pad_h, geo.pad_w) != (1, 1, 1, 1, 0, 0) \
            or (geo.in_h, geo.in_w) != (geo.out_h, geo.out_w):
        raise Unsupported("a pre-activation has generated code for 1x1, stride-1, unpadded convolutions only")
    ctx.llvm_unroll = False
    ctx.llvm_loop_vectorize = False
    NCHWcEmitter(ctx, geo, 4 if ctx.has_input(4) else None, None, activation, params, prologue=(2, 3)).emit()


def column_as_row(geo: ConvGeometry) -> ConvGeometry:
    """A convolution down a one-pixel-wide column (``W == 1``, a ``k x 1`` kernel: a 1-D
    convolution stored as ``[N, C, L, 1]``) as the same convolution along a one-row image:
    ``[N, C/8, L, 1, 8]`` and ``[N, C/8, 1, L, 8]`` are the same bytes, and the packed weights
    of a ``k x 1`` and a ``1 x k`` kernel too. The tiles then run along ``L`` (TILE_PIXELS
    outputs each) instead of one pixel per row. Any other geometry is returned as it is.

    Example:
        >>> geo = ConvGeometry(1, 256, 512, 1, 512, 1, 5, 1, 508, 1, 1, 1, 1, 1, 0, 0)
        >>> row = column_as_row(geo)
        >>> (row.in_h, row.in_w, row.k_h, row.k_w, row.out_h, row.out_w)
        (1, 512, 1, 5, 1, 508)
    """
    if (geo.in_w, geo.out_w, geo.k_w, geo.pad_w) != (1, 1, 1, 0) or geo.in_h == 1:
        return geo
    return replace(geo, in_h=1, in_w=geo.in_h, k_h=1, k_w=geo.k_h, out_h=1, out_w=geo.out_h, stride_h=1,
                   stride_w=geo.stride_h, dil_h=1, dil_w=geo.dil_h, pad_h=0, pad_w=geo.pad_h)


__all__ = ["BLOCK", "column_as_row", "unblocked_geometry", "TILE_PIXELS", "TILE_VECTORS", "blocked_geometry",
           "tile_blocks", "vector_parts",
           "ColumnPlan", "plan_columns", "accumulator_copies", "channel_tiles", "pack_weights", "NCHWcEmitter",
           "conv_nchwc", "pre_act_conv_nchwc"]

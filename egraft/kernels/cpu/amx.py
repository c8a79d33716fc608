"""AMX tile products (Intel Sapphire Rapids and later): ``C[m, n] += A[m, k] @ B[k, n]`` with
A uint8, B int8 and C int32, exact (no int16 step), 16 x 16 outputs per ``tdpbusd``.

A tile register holds 16 rows of 64 bytes: A's rows with 64 of their k values, B's rows of
*quads* (4 k values of 16 columns side by side, the layout of :func:`quant.pack_integer_quads`
with ``nr = 16``), C's rows of 16 int32. The kernel keeps four C tiles (32 rows x 32
columns), two of A and two of B in the eight registers; each 64-deep step is four loads
and four products. Linux hands a process the tile registers only when asked
(``arch_prctl(ARCH_REQ_XCOMP_PERM)``): :func:`available` asks once, and says no on other
systems, on hosts without AMX and under ``EGRAFT_AMX=0``.

Example: ``MatMulInteger(a: u8[1, 128, 512], B: i8[512, 512])`` is 4 blocks of 32 rows
times 16 pairs of 16-column panels, each 8 steps of 64 (onnxruntime's MLAS uses AMX too).
"""

from __future__ import annotations

import ctypes
import os
import sys
from functools import cache

from llvmlite import ir

from egraft.kernels.cpu.emit import I8, I8P, I32, I64, KernelContext, const64, imin, masked_store, splat
from egraft.kernels.cpu.llvm import host_cpu

#: a tile: 16 rows of 64 bytes
TILE_ROWS, TILE_BYTES = 16, 64
#: k values per step (one row of an A tile)
DEPTH = TILE_BYTES
#: tile registers: four C tiles (row tile r, column tile c at 2r + c), two of A, two of B
C_TILES, A_TILES, B_TILES = (0, 1, 2, 3), (4, 5), (6, 7)
_ARCH_REQ_XCOMP_PERM, _XFEATURE_XTILEDATA, _SYS_ARCH_PRCTL = 0x1023, 18, 158


@cache
def _permission() -> bool:
    """Ask Linux for the tile data state once (process-wide, threads included)."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.syscall(_SYS_ARCH_PRCTL, _ARCH_REQ_XCOMP_PERM, _XFEATURE_XTILEDATA) == 0
    except (OSError, AttributeError):
        return False


def host_has_tiles() -> bool:
    """Whether the CPU has AMX's int8 tile products (whatever the settings)."""
    triple, _, features = host_cpu()
    return triple.startswith("x86_64") and {"+amx-tile", "+amx-int8"} <= set(features.split(","))


def available() -> bool:
    """Whether the integer products may run on AMX tiles here: the CPU has them, Linux lends
    them to this process, and ``EGRAFT_AMX`` is not ``0``."""
    if os.environ.get("EGRAFT_AMX", "1").strip() == "0" or not host_has_tiles():
        return False
    return _permission()


def enable() -> None:
    """Before running code that may use tiles (a kernel loaded from the cache was built by
    a process that had them): ask for them if the CPU has them."""
    if host_has_tiles():
        _permission()


class Tiles:
    """The tile instructions as LLVM intrinsics on fixed registers."""

    def __init__(self, b: ir.IRBuilder):
        self.b = b
        module = b.module

        def fn(name: str, args: list[ir.Type]) -> ir.Function:
            return module.globals.get(name) or ir.Function(module, ir.FunctionType(ir.VoidType(), args), name)

        self._config = fn("llvm.x86.ldtilecfg", [I8P])
        self._release = fn("llvm.x86.tilerelease", [])
        self._zero = fn("llvm.x86.tilezero", [I8])
        self._load = fn("llvm.x86.tileloadd64", [I8, I8P, I64])
        self._store = fn("llvm.x86.tilestored64", [I8, I8P, I64])
        self._product = fn("llvm.x86.tdpbusd", [I8, I8, I8])

    def configure(self) -> None:
        """Every register 16 rows of 64 bytes (palette 1)."""
        config = bytearray(64)
        config[0] = 1
        for t in (*C_TILES, *A_TILES, *B_TILES):
            config[16 + 2 * t] = TILE_BYTES
            config[48 + t] = TILE_ROWS
        module = self.b.module
        table = module.globals.get("egraft.amx.config")
        if table is None:
            table = ir.GlobalVariable(module, ir.ArrayType(I8, 64), "egraft.amx.config")
            table.initializer = ir.Constant(ir.ArrayType(I8, 64), bytearray(config))
            table.global_constant = True
            table.linkage = "internal"
            table.align = 64
        self.b.call(self._config, [self.b.bitcast(table, I8P)])

    def release(self) -> None:
        self.b.call(self._release, [])

    def zero(self, t: int) -> None:
        self.b.call(self._zero, [ir.Constant(I8, t)])

    def load(self, t: int, pointer: ir.Value, stride: ir.Value) -> None:
        self.b.call(self._load, [ir.Constant(I8, t), pointer, stride])

    def store(self, t: int, pointer: ir.Value, stride: ir.Value) -> None:
        self.b.call(self._store, [ir.Constant(I8, t), pointer, stride])

    def product(self, c: int, a: int, b: int) -> None:
        """``c += a (uint8) @ b (int8 quads)``."""
        self.b.call(self._product, [ir.Constant(I8, c), ir.Constant(I8, a), ir.Constant(I8, b)])


def scratch_bytes(k: int, n: int) -> int:
    """The scratch a call needs: a block of A's rows (32, padded to whole steps), 4 C tiles
    and a row of ``n`` int32 (padded to whole tiles) for the caller (:func:`bias_row`)."""
    return 2 * TILE_ROWS * -(-k // DEPTH) * DEPTH + 4 * TILE_ROWS * TILE_BYTES + -(-n // TILE_ROWS) * TILE_BYTES


def bias_row(ctx: KernelContext, k: int) -> ir.Value:
    """The scratch's row of int32 for the caller: the values every output row starts from."""
    at = 2 * TILE_ROWS * -(-k // DEPTH) * DEPTH + 4 * TILE_ROWS * TILE_BYTES
    return ctx.builder.bitcast(ctx.builder.gep(ctx.scratch, [const64(at)]), I32.as_pointer())


def emit_tile_gemm(ctx: KernelContext, panels: ir.Value, k: int, n: int, rows: ir.Value, a: ir.Value,
                   a_signed: bool, out: ir.Value, bias: ir.Value | None = None,
                   row_terms=None, fix_row=None) -> None:
    """``out[r, :n] = bias + A[r] @ B`` (int32, ``rows x n`` row-major at ``out``) for A
    (``rows x k`` bytes at ``a``, row-major) and the constant B packed in 16-column panels
    at ``panels`` (quads, 64-deep steps: a panel is ``ceil(k / 64) * 16`` rows of 64 bytes,
    zero past k and n).

    ``a_signed``: A is int8 (each block's rows are copied to the scratch anyway, tile by tile:
    its bytes flip to the uint8 they map to, ``x + 128``).
    ``bias``: ``n`` int32 (padded to whole tiles, e.g. :func:`bias_row`) every row starts
    from (the C tiles load it with a row stride of 0), or None for zeros.
    ``row_terms(r0, valid_rows)``: called once per block of rows (``[r0, r0 + valid_rows)``)
    before its products; ``fix_row(row, i, column, end)``: after them, for each row (the
    block's ``i``-th) and the thread's columns ``[column, end)`` of the output.

    The thread takes its share of the column pairs; per block of 32 rows (16 at the end when
    that is all that is left) every pair runs 64-deep steps in registers, and whole tiles are
    stored straight to ``out`` (the others through the scratch)."""
    b = ctx.builder
    tiles = Tiles(b)
    steps = -(-k // DEPTH)
    depth = steps * DEPTH
    panel_bytes = steps * TILE_ROWS * TILE_BYTES
    count = -(-n // TILE_ROWS)
    pairs = -(-count // 2)
    lo, hi = ctx.share(pairs)
    block_ptr = ctx.scratch
    c_area = b.gep(ctx.scratch, [const64(2 * TILE_ROWS * depth)])
    out8 = b.bitcast(out, I8P)
    bias8 = b.bitcast(bias, I8P) if bias is not None else None
    tiles.configure()
    blocks = b.sdiv(b.add(rows, const64(2 * TILE_ROWS - 1)), const64(2 * TILE_ROWS))

    chunk = ir.VectorType(I8, DEPTH)
    flip = ir.Constant(chunk, [-128] * DEPTH)

    def pack_block(r0: ir.Value, valid: ir.Value) -> None:
        """The block's rows to the scratch tile by tile (``[2][steps][16][64]`` bytes: every
        tile load reads 1 KiB in a row), int8 flipped to uint8, the last step zero-padded."""
        with ctx.loop(valid, name="pack_row") as i:
            src = b.mul(b.add(r0, i), const64(k))
            dst = b.add(b.mul(b.sdiv(i, const64(TILE_ROWS)), const64(steps * TILE_ROWS * TILE_BYTES)),
                        b.mul(b.srem(i, const64(TILE_ROWS)), const64(TILE_BYTES)))
            with ctx.loop(const64(k // DEPTH), name="pack_step") as s:
                value = b.load(b.bitcast(b.gep(a, [b.add(src, b.mul(s, const64(DEPTH)))]), chunk.as_pointer()),
                               align=1)
                if a_signed:
                    value = b.xor(value, flip)
                at = b.add(dst, b.mul(s, const64(TILE_ROWS * TILE_BYTES)))
                b.store(value, b.bitcast(b.gep(block_ptr, [at]), chunk.as_pointer()), align=64)
            if k % DEPTH:
                last = b.add(dst, const64((steps - 1) * TILE_ROWS * TILE_BYTES))
                for j in range(DEPTH):
                    if j < k % DEPTH:
                        value = b.load(b.gep(a, [b.add(src, const64(k - k % DEPTH + j))]))
                        value = b.xor(value, ir.Constant(I8, -128)) if a_signed else value
                    else:
                        value = ir.Constant(I8, 0)
                    b.store(value, b.gep(block_ptr, [b.add(last, const64(j))]))

    def block(row_tiles: int, col_tiles: int, r0: ir.Value, valid_rows: ir.Value, p0: ir.Value) -> None:
        for r in range(row_tiles):
            for c in range(col_tiles):
                if bias8 is None:
                    tiles.zero(2 * r + c)
                else:
                    tiles.load(2 * r + c, b.gep(bias8, [b.mul(b.add(p0, const64(c)), const64(TILE_BYTES))]),
                               const64(0))
        with ctx.loop(const64(steps), name="step") as s:
            for r in range(row_tiles):
                at = b.add(const64(r * steps * TILE_ROWS * TILE_BYTES), b.mul(s, const64(TILE_ROWS * TILE_BYTES)))
                tiles.load(A_TILES[r], b.gep(block_ptr, [at]), const64(TILE_BYTES))
            for c in range(col_tiles):
                at = b.add(b.mul(b.add(p0, const64(c)), const64(panel_bytes)),
                           b.mul(s, const64(TILE_ROWS * TILE_BYTES)))
                tiles.load(B_TILES[c], b.gep(panels, [at]), const64(TILE_BYTES))
            for r in range(row_tiles):
                for c in range(col_tiles):
                    tiles.product(2 * r + c, A_TILES[r], B_TILES[c])
        for r in range(row_tiles):
            for c in range(col_tiles):
                _store_tile(ctx, tiles, 2 * r + c, b.add(r0, const64(r * TILE_ROWS)),
                            b.sub(valid_rows, const64(r * TILE_ROWS)), b.add(p0, const64(c)), n, out8,
                            b.gep(c_area, [const64((2 * r + c) * TILE_ROWS * TILE_BYTES)]))

    with ctx.loop(blocks, name="block") as rb:
        r0 = b.mul(rb, const64(2 * TILE_ROWS))
        valid_rows = imin(b, const64(2 * TILE_ROWS), b.sub(rows, r0))
        pack_block(r0, valid_rows)
        if row_terms is not None:
            row_terms(r0, valid_rows)
        two_rows = b.icmp_signed(">", valid_rows, const64(TILE_ROWS))
        with ctx.loop(hi, start=lo, name="pair") as pair:
            p0 = b.mul(pair, const64(2))
            two_cols = b.icmp_signed("<", b.add(p0, const64(1)), const64(count))
            with b.if_else(two_rows) as (tall, short):
                for branch, row_tiles in ((tall, 2), (short, 1)):
                    with branch:
                        with b.if_else(two_cols) as (wide, narrow):
                            with wide:
                                block(row_tiles, 2, r0, valid_rows, p0)
                            with narrow:
                                block(row_tiles, 1, r0, valid_rows, p0)
        if fix_row is not None:
            column = b.mul(lo, const64(2 * TILE_ROWS))
            end = imin(b, b.mul(hi, const64(2 * TILE_ROWS)), const64(n))
            with ctx.loop(valid_rows, name="fix") as i:
                fix_row(b.add(r0, i), i, column, end)
    tiles.release()


def _store_tile(ctx: KernelContext, tiles: Tiles, t: int, r0: ir.Value, valid_rows: ir.Value, panel: ir.Value,
                n: int, out8: ir.Value, spare: ir.Value) -> None:
    """C tile ``t`` (rows from ``r0``, columns of ``panel``) to the output: straight when all
    its rows and columns are in it, else through ``spare`` (1 KiB of scratch), row by row."""
    b = ctx.builder
    column = b.mul(panel, const64(TILE_ROWS))
    valid = imin(b, const64(TILE_ROWS), b.sub(const64(n), column))
    full = b.and_(b.icmp_signed(">=", valid_rows, const64(TILE_ROWS)), b.icmp_signed("==", valid, const64(TILE_ROWS)))
    at = b.mul(b.add(b.mul(r0, const64(n)), column), const64(4))
    with b.if_else(full) as (whole, part):
        with whole:
            tiles.store(t, b.gep(out8, [at]), const64(4 * n))
        with part:
            tiles.store(t, spare, const64(TILE_BYTES))
            vt = ir.VectorType(I32, TILE_ROWS)
            spare32, out32 = b.bitcast(spare, I32.as_pointer()), b.bitcast(out8, I32.as_pointer())
            with ctx.loop(imin(b, valid_rows, const64(TILE_ROWS)), name="tile_row") as i:
                values = b.load(b.bitcast(b.gep(spare32, [b.mul(i, const64(TILE_ROWS))]), vt.as_pointer()), align=4)
                store_int32_row(b, out32, b.add(b.mul(b.add(r0, i), const64(n)), column), values, valid)


def store_int32_row(b: ir.IRBuilder, out: ir.Value, at: ir.Value, values: ir.Value, valid: ir.Value) -> None:
    """The first ``valid`` lanes of ``values`` (``<16 x i32>``) to ``out[at..]``: one vector
    store when all 16 are, a masked one otherwise."""
    lanes = values.type.count
    with b.if_else(b.icmp_signed("==", valid, const64(lanes))) as (whole, part):
        with whole:
            b.store(values, b.bitcast(b.gep(out, [at]), values.type.as_pointer()), align=4)
        with part:
            mask = b.icmp_signed("<", ir.Constant(ir.VectorType(I32, lanes), list(range(lanes))),
                                 splat(b, b.trunc(valid, I32), lanes))
            masked_store(b, values, out, at, mask)

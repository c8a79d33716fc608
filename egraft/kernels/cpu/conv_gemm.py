"""Convolution as one matrix product per image and group, through ``egraft_sgemm``
(:mod:`egraft.kernels.cpu.sgemm`), with no im2col buffer:

    Y[g][m, p] = act(sum_k W[g][m, k] * X_col[g][k, p] + bias[m] + Z[m, p])

``m`` is the output channel, ``p = oh * OW + ow`` the output pixel, ``k = (c, kh, kw)``
the tap. The weights are packed into the micro-kernel's panels at compile time (a
derived constant of the kernel); ``X_col`` is never built: the library's packing step
reads the image through four small offset tables (per ``k``: channel offset and the
tap's row and column shift; per ``p``: the window's top-left corner) made at compile
time, zero where the tap falls in the padding. A 1x1 convolution with unit strides and
no padding reads ``X`` as the plain ``[C, H*W]`` matrix it is.

A convolution with few output pixels and many output channels (an STFT as a 1-D
convolution: 257 channels, 8 frames) would fill a fraction of the micro-kernel's ``NR``
columns: it runs transposed instead, ``Y^T = X_col^T @ W^T`` (pixels as the rows, the
channels as the columns, ``W^T`` packed at compile time), with ``X_col^T`` gathered into a
heap buffer and the result transposed into ``Y`` (:func:`emit_few_pixels`).

Depthwise convolutions (one input channel per group) stay on the direct kernel
(:mod:`egraft.kernels.cpu.conv`): a product of one row of ``k`` per output channel has
nothing to reuse.

Example: ResNet-50's ``Conv(f32[1, 256, 56, 56], f32[128, 256, 1, 1]) {strides = [2, 2]}``
is one product ``128 x 784 x 256`` whose ``B`` is gathered with stride 2 while packing.
"""

from __future__ import annotations

import numpy as np
from llvmlite import ir

from egraft.ir.dims import dims_equal
from egraft.kernels.cpu.emit import I64, KernelContext, imin, register_packing
from egraft.kernels.cpu.sgemm import (
    BIAS_PER_ROW,
    MAX_SEGMENTS,
    Epilogue,
    blocking,
    emit_call,
    pack_a_constant,
    pack_b_constant,
)


def conv_tables(geo) -> dict[str, np.ndarray]:
    """The implicit-im2col tables of ``geo`` (a :class:`egraft.kernels.cpu.conv.ConvGeometry`),
    for one group: ``k_off``, ``k_h``, ``k_w`` per tap, ``n_h``, ``n_w`` per output pixel,
    ``panel_run`` per panel of ``NR`` pixels (how many runs of output rows its pixels lie
    in; 0 when more than :data:`~egraft.kernels.cpu.sgemm.MAX_SEGMENTS` or the stride is
    over 2) and ``segments``, each run's first and end lane, output row and first column.

    Example: a 3x3 conv with pad 1 on a 4x4 image has ``n_h[0] == n_w[0] == -1`` and
    ``k_off[4] == 1 * 4 + 1`` (the centre tap of channel 0).
    """
    taps = geo.k_h * geo.k_w
    k = np.arange(geo.group_in * taps)
    c, kh, kw = k // taps, (k % taps) // geo.k_w, k % geo.k_w
    k_h = kh * geo.dil_h
    k_w = kw * geo.dil_w
    k_off = c * geo.in_h * geo.in_w + k_h * geo.in_w + k_w
    p = np.arange(geo.out_h * geo.out_w)
    oh, ow = p // geo.out_w, p % geo.out_w
    n_h = oh * geo.stride_h - geo.pad_h
    n_w = ow * geo.stride_w - geo.pad_w
    nr = blocking().nr
    panels = -(-len(p) // nr)
    runs = np.zeros(panels, np.int64)
    segments = np.zeros((panels, MAX_SEGMENTS, 4), np.int64)  # (first lane, end lane, n_h, n_w at the first)
    if geo.stride_w in (1, 2):
        for q in range(panels):
            lo, hi = q * nr, min(q * nr + nr, len(p))
            starts = [j for j in range(lo, hi) if j == lo or oh[j] != oh[j - 1]]
            if len(starts) > MAX_SEGMENTS:
                continue
            runs[q] = len(starts)
            for s, j in enumerate(starts):
                end = starts[s + 1] if s + 1 < len(starts) else hi
                segments[q, s] = (j - lo, end - lo, n_h[j], n_w[j])
    return {"k_off": k_off.astype(np.int64), "k_h": k_h.astype(np.int64), "k_w": k_w.astype(np.int64),
            "n_h": n_h.astype(np.int64), "n_w": n_w.astype(np.int64), "panel_run": runs,
            "segments": segments.reshape(-1)}


@register_packing("conv_gemm.panels", gather=True)
def pack_conv_weights(w: np.ndarray, group: int, mr: int) -> np.ndarray:
    """ONNX weights ``[M, C/group, KH, KW]`` as the products read them: per group, the
    ``[M/group, K]`` matrix in panels of ``mr`` rows (:func:`~egraft.kernels.cpu.sgemm.pack_a_constant`),
    the groups back to back.

    Example:
        >>> pack_conv_weights(np.arange(8, dtype=np.float32).reshape(2, 1, 2, 2), 1, 4)[:4]
        array([0., 4., 0., 0.], dtype=float32)
    """
    rows = np.asarray(w, np.float32).reshape(group, w.shape[0] // group, -1)
    return np.concatenate([pack_a_constant(rows[g], mr) for g in range(group)])


@register_packing("conv_gemm.transposed_panels", gather=True)
def pack_transposed_weights(w: np.ndarray, nr: int) -> np.ndarray:
    """ONNX weights ``[M, C, KH, KW]`` (one group) as ``W^T`` (``[K, M]``) packed for the
    products' ``B`` (:func:`~egraft.kernels.cpu.sgemm.pack_b_constant`): the few-pixels form.

    Example:
        >>> pack_transposed_weights(np.arange(4, dtype=np.float32).reshape(2, 1, 2, 1), 4)[:4]
        array([0., 2., 0., 0.], dtype=float32)
    """
    return pack_b_constant(np.asarray(w, np.float32).reshape(w.shape[0], -1).T, nr)


def few_pixels(ctx: KernelContext, geo, residual: int | None) -> bool:
    """Whether the convolution runs transposed (see the module docstring): one group,
    constant weights, no residual, fewer output pixels than a panel of ``NR`` and at least
    two panels' worth of output channels."""
    blk = blocking()
    return (geo.group == 1 and residual is None and ctx.is_constant(1)
            and geo.out_h * geo.out_w < blk.nr and geo.out_channels >= 2 * blk.nr)


def emit_few_pixels(ctx: KernelContext, geo, bias: int | None, activation: str, params: tuple[float, ...]) -> None:
    """Per image: ``X_col^T`` (pixels x taps, zero in the padding) into a heap buffer, one
    product ``X_col^T @ W^T`` (bias per column, the activation) into another, then its
    transpose into ``Y``. Parts share the panels of output channels: each computes and
    transposes its own (a classifier's 1x1 convolution on one pixel reads 4 MB of weights
    for 2 MFLOP: DenseNet-121's 1024 -> 1000, 0.30 ms at 1 thread and at 2 when it ran whole)."""
    from egraft.kernels.cpu.gemm import heap_buffer, heap_free
    from egraft.kernels.cpu.sgemm import BIAS_PER_COLUMN

    b = ctx.builder
    f32 = ir.FloatType()
    k = geo.channels * geo.k_h * geo.k_w
    pixels, m = geo.out_h * geo.out_w, geo.out_channels
    w_t, _ = ctx.packed_constant("packed_wt", "conv_gemm.transposed_panels", 1, nr=blocking().nr)
    tables = conv_tables(geo)
    rows = tables["n_h"][:, None] + tables["k_h"][None, :]
    columns = tables["n_w"][:, None] + tables["k_w"][None, :]
    padded = bool(((rows < 0) | (rows >= geo.in_h) | (columns < 0) | (columns >= geo.in_w)).any())
    k_off, k_h, k_w = (ctx.derived_constant(name, tables[name]) for name in ("k_off", "k_h", "k_w"))
    x, y = ctx.in_ptr(0), ctx.out_ptr(0)
    bias_ptr = ctx.in_ptr(bias) if bias is not None else None
    a = heap_buffer(ctx, f32, ir.Constant(I64, pixels * k))
    c = heap_buffer(ctx, f32, ir.Constant(I64, pixels * m))
    plane = geo.in_h * geo.in_w
    nr = blocking().nr
    panel_lo, panel_hi = ctx.share(-(-m // nr))  # this part's panels of output channels
    first = b.mul(panel_lo, ir.Constant(I64, nr))
    end = imin(b, b.mul(panel_hi, ir.Constant(I64, nr)), ir.Constant(I64, m))
    columns = b.sub(end, first)

    def const(v: int) -> ir.Constant:
        return ir.Constant(I64, v)

    def load(table: ir.Value, i: ir.Value) -> ir.Value:
        return b.load(b.gep(table, [i]))

    with ctx.loop(ctx.dim(geo.batch), name="image") as image:
        x_image = b.gep(x, [b.mul(image, const(geo.channels * plane))])
        for p in range(pixels):  # few: unrolled
            n_h, n_w = int(tables["n_h"][p]), int(tables["n_w"][p])
            corner = b.gep(x_image, [const(n_h * geo.in_w + n_w)])
            with ctx.loop(const(k), name="tap") as tap:
                at = b.gep(a, [b.add(const(p * k), tap)])
                if padded:
                    row, column = b.add(load(k_h, tap), const(n_h)), b.add(load(k_w, tap), const(n_w))
                    inside = b.and_(b.icmp_unsigned("<", row, const(geo.in_h)),
                                    b.icmp_unsigned("<", column, const(geo.in_w)))
                    with b.if_else(inside) as (then, otherwise):
                        with then:
                            b.store(b.load(b.gep(corner, [load(k_off, tap)])), at)
                        with otherwise:
                            b.store(ir.Constant(f32, 0.0), at)
                else:
                    b.store(b.load(b.gep(corner, [load(k_off, tap)])), at)
        epilogue = Epilogue(bias=b.gep(bias_ptr, [first]) if bias_ptr is not None else None,
                            bias_kind=BIAS_PER_COLUMN, activation=activation, params=params)
        with b.if_then(b.icmp_signed(">", columns, const(0))):
            emit_call(ctx, {"m": pixels, "n": columns, "k": k, "a": a, "a_rs": k, "a_cs": 1,
                            "b": b.gep(w_t, [b.mul(panel_lo, const(nr * k))]), "b_packed": 1,
                            "c": b.gep(c, [first]), "ldc": m}, epilogue, parallel=False)
        y_image = b.mul(image, const(m * pixels))
        with ctx.loop(end, name="channel", start=first) as channel:
            for p in range(pixels):
                value = b.load(b.gep(c, [b.add(const(p * m), channel)]))
                b.store(value, b.gep(y, [b.add(y_image, b.add(b.mul(channel, const(pixels)), const(p)))]))
    heap_free(ctx, a)
    heap_free(ctx, c)


def is_plain_matrix(geo) -> bool:
    """A 1x1 convolution with unit strides and no padding: ``X`` is already ``[C, H*W]``."""
    return (geo.k_h, geo.k_w, geo.stride_h, geo.stride_w, geo.pad_h, geo.pad_w) == (1, 1, 1, 1, 0, 0) \
        and (geo.out_h, geo.out_w) == (geo.in_h, geo.in_w)


def fits(ctx: KernelContext, geo, residual: int | None, activation: str) -> bool:
    """Whether this convolution runs as products: fp32, not depthwise, an activation the
    library applies, a residual of the output's own shape."""
    if ctx.out_type(0).dtype.short != "f32" or any(ctx.in_type(i).dtype.short != "f32" for i in (0, 1)):
        return False
    if geo.group_in == 1 and geo.group > 1:
        return False  # depthwise
    if not Epilogue.fits(activation):
        return False
    return residual_fits(ctx, residual)


def residual_fits(ctx: KernelContext, residual: int | None) -> bool:
    """Whether the library's epilogue can add input ``residual``: none, fp32 of the
    output's own shape, or a constant per output channel (:func:`is_channel_residual`)."""
    if residual is None or is_channel_residual(ctx, residual):
        return True
    z, y = ctx.shape(ctx.in_type(residual)), ctx.shape(ctx.out_type(0))
    same_shape = len(z) == len(y) and all(dims_equal(a, b) for a, b in zip(z, y))
    return same_shape and ctx.in_type(residual).dtype.short == "f32"


def is_channel_residual(ctx: KernelContext, residual: int | None, bias: int | None = None) -> bool:
    """Whether ``residual`` is an fp32 constant that varies along the output's channel axis
    only (a batch normalization's shift, ``[C, 1, 1]``, fused as ``Add``) and the bias a
    constant or absent: the products then add it as part of their bias (as a broadcast
    residual, the convolution ran 5-8x slower as direct loops; Inception-v2's 7x7 stem 21 ms
    against 3 ms). Decided from the types: no value is read."""
    if residual is None or not ctx.is_constant(residual) or (bias is not None and not ctx.is_constant(bias)):
        return False
    y, z = ctx.shape(ctx.out_type(0)), ctx.shape(ctx.in_type(residual))
    if ctx.in_type(residual).dtype.short != "f32" or len(z) > len(y) or len(y) < 2:
        return False
    padded = (1,) * (len(y) - len(z)) + tuple(z)
    return all(d == 1 for k, d in enumerate(padded) if k != 1) and (padded[1] == 1 or dims_equal(padded[1], y[1]))


def _bias_and_residual(ctx: KernelContext, bias: int | None, residual: int | None):
    """The pointers of the per-channel bias and of the residual the products add: a
    constant per-channel residual joins the bias (one constant, ``bias + z``)."""
    if is_channel_residual(ctx, residual, bias):
        channels = ctx.shape(ctx.out_type(0))[1]
        values = np.broadcast_to(np.asarray(ctx.constant(residual), np.float32).reshape(-1), (channels,))
        if bias is not None:
            values = values + np.asarray(ctx.constant(bias), np.float32).reshape(-1)
        return ctx.derived_constant("bias_and_residual", np.ascontiguousarray(values, np.float32)), None
    return (ctx.in_ptr(bias) if bias is not None else None), (ctx.in_ptr(residual) if residual is not None else None)


def emit_conv_gemm(ctx: KernelContext, geo, bias: int | None, residual: int | None, activation: str,
                   params: tuple[float, ...]) -> None:
    """Emit the convolution of ``ctx``'s node as products (see the module docstring);
    :func:`fits` must hold."""
    if few_pixels(ctx, geo, residual):
        emit_few_pixels(ctx, geo, bias, activation, params)
        return
    b = ctx.builder
    k = geo.group_in * geo.k_h * geo.k_w
    pixels = geo.out_h * geo.out_w
    go = geo.group_out
    mr = blocking().mr
    if ctx.is_constant(1):
        a_base, _ = ctx.packed_constant("packed_w", "conv_gemm.panels", 1, group=geo.group, mr=mr)
        a_fields = {"a_packed": 1}
        group_a = (-(-go // mr)) * mr * k
    else:
        a_base, a_fields = ctx.in_ptr(1), {"a_rs": k, "a_cs": 1}
        group_a = go * k
    if is_plain_matrix(geo):
        b_fields = {"b_rs": pixels, "b_cs": 1}
    else:
        tables = {name: ctx.derived_constant(name, array) for name, array in conv_tables(geo).items()}
        b_fields = {"conv": 1, **tables, "run_stride": geo.stride_w, "height": geo.in_h, "width": geo.in_w}
    x, y = ctx.in_ptr(0), ctx.out_ptr(0)
    bias_ptr, z = _bias_and_residual(ctx, bias, residual)
    batch = geo.batch

    def at(ptr: ir.Value, offset: ir.Value) -> ir.Value:
        return b.gep(ptr, [offset])

    def const(v: int) -> ir.Constant:
        return ir.Constant(I64, v)

    plane = geo.in_h * geo.in_w
    with ctx.loop(ctx.dim(batch), name="image") as image:
        for g in range(geo.group):
            x_at = b.add(b.mul(image, const(geo.channels * plane)), const(g * geo.group_in * plane))
            y_at = b.add(b.mul(image, const(geo.out_channels * pixels)), const(g * go * pixels))
            epilogue = Epilogue(bias=at(bias_ptr, const(g * go)) if bias_ptr is not None else None,
                                bias_kind=BIAS_PER_ROW, res=at(z, y_at) if z is not None else None, ldr=pixels,
                                activation=activation, params=params)
            emit_call(ctx, {"m": go, "n": pixels, "k": k, "a": at(a_base, const(g * group_a)), **a_fields,
                            "b": at(x, x_at), **b_fields, "c": at(y, y_at), "ldc": pixels}, epilogue)


__all__ = ["conv_tables", "pack_conv_weights", "pack_transposed_weights", "is_plain_matrix", "fits", "few_pixels",
           "residual_fits", "emit_conv_gemm", "emit_few_pixels"]

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
from egraft.kernels.cpu.emit import I64, KernelContext, register_packing
from egraft.kernels.cpu.sgemm import BIAS_PER_ROW, MAX_SEGMENTS, Epilogue, blocking, emit_call, pack_a_constant


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
    """Whether the library's epilogue can add input ``residual``: none, or fp32 of the
    output's own shape."""
    if residual is None:
        return True
    z, y = ctx.shape(ctx.in_type(residual)), ctx.shape(ctx.out_type(0))
    same_shape = len(z) == len(y) and all(dims_equal(a, b) for a, b in zip(z, y))
    return same_shape and ctx.in_type(residual).dtype.short == "f32"


def emit_conv_gemm(ctx: KernelContext, geo, bias: int | None, residual: int | None, activation: str,
                   params: tuple[float, ...]) -> None:
    """Emit the convolution of ``ctx``'s node as products (see the module docstring);
    :func:`fits` must hold."""
    b = ctx.builder
    k = geo.group_in * geo.k_h * geo.k_w
    pixels = geo.out_h * geo.out_w
    go = geo.group_out
    mr = blocking().mr
    if ctx.constant(1) is not None:
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
    bias_ptr = ctx.in_ptr(bias) if bias is not None else None
    z = ctx.in_ptr(residual) if residual is not None else None
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


__all__ = ["conv_tables", "pack_conv_weights", "is_plain_matrix", "fits", "residual_fits", "emit_conv_gemm"]

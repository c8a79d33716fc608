"""CUDA kernels of ``Conv`` and egraft's ``FusedConv`` (2-D NCHW and 1-D, float32): bias,
residual addend ``Z`` and activation fused into the one launch.

Implicit GEMM on the tile loop of :mod:`egraft.kernels.cuda.gemm`: per channel group,
``Y[oc, (img, oh, ow)] = W[oc, (c, kh, kw)] @ X'[(c, kh, kw), (img, oh, ow)]`` with
M = output channels of the group, N = batch x output pixels (every image in one
product, so small images still fill the tiles) and K = input channels of the group x
taps; the group is the tile loop's batch index. ``X'`` is never built: its reader
decodes a pixel once per thread (image, input row and column of the window's corner)
and each tap ``k`` on the fly (divisions by compile-time constants), reading 0 in the
padding. Consecutive threads read consecutive pixels, so the gather coalesces along a
row; a 1x1, stride-1, unpadded convolution reads ``X`` as the plain matrix it is.

Depthwise convolutions (group = channels, one input channel per group: a product of
depth ``kh x kw`` per output, nothing to tile) have a direct kernel instead: one thread
per output element, consecutive threads along the output row, the taps unrolled.

Example:
    >>> kernel = generate(conv_node, graph)                 # doctest: +SKIP
    >>> [launch.function for launch in kernel.launches]     # doctest: +SKIP
    ['eg_conv']
"""

from __future__ import annotations

from dataclasses import dataclass

import sympy

from egraft.ir.dims import dim_product, dims_equal
from egraft.kernels.cuda import register_kernel
from egraft.kernels.cuda.emit import CudaContext, Unsupported, activation_code
from egraft.kernels.cuda.gemm import (
    FUSED_DOMAIN,
    Operand,
    Term,
    broadcast_strides,
    dense_operand,
    gemm_body,
    gemm_grid,
    pick_tile,
    require_float32,
    strided,
)

#: Threads of a block of the depthwise kernel.
DEPTHWISE_THREADS = 256


@dataclass(frozen=True)
class ConvGeometry:
    """A 2-D convolution's sizes (a 1-D one has height 1): dims of X and Y (ints or sympy),
    the weights' (ints), strides, dilations and the begin pads as C expressions."""

    batch: object
    height: object
    width: object
    out_height: object
    out_width: object
    channels: int
    out_channels: int
    group: int
    kernel: tuple[int, int]
    strides: tuple[int, int]
    dilations: tuple[int, int]
    pad_top: str
    pad_left: str

    @property
    def group_channels(self) -> int:
        return self.channels // self.group

    @property
    def group_out_channels(self) -> int:
        return self.out_channels // self.group

    @property
    def taps(self) -> int:
        return self.kernel[0] * self.kernel[1]

    @property
    def depthwise(self) -> bool:
        return self.group > 1 and self.group_channels == 1

    @property
    def pointwise(self) -> bool:
        """A 1x1, stride-1 convolution without padding: ``X`` per image is a ``C x HW`` matrix."""
        return (self.kernel == (1, 1) and self.strides == (1, 1) and self.pad_top == self.pad_left == "0LL"
                and dims_equal(self.out_height, self.height) and dims_equal(self.out_width, self.width))


def conv_geometry(ctx: CudaContext) -> ConvGeometry:
    """The node's :class:`ConvGeometry`; ``Unsupported`` for 3-D and up, or weights of unknown shape.

    Example:
        >>> conv_geometry(ctx).kernel                          # doctest: +SKIP
        (3, 3)
    """
    x, w, y = ctx.in_shape(0), ctx.in_shape(1), ctx.out_shape(0)
    if len(x) not in (3, 4) or len(w) != len(x) or len(y) != len(x):
        raise Unsupported(f"CUDA convolutions are 1-D or 2-D, not {len(x) - 2}-D")
    if not all(isinstance(d, int) for d in w):
        raise Unsupported(f"the weights' shape {list(w)} is not static")
    nd = len(x) - 2
    group = int(ctx.attr("group", 1))
    strides = list(ctx.attr("strides", None) or [1] * nd)
    dilations = list(ctx.attr("dilations", None) or [1] * nd)
    pads = list(ctx.attr("pads", None) or [0] * 2 * nd)
    kernel = list(w[2:])
    height, width = (x[2], x[3]) if nd == 2 else (1, x[2])
    out_height, out_width = (y[2], y[3]) if nd == 2 else (1, y[2])
    if nd == 1:
        kernel, strides, dilations, pads = [1, *kernel], [1, *strides], [1, *dilations], [0, pads[0], 0, pads[1]]
    auto_pad = ctx.attr("auto_pad", "NOTSET") or "NOTSET"
    begins = [_begin_pad(ctx, auto_pad, pads[i], n, o, strides[i], (kernel[i] - 1) * dilations[i] + 1)
              for i, (n, o) in enumerate(((height, out_height), (width, out_width)))]
    return ConvGeometry(x[0], height, width, out_height, out_width, w[1] * group, w[0], group, tuple(kernel),
                        tuple(strides), tuple(dilations), *begins)


def _begin_pad(ctx: CudaContext, auto_pad: str, pad: int, size, out, stride: int, extent: int) -> str:
    """The begin pad along one axis as a C expression (SAME_* pads depend on the input size)."""
    if auto_pad == "VALID":
        return "0LL"
    if auto_pad not in ("SAME_UPPER", "SAME_LOWER"):
        return ctx.dim(int(pad))
    upper = auto_pad == "SAME_UPPER"
    if isinstance(size, int) and isinstance(out, int):
        total = max(0, (out - 1) * stride + extent - size)
        return ctx.dim(total // 2 if upper else total - total // 2)
    total = f"eg_max(0LL, ({ctx.dim(out)} - 1) * {stride} + {extent} - {ctx.dim(size)})"
    return f"({total} / 2)" if upper else f"({total} - {total} / 2)"


@register_kernel("Conv")
@register_kernel("FusedConv", domain=FUSED_DOMAIN)
def conv_kernel(ctx: CudaContext) -> None:
    """``act(Conv(X, W, B) + Z)``: the implicit GEMM, or the direct depthwise kernel.

    Example:
        >>> generate(depthwise_node, graph).launches[0].function    # doctest: +SKIP
        'eg_conv_depthwise'
    """
    require_float32(ctx)
    geometry = conv_geometry(ctx)
    activation = activation_code(ctx.attr("activation", ""), ctx.attr("activation_params", []), "v")
    z_strides = _z_strides(ctx, geometry)
    if geometry.depthwise:
        _depthwise(ctx, geometry, z_strides, activation)
    else:
        _implicit_gemm(ctx, geometry, z_strides, activation)


def _z_strides(ctx: CudaContext, g: ConvGeometry) -> list | None:
    """Z's strides along ``(N, OC, OH, OW)`` (``None`` without Z)."""
    if ctx.node.op != "FusedConv" or not ctx.has_input(3):
        return None
    out = ctx.out_shape(0)
    shape = ctx.in_shape(3)
    if len(shape) > len(out):
        raise Unsupported(f"Z of rank {len(shape)} does not broadcast to rank {len(out)}")
    strides = broadcast_strides(shape, out)
    return strides if len(out) == 4 else [strides[0], strides[1], 0, strides[2]]


def _prologue(ctx: CudaContext, g: ConvGeometry) -> str:
    """The sizes every conv kernel names, as ``const long long``."""
    return (f"const long long IH = {ctx.dim(g.height)}, IW = {ctx.dim(g.width)};\n"
            f"const long long OH = {ctx.dim(g.out_height)}, OW = {ctx.dim(g.out_width)}, OHW = OH * OW;\n"
            f"const long long PT = {g.pad_top}, PL = {g.pad_left};")


# ---- implicit GEMM -----------------------------------------------------------------------------
def _tap_helper(ctx: CudaContext, g: ConvGeometry) -> str:
    """A ``__device__`` function reading tap ``k`` of the window at ``(ih0, iw0)`` (0 in the padding)."""
    kh, kw = g.kernel
    dh, dw = g.dilations
    name = f"eg_conv_tap_{kh}x{kw}_d{dh}x{dw}"
    ctx.helper(f"""__device__ __forceinline__ float {name}(const float* __restrict__ xp, int k, long long ih0,
        long long iw0, long long ih_n, long long iw_n, long long depth) {{
    if (k >= depth) return 0.0f;
    const int c = k / {g.taps}, r = k - c * {g.taps}, kh = r / {kw}, kw = r - kh * {kw};
    const long long ih = ih0 + kh * {dh}, iw = iw0 + kw * {dw};
    if (ih < 0 || ih >= ih_n || iw < 0 || iw >= iw_n) return 0.0f;
    return xp[((long long)c * ih_n + ih) * iw_n + iw];
}}""")
    return name


def _image_operand(ctx: CudaContext, g: ConvGeometry) -> Operand:
    """The virtual im2col matrix ``X'[(c, kh, kw), (img, oh, ow)]`` of group ``z``."""
    x = ctx.x(0)
    sh, sw = g.strides
    channels, group_channels = g.channels, g.group_channels

    def prepare(slot: str, n: str) -> str:
        lines = [f"const bool ok_{slot} = ({n}) < N;",
                 f"const long long n_{slot} = ok_{slot} ? ({n}) : 0LL;",
                 f"const long long img_{slot} = n_{slot} / OHW, p_{slot} = n_{slot} % OHW;",
                 f"const float* xp_{slot} = {x} + (img_{slot} * {channels} + z * {group_channels}) * IH * IW;"]
        if not g.pointwise:
            lines.append(f"const long long ih_{slot} = p_{slot} / OW * {sh} - PT, "
                         f"iw_{slot} = p_{slot} % OW * {sw} - PL;")
        return "\n".join(lines)

    if g.pointwise:
        def load(slot: str, k: str) -> str:
            return f"(ok_{slot} && ({k}) < K ? xp_{slot}[(long long)({k}) * OHW + p_{slot}] : 0.0f)"
    else:
        tap = _tap_helper(ctx, g)

        def load(slot: str, k: str) -> str:
            return f"(ok_{slot} ? {tap}(xp_{slot}, {k}, ih_{slot}, iw_{slot}, IH, IW, K) : 0.0f)"

    return Operand("x", prepare, load)


def _implicit_gemm(ctx: CudaContext, g: ConvGeometry, z_strides: list | None, activation: str) -> None:
    mg, depth = g.group_out_channels, g.group_channels * g.taps
    pixels = dim_product((g.batch, g.out_height, g.out_width))
    tile = pick_tile(mg, pixels)
    weights = dense_operand(ctx.x(1), f"z * {mg * depth}LL", "M", "K", "K", "1LL", along="k")
    out = Term(ctx.y(0), f"z * {mg}LL * OHW", strided("OHW"), lambda j: f"img_{j} * {g.out_channels}LL * OHW + pix_{j}")
    addends = []
    if ctx.has_input(2):
        addends.append(Term(ctx.x(2), f"z * {mg}LL", strided("1LL"), lambda j: "0LL"))
    if z_strides is not None:
        s0, s1, sh, sw = (ctx.dim(s) for s in z_strides)

        def z_columns(j: int) -> str:
            parts = [] if z_strides[0] == 0 else [f"img_{j} * {s0}"]
            parts.append(_pixel_offset(f"pix_{j}", sh, sw, z_strides, g))
            return " + ".join(p for p in parts if p != "0LL") or "0LL"

        addends.append(Term(ctx.x(3), f"z * {mg}LL * {s1}", strided(s1), z_columns))
    body = gemm_body(tile, f"{mg}LL", ctx.dim(pixels), f"{depth}LL", _prologue(ctx, g), weights,
                     _image_operand(ctx, g), out, addends, activation=activation,
                     column_setup=lambda j: _column_pixel(j, tile.threads_n))
    ctx.function("eg_conv", body, grid=gemm_grid(ctx, tile, mg, pixels, g.group), block=tile.threads)


def _column_pixel(j: int, step: int) -> str:
    """Declare ``img_<j>`` and ``pix_<j>`` (image and pixel) of the thread's output column
    ``j``: one division for the first, then steps of ``step`` columns."""
    if j == 0:
        return "long long img_0 = n_0 / OHW, pix_0 = n_0 - img_0 * OHW;"
    return (f"long long img_{j} = img_{j - 1}, pix_{j} = pix_{j - 1} + {step};\n"
            f"while (pix_{j} >= OHW) {{ pix_{j} -= OHW; ++img_{j}; }}")


def _pixel_offset(pixel: str, sh: str, sw: str, strides: list, g: ConvGeometry) -> str:
    """Z's offset of an output pixel ``oh * OW + ow`` from its (OH, OW) strides."""
    row, col = strides[2], strides[3]
    if row == 0 and col == 0:
        return "0LL"
    one_row = isinstance(g.out_height, int) and g.out_height == 1
    if col != 0 and (one_row or _is_dense(row, col, g)):
        return f"{pixel} * {sw}"  # Z has every pixel (or there is one row): the pixel index scaled
    parts = []
    if row != 0:
        parts.append(f"{pixel} / OW * {sh}")
    if col != 0:
        parts.append(f"{pixel} % OW * {sw}")
    return " + ".join(parts)


def _is_dense(row, col, g: ConvGeometry) -> bool:
    """Whether Z's row stride is ``OW`` times its column stride."""
    return row != 0 and sympy.expand(sympy.sympify(row) - sympy.sympify(col) * g.out_width) == 0


# ---- depthwise ---------------------------------------------------------------------------------
def _depthwise(ctx: CudaContext, g: ConvGeometry, z_strides: list | None, activation: str) -> None:
    """One thread per output element: its ``kh x kw`` taps, unrolled, then bias, Z and activation."""
    kh, kw = g.kernel
    sh, sw = g.strides
    dh, dw = g.dilations
    multiplier = g.out_channels // g.group
    total = dim_product((g.batch, g.out_channels, g.out_height, g.out_width))
    lines = ["float v = acc;"]
    if ctx.has_input(2):
        lines.append(f"v += {ctx.x(2)}[oc];")
    if z_strides is not None:
        s0, s1, sh_z, sw_z = (ctx.dim(s) for s in z_strides)
        parts = [p for p, s in ((f"img * {s0}", z_strides[0]), (f"oc * {s1}", z_strides[1]),
                                (f"oh * {sh_z}", z_strides[2]), (f"ow * {sw_z}", z_strides[3])) if s != 0]
        lines.append(f"v += {ctx.x(3)}[{' + '.join(parts) or '0LL'}];")
    if activation != "v":
        lines.append(f"v = {activation};")
    lines.append(f"{ctx.y(0)}[index] = v;")
    epilogue = "\n".join(lines)
    body = f"""const long long index = (long long)blockIdx.x * {DEPTHWISE_THREADS} + threadIdx.x;
{_prologue(ctx, g)}
const long long total = {ctx.dim(total)};
if (index < total) {{
const long long ow = index % OW, rest = index / OW, oh = rest % OH, rest2 = rest / OH;
const long long oc = rest2 % {g.out_channels}, img = rest2 / {g.out_channels};
const float* xp = {ctx.x(0)} + (img * {g.channels} + oc / {multiplier}) * IH * IW;
const float* wp = {ctx.x(1)} + oc * {g.taps};
const long long ih0 = oh * {sh} - PT, iw0 = ow * {sw} - PL;
float acc = 0.0f;
#pragma unroll
for (int kh = 0; kh < {kh}; ++kh) {{
const long long ih = ih0 + kh * {dh};
if (ih >= 0 && ih < IH) {{
#pragma unroll
for (int kw = 0; kw < {kw}; ++kw) {{
const long long iw = iw0 + kw * {dw};
if (iw >= 0 && iw < IW) acc = fmaf(xp[ih * IW + iw], wp[kh * {kw} + kw], acc);
}}
}}
}}
{epilogue}
}}"""
    ctx.function("eg_conv_depthwise", body, grid=ctx.blocks_for(total, DEPTHWISE_THREADS), block=DEPTHWISE_THREADS)


__all__ = ["ConvGeometry", "conv_geometry", "conv_kernel", "DEPTHWISE_THREADS"]

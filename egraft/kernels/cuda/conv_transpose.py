"""CUDA kernels of ConvTranspose (1-D and 2-D NCHW, float32): strides, pads (explicit,
auto_pad or from ``output_shape``: the registry's geometry), dilations, output_padding,
groups and bias. No atomics: every output element is written once, by the thread that
sums everything reaching it.

Output pixel ``o`` receives input pixel ``i`` through tap ``k`` when ``o + pad = i *
stride + k * dilation``. Split the output by *phase* ``rho = o mod stride``: within a
phase the taps that reach a pixel are always the same, ``k = k0 + step * t`` (``k0`` the
phase's first tap, ``step = stride / gcd(stride, dilation)``), and they read ``i = q + base
- jump * t`` for output ``o = rho + stride * q``. Each phase is then an ordinary
convolution, and the main kernel is an implicit GEMM on the tile loop of
:mod:`egraft.kernels.cuda.gemm`, one product per (group, row phase, column phase) (the
loop's batch index): ``Y[m, (img, qh, qw)] = W'[m, (c, th, tw)] @ X'[(c, th, tw), (img,
qh, qw)]`` with M = output channels of the group, N = images x output pixels of the
phase and K = input channels of the group x taps of the phase (``ceil(kernel / step)``
per axis; taps past the kernel read 0). Neither ``W'`` nor ``X'`` is built: their
readers decode ``k`` on the fly (divisions by constants). Every phase must have as many
pixels as the others (the output's dims multiples of the strides: ``k=4, s=2, p=1``,
``k=2, s=2`` and ``k=3, s=2, p=1, output_padding=1`` all are), and the product must be
worth tiling (at least 16 output channels and 16 of depth).

Everything else (odd output sizes, depthwise upsamplers, few channels) runs the direct
kernel: one thread per output element, 256 per block, consecutive threads along the
output row; the taps are unrolled, a tap that does not land on a stride skipped, the
input channels of the group looped.

Example:
    >>> kernel = generate(conv_transpose_node, graph, 17)   # doctest: +SKIP
    >>> kernel.launches[0].function                         # doctest: +SKIP
    'eg_conv_transpose'
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import sympy

from egraft.ir.dims import dim_product
from egraft.ir.ops.nn_spatial import _conv_transpose_geometry
from egraft.kernels.cuda import register_kernel
from egraft.kernels.cuda.elementwise import static_int
from egraft.kernels.cuda.emit import CudaContext, Unsupported
from egraft.kernels.cuda.gemm import Operand, Term, gemm_body, gemm_grid, pick_tile, require_float32, strided

#: Threads of a block of the direct kernel.
DIRECT_THREADS = 256
#: The implicit GEMM needs at least this many output channels per group, and this much depth.
MIN_GEMM_ROWS = 16
MIN_GEMM_DEPTH = 16


@dataclass(frozen=True)
class TransposeGeometry:
    """A 2-D transposed convolution's sizes (a 1-D one has height 1): the dims of X and Y
    (ints or sympy), the weights' (ints), strides, dilations, and the begin pads (dims)."""

    batch: object
    height: object
    width: object
    out_height: object
    out_width: object
    channels: int
    group_out_channels: int
    group: int
    kernel: tuple[int, int]
    strides: tuple[int, int]
    dilations: tuple[int, int]
    pads: tuple

    @property
    def group_channels(self) -> int:
        return self.channels // self.group

    @property
    def out_channels(self) -> int:
        return self.group_out_channels * self.group

    @property
    def taps(self) -> int:
        return self.kernel[0] * self.kernel[1]

    def phase_step(self, axis: int) -> int:
        """Taps of one phase are this far apart along ``axis``."""
        return self.strides[axis] // math.gcd(self.strides[axis], self.dilations[axis])

    def phase_jump(self, axis: int) -> int:
        """The input index moves back this much per tap of a phase along ``axis``."""
        return self.dilations[axis] // math.gcd(self.strides[axis], self.dilations[axis])

    def phase_taps(self, axis: int) -> int:
        """The most taps a phase has along ``axis``."""
        return -(-self.kernel[axis] // self.phase_step(axis))


def transpose_geometry(ctx: CudaContext) -> TransposeGeometry:
    """The node's :class:`TransposeGeometry`; ``Unsupported`` for 3-D and up, weights of
    unknown shape or channels that do not split into the groups.

    Example:
        >>> transpose_geometry(ctx).strides                  # doctest: +SKIP
        (2, 2)
    """
    x, w, y = ctx.in_shape(0), ctx.in_shape(1), ctx.out_shape(0)
    if len(x) not in (3, 4) or len(w) != len(x) or len(y) != len(x):
        raise Unsupported(f"CUDA transposed convolutions are 1-D or 2-D, not {len(x) - 2}-D")
    if not all(static_int(d) is not None for d in w):
        raise Unsupported(f"the weights' shape {list(w)} is not static")
    w = [static_int(d) for d in w]
    nd = len(x) - 2
    group = int(ctx.attr("group", 1))
    if w[0] % group or (static_int(x[1]) is not None and static_int(x[1]) != w[0]):
        raise Unsupported(f"{x[1]} input channels, weights {w} in {group} groups")
    strides = [int(s) for s in ctx.attr("strides", None) or [1] * nd]
    dilations = [int(d) for d in ctx.attr("dilations", None) or [1] * nd]
    if min(strides + dilations) < 1:
        raise Unsupported(f"strides {strides} and dilations {dilations} must be positive")
    try:
        _, begins, _ = _conv_transpose_geometry(ctx, list(x[2:]), w[2:])
    except ValueError as e:
        raise Unsupported(str(e)) from None
    kernel, spatial, out_spatial = list(w[2:]), list(x[2:]), list(y[2:])
    if nd == 1:
        kernel, strides, dilations, begins = [1, *kernel], [1, *strides], [1, *dilations], [0, *begins]
        spatial, out_spatial = [1, *spatial], [1, *out_spatial]
    return TransposeGeometry(x[0], spatial[0], spatial[1], out_spatial[0], out_spatial[1], w[0], w[1], group,
                             tuple(kernel), tuple(strides), tuple(dilations), tuple(begins))


@register_kernel("ConvTranspose")
def conv_transpose(ctx: CudaContext) -> None:
    """``y[n, m, o] = b[m] + sum over c of m's group and taps k with o + pad = i * stride +
    k * dilation of x[n, c, i] * w[c, m mod M/group, k]``: the phase-split implicit GEMM,
    or the direct kernel.

    Example:
        >>> generate(odd_sized_node, graph, 17).launches[0].function    # doctest: +SKIP
        'eg_conv_transpose_direct'
    """
    require_float32(ctx)
    g = transpose_geometry(ctx)
    depth = g.group_channels * g.phase_taps(0) * g.phase_taps(1)
    phases_even = all(_multiple(d, s) for d, s in zip((g.out_height, g.out_width), g.strides))
    if phases_even and g.group_out_channels >= MIN_GEMM_ROWS and depth >= MIN_GEMM_DEPTH:
        _phase_gemm(ctx, g)
    else:
        _direct(ctx, g)


def _multiple(d, s: int) -> bool:
    """Whether the dim ``d`` is a multiple of ``s`` for every binding of its symbols.

    Example:
        >>> _multiple(sympy.Symbol("h") * 2, 2), _multiple(sympy.Symbol("h") * 2 - 1, 2)
        (True, False)
    """
    if static_int(d) is not None:
        return static_int(d) % s == 0
    e = sympy.expand(sympy.sympify(d))
    if not e.is_polynomial(*e.free_symbols):
        return False
    coefficients = sympy.Poly(e, *e.free_symbols).coeffs()
    return all(c.is_Integer and int(c) % s == 0 for c in coefficients)


def _sizes(ctx: CudaContext, g: TransposeGeometry) -> str:
    """The sizes every kernel here names, as ``const long long``."""
    return (f"const long long IH = {ctx.dim(g.height)}, IW = {ctx.dim(g.width)};\n"
            f"const long long OH = {ctx.dim(g.out_height)}, OW = {ctx.dim(g.out_width)}, OHW = OH * OW;\n"
            f"const long long PT = {ctx.dim(g.pads[0])}, PL = {ctx.dim(g.pads[1])};")


# ---- the phase-split implicit GEMM -------------------------------------------------------------------
def _tap_decode(g: TransposeGeometry) -> str:
    """C statements decoding the depth index ``k`` into channel ``c`` and the taps ``kh``,
    ``kw`` of the phase (``th``, ``tw`` its tap numbers), returning 0 from the helper when
    past the depth or the kernel."""
    th, tw = g.phase_taps(0), g.phase_taps(1)
    return f"""    if (k >= depth || kh0 < 0 || kw0 < 0) return 0.0f;
    const int c = k / {th * tw}, r = k - c * {th * tw}, th = r / {tw}, tw = r - th * {tw};
    const int kh = (int)kh0 + {g.phase_step(0)} * th, kw = (int)kw0 + {g.phase_step(1)} * tw;
    if (kh >= {g.kernel[0]} || kw >= {g.kernel[1]}) return 0.0f;"""


def _helpers(ctx: CudaContext, g: TransposeGeometry) -> tuple[str, str]:
    """The ``__device__`` readers of ``W'`` and ``X'`` (names specific to the geometry)."""
    tag = (f"{g.kernel[0]}x{g.kernel[1]}_s{g.strides[0]}x{g.strides[1]}_d{g.dilations[0]}x{g.dilations[1]}"
           f"_m{g.group_out_channels}")
    weight, pixel = f"eg_convt_weight_{tag}", f"eg_convt_pixel_{tag}"
    ctx.helper(f"""__device__ __forceinline__ float {weight}(const float* __restrict__ wp, int k, long long depth,
        long long kh0, long long kw0) {{
{_tap_decode(g)}
    return wp[(long long)c * {g.group_out_channels * g.taps} + kh * {g.kernel[1]} + kw];
}}""")
    ctx.helper(f"""__device__ __forceinline__ float {pixel}(const float* __restrict__ xp, int k, long long depth,
        long long kh0, long long kw0, int ih0, int iw0, int ih_n, int iw_n) {{
{_tap_decode(g)}
    const int ih = ih0 - {g.phase_jump(0)} * th, iw = iw0 - {g.phase_jump(1)} * tw;
    if (ih < 0 || ih >= ih_n || iw < 0 || iw >= iw_n) return 0.0f;
    return xp[((long long)c * ih_n + ih) * iw_n + iw];
}}""")
    return weight, pixel


def _phase_prologue(ctx: CudaContext, g: TransposeGeometry) -> str:
    """Per block (``z``: group, row phase, column phase): the phase's first taps ``kh0``,
    ``kw0`` (-1: no tap reaches it) and the input offsets ``bh``, ``bw`` of its pixels."""
    sh, sw = g.strides
    lines = [_sizes(ctx, g),
             # at least 1: they only decode columns (an empty output has N = 0, and no column is written)
             f"const long long QH = eg_max(OH / {sh}, 1LL), QW = eg_max(OW / {sw}, 1LL), QHW = QH * QW;",
             "const int ih_n = (int)IH, iw_n = (int)IW;",
             f"const long long grp = z / {sh * sw}, rh = z / {sw} % {sh}, rw = z % {sw};"]
    for name, axis, rho, pad in (("h", 0, "rh", "PT"), ("w", 1, "rw", "PL")):
        s, d = g.strides[axis], g.dilations[axis]
        lines += [f"long long k{name}0 = -1;",
                  f"for (long long k = {g.phase_step(axis) - 1}; k >= 0; --k)",
                  f"    if (eg_mod({rho} + {pad} - k * {d}, {s}) == 0) k{name}0 = k;",
                  f"const long long b{name} = k{name}0 < 0 ? 0LL : ({rho} + {pad} - k{name}0 * {d}) / {s};"]
    return "\n".join(lines)


def _phase_gemm(ctx: CudaContext, g: TransposeGeometry) -> None:
    weight, pixel = _helpers(ctx, g)
    mg, cg = g.group_out_channels, g.group_channels
    sh, sw = g.strides
    depth = cg * g.phase_taps(0) * g.phase_taps(1)
    pixels = dim_product((g.batch, sympy.sympify(g.out_height) / sh, sympy.sympify(g.out_width) / sw))
    tile = pick_tile(mg, pixels)
    w, x = ctx.x(1), ctx.x(0)

    def weight_prepare(slot: str, m: str) -> str:
        return (f"const bool ok_{slot} = ({m}) < M;\n"
                f"const float* wp_{slot} = {w} + (grp * {cg * mg}LL + (ok_{slot} ? ({m}) : 0LL)) * {g.taps};")

    def weight_load(slot: str, k: str) -> str:
        return f"(ok_{slot} ? {weight}(wp_{slot}, {k}, K, kh0, kw0) : 0.0f)"

    def pixel_prepare(slot: str, n: str) -> str:
        return (f"const bool ok_{slot} = ({n}) < N;\n"
                f"const long long n_{slot} = ok_{slot} ? ({n}) : 0LL;\n"
                f"const long long img_{slot} = n_{slot} / QHW, p_{slot} = n_{slot} % QHW;\n"
                f"const int ih_{slot} = (int)(p_{slot} / QW + bh), iw_{slot} = (int)(p_{slot} % QW + bw);\n"
                f"const float* xp_{slot} = {x} + (img_{slot} * {g.channels} + grp * {cg}) * IH * IW;")

    def pixel_load(slot: str, k: str) -> str:
        return f"(ok_{slot} ? {pixel}(xp_{slot}, {k}, K, kh0, kw0, ih_{slot}, iw_{slot}, ih_n, iw_n) : 0.0f)"

    out = Term(ctx.y(0), f"grp * {mg}LL * OHW", strided("OHW"),
               lambda j: f"img_{j} * {g.out_channels}LL * OHW + pix_{j}")
    addends = [Term(ctx.x(2), f"grp * {mg}LL", strided("1LL"), lambda j: "0LL")] if ctx.has_input(2) else []

    def column(j: int) -> str:
        """``img_<j>`` and ``pix_<j>`` (image and output pixel) of the thread's column ``j``:
        divisions for the first, then steps of ``threads_n`` columns."""
        if j == 0:
            position = ("long long img_0 = n_0 / QHW, qh_0 = n_0 % QHW, qw_0 = qh_0 % QW;\n"
                        "qh_0 /= QW;")
        else:
            position = (f"long long img_{j} = img_{j - 1}, qh_{j} = qh_{j - 1}, "
                        f"qw_{j} = qw_{j - 1} + {tile.threads_n};\n"
                        f"while (qw_{j} >= QW) {{ qw_{j} -= QW; ++qh_{j}; }}\n"
                        f"while (qh_{j} >= QH) {{ qh_{j} -= QH; ++img_{j}; }}")
        return position + f"\nconst long long pix_{j} = (rh + {sh} * qh_{j}) * OW + rw + {sw} * qw_{j};"

    body = gemm_body(tile, f"{mg}LL", ctx.dim(pixels), f"{depth}LL", _phase_prologue(ctx, g),
                     Operand("k", weight_prepare, weight_load), Operand("x", pixel_prepare, pixel_load),
                     out, addends, column_setup=column)
    ctx.function("eg_conv_transpose", body, grid=gemm_grid(ctx, tile, mg, pixels, g.group * sh * sw),
                 block=tile.threads)


# ---- the direct kernel --------------------------------------------------------------------------------
def _direct(ctx: CudaContext, g: TransposeGeometry) -> None:
    """One thread per output element: the taps unrolled, the group's input channels looped."""
    kh, kw = g.kernel
    sh, sw = g.strides
    dh, dw = g.dilations
    mg, cg = g.group_out_channels, g.group_channels
    total = dim_product((g.batch, g.out_channels, g.out_height, g.out_width))
    bias = f"{ctx.x(2)}[m]" if ctx.has_input(2) else "0.0f"
    body = f"""const long long index = (long long)blockIdx.x * {DIRECT_THREADS} + threadIdx.x;
{_sizes(ctx, g)}
if (index < {ctx.dim(total)}) {{
    const long long ow = index % OW, rest = index / OW, oh = rest % OH, rest2 = rest / OH;
    const long long m = rest2 % {g.out_channels}, img = rest2 / {g.out_channels};
    const long long grp = m / {mg};
    const float* xp = {ctx.x(0)} + (img * {g.channels} + grp * {cg}) * IH * IW;
    const float* wp = {ctx.x(1)} + (grp * {cg * mg}LL + (m - grp * {mg})) * {g.taps};
    float acc = 0.0f;
    #pragma unroll
    for (int kh = 0; kh < {kh}; ++kh) {{
        const long long th = oh + PT - kh * {dh};
        const long long ih = th / {sh};
        if (th >= 0 && ih * {sh} == th && ih < IH) {{
            #pragma unroll
            for (int kw = 0; kw < {kw}; ++kw) {{
                const long long tw = ow + PL - kw * {dw};
                const long long iw = tw / {sw};
                if (tw >= 0 && iw * {sw} == tw && iw < IW) {{
                    const float* xc = xp + ih * IW + iw;
                    const float* wc = wp + kh * {kw} + kw;
                    for (int c = 0; c < {cg}; ++c) acc = fmaf(xc[c * IH * IW], wc[c * {mg * g.taps}], acc);
                }}
            }}
        }}
    }}
    {ctx.y(0)}[index] = acc + {bias};
}}"""
    ctx.function("eg_conv_transpose_direct", body, grid=ctx.blocks_for(total, DIRECT_THREADS), block=DIRECT_THREADS)


__all__ = ["conv_transpose", "transpose_geometry", "TransposeGeometry", "DIRECT_THREADS"]

"""CUDA kernels of Resize (opsets 10 to 19) and the old Upsample: nearest (every
``nearest_mode``), linear and cubic (``cubic_coeff_a``, ``exclude_outside``) resampling with
the coordinate modes half_pixel, half_pixel_symmetric, pytorch_half_pixel, align_corners,
asymmetric and tf_half_pixel_for_nn, from constant scales or sizes, over symbolic dims.

One thread per output element, a grid-stride loop of 256-thread blocks (consecutive
threads along the output row, so the reads of neighbouring threads are neighbours too).
Each thread decodes its coordinates, then, per resized axis, the source coordinate in
double precision exactly as the reference computes it (:mod:`egraft.ir.ops.nn_spatial`):
with the *given* scale (a constant, even where the dims are symbolic: ``[1, 3, h, w]``
times 2 is ``[1, 3, 2*h, 2*w]`` and reads ``o / 2``), or ``out / in`` from sizes, at run
time when the input's dims are symbolic. Nearest reads one element; linear (2 taps per
axis) and cubic (4) weigh their taps in double, round the weights to float and sum in
float axis by axis, the first resized axis innermost, as the reference does one axis at a
time, so the numbers match it to a few ulps.

Refused: computed scales or sizes, ``antialias``, ``tf_crop_and_resize``, a
``keep_aspect_ratio_policy`` other than stretch, linear or cubic on integers, and more
than 64 taps per output (cubic over 4 axes).

Example:
    >>> kernel = generate(resize_node, graph, 17)     # doctest: +SKIP
    >>> kernel.launches[0].function                   # doctest: +SKIP
    'eg_resize'
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from egraft.ir.dtypes import DType
from egraft.ir.ops.nn_spatial import _input_slots, _resize_axes, _resize_options
from egraft.kernels.cuda import register_kernel
from egraft.kernels.cuda.elementwise import c_dim, decompose, dims_product, same_dim, static_int
from egraft.kernels.cuda.emit import CudaContext, Unsupported
from egraft.kernels.cuda.scatter_gather import grid_stride, strides_of

#: Coordinate transformations with generated code (tf_crop_and_resize, with its roi, has none).
COORDINATE_MODES = ("half_pixel", "half_pixel_symmetric", "pytorch_half_pixel", "align_corners", "asymmetric",
                    "tf_half_pixel_for_nn")
NEAREST_MODES = ("round_prefer_floor", "round_prefer_ceil", "floor", "ceil")
#: At most this many input reads per output element.
MAX_TAPS = 64


@dataclass(frozen=True)
class AxisResize:
    """How one resized axis reads the input: its dims and its scale, a float (given, or
    ``out / in`` of static dims) or ``None`` for ``out / in`` at run time; ``maybe_same``:
    the dims may turn out equal at run time, and then the axis is copied (the reference
    skips an axis whose length and factor do not change)."""

    axis: int
    in_dim: object
    out_dim: object
    scale: float | None
    maybe_same: bool = False


@register_kernel("Resize")
def resize(ctx: CudaContext) -> None:
    """Resize with constant scales or sizes (see the module docstring).

    Example:
        >>> generate(resize_node, graph, 17).launches[0].block    # doctest: +SKIP
        (256, 1, 1)
    """
    _resize(ctx, "Resize")


@register_kernel("Upsample")
def upsample(ctx: CudaContext) -> None:
    """The deprecated Upsample: Resize with asymmetric coordinates (and its old nearest rounding)."""
    _resize(ctx, "Upsample")


def _resize(ctx: CudaContext, op: str) -> None:
    opts = _resize_options(ctx, op)
    if opts.antialias:
        raise Unsupported("Resize with antialias=1")
    if opts.mode not in ("nearest", "linear", "cubic"):
        raise Unsupported(f"Resize mode {opts.mode!r}")
    if opts.coordinate_mode not in COORDINATE_MODES:
        raise Unsupported(f"Resize coordinate_transformation_mode {opts.coordinate_mode!r}")
    if opts.mode == "nearest" and not opts.legacy and opts.nearest_mode not in NEAREST_MODES:
        raise Unsupported(f"Resize nearest_mode {opts.nearest_mode!r}")
    dtype = ctx.in_dtype(0)
    ctype = ctx.ctype(dtype)
    if opts.mode != "nearest" and dtype != DType.FLOAT32:
        raise Unsupported(f"{opts.mode} Resize of {dtype.short}: float32 only")
    resized = resized_axes(ctx, op)
    taps = {"nearest": 1, "linear": 2, "cubic": 4}[opts.mode]
    if taps ** len(resized) > MAX_TAPS:
        raise Unsupported(f"{opts.mode} Resize over {len(resized)} axes ({taps ** len(resized)} taps per output)")
    shape, out_shape = ctx.in_shape(0), ctx.out_shape(0)
    in_strides = strides_of(shape)
    x, y = ctx.x(0), ctx.y(0)

    def body(itype: str) -> list[str]:
        lines = decompose(ctx, out_shape, itype)
        moved = {a.axis for a in resized}
        kept = [f"c{k} * {c_dim(ctx, in_strides[k], itype)}" for k in range(len(shape))
                if k not in moved and static_int(shape[k]) != 1]
        lines.append(f"const {itype} base = {' + '.join(kept) or '0'};")
        for a in resized:
            lines += _axis_code(ctx, a, opts, taps, itype)
        value = _tap_sum(x, resized, taps, in_strides, ctx, itype, weighted=opts.mode != "nearest")
        return [*lines, f"{y}[i] = ({ctype})({value});"]

    grid_stride(ctx, "eg_resize", dims_product(out_shape), [dims_product(shape)], body)


def resized_axes(ctx: CudaContext, op: str) -> list[AxisResize]:
    """The axes the reference resamples (an axis whose length and factor stay is copied),
    with their scales; ``Unsupported`` for computed scales or sizes.

    Example:
        >>> [(a.axis, a.scale) for a in resized_axes(ctx, "Resize")]    # doctest: +SKIP
        [(2, 2.0), (3, 2.0)]
    """
    shape, out_shape = ctx.in_shape(0), ctx.out_shape(0)
    rank = len(shape)
    axes = _resize_axes(ctx, rank) if op == "Resize" else list(range(rank))
    _, scales_slot, sizes_slot = _input_slots(ctx, op)
    sizes = _constant_input(ctx, sizes_slot, "sizes")
    if sizes is not None:
        policy = ctx.attr("keep_aspect_ratio_policy", "stretch") if op == "Resize" and ctx.opset >= 18 else "stretch"
        if policy != "stretch":
            raise Unsupported(f"Resize keep_aspect_ratio_policy {policy!r}")
        out = []
        for a in axes:
            n, m = static_int(shape[a]), static_int(out_shape[a])
            if n is not None and m is not None:
                if n != m and n > 0:
                    out.append(AxisResize(a, shape[a], out_shape[a], m / n))
            elif not same_dim(shape[a], out_shape[a]):
                out.append(AxisResize(a, shape[a], out_shape[a], None, maybe_same=True))
        return out
    scales = ctx.attr("scales", None) if scales_slot is None else _constant_input(ctx, scales_slot, "scales")
    if scales is None:
        raise Unsupported("Resize without constant scales or sizes")
    if len(scales) != len(axes):
        raise Unsupported(f"{len(scales)} scales for {len(axes)} axes")
    return [AxisResize(a, shape[a], out_shape[a], float(np.float32(s)))
            for a, s in zip(axes, scales) if float(np.float32(s)) != 1.0]


def _constant_input(ctx: CudaContext, slot: int | None, what: str) -> list | None:
    """The values of an optional constant input (``None`` when absent or empty);
    ``Unsupported`` when it is computed (and not known to be empty)."""
    if slot is None or not ctx.has_input(slot):
        return None
    value = ctx.constant(slot)
    if value is None:
        shape = ctx.in_shape(slot)
        if len(shape) == 1 and static_int(shape[0]) == 0:
            return None
        raise Unsupported(f"Resize with computed {what}")
    value = np.asarray(value).ravel()
    return value.tolist() if value.size else None


# ---- per-axis code ------------------------------------------------------------------------------
def _double(value: float) -> str:
    return repr(float(value))


def _minus(value: float) -> str:
    """`` - value`` in C (`` + -value`` when it is negative: the same double)."""
    return f" - {_double(value)}" if value >= 0 else f" + {_double(-value)}"


def _divide(e: str, scale: str, constant: float | None) -> str:
    """``e / scale`` in C doubles: a product when the scale is a power of two (exact)."""
    if constant is not None and constant > 0 and math.frexp(constant)[0] == 0.5:
        return f"({e}) * {_double(1.0 / constant)}"
    return f"({e}) / {scale}"


def source_coordinate(mode: str, o: str, n: str, m: str, scale: str, constant: float | None = None) -> str:
    """The C double expression of the input coordinate of output index ``o`` along an axis
    of ``n`` input and ``m`` output elements (doubles) with ``scale``: the reference's
    ``coordinate_transformation_mode`` formulas.

    Example:
        >>> source_coordinate("half_pixel", "o", "n", "m", "s", 2.0)
        '(o + 0.5) * 0.5 - 0.5'
        >>> source_coordinate("asymmetric", "o", "n", "m", "s")
        '(o) / s'
    """
    if mode == "asymmetric":
        return _divide(o, scale, constant)
    if mode == "half_pixel":
        return f"{_divide(f'{o} + 0.5', scale, constant)} - 0.5"
    if mode == "pytorch_half_pixel":
        return f"({m} > 1.0 ? {_divide(f'{o} + 0.5', scale, constant)} - 0.5 : 0.0)"
    if mode == "tf_half_pixel_for_nn":
        return _divide(f"{o} + 0.5", scale, constant)
    if mode == "align_corners":
        width = f"({scale} * {n})"
        return f"({width} == 1.0 ? 0.0 : {o} * ({n} - 1.0) / ({width} - 1.0))"
    if mode == "half_pixel_symmetric":
        offset = f"{n} / 2.0 * (1.0 - {m} / ({scale} * {n}))"
        return f"{offset} + {_divide(f'{o} + 0.5', scale, constant)} - 0.5"
    raise Unsupported(f"Resize coordinate_transformation_mode {mode!r}")


def _axis_code(ctx: CudaContext, a: AxisResize, opts, taps: int, itype: str) -> list[str]:
    """Statements declaring axis ``a``'s tap indices ``i<a>_<t>`` (and float weights ``w<a>_<t>``)."""
    k = a.axis
    n, m = ctx.dim(a.in_dim), ctx.dim(a.out_dim)
    scale = f"s{k}"
    lines = [f"const long long n{k} = {n};",
             f"const double {scale} = {_double(a.scale) if a.scale is not None else f'(double){m} / (double)n{k}'};",
             f"double x{k} = {source_coordinate(opts.coordinate_mode, f'(double)c{k}', f'(double)n{k}', f'(double){m}', scale, a.scale)};"]  # noqa: E501
    same = f"{m} == n{k}" if a.maybe_same else None
    if taps == 1:
        lines.append(f"long long p{k} = (long long){_rounding(opts, f'x{k}', a.scale)};")
        if same:
            lines.append(f"if ({same}) p{k} = c{k};")
        lines.append(f"p{k} = p{k} < 0 ? 0 : (p{k} >= n{k} ? eg_max(n{k} - 1, 0LL) : p{k});")
        lines.append(f"const {itype} i{k}_0 = ({itype})p{k};")
        return lines
    if opts.mode == "linear":  # beyond the edges, linear reads the edge (the reference clamps)
        lines.append(f"x{k} = fmin(fmax(x{k}, 0.0), (double)eg_max(n{k} - 1, 0LL));")
    offsets = [0, 1] if taps == 2 else [-1, 0, 1, 2]
    lines += [f"double b{k} = floor(x{k});",
              f"if (b{k} == x{k}) b{k} = x{k} - 1.0;",  # an exact integer reads with ratio 1
              f"const double r{k} = x{k} - b{k};"]
    for t, off in enumerate(offsets):
        lines.append(f"double v{k}_{t} = {_kernel(ctx, opts, f'{_double(off)} - r{k}')};")
    for t, off in enumerate(offsets):
        lines.append(f"long long p{k}_{t} = (long long)b{k} + {off};")
    if opts.exclude_outside:
        lines.append(f"double sum{k} = 0.0;")
        for t in range(taps):
            lines.append(f"if (p{k}_{t} < 0 || p{k}_{t} >= n{k}) v{k}_{t} = 0.0; sum{k} += v{k}_{t};")
        lines.append(f"if (sum{k} == 0.0) sum{k} = 1.0;")
        lines += [f"v{k}_{t} /= sum{k};" for t in range(taps)]
    if same:  # the reference copies the axis: one tap of weight 1 at the output index
        lines.append(f"if ({same}) {{ " + " ".join(
            f"p{k}_{t} = c{k}; v{k}_{t} = {'1.0' if t == 0 else '0.0'};" for t in range(taps)) + " }")
    for t in range(taps):
        clamp = f"p{k}_{t} < 0 ? 0 : (p{k}_{t} >= n{k} ? n{k} - 1 : p{k}_{t})"
        lines.append(f"const {itype} i{k}_{t} = ({itype})({clamp});")
        lines.append(f"const float w{k}_{t} = (float)v{k}_{t};")
    return lines


def _rounding(opts, x: str, scale: float | None) -> str:
    """The C double expression of nearest's input index (before clamping)."""
    if opts.legacy:  # Upsample / Resize-10: round up when shrinking, truncate when growing
        if scale is None:
            raise Unsupported("Upsample without constant scales")
        return f"ceil({x})" if scale < 1 else f"floor({x})"
    return {"round_prefer_floor": f"ceil({x} - 0.5)", "round_prefer_ceil": f"floor({x} + 0.5)",
            "floor": f"floor({x})", "ceil": f"ceil({x})"}[opts.nearest_mode]


def _kernel(ctx: CudaContext, opts, t: str) -> str:
    """The C double expression of the interpolation kernel at ``t`` (cubic: a helper with
    the reference's coefficients and order of operations)."""
    if opts.mode == "linear":
        return f"fmin(fmax(1.0 - fabs({t}), 0.0), 1.0)"
    a = float(opts.cubic_a)
    ctx.helper(f"""__device__ __forceinline__ double eg_resize_cubic(double t) {{
    t = fabs(t);
    if (t <= 1.0) return ({_double(a + 2)} * t{_minus(a + 3)}) * t * t + 1.0;
    if (t < 2.0) return (({_double(a)} * t{_minus(5 * a)}) * t{_minus(-8 * a)}) * t{_minus(4 * a)};
    return 0.0;
}}""")
    return f"eg_resize_cubic({t})"


def _tap_sum(x: str, resized: list[AxisResize], taps: int, strides: list, ctx: CudaContext, itype: str,
             weighted: bool) -> str:
    """The C expression of the output: the weighted taps summed one axis at a time, the
    first resized axis innermost (the reference's order)."""
    def level(j: int, terms: list[str]) -> str:
        if j < 0:
            return f"{x}[{' + '.join(['base', *terms])}]"
        a = resized[j].axis
        stride = c_dim(ctx, strides[a], itype)
        parts = []
        for t in range(taps):
            inner = level(j - 1, [*terms, f"i{a}_{t}" if static_int(strides[a]) == 1 else f"i{a}_{t} * {stride}"])
            parts.append(f"({inner}) * w{a}_{t}" if weighted else inner)
        return " + ".join(parts)

    return level(len(resized) - 1, [])


__all__ = ["resize", "upsample", "resized_axes", "source_coordinate", "AxisResize", "COORDINATE_MODES"]

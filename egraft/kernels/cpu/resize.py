"""Resize (and the old Upsample): nearest, linear and cubic resampling of static shapes
with constant scales or sizes (and roi); over symbolic dims, nearest upsampling by
whole-number scales (asymmetric coordinates, floor rounding: what detection and OCR
feature pyramids use), the loop bounds read at run time.

The reference kernel's own helpers (:mod:`egraft.ir.ops.nn_spatial`) compute, at compile
time, which input positions each output index of each axis reads and with which weights
(coordinate transformation, nearest rounding, antialiasing, exclude_outside, crop
extrapolation); the tables become constant arrays in the module, and the kernel is a loop
nest over the output with, per element, a small loop over the taps of every resized axis:

    y[o] = sum over taps (t_0, t_1, ...) of  w_0[o_0, t_0] * w_1[o_1, t_1] * ... * x[i_0[o_0, t_0], i_1[o_1, t_1], ...]

Axes that are not resized read their own index with one tap of weight 1.

Example: a 2x bilinear upsampling of ``f32[1, 3, 4, 4]`` reads 2 x 2 taps per output.
"""

from __future__ import annotations

import numpy as np
from llvmlite import ir

from egraft.ir.dims import dim_product
from egraft.ir.ops.nn_spatial import (
    _input_slots,
    _interpolation_taps,
    _nearest_index,
    _resize_axes,
    _resize_options,
    _resize_plan,
    _source_coords,
)
from egraft.kernels.cpu import register_kernel
from egraft.kernels.cpu.emit import I8, I64, KernelContext, Unsupported, is_float, llvm_type


def _constant_or_none(ctx: KernelContext, slot: int | None):
    """A constant optional input as a flat array (``None`` when absent or empty)."""
    if slot is None or not ctx.has_input(slot):
        return None
    value = ctx.constant(slot)
    if value is None:
        raise Unsupported(f"input {slot} of Resize is computed at run time")
    value = np.asarray(value).ravel()
    return value if value.size else None


def _tables(ctx: KernelContext, op: str, shape: list[int]):
    """Per axis: (indices [out, taps], weights [out, taps] or None, outside [out] or None)."""
    opts = _resize_options(ctx, op)
    roi_slot, scales_slot, sizes_slot = _input_slots(ctx, op)
    rank = len(shape)
    axes = _resize_axes(ctx, rank) if op == "Resize" else list(range(rank))
    sizes = _constant_or_none(ctx, sizes_slot)
    scales = ctx.attr("scales") if scales_slot is None else _constant_or_none(ctx, scales_slot)
    policy = ctx.attr("keep_aspect_ratio_policy", "stretch") if op == "Resize" and ctx.opset >= 18 else "stretch"
    if sizes is not None:
        out, factors = _resize_plan(shape, axes, None, [int(v) for v in sizes], policy)
    elif scales is None:
        raise Unsupported("Resize without scales or sizes")
    else:
        out, factors = _resize_plan(shape, axes, [float(np.float32(s)) for s in scales], None, "stretch")
    roi = [0.0] * rank + [1.0] * rank
    given_roi = _constant_or_none(ctx, roi_slot)
    crop = opts.coordinate_mode == "tf_crop_and_resize"
    if given_roi is not None and crop:
        for i, a in enumerate(axes):
            roi[a], roi[rank + a] = float(given_roi[i]), float(given_roi[len(axes) + i])
    tables = []
    for axis in range(rank):
        span = (roi[axis], roi[rank + axis])
        n_in, n_out, factor = shape[axis], int(out[axis]), float(factors[axis])
        if n_out == n_in and factor == 1.0 and (not crop or span == (0.0, 1.0)):
            tables.append((np.arange(n_out, dtype=np.int64)[:, None], None, None))
            continue
        coords = _source_coords(opts, n_out, n_in, factor, span)
        outside = ((coords < 0) | (coords > n_in - 1)) if crop else None
        if outside is not None and not outside.any():
            outside = None
        if opts.mode == "nearest":
            index = np.clip(_nearest_index(opts, coords, factor), 0, max(n_in - 1, 0))
            tables.append((index[:, None], None, outside))
        else:
            index, weights = _interpolation_taps(opts, coords, n_in, factor)
            tables.append((index, weights, outside))
    return opts, [int(d) for d in out], tables


def _global_array(ctx: KernelContext, name: str, element: ir.Type, values) -> ir.Value:
    """A constant array in the module; a pointer to its first element."""
    values = list(values)
    array_type = ir.ArrayType(element, max(len(values), 1))
    g = ir.GlobalVariable(ctx.module, array_type, name=f"{ctx.function.name}.{name}")
    g.global_constant = True
    g.linkage = "internal"
    g.initializer = ir.Constant(array_type, values or [ir.Constant(element, 0)])
    return ctx.builder.gep(g, [ir.Constant(I64, 0), ir.Constant(I64, 0)])


def _integer_scales(ctx: KernelContext, op: str, rank: int) -> list[int] | None:
    """The scale of every axis when all are constant whole numbers (an integer upsampling),
    else ``None``."""
    _, scales_slot, sizes_slot = _input_slots(ctx, op)
    if sizes_slot is not None and _constant_or_none(ctx, sizes_slot) is not None:
        return None
    scales = ctx.attr("scales") if scales_slot is None else _constant_or_none(ctx, scales_slot)
    if scales is None:
        return None
    scales = [float(np.float32(v)) for v in scales]
    axes = _resize_axes(ctx, rank) if op == "Resize" else list(range(rank))
    if len(scales) != len(axes) or not all(v >= 1 and v.is_integer() for v in scales):
        return None
    per_axis = [1] * rank
    for a, v in zip(axes, scales):
        per_axis[a] = int(v)
    return per_axis


def _generate_symbolic_nearest(ctx: KernelContext, op: str, shape: list) -> None:
    """Nearest upsampling by whole-number scales over symbolic dims: output index ``o`` of a
    scaled axis reads input ``o // scale`` (asymmetric coordinates, floor rounding: exactly
    ``floor(o / scale)``); the loop bounds are the runtime dims."""
    opts = _resize_options(ctx, op)
    if opts.legacy or opts.mode != "nearest" or opts.coordinate_mode != "asymmetric" \
            or opts.nearest_mode != "floor" or opts.antialias:
        raise Unsupported("Resize of symbolic dims has generated code only for nearest, asymmetric, floor "
                          f"(this one: {opts.mode}, {opts.coordinate_mode}, {opts.nearest_mode})")
    scales = _integer_scales(ctx, op, len(shape))
    if scales is None:
        raise Unsupported("Resize of symbolic dims has generated code only for constant whole-number scales")
    out = list(ctx.shape(ctx.out_type(0)))
    b = ctx.builder
    x, y = ctx.in_ptr(0), ctx.out_ptr(0)
    in_strides = [ctx.dim(dim_product(shape[a + 1:])) for a in range(len(shape))]
    out_strides = [ctx.dim(dim_product(out[a + 1:])) for a in range(len(out))]

    def nest(axis: int, in_offset, out_offset) -> None:
        if axis == len(out):
            b.store(b.load(b.gep(x, [in_offset])), b.gep(y, [out_offset]))
            return
        with ctx.loop(ctx.dim(out[axis]), name=f"o{axis}") as o:
            source = o if scales[axis] == 1 else b.sdiv(o, ir.Constant(I64, scales[axis]))
            nest(axis + 1, b.add(in_offset, b.mul(source, in_strides[axis])),
                 b.add(out_offset, b.mul(o, out_strides[axis])))

    nest(0, ir.Constant(I64, 0), ir.Constant(I64, 0))


def _generate(ctx: KernelContext, op: str) -> None:
    x_type, y_type = ctx.in_type(0), ctx.out_type(0)
    shape = list(ctx.shape(x_type))
    if not all(isinstance(d, int) for d in shape):
        _generate_symbolic_nearest(ctx, op, shape)
        return
    element = llvm_type(x_type.dtype)
    opts, out, tables = _tables(ctx, op, shape)
    if list(ctx.shape(y_type)) != out:
        raise Unsupported(f"output shape {out} differs from the inferred {list(ctx.shape(y_type))}")
    weighted = any(w is not None for _, w, _ in tables)
    if weighted and not is_float(element):
        raise Unsupported("linear and cubic Resize of integers (rounded by the reference) has no generated code")
    b = ctx.builder
    x, y = ctx.in_ptr(0), ctx.out_ptr(0)
    strides = [int(np.prod(shape[a + 1:])) for a in range(len(shape))]
    axis_tables = []
    for axis, (index, weights, outside) in enumerate(tables):
        taps = index.shape[1]
        idx = _global_array(ctx, f"i{axis}", I64, [ir.Constant(I64, int(v) * strides[axis]) for v in index.ravel()])
        w = None if weights is None else _global_array(
            ctx, f"w{axis}", element, [ir.Constant(element, float(v)) for v in weights.astype(np.float64).ravel()])
        out_of_range = None if outside is None else _global_array(
            ctx, f"o{axis}", I8, [ir.Constant(I8, int(v)) for v in outside])
        axis_tables.append((taps, idx, w, out_of_range))
    extrapolation = ir.Constant(element, float(opts.extrapolation_value)) if is_float(element) \
        else ir.Constant(element, int(opts.extrapolation_value))
    zero = ir.Constant(element, 0.0) if is_float(element) else ir.Constant(element, 0)
    out_strides = [int(np.prod(out[a + 1:])) for a in range(len(out))]

    def nest(axis: int, out_offset, positions: list) -> None:
        if axis == len(out):
            emit_element(out_offset, positions)
            return
        with ctx.loop(out[axis], name=f"o{axis}") as o:
            nest(axis + 1, b.add(out_offset, b.mul(o, ir.Constant(I64, out_strides[axis]))), positions + [o])

    def emit_element(out_offset, positions) -> None:
        acc = ctx.alloca(element, name="acc")
        b.store(zero, acc)

        def taps(axis: int, in_offset, weight) -> None:
            if axis == len(positions):
                value = b.load(b.gep(x, [in_offset]))
                if weight is not None:
                    value = b.fmul(value, weight)
                    b.store(b.fadd(b.load(acc), value), acc)
                else:
                    b.store(value, acc)
                return
            count, idx, w, _ = axis_tables[axis]
            with ctx.loop(count, name=f"t{axis}") as t:
                k = b.add(b.mul(positions[axis], ir.Constant(I64, count)), t)
                here = b.add(in_offset, b.load(b.gep(idx, [k])))
                factor = weight
                if w is not None:
                    tap_weight = b.load(b.gep(w, [k]))
                    factor = tap_weight if factor is None else b.fmul(factor, tap_weight)
                taps(axis + 1, here, factor)

        taps(0, ir.Constant(I64, 0), None)
        result = b.load(acc)
        for axis, (_, _, _, out_of_range) in enumerate(axis_tables):
            if out_of_range is not None:
                flag = b.load(b.gep(out_of_range, [positions[axis]]))
                result = b.select(b.icmp_unsigned("!=", flag, ir.Constant(I8, 0)), extrapolation, result)
        b.store(result, b.gep(y, [out_offset]))

    nest(0, ir.Constant(I64, 0), [])


@register_kernel("Resize")
def resize(ctx: KernelContext) -> None:
    """Resize with constant scales/sizes/roi over static shapes (see the module docstring)."""
    _generate(ctx, "Resize")


@register_kernel("Upsample")
def upsample(ctx: KernelContext) -> None:
    """The deprecated Upsample: Resize with asymmetric coordinates."""
    _generate(ctx, "Upsample")

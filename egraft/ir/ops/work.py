"""Work formulas (:class:`egraft.ir.work.Work`) of the ops whose cost is not one
operation per output element: convolutions and matrix products (2 flops per
multiply-add), Winograd with its transform buffers, attention, reductions, pooling,
normalizations, data movement (no arithmetic) and views (no traffic, no kernel).

Epilogues of the fused ops (bias, residual addend, activation) add one operation per
output element each. Winograd F(2x2, 3x3) does 16 multiply-adds per 2x2 output tile and
input channel instead of 36 (2.25x fewer), but writes and reads back two transform
buffers (V = B^T d B per input tile, M = U * V per output tile): in a bandwidth-poor
profile the direct convolution wins, in a compute-poor one Winograd does.
"""

from __future__ import annotations

import math

from egraft.ir.ops.fused_elementwise import parse_expr
from egraft.ir.registry import register_work
from egraft.ir.work import Work, WorkContext, numel

EGRAFT = "com.egraft"


def _epilogue(ctx: WorkContext, first_optional: int) -> float:
    """One operation per output element for each optional addend present and the activation."""
    present = sum(ctx.has_input(i) for i in range(first_optional, len(ctx.inputs)))
    return float(ctx.out_elems * (present + (1 if ctx.attr("activation", "") else 0)))


def _conv_flops(ctx: WorkContext) -> float:
    """2 * output elements * (input channels per group * kernel size), from W [M, C/g, *K]."""
    w = ctx.inputs[1]
    return 2.0 * ctx.out_elems * (math.prod(w[1:]) if w else 1)


def _conv(family: str):
    def work(ctx: WorkContext) -> Work:
        return Work(_conv_flops(ctx) + _epilogue(ctx, 2), family)
    return work


def _pre_act_conv(ctx: WorkContext) -> Work:
    """PreActConvNCHWc(Xb, W, S, T, B?): the convolution, its epilogue and two operations per
    input element (a multiply-add and the ReLU, as the kernel stages the input it reads)."""
    return Work(_conv_flops(ctx) + 2.0 * ctx.input_elems(0) + _epilogue(ctx, 4), "conv_nchwc")


def _conv_transpose(ctx: WorkContext) -> Work:
    w = ctx.inputs[1]  # [C, M/g, *K]: every input element scatters M/g * K products
    return Work(2.0 * ctx.input_elems(0) * (math.prod(w[1:]) if w else 1) + _epilogue(ctx, 2), "conv")


#: F(2x2, 3x3): input tile 4x4, output tile 2x2; adds of the input (B^T d B) and output (A^T M A) transforms.
_TILE_IN, _TILE_OUT, _INPUT_TRANSFORM_OPS, _OUTPUT_TRANSFORM_OPS = 16, 2, 32, 24


#: The products' fixed cost per accumulator tile (loading and storing it), in steps of their
#: depth (the input channels). Fitted with the profile's winograd efficiency (0.87) on eight
#: 3x3 convolutions (8-56 pixels, 24-256 channels, 2026-12-05): with it, the padded tiles
#: and any efficiency in (0.79, 0.95), extraction picks the faster of Winograd and the
#: blocked direct convolution on all eight.
_PRODUCT_STARTUP = 8


def _winograd(ctx: WorkContext) -> Work:
    """WinogradConv(X, W, U?, B?): products over 16 points per tile (the tiles the CPU kernel's
    products run over: each chunk's rounded up to whole vectors) plus both transforms; traffic
    of X, U (or W when U is computed in the kernel), B, the output and both transform buffers."""
    x, out = ctx.inputs[0], ctx.outputs[0]
    if x is None or out is None or len(out) != 4:
        return Work(float(ctx.out_elems), "winograd")
    n, c = x[0], x[1]
    m, ho, wo = out[1], out[2], out[3]
    tiles = n * math.ceil(ho / _TILE_OUT) * math.ceil(wo / _TILE_OUT)
    from egraft.kernels.cpu.winograd import padded_tiles

    padded = padded_tiles(ho, wo, c, m)  # the products run over whole vectors of tiles per chunk
    product_tiles = tiles if padded is None else n * max(padded, tiles // max(n, 1))
    item = ctx.output_itemsizes[0]
    flops = 2.0 * _TILE_IN * m * (c + _PRODUCT_STARTUP) * product_tiles \
        + _INPUT_TRANSFORM_OPS * c * tiles + _OUTPUT_TRANSFORM_OPS * m * tiles
    flops += ctx.out_elems * (ctx.has_input(3) + (1 if ctx.attr("activation", "") else 0))  # bias, activation
    buffers = (_TILE_IN * c * tiles + _TILE_IN * m * tiles) * item  # V and M, each written then read
    weights = ctx.input_bytes(2) if ctx.has_input(2) else ctx.input_bytes(1)
    if not ctx.has_input(2):
        flops += 2.0 * m * c * (4 * 3 * 3 + 4 * 4 * 3)  # G W G^T per filter, in the kernel
    reads = ctx.input_bytes(0) + weights + ctx.input_bytes(3) + buffers
    return Work(flops, "winograd", reads=reads, writes=ctx.writes + buffers)


def _winograd_weights(ctx: WorkContext) -> Work:
    w = ctx.inputs[0]
    filters = numel(w[:2]) if w else 0
    return Work(2.0 * filters * (4 * 3 * 3 + 4 * 4 * 3), "other")


def _gemm(fused: bool):
    """2 * M * N * K plus the addends: A [M, K] (or [K, M] with transA); ``gemm_fused`` with an
    epilogue (FusedGemm, or a Gemm with C)."""
    def work(ctx: WorkContext) -> Work:
        a = ctx.inputs[0]
        k = (a[0] if ctx.attr("transA", 0) else a[-1]) if a else 1
        family = "gemm_fused" if fused or ctx.has_input(2) else "gemm"
        return Work(2.0 * ctx.out_elems * k + _epilogue(ctx, 2), family)
    return work


def _matmul(first_optional: int, fused: bool = False):
    def work(ctx: WorkContext) -> Work:
        a = ctx.inputs[0]
        k = a[-1] if a else 1
        return Work(2.0 * ctx.out_elems * k + _epilogue(ctx, first_optional), "gemm_fused" if fused else "gemm")
    return work


def _attention(ctx: WorkContext) -> Work:
    """Q [..., S, D] @ Kt [..., D, T], a masked softmax over T (about 5 operations per score), then @ V."""
    q, kt, v = ctx.inputs[0], ctx.inputs[1], ctx.inputs[2]
    if q is None or kt is None or v is None:
        return Work(float(ctx.out_elems), "attention")
    scores = numel(q[:-1]) * kt[-1]
    return Work(2.0 * scores * q[-1] + 5.0 * scores + 2.0 * ctx.out_elems * v[-2], "attention")


def _elementwise_body(ctx: WorkContext) -> Work:
    """One operation per function of the body, per output element."""
    return Work(float(ctx.out_elems * max(_count_calls(parse_expr(ctx.attr("expr", "x0"))), 1)), "elementwise")


def _count_calls(tree) -> int:
    if isinstance(tree, tuple) and tree and tree[0] == "call":
        return 1 + sum(_count_calls(a) for a in tree[2])
    return 0


def _per_input_element(per: float, family: str):
    def work(ctx: WorkContext) -> Work:
        return Work(per * ctx.input_elems(0), family)
    return work


def _per_output_element(per: float, family: str):
    def work(ctx: WorkContext) -> Work:
        return Work(per * ctx.out_elems, family)
    return work


def _pool(ctx: WorkContext) -> Work:
    return Work(float(ctx.out_elems * math.prod(ctx.attr("kernel_shape", [1]) or [1])), "pool")


def _moves(family: str):
    def work(ctx: WorkContext) -> Work:
        return Work(0.0, family)
    return work


#: Operations per gate column per time step besides the products (bias adds, activation, state update).
_RECURRENT_GATE_OPS = 4


def _recurrent(ctx: WorkContext) -> Work:
    """RNN, GRU, LSTM (and the quantized LSTM): ``X`` ``[seq, batch, input]`` (or batch-major)
    times ``W`` and every step's state times ``R``, 2 flops per multiply-add, for every
    direction (``W`` and ``R`` hold ``input`` and ``hidden`` weights for each of the
    ``num_dir * gates * hidden`` gate columns, in either layout), plus the gate arithmetic."""
    x, w, r = ctx.inputs[0], ctx.inputs[1], ctx.inputs[2]
    if x is None or w is None or r is None or len(x) != 3 or len(r) != 3:
        return Work(float(ctx.out_elems), "gemm")
    steps = x[0] * x[1]  # seq * batch
    columns = r[0] * max(r[1], r[2])
    return Work(2.0 * steps * (math.prod(w) + math.prod(r)) + _RECURRENT_GATE_OPS * steps * columns, "gemm")


def _view(ctx: WorkContext) -> Work:
    return Work(0.0, "view", reads=0.0, writes=0.0, launches=0)


def _register() -> None:
    for op in ("Conv", "ConvInteger", "QLinearConv"):
        register_work(op, _conv("conv"))
    register_work("FusedConv", _conv("conv"), EGRAFT)
    register_work("ConvNHWC", _conv("conv_nhwc"), EGRAFT)
    register_work("ConvNCHWc", _conv("conv_nchwc"), EGRAFT)
    register_work("PreActConvNCHWc", _pre_act_conv, EGRAFT)
    register_work("ConvTranspose", _conv_transpose)
    register_work("WinogradConv", _winograd, EGRAFT)
    register_work("WinogradWeights", _winograd_weights, EGRAFT)
    register_work("Gemm", _gemm(fused=False))
    register_work("FusedGemm", _gemm(fused=True), EGRAFT)
    for op in ("MatMul", "MatMulInteger", "QLinearMatMul"):
        register_work(op, _matmul(99))
    register_work("FusedMatMul", _matmul(2, fused=True), EGRAFT)
    register_work("Attention", _attention, EGRAFT)
    for op in ("RNN", "GRU", "LSTM"):
        register_work(op, _recurrent)
    register_work("DynamicQuantizeLSTM", _recurrent, "com.microsoft")
    register_work("Elementwise", _elementwise_body, EGRAFT)
    for op in ("ReduceL1", "ReduceL2", "ReduceLogSum", "ReduceLogSumExp", "ReduceMax", "ReduceMean", "ReduceMin",
               "ReduceProd", "ReduceSum", "ReduceSumSquare", "ArgMax", "ArgMin", "GlobalAveragePool",
               "GlobalMaxPool", "CumSum", "CumProd", "TopK"):
        register_work(op, _per_input_element(1.0, "reduce"))
    for op in ("Softmax", "LogSoftmax", "Hardmax"):
        register_work(op, _per_input_element(4.0, "normalize"))
    for op in ("LayerNormalization", "GroupNormalization", "InstanceNormalization", "RMSNormalization",
               "MeanVarianceNormalization", "LpNormalization", "LRN"):
        register_work(op, _per_input_element(5.0, "normalize"))
    register_work("LayerNorm", _per_input_element(5.0, "normalize"), EGRAFT)
    register_work("BatchNormalization", _per_input_element(2.0, "normalize"))
    for op in ("MaxPool", "AveragePool", "LpPool"):
        register_work(op, _pool)
    register_work("Gelu", _per_output_element(8.0, "elementwise"), EGRAFT)
    for op in ("Transpose", "DepthToSpace", "SpaceToDepth"):
        register_work(op, _moves("layout"))
    register_work("LayoutToBlocked", _moves("layout"), EGRAFT)
    register_work("LayoutFromBlocked", _moves("layout"), EGRAFT)
    for op in ("Concat", "Split", "Slice", "Gather", "GatherElements", "GatherND", "Pad", "Expand", "Tile",
               "Cast", "CastLike", "ConstantOfShape", "ScatterElements", "ScatterND", "Compress", "Trilu",
               "ReverseSequence", "CenterCropPad", "OneHot", "Range", "EyeLike"):
        register_work(op, _moves("data"))
    register_work("Resize", _per_output_element(4.0, "data"))
    for op in ("Reshape", "Squeeze", "Unsqueeze", "Flatten", "Identity", "Dropout", "Shape", "Size"):
        register_work(op, _view)


_register()

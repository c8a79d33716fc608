"""A small transformer encoder written with onnx.helper, in the form PyTorch exports:
symbolic ``batch`` and ``seq`` dims, shape arithmetic through Shape/Gather/Concat,
attention with a mask, both GELU forms, the decomposed and the fused LayerNorm, an
int8 weight through DequantizeLinear.

Example:
    >>> model = encoder_model()                   # doctest: +SKIP
    >>> feeds = encoder_inputs(batch=2, seq=7)    # doctest: +SKIP
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper


class _Builder:
    def __init__(self, seed: int):
        self.rng = np.random.default_rng(seed)
        self.nodes: list[onnx.NodeProto] = []
        self.inits: list[onnx.TensorProto] = []
        self.count = 0

    def name(self, hint: str) -> str:
        self.count += 1
        return f"{hint}_{self.count}"

    def const(self, array: np.ndarray, hint: str = "c") -> str:
        name = self.name(hint)
        self.inits.append(numpy_helper.from_array(np.asarray(array), name))
        return name

    def weight(self, shape: tuple, hint: str, scale: float | None = None) -> str:
        std = scale if scale is not None else 1.0 / np.sqrt(shape[0])
        return self.const(self.rng.normal(0, std, shape).astype(np.float32), hint)

    def op(self, op_type: str, inputs: list[str], hint: str | None = None, n_out: int = 1, **attrs) -> str:
        outs = [self.name(hint or op_type.lower()) for _ in range(n_out)]
        self.nodes.append(helper.make_node(op_type, inputs, outs, name=self.name(op_type), **attrs))
        return outs[0]


def _layernorm_decomposed(b: _Builder, x: str, hidden: int) -> str:
    """ReduceMean, Sub, Pow, ReduceMean, Add, Sqrt, Div, Mul, Add: the pattern exporters emit."""
    axes = b.const(np.array([-1], np.int64), "axes")
    mean = b.op("ReduceMean", [x, axes], keepdims=1)
    centered = b.op("Sub", [x, mean])
    sq = b.op("Pow", [centered, b.const(np.float32(2.0), "two")])
    var = b.op("ReduceMean", [sq, axes], keepdims=1)
    std = b.op("Sqrt", [b.op("Add", [var, b.const(np.float32(1e-5), "eps")])])
    normed = b.op("Div", [centered, std])
    gamma = b.const((1 + 0.1 * b.rng.normal(size=hidden)).astype(np.float32), "ln_gamma")
    beta = b.const((0.1 * b.rng.normal(size=hidden)).astype(np.float32), "ln_beta")
    return b.op("Add", [b.op("Mul", [normed, gamma]), beta])


def _layernorm(b: _Builder, x: str, hidden: int) -> str:
    gamma = b.const((1 + 0.1 * b.rng.normal(size=hidden)).astype(np.float32), "ln_gamma")
    beta = b.const((0.1 * b.rng.normal(size=hidden)).astype(np.float32), "ln_beta")
    return b.op("LayerNormalization", [x, gamma, beta], axis=-1, epsilon=1e-5)


def _gelu_erf(b: _Builder, x: str) -> str:
    """0.5 * x * (1 + erf(x / sqrt(2)))."""
    inner = b.op("Erf", [b.op("Div", [x, b.const(np.float32(np.sqrt(2.0)), "sqrt2")])])
    return b.op("Mul", [b.op("Mul", [x, b.op("Add", [inner, b.const(np.float32(1.0), "one")])]),
                        b.const(np.float32(0.5), "half")])


def _gelu_tanh(b: _Builder, x: str) -> str:
    """0.5 * x * (1 + tanh(sqrt(2/pi) * (x + 0.044715 * x^3)))."""
    cube = b.op("Pow", [x, b.const(np.float32(3.0), "three")])
    inner = b.op("Add", [x, b.op("Mul", [cube, b.const(np.float32(0.044715), "k")])])
    t = b.op("Tanh", [b.op("Mul", [inner, b.const(np.float32(np.sqrt(2 / np.pi)), "c")])])
    return b.op("Mul", [b.op("Mul", [x, b.const(np.float32(0.5), "half")]),
                        b.op("Add", [t, b.const(np.float32(1.0), "one")])])


def _dims(b: _Builder, x: str) -> tuple[str, str]:
    """(batch, seq) of x as 1-element i64 tensors, the way exporters compute them."""
    shape = b.op("Shape", [x])
    batch = b.op("Unsqueeze", [b.op("Gather", [shape, b.const(np.int64(0), "i0")], axis=0),
                               b.const(np.array([0], np.int64), "ax0")])
    seq = b.op("Unsqueeze", [b.op("Gather", [shape, b.const(np.int64(1), "i1")], axis=0),
                             b.const(np.array([0], np.int64), "ax0")])
    return batch, seq


def _attention(b: _Builder, x: str, mask_bias: str, hidden: int, heads: int) -> str:
    head_dim = hidden // heads
    batch, seq = _dims(b, x)
    split_shape = b.op("Concat", [batch, seq, b.const(np.array([heads, head_dim], np.int64), "hd")], axis=0)
    merged_shape = b.op("Concat", [batch, seq, b.const(np.array([hidden], np.int64), "h")], axis=0)

    def project(hint: str) -> str:
        y = b.op("Add", [b.op("MatMul", [x, b.weight((hidden, hidden), f"w{hint}")]),
                         b.weight((hidden,), f"b{hint}", 0.02)])
        return b.op("Transpose", [b.op("Reshape", [y, split_shape])], perm=[0, 2, 1, 3])

    q, k, v = project("q"), project("k"), project("v")
    kt = b.op("Transpose", [k], perm=[0, 1, 3, 2])
    scores = b.op("Div", [b.op("MatMul", [q, kt]), b.const(np.float32(np.sqrt(head_dim)), "scale")])
    probs = b.op("Softmax", [b.op("Add", [scores, mask_bias])], axis=-1)
    context = b.op("Transpose", [b.op("MatMul", [probs, v])], perm=[0, 2, 1, 3])
    merged = b.op("Reshape", [context, merged_shape])
    return b.op("Add", [b.op("MatMul", [merged, b.weight((hidden, hidden), "wo")]), b.weight((hidden,), "bo", 0.02)])


def encoder_model(vocab: int = 64, hidden: int = 32, heads: int = 4, layers: int = 2, max_seq: int = 64,
                  seed: int = 0) -> onnx.ModelProto:
    """A BERT-like encoder with inputs ``input_ids``, ``attention_mask`` (i64[batch, seq])
    and outputs ``hidden_states`` (f32[batch, seq, hidden]) and ``pooled`` (f32[batch, hidden])."""
    b = _Builder(seed)
    embedding = b.weight((vocab, hidden), "tok_emb", 1.0)
    positions = b.weight((max_seq, hidden), "pos_emb", 0.5)
    tokens = b.op("Gather", [embedding, "input_ids"], axis=0)
    seq_len = b.op("Unsqueeze", [b.op("Gather", [b.op("Shape", ["input_ids"]), b.const(np.int64(1), "i1")],
                                      axis=0), b.const(np.array([0], np.int64), "ax0")])
    pos = b.op("Slice", [positions, b.const(np.array([0], np.int64), "zero"), seq_len,
                         b.const(np.array([0], np.int64), "ax0")])
    x = _layernorm_decomposed(b, b.op("Add", [tokens, pos]), hidden)

    # mask: 1 -> 0, 0 -> -10000, shaped [batch, 1, 1, seq]
    mask_f = b.op("Cast", [b.op("Unsqueeze", ["attention_mask", b.const(np.array([1, 2], np.int64), "ax12")])],
                  to=TensorProto.FLOAT)
    keep = b.op("Equal", [mask_f, b.const(np.float32(1.0), "one")])
    mask_bias = b.op("Where", [keep, b.const(np.float32(0.0), "zero_f"), b.const(np.float32(-10000.0), "neg")])

    for layer in range(layers):
        attn = _attention(b, x, mask_bias, hidden, heads)
        x = _layernorm_decomposed(b, b.op("Add", [x, attn]), hidden) if layer == 0 else _layernorm(
            b, b.op("Add", [x, attn]), hidden)
        if layer == 0:
            w1 = b.weight((hidden, 4 * hidden), "w1")
        else:  # an int8 weight, dequantized per output channel
            q = b.rng.integers(-127, 128, (hidden, 4 * hidden)).astype(np.int8)
            scale = (np.abs(b.rng.normal(size=4 * hidden)) * 0.002 + 0.001).astype(np.float32)
            w1 = b.op("DequantizeLinear", [b.const(q, "w1_q"), b.const(scale, "w1_scale")], axis=1)
        h = b.op("Add", [b.op("MatMul", [x, w1]), b.weight((4 * hidden,), "b1", 0.02)])
        h = _gelu_erf(b, h) if layer == 0 else _gelu_tanh(b, h)
        ffn = b.op("Add", [b.op("MatMul", [h, b.weight((4 * hidden, hidden), "w2")]), b.weight((hidden,), "b2", 0.02)])
        x = _layernorm(b, b.op("Add", [x, ffn]), hidden)

    hidden_states = b.op("Identity", [x], hint="hidden_states")
    first = b.op("Gather", [x, b.const(np.int64(0), "i0")], axis=1)
    pooled = b.op("Tanh", [b.op("Gemm", [first, b.weight((hidden, hidden), "wp"), b.weight((hidden,), "bp", 0.02)],
                                transB=1)], hint="pooled")
    b.nodes.append(helper.make_node("Identity", [hidden_states], ["hidden_states"], name="out_hidden"))
    b.nodes.append(helper.make_node("Identity", [pooled], ["pooled"], name="out_pooled"))
    graph = helper.make_graph(
        b.nodes, "test_encoder",
        [helper.make_tensor_value_info("input_ids", TensorProto.INT64, ["batch", "seq"]),
         helper.make_tensor_value_info("attention_mask", TensorProto.INT64, ["batch", "seq"])],
        [helper.make_tensor_value_info("hidden_states", TensorProto.FLOAT, ["batch", "seq", hidden]),
         helper.make_tensor_value_info("pooled", TensorProto.FLOAT, ["batch", hidden])],
        initializer=b.inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)], producer_name="egraft-tests")
    onnx.checker.check_model(model)
    return model


def encoder_inputs(batch: int, seq: int, vocab: int = 64, seed: int = 0) -> dict[str, np.ndarray]:
    """Random token ids and a mask whose last rows have padding."""
    rng = np.random.default_rng(seed)
    ids = rng.integers(0, vocab, (batch, seq)).astype(np.int64)
    mask = np.ones((batch, seq), np.int64)
    for row in range(batch):
        pad = int(rng.integers(0, max(seq // 2, 1)))
        if pad:
            mask[row, seq - pad:] = 0
    return {"input_ids": ids, "attention_mask": mask}

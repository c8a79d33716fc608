"""The op registry: every op the bundled models and the encoder use runs on egraft's own
numpy kernels with native inference (no onnx.reference fallback can hide a legacy-opset
difference there), and the registry's entries are well formed."""

from __future__ import annotations

import onnx
import pytest

import egraft
from egraft.ir.registry import all_ops, get_op
from egraft.testing.encoder import encoder_model
from egraft.testing.models import LIGHT_MODELS, light_model_path

#: Ops named by the foundation issue for transformer, detection/OCR and recurrent models.
REQUIRED = """
Conv ConvTranspose BatchNormalization Relu MaxPool AveragePool GlobalAveragePool Gemm MatMul Softmax
LayerNormalization Gather Erf Gelu Where Expand Reshape Transpose Slice Split Concat Unsqueeze Squeeze
ReduceMean Pow Sqrt Cast Shape Range ConstantOfShape DequantizeLinear MatMulInteger DynamicQuantizeLinear
Resize HardSigmoid HardSwish Sigmoid Clip Pad ArgMax TopK LSTM GRU RNN If Loop Scan LRN Dropout Sum
Flatten Add Mul Sub Div Tanh Identity
""".split()


def _ops_of(graph):
    for node in graph.nodes:
        yield node
        for attr in node.attrs.values():
            if isinstance(attr, egraft.Graph):
                yield from _ops_of(attr)


@pytest.mark.parametrize("op_name", REQUIRED)
def test_required_ops_are_native(op_name):
    op = get_op(op_name)
    assert op is not None and op.infer is not None and op.compute is not None, f"{op_name} falls back to onnx"


@pytest.mark.parametrize("model_name", [*LIGHT_MODELS, "encoder"])
def test_bundled_models_use_no_fallback(model_name):
    model = encoder_model() if model_name == "encoder" else onnx.load(light_model_path(model_name))
    graph = egraft.load(model)
    fallbacks = sorted({n.op for n in _ops_of(graph) if get_op(n.op, n.domain).compute is None})
    assert not fallbacks, f"{model_name} runs {fallbacks} on onnx.reference"


def test_entries_are_unique_and_documented():
    ops = all_ops()
    keys = [(op.domain, op.name) for op in ops]
    assert len(keys) == len(set(keys))
    for op in ops:
        assert op.doc, f"{op.name} has no doc line"
        assert op.compute is not None or op.infer is not None, op.name

"""The test encoder (egraft/testing/encoder.py): symbolic batch and seq through a
transformer as exporters write it, against onnxruntime at several sizes."""

from __future__ import annotations

import pytest
from conftest import run_onnxruntime

import egraft
from egraft.testing.encoder import encoder_inputs, encoder_model
from egraft.testing.models import scale_relative_error


@pytest.fixture(scope="module")
def model():
    return encoder_model()


def test_symbolic_dims_flow_through_the_encoder(model):
    graph = egraft.load(model)
    assert [str(v.type) for v in graph.inputs] == ["i64[batch, seq]", "i64[batch, seq]"]
    assert [str(v.type) for v in graph.outputs] == ["f32[batch, seq, 32]", "f32[batch, 32]"]
    text = str(graph)
    assert "f32[batch, 4, seq, seq] = Softmax" in text
    assert "f32[batch, seq, 32] = Reshape" in text
    assert "_d" not in text, "a dim lost its symbol somewhere in the encoder"
    assert graph.symbols() == ["batch", "seq"]


@pytest.mark.parametrize(("batch", "seq"), [(1, 5), (3, 17), (2, 64)])
def test_encoder_matches_onnxruntime(model, batch, seq):
    graph = egraft.load(model)
    feeds = encoder_inputs(batch, seq, seed=batch * 100 + seq)
    ours = graph.run(feeds)
    reference = run_onnxruntime(model, feeds, exact=True)
    for name, ref in reference.items():
        assert ours[name].shape == ref.shape
        assert scale_relative_error(ours[name], ref) <= 1e-4, name


def test_encoder_export_round_trip(model):
    exported = egraft.to_onnx(egraft.load(model))
    feeds = encoder_inputs(2, 9)
    reference = run_onnxruntime(model, feeds, exact=True)
    again = run_onnxruntime(exported, feeds, exact=True)
    for name, ref in reference.items():
        assert scale_relative_error(again[name], ref) <= 1e-6, name

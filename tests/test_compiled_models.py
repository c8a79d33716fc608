"""The bundled light models and the test encoder, rewritten and compiled to native CPU
code, against onnxruntime on re-weighted weights: every node on generated code."""

from __future__ import annotations

import onnx
import pytest
from conftest import run_onnxruntime

import egraft
from egraft.testing.encoder import encoder_inputs, encoder_model
from egraft.testing.models import (
    LIGHT_MODELS,
    backend_input,
    light_model_path,
    reweight,
    scale_relative_error,
    softmax_logits,
    with_outputs,
)


@pytest.mark.parametrize("name", LIGHT_MODELS)
def test_compiled_light_model_matches_onnxruntime(name):
    source = onnx.load(light_model_path(name))
    model = with_outputs(reweight(source, seed=3), softmax_logits(source))
    feeds = backend_input(source)
    compiled = egraft.compile(model)
    assert compiled.report().fallbacks == []
    got = compiled.run(feeds)
    for key, want in run_onnxruntime(model, feeds).items():
        assert got[key].shape == want.shape and got[key].dtype == want.dtype, key
        assert scale_relative_error(got[key], want) <= 1e-3, key


def test_compiled_encoder_matches_onnxruntime_at_several_shapes():
    model = encoder_model()
    compiled = egraft.compile(model)
    assert compiled.report().fallbacks == []
    for batch, seq in ((1, 5), (3, 17), (2, 64)):
        feeds = encoder_inputs(batch, seq)
        got = compiled.run(feeds)
        for key, want in run_onnxruntime(model, feeds, exact=True).items():
            assert got[key].shape == want.shape, key
            assert scale_relative_error(got[key], want) <= 1e-3, key
    feeds = encoder_inputs(2, 8)
    feeds["attention_mask"] = feeds["attention_mask"][:, :7]
    with pytest.raises(egraft.EgraftError, match=r"input 'attention_mask' has shape \[2, 7\], expected "
                                                 r"\[batch, seq\] with seq=8"):
        compiled.run(feeds)

"""The nine light models of the onnx package: import, print, the shipped expected outputs,
re-weighted models against onnxruntime (logits and every output), and the export round trip.

The shipped weights are ConstantOfShape fills, so their outputs are uniform; the
re-weighted models (seeded He-scaled weights, positive BatchNormalization variances)
are what proves the kernels. The comparison is the project's standard:
max |egraft - onnxruntime| / max |onnxruntime| <= 1e-3.
"""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from conftest import run_onnxruntime

import egraft
from egraft.testing.models import (
    LIGHT_MODELS,
    backend_input,
    light_expected_output,
    light_model_path,
    reweight,
    scale_relative_error,
    softmax_logits,
    with_outputs,
)

TOLERANCE = 1e-3


@pytest.fixture(scope="module", params=LIGHT_MODELS)
def light(request):
    name = request.param
    return name, onnx.load(light_model_path(name))


def test_imports_prints_and_matches_shipped_output(light):
    name, model = light
    graph = egraft.load(model)
    text = str(graph)
    assert text.startswith(f"graph {graph.name}(")
    assert len(text.splitlines()) > len(graph.nodes)
    feeds = backend_input(model)
    out = graph.run(feeds)[graph.outputs[0].name]
    expected = light_expected_output(name)
    assert out.shape == expected.shape
    assert scale_relative_error(out, expected) <= TOLERANCE


def test_reweighted_model_matches_onnxruntime(light):
    name, model = light
    logits = softmax_logits(model)
    reweighted = with_outputs(reweight(model, seed=1), logits)
    feeds = backend_input(model)
    reference = run_onnxruntime(reweighted, feeds)
    graph = egraft.load(reweighted)
    ours = graph.run(feeds)
    assert set(ours) == set(reference)
    for key, ref in reference.items():
        assert np.std(ref) > 0 or ref.size == 1, f"{name}: output {key} is uniform; re-weighting did not reach it"
        err = scale_relative_error(ours[key], ref)
        assert err <= TOLERANCE, f"{name}: output {key}: scale-relative error {err:.2e}"
    for key in logits:
        assert key in ours


def test_export_round_trip_runs_in_onnxruntime(light, tmp_path):
    name, model = light
    reweighted = reweight(model, seed=2)
    feeds = backend_input(model)
    reference = run_onnxruntime(reweighted, feeds)
    path = tmp_path / f"{name}.onnx"
    egraft.save_onnx(egraft.load(reweighted), path)
    exported = onnx.load(path)
    onnx.checker.check_model(exported)
    again = run_onnxruntime(exported, feeds)
    for key, ref in reference.items():
        assert scale_relative_error(again[key], ref) <= 1e-5

"""The egraft command, through typer's runner: output and exit codes."""

from __future__ import annotations

import json

import numpy as np
import onnx
from conftest import run_onnxruntime, symbolic_batch_model
from typer.testing import CliRunner

from egraft.cli import app
from egraft.testing.models import light_model_path, reweight

runner = CliRunner()


def _save(model: onnx.ModelProto, path) -> str:
    path.write_bytes(model.SerializeToString())
    return str(path)


def test_show_prints_ir_histogram_and_symbols(tmp_path):
    path = _save(symbolic_batch_model(), tmp_path / "mlp.onnx")
    result = runner.invoke(app, ["show", path])
    assert result.exit_code == 0, result.output
    assert "%y: f32[batch, 4] = Softmax(%7) {axis=-1}" in result.output
    assert "symbolic dims: batch" in result.output
    assert "MatMul" in result.output


def test_show_json(tmp_path):
    path = _save(symbolic_batch_model(), tmp_path / "mlp.onnx")
    result = runner.invoke(app, ["show", path, "--json"])
    info = json.loads(result.output)
    assert info["symbols"] == ["batch"]
    assert info["outputs"] == {"y": "f32[batch, 4]"}
    assert info["ops"]["Relu"] == 1


def test_show_ops_says_which_ops_fall_back():
    result = runner.invoke(app, ["show", "--ops", "--json"])
    rows = json.loads(result.output)
    by_op = {r["op"]: r for r in rows}
    assert by_op["Add"]["execution"] == "numpy"
    assert by_op["Reshape"]["inference"] == "native"
    assert all(r["execution"] in ("numpy", "onnx.reference") for r in rows)


def test_run_with_inputs_and_check(tmp_path):
    model = symbolic_batch_model()
    path = _save(model, tmp_path / "mlp.onnx")
    x = np.random.default_rng(0).normal(size=(5, 2, 3)).astype(np.float32)
    np.save(tmp_path / "x.npy", x)
    result = runner.invoke(app, ["run", path, "--input", f"x={tmp_path / 'x.npy'}", "--check",
                                 "-o", str(tmp_path / "out")])
    assert result.exit_code == 0, result.output
    assert "egraft vs onnxruntime" in result.output
    saved = np.load(tmp_path / "out" / "y.npy")
    np.testing.assert_allclose(saved, run_onnxruntime(model, {"x": x})["y"], rtol=1e-5)


def test_run_generates_inputs_for_bound_symbols(tmp_path):
    path = _save(symbolic_batch_model(), tmp_path / "mlp.onnx")
    result = runner.invoke(app, ["run", path, "--shape", "batch=3"])
    assert result.exit_code == 0, result.output
    assert "float32[3, 4]" in result.output
    result = runner.invoke(app, ["run", path])
    assert result.exit_code == 2
    assert "unbound dims ['batch']" in result.output


def test_run_check_on_a_reweighted_light_model(tmp_path):
    path = _save(reweight(onnx.load(light_model_path("squeezenet")), seed=3), tmp_path / "squeezenet.onnx")
    result = runner.invoke(app, ["run", path, "--check"])
    assert result.exit_code == 0, result.output
    assert "yes" in result.output and "NO" not in result.output


def test_run_reweight_on_a_bundled_model_by_name(tmp_path):
    result = runner.invoke(app, ["run", "squeezenet", "--reweight", "1", "--check", "-o", str(tmp_path)])
    assert result.exit_code == 0, result.output
    assert "replaced by random values (seed 1)" in result.output
    saved = np.load(next(tmp_path.glob("*.npy")))
    reference = run_onnxruntime(reweight(onnx.load(light_model_path("squeezenet")), seed=1),
                                {"data_0": (np.arange(3 * 224 * 224) / (3 * 224 * 224)).astype(np.float32)
                                 .reshape(1, 3, 224, 224)})
    expected = next(iter(reference.values()))
    assert np.std(expected) > 0
    np.testing.assert_allclose(saved, expected, rtol=1e-3, atol=1e-5)


def test_bad_inputs_exit_2_with_one_line(tmp_path):
    path = _save(symbolic_batch_model(), tmp_path / "mlp.onnx")
    np.save(tmp_path / "wrong.npy", np.zeros((2, 6), np.float32))
    cases = [
        (["run", path, "--input", f"x={tmp_path / 'wrong.npy'}"], "input 'x' has rank 2"),
        (["run", path, "--input", "q=foo.npy"], "the model has no input 'q'"),
        (["run", path, "--input", f"x={tmp_path / 'missing.npy'}"], "cannot read"),
        (["run", path, "--shape", "batch"], "expected NAME=INT"),
        (["show", str(tmp_path / "nothing.onnx")], "no such file"),
    ]
    for args, message in cases:
        result = runner.invoke(app, args)
        assert result.exit_code == 2, (args, result.output)
        assert "error:" in result.output and message in result.output, (args, result.output)
        assert "Traceback" not in result.output


def test_conformance_json_on_a_filter():
    result = runner.invoke(app, ["conformance", "--json", "--filter", "test_relu"])
    assert result.exit_code == 0, result.output
    summary = json.loads(result.output)
    assert summary["full"]["total"] >= 1
    assert summary["per_op"]["Relu"]["pass"] == summary["per_op"]["Relu"]["total"]

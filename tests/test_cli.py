"""The egraft command, through typer's runner: output and exit codes."""

from __future__ import annotations

import json
from pathlib import Path

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


# ---- bad input, as a new user meets it (issue 13) ----------------------------------------------
def _one_error_line(result, message: str, code: int = 2) -> None:
    assert result.exit_code == code, result.output
    assert "Traceback" not in result.output, result.output
    assert message in result.output, result.output


def test_error_lines_keep_bracketed_text(tmp_path):
    path = _save(symbolic_batch_model(), tmp_path / "mlp.onnx")
    np.save(tmp_path / "wrong.npy", np.zeros((2, 6), np.float32))
    result = runner.invoke(app, ["run", path, "--input", f"x={tmp_path / 'wrong.npy'}"])
    _one_error_line(result, "expected rank 3 ([batch, 2, 3])")


def test_rules_list_keeps_bracketed_rule_text(tmp_path):
    rules = tmp_path / "mine.rules"
    rules.write_text("# Mine: one rule.\nruleset mine\n\n# Relu([x]) -> [x] twice\n"
                     "rule relu_twice_bracket:\n    Relu(Relu(x)) => Relu(x)\n")
    result = runner.invoke(app, ["rules", "list", str(rules)])
    assert result.exit_code == 0, result.output
    assert "Relu([x]) -> [x] twice" in result.output


def test_show_table_keeps_a_bracketed_model_name(tmp_path):
    model = symbolic_batch_model()
    model.graph.name = "mlp[v2]"
    result = runner.invoke(app, ["show", _save(model, tmp_path / "mlp.onnx"), "--no-text"])
    assert result.exit_code == 0, result.output
    assert "mlp[v2]: 9 nodes" in result.output


def test_shape_of_an_unknown_dim_is_an_error(tmp_path, monkeypatch):
    monkeypatch.setenv("EGRAFT_CACHE_DIR", str(tmp_path / "cache"))
    path = _save(symbolic_batch_model(), tmp_path / "mlp.onnx")
    message = f"--shape nosuchdim=3: {path} has no symbolic dim 'nosuchdim'; its symbolic dims: batch"
    for command in (["run"], ["run", "--backend", "reference"], ["compile"], ["bench", "--repeat", "1"],
                    ["profile", "-o", str(tmp_path / "t.json")], ["optimize"], ["plan"]):
        result = runner.invoke(app, [command[0], path, "--shape", "nosuchdim=3", *command[1:]])
        _one_error_line(result, message)
    assert not (tmp_path / "cache").exists()  # refused before anything was compiled


def test_wrong_inputs_are_refused_before_compiling(tmp_path, monkeypatch):
    monkeypatch.setenv("EGRAFT_CACHE_DIR", str(tmp_path / "cache"))
    path = _save(symbolic_batch_model(), tmp_path / "mlp.onnx")
    np.save(tmp_path / "f64.npy", np.zeros((8, 2, 3), np.float64))
    np.save(tmp_path / "fixed.npy", np.zeros((8, 2, 5), np.float32))
    cases = [
        (["run", path, "--input", f"x={tmp_path / 'f64.npy'}"],
         "input 'x' has dtype float64, expected float32 (f32[batch, 2, 3])"),
        (["run", path, "--input", f"x={tmp_path / 'fixed.npy'}"], "input 'x'"),
        (["run", path, "--input", "q=foo.npy"], "the model has no input 'q'"),
        (["bench", path], "unbound dims ['batch']"),
        (["profile", path, "-o", str(tmp_path / "t.json")], "unbound dims ['batch']"),
    ]
    for args, message in cases:
        _one_error_line(runner.invoke(app, args), message)
    assert not (tmp_path / "cache").exists()


def test_run_check_fails_on_nan_outputs(tmp_path, monkeypatch):
    from egraft.lowering.runtime import CompiledModel

    run = CompiledModel.run

    def nan_run(self, feeds, profile=None):
        outputs = run(self, feeds, profile)
        outputs["y"][0, 0] = np.nan
        return outputs

    monkeypatch.setenv("EGRAFT_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(CompiledModel, "run", nan_run)
    path = _save(symbolic_batch_model(), tmp_path / "mlp.onnx")
    result = runner.invoke(app, ["run", path, "--shape", "batch=2", "--check"])
    _one_error_line(result, "output 'y': 1 NaN/Inf values where onnxruntime's differ", code=1)
    assert "outputs differ from onnxruntime (non-finite values)" in result.output


def test_output_paths_missing_folders_existing_files_and_wrong_kinds(tmp_path, monkeypatch):
    monkeypatch.setenv("EGRAFT_CACHE_DIR", str(tmp_path / "cache"))
    path = _save(symbolic_batch_model(), tmp_path / "mlp.onnx")
    folder, file = tmp_path / "a_folder", tmp_path / "a_file.txt"
    folder.mkdir()
    file.write_text("keep me")
    refused = [
        (["optimize", path, "-o", str(folder), "--force"], f"{folder} is a folder; give a file path"),
        (["optimize", path, "-o", str(file)], f"{file} exists; pass --force"),
        (["optimize", path, "--plan", str(file / "p.json")], f"{file} is a file, not a folder"),
        (["plan", path, "-o", str(folder), "--force"], f"{folder} is a folder; give a file path"),
        (["compile", path, "-o", str(file), "--force"], f"{file} is a file; give a folder"),
        (["profile", path, "--shape", "batch=1", "-o", str(folder), "--force"], f"{folder} is a folder"),
        (["run", path, "--shape", "batch=1", "-o", str(file)], f"{file} is a file; give a folder"),
    ]
    for args, message in refused:
        _one_error_line(runner.invoke(app, args), message)
    assert file.read_text() == "keep me"
    written = [
        (["optimize", path, "-o", str(tmp_path / "new" / "deeper" / "m.onnx")], tmp_path / "new/deeper/m.onnx"),
        (["plan", path, "-o", str(tmp_path / "plans" / "p.json")], tmp_path / "plans/p.json"),
        (["compile", path, "-o", str(tmp_path / "build" / "b")], tmp_path / "build/b/report.json"),
        (["profile", path, "--shape", "batch=1", "--runs", "1", "-o", str(tmp_path / "traces" / "t.json")],
         tmp_path / "traces/t.json"),
        (["run", path, "--shape", "batch=1", "-o", str(tmp_path / "outs" / "o")], tmp_path / "outs/o/y.npy"),
    ]
    for args, target in written:
        result = runner.invoke(app, args)
        assert result.exit_code == 0, (args, result.output)
        assert target.is_file(), args
    result = runner.invoke(app, ["compile", path, "-o", str(tmp_path / "build" / "b")])
    _one_error_line(result, "module.ll exists; pass --force")
    result = runner.invoke(app, ["run", path, "--shape", "batch=1", "-o", str(tmp_path / "outs" / "o")])
    _one_error_line(result, "y.npy exists; pass --force")
    assert runner.invoke(app, ["compile", path, "-o", str(tmp_path / "build" / "b"), "--force"]).exit_code == 0


# ---- the README's tour runs as written ---------------------------------------------------------
ROOT = Path(__file__).resolve().parent.parent


def _readme_block(command: str) -> list[str]:
    """The output lines that README.md's tour shows under ``$ <command>``."""
    lines = (ROOT / "README.md").read_text().splitlines()
    start = next(k for k, line in enumerate(lines) if line.startswith(f"$ {command}"))
    end = next(k for k in range(start + 1, len(lines)) if lines[k].startswith("$ ") or lines[k] == "```")
    return [line for line in lines[start + 1:end] if line]


def test_readme_tour_show_prints_what_the_readme_shows(monkeypatch):
    monkeypatch.chdir(ROOT)
    result = runner.invoke(app, ["show", "docs/examples/mlp.onnx"])
    assert result.exit_code == 0, result.output
    expected = _readme_block("egraft show docs/examples/mlp.onnx")
    printed = [line.rstrip() for line in result.output.splitlines() if line.strip()]
    table = ("┏", "┃", "┡", "│", "└", "   symbolic_mlp: ", " nodes, ")  # the op table and its title
    text = [line for line in expected if not line.startswith(table)]
    assert [line for line in printed if line in text] == text  # the IR text, constants, symbolic dims
    assert "symbolic dims: batch" in text and "  %y: f32[batch, 4] = Softmax(%7) {axis=-1}" in text
    for op in ("Add", "MatMul", "Softmax", "Unsqueeze"):
        assert any(line.startswith(f"│ {op}") for line in expected) and any(op in line for line in printed)


def test_readme_tour_example_commands_run(tmp_path, monkeypatch):
    monkeypatch.chdir(ROOT)
    monkeypatch.setenv("EGRAFT_CACHE_DIR", str(tmp_path / "cache"))
    np.save(tmp_path / "x.npy", np.ones((8, 2, 3), np.float32))
    commands = [
        ["run", "docs/examples/mlp.onnx", "--input", f"x={tmp_path / 'x.npy'}", "--check"],
        ["run", "docs/examples/mlp.onnx", "--shape", "batch=8"],
        ["optimize", "docs/examples/mlp.onnx", "--rules", "docs/examples/mine.rules", "--rules-off", "fusion",
         "--shape", "batch=1"],
        ["rules", "check", "docs/examples/mine.rules"],
        ["rules", "test", "docs/examples/mine.rules"],
    ]
    for args in commands:
        result = runner.invoke(app, args)
        assert result.exit_code == 0, (args, result.output)
    readme = (ROOT / "README.md").read_text()
    assert "model.onnx" not in readme and "mine.rules --" not in readme.replace("examples/mine.rules", "")
    assert onnx.load(ROOT / "docs/examples/mlp.onnx").graph.name == "symbolic_mlp"

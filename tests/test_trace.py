"""``EGRAFT_TRACE``: the events printed match what the compiler reports through its own API
(the graph's inferred types, the saturation's rule statistics, the compiled model's steps)."""

from __future__ import annotations

import collections
import json
import os
import re
import subprocess
import sys

import numpy as np
import onnx
from onnx import TensorProto, helper

import egraft

EGRAFT = [sys.executable, "-m", "egraft.cli"]
MLP = "docs/examples/mlp.onnx"


def run(args: list[str], trace: str, cwd=None) -> subprocess.CompletedProcess:
    env = dict(os.environ, EGRAFT_TRACE=trace)
    return subprocess.run([*EGRAFT, *args], capture_output=True, text=True, env=env, timeout=300, cwd=cwd)


def events(stderr: str, category: str) -> list[str]:
    prefix = f"[egraft:{category}] "
    return [line[len(prefix):] for line in stderr.splitlines() if line.startswith(prefix)]


def test_shapes_lists_every_node_with_its_inferred_types():
    done = run(["show", MLP], "shapes")
    assert done.returncode == 0, done.stderr
    graph = egraft.load(MLP)
    lines = [e for e in events(done.stderr, "shapes") if not e.startswith("new dim")]
    assert len(lines) == len(graph.nodes)
    for line, node in zip(lines, graph.nodes):
        types = ", ".join(str(v.type) for v in node.outputs if v is not None)
        assert line.endswith(f"-> {types}") and f"= {node.op}(" in line, (line, node.label)


def test_shapes_names_where_a_data_dependent_dim_first_appears(tmp_path):
    graph = helper.make_graph([helper.make_node("NonZero", ["x"], ["idx"], name="nz"),
                               helper.make_node("Transpose", ["idx"], ["y"])], "nonzero",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4])],
                              [helper.make_tensor_value_info("y", TensorProto.INT64, None)])
    path = tmp_path / "nonzero.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), path)
    done = run(["show", str(path)], "shapes")
    assert done.returncode == 0, done.stderr
    new = [e for e in events(done.stderr, "shapes") if e.startswith("new dim")]
    symbol = str(egraft.load(path).nodes[0].outputs[0].type.shape[1])
    assert new == [f"new dim {symbol}: output 0 of NonZero 'nz'"]


def test_rules_prints_one_event_per_application_as_the_report_counts_them():
    done = run(["optimize", "squeezenet", "--json"], "rules")
    assert done.returncode == 0, done.stderr
    counted = collections.Counter(re.match(r"(\S+): round \d+, e-class \d+", e).group(1)
                                  for e in events(done.stderr, "rules"))
    report = json.loads(done.stdout)["rules"]
    assert counted == collections.Counter({name: s["applied"] for name, s in report.items() if s["applied"]})


def test_lower_prints_every_step_as_the_compiled_model_reports_it(tmp_path, monkeypatch):
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", 3])
    graph = helper.make_graph([helper.make_node("Relu", ["x"], ["r"]), helper.make_node("NonZero", ["r"], ["y"])],
                              "g", [x], [helper.make_tensor_value_info("y", TensorProto.INT64, None)])
    path = tmp_path / "g.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), path)
    monkeypatch.setenv("EGRAFT_TRACE", "lower,nonsense")
    compiled = egraft.compile(path, use_cache=False)
    x = np.array([[1, -1, 2]], np.float32)
    np.testing.assert_array_equal(compiled.run({"x": x})["y"], np.array(np.nonzero(np.maximum(x, 0)), np.int64))
    done = run(["compile", str(path), "--no-cache"], "lower,nonsense")
    assert done.returncode == 0, done.stderr
    lines = events(done.stderr, "lower")
    expected = [", ".join(f"%{v.name}" for v in s.node.outputs if v is not None) + f" = {s.node.label} -> {s.kind}"
                + (f": {s.reason}" if s.kind == "fallback" else "") for s in compiled.steps]
    assert lines == expected
    assert "unknown category nonsense; known: shapes, rules, extract, lower, all" in done.stderr


def test_extract_prints_each_choice_cheaper_than_its_alternatives():
    done = run(["optimize", "squeezenet", "--json"], "extract")
    assert done.returncode == 0, done.stderr
    lines = events(done.stderr, "extract")
    choices = [line for line in lines if line.startswith("e-class")]
    assert choices and lines[-1].startswith("greedy (heuristic): program cost")
    assert lines[-1].endswith(f"{len(choices)} e-class(es) with a choice")
    total = float(re.search(r"program cost (\S+),", lines[-1]).group(1))
    assert abs(total - json.loads(done.stdout)["cost"]["total"]) <= 1e-5 * total
    fused = 0
    for line in choices:
        match = re.match(r"e-class e\d+: (\S+)\(.*?\) (\S+) \(own (\S+)\) over (.*)$", line)
        assert match, line
        chosen, cost = match.group(1), float(match.group(2))
        alternatives = [float(c) for c in re.findall(r"\) (\S+)(?:,|$)", match.group(4)) if c != "-"]
        assert all(cost <= alt for alt in alternatives), line  # greedy keeps the cheapest it priced
        fused += chosen.startswith("com.egraft::")
    assert fused >= 10  # squeezenet's convolutions take fused and blocked forms over Conv + Relu

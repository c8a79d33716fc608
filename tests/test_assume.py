"""Shape assumptions (issue 15, item 8): ``egraft.compile(model, assume=[...])`` and
``--assume``: facts the build uses (a divisibility makes exact quotient dims, an equality
unifies two dims), checked on every call; a call that breaks one is refused naming it."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper

import egraft
from egraft.errors import InputError
from egraft.ir.assume import check_assumptions, parse_assumptions, substitutions


def pool_and_add() -> onnx.ModelProto:
    """y = Relu(MaxPool(x, 2x2 stride 2)), s = x + z over x: f32[1, 3, h, w], z: f32[1, 3, hh, w]."""
    nodes = [helper.make_node("MaxPool", ["x"], ["p"], kernel_shape=[2, 2], strides=[2, 2]),
             helper.make_node("Relu", ["p"], ["y"]), helper.make_node("Add", ["x", "z"], ["s"])]
    inputs = [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, "h", "w"]),
              helper.make_tensor_value_info("z", TensorProto.FLOAT, [1, 3, "hh", "w"])]
    outputs = [helper.make_tensor_value_info(n, TensorProto.FLOAT, None) for n in ("y", "s")]
    return helper.make_model(helper.make_graph(nodes, "pool_and_add", inputs, outputs),
                             opset_imports=[helper.make_opsetid("", 17)])


ASSUME = ["h % 2 == 0", "hh == h", "w <= 64"]


@pytest.fixture(scope="module")
def assumed():
    model = pool_and_add()
    return model, egraft.compile(model.SerializeToString(), use_cache=False, assume=ASSUME)


def test_the_build_uses_divisibility_and_equality(assumed):
    _, compiled = assumed
    y, s = (v.type.shape for v in compiled.graph.outputs)
    assert str(y[2]) == "h_q2"  # floor(h/2) with h = 2*h_q2
    assert str(s[2]) == "2*h_q2"  # Max(h, hh) with hh == h
    plain = egraft.compile(pool_and_add().SerializeToString(), use_cache=False)
    assert "Max" in str(plain.graph.outputs[1].type.shape[2]) and "floor" in str(plain.graph.outputs[0].type)
    assert not compiled.report({"h": 4, "hh": 4, "w": 6}).fallbacks


@pytest.mark.parametrize("h, w", [(2, 2), (8, 6), (30, 64)])
def test_calls_within_the_assumptions_match_onnxruntime(assumed, h, w):
    model, compiled = assumed
    rng = np.random.default_rng(h * w)
    feeds = {"x": rng.normal(0, 1, (1, 3, h, w)).astype(np.float32),
             "z": rng.normal(0, 1, (1, 3, h, w)).astype(np.float32)}
    want = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, feeds)
    got = compiled.run(feeds)
    np.testing.assert_array_equal(got["y"], want[0])
    np.testing.assert_array_equal(got["s"], want[1])


@pytest.mark.parametrize("h, hh, w, broken", [(7, 7, 6, "h % 2 == 0"), (8, 4, 6, "hh == h"), (8, 8, 70, "w <= 64")])
def test_a_call_that_breaks_an_assumption_is_refused_naming_it(assumed, h, hh, w, broken):
    _, compiled = assumed
    feeds = {"x": np.zeros((1, 3, h, w), np.float32), "z": np.zeros((1, 3, hh, w), np.float32)}
    with pytest.raises(InputError, match=f"breaks the assumption '{broken}'"):
        compiled.run(feeds)


@pytest.mark.parametrize("text, message", [
    ("h % 2 = 0", "write EXPR OP EXPR"), ("q < 3", "no symbolic dim 'q'"), ("h < 3.5", "3.5 is not an integer"),
    ("h ** 2 < 9", "only dims, integers"), ("3 < 4", "names no symbolic dim"), ("h <", "write EXPR OP EXPR"),
])
def test_bad_assumptions_are_refused_when_compiling(text, message):
    with pytest.raises(InputError, match=message):
        egraft.compile(pool_and_add().SerializeToString(), use_cache=False, assume=[text])


def test_a_shape_that_breaks_an_assumption_is_refused():
    with pytest.raises(InputError, match="h=3 \\(bound by shape\\) breaks the assumption 'h % 2 == 0'"):
        egraft.compile(pool_and_add().SerializeToString(), use_cache=False, shape={"h": 3}, assume=["h % 2 == 0"])


def test_assumption_algebra():
    facts = parse_assumptions(["h % 32 == 0", "seq == 2 * n", "w // 4 >= 2"], {"h", "seq", "n", "w"})
    assert {str(k): str(v) for k, v in substitutions(facts).items()} == {"h": "32*h_q32", "seq": "2*n"}
    assert check_assumptions(facts, {"h": 64, "seq": 6, "n": 3, "w": 8}) == {"h": 64, "seq": 6, "n": 3, "w": 8,
                                                                          "h_q32": 2}
    with pytest.raises(InputError, match="w=7"):
        check_assumptions(facts, {"w": 7})
    assert check_assumptions(facts, {"n": 3}) == {"n": 3}  # facts over unbound dims wait for their dims


def test_the_cli_takes_assume(tmp_path):
    path = tmp_path / "m.onnx"
    onnx.save(pool_and_add(), path)
    run = [sys.executable, "-m", "egraft.cli", "compile", str(path), "--no-cache", "--json"]
    done = subprocess.run(run + ["--assume", "h % 2 == 0"], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["fallbacks"] == []
    done = subprocess.run(run + ["--assume", "hieght % 2 == 0"], capture_output=True, text=True)
    assert done.returncode != 0 and "no symbolic dim 'hieght'" in done.stderr and "Traceback" not in done.stderr

"""Specialization with guards (issue 15, item 3): ``egraft.compile(..., specialize="auto")``
serves a new shape at once on the generic build, builds that shape's variant in a worker
process (through a real compile cache in a temporary folder) and runs the variant once it
is ready; every answer matches onnxruntime."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper

import egraft
import egraft.specializing
from egraft.errors import EgraftError, InputError


def conv_model() -> onnx.ModelProto:
    """y = Relu(Conv(x, w) + b) over x: f32[n, 8, h, w] (3x3, pad 1)."""
    rng = np.random.default_rng(3)
    inits = [onnx.numpy_helper.from_array(rng.normal(0, 0.2, (16, 8, 3, 3)).astype(np.float32), "w"),
             onnx.numpy_helper.from_array(rng.normal(0, 0.2, (16,)).astype(np.float32), "b")]
    nodes = [helper.make_node("Conv", ["x", "w", "b"], ["c"], pads=[1, 1, 1, 1]),
             helper.make_node("Relu", ["c"], ["y"])]
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", 8, "h", "w"])
    graph = helper.make_graph(nodes, "conv", [x], [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("EGRAFT_CACHE_DIR", str(tmp_path / "cache"))  # the worker process inherits it
    return tmp_path / "cache"


def reference(model: onnx.ModelProto, x: np.ndarray) -> np.ndarray:
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return session.run(None, {"x": x})[0]


def test_a_new_shape_runs_generic_at_once_then_its_variant(cache):
    model = conv_model()
    compiled = egraft.compile(model.SerializeToString(), specialize="auto", use_cache=False)
    assert isinstance(compiled, egraft.specializing.SpecializingModel)
    assert compiled.guard_symbols == ["h", "n", "w"]
    x = np.random.default_rng(0).normal(0, 1, (1, 8, 12, 20)).astype(np.float32)
    want = reference(model, x)
    np.testing.assert_allclose(compiled.run({"x": x})["y"], want, rtol=1e-4, atol=1e-5)  # the generic build
    key = (("h", 12), ("n", 1), ("w", 20))
    assert compiled.variants[key] in ("building", "ready")
    compiled.wait(timeout=300)
    assert compiled.variants == {key: "ready"}
    variant = compiled._ready[key]
    assert variant.cache_hit  # built by the worker process, read back from the cache here
    assert [d for d in variant.graph.inputs[0].type.shape] == [1, 8, 12, 20]  # static: the shape's own build
    profile: list = []
    np.testing.assert_allclose(compiled.run({"x": x}, profile=profile)["y"], want, rtol=1e-4, atol=1e-5)
    assert {p.op for p in profile} <= {s.node.op for s in variant.steps}
    assert list(cache.glob("compiled/*.json")), "the variant went through the compile cache"
    # another shape: the generic build again, correct, while its own variant builds
    x2 = np.random.default_rng(1).normal(0, 1, (2, 8, 5, 7)).astype(np.float32)
    np.testing.assert_allclose(compiled.run({"x": x2})["y"], reference(model, x2), rtol=1e-4, atol=1e-5)
    compiled.wait(timeout=300)
    assert compiled.variants[(("h", 5), ("n", 2), ("w", 7))] == "ready"


def test_a_variant_goes_to_the_cache_of_the_compile_that_asked_for_it(tmp_path, monkeypatch):
    """$EGRAFT_CACHE_DIR changes (another test's cache, another job's) between the call that asks for a
    variant and its build: the worker still builds into the first folder, and the variant is read
    back from there; the second folder gets nothing."""
    first, second = tmp_path / "first", tmp_path / "second"
    monkeypatch.setenv("EGRAFT_CACHE_DIR", str(first))
    model = conv_model()
    compiled = egraft.compile(model.SerializeToString(), specialize="auto", use_cache=False)
    x = np.random.default_rng(5).normal(0, 1, (1, 8, 6, 9)).astype(np.float32)
    with egraft.specializing._ONE_BUILD:  # the build waits until the environment has changed
        compiled.run({"x": x})
        monkeypatch.setenv("EGRAFT_CACHE_DIR", str(second))
    compiled.wait(timeout=300)
    key = (("h", 6), ("n", 1), ("w", 9))
    assert compiled.variants == {key: "ready"}
    assert compiled._ready[key].cache_hit  # read back from the folder the worker wrote to
    assert list(first.glob("compiled/*.json"))
    assert not second.exists() or not list(second.rglob("*.json"))
    np.testing.assert_allclose(compiled.run({"x": x})["y"], reference(model, x), rtol=1e-4, atol=1e-5)


def test_bindings_past_the_limit_stay_generic(cache, monkeypatch):
    monkeypatch.setattr(egraft.specializing, "MAX_VARIANTS", 1)
    model = conv_model()
    compiled = egraft.compile(model.SerializeToString(), specialize="auto", use_cache=False)
    shapes = [(1, 8, 4, 4), (1, 8, 6, 3)]
    for shape in shapes:
        x = np.random.default_rng(sum(shape)).normal(0, 1, shape).astype(np.float32)
        np.testing.assert_allclose(compiled.run({"x": x})["y"], reference(model, x), rtol=1e-4, atol=1e-5)
    compiled.wait(timeout=300)
    assert compiled.variants == {(("h", 4), ("n", 1), ("w", 4)): "ready",
                                 (("h", 6), ("n", 1), ("w", 3)): "generic (variant limit reached)"}


def test_wrong_inputs_are_still_refused_by_name(cache):
    compiled = egraft.compile(conv_model().SerializeToString(), specialize="auto", use_cache=False)
    with pytest.raises(InputError, match="x"):
        compiled.run({"x": np.zeros((1, 3, 4, 4), np.float32)})  # 3 channels, not 8
    with pytest.raises(InputError):
        compiled.run({"x": np.zeros((8, 4, 4), np.float32)})  # rank 3: no binding, the generic build says why
    assert compiled.variants == {}  # no binding: nothing to build


def test_specialize_settings():
    with pytest.raises(EgraftError, match="specialize='always'"):
        egraft.compile(conv_model().SerializeToString(), specialize="always", use_cache=False)
    graph = conv_model().graph
    static = helper.make_model(helper.make_graph(
        graph.node, "static", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 8, 4, 4])], graph.output,
        graph.initializer), opset_imports=[helper.make_opsetid("", 17)])
    compiled = egraft.compile(static.SerializeToString(), specialize="auto", use_cache=False)
    assert not isinstance(compiled, egraft.specializing.SpecializingModel)  # no symbolic dims: nothing to specialize


def test_auto_is_the_default_and_the_environment_can_turn_it_off(monkeypatch):
    """Without ``specialize=``, a model with symbolic input dims builds variants
    (``$EGRAFT_SPECIALIZE`` unset); ``EGRAFT_SPECIALIZE=off`` keeps the one generic build,
    and a value that is neither is refused naming the variable."""
    model = conv_model().SerializeToString()
    monkeypatch.delenv("EGRAFT_SPECIALIZE")
    assert isinstance(egraft.compile(model, use_cache=False), egraft.specializing.SpecializingModel)
    monkeypatch.setenv("EGRAFT_SPECIALIZE", "off")
    assert not isinstance(egraft.compile(model, use_cache=False), egraft.specializing.SpecializingModel)
    monkeypatch.setenv("EGRAFT_SPECIALIZE", "sometimes")
    with pytest.raises(EgraftError, match=r"\$EGRAFT_SPECIALIZE='sometimes'"):
        egraft.compile(model, use_cache=False)


def mode_model() -> onnx.ModelProto:
    """y = Tanh(x) if mode == 1 else Neg(x) * 2 (x: f32[n, 4], mode: i64[]); silero's
    If on its sample rate."""
    then = helper.make_graph([helper.make_node("Tanh", ["x"], ["t"])], "then", [],
                             [helper.make_tensor_value_info("t", TensorProto.FLOAT, None)])
    other = helper.make_graph([helper.make_node("Neg", ["x"], ["g"]), helper.make_node("Mul", ["g", "two"], ["e"])],
                              "other", [], [helper.make_tensor_value_info("e", TensorProto.FLOAT, None)])
    nodes = [helper.make_node("Equal", ["mode", "one"], ["is1"]),
             helper.make_node("If", ["is1"], ["y"], then_branch=then, else_branch=other)]
    inputs = [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", 4]),
              helper.make_tensor_value_info("mode", TensorProto.INT64, [])]
    inits = [helper.make_tensor("one", TensorProto.INT64, [], [1]),
             helper.make_tensor("two", TensorProto.FLOAT, [], [2])]
    graph = helper.make_graph(nodes, "mode", inputs, [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
                              inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def test_an_input_that_decides_an_if_is_part_of_the_guard(cache):
    """A one-element integer input that an If's condition is computed from (silero's sample
    rate) keys the variants by its value too: each variant runs its branch inline (no
    control step); a call with another value runs the generic build, then its own variant."""
    model = mode_model()
    compiled = egraft.compile(model.SerializeToString(), specialize="auto")
    assert compiled.guard_values == ["mode"] and compiled.guard_symbols == ["n"]
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    x = np.random.default_rng(1).normal(0, 1, (3, 4)).astype(np.float32)
    for mode in (1, 0, 1):
        feeds = {"x": x, "mode": np.array(mode, np.int64)}
        for _ in range(2):
            np.testing.assert_allclose(compiled.run(feeds)["y"], session.run(None, feeds)[0], rtol=1e-6)
            compiled.wait(timeout=300)
    assert set(compiled.variants) == {(("=mode", 1), ("n", 3)), (("=mode", 0), ("n", 3))}
    for key, variant in compiled.built.items():
        assert variant.report().controls == 0, key  # the If is its branch
        assert {s.node.op for s in variant.steps} & ({"Tanh"} if key[0][1] == 1 else {"Neg", "Elementwise", "Mul"})


def test_values_bind_an_input_and_refuse_what_is_not_a_setting():
    model = mode_model().SerializeToString()
    bound = egraft.compile(model, values={"mode": 0}, specialize="off", use_cache=False)
    x = np.linspace(-1, 1, 8, dtype=np.float32).reshape(2, 4)
    np.testing.assert_allclose(bound.run({"x": x, "mode": np.array(0, np.int64)})["y"], -2 * x, rtol=1e-6)
    assert bound.report().controls == 0
    with pytest.raises(InputError, match=r"'x' is not an integer or bool input of one element; those are \['mode'\]"):
        egraft.compile(model, values={"x": 1}, specialize="off", use_cache=False)
    with pytest.raises(InputError, match="does not fit its dtype"):
        egraft.compile(model, values={"mode": 1.5}, specialize="off", use_cache=False)

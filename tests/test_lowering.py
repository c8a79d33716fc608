"""Lowering and the runtime: memory planning, views, reference fallbacks (also of
data-dependent shapes), threads, the compile cache and the compile/bench/profile/cache
commands, checked against onnxruntime and numpy."""

from __future__ import annotations

import gc
import json
import re
import threading

import llvmlite.binding as llvm
import numpy as np
import onnx
import pytest
from conftest import run_onnxruntime, symbolic_batch_model
from hypothesis import given, settings
from hypothesis import strategies as st
from onnx import TensorProto, helper, numpy_helper
from typer.testing import CliRunner

import egraft
from egraft.cli import app
from egraft.errors import EgraftError
from egraft.lowering.compile import compile_graph, lower
from egraft.lowering.memory import ALIGNMENT, assign_offsets
from egraft.lowering.runtime import MIN_PARALLEL_WORK
from egraft.optimize import optimize
from egraft.testing.models import (
    backend_input,
    light_model_path,
    reweight,
    scale_relative_error,
    softmax_logits,
    with_outputs,
)

runner = CliRunner()


# ---- memory planning ------------------------------------------------------------------------
def test_assign_offsets_reuses_memory_of_dead_buffers():
    offsets, peak = assign_offsets([100, 100, 100], [(0, 1), (1, 2), (2, 3)])
    assert offsets == [0, 128, 0] and peak == 256  # the third reuses the first one's bytes (64-byte aligned)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 5000), st.integers(0, 30), st.integers(0, 10)), min_size=1, max_size=40))
def test_assign_offsets_never_overlaps_live_buffers(buffers):
    sizes = [s for s, _, _ in buffers]
    lifetimes = [(first, first + length) for _, first, length in buffers]
    offsets, peak = assign_offsets(sizes, lifetimes)
    for a in range(len(sizes)):
        assert offsets[a] % ALIGNMENT == 0 and offsets[a] + sizes[a] <= peak
        for b in range(a):
            live_together = lifetimes[a][0] <= lifetimes[b][1] and lifetimes[b][0] <= lifetimes[a][1]
            disjoint = offsets[a] + sizes[a] <= offsets[b] or offsets[b] + sizes[b] <= offsets[a]
            assert not live_together or disjoint, (a, b)
    # Never more than every buffer side by side, never less than what is alive at once.
    assert peak <= sum(-(-s // ALIGNMENT) * ALIGNMENT for s in sizes)
    most_alive = max(sum(s for s, (f, last) in zip(sizes, lifetimes) if f <= t <= last) for t in range(41))
    assert peak >= most_alive


def test_resnet50_memory_plan_reuses_buffers():
    compiled = compile_graph(optimize(egraft.load(light_model_path("resnet50"))).graph)
    report = compiled.report()
    assert report.peak_bytes <= 0.6 * report.no_reuse_bytes
    # The largest activation (64 x 112 x 112 floats) must fit.
    assert report.peak_bytes >= 64 * 112 * 112 * 4


# ---- views, fallbacks, symbolic dims ----------------------------------------------------------
def _nonzero_model() -> onnx.ModelProto:
    """y = Relu(Gather(x, NonZero(x > 0)[0]) * 2): a data-dependent length between kernels."""
    nodes = [helper.make_node("Greater", ["x", "zero"], ["mask"]),
             helper.make_node("NonZero", ["mask"], ["nz"]),
             helper.make_node("Squeeze", ["nz", "axis0"], ["idx"]),
             helper.make_node("Gather", ["x", "idx"], ["picked"]),
             helper.make_node("Mul", ["picked", "two"], ["scaled"]),
             helper.make_node("Relu", ["scaled"], ["y"])]
    inits = [numpy_helper.from_array(np.array(0, np.float32), "zero"),
             numpy_helper.from_array(np.array([0], np.int64), "axis0"),
             numpy_helper.from_array(np.array(2, np.float32), "two")]
    return helper.make_model(helper.make_graph(
        nodes, "nonzero", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n"])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)], inits),
        opset_imports=[helper.make_opsetid("", 17)])


def test_a_data_dependent_length_flows_from_a_fallback_into_kernels():
    model = _nonzero_model()
    compiled = compile_graph(egraft.load(model))
    kinds = {s.node.op: s.kind for s in compiled.steps}
    assert kinds["NonZero"] == "fallback" and kinds["Mul"] == "kernel" and kinds["Squeeze"] == "view"
    for n in (5, 17):
        x = np.random.default_rng(n).normal(size=n).astype(np.float32)
        got = compiled.run({"x": x})["y"]
        np.testing.assert_allclose(got, run_onnxruntime(model, {"x": x})["y"], rtol=1e-6)
        assert got.shape == ((x > 0).sum(),)


def _small_cnn(batch="n") -> onnx.ModelProto:
    """Conv + Relu + MaxPool + GlobalAveragePool + Flatten + Gemm + Softmax over a symbolic batch."""
    rng = np.random.default_rng(7)
    nodes = [helper.make_node("Conv", ["x", "w", "b"], ["c"], pads=[1, 1, 1, 1]),
             helper.make_node("Relu", ["c"], ["r"]),
             helper.make_node("MaxPool", ["r"], ["p"], kernel_shape=[2, 2], strides=[2, 2]),
             helper.make_node("GlobalAveragePool", ["p"], ["g"]),
             helper.make_node("Flatten", ["g"], ["f"]),
             helper.make_node("Gemm", ["f", "fc", "fb"], ["logits"], transB=1),
             helper.make_node("Softmax", ["logits"], ["y"], axis=1)]
    inits = [numpy_helper.from_array(rng.normal(size=(8, 3, 3, 3)).astype(np.float32), "w"),
             numpy_helper.from_array(rng.normal(size=8).astype(np.float32), "b"),
             numpy_helper.from_array(rng.normal(size=(5, 8)).astype(np.float32), "fc"),
             numpy_helper.from_array(rng.normal(size=5).astype(np.float32), "fb")]
    return helper.make_model(helper.make_graph(
        nodes, "cnn", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [batch, 3, 8, 8])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)], inits),
        opset_imports=[helper.make_opsetid("", 17)])


def test_an_empty_batch_is_a_dim_not_an_unbound_symbol():
    """A symbol bound to 0 (an empty batch) runs every kernel on zero rows, as onnxruntime does."""
    model = _small_cnn()
    compiled = egraft.compile(model, use_cache=False)
    for batch in (0, 2, 0):
        x = np.random.default_rng(batch).normal(size=(batch, 3, 8, 8)).astype(np.float32)
        want = run_onnxruntime(model, {"x": x})["y"]
        got = compiled.run({"x": x})["y"]
        assert got.shape == want.shape == (batch, 5)
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(egraft.load(model).run({"x": x})["y"], want, rtol=1e-5, atol=1e-6)


def test_symbolic_batch_runs_every_batch_from_one_compile_and_refuses_a_wrong_shape():
    model = symbolic_batch_model()
    compiled = egraft.compile(model)
    for batch in (1, 3, 8):
        x = np.random.default_rng(batch).normal(size=(batch, 2, 3)).astype(np.float32)
        np.testing.assert_allclose(compiled.run({"x": x})["y"], run_onnxruntime(model, {"x": x})["y"], rtol=1e-5,
                                   atol=1e-6)
    with pytest.raises(egraft.EgraftError, match=r"input 'x' has shape \[4, 3, 2\], expected \[batch, 2, 3\]"):
        compiled.run({"x": np.zeros((4, 3, 2), np.float32)})
    with pytest.raises(egraft.EgraftError, match="missing input 'x'"):
        compiled.run({})


def test_calls_from_several_threads_at_once_are_independent():
    gc.collect()  # earlier tests' e-graphs must not be collected on these threads (egglog objects are unsendable)
    model = symbolic_batch_model()
    compiled = egraft.compile(model)
    inputs = {b: np.random.default_rng(b).normal(size=(b, 2, 3)).astype(np.float32) for b in (1, 2, 5, 9)}
    want = {b: run_onnxruntime(model, {"x": x})["y"] for b, x in inputs.items()}
    errors: list = []

    def work(b: int) -> None:
        for _ in range(50):
            got = compiled.run({"x": inputs[b]})["y"]
            if got.shape != want[b].shape or not np.allclose(got, want[b], rtol=1e-5, atol=1e-6):
                errors.append(b)

    threads = [threading.Thread(target=work, args=(b,)) for b in inputs]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors


def _dense_model(m: int = 96, k: int = 256, n: int = 200) -> onnx.ModelProto:
    """``relu(x @ W + b) @ W2``: two products big enough to be split over threads."""
    rng = np.random.default_rng(4)
    inits = [onnx.numpy_helper.from_array(rng.normal(size=(k, n)).astype(np.float32), "w"),
             onnx.numpy_helper.from_array(rng.normal(size=n).astype(np.float32), "b"),
             onnx.numpy_helper.from_array(rng.normal(size=(n, k)).astype(np.float32), "w2")]
    nodes = [onnx.helper.make_node("MatMul", ["x", "w"], ["h"]), onnx.helper.make_node("Add", ["h", "b"], ["hb"]),
             onnx.helper.make_node("Relu", ["hb"], ["r"]), onnx.helper.make_node("MatMul", ["r", "w2"], ["y"])]
    graph = onnx.helper.make_graph(nodes, "dense", [onnx.helper.make_tensor_value_info("x", 1, [m, k])],
                                   [onnx.helper.make_tensor_value_info("y", 1, None)], inits)
    return onnx.helper.make_model(graph, opset_imports=[onnx.helper.make_opsetid("", 17)])


def test_parallel_kernels_from_several_callers_share_the_cores():
    """Kernels split over threads, called from several threads at once (each call borrows the
    helpers that are free, possibly none): every result is right, whatever the split."""
    gc.collect()
    model = _dense_model()
    compiled = egraft.compile(model, threads=2)
    assert compiled.threads == 2 and any(w >= MIN_PARALLEL_WORK for w in compiled.parallel_work().values())
    inputs = [np.random.default_rng(i).normal(size=(96, 256)).astype(np.float32) for i in range(4)]
    want = [run_onnxruntime(model, {"x": x})["y"] for x in inputs]
    errors: list = []

    def work(i: int) -> None:
        for _ in range(20):
            got = compiled.run({"x": inputs[i]})["y"]
            if scale_relative_error(got, want[i]) > 1e-5:
                errors.append(i)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(len(inputs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    compiled.threads = 1
    assert scale_relative_error(compiled.run({"x": inputs[0]})["y"], want[0]) <= 1e-5
    with pytest.raises(EgraftError, match="threads=0"):
        egraft.compile(model, threads=0)


def test_outputs_keep_their_names_and_survive_the_next_call():
    model = symbolic_batch_model()
    compiled = egraft.compile(model)
    x1, x2 = np.ones((2, 2, 3), np.float32), np.zeros((2, 2, 3), np.float32)
    first = compiled.run({"x": x1})
    snapshot = first["y"].copy()
    compiled.run({"x": x2})
    assert list(first) == [o.name for o in model.graph.output]
    np.testing.assert_array_equal(first["y"], snapshot)


# ---- the compile cache ----------------------------------------------------------------------------
def test_a_second_compile_comes_from_the_cache_and_an_edit_misses(tmp_path, monkeypatch):
    monkeypatch.setenv("EGRAFT_CACHE_DIR", str(tmp_path / "cache"))
    rules = tmp_path / "mine.rules"
    rules.write_text("ruleset mine\nrule double_negation:\n    Neg(Neg(x)) => x\n")
    model = symbolic_batch_model()
    first = egraft.compile(model, rules=[rules])
    second = egraft.compile(model, rules=[rules])
    assert not first.cache_hit and second.cache_hit
    rules.write_text("ruleset mine\nrule double_negation:\n    Neg(Neg(x)) => Neg(Neg(x))\n")
    assert not egraft.compile(model, rules=[rules]).cache_hit  # the rule file changed
    assert not egraft.compile(model, rules=[rules], shape={"batch": 2}).cache_hit  # other settings
    assert not egraft.compile(model, rules=[rules], use_cache=False).cache_hit
    x = np.ones((2, 2, 3), np.float32)
    np.testing.assert_allclose(second.run({"x": x})["y"], first.run({"x": x})["y"])
    from egraft.compiler import clear_cache

    assert clear_cache() > 0
    assert not egraft.compile(model, rules=[rules]).cache_hit


def test_a_damaged_cache_entry_is_rebuilt(tmp_path, monkeypatch):
    monkeypatch.setenv("EGRAFT_CACHE_DIR", str(tmp_path / "cache"))
    model = symbolic_batch_model()
    egraft.compile(model)
    for entry in (tmp_path / "cache" / "compiled").glob("*.pkl"):
        entry.write_bytes(b"not a pickle")
    again = egraft.compile(model)
    assert not again.cache_hit
    x = np.ones((3, 2, 3), np.float32)
    np.testing.assert_allclose(again.run({"x": x})["y"], run_onnxruntime(model, {"x": x})["y"], rtol=1e-5)


# ---- the CLI ----------------------------------------------------------------------------------------
def test_cli_compile_writes_a_build_and_refuses_to_overwrite_it(tmp_path):
    src = tmp_path / "m.onnx"
    onnx.save(symbolic_batch_model(), src)
    out = tmp_path / "build"
    result = runner.invoke(app, ["compile", str(src), "-o", str(out), "--json"])
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    assert report["kernels"] >= 1 and report["peak_bytes"] is not None
    text = (out / "module.ll").read_text()  # one module: a stub per kernel step, each kernel once
    assert len(re.findall(r'define void @"?k\d+_', text)) == report["kernels"]
    assert 1 <= len(re.findall(r'define void @"?kernel\.', text)) <= report["kernels"]
    llvm.parse_assembly(text).verify()
    exported = onnx.load(out / "model.opt.onnx")
    x = np.ones((2, 2, 3), np.float32)
    np.testing.assert_allclose(run_onnxruntime(exported, {"x": x})["y"],
                               run_onnxruntime(symbolic_batch_model(), {"x": x})["y"], rtol=1e-5)
    again = runner.invoke(app, ["compile", str(src), "-o", str(out)])
    assert again.exit_code == 2 and "exists; pass --force" in again.output


def test_cli_run_compiled_and_reference_agree_with_onnxruntime(tmp_path):
    src = tmp_path / "m.onnx"
    onnx.save(symbolic_batch_model(), src)
    for backend in ("cpu", "reference"):
        result = runner.invoke(app, ["run", str(src), "--shape", "batch=3", "--check", "--backend", backend])
        assert result.exit_code == 0, result.output
        assert "yes" in result.output
    bad = runner.invoke(app, ["run", str(src), "--backend", "gpu"])
    assert bad.exit_code == 2 and "--backend gpu: unknown backend" in bad.output


def test_cli_bench_and_profile(tmp_path):
    src = tmp_path / "m.onnx"
    onnx.save(symbolic_batch_model(), src)
    bench = runner.invoke(app, ["bench", str(src), "--shape", "batch=4", "--repeat", "3", "--threads", "2", "--json"])
    assert bench.exit_code == 0, bench.output
    figures = json.loads(bench.stdout)
    assert figures["threads"] == 2
    assert figures["egraft_ms"] > 0 and figures["onnxruntime_ms"] > 0
    assert figures["ratio"] == pytest.approx(figures["egraft_ms"] / figures["onnxruntime_ms"], rel=1e-3)
    trace = tmp_path / "trace.json"
    profiled = runner.invoke(app, ["profile", str(src), "--shape", "batch=4", "-o", str(trace), "--runs", "2"])
    assert profiled.exit_code == 0, profiled.output
    events = [e for e in json.loads(trace.read_text())["traceEvents"] if e["ph"] == "X"]
    steps = len(lower(optimize(egraft.load(symbolic_batch_model())).graph).steps)
    assert len(events) == 2 * steps and all(e["dur"] >= 0 for e in events)
    assert {e["tid"] for e in events} == {1, 2}


def test_cli_cache_clear(tmp_path, monkeypatch):
    monkeypatch.setenv("EGRAFT_CACHE_DIR", str(tmp_path / "cache"))
    egraft.compile(symbolic_batch_model())
    shown = runner.invoke(app, ["cache", "show"])
    assert shown.exit_code == 0 and str(tmp_path / "cache") in shown.output.replace("\n", "")
    cleared = runner.invoke(app, ["cache", "clear"])
    assert cleared.exit_code == 0 and "removed" in cleared.output
    assert not list((tmp_path / "cache").rglob("*.pkl"))


def test_elementwise_chains_run_in_place():
    # x -> Exp -> Add(b) -> Relu -> Neg -> y: each intermediate dies at its consumer, so the
    # Add, Relu results reuse the Exp buffer; the output is the caller's own array.
    b = np.linspace(-1, 1, 6).astype(np.float32)
    nodes = [helper.make_node("Exp", ["x"], ["e"]), helper.make_node("Add", ["e", "b"], ["a"]),
             helper.make_node("Relu", ["a"], ["r"]), helper.make_node("Neg", ["r"], ["y"])]
    model = helper.make_model(helper.make_graph(
        nodes, "chain", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", 6])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)], [numpy_helper.from_array(b, "b")]),
        opset_imports=[helper.make_opsetid("", 17)])
    lowered = lower(egraft.load(model))
    assert lowered.storage == {"a": "e", "r": "e"}
    assert [buffer.value for buffer in lowered.buffers] == ["e"]
    assert lowered.slots["a"] == lowered.slots["r"] == lowered.slots["e"]
    compiled = compile_graph(egraft.load(model))
    x = np.random.default_rng(0).normal(size=(4, 6)).astype(np.float32)
    np.testing.assert_allclose(compiled.run({"x": x})["y"], -np.maximum(np.exp(x) + b, 0), rtol=1e-6)


@pytest.mark.parametrize(("starts", "ends", "axes", "view"), [
    ([1], [3], [0], True),             # whole rows: contiguous
    ([0, 2], [1, 6], [0, 1], True),    # one row, a run of columns
    ([0, -3], [4, 100], [0, 2], False),  # a column range on every row: strided
    ([2], [2], [1], True),             # empty
])
def test_contiguous_slices_are_views(starts, ends, axes, view):
    x = np.arange(4 * 8 * 16, dtype=np.float32).reshape(4, 8, 16)
    inits = [numpy_helper.from_array(np.array(a, np.int64), n) for a, n in ((starts, "s"), (ends, "e"), (axes, "a"))]
    nodes = [helper.make_node("Slice", ["x", "s", "e", "a"], ["t"]), helper.make_node("Neg", ["t"], ["y"])]
    model = helper.make_model(helper.make_graph(
        nodes, "slice", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4, 8, 16])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)], inits),
        opset_imports=[helper.make_opsetid("", 17)])
    compiled = compile_graph(egraft.load(model))
    assert (compiled.steps[0].kind == "view") == view
    np.testing.assert_array_equal(compiled.run({"x": x})["y"], run_onnxruntime(model, {"x": x})["y"])


def test_a_plan_compiles_to_its_own_graph_and_a_stale_plan_is_refused(tmp_path):
    plan_path = tmp_path / "sq.plan.json"
    made = runner.invoke(app, ["plan", "squeezenet", "-o", str(plan_path), "--extractor", "ilp"])
    assert made.exit_code == 0, made.output
    plan = json.loads(plan_path.read_text())
    compiled = egraft.compile(plan_path)
    assert str(compiled.graph) == plan["graph"]["ir"]
    built = runner.invoke(app, ["compile", str(plan_path), "--json"])
    assert built.exit_code == 0, built.output
    assert "com.egraft::ConvNCHWc" in plan["graph"]["ir"]
    plan["graph"]["ir"] = plan["graph"]["ir"].replace("com.egraft::ConvNCHWc", "com.egraft::FusedConv", 1)
    stale = tmp_path / "stale.plan.json"
    stale.write_text(json.dumps(plan))
    with pytest.raises(egraft.EgraftError, match="differs from the plan's"):
        egraft.compile(stale)
    plan["model"]["name"] = "nowhere.onnx"
    stale.write_text(json.dumps(plan))
    refused = runner.invoke(app, ["compile", str(stale)])
    assert refused.exit_code == 2 and "its model 'nowhere.onnx' is not a file here" in refused.output


@pytest.mark.skipif(not hasattr(__import__("os"), "fork"), reason="fork is POSIX-only")
def test_a_forked_child_gets_its_own_workers():
    """The native workers are threads of the process that started them; a forked child
    (multiprocessing's default on Linux) must start its own instead of waiting on them."""
    import multiprocessing

    model = _dense_model()
    compiled = egraft.compile(model, threads=2)
    x = np.random.default_rng(1).normal(size=(96, 256)).astype(np.float32)
    want = run_onnxruntime(model, {"x": x})["y"]
    compiled.run({"x": x})  # the parent's workers exist now
    context = multiprocessing.get_context("fork")
    results = context.Queue()
    child = context.Process(target=lambda: results.put(compiled.run({"x": x})["y"]))  # fork: nothing pickled
    child.start()
    got = results.get(timeout=120)
    child.join(timeout=60)
    assert child.exitcode == 0
    assert scale_relative_error(got, want) <= 1e-5


# ---- what a new user sees (issue 13) -------------------------------------------------------------
def test_compiled_model_repr_names_inputs_outputs_steps_and_threads():
    compiled = egraft.compile(symbolic_batch_model(), use_cache=False, threads=2)
    text = repr(compiled)
    assert text == repr(egraft.compile(symbolic_batch_model(), use_cache=False, threads=2))  # deterministic
    report = compiled.report()
    assert text == (
        "CompiledModel(symbolic_mlp,\n"
        "  inputs: x: f32[batch, 2, 3],\n"
        "  outputs: y: f32[batch, 4],\n"
        "  symbolic dims: batch,\n"
        f"  steps: {report.kernels} kernels, {report.views} views, 0 on reference kernels,\n"
        "  threads: 2)")
    assert "0x" not in text


def test_compiled_model_repr_lists_the_ops_on_reference_kernels():
    graph = helper.make_graph(
        [helper.make_node("NonZero", ["x"], ["nz"]), helper.make_node("Relu", ["x"], ["y"])], "nz",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4])],
        [helper.make_tensor_value_info("nz", TensorProto.INT64, None),
         helper.make_tensor_value_info("y", TensorProto.FLOAT, [4])])
    compiled = egraft.compile(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]),
                              rewrite=False, use_cache=False, threads=1)
    assert "1 on reference kernels (NonZero)" in repr(compiled)


def test_compile_refuses_a_shape_of_an_unknown_dim(tmp_path, monkeypatch):
    monkeypatch.setenv("EGRAFT_CACHE_DIR", str(tmp_path / "cache"))
    path = tmp_path / "mlp.onnx"
    path.write_bytes(symbolic_batch_model().SerializeToString())
    with pytest.raises(EgraftError, match=r"shape=\{'nosuchdim': 3\}: .*mlp.onnx has no symbolic dim 'nosuchdim'; "
                                          r"its symbolic dims: batch"):
        egraft.compile(path, shape={"nosuchdim": 3})
    with pytest.raises(EgraftError, match="has no symbolic dim 'seq'"):
        egraft.compile(symbolic_batch_model(), shape={"batch": 2, "seq": 8}, rewrite=False)
    assert egraft.compile(path, shape={"batch": 2}).run({"x": np.zeros((2, 2, 3), np.float32)})["y"].shape == (2, 4)


def test_in_place_never_reuses_the_root_of_a_partial_view():
    """Relu on a contiguous Slice (a view at an offset of a larger buffer) that is the
    buffer's last reader: writing in place would take the root's buffer, of another size."""
    nodes = [helper.make_node("Mul", ["x", "two"], ["a"]),
             helper.make_node("Slice", ["a", "starts", "ends", "axes"], ["s"]),
             helper.make_node("Relu", ["s"], ["r"]),
             helper.make_node("Add", ["r", "two"], ["y"])]
    inits = [numpy_helper.from_array(np.array(2, np.float32), "two"),
             numpy_helper.from_array(np.array([2], np.int64), "starts"),
             numpy_helper.from_array(np.array([4], np.int64), "ends"),
             numpy_helper.from_array(np.array([0], np.int64), "axes")]
    model = helper.make_model(helper.make_graph(
        nodes, "partial_view", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [8, 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)], inits),
        opset_imports=[helper.make_opsetid("", 17)])
    compiled = compile_graph(egraft.load(model))
    assert {s.node.op: s.kind for s in compiled.steps}["Slice"] == "view"
    x = np.random.default_rng(0).normal(size=(8, 4)).astype(np.float32)
    np.testing.assert_allclose(compiled.run({"x": x})["y"], run_onnxruntime(model, {"x": x})["y"], rtol=1e-6)


def test_a_reshape_to_a_target_from_data_runs_on_its_reference_kernel():
    """Reshape(x, target) with the target an input: its output dims are fresh symbols only
    the run binds, so it cannot be a view planned ahead; the steps after it are kernels."""
    nodes = [helper.make_node("Reshape", ["x", "target"], ["r"]), helper.make_node("Relu", ["r"], ["y"])]
    model = helper.make_model(helper.make_graph(
        nodes, "data_reshape", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [12]),
                                helper.make_tensor_value_info("target", TensorProto.INT64, [2])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)]), opset_imports=[helper.make_opsetid("", 17)])
    compiled = compile_graph(egraft.load(model))
    assert {s.node.op: s.kind for s in compiled.steps} == {"Reshape": "fallback", "Relu": "kernel"}
    x = np.random.default_rng(0).normal(size=12).astype(np.float32)
    for target in ([3, 4], [6, 2]):
        feeds = {"x": x, "target": np.array(target, np.int64)}
        got = compiled.run(feeds)["y"]
        assert got.shape == tuple(target)
        np.testing.assert_array_equal(got, run_onnxruntime(model, feeds)["y"])


def test_repeated_layers_reuse_one_emission_with_their_own_weights():
    """Three convolutions and two integer products of the same shapes, each with its own
    weights (the products' per-column zero points are equal: read by value, they are part
    of what the code depends on): the later ones reuse the first one's emitted code (the
    lower stage runs each generator once), their weights packed again from their own
    constants, so the outputs match onnxruntime's exactly."""
    rng = np.random.default_rng(7)
    nodes, inits = [], []
    x = "x"
    for i in range(3):
        inits += [numpy_helper.from_array(rng.standard_normal((16, 16, 3, 3)).astype(np.float32) * 0.2, f"w{i}"),
                  numpy_helper.from_array(rng.standard_normal(16).astype(np.float32), f"b{i}")]
        nodes += [helper.make_node("Conv", [x, f"w{i}", f"b{i}"], [f"c{i}"], pads=[1, 1, 1, 1]),
                  helper.make_node("Relu", [f"c{i}"], [f"r{i}"])]
        x = f"r{i}"
    zero = rng.integers(-5, 5, 24).astype(np.int8)  # read by value: the same in both, else no reuse
    for i in range(2):
        inits += [numpy_helper.from_array(rng.integers(-128, 127, (32, 24)).astype(np.int8), f"q{i}"),
                  numpy_helper.from_array(zero.copy(), f"z{i}")]
    nodes += [helper.make_node("MatMulInteger", ["a", "q0", "", "z0"], ["m0"]),
              helper.make_node("MatMulInteger", ["a", "q1", "", "z1"], ["m1"])]
    graph = helper.make_graph(
        nodes, "repeated",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 16, 12, 12]),
         helper.make_tensor_value_info("a", TensorProto.UINT8, [5, 32])],
        [helper.make_tensor_value_info(x, TensorProto.FLOAT, None),
         helper.make_tensor_value_info("m0", TensorProto.INT32, None),
         helper.make_tensor_value_info("m1", TensorProto.INT32, None)], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    optimized = optimize(egraft.load(model), cost="roofline").graph
    lowered = lower(optimized)
    kernel_steps = [s for s in lowered.steps if s.kind == "kernel"]
    assert lowered.reused_emissions >= 3, (lowered.reused_emissions, [s.node.op for s in kernel_steps])
    assert len(lowered.kernels.modules) <= len(kernel_steps) - lowered.reused_emissions
    feeds = {"x": rng.standard_normal((1, 16, 12, 12)).astype(np.float32),
             "a": rng.integers(0, 255, (5, 32)).astype(np.uint8)}
    got = egraft.compile(model, use_cache=False, specialize="off").run(feeds)
    want = run_onnxruntime(model, feeds, exact=True)
    # the integer products against their exact int64 values: onnxruntime saturates u8 x s8 pairs
    # in int16 on x86 without VNNI, here with per-column zero points even when told to be exact
    a = feeds["a"].astype(np.int64)
    for i in range(2):
        w = numpy_helper.to_array(inits[6 + 2 * i]).astype(np.int64) - zero.astype(np.int64)
        np.testing.assert_array_equal(got[f"m{i}"], a @ w)
    assert not np.array_equal(got["m0"], got["m1"])
    np.testing.assert_allclose(got[x], want[x], rtol=1e-4, atol=1e-4)


def test_kernels_compile_in_a_helper_while_lowering_emits_the_next(monkeypatch, tmp_path):
    """With two compile jobs, lowering hands each new kernel to a helper process at once; compiling
    the model takes the helper's objects (the same bytes LLVM makes here) and ends the session,
    and the model's outputs match onnxruntime's. A lowering that fails ends its session."""
    from egraft.kernels.cpu import early_compile
    from egraft.kernels.cpu.llvm import object_code, object_key
    from egraft.lowering.compile import compile_lowered

    monkeypatch.setenv("EGRAFT_COMPILE_JOBS", "2")
    monkeypatch.setenv("EGRAFT_CACHE_DIR", str(tmp_path))  # nothing cached
    source = onnx.load(light_model_path("squeezenet"))  # re-weighted: the shipped fills give logits near 1e10
    model = with_outputs(reweight(source, seed=3), softmax_logits(source))
    graph = optimize(egraft.load(model), cost="roofline").graph
    lowered = lower(graph)
    session = lowered.early
    assert session is not None and early_compile.current() is None  # held by the lowered model only
    made = session.take_all(object_code)
    texts = list(lowered.kernels.modules.values())
    assert len(made) == len(texts) >= 10
    for text in texts[:3]:
        assert made[object_key(text)] == object_code(text)
    compiled = compile_lowered(lowered)
    assert lowered.early is None and session.closed
    feeds = backend_input(model)
    want = run_onnxruntime(model, feeds)
    got = compiled.run(feeds)
    for name, ref in want.items():
        assert scale_relative_error(got[name], ref) <= 1e-4, name

    import egraft.lowering.compile as lowering

    def interrupted(graph):  # a lowering stopped half way (Ctrl-C, a generator's bug)
        early_compile.submit(object_key(texts[0]), texts[0])
        raise KeyboardInterrupt

    monkeypatch.setattr(lowering, "_lower", interrupted)
    with pytest.raises(KeyboardInterrupt):
        lower(graph)
    assert early_compile.current() is None


def _data_model(c: int, h: int) -> onnx.ModelProto:
    """y = Relu(BatchNormalization(LayoutFromBlocked(LayoutToBlocked(x)))): ops that move data."""
    rng = np.random.default_rng(8)
    inits = {"s": rng.uniform(0.5, 1.5, c), "b": rng.normal(size=c), "m": rng.normal(size=c),
             "v": rng.uniform(0.5, 1.5, c)}
    nodes = [helper.make_node("LayoutToBlocked", ["x"], ["xb"], domain="com.egraft", block=8),
             helper.make_node("LayoutFromBlocked", ["xb"], ["x2"], domain="com.egraft", block=8),
             helper.make_node("BatchNormalization", ["x2", "s", "b", "m", "v"], ["n"]),
             helper.make_node("Relu", ["n"], ["y"])]
    graph = helper.make_graph(nodes, "data", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, c, h, h])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
                              [numpy_helper.from_array(v.astype(np.float32), k) for k, v in inits.items()])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("com.egraft", 1)])


def test_kernels_that_move_data_are_split_by_the_bytes_they_move():
    """Layout changes, BatchNormalization and elementwise ops do few flops per byte: at 2 threads
    they are split when they move MIN_PARALLEL_BYTES or more, and their outputs are the same."""
    from egraft.lowering import runtime

    big = compile_graph(egraft.load(_data_model(64, 56)))  # 800 KB per value
    small = compile_graph(egraft.load(_data_model(8, 4)))
    assert all(step.parallel for step in big.steps)
    assert min(big.parallel_work().values()) >= runtime.MIN_PARALLEL_WORK
    assert max(small.parallel_work().values()) < runtime.MIN_PARALLEL_WORK
    x = np.random.default_rng(9).normal(size=(1, 64, 56, 56)).astype(np.float32)
    assert big.split_steps({"x": x}) == sorted(step.index for step in big.steps)
    assert small.split_steps({"x": np.zeros((1, 8, 4, 4), np.float32)}) == []
    s, b, m, v = (numpy_helper.to_array(t) for t in _data_model(64, 56).graph.initializer)
    want = np.maximum((x - m[:, None, None]) * (s / np.sqrt(v + 1e-5))[:, None, None] + b[:, None, None], 0)
    for threads in (1, 2):
        big.threads = threads
        np.testing.assert_allclose(big.run({"x": x})["y"], want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("axis", [1, 2])
def test_a_concat_copies_in_parts(axis):
    """Each input goes to its own region of the output, so the parts share every copy: a
    contiguous run (axis 1 of a batch of one) by its elements, strided slices by rows."""
    from egraft.lowering import runtime

    xs = [np.random.default_rng(k).normal(size=(1, 64, 40, 41)).astype(np.float32) for k in range(2)]
    node = helper.make_node("Concat", ["a", "b"], ["y"], axis=axis)
    graph = helper.make_graph([node], "cat", [helper.make_tensor_value_info(n, TensorProto.FLOAT, list(x.shape))
                                              for n, x in zip("ab", xs)],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)])
    compiled = compile_graph(egraft.load(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])))
    (step,) = compiled.steps
    assert step.parallel and compiled.parallel_work()[step.index] >= runtime.MIN_PARALLEL_WORK
    for threads in (1, 2):
        compiled.threads = threads
        np.testing.assert_array_equal(compiled.run({"a": xs[0], "b": xs[1]})["y"], np.concatenate(xs, axis))


def test_packed_weights_hold_no_subnormal_floats():
    """A packed copy of weights flushes their subnormal floats to zero (a microcode assist per
    multiply-add on Intel cores); the graph's constant keeps them, and the outputs still match
    onnxruntime's, which computes with them."""
    rng = np.random.default_rng(12)
    w = rng.normal(size=(96, 64, 1, 1)).astype(np.float32)
    w[rng.random(w.shape) < 0.1] = np.float32(3e-39)  # subnormal
    graph = helper.make_graph([helper.make_node("Conv", ["x", "w"], ["y"])], "g",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 64, 2, 3])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
                              [numpy_helper.from_array(w, "w")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    compiled = compile_graph(egraft.load(model))
    tiny = np.finfo(np.float32).tiny
    assert compiled._lowered.derived and all(
        not ((np.abs(a) < tiny) & (a != 0)).any() for a in compiled._lowered.derived.values() if a.dtype.kind == "f")
    assert ((np.abs(w) < tiny) & (w != 0)).sum() == (
        (np.abs(compiled.graph.constants[compiled.graph.nodes[0].inputs[1].const]) < tiny) & (w != 0)).sum()
    x = rng.normal(size=(1, 64, 2, 3)).astype(np.float32)
    np.testing.assert_allclose(compiled.run({"x": x})["y"], run_onnxruntime(model, {"x": x})["y"], rtol=1e-5, atol=1e-5)


# ---- Concat written in place ------------------------------------------------------------------------
def _concat_model(batch: int = 1, channels: tuple[int, ...] = (16, 8), extra_reader: bool = False,
                  nested: bool = False) -> onnx.ModelProto:
    """x -> one 1x1 Conv per entry of ``channels`` -> Concat(axis=1) [-> Concat with x's Relu]
    -> a 1x1 Conv; optionally the first Conv's output also feeds a second output."""
    rng = np.random.default_rng(len(channels) + batch)
    inits, nodes, parts = [], [], []
    for k, c in enumerate(channels):
        inits.append(numpy_helper.from_array((rng.normal(size=(c, 8, 1, 1)) * 0.3).astype(np.float32), f"w{k}"))
        nodes.append(helper.make_node("Conv", ["x", f"w{k}"], [f"p{k}"]))
        parts.append(f"p{k}")
    nodes.append(helper.make_node("Concat", parts, ["cat"], axis=1))
    joined, total = "cat", sum(channels)
    if nested:  # DenseNet's shape: the concatenation grows by one more feature map
        nodes += [helper.make_node("Relu", ["x"], ["r"]), helper.make_node("Concat", ["cat", "r"], ["cat2"], axis=1)]
        joined, total = "cat2", total + 8
    inits.append(numpy_helper.from_array((rng.normal(size=(4, total, 1, 1)) * 0.3).astype(np.float32), "wo"))
    nodes.append(helper.make_node("Conv", [joined, "wo"], ["y"]))
    outputs = [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)]
    if extra_reader:
        nodes.append(helper.make_node("Sigmoid", ["p0"], ["z"]))
        outputs.append(helper.make_tensor_value_info("z", TensorProto.FLOAT, None))
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [batch, 8, 6, 6])
    graph = helper.make_graph(nodes, "concat", [x], outputs, inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


@pytest.mark.parametrize(("case", "kwargs", "placed"), [
    ("two parts", {}, 1), ("three parts, one read again", {"channels": (8, 16, 8), "extra_reader": True}, 1),
    ("nested", {"nested": True}, 2), ("batch 2: not contiguous ranges", {"batch": 2}, 0),
    ("an unaligned range", {"channels": (3, 8)}, 0),
])
def test_a_concat_is_written_in_place_by_its_inputs_kernels(case, kwargs, placed):
    """A Concat along the channels of a batch-1 tensor copies nothing: its inputs' kernels
    write into their ranges of its buffer (nested ones too); a batch of 2 (ranges not
    contiguous) or a range not 64-byte aligned keeps the copy. Outputs match onnxruntime
    either way, at 1 and 2 threads, and the inputs' ranges never overlap."""
    model = _concat_model(**kwargs)
    compiled = compile_graph(egraft.load(model))
    steps = compiled._lowered.steps
    assert sum(s.kind == "placed" for s in steps) == placed, case
    assert not [s for s in steps if s.kind == "fallback"]
    parts = compiled._lowered.parts
    plan = compiled.memory_plan()
    ranges = sorted((plan.offsets[name], plan.offsets[name] + size) for name, (_, _, size) in parts.items()
                    if name.startswith("p") or name == "r")
    assert all(a[1] <= b[0] for a, b in zip(ranges, ranges[1:]))
    x = np.random.default_rng(7).normal(size=(kwargs.get("batch", 1), 8, 6, 6)).astype(np.float32)
    want = run_onnxruntime(model, {"x": x})
    for threads in (1, 2):
        compiled.threads = threads
        got = compiled.run({"x": x})
        for name, value in want.items():
            np.testing.assert_allclose(got[name], value, rtol=1e-5, atol=1e-5, err_msg=f"{case}: {name}")


def test_packed_weights_sit_at_aligned_addresses_whatever_numpy_gave(monkeypatch):
    """The product kernels read pre-packed weights with aligned vector loads (``vmovaps`` on
    AVX2), which fault on an address numpy left only 16-byte aligned: a symbolic-batch linear
    layer segfaulted in 5 runs of 6 on an AVX2 host. Every constant the runtime hands a kernel
    is copied to a 64-byte boundary first; here every array numpy allocates for it is shifted
    off that boundary, and the model still runs and matches numpy."""
    from egraft.lowering import runtime

    plain = runtime._contiguous

    def misaligned(array):  # the same values, at an address 16 bytes past a 64-byte boundary
        array = plain(array)
        raw = np.empty(array.nbytes + 2 * ALIGNMENT, np.uint8)
        start = (-raw.ctypes.data) % ALIGNMENT + 16
        out = raw[start:start + array.nbytes].view(array.dtype).reshape(array.shape)
        out[...] = array
        return out

    monkeypatch.setattr(runtime, "_contiguous", misaligned)
    rng = np.random.default_rng(3)
    w = (rng.normal(size=(16, 40)) * 0.3).astype(np.float32)
    b = rng.normal(size=40).astype(np.float32)
    nodes = [helper.make_node("MatMul", ["x", "w"], ["m"]), helper.make_node("Add", ["m", "b"], ["y"])]
    graph = helper.make_graph(nodes, "linear", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", 16])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
                              [numpy_helper.from_array(w, "w"), numpy_helper.from_array(b, "b")])
    compiled = egraft.compile(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), use_cache=False)
    assert all(a.ctypes.data % ALIGNMENT == 0 for a in compiled._constants.values())
    for n in (1, 7, 33):
        x = rng.normal(size=(n, 16)).astype(np.float32)
        np.testing.assert_allclose(compiled.run({"x": x})["y"], x @ w + b, rtol=1e-5, atol=1e-5)

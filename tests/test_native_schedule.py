"""The native schedule: a compiled model runs in one native call per run, views cost
nothing, and the steps Python must run (reference kernels, data-dependent sizes) sit
between native segments and see the right values."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from conftest import run_onnxruntime, symbolic_batch_model
from onnx import TensorProto, helper, numpy_helper

import egraft
from egraft.lowering import runtime
from egraft.lowering.compile import compile_graph
from egraft.lowering.schedule import NativeSegment


def _views_model() -> onnx.ModelProto:
    """Kernels joined by views of every kind: a Reshape, a contiguous Slice at an offset (a
    view into the middle of its input), a Flatten of a constant, and an output made from them.

    y = Relu(Slice(Reshape(x @ W, [2, n, 4]), 1:2 on axis 0) * 3) + Flatten(C)[0]
    """
    rng = np.random.default_rng(3)
    nodes = [helper.make_node("MatMul", ["x", "W"], ["xw"]),
             helper.make_node("Reshape", ["xw", "shape"], ["r"]),
             helper.make_node("Slice", ["r", "starts", "ends", "axes"], ["s"]),
             helper.make_node("Mul", ["s", "three"], ["m"]),
             helper.make_node("Relu", ["m"], ["a"]),
             helper.make_node("Flatten", ["C"], ["cf"], axis=0),
             helper.make_node("Add", ["a", "cf"], ["y"])]
    inits = [numpy_helper.from_array(rng.normal(size=(5, 8)).astype(np.float32), "W"),
             numpy_helper.from_array(np.array([2, 3, 4], np.int64), "shape"),
             numpy_helper.from_array(np.array([1], np.int64), "starts"),
             numpy_helper.from_array(np.array([2], np.int64), "ends"),
             numpy_helper.from_array(np.array([0], np.int64), "axes"),
             numpy_helper.from_array(np.array(3, np.float32), "three"),
             numpy_helper.from_array(rng.normal(size=(2, 2)).astype(np.float32), "C")]
    graph = helper.make_graph(nodes, "views", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [3, 5])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def _views_reference(x: np.ndarray, model: onnx.ModelProto) -> np.ndarray:
    init = {t.name: numpy_helper.to_array(t).astype(np.float64) for t in model.graph.initializer}
    r = (x.astype(np.float64) @ init["W"]).reshape(2, 3, 4)
    return np.maximum(r[1:2] * 3, 0) + init["C"].reshape(1, 4)


def test_a_model_of_kernels_and_views_runs_in_one_native_call():
    model = _views_model()
    compiled = compile_graph(egraft.load(model))
    kinds = [s.kind for s in compiled.steps]
    assert "view" in kinds and "fallback" not in kinds
    schedule = compiled.run_schedule()
    assert len(schedule.segments) == 1 and isinstance(schedule.segments[0], NativeSegment)
    assert schedule.segments[0].count == kinds.count("kernel")
    for seed in range(3):
        x = np.random.default_rng(seed).normal(size=(3, 5)).astype(np.float32)
        np.testing.assert_allclose(compiled.run({"x": x})["y"], _views_reference(x, model), rtol=1e-5, atol=1e-5)


def _nonzero_model() -> onnx.ModelProto:
    """y = Relu(Gather(x * 2, NonZero(x > 0)[0]) + 1): a reference kernel (NonZero) between
    kernels, a view of its output and a data-dependent length that kernels read."""
    nodes = [helper.make_node("Mul", ["x", "two"], ["x2"]),
             helper.make_node("Greater", ["x", "zero"], ["mask"]),
             helper.make_node("NonZero", ["mask"], ["nz"]),
             helper.make_node("Squeeze", ["nz", "axis0"], ["idx"]),
             helper.make_node("Gather", ["x2", "idx"], ["picked"]),
             helper.make_node("Add", ["picked", "one"], ["shifted"]),
             helper.make_node("Relu", ["shifted"], ["y"]),
             helper.make_node("Neg", ["x2"], ["z"])]
    inits = [numpy_helper.from_array(np.array(0, np.float32), "zero"),
             numpy_helper.from_array(np.array(1, np.float32), "one"),
             numpy_helper.from_array(np.array([0], np.int64), "axis0"),
             numpy_helper.from_array(np.array(2, np.float32), "two")]
    return helper.make_model(helper.make_graph(
        nodes, "nonzero", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n"])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None),
         helper.make_tensor_value_info("z", TensorProto.FLOAT, ["n"])], inits),
        opset_imports=[helper.make_opsetid("", 17)])


def test_python_steps_sit_between_native_segments_and_read_their_values():
    model = _nonzero_model()
    compiled = compile_graph(egraft.load(model))
    schedule = compiled.run_schedule({"n": 9})
    python_steps = [s for s in schedule.segments if not isinstance(s, NativeSegment)]
    assert any(s.node.op == "NonZero" for s in python_steps)
    assert any(isinstance(s, NativeSegment) and s.count for s in schedule.segments)
    for n in (9, 1, 30, 9):
        x = np.random.default_rng(n).normal(size=n).astype(np.float32)
        got = compiled.run({"x": x})
        want = run_onnxruntime(model, {"x": x})
        for name in ("y", "z"):
            assert got[name].shape == want[name].shape
            np.testing.assert_allclose(got[name], want[name], rtol=1e-6, err_msg=name)


@pytest.mark.parametrize("make", [_views_model, _nonzero_model, symbolic_batch_model])
def test_the_native_schedule_and_the_step_by_step_run_agree_bit_for_bit(make, monkeypatch):
    model = make()
    compiled = egraft.compile(model, use_cache=False)
    name = model.graph.input[0].name
    shape = [3, 5] if make is _views_model else [7] if make is _nonzero_model else [4, 2, 3]
    x = np.random.default_rng(1).normal(size=shape).astype(np.float32)
    native = compiled.run({name: x})
    monkeypatch.setattr(runtime, "_STEPWISE", True)
    stepwise = compiled.run({name: x})
    assert native.keys() == stepwise.keys()
    for key in native:
        np.testing.assert_array_equal(native[key], stepwise[key], err_msg=key)


def test_a_profiled_run_times_every_step_inside_the_native_call():
    model = _views_model()
    compiled = compile_graph(egraft.load(model))
    x = np.random.default_rng(0).normal(size=(3, 5)).astype(np.float32)
    profile: list = []
    got = compiled.run({"x": x}, profile=profile)["y"]
    np.testing.assert_allclose(got, _views_reference(x, model), rtol=1e-5, atol=1e-5)
    assert [t.index for t in profile] == [s.index for s in compiled.steps]
    for earlier, later in zip(profile, profile[1:]):
        assert earlier.start_ns <= earlier.end_ns <= later.start_ns + 1000  # in order (the clocks agree to ~1 us)
    assert all(t.end_ns == t.start_ns for t in profile if t.kind == "view")  # folded into the table


def test_the_native_schedule_splits_the_kernels_worth_it(split_every_parallel_kernel):
    rng = np.random.default_rng(4)
    k, n = 64, 48
    w, w2 = rng.normal(size=(k, n)).astype(np.float32), rng.normal(size=(n, k)).astype(np.float32)
    nodes = [helper.make_node("MatMul", ["x", "w"], ["h"]), helper.make_node("Relu", ["h"], ["r"]),
             helper.make_node("MatMul", ["r", "w2"], ["y"])]
    graph = helper.make_graph(nodes, "dense", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["m", k])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
                              [numpy_helper.from_array(w, "w"), numpy_helper.from_array(w2, "w2")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    compiled = egraft.compile(model, threads=2, use_cache=False)
    if runtime.cpu_count() < 2:
        pytest.skip("one core: nothing to split over")
    segment = compiled.run_schedule({"m": 40}).segments[0]
    assert max(segment.parts) == 2 and min(segment.parts) >= 1
    for m in (40, 3):
        x = rng.normal(size=(m, k)).astype(np.float32)
        want = np.maximum(x.astype(np.float64) @ w, 0) @ w2
        np.testing.assert_allclose(compiled.run({"x": x})["y"], want, rtol=1e-4, atol=1e-4)


def _thread_of_part_kernel() -> tuple[egraft.kernels.cpu.llvm.JitModule, int]:
    """A kernel of the one ABI that writes, for its ``part``, the Linux thread id it runs on
    into ``table[0][part]`` (``gettid``, system call 186 on x86-64). Part 0 then waits (a
    bounded spin, about a tenth of a second) until part 1 has written its id, so the other
    thread, even one asleep on its futex on a loaded machine, has the time to claim part 1;
    whichever thread claimed part 0, the other one runs part 1 unless it never woke."""
    from llvmlite import ir

    from egraft.kernels.cpu.llvm import JitModule, host_cpu

    i64, i8p = ir.IntType(64), ir.IntType(8).as_pointer()
    module = ir.Module(name="thread_of_part")
    module.triple = host_cpu()[0]
    syscall = ir.Function(module, ir.FunctionType(i64, [i64], var_arg=True), "syscall")
    kernel = ir.Function(module, ir.FunctionType(ir.VoidType(), [i8p.as_pointer(), i64.as_pointer(), i64, i64, i8p]),
                         "thread_of_part")
    pause = ir.Function(module, ir.FunctionType(ir.VoidType(), []), "llvm.x86.sse2.pause")
    table, _, part, _, _ = kernel.args
    entry, spin, done = (kernel.append_basic_block(n) for n in ("entry", "spin", "done"))
    b = ir.IRBuilder(entry)
    out = b.bitcast(b.load(table), i64.as_pointer())
    b.store_atomic(b.call(syscall, [ir.Constant(i64, 186)]), b.gep(out, [part]), "release", 8)
    zero = ir.Constant(i64, 0)
    b.cbranch(b.icmp_signed("==", part, zero), spin, done)
    b.position_at_end(spin)
    count = b.phi(i64)
    count.add_incoming(zero, entry)
    b.call(pause, [])
    following = b.add(count, ir.Constant(i64, 1))
    count.add_incoming(following, spin)
    other_written = b.icmp_signed("!=", b.load_atomic(b.gep(out, [ir.Constant(i64, 1)]), "acquire", 8), zero)
    b.cbranch(b.or_(other_written, b.icmp_signed(">=", following, ir.Constant(i64, 2_000_000))), done, spin)
    b.position_at_end(done)
    b.ret_void()
    jit = JitModule(str(module), use_cache=False)
    return jit, jit.address("thread_of_part")


@pytest.mark.skipif(runtime.cpu_count() < 2, reason="a split needs a second core for the worker")
def test_each_thread_runs_its_own_part_of_a_split_kernel():
    """The caller claims part 0 and the worker part 1 first, so a kernel's share of the data
    stays on one core from kernel to kernel. Over many splits: whenever the two parts ran on
    two threads, part 0 ran on the caller's (a thread runs the other's part only after its
    own is taken: a busy machine may leave both parts to one thread, never swap them; before,
    the spinning worker took part 0 first in about 4 splits out of 10). Part 0 waits for
    part 1 (see the kernel), so a worker asleep under CI's load still gets its part: with
    a kernel that returned at once, CI saw the caller run both parts in all 300 splits."""
    import threading

    from egraft.kernels.cpu.sgemm import SCRATCH_BYTES
    from egraft.kernels.cpu.workers import NativeWorkers

    jit, address = _thread_of_part_kernel()
    # workers of its own: the process's may be owned by another caller of this process
    # (one caller owns them at a time; the others run alone), as the full suite showed
    workers = NativeWorkers([runtime._aligned_empty(SCRATCH_BYTES)])
    out = np.zeros(2, np.int64)
    table = np.array([out.ctypes.data], np.uint64)
    dims = np.zeros(1, np.int64)
    caller = threading.get_native_id()
    shared, swapped = 0, 0
    for _ in range(100):
        out[:] = 0
        assert workers.run(address, table.ctypes.data, dims.ctypes.data, 2, runtime.thread_scratch()) == 2
        assert out.all(), "every part ran"
        if out[0] != out[1]:
            shared += 1
            swapped += int(out[0]) != caller
    assert swapped == 0, f"part 0 ran on the worker in {swapped} of {shared} shared splits"
    assert shared > 0, "no split ran on two threads"
    del jit

"""The compile cache on disk (egraft/compile_cache.py, egraft/kernels/cpu/llvm.py): checksums,
damaged entries rebuilt with a warning, the size cap and least-recently-used eviction,
what an entry stores. Real cache folders under tmp_path through $EGRAFT_CACHE_DIR."""

from __future__ import annotations

import json
import os
import warnings
from dataclasses import replace

import numpy as np
import onnx
import pytest
from conftest import run_onnxruntime
from onnx import TensorProto, helper

import egraft
from egraft.errors import EgraftError
from egraft.extract.cost import Roofline
from egraft.extract.profiles import load_profile
from egraft.kernels.cpu.llvm import cache_max_bytes, evict


def conv_model(out_channels: int = 16, seed: int = 0) -> onnx.ModelProto:
    """y = Relu(Conv(x, w, b)): x f32[1, 8, 16, 16], 3x3 pads 1; its kernel packs w."""
    rng = np.random.default_rng(seed)
    w = rng.normal(size=(out_channels, 8, 3, 3)).astype(np.float32)
    b = rng.normal(size=(out_channels,)).astype(np.float32)
    graph = helper.make_graph(
        [helper.make_node("Conv", ["x", "w", "b"], ["c"], pads=[1, 1, 1, 1]), helper.make_node("Relu", ["c"], ["y"])],
        "conv_relu",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 8, 16, 16])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, out_channels, 16, 16])],
        initializer=[onnx.numpy_helper.from_array(w, "w"), onnx.numpy_helper.from_array(b, "b")],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


FEEDS = {"x": np.random.default_rng(1).normal(size=(1, 8, 16, 16)).astype(np.float32)}


@pytest.fixture
def cache(tmp_path, monkeypatch):
    folder = tmp_path / "cache"
    monkeypatch.setenv("EGRAFT_CACHE_DIR", str(folder))
    monkeypatch.delenv("EGRAFT_CACHE_MAX", raising=False)
    return folder


def _corrupt(path, at: float = 0.5) -> None:
    """Flip bytes in the middle of ``path`` (its size stays)."""
    data = bytearray(path.read_bytes())
    k = int(len(data) * at)
    for i in range(k, min(k + 64, len(data))):
        data[i] ^= 0xFF
    path.write_bytes(bytes(data))


def _check(compiled, model) -> None:
    np.testing.assert_allclose(compiled.run(FEEDS)["y"], run_onnxruntime(model, FEEDS)["y"], rtol=1e-4, atol=1e-4)


def test_every_entry_records_checksums_of_its_files(cache):
    compiled = egraft.compile(conv_model())
    assert compiled._lowered.derived, "the conv kernel should pack its weights"
    metas = sorted(cache.rglob("*.json"))
    assert {m.parent.name for m in metas} == {"compiled", "objects"}
    for meta in metas:
        for info in json.loads(meta.read_text())["files"].values():
            assert len(info["sha256"]) == 64 and (meta.parent / info["name"]).stat().st_size == info["bytes"]


def test_a_damaged_object_file_is_rebuilt_with_a_warning(cache):
    model = conv_model()
    egraft.compile(model)
    objects = sorted((cache / "objects").glob("*.o"), key=lambda p: p.stat().st_size)
    _corrupt(objects[-1])  # the model's kernels (the largest object)
    with pytest.warns(RuntimeWarning, match=r"egraft cache: the entry .* is damaged \(.*\.o does not match"):
        again = egraft.compile(model)
    assert again.cache_hit and not again.report().cached  # the model came back; its code was compiled again
    _check(again, model)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        third = egraft.compile(model)  # repaired: no warning, the object code from the cache
    assert third.report().cached
    _check(third, model)


def test_a_damaged_constants_blob_of_the_same_size_is_rebuilt_with_a_warning(cache):
    model = conv_model()
    egraft.compile(model)
    (blob,) = (cache / "compiled").glob("*.bin")
    size = blob.stat().st_size
    _corrupt(blob)
    assert blob.stat().st_size == size
    with pytest.warns(RuntimeWarning, match=r"is damaged \(.*\.bin does not match its checksum\); rebuilding it"):
        again = egraft.compile(model)
    assert not again.cache_hit
    _check(again, model)
    assert egraft.compile(model).cache_hit  # written again, whole


def test_a_damaged_pickle_is_never_unpickled(cache):
    model = conv_model()
    egraft.compile(model)
    (pkl,) = (cache / "compiled").glob("*.pkl")
    _corrupt(pkl, at=0.1)
    with pytest.warns(RuntimeWarning, match=r"\.pkl does not match its checksum"):
        again = egraft.compile(model)
    assert not again.cache_hit
    _check(again, model)


def _read_constants(graph) -> set[str]:
    """The keys of the constants the graph's nodes read (rewriting leaves others behind)."""
    return {v.const for node in graph.nodes for v in node.inputs if v is not None and v.const is not None}


def _constants_bytes(cache) -> int:
    blobs = sorted((cache / "compiled").glob("*.bin"))
    assert len(blobs) == 1, sorted(f.name for f in (cache / "compiled").iterdir())  # one entry (seen twice once)
    return blobs[0].stat().st_size


def test_an_entry_stores_the_packed_weights_instead_of_the_weights(cache):
    model = conv_model(out_channels=64)
    first = egraft.compile(model)
    packer = next(s.node for s in first.steps if any(n.startswith(f"{s.function}.") for n in first._lowered.derived))
    w_value = packer.inputs[1]
    assert first._lowered.derived and w_value.name not in first._lowered.runtime_constants  # read packed only
    weights = sum(onnx.numpy_helper.to_array(t).nbytes for t in model.graph.initializer)
    assert _constants_bytes(cache) <= 1.2 * weights  # the packed copy, not the weights besides
    second = egraft.compile(model)
    assert second.cache_hit
    assert set(second._lowered.derived) == set(first._lowered.derived)
    for name, array in first._lowered.derived.items():
        np.testing.assert_array_equal(second._lowered.derived[name], array)
    assert w_value.const not in second.graph.constants  # left out of the entry ...
    for key in _read_constants(first.graph):  # ... and given back, unpacked, when asked for
        np.testing.assert_array_equal(second.graph.constants[key], first.graph.constants[key])
    exported = {t.name: onnx.numpy_helper.to_array(t) for t in egraft.to_onnx(second.graph).graph.initializer}
    np.testing.assert_array_equal(exported[w_value.name], first.graph.constants[w_value.const])
    np.testing.assert_array_equal(second.run(FEEDS)["y"], first.run(FEEDS)["y"])
    _check(second, model)


def test_a_hit_runs_no_kernel_generator(cache, monkeypatch):
    from egraft.kernels.cpu.emit import KernelContext

    model = conv_model(out_channels=64)
    first = egraft.compile(model)
    calls = []
    init = KernelContext.__init__

    def counted(self, *args, **kwargs):
        calls.append(args[1])
        init(self, *args, **kwargs)

    monkeypatch.setattr(KernelContext, "__init__", counted)
    second = egraft.compile(model)
    assert second.cache_hit and calls == []
    np.testing.assert_array_equal(second.run(FEEDS)["y"], first.run(FEEDS)["y"])
    assert egraft.compile(model, use_cache=False) and calls  # the counter counts


def test_cache_max_parses_sizes(monkeypatch):
    for text, expected in (("500M", 500 * 2**20), ("2G", 2 * 2**30), ("1.5g", int(1.5 * 2**30)), ("4096", 4096),
                           ("64KiB", 64 * 2**10), ("0", 0)):
        monkeypatch.setenv("EGRAFT_CACHE_MAX", text)
        assert cache_max_bytes() == expected, text
    monkeypatch.delenv("EGRAFT_CACHE_MAX")
    assert cache_max_bytes() == 4 * 2**30
    monkeypatch.setenv("EGRAFT_CACHE_MAX", "lots")
    with pytest.raises(EgraftError, match="EGRAFT_CACHE_MAX='lots': expected a size such as 500M"):
        cache_max_bytes()


def _entry_bytes(cache) -> dict[str, int]:
    """Bytes of each compiled model's and object's entry (the parsed rule files are outside the cap)."""
    sizes: dict[str, int] = {}
    for f in cache.rglob("*"):
        if f.is_file() and f.parent.name != "rules":
            sizes[f.name.split(".")[0]] = sizes.get(f.name.split(".")[0], 0) + f.stat().st_size
    return sizes


def test_the_least_recently_used_entries_go_when_the_cache_is_full(cache, monkeypatch):
    a, b, c = conv_model(16, seed=1), conv_model(16, seed=2), conv_model(16, seed=3)
    egraft.compile(a)
    metas_a = set(cache.rglob("*.json"))
    egraft.compile(b)
    metas_b = set(cache.rglob("*.json")) - metas_a
    now = os.stat(next(iter(metas_a))).st_mtime
    for meta in metas_a:
        os.utime(meta, (now, now))  # a was used last
    for meta in metas_b:  # b's model first, then its object code: the least recently used
        old = now - (200 if meta.parent.name == "compiled" else 100)
        os.utime(meta, (old, old))
    sizes = _entry_bytes(cache)
    size_b = sum(sizes[m.stem] for m in metas_b)
    total = sum(sizes.values())
    monkeypatch.setenv("EGRAFT_CACHE_MAX", str(total + size_b // 4))  # no room for c besides a and b
    egraft.compile(c)
    assert sum(_entry_bytes(cache).values()) <= total + size_b // 4
    assert all(m.exists() for m in metas_a)
    assert not any(m.exists() for m in metas_b if m.parent.name == "compiled")
    assert egraft.compile(a).cache_hit and egraft.compile(c).cache_hit
    assert not egraft.compile(b).cache_hit  # evicted


def test_evict_to_zero_keeps_only_the_entry_just_written(cache):
    egraft.compile(conv_model(16, seed=1))
    egraft.compile(conv_model(16, seed=2))
    keep = sorted((cache / "compiled").glob("*.json"), key=lambda m: m.stat().st_mtime)[-1]
    assert evict(keep=keep, limit=0) > 0
    assert sorted(f.name for f in cache.rglob("*") if f.is_file() and f.parent.name != "rules") == sorted(
        f.name for f in (cache / "compiled").glob(keep.stem + ".*"))


def test_winograd_filters_are_computed_again_not_stored(cache):
    rng = np.random.default_rng(4)
    w = rng.normal(size=(64, 64, 3, 3)).astype(np.float32)
    graph = helper.make_graph(
        [helper.make_node("Conv", ["x", "w"], ["c"], pads=[1, 1, 1, 1]), helper.make_node("Relu", ["c"], ["y"])],
        "winograd", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 64, 28, 28])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 64, 28, 28])],
        initializer=[onnx.numpy_helper.from_array(w, "w")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    # (without the shipped profile's per-call Winograd cost, which keeps it for large layers only)
    flops_only = Roofline(replace(load_profile("cpu-host"), call_us={}))
    first = egraft.compile(model, cost=flops_only)
    assert "WinogradConv" in first.graph.op_histogram()
    (packed_u,) = [a for n, a in first._lowered.derived.items() if n.endswith(".packed_u")]
    assert packed_u.nbytes > 1.5 * w.nbytes
    assert _constants_bytes(cache) <= 1.2 * w.nbytes  # w, not G w G^T (16/9 of it) nor its packed copy
    second = egraft.compile(model, cost=flops_only)
    assert second.cache_hit
    for name, array in first._lowered.derived.items():  # packed again, in numpy, to the same bytes
        np.testing.assert_array_equal(second._lowered.derived[name], array)
    for key in _read_constants(first.graph):
        np.testing.assert_array_equal(second.graph.constants[key], first.graph.constants[key])
    assert str(second.graph) == str(first.graph)
    x = rng.normal(size=(1, 64, 28, 28)).astype(np.float32)
    np.testing.assert_array_equal(second.run({"x": x})["y"], first.run({"x": x})["y"])
    np.testing.assert_allclose(second.run({"x": x})["y"], run_onnxruntime(model, {"x": x})["y"], rtol=1e-3, atol=1e-3)


def test_every_packed_weight_records_which_packing_made_it_from_which_constant(cache):
    compiled = egraft.compile(conv_model(out_channels=64))
    lowered = compiled._lowered
    assert lowered.packed_from and set(lowered.packed_from) <= set(lowered.derived)
    for name, made in lowered.packed_from.items():
        w = np.asarray(compiled.graph.constants[made.source])
        np.testing.assert_array_equal(made.apply(w), lowered.derived[name])  # the record makes it again
        assert made.gather
        np.testing.assert_array_equal(made.unpack(lowered.derived[name], w.shape, w.dtype), w)


@pytest.mark.parametrize("packing, params, shape", [("conv_gemm.panels", (("group", 2), ("mr", 6)), (10, 3, 3, 3)),
                                                     ("conv_nchwc.blocked", (), (24, 16, 3, 3))])
def test_a_gather_packing_unpacks_to_its_weight(packing, params, shape):
    from egraft.kernels.cpu.emit import PackedFrom

    w = np.random.default_rng(5).normal(size=shape).astype(np.float32)
    made = PackedFrom(packing, "w", params)
    np.testing.assert_array_equal(made.unpack(made.apply(w), w.shape, w.dtype), w)


def test_winograd_packing_is_not_a_gather():
    from egraft.kernels.cpu.emit import PackedFrom

    made = PackedFrom("winograd.packed_u", "w", (("mr", 6),))
    w = np.ones((4, 4, 3, 3), np.float32)
    assert not made.gather and made.apply(w).size == 16 * 6 * 4
    with pytest.raises(ValueError, match="'winograd.packed_u' is not a gather"):
        made.unpack(made.apply(w), w.shape, w.dtype)
    with pytest.raises(KeyError, match="no weight packing 'nosuch'"):
        PackedFrom("nosuch", "w").apply(w)


def test_an_entry_is_written_in_the_background_and_a_second_compile_waits_for_it(cache, monkeypatch):
    """By default (outside these tests' fixture) compile returns while its entry is written
    on a thread of its own: the model runs meanwhile; a second compile of the same model
    waits for the write and is a hit; wait_for_writes leaves the entry complete on disk."""
    from egraft import compile_cache

    monkeypatch.setattr(compile_cache, "WRITE_IN_BACKGROUND", True)
    model = conv_model(seed=3)
    first = egraft.compile(model)
    assert not first.cache_hit
    _check(first, model)  # runs while the entry may still be written
    second = egraft.compile(model)
    assert second.cache_hit
    _check(second, model)
    compile_cache.wait_for_writes()
    assert not compile_cache._PENDING
    entries = sorted(p.suffix for p in (cache / "compiled").iterdir())
    assert entries == [".bin", ".json", ".pkl"]
    assert egraft.compile_cache.clear_cache() > 0 and not (cache / "compiled").exists()

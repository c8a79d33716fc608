"""``egraft zoo``: sources, generated inputs, isolation (crash, hang, out-of-memory, corrupt
file), the SQLite store under ``kill -9`` and concurrent writers, resume and keys, a real
Dask cluster on localhost, and the CLI's errors. Models run in real processes through the
real ``egraft`` command; rows are checked against values computed here (file hashes, node
counts, onnxruntime's outputs)."""

from __future__ import annotations

import hashlib
import json
import os
import signal
import socket
import sqlite3
import subprocess
import sys
import time
from datetime import datetime
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

import egraft
from egraft.errors import EgraftError
from egraft.testing.broken_models import write_broken_models
from egraft.zoo.inputs import generated_specs
from egraft.zoo.sources import resolve_sources
from egraft.zoo.store import ROW_FIELDS, ZooStore

EGRAFT = [sys.executable, "-m", "egraft.cli"]
REQUIRED = ("model", "sha256", "status", "error", "worker", "started", "finished", "nodes_before", "nodes_after",
            "optimize_s", "compile_s", "fallbacks", "egraft_ms", "onnxruntime_ms", "max_error", "rules")


def mlp(seed: int = 0) -> onnx.ModelProto:
    """y = relu(x @ w1 + b1) @ w2 on x: f32[batch, 8] (a symbolic batch)."""
    rng = np.random.default_rng(seed)
    inits = [numpy_helper.from_array(rng.normal(0, 0.5, s).astype(np.float32), n)
             for n, s in (("w1", (8, 16)), ("b1", (16,)), ("w2", (16, 4)))]
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "w1"], ["h"]), helper.make_node("Add", ["h", "b1"], ["hb"]),
         helper.make_node("Relu", ["hb"], ["r"]), helper.make_node("MatMul", ["r", "w2"], ["y"])],
        f"mlp{seed}", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 8])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 4])], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def embedding() -> onnx.ModelProto:
    """mean over seq of table[Cast(ids)]: int32 token ids a Gather reads through a Cast."""
    table = np.random.default_rng(1).normal(0, 1, (50, 8)).astype(np.float32)
    graph = helper.make_graph(
        [helper.make_node("Cast", ["ids"], ["ids64"], to=TensorProto.INT64),
         helper.make_node("Gather", ["table", "ids64"], ["e"]),
         helper.make_node("ReduceMean", ["e"], ["y"], axes=[1], keepdims=0)],
        "embedding", [helper.make_tensor_value_info("ids", TensorProto.INT32, ["batch", "seq"])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 8])],
        [numpy_helper.from_array(table, "table")])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def zoo(*args: str, cwd: Path, timeout: float = 240) -> subprocess.CompletedProcess:
    return subprocess.run([*EGRAFT, "zoo", *args], cwd=cwd, capture_output=True, text=True, timeout=timeout)


def show(db: Path, run: str) -> dict[str, dict]:
    done = subprocess.run([*EGRAFT, "zoo", "show", run, "--db", str(db), "--json"], capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 0, done.stderr
    return {r["model"]: r for r in json.loads(done.stdout)}


def sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


# ---- sources and inputs --------------------------------------------------------------------------
def test_sources_folder_manifest_bundled_and_their_errors(tmp_path):
    (tmp_path / "zoo" / "vision").mkdir(parents=True)
    onnx.save(mlp(0), tmp_path / "zoo" / "a.onnx")
    onnx.save(mlp(1), tmp_path / "zoo" / "vision" / "b.onnx")
    assert [m.name for m in resolve_sources([str(tmp_path / "zoo")])] == ["a", "vision/b"]
    manifest = tmp_path / "zoo.toml"
    manifest.write_text('[[model]]\npath = "zoo/a.onnx"\nname = "alpha"\ntolerance = 1e-4\n'
                        'shapes = [{batch = 3}, {batch = 5}]\n'
                        '[[model.input]]\nname = "x"\ndtype = "float32"\nshape = ["batch", 8]\nkind = "normal"\n')
    m, = resolve_sources([str(manifest)])
    assert (m.name, m.path, m.tolerance) == ("alpha", (tmp_path / "zoo" / "a.onnx").resolve(), 1e-4)
    assert [b["dims"] for b in m.bindings] == [{"batch": 3}, {"batch": 5}] and m.inputs[0]["kind"] == "normal"
    assert [m.name for m in resolve_sources(["squeezenet", "light_resnet50"])] == ["squeezenet", "resnet50"]
    manifest.write_text('[[model]]\npath = "zoo/a.onnx"\nshape = [{batch = 3}]\n')
    with pytest.raises(EgraftError, match=r"unknown field\(s\) \['shape'\]"):
        resolve_sources([str(manifest)])
    manifest.write_text('[[model]]\npath = "zoo/a.onnx"\n[[model.input]]\nname = "x"\ndtype = "float32"\n'
                        'shape = [1, 8]\nkind = "gaussian"\n')
    with pytest.raises(EgraftError, match="kind 'gaussian'"):
        resolve_sources([str(manifest)])
    with pytest.raises(EgraftError, match="two models are named 'a'"):
        resolve_sources([str(tmp_path / "zoo" / "a.onnx"), str(tmp_path / "zoo")])
    with pytest.raises(EgraftError, match="not a folder, an .onnx file"):
        resolve_sources(["no_such_thing"])


def test_generated_inputs_keep_gather_indices_inside_the_table():
    import onnxruntime as ort

    from egraft.testing.corpus import Binding, feeds_from_specs

    model = embedding()
    specs = generated_specs(model)
    assert [(s.kind, s.low, s.high) for s in specs] == [("integers", 0, 50)]
    feeds = feeds_from_specs(specs, Binding({"batch": 2, "seq": 300}), seed=0)
    ids = feeds["ids"]
    assert ids.dtype == np.int32 and ids.shape == (2, 300) and ids.min() >= 0 and ids.max() <= 49
    assert ids.max() >= 40  # the range is used, not just its start
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    table = numpy_helper.to_array(model.graph.initializer[0])
    np.testing.assert_allclose(session.run(None, feeds)[0], table[ids].mean(axis=1), rtol=1e-5, atol=1e-6)


# ---- isolation: every failure classified, the rest finish -----------------------------------------
def test_zoo_run_classifies_corrupt_endless_and_huge_models_and_finishes_the_rest(tmp_path):
    # The timeout covers a worker's start, imports, optimize, compile, check and bench: the
    # well-behaved models need ~5 s alone and well over 12 s on a loaded 2-core CI machine.
    folder = tmp_path / "zoo"
    broken = write_broken_models(folder)
    onnx.save(mlp(0), folder / "mlp.onnx")
    onnx.save(embedding(), folder / "embedding.onnx")
    db = tmp_path / "zoo.sqlite"
    done = zoo("run", str(folder), "--db", str(db), "--name", "mixed", "--jobs", "2", "--timeout", "40",
               "--max-memory", "4", "--bench-seconds", "0.2", "--shape", "batch=3", "--shape", "seq=5", cwd=tmp_path)
    assert done.returncode == 1, done.stderr
    rows = show(db, "mixed")
    assert sorted(rows) == ["corrupt", "embedding", "endless_loop", "huge_intermediate", "mlp"]
    for row in rows.values():
        assert set(REQUIRED) <= set(row) and list(row)[: len(ROW_FIELDS)] == list(ROW_FIELDS)
        assert row["sha256"] == sha(folder / f"{row['model']}.onnx")
        assert datetime.fromisoformat(row["started"]) <= datetime.fromisoformat(row["finished"])
        host, pid = row["worker"].rsplit(":", 1)
        assert host == socket.gethostname() and pid.isdigit()
    assert rows["corrupt"]["status"] == "error" and "not a valid ONNX model" in rows["corrupt"]["error"]
    assert rows["endless_loop"]["status"] == "timeout" and "40 s" in rows["endless_loop"]["error"]
    assert rows["endless_loop"]["wall_s"] >= 40
    huge = rows["huge_intermediate"]
    assert huge["status"] in ("error", "crashed") and ("MemoryError" in huge["error"] or "SIGKILL" in huge["error"])
    assert str(broken["huge_intermediate"].name) == "huge_intermediate.onnx"
    for name in ("mlp", "embedding"):
        row = rows[name]
        assert row["status"] == "ok", row["error"]
        assert row["nodes_before"] == len(egraft.load(folder / f"{name}.onnx").nodes)
        assert row["max_error"] is not None and row["max_error"] < 1e-5
        assert row["egraft_ms"] > 0 and row["onnxruntime_ms"] > 0
        assert row["speedup"] == pytest.approx(row["onnxruntime_ms"] / row["egraft_ms"], rel=1e-3)
        assert row["fallbacks"] == 0 and row["compile_s"] > 0 and row["optimize_s"] > 0
    assert rows["mlp"]["bindings"] == {"batch": 3}
    assert rows["embedding"]["bindings"] == {"batch": 3, "seq": 5}
    assert rows["mlp"]["rules"], "the mlp's MatMul+Add fuse: some rule fired"
    assert "1 of 5 ok" not in done.stdout and "2 of 5 ok" in done.stdout
    # More memory: only the model that ran out of it runs again; the timeout stays (40 s).
    again = zoo("run", str(folder), "--db", str(db), "--name", "mixed", "--jobs", "2", "--timeout", "40",
                "--max-memory", "5", "--bench-seconds", "0.2", "--shape", "batch=3", "--shape", "seq=5", cwd=tmp_path)
    assert again.returncode == 1 and "1 to run" in again.stderr and "4 finished and kept" in again.stderr
    rerun = show(db, "mixed")
    assert rerun["huge_intermediate"]["process"] != huge["process"]
    assert rerun["huge_intermediate"]["limits"]["max_memory_gb"] == 5
    assert all(rerun[m]["process"] == rows[m]["process"] for m in rows if m != "huge_intermediate")


def test_a_raised_limit_reruns_only_the_rows_that_hit_it():
    from egraft.zoo.run import ZooSettings, hit_a_raised_limit

    settings = ZooSettings(timeout=100, max_memory_gb=8)
    timeout = {"status": "timeout", "limits": {"timeout": 60, "max_memory_gb": 8}}
    oom = {"status": "error", "error": "MemoryError: out of memory", "limits": {"timeout": 100, "max_memory_gb": 4}}
    killed = {"status": "crashed", "error": "killed by SIGKILL", "limits": {"timeout": 100, "max_memory_gb": 4}}
    other = {"status": "error", "error": "ModelError: not a valid ONNX model", "limits": {"timeout": 1,
                                                                                         "max_memory_gb": 1}}
    assert hit_a_raised_limit(timeout, settings) and hit_a_raised_limit(oom, settings)
    assert hit_a_raised_limit(killed, settings) and not hit_a_raised_limit(other, settings)
    assert not hit_a_raised_limit(timeout, ZooSettings(timeout=60)) and not hit_a_raised_limit(
        oom, ZooSettings(max_memory_gb=4))


def exp_matmul(drop_exp: bool = False) -> onnx.ModelProto:
    """y = exp(x) @ w on x: f32[batch, 8] (``drop_exp``: y = x @ w)."""
    w = numpy_helper.from_array(np.random.default_rng(2).normal(0, 0.5, (8, 4)).astype(np.float32), "w")
    nodes = [helper.make_node("MatMul", ["x", "w"], ["y"])] if drop_exp else \
        [helper.make_node("Exp", ["x"], ["e"]), helper.make_node("MatMul", ["e", "w"], ["y"])]
    graph = helper.make_graph(nodes, "exp_matmul",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 8])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 4])], [w])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def test_an_unsound_rule_file_gives_a_mismatch_with_the_error_measured(tmp_path):
    """A rule author's unsound rule (Exp dropped) makes egraft compute exp-free outputs:
    the row is a mismatch whose error is the one between onnxruntime on the model and on
    the model without its Exp, on the same generated inputs."""
    import onnxruntime as ort

    from egraft.testing.corpus import Binding, InputSpec, feeds_from_specs
    from egraft.testing.corpus.compare import compare_outputs

    onnx.save(exp_matmul(), tmp_path / "exp_matmul.onnx")
    (tmp_path / "unsound.rules").write_text("ruleset unsound\n\n# exp(x) -> x (wrong)\n"
                                            "rule drop_exp:\n    Exp(x) => x\n")
    (tmp_path / "zoo.toml").write_text('[[model]]\npath = "exp_matmul.onnx"\nshapes = [{batch = 5}]\n'
                                       '[[model.input]]\nname = "x"\ndtype = "float32"\nshape = ["batch", 8]\n'
                                       'kind = "normal"\nstd = 1.0\n')
    db = tmp_path / "z.sqlite"
    done = zoo("run", "zoo.toml", "--db", str(db), "--name", "unsound", "--stages", "check",
               "--rules", "unsound.rules", cwd=tmp_path)
    assert done.returncode == 1, done.stderr
    row = show(db, "unsound")["exp_matmul"]
    assert row["status"] == "mismatch" and row["stage"] == "check" and row["rules"].get("drop_exp", 0) >= 1
    feeds = feeds_from_specs([InputSpec("x", "float32", ("batch", 8), "normal", std=1.0)], Binding({"batch": 5}))
    run = lambda m: ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, feeds)
    expected = compare_outputs({"y": run(exp_matmul(drop_exp=True))[0]}, {"y": run(exp_matmul())[0]}).error
    assert expected > 0.01 and row["max_error"] == pytest.approx(expected, rel=1e-3)
    assert f"{row['max_error']:.3g} > tolerance 0.001" in row["error"]


# ---- the store: kill -9, resume, keys, concurrent writers -----------------------------------------
def _zoo_children_of(parent: int) -> list[int]:
    found = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            env = (proc / "environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if f"EGRAFT_ZOO_PARENT={parent}".encode() in env:
            found.append(int(proc.name))
    return found


def test_kill_9_then_the_same_command_finishes_without_recomputing(tmp_path):
    folder = tmp_path / "zoo"
    folder.mkdir()
    for seed in range(4):
        onnx.save(mlp(seed), folder / f"mlp{seed}.onnx")
    db = tmp_path / "zoo.sqlite"
    command = [*EGRAFT, "zoo", "run", str(folder), "--db", str(db), "--name", "nightly", "--jobs", "1",
               "--stages", "compile"]
    parent = subprocess.Popen(command, cwd=tmp_path, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 180
    finished: dict[str, dict] = {}
    while time.time() < deadline and not finished:
        time.sleep(0.2)
        if db.exists():
            try:
                with sqlite3.connect(db, timeout=5) as c:
                    finished = {m: json.loads(r) for m, r in c.execute("SELECT model, row FROM results")}
            except sqlite3.OperationalError:  # the tables are being created
                pass
    assert finished, "no row was written in time"
    children = _zoo_children_of(parent.pid)
    parent.send_signal(signal.SIGKILL)
    parent.wait()
    time.sleep(1.5)
    assert not [p for p in children if Path(f"/proc/{p}").exists() and
                b"zombie" not in Path(f"/proc/{p}/status").read_bytes().lower()], "a model outlived its supervisor"
    assert len(finished) < 4
    done = subprocess.run(command, cwd=tmp_path, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr
    assert f"{len(finished)} finished and kept" in done.stderr
    rows = show(db, "nightly")
    assert sorted(rows) == [f"mlp{s}" for s in range(4)]
    for model, before in finished.items():
        assert (rows[model]["finished"], rows[model]["process"]) == (before["finished"], before["process"])
    with sqlite3.connect(db) as c:
        assert c.execute("SELECT COUNT(*) FROM results WHERE run = 'nightly'").fetchone()[0] == 4


def test_ctrl_c_kills_the_running_models_and_exits_130(tmp_path):
    for seed in range(3):
        onnx.save(mlp(seed), tmp_path / f"m{seed}.onnx")
    parent = subprocess.Popen([*EGRAFT, "zoo", "run", "m0.onnx", "m1.onnx", "m2.onnx", "--db", "z.sqlite",
                               "--jobs", "2", "--stages", "compile"], cwd=tmp_path, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True,
                              preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    deadline = time.time() + 120
    children: list[int] = []
    while time.time() < deadline and not children:
        time.sleep(0.1)
        children = _zoo_children_of(parent.pid)
    assert children, "no model process started"
    parent.send_signal(signal.SIGINT)
    _, err = parent.communicate(timeout=60)
    assert parent.returncode == 130 and "interrupted: the finished rows are in z.sqlite" in err
    time.sleep(0.5)
    assert not [p for p in children if Path(f"/proc/{p}").exists() and
                b"zombie" not in Path(f"/proc/{p}/status").read_bytes().lower()]


def test_keys_keep_finished_rows_and_settings_or_force_recompute(tmp_path):
    onnx.save(mlp(0), tmp_path / "mlp.onnx")
    db = tmp_path / "zoo.sqlite"
    base = ("run", "mlp.onnx", "--db", str(db), "--name", "r", "--stages", "optimize")

    def row() -> dict:
        return show(db, "r")["mlp"]

    assert zoo(*base, cwd=tmp_path).returncode == 0
    first = row()
    done = zoo(*base, cwd=tmp_path)
    assert done.returncode == 0 and "1 finished and kept" in done.stderr
    assert row()["process"] == first["process"]
    assert zoo(*base, "--rules-off", "fusion", cwd=tmp_path).returncode == 0
    nofusion = row()
    assert nofusion["process"] != first["process"] and nofusion["key"] != first["key"]
    assert not any("matmul" in r and "add" in r for r in nofusion["rules"]) and nofusion["nodes_after"] >= \
        first["nodes_after"]
    assert zoo(*base, "--rules-off", "fusion", "--force", cwd=tmp_path).returncode == 0
    assert row()["process"] != nofusion["process"] and row()["key"] == nofusion["key"]
    plan = zoo("show", "r", "--db", str(db), "--plan", "mlp", cwd=tmp_path)
    assert plan.returncode == 0 and len(json.loads(plan.stdout)["graph"]["nodes"]) == row()["nodes_after"]
    report = zoo("report", "r", "--db", str(db), "-o", "out/report.html", cwd=tmp_path)
    assert report.returncode == 0, report.stderr
    assert "mlp" in (tmp_path / "out" / "report.html").read_text() and (tmp_path / "out" / "report.md").exists()


def test_two_zoo_runs_write_one_database_at_once(tmp_path):
    for seed in range(3):
        onnx.save(mlp(seed), tmp_path / f"m{seed}.onnx")
    db = tmp_path / "shared.sqlite"
    procs = [subprocess.Popen([*EGRAFT, "zoo", "run", *[f"m{s}.onnx" for s in range(3)], "--db", str(db),
                               "--name", name, "--stages", "optimize", "--jobs", "2"],
                              cwd=tmp_path, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
             for name in ("left", "right")]
    for p in procs:
        _, err = p.communicate(timeout=240)
        assert p.returncode == 0, err
    store = ZooStore(db, create=False)
    assert {r.name: r.counts for r in store.runs()} == {"left": {"ok": 3}, "right": {"ok": 3}}
    with sqlite3.connect(db) as c:
        assert c.execute("PRAGMA journal_mode").fetchone()[0] == "wal"


# ---- Dask ----------------------------------------------------------------------------------------
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_dask_runs_rows_on_both_workers_of_a_real_cluster(tmp_path):
    pytest.importorskip("distributed", reason="Dask distributed is not installed (pip install 'dask[distributed]')")
    from distributed import Client

    for seed in range(6):
        onnx.save(mlp(seed), tmp_path / f"m{seed}.onnx")
    address = f"tcp://127.0.0.1:{_free_port()}"
    env = dict(os.environ, DASK_DISTRIBUTED__WORKER__DAEMON="False")
    procs = [subprocess.Popen([sys.executable, "-m", "distributed.cli.dask_scheduler", "--host", "127.0.0.1",
                               "--port", address.rsplit(":", 1)[1], "--no-dashboard"],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)]
    try:
        for _ in range(2):
            procs.append(subprocess.Popen([sys.executable, "-m", "distributed.cli.dask_worker", address,
                                           "--nthreads", "1", "--no-dashboard", "--name", f"w{len(procs)}"],
                                          stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env))
        with Client(address, timeout="60s") as client:
            client.wait_for_workers(2, timeout=60)
            pids = set(client.run(os.getpid).values())
        db = tmp_path / "zoo.sqlite"
        done = zoo("run", *[f"m{s}.onnx" for s in range(6)], "--db", str(db), "--name", "cluster",
                   "--stages", "optimize", "--dask", address, cwd=tmp_path)
        assert done.returncode == 0, done.stderr
        rows = show(db, "cluster")
        assert len(rows) == 6 and all(r["status"] == "ok" for r in rows.values())
        workers = {r["worker"] for r in rows.values()}
        assert {int(w.rsplit(":", 1)[1]) for w in workers} == pids, (workers, pids)
        for r in rows.values():
            assert r["process"] != r["worker"]  # the model ran in its own process under the worker
        by_env = subprocess.run([*EGRAFT, "zoo", "run", "m0.onnx", "--db", str(db), "--name", "env",
                                 "--stages", "optimize"], cwd=tmp_path, capture_output=True, text=True, timeout=240,
                                env=dict(os.environ, DASK_SCHEDULER_ADDRESS=address))
        assert by_env.returncode == 0 and f"on the Dask cluster at {address}" in by_env.stderr
        assert int(show(db, "env")["m0"]["worker"].rsplit(":", 1)[1]) in pids
    finally:
        for p in reversed(procs):
            p.terminate()
        for p in procs:
            try:
                p.wait(timeout=20)
            except subprocess.TimeoutExpired:
                p.kill()


# ---- the CLI's errors ----------------------------------------------------------------------------
@pytest.mark.parametrize("args, message", [
    (["run", "mlp.onnx", "--stages", "optimize,lint"], "--stages lint: unknown stage"),
    (["run", "mlp.onnx", "--rules-off", "nosuch"], "--rules-off nosuch: no such rule set"),
    (["run", "nothing_here"], "nothing_here: not a folder, an .onnx file"),
    (["run", "mlp.onnx", "--jobs", "2", "--dask", "tcp://127.0.0.1:1"], "give --jobs or --dask, not both"),
    (["run", "mlp.onnx", "--threads", "0"], "--threads 0: give 1 or more"),
    (["run", "mlp.onnx", "--shape", "batch"], "expected NAME=INT"),
    (["run", "mlp.onnx", "--db", "junk.sqlite"], "not a usable SQLite database"),
    (["show", "--db", "missing.sqlite"], "no such database"),
    (["report", "r", "--db", "missing.sqlite", "-o", "taken.html"], "taken.html exists; pass --force"),
    (["report", "r", "--db", "missing.sqlite", "-o", "out.txt"], "give an .html file"),
])
def test_usage_errors_exit_2_with_one_line(tmp_path, args, message):
    onnx.save(mlp(0), tmp_path / "mlp.onnx")
    (tmp_path / "junk.sqlite").write_bytes(b"this is not a database" * 100)
    (tmp_path / "taken.html").write_text("<p>mine</p>")
    done = zoo(*args, cwd=tmp_path, timeout=60)
    assert done.returncode == 2, (done.stdout, done.stderr)
    assert message in done.stderr and "Traceback" not in done.stderr
    assert (tmp_path / "taken.html").read_text() == "<p>mine</p>"


def test_diff_gate_exits_1_on_a_slower_or_broken_model(tmp_path):
    db = tmp_path / "zoo.sqlite"
    store = ZooStore(db)
    stamp = "2026-12-04T00:00:00+00:00"
    for run, rows in {"a": [("m1", "ok", 10.0), ("m2", "ok", 10.0), ("m3", "ok", 10.0)],
                      "b": [("m1", "ok", 9.0), ("m2", "ok", 10.4), ("m3", "error", None)]}.items():
        store.begin_run(run, {})
        for model, status, ms in rows:
            store.put(run, {"model": model, "key": "k", "status": status, "finished": stamp, "egraft_ms": ms})
    store.close()
    gate = zoo("diff", "a", "b", "--db", str(db), "--fail-below", "0.95", cwd=tmp_path, timeout=60)
    assert gate.returncode == 1 and "m3: ok -> error" in gate.stderr and "m2" not in gate.stderr
    loose = zoo("diff", "a", "b", "--db", str(db), "--fail-below", "0.9", "--json", cwd=tmp_path, timeout=60)
    assert loose.returncode == 1  # m3 broke: any ratio fails it
    entries = {e["model"]: e for e in json.loads(loose.stdout)}
    assert entries["m1"]["speed_ratio"] == pytest.approx(10 / 9) and entries["m2"]["speed_ratio"] == \
        pytest.approx(10 / 10.4)
    tighter = zoo("diff", "a", "b", "--db", str(db), "--fail-below", "0.97", cwd=tmp_path, timeout=60)
    assert tighter.returncode == 1 and "m2: slower" in tighter.stderr
    plain = zoo("diff", "a", "b", "--db", str(db), cwd=tmp_path, timeout=60)
    assert plain.returncode == 0 and "m1" in plain.stdout


def test_names_with_brackets_print_as_written(tmp_path):
    """Run and model names are user text: the consoles print them literally (no rich markup,
    no escaping backslashes)."""
    db = tmp_path / "zoo.sqlite"
    store = ZooStore(db)
    store.begin_run("nightly[v2]", {})
    store.put("nightly[v2]", {"model": "det[int8]", "key": "k", "status": "error", "error": "bad [value]",
                              "finished": "2026-12-04T00:00:00+00:00"})
    store.close()
    shown = zoo("show", "nightly[v2]", "--db", str(db), cwd=tmp_path, timeout=60)
    assert shown.returncode == 0 and "run nightly[v2]: 0 of 1 ok" in shown.stdout
    assert "det[int8]" in shown.stdout and "bad [value]" in shown.stdout and "\\[" not in shown.stdout

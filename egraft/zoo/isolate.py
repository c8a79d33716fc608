"""Running one model in its own OS process, so that nothing it does can take the batch down.

:func:`run_isolated` starts a Python process in a new session (its own process group)
that runs :mod:`egraft.zoo.job`, with the task in a JSON file and the result coming back
in another; stdout goes nowhere and stderr to a file whose tail explains a crash. Before
it imports anything heavy, the child asks the kernel to kill it when its supervisor dies
(PR_SET_PDEATHSIG), so a ``kill -9`` of ``egraft zoo run`` leaves no model running, and
caps its address space (``--max-memory``, RLIMIT_AS: an allocation past it is a
``MemoryError``, an ``error`` row). After ``timeout`` seconds
the whole process group is killed (``timeout``). A child that dies of a signal is
``crashed`` with the signal's name; one that exits without a result is ``crashed`` with
its exit code and the last line of its stderr.

The function is self-contained: the local executor calls it from a thread, a Dask worker
calls it as a task (it runs on the worker, which records itself as the row's ``worker``).

Example:
    >>> row = run_isolated(model_spec, settings, timeout=600)        # doctest: +SKIP
    >>> row["status"], row["worker"]                                 # doctest: +SKIP
    ('ok', 'host-1:4242')
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from egraft.zoo.store import now_iso

#: The child's first lines, before anything heavy is imported: die with the supervisor
#: (PR_SET_PDEATHSIG; exit at once if it is already gone), cap the address space, then run
#: :mod:`egraft.zoo.job`.
_LAUNCHER = """\
import ctypes, os, resource, runpy, signal, sys
ctypes.CDLL(None).prctl(1, signal.SIGKILL)
if os.getppid() != int(os.environ["EGRAFT_ZOO_PARENT"]):
    os._exit(1)
cap = os.environ.get("EGRAFT_ZOO_MAX_MEMORY_GB")
if cap:
    limit = int(float(cap) * 2**30)
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
sys.argv = ["egraft.zoo.job", *sys.argv[1:]]
runpy.run_module("egraft.zoo.job", run_name="__main__", alter_sys=True)
"""

_running: set[subprocess.Popen] = set()
_running_lock = threading.Lock()


def kill_running() -> int:
    """Kill the process group of every model this process is running (on Ctrl-C); how many."""
    with _running_lock:
        procs = list(_running)
    for proc in procs:
        _kill_group(proc)
    return len(procs)


def _kill_group(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def _stderr_tail(path: Path, lines: int = 1) -> str:
    try:
        text = path.read_text(errors="replace").strip().splitlines()
    except OSError:
        return ""
    useful = [line for line in text if line.strip()]
    return " | ".join(useful[-lines:])


def _signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"


def run_isolated(model: dict, settings: dict, timeout: float, host: str | None = None) -> dict:
    """Run ``model`` (a :meth:`ZooModel.spec`) under ``settings`` in a child process; the
    row's measured and outcome fields, ``worker``, ``process``, ``started``, ``finished``
    and ``wall_s`` (never raises for anything the model does)."""
    host = host or socket.gethostname()
    started, start = now_iso(), time.perf_counter()
    base = {"worker": f"{host}:{os.getpid()}", "started": started, "tolerance": model["tolerance"],
            "threads": settings["threads"]}
    with tempfile.TemporaryDirectory(prefix="egraft-zoo-") as folder:
        task, result, stderr = Path(folder, "task.json"), Path(folder, "result.json"), Path(folder, "stderr.txt")
        task.write_text(json.dumps({"model": model, "settings": settings}))
        env = dict(os.environ, EGRAFT_ZOO_PARENT=str(os.getpid()))
        for var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):  # numpy fallbacks: one thread
            env.setdefault(var, "1")
        env.pop("OPENBLAS_CORETYPE", None)  # it pins OpenBLAS to an older, slower kernel
        if settings.get("max_memory_gb"):
            env["EGRAFT_ZOO_MAX_MEMORY_GB"] = f"{settings['max_memory_gb']:g}"
        with open(stderr, "wb") as err:
            proc = subprocess.Popen([sys.executable, "-c", _LAUNCHER, str(task), str(result)],
                                    stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=err,
                                    env=env, start_new_session=True)
        with _running_lock:
            _running.add(proc)
        base["process"] = f"{host}:{proc.pid}"
        try:
            code = proc.wait(timeout=timeout)
            timed_out = False
        except subprocess.TimeoutExpired:
            _kill_group(proc)
            code, timed_out = proc.wait(), True
        finally:
            with _running_lock:
                _running.discard(proc)
        _kill_group(proc)  # anything the model's process left behind in its group
        base.update(finished=now_iso(), wall_s=round(time.perf_counter() - start, 3))
        if timed_out:
            return {**base, "status": "timeout", "stage": None,
                    "error": f"no result after {timeout:g} s: the process group was killed"}
        if code == 0 and result.exists():
            done = json.loads(result.read_text())
            return {**base, **done["row"], "plan": done["plan"]}
        tail = _stderr_tail(stderr)
        if code < 0:
            name = _signal_name(-code)
            why = " (the kernel's out-of-memory killer sends it)" if name == "SIGKILL" else ""
            error = f"killed by {name}{why}" + (f": {tail}" if tail else "")
        else:
            error = f"exit code {code} without a result" + (f": {tail}" if tail else "")
        return {**base, "status": "crashed", "stage": None, "error": error}


__all__ = ["run_isolated", "kill_running"]

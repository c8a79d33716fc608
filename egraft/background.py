"""Compiling in the background without slowing the caller: a function run in a fresh,
low-priority Python process.

A compile inside the calling process would hold the interpreter lock for seconds and stall
the very calls it should speed up (each call takes the lock between its kernels). So
:func:`call_in_worker` runs ``module:function`` in ``python -c`` (no fork of the caller's
threads, no re-import of its main module), at ``nice`` 10 (``$EGRAFT_WORKER_NICE`` sets
another niceness: 0 where the machine's other work must not starve the build), with the arguments and the
result pickled through a temporary folder; compiled object code comes back through the
on-disk caches (:mod:`egraft.kernels.cpu.llvm`), so loading the result takes milliseconds.
The worker keys cache entries by the caller's source digest (``$EGRAFT_SOURCE_DIGEST``).

Example:
    >>> call_in_worker("math:gcd", 12, 18)
    6
"""

from __future__ import annotations

import os
import pickle
import subprocess
import sys
import tempfile
from pathlib import Path

_WORKER = """
import importlib, os, pickle, sys
os.nice(int(os.environ.get("EGRAFT_WORKER_NICE", "10")))
with open(sys.argv[1], "rb") as f:
    target, args = pickle.load(f)
module, name = target.split(":")
result = getattr(importlib.import_module(module), name)(*args)
with open(sys.argv[2], "wb") as f:
    pickle.dump(result, f)
"""


def call_in_worker(target: str, *args):
    """``module:function(*args)`` in a fresh low-priority Python process; its result.
    Raises ``RuntimeError`` with the worker's last error line when it fails (an
    ``$EGRAFT_WORKER_NICE`` that is not an integer included)."""
    from egraft.compile_cache import _source_digest
    from egraft.kernels.cpu.llvm import cache_dir

    root = str(Path(__file__).resolve().parent.parent)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p),
               EGRAFT_SOURCE_DIGEST=_source_digest(),  # cache entries keyed as this process looks them up
               EGRAFT_CACHE_DIR=str(cache_dir()))  # and stored where it looks (a pinned folder included)
    with tempfile.TemporaryDirectory(prefix="egraft-worker-") as folder:
        request, result = Path(folder) / "request.pkl", Path(folder) / "result.pkl"
        request.write_bytes(pickle.dumps((target, args)))
        done = subprocess.run([sys.executable, "-c", _WORKER, str(request), str(result)], env=env,
                              capture_output=True, text=True)
        if done.returncode != 0 or not result.exists():
            lines = [line for line in done.stderr.strip().splitlines() if line.strip()]
            raise RuntimeError(lines[-1] if lines else f"the worker exited with {done.returncode}")
        return pickle.loads(result.read_bytes())


__all__ = ["call_in_worker"]

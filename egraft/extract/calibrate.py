"""``egraft calibrate``: short micro-benchmarks that measure this machine for the
``cpu-host`` roofline profile.

- arithmetic: an fp32 matrix product of 1024^3 (2 * 1024^3 flops: BLAS's FMA loop, the
  best the host reaches in practice) at ``threads`` threads;
- memory bandwidth: a copy of 256 MB (bytes read plus bytes written per second);
- launch cost: the time of a call on 16 elements (what starting a small kernel costs).

Each is the median of several runs (the machines are shared and noisy). The benchmarks
run in a child process with ``OPENBLAS_NUM_THREADS`` / ``OMP_NUM_THREADS`` set to
``threads`` and ``OPENBLAS_CORETYPE`` removed (it pins OpenBLAS to an older kernel and
would understate the peak).

Example:
    >>> profile = calibrate(threads=1)     # doctest: +SKIP
    >>> save_profile(profile)              # doctest: +SKIP
"""

from __future__ import annotations

import datetime
import json
import os
import subprocess
import sys
import time

from egraft.errors import EgraftError
from egraft.extract.profiles import Profile, load_profile

GEMM_SIZE = 1024
COPY_BYTES = 256 * 1024 * 1024
REPEATS = 7


def _median(xs: list[float]) -> float:
    xs = sorted(xs)
    return xs[len(xs) // 2]


def measure() -> dict[str, float]:
    """Run the micro-benchmarks in this process (threads as the environment sets them)."""
    import numpy as np

    rng = np.random.default_rng(0)
    a = rng.standard_normal((GEMM_SIZE, GEMM_SIZE), dtype=np.float32)
    b = rng.standard_normal((GEMM_SIZE, GEMM_SIZE), dtype=np.float32)
    c = np.empty_like(a)
    np.matmul(a, b, out=c)
    times = []
    for _ in range(REPEATS):
        t = time.perf_counter()
        np.matmul(a, b, out=c)
        times.append(time.perf_counter() - t)
    gflops = 2.0 * GEMM_SIZE**3 / _median(times) / 1e9
    src = np.ones(COPY_BYTES // 4, dtype=np.float32)
    dst = np.empty_like(src)
    np.copyto(dst, src)
    times = []
    for _ in range(REPEATS):
        t = time.perf_counter()
        np.copyto(dst, src)
        times.append(time.perf_counter() - t)
    bandwidth = 2.0 * COPY_BYTES / _median(times) / 1e9
    x = np.ones(16, np.float32)
    y = np.empty_like(x)
    times = []
    for _ in range(REPEATS):
        t = time.perf_counter()
        for _ in range(1000):
            np.add(x, x, out=y)
        times.append((time.perf_counter() - t) / 1000)
    return {"peak_gflops": gflops, "bandwidth_gbs": bandwidth, "launch_us": _median(times) * 1e6}


def calibrate(threads: int = 1, base: str = "cpu-host") -> Profile:
    """Measure this machine and return the ``cpu-host`` profile with its figures
    (efficiencies, and the record of a ``--kernels`` fit, are kept from ``base``)."""
    env = dict(os.environ)
    env.pop("OPENBLAS_CORETYPE", None)
    for var in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"):
        env[var] = str(threads)
    try:
        done = subprocess.run([sys.executable, "-m", "egraft.extract.calibrate"], env=env, capture_output=True,
                              text=True, timeout=300, check=False)
    except subprocess.TimeoutExpired:
        raise EgraftError("calibration took more than 300 s; is the machine overloaded?") from None
    if done.returncode != 0:
        last = done.stderr.strip().splitlines()[-1] if done.stderr.strip() else f"exit status {done.returncode}"
        raise EgraftError(f"calibration failed: {last}")
    figures = json.loads(done.stdout)
    template = load_profile(base)
    today = datetime.date.today().isoformat()
    kept = [part for part in template.source.split("; ") if part.startswith("kernels measured")]
    return Profile(
        name="cpu-host", target="cpu",
        peak_gflops=float(f"{figures['peak_gflops']:.4g}"),
        bandwidth_gbs=float(f"{figures['bandwidth_gbs']:.4g}"),
        launch_us=float(f"{figures['launch_us']:.3g}"),
        efficiency=dict(template.efficiency), bandwidth_efficiency=dict(template.bandwidth_efficiency),
        call_us=dict(template.call_us),
        description=f"this machine, measured by egraft calibrate at {threads} thread(s)",
        source="; ".join([f"measured {today}: fp32 GEMM {GEMM_SIZE}^3, copy of {COPY_BYTES >> 20} MB, "
                          "16-element call", *kept]),
    )


if __name__ == "__main__":  # the child process of calibrate()
    print(json.dumps(measure()))

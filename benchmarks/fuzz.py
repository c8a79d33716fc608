"""Differential fuzzing of egraft against onnxruntime (in the spirit of NNSmith).

Generates ``--count`` random valid ONNX graphs from seeds ``--start ...``
(:mod:`egraft.testing.fuzz`), runs each at two bindings of its symbolic dims on egraft's
reference executor and on its compiled CPU backend, judges them against onnxruntime
(basic optimizations) and prints, per backend, the outcomes: ok, mismatch, crash, refusal
(by reason), ill-conditioned (onnxruntime itself is off from a float64 evaluation by more
than the tolerance, so the graph cannot judge egraft), timeout, and the generator's invalid
rate (graphs onnxruntime rejects).

Failures are grouped by what they say (the exception and the innermost egraft frame for a
crash; the backend for a mismatch); the first ``--minimize`` of each group are minimized
(delta debugging) into ``--out``/<backend>_<outcome>_seed<N>/ as a runnable model.onnx
with its feeds (feeds0.npz, feeds1.npz), model.txt and failure.json.

Run: python benchmarks/fuzz.py --count 1000 --start 0 --out /tmp/fuzz_failures [--jobs 2]
"""

from __future__ import annotations

import argparse
import collections
import json
import multiprocessing
import os
import queue
import re
import signal
import sys
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("EGRAFT_NUM_THREADS", "1")

from rich.console import Console  # noqa: E402
from rich.table import Table  # noqa: E402

from egraft.testing.fuzz.generate import generate  # noqa: E402
from egraft.testing.fuzz.oracle import ALL_BACKENDS, BACKENDS, Result, check, refusal_reason  # noqa: E402

OUTCOMES = ("ok", "mismatch", "crash", "refusal", "ill-conditioned", "timeout", "invalid")
TIMEOUT_S = 90


def _alarm(signum, frame):
    raise TimeoutError(f"over {TIMEOUT_S} s")


def run_seed(job: tuple[int, tuple[str, ...]]) -> tuple[int, list[Result], float, int]:
    """The results of seed ``seed`` on each of ``backends``, its seconds and its node count."""
    seed, backends = job
    signal.signal(signal.SIGALRM, _alarm)
    t = time.perf_counter()
    case = generate(seed)
    signal.alarm(TIMEOUT_S)
    try:
        results = check(case, backends)
    except TimeoutError:
        results = [Result(b, "timeout", f"over {TIMEOUT_S} s") for b in backends]
    finally:
        signal.alarm(0)
    return seed, results, time.perf_counter() - t, len(case.model.graph.node)


def _worker(fn, tasks, replies) -> None:
    while (job := tasks.get()) is not None:
        replies.put(("start", os.getpid(), job))
        replies.put(("done", os.getpid(), fn(job)))


def run_all(fn, jobs: list, workers: int, died):
    """``fn(job)`` for every job in ``workers`` processes, yielding results as they come. A
    worker that dies (a segfault in compiled code) is replaced; ``died(job, exitcode)``
    gives the result of the job it was running."""
    ctx = multiprocessing.get_context("spawn")
    tasks, replies = ctx.Queue(), ctx.Queue()
    for job in jobs:
        tasks.put(job)
    procs: dict[int, object] = {}
    running: dict[int, object] = {}

    def spawn():
        p = ctx.Process(target=_worker, args=(fn, tasks, replies))  # not daemonic: it may start children
        p.start()
        procs[p.pid] = p

    for _ in range(min(workers, len(jobs))):
        spawn()
    left = len(jobs)
    while left:
        try:
            kind, pid, payload = replies.get(timeout=1.0)
        except queue.Empty:
            for pid, p in list(procs.items()):
                if not p.is_alive():
                    del procs[pid]
                    if pid in running:
                        left -= 1
                        yield died(running.pop(pid), p.exitcode)
                        spawn()
            continue
        if kind == "start":
            running[pid] = payload
        else:
            running.pop(pid, None)
            left -= 1
            yield payload
    for _ in procs:
        tasks.put(None)
    for p in procs.values():
        p.join(timeout=5)


def _died(job: tuple[int, tuple[str, ...]], code: int) -> tuple[int, list[Result], float, int]:
    """The results of a seed whose worker died (in compiled code or in LLVM): each backend
    checked again in a child process of its own, so the one that kills it is a crash."""
    from egraft.testing.fuzz.minimize import check_isolated

    seed, backends = job
    case = generate(seed)
    return seed, [check_isolated(case, b) for b in backends], 0.0, len(case.model.graph.node)


def group(r: Result) -> str:
    """What a failure says, without the names and numbers that differ between seeds."""
    if r.outcome == "mismatch":
        kind = "dtype" if "dtype" in r.detail else "shape" if "shape" in r.detail else "value"
        return f"{r.backend} mismatch ({kind})"
    first = refusal_reason(r.detail)
    frame = re.findall(r"at (\S+) (\w+)", r.detail)
    return f"{r.backend} {r.outcome}: {first}" + (f" [{frame[-1][0]} {frame[-1][1]}]" if frame else "")


def minimize_seed(job: tuple[int, str, str, int, bool]) -> tuple[int, str, str, str]:
    """Minimize seed ``seed``'s failure on ``backend`` (in child processes when it ``died``);
    returns where it was written and the op kinds left."""
    from egraft.testing.fuzz.minimize import check_isolated, minimize, save_case

    seed, backend, out, seconds, died = job
    case = generate(seed)
    died = died or backend == "compiled"  # compiled code may corrupt the heap: check it in children
    result = check_isolated(case, backend) if died else check(case, [backend])[0]
    if result.outcome in ("ok", "refusal", "invalid"):
        return seed, backend, "", "(did not fail again)"
    isolated = died or result.detail.startswith("ProcessDied")
    small = minimize(case, result, seconds=seconds, isolated=isolated)
    final = check_isolated(small, backend) if isolated else check(small, [backend])[0]
    path = save_case(small, Path(out) / f"{backend}_{result.outcome}_seed{seed}", final)
    return seed, backend, str(path.parent), " ".join(n.op_type for n in small.model.graph.node)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--count", type=int, default=100, help="graphs to generate (default 100)")
    parser.add_argument("--start", type=int, default=0, help="first seed (default 0)")
    parser.add_argument("--out", default="/tmp/fuzz_failures", help="folder for minimized failures")
    parser.add_argument("--jobs", type=int, default=2, help="worker processes (default 2)")
    parser.add_argument("--minimize", type=int, default=2, help="failures minimized per group (default 2; 0: none)")
    parser.add_argument("--minimize-seconds", type=int, default=90, help="time per minimization (default 90)")
    parser.add_argument("--backends", default=",".join(BACKENDS),
                        help=f"comma-separated, of {', '.join(ALL_BACKENDS)} (default {','.join(BACKENDS)})")
    parser.add_argument("--json", default=None, help="also write every seed's results to this file")
    args = parser.parse_args()
    from egraft.testing.bench import temporary_cache

    temporary_cache()
    console = Console()
    backends = tuple(args.backends.split(","))
    jobs = [(seed, backends) for seed in range(args.start, args.start + args.count)]
    tally = {b: collections.Counter() for b in backends}
    reasons = {b: collections.Counter() for b in backends}
    groups: dict[str, list[int]] = collections.defaultdict(list)
    records = []
    start = time.perf_counter()
    seconds = 0.0
    for k, (seed, results, secs, nodes) in enumerate(run_all(run_seed, jobs, args.jobs, _died), 1):
        seconds += secs
        for r in results:
            tally[r.backend][r.outcome] += 1
            if r.outcome == "refusal":
                reasons[r.backend][refusal_reason(r.detail)] += 1
            elif r.outcome not in ("ok", "invalid"):
                groups[group(r)].append(seed)
        records.append({"seed": seed, "nodes": nodes, "seconds": round(secs, 3),
                        "results": [r.__dict__ for r in results]})
        if k % 50 == 0:
            print(f"{k}/{args.count} graphs, {time.perf_counter() - start:.0f} s", file=sys.stderr, flush=True)
    wall = time.perf_counter() - start

    table = Table(title=f"egraft vs onnxruntime on {args.count} random graphs (seeds {args.start}.."
                        f"{args.start + args.count - 1}), two bindings each")
    table.add_column("outcome")
    for b in backends:
        table.add_column(b, justify="right")
    for o in OUTCOMES:
        table.add_row(o, *(f"{tally[b][o]} ({100 * tally[b][o] / args.count:.1f}%)" for b in backends))
    console.print(table)
    invalid = tally[backends[0]]["invalid"]
    console.print(f"invalid-graph rate: {invalid}/{args.count} = {100 * invalid / args.count:.2f}%; "
                  f"{wall:.0f} s wall, {seconds / args.count:.2f} s per graph")
    for b in backends:
        if reasons[b]:
            rt = Table(title=f"refusals on {b}, by reason")
            rt.add_column("count", justify="right")
            rt.add_column("reason")
            for reason, n in reasons[b].most_common():
                rt.add_row(str(n), reason)
            console.print(rt)
    gt = Table(title="failures by group")
    gt.add_column("count", justify="right")
    gt.add_column("group")
    gt.add_column("seeds")
    for g, s in sorted(groups.items(), key=lambda kv: -len(kv[1])):
        gt.add_row(str(len(s)), g, " ".join(map(str, sorted(s)[:8])) + (" ..." if len(s) > 8 else ""))
    console.print(gt)

    if args.json:
        Path(args.json).write_text(json.dumps({"tally": {b: dict(t) for b, t in tally.items()},
                                               "groups": groups, "seeds": records}, default=str) + "\n")
    if args.minimize and groups:
        jobs = [(s, g.split(" ", 1)[0], args.out, args.minimize_seconds, "ProcessDied" in g)
                for g, ss in groups.items() if "timeout" not in g and "ill-conditioned" not in g
                for s in sorted(ss)[:args.minimize]]
        mt = Table(title=f"minimized failures (in {args.out})")
        for col in ("seed", "backend", "folder", "ops left"):
            mt.add_column(col)
        for seed, backend, folder, ops in run_all(minimize_seed, jobs, args.jobs,
                                                  lambda job, code: (job[0], job[1], "", f"died: {code}")):
            mt.add_row(str(seed), backend, folder, ops)
        console.print(mt)


if __name__ == "__main__":
    main()

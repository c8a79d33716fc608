"""One build per model serves every listed shape (issue 15): each corpus model whose inputs
have symbolic dims is compiled once with its dims left symbolic, then run at every binding
the manifest lists, each new shape's first call timed against warm calls, every output
checked against onnxruntime.

Per model and binding: nodes on reference kernels at that binding, the first call at the
new shape (ms: the per-binding memory plan and shapes are computed then; no compile), the
warm median (alternating blocks with onnxruntime at 1 thread, both engines), first/warm,
egraft/onnxruntime and the error against onnxruntime with the entry's tolerance. With
``--specialize``, also the warm median of the shape's variant (``specialize="auto"``,
built in the background, waited for). Each model runs in its own process with a time
limit.

Run: python benchmarks/symbolic_shapes.py [--only NAME...] [--specialize] [--json FILE] [--timeout 600]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

for _var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):  # numpy stays out of the way
    os.environ.setdefault(_var, "1")

MARK = "@@shapes-row@@"


def _worker(name: str, specialize: bool) -> int:
    import onnxruntime as ort

    import egraft
    from egraft.testing.bench import temporary_cache
    from egraft.testing.corpus import entry, make_feeds, model_path
    from egraft.testing.corpus.compare import compare_outputs
    from egraft.testing.timing import alternating_blocks_ms

    e = entry(name)
    path = model_path(name)
    options = ort.SessionOptions()
    options.intra_op_num_threads = 1
    options.inter_op_num_threads = 1
    options.log_severity_level = 3
    session = ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
    with temporary_cache():
        start = time.perf_counter()
        compiled = egraft.compile(str(path), use_cache=False, threads=1,
                                  specialize="auto" if specialize else "off")
        compile_s = time.perf_counter() - start
        generic = getattr(compiled, "generic", compiled)
        for binding in e.bindings:
            feeds = make_feeds(e, binding)
            fallbacks = len(generic.report(binding.dims).fallbacks)
            start = time.perf_counter()
            out = generic.run(feeds)
            first_ms = (time.perf_counter() - start) * 1e3
            want = dict(zip([o.name for o in session.get_outputs()], session.run(None, feeds)))
            error = compare_outputs(out, want).error
            warm = alternating_blocks_ms({"egraft": lambda: generic.run(feeds),
                                          "onnxruntime": lambda: session.run(None, feeds)}, budget_s=1.5, rounds=3)
            row = {"model": name, "binding": binding.label, "compile_s": round(compile_s, 2), "fallbacks": fallbacks,
                   "first_ms": first_ms, "warm_ms": warm["egraft"], "ort_ms": warm["onnxruntime"], "error": error,
                   "tolerance": e.tolerance}
            if specialize:
                compiled.run(feeds)  # asks for the variant
                compiled.wait(timeout=600)
                state = compiled.variants.get(compiled.guard(feeds), "no binding")
                row["variant"] = state
                if state == "ready":
                    variant_error = compare_outputs(compiled.run(feeds), want).error
                    timed = alternating_blocks_ms({"variant": lambda: compiled.run(feeds),
                                                   "onnxruntime": lambda: session.run(None, feeds)},
                                                  budget_s=1.5, rounds=3)
                    row.update(variant_ms=timed["variant"], variant_error=variant_error)
            print(MARK + json.dumps(row), flush=True)
    return 0


def _symbolic(name: str) -> bool:
    from egraft.testing.corpus import entry

    return any(isinstance(d, str) for spec in entry(name).inputs for d in spec.shape)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", nargs="*", help="corpus models to run (default: every one with symbolic dims)")
    parser.add_argument("--specialize", action="store_true", help="also time each shape's specialized variant")
    parser.add_argument("--json", help="write the rows here")
    parser.add_argument("--timeout", type=float, default=600)
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        return _worker(args.worker, args.specialize)
    from egraft.testing.corpus import entries, fetch

    names = args.only or [e.name for e in entries() if _symbolic(e.name)]
    fetch(names)
    rows = []
    for name in names:
        command = [sys.executable, __file__, "--worker", name] + (["--specialize"] if args.specialize else [])
        try:
            done = subprocess.run(command, capture_output=True, text=True, timeout=args.timeout)
            got = [json.loads(line[len(MARK):]) for line in done.stdout.splitlines() if line.startswith(MARK)]
            if not got:
                tail = (done.stderr.strip().splitlines() or [f"exit {done.returncode}"])[-1]
                got = [{"model": name, "binding": "-", "failure": tail}]
        except subprocess.TimeoutExpired:
            got = [{"model": name, "binding": "-", "failure": f"timed out after {args.timeout:.0f} s"}]
        rows += got
        for row in got:
            print(_line(row), flush=True)
    _table(rows, args.specialize)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0 if all("failure" not in r and r["error"] <= r["tolerance"] for r in rows) else 1


def _line(row: dict) -> str:
    if "failure" in row:
        return f"{row['model']}: FAILED {row['failure']}"
    return f"{row['model']} [{row['binding']}]: first {row['first_ms']:.2f} ms, warm {row['warm_ms']:.3f} ms"


def _table(rows: list[dict], specialize: bool) -> None:
    head = ["model", "binding", "ref. nodes", "first call ms", "warm ms", "first/warm", "onnxruntime ms",
            "egraft/ort", "error", "ok"]
    if specialize:
        head[8:8] = ["variant ms", "variant/ort"]
    print("\n| " + " | ".join(head) + " |\n|" + "---|" * len(head))
    for r in rows:
        if "failure" in r:
            print(f"| {r['model']} | - | FAILED: {r['failure']} |")
            continue
        cells = [r["model"], r["binding"], str(r["fallbacks"]), f"{r['first_ms']:.2f}", f"{r['warm_ms']:.3f}",
                 f"{r['first_ms'] / r['warm_ms']:.2f}", f"{r['ort_ms']:.3f}", f"{r['warm_ms'] / r['ort_ms']:.2f}",
                 f"{r['error']:.1e}", "yes" if r["error"] <= r["tolerance"] else "NO"]
        if specialize:
            v = r.get("variant_ms")
            cells[8:8] = [f"{v:.3f}" if v else r.get("variant", "-"), f"{v / r['ort_ms']:.2f}" if v else "-"]
        print("| " + " | ".join(cells) + " |")
    ok = [r for r in rows if "failure" not in r]
    if ok:
        import statistics

        ratios = sorted(r["first_ms"] / r["warm_ms"] for r in ok)
        print(f"\n{len(ok)} shapes of {len({r['model'] for r in ok})} models, one build each; "
              f"first call / warm: median {statistics.median(ratios):.2f}, max {ratios[-1]:.2f}; "
              f"matching onnxruntime: {sum(r['error'] <= r['tolerance'] for r in ok)}/{len(ok)}")


if __name__ == "__main__":
    sys.exit(main())

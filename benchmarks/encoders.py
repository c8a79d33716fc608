"""Transformer encoders, egraft against onnxruntime: the test encoder and the corpus's
BERT-like encoders (fp32 paraphrase-MiniLM-L3, int8 all-MiniLM-L6, int8 T5), batch 1, at
sequence 16 and 128, at 1 and 2 threads, in one run.

Per encoder: one compile with its dims left symbolic (the build every sequence length runs
on), the outputs at each length checked against onnxruntime (basic optimizations: the
reference for ONNX semantics); then per length and thread count the median latency of
egraft and of onnxruntime (every optimization, that many intra-op threads) timed in
alternating blocks, their ratio, and egraft's overhead share ((latency - time inside
kernels) / latency, the kernel time from a profiled run). Each encoder in its own process.
An error past the entry's tolerance also shows how far onnxruntime moves from itself when
the float inputs and weights move one ulp (``ort_sensitivity``: dynamic int8 quantization
amplifies rounding); it fails only when egraft is further from onnxruntime than that.

The test encoder's position table has 64 rows: its longer lengths run at 64.

Run: python benchmarks/encoders.py [--only NAME...] [--lengths 16 128] [--threads 1 2] [--budget 2]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys

for _var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_var, "1")

MARK = "@@encoders@@"
#: name -> (corpus entry or None for the test encoder, kind)
ENCODERS = {"test encoder": (None, "fp32"), "paraphrase_minilm_l3": ("paraphrase_minilm_l3", "fp32"),
            "minilm_l6_int8": ("minilm_l6_int8", "int8"), "t5_encoder_int8": ("t5_encoder_int8", "int8")}
#: the longest sequence an encoder's position table holds (the test encoder's has 64 rows:
#: a longer input is refused by egraft and mis-shaped in onnxruntime)
MAX_LENGTH = {"test encoder": 64}


def _feeds(name: str, length: int):
    """(model path or proto, feeds, tolerance) at batch 1 and ``length`` tokens."""
    entry_name, _ = ENCODERS[name]
    if entry_name is None:
        from egraft.testing.bench import encoder_inputs, encoder_model

        return encoder_model(), encoder_inputs(1, length), 1e-3
    from egraft.testing.corpus import Binding, entry, fetch, make_feeds, model_path

    e = entry(entry_name)
    fetch([entry_name], progress=None)
    symbols = [d for spec in e.inputs for d in spec.shape if isinstance(d, str)]
    batch, sequence = symbols[0], symbols[1]
    return str(model_path(entry_name)), make_feeds(e, Binding(dims={batch: 1, sequence: length})), e.tolerance


def _measure(name: str, lengths: list[int], threads: list[int], budget: float) -> dict:
    import onnx

    import egraft
    from egraft.testing.bench import ort_session, temporary_cache
    from egraft.testing.corpus.compare import compare_outputs
    from egraft.testing.timing import against_onnxruntime

    temporary_cache()
    model, _, _ = _feeds(name, lengths[0])
    proto = model if isinstance(model, onnx.ModelProto) else onnx.load(model)
    compiled = egraft.compile(model)
    judge = ort_session(proto, threads=1, exact=True)
    sessions = {t: ort_session(proto, threads=t) for t in threads}
    rows = []
    for length in sorted({min(n, MAX_LENGTH.get(name, n)) for n in lengths}):
        _, feeds, tolerance = _feeds(name, length)
        compiled.run(feeds)
        compiled.wait()
        reference = dict(zip([o.name for o in judge.get_outputs()], judge.run(None, feeds)))
        error = compare_outputs(compiled.run(feeds), reference).error
        itself = None  # past the tolerance: how far onnxruntime moves from itself on data nudged one ulp
        if error > tolerance and not isinstance(model, onnx.ModelProto):
            from egraft.testing.corpus.compare import ort_sensitivity

            itself = ort_sensitivity(model, feeds)
        for count in threads:
            compiled.threads = count
            timing = against_onnxruntime(compiled, sessions[count], feeds, budget)
            rows.append(dict(encoder=name, kind=ENCODERS[name][1], length=length, threads=count, error=error,
                             tolerance=tolerance, ort_itself=itself, **timing))
    return dict(encoder=name, rows=rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", nargs="+", metavar="NAME", choices=list(ENCODERS))
    parser.add_argument("--lengths", nargs="+", type=int, default=[16, 128])
    parser.add_argument("--threads", nargs="+", type=int, default=[1, 2])
    parser.add_argument("--budget", type=float, default=2.0)
    parser.add_argument("--timeout", type=float, default=900)
    parser.add_argument("--worker", metavar="NAME", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        print(MARK + json.dumps(_measure(args.worker, args.lengths, args.threads, args.budget)), flush=True)
        return
    from rich.console import Console
    from rich.markup import escape
    from rich.table import Table

    table = Table(title="Encoders, batch 1: egraft vs onnxruntime "
                        "(medians of alternating blocks; ratios paired per round)")
    for column in ("encoder", "kind", "sequence", "threads", "egraft ms", "onnxruntime ms", "egraft / ort",
                   "overhead share", "error (tolerance)"):
        table.add_column(column, justify="left" if column in ("encoder", "kind") else "right")
    ratios = []
    for name in args.only or list(ENCODERS):
        command = [sys.executable, __file__, "--worker", name, "--lengths", *map(str, args.lengths), "--threads",
                   *map(str, args.threads), "--budget", str(args.budget)]
        try:
            done = subprocess.run(command, capture_output=True, text=True, timeout=args.timeout)
            found = [json.loads(line[len(MARK):]) for line in done.stdout.splitlines() if line.startswith(MARK)]
            failure = None if found else ([x for x in done.stderr.splitlines() if x.strip()] or ["no output"])[-1]
        except subprocess.TimeoutExpired:
            found, failure = [], f"no result within {args.timeout:.0f} s"
        if failure:
            table.add_row(name, ENCODERS[name][1], "", "", "failed", "", "", "", escape(failure[:80]))
            continue
        for r in found[0]["rows"]:
            ratio = r.get("ratio", r["egraft_ms"] / r["ort_ms"])
            ratios.append(ratio)
            itself = r.get("ort_itself")
            if r["error"] <= r["tolerance"]:
                flag = ""
            elif itself is not None and r["error"] <= itself:  # no closer than onnxruntime is to itself
                flag = f"; ort vs itself {itself:.1e}"
            else:
                flag = f"; ort vs itself {itself:.1e} FAIL" if itself is not None else " FAIL"
            table.add_row(name, r["kind"], str(r["length"]), str(r["threads"]), f"{r['egraft_ms']:.3g}",
                          f"{r['ort_ms']:.3g}", f"{ratio:.2f}", f"{r['overhead']:.1%}",
                          f"{r['error']:.1e} ({r['tolerance']:.0e}{flag})")
        print(f"{name}: done", file=sys.stderr, flush=True)
    geomean = math.exp(sum(map(math.log, ratios)) / len(ratios)) if ratios else float("nan")
    table.caption = f"geometric mean egraft / onnxruntime {geomean:.3f} over {len(ratios)} runs"
    Console(width=200).print(table)


if __name__ == "__main__":
    main()

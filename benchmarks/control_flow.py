"""Control flow compiled (issue 15, item 4): the corpus models with If nodes, with the
If/Loop/Scan bodies compiled into sub-programs (now) and with the nodes on the reference
interpreter (before: ``--before``), side by side with onnxruntime.

For each model and input binding it prints the fallbacks of the generic build, those of
the programs that run once a call has shown the ranks that only a run knows (the rank
variants; a body that has not run yet counts with its generic build), the largest error
against onnxruntime and the median latency of many calls on one thread.

Usage:
    python benchmarks/control_flow.py [--before] [--calls 300] [model ...]
"""

from __future__ import annotations

import argparse

import onnxruntime as ort

import egraft
from egraft.testing.corpus import entry, make_feeds, model_path
from egraft.testing.corpus.compare import compare_outputs, ort_outputs
from egraft.testing.timing import median_ms

MODELS = ["akiki_vad", "silero_vad_16k_op15", "silero_vad_ifless_op18", "silero_vad_v5"]


def running_fallbacks(compiled, dims) -> list[tuple[str, str, str]]:
    """The fallbacks of what a call runs now: the newest rank variant of each program (its
    generic build when it has none), bodies included."""
    program = compiled.variants()[-1] if compiled.variants() else compiled
    found = [f for f in program.report(dims).fallbacks if " / " not in f[0]]
    for name, body in program.bodies().items():
        found += [(f"{name}: {label}", op, reason) for label, op, reason in running_fallbacks(body, dims)]
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("models", nargs="*", default=MODELS)
    parser.add_argument("--before", action="store_true", help="If/Loop/Scan on the reference interpreter")
    parser.add_argument("--calls", type=int, default=300)
    args = parser.parse_args()
    if args.before:
        import egraft.lowering.compile as lowering

        lowering.is_control = lambda node: False
        lowering.inline_constant_ifs = lambda graph: graph
    options = ort.SessionOptions()
    options.intra_op_num_threads = 1
    print(f"{'model':24} {'binding':30} {'generic':>7} {'running':>7} {'error':>9} {'egraft ms':>9} {'ort ms':>7}")
    for name in args.models:
        e = entry(name)
        path = model_path(e.name)
        compiled = egraft.compile(str(path), use_cache=False, threads=1)
        session = ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
        for binding in e.bindings:
            feeds = make_feeds(e, binding)
            error = 0.0
            for _ in range(3):  # each run may learn ranks; their variants build in the background
                error = max(error, compare_outputs(compiled.run(feeds), ort_outputs(path, feeds)).error)
                compiled.wait()
            generic = len(compiled.report(binding.dims).fallbacks)
            running = len(running_fallbacks(compiled, binding.dims))
            ours = median_ms(lambda: compiled.run(feeds), args.calls, warmup=10)
            theirs = median_ms(lambda: session.run(None, feeds), args.calls, warmup=10)
            print(f"{name:24} {binding.label:30} {generic:7d} {running:7d} {error:9.2e} {ours:9.3f} {theirs:7.3f}")


if __name__ == "__main__":
    main()

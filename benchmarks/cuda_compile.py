"""The CUDA build of every bundled model and the test encoder, on a machine without a GPU:
kernel launches per run, distinct modules, registers (max), spills, shared memory (max),
ops on the host (fallbacks) and compile seconds per stage (NVRTC cold: no cubin cache).
``--emulate`` also runs each build on the emulated device (the same CUDA C compiled for
this CPU) on a seeded input and gives its error against onnxruntime (scale-relative: max
|diff| / max |reference|; the bundled models re-weighted with seeded random weights).

Example:
    python benchmarks/cuda_compile.py --arch sm_90 --emulate
"""

from __future__ import annotations

import argparse
import time

import onnx
from rich.console import Console
from rich.table import Table

import egraft
from egraft.testing.encoder import encoder_model
from egraft.testing.models import LIGHT_MODELS, light_model_path, reweight


def _bundled(name: str) -> onnx.ModelProto:
    """A bundled model with seeded random weights and its logits (before the final Softmax,
    which saturates) as an output too."""
    from egraft.testing.models import softmax_logits, with_outputs

    proto = onnx.load(light_model_path(name))
    return with_outputs(reweight(proto, seed=0), softmax_logits(proto))


def _emulated(compiled, model, name: str) -> tuple[str, str]:
    """(error against onnxruntime, seconds) of one run of ``compiled`` on the emulated device."""
    import numpy as np
    import onnxruntime as ort

    from egraft.testing.encoder import encoder_inputs

    if name == "encoder":
        feeds = encoder_inputs(2, 16)
    else:
        graph = egraft.load(model)
        feeds = {v.name: np.random.default_rng(0).normal(size=[int(d) for d in v.type.shape]).astype(np.float32)
                 for v in graph.inputs}
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL  # its rewrites approximate
    session = ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
    want = dict(zip([o.name for o in session.get_outputs()], session.run(None, feeds)))
    start = time.perf_counter()
    got = compiled.run(feeds)
    seconds = time.perf_counter() - start
    error = max(float(np.abs(got[k] - v).max() / max(np.abs(v).max(), 1e-30)) for k, v in want.items())
    return f"{error:.1e}", f"{seconds:.1f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", default="sm_90")
    parser.add_argument("--only", nargs="*")
    parser.add_argument("--emulate", action="store_true", help="run each build on the emulated device too")
    args = parser.parse_args()
    table = Table(title=f"CUDA builds for {args.arch} (NVRTC, no GPU; cold)")
    emulated = ("emulated err", "emulated s") if args.emulate else ()
    for col in ("model", "launches", "modules", "max registers", "spill bytes", "max shared KiB", "fallbacks",
                "optimize s", "lower s", "nvrtc s", "total s", *emulated):
        table.add_column(col, justify="left" if col == "model" else "right")
    for name in args.only or [*LIGHT_MODELS, "encoder"]:
        model = encoder_model() if name == "encoder" else _bundled(name)
        start = time.perf_counter()
        compiled = egraft.compile(model, target="cuda", arch=args.arch, use_cache=False,
                                  device="emulator" if args.emulate else "cuda")
        total = time.perf_counter() - start
        report = compiled.report()
        kernels = report["kernels"]
        seconds = report["seconds"]
        table.add_row(name, str(len(kernels)), str(report["modules"]),
                      str(max(k["registers"] for k in kernels)), str(sum(k["spill_bytes"] for k in kernels)),
                      f"{max(k['shared_bytes'] for k in kernels) / 1024:.1f}", str(len(report["fallbacks"])),
                      f"{seconds.get('optimize', 0):.2f}", f"{seconds.get('lower', 0):.2f}",
                      f"{seconds.get('nvrtc', 0):.2f}", f"{total:.2f}", *(_emulated(compiled, model, name)
                                                                         if args.emulate else ()))
    Console(width=200).print(table)


if __name__ == "__main__":
    main()

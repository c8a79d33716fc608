"""The CUDA build of every bundled model and the test encoder, on a machine without a GPU:
kernel launches per run, distinct modules, registers (max), spills, shared memory (max),
ops on the host (fallbacks) and compile seconds per stage (NVRTC cold: no cubin cache).

Example:
    python benchmarks/cuda_compile.py --arch sm_90
"""

from __future__ import annotations

import argparse
import time

from rich.console import Console
from rich.table import Table

import egraft
from egraft.testing.encoder import encoder_model
from egraft.testing.models import LIGHT_MODELS, light_model_path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", default="sm_90")
    parser.add_argument("--only", nargs="*")
    args = parser.parse_args()
    table = Table(title=f"CUDA builds for {args.arch} (NVRTC, no GPU; cold)")
    for col in ("model", "launches", "modules", "max registers", "spill bytes", "max shared KiB", "fallbacks",
                "optimize s", "lower s", "nvrtc s", "total s"):
        table.add_column(col, justify="left" if col == "model" else "right")
    for name in args.only or [*LIGHT_MODELS, "encoder"]:
        model = encoder_model() if name == "encoder" else str(light_model_path(name))
        start = time.perf_counter()
        compiled = egraft.compile(model, target="cuda", arch=args.arch, use_cache=False)
        total = time.perf_counter() - start
        report = compiled.report()
        kernels = report["kernels"]
        seconds = report["seconds"]
        table.add_row(name, str(len(kernels)), str(report["modules"]),
                      str(max(k["registers"] for k in kernels)), str(sum(k["spill_bytes"] for k in kernels)),
                      f"{max(k['shared_bytes'] for k in kernels) / 1024:.1f}", str(len(report["fallbacks"])),
                      f"{seconds.get('optimize', 0):.2f}", f"{seconds.get('lower', 0):.2f}",
                      f"{seconds.get('nvrtc', 0):.2f}", f"{total:.2f}")
    Console(width=160).print(table)


if __name__ == "__main__":
    main()

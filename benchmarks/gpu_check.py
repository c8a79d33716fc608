"""The CUDA backend on a real GPU: numbers against onnxruntime (CPU) and latency beside
PyTorch, for the nine bundled models and the test encoder. Run it whenever a GPU is at hand.

It is written for a fresh machine with an NVIDIA GPU, CuPy, numpy, onnx, onnxruntime (CPU)
and PyTorch installed but nothing downloadable (the lent H200): what egraft needs beyond
that (egglog and its imports, lark) travels as wheels in ``--wheels`` (fetch them here with
``benchmarks/gpu_wheels.sh``) and is installed into a temporary folder, no network used.

Per model: compile for the device's architecture (seconds, kernels, registers, spills),
run a seeded input, compare with onnxruntime on the CPU (max |diff| / max |ref| <= 1e-3),
then time in alternating blocks: egraft's ``run`` (numpy in and out: copies included),
egraft with device-resident CuPy arrays, the same replayed as a CUDA graph, and PyTorch's torchvision model of the same
architecture (eager and CUDA graph, TF32 off) where there is one. Writes ``gpu_check.json``
and ``gpu_check.md`` under ``--out``.

Example (on the device machine, from the repository root; ``--emulate`` is a dry run of
the same script on a machine without a GPU):
    python benchmarks/gpu_check.py --wheels .gpu_wheels --out $OUT --repeat 20
    python benchmarks/gpu_check.py --emulate --only squeezenet encoder --out /tmp/dry
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TORCHVISION = {"bvlc_alexnet": "alexnet", "densenet121": "densenet121", "inception_v1": "googlenet",
               "resnet50": "resnet50", "squeezenet": "squeezenet1_0", "vgg19": "vgg19",
               "shufflenet": "shufflenet_v2_x1_0"}


def ensure_imports(wheels: str | None) -> None:
    """egraft from this tree; egglog and lark from ``wheels`` when they are not installed."""
    sys.path.insert(0, str(ROOT))
    try:
        import egglog  # noqa: F401
        import lark  # noqa: F401
        return
    except ImportError:
        pass
    if not wheels or not glob.glob(os.path.join(wheels, "*.whl")):
        sys.exit("egglog or lark is missing and --wheels has no wheels (benchmarks/gpu_wheels.sh fetches them)")
    target = os.path.join(tempfile.gettempdir(), "egraft-gpu-deps")
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--target", target,
                    *glob.glob(os.path.join(wheels, "*.whl"))], check=True)
    sys.path.insert(0, target)


def median_ms(fn, sync, repeat: int) -> float:
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        sync()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def torch_runner(name: str, x):
    """PyTorch's model of the same architecture (random weights): eager and CUDA-graph callables."""
    import torch
    import torchvision

    torch.backends.cudnn.benchmark = True
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    kwargs = {"aux_logits": False, "init_weights": True} if name == "googlenet" else {}
    model = getattr(torchvision.models, name)(weights=None, **kwargs).cuda().eval()
    inp = torch.from_numpy(x).cuda()
    with torch.no_grad():
        for _ in range(3):
            model(inp)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(2):
                model(inp)
        torch.cuda.current_stream().wait_stream(stream)
        with torch.cuda.graph(graph):
            model(inp)

    def eager():
        with torch.no_grad():
            model(inp)
    return eager, graph.replay, torch.cuda.synchronize


def check_model(name: str, repeat: int, rounds: int, emulate: bool = False) -> dict:
    import numpy as np
    import onnx
    import onnxruntime as ort

    import egraft
    from egraft.testing.encoder import encoder_inputs, encoder_model
    from egraft.testing.models import light_model_path, reweight, softmax_logits, with_outputs

    if emulate:  # a dry run on a machine without a GPU: the CUDA C on the emulated device, no timings
        arch = "sm_90"
    else:
        import cupy

        arch = "sm_{}{}".format(*cupy.cuda.Device().compute_capability)
    if name == "encoder":
        model, feeds = encoder_model(), encoder_inputs(1, 64)  # its position table has 64 rows
    else:
        proto = onnx.load(light_model_path(name))
        model = with_outputs(reweight(proto, seed=0), softmax_logits(proto))  # the logits too: Softmax saturates
        feeds = {v.name: np.random.default_rng(0).normal(size=[int(d) for d in v.type.shape]).astype(np.float32)
                 for v in egraft.load(model).inputs}
    row: dict = {"model": name, "arch": arch}
    start = time.perf_counter()
    compiled = egraft.compile(model, target="cuda", arch=arch, device="emulator" if emulate else "cuda")
    row["compile_s"] = round(time.perf_counter() - start, 2)
    report = compiled.report()
    row.update(kernels=len(report["kernels"]), fallbacks=len(report["fallbacks"]),
               max_registers=max((k["registers"] or 0 for k in report["kernels"]), default=0),
               spill_bytes=sum(k["spill_bytes"] or 0 for k in report["kernels"]))
    options = ort.SessionOptions()  # its graph rewrites approximate (7e-3 on the encoder): off
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    session = ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
    want = dict(zip([o.name for o in session.get_outputs()], session.run(None, feeds)))
    got = compiled.run(feeds)
    errors = [float(np.abs(got[k] - v).max() / max(np.abs(v).max(), 1e-30)) for k, v in want.items()]
    row["max_rel_error"] = max(errors)
    row["matches"] = row["max_rel_error"] <= 1e-3
    if emulate:
        return row
    device_feeds = {k: cupy.asarray(v) for k, v in feeds.items()}
    sync = cupy.cuda.get_current_stream().synchronize
    from egraft.lowering.cuda_runtime import CudaModel

    graphed = CudaModel(compiled.program, cuda_graph=True)
    runners = {"egraft": lambda: compiled.run(feeds), "egraft_device": lambda: compiled.run(device_feeds),
               "egraft_graph": lambda: graphed.run(device_feeds)}
    if name in TORCHVISION:
        eager, replay, torch_sync = torch_runner(TORCHVISION[name], next(iter(feeds.values())))
        runners.update(torch_eager=eager, torch_graph=replay)
    else:
        torch_sync = sync
    timings: dict[str, list[float]] = {k: [] for k in runners}
    for fn in runners.values():
        fn()  # warm up
    for _ in range(rounds):  # alternating blocks
        for key, fn in runners.items():
            timings[key].append(median_ms(fn, torch_sync if key.startswith("torch") else sync, repeat))
    row.update({f"{k}_ms": round(statistics.median(v), 3) for k, v in timings.items()})
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--wheels", default=".gpu_wheels")
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    parser.add_argument("--repeat", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--only", nargs="*")
    parser.add_argument("--emulate", action="store_true",
                        help="no GPU: run the CUDA builds on the emulated device and skip the timings (a dry run)")
    args = parser.parse_args()
    ensure_imports(args.wheels)
    from egraft.testing.models import LIGHT_MODELS

    names = args.only or [*LIGHT_MODELS, "encoder"]
    rows = []
    for name in names:
        try:
            rows.append(check_model(name, args.repeat, args.rounds, args.emulate))
        except Exception as e:  # one model's failure is a row, not the end of the run
            rows.append({"model": name, "error": f"{type(e).__name__}: {e}", "trace": traceback.format_exc()[-2000:]})
        print(json.dumps(rows[-1]), flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "gpu_check.json").write_text(json.dumps(rows, indent=1))
    columns = ["model", "compile_s", "kernels", "fallbacks", "max_registers", "spill_bytes", "max_rel_error",
               "egraft_ms", "egraft_device_ms", "egraft_graph_ms", "torch_eager_ms", "torch_graph_ms", "error"]
    lines = ["| " + " | ".join(columns) + " |", "|" + " --- |" * len(columns)]
    for row in rows:
        lines.append("| " + " | ".join(str(row.get(c, "")) for c in columns) + " |")
    (out / "gpu_check.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()

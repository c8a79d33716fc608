"""What the benchmarks share: the zoo's models with their inputs, onnxruntime sessions at
a given thread count, and the reference outputs a compiled model is checked against.

The zoo is the light models (:data:`egraft.testing.models.LIGHT_MODELS`, re-weighted so
that a wrong kernel cannot hide behind a saturated softmax, with the softmax's logits as
an extra output) and the test encoder (batch 1, 64 tokens).

Example:
    >>> model, feeds = zoo_model("encoder")          # doctest: +SKIP
    >>> session = ort_session(model, threads=1)       # doctest: +SKIP
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx

from egraft.testing.encoder import encoder_inputs, encoder_model
from egraft.testing.models import LIGHT_MODELS, backend_input, light_model_path, reweight, softmax_logits, with_outputs

#: Every model the zoo benchmarks run, in order.
ZOO = (*LIGHT_MODELS, "encoder")


def zoo_model(name: str) -> tuple[onnx.ModelProto, dict[str, np.ndarray]]:
    """The model ``name`` of :data:`ZOO` as the benchmarks run it, and its inputs."""
    if name == "encoder":
        return encoder_model(), encoder_inputs(1, 64)
    if name not in LIGHT_MODELS:
        raise ValueError(f"{name!r}: not in the zoo; known: {', '.join(ZOO)}")
    source = onnx.load(light_model_path(name))
    return with_outputs(reweight(source, seed=0), softmax_logits(source)), backend_input(source)


def exact_integer_products(options) -> None:
    """Make an onnxruntime session's ``options`` compute u8 x s8 integer products exactly
    (``session.x64quantprecision``): on x86 without VNNI (SSE4.1, AVX2, AVX-512 without VNNI,
    this znver3 among them) its products otherwise add pairs of byte products in saturating
    int16 (``vpmaddubsw``), so MatMulInteger, ConvInteger and DynamicQuantizeLSTM differ from
    the exact int32 products ONNX defines: 31 of a 2 x 33 MatMulInteger's outputs here. A
    reference must be exact; a speed comparison keeps onnxruntime's default."""
    options.add_session_config_entry("session.x64quantprecision", "1")


def ort_session(model: onnx.ModelProto, threads: int = 1, exact: bool = False):
    """An onnxruntime CPU session with ``threads`` intra-op threads (one inter-op thread).
    ``exact`` keeps to the basic graph optimizations and exact integer products
    (:func:`exact_integer_products`): the reference for ONNX semantics (the extended ones
    include lossy rewrites); otherwise every optimization, as deployed."""
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    options.inter_op_num_threads = 1
    options.log_severity_level = 3
    if exact:
        options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_BASIC
        exact_integer_products(options)
    return ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])


def reference_outputs(model: onnx.ModelProto, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The outputs onnxruntime (basic optimizations) gives, by name."""
    session = ort_session(model, threads=1, exact=True)
    return dict(zip([o.name for o in session.get_outputs()], session.run(None, feeds)))


__all__ = ["ZOO", "zoo_model", "ort_session", "reference_outputs"]


def temporary_cache() -> Path:
    """Point ``EGRAFT_CACHE_DIR`` at a fresh directory, removed when the process exits (a
    benchmark's builds take gigabytes); returns it.

    Example:
        >>> folder = temporary_cache()              # doctest: +SKIP
    """
    import atexit
    import os
    import shutil
    import tempfile

    folder = Path(tempfile.mkdtemp(prefix="egraft-bench-cache-"))
    os.environ["EGRAFT_CACHE_DIR"] = str(folder)
    atexit.register(shutil.rmtree, folder, ignore_errors=True)
    return folder

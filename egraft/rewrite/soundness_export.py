"""A counterexample as a runnable ONNX model, for the soundness checker
(:mod:`egraft.rewrite.soundness`): the instance's inputs, and two outputs, ``before`` (the
program the rule matched) and ``after`` (its replacement), so that onnxruntime shows the
difference. egraft's own ops become model-local functions (:func:`egraft.frontend.onnx_export.to_onnx`).
The failing draw's inputs are saved beside it (``<rule>.inputs.npz``).

Example:
    >>> path = write_counterexample(rule, graph, feed, 18, Path("out"))   # doctest: +SKIP
    >>> sess = onnxruntime.InferenceSession(str(path))                    # doctest: +SKIP
    >>> before, after = sess.run(None, dict(np.load(path.with_suffix(".inputs.npz"))))  # doctest: +SKIP
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from pathlib import Path

import numpy as np
import onnx

from egraft.ir.graph import Graph
from egraft.rewrite.ast import Rule
from egraft.rewrite.soundness_engine import Applied, apply_rule

__all__ = ["counterexample_path", "write_counterexample"]


def counterexample_path(folder: Path, rule_name: str) -> Path:
    """``folder/<rule>.onnx``, the rule's name made a file name (``conv/without_b`` ->
    ``conv__without_b``)."""
    return Path(folder) / (re.sub(r"[^A-Za-z0-9_.-]", "__", rule_name) + ".onnx")


def write_counterexample(rule: Rule, graph: Graph, feed: Mapping[str, np.ndarray], opset: int,
                         folder: Path) -> Path:
    """Apply ``rule`` to the instance ``graph`` once more and write the matched program and
    its replacement as one ONNX model (checked by ``onnx.checker``) with the draw ``feed``
    beside it; returns the model's path. Raises ValueError when the rule does not apply.

    Example: ``write_counterexample(rule, graph, feed, 18, Path("out"))`` -> ``Path("out/relu_drop.onnx")``.
    """
    from egraft.frontend.onnx_export import to_onnx

    applied = apply_rule(rule, graph, opset, both=True)
    if not isinstance(applied, Applied) or applied.both is None:
        raise ValueError(f"the rule no longer applies to its counterexample: {applied.detail}")
    model = to_onnx(applied.both)
    onnx.checker.check_model(model)
    path = counterexample_path(folder, rule.name)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(model.SerializeToString())
    names = {v.name for v in applied.both.inputs}
    np.savez(path.with_suffix(".inputs.npz"), **{k: np.asarray(v) for k, v in feed.items() if k in names})
    return path

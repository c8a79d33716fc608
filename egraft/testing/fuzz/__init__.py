"""Differential testing in the spirit of NNSmith: random valid ONNX graphs
(:func:`generate`), run by egraft's reference executor and its compiled backend and judged
against onnxruntime (:func:`check`), and a delta-debugging minimizer for the failures
(:func:`minimize`). ``benchmarks/fuzz.py`` runs many seeds and tabulates the outcomes.

Example:
    >>> case = generate(3)                      # doctest: +SKIP
    >>> [r.outcome for r in check(case)]        # doctest: +SKIP
    ['ok', 'ok']
"""

from egraft.testing.fuzz.generate import FuzzCase, generate

__all__ = ["FuzzCase", "generate"]

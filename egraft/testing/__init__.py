"""Helpers for tests and benchmarks: the bundled models, re-weighting, comparisons."""

"""The ONNX backend node conformance suite through egraft: the pass-rate floor."""

from __future__ import annotations

import pytest

from egraft.conformance import run_conformance, summarize


@pytest.fixture(scope="module")
def summary():
    return summarize(run_conformance())


def test_core_pass_rate_is_at_least_090(summary):
    core = summary["core"]
    assert core["total"] >= 1500
    assert core["pass_rate"] >= 0.90, core


def test_every_failure_says_why(summary):
    for failure in summary["failures"]:
        assert failure["detail"], failure["name"]


def test_unsupported_cases_are_exotic_types_or_named_ops(summary):
    for failure in summary["failures"]:
        if failure["status"] == "unsupported":
            detail = failure["detail"]
            assert "not supported" in detail or "supports tensor" in detail or "unsupported op" in detail, detail

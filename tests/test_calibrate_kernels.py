"""``egraft calibrate --kernels``: the fit (on synthetic measurements from a known profile),
the saved profile as the cost model reads it, and a small real run through the CLI."""

from __future__ import annotations

import math

import pytest
from typer.testing import CliRunner

from egraft.cli import app
from egraft.errors import EgraftError
from egraft.extract.calibrate_kernels import (
    SOURCE_TAG,
    FamilyFit,
    fit_error,
    fit_families,
    fitted_profile,
    has_kernel_fit,
    predict_us,
    synthetic_samples,
)
from egraft.extract.cost import Roofline, cost_model
from egraft.extract.kernel_cases import kernel_cases
from egraft.extract.profiles import SHIPPED_DIR, Profile, load_profile, save_profile, user_profile_path
from egraft.ir.work import Work

runner = CliRunner()
MACHINE = Profile("cpu-host", "cpu", peak_gflops=80.0, bandwidth_gbs=25.0, launch_us=1.0,
                  source="measured 2026-01-01: test figures")
#: The "real" machine the synthetic samples come from: conv at 60% of peak and slow on
#: memory, elementwise with its data in cache, layout (no flops) at half the bandwidth.
TRUTH = Profile("cpu-host", "cpu", peak_gflops=80.0, bandwidth_gbs=25.0, launch_us=1.0,
                efficiency={"conv": 0.6, "elementwise": 0.3, "gemm": 0.85},
                bandwidth_efficiency={"conv": 0.4, "elementwise": 2.5, "gemm": 1.0, "layout": 0.5})
#: (flops, bytes) of kernels on both sides of the ridge point (80 / 25 = 3.2 flop/byte).
MIXED = [(5e7, 5e5), (1e8, 2e6), (2e6, 2e6), (1e6, 8e6), (3e7, 1e5), (4e5, 3e6)]


def _samples(noise: float = 0.0):
    samples = []
    for i, family in enumerate(("conv", "elementwise", "gemm")):
        samples += synthetic_samples(TRUTH, family, MIXED, noise=noise, seed=i)
    samples += synthetic_samples(TRUTH, "layout", [(0.0, b) for b in (1e5, 1e6, 4e6, 1.6e7)], noise=noise, seed=9)
    return samples


def test_the_fit_recovers_the_parameters_that_made_the_measurements():
    fits = fit_families(_samples(), MACHINE)
    assert list(fits) == ["conv", "gemm", "elementwise", "layout"]  # the order of FAMILIES
    for family, fit in fits.items():
        assert fit.samples == (4 if family == "layout" else len(MIXED))
        assert fit.bandwidth_efficiency == pytest.approx(TRUTH.bandwidth_efficiency[family], rel=0.01)
        assert fit.error == pytest.approx(1.0, abs=0.01) and fit.error_before > 1.05
        if family != "layout":
            assert fit.efficiency == pytest.approx(TRUTH.efficiency[family], rel=0.01)
    # layout kernels do no arithmetic: their efficiency is not seen, so it stays as it was
    assert fits["layout"].efficiency == MACHINE.family_efficiency("layout") == 1.0


def test_the_fit_tolerates_noise_and_a_wild_outlier():
    samples = _samples(noise=0.1)
    slow = synthetic_samples(TRUTH, "conv", [(1e6, 1e5)])[0]
    samples.append(type(slow)(**{**slow.__dict__, "measured_us": slow.measured_us * 30}))  # a 30x slower kernel
    conv = fit_families(samples, MACHINE)["conv"]
    assert conv.efficiency == pytest.approx(0.6, rel=0.15)
    assert conv.bandwidth_efficiency == pytest.approx(0.4, rel=0.15)
    assert 1.0 < conv.error < 2.0  # the outlier alone is 30 ** (1 / 7) = 1.63x of it


def test_a_number_the_samples_do_not_determine_stays_near_one():
    samples = synthetic_samples(TRUTH, "gemm", [(1e9, 1e5), (5e8, 1e5)])  # compute-bound only
    gemm = fit_families(samples, MACHINE)["gemm"]
    assert gemm.efficiency == pytest.approx(0.85, rel=0.01)
    assert gemm.bandwidth_efficiency == pytest.approx(1.0, rel=0.05)
    # one sample fits a whole curve of pairs: the one nearest to (1, 1) wins
    one = synthetic_samples(TRUTH, "conv", [(5e7, 5e5)])
    conv = fit_families(one, MACHINE)["conv"]
    assert conv.efficiency == pytest.approx(0.6, rel=0.01) and conv.bandwidth_efficiency == pytest.approx(1.0, rel=0.05)


def test_the_fitted_profile_is_saved_read_back_and_changes_the_cost_model():
    before = cost_model("roofline")  # the shipped profile (no saved one yet)
    shipped = load_profile(str(SHIPPED_DIR / "cpu-host.toml"))
    work = Work(1e8, "conv", reads=1e6, writes=0.0)  # compute-bound
    assert before.op_cost(work, None) == pytest.approx(
        1e8 / (shipped.peak_gflops * 1e3 * shipped.efficiency["conv"]) + shipped.launch_us)
    fits = fit_families(_samples(), MACHINE)
    profile = fitted_profile(MACHINE, fits, threads=1, date="2026-02-03")
    assert profile.source == ("measured 2026-01-01: test figures; kernels measured 2026-02-03: 22 kernels in "
                              "4 families at 1 thread(s)")
    assert has_kernel_fit(profile) and not has_kernel_fit(MACHINE)
    path = save_profile(profile)
    assert path == user_profile_path("cpu-host")
    text = path.read_text()
    assert "[bandwidth_efficiency]\nconv = 0.4\n" in text and "\nelementwise = 0.3\n" in text
    loaded = load_profile("cpu-host")
    assert loaded.efficiency["conv"] == 0.6 and loaded.bandwidth_efficiency["layout"] == 0.5
    after = cost_model("roofline")  # the default cpu profile: the saved one now
    assert after.op_cost(work, None) == pytest.approx(1e8 / (80e3 * 0.6) + 1.0)
    memory_bound = Work(1e5, "elementwise", reads=4e6, writes=4e6)
    assert after.op_cost(memory_bound, None) == pytest.approx(8e6 / (25e3 * 2.5) + 1.0)
    assert after.settings()["profile"]["bandwidth_efficiency"]["elementwise"] == 2.5
    # the fitted profile predicts the samples it was fitted to
    assert fit_error(loaded, _samples()) == pytest.approx(1.0, abs=0.01)
    # conv's variants were not measured: they take conv's fit, so that they do not look cheaper
    assert loaded.efficiency["conv_nhwc"] == loaded.efficiency["conv"] == 0.6
    assert loaded.bandwidth_efficiency["conv_nchwc"] == 0.4 and loaded.efficiency["winograd"] == 0.6


def test_a_profile_without_bandwidth_efficiencies_prints_as_before():
    assert "bandwidth_efficiency" not in MACHINE.to_toml()
    assert "bandwidth_efficiency" not in MACHINE.settings()


def test_a_bad_bandwidth_efficiency_is_refused_naming_the_key(tmp_path):
    bad = tmp_path / "bad.toml"
    bad.write_text(MACHINE.to_toml() + "\n[bandwidth_efficiency]\nconv = -1.0\n")
    with pytest.raises(EgraftError, match=r"bandwidth_efficiency.conv = -1.0; expected a positive number"):
        load_profile(str(bad))


def test_predict_us_is_the_roofline_formula():
    sample = synthetic_samples(TRUTH, "conv", [(5e7, 5e5)])[0]
    assert predict_us(TRUTH, sample) == Roofline(TRUTH).op_cost(Work(5e7, "conv", reads=5e5, writes=0.0), None)
    assert sample.measured_us == pytest.approx(5e7 / (80e3 * 0.6) + 1.0)
    assert FamilyFit("conv", 1, 0.5, 1.0, 1.0, 2.0).family == "conv"


def test_the_quick_cases_cover_every_family_that_computes_once():
    quick = kernel_cases(quick=True)
    families = [c.family for c in quick]
    assert len(families) == len(set(families)) == 12  # every family but view and other
    assert len(kernel_cases()) > 3 * len(quick)


def test_calibrate_kernels_times_the_kernels_and_saves_the_fit(monkeypatch):
    result = runner.invoke(app, ["calibrate", "--kernels", "--quick"])
    assert result.exit_code == 0, result.output
    out = result.stdout.replace("\n", " ")
    assert "peak fp32" in out and "kernel families at 1 thread(s)" in out  # the machine was measured first
    profile = load_profile("cpu-host")
    assert profile.path == str(user_profile_path("cpu-host")) and SOURCE_TAG in profile.source
    fitted = {c.family for c in kernel_cases(quick=True)}
    assert fitted <= set(profile.bandwidth_efficiency)
    for family in fitted:
        e, b = profile.efficiency[family], profile.bandwidth_efficiency[family]
        assert math.isfinite(e) and 0 < e <= 1 and math.isfinite(b) and b > 0, family
    again = runner.invoke(app, ["calibrate", "--kernels", "--quick"])
    assert again.exit_code == 2 and "already holds kernel-fitted efficiencies" in again.output
    assert "pass --force" in again.output


def test_node_cost_prices_a_graph_node_by_its_work_on_the_profile():
    import egraft

    case = kernel_cases(quick=True)[0]
    assert case.name == "conv 3x3 64->64 28x28"
    graph = egraft.load(case.model)
    model = cost_model("roofline", TRUTH)
    work = model.node_work(graph, graph.nodes[0])
    outputs = 64 * 28 * 28
    assert (work.family, work.flops) == ("conv", 2.0 * outputs * 64 * 9 + outputs)  # products, then the bias
    assert model.node_cost(graph, graph.nodes[0]) == pytest.approx(work.flops / (80e3 * 0.6) + 1.0)


def test_a_variant_measured_once_takes_its_parents_memory_side():
    """One compute-bound sample of ConvNHWC fits its efficiency but cannot see its bandwidth:
    the profile gives it conv's, so it never looks cheaper where conv is memory-bound."""
    samples = _samples() + synthetic_samples(TRUTH, "conv_nhwc", [(5e8, 1e6)])
    fits = fit_families(samples, MACHINE)
    assert fits["conv_nhwc"].samples == 1
    profile = fitted_profile(MACHINE, fits, threads=1, date="2026-02-03")
    assert profile.bandwidth_efficiency["conv_nhwc"] == profile.bandwidth_efficiency["conv"] == 0.4
    assert profile.efficiency["conv_nhwc"] == pytest.approx(fits["conv_nhwc"].efficiency, rel=1e-2)

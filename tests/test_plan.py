"""Plans: the JSON documents of `egraft plan`, and `egraft diff`, `explain`, `show PLAN`
and `optimize --plan` over them, checked against the source model and onnxruntime."""

from __future__ import annotations

import json
from dataclasses import replace

import onnx
import pytest
from conftest import run_onnxruntime
from typer.testing import CliRunner

import egraft
from egraft.cli import app
from egraft.extract.cost import cost_model
from egraft.extract.extractor import extract
from egraft.extract.plan import PLAN_VERSION, build_plan, load_plan, plan_json
from egraft.extract.profiles import load_profile
from egraft.optimize import optimize
from egraft.testing.models import backend_input, light_model_path, reweight, scale_relative_error

runner = CliRunner()


def _invoke(*args: str):
    result = runner.invoke(app, list(args))
    assert result.exit_code == 0, result.output
    return result


@pytest.fixture(scope="module")
def resnet_plans(tmp_path_factory):
    """ResNet-50 planned with all shipped rules and without the fusion rule set."""
    folder = tmp_path_factory.mktemp("plans")
    full, nofusion = folder / "full.plan.json", folder / "nofusion.plan.json"
    _invoke("plan", "resnet50", "-o", str(full), "--reproducible")
    _invoke("plan", "resnet50", "-o", str(nofusion), "--rules-off", "fusion", "--reproducible")
    return full, nofusion


def test_plans_are_identical_byte_for_byte(tmp_path):
    """An ILP solved to optimality (AlexNet's, in a few seconds) gives the same bytes every run.
    (A solve the time limit stops may not: what the ILP finds by then depends on the machine.)"""
    first, second = tmp_path / "a.json", tmp_path / "b.json"
    for path in (first, second):
        _invoke("plan", "bvlc_alexnet", "-o", str(path), "--extractor", "ilp", "--reproducible")
    assert json.loads(first.read_text())["extraction"]["status"] == "optimal"
    assert first.read_bytes() == second.read_bytes()
    timed = tmp_path / "timed.json"
    _invoke("plan", "bvlc_alexnet", "-o", str(timed), "--extractor", "ilp")
    with_timings = json.loads(timed.read_text())
    assert set(with_timings["timings"]) >= {"rules", "load", "saturate", "extract"}
    del with_timings["timings"]
    assert with_timings == json.loads(first.read_text())


def test_a_plan_records_its_graph_costs_and_settings(resnet_plans):
    full, _ = resnet_plans
    plan = load_plan(full)
    assert plan["format"] == "egraft-plan" and plan["version"] == PLAN_VERSION
    settings = plan["settings"]
    assert settings["cost_model"]["name"] == "roofline" and settings["cost_model"]["profile"]["name"] == "cpu-host"
    assert settings["extractor"] == "greedy" and settings["egraft_version"] == egraft.__version__
    files = {f["path"]: f for f in settings["rule_files"]}
    assert set(files) == {f"egraft/rules/{s}.rules" for s in
                          ("algebra", "folding", "fusion", "fusion_elementwise", "layout", "specialization")}
    assert all(len(f["sha256"]) == 64 for f in files.values())
    nodes = plan["graph"]["nodes"]
    assert plan["cost"]["total"] == pytest.approx(sum(n["cost"] for n in nodes), rel=1e-4)
    assert plan["graph"]["ops"] == {op: sum(1 for n in nodes if n["op"].split("::")[-1] == op)
                                    for op in plan["graph"]["ops"]}
    # Every source node is either covered by a plan node or eliminated (the constant fills
    # of the bundled weights fold away).
    covered = {k for n in nodes for k in n["covers"]}
    assert covered | set(plan["eliminated"]) == set(range(plan["model"]["nodes"]))
    assert plan["egraph"]["stop_reason"] == "saturated" and plan["egraph"]["enodes"] > plan["model"]["nodes"]


def test_diff_without_fusion_shows_the_fused_ops_and_the_cost(resnet_plans):
    """Fusion folds ResNet-50's Relus and residual Sums into the convolutions' epilogues
    (the blocked ConvNCHWc with an activation, or FusedConv): the plan without it keeps them all."""
    full, nofusion = resnet_plans
    d = json.loads(_invoke("diff", str(full), str(nofusion), "--json").stdout)
    ops = {row["op"]: (row["a"], row["b"]) for row in d["ops"]}
    assert ops["Relu"][1] == 49 and ops["Relu"][0] <= 16
    residuals = [ops.get("Sum", (0, 0))[side] + ops.get("Add", (0, 0))[side] for side in (0, 1)]  # Sum(a, b) = a + b
    assert residuals[1] == 16 and residuals[0] < 16
    assert ops.get("FusedConv", (0, 0))[1] == 0  # no NCHW convolution with an activation without fusion
    assert d["cost"]["difference"] > 0  # fusion makes the plan cheaper
    assert d["cost"]["difference"] == pytest.approx(d["cost"]["b"] - d["cost"]["a"], rel=1e-6)
    fusion_rules = {"conv_activation/Relu", "blocked_conv_relu"}
    assert {"blocked_conv_add_relu/Add", "blocked_conv_add_relu/Sum"} & set(d["rules_only_a"])  # the residuals
    assert "blocked_conv_relu" in d["rules_only_a"] and not fusion_rules & set(d["rules_only_b"])
    assert any(n["op"] in ("com.egraft::FusedConv", "com.egraft::ConvNCHWc") for n in d["only_a"])
    top = d["top_differences"]

    def relus(ops: list[str]) -> int:
        return sum(op.endswith(" Relu") for op in ops)

    assert len(top) == 5 and all(r["difference"] > 0 and relus(r["a"]) < relus(r["b"]) for r in top)
    text = _invoke("diff", str(full), str(nofusion)).stdout
    assert "ConvNCHWc" in text and "difference (b - a)" in text and "blocked_conv_relu" in text


def test_explain_traces_a_fused_conv_to_its_conv_batchnorm_and_relu(resnet_plans):
    full, _ = resnet_plans
    plan = load_plan(full)
    fused = [n for n in plan["graph"]["nodes"] if n["op"] in ("com.egraft::FusedConv", "com.egraft::ConvNCHWc")
             and sorted(plan["source"][k]["op"] for k in n["covers"]) == ["BatchNormalization", "Conv", "Relu"]]
    assert len(fused) >= 10
    info = json.loads(_invoke("explain", str(full), fused[0]["id"], "--json").stdout)
    conv, bn, relu = sorted(info["covers"], key=lambda s: s["index"])
    assert (conv["op"], bn["op"], relu["op"]) == ("Conv", "BatchNormalization", "Relu")
    # The covered nodes are a Conv -> BatchNormalization -> Relu chain of the source model.
    source = onnx.load(light_model_path("resnet50")).graph.node
    assert source[bn["index"]].input[0] == source[conv["index"]].output[0]
    assert source[relu["index"]].input[0] == source[bn["index"]].output[0]
    relu_rule = "conv_activation/Relu" if fused[0]["op"] == "com.egraft::FusedConv" else "blocked_conv_relu"
    assert info["rules"][0].startswith("fold_bn_into_conv") and info["rules"][-1] == relu_rule
    # The rejected alternatives are dearer than the choice, counted with what they need.
    assert info["alternatives"]
    assert all(alt["subtree_cost"] is None or alt["subtree_cost"] >= info["subtree_cost"]
               for alt in info["alternatives"])
    text = _invoke("explain", str(full), fused[0]["id"]).stdout
    assert f"rule {relu_rule}" in text and "BatchNormalization" in text and "rejected" in text
    # A node can also be named by a source node it covers.
    by_source = json.loads(_invoke("explain", str(full), f"source:{bn['index']}", "--json").stdout)
    assert by_source["id"] == fused[0]["id"]


def test_show_plan_prints_the_chosen_graph(resnet_plans):
    full, _ = resnet_plans
    plan = load_plan(full)
    text = _invoke("show", str(full)).stdout
    assert text.startswith(plan["graph"]["ir"])
    for op in ("FusedConv", "ConvNCHWc", "WinogradConv"):
        assert text.count(f"com.egraft::{op}(") == plan["graph"]["ops"].get(op, 0)
    assert plan["graph"]["ops"].get("ConvNCHWc", 0) > 0


def test_the_encoder_plan_exports_and_runs_in_onnxruntime():
    from egraft.testing.encoder import encoder_inputs, encoder_model

    model = encoder_model()
    result = optimize(egraft.load(model), cost="roofline", extractor="ilp")
    assert result.extraction.status == "optimal"
    for name, profile in (("nodes", None), ("flops", None), ("roofline", "cuda-h200")):
        costs = cost_model(name, profile)
        assert extract(result.snapshot, costs, "ilp").cost <= extract(result.snapshot, costs, "greedy").cost
    plan = build_plan(result)
    assert json.loads(plan_json(plan))["graph"]["ir"] == str(result.graph)
    feeds = encoder_inputs(3, 11)
    reference = run_onnxruntime(model, feeds, exact=True)
    exported = run_onnxruntime(egraft.to_onnx(result.graph), feeds, exact=True)
    for key, ref in reference.items():
        assert scale_relative_error(exported[key], ref) <= 1e-4, key


def test_optimize_writes_the_model_and_its_plan(tmp_path):
    source = reweight(onnx.load(light_model_path("squeezenet")), seed=2)
    src, out, plan_path = tmp_path / "sq.onnx", tmp_path / "sq.opt.onnx", tmp_path / "sq.plan.json"
    onnx.save(source, src)
    _invoke("optimize", str(src), "-o", str(out), "--plan", str(plan_path), "--extractor", "ilp")
    plan = load_plan(plan_path)
    exported = onnx.load(out)
    assert len(exported.graph.node) == len(plan["graph"]["nodes"])

    # egraft-only ops travel as ONNX local functions, one per op and attribute set
    # (FusedConv_8ba99df8), standard ops as themselves.
    def exported_op(node: onnx.NodeProto) -> str:
        return f"{node.domain}::{node.op_type.rsplit('_', 1)[0]}" if node.domain else node.op_type

    assert [exported_op(n) for n in exported.graph.node] == [n["op"] for n in plan["graph"]["nodes"]]
    assert {(f.domain, f.name) for f in exported.functions} == {
        (n.domain, n.op_type) for n in exported.graph.node if n.domain}
    feeds = backend_input(source)
    want = run_onnxruntime(source, feeds)
    got = run_onnxruntime(exported, feeds)
    for key, ref in want.items():
        assert scale_relative_error(got[key], ref) <= 1e-4, key


def test_plan_errors_name_the_file_and_what_to_do(tmp_path, resnet_plans):
    full, _ = resnet_plans
    not_json = tmp_path / "not.json"
    not_json.write_text("{oops")
    other = tmp_path / "other.json"
    other.write_text('{"hello": 1}')
    newer = tmp_path / "newer.json"
    newer.write_text(json.dumps({**json.loads(full.read_text()), "version": PLAN_VERSION + 1}))
    cases = [
        (["diff", str(not_json), str(full)], f"{not_json}: not a plan (not JSON"),
        (["explain", str(other), "n0"], f"{other}: not an egraft plan"),
        (["show", str(newer)], f"plan version {PLAN_VERSION + 1}"),
        (["explain", str(full), "n99999"], "no node 'n99999' in the plan"),
        (["plan", "squeezenet", "--extractor", "exact"], "--extractor exact: unknown extractor"),
        (["plan", "squeezenet", "--cost-model", "speed"], "--cost-model speed: unknown cost model"),
        (["plan", "squeezenet", "--profile", "nowhere"], "--profile nowhere: no such profile"),
    ]
    for args, message in cases:
        result = runner.invoke(app, args)
        assert result.exit_code == 2, (args, result.output)
        assert message in result.output, (args, result.output)
        assert "Traceback" not in result.output
    before = full.read_bytes()
    refused = runner.invoke(app, ["plan", "squeezenet", "-o", str(full)])
    assert refused.exit_code == 2 and "exists; pass --force" in refused.output
    assert full.read_bytes() == before


def test_calibrate_saves_a_profile_that_plans_then_use(tmp_path, monkeypatch):
    from egraft.extract.profiles import load_profile, user_profile_path

    monkeypatch.setenv("EGRAFT_CONFIG_DIR", str(tmp_path))
    measured = _invoke("calibrate").stdout
    saved = user_profile_path("cpu-host")
    assert saved.is_file() and str(saved) in measured.replace("\n", "")
    profile = load_profile("cpu-host")
    assert profile.source.startswith("measured")
    # fp32 GEMM on one core and a memory copy: figures any machine egraft runs on reaches,
    # and no machine exceeds.
    assert 1.0 < profile.peak_gflops < 2000.0 and 0.5 < profile.bandwidth_gbs < 2000.0 and profile.launch_us > 0
    assert f"{profile.peak_gflops:.4g}" in measured
    assert f"peak_gflops = {profile.peak_gflops!r}" in _invoke("calibrate", "--show").stdout
    again = runner.invoke(app, ["calibrate"])
    assert again.exit_code == 2 and "pass --force" in again.output
    plan = json.loads(_invoke("plan", "squeezenet", "--json", "--reproducible").stdout)
    assert plan["settings"]["cost_model"]["profile"]["peak_gflops"] == profile.peak_gflops


def test_the_nodes_cost_model_extracts_fewer_ops_than_roofline(resnet_plans, tmp_path):
    full, _ = resnet_plans
    fewest = tmp_path / "nodes.plan.json"
    _invoke("plan", "resnet50", "-o", str(fewest), "--cost-model", "nodes", "--extractor", "ilp", "--reproducible")
    by_nodes, by_time = load_plan(fewest), load_plan(full)
    status = by_nodes["extraction"]["status"]  # HiGHS may stop at its limit on ResNet's residual Adds
    assert status == "optimal" or status.startswith("time limit"), status
    assert by_nodes["cost"]["total"] == len(by_nodes["graph"]["nodes"])
    assert len(by_nodes["graph"]["nodes"]) <= len(by_time["graph"]["nodes"])
    # (Under nodes, Winograd and direct forms tie at one op each.)
    # The shipped cpu-host profile charges each Winograd call what it costs inside a model
    # beyond its flops ([call_us]): most of ResNet-50's 3x3 stride-1 layers are too small to
    # pay it and run on the blocked direct convolution. How many depends on the host's vector
    # width (Winograd's products run over whole vectors of tiles): none on AVX-512, the three
    # 128-channel 28x28 layers on AVX2 (znver3), whose 8-wide vectors pad less.
    def direct_3x3(plan) -> list[str]:
        return [n["outputs"][0]["type"] for n in plan["graph"]["nodes"] if n["op"] == "com.egraft::ConvNCHWc"
                and n["attrs"]["kernel_shape"] == [3, 3] and n["attrs"].get("strides", [1, 1]) == [1, 1]]

    charged = by_time["graph"]["ops"].get("WinogradConv", 0)
    assert charged in (0, 3) and charged + len(direct_3x3(by_time)) == 13
    # Without that cost the roofline runs them by Winograd (2.25x fewer multiplications), but
    # those on 7x7 images by the blocked direct convolution (Winograd's transforms would
    # outweigh its savings): 11 of 13.
    profile = tmp_path / "no-call-cost.toml"
    profile.write_text(replace(load_profile("cpu-host"), call_us={}).to_toml())
    flops_only = tmp_path / "flops.plan.json"
    _invoke("plan", "resnet50", "-o", str(flops_only), "--profile", str(profile), "--reproducible")
    by_time = load_plan(flops_only)
    assert by_time["graph"]["ops"]["WinogradConv"] == 11
    assert direct_3x3(by_time) == ["f32[1, 64, 7, 7, 8]"] * 2
    winograd = [n for n in by_time["graph"]["nodes"] if n["op"] == "com.egraft::WinogradConv"]
    assert all(n["attrs"].get("activation") == "relu" for n in winograd)
    assert all(sorted(by_time["source"][k]["op"] for k in n["covers"]) == ["BatchNormalization", "Conv", "Relu"]
               for n in winograd)
    assert "BatchNormalization" not in by_time["graph"]["ops"]


def test_the_target_picks_the_profile_and_the_plan_says_so():
    cuda = json.loads(_invoke("plan", "squeezenet", "--target", "cuda", "--json", "--reproducible").stdout)
    cpu = json.loads(_invoke("plan", "squeezenet", "--json", "--reproducible").stdout)
    assert cuda["settings"]["target"] == "cuda" and cuda["settings"]["cost_model"]["profile"]["name"] == "cuda-h200"
    assert cpu["settings"]["target"] == "cpu" and cpu["settings"]["cost_model"]["profile"]["name"] == "cpu-host"
    # The same ops cost far less on the H200's 67 TFLOP/s and 4.8 TB/s than on one CPU core.
    assert cuda["cost"]["unit"] == cpu["cost"]["unit"] == "us"
    assert 10 * cuda["cost"]["total"] < cpu["cost"]["total"]
    wrong = runner.invoke(app, ["plan", "squeezenet", "--target", "tpu"])
    assert wrong.exit_code == 2 and "--target tpu: unknown target; known: cpu, cuda" in wrong.output


def test_reproducible_plans_leave_out_a_time_limited_ilps_gap_and_bound():
    """When the clock stopped HiGHS, its gap and bound say when, not what: --reproducible drops them."""
    from egraft.extract.plan import plan_json

    extraction = {"extractor": "ilp", "status": "time limit: greedy's program kept", "gap": 0.3, "lower_bound": 5.0}
    plan = {"format": "egraft-plan", "extraction": extraction, "timings": {"extract": 30.1}}
    assert json.loads(plan_json(plan, timings=False))["extraction"] == {"extractor": "ilp",
                                                                       "status": extraction["status"]}
    assert json.loads(plan_json(plan))["extraction"] == extraction
    solved = {**plan, "extraction": {**extraction, "status": "optimal", "gap": 0.0}}
    assert json.loads(plan_json(solved, timings=False))["extraction"]["lower_bound"] == 5.0

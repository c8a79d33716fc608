"""The zoo report (egraft/zoo/report.py) and run comparison (egraft/zoo/diff.py), on a real
SQLite store with two runs written through ZooStore.put; and the page as a headless Chromium
renders it."""

from __future__ import annotations

import doctest
import math
import re
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest

from egraft.errors import EgraftError
from egraft.zoo import diff as diff_module
from egraft.zoo import report as report_module
from egraft.zoo.diff import diff_runs, geomean, regressions
from egraft.zoo.report import FASTER_COLOUR, SLOWER_COLOUR, fmt_speedup, render_html, render_markdown, write_report
from egraft.zoo.store import ZooStore

ERROR_TEXT = 'compile failed: <script>alert("x")</script> in [brackets] | pipe & more ' + "x" * 150


def _row(model: str, status: str, **fields) -> dict:
    row = {"model": model, "key": f"key-{model}", "status": status, "error": None, "stage": None,
           "worker": "host-a:101", "started": "2026-01-02T03:04:00+00:00", "finished": "2026-01-02T03:05:00+00:00",
           "wall_s": 10.0, "nodes_before": 100, "nodes_after": 80, "optimize_s": 2.0, "compile_s": 1.0,
           "fallbacks": 0, "predicted_ms": None, "egraft_ms": None, "onnxruntime_ms": None, "speedup": None,
           "max_error": 1e-7, "tolerance": 1e-5, "rules": {}}
    row.update(fields)
    if row["egraft_ms"] is not None and row["onnxruntime_ms"] is not None:
        row["speedup"] = row["onnxruntime_ms"] / row["egraft_ms"]
    return row


RUN_A = [
    _row("alexnet", "ok", egraft_ms=4.0, onnxruntime_ms=6.0, predicted_ms=3.5,
         rules={"fuse-conv-relu": 5, "mul-one": 2}),
    _row("bert_tiny", "ok", egraft_ms=2.0, onnxruntime_ms=1.5, predicted_ms=2.5,
         rules={"fold-transpose": 12, "mul-one": 1}),
    _row("crashy", "ok", egraft_ms=1.0, onnxruntime_ms=1.2, rules={"fuse-conv-relu": 1}),
    _row("deep<net>", "mismatch", egraft_ms=8.0, onnxruntime_ms=7.0, max_error=0.3,
         rules={"fold-transpose": 3}),
    _row("eternal", "timeout", error="timed out after 600 s", stage="optimize", optimize_s=None, compile_s=None,
         nodes_after=None, rules=None),
]
RUN_B = [
    _row("alexnet", "ok", egraft_ms=3.0, onnxruntime_ms=6.0, predicted_ms=3.0, optimize_s=3.0, nodes_after=70,
         rules={"fuse-conv-relu": 5, "mul-one": 2, "new-rule": 40}),
    _row("bert_tiny", "ok", egraft_ms=2.5, onnxruntime_ms=1.5, predicted_ms=2.5, optimize_s=1.0,
         rules={"fold-transpose": 12}),
    _row("crashy", "error", error=ERROR_TEXT, stage="compile", compile_s=None, egraft_ms=None, rules=None,
         worker="host-b:202"),
    _row("deep<net>", "mismatch", egraft_ms=8.0, onnxruntime_ms=7.0, max_error=0.3, rules={"fold-transpose": 3}),
    _row("eternal", "timeout", error="timed out after 600 s", stage="optimize", optimize_s=None, compile_s=None,
         nodes_after=None, rules=None),
    _row("fresh", "ok", egraft_ms=1.0, onnxruntime_ms=1.0, rules={"mul-one": 7}),
]
MODELS_A = [r["model"] for r in RUN_A]
MODELS_ALL = sorted({r["model"] for r in RUN_A + RUN_B})


def make_store(path: Path) -> ZooStore:
    """A store with runs 'base' (RUN_A) and 'next' (RUN_B), written row by row."""
    store = ZooStore(path)
    store.begin_run("base", {"threads": 1, "profile": "cpu-host", "repeat": 5})
    for row in RUN_A:
        store.put("base", row)
    store.begin_run("next", {"threads": 1, "profile": "<roofline>", "repeat": 5})
    for row in RUN_B:
        store.put("next", row)
    return store


@pytest.fixture
def store(tmp_path):
    s = make_store(tmp_path / "zoo.sqlite")
    yield s
    s.close()


def _section(page: str, ident: str) -> str:
    start = page.index(f'<section id="{ident}">')
    return page[start:page.index("</section>", start)]


def _table_rows(page: str, cls: str) -> list[str]:
    start = page.index(f'<table class="{cls}">')
    body = page[page.index("<tbody>", start):page.index("</tbody>", start)]
    return re.findall(r"<tr\b.*?</tr>", body, flags=re.S)


# ---- diff.py --------------------------------------------------------------------------------------
def test_diff_runs_against_hand_computation():
    entries = diff_runs(RUN_A, RUN_B)
    assert [e["model"] for e in entries] == MODELS_ALL
    by = {e["model"]: e for e in entries}
    assert by["alexnet"]["speed_ratio"] == pytest.approx(4.0 / 3.0)
    assert by["alexnet"]["optimize_ratio"] == pytest.approx(3.0 / 2.0)
    assert by["alexnet"]["nodes_ratio"] == pytest.approx(70 / 80)
    assert (by["alexnet"]["nodes_after_a"], by["alexnet"]["nodes_after_b"]) == (80, 70)
    assert by["bert_tiny"]["speed_ratio"] == pytest.approx(2.0 / 2.5)
    assert by["bert_tiny"]["optimize_ratio"] == pytest.approx(1.0 / 2.0)
    assert not by["bert_tiny"]["status_changed"]
    assert by["crashy"]["status_a"] == "ok" and by["crashy"]["status_b"] == "error"
    assert by["crashy"]["status_changed"] and by["crashy"]["speed_ratio"] is None
    assert by["crashy"]["egraft_ms_a"] == 1.0 and by["crashy"]["egraft_ms_b"] is None
    assert by["deep<net>"]["speed_ratio"] == pytest.approx(1.0)
    assert by["eternal"]["optimize_ratio"] is None and by["eternal"]["nodes_ratio"] is None
    fresh = by["fresh"]
    assert fresh["status_a"] is None and fresh["status_b"] == "ok" and fresh["status_changed"]
    assert fresh["egraft_ms_a"] is None and fresh["egraft_ms_b"] == 1.0
    assert fresh["speed_ratio"] is None and fresh["optimize_ratio"] is None and fresh["nodes_ratio"] is None
    # only in A: B's side is None
    back = {e["model"]: e for e in diff_runs(RUN_B, RUN_A)}["fresh"]
    assert back["status_a"] == "ok" and back["status_b"] is None and back["egraft_ms_b"] is None


def test_regressions_catch_the_slower_model_and_the_ok_to_error_model():
    found = regressions(diff_runs(RUN_A, RUN_B), fail_below=0.95)
    assert [m for m, _ in found] == ["bert_tiny", "crashy"]
    reasons = dict(found)
    assert reasons["crashy"] == "ok -> error"
    assert reasons["bert_tiny"].startswith("slower: speed ratio 0.800 < 0.95")
    # a model ok in A and missing in B; the threshold decides about the slower one
    found = regressions(diff_runs(RUN_B, RUN_A), fail_below=0.5)
    assert found == [("fresh", "ok -> missing")]


def test_geomean():
    assert geomean([2.0, 8.0, None]) == pytest.approx(4.0)
    assert geomean([]) is None and geomean([None, None]) is None
    for bad in (0.0, -1.0, math.nan, math.inf):
        with pytest.raises(ValueError):
            geomean([1.0, bad])


def test_docstring_examples():
    from egraft.zoo import charts as charts_module

    for module in (diff_module, report_module, charts_module):
        result = doctest.testmod(module)
        assert result.attempted > 0 and result.failed == 0, module.__name__


# ---- report.py ------------------------------------------------------------------------------------
def test_html_escapes_user_text(store):
    page = render_html(store, ["base", "next"])
    assert "<script" not in page.lower()
    # the error of crashy in run B shows only in the comparison as a status; the detailed run is A
    page_b = render_html(store, ["next"])
    assert "<script" not in page_b.lower()
    short = 'compile: compile failed: &lt;script&gt;alert(&quot;x&quot;)&lt;/script&gt; in [brackets] | pipe &amp; more'
    assert short in page_b
    full = 'title="compile: compile failed: &lt;script&gt;alert(&quot;x&quot;)&lt;/script&gt; in [brackets]'
    assert full in page_b and ("x" * 150 + '"') in page_b       # the title holds the whole text
    assert "deep&lt;net&gt;" in page and "deep<net>" not in page
    assert "&lt;roofline&gt;" in page                             # a setting
    rows = {re.search(r"<td>(.*?)</td>", r).group(1): r for r in _table_rows(page_b, "models")}
    err_cell = re.search(r'<td class="err"[^>]*>(.*?)</td>', rows["crashy"]).group(1)
    assert len(err_cell.replace("&lt;", "<").replace("&gt;", ">").replace("&quot;", '"').replace("&amp;", "&")) \
        <= report_module.ERROR_CHARS


def test_summary_geomean_matches_numpy(store):
    page = render_html(store, ["base"])
    speedups = np.array([r["onnxruntime_ms"] / r["egraft_ms"] for r in RUN_A if r["egraft_ms"] is not None])
    want = float(np.exp(np.mean(np.log(speedups))))
    summary = _section(page, "summary")
    assert f"{want:.3f}×" == fmt_speedup(want)
    assert f"{want:.3f}× over {len(speedups)} of {len(RUN_A)} models" in summary
    assert "total optimize time" in summary and f"{sum(r['optimize_s'] or 0 for r in RUN_A):.2f} s" in summary
    assert f"{sum(r['compile_s'] or 0 for r in RUN_A):.2f} s" in summary
    assert f"{sum(r['wall_s'] for r in RUN_A):.2f} s" in summary
    for status, n in {"ok": 3, "mismatch": 1, "timeout": 1, "error": 0, "crashed": 0}.items():
        assert re.search(rf'badge status-{status}">{status}</span></th><td class="num">{n}</td>', summary)
    assert "cpu-host" in summary and "base" in summary


def test_model_table_and_charts(store):
    page = render_html(store, ["base", "next"])
    rows = _table_rows(page, "models")
    assert len(rows) == len(RUN_A)
    assert [re.search(r"<td>(.*?)</td>", r).group(1) for r in rows] == [
        m.replace("<", "&lt;").replace(">", "&gt;") for m in MODELS_A]
    assert [re.search(r'class="(status-\w+)"', r).group(1) for r in rows] == [
        f"status-{r['status']}" for r in RUN_A]
    assert "100 → 80" in rows[0] and "1.500×" in rows[0]
    # speed-up, stages, rules, predicted vs measured, and the comparison's speed ratio
    assert page.count("<svg") == 5
    assert page.count("<figcaption") == 5
    ids = re.findall(r'\bid="([^"]+)"', page)
    assert len(ids) == len(set(ids)), "the charts' ids collide"
    for rule in ("fuse-conv-relu", "mul-one", "fold-transpose"):
        assert rule in _section(page, "charts")
    diff_rows = _table_rows(page, "diff")
    assert len(diff_rows) == len(MODELS_ALL)
    changed = [re.search(r"<td>(.*?)</td>", r).group(1) for r in diff_rows if 'class="changed"' in r]
    assert changed == ["crashy", "fresh"]
    ratio = float(np.exp(np.mean(np.log([4.0 / 3.0, 2.0 / 2.5, 8.0 / 8.0]))))
    assert f"geometric-mean speed ratio A/B {ratio:.3f}× over 3 of 6 models" in page


def test_no_network_no_script_and_deterministic(store):
    page = render_html(store, ["base", "next"])
    assert not re.search(r"""(src|href)\s*=\s*["']?\s*(https?:)?//""", page, flags=re.I)
    assert not re.search(r"url\(\s*['\"]?\s*(https?:)?//", page, flags=re.I)
    assert "@import" not in page and "<script" not in page.lower() and "<link" not in page.lower()
    assert not re.search(r"\son\w+\s*=", page)                # no event handlers
    assert render_html(store, ["base", "next"]) == page


def test_charts_replaced_by_a_sentence_without_data(tmp_path):
    store = ZooStore(tmp_path / "zoo.sqlite")
    store.begin_run("r", {})
    store.put("r", _row("broken", "error", error="cannot load", stage="load", optimize_s=None, compile_s=None,
                        nodes_after=None, rules=None))
    page = render_html(store, ["r"])
    assert "<svg" not in page
    charts = _section(page, "charts")
    assert "No model has a speed-up" in charts and "No rule fired" in charts
    assert "No model reached the optimize stage" in charts and "No model has both a predicted" in charts
    assert "no model has a speed-up" in _section(page, "summary")
    with pytest.raises(EgraftError, match="no run 'nope'"):
        render_html(store, ["nope"])
    with pytest.raises(EgraftError):
        render_html(store, [])


def test_heatmap_keeps_the_40_most_applied_rules(tmp_path):
    store = ZooStore(tmp_path / "zoo.sqlite")
    store.begin_run("r", {})
    store.put("r", _row("m1", "ok", rules={f"rule{i:02d}": i + 1 for i in range(50)}))
    store.put("r", _row("m2", "ok", rules={"rule00": 0}))
    charts = _section(render_html(store, ["r"]), "charts")
    assert "the 40 most applied of the 50 rules that fired" in charts
    assert "rule49" in charts and "rule10" in charts and "rule09" not in charts


def test_write_report_and_markdown_twin(store, tmp_path):
    html_path, md_path = write_report(store, ["base", "next"], tmp_path / "out" / "report.html")
    assert html_path == tmp_path / "out" / "report.html" and md_path == tmp_path / "out" / "report.md"
    assert html_path.read_text(encoding="utf-8") == render_html(store, ["base", "next"])
    md = md_path.read_text(encoding="utf-8")
    assert md == render_markdown(store, ["base", "next"], html_name="report.html")
    assert "report.html" in md and "<svg" not in md
    lines = md.splitlines()
    model_table = lines[lines.index("## Models of run base") + 2:]
    model_table = model_table[:model_table.index("")]
    assert len(model_table) == 2 + len(RUN_A)                   # header, alignment, one row per model
    assert [line.split(" | ")[0].lstrip("| ") for line in model_table[2:]] == [
        "alexnet", "bert_tiny", "crashy", r"deep\<net\>", "eternal"]
    assert all(line.count(" | ") == len(report_module._MODEL_COLUMNS) - 1 for line in model_table)
    want = float(np.exp(np.mean(np.log([6 / 4, 1.5 / 2, 1.2 / 1, 7 / 8]))))
    assert f"{want:.3f}× over 4 of 5 models" in md
    # the error text: one cell, its pipe, brackets and tags escaped
    md_b = render_markdown(store, ["next"])
    crashy = next(line for line in md_b.splitlines() if line.startswith("| crashy"))
    assert r"\<script\>" in crashy and r"\[brackets\] \| pipe" in crashy
    assert not re.search(r"(?<!\\)[<>\[\]|]", crashy.strip("| ").replace(" | ", "")), "an unescaped character"
    assert crashy.count(" | ") == len(report_module._MODEL_COLUMNS) - 1
    compare = md[md.index("## Run next (B) compared to base (A)"):]
    for model in ("alexnet", "fresh"):
        assert f"| {model} |" in compare
    assert "ok → error" in compare and "missing → ok" in compare


# ---- the page in a real browser ----------------------------------------------------------------------
def _chromium(*args: str, profile: Path) -> subprocess.CompletedProcess:
    cmd = ["chromium", "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
           f"--user-data-dir={profile}", *args]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, f"{' '.join(cmd)} failed ({done.returncode}):\n{done.stderr[-2000:]}"
    return done


def _pixels_of(image: np.ndarray, colour: str, tolerance: float = 6 / 255) -> int:
    want = np.array([int(colour[i:i + 2], 16) / 255 for i in (1, 3, 5)])
    return int(np.all(np.abs(image[..., :3] - want) <= tolerance, axis=-1).sum())


def test_report_renders_in_headless_chromium(store, tmp_path):
    if shutil.which("chromium") is None:
        pytest.skip("chromium is not installed: apt-get install chromium")
    import matplotlib.image

    html_path, _ = write_report(store, ["base", "next"], tmp_path / "report.html")
    url = html_path.resolve().as_uri()
    dom = _chromium("--dump-dom", url, profile=tmp_path / "profile-dom").stdout
    for table in ("summary", "models", "diff"):
        assert f'<table class="{table}">' in dom
    assert len(_table_rows(dom, "models")) == len(RUN_A) and len(_table_rows(dom, "diff")) == len(MODELS_ALL)
    assert dom.count("<svg") == 5
    assert "<script" not in dom.lower()

    png = tmp_path / "report.png"
    _chromium(f"--screenshot={png}", "--window-size=1280,2000", url, profile=tmp_path / "profile-shot")
    image = matplotlib.image.imread(png)
    assert image.shape[:2] == (2000, 1280)
    inked = np.any(image[..., :3] < 0.95, axis=-1).mean()
    assert inked > 0.05, f"the screenshot is almost blank: {inked:.1%} of its pixels are not white"
    # the speed-up chart's bars (alexnet and crashy faster than onnxruntime, two models slower)
    assert _pixels_of(image, FASTER_COLOUR) > 500, "no bar of the speed-up chart in the screenshot"
    assert _pixels_of(image, SLOWER_COLOUR) > 500

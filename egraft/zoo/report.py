"""The zoo report: one self-contained HTML page (and its Markdown twin) for runs of a store.

The page needs no network and no JavaScript: its style is inline and its charts are
inline SVG (:mod:`egraft.zoo.charts`, matplotlib imported only when a chart is drawn). It holds, for
the first run given: a summary (settings, statuses, the geometric-mean speed-up against
onnxruntime, time spent), a table of every model, and charts of the speed-ups, the time
per stage, the rules that fired and the cost model's predictions; each later run is then
compared to the first (:func:`egraft.zoo.diff.diff_runs`). The output depends only on the
store's rows and runs (no "generated at" time), so one store always gives the same bytes.

Example:
    >>> from egraft.zoo.store import ZooStore
    >>> store = ZooStore(":memory:")
    >>> store.begin_run("r1", {"threads": 1})
    >>> store.put("r1", {"model": "m", "key": "k", "status": "ok", "finished": "2026-01-01T00:00:00+00:00",
    ...                  "egraft_ms": 1.0, "onnxruntime_ms": 2.0, "speedup": 2.0})
    >>> "2.000×" in render_markdown(store, ["r1"])
    True
"""

from __future__ import annotations

import html
import json
import math
import re
from pathlib import Path

from egraft.errors import EgraftError
from egraft.zoo.charts import (
    COMPILE_COLOUR,
    FASTER_COLOUR,
    OPTIMIZE_COLOUR,
    SLOWER_COLOUR,
    finite_number,
    one_line,
    positive_number,
    predicted_chart,
    ratio_chart,
    rules_chart,
    shorten,
    speedup_chart,
    stages_chart,
)
from egraft.zoo.diff import diff_runs, geomean
from egraft.zoo.store import STATUSES, RunInfo, ZooStore

#: Error texts longer than this are cut in the tables (the full text is the cell's tooltip).
ERROR_CHARS = 120
NONE = "–"

_STYLE = """
body { font-family: system-ui, -apple-system, "Segoe UI", Roboto, "Helvetica Neue", Arial, sans-serif;
       margin: 1.5em auto; max-width: 1200px; padding: 0 1em; color: #222; line-height: 1.4; }
h1 { font-size: 1.6em; margin-bottom: 0.2em; }
h2 { border-bottom: 2px solid #ddd; padding-bottom: 0.2em; margin-top: 1.8em; }
h3 { margin-bottom: 0.3em; }
code { background: #f3f3f3; padding: 0 0.25em; border-radius: 3px; }
.meta, .caption, .note { color: #555; }
.caption { font-size: 0.9em; margin-top: 0.2em; }
nav a { margin-right: 1em; }
.wide { overflow-x: auto; }
table { border-collapse: collapse; margin: 0.5em 0 1em; font-size: 0.9em; }
th, td { border: 1px solid #bbb; padding: 0.25em 0.5em; vertical-align: top; }
th { background: #eef1f4; text-align: left; }
td.num { text-align: right; font-variant-numeric: tabular-nums; white-space: nowrap; }
td.nowrap { white-space: nowrap; }
td.err { min-width: 18em; max-width: 28em; overflow-wrap: anywhere; font-size: 0.85em;
         font-family: ui-monospace, Menlo, Consolas, monospace; }
.stage { color: #666; }
.badge { display: inline-block; padding: 0 0.4em; border-radius: 3px; font-size: 0.85em; font-weight: 600; }
.status-ok .badge, .badge.status-ok { background: #d8f3dc; color: #1b4332; }
.status-mismatch .badge, .badge.status-mismatch { background: #ffe8a3; color: #6b4f00; }
.status-error .badge, .badge.status-error { background: #ffd6d6; color: #8a1111; }
.status-timeout .badge, .badge.status-timeout { background: #ffe0c2; color: #7a3a00; }
.status-crashed .badge, .badge.status-crashed { background: #e3d5f5; color: #4a1d7a; }
.status-other .badge, .badge.status-other { background: #e4e4e4; color: #333; }
tr.status-mismatch td { background: #fffbea; }
tr.status-error td, tr.status-crashed td { background: #fff3f3; }
tr.status-timeout td { background: #fff7ef; }
tr.changed td { background: #fff6d6; }
tr.changed td:first-child { border-left: 4px solid #e9a23b; }
.faster { color: #1d6f65; font-weight: 600; }
.slower { color: #b23a1e; font-weight: 600; }
.over { color: #b23a1e; font-weight: 600; }
.differs { background: #fff6d6; }
figure { margin: 1em 0 2em; }
figure svg { max-width: 100%; height: auto; display: block; }
"""


# ---- data ------------------------------------------------------------------------------------------
def _load(store: ZooStore, runs: list[str]) -> list[tuple[RunInfo, list[dict]]]:
    if not runs:
        raise EgraftError("no run to report: name one or more runs of the store")
    return [(store.run(name), store.rows(name)) for name in runs]


def _status_class(status) -> str:
    return f"status-{status}" if status in STATUSES else "status-other"


def summarize(info: RunInfo, rows: list[dict]) -> dict:
    """The numbers of a run's summary: ``models``, ``counts`` (status -> models, every status
    of :data:`STATUSES` first), ``geomean_speedup`` over the ``speedups`` models that have a
    positive one, the totals ``optimize_s``, ``compile_s`` and ``wall_s`` (None when no
    model has the field)."""
    counts = {s: 0 for s in STATUSES}
    for r in rows:
        counts[r.get("status") or "?"] = counts.get(r.get("status") or "?", 0) + 1
    speedups = [s for s in (positive_number(r.get("speedup")) for r in rows) if s is not None]

    def total(field):
        values = [v for v in (finite_number(r.get(field)) for r in rows) if v is not None]
        return math.fsum(values) if values else None

    return {"name": info.name, "created": info.created, "updated": info.updated, "settings": info.settings,
            "models": len(rows), "counts": counts, "speedups": len(speedups), "geomean_speedup": geomean(speedups),
            "optimize_s": total("optimize_s"), "compile_s": total("compile_s"), "wall_s": total("wall_s")}


# ---- formatting (shared by HTML and Markdown) -------------------------------------------------------
def fmt_speedup(v) -> str:
    """A speed-up or a speed ratio as the report prints it: ``1.234×``."""
    v = finite_number(v)
    return NONE if v is None else f"{v:.3f}×"


def _fmt(v, spec: str) -> str:
    v = finite_number(v)
    return NONE if v is None else format(v, spec)


def _fmt_int(v) -> str:
    return NONE if finite_number(v) is None else str(int(v))


def _fmt_seconds(v) -> str:
    v = finite_number(v)
    return NONE if v is None else f"{v:.2f} s"


def _fmt_ms(v) -> str:
    v = finite_number(v)
    if v is None:
        return NONE
    return f"{v:.1f}" if abs(v) >= 100 else f"{v:.3f}" if abs(v) >= 1 else f"{v:.3g}"


def _fmt_nodes(a, b) -> str:
    if finite_number(a) is None and finite_number(b) is None:
        return NONE
    return f"{_fmt_int(a)} → {_fmt_int(b)}"


def _fmt_setting(v) -> str:
    return v if isinstance(v, str) else json.dumps(v, sort_keys=True)


def _error_text(row: dict) -> str:
    return "" if row.get("error") is None else str(row["error"])


def _settings_rows(summaries: list[dict]) -> list[tuple[str, list[str], bool]]:
    """(setting, value per run, whether the runs differ) for every setting of any run."""
    keys = sorted({k for s in summaries for k in s["settings"]})
    out = []
    for k in keys:
        values = [_fmt_setting(s["settings"][k]) if k in s["settings"] else NONE for s in summaries]
        out.append((k, values, len(set(values)) > 1))
    return out


def _summary_lines(s: dict) -> list[tuple[str, str]]:
    """(label, value) of a run's summary apart from its settings and statuses, in print order."""
    g = s["geomean_speedup"]
    speed = (f"{fmt_speedup(g)} over {s['speedups']} of {s['models']} models" if g is not None
             else f"{NONE} (no model has a speed-up)")
    return [("created", s["created"]), ("updated", s["updated"]), ("models", str(s["models"])),
            ("geometric-mean speed-up vs onnxruntime", speed),
            ("total optimize time", _fmt_seconds(s["optimize_s"])),
            ("total compile time", _fmt_seconds(s["compile_s"])),
            ("total wall time", _fmt_seconds(s["wall_s"]))]


_MODEL_COLUMNS = ("model", "status", "error", "nodes before → after", "optimize s", "compile s", "fallbacks",
                  "egraft ms", "onnxruntime ms", "speed-up", "max error", "worker")


def _model_cells(row: dict) -> list[str]:
    """The plain-text cells of a model's table row (error cut), in :data:`_MODEL_COLUMNS` order."""
    err = _error_text(row)
    if err and row.get("stage"):
        err = f"{row['stage']}: {err}"
    return [str(row["model"]), str(row.get("status")), shorten(err, ERROR_CHARS) if err else "",
            _fmt_nodes(row.get("nodes_before"), row.get("nodes_after")),
            _fmt(row.get("optimize_s"), ".2f"), _fmt(row.get("compile_s"), ".2f"), _fmt_int(row.get("fallbacks")),
            _fmt_ms(row.get("egraft_ms")), _fmt_ms(row.get("onnxruntime_ms")), fmt_speedup(row.get("speedup")),
            _fmt(row.get("max_error"), ".2e"), str(row.get("worker") or "")]


_DIFF_COLUMNS = ("model", "status A → B", "egraft ms A", "egraft ms B", "speed ratio A/B", "optimize s A",
                 "optimize s B", "optimize ratio B/A", "nodes after A → B")


def _diff_cells(e: dict) -> list[str]:
    return [str(e["model"]), f"{e['status_a'] or 'missing'} → {e['status_b'] or 'missing'}",
            _fmt_ms(e["egraft_ms_a"]), _fmt_ms(e["egraft_ms_b"]), fmt_speedup(e["speed_ratio"]),
            _fmt(e["optimize_s_a"], ".2f"), _fmt(e["optimize_s_b"], ".2f"), fmt_speedup(e["optimize_ratio"]),
            _fmt_nodes(e["nodes_after_a"], e["nodes_after_b"])]


def _diff_summary(entries: list[dict]) -> str:
    ratios = [e["speed_ratio"] for e in entries if e["speed_ratio"] is not None]
    g = geomean(ratios)
    changed = sum(e["status_changed"] for e in entries)
    faster = sum(r > 1 for r in ratios)
    slower = sum(r < 1 for r in ratios)
    speed = (f"geometric-mean speed ratio A/B {fmt_speedup(g)} over {len(ratios)} of {len(entries)} models "
             f"(above 1: B is faster; B faster on {faster}, slower on {slower})" if g is not None
             else "no model has an egraft latency in both runs")
    return f"{speed}; {changed} model{'s' * (changed != 1)} changed status."


# ---- HTML --------------------------------------------------------------------------------------------
def _e(text) -> str:
    return html.escape(str(text), quote=True)


def _html_table(header: list[str], rows: list[str], cls: str) -> str:
    head = "".join(f"<th>{_e(h)}</th>" for h in header)
    return (f'<div class="wide"><table class="{cls}">\n<thead><tr>{head}</tr></thead>\n<tbody>\n' + "\n".join(rows)
            + "\n</tbody></table></div>")


def _html_summary(summaries: list[dict]) -> str:
    multi = len(summaries) > 1
    header = ["", *(("A: " if i == 0 else f"{chr(66 + i - 1)}: ") * multi + s["name"]
                    for i, s in enumerate(summaries))]
    lines = []
    for i, (label, _) in enumerate(_summary_lines(summaries[0])):
        cells = "".join(f'<td class="num">{_e(_summary_lines(s)[i][1])}</td>' for s in summaries)
        lines.append(f"<tr><th>{_e(label)}</th>{cells}</tr>")
    statuses = list(dict.fromkeys(k for s in summaries for k in s["counts"]))
    for status in statuses:
        cells = "".join(f'<td class="num">{s["counts"].get(status, 0)}</td>' for s in summaries)
        lines.append(f'<tr><th><span class="badge {_status_class(status)}">{_e(status)}</span></th>{cells}</tr>')
    for key, values, differs in _settings_rows(summaries):
        cls = ' class="differs"' if differs and multi else ""
        cells = "".join(f"<td{cls}><code>{_e(v)}</code></td>" for v in values)
        lines.append(f"<tr><th>setting <code>{_e(key)}</code></th>{cells}</tr>")
    return _html_table(header, lines, "summary")


def _html_models(rows: list[dict]) -> str:
    lines = []
    for r in rows:
        cells = _model_cells(r)
        status, err = r.get("status"), _error_text(r)
        full = f"{r['stage']}: {err}" if err and r.get("stage") else err
        tol, maxerr = finite_number(r.get("tolerance")), finite_number(r.get("max_error"))
        over = tol is not None and maxerr is not None and maxerr > tol
        speed = finite_number(r.get("speedup"))
        speed_cls = "" if speed is None else (" faster" if speed >= 1 else " slower")
        tds = [f"<td>{_e(cells[0])}</td>",
               f'<td class="nowrap"><span class="badge {_status_class(status)}">{_e(status)}</span></td>',
               f'<td class="err" title="{_e(full)}">{_e(cells[2])}</td>' if err else '<td class="err"></td>',
               *(f'<td class="num">{_e(c)}</td>' for c in cells[3:9]),
               f'<td class="num{speed_cls}">{_e(cells[9])}</td>',
               f'<td class="num{" over" * over}"' + (f' title="tolerance {_e(_fmt(tol, ".2e"))}"' if tol else "")
               + f">{_e(cells[10])}</td>",
               f'<td class="nowrap">{_e(cells[11])}</td>']
        lines.append(f'<tr class="{_status_class(status)}">' + "".join(tds) + "</tr>")
    return _html_table(list(_MODEL_COLUMNS), lines, "models")


def _html_diff(entries: list[dict]) -> str:
    lines = []
    for e in entries:
        cells = _diff_cells(e)
        r = e["speed_ratio"]
        speed_cls = "" if r is None else (" faster" if r > 1 else " slower" if r < 1 else "")
        status = (f'<span class="badge {_status_class(e["status_a"])}">{_e(e["status_a"] or "missing")}</span> → '
                  f'<span class="badge {_status_class(e["status_b"])}">{_e(e["status_b"] or "missing")}</span>')
        tds = [f"<td>{_e(cells[0])}</td>", f'<td class="nowrap">{status}</td>',
               *(f'<td class="num">{_e(c)}</td>' for c in cells[2:4]),
               f'<td class="num{speed_cls}">{_e(cells[4])}</td>',
               *(f'<td class="num">{_e(c)}</td>' for c in cells[5:])]
        changed = ' class="changed"' if e["status_changed"] else ""
        lines.append(f"<tr{changed}>" + "".join(tds) + "</tr>")
    return _html_table(list(_DIFF_COLUMNS), lines, "diff")


def _html_figure(title: str, chart: tuple[str | None, str]) -> str:
    svg, caption = chart
    if svg is None:
        return f'<figure>\n<h3>{_e(title)}</h3>\n<p class="note">{_e(caption)}</p>\n</figure>'
    return f'<figure>\n<h3>{_e(title)}</h3>\n{svg}\n<figcaption class="caption">{_e(caption)}</figcaption>\n</figure>'


def render_html(store: ZooStore, runs: list[str]) -> str:
    """The report of ``runs`` (names of runs of ``store``; the first is the one detailed, each
    later one is compared to it) as one self-contained HTML page."""
    loaded = _load(store, runs)
    summaries = [summarize(info, rows) for info, rows in loaded]
    first, rows = loaded[0]
    title = f"egraft zoo report: {first.name}" + "".join(f" vs {info.name}" for info, _ in loaded[1:])
    nav = ['<a href="#summary">Summary</a>', '<a href="#models">Models</a>', '<a href="#charts">Charts</a>']
    nav += [f'<a href="#compare-{i}">{_e(info.name)} vs {_e(first.name)}</a>' for i, (info, _) in
            enumerate(loaded[1:], 1)]
    parts = [
        "<!DOCTYPE html>", '<html lang="en">', "<head>", '<meta charset="utf-8">',
        '<meta name="viewport" content="width=device-width, initial-scale=1">',
        f"<title>{_e(title)}</title>", f"<style>{_STYLE}</style>", "</head>", "<body>",
        f"<h1>{_e(title)}</h1>",
        '<p class="meta">' + "; ".join(f"run <code>{_e(s['name'])}</code>: {s['models']} models, last written "
                                       f"{_e(s['updated'])}" for s in summaries) + "</p>",
        "<nav>" + "".join(nav) + "</nav>",
        '<section id="summary">', "<h2>Summary</h2>", _html_summary(summaries), "</section>",
        '<section id="models">', f"<h2>Models of run <code>{_e(first.name)}</code></h2>",
        _html_models(rows) if rows else '<p class="note">This run has no models yet.</p>', "</section>",
        '<section id="charts">', f"<h2>Charts of run <code>{_e(first.name)}</code></h2>",
        _html_figure("Speed-up per model vs onnxruntime", speedup_chart(rows)),
        _html_figure("Time per stage", stages_chart(rows)),
        _html_figure("Rules fired", rules_chart(rows)),
        _html_figure("Predicted vs measured latency", predicted_chart(rows)),
        "</section>",
    ]
    for i, (info, other) in enumerate(loaded[1:], 1):
        entries = diff_runs(rows, other)
        parts += [f'<section id="compare-{i}">',
                  f"<h2>Run <code>{_e(info.name)}</code> (B) compared to <code>{_e(first.name)}</code> (A)</h2>",
                  f"<p>{_e(_diff_summary(entries))}</p>", _html_diff(entries),
                  _html_figure("Speed ratio per model, A/B", ratio_chart(f"ratio{i}", entries)), "</section>"]
    parts += ["</body>", "</html>", ""]
    return "\n".join(parts)


# ---- Markdown ------------------------------------------------------------------------------------
_MD_SPECIAL = re.compile(r"([\\|`*\[\]<>])")


def _m(text) -> str:
    """``text`` for a Markdown table cell: one line, with the characters that would end the
    cell or start markup or HTML backslash-escaped."""
    return _MD_SPECIAL.sub(r"\\\1", one_line(str(text)))


def _md_table(header: list[str], rows: list[list[str]], numeric_from: int = 1) -> list[str]:
    align = ["---" if i < numeric_from else "---:" for i in range(len(header))]
    out = ["| " + " | ".join(_m(h) for h in header) + " |", "| " + " | ".join(align) + " |"]
    out += ["| " + " | ".join(_m(c) for c in row) + " |" for row in rows]
    return out


def render_markdown(store: ZooStore, runs: list[str], html_name: str | None = None) -> str:
    """The report of ``runs`` as Markdown: the summary and tables of :func:`render_html`,
    without the charts (a note points to the HTML page, ``html_name`` when given)."""
    loaded = _load(store, runs)
    summaries = [summarize(info, rows) for info, rows in loaded]
    first, rows = loaded[0]
    multi = len(summaries) > 1
    title = f"egraft zoo report: {first.name}" + "".join(f" vs {info.name}" for info, _ in loaded[1:])
    out = [f"# {_m(title)}", ""]
    header = ["", *(("A: " if i == 0 else f"{chr(66 + i - 1)}: ") * multi + s["name"]
                    for i, s in enumerate(summaries))]
    table = [[label] + [_summary_lines(s)[i][1] for s in summaries]
             for i, (label, _) in enumerate(_summary_lines(summaries[0]))]
    statuses = list(dict.fromkeys(k for s in summaries for k in s["counts"]))
    table += [[status] + [str(s["counts"].get(status, 0)) for s in summaries] for status in statuses]
    table += [[f"setting {key}"] + values for key, values, _ in _settings_rows(summaries)]
    out += ["## Summary", "", *_md_table(header, table), ""]
    out += [f"## Models of run {_m(first.name)}", ""]
    out += [*_md_table(list(_MODEL_COLUMNS), [_model_cells(r) for r in rows], numeric_from=3), ""] if rows else \
        ["This run has no models yet.", ""]
    where = f"the HTML report ({_m(html_name)})" if html_name else "the HTML report"
    out += ["## Charts", "", f"The charts (speed-up, time per stage, rules fired, predicted vs measured latency"
            f"{', speed ratio' if multi else ''}) are in {where}.", ""]
    for info, other in loaded[1:]:
        entries = diff_runs(rows, other)
        out += [f"## Run {_m(info.name)} (B) compared to {_m(first.name)} (A)", "", _m(_diff_summary(entries)), ""]
        out += [*_md_table(list(_DIFF_COLUMNS), [_diff_cells(e) for e in entries], numeric_from=2), ""]
    return "\n".join(out)


def write_report(store: ZooStore, runs: list[str], html_path: Path) -> tuple[Path, Path]:
    """Write the HTML report of ``runs`` to ``html_path`` and its Markdown twin beside it
    (same name, ``.md``); return both paths."""
    html_path = Path(html_path)
    md_path = html_path.with_suffix(".md")
    page = render_html(store, runs)
    text = render_markdown(store, runs, html_name=html_path.name)
    try:
        html_path.parent.mkdir(parents=True, exist_ok=True)
        html_path.write_text(page, encoding="utf-8")
        md_path.write_text(text, encoding="utf-8")
    except OSError as e:
        raise EgraftError(f"cannot write the report {html_path}: {e.strerror}") from None
    return html_path, md_path


__all__ = ["FASTER_COLOUR", "SLOWER_COLOUR", "OPTIMIZE_COLOUR", "COMPILE_COLOUR", "fmt_speedup", "render_html",
           "render_markdown", "summarize", "write_report"]

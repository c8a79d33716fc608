"""The charts of the zoo report: each a function from rows to inline SVG text (drawn by
matplotlib, imported only when a chart is drawn) and a one-line caption, or ``None`` and
a sentence saying why there is nothing to draw. The SVG is deterministic (a fixed hash
salt, no date) and its ids are prefixed per chart, so several charts share one page.

Example:
    >>> svg, caption = speedup_chart([{"model": "m", "speedup": 1.5}])
    >>> svg.startswith("<svg"), caption.split(";")[0]
    (True, '1 of 1 models, fastest first')
"""

from __future__ import annotations

import html
import io
import math
import re
from collections.abc import Callable

#: Bar colours of the speed-up and speed-ratio charts: at or above 1 (egraft, or run B, is
#: faster) and below 1.
FASTER_COLOUR = "#2a9d8f"
SLOWER_COLOUR = "#e76f51"
#: The stacked bars of the time-per-stage chart.
OPTIMIZE_COLOUR = "#264653"
COMPILE_COLOUR = "#e9c46a"
#: The heat map shows at most this many rules (the most applied ones).
MAX_HEATMAP_RULES = 40
#: Labels of the charts' axes are cut to this many characters.
LABEL_CHARS = 40
#: Points of the predicted-vs-measured chart are labelled with their model up to this many.
MAX_POINT_LABELS = 30


# ---- values ----------------------------------------------------------------------------------------
def finite_number(v) -> float | None:
    """``v`` when it is a finite number (not a bool), else None."""
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        return None
    return v


def positive_number(v) -> float | None:
    """``v`` when it is a finite number above 0, else None."""
    v = finite_number(v)
    return v if v is not None and v > 0 else None


def one_line(text: str) -> str:
    """``text`` with every run of whitespace one space."""
    return " ".join(str(text).split())


def shorten(text: str, limit: int) -> str:
    """``text`` on one line, cut to ``limit`` characters with an ellipsis."""
    text = one_line(text)
    return text if len(text) <= limit else text[:limit - 1].rstrip() + "…"


# ---- charts ----------------------------------------------------------------------------------------
def _label(text: str) -> str:
    """``text`` as a chart label: cut, and its dollar signs escaped (they would start mathtext)."""
    return shorten(text, LABEL_CHARS).replace("$", r"\$")


def _log_ticks(axis, suffix: str = "") -> None:
    """Ticks at 1, 2 and 5 of each decade of a log ``axis``, labelled as plain numbers."""
    from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter

    axis.set_major_locator(LogLocator(base=10, subs=(1.0, 2.0, 5.0)))
    axis.set_major_formatter(FuncFormatter(lambda x, _: f"{x:g}{suffix}"))
    axis.set_minor_formatter(NullFormatter())


def _svg(name: str, draw: Callable) -> str:
    """``draw(Figure)`` rendered to inline SVG text: deterministic (fixed hash salt, no date),
    text kept as text, and every id prefixed with ``name`` so that the page's charts do not share ids."""
    import matplotlib
    from matplotlib.figure import Figure

    rc = {"svg.hashsalt": f"egraft-zoo-{name}", "svg.fonttype": "none", "text.parse_math": False,
          "font.family": "sans-serif", "font.size": 9, "axes.titlesize": 10}
    with matplotlib.rc_context(rc):
        fig = Figure()
        draw(fig)
        buf = io.StringIO()
        fig.savefig(buf, format="svg", metadata={"Date": None}, bbox_inches="tight")
    text = buf.getvalue()
    text = text[text.index("<svg"):]
    text = re.sub(r"\s*<metadata>.*?</metadata>", "", text, flags=re.S)
    text = re.sub(r"<!--.*?-->", "", text, flags=re.S)
    text = text.replace("<style type=\"text/css\">*{", "<style type=\"text/css\">svg *{")
    text = re.sub(r'\bid="([^"]+)"', rf'id="{name}-\1"', text)
    text = re.sub(r'url\(#([^)]+)\)', rf'url(#{name}-\1)', text)
    text = re.sub(r'href="#([^"]+)"', rf'href="#{name}-\1"', text)
    return text.replace("<svg ", f'<svg role="img" aria-label="{html.escape(name)} chart" ', 1).strip()


def _diverging_bars(fig, labels: list[str], values: list[float], xlabel: str, title: str) -> None:
    """Horizontal bars from 1 to each value on a log axis, top to bottom in the given order."""
    n = len(values)
    fig.set_size_inches(8, 1.1 + 0.28 * n)
    ax = fig.subplots()
    ys = list(range(n))
    colours = [FASTER_COLOUR if v >= 1 else SLOWER_COLOUR for v in values]
    ax.barh(ys, [v - 1 for v in values], left=1, color=colours, height=0.7)
    ax.axvline(1.0, color="#333", linewidth=1)
    ax.set_xscale("log")
    lo, hi = min(min(values), 1.0), max(max(values), 1.0)
    ax.set_xlim(lo / 1.6, hi * 1.6)
    _log_ticks(ax.xaxis, "×")
    for y, v in zip(ys, values):
        ax.annotate(f"{v:.2f}×", (v, y), xytext=(3 if v >= 1 else -3, 0), textcoords="offset points",
                    ha="left" if v >= 1 else "right", va="center", fontsize=8)
    ax.set_yticks(ys, [_label(s) for s in labels])
    ax.set_ylim(n - 0.5, -0.5)
    ax.set_xlabel(xlabel)
    ax.set_title(title, loc="left")
    ax.grid(axis="x", which="major", color="#ddd", linewidth=0.6)
    ax.set_axisbelow(True)


def speedup_chart(rows: list[dict]) -> tuple[str | None, str]:
    points = sorted(((r["model"], positive_number(r.get("speedup"))) for r in rows
                     if positive_number(r.get("speedup"))), key=lambda p: (-p[1], p[0]))
    if not points:
        return None, "No model has a speed-up (none was benchmarked against onnxruntime)."
    svg = _svg("speedup", lambda fig: _diverging_bars(
        fig, [p[0] for p in points], [p[1] for p in points], "speed-up vs onnxruntime (log scale)",
        "onnxruntime ms / egraft ms"))
    return svg, (f"{len(points)} of {len(rows)} models, fastest first; right of the line at 1× egraft is faster "
                 f"than onnxruntime, left of it slower.")


def stages_chart(rows: list[dict]) -> tuple[str | None, str]:
    points = [(r["model"], finite_number(r.get("optimize_s")) or 0.0, finite_number(r.get("compile_s")) or 0.0)
              for r in rows
              if finite_number(r.get("optimize_s")) is not None or finite_number(r.get("compile_s")) is not None]
    if not points:
        return None, "No model reached the optimize stage, so there is no time per stage to show."

    def draw(fig):
        n = len(points)
        fig.set_size_inches(8, 1.3 + 0.28 * n)
        ax = fig.subplots()
        ys = list(range(n))
        opt = [p[1] for p in points]
        ax.barh(ys, opt, color=OPTIMIZE_COLOUR, height=0.7, label="optimize")
        ax.barh(ys, [p[2] for p in points], left=opt, color=COMPILE_COLOUR, height=0.7, label="compile")
        ax.set_yticks(ys, [_label(p[0]) for p in points])
        ax.set_ylim(n - 0.5, -0.5)
        ax.set_xlabel("seconds")
        ax.set_title("optimize + compile time", loc="left")
        ax.legend(loc="lower right", frameon=False, ncols=2, bbox_to_anchor=(1.0, 1.0))
        ax.grid(axis="x", color="#ddd", linewidth=0.6)
        ax.set_axisbelow(True)

    return _svg("stages", draw), (f"{len(points)} of {len(rows)} models: optimize (load, saturate, extract) "
                                  f"then compile (lowering, code generation, LLVM), stacked.")


def rules_chart(rows: list[dict]) -> tuple[str | None, str]:
    models = [r for r in rows if isinstance(r.get("rules"), dict)]
    totals: dict[str, float] = {}
    for r in models:
        for rule, n in r["rules"].items():
            if positive_number(n):
                totals[str(rule)] = totals.get(str(rule), 0) + n
    if not totals:
        return None, "No rule fired in any model (or no model reached the optimize stage)."
    rules = sorted(totals, key=lambda k: (-totals[k], k))[:MAX_HEATMAP_RULES]
    models = [r for r in models if any(positive_number(r["rules"].get(k)) for k in rules)]

    def draw(fig):
        import numpy as np
        from matplotlib.colors import LogNorm

        grid = np.ma.masked_less_equal(
            np.array([[positive_number(r["rules"].get(k)) or 0.0 for r in models] for k in rules], dtype=float), 0.0)
        fig.set_size_inches(max(6.0, 3.5 + 0.32 * len(models)), 1.6 + 0.24 * len(rules) + 0.05 * max(
            len(_label(r["model"])) for r in models))
        ax = fig.subplots()
        ax.set_facecolor("#e4e4e4")
        norm = LogNorm(vmin=1, vmax=max(2.0, float(grid.max())))
        mesh = ax.pcolormesh(grid, cmap="viridis", norm=norm, edgecolors="white", linewidth=0.5)
        if len(rules) * len(models) <= 600:
            for (i, j), n in np.ndenumerate(grid.filled(0.0)):
                if n > 0:
                    ax.text(j + 0.5, i + 0.5, f"{n:g}", ha="center", va="center", fontsize=7,
                            color="white" if norm(n) < 0.6 else "black")
        ax.set_xticks([i + 0.5 for i in range(len(models))], [_label(r["model"]) for r in models], rotation=90)
        ax.set_yticks([i + 0.5 for i in range(len(rules))], [_label(k) for k in rules])
        ax.set_ylim(len(rules), 0)
        ax.tick_params(length=0)
        bar = fig.colorbar(mesh, ax=ax, label="applications (log scale)", fraction=0.04, pad=0.02)
        _log_ticks(bar.ax.yaxis)

    shown = (f"the {len(rules)} most applied of the {len(totals)} rules that fired" if len(totals) > len(rules)
             else f"all {len(rules)} rules that fired")
    return _svg("rules", draw), (f"Rules × models, {shown}; colour = applications (log scale), "
                                 f"grey = not fired in that model.")


def predicted_chart(rows: list[dict]) -> tuple[str | None, str]:
    points = [(r["model"], positive_number(r.get("predicted_ms")), positive_number(r.get("egraft_ms"))) for r in rows]
    points = [p for p in points if p[1] is not None and p[2] is not None]
    if not points:
        return None, ("No model has both a predicted and a measured latency (the prediction comes from the "
                      "roofline cost model only), so there is no scatter to show.")

    def draw(fig):
        fig.set_size_inches(6, 5)
        ax = fig.subplots()
        xs, ys = [p[1] for p in points], [p[2] for p in points]
        lo, hi = min(xs + ys) / 1.5, max(xs + ys) * 1.5
        ax.plot([lo, hi], [lo, hi], color="#888", linewidth=1, linestyle="--", label="measured = predicted")
        ax.scatter(xs, ys, color=OPTIMIZE_COLOUR, s=22, zorder=3)
        if len(points) <= MAX_POINT_LABELS:
            for name, x, y in points:
                ax.annotate(_label(name), (x, y), xytext=(4, 3), textcoords="offset points", fontsize=7)
        ax.set_xscale("log")
        ax.set_yscale("log")
        _log_ticks(ax.xaxis)
        _log_ticks(ax.yaxis)
        ax.set_xlim(lo, hi)
        ax.set_ylim(lo, hi)
        ax.set_aspect("equal")
        ax.set_xlabel("predicted ms (cost model)")
        ax.set_ylabel("measured egraft ms")
        ax.legend(loc="upper left", frameon=False)
        ax.grid(color="#eee", linewidth=0.6)

    return _svg("predicted", draw), (f"{len(points)} of {len(rows)} models; above the dashed line the model "
                                     f"ran slower than the cost model predicted.")


def ratio_chart(name: str, entries: list[dict]) -> tuple[str | None, str]:
    points = sorted(((e["model"], e["speed_ratio"]) for e in entries if e["speed_ratio"] is not None),
                    key=lambda p: (-p[1], p[0]))
    if not points:
        return None, "No model has an egraft latency in both runs, so there is no speed ratio to show."
    svg = _svg(name, lambda fig: _diverging_bars(
        fig, [p[0] for p in points], [p[1] for p in points], "speed ratio A/B (log scale)",
        "egraft ms of A / egraft ms of B"))
    return svg, (f"{len(points)} of {len(entries)} models; right of the line at 1× run B is faster than run A, "
                 f"left of it slower.")


__all__ = ["FASTER_COLOUR", "SLOWER_COLOUR", "OPTIMIZE_COLOUR", "COMPILE_COLOUR", "finite_number", "positive_number",
           "one_line", "shorten", "speedup_chart", "stages_chart", "rules_chart", "predicted_chart", "ratio_chart"]

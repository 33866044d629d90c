"""``report.html``: a batch summary as one self-contained page, readable offline.

No scripts, no fonts, no images from anywhere: the plots are inline SVG
written here (horizontal bars, one row per task, so task names stay
readable), and the tables are the same rows the Markdown summary has
(:mod:`.summary`).  Stable ids for tests and for people who link to a part:
``summary-table`` (one ``tr.task-row`` per task), ``suite-metrics``, and the
plots ``plot-speedup``, ``plot-turns``, ``plot-cost``.
"""

from __future__ import annotations

from html import escape
from typing import Any

from .summary import TASK_COLUMNS, notes, suite_lines, task_table_rows

COLORS = {"gemm": "#1f77b4", "compile": "#ff7f0e", "accepted": "#2ca02c", "not": "#9e9e9e", "cost": "#9467bd"}
LABEL_W, BAR_W, VALUE_W, BAR_H, GAP = 190, 460, 80, 14, 10

Series = tuple[str, str, list[float | None]]  # name, colour, one value per row (None: n/a)


def hbar_chart(svg_id: str, title: str, rows: list[str], series: list[Series], fmt=str,
               ref: float | None = None, ref_label: str = "", na: str = "n/a") -> str:
    """Grouped horizontal bars; a None value is written ``na`` where its bar would be."""
    values = [v for _, _, vs in series for v in vs if v is not None]
    top = max([*values, ref or 0.0]) or 1.0
    group_h = BAR_H * len(series) + GAP
    legend_h = 22
    height = 30 + legend_h + group_h * len(rows) + 10
    width = LABEL_W + BAR_W + VALUE_W
    out = [f'<svg id="{svg_id}" xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
           f'viewBox="0 0 {width} {height}" role="img" aria-label="{escape(title)}">',
           f'<text x="0" y="18" class="title">{escape(title)}</text>']
    x = LABEL_W
    for name, color, _ in series:  # legend
        out.append(f'<rect x="{x}" y="28" width="12" height="12" fill="{color}"/>'
                   f'<text x="{x + 16}" y="38" class="small">{escape(name)}</text>')
        x += 20 + 7 * len(name)
    y0 = 30 + legend_h
    for r, label in enumerate(rows):
        gy = y0 + r * group_h
        out.append(f'<text x="{LABEL_W - 6}" y="{gy + group_h / 2}" text-anchor="end" '
                   f'dominant-baseline="middle">{escape(label)}</text>')
        for s, (name, color, vs) in enumerate(series):
            by, v = gy + s * BAR_H, vs[r]
            if v is None:
                if na:
                    out.append(f'<text x="{LABEL_W + 4}" y="{by + BAR_H - 3}" class="na">{escape(na)}</text>')
                continue
            w = max(1.0, BAR_W * v / top)
            out.append(f'<rect class="bar" x="{LABEL_W}" y="{by}" width="{w:.1f}" height="{BAR_H - 2}" '
                       f'fill="{color}"><title>{escape(f"{label}, {name}: {fmt(v)}")}</title></rect>'
                       f'<text x="{LABEL_W + w + 4:.1f}" y="{by + BAR_H - 3}" class="small">{escape(fmt(v))}</text>')
    if ref is not None:
        rx = LABEL_W + BAR_W * ref / top
        out.append(f'<line x1="{rx:.1f}" y1="{y0 - 4}" x2="{rx:.1f}" y2="{height - 6}" class="ref"/>'
                   f'<text x="{rx + 3:.1f}" y="{height - 2}" class="small">{escape(ref_label)}</text>')
    out.append("</svg>")
    return "\n".join(out)


def plots(summary: dict[str, Any]) -> list[str]:
    tasks = summary["tasks"]
    names = [t["task"] for t in tasks]
    speedup = hbar_chart(
        "plot-speedup", "Best speedup per task (baseline time / program time; n/a: no accepted GPU run)", names,
        [("vs plain GEMM", COLORS["gemm"], [t["best_speedup_vs_gemm"] for t in tasks]),
         ("vs torch.compile", COLORS["compile"], [t["best_speedup_vs_compile"] for t in tasks])],
        fmt=lambda v: f"{v:.2f}x", ref=1.0, ref_label="1.0x")
    turns = hbar_chart(
        "plot-turns", "Turns: to acceptance, or used when not accepted", names,
        [("turns to acceptance", COLORS["accepted"], [t["turns_to_accept"] for t in tasks]),
         ("turns used, not accepted (max over samples)", COLORS["not"],
          [None if t["solved"] else max(t["turns"], default=0) for t in tasks])],
        fmt=lambda v: f"{v:g}", na="")  # each task has exactly one of the two bars
    cost = hbar_chart(
        "plot-cost", "Cost per task, USD (all samples; n/a: no price known)", names,
        [("cost", COLORS["cost"], [t["cost_usd"] for t in tasks])], fmt=lambda v: f"${v:.4f}")
    return [speedup, turns, cost]


CSS = """
body { font-family: system-ui, sans-serif; margin: 24px; color: #222; max-width: 1100px; }
table { border-collapse: collapse; margin: 12px 0 24px; }
th, td { border: 1px solid #ccc; padding: 4px 8px; text-align: left; font-size: 14px; }
th { background: #f2f2f2; }
.note { background: #fff8e1; border-left: 4px solid #f0b400; padding: 8px 12px; margin: 8px 0; }
svg { display: block; margin: 16px 0; font-size: 12px; }
svg .title { font-size: 14px; font-weight: bold; }
svg .small { font-size: 11px; fill: #333; }
svg .na { font-size: 11px; fill: #999; font-style: italic; }
svg .ref { stroke: #d62728; stroke-dasharray: 4 3; }
"""


def _table(table_id: str, header: list[str], rows: list[list[str]], row_class: str = "") -> str:
    head = "".join(f"<th>{escape(h)}</th>" for h in header)
    body = "\n".join(f'<tr class="{row_class}">' + "".join(f"<td>{escape(c)}</td>" for c in r) + "</tr>"
                     for r in rows)
    return f'<table id="{table_id}"><thead><tr>{head}</tr></thead><tbody>\n{body}\n</tbody></table>'


def render(summary: dict[str, Any]) -> str:
    s = summary["suite"]
    title = f"{summary['batch']}: {s['tasks']} tasks x {summary['samples']} samples ({summary['model']})"
    parts = [f"<h1>{escape(title)}</h1>"]
    parts += [f'<p class="note">{escape(n)}</p>' for n in notes(summary)]
    parts += ["<h2>Tasks</h2>", _table("summary-table", TASK_COLUMNS, task_table_rows(summary), "task-row")]
    parts += ["<h2>Suite</h2>", _table("suite-metrics", ["metric", "value"], [list(x) for x in suite_lines(summary)])]
    parts += ["<h2>Plots</h2>", *plots(summary)]
    return (f'<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8"><title>{escape(title)}</title>'
            f"<style>{CSS}</style></head>\n<body>\n" + "\n".join(parts) + "\n</body></html>\n")

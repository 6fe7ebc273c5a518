"""report/index.html: the sweep's report as one page that opens offline and travels as one file.

The same content as summary.md (rendered from it, so the two cannot disagree), with the plots
embedded, every table sortable by a click on its header, and a drill-down per job: its
per-position acceptance, where its cycles' time went, the pairs behind its speedup's interval and
the lossless check's detail."""
from __future__ import annotations

import base64
import html
import json
import math
import re
from pathlib import Path

import pandas as pd

# Sorting by a column: numbers as numbers (a cell's first number), the rest as text; a second
# click reverses. Written for this page; no library is loaded (the page must open offline).
SORT_SCRIPT = """
document.querySelectorAll("table").forEach(function (table) {
  table.querySelectorAll("th").forEach(function (th, col) {
    th.title = "sort by this column";
    th.addEventListener("click", function () {
      var body = table.tBodies[0];
      var rows = Array.from(body.rows);
      var up = th.dataset.order !== "asc";
      function key(row) {
        var text = row.cells[col] ? row.cells[col].textContent.trim() : "";
        var num = parseFloat(text.replace(/[^0-9eE+.-].*$/, ""));
        return isNaN(num) ? text : num;
      }
      rows.sort(function (a, b) {
        var x = key(a), y = key(b);
        if (typeof x !== typeof y) { x = String(x); y = String(y); }
        return (x < y ? -1 : x > y ? 1 : 0) * (up ? 1 : -1);
      });
      rows.forEach(function (r) { body.appendChild(r); });
      th.dataset.order = up ? "asc" : "desc";
    });
  });
});
"""

STYLE = """
body { font-family: system-ui, sans-serif; margin: 2em auto; padding: 0 1em; max-width: 1200px; color: #222;
       line-height: 1.4; }
table { border-collapse: collapse; margin: 0.8em 0; font-size: 0.85em; display: block; overflow-x: auto; }
th, td { border: 1px solid #bbb; padding: 0.2em 0.5em; text-align: right; }
th { background: #eee; cursor: pointer; }
td:first-child, th:first-child { text-align: left; }
img { max-width: 100%; border: 1px solid #ddd; margin: 0.5em 0; }
details { margin: 0.3em 0; padding: 0.3em 0.6em; border: 1px solid #ddd; }
summary { cursor: pointer; font-family: monospace; }
code { background: #f4f4f4; padding: 0 0.2em; }
"""


def _fmt(v, spec: str = ".3f") -> str:
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "-"
    return format(v, spec) if isinstance(v, (int, float)) and not isinstance(v, bool) else str(v)


def _table(headers: list[str], rows: list[list]) -> str:
    head = "".join(f"<th>{html.escape(h)}</th>" for h in headers)
    body = "".join("<tr>" + "".join(f"<td>{html.escape(_fmt(c))}</td>" for c in r) + "</tr>" for r in rows)
    return f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"


def _list(v) -> list:
    if isinstance(v, str):
        try:
            v = json.loads(v)
        except ValueError:
            return []
    return list(v) if isinstance(v, (list, tuple)) or hasattr(v, "tolist") else []


def job_details(r) -> str:
    """One job's drill-down, from its row."""
    ci = f" [{_fmt(r.get('speedup_ci_low'), '.2f')}, {_fmt(r.get('speedup_ci_high'), '.2f')}]"
    title = (f"{r.get('job')}: speedup {_fmt(r.get('speedup'), '.2f')}{ci}, alpha {_fmt(r.get('acceptance_rate'), '.2f')}"
             f", lossless {_fmt(r.get('lossless'))}, status {r.get('status')}")
    parts = []
    per = _list(r.get("per_position_acceptance"))
    if per:
        parts.append("<h4>Acceptance per draft position</h4>"
                     + _table(["position"] + [str(j + 1) for j in range(len(per))], [["accepted"] + per]))
    v, d = r.get("verify_fraction"), r.get("draft_fraction")
    if isinstance(v, float) and isinstance(d, float) and v == v and d == d:
        parts.append("<h4>Where a cycle's time went</h4>"
                     + _table(["verify", "draft", "other"], [[f"{v:.1%}", f"{d:.1%}", f"{max(0.0, 1 - v - d):.1%}"]]))
    pairs = _list(r.get("pairs"))
    if pairs:
        parts.append(f"<h4>The {len(pairs)} pairs behind the interval</h4>"
                     + _table(["repeat", "batch", "first", "speedup"],
                              [[p.get("repeat"), p.get("batch"), p.get("first") or "-", p.get("speedup")] for p in pairs]))
    detail = _list(r.get("lossless_detail"))
    if detail:
        keys = sorted({k for x in detail if isinstance(x, dict) for k in x})
        parts.append("<h4>Lossless check: each divergence</h4>"
                     + _table(keys, [[json.dumps(x.get(k)) if isinstance(x.get(k), (list, dict)) else x.get(k)
                                      for k in keys] for x in detail if isinstance(x, dict)]))
    if r.get("error"):
        parts.append(f"<h4>Error</h4><pre>{html.escape(str(r.get('error')))}</pre>")
    body = "".join(parts) or "<p>Nothing more was recorded for this job.</p>"
    return f'<details id="{html.escape(str(r.get("job")))}"><summary>{html.escape(title)}</summary>{body}</details>'


def _embed_images(body: str, folder: Path) -> str:
    def one(m):
        path = folder / m.group(2)
        if not path.is_file():
            return m.group(0)
        data = base64.b64encode(path.read_bytes()).decode()
        return f'{m.group(1)}data:image/png;base64,{data}{m.group(3)}'
    return re.sub(r'(<img [^>]*src=")([^":]+\.png)(")', one, body)


def write_html(out: Path, title: str, summary_md: str, df: pd.DataFrame) -> Path:
    """out/index.html from the report's summary.md text and plots (in out) and the jobs' rows."""
    import markdown

    body = markdown.markdown(summary_md, extensions=["tables"])
    body = _embed_images(body, out)
    order = [c for c in ("workload", "method", "batch_size", "load_level") if c in df.columns]
    jobs = "".join(job_details(r) for _, r in (df.sort_values(order) if order else df).iterrows())
    page = (f"<!doctype html><html lang=\"en\"><head><meta charset=\"utf-8\"><title>{html.escape(title)}</title>"
            f"<style>{STYLE}</style></head><body>{body}<h2>Every job</h2>"
            f"<p>Click a job for its per-position acceptance, time split, pairs and lossless detail; click a table's "
            f"header to sort by that column.</p>{jobs}<script>{SORT_SCRIPT}</script></body></html>")
    path = out / "index.html"
    path.write_text(page)
    return path

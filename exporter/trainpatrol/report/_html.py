"""Tiny HTML helpers. Everything from the bundle is escaped: a stack or a label may hold anything."""

from __future__ import annotations

import html
import math
from collections.abc import Iterable, Sequence


def esc(value: object) -> str:
    return html.escape(str(value), quote=True)


def table(headers: Sequence[str], rows: Iterable[Sequence[str]], *, cls: str = "", raw: bool = False) -> str:
    """A table; headers and cells are escaped unless ``raw`` (then the caller escaped them)."""
    cell = (lambda c: c) if raw else esc
    head = "".join(f"<th>{cell(h)}</th>" for h in headers)
    body = "".join("<tr>" + "".join(f"<td>{cell(c)}</td>" for c in row) + "</tr>" for row in rows)
    attr = f' class="{esc(cls)}"' if cls else ""
    return f"<table{attr}><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"


def details(summary: str, body: str, *, open_: bool = False, ident: str = "") -> str:
    attrs = (" open" if open_ else "") + (f' id="{esc(ident)}"' if ident else "")
    return f"<details{attrs}><summary>{summary}</summary>{body}</details>"


def pre(text: str, cls: str = "") -> str:
    return f'<pre class="{esc(cls)}">{esc(text)}</pre>'


def note(text_html: str, kind: str = "info") -> str:
    return f'<div class="note {esc(kind)}">{text_html}</div>'


def num(value: object, digits: int = 4) -> str:
    """A number for a table: integers as they are, floats to ``digits`` significant digits, NaN/Inf named."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return "" if value is None else str(value)
    if isinstance(value, int):
        return str(value)
    return f"{value:.{digits}g}" if math.isfinite(value) else value_label(value)


def value_label(v: float) -> str:
    return "NaN" if math.isnan(v) else ("+Inf" if v > 0 else "-Inf")


def gib(value: object) -> str:
    return f"{value / 2**30:.2f} GiB" if isinstance(value, int | float) and math.isfinite(value) else "-"


CSS = """
:root { --fg:#1d2330; --muted:#5f6b7a; --line:#d9dee5; --bg:#f6f7f9; --bad:#c62828; --ok:#2e7d32; --warn:#b26a00; }
* { box-sizing: border-box; }
body { margin:0; font: 14px/1.45 system-ui, -apple-system, "Segoe UI", Roboto, "DejaVu Sans", sans-serif;
       color:var(--fg); background:var(--bg); }
header { background:#1d2330; color:#fff; padding:14px 24px; }
header h1 { margin:0; font-size:20px; font-weight:600; }
header .sub { color:#b8c1cf; font-size:13px; margin-top:2px; }
nav { background:#fff; border-bottom:1px solid var(--line); padding:6px 24px; position:sticky; top:0; z-index:1; }
nav a { margin-right:16px; color:#1f5fbf; text-decoration:none; font-size:13px; }
main { max-width:1240px; margin:0 auto; padding:12px 24px 48px; }
section { background:#fff; border:1px solid var(--line); border-radius:6px; padding:12px 18px; margin:14px 0; }
h2 { font-size:17px; margin:2px 0 10px; }
h3 { font-size:15px; margin:14px 0 6px; }
h4 { font-size:14px; margin:10px 0 4px; }
table { border-collapse:collapse; margin:6px 0 10px; font-size:13px; }
th, td { border:1px solid var(--line); padding:3px 8px; text-align:left; vertical-align:top; }
th { background:#f0f2f5; font-weight:600; }
table.nums td { font-variant-numeric: tabular-nums; white-space: nowrap; }
table.nums td:nth-child(3) { white-space: normal; font-size: 12px; }
pre { background:#f6f8fa; border:1px solid var(--line); border-radius:4px; padding:8px 10px; overflow:auto;
      max-height:480px; font: 12px/1.35 ui-monospace, "DejaVu Sans Mono", Menlo, Consolas, monospace; }
code { font: 12.5px ui-monospace, "DejaVu Sans Mono", Menlo, Consolas, monospace; background:#f0f2f5;
       padding:0 3px; border-radius:3px; }
details { margin:6px 0; }
summary { cursor:pointer; font-weight:600; }
.badge { display:inline-block; padding:1px 9px; border-radius:10px; font-size:12px; font-weight:600; color:#fff;
         vertical-align:middle; margin-left:8px; }
.badge.ok { background:var(--ok); } .badge.bad { background:var(--bad); } .badge.warn { background:var(--warn); }
.note { border-left:4px solid #1f5fbf; background:#eef4fd; padding:6px 10px; margin:8px 0; }
.note.warn { border-color:var(--warn); background:#fff6e5; }
.note.bad { border-color:var(--bad); background:#fdecea; }
.muted { color:var(--muted); }
.bad-text { color:var(--bad); font-weight:600; }
dl.facts { display:grid; grid-template-columns: 170px 1fr; gap:3px 12px; margin:4px 0 8px; }
dl.facts dt { color:var(--muted); } dl.facts dd { margin:0; }
figure.timeline { margin:0; } figure.timeline svg { width:100%; height:auto; display:block; }
figcaption { color:var(--muted); font-size:12.5px; margin-top:4px; }
"""

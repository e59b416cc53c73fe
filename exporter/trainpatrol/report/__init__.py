"""The evidence report: ``<bundle>/report.html``, one self-contained page per incident (inline CSS and SVG, no
scripts, no fetches).

It shows what happened, every rank's recent history on one step axis, the GPU readings, the
allocator, the stacks, the DataLoader audit and what to do next (from docs/runbooks.md). Plots need
matplotlib (the ``report`` extra); ``trainpatrol report DIR`` regenerates the page.
"""

from __future__ import annotations

import os
from pathlib import Path

from .._version import __version__
from . import hardware, story
from ._html import CSS, esc, note
from .bundle import Bundle, Incident, load, ranks_text, read_incident
from .runbook import find_runbooks
from .timeline import PANELS, render_svg

__all__ = ["REPORT_NAME", "write_report"]

REPORT_NAME = "report.html"
SECTIONS = (("happened", "What happened"), ("next", "What to do next"), ("timeline", "Timeline"),
            ("loader", "DataLoader"), ("gpu", "GPU readings"), ("memory", "Memory"), ("stacks", "Stacks"),
            ("files", "Bundle"))


def _timeline(bundle: Bundle) -> str:
    if not any(part.history for part in bundle.ranks):
        return note("No rank's history.json holds a step record.", "warn")
    try:
        svg, counts = render_svg(bundle.ranks, bundle.step, bundle.action)
    except ImportError:
        return note("The plots need matplotlib: <code>pip install 'trainpatrol[report]'</code>, then "
                    f"<code>trainpatrol report {esc(bundle.path)}</code>.", "warn")
    empty = [p.title for p in PANELS if not counts[p.key]]
    caption = (f"The last {max(len(p.history) for p in bundle.ranks)} steps of every rank's history, on one step "
               "axis. Red bands and crosses mark non-finite values (the line breaks there); the dashed line is "
               f"the step of the {esc(bundle.action)}. Loader wait ratio = loader_wait_seconds / step_seconds. "
               "Memory is sampled on a time budget, so its points are joined across unsampled steps. Ranks with equal "
               "values (a DDP gradient norm) draw on top of each other, the highest rank on top.")
    if empty:
        caption += f" No values in this bundle for: {esc(', '.join(empty))}."
    caption += _simulated(bundle, [p.title for p in PANELS if p.memory and counts[p.key]])
    return f'<figure class="timeline" id="timeline">{svg}<figcaption>{caption}</figcaption></figure>'


def _simulated(bundle: Bundle, memory_panels: list[str]) -> str:
    """A sentence for the caption when memory panels plot a simulated allocator's readings."""
    ranks = [p for p in bundle.ranks if p.simulated_memory]
    if not ranks or not memory_panels:
        return ""
    readers = sorted({p.memory_reader for p in ranks})
    panels = ", ".join(memory_panels[:-1]) + (" and " if len(memory_panels) > 1 else "") + memory_panels[-1]
    return (f" The {esc(panels)} panel{'s' if len(memory_panels) > 1 else ''} plot simulated values for "
            f"{esc(ranks_text([p.rank for p in ranks]))}: their memory readings came from PatrolConfig.memory_reader "
            f"= {esc(' / '.join(readers))}, not from a CUDA allocator.")


def render(bundle: Bundle, inc: Incident, runbooks: Path | None) -> str:
    bodies = {"happened": story.happened(bundle, inc), "next": story.next_steps(bundle, inc, runbooks),
              "timeline": _timeline(bundle), "loader": story.loader(bundle), "gpu": hardware.gpus(bundle),
              "memory": hardware.memory(bundle), "stacks": hardware.stacks(bundle), "files": hardware.files(bundle)}
    problems = "".join(note(esc(n), "warn") for n in bundle.notes)
    title = f"{inc.action} at step {inc.step} — run {inc.run}"
    nav = "".join(f'<a href="#{k}">{esc(t)}</a>' for k, t in SECTIONS)
    sections = "".join(f'<section id="{k}"><h2>{esc(t)}</h2>{bodies[k]}</section>' for k, t in SECTIONS)
    return (f'<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8">'
            f'<meta name="viewport" content="width=device-width, initial-scale=1">'
            f"<meta http-equiv=\"Content-Security-Policy\" content=\"default-src 'none'; img-src data:; "
            f"style-src 'unsafe-inline'\">"
            f"<title>trainpatrol: {esc(title)}</title><style>{CSS}</style></head><body>"
            f"<header><h1>trainpatrol evidence: {esc(title)}</h1>"
            f'<div class="sub">{esc(inc.when)} · bundle {esc(bundle.path.name)} · report by trainpatrol '
            f"{esc(__version__)}</div></header><nav>{nav}</nav><main>{problems}{sections}</main></body></html>\n")


def write_report(bundle: Path, *, runbooks: Path | None = None) -> Path:
    """Write ``<bundle>/report.html`` from the bundle's files and return its path.

    ``runbooks`` is the runbook Markdown (default: $TRAINPATROL_RUNBOOKS, or the docs/runbooks.md the
    package ships); without one, built-in hints stand in.
    """
    bundle = Path(bundle)
    data = load(bundle)
    page = render(data, read_incident(data), find_runbooks(runbooks))
    target = bundle / REPORT_NAME
    tmp = target.with_name(f".{REPORT_NAME}.{os.getpid()}.tmp")
    tmp.write_text(page, encoding="utf-8")
    os.replace(tmp, target)
    return target

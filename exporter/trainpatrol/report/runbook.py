"""What to do next: the runbook section of the alert (docs/runbooks.md, one ``## AlertName`` section per
alert), read when the report is written, or a short built-in hint when no runbook has that section.
"""

from __future__ import annotations

import html
import os
import re
from dataclasses import dataclass
from pathlib import Path

from .. import shipped
from .._version import __version__
from ._html import table

ENV = "TRAINPATROL_RUNBOOKS"
PACKAGED = f"the runbooks of trainpatrol {__version__} (docs/runbooks.md)"
RUNBOOK_URL = "https://github.com/trainpatrol/trainpatrol/blob/main/docs/runbooks.md"
"""Where the shipped alerts' ``runbook_url`` points (alerting/config.py); the report's runbook links go there,
since a ``#section`` link would point into the report page, which has none of the runbook's sections."""
_HEADING = re.compile(r"^(#{1,6})\s+(.+?)\s*#*\s*$")

BUILTIN = {
    "nonfinite_loss": [
        "Find the first non-finite step in the timeline and whether one rank or all ranks went first.",
        "NaN on one rank only points at its batch: dump the sample ids of that step and look for bad data.",
        "NaN on all ranks after a grad-norm climb points at the optimisation: lower the learning rate, "
        "check warm-up, use bf16 rather than fp16 or keep GradScaler on.",
        "Resume once the cause is fixed: the report says whether the pause checkpoint is finite; if not, "
        "patrol.restore(\"latest\") takes the last good one it names.",
    ],
    "nonfinite_grad": [
        "A non-finite gradient with a finite loss is usually an fp16 overflow or a division by zero in a custom "
        "op or loss term: check the loss scale and any eps in normalisations.",
        "The checkpoint's state is finite when Patrol skipped the update (fused optimizer, or CPU); if the "
        "report marks it non-finite, restart from the last good checkpoint it names.",
    ],
    "loss_spike": [
        "Compare the spike's step with the grad norm and the loader panel: a bad batch spikes one step, "
        "an unstable optimiser climbs over several.",
        "Lower the learning rate or tighten gradient clipping if the spikes recur.",
    ],
    "loss_stagnation": ["Check the learning-rate schedule and whether the data loader repeats the same batches."],
    "grad_norm_explosion": [
        "Look for the loss rising with the grad norm; clip gradients (clip_grad_norm_) or lower the learning rate.",
    ],
    "memory_fragmentation": [
        "Reserved memory stayed unusable even at the allocation peak, or the allocator had to free its cache and "
        "retry: set PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True, or pad batches to a few fixed sizes.",
        "`trainpatrol empty-cache RUN` returns cached blocks, at the cost of slower allocations afterwards.",
    ],
    "oom_risk": [
        "Allocated memory is close to the device's capacity: lower the micro-batch size, turn on activation "
        "checkpointing, or shard optimizer state.",
    ],
    "host_memory_leak": [
        "The rank's host memory (with what its DataLoader workers added) grew steadily toward its limit, or came "
        "close to it; the kernel's OOM killer ends a rank with SIGKILL and leaves no evidence, so this was written "
        "first. The reason above gives the rate and the time left.",
        "Look for a list or dict that keeps tensors across steps: outputs or losses kept with their graphs "
        "(keep `.detach()` or `.item()`), metrics gathered for an epoch, evaluation run without torch.no_grad().",
        "Growth in the workers (trainpatrol_dataloader_worker_resident_bytes) points at the dataset: a cache "
        "that grows, or Python lists touched by every worker; set host_memory_limit_bytes to the rank's budget "
        "when several ranks share one cgroup unevenly.",
    ],
    "oom": [
        "The run ran out of device memory. Read the memory summary below, and the snapshot if recording was on.",
        "Lower the micro-batch size or sequence length, or turn on activation checkpointing, then restore the "
        "last checkpoint.",
    ],
    "request": [
        "Someone or something asked for this action by hand (CLI, HTTP API or a script); the reason says who.",
    ],
}
"""Built-in hints, by guard (or action), for when docs/runbooks.md has no section for the alert."""


@dataclass
class Advice:
    title: str
    body_html: str
    origin: str
    """Where the advice comes from, said on the page."""


def find_runbooks(explicit: Path | None = None) -> Path | None:
    """``explicit``, then $TRAINPATROL_RUNBOOKS, then the runbooks the package ships (docs/runbooks.md)."""
    candidates = [explicit, Path(os.environ[ENV]) if os.environ.get(ENV) else None, _packaged()]
    return next((p for p in candidates if p is not None and p.is_file()), None)


def _packaged() -> Path | None:
    found = shipped.data() / "runbooks.md"
    return found if isinstance(found, Path) else None  # a zipped install has no path; the built-in hints remain


def _name(runbooks: Path | None) -> str:
    """How the page names the file: the packaged one by what it is, not by where the package lies."""
    return PACKAGED if runbooks == _packaged() else str(runbooks)


def anchor(heading: str) -> str:
    """GitHub's anchor for a heading, e.g. ``TrainPatrolNonFiniteLoss`` -> ``trainpatrolnonfiniteloss``."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def sections(markdown: str) -> dict[str, tuple[str, str]]:
    """anchor -> (heading, body) of every section, the body running to the next heading of its level or above."""
    lines = markdown.splitlines()
    heads = []
    fenced = False
    for i, line in enumerate(lines):
        if line.lstrip().startswith("```"):
            fenced = not fenced
        m = None if fenced else _HEADING.match(line)
        if m:
            heads.append((i, len(m.group(1)), m.group(2)))
    out: dict[str, tuple[str, str]] = {}
    for n, (i, level, title) in enumerate(heads):
        end = next((j for j, lv, _ in heads[n + 1:] if lv <= level), len(lines))
        out.setdefault(anchor(title), (title, "\n".join(lines[i + 1:end]).strip("\n")))
    return out


def lookup(keys: list[str], runbooks: Path | None) -> Advice:
    """The runbook section of the first key that has one, else the built-in hint of the first key with one."""
    secs: dict[str, tuple[str, str]] = {}
    if runbooks is not None:
        try:
            secs = sections(runbooks.read_text(errors="replace"))
        except OSError:
            runbooks = None
    for key in keys:
        if anchor(key) in secs:
            title, body = secs[anchor(key)]
            return Advice(title, markdown_html(body, {a: t for a, (t, _) in secs.items()}),
                          f"{_name(runbooks)}, section “{title}”")
    if runbooks is None:
        why = f"no runbook file was found: the packaged docs/runbooks.md, or ${ENV}"
    elif keys:
        why = f"{_name(runbooks)} has no section {' or '.join(keys)}"
    else:
        why = "no alert or guard names a runbook section"
    hint_key = next((k for k in keys if k in BUILTIN), "" if keys else "request")
    hints = BUILTIN.get(hint_key, ["No built-in hint for this cause; read the timeline and the stacks below."])
    body_html = "<ul>" + "".join(f"<li>{inline(h)}</li>" for h in hints) + "</ul>"
    return Advice(keys[0] if keys else "A request by hand", body_html, f"a built-in hint ({why})")


def inline(text: str, headings: dict[str, str] | None = None) -> str:
    """Escape, then render `code`, **bold**, *emphasis* and [text](url) links (links are not fetched, only
    shown). ``headings`` (anchor -> title) are the runbook's sections: a ``#anchor`` link, or a "see
    *Title* above" that names one, becomes a link to that section of the published runbooks."""
    parts = re.split(r"(`[^`]+`)", text)  # code spans keep their asterisks and brackets
    return "".join(f"<code>{html.escape(p[1:-1], quote=True)}</code>" if p.startswith("`") and len(p) > 1
                   else _inline_text(p, headings or {}) for p in parts)


def _inline_text(text: str, headings: dict[str, str]) -> str:
    def see(m: re.Match[str]) -> str:
        key = anchor(m.group(2))
        if key not in headings:
            return m.group(0)
        return f"{m.group(1)}[{m.group(2)}](#{key}) in the runbooks"

    text = re.sub(r"\b(see )\*([^*]+)\*(?: (?:above|below))?", see, text)
    out = html.escape(text, quote=True)
    out = re.sub(r"\*\*([^*]+)\*\*", r"<strong>\1</strong>", out)
    out = re.sub(r"(?<![\w*])\*([^*\s](?:[^*]*[^*\s])?)\*(?![\w*])", r"<em>\1</em>", out)
    out = re.sub(r"\[([^\]]+)\]\(#([\w-]+)\)", rf'<a href="{RUNBOOK_URL}#\2">\1</a>', out)
    return re.sub(r"\[([^\]]+)\]\((https?://[^)\s]+)\)", r'<a href="\2">\1</a>', out)


def markdown_html(md: str, headings: dict[str, str] | None = None) -> str:
    """The small Markdown subset runbooks use: paragraphs, lists, fenced code, sub-headings, inline code."""
    out: list[str] = []
    para: list[str] = []
    rows: list[list[str]] = []
    lst: str = ""
    code: list[str] | None = None

    def flush() -> None:
        nonlocal lst
        if para:
            out.append(f"<p>{inline(' '.join(para), headings)}</p>")
            para.clear()
        if lst:
            out.append(f"</{lst}>")
            lst = ""
        if rows:
            cells = [[inline(c, headings) for c in row] for row in rows]
            out.append(table(cells[0], cells[1:], raw=True))
            rows.clear()

    for line in md.splitlines():
        if code is not None:
            if line.lstrip().startswith("```"):
                out.append("<pre>" + html.escape("\n".join(code)) + "</pre>")
                code = None
            else:
                code.append(line)
            continue
        stripped = line.strip()
        item = re.match(r"^\s*(?:([-*+])|\d+[.)])\s+(.*)$", line)
        if stripped.startswith("```"):
            flush()
            code = []
        elif not stripped:
            flush()
        elif stripped.startswith("|"):
            if not rows:
                flush()
            cells = [c.strip() for c in stripped.strip("|").split("|")]
            if not all(re.fullmatch(r":?-{3,}:?", c) for c in cells):
                rows.append(cells)
        elif m := _HEADING.match(line):
            flush()
            out.append(f"<h4>{inline(m.group(2), headings)}</h4>")
        elif item:
            kind = "ul" if item.group(1) else "ol"
            if para or lst != kind:
                flush()
                out.append(f"<{kind}>")
                lst = kind
            out.append(f"<li>{inline(item.group(2), headings)}</li>")
        elif lst and line.startswith((" ", "\t")):
            out[-1] = out[-1][:-5] + " " + inline(stripped, headings) + "</li>"
        else:
            if lst:
                flush()
            para.append(stripped)
    if code is not None:
        out.append("<pre>" + html.escape("\n".join(code)) + "</pre>")
    flush()
    return "\n".join(out)

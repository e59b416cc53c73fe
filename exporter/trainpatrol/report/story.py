"""The page's reading of the incident: what happened, what to do next, and the DataLoader's audit."""

from __future__ import annotations

import json
import math
import time
from pathlib import Path
from typing import Any

from ..actions import STOP_EXIT_CODE
from ..loader_audit import ADVICE
from ._html import details, esc, note, num, table
from .bundle import Bundle, Incident, ranks_text
from .runbook import lookup

AUDIT_KEYS = ("loader_audit", "dataloader_audit")
"""Where a rank's extra.json (or config.json) carries ``asdict(LoaderAudit)``."""


def describe_source(inc: Incident) -> str:
    s = inc.source
    if inc.alertname:
        state = f" ({esc(inc.alert.get('status', 'firing'))})" if inc.alert else ""
        return f"Alertmanager alert <strong>{esc(inc.alertname)}</strong>{state}"
    if s.startswith("guard:"):
        return f"local guard <strong>{esc(inc.guard)}</strong> in the training process (no Prometheus involved)"
    known = {"api": "a request to the agent's HTTP API or the <code>trainpatrol</code> CLI",
             "pause_timeout": "the pause timeout: the run stayed paused longer than <code>pause_timeout_seconds</code>",
             "exception": "an exception raised in the training loop",
             "agreed with another rank": "not recorded: rank 0 only saw the action agreed with another rank",
             "": "not recorded in this bundle"}
    return known.get(s, f"<code>{esc(s)}</code>")


def happened(bundle: Bundle, inc: Incident) -> str:
    failed = [o for o in inc.outcomes if o[1] not in ("ok", "")]
    badge = ('<span class="badge bad">failed on ' + esc(ranks_text([o[0] for o in failed])) + "</span>"
             if failed else '<span class="badge ok">done on every rank</span>' if inc.outcomes else "")
    facts = [("Action", f"<strong>{esc(inc.action)}</strong> at step {esc(inc.step)} {badge}"),
             ("Run", esc(inc.run)), ("When", esc(inc.when)), ("Triggered by", describe_source(inc))]
    if inc.reason:
        facts.append(("Reason", esc(inc.reason)))
    manifest = bundle.manifest
    if "checkpoint" in manifest:
        ok = manifest.get("checkpoint_ok")
        state = '<span class="bad-text">failed</span>' if ok is False else "written"
        facts.append(("Checkpoint", f"{state}: <code>{esc(manifest.get('checkpoint') or '-')}</code>"))
    facts += _checkpoint_facts(manifest)
    world = manifest.get("world_size")
    facts.append(("Ranks in bundle", f"{len(bundle.ranks)}" + (f" of {esc(world)}" if world else "")))
    out = ['<dl class="facts">' + "".join(f"<dt>{k}</dt><dd>{v}</dd>" for k, v in facts) + "</dl>"]
    if manifest.get("finite") is False:
        names = ", ".join(manifest.get("nonfinite") or [])
        good = manifest.get("last_good_checkpoint") or ""
        out.append(note(f"The checkpoint written here holds {esc(manifest.get('nonfinite_count'))} non-finite "
                        f"tensors ({esc(names)}): do not resume from it. <code>patrol.restore(&quot;latest&quot;)"
                        f"</code> passes over it" + (f" and takes <code>{esc(good)}</code>." if good else
                                                     "; no finite checkpoint exists."), "bad"))
    if inc.cause_inferred:
        out.append(note(esc(inc.cause_inferred), "warn"))
    if inc.findings:
        rows = [(f.field.replace("_", " "), str(f.rank), f.label, _steps(f.steps)) for f in inc.findings]
        out.append("<h3>Non-finite values in the history</h3>" + table(("value", "rank", "first", "steps"), rows))
    out.append(_guard_trips_and_validation(bundle))
    if inc.alert:
        out.append(_alert(inc.alert))
    rows = [(str(r), o or "(not recorded)", d, c) for r, o, d, c in inc.outcomes]
    if rows:
        out.append("<h3>Outcome on each rank</h3>" + table(("rank", "outcome", "detail", "checkpoint"), rows))
    out.append(_versions(bundle))
    return "".join(out)


def _guard_trips_and_validation(bundle: Bundle) -> str:
    """Rank 0's latest guard trips and validation losses, the context the log alone held before."""
    if not bundle.ranks:
        return ""
    extra, out = bundle.ranks[0].extra, []
    trips = [t for t in extra.get("guard_trips") or [] if isinstance(t, dict)][-12:]
    if trips:
        rows = [(_clock(t.get("time")), str(t.get("guard", "")), str(t.get("detail", ""))) for t in trips]
        out.append(f"<h3>Guard trips (rank {bundle.ranks[0].rank}, latest {len(rows)})</h3>"
                   + table(("time (UTC)", "guard", "detail"), rows))
    vals = [v for v in extra.get("validation_history") or [] if isinstance(v, dict)][-12:]
    if vals:
        best = min(float(v.get("value", math.inf)) for v in vals)
        losses = [(str(v.get("step", "")), f"{float(v.get('value', math.nan)):.6g}"
                   + (" (best)" if v.get("value") == best else "")) for v in vals]
        out.append(f"<h3>Validation loss (rank {bundle.ranks[0].rank})</h3>"
                   + table(("step", "validation loss"), losses))
    return "".join(out)


def _clock(t: Any) -> str:
    return time.strftime("%H:%M:%S", time.gmtime(float(t))) if isinstance(t, int | float) else ""


def _checkpoint_facts(manifest: dict[str, Any]) -> list[tuple[str, str]]:
    facts = []
    if manifest.get("finite") is not None:
        facts.append(("Checkpoint state", "finite" if manifest["finite"] else
                      '<span class="bad-text">non-finite: do not resume from it</span>'))
    if isinstance(manifest.get("training_held_seconds"), int | float):
        held, before = float(manifest["training_held_seconds"]), manifest.get("training_held_seconds_total")
        how = "staged in host memory, written in the background" if manifest.get("background") else "written at once"
        facts.append(("Training held", f"{held:.3f} s by this checkpoint ({how})"
                      + (f"; {float(before):.1f} s by the checkpoints before it in this process"
                         if isinstance(before, int | float) else "")))
    if manifest.get("last_good_checkpoint"):
        facts.append(("Last good checkpoint", f"<code>{esc(manifest['last_good_checkpoint'])}</code> "
                      "(what <code>patrol.restore(&quot;latest&quot;)</code> takes)"))
    if manifest.get("best_checkpoint"):
        facts.append(("Best validation checkpoint", f"<code>{esc(manifest['best_checkpoint'])}</code> (validation "
                      f"loss {esc(manifest.get('best_validation_loss'))})"))
    return facts


def _if_it_persists(bundle: Bundle) -> str:
    acting = bundle.ranks[0].config.get("guard_actions") if bundle.ranks else None
    if not isinstance(acting, dict) or not acting:
        return "A resume re-arms the local guards; none of them acts in this run's configuration."
    listed = ", ".join(f"<code>{esc(g)}</code> → {esc(a)}" for g, a in acting.items())
    return ("A resume re-arms the local guards: if the fault persists, or comes back, they act again at its "
            f"next step ({listed}), so a run that is still sick pauses again rather than training on.")


def _steps(steps: list[int]) -> str:
    shown = ", ".join(str(s) for s in steps[:12])
    return shown + (f" … ({len(steps)} steps)" if len(steps) > 12 else "")


def _alert(alert: dict[str, Any]) -> str:
    labels: dict[str, Any] = alert["labels"] if isinstance(alert.get("labels"), dict) else {}
    notes: dict[str, Any] = alert["annotations"] if isinstance(alert.get("annotations"), dict) else {}
    rows = [(f"label {k}", str(v)) for k, v in sorted(labels.items())]
    rows += [(f"annotation {k}", str(v)) for k, v in sorted(notes.items())]
    rows += [(k, str(alert[k])) for k in ("startsAt", "fingerprint", "generatorURL") if alert.get(k)]
    return "<h3>The alert</h3>" + table(("field", "value"), rows)


def _versions(bundle: Bundle) -> str:
    if not bundle.ranks or not bundle.ranks[0].versions:
        return ""
    v = bundle.ranks[0].versions
    rows = [(k, " ".join(map(str, v[k])) if isinstance(v[k], list) else str(v[k])) for k in v]
    return details(f"Versions (rank {bundle.ranks[0].rank})", table(("component", "version"), rows))


def next_steps(bundle: Bundle, inc: Incident, runbooks: Path | None) -> str:
    advice = lookup(inc.runbook_keys, runbooks)
    out = [f'<h3>{esc(advice.title)}</h3><div class="runbook">{advice.body_html}</div>'
           f'<p class="muted">From {esc(advice.origin)}.</p>']
    run, ckpt = esc(inc.run), esc(bundle.manifest.get("checkpoint") or "")
    if inc.action == "pause":
        out.append(f"<p>Every rank was paused at step {esc(inc.step)} when this was written "
                   f"(<code>trainpatrol status {run}</code> shows the state now). Once the cause is understood: "
                   f"<code>trainpatrol resume {run}</code> to go on, or <code>trainpatrol stop {run}</code> to end "
                   f"the run (exit code {STOP_EXIT_CODE}, which orchestrators should not restart).</p>")
        out.append(f"<p>{_if_it_persists(bundle)}</p>")
    elif inc.action == "stop":
        out.append(f"<p>Every rank exited with code {STOP_EXIT_CODE}. To continue after a fix, start the job again "
                   f"and call <code>patrol.restore({'&quot;' + ckpt + '&quot;' if ckpt else '&quot;latest&quot;'})"
                   f"</code>.</p>")
    elif inc.action == "oom":
        out.append("<p>The process raised an out-of-memory error and re-raised it after writing this bundle.</p>")
    else:
        out.append(f"<p>A <code>{esc(inc.action)}</code> does not pause the run: it went on training.</p>")
    if ckpt and inc.action not in ("stop",):
        out.append(f"<p>The checkpoint of this step: <code>{ckpt}</code> "
                   f"(<code>patrol.restore(&quot;{ckpt}&quot;)</code>).</p>")
    out.append(f'<p class="muted">Regenerate this page: <code>trainpatrol report {esc(bundle.path)}</code></p>')
    return "".join(out)


def _audit(bundle: Bundle) -> tuple[dict[int, Any], list[int]]:
    """Each rank's audit (None where the key is present but empty) and the ranks that carry no key."""
    found: dict[int, Any] = {}
    missing = []
    for part in bundle.ranks:
        for source in (part.extra, part.config):
            key = next((k for k in AUDIT_KEYS if k in source), None)
            if key is not None:
                found[part.rank] = source[key]
                break
        else:
            missing.append(part.rank)
    return found, missing


def loader(bundle: Bundle) -> str:
    found, missing = _audit(bundle)
    out = []
    groups: dict[str, list[int]] = {}
    for rank, audit in found.items():
        groups.setdefault(json.dumps(audit, sort_keys=True, default=str), []).append(rank)
    for text, ranks in groups.items():
        out.append(f"<h3>{esc(ranks_text(ranks, capital=True))}</h3>" + _one_audit(json.loads(text)))
    if missing:
        out.append(note(f"This bundle carries no DataLoader audit for {esc(ranks_text(missing))} "
                        f"(looked for <code>{AUDIT_KEYS[0]}</code> in <code>rank-NNNNN/extra.json</code> and "
                        "<code>config.json</code>). What the history measured is below.", "warn"))
    out.append("<h3>Measured wait for batches</h3>" + _measured(bundle))
    return "".join(out)


def _one_audit(audit: Any) -> str:
    if not isinstance(audit, dict):
        return note("The batches did not come from a torch DataLoader, so its settings could not be audited.")
    info = audit.get("info") if isinstance(audit.get("info"), dict) else {}
    warnings = audit.get("warnings") or {}
    if isinstance(warnings, list):
        warnings = {str(w): "" for w in warnings}
    out = table(("setting", "value"), sorted((str(k), str(v)) for k, v in info.items())) if info else ""
    if warnings:
        rows = [(str(k), str(v or ADVICE.get(str(k), ""))) for k, v in sorted(warnings.items())]
        out += "<h4>Advice</h4>" + table(("check", "advice"), rows)
    else:
        out += note("The DataLoader's settings pass every check of the audit.")
    return out


def _measured(bundle: Bundle) -> str:
    rows = []
    for part in bundle.ranks:
        pairs = [(w, s) for w, s in zip(part.series("loader_wait_seconds"), part.series("step_seconds"), strict=True)
                 if w is not None and s is not None and math.isfinite(w) and math.isfinite(s) and s > 0]
        if not pairs:
            rows.append((str(part.rank), "-", "-", "-", "no step times in the history"))
            continue
        ratio = sum(w for w, _ in pairs) / sum(s for _, s in pairs)
        worst = max(w / s for w, s in pairs)
        slow = sum(1 for w, s in pairs if w / s > 0.5)
        verdict = ("input-bound: the GPU waits on data" if ratio > 0.2 else
                   "occasional stalls" if slow else "the pipeline keeps up")
        rows.append((str(part.rank), num(ratio, 3), num(worst, 3), f"{slow} of {len(pairs)}", verdict))
    return table(("rank", "wait ratio (whole history)", "worst step", "steps waiting > 50 %", "reading"), rows)

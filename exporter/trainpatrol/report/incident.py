"""What happened: the trigger (alert, guard or request), the action, its outcome on each rank, and the
non-finite steps in the history. When the trigger does not name its cause, the history is asked.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Any

from ._html import value_label
from .bundle import Bundle, RankPart

ALERT_FOR_GUARD = {
    "nonfinite_loss": "TrainPatrolNonFiniteLoss",
    "nonfinite_grad": "TrainPatrolNonFiniteGrad",
    "loss_spike": "TrainPatrolLossSpike",
    "loss_stagnation": "TrainPatrolLossStagnation",
    "grad_norm_explosion": "TrainPatrolGradNormExplosion",
    "memory_fragmentation": "TrainPatrolMemoryFragmentationHigh",
    "oom_risk": "TrainPatrolOOMRisk",
}
"""Each local guard and the shipped alert that watches the same condition (its runbook section)."""
OOM_ALERT = "TrainPatrolOOMRisk"
"""The alert whose runbook section covers an OOM that happened (its Next says what the forensics hold)."""

_UNNAMED_SOURCES = ("", "agreed with another rank")
# Memory fields are NaN on steps where the allocator was not sampled, so only an Inf there is a fault.
_NAN_IS_FAULT = {"loss": True, "grad_norm": True}


@dataclass
class Finding:
    """A history field that held non-finite values on one rank."""

    field: str
    rank: int
    steps: list[int]
    first_value: float

    @property
    def label(self) -> str:
        return value_label(self.first_value)


@dataclass
class Incident:
    action: str
    step: int | None
    run: str
    when: str
    source: str
    reason: str
    alert: dict[str, Any] | None
    alertname: str
    guard: str
    cause_inferred: str
    """Set when the trigger did not name a cause and one was read from the history."""
    outcomes: list[tuple[int, str, str, str]] = field(default_factory=list)
    """(rank, outcome, detail, checkpoint) from each rank's extra.json."""
    findings: list[Finding] = field(default_factory=list)

    @property
    def runbook_keys(self) -> list[str]:
        """Section names to look for in the runbooks, best first."""
        guard = self.guard or next((g for g, a in ALERT_FOR_GUARD.items() if a == self.alertname), "")
        oom = [OOM_ALERT, "oom"] if self.action == "oom" else []
        keys = [self.alertname, ALERT_FOR_GUARD.get(guard, ""), guard, *oom]
        return list(dict.fromkeys(k for k in keys if k))


def nonfinite_findings(part: RankPart) -> list[Finding]:
    out = []
    for name in ("loss", "grad_norm", "allocated_bytes", "reserved_bytes", "fragmentation_ratio"):
        values = [v for v in part.series(name) if v is not None]
        if name == "grad_norm" and values and all(math.isnan(v) for v in values):
            continue  # never computed on this rank (no parameters, no norm passed): not a fault
        bad = [(s, v) for s, v in part.nonfinite_steps(name) if _NAN_IS_FAULT.get(name) or math.isinf(v)]
        if bad:
            out.append(Finding(name, part.rank, [s for s, _ in bad], bad[0][1]))
    return out


def _trigger(bundle: Bundle) -> dict[str, Any]:
    """trigger.json, or a rank's own record of it where rank 0 only heard the agreed word."""
    own = [r.extra["trigger"] for r in bundle.ranks if isinstance(r.extra.get("trigger"), dict)]
    for c in [bundle.trigger, *own]:
        if c.get("alert") or str(c.get("source") or "") not in _UNNAMED_SOURCES:
            return dict(c)
    return bundle.trigger


def _when(bundle: Bundle) -> str:
    t = bundle.manifest.get("time")
    if not isinstance(t, int | float):
        return bundle.path.name.split("-step")[0]
    return time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(t))


def read_incident(bundle: Bundle) -> Incident:
    trig = _trigger(bundle)
    alert = trig.get("alert") if isinstance(trig.get("alert"), dict) else None
    source = str(trig.get("source") or "")
    labels = alert.get("labels", {}) if alert else {}
    alertname = str(labels.get("alertname", "")) if isinstance(labels, dict) else ""
    if not alertname and source.startswith("alertmanager:"):
        alertname = source.split(":", 1)[1]
    guard = source.split(":", 1)[1] if source.startswith("guard:") else ""
    inc = Incident(action=bundle.action, step=bundle.step, run=bundle.run, when=_when(bundle), source=source,
                   reason=str(trig.get("reason") or trig.get("error") or ""), alert=alert, alertname=alertname,
                   guard=guard, cause_inferred="")
    for part in bundle.ranks:
        e = part.extra
        outcome = str(e.get("outcome") or ("failed" if e.get("error") else ""))
        inc.outcomes.append((part.rank, outcome, str(e.get("detail") or e.get("error") or ""),
                             str(e.get("checkpoint") or "")))
        inc.findings.extend(nonfinite_findings(part))
    if not alertname and not guard and source in _UNNAMED_SOURCES:
        inc.cause_inferred = _infer(inc)
    return inc


def _infer(inc: Incident) -> str:
    for name, guard in (("loss", "nonfinite_loss"), ("grad_norm", "nonfinite_grad")):
        hits = [f for f in inc.findings if f.field == name]
        if hits:
            first = min(hits, key=lambda f: f.steps[0])
            inc.guard = guard
            return (f"The trigger does not name its cause; the history shows a {first.label} {name.replace('_', ' ')} "
                    f"at step {first.steps[0]} on rank {first.rank}, which the {guard} guard acts on.")
    return ""

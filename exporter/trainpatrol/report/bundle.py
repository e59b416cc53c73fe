"""Reads an evidence bundle into plain values, and the incident it records: the trigger (alert, guard or
request), the action, its outcome on each rank, and the non-finite steps in the history (asked for the cause
when the trigger does not name one). A missing or unreadable file becomes a note, never an error: a
half-written bundle from a dying job is exactly the one someone needs to read.
"""

from __future__ import annotations

import json
import math
import re
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ._html import value_label

MAX_TEXT_CHARS = 200_000
"""Text files shown in the page are cut here; the bundle keeps the whole file."""

_RANK_DIR = re.compile(r"^rank-(\d+)$")


def to_float(value: Any) -> float | None:
    """A history value as a float; "nan"/"inf"/"-inf" strings (how history.json stores them) become
    the non-finite floats they name, and anything that is not a number becomes None (missing)."""
    if isinstance(value, bool) or not isinstance(value, int | float | str):
        return None
    try:
        return float(value)
    except ValueError:
        return None


@dataclass
class RankPart:
    """One rank's directory of the bundle."""

    rank: int
    path: Path
    history: list[dict[str, float | None]] = field(default_factory=list)
    extra: dict[str, Any] = field(default_factory=dict)
    config: dict[str, Any] = field(default_factory=dict)
    versions: dict[str, Any] = field(default_factory=dict)
    nvml: Any = None
    memory_stats: dict[str, Any] = field(default_factory=dict)
    memory_summary: str = ""
    stacks: str = ""
    has_snapshot: bool = False

    @property
    def memory_reader(self) -> str:
        """The ``PatrolConfig.memory_reader`` the rank ran with, "" for the default (torch's CUDA allocator)."""
        reader = str(self.config.get("memory_reader") or "")
        if reader in ("", "None"):
            return ""
        # a repr without its own __repr__ names the class and an address that means nothing later
        return re.sub(r"^<(?:[\w.]+\.)?(\w+) object at 0x[0-9a-f]+>$", r"\1", reader)

    @property
    def simulated_memory(self) -> bool:
        """The history's memory values came from a custom reader on a rank without a CUDA allocator."""
        no_cuda = "no CUDA caching allocator" in self.memory_summary or self.versions.get("cuda", "") is None
        return bool(self.memory_reader) and no_cuda

    @property
    def steps(self) -> list[int]:
        return [int(r["step"] or 0) for r in self.history]

    def series(self, name: str) -> list[float | None]:
        """The values of one history field, step by step (None where the record lacks it)."""
        return [r.get(name) for r in self.history]

    def nonfinite_steps(self, name: str) -> list[tuple[int, float]]:
        return [(int(r["step"] or 0), v) for r in self.history
                if (v := r.get(name)) is not None and not math.isfinite(v)]


@dataclass
class Bundle:
    path: Path
    manifest: dict[str, Any] = field(default_factory=dict)
    trigger: dict[str, Any] = field(default_factory=dict)
    ranks: list[RankPart] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    """What could not be read, in words, shown at the top of the page."""

    @property
    def action(self) -> str:
        m = re.search(r"-step\d+-(\w+)$", self.path.name)  # the bundle's name, where the manifest is lost
        return str(self.manifest.get("action") or (m.group(1) if m else "") or "unknown action")

    @property
    def step(self) -> int | None:
        value = self.manifest.get("step")
        if isinstance(value, int):
            return value
        m = re.search(r"-step(\d+)-", self.path.name)
        return int(m.group(1)) if m else None

    @property
    def run(self) -> str:
        value = self.manifest.get("run") or next((r.config.get("run") for r in self.ranks if r.config.get("run")), "")
        return str(value or "?")

    def files(self) -> list[str]:
        return sorted(str(p.relative_to(self.path)) for p in self.path.rglob("*") if p.is_file())


def _read_json(path: Path, notes: list[str], *, required: bool = True) -> Any:
    if not path.exists():
        if required:
            notes.append(f"{path.parent.name}/{path.name} is missing.")
        return None
    try:
        return json.loads(path.read_text(errors="replace"))
    except (OSError, ValueError) as exc:
        notes.append(f"{path.parent.name}/{path.name} could not be read: {exc}.")
        return None


def _read_text(path: Path, notes: list[str], *, required: bool = True) -> str:
    if not path.exists():
        if required:
            notes.append(f"{path.parent.name}/{path.name} is missing.")
        return ""
    try:
        with path.open(errors="replace") as f:
            text = f.read(MAX_TEXT_CHARS + 1)
    except OSError as exc:
        notes.append(f"{path.parent.name}/{path.name} could not be read: {exc}.")
        return ""
    if len(text) > MAX_TEXT_CHARS:
        text = text[:MAX_TEXT_CHARS] + f"\n[cut at {MAX_TEXT_CHARS} characters here; the file in the bundle is whole]\n"
    return text


def _dict(value: Any) -> dict[str, Any]:
    return value if isinstance(value, dict) else {}


def _history(raw: Any, where: str, notes: list[str]) -> list[dict[str, float | None]]:
    if raw is None:
        return []
    if not isinstance(raw, list):
        notes.append(f"{where}/history.json is not a list of step records.")
        return []
    out = [{str(k): to_float(v) for k, v in rec.items()} for rec in raw
           if isinstance(rec, dict) and to_float(rec.get("step")) is not None]
    return sorted(out, key=lambda r: r["step"] or 0)


def read_rank(path: Path, rank: int, notes: list[str]) -> RankPart:
    where = path.name
    part = RankPart(rank=rank, path=path)
    part.history = _history(_read_json(path / "history.json", notes), where, notes)
    part.extra = _dict(_read_json(path / "extra.json", notes, required=False))
    part.config = _dict(_read_json(path / "config.json", notes))
    part.versions = _dict(_read_json(path / "versions.json", notes))
    part.nvml = _read_json(path / "nvml.json", notes)
    part.memory_stats = _dict(_read_json(path / "memory_stats.json", notes, required=False))
    part.memory_summary = _read_text(path / "memory_summary.txt", notes)
    part.stacks = _read_text(path / "stacks.txt", notes)
    part.has_snapshot = (path / "memory_snapshot.pickle").exists()
    return part


class NotABundle(ValueError):
    """The directory holds none of a bundle's own files: a page for it would describe nothing."""


def load(path: Path) -> Bundle:
    """Read the bundle at ``path``; raises only when ``path`` is not a directory or holds no part of a
    bundle at all (a bundle missing some files is read, with notes)."""
    if not path.is_dir():
        raise FileNotFoundError(f"Evidence bundle {str(path)!r} is not a directory.")
    if not any((path / name).exists() for name in ("manifest.json", "trigger.json")) and \
            not any(_RANK_DIR.match(child.name) and child.is_dir() for child in path.iterdir()):
        raise NotABundle(f"{path} is not an evidence bundle (no manifest.json, trigger.json or rank-NNNNN directory)")
    bundle = Bundle(path=path)
    notes = bundle.notes
    bundle.manifest = _dict(_read_json(path / "manifest.json", notes))
    bundle.trigger = _dict(_read_json(path / "trigger.json", notes))
    for child in sorted(path.iterdir()):
        m = _RANK_DIR.match(child.name)
        if m and child.is_dir():
            bundle.ranks.append(read_rank(child, int(m.group(1)), notes))
    bundle.ranks.sort(key=lambda r: r.rank)
    world = bundle.manifest.get("world_size")
    if isinstance(world, int) and world > 0:
        missing = sorted(set(range(world)) - {r.rank for r in bundle.ranks})
        if missing:
            notes.append(f"{len(missing)} of {world} ranks wrote no part: {ranks_text(missing)}.")
    if not bundle.ranks:
        notes.append("The bundle holds no rank-NNNNN directory.")
    return bundle


def spans(values: list[int]) -> list[tuple[int, int]]:
    """Consecutive values merged: [3, 4, 5, 9] -> [(3, 5), (9, 9)]."""
    out: list[tuple[int, int]] = []
    for v in sorted(set(values)):
        if out and v == out[-1][1] + 1:
            out[-1] = (out[-1][0], v)
        else:
            out.append((v, v))
    return out


def compact_ranks(ranks: list[int]) -> str:
    """``[0, 1, 2, 5, 7, 8]`` -> ``"0-2, 5, 7, 8"``: runs of three or more become a range."""
    return ", ".join(f"{lo}-{hi}" if hi - lo > 1 else ", ".join(map(str, range(lo, hi + 1))) for lo, hi in spans(ranks))


def ranks_text(ranks: list[int], capital: bool = False) -> str:
    """``"rank 0"``, ``"ranks 0, 1"``, ``"ranks 0-7"``: the noun agrees with the count."""
    noun = "Rank" if capital else "rank"
    return f"{noun}{'s' if len(set(ranks)) > 1 else ''} {compact_ranks(ranks)}"

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

"""Hang forensics: a rank whose training thread has not reached a step boundary for long is captured from the
publisher's thread (the training thread is the one that hangs), with the phase it is stuck in.

The phase is read from the training thread's stack, so finding it costs the training loop nothing: waiting for
data (the DataLoader), forward (the model, or the user's code), backward (under DDP also the wait in the gradient
all-reduce for the slowest peer), optimizer, a collective the user called, or Patrol's own step boundary
(its control-word exchange waits for the other ranks). In a hung lock-step job every rank stalls; the ranks
that wait for a peer stall in the same phase, and the rank that is not where the others are is the one to look
at. Each stalled rank writes its part of ``<evidence_dir>/stall-step<step>/`` (all-thread stacks, phase, step,
seconds since its last step); rank 0 then waits a little for the others' parts (a shared evidence directory)
and writes ``stall.json``, which names the odd ranks, and the bundle's report.
"""

from __future__ import annotations

import json
import logging
import math
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from types import FrameType
from typing import Any

from ..control.commands import CommandBook, RunRecord
from ..control.evidence import EvidenceWriter
from ..control.executor import InAction
from .collective_trace import behind_ranks, collective_trace
from .step_recorder import StepRecorder

log = logging.getLogger("trainpatrol")

PHASES = ("", "data", "forward", "backward", "optimizer", "collective", "boundary", "checkpoint", "evidence",
          "agreement")
"""``trainpatrol_rank_stalled_phase``: 0 while the rank steps, else the index of the phase it is stuck in."""

_MARKERS = (  # (phase, a path fragment of a frame's file, or the name of its function), first match wins
    ("boundary", "trainpatrol/probe/control_loop.py"), ("boundary", "trainpatrol/control/"),
    ("data", "torch/utils/data/"), ("data", "trainpatrol/probe/loader.py"),
    ("optimizer", "torch/optim/"),
    ("collective", "torch/nn/parallel/distributed.py"), ("collective", "torch/distributed/"),
    ("backward", "torch/autograd/"), ("backward", "torch/_tensor.py:backward"),
)
_ACTION_MARKERS = (
    ("agreement", "trainpatrol/control/coordinator.py:all_true"),
    ("evidence", "trainpatrol/control/evidence.py"), ("evidence", "trainpatrol/report/"),
    ("checkpoint", "trainpatrol/control/checkpoint.py"), ("checkpoint", "trainpatrol/control/sharded.py"),
    ("checkpoint", "trainpatrol/control/state_file.py"), ("checkpoint", "torch/distributed/checkpoint/"),
    ("checkpoint", "trainpatrol/control/executor.py:_checkpoint"),
    ("checkpoint", "trainpatrol/control/executor.py:wait_for_write"),
)
ACTION_CHECKPOINT_MULTIPLE = 4.0
"""An action counts as stalled past this many times the last checkpoint's write, if longer than the config's."""


def phase_of(frame: FrameType | None, *, in_action: bool = False) -> str:
    """The phase a thread is in, from its stack (``frame``: its innermost frame); ``in_action``: the part of an
    action it is in ("boundary" for none of them)."""
    places = []
    while frame is not None:
        code = frame.f_code
        places.append(f"{code.co_filename.replace(chr(92), '/')}:{code.co_name}")
        frame = frame.f_back
    for phase, marker in _ACTION_MARKERS if in_action else _MARKERS:
        if any(marker in place for place in places):
            return phase
    return "boundary" if in_action else "forward"


def odd_ranks(phases: dict[int, str]) -> list[int]:
    """The ranks not in the phase most ranks are stuck in (none when all agree or only one rank answered)."""
    if len(phases) < 2:
        return []
    common, count = Counter(phases.values()).most_common(1)[0]
    if count == len(phases):
        return []
    return sorted(r for r, p in phases.items() if p != common)


class StallWatch:
    def __init__(self, recorder: StepRecorder, record: RunRecord, commands: CommandBook, evidence: EvidenceWriter,
                 evidence_dir: str, rank: int, world_size: int, *, multiple: float, floor_seconds: float,
                 action_floor_seconds: float, acting: Callable[[], bool],
                 in_action: Callable[[], InAction | None]) -> None:
        """``acting``: whether the training thread is away from the loop for the control loop (acting, or paused);
        ``in_action``: the action it carries out now, if any."""
        self._recorder, self._record, self._evidence = recorder, record, evidence
        self._acting, self._in_action = acting, in_action
        self._commands = commands
        self._dir, self._rank, self._world = Path(evidence_dir), rank, world_size
        self._multiple, self._floor, self._action_floor = multiple, floor_seconds, action_floor_seconds
        self._captured = ""
        """The bundle of the last stall captured: one capture a stall."""

    def threshold(self) -> float:
        """Seconds without a step boundary after which the rank counts as stalled."""
        history = self._recorder.history
        recent = history.median("step_seconds", 20) if history.records else 0.0
        return max(self._floor, self._multiple * recent)

    def action_threshold(self) -> float:
        """Seconds an action may hold the training thread before the rank counts as stalled in it."""
        last_write = self._record.last_checkpoint_write_seconds  # NaN before the first
        return max(self._action_floor, ACTION_CHECKPOINT_MULTIPLE * last_write if math.isfinite(last_write) else 0.0)

    def check(self) -> int:
        """The phase code to export (0: not stalled); the first check past the threshold captures the rank."""
        recorder = self._recorder
        action = self._in_action()
        action_name = action.action if action is not None else ""
        if action is not None:
            step, since, threshold = action.step, time.perf_counter() - action.began, self.action_threshold()
            reason = f"{action_name} at step {step} held the training thread for {threshold:.0f} s"
        else:
            step = recorder.totals.steps
            if self._record.state != "running" or step == 0 or self._acting():
                return 0
            since, threshold = time.perf_counter() - recorder.last_step_end, self.threshold()
            reason = f"no step boundary for {threshold:.0f} s"
        if since < threshold:
            return 0
        phase = phase_of(sys._current_frames().get(recorder.owner), in_action=action is not None)
        bundle = self._dir / (f"stall-step{step:08d}" + (f"-{action_name}" if action_name else ""))
        if self._captured != bundle.name:
            self._captured = bundle.name
            self._capture(bundle, step, phase, since, threshold, {"source": "stall", "reason": reason}, action_name)
        asked = self._commands.pending().get("capture")
        if asked is not None:
            self._carry_out(asked, bundle, step, phase, since, threshold, action_name)
        return PHASES.index(phase)

    def _carry_out(self, command: dict[str, Any], stall: Path, step: int, phase: str, since: float, threshold: float,
                   action: str) -> None:
        """A capture asked for while the training thread is stuck would wait for a boundary it does not reach: it is
        written from here, as the stall's own is, and reported done."""
        cid = int(command["id"])
        bundle = stall.with_name(f"{stall.name}-capture{cid}")
        trigger = {"source": command.get("source") or "agent", "reason": command.get("reason", ""),
                   "command_id": cid, **({"alert": command["alert"]} if command.get("alert") else {})}
        written = self._capture(bundle, step, phase, since, threshold, trigger, action)
        self._commands.mark_done([cid])
        self._record.action(cid, "capture", "ok" if written else "failed", step,
                            f"written while the training thread is stuck in {phase}",
                            evidence=str(bundle) if written else "")

    def _capture(self, bundle: Path, step: int, phase: str, since: float, threshold: float,
                 trigger: dict[str, Any], action: str) -> bool:
        """``since``: seconds since the last step boundary, or since ``action`` (if any) began."""
        facts = {"rank": self._rank, "step": step, "phase": phase, "seconds_since_step": round(since, 3),
                 "threshold_seconds": round(threshold, 3), "time": time.time(),
                 "collectives": collective_trace(), **({"action": action} if action else {})}
        log.error("trainpatrol: rank %d stalled at step %d for %.0f s, in %s; stacks in %s", self._rank, step,
                  since, f"the {phase} of its {action}" if action else phase, bundle)
        try:
            self._evidence.part(bundle, {"stall": facts},
                                nvml={"available": False, "reason": "not fetched for a stall capture"})
        except OSError as exc:
            log.warning("trainpatrol: stall evidence not written: %s", exc)
            return False
        self._record.last_evidence = str(bundle)
        if self._rank == 0:
            threading.Thread(target=self._name_the_odd_ranks, args=(bundle, step, threshold, trigger, action),
                             name="trainpatrol-stall-index", daemon=True).start()
        return True

    def _name_the_odd_ranks(self, bundle: Path, step: int, threshold: float, trigger: dict[str, Any],
                            action: str) -> None:
        """On rank 0: the ranks' parts side by side (waiting 5 s, or a quarter of the threshold, for them), the odd
        ranks named in ``stall.json``, then the bundle's manifest and report."""
        deadline = time.monotonic() + min(30.0, max(5.0, threshold / 4))
        parts: dict[int, dict[str, Any]] = {}
        while True:
            parts = _stall_parts(bundle)
            if len(parts) >= self._world or time.monotonic() > deadline:
                break
            time.sleep(0.5)
        phases = {r: str(p["phase"]) for r, p in parts.items()}
        traces = {r: p["collectives"] for r, p in parts.items() if (p.get("collectives") or {}).get("available")}
        odd, behind = odd_ranks(phases), behind_ranks(traces)
        summary = {"step": step, **({"action": action} if action else {}), "world_size": self._world,
                   "phases": {str(r): p for r, p in sorted(phases.items())},
                   "odd_ranks": odd, "behind_ranks": behind,
                   "last_collectives": {str(r): t["last"] for r, t in sorted(traces.items())},
                   "no_part": sorted(set(range(self._world)) - set(phases))}
        (bundle / "stall.json").write_text(json.dumps(summary, indent=2))
        named = [f"rank(s) {odd} not where the others are"] if odd else [f"ranks in {sorted(set(phases.values()))}"]
        if behind:
            named.append(f"rank(s) {behind} behind in their collectives")
        log.error("trainpatrol: stall at step %d%s: %s", step, f" in its {action}" if action else "", "; ".join(named))
        self._evidence.index(bundle, {"action": "capture", "step": step, "rank": 0, "stall": summary}, trigger)


def _stall_parts(bundle: Path) -> dict[int, dict[str, Any]]:
    """Each rank's stall facts written into ``bundle`` so far."""
    out = {}
    for part in bundle.glob("rank-*/extra.json"):
        try:
            stall: dict[str, Any] = json.loads(part.read_text()).get("stall", {})
        except (OSError, ValueError):
            continue
        if "phase" in stall:
            out[int(stall["rank"])] = stall
    return out

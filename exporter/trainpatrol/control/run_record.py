"""What the executor records: the run's state, its recent actions and their counts, the last checkpoint
and evidence. The rank's pushes read it."""

from __future__ import annotations

import logging
import math
import time
from collections import deque

from ..protocol import ActionRecord

log = logging.getLogger("trainpatrol")


class RunRecord:
    def __init__(self) -> None:
        self.state = "running"
        self.actions: deque[ActionRecord] = deque(maxlen=32)
        self.action_counts: dict[tuple[str, str], float] = {}
        self.checkpoint_failures = 0.0
        self.last_checkpoint = ""
        self.last_checkpoint_time = math.nan
        self.last_checkpoint_step = math.nan
        self.checkpoint_blocked_seconds = 0.0
        """Training time spent waiting for checkpoints (a background write's staging, a pause's or stop's whole
        write)."""
        self.last_checkpoint_write_seconds = math.nan
        """From the start of the last successful checkpoint until it was durable."""
        self.last_evidence = ""

    def action(self, cid: int, action: str, outcome: str, step: int, detail: str = "", path: str = "",
               evidence: str = "") -> None:
        self.actions.append(ActionRecord(id=cid, action=action, outcome=outcome, step=step,  # type: ignore[arg-type]
                                         time=time.time(), detail=detail, checkpoint=path, evidence=evidence))
        key = (action, outcome)
        self.action_counts[key] = self.action_counts.get(key, 0) + 1
        log.warning("trainpatrol: %s at step %d: %s %s", action, step, outcome, detail)

    def checkpointed(self, path: str, step: int) -> None:
        self.last_checkpoint = path
        self.last_checkpoint_time, self.last_checkpoint_step = time.time(), float(step)

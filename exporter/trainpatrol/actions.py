"""Control actions, their wire codes and priorities, and the documented exit code of ``stop``."""

from __future__ import annotations

from typing import Literal

Action = Literal["checkpoint", "pause", "resume", "stop", "empty_cache", "capture"]
ACTIONS: tuple[Action, ...] = ("checkpoint", "pause", "resume", "stop", "empty_cache", "capture")

# When several actions are agreed at the same boundary, empty_cache runs first (nothing else does
# its job), then the strongest of the rest; the weaker ones it implies (a stop or pause also
# checkpoints and captures, a checkpoint also captures) are recorded as skipped, covered by it.
PRIORITY: dict[str, int] = {"stop": 5, "pause": 4, "checkpoint": 3, "capture": 2, "empty_cache": 1, "resume": 0}

STOP_EXIT_CODE = 86
"""Exit code of every rank after ``stop``. Orchestrators should treat it as final, not restart
(Kubernetes: a Job ``podFailurePolicy`` rule with ``action: FailJob`` on exit code 86)."""

RUN_STATES = ("running", "pausing", "paused", "stopping", "stopped", "closed")

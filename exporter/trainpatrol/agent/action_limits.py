"""A bounded number of commands of an action per run and minute (AgentConfig.action_rate_limits)."""

from __future__ import annotations

from collections import deque

from .run_keys import RunId

WINDOW_SECONDS = 60.0


class ActionLimits:
    """Not thread-safe: RankStore calls it under its lock."""

    def __init__(self, limits: dict[str, int]) -> None:
        self.limits = dict(limits)
        self._times: dict[tuple[RunId, str], deque[float]] = {}

    def take(self, run: RunId, action: str, now: float) -> bool:
        """Counts one command of ``action`` for ``run`` at ``now`` unless the window is full."""
        limit = self.limits.get(action)
        if limit is None:
            return True
        times = self._times.setdefault((run, action), deque())
        while times and now - times[0] >= WINDOW_SECONDS:
            times.popleft()
        if len(times) >= limit:
            return False
        times.append(now)
        return True

    def expire(self, now: float) -> None:
        for key, times in list(self._times.items()):
            if not times or now - times[-1] >= WINDOW_SECONDS:
                del self._times[key]

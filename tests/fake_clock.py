"""A clock that tests move by hand, for TTLs and timestamps the agent reads from ``time.time``."""

from __future__ import annotations

T0 = 1_700_000_000.25


class Clock:
    def __init__(self, now: float = T0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now

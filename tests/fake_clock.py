"""A clock that tests move by hand, for TTLs and timestamps the agent reads from ``time.time``, and for
the step clock Patrol reads from ``time.perf_counter``."""

from __future__ import annotations

import time

import pytest

T0 = 1_700_000_000.25


class Clock:
    def __init__(self, now: float = T0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def script_perf_counter(monkeypatch: pytest.MonkeyPatch) -> Clock:
    """``time.perf_counter``, which Patrol times steps, waits and its own work with, as a clock that only
    the test moves, from 0: the durations a test scripts are then the exact durations Patrol measures."""
    clock = Clock(0.0)
    monkeypatch.setattr(time, "perf_counter", clock)
    return clock

"""How much of Patrol's host time a GPU run pays for.

A step's host work (Patrol's included) costs the run time only while the GPU waits for it. When the host runs
ahead of the device, as a GPU-bound loop without a per-step sync does, it hides behind queued kernels and the
step takes as long without Patrol. So at every read-back (about every ``readback_lag_seconds``) the event that
ends it is queried once more at the next step: done, the device had caught up within one step and the host's
time was on the critical path; not done, the device was more than a step behind. The share of recent samples
that found it done scales Patrol's host time in ``trainpatrol_probe_overhead_ratio``. Never a sync: the event
is only queried.
"""

from __future__ import annotations

from collections import deque
from typing import Any

SAMPLES = 32
"""Read-backs the share is taken over (about 3 s at the default lag)."""


class Exposure:
    def __init__(self) -> None:
        self._samples: deque[bool] = deque(maxlen=SAMPLES)
        self._event: Any = None

    def watch(self, event: Any) -> None:
        """The event that ends the read-back just queued; ``sample`` queries it at the next step."""
        self._event = event

    def sample(self) -> None:
        event, self._event = self._event, None
        if event is not None:
            self._samples.append(bool(event.query()))

    @property
    def share(self) -> float:
        """The share of samples whose device had caught up (1 until the first sample)."""
        return sum(self._samples) / len(self._samples) if self._samples else 1.0

"""How much of Patrol's host time a GPU run pays for.

A step's host work (Patrol's included) costs the run time only while the GPU waits for it. When the host runs
ahead of the device, as a GPU-bound loop without a per-step sync does, it hides behind queued kernels and the
step takes as long without Patrol. So at every read-back (about every ``readback_lag_seconds``) the next step is
sampled: an event is recorded when Patrol's work in ``step()`` begins, behind all the host has queued so far, and
queried when that work ends. Done, the device had run out of queued work while Patrol ran, and Patrol's time was
on the critical path; not done, the device was still busy with earlier work, and Patrol's time cost nothing. The
share of recent samples that found it done scales Patrol's host time in ``trainpatrol_probe_overhead_ratio``.

Asking whether the device caught up within a step instead is wrong where the host's lead is capped by the driver's
launch queue (about a thousand kernels): a large model's host blocks in a launch, the device is never a whole step
behind, and yet every microsecond Patrol adds is hidden. Never a sync: the event is only queried.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from typing import Any

SAMPLES = 32
"""Sampled steps the share is taken over (about 3 s at the default lag)."""


class Exposure:
    def __init__(self, new_event: Callable[[], Any]) -> None:
        """``new_event``: makes the reusable device event (``torch.cuda.Event``), once, when the first sample is due."""
        self._new_event = new_event
        self._event: Any = None
        self._samples: deque[bool] = deque(maxlen=SAMPLES)
        self._due = False
        self._open = False

    def due(self) -> None:
        """Sample the next step (called at each read-back, so sampling keeps its pace)."""
        self._due = True

    def begin(self) -> None:
        """Where Patrol's work in a step begins: when a sample is due, record the event behind the queued work."""
        if self._due:
            self._due = False
            if self._event is None:
                self._event = self._new_event()
            self._event.record()
            self._open = True

    def end(self) -> None:
        """Where Patrol's work in the step ends: whether the device finished the queued work in the meantime."""
        if self._open:
            self._open = False
            self._samples.append(bool(self._event.query()))

    @property
    def share(self) -> float:
        """The share of sampled steps whose device ran out of work while Patrol ran (1 until the first sample)."""
        return sum(self._samples) / len(self._samples) if self._samples else 1.0

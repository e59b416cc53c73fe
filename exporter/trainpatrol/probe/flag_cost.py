"""What torch spends on the host when a fused optimizer is handed Patrol's non-finite flag.

Handed ``found_inf``, a fused torch optimizer moves the flag to each device and subtracts it from every step count
after its update: one ``_foreach_sub_`` per device and dtype, inside ``optimizer.step()``, outside Patrol's code.
The job pays that for the skip on every step, so the self-report counts it. It is timed where torch's own call
runs, in the loop after a forward and backward (timed warm, back to back, it reads about half: docs/benchmarks.md):
from the optimizer's pre-hook, on stand-ins of the same count and device, one call about once a second. The
estimate is the median of the recent samples, so it follows the host as it speeds up or slows down.
"""

from __future__ import annotations

import logging
import math
import statistics
import time
from collections import deque
from collections.abc import Callable

import torch

log = logging.getLogger("trainpatrol")
SAMPLE_SECONDS = 1.0
SAMPLES = 15


class FlagCost:
    def __init__(self, interval: float = SAMPLE_SECONDS) -> None:
        self.interval = interval
        self.seconds = 0.0
        """The estimate: host seconds torch spends on the flag each step."""
        self._stand_ins: list[tuple[torch.device, list[torch.Tensor]]] | None = None
        self._flag: torch.Tensor | None = None
        self._samples: deque[float] = deque(maxlen=SAMPLES)
        self._next_at = 0.0

    def sample(self, params: Callable[[], list[torch.Tensor]], now: float) -> float:
        """The estimate, after timing the subtraction once when ``interval`` has passed since the last sample.
        ``params``: the optimizer's, read at the first sample (torch steps only those that have a gradient)."""
        if now < self._next_at:
            return self.seconds
        self._next_at = now + self.interval
        try:
            if self._stand_ins is None:
                self._stand_ins = self._build(params())
            took = self._time_once()
        except RuntimeError as exc:  # a device without the op: the self-report leaves it out, the step goes on
            log.debug("trainpatrol: could not time the fused step's flag: %s", exc)
            self._next_at = math.inf
            return self.seconds
        self._samples.append(took)
        self.seconds = statistics.median(self._samples)
        return self.seconds

    def _build(self, params: list[torch.Tensor]) -> list[tuple[torch.device, list[torch.Tensor]]]:
        counts: dict[tuple[torch.device, torch.dtype], int] = {}
        for p in params:
            if p.grad is not None:
                counts[p.device, p.dtype] = counts.get((p.device, p.dtype), 0) + 1
        # separate tensors, as the step counts are: over views of one tensor the subtraction takes longer
        stand_ins = [(device, [torch.zeros((), device=device) for _ in range(n)]) for (device, _), n in counts.items()]
        flag = self._flag = torch.zeros((), device=stand_ins[0][0] if stand_ins else "cpu")
        for device, steps in stand_ins:  # once untimed: the first call sets the op up
            torch._foreach_sub_(steps, [flag.to(device)] * len(steps))
        return stand_ins

    def _time_once(self) -> float:
        """As torch does it: the flag to each device, then one subtraction over that device's step counts."""
        flag = self._flag
        assert flag is not None and self._stand_ins is not None
        start = time.perf_counter()
        for device, steps in self._stand_ins:
            on_device = flag.to(device, non_blocking=True)
            torch._foreach_sub_(steps, [on_device] * len(steps))
        return time.perf_counter() - start

"""Gets small device tensors to the host one step later, without a host-device sync.

On CUDA each submitted vector is copied non-blocking into a pinned host buffer and an event is
recorded; ``poll`` returns only the vectors whose event has completed (``Event.query`` never
blocks). On CPU the values are available at once.
"""

from __future__ import annotations

import logging
from collections import deque

import torch

from . import device_values as dv

log = logging.getLogger("trainpatrol")
RING = 8
Tag = tuple[int, int]
"""(first step, rows) of a read-back."""


class Readback:
    def __init__(self, device: torch.device, width: int) -> None:
        self.device = device
        self.dropped = 0
        self._cuda = device.type == "cuda"
        self._free: deque[torch.Tensor] = deque()
        self._pending: deque[tuple[Tag, torch.Tensor | list[float], torch.cuda.Event | None]] = deque()
        if self._cuda:
            for _ in range(RING):
                self._free.append(torch.empty(width, dtype=dv.DTYPE, pin_memory=True))

    def submit(self, tag: Tag, vector: torch.Tensor) -> None:
        """Queue ``vector`` (on the device, ``dv.DTYPE``, length ``width``) to be read back with ``tag``."""
        if not self._cuda:
            self._pending.append((tag, vector.tolist(), None))  # a host tensor: reading it is free
            return
        if not self._free:
            # the GPU is more than RING steps behind: skip this step's values rather than block;
            # the device-side counters still carry every non-finite step
            self.dropped += 1
            if self.dropped == 1:
                log.warning("trainpatrol: the GPU is over %d read-backs behind; skipping values (counted)", RING)
            return
        buf = self._free.popleft()
        buf.copy_(vector, non_blocking=True)
        event = torch.cuda.Event()
        event.record()
        self._pending.append((tag, buf, event))

    def poll(self) -> list[tuple[Tag, list[float]]]:
        out: list[tuple[Tag, list[float]]] = []
        while self._pending:
            tag, buf, event = self._pending[0]
            if event is not None and not event.query():
                break
            self._pending.popleft()
            if isinstance(buf, list):
                out.append((tag, buf))
            else:
                out.append((tag, buf.tolist()))
                self._free.append(buf)
        return out

    def drain(self) -> list[tuple[Tag, list[float]]]:
        """Wait for everything queued: only for close(), OOM forensics and actions, never per step."""
        if self._cuda and self._pending:
            last = self._pending[-1][2]
            if last is not None:
                last.synchronize()
        return self.poll()

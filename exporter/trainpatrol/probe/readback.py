"""Gets small device tensors to the host one step later, without a host-device sync.

On CUDA each submitted vector is copied non-blocking into a pinned host buffer and an event is
recorded; ``poll`` returns only the vectors whose event has completed (``Event.query`` never
blocks). On CPU the values are available at once.
"""

from __future__ import annotations

from collections import deque

import torch

RING = 8


class Readback:
    def __init__(self, device: torch.device, width: int) -> None:
        self.device = device
        self.width = width
        self.dropped = 0
        self._cuda = device.type == "cuda"
        self._free: deque[torch.Tensor] = deque()
        self._pending: deque[tuple[int, torch.Tensor | list[float], torch.cuda.Event | None]] = deque()
        if self._cuda:
            for _ in range(RING):
                self._free.append(torch.empty(width, dtype=torch.float32, pin_memory=True))

    def submit(self, step: int, vector: torch.Tensor) -> None:
        """Queue ``vector`` (on the device, float32, length ``width``) to be read for ``step``."""
        if not self._cuda:
            self._pending.append((step, vector.tolist(), None))  # a host tensor: reading it is free
            return
        if not self._free:
            # the GPU is more than RING steps behind: skip this step's values rather than block;
            # the device-side counters still carry every non-finite step
            self.dropped += 1
            return
        buf = self._free.popleft()
        buf.copy_(vector, non_blocking=True)
        event = torch.cuda.Event()
        event.record()
        self._pending.append((step, buf, event))

    def poll(self) -> list[tuple[int, list[float]]]:
        out: list[tuple[int, list[float]]] = []
        while self._pending:
            step, buf, event = self._pending[0]
            if event is not None and not event.query():
                break
            self._pending.popleft()
            if isinstance(buf, list):
                out.append((step, buf))
            else:
                out.append((step, buf.tolist()))
                self._free.append(buf)
        return out

    def drain(self) -> list[tuple[int, list[float]]]:
        """Wait for everything queued: only for close(), OOM forensics and actions, never per step."""
        if self._cuda and self._pending:
            last = self._pending[-1][2]
            if last is not None:
                last.synchronize()
        return self.poll()

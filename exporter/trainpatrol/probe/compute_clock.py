"""How long a rank computes each step, apart from the time it waits for its peers.

Under data parallelism every rank waits for the slowest in the gradient all-reduce, so step times even out and
cannot name a slow rank; the time from the model's first forward of a step to the moment backward accumulated
the gradient of the model's first parameter (computed last, before DDP's final wait) can
(``trainpatrol_compute_seconds_total``, read by the Straggler rule).

The clock times a sample of steps: its hooks are on only while a step is timed, and a step is timed once
``GAP_SECONDS`` have passed since the last one was, so every step of a slow loop is timed and a fast loop pays for
about ten hooked steps a second, not for hooks on every step. Each timed step counts for the steps since the last.
On CPU both ends are host clock readings. On a GPU the host runs ahead of the device, so the ends are CUDA events
recorded on the current stream, read back once both have completed (``Event.query``, never a sync).
"""

from __future__ import annotations

import math
import time
from collections import deque
from typing import Any

import torch

EVENT_PAIRS = 8
"""Timed steps that may wait for their events at once; none free, the next step is not timed."""
GAP_SECONDS = 0.1


class ComputeClock:
    def __init__(self, model: torch.nn.Module, device: torch.device) -> None:
        self._model = model
        self._first = next((p for p in model.parameters() if p.requires_grad), None)
        self.seconds = math.nan if self._first is None else 0.0
        """Compute seconds of the steps whose times have been read (a total, like the step counter). It starts at 0
        with the step counter: a rate ratio of two counters whose first samples differ by a scrape skews a young
        run's per-step mean by that scrape's share of the window, enough to name a healthy rank a straggler. NaN
        (not exported) once the first step closed without its end: a model whose first parameter's gradient is not
        accumulated by autograd (FSDP2 sets its sharded gradients itself) measures none, and the Straggler rule
        reads its step time instead."""
        self.active = self._first is not None
        self._measured = False
        self._on_gpu = device.type == "cuda"
        self._began = self._ended = 0.0
        self._steps_since = 0
        self._next_at = 0.0
        self._hook_seconds = 0.0
        """The hooks' own time since the last ``step``, Patrol's overhead."""
        self._free: list[tuple[Any, Any]] = []
        self._pair: tuple[Any, Any] | None = None
        """The events of the step being timed, on a GPU."""
        self._pending: deque[tuple[Any, Any, int]] = deque()
        if self._on_gpu:
            self._free = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
                          for _ in range(EVENT_PAIRS)]
        self._handles: list[Any] = []
        if self.active:
            self._arm()  # the first step is timed: it tells whether this model's end is ever seen

    def _arm(self) -> None:
        assert self._first is not None
        if self._on_gpu:
            self._pair = self._free.pop()
        self._handles = [self._model.register_forward_pre_hook(self._forward),
                         self._first.register_post_accumulate_grad_hook(self._backward_done)]

    def _disarm(self, timed: bool = False) -> None:
        """``timed``: the step's events go to be read, else back to the free ones."""
        for handle in self._handles:
            handle.remove()
        self._handles = []
        if self._pair is not None:
            if timed:
                self._pending.append((*self._pair, self._steps_since))
            else:
                self._free.append(self._pair)
            self._pair = None

    def _forward(self, _module: torch.nn.Module, _args: Any) -> None:
        start = time.perf_counter()
        self._begin()
        self._hook_seconds += time.perf_counter() - start

    def _backward_done(self, _param: torch.Tensor) -> None:
        start = time.perf_counter()
        self._end()
        self._hook_seconds += time.perf_counter() - start

    def _begin(self) -> None:
        if self._began or not torch.is_grad_enabled():
            return  # a later micro-batch of the same step, or an evaluation
        if self._pair is not None:
            self._pair[0].record()
        self._began = time.perf_counter()

    def _end(self) -> None:
        if not self._began:
            return
        if self._pair is not None:
            self._pair[1].record()
        self._ended = time.perf_counter()

    def step(self, now: float) -> float:
        """An optimizer step closed at ``now``: the step's compute ends at its last backward. Returns the hooks'
        own time since the last step, Patrol's overhead."""
        self._steps_since += 1
        spent = 0.0
        if self._handles:
            if self._began and self._ended >= self._began:
                self._measured = True
                if not self._on_gpu:
                    self.seconds += (self._ended - self._began) * self._steps_since
                self._disarm(timed=True)
                self._steps_since = 0
                self._next_at = now + GAP_SECONDS
            elif self._began and not self._measured:
                self.seconds, self.active = math.nan, False
                self._disarm()
            self._began = self._ended = 0.0
            spent, self._hook_seconds = self._hook_seconds, 0.0
        if not self._handles and self.active and now >= self._next_at and (self._free or not self._on_gpu):
            self._arm()
        return spent

    def collect(self) -> float:
        """``seconds`` after reading the events that completed (the training thread's; no sync)."""
        pending = self._pending
        while pending and pending[0][1].query():
            start, end, steps = pending.popleft()
            self.seconds += start.elapsed_time(end) / 1e3 * steps
            self._free.append((start, end))
        return self.seconds

    def remove(self) -> None:
        self.active = False
        self._disarm()

"""How long a rank computes each step, apart from the time it waits for its peers.

Under data parallelism every rank waits for the slowest in the gradient all-reduce, so step times even out and
cannot name a slow rank; the time from the model's first forward of a step to the moment backward accumulated
the gradient of the model's first parameter (computed last, before DDP's final wait) can
(``trainpatrol_compute_seconds_total``, read by the Straggler rule).

On CPU both ends are host clock readings. On a GPU the host runs ahead of the device, so the ends are CUDA events
recorded on the current stream; they are read back once both have completed (``Event.query``, never a sync), every
``every``-th step, and each timed step counts for the steps since the last one timed.
"""

from __future__ import annotations

import math
import time
from collections import deque
from typing import Any

import torch

EVENT_PAIRS = 8
"""Timed steps that may wait for their events at once; a step finding none free is not timed."""


class ComputeClock:
    def __init__(self, model: torch.nn.Module, device: torch.device, every: int = 4) -> None:
        first = next((p for p in model.parameters() if p.requires_grad), None)
        self.seconds = math.nan if first is None else 0.0
        """Compute seconds of the steps whose times have been read (a total, like the step counter). It starts at 0
        with the step counter: a rate ratio of two counters whose first samples differ by a scrape skews a young
        run's per-step mean by that scrape's share of the window, enough to name a healthy rank a straggler. NaN
        (not exported) once the first step closed without its end: a model whose first parameter's gradient is not
        accumulated by autograd (FSDP2 sets its sharded gradients itself) measures none, and the Straggler rule
        reads its step time instead."""
        self._measured = False
        self._on_gpu = device.type == "cuda"
        self._every = every if self._on_gpu else 1
        self._began = self._ended = 0.0
        self._steps_since = 0
        self._hook_seconds = 0.0
        """The hooks' own time since the last ``step``, Patrol's overhead."""
        self._timing = True
        self._free: list[tuple[Any, Any]] = []
        self._pending: deque[tuple[Any, Any, int]] = deque()
        if self._on_gpu:
            self._free = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
                          for _ in range(EVENT_PAIRS)]
        self._handles = [] if first is None else [model.register_forward_pre_hook(self._forward),
                                                  first.register_post_accumulate_grad_hook(self._backward_done)]

    @property
    def active(self) -> bool:
        return bool(self._handles)

    def _forward(self, _module: torch.nn.Module, _args: Any) -> None:
        start = time.perf_counter()
        self._begin()
        self._hook_seconds += time.perf_counter() - start

    def _backward_done(self, _param: torch.Tensor) -> None:
        start = time.perf_counter()
        self._end()
        self._hook_seconds += time.perf_counter() - start

    def _begin(self) -> None:
        if self._began or not self._timing or not torch.is_grad_enabled():
            return  # a later micro-batch of the same step, a step not timed, or an evaluation
        if self._on_gpu:
            self._free[-1][0].record()
        self._began = time.perf_counter()

    def _end(self) -> None:
        if not self._began:
            return
        if self._on_gpu:
            self._free[-1][1].record()
        self._ended = time.perf_counter()

    def step(self) -> float:
        """An optimizer step closed: the step's compute ends at its last backward. Returns its hooks' own time
        since the last step, Patrol's overhead."""
        self._steps_since += 1
        if self._began and not self._ended and not self._measured:
            self.seconds = math.nan
            self.remove()
        if self._began and self._ended >= self._began:
            self._measured = True
            if self._on_gpu:
                start, end = self._free.pop()
                self._pending.append((start, end, self._steps_since))
            else:
                self.seconds += self._ended - self._began
            self._steps_since = 0
        self._began = self._ended = 0.0
        self._timing = bool(self._free) and self._steps_since + 1 >= self._every if self._on_gpu else True
        spent, self._hook_seconds = self._hook_seconds, 0.0
        return spent

    def collect(self) -> float:
        """``seconds`` after reading the events that completed (the training thread's; no sync)."""
        pending = self._pending
        while pending and pending[0][1].query():
            start, end, steps = pending.popleft()
            spent = start.elapsed_time(end) / 1e3 * steps
            self.seconds += spent
            self._free.append((start, end))
        if not self._timing and self._free and self._steps_since + 1 >= self._every:
            self._timing = True
        return self.seconds

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []

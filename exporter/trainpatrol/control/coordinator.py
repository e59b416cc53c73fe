"""Agreement across ranks through a tiny lagged control word, with no host sync per step.

Every K optimizer steps each rank contributes a word (the id of each action it has pending, its
step time and the wall clock) to an asynchronous MAX all-reduce. The result is read at the next
exchange, K steps later, when it has long completed, so reading it never stalls the device. All
ranks launch and read the same exchanges at the same steps, so all act at the same step. K follows
the agreed step time so that exchanges happen about every ``target_seconds``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from ..actions import ACTIONS

SLOTS = len(ACTIONS)
STEP_TIME_SLOT = SLOTS
CLOCK_SLOT = SLOTS + 1
WIDTH = SLOTS + 2


@dataclass
class Agreement:
    step: int
    commands: dict[str, int]
    """action -> command id (0: none) agreed by all ranks."""
    clock: float


def encode(pending: dict[str, int], step_seconds: float, clock: float) -> list[int]:
    word = [int(pending.get(a, 0)) for a in ACTIONS]
    return [*word, int(step_seconds * 1e6), int(clock)]


def decode(word: list[int], step: int) -> Agreement:
    return Agreement(step, {a: int(word[i]) for i, a in enumerate(ACTIONS) if word[i]}, float(word[CLOCK_SLOT]))


class Coordinator:
    def __init__(self, device: torch.device, *, target_seconds: float = 0.5, min_interval: int = 1,
                 max_interval: int = 256, first_interval: int = 8) -> None:
        self.distributed = dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
        self.target_seconds = target_seconds
        self.min_interval, self.max_interval = min_interval, max_interval
        self.interval = 1 if not self.distributed else first_interval
        self.next_exchange = self.interval
        nccl = self.distributed and dist.get_backend() == "nccl"
        self._device = device if nccl else torch.device("cpu")
        self._cuda = self._device.type == "cuda"
        self._word = torch.zeros(WIDTH, dtype=torch.int64, device=self._device)
        self._host = torch.zeros(WIDTH, dtype=torch.int64, pin_memory=self._cuda)
        self._result = torch.zeros(WIDTH, dtype=torch.int64, pin_memory=self._cuda)
        self._event: torch.cuda.Event | None = None
        self._work: dist.Work | None = None
        self._last_word: list[int] = []

    def due(self, step: int) -> bool:
        return step >= self.next_exchange

    def exchange(self, step: int, word: list[int]) -> Agreement | None:
        """At a due step: read the previous exchange's result (if any) and launch the next one."""
        if not self.distributed:
            self.next_exchange = step + 1
            return decode(word, step)
        agreed = self._collect(step)
        self._host.copy_(torch.tensor(word, dtype=torch.int64))
        self._word.copy_(self._host, non_blocking=self._cuda)
        self._work = dist.all_reduce(self._word, op=dist.ReduceOp.MAX, async_op=True)
        if self._cuda:
            self._work.wait()  # orders the current stream after the collective; does not block the host
            self._result.copy_(self._word, non_blocking=True)
            self._event = torch.cuda.Event()
            self._event.record()
        if agreed is not None:
            step_seconds = max(self._last_word[STEP_TIME_SLOT] / 1e6, 1e-4)  # the agreed (slowest) step time
            self.interval = max(self.min_interval, min(self.max_interval, round(self.target_seconds / step_seconds)))
        self.next_exchange = step + self.interval
        return agreed

    def _collect(self, step: int) -> Agreement | None:
        if self._work is None:
            return None
        if self._cuda:
            assert self._event is not None
            self._event.synchronize()  # completed K steps ago; costs nothing in practice
            word = self._result.tolist()
        else:
            self._work.wait()
            word = self._word.tolist()
        self._work = None
        self._last_word = word
        return decode(word, step)

    def blocking_exchange(self, word: list[int], step: int) -> Agreement:
        """A synchronous round, used only while paused or acting, never per step."""
        if not self.distributed:
            return decode(word, step)
        pending = self._collect(step)  # finish the lagged exchange first so collectives stay paired
        t = torch.tensor(word, dtype=torch.int64, device=self._device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        merged = decode(t.tolist(), step)
        if pending is not None:
            for action, cid in pending.commands.items():
                merged.commands.setdefault(action, cid)
        self.next_exchange = step + self.interval
        return merged

    def all_true(self, ok: bool) -> bool:
        """Whether every rank reports ``ok`` (a blocking round, used only while acting)."""
        if not self.distributed:
            return ok
        t = torch.tensor([1 if ok else 0], dtype=torch.int64, device=self._device)
        dist.all_reduce(t, op=dist.ReduceOp.MIN)
        return bool(t.item())

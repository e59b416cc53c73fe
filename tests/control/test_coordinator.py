"""The lagged control word, ranks driven step by step in one thread: the schedule of exchanges and the step
at which a command is agreed follow from the words alone, never from a rank's own step time."""

from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace

import pytest
import torch

from trainpatrol.control import coordinator as coordinator_module
from trainpatrol.control.coordinator import Coordinator, encode


@dataclass
class _Launched:
    word: list[int]
    """The rank's word when it launched the collective (the coordinator reuses its tensor)."""
    tensor: torch.Tensor


class LockstepMaxReduce:
    """``torch.distributed`` as the coordinator uses it, for ranks driven in turn by one thread: the n-th
    all_reduce of each rank pairs with the n-th of every other, as collectives do. Waiting on one that some
    rank never launched raises, where real ranks would hang."""

    ReduceOp = SimpleNamespace(MAX="max")

    def __init__(self, world_size: int) -> None:
        self.world_size = world_size
        self.rank = 0
        """The rank whose code runs now; the driver sets it."""
        self.launched: list[list[_Launched]] = [[] for _ in range(world_size)]

    def is_available(self) -> bool:
        return True

    def is_initialized(self) -> bool:
        return True

    def get_world_size(self) -> int:
        return self.world_size

    def get_backend(self) -> str:
        return "gloo"

    def all_reduce(self, tensor: torch.Tensor, op: str, async_op: bool = False) -> SimpleNamespace:
        assert op == "max" and async_op, "the per-step exchange is an asynchronous MAX all-reduce"
        rank, n = self.rank, len(self.launched[self.rank])
        self.launched[rank].append(_Launched(tensor.tolist(), tensor))
        return SimpleNamespace(wait=lambda: self._complete(rank, n))

    def _complete(self, rank: int, n: int) -> None:
        missing = [r for r in range(self.world_size) if len(self.launched[r]) <= n]
        assert not missing, f"rank {rank} waits on collective {n}, which ranks {missing} never launched"
        words = [self.launched[r][n].word for r in range(self.world_size)]
        self.launched[rank][n].tensor.copy_(torch.tensor([max(column) for column in zip(*words, strict=True)]))


@dataclass
class Exchange:
    step: int
    agreed: dict[str, int] | None
    """The commands read at this exchange (launched at the one before); None at the first."""
    agreed_at: int | None


def drive(monkeypatch: pytest.MonkeyPatch, step_seconds: list[float], steps: int,
          pending: dict[tuple[int, int], dict[str, int]] | None = None) -> list[list[Exchange]]:
    """Every rank's exchanges over ``steps`` steps; rank r reports ``step_seconds[r]`` as its step time and
    ``pending[(r, step)]`` as its pending commands from that step on."""
    reduce = LockstepMaxReduce(len(step_seconds))
    monkeypatch.setattr(coordinator_module, "dist", reduce)
    ranks = [Coordinator(torch.device("cpu"), target_seconds=0.5) for _ in step_seconds]
    own: list[dict[str, int]] = [{} for _ in step_seconds]
    exchanges: list[list[Exchange]] = [[] for _ in step_seconds]
    for step in range(1, steps + 1):
        for rank, coordinator in enumerate(ranks):
            own[rank].update((pending or {}).get((rank, step), {}))
            if not coordinator.due(step):
                continue
            reduce.rank = rank
            agreed = coordinator.exchange(step, encode(own[rank], step_seconds[rank], clock=1_000.0))
            exchanges[rank].append(Exchange(step, None, None) if agreed is None else
                                   Exchange(step, agreed.commands, agreed.step))
    return exchanges


def test_ranks_with_different_step_times_exchange_at_the_same_steps(monkeypatch: pytest.MonkeyPatch) -> None:
    exchanges = drive(monkeypatch, step_seconds=[0.02, 0.1], steps=41)
    # The first exchange comes at step 8 (first_interval) and is read at 16. The agreed step time is the
    # slower rank's 0.1 s, so every later interval is 0.5 s / 0.1 s = 5 steps on both ranks; the faster
    # rank alone would wait 0.5 / 0.02 = 25.
    expected = [8, 16, 21, 26, 31, 36, 41]
    assert [e.step for e in exchanges[0]] == expected
    assert [e.step for e in exchanges[1]] == expected


def test_a_command_in_one_ranks_word_is_agreed_by_every_rank_at_the_next_exchange(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # rank 1 alone has pause 7 pending from step 12: its word carries it from the exchange at step 16
    exchanges = drive(monkeypatch, step_seconds=[0.02, 0.1], steps=26, pending={(1, 12): {"pause": 7}})
    for rank in (0, 1):
        assert [(e.step, e.agreed, e.agreed_at) for e in exchanges[rank]] == [
            (8, None, None), (16, {}, 16), (21, {"pause": 7}, 21), (26, {"pause": 7}, 26)]

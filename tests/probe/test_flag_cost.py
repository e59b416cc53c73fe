"""What torch spends on Patrol's non-finite flag is timed in the loop: seldom, and following the host."""

from __future__ import annotations

import time
from typing import Any

import pytest
import torch

from trainpatrol.probe.flag_cost import SAMPLES, FlagCost

SLOW = 0.002


def params_with_grads(n: int) -> list[torch.Tensor]:
    params = [torch.nn.Parameter(torch.zeros(3)) for _ in range(n)]
    for p in params[:-1]:
        p.grad = torch.zeros(3)
    return params


def counted_subtractions(monkeypatch: pytest.MonkeyPatch, slow: list[bool] | None = None) -> list[int]:
    """Counts ``torch._foreach_sub_`` calls and the tensors each took; burns ``SLOW`` in each while ``slow[0]``."""
    sizes: list[int] = []
    original = torch._foreach_sub_

    def counted(steps: list[torch.Tensor], *args: Any) -> Any:
        sizes.append(len(steps))
        if slow and slow[0]:
            end = time.perf_counter() + SLOW
            while time.perf_counter() < end:
                pass
        return original(steps, *args)
    monkeypatch.setattr(torch, "_foreach_sub_", counted)
    return sizes


def test_the_flag_is_timed_once_an_interval_on_as_many_stand_ins_as_parameters_with_a_gradient(
        monkeypatch: pytest.MonkeyPatch) -> None:
    sizes = counted_subtractions(monkeypatch)
    cost = FlagCost(interval=1.0)
    params = params_with_grads(5)
    for i in range(100):  # a fast loop's second: one sample, after the untimed first call
        cost.sample(lambda: params, 10.0 + i / 100)
    assert sizes == [4, 4]
    cost.sample(lambda: params, 11.0)
    assert sizes == [4, 4, 4]
    assert 0 < cost.seconds < 0.001


def test_the_estimate_follows_the_host_by_the_median_of_recent_samples(monkeypatch: pytest.MonkeyPatch) -> None:
    slow = [False]
    counted_subtractions(monkeypatch, slow)
    cost = FlagCost(interval=0.0)
    params = params_with_grads(3)
    for _ in range(SAMPLES):
        cost.sample(lambda: params, time.perf_counter())
    assert cost.seconds < SLOW / 2
    slow[0] = True
    for _ in range(SAMPLES // 2):  # a minority of slow samples: the median stays
        cost.sample(lambda: params, time.perf_counter())
    assert cost.seconds < SLOW / 2
    cost.sample(lambda: params, time.perf_counter())
    assert cost.seconds >= SLOW

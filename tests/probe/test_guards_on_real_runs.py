"""Every guard stays quiet on healthy real runs and trips on sick ones, with the default configuration.

The allocator readings are the ones Patrol took on an H200 (bench/guard_ranges.py, docs/benchmarks.md):
GPT-2-124M bf16 16x1024 read 16.71 GiB reserved, 1.0-1.9 GiB allocated at the step boundary and a
15.1-16.0 GiB peak; the fragmented workload read 11.3-13.9 GiB reserved and 105 allocator retries.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from resume_loops import char_loader, char_model, config, train_chars

from trainpatrol import Patrol
from trainpatrol.demo import _data, _model
from trainpatrol.probe.guards import GuardConfig, Guards
from trainpatrol.probe.memory import MemoryReading

GIB = 2.0**30


def quiet(patrol: Patrol) -> dict[str, int]:
    return {g: n for g, n in patrol._guards.trips.items() if n}


def test_the_demo_regression_with_a_shuffled_loader_keeps_every_guard_quiet(tmp_path: Path) -> None:
    model = _model(torch.device("cpu"))
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    loader = torch.utils.data.DataLoader(_data(), batch_size=64, shuffle=True)
    patrol = Patrol(model=model, optimizer=opt, config=config(tmp_path, "demo-healthy"))
    while patrol.step_count < 600:
        for x, y in patrol.loader(loader):
            loss = torch.nn.functional.mse_loss(model(x), y)
            loss.backward()
            total = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            patrol.step(loss, grad_norm=total, batch_size=len(x))
            opt.step()
            opt.zero_grad()
    assert quiet(patrol) == {} and list(patrol.actions) == []
    patrol.close()


def test_the_char_model_keeps_every_guard_quiet(tmp_path: Path) -> None:
    model, opt = char_model()
    patrol = Patrol(model=model, optimizer=opt, config=config(tmp_path, "char-healthy"))
    losses: list[float] = []
    train_chars(patrol, model, opt, char_loader(0), 400, losses)
    assert losses[-1] < losses[0] / 2  # it learns
    assert quiet(patrol) == {} and list(patrol.actions) == []
    patrol.close()


def reading(reserved: float, allocated: float, peak: float, retries: float = 0.0) -> MemoryReading:
    return MemoryReading(allocated=allocated * GIB, reserved=reserved * GIB, active=allocated * GIB,
                         inactive_split=1.4 * GIB, peak_allocated=peak * GIB, alloc_retries=retries, ooms=0.0,
                         capacity=139.8 * GIB)


def test_a_healthy_gpt2_runs_allocator_readings_never_trip_fragmentation() -> None:
    guards = Guards(GuardConfig())
    for allocated, peak in ((1.93, 15.09), (0.997, 16.05), (1.5, 15.6)):
        m = reading(16.71, allocated, peak)
        assert (m.reserved - m.allocated) / m.reserved > 0.88  # what the old definition read: caching
        assert m.fragmentation < 0.1
        assert guards.check_memory(m) == []
    assert guards.trips["memory_fragmentation"] == 0


@pytest.mark.parametrize(("before", "m"), [
    # the H200 fragmented workload: the allocator had to free its cache and retry (0 -> 105 retries)
    (reading(11.0, 0.5, 10.5), reading(11.27, 0.43, 10.9, retries=105.0)),
    # more than 0.35 of 13.9 GiB reserved stayed unusable even at the peak (8 GiB)
    (reading(11.0, 0.5, 8.0), reading(13.92, 1.2, 8.0)),
])
def test_a_fragmented_workloads_readings_trip_fragmentation(before: MemoryReading, m: MemoryReading) -> None:
    guards = Guards(GuardConfig())
    assert guards.check_memory(before) == []
    tripped = guards.check_memory(m)
    assert [g for g, _ in tripped] == ["memory_fragmentation"]
    assert "unusable even at the allocation peak" in tripped[0][1]


def test_a_user_resetting_peak_statistics_does_not_look_like_fragmentation(tmp_path: Path) -> None:
    readings = iter([reading(16.71, 1.5, 16.0), reading(16.71, 1.5, 1.6), reading(16.71, 1.5, 1.6)])
    patrol = Patrol(config=config(tmp_path, "reset-peaks", memory_reader=lambda: next(readings),
                                  memory_interval_seconds=0.0), device="cpu")
    for _ in range(3):  # after the first read the user called torch.cuda.reset_peak_memory_stats()
        patrol.step(torch.tensor(1.0))
    m = patrol._latest.memory
    assert m is not None and m.peak_allocated == 1.6 * GIB and m.fragmentation < 0.05
    assert patrol._guards.trips["memory_fragmentation"] == 0
    patrol.close()

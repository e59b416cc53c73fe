"""A CPU rank's compute time counts its forward and backward, not its wait for data nor an evaluation between
steps: with a loader that takes 0.1 s a batch and a forward of 0.05 s, compute is about 0.05 s a step while a step
takes about 0.2 s."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.utils.data import DataLoader, Dataset

from trainpatrol import Patrol, PatrolConfig
from trainpatrol.probe import compute_clock


class Slow(Dataset[torch.Tensor]):
    def __len__(self) -> int:
        return 12

    def __getitem__(self, i: int) -> torch.Tensor:
        time.sleep(0.1)
        return torch.ones(4)


def test_compute_time_leaves_out_the_wait_for_data(tmp_path: Path) -> None:
    model = torch.nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    patrol = Patrol(model=model, optimizer=opt, config=PatrolConfig(
        run="compute", agent_url="http://127.0.0.1:9", embedded_agent=False, checkpoint_dir=str(tmp_path / "ckpt"),
        evidence_dir=str(tmp_path / "evidence"), push_interval_seconds=3600, guard_actions={}))
    for x in patrol.loader(DataLoader(Slow(), batch_size=1)):
        loss = model(x).pow(2).mean()
        time.sleep(0.05)
        loss.backward()
        patrol.step(loss)
        opt.step()
        opt.zero_grad()
        with torch.no_grad():  # an evaluation, then other host work, before the next batch
            model(x)
        time.sleep(0.05)
    totals = patrol._totals
    patrol.close()
    assert totals.steps == 12
    assert 0.045 <= totals.compute / 12 <= 0.09, totals.compute
    assert totals.step_sum / 11 >= 0.14 and totals.loader_wait / 12 >= 0.095


def quiet_patrol(model: torch.nn.Module, tmp_path: Path) -> Patrol:
    """A Patrol that pushes nowhere (its snapshot is read directly) and whose guards do not act."""
    return Patrol(model=model, config=PatrolConfig(
        run="compute", agent_url="http://127.0.0.1:9", embedded_agent=False, checkpoint_dir=str(tmp_path / "ckpt"),
        evidence_dir=str(tmp_path / "evidence"), push_interval_seconds=3600, guard_actions={}))


def pushed(patrol: Patrol) -> dict[str, float]:
    return {s["name"]: s["value"] for s in patrol._report.snapshot()["samples"]
            if s["name"] in ("trainpatrol_step_total", "trainpatrol_compute_seconds_total")}


def test_the_compute_counter_is_pushed_at_zero_with_the_step_counter_before_the_first_step(tmp_path: Path) -> None:
    """Both counters' first samples fall in one scrape: a rate ratio of counters whose first samples differ by a
    scrape skews a young run's per-step compute mean by that scrape's share of the window."""
    model = torch.nn.Linear(4, 1)
    patrol = quiet_patrol(model, tmp_path)
    try:
        assert pushed(patrol) == {"trainpatrol_step_total": 0.0, "trainpatrol_compute_seconds_total": 0.0}
        model(torch.ones(1, 4)).sum().backward()
        patrol.step(torch.tensor(1.0))
        after = pushed(patrol)
        assert after["trainpatrol_step_total"] == 1.0 and after["trainpatrol_compute_seconds_total"] > 0
    finally:
        patrol.close()


class UnusedFirst(torch.nn.Module):
    """Its first parameter takes no part in the forward, as FSDP2's sharded parameters take none in autograd's."""

    def __init__(self) -> None:
        super().__init__()
        self.unused = torch.nn.Parameter(torch.ones(1))
        self.used = torch.nn.Linear(4, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.used(x)
        return out


def test_a_rank_whose_first_gradient_autograd_never_accumulates_stops_pushing_compute_time(tmp_path: Path) -> None:
    """After its first step closes with no end seen, the rank pushes no compute time: the Straggler rule reads its
    step time instead of a compute time stuck at 0."""
    model = UnusedFirst()
    patrol = quiet_patrol(model, tmp_path)
    try:
        for _ in range(2):
            model(torch.ones(1, 4)).sum().backward()
            patrol.step(torch.tensor(1.0))
        assert pushed(patrol) == {"trainpatrol_step_total": 2.0}
    finally:
        patrol.close()


class Burning(torch.nn.Module):
    """A forward that takes ``seconds`` of CPU: a fast step's known compute."""

    def __init__(self, seconds: float) -> None:
        super().__init__()
        self.seconds = seconds
        self.lin = torch.nn.Linear(4, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        end = time.thread_time() + self.seconds
        while time.thread_time() < end:
            pass
        out: torch.Tensor = self.lin(x)
        return out


def test_a_fast_loop_times_a_sample_of_its_steps_and_counts_each_for_the_steps_between(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Steps of about 2 ms: the clock's hooks run on about ten steps a second, not on all 300, and its total still
    comes to the forwards' and backwards' own time, as the loop clocks it itself (on a loaded machine a step takes
    longer than its 2 ms of CPU, for both)."""
    hooked: list[float] = []
    original = compute_clock.ComputeClock._forward

    def counted(self: compute_clock.ComputeClock, module: torch.nn.Module, args: Any) -> None:
        hooked.append(time.perf_counter())
        original(self, module, args)
    monkeypatch.setattr(compute_clock.ComputeClock, "_forward", counted)
    model = Burning(0.002)
    patrol = quiet_patrol(model, tmp_path)
    try:
        start, computed = time.perf_counter(), 0.0
        for _ in range(300):
            began = time.perf_counter()
            model(torch.ones(1, 4)).sum().backward()
            computed += time.perf_counter() - began
            patrol.step(torch.tensor(1.0))
        elapsed = time.perf_counter() - start
        patrol._recorder.fold_in()
        compute = patrol._totals.compute
    finally:
        patrol.close()
    assert 2 <= len(hooked) <= elapsed / compute_clock.GAP_SECONDS + 2, (len(hooked), elapsed)
    assert 0.6 <= compute / computed <= 1.6, (compute, computed)  # a timed step stands for the untimed ones before it

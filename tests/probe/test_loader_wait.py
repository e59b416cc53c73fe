"""The loader wait ratio against a loader whose waits are known: a scripted clock that only the loader (the
fetch) and the loop (the compute) move, so every expected value follows from FETCH and COMPUTE. A pause is
never data wait."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from resume_loops import config

from fake_clock import Clock, script_perf_counter
from trainpatrol import Patrol

FETCH, COMPUTE = 0.03, 0.01
"""Seconds each batch takes to arrive, and each step to train on it: 3/4 of every step is waiting."""


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> Clock:
    return script_perf_counter(monkeypatch)


class SlowLoader:
    """A starved pipeline: every batch takes FETCH seconds to arrive."""

    def __init__(self, batches: int, clock: Clock) -> None:
        self.batches, self.clock = batches, clock

    def __iter__(self) -> Iterator[torch.Tensor]:
        for _ in range(self.batches):
            self.clock.now += FETCH
            yield torch.ones(4)


def train(patrol: Patrol, loader: SlowLoader, clock: Clock) -> None:
    for batch in patrol.loader(loader):
        clock.now += COMPUTE
        patrol.step(batch.sum() / 4)


def value(patrol: Patrol, name: str) -> float:
    samples = patrol._report.snapshot()["samples"]
    return float(next(s["value"] for s in samples if s["name"] == "trainpatrol_" + name))


def test_the_wait_ratio_equals_the_known_share_of_waiting(tmp_path: Path, clock: Clock) -> None:
    patrol = Patrol(config=config(tmp_path, "slow", window=40), device="cpu")
    train(patrol, SlowLoader(60, clock), clock)
    assert value(patrol, "loader_wait_ratio") == pytest.approx(0.03 / 0.04, rel=1e-9)
    assert value(patrol, "loader_wait_seconds_total") == pytest.approx(60 * 0.03, rel=1e-9)
    patrol.close()


def test_time_paused_at_a_boundary_is_not_data_wait(tmp_path: Path, clock: Clock) -> None:
    patrol = Patrol(config=config(tmp_path, "paused-wait", window=40), device="cpu")

    def operator() -> None:
        while patrol.state != "paused":
            threading.Event().wait(0.01)
        clock.now += 1000.0  # a long pause, as the step clock sees it
        patrol.request("resume", "operator")

    threading.Thread(target=operator, daemon=True).start()
    patrol.step(torch.tensor(1.0))
    patrol.request("pause", "operator")  # carried out at the loader's first boundary
    train(patrol, SlowLoader(40, clock), clock)
    assert [a.action for a in patrol.actions] == ["pause", "resume"]
    assert value(patrol, "loader_wait_seconds_total") == pytest.approx(40 * 0.03, rel=1e-9)
    assert max(r.loader_wait_seconds for r in patrol._history.records) == pytest.approx(0.03, rel=1e-9)
    patrol.close()

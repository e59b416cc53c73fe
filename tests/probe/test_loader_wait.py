"""The loader wait ratio against a loader with a known, deliberate wait; a pause is never data wait."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path

import torch
from resume_loops import config

from trainpatrol import Patrol

FETCH, COMPUTE = 0.03, 0.01


class SlowLoader:
    """A starved pipeline: every batch takes FETCH seconds to arrive; records the waits it caused."""

    def __init__(self, batches: int) -> None:
        self.batches = batches
        self.waits: list[float] = []

    def __iter__(self) -> Iterator[torch.Tensor]:
        for _ in range(self.batches):
            start = time.perf_counter()
            time.sleep(FETCH)
            self.waits.append(time.perf_counter() - start)
            yield torch.ones(4)


def train(patrol: Patrol, loader: SlowLoader, paused: threading.Event | None = None) -> list[float]:
    """Returns the wall time of each step as the loop itself sees it (fetch + compute), pauses left out."""
    steps = []
    last = time.perf_counter()
    for batch in patrol.loader(loader):
        if paused is not None and paused.is_set():
            paused.clear()
            last = time.perf_counter()  # the loop resumed: the pause is not part of this step's time
        time.sleep(COMPUTE)
        patrol.step(batch.sum() / 4)
        now = time.perf_counter()
        steps.append(now - last)
        last = now
    return steps


def test_the_wait_ratio_equals_the_known_share_of_waiting(tmp_path: Path) -> None:
    patrol = Patrol(config=config(tmp_path, "slow", window=40), device="cpu")
    loader = SlowLoader(60)
    steps = train(patrol, loader)
    snap = patrol.snapshot()
    ratio = next(s["value"] for s in snap["samples"] if s["name"] == "trainpatrol_loader_wait_ratio")
    truth = sum(loader.waits[-40:]) / sum(steps[-40:])
    assert 0.7 < truth < 0.8  # 30 ms of every ~40 ms step
    assert abs(ratio - truth) < 0.03
    total = next(s["value"] for s in snap["samples"] if s["name"] == "trainpatrol_loader_wait_seconds_total")
    assert abs(total - sum(loader.waits)) < 0.02 * len(loader.waits)
    patrol.close()


def test_time_paused_at_a_boundary_is_not_data_wait(tmp_path: Path) -> None:
    patrol = Patrol(config=config(tmp_path, "paused-wait", window=40), device="cpu")
    loader = SlowLoader(40)
    resumed = threading.Event()

    def operator() -> None:
        while patrol.state != "paused":
            time.sleep(0.01)
        time.sleep(1.0)
        resumed.set()
        patrol.request("resume", "operator")

    threading.Thread(target=operator, daemon=True).start()
    patrol.step(torch.tensor(1.0))
    patrol.request("pause", "operator")  # carried out at the loader's first boundary, for 1 s
    train(patrol, loader, resumed)
    assert [a.action for a in patrol.actions] == ["pause", "resume"]
    snap = patrol.snapshot()
    total = next(s["value"] for s in snap["samples"] if s["name"] == "trainpatrol_loader_wait_seconds_total")
    assert total < sum(loader.waits) + 0.2  # the second paused is not in it
    assert max(r.loader_wait_seconds for r in patrol.history.records) < 0.2
    patrol.close()

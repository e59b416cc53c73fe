"""``trainpatrol_probe_overhead_ratio`` counts all of Patrol: ``step()`` from its first line, the loader wrapper,
the optimizer hooks and the publisher thread. Each part made slow on purpose (CPU burnt in it) raises the ratio that
a README loop over a real shuffled DataLoader with workers reports."""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from servers import agent
from trainpatrol import Patrol, PatrolConfig
from trainpatrol.probe import compute_clock
from trainpatrol.probe.snapshot import RankReport
from trainpatrol.probe.step_recorder import StepRecorder
from trainpatrol.probe.update_hooks import UpdateHooks

STEP_WORK = 0.001
"""The training step's own CPU work, besides the tiny model."""
SLOW = 0.002
"""What a slowed part burns each time it runs."""
WINDOW = 32
"""Patrol's window of steps, over which its ratio and the test's shares are taken."""


def burn(seconds: float) -> None:
    end = time.thread_time() + seconds
    while time.thread_time() < end:
        pass


@pytest.fixture(scope="module")
def batches() -> Iterator[DataLoader[Any]]:
    data = TensorDataset(torch.randn(8 * 48, 8))
    yield DataLoader(data, batch_size=8, shuffle=True, num_workers=2, persistent_workers=True)


@pytest.fixture(scope="module")
def agent_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    with agent(tmp_path_factory.mktemp("agent"), "--no-nvml") as url:
        yield url


def reported_ratio(tmp: Path, url: str, batches: DataLoader[Any], *, push_interval: float = 3600.0,
                   min_seconds: float = 0.0, own: list[float] | None = None,
                   step_seconds: list[float] | None = None, step_cpu: list[float] | None = None,
                   fused: bool = False) -> float:
    """The README loop for an epoch (and more, until ``min_seconds`` have passed); Patrol's self-report after it.
    ``own`` gets the training thread's part of it; ``step_seconds`` the mean step time over Patrol's window,
    ``step_cpu`` the training thread's mean CPU seconds a step over the same steps."""
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 1)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=fused)
    cfg = PatrolConfig(run="self-report", agent_url=url, embedded_agent=False, checkpoint_dir=str(tmp / "ckpt"),
                       evidence_dir=str(tmp / "evidence"), window=WINDOW, guard_actions={},
                       push_interval_seconds=push_interval)
    cpu_at_step: deque[float] = deque(maxlen=WINDOW + 1)
    with Patrol(model=model, optimizer=opt, config=cfg) as patrol:
        start = time.monotonic()
        while patrol.step_count < WINDOW + 8 or time.monotonic() - start < min_seconds:
            for (xb,) in patrol.loader(batches):
                loss = model(xb).pow(2).mean()
                loss.backward()
                burn(STEP_WORK)
                patrol.step(loss, batch_size=8)
                cpu_at_step.append(time.thread_time())
                opt.step()
                opt.zero_grad()
        snap = patrol._report.snapshot()
        if own is not None:
            own.append(patrol._history.ratio("probe_seconds", "step_seconds"))
        if step_seconds is not None:
            step_seconds.append(patrol._history.mean("step_seconds"))
        if step_cpu is not None:
            step_cpu.append((cpu_at_step[-1] - cpu_at_step[0]) / WINDOW)
    return float(next(s["value"] for s in snap["samples"] if s["name"] == "trainpatrol_probe_overhead_ratio"))


def slowed(monkeypatch: pytest.MonkeyPatch, owner: Any, name: str, when: Callable[[], bool] = lambda: True,
           took: list[float] | None = None) -> None:
    """``owner.name`` burns ``SLOW`` of CPU first; ``took`` gets the wall time each burn took."""
    original = getattr(owner, name)

    def slow(*args: Any, **kwargs: Any) -> Any:
        if when():
            start = time.perf_counter()
            burn(SLOW)
            if took is not None:
                took.append(time.perf_counter() - start)
        return original(*args, **kwargs)
    monkeypatch.setattr(owner, name, slow)


def counted_share(monkeypatch: pytest.MonkeyPatch, owner: Any, name: str, tmp: Path, url: str,
                  batches: DataLoader[Any], fused: bool = False, timed_once: bool = False) -> tuple[float, float]:
    """(the self-report, the share of step time the slowed part took over Patrol's window), with the part slowed;
    both scale alike with the machine's load. ``timed_once``: Patrol times the part on a sample of steps (one
    here) and counts that every step, so its share is the CPU it burns each step over the step's wall time, the least
    that one timing can read.
    Asserts that the slowed part is a tenth or more of the training thread's CPU a step, which load does not
    change, so that a ratio left without it cannot pass."""
    took: list[float] = []
    slowed(monkeypatch, owner, name, took=took)
    step: list[float] = []
    cpu: list[float] = []
    ratio = reported_ratio(tmp, url, batches, step_seconds=step, step_cpu=cpu, fused=fused)
    assert SLOW / cpu[0] > 0.1, cpu
    return ratio, (SLOW if timed_once else sum(took[-WINDOW:]) / WINDOW) / step[0]


def test_a_quick_patrol_reports_a_small_ratio(tmp_path: Path, agent_url: str, batches: DataLoader[Any]) -> None:
    assert 0 < reported_ratio(tmp_path, agent_url, batches) < 0.2


def test_a_slow_step_raises_the_ratio_from_its_first_line(tmp_path: Path, agent_url: str, batches: DataLoader[Any],
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    # the burn comes before the recorder's first line: step() times itself from its own first line
    ratio, share = counted_share(monkeypatch, StepRecorder, "record", tmp_path, agent_url, batches)
    assert ratio > 0.6 * share, (ratio, share)


def test_slow_optimizer_hooks_raise_the_ratio(tmp_path: Path, agent_url: str, batches: DataLoader[Any],
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    # the pre-hook of every optimizer.step() calls decide(): about 0.4 of the step on an idle machine, where a
    # ratio that left the hooks out reads 0.03
    ratio, share = counted_share(monkeypatch, UpdateHooks, "decide", tmp_path, agent_url, batches)
    assert ratio > 0.6 * share, (ratio, share)


def test_what_a_fused_optimizer_spends_on_the_non_finite_flag_raises_the_ratio(
        tmp_path: Path, agent_url: str, batches: DataLoader[Any], monkeypatch: pytest.MonkeyPatch) -> None:
    # handed Patrol's flag, torch's fused AdamW subtracts it from every step count inside optimizer.step(), outside
    # Patrol's code: made slow, the job pays for it every step, and the ratio says so
    ratio, share = counted_share(monkeypatch, torch, "_foreach_sub_", tmp_path, agent_url, batches, fused=True,
                                 timed_once=True)
    assert ratio > 0.6 * share, (ratio, share)


def test_a_slow_loader_wrapper_raises_the_ratio(tmp_path: Path, agent_url: str, batches: DataLoader[Any],
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    # the wrapper hands each fetch's start and end to it
    ratio, share = counted_share(monkeypatch, StepRecorder, "fetched", tmp_path, agent_url, batches)
    assert ratio > 0.6 * share, (ratio, share)


def test_a_slow_compute_clock_raises_the_ratio(tmp_path: Path, agent_url: str, batches: DataLoader[Any],
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    # its forward pre-hook runs at a timed step's first forward, outside step() and the optimizer's hooks; here
    # every step is timed
    monkeypatch.setattr(compute_clock, "GAP_SECONDS", 0.0)
    ratio, share = counted_share(monkeypatch, compute_clock.ComputeClock, "_begin", tmp_path, agent_url, batches)
    assert ratio > 0.6 * share, (ratio, share)


def test_a_slow_publisher_raises_the_ratio_by_its_cpu_share(tmp_path: Path, agent_url: str,
                                                            batches: DataLoader[Any],
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """20 ms of CPU in each push, every 50 ms: the ratio grows by the publisher thread's CPU seconds per second,
    which the test reads from the thread's own CPU clock (a loaded machine runs fewer pushes, so fewer seconds)."""
    on_publisher = lambda: threading.current_thread().name == "trainpatrol-publisher"  # noqa: E731
    for _ in range(10):
        slowed(monkeypatch, RankReport, "snapshot", on_publisher)
    seen: list[tuple[float, float]] = []
    original = RankReport.snapshot

    def clocked(self: RankReport) -> dict[str, Any]:
        out = original(self)
        if on_publisher():
            seen.append((time.perf_counter(), time.thread_time()))
        return out
    monkeypatch.setattr(RankReport, "snapshot", clocked)
    own: list[float] = []
    ratio = reported_ratio(tmp_path, agent_url, batches, push_interval=0.05, min_seconds=2.5, own=own)
    (t0, cpu0), (t1, cpu1) = seen[1], seen[-1]
    share = (cpu1 - cpu0) / (t1 - t0)
    assert share > 0.02
    # Patrol's share is over its last second or more, this one over the whole run: on a loaded machine they
    # differ; left out of the ratio, the difference would be 0
    assert share / 3 < ratio - own[0] < 3 * share, (ratio, own, share)

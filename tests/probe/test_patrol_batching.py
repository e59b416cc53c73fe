"""On CPU, steps are folded into history, totals and guards in batches: values stay exact wherever the
training thread reads them, and a guard's action still comes at the next boundary."""

from __future__ import annotations

import math
import threading
from pathlib import Path
from typing import Any

import torch

from loops import losses_with_nan, run_scripted, scripted_patrol
from trainpatrol import Patrol, PatrolConfig
from trainpatrol.probe.guards import GuardConfig
from trainpatrol.probe.window import History


def value(snapshot: dict[str, Any], name: str, **labels: str) -> float:
    found = [s["value"] for s in snapshot["samples"]
             if s["name"] == "trainpatrol_" + name and all(s["labels"].get(k) == v for k, v in labels.items())]
    assert len(found) == 1, f"{name}{labels}: {found}"
    return float(found[0])


def batched(tmp: Path, **overrides: Any) -> Patrol:
    """Batches of 16 steps whatever the step time (after the first step, which is folded alone)."""
    patrol: Patrol = scripted_patrol(tmp, readback_lag_seconds=3600.0, **overrides)
    return patrol


def test_nan_acts_at_the_next_boundary_though_steps_are_batched(tmp_path: Path) -> None:
    patrol = batched(tmp_path, guard_actions={"nonfinite_loss": "empty_cache", "nonfinite_grad": "empty_cache"})
    norms = [1.0] * 30
    norms[24] = math.inf
    run_scripted(patrol, losses_with_nan(30, nan_at=20), grad_norms=norms)
    assert [(a.action, a.step) for a in patrol.actions] == [("empty_cache", 20), ("empty_cache", 25)]
    assert patrol._guards.trips["nonfinite_loss"] == patrol._guards.trips["nonfinite_grad"] == 1
    patrol.close()


def test_a_spike_guard_that_acts_is_judged_every_step(tmp_path: Path) -> None:
    patrol = batched(tmp_path, guards=GuardConfig(min_steps=5), guard_actions={"loss_spike": "empty_cache"})
    run_scripted(patrol, [1.0] * 10 + [5.0] + [1.0] * 5)
    assert [(a.action, a.step) for a in patrol.actions] == [("empty_cache", 11)]
    patrol.close()


def test_the_publisher_sees_batches_the_training_thread_every_step(tmp_path: Path) -> None:
    patrol = batched(tmp_path, guard_actions={})
    run_scripted(patrol, [float(i) for i in range(1, 21)])
    seen: list[dict[str, Any]] = []
    publisher = threading.Thread(target=lambda: seen.append(patrol._report.snapshot()))
    publisher.start()
    publisher.join()
    assert value(seen[0], "step_total") == 20  # counted at once
    assert value(seen[0], "loss") == 17.0  # steps 2-17 were folded at step 17
    assert patrol._history.records[-1].step == 17  # another thread's snapshot folds nothing in
    snap = patrol._report.snapshot()
    assert value(snap, "loss") == 20.0
    assert [r.step for r in patrol._history.records] == list(range(1, 21))
    assert [r.loss for r in patrol._history.records] == [float(i) for i in range(1, 21)]
    assert all(r.probe_seconds > 0 and r.step_seconds > 0 for r in patrol._history.records)
    assert snap["histogram"]["counts"][-1] == 20
    patrol.close()


def test_learning_rate_is_the_last_steps_when_a_scheduler_moved_it_since(tmp_path: Path) -> None:
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.5)
    cfg = PatrolConfig(run="lr", agent_url="http://127.0.0.1:9", embedded_agent=False, push_interval_seconds=3600,
                       readback_lag_seconds=3600.0, checkpoint_dir=str(tmp_path / "c"), evidence_dir=str(tmp_path))
    patrol = Patrol(optimizer=opt, config=cfg, device="cpu")
    for _ in range(3):
        patrol.step(torch.tensor(1.0))
    opt.param_groups[0]["lr"] = 0.25  # what a scheduler does after the step
    assert value(patrol._report.snapshot(), "learning_rate", param_group="0") == 0.5
    patrol.step(torch.tensor(1.0), learning_rates=[0.125])
    patrol.step(torch.tensor(1.0))
    assert value(patrol._report.snapshot(), "learning_rate", param_group="0") == 0.25
    patrol.step(torch.tensor(1.0), learning_rates=[0.125])
    assert value(patrol._report.snapshot(), "learning_rate", param_group="0") == 0.125
    patrol.close()


def test_history_get_with_skipped_steps_and_after_going_back() -> None:
    h = History(window=4)
    for s in (1, 2, 3, 5, 6):
        h.record(s, 0.0).loss = float(s)
    assert [r.loss if (r := h.get(s)) else None for s in range(8)] == [None, 1.0, 2.0, 3.0, None, 5.0, 6.0, None]
    for s in (4, 5):  # a restore to step 3
        h.record(s, 0.0).loss = 10.0 * s
    assert [r.loss if (r := h.get(s)) else None for s in range(8)] == [None, 1.0, 2.0, 3.0, 40.0, 50.0, 6.0, None]
    short = History(window=2, keep=4)
    for s in range(1, 11):
        short.record(s, 0.0)
    assert [s for s in range(12) if short.get(s) is not None] == [7, 8, 9, 10]

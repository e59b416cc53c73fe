"""Periodic checkpoints: every N optimizer steps or every S seconds, each a checkpoint of the step it names,
with a trigger that says so; none at all when neither is set."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import torch

from trainpatrol import Patrol, PatrolConfig


def train(tmp_path: Path, steps: int, sleep: float = 0.0, **config: float) -> Patrol:
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 1)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    patrol = Patrol(model=model, optimizer=opt, config=PatrolConfig(
        run="periodic", agent_url="http://127.0.0.1:9", embedded_agent=False,
        checkpoint_dir=str(tmp_path / "ckpt"), evidence_dir=str(tmp_path / "evidence"), push_interval_seconds=3600,
        guard_actions={}, keep_checkpoints=100, **config))  # type: ignore[arg-type]
    for _ in range(steps):
        patrol.boundary()
        loss = model(torch.randn(16, 8)).pow(2).mean()
        loss.backward()
        patrol.step(loss)
        opt.step()
        opt.zero_grad()
        time.sleep(sleep)
    patrol.close()
    return patrol


def triggers(tmp_path: Path) -> list[tuple[int, str, str]]:
    found = [json.loads((b / "trigger.json").read_text()) | {"step": int(b.name.split("-step")[1][:8])}
             for b in (tmp_path / "evidence").iterdir()]
    return sorted((t["step"], t["source"], t["reason"]) for t in found)


def test_a_checkpoint_every_ten_steps_names_its_step(tmp_path: Path) -> None:
    patrol = train(tmp_path, 35, checkpoint_every_steps=10)
    assert [(a.action, a.outcome, a.step) for a in patrol.actions] == [("checkpoint", "ok", s) for s in (10, 20, 30)]
    assert sorted(p.name for p in (tmp_path / "ckpt").glob("step-*")) == [f"step-{s:08d}" for s in (10, 20, 30)]
    assert triggers(tmp_path) == [(s, "periodic", "periodic checkpoint every 10 steps") for s in (10, 20, 30)]


def test_a_checkpoint_every_few_seconds_waits_that_long(tmp_path: Path) -> None:
    started, wall = time.perf_counter(), time.time()
    patrol = train(tmp_path, 40, sleep=0.05, checkpoint_every_seconds=0.4)
    elapsed = time.perf_counter() - started
    times = [a.time for a in patrol.actions]
    assert all(a.action == "checkpoint" and a.outcome == "ok" for a in patrol.actions)
    assert 1 <= len(times) <= elapsed / 0.4
    assert times[0] - wall >= 0.4, times  # not before the first 0.4 s have passed
    assert {(src, why) for _, src, why in triggers(tmp_path)} == {("periodic", "periodic checkpoint every 0.4 s")}


def test_no_periodic_checkpoint_unless_asked(tmp_path: Path) -> None:
    assert list(train(tmp_path, 30).actions) == [] and not list((tmp_path / "ckpt").glob("step-*"))


@pytest.mark.parametrize("bad", [{"checkpoint_every_steps": -1}, {"checkpoint_every_seconds": float("nan")}])
def test_a_negative_or_nan_period_is_refused(bad: dict[str, float]) -> None:
    with pytest.raises(ValueError, match="must be >= 0"):
        PatrolConfig(**bad).validate()  # type: ignore[arg-type]

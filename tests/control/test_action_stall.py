"""An action that holds the training thread past its time is a stall, named by the part of the action the rank is
in; a run whose checkpoints are slow but steady is not stalled by them. One process on CPU, a real agent; the
checkpoint's write is made slow where it happens (``Checkpointer.save_rank``)."""

from __future__ import annotations

import json
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import torch

from servers import agent, http_get
from trainpatrol import Patrol, PatrolConfig
from trainpatrol.control.checkpoint import Checkpointer
from trainpatrol.probe.stall_watch import PHASES


def slow_saves(monkeypatch: pytest.MonkeyPatch, seconds: list[float]) -> None:
    """The n-th checkpoint's write takes ``seconds[n]`` longer."""
    save = Checkpointer.save_rank

    def slow(self: Checkpointer, *args: Any, **kwargs: Any) -> Path:
        threading.Event().wait(seconds.pop(0))
        return save(self, *args, **kwargs)

    monkeypatch.setattr(Checkpointer, "save_rank", slow)


@contextmanager
def highest_phase(url: str) -> Iterator[Callable[[], int]]:
    """The highest ``trainpatrol_rank_stalled_phase`` the agent served while the block ran."""
    highest, done = [0], threading.Event()

    def watch() -> None:
        while not done.is_set():
            for line in http_get(f"{url}/metrics").decode().splitlines():
                if line.startswith("trainpatrol_rank_stalled_phase{") and 'run="act"' in line:
                    highest[0] = max(highest[0], int(float(line.rsplit(" ", 1)[1])))
            done.wait(0.1)

    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        yield lambda: highest[0]
    finally:
        done.set()
        watcher.join()


def train(tmp: Path, url: str, action_stall_seconds: float, checkpoints_at: set[int]) -> Patrol:
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    batches = [torch.randn(4, 8) for _ in range(30)]
    with Patrol(model=model, optimizer=opt, config=PatrolConfig(
            run="act", agent_url=url, embedded_agent=False, checkpoint_dir=str(tmp / "ckpt"),
            evidence_dir=str(tmp / "evidence"), push_interval_seconds=0.1, guard_actions={},
            action_stall_seconds=action_stall_seconds)) as patrol:
        for step, x in enumerate(patrol.loader(batches), 1):
            loss = model(x).pow(2).mean()
            loss.backward()
            patrol.step(loss, batch_size=4)
            opt.step()
            opt.zero_grad()
            if step in checkpoints_at:
                patrol.request("checkpoint", f"asked at step {step}")
    return patrol


def test_a_checkpoint_held_past_the_action_stall_time_is_captured_in_its_checkpoint_phase(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    slow_saves(monkeypatch, [3.0])
    with agent(tmp_path) as url, highest_phase(url) as highest:
        patrol = train(tmp_path, url, action_stall_seconds=1.0, checkpoints_at={5})
    assert [a.outcome for a in patrol.actions if a.action == "checkpoint"] == ["ok"]
    bundles = list((tmp_path / "evidence").glob("stall-step*"))
    assert [b.name for b in bundles] == ["stall-step00000005-checkpoint"]
    stall = json.loads((bundles[0] / "rank-00000" / "extra.json").read_text())["stall"]
    assert (stall["phase"], stall["action"], stall["step"]) == ("checkpoint", "checkpoint", 5)
    assert 1.0 <= stall["seconds_since_step"] < 3.0 and stall["threshold_seconds"] == 1.0
    summary = json.loads((bundles[0] / "stall.json").read_text())
    assert summary["phases"] == {"0": "checkpoint"} and summary["action"] == "checkpoint"
    assert PHASES[highest()] == "checkpoint"


def test_checkpoints_slow_but_steady_are_no_stall(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # the second write takes longer than action_stall_seconds, but not four times the first's
    slow_saves(monkeypatch, [1.0, 2.5])
    with agent(tmp_path) as url, highest_phase(url) as highest:
        patrol = train(tmp_path, url, action_stall_seconds=1.5, checkpoints_at={5, 15})
    assert [a.outcome for a in patrol.actions if a.action == "checkpoint"] == ["ok", "ok"]
    assert highest() == 0 and not list((tmp_path / "evidence").glob("stall-*"))

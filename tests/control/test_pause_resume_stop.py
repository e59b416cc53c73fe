"""Issue 5 on one process: pause, resume, stop through a real agent; bit-for-bit restore; a failed save."""

from __future__ import annotations

import json
import threading
from pathlib import Path
from typing import Any

import torch

from servers import agent, holds_for, http_json, wait_for
from trainpatrol import STOP_EXIT_CODE, Patrol, PatrolConfig
from trainpatrol.control.checkpoint import Checkpointer, temp_path


def make(tmp: Path, url: str, run: str, seed: int = 0, patrol_args: dict[str, Any] | None = None,
         **cfg: Any) -> tuple[Patrol, torch.nn.Module]:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=7, gamma=0.5)
    config = PatrolConfig(run=run, agent_url=url, embedded_agent=False, checkpoint_dir=str(tmp / "ckpt"),
                          evidence_dir=str(tmp / "evidence"), push_interval_seconds=0.1,
                          pause_poll_seconds=0.05, **cfg)
    return Patrol(model=model, optimizer=opt, scheduler=sched, config=config, **(patrol_args or {})), model


def train(patrol: Patrol, model: torch.nn.Module, until: int, losses: list[float],
          halt: threading.Event | None = None) -> int | None:
    """Synthetic data drawn from torch's RNG, so a restored RNG replays the same batches.

    `halt` ends a background loop when its test fails, so it cannot draw from the RNG of the next test."""
    assert patrol.optimizer is not None and patrol._scheduler is not None
    try:
        while patrol.step_count < until and not (halt is not None and halt.is_set()):
            patrol.boundary()
            if halt is not None:
                halt.wait(0.01)
            x = torch.randn(16, 8)
            loss = ((model(x) - x.sum(dim=1, keepdim=True)) ** 2).mean()
            loss.backward()
            patrol.step(loss)
            patrol.optimizer.step()
            patrol.optimizer.zero_grad()
            patrol._scheduler.step()
            losses.append(loss.item())
    except SystemExit as exc:
        return int(exc.code) if exc.code is not None else 0
    return None


def post_action(url: str, run: str, action: str) -> Any:
    return http_json(f"{url}/v1/runs/{run}/actions", {"action": action, "reason": "test"})


def run_state(url: str, run: str) -> str:
    try:
        return str(http_json(f"{url}/v1/runs/{run}")["state"])
    except Exception:
        return "unknown"


def test_pause_resume_then_stop_via_the_agent(tmp_path: Path) -> None:
    with agent(tmp_path, "--no-nvml") as url:
        patrol, model = make(tmp_path, url, "p1")
        losses: list[float] = []
        result: list[int | None] = []
        halt = threading.Event()
        t = threading.Thread(target=lambda: result.append(train(patrol, model, 10**6, losses, halt)), daemon=True)
        t.start()
        try:
            pause_resume_then_stop(url, patrol, t, result)
        finally:
            halt.set()
            t.join(30)
            patrol.close()


def pause_resume_then_stop(url: str, patrol: Patrol, t: threading.Thread, result: list[int | None]) -> None:
    # The agent answers 404 for a run until the run's first push, which follows its proof handshake.
    wait_for(lambda: run_state(url, "p1") == "running", 20, what="the agent knows the run")
    post_action(url, "p1", "pause")
    wait_for(lambda: run_state(url, "p1") == "paused", 20, what="paused")
    paused_at = patrol.step_count
    assert patrol.state == "paused"
    holds_for(lambda: patrol.step_count == paused_at and patrol.state == "paused", 0.5, what="the pause")
    pause = next(a for a in patrol.actions if a.action == "pause")
    assert pause.outcome == "ok" and pause.step == paused_at
    ckpt = Path(pause.checkpoint)
    assert json.loads((ckpt / "meta.json").read_text())["pinned"] is True
    manifest = json.loads((Path(pause.evidence) / "manifest.json").read_text())
    assert manifest["action"] == "pause" and manifest["step"] == paused_at
    for name in ("history.json", "stacks.txt", "nvml.json", "versions.json", "config.json",
                 "memory_summary.txt"):
        assert (Path(pause.evidence) / "rank-00000" / name).is_file(), name
    trigger = json.loads((Path(pause.evidence) / "trigger.json").read_text())
    assert trigger["action"] == "pause" and trigger["source"] == "api"

    post_action(url, "p1", "resume")
    wait_for(lambda: patrol.step_count > paused_at + 5, 20, what="resumed")
    post_action(url, "p1", "stop")
    t.join(30)
    assert result == [STOP_EXIT_CODE]
    assert patrol.state == "stopped"
    wait_for(lambda: run_state(url, "p1") == "stopped", 10, what="agent sees stopped")
    status = http_json(f"{url}/v1/runs/p1")
    assert status["last_action"]["action"] == "stop" and status["last_action"]["outcome"] == "ok"
    assert status["last_checkpoint"].endswith(f"step-{patrol.step_count:08d}")


def test_restart_from_stop_checkpoint_reproduces_losses_bit_for_bit(tmp_path: Path) -> None:
    url = "http://127.0.0.1:9"  # no agent: local requests only
    reference: list[float] = []
    patrol, model = make(tmp_path / "a", url, "ref")
    train(patrol, model, 30, reference)
    patrol.close()

    first: list[float] = []
    patrol, model = make(tmp_path / "b", url, "split")
    train(patrol, model, 12, first)
    patrol.request("stop", "test stop at 12")
    assert train(patrol, model, 30, first) == STOP_EXIT_CODE
    patrol.close()
    assert first == reference[:12]

    torch.manual_seed(999)  # the restore must bring the RNG back, not this
    resumed: list[float] = []
    patrol, model = make(tmp_path / "b", url, "split", seed=123)
    assert patrol.restore("latest").step == 12
    train(patrol, model, 30, resumed)
    patrol.close()
    assert resumed == reference[12:]  # exact float equality


def test_failed_checkpoint_keeps_previous_and_stays_paused(tmp_path: Path) -> None:
    with agent(tmp_path, "--no-nvml", "--series", "full") as url:  # checkpoint_failures_total
        patrol, model = make(tmp_path, url, "full")
        losses: list[float] = []
        train(patrol, model, 5, losses)
        patrol.request("checkpoint", "first, good")
        train(patrol, model, 6, losses)
        good = Checkpointer(tmp_path / "ckpt").latest()
        assert good is not None and good.name == "step-00000005"
        before = sorted(p.name for p in good.iterdir())

        # the next save goes to a full disk: its temp file is a link to /dev/full (ENOSPC)
        target = tmp_path / "ckpt" / "step-00000006"
        target.mkdir(parents=True)
        temp_path(target / "state.bin").symlink_to("/dev/full")
        patrol.request("checkpoint", "second, disk full")
        result: list[int | None] = []
        t = threading.Thread(target=lambda: result.append(train(patrol, model, 10, losses)), daemon=True)
        t.start()
        wait_for(lambda: patrol.state == "paused", 20, what="paused after failed save")
        failed = [a for a in patrol.actions if a.action == "checkpoint"][-1]
        assert failed.outcome == "failed" and "No space left on device" in failed.detail
        assert patrol.step_count == 6
        assert Checkpointer(tmp_path / "ckpt").latest() == good
        assert sorted(p.name for p in good.iterdir()) == before
        assert not (target / "meta.json").exists() and not (target / "state.bin").exists()
        wait_for(lambda: run_state(url, "full") == "paused", 10, what="agent sees paused")
        status = http_json(f"{url}/v1/runs/full")
        assert status["last_action"]["outcome"] == "failed"
        body = http_json(f"{url}/v1/runs/full")
        assert body["last_checkpoint"].endswith("step-00000005")
        metrics = wait_for(lambda: [ln for ln in __import__("urllib.request").request.urlopen(url + "/metrics")
                                    .read().decode().splitlines()
                                    if ln.startswith("trainpatrol_checkpoint_failures_total")], 5)
        assert metrics[0].endswith(" 1.0")
        post_action(url, "full", "resume")
        t.join(30)
        assert result == [None] and patrol.step_count == 10
        patrol.close()


def test_pause_timeout_turns_into_stop(tmp_path: Path) -> None:
    patrol, model = make(tmp_path, "http://127.0.0.1:9", "timeout", pause_timeout_seconds=0.3)
    losses: list[float] = []
    train(patrol, model, 3, losses)
    patrol.request("pause", "test")
    assert train(patrol, model, 10, losses) == STOP_EXIT_CODE
    assert [(a.action, a.outcome) for a in patrol.actions] == [("pause", "ok"), ("stop", "ok")]
    assert patrol.state == "stopped" and patrol.step_count == 3
    patrol.close()


def test_extra_state_round_trips_through_a_checkpoint(tmp_path: Path) -> None:
    extra = {"epoch": 3, "sampler_offset": 1234}
    patrol, model = make(tmp_path, "http://127.0.0.1:9", "extra", patrol_args={"extra_state": lambda: dict(extra)})
    train(patrol, model, 4, [])
    patrol.request("checkpoint", "test")
    train(patrol, model, 5, [])
    patrol.close()
    saved = tmp_path / "ckpt" / "step-00000004"
    restored: list[dict[str, Any]] = []
    patrol, model = make(tmp_path, "http://127.0.0.1:9", "extra", patrol_args={"load_extra_state": restored.append})
    assert patrol.restore(saved).step == 4
    assert restored == [extra]
    patrol.close()


def test_actions_agreed_at_the_same_step_all_take_effect(tmp_path: Path) -> None:
    patrol, model = make(tmp_path, "http://127.0.0.1:9", "many")
    train(patrol, model, 2, [])
    patrol.request("capture", "alert A")
    patrol.request("empty_cache", "alert B")
    patrol.request("checkpoint", "alert C")
    patrol.request("resume", "stray")
    train(patrol, model, 3, [])
    got = sorted((a.action, a.outcome, a.step) for a in patrol.actions)
    assert got == [("capture", "skipped", 2), ("checkpoint", "ok", 2), ("empty_cache", "ok", 2),
                   ("resume", "skipped", 2)]
    skipped = next(a for a in patrol.actions if a.action == "capture")
    assert skipped.detail == "covered by checkpoint at the same step"
    patrol.close()

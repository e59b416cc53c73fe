"""A ``checkpoint`` action stages the state in host memory and returns to training; the state is written
in the background, holds exactly the step it names, and the time training was held is exported."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import pytest
import torch
from resume_loops import config, mlp
from test_poisoned_state import train_mlp

from trainpatrol import Patrol
from trainpatrol.control import executor


def value(patrol: Patrol, name: str) -> float:
    snap = patrol._report.snapshot()
    return float(next(s["value"] for s in snap["samples"] if s["name"] == f"trainpatrol_{name}"))


def held_writes(monkeypatch: pytest.MonkeyPatch) -> threading.Event:
    """The background writer waits (a slow disk) until the returned event is set."""
    release = threading.Event()
    atomic_write = executor.ckpt.atomic_write

    def held_write(path: Path, write: Any) -> None:
        if threading.current_thread().name == "trainpatrol-checkpoint-writer":
            release.wait(30)
        atomic_write(path, write)
    monkeypatch.setattr(executor.ckpt, "atomic_write", held_write)
    return release


def checkpoint_staged_at_step_10(tmp_path: Path) -> tuple[Patrol, torch.nn.Module, torch.optim.Optimizer]:
    model, opt = mlp()
    patrol = Patrol(model=model, optimizer=opt, config=config(tmp_path, "async", guard_actions={},
                                                              background_checkpoints=True))
    train_mlp(patrol, model, opt, 10)
    patrol.request("checkpoint", "test")
    patrol.boundary()  # staged here; the loop goes on at once
    return patrol, model, opt


def test_a_checkpoint_written_while_training_goes_on_holds_the_state_of_its_step(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    release = held_writes(monkeypatch)  # the write waits until training has moved the weights on
    patrol, model, opt = checkpoint_staged_at_step_10(tmp_path)
    at_step = {k: v.clone() for k, v in model.state_dict().items()}
    moments = {k: v["exp_avg"].clone() for k, v in opt.state_dict()["state"].items()}
    train_mlp(patrol, model, opt, 30)  # 20 steps while the checkpoint is being written
    assert not any(torch.equal(at_step[k], v) for k, v in model.state_dict().items())
    assert [a.action for a in patrol.actions] == []  # not durable yet: no outcome
    release.set()
    patrol._control.executor.wait_for_write()
    assert [(a.action, a.outcome, a.step) for a in patrol.actions] == [("checkpoint", "ok", 10)]
    blocked, took = value(patrol, "checkpoint_blocked_seconds_total"), value(patrol, "checkpoint_write_seconds")
    assert 0 < blocked < took
    patrol.close()

    model, opt = mlp(seed=7)
    fresh = Patrol(model=model, optimizer=opt, config=config(tmp_path, "async"))
    assert fresh.restore("latest").step == 10
    for k, v in model.state_dict().items():
        assert torch.equal(v, at_step[k]), k
    assert all(torch.equal(v["exp_avg"], moments[k]) for k, v in opt.state_dict()["state"].items())
    fresh.close()


def test_a_stop_reports_ok_only_once_its_checkpoint_is_durable(tmp_path: Path) -> None:
    model, opt = mlp()
    patrol = Patrol(model=model, optimizer=opt, config=config(tmp_path, "sync", guard_actions={}))
    train_mlp(patrol, model, opt, 10)
    patrol.request("checkpoint", "first")
    patrol.request("stop", "then stop")  # the stronger action covers the checkpoint and writes at once
    with pytest.raises(SystemExit):
        patrol.boundary()
    stop = patrol.actions[-1]
    assert (stop.action, stop.outcome) == ("stop", "ok")
    assert (Path(stop.checkpoint) / "meta.json").is_file() and (Path(stop.checkpoint) / "state.bin").is_file()
    patrol.close()


def test_a_background_write_that_fails_leaves_no_checkpoint_and_pauses_the_run(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    atomic_write = executor.ckpt.atomic_write

    def full_disk(path: Path, write: Any) -> None:
        if threading.current_thread().name == "trainpatrol-checkpoint-writer":
            raise OSError(28, "No space left on device", str(path))
        atomic_write(path, write)
    monkeypatch.setattr(executor.ckpt, "atomic_write", full_disk)
    model, opt = mlp()
    patrol = Patrol(model=model, optimizer=opt, config=config(tmp_path, "fails", guard_actions={},
                                                              background_checkpoints=True))
    train_mlp(patrol, model, opt, 10)
    patrol.request("checkpoint", "test")
    patrol.boundary()
    patrol._control.executor.wait_for_write()
    (action, outcome, step), = [(a.action, a.outcome, a.step) for a in patrol.actions]
    assert (action, outcome, step) == ("checkpoint", "failed", 10)
    assert "No space left on device" in patrol.actions[0].detail
    assert not (tmp_path / "ckpt" / "step-00000010").exists()
    pause = patrol._commands.pending()["pause"]
    assert pause["source"] == "checkpoint" and "checkpoint of step 10 failed" in pause["reason"]
    patrol.close()


def test_a_run_whose_close_waits_for_a_write_reads_stopping_not_running(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Training is over once ``close`` begins: while it waits for a checkpoint still being written the rank
    reports ``stopping`` (pushed as ``trainpatrol_rank_state`` 3), so no stall alert reads the wait as a hang."""
    release = held_writes(monkeypatch)
    patrol, _, _ = checkpoint_staged_at_step_10(tmp_path)
    assert patrol.state == "running"
    closing = threading.Thread(target=patrol.close)
    closing.start()
    closing.join(0.5)
    assert closing.is_alive() and patrol.state == "stopping"
    assert value(patrol, "rank_state") == 3.0
    release.set()
    closing.join(30)
    assert patrol.state == "closed"
    assert [(a.action, a.outcome, a.step) for a in patrol.actions] == [("checkpoint", "ok", 10)]


def test_a_single_process_dcp_checkpoint_written_in_the_background_holds_the_state_of_its_step(
        tmp_path: Path) -> None:
    model, opt = mlp()
    cfg = config(tmp_path, "dcp-single", guard_actions={}, background_checkpoints=True, checkpoint_format="dcp")
    patrol = Patrol(model=model, optimizer=opt, config=cfg)
    train_mlp(patrol, model, opt, 10)
    patrol.request("checkpoint", "test")
    patrol.boundary()  # staged here, with no process group to write it with
    at_step = {k: v.clone() for k, v in model.state_dict().items()}
    train_mlp(patrol, model, opt, 30)
    patrol._control.executor.wait_for_write()
    assert [(a.action, a.outcome, a.step) for a in patrol.actions] == [("checkpoint", "ok", 10)]
    patrol.close()

    model, opt = mlp(seed=7)
    fresh = Patrol(model=model, optimizer=opt, config=config(tmp_path, "dcp-single", checkpoint_format="dcp"))
    assert fresh.restore("latest").step == 10
    for k, v in model.state_dict().items():
        assert torch.equal(v, at_step[k]), k
    fresh.close()


def test_dcp_checkpoints_stage_into_the_same_host_buffers_and_each_holds_its_own_step(tmp_path: Path) -> None:
    model, opt = mlp()
    cfg = config(tmp_path, "dcp-stager", guard_actions={}, background_checkpoints=True, checkpoint_format="dcp",
                 pause_timeout_seconds=5)  # a failed save pauses; a stuck test stops
    patrol = Patrol(model=model, optimizer=opt, config=cfg)
    writer = patrol._control.executor._shard_writer
    stage = writer.stage
    buffers: list[set[int]] = []

    def staged_pointers(state: Any, on_gpu: bool) -> Any:
        staged = stage(state, on_gpu)
        buffers.append({t.data_ptr() for t in staged["model"].values()})
        return staged
    writer.stage = staged_pointers  # type: ignore[method-assign]
    for step in (10, 20):
        train_mlp(patrol, model, opt, step)
        patrol.request("checkpoint", "test")
        patrol.boundary()
        at_step = {k: v.clone() for k, v in model.state_dict().items()}
        patrol._control.executor.wait_for_write()
    assert [(a.outcome, a.step) for a in patrol.actions if a.action == "checkpoint"] == [("ok", 10), ("ok", 20)]
    assert len(buffers) == 2 and buffers[0] == buffers[1]  # the second save copied into the first's buffers
    patrol.close()

    model, opt = mlp(seed=7)
    fresh = Patrol(model=model, optimizer=opt, config=config(tmp_path, "dcp-stager", checkpoint_format="dcp"))
    assert fresh.restore("latest").step == 20
    assert all(torch.equal(v, at_step[k]) for k, v in model.state_dict().items())
    fresh.close()

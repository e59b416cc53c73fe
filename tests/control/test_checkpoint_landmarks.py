"""The checkpoints a team needs are kept and named: the best validation one, the last good one; no temp files."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from resume_loops import config, meta, mlp, mlp_loss

from trainpatrol import Patrol
from trainpatrol.control.checkpoint import Checkpointer, atomic_write


def train(patrol: Patrol, model: torch.nn.Module, opt: torch.optim.Optimizer, until: int, nan_at: int = 0) -> None:
    while patrol.step_count < until:
        patrol.boundary()
        loss = mlp_loss(model) * (float("nan") if patrol.step_count + 1 == nan_at else 1.0)
        loss.backward()
        patrol.step(loss)
        opt.step()
        opt.zero_grad()


def durable(patrol: Patrol) -> None:
    """The report page is rendered in the background: wait for it, as ``close()`` does."""
    patrol._control.executor.wait()


def evidence(patrol: Patrol) -> tuple[dict[str, object], str]:
    durable(patrol)
    bundle = Path(patrol.actions[-1].evidence)
    return json.loads((bundle / "manifest.json").read_text()), (bundle / "report.html").read_text()


def test_the_best_validation_checkpoint_is_kept_and_named_when_validation_diverges(tmp_path: Path) -> None:
    model, opt = mlp()
    patrol = Patrol(model=model, optimizer=opt, config=config(tmp_path, "best", keep_checkpoints=1))
    for step, val in zip((10, 20, 30, 40, 50), (5.0, 4.0, 3.04, 3.5, 8.4), strict=True):
        train(patrol, model, opt, step)
        patrol.evaluate(val)
        patrol.request("checkpoint", "periodic")  # coalesces with a best-loss checkpoint at the same boundary
    train(patrol, model, opt, 55)
    patrol._commands.request("checkpoint", "TrainPatrolValLossDiverging", source="alertmanager",  # as the agent's
                             alert={"labels": {"alertname": "TrainPatrolValLossDiverging", "action": "checkpoint"}})
    train(patrol, model, opt, 56)
    durable(patrol)
    ckpt = Checkpointer(tmp_path / "ckpt")
    assert [p.name for p in ckpt.complete()] == ["step-00000030", "step-00000055"]
    assert meta(ckpt.path_for(30))["best"] == {"validation_loss": 3.04}
    manifest, report = evidence(patrol)
    assert manifest["best_checkpoint"] == str(ckpt.path_for(30)) and manifest["best_validation_loss"] == 3.04
    assert "Best validation checkpoint" in report and str(ckpt.path_for(30)) in report
    patrol.close()

    model, opt = mlp(seed=3)
    again = Patrol(model=model, optimizer=opt, config=config(tmp_path, "best"))
    assert again.restore("latest").step == 55
    again.evaluate(3.5)  # not better than the restored run's best
    assert again._training.best_pending is None
    again.close()


def test_evidence_warns_when_its_checkpoint_is_poisoned_and_names_the_last_good_one(tmp_path: Path) -> None:
    model, opt = mlp()
    patrol = Patrol(model=model, optimizer=opt,
                    config=config(tmp_path, "poison", skip_nonfinite_updates=False, guard_actions={}))
    train(patrol, model, opt, 20)
    patrol.request("checkpoint", "periodic")
    train(patrol, model, opt, 25, nan_at=22)
    patrol.request("capture", "look")
    patrol.request("checkpoint", "after the NaN")
    train(patrol, model, opt, 26)
    manifest, report = evidence(patrol)
    assert manifest["finite"] is False and manifest["nonfinite_count"] == 12
    assert manifest["last_good_checkpoint"] == str(tmp_path / "ckpt" / "step-00000020")
    assert "do not resume from it" in report and "step-00000020" in report
    assert "non-finite" in patrol.actions[-1].detail
    patrol.close()


def test_a_failed_checkpoint_write_leaves_no_temporary_file(tmp_path: Path) -> None:
    def fails(f: object) -> None:
        raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        atomic_write(tmp_path / "state.bin", fails)
    assert list(tmp_path.iterdir()) == []


def test_temporary_files_of_a_write_that_died_are_removed_at_the_next_start(tmp_path: Path) -> None:
    step = tmp_path / "ckpt" / "step-00000007"
    step.mkdir(parents=True)
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    host = socket.gethostname()
    died = step / f".state.bin.tmp-{host}-{int(dead.stdout)}"
    live = step / f".rank-00000.pt.tmp-{host}-{os.getpid()}"  # a write in progress in a live process
    old = step / ".rank-00001.pt.tmp-other-host-12"
    recent = step / ".rank-00002.pt.tmp-other-host-13"
    for f in (died, live, old, recent):
        f.write_bytes(b"partial")
    os.utime(old, (time.time() - 7200, time.time() - 7200))
    Checkpointer(tmp_path / "ckpt")
    assert sorted(p.name for p in step.iterdir()) == sorted([live.name, recent.name])


def test_a_write_killed_mid_way_leaves_only_a_temp_file_that_the_next_start_removes(tmp_path: Path) -> None:
    ckpt = tmp_path / "ckpt" / "step-00000003"
    ckpt.mkdir(parents=True)
    code = ("import os, signal, sys\n"
            "from pathlib import Path\n"
            "from trainpatrol.control.checkpoint import atomic_write\n"
            "def write(f):\n"
            "    f.write(b'half')\n"
            "    f.flush()\n"
            "    os.kill(os.getpid(), signal.SIGKILL)\n"
            f"atomic_write(Path({str(ckpt / 'state.bin')!r}), write)\n")
    assert subprocess.run([sys.executable, "-c", code]).returncode == -9
    assert [p.name.split(".tmp-")[0] for p in ckpt.iterdir()] == [".state.bin"]
    Checkpointer(tmp_path / "ckpt")
    assert list(ckpt.iterdir()) == []


def test_evidence_holds_learning_rates_guard_trips_and_validation_history(tmp_path: Path) -> None:
    model, opt = mlp()
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=5, gamma=0.5)
    patrol = Patrol(model=model, optimizer=opt, config=config(tmp_path, "explain", guard_actions={}))
    for step in range(1, 31):
        patrol.boundary()
        loss = mlp_loss(model) * (1e6 if step == 25 else 1.0)  # a spike the loss guard records
        loss.backward()
        patrol.step(loss)
        opt.step()
        opt.zero_grad()
        sched.step()
        if step % 10 == 0:
            patrol.evaluate(1.0 / step)
    patrol.request("capture", "look")
    patrol.boundary()
    durable(patrol)  # the capture is covered by the best-loss checkpoint of the same boundary
    bundle = Path(patrol.actions[-1].evidence)
    history = json.loads((bundle / "rank-00000" / "history.json").read_text())
    assert [r["learning_rate"] for r in history][:12] == [1e-2] * 5 + [5e-3] * 5 + [2.5e-3] * 2
    extra = json.loads((bundle / "rank-00000" / "extra.json").read_text())
    assert [t["guard"] for t in extra["guard_trips"]] == ["loss_spike", "grad_norm_explosion"]
    assert "at step 25" in extra["guard_trips"][0]["detail"]
    assert [(v["step"], v["value"]) for v in extra["validation_history"]] == [(10, 0.1), (20, 0.05), (30, 1 / 30)]
    report = (bundle / "report.html").read_text()
    assert "Guard trips" in report and "loss_spike" in report and "Validation loss" in report
    patrol.close()

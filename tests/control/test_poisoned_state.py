"""A non-finite step never becomes the state a run resumes from."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
import torch
from resume_loops import config, meta, mlp, mlp_loss, nonfinite_tensors, pause_then_stop, run_until_stopped

from servers import wait_for
from trainpatrol import STOP_EXIT_CODE, Patrol
from trainpatrol.control.checkpoint import Checkpointer


def train_mlp(patrol: Patrol, model: torch.nn.Module, opt: torch.optim.Optimizer, steps: int,
              nan_at: int = 0, checkpoint_at: int = 0) -> None:
    """The README loop with a real DataLoader-free batch source; ``loss * nan`` at step ``nan_at``."""
    while patrol.step_count < steps:
        patrol.boundary()
        loss = mlp_loss(model)
        if patrol.step_count + 1 == nan_at:
            loss = loss * float("nan")
        loss.backward()
        patrol.step(loss)
        opt.step()
        opt.zero_grad()
        if patrol.step_count == checkpoint_at:
            patrol.request("checkpoint", "periodic")


@pytest.mark.parametrize("fused", [False, True], ids=["adam", "fused-adam"])
def test_a_nan_step_leaves_the_pause_checkpoint_finite_and_latest(tmp_path: Path, fused: bool) -> None:
    model, _ = mlp()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2, fused=fused)
    patrol = Patrol(model=model, optimizer=opt, config=config(tmp_path, "nan"))
    assert pause_then_stop(patrol, lambda: train_mlp(patrol, model, opt, 10**6, nan_at=50)) == STOP_EXIT_CODE
    pause = next(a for a in patrol.actions if a.action == "pause")
    assert pause.step == 50
    latest = Checkpointer(tmp_path / "ckpt").latest()
    assert latest is not None and latest.name == "step-00000050"
    assert nonfinite_tensors(latest) == []
    assert meta(latest)["finite"] is True
    assert all(torch.isfinite(p).all() for p in model.parameters())
    patrol.close()


def test_a_skipped_nan_step_does_not_move_weights_or_optimizer_state(tmp_path: Path) -> None:
    model, opt = mlp()
    patrol = Patrol(model=model, optimizer=opt, config=config(tmp_path, "skip", guard_actions={}))
    train_mlp(patrol, model, opt, 20)
    before = [p.detach().clone() for p in model.parameters()]
    steps_before = [int(s["step"]) for s in opt.state.values()]
    train_mlp(patrol, model, opt, 21, nan_at=21)
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))
    assert [int(s["step"]) for s in opt.state.values()] == steps_before
    train_mlp(patrol, model, opt, 22)
    assert not all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))
    patrol.close()


def test_restore_latest_takes_the_newest_finite_checkpoint_and_says_which(tmp_path: Path) -> None:
    model, opt = mlp()
    patrol = Patrol(model=model, optimizer=opt, config=config(tmp_path, "poison", skip_nonfinite_updates=False))
    assert pause_then_stop(patrol, lambda: train_mlp(patrol, model, opt, 10**6, nan_at=50,
                                                     checkpoint_at=31)) == STOP_EXIT_CODE
    patrol.close()
    ckpt = Checkpointer(tmp_path / "ckpt")
    names = [p.name for p in ckpt.complete()]
    assert names == ["step-00000031", "step-00000050"]
    poisoned = ckpt.path_for(50)
    assert sorted(nonfinite_tensors(poisoned))[:2] == ["model:0.bias", "model:0.weight"]
    assert meta(poisoned)["finite"] is False and "model:0.weight" in meta(poisoned)["nonfinite"]
    assert meta(ckpt.path_for(31))["finite"] is True

    model, opt = mlp(seed=5)
    fresh = Patrol(model=model, optimizer=opt, config=config(tmp_path, "poison"))
    restored = fresh.restore("latest")
    assert restored.step == 31 and Path(restored.path).name == "step-00000031"
    assert len(restored.skipped) == 1 and "step-00000050" in restored.skipped[0]
    assert "non-finite" in restored.skipped[0]
    assert all(torch.isfinite(p).all() for p in model.parameters())
    fresh.close()


def test_rotation_never_removes_the_last_finite_checkpoint(tmp_path: Path) -> None:
    model, opt = mlp()
    patrol = Patrol(model=model, optimizer=opt, config=config(tmp_path, "rot", skip_nonfinite_updates=False,
                                                              keep_checkpoints=1, guard_actions={}))
    train_mlp(patrol, model, opt, 10, checkpoint_at=10)
    train_mlp(patrol, model, opt, 12, nan_at=11)  # poisons the weights for good
    for step in (13, 14, 15):
        patrol.request("checkpoint", "periodic")
        train_mlp(patrol, model, opt, step)
    names = [p.name for p in Checkpointer(tmp_path / "ckpt").complete()]
    assert names == ["step-00000010", "step-00000014"]
    restored = patrol.restore("latest")
    assert restored.step == 10
    patrol.close()


def test_restore_with_no_checkpoint_says_there_is_nothing_to_restore(tmp_path: Path) -> None:
    model, opt = mlp()
    patrol = Patrol(model=model, optimizer=opt, config=config(tmp_path, "empty"))
    before = [p.detach().clone() for p in model.parameters()]
    restored = patrol.restore("latest")
    assert not restored
    assert restored.step == 0 and restored.path == ""
    assert "nothing to restore" in restored.reason
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))
    patrol.close()


def test_repeated_pauses_of_a_nonfinite_run_save_its_state_once(tmp_path: Path) -> None:
    """An operator resumes a run whose weights are NaN again and again; each resume pauses again at once (the
    guards are re-armed), and none of those pauses writes the non-finite state a second time."""
    model, opt = mlp()
    patrol = Patrol(model=model, optimizer=opt, config=config(tmp_path, "sick", skip_nonfinite_updates=False,
                                                               guard_actions={"nonfinite_loss": "pause"}))
    result: list[int | None] = []
    t = threading.Thread(target=lambda: result.append(run_until_stopped(
        lambda: train_mlp(patrol, model, opt, 10**6, nan_at=50, checkpoint_at=31))), daemon=True)
    t.start()
    for n in range(1, 7):
        wait_for(lambda n=n: [a.action for a in patrol.actions].count("pause") == n and patrol.state == "paused",
                 30, what=f"pause {n}")
        patrol.request("resume", f"the operator, {n}th time")
    wait_for(lambda: [a.action for a in patrol.actions].count("pause") == 7 and patrol.state == "paused", 30,
             what="pause 7")
    patrol.request("stop", "test over")
    t.join(120)  # a stop waits for the eight reports, each rendered by a child process in turn
    assert result == [STOP_EXIT_CODE]
    patrol.close()
    ckpt = Checkpointer(tmp_path / "ckpt")
    assert [p.name for p in ckpt.complete()] == ["step-00000031", "step-00000050"]
    pauses = [a for a in patrol.actions if a.action in ("pause", "stop")]
    assert [a.outcome for a in pauses] == ["ok"] * 8
    assert pauses[0].checkpoint.endswith("step-00000050")
    for later in pauses[1:]:
        assert later.checkpoint.endswith("step-00000050") and "not written again" in later.detail


def test_pinned_checkpoints_are_capped_and_the_newest_finite_one_stays(tmp_path: Path) -> None:
    model, opt = mlp()
    patrol = Patrol(model=model, optimizer=opt, config=config(tmp_path, "cap", keep_pinned_checkpoints=2,
                                                               guard_actions={}))
    result: list[int | None] = []
    t = threading.Thread(target=lambda: result.append(run_until_stopped(
        lambda: train_mlp(patrol, model, opt, 10**6))), daemon=True)
    t.start()
    last = 0
    for _ in range(4):  # four pauses, each resumed, then a stop: five pinned checkpoints at five steps
        # each after some training since the last: one at the same step would be that checkpoint again
        wait_for(lambda last=last: patrol.step_count >= last + 10, 30, what="training")
        patrol.request("pause", "the operator")
        wait_for(lambda: patrol.state == "paused", 30, what="paused")
        last = patrol.step_count
        patrol.request("resume", "the operator")
        wait_for(lambda: patrol.state == "running", 30, what="resumed")
    wait_for(lambda: patrol.step_count >= last + 10, 30, what="training")
    patrol.request("stop", "test over")
    t.join(120)  # a stop waits for every report, each rendered by a child process in turn
    assert result == [STOP_EXIT_CODE]
    patrol.close()
    pinned = [p.name for p in Checkpointer(tmp_path / "ckpt").complete() if meta(p)["pinned"]]
    steps = [a.step for a in patrol.actions if a.action in ("pause", "stop")]
    assert len(steps) == 5 and pinned == [f"step-{s:08d}" for s in steps[-2:]]

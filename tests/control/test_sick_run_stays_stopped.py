"""After a person resumes a paused run, a fault that persists (or comes back) stops it again."""

from __future__ import annotations

import threading
from pathlib import Path

import torch
from resume_loops import config, mlp, mlp_loss, pause_then_stop, run_until_stopped

from servers import wait_for
from trainpatrol import STOP_EXIT_CODE, Patrol, PatrolConfig


def sick_from(patrol: Patrol, model: torch.nn.Module, opt: torch.optim.Optimizer, first_bad: int) -> None:
    """Every step from ``first_bad`` on has a NaN loss (a corrupted shard, a diverged scale)."""
    while True:
        patrol.boundary()
        loss = mlp_loss(model)
        if patrol.step_count + 1 >= first_bad:
            loss = loss * float("nan")
        loss.backward()
        patrol.step(loss)
        opt.step()
        opt.zero_grad()


def test_a_resumed_run_whose_loss_is_still_nan_pauses_again_at_its_next_step(tmp_path: Path) -> None:
    model, opt = mlp()
    patrol = Patrol(model=model, optimizer=opt, config=config(tmp_path, "sick"))
    result: list[int | None] = []
    t = threading.Thread(target=lambda: result.append(run_until_stopped(lambda: sick_from(patrol, model, opt, 40))),
                         daemon=True)
    t.start()
    wait_for(lambda: patrol.state == "paused", 30, what="first pause")
    assert patrol.step_count == 40
    for expected in (41, 42):
        patrol.request("resume", "a person")
        wait_for(lambda at=expected: [a.step for a in patrol.actions if a.action == "pause"][-1:] == [at], 30,
                 what=f"pause again at {expected}")
        assert patrol.state == "paused"
    resumes = [a for a in patrol.actions if a.action == "resume"]
    assert "act again" in resumes[0].detail and "nonfinite_loss -> pause" in resumes[0].detail
    patrol.request("stop", "end")
    t.join(30)
    assert result == [STOP_EXIT_CODE]
    assert all(torch.isfinite(p).all() for p in model.parameters())  # every NaN update was skipped
    patrol.close()


def test_a_nan_loss_with_a_finite_grad_norm_pauses_by_the_loss_guard_alone(tmp_path: Path) -> None:
    cfg = config(tmp_path, "loss-only", guard_actions={"nonfinite_loss": "pause"})
    for grad_norm in (torch.tensor(0.5), None):
        patrol = Patrol(config=PatrolConfig(**{**cfg.__dict__, "run": f"loss-only-{grad_norm is None}"}),
                        device="cpu")

        def loop(p: Patrol = patrol, gn: torch.Tensor | None = grad_norm) -> None:
            for i in range(10**6):
                p.boundary()
                p.step(torch.tensor(float("nan") if i == 9 else 1.0), grad_norm=gn)

        assert pause_then_stop(patrol, loop) == STOP_EXIT_CODE
        assert [(a.action, a.step) for a in patrol.actions] == [("pause", 10), ("stop", 10)]
        assert patrol._guards.trips["nonfinite_grad"] == 0 and patrol._guards.trips["nonfinite_loss"] == 1
        patrol.close()


def test_the_pause_report_says_what_a_resume_does_if_the_fault_persists(tmp_path: Path) -> None:
    model, opt = mlp()
    patrol = Patrol(model=model, optimizer=opt, config=config(tmp_path, "report"))
    assert pause_then_stop(patrol, lambda: sick_from(patrol, model, opt, 5)) == STOP_EXIT_CODE
    pause = next(a for a in patrol.actions if a.action == "pause")
    report = (Path(pause.evidence) / "report.html").read_text()
    assert "if the fault persists, or comes back, they act again" in report
    assert "<code>nonfinite_loss</code> → pause" in report
    patrol.close()

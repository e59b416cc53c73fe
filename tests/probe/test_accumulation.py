"""Gradient accumulation in a plain loop: the unscaled loss, every backward pass, and the pre-clip norm."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch
from resume_loops import config, mlp

from trainpatrol import Patrol

ACCUM = 4


def accumulate(patrol: Patrol, model: torch.nn.Module, opt: torch.optim.Optimizer, steps: int,
               clip_first: bool) -> list[tuple[float, float]]:
    """The README's accumulation loop; returns each optimizer step's (mean unscaled loss, pre-clip norm)."""
    truth = []
    g = torch.Generator().manual_seed(3)
    for _ in range(steps):
        losses = []
        for _ in range(ACCUM):
            x = torch.randn(16, 8, generator=g) * 3
            loss = ((model(x) - x.sum(dim=1, keepdim=True)) ** 2).mean()
            (loss / ACCUM).backward()  # what is back-propagated is scaled...
            losses.append(loss.item())
            if len(losses) < ACCUM:
                patrol.step(loss)  # ...what Patrol gets is not
        if clip_first:  # the mistake: the norm Patrol reads itself is then the clipped one
            total = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            patrol.step(loss)
        else:
            patrol.step(loss, grad_norm=(total := torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)))
        opt.step()
        opt.zero_grad()
        truth.append((sum(losses) / ACCUM, float(total)))
    return truth


def test_the_accumulation_loop_exports_the_unscaled_loss_every_backward_pass_and_the_pre_clip_norm(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    model, opt = mlp()
    patrol = Patrol(model=model, optimizer=opt, config=config(tmp_path, "accum", grad_accum_steps=ACCUM,
                                                              guard_actions={}))
    with caplog.at_level(logging.WARNING, logger="trainpatrol"):
        truth = accumulate(patrol, model, opt, 12, clip_first=False)
        patrol._report.snapshot()  # folds the last CPU steps in
    assert patrol.step_count == 12 and patrol._totals.micro_steps == 12 * ACCUM
    for step, (loss, norm) in enumerate(truth, start=1):
        rec = patrol._history.get(step)
        assert rec is not None
        assert rec.loss == pytest.approx(loss, rel=1e-6) and rec.grad_norm == pytest.approx(norm, rel=1e-6)
    assert max(n for _, n in truth) > 3  # the norm Patrol exports is above the clip threshold
    assert "looks clipped" not in caplog.text
    patrol.close()


def test_a_norm_read_after_clipping_is_warned_about_once(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    model, opt = mlp()
    patrol = Patrol(model=model, optimizer=opt, config=config(tmp_path, "clipped", grad_accum_steps=ACCUM,
                                                              guard_actions={}))
    with caplog.at_level(logging.WARNING, logger="trainpatrol"):
        accumulate(patrol, model, opt, 20, clip_first=True)
        patrol._report.snapshot()
    warnings = [r.getMessage() for r in caplog.records if "looks clipped" in r.getMessage()]
    assert len(warnings) == 1 and "read 1 on 8 steps in a row" in warnings[0]
    patrol.close()

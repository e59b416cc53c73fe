"""What the framework callbacks share."""

from __future__ import annotations

from ..probe.config import PatrolConfig
from ..probe.patrol import Patrol
from ..protocol import ActionRecord


def check_accum(cfg: PatrolConfig, framework: str) -> PatrolConfig:
    if cfg.grad_accum_steps != 1:
        raise ValueError(f"`PatrolConfig(grad_accum_steps={cfg.grad_accum_steps!r})`: the callback steps the Patrol "
                         f"once per optimizer step and reads {framework}'s accumulation itself; leave it at 1.")
    return cfg


def new_actions(patrol: Patrol, before: ActionRecord | None) -> list[ActionRecord]:
    """The action records the Patrol added after ``before``, oldest first."""
    new: list[ActionRecord] = []
    for rec in reversed(patrol.actions):
        if rec is before:
            break
        new.append(rec)
    return new[::-1]

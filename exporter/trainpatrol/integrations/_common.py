"""What the framework callbacks share."""

from __future__ import annotations

from dataclasses import replace
from itertools import takewhile
from typing import Any

from ..actions import STOP_EXIT_CODE
from ..probe.config import PatrolConfig
from ..probe.patrol import Patrol


def patrol_or_config(patrol: Patrol | PatrolConfig | None, config: dict[str, Any],
                     framework: str) -> tuple[Patrol | None, PatrolConfig | None]:
    """The Patrol given to a callback, or the config of the one it builds from ``patrol`` and keywords."""
    if isinstance(patrol, Patrol):
        if config:
            raise TypeError(f"`TrainPatrolCallback(patrol, {', '.join(config)}=...)`: keywords configure a "
                            "Patrol the callback builds; pass a PatrolConfig instead of a Patrol.")
        cfg = patrol.config
    else:
        cfg = replace(patrol or PatrolConfig(), **config).validate()
    if cfg.grad_accum_steps != 1:
        raise ValueError(f"`PatrolConfig(grad_accum_steps={cfg.grad_accum_steps!r})`: the callback steps the Patrol "
                         f"once per optimizer step and reads {framework}'s accumulation itself; leave it at 1.")
    return (patrol, None) if isinstance(patrol, Patrol) else (None, cfg)


def boundary(patrol: Patrol) -> tuple[bool, bool]:
    """Carry out the agreed actions; returns whether the ranks agreed to stop, and whether a checkpoint was
    written (then the framework writes its own resumable one at the same step)."""
    before = patrol.actions[-1] if patrol.actions else None
    try:
        patrol.boundary()
    except SystemExit as exc:
        if exc.code != STOP_EXIT_CODE:
            raise
        return True, False
    new = takewhile(lambda rec: rec is not before, reversed(patrol.actions))
    return False, any(rec.action == "checkpoint" and rec.outcome == "ok" for rec in new)

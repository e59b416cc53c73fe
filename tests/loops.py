"""Instrumented training loops with scripted, known values, shared by tests."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch

from trainpatrol import Patrol, PatrolConfig


def scripted_patrol(tmp: Any, agent_url: str = "http://127.0.0.1:9", **overrides: Any) -> Patrol:
    """A Patrol with no model: the test passes loss and grad norm itself."""
    cfg = PatrolConfig(run=overrides.pop("run", "test"), agent_url=agent_url, embedded_agent=False,
                       checkpoint_dir=str(tmp / "ckpt"), evidence_dir=str(tmp / "evidence"),
                       push_interval_seconds=overrides.pop("push_interval_seconds", 3600.0), **overrides)
    return Patrol(config=cfg, device="cpu")


def run_scripted(patrol: Patrol, losses: Sequence[float], grad_norms: Sequence[float] | None = None,
                 batch_size: int = 8) -> None:
    for i, value in enumerate(losses):
        patrol.boundary()
        gn = None if grad_norms is None else torch.tensor(grad_norms[i])
        patrol.step(torch.tensor(value), grad_norm=gn, batch_size=batch_size)


def losses_with_nan(n: int, nan_at: int) -> list[float]:
    """1.0, 0.99, ... with a NaN at 1-based step ``nan_at``."""
    return [math.nan if i + 1 == nan_at else 1.0 - 0.01 * i for i in range(n)]

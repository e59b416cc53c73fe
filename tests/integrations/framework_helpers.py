"""What the Hugging Face and Lightning tests share: a Patrol config and reading /metrics."""

from __future__ import annotations

from pathlib import Path

from servers import http_get
from trainpatrol import PatrolConfig


def patrol_config(tmp: Path, url: str, run: str) -> PatrolConfig:
    return PatrolConfig(run=run, agent_url=url, embedded_agent=False, push_interval_seconds=0.1,
                        checkpoint_dir=str(tmp / "patrol-ckpt"), evidence_dir=str(tmp / "evidence"))


def exposed(url: str, name: str, run: str, extra: str = "", rank: int = 0) -> float:
    prefix = f'{name}{{{extra}rank="{rank}",run="{run}"}} '
    for line in http_get(url + "/metrics").decode().splitlines():
        if line.startswith(prefix):
            return float(line[len(prefix):])
    raise AssertionError(f"{prefix!r} not exposed")


def run_value(url: str, name: str, run: str) -> float:
    """A series the agent serves once per run."""
    prefix = f'{name}{{run="{run}"}} '
    for line in http_get(url + "/metrics").decode().splitlines():
        if line.startswith(prefix):
            return float(line[len(prefix):])
    raise AssertionError(f"{prefix!r} not exposed")

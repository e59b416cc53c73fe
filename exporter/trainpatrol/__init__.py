"""trainpatrol: a training-health monitor for PyTorch that stops a sick run cleanly."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__all__ = ["STOP_EXIT_CODE", "Patrol", "PatrolConfig", "__version__", "measure_flops"]

from ._version import __version__
from .actions import STOP_EXIT_CODE

if TYPE_CHECKING:
    from .probe.config import PatrolConfig
    from .probe.flops import measure_flops
    from .probe.patrol import Patrol


def __getattr__(name: str) -> Any:
    # torch is imported only when the training side is used, so the agent starts fast without it
    if name == "Patrol":
        from .probe.patrol import Patrol

        return Patrol
    if name == "PatrolConfig":
        from .probe.config import PatrolConfig

        return PatrolConfig
    if name == "measure_flops":
        from .probe.flops import measure_flops

        return measure_flops
    raise AttributeError(name)

"""torch is the user's: ``pip install trainpatrol`` does not pull it, so the training side says how to get it."""

from __future__ import annotations

import importlib.util

MISSING = ("trainpatrol's training side (Patrol, trainpatrol.probe, the demo) needs PyTorch, which is not installed: "
           "install the torch build for your machine (https://pytorch.org/get-started/locally/), e.g. "
           "`pip install torch`. The agent, `trainpatrol export` and `trainpatrol report` run without it.")


def require_torch() -> None:
    """Raise an ImportError that says how to install torch when it is missing."""
    if importlib.util.find_spec("torch") is None:
        raise ImportError(MISSING, name="torch")

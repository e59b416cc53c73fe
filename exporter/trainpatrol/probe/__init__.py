"""Patrol, the training side: it runs in the user's training process, on the user's torch."""

from __future__ import annotations

from .._torch import require_torch

require_torch()

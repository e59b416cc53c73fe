"""Issue 10 on two GPUs over NCCL: same-step pause, resume, stop and restore, and a NaN on rank 1."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parents[1] / "control"))
from ddp_scenarios import nan_on_rank_one_pauses_both, pause_resume_stop_and_restore

pytestmark = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")


def test_pause_resume_stop_and_restore_over_nccl(tmp_path: Path) -> None:
    pause_resume_stop_and_restore(tmp_path, "cuda")


def test_nan_on_rank_one_pauses_both_over_nccl(tmp_path: Path) -> None:
    nan_on_rank_one_pauses_both(tmp_path, "cuda")

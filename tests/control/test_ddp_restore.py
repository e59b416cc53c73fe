"""The two-rank scenarios of the GPU proof, on CPU with gloo, so CI catches what the GPU run would."""

from __future__ import annotations

from pathlib import Path

from ddp_scenarios import pause_resume_stop_and_restore


def test_two_rank_pause_resume_stop_and_restore_on_gloo(tmp_path: Path) -> None:
    pause_resume_stop_and_restore(tmp_path, "cpu")

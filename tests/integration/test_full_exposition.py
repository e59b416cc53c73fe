"""The agent's whole /metrics, with 8 GPUs and several ranks, passes ``promtool check metrics``."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from loops import run_scripted, scripted_patrol
from markers import needs_promtool
from nvml_fake import FIXTURE
from servers import PROMTOOL, agent, http_get, wait_for

RANKS = 3


@needs_promtool
def test_a_full_exposition_of_8_gpus_and_3_ranks_passes_promtool(tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    with agent(tmp_path, "--nvml-fake", str(FIXTURE), "--nvml-pcie", "--nvml-processes") as url:
        monkeypatch.setenv("WORLD_SIZE", str(RANKS))
        for rank in range(RANKS):
            monkeypatch.setenv("RANK", str(rank))
            monkeypatch.setenv("LOCAL_RANK", str(rank))
            patrol = scripted_patrol(tmp_path / f"rank{rank}", url, run="full")
            run_scripted(patrol, [2.0 - rank / 8 - step / 64 for step in range(10)])
            patrol.close()  # the final push, taken in before close returns
        body = wait_for(lambda: b if (b := http_get(url + "/metrics")).count(b"trainpatrol_gpu_power_watts{") == 8
                        else None, 20, what="an NVML sample of 8 GPUs")
    assert [body.count(f'trainpatrol_step_total{{rank="{r}",run="full"}} 10.0\n'.encode()) for r in range(RANKS)] \
        == [1] * RANKS
    assert body.count(b'trainpatrol_collector_success{collector="nvml"} 1.0\n') == 1
    assert b"trainpatrol_gpu_pcie_throughput_bytes_per_second{" in body
    assert PROMTOOL is not None
    result = subprocess.run([PROMTOOL, "check", "metrics"], input=body, capture_output=True, timeout=30)
    assert result.returncode == 0, result.stdout.decode() + result.stderr.decode()
    assert result.stdout.strip() == b"" and result.stderr.strip() == b""

"""The agent's whole /metrics, with 8 GPUs and several ranks or hostile label values, passes
``promtool check metrics`` and parses back to what was pushed."""

from __future__ import annotations

import subprocess
import urllib.error
from pathlib import Path

import pytest

from exposition_check import assert_clean, value
from loops import run_scripted, scripted_patrol
from markers import needs_promtool
from nvml_fake import FIXTURE
from servers import PROMTOOL, agent, http_get, http_json, wait_for

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
        == [1] * RANKS, [ln for ln in body.decode().splitlines() if ln.startswith(("trainpatrol_step_total{",
                                                                                     "trainpatrol_pushes_total{"))]
    assert body.count(b'trainpatrol_collector_success{collector="nvml"} 1.0\n') == 1
    assert b"trainpatrol_gpu_pcie_throughput_bytes_per_second{" in body
    assert PROMTOOL is not None
    result = subprocess.run([PROMTOOL, "check", "metrics"], input=body, capture_output=True, timeout=30)
    assert result.returncode == 0, result.stdout.decode() + result.stderr.decode()
    assert result.stdout.strip() == b"" and result.stderr.strip() == b""


HOSTILE = 'a \\ back"slash\\n "quote" % %s \\\\'
"""Printable, so the protocol takes it: backslashes (one before an ``n``), quotes and ``%``."""


def test_hostile_label_values_pushed_to_a_real_agent_parse_back_exactly(tmp_path: Path) -> None:
    info = {"local_rank": "0", "world_size": "1", "host": HOSTILE, "gpu_uuid": "GPU-" + HOSTILE, "device": "cuda:0",
            "torch_version": "2", "cuda_version": "13", "trainpatrol_version": "0", "launcher": "", "launcher_job": ""}
    push = {"run": "hostile", "rank": 0, "samples": [
        {"name": "trainpatrol_guard_trips_total", "labels": {"guard": HOSTILE}, "value": 2.0},
        {"name": "trainpatrol_rank_info", "labels": info, "value": 1.0}]}
    with agent(tmp_path, "--no-nvml") as url:
        http_json(url + "/v1/push", push)
        newline = {**push, "rank": 0, "samples": [
            {"name": "trainpatrol_guard_trips_total", "labels": {"guard": "one\ntwo"}, "value": 9.0}]}
        with pytest.raises(urllib.error.HTTPError) as refused:
            http_json(url + "/v1/push", newline)
        body = http_get(url + "/metrics")
    assert refused.value.code == 422
    assert value(body, "trainpatrol_guard_trips_total", {"run": "hostile", "rank": "0", "guard": HOSTILE}) == 2.0
    assert value(body, "trainpatrol_rank_info", {"run": "hostile", "rank": "0", **info}) == 1.0
    assert b'guard="one' not in body and value(body, "trainpatrol_pushes_total", {"outcome": "invalid"}) == 1.0
    assert_clean(body)

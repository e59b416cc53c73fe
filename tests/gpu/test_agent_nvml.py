"""Issue 4 on a real GPU: the agent serves real NVML readings next to a real rank."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import torch

from servers import PROMTOOL, agent, http_get, wait_for
from trainpatrol import Patrol, PatrolConfig


def test_agent_with_real_nvml_joins_rank_on_uuid(tmp_path: Path) -> None:
    with agent(tmp_path, "--nvml-interval", "0.5", "--nvml-processes") as url:
        dev = torch.device("cuda", 0)
        patrol = Patrol(device=dev, config=PatrolConfig(run="gpu-agent", agent_url=url, embedded_agent=False,
                                                       push_interval_seconds=0.2))
        for _ in range(20):
            patrol.step(torch.ones((), device=dev))
        def ready() -> str | None:
            b = http_get(url + "/metrics").decode()
            return b if 'trainpatrol_collector_success{collector="nvml"} 1.0' in b and "gpu-agent" in b else None

        body = wait_for(ready, 20, what="nvml sample and rank")
        patrol.close()
    uuid = patrol._identity.gpu_uuid
    assert f'gpu_uuid="{uuid}"' in body
    assert 'trainpatrol_gpu_info{' in body and f'uuid="{uuid}"' in body
    for name in ("trainpatrol_gpu_power_watts", "trainpatrol_gpu_energy_joules_total",
                 "trainpatrol_gpu_temperature_celsius", "trainpatrol_gpu_clock_hertz",
                 "trainpatrol_gpu_memory_total_bytes", "trainpatrol_gpu_utilization_ratio",
                 "trainpatrol_gpu_clock_event_active"):
        assert f"\n{name}{{" in body, name
    out = os.environ.get("OUT")
    if out:
        Path(out, "agent_metrics_h200.txt").write_text(body)
    if PROMTOOL:
        r = subprocess.run([PROMTOOL, "check", "metrics"], input=body.encode(), capture_output=True)
        assert r.returncode == 0, r.stdout + r.stderr

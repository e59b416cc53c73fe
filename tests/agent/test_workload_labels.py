"""A rank's workload identity on every one of its series, end to end from a Patrol to /metrics."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from loops import run_scripted, scripted_patrol
from servers import agent_in_thread, http_get
from trainpatrol.agent.app import Agent
from trainpatrol.agent.config import AgentConfig

POD = {"TRAINPATROL_KUBERNETES": "1", "POD_NAMESPACE": "team-a", "POD_NAME": "llm-worker-1",
       "CONTAINER_NAME": "trainer", "NODE_NAME": "gpu-node-12", "JOBSET_NAME": "llm-7b"}
WORKLOAD = {"namespace": "team-a", "pod": "llm-worker-1", "container": "trainer", "node": "gpu-node-12"}


def _rank_series(body: str) -> dict[str, list[dict[str, str]]]:
    out: dict[str, list[dict[str, str]]] = {}
    for family in text_string_to_metric_families(body):
        for s in family.samples:
            if "run" in s.labels:
                out.setdefault(s.name, []).append(dict(s.labels))
    return out


def test_every_series_of_a_rank_in_a_pod_carries_its_namespace_pod_container_and_node(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    agent = Agent(AgentConfig(nvml=False))
    with agent_in_thread(agent.app) as port:
        for key, value in POD.items():
            monkeypatch.setenv(key, value)
        in_pod = scripted_patrol(tmp_path / "a", f"http://127.0.0.1:{port}", run="shared-name")
        for key in POD:
            monkeypatch.delenv(key)
        monkeypatch.setenv("TRAINPATROL_KUBERNETES", "0")
        on_host = scripted_patrol(tmp_path / "b", f"http://127.0.0.1:{port}", run="other-run")
        try:
            for patrol in (in_pod, on_host):
                run_scripted(patrol, [2.0, 1.5, 1.25])
                assert patrol._publisher.push_now()
            body = http_get(f"http://127.0.0.1:{port}/metrics").decode()
        finally:
            in_pod.close()
            on_host.close()
    series = _rank_series(body)
    assert len(series) > 20
    for name, label_sets in series.items():
        pod_sets = [s for s in label_sets if s["run"] == "shared-name"]
        host_sets = [s for s in label_sets if s["run"] == "other-run"]
        assert pod_sets and host_sets, name
        if name.startswith("trainpatrol_run_"):  # once per run: the run is named by its namespace, not a pod
            assert all(s["namespace"] == WORKLOAD["namespace"] and "pod" not in s for s in pod_sets), name
            continue
        assert all(s.items() >= WORKLOAD.items() for s in pod_sets), name
        assert all(not s.keys() & WORKLOAD.keys() for s in host_sets), name
    info = next(s for s in series["trainpatrol_rank_info"] if s["run"] == "shared-name")
    assert (info["launcher"], info["launcher_job"]) == ("jobset", "llm-7b")
    assert next(s for s in series["trainpatrol_rank_info"] if s["run"] == "other-run")["launcher"] == ""
    assert 'trainpatrol_loss{container="trainer",namespace="team-a",node="gpu-node-12",pod="llm-worker-1",' \
           'rank="0",run="shared-name"} 1.25\n' in body
    check = subprocess.run(["promtool", "check", "metrics"], input=body.encode(), capture_output=True, timeout=30)
    assert check.returncode == 0, check.stderr.decode()

"""An agent with a token, and clients that push as a rank would: from loopback or from another host."""

from __future__ import annotations

import threading
import time
from typing import Any

from fastapi.testclient import TestClient

from fake_clock import Clock
from servers import http_json
from trainpatrol.agent.app import Agent
from trainpatrol.agent.config import AgentConfig

TOKEN = "agent-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
KEY_HEADER = "X-Trainpatrol-Run-Key"
LOOPBACK = ("127.0.0.1", 40000)


def make_agent(clock: Clock | None = None, **overrides: Any) -> Agent:
    config = AgentConfig(token=TOKEN, nvml=False, **overrides).load()
    return Agent(config, clock=clock) if clock is not None else Agent(config)


def loopback(agent: Agent) -> TestClient:
    """A client on 127.0.0.1: pushes need no agent token from here."""
    return TestClient(agent.app, client=LOOPBACK, base_url="http://localhost")


def snapshot(run: str = "train", rank: int = 0, *, namespace: str = "", world_size: int = 2,
             **extra: Any) -> dict[str, Any]:
    return {"run": run, "rank": rank, "world_size": world_size, "namespace": namespace,
            "step": extra.pop("step", 5), **extra}


def push(client: TestClient, key: str = "", headers: dict[str, str] | None = None, **fields: Any) -> Any:
    h = dict(headers or {})
    if key:
        h[KEY_HEADER] = key
    return client.post("/v1/push", json=snapshot(**fields), headers=h)


def now_rfc3339() -> str:
    """The wall clock as Alertmanager writes times, from one reading: two could straddle a second and write a time
    a second early (an alert that then predates its run's key)."""
    now = time.time()
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(now)) + f".{int(now % 1 * 1e6):06d}Z"


def alert(fp: str, *, action: str = "pause", run: str = "train", namespace: str = "",
          alertname: str = "TrainPatrolNonFiniteLoss", starts: str = "", **labels: str) -> dict[str, Any]:
    """An alert as Alertmanager sends it; it began firing now unless ``starts`` says when."""
    starts = starts or now_rfc3339()
    all_labels = {"alertname": alertname, "run": run, "action": action, "severity": "critical", **labels}
    if namespace:
        all_labels["namespace"] = namespace
    return {"status": "firing", "labels": all_labels, "annotations": {"summary": "x."}, "startsAt": starts,
            "endsAt": "0001-01-01T00:00:00Z", "generatorURL": "", "fingerprint": fp}


def payload(*alerts: dict[str, Any]) -> dict[str, Any]:
    return {"version": "4", "groupKey": "g", "truncatedAlerts": 0, "status": "firing", "receiver": "trainpatrol",
            "groupLabels": {}, "commonLabels": {}, "commonAnnotations": {}, "externalURL": "", "alerts": list(alerts)}


def counter(agent: Agent, family: str, **labels: str) -> float:
    """One sample of the agent's /metrics, 0 when absent."""
    from prometheus_client.parser import text_string_to_metric_families

    for fam in text_string_to_metric_families(agent.registry.body().data.decode()):
        for s in fam.samples:
            if s.name == family and s.labels == labels:
                return s.value
    return 0.0


class GpuRank:
    """Pushes a bare rank of ``run`` bound to the GPU ``gpu_uuid`` twice a second, standing in for a rank on a
    GPU: its identity (``trainpatrol_rank_info``), so the rules and panels that join GPUs to ranks have one, and
    its tokens with GPT-2-124M's training FLOPs per token and an H200's bf16 peak, so MFU has one. It belongs to
    a job that torchrun restarted once (``restart_count``), so the restart annotation has one. A context manager:
    pushing from enter to exit."""

    def __init__(self, agent_url: str, gpu_uuid: str, run: str) -> None:
        self.url, self.uuid, self.run = agent_url, gpu_uuid, run
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._loop, daemon=True)

    def _loop(self) -> None:
        info = {"local_rank": "0", "world_size": "1", "host": "gpu-host", "gpu_uuid": self.uuid, "device": "cuda:0",
                "torch_version": "", "cuda_version": "", "trainpatrol_version": "", "launcher": "", "launcher_job": ""}
        seq = 0
        while not self.stop.is_set():
            seq += 1
            http_json(f"{self.url}/v1/push", {
                "run": self.run, "rank": 0, "world_size": 1, "host": "gpu-host", "gpu_uuid": self.uuid, "seq": seq,
                "restart_count": 1, "model_flops_per_token": 6 * 124e6, "peak_flops": 989.4e12, "compute_dtype": "bf16",
                "time": time.time(), "step": seq,
                "samples": [{"name": "trainpatrol_rank_info", "labels": info, "value": 1.0},
                            {"name": "trainpatrol_tokens_total", "labels": {}, "value": 8 * 1024 * seq}]})
            self.stop.wait(0.5)

    def __enter__(self) -> GpuRank:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        self.thread.join(timeout=5)

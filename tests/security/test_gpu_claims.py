"""A rank names only a GPU of its agent's node: a push claiming a GPU the node's NVML does not list
(another run's, elsewhere) is refused, so that GPU's XID alerts cannot be put on the claimer's run."""

from __future__ import annotations

from fastapi.testclient import TestClient

from nvml_fake.fake import FakeNvml
from rank_client import LOOPBACK, counter
from trainpatrol.agent.app import Agent
from trainpatrol.agent.config import AgentConfig
from trainpatrol.collectors.nvml import NvmlCollector

INFO = {"local_rank": "0", "world_size": "1", "host": "n1", "device": "cuda:0", "torch_version": "2",
        "cuda_version": "13", "trainpatrol_version": "0", "launcher": "", "launcher_job": ""}


def push(client: TestClient, run: str, uuid: str, info_uuid: str | None = None) -> int:
    info = {"name": "trainpatrol_rank_info", "labels": {**INFO, "gpu_uuid": info_uuid or uuid}, "value": 1.0}
    body = {"run": run, "rank": 0, "world_size": 1, "gpu_uuid": uuid, "samples": [info]}
    return client.post("/v1/push", json=body, headers={"X-Trainpatrol-Run-Key": run}).status_code


def test_a_push_claiming_a_gpu_this_node_does_not_have_is_refused() -> None:
    nvml = NvmlCollector(FakeNvml.from_fixture(gpus=2))
    nvml.sample_once()
    agent = Agent(AgentConfig(nvml=False).load(), nvml=nvml)
    client = TestClient(agent.app, client=LOOPBACK, base_url="http://localhost")
    ours, theirs = sorted(nvml.uuids())[0], "GPU-00000000-dead-beef-0000-000000000000"
    assert push(client, "llama", ours) == 200
    assert push(client, "zzz-evil", theirs) == 422
    assert push(client, "zzz-evil", ours, info_uuid=theirs) == 422  # the join reads rank_info's label
    assert [e.snapshot.run for e in agent.store.entries()] == ["llama"]
    assert counter(agent, "trainpatrol_refused_requests_total", reason="foreign_gpu") == 2.0

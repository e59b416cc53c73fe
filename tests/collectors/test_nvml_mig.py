"""A GPU in MIG mode: one series set per MIG instance, and ranks on a slice join them by its uuid."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from exposition_check import Scraped
from markers import needs_prometheus
from nvml_fake.fake import FakeNvml, MigInstance
from servers import agent_in_thread, http_json, prometheus, query, wait_for
from trainpatrol.agent.app import Agent
from trainpatrol.agent.config import AgentConfig
from trainpatrol.collectors.nvml import NvmlCollector
from trainpatrol.collectors.registry import Registry

GIB = 1 << 30
SLICES = (MigInstance(gpu_instance=9, compute_instance=0, profile="1g.18gb", total_bytes=16 * GIB, used_bytes=3 * GIB),
          MigInstance(gpu_instance=2, compute_instance=0, profile="3g.71gb", total_bytes=66 * GIB, used_bytes=40 * GIB))


def mig_gpu() -> tuple[FakeNvml, NvmlCollector]:
    fake = FakeNvml.from_fixture(gpus=2)
    fake.enable_mig(1, SLICES)
    fake.nvmlInit()  # the test's own reference, to read the uuids the collector will see
    return fake, NvmlCollector(fake, interval_seconds=0.05)


def test_each_mig_instance_has_its_uuid_profile_and_memory(caplog: pytest.LogCaptureFixture) -> None:
    fake, collector = mig_gpu()
    registry = Scraped(Registry({"nvml": collector}))
    with caplog.at_level(logging.DEBUG, logger="trainpatrol"):
        collector.sample_once()
    parent = {"gpu": "1", "uuid": fake.nvmlDeviceGetUUID(fake.nvmlDeviceGetHandleByIndex(1))}
    slices = [fake.nvmlDeviceGetMigDeviceHandleByIndex(fake.nvmlDeviceGetHandleByIndex(1), i) for i in (0, 1)]
    uuids = [fake.nvmlDeviceGetUUID(h) for h in slices]
    assert all(u.startswith("MIG-") for u in uuids) and len(set(uuids)) == 2
    for mig_uuid, (gi, profile, total, used) in zip(uuids, [("9", "1g.18gb", 16, 3), ("2", "3g.71gb", 66, 40)],
                                                    strict=True):
        info = {**parent, "mig_uuid": mig_uuid, "gpu_instance": gi, "compute_instance": "0", "profile": profile}
        assert registry.get_sample_value("trainpatrol_gpu_mig_info", info) == 1.0
        mem = {**parent, "mig_uuid": mig_uuid}
        assert registry.get_sample_value("trainpatrol_gpu_mig_memory_total_bytes", mem) == total * GIB
        assert registry.get_sample_value("trainpatrol_gpu_mig_memory_used_bytes", mem) == used * GIB
    assert registry.get_sample_value("trainpatrol_gpu_mig_info", {"gpu": "0", "uuid": parent["uuid"]}) is None
    assert "NotFound" not in caplog.text  # the five empty slots of seven are no fault


@needs_prometheus
def test_a_rank_on_a_mig_slice_joins_its_instance_in_prometheus(tmp_path: Path) -> None:
    fake, collector = mig_gpu()
    slice_uuid = fake.nvmlDeviceGetUUID(fake.nvmlDeviceGetMigDeviceHandleByIndex(fake.nvmlDeviceGetHandleByIndex(1), 1))
    collector.start()
    agent = Agent(AgentConfig(nvml=False), nvml=collector)
    info = {"local_rank": "0", "world_size": "1", "host": "node-a", "gpu_uuid": slice_uuid, "device": "cuda:0",
            "torch_version": "2.11.0", "cuda_version": "13.0", "trainpatrol_version": "0.1.0", "launcher": "",
            "launcher_job": ""}
    try:
        with agent_in_thread(agent.app) as port:
            http_json(f"http://127.0.0.1:{port}/v1/push", {
                "run": "on-a-slice", "rank": 0, "gpu_uuid": slice_uuid, "instance": "a" * 16, "samples": [
                    {"name": "trainpatrol_rank_info", "labels": info, "value": 1.0}]})
            with prometheus(tmp_path, [f"127.0.0.1:{port}"]) as prom:
                # the join docs/kubernetes.md gives: a rank's gpu_uuid is its MIG instance's mig_uuid
                expr = ('label_replace(trainpatrol_rank_info, "mig_uuid", "$1", "gpu_uuid", "(MIG-.+)") '
                        '* on (instance, mig_uuid) group_left (gpu, uuid, profile) trainpatrol_gpu_mig_info')
                joined = wait_for(lambda: query(prom, expr), 20, what="the rank joined to its MIG instance")
    finally:
        collector.stop()
    assert len(joined) == 1
    labels = joined[0]["metric"]
    assert (labels["run"], labels["gpu"], labels["profile"], labels["mig_uuid"]) == ("on-a-slice", "1", "3g.71gb",
                                                                                     slice_uuid)

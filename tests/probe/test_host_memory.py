"""Host memory per rank and per DataLoader worker: read where a push is built, exported, and judged by the
host_memory_leak guard early enough that the evidence is on disk before the OOM killer ends the rank."""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from pathlib import Path

import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families
from torch.utils.data import DataLoader, TensorDataset

from loops import run_scripted, scripted_patrol
from servers import agent, http_get, process, wait_for
from trainpatrol import Patrol, PatrolConfig
from trainpatrol.probe.host_memory import cgroup_limit_bytes, mem_total_bytes

HERE = Path(__file__).resolve().parent
MIB = 2.0**20
PAGE = os.sysconf("SC_PAGE_SIZE")


def statm_rss(pid: int | str = "self") -> float:
    return int(Path(f"/proc/{pid}/statm").read_text().split()[1]) * PAGE


def series(body: bytes, name: str) -> dict[tuple[tuple[str, str], ...], float]:
    out: dict[tuple[tuple[str, str], ...], float] = {}
    for family in text_string_to_metric_families(body.decode()):
        for s in family.samples:
            if s.name == name:
                out[tuple(sorted(s.labels.items()))] = s.value
    return out


def test_a_loop_that_keeps_its_outputs_writes_evidence_before_the_oom_killer_acts(tmp_path: Path) -> None:
    """The incident, on CPU: a loop keeps each step's output with its graph. The test plays the OOM killer
    (SIGKILL, no warning) once the rank's resident set reaches the limit; by then the guard has tripped and
    the rank has written an evidence bundle (action capture, source the guard)."""
    headroom, rate = 750 * MIB, 30.0  # the limit 750 MiB above the start, reached after about 25 s
    log = tmp_path / "leak.log"
    cmd = [sys.executable, str(HERE / "leaky_loop.py"), "", str(tmp_path), str(headroom), str(rate)]
    with agent(tmp_path, "--series", "full") as url:
        cmd[2] = url
        with process(cmd, log) as proc:
            info = wait_for(lambda: proc.poll() is not None or json.loads((tmp_path / "limit.json").read_text()),
                            60, what="the leaking loop to start")
            assert isinstance(info, dict), log.read_text()
            killed_at = rss_at_kill = None
            deadline = time.monotonic() + 90
            while proc.poll() is None and time.monotonic() < deadline:
                try:
                    rss = statm_rss(proc.pid)
                except OSError:  # it ended by itself: the assertions below say how
                    break
                if rss >= info["limit"]:  # the OOM killer
                    os.kill(proc.pid, signal.SIGKILL)
                    killed_at, rss_at_kill = time.time(), rss
                    break
                time.sleep(0.02)
            proc.wait(10)
            body = http_get(url + "/metrics")
    assert killed_at is not None, "the loop never reached its limit:\n" + log.read_text()
    assert rss_at_kill is not None and rss_at_kill >= info["start"] + 500 * MIB
    bundles = sorted((tmp_path / "evidence").iterdir()) if (tmp_path / "evidence").exists() else []
    assert len(bundles) == 1, ("no evidence before the OOM kill", bundles, log.read_text())
    manifest = json.loads((bundles[0] / "manifest.json").read_text())
    trigger = json.loads((bundles[0] / "trigger.json").read_text())
    assert manifest["action"] == "capture" and manifest["checkpoint"] == ""
    assert trigger["source"] == "guard:host_memory_leak", trigger
    assert "limit" in trigger["reason"], trigger["reason"]
    assert (bundles[0] / "manifest.json").stat().st_mtime < killed_at - 1.0  # on disk well before the kill
    key = (("guard", "host_memory_leak"), ("rank", "0"), ("run", "leak"))
    assert series(body, "trainpatrol_guard_trips_total")[key] == 1.0
    (resident,) = series(body, "trainpatrol_host_memory_resident_bytes").values()
    assert info["start"] < resident < info["limit"]
    assert series(body, "trainpatrol_host_memory_limit_bytes") == {(("rank", "0"), ("run", "leak")): info["limit"]}


def test_a_healthy_loop_with_two_workers_exports_each_resident_set_and_stays_quiet(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1))
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    data = TensorDataset(torch.randn(1024, 32), torch.randn(1024, 1))
    loader = DataLoader(data, batch_size=16, shuffle=True, num_workers=2, persistent_workers=True)
    with agent(tmp_path, "--series", "full") as url:
        config = PatrolConfig(run="healthy", agent_url=url, embedded_agent=False, push_interval_seconds=1.0,
                              checkpoint_dir=str(tmp_path / "ckpt"), evidence_dir=str(tmp_path / "evidence"))
        patrol = Patrol(model=model, optimizer=opt, config=config)
        began = time.monotonic()
        while time.monotonic() - began < 18:  # the guard judges after 15 s of readings
            for x, y in patrol.loader(loader):
                loss = torch.nn.functional.mse_loss(model(x), y)
                opt.zero_grad()
                loss.backward()
                patrol.step(loss, batch_size=16)
                opt.step()
                time.sleep(0.002)
                if time.monotonic() - began >= 18:
                    break
        workers = [w.pid for w in loader._iterator._workers]  # type: ignore[union-attr]
        seq = patrol._report.seq
        wait_for(lambda: patrol._report.seq > seq + 1, 5, what="a push after the loop")
        body = http_get(url + "/metrics")
        rank_rss, worker_rss = statm_rss(), [statm_rss(pid) for pid in workers]
        patrol.close()
    labels = (("rank", "0"), ("run", "healthy"))
    assert series(body, "trainpatrol_host_memory_resident_bytes")[labels] == pytest.approx(rank_rss, rel=0.1)
    exported = series(body, "trainpatrol_dataloader_worker_resident_bytes")
    assert exported.keys() == {(("rank", "0"), ("run", "healthy"), ("worker", str(i))) for i in range(2)}
    for i, rss in enumerate(worker_rss):
        assert exported[(("rank", "0"), ("run", "healthy"), ("worker", str(i)))] == pytest.approx(rss, rel=0.1)
    limit = series(body, "trainpatrol_host_memory_limit_bytes")[labels]
    total = mem_total_bytes()
    assert total is not None and 0 < limit <= total
    assert series(body, "trainpatrol_guard_trips_total")[(("guard", "host_memory_leak"), *labels)] == 0.0
    assert not (tmp_path / "evidence").exists()


def test_host_memory_is_read_where_a_push_is_built_never_in_step(tmp_path: Path) -> None:
    patrol = scripted_patrol(tmp_path, guard_actions={})
    reads: list[int] = []
    read = patrol._report.host_memory.read

    def counted(*args: object, **kwargs: object) -> object:
        reads.append(1)
        return read(*args, **kwargs)  # type: ignore[arg-type]
    patrol._report.host_memory.read = counted  # type: ignore[method-assign]
    run_scripted(patrol, [1.0] * 200)
    assert reads == []
    snap = patrol._report.snapshot()
    assert len(reads) == 1
    (resident,) = [s["value"] for s in snap["samples"] if s["name"] == "trainpatrol_host_memory_resident_bytes"]
    assert resident == pytest.approx(statm_rss(), rel=0.1)
    patrol.close()


def test_the_limit_in_force_is_the_lowest_cgroup_limit_above_the_rank(tmp_path: Path) -> None:
    own = tmp_path / "cgroup"
    v2 = tmp_path / "v2"
    (v2 / "kubepods" / "pod1" / "ctr").mkdir(parents=True)
    (v2 / "kubepods" / "pod1" / "memory.max").write_text("2147483648\n")
    (v2 / "kubepods" / "pod1" / "ctr" / "memory.max").write_text("max\n")
    own.write_text("0::/kubepods/pod1/ctr\n")
    assert cgroup_limit_bytes(own, v2) == 2**31
    (v2 / "kubepods" / "pod1" / "memory.max").write_text("max\n")
    assert cgroup_limit_bytes(own, v2) is None  # "max": no limit
    v1 = tmp_path / "v1"
    (v1 / "memory").mkdir(parents=True)  # a container sees its own cgroup at the mount's root
    (v1 / "memory" / "memory.limit_in_bytes").write_text("1073741824\n")
    own.write_text("5:cpu:/docker/abc\n4:memory:/docker/abc\n0::/\n")
    assert cgroup_limit_bytes(own, v1) == 2**30
    (v1 / "memory" / "memory.limit_in_bytes").write_text("9223372036854771712\n")  # v1's "no limit"
    assert cgroup_limit_bytes(own, v1) is None
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:       24731184 kB\nMemFree:        22777108 kB\n")
    assert mem_total_bytes(meminfo) == 24731184 * 1024

"""The agent's own process_* metrics: what a scrape shows about the agent process itself, as the client
libraries name them, read from /proc at most once a second."""

from __future__ import annotations

import os
import time
from pathlib import Path

import psutil
import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from servers import agent, http_get
from trainpatrol.agent.exposition import Families, exposition
from trainpatrol.collectors.process_self import ProcessMetrics

PAGE = os.sysconf("SC_PAGE_SIZE")
NAMES = ("process_resident_memory_bytes", "process_virtual_memory_bytes", "process_cpu_seconds_total",
         "process_open_fds", "process_max_fds", "process_start_time_seconds")


def values(body: bytes) -> dict[str, float]:
    return {s.name: s.value for f in text_string_to_metric_families(body.decode()) for s in f.samples
            if s.name.startswith("process_")}


def test_the_agent_serves_its_own_process_metrics_with_plausible_values(tmp_path: Path) -> None:
    with agent(tmp_path) as url:
        port = int(url.rsplit(":", 1)[1])
        (pid,) = [p.pid for p in psutil.Process().children(recursive=True)
                  if "agent" in p.cmdline() and str(port) in p.cmdline()]
        for _ in range(20):
            http_get(url + "/metrics")  # some work, so the CPU time is above zero
        time.sleep(1.1)  # the next scrape reads /proc again
        got = values(http_get(url + "/metrics"))
        rss = int(Path(f"/proc/{pid}/statm").read_text().split()[1]) * PAGE
        fds = len(os.listdir(f"/proc/{pid}/fd"))
        started = psutil.Process(pid).create_time()
    assert set(got) == set(NAMES), got
    assert got["process_resident_memory_bytes"] == pytest.approx(rss, rel=0.2)
    assert got["process_virtual_memory_bytes"] > got["process_resident_memory_bytes"]
    assert 0 < got["process_cpu_seconds_total"] < 120
    assert 0 < got["process_open_fds"] <= got["process_max_fds"]
    assert abs(got["process_open_fds"] - fds) <= 5
    assert got["process_start_time_seconds"] == pytest.approx(started, abs=2.0)


def test_process_families_are_read_once_a_second_and_written_as_generate_latest_writes_them() -> None:
    now = [100.0]
    collector = ProcessMetrics(clock=lambda: now[0])
    first = collector.collect()
    assert collector.collect() is first  # within the second: the same families, /proc not read again
    now[0] += 1.0
    later = collector.collect()
    assert later is not first
    assert [f.name for f in later] == ["process_resident_memory_bytes", "process_virtual_memory_bytes",
                                       "process_cpu_seconds", "process_open_fds", "process_max_fds",
                                       "process_start_time_seconds"]
    assert exposition(Families(later)) == generate_latest(Families(later))

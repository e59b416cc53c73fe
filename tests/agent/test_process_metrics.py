"""The agent's own process_* metrics: what a scrape shows about the agent process itself, as the client
libraries name them, read from /proc at most once a second."""

from __future__ import annotations

import os
import time
from pathlib import Path

import psutil
import pytest
from prometheus_client.parser import text_string_to_metric_families

from exposition_check import Watched, assert_clean, text
from servers import agent, http_get
from trainpatrol.collectors.registry import ProcessMetrics

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


def test_process_families_are_read_once_a_second_as_prometheus_client_names_them() -> None:
    now = [100.0]
    collector = Watched(ProcessMetrics(clock=lambda: now[0]))
    assert collector.changed()
    first = text(collector)
    now[0] += 0.999
    assert not collector.changed()  # within the second: /proc is not read again
    now[0] += 0.001
    assert collector.changed()
    later = text(collector)
    assert [f.name for f in text_string_to_metric_families(later.decode())] == [
        "process_virtual_memory_bytes", "process_resident_memory_bytes", "process_start_time_seconds",
        "process_cpu_seconds", "process_open_fds", "process_max_fds"]
    assert b"# TYPE process_cpu_seconds_total counter\nprocess_cpu_seconds_total " in later
    assert first.split(b"process_start_time_seconds ")[1] == later.split(b"process_start_time_seconds ")[1]
    assert_clean(later)

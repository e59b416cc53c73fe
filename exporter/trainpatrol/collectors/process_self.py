"""The agent process's own ``process_*`` metrics, as every Prometheus client library names them.

Emits ``process_resident_memory_bytes``, ``process_virtual_memory_bytes``, ``process_cpu_seconds_total``,
``process_open_fds``, ``process_max_fds`` and ``process_start_time_seconds``.

prometheus_client's ``ProcessCollector`` reads the same files, but builds its families on every scrape and
writes them through ``generate_latest``; the agent's CPU budget (bench/scrape.py) is tight, so /proc is read
here at most once a second (``/proc/self/stat`` and a listing of ``/proc/self/fd``, some tens of µs) and the
lines are formatted once per reading; scrapes in between get the very same families. Where /proc is missing
(not Linux) it yields nothing.
"""

from __future__ import annotations

import os
import resource
import time
from collections.abc import Callable

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from ..agent.exposition import RenderedFamily, render
from ..catalogue import BY_NAME

_GAUGES = ("process_resident_memory_bytes", "process_virtual_memory_bytes")
_FDS = ("process_open_fds", "process_max_fds")


def _boot_time() -> float:
    with open("/proc/stat", "rb") as f:
        for line in f:
            if line.startswith(b"btime "):
                return float(line.split()[1])
    raise OSError("no btime in /proc/stat")


class ProcessMetrics:
    """A collector of this process's metrics, read again at most every ``interval`` seconds."""

    def __init__(self, interval: float = 1.0, clock: Callable[[], float] = time.monotonic) -> None:
        self.interval = interval
        self.clock = clock
        self._ticks = float(os.sysconf("SC_CLK_TCK"))
        self._page = float(os.sysconf("SC_PAGE_SIZE"))
        self._read_at = -float("inf")
        self._families: list[Metric] = []
        self._start: float | None = None

    def describe(self) -> list[Metric]:
        return []

    def collect(self) -> list[Metric]:
        now = self.clock()
        if now - self._read_at < self.interval:
            return self._families
        self._read_at = now
        try:
            self._families = self._read()
        except OSError:  # no /proc here
            self._families = []
        return self._families

    def _read(self) -> list[Metric]:
        with open("/proc/self/stat", "rb") as f:
            stat = f.read()
        fields = stat[stat.rindex(b")") + 2:].split()  # the command name may hold spaces and parentheses
        utime, stime, starttime = float(fields[11]), float(fields[12]), float(fields[19])
        vsize, rss = float(fields[20]), float(fields[21]) * self._page
        if self._start is None:
            self._start = _boot_time() + starttime / self._ticks
        open_fds = float(len(os.listdir("/proc/self/fd")))
        max_fds = float(resource.getrlimit(resource.RLIMIT_NOFILE)[0])
        families: list[Metric] = []
        for name, value in zip(_GAUGES, (rss, vsize), strict=True):
            families.append(GaugeMetricFamily(name, BY_NAME[name].help, value=value, unit="bytes"))
        families.append(CounterMetricFamily("process_cpu_seconds", BY_NAME["process_cpu_seconds_total"].help,
                                            value=(utime + stime) / self._ticks, unit="seconds"))
        for name, value in zip(_FDS, (open_fds, max_fds), strict=True):
            families.append(GaugeMetricFamily(name, BY_NAME[name].help, value=value))
        families.append(GaugeMetricFamily("process_start_time_seconds", BY_NAME["process_start_time_seconds"].help,
                                          value=self._start, unit="seconds"))
        rendered: list[RenderedFamily] = render(families)
        return list(rendered)

"""The agent process's own ``process_*`` metrics: prometheus_client's process collector, read at most
once a second (it reads /proc; where there is none, it gives nothing)."""

from __future__ import annotations

import time
from collections.abc import Callable, Hashable, Iterable

from prometheus_client.metrics_core import Metric
from prometheus_client.process_collector import ProcessCollector


class ProcessMetrics:
    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._collector = ProcessCollector(registry=None)
        self._clock = clock

    def version(self) -> Hashable:
        return int(self._clock())

    def collect(self) -> Iterable[Metric]:
        return self._collector.collect()

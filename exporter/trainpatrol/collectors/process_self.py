"""The agent process's own ``process_*`` metrics, as every Prometheus client library names them.

Emits ``process_resident_memory_bytes``, ``process_virtual_memory_bytes``, ``process_cpu_seconds_total``,
``process_open_fds``, ``process_max_fds`` and ``process_start_time_seconds``.

/proc is read at most once a second (``/proc/self/stat`` and a listing of ``/proc/self/fd``); where it
is missing (not Linux) this writes nothing.
"""

from __future__ import annotations

import os
import resource
import time
from collections.abc import Callable

from ..catalogue import BY_NAME
from ..exposition import family


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
        self._start: float | None = None

    def changed(self) -> bool:
        return self.clock() - self._read_at >= self.interval

    def write(self) -> bytes:
        self._read_at = self.clock()
        try:
            values = self._read()
        except OSError:  # no /proc here
            return b""
        return "".join([family(name, BY_NAME[name].kind, BY_NAME[name].help, [({}, value)])
                        for name, value in values.items()]).encode()

    def _read(self) -> dict[str, float]:
        with open("/proc/self/stat", "rb") as f:
            stat = f.read()
        fields = stat[stat.rindex(b")") + 2:].split()  # the command name may hold spaces and parentheses
        utime, stime, starttime = float(fields[11]), float(fields[12]), float(fields[19])
        if self._start is None:
            self._start = _boot_time() + starttime / self._ticks
        return {"process_resident_memory_bytes": float(fields[21]) * self._page,
                "process_virtual_memory_bytes": float(fields[20]),
                "process_cpu_seconds_total": (utime + stime) / self._ticks,
                "process_open_fds": float(len(os.listdir("/proc/self/fd"))),
                "process_max_fds": float(resource.getrlimit(resource.RLIMIT_NOFILE)[0]),
                "process_start_time_seconds": self._start}

"""Host (CPU) memory of a rank and of its DataLoader workers, the limit it lives under, and its trend.

Why: a rank that leaks host memory (a loop that keeps outputs with their autograd graphs, a cache that
grows in a dataset) is ended by the kernel's OOM killer with SIGKILL: no exception, no ``atexit``, no
evidence, and all Prometheus sees is the rank going down. The allocator metrics cover device memory only.
So Patrol reads the resident set of the rank and of each worker of the loader it iterates, and the limit
that applies, and the ``host_memory_leak`` guard judges their trend early enough to write evidence first.

Cost: one read of ``/proc/PID/statm`` per process (a few µs each), taken where the publisher thread builds
a push (``Patrol.snapshot``, about once a second), never in ``Patrol.step()``. The limit (the cgroup's
``memory.max``, or v1's ``memory.limit_in_bytes``, and ``MemTotal``) is read again every 30 s. Linux only:
elsewhere nothing is read and nothing is exported.

A forked worker's resident set counts every page it still shares with the rank (copy-on-write), so the
guard adds each worker's growth since it was first seen, not its resident set (the metric shows the latter).
"""

from __future__ import annotations

import itertools
import math
import os
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .window import slope

PAGE_SIZE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096
MAX_WORKERS = 64
"""Workers exported per rank (the ``worker`` label is the worker's index in its loader, so it is bounded)."""
TREND_SPACING = 0.5
"""The trend keeps readings at least this far apart (pushes may come faster: state changes, short intervals)."""
LIMIT_REFRESH_SECONDS = 30.0
_NO_LIMIT = 2.0**62
"""cgroup v1 writes "no limit" as a page-rounded 2**63 - 1; anything this large is no limit."""
MIB = 2.0**20


def resident_bytes(pid: int | None = None) -> float | None:
    """The resident set of ``pid`` (None: this process) from /proc/PID/statm; None when it cannot be read."""
    try:
        with open(f"/proc/{'self' if pid is None else pid}/statm", "rb") as f:
            return float(int(f.read().split()[1]) * PAGE_SIZE)
    except (OSError, IndexError, ValueError):
        return None


def _limit_file(path: Path) -> float | None:
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    if text == "max" or not text.isdigit():
        return None
    value = float(text)
    return value if 0 < value < _NO_LIMIT else None


def cgroup_limit_bytes(own: Path = Path("/proc/self/cgroup"), root: Path = Path("/sys/fs/cgroup")) -> float | None:
    """The lowest memory limit of this process's cgroup and its ancestors, v2 (``memory.max``) or v1
    (``memory/…/memory.limit_in_bytes``); None when there is none. A container that sees its own cgroup at
    the mount's root still finds its limit there, as the walk up ends at the root."""
    try:
        lines = own.read_text().splitlines()
    except OSError:
        return None
    found: list[float] = []
    for line in lines:
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        _, controllers, path = parts
        if controllers == "":
            base, name = root, "memory.max"
        elif "memory" in controllers.split(","):
            base, name = root / "memory", "memory.limit_in_bytes"
        else:
            continue
        rel = Path(path.lstrip("/"))
        for folder in (rel, *rel.parents):
            value = _limit_file(base / folder / name)
            if value is not None:
                found.append(value)
    return min(found) if found else None


def mem_total_bytes(meminfo: Path = Path("/proc/meminfo")) -> float | None:
    try:
        with open(meminfo) as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    return float(line.split()[1]) * 1024
    except (OSError, IndexError, ValueError):
        return None
    return None


def system_limit_bytes() -> float | None:
    """The limit in force on this process: the lower of its cgroup's limit and the host's memory."""
    known = [v for v in (cgroup_limit_bytes(), mem_total_bytes()) if v is not None]
    return min(known) if known else None


def worker_pids(iterator: Any) -> list[int]:
    """The live worker processes of a DataLoader iterator, in worker order (a multiprocess
    ``_MultiProcessingDataLoaderIter`` keeps them in ``_workers``); none for any other iterator."""
    workers = getattr(iterator, "_workers", None)
    if not workers or getattr(iterator, "_shutdown", False):
        return []
    status = getattr(iterator, "_workers_status", None) or [True] * len(workers)
    return [int(w.pid) for w, alive in zip(list(workers)[:MAX_WORKERS], status, strict=False)
            if alive and w.pid is not None]


@dataclass(frozen=True)
class HostMemoryReading:
    time: float
    """``time.monotonic()`` of the read."""
    resident: float
    """The rank's resident set, bytes."""
    workers: dict[int, float]
    """Each live worker's resident set, by its index in the loader."""
    workers_growth: float
    """What the workers added since each was first seen (their shared pages are the rank's)."""
    limit: float
    """The limit in force: ``PatrolConfig.host_memory_limit_bytes``, else the lower of the cgroup's limit and
    MemTotal; NaN when unknown."""
    budget: float
    """What the guard holds the rank to: the override as it is, else the limit shared by the node's local
    ranks (``LOCAL_WORLD_SIZE``), who all live under it; NaN when unknown."""

    @property
    def judged(self) -> float:
        """What the guard judges: the rank's resident set and what its workers added."""
        return self.resident + self.workers_growth


def _local_world_size() -> int:
    """The ranks on this node (torchrun's ``LOCAL_WORLD_SIZE``), who all live under the same limit."""
    try:
        return max(1, int(os.environ.get("LOCAL_WORLD_SIZE") or 1))
    except ValueError:
        return 1


class HostMemory:
    """Reads a rank's host memory (``read``); thread-safe.

    ``limit_override``: ``PatrolConfig.host_memory_limit_bytes`` (0: the cgroup's limit or MemTotal)."""

    def __init__(self, limit_override: float = 0.0,
                 read_resident: Callable[[int | None], float | None] = resident_bytes,
                 read_limit: Callable[[], float | None] = system_limit_bytes, local_ranks: int | None = None) -> None:
        self.limit_override = limit_override
        self.read_resident = read_resident
        self.read_limit = read_limit
        self.local_ranks = local_ranks or _local_world_size()
        self._lock = threading.Lock()
        self._limit, self._limit_at = math.nan, -math.inf
        self._first: dict[int, float] = {}
        """Each worker's resident set when it was first seen, by pid."""

    def read(self, workers: Iterable[int] = (), now: float | None = None) -> HostMemoryReading | None:
        """Read the rank and ``workers`` (pids, in worker order); None when /proc cannot be read."""
        now = time.monotonic() if now is None else now
        with self._lock:
            resident = self.read_resident(None)
            if resident is None:
                return None
            if self.limit_override <= 0 and now - self._limit_at >= LIMIT_REFRESH_SECONDS:
                found = self.read_limit()
                self._limit, self._limit_at = math.nan if found is None else found, now
            per_worker: dict[int, float] = {}
            seen: dict[int, float] = {}
            growth = 0.0
            for index, pid in enumerate(workers):
                rss = self.read_resident(pid)
                if rss is None:  # it exited meanwhile
                    continue
                per_worker[index] = rss
                seen[pid] = base = self._first.get(pid, rss)
                growth += max(0.0, rss - base)
            self._first = seen
            if self.limit_override > 0:
                limit = budget = float(self.limit_override)
            else:
                limit, budget = self._limit, self._limit / self.local_ranks
        return HostMemoryReading(now, resident, per_worker, growth, limit, budget)


@dataclass
class LeakTrend:
    """The last ``window_seconds`` of judged host memory, and whether it shows a leak (``leak``)."""

    window_seconds: float = 30.0
    points: deque[tuple[float, float]] = field(default_factory=deque)
    """Readings at least ``TREND_SPACING`` apart."""
    last: tuple[float, float] | None = None
    """The newest reading, kept or not."""

    def add(self, t: float, value: float) -> None:
        points = self.points
        if points and t < points[-1][0]:
            points.clear()  # a clock that went back: start again
        self.last = (t, value)
        if not points or t - points[-1][0] >= TREND_SPACING:
            points.append((t, value))
        while points and points[0][0] < t - self.window_seconds:
            points.popleft()

    def leak(self, budget: float, *, used_ratio: float, min_growth: float, horizon: float,
             min_seconds: float) -> str | None:
        """Why the memory counts as leaking, or None: it is above ``used_ratio`` of ``budget``, or it grew
        steadily for at least ``min_seconds`` (at ``min_growth`` bytes/s or more by least squares, in each
        third of the window, and still in the last) at a rate that reaches ``budget`` within ``horizon`` s."""
        points = list(self.points)
        if not points or self.last is None or not budget > 0:
            return None
        now = self.last[1]
        if now >= used_ratio * budget:
            return (f"resident {now / MIB:.0f} MiB (rank and its workers' growth), {now / budget:.0%} of the "
                    f"{budget / MIB:.0f} MiB limit")
        span = points[-1][0] - points[0][0]
        if len(points) < 8 or span < min_seconds:
            return None
        rate = slope(points)
        if not rate >= min_growth:
            return None
        thirds: list[list[tuple[float, float]]] = [[], [], []]
        for p in points:
            thirds[min(2, int(3 * (p[0] - points[0][0]) / span))].append(p)
        if min(map(len, thirds)) < 2:
            return None
        centres = [(sum(p[0] for p in part) / len(part), sum(p[1] for p in part) / len(part)) for part in thirds]
        for (t0, v0), (t1, v1) in itertools.pairwise(centres):
            if v1 - v0 < 0.5 * rate * (t1 - t0):
                return None  # grew in one place (a step), not throughout
        if not slope(thirds[2]) >= 0.5 * rate:
            return None  # no longer growing
        eta = (budget - now) / rate
        if eta > horizon:
            return None
        return (f"resident {now / MIB:.0f} MiB (rank and its workers' growth) grew {rate / MIB:.1f} MiB/s over the "
                f"last {span:.0f} s; at this rate it reaches the {budget / MIB:.0f} MiB limit in {eta:.0f} s")


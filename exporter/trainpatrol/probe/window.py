"""The rank's recent history: one record per optimizer step, and statistics over a window."""

from __future__ import annotations

import math
from collections import deque
from itertools import islice
from dataclasses import asdict, dataclass
from statistics import median
from typing import Any


@dataclass
class StepRecord:
    step: int
    time: float
    loss: float = math.nan
    grad_norm: float = math.nan
    step_seconds: float = 0.0
    loader_wait_seconds: float = 0.0
    allocated_bytes: float = math.nan
    reserved_bytes: float = math.nan
    fragmentation_ratio: float = math.nan
    probe_seconds: float = 0.0


def _finite(values: list[float]) -> list[float]:
    return [v for v in values if math.isfinite(v)]


class History:
    """Bounded history for evidence, and a shorter window for exported window statistics."""

    def __init__(self, window: int = 100, keep: int = 1024) -> None:
        self.window = window
        self.records: deque[StepRecord] = deque(maxlen=max(keep, window))
        self._by_step: dict[int, StepRecord] = {}

    def record(self, step: int, now: float) -> StepRecord:
        rec = StepRecord(step, now)
        if len(self.records) == self.records.maxlen:
            self._by_step.pop(self.records[0].step, None)
        self.records.append(rec)
        self._by_step[step] = rec
        return rec

    def get(self, step: int) -> StepRecord | None:
        return self._by_step.get(step)

    def recent(self, n: int | None = None) -> list[StepRecord]:
        n = self.window if n is None else n
        size = len(self.records)
        return list(islice(self.records, max(0, size - n), size))

    def values(self, field: str, n: int | None = None) -> list[float]:
        return _finite([getattr(r, field) for r in self.recent(n)])

    def mean(self, field: str) -> float:
        vals = self.values(field)
        return sum(vals) / len(vals) if vals else math.nan

    def max(self, field: str) -> float:
        return max(self.values(field), default=math.nan)

    def median(self, field: str, n: int | None = None) -> float:
        vals = self.values(field, n)
        return float(median(vals)) if vals else math.nan

    def ratio(self, num: str, den: str) -> float:
        recs = self.recent()
        total = sum(getattr(r, den) for r in recs)
        return sum(getattr(r, num) for r in recs) / total if total > 0 else math.nan

    def slope(self, field: str) -> float:
        """Least-squares slope of ``field`` against step over the window."""
        pts = [(r.step, getattr(r, field)) for r in self.recent() if math.isfinite(getattr(r, field))]
        if len(pts) < 2:
            return math.nan
        mx = sum(p[0] for p in pts) / len(pts)
        my = sum(p[1] for p in pts) / len(pts)
        den = sum((x - mx) ** 2 for x, _ in pts)
        return sum((x - mx) * (y - my) for x, y in pts) / den if den else math.nan

    def dump(self, n: int | None = None) -> list[dict[str, Any]]:
        return [{k: (v if not isinstance(v, float) or math.isfinite(v) else str(v)) for k, v in asdict(r).items()}
                for r in (self.records if n is None else self.recent(n))]

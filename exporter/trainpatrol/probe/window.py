"""The rank's recent history: one record per optimizer step, and statistics over a window."""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from itertools import islice
from statistics import median
from typing import Any


@dataclass(slots=True)
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
    learning_rate: float = math.nan
    """The first param group's, as the step used it."""


def finite(values: list[float]) -> list[float]:
    """``values`` without NaN and Inf; one C-level sum decides whether any needs filtering."""
    total = sum(values)
    return values if total - total == 0 else list(filter(math.isfinite, values))


def slope(points: Sequence[tuple[float, float]]) -> float:
    """The least-squares slope of y over x; NaN for fewer than two distinct x."""
    n = len(points)
    if n < 2:
        return math.nan
    mx = sum(p[0] for p in points) / n
    my = sum(p[1] for p in points) / n
    var = sum((p[0] - mx) ** 2 for p in points)
    return sum((p[0] - mx) * (p[1] - my) for p in points) / var if var > 0 else math.nan


class History:
    """Bounded history for evidence, and a shorter window for exported window statistics."""

    def __init__(self, window: int = 100, keep: int = 1024) -> None:
        self.window = window
        self.records: deque[StepRecord] = deque(maxlen=max(keep, window))

    def record(self, step: int, now: float) -> StepRecord:
        rec = StepRecord(step, now)
        self.add(rec)
        return rec

    def add(self, rec: StepRecord) -> None:
        self.records.append(rec)

    def get(self, step: int) -> StepRecord | None:
        """The newest record of ``step``, if still held: where consecutive steps put it, else the
        first one found walking back from the newest (skipped steps, a restore to an earlier step)."""
        records = self.records
        if not records:
            return None
        i = len(records) - 1 - (records[-1].step - step)
        if 0 <= i < len(records) and records[i].step == step:
            return records[i]
        return next((r for r in reversed(records) if r.step == step), None)

    def recent(self, n: int | None = None) -> list[StepRecord]:
        out = list(islice(reversed(self.records), max(0, self.window if n is None else n)))
        out.reverse()  # walked from the newest end: O(n), not O(len(records))
        return out

    def values(self, field: str, n: int | None = None) -> list[float]:
        return finite([getattr(r, field) for r in self.recent(n)])

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
        return slope([(r.step, v) for r in self.recent() if math.isfinite(v := getattr(r, field))])

    def dump(self, n: int | None = None) -> list[dict[str, Any]]:
        return [{k: (v if not isinstance(v, float) or math.isfinite(v) else str(v)) for k, v in asdict(r).items()}
                for r in (self.records if n is None else self.recent(n))]

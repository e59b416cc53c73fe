"""Serves the ranks' pushed series, plus the liveness the agent derives from them.

Emits every ``source="rank"`` metric of the catalogue with ``run`` and ``rank`` labels (and the
workload labels a rank has), then ``trainpatrol_rank_up``,
``trainpatrol_rank_last_push_timestamp_seconds`` and ``trainpatrol_rank_last_step_timestamp_seconds``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple, Protocol

from ..catalogue import AGENT_METRICS, RANK_METRICS
from ..exposition import go_float, header

_HEADERS = tuple(header(m.name, m.kind, m.help) for m in RANK_METRICS)
_LIVENESS = tuple(m for m in AGENT_METRICS if m.name.startswith("trainpatrol_rank_"))
assert [m.name for m in _LIVENESS] == ["trainpatrol_rank_up", "trainpatrol_rank_last_push_timestamp_seconds",
                                       "trainpatrol_rank_last_step_timestamp_seconds"]  # RankCollector.write


class RankRow(NamedTuple):
    """What a scrape writes of one rank."""

    texts: tuple[str, ...]
    """Per catalogue rank family, the rank's lines (collectors.rank_record)."""
    plain: str
    """The label block of its liveness lines."""
    up: bool
    last_push: float
    last_step_advance: float


class RankSource(Protocol):
    """Where the ranks come from (agent.store)."""

    def state(self) -> tuple[int, tuple[bool, ...]]:
        """A count of writes and expiries, and each rank's up flag: what the lines depend on."""

    def rows(self) -> Sequence[RankRow]:
        """Every rank, sorted by (namespace, run, rank)."""


class RankCollector:
    """Writes family by family in catalogue order, the ranks in order within each."""

    def __init__(self, source: RankSource) -> None:
        self._source = source
        self._written: tuple[int, tuple[bool, ...]] | None = None

    def changed(self) -> bool:
        return self._source.state() != self._written

    def write(self) -> bytes:
        state = self._source.state()
        rows = self._source.rows()
        out: list[str] = []
        for j, head in enumerate(_HEADERS):
            lines = "".join([row.texts[j] for row in rows])
            if lines:
                out += (head, lines)
        if rows:
            up, push, step = (m.name for m in _LIVENESS)
            out += (header(up, "gauge", _LIVENESS[0].help),
                    *[f"{up}{{{r.plain}}} {'1.0' if r.up else '0.0'}\n" for r in rows],
                    header(push, "gauge", _LIVENESS[1].help),
                    *[f"{push}{{{r.plain}}} {go_float(r.last_push)}\n" for r in rows],
                    header(step, "gauge", _LIVENESS[2].help),
                    *[f"{step}{{{r.plain}}} {go_float(r.last_step_advance)}\n" for r in rows])
        self._written = state
        return "".join(out).encode()

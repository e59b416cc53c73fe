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
_UP, _PUSH, _STEP = (m.name for m in _LIVENESS)
assert (_UP, _PUSH, _STEP) == ("trainpatrol_rank_up", "trainpatrol_rank_last_push_timestamp_seconds",
                               "trainpatrol_rank_last_step_timestamp_seconds")
_UP_HEADER, _PUSH_HEADER, _STEP_HEADER = (header(m.name, m.kind, m.help) for m in _LIVENESS)


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
        self._stamps: dict[str, tuple[float, float, str, str]] = {}
        """Per rank (its label block): the two timestamps last written and their lines. A scrape
        finds most ranks' unchanged since the last one, and formatting a timestamp is not cheap."""

    def changed(self) -> bool:
        return self._source.state() != self._written

    def write(self) -> bytes:
        state = self._source.state()
        rows = self._source.rows()
        out: list[str] = []
        for head, lines in zip(_HEADERS, zip(*[row.texts for row in rows], strict=True), strict=False):
            if any(lines):
                out.append(head)
                out += lines
        stamps = [self._stamp_lines(r) for r in rows]
        if rows:
            out += (_UP_HEADER, *[f"{_UP}{{{r.plain}}} {'1.0' if r.up else '0.0'}\n" for r in rows],
                    _PUSH_HEADER, *[s[2] for s in stamps], _STEP_HEADER, *[s[3] for s in stamps])
        self._stamps = {r.plain: s for r, s in zip(rows, stamps, strict=True)}
        self._written = state
        return "".join(out).encode()

    def _stamp_lines(self, row: RankRow) -> tuple[float, float, str, str]:
        known = self._stamps.get(row.plain)
        if known is not None and known[0] == row.last_push and known[1] == row.last_step_advance:
            return known
        return (row.last_push, row.last_step_advance, f"{_PUSH}{{{row.plain}}} {go_float(row.last_push)}\n",
                f"{_STEP}{{{row.plain}}} {go_float(row.last_step_advance)}\n")

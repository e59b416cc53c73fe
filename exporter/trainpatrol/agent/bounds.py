"""The agent's bounds on what others make it hold (docs/security.md, "Bounds").

A push over a bound is refused whole, with the bound's name and its setting in the message, and
counted in ``trainpatrol_refused_requests_total{reason}`` under that name. Known ranks keep pushing:
a bound refuses only what is new (a run, a rank, more series), never the state of one that is here.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..protocol import RankSnapshot
from .config import AgentConfig

_DEFAULTS = AgentConfig()


class Refused(Exception):
    """A request over a bound: answered ``status`` with ``detail``, counted under ``reason``."""

    def __init__(self, status: int, reason: str, detail: str) -> None:
        super().__init__(detail)
        self.status, self.reason, self.detail = status, reason, detail


class PushRefused(Refused):
    """A valid push its proof does not allow (403): a run bound to another key, a namespace out of the token's reach."""

    def __init__(self, detail: str) -> None:
        super().__init__(403, "run_key", detail)


def _setting(name: str) -> str:
    return f"{name}, TRAINPATROL_{name.upper()}"


@dataclass(frozen=True)
class Bounds:
    """The agent's bounds; their defaults and meaning are AgentConfig's."""

    max_runs: int = _DEFAULTS.max_runs
    max_ranks_per_run: int = _DEFAULTS.max_ranks_per_run
    max_series: int = _DEFAULTS.max_series
    max_samples_per_push: int = _DEFAULTS.max_samples_per_push
    max_label_length: int = _DEFAULTS.max_label_length
    max_queued_commands: int = _DEFAULTS.max_queued_commands

    @classmethod
    def of(cls, config: AgentConfig) -> Bounds:
        return cls(max_runs=config.max_runs, max_ranks_per_run=config.max_ranks_per_run,
                   max_series=config.max_series, max_samples_per_push=config.max_samples_per_push,
                   max_label_length=config.max_label_length, max_queued_commands=config.max_queued_commands)

    def check_body(self, body: bytes) -> None:
        """Before parsing: a body with more sample objects than the bound is refused unread. Every
        sample has a ``"name"`` key, and those bytes cannot occur inside a JSON string (its quotes
        would be escaped), so the count bounds the samples from above; parsing a large body blocked
        the event loop, and every scrape behind it, for about 10 ms per 0.25 MB."""
        found = body.count(b'"name"')
        if found > self.max_samples_per_push + 1:  # one more: the histogram has a name too
            raise Refused(413, "max_samples_per_push",
                          f"A push of at least {found - 1} samples is over the limit of {self.max_samples_per_push} "
                          f"({_setting('max_samples_per_push')}).")

    def check_snapshot(self, snap: RankSnapshot) -> None:
        """What one push may carry, whoever sends it."""
        if len(snap.samples) > self.max_samples_per_push:
            raise Refused(413, "max_samples_per_push",
                          f"A push of {len(snap.samples)} samples is over the limit of {self.max_samples_per_push} "
                          f"({_setting('max_samples_per_push')}).")
        if self.max_label_length < 256:  # the protocol already holds every label value to 256 characters
            for s in snap.samples:
                for name, value in s.labels.items():
                    if len(value) > self.max_label_length:
                        raise Refused(422, "max_label_length",
                                      f"Label {name!r} of {s.name} is {len(value)} characters long, over the limit "
                                      f"of {self.max_label_length} ({_setting('max_label_length')}).")

    def admit(self, snap: RankSnapshot, new_rank: bool, runs: int, ranks_of_run: int | None,
              series_after: int) -> None:
        """May the store take this push? ``ranks_of_run`` is None for a run it does not host yet."""
        if ranks_of_run is None and runs >= self.max_runs:
            raise Refused(429, "max_runs", f"Run {snap.run!r} refused: this agent already hosts {runs} runs, "
                                           f"the limit ({_setting('max_runs')}).")
        if new_rank and ranks_of_run is not None and ranks_of_run >= self.max_ranks_per_run:
            raise Refused(429, "max_ranks_per_run",
                          f"Rank {snap.rank} of run {snap.run!r} refused: the run already has {ranks_of_run} ranks "
                          f"here, the limit ({_setting('max_ranks_per_run')}).")
        if series_after > self.max_series:
            raise Refused(429, "max_series",
                          f"Push of run {snap.run!r} rank {snap.rank} refused: this agent would hold "
                          f"{series_after} series, over the limit of {self.max_series} ({_setting('max_series')}).")

    def admit_command(self, run: str, queued: int) -> None:
        if queued >= self.max_queued_commands:
            raise Refused(429, "max_queued_commands",
                          f"Run {run!r} already has {queued} commands waiting, the limit "
                          f"({_setting('max_queued_commands')}); they are carried out at the ranks' next push.")

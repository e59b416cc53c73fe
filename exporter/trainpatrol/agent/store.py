"""What the agent knows about its ranks: last pushes, their series, liveness, and commands waiting for them.

A run's ranks are one **incarnation** while their Patrols live (each pushes its ``instance``). A command is
for the instances live when it was asked for: it reaches those alone, a later one coalesces into it only if
it would reach the same ranks, and once none of them is left (the job was relaunched under its name) it is
dropped. A run holds at most ``max_series_per_run`` series; when a new run or rank would go over a bound, a
run that gives way goes first (docs/security.md): all its ranks ended or down, or none advanced a step
``squat_seconds`` after it came.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

from ..collectors.ranks import RankRow
from ..protocol import ActionRecord, Command, RankSnapshot
from .auth import RunId, RunKeys
from .limits import ActionLimits, Bounds, Refused

COMMAND_TTL_SECONDS = 3600.0
ENDED_STATES = ("closed", "stopped")
"""States a rank reports last, on purpose: it pushes no more, and it is never shown ``down``."""


@dataclass
class RankEntry:
    snapshot: RankSnapshot  # the rank's last push
    last_push: float
    last_step_advance: float


Enqueued = Literal["queued", "duplicate", "coalesced", "rate_limited"]


class WrongRunKey(Exception):
    """A push for a run whose key it does not carry (agent.auth)."""

    def __init__(self, run: RunId) -> None:
        where = f" in namespace {run[0]!r}" if run[0] else ""
        super().__init__(f"Run {run[1]!r}{where} belongs to pushes that carry its run key; this push does not.")


def run_id(snap: RankSnapshot | Command) -> RunId:
    return (snap.namespace, snap.run)


class RankStore:
    """Thread-safe; the web handlers, the collector and the expiry all go through one lock.
    Runs are (namespace, run): the same run name in two namespaces is two runs."""

    def __init__(self, rank_up_ttl: float = 15.0, expire_after: float = 600.0, closed_expire_after: float = 60.0,
                 clock: Callable[[], float] = time.time, action_limits: dict[str, int] | None = None,
                 bounds: Bounds | None = None, squat_seconds: float = 60.0,
                 count: Callable[[str, str], None] = lambda counter, reason: None) -> None:
        self.bounds = bounds or Bounds()
        self.squat_seconds = squat_seconds
        self._count = count  # count("dropped", reason): ranks dropped by a binding or an eviction
        self.rank_up_ttl = rank_up_ttl
        self.expire_after = expire_after
        self.closed_expire_after = closed_expire_after
        self._clock = clock
        self._lock = threading.Lock()
        self._ranks: dict[tuple[str, str, int], RankEntry] = {}
        self._commands: dict[RunId, list[Command]] = {}
        self._keys = RunKeys()
        self._limits = ActionLimits(action_limits or {})
        self._seen_commands: dict[int, float] = {}
        self._run_ranks: dict[RunId, int] = {}  # with the two below, what the bounds are checked against
        self._series = 0
        self._run_series: dict[RunId, int] = {}
        self._came: dict[RunId, float] = {}  # when each run's first rank came (or its key was bound again)
        self._trained: set[RunId] = set()  # runs some rank of which advanced a step
        self._targets: dict[int, frozenset[str]] = {}  # per command, the instances live when it was asked for
        self._version = 0  # writes and expiries so far: what /metrics has to write again for
        self._next_expiry = float("inf")  # nothing is due to expire before (maybe earlier than the first due)
        self._up_flags: tuple[int, tuple[bool, ...], float] = (-1, (), float("-inf"))
        """``state``'s last answer: the version, the up flags, and until when the flags hold."""

    # --- pushes -------------------------------------------------------------------------------
    def push(self, snap: RankSnapshot, key_digest: bytes = b"") -> list[Command]:
        """Record a snapshot; return the run's commands this rank has not carried out yet. Raises,
        recording nothing: ``WrongRunKey`` when the run is bound to another key (or keyed, for a keyless
        push), and ``Refused`` for a push over a bound that no other run gives way to."""
        now = self._clock()
        run = run_id(snap)
        key = (snap.namespace, snap.run, snap.rank)
        with self._lock:
            binding = self._keys.admit(run, key_digest, lambda r: self._gives_way(r, now), now)
            if binding == "refused":
                raise WrongRunKey(run)
            if binding in ("bound", "rebound") and self._run_ranks.get(run):  # not this key's ranks
                self._drop_run(run, "keyless" if binding == "bound" else "superseded")
            old = self._ranks.get(key)
            if old is not None and snap.seq and old.snapshot.seq > snap.seq and old.snapshot.instance == snap.instance:
                return []  # a late, reordered push: keep the newer state
            held = len(old.snapshot.samples) if old is not None else 0
            if old is None or len(snap.samples) > held:
                self._admit(snap, run, old is None, held, now)
            if old is None:
                self._run_ranks[run] = self._run_ranks.get(run, 0) + 1
                self._came.setdefault(run, now)
            self._series += len(snap.samples) - held
            self._run_series[run] = self._run_series.get(run, 0) + len(snap.samples) - held
            self._version += 1
            advanced = old is None or snap.step != old.snapshot.step
            if old is not None and advanced and old.snapshot.instance == snap.instance:
                self._trained.add(run)
            stepped = _step_time(snap, old, now) if advanced else old.last_step_advance  # type: ignore[union-attr]
            entry = self._ranks[key] = RankEntry(snap, now, stepped)
            self._next_expiry = min(self._next_expiry, self._deadline(entry))
            if not self._commands.get(run):
                return []  # the common case: nothing queued, so nothing to retire or hand out
            self._retire(run, now)
            done = set(snap.done_commands)
            return [c for c in self._commands.get(run, []) if c.id not in done  # and for this incarnation:
                    and (self._targets.get(c.id) is None or snap.instance in self._targets[c.id])]

    def _admit(self, snap: RankSnapshot, run: RunId, new_rank: bool, held: int, now: float) -> None:
        """Bounds.admit; over a bound, runs that give way are dropped, oldest push first, until it fits."""
        while True:
            try:
                self.bounds.admit(snap, new_rank, len(self._run_ranks), self._run_ranks.get(run),
                                  self._series - held + len(snap.samples),
                                  self._run_series.get(run, 0) - held + len(snap.samples))
                return
            except Refused as exc:
                yielding = [r for r in self._run_ranks if r != run and self._gives_way(r, now)]
                if exc.reason == "max_series_per_run" or not yielding:
                    raise
                self._drop_run(min(yielding, key=lambda r: max((e.last_push for e in self._run_entries(r)),
                                                               default=0.0)), "evicted")

    def _gives_way(self, run: RunId, now: float) -> bool:
        """Every rank ended or down, or none trained in ``squat_seconds`` since it came (a name held by pushes
        alone): its name goes to a push with another key (a relaunch), its room to a new run over a bound."""
        entries = self._run_entries(run)
        return all(e.snapshot.state in ENDED_STATES or not self.is_up(e, now) for e in entries) or (
            run not in self._trained and now - self._came.get(run, now) > self.squat_seconds)

    def _run_entries(self, run: RunId) -> list[RankEntry]:
        return [e for (ns, r, _), e in self._ranks.items() if (ns, r) == run]

    def _drop_run(self, run: RunId, reason: str) -> None:
        """Every rank of ``run`` goes, counted under ``reason``; its commands and training record with them."""
        gone = [(k, e) for k, e in self._ranks.items() if (k[0], k[1]) == run]
        for k, e in gone:
            self._forget(k, e)
        for command in self._commands.pop(run, []):
            self._targets.pop(command.id, None)
        self._trained.discard(run)
        self._came.pop(run, None)
        for _ in gone:
            self._count("dropped", reason)

    def _undone(self, run: RunId, commands: list[Command]) -> list[Command]:
        """Those of ``commands`` some current rank of their incarnation has not carried out (none without ranks)."""
        ranks = self._run_snapshots(run)
        instances = {r.instance for r in ranks}
        return [c for c in commands if not all(c.id in r.done_commands for r in ranks)
                and (self._targets.get(c.id) is None or self._targets[c.id] & instances)]

    def _retire(self, run: RunId, now: float) -> None:
        """Drops the run's commands that every current rank carried out (a restarted job never receives
        them again), that are past their TTL, or whose ranks are all gone (another incarnation)."""
        queue = self._commands.get(run, [])
        self._commands[run] = self._undone(run, [c for c in queue if now - c.created < COMMAND_TTL_SECONDS])
        self._untarget(queue, self._commands[run])

    def _untarget(self, queue: list[Command], kept: list[Command]) -> None:
        """Forgets the targets of the commands of ``queue`` that are not ``kept``."""
        kept_ids = {c.id for c in kept}
        for c in queue:
            if c.id not in kept_ids:
                self._targets.pop(c.id, None)

    def _run_snapshots(self, run: RunId) -> list[RankSnapshot]:
        return [e.snapshot for e in self._run_entries(run)]

    def enqueue(self, command: Command) -> tuple[Enqueued, Command]:
        """Queue a command for its run; returns the outcome and the command the ranks will carry out:
        ``duplicate`` (id queued before), ``coalesced`` (a command of the same action no rank acted on yet
        stands for it, so an alert group of per-rank alerts makes one checkpoint), ``rate_limited`` or ``queued``."""
        with self._lock:
            if command.id in self._seen_commands:
                return "duplicate", command
            run = run_id(command)
            now = self._clock()
            self._retire(run, now)
            queue = self._commands.setdefault(run, [])
            snaps = self._run_snapshots(run)  # no set of every rank's done ids: a storm of alerts comes here
            live = frozenset(e.snapshot.instance for e in self._run_entries(run) if self.is_live(e, now))
            same = next((c for c in queue if c.action == command.action
                         and not any(c.id in snap.done_commands for snap in snaps)
                         and live <= self._targets.get(c.id, live)), None)
            if same is not None:
                return "coalesced", same
            self.bounds.admit_command(command.run, len(queue))  # raises Refused; a coalesced one took no room
            if not self._limits.take(run, command.action, self._clock()):
                return "rate_limited", command
            self._seen_commands[command.id] = command.created
            if len(self._seen_commands) > 10000:
                for cid in sorted(self._seen_commands, key=self._seen_commands.__getitem__)[:1000]:
                    del self._seen_commands[cid]
            self._next_expiry = min(self._next_expiry, command.created + COMMAND_TTL_SECONDS)
            if live:
                self._targets[command.id] = live
            queue.append(command)  # different actions all stay: ranks order them by priority
            return "queued", command

    # --- reads --------------------------------------------------------------------------------
    def _deadline(self, e: RankEntry) -> float:
        """When the rank's series go, unless it pushes again before."""
        return e.last_push + (min(self.expire_after, self.closed_expire_after) if e.snapshot.state == "closed"
                              else self.expire_after)

    def expire(self) -> None:
        """Removes ranks and command queues past their TTL; scans only once something is due (every
        scrape calls this, and a scan per scrape cost more than the scrape)."""
        now = self._clock()
        with self._lock:
            if now < self._next_expiry:
                return
            for key, e in list(self._ranks.items()):
                if now > self._deadline(e):
                    self._forget(key, e)
            self._keys.keep_only({(ns, r) for ns, r, _ in self._ranks})  # a key lives as long as its run's series
            self._limits.expire(now)
            for run, queue in list(self._commands.items()):  # queues of runs no rank pushes for any more
                kept = [c for c in queue if now - c.created < COMMAND_TTL_SECONDS]
                self._untarget(queue, kept)
                if kept:
                    self._commands[run] = kept
                else:
                    del self._commands[run]
            for run in [r for r in self._came if r not in self._run_ranks]:
                self._came.pop(run, None)
                self._trained.discard(run)
            self._next_expiry = min([*(self._deadline(e) for e in self._ranks.values()),
                                     *(c.created + COMMAND_TTL_SECONDS for q in self._commands.values() for c in q)],
                                    default=float("inf"))

    def _forget(self, key: tuple[str, str, int], e: RankEntry) -> None:
        del self._ranks[key]
        self._version += 1
        self._series -= len(e.snapshot.samples)
        run = (key[0], key[1])
        self._run_series[run] -= len(e.snapshot.samples)
        left = self._run_ranks[run] - 1
        if left:
            self._run_ranks[run] = left
        else:
            del self._run_ranks[run]
            del self._run_series[run]

    def entries(self) -> tuple[RankEntry, ...]:
        """Every rank, sorted by (namespace, run, rank)."""
        self.expire()
        with self._lock:
            return tuple(self._ranks[k] for k in sorted(self._ranks))

    def is_up(self, entry: RankEntry, now: float | None = None) -> bool:
        return (entry.snapshot.state != "closed"
                and (self._clock() if now is None else now) - entry.last_push <= self.rank_up_ttl)

    def is_live(self, entry: RankEntry, now: float | None = None) -> bool:
        """The rank can still carry out a command: up, and neither closed nor stopped."""
        return entry.snapshot.state not in ENDED_STATES and self.is_up(entry, now)

    def live_ranks(self, run: str, namespace: str = "") -> int:
        """How many ranks of ``run`` are live on this agent."""
        return sum(1 for e in self.entries() if run_id(e.snapshot) == (namespace, run) and self.is_live(e))

    # --- for /metrics (collectors.ranks.RankSource) -----------------------------------------------
    def state(self) -> tuple[int, tuple[bool, ...]]:
        """Writes and expiries so far, and ``is_up`` of each rank in order (up flips with the clock alone).
        Asked at every scrape: the flags are worked out again only after a write or an up rank's TTL."""
        self.expire()
        now = self._clock()
        with self._lock:
            version, ups, until = self._up_flags
            if version != self._version or now > until:
                entries = [self._ranks[k] for k in sorted(self._ranks)]
                ups = tuple([self.is_up(e, now) for e in entries])
                until = min([e.last_push + self.rank_up_ttl for e, up in zip(entries, ups, strict=True) if up],
                            default=float("inf"))
                self._up_flags = version, ups, until = self._version, ups, until
            return version, ups

    def rows(self) -> list[RankRow]:
        """Every rank's last push and liveness, sorted by (namespace, run, rank)."""
        self.expire()
        now = self._clock()
        with self._lock:
            return [RankRow(e.snapshot, self.is_up(e, now), e.last_push, e.last_step_advance)
                    for e in (self._ranks[k] for k in sorted(self._ranks))]

    def hosts_run(self, run: str, namespace: str = "") -> bool:
        return any(run_id(e.snapshot) == (namespace, run) for e in self.entries())

    def pid_to_rank(self) -> dict[int, tuple[str, str]]:
        return {e.snapshot.pid: (e.snapshot.run, str(e.snapshot.rank)) for e in self.entries() if e.snapshot.pid}

    def pending(self, run: str, namespace: str = "") -> list[Command]:
        """Commands some rank of ``run``'s incarnation has not carried out yet (all, while it has no rank)."""
        with self._lock:
            queue = self._commands.get((namespace, run), [])
            return self._undone((namespace, run), queue) if self._run_entries((namespace, run)) else list(queue)

    def bound_at(self, run: str, namespace: str = "") -> float | None:
        """When the run's key was bound (agent clock; None for a keyless run), for agent.alerts."""
        with self._lock:
            return self._keys.bound_at((namespace, run))

    def all_runs(self) -> list[dict[str, Any]]:
        """The status of every run, in every namespace."""
        out: dict[RunId, list[RankEntry]] = {}
        for e in self.entries():
            out.setdefault(run_id(e.snapshot), []).append(e)
        return [self.run_status(run, ranks, namespace=ns) for (ns, run), ranks in out.items()]

    def runs(self, namespace: str = "") -> dict[str, dict[str, Any]]:
        """The runs of one namespace, by name."""
        return {s["run"]: s for s in self.all_runs() if s["namespace"] == namespace}

    def run_status(self, run: str, ranks: list[RankEntry] | None = None, namespace: str = "") -> dict[str, Any]:
        ranks = ranks if ranks is not None else [e for e in self.entries() if run_id(e.snapshot) == (namespace, run)]
        states = [e.snapshot.state if self.is_up(e) or e.snapshot.state in ENDED_STATES else "down" for e in ranks]
        actions: list[ActionRecord] = sorted((a for e in ranks for a in e.snapshot.actions),
                                             key=lambda a: (a.time, a.id))
        last = actions[-1] if actions else None
        last_outcome = None
        if last is not None:
            same = [a for a in actions if a.id == last.id]
            last_outcome = {"id": last.id, "action": last.action, "step": last.step,
                            "outcome": "failed" if any(a.outcome == "failed" for a in same) else last.outcome,
                            "detail": "; ".join(sorted({a.detail for a in same if a.detail})),
                            "evidence": last.evidence, "ranks_reported": len(same)}
        checkpoints = [e.snapshot.last_checkpoint for e in ranks if e.snapshot.last_checkpoint]
        return {"namespace": namespace, "run": run, "state": _run_state(states),
                "world_size": max((e.snapshot.world_size for e in ranks), default=0),
                "ranks": [{"rank": e.snapshot.rank, "state": s, "step": e.snapshot.step, "host": e.snapshot.host,
                           "last_push": e.last_push, "up": self.is_up(e)} for e, s in zip(ranks, states, strict=False)],
                "last_action": last_outcome, "last_checkpoint": max(checkpoints, default=""),
                "pending_commands": [c.model_dump() for c in self.pending(run, namespace)]}


def _step_time(snap: RankSnapshot, old: RankEntry | None, now: float) -> float:
    """When the rank's step advanced: its own clock to the sub-second, kept between its previous push (the step
    had not advanced then) and this one, so a skewed or lying clock moves it by at most a push interval."""
    earliest = old.last_push if old is not None else now
    return min(max(snap.step_time, earliest), now) if snap.step_time > 0 else now


def _run_state(states: list[str]) -> str:
    if not states:
        return "unknown"
    s = set(states)
    for state in ("stopped", "closed", "paused", "down"):
        if s == {state}:
            return state
    if "stopping" in s or "stopped" in s:
        return "stopping"
    if "pausing" in s or "paused" in s:
        return "pausing"
    if s <= {"running", "closed"}:
        return "running"
    return "degraded"

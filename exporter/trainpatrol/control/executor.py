"""Carries out agreed actions at a step boundary: checkpoint, evidence, pause, resume, stop.

Every rank runs the same code on the same agreed word, so every rank does the same thing at the
same step. A pause waits outside any collective; while paused the ranks meet only in short,
completed rounds, so NCCL timeouts cannot fire. A failed checkpoint keeps the run paused; a stop whose
checkpoint failed stops all the same, saying that nothing was saved. A
checkpoint records whether its state is finite; ``restore("latest")`` takes the newest finite one.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable, Mapping
from concurrent.futures import Future
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import torch

from ..actions import PRIORITY, STOP_EXIT_CODE
from . import checkpoint as ckpt
from . import sharded
from .commands import CommandBook, RunRecord
from .coordinator import Agreement, Coordinator
from .evidence import EvidenceWriter
from .state_file import Stager

log = logging.getLogger("trainpatrol")


@dataclass(frozen=True)
class RankFacts:
    """Who this rank is and how it waits while paused: fixed for the run."""

    run: str
    rank: int
    world_size: int
    device: torch.device
    guard_actions: Mapping[str, str]
    pause_timeout_seconds: float
    pause_poll_seconds: float
    background_saves: bool = False
    """Whether a ``checkpoint`` action's state is written in the background (PatrolConfig.background_checkpoints)."""


@dataclass(frozen=True)
class InAction:
    action: str
    step: int
    began: float
    """``time.perf_counter()`` when the action began."""


class Executor:
    def __init__(self, facts: RankFacts, *, checkpointer: ckpt.Checkpointer, coordinator: Coordinator,
                 commands: CommandBook, record: RunRecord, evidence: EvidenceWriter, training: ckpt.TrainingState,
                 control_word: Callable[[], list[int]], announce: Callable[[], object],
                 context: Callable[[], dict[str, Any]], rearm_guards: Callable[[], None]) -> None:
        """``control_word``: this rank's word for the next exchange; ``announce``: push the state now;
        ``context``: what evidence adds about the rank (loader audit, guard trips, validation history)."""
        self.facts, self.checkpointer, self.coordinator = facts, checkpointer, coordinator
        self.commands, self.record, self.evidence, self.training = commands, record, evidence, training
        self._control_word, self._announce, self._context = control_word, announce, context
        self._rearm_guards = rearm_guards
        self._known: dict[int, dict[str, Any]] = {}
        self._stager = Stager()
        self._shard_writer = sharded.BackgroundWriter()
        self._staged: tuple[int, Callable[[], dict[str, Any]], dict[str, Any], float] | None = None
        """A ``checkpoint`` action's write left to a thread: (step, what makes it durable and returns what meta.json
        adds, meta, when the checkpoint began). Rank 0's staged replicated state, or every rank's staged shards."""
        self._writer: threading.Thread | None = None
        self._reserved = not (facts.background_saves and facts.device.type == "cuda")  # nothing to pin ahead
        self._reserving: threading.Thread | None = None
        self.in_action: InAction | None = None
        """The action holding the training thread now, for the stall watch (an action holds every rank at once)."""

    def reserve_staging(self) -> None:
        """At a step boundary after the first optimizer step (its state exists then), with background saves on a
        GPU: a thread pins the host memory the first ``checkpoint`` stages into, once per run, so that checkpoint
        is held only for the copy, not for pinning (slower than the copy by fifty times)."""
        if self._reserved:
            return
        self._reserved = True
        f, training = self.facts, self.training
        if training.sharded():  # DCP's stager keeps its buffers only by staging into them: one copy, discarded
            work: Callable[[], object] = partial(self._shard_writer.stage, training.sharded_state(), on_gpu=True)
        elif f.rank == 0:  # only rank 0 writes the replicated state
            work = partial(self._stager.reserve, training.replicated(0))
        else:
            return

        def reserve() -> None:
            # this rank's device, and a stream of its own: the discarded copy never delays the training's kernels
            try:
                with torch.cuda.device(f.device), torch.cuda.stream(torch.cuda.Stream(f.device)):
                    work()
            except Exception as exc:  # the first checkpoint allocates what is missing, holding training meanwhile
                log.warning("trainpatrol: rank %d: host memory for background checkpoints not reserved: %s",
                            f.rank, exc)

        self._reserving = threading.Thread(target=reserve, name="trainpatrol-reserve-staging", daemon=True)
        self._reserving.start()

    def _wait_for_reservation(self) -> None:
        if self._reserving is not None:
            self._reserving.join()

    def wait_for_write(self) -> None:
        """Until the checkpoint being written in the background (at most one) is durable or has failed."""
        if self._writer is not None:
            self._writer.join()
            self._writer = None

    def wait(self) -> None:
        """Until the work left to threads is done: a checkpoint being written, a report being rendered."""
        self.wait_for_write()
        self.evidence.wait()

    def close(self) -> None:
        """``wait``, then free the host buffers that shards were staged in."""
        self.wait()
        self._wait_for_reservation()
        self._shard_writer.close()

    # --- entry --------------------------------------------------------------------------------
    def execute(self, agreed: Agreement) -> None:
        commands = {a: cid for a, cid in agreed.commands.items() if cid not in self.commands.done}
        self._known = {c["id"]: c for c in self.commands.pending().values()}
        self.commands.mark_done(agreed.commands.values())
        if not commands:
            return
        # A resume agreed with a pause came after it (a running run has nothing to resume): the pause is
        # carried out, then the resume, so an operator's quick pause and resume never leaves the run paused.
        resume = commands.pop("resume", None)
        if resume is not None and "pause" not in commands:
            self.record.action(resume, "resume", "skipped", agreed.step, "run was not paused")
            resume = None
        if "empty_cache" in commands and len(commands) > 1:
            # nothing else releases cached blocks, so it runs too, before the stronger action
            cid = commands.pop("empty_cache")
            self._act("empty_cache", cid, agreed, self._trigger(cid, "empty_cache"))
        if not commands:
            return
        primary = max(commands, key=PRIORITY.__getitem__)
        if resume is not None and primary != "pause":
            self.record.action(resume, "resume", "skipped", agreed.step, f"covered by {primary} at the same step")
            resume = None
        for action, cid in commands.items():
            if action != primary:  # a checkpoint or capture is part of what the stronger action writes
                self.record.action(cid, action, "skipped", agreed.step, f"covered by {primary} at the same step")
        trigger = self._trigger(commands[primary], primary)
        ok = self._act(primary, commands[primary], agreed, trigger)
        if primary == "stop":  # as the operator asked, also when its checkpoint failed (its detail says so)
            self._stop()
        if primary == "pause" or (not ok and primary == "checkpoint"):
            self._pause(agreed, resume)

    # --- one action ---------------------------------------------------------------------------
    def _act(self, action: str, cid: int, agreed: Agreement, trigger: dict[str, Any]) -> bool:
        self.in_action = InAction(action, agreed.step, time.perf_counter())
        try:
            return self._carry_out(action, cid, agreed, trigger)
        finally:
            self.in_action = None

    def _carry_out(self, action: str, cid: int, agreed: Agreement, trigger: dict[str, Any]) -> bool:
        f, record, step = self.facts, self.record, agreed.step
        record.state = {"pause": "pausing", "stop": "stopping"}.get(action, record.state)
        detail, path, ok = "", "", True
        facts: dict[str, Any] = {}
        blocked_from = time.perf_counter()
        if action in ("checkpoint", "pause", "stop"):
            # a checkpoint action returns to training once its state is staged; a pause or a stop reports ok
            # only once its checkpoint is durable
            ok, path, detail, facts = self._checkpoint(step, pinned=action in ("pause", "stop"), reason=trigger,
                                                       write=f"{int(agreed.clock)}-{cid}",
                                                       background=action == "checkpoint" and f.background_saves)
            if not ok and action == "stop":
                last = self.checkpointer.latest()
                detail += (f"; stopping all the same: nothing was saved at step {step}; the last complete "
                           f"checkpoint is {last or 'none'}")
            # what the report says this checkpoint cost: training held by it, and by every checkpoint so far
            facts = {**facts, "training_held_seconds": round(time.perf_counter() - blocked_from, 4),
                     "training_held_seconds_total": round(record.checkpoint_blocked_seconds, 4),
                     "background": self._staged is not None}
        if action == "empty_cache" and f.device.type == "cuda":
            torch.cuda.empty_cache()
        bundle = self.evidence.bundle(agreed.clock, step, action)
        try:
            self.evidence.part(bundle, {"checkpoint": path, "outcome": "ok" if ok else "failed", "detail": detail,
                                        "trigger": trigger, **facts, **self._context()})
        except OSError as exc:
            detail = (detail + "; " if detail else "") + f"evidence not written: {exc}"
            log.error("trainpatrol: %s", detail)
        self.coordinator.all_true(True)  # every rank's part is on disk before rank 0 indexes the bundle
        if f.rank == 0:
            try:
                self.evidence.index(bundle, {"action": action, "command_id": cid, "step": step, "run": f.run,
                                             "world_size": f.world_size, "time": agreed.clock,
                                             "checkpoint": path, "checkpoint_ok": ok, **facts,
                                             **self._checkpoint_landmarks()}, trigger)
            except OSError as exc:
                detail = (detail + "; " if detail else "") + f"evidence manifest not written: {exc}"
                log.error("trainpatrol: %s", detail)
        record.last_evidence = str(bundle)
        if self._staged is not None:  # the outcome is recorded once the state is durable
            self._write_in_background(cid, str(bundle))
        else:
            record.action(cid, action, "ok" if ok else "failed", step, detail, path, str(bundle))
        if action in ("checkpoint", "pause", "stop"):
            record.checkpoint_blocked_seconds += time.perf_counter() - blocked_from
        return ok

    def _checkpoint(self, step: int, pinned: bool, reason: dict[str, Any], write: str,
                    background: bool = False) -> tuple[bool, str, str, dict[str, Any]]:
        """(ok, path, detail, facts): facts say, on rank 0, whether the state is finite and if it is the best.
        ``write``: names this write the same on every rank (its shards' directory). ``background``: the state is
        staged in host memory and written after training resumes (rank 0's replicated state; every rank's shards).
        Every rank makes the same collective calls whatever fails, so none waits for ever."""
        rank, checkpointer, training = self.facts.rank, self.checkpointer, self.training
        self.wait_for_write()  # at most one checkpoint in flight
        self._wait_for_reservation()
        began = time.perf_counter()
        facts: dict[str, Any] = {}
        best, training.best_pending = training.best_pending, None
        shards = training.sharded()  # the same on every rank
        shard_dir = f"{sharded.PREFIX}{write}"
        error, bad = "", []
        state: dict[str, Any] = {}
        replicated: dict[str, Any] | None = None
        staged: Any = None
        in_flight: Future[Any] | None = None
        if background and shards:
            self._shard_writer.join_group()
        try:
            if rank == 0:
                checkpointer.check_room()
            if shards:
                state = training.sharded_state()
                bad = ckpt.nonfinite_entries(state)  # this rank's shards
                if background:  # only this copy into host memory blocks training
                    state = self._shard_writer.stage(state, on_gpu=self.facts.device.type == "cuda")
            replicated = training.replicated(step, sharded=shards) if rank == 0 else None
            if replicated is not None and not shards:
                bad = ckpt.nonfinite_entries(replicated)
        except Exception as exc:
            error = f"rank {rank}: checkpoint not taken: {exc}"
        if self.coordinator.all_true(not error):
            finite = self.coordinator.all_true(not bad)
            if not finite and not bad:
                bad = ["(on another rank's shards)"]
            incident = checkpointer.incident() if not finite and pinned else None
            if incident is not None:  # a sick run paused again: its state was saved once, at the incident's start
                detail = (f"state non-finite ({ckpt.describe_nonfinite({'nonfinite': bad})}), as in {incident.name}, "
                          f"this incident's first checkpoint: not written again")
                log.error("trainpatrol: %s", detail)
                return True, str(incident), detail, {"finite": False, "same_incident_as": str(incident)}
            where = checkpointer.path_for(step) / shard_dir
            if background and not shards and replicated is not None:
                try:  # the state waits in host memory; only this copy blocks training
                    staged_state, replicated = self._stager.stage(replicated), None
                    staged = partial(self._durable_replicated, checkpointer.path_for(step), staged_state)
                except Exception as exc:
                    error = f"rank {rank}: checkpoint not staged: {exc}"
            if background and shards:
                error = error or self._write(step, False, where, {}, replicated)
                if not error:
                    in_flight = self._shard_writer.write(where, state)
                    staged = partial(self._durable_shards, where, in_flight)
            else:
                error = error or self._write(step, shards, where, state, replicated)
        detail = error
        if rank == 0 and not error:
            facts = {"finite": not bad, "nonfinite": bad[:ckpt.NONFINITE_NAMES_KEPT], "nonfinite_count": len(bad)}
            if best is not None:
                facts["best"] = {"validation_loss": best}
        ok = self.coordinator.all_true(not error)
        path = str(checkpointer.path_for(step))
        meta = {"world_size": self.facts.world_size, "pinned": pinned, "run": self.facts.run, "reason": reason, **facts}
        if ok and staged is not None:
            self._staged = (step, staged, meta, began)
            return True, path, "writing in the background", facts
        if ok and rank == 0:
            try:
                layout = {"format": "dcp", "dcp": shard_dir,
                          "shards": sharded.files(checkpointer.path_for(step) / shard_dir)} if shards else {}
                checkpointer.commit(step, {**meta, **layout})
            except Exception as exc:
                ok, detail = False, f"rank 0: checkpoint commit failed: {exc}"
                log.error("trainpatrol: %s", detail)
        ok = self.coordinator.all_true(ok)
        if not ok:  # no partial step directory stays: every rank's share goes, then the directory
            if in_flight is not None:  # another rank failed after this one's shards went to DCP's writer
                with contextlib.suppress(Exception):
                    in_flight.result()
            with contextlib.suppress(OSError):
                checkpointer.discard(step, rank)
            self.coordinator.all_true(True)
            if rank == 0:
                checkpointer.discard_incomplete(step)
            self.record.checkpoint_failures += 1
            return False, "", detail or "checkpoint failed on another rank", {}
        self.record.checkpointed(path, step)
        self.record.last_checkpoint_write_seconds = time.perf_counter() - began
        if facts.get("finite") is False:
            good = checkpointer.last_good()
            detail = (f"checkpoint holds {ckpt.describe_nonfinite(facts)}; restore('latest') passes over it; "
                      f"last good checkpoint: {good or 'none'}")
            log.error("trainpatrol: %s", detail)
        return True, path, detail, facts

    @staticmethod
    def _durable_replicated(path: Path, staged: Any) -> dict[str, Any]:
        ckpt.write_state(path, staged)
        return {}

    @staticmethod
    def _durable_shards(where: Path, written: Future[Any]) -> dict[str, Any]:
        written.result()  # every rank's shards and DCP's metadata are written (DCP gathered the ranks' results)
        return {"format": "dcp", "dcp": where.name, "shards": sharded.files(where)}

    def _write_in_background(self, cid: int, bundle: str) -> None:
        """The staged state is made durable on a thread while training goes on; then rank 0 commits the checkpoint
        and each rank records the action's outcome. A failure removes what was written: ``latest`` is never a half
        checkpoint."""
        assert self._staged is not None
        (step, durable, meta, began), self._staged = self._staged, None
        checkpointer, record, rank = self.checkpointer, self.record, self.facts.rank
        path = checkpointer.path_for(step)

        def write() -> None:
            try:
                layout = durable()
                if rank == 0:
                    checkpointer.commit(step, {**meta, **layout})
            except Exception as exc:
                detail = f"rank {rank}: checkpoint failed: {exc}; the previous checkpoint is intact"
                log.error("trainpatrol: %s", detail)
                checkpointer.discard(step, rank)
                if rank == 0:
                    checkpointer.discard_incomplete(step)
                record.checkpoint_failures += 1
                record.action(cid, "checkpoint", "failed", step, detail, "", bundle)
                # as a failed checkpoint at the boundary does, this one pauses the run (at the next boundary)
                self.commands.request("pause", f"the checkpoint of step {step} failed: {exc}", source="checkpoint")
                return
            record.checkpointed(str(path), step)
            record.last_checkpoint_write_seconds = time.perf_counter() - began
            detail = "" if meta.get("finite", True) else \
                f"checkpoint holds {ckpt.describe_nonfinite(meta)}; restore('latest') passes over it"
            record.action(cid, "checkpoint", "ok", step, detail, str(path), bundle)

        self._writer = threading.Thread(target=write, name="trainpatrol-checkpoint-writer", daemon=True)
        self._writer.start()

    def _write(self, step: int, shards: bool, shard_dir: Path, state: dict[str, Any],
               replicated: dict[str, Any] | None) -> str:
        """Write this rank's part; returns what failed ("" when nothing did)."""
        rank = self.facts.rank
        try:
            if shards:  # every rank writes its shards (DCP raises on every rank when one fails)
                sharded.save(shard_dir, state)
            self.checkpointer.save_rank(step, rank, replicated, self.training.per_rank(step))
        except Exception as exc:
            error = f"rank {rank}: checkpoint failed: {exc}"
            log.error("trainpatrol: %s; the previous checkpoint is intact", error)
            return error
        return ""

    def _checkpoint_landmarks(self) -> dict[str, Any]:
        """The checkpoints a reader of the evidence wants next to the one just written."""
        good, best = self.checkpointer.last_good(), self.checkpointer.best()
        marks: dict[str, Any] = {"last_good_checkpoint": str(good or "")}
        if best is not None:
            marks["best_checkpoint"] = str(best)
            marks["best_validation_loss"] = ckpt.read_meta(best).get("best", {}).get("validation_loss")
        return marks

    def _trigger(self, cid: int, action: str) -> dict[str, Any]:
        """The request as this rank heard it, or a note that only another rank heard it."""
        return self._known.get(cid) or {"id": cid, "action": action, "source": "agreed with another rank"}

    # --- pause and stop -----------------------------------------------------------------------
    def _pause(self, agreed: Agreement, resume: int | None = None) -> None:
        """Wait, outside any collective but the control rounds, until a resume (``resume``: one already agreed)."""
        run, record = self.facts.run, self.record
        record.state = "paused"
        self._announce()
        log.warning("trainpatrol: run %s paused at step %d; resume with `trainpatrol resume %s`",
                    run, agreed.step, run)
        if resume is not None:
            self._resume(resume, agreed.step)
            return
        started = time.monotonic()
        timeout = self.facts.pause_timeout_seconds
        while True:
            time.sleep(self.facts.pause_poll_seconds)
            if timeout and time.monotonic() - started > timeout:
                self.commands.request("stop", f"paused longer than {timeout:g} s", source="pause_timeout")
            now = self.coordinator.blocking_exchange(self._control_word(), agreed.step)
            fresh = {a: c for a, c in now.commands.items() if c not in self.commands.done}
            self._known = {c["id"]: c for c in self.commands.pending().values()}
            self.commands.mark_done(now.commands.values())
            if "stop" in fresh:
                self._act("stop", fresh["stop"], now, self._trigger(fresh["stop"], "stop"))
                self._stop()
            for action in ("checkpoint", "capture", "empty_cache"):
                if action in fresh:
                    self._act(action, fresh[action], now, self._trigger(fresh[action], action))
            if "resume" in fresh:
                self._resume(fresh["resume"], agreed.step)
                return

    def _resume(self, cid: int, step: int) -> None:
        # a person resumed: a fault that persists, or comes back, must stop the run again
        self._rearm_guards()
        acting = ", ".join(f"{g} -> {a}" for g, a in self.facts.guard_actions.items()) or "none"
        self.record.action(cid, "resume", "ok", step,
                           f"guards re-armed; if the fault persists they act again ({acting})")
        self.record.state = "running"
        self._announce()
        log.warning("trainpatrol: run %s resumed at step %d; guards re-armed: if the fault persists they act "
                    "again (%s)", self.facts.run, step, acting)

    def _stop(self) -> None:
        self.wait()  # the process exits next
        self.record.state = "stopped"
        self._announce()
        log.warning("trainpatrol: run %s stopped; exiting with code %d", self.facts.run, STOP_EXIT_CODE)
        raise SystemExit(STOP_EXIT_CODE)

    # --- restore ------------------------------------------------------------------------------
    def restore(self, path: str | Path) -> ckpt.Restored:
        """Loads the checkpoint into the training state; the caller continues counting from its step."""
        self.wait_for_write()
        skipped: list[str] = []
        if str(path) == "latest":
            target, skipped = self.checkpointer.latest_finite()
            if target is None:
                why = (f"nothing to restore: no complete checkpoint with finite state under "
                       f"{str(self.checkpointer.directory)!r}")
                if skipped:
                    why += f" (passed over {'; '.join(skipped)})"
                log.warning("trainpatrol: %s; starting fresh", why)
                return ckpt.Restored(reason=why, skipped=tuple(skipped))
            reason = "the newest checkpoint with finite state" if skipped else "the newest checkpoint"
        else:
            target, reason = Path(path), "asked for by path"
        meta, replicated, per_rank = ckpt.load(target, self.facts.rank, map_location=self.facts.device)
        if meta.get("format") == "dcp":  # every rank reads its shards, resharded where the world size changed
            self.training.load_sharded(target / str(meta["dcp"]))
        epoch = self.training.load(replicated, per_rank)
        step = int(meta["step"])
        self.record.last_checkpoint = str(target)
        if meta.get("finite") is False:
            log.error("trainpatrol: %s holds %s", target, ckpt.describe_nonfinite(meta))
        passed = f"; passed over {'; '.join(skipped)}" if skipped else ""
        log.warning("trainpatrol: restored %s (step %d): %s%s", target, step, reason, passed)
        return ckpt.Restored(step=step, path=str(target), reason=reason, skipped=tuple(skipped), epoch=epoch)

    def best_validation_loss(self) -> float | None:
        """The best validation loss among the checkpoints (a new best must beat it)."""
        best = self.checkpointer.best()
        return None if best is None else float(ckpt.read_meta(best)["best"]["validation_loss"])

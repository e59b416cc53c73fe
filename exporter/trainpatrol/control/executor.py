"""Carries out agreed actions at a step boundary: checkpoint, evidence, pause, resume, stop.

Every rank runs the same code on the same agreed word, so every rank does the same thing at the
same step. A pause waits outside any collective; while paused the ranks meet only in short,
completed rounds, so NCCL timeouts cannot fire. A failed checkpoint keeps the run paused. A
checkpoint records whether its state is finite; ``restore("latest")`` takes the newest finite one.
"""

from __future__ import annotations

import logging
import time
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from ..actions import PRIORITY, STOP_EXIT_CODE
from ..protocol import ActionRecord
from ..report import write_report_quietly
from . import checkpoint as ckpt
from .coordinator import Agreement
from .evidence import bundle_name, fetch_nvml, write_manifest, write_rank_part

if TYPE_CHECKING:
    from ..probe.patrol import Patrol

log = logging.getLogger("trainpatrol")


class Executor:
    def __init__(self, patrol: Patrol) -> None:
        self.p = patrol
        self._known: dict[int, dict[str, Any]] = {}

    # --- entry --------------------------------------------------------------------------------
    def execute(self, agreed: Agreement) -> None:
        p = self.p
        commands = {a: cid for a, cid in agreed.commands.items() if cid not in p._done}
        self._known = {c["id"]: c for c in p.take_pending().values()}
        p.mark_done(agreed.commands.values())
        if not commands:
            return
        if "resume" in commands:
            self._record(commands.pop("resume"), "resume", "skipped", agreed.step, "run was not paused")
        if "empty_cache" in commands and len(commands) > 1:
            # nothing else releases cached blocks, so it runs too, before the stronger action
            cid = commands.pop("empty_cache")
            self._act("empty_cache", cid, agreed, self._trigger(cid, "empty_cache"))
        if not commands:
            return
        primary = max(commands, key=PRIORITY.__getitem__)
        for action, cid in commands.items():
            if action != primary:  # a checkpoint or capture is part of what the stronger action writes
                self._record(cid, action, "skipped", agreed.step, f"covered by {primary} at the same step")
        trigger = self._trigger(commands[primary], primary)
        ok = self._act(primary, commands[primary], agreed, trigger)
        if primary == "stop" and ok:
            self._stop()
        if primary == "pause" or (not ok and primary in ("checkpoint", "stop")):
            self._pause(agreed)

    # --- one action ---------------------------------------------------------------------------
    def _act(self, action: str, cid: int, agreed: Agreement, trigger: dict[str, Any]) -> bool:
        p = self.p
        step = agreed.step
        p.state = {"pause": "pausing", "stop": "stopping"}.get(action, p.state)
        detail, path, ok = "", "", True
        facts: dict[str, Any] = {}
        if action in ("checkpoint", "pause", "stop"):
            ok, path, detail, facts = self._checkpoint(step, pinned=action in ("pause", "stop"), reason=trigger)
        if action == "empty_cache" and p.device.type == "cuda":
            torch.cuda.empty_cache()
        bundle = Path(p.config.evidence_dir) / bundle_name(agreed.clock, step, action)
        audit = asdict(p._audit) if p._audit is not None else None
        try:
            write_rank_part(bundle, p.identity.rank, history=p.history.dump(), device=p.device,
                            nvml=fetch_nvml(p.config.agent_url, p.config.token), config=p.config_dict(),
                            extra={"checkpoint": path, "outcome": "ok" if ok else "failed", "detail": detail,
                                   "trigger": trigger, "loader_audit": audit, **facts,
                                   "guard_trips": list(p.guards.trip_log),
                                   "validation_history": list(p.validation_history)})
        except OSError as exc:
            detail = (detail + "; " if detail else "") + f"evidence not written: {exc}"
            log.error("trainpatrol: %s", detail)
        p.coordinator.all_true(True)  # every rank's part is on disk before rank 0 indexes the bundle
        if p.identity.rank == 0:
            try:
                write_manifest(bundle, {"action": action, "command_id": cid, "step": step, "run": p.config.run,
                                        "world_size": p.identity.world_size, "time": agreed.clock,
                                        "checkpoint": path, "checkpoint_ok": ok, **facts,
                                        **self._checkpoint_landmarks()}, trigger)
                write_report_quietly(bundle)
            except OSError as exc:
                detail = (detail + "; " if detail else "") + f"evidence manifest not written: {exc}"
                log.error("trainpatrol: %s", detail)
        p.last_evidence = str(bundle)
        self._record(cid, action, "ok" if ok else "failed", step, detail, path, str(bundle))
        return ok

    def _checkpoint(self, step: int, pinned: bool, reason: dict[str, Any]) -> tuple[bool, str, str, dict[str, Any]]:
        """(ok, path, detail, facts): facts say, on rank 0, whether the state is finite and if it is the best."""
        p = self.p
        rank = p.identity.rank
        detail = ""
        facts: dict[str, Any] = {}
        best, p.best_pending = p.best_pending, None
        try:
            replicated = self._replicated_state(step) if rank == 0 else None
            if replicated is not None:
                bad = ckpt.nonfinite_entries(replicated)
                facts = {"finite": not bad, "nonfinite": bad[:ckpt.NONFINITE_NAMES_KEPT], "nonfinite_count": len(bad)}
                if best is not None:
                    facts["best"] = {"validation_loss": best}
            per_rank = {"step": step, "rng": ckpt.rng_state(), "loader": p.loader_tracker.state(),
                        "extra": p.extra_state() if p.extra_state is not None else None}
            p.checkpointer.save_rank(step, rank, replicated, per_rank)
            ok = True
        except Exception as exc:
            ok, detail = False, f"rank {rank}: checkpoint failed: {exc}"
            log.error("trainpatrol: %s; the previous checkpoint is intact", detail)
        ok = p.coordinator.all_true(ok)
        path = str(p.checkpointer.path_for(step))
        if ok and rank == 0:
            try:
                p.checkpointer.commit(step, {"world_size": p.identity.world_size, "pinned": pinned,
                                             "run": p.config.run, "reason": reason, **facts})
            except Exception as exc:
                ok, detail = False, f"rank 0: checkpoint commit failed: {exc}"
                log.error("trainpatrol: %s", detail)
        ok = p.coordinator.all_true(ok)
        if not ok:
            p.totals.checkpoint_failures += 1
            return False, "", detail or "checkpoint failed on another rank", {}
        p.last_checkpoint = path
        p.latest.last_checkpoint_time, p.latest.last_checkpoint_step = time.time(), float(step)
        if facts.get("finite") is False:
            good = p.checkpointer.last_good()
            detail = (f"checkpoint holds {ckpt.describe_nonfinite(facts)}; restore('latest') passes over it; "
                      f"last good checkpoint: {good or 'none'}")
            log.error("trainpatrol: %s", detail)
        return True, path, detail, facts

    def _checkpoint_landmarks(self) -> dict[str, Any]:
        """The checkpoints a reader of the evidence wants next to the one just written."""
        c = self.p.checkpointer
        good, best = c.last_good(), c.best()
        marks: dict[str, Any] = {"last_good_checkpoint": str(good or "")}
        if best is not None:
            marks["best_checkpoint"] = str(best)
            marks["best_validation_loss"] = ckpt.read_meta(best).get("best", {}).get("validation_loss")
        return marks

    def _replicated_state(self, step: int) -> dict[str, Any]:
        p = self.p
        state: dict[str, Any] = {"step": step}
        for name in ("model", "optimizer", "scheduler", "scaler"):
            obj = getattr(p, name)
            if obj is not None:
                state[name] = obj.state_dict()
        return state

    def _record(self, cid: int, action: str, outcome: str, step: int, detail: str = "", path: str = "",
                evidence: str = "") -> None:
        p = self.p
        p.actions.append(ActionRecord(id=cid, action=action, outcome=outcome, step=step,  # type: ignore[arg-type]
                                      time=time.time(), detail=detail, checkpoint=path, evidence=evidence))
        key = (action, outcome)
        p.totals.actions[key] = p.totals.actions.get(key, 0) + 1
        log.warning("trainpatrol: %s at step %d: %s %s", action, step, outcome, detail)

    def _trigger(self, cid: int, action: str) -> dict[str, Any]:
        """The request as this rank heard it, or a note that only another rank heard it."""
        return self._known.get(cid) or {"id": cid, "action": action, "source": "agreed with another rank"}

    # --- pause and stop -----------------------------------------------------------------------
    def _pause(self, agreed: Agreement) -> None:
        p = self.p
        p.state = "paused"
        p.publisher.push_now()
        log.warning("trainpatrol: run %s paused at step %d; resume with `trainpatrol resume %s`",
                    p.config.run, agreed.step, p.config.run)
        started = time.monotonic()
        timeout = p.config.pause_timeout_seconds
        while True:
            time.sleep(p.config.pause_poll_seconds)
            if timeout and time.monotonic() - started > timeout:
                p.request("stop", f"paused longer than {timeout:g} s", source="pause_timeout")
            word = p.control_word()
            now = p.coordinator.blocking_exchange(word, agreed.step)
            fresh = {a: c for a, c in now.commands.items() if c not in p._done}
            self._known = {c["id"]: c for c in p.take_pending().values()}
            p.mark_done(now.commands.values())
            if "stop" in fresh:
                self._act("stop", fresh["stop"], now, self._trigger(fresh["stop"], "stop"))
                self._stop()
            for action in ("checkpoint", "capture", "empty_cache"):
                if action in fresh:
                    self._act(action, fresh[action], now, self._trigger(fresh[action], action))
            if "resume" in fresh:
                # a person resumed: a fault that persists, or comes back, must stop the run again
                p.guards.rearm()
                acting = ", ".join(f"{g} -> {a}" for g, a in p.config.guard_actions.items()) or "none"
                self._record(fresh["resume"], "resume", "ok", agreed.step,
                             f"guards re-armed; if the fault persists they act again ({acting})")
                p.state = "running"
                p.publisher.push_now()
                log.warning("trainpatrol: run %s resumed at step %d; guards re-armed: if the fault persists they act "
                            "again (%s)", p.config.run, agreed.step, acting)
                return

    def _stop(self) -> None:
        p = self.p
        p.state = "stopped"
        p.publisher.push_now()
        log.warning("trainpatrol: run %s stopped; exiting with code %d", p.config.run, STOP_EXIT_CODE)
        raise SystemExit(STOP_EXIT_CODE)

    # --- restore ------------------------------------------------------------------------------
    def restore(self, path: str | Path) -> ckpt.Restored:
        p = self.p
        skipped: list[str] = []
        if str(path) == "latest":
            target, skipped = p.checkpointer.latest_finite()
            if target is None:
                why = (f"nothing to restore: no complete checkpoint with finite state under "
                       f"{str(p.checkpointer.directory)!r}")
                if skipped:
                    why += f" (passed over {'; '.join(skipped)})"
                log.warning("trainpatrol: %s; starting fresh", why)
                return ckpt.Restored(reason=why, skipped=tuple(skipped))
            reason = "the newest checkpoint with finite state" if skipped else "the newest checkpoint"
        else:
            target, reason = Path(path), "asked for by path"
        meta, replicated, per_rank = ckpt.load(target, p.identity.rank, map_location=p.device)
        for name in ("model", "optimizer", "scheduler", "scaler"):
            obj = getattr(p, name)
            if obj is not None and name in replicated:
                obj.load_state_dict(replicated[name])
        if "rng" in per_rank:
            ckpt.set_rng_state(per_rank["rng"])
        # the loader replays its epoch's start from its own RNG, then the checkpoint's RNG is set again
        epoch = p.loader_tracker.restore(per_rank.get("loader"), lambda: ckpt.set_rng_state(per_rank["rng"]))
        if p.load_extra_state is not None and per_rank.get("extra") is not None:
            p.load_extra_state(per_rank["extra"])
        step = int(meta["step"])
        p.start_at(step)
        p.last_checkpoint = str(target)
        best = p.checkpointer.best()
        if best is not None:
            p.restored_best(float(ckpt.read_meta(best)["best"]["validation_loss"]))
        if meta.get("finite") is False:
            log.error("trainpatrol: %s holds %s", target, ckpt.describe_nonfinite(meta))
        passed = f"; passed over {'; '.join(skipped)}" if skipped else ""
        log.warning("trainpatrol: restored %s (step %d): %s%s", target, step, reason, passed)
        return ckpt.Restored(step=step, path=str(target), reason=reason, skipped=tuple(skipped), epoch=epoch)

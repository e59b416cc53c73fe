"""What the rank reports (``RankReport``): the push snapshot, the host-memory reading taken as it is built, and the
evidence of an out-of-memory error."""

from __future__ import annotations

import itertools
import logging
import os
import secrets
import threading
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

from ..control.commands import RunRecord
from ..control.evidence import EvidenceWriter
from ..loader_audit import LoaderAudit, audit
from .config import PatrolConfig
from .flops import peak_flops
from .guards import Guards
from .host_memory import HostMemory, worker_pids
from .identity import Identity
from .loader import LoaderTracker
from .metrics_state import samples
from .publisher import Publisher
from .stall_watch import StallWatch
from .step_recorder import StepRecorder
from .workload import Workload

log = logging.getLogger("trainpatrol")


def config_dict(config: PatrolConfig) -> dict[str, Any]:
    """The config as evidence bundles and checkpoints carry it: without the token and the run key."""
    d = asdict(config)
    d.pop("token", None)
    d.pop("run_key", None)
    d["memory_reader"] = repr(config.memory_reader)
    return d


class RankReport:
    def __init__(self, config: PatrolConfig, identity: Identity, workload: Workload, recorder: StepRecorder,
                 guards: Guards, record: RunRecord, host_memory: HostMemory, loader_tracker: LoaderTracker,
                 done_commands: Any, validation_history: Any) -> None:
        self.config, self.identity, self.workload, self.recorder = config, identity, workload, recorder
        self.guards, self.record, self.host_memory, self.loader_tracker = guards, record, host_memory, loader_tracker
        self._done_commands, self._validation_history = done_commands, validation_history
        self._audit_logged: set[str] = set()
        self.audit: LoaderAudit | None = None
        self.publisher: Publisher | None = None
        """Set once it exists (it takes ``snapshot``): its dropped pushes and its thread's CPU time are reported."""
        self._publisher_seen = (time.perf_counter(), 0.0)
        self._publisher_share = 0.0
        self.seq = 0
        self._instance = secrets.token_hex(8)
        restarts = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
        self._restarts = int(restarts) if restarts.isdigit() else 0
        self.stall_watch: StallWatch | None = None
        """Set once it exists: each push says whether the training thread is stuck, and where."""
        self.device_name = ""
        """The rank's GPU as torch names it ("NVIDIA H200"), for its peak FLOP/s; "" off a GPU."""
        self.compute_dtype = ""
        """The dtype the model computes in (probe.flops.dtype_name), seen at its first forward."""
        self.flops_per_token, self.flops_per_step = config.flops_per_token, config.flops_per_step
        """The model's FLOPs: as configured, or (per token) as a framework integration counts them."""

    def snapshot(self) -> dict[str, Any]:
        """The push payload (see trainpatrol.protocol.RankSnapshot). From the training thread it holds
        every step so far; from the publisher's, CPU values may be ``readback_lag_seconds`` late, as on CUDA."""
        recorder = self.recorder
        if recorder.rows_waiting and threading.get_ident() == recorder.owner:
            recorder.fold_in()
        self._read_host_memory()
        if self.stall_watch is not None:
            recorder.latest.stalled_phase = self.stall_watch.check()
        self.seq += 1
        ident, totals, record, now = self.identity, recorder.totals, self.record, time.time()
        return {
            "run": self.config.run, "rank": ident.rank, "instance": self._instance, "local_rank": ident.local_rank,
            "world_size": ident.world_size, "host": ident.host, "pid": os.getpid(), "gpu_uuid": ident.gpu_uuid,
            **self.workload.fields(),
            "restart_count": self._restarts, **self._flops(),
            "seq": self.seq, "time": now, "step": totals.steps, "step_time": self._step_time(now),
            "state": record.state,
            "samples": samples(totals, recorder.latest, recorder.history, self.guards.trips, self.guards.active,
                               record, ident.info_labels(self.workload), self.audit,
                               self.publisher.dropped if self.publisher else 0, self._publisher_cpu_share()),
            "histogram": {"counts": list(itertools.accumulate(totals.step_hist)), "sum": totals.step_sum},
            "actions": [a.model_dump() for a in record.actions],
            "done_commands": list(self._done_commands),
            "last_checkpoint": record.last_checkpoint, "evidence_dir": record.last_evidence,
        }

    def _flops(self) -> dict[str, Any]:
        """What the run's achieved FLOP/s and MFU are worked out from (probe.flops)."""
        cfg, dtype = self.config, self.compute_dtype
        peak = cfg.peak_flops or (peak_flops(self.device_name, dtype) if dtype else 0.0)
        return {"model_flops_per_token": self.flops_per_token, "model_flops_per_step": self.flops_per_step,
                "peak_flops": peak, "compute_dtype": dtype}

    def _step_time(self, now: float) -> float:
        """The wall clock at the last step boundary, from the step clock (the training thread reads no wall clock)."""
        recorder = self.recorder
        return now - (time.perf_counter() - recorder.last_step_end) if recorder.totals.steps else 0.0

    def _publisher_cpu_share(self) -> float:
        """The publisher thread's CPU seconds per second, over the last second or more."""
        now, cpu = time.perf_counter(), self.publisher.cpu_seconds if self.publisher else 0.0
        since, before = self._publisher_seen
        if now - since >= 1.0:
            self._publisher_share = max(0.0, cpu - before) / (now - since)
            self._publisher_seen = (now, cpu)
        return self._publisher_share

    def _read_host_memory(self) -> None:
        """The rank's and its loader workers' resident sets, judged by the host_memory_leak guard. Read here, as
        a push is built (on the publisher thread), never in ``step``; a tripped guard's action is a request,
        carried out by the training thread at its next boundary."""
        reading = self.host_memory.read(worker_pids(self.loader_tracker.iterator()))
        if reading is not None:
            self.recorder.latest.host_memory = reading
            self.recorder.trip(self.guards.check_host_memory(reading))

    def audit_loader(self, loader: Any, cuda: bool) -> None:
        """Audit a loader the rank iterates; each finding is logged once per run."""
        found = self.audit = audit(loader, cuda)
        for check, advice in (found.warnings if found else {}).items():
            if check not in self._audit_logged:
                self._audit_logged.add(check)
                log.warning("trainpatrol DataLoader audit: %s: %s", check, advice)

    def evidence_context(self) -> dict[str, Any]:
        """What an action's evidence adds about this rank."""
        return {"loader_audit": asdict(self.audit) if self.audit is not None else None,
                "guard_trips": list(self.guards.trip_log), "validation_history": list(self._validation_history)}

    def oom_evidence(self, evidence: EvidenceWriter, exc: BaseException) -> Path:
        """Every step so far and an allocator read, into an evidence bundle of its own."""
        self.recorder.catch_up(wait=False)
        step = self.recorder.totals.steps
        self.recorder.read_memory(step)
        bundle = evidence.bundle(time.time(), step, "oom")
        evidence.part(bundle, {"error": repr(exc)},
                      nvml={"available": False, "reason": "not fetched during OOM handling"})
        evidence.index(bundle, {"action": "oom", "step": step, "rank": self.identity.rank},
                       {"source": "exception", "error": repr(exc)})
        self.record.last_evidence = str(bundle)
        return bundle

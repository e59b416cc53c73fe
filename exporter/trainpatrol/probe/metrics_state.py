"""The rank's host-side totals and how they become catalogue samples for a push."""

from __future__ import annotations

import bisect
import math
from dataclasses import dataclass, field
from typing import Any

from ..actions import ACTIONS, RUN_STATES
from ..catalogue import STEP_DURATION_BUCKETS, P
from ..control.commands import RunRecord
from ..loader_audit import LoaderAudit
from .guards import GUARDS
from .host_memory import HostMemoryReading
from .memory import MemoryReading
from .window import History

MAX_PARAM_GROUPS = 16


@dataclass
class Totals:
    steps: int = 0
    micro_steps: int = 0
    samples: float = 0.0
    tokens: float = 0.0
    loader_wait: float = 0.0
    compute: float = math.nan
    """Seconds computing (forward and backward, without the data wait and the wait for peers): CPU ranks."""
    nonfinite_loss: float = 0.0
    nonfinite_grad: float = 0.0
    amp_skipped: float = 0.0
    step_hist: list[float] = field(default_factory=lambda: [0.0] * (len(STEP_DURATION_BUCKETS) + 1))
    step_sum: float = 0.0

    def observe_step(self, seconds: float) -> None:
        self.step_hist[bisect.bisect_left(STEP_DURATION_BUCKETS, seconds)] += 1
        self.step_sum += seconds


@dataclass
class Latest:
    loss: float = math.nan
    grad_norm: float = math.nan
    loss_scale: float = math.nan
    validation_loss: float = math.nan
    learning_rates: list[float] = field(default_factory=list)
    memory: MemoryReading | None = None
    window_peak: float = 0.0
    interval_steps: int = 1
    stalled_phase: int = 0
    """0 while the rank steps, else the phase it is stuck in (probe.stall_watch.PHASES)."""
    host_memory: HostMemoryReading | None = None
    """The last host-memory reading (taken where a push is built: Patrol.snapshot)."""
    exposed_share: float = 1.0
    """The share of Patrol's host time the steps pay for: on a GPU, how often the device ran out of queued work
    while Patrol's ``step()`` ran (``probe.exposure``); while it is busy, the host's time hides behind that work.
    1 on CPU."""


def samples(t: Totals, latest: Latest, history: History, guards_trips: dict[str, int],
            guards_active: dict[str, bool], record: RunRecord, info: dict[str, str], audit: LoaderAudit | None,
            dropped: int, publisher_share: float) -> list[dict[str, Any]]:
    """``publisher_share``: the publisher thread's CPU seconds per second, part of what Patrol costs."""
    out: list[dict[str, Any]] = []
    state = record.state

    def add(name: str, value: float, **labels: str) -> None:
        if math.isfinite(value):
            out.append({"name": P + name, "labels": labels, "value": value})

    add("rank_info", 1.0, **info)
    add("step_total", t.steps)
    add("micro_step_total", t.micro_steps)
    add("samples_total", t.samples)
    add("tokens_total", t.tokens)
    add("loss", latest.loss)
    add("loss_window_mean", history.mean("loss"))
    add("loss_window_max", history.max("loss"))
    add("validation_loss", latest.validation_loss)
    add("nonfinite_steps_total", t.nonfinite_loss, kind="loss")
    add("nonfinite_steps_total", t.nonfinite_grad, kind="grad")
    add("grad_norm", latest.grad_norm)
    add("grad_norm_window_max", history.max("grad_norm"))
    add("amp_skipped_steps_total", t.amp_skipped)
    add("amp_loss_scale", latest.loss_scale)
    for i, lr in enumerate(latest.learning_rates[:MAX_PARAM_GROUPS]):
        add("learning_rate", lr, param_group=str(i))
    add("loader_wait_seconds_total", t.loader_wait)
    add("compute_seconds_total", t.compute)
    add("loader_wait_ratio", history.ratio("loader_wait_seconds", "step_seconds"))
    if audit is not None:
        add("dataloader_info", 1.0, **audit.info)
        for check in ("num_workers_zero", "pin_memory_off", "persistent_workers_off", "prefetch_factor_low"):
            add("dataloader_warning", 1.0 if check in audit.warnings else 0.0, check=check)
    m = latest.memory
    if m is not None:
        add("cuda_memory_allocated_bytes", m.allocated)
        add("cuda_memory_reserved_bytes", m.reserved)
        add("cuda_memory_active_bytes", m.active)
        add("cuda_memory_inactive_split_bytes", m.inactive_split)
        add("cuda_memory_peak_allocated_bytes", latest.window_peak)
        add("cuda_memory_fragmentation_ratio", m.fragmentation)
        add("cuda_memory_unusable_at_peak_bytes", m.unusable_at_peak)
        add("cuda_memory_capacity_bytes", m.capacity)
        add("cuda_memory_used_ratio", m.used_ratio)
        add("cuda_alloc_retries_total", m.alloc_retries)
        add("cuda_ooms_total", m.ooms)
        add("cuda_memory_baseline_bytes", m.allocated)
        add("cuda_memory_baseline_slope_bytes_per_step", history.slope("allocated_bytes"))
    h = latest.host_memory
    if h is not None:
        add("host_memory_resident_bytes", h.resident)
        add("host_memory_limit_bytes", h.limit)
        for worker, resident in h.workers.items():
            add("dataloader_worker_resident_bytes", resident, worker=str(worker))
    probe_share = history.ratio("probe_seconds", "step_seconds") + publisher_share
    add("probe_overhead_ratio", probe_share * latest.exposed_share)
    for g in GUARDS:
        add("guard_trips_total", guards_trips[g], guard=g)
        add("guard_active", 1.0 if guards_active[g] else 0.0, guard=g)
    add("rank_state", RUN_STATES.index(state))
    add("rank_stalled_phase", latest.stalled_phase)
    for action in ACTIONS:  # every series exists from the start, so increase() sees the first action
        for outcome in ("ok", "failed", "skipped"):
            add("actions_total", record.action_counts.get((action, outcome), 0.0), action=action, outcome=outcome)
    add("checkpoint_failures_total", record.checkpoint_failures)
    add("checkpoint_blocked_seconds_total", record.checkpoint_blocked_seconds)
    add("checkpoint_write_seconds", record.last_checkpoint_write_seconds)
    add("last_checkpoint_timestamp_seconds", record.last_checkpoint_time)
    add("last_checkpoint_step", record.last_checkpoint_step)
    add("control_interval_steps", latest.interval_steps)
    add("push_dropped_total", dropped)
    return out

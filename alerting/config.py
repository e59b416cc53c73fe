"""Selectors, thresholds and windows of every trainpatrol rule, in one place (mixin-style).

``DEFAULT`` is the shipped policy, rendered to ``alerting/rules.yml``. ``FAST`` keeps every
threshold and shortens windows and ``for:`` durations, so an end-to-end test with 1 s scrape and
evaluation intervals sees an alert within seconds. Thresholds are the seeds' defaults where they
give one; the others are documented next to their field.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Literal

Profile = Literal["default", "fast"]
GpuSource = Literal["nvml", "dcgm"]
GPU_SOURCES: tuple[GpuSource, ...] = ("nvml", "dcgm")
PROFILES: tuple[Profile, ...] = ("default", "fast")

ALERT_PREFIX = "TrainPatrol"

ALERTS: tuple[str, ...] = (
    "NonFiniteLoss", "NonFiniteGrad", "GradNormExplosion", "LossSpike", "LossStagnation",
    "ValLossDiverging", "MemoryFragmentationHigh", "AllocRetries", "OOMRisk", "DataLoaderBound",
    "GPUUnderutilized", "RankHung", "RankStalled", "RankDown", "Straggler", "CheckpointsBlockTraining", "GPUXidError",
    "ThermalThrottle", "EccUncorrectable", "RowRemapFailure", "AgentDown",
)
"""Alert names without the prefix, in the order they are rendered and documented."""

DEFAULT_FOR: dict[str, str] = {
    "NonFiniteLoss": "0s",  # increase() over a window already holds every NaN; act at once
    "NonFiniteGrad": "0s",
    "GradNormExplosion": "15s",  # measured: see alerting/README.md, "Durations from measurements"
    "LossSpike": "0s",  # spikes are short by nature and the action (capture) is cheap
    "LossStagnation": "30m",
    "ValLossDiverging": "10m",  # the validation loss stays above its best this long: sustained, not one noisy eval
    "MemoryFragmentationHigh": "10m",  # seeds: 10 m
    "AllocRetries": "10m",
    "OOMRisk": "5m",
    "DataLoaderBound": "3m",  # over a 2m window; measured: see alerting/README.md
    "GPUUnderutilized": "15m",
    "RankHung": "1m",  # Patrol reports a stall after PatrolConfig.stall_seconds (60 s): about two minutes in all
    "RankStalled": "5m",
    "RankDown": "1m",
    "Straggler": "15m",
    "CheckpointsBlockTraining": "0s",  # the window is already an hour
    "GPUXidError": "0s",
    "ThermalThrottle": "5m",
    "EccUncorrectable": "0s",
    "RowRemapFailure": "5m",
    "AgentDown": "2m",
}

_DURATION = re.compile(r"^(0|([0-9]+(ms|s|m|h|d|w|y))+)$")
GIB = 1024**3


@dataclass(frozen=True)
class Config:
    selector: str = 'job="trainpatrol"'
    """Label matchers added to every selector; ``job`` is also what ``up`` is read with for AgentDown."""
    cluster_label: str = "cluster"
    """The label that names the cluster (Prometheus ``external_labels`` usually add ``cluster``).
    Rules aggregate by it, ``namespace`` and ``run``, so equal run names stay apart."""
    gpu_source: GpuSource = "nvml"
    """Where GPU series come from: the agent's NVML collector, or NVIDIA dcgm-exporter
    (``DCGM_FI_*``, joined to ranks by GPU UUID) with the agent's NVML off."""
    dcgm_selector: str = ""
    """Label matchers for ``DCGM_FI_*`` series, e.g. ``'job="dcgm-exporter"'``; empty reads every one."""
    runbook_base: str = "https://github.com/trainpatrol/trainpatrol/blob/main/docs/runbooks.md"
    durations: Mapping[str, str] = field(default_factory=lambda: dict(DEFAULT_FOR))
    """``for:`` of each alert, by name without the prefix."""

    # Non-finite loss and gradients.
    nonfinite_window: str = "5m"
    """increase() window: an alert stays active this long after the last non-finite step."""
    nonfinite_grad_ignore_amp_skips: bool = True
    """fp16 GradScaler skips steps with inf gradients by design; those are not an emergency."""

    # Counters read with increase() (non-finite steps, alloc retries, ECC errors).
    new_series_history: str = "1h"
    """A counter series with no sample in this long before an increase() window is new: its whole
    value counts as the increase, because increase() cannot see what a series counted before its
    first scrape. Looking back this far (not just one window) keeps a scrape gap, e.g. an agent
    restart, which writes staleness markers, from making an old non-zero counter look new."""

    # Gradient norm.
    grad_norm_factor: float = 10.0
    """Explosion: the window max is above this many times its own trailing median (like with like:
    a window max against earlier window maxes, never against single steps)."""
    grad_norm_ceiling: float = 1000.0
    """Explosion whatever the history: no healthy model has a global grad norm this large."""
    grad_norm_median_window: str = "30m"
    grad_norm_min_samples: int = 10
    """Samples of history needed before the relative test applies (no verdict during warm-up)."""

    # Training loss.
    loss_spike_factor: float = 3.0
    """Spike: the window max loss is above this many times its own trailing median."""
    loss_median_window: str = "30m"
    loss_min_samples: int = 10
    loss_stagnation_window: str = "2h"
    """Stagnation: no new best (lowest) run-mean loss within this window..."""
    loss_stagnation_history: str = "6h"
    """...compared with the best over this much history before it."""

    # Validation loss (the seeds' early-stop row).
    val_loss_rise_ratio: float = 0.02
    """Divergence: the validation loss is this fraction above the best (lowest) it reached within
    ``val_loss_best_window``, the run's lifetime for most runs, for the whole ``for:`` duration..."""
    val_loss_best_window: str = "6h"
    train_loss_trend_window: str = "15m"
    """...while the training loss falls: ``deriv()`` of the run's mean training loss over this window
    is negative at every evaluation of the same stretch."""
    val_loss_diverging_action: Literal["checkpoint", "stop"] = "checkpoint"

    # CUDA memory.
    fragmentation_ratio: float = 0.35  # seeds
    """Fragmentation: this share of the reserved bytes stayed unusable even at the allocation peak
    (``trainpatrol_cuda_memory_fragmentation_ratio``: healthy GPT-2-124M bf16 on an H200 reads
    0.01-0.03 with 16.8 GiB reserved; a fragmented workload 0.3-0.6)..."""
    fragmentation_min_reserved_bytes: int = 4 * GIB  # seeds: fragmentation only matters when much is cached
    fragmentation_retrying_ratio: float = 0.2
    """...or this share while the allocator keeps retrying cudaMalloc (any retry within
    ``alloc_retries_window``, at every evaluation of the ``for:``): fragmentation that already costs
    steps, whatever the amount reserved."""
    alloc_retries_window: str = "10m"
    alloc_retries_threshold: float = 1.0
    """AllocRetries: more than this many cudaMalloc retries in every window, for the ``for:`` duration."""
    oom_used_ratio: float = 0.92  # seeds: allocated / capacity, also checked at the window peak

    # Data loading, utilisation, stragglers.
    loader_wait_ratio: float = 0.3  # seeds
    """DataLoaderBound: loader wait over step time within 2m (the recording rule's fixed window)."""
    mfu_underutilized_ratio: float = 0.05
    """GPUUnderutilized: a rank's model FLOPs utilisation over the window below this, where its run gives its FLOPs
    and the GPU's peak is known (alerting/README.md has the measured runs behind it)..."""
    sm_active_underutilized_ratio: float = 0.3
    """...else, in DCGM mode where dcgm-exporter exports ``DCGM_FI_PROF_SM_ACTIVE``, the GPU's SM activity below
    this..."""
    gpu_underutilized_ratio: float = 0.5
    """...else the share of time in which any kernel ran (NVML's utilization.gpu, DCGM_FI_DEV_GPU_UTIL)."""
    gpu_underutilized_window: str = "15m"
    straggler_ratio: float = 1.2
    """Straggler: the rank's mean step time over 5 m is this many times the run's median."""
    checkpoint_blocked_ratio: float = 0.05
    checkpoint_blocked_window: str = "1h"
    """CheckpointsBlockTraining: checkpoints held training for more than this share of the window's wall time."""

    # Liveness.
    stall_factor: float = 20.0
    """RankStalled: no step for this many mean step times (the rank's lifetime mean)..."""
    stall_min_seconds: float = 300.0
    """...and never less than this, so evaluation and checkpoint pauses do not count as stalls."""

    # GPU health (NVML).
    xid_critical_codes: tuple[int, ...] = (48, 62, 64, 74, 79, 95, 119, 120)
    """XIDs after which the GPU or its memory needs attention (double-bit ECC, internal micro-controller
    halt, ECC page retirement failures, NVLink, fallen off the bus, uncontained ECC, GSP): critical.
    Every other code (13, 31, 43, 45: faults of the application) is a warning."""
    xid_recent_seconds: float = 300.0
    """GPUXidError stays active this long after the last XID (read from its last-seen timestamp)."""
    ecc_window: str = "10m"
    """EccUncorrectable stays active this long after the last uncorrected ECC error."""
    thermal_reason_regex: str = "(?i).*thermal.*"
    """``reason`` values of trainpatrol_gpu_clock_event_active that mean thermal throttling."""

    def validate(self) -> Config:
        """Check durations and names; errors quote the key and value."""
        missing = [a for a in ALERTS if a not in self.durations]
        if missing:
            raise ValueError(f"Config 'durations' has no entry for {missing[0]!r}. Expected one per alert.")
        for key, value in self.durations.items():
            if key not in ALERTS:
                raise ValueError(f"Config 'durations' has key {key!r}. Not an alert name.")
            _check_duration(f"durations[{key!r}]", value)
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if f.name.endswith(("_window", "_history", "_offset")):
                _check_duration(f.name, value)
        if self.gpu_source not in GPU_SOURCES:
            raise ValueError(f"Config 'gpu_source' has value {self.gpu_source!r}. Expected 'nvml' or 'dcgm'.")
        if not re.fullmatch(r"[a-zA-Z_][a-zA-Z0-9_]*", self.cluster_label):
            raise ValueError(f"Config 'cluster_label' has value {self.cluster_label!r}. Not a Prometheus label name.")
        if not self.xid_critical_codes or not all(isinstance(c, int) and c > 0 for c in self.xid_critical_codes):
            raise ValueError(
                f"Config 'xid_critical_codes' has value {self.xid_critical_codes!r}. Expected positive integers."
            )
        if self.val_loss_diverging_action not in ("checkpoint", "stop"):
            raise ValueError(
                f"Config 'val_loss_diverging_action' has value {self.val_loss_diverging_action!r}. "
                "Expected 'checkpoint' or 'stop'."
            )
        return self

    def for_(self, alert: str) -> str:
        return self.durations[alert]


def _check_duration(key: str, value: str) -> None:
    if not _DURATION.match(value):
        raise ValueError(f"Config {key!r} has value {value!r}. Not a Prometheus duration (e.g. '5m').")


DEFAULT = Config()

FAST = dataclasses.replace(
    DEFAULT,
    # One noisy evaluation is not over-fitting: the demo's healthy validation loss swings 2.7 % above
    # its best for a second at a time (tests/alerting/test_rules.py). 10m scaled like the trend window.
    durations={**{a: "0s" for a in ALERTS}, "ValLossDiverging": "20s"},
    nonfinite_window="1m",
    grad_norm_median_window="1m",
    grad_norm_min_samples=3,
    loss_median_window="1m",
    loss_min_samples=3,
    loss_stagnation_window="1m",
    loss_stagnation_history="2m",
    val_loss_best_window="5m",
    train_loss_trend_window="30s",
    alloc_retries_window="1m",
    gpu_underutilized_window="1m",
    stall_min_seconds=10.0,
    xid_recent_seconds=60.0,
    ecc_window="1m",
)
"""Same thresholds, short windows and ``for: 0s`` (``20s`` for ValLossDiverging, which must be sustained):
for tests and the demo at 1 s scrape and evaluation."""


def profile(name: str) -> Config:
    """The config of a named profile."""
    if name == "default":
        return DEFAULT
    if name == "fast":
        return FAST
    raise ValueError(f"Profile {name!r} is not known. Expected one of {', '.join(PROFILES)}.")

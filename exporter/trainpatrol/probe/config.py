"""Patrol's typed configuration; ``TRAINPATROL_*`` variables fill what the code leaves unset."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

from ..actions import ACTIONS
from ..agent.config import DEFAULT_URL
from .guards import GUARDS, GuardConfig
from .memory import MemoryReader


def _env_token() -> str:
    if os.environ.get("TRAINPATROL_TOKEN"):
        return os.environ["TRAINPATROL_TOKEN"]
    path = os.environ.get("TRAINPATROL_TOKEN_FILE", "")
    return Path(path).read_text().strip() if path else ""


def _env_seconds(name: str, default: float) -> float:
    raw = os.environ.get(name, "")
    try:
        return float(raw) if raw.strip() else default
    except ValueError:
        raise ValueError(f"{name} has value {raw!r}. Not a number of seconds.") from None


@dataclass
class PatrolConfig:
    run: str = field(default_factory=lambda: os.environ.get("TRAINPATROL_RUN", "default"))
    agent_url: str = field(default_factory=lambda: os.environ.get("TRAINPATROL_AGENT_URL", DEFAULT_URL))
    token: str = field(default_factory=_env_token)
    run_key: str = field(default_factory=lambda: os.environ.get("TRAINPATROL_RUN_KEY", ""))
    """The secret every push of the run proves (probe.run_key); empty: rank 0 makes one and shares it."""
    embedded_agent: bool = True
    """Local rank 0 starts a detached agent when none answers on a loopback URL (probe/embedded.py)."""
    embedded_agent_idle_seconds: float = field(
        default_factory=lambda: _env_seconds("TRAINPATROL_EMBEDDED_AGENT_IDLE_SECONDS", 60.0))
    """The embedded agent exits when no rank on the host has pushed to it for this long."""
    push_interval_seconds: float = 1.0
    window: int = 100
    """Steps over which window statistics (mean, max, ratios, slope) are computed."""
    grad_accum_steps: int = 1
    """Micro-steps per optimizer step; Patrol.step() is called once per micro-step."""
    readback_lag_seconds: float = 0.1
    """Step values reach history and guards in batches covering about this much time (at most 16
    steps): on CUDA one copy to the host per batch, so fast steps pay for fewer kernel launches; on
    CPU one warm loop per batch. Guards see them that much later, except a non-finite value on CPU
    (folded in at once) and every step when a loss or grad-norm guard has an action."""
    memory_interval_seconds: float = 1.0
    """Allocator reads happen at most this often (a read is not free: docs/benchmarks.md)."""
    checkpoint_dir: str = field(default_factory=lambda: os.environ.get("TRAINPATROL_CHECKPOINT_DIR",
                                                                       "trainpatrol/checkpoints"))
    evidence_dir: str = field(default_factory=lambda: os.environ.get("TRAINPATROL_EVIDENCE_DIR",
                                                                     "trainpatrol/evidence"))
    keep_checkpoints: int = 3
    """Unpinned checkpoints kept (``checkpoint`` actions, new best losses); the newest finite one always stays."""
    keep_pinned_checkpoints: int = 8
    """Pinned checkpoints kept (each pause's and stop's), the oldest going first; the newest finite one always
    stays. A run whose state is still non-finite writes none again (it points at the incident's first)."""
    background_checkpoints: bool = False
    """A ``checkpoint`` action (not a pause's or stop's) stages the state in host memory kept for the next one
    (pinned for GPU tensors: as much host memory as the state), returns to training and writes it in the
    background: rank 0 the replicated state; every rank its shards of a sharded model (DCP's ``async_save``, its
    collectives on a gloo group of their own). A failed write pauses the run at the next boundary. Off by
    default because the copy takes as much host memory as the (rank's share of the) state for the Patrol's
    lifetime (84 GB for a 7B model with AdamW, unsharded). On a GPU that memory is pinned on a thread after the
    optimizer's first step, so the first checkpoint is not held for it; docs/benchmarks.md has what it saves."""
    flops_per_token: float = 0.0
    """The model's training FLOPs per token, forward and backward (about 6 x parameters, plus attention's 12 x
    layers x width x sequence length for a transformer): with ``step(tokens=)`` it gives the run's achieved
    FLOP/s and, on a device with a known peak, its MFU (``trainpatrol_run_model_flops_per_token``). 0: unknown."""
    flops_per_step: float = 0.0
    """Or the FLOPs of one optimizer step on this rank (``trainpatrol.measure_flops`` measures one), used where
    ``flops_per_token`` is not given. 0: unknown."""
    peak_flops: float = 0.0
    """The device's dense peak FLOP/s in the dtype the model computes in; 0: trainpatrol's table of NVIDIA GPUs
    (H100, H200, A100, L40S, B200; probe.flops), which names no peak for other devices."""
    checkpoint_every_steps: int = 0
    """A ``checkpoint`` every this many optimizer steps (0: none). Periodic checkpoints give a finite state to fall
    back to when the optimizer cannot skip a non-finite step on the device (a foreach or plain AdamW); they are off
    by default because a run usually has its own (the framework's) and each one costs disk (``keep_checkpoints``
    of them stay) and, unless ``background_checkpoints``, a synchronous write."""
    checkpoint_every_seconds: float = 0.0
    """A ``checkpoint`` once this many seconds have passed since the last periodic one (0: none); rank 0 asks,
    every rank takes it at the same step."""
    stall_seconds: float = 60.0
    """A rank that has not reached a step boundary for this long, or ``stall_step_multiple`` times its recent
    step time if longer, is stalled: Patrol's publisher thread captures it (stacks, the phase it is stuck in)
    into ``<evidence_dir>/stall-step<N>/`` and exports the phase (``trainpatrol_rank_stalled_phase``)."""
    stall_step_multiple: float = 10.0
    action_stall_seconds: float = 600.0
    """An action (a checkpoint, a pause, a stop, a capture) that has held the training thread this long, or four
    times the last checkpoint's write if longer, is stalled: captured the same way, in
    ``<evidence_dir>/stall-step<N>-<action>/``, with the part of the action it is stuck in (writing the checkpoint,
    writing evidence, waiting for the other ranks to agree)."""
    checkpoint_format: str = "auto"
    """``torch``: the model and optimizer state, whole, in one file that rank 0 writes (replicated state:
    DDP, one process). ``dcp``: every rank writes its shards through torch.distributed.checkpoint. ``auto``:
    ``dcp`` when the model holds DTensors (FSDP2's ``fully_shard``, tensor parallel), else ``torch``."""
    guards: GuardConfig = field(default_factory=GuardConfig)
    guard_actions: dict[str, str] = field(default_factory=lambda: {
        "nonfinite_loss": "pause", "nonfinite_grad": "pause", "loss_spike": "pause", "grad_norm_explosion": "pause",
        "host_memory_leak": "capture"})
    """Which action a tripped local guard requests. Unlisted guards are recorded, exported, logged. A blow-up
    can reach NaN within one scrape interval, so the explosion guards pause here rather than wait for an alert;
    their thresholds sit well above what healthy runs reach (docs/benchmarks.md). A host-memory leak captures
    evidence, as the OOM killer's SIGKILL leaves the rank no chance to write any afterwards."""
    skip_nonfinite_updates: bool = True
    """Skip the optimizer update of a step whose loss or gradients are non-finite, on the device and without a
    host sync, so the weights a pause saves are the last good ones (see ``probe/update_hooks.py``)."""
    keep_best_checkpoint: bool = True
    """A new best loss passed to ``evaluate()`` checkpoints at the next boundary; rotation never removes that one."""
    pause_timeout_seconds: float = 0.0
    """A pause longer than this turns into ``stop``; 0 waits for ever."""
    pause_poll_seconds: float = 0.2
    control_target_seconds: float = 0.5
    """Control-word exchanges happen about this often (K = target / agreed step time)."""
    record_memory_history: bool = False
    """Record CUDA allocation history so evidence bundles carry a memory snapshot."""
    memory_reader: MemoryReader | None = None
    """Override of the allocator reading: a fault-injection hook for tests and demos."""
    host_memory_limit_bytes: float = 0.0
    """The host memory this rank (with its DataLoader workers' growth) may use, exported as
    ``trainpatrol_host_memory_limit_bytes`` and judged by the ``host_memory_leak`` guard. 0: the lower of the
    cgroup's limit and MemTotal, which the guard shares among the node's ``LOCAL_WORLD_SIZE`` ranks."""

    def validate(self) -> PatrolConfig:
        if self.grad_accum_steps < 1:
            raise ValueError(f"`PatrolConfig(grad_accum_steps={self.grad_accum_steps!r})` must be >= 1.")
        if not self.host_memory_limit_bytes >= 0:
            raise ValueError(f"`PatrolConfig(host_memory_limit_bytes={self.host_memory_limit_bytes!r})` must be >= 0.")
        if self.checkpoint_every_steps < 0 or not self.checkpoint_every_seconds >= 0:
            raise ValueError(f"`PatrolConfig(checkpoint_every_steps={self.checkpoint_every_steps!r}, "
                             f"checkpoint_every_seconds={self.checkpoint_every_seconds!r})` must be >= 0.")
        for name in ("flops_per_token", "flops_per_step", "peak_flops"):
            value = getattr(self, name)
            if not (isinstance(value, int | float) and 0 <= value < float("inf")):
                raise ValueError(f"`PatrolConfig({name}={value!r})` must be a finite number >= 0.")
        if not (self.stall_seconds > 0 and self.stall_step_multiple > 0 and self.action_stall_seconds > 0):
            raise ValueError(f"`PatrolConfig(stall_seconds={self.stall_seconds!r}, stall_step_multiple="
                             f"{self.stall_step_multiple!r}, action_stall_seconds={self.action_stall_seconds!r})` "
                             "must be > 0.")
        if self.checkpoint_format not in ("auto", "dcp", "torch"):
            raise ValueError(f"`PatrolConfig(checkpoint_format={self.checkpoint_format!r})`: expected 'auto', 'dcp' "
                             "or 'torch'.")
        if self.window < 2:
            raise ValueError(f"`PatrolConfig(window={self.window!r})` must be >= 2.")
        for guard, action in self.guard_actions.items():
            if guard not in GUARDS:
                raise ValueError(f"`PatrolConfig(guard_actions={{{guard!r}: ...}})`: unknown guard; "
                                 f"expected one of {', '.join(GUARDS)}.")
            if action not in ACTIONS or action == "resume":
                raise ValueError(f"`PatrolConfig(guard_actions={{{guard!r}: {action!r}}})`: not a valid action.")
        return self

"""Alerts on GPU health from NVML, joined to the rank that uses the GPU where there is one."""

from __future__ import annotations

from .config import Config
from .promql import (
    COUNT,
    GPU,
    GPU_ON,
    INSTANCE,
    RANK,
    RANK_INFO,
    RUN,
    UUID,
    Alert,
    Group,
    increased,
    num,
    on_rank,
    on_rank_or_gpu,
    sel,
)

WHO = (
    f"GPU {GPU} ({UUID}) on {INSTANCE}"
    "{{ if $labels.run }}, used by rank {{ $labels.rank }} of run {{ $labels.run }},{{ end }}"
)
XID = "{{ $labels.xid }}"
AGO = "{{ $value | humanizeDuration }}"


def group(cfg: Config) -> Group:
    def s(metric: str, *matchers: str) -> str:
        return sel(cfg, metric, *matchers)

    # The last-seen timestamp, not increase() of the counter: an xid's series is born with its
    # first event, and increase() cannot see a series' first sample.
    xid_recent = (
        f"time() - {s('trainpatrol_gpu_xid_last_timestamp_seconds')} < {num(cfg.xid_recent_seconds)}"
    )
    thermal = s("trainpatrol_gpu_clock_event_active", f'reason=~"{cfg.thermal_reason_regex}"')
    ecc = s("trainpatrol_gpu_ecc_errors_total", 'type="uncorrected"')
    remap = s("trainpatrol_gpu_remapped_rows", 'state="failure"')
    xid_summary = "A GPU reported an XID error."
    rules = (
        # Two rules, one name: only an alert that names a run may carry an action.
        Alert(
            "GPUXidError", on_rank(xid_recent), "critical", xid_summary,
            f"GPU {GPU} ({UUID}) on {INSTANCE}, used by rank {RANK} of run {RUN}, reported XID {XID} "
            f"{AGO} ago. trainpatrol checkpoints the run while the GPU still answers.",
            action="checkpoint",
        ),
        Alert(
            "GPUXidError", f"{xid_recent}\nunless on ({GPU_ON})\n{RANK_INFO}", "critical", xid_summary,
            f"GPU {GPU} ({UUID}) on {INSTANCE}, used by no trainpatrol rank, reported XID {XID} {AGO} ago.",
        ),
        Alert(
            "ThermalThrottle", on_rank_or_gpu(f"{thermal} == 1"), "warning",
            "A GPU is throttled by temperature.",
            f"{WHO} runs at reduced clocks: clock event {{{{ $labels.reason }}}} is active.",
        ),
        Alert(
            "EccUncorrectable", on_rank_or_gpu(increased(cfg, ecc, cfg.ecc_window)), "critical",
            "A GPU had uncorrectable ECC memory errors.",
            f"{WHO} counted {COUNT} uncorrectable ECC error(s) in the last {cfg.ecc_window}. "
            "Results computed on it may be corrupt.",
        ),
        Alert(
            "RowRemapFailure", on_rank_or_gpu(f"{remap} > 0"), "critical",
            "A GPU failed to remap a memory row.",
            f"{WHO} failed to remap a faulty memory row: it cannot repair further memory errors and needs "
            "service.",
        ),
    )
    return Group("trainpatrol-gpu", rules)

"""Alerts on GPU health, from NVML (the agent) or dcgm-exporter, joined to the rank that uses the GPU."""

from __future__ import annotations

from .config import Config
from .promql import (
    COUNT,
    GPU,
    INSTANCE,
    RANK,
    RUN,
    UUID,
    Alert,
    Group,
    dsel,
    increased,
    num,
    on_rank,
    on_rank_or_gpu,
    sel,
    unused_gpu,
)

XID = "{{ $labels.xid }}"
AGO = "{{ $value | humanizeDuration }}"
DCGM_UUID = "{{ $labels.UUID }}"
DCGM_HOST = "{{ $labels.Hostname }}"
DCGM_XID = '{{ printf "%.0f" $value }}'
RANK_CLAUSE = "{{ if $labels.run }}, used by rank {{ $labels.rank }} of run " + RUN + ",{{ end }}"
XID_SUMMARY = "A GPU reported an XID error."
XID_CRITICAL_ACTION = "trainpatrol checkpoints the run while the GPU still answers."


def group(cfg: Config) -> Group:
    rules = _dcgm(cfg) if cfg.gpu_source == "dcgm" else _nvml(cfg)
    return Group("trainpatrol-gpu", rules)


def _xid_rules(cfg: Config, critical: str, warning: str, where: str, code: str, copied: str, pick: str,
               ) -> tuple[Alert, ...]:
    """Critical codes page (with an action for every rank that uses the GPU), other codes warn. Of
    several codes on one GPU, each rank's alert names the one ``pick`` chooses (the most recent)."""
    return (
        # Two critical rules, one name: only an alert that names a run may carry an action.
        Alert(
            "GPUXidError", on_rank(cfg, critical, copied, pick), "critical", XID_SUMMARY,
            f"{where}, used by rank {RANK} of run {RUN}, reported XID {code}, after which the GPU or its "
            f"memory needs attention. {XID_CRITICAL_ACTION}",
            action="checkpoint",
        ),
        Alert(
            "GPUXidError", unused_gpu(cfg, critical), "critical", XID_SUMMARY,
            f"{where}, used by no trainpatrol rank, reported XID {code}, after which the GPU or its memory "
            "needs attention.",
        ),
        Alert(
            "GPUXidError", on_rank_or_gpu(cfg, warning, copied, pick), "warning", XID_SUMMARY,
            f"{where}{RANK_CLAUSE} reported XID {code}: a fault of the application (such as 13, 31, 43 or 45) "
            "rather than of the GPU.",
        ),
    )


def _nvml(cfg: Config) -> tuple[Alert, ...]:
    def s(metric: str, *matchers: str) -> str:
        return sel(cfg, metric, *matchers)

    codes = "|".join(str(c) for c in cfg.xid_critical_codes)

    # The last-seen timestamp, not increase() of the counter: an xid's series is born with its
    # first event, and increase() cannot see a series' first sample.
    def xid_recent(matcher: str) -> str:
        last = s("trainpatrol_gpu_xid_last_timestamp_seconds", matcher)
        return f"time() - {last} < {num(cfg.xid_recent_seconds)}"

    thermal = s("trainpatrol_gpu_clock_event_active", f'reason=~"{cfg.thermal_reason_regex}"')
    ecc = s("trainpatrol_gpu_ecc_errors_total", 'type="uncorrected"')
    remap = s("trainpatrol_gpu_remapped_rows", 'state="failure"')
    where = f"GPU {GPU} ({UUID}) on {INSTANCE}"
    who = where + RANK_CLAUSE
    return (
        *_xid_rules(cfg, xid_recent(f'xid=~"{codes}"'), xid_recent(f'xid!~"{codes}"'), where,
                    f"{XID} {AGO} ago", "xid", "bottomk"),
        Alert(
            "ThermalThrottle", on_rank_or_gpu(cfg, f"{thermal} == 1", "reason"), "warning",
            "A GPU is throttled by temperature.",
            f"{who} runs at reduced clocks: clock event {{{{ $labels.reason }}}} is active.",
        ),
        *_memory_rules(cfg, increased(cfg, ecc, cfg.ecc_window), f"{remap} > 0", who, "type", "state"),
    )


def _memory_rules(cfg: Config, ecc: str, remap: str, who: str, ecc_copied: str = "", remap_copied: str = "",
                  ) -> tuple[Alert, ...]:
    return (
        Alert(
            "EccUncorrectable", on_rank_or_gpu(cfg, ecc, ecc_copied), "critical",
            "A GPU had uncorrectable ECC memory errors.",
            f"{who} counted {COUNT} uncorrectable ECC error(s) in the last {cfg.ecc_window}. "
            "Results computed on it may be corrupt.",
        ),
        Alert(
            "RowRemapFailure", on_rank_or_gpu(cfg, remap, remap_copied), "critical",
            "A GPU failed to remap a memory row.",
            f"{who} failed to remap a faulty memory row: it cannot repair further memory errors and needs "
            "service.",
        ),
    )


# Clock event (throttle) reason bits, as NVML and DCGM define them: 0x20 SW thermal slowdown,
# 0x40 HW thermal slowdown. floor(x / 32) % 4 > 0 holds when either is set.
THERMAL_BITS_LOW, THERMAL_BITS_SPAN = 32, 4


def _dcgm(cfg: Config) -> tuple[Alert, ...]:
    def d(metric: str) -> str:
        return dsel(cfg, metric)

    # dcgm-exporter's XID is a gauge of the last code (0: none), not a counter or a timestamp:
    # the alert holds while the gauge holds a code, and the code is the value.
    xid = d("DCGM_FI_DEV_XID_ERRORS")
    # One line, so the chart can swap the codes (helm/trainpatrol: prometheusRule.xidCriticalCodes).
    critical = "(" + " or ".join(f"{xid} == {c}" for c in cfg.xid_critical_codes) + ")"
    warning = f"{xid} > 0\nunless\n{critical}"
    # Older exporters name the bitmask CLOCK_THROTTLE_REASONS, DCGM 3.3+ CLOCKS_EVENT_REASONS.
    reasons = f"({d('DCGM_FI_DEV_CLOCK_THROTTLE_REASONS')} or {d('DCGM_FI_DEV_CLOCKS_EVENT_REASONS')})"
    thermal = f"{reasons}\nand\nfloor({reasons} / {THERMAL_BITS_LOW}) % {THERMAL_BITS_SPAN} > 0"
    ecc = increased(cfg, d("DCGM_FI_DEV_ECC_DBE_VOL_TOTAL"), cfg.ecc_window)
    where = f"GPU {GPU} ({DCGM_UUID}) on {DCGM_HOST}"
    who = where + RANK_CLAUSE
    return (
        *_xid_rules(cfg, critical, warning, where, DCGM_XID, "err_code, err_msg", "topk"),
        Alert(
            "ThermalThrottle", on_rank_or_gpu(cfg, thermal), "warning",
            "A GPU is throttled by temperature.",
            f"{who} runs at reduced clocks: its clock event reasons (bitmask {{{{ $value }}}}) include a thermal "
            "slowdown.",
        ),
        *_memory_rules(cfg, ecc, f"{d('DCGM_FI_DEV_ROW_REMAP_FAILURE')} > 0", who),
    )

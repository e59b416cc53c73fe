"""Alerts on liveness: a rank that hangs, a rank that is gone, an agent that is gone."""

from __future__ import annotations

from .config import Config
from .promql import (
    INSTANCE,
    RANK,
    RANK_ODD,
    RANK_STATE_FINISHED,
    RUN,
    Alert,
    Group,
    num,
    rank_labels,
    run_labels,
    sel,
    unless_halted,
)


def group(cfg: Config) -> Group:
    rank_on, run_on = rank_labels(cfg), run_labels(cfg)
    def s(metric: str, *matchers: str) -> str:
        return sel(cfg, metric, *matchers)

    # Stalled: the rank still pushes, but its step counter has not moved for 20 mean step times
    # (its lifetime mean, which a long stall cannot empty, unlike a rate) and at least 5 minutes.
    # The stall is measured between the agent's two timestamps, the last push and the last step
    # advance, not from now: a rank that stops pushing (SIGKILL, a crash) freezes both, so it never
    # reads as stalled while the agent still counts it up for its liveness TTL; once the TTL passes
    # it is down, which is RankDown's business. A rank that pauses, stops or closes on purpose, or
    # did so within the stall minimum (a resume steps again within that), is left out.
    stall_window = f"{num(cfg.stall_min_seconds)}s"
    stalled = (
        "(\n"
        f"  {s('trainpatrol_rank_last_push_timestamp_seconds')}\n"
        f"  - on ({rank_on})\n"
        f"  ({s('trainpatrol_rank_last_step_timestamp_seconds')} > 0)\n"
        ")\n"
        f"> on ({rank_on})\n"
        "clamp_min(\n"
        f"  {num(cfg.stall_factor)} * {s('trainpatrol_step_duration_seconds_sum')}\n"
        f"  / on ({rank_on})\n"
        f"  clamp_min({s('trainpatrol_step_duration_seconds_count')}, 1),\n"
        f"  {num(cfg.stall_min_seconds)}\n"
        ")\n"
        f"and on ({rank_on})\n({s('trainpatrol_rank_up')} == 1)\n"
        + unless_halted(rank_on, stall_window, stalled=False)
        # a run with a rank stuck where the others are not raises RankHung for that rank alone
        + f"\nunless on ({run_on})\n  {RANK_ODD}"
    )
    # A rank that closed or stopped on purpose is not down.
    finished = f"{s('trainpatrol_rank_state')} >= {RANK_STATE_FINISHED}"
    down = f"{s('trainpatrol_rank_up')} == 0\nunless on ({rank_on})\n({finished})"
    rules = (
        Alert(
            "RankHung", RANK_ODD, "critical",
            "A rank is stuck where the other ranks of its run are not.",
            f"Rank {RANK} of run {RUN} on {INSTANCE} has been stuck longer than Patrol's stall time (without a "
            "step boundary, or inside an action such as a checkpoint) in {{ $labels.phase }}, while most stalled "
            "ranks of the run are elsewhere (waiting for it). Each stalled rank wrote its stacks to "
            "<evidence_dir>/stall-step<N>/ (stall-step<N>-<action>/ inside an action); stall.json there names the "
            "odd ranks. A hung collective cannot be paused: see the runbook.",
        ),
        Alert(
            "RankStalled", stalled, "critical",
            "A rank is alive but makes no progress.",
            f"Rank {RANK} of run {RUN} on {INSTANCE} still pushes metrics but has not finished a step for "
            f"{{{{ $value | humanizeDuration }}}}, more than {num(cfg.stall_factor)}x its mean step time. "
            "trainpatrol captures all-thread stacks to show where it hangs.",
            action="capture",
        ),
        Alert(
            "RankDown", down, "critical",
            "A rank stopped reporting.",
            f"Rank {RANK} of run {RUN} has not pushed to the agent at {INSTANCE} within its liveness TTL, "
            "and did not close: the process died, or it cannot reach the agent.",
        ),
        Alert(
            "AgentDown", f"{s('up')} == 0", "warning",
            "A trainpatrol agent cannot be scraped.",
            f"Prometheus cannot scrape the trainpatrol agent at {INSTANCE}: its ranks and GPUs are unwatched, "
            "and alerts cannot act on them through it. Local guards in the ranks still work.",
        ),
    )
    return Group("trainpatrol-liveness", rules)

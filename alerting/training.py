"""Alerts on the training signal: non-finite values, gradient norm, training and validation loss."""

from __future__ import annotations

from .config import Config
from .promql import COUNT, INSTANCE, RANK, RANK_ON, RUN, RUN_ON, VALUE, Alert, Group, num, sel
from .recording import LOSS_RUN, STEP_RATE_RUN, VAL_LOSS_RUN


def group(cfg: Config) -> Group:
    def s(metric: str, *matchers: str) -> str:
        return sel(cfg, metric, *matchers)

    def nonfinite(kind: str) -> str:
        counter = s("trainpatrol_nonfinite_steps_total", 'kind="' + kind + '"')
        return f"increase({counter}[{cfg.nonfinite_window}]) > 0"

    grad_expr = nonfinite("grad")
    if cfg.nonfinite_grad_ignore_amp_skips:
        grad_expr += (
            f"\nunless on ({RANK_ON})\n"
            f"increase({s('trainpatrol_amp_skipped_steps_total')}[{cfg.nonfinite_window}]) > 0"
        )

    gw = cfg.grad_norm_median_window
    grad_norm_expr = (
        "(\n"
        f"  {s('trainpatrol_grad_norm_window_max')}\n"
        f"  > on ({RANK_ON})\n"
        f"    {num(cfg.grad_norm_factor)} * quantile_over_time(0.5, {s('trainpatrol_grad_norm')}[{gw}])\n"
        f"  and on ({RANK_ON})\n"
        f"    count_over_time({s('trainpatrol_grad_norm')}[{gw}]) >= {cfg.grad_norm_min_samples}\n"
        ")\n"
        f"or\n{s('trainpatrol_grad_norm_window_max')} > {num(cfg.grad_norm_ceiling)}"
    )

    lw = cfg.loss_median_window
    loss_median = f"quantile_over_time(0.5, {s('trainpatrol_loss_window_mean')}[{lw}])"
    loss_spike_expr = (
        f"{s('trainpatrol_loss_window_max')}\n"
        f"> on ({RANK_ON})\n  {num(cfg.loss_spike_factor)} * {loss_median}\n"
        f"and on ({RANK_ON})\n  count_over_time({s('trainpatrol_loss_window_mean')}[{lw}]) >= {cfg.loss_min_samples}\n"
        f"and on ({RANK_ON})\n  {loss_median} > 0"
    )

    stagnation_expr = (
        f"min_over_time({LOSS_RUN}[{cfg.loss_stagnation_window}])\n"
        f">= on ({RUN_ON})\n"
        f"min_over_time({LOSS_RUN}[{cfg.loss_stagnation_history}] offset {cfg.loss_stagnation_window})\n"
        f"and on ({RUN_ON})\n{STEP_RATE_RUN} > 0"
    )

    tw, to = cfg.train_loss_trend_window, cfg.train_loss_trend_offset
    val_expr = (
        f"{VAL_LOSS_RUN}\n"
        f"> on ({RUN_ON})\n"
        f"  {num(1 + cfg.val_loss_rise_ratio)} * min_over_time({VAL_LOSS_RUN}[{cfg.val_loss_best_window}])\n"
        f"and on ({RUN_ON})\n  avg_over_time({LOSS_RUN}[{tw}])\n"
        f"  < on ({RUN_ON})\n  avg_over_time({LOSS_RUN}[{tw}] offset {to})"
    )

    who = f"Rank {RANK} of run {RUN} on {INSTANCE}"
    rules = (
        Alert(
            "NonFiniteLoss", nonfinite("loss"), "critical",
            "The training loss became NaN or Inf.",
            f"{who} had {COUNT} step(s) with a non-finite loss in the last {cfg.nonfinite_window}. "
            "trainpatrol pauses the run with a checkpoint and an evidence bundle.",
            action="pause",
        ),
        Alert(
            "NonFiniteGrad", grad_expr, "critical",
            "The gradient norm became NaN or Inf.",
            f"{who} had {COUNT} step(s) with a non-finite gradient norm in the last {cfg.nonfinite_window}"
            + (" (GradScaler skips excluded)" if cfg.nonfinite_grad_ignore_amp_skips else "")
            + ". trainpatrol pauses the run with a checkpoint and an evidence bundle.",
            action="pause",
        ),
        Alert(
            "GradNormExplosion", grad_norm_expr, "critical",
            "The gradient norm exploded.",
            f"{who}: the global gradient norm reached {VALUE}, more than {num(cfg.grad_norm_factor)}x its "
            f"median over the last {gw} or above the ceiling of {num(cfg.grad_norm_ceiling)}. "
            "trainpatrol pauses the run before the weights diverge.",
            action="pause",
        ),
        Alert(
            "LossSpike", loss_spike_expr, "warning",
            "The training loss spiked.",
            f"{who}: the training loss reached {VALUE}, more than {num(cfg.loss_spike_factor)}x its median "
            f"over the last {lw}. trainpatrol captures evidence (history, stacks, allocator state).",
            action="capture",
        ),
        Alert(
            "LossStagnation", stagnation_expr, "warning",
            "The training loss stopped improving.",
            f"Run {RUN}: the best mean training loss of the last {cfg.loss_stagnation_window} ({VALUE}) is no "
            f"lower than the best of the {cfg.loss_stagnation_history} before, although the run keeps stepping.",
        ),
        Alert(
            "ValLossDiverging", val_expr, "warning",
            "The validation loss rises while the training loss falls.",
            f"Run {RUN}: the validation loss ({VALUE}) is more than {num(cfg.val_loss_rise_ratio * 100)}% "
            f"above its best of the last {cfg.val_loss_best_window} while the training loss keeps falling: "
            f"the model is overfitting. trainpatrol asks the run to {cfg.val_loss_diverging_action}.",
            action=cfg.val_loss_diverging_action,
        ),
    )
    return Group("trainpatrol-training", rules)

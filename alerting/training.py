"""Alerts on the training signal: non-finite values, gradient norm, training and validation loss."""

from __future__ import annotations

from .config import Config
from .promql import (
    COUNT,
    INSTANCE,
    RANK,
    RUN,
    VALUE,
    Alert,
    Group,
    increased,
    indent,
    num,
    rank_labels,
    run_labels,
    sel,
    unless_halted,
)
from .recording import LOSS_RUN, STEP_RATE_RUN, VAL_LOSS_RUN


def group(cfg: Config) -> Group:
    rank_on = rank_labels(cfg)
    run_on = run_labels(cfg)
    def s(metric: str, *matchers: str) -> str:
        return sel(cfg, metric, *matchers)

    def nonfinite(kind: str) -> str:
        return increased(cfg, s("trainpatrol_nonfinite_steps_total", f'kind="{kind}"'), cfg.nonfinite_window)

    grad_expr = nonfinite("grad")
    if cfg.nonfinite_grad_ignore_amp_skips:
        amp_skips = increased(cfg, s("trainpatrol_amp_skipped_steps_total"), cfg.nonfinite_window)
        grad_expr = f"(\n{indent(grad_expr)}\n)\nunless on ({rank_on})\n(\n{indent(amp_skips)}\n)"

    # Like with like: the window max (the largest value of the Patrol's last N steps) is compared
    # with its own trailing median, never with single steps or window means. Early in training the
    # window max still holds the first, high steps while later steps are far lower; against itself
    # it is flat then falls, so only a new maximum well above the usual one fires.
    def window_max_test(metric: str, factor: float, window: str, min_samples: int) -> str:
        m = s(metric)
        return (
            f"{m}\n"
            f"> on ({rank_on})\n  {num(factor)} * quantile_over_time(0.5, {m}[{window}])\n"
            f"and on ({rank_on})\n  count_over_time({m}[{window}]) >= {min_samples}"
        )

    gw = cfg.grad_norm_median_window
    grad_relative = window_max_test(
        "trainpatrol_grad_norm_window_max", cfg.grad_norm_factor, gw, cfg.grad_norm_min_samples
    )
    grad_norm_expr = (
        f"(\n{indent(grad_relative)}\n)\n"
        f"or\n{s('trainpatrol_grad_norm_window_max')} > {num(cfg.grad_norm_ceiling)}"
    )

    lw = cfg.loss_median_window
    loss_spike_expr = (
        window_max_test("trainpatrol_loss_window_max", cfg.loss_spike_factor, lw, cfg.loss_min_samples)
        + f"\nand on ({rank_on})\n  quantile_over_time(0.5, {s('trainpatrol_loss_window_max')}[{lw}]) > 0"
    )

    # The step rate is a 5m rate: it stays above 0 for 5 minutes after the last step, so a run
    # that paused, stopped or closed is left out for as long.
    stagnation_expr = (
        f"min_over_time({LOSS_RUN}[{cfg.loss_stagnation_window}])\n"
        f">= on ({run_on})\n"
        f"min_over_time({LOSS_RUN}[{cfg.loss_stagnation_history}] offset {cfg.loss_stagnation_window})\n"
        f"and on ({run_on})\n{STEP_RATE_RUN} > 0\n"
        + unless_halted(run_on, "5m")
    )

    # Over-fitting: the validation loss is above the best this run reached (lowest within the best
    # window), at every evaluation of the for: duration, while the training loss falls (its
    # least-squares slope over the trend window is negative). The for: is what makes the rise
    # sustained; nothing waits for an hour of history, so a run that over-fits from step 40 is seen
    # within minutes of it.
    tw = cfg.train_loss_trend_window
    val_expr = (
        f"{VAL_LOSS_RUN}\n"
        f"> on ({run_on})\n"
        f"  {num(1 + cfg.val_loss_rise_ratio)} * min_over_time({VAL_LOSS_RUN}[{cfg.val_loss_best_window}])\n"
        f"and on ({run_on})\n  deriv({LOSS_RUN}[{tw}]) < 0\n"
        + unless_halted(run_on, tw)
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
            f"{who}: the window-max global gradient norm reached {VALUE}, more than {num(cfg.grad_norm_factor)}x "
            f"its own median over the last {gw}, or above the ceiling of {num(cfg.grad_norm_ceiling)}. "
            "trainpatrol pauses the run before the weights diverge.",
            action="pause",
        ),
        Alert(
            "LossSpike", loss_spike_expr, "warning",
            "The training loss spiked.",
            f"{who}: the window-max training loss reached {VALUE}, more than {num(cfg.loss_spike_factor)}x "
            f"its own median over the last {lw}. trainpatrol captures evidence (history, stacks, allocator state).",
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
            f"Run {RUN}: the validation loss ({VALUE}) has stayed more than {num(cfg.val_loss_rise_ratio * 100)}% "
            f"above the best of the last {cfg.val_loss_best_window} while the training loss kept falling "
            f"(over {tw}): the model is overfitting. trainpatrol asks the run to {cfg.val_loss_diverging_action}.",
            action=cfg.val_loss_diverging_action,
        ),
    )
    return Group("trainpatrol-training", rules)

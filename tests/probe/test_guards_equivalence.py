"""The guards' cheap per-step check judges exactly as judging every step in full does."""

from __future__ import annotations

import math
import random
from statistics import median

import pytest

from trainpatrol.probe.guards import GuardConfig, Guards
from trainpatrol.probe.window import History


class FullGuards(Guards):
    """Every step judged in full, medians refreshed as before the fast path (the reference)."""

    def __init__(self, config: GuardConfig) -> None:
        super().__init__(config)
        self._refreshed_at = -(10**9)

    def check_step(self, step: int, loss: float, grad_norm: float | None, history: History) -> list[tuple[str, str]]:
        c = self.config
        tripped: list[tuple[str, str]] = []
        gn = 0.0 if grad_norm is None else grad_norm
        if not (math.isfinite(loss) and math.isfinite(gn)) or self.active["nonfinite_loss"] \
                or self.active["nonfinite_grad"]:
            self._set("nonfinite_loss", not math.isfinite(loss), lambda: "", tripped)
            self._set("nonfinite_grad", not math.isfinite(gn), lambda: "", tripped)
        self._full_refresh(step, history)
        enough = self._samples >= c.min_steps
        med_loss, med_gn = self._med_loss, self._med_gn
        spike = enough and math.isfinite(loss) and med_loss > 0 and loss > c.loss_spike_factor * med_loss
        if spike or self.active["loss_spike"]:
            self._set("loss_spike", spike, lambda: "", tripped)
        exploded = math.isfinite(gn) and ((enough and med_gn > 0 and gn > c.grad_norm_factor * med_gn)
                                          or gn > c.grad_norm_ceiling)
        if exploded or self.active["grad_norm_explosion"]:
            self._set("grad_norm_explosion", exploded, lambda: "", tripped)
        if self._stagnant_now or self.active["loss_stagnation"]:
            self._set("loss_stagnation", self._stagnant_now, lambda: "", tripped)
        return tripped

    def _full_refresh(self, step: int, history: History) -> None:
        c = self.config
        if step - self._refreshed_at < c.median_refresh_steps and self._samples >= c.min_steps:
            return
        self._refreshed_at = step
        window = history.recent(c.median_window)
        losses = [r.loss for r in window if math.isfinite(r.loss)]
        norms = [r.grad_norm for r in window if math.isfinite(r.grad_norm)]
        self._samples = len(losses)
        self._med_loss = float(median(losses)) if losses else math.nan
        self._med_gn = float(median(norms)) if norms else math.nan
        if step - self._stagnation_at >= max(c.median_refresh_steps, c.stagnation_steps // 20):
            self._stagnation_at = step
            n = c.stagnation_steps
            losses = history.values("loss", n + c.median_refresh_steps)[-n:]
            half = len(losses) // 2
            self._stagnant_now = len(losses) >= n and (first := median(losses[:half])) > 0 \
                and (first - median(losses[half:])) / first < c.stagnation_min_improvement


def script(rng: random.Random, steps: int) -> list[tuple[float, float | None]]:
    out: list[tuple[float, float | None]] = []
    loss, gn = 2.0, 1.0
    for _ in range(steps):
        loss *= rng.choice([0.999, 1.0, 1.001])
        roll = rng.random()
        value = loss * (rng.uniform(3, 8) if roll < 0.04 else 1.0)
        norm: float | None = gn * rng.uniform(0.5, 1.5) * (rng.uniform(5, 50) if rng.random() < 0.04 else 1.0)
        if roll > 0.985:
            value = rng.choice([math.nan, math.inf, -math.inf])
        if rng.random() < 0.01:
            norm = rng.choice([math.nan, math.inf, None])
        out.append((value, norm))
    return out


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("lag", [0, 5])
def test_the_per_step_check_trips_as_judging_every_step_in_full_does(seed: int, lag: int) -> None:
    """``lag``: the records of later steps already exist, their values unread (as on CUDA)."""
    rng = random.Random(seed)
    config = GuardConfig(min_steps=5 + seed, median_window=30, median_refresh_steps=1 + seed % 4,
                         stagnation_steps=40, stagnation_min_improvement=0.5,
                         grad_norm_ceiling=4.0 if seed % 2 else 60.0)
    steps = script(rng, 600)
    judged = []
    for guards in (Guards(config, clock=lambda: 0.0), FullGuards(config)):
        history = History(window=30, keep=64)
        recs = [history.record(s + 1, 0.0) for s in range(lag)]
        trips = []
        for i, (loss, gn) in enumerate(steps):
            recs.append(history.record(i + lag + 1, 0.0))
            trips.append([g for g, _ in guards.check_step(i + 1, loss, gn, history)])
            rec = recs[i]
            rec.loss, rec.grad_norm = loss, math.nan if gn is None else gn
        judged.append((trips, dict(guards.trips), dict(guards.active)))
    assert judged[0] == judged[1]
    assert sum(judged[1][1].values()) > 5  # the script does trip guards

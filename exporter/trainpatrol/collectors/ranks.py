"""Serves the ranks' pushed series, the liveness the agent derives from them, and the run-level series.

The catalogue's rank metrics that some rank pushed, with ``run``, ``rank`` and the rank's workload labels; then
each rank's liveness series; then once per run what is the same on its ranks or sums over them. At the
``standard`` series level a rank stays within ``catalogue.SERIES_BUDGET``: no ``FULL_ONLY`` metrics, its
step-duration histogram as a summary, ``NONZERO_ONLY`` series only while not 0; ``full`` serves everything.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable, Iterator, Sequence
from typing import NamedTuple, Protocol

from prometheus_client.metrics_core import Metric

from ..catalogue import AGENT_METRICS, BY_NAME, FULL_ONLY, NONZERO_ONLY, RANK_METRICS, STEP_DURATION_BUCKETS, P
from ..catalogue import Metric as CatalogueMetric
from ..protocol import RankSnapshot
from .registry import Labels

WORKLOAD_LABELS = ("namespace", "pod", "container", "node")
"""The training process's own Kubernetes identity, on every series of its rank when it has one."""
_HISTOGRAM = next(m.name for m in RANK_METRICS if m.kind == "histogram")
_BOUNDS = (*(str(b) for b in STEP_DURATION_BUCKETS), "+Inf")
_LIVENESS = tuple(m for m in AGENT_METRICS if m.name.startswith("trainpatrol_rank_"))
_RUN_ACTIONS, _RUN_HISTOGRAM = BY_NAME[P + "run_actions_total"], BY_NAME[P + "run_step_duration_seconds"]
_RUN_RESTARTS, _RUN_LR = BY_NAME[P + "run_restarts"], BY_NAME[P + "run_learning_rate"]
_RUN_FLOPS = tuple(BY_NAME[P + name] for name in ("run_model_flops_per_token", "run_model_flops_per_step",
                                                  "run_peak_flops"))
_RUN_SUMS = {P + name: BY_NAME[P + "run_" + name] for name in ("samples_total", "tokens_total",
                                                              "loader_wait_seconds_total")}
"""The rank counters that the agent also serves once per run, summed over its ranks: the run's rules read these few
series instead of a rate of every rank's."""
_ACTIONS, _LR = P + "actions_total", P + "learning_rate"
SERIES_LEVELS = ("standard", "full")


class RankRow(NamedTuple):
    """What a scrape writes of one rank."""

    snapshot: RankSnapshot
    up: bool
    last_push: float
    last_step_advance: float


class RankSource(Protocol):
    """Where the ranks come from (agent.store)."""

    def state(self) -> Hashable:
        """Changes whenever ``rows`` would give something else: a push, an expiry, an up flag flipping."""

    def rows(self) -> Sequence[RankRow]:
        """Every rank, sorted by (namespace, run, rank)."""


def rank_labels(snap: RankSnapshot) -> dict[str, str]:
    """The labels every series of a rank carries: run, rank and the workload labels it has."""
    labels = {"run": snap.run, "rank": str(snap.rank)}
    labels.update({k: getattr(snap, k) for k in WORKLOAD_LABELS if getattr(snap, k)})
    return labels


class RankCollector:
    """Families in catalogue order, the ranks in order within each; labels sorted by name, as the
    text format has always written them."""

    def __init__(self, source: RankSource, max_series: int = 200_000, level: str = "standard") -> None:
        if level not in SERIES_LEVELS:
            raise ValueError(f"series level {level!r}: expected one of {', '.join(SERIES_LEVELS)}")
        self._source, self._full = source, level == "full"
        self._labels: dict[tuple[object, ...], dict[str, str]] = {}
        """Each series' labels, sorted, kept from scrape to scrape: a rank pushes the same series every
        second, and building them again was most of a scrape. Cleared when past ``max_series``."""
        self._max_series = max_series

    def version(self) -> Hashable:
        return self._source.state()

    def collect(self) -> Iterator[Metric]:
        rows, full = self._source.rows(), self._full
        families = {spec.name: spec.family() for spec in RANK_METRICS if full or spec.name not in FULL_ONLY}
        if not full:
            # _sum and _count without buckets is a summary: the +Inf bucket would repeat _count, and no rule
            # or panel reads a rank's other buckets (the run's are trainpatrol_run_step_duration_seconds)
            families[_HISTOGRAM] = Metric(_HISTOGRAM, families[_HISTOGRAM].documentation, "summary")
        liveness = [spec.family() for spec in _LIVENESS]
        run_actions: dict[tuple[str, ...], float] = {}
        learning_rates: dict[tuple[str, str, str], tuple[int, float]] = {}
        restarts: dict[tuple[str, str], float] = {}
        flops: dict[tuple[str, str], tuple[float, float, float, str]] = {}
        run_steps: dict[tuple[str, str], tuple[list[float], float]] = {}
        run_sums: dict[str, dict[tuple[str, str], float]] = {name: {} for name in _RUN_SUMS}
        if len(self._labels) > self._max_series:
            self._labels.clear()
        labels_of = self._labels
        for row in rows:
            snap = row.snapshot
            rank = (snap.run, snap.rank, *(getattr(snap, k) for k in WORKLOAD_LABELS))
            base: dict[str, str] | None = None
            of_run = (snap.namespace, snap.run)
            for s in snap.samples:
                by_run = run_sums.get(s.name)
                if by_run is not None:
                    by_run[of_run] = by_run.get(of_run, 0.0) + s.value
                elif s.name == _ACTIONS:
                    act = (snap.namespace, snap.run, s.labels.get("action", ""), s.labels.get("outcome", ""))
                    run_actions[act] = max(run_actions.get(act, 0.0), s.value)
                elif s.name == _LR:
                    of_group = (snap.namespace, snap.run, s.labels.get("param_group", ""))
                    held = learning_rates.get(of_group)
                    if held is None or snap.rank < held[0]:
                        learning_rates[of_group] = (snap.rank, s.value)
                fam = families.get(s.name)
                if fam is None or (not full and not s.value and s.name in NONZERO_ONLY):
                    continue
                series = (rank, s.name, *s.labels.items())
                labels = labels_of.get(series)
                if labels is None:
                    base = base or rank_labels(snap)
                    labels = labels_of[series] = _sorted(base | s.labels)
                fam.add_sample(s.name, labels, 1.0 if fam.type == "info" else s.value)
            restarts[of_run] = max(restarts.get(of_run, 0.0), float(snap.restart_count))
            if snap.model_flops_per_token or snap.model_flops_per_step:
                flops[of_run] = _most(flops.get(of_run), snap)
            plain = labels_of.get(rank)
            if plain is None:
                plain = labels_of[rank] = _sorted(rank_labels(snap))
            if snap.histogram is not None:
                fam, counts = families[_HISTOGRAM], snap.histogram.counts
                if full:
                    for le, count in zip(_BOUNDS, counts, strict=True):
                        bucket = (rank, le)
                        labels = labels_of.get(bucket)
                        if labels is None:
                            labels = labels_of[bucket] = _sorted(plain | {"le": le})
                        fam.add_sample(_HISTOGRAM + "_bucket", labels, count)
                fam.add_sample(_HISTOGRAM + "_count", plain, counts[-1])
                fam.add_sample(_HISTOGRAM + "_sum", plain, snap.histogram.sum)
                summed, total = run_steps.get(of_run, ([0.0] * len(counts), 0.0))
                run_steps[of_run] = ([a + b for a, b in zip(summed, counts, strict=True)], total + snap.histogram.sum)
            for fam, value in zip(liveness, (1.0 if row.up else 0.0, row.last_push, row.last_step_advance),
                                  strict=True):
                fam.add_sample(fam.name, plain, value)
        yield from (f for f in (*families.values(), *liveness) if f.samples)
        yield from _run_families(run_actions, run_steps, run_sums, restarts, learning_rates, flops)


def _run_labels(namespace: str, run: str, **more: str) -> dict[str, str]:
    return _sorted(({"namespace": namespace} if namespace else {}) | {"run": run} | more)


def _filled(spec: CatalogueMetric, rows: Iterable[tuple[dict[str, str], float]]) -> Iterator[Metric]:
    """``spec``'s family with these (labels, value) samples, if there are any."""
    fam = spec.family()
    for labels, value in rows:
        fam.add_sample(spec.name, labels, value)
    if fam.samples:
        yield fam


def _run_families(actions: dict[tuple[str, ...], float], steps: dict[tuple[str, str], tuple[list[float], float]],
                  sums: dict[str, dict[tuple[str, str], float]], restarts: dict[tuple[str, str], float],
                  learning_rates: dict[tuple[str, str, str], tuple[int, float]],
                  flops: dict[tuple[str, str], tuple[float, float, float, str]]) -> Iterator[Metric]:
    """Once per run: its actions and restarts (the most any rank reports), its ranks' step histograms and
    throughput counters summed, its learning rates (the lowest rank's), and what its FLOP/s and MFU are worked out
    from (alerting/recording.py)."""
    yield from _filled(_RUN_ACTIONS, ((_run_labels(ns, run, action=action, outcome=outcome), value)
                                      for (ns, run, action, outcome), value in sorted(actions.items())))
    for name, spec in _RUN_SUMS.items():
        yield from _filled(spec, ((_run_labels(*run), total) for run, total in sorted(sums[name].items())))
    yield from _filled(_RUN_RESTARTS, ((_run_labels(*run), count) for run, count in sorted(restarts.items())))
    if steps:
        fam = _RUN_HISTOGRAM.family()
        name = _RUN_HISTOGRAM.name
        for (namespace, run), (counts, total) in sorted(steps.items()):
            for le, count in zip(_BOUNDS, counts, strict=True):
                fam.add_sample(name + "_bucket", _run_labels(namespace, run, le=le), count)
            fam.add_sample(name + "_count", _run_labels(namespace, run), counts[-1])
            fam.add_sample(name + "_sum", _run_labels(namespace, run), total)
        yield fam
    yield from _filled(_RUN_LR, ((_run_labels(ns, run, param_group=group), value)
                                 for (ns, run, group), (_, value) in sorted(learning_rates.items())))
    per_token, per_step, peak = _RUN_FLOPS
    runs = sorted(flops.items())
    yield from _filled(per_token, ((_run_labels(*run), token) for run, (token, _, _, _) in runs if token))
    yield from _filled(per_step, ((_run_labels(*run), step) for run, (token, step, _, _) in runs if step and not token))
    yield from _filled(peak, ((_run_labels(*run, dtype=dtype or "unknown"), device_peak)
                              for run, (_, _, device_peak, dtype) in runs if device_peak))


def _most(held: tuple[float, float, float, str] | None, snap: RankSnapshot) -> tuple[float, float, float, str]:
    """A run's FLOP figures: the largest any of its ranks reports (they agree on a data-parallel run), and the
    peak of the slowest device (MFU is judged against what the run's GPUs can do)."""
    if held is None:
        return snap.model_flops_per_token, snap.model_flops_per_step, snap.peak_flops, snap.compute_dtype
    peak, dtype = held[2], held[3]
    if snap.peak_flops and (not peak or snap.peak_flops < peak):
        peak, dtype = snap.peak_flops, snap.compute_dtype
    return max(held[0], snap.model_flops_per_token), max(held[1], snap.model_flops_per_step), peak, dtype


def _sorted(labels: dict[str, str]) -> dict[str, str]:
    return Labels(dict(sorted(labels.items())))

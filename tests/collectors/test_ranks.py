"""The rank lines: family by family in catalogue order, ranks in order, then their liveness."""

from __future__ import annotations

from typing import Any

from exposition_check import Watched, assert_clean, text
from fake_clock import T0, Clock
from trainpatrol.agent.store import RankStore
from trainpatrol.catalogue import STEP_DURATION_BUCKETS
from trainpatrol.collectors.ranks import RankCollector
from trainpatrol.protocol import RankSnapshot

INFO = {"local_rank": "1", "world_size": "2", "host": "n%s", "gpu_uuid": "GPU-1", "device": "cuda:1",
        "torch_version": "2.5", "cuda_version": "12.4", "trainpatrol_version": "0.1", "launcher": "torchrun",
        "launcher_job": "j1"}
POD = {"namespace": "team-a", "pod": "w-1", "container": "trainer", "node": "gpu-12"}


def snap(rank: int = 1, **extra: Any) -> RankSnapshot:
    counts = [float(min(i, 5)) for i in range(len(STEP_DURATION_BUCKETS) + 1)]
    return RankSnapshot.model_validate({
        "run": "r1", "rank": rank, "world_size": 2, "step": 7, "instance": "a" * 16,
        "samples": [{"name": "trainpatrol_loss", "value": 1.5},
                    {"name": "trainpatrol_nonfinite_steps_total", "labels": {"kind": "l%s"}, "value": 3.0},
                    {"name": "trainpatrol_step_total", "value": 1e6},
                    {"name": "trainpatrol_rank_info", "labels": INFO, "value": 7.0}],
        "histogram": {"counts": counts, "sum": 2.5}, **extra})


def test_a_rank_with_workload_labels_a_histogram_and_an_info_is_written_exactly() -> None:
    store = RankStore(clock=Clock())
    store.push(snap(**POD))
    body = text(RankCollector(store, level="full"))
    w = 'container="trainer",namespace="team-a",node="gpu-12",pod="w-1",rank="1",run="r1"'
    buckets = "".join(f'trainpatrol_step_duration_seconds_bucket{{container="trainer",le="{le}",namespace="team-a",'
                      f'node="gpu-12",pod="w-1",rank="1",run="r1"}} {float(min(i, 5))}\n'
                      for i, le in enumerate(["0.001", "0.0025", "0.005", "0.01", "0.025", "0.05", "0.1", "0.25",
                                              "0.5", "1.0", "2.5", "5.0", "10.0", "30.0", "60.0", "+Inf"]))
    assert body.decode() == (
        "# HELP trainpatrol_rank_info Identity of a rank: host, GPU uuid, versions and the job's launcher. "
        "Join GPU metrics on uuid.\n# TYPE trainpatrol_rank_info gauge\n"
        'trainpatrol_rank_info{container="trainer",cuda_version="12.4",device="cuda:1",gpu_uuid="GPU-1",host="n%s",'
        'launcher="torchrun",launcher_job="j1",local_rank="1",namespace="team-a",node="gpu-12",pod="w-1",rank="1",'
        'run="r1",torch_version="2.5",trainpatrol_version="0.1",world_size="2"} 1.0\n'
        "# HELP trainpatrol_step_total Optimizer steps completed.\n# TYPE trainpatrol_step_total counter\n"
        f"trainpatrol_step_total{{{w}}} 1e+06\n"
        "# HELP trainpatrol_step_duration_seconds Wall time of one optimizer step, boundary to boundary.\n"
        "# TYPE trainpatrol_step_duration_seconds histogram\n" + buckets +
        f"trainpatrol_step_duration_seconds_count{{{w}}} 5.0\n"
        f"trainpatrol_step_duration_seconds_sum{{{w}}} 2.5\n"
        "# HELP trainpatrol_loss Training loss of the last step read back from the device.\n"
        "# TYPE trainpatrol_loss gauge\n"
        f"trainpatrol_loss{{{w}}} 1.5\n"
        "# HELP trainpatrol_nonfinite_steps_total Steps whose loss or grad norm was NaN or Inf, by kind.\n"
        "# TYPE trainpatrol_nonfinite_steps_total counter\n"
        'trainpatrol_nonfinite_steps_total{container="trainer",kind="l%s",namespace="team-a",node="gpu-12",'
        'pod="w-1",rank="1",run="r1"} 3.0\n'
        "# HELP trainpatrol_rank_up 1 while the rank pushed within the liveness TTL.\n"
        "# TYPE trainpatrol_rank_up gauge\n"
        f"trainpatrol_rank_up{{{w}}} 1.0\n"
        "# HELP trainpatrol_rank_last_push_timestamp_seconds Unix time of the rank's last accepted push.\n"
        "# TYPE trainpatrol_rank_last_push_timestamp_seconds gauge\n"
        f"trainpatrol_rank_last_push_timestamp_seconds{{{w}}} 1.70000000025e+09\n"
        "# HELP trainpatrol_rank_last_step_timestamp_seconds Unix time at which the rank's step counter last "
        "advanced: the rank's own clock at that step's end, to the sub-second (kept between its previous push and "
        "the one that reported the step, the agent's clock on a rank's first push).\n"
        "# TYPE trainpatrol_rank_last_step_timestamp_seconds gauge\n"
        f"trainpatrol_rank_last_step_timestamp_seconds{{{w}}} 1.70000000025e+09\n"
        "# HELP trainpatrol_run_restarts Restarts of the run so far (torchrun's TORCHELASTIC_RESTART_COUNT, as each "
        "rank pushes it): the most any of this agent's ranks of the run reports. The run-timeline dashboard marks "
        "each increase.\n# TYPE trainpatrol_run_restarts gauge\n"
        'trainpatrol_run_restarts{namespace="team-a",run="r1"} 0.0\n'
        "# HELP trainpatrol_run_step_duration_seconds Wall time of one optimizer step, the histograms of this agent's "
        "ranks of the run summed. sum by (run, le) over agents gives the run's quantiles.\n"
        "# TYPE trainpatrol_run_step_duration_seconds histogram\n"
        + buckets.replace("trainpatrol_step", "trainpatrol_run_step").replace(
            ',node="gpu-12",pod="w-1",rank="1"', "").replace('container="trainer",', "") +
        'trainpatrol_run_step_duration_seconds_count{namespace="team-a",run="r1"} 5.0\n'
        'trainpatrol_run_step_duration_seconds_sum{namespace="team-a",run="r1"} 2.5\n')
    assert_clean(body)


def test_the_standard_level_keeps_a_rank_to_its_budget_and_serves_what_is_the_same_once_per_run() -> None:
    store = RankStore(clock=Clock())
    for rank, (ok, failed, trips) in enumerate([(2.0, 0.0, 0.0), (2.0, 1.0, 3.0)]):
        store.push(snap(rank, samples=[
            {"name": "trainpatrol_loss", "value": 1.5},
            {"name": "trainpatrol_actions_total", "labels": {"action": "pause", "outcome": "ok"}, "value": ok},
            {"name": "trainpatrol_actions_total", "labels": {"action": "pause", "outcome": "failed"},
             "value": failed},
            {"name": "trainpatrol_guard_trips_total", "labels": {"guard": "loss_spike"}, "value": trips},
            {"name": "trainpatrol_guard_active", "labels": {"guard": "loss_spike"}, "value": 0.0},
            {"name": "trainpatrol_rank_stalled_phase", "value": trips},
            {"name": "trainpatrol_micro_step_total", "value": 9.0}]))
    body = text(RankCollector(store)).decode()
    lines = [ln for ln in body.splitlines() if not ln.startswith("#")]
    assert [ln for ln in lines if "actions_total" in ln] == [
        'trainpatrol_run_actions_total{action="pause",outcome="failed",run="r1"} 1.0',
        'trainpatrol_run_actions_total{action="pause",outcome="ok",run="r1"} 2.0']
    assert [ln for ln in lines if "guard" in ln] == [
        'trainpatrol_guard_trips_total{guard="loss_spike",rank="1",run="r1"} 3.0']
    assert [ln for ln in lines if "stalled_phase" in ln] == ['trainpatrol_rank_stalled_phase{rank="1",run="r1"} 3.0']
    assert not [ln for ln in lines if "micro_step" in ln]
    per_rank = [ln for ln in lines if ln.startswith("trainpatrol_step_duration_seconds")]
    assert "# TYPE trainpatrol_step_duration_seconds summary" in body
    assert per_rank == [line for r in (0, 1) for line in (
        f'trainpatrol_step_duration_seconds_count{{rank="{r}",run="r1"}} 5.0',
        f'trainpatrol_step_duration_seconds_sum{{rank="{r}",run="r1"}} 2.5')]
    assert 'trainpatrol_run_step_duration_seconds_bucket{le="0.0025",run="r1"} 2.0' in lines
    assert 'trainpatrol_run_step_duration_seconds_sum{run="r1"} 5.0' in lines
    assert_clean(body.encode())


def test_ranks_are_written_in_order_within_each_family() -> None:
    store = RankStore(clock=Clock())
    for rank, run, ns in ((1, "r1", ""), (0, "r2", ""), (0, "r1", "team-b"), (0, "r1", "")):
        store.push(snap(rank, run=run, namespace=ns, world_size=2))
    lines = [ln for ln in text(RankCollector(store)).decode().splitlines() if ln.startswith("trainpatrol_loss{")]
    assert lines == ['trainpatrol_loss{rank="0",run="r1"} 1.5', 'trainpatrol_loss{rank="1",run="r1"} 1.5',
                     'trainpatrol_loss{rank="0",run="r2"} 1.5',
                     'trainpatrol_loss{namespace="team-b",rank="0",run="r1"} 1.5']


def test_values_go_does_not_write_as_python_does_and_a_zero_of_either_sign() -> None:
    store = RankStore(clock=Clock())
    store.push(snap(0, samples=[{"name": "trainpatrol_loss", "value": float("nan")},
                                {"name": "trainpatrol_grad_norm", "value": float("inf")},
                                {"name": "trainpatrol_amp_loss_scale", "value": -0.0},
                                {"name": "trainpatrol_step_total", "value": 1.5e16}]))
    body = text(RankCollector(store, level="full")).decode()
    assert [ln.rsplit(" ", 1)[1] for ln in body.splitlines() if ln.startswith(("trainpatrol_loss{",
            "trainpatrol_grad_norm{", "trainpatrol_amp_loss_scale{", "trainpatrol_step_total{"))] == [
        "1.5e+16", "NaN", "+Inf", "-0.0"]
    store.push(snap(0, samples=[{"name": "trainpatrol_amp_loss_scale", "value": 0.0}]))
    assert 'trainpatrol_amp_loss_scale{rank="0",run="r1"} 0.0\n' in text(RankCollector(store, level="full")).decode()


def test_changed_says_yes_after_a_push_and_after_the_ttl_and_no_in_between() -> None:
    clock = Clock()
    store = RankStore(rank_up_ttl=15.0, clock=clock)
    collector = Watched(RankCollector(store))
    assert collector.changed()
    text(collector)
    assert not collector.changed()
    store.push(snap(0))
    assert collector.changed()
    text(collector)
    clock.now = T0 + 15.0
    assert not collector.changed()
    clock.now = T0 + 15.001
    assert collector.changed()
    assert 'trainpatrol_rank_up{rank="0",run="r1"} 0.0\n' in text(collector).decode()
    assert not collector.changed()


def test_one_collector_writes_each_ranks_latest_push_and_step_times_scrape_after_scrape() -> None:
    clock = Clock()
    store = RankStore(clock=clock)
    collector = RankCollector(store)
    store.push(snap(0, step=7))
    store.push(snap(1, step=7))
    text(collector)
    clock.now = T0 + 2.5
    store.push(snap(0, step=8))
    store.push(snap(1, step=7))  # pushed again, but no step since
    body = text(collector).decode()
    stamps = [ln for ln in body.splitlines() if ln.startswith("trainpatrol_rank_last_")]
    assert stamps == ['trainpatrol_rank_last_push_timestamp_seconds{rank="0",run="r1"} 1.70000000275e+09',
                      'trainpatrol_rank_last_push_timestamp_seconds{rank="1",run="r1"} 1.70000000275e+09',
                      'trainpatrol_rank_last_step_timestamp_seconds{rank="0",run="r1"} 1.70000000275e+09',
                      'trainpatrol_rank_last_step_timestamp_seconds{rank="1",run="r1"} 1.70000000025e+09']


def test_a_runs_restart_count_is_served_once_per_run_as_the_most_any_rank_reports() -> None:
    store = RankStore(clock=Clock())
    store.push(snap(0, restart_count=2))
    store.push(snap(1, restart_count=3))
    store.push(snap(0, run="other"))
    lines = [ln for ln in text(RankCollector(store)).decode().splitlines() if ln.startswith("trainpatrol_run_restarts")]
    assert lines == ['trainpatrol_run_restarts{run="other"} 0.0', 'trainpatrol_run_restarts{run="r1"} 3.0']


def test_a_runs_learning_rates_are_served_once_per_run_as_its_lowest_rank_reports_them() -> None:
    store = RankStore(clock=Clock())
    for rank, lr in ((3, 0.5), (1, 0.25), (2, 0.125)):  # pushed out of rank order
        store.push(snap(rank, world_size=4, samples=[{"name": "trainpatrol_learning_rate", "labels": {"param_group": g},
                                        "value": lr / (int(g) + 1)} for g in ("0", "1")]))
    lines = [ln for ln in text(RankCollector(store)).decode().splitlines() if "learning_rate" in ln
             and not ln.startswith("#")]
    assert lines == ['trainpatrol_run_learning_rate{param_group="0",run="r1"} 0.25',
                     'trainpatrol_run_learning_rate{param_group="1",run="r1"} 0.125']


def test_a_runs_throughput_counters_are_served_once_per_run_as_its_ranks_summed() -> None:
    store = RankStore(clock=Clock())
    for rank, (samples, tokens, wait) in enumerate([(64.0, 8192.0, 1.5), (32.0, 4096.0, 0.25)]):
        store.push(snap(rank, samples=[{"name": "trainpatrol_samples_total", "value": samples},
                                       {"name": "trainpatrol_tokens_total", "value": tokens},
                                       {"name": "trainpatrol_loader_wait_seconds_total", "value": wait}]))
    store.push(snap(0, run="no-tokens", samples=[{"name": "trainpatrol_samples_total", "value": 8.0}]))
    summed = ("trainpatrol_run_samples_total", "trainpatrol_run_tokens_total", "trainpatrol_run_loader_wait_seconds")
    lines = [ln for ln in text(RankCollector(store)).decode().splitlines() if ln.startswith(summed)]
    assert lines == ['trainpatrol_run_samples_total{run="no-tokens"} 8.0',
                     'trainpatrol_run_samples_total{run="r1"} 96.0',
                     'trainpatrol_run_tokens_total{run="r1"} 12288.0',
                     'trainpatrol_run_loader_wait_seconds_total{run="r1"} 1.75']

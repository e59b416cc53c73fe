"""A straggler under lock-step parallelism is named: 4 gloo DDP ranks under torchrun, rank 1's forward 30 % slower.
Every rank waits for it at the gradient all-reduce, so step times even out; compute times (up to the model's last
gradient) do not, and the shipped Straggler rule (fast profile, a real Prometheus) names rank 1 and no other.
The same job without a slow rank names none."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

from servers import REPO, agent, prometheus, python_env, query, wait_for

WORKER = REPO / "tests" / "control" / "lockstep_worker.py"
RULES = REPO / "alerting" / "rules-fast.yml"


def lockstep(tmp: Path, url: str, **env: str) -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "4",
                             str(WORKER)], env=python_env(AGENT_URL=url, OUT=str(tmp), OMP_NUM_THREADS="1",
                                                          RUN="lockstep", FORWARD_SECONDS="0.05", **env),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def stragglers(prom: str) -> set[str]:
    return {r["metric"]["rank"] for r in query(prom, 'ALERTS{alertname="TrainPatrolStraggler",alertstate="firing"}')}


STEP_RATIO = ('run_rank:trainpatrol_step_duration_seconds:mean5m{run="lockstep"} / on (run) group_left ()'
              ' run:trainpatrol_step_duration_seconds:median_mean5m{run="lockstep"}')
COMPUTE_RATIO = ('rate(trainpatrol_compute_seconds_total{run="lockstep"}[5m])'
                 ' / on (run, rank) rate(trainpatrol_step_total{run="lockstep"}[5m])'
                 ' / on (run) group_left () run:trainpatrol_compute_seconds_per_step:median_mean5m{run="lockstep"}')
"""Each rank's mean step time and compute time over its run's median, as the Straggler rule works them out."""


def ratios(prom: str, expr: str) -> dict[str, float]:
    return {r["metric"]["rank"]: float(r["value"][1]) for r in query(prom, expr)}


def every_ranks_ratio(prom: str, expr: str) -> dict[str, float]:
    """The ratios once all 4 ranks have one: the recording group that the step ratio reads may evaluate up to an
    interval after the group whose Straggler fired."""
    def all_four() -> dict[str, float]:
        found = ratios(prom, expr)
        return found if len(found) == 4 else {}
    found: dict[str, float] = wait_for(all_four, 30, interval=0.5, what=f"every rank's {expr}")
    return found


def test_a_rank_30_percent_slower_in_its_forward_is_named_by_its_compute_time(tmp_path: Path) -> None:
    with agent(tmp_path) as url, prometheus(tmp_path, [url.removeprefix("http://")], [RULES]) as prom:
        job = lockstep(tmp_path, url, STEPS="100000", SLOW_RANK="1")
        try:
            wait_for(lambda: stragglers(prom), 300, interval=1, what="TrainPatrolStraggler firing")
            assert stragglers(prom) == {"1"}
            compute = every_ranks_ratio(prom, COMPUTE_RATIO)
            # the all-reduce evens step times out; in a young run each rank's window starts at its own first scrape,
            # so on a loaded runner it holds a different share of the slow early steps until it fills
            steps: list[dict[str, float]] = []

            def evened() -> bool:
                steps.append(every_ranks_ratio(prom, STEP_RATIO))
                return max(steps[-1].values()) < 1.1
            try:
                wait_for(evened, 90, interval=2, what="every rank's step ratio under 1.1")
            except TimeoutError:
                raise AssertionError(f"step ratios never evened out: {steps[-3:]}") from None
            # the firing rule already read rank 1 above 1.2; read a moment later on a loaded 2-core runner it may sit
            # just under (1.197 seen in CI), so here it must stay the largest while every other rank stays under the
            # rule's 1.2 (a healthy rank's host-clocked compute time drifts up to about 1.14)
            assert max(compute, key=compute.__getitem__) == "1", compute
            assert all(v < 1.2 for r, v in compute.items() if r != "1"), compute
        finally:
            job.kill()
            job.wait()


def test_a_lockstep_job_without_a_slow_rank_names_none(tmp_path: Path) -> None:
    with agent(tmp_path) as url, prometheus(tmp_path, [url.removeprefix("http://")], [RULES]) as prom:
        job = lockstep(tmp_path, url, STEPS="100000")
        try:
            wait_for(lambda: len(ratios(prom, COMPUTE_RATIO)) == 4, 150, interval=1, what="every rank's compute ratio")
            until = time.monotonic() + 30
            while time.monotonic() < until:
                assert not stragglers(prom)
                time.sleep(1)
        finally:
            job.kill()
            job.wait()

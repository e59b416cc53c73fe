"""TrainPatrolRankDown through a real Prometheus and the shipped rules: a rank that closed normally
never pages, a rank that just disappears does.

The rules are the shipped ones rendered with the fast profile (``for: 0s``), as in
test_alert_loop.py; Prometheus scrapes a real ``trainpatrol agent`` process (liveness TTL 2 s) and
evaluates every second. The run that ends well pauses and resumes first, then trains on past the
agent's keep-alive timeout (uvicorn: 5 s), so its final "closed" push meets the stale connection
of the reported incident. The other run's process "dies": its pushes stop without a close.
"""

from __future__ import annotations

import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from loops import scripted_patrol
from markers import needs_prometheus
from servers import REPO, agent, http_json, prometheus, python_env, query, query_value, wait_for
from trainpatrol import Patrol

pytestmark = [needs_prometheus, pytest.mark.timeout(120)]

UP_TTL = 2.0
AGENT_KEEP_ALIVE = 5.0  # uvicorn's default, which the agent keeps


def fast_rules(tmp: Path) -> Path:
    sys.path.insert(0, str(REPO))
    try:
        from alerting.config import FAST
        from alerting.generate import render
    finally:
        sys.path.remove(str(REPO))
    rules = tmp / "rules-fast.yml"
    rules.write_text(render(FAST, "fast"))
    return rules


class Training:
    """A scripted run in a thread (``boundary`` blocks while paused)."""

    def __init__(self, patrol: Patrol) -> None:
        self.patrol, self.stop = patrol, threading.Event()
        self.thread = threading.Thread(target=self._loop, name=f"run-{patrol.config.run}", daemon=True)
        self.thread.start()

    def _loop(self) -> None:
        while not self.stop.is_set():
            self.patrol.boundary()
            self.patrol.step(torch.tensor(2.0), batch_size=8)
            time.sleep(0.02)

    def end(self) -> None:
        self.stop.set()
        self.thread.join(10)
        assert not self.thread.is_alive()


def rank_down(prom: str, run: str, over: str = "") -> list[dict[str, object]]:
    """TrainPatrolRankDown of ``run``, pending or firing: now, or at any evaluation in ``over``."""
    selector = f'ALERTS{{alertname="TrainPatrolRankDown",run="{run}"}}'
    return query(prom, f"count_over_time({selector}[{over}])" if over else selector)


def test_a_rank_that_closed_normally_never_pages_rank_down_and_one_that_vanished_does(tmp_path: Path) -> None:
    rules = fast_rules(tmp_path)
    # a 5 s keep-alive (the default is 20 s), so a final push finds its kept-alive connection closed
    with agent(tmp_path, "--no-nvml", "--rank-up-ttl", str(UP_TTL),
               env=python_env(TRAINPATROL_KEEP_ALIVE_SECONDS="5")) as url, \
            prometheus(tmp_path, [url.removeprefix("http://")], [rules]) as prom:
        finished = Training(scripted_patrol(tmp_path / "finished", url, run="finished", push_interval_seconds=0.25,
                                            pause_poll_seconds=0.05, guard_actions={}))
        vanished = Training(scripted_patrol(tmp_path / "vanished", url, run="vanished", push_interval_seconds=0.25,
                                            guard_actions={}))
        for run in ("finished", "vanished"):
            wait_for(lambda run=run: query_value(prom, f'trainpatrol_rank_up{{run="{run}"}}') == 1, 20,
                     what=f"Prometheus sees run {run} up")

        # the run that ends well: a pause and a resume, then it trains on past the keep-alive timeout
        finished.patrol.request("pause", "test", source="test")
        wait_for(lambda: finished.patrol.state == "paused", 10, interval=0.02, what="paused")
        http_json(f"{url}/v1/runs/finished/actions", {"action": "resume", "reason": "test"})
        wait_for(lambda: finished.patrol.state == "running", 10, interval=0.02, what="resumed")
        time.sleep(AGENT_KEEP_ALIVE + 1)
        finished.end()
        finished.patrol.close()

        # the other run's process dies: no close, its pushes just stop
        vanished.end()
        vanished.patrol._publisher.stop(final_push=False)
        died = time.time()

        firing = wait_for(lambda: rank_down(prom, "vanished"), 30, what="TrainPatrolRankDown for the vanished rank")
        assert firing[0]["metric"]["rank"] == "0" and firing[0]["metric"]["severity"] == "critical", firing
        print(f"\n[rank-down] the vanished rank paged after {time.time() - died:.1f} s")
        time.sleep(2)  # two more evaluations: the closed rank passed its TTL before the vanished one did
        assert rank_down(prom, "finished", over="5m") == []
        assert finished.patrol._publisher.dropped == 0
        assert query_value(prom, 'trainpatrol_rank_state{run="finished"}') == 5  # closed
        assert query_value(prom, 'trainpatrol_rank_up{run="finished"}') == 0
        assert http_json(f"{url}/v1/runs/finished")["state"] == "closed"
        assert http_json(f"{url}/v1/runs/vanished")["state"] == "down"

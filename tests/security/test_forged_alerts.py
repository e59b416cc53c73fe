"""Issue 22 finding 2, end to end: a forged rank push of another run raised TrainPatrolNonFiniteLoss
(action pause) in a real Prometheus with the shipped rules within 2 s. Now the push is refused and no
alert fires for that run; the run's own rank, which proves its key, still raises the alert."""

from __future__ import annotations

import time
from pathlib import Path

from markers import needs_prometheus
from rank_client import loopback, make_agent, push
from servers import agent_in_thread, prometheus, query, wait_for

RULES = Path(__file__).resolve().parents[2] / "alerting" / "rules.yml"
NAN_LOSS = [{"name": "trainpatrol_nonfinite_steps_total", "labels": {"kind": "loss"}, "value": 2.0}]
ZERO = [{"name": "trainpatrol_nonfinite_steps_total", "labels": {"kind": "loss"}, "value": 0.0}]


def _firing(prom: str, run: str) -> list[str]:
    expr = f'ALERTS{{alertname="TrainPatrolNonFiniteLoss",alertstate="firing",run="{run}"}}'
    return sorted(r["metric"]["rank"] + ":" + r["metric"]["action"] for r in query(prom, expr))


@needs_prometheus
def test_a_forged_rank_push_fires_no_alert_for_another_run(tmp_path: Path) -> None:
    agent = make_agent()
    client = loopback(agent)
    for run in ("victim", "own"):
        assert push(client, f"{run}-key", run=run, rank=0, world_size=8, samples=ZERO).status_code == 200
    with agent_in_thread(agent.app) as port, prometheus(tmp_path, [f"127.0.0.1:{port}"], [RULES]) as prom:
        wait_for(lambda: query(prom, 'trainpatrol_nonfinite_steps_total{run="own"}'), 20, what="a first scrape")
        forged = push(client, "forged-key", run="victim", rank=7, world_size=8, samples=NAN_LOSS)
        assert push(client, "own-key", run="own", rank=0, world_size=8, samples=NAN_LOSS).status_code == 200
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and not _firing(prom, "own"):
            for run in ("victim", "own"):  # keep the ranks live, as a Patrol would
                push(client, f"{run}-key", run=run, rank=0, world_size=8, samples=NAN_LOSS if run == "own" else ZERO)
            time.sleep(0.5)
        assert _firing(prom, "own") == ["0:pause"]  # the pipeline works: the run's own rank raises it
        assert _firing(prom, "victim") == []
        assert forged.status_code == 403
        assert query(prom, 'trainpatrol_nonfinite_steps_total{run="victim",rank="7"}') == []

"""Patrol -> agent -> /metrics -> a real Prometheus; promtool; an agent restart mid-run."""

from __future__ import annotations

import subprocess
import time
from pathlib import Path

from loops import run_scripted, scripted_patrol
from markers import needs_prometheus, needs_promtool
from servers import PROMTOOL, agent, free_port, http_get, prometheus, query_value, wait_for

LOSSES = [4.0 - i / 64 for i in range(120)]  # exact in float32


@needs_prometheus
def test_prometheus_sees_steps_and_last_loss(tmp_path: Path) -> None:
    with agent(tmp_path, "--no-nvml") as url, prometheus(tmp_path, [url.removeprefix("http://")]) as prom:
        patrol = scripted_patrol(tmp_path, url, run="skeleton", push_interval_seconds=0.2)
        run_scripted(patrol, LOSSES)
        patrol.close()
        steps = wait_for(lambda: query_value(prom, 'trainpatrol_step_total{run="skeleton"}') == len(LOSSES),
                         20, what="step_total in Prometheus")
        assert steps
        assert query_value(prom, 'trainpatrol_loss{run="skeleton"}') == LOSSES[-1]
        assert query_value(prom, 'trainpatrol_step_duration_seconds_count{run="skeleton"}') == len(LOSSES)
        assert query_value(prom, 'trainpatrol_samples_total{run="skeleton"}') == 8 * len(LOSSES)


@needs_promtool
def test_exposition_passes_promtool(tmp_path: Path) -> None:
    with agent(tmp_path, "--no-nvml") as url:
        patrol = scripted_patrol(tmp_path, url, run="lint")
        run_scripted(patrol, LOSSES[:10])
        patrol.close()
        body = http_get(url + "/metrics")
    assert b'trainpatrol_step_total{rank="0",run="lint"} 10.0' in body
    assert PROMTOOL is not None
    result = subprocess.run([PROMTOOL, "check", "metrics"], input=body, capture_output=True, timeout=30)
    assert result.returncode == 0, result.stdout.decode() + result.stderr.decode()
    assert result.stdout.decode().strip() == "" and result.stderr.decode().strip() == ""


def test_agent_restart_mid_run_loses_nothing(tmp_path: Path) -> None:
    port = free_port()
    patrol = None
    with agent(tmp_path, "--no-nvml", port=port) as url:
        patrol = scripted_patrol(tmp_path, url, run="restart", push_interval_seconds=0.1)
        run_scripted(patrol, LOSSES[:40])
        wait_for(lambda: b'trainpatrol_step_total{rank="0",run="restart"} 40.0' in http_get(url + "/metrics"),
                 10, what="first push")
    # the agent is gone: the loop goes on and raises nothing; pushes are dropped and counted
    run_scripted(patrol, LOSSES[40:80])
    wait_for(lambda: patrol._publisher.dropped > 0, 10, what="a dropped push")
    with agent(tmp_path, "--no-nvml", "--series", "full", port=port) as url:  # push_dropped_total
        run_scripted(patrol, LOSSES[80:])
        wait_for(lambda: b'trainpatrol_step_total{rank="0",run="restart"} 120.0' in http_get(url + "/metrics"),
                 15, what="totals after the restart")
        body = http_get(url + "/metrics").decode()
        dropped = [ln for ln in body.splitlines() if ln.startswith("trainpatrol_push_dropped_total")]
        assert dropped and float(dropped[0].split()[-1]) >= 1
        patrol.close()
    assert patrol._totals.steps == 120


def test_training_never_waits_for_a_missing_agent(tmp_path: Path) -> None:
    patrol = scripted_patrol(tmp_path, f"http://127.0.0.1:{free_port()}", run="nobody",
                             push_interval_seconds=0.05)
    start = time.perf_counter()
    run_scripted(patrol, LOSSES)
    elapsed = time.perf_counter() - start
    patrol.close()
    assert patrol._totals.steps == len(LOSSES)
    assert patrol._publisher.dropped >= 1
    assert patrol._publisher.delivered == 0
    assert elapsed < 5  # a bound on hanging, not a speed claim: 120 steps with no agent at all

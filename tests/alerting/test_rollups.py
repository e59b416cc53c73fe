"""The run and node rollups and the outlier rules on a 64-rank run (8 ranks a node, whose agent is their
``instance``) with one rank standing out in each quantity: min, median and max come out exactly, the node of the
odd rank shows it, and each outlier rule names the odd rank; in the same run with no odd rank the outlier rules
name ranks at the common value. Real promtool over the shipped rules."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

RULES = Path(__file__).resolve().parents[2] / "alerting" / "rules.yml"
PROMTOOL = shutil.which("promtool")
RANKS, PER_HOST = 64, 8
SLOW, WAITING, LARGEST, FULLEST = 37, 50, 5, 12
pytestmark = pytest.mark.skipif(PROMTOOL is None, reason="promtool not installed (apt-get install prometheus)")


def rank_series(odd: bool) -> list[dict[str, str]]:
    series = []
    for r in range(RANKS):
        labels = f'job="trainpatrol",instance="node-{r // PER_HOST}:9400",run="llama",rank="{r}"'
        step = 12.0 if odd and r == SLOW else 8.0  # seconds of steps a minute, 64 steps: 0.1875 s against 0.125 s
        wait = 0.6 if odd and r == WAITING else 0.05
        series += [
            {"series": f"trainpatrol_rank_info{{{labels},host=\"host-{r // PER_HOST}\"}}", "values": "1x30"},
            {"series": f"trainpatrol_step_duration_seconds_sum{{{labels}}}", "values": f"0+{step}x30"},
            {"series": f"trainpatrol_step_duration_seconds_count{{{labels}}}", "values": "0+64x30"},
            {"series": f"trainpatrol_loader_wait_ratio{{{labels}}}", "values": f"{wait}x30"},
            {"series": f"trainpatrol_grad_norm{{{labels}}}", "values": f"{40 if odd and r == LARGEST else 1}x30"},
            {"series": f"trainpatrol_cuda_memory_used_ratio{{{labels}}}",
             "values": f"{0.95 if odd and r == FULLEST else 0.5}x30"},
            {"series": f"trainpatrol_rank_up{{{labels}}}", "values": "1x30"},
        ]
    return series


def run_promtool(tmp_path: Path, tests: list[dict[str, Any]]) -> subprocess.CompletedProcess[str]:
    spec = {"rule_files": [str(RULES)], "evaluation_interval": "1m",
            "group_eval_order": ["trainpatrol-recording", "trainpatrol-rollups"], "tests": tests}
    (tmp_path / "rollups.test.yml").write_text(yaml.safe_dump(spec, width=10_000))
    return subprocess.run([str(PROMTOOL), "test", "rules", "rollups.test.yml"], cwd=tmp_path, capture_output=True,
                          text=True, timeout=120)


def one(name: str, value: float, **labels: str) -> dict[str, Any]:
    text = ",".join(f'{k}="{v}"' for k, v in {"job": "trainpatrol", "run": "llama", **labels}.items())
    return {"labels": f"{name}{{{text}}}", "value": value}


def rank(name: str, value: float, r: int) -> dict[str, Any]:
    return one(name, value, instance=f"node-{r // PER_HOST}:9400", rank=str(r))


def test_the_rollups_are_exact_and_each_outlier_rule_names_the_odd_rank(tmp_path: Path) -> None:
    step, wait = "trainpatrol_step_duration_seconds", "trainpatrol_loader_wait_ratio"
    checks = [
        (f"run:{step}:min_mean5m", [one(f"run:{step}:min_mean5m", 0.125)]),
        (f"run:{step}:median_mean5m", [one(f"run:{step}:median_mean5m", 0.125)]),
        (f"run:{step}:max_mean5m", [one(f"run:{step}:max_mean5m", 0.1875)]),
        (f"run_instance:{step}:max_mean5m > 0.15",
         [one(f"run_instance:{step}:max_mean5m", 0.1875, instance=f"node-{SLOW // PER_HOST}:9400")]),
        (f"run_rank:{step}:outlier_slowest > 0.15", [rank(f"run_rank:{step}:outlier_slowest", 0.1875, SLOW)]),
        (f"count(run_rank:{step}:outlier_slowest)", [{"labels": "{}", "value": 3}]),
        (f"run:{wait}:max", [one(f"run:{wait}:max", 0.6)]),
        (f"run:{wait}:median", [one(f"run:{wait}:median", 0.05)]),
        (f"run_instance:{wait}:max > 0.5",
         [one(f"run_instance:{wait}:max", 0.6, instance=f"node-{WAITING // PER_HOST}:9400")]),
        (f"run_rank:{wait}:outlier_most_waiting > 0.5", [rank(f"run_rank:{wait}:outlier_most_waiting", 0.6, WAITING)]),
        ("run:trainpatrol_grad_norm:median", [one("run:trainpatrol_grad_norm:median", 1.0)]),
        ("run_rank:trainpatrol_grad_norm:outlier_largest > 1",
         [rank("run_rank:trainpatrol_grad_norm:outlier_largest", 40.0, LARGEST)]),
        ("run_instance:trainpatrol_cuda_memory_used_ratio:max > 0.9",
         [one("run_instance:trainpatrol_cuda_memory_used_ratio:max", 0.95,
              instance=f"node-{FULLEST // PER_HOST}:9400")]),
        ("run_rank:trainpatrol_cuda_memory_used_ratio:outlier_fullest > 0.9",
         [rank("run_rank:trainpatrol_cuda_memory_used_ratio:outlier_fullest", 0.95, FULLEST)]),
    ]
    healthy = [(f"run_rank:{step}:outlier_slowest > 0.125", []), (f"run:{step}:max_mean5m > 0.125", []),
               ("run_rank:trainpatrol_cuda_memory_used_ratio:outlier_fullest > 0.5", [])]
    done = run_promtool(tmp_path, [
        {"name": f"{RANKS} ranks, one odd in each quantity", "interval": "1m", "input_series": rank_series(True),
         "promql_expr_test": [{"expr": e, "eval_time": "20m", "exp_samples": s} for e, s in checks]},
        {"name": f"{RANKS} ranks alike", "interval": "1m", "input_series": rank_series(False),
         "promql_expr_test": [{"expr": e, "eval_time": "20m", "exp_samples": s} for e, s in healthy]}])
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]

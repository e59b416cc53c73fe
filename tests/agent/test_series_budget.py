"""The series one rank costs in Prometheus: at most catalogue.SERIES_BUDGET at the agent's default level, with
every series an alert reads there from the first push (those served only while not 0 read as ``> 0``);
``--series full`` brings back the whole catalogue.

The rank is the README's loop on a real model: a shuffled DataLoader with workers through ``patrol.loader``,
grad norm, batch size and tokens, a validation loss, a GradScaler, two parameter groups, and allocator
readings (simulated here: a GPU rank's memory series)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from servers import agent, http_get
from trainpatrol import Patrol, PatrolConfig
from trainpatrol.catalogue import FULL_ONLY, NONZERO_ONLY, RANK_METRICS, SERIES_BUDGET
from trainpatrol.demo import SimulatedAllocator

RULES = Path(__file__).resolve().parents[2] / "alerting" / "rules.yml"


def a_rank(url: str, tmp: Path) -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 1))
    opt = torch.optim.AdamW([{"params": model[0].parameters()}, {"params": model[2].parameters(), "lr": 1e-4}])
    scaler = torch.amp.GradScaler("cpu")
    data = TensorDataset(torch.randn(256, 16), torch.randn(256, 1))
    loader = DataLoader(data, batch_size=16, shuffle=True, num_workers=2, persistent_workers=True)
    patrol = Patrol(model=model, optimizer=opt, scaler=scaler, config=PatrolConfig(
        run="budget", agent_url=url, checkpoint_dir=str(tmp / "ckpt"), evidence_dir=str(tmp / "evidence"),
        memory_reader=SimulatedAllocator(), push_interval_seconds=3600))
    try:
        for x, y in patrol.loader(loader):
            loss = torch.nn.functional.mse_loss(model(x), y)
            scaler.scale(loss).backward()
            scaler.unscale_(opt)
            total = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            patrol.step(loss, grad_norm=total, batch_size=16, tokens=16 * 16)
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()
        patrol.evaluate(0.5)
        assert patrol._publisher.push_now()
    finally:
        patrol.close()


def series_of_rank(body: str) -> list[str]:
    return [ln.split(" ")[0] for ln in body.splitlines()
            if ln.startswith("trainpatrol_") and 'run="budget"' in ln and 'rank="0"' in ln]


@pytest.fixture(scope="module")
def exposition(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    out = {}
    for level in ("standard", "full"):
        tmp = tmp_path_factory.mktemp(level)
        with agent(tmp, "--series", level) as url:
            a_rank(url, tmp)
            out[level] = http_get(f"{url}/metrics").decode()
    return out


def test_a_rank_costs_at_most_the_budget_at_the_standard_level(exposition: dict[str, str]) -> None:
    series = series_of_rank(exposition["standard"])
    assert 28 <= len(series) <= SERIES_BUDGET == 30, "\n".join(series)
    assert not {s.split("{")[0] for s in series} & FULL_ONLY
    # a rank's step times as a summary: _sum and _count, no bucket (the +Inf one repeats _count)
    assert "trainpatrol_step_duration_seconds_bucket" not in exposition["standard"]
    assert "# TYPE trainpatrol_step_duration_seconds summary" in exposition["standard"]
    assert 'trainpatrol_rank_stalled_phase{rank="0",run="budget"} 0.0' in exposition["full"]
    assert "trainpatrol_rank_stalled_phase{" not in exposition["standard"]


def test_every_series_an_alert_reads_is_there_from_the_first_push(exposition: dict[str, str]) -> None:
    read = set(re.findall(r"(?<![:\w])trainpatrol_[a-z_]+", RULES.read_text()))  # not recorded names
    served = {s.split("{")[0] for s in exposition["standard"].splitlines() if s.startswith("trainpatrol_")}
    rank_metrics = {m.name for m in RANK_METRICS if m.kind != "histogram"} | {
        m.name + suffix for m in RANK_METRICS if m.kind == "histogram" for suffix in ("_bucket", "_sum", "_count")}
    missing = sorted((read & rank_metrics) - served - {"trainpatrol_validation_loss"} - NONZERO_ONLY
                     | (read & FULL_ONLY))
    assert missing == []
    # a series left out at 0 may only be read as "> 0", where its absence and 0 agree
    for name in read & NONZERO_ONLY:
        uses = re.findall(rf"(?<![:\w]){name}(?:{{[^}}\n]*}})?([^\n]*)", RULES.read_text())
        assert uses and all(use.strip() == "> 0" for use in uses), (name, uses)
    assert 'trainpatrol_nonfinite_steps_total{kind="grad",rank="0",run="budget"} 0.0' in exposition["standard"]
    assert 'trainpatrol_cuda_ooms_total{rank="0",run="budget"} 0.0' in exposition["standard"]


def test_the_full_level_serves_the_whole_catalogue(exposition: dict[str, str]) -> None:
    full = {s.split("{")[0] for s in series_of_rank(exposition["full"])}
    expected = {m.name for m in RANK_METRICS if m.kind != "histogram"}
    after_a_checkpoint = {"trainpatrol_checkpoint_write_seconds", "trainpatrol_last_checkpoint_step",
                          "trainpatrol_last_checkpoint_timestamp_seconds"}
    # the allocator baseline's slope needs readings spread over time: a run slowed by a busy machine has one
    slope = {"trainpatrol_cuda_memory_baseline_slope_bytes_per_step"}
    assert after_a_checkpoint <= expected - full <= after_a_checkpoint | slope
    assert len(series_of_rank(exposition["full"])) > len(series_of_rank(exposition["standard"])) + 40


def test_the_learning_rate_is_served_once_per_run_at_the_standard_level(exposition: dict[str, str]) -> None:
    lines = [ln for ln in exposition["standard"].splitlines() if "learning_rate{" in ln]
    assert lines == ['trainpatrol_run_learning_rate{param_group="0",run="budget"} 0.001',
                     'trainpatrol_run_learning_rate{param_group="1",run="budget"} 0.0001']

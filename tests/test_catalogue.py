"""The catalogue is the single list of metrics: docs/metrics.md equals it, and every metric in it exists."""

from __future__ import annotations

import re
from pathlib import Path

from loops import run_scripted, scripted_patrol
from probe.test_patrol_values import ScriptedAllocator
from trainpatrol import Patrol
from trainpatrol.catalogue import ALL_METRICS, RANK_METRICS, render_markdown

ROOT = Path(__file__).resolve().parents[1]
UNITS = {"seconds": "_seconds", "bytes": "_bytes", "ratio": "_ratio", "celsius": "_celsius", "watts": "_watts",
         "joules": "_joules_total", "hertz": "_hertz"}


def test_docs_metrics_md_is_generated_from_the_catalogue() -> None:
    assert (ROOT / "docs" / "metrics.md").read_text() == render_markdown(), \
        "docs/metrics.md is stale: run `make docs`"


def test_names_follow_prometheus_conventions() -> None:
    names = [m.name for m in ALL_METRICS]
    assert len(names) == len(set(names))
    for m in ALL_METRICS:
        # one prefix; the agent's process_* metrics keep the names every client library gives them
        assert re.fullmatch(r"trainpatrol_[a-z0-9_]+", m.name) or (
            m.source == "agent" and re.fullmatch(r"process_[a-z0-9_]+", m.name)), m.name
        assert (m.kind == "counter") == m.name.endswith("_total"), m.name
        assert m.kind != "info" or m.name.endswith("_info"), m.name
        if m.unit in UNITS:
            assert UNITS[m.unit] in m.name, m.name
        assert "job" not in m.all_labels and not {"step", "pid", "loss", "batch"} & set(m.all_labels), m.name
        assert m.help.endswith("."), m.name


def test_every_rank_metric_is_pushed_by_a_patrol(tmp_path: Path) -> None:
    patrol = scripted_patrol(tmp_path, memory_reader=ScriptedAllocator(5 * 2**30), memory_interval_seconds=0.0,
                             guard_actions={})
    import torch

    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1)
    patrol.optimizer = opt
    from torch.utils.data import DataLoader

    # a persistent worker is alive when the snapshot is built: its resident set is pushed too
    loader = DataLoader(torch.utils.data.TensorDataset(torch.ones(8)), batch_size=2, num_workers=1,
                        persistent_workers=True)
    for (x,) in patrol.loader(loader):
        patrol.step(x.sum(), grad_norm=1.0, batch_size=2)
    run_scripted(patrol, [1.0, 2.0], grad_norms=[1.0, 2.0])
    model = torch.nn.Linear(2, 1)  # a CPU rank with a model times its compute (a hook on the first parameter)
    with_model = Patrol(model=model, config=patrol.config)
    model(torch.ones(1, 2)).sum().backward()
    with_model.step(torch.tensor(1.0))
    timed = {s["name"] for s in with_model._report.snapshot()["samples"]} & {"trainpatrol_compute_seconds_total"}
    with_model.close()
    patrol.evaluate(0.5)
    patrol._latest.loss_scale = 1024.0  # set by a GradScaler (tested in test_patrol_values)
    patrol._record.last_checkpoint_time, patrol._record.last_checkpoint_step = 1.0, 2.0
    patrol._record.last_checkpoint_write_seconds = 0.5
    snap = patrol._report.snapshot()
    pushed = {s["name"] for s in snap["samples"]} | {"trainpatrol_step_duration_seconds"} | timed
    assert pushed == {m.name for m in RANK_METRICS}
    patrol.close()

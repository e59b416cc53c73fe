"""The evidence report (matplotlib, seconds of Python) is rendered by a child process: the training process
never imports matplotlib, so the report cannot hold its GIL, and the report is there once the Patrol closes."""

from __future__ import annotations

import json
import logging
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from servers import python_env
from trainpatrol.control.evidence import REPORTS_WAITING, EvidenceWriter

SCRIPT = """
import json, sys, torch
from pathlib import Path
from trainpatrol import Patrol, PatrolConfig
root = Path(sys.argv[1])
model = torch.nn.Linear(4, 1)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
patrol = Patrol(model=model, optimizer=opt, config=PatrolConfig(
    run="report-child", agent_url="http://127.0.0.1:9", embedded_agent=False, checkpoint_dir=str(root / "ckpt"),
    evidence_dir=str(root / "evidence"), push_interval_seconds=3600, guard_actions={}))
patrol.request("checkpoint", "test")
for _ in range(5):
    patrol.boundary()
    loss = model(torch.randn(8, 4)).pow(2).mean()
    loss.backward()
    patrol.step(loss)
    opt.step()
    opt.zero_grad()
rendered_here = "matplotlib" in sys.modules
patrol.close()
print(json.dumps({"matplotlib_imported": rendered_here or "matplotlib" in sys.modules,
                  "actions": [(a.action, a.outcome) for a in patrol.actions]}))
"""


def test_the_report_is_rendered_by_a_child_process_and_written_by_close(tmp_path: Path) -> None:
    done = subprocess.run([sys.executable, "-c", SCRIPT, str(tmp_path)], capture_output=True, text=True,
                          env=python_env(), timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    out = json.loads(done.stdout.strip().splitlines()[-1])
    assert out == {"matplotlib_imported": False, "actions": [["checkpoint", "ok"]]}
    reports = list((tmp_path / "evidence").glob("*/report.html"))
    assert len(reports) == 1 and "timeline" in reports[0].read_text()


def test_reports_waiting_to_render_are_bounded_and_the_rest_are_named(tmp_path: Path,
                                                                     caplog: pytest.LogCaptureFixture) -> None:
    writer = EvidenceWriter(tmp_path, 0, torch.device("cpu"), history=list, config=dict, nvml=lambda: None)
    bundles = [tmp_path / f"bundle-{i}" for i in range(10)]
    with caplog.at_level(logging.WARNING, logger="trainpatrol"):
        for bundle in bundles:
            writer.index(bundle, {"action": "checkpoint"}, {"source": "test"})
        writer.wait()
    skipped = [r.getMessage() for r in caplog.records if "not rendered" in r.getMessage()]
    assert len(skipped) in (10 - REPORTS_WAITING - 1, 10 - REPORTS_WAITING)  # the first may have left the queue
    assert not any(str(bundles[-1]) in m for m in skipped)  # the newest always renders: the oldest waiting give way
    assert (bundles[-1] / "manifest.json").is_file()

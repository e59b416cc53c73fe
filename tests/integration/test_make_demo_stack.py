"""``make demo-stack`` as a newcomer runs it: a fresh clone, the default relative workdir, the Makefile's own flags."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from markers import needs_alertmanager, needs_prometheus
from servers import REPO

PAUSED = re.compile(r"\[demo\] run demo is paused at step (\d+), about [\d.]+ s after the fault, by (.+?); "
                    r"checkpoint: (\S+); evidence: (\S+)")


def _clone(tmp: Path) -> Path:
    clone = tmp / "trainpatrol"
    subprocess.run(["git", "clone", "--quiet", str(REPO), str(clone)], check=True, timeout=60)
    return clone


def _make_demo_stack(clone: Path) -> tuple[int, str]:
    """Runs the target with the venv this test runs in (CI's ``make test`` built it in the checkout) and the
    clone's code; ``-o`` keeps make from rebuilding that venv because the clone's pyproject.toml is newer."""
    venv = Path(sys.prefix)
    env = {**os.environ, "PYTHONPATH": str(clone / "exporter")}
    result = subprocess.run(["make", "--no-print-directory", "demo-stack", f"VENV={venv}", "-o", f"{venv}/.installed"],
                            cwd=clone, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=240)
    out = result.stdout.decode(errors="replace")
    (clone.parent / "make-demo-stack.log").write_text(out)
    return result.returncode, out


@needs_prometheus
@needs_alertmanager
@pytest.mark.timeout(300)
def test_make_demo_stack_from_a_fresh_clone_pauses_on_the_prometheus_alert(tmp_path: Path) -> None:
    clone = _clone(tmp_path)
    rc, out = _make_demo_stack(clone)
    assert rc == 0, out[-4000:]
    found = PAUSED.findall(out)
    assert len(found) == 1, out[-4000:]
    step, by, checkpoint, evidence = found[0]
    assert int(step) >= 200
    assert by == "Prometheus alert TrainPatrolGradNormExplosion (Prometheus -> Alertmanager -> agent webhook)"
    assert (clone / checkpoint / "meta.json").is_file()
    assert (clone / evidence / "trigger.json").is_file()
    assert "alert fired: TrainPatrolGradNormExplosion (firing, run demo, action pause, agent: act)" in out
    assert "[demo] done: 600 steps." in out
    stack = (clone / "demo-output" / "stack").resolve()
    assert f'"{stack}/rules-fast.yml"' in (stack / "prometheus.yml").read_text()


@needs_prometheus
@needs_alertmanager
@pytest.mark.timeout(300)
def test_make_demo_stack_without_the_rules_exits_non_zero_saying_so(tmp_path: Path) -> None:
    clone = _clone(tmp_path)
    (clone / "alerting" / "rules-fast.yml").write_text("groups: []\n")
    rc, out = _make_demo_stack(clone)
    assert rc != 0, out[-4000:]
    stack = (clone / "demo-output" / "stack").resolve()
    assert (f"[demo] --stack: Prometheus loaded no alerting rule TrainPatrolGradNormExplosion from "
            f"{stack}/rules-fast.yml (0 alerting rules in all), so the injected grad_spike would go unseen") in out
    assert "[demo] step" not in out  # it fails before training

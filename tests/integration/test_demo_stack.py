"""``trainpatrol demo --stack`` as a newcomer runs it: a subprocess, end to end, judged by its output and files."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import urllib.error
from pathlib import Path

import pytest

from markers import needs_alertmanager, needs_prometheus
from servers import REPO, free_port, http_get, python_env

PAUSED = re.compile(r"\[demo\] run demo is paused at step (\d+), about ([\d.]+) s after the fault, by (.+?); "
                    r"checkpoint: (\S+); evidence: (\S+)")


def _demo(tmp: Path, *args: str, env: dict[str, str] | None = None) -> tuple[int, str]:
    cmd = [sys.executable, "-m", "trainpatrol", "demo", "--workdir", str(tmp / "out"), "--auto-resume", "1",
           "--agent-url", f"http://127.0.0.1:{free_port()}", *args]
    try:
        result = subprocess.run(cmd, cwd=REPO, env=env or python_env(), stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, timeout=150)
    except subprocess.TimeoutExpired as exc:  # say how far it got
        partial = (exc.output or b"").decode(errors="replace")
        (tmp / "demo.log").write_text(partial)
        pytest.fail(f"the demo ran past 150 s; its output so far:\n{partial[-4000:]}")
    out = result.stdout.decode(errors="replace")
    (tmp / "demo.log").write_text(out)
    return result.returncode, out


def _pause(out: str) -> tuple[int, str, Path, Path]:
    """The one pause of the run: step, trigger, checkpoint and evidence bundle."""
    found = PAUSED.search(out)
    assert found, out[-4000:]
    assert len(PAUSED.findall(out)) == 1, out[-4000:]
    print(f"\n[demo] paused {found[2]} s after the fault, by {found[3]}")
    return int(found[1]), found[3], Path(found[4]), Path(found[5])


@needs_prometheus
@needs_alertmanager
@pytest.mark.timeout(180)
def test_demo_stack_pauses_on_the_prometheus_alert_and_resumes(tmp_path: Path) -> None:
    rc, out = _demo(tmp_path, "--stack", "--steps", "400", "--prometheus-port", str(free_port()),
                    "--alertmanager-port", str(free_port()))
    assert rc == 0, out[-4000:]
    prom = re.search(r"\[demo\] --stack: Prometheus +(http://127\.0\.0\.1:\d+)", out)
    am = re.search(r"\[demo\] --stack: Alertmanager +(http://127\.0\.0\.1:\d+)", out)
    assert prom and am, out[-4000:]
    assert "FAST profile" in out
    assert "injecting grad_spike@200" in out  # the --stack default: no local guard acts on it

    step, by, checkpoint, evidence = _pause(out)
    assert step >= 200
    assert by.startswith("Prometheus alert TrainPatrolGradNormExplosion"), by
    assert (checkpoint / "meta.json").is_file() and json.loads((checkpoint / "meta.json").read_text())["pinned"]
    trigger = json.loads((evidence / "trigger.json").read_text())
    assert trigger["source"] == "alertmanager:TrainPatrolGradNormExplosion"
    assert json.loads((evidence / "manifest.json").read_text())["action"] == "pause"
    assert f"resume at step {step}: ok" in out
    assert "alert fired: TrainPatrolGradNormExplosion (firing, run demo, action pause, agent: act)" in out
    assert "[demo] done: 400 steps." in out
    # the healthy warm-up trips no alert and no guard: before the fault the run writes only its own
    # checkpoints (periodic, new best validation loss); what fires afterwards is what the grad spike causes
    bundles = sorted((int(b.name.split("-step")[1][:8]), json.loads((b / "trigger.json").read_text())["source"])
                     for b in (tmp_path / "out" / "evidence").iterdir())
    fired = sorted(set(re.findall(r"alert fired: (\w+) \(firing", out)))
    seen = f"bundles (step, source): {bundles}; alerts fired: {fired}"
    assert any(s < 200 for s, _ in bundles), seen
    assert all(src in ("periodic", "best_validation_loss") for s, src in bundles if s < 200), seen
    assert fired in (["TrainPatrolGradNormExplosion"], ["TrainPatrolGradNormExplosion", "TrainPatrolLossSpike"]), seen

    # the stack is gone
    for url in (prom[1], am[1]):
        with pytest.raises(urllib.error.URLError):
            http_get(url + "/-/ready", timeout=1)


@pytest.mark.timeout(120)
def test_demo_stack_without_binaries_falls_back_to_the_local_guards(tmp_path: Path) -> None:
    env = python_env(PATH=os.path.dirname(sys.executable))  # no prometheus, no alertmanager
    rc, out = _demo(tmp_path, "--stack", "--steps", "150", "--inject", "grad_spike@60", env=env)
    assert rc == 0, out[-4000:]
    assert "Falling back to the local guards" in out
    assert "--stack: Prometheus" not in out
    step, by, checkpoint, evidence = _pause(out)
    assert step >= 60
    assert by.startswith("local guard grad_norm_explosion"), by
    assert (checkpoint / "meta.json").is_file() and (evidence / "trigger.json").is_file()
    assert "[demo] done: 150 steps." in out


@needs_prometheus
@needs_alertmanager
@pytest.mark.timeout(180)
def test_demo_stack_exits_non_zero_when_the_expected_alert_never_arrives(tmp_path: Path) -> None:
    """The run ends before its fault (step 1000 of 60), so the alert the fault should fire never comes."""
    rc, out = _demo(tmp_path, "--stack", "--steps", "60", "--inject", "grad_spike@1000", "--prometheus-port",
                    str(free_port()), "--alertmanager-port", str(free_port()))
    assert rc == 1, out[-4000:]
    prom = re.search(r"\[demo\] --stack: Prometheus +(http://127\.0\.0\.1:\d+)", out)
    am = re.search(r"\[demo\] --stack: Alertmanager +(http://127\.0\.0\.1:\d+)", out)
    assert prom and am, out[-4000:]
    assert "[demo] done: 60 steps." in out
    assert (f"[demo] --stack: FAILED: the injected grad_spike should have fired TrainPatrolGradNormExplosion, but "
            f"the agent's webhook never received it; see {prom[1]}/alerts, {am[1]} and the logs in "
            f"{tmp_path / 'out' / 'stack'}.") in out

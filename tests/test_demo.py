"""``trainpatrol demo`` on the CPU, as ``make demo`` runs it: what it prints at the end, and that it
prints no warning about its own monitoring."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

from servers import free_port, python_env, wait_for
from trainpatrol.probe.embedded import agent_answers


def test_the_demo_ends_by_pointing_at_the_pause_bundle_and_logs_no_push_failure(tmp_path: Path) -> None:
    url = f"http://127.0.0.1:{free_port()}"
    work = tmp_path / "out"
    result = subprocess.run([sys.executable, "-m", "trainpatrol", "demo", "--steps", "160", "--inject", "nan@150",
                             "--agent-url", url, "--workdir", str(work), "--step-sleep", "0", "--auto-resume", "0.5",
                             "--checkpoint-every", "155", "--quiet"],
                            capture_output=True, text=True, timeout=180,
                            env=python_env(TRAINPATROL_EMBEDDED_AGENT_IDLE_SECONDS="3"))
    assert result.returncode == 0, result.stderr
    [pause] = sorted((work / "evidence").glob("*-step00000150-pause"))
    assert sorted((work / "evidence").glob("*-step00000155-checkpoint"))  # a later bundle, not the incident
    last = result.stdout.splitlines()[-1]
    assert last == (f"[demo] done: 160 steps. The pause's evidence: {pause} (open {pause / 'report.html'}); "
                    f"last checkpoint: {work / 'checkpoints' / 'step-00000155'}")
    assert (pause / "report.html").is_file()
    logged = result.stdout + result.stderr
    assert re.findall(r".*(?:push to agent|Broken pipe|Connection refused|none answers).*", logged) == []
    assert "it exits 3 s after the last rank's push" in logged
    wait_for(lambda: not agent_answers(url), 15, what="the demo's embedded agent exiting by itself")

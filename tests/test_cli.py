"""The CLI against a real agent with a token: actions, status, and errors that name the problem."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from loops import run_scripted, scripted_patrol
from servers import agent, http_json, python_env


def cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "trainpatrol", *args], capture_output=True, text=True,
                          timeout=60, env=env or python_env())


def test_cli_actions_and_status_with_a_token_file(tmp_path: Path) -> None:
    token = tmp_path / "token"
    token.write_text("cli-secret\n")
    with agent(tmp_path, "--no-nvml", "--token-file", str(token)) as url:
        patrol = scripted_patrol(tmp_path, url, run="cli-run", push_interval_seconds=0.1, token="cli-secret")
        run_scripted(patrol, [1.0] * 7)
        patrol.publisher.push_now()
        denied = cli("pause", "cli-run", "--agent", url)
        assert denied.returncode == 1 and "401" in denied.stderr
        ok = cli("checkpoint", "cli-run", "--agent", url, "--token-file", str(token), "--reason", "from test")
        assert ok.returncode == 0 and ok.stdout.startswith("checkpoint queued for run cli-run (id ")
        pending = http_json(f"{url}/v1/runs/cli-run")["pending_commands"]
        assert [(c["action"], c["reason"], c["source"]) for c in pending] == [("checkpoint", "from test", "api")]
        status = cli("status", "--agent", url, "--token-file", str(token))
        assert status.returncode == 0
        lines = status.stdout.splitlines()
        assert lines[0].split() == ["RUN", "STATE", "RANK", "RANK", "STATE", "STEP", "HOST", "LAST", "ACTION"]
        assert lines[1].split()[:5] == ["cli-run", "running", "0", "running", "7"]
        patrol.close()


def test_cli_reports_an_unreachable_agent() -> None:
    result = cli("resume", "x", "--agent", "http://127.0.0.1:9")
    assert result.returncode == 1 and "cannot reach agent http://127.0.0.1:9" in result.stderr


def test_agent_refuses_non_loopback_without_token() -> None:
    env = python_env()
    env.pop("TRAINPATROL_TOKEN", None)
    result = cli("agent", "--host", "0.0.0.0", "--port", "9", "--no-nvml", env=env)
    assert result.returncode == 2
    assert "not loopback, and no token is set" in result.stderr

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
        assert ok.stdout.endswith("; 1 live rank)\n"), ok.stdout
        pending = http_json(f"{url}/v1/runs/cli-run")["pending_commands"]
        assert [(c["action"], c["reason"], c["source"]) for c in pending] == [("checkpoint", "from test", "api")]
        status = cli("status", "--agent", url, "--token-file", str(token))
        assert status.returncode == 0
        lines = status.stdout.splitlines()
        assert lines[0].split() == ["RUN", "STATE", "RANK", "RANK", "STATE", "STEP", "HOST", "LAST", "ACTION"]
        assert lines[1].split()[:5] == ["cli-run", "running", "0", "running", "7"]
        patrol.close()


def test_cli_action_for_a_run_no_live_rank_serves_says_so_in_one_line(tmp_path: Path) -> None:
    token = tmp_path / "token"
    token.write_text("cli-secret\n")
    with agent(tmp_path, "--no-nvml", "--token-file", str(token)) as url:
        patrol = scripted_patrol(tmp_path, url, run="ended", token="cli-secret")
        run_scripted(patrol, [1.0] * 3)
        patrol.close()  # its final push says closed
        assert http_json(f"{url}/v1/runs/ended")["state"] == "closed"
        for run in ("ended", "never-seen"):
            for action in ("pause", "resume", "checkpoint", "stop", "capture", "empty-cache"):
                result = cli(action, run, "--agent", url, "--token-file", str(token))
                assert result.returncode == 1, (action, run, result)
                assert result.stderr == f"no live rank of run {run} on this agent\n", (action, run, result.stderr)
                assert result.stdout == ""
        assert http_json(f"{url}/v1/runs/ended")["pending_commands"] == []


def test_cli_reports_an_unreachable_agent() -> None:
    result = cli("resume", "x", "--agent", "http://127.0.0.1:9")
    assert result.returncode == 1 and "cannot reach agent http://127.0.0.1:9" in result.stderr


def test_agent_refuses_non_loopback_without_token() -> None:
    env = python_env()
    env.pop("TRAINPATROL_TOKEN", None)
    result = cli("agent", "--host", "0.0.0.0", "--port", "9", "--no-nvml", env=env)
    assert result.returncode == 2
    assert "not loopback, and no token is set" in result.stderr

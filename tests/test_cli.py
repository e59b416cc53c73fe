"""The CLI against a real agent with a token: actions, status, and errors that name the problem."""

from __future__ import annotations

import http.server
import subprocess
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import trainpatrol
from loops import run_scripted, scripted_patrol
from servers import agent, answer_json, free_port, http_json, python_env


def cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "trainpatrol", *args], capture_output=True, text=True,
                          timeout=60, env=env or python_env())


def test_cli_actions_and_status_with_a_token_file(tmp_path: Path) -> None:
    token = tmp_path / "token"
    token.write_text("cli-secret\n")
    with agent(tmp_path, "--no-nvml", "--token-file", str(token)) as url:
        patrol = scripted_patrol(tmp_path, url, run="cli-run", push_interval_seconds=0.1, token="cli-secret")
        run_scripted(patrol, [1.0] * 7)
        patrol._publisher.push_now()
        denied = cli("pause", "cli-run", "--agent", url)
        assert denied.returncode == 1 and "401" in denied.stderr
        ok = cli("checkpoint", "cli-run", "--agent", url, "--token-file", str(token), "--reason", "from test")
        assert ok.returncode == 0 and ok.stdout.startswith("checkpoint queued for run cli-run (id ")
        assert ok.stdout.endswith("; 1 live rank)\n"), ok.stdout
        pending = http_json(f"{url}/v1/runs/cli-run", token="cli-secret")["pending_commands"]
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
        assert http_json(f"{url}/v1/runs/ended", token="cli-secret")["state"] == "closed"
        for run in ("ended", "never-seen"):
            for action in ("pause", "resume", "checkpoint", "stop", "capture", "empty-cache"):
                result = cli(action, run, "--agent", url, "--token-file", str(token))
                assert result.returncode == 1, (action, run, result)
                assert result.stderr == f"no live rank of run {run} on this agent\n", (action, run, result.stderr)
                assert result.stdout == ""
        assert http_json(f"{url}/v1/runs/ended", token="cli-secret")["pending_commands"] == []


def test_cli_reports_an_unreachable_agent() -> None:
    result = cli("resume", "x", "--agent", "http://127.0.0.1:9")
    assert result.returncode == 1 and "cannot reach agent http://127.0.0.1:9" in result.stderr


def test_agent_refuses_non_loopback_without_token() -> None:
    env = python_env()
    env.pop("TRAINPATROL_TOKEN", None)
    result = cli("agent", "--host", "0.0.0.0", "--port", "9", "--no-nvml", env=env)
    assert result.returncode == 2
    assert "not loopback, and no token is set" in result.stderr


def one_line_error(result: subprocess.CompletedProcess[str]) -> str:
    """The one stderr line of a failed command, after checking there is nothing else."""
    assert result.returncode != 0, result
    assert "Traceback" not in result.stderr, result.stderr
    assert result.stdout == "", result.stdout
    assert result.stderr.count("\n") == 1 and result.stderr.endswith("\n"), result.stderr
    return result.stderr[:-1]


def test_status_with_an_agent_that_is_not_a_url_says_so_in_one_line() -> None:
    result = cli("status", "--agent", "notaurl")
    assert one_line_error(result) == ("trainpatrol status: argument --agent: 'notaurl' is not an agent URL; "
                                      "expected http://HOST:PORT (see trainpatrol status --help)")
    assert result.returncode == 2


def test_report_of_a_missing_directory_says_so_in_one_line(tmp_path: Path) -> None:
    missing = tmp_path / "nope"
    result = cli("report", str(missing))
    assert one_line_error(result) == f"trainpatrol report: {missing} is not a directory"
    assert result.returncode == 1


def test_report_of_a_directory_that_is_no_bundle_refuses_and_writes_nothing(tmp_path: Path) -> None:
    (tmp_path / "notes.txt").write_text("hello\n")
    result = cli("report", str(tmp_path))
    assert one_line_error(result) == (f"trainpatrol report: {tmp_path} is not an evidence bundle "
                                      "(no manifest.json, trigger.json or rank-NNNNN directory)")
    assert result.returncode == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == ["notes.txt"]


def test_status_of_a_run_the_agent_does_not_know_says_so_in_one_line(tmp_path: Path) -> None:
    with agent(tmp_path, "--no-nvml") as url:
        result = cli("status", "nosuchrun", "--agent", url)
    assert one_line_error(result) == f"trainpatrol status: run nosuchrun is unknown on agent {url}"
    assert result.returncode == 1


def test_every_command_words_an_unreachable_agent_the_same_way() -> None:
    url = f"http://127.0.0.1:{free_port()}"
    for args in (["status"], ["status", "somerun"], ["pause", "somerun"], ["resume", "somerun"]):
        result = cli(*args, "--agent", url)
        assert one_line_error(result) == f"trainpatrol {args[0]}: cannot reach agent {url} (Connection refused)"
        assert result.returncode == 1


def test_version_comes_from_the_package() -> None:
    result = cli("--version")
    assert result.returncode == 0 and result.stderr == ""
    assert result.stdout == f"trainpatrol {trainpatrol.__version__}\n"


def test_top_level_help_describes_the_tool_for_users_with_examples() -> None:
    result = cli("--help")
    assert result.returncode == 0
    assert "no logic of its own" not in result.stdout
    assert ("Watches PyTorch training runs, exports their health to Prometheus, and pauses, checkpoints "
            "or stops a sick run.") in " ".join(result.stdout.split())
    assert "examples:\n  trainpatrol demo " in result.stdout
    assert "\n  trainpatrol status\n" in result.stdout


def test_agent_on_a_taken_port_says_so_in_one_line(tmp_path: Path) -> None:
    with agent(tmp_path, "--no-nvml") as url:
        port = url.rsplit(":", 1)[1]
        result = cli("agent", "--port", port, "--no-nvml")
    assert one_line_error(result) == (f"trainpatrol agent: port {port} on 127.0.0.1 is taken (another agent?); "
                                      "pick another with --port")
    assert result.returncode == 1


def test_agent_with_an_nvml_fake_path_that_names_no_fixture_says_so_in_one_line(tmp_path: Path) -> None:
    lone = tmp_path / "nvml.json"
    lone.write_text("{}")  # a fixture without fake.py beside it is as unusable as none
    for path in (tmp_path / "missing.json", lone):
        result = cli("agent", "--port", str(free_port()), "--nvml-fake", str(path))
        assert one_line_error(result) == (
            f"trainpatrol agent: Config 'nvml_fake' has value {str(path)!r}. Expected an NVML fixture (JSON) with "
            "fake.py beside it, as tests/nvml_fake/nvml_h200.json in the repository.")
        assert result.returncode == 2


def test_misuse_gives_one_line_and_a_nonzero_exit(tmp_path: Path) -> None:
    missing = tmp_path / "no-token"
    cases = {
        ("pause",): "trainpatrol pause: the following arguments are required: run (see trainpatrol pause --help)",
        ("frobnicate",): "trainpatrol: argument command: invalid choice: 'frobnicate' (choose from 'agent', "
                         "'checkpoint', 'pause', 'resume', 'stop', 'empty-cache', 'capture', 'status', 'demo', "
                         "'report', 'export') (see trainpatrol --help)",
        ("agent", "--port", "abc"): "trainpatrol agent: argument --port: invalid int value: 'abc' "
                                    "(see trainpatrol agent --help)",
        ("demo", "--inject", "nan@x"): "trainpatrol demo: argument --inject: 'nan@x' is not FAULT@STEP with FAULT one "
                                       "of nan, grad_spike, fragmentation, loader_stall, none and STEP a positive "
                                       "step number (see trainpatrol demo --help)",
        ("status", "--token-file", str(missing)): f"trainpatrol status: cannot read the token file {missing}: "
                                                  "No such file or directory",
    }
    for args, line in cases.items():
        result = cli(*args)
        assert one_line_error(result) == line, args


@contextmanager
def json_server(body: Any) -> Iterator[str]:
    """A real HTTP server that is not an agent: it answers ``body`` as JSON on every path."""

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            answer_json(self, 200, body)

        def log_message(self, *args: Any) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()
        thread.join(5)


def test_status_against_a_server_that_is_not_an_agent_says_so_in_one_line() -> None:
    with json_server({"hello": 1}) as url:
        result = cli("status", "--agent", url)
    assert one_line_error(result) == (f"trainpatrol status: agent {url} answered without a list of runs; "
                                      "is it a trainpatrol agent?")
    with json_server({"runs": [{"run": "x"}]}) as url:
        result = cli("status", "--agent", url)
    assert one_line_error(result) == (f"trainpatrol status: agent {url} answered runs in a form this CLI "
                                      "does not know; try --json")

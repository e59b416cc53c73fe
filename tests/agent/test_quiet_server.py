"""The agent's uvicorn server: one wake-up a second when idle, a fresh Date header, a prompt stop."""

from __future__ import annotations

import email.utils
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from servers import free_port, python_env, wait_for

pytestmark = pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="reads /proc (Linux)")


def _wakeups(pid: int) -> int:
    """Times the agent's event-loop thread went to sleep and was woken (voluntary context switches)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("voluntary_ctxt_switches:"):
            return int(line.split()[1])
    raise AssertionError("no voluntary_ctxt_switches in /proc status")


def _date(url: str) -> float:
    with urllib.request.urlopen(url, timeout=5) as resp:
        return email.utils.parsedate_to_datetime(resp.headers["date"]).timestamp()


def test_idle_agent_wakes_once_a_second_keeps_its_date_fresh_and_stops_at_once(tmp_path: Path) -> None:
    port = free_port()
    log = open(tmp_path / "agent.log", "wb")  # noqa: SIM115 - closed below
    proc = subprocess.Popen([sys.executable, "-m", "trainpatrol", "agent", "--host", "127.0.0.1", "--port",
                             str(port), "--no-nvml"], stdout=log, stderr=subprocess.STDOUT, env=python_env())
    url = f"http://127.0.0.1:{port}/healthz"
    try:
        wait_for(lambda: _date(url), 20, what="agent up")
        time.sleep(1.0)  # the request's own wake-ups are over
        before = _wakeups(proc.pid)
        time.sleep(4.0)
        woken = _wakeups(proc.pid) - before
        assert 2 <= woken <= 8, woken  # once a second; uvicorn's own loop wakes 40 times in 4 s
        first = _date(url)
        assert abs(first - time.time()) < 2.0
        wait_for(lambda: _date(url) > first, 3.0, what="a new Date header")
        proc.send_signal(signal.SIGTERM)
        t0 = time.monotonic()
        proc.wait(timeout=10)
        assert time.monotonic() - t0 < 1.0, "SIGTERM must wake the server loop, not wait for its next tick"
        assert proc.returncode == -signal.SIGTERM  # uvicorn re-raises the signal it handled, as uvicorn.run does
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        log.close()
    assert b"Traceback" not in (tmp_path / "agent.log").read_bytes()


def test_agent_on_a_taken_port_fails_as_uvicorn_run_does(tmp_path: Path) -> None:
    """``serve`` itself, as when the port is taken after the CLI found it free (tests/test_cli.py has the
    CLI's one-line answer to a port taken beforehand)."""
    import socket

    code = ("import sys; from trainpatrol.agent.config import AgentConfig; from trainpatrol.agent.server import serve; "
            "serve(AgentConfig(port=int(sys.argv[1]), nvml=False))")
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = subprocess.run([sys.executable, "-c", code, str(port)], capture_output=True, text=True, timeout=60,
                                env=python_env())
    assert result.returncode == 3
    assert "address already in use" in result.stderr

"""The agent's server: uvicorn's own, stopped by SIGTERM at once, or by ``stop_when_idle``."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from types import SimpleNamespace

from servers import free_port, python_env, wait_for
from trainpatrol import handshake
from trainpatrol.agent.server import stop_when_idle


class FakeClock:
    """Stands in for the idle watcher's ``threading.Event``: each wait moves the clock on by its timeout."""

    def __init__(self, done_at: float = float("inf")) -> None:
        self.now, self.done_at = 0.0, done_at
        self.waits: list[float] = []

    def wait(self, timeout: float) -> bool:
        self.waits.append(round(timeout, 3))
        self.now += timeout
        return self.now >= self.done_at


def test_an_idle_agent_is_asked_to_exit_once_no_rank_pushed_for_the_limit_and_not_before() -> None:
    clock, server = FakeClock(), SimpleNamespace(should_exit=False)
    pushes = [4.0, 9.5]  # then no rank pushes any more

    def idle_for() -> float:
        return clock.now - max((p for p in pushes if p <= clock.now), default=0.0)

    stop_when_idle(server, idle_for, 10.0, clock)  # type: ignore[arg-type]
    assert server.should_exit is True
    assert clock.waits == [10.05, 9.5]  # one wake-up per limit while ranks push, none in between
    assert round(clock.now - pushes[-1], 3) == 10.05


def test_the_idle_watcher_ends_with_the_server_without_asking_it_anything() -> None:
    clock, server = FakeClock(done_at=3.0), SimpleNamespace(should_exit=False)
    stop_when_idle(server, lambda: clock.now, 10.0, clock)  # type: ignore[arg-type]
    assert server.should_exit is False
    assert clock.waits == [10.05]


def test_sigterm_stops_the_agent_at_once_as_uvicorn_run_does_and_removes_its_key(tmp_path: Path) -> None:
    port = free_port()
    log = open(tmp_path / "agent.log", "wb")  # noqa: SIM115 - closed below
    proc = subprocess.Popen([sys.executable, "-m", "trainpatrol", "agent", "--host", "127.0.0.1", "--port",
                             str(port), "--no-nvml"], stdout=log, stderr=subprocess.STDOUT, env=python_env())
    try:
        wait_for(lambda: urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=5).status == 200, 20,
                 what="agent up")
        proc.send_signal(signal.SIGTERM)
        t0 = time.monotonic()
        proc.wait(timeout=10)
        assert time.monotonic() - t0 < 1.0
        assert proc.returncode == -signal.SIGTERM  # uvicorn re-raises the signal it handled
        assert not handshake.key_path(port).exists()  # and the agent cleaned up first: its key is gone
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
    assert "address already in use" in result.stderr.lower()


def test_an_agent_answers_nothing_before_its_users_ranks_can_check_it(tmp_path: Path) -> None:
    """A rank that starts with its agent (a sidecar, an embedded agent) pushes as soon as the port answers: the
    key it checks the agent with must be there by then, or its first pushes, and a short run's final one, fail."""
    port = free_port()
    with open(tmp_path / "agent.log", "wb") as log:
        proc = subprocess.Popen([sys.executable, "-m", "trainpatrol", "agent", "--host", "127.0.0.1", "--port",
                                 str(port), "--no-nvml"], stdout=log, stderr=subprocess.STDOUT, env=python_env())
        try:
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline:
                try:
                    with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=5):
                        break  # the first answer
                except OSError:
                    time.sleep(0.001)
            key = handshake.read_key(port)
            conn = handshake.connect("127.0.0.1", port, "", 5.0)  # raises AgentNotVerified without the key
            conn.close()
        finally:
            proc.terminate()
            proc.wait(10)
    assert len(key) >= 32

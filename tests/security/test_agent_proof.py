"""A run talks only to an agent that proved itself: a listener that took the agent's port learns neither
the token nor the run key, and its forged commands are never obeyed."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

from loops import run_scripted, scripted_patrol
from servers import agent_in_thread, wait_for
from trainpatrol import handshake
from trainpatrol.agent.app import Agent
from trainpatrol.agent.config import AgentConfig

FORGED_STOP = {"id": 7, "run": "victim", "action": "stop", "reason": "forged", "source": "api", "created": 4e9}


@contextmanager
def fake_agent() -> Iterator[tuple[int, list[dict[str, Any]]]]:
    """A listener on a loopback port that logs every request and answers each as a real agent would
    like to: a hello with a made-up proof, a push with a stop for the run."""
    heard: list[dict[str, Any]] = []

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
            heard.append({"path": self.path, "headers": dict(self.headers), "body": body})
            answer = {"proofs": ["0" * 64], "commands": [FORGED_STOP]}
            data = json.dumps(answer).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        do_GET = do_POST

        def log_message(self, *args: Any) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server.server_address[1], heard
    finally:
        server.shutdown()
        server.server_close()


def test_a_listener_on_the_agents_port_learns_no_secret_and_cannot_stop_the_run(tmp_path: Path) -> None:
    with fake_agent() as (port, heard):
        patrol = scripted_patrol(tmp_path, f"http://127.0.0.1:{port}", run="victim", token="the-agent-token",
                                 run_key="the-run-key", push_interval_seconds=0.05)
        try:
            for _ in range(10):
                run_scripted(patrol, [1.0] * 5)
                threading.Event().wait(0.05)
            wait_for(lambda: len(heard) >= 3, 10, what="the run knocking on the fake agent")
            run_scripted(patrol, [1.0] * 5)
            assert patrol.state == "running"
        finally:
            patrol.close()
    assert {h["path"] for h in heard} == {handshake.PATH}  # nothing but hellos: no push, no NVML read
    for h in heard:
        sent = json.dumps(h["headers"]).lower() + h["body"].decode()
        assert "the-agent-token" not in sent and "the-run-key" not in sent, h


def test_an_agent_proves_itself_with_the_token_or_its_users_key_and_no_other(tmp_path: Path) -> None:
    agent = Agent(AgentConfig(nvml=False, token="the-agent-token").load())
    with agent_in_thread(agent.app) as port:
        handshake.connect("127.0.0.1", port, "the-agent-token", 2.0).close()  # the token
        handshake.connect("127.0.0.1", port, "", 2.0).close()  # this user's key file
        for token in ("a-wrong-token",):
            try:
                handshake.connect("127.0.0.1", port, token, 2.0)
            except handshake.AgentNotVerified:
                continue
            raise AssertionError("an agent that does not hold the run's token proved itself")
    assert handshake.read_key(port) == ""  # the key file goes with the agent

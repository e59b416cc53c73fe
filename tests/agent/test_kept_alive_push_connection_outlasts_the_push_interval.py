"""A rank pushing every 5 s (as a fleet does) keeps one connection: the agent never closes it between pushes.

A real ``trainpatrol agent`` process on loopback with its default keep-alive, and the rank's own push client
(``probe.publisher.Publisher``) pushing on its kept-alive connection, silent between pushes for the longest
a 5 s publisher leaves (``next_push_delay``: up to 1.1 intervals, when a push ran late). Before each push the
test looks at the client's socket: had the agent closed it, it would read as at its end. When the agent's
keep-alive was 5 s, the agent closed it about 5 s after each answer, and the publisher had to retry on a new
connection (the retry hides it: only the socket shows it).
"""

from __future__ import annotations

import select
import socket
import time
from pathlib import Path
from typing import Any

import pytest

from servers import agent, http_json, python_env, wait_for
from trainpatrol import handshake
from trainpatrol.probe.publisher import Publisher, next_push_delay

pytestmark = pytest.mark.timeout(60)

INTERVAL = 5.0
"""The push interval a fleet uses."""
SILENCE = max(next_push_delay(INTERVAL, k / 100) for k in range(int(INTERVAL * 100)))
"""The longest silence between two pushes such a publisher leaves, on a 10 ms grid: 5.49 s."""
PUSHES = 3


def snapshots(run: str) -> Any:
    seq = [0]

    def snapshot() -> dict[str, Any]:
        seq[0] += 1
        return {"run": run, "rank": 0, "world_size": 1, "seq": seq[0], "step": seq[0],
                "samples": [{"name": "trainpatrol_step_total", "labels": {}, "value": float(seq[0])}]}
    return snapshot


def closed_by_agent(sock: socket.socket) -> bool:
    """The agent sends nothing unasked on a push connection: readable means it closed (or reset) it."""
    readable, _, _ = select.select([sock], [], [], 0)
    return bool(readable)


def test_pushes_five_seconds_apart_share_one_connection_the_agent_never_closes(tmp_path: Path) -> None:
    assert 5.4 < SILENCE < 5.5
    env = python_env()
    env.pop("TRAINPATROL_KEEP_ALIVE_SECONDS", None)  # the agent's default is what is tested
    with agent(tmp_path, "--no-nvml", env=env) as url:
        port = int(url.rsplit(":", 1)[1])
        wait_for(lambda: handshake.read_key(port), 10, interval=0.02, what="the agent's key file")
        publisher = Publisher(url, snapshots("fleet"), lambda commands: None, interval=INTERVAL, timeout=2.0)
        try:
            connections: list[tuple[object, tuple[str, int]]] = []
            answered = 0.0
            for push in range(PUSHES):
                if push:
                    time.sleep(max(SILENCE - (time.monotonic() - answered), 0.0))
                    assert publisher._conn is not None
                    assert not closed_by_agent(publisher._conn.sock), \
                        f"the agent closed the kept-alive connection within {SILENCE:.2f} s of its answer " \
                        f"(before push {push + 1})"
                assert publisher.push_now(), f"push {push + 1} failed"
                answered = time.monotonic()
                assert publisher._conn is not None and publisher._conn.sock is not None
                connections.append((publisher._conn, publisher._conn.sock.getsockname()))
            assert len({id(conn) for conn, _ in connections}) == 1, "a push went out on a new connection"
            assert len({local for _, local in connections}) == 1, connections
            assert (publisher.delivered, publisher.dropped) == (PUSHES, 0)
            run = http_json(f"{url}/v1/runs/fleet")
            assert run["ranks"][0]["step"] == PUSHES
        finally:
            publisher.stop(final_push=False)

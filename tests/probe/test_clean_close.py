"""A clean exit is a clean exit: a rank's final "closed" push reaches the agent even when the
kept-alive connection it would go out on went stale meanwhile, and the agent shows the rank
``closed``, never ``down``, once its liveness TTL has passed.

A push that changes state (pause, resume, the final one) is a request of its own on one kept-alive
connection, while the periodic pushes go on the stream; so after a pause and resume that
connection sits idle until ``close()``, and the agent (uvicorn: 5 s) has closed it by then, or the
agent restarted in between.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from fastapi.testclient import TestClient
from prometheus_client.parser import text_string_to_metric_families

from loops import scripted_patrol
from servers import agent_in_thread, free_port, http_json, wait_for
from trainpatrol import Patrol
from trainpatrol.agent.app import Agent
from trainpatrol.agent.config import AgentConfig

UP_TTL = 0.5
KEEP_ALIVE = 0.3  # seconds the agent keeps an idle connection open (uvicorn's default is 5)


@pytest.fixture
def logged(caplog: pytest.LogCaptureFixture) -> Iterator[pytest.LogCaptureFixture]:
    """What the Patrol logs at WARNING and above (conftest keeps trainpatrol at ERROR otherwise)."""
    caplog.set_level(logging.WARNING, logger="trainpatrol")
    yield caplog


def make_agent() -> Agent:
    return Agent(AgentConfig(nvml=False, rank_up_ttl_seconds=UP_TTL).load())


def train_in_thread(patrol: Patrol, stop: threading.Event) -> threading.Thread:
    def loop() -> None:
        while not stop.is_set():
            patrol.boundary()  # blocks while paused
            patrol.step(torch.tensor(1.0), batch_size=8)
            time.sleep(0.01)

    thread = threading.Thread(target=loop, name="train", daemon=True)
    thread.start()
    return thread


def pause_and_resume(patrol: Patrol, url: str, run: str) -> None:
    """A pause (a local guard's, say) and a resume through the agent's control API."""
    patrol.request("pause", "test", source="test")
    wait_for(lambda: patrol.state == "paused", 10, interval=0.01, what="paused")
    http_json(f"{url}/v1/runs/{run}/actions", {"action": "resume", "reason": "test"})
    wait_for(lambda: patrol.state == "running", 10, interval=0.01, what="resumed")


def rank_series(agent: Agent, run: str) -> dict[str, float]:
    """rank_up and rank_state (0 running ... 5 closed) of rank 0 of ``run``, as /metrics serves them."""
    text = TestClient(agent.app, base_url="http://localhost").get("/metrics").text
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.labels.get("run") == run and s.name == "trainpatrol_rank_up":
                out["up"] = s.value
            elif s.labels.get("run") == run and s.name == "trainpatrol_rank_state":
                out["state"] = s.value
    return out


def assert_shown_closed(agent: Agent, run: str) -> None:
    """Closed at once (the final push is confirmed when ``close()`` returns), and still closed,
    not down, once the liveness TTL has passed."""
    status = agent.store.runs()[run]
    assert status["state"] == "closed", status
    time.sleep(UP_TTL + 0.2)
    status = agent.store.runs()[run]
    assert status["state"] == "closed" and [r["state"] for r in status["ranks"]] == ["closed"], status
    series = rank_series(agent, run)
    assert series == {"up": 0.0, "state": 5.0}, series  # 5: closed


def test_final_push_after_the_agent_dropped_the_idle_kept_alive_connection_is_delivered(
        tmp_path: Path, logged: pytest.LogCaptureFixture) -> None:
    agent = make_agent()
    with agent_in_thread(agent.app, keep_alive=KEEP_ALIVE) as port:
        url = f"http://127.0.0.1:{port}"
        patrol = scripted_patrol(tmp_path, url, run="done", push_interval_seconds=0.1, pause_poll_seconds=0.02)
        stop = threading.Event()
        thread = train_in_thread(patrol, stop)
        pause_and_resume(patrol, url, "done")
        time.sleep(KEEP_ALIVE * 3)  # trains on; the agent closes the idle kept-alive connection
        stop.set()
        thread.join(10)
        patrol.close()
        assert patrol._publisher.dropped == 0
        assert_shown_closed(agent, "done")
    noisy = [r.getMessage() for r in logged.records if r.name.startswith("trainpatrol")
             and ("failed" in r.getMessage() or "Broken pipe" in r.getMessage())]
    assert noisy == []  # a normal close logs no failure


def test_final_push_to_a_restarted_agent_is_delivered(tmp_path: Path) -> None:
    port = free_port()
    first, second = make_agent(), make_agent()
    with agent_in_thread(first.app, port):
        patrol = scripted_patrol(tmp_path, f"http://127.0.0.1:{port}", run="done", push_interval_seconds=0.1)
        patrol.step(torch.tensor(1.0), batch_size=8)
        assert patrol._publisher.push_now()  # a state change's push: the kept-alive connection is open
    with agent_in_thread(second.app, port):
        patrol.step(torch.tensor(1.0), batch_size=8)
        patrol.close()
        assert_shown_closed(second, "done")
        assert second.store.runs()["done"]["ranks"][0]["step"] == 2

"""Finding 3 (DNS rebinding): every route checks the Host header against loopback names and the
configured addresses, so a web page that rebinds its own name to 127.0.0.1 reaches nothing."""

from __future__ import annotations

import asyncio
import json
import socket

import pytest
from _edge import AUTH, alert, make, payload, raw, snapshot
from fastapi.testclient import TestClient

from servers import agent_in_thread
from trainpatrol.agent.app import Agent
from trainpatrol.agent.config import AgentConfig

FOREIGN = "attacker.example"


def test_a_rebound_page_cannot_stop_a_run_or_read_a_no_token_loopback_agent() -> None:
    agent = Agent(AgentConfig(nvml=False).load())  # python train.py's embedded agent: loopback, no token
    with agent_in_thread(agent.app) as port:
        here = f"127.0.0.1:{port}"
        assert raw(port, "POST", "/v1/push", here, json.dumps(snapshot()).encode())[0] == 200
        stop = json.dumps({"action": "stop", "reason": "rebound"}).encode()
        assert raw(port, "POST", "/v1/runs/r1/actions", f"{FOREIGN}:{port}", stop) == (
            421, {"detail": f"Host {FOREIGN + ':' + str(port)!r} is not this agent's: DNS rebinding is refused. "
                            "Add the name to allowed_hosts (TRAINPATROL_ALLOWED_HOSTS) if it is one of ours."})
        routes = [("GET", "/v1/runs", None), ("GET", "/v1/runs/r1", None), ("GET", "/v1/alerts", None),
                  ("GET", "/metrics", None), ("GET", "/healthz", None),
                  ("POST", "/v1/push", json.dumps(snapshot(rank=1)).encode()),
                  ("POST", "/v1/alertmanager", json.dumps(payload(alert(action="stop"))).encode())]
        for method, path, body in routes:
            assert raw(port, method, path, FOREIGN, body)[0] == 421, path
        assert agent.store.pending("r1") == []
        assert [e.snapshot.rank for e in agent.store.entries()] == [0]
        assert agent.stats.refusals["host"] == 1 + len(routes)
        metrics = raw(port, "GET", "/metrics", here)
        assert metrics[0] == 200
        assert f'trainpatrol_refused_requests_total{{reason="host"}} {1 + len(routes)}' in metrics[1]["text"]


@pytest.mark.parametrize("host", ["localhost", "LOCALHOST:9400", "127.0.0.1", "127.0.0.1:1", "[::1]", "[::1]:9400",
                                  "agent.ns.svc", "agent.ns.svc:9400", "10.1.2.3:9400"])
def test_loopback_names_and_the_configured_addresses_are_served(host: str) -> None:
    agent, client = make(allowed_hosts=("agent.ns.svc", "10.1.2.3"))
    assert client.get("/healthz", headers={"host": host}).status_code == 200
    assert client.get("/v1/runs", headers={"host": host, **AUTH}).status_code == 200
    assert agent.stats.refusals["host"] == 0


@pytest.mark.parametrize("host", ["attacker.example", "localhost.attacker.example", "127.0.0.1.nip.io",
                                  "agent.ns.svc.attacker.example", "10.1.2.33", "", "localhost:x",
                                  "user@localhost"])
def test_any_other_host_is_421_on_hot_and_framework_routes(host: str) -> None:
    agent, client = make(allowed_hosts=("agent.ns.svc", "10.1.2.3"))
    for method, path in [("GET", "/healthz"), ("GET", "/metrics"), ("GET", "/v1/runs"), ("POST", "/v1/push")]:
        r = client.request(method, path, headers={"host": host, **AUTH}, json=snapshot())
        assert r.status_code == 421, (path, r.text)
        assert "DNS rebinding is refused" in r.json()["detail"]
    assert agent.stats.refusals["host"] == 4
    assert agent.store.entries() == ()


@pytest.mark.parametrize("bind,served,refused", [("10.9.8.7", "10.9.8.7:9400", "10.9.8.6:9400"),
                                                 ("fd00::5", "[fd00:0::5]:9400", "[fd00::6]:9400"),
                                                 ("0.0.0.0", "127.0.0.1:9400", "0.0.0.0:9400")])
def test_the_bind_address_is_an_allowed_host(bind: str, served: str, refused: str) -> None:
    agent = Agent(AgentConfig(host=bind, token="t", nvml=False).load())
    client = TestClient(agent.app)
    assert client.get("/healthz", headers={"host": served}).status_code == 200
    assert client.get("/healthz", headers={"host": refused}).status_code == 421


@pytest.mark.parametrize("hosts", [("attacker.example", "127.0.0.1"), ("127.0.0.1", "attacker.example"),
                                   ("127.0.0.1", "127.0.0.1")])
def test_a_request_with_two_host_headers_is_refused_whichever_comes_last(hosts: tuple[str, str]) -> None:
    """A proxy or a browser may read the first Host and the agent the last: two Host headers are refused
    outright (400), and the request reaches no route. uvicorn's h11 parser, which the agent runs,
    refuses them itself; the agent's own Host check refuses them behind any other server."""
    agent = Agent(AgentConfig(nvml=False).load())
    with agent_in_thread(agent.app) as port:
        stop = json.dumps({"action": "stop", "reason": "two hosts"}).encode()
        head = (f"POST /v1/runs/r1/actions HTTP/1.1\r\nHost: {hosts[0]}:{port}\r\nHost: {hosts[1]}:{port}\r\n"
                f"Content-Type: application/json\r\nContent-Length: {len(stop)}\r\n\r\n").encode()
        assert raw(port, "POST", "/v1/push", f"127.0.0.1:{port}", json.dumps(snapshot()).encode())[0] == 200
        with socket.create_connection(("127.0.0.1", port), timeout=5) as conn:
            conn.sendall(head + stop)
            answer = b""
            while chunk := conn.recv(65536):
                answer += chunk
        status = answer.split(b"\r\n", 1)[0]
        assert status == b"HTTP/1.1 400 Bad Request", answer
        assert agent.store.pending("r1") == []


def test_the_agents_own_host_check_refuses_two_host_headers() -> None:
    """Behind a server that passes both on (the ASGI scope holds every header), the Edge refuses them."""
    agent = Agent(AgentConfig(nvml=False).load())
    sent: list[dict[str, object]] = []
    scope = {"type": "http", "method": "POST", "path": "/v1/runs/r1/actions", "raw_path": b"/v1/runs/r1/actions",
             "query_string": b"", "headers": [(b"host", b"127.0.0.1"), (b"host", b"evil.example")],
             "client": ("127.0.0.1", 5000), "server": ("127.0.0.1", 9402), "scheme": "http",
             "http_version": "1.1", "root_path": "", "asgi": {"version": "3.0"}}

    async def receive() -> dict[str, object]:
        return {"type": "http.request", "body": b"{}", "more_body": False}

    async def send(message: dict[str, object]) -> None:
        sent.append(message)

    asyncio.run(agent.app(scope, receive, send))
    assert sent[0]["status"] == 400 and b"more than one Host header" in sent[1]["body"]  # type: ignore[operator]
    assert agent.stats.refusals["host"] == 1

"""Issue 22 finding 8: with the peer down, the router answered 202 and marked the alert seen, so
Alertmanager's re-send once the peer was back was a "duplicate", never delivered.

An alert is marked seen only once delivered to the peer that hosts the run; a failed forward is a 503,
which Alertmanager re-sends. In-process agents served by uvicorn on 127.0.0.1."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from typing import Any

from rank_client import AUTH, TOKEN, alert, counter, payload
from servers import agent_in_thread, free_port
from trainpatrol.agent.app import Agent
from trainpatrol.agent.config import AgentConfig


def _post(port: int, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/alertmanager", data=json.dumps(body).encode(),
                                 method="POST", headers={"Content-Type": "application/json", **AUTH})
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def _push(port: int, run: str) -> None:
    body = json.dumps({"run": run, "rank": 0, "world_size": 1, "step": 1}).encode()
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/push", data=body, method="POST",
                                 headers={"Content-Type": "application/json", "X-Trainpatrol-Run-Key": "k"})
    with urllib.request.urlopen(req, timeout=5) as r:
        assert r.status == 200


def _agents(peer_port: int) -> tuple[Agent, Agent]:
    router = Agent(AgentConfig(token=TOKEN, nvml=False, mode="router", peers=(f"127.0.0.1:{peer_port}",),
                               port=free_port()).load())
    peer = Agent(AgentConfig(token=TOKEN, nvml=False, port=peer_port).load())
    return router, peer


def test_an_alert_forwarded_while_the_peer_is_down_is_delivered_on_the_resend() -> None:
    peer_port = free_port()
    router, peer = _agents(peer_port)
    for labels in ({"instance": f"127.0.0.1:{peer_port}"}, {}):  # named by instance, or found by run lookup
        fp, run = f"fp-{len(labels)}", f"B{len(labels)}"
        with agent_in_thread(peer.app, port=peer_port):
            _push(peer_port, run)  # the run lives on the peer, which then goes down a while
        body = payload(alert(fp, run=run, **labels))
        with agent_in_thread(router.app) as router_port:
            status, answer = _post(router_port, body)
            assert status == 503, answer
            assert [r["outcome"] for r in answer["results"]] == ["forward_failed"]
            with agent_in_thread(peer.app, port=peer_port):
                _push(peer_port, run)
                status, answer = _post(router_port, body)  # Alertmanager's re-send
                assert status == 202, answer
                assert [r["outcome"] for r in answer["results"]] == ["forwarded"]
                assert fp in [c.alert["fingerprint"] for c in peer.store.pending(run) if c.alert]
                status, answer = _post(router_port, body)  # delivered: a later re-send is a duplicate
                assert (status, [r["outcome"] for r in answer["results"]]) == (202, ["duplicate"])
    assert counter(router, "trainpatrol_forwarded_alerts_total", outcome="failed") == 2.0
    assert counter(router, "trainpatrol_forwarded_alerts_total", outcome="ok") == 2.0


def test_the_router_forwards_by_namespace_and_run() -> None:
    """The peer hosts run B of namespace team-a: an alert for B of team-b is hosted nowhere."""
    peer_port = free_port()
    router, peer = _agents(peer_port)
    body = json.dumps({"run": "B", "namespace": "team-a", "rank": 0, "world_size": 1, "step": 1}).encode()
    with agent_in_thread(peer.app, port=peer_port), agent_in_thread(router.app) as router_port:
        req = urllib.request.Request(f"http://127.0.0.1:{peer_port}/v1/push", data=body, method="POST",
                                     headers={"Content-Type": "application/json", "X-Trainpatrol-Run-Key": "k"})
        urllib.request.urlopen(req, timeout=5).close()
        status, answer = _post(router_port, payload(alert("ns-b", run="B", namespace="team-b"),
                                                    alert("ns-a", run="B", namespace="team-a")))
    assert status == 202, answer
    assert [r["outcome"] for r in answer["results"]] == ["no_peer", "forwarded"]
    assert [c.alert["fingerprint"] for c in peer.store.pending("B", namespace="team-a") if c.alert] == ["ns-a"]
    assert peer.store.pending("B", namespace="team-b") == []

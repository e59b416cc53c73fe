"""The control API and the Alertmanager webhook refuse bad input and act exactly once."""

from __future__ import annotations

from typing import Any

import pytest
from fastapi.testclient import TestClient

from fake_clock import T0, Clock
from trainpatrol.agent.app import Agent
from trainpatrol.agent.config import AgentConfig, ConfigError

TOKEN = "s3cret-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}


def make_agent(**overrides: Any) -> tuple[Agent, TestClient]:
    agent = Agent(AgentConfig(token=TOKEN, nvml=False, **overrides).load())
    return agent, TestClient(agent.app, base_url="http://localhost")


def push(client: TestClient, run: str = "r1", rank: int = 0, **extra: Any) -> Any:
    body = {"run": run, "rank": rank, "world_size": 2, "step": extra.pop("step", 5), **extra}
    return client.post("/v1/push", json=body, headers=AUTH)


def alert(status: str = "firing", action: str = "pause", run: str = "r1", fp: str = "abc123",
          starts: str = "2026-11-30T00:00:00Z") -> dict[str, Any]:
    return {"status": status, "labels": {"alertname": "TrainPatrolNonFiniteLoss", "run": run, "action": action,
                                         "severity": "critical"},
            "annotations": {"summary": "Loss is NaN or Inf."}, "startsAt": starts,
            "endsAt": "0001-01-01T00:00:00Z", "generatorURL": "http://prom/graph", "fingerprint": fp}


def payload(*alerts: dict[str, Any]) -> dict[str, Any]:
    return {"version": "4", "groupKey": "{}:{alertname=\"X\"}", "truncatedAlerts": 0,
            "status": alerts[0]["status"], "receiver": "trainpatrol", "groupLabels": {}, "commonLabels": {},
            "commonAnnotations": {}, "externalURL": "http://am", "alerts": list(alerts)}


def test_non_loopback_without_token_refuses_to_start() -> None:
    with pytest.raises(ConfigError, match="not loopback, and no token"):
        AgentConfig(host="0.0.0.0", nvml=False).load()
    AgentConfig(host="0.0.0.0", token="x", nvml=False).load()


@pytest.mark.parametrize("headers", [{}, {"Authorization": "Bearer wrong"}, {"Authorization": TOKEN}])
def test_wrong_or_missing_token_is_401_and_nothing_queued(headers: dict[str, str]) -> None:
    agent, client = make_agent()
    push(client)
    r = client.post("/v1/runs/r1/actions", json={"action": "pause"}, headers=headers)
    assert r.status_code == 401
    r = client.post("/v1/alertmanager", json=payload(alert()), headers=headers)
    assert r.status_code == 401
    assert agent.store.pending("r1") == []


def test_push_from_other_host_needs_token() -> None:
    _, client = make_agent()
    r = client.post("/v1/push", json={"run": "r1", "rank": 0})  # TestClient is not loopback
    assert r.status_code == 401
    assert push(client).status_code == 200


@pytest.mark.parametrize("body, fragment", [
    ({"version": "4"}, "status"),
    ({**payload(alert()), "version": "3"}, "version"),
    ({**payload(alert()), "alerts": [{"labels": {}}]}, "alerts"),
    ("not json at all", "Invalid request"),
])
def test_malformed_webhook_is_422_with_message(body: Any, fragment: str) -> None:
    agent, client = make_agent()
    kwargs = {"content": body} if isinstance(body, str) else {"json": body}
    r = client.post("/v1/alertmanager", headers={**AUTH, "Content-Type": "application/json"}, **kwargs)
    assert r.status_code == 422
    assert fragment in r.json()["detail"]
    assert agent.store.pending("r1") == []


def test_garbage_push_is_422_and_counted() -> None:
    agent, client = make_agent()
    r = client.post("/v1/push", json={"run": "r1", "rank": 0, "samples": [
        {"name": "trainpatrol_bogus", "labels": {}, "value": 1}]}, headers=AUTH)
    assert r.status_code == 422
    assert "Unknown rank metric 'trainpatrol_bogus'" in r.json()["detail"]
    r = client.post("/v1/push", json={"run": "r1", "rank": 3, "world_size": 2}, headers=AUTH)
    assert r.status_code == 422 and "outside world_size" in r.json()["detail"]
    r = client.post("/v1/push", json={"run": "bad run/../x", "rank": 0}, headers=AUTH)
    assert r.status_code == 422
    assert agent.stats.pushes["invalid"] == 3
    assert agent.store.entries() == ()


def test_oversized_push_is_413() -> None:
    agent, client = make_agent(max_push_bytes=1000)
    r = client.post("/v1/push", content=b"{" + b" " * 2000 + b"}", headers={**AUTH, "Content-Type": "application/json"})
    assert r.status_code == 413 and "over the limit" in r.json()["detail"]

    def chunks() -> Any:  # no Content-Length: the limit holds as the body streams in
        yield b"{" + b" " * 600
        yield b" " * 600 + b"}"

    r = client.post("/v1/push", content=chunks(), headers={**AUTH, "Content-Type": "application/json"})
    assert r.status_code == 413 and r.json()["detail"] == \
        "Request body of more than 1000 bytes is over the limit of 1000 bytes."
    assert agent.stats.pushes["too_large"] == 2 and agent.store.entries() == ()


def test_push_token_is_checked_before_the_body_is_read() -> None:
    """A stranger learns nothing from validation messages: 401 whatever the body."""
    agent, client = make_agent()
    r = client.post("/v1/push", content=b"\xff garbage", headers={"Content-Type": "application/json"})
    assert r.status_code == 401 and r.headers["www-authenticate"] == "Bearer"
    r = client.post("/v1/push", json={"run": "r1", "rank": 0}, headers={"Authorization": "Bearer wrong"})
    assert r.status_code == 401
    assert agent.stats.pushes["unauthorized"] == 2 and agent.stats.pushes["invalid"] == 0


@pytest.mark.parametrize("content, content_type, fragment", [
    (b"\xff\xfe not UTF-8", "application/json", "body: Invalid JSON"),
    (b'{"run": "r1", "rank": 0', "application/json", "body: Invalid JSON: EOF"),
    (b'{"run": "r1", "rank": 0}', "text/plain", "Content-Type must be application/json, not 'text/plain'"),
    (b"[]", "application/json", "body: Input should be an object"),
])
def test_unreadable_push_is_422_with_message(content: bytes, content_type: str, fragment: str) -> None:
    agent, client = make_agent()
    r = client.post("/v1/push", content=content, headers={**AUTH, "Content-Type": content_type})
    assert r.status_code == 422 and fragment in r.json()["detail"], r.json()
    assert agent.stats.pushes["invalid"] == 1 and agent.store.entries() == ()


def test_duplicate_alert_makes_one_command() -> None:
    agent, client = make_agent()
    push(client)
    for _ in range(3):
        r = client.post("/v1/alertmanager", json=payload(alert()), headers=AUTH)
        assert r.status_code == 202
    assert [c.action for c in agent.store.pending("r1")] == ["pause"]
    outcomes = [a["outcome"] for a in agent.alert_log]
    assert outcomes == ["act", "duplicate", "duplicate"]
    # the rank receives it in its push reply, once per id
    reply = push(client).json()
    assert [c["action"] for c in reply["commands"]] == ["pause"]
    done = push(client, done_commands=[reply["commands"][0]["id"]]).json()
    assert done["commands"] == []


def test_an_alert_that_resolves_and_fires_again_acts_again() -> None:
    agent, client = make_agent()
    push(client)
    first = client.post("/v1/alertmanager", json=payload(alert()), headers=AUTH)
    assert first.status_code == 202 and first.json()["results"][0]["outcome"] == "act"
    [pause] = agent.store.pending("r1")
    push(client, done_commands=[pause.id])  # the rank paused
    resolved = client.post("/v1/alertmanager", json=payload(alert(status="resolved")), headers=AUTH)
    assert resolved.json()["results"][0]["outcome"] == "resolved"
    # the same alert (same fingerprint) fires again after a resume: Alertmanager gives it a new startsAt
    again = client.post("/v1/alertmanager", json=payload(alert(starts="2026-11-30T00:05:00Z")), headers=AUTH)
    assert again.status_code == 202 and again.json()["results"][0]["outcome"] == "act"
    [second] = agent.store.pending("r1")
    assert second.action == "pause" and second.id != pause.id


def test_resolved_alert_resumes_nothing() -> None:
    agent, client = make_agent()
    push(client)
    r = client.post("/v1/alertmanager", json=payload(alert(status="resolved", action="pause")), headers=AUTH)
    assert r.status_code == 202
    assert r.json()["results"][0]["outcome"] == "resolved"
    assert agent.store.pending("r1") == []


def test_action_outside_allow_list_is_403() -> None:
    agent, client = make_agent(allowed_actions=("pause", "checkpoint"))
    push(client)
    r = client.post("/v1/runs/r1/actions", json={"action": "stop"}, headers=AUTH)
    assert r.status_code == 403 and "not in the allow-list" in r.json()["detail"]
    r = client.post("/v1/alertmanager", json=payload(alert(action="stop")), headers=AUTH)
    assert r.status_code == 403 and "'stop'" in r.json()["detail"]
    r = client.post("/v1/alertmanager", json=payload(alert(action="resume", fp="r")), headers=AUTH)
    assert r.status_code == 403  # a webhook never resumes
    assert agent.store.pending("r1") == []


def test_unknown_action_in_api_is_422() -> None:
    _, client = make_agent()
    r = client.post("/v1/runs/r1/actions", json={"action": "reboot"}, headers=AUTH)
    assert r.status_code == 422 and "action" in r.json()["detail"]


def test_run_status_shows_ranks_and_last_action() -> None:
    _agent, client = make_agent()
    push(client, rank=0, state="paused", step=12, last_checkpoint="/ck/step-00000012",
         actions=[{"id": 7, "action": "pause", "outcome": "ok", "step": 12, "time": 1.0}])
    push(client, rank=1, state="paused", step=12,
         actions=[{"id": 7, "action": "pause", "outcome": "ok", "step": 12, "time": 1.0}])
    status = client.get("/v1/runs/r1", headers=AUTH).json()
    assert status["state"] == "paused"
    assert [(r["rank"], r["step"], r["state"]) for r in status["ranks"]] == [(0, 12, "paused"), (1, 12, "paused")]
    assert status["last_action"]["action"] == "pause" and status["last_action"]["outcome"] == "ok"
    assert status["last_checkpoint"] == "/ck/step-00000012"
    assert client.get("/v1/runs/nope", headers=AUTH).status_code == 404


def test_openapi_documents_the_control_surface() -> None:
    _, client = make_agent(api_docs=True)
    paths = client.get("/openapi.json", headers=AUTH).json()["paths"]
    for path in ("/v1/push", "/v1/runs", "/v1/runs/{run}", "/v1/runs/{run}/actions", "/v1/alertmanager",
                 "/metrics", "/healthz"):
        assert path in paths


def test_an_action_for_a_run_with_a_live_rank_is_accepted_and_says_how_many_are_live() -> None:
    agent, client = make_agent()
    push(client, rank=0)
    push(client, rank=1, state="paused")  # paused ranks push on, and hear their commands: live
    push(client, rank=2, world_size=3, state="closed")
    r = client.post("/v1/runs/r1/actions", json={"action": "checkpoint", "reason": "test"}, headers=AUTH)
    assert r.status_code == 202
    body = r.json()
    assert body["accepted"] is True and body["live"] is True and body["live_ranks"] == 2, body
    assert [c.id for c in agent.store.pending("r1")] == [body["id"]]


@pytest.mark.parametrize("ranks, status", [
    ((), 404),  # no rank of the run ever pushed here
    (("closed", "closed"), 409),
    (("stopped", "closed"), 409),
    (("running", "running"), 409),  # both pushed last longer ago than the liveness TTL: down
    (("closed", "running"), 409),
], ids=["unknown", "closed", "stopped", "down", "closed-and-down"])
@pytest.mark.parametrize("action", ["pause", "resume", "checkpoint", "stop"])
def test_an_action_for_a_run_no_live_rank_serves_is_refused_and_nothing_queued(
        ranks: tuple[str, ...], status: int, action: str) -> None:
    clock = Clock(T0)
    agent = Agent(AgentConfig(token=TOKEN, nvml=False, rank_up_ttl_seconds=15.0, api_docs=True).load(), clock=clock)
    client = TestClient(agent.app, base_url="http://localhost")
    for rank, state in enumerate(ranks):
        assert push(client, "ended", rank, state=state).status_code == 200
    clock.now = T0 + 16  # past the liveness TTL: a rank still "running" by its last push is down
    r = client.post("/v1/runs/ended/actions", json={"action": action}, headers=AUTH)
    assert r.status_code == status, r.text
    assert r.json()["detail"] == "no live rank of run ended on this agent"
    assert r.json()["live"] is False and r.json()["live_ranks"] == 0
    assert agent.store.pending("ended") == [] and agent.stats.commands == {}
    # the refusals are documented
    responses = client.get("/openapi.json", headers=AUTH).json()["paths"]["/v1/runs/{run}/actions"]["post"]["responses"]
    assert {"202", "404", "409"} <= set(responses)


@pytest.mark.parametrize("ranks", [
    (),  # no rank of the run ever pushed here (and no peer to forward to)
    ("closed", "closed"),
    ("stopped", "closed"),
    ("running", "running"),  # both pushed last longer ago than the liveness TTL: down (a SIGKILL)
], ids=["unknown", "closed", "stopped", "down"])
def test_a_webhook_alert_for_a_run_without_a_live_rank_queues_nothing_and_answers_2xx(
        ranks: tuple[str, ...]) -> None:
    """Alertmanager must not retry (2xx), the command must not wait for a rank that never comes, and
    the outcome is counted in trainpatrol_webhook_alerts_total{outcome="no_live_rank"}."""
    clock = Clock(T0)
    agent = Agent(AgentConfig(token=TOKEN, nvml=False, rank_up_ttl_seconds=15.0, api_docs=True).load(), clock=clock)
    client = TestClient(agent.app, base_url="http://localhost")
    for rank, state in enumerate(ranks):
        assert push(client, "ended", rank, state=state).status_code == 200
    clock.now = T0 + 16
    r = client.post("/v1/alertmanager", json=payload(alert(run="ended", action="capture")), headers=AUTH)
    assert r.status_code == 202, r.text
    [result] = r.json()["results"]
    assert result["outcome"] == "no_live_rank"
    assert result["detail"] == "no live rank of run ended on this agent"
    assert agent.store.pending("ended") == [] and agent.stats.commands == {}
    assert agent.stats.alerts["no_live_rank"] == 1 and agent.stats.alerts["act"] == 0
    metrics = client.get("/metrics", headers=AUTH).text
    assert 'trainpatrol_webhook_alerts_total{outcome="no_live_rank"} 1.0' in metrics.splitlines()
    # not marked seen: the same alert, sent again once a rank of the run is live, acts
    assert push(client, "ended", 0, state="running").status_code == 200
    again = client.post("/v1/alertmanager", json=payload(alert(run="ended", action="capture")), headers=AUTH)
    assert again.status_code == 202 and again.json()["results"][0]["outcome"] == "act"
    assert [c.action for c in agent.store.pending("ended")] == ["capture"]


def test_a_webhook_alert_acts_for_a_paused_run_and_skips_only_the_alerts_without_a_live_rank() -> None:
    agent, client = make_agent()
    push(client, "live", 0, state="paused")  # a paused rank pushes on and hears commands: live
    push(client, "gone", 0, state="closed")
    r = client.post("/v1/alertmanager", headers=AUTH, json=payload(
        alert(run="live", action="checkpoint", fp="a1"), alert(run="gone", action="checkpoint", fp="a2")))
    assert r.status_code == 202
    assert [x["outcome"] for x in r.json()["results"]] == ["act", "no_live_rank"]
    assert [c.action for c in agent.store.pending("live")] == ["checkpoint"] and agent.store.pending("gone") == []
    # the per-alert outcomes are kept for GET /v1/alerts as well
    assert [a["outcome"] for a in client.get("/v1/alerts", headers=AUTH).json()["alerts"]] == ["act", "no_live_rank"]

"""One router: FastAPI serves every route its OpenAPI schema documents, the pushes included, and both
push routes refuse a wrong token with the same answer before reading the body."""

from __future__ import annotations

import json
import socket
from typing import Any

from fastapi.testclient import TestClient

from servers import agent_in_thread, raw_answer
from trainpatrol.agent.app import Agent
from trainpatrol.agent.config import AgentConfig

TOKEN = "routes-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
PUSH_REFUSED = {"detail": "Pushes from other hosts must carry the bearer token; a token that is sent must be right."}


def documented_agent() -> tuple[Agent, TestClient, dict[str, Any]]:
    agent = Agent(AgentConfig(token=TOKEN, nvml=False, api_docs=True).load())
    client = TestClient(agent.app, base_url="http://localhost")
    return agent, client, client.get("/openapi.json", headers=AUTH).json()


def test_the_schema_documents_the_push_and_scrape_routes_with_their_content_types_and_error_codes() -> None:
    _, _, schema = documented_agent()
    paths = schema["paths"]

    def summary(path: str, method: str) -> tuple[list[str], list[str]]:
        op = paths[path][method]
        return sorted(op.get("requestBody", {}).get("content", {})), sorted(op["responses"])

    assert "/v1/push/stream" not in paths
    assert summary("/v1/push", "post") == (["application/json"],
                                           ["200", "400", "401", "403", "413", "421", "422", "429"])
    assert summary("/metrics", "get") == ([], ["200", "421"])
    assert summary("/healthz", "get") == ([], ["200", "421"])
    body = paths["/v1/push"]["post"]["requestBody"]["content"]["application/json"]["schema"]
    assert body["required"] == ["run", "rank"] and body["additionalProperties"] is False


def test_every_route_in_the_schema_is_served() -> None:
    agent, client, schema = documented_agent()
    for namespace in ("", "ns"):  # a hosted run in each, so a run's routes find it
        assert client.post("/v1/push", json={"run": "r1", "rank": 0, "namespace": namespace},
                           headers=AUTH).status_code == 200
    served: dict[str, int] = {}
    for path, operations in schema["paths"].items():
        url = path.replace("{run}", "r1").replace("{namespace}", "ns")
        for method, op in operations.items():
            content = next(iter(op.get("requestBody", {}).get("content", {})), None)
            extra: dict[str, Any] = {} if content is None else {
                "content": b"{}\n", "headers": {**AUTH, "Content-Type": content}}
            served[f"{method.upper()} {path}"] = client.request(method, url, **{"headers": AUTH, **extra}).status_code
    assert len(served) == 12 and all(status not in (404, 405) for status in served.values()), served
    assert served["GET /metrics"] == 200
    assert served["POST /v1/push"] == 422 and agent.stats.pushes["invalid"] == 1.0


def test_a_wrong_token_gets_a_401_on_a_push() -> None:
    agent, client, _ = documented_agent()
    answer = client.post("/v1/push", json={"run": "r1", "rank": 0}, headers={"Authorization": "Bearer nope"})
    assert (answer.status_code, answer.json(), answer.headers["www-authenticate"]) == (401, PUSH_REFUSED, "Bearer")
    assert agent.stats.pushes["unauthorized"] == 1.0 and agent.store.entries() == ()


def test_a_wrong_token_is_answered_before_the_body_is_sent() -> None:
    agent = Agent(AgentConfig(token=TOKEN, nvml=False).load())
    with agent_in_thread(agent.app) as port, socket.create_connection(("127.0.0.1", port), timeout=5.0) as s:
        s.sendall(b"POST /v1/push HTTP/1.1\r\nHost: localhost\r\nAuthorization: Bearer nope\r\n"
                  b"Content-Type: application/json\r\nContent-Length: 200000\r\n\r\n")
        head, body = raw_answer(s)
        assert head.startswith(b"HTTP/1.1 401 "), head
        assert json.loads(body) == PUSH_REFUSED


def test_a_422_names_the_first_error_lists_all_under_body_and_shortens_what_it_echoes() -> None:
    """A push and a control route word a validation error alike."""
    _, client, _ = documented_agent()
    long_host = "h" * 300
    push = {"run": "r1", "rank": 0, "host": long_host}
    answer = client.post("/v1/push", json=push, headers=AUTH).json()
    shortened = "h" * 256 + "... (300 characters)"
    assert answer["detail"] == "Invalid request: body.host: String should have at most 253 characters"
    assert [(e["loc"], e["input"]) for e in answer["errors"]] == [(["body", "host"], shortened)]
    action = client.post("/v1/runs/r1/actions", json={"action": "pause", "reason": "r" * 2000, "extra": 1},
                         headers=AUTH).json()
    assert [e["loc"] for e in action["errors"]] == [["body", "reason"], ["body", "extra"]]
    assert action["detail"].startswith("Invalid request: body.reason: ")
    assert action["errors"][0]["input"] == "r" * 256 + "... (2000 characters)"

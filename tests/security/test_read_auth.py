"""Finding 4: read routes need the token whenever one is configured; the API docs are served only
when asked for; a request without the token is refused before its body is read or validated."""

from __future__ import annotations

import pytest
from _edge import AUTH, TOKEN, alert, make, payload, snapshot

READS = ["/v1/runs", "/v1/runs/r1", "/v1/alerts", "/v1/nvml"]


@pytest.mark.parametrize("headers", [{}, {"Authorization": "Bearer wrong"}, {"Authorization": TOKEN}],
                         ids=["none", "wrong", "no-scheme"])
def test_read_routes_need_the_token(headers: dict[str, str]) -> None:
    agent, client = make()
    pushed = client.post("/v1/push", json=snapshot(host="node-7", last_checkpoint="/ckpt/a"), headers=AUTH)
    assert pushed.status_code == 200
    client.post("/v1/alertmanager", json=payload(alert()), headers=AUTH)
    for path in READS:
        r = client.get(path, headers=headers)
        assert (r.status_code, r.json()) == (401, {"detail": "Missing or wrong bearer token."}), path
        assert r.headers["www-authenticate"] == "Bearer"
        assert "node-7" not in r.text
        assert client.get(path, headers=AUTH).status_code == 200, path
    assert agent.stats.refusals["unauthorized"] == len(READS)


def test_metrics_and_healthz_stay_open_unless_a_scrape_token_is_set() -> None:
    _, client = make()
    assert client.get("/metrics").status_code == 200
    assert client.get("/healthz").status_code == 200
    agent, client = make(metrics_token="scrape-token")
    assert client.get("/metrics").status_code == 401
    assert client.get("/metrics", headers=AUTH).status_code == 401  # the control token is not the scrape token
    assert client.get("/metrics", headers={"Authorization": "Bearer scrape-token"}).status_code == 200
    assert client.get("/healthz").status_code == 200
    assert agent.stats.refusals["unauthorized"] == 2


def test_api_docs_are_off_unless_asked_for_and_then_need_the_token() -> None:
    _, client = make()
    for path in ("/openapi.json", "/docs", "/redoc"):
        assert client.get(path, headers=AUTH).status_code == 404, path
    _, client = make(api_docs=True)
    for path in ("/openapi.json", "/docs"):
        assert client.get(path).status_code == 401, path
        assert client.get(path, headers=AUTH).status_code == 200, path


@pytest.mark.parametrize("path", ["/v1/alertmanager", "/v1/runs/r1/actions", "/v1/push"])
def test_a_request_without_the_token_is_401_before_its_body_is_validated(path: str) -> None:
    _agent, client = make()
    r = client.post(path, content=b'{"not": "valid', headers={"Content-Type": "application/json"})
    assert r.status_code == 401, r.text
    r = client.post(path, json={"action": 7}, headers={"Authorization": "Bearer wrong"})
    assert r.status_code == 401, r.text

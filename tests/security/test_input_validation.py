"""Finding 9: names and labels that are not printable UTF-8 are refused with 422 at the edge and
break no state; tokens compare as UTF-8; the CLI prints no control characters it was sent."""

from __future__ import annotations

import json
from typing import Any

import pytest
from _edge import AUTH, alert, make, payload, snapshot

from trainpatrol import cli
from trainpatrol.catalogue import STEP_DURATION_BUCKETS

SURROGATE = '{"version": "4", "status": "firing", "alerts": [{"status": "firing", "labels": {"alertname": "X", ' \
            '"run": "r1", "action": "pause", "evil": "\\ud800"}, "startsAt": "2026-12-01T00:00:00Z", ' \
            '"fingerprint": "fp1"}]}'


def reads_still_answer(client: Any) -> None:
    for path in ("/v1/runs", "/v1/runs/r1", "/v1/alerts"):
        assert client.get(path, headers=AUTH).status_code == 200, path
    assert client.post("/v1/push", json=snapshot(), headers=AUTH).json() == {"accepted": True, "commands": []}


def test_a_lone_surrogate_in_an_alert_label_is_422_and_queues_nothing() -> None:
    agent, client = make()
    client.post("/v1/push", json=snapshot(), headers=AUTH)
    r = client.post("/v1/alertmanager", content=SURROGATE.encode(),
                    headers={**AUTH, "Content-Type": "application/json"})
    assert r.status_code == 422 and "printable UTF-8" in r.json()["detail"], r.text
    assert agent.store.pending("r1") == []
    reads_still_answer(client)


@pytest.mark.parametrize("field,value", [("run", "abc\n"), ("run", "abc\x1b[31m"), ("alertname", "A\rB"),
                                         ("severity", "\u202ecritical")])
def test_a_control_character_in_an_alert_label_is_422_and_a_fixed_retry_acts(field: str, value: str) -> None:
    _agent, client = make()
    client.post("/v1/push", json=snapshot(), headers=AUTH)
    r = client.post("/v1/alertmanager", json=payload(alert(**{field: value})), headers=AUTH)
    assert r.status_code == 422, r.text
    reads_still_answer(client)
    r = client.post("/v1/alertmanager", json=payload(alert()), headers=AUTH)
    assert r.status_code == 202 and r.json()["results"][0]["outcome"] == "act"


def test_nan_truncated_alerts_is_422_and_the_alert_is_not_marked_seen() -> None:
    _agent, client = make()
    client.post("/v1/push", json=snapshot(), headers=AUTH)
    body = json.dumps(payload(alert())).replace('"version"', '"truncatedAlerts": NaN, "version"')
    r = client.post("/v1/alertmanager", content=body.encode(), headers={**AUTH, "Content-Type": "application/json"})
    assert r.status_code == 422, r.text
    r = client.post("/v1/alertmanager", json=payload(alert()), headers=AUTH)
    assert r.json()["results"][0]["outcome"] == "act"


def test_a_run_name_ending_in_a_newline_is_422_on_the_actions_route() -> None:
    _, client = make()
    client.post("/v1/push", json=snapshot(), headers=AUTH)
    r = client.post("/v1/runs/r1%0A/actions", json={"action": "pause"}, headers=AUTH)
    assert r.status_code == 422 and "is not valid" in r.json()["detail"]
    assert client.get("/v1/runs/r1%0A", headers=AUTH).status_code == 422


@pytest.mark.parametrize("field", ["host", "last_checkpoint", "evidence_dir", "instance", "gpu_uuid"])
def test_a_push_with_control_characters_in_a_name_is_422(field: str) -> None:
    agent, client = make()
    r = client.post("/v1/push", json=snapshot(**{field: "/ckpt/\x1b[2J\x1b[31mpwned"}), headers=AUTH)
    assert r.status_code == 422 and "printable UTF-8" in r.json()["detail"], r.text
    r = client.post("/v1/push", json=snapshot(**{field: "a\u2028b"}), headers=AUTH)
    assert r.status_code == 422 and "printable UTF-8" in r.json()["detail"], r.text
    assert agent.store.entries() == ()


def test_a_label_value_with_a_control_character_is_422() -> None:
    _, client = make()
    sample = {"name": "trainpatrol_loss", "labels": {}, "value": 1.0}
    info = {"name": "trainpatrol_rank_info", "value": 1.0, "labels": {
        "local_rank": "0", "world_size": "2", "host": "h\x00", "gpu_uuid": "G", "device": "cuda:0",
        "torch_version": "2", "cuda_version": "12", "trainpatrol_version": "0", "launcher": "", "launcher_job": ""}}
    r = client.post("/v1/push", json=snapshot(samples=[sample, info]), headers=AUTH)
    assert r.status_code == 422 and "printable UTF-8" in r.json()["detail"], r.text


def test_a_utf8_token_matches() -> None:
    token = "tökén-✓"
    _agent, client = make(token=token)
    client.post("/v1/push", json=snapshot(), headers={"Authorization": f"Bearer {token}".encode()})
    r = client.post("/v1/runs/r1/actions", json={"action": "pause"},
                    headers={"Authorization": f"Bearer {token}".encode(), "Content-Type": "application/json"})
    assert r.status_code == 202, r.text
    r = client.get("/v1/runs", headers={"Authorization": f"Bearer {token}".encode()})
    assert r.status_code == 200
    assert client.get("/v1/runs", headers={"Authorization": "Bearer tökén-x".encode()}).status_code == 401


def test_the_status_table_prints_no_control_characters() -> None:
    runs = [{"run": "r1\x1b]0;x\x07", "state": "running", "last_checkpoint": "/ckpt/\x1b[2J\x1b[31mpwned\r\n",
             "last_action": {"action": "pause", "outcome": "ok\x1b[0m", "step": 3},
             "ranks": [{"rank": 0, "state": "running", "step": 5, "host": "node\x1b[1A\u202e7"}]}]
    text = "\n".join(cli._status_rows(runs))
    assert not any((ord(c) < 32 and c != "\n") or 0x7f <= ord(c) < 0xa0 or c == "\u202e" for c in text), repr(text)
    assert "/ckpt/[2J[31mpwned" in text and len(text.splitlines()) == 3


def test_an_error_detail_from_the_agent_is_printed_without_control_characters() -> None:
    assert cli._detail(json.dumps({"detail": "no run \x1b[31mevil\x1b[0m"})) == "no run [31mevil[0m"


@pytest.mark.parametrize("where,bad", [("counts", "NaN"), ("counts", "Infinity"), ("sum", "NaN"),
                                       ("sum", "Infinity")])
def test_a_histogram_with_a_non_finite_count_or_sum_is_422_and_exports_nothing(where: str, bad: str) -> None:
    _agent, client = make()
    counts = [float(i) for i in range(len(STEP_DURATION_BUCKETS) + 1)]
    histogram = {"counts": counts, "sum": 1.5}
    body = json.dumps(snapshot(histogram=histogram))
    if where == "counts":  # a NaN in the middle keeps the rest cumulative: the comparisons pass NaN
        body = body.replace('"counts": [0.0, 1.0, 2.0', f'"counts": [0.0, {bad}, 2.0')
    else:
        body = body.replace('"sum": 1.5', f'"sum": {bad}')
    assert bad in body
    r = client.post("/v1/push", content=body.encode(), headers={**AUTH, "Content-Type": "application/json"})
    assert r.status_code == 422, r.text
    assert "finite" in r.text
    metrics = client.get("/metrics").text
    assert "NaN" not in metrics and "trainpatrol_step_duration_seconds_count{" not in metrics
    # A finite histogram is accepted as before.
    r = client.post("/v1/push", json=snapshot(histogram=histogram), headers=AUTH)
    assert r.status_code == 200, r.text
    assert 'trainpatrol_step_duration_seconds_count{' in client.get("/metrics").text

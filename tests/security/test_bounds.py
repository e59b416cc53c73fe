"""Finding 5: runs, ranks, series, samples, label lengths, queued commands and the alert log are
bounded; each refusal is answered 413/422/429 with the limit's name and counted."""

from __future__ import annotations

import json
from typing import Any

from _edge import AUTH, alert, make, payload, snapshot

LOSS = "trainpatrol_loss"


def loss(value: float = 1.0) -> dict[str, Any]:
    return {"name": LOSS, "labels": {}, "value": value}


def info(**labels: str) -> dict[str, Any]:
    base = {"local_rank": "0", "world_size": "2", "host": "h", "gpu_uuid": "GPU-1", "device": "cuda:0",
            "torch_version": "2.5", "cuda_version": "12.4", "trainpatrol_version": "0", "launcher": "",
            "launcher_job": ""}
    return {"name": "trainpatrol_rank_info", "labels": {**base, **labels}, "value": 1.0}


def test_a_new_run_over_max_runs_is_429_and_counted_and_known_runs_go_on() -> None:
    agent, client = make(max_runs=2)
    for run in ("a", "b"):
        assert client.post("/v1/push", json=snapshot(run), headers=AUTH).status_code == 200
    r = client.post("/v1/push", json=snapshot("c"), headers=AUTH)
    assert (r.status_code, r.json()) == (429, {"detail": "Run 'c' refused: this agent already hosts 2 runs, the "
                                                         "limit (max_runs, TRAINPATROL_MAX_RUNS)."})
    assert client.post("/v1/push", json=snapshot("a", rank=1), headers=AUTH).status_code == 200
    assert sorted({e.snapshot.run for e in agent.store.entries()}) == ["a", "b"]
    assert agent.stats.refusals["max_runs"] == 1
    assert agent.stats.pushes["refused"] == 1


def test_a_new_rank_over_max_ranks_per_run_is_429() -> None:
    agent, client = make(max_ranks_per_run=2)
    for rank in (0, 1):
        assert client.post("/v1/push", json=snapshot(rank=rank, world_size=8), headers=AUTH).status_code == 200
    r = client.post("/v1/push", json=snapshot(rank=2, world_size=8), headers=AUTH)
    assert r.status_code == 429 and "max_ranks_per_run" in r.json()["detail"]
    assert agent.stats.refusals["max_ranks_per_run"] == 1


def test_series_over_max_series_are_429_and_a_rank_may_replace_its_own() -> None:
    agent, client = make(max_series=3)
    assert client.post("/v1/push", json=snapshot(samples=[loss(), info()]), headers=AUTH).status_code == 200
    assert client.post("/v1/push", json=snapshot(samples=[loss(2.0), info()]), headers=AUTH).status_code == 200
    r = client.post("/v1/push", json=snapshot(rank=1, samples=[loss(), info()]), headers=AUTH)
    assert r.status_code == 429 and "max_series" in r.json()["detail"]
    assert agent.stats.refusals["max_series"] == 1


def test_a_push_over_max_samples_per_push_is_413() -> None:
    agent, client = make(max_samples_per_push=1)
    r = client.post("/v1/push", json=snapshot(samples=[loss(), info()]), headers=AUTH)
    assert (r.status_code, r.json()["detail"]) == (413, "A push of 2 samples is over the limit of 1 "
                                                        "(max_samples_per_push, TRAINPATROL_MAX_SAMPLES_PER_PUSH).")
    assert agent.stats.refusals["max_samples_per_push"] == 1 and agent.store.entries() == ()


def test_a_label_value_over_max_label_length_is_422() -> None:
    agent, client = make(max_label_length=16)
    r = client.post("/v1/push", json=snapshot(samples=[info(host="h" * 17)]), headers=AUTH)
    assert r.status_code == 422 and "max_label_length" in r.json()["detail"]
    assert agent.stats.refusals["max_label_length"] == 1 and agent.store.entries() == ()


def test_pushes_over_the_run_bound_are_refused_alone() -> None:
    agent, client = make(max_runs=1)
    statuses = [client.post("/v1/push", json=snapshot(run), headers=AUTH) for run in ("a", "b", "a")]
    assert [r.status_code for r in statuses] == [200, 429, 200] and "max_runs" in statuses[1].json()["detail"]
    assert agent.stats.refusals["max_runs"] == 1 and [e.snapshot.run for e in agent.store.entries()] == ["a"]


def test_queued_commands_per_run_are_bounded() -> None:
    agent, client = make(max_queued_commands=2)
    client.post("/v1/push", json=snapshot(), headers=AUTH)
    for action in ("pause", "stop"):  # two of one action would coalesce into one (agent.store)
        assert client.post("/v1/runs/r1/actions", json={"action": action}, headers=AUTH).status_code == 202
    r = client.post("/v1/runs/r1/actions", json={"action": "checkpoint"}, headers=AUTH)
    assert r.status_code == 429 and "max_queued_commands" in r.json()["detail"]
    assert len(agent.store.pending("r1")) == 2
    assert agent.stats.refusals["max_queued_commands"] == 1


def test_the_alert_log_and_alert_fields_are_bounded() -> None:
    agent, client = make(alert_log_size=3)
    for i in range(5):
        assert client.post("/v1/alertmanager", json=payload(alert(run=f"gone{i}", fp=f"f{i}")),
                           headers=AUTH).status_code == 202
    assert [a["run"] for a in agent.alert_log] == ["gone2", "gone3", "gone4"]
    big = alert()
    big["annotations"]["description"] = "x" * 20_000
    r = client.post("/v1/alertmanager", json=payload(big), headers=AUTH)
    assert r.status_code == 422
    big = alert()
    big["startsAt"] = "2" * 1000
    assert client.post("/v1/alertmanager", json=payload(big), headers=AUTH).status_code == 422
    assert len(agent.alert_log) == 3
    assert agent.stats.refusals["invalid_request"] == 2


def test_a_request_body_over_max_request_bytes_is_413_and_counted() -> None:
    agent, client = make(max_request_bytes=1000)
    r = client.post("/v1/alertmanager", content=b" " * 1001, headers={**AUTH, "Content-Type": "application/json"})
    assert (r.status_code, r.json()["detail"]) == (413, "Request body of 1001 bytes is over the limit of 1000 bytes.")
    assert agent.stats.refusals["max_request_bytes"] == 1


def test_a_body_with_more_samples_than_the_bound_is_413_before_it_is_parsed() -> None:
    agent, client = make(max_samples_per_push=2)
    body = json.dumps(snapshot(samples=[loss()] * 4)).encode()
    r = client.post("/v1/push", content=body, headers={**AUTH, "Content-Type": "application/json"})
    assert (r.status_code, r.json()["detail"]) == (413, "A push of at least 3 samples is over the limit of 2 "
                                                        "(max_samples_per_push, TRAINPATROL_MAX_SAMPLES_PER_PUSH).")
    # a label value cannot hold the key's bytes: JSON escapes its quotes
    tricky = snapshot(samples=[info(host='"name" "name" "name"')])
    assert client.post("/v1/push", json=tricky, headers=AUTH).status_code == 200
    assert agent.stats.refusals["max_samples_per_push"] == 1 and agent.stats.pushes["refused"] == 1


def test_the_default_bounds_refuse_a_seventeenth_run_and_a_push_of_1025_samples() -> None:
    agent, client = make()
    for i in range(16):
        assert client.post("/v1/push", json=snapshot(f"run{i}"), headers=AUTH).status_code == 200
    assert client.post("/v1/push", json=snapshot("run16"), headers=AUTH).status_code == 429
    assert client.post("/v1/push", json=snapshot("run0", samples=[loss()] * 1025), headers=AUTH).status_code == 413
    assert len(agent.store.entries()) == 16

"""A run's name is its own: keyless pushes made before it came cannot stay in it or steer it, a command
for a killed incarnation never answers for the relaunch, a name held by pushes that never trained is
given up, and a flood of runs cannot keep a new honest run out."""

from __future__ import annotations

import logging
import time

import pytest

from fake_clock import Clock
from rank_client import AUTH, alert, counter, loopback, make_agent, payload, push
from servers import agent_in_thread, wait_for
from trainpatrol.agent.app import Agent
from trainpatrol.agent.config import AgentConfig
from trainpatrol.probe.publisher import Publisher

NAN = [{"name": "trainpatrol_nonfinite_steps_total", "labels": {"kind": "loss"}, "value": 2.0}]


def rfc3339(t: float) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(t)) + f".{int(t % 1 * 1e9):09d}Z"


def test_keyless_ranks_pushed_before_a_run_go_when_it_binds_its_key_and_cannot_come_back() -> None:
    agent = make_agent()
    client = loopback(agent)
    assert push(client, rank=7, world_size=8, samples=NAN).status_code == 200  # before the run starts
    assert push(client, "the-runs-key", rank=0, world_size=8).status_code == 200
    body = agent.registry.body().data.decode()
    assert 'rank="7"' not in body and "trainpatrol_nonfinite_steps_total{" not in body
    assert [e.snapshot.rank for e in agent.store.entries()] == [0]
    assert counter(agent, "trainpatrol_dropped_ranks_total", reason="keyless") == 1.0
    r = push(client, rank=7, world_size=8, samples=NAN)  # keyless, into a keyed name
    assert r.status_code == 403, r.text
    assert [e.snapshot.rank for e in agent.store.entries()] == [0]


def test_an_alert_that_began_before_the_run_bound_its_key_does_not_act_on_it() -> None:
    clock = Clock(time.time())
    agent = make_agent(clock)
    client = loopback(agent)
    assert push(client, "the-runs-key", rank=0).status_code == 200
    old = payload(alert("from-keyless-series", starts=rfc3339(clock.now - 3.0)))
    r = client.post("/v1/alertmanager", json=old, headers=AUTH)
    assert r.status_code == 202 and [x["outcome"] for x in r.json()["results"]] == ["predates_key"]
    assert agent.store.pending("train") == []
    fresh = payload(alert("from-the-runs-series", starts=rfc3339(clock.now + 1.0)))
    r = client.post("/v1/alertmanager", json=fresh, headers=AUTH)
    assert [x["outcome"] for x in r.json()["results"]] == ["act"]
    assert [c.action for c in agent.store.pending("train")] == ["pause"]


def test_a_command_for_a_killed_incarnation_neither_swallows_nor_reaches_the_relaunch() -> None:
    clock = Clock()
    agent = make_agent(clock)
    client = loopback(agent)
    assert push(client, "k", rank=0, world_size=1, instance="first").status_code == 200
    first = client.post("/v1/runs/train/actions", json={"action": "stop"}, headers=AUTH).json()
    clock.now += 2.0  # the first incarnation is stopped (SIGSTOP), then killed: it never carries the stop out
    reply = push(client, "k", rank=0, world_size=1, instance="second", step=1)  # relaunched, same key
    assert reply.status_code == 200 and reply.json()["commands"] == []
    second = client.post("/v1/runs/train/actions", json={"action": "stop"}, headers=AUTH).json()
    assert second["coalesced"] is False and second["id"] != first["id"]
    reply = push(client, "k", rank=0, world_size=1, instance="second", step=2)
    assert [c["id"] for c in reply.json()["commands"]] == [second["id"]]
    status = client.get("/v1/runs/train", headers=AUTH).json()
    assert [c["id"] for c in status["pending_commands"]] == [second["id"]]


def test_a_name_held_by_pushes_that_never_trained_is_given_up_after_squat_seconds() -> None:
    clock = Clock()
    agent = make_agent(clock, squat_seconds=60.0)
    client = loopback(agent)
    for _ in range(5):  # a squatter renews its pushes, never stepping
        assert push(client, "squatter", rank=0, step=0).status_code == 200
        clock.now += 10.0
    assert push(client, "the-real-run", rank=0, step=0).status_code == 403  # 50 s: not yet
    clock.now += 11.0
    assert push(client, "squatter", rank=0, step=0).status_code == 200
    assert push(client, "the-real-run", rank=0, step=0).status_code == 200  # 61 s without a step
    assert push(client, "squatter", rank=0, step=0).status_code == 403
    assert counter(agent, "trainpatrol_dropped_ranks_total", reason="superseded") == 1.0


def test_a_run_that_trains_keeps_its_name_while_its_ranks_are_up() -> None:
    clock = Clock()
    agent = make_agent(clock, squat_seconds=60.0)
    client = loopback(agent)
    for step in range(10):
        assert push(client, "trainer", rank=0, step=step).status_code == 200
        clock.now += 10.0
    assert push(client, "other", rank=0).status_code == 403
    clock.now += 16.0  # no push for longer than the liveness TTL: down, as after kill -9
    assert push(client, "relaunched", rank=0).status_code == 200


def test_a_new_run_is_admitted_while_a_flood_of_runs_holds_the_bounds() -> None:
    clock = Clock()
    agent = make_agent(clock, max_runs=4, squat_seconds=60.0)
    client = loopback(agent)
    for i in range(4):
        assert push(client, run=f"evil-{i}", rank=0, world_size=1).status_code == 200
    assert push(client, "honest", run="honest", rank=0).status_code == 429  # every run is up and young
    clock.now += 16.0  # the flood's runs pushed once and went down
    assert push(client, "honest", run="honest", rank=0).status_code == 200
    assert counter(agent, "trainpatrol_dropped_ranks_total", reason="evicted") == 1.0
    assert len(agent.store.all_runs()) == 4


def test_one_run_cannot_take_every_series() -> None:
    agent = make_agent(max_series=100, max_series_per_run=60)
    client = loopback(agent)
    loss = {"name": "trainpatrol_loss", "labels": {}, "value": 1.0}
    assert push(client, run="flood", rank=0, samples=[loss] * 50).status_code == 200
    r = push(client, run="flood", rank=1, samples=[loss] * 50)
    assert r.status_code == 429 and "max_series_per_run" in r.json()["detail"]
    assert push(client, run="honest", rank=0, samples=[loss] * 40).status_code == 200


def test_refused_pushes_keep_an_idle_agent_up_and_never_read_as_working(caplog: pytest.LogCaptureFixture) -> None:
    agent = Agent(AgentConfig(nvml=False).load())
    with agent_in_thread(agent.app) as port:
        client_push = loopback(agent)
        assert push(client_push, "bound-key", run="taken", rank=0, world_size=1).status_code == 200
        agent.last_push -= 100.0  # as if no accepted push for 100 s
        caplog.set_level(logging.INFO, logger="trainpatrol")
        snap = {"run": "taken", "rank": 0, "world_size": 1}
        pub = Publisher(f"http://127.0.0.1:{port}", lambda: dict(snap), lambda c: None, run_key="another-key",
                        interval=0.05, max_backoff=0.05)
        pub.start()
        wait_for(lambda: pub.dropped >= 5, 10, what="five refused pushes")
        pub.stop(final_push=False)
    assert agent.idle_for() < 5.0  # its ranks are pushing, even if refused: the node is alive
    assert pub.delivered == 0
    said = [r.getMessage() for r in caplog.records if r.name == "trainpatrol"]
    assert len([m for m in said if "failed" in m or "refused" in m]) == 1, said
    assert not any("work again" in m for m in said), said

"""A push speaks only for its own run: it must prove the run's key, which the run's first push set.

Issue 22 findings 1 and 2: a local process without the agent token pushed as a rank of another run,
marked its queued commands done (the reply even listed them), and created series that fired alerts.
"""

from __future__ import annotations

from rank_client import AUTH, KEY_HEADER, TOKEN, counter, loopback, make_agent, push, snapshot

VICTIM_KEY = "victim-run-key"


def test_forged_loopback_push_cannot_mark_another_runs_commands_done() -> None:
    agent = make_agent()
    victim = loopback(agent)
    for rank in (0, 1):
        assert push(victim, VICTIM_KEY, rank=rank).status_code == 200
    ids = []
    for action in ("pause", "stop"):
        r = victim.post("/v1/runs/train/actions", json={"action": action}, headers=AUTH)
        assert r.status_code == 202, r.text
        ids.append(r.json()["id"])

    forger = loopback(agent)
    for rank in (0, 1):
        r = push(forger, rank=rank, done_commands=ids)  # no key at all
        assert r.status_code == 403, r.text
        assert "commands" not in r.json()  # the refusal lists nothing of the run
        r = push(forger, "guessed-key", rank=rank, done_commands=ids)
        assert r.status_code == 403, r.text

    assert [c.id for c in agent.store.pending("train")] == ids
    status = victim.get("/v1/runs/train", headers=AUTH).json()
    assert [c["id"] for c in status["pending_commands"]] == ids
    assert counter(agent, "trainpatrol_pushes_total", outcome="wrong_run_key") == 4.0
    reply = push(victim, VICTIM_KEY, rank=0)
    assert [c["id"] for c in reply.json()["commands"]] == ids


def test_forged_push_creates_no_series_for_another_run() -> None:
    agent = make_agent()
    victim = loopback(agent)
    assert push(victim, VICTIM_KEY, rank=0, world_size=8).status_code == 200
    nan = [{"name": "trainpatrol_nonfinite_steps_total", "labels": {"kind": "loss"}, "value": 2.0}]
    r = push(loopback(agent), "not-the-key", rank=7, world_size=8, samples=nan)
    assert r.status_code == 403, r.text
    body = agent.registry.body().data.decode()
    assert 'rank="7"' not in body
    assert "trainpatrol_nonfinite_steps_total{" not in body


def test_a_push_acking_commands_without_the_runs_key_acks_nothing() -> None:
    agent = make_agent()
    client = loopback(agent)
    assert push(client, VICTIM_KEY, rank=0).status_code == 200
    r = client.post("/v1/push", json=snapshot(rank=0, done_commands=[5]),
                    headers={"Content-Type": "application/json", KEY_HEADER: "wrong"})
    assert r.status_code == 403
    assert [e.snapshot.done_commands for e in agent.store.entries()] == [[]]


def test_first_keyed_push_binds_the_run_and_the_binding_expires_with_its_series() -> None:
    from fake_clock import T0, Clock

    clock = Clock(T0)
    agent = make_agent(clock, rank_expire_seconds=60.0, closed_expire_seconds=60.0)
    client = loopback(agent)
    assert push(client, "first", rank=0).status_code == 200
    assert push(client, "second", rank=1).status_code == 403
    clock.now += 61
    agent.store.expire()
    assert push(client, "second", rank=1).status_code == 200  # a new run of the same name


def test_loopback_push_with_a_wrong_agent_token_is_refused() -> None:
    """Loopback pushes need no token; one that carries a wrong token is still refused, not waved through."""
    agent = make_agent()
    client = loopback(agent)
    wrong = {"Authorization": "Bearer wrong-token"}
    r = push(client, VICTIM_KEY, headers=wrong, rank=0)
    assert r.status_code == 401
    assert agent.store.entries() == ()
    assert counter(agent, "trainpatrol_pushes_total", outcome="unauthorized") == 1.0
    assert push(client, VICTIM_KEY, headers={"Authorization": f"Bearer {TOKEN}"}, rank=0).status_code == 200


def test_a_run_relaunched_with_a_new_key_takes_over_once_every_rank_ended() -> None:
    agent = make_agent()
    client = loopback(agent)
    for rank in (0, 1):
        assert push(client, "first-launch", rank=rank).status_code == 200
    assert push(client, "relaunch", rank=0).status_code == 403  # rank 1 still runs
    assert push(client, "first-launch", rank=0, state="stopped").status_code == 200
    assert push(client, "relaunch", rank=0).status_code == 403
    assert push(client, "first-launch", rank=1, state="closed").status_code == 200
    assert push(client, "relaunch", rank=0).status_code == 200
    assert push(client, "first-launch", rank=1).status_code == 403  # the old launch is out

"""Issue 22 finding 7: one alert group made a checkpoint per alert, a capture storm a bundle per alert.

Same-action commands that no rank has acted on coalesce into one; checkpoints and captures are
rate-limited per run and minute (defaults: 2 and 4)."""

from __future__ import annotations

from fake_clock import T0, Clock
from rank_client import AUTH, alert, counter, loopback, make_agent, payload, push

KEY = "run-key"


def _ack_all(client: object, ids: list[int], world: int = 8) -> None:
    for rank in range(world):
        push(client, KEY, rank=rank, world_size=world, done_commands=ids)  # type: ignore[arg-type]


def test_an_oom_risk_group_of_eight_alerts_makes_one_checkpoint() -> None:
    agent = make_agent(Clock(T0))
    client = loopback(agent)
    _ack_all(client, [])
    group = [alert(f"oom{r}", action="checkpoint", alertname="TrainPatrolOOMRisk", rank=str(r)) for r in range(8)]
    r = client.post("/v1/alertmanager", json=payload(*group), headers=AUTH)
    assert r.status_code == 202
    assert [x["outcome"] for x in r.json()["results"]] == ["act"] + ["coalesced"] * 7
    assert [c.action for c in agent.store.pending("train")] == ["checkpoint"]
    assert counter(agent, "trainpatrol_control_commands_total", action="checkpoint", source="alertmanager") == 1.0


def test_a_webhook_of_a_thousand_capture_alerts_queues_one_capture() -> None:
    agent = make_agent(Clock(T0))  # the ranks stay live however long a busy machine takes over the webhook
    client = loopback(agent)
    _ack_all(client, [])
    alerts = [alert(f"cap{i}", action="capture", alertname="TrainPatrolLoaderStall", rank=str(i % 8))
              for i in range(1000)]
    r = client.post("/v1/alertmanager", json=payload(*alerts), headers=AUTH)
    assert r.status_code == 202
    outcomes = [x["outcome"] for x in r.json()["results"]]
    assert (outcomes.count("act"), outcomes.count("coalesced")) == (1, 999)
    assert [c.action for c in agent.store.pending("train")] == ["capture"]


def test_a_capture_storm_makes_at_most_four_bundles_a_minute() -> None:
    clock = Clock(T0)
    agent = make_agent(clock)
    client = loopback(agent)
    _ack_all(client, [])
    queued: list[int] = []
    for wave in range(10):  # the ranks act on each capture before the next wave of 100 alerts comes
        alerts = [alert(f"cap{wave}-{i}", action="capture", alertname="TrainPatrolLoaderStall") for i in range(100)]
        client.post("/v1/alertmanager", json=payload(*alerts), headers=AUTH)
        queued += [c.id for c in agent.store.pending("train")]
        _ack_all(client, queued)
        clock.now += 3
    assert len(queued) == 4
    # four waves coalesce into their first alert; each alert of the six later waves is refused
    assert counter(agent, "trainpatrol_control_commands_refused_total", action="capture", reason="coalesced") == 396.0
    assert counter(agent, "trainpatrol_control_commands_refused_total", action="capture",
                   reason="rate_limited") == 600.0
    clock.now = T0 + 61  # a minute after the first capture, the next is allowed
    _ack_all(client, queued)  # the ranks are still live
    client.post("/v1/alertmanager", json=payload(alert("late", action="capture")), headers=AUTH)
    assert len(agent.store.pending("train")) == 1


def test_the_api_refuses_a_third_checkpoint_in_a_minute_with_429() -> None:
    clock = Clock(T0)
    agent = make_agent(clock)
    client = loopback(agent)
    _ack_all(client, [])
    for _ in range(2):
        r = client.post("/v1/runs/train/actions", json={"action": "checkpoint"}, headers=AUTH)
        assert r.status_code == 202
        _ack_all(client, [r.json()["id"]])
    r = client.post("/v1/runs/train/actions", json={"action": "checkpoint"}, headers=AUTH)
    assert r.status_code == 429
    assert r.json()["detail"] == "Run 'train' had 2 checkpoint actions in the last 60 s, the limit; retry later."
    assert r.headers["retry-after"] == "60"


def test_a_repeated_api_pause_coalesces_with_the_one_not_yet_acted_on() -> None:
    agent = make_agent()
    client = loopback(agent)
    _ack_all(client, [])
    first = client.post("/v1/runs/train/actions", json={"action": "pause"}, headers=AUTH).json()
    again = client.post("/v1/runs/train/actions", json={"action": "pause"}, headers=AUTH).json()
    assert again["id"] == first["id"] and again["coalesced"] is True
    assert len(agent.store.pending("train")) == 1

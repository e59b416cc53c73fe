"""The Patrol's pushes: a whole snapshot a second on a kept-alive connection, commands in the replies,
a confirmed final push, reconnects to a restarted agent, and /metrics following every push."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from exposition_check import value
from loops import run_scripted, scripted_patrol
from servers import agent_in_thread, free_port, http_get, wait_for
from trainpatrol.agent.app import Agent
from trainpatrol.agent.config import AgentConfig
from trainpatrol.probe.publisher import Publisher
from trainpatrol.protocol import Command


def samples(*values: float, lr_groups: int = 1) -> list[dict[str, Any]]:
    names = ["trainpatrol_loss", "trainpatrol_step_total", "trainpatrol_grad_norm"]
    out = [{"name": n, "labels": {}, "value": v} for n, v in zip(names, values, strict=False)]
    return out + [{"name": "trainpatrol_learning_rate", "labels": {"param_group": str(g)}, "value": 1e-3}
                  for g in range(lr_groups)]


def _patrol_like(run: str = "r") -> Any:
    seq = [0]

    def snapshot() -> dict[str, Any]:
        seq[0] += 1
        return {"run": run, "rank": 0, "world_size": 1, "instance": "p1", "seq": seq[0], "step": seq[0],
                "samples": samples(3.0 - seq[0] * 0.01, float(seq[0]), 0.5)}
    return snapshot


def latest(agent: Agent) -> Any:
    return agent.store.entries()[0].snapshot


def test_publisher_pushes_on_one_connection_hears_commands_and_its_final_push_is_confirmed() -> None:
    agent = Agent(AgentConfig(nvml=False).load())
    heard: list[list[dict[str, Any]]] = []
    with agent_in_thread(agent.app) as port:
        pub = Publisher(f"http://127.0.0.1:{port}", _patrol_like(), heard.append, interval=0.05)
        pub.start()
        wait_for(lambda: pub.delivered >= 5, 10, what="five pushes")
        connection = pub._conn
        agent.enqueue(Command(id=5, run="r", action="pause", created=time.time()))
        wait_for(lambda: heard, 5, what="the command")
        assert heard[0][0]["id"] == 5 and heard[0][0]["action"] == "pause"
        assert pub._conn is connection  # kept alive: one TCP connection for every push
        pub.stop(final_push=True)
        last = latest(agent)  # no waiting: taken in when stop() returns
        assert last.seq == pub.delivered and last.samples[1].value == float(last.seq)
        assert pub.dropped == 0 and agent.stats.pushes["ok"] == pub.delivered


def test_without_an_agent_pushes_are_dropped_counted_and_retried_with_backoff() -> None:
    pub = Publisher(f"http://127.0.0.1:{free_port()}", _patrol_like(), lambda c: None, interval=0.05,
                    max_backoff=0.1)
    pub.start()
    wait_for(lambda: pub.dropped >= 3, 10, what="three dropped pushes")
    pub.stop(final_push=False)
    assert pub.delivered == 0


def test_publisher_reconnects_to_a_restarted_agent() -> None:
    port = free_port()
    first, second = Agent(AgentConfig(nvml=False).load()), Agent(AgentConfig(nvml=False).load())
    pub = Publisher(f"http://127.0.0.1:{port}", _patrol_like(), lambda c: None, interval=0.05, max_backoff=0.2)
    with agent_in_thread(first.app, port):
        pub.start()
        wait_for(lambda: pub.delivered >= 3, 10, what="pushes to the first agent")
    with agent_in_thread(second.app, port):
        wait_for(lambda: second.store.entries(), 10, what="pushes to the restarted agent")
        assert len(latest(second).samples) == 4 and second.stats.pushes["invalid"] == 0
        seen = latest(second).seq
        wait_for(lambda: latest(second).seq > seen + 2, 10, what="pushes go on")
        pub.stop(final_push=True)
    assert value(second.registry.body().data, "trainpatrol_step_total", {"run": "r", "rank": "0"}) == \
        float(latest(second).seq)


def test_the_step_time_histogram_on_metrics_follows_every_push(tmp_path: Path) -> None:
    """/metrics shows the histogram of the rank's last push (a frozen count once made the loader-wait
    ratio grow without bound and fire DataLoaderBound on a healthy run)."""
    agent = Agent(AgentConfig(nvml=False).load())
    with agent_in_thread(agent.app) as port:
        patrol = scripted_patrol(tmp_path, f"http://127.0.0.1:{port}", run="h", push_interval_seconds=0.05)
        labels = {"run": "h", "rank": "0"}

        def on_metrics() -> tuple[float | None, float | None, float | None]:
            body = http_get(f"http://127.0.0.1:{port}/metrics")
            return (value(body, "trainpatrol_step_total", labels),
                    value(body, "trainpatrol_step_duration_seconds_count", labels),
                    value(body, "trainpatrol_step_duration_seconds_sum", labels))
        try:
            sums = []
            for steps in (5, 12, 30):
                run_scripted(patrol, [1.0] * (steps - patrol.step_count))
                seen: list[Any] = []
                wait_for(lambda: seen.append(on_metrics()) or seen[-1][:2] == (steps, steps), 5,  # noqa: B023
                         what=f"step_total and the histogram's count at {steps}")
                sums.append(seen[-1][2])
            assert agent.stats.pushes["ok"] >= 3 and sums == sorted(sums) and sums[0] < sums[-1]
        finally:
            patrol.close()


def test_the_final_push_is_tried_again_when_a_busy_agent_misses_it(monkeypatch: Any) -> None:
    """The rank's last state (closed) tells the agent it did not die: one timed-out push must not lose it."""
    agent = Agent(AgentConfig(nvml=False).load())
    with agent_in_thread(agent.app) as port:
        pub = Publisher(f"http://127.0.0.1:{port}", _patrol_like(), lambda c: None, interval=3600)
        real_post, missed = pub._post, []

        def busy_agent(body: bytes) -> None:  # the agent answers the first two after the push's timeout
            if len(missed) < 2:
                missed.append(body)
                raise TimeoutError("timed out")
            real_post(body)
        monkeypatch.setattr(pub, "_post", busy_agent)
        pub.stop(final_push=True)
        assert len(missed) == 2 and latest(agent).seq == 3

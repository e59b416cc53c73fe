"""The Patrol's side of the push stream: deltas, chunk decoding, a refused stream, reconnects."""

from __future__ import annotations

import json
import math
import random
import time
from pathlib import Path
from typing import Any

from exposition_check import value
from loops import run_scripted, scripted_patrol
from servers import agent_in_thread, free_port, http_get, wait_for, without_push_stream
from trainpatrol.agent.app import Agent
from trainpatrol.agent.config import AgentConfig
from trainpatrol.probe.publisher import Publisher
from trainpatrol.probe.push_stream import _Dechunker
from trainpatrol.probe.snapshot_delta import DeltaEncoder
from trainpatrol.protocol import Command


def samples(*values: float, lr_groups: int = 1) -> list[dict[str, Any]]:
    names = ["trainpatrol_loss", "trainpatrol_step_total", "trainpatrol_grad_norm"]
    out = [{"name": n, "labels": {}, "value": v} for n, v in zip(names, values, strict=False)]
    return out + [{"name": "trainpatrol_learning_rate", "labels": {"param_group": str(g)}, "value": 1e-3}
                  for g in range(lr_groups)]


def line(encoder: DeltaEncoder, snap_samples: list[dict[str, Any]], seq: int = 1) -> dict[str, Any]:
    raw = encoder.encode({"run": "r", "rank": 0, "seq": seq, "samples": snap_samples})
    assert raw.endswith(b"\n") and raw.count(b"\n") == 1
    return dict(json.loads(raw))


def test_delta_encoder_sends_whole_then_only_what_changed() -> None:
    enc = DeltaEncoder()
    assert line(enc, samples(2.0, 10.0, 0.5))["samples"] == samples(2.0, 10.0, 0.5)
    second = line(enc, samples(1.5, 20.0, 0.5), seq=2)
    assert "samples" not in second and second["changed"] == [[0, 1.5], [1, 20.0]] and second["seq"] == 2
    assert line(enc, samples(1.5, 20.0, 0.5))["changed"] == []
    assert line(enc, samples(1.5, 20.0, -0.0))["changed"] == [[2, -0.0]]  # -0.0 prints apart from 0.0
    nan = line(enc, samples(math.nan, 20.0, -0.0))["changed"]
    assert len(nan) == 1 and nan[0][0] == 0 and math.isnan(nan[0][1])
    assert line(enc, samples(math.nan, 20.0, -0.0))["changed"][0][0] == 0  # NaN never equals itself
    assert "samples" in line(enc, samples(1.0, 20.0, 0.0, lr_groups=2))  # new series: whole again
    enc.reset()
    assert "samples" in line(enc, samples(1.0, 20.0, 0.0, lr_groups=2))


def test_delta_encoder_sends_a_whole_line_when_the_step_histogram_appears() -> None:
    enc = DeltaEncoder()
    histogram = {"counts": [0.0] * 15 + [1.0], "sum": 0.5}
    assert "samples" in json.loads(enc.encode({"run": "r", "rank": 0, "samples": samples(2.0)}))
    assert "samples" in json.loads(enc.encode({"run": "r", "rank": 0, "samples": samples(2.0),
                                               "histogram": histogram}))
    delta = json.loads(enc.encode({"run": "r", "rank": 0, "samples": samples(2.0), "histogram": histogram}))
    assert delta["changed"] == [] and delta["histogram"] == histogram


def test_dechunker_gives_the_same_bytes_however_the_chunks_are_cut() -> None:
    payload = [b'{"a": 1}\n', b"x" * 70000, b"", b'{"b": 2}\n']
    wire = b"".join(b"%x\r\n%s\r\n" % (len(p), p) for p in payload if p) + b"0\r\n\r\n"
    rng = random.Random(3)
    for _ in range(20):
        d, out, i = _Dechunker(), [], 0
        while i < len(wire):
            n = rng.randint(1, 9000)
            out.append(d.feed(wire[i:i + n]))
            i += n
        assert b"".join(out) == b"".join(payload) and d.done


def _patrol_like(run: str = "r") -> Any:
    seq = [0]

    def snapshot() -> dict[str, Any]:
        seq[0] += 1
        return {"run": run, "rank": 0, "world_size": 1, "instance": "p1", "seq": seq[0], "step": seq[0],
                "samples": samples(3.0 - seq[0] * 0.01, float(seq[0]), 0.5)}
    return snapshot


def latest(agent: Agent) -> Any:
    return agent.store.entries()[0].snapshot


def test_publisher_streams_deltas_hears_commands_and_its_final_push_is_confirmed() -> None:
    agent = Agent(AgentConfig(nvml=False).load())
    heard: list[list[dict[str, Any]]] = []
    with agent_in_thread(agent.app) as port:
        pub = Publisher(f"http://127.0.0.1:{port}", _patrol_like(), heard.append, interval=0.05)
        pub.start()
        wait_for(lambda: pub.delivered >= 5, 10, what="five pushes")
        agent.enqueue(Command(id=5, run="r", action="pause", created=time.time()))
        wait_for(lambda: heard, 5, what="the command")
        assert heard[0][0]["id"] == 5 and heard[0][0]["action"] == "pause"
        pub.stop(final_push=True)
        last = latest(agent)  # no waiting: the final push is a request of its own, taken in when stop() returns
        assert last.seq == pub.delivered and last.samples[1].value == float(last.seq)
        assert pub.dropped == 0
        # the stream's last lines are still handled after it closed, in the agent's next batch
        wait_for(lambda: agent.stats.pushes["ok"] == pub.delivered, 5, what="every line handled")
        assert latest(agent).seq == last.seq  # and an older line never overwrites the final push


def test_without_the_stream_periodic_pushes_are_dropped_and_only_the_confirmed_push_arrives() -> None:
    agent = Agent(AgentConfig(nvml=False).load())
    with agent_in_thread(without_push_stream(agent)) as port:
        pub = Publisher(f"http://127.0.0.1:{port}", _patrol_like(), lambda c: None, interval=0.05, max_backoff=0.1)
        pub.start()
        wait_for(lambda: pub.dropped >= 3, 10, what="three refused streams")
        assert pub.delivered == 0 and not agent.store.entries()  # no push went by request instead
        pub.stop(final_push=True)
        assert pub.delivered == 1 and latest(agent).seq == 1 + pub.dropped  # one snapshot per try, the last posted


def test_publisher_reconnects_to_a_restarted_agent_with_a_whole_line() -> None:
    port = free_port()
    first, second = Agent(AgentConfig(nvml=False).load()), Agent(AgentConfig(nvml=False).load())
    pub = Publisher(f"http://127.0.0.1:{port}", _patrol_like(), lambda c: None, interval=0.05, max_backoff=0.2)
    with agent_in_thread(first.app, port):
        pub.start()
        wait_for(lambda: pub.delivered >= 3, 10, what="pushes to the first agent")
    with agent_in_thread(second.app, port):
        wait_for(lambda: second.store.entries(), 10, what="pushes to the restarted agent")
        # a whole snapshot: the new stream started over (a delta without its base would be refused)
        assert second.store.entries()[0].record.written.samples == 4 and second.stats.pushes["invalid"] == 0
        seen = latest(second).seq
        wait_for(lambda: latest(second).seq > seen + 2, 10, what="deltas on the new stream")
        pub.stop(final_push=True)
    assert value(second.metrics(), "trainpatrol_step_total", {"run": "r", "rank": "0"}) == float(latest(second).seq)


def test_the_step_time_histogram_on_metrics_follows_every_streamed_line(tmp_path: Path) -> None:
    """A delta line names the samples that changed and carries the histogram whole: /metrics must show
    the histogram of the line, not of the stream's first whole snapshot (a frozen count made the
    loader-wait ratio grow without bound and fire DataLoaderBound on a healthy run)."""
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

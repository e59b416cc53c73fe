"""Pushes on one kept-open stream (POST /v1/push/stream), whole lines and deltas.

The stream is what a Patrol uses, so its refusals must be as clear as a single push's, and one bad
line must never cost the lines around it."""

from __future__ import annotations

import json
import socket
import time
from typing import Any

import pytest
from fastapi.testclient import TestClient

from exposition_check import values as samples
from servers import agent_in_thread, wait_for, without_push_stream
from trainpatrol.agent.app import Agent
from trainpatrol.agent.config import AgentConfig
from trainpatrol.collectors.ranks import RankCollector
from trainpatrol.probe.push_stream import PushStream, StreamRefused
from trainpatrol.protocol import Command

TOKEN = "stream-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
NDJSON = {**AUTH, "Content-Type": "application/x-ndjson"}


def snap(rank: int = 0, seq: int = 1, loss: float = 2.5, steps: float = 10.0, **extra: Any) -> dict[str, Any]:
    return {"run": "r1", "rank": rank, "world_size": 2, "instance": f"i{rank}", "seq": seq, "step": int(steps),
            "samples": [{"name": "trainpatrol_loss", "labels": {}, "value": loss},
                        {"name": "trainpatrol_step_total", "labels": {}, "value": steps},
                        {"name": "trainpatrol_learning_rate", "labels": {"param_group": "0"}, "value": 3e-4}],
            **extra}


def delta(rank: int = 0, seq: int = 2, changed: list[list[float]] | None = None, **extra: Any) -> dict[str, Any]:
    line = {k: v for k, v in snap(rank, seq).items() if k != "samples"}
    return {**line, "changed": changed if changed is not None else [[0, 1.5], [1, 20.0]], **extra}


def body(*lines: Any) -> bytes:
    return b"".join((x if isinstance(x, bytes) else json.dumps(x).encode()) + b"\n" for x in lines)


def answer(client: TestClient, data: bytes, headers: dict[str, str] = NDJSON) -> list[dict[str, Any]]:
    r = client.post("/v1/push/stream", content=data, headers=headers)
    assert r.status_code == 200, r.text
    assert r.headers["content-type"] == "application/x-ndjson"
    return [json.loads(line) for line in r.text.splitlines()]


def make(**overrides: Any) -> tuple[Agent, TestClient]:
    agent = Agent(AgentConfig(token=TOKEN, nvml=False, **overrides).load())
    return agent, TestClient(agent.app, base_url="http://localhost")


def values(agent: Agent, rank: int = 0) -> dict[str, float]:
    """The rank's pushed series as /metrics serves them, by name."""
    pushed = {s["name"] for s in snap()["samples"]}
    return {name: v for (name, labels), v in samples(agent.metrics()).items()
            if name in pushed and ("rank", str(rank)) in labels}


def pushes(agent: Agent) -> dict[str, float]:
    return {dict(labels)["outcome"]: v for (name, labels), v in samples(agent.metrics()).items()
            if name == "trainpatrol_pushes_total"}


def test_whole_then_delta_lines_are_merged_and_exposed() -> None:
    agent, client = make()
    assert answer(client, body(snap(), delta(seq=2), delta(seq=3, changed=[[0, 1.25]]))) == \
        [{"accepted": 3, "refused": 0}]
    assert values(agent) == {"trainpatrol_loss": 1.25, "trainpatrol_step_total": 20.0,
                             "trainpatrol_learning_rate": 3e-4}
    text = agent.metrics().decode()
    assert 'trainpatrol_loss{rank="0",run="r1"} 1.25\n' in text
    assert 'trainpatrol_step_total{rank="0",run="r1"} 20.0\n' in text
    assert 'trainpatrol_learning_rate{param_group="0",rank="0",run="r1"} 0.0003\n' in text
    assert pushes(agent)["ok"] == 3.0


def test_a_rank_with_commands_hears_them_on_its_stream() -> None:
    agent, client = make()
    agent.enqueue(Command(id=7, run="r1", action="pause", reason="test", created=time.time()))
    lines = answer(client, body(snap(rank=1, seq=4)))
    assert lines[-1] == {"accepted": 1, "refused": 0}
    assert [(x["run"], x["rank"], x["seq"], [(c["id"], c["action"]) for c in x["commands"]]) for x in lines[:-1]] \
        == [("r1", 1, 4, [(7, "pause")])]


def test_a_bad_line_is_refused_alone_and_counted() -> None:
    agent, client = make()
    lines = answer(client, body(snap(seq=1), b"{not json", {**snap(seq=2), "rank": 5}, snap(seq=3, loss=0.5)))
    assert lines[-1] == {"accepted": 2, "refused": 2}
    assert [(x["line"], x["status"]) for x in lines[:-1]] == [(2, 422), (3, 422)]
    assert lines[0]["detail"].startswith("Invalid request: body: Invalid JSON")
    assert "rank 5 is outside world_size 2" in lines[1]["detail"]
    assert values(agent)["trainpatrol_loss"] == 0.5
    assert pushes(agent)["ok"] == 2.0 and pushes(agent)["invalid"] == 2.0


@pytest.mark.parametrize("lines, fragment", [
    ([delta()], "needs a whole snapshot of run 'r1' rank 0 earlier on the same stream"),
    ([snap(), delta(instance="other")], "needs a whole snapshot"),  # a new Patrol in the same process
    ([snap(), delta(changed=[[3, 1.0]])], "sample index 3 is outside the 3 samples"),
    ([snap(), {**delta(), "samples": snap()["samples"]}], "carries `changed`, not `samples`"),
    ([snap(), delta(changed=[[-1, 1.0]])], "greater than or equal to 0"),
])
def test_a_delta_without_its_base_is_refused_with_a_reason(lines: list[dict[str, Any]], fragment: str) -> None:
    agent, client = make()
    refused = answer(client, body(*lines))[-2]
    assert refused["status"] == 422 and fragment in refused["detail"], refused
    if len(lines) == 1:
        assert agent.store.entries() == () and values(agent) == {}
    else:  # the whole line stands, untouched by the refused delta
        assert values(agent) == {"trainpatrol_loss": 2.5, "trainpatrol_step_total": 10.0,
                                 "trainpatrol_learning_rate": 3e-4}


def test_after_a_refused_line_deltas_wait_for_a_whole_line() -> None:
    """A delta after a refusal might build on a snapshot the agent never took: whole lines first."""
    agent, client = make()
    lines = answer(client, body(snap(), b"garbage", delta(seq=3), snap(seq=4, loss=9.0), delta(seq=5)))
    assert [x.get("status") for x in lines] == [422, 422, None]
    assert "needs a whole snapshot" in lines[1]["detail"]
    assert lines[-1] == {"accepted": 3, "refused": 2}
    assert values(agent)["trainpatrol_loss"] == 1.5  # seq 5's delta on seq 4's whole line


def test_an_overlong_line_is_413_and_the_stream_goes_on() -> None:
    agent, client = make(max_push_bytes=2000)
    long_line = json.dumps({**snap(seq=2), "host": "h" * 3000}).encode()
    lines = answer(client, body(snap(seq=1), long_line, snap(seq=3, loss=0.75)))
    assert [(x["line"], x["status"]) for x in lines[:-1]] == [(2, 413)]
    assert "longer than the limit of 2000 bytes" in lines[0]["detail"]
    assert lines[-1] == {"accepted": 2, "refused": 1}
    assert values(agent)["trainpatrol_loss"] == 0.75
    assert pushes(agent)["too_large"] == 1.0


def test_an_overlong_line_arriving_in_pieces_is_skipped_to_its_newline() -> None:
    agent, client = make(max_push_bytes=2000)
    pieces = [json.dumps(snap(seq=1)).encode() + b"\n", b'{"run": "r1", "host": "' + b"x" * 1500,
              b"y" * 1500, b'"}\n' + json.dumps(snap(seq=2, loss=0.125)).encode()]  # last line: no newline
    r = client.post("/v1/push/stream", content=iter(pieces), headers=NDJSON)  # chunked
    lines = [json.loads(x) for x in r.text.splitlines()]
    assert [(x["line"], x["status"]) for x in lines[:-1]] == [(2, 413)]
    assert lines[-1] == {"accepted": 2, "refused": 1}
    assert values(agent)["trainpatrol_loss"] == 0.125


@pytest.mark.parametrize("headers, status, fragment", [
    ({"Content-Type": "application/x-ndjson"}, 401, "must carry the bearer token"),
    ({"Content-Type": "application/x-ndjson", "Authorization": "Bearer wrong"}, 401, "must carry the bearer token"),
    ({**AUTH, "Content-Type": "text/plain"}, 422, "must be application/x-ndjson or application/json"),
])
def test_a_refused_stream_gets_an_ordinary_error(headers: dict[str, str], status: int, fragment: str) -> None:
    agent, client = make()
    r = client.post("/v1/push/stream", content=body(snap()), headers=headers)
    assert r.status_code == status and fragment in r.json()["detail"]
    assert agent.store.entries() == ()


def test_a_live_stream_interleaves_pushes_commands_and_ends_cleanly() -> None:
    agent = Agent(AgentConfig(nvml=False).load())
    with agent_in_thread(agent.app) as port:
        stream = PushStream("127.0.0.1", port, timeout=5.0)
        stream.open()
        stream.send(body(snap(seq=1)))
        wait_for(lambda: agent.store.entries(), 5, what="the first line")
        assert stream.replies() == []  # nothing to say: the agent writes nothing
        agent.enqueue(Command(id=11, run="r1", action="checkpoint", created=time.time()))
        stream.send(body(delta(seq=2)))
        got: list[dict[str, Any]] = []
        wait_for(lambda: got.extend(stream.replies()) or got, 5, what="the command on the stream")
        assert [c["id"] for c in got[0]["commands"]] == [11]
        assert values(agent)["trainpatrol_loss"] == 1.5
        assert stream.finish() == []  # the command went out once, on seq 2's reply
        assert stream.summary == {"accepted": 2, "refused": 0}
        stream.close()


def test_a_peer_that_goes_silent_is_let_go_and_one_that_vanishes_mid_line_costs_nothing() -> None:
    agent = Agent(AgentConfig(nvml=False, rank_expire_seconds=0.5, stream_idle_seconds=0.5).load())
    with agent_in_thread(agent.app) as port:
        silent = PushStream("127.0.0.1", port, timeout=5.0)
        silent.open()
        silent.send(body(snap(seq=1)))
        wait_for(lambda: silent.replies() == [] and silent.ended, 5, what="the idle stream to end")
        assert silent.summary == {"accepted": 1, "refused": 0}
        silent.close()
        with socket.create_connection(("127.0.0.1", port)) as raw:  # half a line, then gone
            raw.sendall(b"POST /v1/push/stream HTTP/1.1\r\nHost: x\r\nContent-Type: application/x-ndjson\r\n"
                        b"Transfer-Encoding: chunked\r\n\r\n20\r\n" + b'{"run": "r1", "rank": 0, "seq": ')
        again = PushStream("127.0.0.1", port, timeout=5.0)
        again.open()
        again.send(body(snap(seq=9, loss=0.5)))
        again.finish()
        assert again.summary == {"accepted": 1, "refused": 0}
        assert values(agent)["trainpatrol_loss"] == 0.5 and pushes(agent)["invalid"] == 0.0


def test_an_agent_without_the_stream_is_told_apart() -> None:
    """An agent without the stream route stands in for an older one: 404, which the Patrol falls back on."""
    agent = Agent(AgentConfig(nvml=False).load())
    with agent_in_thread(without_push_stream(agent)) as port, pytest.raises(StreamRefused) as refused:
        PushStream("127.0.0.1", port, timeout=5.0).open()
    assert refused.value.status == 404 and refused.value.detail == "Not Found"


def test_a_burst_of_lines_lets_a_waiting_scrape_in_every_few_lines() -> None:
    import asyncio

    from trainpatrol.agent.auth import EVERY, PushProof
    from trainpatrol.agent.push_stream import PushStream as AgentStream
    from trainpatrol.agent.push_stream import _Stream
    from trainpatrol.agent.stats import AgentStats

    order: list[Any] = []
    handler = AgentStream(accept=lambda s, _, __: order.append(s.rank) or [], stats=AgentStats("agent"),
                          max_line=1_000_000, idle_seconds=60.0)

    async def sent(message: Any) -> None:
        pass

    async def main() -> None:
        stream = _Stream(sent, PushProof(EVERY, b""))
        handler.open_streams = 1
        for rank in range(20):  # a burst: the batch starts at once and takes every line queued meanwhile
            handler._enqueue(stream, json.dumps(snap(rank=rank, world_size=64)).encode(), rank + 1)
        await asyncio.sleep(0)  # the batch starts; a scrape arrives while it runs
        order.append("scrape")
        while handler._handling:
            await asyncio.sleep(0)

    asyncio.run(main())
    assert order == [*range(8), "scrape", *range(8, 20)]


def test_a_batch_starts_once_every_open_stream_has_a_line_or_after_the_batch_time() -> None:
    import asyncio

    from trainpatrol.agent.auth import EVERY, PushProof
    from trainpatrol.agent.push_stream import PushStream as AgentStream
    from trainpatrol.agent.push_stream import _Stream
    from trainpatrol.agent.stats import AgentStats

    handled: list[tuple[int, float]] = []
    handler = AgentStream(accept=lambda s, _, __: handled.append((s.rank, loop.time())) or [],
                          stats=AgentStats("agent"), max_line=1_000_000, idle_seconds=60.0, batch_seconds=0.2)

    async def sent(message: Any) -> None:
        pass

    async def drained() -> None:
        while handler._queue or handler._handling:
            await asyncio.sleep(0.005)

    async def main() -> float:
        streams = [_Stream(sent, PushProof(EVERY, b"")) for _ in range(3)]
        handler.open_streams = 3
        for rank, stream in enumerate(streams):
            handler._enqueue(stream, json.dumps(snap(rank=rank, world_size=64)).encode(), 1)
            assert (handler._flush is not None, handler._handling) == ((True, False) if rank < 2 else (False, True))
        await drained()  # one line from each open stream: the batch started with the last, no timer left
        start = loop.time()
        handler._enqueue(streams[0], json.dumps(snap(rank=0, world_size=64, step=2)).encode(), 2)
        assert handler._flush is not None and not handler._handling  # one line of three streams waits
        await drained()
        return handled[-1][1] - start

    loop = asyncio.new_event_loop()
    try:
        waited = loop.run_until_complete(main())
    finally:
        loop.close()
    assert [rank for rank, _ in handled] == [0, 1, 2, 0]
    assert waited >= 0.2


def test_a_batch_writes_the_lines_out_when_scrapes_come_as_often_as_batches(monkeypatch: pytest.MonkeyPatch) -> None:
    writes: list[bytes] = []
    write = RankCollector.write
    monkeypatch.setattr(RankCollector, "write", lambda self: writes.append(write(self)) or writes[-1])
    _, client = make()
    assert answer(client, body(snap(rank=0)))[-1] == {"accepted": 1, "refused": 0}
    assert writes == []  # no scrape yet: the batch left the writing to the first scrape
    assert b'trainpatrol_loss{rank="0",run="r1"} 2.5' in client.get("/metrics").content
    assert answer(client, body(snap(rank=0, seq=2), delta(seq=3, changed=[[0, 0.75]])))[-1]["accepted"] == 2
    assert len(writes) == 2 and b'trainpatrol_loss{rank="0",run="r1"} 0.75' in writes[-1]  # before a scrape
    assert answer(client, body(snap(rank=0, seq=4)))[-1]["accepted"] == 1
    assert len(writes) == 2  # no scrape since the last batch: left to the next scrape
    assert b'trainpatrol_loss{rank="0",run="r1"} 2.5' in client.get("/metrics").content
    assert len(writes) == 3

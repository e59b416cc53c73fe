"""Any agent can take Alertmanager's webhook and route alerts to the agent hosting the run.

Real agent processes on 127.0.0.1. Agent 1 is the router (peers: agents 2 and 3); run "B" has a rank
on agent 2 only. A spy HTTP server stands for an agent that is not a peer.
"""

from __future__ import annotations

import http.server
import itertools
import json
import socket
import threading
import time
import urllib.error
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families

from loops import scripted_patrol
from rank_client import now_rfc3339
from servers import agent, answer_json, free_port, http_get, http_json, wait_for
from trainpatrol.agent.alerts import Alert, command_id
from trainpatrol.agent.config import AgentConfig
from trainpatrol.agent.peers import FORWARDED_HEADER, PeerForwarder

TOKEN = "router-test-token"
_fingerprints = itertools.count(1)


@dataclass
class Cluster:
    urls: dict[str, str]
    """router, a2, a3 (token); open: a router with no token whose only peer is a2."""
    spy: Spy

    def addr(self, name: str) -> str:
        return self.urls[name].removeprefix("http://")


class Spy(http.server.ThreadingHTTPServer):
    """An agent that is not anyone's peer: claims to host every run and records every request."""

    def __init__(self) -> None:
        self.requests: list[str] = []

        spy = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def _answer(self, status: int, body: Any) -> None:
                spy.requests.append(f"{self.command} {self.path}")
                answer_json(self, status, body)

            def do_GET(self) -> None:
                self._answer(200, {"runs": [{"run": r} for r in ("B", "P", "ghost", "nowhere")]})

            def do_POST(self) -> None:
                self._answer(202, {"accepted": True})

            def log_message(self, *args: Any) -> None:
                pass

        super().__init__(("127.0.0.1", 0), Handler)

    @property
    def addr(self) -> str:
        return f"127.0.0.1:{self.server_address[1]}"


@contextmanager
def spy_server() -> Iterator[Spy]:
    spy = Spy()
    t = threading.Thread(target=spy.serve_forever, daemon=True)
    t.start()
    try:
        yield spy
    finally:
        spy.shutdown()
        spy.server_close()


def alert(run: str, action: str = "pause", instance: str | None = None) -> dict[str, Any]:
    labels = {"alertname": "TrainPatrolNonFiniteLoss", "run": run, "action": action, "severity": "critical"}
    if instance is not None:
        labels["instance"] = instance
    return {"status": "firing", "labels": labels, "annotations": {"summary": "Loss is NaN or Inf."},
            "startsAt": now_rfc3339(), "endsAt": "0001-01-01T00:00:00Z",
            "generatorURL": "http://prom/graph", "fingerprint": f"fp{next(_fingerprints):06d}"}


def payload(*alerts: dict[str, Any]) -> dict[str, Any]:
    return {"version": "4", "groupKey": '{}:{alertname="TrainPatrolNonFiniteLoss"}', "truncatedAlerts": 0,
            "status": "firing", "receiver": "trainpatrol", "groupLabels": {}, "commonLabels": {},
            "commonAnnotations": {}, "externalURL": "http://am", "alerts": list(alerts)}


def post_alert(url: str, a: dict[str, Any], token: str = TOKEN, headers: dict[str, str] | None = None) -> Any:
    import urllib.request

    req = urllib.request.Request(f"{url}/v1/alertmanager", data=json.dumps(payload(a)).encode(), method="POST",
                                 headers={"Content-Type": "application/json", **(headers or {})})
    if token:
        req.add_header("Authorization", f"Bearer {token}")
    with urllib.request.urlopen(req, timeout=5) as r:
        assert r.status == 202
        return json.loads(r.read())


def counters(url: str) -> dict[str, dict[str, float]]:
    """{"forwarded": {outcome: n}, "webhook": {outcome: n}} from the agent's /metrics."""
    out: dict[str, dict[str, float]] = {"forwarded": {}, "webhook": {}}
    for family in text_string_to_metric_families(http_get(url + "/metrics").decode()):
        for key, name in (("forwarded", "trainpatrol_forwarded_alerts"), ("webhook", "trainpatrol_webhook_alerts")):
            if family.name == name:
                out[key] = {s.labels["outcome"]: s.value for s in family.samples if s.name.endswith("_total")}
    return out


def nonzero(values: dict[str, float]) -> dict[str, float]:
    return {k: v for k, v in values.items() if v}


def delta(after: dict[str, float], before: dict[str, float]) -> dict[str, float]:
    return nonzero({k: v - before.get(k, 0.0) for k, v in after.items()})


def push_rank(url: str, run: str, rank: int = 0) -> None:
    http_json(f"{url}/v1/push", {"run": run, "rank": rank, "world_size": 1, "step": 1})  # loopback: no token


def pending(url: str, run: str) -> list[dict[str, Any]]:
    return list(http_json(f"{url}/v1/runs/{run}", token=TOKEN)["pending_commands"])


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    tmp = tmp_path_factory.mktemp("router")
    (tmp / "token").write_text(TOKEN + "\n")
    ports = {name: free_port() for name in ("router", "a2", "a3", "open")}
    peers = f"127.0.0.1:{ports['a2']},127.0.0.1:{ports['a3']}"
    args = {"router": ("--token-file", str(tmp / "token"), "--peers", peers),
            "a2": ("--token-file", str(tmp / "token")), "a3": ("--token-file", str(tmp / "token")),
            "open": ("--peers", f"127.0.0.1:{ports['a2']}")}
    with ExitStack() as stack:
        urls = {name: stack.enter_context(agent(tmp, "--no-nvml", *args[name], port=port))
                for name, port in ports.items()}
        push_rank(urls["a2"], "B")  # before any run lookup, which the router caches for a few seconds
        spy = stack.enter_context(spy_server())
        yield Cluster(urls, spy)
        assert spy.requests == [], "a server that is not a peer was contacted"


def test_forwarded_by_instance_label_pauses_the_rank(cluster: Cluster, tmp_path: Path) -> None:
    a2 = cluster.urls["a2"]
    patrol = scripted_patrol(tmp_path, a2, run="P", push_interval_seconds=0.1, pause_poll_seconds=0.05)
    stop = threading.Event()

    def loop() -> None:
        while not stop.is_set():
            patrol.boundary()
            patrol.step(torch.tensor(1.0), grad_norm=torch.tensor(0.5))
            time.sleep(0.01)

    t = threading.Thread(target=loop, daemon=True)
    t.start()
    try:
        wait_for(lambda: http_json(f"{a2}/v1/runs/P", token=TOKEN)["ranks"], 10, what="the rank's first push")
        before = {name: counters(url) for name, url in cluster.urls.items()}
        reply = post_alert(cluster.urls["router"], alert("P", instance=cluster.addr("a2")))
        assert [r["outcome"] for r in reply["results"]] == ["forwarded"]
        wait_for(lambda: patrol.state == "paused", 20, what="the rank pauses")
        # the paused rank's report reaches a2 with its next push, handled in a2's next batch
        wait_for(lambda: (http_json(f"{a2}/v1/runs/P", token=TOKEN)["last_action"] or {}).get("action") == "pause", 5,
                 what="a2 hears the rank paused")
        after = {name: counters(url) for name, url in cluster.urls.items()}
        assert delta(after["router"]["forwarded"], before["router"]["forwarded"]) == {"ok": 1}
        assert delta(after["router"]["webhook"], before["router"]["webhook"]) == {"forwarded": 1}
        assert delta(after["a2"]["webhook"], before["a2"]["webhook"]) == {"act": 1}
        assert delta(after["a3"]["webhook"], before["a3"]["webhook"]) == {}  # instance named a2 alone
        assert delta(after["a2"]["forwarded"], before["a2"]["forwarded"]) == {}
        http_json(f"{a2}/v1/runs/P/actions", {"action": "resume"}, token=TOKEN)
        wait_for(lambda: patrol.state == "running", 20, what="resumed")
    finally:
        stop.set()
        if patrol.state == "paused":
            http_json(f"{a2}/v1/runs/P/actions", {"action": "resume"}, token=TOKEN)
        t.join(20)
        patrol.close()


def test_forwarded_by_run_lookup_never_to_a_stranger(cluster: Cluster) -> None:
    """The instance label names a server that is not a peer: the router asks its peers instead."""
    a2, a3 = cluster.urls["a2"], cluster.urls["a3"]
    push_rank(a2, "B")  # live: pushed within the liveness TTL
    before = {name: counters(url) for name, url in cluster.urls.items()}
    a = alert("B", instance=cluster.spy.addr)
    reply = post_alert(cluster.urls["router"], a)
    assert [r["outcome"] for r in reply["results"]] == ["forwarded"]
    wait_for(lambda: pending(a2, "B"), 10, what="command on agent 2")
    (command,) = pending(a2, "B")
    assert (command["id"], command["action"], command["source"]) == (
        command_id(Alert.model_validate(a)), "pause", "alertmanager:TrainPatrolNonFiniteLoss")
    assert command["alert"]["labels"]["instance"] == cluster.spy.addr
    after = {name: counters(url) for name, url in cluster.urls.items()}
    assert delta(after["router"]["forwarded"], before["router"]["forwarded"]) == {"ok": 1}
    assert delta(after["a2"]["webhook"], before["a2"]["webhook"]) == {"act": 1}
    assert delta(after["a3"]["webhook"], before["a3"]["webhook"]) == {}
    assert http_json(a3 + "/v1/runs", token=TOKEN) == {"runs": []}
    assert cluster.spy.requests == []


def test_forwarded_to_the_peer_whose_ranks_of_the_run_closed_queues_nothing(cluster: Cluster) -> None:
    """The router forwards as before; the peer hosts the run but no rank of it is live: it answers
    2xx (the router's forward succeeded) with the outcome no_live_rank, and queues nothing."""
    a2 = cluster.urls["a2"]
    http_json(f"{a2}/v1/push", {"run": "C", "rank": 0, "world_size": 1, "step": 9, "state": "closed"})
    before = {name: counters(url) for name, url in cluster.urls.items()}
    reply = post_alert(cluster.urls["router"], alert("C", instance=cluster.addr("a2")))
    assert [r["outcome"] for r in reply["results"]] == ["forwarded"]
    wait_for(lambda: delta(counters(a2)["webhook"], before["a2"]["webhook"]), 10, what="a2 handles the alert")
    after = {name: counters(url) for name, url in cluster.urls.items()}
    assert delta(after["router"]["forwarded"], before["router"]["forwarded"]) == {"ok": 1}
    assert delta(after["a2"]["webhook"], before["a2"]["webhook"]) == {"no_live_rank": 1}
    assert pending(a2, "C") == []


def test_forward_without_the_token_is_refused(cluster: Cluster) -> None:
    """A router with no token forwards to a2, which has one: a2 refuses, nothing is queued, and the
    router answers 503 so that Alertmanager re-sends the alert."""
    a2 = cluster.urls["a2"]
    push_rank(a2, "T")
    before_a2, before_open = counters(a2), counters(cluster.urls["open"])
    with pytest.raises(urllib.error.HTTPError) as refused:
        post_alert(cluster.urls["open"], alert("T", instance=cluster.addr("a2")), token="")
    assert refused.value.code == 503
    wait_for(lambda: delta(counters(cluster.urls["open"])["forwarded"], before_open["forwarded"]), 10,
             what="the forward's outcome")
    assert delta(counters(cluster.urls["open"])["forwarded"], before_open["forwarded"]) == {"failed": 1}
    assert delta(counters(a2)["webhook"], before_a2["webhook"]) == {}
    assert pending(a2, "T") == []


def test_run_hosted_nowhere_is_counted_no_peer(cluster: Cluster) -> None:
    before = {name: counters(url) for name, url in cluster.urls.items()}
    reply = post_alert(cluster.urls["router"], alert("nowhere"))
    assert [r["outcome"] for r in reply["results"]] == ["no_peer"]
    wait_for(lambda: delta(counters(cluster.urls["router"])["forwarded"], before["router"]["forwarded"]), 10,
             what="the router's outcome")
    after = {name: counters(url) for name, url in cluster.urls.items()}
    assert delta(after["router"]["forwarded"], before["router"]["forwarded"]) == {"no_peer": 1}
    for peer in ("a2", "a3"):
        assert delta(after[peer]["webhook"], before[peer]["webhook"]) == {}


def test_two_agents_that_list_each_other_never_ping_pong(tmp_path: Path) -> None:
    (tmp_path / "token").write_text(TOKEN)
    px, py = free_port(), free_port()
    with agent(tmp_path, "--no-nvml", "--token-file", str(tmp_path / "token"), "--peers", f"127.0.0.1:{py}",
               port=px) as x, \
         agent(tmp_path, "--no-nvml", "--token-file", str(tmp_path / "token"), "--peers", f"127.0.0.1:{px}",
               port=py) as y:
        # an unknown run, no instance: x asks y, y does not host it either: no_peer, y hears nothing
        post_alert(x, alert("ghost"))
        # an unknown run aimed at the other agent, both ways: one hop each, then applied locally
        post_alert(x, alert("ghost", instance=f"127.0.0.1:{py}"))
        post_alert(y, alert("ghost", instance=f"127.0.0.1:{px}"))
        # a payload that says it was forwarded already is handled here, never sent on; no rank of
        # "ghost" is live on either agent, so nothing is queued for it (outcome no_live_rank)
        post_alert(x, alert("ghost", instance=f"127.0.0.1:{py}"), headers={FORWARDED_HEADER: "1"})
        expected = {
            x: {"forwarded": {"no_peer": 1, "ok": 1}, "webhook": {"forwarded": 1, "no_peer": 1, "no_live_rank": 2}},
            y: {"forwarded": {"ok": 1}, "webhook": {"forwarded": 1, "no_live_rank": 1}},
        }

        def settled() -> bool:
            return all({k: nonzero(v) for k, v in counters(u).items()} == e for u, e in expected.items())

        wait_for(settled, 10, what=f"counts {expected}")
        time.sleep(2.0)  # nothing keeps bouncing: the counts stay where they are
        assert settled(), {u: counters(u) for u in (x, y)}
        queued = "trainpatrol_control_commands_total{"
        for url in (x, y):
            assert [ln for ln in http_get(url + "/metrics").decode().splitlines() if ln.startswith(queued)] == []


def test_dns_peers_are_the_names_addresses_on_the_agents_port_less_the_agent_itself(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """``localhost`` resolves for real: only loopback, which is this agent. A headless Service with
    pod addresses needs a cluster, so its answer is given to getaddrinfo: two peers (one IPv6) and
    this host's own address, as a pod's Service lists the pod itself."""
    own = socket.gethostbyname(socket.gethostname())
    assert PeerForwarder(AgentConfig(port=9400, peers_dns="localhost"), lambda _: None).peers() == []
    real = socket.getaddrinfo

    def resolve(host: str, port: int, *args: Any, **kwargs: Any) -> list[Any]:
        if host == "trainpatrol-peers.jobs.svc":
            return [(socket.AF_INET, socket.SOCK_STREAM, 6, "", (address, port)) for address in ("10.0.3.7", own)] + \
                   [(socket.AF_INET6, socket.SOCK_STREAM, 6, "", ("fd00::3:8", port, 0, 0))]
        if host == "gone.jobs.svc":
            raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")
        return real(host, port, *args, **kwargs)

    monkeypatch.setattr(socket, "getaddrinfo", resolve)
    router = PeerForwarder(AgentConfig(host="0.0.0.0", port=9400, peers=("10.0.3.7:9400", "10.0.9.1:9500"),
                                peers_dns="trainpatrol-peers.jobs.svc"), lambda _: None)
    assert router.peers() == ["10.0.3.7:9400", "10.0.9.1:9500", "[fd00::3:8]:9400"]
    gone = PeerForwarder(AgentConfig(port=9400, peers=("10.0.9.1:9500",), peers_dns="gone.jobs.svc"), lambda _: None)
    assert gone.peers() == ["10.0.9.1:9500"]  # the configured peers stand while the name does not resolve

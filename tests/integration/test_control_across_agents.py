"""A pause sent to the router reaches a run whose 8 ranks push to 4 agents, and every rank pauses at one step.

Real processes on 127.0.0.1: four ``trainpatrol agent``s, a ``trainpatrol agent --mode router`` given them as
its static peers (``--peers``; in Kubernetes the router finds them through the headless Service instead,
``--peers-dns``), and an 8-rank gloo DDP job on CPU (tests/control/ddp_worker.py: a tiny model trained
through ``patrol.boundary()``; 8 processes forked from one that imported torch, see ``LAUNCHER``), ranks 2k
and 2k+1 pushing to agent k. The pause goes to the router as
Alertmanager's webhook sends it (payload version 4, an alert with ``action: pause`` and the run, no
``instance``): the router asks its peers which host the run and hands the alert to all four. Every agent's
/v1/runs/fleet must show its two ranks paused, all at one step; the test prints how long that took from the
request. A resume goes to one agent, as an operator sends it (the router hosts no ranks); then a stop,
through the router again, ends the run with every rank's exit code 86 and the same step in every record.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import pytest

from rank_client import now_rfc3339
from servers import REPO, free_port, http_get, http_json, process, python_env, wait_for
from trainpatrol import STOP_EXIT_CODE

pytestmark = pytest.mark.timeout(180)

AGENTS = 4
WORLD = 8
RUN = "fleet"
WORKER = REPO / "tests" / "control" / "ddp_worker.py"


def start_agents(stack: ExitStack, tmp: Path) -> tuple[list[str], str]:
    """The four agents and the router, started together; returns their URLs once all answer /healthz."""
    ports = [free_port() for _ in range(AGENTS + 1)]
    peers = ",".join(f"127.0.0.1:{p}" for p in ports[:AGENTS])
    for i, port in enumerate(ports):
        router = ("--mode", "router", "--peers", peers) if i == AGENTS else ()
        cmd = [sys.executable, "-m", "trainpatrol", "agent", "--no-nvml", "--host", "127.0.0.1", "--port", str(port),
               "--log-level", "warning", *router]
        stack.enter_context(process(cmd, tmp / f"agent-{port}.log", env=python_env()))
    urls = [f"http://127.0.0.1:{p}" for p in ports]
    for url in urls:
        wait_for(lambda u=url: http_get(u + "/healthz"), 30, what=f"{url} up")
    assert json.loads(http_get(urls[-1] + "/healthz"))["mode"] == "router"
    return urls[:AGENTS], urls[-1]


LAUNCHER = """
import os, sys, json, traceback
import torch, torch._dynamo  # torch, and what DDP imports when the first one is made: once here, not in each rank
sys.path.insert(0, os.environ["WORKER_DIR"])
import ddp_worker

out, agents = os.environ["OUT"], os.environ["AGENTS"].split(",")
children = {}
for rank in range(int(os.environ["WORLD_SIZE"])):
    pid = os.fork()
    if pid == 0:
        os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank % 2), AGENT_URL=agents[rank // 2])
        log = os.open(f"{out}/worker-{rank}.log", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(log, 1)
        os.dup2(log, 2)
        code = 1
        try:
            code = ddp_worker.main()
        except BaseException:
            traceback.print_exc()
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)
    children[pid] = rank
codes = {}
while children:
    pid, status = os.wait()
    codes[children.pop(pid)] = os.waitstatus_to_exitcode(status)
with open(f"{out}/codes.json", "w") as f:
    json.dump([codes[r] for r in sorted(codes)], f)
"""
"""Forks the ranks from one process that imported torch: each of 8 processes importing it took about 20 s
of the 2 cores (and DDP's first use another 7 s); forked, they start at once. Each rank is still a process
of its own with its own gloo process group, as under torchrun."""


def launch(tmp: Path, agents: list[str]) -> subprocess.Popen[bytes]:
    env = python_env(WORLD_SIZE=str(WORLD), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), OUT=str(tmp),
                     RUN=RUN, AGENTS=",".join(agents), WORKER_DIR=str(WORKER.parent),
                     OMP_NUM_THREADS="1")  # 8 ranks on a few cores: one thread each
    with open(tmp / "launcher.log", "wb") as log:
        return subprocess.Popen([sys.executable, "-c", LAUNCHER], env=env, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)


def ranks(agents: list[str]) -> list[dict[str, Any]]:
    """Every rank as the agents show it (an agent not yet hosting the run shows none)."""
    out = []
    for url in agents:
        with contextlib.suppress(Exception):
            out += http_json(f"{url}/v1/runs/{RUN}")["ranks"]
    return out


def all_ranks(agents: list[str], state: str) -> bool:
    shown = ranks(agents)
    return len(shown) == WORLD and all(r["state"] == state for r in shown)


def min_step(agents: list[str]) -> int:
    return min((r["step"] for r in ranks(agents)), default=-1)


def webhook(router: str, action: str, fingerprint: str) -> dict[str, Any]:
    """What Alertmanager posts for one firing alert of the run that asks for ``action``."""
    alert = {"status": "firing", "startsAt": now_rfc3339(), "endsAt": "0001-01-01T00:00:00Z",
             "labels": {"alertname": "TrainPatrolOperatorAction", "run": RUN, "action": action,
                        "severity": "critical"},
             "annotations": {"summary": f"{action} the whole run"}, "generatorURL": "http://prometheus/graph",
             "fingerprint": fingerprint}
    body = {"version": "4", "groupKey": '{}:{action=~".+"}', "truncatedAlerts": 0, "status": "firing",
            "receiver": "trainpatrol", "groupLabels": {}, "commonLabels": alert["labels"],
            "commonAnnotations": alert["annotations"], "externalURL": "http://alertmanager", "alerts": [alert]}
    return dict(http_json(f"{router}/v1/alertmanager", body, timeout=10))


def test_a_pause_through_the_router_pauses_eight_ranks_on_four_agents_at_one_step(tmp_path: Path) -> None:
    began = time.monotonic()
    with ExitStack() as stack:
        agents, router = start_agents(stack, tmp_path)
        launcher = launch(tmp_path, agents)

        def kill_left() -> None:  # the launcher and its ranks: a session of their own
            if launcher.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(launcher.pid, signal.SIGKILL)
                launcher.wait(10)

        stack.callback(kill_left)
        wait_for(lambda: all_ranks(agents, "running") and min_step(agents) > 3, 90, interval=0.2,
                 what=f"{WORLD} ranks training on {AGENTS} agents")
        assert [len(http_json(f"{u}/v1/runs/{RUN}")["ranks"]) for u in agents] == [2] * AGENTS
        up = time.monotonic()

        sent_wall, sent = time.time(), time.monotonic()
        reply = webhook(router, "pause", "fleet-pause")
        assert [r["outcome"] for r in reply["results"]] == ["forwarded"], reply
        wait_for(lambda: all_ranks(agents, "paused"), 30, interval=0.02, what=f"all {WORLD} ranks paused")
        all_paused = time.monotonic() - sent
        steps = {r["step"] for r in ranks(agents)}
        assert len(steps) == 1, f"ranks paused at different steps: {ranks(agents)}"
        paused_at = steps.pop()
        for url in agents:  # the router handed the alert to every agent hosting the run
            alerts = http_json(f"{url}/v1/alerts")["alerts"]
            outcomes = [a["outcome"] for a in alerts if a["fingerprint"] == "fleet-pause"]
            assert outcomes == ["act"], (url, outcomes)

        http_json(f"{agents[-1]}/v1/runs/{RUN}/actions", {"action": "resume", "reason": "test"})
        wait_for(lambda: all_ranks(agents, "running") and min_step(agents) > paused_at + 2, 30, interval=0.05,
                 what="all ranks resumed and training")
        assert [r["outcome"] for r in webhook(router, "stop", "fleet-stop")["results"]] == ["forwarded"]
        launcher.wait(timeout=60)
        logs = "\n".join((tmp_path / name).read_text()[-1500:]
                         for name in ["launcher.log", *(f"worker-{r}.log" for r in range(WORLD))])
        assert json.loads((tmp_path / "codes.json").read_text()) == [STOP_EXIT_CODE] * WORLD, logs

    records = [json.loads((tmp_path / f"rank-{r}.json").read_text()) for r in range(WORLD)]
    pauses = [[a for a in rec["actions"] if a["action"] == "pause"] for rec in records]
    assert all(len(p) == 1 and p[0]["outcome"] == "ok" and p[0]["step"] == paused_at for p in pauses), pauses
    assert len({p[0]["id"] for p in pauses}) == 1  # one command, heard through four agents
    per_rank = [{(a["id"], a["action"]): a["step"] for a in rec["actions"]} for rec in records]
    assert all(p == per_rank[0] for p in per_rank), "ranks disagree on the step of some action"
    assert [a["action"] for a in records[0]["actions"]] == ["pause", "resume", "stop"]
    assert len({rec["steps"] for rec in records}) == 1
    last_record = max(p[0]["time"] for p in pauses) - sent_wall
    print(f"\n{WORLD} ranks on {AGENTS} agents: up {up - began:.1f} s after the start; pause through the router: "
          f"every agent shows every rank paused at step {paused_at} {all_paused:.2f} s after the request "
          f"(the last rank recorded its pause {last_record:.2f} s after it); "
          f"whole test {time.monotonic() - began:.1f} s")

"""A real evidence bundle, made once per session: a two-rank CPU run (gloo) with Patrol, a NaN loss
injected on rank 1 at step 30, a real agent (NVML readings from the recorded H200 fixture, the only
fake: it stands in for the GPU), the local guard pausing both ranks, and the test resuming the run
through the agent as an operator would.
"""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path

HERE = Path(__file__).resolve().parent
FIXTURE = HERE.parent / "nvml_fake" / "nvml_h200.json"
RUN = "report-test"
NAN_AT, NAN_RANK, WORLD = 30, 1, 2


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _get(url: str) -> dict[str, object]:
    with urllib.request.urlopen(url, timeout=2) as r:
        return dict(json.loads(r.read()))


def _wait(what: str, ok: Callable[[], bool], timeout: float, procs: list[subprocess.Popen[bytes]]) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if ok():
                return
        except OSError:
            pass
        if any(p.poll() not in (None, 0) for p in procs):
            break
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}")


def make_real_bundle(work: Path) -> Path:
    """Run the job under ``work`` and return its pause bundle."""
    agent_port = _free_port()
    url = f"http://127.0.0.1:{agent_port}"
    procs: list[subprocess.Popen[bytes]] = []
    logs = []
    try:
        log = open(work / "agent.log", "wb")  # noqa: SIM115
        logs.append(log)
        procs.append(subprocess.Popen(
            [sys.executable, "-m", "trainpatrol", "agent", "--host", "127.0.0.1", "--port", str(agent_port),
             "--nvml-fake", str(FIXTURE), "--nvml-interval", "0.5"], stdout=log, stderr=subprocess.STDOUT))
        _wait("the agent", lambda: _get(url + "/healthz") is not None, 30, procs)
        dist_port = _free_port()
        for rank in range(WORLD):
            log = open(work / f"rank{rank}.log", "wb")  # noqa: SIM115
            logs.append(log)
            procs.append(subprocess.Popen(
                [sys.executable, str(HERE / "train_ranks.py"), "--rank", str(rank), "--world-size", str(WORLD),
                 "--port", str(dist_port), "--workdir", str(work), "--agent-url", url, "--nan-at", str(NAN_AT),
                 "--nan-rank", str(NAN_RANK)], stdout=log, stderr=subprocess.STDOUT))
        _wait("the run to pause", lambda: _get(f"{url}/v1/runs/{RUN}").get("state") == "paused", 120, procs)
        body = json.dumps({"action": "resume", "reason": "resumed by the report test"}).encode()
        req = urllib.request.Request(f"{url}/v1/runs/{RUN}/actions", data=body, method="POST",
                                     headers={"Content-Type": "application/json"})
        urllib.request.urlopen(req, timeout=5).read()
        for p in procs[1:]:
            assert p.wait(timeout=120) == 0, "a rank failed"
    except (AssertionError, subprocess.TimeoutExpired) as exc:
        tails = "".join(f"\n--- {f.name}\n{f.read_text(errors='replace')[-2000:]}" for f in sorted(work.glob("*.log")))
        raise AssertionError(f"{exc}{tails}") from None
    finally:
        for p in procs:
            if p.poll() is None:
                p.terminate()
                p.wait(timeout=10)
        for log in logs:
            log.close()
    bundles = sorted((work / "evidence").glob("*-pause"))
    assert len(bundles) == 1, sorted((work / "evidence").glob("*"))
    return bundles[0]


def heard_guard(bundle: Path) -> str:
    """The guard whose request the ranks agreed on, from the part of the rank that heard it itself.

    Each rank's extra.json holds its view of the request: the guard's own record on the rank that made
    it, "agreed with another rank" on the others. Which guard wins (the loss's on the NaN rank, or the
    gradient norm's on another rank, DDP spreading the NaN) varies from run to run.
    """
    sources = {json.loads((part / "extra.json").read_text())["trigger"]["source"]
               for part in sorted(bundle.glob("rank-*"))}
    heard = sources - {"agreed with another rank"}
    assert len(heard) == 1 and next(iter(heard)).startswith("guard:"), sources
    return next(iter(heard)).removeprefix("guard:")

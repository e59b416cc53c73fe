"""/metrics under the loads a node agent sees: a real agent with 8 fake H200s whose slow NVML calls take
as long as on the real GPU, ranks pushing once a second, and a scraper asking for /metrics as
Prometheus does. Reports scrape latency (p50/p99), the agent's CPU share of one core and its RSS, as JSON:

    python bench/scrape.py [--quick] [--load node|fleet|RANKSxSECONDS,...] [--seconds 60]

The loads (DESIGN.md): ``node`` is an 8-GPU node, 8 ranks scraped every 15 s (target: at most 1 % of
a core); ``fleet`` is 64 ranks scraped every 5 s, the fast alert profile's pace (target: at most 5 %
of a core and a p99 of at most 25 ms); RSS at most 150 MB in both.

The rank payload is a real Patrol snapshot (scripted steps, an H200-sized allocator reading), sent
as each rank with world_size 64. Every push moves what a second of training moves (counters, loss,
grad norm, loader wait, allocator readings, the step histogram). Pushers run in a process of their
own and push as Patrol does: one ``POST /v1/push`` of the whole snapshot a second, on a kept-alive
connection. The scraper asks with Prometheus' own Accept header (OpenMetrics first). The agent's
CPU share covers everything it does: pushes, scrapes and NVML sampling. To see where it goes,
attach ``py-spy record -p <agent pid>`` during a run.

``--hostile`` runs a bounded hostile load beside the honest ranks, from a process of its own
(``hostile_load``): new runs and new ranks until the agent's bounds refuse them, 0.9 MB pushes and
0.25 MB ones of 1,000 samples,
webhooks for runs it does not host (some with half a megabyte of annotations), requests with a
foreign Host header, 100 connections that never send a request, reopened as the agent lets them
go, and 300 connections that trickle one header byte every 0.25 s and never end a request, reopened
when closed (``trickle.Trickle``; with ``max_connections`` 256 the agent evicts about 100 of them a
second). It reports what the agent answered, by kind and status, and how many trickling connections
it opened.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import http.client
import json
import multiprocessing
import os
import platform
import random
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import psutil

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "exporter"))
sys.path.insert(0, str(REPO / "bench"))  # trickle.py, also in the hostile load's own process

WORLD_SIZE = 64
DELAYS = {"nvmlDeviceGetPcieThroughput": 0.0208, "nvmlDeviceGetTotalEnergyConsumption": 0.003}
LOADS = {"node": (8, 15.0), "fleet": (64, 5.0)}
"""Ranks, and seconds between scrapes."""
TARGETS = {"cpu_core_share": {"node": 0.01, "fleet": 0.05}, "p99_ms": {"fleet": 25.0}, "rss_mb": 150.0}
PROMETHEUS_ACCEPT = ("application/openmetrics-text;version=1.0.0,application/openmetrics-text;version=0.0.1;q=0.75,"
                     "text/plain;version=0.0.4;q=0.5,*/*;q=0.1")
H200_BYTES = 150_754_820_096


def patrol_snapshot() -> dict[str, Any]:
    """One rank's push payload after 200 scripted steps, with allocator readings as on a GPU."""
    import logging

    import torch

    from trainpatrol import Patrol, PatrolConfig
    from trainpatrol.probe.memory import MemoryReading

    logging.getLogger("trainpatrol").setLevel(logging.ERROR)  # its publisher has no agent to reach

    def memory() -> MemoryReading:
        return MemoryReading(allocated=61e9, reserved=72e9, active=60e9, inactive_split=2.5e9,
                             peak_allocated=70e9, alloc_retries=0, ooms=0, capacity=H200_BYTES)

    with tempfile.TemporaryDirectory() as tmp:
        cfg = PatrolConfig(run="bench", agent_url="http://127.0.0.1:9", embedded_agent=False,
                           checkpoint_dir=f"{tmp}/ckpt", evidence_dir=f"{tmp}/evidence",
                           push_interval_seconds=3600.0, memory_reader=memory, memory_interval_seconds=0.0)
        patrol = Patrol(config=cfg, device="cpu")
        for i in range(200):
            patrol.boundary()
            patrol.step(torch.tensor(3.0 - 0.005 * i), grad_norm=torch.tensor(0.8 + 0.001 * i), batch_size=32,
                        tokens=32 * 1024, learning_rates=[3e-4])
        snap = patrol._report.snapshot()
        patrol._publisher.stop(final_push=False)
    snap.update(world_size=WORLD_SIZE, host="bench-node", gpu_uuid="GPU-00000000-0000-0000-0000-000000000000")
    return snap


MOVING_TOTALS = {"trainpatrol_step_total", "trainpatrol_micro_step_total", "trainpatrol_samples_total",
                 "trainpatrol_tokens_total", "trainpatrol_loader_wait_seconds_total"}
MOVING_GAUGES = {"trainpatrol_loss", "trainpatrol_loss_window_mean", "trainpatrol_loss_window_max",
                 "trainpatrol_grad_norm", "trainpatrol_grad_norm_window_max", "trainpatrol_loader_wait_ratio",
                 "trainpatrol_cuda_memory_allocated_bytes", "trainpatrol_cuda_memory_active_bytes",
                 "trainpatrol_cuda_memory_inactive_split_bytes", "trainpatrol_cuda_memory_fragmentation_ratio",
                 "trainpatrol_cuda_memory_used_ratio", "trainpatrol_probe_overhead_ratio"}


def advance(snap: dict[str, Any], base: dict[str, Any], steps: int, rng: random.Random) -> None:
    """What a second of training changes in a snapshot: totals grow, readings wander."""
    for s, b in zip(snap["samples"], base["samples"], strict=True):
        if s["name"] in MOVING_TOTALS:
            s["value"] += steps * (1.0 if s["name"].endswith("step_total") else b["value"] / 200 + rng.random())
        elif s["name"] in MOVING_GAUGES:
            s["value"] = b["value"] * (0.9 + 0.2 * rng.random())
    h = snap["histogram"]
    h["counts"] = [c + steps for c in h["counts"]]
    h["sum"] += steps * 0.012 * (0.9 + 0.2 * rng.random())


def push_ranks(port: int, template: dict[str, Any], ranks: int, stop: Any, counts: Any,
               gpus: list[str] | None = None) -> None:
    """Every rank pushes once a second on Patrol's schedule (whole seconds of the wall clock). Lines
    are made ready before their instant and sent back to back at it, as 64 rank processes would send
    in parallel: threads of one process that each encode at the instant queue on the GIL and reach
    the agent spread over tens of milliseconds."""
    from trainpatrol.probe.publisher import next_push_delay

    sims = [RankSim(port, template, rank, (gpus or [])[rank % len(gpus)] if gpus else "") for rank in range(ranks)]
    while not stop.is_set():
        at = time.time() + next_push_delay(1.0, time.time())
        ready = [sim.prepare(at) for sim in sims]
        stop.wait(max(0.0, at - time.time()))
        results = [sim.send(body) for sim, body in zip(sims, ready, strict=True)]
        with counts.get_lock():
            counts[0] += sum(results)
            counts[1] += len(results) - sum(results)
    for sim in sims:
        sim.close()


RUN_KEY = "bench-run-key"
"""Every fake rank proves it, as a Patrol's ranks prove their run's key (probe.run_key)."""
RUN_KEY_HEADER = "X-Trainpatrol-Run-Key"


class RankSim:
    """One rank's pushes: its snapshot moving as training would, one request each on a kept-alive connection."""

    def __init__(self, port: int, template: dict[str, Any], rank: int, gpu_uuid: str = "") -> None:
        snap = copy.deepcopy(template)
        snap.update(rank=rank, local_rank=rank % 8, pid=100_000 + rank, instance=f"{rank:016x}")
        if gpu_uuid:  # one of the agent's (fake) GPUs: the agent refuses a GPU its node does not have
            snap["gpu_uuid"] = gpu_uuid
        for s in snap["samples"]:
            if "local_rank" in s["labels"]:
                s["labels"]["local_rank"] = str(rank % 8)
        self.snap, self.base, self.rng = snap, copy.deepcopy(snap), random.Random(rank)
        self.port = port
        self.seq, self.step = 0, int(snap["step"])
        self.conn: http.client.HTTPConnection | None = None

    def prepare(self, at: float) -> bytes:
        """The next push's body, taken at ``at``."""
        self.seq, self.step = self.seq + 1, self.step + 30
        self.snap.update(seq=self.seq, step=self.step, time=at)
        advance(self.snap, self.base, 30, self.rng)
        return json.dumps(self.snap).encode()

    def send(self, body: bytes) -> bool:
        try:
            self.conn = self.conn or http.client.HTTPConnection("127.0.0.1", self.port, timeout=5.0)
            self.conn.request("POST", "/v1/push", body=body,
                              headers={"Content-Type": "application/json", RUN_KEY_HEADER: RUN_KEY})
            resp = self.conn.getresponse()
            resp.read()
            return resp.status == 200
        except (OSError, http.client.HTTPException):
            self.close()
            return False

    def close(self) -> None:
        if self.conn is not None:
            self.conn.close()
        self.conn = None


def late_run(port: int, template: dict[str, Any], gpus: list[str], stop: Any, answers: dict[str, int]) -> None:
    """A run that starts during the flood and pushes once a second with its key; counts the answers."""
    sim = RankSim(port, dict(template, run="late-honest"), 0, gpus[0] if gpus else "")
    while not stop.is_set():
        status = "200" if sim.send(sim.prepare(time.time())) else "refused"
        answers[status] = answers.get(status, 0) + 1
        stop.wait(1.0)
    sim.close()


HOSTILE_IDLE_CONNECTIONS = 100
HOSTILE_TRICKLE_CONNECTIONS, HOSTILE_TRICKLE_EVERY = 300, 0.25


def hostile_load(port: int, template: dict[str, Any], stop: Any, report: Any, gpus: list[str] | None = None) -> None:
    """About 10 hostile requests a second and 100 silent connections, until ``stop``; puts the
    statuses the agent answered, by kind, on ``report``."""
    from collections import Counter

    if gpus:  # a GPU of the agent's node: the flood is refused by the bounds, not by the GPU check
        template = dict(template, gpu_uuid=gpus[0])
    answers: dict[str, Counter[str]] = {}
    slowest: dict[str, float] = {}
    idle: list[socket.socket] = []
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=5.0)
    big = copy.deepcopy(template)
    big["samples"] = [dict(s, labels=dict(s["labels"])) for s in template["samples"]] * 56  # about 0.9 MB
    big_body = json.dumps(big).encode()
    many = dict(big, samples=big["samples"][: len(template["samples"]) * 14])  # about 0.25 MB: read and parsed
    many_body = json.dumps(many).encode()
    note = "x" * 500_000

    def send(kind: str, method: str, path: str, body: Any = None, host: str = "") -> None:
        nonlocal conn
        data = body if isinstance(body, bytes) else json.dumps(body).encode() if body is not None else None
        headers = {"Content-Type": "application/json", **({"Host": host} if host else {})}
        start = time.perf_counter()
        try:
            conn.request(method, path, body=data, headers=headers)
            resp = conn.getresponse()
            resp.read()
            status = str(resp.status)
            if resp.getheader("connection", "").lower() == "close":
                conn.close()
        except (OSError, http.client.HTTPException) as exc:
            status = type(exc).__name__
            conn.close()
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=5.0)
        answers.setdefault(kind, Counter())[status] += 1
        slowest[kind] = max(slowest.get(kind, 0.0), round((time.perf_counter() - start) * 1000, 1))

    def alert(run: str, n: int, annotation: str) -> dict[str, Any]:
        return {"version": "4", "status": "firing", "alerts": [{
            "status": "firing", "labels": {"alertname": "TrainPatrolNonFiniteLoss", "run": run, "action": "stop"},
            "annotations": {"summary": annotation}, "startsAt": f"2026-12-01T00:00:{n % 60:02d}Z",
            "fingerprint": f"{n:016x}"}]}

    from trickle import Trickle

    trickle = Trickle(port, HOSTILE_TRICKLE_CONNECTIONS, HOSTILE_TRICKLE_EVERY)
    flood = trickle.running()
    flood.__enter__()
    n = 0
    while not stop.is_set():
        n += 1
        started = time.monotonic()
        send("new_run", "POST", "/v1/push", dict(template, run=f"evil-{n}", rank=0, world_size=1))
        for i in range(2):
            send("new_rank", "POST", "/v1/push", dict(template, run="evil-ranks", rank=2 * n + i,
                                                      world_size=1_000_000))
        if n % 2 == 0:
            send("big_push", "POST", "/v1/push", big_body)
        else:
            send("many_samples_push", "POST", "/v1/push", many_body)
        send("webhook_unknown_run", "POST", "/v1/alertmanager", alert(f"gone-{n}", n, "Loss is NaN."))
        send("webhook_big_annotation", "POST", "/v1/alertmanager", alert(f"gone-{n}", n, note))
        for _ in range(4):
            send("foreign_host", "GET", "/v1/runs", host="attacker.example")
        idle = [s for s in idle if _still_open(s)]
        while len(idle) < HOSTILE_IDLE_CONNECTIONS:
            try:
                idle.append(socket.create_connection(("127.0.0.1", port), timeout=1.0))
            except OSError:
                answers.setdefault("idle_connection", Counter())["refused"] += 1
                break
        stop.wait(max(0.0, 1.0 - (time.monotonic() - started)))
    for s in idle:
        s.close()
    conn.close()
    flood.__exit__(None, None, None)
    report.put({**{kind: {**dict(sorted(c.items())), "slowest_ms": slowest.get(kind)}
                   for kind, c in sorted(answers.items())},
                "trickle_connections_opened": trickle.opened})


def _still_open(s: socket.socket) -> bool:
    """False once the agent closed it (or reset it); closes it then."""
    try:
        s.setblocking(False)
        closed = s.recv(1) == b""
    except BlockingIOError:
        return True
    except OSError:
        closed = True
    if closed:
        s.close()
    return not closed


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def get(conn: http.client.HTTPConnection, path: str, headers: dict[str, str] | None = None) -> bytes:
    conn.request("GET", path, headers=headers or {})
    resp = conn.getresponse()
    body = resp.read()
    if resp.status != 200:
        raise RuntimeError(f"GET {path} answered {resp.status}: {body[:200]!r}")
    return body


def get_once(port: int, path: str) -> bytes:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=5.0)
    try:
        return get(conn, path)
    finally:
        conn.close()


def wait_until(what: str, predicate: Any, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if predicate():
                return
        except (OSError, RuntimeError, http.client.HTTPException):
            pass
        time.sleep(0.1)
    raise TimeoutError(f"timed out after {timeout}s waiting for {what}")


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))]


def measure(ranks: int, seconds: float, scrape_every: float, template: dict[str, Any], log_dir: Path,
            nvml: bool = True, hostile: float = 0.0) -> dict[str, Any]:
    """One load against the agent: ``ranks`` pushing, a scrape every ``scrape_every`` seconds (0: none)."""
    port = free_port()
    env = dict(os.environ, TRAINPATROL_NVML_FAKE_DELAYS=json.dumps(DELAYS), PYTHONUNBUFFERED="1")
    env["PYTHONPATH"] = os.pathsep.join([str(REPO / "exporter"), env.get("PYTHONPATH", "")])
    fixture = REPO / "tests" / "nvml_fake" / "nvml_h200.json"
    cmd = [sys.executable, "-m", "trainpatrol", "agent", "--host", "127.0.0.1", "--port", str(port),
           *(["--nvml-fake", str(fixture), "--nvml-pcie"] if nvml else ["--no-nvml"]), "--log-level", "warning"]
    log = open(log_dir / f"agent-{ranks}.log", "wb")  # noqa: SIM115 - closed in the finally below
    agent = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
    ctx = multiprocessing.get_context("spawn")
    stop, counts = ctx.Event(), ctx.Array("l", [0, 0])
    gpus: list[str] = []  # the agent's GPUs, filled before the pushers start (spawn pickles them then)
    pusher = ctx.Process(target=push_ranks, args=(port, template, ranks, stop, counts, gpus), daemon=True)
    hostile_report = ctx.Queue()
    attacker = ctx.Process(target=hostile_load, args=(port, template, stop, hostile_report, gpus), daemon=True)
    hostile_answers: dict[str, Any] = {}
    try:
        wait_until("agent /healthz", lambda: get_once(port, "/healthz"), 30)
        if nvml:
            wait_until("an NVML sample", lambda: gpus.extend(g["uuid"] for g in json.loads(
                get_once(port, "/v1/nvml")).get("gpus", [])) or gpus, 30)
        pusher.start()
        wait_until(f"{ranks} ranks and an NVML sample", lambda: _ready(port, ranks, nvml), 30)
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=5.0)
        late: dict[str, int] = {}
        if hostile:  # seconds for it to fill what the bounds let it fill, before measuring
            attacker.start()
            time.sleep(hostile)
            # a new honest run that comes while the flood holds the bounds: it must get in
            threading.Thread(target=late_run, args=(port, template, gpus, stop, late), daemon=True).start()
        time.sleep(2.0)  # let every rank push at least twice before measuring
        proc = psutil.Process(agent.pid)
        pushed_before = counts[0]
        threads_before = _thread_cpu(proc)
        cpu_before, wall_before, switches_before = proc.cpu_times(), time.monotonic(), proc.num_ctx_switches()
        latencies, rss_peak, size = [], 0, 0
        next_at = time.monotonic()
        if not scrape_every:  # what the rest costs without scrapes
            time.sleep(seconds)
        while scrape_every and time.monotonic() - wall_before < seconds:
            time.sleep(max(0.0, next_at - time.monotonic()))
            next_at += scrape_every
            start = time.perf_counter()
            try:
                body = get(conn, "/metrics", {"Accept": PROMETHEUS_ACCEPT})
            except (ConnectionError, http.client.HTTPException):  # the agent closed it while idle: as Prometheus,
                conn.close()                                        # once more on a new connection
                body = get(conn, "/metrics", {"Accept": PROMETHEUS_ACCEPT})
            latencies.append(time.perf_counter() - start)
            size = len(body)
            rss_peak = max(rss_peak, proc.memory_info().rss)
        cpu_after, wall_after, switches_after = proc.cpu_times(), time.monotonic(), proc.num_ctx_switches()
        threads_after = _thread_cpu(proc)
        pushes = counts[0] - pushed_before
        rss_peak = max(rss_peak, proc.memory_info().rss)
        conn.close()
        text = get_once(port, "/metrics").decode()
    finally:
        stop.set()
        if attacker.pid is not None:
            with contextlib.suppress(Exception):
                hostile_answers = hostile_report.get(timeout=15)
            attacker.join(10)
        if pusher.pid is not None:
            pusher.join(10)
        agent.terminate()
        try:
            agent.wait(10)
        except subprocess.TimeoutExpired:
            agent.kill()
            agent.wait(10)
        log.close()
    wall = wall_after - wall_before
    cpu = (cpu_after.user - cpu_before.user) + (cpu_after.system - cpu_before.system)
    ms = [x * 1000 for x in latencies]
    return {
        "ranks": ranks,
        "nvml": nvml,
        "scrape_every_seconds": scrape_every,
        "seconds": round(wall, 2),
        "scrapes": len(latencies),
        "scrape_ms_p50": round(statistics.median(ms), 3) if ms else None,
        "scrape_ms_p99": round(percentile(ms, 0.99), 3) if ms else None,
        "scrape_ms_max": round(max(ms), 3) if ms else None,
        "cpu_core_share": round(cpu / wall, 4),
        "cpu_user_share": round((cpu_after.user - cpu_before.user) / wall, 4),
        "cpu_system_share": round((cpu_after.system - cpu_before.system) / wall, 4),
        "cpu_core_share_by_thread": {name: round((threads_after[name] - threads_before.get(name, 0.0)) / wall, 4)
                                     for name in sorted(threads_after)},
        "wakeups_per_second": round((switches_after.voluntary - switches_before.voluntary) / wall, 1),
        "rss_mb_peak": round(rss_peak / 2**20, 1),
        "pushes_per_second": round(pushes / wall, 2),
        "push_errors": counts[1],
        "exposition_bytes": size,
        "series": sum(1 for line in text.splitlines() if line and not line.startswith("#")),
        "collector_duration_seconds": _collector_durations(text),
        **({"hostile_answers": hostile_answers, "refused_requests": _refusals(text),
            "late_honest_run_answers": dict(sorted(late.items())),
            "hostile_started_seconds_before": hostile} if hostile else {}),
    }


def _refusals(text: str) -> dict[str, float]:
    """``trainpatrol_refused_requests_total`` by reason."""
    prefix = "trainpatrol_refused_requests_total{"
    return {line.split('"')[1]: float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
            if line.startswith(prefix)}


def _thread_cpu(proc: psutil.Process) -> dict[str, float]:
    """CPU seconds of the agent's threads, by thread name (Linux); the event loop is ``main``."""
    out: dict[str, float] = {}
    for t in proc.threads():
        try:
            name = Path(f"/proc/{proc.pid}/task/{t.id}/comm").read_text().strip()
        except OSError:
            continue
        name = "main" if t.id == proc.pid else name
        out[name] = out.get(name, 0.0) + t.user_time + t.system_time
    return out


def _ready(port: int, ranks: int, nvml: bool) -> bool:
    runs = json.loads(get_once(port, "/v1/runs"))["runs"]
    hosted = sum(len(r["ranks"]) for r in runs if r["run"] == "bench")
    nvml_ok = 'trainpatrol_collector_success{collector="nvml"} 1.0' in get_once(port, "/metrics").decode()
    return hosted == ranks and (nvml_ok or not nvml)


def _collector_durations(text: str) -> dict[str, float]:
    out = {}
    for line in text.splitlines():
        if line.startswith("trainpatrol_collector_duration_seconds{"):
            name = line.split('"')[1]
            out[name] = round(float(line.rsplit(" ", 1)[1]) * 1000, 3)
    return {f"{k}_ms": v for k, v in sorted(out.items())}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="15 s per load instead of --seconds")
    parser.add_argument("--seconds", type=float, default=60.0)
    parser.add_argument("--load", default="node,fleet",
                        help="comma-separated: node (8 ranks, a scrape every 15 s), fleet (64 ranks, every 5 s), "
                             "or RANKSxSECONDS (0 seconds: no scrapes)")
    parser.add_argument("--no-nvml", dest="nvml", action="store_false", help="an agent without the NVML collector")
    parser.add_argument("--hostile", type=float, default=0.0, metavar="SECONDS",
                        help="a bounded hostile load beside the ranks (hostile_load), started SECONDS before the "
                             "measurement so that it has filled what the bounds let it fill (40 does)")
    args = parser.parse_args()
    seconds = 15.0 if args.quick else args.seconds
    template = patrol_snapshot()
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        for load in args.load.split(","):
            ranks, every = LOADS[load] if load in LOADS else (int(load.split("x")[0]), float(load.split("x")[1]))
            result = measure(ranks, seconds, every, template, Path(tmp), args.nvml, hostile=args.hostile)
            results.append({"load": load, **result})
    met = {}
    for r in results:
        checks = {"rss_mb": r["rss_mb_peak"] <= TARGETS["rss_mb"]}
        load = r["load"]
        if r["nvml"] and "hostile_answers" not in r:
            cpu_target = TARGETS["cpu_core_share"].get(load)  # type: ignore[attr-defined]
            if cpu_target is not None:
                checks["cpu_core_share"] = r["cpu_core_share"] <= cpu_target
            p99_target = TARGETS["p99_ms"].get(load)  # type: ignore[attr-defined]
            if p99_target is not None and r["scrapes"]:
                checks["p99_ms"] = r["scrape_ms_p99"] <= p99_target
        met.update({f"{name}_{load}": ok for name, ok in checks.items()})
    report = {
        "bench": "scrape",
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version(), "platform": platform.platform()},
        "setup": {"gpus": 8 if args.nvml else 0, "nvml_fake_delays_seconds": DELAYS, "nvml_pcie": args.nvml,
                  "nvml_interval_seconds": 1.0, "push_hz_per_rank": 1.0, "steps_per_push": 30,
                  "seconds_per_load": seconds, "hostile": args.hostile,
                  "samples_per_push": len(template["samples"]), "push_bytes": len(json.dumps(template))},
        "results": results,
        "targets": TARGETS,
        "met": met,
    }
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()

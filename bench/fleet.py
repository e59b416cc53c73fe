"""A simulated fleet: real agents, a real Prometheus with the shipped rules and a real Alertmanager, and
synthetic ranks of one run pushing over Patrol's own push path. How series, rule evaluation,
Prometheus' memory and the agents' CPU grow with the ranks, and how long a straggler takes to be named:

    python bench/fleet.py [--agents 16] [--ranks 1024[,4096]] [--seconds 480] [--fault-after 150] [--out F.json]

**Ranks.** Before anything starts, a small real CPU training run (the demo's model and data, a
simulated allocator reading, ``STEP_SECONDS`` a step) trains with Patrol and its snapshot is taken after
each of ``RECORD_STEPS`` steps (``record``; ``--save-recording``/``--recording`` keep one). Every synthetic
rank replays it time-true (``Replay``, ``RankSim``): its own rank, host, GPU UUID and world size; steps on
one clock for all ranks, as in a synchronous data-parallel run (each rank but the fault rank times them
up to ``RANK_JITTER`` off), with counters (steps, samples, tokens, the step histogram) that keep growing across
replay cycles; gauges as recorded, from a random frame. Ranks are spread evenly over the agents
(contiguous blocks, as nodes are) and each pushes every ``--push-interval`` seconds (default 5) from a
random phase, through a real ``Publisher`` (the agent handshake, the run key, a kept-alive connection per
rank, one more try on a new connection when the agent closed it): ``--pushers`` processes, one thread
per agent in each, each thread owning that agent's ranks.

**Fault.** ``--fault-after`` seconds into the measurement, rank ``--fault-rank`` becomes a straggler: from
that instant its steps take ``STRAGGLER_FACTOR`` (1.4) times as long (its histogram's sum and buckets and its
compute time, and its step, sample and token rates follow; its loader-wait and probe-overhead ratios drop by the
factor).

**Watching.** One Prometheus scrapes every agent every ``--scrape-interval`` seconds and evaluates
``--rules`` at the same pace; its alerts go to a real Alertmanager (``prometheus-alertmanager``, every
alert its own group, ``group_wait`` 0 s) whose webhook is a receiver in this process, which notes
when each alert first arrives. Without an Alertmanager binary the receiver itself takes Prometheus'
``POST /api/v2/alerts`` (``alertmanager: "emulated"`` in the report).

**Reported** per size: series in Prometheus' head, the most each rule group's last evaluation took,
missed evaluations, Prometheus' peak RSS and CPU, the agents' CPU (their CPU seconds over the measured
window, summed, per wall second) and RSS, pushes ok / failed / retried on a new connection, push latency
and how late the pushers were against their schedule, with the pushers' own CPU (lateness that grows
while their CPU nears one core each means the bench, not the agents, was the bottleneck: raise
``--pushers``), the series of one rank, what the agents counted, and the
seconds from the fault to (a) the first alert naming the fault rank at the receiver, (b) the first
firing ``ALERTS`` series naming it in Prometheus and (c) the first time ``--outlier-query`` names it
(by default every recording rule whose name holds "outlier", selected at ``rank=<fault rank>``; null
when the rules have none). Each also says whether it named the rank before the fault. At the end, with
everything stopped, Prometheus starts again on the fleet's TSDB with nothing else to do and runs every rule the
fleet loaded once more, one query at a time, with its query statistics (``rule_work_one_round``): the samples each
group loads, which depend on the ranks and not on the host, and its rules' evaluation time alone.

``--ranks 1024,4096`` runs each size in turn, each with fresh agents, Prometheus and Alertmanager.
Prometheus inherits the environment: ``GOGC=75`` runs it as Prometheus 2.53 and later run by default.
"""

from __future__ import annotations

import argparse
import bisect
import contextlib
import gzip
import heapq
import http.server
import json
import logging
import multiprocessing
import os
import platform
import random
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.parse
import urllib.request
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "exporter"))
sys.path.insert(0, str(REPO / "bench"))

from scrape import free_port, percentile, wait_until  # noqa: E402

from trainpatrol._process import terminate  # noqa: E402
from trainpatrol.agent.config import AgentConfig  # noqa: E402
from trainpatrol.catalogue import STEP_DURATION_BUCKETS  # noqa: E402
from trainpatrol.probe.publisher import Publisher  # noqa: E402
from trainpatrol.stack import prometheus_config  # noqa: E402

RUN = "fleet"
RUN_KEY = "fleet-bench-run-key"
"""Every synthetic rank proves it, as a Patrol's ranks prove their run's key (probe.run_key)."""
STEP_SECONDS = 0.1
"""The recorded run's pace: each step sleeps to this, so its step histogram is one a replay can keep."""
RECORD_WARMUP, RECORD_STEPS = 40, 60
STRAGGLER_FACTOR = 1.4
RANK_JITTER = 0.01
"""Each rank's steps take up to this much (a fraction) more or less time than the recording's, for good:
ranks of a synchronous run finish steps together but time them a little differently, and exact ties
would make every topk of step times name arbitrary ranks."""
PER_STEP_RATIOS = ("trainpatrol_loader_wait_ratio", "trainpatrol_probe_overhead_ratio")
"""Gauges that divide by the step time: a straggler's are lower by the factor."""
PER_STEP_SECONDS = ("trainpatrol_compute_seconds_total",)
"""Counters of time spent computing each step: a straggler's grow by the factor faster (its compute is slow)."""
RANK_SPECIFIC_LABELS = ("local_rank", "world_size", "host", "gpu_uuid")
RANKS_PER_NODE = 8
DEFAULT_AGENT = AgentConfig()


# --- the recording ------------------------------------------------------------------------------------

def record(steps: int = RECORD_STEPS, warmup: int = RECORD_WARMUP) -> dict[str, Any]:
    """A real CPU training run with Patrol: its snapshot after each of ``steps`` steps, after ``warmup``."""
    import torch
    from torch.utils.data import DataLoader

    from trainpatrol import Patrol, PatrolConfig
    from trainpatrol.demo import SimulatedAllocator, _data, _model, _validate

    logging.getLogger("trainpatrol").setLevel(logging.ERROR)  # its publisher has no agent to reach
    cpu = torch.device("cpu")
    model = _model(cpu)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    loader = DataLoader(_data(), batch_size=64, shuffle=True, generator=torch.Generator().manual_seed(0))
    held_out = _data(512, seed=2)
    frames: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as tmp:
        cfg = PatrolConfig(run=RUN, run_key=RUN_KEY, agent_url="http://127.0.0.1:9", embedded_agent=False,
                           checkpoint_dir=f"{tmp}/ckpt", evidence_dir=f"{tmp}/evidence",
                           push_interval_seconds=3600.0, memory_reader=SimulatedAllocator(),
                           memory_interval_seconds=0.0, keep_best_checkpoint=False)
        patrol = Patrol(model=model, optimizer=opt, device=cpu, config=cfg)
        try:
            while len(frames) < steps:
                for x, y in patrol.loader(loader):
                    started = time.perf_counter()
                    loss = torch.nn.functional.mse_loss(model(x), y)
                    loss.backward()
                    total = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                    patrol.step(loss, grad_norm=total, batch_size=x.shape[0], tokens=x.shape[0] * 512)
                    opt.step()
                    opt.zero_grad(set_to_none=True)
                    if patrol.step_count % 25 == 0:
                        patrol.evaluate(_validate(model, held_out, cpu))
                    time.sleep(max(0.0, STEP_SECONDS - (time.perf_counter() - started)))
                    if patrol.step_count > warmup:
                        frames.append(patrol._report.snapshot())
                    if len(frames) >= steps:
                        break
        finally:
            patrol._publisher.stop(final_push=False)
    return {"recorded": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "step_seconds": STEP_SECONDS,
            "frames": frames}


def load_recording(path: Path) -> dict[str, Any]:
    with gzip.open(path, "rt") if path.suffix == ".gz" else open(path) as f:
        return dict(json.load(f))


def save_recording(recording: dict[str, Any], path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with gzip.open(path, "wt") if path.suffix == ".gz" else open(path, "w") as f:
        json.dump(recording, f, separators=(",", ":"))


@dataclass
class Replay:
    """The recording as vectors: each frame's sample values, then its cumulative histogram counts, then
    its histogram sum. Only the frames that hold the last frame's set of samples are kept."""

    template: dict[str, Any]
    names: list[str]
    labels: list[dict[str, str]]
    counter: list[bool]
    frames: list[list[float]]
    steps: list[int]
    step_seconds: float

    @classmethod
    def of(cls, recording: dict[str, Any]) -> Replay:
        raw = recording["frames"]
        key = [(s["name"], tuple(sorted(s["labels"].items()))) for s in raw[-1]["samples"]]
        kept = [f for f in raw if [(s["name"], tuple(sorted(s["labels"].items()))) for s in f["samples"]] == key]
        if len(kept) < 10:
            raise ValueError(f"the recording has {len(kept)} frames with one set of samples; 10 at least are needed")
        frames = [[float(s["value"]) for s in f["samples"]] + [float(c) for c in f["histogram"]["counts"]]
                  + [float(f["histogram"]["sum"])] for f in kept]
        names = [s["name"] for s in kept[0]["samples"]]
        hist = len(kept[0]["histogram"]["counts"]) + 1
        counter = [n.endswith("_total") for n in names] + [True] * hist
        steps = [int(f["step"]) for f in kept]
        step_seconds = (frames[-1][-1] - frames[0][-1]) / max(1, steps[-1] - steps[0])
        template = {k: v for k, v in kept[0].items() if k not in ("samples", "histogram")}
        return cls(template, names, [dict(s["labels"]) for s in kept[0]["samples"]], counter, frames, steps,
                   step_seconds or STEP_SECONDS)

    @property
    def samples(self) -> int:
        return len(self.names)

    def track(self, factor: float) -> Track:
        """The recording's steps, each taking ``factor`` times as long as recorded."""
        n, first = self.samples, self.frames[0]
        parts: list[list[float]] = []
        bounds = [*STEP_DURATION_BUCKETS, float("inf")]
        counts = [0.0] * len(bounds)
        total = 0.0
        slower = {i for i, name in enumerate(self.names) if name in PER_STEP_SECONDS}
        for j, frame in enumerate(self.frames):
            if j:
                before = self.frames[j - 1]
                stepped = frame[-2] - before[-2]  # the +Inf bucket: steps in this frame
                took = frame[-1] - before[-1]
                if stepped > 0:
                    b = bisect.bisect_left(bounds, factor * took / stepped)
                    for i in range(b, len(bounds)):
                        counts[i] += stepped
                    total += factor * took
            parts.append([(v - f) * (factor if i in slower else 1.0)
                          for i, (v, f) in enumerate(zip(frame[:n], first[:n], strict=True))] + counts + [total])
        ratios = [i for i, name in enumerate(self.names) if name in PER_STEP_RATIOS]
        return Track(parts[:-1], parts[-1], self.step_seconds * factor, 1.0 / factor, ratios)


@dataclass
class Track:
    """What ``k`` steps from the recording's start add to the counters: ``cycles * whole + parts[k % len]``."""

    parts: list[list[float]]
    whole: list[float]
    step_seconds: float
    ratio_scale: float
    ratio_indices: list[int]

    def cum(self, k: int) -> list[float]:
        cycles, j = divmod(k, len(self.parts))
        return [cycles * w + p for w, p in zip(self.whole, self.parts[j], strict=True)]


class RankSim:
    """One synthetic rank: the recording replayed at its pace, as its snapshot. Every rank's steps keep the
    same clock from ``epoch`` (a synchronous data-parallel run: ranks finish their steps together), so
    their step-time means agree until the fault; their other readings start at a random frame."""

    def __init__(self, replay: Replay, tracks: list[Track], rank: int, world: int, epoch: float,
                 rng: random.Random) -> None:
        self.replay, self.tracks, self.rank = replay, tracks, rank
        node = rank // RANKS_PER_NODE
        gpu = f"GPU-f1ee7000-{node:04x}-{rank % RANKS_PER_NODE:04x}-0000-{rank:012x}"
        ident = {"local_rank": str(rank % RANKS_PER_NODE), "world_size": str(world), "host": f"node-{node:04d}",
                 "gpu_uuid": gpu}
        self.labels = [dict(lb, **{k: ident[k] for k in RANK_SPECIFIC_LABELS if k in lb})
                       if any(k in lb for k in RANK_SPECIFIC_LABELS) else lb for lb in replay.labels]
        self.fields = dict(replay.template, run=RUN, rank=rank, local_rank=rank % RANKS_PER_NODE, world_size=world,
                           host=ident["host"], gpu_uuid=gpu, pid=100_000 + rank, instance=f"{rank:016x}",
                           state="running", actions=[], done_commands=[], last_checkpoint="", evidence_dir="")
        self.phase = rng.randrange(len(tracks[0].parts))
        self.jitter = 1.0 + rng.uniform(-RANK_JITTER, RANK_JITTER)
        self.pos, self.at, self.track = 0.0, epoch, 0
        self.origin_k, self.origin = 0, list(replay.frames[0])
        self.seq = 0

    def advance(self, now: float) -> None:
        self.pos += max(0.0, now - self.at) / self.tracks[self.track].step_seconds
        self.at = max(self.at, now)

    def values(self) -> list[float]:
        k, track, frames = int(self.pos), self.tracks[self.track], self.replay.frames
        gauges = frames[(k + self.phase) % len(track.parts)]
        now, then = track.cum(k), track.cum(self.origin_k)
        out = [o + a - b if c else g for o, a, b, c, g in
               zip(self.origin, now, then, self.replay.counter, gauges, strict=True)]
        out[-1] = self.origin[-1] + (now[-1] - then[-1]) * self.jitter  # the histogram's sum
        for i in track.ratio_indices:
            out[i] *= track.ratio_scale
        return out

    def become(self, track: int, at: float) -> None:
        """From ``at`` on, its steps follow ``track``; the counters go on from where they are."""
        self.advance(at)
        self.origin, self.origin_k, self.track = self.values(), int(self.pos), track

    def snapshot(self) -> dict[str, Any]:
        self.advance(time.time())
        values, n = self.values(), self.replay.samples
        self.seq += 1
        # step_time: when its last step ended, as Patrol reports it (the recording's own would be long past, and the
        # agent would then date every step to the rank's previous push: RankStalled at a push interval over 10 s).
        step_time = self.at - (self.pos % 1.0) * self.tracks[self.track].step_seconds
        return dict(self.fields, seq=self.seq, time=self.at, step_time=step_time,
                    step=self.replay.steps[0] + int(self.pos),
                    samples=[{"name": name, "labels": lb, "value": v}
                             for name, lb, v in zip(self.replay.names, self.labels, values[:n], strict=True)],
                    histogram={"counts": values[n:-1], "sum": values[-1]})


# --- the pushers ----------------------------------------------------------------------------------------

class CountingPublisher(Publisher):
    """Patrol's publisher, counting its requests, the connections it opened and why pushes failed."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.attempts = self.connections = 0
        self.reasons: Counter[str] = Counter()

    def _request(self, body: bytes) -> tuple[int, bytes]:
        self.attempts += 1
        self.connections += self._conn is None
        return super()._request(body)

    def _failed(self, exc: Exception) -> None:
        self.reasons[f"{type(exc).__name__}: {str(exc)[:100]}"] += 1
        super()._failed(exc)


def push_agent(port: int, ranks: list[int], replay: Replay, world: int, interval: float, fault_rank: int,
               fault_at: Any, stop: Any, out: dict[str, Any], epoch: float, seed: int) -> None:
    """One agent's ranks, each pushing every ``interval`` from a random phase, in due order."""
    tracks = [replay.track(1.0), replay.track(STRAGGLER_FACTOR)]
    rng, now = random.Random(seed), time.time()
    sims = [RankSim(replay, tracks, rank, world, epoch, rng) for rank in ranks]
    for sim in sims:
        if sim.rank == fault_rank:  # the run's median rank until the fault: only the fault sets it apart
            sim.jitter = 1.0
    pubs = [CountingPublisher(f"http://127.0.0.1:{port}", sim.snapshot, lambda commands: None, run_key=RUN_KEY,
                              interval=interval) for sim in sims]
    due = [(now + rng.uniform(0, interval), i) for i in range(len(sims))]
    heapq.heapify(due)
    retried, push_ms, late_ms = 0, [], []
    while not stop.is_set():
        at, i = due[0]
        if stop.wait(max(0.0, at - time.time())):
            break
        sim, pub = sims[i], pubs[i]
        if sim.rank == fault_rank and sim.track == 0 and 0 < fault_at.value <= time.time():
            sim.become(1, fault_at.value)
            out["fault_first_push"] = time.time()
        started = time.time()
        late_ms.append((started - at) * 1000)
        before = pub.attempts
        pub.push_now()
        push_ms.append((time.time() - started) * 1000)
        retried += pub.attempts - before > 1
        heapq.heapreplace(due, (at + interval, i))
    for pub in pubs:
        with contextlib.suppress(Exception):
            pub.stop(final_push=False)
    reasons: Counter[str] = Counter()
    for pub in pubs:
        reasons.update(pub.reasons)
    out.update(ok=sum(p.delivered for p in pubs), failed=sum(p.dropped for p in pubs), retried=retried,
               connections=sum(p.connections for p in pubs), reasons=dict(reasons), push_ms=push_ms, late_ms=late_ms)


def pusher(assignments: list[tuple[int, list[int]]], replay: Replay, world: int, interval: float, fault_rank: int,
           fault_at: Any, stop: Any, results: Any, epoch: float, seed: int, cpus: frozenset[int]) -> None:
    """A pusher process: a thread per agent (``push_agent``); puts what they counted on ``results``."""
    if cpus:
        os.sched_setaffinity(0, cpus)  # before its threads start: they inherit it
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent stops it; Ctrl-C reaches the whole group
    logging.getLogger("trainpatrol").setLevel(logging.ERROR)  # failures are counted, not logged 10,000 times
    outs: list[dict[str, Any]] = [{} for _ in assignments]
    threads = [threading.Thread(target=push_agent, name=f"agent-{port}", daemon=True,
                                args=(port, ranks, replay, world, interval, fault_rank, fault_at, stop, out,
                                      epoch, seed * 1000 + n))
               for n, ((port, ranks), out) in enumerate(zip(assignments, outs, strict=True))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    results.put(outs)


# --- the alert receiver ----------------------------------------------------------------------------------

class Receiver:
    """Alertmanager's webhook (``POST /webhook``) or, without Alertmanager, Alertmanager's own
    ``POST /api/v2/alerts`` as Prometheus calls it: notes when each alert (label set) first arrives."""

    def __init__(self) -> None:
        self.first: dict[tuple[tuple[str, str], ...], float] = {}
        self.posts = 0
        self.lock = threading.Lock()
        receiver = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                try:
                    doc = json.loads(body or b"null")
                    alerts = doc.get("alerts", []) if isinstance(doc, dict) else doc if isinstance(doc, list) else []
                except ValueError:
                    alerts = []
                receiver.take(alerts)
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", "2")
                self.end_headers()
                self.wfile.write(b"{}")

            def log_message(self, format: str, *args: Any) -> None:
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.port = int(self.server.server_address[1])
        self.thread = threading.Thread(target=self.server.serve_forever, name="receiver", daemon=True)
        self.thread.start()

    def take(self, alerts: list[Any]) -> None:
        now = time.time()
        with self.lock:
            self.posts += 1
            for a in alerts:
                if isinstance(a, dict) and a.get("status", "firing") == "firing":
                    key = tuple(sorted((str(k), str(v)) for k, v in dict(a.get("labels", {})).items()))
                    self.first.setdefault(key, now)

    def arrivals(self) -> list[tuple[float, dict[str, str]]]:
        with self.lock:
            return sorted((t, dict(key)) for key, t in self.first.items())

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


# --- the processes ---------------------------------------------------------------------------------------

class ProcessExited(Exception):
    """A process of the fleet ended early (not an OSError or RuntimeError, which ``wait_until`` retries)."""


class Fleet:
    """Every process of one size, started in order and ended in reverse (``stop``), whatever happened."""

    def __init__(self, workdir: Path) -> None:
        self.workdir = workdir
        self.procs: list[tuple[str, subprocess.Popen[bytes]]] = []

    def spawn(self, name: str, cmd: list[str], env: dict[str, str] | None = None) -> subprocess.Popen[bytes]:
        with open(self.workdir / f"{name}.log", "wb") as log:
            proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        self.procs.append((name, proc))
        return proc

    def check(self) -> None:
        for name, proc in self.procs:
            if proc.poll() is not None:
                raise ProcessExited(f"{name} exited with {proc.returncode}: {self.tail(name)}")

    def answers(self, url: str) -> bytes:
        """``url``'s body, once every process is still running."""
        self.check()
        return http_get(url, 2)

    def tail(self, name: str, chars: int = 1500) -> str:
        try:
            return (self.workdir / f"{name}.log").read_text(errors="replace")[-chars:]
        except OSError:
            return ""

    def stop(self) -> None:
        for _, proc in reversed(self.procs):
            with contextlib.suppress(Exception):
                proc.terminate()
        for _, proc in reversed(self.procs):
            with contextlib.suppress(Exception):
                terminate(proc, timeout=10)


def http_get(url: str, timeout: float = 10.0) -> bytes:
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return bytes(r.read())


def promql(prom: str, expr: str) -> list[dict[str, Any]]:
    body = json.loads(http_get(f"{prom}/api/v1/query?{urllib.parse.urlencode({'query': expr})}"))
    if body.get("status") != "success":
        raise RuntimeError(f"query {expr!r}: {body}")
    return list(body["data"]["result"])


def scalar(prom: str, expr: str) -> float | None:
    try:
        result = promql(prom, expr)
    except (OSError, RuntimeError, ValueError):
        return None
    return float(result[0]["value"][1]) if result else None


def rule_work(prom: str, groups: list[dict[str, Any]], at: float, repeats: int = 5) -> dict[str, Any]:
    """Every rule of ``groups`` (as ``/api/v1/rules`` lists them) run through the query API at ``at``, one query at
    a time, with Prometheus' query statistics: the samples it loads (``totalQueryableSamples``, the same on any
    host, so its growth with the ranks is the rules' own) and the median of ``repeats`` inner evaluation times."""
    out: dict[str, dict[str, float]] = {}
    for group in groups:
        samples, seconds = 0.0, 0.0
        for rule in group["rules"]:
            stats = []
            for _ in range(repeats):
                query = urllib.parse.urlencode({"query": rule["query"], "time": f"{at:.3f}", "stats": "all"})
                stats.append(json.loads(http_get(f"{prom}/api/v1/query?{query}", 60))["data"]["stats"])
            samples += stats[0]["samples"]["totalQueryableSamples"]
            seconds += statistics.median(st["timings"]["innerEvalTime"] for st in stats)
        out[group["name"]] = {"samples": samples, "inner_eval_seconds": round(seconds, 4)}
    return {"groups": out, "samples": sum(g["samples"] for g in out.values()),
            "inner_eval_seconds": round(sum(g["inner_eval_seconds"] for g in out.values()), 4)}


def quiet_rule_work(s: Settings, groups: list[dict[str, Any]], workdir: Path) -> dict[str, Any]:
    """``rule_work`` in a Prometheus that does nothing else: started again on the stopped fleet's TSDB with no
    scrapes and no rules, at the last instant the fleet wrote. Its times are the rules' evaluation alone, without
    the ingest and the other groups that the live timings share the process with."""
    quiet = Fleet(workdir)
    (workdir / "quiet.yml").write_text("global: {evaluation_interval: 1h}\n")
    prom = f"http://127.0.0.1:{free_port()}"
    quiet.spawn("prometheus-quiet", s.pinned([
        shutil.which("prometheus") or "prometheus", f"--config.file={workdir / 'quiet.yml'}",
        f"--storage.tsdb.path={workdir / 'tsdb'}", f"--web.listen-address={prom.removeprefix('http://')}",
        "--log.level=warn"], prometheus=True))
    try:
        wait_until("quiet prometheus ready", lambda: quiet.answers(prom + "/-/ready"), 120)
        head = json.loads(http_get(f"{prom}/api/v1/status/tsdb"))["data"]["headStats"]
        return {"head_series": head["numSeries"], **rule_work(prom, groups, head["maxTime"] / 1000 - 1)}
    finally:
        quiet.stop()


def exposition(url: str) -> dict[str, list[tuple[dict[str, str], float]]]:
    """A /metrics page as {sample name: [(labels, value)]}."""
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[str, list[tuple[dict[str, str], float]]] = {}
    for family in text_string_to_metric_families(http_get(url).decode()):
        for s in family.samples:
            out.setdefault(s.name, []).append((dict(s.labels), float(s.value)))
    return out


def alertmanager_binary() -> str | None:
    return shutil.which("prometheus-alertmanager") or shutil.which("alertmanager")


def duration(seconds: float) -> str:
    """Prometheus' duration format has no fractions."""
    return f"{round(seconds * 1000)}ms"


def agent_overrides(ranks_per_agent: int, samples: int) -> dict[str, str]:
    """The bounds one agent needs to host its share of the run: only those the defaults do not already fit."""
    series = ranks_per_agent * samples
    need = {"max_ranks_per_run": ranks_per_agent, "max_series_per_run": series, "max_series": series,
            "max_connections": ranks_per_agent + 64}  # a kept-alive connection per rank, and the scrapes
    return {f"TRAINPATROL_{k.upper()}": str(v) for k, v in need.items() if v > getattr(DEFAULT_AGENT, k)}


# --- one size ---------------------------------------------------------------------------------------------

def cpu_list(text: str) -> frozenset[int]:
    """``0-3,8`` as taskset reads it."""
    cpus: set[int] = set()
    for part in text.split(","):
        first, _, last = part.partition("-")
        cpus.update(range(int(first), int(last or first) + 1))
    return frozenset(cpus)


@dataclass
class Settings:
    agents: int
    seconds: float
    scrape_interval: float
    push_interval: float
    rules: Path
    fault_rank: int
    fault_after: float
    outlier_query: str
    pushers: int
    alertmanager: str
    prometheus_cpus: frozenset[int] = frozenset()
    """Prometheus alone on these CPUs, the agents and pushers on the others (empty: no pinning): at 4,096 ranks they
    share a host's caches and memory bandwidth, which Prometheus' own times then include."""

    def pinned(self, cmd: list[str], prometheus: bool = False) -> list[str]:
        cpus = self.prometheus_cpus if prometheus else self.other_cpus()
        return ["taskset", "-c", ",".join(map(str, sorted(cpus))), *cmd] if cpus else cmd

    def other_cpus(self) -> frozenset[int]:
        return frozenset(os.sched_getaffinity(0)) - self.prometheus_cpus if self.prometheus_cpus else frozenset()


@dataclass
class Watch:
    """What the measurement saw, as it went."""

    start: float = 0.0
    fault: float | None = None
    before: dict[str, float] = field(default_factory=dict)
    """When each watch (the Prometheus alert, the outlier query) first named the fault rank before the fault."""
    after: dict[str, float] = field(default_factory=dict)
    maxima: dict[str, float] = field(default_factory=dict)
    last: dict[str, float] = field(default_factory=dict)
    rule_seconds: dict[str, float] = field(default_factory=dict)
    rule_samples: dict[str, list[float]] = field(default_factory=dict)
    """Each group's last evaluation time at every sample, for its median."""
    slowest_rules: dict[str, float] = field(default_factory=dict)
    """The most each rule's own evaluation took (/api/v1/rules), by group/rule name."""
    rule_evaluations: dict[str, list[float]] = field(default_factory=dict)
    """Each rule's own evaluation time at every sample, for its median."""
    missed: dict[str, float] = field(default_factory=dict)
    named_by: dict[tuple[str, bool], list[str]] = field(default_factory=dict)
    """The alerts or series that named the fault rank first, by (watch, after the fault)."""
    query_errors: int = 0
    outlier: str = ""

    def since_fault(self, t: float | None) -> float | None:
        return None if t is None or self.fault is None else round(t - self.fault, 1)

    def peak(self, name: str, value: float | None) -> None:
        if value is not None:
            self.maxima[name] = max(self.maxima.get(name, value), value)


def start_alerting(fleet: Fleet, receiver: Receiver, choice: str) -> tuple[str, str]:
    """Alertmanager with the receiver as its webhook, or the receiver alone: (Prometheus' target, what it is)."""
    binary = alertmanager_binary() if choice != "emulated" else None
    if choice == "real" and binary is None:
        raise RuntimeError("--alertmanager real: neither prometheus-alertmanager nor alertmanager is on PATH")
    if binary is None:
        return f"127.0.0.1:{receiver.port}", "emulated: the receiver takes POST /api/v2/alerts"
    port, cfg = free_port(), fleet.workdir / "alertmanager.yml"
    cfg.write_text(json.dumps({
        "route": {"receiver": "bench", "group_by": ["..."], "group_wait": "0s", "group_interval": "5s",
                  "repeat_interval": "1h"},
        "receivers": [{"name": "bench", "webhook_configs": [
            {"url": f"http://127.0.0.1:{receiver.port}/webhook", "send_resolved": False}]}]}))
    fleet.spawn("alertmanager", [binary, f"--config.file={cfg}", f"--storage.path={fleet.workdir / 'am'}",
                                 f"--web.listen-address=127.0.0.1:{port}", "--cluster.listen-address=",
                                 "--log.level=warn"])
    wait_until("alertmanager ready", lambda: fleet.answers(f"http://127.0.0.1:{port}/-/ready"), 30)
    version = subprocess.run([binary, "--version"], capture_output=True, text=True, timeout=10)
    return f"127.0.0.1:{port}", "real: " + (version.stdout + version.stderr).strip().split("\n")[0]


def measure(ranks: int, s: Settings, replay: Replay, workdir: Path) -> dict[str, Any]:
    """One size: start everything, let every rank push, measure for ``s.seconds``, end everything."""
    workdir.mkdir(parents=True, exist_ok=True)
    fleet, receiver = Fleet(workdir), Receiver()
    ctx = multiprocessing.get_context("spawn")
    stop, fault_at, results = ctx.Event(), ctx.Value("d", 0.0), ctx.Queue()
    procs: list[Any] = []
    per_agent = [list(range(a * ranks // s.agents, (a + 1) * ranks // s.agents)) for a in range(s.agents)]
    overrides = agent_overrides(max(map(len, per_agent)), replay.samples)
    watch = Watch()
    try:
        ports = [free_port() for _ in range(s.agents)]
        env = dict(os.environ, PYTHONUNBUFFERED="1", **overrides)
        env["PYTHONPATH"] = os.pathsep.join([str(REPO / "exporter"), env.get("PYTHONPATH", "")])
        agents = [fleet.spawn(f"agent-{i}", s.pinned([sys.executable, "-m", "trainpatrol", "agent", "--host",
                                                      "127.0.0.1", "--port", str(port), "--no-nvml", "--log-level",
                                                      "warning"]), env)
                  for i, port in enumerate(ports)]
        for port in ports:
            wait_until(f"agent {port} /healthz", lambda p=port: fleet.answers(f"http://127.0.0.1:{p}/healthz"),
                       30 + s.agents)
        am_target, am_kind = start_alerting(fleet, receiver, s.alertmanager)
        prom_port = free_port()
        (workdir / "prometheus.yml").write_text(prometheus_config(
            [f"127.0.0.1:{p}" for p in ports], [s.rules.resolve()], am_target, duration(s.scrape_interval)))
        prom_proc = fleet.spawn("prometheus", s.pinned([
            shutil.which("prometheus") or "prometheus", f"--config.file={workdir / 'prometheus.yml'}",
            f"--storage.tsdb.path={workdir / 'tsdb'}", f"--web.listen-address=127.0.0.1:{prom_port}",
            "--log.level=warn"], prometheus=True))
        prom = f"http://127.0.0.1:{prom_port}"
        wait_until("prometheus ready", lambda: fleet.answers(prom + "/-/ready"), 60)

        started = time.time()
        shares: list[list[tuple[int, list[int]]]] = [[] for _ in range(min(s.pushers, s.agents))]
        for i, (port, rs) in enumerate(zip(ports, per_agent, strict=True)):
            shares[i % len(shares)].append((port, rs))
        for n, share in enumerate(shares):
            proc = ctx.Process(target=pusher, name=f"pusher-{n}", daemon=True,
                               args=(share, replay, ranks, s.push_interval, s.fault_rank, fault_at, stop, results,
                                     started, n, s.other_cpus()))
            proc.start()
            procs.append(proc)

        def hosted() -> int:
            fleet.check()
            return sum(len(r["ranks"]) for port in ports
                       for r in json.loads(http_get(f"http://127.0.0.1:{port}/v1/runs", 5))["runs"] if r["run"] == RUN)

        try:
            wait_until(f"all {ranks} ranks hosted", lambda: hosted() == ranks,
                       3 * s.push_interval + 30 + ranks / 100)
        except TimeoutError as exc:
            raise TimeoutError(f"{exc}; the agents counted {agents_counted(ports)}") from None
        all_hosted = time.time() - started
        wait_until("every agent scraped", lambda: scalar(prom, 'count(up{job="trainpatrol"} == 1)') == s.agents,
                   3 * s.scrape_interval + 30)
        watch.outlier = s.outlier_query or default_outlier_query(prom, s.fault_rank)
        watched = {"agents": [psutil.Process(p.pid) for p in agents], "prometheus": [psutil.Process(prom_proc.pid)],
                   "pushers": [psutil.Process(p.pid) for p in procs]}
        cpu0 = {k: sum(map(_cpu, v)) for k, v in watched.items()}
        wall = run_measurement(s, fleet, procs, prom, watch, watched, fault_at)
        cpu = {k: (sum(map(_cpu, v)) - cpu0[k]) / wall for k, v in watched.items()}
        sample_prometheus(prom, watch)
        final = {name: scalar(prom, expr) for name, expr in {
            "series_per_rank": 'count({job="trainpatrol",rank="0",__name__=~"trainpatrol_.*"})',
            "series_per_rank_all": 'count({rank="0"})',
            "series_trainpatrol": 'count({job="trainpatrol",__name__=~"trainpatrol_.*"})',
            "series_recorded": 'count({__name__=~".+:.+"})',
        }.items()}
        counted = agents_counted(ports)
        groups = json.loads(http_get(f"{prom}/api/v1/rules"))["data"]["groups"]
    finally:
        with uninterrupted():
            stop.set()
            pushed = collect(results, procs, s.push_interval)
            fleet.stop()
            receiver.close()
    work = quiet_rule_work(s, groups, workdir)
    return {
        "ranks": ranks,
        "agents": s.agents,
        "ranks_per_agent": ranks / s.agents,
        "seconds": round(wall, 1),
        "seconds_until_all_ranks_hosted": round(all_hosted, 1),
        "push_interval_seconds": s.push_interval,
        "scrape_interval_seconds": s.scrape_interval,
        "rules": str(s.rules),
        "alertmanager": am_kind,
        "agent_overrides": overrides,
        "prometheus": prometheus_report(watch, cpu["prometheus"], final),
        "rule_work_one_round": work,
        "series_per_rank": final["series_per_rank"],
        "series_per_rank_with_recorded": final["series_per_rank_all"],
        "agents_cpu_core_share": round(cpu["agents"], 3),
        "agents_cpu_core_share_per_agent": round(cpu["agents"] / s.agents, 4),
        "agents_rss_mb_max_one": round(watch.maxima.get("agents_rss_one", 0) / 2**20, 1),
        "agents_rss_mb_max_sum": round(watch.maxima.get("agents_rss_sum", 0) / 2**20, 1),
        "agents_counted": counted,
        "pushers_cpu_core_share": round(cpu["pushers"], 3),
        "pushes": pushes_report(pushed, wall),
        "fault": fault_report(s, watch, pushed, receiver.arrivals()),
        "alerts_received": alerts_report(receiver.arrivals(), watch.start),
        "query_errors": watch.query_errors,
    }


def run_measurement(s: Settings, fleet: Fleet, procs: list[Any], prom: str, watch: Watch,
                    watched: dict[str, list[psutil.Process]], fault_at: Any) -> float:
    """``s.seconds`` of watching, once a second; the fault at ``s.fault_after``. Returns the seconds it took."""
    t0, watch.start = time.monotonic(), time.time()
    next_sample = 0.0
    while (elapsed := time.monotonic() - t0) < s.seconds:
        fleet.check()
        if not any(p.is_alive() for p in procs):
            raise ProcessExited("every pusher process exited")
        if watch.fault is None and elapsed >= s.fault_after:
            watch.fault = fault_at.value = time.time()
        for name, expr in (("prometheus_alert", f'ALERTS{{alertstate="firing",rank="{s.fault_rank}"}}'),
                           ("outlier", watch.outlier)):
            seen = watch.before if watch.fault is None else watch.after
            if not expr or name in seen:
                continue
            try:
                hits = [r["metric"] for r in promql(prom, expr) if r["metric"].get("rank") == str(s.fault_rank)]
            except (OSError, RuntimeError, ValueError):
                watch.query_errors += 1
                continue
            if hits:
                seen[name] = time.time()
                watch.named_by[(name, seen is watch.after)] = sorted(
                    {m.get("alertname") or m.get("__name__") or "(unnamed)" for m in hits})
        if elapsed >= next_sample:
            next_sample = elapsed + s.scrape_interval
            sample_prometheus(prom, watch)
            for kind, ps in watched.items():
                rss = [_rss(p) for p in ps]
                watch.peak(f"{kind}_rss_sum", sum(rss))
                watch.peak(f"{kind}_rss_one", max(rss))
            watch.peak("scrape_duration", scalar(prom, 'max(scrape_duration_seconds{job="trainpatrol"})'))
            watch.peak("samples_scraped", scalar(prom, 'sum(scrape_samples_scraped{job="trainpatrol"})'))
        time.sleep(max(0.0, 1.0 - (time.monotonic() - t0 - elapsed)))
    return time.monotonic() - t0


@contextlib.contextmanager
def uninterrupted() -> Any:
    """Ctrl-C waits while the processes are being ended (each step is bounded), then takes effect."""
    got: list[int] = []
    old = signal.signal(signal.SIGINT, lambda signum, frame: got.append(signum))
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, old)
        if got:
            raise KeyboardInterrupt


def _cpu(p: psutil.Process) -> float:
    try:
        t = p.cpu_times()
        return float(t.user + t.system)
    except psutil.Error:
        return 0.0


def _rss(p: psutil.Process) -> float:
    try:
        return float(p.memory_info().rss)
    except psutil.Error:
        return 0.0


def default_outlier_query(prom: str, fault_rank: int) -> str:
    """Every loaded recording rule whose name holds "outlier", at the fault rank; "" when there is none."""
    try:
        groups = json.loads(http_get(f"{prom}/api/v1/rules?type=record"))["data"]["groups"]
    except (OSError, ValueError, KeyError):
        return ""
    names = sorted({r["name"] for g in groups for r in g["rules"] if "outlier" in r["name"].lower()})
    return f'{{__name__=~"{"|".join(names)}",rank="{fault_rank}"}}' if names else ""


def sample_prometheus(prom: str, watch: Watch) -> None:
    """Prometheus' own /metrics: head series, RSS, and each rule group's last evaluation and missed ones."""
    try:
        page = exposition(prom + "/metrics")
    except (OSError, ValueError):
        watch.query_errors += 1
        return
    for name in ("prometheus_tsdb_head_series", "process_resident_memory_bytes"):
        for _, value in page.get(name, []):
            watch.peak(name, value)
            watch.last[name] = value
    for labels, value in page.get("prometheus_rule_group_last_duration_seconds", []):
        group = labels.get("rule_group", "").rpartition(";")[2]
        watch.rule_seconds[group] = max(watch.rule_seconds.get(group, 0.0), value)
        watch.rule_samples.setdefault(group, []).append(value)
    try:
        groups = json.loads(http_get(f"{prom}/api/v1/rules"))["data"]["groups"]
    except (OSError, ValueError, KeyError):
        watch.query_errors += 1
        groups = []
    for g in groups:
        for rule in g["rules"]:
            key = f"{g['name']}/{rule['name']}"
            seconds = float(rule.get("evaluationTime", 0))
            watch.slowest_rules[key] = max(watch.slowest_rules.get(key, 0.0), seconds)
            watch.rule_evaluations.setdefault(key, []).append(seconds)
    for labels, value in page.get("prometheus_rule_group_iterations_missed_total", []):
        watch.missed[labels.get("rule_group", "").rpartition(";")[2]] = value
    for name in ("prometheus_notifications_dropped_total", "prometheus_rule_evaluation_failures_total"):
        watch.maxima[name] = sum(v for _, v in page.get(name, []))


def agents_counted(ports: list[int]) -> dict[str, Any]:
    """What the agents counted (pushes by outcome, refusals by reason) and the largest /metrics they wrote."""
    pushes: Counter[str] = Counter()
    refused: Counter[str] = Counter()
    largest = 0
    for port in ports:
        try:
            body = http_get(f"http://127.0.0.1:{port}/metrics")
        except OSError:
            continue
        largest = max(largest, len(body))
        for line in body.decode().splitlines():
            if line.startswith(("trainpatrol_pushes_total{", "trainpatrol_refused_requests_total{")):
                label = line.split('"')[1]
                value = float(line.rsplit(" ", 1)[1])
                (pushes if line.startswith("trainpatrol_pushes") else refused)[label] += int(value)
    return {"pushes_by_outcome": dict(sorted(pushes.items())), "refused_by_reason": dict(sorted(refused.items())),
            "largest_exposition_bytes": largest}


def collect(results: Any, procs: list[Any], interval: float) -> list[dict[str, Any]]:
    """What every pusher thread counted; bounded: a pusher that does not answer is ended."""
    outs: list[dict[str, Any]] = []
    deadline = time.monotonic() + 2 * interval + 20  # a push in flight takes at most its timeouts
    for _ in procs:
        try:
            outs.extend(results.get(timeout=max(0.1, deadline - time.monotonic())))
        except Exception:  # queue.Empty, or a pusher that died
            break
    for proc in procs:
        proc.join(max(0.1, deadline - time.monotonic()))
        if proc.is_alive():
            proc.terminate()
            proc.join(5)
    return outs


def prometheus_report(watch: Watch, cpu: float, final: dict[str, float | None]) -> dict[str, Any]:
    m = watch.maxima
    return {
        "head_series": watch.last.get("prometheus_tsdb_head_series"),
        "head_series_max": m.get("prometheus_tsdb_head_series"),
        "rss_mb_max": round(m.get("process_resident_memory_bytes", 0) / 2**20, 1),
        "cpu_core_share": round(cpu, 3),
        "rule_group_last_duration_seconds_max": {g: round(v, 4) for g, v in sorted(watch.rule_seconds.items())},
        "rule_group_last_duration_seconds_median": {g: round(statistics.median(v), 4)
                                                    for g, v in sorted(watch.rule_samples.items())},
        "rule_group_last_duration_seconds_p90": {g: round(statistics.quantiles(v, n=10)[-1], 4)
                                                 for g, v in sorted(watch.rule_samples.items()) if len(v) > 1},
        # The work of one round of every group: what the groups' split into several cannot hide.
        "rule_groups_summed_seconds_median": round(sum(statistics.median(v) for v in watch.rule_samples.values()), 4),
        "slowest_rules_seconds_max": dict(sorted(((r, round(v, 4)) for r, v in watch.slowest_rules.items()),
                                                 key=lambda kv: -kv[1])[:12]),
        # The max is one unlucky evaluation (a GC pause, a scrape landing at once); the median is the rule's cost.
        "slowest_rules_seconds_median": dict(sorted(((r, round(statistics.median(v), 4))
                                                     for r, v in watch.rule_evaluations.items()),
                                                    key=lambda kv: -kv[1])[:20]),
        "rule_group_iterations_missed": {g: v for g, v in sorted(watch.missed.items()) if v},
        "rule_evaluation_failures": m.get("prometheus_rule_evaluation_failures_total"),
        "notifications_dropped": m.get("prometheus_notifications_dropped_total"),
        "scrape_duration_seconds_max": round(m.get("scrape_duration", 0), 4),
        "samples_per_scrape_round_max": m.get("samples_scraped"),
        "series_trainpatrol": final["series_trainpatrol"],
        "series_recorded": final["series_recorded"],
    }


def pushes_report(pushed: list[dict[str, Any]], wall: float) -> dict[str, Any]:
    push_ms = [x for o in pushed for x in o.get("push_ms", [])]
    late_ms = [x for o in pushed for x in o.get("late_ms", [])]
    reasons: Counter[str] = Counter()
    for o in pushed:
        reasons.update(o.get("reasons", {}))
    return {
        "ok": sum(o.get("ok", 0) for o in pushed),
        "failed": sum(o.get("failed", 0) for o in pushed),
        "retried": sum(o.get("retried", 0) for o in pushed),
        "connections_opened": sum(o.get("connections", 0) for o in pushed),
        **{f"{name}_p{q}": round(percentile(values, q / 100), 2) if values else None
           for name, values in (("push_ms", push_ms), ("late_ms", late_ms)) for q in (50, 99)},
        "push_ms_max": round(max(push_ms), 1) if push_ms else None,
        "late_ms_max": round(max(late_ms), 1) if late_ms else None,
        "failures": dict(reasons.most_common(5)),
        "pusher_threads_reporting": len(pushed),
    }


def fault_report(s: Settings, watch: Watch, pushed: list[dict[str, Any]],
                 arrivals: list[tuple[float, dict[str, str]]]) -> dict[str, Any]:
    rank = str(s.fault_rank)
    named = [(t, a) for t, a in arrivals if a.get("rank") == rank]
    arrived = [(t, a) for t, a in named if watch.fault is not None and t >= watch.fault]
    first_faulty = [o["fault_first_push"] for o in pushed if "fault_first_push" in o]
    return {
        "rank": s.fault_rank,
        "step_time_factor": STRAGGLER_FACTOR,
        "injected_at_seconds": round(watch.fault - watch.start, 1) if watch.fault else None,
        "first_faulty_push_after_seconds": watch.since_fault(min(first_faulty)) if first_faulty else None,
        "seconds_to_alert_at_receiver": watch.since_fault(arrived[0][0]) if arrived else None,
        "first_alert": arrived[0][1].get("alertname") if arrived else None,
        "seconds_to_prometheus_alert": watch.since_fault(watch.after.get("prometheus_alert")),
        "prometheus_alert": watch.named_by.get(("prometheus_alert", True)),
        "seconds_to_outlier_query": watch.since_fault(watch.after.get("outlier")),
        "outlier_named_by": watch.named_by.get(("outlier", True)),
        "outlier_query": watch.outlier or None,
        "outlier_note": None if watch.outlier else "no --outlier-query, and no recording rule named *outlier* loaded",
        "before_fault": {  # what named the fault rank before it was one, and when first (seconds into the run)
            "alerts_at_receiver": sorted({a.get("alertname", "?") for t, a in named
                                          if watch.fault is None or t < watch.fault}),
            "prometheus_alerts": watch.named_by.get(("prometheus_alert", False), []),
            "outlier_series": watch.named_by.get(("outlier", False), []),
            "outlier_at_seconds": round(watch.before["outlier"] - watch.start, 1) if "outlier" in watch.before
            else None,
        },
    }


def alerts_report(arrivals: list[tuple[float, dict[str, str]]], start: float) -> dict[str, Any]:
    """Per alert name: distinct alerts (label sets) that arrived, the ranks they named, when the first came."""
    out: dict[str, dict[str, Any]] = {}
    for t, a in arrivals:
        entry = out.setdefault(a.get("alertname", "?"), {"alerts": 0, "ranks": set(),
                                                         "first_after_start_seconds": round(t - start, 1)})
        entry["alerts"] += 1
        entry["ranks"].add(a.get("rank", ""))
    return {name: dict(e, ranks=len(e["ranks"] - {""})) for name, e in sorted(out.items())}


# --- the command ------------------------------------------------------------------------------------------

def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--agents", type=int, default=16)
    parser.add_argument("--ranks", default="1024", help="ranks of the one run, or sizes run in turn: 1024,4096")
    parser.add_argument("--seconds", type=float, default=480.0, help="measured seconds per size, after warm-up")
    parser.add_argument("--scrape-interval", type=float, default=5.0, help="Prometheus' scrape and rule interval")
    parser.add_argument("--push-interval", type=float, default=5.0, help="seconds between one rank's pushes")
    parser.add_argument("--rules", type=Path, default=REPO / "alerting" / "rules-fast.yml")
    parser.add_argument("--fault-rank", type=int, default=7)
    parser.add_argument("--fault-after", type=float, default=150.0,
                        help="seconds into the measurement at which the fault rank turns straggler (the straggler "
                             "rule's 5 m means need about 3 min after it, with at least 2 min of history before)")
    parser.add_argument("--outlier-query", default="",
                        help="PromQL whose result names outliers; the fault rank counts as named when a series with "
                             "its rank label comes back (default: recording rules named *outlier*, at the rank)")
    parser.add_argument("--pushers", type=int, default=2, help="pusher processes (each a thread per agent)")
    parser.add_argument("--alertmanager", choices=["auto", "real", "emulated"], default="auto")
    parser.add_argument("--prometheus-cpus", type=cpu_list, default=frozenset(),
                        help="pin Prometheus to these CPUs (0-3 or 0,2) and the agents and pushers to the others")
    parser.add_argument("--recording", type=Path, help="replay this recording (json or json.gz) instead of recording")
    parser.add_argument("--save-recording", type=Path, help="keep the recording here (json or json.gz)")
    parser.add_argument("--workdir", type=Path, help="configs and logs, kept (default: a temporary directory)")
    parser.add_argument("--out", type=Path, help="also write the JSON report here")
    args = parser.parse_args()
    sizes = [int(x) for x in args.ranks.split(",") if x.strip()]
    if not sizes or min(sizes) < args.agents or args.agents < 1:
        parser.error("--ranks needs at least one rank per agent")
    if not 0 <= args.fault_rank < min(sizes):
        parser.error("--fault-rank must be a rank of every size")
    if not args.rules.is_file():
        parser.error(f"--rules {args.rules}: no such file")
    if not shutil.which("prometheus"):
        parser.error("prometheus is not on PATH")

    def interrupted(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, interrupted)  # ends the way Ctrl-C does: every process stopped
    signal.signal(signal.SIGINT, signal.default_int_handler)  # also when started with SIGINT ignored (nohup, &)
    settings = Settings(args.agents, args.seconds, args.scrape_interval, args.push_interval, args.rules,
                        args.fault_rank, args.fault_after, args.outlier_query, max(1, args.pushers), args.alertmanager,
                        args.prometheus_cpus)
    took = time.monotonic()
    recording = load_recording(args.recording) if args.recording else record()
    if args.save_recording:
        save_recording(recording, args.save_recording)
    replay = Replay.of(recording)
    recorded = round(time.monotonic() - took, 1)
    results: list[dict[str, Any]] = []
    out: dict[str, Any] = {
        "bench": "fleet",
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version(), "platform": platform.platform()},
        "setup": {"recording": str(args.recording) if args.recording else f"recorded at start in {recorded} s",
                  "recorded_frames": len(replay.frames), "recorded_step_seconds": round(replay.step_seconds, 4),
                  "samples_per_push": replay.samples,
                  "push_bytes": len(json.dumps(RankSim(replay, [replay.track(1.0)], 0, 1, time.time() - 60,
                                                       random.Random(0)).snapshot())),
                  "prometheus_gogc": os.environ.get("GOGC") or "unset: Go's default, 100 (75 from Prometheus 2.53)",
                  "pushers": settings.pushers, "prometheus_cpus": sorted(settings.prometheus_cpus),
                  "others_cpus": sorted(settings.other_cpus()), "straggler_step_time_factor": STRAGGLER_FACTOR,
                  "rank_step_time_jitter": RANK_JITTER},
        "results": results,
    }
    with contextlib.ExitStack() as stack:
        base = args.workdir or Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="fleet-")))
        for ranks in sizes:
            print(f"fleet: {ranks} ranks on {args.agents} agents, {args.seconds:g} s ...", file=sys.stderr)
            try:
                results.append(measure(ranks, settings, replay, base / f"ranks-{ranks}"))
            except (ProcessExited, RuntimeError, TimeoutError, OSError) as exc:
                results.append({"ranks": ranks, "agents": args.agents, "error": str(exc)})
            except KeyboardInterrupt:
                results.append({"ranks": ranks, "agents": args.agents, "error": "interrupted"})
                out["interrupted"] = True
                break
    text = json.dumps(out, indent=2)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")
    return 130 if out.get("interrupted") else 0


if __name__ == "__main__":
    sys.exit(main())

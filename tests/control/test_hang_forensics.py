"""A hung lock-step job names the rank that is not where the others are: 4 gloo DDP ranks under torchrun, rank 2
blocks in its data loading while ranks 0, 1 and 3 wait for it in the gradient all-reduce. Every live rank writes
its part of the stall bundle (stacks, phase) from Patrol's own thread, rank 0's stall.json names rank 2 and its
phase, the agent serves each rank's stalled phase, and in a real Prometheus with the shipped rules (fast profile)
TrainPatrolRankHung names rank 2 and is the only alert of the run; a run whose loader is slow but steady writes
nothing and raises no stall alert. A rank stuck writing an action's evidence is named the same way, in the part of
the action it is in, while the others wait to agree on the outcome."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from servers import REPO, agent, http_get, http_json, prometheus, python_env, query, wait_for
from trainpatrol.probe.stall_watch import PHASES, odd_ranks

WORKER = REPO / "tests" / "control" / "lockstep_worker.py"
RULES = REPO / "alerting" / "rules-fast.yml"


def torchrun(tmp: Path, url: str, **env: str) -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "4",
                             str(WORKER)], env=python_env(AGENT_URL=url, OUT=str(tmp), OMP_NUM_THREADS="1", **env),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


@dataclass
class Job:
    url: str
    prom: str
    process: subprocess.Popen[str]
    since: float

    def finished(self) -> str:
        """The job's output, once it has exited with 0."""
        output, _ = self.process.communicate(timeout=150)
        assert self.process.returncode == 0, output[-3000:]
        return output


@contextmanager
def lockstep_job(tmp: Path, **env: str) -> Iterator[Job]:
    """The 4-rank job, its agent and a Prometheus with the fast rules; the job is killed if the test leaves early."""
    with agent(tmp) as url, prometheus(tmp, [url.removeprefix("http://")], [RULES]) as prom:
        job = Job(url, prom, torchrun(tmp, url, **env), time.time())
        try:
            yield job
        finally:
            if job.process.poll() is None:
                job.process.kill()
                job.process.wait()


def stalled_phases(url: str) -> dict[int, int]:
    out = {}
    for line in http_get(f"{url}/metrics").decode().splitlines():
        if line.startswith("trainpatrol_rank_stalled_phase{") and 'run="hang"' in line:
            rank = int(line.split('rank="')[1].split('"')[0])
            out[rank] = int(float(line.rsplit(" ", 1)[1]))
    return out


def every_rank_stalled(url: str, within: float) -> dict[int, str]:
    """Each rank's stalled phase, by name, once all four ranks have been seen stalled."""
    seen: dict[int, int] = {}

    def all_stalled() -> bool:
        seen.update(stalled_phases(url))
        return len(seen) == 4 and all(seen.values())

    wait_for(all_stalled, within, interval=0.2, what="every rank reported stalled")
    return {r: PHASES[p] for r, p in seen.items()}


def alerts_of_the_run(prom: str, since: float) -> dict[str, set[tuple[str, str]]]:
    """Every alert of run "hang" that was pending or firing since ``since``: its (rank, phase) pairs by name."""
    window = f"{int(time.time() - since) + 2}s"
    out: dict[str, set[tuple[str, str]]] = {}
    for r in query(prom, f'max_over_time(ALERTS{{run="hang"}}[{window}])'):
        m = r["metric"]
        out.setdefault(m["alertname"], set()).add((m.get("rank", ""), m.get("phase", "")))
    return out


def test_rank_2_blocked_in_its_data_is_named_while_the_others_wait_in_the_all_reduce(tmp_path: Path) -> None:
    # each forward 100 ms: compute times as even as a real lock-step job's, not the scheduler noise of a 1 ms MLP
    # on 4 processes over 2 cores, which the fast profile's Straggler (for: 0s, over the few steps of a young run)
    # reads as stragglers (at 30 ms a loaded runner once put healthy rank 0 past its 1.2)
    with lockstep_job(tmp_path, STEPS="40", HANG_RANK="2", HANG_AT="30", HANG_SECONDS="30",
                      FORWARD_SECONDS="0.1") as job:
        url, prom = job.url, job.prom
        assert every_rank_stalled(url, 150) == {0: "backward", 1: "backward", 2: "data", 3: "backward"}
        summary_file = tmp_path / "evidence" / "stall-step00000030" / "stall.json"
        wait_for(summary_file.is_file, 30, what="stall.json")
        summary = json.loads(summary_file.read_text())
        assert summary["odd_ranks"] == [2] and summary["phases"] == {
            "0": "backward", "1": "backward", "2": "data", "3": "backward"} and summary["no_part"] == []
        # gloo's Flight Recorder: the waiting ranks entered one more all-reduce than rank 2
        last = {int(r): groups["0"] for r, groups in summary["last_collectives"].items()}
        assert summary["behind_ranks"] == [2] and {v["op"] for v in last.values()} == {"gloo:all_reduce"}
        assert last[0]["seq"] == last[1]["seq"] == last[3]["seq"] == last[2]["seq"] + 1, last
        for r in range(4):
            part = tmp_path / "evidence" / "stall-step00000030" / f"rank-{r:05d}"
            assert "MainThread" in (part / "stacks.txt").read_text() or "Current thread" in (
                part / "stacks.txt").read_text()
            assert json.loads((part / "extra.json").read_text())["stall"]["step"] == 30
        hung = 'ALERTS{alertname="TrainPatrolRankHung",alertstate="firing",run="hang"}'
        wait_for(lambda: query(prom, hung), 30, interval=0.5, what="TrainPatrolRankHung firing")
        # a capture asked for while every rank is stuck is carried out from Patrol's own thread, not queued for
        # a step boundary that the hung ranks do not reach
        asked = http_json(f"{url}/v1/runs/hang/actions", {"action": "capture", "reason": "operator, while hung"})
        capture = tmp_path / "evidence" / f"stall-step00000030-capture{asked['id']}"
        wait_for((capture / "manifest.json").is_file, 20, what="the capture's bundle while the run hangs")
        assert any(stalled_phases(url).values()), "the capture came only after the hang"
        assert sorted(p.name for p in capture.glob("rank-*")) == [f"rank-{r:05d}" for r in range(4)]
        assert json.loads((capture / "trigger.json").read_text())["reason"] == "operator, while hung"
        assert json.loads((capture / "stall.json").read_text())["odd_ranks"] == [2]
        wait_for(lambda: not any(stalled_phases(url).values()), 60, what="the run steps again")
        # one alarm for the hang: RankHung for rank 2 alone; no RankStalled for every rank, no training signal
        assert alerts_of_the_run(prom, job.since) == {"TrainPatrolRankHung": {("2", "data")}}
        job.finished()


def test_a_rank_stuck_writing_an_actions_evidence_is_named_while_the_others_wait_to_agree(tmp_path: Path) -> None:
    """An action holds every rank at once, so the stall watch used to stand down while one ran: a rank whose write
    hung (a stuck filesystem) held the others in the action's agreement until the process group timed out, and
    nothing said which rank or where."""
    with lockstep_job(tmp_path, STEPS="30", CHECKPOINT_AT="5", EVIDENCE_HANG_RANK="1", HANG_SECONDS="25",
                      ACTION_STALL_SECONDS="3") as job:
        url, prom = job.url, job.prom
        assert every_rank_stalled(url, 90) == {0: "agreement", 1: "evidence", 2: "agreement", 3: "agreement"}
        hung = 'ALERTS{alertname="TrainPatrolRankHung",alertstate="firing",run="hang"}'
        wait_for(lambda: query(prom, hung), 20, interval=0.5, what="TrainPatrolRankHung firing")
        found = wait_for(lambda: list((tmp_path / "evidence").glob("stall-step*-checkpoint/stall.json")), 30,
                         what="the action's stall.json")
        summary = json.loads(found[0].read_text())
        assert summary["odd_ranks"] == [1] and summary["action"] == "checkpoint" and summary["phases"] == {
            "0": "agreement", "1": "evidence", "2": "agreement", "3": "agreement"} and summary["no_part"] == []
        part = found[0].parent / "rank-00001"
        assert "history.json" in (part / "stacks.txt").read_text() or "_json" in (part / "stacks.txt").read_text()
        wait_for(lambda: not any(stalled_phases(url).values()), 60, what="the run steps again")
        assert alerts_of_the_run(prom, job.since).get("TrainPatrolRankHung") == {("1", "evidence")}
        output = job.finished()
        # the action itself went through once the write ended: its checkpoint is complete
        assert list((tmp_path / "ckpt").glob("step-*/meta.json")), output[-3000:]


def test_a_slow_but_steady_loader_is_no_stall(tmp_path: Path) -> None:
    with lockstep_job(tmp_path, STEPS="12", SLOW_LOADER="0.4") as job:
        highest: list[int] = [0]
        done = threading.Event()

        def watch() -> None:
            while not done.is_set():
                highest[0] = max([highest[0], *stalled_phases(job.url).values()])
                done.wait(0.3)

        watcher = threading.Thread(target=watch)
        watcher.start()
        try:
            job.finished()
        finally:
            done.set()
            watcher.join()
        stall_alerts = {"TrainPatrolRankHung", "TrainPatrolRankStalled"} & set(alerts_of_the_run(job.prom, job.since))
    assert highest[0] == 0 and not list((tmp_path / "evidence").glob("stall-*")) and not stall_alerts


def test_the_odd_ranks_are_those_outside_the_common_phase() -> None:
    assert odd_ranks({0: "backward", 1: "backward", 2: "data", 3: "backward"}) == [2]
    assert odd_ranks({0: "collective", 1: "collective"}) == []
    assert odd_ranks({0: "data"}) == []

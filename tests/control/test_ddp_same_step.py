"""Issue 5: four gloo DDP ranks on two agents pause at the same step, 20 times; resume; stop with 86."""

from __future__ import annotations

import json
import subprocess
import sys
from contextlib import ExitStack
from pathlib import Path
from typing import Any

from servers import agent, free_port, http_json, python_env, wait_for
from trainpatrol import STOP_EXIT_CODE

WORLD = 4
WORKER = Path(__file__).with_name("ddp_worker.py")


def run_state(url: str, run: str) -> dict[str, Any]:
    try:
        return dict(http_json(f"{url}/v1/runs/{run}"))
    except Exception:
        return {"state": "unknown", "ranks": []}


def launch(tmp: Path, urls: list[str], run: str, **env: str) -> list[subprocess.Popen[bytes]]:
    port = str(free_port())
    procs = []
    for rank in range(WORLD):
        e = python_env(RANK=str(rank), WORLD_SIZE=str(WORLD), LOCAL_RANK=str(rank % 2), MASTER_ADDR="127.0.0.1",
                       MASTER_PORT=port, AGENT_URL=urls[rank // 2], OUT=str(tmp), RUN=run, **env)
        log = open(tmp / f"worker-{rank}.log", "wb")  # noqa: SIM115 - closed with the process
        procs.append(subprocess.Popen([sys.executable, str(WORKER)], env=e, stdout=log, stderr=subprocess.STDOUT))
    return procs


def all_in(urls: list[str], run: str, state: str) -> bool:
    views = [run_state(u, run) for u in urls]
    return all(len(v["ranks"]) == 2 and v["state"] == state for v in views)


def min_step(urls: list[str], run: str) -> int:
    return min((r["step"] for u in urls for r in run_state(u, run)["ranks"]), default=-1)


def test_pause_reaches_all_ranks_at_the_same_step_twenty_times(tmp_path: Path) -> None:
    with ExitStack() as stack:
        urls = [stack.enter_context(agent(tmp_path, "--no-nvml")) for _ in range(2)]
        procs = launch(tmp_path, urls, "ddp", SLOW_RANK="3", SLOW_SECONDS="0.01")
        try:
            wait_for(lambda: all_in(urls, "ddp", "running") and min_step(urls, "ddp") > 3, 90, what="4 ranks up")
            for i in range(20):
                to, other = (urls[0], urls[1]) if i % 2 == 0 else (urls[1], urls[0])
                http_json(f"{to}/v1/runs/ddp/actions", {"action": "pause", "reason": f"repetition {i}"})
                wait_for(lambda: all_in(urls, "ddp", "paused"), 60, what=f"all paused (repetition {i})")
                steps = {r["step"] for u in urls for r in run_state(u, "ddp")["ranks"]}
                assert len(steps) == 1, f"repetition {i}: ranks paused at different steps {steps}"
                paused_at = steps.pop()
                http_json(f"{other}/v1/runs/ddp/actions", {"action": "resume", "reason": f"repetition {i}"})
                wait_for(lambda at=paused_at: min_step(urls, "ddp") > at, 60, what=f"resumed (repetition {i})")
            http_json(f"{urls[1]}/v1/runs/ddp/actions", {"action": "stop", "reason": "end of test"})
            codes = [p.wait(timeout=120) for p in procs]
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
        logs = "\n".join((tmp_path / f"worker-{r}.log").read_text()[-2000:] for r in range(WORLD))
        assert codes == [STOP_EXIT_CODE] * WORLD, logs

    records = [json.loads((tmp_path / f"rank-{r}.json").read_text()) for r in range(WORLD)]
    per_rank = [{(a["id"], a["action"]): a["step"] for a in rec["actions"]} for rec in records]
    assert all(p == per_rank[0] for p in per_rank), "ranks disagree on the step of some action"
    # every rank's own record: 20 pauses and 20 resumes (the deque keeps the last 32 actions), one stop
    actions = [a["action"] for a in records[0]["actions"]]
    assert actions.count("stop") == 1 and actions[-1] == "stop"
    assert actions.count("pause") >= 15 and actions.count("resume") >= 15
    assert all(a["outcome"] == "ok" for rec in records for a in rec["actions"])
    assert len({rec["steps"] for rec in records}) == 1
    # replicated state once (rank 0), per-rank state per rank, in every checkpoint; pause ones pinned
    checkpoints = sorted((tmp_path / "ckpt").glob("step-*"))
    assert len(checkpoints) == 8  # the newest keep_pinned_checkpoints of the pauses' and the stop's
    for ckpt in checkpoints:
        assert sorted(p.name for p in ckpt.iterdir()) == ["meta.json", "rank-00000.pt", "rank-00001.pt",
                                                          "rank-00002.pt", "rank-00003.pt", "state.bin"]
        assert json.loads((ckpt / "meta.json").read_text())["pinned"] is True


def test_nan_on_rank_one_pauses_every_rank_through_the_local_guard(tmp_path: Path) -> None:
    with agent(tmp_path, "--no-nvml") as url:
        urls = [url, url]
        procs = launch(tmp_path, urls, "nan", NAN_AT="25")
        try:
            wait_for(lambda: run_state(url, "nan")["state"] == "paused" and len(run_state(url, "nan")["ranks"]) == 4,
                     90, what="all 4 ranks paused")
            steps = {r["step"] for r in run_state(url, "nan")["ranks"]}
            assert len(steps) == 1 and steps.pop() >= 25
            http_json(f"{url}/v1/runs/nan/actions", {"action": "stop", "reason": "end of test"})
            codes = [p.wait(timeout=120) for p in procs]
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
    assert codes == [STOP_EXIT_CODE] * WORLD
    records = [json.loads((tmp_path / f"rank-{r}.json").read_text()) for r in range(WORLD)]
    pauses = [[a for a in rec["actions"] if a["action"] == "pause"] for rec in records]
    assert all(len(p) == 1 for p in pauses)
    assert len({p[0]["step"] for p in pauses}) == 1
    manifest = json.loads((Path(pauses[0][0]["evidence"]) / "manifest.json").read_text())
    assert manifest["world_size"] == 4 and manifest["action"] == "pause"
    trigger = json.loads((Path(pauses[0][0]["evidence"]) / "trigger.json").read_text())
    assert trigger["source"] in ("guard:nonfinite_loss", "agreed with another rank")
    trig1 = json.loads((Path(pauses[1][0]["evidence"]) / "trigger.json").read_text())
    assert trig1["source"] in ("guard:nonfinite_loss", "agreed with another rank")

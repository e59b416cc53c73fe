"""The embedded agent: started by the first run on a host, used by every run there, ended by none.

Real processes throughout: training scripts (tests/probe/embedded_run.py) whose Patrol starts a real
``trainpatrol agent``, driven through the agent's HTTP API as a user's CLI would."""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from contextlib import AbstractContextManager
from pathlib import Path

from servers import free_port, http_get, http_json, process, python_env, wait_for
from trainpatrol.actions import STOP_EXIT_CODE
from trainpatrol.agent.server import STARTUP_FAILURE
from trainpatrol.probe import embedded
from trainpatrol.probe.embedded import agent_answers, start_embedded_agent

SCRIPT = str(Path(__file__).with_name("embedded_run.py"))
IDLE = 3.0  # the agent's --exit-when-idle in these tests (60 s by default)


def training(tmp: Path, url: str, run: str, steps: int) -> AbstractContextManager[subprocess.Popen[bytes]]:
    cmd = [sys.executable, SCRIPT, url, run, str(tmp / run), str(steps), str(IDLE)]
    return process(cmd, tmp / f"{run}.log", env=python_env())


def run_state(url: str, run: str) -> str:
    try:
        return str(http_json(f"{url}/v1/runs/{run}")["state"])
    except OSError:
        return ""


def act(url: str, run: str, action: str) -> None:
    http_json(f"{url}/v1/runs/{run}/actions", {"action": action, "reason": "from the test"})


def step_total(url: str, run: str) -> float:
    prefix = f'trainpatrol_step_total{{rank="0",run="{run}"}} '
    for line in http_get(f"{url}/metrics").decode().splitlines():
        if line.startswith(prefix):
            return float(line[len(prefix):])
    return -1.0


def push_trouble(log: Path) -> list[str]:
    """Lines a user would read as the monitoring failing."""
    words = ("push to agent", "Broken pipe", "Connection refused", "none answers")
    return [line for line in log.read_text().splitlines() if any(w in line for w in words)]


def test_a_second_run_keeps_metrics_and_control_after_the_run_that_started_the_agent_ends(tmp_path: Path) -> None:
    url = f"http://127.0.0.1:{free_port()}"
    # The first run ends only once the second pushes: a loaded machine may take longer than the idle
    # time to start the second, and an agent nobody pushes to then rightly exits.
    with training(tmp_path, url, "first", steps=100_000) as first:
        wait_for(lambda: run_state(url, "first") == "running", 60, what="first run pushing")
        with training(tmp_path, url, "second", steps=100_000) as second:
            wait_for(lambda: run_state(url, "second") == "running", 60, what="second run pushing")
            (tmp_path / "first").mkdir(exist_ok=True)
            (tmp_path / "first" / "finish").touch()
            assert first.wait(timeout=60) == 0
            time.sleep(IDLE + 1.0)  # longer than the agent's idle time: only the second run keeps it up
            assert run_state(url, "first") == "closed"
            before = step_total(url, "second")
            wait_for(lambda: step_total(url, "second") > before, 10, what="second run's steps on /metrics")
            act(url, "second", "pause")
            wait_for(lambda: run_state(url, "second") == "paused", 10, what="second run paused")
            act(url, "second", "stop")
            assert second.wait(timeout=30) == STOP_EXIT_CODE
    assert push_trouble(tmp_path / "first.log") == []
    assert push_trouble(tmp_path / "second.log") == []
    assert agent_answers(url)  # both runs have ended; the agent waits IDLE seconds for another
    wait_for(lambda: not agent_answers(url), IDLE + 10, what="the idle agent exiting by itself")


def test_a_run_that_starts_pauses_resumes_and_ends_logs_no_push_failure(tmp_path: Path) -> None:
    url = f"http://127.0.0.1:{free_port()}"
    with training(tmp_path, url, "demo", steps=200) as run:
        wait_for(lambda: run_state(url, "demo") == "running", 60, what="run pushing")
        act(url, "demo", "pause")
        wait_for(lambda: run_state(url, "demo") == "paused", 10, what="paused")
        time.sleep(1.0)
        act(url, "demo", "resume")
        wait_for(lambda: run_state(url, "demo") == "running", 10, what="resumed")
        assert run.wait(timeout=60) == 0
    log = (tmp_path / "demo.log").read_text()
    assert "finished demo" in log
    assert "an embedded agent serves" in log
    assert push_trouble(tmp_path / "demo.log") == []
    # what a pause and a resume log, and nothing else
    expected = tuple(f"WARNING trainpatrol: trainpatrol: {what}" for what in
                     ("pause at step ", "run demo paused", "resume at step ", "run demo resumed"))
    warnings = [line for line in log.splitlines() if line.startswith("WARNING")]
    assert [w for w in warnings if not w.startswith(expected)] == []
    assert len(warnings) == 4, warnings


def test_two_runs_starting_an_agent_on_one_port_at_once_end_with_one_agent() -> None:
    url = f"http://127.0.0.1:{free_port()}"
    answered: list[bool] = []
    threads = [threading.Thread(target=lambda: answered.append(
        start_embedded_agent(url, extra_args=["--no-nvml"], idle_seconds=IDLE))) for _ in range(2)]
    already = list(embedded._started)
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert answered == [True, True]
        ours = [p for p in embedded._started if p not in already]
        assert len(ours) == 2
        wait_for(lambda: sum(p.poll() is not None for p in ours) == 1, 20, what="the second agent giving up")
        # the loser found the port taken: by the CLI's check (1), or at its bind when both passed the check (3)
        [lost] = [p.returncode for p in ours if p.returncode is not None]
        assert lost in (1, STARTUP_FAILURE)
        assert agent_answers(url)
        wait_for(lambda: all(p.poll() is not None for p in ours), IDLE + 10, what="the idle agent exiting")
        assert [p.returncode for p in ours].count(0) == 1
    finally:
        for p in embedded._started:
            if p not in already and p.poll() is None:
                p.terminate()
                p.wait(10)


def test_the_agent_exits_by_itself_when_no_rank_pushes(tmp_path: Path) -> None:
    port = free_port()
    cmd = [sys.executable, "-m", "trainpatrol", "agent", "--port", str(port), "--no-nvml", "--exit-when-idle", "2"]
    started = time.monotonic()
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=30, env=python_env())
    assert result.returncode == 0, result.stderr
    assert 2 <= time.monotonic() - started < 15
    assert "no rank has pushed for 2 s: exiting" in result.stderr


def test_a_local_rank_that_starts_before_rank_0_waits_for_its_agent_without_warning(tmp_path: Path) -> None:
    url = f"http://127.0.0.1:{free_port()}"
    cmd = [sys.executable, SCRIPT, url, "ranks", str(tmp_path / "ranks"), "60", str(IDLE)]
    with process(cmd, tmp_path / "rank1.log", env=python_env(LOCAL_RANK="1", RANK="1", WORLD_SIZE="2")) as rank1:
        time.sleep(2.0)  # rank 1 is up and would have pushed by now
        assert not agent_answers(url)
        with process(cmd, tmp_path / "rank0.log", env=python_env(LOCAL_RANK="0", RANK="0", WORLD_SIZE="2")) as rank0:
            assert rank0.wait(timeout=60) == 0
            assert rank1.wait(timeout=60) == 0
    assert "finished ranks" in (tmp_path / "rank1.log").read_text()
    assert push_trouble(tmp_path / "rank1.log") == []
    assert push_trouble(tmp_path / "rank0.log") == []

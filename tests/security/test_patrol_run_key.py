"""A Patrol proves its run's key with every push, on the stream and by single request; another
process, even one that knows the run's name and rank, is refused."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from pathlib import Path

import pytest
import torch

from loops import scripted_patrol
from rank_client import counter, make_agent
from servers import agent_in_thread, wait_for
from trainpatrol.probe.snapshot import config_dict


def test_a_patrols_pushes_carry_its_run_key_and_a_forger_is_refused(tmp_path: Path) -> None:
    agent = make_agent()
    with agent_in_thread(agent.app) as port:
        patrol = scripted_patrol(tmp_path, f"http://127.0.0.1:{port}", run="keyed", push_interval_seconds=0.2)
        try:
            patrol.boundary()
            patrol.step(torch.tensor(1.0), grad_norm=torch.tensor(0.5))
            assert patrol._publisher.push_now()  # a single request
            wait_for(lambda: counter(agent, "trainpatrol_pushes_total", outcome="ok") >= 3, 10,
                     what="stream pushes besides the single one")
            forged = json.dumps({"run": "keyed", "rank": 0, "done_commands": [1]}).encode()
            req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/push", data=forged, method="POST",
                                         headers={"Content-Type": "application/json"})
            with pytest.raises(urllib.error.HTTPError) as refused:
                urllib.request.urlopen(req, timeout=5)
            assert refused.value.code == 403
            assert patrol._publisher.push_now()
            assert counter(agent, "trainpatrol_pushes_total", outcome="wrong_run_key") == 1.0
            assert "run_key" not in config_dict(patrol.config)
        finally:
            patrol.close()
    assert agent.store.runs()["keyed"]["state"] == "closed"


def test_ranks_without_a_process_group_push_without_a_key_and_say_so(monkeypatch: pytest.MonkeyPatch,
                                                                      caplog: pytest.LogCaptureFixture) -> None:
    from trainpatrol.probe.run_key import run_key

    cpu = torch.device("cpu")
    monkeypatch.setenv("WORLD_SIZE", "1")
    made = run_key("", False, cpu)
    assert len(made) == 32 and made != run_key("", False, cpu)
    assert run_key("from-the-launcher", False, cpu) == "from-the-launcher"
    monkeypatch.setenv("WORLD_SIZE", "2")
    with caplog.at_level("WARNING", logger="trainpatrol"):
        assert run_key("", False, cpu) == ""
    assert "give every rank the same TRAINPATROL_RUN_KEY" in caplog.text
    assert run_key("from-the-launcher", False, cpu) == "from-the-launcher"

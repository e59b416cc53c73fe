"""Runs are (namespace, run): two namespaces with a run of the same name cannot touch each other."""

from __future__ import annotations

from typing import Any

from rank_client import AUTH, alert, loopback, make_agent, payload, push, snapshot

A, B = "team-a", "team-b"
A_TOKEN = "team-a-token"


def _two_runs(**config: Any) -> tuple[Any, Any]:
    agent = make_agent(**config)
    client = loopback(agent)
    for ns, key in ((A, "key-a"), (B, "key-b")):
        for rank in (0, 1):
            assert push(client, key, namespace=ns, rank=rank).status_code == 200
    return agent, client


def test_a_push_with_one_namespaces_key_cannot_push_into_the_other() -> None:
    agent, client = _two_runs()
    r = push(client, "key-a", namespace=B, rank=1, step=99)
    assert r.status_code == 403
    assert {(e.snapshot.namespace, e.snapshot.rank): e.snapshot.step
            for e in agent.store.entries()} == {(A, 0): 5, (A, 1): 5, (B, 0): 5, (B, 1): 5}


def test_an_action_for_one_namespace_reaches_only_its_ranks() -> None:
    agent, client = _two_runs()
    r = client.post(f"/v1/namespaces/{A}/runs/train/actions", json={"action": "pause"}, headers=AUTH)
    assert r.status_code == 202, r.text
    cid = r.json()["id"]
    assert r.json()["namespace"] == A
    assert [c["id"] for c in push(client, "key-a", namespace=A, rank=0).json()["commands"]] == [cid]
    assert push(client, "key-b", namespace=B, rank=0).json()["commands"] == []
    # the old route addresses the run of the empty namespace, which does not exist here
    assert client.post("/v1/runs/train/actions", json={"action": "pause"}, headers=AUTH).status_code == 404
    # B's ranks cannot acknowledge A's command, and A's acknowledgement retires it for A only
    assert push(client, "key-b", namespace=A, rank=0, done_commands=[cid]).status_code == 403
    for rank in (0, 1):
        push(client, "key-a", namespace=A, rank=rank, done_commands=[cid])
    assert agent.store.pending("train", namespace=A) == []
    assert agent.store.pending("train", namespace=B) == []


def test_a_webhook_alert_acts_on_the_run_of_its_namespace_label() -> None:
    agent, client = _two_runs()
    r = client.post("/v1/alertmanager", json=payload(alert("f1", namespace=B)), headers=AUTH)
    assert r.status_code == 202, r.text
    assert [c.action for c in agent.store.pending("train", namespace=B)] == ["pause"]
    assert agent.store.pending("train", namespace=A) == []


def test_a_namespace_token_reaches_only_its_namespace() -> None:
    agent, client = _two_runs(namespace_tokens={A: A_TOKEN})
    scoped = {"Authorization": f"Bearer {A_TOKEN}"}
    assert client.post(f"/v1/namespaces/{B}/runs/train/actions", json={"action": "pause"},
                       headers=scoped).status_code == 403
    assert client.post(f"/v1/namespaces/{A}/runs/train/actions", json={"action": "pause"},
                       headers=scoped).status_code == 202
    r = client.post("/v1/alertmanager", json=payload(alert("f2", namespace=B)), headers=scoped)
    assert [x["outcome"] for x in r.json()["results"]] == ["forbidden_namespace"]
    assert agent.store.pending("train", namespace=B) == []
    # from another host, the scoped token pushes for its own namespace only
    from fastapi.testclient import TestClient

    remote = TestClient(agent.app, base_url="http://localhost")
    ok = remote.post("/v1/push", json=snapshot(namespace=A, rank=0),
                     headers={**scoped, "X-Trainpatrol-Run-Key": "key-a"})
    assert ok.status_code == 200
    refused = remote.post("/v1/push", json=snapshot(namespace=B, rank=0),
                          headers={**scoped, "X-Trainpatrol-Run-Key": "key-b"})
    assert refused.status_code == 403


def test_the_cli_acts_on_the_run_of_the_namespace_it_names(capsys: Any, monkeypatch: Any) -> None:
    from rank_client import TOKEN
    from servers import agent_in_thread
    from trainpatrol.cli import main

    agent, _ = _two_runs()
    monkeypatch.setenv("TRAINPATROL_TOKEN", TOKEN)
    with agent_in_thread(agent.app) as port:
        args = ["pause", "train", "--agent", f"http://127.0.0.1:{port}", "--namespace", B]
        assert main(args) == 0
        assert main(args) == 0
    first, again = capsys.readouterr().out.splitlines()
    (command,) = agent.store.pending("train", namespace=B)
    assert first == f"pause queued for run train (id {command.id}; 2 live ranks)"
    assert again == f"pause already queued for run train (id {command.id}; 2 live ranks)"
    assert agent.store.pending("train", namespace=A) == []


def test_namespace_tokens_and_rate_limits_come_from_the_environment_or_a_file(tmp_path: Any) -> None:
    import pytest

    from trainpatrol.agent.config import AgentConfig, ConfigError

    tokens = tmp_path / "tokens"
    tokens.write_text("# namespace=token\nteam-a=from-file\nteam-c=only-in-file\n")
    env = {"TRAINPATROL_NAMESPACE_TOKENS": "team-a=from-env,team-b=b-token",
           "TRAINPATROL_NAMESPACE_TOKENS_FILE": str(tokens), "TRAINPATROL_ACTION_RATE_LIMITS": "capture=1"}
    config = AgentConfig.from_env(env).load()
    assert config.namespace_tokens == {"team-a": "from-env", "team-b": "b-token", "team-c": "only-in-file"}
    assert config.action_rate_limits == {"capture": 1}
    with pytest.raises(ConfigError, match="Config 'namespace_tokens' has entry 'Team_A'"):
        AgentConfig(namespace_tokens={"Team_A": "x"}).load()
    with pytest.raises(ConfigError, match="Config 'action_rate_limits' has entry frobnicate=1"):
        AgentConfig(action_rate_limits={"frobnicate": 1}).load()

"""Helpers for the security tests: an in-process agent, and raw HTTP with any Host header."""

from __future__ import annotations

import http.client
import json
from typing import Any

from fastapi.testclient import TestClient

from trainpatrol.agent.app import Agent
from trainpatrol.agent.config import AgentConfig

TOKEN = "edge-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}


def make(**overrides: Any) -> tuple[Agent, TestClient]:
    """A token agent and a client that names it ``localhost``, as a local CLI would."""
    agent = Agent(AgentConfig(**{"token": TOKEN, "nvml": False, **overrides}).load())
    return agent, TestClient(agent.app, base_url="http://localhost")


def snapshot(run: str = "r1", rank: int = 0, world_size: int = 2, **extra: Any) -> dict[str, Any]:
    return {"run": run, "rank": rank, "world_size": world_size, "step": 5, **extra}


def alert(run: str = "r1", action: str = "pause", fp: str = "fp1", **labels: str) -> dict[str, Any]:
    return {"status": "firing", "labels": {"alertname": "TrainPatrolNonFiniteLoss", "run": run, "action": action,
                                           **labels},
            "annotations": {"summary": "Loss is NaN or Inf."}, "startsAt": "2026-12-01T00:00:00Z",
            "fingerprint": fp}


def payload(*alerts: dict[str, Any], **extra: Any) -> dict[str, Any]:
    return {"version": "4", "status": "firing", "alerts": list(alerts), **extra}


def raw(port: int, method: str, path: str, host: str, body: bytes | None = None,
        headers: dict[str, str] | None = None, timeout: float = 5.0) -> tuple[int, dict[str, Any]]:
    """One request to 127.0.0.1:``port`` with ``host`` as its Host header; (status, JSON answer)."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        conn.putrequest(method, path, skip_host=True, skip_accept_encoding=True)
        conn.putheader("Host", host)
        for name, value in {"Content-Type": "application/json", **(headers or {})}.items():
            conn.putheader(name, value)
        conn.putheader("Content-Length", str(len(body or b"")))
        conn.endheaders(body)
        response = conn.getresponse()
        data = response.read()
        try:
            return response.status, json.loads(data or b"null")
        except ValueError:
            return response.status, {"text": data.decode("utf-8", "replace")}
    finally:
        conn.close()

"""Start the real components on 127.0.0.1 for tests: Prometheus, Alertmanager, the agent, a demo run.

Every wait is bounded; every process is killed on exit.
"""

from __future__ import annotations

import http.server
import json
import os
import shutil
import socket
import subprocess
import sys
import time
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from trainpatrol import handshake
from trainpatrol._process import terminate

PROMETHEUS = shutil.which("prometheus")
ALERTMANAGER = shutil.which("prometheus-alertmanager") or shutil.which("alertmanager")
PROMTOOL = shutil.which("promtool")
AMTOOL = shutil.which("amtool")
REPO = Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_for(predicate: Callable[[], Any], timeout: float, interval: float = 0.1, what: str = "condition") -> Any:
    deadline = time.monotonic() + timeout
    last_exc: Exception | None = None
    while time.monotonic() < deadline:
        try:
            value = predicate()
            if value:
                return value
        except Exception as exc:  # the server may not be up yet
            last_exc = exc
        time.sleep(interval)
    raise TimeoutError(f"timed out after {timeout}s waiting for {what}; last error: {last_exc!r}")


def holds_for(predicate: Callable[[], Any], seconds: float, interval: float = 0.05, what: str = "condition") -> None:
    """Assert that ``predicate`` stays true for the whole of ``seconds`` (checked every ``interval``)."""
    deadline = time.monotonic() + seconds
    while True:
        assert predicate(), f"{what} stopped holding"
        if time.monotonic() >= deadline:
            return
        time.sleep(interval)


def answer_json(handler: http.server.BaseHTTPRequestHandler, status: int, body: Any) -> None:
    """Reply from a test HTTP server's handler with ``body`` as JSON."""
    data = json.dumps(body).encode()
    handler.send_response(status)
    handler.send_header("Content-Type", "application/json")
    handler.send_header("Content-Length", str(len(data)))
    handler.end_headers()
    handler.wfile.write(data)


def raw_answer(s: socket.socket) -> tuple[bytes, bytes]:
    """One whole HTTP answer read off ``s``: its head (status line and headers) and its Content-Length of body. A
    server may write the head and the body apart, so one ``recv`` can hold the head alone."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = s.recv(4096)
        assert chunk, f"closed before the end of the head: {data!r}"
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    length = int(next((line.split(b":")[1] for line in head.split(b"\r\n")
                       if line.lower().startswith(b"content-length")), b"0"))
    while len(body) < length:
        chunk = s.recv(4096)
        assert chunk, f"closed before the end of the body: {head!r} {body!r}"
        body += chunk
    return head, body


def http_get(url: str, timeout: float = 2.0) -> bytes:
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return bytes(r.read())


def http_json(url: str, body: Any = None, token: str = "", timeout: float = 5.0, method: str = "") -> Any:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, method=method or ("POST" if data is not None else "GET"))
    req.add_header("Content-Type", "application/json")
    if token:
        req.add_header("Authorization", f"Bearer {token}")
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read() or b"null")


@contextmanager
def process(args: list[str], log: Path, env: dict[str, str] | None = None) -> Iterator[subprocess.Popen[bytes]]:
    with open(log, "wb") as out:
        proc = subprocess.Popen(args, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    try:
        yield proc
    finally:
        terminate(proc)


def python_env(**extra: str) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONUNBUFFERED"] = "1"
    env.update(extra)
    return env


@contextmanager
def serving(cmd: list[str], log: Path, port: int, ready_path: str, timeout: float,
            env: dict[str, str] | None = None) -> Iterator[str]:
    """Start ``cmd``, wait until ``ready_path`` answers on ``port`` (or the process dies); yield the URL."""
    with process(cmd, log, env=env) as proc:
        url = f"http://127.0.0.1:{port}"
        wait_for(lambda: proc.poll() is not None or http_get(url + ready_path), timeout, what=f"{cmd[0]} ready")
        assert proc.poll() is None, log.read_text()
        yield url


@contextmanager
def agent_in_thread(app: Any, port: int | None = None, keep_alive: float = 5.0) -> Iterator[int]:
    """uvicorn serving ``app`` (an in-process ``Agent.app``) on 127.0.0.1 from a thread; yields its port.

    For tests that drive a real HTTP server and look at the same ``Agent`` object. ``keep_alive``:
    seconds after which the server closes an idle kept-alive connection (uvicorn's default is 5)."""
    import threading

    import uvicorn

    port = port or free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning",
                                           timeout_graceful_shutdown=1,
                                           timeout_keep_alive=keep_alive))  # type: ignore[arg-type]
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    key = getattr(app, "identity_key", "")
    try:
        wait_for(lambda: server.started, 10, what="uvicorn started")
        if key:  # as the agent's own server does: its user's ranks check it with this (trainpatrol.handshake)
            handshake.write_key(port, key)
        yield port
    finally:
        server.should_exit = True
        thread.join(10)
        if key:
            handshake.remove_key(port, key)
        assert not thread.is_alive(), "uvicorn did not stop"


@contextmanager
def agent(tmp: Path, *args: str, port: int | None = None, env: dict[str, str] | None = None) -> Iterator[str]:
    """A real ``trainpatrol agent`` process; yields its base URL."""
    port = port or free_port()
    cmd = [sys.executable, "-m", "trainpatrol", "agent", "--host", "127.0.0.1", "--port", str(port), *args]
    with serving(cmd, tmp / f"agent-{port}.log", port, "/healthz", 20, env=env or python_env()) as url:
        yield url


@contextmanager
def prometheus(tmp: Path, targets: list[str], rule_files: list[Path] = (),  # type: ignore[assignment]
               alertmanager_url: str = "", interval: str = "1s", labels: dict[str, str] | None = None,
               other_jobs: dict[str, list[str]] | None = None, extra_config: dict[str, Any] | None = None,
               flags: tuple[str, ...] = ()) -> Iterator[str]:
    """A real Prometheus scraping ``targets`` (host:port) every ``interval``; yields its base URL.

    ``labels`` become target labels, with honor_labels on as the chart's monitors set it; ``other_jobs``
    (job name to targets) are scraped beside, with the same target labels. ``extra_config``: more top-level
    sections (``remote_write``, ...; a mapping such as ``global`` is merged into the one above); ``flags``:
    more command-line flags (``--web.enable-remote-write-receiver``, ...)."""
    assert PROMETHEUS, "prometheus binary not installed"
    port = free_port()
    cfg: dict[str, Any] = {
        "global": {"scrape_interval": interval, "evaluation_interval": interval, "scrape_timeout": interval},
        "scrape_configs": [{"job_name": job, "honor_labels": bool(labels),
                            "static_configs": [{"targets": job_targets, "labels": labels or {}}]}
                           for job, job_targets in {"trainpatrol": targets, **(other_jobs or {})}.items()],
        "rule_files": [str(p) for p in rule_files],
    }
    if alertmanager_url:
        host = urllib.parse.urlparse(alertmanager_url).netloc
        cfg["alerting"] = {"alertmanagers": [{"static_configs": [{"targets": [host]}]}]}
    for key, value in (extra_config or {}).items():
        cfg[key] = {**cfg[key], **value} if isinstance(value, dict) and isinstance(cfg.get(key), dict) else value
    (tmp / "prometheus.yml").write_text(json.dumps(cfg))
    cmd = [PROMETHEUS, f"--config.file={tmp / 'prometheus.yml'}", f"--storage.tsdb.path={tmp / 'tsdb'}",
           f"--web.listen-address=127.0.0.1:{port}", "--web.enable-lifecycle", "--log.level=warn", *flags]
    with serving(cmd, tmp / "prometheus.log", port, "/-/ready", 30) as url:
        yield url


@contextmanager
def alertmanager(tmp: Path, config_yaml: str) -> Iterator[str]:
    """A real Alertmanager with ``config_yaml``; clustering off so it binds loopback only."""
    assert ALERTMANAGER, "alertmanager binary not installed"
    port = free_port()
    (tmp / "alertmanager.yml").write_text(config_yaml)
    cmd = [ALERTMANAGER, f"--config.file={tmp / 'alertmanager.yml'}", f"--storage.path={tmp / 'am'}",
           f"--web.listen-address=127.0.0.1:{port}", "--cluster.listen-address=", "--log.level=warn"]
    with serving(cmd, tmp / "alertmanager.log", port, "/-/ready", 30) as url:
        yield url


def query(prom_url: str, expr: str, at: float | None = None) -> list[dict[str, Any]]:
    """Instant query; returns the result vector."""
    params = {"query": expr}
    if at is not None:
        params["time"] = str(at)
    body = http_json(f"{prom_url}/api/v1/query?{urllib.parse.urlencode(params)}")
    assert body["status"] == "success", body
    return list(body["data"]["result"])


def query_value(prom_url: str, expr: str) -> float | None:
    result = query(prom_url, expr)
    if not result:
        return None
    return float(result[0]["value"][1])


@contextmanager
def alert_loop(tmp: Path, rules: Path, token_file: Path, group_interval: str = "1s") -> Iterator[tuple[str, str, str]]:
    """The whole loop: an agent holding the token in ``token_file``, an Alertmanager routing as
    alerting/alertmanager.yml does to that agent's webhook (bearer ``token_file``, ``group_wait: 0s``,
    ``group_interval`` overridden so resolved notifications come quickly), and a Prometheus evaluating
    ``rules`` every second. Yields the agent, Prometheus and Alertmanager URLs."""
    from trainpatrol.stack import WEBHOOK_PATH, alertmanager_config

    template = (REPO / "alerting" / "alertmanager.yml").read_text()
    with agent(tmp, "--no-nvml", "--token-file", str(token_file)) as agent_url:
        am_yaml = alertmanager_config(template, agent_url + WEBHOOK_PATH, token_file, group_interval=group_interval)
        with alertmanager(tmp, am_yaml) as am_url, \
                prometheus(tmp, [agent_url.removeprefix("http://")], [rules], alertmanager_url=am_url) as prom_url:
            yield agent_url, prom_url, am_url



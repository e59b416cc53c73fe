"""Finding 6: idle, slow-header, slow-body and slow-chunked-body connections cannot exhaust the agent's
file descriptors; a request with a wrong token is refused before its body arrives."""

from __future__ import annotations

import http.client
import json
import socket
import sys
import threading
import time
from pathlib import Path

from _edge import raw

sys.path.insert(0, str(Path(__file__).parents[2] / "bench"))
from trickle import Trickle

from servers import free_port, http_get, process, python_env, raw_answer, serving, wait_for

HOSTILE_PER_KIND = 75
"""Four kinds: 300 hostile connections against an agent allowed 256 descriptors."""


def _hostile(port: int, kind: str) -> socket.socket | None:
    s = socket.socket()
    s.settimeout(2)
    try:
        s.connect(("127.0.0.1", port))
        host = f"Host: 127.0.0.1:{port}\r\n".encode()
        if kind == "slow-header":
            s.sendall(b"GET /healthz HTTP/1.1\r\n" + host)
        elif kind == "slow-body":
            s.sendall(b"POST /v1/push HTTP/1.1\r\n" + host + b"Content-Type: application/json\r\n"
                      b"Content-Length: 200000\r\n\r\n{\"run\"")
        elif kind == "slow-chunked-body":
            s.sendall(b"POST /v1/push HTTP/1.1\r\n" + host + b"Content-Type: application/json\r\n"
                      b"Transfer-Encoding: chunked\r\n\r\n1\r\n{\r\n")
    except OSError:  # refused or reset: the agent let it go, as it should under load
        s.close()
        return None
    return s


def test_health_and_scrapes_answer_while_300_hostile_connections_hold_on(tmp_path: Path) -> None:
    port = free_port()
    env = python_env(TRAINPATROL_MAX_CONNECTIONS="100", TRAINPATROL_HEADER_TIMEOUT_SECONDS="1",
                     TRAINPATROL_BODY_TIMEOUT_SECONDS="1")
    cmd = [sys.executable, "-c", "import resource, sys; "
           "resource.setrlimit(resource.RLIMIT_NOFILE, (128, 256)); "
           "from trainpatrol.cli import main; sys.exit(main(sys.argv[1:]))",
           "agent", "--no-nvml", "--host", "127.0.0.1", "--port", str(port)]
    with process(cmd, tmp_path / "agent.log", env=env) as proc:
        here = f"127.0.0.1:{port}"
        wait_for(lambda: http_get(f"http://{here}/healthz"), 20, what="agent ready")
        limits = Path(f"/proc/{proc.pid}/limits").read_text()
        assert [line.split()[3:5] for line in limits.splitlines() if line.startswith("Max open files")] == \
            [["256", "256"]], limits
        hostile = [_hostile(port, kind) for kind in ("idle", "slow-header", "slow-body", "slow-chunked-body")
                   for _ in range(HOSTILE_PER_KIND)]
        try:
            deadline = time.monotonic() + 6
            answered = 0
            while time.monotonic() < deadline:
                started = time.monotonic()
                assert raw(port, "GET", "/healthz", here, timeout=3)[0] == 200
                assert raw(port, "GET", "/metrics", here, timeout=3)[0] == 200
                assert time.monotonic() - started < 3
                answered += 1
                hostile.append(_hostile(port, "idle"))  # and the flood goes on
                time.sleep(0.5)
            assert answered >= 5
            metrics = raw(port, "GET", "/metrics", here)[1]["text"]
            for reason in ("connections", "header_timeout", "body_timeout"):
                assert f'trainpatrol_refused_requests_total{{reason="{reason}"}}' in metrics, reason
        finally:
            for s in hostile:
                if s is not None:
                    s.close()


def test_a_wrong_token_with_a_large_body_is_401_before_the_body_arrives(tmp_path: Path) -> None:
    port = free_port()
    env = python_env(TRAINPATROL_TOKEN="right-token")
    cmd = [sys.executable, "-m", "trainpatrol", "agent", "--no-nvml", "--host", "127.0.0.1", "--port", str(port)]
    with serving(cmd, tmp_path / "agent.log", port, "/healthz", 20, env=env):
        for path in ("/v1/push", "/v1/alertmanager", "/v1/runs/r1/actions"):
            with socket.create_connection(("127.0.0.1", port), timeout=2) as s:
                s.sendall(f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nAuthorization: Bearer wrong\r\n"
                          "Content-Type: application/json\r\nContent-Length: 500000\r\n\r\n{".encode())
                started = time.monotonic()
                head = s.recv(4096)
                assert head.startswith(b"HTTP/1.1 401 "), (path, head)
                assert time.monotonic() - started < 1.5


def _closed_by_peer(s: socket.socket, within: float) -> bool:
    """Did the agent close ``s`` (the agent sends nothing before it does) within ``within`` seconds?"""
    s.settimeout(within)
    try:
        s.recv(1024)
    except TimeoutError:
        return False
    except OSError:  # reset
        pass
    return True


def test_silent_slow_header_and_slow_body_connections_are_closed_after_their_timeouts(tmp_path: Path) -> None:
    port = free_port()
    env = python_env(TRAINPATROL_HEADER_TIMEOUT_SECONDS="1", TRAINPATROL_BODY_TIMEOUT_SECONDS="1",
                     TRAINPATROL_KEEP_ALIVE_SECONDS="30")
    cmd = [sys.executable, "-m", "trainpatrol", "agent", "--no-nvml", "--host", "127.0.0.1", "--port", str(port)]
    with serving(cmd, tmp_path / "agent.log", port, "/healthz", 20, env=env):
        kinds = {"idle": 4, "slow-header": 3, "slow-body": 5}
        opened = {kind: [_hostile(port, kind) for _ in range(n)] for kind, n in kinds.items()}
        assert all(s is not None for group in opened.values() for s in group)
        time.sleep(0.5)
        assert not any(_closed_by_peer(s, 0.01) for group in opened.values() for s in group if s)  # not yet
        assert all(_closed_by_peer(s, 2.0) for group in opened.values() for s in group if s)
        metrics = raw(port, "GET", "/metrics", f"127.0.0.1:{port}")[1]["text"]
        assert 'trainpatrol_refused_requests_total{reason="header_timeout"} 7.0' in metrics
        assert 'trainpatrol_refused_requests_total{reason="body_timeout"} 5.0' in metrics
        for group in opened.values():
            for s in group:
                if s is not None:
                    s.close()
        # 20 kB of headers not yet ended are within max_header_bytes (64 kB; h11's own default is 16 kB)
        with socket.create_connection(("127.0.0.1", port), timeout=2) as s:
            s.sendall(f"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nX-Pad: {'a' * 20_000}\r\n".encode())
            assert not _closed_by_peer(s, 0.3)
            s.sendall(b"\r\n")
            assert raw_answer(s)[0].startswith(b"HTTP/1.1 200 ")
        # headers without end, sent at once: past max_header_bytes uvicorn's h11 answers 400 and closes,
        # not at the timeout
        with socket.create_connection(("127.0.0.1", port), timeout=2) as s:
            started = time.monotonic()
            s.sendall(b"GET /healthz HTTP/1.1\r\n" + b"X-Pad: " + b"a" * 70_000 + b"\r\n")
            assert s.recv(4096).startswith(b"HTTP/1.1 400 ")
            assert _closed_by_peer(s, 2.0) and time.monotonic() - started < 0.9
        # a push whose headers and 200 kB body come in one piece is no header flood
        body = b'{"run": "r1", "rank": 0, "host": "' + b"h" * 200 + b'"}' + b" " * 200_000
        with socket.create_connection(("127.0.0.1", port), timeout=2) as s:
            s.sendall(f"POST /v1/push HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nContent-Type: application/json\r\n"
                      f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
            assert s.recv(4096).startswith(b"HTTP/1.1 200 ")
        # a body the agent refused by its Content-Length, still streaming in, is no header flood either
        with socket.create_connection(("127.0.0.1", port), timeout=2) as s:
            s.sendall(f"POST /v1/push HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nContent-Type: application/json\r\n"
                      "Content-Length: 900000\r\n\r\n".encode())
            assert raw_answer(s)[0].startswith(b"HTTP/1.1 413 ")
            s.sendall(b" " * 900_000)
            s.sendall(f"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n\r\n".encode())
            assert raw_answer(s)[0].startswith(b"HTTP/1.1 200 ")
        metrics = raw(port, "GET", "/metrics", f"127.0.0.1:{port}")[1]["text"]
        assert 'trainpatrol_refused_requests_total{reason="malformed"} 1.0' in metrics


def _honest_pushes(port: int, rank: int, until: float, errors: list[str], done: list[int]) -> None:
    """A rank's kept-alive stream: a push a second on one connection, as Patrol pushes."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
    while time.monotonic() < until:
        started = time.monotonic()
        body = json.dumps({"run": "honest", "rank": rank, "world_size": 16, "step": done[rank]}).encode()
        try:
            conn.request("POST", "/v1/push", body, {"Content-Type": "application/json"})
            response = conn.getresponse()
            response.read()
            if response.status != 200:
                errors.append(f"rank {rank}: {response.status}")
            done[rank] += 1
        except (OSError, http.client.HTTPException) as exc:
            errors.append(f"rank {rank}: {exc!r}")
            conn.close()
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
        time.sleep(max(0.0, 1.0 - (time.monotonic() - started)))
    conn.close()


def _honest_scrapes(port: int, until: float, errors: list[str], done: list[int]) -> None:
    """A 10 Hz scraper on one kept-alive connection."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
    while time.monotonic() < until:
        try:
            conn.request("GET", "/metrics")
            response = conn.getresponse()
            response.read()
            if response.status != 200:
                errors.append(f"scrape: {response.status}")
            done[0] += 1
        except (OSError, http.client.HTTPException) as exc:
            errors.append(f"scrape: {exc!r}")
            conn.close()
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
        time.sleep(0.1)
    conn.close()


def test_kept_alive_rank_streams_and_a_scraper_survive_300_trickling_connections(tmp_path: Path) -> None:
    """300 connections that each send a header byte every 0.25 s and never end a request (about 120
    reopened a second once the cap closes them) against max_connections=100: eviction takes the oldest
    connection that never completed a request, so 16 ranks pushing once a second on kept-alive
    connections and a 10 Hz kept-alive scraper lose nothing. (Evicting the connection silent longest
    closed the ranks' streams, whose silences between pushes are longer than the trickle's.)"""
    port = free_port()
    env = python_env(TRAINPATROL_MAX_CONNECTIONS="100", TRAINPATROL_KEEP_ALIVE_SECONDS="5")
    cmd = [sys.executable, "-m", "trainpatrol", "agent", "--no-nvml", "--host", "127.0.0.1", "--port", str(port)]
    with serving(cmd, tmp_path / "agent.log", port, "/healthz", 20, env=env), Trickle(port, 300).running() as flood:
        time.sleep(2)  # the flood fills the cap first
        errors: list[str] = []
        pushes, scrapes = [0] * 16, [0]
        until = time.monotonic() + 8
        threads = [threading.Thread(target=_honest_pushes, args=(port, r, until, errors, pushes)) for r in range(16)]
        threads.append(threading.Thread(target=_honest_scrapes, args=(port, until, errors, scrapes)))
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
        metrics = raw(port, "GET", "/metrics", f"127.0.0.1:{port}")[1]["text"]
    evicted = next(float(line.split()[-1]) for line in metrics.splitlines()
                   if line.startswith('trainpatrol_refused_requests_total{reason="connections"}'))
    assert flood.opened > 400 and evicted > 100, (flood.opened, evicted)  # the flood did press on the cap
    assert errors == [], (len(errors), errors[:5])
    assert sum(pushes) >= 16 * 7 and scrapes[0] >= 40, (pushes, scrapes)

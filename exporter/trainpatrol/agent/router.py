"""Forwards alerts for runs this agent does not host to the peer that does.

Only known peers are used (a configured list, or the addresses a DNS name resolves to); forwarded
payloads carry the token and a marker header, and a forwarded payload is never forwarded again.
"""

from __future__ import annotations

import json
import logging
import socket
import threading
import time
import urllib.request
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

from .alerts import Alert
from .config import AgentConfig

log = logging.getLogger(__name__)
FORWARDED_HEADER = "X-Trainpatrol-Forwarded"
RUNS_CACHE_SECONDS = 5.0


class Router:
    def __init__(self, config: AgentConfig, count: Callable[[str], None]) -> None:
        self._config = config
        self._count = count
        self._pool = ThreadPoolExecutor(max_workers=4, thread_name_prefix="trainpatrol-router")
        self._runs_cache: dict[str, tuple[float, list[str]]] = {}
        self._lock = threading.Lock()

    def peers(self) -> list[str]:
        peers = list(self._config.peers)
        if self._config.peers_dns:
            try:
                infos = socket.getaddrinfo(self._config.peers_dns, self._config.port, proto=socket.IPPROTO_TCP)
                peers += sorted({f"{i[4][0]}:{self._config.port}" for i in infos})
            except OSError as exc:
                log.warning("cannot resolve peers DNS name %r: %s", self._config.peers_dns, exc)
        me = {f"{self._config.host}:{self._config.port}", f"127.0.0.1:{self._config.port}"}
        return [p for p in dict.fromkeys(peers) if p not in me]

    def forward(self, alerts: list[Alert], payload: dict[str, object]) -> None:
        """Pick a peer per alert and post asynchronously."""
        self._pool.submit(self._forward_all, alerts, payload)

    def _forward_all(self, alerts: list[Alert], payload: dict[str, object]) -> None:
        peers = self.peers()
        by_peer: dict[str, list[Alert]] = {}
        for alert in alerts:
            targets = self._targets(alert, peers)
            if not targets:
                self._count("no_peer")
                log.warning("no known peer hosts run %r (alert %s)", alert.labels.get("run"), alert.fingerprint)
            for t in targets:
                by_peer.setdefault(t, []).append(alert)
        for peer, subset in by_peer.items():
            body = dict(payload, alerts=[a.model_dump() for a in subset])
            try:
                self._post(peer, body)
                self._count("ok")
            except Exception as exc:
                self._count("failed")
                log.warning("forwarding %d alert(s) to %s failed: %s", len(subset), peer, exc)

    def _targets(self, alert: Alert, peers: list[str]) -> list[str]:
        instance = alert.labels.get("instance", "")
        if instance in peers:
            return [instance]
        run = alert.labels.get("run", "")
        return [p for p in peers if run in self._peer_runs(p)]

    def _peer_runs(self, peer: str) -> list[str]:
        now = time.monotonic()
        with self._lock:
            cached = self._runs_cache.get(peer)
            if cached and now - cached[0] < RUNS_CACHE_SECONDS:
                return cached[1]
        try:
            req = urllib.request.Request(f"http://{peer}/v1/runs", headers=self._headers())
            with urllib.request.urlopen(req, timeout=2.0) as r:
                runs = [str(x["run"]) for x in json.loads(r.read())["runs"]]
        except Exception as exc:
            log.info("peer %s did not list its runs: %s", peer, exc)
            runs = []
        with self._lock:
            self._runs_cache[peer] = (now, runs)
        return runs

    def _headers(self) -> dict[str, str]:
        headers = {"Content-Type": "application/json", FORWARDED_HEADER: "1"}
        if self._config.token:
            headers["Authorization"] = f"Bearer {self._config.token}"
        return headers

    def _post(self, peer: str, body: dict[str, object]) -> None:
        req = urllib.request.Request(f"http://{peer}/v1/alertmanager", data=json.dumps(body).encode(),
                                     headers=self._headers(), method="POST")
        with urllib.request.urlopen(req, timeout=5.0) as r:
            r.read()

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

"""The peer forwarder: alerts for runs this agent does not host go to the peer that does (all the
``router`` mode does). Only known peers are used (configured, or a DNS name's addresses); a forwarded
payload carries the token and a marker header and is never forwarded again. Delivery is synchronous, so
the webhook can answer 5xx for an alert its peer did not take.
"""

from __future__ import annotations

import functools
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


class PeerForwarder:
    def __init__(self, config: AgentConfig, count: Callable[[str], None]) -> None:
        self._config = config
        self._count = count
        self._pool = ThreadPoolExecutor(max_workers=4, thread_name_prefix="trainpatrol-router")
        self._runs_cache: dict[str, tuple[float, list[tuple[str, str]]]] = {}
        self._lock = threading.Lock()

    def peers(self) -> list[str]:
        """The configured peers, then the addresses of ``peers_dns`` on this agent's port, less this
        agent itself: a headless Service resolves to every pod, this one included."""
        port = self._config.port
        peers = list(self._config.peers)
        if self._config.peers_dns:
            try:
                infos = socket.getaddrinfo(self._config.peers_dns, port, proto=socket.IPPROTO_TCP)
                peers += sorted({host_port(str(i[4][0]), port) for i in infos})
            except OSError as exc:
                log.warning("cannot resolve peers DNS name %r: %s", self._config.peers_dns, exc)
        me = {host_port(address, port) for address in (self._config.host, *_own_addresses())}
        return [p for p in dict.fromkeys(peers) if p not in me]

    def deliver(self, alerts: list[Alert], payload: dict[str, object]) -> list[str]:
        """Posts each alert to the peer hosting its run, the peers in parallel, and waits (an alert is handled
        once its peer took it). Per alert: ``forwarded``; ``forward_failed`` (the peer refused or did not
        answer, or one that might host the run did not list its runs: Alertmanager must re-send); ``no_peer``."""
        peers = self.peers()
        listings: dict[str, list[tuple[str, str]] | None] = {p: [] for p in peers}
        if any(a.labels.get("instance", "") not in listings for a in alerts):  # some run must be looked up
            listings = dict(zip(peers, self._pool.map(self._peer_runs, peers), strict=True))
        outcomes: list[str] = []
        by_peer: dict[str, list[int]] = {}
        for i, alert in enumerate(alerts):
            targets = self._targets(alert, listings)
            if targets:
                outcomes.append("forwarded")
                for t in targets:
                    by_peer.setdefault(t, []).append(i)
            elif any(runs is None for runs in listings.values()):
                self._count("failed")
                outcomes.append("forward_failed")
                log.warning("a peer did not list its runs: alert %s for run %r waits for a re-send",
                            alert.fingerprint, alert.labels.get("run"))
            else:
                self._count("no_peer")
                outcomes.append("no_peer")
                log.warning("no known peer hosts run %r (alert %s)", alert.labels.get("run"), alert.fingerprint)
        posts = {peer: self._pool.submit(self._post, peer, dict(payload, alerts=[alerts[i].model_dump() for i in idx]))
                 for peer, idx in by_peer.items()}
        for peer, future in posts.items():
            try:
                future.result()
                self._count("ok")
            except Exception as exc:
                self._count("failed")
                log.warning("forwarding %d alert(s) to %s failed: %s", len(by_peer[peer]), peer, exc)
                for i in by_peer[peer]:
                    outcomes[i] = "forward_failed"
        return outcomes

    def _targets(self, alert: Alert, listings: dict[str, list[tuple[str, str]] | None]) -> list[str]:
        instance = alert.labels.get("instance", "")
        if instance in listings:
            return [instance]
        run = (alert.labels.get("namespace", ""), alert.labels.get("run", ""))
        return [p for p, runs in listings.items() if runs is not None and run in runs]

    def _peer_runs(self, peer: str) -> list[tuple[str, str]] | None:
        """The (namespace, run) pairs a peer hosts; None when it did not answer (never cached)."""
        now = time.monotonic()
        with self._lock:
            cached = self._runs_cache.get(peer)
            if cached and now - cached[0] < RUNS_CACHE_SECONDS:
                return cached[1]
        try:
            req = urllib.request.Request(f"http://{peer}/v1/runs", headers=self._headers())
            with urllib.request.urlopen(req, timeout=2.0) as r:
                runs = [(str(x.get("namespace", "")), str(x["run"])) for x in json.loads(r.read())["runs"]]
        except Exception as exc:
            log.info("peer %s did not list its runs: %s", peer, exc)
            return None
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


def host_port(address: str, port: int) -> str:
    """``address:port`` as a URL authority: an IPv6 address goes in brackets."""
    return f"[{address}]:{port}" if ":" in address else f"{address}:{port}"


@functools.cache
def _own_addresses() -> tuple[str, ...]:
    """The loopback addresses and those this host's name resolves to (a pod's own IP)."""
    addresses = {"127.0.0.1", "::1"}
    try:
        addresses |= {str(i[4][0]) for i in socket.getaddrinfo(socket.gethostname(), None, proto=socket.IPPROTO_TCP)}
    except OSError as exc:
        log.info("this host's name does not resolve (%s): only loopback counts as this agent", exc)
    return tuple(sorted(addresses))

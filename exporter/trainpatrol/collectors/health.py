"""Runs named collectors so that one failing never fails the scrape, and writes the /metrics body.

Emits ``trainpatrol_collector_success{collector}`` and
``trainpatrol_collector_duration_seconds{collector}`` for each collector.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass

from ..catalogue import BY_NAME
from ..exposition import Collector, family

log = logging.getLogger(__name__)
_SUCCESS, _DURATION = "trainpatrol_collector_success", "trainpatrol_collector_duration_seconds"


@dataclass(frozen=True)
class _Part:
    """What a collector's last collection gave: its text (empty when it failed), and how it went."""

    text: bytes
    ok: bool
    seconds: float


class CollectorSet:
    """Each collector is asked ``changed()`` at every scrape; only a collector that says yes is
    written again, and the body is joined again only when one was."""

    def __init__(self, collectors: Mapping[str, Collector]) -> None:
        self._collectors = dict(collectors)
        self._parts: dict[str, _Part] = {}
        self._logged: set[tuple[str, str]] = set()
        self._body: bytes | None = None
        self._lock = threading.Lock()  # one scrape at a time writes; the others wait for its body

    def body(self) -> bytes:
        with self._lock:
            dirty = [name for name in self._collectors if self._changed(name)]
            for name in dirty:
                self._parts[name] = self._collect(name)
            if dirty or self._body is None:
                self._body = b"".join([*(p.text for p in self._parts.values()), self._health()])
            return self._body

    def _changed(self, name: str) -> bool:
        if name not in self._parts:
            return True
        try:
            return self._collectors[name].changed()
        except Exception as exc:  # asking must not break the scrape either: collect, and fail there
            self._log(name, exc)
            return True

    def _collect(self, name: str) -> _Part:
        start = time.perf_counter()
        try:
            text, ok = self._collectors[name].write(), True
        except Exception as exc:  # a broken collector must not break the scrape
            self._log(name, exc)
            text, ok = b"", False
        return _Part(text, ok, time.perf_counter() - start)

    def _log(self, name: str, exc: Exception) -> None:
        key = (name, f"{type(exc).__name__}: {exc}")
        if key not in self._logged:
            self._logged.add(key)
            log.warning("collector %s failed: %s", name, key[1])

    def _health(self) -> bytes:
        parts = [({"collector": name}, part) for name, part in self._parts.items()]
        return (family(_SUCCESS, "gauge", BY_NAME[_SUCCESS].help, [(c, 1.0 if p.ok else 0.0) for c, p in parts])
                + family(_DURATION, "gauge", BY_NAME[_DURATION].help, [(c, p.seconds) for c, p in parts])).encode()

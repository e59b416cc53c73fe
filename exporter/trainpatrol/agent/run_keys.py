"""Which key proves a push speaks for a run: the first push of a (namespace, run) that carries one sets it.

A rank proves its run's key (``X-Trainpatrol-Run-Key``, probe.run_key) with every push; its
acknowledgements of commands travel in the same push. Without this, any process that could reach the
agent (from loopback, or any pod holding the shared push token) could push as a rank of another run,
mark its commands done and raise alerts for it. A run whose pushes carry no key has bound none, and
takes keyless pushes (older probes); once a key is bound, pushes without it are refused. The agent
keeps a digest, never the key, and forgets it with the run's last series (RankStore.expire); a run
whose ranks all closed or stopped takes the next key that comes (a relaunch under the same name).
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Callable

RUN_KEY_HEADER = "x-trainpatrol-run-key"
RunId = tuple[str, str]
"""(namespace, run)."""


def digest(key: str) -> bytes:
    """Of the key as sent; empty for no key. The header is latin-1 on the wire, as ASGI gives it."""
    return hashlib.sha256(key.encode("latin-1", "replace")).digest() if key else b""


class RunKeys:
    """Not thread-safe: RankStore calls it under its lock."""

    def __init__(self) -> None:
        self._bound: dict[RunId, bytes] = {}

    def admit(self, run: RunId, key_digest: bytes, ended: Callable[[RunId], bool]) -> bool:
        """Whether a push with this key may speak for ``run``; binds the key if the run has none, or
        if ``ended(run)`` says every rank of the run closed or stopped: a run relaunched under the same
        name comes with a new key, and must not wait for the old series to expire."""
        bound = self._bound.get(run)
        if bound is not None and key_digest and hmac.compare_digest(bound, key_digest):
            return True
        if bound is None or (key_digest and ended(run)):
            if key_digest:
                self._bound[run] = key_digest
            return True
        return False

    def keep_only(self, runs: set[RunId]) -> None:
        """Forget the keys of runs that have no series left."""
        for run in [r for r in self._bound if r not in runs]:
            del self._bound[run]

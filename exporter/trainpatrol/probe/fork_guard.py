"""Processes forked from a training process (DataLoader workers) never collect the parent's garbage.

A Patrol, like most objects that hold callbacks to each other, lives in reference cycles: once the run drops it,
the cyclic collector frees it at whatever allocation next triggers a collection. When that happens in a
DataLoader worker forked meanwhile, the worker frees the Patrol's CUDA events and pinned buffers, and a CUDA call
in a forked child aborts it ("DataLoader worker ... is killed by signal: Aborted"). Freezing the collector's
objects across a fork, as CPython's ``gc.freeze`` documentation advises for forking servers, leaves them to the
parent to free.
"""

from __future__ import annotations

import gc
import os
import threading

_lock = threading.Lock()
_installed = False
_froze = False


def _before_fork() -> None:
    global _froze
    _froze = gc.get_freeze_count() == 0  # a process that froze objects of its own keeps them frozen
    if _froze:
        gc.freeze()


def _after_fork_in_parent() -> None:
    if _froze:
        gc.unfreeze()


def install() -> None:
    """Registers the fork hooks, once per process."""
    global _installed
    with _lock:
        if not _installed:
            os.register_at_fork(before=_before_fork, after_in_parent=_after_fork_in_parent)
            _installed = True

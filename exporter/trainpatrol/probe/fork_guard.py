"""Processes forked from a training process (DataLoader workers) never collect the parent's garbage.

A Patrol, like most objects that hold callbacks to each other, lives in reference cycles: once the run drops it,
the cyclic collector frees it at whatever allocation next triggers a collection. When that happens in a
DataLoader worker, the worker frees the Patrol's CUDA events and pinned buffers, and a CUDA call in a forked child
aborts it ("DataLoader worker ... is killed by signal: Aborted"). The child freezes every object it inherited, as
CPython's ``gc.freeze`` documentation advises for forked processes, so only the parent ever frees them. Freezing
in the child rather than around the fork in the parent works whatever the parent froze of its own (some Python
builds freeze their startup objects, so the parent's freeze count is not zero).
"""

from __future__ import annotations

import gc
import os
import threading

_lock = threading.Lock()
_installed = False


def install() -> None:
    """Registers the fork hook, once per process."""
    global _installed
    with _lock:
        if not _installed:
            os.register_at_fork(after_in_child=gc.freeze)
            _installed = True

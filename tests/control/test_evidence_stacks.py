"""The stacks of an evidence bundle: every Python thread, by name, where it is."""

from __future__ import annotations

import re
import threading

from trainpatrol.control.evidence import all_stacks


def _blocks(stacks: str) -> dict[str, str]:
    """Thread name -> its block (header and frames)."""
    parts = re.split(r'^(?=(?:Current thread|Thread) 0x[0-9a-f]{16} ")', stacks, flags=re.MULTILINE)
    return {re.search(r'"([^"]*)"', p).group(1): p for p in parts if p.strip()}  # type: ignore[union-attr]


def _wait_for_the_signal(started: threading.Event, release: threading.Event) -> None:
    started.set()
    release.wait(30)


def test_stacks_name_every_thread_and_show_where_each_is() -> None:
    started, release = threading.Event(), threading.Event()
    helper = threading.Thread(target=_wait_for_the_signal, args=(started, release), name="loader-helper")
    helper.start()
    try:
        assert started.wait(10)
        blocks = _blocks(all_stacks())
    finally:
        release.set()
        helper.join(10)
    assert blocks["loader-helper"].startswith(f"Thread 0x{helper.ident:016x} \"loader-helper\"")
    assert "in _wait_for_the_signal\n    release.wait(30)" in blocks["loader-helper"]
    assert blocks["MainThread"].startswith("Current thread 0x")
    assert "in test_stacks_name_every_thread_and_show_where_each_is" in blocks["MainThread"]

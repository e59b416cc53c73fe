"""Starts an agent as a child process when none answers, so ``python train.py`` alone has /metrics."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import tempfile
import urllib.parse
import urllib.request

from .._process import terminate

log = logging.getLogger("trainpatrol")


def agent_answers(url: str, timeout: float = 0.5) -> bool:
    try:
        with urllib.request.urlopen(url.rstrip("/") + "/healthz", timeout=timeout) as r:
            return bool(r.status == 200)
    except Exception:
        return False


def start_embedded_agent(url: str, extra_args: list[str] | None = None) -> subprocess.Popen[bytes] | None:
    """Start ``trainpatrol agent`` on the URL's loopback port; None when the URL is not loopback."""
    parsed = urllib.parse.urlparse(url)
    if parsed.hostname not in ("127.0.0.1", "localhost"):
        log.warning("trainpatrol: no agent answers at %s and it is not loopback; not starting one", url)
        return None
    port = parsed.port or 9400
    log_path = os.path.join(tempfile.gettempdir(), f"trainpatrol-agent-{port}.log")
    cmd = [sys.executable, "-m", "trainpatrol", "agent", "--host", "127.0.0.1", "--port", str(port),
           *(extra_args or [])]
    with open(log_path, "ab") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                start_new_session=True)
    log.warning("trainpatrol: started an embedded agent on http://127.0.0.1:%d/metrics (log %s)", port, log_path)
    return proc


def stop_embedded_agent(proc: subprocess.Popen[bytes] | None) -> None:
    terminate(proc, timeout=5)

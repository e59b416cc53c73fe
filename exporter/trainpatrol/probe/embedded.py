"""Starts an agent when none answers, so ``python train.py`` alone has /metrics.

The agent is detached (its own session, no pipe to the run) and the run that started it never ends
it: another run on the host may have found it answering and push to it. It exits by itself once no
rank has pushed for ``EMBEDDED_IDLE_SECONDS`` (``trainpatrol agent --exit-when-idle``). Two runs that
start one at the same moment end with one agent: the second cannot bind the port and exits, and both
runs wait for whichever agent answers. An agent answers when it proves itself (trainpatrol.handshake):
a process of another user that holds the port is no agent of this run's.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import tempfile
import time
import urllib.parse

from .. import handshake
from ..agent.config import DEFAULT_PORT, EMBEDDED_IDLE_SECONDS

log = logging.getLogger("trainpatrol")

STARTUP_SECONDS = 30.0
"""How long a run waits for the agent it started to answer (it imports FastAPI: 1-3 s here)."""

_started: list[subprocess.Popen[bytes]] = []
"""Agents this process started. Held so that no ``Popen`` is collected while its agent runs (which
warns "subprocess is still running") and so that one which exited is reaped."""


def agent_answers(url: str, token: str = "", timeout: float = 0.5) -> bool:
    """An agent at ``url`` proves itself to this run (with ``token``, or this user's agent key)."""
    parsed = urllib.parse.urlparse(url)
    try:
        handshake.connect(parsed.hostname or "127.0.0.1", parsed.port or DEFAULT_PORT, token, timeout).close()
        return True
    except Exception:
        return False


def is_loopback_url(url: str) -> bool:
    return urllib.parse.urlparse(url).hostname in ("127.0.0.1", "localhost")


def wait_for_agent(url: str, token: str = "", seconds: float = STARTUP_SECONDS) -> bool:
    """Whether an agent answers at ``url`` within ``seconds``: the other local ranks wait so for the one
    local rank 0 starts, rather than warn that their first pushes were refused."""
    started = time.monotonic()
    while not agent_answers(url, token):
        if time.monotonic() - started > seconds:
            return False
        time.sleep(0.1)
    return True


def start_embedded_agent(url: str, extra_args: list[str] | None = None, token: str = "",
                         idle_seconds: float = EMBEDDED_IDLE_SECONDS,
                         wait_seconds: float = STARTUP_SECONDS) -> bool:
    """Start ``trainpatrol agent`` on the URL's loopback port and wait until an agent answers there.

    Returns whether one answers: the one started here, or one another run started meanwhile. False
    (with one warning) when the URL is not loopback or no agent answered within ``wait_seconds``."""
    parsed = urllib.parse.urlparse(url)
    if not is_loopback_url(url):
        log.warning("trainpatrol: no agent answers at %s and it is not loopback; not starting one", url)
        return False
    port = parsed.port or DEFAULT_PORT
    log_path = os.path.join(tempfile.gettempdir(), f"trainpatrol-agent-{port}.log")
    cmd = [sys.executable, "-m", "trainpatrol", "agent", "--host", "127.0.0.1", "--port", str(port),
           "--exit-when-idle", f"{idle_seconds:g}", *(extra_args or [])]
    for old in list(_started):
        if old.poll() is not None:
            _started.remove(old)
    with open(log_path, "ab") as out:
        # A new session: a Ctrl-C or SIGHUP meant for the run does not reach the agent other runs use
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                start_new_session=True, close_fds=True)
    _started.append(proc)
    started = time.monotonic()
    while time.monotonic() - started < wait_seconds:
        if agent_answers(url, token):
            log.info("trainpatrol: an embedded agent serves http://127.0.0.1:%d/metrics; it exits %g s after "
                     "the last rank's push (log %s)", port, idle_seconds, log_path)
            return True
        if proc.poll() is not None and time.monotonic() - started > 5:
            break  # ours exited (the port is taken) and no agent came up on it since
        time.sleep(0.1)
    log.warning("trainpatrol: started an agent on port %d but none answers there (log %s); pushes will retry",
                port, log_path)
    return False


def ensure_agent(url: str, local_rank: int, idle_seconds: float, token: str = "") -> None:
    """Local rank 0 starts an agent where none answers; the other ranks wait for it. Both wait until it
    proves itself, so the first push finds the agent; it outlives this run."""
    if agent_answers(url, token):
        return
    if local_rank == 0:
        start_embedded_agent(url, idle_seconds=idle_seconds, token=token)
    elif is_loopback_url(url) and not wait_for_agent(url, token):
        log.warning("trainpatrol: no agent answers at %s, and local rank 0 started none; pushes will retry", url)

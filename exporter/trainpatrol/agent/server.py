"""Starts the agent: NVML sampler, expiry, and uvicorn (which can also live in a background thread)."""

from __future__ import annotations

import contextlib
import gc
import importlib.util
import json
import logging
import os
import signal
import sys
import threading
from collections.abc import Callable, Iterator
from typing import Any

import uvicorn

from .. import handshake
from .app import Agent
from .config import AgentConfig, fake_module
from .limits import guarded_protocol, raise_open_files_limit

log = logging.getLogger(__name__)
STARTUP_FAILURE = 3
"""The exit status of ``uvicorn.run`` when the server could not start (a port in use, say)."""
FAKE_DELAYS_ENV = "TRAINPATROL_NVML_FAKE_DELAYS"
"""JSON {"nvmlFunction": seconds} slowing the fake's calls as on real GPUs (bench/scrape.py)."""


def build_agent(config: AgentConfig) -> Agent:
    """The agent, with its NVML collector (real, or fed by a recorded fixture) unless that is switched off."""
    config.load()
    if not config.nvml:
        return Agent(config)
    from ..collectors.nvml import NvmlCollector

    source: Any = None
    if config.nvml_fake:  # the fake is fake.py beside the fixture (config.load checked both exist)
        delays = json.loads(os.environ.get(FAKE_DELAYS_ENV) or "{}")
        spec = importlib.util.spec_from_file_location("trainpatrol_nvml_fake", fake_module(config.nvml_fake))
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module  # dataclasses look their module up while the class is made
        spec.loader.exec_module(module)
        source = module.FakeNvml.from_fixture(config.nvml_fake, delays=delays)
    agent: Agent  # bound before the NVML sampler first asks for the ranks' pids
    agent = Agent(config, nvml=NvmlCollector(source, interval_seconds=config.nvml_interval_seconds,
                                             slow_interval_seconds=config.nvml_slow_interval_seconds,
                                             pcie=config.nvml_pcie, processes=config.nvml_processes,
                                             pid_to_rank=lambda: agent.store.pid_to_rank()))
    return agent


class _Terminated(BaseException):
    """SIGTERM, handed back by uvicorn once it has shut down."""


@contextlib.contextmanager
def _ends_by_sigterm_after_cleanup() -> Iterator[None]:
    """uvicorn re-raises the SIGTERM it handled once it has shut down; under the default handler that ends the
    process at once, before the ``finally`` blocks inside (the key file stayed). Here the signal unwinds them
    first, and the process then ends by it all the same, as ``uvicorn.run`` does."""
    if threading.current_thread() is not threading.main_thread():  # signals reach the main thread alone
        yield
        return

    def unwind(_signum: int, _frame: object) -> None:
        raise _Terminated

    previous = signal.signal(signal.SIGTERM, unwind)
    try:
        yield
    except _Terminated:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        signal.raise_signal(signal.SIGTERM)
    finally:
        signal.signal(signal.SIGTERM, previous)


@_ends_by_sigterm_after_cleanup()
def serve(config: AgentConfig) -> None:
    agent = build_agent(config)
    if agent.nvml is not None:
        agent.nvml.start()
    # Every push allocates thousands of short-lived objects, and a full collection over the startup's
    # own (FastAPI, pydantic schemas, the catalogue) stalls scrapes (bench/scrape.py's p99): keep those
    # out of collections for good, and collect young objects less often.
    gc.freeze()
    gc.set_threshold(10_000, 50, 100)
    log.info("trainpatrol agent (%s) on http://%s:%d/metrics", config.mode, config.host, config.port)
    log.info("at most %d connections, %d open files", config.max_connections, raise_open_files_limit())
    done = threading.Event()
    try:
        protocol = guarded_protocol(config, lambda reason: agent.stats.count("refusals", reason))
        server = uvicorn.Server(uvicorn.Config(agent.app, host=config.host, port=config.port, http=protocol,
                                               ws="none", log_level=config.log_level, access_log=False,
                                               h11_max_incomplete_event_size=config.max_header_bytes,
                                               timeout_keep_alive=int(config.keep_alive_seconds) or 1,
                                               timeout_graceful_shutdown=2))
        # The port is held (listen: a second agent's listen fails, so it cannot overwrite this one's key)
        # before the key is written, and the key before anything is served: a rank that reaches the agent
        # finds its key.
        sock = server.config.bind_socket()  # exits as uvicorn.run does when the port is taken
        try:
            sock.listen(server.config.backlog)
        except OSError as exc:  # another agent bound the same port in the same instant, and listened first
            log.error("%s", exc)
            raise SystemExit(STARTUP_FAILURE) from exc
        if handshake.is_loopback(config.host):  # the user's own ranks check this agent with its key
            handshake.write_key(config.port, agent.identity_key)
        if config.exit_when_idle_seconds:
            log.info("exits when no rank has pushed for %g s", config.exit_when_idle_seconds)
            threading.Thread(target=stop_when_idle, args=(server, agent.idle_for, config.exit_when_idle_seconds, done),
                             name="trainpatrol-idle", daemon=True).start()
        with contextlib.suppress(KeyboardInterrupt):
            server.run(sockets=[sock])
        if not server.started:  # the application did not start: fail as uvicorn.run does
            raise SystemExit(STARTUP_FAILURE)
    finally:
        done.set()
        handshake.remove_key(config.port, agent.identity_key)
        if agent.nvml is not None:
            agent.nvml.stop()
        agent.peers.close()


def stop_when_idle(server: uvicorn.Server, idle_for: Callable[[], float], seconds: float,
                   done: threading.Event) -> None:
    """Asks ``server`` to exit once no rank has pushed for ``seconds``; sleeps until then, or until ``done``."""
    while not done.wait(max(seconds - idle_for(), 0.0) + 0.05):
        if idle_for() > seconds:
            log.info("no rank has pushed for %g s: exiting", seconds)
            server.should_exit = True
            return

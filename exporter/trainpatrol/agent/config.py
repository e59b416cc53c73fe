"""The agent's one typed configuration. The CLI and ``TRAINPATROL_*`` variables only map onto it."""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Literal

from ..actions import ACTIONS
from ..handshake import is_loopback
from ..protocol import DNS_LABEL

Mode = Literal["agent", "router"]

DEFAULT_PORT = 9402
"""Beside dcgm-exporter, which listens on 9400."""
DEFAULT_URL = f"http://127.0.0.1:{DEFAULT_PORT}"
EMBEDDED_IDLE_SECONDS = 60.0
"""An embedded agent (probe.embedded) exits when no rank has pushed for this long: a paused rank keeps
pushing, and a run restarted within it finds the same agent."""
DEFAULT_ALLOWED_ACTIONS = ("checkpoint", "pause", "capture", "empty_cache", "stop")
DEFAULT_ACTION_RATE_LIMITS = {"checkpoint": 2, "capture": 4}
"""Per run and minute: sized for a few runs sharing a node's disk and CPU."""


class ConfigError(ValueError):
    """A configuration value is invalid; the message quotes key and value."""


@dataclass
class AgentConfig:
    host: str = "127.0.0.1"
    port: int = DEFAULT_PORT
    mode: Mode = "agent"
    token: str = ""
    """Bearer token for the control API, webhooks and non-loopback pushes. Empty: loopback only."""
    token_file: str = ""
    namespace_tokens: dict[str, str] = field(default_factory=dict)
    """Tokens that reach one namespace each (``{namespace: token}``; TRAINPATROL_NAMESPACE_TOKENS is
    ``ns=token,...``): control, webhooks and non-loopback pushes for runs of that namespace only."""
    namespace_tokens_file: str = ""
    """A file of ``namespace=token`` lines, read by ``load``, adding to ``namespace_tokens``."""
    action_rate_limits: dict[str, int] = field(default_factory=lambda: dict(DEFAULT_ACTION_RATE_LIMITS))
    """At most this many commands of an action per run in any 60 s (``action=n,...``; actions not named are
    not limited): each writes a checkpoint or evidence on every rank, so an alert storm must not."""
    allowed_actions: tuple[str, ...] = DEFAULT_ALLOWED_ACTIONS
    """Actions an Alertmanager webhook or the HTTP API may ask for. ``resume`` always needs the API."""
    rank_up_ttl_seconds: float = 15.0
    """A rank that has not pushed for this long gets ``trainpatrol_rank_up 0``."""
    rank_expire_seconds: float = 600.0
    """Series of a rank that has not pushed for this long (or closed this long ago) are removed."""
    closed_expire_seconds: float = 60.0
    nvml: bool = True
    nvml_interval_seconds: float = 1.0
    nvml_slow_interval_seconds: float = 5.0
    """How often the counters, near-constant settings and blocking calls are read (collectors.nvml)."""
    nvml_pcie: bool = False
    """PCIe throughput costs about 20 ms per GPU per sample, so it is opt-in."""
    nvml_processes: bool = False
    nvml_fake: str = ""
    """An NVML fixture (JSON) with ``fake.py`` beside it, as tests/nvml_fake/nvml_h200.json (not in the wheel)."""
    peers: tuple[str, ...] = ()
    """Peer agents (host:port) this agent may forward alerts to."""
    peers_dns: str = ""
    """A DNS name (e.g. a headless Service) whose addresses, on ``port``, are peers."""
    allowed_hosts: tuple[str, ...] = ()
    """Host header names (besides loopback and ``host``) this agent answers to, as a Service's DNS name
    or the pod IP; any other gets 421 (agent.auth)."""
    api_docs: bool = False
    """Serve /docs and /openapi.json (behind the token when one is set)."""
    metrics_token: str = ""
    """Bearer token /metrics asks for. Empty (the default): /metrics is open, as Prometheus expects."""
    # Bounds (docs/security.md): sized for a node of 8 GPUs running a few runs, with room to spare.
    max_runs: int = 16
    max_ranks_per_run: int = 128
    max_series: int = 10_000
    """Samples held over all ranks: what /metrics has to write (a rank of a real run pushes about 100)."""
    max_series_per_run: int = 7_500
    """Samples one run may hold: one run's flood leaves room for new runs."""
    squat_seconds: float = 60.0
    """A run none of whose ranks advanced a step this long after it came gives way (agent.store)."""
    max_samples_per_push: int = 1024
    max_label_length: int = 256
    max_queued_commands: int = 64
    """Commands waiting per run."""
    alert_log_size: int = 200
    webhook_dedupe_size: int = 10000
    max_push_bytes: int = 262_144
    """Fits a snapshot of 1024 samples (a Patrol's is about 7 KB); parsing blocks the event loop for its size."""
    max_request_bytes: int = 1_000_000
    """Any other request body: the webhook (a group of hundreds of alerts) and the control API."""
    # Connections: a slow or silent peer cannot hold a descriptor for long (docs/security.md).
    max_connections: int = 256
    """Ours (agent.limits): over it, the stalest connection waiting on its peer is closed."""
    header_timeout_seconds: float = 10.0
    """Ours: a request's headers must be in this long after the connection opened or the request began."""
    body_timeout_seconds: float = 10.0
    """Ours: a request's body must be in this long after its headers."""
    max_header_bytes: int = 65_536
    """uvicorn's ``h11_max_incomplete_event_size``: unfinished headers past it are answered 400."""
    keep_alive_seconds: float = 20.0
    """uvicorn's ``timeout_keep_alive`` (whole seconds). It outlasts the silence between two pushes of a rank
    that is up (at most 1.1 push intervals of under ``rank_up_ttl_seconds``: 16.5 s), or pushes race the close
    and need a retry (1 % of them at 5 s); ``max_connections`` bounds idle ones (docs/security.md)."""
    series: str = "standard"
    """``standard`` keeps each rank within ``catalogue.SERIES_BUDGET``, ``full`` serves every series
    (docs/metrics.md, "Series budget")."""
    log_level: str = "info"
    exit_when_idle_seconds: float = 0.0
    """Exit when no rank has pushed for this long (0: never): how a detached embedded agent ends."""

    def load(self) -> AgentConfig:
        """Validate, read the token file, and enforce the fail-closed rule."""
        if not 0 < self.port < 65536:
            raise ConfigError(f"Config 'port' has value {self.port!r}. Not a valid TCP port.")
        if self.exit_when_idle_seconds < 0:
            raise ConfigError(f"Config 'exit_when_idle_seconds' has value {self.exit_when_idle_seconds!r}. "
                              "Expected 0 (never) or more.")
        if self.series not in ("standard", "full"):
            raise ConfigError(f"Config 'series' has value {self.series!r}. Expected 'standard' or 'full'.")
        if self.mode not in ("agent", "router"):
            raise ConfigError(f"Config 'mode' has value {self.mode!r}. Expected 'agent' or 'router'.")
        for name in ("max_runs", "max_ranks_per_run", "max_series", "max_series_per_run", "squat_seconds",
                     "max_samples_per_push", "max_label_length", "max_queued_commands", "alert_log_size",
                     "webhook_dedupe_size", "max_push_bytes", "max_request_bytes", "max_connections",
                     "max_header_bytes", "header_timeout_seconds", "body_timeout_seconds", "keep_alive_seconds"):
            if not getattr(self, name) > 0:
                raise ConfigError(f"Config '{name}' has value {getattr(self, name)!r}. Expected a positive number.")
        if unknown := [a for a in self.allowed_actions if a not in ACTIONS]:
            raise ConfigError(f"Config 'allowed_actions' has value {unknown[0]!r}. "
                              f"Expected one of {', '.join(ACTIONS)}.")
        if self.nvml_fake and not (Path(self.nvml_fake).is_file() and fake_module(self.nvml_fake).is_file()):
            raise ConfigError(f"Config 'nvml_fake' has value {self.nvml_fake!r}. Expected an NVML fixture (JSON) "
                              "with fake.py beside it, as tests/nvml_fake/nvml_h200.json in the repository.")
        if self.token_file and not self.token:
            try:
                self.token = Path(self.token_file).read_text().strip()
            except OSError as exc:
                raise ConfigError(f"Config 'token_file' has value {self.token_file!r}: {exc}.") from exc
        if self.namespace_tokens_file:
            self.namespace_tokens = {**_read_pairs("namespace_tokens_file", self.namespace_tokens_file),
                                     **self.namespace_tokens}
        for namespace, token in self.namespace_tokens.items():
            if not namespace or not re.match(DNS_LABEL, namespace) or not token:
                raise ConfigError(f"Config 'namespace_tokens' has entry {namespace!r}. Expected a namespace "
                                  "(a DNS label) with a non-empty token.")
        for action, limit in self.action_rate_limits.items():
            if action not in ACTIONS or not isinstance(limit, int) or limit < 0:
                raise ConfigError(f"Config 'action_rate_limits' has entry {action}={limit!r}. Expected an action "
                                  "and a count per minute of 0 or more.")
        if not self.token and not is_loopback(self.host):
            raise ConfigError(f"Config 'host' has value {self.host!r}, which is not loopback, and no token is set. "
                              "Set TRAINPATROL_TOKEN or --token-file: the control API fails closed.")
        return self

    @classmethod
    def from_env(cls, env: dict[str, str] | None = None, **overrides: object) -> AgentConfig:
        """Build from ``TRAINPATROL_<FIELD>`` variables, then explicit overrides (CLI flags)."""
        env = dict(os.environ if env is None else env)
        values: dict[str, object] = {}
        for f in fields(cls):
            key = "TRAINPATROL_" + f.name.upper()
            if key in env:
                values[f.name] = _parse(f.name, str(f.type), env[key])
        values.update({k: v for k, v in overrides.items() if v is not None})
        return cls(**values)  # type: ignore[arg-type]


def _parse(name: str, type_name: str, raw: str) -> object:
    try:
        if "bool" in type_name:
            low = raw.strip().lower()
            if low in ("1", "true", "yes", "on"):
                return True
            if low in ("0", "false", "no", "off", ""):
                return False
            raise ValueError(raw)
        if "dict" in type_name:
            pairs = dict(_pair(p) for p in raw.split(",") if p.strip())
            return {k: int(v) for k, v in pairs.items()} if "int" in type_name else pairs
        if "tuple" in type_name:
            return tuple(p.strip() for p in raw.split(",") if p.strip())
        if type_name == "int":
            return int(raw)
        if type_name == "float":
            return float(raw)
    except ValueError:
        raise ConfigError(f"Config 'TRAINPATROL_{name.upper()}' has value {raw!r}. Not a valid {type_name}.") from None
    return raw


def _pair(entry: str) -> tuple[str, str]:
    key, sep, value = entry.partition("=")
    if not sep:
        raise ValueError(entry)
    return key.strip(), value.strip()


def _read_pairs(name: str, path: str) -> dict[str, str]:
    try:
        lines = Path(path).read_text().splitlines()
        return dict(_pair(line) for line in lines if line.strip() and not line.lstrip().startswith("#"))
    except (OSError, ValueError) as exc:
        raise ConfigError(f"Config {name!r} has value {path!r}: {exc}. Expected namespace=token lines.") from exc


def fake_module(fixture: str) -> Path:
    """The NVML fake's source, beside its fixture: test code, so it is loaded by path, never packaged."""
    return Path(fixture).parent / "fake.py"

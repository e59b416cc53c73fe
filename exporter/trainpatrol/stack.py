"""A local alert loop for ``trainpatrol demo --stack``: agent, Prometheus and Alertmanager on 127.0.0.1.

Prometheus scrapes the agent every second and evaluates the shipped rules of the *fast* profile (the same
thresholds, short windows, ``for: 0s`` but where a condition must last; ``rules-fast.yml`` of the package),
so an alert fires within seconds. Alertmanager routes as the shipped ``alertmanager.yml`` does, pointed at
the agent's webhook, with a bearer token generated for this run and kept in a private credentials file; the
agent is started with the same token. Every process binds loopback only (Alertmanager's cluster listener is
off), storage lives in a private temporary directory, and everything is stopped and removed on exit.
Configs and logs stay under ``<workdir>/stack/`` for inspection; every path in a config is absolute, since
Prometheus resolves a relative ``rule_files`` entry against the config's folder, and ``promtool check config``
and ``amtool check-config`` pass each config before its server starts.
"""

from __future__ import annotations

import json
import secrets
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.parse
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any

from . import shipped
from ._process import terminate
from .agent.config import DEFAULT_PORT

PROMETHEUS_PORT = 9090
ALERTMANAGER_PORT = 9093
AGENT_PORT = DEFAULT_PORT
WEBHOOK_PATH = "/v1/alertmanager"


class StackError(RuntimeError):
    """A stack component is missing, misconfigured, or did not become ready."""


@dataclass(frozen=True)
class Binaries:
    prometheus: str
    alertmanager: str
    promtool: str
    amtool: str

    @classmethod
    def find(cls) -> Binaries | None:
        """Debian names Alertmanager ``prometheus-alertmanager``; upstream tarballs ``alertmanager``."""
        found = (shutil.which("prometheus"), shutil.which("prometheus-alertmanager") or shutil.which("alertmanager"),
                 shutil.which("promtool"), shutil.which("amtool"))
        return cls(*found) if all(found) else None  # type: ignore[arg-type]


def alertmanager_config(template: str, webhook_url: str, credentials_file: Path | str,
                        group_interval: str | None = None) -> str:
    """``template`` (the shipped alertmanager.yml) with every webhook pointed at ``webhook_url``'s host and
    the bearer token read from ``credentials_file``; ``group_interval`` overrides it on webhook routes."""
    try:
        import yaml
    except ImportError as exc:
        raise StackError("PyYAML is needed to derive the Alertmanager config (pip install pyyaml).") from exc
    doc: dict[str, Any] = yaml.safe_load(template)
    target = urllib.parse.urlparse(webhook_url)
    webhook_receivers = set()
    for receiver in doc.get("receivers", []):
        for hook in receiver.get("webhook_configs", []):
            path = urllib.parse.urlparse(hook["url"]).path or WEBHOOK_PATH
            hook["url"] = urllib.parse.urlunparse((target.scheme, target.netloc, path, "", "", ""))
            auth = hook.setdefault("http_config", {}).setdefault("authorization", {"type": "Bearer"})
            auth.pop("credentials", None)
            auth["credentials_file"] = str(credentials_file)
            webhook_receivers.add(receiver["name"])
    if not webhook_receivers:
        raise StackError("The Alertmanager template has no webhook_configs to point at the agent.")
    if group_interval is not None:
        for route in _routes(doc.get("route", {})):
            if route.get("receiver") in webhook_receivers:
                route["group_interval"] = group_interval
    header = "# derived from trainpatrol's alertmanager.yml by trainpatrol.stack, do not edit\n"
    return header + str(yaml.safe_dump(doc, sort_keys=False))


def _routes(route: dict[str, Any]) -> list[dict[str, Any]]:
    return [route, *(r for child in route.get("routes", []) for r in _routes(child))]


def prometheus_config(targets: list[str], rule_files: list[Path], alertmanager: str, interval: str = "1s") -> str:
    """Scrape ``targets`` (host:port) as job ``trainpatrol``, the job the shipped rules select."""
    cfg = {
        "global": {"scrape_interval": interval, "evaluation_interval": interval, "scrape_timeout": interval},
        "scrape_configs": [{"job_name": "trainpatrol", "static_configs": [{"targets": targets}]}],
        "rule_files": [str(p) for p in rule_files],
        "alerting": {"alertmanagers": [{"static_configs": [{"targets": [alertmanager]}]}]},
    }
    return json.dumps(cfg, indent=2) + "\n"


def port_or_free(preferred: int) -> int:
    """``preferred`` when nothing listens on 127.0.0.1 there, else (or for 0) a free port."""
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", preferred))
        except OSError:
            s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class StackConfig:
    workdir: Path
    """Configs and logs go to ``<workdir>/stack/`` (made absolute)."""
    agent_port: int = AGENT_PORT
    prometheus_port: int = PROMETHEUS_PORT
    alertmanager_port: int = ALERTMANAGER_PORT
    """Preferred ports; a busy one is replaced by a free one."""
    interval: str = "1s"
    """Scrape and rule-evaluation interval."""
    start_timeout_seconds: float = 30.0


class Stack:
    """``with Stack(config, binaries) as stack:`` starts the agent, Alertmanager and Prometheus;
    ``agent_url``, ``prometheus_url``, ``alertmanager_url`` and ``token`` are then set."""

    def __init__(self, config: StackConfig, binaries: Binaries) -> None:
        self.config, self.binaries = config, binaries
        self.dir = Path(config.workdir).resolve() / "stack"
        self.token = secrets.token_urlsafe(32)
        self.agent_url = self.prometheus_url = self.alertmanager_url = ""
        self.rules_file = self.dir / "rules-fast.yml"
        self._private: Path | None = None
        self._procs: list[tuple[str, subprocess.Popen[bytes]]] = []

    @property
    def token_file(self) -> Path:
        assert self._private is not None, "Stack.start() first"
        return self._private / "token"

    def start(self) -> Stack:
        """Start all three and wait until each is ready; on failure stop what started and raise."""
        cfg = self.config
        self.dir.mkdir(parents=True, exist_ok=True)
        self._private = Path(tempfile.mkdtemp(prefix="trainpatrol-stack-"))  # 0700: token and storage
        try:
            self.token_file.write_text(self.token + "\n")
            self.token_file.chmod(0o600)
            self.rules_file.write_bytes(shipped.resource(self.rules_file.name).read_bytes())
            agent_port = port_or_free(cfg.agent_port)
            self.agent_url = f"http://127.0.0.1:{agent_port}"
            self._spawn("agent", [sys.executable, "-m", "trainpatrol", "agent", "--host", "127.0.0.1",
                                  "--port", str(agent_port), "--token-file", str(self.token_file)],
                        self.agent_url + "/healthz")
            am_port = port_or_free(cfg.alertmanager_port)
            self.alertmanager_url = f"http://127.0.0.1:{am_port}"
            am_yml = self.dir / "alertmanager.yml"
            am_yml.write_text(alertmanager_config(shipped.resource("alertmanager.yml").read_text(),
                                                  self.agent_url + WEBHOOK_PATH, self.token_file))
            self._check([self.binaries.amtool, "check-config", str(am_yml)])
            self._spawn("alertmanager", [self.binaries.alertmanager, f"--config.file={am_yml}",
                                         f"--storage.path={self._private / 'alertmanager'}",
                                         f"--web.listen-address=127.0.0.1:{am_port}",
                                         f"--web.external-url={self.alertmanager_url}",
                                         "--cluster.listen-address=", "--log.level=warn"],
                        self.alertmanager_url + "/-/ready")
            prom_port = port_or_free(cfg.prometheus_port)
            self.prometheus_url = f"http://127.0.0.1:{prom_port}"
            prom_yml = self.dir / "prometheus.yml"
            prom_yml.write_text(prometheus_config([f"127.0.0.1:{agent_port}"], [self.rules_file],
                                                  f"127.0.0.1:{am_port}", cfg.interval))
            self._check([self.binaries.promtool, "check", "config", str(prom_yml)])  # its rule files too
            self._spawn("prometheus", [self.binaries.prometheus, f"--config.file={prom_yml}",
                                       f"--storage.tsdb.path={self._private / 'prometheus'}",
                                       f"--web.listen-address=127.0.0.1:{prom_port}",
                                       f"--web.external-url={self.prometheus_url}", "--log.level=warn"],
                        self.prometheus_url + "/-/ready")
            self._wait_first_scrape()
        except BaseException:
            self.stop()
            raise
        return self

    def _check(self, cmd: list[str]) -> None:
        result = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
        if result.returncode != 0:
            raise StackError(f"`{' '.join(cmd)}` failed with code {result.returncode}:\n"
                             f"{(result.stdout + result.stderr).strip()}")

    def _spawn(self, name: str, args: list[str], ready_url: str) -> None:
        log = self.dir / f"{name}.log"
        with open(log, "wb") as out:
            proc = subprocess.Popen(args, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                    start_new_session=True)
        self._procs.append((name, proc))
        deadline = time.monotonic() + self.config.start_timeout_seconds
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                tail = log.read_text(errors="replace")[-2000:]
                raise StackError(f"{name} exited with code {proc.returncode} while starting; {log}:\n{tail}")
            try:
                with urllib.request.urlopen(ready_url, timeout=1) as r:
                    if r.status == 200:
                        return
            except OSError:
                pass
            time.sleep(0.1)
        raise StackError(f"{name} was not ready at {ready_url} within {self.config.start_timeout_seconds:g} s; "
                         f"see {log}")

    def _wait_first_scrape(self) -> None:
        """Prometheus applies new targets every 5 s, so the first scrape lags readiness. A counter whose
        first sample is already above 0 never shows an increase, so training waits for that scrape."""
        url = f"{self.prometheus_url}/api/v1/query?" + urllib.parse.urlencode({"query": 'up{job="trainpatrol"} == 1'})
        deadline = time.monotonic() + self.config.start_timeout_seconds
        while time.monotonic() < deadline:
            try:
                with urllib.request.urlopen(url, timeout=1) as r:
                    if json.loads(r.read())["data"]["result"]:
                        return
            except (OSError, ValueError, KeyError):
                pass
            time.sleep(0.2)
        raise StackError(f"Prometheus did not scrape the agent at {self.agent_url} within "
                         f"{self.config.start_timeout_seconds:g} s; see {self.dir / 'prometheus.log'}")

    def loaded_alerts(self) -> list[str]:
        """The names of the alerting rules Prometheus loaded (GET /api/v1/rules)."""
        url = f"{self.prometheus_url}/api/v1/rules?type=alert"
        with urllib.request.urlopen(url, timeout=5) as r:
            groups = json.loads(r.read())["data"]["groups"]
        return [str(rule["name"]) for g in groups for rule in g["rules"]]

    def alerts(self) -> list[dict[str, Any]]:
        """What the agent's webhook received (GET /v1/alerts), oldest first."""
        req = urllib.request.Request(self.agent_url + "/v1/alerts", headers={"Authorization": f"Bearer {self.token}"})
        with urllib.request.urlopen(req, timeout=5) as r:
            return list(json.loads(r.read())["alerts"])

    def stop(self) -> None:
        """Stop in reverse order (Prometheus first, the agent last) and remove the private directory."""
        while self._procs:
            _, proc = self._procs.pop()
            terminate(proc)
        if self._private is not None:
            shutil.rmtree(self._private, ignore_errors=True)
            self._private = None

    def __enter__(self) -> Stack:
        return self if self._procs else self.start()

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.stop()

"""The ``trainpatrol`` command. Flags map onto the components' configs; what is left here is turning
every failure a user can cause into one line on stderr and a non-zero exit, never a traceback."""

from __future__ import annotations

import argparse
import errno
import http.client
import json
import logging
import os
import re
import socket
import sys
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any, NoReturn

from ._version import __version__
from .actions import ACTIONS
from .agent.config import DEFAULT_PORT, DEFAULT_URL, EMBEDDED_IDLE_SECONDS
from .catalogue import SERIES_BUDGET
from .faults import FAULTS
from .shipped import KINDS, export

DEFAULT_AGENT = os.environ.get("TRAINPATROL_AGENT_URL", DEFAULT_URL)
DESCRIPTION = """Watches PyTorch training runs, exports their health to Prometheus, and pauses, checkpoints
or stops a sick run. Training processes use Patrol (from trainpatrol import Patrol); this command
runs the agent they push to, operates runs through it, and renders evidence reports."""
EXAMPLES = """examples:
  trainpatrol demo                       train a small model, inject a NaN, watch it pause and resume
  trainpatrol agent --port 9402          serve /metrics, the control API and the Alertmanager webhook
  trainpatrol status
  trainpatrol status my-run --json
  trainpatrol pause my-run --reason "loss looks off"
  trainpatrol resume my-run
  trainpatrol report trainpatrol/evidence/20250101T000000Z-step00000150-pause

The agent URL comes from --agent or TRAINPATROL_AGENT_URL (default http://127.0.0.1:9402); a token from
--token-file, TRAINPATROL_TOKEN_FILE or TRAINPATROL_TOKEN. `trainpatrol COMMAND --help` describes each."""


class CliError(Exception):
    """A failure the user can act on: ``main`` prints it as one line and exits 1."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        """One line instead of argparse's usage block: the message names the flag and the value."""
        self.exit(2, f"{self.prog}: {message} (see {self.prog} --help)\n")


_UNPRINTABLE = re.compile("[\x00-\x1f\x7f-\x9f\u2028\u2029\u200e\u200f\u202a-\u202e\u2066-\u2069\ud800-\udfff]")
"""What a terminal acts on rather than shows: C0/C1 controls (escape sequences), line separators,
direction marks and overrides, lone surrogates. The agent refuses them; an old or hostile one may not."""


def clean(text: object) -> str:
    """``text`` as a string without what a terminal would act on."""
    return _UNPRINTABLE.sub("", str(text))


def _agent_url(value: str) -> str:
    parsed = urllib.parse.urlparse(value)
    if parsed.scheme not in ("http", "https") or not parsed.hostname:
        raise argparse.ArgumentTypeError(f"{value!r} is not an agent URL; expected http://HOST:PORT")
    try:
        parsed.port  # noqa: B018 -- raises on a port that is not a number
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"{value!r} is not an agent URL: {exc}") from None
    return value


def _fault(value: str) -> str:
    fault, at, step = value.partition("@")
    if fault not in FAULTS or (at and not (step.isdigit() and int(step) > 0)):
        raise argparse.ArgumentTypeError(f"{value!r} is not FAULT@STEP with FAULT one of {', '.join(FAULTS)} "
                                         "and STEP a positive step number")
    return value


def _agent_parser(sub: Any) -> None:
    p = sub.add_parser("agent", help="run the agent (scrape target, control API, webhook receiver)")
    p.add_argument("--host", help="bind address (default 127.0.0.1; non-loopback needs a token)")
    p.add_argument("--port", type=int, help=f"port (default {DEFAULT_PORT})")
    p.add_argument("--mode", choices=["agent", "router"])
    p.add_argument("--series", choices=["standard", "full"],
                   help=f"standard (default): at most {SERIES_BUDGET} series a rank; "
                        "full: every series of docs/metrics.md")
    p.add_argument("--token-file", help="file holding the bearer token (or TRAINPATROL_TOKEN)")
    p.add_argument("--allowed-actions", help="comma-separated actions webhooks and the API may request")
    p.add_argument("--peers", help="comma-separated host:port of peer agents alerts may be forwarded to")
    p.add_argument("--peers-dns", help="DNS name whose addresses are peers (a headless Service)")
    p.add_argument("--allowed-hosts", help="comma-separated Host names the agent answers to besides loopback and "
                                           "--host (a Service name, the pod IP); others get 421")
    p.add_argument("--api-docs", action="store_true", default=None, help="serve /docs and /openapi.json")
    p.add_argument("--nvml", dest="nvml", action="store_true", default=None, help="collect NVML metrics (default)")
    p.add_argument("--no-nvml", dest="nvml", action="store_false")
    p.add_argument("--nvml-interval", type=float, dest="nvml_interval_seconds")
    p.add_argument("--nvml-slow-interval", type=float, dest="nvml_slow_interval_seconds",
                   help="seconds between reads of energy, ECC, retired pages, remapped rows, power limit, PCIe")
    p.add_argument("--nvml-pcie", action="store_true", default=None, help="PCIe throughput (slow per GPU)")
    p.add_argument("--nvml-processes", action="store_true", default=None, help="per-rank GPU memory")
    p.add_argument("--nvml-fake", metavar="FIXTURE",
                   help="serve recorded NVML readings from this fixture, with fake.py beside it, instead of a GPU "
                        "(demos and tests from the repository: tests/nvml_fake/nvml_h200.json)")
    p.add_argument("--rank-up-ttl", type=float, dest="rank_up_ttl_seconds")
    p.add_argument("--rank-expire", type=float, dest="rank_expire_seconds")
    p.add_argument("--exit-when-idle", type=float, dest="exit_when_idle_seconds", metavar="SECONDS",
                   help="exit when no rank has pushed for SECONDS (default 0: never; an embedded agent uses "
                        f"{EMBEDDED_IDLE_SECONDS:g})")
    p.add_argument("--log-level")


def _control_parsers(sub: Any) -> None:
    for action in ACTIONS:
        p = sub.add_parser(action.replace("_", "-"), help=f"ask every rank of RUN to {action}")
        p.add_argument("run")
        p.add_argument("--namespace", default="", help="the run's namespace (default: none)")
        p.add_argument("--reason", default="requested from the CLI")
        _client_args(p)
        p.set_defaults(action=action)
    p = sub.add_parser("status", help="a table of runs and ranks")
    p.add_argument("run", nargs="?")
    p.add_argument("--json", action="store_true")
    _client_args(p)


def _client_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--agent", default=DEFAULT_AGENT, type=_agent_url, help=f"agent URL (default {DEFAULT_AGENT})")
    p.add_argument("--token-file", help="file holding the bearer token (or TRAINPATROL_TOKEN)")


def _demo_parser(sub: Any) -> None:
    p = sub.add_parser("demo", help="train a small model with Patrol, inject a fault, pause and resume")
    p.add_argument("--steps", type=int, default=400)
    p.add_argument("--run", default="demo")
    p.add_argument("--agent-url", default=DEFAULT_URL,
                   help="the agent (started if none answers); with --stack the demo starts its own agent, with a "
                        "token, on this port or a free one")
    p.add_argument("--inject", type=_fault, help=f"FAULT@STEP, FAULT one of {', '.join(FAULTS)} "
                                    "(default nan@150; with --stack grad_spike@200)")
    p.add_argument("--step-sleep", type=float, default=0.02, help="extra seconds per step, to watch it live")
    p.add_argument("--auto-resume", type=float, default=3.0,
                   help="seconds after a pause at which the demo asks the agent to resume (0: wait for you)")
    p.add_argument("--workdir", default="demo-output", help="checkpoints and evidence go here")
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    p.add_argument("--checkpoint-every", type=int, default=100)
    p.add_argument("--eval-every", type=int, default=25, help="steps between validation-loss evaluations")
    p.add_argument("--quiet", action="store_true")
    p.add_argument("--stack", action="store_true",
                   help="also run Prometheus and Alertmanager on 127.0.0.1 with the shipped rules (fast profile), "
                        "so the real alert loop acts; falls back to the local guards without the binaries")
    p.add_argument("--prometheus-port", type=int, default=9090, help="with --stack; a busy port is replaced")
    p.add_argument("--alertmanager-port", type=int, default=9093, help="with --stack; a busy port is replaced")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="trainpatrol", description=DESCRIPTION, epilog=EXAMPLES,
                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--version", action="version", version=f"trainpatrol {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    _agent_parser(sub)
    _control_parsers(sub)
    _demo_parser(sub)
    r = sub.add_parser("report", help="(re)generate report.html of an evidence bundle")
    r.add_argument("bundle")
    e = sub.add_parser("export", help="write out what the package ships: " + ", ".join(KINDS),
                       description="; ".join(f"{kind}: {what}" for kind, what in KINDS.items()))
    e.add_argument("kind", choices=list(KINDS))
    e.add_argument("dir", help="written into this folder (created if needed)")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        return _run(args)
    except CliError as exc:
        print(f"trainpatrol {args.command}: {clean(exc)}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130


def _run(args: argparse.Namespace) -> int:
    if args.command == "agent":
        return _agent(args)
    if args.command == "demo":
        from ._torch import require_torch

        try:
            require_torch()
        except ImportError as exc:
            print(f"trainpatrol demo: {exc}", file=sys.stderr)
            return 2
        from .demo import run_demo

        return run_demo(args)
    if args.command == "export":
        return _export(args)
    if args.command == "status":
        return _status(args)
    if args.command == "report":
        return _report(Path(args.bundle))
    return _action(args)


def _export(args: argparse.Namespace) -> int:
    try:
        for path in export(args.kind, Path(args.dir)):
            print(path)
    except OSError as exc:
        print(f"trainpatrol export {args.kind}: {exc}", file=sys.stderr)
        return 1
    return 0


def _report(path: Path) -> int:
    from .report import write_report
    from .report.bundle import NotABundle

    if not path.is_dir():
        raise CliError(f"{path} is not a directory")
    try:
        print(write_report(path))
    except NotABundle as exc:
        raise CliError(str(exc)) from None
    except OSError as exc:
        raise CliError(f"cannot write the report into {path}: {exc.strerror or exc}") from None
    return 0


def _agent(args: argparse.Namespace) -> int:
    from .agent.config import AgentConfig, ConfigError
    from .agent.server import serve

    overrides = {k: v for k, v in vars(args).items() if k not in ("command",) and v is not None}
    for key in ("allowed_actions", "peers", "allowed_hosts"):
        if key in overrides:
            overrides[key] = tuple(x.strip() for x in overrides[key].split(",") if x.strip())
    try:
        config = AgentConfig.from_env(**overrides).load()
    except ConfigError as exc:
        print(f"trainpatrol agent: {exc}", file=sys.stderr)
        return 2
    problem = _cannot_bind(config.host, config.port)
    if problem:
        print(f"trainpatrol agent: {problem}", file=sys.stderr)
        return 1
    serve(config)
    return 0


def _cannot_bind(host: str, port: int) -> str:
    """Why the agent could not listen on ``host:port``, or "" when it can. Asked before uvicorn starts,
    whose own failure comes after its whole start-up log; a port taken in between still fails there."""
    try:
        family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
    except OSError as exc:
        return f"cannot resolve host {host!r}: {exc.strerror or exc}"
    try:
        with socket.socket(family, socket.SOCK_STREAM) as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn binds
            sock.bind((host, port))
    except OSError as exc:
        if exc.errno == errno.EADDRINUSE:
            return f"port {port} on {host} is taken (another agent?); pick another with --port"
        return f"cannot listen on {host}:{port}: {exc.strerror or exc}"
    return ""


def _token(args: argparse.Namespace) -> str:
    path = getattr(args, "token_file", None) or os.environ.get("TRAINPATROL_TOKEN_FILE")
    if path:
        try:
            return Path(path).read_text().strip()
        except OSError as exc:
            raise CliError(f"cannot read the token file {path}: {exc.strerror or exc}") from None
    return os.environ.get("TRAINPATROL_TOKEN", "")


def _call(args: argparse.Namespace, path: str, body: Any = None) -> Any:
    """The agent's JSON answer. An HTTP error status is raised as ``HTTPError`` for the caller to word;
    an agent that cannot be reached, or answers something that is not JSON, is a ``CliError``."""
    req = urllib.request.Request(args.agent.rstrip("/") + path, method="POST" if body is not None else "GET",
                                 data=None if body is None else json.dumps(body).encode())
    req.add_header("Content-Type", "application/json")
    token = _token(args)
    if token:
        req.add_header("Authorization", f"Bearer {token}")
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            return json.loads(r.read())
    except urllib.error.HTTPError:
        raise
    except urllib.error.URLError as exc:
        reason = exc.reason
        why = (reason.strerror or str(reason)) if isinstance(reason, OSError) else str(reason)
        raise CliError(f"cannot reach agent {args.agent} ({why})") from None
    except (OSError, http.client.HTTPException) as exc:  # a timeout, a reset, a broken answer
        raise CliError(f"cannot reach agent {args.agent} ({getattr(exc, 'strerror', None) or exc})") from None
    except ValueError:
        raise CliError(f"agent {args.agent} answered something that is not JSON; is it a trainpatrol agent?") \
            from None


def _answered(args: argparse.Namespace, exc: urllib.error.HTTPError) -> CliError:
    body = exc.read().decode("utf-8", "replace")
    return CliError(f"agent {args.agent} answered {exc.code}: {_detail(body) or body[:200] or exc.reason}")


def _action(args: argparse.Namespace) -> int:
    """Queues the action for the run's live ranks. Exits 1 with one line on stderr when the agent
    refuses (``no live rank of run RUN on this agent`` when no rank of the run could carry it out)
    or cannot be reached."""
    try:
        where = f"/v1/namespaces/{args.namespace}" if args.namespace else "/v1"
        reply = _call(args, f"{where}/runs/{args.run}/actions", {"action": args.action, "reason": args.reason})
    except urllib.error.HTTPError as exc:
        if exc.code not in (404, 409):
            raise _answered(args, exc) from None
        body = exc.read().decode("utf-8", "replace")
        print(_detail(body) or f"no live rank of run {args.run} on this agent", file=sys.stderr)
        return 1
    live = int(reply.get("live_ranks", 0))
    how = "already queued" if reply.get("coalesced") else "queued"  # one not yet acted on stands for this one
    ranks = f"{live} live rank{'' if live == 1 else 's'}"
    print(clean(f"{args.action} {how} for run {args.run} (id {reply['id']}; {ranks})"))
    return 0


def _detail(body: str) -> str:
    """The ``detail`` of an agent's error answer when it is one line, else ""."""
    try:
        detail = json.loads(body).get("detail")
    except (ValueError, AttributeError):
        return ""
    return clean(detail) if isinstance(detail, str) and detail and "\n" not in detail else ""


def _status(args: argparse.Namespace) -> int:
    try:
        runs = [_call(args, f"/v1/runs/{args.run}")] if args.run else _call(args, "/v1/runs")["runs"]
    except urllib.error.HTTPError as exc:
        if exc.code == 404 and args.run:
            raise CliError(f"run {args.run} is unknown on agent {args.agent}") from None
        raise _answered(args, exc) from None
    except (KeyError, TypeError):
        raise CliError(f"agent {args.agent} answered without a list of runs; is it a trainpatrol agent?") from None
    if args.json:
        print(json.dumps(runs, indent=2))
        return 0
    try:
        rows = _status_rows(runs)
    except (KeyError, TypeError, AttributeError):
        raise CliError(f"agent {args.agent} answered runs in a form this CLI does not know; try --json") from None
    print("\n".join(rows))
    return 0


def _status_rows(runs: list[dict[str, Any]]) -> list[str]:
    """The table ``trainpatrol status`` prints; every value from the agent is cleaned first."""
    rows = [f"{'RUN':<20} {'STATE':<10} {'RANK':>5} {'RANK STATE':<10} {'STEP':>8} {'HOST':<20} LAST ACTION"]
    for run in runs:
        last = run.get("last_action") or {}
        summary = clean(f"{last.get('action', '-')} {last.get('outcome', '')} @{last.get('step', '')}") if last else "-"
        name, state = clean(run["run"]), clean(run["state"])
        for r in run["ranks"]:
            rows.append(f"{name:<20} {state:<10} {clean(r['rank']):>5} {clean(r['state']):<10} {clean(r['step']):>8} "
                        f"{clean(r['host'])[:20]:<20} {summary}")
        if run.get("last_checkpoint"):
            rows.append(f"{'':<20} last checkpoint: {clean(run['last_checkpoint'])}")
    return rows

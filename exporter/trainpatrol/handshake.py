"""How a rank knows it talks to a real agent before it sends the token or the run key.

A process that binds the agent's port first (before an agent starts, or after an embedded one exited)
would otherwise receive both and could steer the run with a forged reply. So every connection a Patrol
opens starts with ``POST /v1/hello``: the Patrol sends a fresh nonce, and the agent answers an HMAC of
it keyed by a secret the Patrol holds too, bound to the agent's own port and, on loopback, to the
Patrol's address as the agent sees it (a listener relaying the hello to an agent elsewhere gets a
proof for the wrong port or address). The secret is the agent token when the Patrol has it; otherwise
the agent's key, which a loopback agent writes at start to a file only its user can read
(``key_path``): a loopback agent without a token is trusted by its own user's runs alone.
"""

from __future__ import annotations

import hashlib
import hmac
import http.client
import ipaddress
import json
import os
import secrets
from pathlib import Path

PATH = "/v1/hello"
SecretKind = str  # "token" or "key"


class AgentNotVerified(ConnectionError):
    """The peer on the agent's port did not prove it knows the secret: nothing more is sent to it."""


def key_path(port: int) -> Path:
    """The loopback agent's key file for ``port``: in the user's runtime directory, else their cache."""
    base = os.environ.get("XDG_RUNTIME_DIR") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "trainpatrol" / f"agent-{port}.key"


def write_key(port: int, key: str) -> None:
    """The key of the agent on ``port``, written readable by this user alone."""
    path = key_path(port)
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(key)
    os.replace(tmp, path)


def remove_key(port: int, key: str) -> None:
    """Removes the key file if it still holds ``key`` (another agent may have taken the port since)."""
    path = key_path(port)
    try:
        if path.read_text() == key:
            path.unlink()
    except OSError:
        pass


def read_key(port: int) -> str:
    """The key of this user's loopback agent on ``port``; empty when there is none."""
    try:
        return key_path(port).read_text().strip()
    except OSError:
        return ""


def proof(secret: str, nonce: str, port: int, client: str) -> str:
    """What the agent answers: ``client`` is the caller's address on loopback, ``-`` otherwise."""
    message = f"trainpatrol-agent|{nonce}|{port}|{client}".encode()
    return hmac.new(secret.encode(), message, hashlib.sha256).hexdigest()


def client_part(address: str) -> str:
    return address if _is_loopback(address) else "-"


def secret_for(token: str, host: str, port: int) -> tuple[SecretKind, str]:
    """Which secret a Patrol can check an agent at ``host:port`` with; ("", "") when none."""
    if token:
        return "token", token
    key = read_key(port) if _is_loopback(host) or host == "localhost" else ""
    return ("key", key) if key else ("", "")


def connect(host: str, port: int, token: str, timeout: float) -> http.client.HTTPConnection:
    """A connection to the agent at ``host:port`` that proved itself (``verify``); the caller may send
    its token and run key on it, and believe its answers."""
    kind, secret = secret_for(token, host, port)
    conn = http.client.HTTPConnection(host, port, timeout=timeout)
    try:
        verify(conn, kind, secret, port)
    except BaseException:
        conn.close()
        raise
    return conn


def verify(conn: http.client.HTTPConnection, kind: SecretKind, secret: str, port: int) -> None:
    """Runs the hello on ``conn`` (opened here if not yet); raises ``AgentNotVerified`` unless the
    agent proved it holds ``secret``. Sends neither the token nor the run key."""
    if not secret:
        raise AgentNotVerified("no secret to check the agent with: give the run TRAINPATROL_TOKEN, or run the "
                               "agent on loopback as this user")
    nonce = secrets.token_hex(16)
    conn.request("POST", PATH, body=json.dumps({"nonce": nonce, "with": kind}).encode(),
                 headers={"Content-Type": "application/json"})
    resp = conn.getresponse()
    data = resp.read()
    if resp.status != 200:
        raise AgentNotVerified(f"the agent answered the hello with {resp.status}")
    assert conn.sock is not None
    local = conn.sock.getsockname()[0]
    try:
        got = [str(p) for p in json.loads(data)["proofs"]][:64]
    except (ValueError, KeyError, TypeError):
        got = []
    expected = proof(secret, nonce, port, client_part(local))
    if not any(hmac.compare_digest(p, expected) for p in got):
        raise AgentNotVerified("the peer on the agent's port did not prove it is the agent")


def _is_loopback(address: str) -> bool:
    try:
        return ipaddress.ip_address(address.split("%")[0]).is_loopback
    except ValueError:
        return address == "localhost"

"""How a rank knows it talks to a real agent before it sends the token or the run key.

A process that binds the agent's port first could otherwise receive both and steer the run with forged
replies. So every connection a Patrol opens starts with ``POST /v1/hello``: the Patrol sends a fresh nonce,
and the agent answers its HMAC under a secret the Patrol holds too, bound to the agent's port and, on
loopback, to the Patrol's address as the agent sees it (so a relay to an agent elsewhere proves the wrong
port or address). The secret is the agent token when the Patrol has it, else the key that a loopback agent
writes at start to a file only its user can read (``key_path``): such an agent is trusted by its user's runs.
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
    return address if is_loopback(address) else "-"


def connect(host: str, port: int, token: str, timeout: float) -> http.client.HTTPConnection:
    """A connection to the agent at ``host:port`` that proved itself (``verify``) with the token, else
    the key of this user's loopback agent; the caller may send its token and run key on it."""
    key = "" if token or not is_loopback(host) else read_key(port)
    kind, secret = ("token", token) if token else ("key", key) if key else ("", "")
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


def is_loopback(address: str) -> bool:
    """``localhost`` or a loopback address (an IPv6 one with or without its zone)."""
    try:
        return ipaddress.ip_address(address).is_loopback
    except ValueError:
        return address == "localhost"

"""The rank's side of ``POST /v1/push/stream``: one kept-open request, one chunk per push.

``http.client`` cannot read an answer while its request body is still going out, so this speaks
the little HTTP/1.1 it needs over a plain socket: a chunked request body whose chunks are NDJSON
snapshots, and a chunked NDJSON answer read whenever it has data (agent.push_stream describes
both). Every blocking call is bounded by ``timeout``.
"""

from __future__ import annotations

import json
import select
import socket
from typing import Any

PATH = "/v1/push/stream"
RUN_KEY_HEADER = "X-Trainpatrol-Run-Key"
"""Proves the run's key (probe.run_key) for every line of the stream."""


class StreamRefused(Exception):
    """The agent answered the stream's request with an error status (a wrong token: 401)."""

    def __init__(self, status: int, detail: str) -> None:
        super().__init__(f"agent answered {status}: {detail}")
        self.status, self.detail = status, detail


class _Dechunker:
    """Turns a chunked HTTP body, fed in arbitrary pieces, back into its bytes."""

    def __init__(self) -> None:
        self._buffer = b""
        self._left = 0  # bytes of the current chunk still to come
        self._crlf = False  # the CRLF after a chunk's data is still to come
        self.done = False

    def feed(self, data: bytes) -> bytes:
        self._buffer += data
        out = []
        while not self.done:
            if self._left:
                take = min(self._left, len(self._buffer))
                out.append(self._buffer[:take])
                self._buffer, self._left = self._buffer[take:], self._left - take
                if self._left:
                    break
                self._crlf = True
            elif self._crlf:
                if len(self._buffer) < 2:
                    break
                self._buffer, self._crlf = self._buffer[2:], False
            else:
                head, crlf, rest = self._buffer.partition(b"\r\n")
                if not crlf:
                    break
                self._buffer, self._left = rest, int(head.split(b";")[0], 16)
                self.done = self._left == 0
        return b"".join(out)


class PushStream:
    """One open stream to the agent. Not thread-safe: its owner serialises calls."""

    def __init__(self, host: str, port: int, token: str = "", timeout: float = 1.0, *, run_key: str = "") -> None:
        self._host, self._port, self._token, self._timeout = host, port, token, timeout
        self._run_key = run_key
        self._sock: socket.socket | None = None
        self._body = _Dechunker()
        self._lines = b""
        self._eof = False
        self.summary: dict[str, Any] | None = None

    @property
    def is_open(self) -> bool:
        return self._sock is not None

    def fileno(self) -> int:
        return self._sock.fileno() if self._sock is not None else -1

    def open(self) -> None:
        """Connects and sends the request head; raises ``StreamRefused`` if the agent says no."""
        sock = socket.create_connection((self._host, self._port), timeout=self._timeout)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        head = [f"POST {PATH} HTTP/1.1", f"Host: {self._host}:{self._port}",
                "Content-Type: application/x-ndjson", "Transfer-Encoding: chunked"]
        if self._token:
            head.append(f"Authorization: Bearer {self._token}")
        if self._run_key:
            head.append(f"{RUN_KEY_HEADER}: {self._run_key}")
        try:
            sock.sendall(("\r\n".join(head) + "\r\n\r\n").encode("latin-1"))
            status, headers, rest = _read_head(sock)
            if status != 200:
                raise StreamRefused(status, _read_problem(sock, headers, rest))
        except BaseException:
            sock.close()
            raise
        self._sock, self._body, self._lines, self._eof, self.summary = sock, _Dechunker(), b"", False, None
        self._lines = self._body.feed(rest)

    def send(self, line: bytes) -> None:
        """One snapshot, as one chunk; ``line`` ends with a newline."""
        assert self._sock is not None, "open() first"
        self._sock.sendall(b"%x\r\n%s\r\n" % (len(line), line))

    def replies(self) -> list[dict[str, Any]]:
        """Whatever answer lines have arrived, without waiting. Afterwards ``ended`` says whether the
        agent ended the answer or closed the connection; the stream is of no further use then."""
        assert self._sock is not None, "open() first"
        while not self.ended and select.select([self._sock], [], [], 0)[0]:
            data = self._sock.recv(65536)
            if not data:
                self._eof = True
            self._lines += self._body.feed(data)
        return self._take_lines()

    @property
    def ended(self) -> bool:
        return self._eof or self._body.done

    def finish(self) -> list[dict[str, Any]]:
        """Ends the request body and reads the answer to its end: every line was handled by then."""
        assert self._sock is not None, "open() first"
        self._sock.sendall(b"0\r\n\r\n")
        while not self._body.done:
            data = self._sock.recv(65536)
            if not data:
                raise ConnectionError("agent closed the push stream before its summary")
            self._lines += self._body.feed(data)
        return self._take_lines()

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None

    def _take_lines(self) -> list[dict[str, Any]]:
        *complete, self._lines = self._lines.split(b"\n")
        out = []
        for raw in complete:
            if raw.strip():
                value = json.loads(raw)
                if "accepted" in value:
                    self.summary = value
                else:
                    out.append(value)
        return out


def _read_head(sock: socket.socket) -> tuple[int, dict[str, str], bytes]:
    data = b""
    while b"\r\n\r\n" not in data:
        more = sock.recv(65536)
        if not more:
            raise ConnectionError("agent closed the connection before answering the push stream")
        data += more
        if len(data) > 65536:
            raise ConnectionError("agent's answer head is too long")
    head, _, rest = data.partition(b"\r\n\r\n")
    status_line, *header_lines = head.decode("latin-1").split("\r\n")
    headers = {}
    for line in header_lines:
        name, _, value = line.partition(":")
        headers[name.strip().lower()] = value.strip()
    return int(status_line.split()[1]), headers, rest


def _read_problem(sock: socket.socket, headers: dict[str, str], rest: bytes) -> str:
    """The ``detail`` of an error answer with a Content-Length body, or what there is of it."""
    length = int(headers.get("content-length", "0") or 0)
    body = rest
    while len(body) < length:
        more = sock.recv(65536)
        if not more:
            break
        body += more
    try:
        return str(json.loads(body).get("detail", body[:300]))
    except ValueError:
        return body[:300].decode("latin-1")

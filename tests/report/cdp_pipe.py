"""Drives Debian's headless Chromium over the DevTools protocol on a pipe (``--remote-debugging-pipe``).

No webdriver, no websocket library and no browser download: Chromium reads commands on fd 3 and
writes replies and events on fd 4, each a JSON message ended by a NUL byte.
"""

from __future__ import annotations

import base64
import contextlib
import fcntl
import json
import os
import shutil
import subprocess
import threading
import time
from pathlib import Path
from typing import Any

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
FLAGS = ("--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync",
         "--disable-default-apps", "--hide-scrollbars", "--disable-extensions", "--mute-audio",
         "--remote-debugging-pipe")


class Chromium:
    """``with Chromium(tmp) as c: page = c.open(url)``; ``c.events`` holds every event seen."""

    def __init__(self, profile: Path, binary: str | None = CHROMIUM) -> None:
        if binary is None:
            raise FileNotFoundError("chromium is not installed")
        to_child_r, self._to_child = os.pipe()
        self._from_child, from_child_w = os.pipe()

        def fds_3_and_4() -> None:  # runs in the child, before exec
            a = fcntl.fcntl(to_child_r, fcntl.F_DUPFD, 10)
            b = fcntl.fcntl(from_child_w, fcntl.F_DUPFD, 10)
            os.dup2(a, 3)
            os.dup2(b, 4)

        profile.mkdir(parents=True, exist_ok=True)
        self._log = open(profile.parent / f"{profile.name}-chromium.log", "wb")  # noqa: SIM115
        # close_fds=False: subprocess would close fds 3 and 4 after preexec_fn; every other fd Python
        # opened is non-inheritable (PEP 446) and closes on exec anyway
        self.proc = subprocess.Popen([binary, *FLAGS, f"--user-data-dir={profile}", "about:blank"],
                                     close_fds=False, preexec_fn=fds_3_and_4,
                                     stdin=subprocess.DEVNULL, stdout=self._log, stderr=subprocess.STDOUT)
        os.close(to_child_r)
        os.close(from_child_w)
        self._next = 0
        self._replies: dict[int, dict[str, Any]] = {}
        self.events: list[dict[str, Any]] = []
        self._cv = threading.Condition()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        buf = b""
        while True:
            chunk = os.read(self._from_child, 1 << 16)
            if not chunk:
                return
            buf += chunk
            while b"\0" in buf:
                raw, buf = buf.split(b"\0", 1)
                msg = json.loads(raw)
                with self._cv:
                    if "id" in msg:
                        self._replies[msg["id"]] = msg
                    else:
                        self.events.append(msg)
                    self._cv.notify_all()

    def call(self, method: str, params: dict[str, Any] | None = None, session: str | None = None,
             timeout: float = 90.0) -> dict[str, Any]:
        with self._cv:
            self._next += 1
            mid = self._next
        msg: dict[str, Any] = {"id": mid, "method": method, "params": params or {}}
        if session:
            msg["sessionId"] = session
        os.write(self._to_child, json.dumps(msg).encode() + b"\0")
        deadline = time.monotonic() + timeout
        with self._cv:
            while mid not in self._replies:
                left = deadline - time.monotonic()
                if self.proc.poll() is not None:
                    raise RuntimeError(f"Chromium exited (code {self.proc.returncode}) before answering {method}")
                if left <= 0:  # a loaded runner's Chromium can take tens of seconds to open its first tab
                    raise TimeoutError(f"Chromium did not answer {method} within {timeout} s")
                self._cv.wait(left)
            reply = self._replies.pop(mid)
        if "error" in reply:
            raise RuntimeError(f"{method}: {reply['error']}")
        return dict(reply.get("result", {}))

    def wait_event(self, method: str, session: str, timeout: float = 30.0) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        with self._cv:
            while True:
                for e in self.events:
                    if e.get("method") == method and e.get("sessionId") == session:
                        return e
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(f"no {method} within {timeout} s")
                self._cv.wait(left)

    def open(self, url: str, width: int = 1280, height: int = 900) -> str:
        """A new tab with network, page, runtime and log events on; navigates and waits for load."""
        target = self.call("Target.createTarget", {"url": "about:blank"})["targetId"]
        sid = str(self.call("Target.attachToTarget", {"targetId": target, "flatten": True})["sessionId"])
        for domain in ("Page", "Network", "Runtime", "Log"):
            self.call(f"{domain}.enable", session=sid)
        self.call("Emulation.setDeviceMetricsOverride",
                  {"width": width, "height": height, "deviceScaleFactor": 1, "mobile": False}, sid)
        self.call("Page.navigate", {"url": url}, sid)
        self.wait_event("Page.loadEventFired", sid)
        return sid

    def session_events(self, sid: str, method: str) -> list[dict[str, Any]]:
        with self._cv:
            return [e["params"] for e in self.events if e.get("sessionId") == sid and e.get("method") == method]

    def evaluate(self, sid: str, expression: str) -> Any:
        result = self.call("Runtime.evaluate", {"expression": expression, "returnByValue": True}, sid)
        if "exceptionDetails" in result:
            raise RuntimeError(f"page script failed: {result['exceptionDetails']}")
        return result["result"].get("value")

    def screenshot(self, sid: str, path: Path, clip: dict[str, float] | None = None) -> bytes:
        """A PNG of ``clip`` (CSS pixels), or of the whole page when None."""
        if clip is None:
            size = self.call("Page.getLayoutMetrics", session=sid)["cssContentSize"]
            clip = {"x": 0, "y": 0, "width": size["width"], "height": size["height"]}
        shot = self.call("Page.captureScreenshot", {"format": "png", "captureBeyondViewport": True,
                                                    "clip": {**clip, "scale": 1}}, sid)
        data = base64.b64decode(shot["data"])
        path.write_bytes(data)
        return data

    def close(self) -> None:
        with contextlib.suppress(RuntimeError, TimeoutError, OSError):
            self.call("Browser.close", timeout=5)
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        for fd in (self._to_child, self._from_child):
            with contextlib.suppress(OSError):
                os.close(fd)
        self._log.close()

    def __enter__(self) -> Chromium:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def png_size(data: bytes) -> tuple[int, int]:
    """Width and height from a PNG's IHDR chunk."""
    assert data[:8] == b"\x89PNG\r\n\x1a\n", "not a PNG"
    return int.from_bytes(data[16:20], "big"), int.from_bytes(data[20:24], "big")

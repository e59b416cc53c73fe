"""The trickle flood: connections that send one header byte every ``every`` seconds and never end a
request, reopened as soon as the agent closes them: bench/scrape.py's ``--hostile`` load and
tests/security/test_connections.py. Against eviction by "silent longest" it starved kept-alive rank
streams (0 of 640 pushes through, issue 34)."""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Iterator


class Trickle:
    """``count`` trickling connections to 127.0.0.1:``port``, on their own event loop in a thread."""

    def __init__(self, port: int, count: int = 300, every: float = 0.25) -> None:
        self.port, self.count, self.every = port, count, every
        self.opened = 0
        """Connections opened, reopened ones included."""
        self._stop = threading.Event()
        self._thread = threading.Thread(target=lambda: asyncio.run(self._main()), daemon=True)

    async def _one(self, i: int) -> None:
        head = f"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1:{self.port}\r\nX-Trickle-{i}: ".encode()
        head += b"a" * 60_000  # never ends: within max_header_bytes for 60,000 bytes at 4 a second
        await asyncio.sleep(self.every * i / self.count)  # spread over one period
        while not self._stop.is_set():
            writer = None
            try:
                reader, writer = await asyncio.open_connection("127.0.0.1", self.port)
                self.opened += 1
                for byte in head:
                    if self._stop.is_set() or reader.at_eof():
                        break
                    writer.write(bytes((byte,)))
                    await writer.drain()
                    with contextlib.suppress(TimeoutError):  # an answer or a close ends the wait early
                        if await asyncio.wait_for(reader.read(1024), self.every) == b"":
                            break
            except OSError:
                await asyncio.sleep(0.01)
            finally:
                if writer is not None:
                    writer.close()

    async def _main(self) -> None:
        tasks = [asyncio.create_task(self._one(i)) for i in range(self.count)]
        while not self._stop.is_set():
            await asyncio.sleep(0.05)
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    @contextlib.contextmanager
    def running(self) -> Iterator[Trickle]:
        self._thread.start()
        try:
            yield self
        finally:
            self._stop.set()
            self._thread.join(10)

"""uvicorn's server with a main loop that wakes once a second instead of ten times.

uvicorn's own loop sleeps 0.1 s between checks for a shutdown request, and a wake-up from an idle
wait costs far more CPU than the check (docs/benchmarks.md, "Wake-ups"). This loop refreshes the
Date header once a second, as uvicorn does, and a shutdown signal wakes it at once.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from types import FrameType

import uvicorn


class QuietServer(uvicorn.Server):
    tick_seconds = 1.0

    def __init__(self, config: uvicorn.Config, should_stop: Callable[[], bool] = lambda: False) -> None:
        super().__init__(config)
        self._should_stop = should_stop
        """Asked once a tick: True ends the server as a shutdown signal would (an idle agent, say)."""
        self._loop: asyncio.AbstractEventLoop | None = None
        self._tick: asyncio.Future[None] | None = None

    async def main_loop(self) -> None:
        self._loop = loop = asyncio.get_running_loop()
        counter = 0
        while not await self.on_tick(counter):  # a multiple of 10: on_tick refreshes the Date header
            if self._should_stop():
                self.should_exit = True  # on_tick sees it next and returns True
            counter = (counter + 10) % 864_000
            self._tick = loop.create_future()
            timer = loop.call_later(self.tick_seconds, self._wake)
            try:
                await self._tick
            finally:
                timer.cancel()

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        super().handle_exit(sig, frame)
        if self._loop is not None and not self._loop.is_closed():
            self._loop.call_soon_threadsafe(self._wake)

    def _wake(self) -> None:
        if self._tick is not None and not self._tick.done():
            self._tick.set_result(None)

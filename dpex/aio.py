"""An asyncio event loop on a thread of its own: the home of a daemon's
``grpc.aio`` server (the dispatcher's and the worker's), whose long calls
(heartbeats, syncs, a trainer's Fetch stream) are coroutines that hold no
thread while they wait."""
from __future__ import annotations

import asyncio
import threading
from typing import Any, Coroutine


def new_event_loop() -> asyncio.AbstractEventLoop:
    """uvloop's where it is installed (a tenth less CPU under a fleet, see
    benchmarks/RESULTS.md §13), else asyncio's."""
    try:
        import uvloop
    except ImportError:
        return asyncio.new_event_loop()
    return uvloop.new_event_loop()


class LoopThread:
    """A running event loop and its thread, until :meth:`close`."""

    def __init__(self, name: str) -> None:
        self.loop = new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name=name, daemon=True)
        self._thread.start()

    def run(self, coroutine: Coroutine) -> Any:
        """Runs ``coroutine`` on the loop; its result (from another thread)."""
        return asyncio.run_coroutine_threadsafe(coroutine, self.loop).result()

    def join(self) -> None:
        """Waits until the loop is closed."""
        self._thread.join()

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join()
        self.loop.close()

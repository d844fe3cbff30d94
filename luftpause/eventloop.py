"""The event loop every service's ``main`` runs on, and its wait for a stop signal."""

from __future__ import annotations

import asyncio
import signal
from collections.abc import Coroutine
from typing import Any


def run_event_loop(main: Coroutine[Any, Any, None]) -> None:
    """Run a service's main coroutine on uvloop where it is installed (gRPC's asyncio
    stack costs about half the CPU per message on it), else on the standard loop (e.g.
    on Windows, where uvloop is not a dependency)."""
    try:
        import uvloop
    except ImportError:
        asyncio.run(main)
    else:
        uvloop.run(main)


async def stop_signalled() -> None:
    """Return at the service's first SIGTERM or SIGINT, for its serve() to shut down in order."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)
    await stop.wait()

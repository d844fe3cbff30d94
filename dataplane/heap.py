"""Memory a large request used goes back to the system once the request is over.

A request's bodies are let go when it ends (dataplane/requests.py reads the body without
aiohttp's copy on the request; a turn releases its bodies when it ends, and no reference
cycle holds them, dataplane/turn.py). That returns them to the C allocator, not to the
system: glibc keeps freed memory in its heap, where the chunks of a 31 MiB upload and the
objects decoded from it leave holes between blocks that stay in use, and it trims the
heap's top only past a threshold that grows with the largest blocks freed (up to 64 MiB).
16 such requests at once left 200-300 MB resident for good (``make bench-body-memory``).

So a request that brought a body of at least TRIM_AFTER_BYTES has glibc's
``malloc_trim`` run after it (the free pages of every arena handed back), in a thread,
TRIM_DELAY_S after it ended: the requests of a burst that end within that time share one
trim, and trims come one at a time. A trim costs about 0.1 ms per MB it returns (and
well under a millisecond when there is nothing to return). Elsewhere than glibc (musl,
macOS) there is no ``malloc_trim`` and nothing is done.
"""

from __future__ import annotations

import asyncio
import ctypes
import time
from collections.abc import Callable

import structlog
from aiohttp import web

from luftpause.dataplane.constants import TRIM_AFTER_BYTES, TRIM_DELAY_S

log = structlog.get_logger(component="heap")


def _malloc_trim() -> Callable[[int], int] | None:
    """glibc's ``malloc_trim``, or None where the C library has none."""
    try:
        trim = ctypes.CDLL(None).malloc_trim
    except (OSError, TypeError, AttributeError):
        return None
    trim.argtypes, trim.restype = [ctypes.c_size_t], ctypes.c_int
    return trim


class HeapTrimmer:
    """Trims the C heap after large requests: once per burst, one trim at a time."""

    def __init__(self, trim: Callable[[int], int] | None = None, delay: float = TRIM_DELAY_S) -> None:
        self._trim = trim
        self.delay = delay
        self._busy = False  # a trim is due or under way (on _loop)
        self._again = False  # a large request ended while one was under way: another after it
        self._loop: asyncio.AbstractEventLoop | None = None
        self._task: asyncio.Future | None = None
        self.trims = 0  # trims done

    @property
    def available(self) -> bool:
        return self._trim is not None

    def request_ended(self) -> None:
        """A request with a large body is over: trim DELAY seconds from now, unless a trim
        is due by then already (a trim under way is followed by one more)."""
        if self._trim is None:
            return
        loop = asyncio.get_running_loop()
        if self._busy and self._loop is loop:  # (a trim due on a loop since closed never comes)
            self._again = True
            return
        self._busy, self._loop = True, loop
        loop.call_later(self.delay, self._start)

    def _start(self) -> None:
        self._again = False
        started = time.monotonic()
        self._task = asyncio.ensure_future(asyncio.to_thread(self._trim, 0))
        self._task.add_done_callback(lambda task: self._done(task, started))

    def _done(self, task: asyncio.Future, started: float) -> None:
        self._busy, self._task = False, None
        self.trims += 1
        if not task.cancelled() and task.exception() is not None:
            log.warning("heap_trim_failed", error=repr(task.exception()))
        else:
            log.debug("heap_trimmed", ms=round((time.monotonic() - started) * 1000, 1))
        if self._again:
            self._again = False
            self.request_ended()


TRIMMER = HeapTrimmer(_malloc_trim())  # one C heap per process


@web.middleware
async def trim_after_large_bodies(request: web.Request, handler):
    """After a request that brought TRIM_AFTER_BYTES or more, whatever its answer, the
    process's C heap is trimmed (soon, with the others of its burst)."""
    try:
        return await handler(request)
    finally:
        if getattr(request.content, "total_bytes", 0) >= TRIM_AFTER_BYTES:  # (the bytes it received)
            TRIMMER.request_ended()

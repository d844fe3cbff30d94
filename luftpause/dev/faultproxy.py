"""A TCP proxy on loopback that can cut the link it carries: a network partition for
tests and ``make chaos``, without network namespaces.

Between dataplanes and the scheduler: ``Stack(dataplane_scheduler=proxy.address)``.
Between the scheduler and one engine (the dataplane still reaching it):
:func:`probe_through` points that endpoint's ``probe_url`` at the proxy.

While cut nothing passes in either direction and nothing is refused or reset: bytes
already sent wait, new connections are accepted and get nothing (as when packets are
dropped, not rejected). On heal what was held back flows on, as TCP delivers it after
a partition shorter than its retransmission timeout. The proxy runs its own event
loop in a thread, so synchronous code (a stack being started) can use it.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from pathlib import Path

import structlog
import yaml


log = structlog.get_logger(component="faultproxy")

HOST = "127.0.0.1"
CHUNK = 65536


class FaultProxy:
    """Listens on ``port`` (by default one the system chooses as it binds, known after
    :meth:`start`) and forwards to ``target_port``."""

    def __init__(self, target_port: int, port: int = 0, target_host: str = HOST) -> None:
        self.target = (target_host, target_port)
        self.port = port
        self._loop = asyncio.new_event_loop()
        self._open: asyncio.Event | None = None
        self._server: asyncio.base_events.Server | None = None
        self._thread = threading.Thread(target=self._loop.run_forever, name=f"faultproxy-{target_port}", daemon=True)
        self._pumps: set[asyncio.Task] = set()

    @property
    def address(self) -> str:
        return f"{HOST}:{self.port}"

    def start(self) -> FaultProxy:
        self._thread.start()
        asyncio.run_coroutine_threadsafe(self._serve(), self._loop).result(10)
        return self

    async def _serve(self) -> None:
        self._open = asyncio.Event()
        self._open.set()
        self._server = await asyncio.start_server(self._accepted, HOST, self.port)
        self.port = self._server.sockets[0].getsockname()[1]

    def cut(self) -> None:
        """From now on nothing passes (until :meth:`heal`)."""
        self._loop.call_soon_threadsafe(self._open.clear)
        log.info("link_cut", port=self.port, target=self.target[1])

    def heal(self) -> None:
        self._loop.call_soon_threadsafe(self._open.set)
        log.info("link_healed", port=self.port, target=self.target[1])

    async def _accepted(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await self._open.wait()  # cut: the peer is never reached
        try:
            upstream_reader, upstream_writer = await asyncio.open_connection(*self.target)
        except OSError:
            writer.close()
            return
        for source, sink in ((reader, upstream_writer), (upstream_reader, writer)):
            task = asyncio.create_task(self._pump(source, sink))
            self._pumps.add(task)
            task.add_done_callback(self._pumps.discard)

    async def _pump(self, source: asyncio.StreamReader, sink: asyncio.StreamWriter) -> None:
        try:
            while True:
                await self._open.wait()
                data = await source.read(CHUNK)
                await self._open.wait()  # read just before the cut: held back until the heal
                if not data:
                    break
                sink.write(data)
                await sink.drain()
        except (ConnectionError, OSError):
            pass
        finally:
            with contextlib.suppress(Exception):
                sink.close()

    def close(self) -> None:
        async def stop() -> None:
            if self._server is not None:
                self._server.close()
            for task in list(self._pumps):
                task.cancel()
            await asyncio.gather(*self._pumps, return_exceptions=True)

        with contextlib.suppress(Exception):
            asyncio.run_coroutine_threadsafe(stop(), self._loop).result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)


def probe_through(pool_file: Path, endpoint: str, proxy: FaultProxy) -> None:
    """Have the scheduler probe ``endpoint`` through ``proxy`` (its ``probe_url``) while
    turns still go straight to its ``base_url``; before the scheduler starts."""
    pool = yaml.safe_load(pool_file.read_text())
    [entry] = [e for e in pool["endpoints"] if e["name"] == endpoint]
    entry["probe_url"] = f"http://{proxy.address}"
    pool_file.write_text(yaml.safe_dump(pool, sort_keys=False))

"""The engines' own agent features, on the scheduler's side (luftpause/hints.py): which
each replica has, and the engine sessions of runs, closed when their runs end.

A replica's hints are its pool entry's, else what its engine's server info said on the
first healthy probe of each healthy spell. An SGLang engine with the session radix
cache keeps a session's KV ahead of unreferenced KV until ``POST /close_session``; the
dataplane names each interactive turn's session by its run, so this side remembers which
such replicas each interactive run's turns went to and, once the run has left the core's state (a
run-end notice, its harness session over, the idle timeout), closes the session on
each of them, a few at a time, in the background. A close that fails is logged and
not repeated: the engine still evicts an unclosed session's KV, only later.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping

import httpx
import structlog

from luftpause.hints import NO_HINTS, EngineHints
from luftpause.scheduler.core.state import State
from luftpause.scheduler.pool import Endpoint
from luftpause.scheduler.probes import auth_headers
from luftpause.vocabulary import BATCH

CLOSE_SESSION_PATH = "/close_session"
CLOSES_AT_ONCE = 8  # sessions closed side by side (a mass end of runs is not a burst on the engines)


class EngineSessions:
    """Each replica's hints, and the runs with a session open on replicas that keep them."""

    def __init__(self, endpoints: Mapping[str, Endpoint], log: structlog.typing.FilteringBoundLogger) -> None:
        self._endpoints = endpoints
        self._read: dict[str, EngineHints] = {}  # replica -> what its server info said
        self._open: dict[str, set[str]] = {}  # run id -> replicas keeping a session of it
        self._closing: asyncio.Queue[tuple[str, str]] | None = None
        self._workers: list[asyncio.Task] = []
        self.log = log

    def of(self, endpoint: Endpoint) -> EngineHints:
        """The replica's hints: its pool entry's, else what its engine said."""
        return endpoint.hints if endpoint.hints is not None else self._read.get(endpoint.name, NO_HINTS)

    def learned(self, endpoint: Endpoint, hints: EngineHints) -> None:
        """What the engine's server info said, on the first healthy probe of a spell."""
        if endpoint.hints is not None:
            return
        if hints != self._read.get(endpoint.name, NO_HINTS):
            self.log.info("engine_hints", replica=endpoint.name, **hints.as_fields(),
                          effect="its turns carry these fields" if hints else "its turns go unchanged")
        self._read[endpoint.name] = hints

    def placed(self, run_id: str, service_class: str, replica: str) -> None:
        """A turn of the run went to the replica: a session of it is open there if the
        replica keeps sessions and the run is interactive (batch turns name none:
        luftpause/hints.py)."""
        endpoint = self._endpoints.get(replica)
        if service_class != BATCH and endpoint is not None and self.of(endpoint).sessions:
            self._open.setdefault(run_id, set()).add(replica)

    def settle(self, state: State, client: httpx.AsyncClient | None) -> None:
        """Close the sessions of runs that are no longer in the state."""
        ended = [run_id for run_id in self._open if run_id not in state.runs]
        if not ended or client is None:
            return
        queue = self._queue(client)
        for run_id in ended:
            for replica in sorted(self._open.pop(run_id)):
                queue.put_nowait((run_id, replica))

    def _queue(self, client: httpx.AsyncClient) -> asyncio.Queue[tuple[str, str]]:
        if self._closing is None:
            self._closing = asyncio.Queue()
            self._workers = [asyncio.get_running_loop().create_task(self._close_forever(client))
                             for _ in range(CLOSES_AT_ONCE)]
        return self._closing

    async def _close_forever(self, client: httpx.AsyncClient) -> None:
        assert self._closing is not None
        while True:
            run_id, replica = await self._closing.get()
            await self.close(client, self._endpoints[replica], run_id)

    async def close(self, client: httpx.AsyncClient, endpoint: Endpoint, run_id: str) -> None:
        """``POST /close_session`` for the run on the replica (a refusal is logged)."""
        try:
            response = await client.post(endpoint.base_url + CLOSE_SESSION_PATH, json={"session_id": run_id},
                                         headers=auth_headers(endpoint))
        except httpx.HTTPError as exc:
            self.log.warning("engine_session_unclosed", replica=endpoint.name, run=run_id, problem=repr(exc),
                             effect="the engine evicts its KV later, as unreferenced")
            return
        if response.status_code != 200:
            self.log.warning("engine_session_unclosed", replica=endpoint.name, run=run_id,
                             status=response.status_code, effect="the engine evicts its KV later, as unreferenced")
            return
        self.log.debug("engine_session_closed", replica=endpoint.name, run=run_id)

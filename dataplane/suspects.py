"""Requests that took a replica down, remembered briefly, so that a query of death
reaches at most two replicas.

A turn whose engine stalled on it (no first byte within its bound) or dropped the
connection after the request reached it may have been brought down *by* that request:
some inputs crash or wedge an engine, and every copy of the engine alike. Sending such a
turn again elsewhere, as :func:`~luftpause.dataplane.turn.run_turn` does for a failed
engine, would take the replicas down one after another, and with them every other turn
of the pool. So such a failure is remembered by the request's fingerprint (its model and
the body sent to the engine) for ``SUSPECT_MEMORY_S``:

* a turn is sent at most once more after such a failure, and such re-sends go one at a
  time per replica they failed on (:meth:`Suspects.lane`), each until its first byte:
  a wedge takes down every turn on its replica that had no byte yet, the culprit and its
  victims alike, and all of them are re-sent at about the same moment; sent together
  they would meet the culprit again on the next replica it wedges, and be refused with
  it. One at a time, the culprit wedges that replica alone and is refused there, and
  the rest go where the pool is still in rotation. The streams the wedge stalled after
  bytes reached their clients are continued elsewhere (dataplane/continuation.py) at
  that moment too: such continuations go side by side, but never beside a re-send from
  the same replica, each until its first byte (:class:`Lane`), so the culprit's re-send
  does not wedge a replica a continuation has just gone to;
* a request that failed so on ``SUSPECT_REPLICAS`` replicas is not sent again while it
  is remembered: it is answered at once with a 502 that says so (marked
  ``x-luftpause-engine-failure: repeated``, which clients must not retry);
* and that answer comes within two first-byte bounds of the send that failed: its
  re-send waits for its first byte only what is left of them (:func:`resend_due`), not
  a whole bound of its own after its admission and connection. Time it waited for a slot
  or behind other re-sends in its lane is the pool's queue, not an engine's, and is not
  counted: a victim of a wedge re-sent behind the culprit keeps about its whole bound.

A connection refused (the engine was down before the request came) says nothing about
the request and is not counted. Memory is bounded: the oldest entries go first.
"""

from __future__ import annotations

import asyncio
import hashlib
import time
from collections import OrderedDict
from collections.abc import Callable

from luftpause.dataplane.constants import SUSPECT_MEMORY_ENTRIES, SUSPECT_MEMORY_S, SUSPECT_REPLICAS

# Of a re-sent suspect's two first-byte bounds, the seconds kept for its 502's way out (the
# stall noticed, the answer written and sent: about 5 ms on an idle host, more on a busy
# one), so that the client has it within them.
SUSPECT_ANSWER_S = 0.05


def fingerprint(model: str, body: bytes) -> bytes:
    """The request as an engine sees it: its model and the exact body sent."""
    digest = hashlib.blake2b(model.encode(), digest_size=16)
    digest.update(b"\0")
    digest.update(body)
    return digest.digest()


def resend_due(sent: float, bound: float, queued: float) -> float:
    """By when a re-sent suspect's first byte must come: ``SUSPECT_REPLICAS`` first-byte
    bounds (``bound``: the failed send's) from when that send began (``sent``), later by
    the seconds it has been ``queued`` since (held for a slot, behind other re-sends: no
    engine's time), less SUSPECT_ANSWER_S for the answer's way out."""
    return sent + queued + SUSPECT_REPLICAS * bound - SUSPECT_ANSWER_S


class Suspects:
    """Fingerprints of requests that stalled or dropped a replica, and where."""

    def __init__(self, memory_s: float = SUSPECT_MEMORY_S, entries: int = SUSPECT_MEMORY_ENTRIES,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.memory_s, self.entries, self.clock = memory_s, entries, clock
        self._seen: OrderedDict[bytes, tuple[float, frozenset[str]]] = OrderedDict()
        self._lanes: dict[str, Lane] = {}  # one per replica of the pool: a few

    def __bool__(self) -> bool:
        return bool(self._seen)

    def replicas(self, key: bytes) -> frozenset[str]:
        """The replicas the request took down within the memory, none if not remembered."""
        entry = self._seen.get(key)
        if entry is None:
            return frozenset()
        if self.clock() - entry[0] >= self.memory_s:
            del self._seen[key]
            return frozenset()
        return entry[1]

    def refused(self, key: bytes) -> bool:
        """Whether the request is not to be sent again."""
        return len(self.replicas(key)) >= SUSPECT_REPLICAS

    def failed_on(self, key: bytes, replica: str) -> frozenset[str]:
        """Count a stall or drop of ``replica`` on the request; the replicas so far."""
        replicas = self.replicas(key) | {replica}
        self._seen[key] = (self.clock(), replicas)
        self._seen.move_to_end(key)
        while len(self._seen) > self.entries:
            self._seen.popitem(last=False)
        return replicas

    def lane(self, replica: str) -> Lane:
        """The turns sent again from ``replica`` after it failed them (:class:`Lane`)."""
        lane = self._lanes.get(replica)
        if lane is None:
            lane = self._lanes[replica] = Lane()
        return lane


class Lane:
    """The turns sent again from one replica that failed them, each holding its place
    until its first byte (or its end), in the order they came: a turn re-sent after a
    stall or drop there goes alone (:meth:`resend`); continuations of streams that
    stalled there go side by side (:meth:`continuation`), but not beside a re-send.
    Each returns the call that gives its place up."""

    def __init__(self) -> None:
        self._order = asyncio.Lock()  # held by a re-send; a continuation passes it to take its place
        self._continuing = 0  # continuations before their first byte
        self._clear = asyncio.Event()  # none is
        self._clear.set()

    async def resend(self) -> Callable[[], None]:
        """Wait until the re-sends and continuations before it have their first byte."""
        await self._order.acquire()
        try:
            await self._clear.wait()
        except BaseException:
            self._order.release()
            raise
        return self._order.release

    async def continuation(self) -> Callable[[], None]:
        """Wait until the re-sends before it have their first byte."""
        async with self._order:
            self._continuing += 1
            self._clear.clear()
        return self._continued

    def _continued(self) -> None:
        self._continuing -= 1
        if not self._continuing:
            self._clear.set()

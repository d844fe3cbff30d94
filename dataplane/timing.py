"""How long a turn may wait for its engine: a bound on the first byte (and on any pause
of a stream) derived from what the engine is doing, and the watchdog that enforces it.

A wedged engine accepts the request and never answers while its health route says ok;
an engine that stalls mid-stream keeps the connection open and sends nothing more.
Neither is an error a socket reports, so the dataplane bounds the wait.

The bound is not one fixed number. Per replica (and per reply kind: a stream's first
byte is its first token, a non-streamed reply's is the whole reply) the dataplane
keeps the seconds per token its recent first bytes took, counting the tokens the
engine had to prefill first: the turn's own prompt and the prompts of this dataplane's
turns that were still waiting there when it was sent, plus a fixed overhead. The bound
of a new turn is FIRST_BYTE_MARGIN times the slowest of those recent rates applied to
its own pending tokens (while the turn's kind has fewer than FIRST_BYTE_OWN_RATES rates
there, the other kind's slowest counts too where slower: one quick first byte may be a
cached prefix), never below FIRST_BYTE_MIN_S, and never below what prefilling
its prompt uncached would take at FIRST_BYTE_FLOOR_S_PER_TOKEN (a cached prefix makes
a long prompt quick; the same prompt uncached must not look like a stall). A replica
with no history borrows its peers' (the pool's); with none anywhere the cold rate
applies. The bound is recomputed while a turn waits, so the first answers anywhere
tighten the bound of turns sent before them.

A non-streamed reply's first byte comes once the whole reply is generated, so its
pending work counts the reply too: its ``max_tokens`` (or ``max_completion_tokens``),
REPLY_TOKENS_WITHOUT_MAX when it names none, each reply token weighing
FIRST_BYTE_REPLY_WEIGHT prompt tokens; and a reply with a stated ``max_tokens`` is not cut
off before FIRST_BYTE_REPLY_FLOOR_S_PER_TOKEN per token. Counting only prompts, a long
reply after short ones (or a request an engine defers until a running generation ends)
looked like a wedged engine.

A stream that pauses longer than its (recomputed) bound while the dataplane waits on
the engine is stalled too; time spent writing to a slow client does not count.

A turn's pending tokens, as its bound is recomputed, are at least the prompts of this
dataplane's turns waiting there now, those sent after it too: an engine prefills the
prompts waiting together (a prefill batch; llama.cpp's slots in one pass), so a turn's
first token may come with those of turns sent after it, and an answered stream pauses
while the engine prefills new prompts (llama.cpp and SGLang run a prefill batch before
the next decode step).

A turn may be *due by* a moment (:meth:`FirstByteBounds.due_by`): a request re-sent after
it stalled or dropped a replica (dataplane/suspects.py) is to get its answer within two
first-byte bounds in all, so its first byte is awaited only until then, if that is
sooner than its own bound, but never less than DUE_LEAST_SHARE of its own bound: a
healthy replica answers well within that (the bound is FIRST_BYTE_MARGIN times what the
rates predict), so one is not reported stalled because the re-send came late to it.
Pauses of its stream after the first byte have the usual bound.

Every turn on a wedged engine waits out its bound, and more turns reach it meanwhile.
So, well before the bound, a turn still waiting for its first byte is reported *silent*
once its replica has sent nothing at all (no byte to any of this dataplane's turns
there) for SILENT_BOUND_SHARE of the turn's bound as derived before its least value
(FIRST_BYTE_MIN_S): what the recent rates predict, the bound being FIRST_BYTE_MARGIN
times that; at least SILENT_MIN_S, counted from when the
turn was sent or the replica's last byte, whichever is later. The scheduler then places
nothing new there until a byte comes from it (scheduler/core/stalls.py), and this
dataplane uses no slot it was lent there; nothing is re-sent on it.
"""

from __future__ import annotations

import asyncio
import re
from collections import deque
from collections.abc import Callable

from luftpause.dataplane.constants import (
    BYTES_PER_TOKEN,
    FIRST_BYTE_COLD_S_PER_TOKEN,
    FIRST_BYTE_FLOOR_S_PER_TOKEN,
    FIRST_BYTE_HISTORY,
    FIRST_BYTE_MARGIN,
    FIRST_BYTE_MIN_S,
    FIRST_BYTE_OVERHEAD_TOKENS,
    FIRST_BYTE_OWN_RATES,
    FIRST_BYTE_RECHECK_S,
    FIRST_BYTE_REPLY_FLOOR_S_PER_TOKEN,
    FIRST_BYTE_REPLY_WEIGHT,
    REPLY_TOKENS_WITHOUT_MAX,
    SILENT_BOUND_SHARE,
    SILENT_MIN_S,
)

_MAX_TOKENS = re.compile(rb'"max_(?:completion_)?tokens"\s*:\s*(\d+)')
# A turn due by a moment (FirstByteBounds.due_by) waits for its first byte until then, but
# never less than this share of its own bound.
DUE_LEAST_SHARE = 0.5


def prompt_tokens(body: bytes) -> int:
    """A turn's prompt in tokens, estimated from its request body's size."""
    return len(body) // BYTES_PER_TOKEN


def reply_tokens(body: bytes) -> tuple[int, bool]:
    """The most tokens a turn's reply may take (its max_tokens, else a typical reply), and
    whether the request stated it."""
    found = _MAX_TOKENS.search(body)
    return (int(found.group(1)), True) if found else (REPLY_TOKENS_WITHOUT_MAX, False)


class Watch:
    """One turn's wait on its engine."""

    __slots__ = ("replica", "stream", "tokens", "work", "pending", "started", "waiting", "answered", "stalled",
                 "bound", "floor", "silent", "due")

    def __init__(self, replica: str, stream: bool, tokens: int, ahead: int, started: float, reply: int = 0,
                 stated: bool = False) -> None:
        self.replica, self.stream, self.tokens = replica, stream, tokens
        # what the engine does before this turn's first byte: a whole reply's decode steps too
        self.work = tokens + FIRST_BYTE_REPLY_WEIGHT * reply
        self.floor = reply * FIRST_BYTE_REPLY_FLOOR_S_PER_TOKEN if stated else 0.0
        self.pending = self.work + ahead  # and the work of this dataplane's turns waiting there before it
        self.started = started
        self.waiting: float | None = started  # since when the dataplane waits on the engine; None: it does not
        self.answered = False  # the first byte came
        self.stalled = False  # the watchdog gave up on it
        self.bound = 0.0  # the bound it was last held to, seconds
        self.silent: float | None = None  # when it was reported silent (its replica sent nothing), if it was
        self.due: float | None = None  # its first byte is awaited until then at most (FirstByteBounds.due_by)


class FirstByteBounds:
    """Per replica: recent seconds per pending token to the first byte, and the prompt
    tokens of this dataplane's turns still waiting there for theirs."""

    def __init__(self) -> None:
        self._rates: dict[tuple[str, bool], deque[float]] = {}
        self._pooled: dict[bool, deque[float]] = {}
        self._waiting: dict[str, int] = {}
        self._heard: dict[str, float] = {}  # when a byte last came from each replica
        self._silent: dict[str, Watch] = {}  # the replica's last turn reported silent

    def start(self, replica: str, stream: bool, tokens: int, now: float, reply: int = 0,
              stated: bool = False) -> Watch:
        """A turn's wait; ``reply``: the reply tokens a non-streamed turn's first byte waits
        for (``stated``: the request's own max_tokens)."""
        ahead = self._waiting.get(replica, 0)
        watch = Watch(replica, stream, tokens, ahead, now, 0 if stream else reply, stated and not stream)
        self._waiting[replica] = ahead + watch.work
        watch.bound = self.bound(watch)
        return watch

    def bound(self, watch: Watch) -> float:
        """Seconds the turn may wait for its first byte (or in a pause of its stream)."""
        bound = max(FIRST_BYTE_MIN_S, self._derived(watch))
        if watch.due is not None and not watch.answered:
            return min(bound, max(watch.due - watch.started, DUE_LEAST_SHARE * bound))
        return bound

    def due_by(self, watch: Watch, due: float) -> None:
        """The turn's first byte is awaited until ``due`` (the loop's clock) if that is sooner
        than its bound, though never less than DUE_LEAST_SHARE of its bound."""
        watch.due = due
        watch.bound = self.bound(watch)

    def _derived(self, watch: Watch) -> float:
        """The bound as derived from the rates and floors, before its least value."""
        rate = self._rate(watch)
        # The engine prefills the prompts waiting there together (a prefill batch, llama.cpp's
        # slots in one pass), those sent after this turn too, and pauses its streams meanwhile.
        waiting = self._waiting.get(watch.replica, 0)
        pending = max(watch.pending, waiting if not watch.answered else watch.work + waiting)
        expected = FIRST_BYTE_MARGIN * rate * (pending + FIRST_BYTE_OVERHEAD_TOKENS)
        return max(expected, watch.tokens * FIRST_BYTE_FLOOR_S_PER_TOKEN, watch.floor)

    def _rate(self, watch: Watch) -> float:
        """The slowest recent rate of the replica's own for the turn's kind; a replica with
        none takes the pool's for that kind, the cold rate with none there. While the
        replica has fewer than FIRST_BYTE_OWN_RATES of its own for the kind, its other
        kind's slowest counts too if slower: it only ever loosens the bound (a whole
        reply's rate, its reply weighed in, may be quicker per token than a stream's)."""
        own = self._rates.get((watch.replica, watch.stream))
        rates = own or self._pooled.get(watch.stream)
        rate = max(rates) if rates else FIRST_BYTE_COLD_S_PER_TOKEN
        other = self._rates.get((watch.replica, not watch.stream))
        if other and len(own or ()) < FIRST_BYTE_OWN_RATES:
            rate = max(rate, max(other))
        return rate

    def heard(self, replica: str, now: float) -> None:
        """A byte came from the replica."""
        self._heard[replica] = now

    def quiet_since(self, watch: Watch) -> float:
        """Since when the turn's replica has sent nothing: the turn's start or its last byte."""
        return max(watch.started, self._heard.get(watch.replica, watch.started))

    def silent_after(self, watch: Watch) -> float:
        """How long the turn's replica may send nothing before the turn is silent: a share
        of its bound as derived (what the recent rates predict), not of the bound's least value."""
        return max(SILENT_MIN_S, SILENT_BOUND_SHARE * self._derived(watch))

    def silenced(self, watch: Watch, now: float) -> None:
        """The turn was reported silent."""
        watch.silent = now
        self._silent[watch.replica] = watch

    def is_silent(self, replica: str) -> bool:
        """Whether a turn on the replica was reported silent, is still waiting, and nothing
        came from the replica since."""
        watch = self._silent.get(replica)
        if watch is None or watch.answered or self._heard.get(replica, watch.started) > watch.silent:
            if watch is not None:
                del self._silent[replica]
            return False
        return True

    def first_byte(self, watch: Watch, now: float) -> None:
        """The turn's first byte came: learn from how long it took."""
        if watch.answered:
            return
        self._done_waiting(watch)
        watch.answered = True
        self._heard[watch.replica] = now
        rate = max(0.0, now - watch.started) / (watch.pending + FIRST_BYTE_OVERHEAD_TOKENS)
        for key, table in (((watch.replica, watch.stream), self._rates), (watch.stream, self._pooled)):
            history = table.get(key)
            if history is None:
                history = table[key] = deque(maxlen=FIRST_BYTE_HISTORY)
            history.append(rate)

    def ended(self, watch: Watch) -> None:
        """The turn's wait is over, answered or not."""
        if not watch.answered:
            self._done_waiting(watch)
            watch.answered = True  # counted once

    def _done_waiting(self, watch: Watch) -> None:
        left = self._waiting.get(watch.replica, 0) - watch.work
        if left > 0:
            self._waiting[watch.replica] = left
        else:
            self._waiting.pop(watch.replica, None)


class Watchdog:
    """Ends the wait of a turn whose engine overran its bound: expires the timeout the
    turn's engine I/O runs under (:meth:`guard`), so the awaiting code sees a
    TimeoutError and finds ``watch.stalled`` set. Checks only when a bound could have
    passed (and every FIRST_BYTE_RECHECK_S until the first byte, as the bound may
    tighten): one timer per turn, not one per chunk."""

    __slots__ = ("_loop", "_bounds", "_watch", "_timeout", "_handle", "_on_silent")

    def __init__(self, bounds: FirstByteBounds, watch: Watch, on_silent: Callable[[], None] | None = None,
                 loop: asyncio.AbstractEventLoop | None = None) -> None:
        # ``loop``: whose clock and timers it runs on (the running loop's; a test's own clock)
        self._loop = loop or asyncio.get_running_loop()
        self._bounds, self._watch = bounds, watch
        self._on_silent = on_silent  # called once if the turn goes silent (its replica sends nothing)
        self._timeout: asyncio.Timeout | None = None
        first = min(watch.bound, FIRST_BYTE_RECHECK_S)
        if on_silent is not None:
            first = min(first, bounds.silent_after(watch))
        self._handle = self._loop.call_at(watch.started + first, self._check)

    def guard(self) -> asyncio.Timeout:
        """The timeout (``async with``) the engine I/O runs under; the watchdog expires it."""
        self._timeout = asyncio.timeout(None)
        return self._timeout

    def _check(self) -> None:
        watch, now = self._watch, self._loop.time()
        watch.bound = self._bounds.bound(watch)
        since = watch.waiting
        if since is not None and now - since >= watch.bound and self._timeout is not None:
            try:
                self._timeout.reschedule(now)
            except RuntimeError:  # its block was left meanwhile: nothing waits on the engine
                pass
            else:
                watch.stalled = True
                return
        due = (since if since is not None else now) + watch.bound
        if not watch.answered:  # the first answers anywhere may tighten its bound: look again soon
            due = min(due, now + FIRST_BYTE_RECHECK_S)
            if watch.silent is None and self._on_silent is not None:
                silent_at = self._bounds.quiet_since(watch) + self._bounds.silent_after(watch)
                if now >= silent_at - 0.001:  # (a timer may fire a hair early)
                    self._bounds.silenced(watch, now)
                    self._on_silent()
                else:
                    due = min(due, silent_at)
        self._handle = self._loop.call_at(due, self._check)

    def cancel(self) -> None:
        """Stop watching, and let go of the turn (``on_silent``) and the task it guarded:
        a turn keeps its watchdog, which would keep the turn in a reference cycle."""
        self._handle.cancel()
        self._on_silent = self._timeout = None

"""The fake engine's time on a clock the test moves on: in-process engines (``create_app(config,
Gpu(scale, clock))``) whose passes take model time, not the machine's, so a test can time
them exactly and hold a busy engine still while it looks at it."""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

from luftpause.dev.procs import eventually
from luftpause.fakes.engine_state import Simulator


class FakeClock:
    """The engine's clock (the three methods of ``engine_state.Clock``): time stands still
    until the test moves it on. ``sleep`` is a pass on a GPU; ``wait`` an idle engine
    waiting for work at most so long."""

    def __init__(self) -> None:
        self.now = 0.0
        self._timers: list[tuple[float, int, asyncio.Future[None], bool]] = []  # (due, order, fires, a pass)
        self._order = itertools.count()

    def time(self) -> float:
        return self.now

    def _timer(self, seconds: float, is_pass: bool) -> asyncio.Future[None]:
        fires = asyncio.get_running_loop().create_future()
        self._timers.append((self.now + seconds, next(self._order), fires, is_pass))
        return fires

    async def sleep(self, seconds: float) -> None:
        await self._timer(seconds, True)

    async def wait(self, event: asyncio.Event, seconds: float) -> bool:
        fires = self._timer(seconds, False)
        woken = asyncio.ensure_future(event.wait())
        try:
            await asyncio.wait((fires, woken), return_when=asyncio.FIRST_COMPLETED)
        finally:
            fires.cancel()
            woken.cancel()
        return event.is_set()

    @property
    def passes(self) -> int:
        """Passes under way on the GPUs on this clock."""
        return sum(1 for _, _, fires, is_pass in self._timers if is_pass and not fires.done())

    def advance(self, seconds: float) -> None:
        """Time moves on by ``seconds``; what was due by then fires."""
        self._fire(self.now + seconds)

    def next_pass(self) -> None:
        """Time moves on to the end of the next pass under way."""
        self._fire(min(due for due, _, fires, is_pass in self._timers if is_pass and not fires.done()))

    def _fire(self, until: float) -> None:
        self.now = max(self.now, until)
        for due, _, fires, _ in sorted(self._timers, key=lambda t: t[:2]):
            if due <= self.now and not fires.done():
                fires.set_result(None)
        self._timers = [t for t in self._timers if not t[2].done()]


async def passing(clock: FakeClock, work: Awaitable[Any]) -> Any:
    """``work`` on a lone GPU on ``clock``, the clock moved on from pass to pass until it is done."""
    task = asyncio.ensure_future(work)
    while not task.done():
        await eventually(lambda: task.done() or clock.passes, what="a pass under way or the work done")
        if not task.done():
            clock.next_pass()
    return task.result()


def in_engine(sim: Simulator) -> int:
    """Requests the replica has taken into its model so far (queued, running or done)."""
    model = sim.model
    return (len(model.waiting) + len(model.running) + (model.chunked is not None) + model.counters.finished
            + model.counters.aborted)


class Requests:
    """Requests sent to in-process replicas on one :class:`FakeClock`, and the clock moved on
    for them pass by pass (:meth:`until`).

    Time moves on only when nothing else can happen first: every request sent is in its
    replica's model, every replica with work is in a pass or waits for its (shared) GPU,
    and every request a replica finished has its answer back. So requests sent together
    are all in the engine at the same time, and an answer is timed at the end of its last
    pass (:attr:`answered`)."""

    def __init__(self, clock: FakeClock) -> None:
        self.clock = clock
        self.sent: list[tuple[Simulator, asyncio.Task[Any]]] = []
        self.answered: dict[asyncio.Task[Any], float] = {}

    def send(self, sim: Simulator, call: Awaitable[Any]) -> asyncio.Task[Any]:
        task = asyncio.ensure_future(call)
        self.sent.append((sim, task))
        return task

    def _settled(self) -> bool:
        for _, task in self.sent:
            if task.done():
                self.answered.setdefault(task, self.clock.now)
        sims = list({id(sim): sim for sim, _ in self.sent}.values())
        for sim in sims:
            tasks = [task for s, task in self.sent if s is sim]
            if in_engine(sim) < len(tasks) and not all(task.done() for task in tasks):
                return False  # a request not in the engine yet
            if sim.model.counters.finished > sum(task.done() for task in tasks):
                return False  # an answer on its way
        return self.clock.passes == len({id(sim.gpu) for sim in sims if sim.model.busy})

    @property
    def done(self) -> bool:
        return all(task.done() for _, task in self.sent)

    async def until(self, condition: Callable[[], bool] | None = None) -> None:
        """Move the clock on until ``condition`` holds at a settled point (held there, the
        clock standing still, until the next call), or every request is answered."""
        while True:
            await eventually(self._settled, what="every busy replica in a pass and every finished request answered")
            if self.done or (condition is not None and condition()):
                return
            self.clock.next_pass()

    async def results(self) -> list[Any]:
        """Every request answered (the clock moved on as needed); their results, in order sent."""
        await self.until()
        return [task.result() for _, task in self.sent]

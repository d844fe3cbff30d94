"""The dev stack's supervisor: a child process that dies is started again, after a
delay that doubles on each quick death (1 s up to 30 s), and every step is logged."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable

from luftpause.dev.procs import ManagedProcess

FIRST_DELAY_S = 1.0
MAX_DELAY_S = 30.0
STABLE_S = 60.0  # a child that ran this long starts again from the first delay


class Supervisor:
    def __init__(self, processes: Callable[[], Iterable[ManagedProcess]], log,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._processes = processes
        self._log = log
        self._clock = clock
        self._delay: dict[str, float] = {}
        self._started_at: dict[str, float] = {}
        self._due: dict[str, float] = {}  # name -> when to start it again

    def check(self) -> None:
        """Notice dead children and start those whose delay has passed (non-blocking)."""
        now = self._clock()
        for process in self._processes():
            if process.process is None:
                continue
            name = process.name
            if name in self._due:
                if now >= self._due[name]:
                    del self._due[name]
                    self._log.info("process_restarting", process=name)
                    process.start()
                    self._started_at[name] = now
                continue
            code = process.process.poll()
            if code is None:
                continue
            ran = now - self._started_at.get(name, now)
            delay = FIRST_DELAY_S if ran >= STABLE_S else self._delay.get(name, FIRST_DELAY_S / 2) * 2
            delay = min(delay, MAX_DELAY_S)
            self._delay[name] = delay
            self._due[name] = now + delay
            self._log.warning("process_exited", process=name, exit_code=code, restart_in_s=delay,
                              log=str(process.log_path) if process.log_path else None)

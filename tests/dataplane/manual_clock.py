"""A loop's clock and timers for the dataplane's watchdog tests, where time passes only
when the test moves it (the durations are the point, not the wall's)."""

from __future__ import annotations


class Timer:
    def __init__(self, when: float, callback) -> None:
        self.when, self.callback, self.cancelled = when, callback, False

    def cancel(self) -> None:
        self.cancelled = True


class ManualClock:
    """A loop's clock and timers as the watchdog uses them (``time``, ``call_at``), where
    time passes only when the test moves it: due timers run in order on the way."""

    def __init__(self) -> None:
        self.now = 0.0
        self._timers: list[Timer] = []

    def time(self) -> float:
        return self.now

    def call_at(self, when: float, callback) -> Timer:
        timer = Timer(when, callback)
        self._timers.append(timer)
        return timer

    def move_to(self, until: float) -> None:
        while due := [t for t in self._timers if t.when <= until]:
            timer = min(due, key=lambda t: t.when)
            self._timers.remove(timer)
            self.now = max(self.now, timer.when)
            if not timer.cancelled:
                timer.callback()
        self.now = until

"""Budgets: limits a run sets on its whole subtree, children spawned later included.

A run with any of spawn's ``budgetTokens``, ``budgetToolCalls``, ``budgetSeconds`` owns a
budget. Every turn and tool-call round anywhere below it is checked against it (and
against every other budget above it); the seconds limit also has a timer, so it fires
while the subtree idles on a slow tool or a queued turn. On excess the owner's whole
subtree is cancelled with ``budget exceeded: <kind> <used>/<limit>``.

What counts:
- tokens: prompt + completion tokens of every turn in the subtree; a turn is checked
  after it returns (its cost is only known then), so the limit is exceeded, not met;
- tool calls: calls counted before they run, so a round that would go over the limit
  is refused without reaching the tool server;
- seconds: wall clock since the owner was created (across restarts), while anything in
  the subtree is unfinished, less the time every unfinished run of the subtree was
  waiting for a human to approve a tool call (that wait is paused, timer included).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any

import structlog

from luftpause.runtime.runs import BudgetExcess, BudgetKind, Run, RunRegistry, RunStatus
from luftpause.runtime.errors import RuntimeServiceError

log = structlog.get_logger(component="budgets")

ExcessHandler = Callable[[Run, BudgetExcess], None]


class BudgetExceeded(RuntimeServiceError):
    """Raised in the run whose own step went over a budget; its subtree is being cancelled."""

    def __init__(self, owner: Run, excess: BudgetExcess) -> None:
        self.owner, self.excess = owner, excess
        super().__init__(excess.message)


class Budgets:
    def __init__(self, runs: RunRegistry, on_exceeded: ExcessHandler, clock: Callable[[], float] = time.time) -> None:
        self._runs = runs
        self._on_exceeded = on_exceeded
        self._clock = clock
        self._timers: dict[str, asyncio.TimerHandle] = {}

    # --- whose budgets apply -------------------------------------------------------

    def owners(self, run: Run) -> list[Run]:
        """``run`` and its ancestors that own a budget, nearest first."""
        owners, current = [], run
        seen: set[str] = set()
        while current is not None and current.handle not in seen:
            seen.add(current.handle)
            if current.has_budget:
                owners.append(current)
            current = self._runs.get(current.parent) if current.parent in self._runs else None
        return owners

    def used(self, owner: Run) -> dict[str, float]:
        subtree = self._runs.subtree(owner.handle)
        tokens = sum(r.stats.prompt_tokens + r.stats.completion_tokens for r in subtree)
        tool_calls = sum(r.stats.tool_calls + r.tool_calls_in_flight for r in subtree)
        return {
            BudgetKind.TOKENS.value: tokens,
            BudgetKind.TOOL_CALLS.value: tool_calls,
            BudgetKind.SECONDS.value: round(self._seconds_used(owner, subtree), 3),
        }

    def _seconds_used(self, owner: Run, subtree: list[Run]) -> float:
        if any(not r.status.finished for r in subtree):
            end = self._clock()
        else:
            end = max((r.finished_at or owner.created_at) for r in subtree)
        return max(0.0, end - owner.created_at - self._paused(owner, end))

    def _paused(self, owner: Run, now: float) -> float:
        """Seconds ``owner``'s clock stood still: its subtree was all waiting for a human."""
        since = owner.budget_paused_since
        return owner.budget_paused_s + (max(0.0, now - since) if since is not None else 0.0)

    def _elapsed(self, owner: Run) -> float:
        now = self._clock()
        return now - owner.created_at - self._paused(owner, now)

    # --- waiting for a human ---------------------------------------------------------

    def waiting_changed(self, run: Run, *, driven: bool = True) -> None:
        """``run`` started or stopped waiting for approval, finished, or was spawned:
        pause or resume the seconds of every budget above it. ``driven=False``: a run
        another runtime drives, followed here: its seconds are counted as the driver counts
        them (what `status` shows), and no timer is touched (the driver's fires)."""
        for owner in self.owners(run):
            if owner.spec.budget_seconds is None:
                continue
            live = [r for r in self._runs.subtree(owner.handle) if not r.status.finished]
            paused = bool(live) and all(r.status is RunStatus.AWAITING_APPROVAL for r in live)
            if paused and owner.budget_paused_since is None:
                owner.budget_paused_since = self._clock()
                if driven:
                    self.disarm(owner)
            elif not paused and owner.budget_paused_since is not None:
                owner.budget_paused_s = self._paused(owner, self._clock())
                owner.budget_paused_since = None
                if driven:
                    self.arm(owner)

    def paused_record(self, run: Run) -> dict[str, Any]:
        """The paused seconds of the budgets above ``run``, for the journal (survive a restart)."""
        now = self._clock()
        paused = {o.handle: round(self._paused(o, now), 3) for o in self.owners(run) if o.spec.budget_seconds}
        return {"budgetPaused": paused} if paused else {}

    # --- checks ----------------------------------------------------------------------

    def check(self, run: Run, planned_tool_calls: int = 0) -> None:
        """Raise BudgetExceeded if ``run`` (about to make ``planned_tool_calls``) is over a budget.

        The first excess found cancels the owner's subtree through the handler; later
        checks in that subtree raise with the same excess.
        """
        for owner in self.owners(run):
            excess = owner.budget_excess or self._excess(owner, planned_tool_calls)
            if excess is not None:
                self._exceed(owner, excess)
                raise BudgetExceeded(owner, excess)

    def _excess(self, owner: Run, planned_tool_calls: int) -> BudgetExcess | None:
        limits = owner.spec.budget_limits()
        used = self.used(owner)
        if BudgetKind.SECONDS in limits and owner.budget_paused_since is None:
            elapsed = self._elapsed(owner)
            if elapsed > limits[BudgetKind.SECONDS]:
                return BudgetExcess(BudgetKind.SECONDS, elapsed, limits[BudgetKind.SECONDS])
        if BudgetKind.TOKENS in limits and used[BudgetKind.TOKENS] > limits[BudgetKind.TOKENS]:
            return BudgetExcess(BudgetKind.TOKENS, used[BudgetKind.TOKENS], limits[BudgetKind.TOKENS])
        if BudgetKind.TOOL_CALLS in limits:
            wanted = used[BudgetKind.TOOL_CALLS] + planned_tool_calls
            if wanted > limits[BudgetKind.TOOL_CALLS]:
                return BudgetExcess(BudgetKind.TOOL_CALLS, wanted, limits[BudgetKind.TOOL_CALLS])
        return None

    def _exceed(self, owner: Run, excess: BudgetExcess) -> None:
        if owner.budget_excess is not None and owner.budget_excess is not excess:
            return  # already handled
        first = owner.budget_excess is None
        owner.budget_excess = excess
        self.disarm(owner)
        if first:
            log.warning("budget_exceeded", owner=owner.handle, kind=excess.kind, used=excess.used, limit=excess.limit)
            self._on_exceeded(owner, excess)

    def spawn_refusal(self, parent: Run) -> str | None:
        """Why a child may not be spawned under ``parent`` (a budget above it is spent), or None."""
        for owner in self.owners(parent):
            if owner.budget_excess is not None:
                return f"cannot spawn under {parent.handle}: {owner.budget_excess.message} (budget of {owner.handle})"
            seconds = owner.spec.budget_seconds
            if seconds is not None and self._elapsed(owner) > seconds:
                excess = BudgetExcess(BudgetKind.SECONDS, self._elapsed(owner), seconds)
                return f"cannot spawn under {parent.handle}: {excess.message} (budget of {owner.handle})"
        return None

    # --- the seconds timer -----------------------------------------------------------

    def arm(self, owner: Run) -> None:
        """Start the seconds timer of ``owner``'s budget, if it has one and it is not spent."""
        seconds = owner.spec.budget_seconds
        if seconds is None or owner.budget_excess is not None or owner.handle in self._timers:
            return
        if owner.budget_paused_since is not None:
            return  # re-armed when the wait for a human ends
        delay = max(0.0, seconds - self._elapsed(owner))
        self._timers[owner.handle] = asyncio.get_running_loop().call_later(delay, self._deadline, owner)

    def disarm(self, owner: Run) -> None:
        timer = self._timers.pop(owner.handle, None)
        if timer is not None:
            timer.cancel()

    def close(self) -> None:
        for timer in self._timers.values():
            timer.cancel()
        self._timers.clear()

    def _deadline(self, owner: Run) -> None:
        self._timers.pop(owner.handle, None)
        if owner.budget_excess is not None:
            return
        if all(run.status.finished for run in self._runs.subtree(owner.handle)):
            return  # nothing to stop; a later spawn under it is refused (spawn_refusal)
        seconds = owner.spec.budget_seconds or 0.0
        elapsed = self._elapsed(owner)
        if elapsed < seconds:  # paused meanwhile: the rest of the budget is still there
            self.arm(owner)
            return
        self._exceed(owner, BudgetExcess(BudgetKind.SECONDS, elapsed, seconds))

    # --- reporting -------------------------------------------------------------------

    def report(self, run: Run) -> dict[str, Any] | None:
        """The budget governing ``run`` for `status`/`await`: an exceeded one, else the nearest."""
        owners = self.owners(run)
        if not owners:
            return None
        owner = next((o for o in owners if o.budget_excess is not None), owners[0])
        return {
            "owner": owner.handle,
            "limits": owner.spec.budget_limits(),
            "used": self.used(owner),
            "exceeded": owner.budget_excess.to_json() if owner.budget_excess else None,
        }

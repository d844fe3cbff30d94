"""Tool-call approval: a sub-agent's risky tool call waits until a human says yes or no.

A call needs approval when the upstream server marks the tool destructive (and not
read-only), or when the run's ``spawn(approveTools)`` names it. While it waits the run's
status is ``AwaitingApproval``; the question is shown to a human by whichever client
covers the run (an elicitation in `await`/`run`, a task's ``input_required``) or answered
with the `approve` tool.

Decisions are journaled (``approvalRequested`` when asked, ``approvalDecided`` before the
answer takes effect). A request's id is the run, its tool-call round and the call's place
among that round's approvals, so after a restart the redone round finds the answer given
before the crash (for the same tool and arguments) and is not asked again; a request that
was never answered is simply asked again.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, Protocol

import structlog
from pydantic import BaseModel, Field

from luftpause.runtime.runs import Run
from luftpause.runtime.upstream import UpstreamTool
from luftpause.runtime.errors import RuntimeServiceError

log = structlog.get_logger(component="approvals")


class ApprovalForm(BaseModel):
    """The form shown to the human: one boolean."""

    allow: bool = Field(description="Allow this tool call?")


class Appender(Protocol):
    async def append(self, record: dict[str, Any]) -> None: ...


def needs_approval(run: Run, tool: UpstreamTool) -> bool:
    annotations = tool.annotations or {}
    destructive = annotations.get("destructiveHint") is True and annotations.get("readOnlyHint") is not True
    return destructive or tool.name in run.spec.approve_tools


def _canonical(arguments: dict[str, Any]) -> str:
    return json.dumps(arguments, sort_keys=True, separators=(",", ":"))


@dataclass(eq=False)
class PendingApproval:
    id: str
    handle: str
    tool: str
    arguments: dict[str, Any]
    asked_at: float
    decision: asyncio.Future[bool]
    # A client is showing it to a human right now (so another does not ask at once).
    asking: bool = False
    answering: bool = False

    def record(self) -> dict[str, Any]:
        """``pendingApproval`` in `status`, `await` and `approve`."""
        return {"id": self.id, "tool": self.tool, "arguments": self.arguments}

    @property
    def message(self) -> str:
        return (
            f"Sub-agent {self.handle} wants to call the tool {self.tool!r} with arguments "
            f"{_canonical(self.arguments)}. Allow it?"
        )


@dataclass
class _Decision:
    tool: str
    arguments: str
    allow: bool


class AlreadyAnswered(RuntimeServiceError, LookupError):
    """The approval was answered (or withdrawn) before this answer arrived."""


@dataclass
class Approvals:
    """Pending approvals of every run, their journal records and who is waiting for them."""

    journal: Appender | None = None
    # Called when a run starts or stops waiting for a human (status, budgets).
    on_waiting_changed: Callable[[Run], None] = lambda run: None
    clock: Callable[[], float] = time.time
    # Extra fields for the ``approvalDecided`` record of a run (the budgets' paused time).
    decision_extras: Callable[[Run], dict[str, Any]] = lambda run: {}
    _pending: dict[str, PendingApproval] = field(default_factory=dict)
    _by_run: dict[str, list[PendingApproval]] = field(default_factory=dict)
    _decisions: dict[str, _Decision] = field(default_factory=dict)
    _sequence: dict[tuple[str, int], int] = field(default_factory=dict)
    _watchers: set[asyncio.Future[None]] = field(default_factory=set)

    # --- replay --------------------------------------------------------------------

    def restore(self, records: Iterable[dict[str, Any]]) -> int:
        """Take the decisions journaled before a restart; returns how many."""
        for record in records:
            if record.get("type") != "approvalDecided":
                continue
            try:
                self._decisions[str(record["id"])] = _Decision(
                    str(record["tool"]), _canonical(record.get("arguments") or {}), bool(record["allow"])
                )
            except (KeyError, TypeError, ValueError) as exc:
                log.warning("journal_record_unusable", handle=record.get("handle"), type="approvalDecided",
                            error=repr(exc))
        return len(self._decisions)

    def forget_run(self, handle: str) -> None:
        """Drop the decisions of a run (it finished; its rounds are journaled)."""
        for key in [k for k in self._decisions if k.startswith(handle + ":")]:
            del self._decisions[key]
        for key in [k for k in self._sequence if k[0] == handle]:
            del self._sequence[key]

    # --- the gate the agent loop asks ------------------------------------------------

    async def gate(self, run: Run, tool: UpstreamTool, arguments: dict[str, Any]) -> bool:
        """True when the call may run: it needs no approval, or a human allowed it."""
        if not needs_approval(run, tool):
            return True
        approval_id = self._next_id(run)
        earlier = self._decisions.get(approval_id)
        if earlier is not None and earlier.tool == tool.name and earlier.arguments == _canonical(arguments):
            log.info("approval_replayed", run=run.handle, id=approval_id, tool=tool.name, allow=earlier.allow)
            return earlier.allow
        pending = PendingApproval(
            id=approval_id, handle=run.handle, tool=tool.name, arguments=arguments, asked_at=self.clock(),
            decision=asyncio.get_running_loop().create_future(),
        )
        if self.journal is not None:
            await self.journal.append({"type": "approvalRequested", "handle": run.handle, "id": approval_id,
                                       "tool": tool.name, "arguments": arguments, "at": pending.asked_at})
        self._pending[approval_id] = pending
        self._by_run.setdefault(run.handle, []).append(pending)
        log.info("approval_pending", run=run.handle, id=approval_id, tool=tool.name)
        self.on_waiting_changed(run)
        self._notify()
        try:
            return await pending.decision
        finally:
            self._pending.pop(approval_id, None)
            waiting = self._by_run.get(run.handle, [])
            if pending in waiting:
                waiting.remove(pending)
            if not waiting:
                self._by_run.pop(run.handle, None)
            self.on_waiting_changed(run)
            self._notify()

    def _next_id(self, run: Run) -> str:
        """``<handle>:<round>.<n>``: the n-th approval of the run's round (0-based, rounds counted
        from the journaled ones), the same when a round is redone after a restart."""
        round_number = sum(1 for m in run.messages if m.get("role") == "assistant" and m.get("tool_calls"))
        key = (run.handle, round_number)
        sequence = self._sequence.pop(key, 0)
        for older in [k for k in self._sequence if k[0] == run.handle]:
            del self._sequence[older]  # an earlier round of this run: done
        self._sequence[key] = sequence + 1
        return f"{run.handle}:{round_number}.{sequence}"

    # --- answers -------------------------------------------------------------------

    async def answer(self, run: Run, allow: bool, approval_id: str | None = None, *, by: str) -> PendingApproval:
        """Decide the run's oldest pending approval (or the one named); journaled first."""
        pending = self._find(run.handle, approval_id)
        if pending.answering or pending.decision.done():
            raise AlreadyAnswered(f"approval {pending.id} is already answered")
        pending.answering = True
        try:
            if self.journal is not None:
                await self.journal.append({
                    "type": "approvalDecided", "handle": run.handle, "id": pending.id, "tool": pending.tool,
                    "arguments": pending.arguments, "allow": allow, "by": by, "at": self.clock(),
                    **self.decision_extras(run),
                })
        except BaseException:
            pending.answering = False
            raise
        self._decisions[pending.id] = _Decision(pending.tool, _canonical(pending.arguments), allow)
        if not pending.decision.done():
            pending.decision.set_result(allow)
        log.info("approval_decided", run=run.handle, id=pending.id, tool=pending.tool, allow=allow, by=by)
        return pending

    def _find(self, handle: str, approval_id: str | None) -> PendingApproval:
        waiting = [p for p in self._by_run.get(handle, []) if not p.answering]
        if approval_id is not None:
            waiting = [p for p in waiting if p.id == approval_id]
        if not waiting:
            what = f"approval {approval_id}" if approval_id else "approval"
            raise AlreadyAnswered(f"run {handle} has no pending {what}")
        return waiting[0]

    # --- who waits for what ----------------------------------------------------------

    def of(self, handle: str) -> list[PendingApproval]:
        return list(self._by_run.get(handle, []))

    def first_record(self, handle: str) -> dict[str, Any] | None:
        waiting = self._by_run.get(handle)
        return waiting[0].record() if waiting else None

    @property
    def pending_count(self) -> int:
        """Approvals waiting for a human now (for metrics)."""
        return len(self._pending)

    def get(self, approval_id: str) -> PendingApproval | None:
        return self._pending.get(approval_id)

    def unasked(self, handles: Iterable[str], asked: set[str]) -> list[PendingApproval]:
        return [
            p for handle in handles for p in self._by_run.get(handle, [])
            if p.id not in asked and not p.asking and not p.answering
        ]

    async def next_unasked(self, handles: list[str], asked: set[str]) -> list[PendingApproval]:
        """Wait until a run among ``handles`` has approvals not in ``asked`` and not being asked."""
        while True:
            found = self.unasked(handles, asked)
            if found:
                return found
            watcher: asyncio.Future[None] = asyncio.get_running_loop().create_future()
            self._watchers.add(watcher)
            try:
                await watcher
            finally:
                self._watchers.discard(watcher)

    def _notify(self) -> None:
        for watcher in self._watchers:
            if not watcher.done():
                watcher.set_result(None)

    def released(self, pending: PendingApproval) -> None:
        """A client stopped showing ``pending`` without an answer: others may ask it again."""
        pending.asking = False
        self._notify()

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

In a fleet (runtime/fleet.py) every runtime shows and asks the approvals of every run: a
runtime that does not drive a run follows its driver's ``approvalRequested`` and
``approvalDecided`` lines (``follow``), so its `status`/`await` show the question and its
clients are asked it. An answer given there is not decided there: it is sent to the driver
as an ``approvalAnswerRequested`` line (no lease needed), which the driver, following the
lines, takes as if its own client had answered (``take_request``: it journals
``approvalDecided`` naming the request); the first answer the driver takes wins. The
runtime that sent it waits a few seconds (``driver_wait_s``) for that decision. A runtime
adopting a run takes an answer sent but not yet decided when the run asks the same
question again, so the human is not asked twice.
"""

from __future__ import annotations

import asyncio
import json
import secrets
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, Protocol

import structlog
from pydantic import BaseModel, Field

from luftpause.runtime.fleet import Fenced
from luftpause.runtime.runs import Run
from luftpause.runtime.upstream import UpstreamTool
from luftpause.runtime.errors import RuntimeServiceError

log = structlog.get_logger(component="approvals")

# How long an answer given on a runtime that does not drive the run waits for the driver to
# take it (it follows the journal a few times a second) before `approve` returns undecided.
DRIVER_ANSWER_WAIT_S = 5.0


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
    # Another runtime drives the run and asked this (a followed approvalRequested line).
    remote: bool = False
    # The answer given through this runtime took effect (its driver journaled it as the decision).
    decided: bool = False

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


@dataclass
class _Request:
    """An answer another runtime sent for an approval of a run driven here, not taken yet."""

    tool: str
    arguments: str
    allow: bool
    by: str
    request: str

    @classmethod
    def of(cls, record: dict[str, Any]) -> _Request:
        return cls(str(record["tool"]), _canonical(record.get("arguments") or {}), bool(record["allow"]),
                   str(record.get("by") or "approve"), str(record["request"]))

    def answers(self, pending: PendingApproval) -> bool:
        """It was given to this question (the same tool and arguments: a round redone after
        an adoption may ask something else under the same id)."""
        return self.tool == pending.tool and self.arguments == _canonical(pending.arguments)


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
    # In a fleet: how long an answer sent to the run's driver waits for its decision.
    driver_wait_s: float = DRIVER_ANSWER_WAIT_S
    _pending: dict[str, PendingApproval] = field(default_factory=dict)
    _by_run: dict[str, list[PendingApproval]] = field(default_factory=dict)
    _decisions: dict[str, _Decision] = field(default_factory=dict)
    _sequence: dict[tuple[str, int], int] = field(default_factory=dict)
    _watchers: set[asyncio.Future[None]] = field(default_factory=set)
    # A fleet's: answers other runtimes sent for runs driven here, by approval id, until asked.
    _requested: dict[str, _Request] = field(default_factory=dict)
    # A fleet's: answers sent from here waiting for the driver's decision, by approval id.
    _outcomes: dict[str, asyncio.Future[tuple[bool, str | None]]] = field(default_factory=dict)

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
        for key in [k for k in self._requested if k.startswith(handle + ":")]:
            del self._requested[key]
        self._fail_outcomes(handle, f"run {handle} ended before its driver took this answer")

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
        try:
            if not await self._take_sent(run, pending):
                log.info("approval_pending", run=run.handle, id=approval_id, tool=tool.name)
                self.on_waiting_changed(run)
                self._notify()
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

    async def _take_sent(self, run: Run, pending: PendingApproval) -> bool:
        """A fleet's: decide ``pending`` with the answer another runtime sent for it before
        it was asked here (a run adopted after the answer was sent); True when it did."""
        sent = self._requested.pop(pending.id, None)
        if sent is None or not sent.answers(pending):
            return False
        log.info("approval_answer_taken", run=run.handle, id=pending.id, tool=pending.tool, by=sent.by)
        try:
            await self.answer(run, sent.allow, pending.id, by=sent.by, request=sent.request)
        except OSError as exc:  # not journaled: the human is asked instead
            log.warning("approval_answer_not_taken", run=run.handle, id=pending.id, error=str(exc))
            return False
        return True

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

    async def answer(self, run: Run, allow: bool, approval_id: str | None = None, *, by: str,
                     request: str | None = None) -> PendingApproval:
        """Decide the run's oldest pending approval (or the one named); journaled first.

        ``request``: the ``approvalAnswerRequested`` this answer came in (a fleet's), named
        in the decision. For a run another runtime drives the answer is sent to it instead
        (``_ask_driver``): ``decided`` on the approval returned says whether it took effect."""
        pending = self._find(run.handle, approval_id)
        if pending.answering or pending.decision.done():
            raise AlreadyAnswered(f"approval {pending.id} is already answered")
        pending.answering = True
        if pending.remote:
            return await self._ask_driver(run, pending, allow, by)
        try:
            if self.journal is not None:
                await self.journal.append({
                    "type": "approvalDecided", "handle": run.handle, "id": pending.id, "tool": pending.tool,
                    "arguments": pending.arguments, "allow": allow, "by": by,
                    **({"request": request} if request is not None else {}), "at": self.clock(),
                    **self.decision_extras(run),
                })
        except BaseException:
            pending.answering = False
            raise
        self._decisions[pending.id] = _Decision(pending.tool, _canonical(pending.arguments), allow)
        if not pending.decision.done():
            pending.decision.set_result(allow)
        pending.decided = True
        self._settle(pending.id, allow, request)
        log.info("approval_decided", run=run.handle, id=pending.id, tool=pending.tool, allow=allow, by=by)
        return pending

    async def _ask_driver(self, run: Run, pending: PendingApproval, allow: bool, by: str) -> PendingApproval:
        """Send the answer to the runtime driving the run (an ``approvalAnswerRequested``
        line, no lease needed) and wait up to ``driver_wait_s`` for its decision. Raises
        AlreadyAnswered when another answer was decided first."""
        assert self.journal is not None  # (a fleet's journal: remote approvals are followed lines)
        request = secrets.token_hex(8)
        outcome: asyncio.Future[tuple[bool, str | None]] = asyncio.get_running_loop().create_future()
        self._outcomes[pending.id] = outcome
        try:
            await self.journal.append({
                "type": "approvalAnswerRequested", "handle": run.handle, "id": pending.id, "tool": pending.tool,
                "arguments": pending.arguments, "allow": allow, "by": by, "request": request, "at": self.clock(),
            })
        except asyncio.CancelledError:
            raise  # (the line is written anyway: the answer stands)
        except BaseException:
            pending.answering = False
            self._outcomes.pop(pending.id, None)
            raise
        log.info("approval_answer_sent", run=run.handle, id=pending.id, tool=pending.tool, allow=allow, by=by)
        try:
            allowed, taken = await asyncio.wait_for(outcome, self.driver_wait_s)
        except TimeoutError:
            log.info("approval_answer_not_taken_yet", run=run.handle, id=pending.id, waited_s=self.driver_wait_s)
            return pending
        finally:
            if self._outcomes.get(pending.id) is outcome:
                del self._outcomes[pending.id]
        if taken != request:
            raise AlreadyAnswered(f"approval {pending.id} was already answered "
                                  f"({'allowed' if allowed else 'declined'}) through another client")
        pending.decided = True
        return pending

    def _settle(self, approval_id: str, allow: bool, request: str | None) -> None:
        """The approval was decided: an answer sent from here learns whether it was the one."""
        outcome = self._outcomes.get(approval_id)
        if outcome is not None and not outcome.done():
            outcome.set_result((allow, request))

    def _fail_outcomes(self, handle: str, why: str) -> None:
        for key, outcome in list(self._outcomes.items()):
            if key.startswith(handle + ":") and not outcome.done():
                outcome.set_exception(AlreadyAnswered(why))

    # --- a fleet: approvals of runs other runtimes drive ----------------------------

    def follow(self, run: Run | None, record: dict[str, Any]) -> None:
        """A line another runtime appended for a run it drives (``run``, None when unknown
        here): this runtime's view of the run's approvals follows it."""
        kind, handle = record.get("type"), str(record["handle"])
        if kind == "approvalRequested" and run is not None and not run.status.finished:
            self._follow_request(run, record)
        elif kind == "approvalDecided":
            approval_id = str(record["id"])
            self._settle(approval_id, bool(record.get("allow")), record.get("request"))
            pending = self._pending.get(approval_id)
            if pending is not None and pending.remote:
                self._withdraw(run, [pending], decided=bool(record.get("allow")))
        elif kind == "approvalAnswerRequested":
            pending = self._pending.get(str(record["id"]))
            if pending is not None and pending.remote:
                pending.answering = True  # answered elsewhere: not asked here again
        elif kind in ("round", "finished") and (handle in self._by_run or self._outcomes or self._requested):
            # A round is journaled once its approvals are decided; a run that ended asks nothing.
            self._withdraw(run, [p for p in self._by_run.get(handle, []) if p.remote])
            if kind == "finished":
                for key in [k for k in self._requested if k.startswith(handle + ":")]:
                    del self._requested[key]  # (kept while this runtime drove it, before it lost it)
                self._fail_outcomes(handle, f"run {handle} ended before its driver took this answer")

    def _follow_request(self, run: Run, record: dict[str, Any]) -> None:
        approval_id, tool, arguments = str(record["id"]), str(record["tool"]), record.get("arguments") or {}
        known = self._pending.get(approval_id)
        if known is not None:
            if not known.remote or (known.tool == tool and _canonical(known.arguments) == _canonical(arguments)):
                return  # asked again (by a runtime that adopted the run): the same question
            self._withdraw(run, [known])
        at = record.get("at")
        pending = PendingApproval(
            id=approval_id, handle=run.handle, tool=tool, arguments=arguments,
            asked_at=float(at) if isinstance(at, int | float) else self.clock(),
            decision=asyncio.get_running_loop().create_future(), remote=True,
        )
        self._pending[approval_id] = pending
        self._by_run.setdefault(run.handle, []).append(pending)
        log.info("approval_followed", run=run.handle, id=approval_id, tool=tool)
        self.on_waiting_changed(run)
        self._notify()

    def _withdraw(self, run: Run | None, gone: list[PendingApproval], decided: bool | None = None) -> None:
        """Followed approvals that are no longer asked (decided, or their run moved on)."""
        if not gone:
            return
        for pending in gone:
            self._pending.pop(pending.id, None)
            waiting = self._by_run.get(pending.handle, [])
            if pending in waiting:
                waiting.remove(pending)
            if not waiting:
                self._by_run.pop(pending.handle, None)
            if not pending.decision.done():
                if decided is None:
                    pending.decision.cancel()
                else:
                    pending.decision.set_result(decided)
        if run is not None:
            self.on_waiting_changed(run)
        self._notify()

    async def take_request(self, run: Run, record: dict[str, Any]) -> None:
        """Another runtime sent an answer (``approvalAnswerRequested``) for an approval of a
        run driven here: decide it as if a client here had answered (the first answer taken
        wins); one not asked yet is kept until it is."""
        approval_id = str(record["id"])
        try:
            sent = _Request.of(record)
        except (KeyError, TypeError, ValueError) as exc:
            log.warning("journal_record_unusable", handle=run.handle, type="approvalAnswerRequested", error=repr(exc))
            return
        pending = self._pending.get(approval_id)
        if pending is None or pending.remote:
            if approval_id not in self._decisions:
                self._requested.setdefault(approval_id, sent)  # asked later (a run adopted, a line early)
            else:
                log.info("approval_answer_ignored", run=run.handle, id=approval_id, by=sent.by, reason="decided")
            return
        if not sent.answers(pending):
            log.info("approval_answer_ignored", run=run.handle, id=approval_id, by=sent.by, reason="another question")
            return
        try:
            await self.answer(run, sent.allow, approval_id, by=sent.by, request=sent.request)
        except (AlreadyAnswered, Fenced, OSError) as exc:
            log.info("approval_answer_ignored", run=run.handle, id=approval_id, by=sent.by, reason=str(exc))

    def adopted(self, run: Run, records: list[dict[str, Any]]) -> None:
        """This runtime drives ``run`` now: the questions it followed are its own to ask
        (again), the decisions journaled are taken, and so are answers sent but not decided."""
        self._withdraw(run, [p for p in self._by_run.get(run.handle, []) if p.remote])
        for key in [k for k in self._sequence if k[0] == run.handle]:
            del self._sequence[key]  # its ids count from its records again, as after a restart
        self.restore(records)
        decided = {str(r.get("id")) for r in records if r.get("type") == "approvalDecided"}
        for record in records:
            if record.get("type") == "approvalAnswerRequested" and str(record.get("id")) not in decided:
                try:
                    self._requested.setdefault(str(record["id"]), _Request.of(record))
                except (KeyError, TypeError, ValueError) as exc:
                    log.warning("journal_record_unusable", handle=run.handle, type="approvalAnswerRequested",
                                error=repr(exc))

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
        """Approvals waiting for a human now (for metrics): of the runs this runtime drives,
        so a fleet's runtimes do not count one twice."""
        return sum(1 for pending in self._pending.values() if not pending.remote)

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

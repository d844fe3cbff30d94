"""The runtime's core: spawns runs as asyncio tasks, waits for them, cancels subtrees.

The MCP layer (`mcp_server`) only translates arguments and errors; everything a run
does happens here, in `agent` (the loop) and in `budgets` (subtree limits).
"""

from __future__ import annotations

import asyncio
import gc
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any, Literal

import structlog
from opentelemetry import context as otel_context
from opentelemetry import trace

from luftpause.runtime import constants
from luftpause.runtime.agent import AgentLoop, initial_messages
from luftpause.runtime.approvals import Approvals
from luftpause.runtime.budgets import BudgetExceeded, Budgets
from luftpause.runtime.compaction import CompactionTrigger, ForkedCompaction, compact
from luftpause.runtime.dataplane import DataplaneClient, TurnError
from luftpause.runtime.fleet import Fenced, Fleet
from luftpause.runtime.journal import Journal, apply_record, restore_runs
from luftpause.runtime.runs import BudgetExcess, Run, RunRegistry, RunSpec, RunStatus, new_handle
from luftpause.runtime.upstream import Toolbox
from luftpause.runtime.errors import RuntimeServiceError

log = structlog.get_logger(component="runtime")
TRACER = trace.get_tracer("luftpause.runtime")

WaitMode = Literal["all", "any"]
# The lines of runs another runtime drives that its approvals follow (a fleet's).
FOLLOWED_BY_APPROVALS = frozenset({"approvalRequested", "approvalDecided", "approvalAnswerRequested", "round",
                                   "finished"})
CancelReason = Callable[[Run, Run], str]  # (requested root, run in its subtree) -> error text


class InvalidRequest(RuntimeServiceError, ValueError):
    """A request that names things the runtime does not have (parent, tools)."""


class JournalUnavailable(RuntimeServiceError):
    """The journal cannot be written, so a new run could not survive a restart."""


def cancelled_by_caller(root: Run, run: Run) -> str:
    return "cancelled" if run is root else f"cancelled with its ancestor {root.handle}"


class Runtime:
    def __init__(
        self,
        dataplane: DataplaneClient,
        toolbox: Toolbox,
        journal: Journal | None = None,
        *,
        compact_at_bytes: int = constants.COMPACT_AT_BYTES,
        max_runs_per_caller: int = constants.MAX_RUNS_PER_CALLER,
        forked_compaction: ForkedCompaction | None = None,
        clock: Callable[[], float] = time.time,
        fleet: Fleet | None = None,
    ) -> None:
        # The wall clock runs are stamped and budgets measured with (tests move it on).
        self._clock = clock
        self.runs = RunRegistry()
        self.max_runs_per_caller = max_runs_per_caller
        self.toolbox = toolbox
        self.budgets = Budgets(self.runs, self._budget_exceeded, clock)
        self._dataplane = dataplane
        self._journal = journal
        self.approvals = Approvals(
            journal, on_waiting_changed=self._waiting_changed, clock=clock, decision_extras=self.budgets.paused_record
        )
        self._agent = AgentLoop(
            dataplane, toolbox, recorder=journal, approval_gate=self.approvals.gate, guard=self.budgets
        )
        self._stopping = False
        # Runtimes sharing the journal's database (fleet.py); None: this runtime drives every run.
        self._fleet = fleet
        # Runs whose lease went to another runtime: their loops stop without an outcome.
        self._released: set[str] = set()
        # Why each run is being cancelled, by handle; absent = not cancelled by a caller.
        self._cancel_reasons: dict[str, str] = {}
        # Runs whose outcome is being journaled: too late to cancel them.
        self._concluding: set[str] = set()
        self._background: set[asyncio.Task[None]] = set()
        self._compaction = CompactionTrigger(journal.store, compact_at_bytes) if journal is not None else None
        # The start's compaction when a child process began it (`__main__`), else None.
        self._forked_compaction = forked_compaction
        # How long `start` took to compact the journal (or to wait for the child that
        # did and read the result) and to replay it, in seconds.
        self.start_seconds: dict[str, float] = {}

    async def start(self) -> None:
        """Replay the journal: finished runs are kept for `await`, unfinished ones resume."""
        if self._journal is None:
            return
        # Compaction and replay allocate hundreds of thousands of objects and free them by
        # reference counting: the cyclic collector, triggered every few hundred
        # allocations, would only walk them in vain (a third of a 20,000-run start).
        collecting = gc.isenabled()
        gc.disable()
        try:
            started = time.monotonic()
            records = await self._compacted_at_start()
            compacted = time.monotonic()
            restored, resumed = self._replay(records)
            self.start_seconds = {"compaction": compacted - started, "replay": time.monotonic() - compacted}
        finally:
            if collecting:
                gc.enable()
        log.info("journal_replayed", runs=len(restored), resumed=[run.handle for run in resumed],
                 **{f"{part}_seconds": round(seconds, 3) for part, seconds in self.start_seconds.items()})
        if self._fleet is not None:
            self._fleet.last_seq = self._journal.store.last_seq
            self._fleet.start(self._lost, self._adopted, self._followed)

    def _replay(self, records: list[dict[str, Any]]) -> tuple[list[Run], list[Run]]:
        """Register the runs the records describe and resume the unfinished ones; returns
        (every run, the resumed ones)."""
        restored = restore_runs(records, initial_messages)
        self.approvals.restore(records)
        paused = _paused_budgets(records)
        for run in restored:
            self.runs.add(run)
            run.budget_paused_s = paused.get(run.handle, 0.0)
        self._pause_for_open_approvals(records)
        resumed = [run for run in restored if not run.status.finished]
        if self._fleet is not None:
            for record in records:  # questions open on the runtimes driving runs (to answer here too)
                if record.get("type") in FOLLOWED_BY_APPROVALS:
                    self._follow_approvals(record)
            return restored, []  # each resumes where its lease is taken over (_adopted)
        for run in resumed:
            self._launch(run)
        for run in restored:
            if run.has_budget:
                self.budgets.arm(run)  # a deadline passed while the runtime was down fires at once
        return restored, resumed

    def _pause_for_open_approvals(self, records: list[dict[str, Any]]) -> None:
        """A question still open at the stop waited for a human until now (downtime included):
        that time does not count against the seconds budgets above it either."""
        decided = {r.get("id") for r in records if r.get("type") == "approvalDecided"}
        open_since: dict[str, float] = {}
        for record in records:
            handle, at = record.get("handle"), record.get("at")
            if record.get("type") != "approvalRequested" or record.get("id") in decided:
                continue
            if handle in self.runs and isinstance(at, int | float) and not self.runs.get(handle).status.finished:
                open_since[handle] = min(open_since.get(handle, at), at)
        waited: dict[str, float] = {}
        now = self._clock()
        for handle, since in open_since.items():
            for owner in self.budgets.owners(self.runs.get(handle)):
                waited[owner.handle] = max(waited.get(owner.handle, 0.0), now - since)
        for handle, seconds in waited.items():
            self.runs.get(handle).budget_paused_s += max(0.0, seconds)

    async def _compacted_at_start(self) -> list[dict[str, Any]]:
        """The records of the journal, compacted: by the child `__main__` forked for it,
        or here when there is none or it failed."""
        forked, self._forked_compaction = self._forked_compaction, None
        if forked is not None and await asyncio.to_thread(forked.wait):
            assert self._journal is not None and self._compaction is not None
            records = await asyncio.to_thread(self._journal.read)
            self._compaction.size_after_last = self._journal.store.size()
            return records
        return await self._compact_journal()

    async def _compact_journal(self) -> list[dict[str, Any]]:
        """Compact the journal (retention applies); returns the records kept."""
        assert self._journal is not None and self._compaction is not None
        self._compaction.running = True
        try:
            compacted = await asyncio.to_thread(compact, self._journal.store, self._journal._lock)
        except OSError:
            log.exception("journal_compaction_failed", journal=str(self._journal.store))
            return self._journal.read()
        finally:
            self._compaction.running = False
        self._compaction.size_after_last = compacted.bytes_after
        for handle in compacted.dropped:
            if handle in self.runs and self.runs.get(handle).status.finished:
                self.runs.discard(handle)
        return compacted.records

    def _compact_when_due(self) -> None:
        if self._compaction is not None and not self._stopping and self._compaction.due():
            self._compaction.running = True  # one at a time
            self._in_background(self._compact_journal())

    async def stop(self) -> None:
        """Stop running loops without finishing them, so they resume after a restart (in a
        fleet: at once elsewhere, their leases released)."""
        self._stopping = True
        self.budgets.close()
        tasks = [run.loop_task for run in self.runs if run.loop_task is not None and not run.loop_task.done()]
        for task in tasks:
            task.cancel()
        pending = tasks + list(self._background)
        if pending:
            await asyncio.wait(pending, timeout=constants.CANCEL_WAIT_S)
        if self._fleet is not None:  # (after the loops stopped: no run driven here and there at once)
            await self._fleet.stop()

    @property
    def fleet(self) -> Fleet | None:
        """The runtimes sharing this one's journal database, or None."""
        return self._fleet

    def journal_store_problem(self) -> str | None:
        """Why the journal's store cannot be written right now, as far as can be told
        without writing (a file's permissions), or None."""
        return self._journal.store.problem_now() if self._journal is not None else None

    @property
    def journal_problem(self) -> str | None:
        """Why the journal cannot be written right now, or None."""
        return self._journal.problem if self._journal is not None else None

    @property
    def dataplane(self) -> DataplaneClient:
        return self._dataplane

    async def close(self) -> None:
        await self._dataplane.aclose()

    # --- spawning ----------------------------------------------------------------------

    async def spawn(self, spec: RunSpec, caller: str) -> Run:
        self._check_spawnable(spec)
        running = self.runs.unfinished_of(caller)
        if running >= self.max_runs_per_caller:
            raise InvalidRequest(
                f"caller {caller!r} has {running} unfinished runs, the limit (LUFTPAUSE_MAX_RUNS_PER_CALLER); "
                "await or cancel some first"
            )
        run = Run(handle=new_handle(), spec=spec, caller=caller, created_at=self._clock(),
                  messages=initial_messages(spec))
        if self._journal is not None:
            try:
                await self._journal.created(run)  # durable before the handle is handed out
            except OSError as exc:
                raise JournalUnavailable(self._journal.store.unwritable(exc)) from exc
        if run.handle in self.runs:  # (a fleet's adoption pass took its lease back meanwhile: it runs)
            return self.runs.get(run.handle)
        self.runs.add(run)
        run.trace_parent = self._trace_parent(run)
        # In a fleet a run this runtime spawned while driving more than its share is offered
        # to the others (fleet.py): the runtime claiming it drives it (here through _adopted).
        offered = self._fleet is not None and run.handle not in self._fleet.tokens
        if not offered:
            if run.has_budget:
                self.budgets.arm(run)
            self.budgets.waiting_changed(run)  # a new run under a budget paused for a human resumes it
            self._launch(run)
        log.info(
            "run_spawned",
            run=run.handle,
            parent=spec.parent,
            caller=caller,
            service_class=spec.service_class,
            budget=spec.budget_limits() or None,
            offered=offered or None,
        )
        return run

    def _check_spawnable(self, spec: RunSpec) -> None:
        if spec.parent is not None:
            if spec.parent not in self.runs:
                raise InvalidRequest(f"unknown parent handle: {spec.parent}")
            refusal = self.budgets.spawn_refusal(self.runs.get(spec.parent))
            if refusal is not None:
                raise InvalidRequest(refusal)
        if spec.tools is not None:
            known = {tool.name for tool in self.toolbox.tools()}
            unknown = sorted(set(spec.tools) - known)
            if unknown:
                raise InvalidRequest(f"unknown tools {unknown}; available: {sorted(known)}")

    def _launch(self, run: Run) -> None:
        run.loop_task = asyncio.create_task(self._execute(run), name=f"run-{run.handle}")
        run.loop_task.add_done_callback(lambda task: self._loop_ended(run))

    def _loop_ended(self, run: Run) -> None:
        """A loop task cancelled before its first step (a budget deadline that fired at
        once, a cancel right after spawn) never enters `_execute`, so nothing recorded an
        end: conclude the run here, or it would stay Running for good."""
        if run.status.finished or run.handle in self._concluding:
            return
        if (self._stopping or run.handle in self._released) and run.handle not in self._cancel_reasons:
            return  # shutdown: it resumes after the restart (or another runtime drives it now)
        reason = self._cancel_reasons.get(run.handle)
        if reason is None and run.budget_excess is not None:
            reason = run.budget_excess.message
        self._in_background(self._conclude(run, RunStatus.CANCELLED, error=reason or "cancelled"))

    def _trace_parent(self, run: Run) -> otel_context.Context:
        """A child run's span hangs under its parent run's; a top-level run's under the
        MCP request that spawned it (the SDK's span, current while spawn runs)."""
        parent = self.runs.get(run.parent) if run.parent else None
        if parent is not None and parent.span is not None:
            return trace.set_span_in_context(parent.span)
        return otel_context.get_current()

    async def _execute(self, run: Run) -> None:
        attributes = {"gen_ai.operation.name": "invoke_agent", "gen_ai.agent.id": run.handle,
                      "luftpause.parent": run.parent or "", "luftpause.class": run.spec.service_class}
        with TRACER.start_as_current_span(f"invoke_agent {run.handle}", context=run.trace_parent,
                                          attributes=attributes) as span:
            run.span = span
            try:
                await self._drive(run)
            finally:
                span.set_attribute("luftpause.status", run.status.value)
                run.span = None

    async def _drive(self, run: Run) -> None:
        try:
            result = await self._agent.drive(run)
        except asyncio.CancelledError:
            if (self._stopping or run.handle in self._released) and run.handle not in self._cancel_reasons:
                raise  # shutdown (or another runtime's now): leave it unfinished in the journal so it resumes
        except Fenced:
            self._lost(run.handle)  # its lease went elsewhere while this loop drove it
            return
            await self._conclude(run, RunStatus.CANCELLED, error=self._cancel_reasons.get(run.handle, "cancelled"))
        except BudgetExceeded as exc:
            await self._conclude(run, RunStatus.CANCELLED, error=self._cancel_reasons.get(run.handle, str(exc)))
        except TurnError as exc:
            await self._conclude(run, RunStatus.FAILED, error=str(exc))
        except Exception as exc:
            log.exception("run_crashed", run=run.handle)
            await self._conclude(run, RunStatus.FAILED, error=f"internal error: {exc!r}")
        else:
            reason = self._cancel_reasons.get(run.handle)
            if reason is not None:
                # Cancelled while its last step completed, the cancellation swallowed below
                # (a client library finishing its request instead of raising): `cancel` has
                # told the caller it is cancelled, so it ends cancelled, not with the answer.
                await self._conclude(run, RunStatus.CANCELLED, error=reason)
            else:
                await self._conclude(run, RunStatus.COMPLETED, result=result)

    async def _conclude(
        self, run: Run, status: RunStatus, *, result: str | None = None, error: str | None = None
    ) -> None:
        # Journaled before anyone waiting is told, so a result once seen survives a crash.
        self._concluding.add(run.handle)
        finished_at = self._clock()
        if self._journal is not None:
            try:
                await self._journal.finished(run.handle, status, result, error, run.stats, finished_at)
            except OSError:
                log.exception("journal_write_failed", run=run.handle)
            except Fenced:  # another runtime drives it now: its outcome is that runtime's to record
                self._concluding.discard(run.handle)
                self._lost(run.handle)
                return
            self._compact_when_due()
        run.finish(status, result=result, error=error, at=finished_at)
        self._concluding.discard(run.handle)
        self.approvals.forget_run(run.handle)
        self.budgets.waiting_changed(run)
        log.info("run_finished", run=run.handle, status=status.value, error=error, **run.stats.to_journal())
        await self._dataplane.end_run(run.handle)

    # --- a fleet of runtimes on one database (fleet.py) -------------------------------

    async def _ask_drivers_to_cancel(self, roots: list[Run]) -> list[Run]:
        """The unfinished runs under ``roots`` that another runtime drives: a
        ``cancelRequested`` record each, which their driver follows (or their adopter reads)."""
        if self._fleet is None or self._journal is None:
            return []
        asked = []
        for root in roots:
            for run in self.runs.subtree(root.handle):
                if run.status.finished or run.handle in self._fleet.tokens:
                    continue
                await self._journal.append({"type": "cancelRequested", "handle": run.handle,
                                            "reason": cancelled_by_caller(root, run)})
                asked.append(run)
        return asked

    def _lost(self, handle: str) -> None:
        """Another runtime took the run's lease: stop driving it, record nothing more."""
        self._released.add(handle)
        run = self.runs.get(handle) if handle in self.runs else None
        if run is not None and run.loop_task is not None and not run.loop_task.done() \
                and run.loop_task is not asyncio.current_task():
            run.loop_task.cancel()
        log.warning("run_released", run=handle, effect="another runtime drives it")

    def _adopted(self, handle: str, records: list[dict[str, Any]]) -> None:
        """This runtime took the run's lease: rebuild it from its records and resume it from
        its last complete round, as a restart does."""
        restored = restore_runs(records, initial_messages)
        if not restored or self._stopping:  # (stopping: the lease is released with the others)
            return
        run = restored[0]
        asked = next((r for r in records if r.get("type") == "cancelRequested"), None)
        old = self.runs.get(handle) if handle in self.runs else None
        if old is not None:
            if old.loop_task is not None and not old.loop_task.done():
                if handle in self._released:
                    # Its loop was just cancelled as lost (a renewal that read the lease before this
                    # runtime took it back) and has not ended yet: resume the run once it has.
                    old.loop_task.add_done_callback(lambda _: self._adopted(handle, records))
                return  # (else still driving it: its own lease came back)
            # The object others wait on stays; it takes what the records say now.
            old.messages, old.stats, old.model, old.budget_excess = run.messages, run.stats, run.model, run.budget_excess
            if run.status.finished and not old.status.finished:
                old.finish(run.status, result=run.result, error=run.error, at=run.finished_at)
            run = old
        else:
            self.runs.add(run)
        self._released.discard(handle)
        self.approvals.adopted(run, records)
        if run.status.finished:
            return
        if asked is not None:  # cancelled while its driver was away: it ends so here
            self._in_background(self._conclude(run, RunStatus.CANCELLED, error=str(asked.get("reason") or "cancelled")))
            return
        if run.has_budget:
            self.budgets.arm(run)
        self._launch(run)

    def _followed(self, record: dict[str, Any]) -> None:
        """A line another runtime appended: this runtime's view of that run follows it
        (its approvals too); a ``cancelRequested`` for a run this runtime drives cancels it,
        an ``approvalAnswerRequested`` answers its approval."""
        kind, handle = record.get("type"), record["handle"]
        run = self.runs.get(handle) if handle in self.runs else None
        if kind == "cancelRequested":
            if run is not None and self._cancellable(run):
                self._cancel_reasons[handle] = str(record.get("reason") or "cancelled")
                assert run.loop_task is not None
                run.loop_task.cancel()
            return
        if kind == "approvalAnswerRequested" and self._fleet is not None and handle in self._fleet.tokens:
            if run is not None:
                self._in_background(self.approvals.take_request(run, record))
            return
        view = _RegistryView(self.runs)
        try:
            apply_record(view, record, initial_messages)
        except (KeyError, ValueError, TypeError) as exc:
            log.warning("journal_record_unusable", handle=record.get("handle"), type=record.get("type"),
                        error=repr(exc))
        if kind in FOLLOWED_BY_APPROVALS:
            self._follow_approvals(record)
        if handle in self.runs:  # (the line may have started or ended its wait for a human)
            self.budgets.waiting_changed(self.runs.get(handle), driven=False)

    def _follow_approvals(self, record: dict[str, Any]) -> None:
        """The approvals of a run another runtime drives, as its lines tell them (approvals.py)."""
        handle = record["handle"]
        try:
            self.approvals.follow(self.runs.get(handle) if handle in self.runs else None, record)
        except (KeyError, ValueError, TypeError) as exc:
            log.warning("journal_record_unusable", handle=handle, type=record.get("type"), error=repr(exc))

    # --- waiting -----------------------------------------------------------------------

    async def wait(self, runs: Sequence[Run], mode: WaitMode, timeout: float) -> bool:
        """Wait until all (or any) of ``runs`` finished; True when the timeout came first."""
        pending = [run for run in runs if not run.status.finished]
        if not pending or (mode == "any" and len(pending) < len(runs)):
            return False
        waiters = [asyncio.create_task(run.finished.wait()) for run in pending]
        when = asyncio.FIRST_COMPLETED if mode == "any" else asyncio.ALL_COMPLETED
        try:
            done, not_done = await asyncio.wait(waiters, timeout=timeout, return_when=when)
        finally:
            for waiter in waiters:
                waiter.cancel()
        return not done if mode == "any" else bool(not_done)

    # --- cancelling --------------------------------------------------------------------

    def _cancellable(self, run: Run) -> bool:
        running = not run.status.finished and run.loop_task is not None
        return running and run.handle not in self._concluding

    def _cancel_subtrees(self, roots: Iterable[Run], reason: CancelReason) -> list[Run]:
        """Cancel the running runs under ``roots`` without waiting; returns them.

        The calling run's own task is not cancelled: it is the one that found a budget
        exceeded, and it stops by raising instead.
        """
        current = asyncio.current_task()
        cancelled: list[Run] = []
        for root in roots:
            for run in self.runs.subtree(root.handle):
                if not self._cancellable(run) or run in cancelled:
                    continue
                self._cancel_reasons.setdefault(run.handle, reason(root, run))
                if run.loop_task is not current:
                    run.loop_task.cancel()
                cancelled.append(run)
        return cancelled

    async def cancel(self, handles: Iterable[str]) -> list[Run]:
        """Cancel runs and their running descendants; returns every run that was cancelled
        (in a fleet, also those another runtime drives: each is asked through the journal)."""
        roots = self.runs.require(handles)
        cancelled = self._cancel_subtrees(roots, cancelled_by_caller)
        cancelled += await self._ask_drivers_to_cancel(roots)
        # Waiting on the runs' ends, not their tasks: a run whose task was cancelled before
        # it started is concluded by `_loop_ended`, after the task is done.
        waiters = [asyncio.ensure_future(run.finished.wait()) for run in cancelled]
        if waiters:
            try:
                await asyncio.wait(waiters, timeout=constants.CANCEL_WAIT_S)
            finally:
                for waiter in waiters:
                    waiter.cancel()
        log.info("runs_cancelled", runs=[run.handle for run in cancelled])
        return cancelled

    def cancel_soon(self, handles: Iterable[str]) -> None:
        """Cancel runs from a caller that is itself being cancelled (it cannot await)."""
        self._in_background(self.cancel(list(handles)))

    def _budget_exceeded(self, owner: Run, excess: BudgetExcess) -> None:
        """Cancel the owner's subtree with the budget message, and journal the excess."""
        cancelled = self._cancel_subtrees([owner], lambda root, run: excess.message)
        log.info("budget_subtree_cancelled", owner=owner.handle, runs=[run.handle for run in cancelled])
        if self._journal is not None:
            self._in_background(self._journal_excess(owner, excess))

    async def _journal_excess(self, owner: Run, excess: BudgetExcess) -> None:
        assert self._journal is not None
        try:
            await self._journal.budget_exceeded(owner, excess)
        except OSError:
            log.exception("journal_write_failed", run=owner.handle)

    def _in_background(self, work: Any) -> None:
        task = asyncio.create_task(work)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    def listed(self) -> list[Run]:
        """Every run for `status` without handles: live ones first (oldest first), then
        finished ones, most recently finished first."""
        runs = list(self.runs)
        live = [run for run in runs if not run.status.finished]
        done = sorted((run for run in runs if run.status.finished), key=lambda r: r.finished_at or 0.0, reverse=True)
        return live + done

    # --- approval ----------------------------------------------------------------------

    @property
    def approvals_pending(self) -> int:
        """Tool calls waiting for a person's approval now (the metrics gauge)."""
        return self.approvals.pending_count

    def _waiting_changed(self, run: Run) -> None:
        if run.status.finished:
            return
        run.status = RunStatus.AWAITING_APPROVAL if self.approvals.of(run.handle) else RunStatus.RUNNING
        if self._fleet is None or run.handle in self._fleet.tokens:  # (budget timers: the driver's)
            self.budgets.waiting_changed(run)

    # --- reports -----------------------------------------------------------------------

    def _approval_record(self, run: Run) -> dict[str, Any] | None:
        return self.approvals.first_record(run.handle)

    def await_record(self, run: Run) -> dict[str, Any]:
        return run.await_record(self.budgets.report(run), self._approval_record(run))

    def status_record(self, run: Run) -> dict[str, Any]:
        return run.status_record(self.budgets.report(run), self._approval_record(run))

    def tree_report(self) -> dict[str, Any]:
        return self.runs.tree_report(self.budgets.report, self._approval_record)

    def page_report(self, page: list[Run], task_preview: int | None = None,
                    among: Callable[[Run], bool] | None = None) -> dict[str, Any]:
        return self.runs.page_report(page, self.budgets.report, self._approval_record, task_preview, among)


def _paused_budgets(records: list[dict[str, Any]]) -> dict[str, float]:
    """The seconds each budget stood still for a human, as last journaled, by owner handle."""
    paused: dict[str, float] = {}
    for record in records:
        if record.get("type") == "approvalDecided" and isinstance(record.get("budgetPaused"), dict):
            for handle, seconds in record["budgetPaused"].items():
                if isinstance(seconds, int | float):
                    paused[handle] = max(paused.get(handle, 0.0), float(seconds))
    return paused


class _RegistryView:
    """The registry as the journal's replay (``journal._apply``) writes runs: by handle."""

    def __init__(self, runs: RunRegistry) -> None:
        self._runs = runs

    def __contains__(self, handle: object) -> bool:
        return handle in self._runs

    def __getitem__(self, handle: str) -> Run:
        return self._runs.get(handle)

    def __setitem__(self, handle: str, run: Run) -> None:
        self._runs.add(run)

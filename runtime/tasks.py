"""The MCP Tasks extension (``io.modelcontextprotocol/tasks``): `run` as a task.

The SDK does not ship the extension, so it is built on the SDK's extension mechanism:
a 2026-07-28 client that declares the extension gets, from `run`, a task at once
(``resultType: "task"``) instead of a call that blocks until the run finished. It
polls ``tasks/get``; while the run waits for a tool-call approval the task is
``input_required`` with the elicitation (``inputRequests``, keyed by approval id),
answered with ``tasks/update`` (``inputResponses``); when the run finished the task
is ``completed`` with the `run` tool's result. ``tasks/cancel`` cancels the run.
Clients without the extension (and every handshake-era client) keep the blocking `run`.

Tasks are journaled to ``tasks.jsonl`` beside ``runs.jsonl`` (``created``, then ``finished``).
A task still open when the runtime stopped is failed at the next start (journaled), while its
run resumes from ``runs.jsonl`` as usual and answers `await`.

On a database (stores.py) the tasks are rows of their own table, each naming the runtime that
wrote it, and any runtime of the fleet answers ``tasks/get``, ``tasks/update`` and
``tasks/cancel`` for any task: it reads the task's rows by its id (from every writer) and the
run from the fleet's journal, which it follows. There a task open when its runtime stopped
stays open: its run is adopted by another runtime and the task ends with it.
"""

from __future__ import annotations

import asyncio
import contextvars
import json
import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

import structlog
from mcp import MCPError
from mcp.server.context import CallNext, HandlerResult, ServerRequestContext
from mcp.server.extension import Extension, MethodBinding
from mcp_types import INVALID_PARAMS, CallToolRequestParams, CallToolResult, RequestParams, TextContent
from mcp_types.version import MODERN_PROTOCOL_VERSIONS
from pydantic import Field

from luftpause.keys import Keys
from luftpause.runtime.principals import principal_of_context
from luftpause.runtime import constants
from luftpause.runtime.asking import decision_of, elicit_request, record_answer
from luftpause.runtime.stores import FileStore, PostgresStore
from luftpause.runtime.runs import Run, RunStatus
from luftpause.runtime.service import Runtime

log = structlog.get_logger(component="tasks")

IDENTIFIER = "io.modelcontextprotocol/tasks"
TASKS_FILE = "tasks.jsonl"
POLL_INTERVAL_MS = 500
TASK_TTL_MS = int(constants.RETENTION_S * 1000)  # as long as the run is kept
RESTARTED_ERROR = "the runtime restarted while this task was open; its run {handle} resumes (use `await`)"


@dataclass
class TaskStart:
    """Set around the `run` tool while the extension intercepts it: `run` only spawns."""

    run: Run | None = None


TASK_START: contextvars.ContextVar[TaskStart | None] = contextvars.ContextVar("luftpause_task_start", default=None)


class TaskParams(RequestParams):
    task_id: str = Field(alias="taskId")


class TaskUpdateParams(TaskParams):
    input_responses: dict[str, Any] | None = Field(default=None, alias="inputResponses")


@dataclass
class Task:
    id: str
    handle: str
    created_at: float
    updated_at: float
    failed: str | None = None  # the task itself failed (runtime restarted); the run is separate
    cancelled: bool = False


def _fold(tasks: dict[str, Task], line: bytes | str) -> dict[str, Any] | None:
    """One journal line applied to ``tasks``: the record, or None for a torn line. A task's
    end is kept once written: its first error, a cancel by any runtime, its latest time."""
    try:
        record = json.loads(line)
        task_id = record["taskId"]
        if record["type"] == "created":
            tasks[task_id] = Task(task_id, record["handle"], record["createdAt"], record["createdAt"])
        elif record["type"] == "finished" and task_id in tasks:
            task = tasks[task_id]
            task.failed = task.failed or record.get("error")
            task.cancelled = task.cancelled or bool(record.get("cancelled"))
            task.updated_at = max(task.updated_at, record.get("at", task.updated_at))
        return record
    except (ValueError, KeyError, TypeError):
        return None  # a torn last line


@dataclass
class TaskStore:
    """Tasks by id, journaled to ``tasks.jsonl`` or its table (None: kept in memory only)."""

    store: FileStore | PostgresStore | None
    tasks: dict[str, Task] = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _others: list[dict[str, Any]] = field(default_factory=list)  # this runtime's ends of other runtimes' tasks

    @property
    def shared(self) -> bool:
        """On a database: every runtime of the fleet answers for every task."""
        return isinstance(self.store, PostgresStore)

    def restore(self, now: float) -> None:
        """Read the journal; fail tasks left open by the last stop (a lone runtime's: in a fleet
        their runs go on, and so do they); drop expired ones."""
        data = self.store.read_bytes() if self.store is not None else b""
        if not data:
            return
        closed: set[str] = set()
        for line in data.splitlines():
            record = _fold(self.tasks, line)
            if record is not None and record["type"] == "finished":
                closed.add(record["taskId"])
                if record["taskId"] not in self.tasks:
                    self._others.append(record)
        for task in self.tasks.values():
            if task.id not in closed and not self.shared:
                task.failed, task.updated_at = RESTARTED_ERROR.format(handle=task.handle), now
                log.warning("task_failed_by_restart", task=task.id, run=task.handle)
        kept = TASK_TTL_MS / 1000
        self.tasks = {k: t for k, t in self.tasks.items() if now - t.updated_at <= kept}
        self._others = [r for r in self._others if now - r.get("at", now) <= kept]
        self._rewrite(closed)

    def _rewrite(self, closed: set[str]) -> None:
        """The journal as the tasks now are (atomic: write, fsync, rename; one transaction)."""
        if self.store is None:
            return
        lines = []
        for task in self.tasks.values():
            lines.append({"type": "created", "taskId": task.id, "handle": task.handle, "createdAt": task.created_at})
            if task.id in closed or task.failed is not None:
                lines.append({"type": "finished", "taskId": task.id, "error": task.failed,
                              "cancelled": task.cancelled, "at": task.updated_at})
        with self._lock:
            self.store.replace(b"".join(_line(record) for record in [*lines, *self._others]))

    def find(self, task_id: str) -> Task | None:
        """The task as the journal has it now: on a database, its rows from every runtime
        (what this runtime holds if the database does not answer)."""
        if not self.shared:
            return self.tasks.get(task_id)
        try:
            rows = self.store.run_statement(
                "SELECT line FROM luftpause_tasks WHERE handle = %s ORDER BY seq", (task_id,))
        except OSError as exc:
            log.info("task_lookup_failed", task=task_id, error=str(exc))
            return self.tasks.get(task_id)
        found: dict[str, Task] = {}
        # Creation first: a runtime compacting its rows writes them anew, after another's end of the task.
        for (line,) in sorted(rows, key=lambda row: '"type":"created"' not in row[0]):
            _fold(found, line)
        return found.get(task_id)

    def append(self, record: dict[str, Any]) -> None:
        if self.store is None:
            return
        with self._lock:
            self.store.append(_line(record))

    def create(self, run: Run) -> Task:
        now = time.time()
        task = Task(f"task-{uuid.uuid4().hex}", run.handle, now, now)
        self.append({"type": "created", "taskId": task.id, "handle": run.handle, "createdAt": now})
        self.tasks[task.id] = task
        return task

    def close(self, task: Task, *, error: str | None = None, cancelled: bool = False) -> None:
        task.failed, task.cancelled, task.updated_at = error, cancelled, time.time()
        self.append({"type": "finished", "taskId": task.id, "error": error, "cancelled": cancelled,
                     "at": task.updated_at})


def _line(record: dict[str, Any]) -> bytes:
    return (json.dumps(record, separators=(",", ":")) + "\n").encode()


def declares_tasks(ctx: ServerRequestContext[Any, Any]) -> bool:
    if ctx.protocol_version not in MODERN_PROTOCOL_VERSIONS:
        return False  # never a task to a handshake-era client
    capabilities = ctx.session.client_capabilities
    return bool(capabilities and capabilities.extensions and IDENTIFIER in capabilities.extensions)


class TasksExtension(Extension):
    identifier = IDENTIFIER

    def __init__(self, runtime: Runtime, store: TaskStore, keys: Keys | None = None) -> None:
        self._runtime = runtime
        self._store = store
        self._keys = keys if keys is not None else Keys()
        self._watchers: set[asyncio.Task[None]] = set()

    def settings(self) -> dict[str, Any]:
        return {"tools": ["run"]}

    def methods(self) -> list[MethodBinding]:
        versions = frozenset(MODERN_PROTOCOL_VERSIONS)
        return [
            MethodBinding("tasks/get", TaskParams, self._get, protocol_versions=versions),
            MethodBinding("tasks/update", TaskUpdateParams, self._update, protocol_versions=versions),
            MethodBinding("tasks/cancel", TaskParams, self._cancel, protocol_versions=versions),
        ]

    async def intercept_tool_call(
        self, params: CallToolRequestParams, ctx: ServerRequestContext[Any, Any], call_next: CallNext
    ) -> HandlerResult:
        if params.name != "run" or not declares_tasks(ctx):
            return await call_next(ctx)
        start = TaskStart()
        token = TASK_START.set(start)
        try:
            result = await call_next(ctx)  # `run` validates its arguments and spawns, nothing more
        finally:
            TASK_START.reset(token)
        if start.run is None:
            return result  # bad arguments: the tool's error result, as without the extension
        task = self._store.create(start.run)
        watcher = asyncio.create_task(self._close_when_finished(task, start.run), name=f"task-{task.id}")
        self._watchers.add(watcher)
        watcher.add_done_callback(self._watchers.discard)
        log.info("task_created", task=task.id, run=start.run.handle)
        return {"resultType": "task", **self._wire(task, brief=True)}

    async def _close_when_finished(self, task: Task, run: Run) -> None:
        """Journal the task's end with its run's (a stop cancels this: the task stays open,
        and fails at the next start)."""
        await run.finished.wait()
        if task.failed is None and not task.cancelled:
            self._store.close(task)
            log.info("task_completed", task=task.id, run=run.handle, status=run.status.value)

    # --- methods ---------------------------------------------------------------------

    async def _task(self, params: TaskParams, ctx: ServerRequestContext[Any, Any]) -> Task:
        """The task, if the asking client may see its run (runtime/principals.py): a
        tenant's, its own; else unknown, as a task that never was. In a fleet, a task whose
        run another runtime spawned a moment ago waits for the next read of the others'
        lines (fleet.py, Fleet.caught_up), as a tool naming such a run does."""
        task = (await asyncio.to_thread(self._store.find, params.task_id) if self._store.shared  # a query
                else self._store.find(params.task_id))
        runs = self._runtime.runs
        fleet = self._runtime.fleet
        if task is not None and task.handle not in runs and fleet is not None:
            await fleet.caught_up()
        if task is not None and task.handle in runs and not principal_of_context(ctx, self._keys).sees(
                runs.get(task.handle)):
            task = None
        if task is None:
            raise MCPError(code=INVALID_PARAMS, message=f"unknown task: {params.task_id}")
        return task

    async def _get(self, ctx: ServerRequestContext[Any, Any], params: TaskParams) -> dict[str, Any]:
        return self._wire(await self._task(params, ctx))

    async def _update(self, ctx: ServerRequestContext[Any, Any], params: TaskUpdateParams) -> dict[str, Any]:
        task = await self._task(params, ctx)
        for approval_id, response in (params.input_responses or {}).items():
            pending = self._runtime.approvals.get(approval_id)
            if pending is None or pending.handle != task.handle:
                continue  # answered already, or not this task's question
            await record_answer(self._runtime, approval_id, decision_of(response), by="tasks/update")
        return self._wire(task)

    async def _cancel(self, ctx: ServerRequestContext[Any, Any], params: TaskParams) -> dict[str, Any]:
        task = await self._task(params, ctx)
        if task.failed is None and not task.cancelled and task.handle in self._runtime.runs:
            self._store.close(task, cancelled=True)
            await self._runtime.cancel([task.handle])
        return self._wire(task)

    # --- the task on the wire --------------------------------------------------------

    def _wire(self, task: Task, *, brief: bool = False) -> dict[str, Any]:
        run = self._runtime.runs.get(task.handle) if task.handle in self._runtime.runs else None
        wire: dict[str, Any] = {
            "taskId": task.id,
            "status": "working",
            "createdAt": _iso(task.created_at),
            "lastUpdatedAt": _iso(task.updated_at),
            "ttlMs": TASK_TTL_MS,
            "pollIntervalMs": POLL_INTERVAL_MS,
        }
        if task.failed is not None or run is None:
            wire.update(status="failed", error={"code": -32603, "message": task.failed or "the run is gone"})
        elif task.cancelled:
            wire["status"] = "cancelled"
        elif run.status.finished:
            wire.update(status="completed", lastUpdatedAt=_iso(run.finished_at or task.updated_at))
            if not brief:
                wire["result"] = self._result(run)
        elif run.status is RunStatus.AWAITING_APPROVAL:
            pending = self._runtime.approvals.of(run.handle)
            wire["status"] = "input_required"
            if not brief:
                wire["inputRequests"] = {
                    p.id: elicit_request(p).model_dump(by_alias=True, mode="json", exclude_none=True)
                    for p in pending
                }
        return wire

    def _result(self, run: Run) -> dict[str, Any]:
        record = self._runtime.await_record(run)
        result = CallToolResult(content=[TextContent(type="text", text=json.dumps(record))],
                                structured_content=record)
        return result.model_dump(by_alias=True, mode="json", exclude_none=True)


def _iso(at: float) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(at)) + f".{int(at * 1000) % 1000:03d}Z"

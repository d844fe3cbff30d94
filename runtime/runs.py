"""Runs: what a sub-agent was asked to do, where it stands, and the tree they form."""

from __future__ import annotations

import asyncio
import math
import sys
import time
import uuid
from collections import Counter
from collections.abc import Callable, Iterable, Iterator
from dataclasses import asdict, dataclass, field, fields
from enum import StrEnum
from typing import Any

from luftpause.runtime import constants
from luftpause.vocabulary import DEFAULT_SERVICE_CLASS
from luftpause.runtime.errors import RuntimeServiceError


class RunStatus(StrEnum):
    RUNNING = "Running"
    AWAITING_APPROVAL = "AwaitingApproval"
    COMPLETED = "Completed"
    FAILED = "Failed"
    CANCELLED = "Cancelled"

    @property
    def finished(self) -> bool:
        return self in (RunStatus.COMPLETED, RunStatus.FAILED, RunStatus.CANCELLED)


class BudgetKind(StrEnum):
    """What a budget limits; the values are the names used on the wire and in messages."""

    TOKENS = "tokens"  # prompt + completion
    TOOL_CALLS = "toolCalls"
    SECONDS = "seconds"  # wall clock since the budgeted run was created


def _number(value: float, *, round_up: bool = False) -> float | int:
    """Integers stay integers; fractions keep two decimals (``used`` rounds up, so an
    excess never prints as equal to its limit)."""
    if float(value).is_integer():
        return int(value)
    return math.ceil(value * 100) / 100 if round_up else round(value, 2)


@dataclass(frozen=True)
class BudgetExcess:
    """A budget limit that was exceeded: which kind, how much was used, the limit."""

    kind: str
    used: float
    limit: float

    def __post_init__(self) -> None:
        object.__setattr__(self, "used", round(self.used, 3))  # the same after a journal round trip

    @property
    def message(self) -> str:
        return f"budget exceeded: {self.kind} {_number(self.used, round_up=True)}/{_number(self.limit)}"

    def to_json(self) -> dict[str, Any]:
        return {"kind": str(self.kind), "used": self.used, "limit": self.limit}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> BudgetExcess:
        return cls(kind=str(data["kind"]), used=float(data["used"]), limit=float(data["limit"]))


class UnknownRunError(RuntimeServiceError, LookupError):
    def __init__(self, handles: Iterable[str]) -> None:
        self.handles = sorted(handles)
        super().__init__(f"unknown run handle(s): {', '.join(self.handles)}")


@dataclass(frozen=True)
class RunSpec:
    """The arguments of `spawn`, kept whole so later features (budgets, approval) can use them."""

    task: str
    model: str | None = None
    service_class: str = DEFAULT_SERVICE_CLASS
    system: str | None = None
    max_tool_calls: int = constants.DEFAULT_MAX_TOOL_CALLS
    tools: tuple[str, ...] | None = None  # allow-list of upstream tool names; None = all
    max_tokens: int = constants.DEFAULT_MAX_TOKENS  # 0 = leave the reply length to the engine
    parallel_tool_calls: bool = False
    parent: str | None = None
    budget_tokens: int | None = None
    budget_tool_calls: int | None = None
    budget_seconds: float | None = None
    approve_tools: tuple[str, ...] = ()
    temperature: float | None = None  # None = the engine's default sampling
    # The proxy's run (a harness session) whose reply handed out this task, when a harness
    # spawned it through MCP: the root of its tree (a sub-agent's parent is a run handle).
    harness_run: str | None = None

    def __post_init__(self) -> None:
        # One copy of a system prompt however many runs share it (a harness gives all its
        # sub-agents the same one; every runtime of a fleet holds every run: 1.4 KB a run and
        # runtime with loadgen's prompt, a few times the figure for a long harness prompt).
        if type(self.system) is str:
            object.__setattr__(self, "system", sys.intern(self.system))

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    def settings(self) -> dict[str, Any]:
        """The spawn options that shape the run, with their wire names (for `status`)."""
        return {
            "maxToolCalls": self.max_tool_calls,
            "maxTokens": self.max_tokens,
            "parallelToolCalls": self.parallel_tool_calls,
            "tools": list(self.tools) if self.tools is not None else None,
            "approveTools": list(self.approve_tools),
            "system": self.system,
            "temperature": self.temperature,
        }

    def budget_limits(self) -> dict[str, float]:
        """The limits this run sets on its subtree, by budget kind (wire names); unset ones absent."""
        limits = {
            BudgetKind.TOKENS: self.budget_tokens,
            BudgetKind.TOOL_CALLS: self.budget_tool_calls,
            BudgetKind.SECONDS: self.budget_seconds,
        }
        return {kind.value: limit for kind, limit in limits.items() if limit is not None}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> RunSpec:
        # (What this version wrote has no other keys: copied whole, as replay does 10,000 times.)
        values = dict(data) if data.keys() <= _SPEC_FIELDS else {k: v for k, v in data.items() if k in _SPEC_FIELDS}
        if values.get("tools") is not None:
            values["tools"] = tuple(values["tools"])
        values["approve_tools"] = tuple(values.get("approve_tools") or ())
        for budget in ("budget_tokens", "budget_tool_calls", "budget_seconds"):
            # Journals written before limits had to be finite may hold Infinity or NaN,
            # which no JSON report can carry: such a limit limits nothing.
            limit = values.get(budget)
            if isinstance(limit, float) and not math.isfinite(limit):
                values[budget] = None
        return cls(**values)


@dataclass
class RunStats:
    turns: int = 0
    tool_calls: int = 0
    failed_tool_calls: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    turn_seconds: float = 0.0
    tool_seconds: float = 0.0

    def plus(self, other: RunStats) -> RunStats:
        return RunStats(**{name: getattr(self, name) + getattr(other, name) for name in _STATS_FIELDS})

    def to_json(self) -> dict[str, Any]:
        return {
            "turns": self.turns,
            "toolCalls": self.tool_calls,
            "failedToolCalls": self.failed_tool_calls,
            "promptTokens": self.prompt_tokens,
            "completionTokens": self.completion_tokens,
            "turnSeconds": round(self.turn_seconds, 3),
            "toolSeconds": round(self.tool_seconds, 3),
        }

    def to_journal(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_journal(cls, data: dict[str, Any]) -> RunStats:
        return cls(**(data if data.keys() <= _STATS_FIELDS else {k: v for k, v in data.items() if k in _STATS_FIELDS}))


# Field names, computed once: replay builds a RunSpec and RunStats per journaled run.
_SPEC_FIELDS = frozenset(f.name for f in fields(RunSpec))
_STATS_FIELDS = frozenset(f.name for f in fields(RunStats))


def new_handle() -> str:
    return f"run-{uuid.uuid4().hex[:16]}"


@dataclass(eq=False)
class Run:
    handle: str
    spec: RunSpec
    caller: str
    created_at: float = field(default_factory=time.time)
    status: RunStatus = RunStatus.RUNNING
    children: list[str] = field(default_factory=list)
    stats: RunStats = field(default_factory=RunStats)
    model: str | None = None  # resolved on the first turn when the spec names none
    messages: list[dict[str, Any]] = field(default_factory=list)  # complete rounds only
    result: str | None = None
    error: str | None = None
    finished_at: float | None = None
    finished: asyncio.Event = field(default_factory=asyncio.Event)
    loop_task: asyncio.Task[None] | None = None  # the agent loop while it runs in this process
    # What the loop waits on now: "turn" (the model), "tools" (a tool-call round), or None.
    activity: str | None = None
    # Tool calls of the current round that are admitted but not yet counted in `stats`:
    # budgets count them as used so concurrent runs cannot overshoot a tool-call limit.
    tool_calls_in_flight: int = 0
    # Set on a run whose own budget (spawn's budget* arguments) was exceeded.
    budget_excess: BudgetExcess | None = None
    # Seconds this run's budget stood still because its subtree waited for a human, and
    # since when it stands still now (None: running).
    budget_paused_s: float = 0.0
    budget_paused_since: float | None = None
    # Tracing (not journaled): where this run's span hangs, and the span while it runs.
    trace_parent: Any = None
    span: Any = None
    # Told once when the run finishes (the registry's count of its caller's unfinished runs).
    on_finished: Callable[[Run], None] | None = field(default=None, repr=False)

    @property
    def parent(self) -> str | None:
        return self.spec.parent

    @property
    def has_budget(self) -> bool:
        return bool(self.spec.budget_limits())

    def finish(
        self, status: RunStatus, *, result: str | None = None, error: str | None = None, at: float | None = None
    ) -> None:
        self.status, self.result, self.error = status, result, error
        self.finished_at = at if at is not None else time.time()
        self.finished.set()
        told, self.on_finished = self.on_finished, None
        if told is not None:
            told(self)

    def await_record(
        self, budget: dict[str, Any] | None = None, pending_approval: dict[str, Any] | None = None
    ) -> dict[str, Any]:
        """What `await` and `run` report for this run; ``budget`` is the budget governing it."""
        return self._record(budget, pending_approval, result=self.result, toolCalls=self.stats.tool_calls,
                            failedToolCalls=self.stats.failed_tool_calls)

    def status_record(
        self, budget: dict[str, Any] | None = None, pending_approval: dict[str, Any] | None = None
    ) -> dict[str, Any]:
        """What `status` reports: place in the tree and costs, no result text."""
        return self._record(
            budget, pending_approval,
            activity=None if self.status.finished else self.activity,
            parent=self.parent,
            harnessRun=self.spec.harness_run,
            children=list(self.children),
            task=self.spec.task,
            model=self.model or self.spec.model,
            caller=self.caller,
            serviceClass=self.spec.service_class,
            settings=self.spec.settings(),
            createdAt=self.created_at,
            finishedAt=self.finished_at,
            stats=self.stats.to_json(),
        )

    def _record(self, budget: dict[str, Any] | None, pending_approval: dict[str, Any] | None,
                **fields: Any) -> dict[str, Any]:
        """A report on the run: its handle and status, ``fields``, then its error, budget and
        pending approval (every report names these, in this order)."""
        return {"handle": self.handle, "status": self.status.value, **fields, "error": self.error, "budget": budget,
                "pendingApproval": pending_approval}


BudgetReporter = Callable[[Run], dict[str, Any] | None]


def no_budget(run: Run) -> None:
    return None


def preview(text: str, chars: int) -> str:
    """``text`` cut to at most ``chars`` characters, an ellipsis marking the cut."""
    return text if len(text) <= chars else text[: max(chars - 1, 0)] + "…"


def previewed(record: dict[str, Any], chars: int) -> dict[str, Any]:
    """A status record whose task is cut to at most ``chars`` characters, ``taskChars``
    telling its whole length (a page of runs stays small however long their tasks)."""
    return {**record, "task": preview(record["task"], chars), "taskChars": len(record["task"])}


class InvalidPage(RuntimeServiceError, ValueError):
    """A `status` page asked for with a limit or cursor out of range (the message says which)."""


def page_of(listed: list[Run], limit: int, cursor: str | None, maximum: int) -> tuple[list[Run], str | None]:
    """The runs of one `status` page and the cursor of the next (None on the last page)."""
    if not 1 <= limit <= maximum:
        raise InvalidPage(f"limit must be between 1 and {maximum}, got {limit}")
    if cursor is not None and not (cursor.isascii() and cursor.isdigit()):
        raise InvalidPage(f"cursor must be a nextCursor from status, got {cursor!r}")
    start = int(cursor or 0)
    end = start + limit
    return listed[start:end], (str(end) if end < len(listed) else None)


class RunRegistry:
    """All runs of this runtime, by handle, with the parent/child tree."""

    def __init__(self) -> None:
        self._runs: dict[str, Run] = {}
        # Each caller's unfinished runs, kept as runs finish: spawn's limit check would
        # otherwise walk every run kept (the whole fleet's, finished ones included).
        self._unfinished: dict[str, set[str]] = {}

    def __iter__(self) -> Iterator[Run]:
        return iter(self._runs.values())

    def __len__(self) -> int:
        return len(self._runs)

    def __contains__(self, handle: object) -> bool:
        return handle in self._runs

    def add(self, run: Run) -> None:
        old = self._runs.get(run.handle)
        if old is not None and old is not run:
            self._uncount(old)  # (replaced: the new object's status counts)
        self._runs[run.handle] = run
        if not run.status.finished and run.on_finished is None:
            self._unfinished.setdefault(run.caller, set()).add(run.handle)
            run.on_finished = self._ended
        if run.parent is not None and run.parent in self._runs:
            siblings = self._runs[run.parent].children
            if run.handle not in siblings:
                siblings.append(run.handle)

    def _uncount(self, run: Run) -> None:
        """No longer count ``run`` among its caller's unfinished runs (or be told it ended)."""
        if run.on_finished is not None:
            run.on_finished = None
            self._ended(run)

    def _ended(self, run: Run) -> None:
        handles = self._unfinished.get(run.caller)
        if handles is not None:
            handles.discard(run.handle)
            if not handles:
                del self._unfinished[run.caller]

    def unfinished_of(self, caller: str) -> int:
        """How many of ``caller``'s runs are unfinished."""
        return len(self._unfinished.get(caller, ()))

    def discard(self, handle: str) -> None:
        """Forget a run (retention dropped it)."""
        run = self._runs.pop(handle, None)
        if run is not None:
            self._uncount(run)
        if run is not None and run.parent in self._runs:
            siblings = self._runs[run.parent].children
            if handle in siblings:
                siblings.remove(handle)

    def get(self, handle: str) -> Run:
        try:
            return self._runs[handle]
        except KeyError:
            raise UnknownRunError([handle]) from None

    def require(self, handles: Iterable[str]) -> list[Run]:
        """The runs for ``handles`` in order, or UnknownRunError naming every unknown one."""
        handles = list(handles)
        unknown = [handle for handle in handles if handle not in self._runs]
        if unknown:
            raise UnknownRunError(unknown)
        return [self._runs[handle] for handle in handles]

    def subtree(self, handle: str) -> list[Run]:
        """The run and all its descendants, parents before children."""
        ordered, pending = [], [handle]
        while pending:
            run = self._runs[pending.pop(0)]
            ordered.append(run)
            pending.extend(child for child in run.children if child in self._runs)
        return ordered

    def subtree_stats(self) -> dict[str, RunStats]:
        """Every run's own stats plus all its descendants', by handle."""
        totals: dict[str, RunStats] = {}
        # A child is always registered after its parent, so walking backwards sums children first.
        for run in reversed(self._runs.values()):
            total = run.stats
            for child in run.children:
                total = total.plus(totals.get(child, RunStats()))
            totals[run.handle] = total
        return totals

    def roots(self) -> list[Run]:
        return [run for run in self._runs.values() if run.parent is None or run.parent not in self._runs]

    def page_report(
        self, page: list[Run], budget_of: BudgetReporter = no_budget, approval_of: BudgetReporter = no_budget,
        task_preview: int | None = None, among: Callable[[Run], bool] | None = None,
    ) -> dict[str, Any]:
        """`GET /status` for some runs: their records with their subtree totals, the page's
        roots (runs without a parent), and counts and totals over every kept run (``among``:
        every kept run it accepts, a tenant's own).
        ``task_preview``: cut each task to at most that many characters (``taskChars``
        tells the whole length; `GET /status?handle=` gives the whole text)."""
        subtree = self.subtree_stats()
        records = []
        for run in page:
            record = {**run.status_record(budget_of(run), approval_of(run)), "subtree": subtree[run.handle].to_json()}
            records.append(record if task_preview is None else previewed(record, task_preview))
        total = RunStats()
        for root in self.roots():
            if among is None or among(root):
                total = total.plus(subtree[root.handle])
        kept = self._runs.values() if among is None else [run for run in self._runs.values() if among(run)]
        return {
            "roots": [run.handle for run in page if run.parent is None],
            "runs": records,
            "counts": dict(Counter(run.status.value for run in kept)),
            "totals": total.to_json(),
        }

    def tree_report(
        self, budget_of: BudgetReporter = no_budget, approval_of: BudgetReporter = no_budget
    ) -> dict[str, Any]:
        """The whole tree for `GET /status`: per run its own stats and its subtree totals.

        Runs are listed flat in creation order (parents first), each naming its parent and children
        (flat rather than nested so a deep tree cannot hit JSON's recursion limits).
        """
        subtree = self.subtree_stats()
        records = {
            run.handle: {**run.status_record(budget_of(run), approval_of(run)), "subtree": subtree[run.handle].to_json()}
            for run in self._runs.values()
        }
        roots = self.roots()
        total = RunStats()
        for root in roots:
            total = total.plus(subtree[root.handle])
        return {
            "roots": [run.handle for run in roots],
            "runs": list(records.values()),
            "counts": dict(Counter(run.status.value for run in self._runs.values())),
            "totals": total.to_json(),
        }

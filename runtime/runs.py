"""Runs: what a sub-agent was asked to do, where it stands, and the tree they form."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections import Counter
from collections.abc import Iterable, Iterator
from dataclasses import asdict, dataclass, field, fields
from enum import StrEnum
from typing import Any

from luftpause.headers import DEFAULT_SERVICE_CLASS
from luftpause.runtime import constants


class RunStatus(StrEnum):
    RUNNING = "Running"
    AWAITING_APPROVAL = "AwaitingApproval"
    COMPLETED = "Completed"
    FAILED = "Failed"
    CANCELLED = "Cancelled"

    @property
    def finished(self) -> bool:
        return self in (RunStatus.COMPLETED, RunStatus.FAILED, RunStatus.CANCELLED)


class UnknownRunError(LookupError):
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

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> RunSpec:
        known = {f.name for f in fields(cls)}
        values = {key: value for key, value in data.items() if key in known}
        if values.get("tools") is not None:
            values["tools"] = tuple(values["tools"])
        values["approve_tools"] = tuple(values.get("approve_tools") or ())
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
        return RunStats(**{f.name: getattr(self, f.name) + getattr(other, f.name) for f in fields(self)})

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
        known = {f.name for f in fields(cls)}
        return cls(**{key: value for key, value in data.items() if key in known})


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
    finished: asyncio.Event = field(default_factory=asyncio.Event)
    loop_task: asyncio.Task[None] | None = None  # the agent loop while it runs in this process

    @property
    def parent(self) -> str | None:
        return self.spec.parent

    def finish(self, status: RunStatus, *, result: str | None = None, error: str | None = None) -> None:
        self.status, self.result, self.error = status, result, error
        self.finished.set()

    def await_record(self) -> dict[str, Any]:
        """What `await` and `run` report for this run."""
        return {
            "handle": self.handle,
            "status": self.status.value,
            "result": self.result,
            "toolCalls": self.stats.tool_calls,
            "failedToolCalls": self.stats.failed_tool_calls,
            "error": self.error,
        }

    def status_record(self) -> dict[str, Any]:
        """What `status` reports: place in the tree and costs, no result text."""
        return {
            "handle": self.handle,
            "status": self.status.value,
            "parent": self.parent,
            "children": list(self.children),
            "task": self.spec.task,
            "model": self.model or self.spec.model,
            "serviceClass": self.spec.service_class,
            "createdAt": self.created_at,
            "stats": self.stats.to_json(),
            "error": self.error,
        }


class RunRegistry:
    """All runs of this runtime, by handle, with the parent/child tree."""

    def __init__(self) -> None:
        self._runs: dict[str, Run] = {}

    def __iter__(self) -> Iterator[Run]:
        return iter(self._runs.values())

    def __len__(self) -> int:
        return len(self._runs)

    def __contains__(self, handle: object) -> bool:
        return handle in self._runs

    def add(self, run: Run) -> None:
        self._runs[run.handle] = run
        if run.parent is not None and run.parent in self._runs:
            siblings = self._runs[run.parent].children
            if run.handle not in siblings:
                siblings.append(run.handle)

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

    def tree_report(self) -> dict[str, Any]:
        """The whole tree for `GET /status`: per run its own stats and its subtree totals."""
        subtree = self.subtree_stats()
        runs = [{**run.status_record(), "subtree": subtree[run.handle].to_json()} for run in self._runs.values()]
        roots = self.roots()
        total = RunStats()
        for root in roots:
            total = total.plus(subtree[root.handle])
        return {
            "roots": [run.handle for run in roots],
            "runs": runs,
            "counts": dict(Counter(run.status.value for run in self._runs.values())),
            "totals": total.to_json(),
        }

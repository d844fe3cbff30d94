"""The client side of the MCP Tasks extension (``io.modelcontextprotocol/tasks``) for tests.

The SDK ships neither side; this is the client half built on its extension mechanism: a
``ResultClaim`` for ``resultType: "task"`` whose resolver polls ``tasks/get``, answers an
``input_required`` task's elicitations with ``tasks/update`` through a human callback,
and returns the completed task's ``result``. With it, ``Client.call_tool("run", ...)``
resolves a task transparently.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any, Literal

from mcp.client.extension import ClaimContext, ClientExtension, ResultClaim
from mcp.client.session import ClientSession
from mcp_types import CallToolResult, ElicitRequestFormParams, ElicitResult, Request, RequestParams, Result
from pydantic import ConfigDict, Field, TypeAdapter

IDENTIFIER = "io.modelcontextprotocol/tasks"
MAX_POLLS = 2000

Human = Callable[[Any, ElicitRequestFormParams], Awaitable[ElicitResult]]


class CreatedTask(Result):
    model_config = ConfigDict(extra="allow")
    result_type: Literal["task"] = Field(default="task", alias="resultType")
    task_id: str
    status: str


class TaskIdParams(RequestParams):
    task_id: str


class TaskUpdateParams(TaskIdParams):
    input_responses: dict[str, Any]


class GetTask(Request[TaskIdParams, Literal["tasks/get"]]):
    method: Literal["tasks/get"] = "tasks/get"
    params: TaskIdParams


class UpdateTask(Request[TaskUpdateParams, Literal["tasks/update"]]):
    method: Literal["tasks/update"] = "tasks/update"
    params: TaskUpdateParams


class CancelTask(Request[TaskIdParams, Literal["tasks/cancel"]]):
    method: Literal["tasks/cancel"] = "tasks/cancel"
    params: TaskIdParams


ANY = TypeAdapter(dict[str, Any])


async def get_task(session: ClientSession, task_id: str) -> dict[str, Any]:
    return await session.send_request(GetTask(params=TaskIdParams(task_id=task_id)), ANY)


async def update_task(session: ClientSession, task_id: str, responses: dict[str, Any]) -> dict[str, Any]:
    return await session.send_request(
        UpdateTask(params=TaskUpdateParams(task_id=task_id, input_responses=responses)), ANY
    )


async def cancel_task(session: ClientSession, task_id: str) -> dict[str, Any]:
    return await session.send_request(CancelTask(params=TaskIdParams(task_id=task_id)), ANY)


class TasksClient(ClientExtension):
    """Polls tasks to their end; ``human`` answers input_required elicitations."""

    identifier = IDENTIFIER

    def __init__(self, human: Human | None = None) -> None:
        self.human = human
        self.created: list[CreatedTask] = []
        self.statuses: list[str] = []  # every polled status, in order

    def claims(self) -> list[ResultClaim[Any]]:
        return [ResultClaim(result_type="task", model=CreatedTask, resolve=self._resolve)]

    async def _resolve(self, created: CreatedTask, ctx: ClaimContext) -> CallToolResult:
        self.created.append(created)
        answered: set[str] = set()
        for _ in range(MAX_POLLS):
            task = await get_task(ctx.session, created.task_id)
            self.statuses.append(task["status"])
            if task["status"] == "completed":
                return CallToolResult.model_validate(task["result"])
            if task["status"] in ("failed", "cancelled"):
                message = (task.get("error") or {}).get("message", task["status"])
                return CallToolResult(content=[{"type": "text", "text": message}], is_error=True)
            if task["status"] == "input_required" and self.human is not None:
                responses = {}
                for key, request in (task.get("inputRequests") or {}).items():
                    if key in answered:
                        continue
                    answered.add(key)
                    answer = await self.human(None, ElicitRequestFormParams.model_validate(request["params"]))
                    responses[key] = answer.model_dump(by_alias=True, mode="json", exclude_none=True)
                if responses:
                    await update_task(ctx.session, created.task_id, responses)
                    continue
            await asyncio.sleep(task.get("pollIntervalMs", 500) / 1000)
        raise TimeoutError(f"task {created.task_id} did not end after {MAX_POLLS} polls")

"""The MCP face of the runtime: tool signatures, argument checks, errors.

Arguments are camelCase because that is the wire interface MCP clients and their
models see. Arguments that are wrong — a type, a value out of range, a handle that names
no run — are answered as tool execution errors (``isError``, see runtime/arguments.py),
so the client's model reads them and can correct its call; a run's own failure is data
in its record.
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import math
from collections.abc import Awaitable, Callable
from dataclasses import replace
from typing import Annotated, Any, Literal, ParamSpec, TypeVar

from mcp import MCPError
from mcp.server.mcpserver import Context, MCPServer
from mcp.server.mcpserver.tools import Tool
from mcp_types import INTERNAL_ERROR, InputRequiredResult, ToolAnnotations
from pydantic import ConfigDict, Field, with_config
from typing_extensions import NotRequired, TypedDict

from luftpause import __version__, vocabulary
from luftpause.runtime import constants
from luftpause.runtime.approvals import AlreadyAnswered
from luftpause.runtime.asking import asks_by_input_required, read_state, wait_asking, wait_or_ask
from luftpause.runtime.dataplane import TurnError
from luftpause.runtime.arguments import (
    ToolArgumentError,
    answer_argument_errors_as_tool_errors,
    answer_unknown_prompts_with_invalid_params,
    strict,
)
from luftpause.runtime.classify import MAX_LABELS, MIN_LABELS, ClassifyError, checked_labels, classify
from luftpause.keys import Keys
from luftpause.runtime.principals import Principal, principal_of_context
from luftpause.runtime.runs import InvalidPage, RunSpec, RunStatus, UnknownRunError, page_of, previewed
from luftpause.runtime.service import InvalidRequest, JournalUnavailable, Runtime
from luftpause.runtime.tasks import TASK_START, TaskStore, TasksExtension

P = ParamSpec("P")
R = TypeVar("R")

INSTRUCTIONS = (
    "Run sub-agents on the shared model pool. `spawn` starts one and returns a handle at "
    "once; `await` collects results (many handles at a time, so sub-agents run in "
    "parallel); `run` spawns and waits in one call. Sub-agents use the upstream tools "
    "listed by `tools`. A sub-agent's destructive tool call waits for the user's approval "
    "(status AwaitingApproval): clients with elicitation are asked while they `await` or `run`; "
    "others answer with `approve`."
)

Task = Annotated[str, Field(description="What the sub-agent should do (its user message).")]
Model = Annotated[str | None, Field(description="Model id; default: the runtime's default model.")]
ServiceClass = Annotated[
    Literal[vocabulary.SERVICE_CLASSES],  # type: ignore[valid-type]
    Field(description="interactive: someone waits for it (served first); batch: background work."),
]
System = Annotated[str | None, Field(description="System prompt for the sub-agent.")]


def bounds(minimum: float | None = None, maximum: float | None = None, exclusive_minimum: float | None = None,
           min_items: int | None = None, max_items: int | None = None) -> dict[str, Any]:
    """JSON-schema bounds for an argument; the tools check them (an isError result)."""
    named = {"minimum": minimum, "maximum": maximum, "exclusiveMinimum": exclusive_minimum,
             "minItems": min_items, "maxItems": max_items}
    return {key: value for key, value in named.items() if value is not None}


MaxToolCalls = Annotated[
    int,
    Field(description="Tool calls the sub-agent may make; then it must answer (tools stay listed, tool_choice none).",
          json_schema_extra=bounds(0, constants.MAX_TOOL_CALLS_LIMIT)),
]
ToolAllowList = Annotated[
    list[str] | None, Field(description="Allow-list of upstream tool names (see `tools`); default: all.")
]
Temperature = Annotated[float | None, Field(
    description="Sampling temperature of every turn (0 = greedy: small models call tools far more reliably); "
                "default: the engine's.")]
MaxTokens = Annotated[
    int,
    Field(description="Reply length cap per turn in tokens; 0 = leave it to the engine.",
          json_schema_extra=bounds(0, constants.MAX_TOKENS_LIMIT)),
]
ParallelToolCalls = Annotated[
    bool, Field(description="Let the model request several tools per reply and run them concurrently.")
]
Parent = Annotated[str | None, Field(description="Handle of the parent run (builds a run tree).")]
SUBTREE = " for this run and every run spawned under it (now or later); on excess the subtree is cancelled."
BudgetTokens = Annotated[
    int | None,
    Field(description="Token budget (prompt + completion)" + SUBTREE, json_schema_extra=bounds(1, constants.MAX_BUDGET_TOKENS)),
]
BudgetToolCalls = Annotated[
    int | None,
    Field(description="Tool-call budget" + SUBTREE, json_schema_extra=bounds(1, constants.MAX_BUDGET_TOOL_CALLS)),
]
BudgetSeconds = Annotated[
    float | None,
    Field(description="Wall-clock budget in seconds" + SUBTREE,
          json_schema_extra=bounds(maximum=constants.MAX_BUDGET_SECONDS, exclusive_minimum=0)),
]
ApproveTools = Annotated[
    list[str] | None,
    Field(description="Tool names whose calls need the user's approval (destructive tools always do)."),
]
Handles = Annotated[
    list[str],
    Field(description="Run handles returned by spawn.", json_schema_extra=bounds(min_items=1, max_items=constants.MAX_HANDLES)),
]
Timeout = Annotated[
    float,
    Field(description=f"Seconds to wait, 0..{constants.MAX_AWAIT_TIMEOUT_S:.0f}.",
          json_schema_extra=bounds(0, constants.MAX_AWAIT_TIMEOUT_S)),
]
Labels = Annotated[
    list[str] | None,
    Field(description=f"{MIN_LABELS}-{MAX_LABELS} candidate labels; none: the classifier's own.",
          json_schema_extra=bounds(min_items=MIN_LABELS, max_items=MAX_LABELS)),
]


# What the tools return (their outputSchemas). Open to fields added later.
RunStatusName = Literal[tuple(status.value for status in RunStatus)]  # type: ignore[valid-type]

@with_config(ConfigDict(extra="allow"))
class SpawnResult(TypedDict):
    handle: str
    status: RunStatusName


@with_config(ConfigDict(extra="allow"))
class RunRecord(TypedDict):
    handle: str
    status: RunStatusName
    result: str | None
    toolCalls: int
    failedToolCalls: int
    error: str | None
    budget: dict[str, Any] | None
    pendingApproval: Any


@with_config(ConfigDict(extra="allow"))
class AwaitResult(TypedDict):
    runs: list[RunRecord]
    timedOut: bool


@with_config(ConfigDict(extra="allow"))
class StatusRecord(TypedDict):
    handle: str
    status: RunStatusName
    activity: str | None
    parent: str | None
    harnessRun: str | None  # the harness session's run (proxy run id) that spawned it, if known
    children: list[str]
    task: str
    model: str | None
    serviceClass: str
    settings: dict[str, Any]
    createdAt: float
    finishedAt: float | None
    stats: dict[str, Any]
    error: str | None
    budget: dict[str, Any] | None


@with_config(ConfigDict(extra="allow"))
class StatusResult(TypedDict):
    runs: list[StatusRecord]


@with_config(ConfigDict(extra="allow"))
class CancelResult(TypedDict):
    runs: list[RunRecord]
    cancelled: list[str]


@with_config(ConfigDict(extra="allow"))
class ApproveResult(TypedDict):
    handle: str
    approval: dict[str, Any]
    allow: bool
    status: RunStatusName
    # The answer took effect: always on the runtime driving the run; on another (a fleet's),
    # false when the driver had not taken it within a few seconds (it stands: `status` shows
    # when it does).
    decided: NotRequired[bool]


@with_config(ConfigDict(extra="allow"))
class ToolsResult(TypedDict):
    tools: list[dict[str, Any]]


@with_config(ConfigDict(extra="allow"))
class DecideResult(TypedDict):
    label: str | None
    probabilities: dict[str, float]
    unscored: list[str]


def argument_error(message: str) -> ToolArgumentError:
    """An argument the caller got wrong (a tool execution error, see runtime/arguments.py)."""
    return ToolArgumentError(message)


def answers_bad_requests_as_tool_errors(tool: Callable[P, Awaitable[R]]) -> Callable[P, Awaitable[R]]:
    """The runtime's request errors as argument errors the client's model can read; a
    journal that cannot be written as an MCP error (the server's failure, not the call's).
    A run not known here, in a fleet, is looked for once more after the next read of the
    other runtimes' lines: a client may ask one runtime about a run another spawned a
    moment ago (fleet.py, Fleet.caught_up)."""

    @functools.wraps(tool)
    async def wrapper(*args: P.args, **kwargs: P.kwargs) -> R:
        try:
            try:
                return await tool(*args, **kwargs)
            except UnknownRunError:
                fleet = args[0].runtime.fleet if args and isinstance(args[0], RuntimeTools) else None
                if fleet is None or not await fleet.caught_up():
                    raise
                return await tool(*args, **kwargs)
        except (UnknownRunError, InvalidRequest) as exc:
            raise argument_error(str(exc)) from exc
        except JournalUnavailable as exc:
            raise MCPError(code=INTERNAL_ERROR, message=str(exc)) from exc

    return wrapper


def checked_spec(spec: RunSpec) -> RunSpec:
    """The spec, if its values are in range (messages use the wire names)."""
    if not spec.task.strip():
        raise argument_error("task must not be empty")
    if spec.max_tool_calls < 0:
        raise argument_error("maxToolCalls must be >= 0")
    if spec.max_tokens < 0:
        raise argument_error("maxTokens must be >= 0 (0 = engine default)")
    maxima = {
        "maxToolCalls": (spec.max_tool_calls, constants.MAX_TOOL_CALLS_LIMIT),
        "maxTokens": (spec.max_tokens, constants.MAX_TOKENS_LIMIT),
        "budgetTokens": (spec.budget_tokens, constants.MAX_BUDGET_TOKENS),
        "budgetToolCalls": (spec.budget_tool_calls, constants.MAX_BUDGET_TOOL_CALLS),
        "budgetSeconds": (spec.budget_seconds, constants.MAX_BUDGET_SECONDS),
    }
    for name, (value, maximum) in maxima.items():
        if value is None:
            continue
        if not math.isfinite(value):
            raise argument_error(f"{name} must be a finite number")
        if name.startswith("budget") and value <= 0:
            raise argument_error(f"{name} must be > 0")
        if value > maximum:
            raise argument_error(f"{name} must be at most {maximum:g}")
    return spec


def checked_timeout(timeout: float) -> float:
    if not (math.isfinite(timeout) and 0 <= timeout <= constants.MAX_AWAIT_TIMEOUT_S):
        limit = constants.MAX_AWAIT_TIMEOUT_S
        raise argument_error(f"timeout must be between 0 and {limit:.0f} seconds, got {timeout}")
    return timeout


def checked_handles(handles: list[str]) -> list[str]:
    if not handles:
        raise argument_error("handles must name at least one run")
    if len(handles) > constants.MAX_HANDLES:
        raise argument_error(f"handles may name at most {constants.MAX_HANDLES} runs")
    return list(dict.fromkeys(handles))  # a handle named twice is reported once


F = TypeVar("F", bound=Callable[..., Any])

READ_ONLY = ToolAnnotations(read_only_hint=True, destructive_hint=False, idempotent_hint=True, open_world_hint=False)
# A sub-agent calls the upstream tools (open world); starting one changes nothing existing.
STARTS_RUNS = ToolAnnotations(read_only_hint=False, destructive_hint=False, idempotent_hint=False,
                              open_world_hint=True)
_TOOL = "mcp_tool"  # the attribute `tool` marks a method with: its registration's keywords


def tool(name: str | None = None, *, description: str, annotations: ToolAnnotations) -> Callable[[F], F]:
    """Mark a method of :class:`RuntimeTools` as one of the server's tools, registered as
    the SDK's ``MCPServer.tool`` would (``name``: the method's own by default)."""

    def mark(method: F) -> F:
        setattr(method, _TOOL, {"name": name, "description": description, "annotations": annotations})
        return method

    return mark


def with_arguments_of(source: Callable[..., Any], returns: Any) -> Callable[[F], F]:
    """The decorated tool takes ``source``'s arguments, as keywords, and returns
    ``returns``. The SDK reads a tool's arguments (its input schema and their validation)
    from its signature and finds its context parameter among its type hints: both become
    ``source``'s, with ``returns`` as the return type (the output schema)."""
    signature = inspect.signature(source, eval_str=True).replace(return_annotation=returns)
    annotations = {**source.__annotations__, "return": returns}

    def derive(fn: F) -> F:
        fn.__signature__ = signature  # type: ignore[attr-defined]
        fn.__annotations__ = annotations
        return fn

    return derive


class RuntimeTools:
    """The runtime's MCP tools; with tenant ``keys`` each answers a tenant about its own
    runs only (runtime/principals.py)."""

    def __init__(self, runtime: Runtime, keys: Keys) -> None:
        self.runtime = runtime
        self.keys = keys

    def tools(self) -> list[Tool]:
        """Every tool, in the order defined here (tools/list's), each validating its
        arguments strictly (runtime/arguments.py)."""
        return [strict(Tool.from_function(getattr(self, attribute), **getattr(member, _TOOL)))
                for attribute, member in vars(type(self)).items() if hasattr(member, _TOOL)]

    def principal(self, ctx: Context) -> Principal:
        return principal_of_context(ctx, self.keys)

    async def harness_run(self, task: str, asking: Principal) -> str | None:
        """The harness session whose reply handed out this task (the dataplane saw the tool
        call go by): a tenant's own only."""
        found = await self.runtime.dataplane.run_of_task(task)
        if found is None or (asking.tenant and found["caller"] != asking.caller):
            return None
        return found["run_id"]

    @tool(description="Start a sub-agent; returns its handle at once.", annotations=STARTS_RUNS)
    @answers_bad_requests_as_tool_errors
    async def spawn(  # noqa: N803 - camelCase is the MCP wire interface
        self,
        task: Task,
        ctx: Context,
        model: Model = None,
        serviceClass: ServiceClass = vocabulary.DEFAULT_SERVICE_CLASS,  # noqa: N803
        system: System = None,
        maxToolCalls: MaxToolCalls = constants.DEFAULT_MAX_TOOL_CALLS,  # noqa: N803
        tools: ToolAllowList = None,
        maxTokens: MaxTokens = constants.DEFAULT_MAX_TOKENS,  # noqa: N803
        parallelToolCalls: ParallelToolCalls = False,  # noqa: N803
        parent: Parent = None,
        budgetTokens: BudgetTokens = None,  # noqa: N803
        budgetToolCalls: BudgetToolCalls = None,  # noqa: N803
        budgetSeconds: BudgetSeconds = None,  # noqa: N803
        approveTools: ApproveTools = None,  # noqa: N803
        temperature: Temperature = None,
    ) -> SpawnResult:
        runtime = self.runtime
        spec = RunSpec(
            task=task,
            model=model or None,
            service_class=serviceClass,
            system=system or None,
            max_tool_calls=maxToolCalls,
            tools=tuple(tools) if tools is not None else None,
            max_tokens=maxTokens,
            parallel_tool_calls=parallelToolCalls,
            parent=parent or None,
            budget_tokens=budgetTokens,
            budget_tool_calls=budgetToolCalls,
            budget_seconds=budgetSeconds,
            approve_tools=tuple(approveTools or ()),
            temperature=temperature,
        )
        asking = self.principal(ctx)
        if spec.parent is not None and spec.parent in runtime.runs:
            asking.get(runtime.runs, spec.parent)  # another caller's parent is unknown to a tenant
        elif spec.parent is None:
            spec = replace(spec, harness_run=await self.harness_run(spec.task, asking))
        run = await runtime.spawn(checked_spec(spec), asking.caller)
        return {"handle": run.handle, "status": run.status.value}

    @tool(
        name="await",
        description=(
            "Wait for runs: mode 'all' until every run finished, 'any' until one did, at most "
            f"`timeout` seconds (default {constants.DEFAULT_AWAIT_TIMEOUT_S:.0f}, max "
            f"{constants.MAX_AWAIT_TIMEOUT_S:.0f}). Returns each run's status and result; call "
            "again while runs are still Running."
        ),
        annotations=READ_ONLY,
    )
    @answers_bad_requests_as_tool_errors
    async def await_runs(
        self,
        handles: Handles,
        ctx: Context,
        mode: Literal["all", "any"] = "all",
        timeout: Timeout = constants.DEFAULT_AWAIT_TIMEOUT_S,
    ) -> AwaitResult | InputRequiredResult:
        runtime = self.runtime
        runs = self.principal(ctx).require(runtime.runs, checked_handles(handles))
        if asks_by_input_required(ctx):
            outcome = await wait_or_ask(runtime, ctx, runs, mode, checked_timeout(timeout), read_state(ctx))
            if isinstance(outcome, InputRequiredResult):
                return outcome
            timed_out = outcome
        else:
            timed_out = await wait_asking(runtime, ctx, runs, mode, checked_timeout(timeout))
        return {"runs": [runtime.await_record(run) for run in runs], "timedOut": timed_out}

    # `run` takes exactly spawn's arguments and answers with an await record.
    @tool(name="run", description="Start a sub-agent and wait for it in the same call.", annotations=STARTS_RUNS)
    @with_arguments_of(spawn, returns=RunRecord)
    async def run_to_completion(self, ctx: Context, **arguments: Any) -> RunRecord | InputRequiredResult:
        runtime = self.runtime
        task_start = TASK_START.get()
        if task_start is not None:  # the Tasks extension makes a task of it: spawn only
            task_start.run = runtime.runs.get((await self.spawn(ctx=ctx, **arguments))["handle"])
            return runtime.await_record(task_start.run)
        if asks_by_input_required(ctx):
            state = read_state(ctx)  # on a retry: the run this call started
            handle = state.get("handle")
            if not isinstance(handle, str) or handle not in runtime.runs or \
                    not self.principal(ctx).sees(runtime.runs.get(handle)):  # a state naming another's run
                state = {"handle": (await self.spawn(ctx=ctx, **arguments))["handle"]}
            run = runtime.runs.get(state["handle"])
            outcome = await wait_or_ask(runtime, ctx, [run], "all", None, state)
            if isinstance(outcome, InputRequiredResult):
                return outcome
            return runtime.await_record(run)
        run = runtime.runs.get((await self.spawn(ctx=ctx, **arguments))["handle"])
        try:
            await wait_asking(runtime, ctx, [run], "all", None)
        except asyncio.CancelledError:
            # The client cancelled the call (notifications/cancelled) or went away: nobody
            # holds the handle, so the sub-agent would run on for no one.
            runtime.cancel_soon([run.handle])
            raise
        return runtime.await_record(run)

    @tool(
        description=(
            "Status of runs with parent, children, stats, budget and pending approval. Without handles: "
            "every kept run, live ones first, then finished ones newest first, a page at a time "
            f"(pass nextCursor back as cursor), each task cut to {constants.STATUS_TASK_PREVIEW_CHARS} "
            "characters (taskChars is its whole length; name the handle for the whole text)."
        ),
        annotations=READ_ONLY,
    )
    @answers_bad_requests_as_tool_errors
    async def status(
        self,
        ctx: Context,
        handles: Annotated[
            list[str] | None,
            Field(description="Run handles; default: every run.", json_schema_extra=bounds(max_items=constants.MAX_HANDLES)),
        ] = None,
        limit: Annotated[
            int, Field(description=f"Runs per page without handles (1..{constants.STATUS_PAGE_MAX}).")
        ] = constants.STATUS_PAGE_DEFAULT,
        cursor: Annotated[str | None, Field(description="nextCursor of the previous page.")] = None,
    ) -> StatusResult:
        runtime = self.runtime
        asking = self.principal(ctx)
        if handles:
            return {"runs": [runtime.status_record(run) for run in asking.require(runtime.runs, checked_handles(handles))]}
        listed = asking.visible(runtime.listed())
        try:
            page, next_cursor = page_of(listed, limit, cursor, constants.STATUS_PAGE_MAX)
        except InvalidPage as exc:
            raise argument_error(str(exc)) from exc
        records = [previewed(runtime.status_record(run), constants.STATUS_TASK_PREVIEW_CHARS) for run in page]
        return {"runs": records, "total": len(listed), "nextCursor": next_cursor}

    @tool(
        description="Cancel runs; cancelling a parent cancels all its running descendants.",
        annotations=ToolAnnotations(read_only_hint=False, destructive_hint=False, idempotent_hint=True,
                                    open_world_hint=False),
    )
    @answers_bad_requests_as_tool_errors
    async def cancel(self, handles: Handles, ctx: Context) -> CancelResult:
        requested = self.principal(ctx).require(self.runtime.runs, checked_handles(handles))
        cancelled = await self.runtime.cancel(run.handle for run in requested)
        return {
            "runs": [self.runtime.await_record(run) for run in requested],
            "cancelled": [run.handle for run in cancelled],
        }

    @tool(
        description=(
            "Answer a run's pending tool-call approval (see `status`/`await` pendingApproval): "
            "allow true runs the call, false declines it. decided false: the runtime driving the run "
            "has not taken the answer yet (it stands)."
        ),
        # Answering lets a tool call run (or not): a change, but nothing is deleted by it.
        annotations=ToolAnnotations(read_only_hint=False, destructive_hint=False, idempotent_hint=False,
                                    open_world_hint=True),
    )
    @answers_bad_requests_as_tool_errors
    async def approve(
        self,
        handle: Annotated[str, Field(description="Handle of the run awaiting approval.")],
        allow: Annotated[bool, Field(description="true: run the tool call; false: decline it.")],
        ctx: Context,
    ) -> ApproveResult:
        run = self.principal(ctx).get(self.runtime.runs, handle)
        try:
            pending = await self.runtime.approvals.answer(run, allow, by="approve")
        except AlreadyAnswered as exc:
            raise argument_error(str(exc)) from exc
        await asyncio.sleep(0)  # let the run take the answer, so the status below is current
        return {"handle": run.handle, "approval": pending.record(), "allow": allow, "status": run.status.value,
                "decided": pending.decided}

    @tool(name="tools", description="The upstream tools sub-agents can use.", annotations=READ_ONLY)
    async def list_upstream_tools(self) -> ToolsResult:
        return {"tools": [tool.describe() for tool in self.runtime.toolbox.tools()]}

    @tool(
        name="decide",
        description=(
            "Classify `input`. Without `labels`, a one-pass classifier replica answers with its own labels; "
            "with 2-20 `labels`, one model turn scores each label by the log-probability of its first token. "
            "Returns label, probabilities and unscored labels."
        ),
        annotations=READ_ONLY,
    )
    async def decide_tool(
        self,
        input: Annotated[str, Field(description="What to classify.")],  # noqa: A002 - the tool's documented argument name
        ctx: Context,
        labels: Labels = None,
        model: Annotated[str | None, Field(description="Model to use; default: the pool's first of the kind.")] = None,
    ) -> DecideResult:
        if not input.strip():
            raise argument_error("input must not be empty")
        try:
            return await classify(self.runtime.dataplane, input, checked_labels(labels), model or None,
                                self.principal(ctx).caller)
        except ClassifyError as exc:
            raise argument_error(str(exc)) from exc
        except TurnError as exc:
            raise MCPError(code=INTERNAL_ERROR, message=f"decide failed: {exc}") from exc


def build_mcp_server(runtime: Runtime, tasks: TaskStore | None = None, keys: Keys | None = None) -> MCPServer:
    """The runtime's MCP server; ``tasks`` holds `run`'s tasks for clients with the Tasks
    extension; with tenant ``keys`` each tool answers a tenant about its own runs only
    (runtime/principals.py)."""
    tasks = tasks if tasks is not None else TaskStore(None)
    keys = keys if keys is not None else Keys()
    server = MCPServer(
        "luftpause-runtime", version=__version__, instructions=INSTRUCTIONS, log_level="WARNING",
        tools=RuntimeTools(runtime, keys).tools(), extensions=[TasksExtension(runtime, tasks, keys)],
    )
    answer_argument_errors_as_tool_errors(server)
    answer_unknown_prompts_with_invalid_params(server)
    return server

"""The sub-agent loop: LLM turn, tool-call round, next turn, until the model answers.

A run waiting on a tool holds no turn slot: the turn ended when the reply came back,
and the next one is a new request the scheduler admits as a continuation.
"""

from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Protocol

import structlog
from opentelemetry import trace
from opentelemetry.trace import SpanKind, Status, StatusCode

from luftpause.runtime.dataplane import DataplaneClient, TurnIdentity, TurnReply
from luftpause.runtime.runs import Run, RunSpec
from luftpause.runtime.toolcalls import ToolCallArgumentsError, prepare_arguments, recover_text_tool_calls, was_coerced
from luftpause.runtime.upstream import Toolbox, ToolOutcome, UpstreamTool

log = structlog.get_logger(component="agent")
TRACER = trace.get_tracer("luftpause.runtime")

BUDGET_SPENT_TEXT = "Error: the tool-call budget of this run is spent; answer with what you have."


class RoundRecorder(Protocol):
    """Where complete rounds go before the run moves on (the journal)."""

    async def round(self, run: Run, messages: list[dict[str, Any]]) -> None: ...


class RunGuard(Protocol):
    """Limits checked around every step of a run (the budgets).

    ``check`` raises to stop the run; ``planned_tool_calls`` are the calls the next
    round is about to make.
    """

    def check(self, run: Run, planned_tool_calls: int = 0) -> None: ...


# Seam for tool-call approval: asked before a call runs; False = declined.
# The gate may wait for the user; it sets the run's status while it does.
ApprovalGate = Callable[[Run, UpstreamTool, dict[str, Any]], Awaitable[bool]]
DECLINED_TEXT = "Error: the user declined this tool call"


def initial_messages(spec: RunSpec) -> list[dict[str, Any]]:
    messages: list[dict[str, Any]] = []
    if spec.system:
        messages.append({"role": "system", "content": spec.system})
    messages.append({"role": "user", "content": spec.task})
    return messages


@dataclass(frozen=True)
class ToolCall:
    id: str
    name: str
    raw_arguments: Any

    @classmethod
    def from_openai(cls, call: dict[str, Any]) -> ToolCall:
        function = call.get("function") or {}
        return cls(
            id=str(call.get("id") or f"call_{uuid.uuid4().hex[:24]}"),
            name=str(function.get("name") or ""),
            raw_arguments=function.get("arguments"),
        )

    def as_openai(self) -> dict[str, Any]:
        arguments = self.raw_arguments
        if not isinstance(arguments, str):
            arguments = json.dumps(arguments if arguments is not None else {})
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": arguments}}


class AgentLoop:
    def __init__(
        self,
        dataplane: DataplaneClient,
        toolbox: Toolbox,
        recorder: RoundRecorder | None = None,
        approval_gate: ApprovalGate | None = None,
        guard: RunGuard | None = None,
    ) -> None:
        self._dataplane = dataplane
        self._toolbox = toolbox
        self._recorder = recorder
        self._approval_gate = approval_gate
        self._guard = guard

    async def drive(self, run: Run) -> str:
        """Take turns until the model answers without tool calls; returns that answer."""
        run.model = run.model or run.spec.model or await self._dataplane.default_model()
        identity = TurnIdentity(run.handle, run.spec.service_class, run.caller)
        choice_ignored = False  # the engine called tools under tool_choice "none": ask without them
        while True:
            self._check(run)
            offered = [] if choice_ignored else self._offered_tools(run)
            answer_now = run.stats.tool_calls >= run.spec.max_tool_calls
            run.activity = "turn"
            with TRACER.start_as_current_span(f"chat {run.model}", kind=SpanKind.CLIENT, attributes={
                    "gen_ai.operation.name": "chat", "gen_ai.request.model": run.model,
                    "luftpause.run_id": run.handle}) as span:
                reply = await self._dataplane.chat(self._turn_body(run, offered, answer_now), identity)
                span.set_attributes({"gen_ai.usage.input_tokens": reply.prompt_tokens,
                                     "gen_ai.usage.output_tokens": reply.completion_tokens,
                                     "gen_ai.response.finish_reasons": [reply.finish_reason or "stop"]})
            run.activity = None
            self._count_turn(run, reply)
            self._check(run)
            if answer_now and offered and reply.message.get("tool_calls") and not reply.message.get("content"):
                # Some engines ignore tool_choice "none" (or their chat template does); an
                # empty answer would be lost work, so ask once more without the tools.
                log.info("tool_choice_ignored", run=run.handle, effect="answer asked again without tools")
                choice_ignored = True
                continue
            calls = [] if answer_now else self._tool_calls(reply, offered)
            if not calls:
                return str(reply.message.get("content") or "")
            if not reply.message.get("tool_calls"):
                log.info("tool_calls_recovered", run=run.handle, tools=[call.name for call in calls],
                         source="JSON text in the reply's content")
            calls = _calls_to_run(run, calls)
            round_messages = [self._assistant_message(reply, calls)]
            round_messages += await self._execute_round(run, calls, offered)
            run.messages.extend(round_messages)
            if self._recorder is not None:
                await self._recorder.round(run, round_messages)

    def _check(self, run: Run, planned_tool_calls: int = 0) -> None:
        if self._guard is not None:
            self._guard.check(run, planned_tool_calls)

    def _offered_tools(self, run: Run) -> list[UpstreamTool]:
        """The tools listed in every turn of the run, the last one too: once the budget
        is spent they stay listed with ``tool_choice: "none"`` (see :meth:`_turn_body`).
        A run allowed no tool call is offered none."""
        if run.spec.max_tool_calls == 0:
            return []
        tools = self._toolbox.tools()
        if run.spec.tools is not None:
            allowed = set(run.spec.tools)
            tools = [tool for tool in tools if tool.name in allowed]
        return tools

    def _turn_body(self, run: Run, offered: list[UpstreamTool], answer_now: bool) -> dict[str, Any]:
        """One turn's request. With the budget spent (``answer_now``) the tools are still
        listed, with ``tool_choice: "none"``: chat templates render the tool list at the
        top of the prompt, so dropping it would make the last turn's prompt share nothing
        with the earlier ones and miss the engine's prefix cache for the whole
        conversation."""
        body: dict[str, Any] = {"model": run.model, "messages": run.messages}
        if run.spec.max_tokens:
            body["max_tokens"] = run.spec.max_tokens
        if run.spec.temperature is not None:
            body["temperature"] = run.spec.temperature
        if offered:
            body["tools"] = [tool.openai_function() for tool in offered]
            if answer_now:
                body["tool_choice"] = "none"
            elif run.spec.parallel_tool_calls:
                body["parallel_tool_calls"] = True
        return body

    @staticmethod
    def _count_turn(run: Run, reply: TurnReply) -> None:
        run.stats.turns += 1
        run.stats.prompt_tokens += reply.prompt_tokens
        run.stats.completion_tokens += reply.completion_tokens
        run.stats.turn_seconds += reply.seconds

    @staticmethod
    def _tool_calls(reply: TurnReply, offered: list[UpstreamTool]) -> list[ToolCall]:
        if not offered:
            # No tools were on offer: whatever the model says is its answer.
            return []
        raw_calls = reply.message.get("tool_calls") or recover_text_tool_calls(
            reply.message.get("content"), {tool.name for tool in offered}
        )
        return [ToolCall.from_openai(call) for call in raw_calls or [] if isinstance(call, dict)]

    @staticmethod
    def _assistant_message(reply: TurnReply, calls: list[ToolCall]) -> dict[str, Any]:
        content = reply.message.get("content")
        if not reply.message.get("tool_calls"):
            content = None  # the calls were recovered from this text; do not send them twice
        return {"role": "assistant", "content": content, "tool_calls": [call.as_openai() for call in calls]}

    async def _execute_round(
        self, run: Run, calls: list[ToolCall], offered: list[UpstreamTool]
    ) -> list[dict[str, Any]]:
        remaining = max(0, run.spec.max_tool_calls - run.stats.tool_calls)
        allowed, over_budget = calls[:remaining], calls[remaining:]
        self._check(run, planned_tool_calls=len(allowed))
        offered_by_name = {tool.name: tool for tool in offered}
        # Admitted calls count against budgets while they run (the check above and this
        # line run without a pause, so concurrent runs cannot both take the last call).
        run.tool_calls_in_flight = len(allowed)
        run.activity = "tools"
        try:
            if run.spec.parallel_tool_calls:
                outcomes = await asyncio.gather(*(self._execute_call(run, c, offered_by_name) for c in allowed))
            else:
                outcomes = [await self._execute_call(run, call, offered_by_name) for call in allowed]
        finally:
            run.tool_calls_in_flight = 0
            run.activity = None
        for outcome in outcomes:
            run.stats.tool_calls += 1
            run.stats.failed_tool_calls += int(outcome.failed)
            run.stats.tool_seconds += outcome.seconds
        texts = [outcome.text for outcome in outcomes] + [BUDGET_SPENT_TEXT] * len(over_budget)
        return [_tool_message(call, text) for call, text in zip(calls, texts, strict=True)]

    async def _execute_call(self, run: Run, call: ToolCall, offered: dict[str, UpstreamTool]) -> ToolOutcome:
        tool = offered.get(call.name)
        if tool is None:
            names = ", ".join(sorted(offered)) or "none"
            log.info("tool_call_rejected", run=run.handle, tool=call.name, reason="no such tool offered")
            return ToolOutcome(f"Error: there is no tool {call.name!r}; available tools: {names}", failed=True)
        try:
            arguments = prepare_arguments(call.raw_arguments, tool.input_schema)
        except ToolCallArgumentsError as exc:
            log.info("tool_call_rejected", run=run.handle, tool=call.name, reason=str(exc))
            return ToolOutcome(f"Error: {exc}", failed=True)
        if was_coerced(call.raw_arguments, arguments):
            log.info("tool_call_coerced", run=run.handle, tool=call.name, sent=_short(call.raw_arguments),
                     arguments=_short(arguments))
        if self._approval_gate is not None and not await self._approval_gate(run, tool, arguments):
            return ToolOutcome(DECLINED_TEXT, failed=True)
        with TRACER.start_as_current_span(f"execute_tool {call.name}", attributes={
                "gen_ai.operation.name": "execute_tool", "gen_ai.tool.name": call.name,
                "gen_ai.tool.call.id": call.id, "luftpause.run_id": run.handle}) as span:
            outcome = await self._toolbox.call(call.name, arguments)
            if outcome.failed:
                span.set_status(Status(StatusCode.ERROR, outcome.text[:200]))
        log.info(
            "tool_called", run=run.handle, tool=call.name, failed=outcome.failed, seconds=round(outcome.seconds, 3)
        )
        return outcome


def _calls_to_run(run: Run, calls: list[ToolCall]) -> list[ToolCall]:
    """The calls of one reply worth running. Small models repeat the same call two or
    three times in one reply (SmolLM2 on llama.cpp does): identical calls (same tool,
    same arguments) run once. Without ``parallelToolCalls`` a run makes one call per
    reply, whatever the engine allowed (llama.cpp ignores ``parallel_tool_calls``): the
    first is kept. The assistant message sent back holds only the calls that ran."""
    unique: dict[tuple[str, str], ToolCall] = {}
    for call in calls:
        unique.setdefault((call.name, _canonical(call.raw_arguments)), call)
    kept = list(unique.values())
    if len(kept) < len(calls):
        log.info("tool_calls_deduplicated", run=run.handle, received=len(calls), kept=len(kept),
                 tools=sorted({call.name for call in calls}))
    if not run.spec.parallel_tool_calls and len(kept) > 1:
        log.info("tool_calls_dropped", run=run.handle, kept=kept[0].name, dropped=[call.name for call in kept[1:]],
                 reason="parallelToolCalls is false: one call per reply")
        kept = kept[:1]
    return kept


def _canonical(arguments: Any) -> str:
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except ValueError:
            return arguments
    return json.dumps(arguments, sort_keys=True)


def _short(value: Any, limit: int = 200) -> str:
    text = value if isinstance(value, str) else json.dumps(value)
    return text if len(text) <= limit else text[:limit] + "..."


def _tool_message(call: ToolCall, text: str) -> dict[str, Any]:
    return {"role": "tool", "tool_call_id": call.id, "name": call.name, "content": text}

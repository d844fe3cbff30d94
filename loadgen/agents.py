"""Own-loop agents: each runs LLM turn → tool call → LLM turn against any OpenAI-compatible
``base_url`` (luftpause's dataplane, a router, an engine), closed loop: a finished run is
replaced at once until the deadline. Turns stream and are parsed by hand (no SDK) so the
load generator stays cheap on a small machine; luftpause's headers go only to luftpause.
A peer row may send the client's own engine hints (``Target.client_hints``): SGLang's
top-level ``priority`` by class and ``session_id`` = the run, and ``POST /close_session``
when the run ends, what a user could send through a router without luftpause."""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field
from typing import Any

import aiohttp

from luftpause.hints import BACKGROUND, FRESH
from luftpause.loadgen.records import RunRecord, TurnRecord
from luftpause.loadgen.workload import LOOKUP_TOOL, SYSTEM_PROMPT, Workload, plan_run, tool_result
from luftpause.peer_identity import add_identity, finish_path
from luftpause.vocabulary import BATCH, INTERACTIVE

MAX_429_RETRIES = 100


@dataclass(frozen=True)
class Target:
    base_url: str  # ending in /v1
    model: str
    luftpause: bool = False  # send x-luftpause-* headers
    caller: str = "loadgen"
    peer_identity: str = "none"  # a peer router's identity fields on each turn (luftpause.peer_identity)
    client_hints: bool = False  # the client's own priority and session_id on each turn (client_hints)

    def __post_init__(self) -> None:
        if self.luftpause and self.client_hints:  # luftpause sets the engine's fields itself, over a client's
            raise ValueError("a luftpause target sends no client hints")


# The client's own priority by class, in SGLang's order (higher first): what a user without
# luftpause can tell apart. Batch at 0, what an engine gives a request that names none.
CLIENT_PRIORITY = {INTERACTIVE: FRESH, BATCH: BACKGROUND}


def client_hints(body: dict[str, Any], run_id: str, service_class: str) -> dict[str, Any]:
    """``body`` (a new dict) with what a client sends an SGLang engine with priority
    scheduling and a session cache: top-level ``priority`` by class, ``session_id`` = the run."""
    return {**body, "priority": CLIENT_PRIORITY.get(service_class, BACKGROUND), "session_id": run_id}


@dataclass
class Clock:
    """Wall time since the start, and the time scale to turn it into model seconds."""

    time_scale: float = 1.0
    started: float = field(default_factory=time.monotonic)

    def now(self) -> float:
        """Model seconds since the start."""
        return (time.monotonic() - self.started) / self.time_scale

    async def sleep(self, model_seconds: float) -> None:
        await asyncio.sleep(max(0.0, model_seconds * self.time_scale))


class TurnFailed(Exception):
    pass


@dataclass
class Live:
    """Counters the progress display reads."""

    turns_in_flight: int = 0
    runs_started: int = 0
    runs_done: int = 0
    errors: int = 0
    turns_visible: bool = True  # False for MCP sub-agents, whose turns the runtime makes
    close_statuses: dict[str, int] = field(default_factory=dict)  # a router's answers to /close_session, by status


async def stream_turn(session: aiohttp.ClientSession, target: Target, body: dict[str, Any], headers: dict[str, str],
                      clock: Clock) -> tuple[dict[str, Any], TurnRecord]:
    """One streamed turn: the assistant message and what the turn measured."""
    started = clock.now()
    for attempt in range(MAX_429_RETRIES + 1):
        async with session.post(f"{target.base_url}/chat/completions", json=body, headers=headers) as response:
            if response.status == 429 and attempt < MAX_429_RETRIES:
                await asyncio.sleep(float(response.headers.get("Retry-After", "1")))
                continue
            if response.status != 200:
                raise TurnFailed(f"HTTP {response.status}: {(await response.text())[:200]}")
            return await _read_stream(response, started, clock)
    raise TurnFailed("too many 429s")


async def _read_stream(response: aiohttp.ClientResponse, started: float, clock: Clock
                       ) -> tuple[dict[str, Any], TurnRecord]:
    first_token: float | None = None
    content: list[str] = []
    call: dict[str, Any] | None = None
    usage: dict[str, Any] = {}
    finish = ""
    async for raw in response.content:
        if not raw.startswith(b"data: "):
            continue
        payload = raw[6:].strip()
        if payload == b"[DONE]":
            break
        chunk = json.loads(payload)
        first_token = first_token or clock.now()
        usage = chunk.get("usage") or usage
        for choice in chunk.get("choices") or []:
            delta = choice.get("delta") or {}
            content.append(delta.get("content") or "")
            for piece in delta.get("tool_calls") or []:
                call = call or {"id": "", "type": "function", "function": {"name": "", "arguments": ""}}
                function = piece.get("function") or {}
                call["id"] = piece.get("id") or call["id"]
                call["function"]["name"] += function.get("name") or ""
                call["function"]["arguments"] += function.get("arguments") or ""
            finish = choice.get("finish_reason") or finish
    else:
        raise TurnFailed("stream ended without [DONE]")
    message: dict[str, Any] = {"role": "assistant", "content": "".join(content) or None,
                               **({"tool_calls": [call]} if call is not None else {})}
    details, now = usage.get("prompt_tokens_details") or {}, clock.now()
    return message, TurnRecord(started=started, first_token=(first_token or now) - started, duration=now - started,
                               prompt_tokens=int(usage.get("prompt_tokens") or 0),
                               cached_tokens=int(details.get("cached_tokens") or 0),
                               completion_tokens=int(usage.get("completion_tokens") or 0), finish_reason=finish)


async def run_once(session: aiohttp.ClientSession, target: Target, workload: Workload, seed: str, clock: Clock,
                   live: Live, run_id: str | None = None) -> RunRecord:
    """One agent run to its final answer (or its first failure). ``seed`` decides the
    run's task and tool results; ``run_id`` (default: the seed) names it to luftpause."""
    plan, run_id = plan_run(workload, seed), run_id or seed
    messages: list[dict[str, Any]] = [{"role": "system", "content": SYSTEM_PROMPT},
                                      {"role": "user", "content": plan.task}]
    headers = {"x-luftpause-run-id": run_id, "x-luftpause-class": workload.service_class,
               "x-luftpause-caller": target.caller} if target.luftpause else {}
    record, calls = RunRecord(service_class=workload.service_class, seed=seed, started=clock.now()), 0
    live.runs_started += 1
    try:
        while True:
            body: dict[str, Any] = {"model": target.model, "messages": messages, "stream": True,
                                    "stream_options": {"include_usage": True}, "max_tokens": workload.max_tokens}
            if calls < plan.tool_calls:
                body["tools"] = [LOOKUP_TOOL]
            elif workload.answer_keeps_tools:
                body["tools"], body["tool_choice"] = [LOOKUP_TOOL], "none"
            body, extra = add_identity(body, target.peer_identity, run_id, workload.service_class)
            if target.client_hints:
                body = client_hints(body, run_id, workload.service_class)
            live.turns_in_flight += 1
            try:
                message, turn = await stream_turn(session, target, body, {**headers, **extra}, clock)
            finally:
                live.turns_in_flight -= 1
            record.turns.append(turn)
            messages.append(message)
            if not message.get("tool_calls"):
                break
            calls += 1
            await clock.sleep(plan.tool_delays[calls - 1] if calls <= plan.tool_calls else workload.tool_delay_s)
            size = plan.result_chars[calls - 1] if calls <= plan.tool_calls else workload.tool_result_chars
            messages.append({"role": "tool", "tool_call_id": message["tool_calls"][0]["id"],
                             "content": tool_result(seed, calls, size)})
        record.ok = True
    except (TurnFailed, aiohttp.ClientError, asyncio.TimeoutError, json.JSONDecodeError) as exc:
        record.error = f"{type(exc).__name__}: {exc}"[:300]
        live.errors += 1
    record.tool_calls, record.ended = calls, clock.now()
    live.runs_done += 1
    finish, root = finish_path(target.peer_identity, run_id), target.base_url.removesuffix("/v1")
    # The run is over: let the scheduler forget it now, as the runtime does; end its session at a peer router;
    # with client hints, close its session in the engines' cache (SGLang's route, asked of the router).
    for method, url, body in (("DELETE", f"{target.base_url}/runs/{run_id}" if target.luftpause else None, None),
                              ("POST", root + finish if finish is not None else None, None),
                              ("POST", f"{root}/close_session" if target.client_hints else None,
                               {"session_id": run_id})):
        if url is None:
            continue
        try:
            async with session.request(method, url, headers=headers if method == "DELETE" else None,
                                       json=body) as response:
                status = str(response.status)
        except aiohttp.ClientError:
            status = "error"
        if body is not None:  # the router's answers to /close_session, counted
            live.close_statuses[status] = live.close_statuses.get(status, 0) + 1
    return record


async def closed_loop(target: Target, workload: Workload, agents: int, until: float, clock: Clock, live: Live,
                      records: list[RunRecord], name: str, seed: str | None = None) -> None:
    """``agents`` concurrent agents, each starting a new run when one ends, until model
    time ``until``; runs still going then are cancelled (and not counted). Agent i's run k
    is seeded ``{seed}-{i}-{k}`` (``seed`` defaults to ``name``) and named ``{name}-{i}-{k}``:
    variants given one seed see the same runs."""
    seed = seed or name
    timeout = aiohttp.ClientTimeout(total=None, sock_connect=5)
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0), timeout=timeout) as session:

        async def agent(index: int) -> None:
            run = 0
            while clock.now() < until:
                record = await run_once(session, target, workload, f"{seed}-{index}-{run}", clock, live,
                                        run_id=f"{name}-{index}-{run}")
                records.append(record)
                run += 1
                if not record.ok:
                    await clock.sleep(1.0)  # do not spin on a failing target

        tasks = [asyncio.create_task(agent(i)) for i in range(agents)]
        _, pending = await asyncio.wait(tasks, timeout=max(0.0, (until - clock.now()) * clock.time_scale))
        for task in pending:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

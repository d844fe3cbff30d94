"""The fake engine's generative and one-pass endpoints: ``/v1/chat/completions`` (whole
or streamed), a native ``/v1/responses``, and vLLM's ``/classify``; each turn goes through
the simulator, with fault directives applied."""

from __future__ import annotations

import asyncio
import hashlib
import json
import math
import random
import re
import time
import uuid
from dataclasses import dataclass, replace
from typing import Any

import aiohttp
import structlog
from aiohttp import web

from luftpause.dataplane.responses_api import EventTranslator, ResponsesError, to_chat
from luftpause.fakes import faults as fault_directives
from luftpause.fakes import replies
from luftpause.fakes.faults import FaultError, Faults
from luftpause.fakes.replies import Envelope, Reply, ReplyRules, RequestError
from luftpause.fakes.sim import SimRequest

from luftpause.fakes.engine_config import EngineConfig
from luftpause.fakes.engine_state import STATE_KEY, EngineState

log = structlog.get_logger(service="fake-engine")


def idle_close(limit_s: float):
    """Keep-alive as a real engine's server ends it, at its worst: a request that arrives
    on a connection idle for longer than ``limit_s`` finds it closed (llama-server keeps
    idle connections 5 s, uvicorn 5 s) — the race in which a client's pooled connection
    was closed by the server just as the client sent a request on it. The request is
    dropped unanswered and counted in ``/stats`` as ``stale_dropped``."""
    last_used: dict[Any, float] = {}

    @web.middleware
    async def middleware(request: web.Request, handler):
        peer = request.transport.get_extra_info("peername") if request.transport is not None else None
        previous = last_used.pop(peer, None)
        if previous is not None and time.monotonic() - previous > limit_s:
            request.app[STATE_KEY].stale_dropped += 1
            log.info("chat.stale_connection_dropped", idle_s=round(time.monotonic() - previous, 3))
            if request.transport is not None:
                request.transport.abort()
            return web.Response(status=500)  # never reaches the client: its connection is gone
        try:
            return await handler(request)
        finally:
            last_used[peer] = time.monotonic()

    return middleware


def request_error(err: RequestError) -> web.Response:
    return web.json_response(err.body(), status=err.status)


# A JSON escape of a UTF-16 surrogate (``\ud800``): valid JSON, and lone it is no text.
SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")


def _text_only(value: Any) -> Any:
    """``value`` with every lone surrogate in its strings replaced by U+FFFD, as a tokenizer
    reading bytes does: such a string cannot be encoded, and the engine must still serve it."""
    if isinstance(value, str):
        return value.encode("utf-8", "surrogatepass").decode("utf-8", "replace")
    if isinstance(value, list):
        return [_text_only(item) for item in value]
    if isinstance(value, dict):
        return {_text_only(key): _text_only(item) for key, item in value.items()}
    return value


async def read_json(request: web.Request) -> Any:
    raw = await request.read()
    try:
        document = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise RequestError(f"malformed JSON body: {exc}") from exc
    except RecursionError as exc:
        raise RequestError("malformed JSON body: nested too deep") from exc
    return _text_only(document) if SURROGATE_ESCAPE.search(raw) else document


def _seeded_rng(seed: int, text: str) -> random.Random:
    """Randomness that depends on the seed and the prompt, not on arrival order."""
    digest = hashlib.blake2b(f"{seed}\x1f{text}".encode(), digest_size=8).digest()
    return random.Random(int.from_bytes(digest, "big"))


def _reply_rules(config: EngineConfig, prompt_text: str) -> ReplyRules:
    rules = config.rules()
    if config.reply_spread <= 0:
        return rules
    factor = _seeded_rng(config.seed, prompt_text).lognormvariate(0.0, config.reply_spread)
    return replace(rules, reply_tokens=max(1, round(rules.reply_tokens * factor)))


@dataclass
class Turn:
    """One chat request on its way through the simulator."""

    request: web.Request
    state: EngineState
    body: dict[str, Any]
    reply: Reply
    envelope: Envelope
    faults: Faults
    top_logprobs: int | None
    sim_request: SimRequest | None = None
    progress: asyncio.Event | None = None
    offset: int = 0  # where in the whole reply this one starts (a continuation): faults count from there
    priority: int | None = None  # the request's, when the engine schedules by priority
    session_id: str | None = None  # the request's, with --enable-session-radix-cache

    def after(self, count: int | None) -> int | None:
        """A fault's "after N chunks" within this reply: None once a continuation is past it."""
        if count is None or (self.offset and count <= self.offset):
            return None
        return count - self.offset

    def submit(self, prompt_text: str) -> None:
        reply_text = replies.render_message(self.reply.assistant_message())
        cap = replies.completion_cap(self.body)
        self.sim_request, self.progress = self.state.sim.submit(
            self.envelope.model, prompt_text, self.reply.completion_tokens, cap, reply_text, self.priority,
            self.session_id)

    async def wait(self) -> None:
        assert self.progress is not None
        await self.progress.wait()
        self.progress.clear()

    def accounted_reply(self) -> Reply:
        r = self.sim_request
        assert r is not None
        return replace(self.reply, prompt_tokens=r.prompt_tokens, cached_tokens=r.cached_tokens)

    def logprobs(self, deltas: list[dict[str, Any]], start: int) -> dict[str, Any] | None:
        """``logprobs`` of a chunk (or the whole reply) holding ``deltas`` from ``start``."""
        if self.top_logprobs is None:
            return None
        tokens = [replies.delta_text(d) for d in deltas]
        candidates = replies.logprob_candidates(self.body["messages"])
        seed = f"{self.state.config.seed}:{replies.render_prompt(self.body)[-200:]}"
        return {"content": replies.logprob_entries(tokens, candidates, self.top_logprobs, seed, start)}


def scheduling_fields(body: dict[str, Any], config: EngineConfig) -> tuple[int | None, str | None]:
    """The request's top-level ``priority`` and ``session_id``, each read only when a flag
    of the engine gives it a meaning (vLLM's ``--scheduling-policy priority`` or SGLang's
    ``--enable-priority-scheduling``; SGLang's ``--enable-session-radix-cache``), as the
    engines' request models type them (an integer; a string). Without the flags they are
    ignored whatever they hold: the request is served as if it had neither."""
    priority = session_id = None
    if config.scheduling_policy == "priority" or config.enable_priority_scheduling:
        priority = body.get("priority")
        if priority is not None and (isinstance(priority, bool) or not isinstance(priority, int)):
            raise RequestError("priority must be an integer")
    if config.enable_session_radix_cache:
        session_id = body.get("session_id")
        if session_id is not None and not isinstance(session_id, str):
            raise RequestError("session_id must be a string")
    return priority, session_id


async def chat_completions(request: web.Request) -> web.StreamResponse:
    """``POST /v1/chat/completions``: validate, queue in the simulator, answer.

    A streamed answer sends its headers before queueing, as engines behind an ASGI
    server do, so a client can be connected and waiting; a client that goes away at any
    point is counted in ``closed_early`` and frees its batch place or queue place at once.
    """
    state = request.app[STATE_KEY]
    state.requests += 1
    try:
        body = await read_json(request)
        replies.validate(body, state.config.models)
        faults = state.faults.merged(fault_directives.from_messages(body["messages"]))
        top_logprobs = replies.logprobs_request(body)
        continued = replies.continuation(body)
        priority, session_id = scheduling_fields(body, state.config)
        state.sim.fields_seen.observe(priority, session_id)
    except RequestError as err:
        log.info("chat_rejected", status=err.status, reason=str(err))
        return request_error(err)
    except FaultError as err:
        log.info("chat_rejected", status=400, reason=str(err))
        return request_error(RequestError(str(err)))
    status = fault_directives.error_status(faults, body["messages"], state.status_counter)
    if status is not None:
        log.info("chat_fault_status", status=status)
        return web.json_response(fault_directives.error_body(status), status=status,
                                 headers=faults.error_headers(status))
    turn, prompt_text = _planned_turn(request, body, faults, top_logprobs, continued, priority, session_id)
    started = time.monotonic()
    log.info("chat_request", id=turn.envelope.id, model=turn.envelope.model, stream=bool(body.get("stream")))
    if faults.wedge:
        log.warning("engine_wedged", id=turn.envelope.id)
        state.faults = state.faults.merged(Faults(hang=True))
        state.sim.set_gate(False)
    try:
        response = await _answer(turn, prompt_text)
    except _Aborted:
        log.info("chat_aborted", id=turn.envelope.id, after_s=round(time.monotonic() - started, 3))
        return web.Response(status=500)  # never reaches the client: its connection is gone
    except (asyncio.CancelledError, ConnectionResetError):
        state.closed_early += 1
        log.info("chat_closed_early", id=turn.envelope.id, after_s=round(time.monotonic() - started, 3))
        raise
    finally:
        if turn.sim_request is not None:
            state.sim.forget(turn.sim_request)
    _log_done(turn, started)
    return response


def _planned_turn(request: web.Request, body: dict[str, Any], faults: Faults, top_logprobs: int | None,
                  continued: tuple[dict[str, Any], str] | None, priority: int | None,
                  session_id: str | None) -> tuple[Turn, str]:
    """The turn a validated request asks for, its reply planned, and the prompt text it
    queues with: a continued assistant message (``continued``) is answered from where it
    stopped, its prompt left open."""
    state = request.app[STATE_KEY]
    prompt_text = replies.render_prompt(body)
    offset = 0  # the reply's words a continued assistant message already held
    if continued is None:
        reply = replies.plan_reply(body, _reply_rules(state.config, prompt_text), faults)
    else:  # the reply the conversation before it gets, from where the message stopped
        before, prefix = continued
        reply, offset = replies.plan_continuation(
            body, before, prefix, _reply_rules(state.config, replies.render_prompt(before)), faults)
        prompt_text = prompt_text.removesuffix("<|end|>")  # the final message is left open
    turn = Turn(request, state, body, reply, Envelope.new(body["model"]), faults, top_logprobs, offset=offset,
                priority=priority, session_id=session_id)
    return turn, prompt_text


async def _answer(turn: Turn, prompt_text: str) -> web.StreamResponse:
    """The turn answered as its faults and its ``stream`` ask: never (a hang, a wedged
    engine, a stall with no stream to stall in), streamed, or whole."""
    faults, body = turn.faults, turn.body
    if faults.hang or faults.wedge or (faults.stall_after is not None and not body.get("stream")):
        return await _hang(turn.request, turn.state)
    if body.get("stream"):
        return await _stream(turn, prompt_text, replies.wants_usage_chunk(body))
    return await _complete(turn, prompt_text)


def _log_done(turn: Turn, started: float) -> None:
    """The finished turn's line: its tokens as the simulator counted them (as planned, if it
    never reached the simulator), the replica that served it and the scheduling fields it
    was served with (None where the engine's flags give them no meaning)."""
    reply, r = turn.reply, turn.sim_request
    log.info(
        "chat.done",
        id=turn.envelope.id,
        replica=turn.state.config.name,
        priority=turn.priority,
        session_id=turn.session_id,
        finish_reason=reply.finish_reason,
        prompt_tokens=r.prompt_tokens if r else reply.prompt_tokens,
        cached_tokens=r.cached_tokens if r else 0,
        completion_tokens=reply.completion_tokens,
        duration_s=round(time.monotonic() - started, 3),
    )


async def responses(request: web.Request) -> web.StreamResponse:
    """``POST /v1/responses``, served natively as vLLM serves it: over the engine's own chat
    machinery. The request goes as a chat completion to this same engine (the same queue,
    cache and pace) and its reply comes back as a Response or its event stream."""
    state = request.app[STATE_KEY]
    state.responses_requests += 1
    try:
        document = await read_json(request)
        chat = to_chat(document if isinstance(document, dict) else {})
    except RequestError as err:
        return request_error(err)
    except ResponsesError as err:
        return web.json_response(err.body(), status=err.status)
    _forward_scheduling_fields(document, chat.body, state.config)
    own = f"http://{request.host}/v1/chat/completions"
    async with aiohttp.ClientSession() as session, session.post(own, json=chat.body) as upstream:
        if upstream.status != 200 or not chat.body["stream"]:
            body = await upstream.read()
            if upstream.status == 200:
                body = chat.shell.response_body(json.loads(body))
            return web.Response(status=upstream.status, body=body, content_type="application/json")
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        events = EventTranslator(chat.shell)
        await response.write(events.start())
        async for piece in upstream.content.iter_any():
            if out := events.feed(piece):
                await response.write(out)
        await response.write_eof()
        return response


def _forward_scheduling_fields(document: Any, body: dict[str, Any], config: EngineConfig) -> None:
    """A Responses request's top-level ``priority`` and ``session_id`` go on to the chat
    request this endpoint is served by (SGLang wires ``session_id`` through its Responses
    entry point too), when a flag of the engine gives them a meaning; without, the chat
    request is left as it was."""
    if not isinstance(document, dict):
        return
    if (config.scheduling_policy == "priority" or config.enable_priority_scheduling) and "priority" in document:
        body["priority"] = document["priority"]
    if config.enable_session_radix_cache and "session_id" in document:
        body["session_id"] = document["session_id"]


class _Aborted(Exception):
    """The connection was aborted on purpose (``[[fake:die-after=N]]``)."""


def _abort(request: web.Request) -> None:
    """Drop the TCP connection at once, with no further bytes (a crashed engine)."""
    if request.transport is not None:
        request.transport.abort()
    raise _Aborted


async def _hang(request: web.Request, state: EngineState) -> web.StreamResponse:
    """Never answer; the client's disconnect cancels this (counted in ``closed_early``).

    Bounded by ``hang_limit_s`` so a forgotten client cannot pin the handler forever.
    """
    await asyncio.sleep(state.config.hang_limit_s)
    _abort(request)
    raise AssertionError("unreachable")


async def _complete(turn: Turn, prompt_text: str) -> web.Response:
    """Non-streaming: the same prefill and decode time, delivered in one body."""
    turn.submit(prompt_text)
    request = turn.sim_request
    assert request is not None
    while request.state not in ("finished", "aborted"):
        await turn.wait()
        if turn.faults.die_after is not None and request.prefilled:
            _abort(turn.request)
    reply = turn.accounted_reply()
    pieces = list(replies.stream_pieces(reply))
    return web.json_response(replies.completion_body(reply, turn.envelope, turn.logprobs(pieces, 0)))


async def _stream(turn: Turn, prompt_text: str, include_usage: bool) -> web.StreamResponse:
    """SSE: role chunk once prefilled, then the reply's pieces as tokens are generated
    (every ``stream_interval`` tokens), then the closing chunks and ``[DONE]``.

    A client that goes away surfaces as ``ConnectionResetError`` on the next write, or
    at once as cancellation when the server runs with ``handler_cancellation`` (as
    ``main`` does).
    """
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
    await response.prepare(turn.request)
    turn.submit(prompt_text)
    request = turn.sim_request
    assert request is not None
    pieces = list(replies.stream_pieces(turn.reply))
    interval = max(1, turn.state.config.stream_interval)
    sent_pieces, sent_tokens, role_sent = 0, 0, False
    die_after, stall_after = turn.after(turn.faults.die_after), turn.after(turn.faults.stall_after)
    while True:
        await turn.wait()
        if request.state == "aborted":
            raise ConnectionResetError("request aborted")
        if not request.prefilled:
            continue
        if not role_sent:
            await _send(response, turn.envelope.chunk({"role": "assistant", "content": ""}))
            role_sent = True
        finished = request.state == "finished"
        if not finished and request.generated - sent_tokens < interval:
            continue
        due = _pieces_due(request, len(pieces), finished, die_after, stall_after)
        for start in range(sent_pieces, due, interval):  # one chunk per interval's worth of pieces
            batch = pieces[start : min(due, start + interval)]
            await _send(response, turn.envelope.chunk(replies.merge_deltas(batch),
                                                      logprobs=turn.logprobs(batch, start)))
        sent_pieces, sent_tokens = max(sent_pieces, due), request.generated
        if die_after is not None and (sent_pieces >= die_after or finished):
            _abort(turn.request)
        if stall_after is not None and (sent_pieces >= stall_after or finished):
            await _hang(turn.request, turn.state)
        if finished:
            break
    for chunk in replies.closing_chunks(turn.accounted_reply(), turn.envelope, include_usage):
        await _send(response, chunk)
    await response.write(b"data: [DONE]\n\n")
    if turn.faults.linger_after_done_ms:
        await asyncio.sleep(turn.faults.linger_after_done_ms / 1000)
    await response.write_eof()
    return response


def _pieces_due(request: SimRequest, count: int, finished: bool, *limits: int | None) -> int:
    """How many of a reply's ``count`` pieces its generated tokens cover (all of them once
    it is finished), never more than a fault's limit (``die-after``, ``stall-after``)."""
    total = max(1, request.reply_tokens)
    due = count if finished else min(count, math.floor(request.generated * count / total))
    return min([due, *(limit for limit in limits if limit is not None)])


async def _send(response: web.StreamResponse, chunk: dict[str, Any]) -> None:
    await response.write(b"data: " + json.dumps(chunk).encode() + b"\n\n")


# --- one-pass classification (vLLM /classify) ------------------------------------------


def _class_probs(config: EngineConfig, text: str) -> list[float]:
    rng = _seeded_rng(config.seed, "classify\x1f" + text)
    scores = [rng.gauss(0.0, 1.5) for _ in config.labels]
    top = max(scores)
    weights = [math.exp(s - top) for s in scores]
    total = sum(weights)
    return [w / total for w in weights]


async def classify(request: web.Request) -> web.Response:
    """``POST /classify`` (vLLM): ``{"model", "input": str | [str]}`` → one label per input.

    Each input is a prefill-only request through the same batch and KV pool as chat
    turns, so classifying costs engine time like on a real replica.
    """
    state = request.app[STATE_KEY]
    state.requests += 1
    try:
        body = await read_json(request)
        if not isinstance(body, dict):
            raise RequestError("request body must be a JSON object")
        model = body.get("model")
        if model is not None and model not in state.config.models:
            raise RequestError(f"The model `{model}` does not exist.", status=404, code="model_not_found")
        inputs = body.get("input")
        if isinstance(inputs, str):
            inputs = [inputs]
        if not isinstance(inputs, list) or not inputs or not all(isinstance(i, str) for i in inputs):
            raise RequestError("input must be a string or a non-empty list of strings")
    except RequestError as err:
        return request_error(err)
    model_name = model or state.config.models[0]
    submitted = [state.sim.submit(model_name, text, 0, 0) for text in inputs]
    try:
        for sim_request, progress in submitted:
            while sim_request.state not in ("finished", "aborted"):
                await progress.wait()
                progress.clear()
    except asyncio.CancelledError:
        state.closed_early += 1
        raise
    finally:
        for sim_request, _ in submitted:
            state.sim.forget(sim_request)
    data = []
    for index, text in enumerate(inputs):
        probs = _class_probs(state.config, text)
        best = max(range(len(probs)), key=probs.__getitem__)
        data.append({"index": index, "label": state.config.labels[best], "probs": probs,
                     "num_classes": len(probs)})
    prompt = sum(r.prompt_tokens for r, _ in submitted)
    return web.json_response({
        "id": "classify-" + uuid.uuid4().hex,
        "object": "list",
        "created": int(time.time()),
        "model": model_name,
        "data": data,
        "usage": {"prompt_tokens": prompt, "total_tokens": prompt, "completion_tokens": 0},
    })

"""Fake LLM inference engine: an OpenAI-compatible aiohttp server without a model.

It stands in for SGLang/vLLM on machines without a GPU. Replies come from
:mod:`luftpause.fakes.replies` (tool calls while tools are offered, then text); this
module adds what makes it behave like a serving engine from the outside: time to first
token, per-token pacing, a bounded running batch with a FIFO wait queue, Prometheus
``/metrics`` in SGLang's (or vLLM's) names, and counters at ``/stats`` that tests use to
see what really reached the engine. It knows nothing about luftpause's headers.

Run it with ``python -m luftpause.fakes.engine --help``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import time
from collections import deque
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import structlog
from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from luftpause import logs
from luftpause.fakes import faults as fault_directives
from luftpause.fakes import replies
from luftpause.fakes.faults import FaultError, Faults, StatusCounter
from luftpause.fakes.replies import Envelope, Reply, ReplyRules, RequestError

log = structlog.get_logger(service="fake-engine")

ENV_PREFIX = "LUFTPAUSE_FAKE_ENGINE_"


@dataclass(frozen=True)
class EngineConfig:
    """Everything the engine's behaviour depends on (one field per CLI option)."""

    host: str = "127.0.0.1"
    port: int = 9001
    name: str = "fake-engine"
    models: tuple[str, ...] = ("fake-llama-1b",)
    tool_calls: int = 2
    latency_ms: float = 20.0
    token_ms: float = 2.0
    max_running: int = 0
    reply_tokens: int = 12
    kv_tokens: int = 65536
    metrics_format: str = "sglang"
    faults: tuple[str, ...] = ()  # engine-wide fault directives, e.g. ("status=503",)
    hang_limit_s: float = 3600.0  # a [[fake:hang]] request is dropped after this long

    def engine_faults(self) -> Faults:
        return fault_directives.parse(fault_directives.parse_option(f) for f in self.faults)

    def rules(self) -> ReplyRules:
        return ReplyRules(tool_calls=self.tool_calls, reply_tokens=self.reply_tokens)


# --- batch admission ----------------------------------------------------------------


class BatchGate:
    """At most ``limit`` requests generate at once; later ones wait in arrival order.

    ``asyncio.Semaphore`` does not promise FIFO hand-over, and queue order is exactly
    what a scheduler in front of the engine observes, so the queue is explicit.
    ``limit <= 0`` means an unbounded batch (nobody ever waits).
    """

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.running = 0
        self._waiters: deque[asyncio.Future[None]] = deque()

    @property
    def queued(self) -> int:
        return len(self._waiters)

    async def acquire(self) -> None:
        if not self._waiters and (self.limit <= 0 or self.running < self.limit):
            self.running += 1
            return
        waiter: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiters.append(waiter)
        try:
            await waiter  # release() counts us as running before resolving the future
        except asyncio.CancelledError:
            if waiter.done() and not waiter.cancelled():
                self.release()  # admitted and cancelled in the same instant: pass it on
            elif waiter in self._waiters:
                self._waiters.remove(waiter)
            raise

    def release(self) -> None:
        self.running -= 1
        while self._waiters and (self.limit <= 0 or self.running < self.limit):
            waiter = self._waiters.popleft()
            if not waiter.done():
                self.running += 1
                waiter.set_result(None)


# --- engine state -------------------------------------------------------------------


@dataclass
class Generation:
    """One request inside the running batch, for the KV usage gauge."""

    model: str
    prompt_tokens: int
    generated: int = 0


@dataclass
class EngineState:
    """Counters and the batch, shared by all handlers of one app."""

    config: EngineConfig
    gate: BatchGate
    requests: int = 0
    closed_early: int = 0
    queued_by_model: dict[str, int] = field(default_factory=dict)
    running: dict[int, Generation] = field(default_factory=dict)
    faults: Faults = field(default_factory=Faults)
    status_counter: StatusCounter = field(default_factory=StatusCounter)

    def stats(self) -> dict[str, int]:
        """``/stats``: requests that arrived (valid or not), the batch now, and requests
        whose client disconnected before the response was complete."""
        return {
            "requests": self.requests,
            "running": self.gate.running,
            "queued": self.gate.queued,
            "closed_early": self.closed_early,
        }

    def running_for(self, model: str) -> int:
        return sum(1 for g in self.running.values() if g.model == model)

    def token_usage(self) -> float:
        """Share of the KV budget held by the batch: prompt plus tokens generated so far."""
        used = sum(g.prompt_tokens + g.generated for g in self.running.values())
        return min(1.0, used / self.config.kv_tokens) if self.config.kv_tokens > 0 else 0.0


STATE_KEY = web.AppKey("engine_state", EngineState)


class EngineCollector(Collector):
    """Renders gauges from live state at scrape time, in SGLang's or vLLM's names."""

    def __init__(self, state: EngineState) -> None:
        self.state = state

    def collect(self) -> Iterator[GaugeMetricFamily]:
        names = _METRIC_NAMES[self.state.config.metrics_format]
        families = {key: GaugeMetricFamily(name, doc, labels=["model_name"]) for key, (name, doc) in names.items()}
        for model in self.state.config.models:
            values = {
                "running": self.state.running_for(model),
                "queued": self.state.queued_by_model.get(model, 0),
                "token_usage": self.state.token_usage(),
                "cache_hit_rate": 0.0,  # no prefix cache is simulated yet
            }
            for key, family in families.items():
                family.add_metric([model], values[key])
        yield from families.values()


_METRIC_NAMES: dict[str, dict[str, tuple[str, str]]] = {
    "sglang": {
        "running": ("sglang:num_running_reqs", "The number of running requests."),
        "queued": ("sglang:num_queue_reqs", "The number of requests in the waiting queue."),
        "token_usage": ("sglang:token_usage", "The token usage (share of the KV cache in use)."),
        "cache_hit_rate": ("sglang:cache_hit_rate", "The prefix cache hit rate."),
    },
    "vllm": {
        "running": ("vllm:num_requests_running", "Number of requests in model execution batches."),
        "queued": ("vllm:num_requests_waiting", "Number of requests waiting to be processed."),
        "token_usage": ("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage."),
    },
}


# --- HTTP handlers ------------------------------------------------------------------


def _error(err: RequestError) -> web.Response:
    return web.json_response(err.body(), status=err.status)


async def _read_body(request: web.Request) -> dict[str, Any]:
    try:
        body = json.loads(await request.read())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise RequestError(f"malformed JSON body: {exc}") from exc
    state = request.app[STATE_KEY]
    replies.validate(body, state.config.models)
    return body


async def chat_completions(request: web.Request) -> web.StreamResponse:
    """``POST /v1/chat/completions``: validate, wait for a batch slot, answer.

    A streamed answer sends its headers before queueing, as engines behind an ASGI
    server do, so a client can be connected and waiting; a client that goes away at any
    point is counted in ``closed_early`` and frees its slot or queue place at once.
    """
    state = request.app[STATE_KEY]
    state.requests += 1
    try:
        body = await _read_body(request)
        faults = state.faults.merged(fault_directives.from_messages(body["messages"]))
    except RequestError as err:
        log.info("chat.rejected", status=err.status, reason=str(err))
        return _error(err)
    except FaultError as err:
        log.info("chat.rejected", status=400, reason=str(err))
        return _error(RequestError(str(err)))
    status = fault_directives.error_status(faults, body["messages"], state.status_counter)
    if status is not None:
        log.info("chat.fault_status", status=status)
        return web.json_response(fault_directives.error_body(status), status=status,
                                 headers=faults.error_headers(status))
    reply = replies.plan_reply(body, state.config.rules(), faults)
    envelope = Envelope.new(body["model"])
    started = time.monotonic()
    log.info("chat.request", id=envelope.id, model=envelope.model, stream=bool(body.get("stream")))
    try:
        if faults.hang:
            response = await _hang(request, state)
        elif body.get("stream"):
            response = await _stream(request, state, envelope, reply, replies.wants_usage_chunk(body),
                                     faults.die_after)
        else:
            response = await _complete(request, state, envelope, reply, faults.die_after is not None)
    except _Aborted:
        log.info("chat.aborted", id=envelope.id, after_s=round(time.monotonic() - started, 3))
        return web.Response(status=500)  # never reaches the client: its connection is gone
    except (asyncio.CancelledError, ConnectionResetError):
        state.closed_early += 1
        log.info("chat.closed_early", id=envelope.id, after_s=round(time.monotonic() - started, 3))
        raise
    log.info(
        "chat.done",
        id=envelope.id,
        finish_reason=reply.finish_reason,
        prompt_tokens=reply.prompt_tokens,
        completion_tokens=reply.completion_tokens,
        duration_s=round(time.monotonic() - started, 3),
    )
    return response


class _BatchSlot:
    """Hold a batch slot (waiting FIFO for one first) and account for it in the gauges."""

    def __init__(self, state: EngineState, envelope: Envelope, reply: Reply) -> None:
        self.state, self.model = state, envelope.model
        self.generation = Generation(model=envelope.model, prompt_tokens=reply.prompt_tokens)

    async def __aenter__(self) -> Generation:
        queued = self.state.queued_by_model
        queued[self.model] = queued.get(self.model, 0) + 1
        try:
            await self.state.gate.acquire()
        finally:
            queued[self.model] -= 1
        self.state.running[id(self.generation)] = self.generation
        return self.generation

    async def __aexit__(self, *exc: object) -> None:
        self.state.running.pop(id(self.generation), None)
        self.state.gate.release()


async def _sleep_ms(ms: float) -> None:
    if ms > 0:
        await asyncio.sleep(ms / 1000)


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


async def _complete(
    request: web.Request, state: EngineState, envelope: Envelope, reply: Reply, die: bool = False
) -> web.Response:
    """Non-streaming: the same prefill and decode time, delivered in one body."""
    async with _BatchSlot(state, envelope, reply) as generation:
        await _sleep_ms(state.config.latency_ms)
        if die:
            _abort(request)
        for _ in range(reply.completion_tokens):
            await _sleep_ms(state.config.token_ms)
            generation.generated += 1
    return web.json_response(replies.completion_body(reply, envelope))


async def _stream(
    request: web.Request,
    state: EngineState,
    envelope: Envelope,
    reply: Reply,
    include_usage: bool,
    die_after: int | None = None,
) -> web.StreamResponse:
    """SSE: role chunk after the prefill latency, then one chunk per token, then ``[DONE]``.

    A client that goes away surfaces as ``ConnectionResetError`` on the next write, or
    at once as cancellation when the server runs with ``handler_cancellation`` (as
    ``main`` does).
    """
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
    await response.prepare(request)
    async with _BatchSlot(state, envelope, reply) as generation:
        await _sleep_ms(state.config.latency_ms)
        await _send(response, envelope.chunk({"role": "assistant", "content": ""}))
        for sent, delta in enumerate(replies.stream_pieces(reply)):
            if sent == die_after:
                _abort(request)
            await _sleep_ms(state.config.token_ms)
            await _send(response, envelope.chunk(delta))
            generation.generated += 1
        if die_after is not None:  # a reply shorter than N chunks still dies before finishing
            _abort(request)
    for chunk in replies.closing_chunks(reply, envelope, include_usage):
        await _send(response, chunk)
    await response.write(b"data: [DONE]\n\n")
    await response.write_eof()
    return response


async def _send(response: web.StreamResponse, chunk: dict[str, Any]) -> None:
    await response.write(b"data: " + json.dumps(chunk).encode() + b"\n\n")


async def models(request: web.Request) -> web.Response:
    config = request.app[STATE_KEY].config
    created = int(time.time())
    data = [{"id": m, "object": "model", "created": created, "owned_by": config.name} for m in config.models]
    return web.json_response({"object": "list", "data": data})


async def health(request: web.Request) -> web.Response:
    return web.json_response({"status": "ok"})


async def stats(request: web.Request) -> web.Response:
    return web.json_response(request.app[STATE_KEY].stats())


async def metrics(request: web.Request) -> web.Response:
    registry = request.app[REGISTRY_KEY]
    return web.Response(body=generate_latest(registry), headers={"Content-Type": CONTENT_TYPE_LATEST})


REGISTRY_KEY = web.AppKey("metrics_registry", CollectorRegistry)


def create_app(config: EngineConfig) -> web.Application:
    """The engine as an aiohttp app, for ``main`` and for in-process tests."""
    if config.metrics_format not in _METRIC_NAMES:
        raise ValueError(f"metrics_format must be one of {sorted(_METRIC_NAMES)}")
    state = EngineState(config=config, gate=BatchGate(config.max_running), faults=config.engine_faults())
    registry = CollectorRegistry(auto_describe=True)
    registry.register(EngineCollector(state))
    app = web.Application()
    app[STATE_KEY] = state
    app[REGISTRY_KEY] = registry
    app.router.add_post("/v1/chat/completions", chat_completions)
    app.router.add_get("/v1/models", models)
    app.router.add_get("/health", health)
    app.router.add_get("/stats", stats)
    app.router.add_get("/metrics", metrics)
    return app


# --- command line -------------------------------------------------------------------


def _env(name: str, default: object) -> str:
    return os.environ.get(ENV_PREFIX + name, str(default))


def parse_args(argv: Sequence[str] | None = None) -> EngineConfig:
    """CLI options, each defaulting to ``LUFTPAUSE_FAKE_ENGINE_<OPTION>`` from the environment."""
    d = EngineConfig()
    p = argparse.ArgumentParser(
        prog="python -m luftpause.fakes.engine",
        description="Fake OpenAI-compatible LLM engine (no model): paced replies, a bounded batch, /metrics.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )

    def option(flag: str, env: str, kind: type, default: object, text: str) -> None:
        p.add_argument(flag, type=kind, default=kind(_env(env, default)), help=f"{text} [env {ENV_PREFIX}{env}]")

    option("--host", "HOST", str, d.host, "address to listen on")
    option("--port", "PORT", int, d.port, "TCP port to listen on")
    option("--name", "NAME", str, d.name, "engine name used in logs and as owned_by in /v1/models")
    option("--models", "MODELS", str, ",".join(d.models), "comma-separated model names served")
    option("--tool-calls", "TOOL_CALLS", int, d.tool_calls,
           "answer with a tool call while tools are offered and the conversation has fewer than N "
           "assistant tool-call turns; text afterwards")  # fmt: skip
    option("--latency-ms", "LATENCY_MS", float, d.latency_ms, "time to first token (prefill), ms")
    option("--token-ms", "TOKEN_MS", float, d.token_ms, "delay between streamed token chunks, ms")
    option("--max-running", "MAX_RUNNING", int, d.max_running,
           "most requests generating at once; others wait FIFO (reported as queue); 0 = unlimited")  # fmt: skip
    option("--reply-tokens", "REPLY_TOKENS", int, d.reply_tokens, "words (tokens) in a text reply")
    option("--kv-tokens", "KV_TOKENS", int, d.kv_tokens, "KV cache size in tokens, for the token_usage gauge")
    p.add_argument(
        "--metrics-format",
        choices=sorted(_METRIC_NAMES),
        default=_env("METRICS_FORMAT", d.metrics_format),
        help=f"Prometheus metric names to expose [env {ENV_PREFIX}METRICS_FORMAT]",
    )
    p.add_argument("--fault", action="append", default=[], metavar="DIRECTIVE",
                   help="engine-wide fault directive, repeatable: status=503, status-times=429:2, "
                        "retry-after=3, die-after=4, hang, tool-call-as-text, schema-as-arguments, "
                        "string-scalars (the same as [[fake:...]] in a message)")
    a = p.parse_args(argv)
    try:
        fault_directives.parse(fault_directives.parse_option(f) for f in a.fault)
    except FaultError as err:
        p.error(str(err))
    model_names = tuple(m.strip() for m in a.models.split(",") if m.strip())
    if not model_names:
        p.error("--models needs at least one name")
    return EngineConfig(
        host=a.host,
        port=a.port,
        name=a.name,
        models=model_names,
        tool_calls=a.tool_calls,
        latency_ms=a.latency_ms,
        token_ms=a.token_ms,
        max_running=a.max_running,
        reply_tokens=a.reply_tokens,
        kv_tokens=a.kv_tokens,
        metrics_format=a.metrics_format,
        faults=tuple(a.fault),
    )


def main(argv: Sequence[str] | None = None) -> None:
    config = parse_args(argv)
    logs.configure("fake-engine")
    structlog.contextvars.bind_contextvars(engine=config.name)
    log.info("engine.start", **asdict(config))
    web.run_app(
        create_app(config),
        host=config.host,
        port=config.port,
        access_log=None,
        print=None,
        handler_cancellation=True,  # a client disconnect cancels its request, as in real engines
        shutdown_timeout=1.0,
    )


if __name__ == "__main__":
    main()

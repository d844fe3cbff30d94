"""Fake LLM inference engine: an OpenAI-compatible aiohttp server without a model.

It stands in for SGLang/vLLM on machines without a GPU. What it answers comes from
:mod:`luftpause.fakes.replies` (tool calls while tools are offered, then text); when it
answers comes from :mod:`luftpause.fakes.sim`, a continuous-batching model with a
bounded batch, a FIFO queue, a KV budget and a prefix cache, driven here by one loop
per engine in (scaled) real time. Around that: Prometheus ``/metrics`` in SGLang's or
vLLM's names (or llama.cpp's, TGI's, or none that tell load), the endpoints the SGLang router probes, vLLM's ``/classify``,
a native ``/v1/responses`` (OpenAI's Responses API over the same chat machinery, as vLLM
serves it), fault directives (:mod:`luftpause.fakes.faults`), counters at ``/stats`` that tests use to
see what really reached the engine, and a decode gate (``PUT /gate``) a test closes to hold
the batch still while it looks. It knows nothing about luftpause's headers.

Run it with ``python -m luftpause.fakes.engine --help``.

Its parts: fakes/engine_config.py (the configuration, presets and command line),
fakes/engine_state.py (the simulation loop, shared state and Prometheus gauges),
fakes/engine_chat.py (chat completions, Responses and /classify); this module holds the
discovery and control endpoints, the app and the process.
"""

from __future__ import annotations

import asyncio
import hashlib
import signal
import time
import uuid
from collections.abc import Sequence
from dataclasses import asdict
from typing import Any

import structlog
from aiohttp import web
from prometheus_client import CollectorRegistry

from luftpause import logs
from luftpause.prom import metrics_response
from luftpause.fakes import faults as fault_directives
from luftpause.fakes import replies
from luftpause.fakes.faults import FaultError
from luftpause.fakes.replies import RequestError
from luftpause.fakes.sim import CHARS_PER_TOKEN
from luftpause.fakes.engine_chat import idle_close, chat_completions, classify, read_json, request_error, responses
from luftpause.fakes.engine_config import METRIC_NAMES, PRESETS, EngineConfig, parse_args, replica_configs
from luftpause.fakes.engine_state import STATE_KEY, EngineCollector, EngineState, Gpu, Simulator

__all__ = ["PRESETS", "REGISTRY_KEY", "STATE_KEY", "EngineConfig", "Gpu", "create_app", "main", "parse_args"]

log = structlog.get_logger(service="fake-engine")


# --- discovery: models, health, and what the SGLang router probes ------------------------


async def models(request: web.Request) -> web.Response:
    config = request.app[STATE_KEY].config
    created = int(time.time())
    data = [{"id": m, "object": "model", "created": created, "owned_by": config.name} for m in config.models]
    return web.json_response({"object": "list", "data": data})


async def health(request: web.Request) -> web.Response:
    return web.json_response({"status": "ok"})


# The chat request's fields beyond OpenAI's that the fake honours, as vLLM's schema lists them.
CHAT_REQUEST_SCHEMA = {"title": "ChatCompletionRequest", "type": "object", "required": ["messages"],
                       "properties": {name: {"title": name} for name in (
                           "messages", "model", "max_tokens", "max_completion_tokens", "stream", "stream_options",
                           "tools", "tool_choice", "logprobs", "top_logprobs", "add_generation_prompt",
                           "continue_final_message")}}


async def openapi(request: web.Request) -> web.Response:
    """The routes, in the shape FastAPI publishes at ``/openapi.json`` (vLLM, SGLang):
    a ``paths`` mapping of each path to its methods, and the chat request's schema."""
    paths: dict[str, dict] = {}
    for route in request.app.router.routes():
        path = route.resource.canonical if route.resource is not None else ""
        if path and route.method in ("GET", "POST", "PUT"):
            paths.setdefault(path, {})[route.method.lower()] = {"summary": path}
    config = request.app[STATE_KEY].config
    schema = CHAT_REQUEST_SCHEMA
    honoured = [name for name, on in (("priority", config.scheduling_policy == "priority"
                                       or config.enable_priority_scheduling),
                                      ("session_id", config.enable_session_radix_cache)) if on]
    if honoured:  # the fields the engine's flags give a meaning
        schema = {**schema, "properties": {**schema["properties"], **{n: {"title": n} for n in honoured}}}
    chat = paths.get("/v1/chat/completions", {}).get("post")
    if chat is not None:
        chat["requestBody"] = {"content": {"application/json": {
            "schema": {"$ref": "#/components/schemas/ChatCompletionRequest"}}}, "required": True}
    return web.json_response({"openapi": "3.1.0", "info": {"title": "fake engine", "version": "fake"},
                              "paths": paths, "components": {"schemas": {"ChatCompletionRequest": schema}}})


async def server_info(request: web.Request) -> web.Response:
    """SGLang's ``/server_info`` (and ``/get_server_info``), without ``model_path`` or
    ``tokenizer_path``: with them the router would try to fetch a tokenizer."""
    config = request.app[STATE_KEY].config
    return web.json_response({
        "version": "fake",
        "served_model_name": config.models[0],
        "max_running_requests": config.max_running,
        "max_total_num_tokens": config.kv_tokens,
        "page_size": config.block_tokens,
        "context_length": config.context_tokens or None,
        "stream_interval": config.stream_interval,
        # Batches up to this size decode from captured CUDA graphs; larger ones run eagerly.
        "cuda_graph_max_bs": config.cuda_graph_max_bs or None,
        "disable_cuda_graph": False,
        "dp_size": 1,
        "tp_size": 1,
        # Scheduling server arguments, as SGLang publishes its own here (FCFS is its default
        # policy and the fake's), and vLLM's --scheduling-policy (vLLM has no /server_info).
        "schedule_policy": "fcfs",
        "enable_priority_scheduling": config.enable_priority_scheduling,
        "schedule_low_priority_values_first": config.schedule_low_priority_values_first,
        "priority_scheduling_preemption_threshold": config.priority_scheduling_preemption_threshold,
        "disable_priority_preemption": config.disable_priority_preemption,
        "enable_session_radix_cache": config.enable_session_radix_cache,
        "scheduling_policy": config.scheduling_policy,
    })


async def close_session(request: web.Request) -> web.Response:
    """SGLang's ``POST /close_session`` ``{"session_id": ...}`` (``CloseSessionReqInput``),
    served with ``--enable-session-radix-cache`` only: the session's KV is no longer kept
    ahead of other KV (``SessionRefs.close``); 200 with an empty body, as SGLang answers,
    also for a session never seen or already closed."""
    state = request.app[STATE_KEY]
    try:
        body = await read_json(request)
    except RequestError as err:
        return request_error(err)
    session_id = body.get("session_id") if isinstance(body, dict) else None
    if not isinstance(session_id, str):
        return web.json_response({"detail": [{"type": "missing", "loc": ["body", "session_id"],
                                              "msg": "Field required"}]}, status=422)
    released = state.sim.model.close_session(session_id)
    log.info("session_closed", session_id=session_id, released_blocks=released)
    return web.Response(status=200)


async def model_info(request: web.Request) -> web.Response:
    config = request.app[STATE_KEY].config
    return web.json_response({"is_generation": True, "model_type": "fake", "architectures": ["FakeForCausalLM"],
                              "served_model_name": config.models[0]})


async def get_load(request: web.Request) -> web.Response:
    """SGLang's ``/get_load`` (polled by the router's ``power_of_two`` policy)."""
    model = request.app[STATE_KEY].sim.model
    return web.json_response([{
        "dp_rank": 0,
        "num_reqs": len(model.running) + len(model.waiting),
        "num_waiting_reqs": len(model.waiting),
        "num_tokens": model.used_tokens,
    }])


def token_ids(text: str) -> list[int]:
    """The prompt "tokenised" as the engine model counts it (one token per
    ``CHARS_PER_TOKEN`` characters), each token's id a hash of its characters: the same
    text gives the same ids, and a shared prefix a shared run of ids."""
    return [int.from_bytes(hashlib.blake2b(text[i:i + CHARS_PER_TOKEN].encode(), digest_size=4).digest()) % 128_000
            for i in range(0, len(text), CHARS_PER_TOKEN)]


def _text_to_tokenize(body: Any) -> str:
    if not isinstance(body, dict):
        raise RequestError("request body must be a JSON object")
    if isinstance(body.get("messages"), list):
        return replies.render_prompt(body)
    if isinstance(body.get("prompt"), str):
        return body["prompt"]
    raise RequestError("give messages (a list) or prompt (a string)")


async def tokenize(request: web.Request) -> web.Response:
    """vLLM's ``POST /tokenize`` ({prompt} or {messages}): the prompt's token ids, which
    vllm-router's cache_aware and kv_aware policies ask workers for. A read-out: it
    touches no engine state."""
    try:
        ids = token_ids(_text_to_tokenize(await read_json(request)))
    except RequestError as err:
        return request_error(err)
    config = request.app[STATE_KEY].config
    return web.json_response({"count": len(ids), "max_model_len": config.context_tokens or 8192, "tokens": ids,
                              "token_strs": None})


async def render_chat(request: web.Request) -> web.Response:
    """vLLM's ``POST /v1/chat/completions/render``: the token ids the chat request's prompt
    renders to (the same as ``/tokenize``), without generating. A read-out."""
    try:
        body = await read_json(request)
        if not isinstance(body, dict) or not isinstance(body.get("messages"), list):
            raise RequestError("messages (a list) is required")
        ids = token_ids(_text_to_tokenize(body))
    except RequestError as err:
        return request_error(err)
    return web.json_response({"request_id": f"render-{uuid.uuid4().hex}", "model": body.get("model"),
                              "token_ids": ids, "features": None})


async def stats(request: web.Request) -> web.Response:
    return web.json_response(request.app[STATE_KEY].stats())


async def set_faults(request: web.Request) -> web.Response:
    """``PUT /faults`` ``{"faults": ["hang"]}``: the engine-wide fault directives from now
    on, as ``--fault`` sets them at start (``[]`` heals it); requests already waiting
    keep theirs. For injecting a fault into a running engine (``make chaos`` load mode)."""
    state = request.app[STATE_KEY]
    try:
        body = await request.json()
        options = body["faults"]
        if not isinstance(options, list) or not all(isinstance(o, str) for o in options):
            raise ValueError("'faults' must be a list of strings")
        state.faults = fault_directives.parse(fault_directives.parse_option(o) for o in options)
    except (ValueError, KeyError, TypeError, FaultError) as err:
        return web.json_response({"error": {"message": f"bad faults: {err}"}}, status=400)
    log.info("engine_faults_set", faults=options)
    return web.json_response({"faults": options})


async def set_gate(request: web.Request) -> web.Response:
    """``PUT /gate`` ``{"open": false}``: no decode step runs until ``{"open": true}``.
    Requests are still admitted and prefilled (a stream sends its first chunk), so the
    batch, the queue and the gauges hold still: for a test that must see a state which
    would otherwise pass while it looks (/stats shows ``gate_open``)."""
    state = request.app[STATE_KEY]
    try:
        body = await request.json()
        if not isinstance(body, dict) or not isinstance(body.get("open"), bool):
            raise ValueError("'open' must be true or false")
    except ValueError as err:
        return web.json_response({"error": {"message": f"bad gate: {err}"}}, status=400)
    state.sim.set_gate(body["open"])
    log.info("engine_gate", open=body["open"])
    return web.json_response({"open": body["open"]})


async def reset(request: web.Request) -> web.Response:
    """``POST /reset``: an empty cache and zero counters, as after a restart (409 while busy)."""
    state = request.app[STATE_KEY]
    if not state.sim.reset():
        return web.json_response({"error": {"message": "engine is busy"}}, status=409)
    state.requests = state.closed_early = 0
    return web.json_response(state.stats())


async def metrics(request: web.Request) -> web.Response:
    state = request.app[STATE_KEY]
    if state.faults.metrics_hang:  # --fault metrics-hang: load cannot be read
        await asyncio.sleep(state.config.hang_limit_s)
    registry = request.app[REGISTRY_KEY]
    return metrics_response(registry)


REGISTRY_KEY = web.AppKey("metrics_registry", CollectorRegistry)


def create_app(config: EngineConfig, gpu: Gpu | None = None) -> web.Application:
    """The engine as an aiohttp app, for ``main`` and for in-process tests; replicas
    given the same ``gpu`` share its timeline (one process, one GPU)."""
    if config.metrics_format not in METRIC_NAMES:
        raise ValueError(f"metrics_format must be one of {sorted(METRIC_NAMES)}")
    if any(f not in METRIC_NAMES for f in config.also_metrics_formats):
        raise ValueError(f"also_metrics_formats must be among {sorted(METRIC_NAMES)}")
    config.params().priority_policy()  # at most one engine's priority scheduling, a known policy
    state = EngineState(config=config, sim=Simulator(config.params(), config.time_scale, gpu),
                        faults=config.engine_faults())
    registry = CollectorRegistry(auto_describe=True)
    registry.register(EngineCollector(state))
    app = web.Application(middlewares=[idle_close(config.idle_close_s)] if config.idle_close_s > 0 else [])
    app[STATE_KEY] = state
    app[REGISTRY_KEY] = registry

    async def stop_sim(app: web.Application) -> None:
        await state.sim.stop()

    app.on_cleanup.append(stop_sim)
    app.router.add_post("/v1/chat/completions", chat_completions)
    app.router.add_post("/v1/responses", responses)
    app.router.add_post("/classify", classify)
    app.router.add_post("/v1/classify", classify)
    app.router.add_get("/v1/models", models)
    app.router.add_get("/health", health)
    app.router.add_get("/health_generate", health)
    for path in ("/server_info", "/get_server_info"):
        app.router.add_get(path, server_info)
    for path in ("/model_info", "/get_model_info"):
        app.router.add_get(path, model_info)
    app.router.add_get("/get_load", get_load)
    app.router.add_get("/stats", stats)
    app.router.add_post("/tokenize", tokenize)
    app.router.add_post("/v1/chat/completions/render", render_chat)
    app.router.add_post("/reset", reset)
    app.router.add_put("/faults", set_faults)
    app.router.add_put("/gate", set_gate)
    app.router.add_get("/metrics", metrics)
    if config.enable_session_radix_cache:
        app.router.add_post("/close_session", close_session)
    if config.openapi:
        app.router.add_get("/openapi.json", openapi)
    return app


def main(argv: Sequence[str] | None = None) -> None:
    config = parse_args(argv)
    logs.configure("fake-engine")
    structlog.contextvars.bind_contextvars(engine=config.name)
    log.info("engine_start", **asdict(config))
    if not config.extra_ports:
        web.run_app(
            create_app(config),
            host=config.host,
            port=config.port,
            access_log=None,
            print=None,
            handler_cancellation=True,  # a client disconnect cancels its request, as in real engines
            shutdown_timeout=1.0,
        )
        return
    try:
        asyncio.run(_serve_replicas(replica_configs(config)))
    except KeyboardInterrupt:
        pass


async def _serve_replicas(configs: list[EngineConfig]) -> None:
    """Several replicas on one GPU timeline, each app on its own port, until SIGTERM/SIGINT."""

    gpu = Gpu(configs[0].time_scale)
    runners = []
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    try:
        for config in configs:
            runner = web.AppRunner(create_app(config, gpu), access_log=None, handler_cancellation=True,
                                   shutdown_timeout=1.0)
            await runner.setup()
            runners.append(runner)
            await web.TCPSite(runner, config.host, config.port).start()
            log.info("engine_replica", name=config.name, port=config.port)
        await stop.wait()
    finally:
        for runner in runners:
            await runner.cleanup()


if __name__ == "__main__":
    main()

"""The fake engine, run as a real process on a loopback port and driven over HTTP."""

from __future__ import annotations

import asyncio
import json
import math
from collections.abc import AsyncIterator, Callable
from typing import Any

import aiohttp
import openai
import pytest
from aiohttp.test_utils import TestClient, TestServer
from fake_engine_clock import FakeClock, Requests
from prometheus_client.parser import text_string_to_metric_families

from luftpause.dev.procs import eventually
from luftpause.fakes.engine import STATE_KEY, EngineConfig, Gpu, create_app
from luftpause.scheduler.probes import parse_load

MODEL = "fake-llama-1b"
LOOKUP_TOOL = {
    "type": "function",
    "function": {
        "name": "lookup",
        "description": "Look something up.",
        "parameters": {
            "type": "object",
            "properties": {
                "query": {"type": "string"},
                "limit": {"type": "integer"},
                "exact": {"type": "boolean"},
                "mode": {"type": "string", "enum": ["fast", "deep"]},
                "optional_note": {"type": "string"},
            },
            "required": ["query", "limit", "exact", "mode"],
        },
    },
}
OTHER_TOOL = {"type": "function", "function": {"name": "other", "parameters": {"type": "object"}}}


# --- fixtures -----------------------------------------------------------------------


@pytest.fixture(scope="module")
def engine(start_engine: Callable[..., str]) -> str:
    """A quick engine: short latencies, default tool-call count (2)."""
    return start_engine("--latency-ms", "5", "--token-ms", "1")


@pytest.fixture(scope="module")
def slow_engine(start_engine: Callable[..., str]) -> str:
    """A batch of two with slow decoding, so requests visibly run and queue."""
    return start_engine("--max-running", "2", "--latency-ms", "100", "--token-ms", "40", "--reply-tokens", "12")


@pytest.fixture(scope="module")
def long_engine(start_engine: Callable[..., str]) -> str:
    """A batch of two whose replies last minutes (1000 tokens of 0.5 s), so a request
    stays running, or queued behind two, until its client leaves."""
    return start_engine("--max-running", "2", "--latency-ms", "5", "--token-ms", "500", "--reply-tokens", "1000")


@pytest.fixture
async def http() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=15)) as session:
        yield session


# --- helpers ------------------------------------------------------------------------


def chat(content: str = "What is the weather in Berlin today?", **extra: Any) -> dict[str, Any]:
    return {"model": MODEL, "messages": [{"role": "user", "content": content}], **extra}


def with_tool_turns(body: dict[str, Any], turns: int) -> dict[str, Any]:
    """Append ``turns`` completed assistant tool-call rounds to the conversation."""
    messages = list(body["messages"])
    for i in range(turns):
        call = {"id": f"call_{i}", "type": "function", "function": {"name": "lookup", "arguments": "{}"}}
        messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        messages.append({"role": "tool", "tool_call_id": f"call_{i}", "content": "sunny"})
    return {**body, "messages": messages}


async def read_sse(response: aiohttp.ClientResponse) -> tuple[list[dict[str, Any]], bool]:
    """All ``data:`` JSON chunks of an SSE body, and whether it ended with ``[DONE]``."""
    chunks: list[dict[str, Any]] = []
    done = False
    async for raw in response.content:
        line = raw.decode().strip()
        if not line:
            continue
        assert line.startswith("data: "), line
        assert not done, "data after [DONE]"
        payload = line.removeprefix("data: ")
        if payload == "[DONE]":
            done = True
        else:
            chunks.append(json.loads(payload))
    return chunks, done


async def post_stream(http: aiohttp.ClientSession, url: str, body: dict[str, Any]) -> list[dict[str, Any]]:
    async with http.post(f"{url}/v1/chat/completions", json={**body, "stream": True}) as response:
        assert response.status == 200
        assert response.headers["Content-Type"].startswith("text/event-stream")
        chunks, done = await read_sse(response)
    assert done, "stream did not end with [DONE]"
    return chunks


async def post_json(http: aiohttp.ClientSession, url: str, body: Any) -> tuple[int, dict[str, Any]]:
    data = body if isinstance(body, (bytes, str)) else json.dumps(body)
    async with http.post(f"{url}/v1/chat/completions", data=data) as response:
        return response.status, await response.json()


async def get_json(http: aiohttp.ClientSession, url: str) -> dict[str, Any]:
    async with http.get(url) as response:
        assert response.status == 200
        return await response.json()


EXECUTION_COUNTERS = {"sglang:gpu_execution_seconds": "category", "sglang:realtime_tokens": "mode",
                      "sglang:cuda_graph_passes": "mode"}


async def gauges(http: aiohttp.ClientSession, url: str) -> dict[str, float]:
    """``/metrics`` parsed with the Prometheus parser, as ``{name: value}`` for our model:
    gauges, the retraction counter, and the queue-time histogram's sum and count (the
    execution counters: :func:`execution`)."""
    async with http.get(f"{url}/metrics") as response:
        assert response.status == 200
        text = await response.text()
    values: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        if family.name in EXECUTION_COUNTERS:
            continue
        kind = "counter" if "retracted" in family.name else "histogram" if "queue_time" in family.name else "gauge"
        assert family.type == kind, family.name
        for sample in family.samples:
            if sample.name.endswith("_bucket"):
                continue
            assert sample.labels == {"model_name": MODEL}
            values[sample.name] = sample.value
    return values


async def execution(http: aiohttp.ClientSession, url: str) -> dict[tuple[str, str], float]:
    """SGLang's execution counters in ``/metrics``, as ``{(sample name, category or mode): value}``."""
    async with http.get(f"{url}/metrics") as response:
        text = await response.text()
    values: dict[tuple[str, str], float] = {}
    for family in text_string_to_metric_families(text):
        if family.name in EXECUTION_COUNTERS:
            assert family.type == "counter"
            for sample in family.samples:
                if sample.name.endswith("_total"):
                    values[(sample.name, sample.labels[EXECUTION_COUNTERS[family.name]])] = sample.value
    return values


def content_of(chunks: list[dict[str, Any]]) -> str:
    return "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])


def finish_reasons(chunks: list[dict[str, Any]]) -> list[str]:
    return [c["choices"][0]["finish_reason"] for c in chunks if c["choices"] and c["choices"][0]["finish_reason"]]


# --- endpoints ----------------------------------------------------------------------


async def test_health_models_and_stats(engine: str, http: aiohttp.ClientSession) -> None:
    assert await get_json(http, f"{engine}/health") == {"status": "ok"}
    models = await get_json(http, f"{engine}/v1/models")
    assert models["object"] == "list"
    assert [m["id"] for m in models["data"]] == [MODEL]
    assert {"requests", "running", "queued", "closed_early", "cached_tokens"} <= set(await get_json(http, f"{engine}/stats"))


async def test_streamed_text_reply_parses_and_ends_with_done(engine: str, http: aiohttp.ClientSession) -> None:
    chunks = await post_stream(http, engine, chat(stream_options={"include_usage": True}))
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    assert len({c["id"] for c in chunks}) == 1
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    content_chunks = [c for c in chunks if c["choices"] and c["choices"][0]["delta"].get("content")]
    assert len(content_chunks) == 12  # --reply-tokens default, one chunk per token
    assert content_of(chunks).startswith("What is the weather")
    assert finish_reasons(chunks) == ["stop"]
    usage_chunk = chunks[-1]
    assert usage_chunk["choices"] == []
    usage = usage_chunk["usage"]
    assert usage["completion_tokens"] == 12
    rendered = "<|user|>What is the weather in Berlin today?<|end|>"  # the fake chat template
    assert usage["prompt_tokens"] == math.ceil(len(rendered) / 4)  # ~4 chars/token
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
    assert usage["prompt_tokens_details"] == {"cached_tokens": 0}


async def test_no_usage_chunk_unless_asked(engine: str, http: aiohttp.ClientSession) -> None:
    chunks = await post_stream(http, engine, chat())
    assert all(c["choices"] and "usage" not in c for c in chunks)


async def test_tool_call_while_tools_offered_then_text(engine: str, http: aiohttp.ClientSession) -> None:
    body = chat(tools=[LOOKUP_TOOL, OTHER_TOOL])
    ids = set()
    for turns in range(2):  # --tool-calls 2: first and second turn call a tool
        status, reply = await post_json(http, engine, with_tool_turns(body, turns))
        assert status == 200
        choice = reply["choices"][0]
        assert choice["finish_reason"] == "tool_calls"
        (call,) = choice["message"]["tool_calls"]
        assert call["type"] == "function" and call["function"]["name"] == "lookup"
        assert call["id"].startswith("call_")
        ids.add(call["id"])
        args = json.loads(call["function"]["arguments"])
        assert args == {"query": "What is the weather in Berlin", "limit": 1, "exact": True, "mode": "fast"}
    assert len(ids) == 2
    status, reply = await post_json(http, engine, with_tool_turns(body, 2))
    assert reply["choices"][0]["finish_reason"] == "stop"
    assert reply["choices"][0]["message"]["content"]
    assert "tool_calls" not in reply["choices"][0]["message"]


async def test_streamed_tool_call_reassembles(engine: str, http: aiohttp.ClientSession) -> None:
    chunks = await post_stream(http, engine, chat(tools=[LOOKUP_TOOL]))
    deltas = [c["choices"][0]["delta"]["tool_calls"][0] for c in chunks if c["choices"][0]["delta"].get("tool_calls")]
    assert len(deltas) > 2  # announced, then arguments in pieces
    assert deltas[0]["id"].startswith("call_") and deltas[0]["function"]["name"] == "lookup"
    assert all(d["index"] == 0 for d in deltas)
    arguments = "".join(d["function"].get("arguments", "") for d in deltas)
    assert json.loads(arguments)["query"] == "What is the weather in Berlin"
    assert finish_reasons(chunks) == ["tool_calls"]


async def test_tool_choice_none_gives_text(engine: str, http: aiohttp.ClientSession) -> None:
    _, reply = await post_json(http, engine, chat(tools=[LOOKUP_TOOL], tool_choice="none"))
    assert reply["choices"][0]["finish_reason"] == "stop"


@pytest.mark.parametrize("cap_field", ["max_tokens", "max_completion_tokens"])
async def test_token_cap_gives_length(engine: str, http: aiohttp.ClientSession, cap_field: str) -> None:
    status, reply = await post_json(http, engine, chat(**{cap_field: 3}))
    assert status == 200
    assert reply["object"] == "chat.completion"
    assert reply["choices"][0]["finish_reason"] == "length"
    assert reply["usage"]["completion_tokens"] == 3
    assert len(reply["choices"][0]["message"]["content"].split()) == 3

    chunks = await post_stream(http, engine, chat(stream_options={"include_usage": True}, **{cap_field: 4}))
    assert finish_reasons(chunks) == ["length"]
    assert chunks[-1]["usage"]["completion_tokens"] == 4
    assert len(content_of(chunks).split()) == 4


async def test_tool_call_that_does_not_fit_the_cap_is_cut(engine: str, http: aiohttp.ClientSession) -> None:
    _, reply = await post_json(http, engine, chat(tools=[LOOKUP_TOOL], max_tokens=2))
    assert reply["choices"][0]["finish_reason"] == "length"
    assert reply["usage"]["completion_tokens"] == 2


async def test_errors(engine: str, http: aiohttp.ClientSession) -> None:
    before = (await get_json(http, f"{engine}/stats"))["requests"]
    status, body = await post_json(http, engine, chat() | {"model": "no-such-model"})
    assert status == 404 and "no-such-model" in body["error"]["message"]
    status, body = await post_json(http, engine, b'{"model": "fake-llama-1b", "messages": [')
    assert status == 400 and body["error"]["message"]
    status, body = await post_json(http, engine, {"model": MODEL, "messages": "hi"})
    assert status == 400
    status, body = await post_json(http, engine, chat(max_tokens=0))
    assert status == 400
    assert (await get_json(http, f"{engine}/stats"))["requests"] == before + 4  # rejected ones arrived too


async def test_ignores_luftpause_headers(engine: str, http: aiohttp.ClientSession) -> None:
    headers = {"x-luftpause-run-id": "run-1", "x-luftpause-class": "batch"}
    async with http.post(f"{engine}/v1/chat/completions", json=chat(max_tokens=5), headers=headers) as response:
        plain_headers = await response.json()
    _, plain = await post_json(http, engine, chat(max_tokens=5))
    assert plain_headers["choices"] == plain["choices"] and plain_headers["usage"] == plain["usage"]


async def test_openai_sdk_streams(engine: str) -> None:
    client = openai.AsyncOpenAI(base_url=f"{engine}/v1", api_key="unused", max_retries=0)
    try:
        stream = await client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "Say hello"}],
            stream=True,
            stream_options={"include_usage": True},
        )
        text, usage, finish = "", None, None
        async for chunk in stream:
            if chunk.choices:
                text += chunk.choices[0].delta.content or ""
                finish = chunk.choices[0].finish_reason or finish
            if chunk.usage:
                usage = chunk.usage
        assert text.startswith("Say hello") and len(text.split()) == 12
        assert finish == "stop"
        assert usage is not None and usage.completion_tokens == 12

        reply = await client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "find it"}], tools=[LOOKUP_TOOL]
        )
        call = reply.choices[0].message.tool_calls[0]
        assert call.function.name == "lookup" and json.loads(call.function.arguments)["query"] == "find it"

        with pytest.raises(openai.NotFoundError):
            await client.chat.completions.create(model="nope", messages=[{"role": "user", "content": "x"}])
    finally:
        await client.close()


# --- batching, queueing, disconnects -------------------------------------------------


async def test_metrics_show_running_and_queue() -> None:
    """The gauges of a slow engine (a batch of two, 40 ms tokens) idle, busy and done; in
    process on a clock the test moves on, which stands still while the batch is full."""
    clock = FakeClock()
    config = EngineConfig(max_running=2, latency_ms=100, token_ms=40, reply_tokens=12)
    app = create_app(config, Gpu(config.time_scale, clock))
    sim = app[STATE_KEY].sim
    async with TestServer(app) as server, aiohttp.ClientSession() as http:
        url = f"http://{server.host}:{server.port}"
        idle = await gauges(http, url)
        assert set(idle) == {
            "sglang:num_running_reqs",
            "sglang:num_queue_reqs",
            "sglang:token_usage",
            "sglang:cache_hit_rate",
            "sglang:num_retracted_reqs_total",
            "sglang:max_total_num_tokens",
            "sglang:num_used_tokens",
            "sglang:gen_throughput",
            "sglang:queue_time_seconds_sum",
            "sglang:queue_time_seconds_count",
        }
        assert idle["sglang:num_running_reqs"] == 0 and idle["sglang:num_queue_reqs"] == 0
        assert idle["sglang:num_used_tokens"] == 0 and idle["sglang:max_total_num_tokens"] > 0

        requests = Requests(clock)
        for _ in range(5):
            requests.send(sim, post_stream(http, url, chat()))
        await requests.until(lambda: sim.model.gauges.queued == {MODEL: 3})  # two running, three queued
        busy = await gauges(http, url)
        assert busy["sglang:num_queue_reqs"] == 3
        assert busy["sglang:num_running_reqs"] == 2  # max_running 2
        assert 0 < busy["sglang:token_usage"] < 1
        # The scheduler reads the KV pool from these: the same share, in tokens.
        assert busy["sglang:num_used_tokens"] == round(busy["sglang:token_usage"] * busy["sglang:max_total_num_tokens"])
        stats = await get_json(http, f"{url}/stats")
        assert stats["running"] == 2 and stats["queued"] == 3

        for chunks in await requests.results():
            assert finish_reasons(chunks) == ["stop"]
        done = await gauges(http, url)
    assert done["sglang:num_running_reqs"] == 0 and done["sglang:num_queue_reqs"] == 0
    # Tokens per second of its last decode-log interval, as SGLang's: none before any decode.
    assert idle["sglang:gen_throughput"] == 0 and done["sglang:gen_throughput"] > 0
    # Each request's wait in the queue, as SGLang's histogram: the three behind the batch
    # of two waited for a place, at least one reply (12 tokens at 40 ms) each.
    count = done["sglang:queue_time_seconds_count"] - idle["sglang:queue_time_seconds_count"]
    waited = done["sglang:queue_time_seconds_sum"] - idle["sglang:queue_time_seconds_sum"]
    assert count == 5 and waited >= 3 * 12 * 0.040


async def test_execution_counters_are_the_simulated_gpus_time(slow_engine: str, http: aiohttp.ClientSession) -> None:
    """SGLang's ``gpu_execution_seconds_total`` per category, decode tokens and decode
    passes: a decode pass of this engine costs 40 model ms at any batch (``--token-ms``),
    so the decode seconds are 40 ms a pass whatever the host's CPU did, and without CUDA
    graphs every pass is eager; a scheduler reads the cost of a decode token from them."""
    before = await execution(http, slow_engine)
    await asyncio.gather(*(post_stream(http, slow_engine, chat()) for _ in range(3)))
    after = await execution(http, slow_engine)
    grew = {key: after[key] - before.get(key, 0.0) for key in after}
    passes = grew[("sglang:cuda_graph_passes_total", "decode_none")]
    tokens = grew[("sglang:realtime_tokens_total", "decode")]
    assert grew[("sglang:cuda_graph_passes_total", "decode_cuda_graph")] == 0 and passes > 0
    assert grew[("sglang:gpu_execution_seconds_total", "forward_decode")] == pytest.approx(0.040 * passes)
    assert passes <= tokens <= 2 * passes  # --max-running 2
    assert grew[("sglang:gpu_execution_seconds_total", "forward_extend")] > 0  # the prompts' prefill passes


async def test_client_disconnect_closes_engine_request(long_engine: str) -> None:
    async with aiohttp.ClientSession() as http:  # no deadline of its own: its streams last minutes
        async def stats() -> dict[str, Any]:
            return await get_json(http, f"{long_engine}/stats")

        before = (await stats())["closed_early"]
        response = await http.post(f"{long_engine}/v1/chat/completions", json=chat(stream=True))
        first = await response.content.readline()  # the role chunk: generation has started
        assert b"chat.completion.chunk" in first
        assert (await stats())["running"] == 1
        response.close()  # drop the connection mid-stream
        await eventually(lambda: _closed(stats, before + 1), what="the engine counted the disconnect")
        assert (await stats())["running"] == 0


async def test_disconnect_while_queued_frees_the_place(long_engine: str) -> None:
    async with aiohttp.ClientSession() as http:  # no deadline of its own: its streams last minutes
        async def stats() -> dict[str, Any]:
            return await get_json(http, f"{long_engine}/stats")

        before = (await stats())["closed_early"]
        runners = [asyncio.create_task(post_stream(http, long_engine, chat())) for _ in range(2)]
        await eventually(lambda: _has(stats, running=2), what="two requests running")
        waiting = await http.post(f"{long_engine}/v1/chat/completions", json=chat(stream=True))
        await eventually(lambda: _has(stats, queued=1), what="a third queued behind them")
        waiting.close()
        await eventually(lambda: _has(stats, queued=0, closed_early=before + 1), what="the queued one gone")
        assert await _has(stats, running=2)  # the batch went on
        for runner in runners:
            runner.cancel()
        await asyncio.gather(*runners, return_exceptions=True)
        await eventually(lambda: _has(stats, running=0, closed_early=before + 3), what="the runners gone too")


async def _closed(stats: Callable[[], Any], count: int) -> bool:
    return (await stats())["closed_early"] >= count


async def _has(stats: Callable[[], Any], **expected: int) -> bool:
    now = await stats()
    return all(now[key] == value for key, value in expected.items())


# --- in-process -----------------------------------------------------------------------


async def test_create_app_in_process_with_vllm_metrics() -> None:
    config = EngineConfig(metrics_format="vllm", latency_ms=0, token_ms=0)
    async with TestClient(TestServer(create_app(config))) as client:
        response = await client.post("/v1/chat/completions", json=chat(max_tokens=2))
        assert (await response.json())["usage"]["completion_tokens"] == 2
        text = await (await client.get("/metrics")).text()
    names = {f.name for f in text_string_to_metric_families(text)}
    assert {"vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:cache_config_info"} <= names
    assert not any(name.startswith("sglang:") for name in names)
    load = parse_load(text)
    assert load.kv_total == config.kv_tokens // config.block_tokens * config.block_tokens
    assert load.queue_waits == 1 and load.queue_wait_s is not None  # vLLM's request_queue_time_seconds

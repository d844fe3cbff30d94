"""The fake engine's other faces, in process: /classify, logprobs, cached tokens in usage,
streaming intervals, and the endpoints the SGLang router probes."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

import pytest
from aiohttp.test_utils import TestClient, TestServer

from luftpause.fakes.engine import EngineConfig, create_app

MODEL = "fake-llama-1b"


@pytest.fixture
async def client() -> AsyncIterator[TestClient]:
    config = EngineConfig(latency_ms=1, token_ms=1, labels=("no", "yes", "maybe"))
    async with TestClient(TestServer(create_app(config))) as test_client:
        yield test_client


async def chat(client: TestClient, **body: Any) -> dict[str, Any]:
    response = await client.post("/v1/chat/completions", json={"model": MODEL, **body})
    assert response.status == 200, await response.text()
    return await response.json()


async def test_classify_in_vllm_format(client: TestClient) -> None:
    response = await client.post("/classify", json={"model": MODEL, "input": ["good film", "bad film"]})
    assert response.status == 200
    body = await response.json()
    assert [d["index"] for d in body["data"]] == [0, 1]
    for item in body["data"]:
        assert item["num_classes"] == 3 and len(item["probs"]) == 3
        assert abs(sum(item["probs"]) - 1) < 1e-9
        assert item["label"] == ("no", "yes", "maybe")[item["probs"].index(max(item["probs"]))]
    again = await (await client.post("/classify", json={"model": MODEL, "input": "good film"})).json()
    assert again["data"][0]["probs"] == body["data"][0]["probs"]  # deterministic per seed
    assert (await client.post("/classify", json={"model": "nope", "input": "x"})).status == 404
    assert (await client.post("/classify", json={"model": MODEL, "input": []})).status == 400


async def test_logprobs_score_prompt_words(client: TestClient) -> None:
    question = "Answer with one word, yes or no: is the sky blue?"
    body = await chat(client, messages=[{"role": "user", "content": question}], max_tokens=1,
                      logprobs=True, top_logprobs=20)
    (entry,) = body["choices"][0]["logprobs"]["content"]
    alternatives = {t["token"]: t["logprob"] for t in entry["top_logprobs"]}
    assert {"yes", "no"} <= set(alternatives)
    assert entry["top_logprobs"][0]["token"] == entry["token"]
    assert all(v < 0 for v in alternatives.values())
    plain = await chat(client, messages=[{"role": "user", "content": question}], max_tokens=1)
    assert plain["choices"][0]["logprobs"] is None


async def test_streamed_logprobs_follow_chunks(client: TestClient) -> None:
    response = await client.post("/v1/chat/completions", json={
        "model": MODEL, "stream": True, "logprobs": True, "top_logprobs": 2, "max_tokens": 3,
        "messages": [{"role": "user", "content": "red green blue"}]})
    chunks = [json.loads(line.removeprefix("data: ")) for line in (await response.text()).split("\n\n")
              if line.startswith("data: {")]
    with_tokens = [c for c in chunks if c["choices"] and c["choices"][0]["delta"].get("content")]
    assert len(with_tokens) == 3
    assert all(len(c["choices"][0]["logprobs"]["content"]) == 1 for c in with_tokens)


async def test_repeated_conversation_reports_cached_tokens(client: TestClient) -> None:
    messages = [{"role": "system", "content": "You are a careful agent. " * 40},
                {"role": "user", "content": "Plan the trip to Lisbon. " * 10}]
    first = await chat(client, messages=messages)
    assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    follow_up = [*messages, first["choices"][0]["message"], {"role": "user", "content": "And then?"}]
    second = await chat(client, messages=follow_up)
    cached = second["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert cached >= first["usage"]["prompt_tokens"] - 16  # everything but a partial last block
    stats = await (await client.get("/stats")).json()
    assert stats["cached_tokens"] == cached
    metrics = await (await client.get("/metrics")).text()
    hit_rate = next(float(line.split()[-1]) for line in metrics.splitlines()
                    if line.startswith("sglang:cache_hit_rate{"))
    assert 0 < hit_rate < 1


async def test_stream_interval_groups_tokens() -> None:
    config = EngineConfig(latency_ms=1, token_ms=1, reply_tokens=12, stream_interval=4)
    async with TestClient(TestServer(create_app(config))) as client:
        response = await client.post("/v1/chat/completions", json={
            "model": MODEL, "stream": True, "messages": [{"role": "user", "content": "one two three"}]})
        chunks = [json.loads(line.removeprefix("data: ")) for line in (await response.text()).split("\n\n")
                  if line.startswith("data: {")]
    contents = [c["choices"][0]["delta"].get("content") for c in chunks if c["choices"]]
    words = [c for c in contents if c]
    assert len(words) == 3 and len("".join(words).split()) == 12


async def test_router_probe_endpoints(client: TestClient) -> None:
    for path in ("/server_info", "/get_server_info"):
        info = await (await client.get(path)).json()
        assert "model_path" not in info and "tokenizer_path" not in info
    for path in ("/model_info", "/get_model_info"):
        info = await (await client.get(path)).json()
        assert "model_path" not in info and "tokenizer_path" not in info and info["is_generation"]
    load = await (await client.get("/get_load")).json()
    assert load[0]["num_tokens"] == 0 and load[0]["num_reqs"] == 0
    assert (await client.get("/health")).status == 200


async def test_a_lone_surrogate_is_served_and_the_engine_goes_on(client: TestClient) -> None:
    """A lone UTF-16 surrogate is valid JSON and no text; the engine answers it (read as
    U+FFFD) and keeps serving, on chat and on the Responses API over it."""
    raw = (b'{"model": "%s", "messages": [{"role": "user", "content": "hi \\ud800 there"}], "max_tokens": 4}'
           % MODEL.encode())
    response = await client.post("/v1/chat/completions", data=raw, headers={"Content-Type": "application/json"})
    assert response.status == 200, await response.text()
    assert (await client.post("/v1/responses", data=b'{"model": "%s", "input": "\\ud800"}' % MODEL.encode(),
                              headers={"Content-Type": "application/json"})).status == 200
    await chat(client, messages=[{"role": "user", "content": "still here?"}], max_tokens=4)


async def test_json_nested_past_the_parser_depth_is_a_400(client: TestClient) -> None:
    response = await client.post("/v1/chat/completions", data=b"[" * 100_000 + b"]" * 100_000,
                                 headers={"Content-Type": "application/json"})
    assert response.status == 400
    assert "nested too deep" in (await response.json())["error"]["message"]

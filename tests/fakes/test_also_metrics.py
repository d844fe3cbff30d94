"""vLLM-named read-outs beside SGLang's (``--also-metrics-format vllm``), for peer routers
that read only vLLM's names: the same gauges under more names, and not a single step of
the engine model's timing changed by them."""

from __future__ import annotations

from dataclasses import replace

import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from luftpause.fakes.engine import PRESETS, REGISTRY_KEY, STATE_KEY, EngineConfig, create_app, parse_args

PRESET = replace(EngineConfig(), **PRESETS["laptop-1b-sglang"])


def samples(app) -> dict[str, float]:  # type: ignore[no-untyped-def]
    text = generate_latest(app[REGISTRY_KEY]).decode()
    return {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples}


def trace(config: EngineConfig) -> tuple[list[tuple[str, float]], list[dict[str, float]]]:
    """Step kinds and costs of one fixed workload (24 requests, shared and private prefixes,
    enough to queue, chunk and run above the graph size), /metrics scraped after every step."""
    app = create_app(config)
    model = app[STATE_KEY].sim.model
    for i in range(24):
        prompt = "system prompt shared by every run. " * 40 + f"run {i} " * (50 + 37 * i)
        model.submit(config.models[0], prompt, reply_tokens=40 + 7 * (i % 5), max_tokens=256)
    steps: list[tuple[str, float]] = []
    scrapes: list[dict[str, float]] = []
    for _ in range(20_000):
        if not model.busy:
            break
        admitted = model.admit()
        if admitted:
            steps.append(("prefill", model.prefill_ms(admitted)))
            model.finish_prefill(admitted)
        else:
            model.prepare_decode()
            steps.append(("decode", model.decode_ms()))
            model.decode_step()
        scrapes.append(samples(app))
    assert not model.busy
    return steps, scrapes


def test_vllm_names_are_read_outs_that_leave_every_step_time_unchanged() -> None:
    plain_steps, plain = trace(PRESET)
    also_steps, also = trace(replace(PRESET, also_metrics_formats=("vllm",)))
    assert also_steps == plain_steps
    decode_costs = {cost for kind, cost in plain_steps if kind == "decode"}
    assert len(decode_costs) > 3 and max(decode_costs) > PRESET.token_ms + PRESET.decode_eager_ms  # above the graph size
    assert "vllm:num_requests_running" not in plain[0]
    for before, after in zip(plain, also, strict=True):
        assert after["vllm:num_requests_running"] == after["sglang:num_running_reqs"]
        assert after["vllm:num_requests_waiting"] == after["sglang:num_queue_reqs"]
        assert after["vllm:kv_cache_usage_perc"] == after["sglang:token_usage"]
        assert {k: v for k, v in after.items() if not k.startswith("vllm:")} == before
    assert max(s["vllm:num_requests_waiting"] for s in also) > 0  # the workload did queue


def test_option_parses_and_rejects_unknown_names() -> None:
    assert parse_args(["--also-metrics-format", "vllm"]).also_metrics_formats == ("vllm",)
    assert parse_args([]).also_metrics_formats == ()
    with pytest.raises(SystemExit):
        parse_args(["--also-metrics-format", "nonsense"])


async def test_tokenize_and_render_read_out_the_prompts_tokens_without_touching_the_engine() -> None:
    """vLLM's /tokenize and /v1/chat/completions/render, which vllm-router's cache_aware and
    kv_aware policies call on workers: the engine model's token count, ids shared by a
    shared prefix, and no request, cache or counter of the engine changed."""
    from aiohttp.test_utils import TestClient, TestServer

    from luftpause.fakes import replies
    from luftpause.fakes.sim import tokens_for_chars

    async with TestClient(TestServer(create_app(EngineConfig(also_metrics_formats=("vllm",))))) as client:
        first = {"model": "fake-llama-1b", "messages": [{"role": "system", "content": "rules " * 40},
                                                         {"role": "user", "content": "task one " * 30}]}
        later = {**first, "messages": [*first["messages"], {"role": "assistant", "content": "a reply"},
                                       {"role": "user", "content": "and then?"}]}
        before = await (await client.get("/stats")).json()
        rendered = await (await client.post("/v1/chat/completions/render", json=first)).json()
        tokenized = await (await client.post("/tokenize", json=first)).json()
        grown = await (await client.post("/tokenize", json=later)).json()
        plain = await (await client.post("/tokenize", json={"model": "fake-llama-1b", "prompt": "hello there"})).json()
        bad = await client.post("/tokenize", json={"model": "fake-llama-1b"})
        bad_body = await bad.json()
        after = await (await client.get("/stats")).json()
    assert rendered["token_ids"] == tokenized["tokens"]
    assert tokenized["count"] == tokens_for_chars(len(replies.render_prompt(first)))  # as the model counts them
    shared = len(replies.render_prompt(first)) // 4
    assert grown["tokens"][:shared] == tokenized["tokens"][:shared] and grown["count"] > tokenized["count"]
    assert plain["count"] == 3
    assert bad.status == 400 and "messages" in bad_body["error"]["message"]
    assert after == before

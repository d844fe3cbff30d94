"""The continuous-batching model of the fake engine, driven with plain values, and its
time scale measured through the running app."""

from __future__ import annotations

import time

from aiohttp.test_utils import TestClient, TestServer

from luftpause.fakes.engine import EngineConfig, create_app, parse_args
from luftpause.fakes.sim import EngineModel, ModelParams, PrefixCache, block_hashes

BLOCK = 16  # tokens per block = 64 characters


def params(**overrides: object) -> ModelParams:
    base = dict(max_running=0, kv_tokens=100_000, block_tokens=BLOCK, context_tokens=0, max_prefill_tokens=100_000,
                prefill_base_ms=10.0, prefill_ms_per_token=0.1, decode_base_ms=5.0, decode_ms_per_request=1.0)
    return ModelParams(**{**base, **overrides})  # type: ignore[arg-type]


def run_to_end(model: EngineModel, limit: int = 10_000) -> None:
    for _ in range(limit):
        if not model.busy:
            return
        admitted = model.admit()
        if admitted:
            model.finish_prefill(admitted)
        else:
            model.decode_step()
    raise AssertionError("model did not drain")


def text(chars: int, seed: str = "a") -> str:
    return (seed * chars)[:chars]


def test_block_hashes_chain_prefixes() -> None:
    a = block_hashes("x" * 64 + "y" * 64 + "z" * 10, 64)
    b = block_hashes("x" * 64 + "y" * 64 + "w" * 70, 64)
    assert len(a) == 2 and a == b[:2] and len(b) == 3  # partial tails are not blocks
    assert block_hashes("q" * 64 + "y" * 64, 64)[1] != a[1]  # same block after another prefix differs


def test_repeated_prefix_is_served_from_cache() -> None:
    model = EngineModel(params())
    prompt = text(64 * 10)  # 160 tokens, 10 blocks
    first = model.submit("m", prompt, reply_tokens=5, max_tokens=None, reply_text="<|assistant|>done<|end|>")
    run_to_end(model)
    assert first.cached_tokens == 0 and first.state == "finished"
    second = model.submit("m", prompt + "<|assistant|>done<|end|>" + text(200, "b"), 5, None)
    admitted = model.admit()
    assert admitted == [second]
    assert second.cached_tokens >= 10 * BLOCK  # the whole first prompt (and whole reply blocks)
    assert model.prefill_ms([second]) < model.prefill_ms([first])  # only uncached tokens cost
    assert 0 < model.cache_hit_rate() < 1


def test_queue_grows_past_the_batch_limit_fifo() -> None:
    model = EngineModel(params(max_running=2))
    requests = [model.submit("m", text(100, str(i)), 3, None) for i in range(5)]
    assert model.admit() == requests[:2]
    assert [r.id for r in model.waiting] == [r.id for r in requests[2:]]
    assert model.queued_for("m") == 3 and model.running_for("m") == 2
    model.finish_prefill(requests[:2])
    model.decode_step()
    model.decode_step()  # first token at prefill + 2 steps = 3 tokens: both finish
    assert requests[0].state == requests[1].state == "finished"
    assert model.admit() == requests[2:4]


def test_kv_budget_reserves_max_tokens_at_admission() -> None:
    model = EngineModel(params(kv_tokens=1000))
    # 25-token prompts with 400-token reservations: two fit, the third waits for space
    requests = [model.submit("m", text(100, str(i)), 3, max_tokens=400) for i in range(3)]
    assert model.finish_prefill(model.admit()) == [] and model.running == requests[:2]
    assert model.used_tokens > 800 and 0.8 < model.token_usage() <= 1
    run_to_end(model)
    assert all(r.state == "finished" for r in requests)


def test_context_reservation_without_max_tokens() -> None:
    model = EngineModel(params(kv_tokens=9000, context_tokens=4096))
    requests = [model.submit("m", text(400, str(i)), 3, max_tokens=None) for i in range(3)]
    assert [r.reserve_tokens for r in requests] == [4096 - 100] * 3
    assert model.admit() == requests[:2]  # the third would need 4096 more tokens


def test_eviction_frees_space_lru_and_spares_blocks_in_use() -> None:
    model = EngineModel(params(kv_tokens=64 * BLOCK))  # 64 blocks in all
    old = model.submit("m", text(64 * 30, "o"), 1, max_tokens=1)  # 30 blocks, then cached
    run_to_end(model)
    recent = model.submit("m", text(64 * 20, "r"), 1, max_tokens=1)  # 20 blocks, cached later
    run_to_end(model)
    assert len(model.cache) == 50 and model.cache.evictable == 50
    runner = model.submit("m", text(64 * 20, "r") + "tail", 50, max_tokens=50)  # reuses `recent`'s blocks
    assert model.admit() == [runner]
    big = model.submit("m", text(64 * 30, "n"), 1, max_tokens=1)  # needs 30 blocks + 1: evicts `old`
    assert model.admit() == [big]
    assert model.counters.evicted_blocks >= 20
    assert model.cache.cached_prefix(recent.hashes) == 20  # in use by `runner`, never evicted
    assert model.cache.cached_prefix(old.hashes) < 30
    assert model.pool_tokens <= model.params.kv_tokens


def test_aborted_requests_free_their_place() -> None:
    model = EngineModel(params(max_running=1, kv_tokens=2000))
    running = model.submit("m", text(100), 10, max_tokens=1000)
    queued = model.submit("m", text(100, "b"), 10, max_tokens=1000)
    model.admit()
    model.abort(queued)
    assert not model.waiting
    model.abort(running)
    assert not model.running and model.used_tokens == 0
    assert model.counters.aborted == 2


def test_prefix_cache_release_order_evicts_tails_first() -> None:
    cache = PrefixCache()
    blocks = [bytes([i]) for i in range(4)]
    cache.acquire(blocks)
    cache.release(blocks)
    assert cache.evict(2) == 2
    assert cache.cached_prefix(blocks) == 2  # the head of the prefix survived


def test_decode_step_cost_grows_with_batch() -> None:
    model = EngineModel(params())
    one = model.submit("m", text(40), 5, None)
    model.finish_prefill(model.admit())
    alone = model.decode_ms()
    for i in range(9):
        model.submit("m", text(40, str(i)), 5, None)
    model.finish_prefill(model.admit())
    assert len(model.decoding()) == 10 and one in model.decoding()
    assert model.decode_ms() == alone + 9 * model.params.decode_ms_per_request


def test_preset_and_overrides() -> None:
    config = parse_args(["--preset", "laptop-1b", "--max-running", "7", "--time-scale", "0.5"])
    assert config.max_running == 7 and config.time_scale == 0.5
    assert config.kv_tokens == 24000 and config.prefill_ms_per_token > 0
    assert parse_args([]).max_running == 0  # the quick default stays unbounded


async def test_time_scale_speeds_the_engine_up() -> None:
    async def duration(scale: float) -> float:
        config = EngineConfig(latency_ms=100, token_ms=50, reply_tokens=4, time_scale=scale)
        async with TestClient(TestServer(create_app(config))) as client:
            started = time.monotonic()
            body = {"model": "fake-llama-1b", "messages": [{"role": "user", "content": "hi"}]}
            response = await client.post("/v1/chat/completions", json=body)
            assert response.status == 200
            await response.json()
            return time.monotonic() - started

    full, quarter = await duration(1.0), await duration(0.25)
    assert 0.2 < full < 0.5  # prefill 100 ms (first token) + 3 steps of 50 ms
    assert quarter < full / 2.5

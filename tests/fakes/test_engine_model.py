"""The continuous-batching model of the fake engine, driven with plain values (one test
per SGLang behaviour it reproduces), and its time scale and shared GPU measured through
the running app on a clock the test moves on (``fake_engine_clock.FakeClock``)."""

from __future__ import annotations

import json
import urllib.request
from collections.abc import Callable

import pytest
from aiohttp.test_utils import TestClient, TestServer
from fake_engine_clock import FakeClock, Requests, passing

from luftpause.fakes.engine import STATE_KEY, EngineConfig, Gpu, create_app, parse_args
from luftpause.dev.procs import eventually, free_port
from luftpause.fakes.sim import EngineModel, ModelParams, PrefixCache, block_hashes

BLOCK = 16  # tokens per block = 64 characters


def params(**overrides: object) -> ModelParams:
    base = dict(max_running=0, kv_tokens=100_000, block_tokens=BLOCK, context_tokens=0, max_prefill_tokens=100_000,
                prefill_base_ms=10.0, prefill_ms_per_token=0.1, decode_base_ms=5.0, decode_ms_per_request=1.0)
    return ModelParams(**{**base, **overrides})  # type: ignore[arg-type]


def run_to_end(model: EngineModel, limit: int = 100_000) -> None:
    for _ in range(limit):
        if not model.busy:
            return
        step(model)
    raise AssertionError("model did not drain")


def step(model: EngineModel) -> str:
    """One scheduler iteration, as the driver runs it: a prefill pass if one can be built,
    else a decode step."""
    admitted = model.admit()
    if admitted:
        model.finish_prefill(admitted)
        return "prefill"
    model.prepare_decode()
    model.decode_step()
    return "decode"


def decode(model: EngineModel, steps: int) -> None:
    for _ in range(steps):
        model.prepare_decode()
        model.decode_step()


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
    assert model.admit() == [first] and first.extend_tokens == 160
    first_ms = model.prefill_ms([first])
    model.finish_prefill([first])
    run_to_end(model)
    assert first.cached_tokens == 0 and first.state == "finished"
    second = model.submit("m", prompt + "<|assistant|>done<|end|>" + text(200, "b"), 5, None)
    admitted = model.admit()
    assert admitted == [second]
    assert second.cached_tokens >= 10 * BLOCK  # the whole first prompt (and whole reply blocks)
    assert second.extend_tokens == second.prompt_tokens - second.cached_tokens  # only uncached tokens are computed
    assert model.prefill_ms([second]) < first_ms
    assert 0 < model.cache_hit_rate() < 1


def test_queue_grows_past_the_batch_limit_fifo() -> None:
    model = EngineModel(params(max_running=2))
    requests = [model.submit("m", text(100, str(i)), 3, None) for i in range(5)]
    assert model.admit() == requests[:2]
    assert [r.id for r in model.waiting] == [r.id for r in requests[2:]]
    assert model.queued_for("m") == 3 and model.running_for("m") == 2
    model.finish_prefill(requests[:2])
    assert model.admit() == []  # the batch is full: decode instead
    decode(model, 2)  # first token at prefill + 2 steps = 3 tokens: both finish
    assert requests[0].state == requests[1].state == "finished"
    assert model.admit() == requests[2:4]


# --- 1. admission accounting (PrefillAdder) ----------------------------------------------


def test_admission_takes_no_reply_from_the_pool_and_kv_grows_per_decode_step() -> None:
    model = EngineModel(params(kv_tokens=10_000))
    a, b = (model.submit("m", text(400, s), 50, max_tokens=400) for s in "ab")  # 100-token prompts
    model.finish_prefill(model.admit())
    assert model.running == [a, b]
    held = model.used_tokens
    assert held == 200  # the prompts only: nothing of the 400-token replies is taken up front
    for n in range(1, 11):
        decode(model, 1)
        assert model.used_tokens == held + 2 * n  # one token per running request per step


def test_admission_counts_running_requests_remaining_tokens_times_ratio() -> None:
    # 1000-token pool. `first`: 100-token prompt, may generate 800 tokens.
    early = EngineModel(params(kv_tokens=1000))
    first = early.submit("m", text(400, "a"), 700, max_tokens=800)
    early.finish_prefill(early.admit())
    # `second` needs 100 + 290 = 390; the pool has 900 free but `first` is expected to
    # need 799 × 0.7 ≈ 559 of it: refused, and the batch counts as full.
    early.submit("m", text(400, "b"), 200, max_tokens=290)
    assert early.admit() == [] and early.batch_is_full

    late = EngineModel(params(kv_tokens=1000))
    first = late.submit("m", text(400, "a"), 700, max_tokens=800)
    late.finish_prefill(late.admit())
    decode(late, 300)  # `first` holds 400 tokens; 499 left × ratio ≈ 0.4 ≈ 199 expected
    assert abs(late.new_token_ratio - 0.399) < 0.002 and late.used_tokens == 400
    second = late.submit("m", text(400, "b"), 200, max_tokens=290)
    assert late.admit() == [second]  # 390 < 600 free − 199 expected


def test_reply_estimate_is_clipped_at_4096_tokens() -> None:
    model = EngineModel(params(kv_tokens=4300))
    huge = model.submit("m", text(400), 10, max_tokens=100_000)  # needs 100 + min(100 000, 4096) = 4196
    assert model.admit() == [huge]


def test_decode_growth_evicts_unused_cache_before_anything_else() -> None:
    model = EngineModel(params(kv_tokens=400))  # 25 blocks
    old = model.submit("m", text(64 * 15, "o"), 1, max_tokens=1)  # leaves 15 blocks (240 tokens) cached
    run_to_end(model)
    assert model.cache.evictable == 15 and model.free_tokens == 160
    runner = model.submit("m", text(400, "r"), 150, max_tokens=200)  # 100 + 200 ≤ 160 free + 240 evictable
    model.finish_prefill(model.admit())
    assert model.running == [runner]
    run_to_end(model)
    assert runner.state == "finished" and runner.generated == 150
    assert model.counters.evicted_blocks >= 6 and model.counters.retractions == 0
    assert model.cache.cached_prefix(old.hashes) < 15


# --- 2. new_token_ratio decay, retraction ------------------------------------------------


def test_new_token_ratio_decays_to_a_tenth_over_600_steps_and_resets_when_idle() -> None:
    model = EngineModel(params())
    assert model.new_token_ratio == 0.7
    model.submit("m", text(100), 700, max_tokens=800)
    model.finish_prefill(model.admit())
    decode(model, 300)
    assert abs(model.new_token_ratio - (0.7 + 0.098) / 2) < 0.002
    decode(model, 300)
    assert abs(model.new_token_ratio - 0.098) < 1e-9
    decode(model, 50)
    assert abs(model.new_token_ratio - 0.098) < 1e-9  # the floor
    run_to_end(model)
    assert model.new_token_ratio == 0.7  # idle: start over


def test_decode_out_of_memory_retracts_and_requeues_with_prompt_cached() -> None:
    model = EngineModel(params(kv_tokens=600))
    first = model.submit("m", text(400, "a"), 400, max_tokens=400)
    model.finish_prefill(model.admit())
    decode(model, 300)  # first holds 400 tokens, expects 99 × 0.4 ≈ 40 more
    second = model.submit("m", text(64 * 4, "b"), 90, max_tokens=90)  # 64 + 90 fit under 200 − 40
    assert model.admit() == [second]
    model.finish_prefill([second])
    ratio_before = model.new_token_ratio
    steps = 0
    while model.counters.retractions == 0:  # together they need 500 + 154 > 600: a step runs out
        decode(model, 1)
        steps += 1
        assert steps < 200
    # the one with fewer generated tokens goes back to the end of the queue
    assert second.state == "waiting" and list(model.waiting) == [second] and model.running == [first]
    assert second.retractions == 1 and second.generated > 1 and not second.prefilled
    assert model.cache.cached_prefix(second.hashes) == len(second.hashes) == 4  # its prompt stays cached
    assert model.new_token_ratio > ratio_before
    # re-estimated from the remaining batch before the step's token: (generated + 20 × 1) / (max_new + 1)
    assert model.new_token_ratio == min(1.0, (first.generated - 1 + 20) / (first.max_new_tokens + 1))
    generated_before = second.generated
    run_to_end(model)
    assert first.state == second.state == "finished"
    assert first.generated == first.reply_tokens and second.generated == second.reply_tokens
    assert second.generated > generated_before  # it went on from where it was


# --- 3. chunked prefill ------------------------------------------------------------------


def test_long_prompts_prefill_in_chunks_and_the_chunk_continues_first() -> None:
    model = EngineModel(params(chunked_prefill_tokens=2048))
    long = model.submit("m", text(20_000, "l"), 5, max_tokens=10)  # 5000 tokens
    short = model.submit("m", text(400, "s"), 5, max_tokens=10)
    first = model.admit()
    assert first == [long] and long.extend_tokens == 2048 and model.chunked is long
    assert model.prefill_ms(first) == params().prefill_base_ms + 0.1 * 2048
    model.finish_prefill(first)
    assert not long.prefilled and model.running == []
    # the queue is not empty although nearly all of the pool is free
    assert model.queued_for("m") == 1 and model.free_tokens > 90_000
    second = model.admit()
    assert second == [long] and long.extend_tokens == 2048  # the unfinished one goes first, alone
    model.finish_prefill(second)
    third = model.admit()
    assert third == [long, short] and long.extend_tokens == 5000 - 4096 and short.extend_tokens == 100
    model.finish_prefill(third)
    assert long.prefilled and long.generated == 1 and model.chunked is None


def test_prefill_runs_before_decode() -> None:
    model = EngineModel(params())
    running = model.submit("m", text(100), 50, max_tokens=60)
    model.finish_prefill(model.admit())
    assert step(model) == "decode"
    newcomer = model.submit("m", text(100, "n"), 50, max_tokens=60)
    generated = running.generated
    assert step(model) == "prefill" and newcomer.prefilled
    assert running.generated == generated  # the decode batch waited for the prefill pass


# --- 4. no max_tokens ---------------------------------------------------------------------


def test_without_max_tokens_the_estimate_is_the_context_left_clipped_at_4096() -> None:
    model = EngineModel(params(kv_tokens=6000, context_tokens=8192))
    a = model.submit("m", text(400, "a"), 20, max_tokens=None)
    b = model.submit("m", text(400, "b"), 20, max_tokens=None)
    assert a.max_new_tokens == 8192 - 100
    assert model.admit() == [a]  # 100 + 4096 fit; b would need another 4196
    assert list(model.waiting) == [b]


# --- 5. decode cost (CUDA graphs) ---------------------------------------------------------


def test_decode_step_cost_grows_with_batch_and_steps_up_above_the_graph_size() -> None:
    model = EngineModel(params(cuda_graph_max_bs=8, decode_eager_ms=7.0))
    for i in range(9):
        model.submit("m", text(40, str(i)), 50, max_tokens=60)
    model.finish_prefill(model.admit())
    assert len(model.decoding()) == 9
    nine = model.decode_ms()
    model.abort(model.running[-1])
    eight = model.decode_ms()
    assert eight == 5.0 + 8 * 1.0  # base + per request: inside the captured graphs
    assert nine == eight + 1.0 + 7.0  # one more request, and no graph for batch 9


# --- 6. gauges: SGLang's meaning and staleness --------------------------------------------


def test_gauges_refresh_on_prefill_and_every_40_decode_steps() -> None:
    model = EngineModel(params(max_running=2))
    for i in range(2):
        model.submit("m", text(400, str(i)), 100, max_tokens=100)
    model.finish_prefill(model.admit())
    assert model.gauges.running == {"m": 2} and model.gauges.queued == {}
    model.submit("m", text(400, "q"), 100, max_tokens=100)
    decode(model, 39)
    assert model.gauges.queued == {}  # stale: the queue is not shown yet
    assert model.gauges.token_usage == 200 / 100_000
    decode(model, 1)
    assert model.gauges.queued == {"m": 1}
    assert model.gauges.token_usage == model.token_usage() == (200 + 2 * 40) / 100_000


def test_gauge_queue_counts_retracted_requests_and_token_usage_excludes_cache() -> None:
    model = EngineModel(params(kv_tokens=600, metrics_interval_steps=1))
    first = model.submit("m", text(400, "a"), 400, max_tokens=400)
    model.finish_prefill(model.admit())
    decode(model, 300)
    model.submit("m", text(64 * 4, "b"), 90, max_tokens=90)
    model.finish_prefill(model.admit())
    while model.counters.retractions == 0:
        decode(model, 1)
    assert model.gauges.queued == {"m": 1} and model.gauges.running == {"m": 1}
    held = first.prompt_tokens + first.generated - 1
    assert model.gauges.token_usage == held / 600  # the retracted prompt's cached blocks do not count
    assert model.pool_tokens > held


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


def test_preset_and_overrides() -> None:
    config = parse_args(["--preset", "laptop-1b", "--max-running", "7", "--time-scale", "0.5"])
    assert config.max_running == 7 and config.time_scale == 0.5
    assert config.kv_tokens == 24000 and config.prefill_ms_per_token > 0
    assert parse_args([]).max_running == 0  # the quick default stays unbounded
    sglang = parse_args(["--preset", "laptop-1b-sglang"])
    assert (sglang.chunked_prefill_tokens, sglang.cuda_graph_max_bs, sglang.metrics_interval_steps) == (2048, 8, 40)


CHAT = {"model": "fake-llama-1b", "messages": [{"role": "user", "content": "hi"}]}


async def ask(client: TestClient) -> None:
    response = await client.post("/v1/chat/completions", json=CHAT)
    assert response.status == 200
    await response.json()


async def test_time_scale_speeds_the_engine_up() -> None:
    async def duration(scale: float) -> float:
        clock = FakeClock()
        config = EngineConfig(latency_ms=100, token_ms=50, reply_tokens=4, time_scale=scale)
        app = create_app(config, Gpu(scale, clock))
        async with TestClient(TestServer(app)) as client:
            requests = Requests(clock)
            sent = requests.send(app[STATE_KEY].sim, ask(client))
            await requests.results()
        return requests.answered[sent]

    full, quarter = await duration(1.0), await duration(0.25)
    assert full == pytest.approx(0.25)  # prefill 100 ms (first token) + 3 steps of 50 ms
    assert quarter == pytest.approx(full / 4)


async def test_replicas_on_one_gpu_delay_each_other() -> None:
    async def two_at_once(shared: bool) -> list[float]:
        clock = FakeClock()
        config = EngineConfig(latency_ms=100, token_ms=50, reply_tokens=4)
        gpu = Gpu(1.0, clock)
        apps = [create_app(config, gpu if shared else Gpu(1.0, clock)) for _ in range(2)]
        async with TestClient(TestServer(apps[0])) as a, TestClient(TestServer(apps[1])) as b:
            requests = Requests(clock)
            sent = [requests.send(app[STATE_KEY].sim, ask(client)) for app, client in zip(apps, (a, b), strict=True)]
            await requests.results()
        return sorted(requests.answered[task] for task in sent)

    own_gpus = await two_at_once(shared=False)
    one_gpu = await two_at_once(shared=True)
    assert own_gpus == pytest.approx([0.25, 0.25])  # each replica's 250 ms, in parallel
    # the passes take turns (prefill a, prefill b, then a decode step each in turn): 500 ms
    assert one_gpu == pytest.approx([0.45, 0.5])


def test_one_process_serves_replicas_on_extra_ports(start_engine: Callable[..., str]) -> None:
    second = free_port()
    first = start_engine("--preset", "laptop-1b-sglang", "--time-scale", "0.1", "--extra-ports", str(second))
    other = f"http://127.0.0.1:{second}"
    request = urllib.request.Request(f"{other}/v1/chat/completions", data=json.dumps(CHAT).encode(),
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=10) as response:
        assert response.status == 200

    def stats(url: str) -> dict[str, float]:
        with urllib.request.urlopen(f"{url}/stats", timeout=5) as response:
            return json.loads(response.read())

    assert stats(other)["requests"] == 1 and stats(first)["requests"] == 0  # separate replicas
    assert stats(first)["gpu_busy_s"] == stats(other)["gpu_busy_s"] > 0  # one GPU
    with urllib.request.urlopen(f"{first}/metrics", timeout=5) as response:
        assert "sglang:num_retracted_reqs_total" in response.read().decode()


async def test_metrics_are_stale_until_a_refresh_and_refresh_after_30_idle_seconds() -> None:
    scale = 1 / 300  # a model second is scale seconds on the engine's clock
    clock = FakeClock()
    config = EngineConfig(latency_ms=30, token_ms=30, reply_tokens=4, metrics_interval_steps=1000, time_scale=scale)
    app = create_app(config, Gpu(scale, clock))
    async with TestClient(TestServer(app)) as client:
        async def running_gauge() -> float:
            text = await (await client.get("/metrics")).text()
            line = next(x for x in text.splitlines() if x.startswith("sglang:num_running_reqs{"))
            return float(line.rsplit(" ", 1)[1])

        async def refreshed() -> bool:
            return await running_gauge() == 0

        requests = Requests(clock)
        requests.send(app[STATE_KEY].sim, ask(client))
        await requests.results()
        stats = await (await client.get("/stats")).json()
        assert stats["running"] == 0 and stats["reported_running"] == 1  # as of the last prefill pass
        assert await running_gauge() == 1
        clock.advance(29 * scale)  # idle for 29 model seconds: still stale
        assert await running_gauge() == 1
        clock.advance(2 * scale)  # past 30
        await eventually(refreshed, what="the gauges refreshed after 30 idle model seconds")


async def test_gpu_counts_time_lost_to_a_busy_cpu_but_not_idle_time() -> None:
    clock = FakeClock()
    gpu = Gpu(1.0, clock)
    await passing(clock, gpu.run(10))
    clock.advance(0.1)  # the event loop is held up, as by a saturated CPU, while work is pending
    await passing(clock, gpu.run(10, continuing=True))
    assert gpu.lost_s == pytest.approx(0.08)  # 0.1 s behind, 0.02 s of it caught up
    lost = gpu.lost_s
    clock.advance(0.1)  # idle: nothing pending
    await passing(clock, gpu.run(10, continuing=False))
    assert gpu.lost_s == lost

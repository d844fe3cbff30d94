"""The pool file and engine probes, against real fake engines on loopback."""

from __future__ import annotations

import asyncio

import httpx
import pytest
from aiohttp import web

from luftpause.procs import ManagedProcess, free_port
from luftpause.scheduler.pool import Endpoint, PoolError, parse_pool
from luftpause.scheduler.probes import parse_load, probe, probe_client

GOOD = {"name": "a", "base_url": "http://127.0.0.1:1", "models": ["m"]}


@pytest.mark.parametrize(
    ("entry", "names"),
    [
        ({**GOOD, "name": ""}, "'name'"),
        ({**GOOD, "models": "m"}, "'models'"),
        ({**GOOD, "models": []}, "'models'"),
        ({**GOOD, "kind": "weird"}, "kind"),
        ({**GOOD, "base_url": "ftp://x"}, "base_url"),
        ({**GOOD, "colour": "red"}, "colour"),
        ({**GOOD, "base_url": "https://${NO_SUCH_VARIABLE_HERE}"}, "NO_SUCH_VARIABLE_HERE"),
    ],
)
def test_bad_pool_entry_is_rejected_naming_the_field(entry, names):
    with pytest.raises(PoolError) as error:
        parse_pool({"endpoints": [entry]})
    assert names in str(error.value) and "endpoints[0]" in str(error.value)


def test_pool_expands_environment_in_urls(monkeypatch):
    monkeypatch.setenv("POD_ID", "abc123")
    [endpoint] = parse_pool({"endpoints": [{**GOOD, "base_url": "https://${POD_ID}-8000.proxy.example/",
                                            "api_key_env": "POD_KEY"}]})
    assert endpoint.base_url == "https://abc123-8000.proxy.example"
    assert endpoint.api_key_env == "POD_KEY"


def test_scheduler_refuses_to_start_with_a_bad_pool_file(tmp_path):
    pool = tmp_path / "pool.yaml"
    pool.write_text("endpoints:\n  - name: a\n    base_url: http://x\n    models: nope\n")
    process = ManagedProcess("scheduler", "luftpause.scheduler", ["--pool-file", str(pool), "--grpc-port",
                             str(free_port()), "--http-port", str(free_port())], log_path=tmp_path / "log")
    process.start()
    assert process.process.wait(30) == 2
    assert "'models' must be a list of strings" in (tmp_path / "log").read_text()


def test_load_is_read_in_sglang_and_vllm_names():
    assert parse_load("sglang:num_running_reqs{model_name=\"m\"} 3\nsglang:num_queue_reqs{model_name=\"m\"} 2\n")[:2] == (3, 2)
    assert parse_load("vllm:num_requests_running 5\nvllm:num_requests_waiting 0\n")[:2] == (5, 0)
    assert parse_load("some_other_metric 1\n") is None


def test_kv_tokens_are_read_where_the_engine_reports_its_pool():
    sglang = ("sglang:num_running_reqs 3\nsglang:num_queue_reqs 0\nsglang:num_used_tokens 6000\n"
              "sglang:max_total_num_tokens 24000\n")
    assert parse_load(sglang) == (3, 0, 6000, 24000)
    from_share = "sglang:num_running_reqs 3\nsglang:num_queue_reqs 0\nsglang:token_usage 0.5\nsglang:max_total_num_tokens 1000\n"
    assert parse_load(from_share) == (3, 0, 500, 1000)
    vllm = ('vllm:num_requests_running 2\nvllm:num_requests_waiting 1\nvllm:kv_cache_usage_perc 0.25\n'
            'vllm:cache_config_info{block_size="16",num_gpu_blocks="1000"} 1\n')
    assert parse_load(vllm) == (2, 1, 4000, 16000)
    no_pool = "sglang:num_running_reqs 3\nsglang:num_queue_reqs 0\nsglang:token_usage 0.5\n"
    assert parse_load(no_pool) == (3, 0, 0, 0)


@pytest.fixture
def engines(tmp_path):
    """Two fake engines, one of them with a queue of two (4 streams, batch of 2)."""
    ports = [free_port(), free_port()]
    processes = [
        ManagedProcess(f"e{i}", "luftpause.fakes.engine",
                       ["--port", str(port), "--max-running", "1", "--metrics-format", fmt,
                        "--token-ms", "200", "--reply-tokens", "40"],
                       ready_url=f"http://127.0.0.1:{port}/health")
        for i, (port, fmt) in enumerate(zip(ports, ("sglang", "vllm"), strict=True))
    ]
    for p in processes:
        p.start()
    try:
        for p in processes:
            p.wait_ready()
        yield [f"http://127.0.0.1:{port}" for port in ports]
    finally:
        for p in processes:
            p.stop()


async def test_router_load_is_the_sum_of_the_engines_behind_it(engines):
    """Two streams on each engine (batch of one): each runs 1 and queues 1."""
    body = {"model": "fake-llama-1b", "messages": [{"role": "user", "content": "long answer"}], "stream": True}
    async with httpx.AsyncClient(timeout=30) as http:
        async def hold_stream(url):
            async with http.stream("POST", url + "/v1/chat/completions", json=body) as response:
                async for _ in response.aiter_bytes():
                    pass

        streams = [asyncio.create_task(hold_stream(url)) for url in engines for _ in range(2)]
        router = Endpoint("router", engines[0], ("m",), load_from=tuple(engines))
        async with probe_client() as client:
            for _ in range(50):
                result = await probe(client, router)
                if (result.running, result.queued) == (2, 2):
                    break
                await asyncio.sleep(0.1)
        for task in streams:
            task.cancel()
        await asyncio.gather(*streams, return_exceptions=True)
    assert result.healthy and (result.running, result.queued) == (2, 2)


async def test_unreachable_engine_is_unhealthy():
    async with probe_client() as client:
        result = await probe(client, Endpoint("gone", f"http://127.0.0.1:{free_port()}", ("m",)))
    assert not result.healthy


async def test_garbage_metrics_mean_no_load_and_name_the_problem():
    async def garbage(request):
        return web.Response(text="this is {{{ not prometheus\n")

    async def ok(request):
        return web.Response(text="ok")

    app = web.Application()
    app.router.add_get("/health", ok)
    app.router.add_get("/metrics", garbage)
    runner = web.AppRunner(app)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    try:
        async with probe_client() as client:
            result = await probe(client, Endpoint("junk", f"http://127.0.0.1:{port}", ("m",)))
    finally:
        await runner.cleanup()
    assert result.healthy and result.running is None and result.queued is None
    assert result.problems and result.problems[0][0].endswith("/metrics")
    await asyncio.sleep(0)

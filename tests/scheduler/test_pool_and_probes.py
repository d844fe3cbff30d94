"""The pool file and engine probes, against real fake engines on loopback."""

from __future__ import annotations

import asyncio
import re

import httpx
import pytest
from aiohttp import web

from luftpause.fakes.engine import EngineConfig
from luftpause.hints import HIGHER_FIRST, LOWER_FIRST, NO_HINTS, EngineHints
from luftpause.fakes.engine import create_app as create_engine_app
from luftpause.dev.procs import ManagedProcess, eventually, free_port, free_ports, served
from luftpause.scheduler.pool import Endpoint, PoolError, parse_pool
from luftpause.scheduler.core import DecodeCounters
from luftpause.scheduler.probes import ServerInfo, native_apis, parse_load, probe, probe_client, server_info

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
        ({**GOOD, "max_batch": 0}, "'max_batch'"),
        ({**GOOD, "max_batch": "8"}, "'max_batch'"),
        ({**GOOD, "max_batch": True}, "'max_batch'"),
        ({**GOOD, "native_apis": "messages"}, "'native_apis'"),
        ({**GOOD, "native_apis": ["messages", "completions"]}, "completions"),
        ({**GOOD, "base_url": "http://"}, "base_url"),
        ({**GOOD, "probe_url": "127.0.0.1:9001"}, "probe_url"),
        ({**GOOD, "probe_url": "http://host:port"}, "probe_url"),
        ({**GOOD, "probe_url": 9001}, "'probe_url'"),
        ({**GOOD, "probe_url": "http://${NO_SUCH_VARIABLE_HERE}"}, "NO_SUCH_VARIABLE_HERE"),
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


def test_a_probe_url_moves_only_the_probes(monkeypatch):
    monkeypatch.setenv("SIDECAR", "127.0.0.1:9100")
    [plain, sidecar] = parse_pool({"endpoints": [GOOD, {**GOOD, "name": "b", "probe_url": "http://${SIDECAR}/"}]})
    assert plain.probe_url == "" and plain.probed_at == plain.base_url
    assert sidecar.probed_at == "http://127.0.0.1:9100" and sidecar.base_url == GOOD["base_url"]


async def test_probes_go_to_the_probe_url_and_a_silent_one_is_unanswered_not_refused():
    """Health and load are read at probe_url (base_url here leads nowhere); a probe
    address that accepts and never answers is out of sight, a refusing one is down."""
    async def never(reader, writer):
        await asyncio.sleep(30)

    silent = await asyncio.start_server(never, "127.0.0.1", 0)
    silent_port = silent.sockets[0].getsockname()[1]
    nowhere = f"http://127.0.0.1:{free_port()}"
    async with served(create_engine_app(EngineConfig())) as url, probe_client() as client:
        seen = await probe(client, Endpoint("e", nowhere, ("m",), probe_url=url))
        unseen = await probe(client, Endpoint("e", url, ("m",),
                                              probe_url=f"http://127.0.0.1:{silent_port}"))
        refused = await probe(client, Endpoint("e", url, ("m",), probe_url=nowhere))
    silent.close()
    assert seen.healthy and seen.running is not None and not seen.unanswered
    assert not unseen.healthy and unseen.unanswered
    assert not refused.healthy and not refused.unanswered


def test_pool_declares_the_client_apis_an_engine_serves_itself():
    [plain, native, none] = parse_pool({"endpoints": [
        GOOD, {**GOOD, "name": "b", "native_apis": ["messages", "messages"]}, {**GOOD, "name": "c", "native_apis": []}]})
    assert plain.native_apis is None  # not listed: read from the engine's /openapi.json
    assert native.native_apis == ("messages",) and none.native_apis == ()


@pytest.mark.parametrize("openapi, expected", [(True, ("responses",)), (False, ())])
async def test_native_apis_are_read_from_the_routes_an_engine_publishes(openapi, expected):
    # The fake lists /v1/responses (as vLLM does), not /v1/messages; without /openapi.json
    # (llama.cpp) nothing is known and turns are translated.
    async with served(create_engine_app(EngineConfig(openapi=openapi))) as url, probe_client() as client:
        found = await native_apis(client, Endpoint("e", url, ("m",)))
        router = await native_apis(client, Endpoint("r", url, ("m",),
                                                    load_from=(url,)))
        gone = await native_apis(client, Endpoint("g", f"http://127.0.0.1:{free_port()}", ("m",)))
    assert (found, router, gone) == (expected, (), ())


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
    assert parse_load(sglang)[:4] == (3, 0, 6000, 24000)
    from_share = "sglang:num_running_reqs 3\nsglang:num_queue_reqs 0\nsglang:token_usage 0.5\nsglang:max_total_num_tokens 1000\n"
    assert parse_load(from_share)[:4] == (3, 0, 500, 1000)
    vllm = ('vllm:num_requests_running 2\nvllm:num_requests_waiting 1\nvllm:kv_cache_usage_perc 0.25\n'
            'vllm:cache_config_info{block_size="16",num_gpu_blocks="1000"} 1\n')
    assert parse_load(vllm)[:4] == (2, 1, 4000, 16000)
    no_pool = "sglang:num_running_reqs 3\nsglang:num_queue_reqs 0\nsglang:token_usage 0.5\n"
    assert parse_load(no_pool)[:4] == (3, 0, 0, 0)


def test_sglangs_generation_throughput_is_read_beside_its_load():
    """The scheduler reads a decode step's cost from it (core/ceiling.py); an engine that
    does not report it reads 0."""
    text = ('sglang:num_running_reqs{model_name="m"} 8\nsglang:num_queue_reqs{model_name="m"} 0\n'
            'sglang:gen_throughput{model_name="m"} 434.8\n')
    assert parse_load(text).gen_throughput == 434.8
    assert parse_load("sglang:num_running_reqs 3\nsglang:num_queue_reqs 0\n").gen_throughput == 0.0


def test_sglangs_decode_execution_counters_are_read_per_label():
    """SGLang's execution counters, per category or mode: the decode GPU seconds, decode
    tokens and graph / eager passes (the prefill's seconds and tokens are not the decode's);
    an engine that lacks any of them reports none."""
    text = ('sglang:num_running_reqs{model_name="m"} 8\nsglang:num_queue_reqs{model_name="m"} 0\n'
            '# TYPE sglang:gpu_execution_seconds counter\n'
            'sglang:gpu_execution_seconds_total{model_name="m",category="forward_decode"} 12.5\n'
            'sglang:gpu_execution_seconds_total{model_name="m",category="forward_extend"} 4.0\n'
            '# TYPE sglang:realtime_tokens counter\n'
            'sglang:realtime_tokens_total{model_name="m",mode="decode"} 5000\n'
            'sglang:realtime_tokens_total{model_name="m",mode="prefill_compute"} 90000\n'
            '# TYPE sglang:cuda_graph_passes counter\n'
            'sglang:cuda_graph_passes_total{model_name="m",mode="decode_cuda_graph"} 600\n'
            'sglang:cuda_graph_passes_total{model_name="m",mode="decode_none"} 40\n')
    assert parse_load(text).decode_counters == DecodeCounters(12.5, 5000, 600, 40)
    without_passes = "\n".join(line for line in text.splitlines() if "cuda_graph" not in line) + "\n"
    assert parse_load(without_passes).decode_counters is None
    assert parse_load("sglang:num_running_reqs 3\nsglang:num_queue_reqs 0\n").decode_counters is None


def test_the_engines_queue_time_histogram_is_read_beside_its_load():
    """SGLang's queue_time_seconds and vLLM's request_queue_time_seconds: the seconds
    requests waited in the queue, summed, and how many (limit.py tells an arrival from a
    queue by them); an engine without one reads None."""
    sglang = ('sglang:num_running_reqs 3\nsglang:num_queue_reqs 1\n# TYPE sglang:queue_time_seconds histogram\n'
              'sglang:queue_time_seconds_bucket{le="0.1"} 7\nsglang:queue_time_seconds_bucket{le="+Inf"} 9\n'
              'sglang:queue_time_seconds_sum 1.5\nsglang:queue_time_seconds_count 9\n')
    assert parse_load(sglang)[-2:] == (1.5, 9)
    vllm = ('vllm:num_requests_running 2\nvllm:num_requests_waiting 0\n'
            'vllm:request_queue_time_seconds_sum 0.25\nvllm:request_queue_time_seconds_count 4\n')
    assert parse_load(vllm)[-2:] == (0.25, 4)
    assert parse_load("sglang:num_running_reqs 3\nsglang:num_queue_reqs 0\n")[-2:] == (None, None)


def test_load_is_read_in_llama_cpp_and_tgi_names():
    llama_cpp = ("# HELP llamacpp:requests_processing Number of requests processing.\n"
                 "# TYPE llamacpp:requests_processing gauge\nllamacpp:requests_processing 4\n"
                 "# HELP llamacpp:requests_deferred Number of requests deferred.\n"
                 "# TYPE llamacpp:requests_deferred gauge\nllamacpp:requests_deferred 4\n"
                 "# TYPE llamacpp:prompt_tokens_total counter\nllamacpp:prompt_tokens_total 6886\n")
    assert parse_load(llama_cpp)[:4] == (4, 4, 0, 0)
    assert parse_load("# TYPE tgi_batch_current_size gauge\ntgi_batch_current_size 7\n"
                      "# TYPE tgi_queue_size gauge\ntgi_queue_size 3\n")[:4] == (7, 3, 0, 0)


@pytest.mark.parametrize("metrics_format", ["llamacpp", "tgi"])
async def test_fake_engine_in_llama_cpp_and_tgi_names_reports_known_load(metrics_format):
    engine = create_engine_app(EngineConfig(metrics_format=metrics_format))
    async with served(engine, handler_cancellation=True) as url, probe_client() as client:
        result = await probe(client, Endpoint("e", url, ("fake-llama-1b",)))
    assert result.healthy and (result.running, result.queued) == (0, 0) and not result.problems


async def test_metrics_without_a_known_load_metric_name_what_they_report():
    async def ok(request):
        return web.Response(text="ok")

    async def metrics(request):
        return web.Response(text="# TYPE my_engine_busy gauge\nmy_engine_busy 3\nmy_engine_tokens_total 9\n")

    app = web.Application()
    app.router.add_get("/health", ok)
    app.router.add_get("/metrics", metrics)
    async with served(app) as url, probe_client() as client:
        result = await probe(client, Endpoint("odd", url, ("m",)))
    assert result.healthy and result.running is None
    [(metrics_url, problem)] = result.problems
    assert metrics_url == url + "/metrics"
    assert "no known load metric" in problem and "my_engine_busy" in problem and "my_engine_tokens_total" in problem
    assert "llamacpp:requests_processing" in problem  # what it would have understood


async def test_scheduler_logs_a_replica_without_known_load_metrics_once(tmp_path):
    engine = create_engine_app(EngineConfig(metrics_format="none"))
    metrics_read = []  # the engine counts the scheduler's reads of its /metrics

    async def count_metrics_reads(request, response):
        if request.path == "/metrics":
            metrics_read.append(request.path)

    engine.on_response_prepare.append(count_metrics_reads)
    async with served(engine, handler_cancellation=True) as engine_url:
        await scheduler_reads_metrics(tmp_path, engine_url, metrics_read)
    lines = [line for line in (tmp_path / "scheduler.log").read_text().splitlines() if "no known load metric" in line]
    assert len(lines) == 1 and "quiet" in lines[0] and "engine_kv_cache_usage_ratio" in lines[0]


async def scheduler_reads_metrics(tmp_path, engine_url: str, metrics_read: list[str]) -> None:
    """A scheduler started on the one replica at ``engine_url``, stopped after it probed
    the replica healthy and read its metrics five more times."""
    grpc_port, http_port = free_ports(2)
    pool = tmp_path / "pool.yaml"
    pool.write_text(f"endpoints:\n  - name: quiet\n    base_url: {engine_url}\n    models: [fake-llama-1b]\n")
    scheduler = ManagedProcess("scheduler", "luftpause.scheduler",
                               ["--pool-file", str(pool), "--grpc-port", str(grpc_port), "--http-port",
                                str(http_port), "--probe-period", "0.1"],
                               ready_url=f"http://127.0.0.1:{http_port}/health", log_path=tmp_path / "scheduler.log")
    try:
        scheduler.start()
        await asyncio.to_thread(scheduler.wait_ready)
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{http_port}") as http:
            async def healthy() -> bool:
                return (await http.get("/status")).json()["replicas"][0]["healthy"]

            await eventually(healthy, what="the replica probed healthy")
        read_when_healthy = len(metrics_read)
        await eventually(lambda: len(metrics_read) >= read_when_healthy + 5, what="five more probes")
    finally:
        await asyncio.to_thread(scheduler.stop)


@pytest.fixture
def engines(tmp_path):
    """Two fake engines, one of them with a queue of two (4 streams, batch of 2)."""
    ports = free_ports(2)
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
            async def summed():  # the engines' gauges are refreshed, not live
                reading = await probe(client, router)
                return reading if (reading.running, reading.queued) == (2, 2) else None

            result = await eventually(summed, what="the router's load read as 2 running, 2 queued")
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
    async with served(app) as url, probe_client() as client:
        result = await probe(client, Endpoint("junk", url, ("m",)))
    assert result.healthy and result.running is None and result.queued is None
    assert result.problems and result.problems[0][0].endswith("/metrics")


def test_pool_max_batch_caps_the_replica():
    [endpoint] = parse_pool({"endpoints": [{**GOOD, "max_batch": 12}]})
    assert endpoint.replica().ceiling == 12 and parse_pool({"endpoints": [GOOD]})[0].replica().ceiling == 0


@pytest.mark.parametrize(("graphs", "expected"), [(8, 8), (0, 0)])
async def test_fast_batch_is_read_from_sglangs_server_info(graphs, expected):
    async with served(create_engine_app(EngineConfig(cuda_graph_max_bs=graphs))) as url, \
            probe_client() as client:
        size = (await server_info(client, Endpoint("e", url, ("m",)))).fast_batch
        # A router speaks for engines whose settings are their own; a dead port says nothing.
        router = await server_info(client, Endpoint("r", url, ("m",),
                                                    load_from=(url,)))
        gone = await server_info(client, Endpoint("g", f"http://127.0.0.1:{free_port()}", ("m",)))
    assert (size, router, gone) == (expected, ServerInfo(), ServerInfo())


@pytest.mark.parametrize(("flags", "expected"), [
    ({}, NO_HINTS),
    ({"enable_priority_scheduling": True}, EngineHints(HIGHER_FIRST)),
    ({"enable_priority_scheduling": True, "schedule_low_priority_values_first": True}, EngineHints(LOWER_FIRST)),
    ({"enable_session_radix_cache": True}, EngineHints(sessions=True)),
    # vLLM publishes no server info: its priority policy is declared in the pool, not guessed
    ({"scheduling_policy": "priority"}, NO_HINTS),
])
async def test_the_engines_agent_features_are_read_from_sglangs_server_info(flags, expected):
    async with served(create_engine_app(EngineConfig(**flags))) as url, probe_client() as client:
        info = await server_info(client, Endpoint("e", url, ("m",)))
    assert info.hints == expected


def test_pool_hints_declare_what_the_engine_reads_and_refuse_what_it_cannot():
    [vllm] = parse_pool({"endpoints": [{**GOOD, "hints": {"priority": "lower-first"}}]})
    [sglang] = parse_pool({"endpoints": [{**GOOD, "hints": {"priority": "higher-first", "sessions": True}}]})
    [llama] = parse_pool({"endpoints": [{**GOOD, "hints": {"slots": 4}}]})
    [none] = parse_pool({"endpoints": [{**GOOD, "hints": {"priority": "none", "slots": 0}}]})
    [absent] = parse_pool({"endpoints": [GOOD]})
    assert (vllm.hints, sglang.hints, llama.hints, none.hints, absent.hints) == (
        EngineHints(LOWER_FIRST), EngineHints(HIGHER_FIRST, True), EngineHints(slots=4), NO_HINTS, None)
    router = {**GOOD, "load_from": ["http://127.0.0.1:2"]}
    for entry, words in [({**GOOD, "hints": {"priority": "first"}},
                          "hints.priority must be one of lower-first, higher-first, dynamo or none"),
                         ({**GOOD, "hints": {"sessions": "yes"}}, "hints.sessions must be true or false"),
                         ({**GOOD, "hints": {"slots": -1}}, "hints.slots must be a whole number from 0 (none) to"),
                         ({**GOOD, "hints": {"slots": True}}, "hints.slots must be a whole number"),
                         ({**GOOD, "hints": {"slots": "4"}}, "hints.slots must be a whole number"),
                         ({**GOOD, "hints": {"id_slot": 1}}, "unknown hints ['id_slot']"),
                         ({**router, "hints": {"slots": 4}}, "hints.slots are one engine's slots, not a router's"),
                         ({**GOOD, "hints": ["priority"]}, "hints must be a mapping")]:
        with pytest.raises(PoolError, match=re.escape(f"endpoints[0]: {words}")):
            parse_pool({"endpoints": [entry]})


@pytest.mark.parametrize(("props", "expected"), [
    ({"total_slots": 4, "model_alias": "smollm2"}, EngineHints(slots=4)),
    ({"total_slots": 0}, NO_HINTS),
    ({"total_slots": "4"}, NO_HINTS),
    (None, NO_HINTS),  # no /props (and no server info): an engine that says nothing
])
async def test_llama_cpps_slots_are_read_from_its_props(props, expected):
    async def health(request):
        return web.Response(text="ok")

    async def answer_props(request):
        return web.json_response(props)

    app = web.Application()
    app.router.add_get("/health", health)
    if props is not None:
        app.router.add_get("/props", answer_props)
    async with served(app) as url, probe_client() as client:
        info = await server_info(client, Endpoint("e", url, ("m",)))
        router = await server_info(client, Endpoint("r", url, ("m",),
                                                    load_from=(url,)))
    assert (info, router) == (ServerInfo(hints=expected), ServerInfo())

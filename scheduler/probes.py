"""Engine probes: health on each endpoint's own path, load from its /metrics."""

from __future__ import annotations

import asyncio
import os
from dataclasses import dataclass, field
from typing import NamedTuple

import httpx
from prometheus_client.parser import text_string_to_metric_families

from luftpause.hints import NO_HINTS, EngineHints
from luftpause.scheduler.constants import PROBE_TIMEOUT_S
from luftpause.scheduler.core.state import DecodeCounters
from luftpause.scheduler.pool import Endpoint
from luftpause.scheduler.errors import SchedulerError

# (running, waiting) metric names per engine family, as each exposes them at /metrics.
# Ollama has no /metrics at all: its replicas are probed for health only and run uncapped.
LOAD_METRICS = (
    ("sglang:num_running_reqs", "sglang:num_queue_reqs"),  # SGLang
    ("vllm:num_requests_running", "vllm:num_requests_waiting"),  # vLLM
    ("llamacpp:requests_processing", "llamacpp:requests_deferred"),  # llama.cpp llama-server --metrics
    ("tgi_batch_current_size", "tgi_queue_size"),  # Hugging Face TGI
)
# SGLang's generation throughput: tokens generated over its last decode-log interval (every
# ``decode_log_interval`` decode steps, 40 by default) divided by that interval's wall time,
# refreshed with ``num_running_reqs``; with it the scheduler reads what a decode step costs.
GEN_THROUGHPUT_METRIC = "sglang:gen_throughput"
# SGLang's execution counters, per label: the GPU's busy time by forward-mode category
# (``"forward_" + ForwardMode.name.lower()``: forward_decode, forward_extend, ...; SGLang
# exports it with SGLANG_ENABLE_METRICS_DEVICE_TIMER=1), tokens by mode, decode passes
# from captured CUDA graphs or eager. Their decode samples, read between two probes, give
# a decode token's own cost (core/ceiling.py).
EXECUTION_LABELS = {
    "sglang:gpu_execution_seconds_total": "category",
    "sglang:realtime_tokens_total": "mode",
    "sglang:cuda_graph_passes_total": "mode",
}
DECODE_SECONDS = "sglang:gpu_execution_seconds_total{forward_decode}"
DECODE_TOKENS = "sglang:realtime_tokens_total{decode}"
GRAPH_PASSES = "sglang:cuda_graph_passes_total{decode_cuda_graph}"
EAGER_PASSES = "sglang:cuda_graph_passes_total{decode_none}"
# How long requests waited in the engine's queue before it first scheduled them
# (histograms: their ``_sum`` in seconds and ``_count``), per engine family.
QUEUE_TIME_METRICS = ("sglang:queue_time_seconds", "vllm:request_queue_time_seconds")
# SGLang's server arguments (``cuda_graph_max_bs`` among them); other engines answer 404.
SERVER_INFO_PATH = "/get_server_info"
# llama.cpp's settings (``total_slots``, its --parallel), asked where SGLang's are not there.
PROPS_PATH = "/props"
# Where vLLM and SGLang (FastAPI servers) publish their routes; a native client API is
# one whose path is listed there.
OPENAPI_PATH = "/openapi.json"
NATIVE_API_PATHS = (("messages", "/v1/messages"), ("responses", "/v1/responses"))
# At most this many of an unknown engine's metric names go into the log line about it.
SEEN_NAMES_LOGGED = 40


class BadMetrics(SchedulerError, ValueError):
    """An engine's /metrics is not Prometheus text."""


class Load(NamedTuple):
    running: int
    queued: int
    kv_used: int = 0  # KV tokens held; 0 when the engine does not say
    kv_total: int = 0  # KV pool in tokens; 0 when the engine does not say
    gen_throughput: float = 0.0  # tokens/s over the engine's last decode-log interval; 0 when it does not say
    decode_counters: DecodeCounters | None = None  # its execution counters, None when it does not report them
    queue_wait_s: float | None = None  # seconds requests waited in its queue so far, summed; None when not said
    queue_waits: int | None = None  # the requests those waits are of


def _queue_waits(totals: dict[str, float]) -> tuple[float | None, int | None]:
    """(seconds waited in the engine's queue, summed, and by how many requests) so far,
    from its queue-time histogram, or (None, None) when it exports none."""
    for name in QUEUE_TIME_METRICS:
        if name + "_sum" in totals and name + "_count" in totals:
            return max(0.0, totals[name + "_sum"]), max(0, int(totals[name + "_count"]))
    return None, None


def sample_totals(metrics_text: str) -> tuple[dict[str, float], dict[str, dict[str, str]]]:
    """Every sample summed by name, and the labels of the last sample of each name; the
    execution counters (EXECUTION_LABELS) also per label value, as ``name{value}``."""
    totals: dict[str, float] = {}
    labels: dict[str, dict[str, str]] = {}
    try:
        for family in text_string_to_metric_families(metrics_text):
            for sample in family.samples:
                totals[sample.name] = totals.get(sample.name, 0.0) + sample.value
                labels[sample.name] = sample.labels
                label = EXECUTION_LABELS.get(sample.name)
                if label is not None:
                    key = f"{sample.name}{{{sample.labels.get(label, '')}}}"
                    totals[key] = totals.get(key, 0.0) + sample.value
    except (ValueError, TypeError, IndexError, KeyError) as exc:
        raise BadMetrics(str(exc) or type(exc).__name__) from None
    return totals, labels


def _kv_tokens(totals: dict[str, float], labels: dict[str, dict[str, str]]) -> tuple[int, int]:
    """(KV tokens held, KV pool size) where the engine reports them, else (0, 0).
    SGLang: ``num_used_tokens`` (or ``token_usage``) and ``max_total_num_tokens``;
    vLLM: ``kv_cache_usage_perc`` and the pool from ``cache_config_info``'s labels."""
    total = totals.get("sglang:max_total_num_tokens", 0.0)
    if total > 0:
        used = totals.get("sglang:num_used_tokens")
        if used is None:
            used = totals.get("sglang:token_usage", 0.0) * total
        return int(used), int(total)
    config = labels.get("vllm:cache_config_info", {})
    try:
        total = float(config.get("num_gpu_blocks", 0)) * float(config.get("block_size", 0))
    except ValueError:
        total = 0.0
    usage = totals.get("vllm:kv_cache_usage_perc", totals.get("vllm:gpu_cache_usage_perc"))
    if total > 0 and usage is not None:
        return int(usage * total), int(total)
    return 0, 0


def _decode_counters(totals: dict[str, float]) -> DecodeCounters | None:
    """SGLang's decode execution counters, where the engine reports all of them."""
    if not all(name in totals for name in (DECODE_SECONDS, DECODE_TOKENS, GRAPH_PASSES, EAGER_PASSES)):
        return None
    return DecodeCounters(totals[DECODE_SECONDS], int(totals[DECODE_TOKENS]), int(totals[GRAPH_PASSES]),
                          int(totals[EAGER_PASSES]))


def _known_load(totals: dict[str, float], labels: dict[str, dict[str, str]]) -> Load | None:
    for running_name, queued_name in LOAD_METRICS:
        if running_name in totals and queued_name in totals:
            return Load(int(totals[running_name]), int(totals[queued_name]), *_kv_tokens(totals, labels),
                        max(0.0, totals.get(GEN_THROUGHPUT_METRIC, 0.0)), _decode_counters(totals), *_queue_waits(totals))
    return None


def parse_load(metrics_text: str) -> Load | None:
    """Running and queued requests (and KV tokens where reported) from Prometheus text
    in SGLang, vLLM, llama.cpp or TGI names, or None when the engine reports no load.
    Raises BadMetrics on text that does not parse."""
    return _known_load(*sample_totals(metrics_text))


def unknown_load_problem(totals: dict[str, float]) -> str:
    """What to log about a /metrics that answers without any known load metric."""
    seen = sorted(totals)
    shown = ", ".join(seen[:SEEN_NAMES_LOGGED]) + (f" (+{len(seen) - SEEN_NAMES_LOGGED} more)"
                                                  if len(seen) > SEEN_NAMES_LOGGED else "")
    known = ", ".join(f"{running}/{queued}" for running, queued in LOAD_METRICS)
    return f"no known load metric (known: {known}); it reports: {shown or 'nothing'}"


def auth_headers(endpoint: Endpoint) -> dict[str, str]:
    key = os.environ.get(endpoint.api_key_env, "") if endpoint.api_key_env else ""
    return {"Authorization": f"Bearer {key}"} if key else {}


@dataclass(frozen=True)
class ProbeResult:
    healthy: bool
    running: int | None = None  # None: no load reported
    queued: int | None = None
    kv_used: int | None = None  # None: no KV tokens reported
    kv_total: int | None = None
    problems: tuple[tuple[str, str], ...] = field(default=())  # (metrics URL, what is wrong with it)
    load_stale: bool = False  # a metrics source did not answer in time: load unknown, not zero
    unanswered: bool = False  # the health route did not answer in time: out of sight, not known down
    gen_throughput: float | None = None  # the engine's tokens/s (one engine only), None when not reported
    decode_counters: DecodeCounters | None = None  # its execution counters (one engine only), None when not reported
    queue_wait_s: float | None = None  # seconds requests waited in the engine queues so far, summed; None: not reported
    queue_waits: int | None = None  # the requests those waits are of


class _Unanswered(NamedTuple):
    """A metrics source that accepted the request and did not answer within the probe's
    timeout (a wedged /metrics): its load is unknown, not absent."""


async def _load_of(
    client: httpx.AsyncClient, base_url: str, endpoint: Endpoint
) -> Load | tuple[str, str] | _Unanswered | None:
    """(running, queued) at one metrics source, None when not reported, _Unanswered when
    it timed out, or (url, problem): text that does not parse, or metrics that answer
    with no known load metric."""
    try:
        response = await client.get(base_url + endpoint.metrics_path, headers=auth_headers(endpoint))
    except httpx.TimeoutException:
        return _Unanswered()
    except httpx.HTTPError:
        return None
    if response.status_code != 200:
        return None
    try:
        totals, labels = sample_totals(response.text)
    except BadMetrics as exc:
        return (base_url + endpoint.metrics_path, f"not Prometheus text: {exc}")
    load = _known_load(totals, labels)
    return load if load is not None else (base_url + endpoint.metrics_path, unknown_load_problem(totals))


async def probe(client: httpx.AsyncClient, endpoint: Endpoint) -> ProbeResult:
    """Health and load of one endpoint. A router's load is the sum over the engines
    listed in its ``load_from``; if any of them reports none, the router is uncapped."""
    try:
        health = await client.get(endpoint.probed_at + endpoint.health_path, headers=auth_headers(endpoint))
        healthy = health.status_code == 200
    except httpx.TimeoutException:  # no answer at all (a partition, a blackhole): not a refusal
        return ProbeResult(False, unanswered=True)
    except httpx.HTTPError:
        healthy = False
    if not healthy:
        return ProbeResult(False)
    sources = endpoint.load_from or (endpoint.probed_at,)
    loads = await asyncio.gather(*(_load_of(client, url, endpoint) for url in sources))
    if any(isinstance(load, _Unanswered) for load in loads):
        return ProbeResult(True, load_stale=True)
    problems = tuple(load for load in loads if load is not None and not isinstance(load, Load))
    numbers = [load for load in loads if isinstance(load, Load)]
    if len(numbers) != len(loads):
        return ProbeResult(True, problems=problems)
    kv_known = all(n.kv_total > 0 for n in numbers)
    # A step time is one engine's: a router's summed throughput over its engines says none.
    throughput = numbers[0].gen_throughput if len(numbers) == 1 and numbers[0].gen_throughput > 0 else None
    waits_known = all(n.queue_waits is not None for n in numbers)
    return ProbeResult(
        True, sum(n.running for n in numbers), sum(n.queued for n in numbers),
        sum(n.kv_used for n in numbers) if kv_known else None, sum(n.kv_total for n in numbers) if kv_known else None,
        gen_throughput=throughput, decode_counters=numbers[0].decode_counters if len(numbers) == 1 else None,
        queue_wait_s=sum(n.queue_wait_s or 0.0 for n in numbers) if waits_known else None,
        queue_waits=sum(n.queue_waits or 0 for n in numbers) if waits_known else None,
    )


@dataclass(frozen=True)
class ServerInfo:
    """What an engine says of its own settings (SGLang's ``/get_server_info`` carries its
    server arguments, llama.cpp's ``/props`` its slots; other engines, and routers, say
    nothing here)."""

    fast_batch: int = 0  # the largest decode batch it runs at full speed; 0 = unknown
    hints: EngineHints = NO_HINTS  # the agent features it was started with (luftpause/hints.py)


async def server_info(client: httpx.AsyncClient, endpoint: Endpoint) -> ServerInfo:
    """The engine's settings, as far as it reports them: batches up to
    ``cuda_graph_max_bs`` replay captured CUDA graphs, larger ones run eagerly (unless
    ``disable_cuda_graph``, when none is fast); ``enable_priority_scheduling``,
    ``schedule_low_priority_values_first`` and ``enable_session_radix_cache`` are the
    features luftpause drives. An engine without SGLang's server info is asked llama.cpp's
    ``/props``: its ``total_slots``. A router's engines' settings are their own."""
    if endpoint.load_from:
        return ServerInfo()
    info = await _json_at(client, endpoint, SERVER_INFO_PATH)
    if info is None:
        props = await _json_at(client, endpoint, PROPS_PATH)
        return ServerInfo(hints=EngineHints.from_props(props)) if props is not None else ServerInfo()
    size = info.get("cuda_graph_max_bs")
    fast = size if isinstance(size, int) and not isinstance(size, bool) and size > 0 else 0
    return ServerInfo(0 if info.get("disable_cuda_graph") is True else fast, EngineHints.from_server_info(info))


async def _json_at(client: httpx.AsyncClient, endpoint: Endpoint, path: str) -> dict | None:
    """The JSON object the engine answers a GET of ``path`` with (None: not there, not an object)."""
    try:
        response = await client.get(endpoint.probed_at + path, headers=auth_headers(endpoint))
        document = response.json() if response.status_code == 200 else None
    except (httpx.HTTPError, ValueError):
        return None
    return document if isinstance(document, dict) else None


async def native_apis(client: httpx.AsyncClient, endpoint: Endpoint) -> tuple[str, ...]:
    """The client APIs besides chat completions the engine serves itself: those whose
    path its ``/openapi.json`` lists (vLLM and SGLang publish one; an engine without it,
    or a router, serves none as far as luftpause knows: its turns are translated)."""
    if endpoint.load_from:  # a router: what its engines serve is theirs to say
        return ()
    try:
        response = await client.get(endpoint.probed_at + OPENAPI_PATH, headers=auth_headers(endpoint))
        document = response.json() if response.status_code == 200 else None
    except (httpx.HTTPError, ValueError):
        return ()
    paths = document.get("paths") if isinstance(document, dict) else None
    if not isinstance(paths, dict):
        return ()
    return tuple(name for name, path in NATIVE_API_PATHS if isinstance(paths.get(path), dict) and "post" in paths[path])


async def answers(client: httpx.AsyncClient, endpoint: Endpoint, slot: int | None = None) -> bool:
    """Whether the engine streams a one-token generation to its end within the probe
    timeout: the probe that brings a stalled replica back (its health route may answer
    while generation is wedged, and an engine that stalls mid-stream sends a first chunk).
    ``slot``: the engine slot it takes (llama.cpp's ``id_slot``; scheduler/engine_slots.py),
    so that it does not take a slot holding a run's KV."""
    body = {"model": endpoint.models[0], "messages": [{"role": "user", "content": "ping"}], "max_tokens": 1,
            "stream": True, **({"id_slot": slot} if slot is not None else {})}
    try:
        async with asyncio.timeout(PROBE_TIMEOUT_S):
            async with client.stream("POST", endpoint.probed_at + "/v1/chat/completions", json=body,
                                     headers=auth_headers(endpoint)) as response:
                if response.status_code != 200:
                    return False
                received = b""
                async for chunk in response.aiter_bytes():
                    received += chunk
                return b"data:" in received  # the stream ended, with an answer in it
    except (httpx.HTTPError, TimeoutError):
        return False


def probe_client() -> httpx.AsyncClient:
    return httpx.AsyncClient(timeout=httpx.Timeout(PROBE_TIMEOUT_S), trust_env=False)

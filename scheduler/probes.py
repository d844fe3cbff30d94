"""Engine probes: health on each endpoint's own path, load from its /metrics."""

from __future__ import annotations

import asyncio
import os
from dataclasses import dataclass, field

import httpx
from prometheus_client.parser import text_string_to_metric_families

from luftpause.scheduler.constants import PROBE_TIMEOUT_S
from luftpause.scheduler.pool import Endpoint

# (running, waiting) metric names per engine family.
LOAD_METRICS = (
    ("sglang:num_running_reqs", "sglang:num_queue_reqs"),
    ("vllm:num_requests_running", "vllm:num_requests_waiting"),
)


class BadMetrics(ValueError):
    """An engine's /metrics is not Prometheus text."""


def parse_load(metrics_text: str) -> tuple[int, int] | None:
    """(running, queued) from Prometheus text in SGLang or vLLM names, or None when
    the engine reports neither. Raises BadMetrics on text that does not parse."""
    totals: dict[str, float] = {}
    try:
        for family in text_string_to_metric_families(metrics_text):
            for sample in family.samples:
                totals[sample.name] = totals.get(sample.name, 0.0) + sample.value
    except (ValueError, TypeError, IndexError, KeyError) as exc:
        raise BadMetrics(str(exc) or type(exc).__name__) from None
    for running_name, queued_name in LOAD_METRICS:
        if running_name in totals and queued_name in totals:
            return int(totals[running_name]), int(totals[queued_name])
    return None


def auth_headers(endpoint: Endpoint) -> dict[str, str]:
    key = os.environ.get(endpoint.api_key_env, "") if endpoint.api_key_env else ""
    return {"Authorization": f"Bearer {key}"} if key else {}


@dataclass(frozen=True)
class ProbeResult:
    healthy: bool
    running: int | None = None  # None: no load reported
    queued: int | None = None
    problems: tuple[tuple[str, str], ...] = field(default=())  # (metrics URL, what is wrong with it)


async def _load_of(
    client: httpx.AsyncClient, base_url: str, endpoint: Endpoint
) -> tuple[int, int] | tuple[str, str] | None:
    """(running, queued) at one metrics source, None when not reported, or (url, problem)."""
    try:
        response = await client.get(base_url + endpoint.metrics_path, headers=auth_headers(endpoint))
    except httpx.HTTPError:
        return None
    if response.status_code != 200:
        return None
    try:
        return parse_load(response.text)
    except BadMetrics as exc:
        return (base_url + endpoint.metrics_path, f"not Prometheus text: {exc}")


async def probe(client: httpx.AsyncClient, endpoint: Endpoint) -> ProbeResult:
    """Health and load of one endpoint. A router's load is the sum over the engines
    listed in its ``load_from``; if any of them reports none, the router is uncapped."""
    try:
        health = await client.get(endpoint.base_url + endpoint.health_path, headers=auth_headers(endpoint))
        healthy = health.status_code == 200
    except httpx.HTTPError:
        healthy = False
    if not healthy:
        return ProbeResult(False)
    sources = endpoint.load_from or (endpoint.base_url,)
    loads = await asyncio.gather(*(_load_of(client, url, endpoint) for url in sources))
    problems = tuple(load for load in loads if load is not None and isinstance(load[0], str))
    numbers = [load for load in loads if load is not None and isinstance(load[0], int)]
    if len(numbers) != len(loads):
        return ProbeResult(True, problems=problems)
    return ProbeResult(True, sum(n[0] for n in numbers), sum(n[1] for n in numbers))


def probe_client() -> httpx.AsyncClient:
    return httpx.AsyncClient(timeout=httpx.Timeout(PROBE_TIMEOUT_S), trust_env=False)

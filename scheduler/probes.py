"""Engine probes: health on each endpoint's own path, load from its /metrics."""

from __future__ import annotations

import asyncio
import os

import httpx
from prometheus_client.parser import text_string_to_metric_families

from luftpause.scheduler.constants import PROBE_TIMEOUT_S
from luftpause.scheduler.pool import Endpoint

# (running, waiting) metric names per engine family.
LOAD_METRICS = (
    ("sglang:num_running_reqs", "sglang:num_queue_reqs"),
    ("vllm:num_requests_running", "vllm:num_requests_waiting"),
)


def parse_load(metrics_text: str) -> tuple[int, int] | None:
    """(running, queued) from Prometheus text in SGLang or vLLM names, or None."""
    totals: dict[str, float] = {}
    for family in text_string_to_metric_families(metrics_text):
        for sample in family.samples:
            totals[sample.name] = totals.get(sample.name, 0.0) + sample.value
    for running_name, queued_name in LOAD_METRICS:
        if running_name in totals and queued_name in totals:
            return int(totals[running_name]), int(totals[queued_name])
    return None


def auth_headers(endpoint: Endpoint) -> dict[str, str]:
    key = os.environ.get(endpoint.api_key_env, "") if endpoint.api_key_env else ""
    return {"Authorization": f"Bearer {key}"} if key else {}


async def _load_of(client: httpx.AsyncClient, base_url: str, endpoint: Endpoint) -> tuple[int, int] | None:
    try:
        response = await client.get(base_url + endpoint.metrics_path, headers=auth_headers(endpoint))
        if response.status_code != 200:
            return None
        return parse_load(response.text)
    except (httpx.HTTPError, ValueError):
        return None


async def probe(client: httpx.AsyncClient, endpoint: Endpoint) -> tuple[bool, int | None, int | None]:
    """(healthy, running, queued) for one endpoint; load None when not reported.

    A router's load is the sum over the engines listed in its ``load_from``."""
    try:
        health = await client.get(endpoint.base_url + endpoint.health_path, headers=auth_headers(endpoint))
        healthy = health.status_code == 200
    except httpx.HTTPError:
        healthy = False
    if not healthy:
        return False, None, None
    sources = endpoint.load_from or (endpoint.base_url,)
    loads = await asyncio.gather(*(_load_of(client, url, endpoint) for url in sources))
    if any(load is None for load in loads):
        return True, None, None
    return True, sum(load[0] for load in loads), sum(load[1] for load in loads)


def probe_client() -> httpx.AsyncClient:
    return httpx.AsyncClient(timeout=httpx.Timeout(PROBE_TIMEOUT_S), trust_env=False)

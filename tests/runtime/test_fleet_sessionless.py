"""Runtimes of a fleet behind a load balancer without affinity: a real Envoy sending each
request to the next of two runtimes (round robin), as an ingress or a service mesh in front
of a Deployment does. A handshake-era MCP client (the Python SDK in its legacy mode, as
Claude Code speaks) keeps working with ``--mcp-sessions none``: spawn, status and await each
land on either runtime. With sessions kept, its second request reaches a runtime that never
saw its session."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml
from mcp import Client
from runtime_doubles import LocalDataplane, RuntimeProcess

from luftpause import envoy
from luftpause.dev.procs import WAIT_S, ManagedProcess, start_on_free_ports

pytestmark = pytest.mark.timeout(180)


def envoy_config(port: int, admin_port: int, runtimes: list[int]) -> dict[str, Any]:
    """A listener that sends each request to the next runtime, streaming both ways."""
    endpoints = [{"endpoint": {"address": {"socket_address": {"address": "127.0.0.1", "port_value": p}}}}
                 for p in runtimes]
    manager = {
        "@type": "type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3"
                 ".HttpConnectionManager",
        "stat_prefix": "mcp", "stream_idle_timeout": "0s",
        "route_config": {"virtual_hosts": [{"name": "all", "domains": ["*"], "routes": [
            {"match": {"prefix": "/"}, "route": {"cluster": "runtimes", "timeout": "0s"}}]}]},
        "http_filters": [{"name": "envoy.filters.http.router", "typed_config": {
            "@type": "type.googleapis.com/envoy.extensions.filters.http.router.v3.Router"}}],
    }
    return {
        "admin": {"address": {"socket_address": {"address": "127.0.0.1", "port_value": admin_port}}},
        "static_resources": {
            "listeners": [{"name": "mcp", "address": {"socket_address": {"address": "127.0.0.1", "port_value": port}},
                           "filter_chains": [{"filters": [{"name": "envoy.filters.network.http_connection_manager",
                                                           "typed_config": manager}]}]}],
            "clusters": [{"name": "runtimes", "type": "STATIC", "lb_policy": "ROUND_ROBIN", "connect_timeout": "2s",
                          "load_assignment": {"cluster_name": "runtimes", "endpoints": [{"lb_endpoints": endpoints}]}}],
        },
    }


@pytest.fixture
def balanced(start_runtime: Callable[..., RuntimeProcess], tools_file: Path, tmp_path: Path, database: str,
             process_logs: Path) -> Iterator[Callable[..., tuple[str, str]]]:
    """start(base_url, sessions) -> (the balancer's /mcp URL, its admin URL)."""
    started: list[ManagedProcess] = []

    def start(base_url: str, sessions: str) -> tuple[str, str]:
        runtimes = [start_runtime(base_url, tools_file, tmp_path / f"{sessions}-{name}", {
            "LUFTPAUSE_JOURNAL": database, "LUFTPAUSE_RUNTIME_ID": f"{sessions}-{name}",
            "LUFTPAUSE_MCP_SESSIONS": sessions}) for name in ("a", "b")]

        def balancer(ports: list[int]) -> ManagedProcess:
            config = tmp_path / f"envoy-{sessions}.yaml"
            upstreams = [int(r.url.rsplit(":", 1)[1]) for r in runtimes]
            config.write_text(yaml.safe_dump(envoy_config(ports[0], ports[1], upstreams)))
            return ManagedProcess(name="envoy", module="envoy", ready_url=f"http://127.0.0.1:{ports[1]}/ready",
                                  log_path=process_logs / f"envoy-{ports[0]}.log",
                                  command=[str(envoy.ensure()), "-c", str(config), "--disable-hot-restart",
                                           "--log-level", "warn"])

        process, (port, admin) = start_on_free_ports(balancer, count=2, timeout=WAIT_S)
        started.append(process)
        return f"http://127.0.0.1:{port}/mcp", f"http://127.0.0.1:{admin}"

    yield start
    for process in started:
        process.stop()


async def spawn_status_await(url: str) -> dict[str, Any]:
    async with Client(url, mode="legacy") as client:
        spawned = await client.call_tool("spawn", {"task": "anywhere", "tools": ["lookup"]})
        assert not spawned.is_error, spawned.content
        handle = json.loads(spawned.content[0].text)["handle"]
        for _ in range(3):  # the next requests land on both runtimes
            status = await client.call_tool("status", {"handles": [handle]})
            assert not status.is_error, status.content
        done = await client.call_tool("await", {"handles": [handle], "timeout": WAIT_S})
        assert not done.is_error, done.content
        return json.loads(done.content[0].text)["runs"][0]


def requests_per_runtime(admin: str) -> list[int]:
    """Envoy's count of the requests it sent to each runtime."""
    lines = httpx.get(f"{admin}/clusters").text.splitlines()
    return [int(line.rsplit("::", 1)[1]) for line in lines if line.startswith("runtimes::") and "::rq_total::" in line]


async def test_a_handshake_era_client_works_through_any_runtime_with_no_session_kept(balanced, fake_mcp) -> None:
    async with LocalDataplane(calls=1).serving() as base_url:
        url, admin = balanced(base_url, "none")
        run = await spawn_status_await(url)
    assert run["status"] == "Completed" and run["toolCalls"] == 1 and run["result"] == "recorded answer"
    assert [count >= 3 for count in requests_per_runtime(admin)] == [True, True]


async def test_with_sessions_kept_the_client_must_keep_to_one_runtime(balanced, fake_mcp) -> None:
    async with LocalDataplane(calls=1).serving() as base_url:
        url, _ = balanced(base_url, "kept")
        with pytest.raises(ExceptionGroup) as raised:  # the SDK's task group, around the 404's error
            await spawn_status_await(url)
    assert "Session not found" in repr(raised.value)

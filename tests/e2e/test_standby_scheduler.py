"""Two schedulers on one lead lock (PostgreSQL, scheduler/leader.py): one leads, the other
stands by (not ready, refusing dataplanes); the dataplane, given both addresses, follows
the leader; when the leader dies or loses the database the standby takes over and turns
go on being placed, once each."""

from __future__ import annotations

import contextlib
import time
import urllib.parse
from collections.abc import AsyncIterator

import httpx

from luftpause import vocabulary as h
from luftpause.dev.faultproxy import FaultProxy
from luftpause.dev.procs import ManagedProcess, eventually, free_ports
from luftpause.dev.stack import HOST, MODEL, Stack

WITHOUT = frozenset({"runtime", "fake-mcp"})


def scheduler(tmp_path, stack_pool, database: str, name: str) -> tuple[ManagedProcess, int, int]:
    grpc_port, http_port = free_ports(2)
    process = ManagedProcess(name, "luftpause.scheduler",
                             ["--host", HOST, "--grpc-port", str(grpc_port), "--http-port", str(http_port),
                              "--pool-file", str(stack_pool)],
                             env={"LUFTPAUSE_LEAD_LOCK": database}, ready_url=f"http://{HOST}:{http_port}/health",
                             log_path=tmp_path / f"{name}.log")
    process.start()
    process.wait_ready(30)
    return process, grpc_port, http_port


def ready(http_port: int) -> httpx.Response:
    return httpx.get(f"http://{HOST}:{http_port}/ready", timeout=5)


def leading(http_port: int) -> bool:
    return not any(p.startswith("standby") for p in ready(http_port).json()["problems"])


def turn(stack, run_id: str) -> httpx.Response:
    return httpx.post(f"http://{HOST}:{stack.ports.dataplane}/v1/chat/completions", timeout=30,
                      headers={h.RUN_ID: run_id},
                      json={"model": MODEL, "messages": [{"role": "user", "content": run_id}]})


def engine_requests(stack) -> int:
    return sum(httpx.get(f"http://{HOST}:{port}/stats").json()["requests"] for port in stack.ports.engines)


@contextlib.asynccontextmanager
async def led_stack(tmp_path, database: str, leader_lock: str) -> AsyncIterator[tuple[Stack, ManagedProcess]]:
    """A leading scheduler (on ``leader_lock``, the database's URL or a way to it) started
    first, then the stack: engines, its own scheduler on the same lead lock, which stands
    by, and a dataplane given the leader's address first; a turn answered through it."""
    stack = Stack.on_free_ports(tmp_path / "stack", without=WITHOUT, env={"LUFTPAUSE_LEAD_LOCK": database})
    first, first_grpc, first_http = scheduler(tmp_path, stack.pool_file, leader_lock, "scheduler-first")
    try:
        await eventually(lambda: leading(first_http), timeout=30, what="the first scheduler leading")
        stack.dataplane_scheduler = f"{HOST}:{first_grpc},{HOST}:{stack.ports.scheduler_grpc}"
        stack.start()
        assert turn(stack, "before").status_code == 200
        yield stack, first
    finally:
        first.stop()
        stack.stop()


async def test_the_standby_refuses_then_takes_over_within_seconds_and_nothing_is_placed_twice(database, tmp_path):
    async with led_stack(tmp_path, database, database) as (stack, first):
        standby = ready(stack.ports.scheduler_http)
        assert standby.status_code == 503
        assert any("standby: another scheduler holds the lead lock" in p for p in standby.json()["problems"])

        first.kill()  # kill -9: its session ends, the lock is free
        killed = time.monotonic()
        await eventually(lambda: ready(stack.ports.scheduler_http).status_code == 200 or None, timeout=10,
                         what="the standby leading")
        took_over = time.monotonic() - killed
        response = turn(stack, "after")
        answered = time.monotonic() - killed
        assert response.status_code == 200, response.text
        assert took_over < 3.0 and answered < 3.0, (took_over, answered)
        assert engine_requests(stack) == 2  # each turn placed once


async def test_a_leader_cut_off_from_the_database_exits_before_the_standby_leads(database, tmp_path):
    """The leader reaches PostgreSQL through a link that is then cut (packets dropped, not
    refused): it stops leading by exiting within about a second, and the database frees
    the lock only after it, so two never lead at once."""
    url = urllib.parse.urlsplit(database)
    proxy = FaultProxy(url.port).start()
    through_proxy = url._replace(netloc=url.netloc.replace(f":{url.port}", f":{proxy.port}")).geturl()
    try:
        async with led_stack(tmp_path, database, through_proxy) as (stack, first):
            proxy.cut()
            cut = time.monotonic()
            await eventually(lambda: leading(stack.ports.scheduler_http), timeout=15, what="the standby leading")
            took_over = time.monotonic() - cut
            assert first.process.poll() == 3, "the cut-off leader had not stopped leading when the standby began"
            assert "scheduler_lead_lost" in (tmp_path / "scheduler-first.log").read_text()
            assert turn(stack, "after").status_code == 200
            assert engine_requests(stack) == 2
            assert took_over < 4.0, took_over
    finally:
        proxy.close()

"""The scheduler's host probing two fake engines in process, one of them through a real
TCP fault proxy on its probe_url: cut, it goes out of sight (not down) within a probe
timeout and a period, its peer's readings go on at their own pace meanwhile, and it is
back in rotation at once when the link heals."""

from __future__ import annotations

import asyncio
import time

import structlog

from luftpause.dev.faultproxy import FaultProxy
from luftpause.fakes.engine import EngineConfig
from luftpause.fakes.engine import create_app as create_engine_app
from luftpause.scheduler.constants import PROBE_TIMEOUT_S
from luftpause.scheduler.host import SchedulerHost
from luftpause.scheduler.pool import Endpoint

from tests.scheduler.test_pool_and_probes import serve_app

MODEL = "fake-llama-1b"
PERIOD_S = 0.5  # a short probe period, so a's rounds are countable within one b timeout


async def until(predicate, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        await asyncio.sleep(0.02)
    return False


async def test_a_cut_probe_path_puts_one_engine_out_of_sight_without_slowing_its_peers_probes():
    runner_a, url_a = await serve_app(create_engine_app(EngineConfig()))
    runner_b, url_b = await serve_app(create_engine_app(EngineConfig()))
    proxy = FaultProxy(int(url_b.rsplit(":", 1)[1])).start()
    host = SchedulerHost([Endpoint("a", url_a, (MODEL,)),
                          Endpoint("b", url_b, (MODEL,), probe_url=f"http://{proxy.address}")],
                         structlog.get_logger(), probe_period_s=PERIOD_S)
    applied: list[tuple[str, float]] = []
    record = host._probe_result

    def spy(replica, result, *args):  # counts the readings applied; the host's own code applies them
        applied.append((replica, time.monotonic()))
        record(replica, result, *args)

    host._probe_result = spy
    probing = asyncio.create_task(host.probe_forever())
    try:
        assert await until(lambda: all(r.healthy for r in host.state.replicas.values()), 10)
        proxy.cut()
        cut_at = time.monotonic()
        assert await until(lambda: host.state.replicas["b"].unseen, PROBE_TIMEOUT_S + PERIOD_S + 2)
        assert not host.state.replicas["b"].healthy and not host.state.replicas["b"].stalled
        await asyncio.sleep(max(0.0, cut_at + PROBE_TIMEOUT_S + 0.5 - time.monotonic()))
        # a was read about every period throughout (before, every round waited for b's timeout)
        readings_of_a = [t for name, t in applied if name == "a" and t > cut_at]
        assert len(readings_of_a) >= 3, readings_of_a
        proxy.heal()
        healed = time.monotonic()
        assert await until(lambda: host.state.replicas["b"].healthy, PROBE_TIMEOUT_S + PERIOD_S)
        assert time.monotonic() - healed < PERIOD_S + 0.5  # the probe in flight is answered at the heal
        assert not host.state.replicas["b"].unseen
    finally:
        probing.cancel()
        await asyncio.gather(probing, return_exceptions=True)
        proxy.close()
        await runner_a.cleanup()
        await runner_b.cleanup()

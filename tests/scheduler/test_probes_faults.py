"""Probes of engines that misbehave without dying, against the fake engine's fault
modes: a /metrics that never answers reads as load unknown (not as no load), and the
probe generation that brings a stalled replica back tells a wedged engine from one
that answers. The engines hang for as long as the fake's default (an hour): only the
probe's own timeout can end the wait."""

from __future__ import annotations

from luftpause.dev.procs import eventually, served
from luftpause.fakes.engine import EngineConfig
from luftpause.fakes.engine import create_app as create_engine_app
from luftpause.fakes.engine_state import STATE_KEY
from luftpause.scheduler.pool import Endpoint
from luftpause.scheduler.probes import answers, probe, probe_client

MODEL = "fake-llama-1b"


async def test_metrics_that_never_answer_read_as_load_unknown_within_the_probe_timeout():
    engine = create_engine_app(EngineConfig(faults=("metrics-hang",)))
    async with served(engine, handler_cancellation=True) as url, probe_client() as client:
        result = await probe(client, Endpoint("e", url, (MODEL,)))
    assert result.healthy and result.load_stale  # the probe's timeout ended the read of /metrics
    assert result.running is None and result.queued is None  # not "0 running, 0 queued": unknown


async def test_a_probe_generation_is_answered_by_a_working_engine_and_not_by_a_wedged_one():
    working_app, wedged_app = create_engine_app(EngineConfig()), create_engine_app(EngineConfig(faults=("hang",)))
    async with served(working_app, handler_cancellation=True) as working_url, \
            served(wedged_app, handler_cancellation=True) as wedged_url, probe_client() as client:
        healthy = await probe(client, Endpoint("w", wedged_url, (MODEL,)))
        assert healthy.healthy and not healthy.load_stale  # its health and metrics say all is well
        assert await answers(client, Endpoint("a", working_url, (MODEL,)))
        assert not await answers(client, Endpoint("w", wedged_url, (MODEL,)))
        # the probe gave up on the wedged engine itself: the engine saw it hang up
        await eventually(lambda: wedged_app[STATE_KEY].closed_early == 1, what="the probe hung up on the engine")


async def test_an_engine_that_stalls_mid_stream_does_not_pass_the_probe_generation():
    stalling_app = create_engine_app(EngineConfig(faults=("stall-after=1",)))
    async with served(stalling_app, handler_cancellation=True) as url, probe_client() as client:
        assert not await answers(client, Endpoint("s", url, (MODEL,)))
        await eventually(lambda: stalling_app[STATE_KEY].closed_early == 1, what="the probe hung up on the engine")

"""The scheduler's host probing two fake engines in process, one of them through a real
TCP fault proxy on its probe_url: cut, it goes out of sight (not down) at its first
unanswered probe, its peer's readings go on at their own pace meanwhile, and it is
back in rotation at once when the link heals: the probe in flight then is answered."""

from __future__ import annotations

import asyncio
import contextlib

import structlog

from luftpause.dev.faultproxy import FaultProxy
from luftpause.dev.procs import WAIT_S, eventually, served
from luftpause.fakes.engine import EngineConfig
from luftpause.fakes.engine import create_app as create_engine_app
from luftpause.scheduler.host import SchedulerHost
from luftpause.scheduler.pool import Endpoint


MODEL = "fake-llama-1b"
PERIOD_S = 0.5  # a short probe period, so a's rounds are countable within one b timeout


def reads_of_a_during_unanswered_probes_of_b(events: list[tuple]) -> list[int]:
    """For each probe of b that went unanswered, the readings of a applied while it was out."""
    counts, reads = [], None
    for kind, replica, *result in events:
        if replica == "b" and kind == "sent":
            reads = 0
        elif replica == "b" and kind == "read":
            if result[0].unanswered and reads is not None:
                counts.append(reads)
            reads = None
        elif replica == "a" and kind == "read" and reads is not None:
            reads += 1
    return counts


async def test_a_cut_probe_path_puts_one_engine_out_of_sight_without_slowing_its_peers_probes():
    engines = contextlib.AsyncExitStack()
    url_a = await engines.enter_async_context(served(create_engine_app(EngineConfig()), handler_cancellation=True))
    url_b = await engines.enter_async_context(served(create_engine_app(EngineConfig()), handler_cancellation=True))
    proxy = FaultProxy(int(url_b.rsplit(":", 1)[1])).start()
    host = SchedulerHost([Endpoint("a", url_a, (MODEL,)),
                          Endpoint("b", url_b, (MODEL,), probe_url=f"http://{proxy.address}")],
                         structlog.get_logger(), probe_period_s=PERIOD_S)
    # In order: each probe sent, each reading applied (with b's sight right after it).
    events: list[tuple] = []
    b_sent = asyncio.Event()
    send, record = host._probe, host._probe_result

    async def sending(client, endpoint):
        events.append(("sent", endpoint.name))
        if endpoint.name == "b":
            b_sent.set()
        return await send(client, endpoint)

    def reading(replica, result, *args):  # the host's own code applies them
        record(replica, result, *args)
        events.append(("read", replica, result, host.state.replicas["b"].unseen))

    host._probe, host._probe_result = sending, reading
    probing = asyncio.create_task(host.probe_forever())
    try:
        await eventually(lambda: all(r.healthy for r in host.state.replicas.values()), what="both probed healthy")
        cut = len(events)
        proxy.cut()
        await eventually(lambda: host.state.replicas["b"].unseen, what="b out of sight")
        assert not host.state.replicas["b"].healthy and not host.state.replicas["b"].stalled
        # out of sight at its first unanswered probe, not after several
        [first_unanswered, *_] = [e for e in events[cut:] if e[:2] == ("read", "b") and e[2].unanswered]
        assert first_unanswered[3]
        # a was read about every period while a probe of b waited out its timeout (before,
        # every round waited for b's timeout: a was read once a round)
        await eventually(lambda: max(reads_of_a_during_unanswered_probes_of_b(events[cut:]), default=0) >= 3,
                         what="three readings of a during one unanswered probe of b")

        b_sent.clear()
        await asyncio.wait_for(b_sent.wait(), WAIT_S)  # a probe of b goes out on the cut link ...
        healed = len(events)
        proxy.heal()  # ... and is in flight at the heal
        await eventually(lambda: host.state.replicas["b"].healthy, what="b back in rotation")
        # the probe in flight was answered: no timeout waited out, nothing sent again first
        kind, _, *result = next(e for e in events[healed:] if e[1] == "b")
        assert kind == "read" and result[0].healthy and not result[0].unanswered
        assert not host.state.replicas["b"].unseen
    finally:
        probing.cancel()
        await asyncio.gather(probing, return_exceptions=True)
        proxy.close()
        await engines.aclose()

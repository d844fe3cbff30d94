"""The endpoint picker (``python -m luftpause.picker``): luftpause's scheduler
behind Envoy, over Envoy's ext_proc protocol as the Gateway API Inference Extension's
endpoint-picker protocol lays it down.

Envoy carries the bytes; for each request it opens one ``ExternalProcessor/Process``
stream here and sends, in order, the request's headers, its whole (buffered) body, the
response's headers and the response's body as it streams. The picker is a thin sibling
of the scheduler: to the scheduler it is one more dataplane (one Connect stream, its own
run book, Resync on reconnect, leases), so held turns, run pins, limits and the
interactive-before-batch order are the same core's decisions as through the dataplane.
This module is the process (its shared view of the pool, its gRPC and HTTP servers);
each request's exchange with Envoy is in picker/extproc.py.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys

import grpc
from aiohttp import web
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, ProcessCollector

from luftpause.tokens import service_token
from luftpause import logs
from luftpause.aiohttp_server import JsonErrorsRunner
from luftpause.envoy import EXT_PROC_SERVICE, endpoint_key
from luftpause.eventloop import run_event_loop, stop_signalled
from luftpause.frontdoor import probe_routes
from luftpause.grpc_env import EXCLUSIVE_PORT
from luftpause.keys import KEY_IDENTITIES_HELP, KeyIdentitiesError, Keys
from luftpause.link import Placement, SchedulerLink
from luftpause.options import env_option
from luftpause.picker import extproc
from luftpause.picker.extproc import ExternalProcessor, ep_grpc
from luftpause.prom import Children, metrics_response
from luftpause.proto import scheduler_pb2 as pb
from luftpause.runbook import RunBook, session_idle_option

READINESS_POLL_S = 0.2
STATUS_REFRESH_S = 1.0  # how fresh the picker's view of replica health (for fallbacks) is
# A pick is a few hundred microseconds unless the turn is held; buckets up to a minute of hold.
DECISION_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.1, 0.5, 1, 5, 30, 60)


class Replicas:
    """The pool as the scheduler reports it, refreshed every STATUS_REFRESH_S: which
    replicas are healthy (fallbacks), how Envoy knows them (ip:port) and back."""

    def __init__(self) -> None:
        self.by_name: dict[str, pb.ReplicaStatus] = {}
        self.keys: dict[str, str] = {}  # name -> ip:port
        self.names: dict[str, str] = {}  # ip:port -> name

    def update(self, status: pb.StatusReply) -> None:
        self.by_name = {r.name: r for r in status.replicas}
        for replica in status.replicas:
            if replica.name not in self.keys:
                try:
                    key = endpoint_key(replica.base_url)
                except (OSError, ValueError):
                    continue
                self.keys[replica.name], self.names[key] = key, replica.name

    def key(self, placement: Placement) -> str:
        key = self.keys.get(placement.replica)
        if key is None:
            key = self.keys[placement.replica] = endpoint_key(placement.base_url)
            self.names[key] = placement.replica
        return key

    def fallbacks(self, model: str, primary: str, kind: str = "generative") -> list[str]:
        """Other healthy replicas serving ``model``, least loaded first."""
        others = [r for r in self.by_name.values()
                  if r.name != primary and r.healthy and r.kind == kind and model in r.models and r.name in self.keys]
        others.sort(key=lambda r: (r.in_flight, r.name))
        return [self.keys[r.name] for r in others]

    def named(self, endpoints: set[str], model: str, kind: str = "generative") -> list[str]:
        """The replicas (pool names) among ``endpoints`` (ip:port) that serve ``model``."""
        return sorted(r.name for r in self.by_name.values()
                      if r.kind == kind and model in r.models and self.keys.get(r.name) in endpoints)


class PickerMetrics:
    """``GET /metrics``: requests picked, shed and refused, how long a pick took, turns in
    flight and waiting (one registry per picker, so several can live in one test process)."""

    def __init__(self, book: RunBook, scheduler_connected) -> None:
        self.registry = r = CollectorRegistry()
        self._child = Children()
        self._picked = Counter("luftpause_picker_picked", "Turns given a destination, by class.", ["class"],
                               registry=r)
        self._shed = Counter("luftpause_picker_shed", "Batch turns shed with a 429: the batch queue was at its "
                             "bound (held) or the turn waited past its bound (waited).", ["why"], registry=r)
        self._refused = Counter("luftpause_picker_refused", "Requests the picker answered itself with an error, "
                                "by HTTP status (429s included).", ["status"], registry=r)
        self._decision = Histogram("luftpause_picker_decision_seconds", "From a turn's body reaching the picker "
                                   "to its destination going back to Envoy, the hold included.",
                                   buckets=DECISION_BUCKETS, registry=r)
        self.waiting = 0  # turns this picker's streams hold while the scheduler decides
        Gauge("luftpause_picker_turns_in_flight", "Turns placed through this picker whose response has not "
              "ended.", registry=r).set_function(lambda: len(book.turns))
        Gauge("luftpause_picker_turns_waiting", "Turns waiting in this picker for the scheduler's decision "
              "(held).", registry=r).set_function(lambda: self.waiting)
        Gauge("luftpause_picker_scheduler_connected", "1 while the Connect stream to the scheduler is up.",
              registry=r).set_function(lambda: 1.0 if scheduler_connected() else 0.0)
        ProcessCollector(registry=r)

    def picked(self, service_class: str, seconds: float) -> None:
        self._child(self._picked, service_class).inc()
        self._decision.observe(seconds)

    def shed(self, why: str) -> None:
        self._child(self._shed, why).inc()

    def refused(self, status: int) -> None:
        self._child(self._refused, str(status)).inc()


class Picker:
    """What every Process stream shares: the link to the scheduler, the run book, the view
    of the pool, the token and tenant keys, the load-shedding bounds (0: off) and the metrics."""

    def __init__(self, link: SchedulerLink, book: RunBook, log, token: str = "", *, keys: Keys | None = None,
                 shed_batch_held: int = 0, shed_batch_wait_s: float = 0.0) -> None:
        self.link, self.book, self.log, self.token = link, book, log, token
        self.keys = keys if keys is not None else Keys()
        self.shed_batch_held, self.shed_batch_wait_s = shed_batch_held, shed_batch_wait_s
        self.replicas = Replicas()
        self.metrics = PickerMetrics(book, lambda: link.synced)

    async def refresh_forever(self) -> None:
        while True:
            try:
                self.replicas.update(await self.link.status())
            except grpc.RpcError:
                pass  # the scheduler is away: the link reconnects; the last view stands
            await asyncio.sleep(STATUS_REFRESH_S)


# ------------------------------------------------------------------ the process


def grpc_server(picker: Picker, bind: str) -> tuple[grpc.aio.Server, health.aio.HealthServicer]:
    """ext_proc plus the standard gRPC health service: ``liveness`` and "" answer SERVING
    while the process runs; ``readiness`` and the ext_proc service's name only while the
    picker's stream to the scheduler is up (Envoy health-checks the latter)."""
    server = grpc.aio.server(options=EXCLUSIVE_PORT)
    ep_grpc.add_ExternalProcessorServicer_to_server(ExternalProcessor(picker), server)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    server.add_insecure_port(bind)
    return server, health_servicer


async def track_readiness(picker: Picker, servicer: health.aio.HealthServicer) -> None:
    for name in ("", "liveness"):
        await servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    ready = None
    while True:
        if picker.link.synced != ready:
            ready = picker.link.synced
            status = health_pb2.HealthCheckResponse.SERVING if ready else health_pb2.HealthCheckResponse.NOT_SERVING
            for name in ("readiness", EXT_PROC_SERVICE):
                await servicer.set(name, status)
            picker.log.info("picker_readiness", ready=ready)
        await asyncio.sleep(READINESS_POLL_S)


def http_app(picker: Picker) -> web.Application:
    """``/health`` (the process answers; is the scheduler stream up) and ``/ready`` for
    probes and the launcher; ``/metrics`` for Prometheus."""
    app = web.Application()
    app.add_routes(probe_routes(lambda: picker.link.synced))
    app.router.add_get("/metrics", lambda _request: metrics_response(picker.metrics.registry))
    return app


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m luftpause.picker",
                                     description=__doc__ + "\n" + extproc.__doc__.partition("\n\n")[2],
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog="LUFTPAUSE_TOKEN, when set, is the bearer token every /v1 request "
                                            "must carry; the picker also presents it to the scheduler. "
                                            + KEY_IDENTITIES_HELP + " " + logs.LOG_SETTINGS_HELP)
    env_option(parser, "--host", "LUFTPAUSE_PICKER_HOST", "127.0.0.1", "bind address")
    env_option(parser, "--grpc-port", "LUFTPAUSE_PICKER_GRPC_PORT", 5002, "ext_proc and gRPC health port Envoy calls",
               kind=int)
    env_option(parser, "--http-port", "LUFTPAUSE_PICKER_HTTP_PORT", 5003, "/health, /ready and /metrics", kind=int)
    env_option(parser, "--shed-batch-held", "LUFTPAUSE_PICKER_SHED_BATCH_HELD", 0,
               "shed load: a batch turn that would wait while this many batch turns are held already is "
               "answered 429 with Retry-After instead (0: never; interactive turns are never shed)", kind=int)
    env_option(parser, "--shed-batch-wait", "LUFTPAUSE_PICKER_SHED_BATCH_WAIT_S", 0.0,
               "shed load: a batch turn held this many seconds is given up and answered 429 with Retry-After "
               "(0: it waits as long as it takes)", kind=float)
    env_option(parser, "--scheduler", "LUFTPAUSE_SCHEDULER_ADDR", "127.0.0.1:5000",
               "scheduler gRPC address; several, comma-separated, for a leader and its standbys (the stream "
               "goes on to the next when one refuses or is away)")
    session_idle_option(parser)
    return parser.parse_args(argv)


async def serve(args: argparse.Namespace, log) -> None:
    token = service_token(log, "every client is accepted") or ""
    book = RunBook(args.harness_session_idle)
    link = SchedulerLink(args.scheduler, book, log, token or None)
    if args.shed_batch_held < 0 or args.shed_batch_wait < 0:
        raise SystemExit("--shed-batch-held and --shed-batch-wait must be 0 (off) or more")
    picker = Picker(link, book, log, token, keys=args.keys, shed_batch_held=args.shed_batch_held,
                    shed_batch_wait_s=args.shed_batch_wait)
    server, health_servicer = grpc_server(picker, f"{args.host}:{args.grpc_port}")
    link.start()
    await server.start()
    runner = JsonErrorsRunner(http_app(picker), access_log=None)
    await runner.setup()
    await web.TCPSite(runner, args.host, args.http_port).start()
    tasks = [asyncio.create_task(picker.refresh_forever()),
             asyncio.create_task(track_readiness(picker, health_servicer)),
             asyncio.create_task(link.sweep_forever())]
    log.info("picker_started", grpc=f"{args.host}:{args.grpc_port}", http=f"{args.host}:{args.http_port}",
             scheduler=args.scheduler, picker=link.dataplane_id, shed_batch_held=args.shed_batch_held,
             shed_batch_wait_s=args.shed_batch_wait)
    try:
        await stop_signalled()
    finally:
        log.info("picker_stopping")
        for task in tasks:
            task.cancel()
        await server.stop(grace=1.0)
        await runner.cleanup()
        await link.close()


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:  # the tenant keys, as the dataplane reads them (malformed, or without the token: it does not start)
        args.keys = Keys.from_env(os.environ, os.environ.get("LUFTPAUSE_TOKEN", ""))
    except KeyIdentitiesError as exc:
        raise SystemExit(f"python -m luftpause.picker: error: {exc}") from None
    log = logs.configure("picker")
    run_event_loop(serve(args, log))
    return 0


if __name__ == "__main__":
    sys.exit(main())

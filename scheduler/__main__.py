"""``python -m luftpause.scheduler``: gRPC (the dataplanes' Connect stream; Admit, Report, Resync and
Status) and HTTP status."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import sys

from aiohttp import web

from luftpause.tokens import service_token
from luftpause import diagnostics, logs, tracing
from luftpause.aiohttp_server import JsonErrorsRunner
from luftpause.options import env_option
from luftpause.eventloop import run_event_loop, stop_signalled
from luftpause.scheduler.app import http_app, runtime_status_url
from luftpause.scheduler.constants import DEFAULT_GRPC_PORT, DEFAULT_HTTP_PORT, PROBE_PERIOD_S
from luftpause.scheduler.core import LiftMode, Policy
from luftpause.scheduler.grpc_api import grpc_server, mark_serving
from luftpause.scheduler.host import SchedulerHost
from luftpause.scheduler.leader import LeadLock, LeadLost
from luftpause.scheduler.pool import PoolError, load_pool


# The policy's switches on the command line, the one place their words become a Policy
# (policy_from_args); each defaults to what Policy ships. Field -> (flag, env, choices, help).
# Strict affinity (Policy.affinity) is no operator's switch: it is off only under the
# diagnostics switch roaming-runs (luftpause/diagnostics.py), to measure what it is worth.
POLICY_OPTIONS: dict[str, tuple[str, str, tuple[str, ...], str]] = {
    "interactive_slots": (
        "--interactive-slots", "LUFTPAUSE_INTERACTIVE_SLOTS", ("on", "off"),
        "with strict affinity, keep a slot under each replica's decode ceiling for every interactive run "
        "paused there on a tool (at most half the ceiling): its next turn starts at once instead of waiting "
        "for a batch turn to end, and batch throughput pays for the empty slot"),
    "resume_slots": (
        "--resume-slots", "LUFTPAUSE_RESUME_SLOTS", ("on", "off"),
        "with strict affinity, keep a slot under a replica's decode ceiling for an interactive run paused "
        "there while its tool call is due to return (its earlier pauses tell when), so its next turn need not "
        "wait for a batch turn to end; the slot goes back to batch if the run is late (docs/admission.md)"),
    "batch_yields": (
        "--batch-yields", "LUFTPAUSE_BATCH_YIELDS", ("on", "off"),
        "a batch turn whose run's context is at least an eighth of the replica's KV pool (as the engine reports "
        "it) waits, at most 2 s, while an interactive turn is in flight on the same accelerator: its "
        "prefill, most of it computed again where contexts that size outgrow the pool, would otherwise "
        "hold that turn's tokens for many steps (docs/admission.md)"),
    "lift": (
        "--lift-ceiling", "LUFTPAUSE_LIFT_CEILING", ("on", "off", "throughput"),
        "lift a replica's decode ceiling (SGLang's cuda_graph_max_bs) where the engine shows decoding above it "
        "buys throughput: its decode execution counters (GPU seconds, tokens, graph and eager passes; a token "
        "10 %% cheaper) where it reports them, else its gen_throughput (at most 15 %% dearer); a try every 90 s "
        "at most; batch turns leave a lifted slot per paused interactive run; one replica of the pool (while "
        "another keeps its wall) also keeps and climbs a lift that costs a token no more, while turns wait for "
        "it (docs/admission.md). off: the "
        "graph batch is the wall. throughput: also keep, and take higher, a lift that costs a token no more "
        "than at the graph batch (counters only): more batch throughput where a larger batch pays only "
        "further up, every interactive run decoding in the longer step"),
}


def _word(value: bool | LiftMode) -> str:
    """A switch's value as the command line spells it."""
    if isinstance(value, LiftMode):
        return value.value
    return "on" if value else "off"


def policy_from_args(args: argparse.Namespace) -> Policy:
    """The Policy the parsed switches ask for (and the diagnostics switches, parse_args)."""
    values = {"affinity": diagnostics.ROAMING_RUNS not in args.diagnostics}
    for field, (flag, _, _, _) in POLICY_OPTIONS.items():
        word = getattr(args, flag.removeprefix("--").replace("-", "_"))
        values[field] = LiftMode(word) if field == "lift" else word == "on"
    return Policy(**values)


def runtime_url(value: str) -> str:
    try:
        runtime_status_url(value)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return value


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    env = os.environ.get
    parser = argparse.ArgumentParser(prog="python -m luftpause.scheduler", description=__doc__,
                                     epilog=logs.LOG_SETTINGS_HELP + " " + diagnostics.HELP)
    env_option(parser, "--host", "LUFTPAUSE_SCHEDULER_HOST", "127.0.0.1", "bind address")
    env_option(parser, "--grpc-port", "LUFTPAUSE_SCHEDULER_GRPC_PORT", DEFAULT_GRPC_PORT, "gRPC port", kind=int)
    env_option(parser, "--http-port", "LUFTPAUSE_SCHEDULER_HTTP_PORT", DEFAULT_HTTP_PORT, "HTTP status port", kind=int)
    env_option(parser, "--pool-file", "LUFTPAUSE_POOL_FILE", "config/pool.yaml", "engine pool YAML")
    for field, (flag, env_name, choices, text) in POLICY_OPTIONS.items():
        env_option(parser, flag, env_name, _word(getattr(Policy(), field)), text, choices=choices)
    env_option(parser, "--probe-period", "LUFTPAUSE_PROBE_PERIOD_S", PROBE_PERIOD_S,
               "seconds between engine probes (the probe timeout stays 2 s)", kind=float)
    env_option(parser, "--lead-lock", "LUFTPAUSE_LEAD_LOCK", "",
               "a PostgreSQL URL (postgresql://user:password@host:port/db): schedulers given the same one elect "
               "one leader there and the others stand by, not ready and refusing dataplanes until the leader is "
               "gone; a leader cut off from the database exits within about a second (docs/fleet.md). "
               "Unset = this scheduler always leads")
    parser.add_argument("--runtime-url", default=env("LUFTPAUSE_RUNTIME_URL") or None, type=runtime_url,
                        help="the runtime whose run tree the status page shows, e.g. http://127.0.0.1:7000 "
                             "(env LUFTPAUSE_RUNTIME_URL; unset = no run tree). LUFTPAUSE_TOKEN (env only), when "
                             "set, is required on gRPC (metadata) and HTTP (Authorization: Bearer) but health "
                             "checks and the static page, and is presented to the runtime. "
                             "LUFTPAUSE_ALLOWED_HOSTS: comma-separated Host names HTTP clients may use (host or "
                             "host:port, * = any; unset = localhost, 127.0.0.1, [::1]); other Host headers get 421, "
                             "other Origins 403, token or not")
    try:
        switches = diagnostics.read()
    except diagnostics.UnknownDiagnostic as exc:
        parser.error(str(exc))
    args = parser.parse_args(argv)
    args.diagnostics = switches
    return args


async def serve(args: argparse.Namespace, log) -> None:
    endpoints = load_pool(args.pool_file)
    policy = policy_from_args(args)
    if args.diagnostics:
        log.warning("diagnostics_on", switches=sorted(args.diagnostics),
                    reason=f"{diagnostics.ENV} is for measurements only, never for production (docs/diagnostics.md)")
    host = SchedulerHost(endpoints, log, policy=policy, probe_period_s=args.probe_period)
    token = service_token(log, "gRPC and HTTP accept everyone")
    server, health_servicer = grpc_server(host, f"{args.host}:{args.grpc_port}", token)
    lock = LeadLock(args.lead_lock, log) if args.lead_lock else None
    if lock is not None:
        host.standby = lock.where
    await server.start()
    if lock is None:
        await mark_serving(health_servicer)
    host.serving = True
    runner = JsonErrorsRunner(http_app(host, token, args.runtime_url), access_log=None)
    await runner.setup()
    await web.TCPSite(runner, args.host, args.http_port).start()
    log.info("scheduler_started", grpc=f"{args.host}:{args.grpc_port}", http=f"{args.host}:{args.http_port}",
             replicas=[e.name for e in endpoints], affinity=_word(policy.affinity),
             interactive_slots=args.interactive_slots, lift_ceiling=args.lift_ceiling, resume_slots=args.resume_slots)
    tasks = [asyncio.create_task(host.probe_forever()), asyncio.create_task(host.tick_forever())]
    stop = asyncio.create_task(stop_signalled())
    leading = asyncio.create_task(lead(lock, host, health_servicer)) if lock is not None else None
    lost = False
    try:
        await asyncio.wait([t for t in (stop, leading) if t is not None], return_when=asyncio.FIRST_COMPLETED)
        lost = leading is not None and leading.done()
        if lost:
            leading.result()  # LeadLost: out, and the supervisor starts a standby
    finally:
        for task in (stop, leading):
            if task is not None:
                task.cancel()
        if lock is not None:
            await lock.release()
        log.info("scheduler_stopping")
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        await server.stop(grace=0 if lost else 1.0)  # a lost lead: no stream stays a moment longer
        await runner.cleanup()


async def lead(lock: LeadLock, host: SchedulerHost, health_servicer) -> None:
    """Stand by until this scheduler holds the lead lock, then lead until it cannot say
    it does (LeadLost)."""
    await lock.hold()
    host.standby = ""
    await mark_serving(health_servicer)
    await lock.keep()


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    log = logs.configure("scheduler")
    tracing.configure("scheduler")
    try:
        run_event_loop(serve(args, log))
    except PoolError as exc:
        log.error("bad_pool_file", error=str(exc))
        return 2
    except LeadLost as exc:
        log.error("scheduler_lead_lost", problem=str(exc),
                  effect="exiting: another scheduler may lead now; started again, this one stands by")
        return 3
    finally:
        tracing.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())

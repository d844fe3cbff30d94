"""``python -m luftpause.dataplane``: the OpenAI-compatible streaming proxy."""

from __future__ import annotations

import argparse
import os
import sys

from aiohttp import web

from luftpause.tokens import service_token
from luftpause import logs, tracing
from luftpause.aiohttp_server import JsonErrorsRunner
from luftpause.options import env_option
from luftpause.eventloop import run_event_loop, stop_signalled
from luftpause.dataplane.app import create_app
from luftpause.dataplane.constants import DEFAULT_PORT, DEFAULT_SCHEDULER_ADDR, MAX_BODY_BYTES
from luftpause.runbook import session_idle_option
from luftpause.keys import KEY_IDENTITIES_HELP, KeyIdentitiesError, Keys

TOOL_CALLS = ("whole", "live")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m luftpause.dataplane", description=__doc__,
                                     epilog="LUFTPAUSE_TOKEN, when set, is the bearer token every /v1 route requires; "
                                            "the dataplane also presents it to the scheduler. "
                                            "LUFTPAUSE_ALLOWED_HOSTS: comma-separated Host names clients may use "
                                            "(host or host:port, * = any; unset = localhost, 127.0.0.1, [::1]); "
                                            "other Host headers get 421, other Origins 403. "
                                            + KEY_IDENTITIES_HELP + " "
                                            + logs.LOG_SETTINGS_HELP)
    env_option(parser, "--host", "LUFTPAUSE_DATAPLANE_HOST", "127.0.0.1", "bind address")
    env_option(parser, "--port", "LUFTPAUSE_DATAPLANE_PORT", DEFAULT_PORT, "HTTP port", kind=int)
    env_option(parser, "--scheduler", "LUFTPAUSE_SCHEDULER_ADDR", DEFAULT_SCHEDULER_ADDR,
               "scheduler gRPC address; several, comma-separated, for a leader and its standbys (the stream "
               "goes on to the next when one refuses or is away)")
    env_option(parser, "--max-body-bytes", "LUFTPAUSE_MAX_BODY_BYTES", MAX_BODY_BYTES, "largest request body, else 413",
               kind=int)
    env_option(parser, "--messages-warm-up", "LUFTPAUSE_MESSAGES_WARM_UP", "on",
               "on: import the Messages API's anthropic SDK in the background at start, so the first "
               "/v1/messages turn need not wait for it; off: on the first Messages turn (saves about 3 CPU "
               "seconds and 50 MB per dataplane that never serves one)", choices=("on", "off"))
    env_option(parser, "--tool-calls", "LUFTPAUSE_TOOL_CALLS", "whole",
               "how a streamed chat reply's tool calls reach the client: 'whole', all the message's call "
               "deltas held and sent together once the calls are complete (a stream that stalls inside or "
               "between calls can be continued on another replica); 'live', passed on as they come (a stall "
               "inside a call breaks the stream off)", choices=TOOL_CALLS)
    session_idle_option(parser)
    return parser.parse_args(argv)


async def serve(args: argparse.Namespace, log) -> None:
    token = service_token(log, "every client is accepted") or ""
    app = create_app(args.scheduler, token, log, args.max_body_bytes, args.keys,
                     warm_up=args.messages_warm_up == "on", hold_tool_calls=args.tool_calls == "whole",
                     session_done_idle_s=args.harness_session_idle)
    # handler_cancellation: a client that disconnects cancels its handler, which
    # abandons a held turn or closes the engine request.
    runner = JsonErrorsRunner(app, access_log=None, handler_cancellation=True)
    await runner.setup()
    await web.TCPSite(runner, args.host, args.port).start()
    log.info("dataplane_started", address=f"http://{args.host}:{args.port}", scheduler=args.scheduler)
    try:
        await stop_signalled()
    finally:
        log.info("dataplane_stopping")
        await runner.cleanup()


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        args.keys = Keys.from_env(os.environ, os.environ.get("LUFTPAUSE_TOKEN", ""))
    except KeyIdentitiesError as exc:
        print(f"python -m luftpause.dataplane: error: {exc}", file=sys.stderr)
        return 2
    log = logs.configure("dataplane")
    tracing.configure("dataplane")
    run_event_loop(serve(args, log))
    tracing.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())

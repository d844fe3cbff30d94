"""What one message on a Connect-shaped gRPC stream costs with gRPC's default transport
(the EventEngine) and with the one luftpause's scheduler and dataplane choose
(``luftpause.grpc_env``: ``GRPC_EXPERIMENTS=-event_engine_client,-event_engine_listener``;
a value in this process's environment is not passed on): a server process echoes a client process's small messages on
one bidirectional stream, one at a time, on uvloop, as the Connect stream's frames go.
Each process reads its own CPU (utime + stime) over the measured messages; the rounds
alternate the two transports so a machine that gets busier slows both alike.

    python -m luftpause.loadgen.grpc_transport_bench [--rounds 4] [--messages 4000]

Prints a table (µs of CPU per round trip on each side, wall µs per round trip) and
writes JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from rich.console import Console

from luftpause import grpc_env
from luftpause.loadgen.records import new_table, write_json
from luftpause.dev.procs import free_port, wait_until

TRANSPORTS = {"gRPC's default (EventEngine)": "", "luftpause's choice": grpc_env.LEGACY_TRANSPORT}
WARM_UP = 200
PAYLOAD = 100  # bytes: a frame of a few turn events

SIDE = r'''
import asyncio, json, resource, sys, time
import grpc, uvloop

def cpu():
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime

async def server(port, messages, ready):
    finished, marks = asyncio.Event(), {}
    async def echo(requests, context):
        n = 0
        try:
            async for message in requests:
                n += 1
                if n == WARM_UP + 1:
                    marks["start"] = cpu()
                if n == WARM_UP + messages:
                    marks["end"] = cpu()
                yield message
        finally:  # the stream ended, or was cut off once the client had its answers
            finished.set()
    handler = grpc.method_handlers_generic_handler("b.B", {"E": grpc.stream_stream_rpc_method_handler(echo)})
    s = grpc.aio.server()
    s.add_generic_rpc_handlers((handler,))
    s.add_insecure_port(f"127.0.0.1:{port}")
    await s.start()
    open(ready, "w").close()
    await asyncio.wait_for(finished.wait(), 120)
    await s.stop(None)
    return {"server_cpu_us": (marks["end"] - marks["start"]) * 1e6 / (messages - 1)}

async def client(port, messages):
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        call = channel.stream_stream("/b.B/E")()
        payload = b"x" * PAYLOAD
        for _ in range(WARM_UP):
            await call.write(payload)
            await call.read()
        started_cpu, started = cpu(), time.perf_counter()
        for _ in range(messages):
            await call.write(payload)
            await call.read()
        out = {"client_cpu_us": (cpu() - started_cpu) * 1e6 / messages,
               "wall_us": (time.perf_counter() - started) * 1e6 / messages}
        await call.done_writing()
        await call.code()  # the server's end of the stream, before the channel closes
        return out

role, port, messages = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
coroutine = server(port, messages, sys.argv[4]) if role == "server" else client(port, messages)
print(json.dumps(uvloop.run(coroutine)))
'''


def one_round(experiments: str, messages: int, script: Path) -> dict:
    """One server and one client process (``script``, :data:`SIDE`) on one transport."""
    env = {k: v for k, v in os.environ.items() if k != grpc_env.GRPC_EXPERIMENTS}
    if experiments:
        env[grpc_env.GRPC_EXPERIMENTS] = experiments
    port, ready = free_port(), script.parent / f"ready-{time.monotonic_ns()}"
    server = subprocess.Popen([sys.executable, str(script), "server", str(port), str(messages), str(ready)],
                              env=env, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        wait_until(lambda: ready.exists() or server.poll() is not None, 30)
        if not ready.exists():
            raise RuntimeError("the echo server did not start")
        client = subprocess.run([sys.executable, str(script), "client", str(port), str(messages)], env=env,
                                capture_output=True, text=True, timeout=120, check=True)
        served, _ = server.communicate(timeout=60)
    finally:
        if server.poll() is None:
            server.kill()
            server.wait()
    return {**json.loads(client.stdout), **json.loads(served)}


def run(rounds: int, messages: int) -> dict:
    results: dict = {"rounds": rounds, "messages": messages, "payload_bytes": PAYLOAD, "transports": {}}
    with tempfile.TemporaryDirectory() as tmp:
        script = Path(tmp) / "side.py"
        script.write_text(f"WARM_UP = {WARM_UP}\nPAYLOAD = {PAYLOAD}\n" + SIDE)
        for _ in range(rounds):
            for name, experiments in TRANSPORTS.items():
                entry = results["transports"].setdefault(name, {"GRPC_EXPERIMENTS": experiments, "rounds": []})
                entry["rounds"].append(one_round(experiments, messages, script))
    for entry in results["transports"].values():
        for key in ("client_cpu_us", "server_cpu_us", "wall_us"):
            entry[f"median_{key}"] = round(statistics.median(r[key] for r in entry["rounds"]), 1)
    return results


def print_report(console: Console, results: dict) -> None:
    table = new_table(f"One message each way on a gRPC stream, {results['messages']} round trips × "
                      f"{results['rounds']} rounds (median; µs)",
                      ("transport", "GRPC_EXPERIMENTS", "client CPU", "server CPU", "wall"),
                      left=("transport", "GRPC_EXPERIMENTS"))
    for name, entry in results["transports"].items():
        table.add_row(name, entry["GRPC_EXPERIMENTS"] or "(unset)", f"{entry['median_client_cpu_us']:.0f}",
                      f"{entry['median_server_cpu_us']:.0f}", f"{entry['median_wall_us']:.0f}")
    console.print(table)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m luftpause.loadgen.grpc_transport_bench", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=4, help="rounds, each transport once per round (default 4)")
    parser.add_argument("--messages", type=int, default=4000, help="measured round trips per run (default 4000)")
    parser.add_argument("--json", default="bench-results/grpc-transport.json", help="where to write the results")
    args = parser.parse_args(argv)
    if args.rounds < 1 or args.messages < 2:
        parser.error("--rounds must be at least 1 and --messages at least 2")
    console = Console(width=160)
    results = run(args.rounds, args.messages)
    print_report(console, results)
    console.print(f"JSON: {write_json(args.json, results)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

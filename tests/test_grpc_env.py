"""The scheduler and the dataplane pick gRPC's transport before grpc is imported, leave an
operator's choice alone, and the installed grpc knows the switch they use."""

from __future__ import annotations

import os
import subprocess
import sys

from luftpause import grpc_env

PRINT_CHOICE = "import os, {module}; print(os.environ.get('GRPC_EXPERIMENTS'))"


def _python(code: str, **env: str) -> subprocess.CompletedProcess[str]:
    clean = {k: v for k, v in os.environ.items() if k != grpc_env.GRPC_EXPERIMENTS}
    return subprocess.run([sys.executable, "-c", code], env={**clean, **env}, capture_output=True, text=True,
                          timeout=60, check=True)


def test_the_services_choose_the_transport_before_grpc_is_imported():
    for module in ("luftpause.scheduler.host", "luftpause.dataplane.context", "luftpause.picker.__main__"):
        out = _python(PRINT_CHOICE.format(module=module)).stdout.split()
        assert out == [grpc_env.LEGACY_TRANSPORT]


def test_an_operators_choice_is_left_as_it_is():
    out = _python(PRINT_CHOICE.format(module="luftpause.scheduler.host"),
                  GRPC_EXPERIMENTS="-event_engine_client").stdout.split()
    assert out == ["-event_engine_client"]


def test_too_late_once_grpc_is_imported():
    code = "import grpc, os; from luftpause import grpc_env; print(grpc_env.choose_transport(), " \
           "os.environ.get('GRPC_EXPERIMENTS'))"
    assert _python(code).stdout.split() == ["False", "None"]


def test_the_installed_grpc_knows_the_switch_and_a_stream_works_with_it():
    # An unknown experiment name is only an error line on stderr: a grpcio that dropped
    # these would fall back to its default silently. This notices.
    code = """
import asyncio
import luftpause.scheduler  # chooses the transport
import grpc

async def main():
    async def echo(requests, context):
        async for message in requests:
            yield message
    handler = grpc.method_handlers_generic_handler("t.T", {"E": grpc.stream_stream_rpc_method_handler(echo)})
    server = grpc.aio.server()
    server.add_generic_rpc_handlers((handler,))
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        call = channel.stream_stream("/t.T/E")()
        for i in range(3):
            await call.write(b"ping %d" % i)
            print((await call.read()).decode())
        await call.done_writing()
    await server.stop(None)

asyncio.run(main())
"""
    done = _python(code)
    assert done.stdout.split("\n")[:3] == ["ping 0", "ping 1", "ping 2"]
    assert "Unknown experiment" not in done.stderr

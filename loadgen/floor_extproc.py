"""The floor of the endpoint picker's stack, for ``proxy_bench picker``: an ext_proc server on
grpc.aio and uvloop, as the picker is, that answers every message Envoy sends with a
constant (the request body with one fixed destination, everything else "go on") and does
nothing else. No route, identity, JSON, admission, observation, scheduler link, metrics or
logs: what the picker costs above this row is its own work; what this row costs, a picker
in Python's grpc.aio cannot go below with Envoy's ext_proc protocol as luftpause uses it
(the same processing modes, so the same messages per turn).

    python -m luftpause.loadgen.floor_extproc --port 9102 --destination 127.0.0.1:8101
"""

from __future__ import annotations

import argparse
import sys

from luftpause import grpc_env

grpc_env.choose_transport()  # the picker's gRPC transport (luftpause.picker chooses it before grpc loads)
import grpc  # noqa: E402
from google.protobuf import struct_pb2  # noqa: E402
from grpc_health.v1 import health, health_pb2, health_pb2_grpc  # noqa: E402

from luftpause.eventloop import run_event_loop, stop_signalled  # noqa: E402
from luftpause.grpc_env import EXCLUSIVE_PORT  # noqa: E402
from luftpause import envoy  # noqa: E402

envoy.load_stubs()
from envoy.config.core.v3 import base_pb2  # noqa: E402
from envoy.service.ext_proc.v3 import external_processor_pb2 as ep  # noqa: E402
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as ep_grpc  # noqa: E402


def answers(destination: str) -> dict[str, ep.ProcessingResponse]:
    """The one answer to each kind of message."""
    metadata = struct_pb2.Struct()
    metadata.fields[envoy.LB_NAMESPACE].struct_value.fields[envoy.DESTINATION].string_value = destination
    header = base_pb2.HeaderValueOption(header=base_pb2.HeaderValue(key=envoy.DESTINATION,
                                                                    raw_value=destination.encode()))
    routed = ep.BodyResponse(response=ep.CommonResponse(header_mutation=ep.HeaderMutation(set_headers=[header])))
    return {"request_headers": ep.ProcessingResponse(request_headers=ep.HeadersResponse()),
            "request_body": ep.ProcessingResponse(request_body=routed, dynamic_metadata=metadata),
            "response_headers": ep.ProcessingResponse(response_headers=ep.HeadersResponse()),
            "response_body": ep.ProcessingResponse(response_body=ep.BodyResponse())}


class ConstantProcessor(ep_grpc.ExternalProcessorServicer):
    def __init__(self, destination: str) -> None:
        self.answers = answers(destination)

    async def Process(self, request_iterator, context):  # noqa: N802 - the gRPC method's name
        answers = self.answers
        async for message in request_iterator:
            if not message.observability_mode:  # an observing filter's messages want no answer
                yield answers[message.WhichOneof("request")]


async def serve(args: argparse.Namespace) -> None:
    server = grpc.aio.server(options=EXCLUSIVE_PORT)
    ep_grpc.add_ExternalProcessorServicer_to_server(ConstantProcessor(args.destination), server)
    servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    for name in ("", envoy.EXT_PROC_SERVICE):
        await servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    server.add_insecure_port(f"{args.host}:{args.port}")
    await server.start()
    try:
        await stop_signalled()
    finally:
        await server.stop(grace=0.5)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m luftpause.loadgen.floor_extproc", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True, help="the ext_proc gRPC port Envoy calls")
    parser.add_argument("--destination", required=True, help="the engine's ip:port, every request's destination")
    run_event_loop(serve(parser.parse_args(argv)))
    return 0


if __name__ == "__main__":
    sys.exit(main())

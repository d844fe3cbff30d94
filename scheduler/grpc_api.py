"""The scheduler's gRPC face: the ``Scheduler`` service (the dataplanes' Connect stream,
Admit, Report, Resync and Status) over the host (scheduler/host.py), with standard health
checking and reflection. A standby scheduler refuses the dataplanes' calls
(scheduler/leader.py)."""

from __future__ import annotations

from collections.abc import AsyncIterator

import grpc
from google.protobuf import json_format
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection
from opentelemetry import trace
from opentelemetry.trace import SpanKind, Status, StatusCode

from luftpause import auth, tracing
from luftpause.grpc_env import EXCLUSIVE_PORT
from luftpause.proto import scheduler_pb2 as pb
from luftpause.proto import scheduler_pb2_grpc as pb_grpc
from luftpause.scheduler import core, stream
from luftpause.scheduler.host import SchedulerHost
from luftpause.scheduler.validation import admit_problem, resync_problem
from luftpause.vocabulary import DATAPLANE_METADATA, REJECT_CODES
from luftpause.vocabulary import SCHEDULER_STANDBY as STANDBY

TRACER = trace.get_tracer("luftpause.scheduler")
GRPC_CODES = {reason: grpc.StatusCode[codes.grpc] for reason, codes in REJECT_CODES.items()}


class SchedulerServicer(pb_grpc.SchedulerServicer):
    def __init__(self, host: SchedulerHost) -> None:
        self.host = host

    async def _leading(self, context: grpc.aio.ServicerContext) -> None:
        """A standby takes no dataplane: it refuses, naming why, and the dataplane tries
        its next scheduler address."""
        if self.host.standby:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                                f"{STANDBY}: another scheduler holds the lead lock on {self.host.standby}")

    async def Connect(self, request_iterator, context: grpc.aio.ServicerContext) -> None:
        await self._leading(context)
        await stream.serve(self.host, context)

    async def Admit(self, request: pb.AdmitRequest, context: grpc.aio.ServicerContext) -> pb.AdmitReply:
        await self._leading(context)
        if problem := admit_problem(request):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, problem)
        parent = tracing.extract({m.key: m.value for m in context.invocation_metadata() or ()})
        with TRACER.start_as_current_span("admit", context=parent, kind=SpanKind.SERVER,
                                          attributes={"luftpause.turn_id": request.turn_id,
                                                      "luftpause.run_id": request.run_id}) as span:
            action = await self.host.admit(request)
            if isinstance(action, core.Reject):
                span.set_status(Status(StatusCode.ERROR, action.message))
                await context.abort(GRPC_CODES[action.reason], action.message)
            span.set_attributes({"luftpause.replica": action.replica, "luftpause.held_ms": action.held_ms})
        endpoint = self.host.endpoints[action.replica]
        return pb.AdmitReply(
            replica=endpoint.name, base_url=endpoint.base_url, api_key_env=endpoint.api_key_env, held_ms=action.held_ms,
            native_apis=self.host.native_apis(endpoint), hints=self.host.hints(endpoint, request.run_id),
        )

    async def Report(self, request_iterator: AsyncIterator[pb.TurnEventBatch], context) -> pb.ReportAck:
        await self._leading(context)
        dataplane = {m.key: m.value for m in context.invocation_metadata() or ()}.get(DATAPLANE_METADATA, "")
        count = 0
        self.host.stream_opened(dataplane)
        try:
            async for batch in request_iterator:
                for event in batch.events:
                    self.host.report(event)
                count += len(batch.events)
        finally:
            self.host.stream_closed(dataplane)
        return pb.ReportAck(events=count)

    async def Resync(self, request: pb.ResyncRequest, context) -> pb.ResyncReply:
        await self._leading(context)
        if problem := resync_problem(request):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, problem)
        self.host.resync(request)
        return pb.ResyncReply(runs=len(request.runs), turns=len(request.turns))

    async def Status(self, request: pb.StatusRequest, context) -> pb.StatusReply:
        return json_format.ParseDict(self.host.status(), pb.StatusReply())


def grpc_server(host: SchedulerHost, bind: str, token: str | None = None) -> tuple[grpc.aio.Server, health.aio.HealthServicer]:
    """The Scheduler service plus standard health checking and reflection (grpcurl);
    with ``token``, every call but health checks must carry it (luftpause.auth)."""
    server = grpc.aio.server(interceptors=auth.server_interceptors(token), options=EXCLUSIVE_PORT)
    pb_grpc.add_SchedulerServicer_to_server(SchedulerServicer(host), server)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    service_name = pb.DESCRIPTOR.services_by_name["Scheduler"].full_name
    reflection.enable_server_reflection((service_name, health.SERVICE_NAME, reflection.SERVICE_NAME), server)
    server.add_insecure_port(bind)
    return server, health_servicer


async def mark_serving(servicer: health.aio.HealthServicer) -> None:
    for name in ("", pb.DESCRIPTOR.services_by_name["Scheduler"].full_name):
        await servicer.set(name, health_pb2.HealthCheckResponse.SERVING)

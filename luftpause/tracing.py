"""OpenTelemetry tracing shared by the services.

With ``OTEL_EXPORTER_OTLP_ENDPOINT`` set, spans go over OTLP/HTTP to that endpoint
(the standard ``OTEL_*`` variables tune the exporter and batching); unset, the API's
no-op tracer is used and nothing is exported. W3C ``traceparent`` is the propagation
format everywhere: HTTP headers, gRPC metadata and MCP request ``_meta``.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, MutableMapping

from opentelemetry import propagate, trace
from opentelemetry.context import Context

_provider = None


def configure(service: str) -> trace.Tracer:
    """Install an exporting tracer provider when an OTLP endpoint is configured."""
    global _provider
    if os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT") and _provider is None:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor

        _provider = TracerProvider(resource=Resource.create({"service.name": f"luftpause-{service}"}))
        _provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
        trace.set_tracer_provider(_provider)
    return trace.get_tracer(f"luftpause.{service}")


def exporting() -> bool:
    """Spans are recorded and exported (an OTLP endpoint was configured)."""
    return _provider is not None


def shutdown() -> None:
    """Flush spans still batched (at process exit)."""
    if _provider is not None:
        _provider.shutdown()


def extract(carrier: Mapping[str, str]) -> Context:
    """The remote parent carried by ``traceparent`` (and ``tracestate``), if any."""
    return propagate.extract(carrier)


def inject(carrier: MutableMapping[str, str]) -> MutableMapping[str, str]:
    """Add the current span's ``traceparent`` to outgoing headers or metadata."""
    propagate.inject(carrier)
    return carrier


def trace_id() -> str:
    """The current trace id as 32 hex digits, or "" outside a recorded trace."""
    context = trace.get_current_span().get_span_context()
    return format(context.trace_id, "032x") if context.is_valid else ""


def traceparent() -> str:
    """The current span's W3C ``traceparent``, or "" outside a trace (no propagator call:
    this runs once per turn)."""
    context = trace.get_current_span().get_span_context()
    if not context.is_valid:
        return ""
    return f"00-{context.trace_id:032x}-{context.span_id:016x}-{context.trace_flags:02x}"

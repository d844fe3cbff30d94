"""Shared fixtures: the stack as real processes on free loopback ports."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
import structlog

from luftpause.dev.stack import Stack

if TYPE_CHECKING:
    from luftpause.dev.postgres import PrivateCluster


# The fixtures' dataplanes import the anthropic SDK on their first Messages turn, not at start
# (about 3 CPU seconds each, on 2 cores shared by every process of the suite); a test's own `env`
# can turn the warm-up back on. The Claude Code stack keeps the default.
LAZY_MESSAGES = {"LUFTPAUSE_MESSAGES_WARM_UP": "off"}


@pytest.fixture(autouse=True)
def structlog_as_it_was():
    """A test that runs an entry point in this process (a benchmark's main) configures
    structlog for it: a level, loggers cached on first use. The next tests get structlog's
    defaults back, so loggers first used there are not filtered at that level and
    ``structlog.testing.capture_logs`` sees what they log."""
    yield
    if structlog.is_configured():
        structlog.reset_defaults()


def start_stack(directory: Path, **options) -> Stack:
    options["env"] = {**LAZY_MESSAGES, **options.get("env", {})}
    stack = Stack.on_free_ports(directory, **options)
    stack.start()
    return stack


@pytest.fixture(scope="module")
def proxy_stack(tmp_path_factory) -> Iterator[Stack]:
    """Fake engines, scheduler and dataplane (no runtime, no fake MCP)."""
    stack = start_stack(tmp_path_factory.mktemp("proxy"), without=frozenset({"runtime", "fake-mcp"}))
    try:
        yield stack
    finally:
        stack.stop()


@pytest.fixture(scope="module")
def full_stack(tmp_path_factory) -> Iterator[Stack]:
    """Everything `make run` starts, on free ports."""
    stack = start_stack(tmp_path_factory.mktemp("full"), fake_mcp_args=["--delay-s", "0.2"])
    try:
        yield stack
    finally:
        stack.stop()


@pytest.fixture
def make_stack(tmp_path) -> Iterator:
    """Start a stack with custom options; every stack started is stopped afterwards."""
    started: list[Stack] = []

    def make(**options) -> Stack:
        stack = start_stack(tmp_path / f"stack{len(started)}", **options)
        started.append(stack)
        return stack

    try:
        yield make
    finally:
        for stack in started:
            stack.stop()


class OtlpCollector:
    """Stands in for an OpenTelemetry collector: receives OTLP/HTTP trace exports."""

    def __init__(self) -> None:
        import threading
        from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

        from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

        self.spans: list[dict] = []
        collector = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def do_POST(self):
                body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                export = ExportTraceServiceRequest.FromString(body)
                for resource_spans in export.resource_spans:
                    service = next((a.value.string_value for a in resource_spans.resource.attributes
                                    if a.key == "service.name"), "")
                    for scope in resource_spans.scope_spans:
                        for span in scope.spans:
                            collector.spans.append({
                                "service": service, "name": span.name, "trace_id": span.trace_id.hex(),
                                "span_id": span.span_id.hex(), "parent_span_id": span.parent_span_id.hex(),
                                "attributes": {a.key: _otlp_value(a.value) for a in span.attributes},
                            })
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", "0")
                self.end_headers()

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.endpoint = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def named(self, name: str) -> list[dict]:
        return [s for s in self.spans if s["name"] == name]

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def _otlp_value(value):
    kind = value.WhichOneof("value")
    if kind == "array_value":
        return [_otlp_value(v) for v in value.array_value.values]
    return getattr(value, kind) if kind else None


@pytest.fixture
def otlp_collector() -> Iterator[OtlpCollector]:
    collector = OtlpCollector()
    try:
        yield collector
    finally:
        collector.close()


@pytest.fixture(scope="session")
def postgres() -> Iterator["PrivateCluster"]:
    """A private PostgreSQL cluster on 127.0.0.1 for the whole session (the machine's server
    packages; .ci/run installs them when missing); each test makes its own database."""
    import shutil
    import tempfile

    from luftpause.dev.postgres import PrivateCluster

    # Not under pytest's tmp_path: as root the cluster runs as the postgres user, who cannot
    # enter pytest's private directories.
    directory = Path(tempfile.mkdtemp(prefix="luftpause-pg-"))
    cluster = PrivateCluster(directory)
    try:
        cluster.start()
        yield cluster
    finally:
        cluster.stop("immediate")
        shutil.rmtree(directory, ignore_errors=True)


@pytest.fixture
def database(postgres, request) -> str:
    """The URL of a new empty database for this test."""
    import re
    import uuid

    name = re.sub(r"[^a-z0-9_]", "_", request.node.name.lower())[:40] + "_" + uuid.uuid4().hex[:8]
    return postgres.create_database(name)

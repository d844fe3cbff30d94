"""Envoy's configuration, generated from the pool file: Envoy in front of the engines, with
the endpoint picker (``python -m luftpause.picker``) choosing each turn's replica over
ext_proc. Where Envoy's binary and the picker's stubs come from, and the names both sides
of ext_proc use, are in luftpause/envoy.py.

The configuration (docs/envoy.md walks through it): one listener; the ext_proc filter
sending each request's headers and buffered body to the picker and streaming the response
through it; a STATIC cluster of the pool's engines under Envoy's ``override_host``
load-balancing policy, which sends the request to the first reachable endpoint of the
picker's ``x-gateway-destination-endpoint`` list (retrying down it when an engine refuses
the connection); and the picker cluster, gRPC health-checked so that of two pickers only
live ones get streams.

``python -m luftpause.scheduler.envoy config --pool-file ... `` prints a configuration;
``python -m luftpause.scheduler.envoy install`` installs (or finds) the binary;
``python -m luftpause.scheduler.envoy stubs`` installs (or finds) the ext_proc stubs.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import yaml

from luftpause import envoy as shared
from luftpause.envoy import DESTINATION, EXT_PROC_SERVICE, LB_NAMESPACE, SUBSET_NAMESPACE, socket_address
from luftpause.scheduler.pool import Endpoint, load_pool

# Held turns wait in the picker: Envoy waits for its answer as long as a turn may be held.
PICKER_MESSAGE_TIMEOUT_S = 3600
DEFAULT_MAX_BODY_BYTES = 32 * 1024 * 1024  # as the dataplane's limit


def _address(host: str, port: int) -> dict:
    return {"socket_address": {"address": host, "port_value": port}}


def _lb_policy(name: str, type_url: str, **config) -> dict:
    return {"policies": [{"typed_extension_config": {"name": name, "typed_config": {"@type": type_url, **config}}}]}


def config(endpoints: list[Endpoint], *, port: int, admin_port: int, pickers: list[tuple[str, int]],
           host: str = "127.0.0.1", fail_open: bool = False,
           max_body_bytes: int = DEFAULT_MAX_BODY_BYTES) -> dict:
    """Envoy's bootstrap for ``endpoints`` behind ``pickers`` (host, gRPC port).

    ``fail_open``: when no picker answers, requests go on to an engine chosen by Envoy
    (least request) instead of a 500."""
    return {
        "admin": {"address": _address(host, admin_port)},
        "static_resources": {
            "listeners": [{
                "name": "luftpause",
                "address": _address(host, port),
                # The largest request body the picker is sent (Envoy answers 413 above it).
                "per_connection_buffer_limit_bytes": max_body_bytes,
                "filter_chains": [{"filters": [{"name": "envoy.filters.network.http_connection_manager",
                                                "typed_config": _connection_manager(endpoints, pickers, fail_open)}]}],
            }],
            "clusters": [_pool_cluster(endpoints, max_body_bytes), _picker_cluster(pickers)],
        },
    }


def _ext_proc(pickers: list[tuple[str, int]], fail_open: bool) -> dict:
    """The ext_proc filter: each request's headers and buffered body to a picker, the
    response streamed through it."""
    return {
        "@type": "type.googleapis.com/envoy.extensions.filters.http.ext_proc.v3.ExternalProcessor",
        # A stream a picker refuses (it is gone) is opened again on another picker.
        "grpc_service": {"envoy_grpc": {"cluster_name": "picker"}, "retry_policy": {
            "retry_on": "connect-failure,refused-stream,unavailable,reset", "num_retries": max(1, len(pickers) - 1) + 1,
            "retry_back_off": {"base_interval": "0.05s", "max_interval": "0.5s"},
            "retry_host_predicate": [{"name": "envoy.retry_host_predicates.previous_hosts", "typed_config": {
                "@type": "type.googleapis.com/envoy.extensions.retry.host.previous_hosts.v3.PreviousHostsPredicate"}}],
            "host_selection_retry_max_attempts": 3}},
        "failure_mode_allow": fail_open,
        "message_timeout": f"{PICKER_MESSAGE_TIMEOUT_S}s",
        "processing_mode": {
            "request_header_mode": "SEND",
            "request_body_mode": "BUFFERED",
            "response_header_mode": "SEND",
            "response_body_mode": "STREAMED",
            "request_trailer_mode": "SKIP",
            "response_trailer_mode": "SKIP",
        },
        # The engine that served the response: the picker names it in x-luftpause-replica.
        "response_attributes": ["upstream.address"],
        "metadata_options": {
            # Only the gateway's subset hint goes to the picker: forwarding its own answer
            # (envoy.lb) back would copy it into every later message of the turn, each
            # response chunk included, for nothing.
            "forwarding_namespaces": {"untyped": [SUBSET_NAMESPACE]},
            "receiving_namespaces": {"untyped": [LB_NAMESPACE]},
        },
    }


def _status_is(code: int) -> dict:
    return {"status_code_filter": {"comparison": {"op": "EQ", "value": {"default_value": code,
                                                                       "runtime_key": f"luftpause.status_{code}"}}}}


def _local_reply() -> dict:
    """Envoy's own answers in the shape every luftpause error has: 413 (body over the
    limit), 500 (no picker answered, fail-closed) and its upstream failures (no engine
    reachable). The picker's own answers are that shape already, and it never answers
    413 or 500, nor carries these response flags."""
    as_json = {"json_format": {"error": {"message": "%LOCAL_REPLY_BODY%"}}, "content_type": "application/json"}
    upstream_failed = {"response_flag_filter": {"flags": ["UH", "UF", "UO", "URX", "NR", "UC", "UT", "LH", "UMSDR"]}}
    return {"mappers": [
        # ext_proc failed (no picker answered) and Envoy is fail-closed: its body is empty.
        {"filter": _status_is(500), "body": {"inline_string": "the endpoint picker did not answer (fail-closed)"},
         "body_format_override": as_json},
        {"filter": {"or_filter": {"filters": [_status_is(413), upstream_failed]}}, "body_format_override": as_json},
    ]}


def _connection_manager(endpoints: list[Endpoint], pickers: list[tuple[str, int]], fail_open: bool) -> dict:
    """The listener's HTTP connection manager: every request through ext_proc, then routed
    to the pool's cluster."""
    return {
        "@type": "type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager",
        "stat_prefix": "luftpause",
        "codec_type": "AUTO",
        "stream_idle_timeout": f"{PICKER_MESSAGE_TIMEOUT_S}s",  # held turns are idle streams
        "local_reply_config": _local_reply(),
        "route_config": {"name": "pool", "virtual_hosts": [{
            "name": "pool", "domains": ["*"],
            "routes": [{"match": {"prefix": "/"}, "route": {
                "cluster": "pool",
                "timeout": "0s",  # streams of any length
                # An engine that refuses the connection: the next endpoint of the picker's list.
                "retry_policy": {"retry_on": "connect-failure,refused-stream,reset-before-request",
                                 "num_retries": max(1, len(endpoints) - 1)},
            }}],
        }]},
        "http_filters": [
            {"name": "envoy.filters.http.ext_proc", "typed_config": _ext_proc(pickers, fail_open)},
            {"name": "envoy.filters.http.router", "typed_config": {
                "@type": "type.googleapis.com/envoy.extensions.filters.http.router.v3.Router"}},
        ],
    }


def _pool_cluster(endpoints: list[Endpoint], max_body_bytes: int) -> dict:
    """The engines, under ``override_host``: the first reachable endpoint of the picker's
    list (least request among all of them when no picker named one)."""
    pool_hosts = [{"endpoint": {"address": _address(*socket_address(e.base_url))}} for e in endpoints]
    override_host = _lb_policy(
        "envoy.load_balancing_policies.override_host",
        "type.googleapis.com/envoy.extensions.load_balancing_policies.override_host.v3.OverrideHost",
        override_host_sources=[{"header": DESTINATION},
                               {"metadata": {"key": LB_NAMESPACE, "path": [{"key": DESTINATION}]}}],
        fallback_policy=_lb_policy(
            "envoy.load_balancing_policies.least_request",
            "type.googleapis.com/envoy.extensions.load_balancing_policies.least_request.v3.LeastRequest"),
    )
    return {"name": "pool", "type": "STATIC", "connect_timeout": "2s",
            "per_connection_buffer_limit_bytes": max_body_bytes,
            "load_assignment": {"cluster_name": "pool", "endpoints": [{"lb_endpoints": pool_hosts}]},
            "load_balancing_policy": override_host}


def _picker_cluster(pickers: list[tuple[str, int]]) -> dict:
    """The pickers, over HTTP/2 (gRPC), health-checked so that only live ones get streams."""
    http2 = {"envoy.extensions.upstreams.http.v3.HttpProtocolOptions": {
        "@type": "type.googleapis.com/envoy.extensions.upstreams.http.v3.HttpProtocolOptions",
        "explicit_http_config": {"http2_protocol_options": {}}}}
    return {"name": "picker", "type": "STATIC", "connect_timeout": "1s",
            "typed_extension_protocol_options": http2,
            # Only pickers that answer their health check (never all of them in panic).
            "common_lb_config": {"healthy_panic_threshold": {"value": 0}},
            "load_assignment": {"cluster_name": "picker", "endpoints": [{"lb_endpoints": [
                {"endpoint": {"address": _address(h, p)}} for h, p in pickers]}]},
            # A picker that stops answering its health check gets no new streams.
            # A dead picker refuses the connection and fails at once; one slow answer
            # on a busy host does not take a live one out.
            "health_checks": [{"timeout": "2s", "interval": "0.5s", "unhealthy_threshold": 2,
                               "healthy_threshold": 1, "no_traffic_interval": "0.5s",
                               "grpc_health_check": {"service_name": EXT_PROC_SERVICE}}]}


def write_config(path: Path, pool_file: Path, **options) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(render(load_pool(pool_file), **options))
    return path


def render(endpoints: list[Endpoint], **options) -> str:
    return ("# Generated by `python -m luftpause.scheduler.envoy config` from the pool file: "
            "edit the pool, not this file (docs/envoy.md).\n"
            + yaml.safe_dump(config(endpoints, **options), sort_keys=False))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m luftpause.scheduler.envoy",
                                     description=__doc__ + "\n" + shared.__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True)
    commands.add_parser("install", help="install Envoy into the cache (if missing) and print its path")
    commands.add_parser("stubs", help="install the ext_proc stubs (xds-protos) into their directory (if missing) "
                                      "and print its path")
    generate = commands.add_parser("config", help="print Envoy's configuration for a pool file")
    generate.add_argument("--pool-file", default="config/pool.yaml")
    generate.add_argument("--port", type=int, default=8080, help="the listener (the proxy's port; default 8080)")
    generate.add_argument("--admin-port", type=int, default=9901, help="Envoy's admin page (default 9901)")
    generate.add_argument("--picker", action="append", default=None, metavar="HOST:PORT",
                          help="a picker's gRPC address, repeatable (default 127.0.0.1:5002)")
    generate.add_argument("--fail-open", action="store_true",
                          help="when no picker answers, send requests on to an engine Envoy picks (default: 500)")
    args = parser.parse_args(argv)
    if args.command == "install":
        sys.stdout.write(f"{shared.ensure()}\n")
        return 0
    if args.command == "stubs":
        sys.stdout.write(f"{shared.ensure_stubs()}\n")
        return 0
    pickers = [(a.rpartition(":")[0], int(a.rpartition(":")[2])) for a in (args.picker or ["127.0.0.1:5002"])]
    sys.stdout.write(render(load_pool(Path(args.pool_file)), port=args.port, admin_port=args.admin_port,
                            pickers=pickers, fail_open=args.fail_open))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Free ports stay free until a service binds them, or the stack moves the service.

Between choosing a free port and a service binding it, another process may take it (the
kernel hands the same ephemeral ports to everyone). A stack on free ports must still come
up, with every address it reports true."""

from __future__ import annotations

import json
import os
import socket
from collections.abc import Iterator
from contextlib import contextmanager

import httpx
import pytest

from luftpause import vocabulary as h
from luftpause.dev.procs import (
    WAIT_S,
    ManagedProcess,
    PortTaken,
    free_ports,
    listening_owners,
    start_on_free_ports,
    wait_until,
)
from luftpause.dev.stack import MODEL, Ports, Stack, write_configs

NO_RUNTIME = frozenset({"runtime", "fake-mcp"})


@contextmanager
def taken(port: int, reuse_port: bool = False) -> Iterator[socket.socket]:
    """Someone else listening on ``port`` (with SO_REUSEPORT, as another gRPC server would)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        if reuse_port:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        sock.bind(("127.0.0.1", port))
        sock.listen()
        yield sock


def test_free_ports_are_all_different_and_avoid_the_ones_in_use():
    in_use = free_ports(20)
    ports = free_ports(200, avoid=in_use)
    assert len(set(ports)) == 200
    assert not set(ports) & set(in_use)
    chosen = Ports.free(engines=3, dataplanes=2, pickers=2).all()
    assert len(set(chosen)) == len(chosen)


def test_a_stack_whose_ports_are_taken_before_it_binds_them_moves_those_services(tmp_path):
    stack = Stack.on_free_ports(tmp_path, without=NO_RUNTIME)
    chosen = stack.ports
    with taken(chosen.engines[0]), taken(chosen.scheduler_grpc, reuse_port=True):
        try:
            stack.start()
            moved = stack.ports
            assert moved.engines[0] != chosen.engines[0]
            assert moved.scheduler_grpc != chosen.scheduler_grpc
            assert (moved.engines[1], moved.scheduler_http, moved.dataplane) == (
                chosen.engines[1], chosen.scheduler_http, chosen.dataplane)
            # The scheduler found engine-a at its new address (the pool file followed it) ...
            status_url = f"http://127.0.0.1:{moved.scheduler_http}/status"
            assert wait_until(lambda: all(r["healthy"] for r in httpx.get(status_url).json()["replicas"]), WAIT_S, 0.1)
            # ... the dataplane the scheduler at its new gRPC port, and what the stack reports is true.
            reply = httpx.post(f"http://127.0.0.1:{moved.dataplane}/v1/chat/completions", timeout=30,
                               json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}]},
                               headers={h.CALLER: "e2e"})
            assert reply.status_code == 200 and reply.json()["choices"][0]["message"]["content"]
            recorded = json.loads((stack.state_dir / "stack.json").read_text())
            assert recorded["ports"]["scheduler_grpc"] == moved.scheduler_grpc
            assert recorded["urls"]["engine-a"] == f"http://localhost:{moved.engines[0]}"
        finally:
            stack.stop()


def test_a_stack_on_given_ports_does_not_move_a_service_whose_port_is_taken(tmp_path):
    ports = Ports.free()
    pool_file, tools_file = write_configs(tmp_path / "config", ports)
    stack = Stack(ports, pool_file, tools_file, tmp_path / "state",
                  without=frozenset({"engine-b", "fake-mcp", "scheduler", "dataplane", "runtime"}))
    with taken(ports.engines[0]), pytest.raises(PortTaken) as raised:
        stack.start()
    assert raised.value.name == "engine-a" and raised.value.names_port(ports.engines[0])
    assert stack.ports == ports and stack.processes == []


def test_a_process_started_on_free_ports_starts_again_when_its_port_was_taken(tmp_path):
    with taken(free_ports(1)[0]) as holder:
        occupied = holder.getsockname()[1]
        given: list[int] = []

        def engine(ports: list[int]) -> ManagedProcess:
            port = occupied if not given else ports[0]  # the first choice is taken meanwhile
            given.append(port)
            return ManagedProcess("engine", "luftpause.fakes.engine", ["--port", str(port)],
                                  ready_url=f"http://127.0.0.1:{port}/health", log_path=tmp_path / f"engine-{port}.log")

        process, ports = start_on_free_ports(engine)
        try:
            assert given == [occupied, ports[0]]
            assert httpx.get(f"http://127.0.0.1:{ports[0]}/health").status_code == 200
        finally:
            process.stop()


def test_a_port_taken_by_another_service_that_answers_health_is_not_taken_for_ready(tmp_path):
    # Every service answers /health: on a port another test's service took between choosing
    # and binding, the answer is that service's, and the process started must not pass for ready.
    other, (occupied,) = start_on_free_ports(lambda ports: ManagedProcess(
        "other-engine", "luftpause.fakes.engine", ["--port", str(ports[0])],
        ready_url=f"http://127.0.0.1:{ports[0]}/health", log_path=tmp_path / "other.log"))
    given: list[int] = []

    def engine(ports: list[int]) -> ManagedProcess:
        port = occupied if not given else ports[0]
        given.append(port)
        return ManagedProcess("engine", "luftpause.fakes.engine", ["--port", str(port)],
                              ready_url=f"http://127.0.0.1:{port}/health", log_path=tmp_path / f"engine-{port}.log")

    try:
        process, ports = start_on_free_ports(engine)
        try:
            assert given == [occupied, ports[0]] and ports[0] != occupied
        finally:
            process.stop()
    finally:
        other.stop()


def test_a_listening_port_names_its_owner_and_a_closed_one_none():
    port = free_ports(1)[0]
    with taken(port):
        assert any(owner.split()[0] == str(os.getpid()) for owner in listening_owners(port))
    assert listening_owners(port) == []

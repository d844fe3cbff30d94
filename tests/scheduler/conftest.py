"""A scheduler process for the gRPC tests (test_grpc_host.py, test_connect.py)."""

from __future__ import annotations

import pytest
import yaml

from luftpause.dev.procs import ManagedProcess, free_ports, start_on_free_ports

MODEL = "fake-llama-1b"


@pytest.fixture
def scheduler(tmp_path):
    """A scheduler whose only engine is not running yet (port reserved, nothing listens)."""
    (engine_port,) = free_ports(1)
    pool = tmp_path / "pool.yaml"
    pool.write_text(yaml.safe_dump({"endpoints": [
        {"name": "engine-a", "base_url": f"http://127.0.0.1:{engine_port}", "models": [MODEL]}]}))
    process, (grpc_port, http_port) = start_on_free_ports(lambda ports: ManagedProcess(
        "scheduler", "luftpause.scheduler",
        ["--grpc-port", str(ports[0]), "--http-port", str(ports[1]), "--pool-file", str(pool)],
        ready_url=f"http://127.0.0.1:{ports[1]}/health", log_path=tmp_path / "scheduler.log"), count=2, timeout=30)
    try:
        yield {"grpc": f"127.0.0.1:{grpc_port}", "http": f"http://127.0.0.1:{http_port}",
               "engine_port": engine_port, "tmp": tmp_path}
    finally:
        process.stop()

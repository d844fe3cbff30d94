"""The Envoy configuration in the repository is the one generated from the pool file, and
the real Envoy binary accepts what the generator writes."""

from __future__ import annotations

import subprocess
from pathlib import Path

from luftpause import envoy as shared
from luftpause.scheduler import envoy
from luftpause.scheduler.pool import load_pool

ROOT = Path(__file__).resolve().parents[2]


def test_committed_config_is_what_the_pool_file_generates():
    generated = envoy.render(load_pool(ROOT / "config" / "pool.yaml"), port=8080, admin_port=9901,
                             pickers=[("127.0.0.1", 5002)])
    assert (ROOT / "config" / "envoy.yaml").read_text() == generated, \
        "config/envoy.yaml is stale: python -m luftpause.scheduler.envoy config > config/envoy.yaml"


def test_envoy_accepts_the_generated_config_with_two_pickers_and_fail_open(tmp_path):
    path = tmp_path / "envoy.yaml"
    path.write_text(envoy.render(load_pool(ROOT / "config" / "pool.yaml"), port=8080, admin_port=9901,
                                 pickers=[("127.0.0.1", 5002), ("127.0.0.1", 5004)], fail_open=True))
    result = subprocess.run([str(shared.ensure()), "--mode", "validate", "-c", str(path)],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "OK" in result.stdout + result.stderr


def test_replicas_are_addressed_by_ip_and_port():
    assert shared.endpoint_key("http://127.0.0.1:9001") == "127.0.0.1:9001"
    assert shared.endpoint_key("http://localhost:9001") in ("127.0.0.1:9001", "[::1]:9001")
    assert shared.endpoint_key("https://[::1]") == "[::1]:443"

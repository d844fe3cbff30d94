"""Every `python -m` entry point starts and documents the environment it reads."""

from __future__ import annotations

import subprocess
import sys

import pytest

DOCUMENTED = {
    "luftpause": ["--free-ports", "--pool-file", "--tools-file", "--state-dir", "LUFTPAUSE_LOG_FORMAT", "--engine",
                  "LUFTPAUSE_LLAMA_CACHE", "--gateway", "--fail-open"],
    "luftpause.dev.llama": ["build", "LUFTPAUSE_LLAMA_CACHE"],
    "luftpause.scheduler.picker": ["LUFTPAUSE_PICKER_GRPC_PORT", "LUFTPAUSE_PICKER_HTTP_PORT", "LUFTPAUSE_SCHEDULER_ADDR",
                                   "LUFTPAUSE_TOKEN"],
    "luftpause.scheduler.envoy": ["install", "config", "LUFTPAUSE_ENVOY_CACHE"],
    "luftpause.scheduler": ["LUFTPAUSE_SCHEDULER_HOST", "LUFTPAUSE_SCHEDULER_GRPC_PORT",
                            "LUFTPAUSE_SCHEDULER_HTTP_PORT", "LUFTPAUSE_POOL_FILE", "LUFTPAUSE_AFFINITY",
                            "LUFTPAUSE_PROBE_PERIOD_S", "LUFTPAUSE_LOG_FORMAT", "LUFTPAUSE_LOG_LEVEL",
                            "LUFTPAUSE_RUNTIME_URL", "LUFTPAUSE_TOKEN", "LUFTPAUSE_ALLOWED_HOSTS"],
    "luftpause.dataplane": ["LUFTPAUSE_DATAPLANE_HOST", "LUFTPAUSE_DATAPLANE_PORT", "LUFTPAUSE_SCHEDULER_ADDR",
                            "LUFTPAUSE_MAX_BODY_BYTES", "LUFTPAUSE_TOKEN", "LUFTPAUSE_LOG_FORMAT",
                            "LUFTPAUSE_LOG_LEVEL", "LUFTPAUSE_ALLOWED_HOSTS"],
    "luftpause.runtime": ["LUFTPAUSE_RUNTIME_HOST", "LUFTPAUSE_RUNTIME_PORT", "LUFTPAUSE_DATAPLANE_URL",
                          "LUFTPAUSE_TOOLS_FILE", "LUFTPAUSE_STATE_DIR", "LUFTPAUSE_TOKEN",
                          "LUFTPAUSE_LOG_FORMAT", "LUFTPAUSE_LOG_LEVEL", "LUFTPAUSE_ALLOWED_HOSTS",
                          "LUFTPAUSE_SESSION_EVICT_IDLE_S"],
    "luftpause.fakes.engine": ["--max-running", "--tool-calls", "--metrics-format", "--fault", "--idle-close-s"],
    "luftpause.fakes.mcp": ["--delay-s"],
    "luftpause.loadgen": ["--agents", "--spawn"],
    "luftpause.loadgen.proxy_bench": ["--streams", "--no-floor", "--no-envoy"],
    "luftpause.loadgen.picker_bench": ["--requests", "--concurrency", "--json"],
    "luftpause.loadgen.floor_proxy": ["--engine", "--port"],
    "luftpause.loadgen.grpc_transport_bench": ["--rounds", "GRPC_EXPERIMENTS"],
    "luftpause.loadgen.scheduler_bench": ["--events"],
}


@pytest.mark.parametrize("module", sorted(DOCUMENTED))
def test_help_names_what_the_entry_point_reads(module):
    result = subprocess.run([sys.executable, "-m", module, "--help"], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    help_text = " ".join(result.stdout.split())  # argparse wraps long names across lines
    missing = [name for name in DOCUMENTED[module] if name not in help_text.replace("- ", "-")]
    assert not missing, f"{module} --help does not mention {missing}"

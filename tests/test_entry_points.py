"""Every `python -m` entry point starts and documents the environment it reads; a service's
entry point imports no development tooling, and the shared package holds only what the
services import."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

import luftpause

DOCUMENTED = {
    "luftpause": ["--free-ports", "--pool-file", "--tools-file", "--state-dir", "LUFTPAUSE_LOG_FORMAT", "--engine",
                  "LUFTPAUSE_LLAMA_CACHE", "--gateway", "--fail-open"],
    "luftpause.dev.llama": ["build", "LUFTPAUSE_LLAMA_CACHE"],
    "luftpause.picker": ["LUFTPAUSE_PICKER_GRPC_PORT", "LUFTPAUSE_PICKER_HTTP_PORT", "LUFTPAUSE_SCHEDULER_ADDR",
                         "LUFTPAUSE_TOKEN", "LUFTPAUSE_PICKER_SHED_BATCH_HELD", "LUFTPAUSE_PICKER_SHED_BATCH_WAIT_S",
                         "LUFTPAUSE_KEY_IDENTITIES", "LUFTPAUSE_KEYS_FILE"],
    "luftpause.scheduler.envoy": ["install", "config", "LUFTPAUSE_ENVOY_CACHE"],
    "luftpause.scheduler": ["LUFTPAUSE_SCHEDULER_HOST", "LUFTPAUSE_SCHEDULER_GRPC_PORT",
                            "LUFTPAUSE_SCHEDULER_HTTP_PORT", "LUFTPAUSE_POOL_FILE", "LUFTPAUSE_DIAGNOSTICS",
                            "LUFTPAUSE_PROBE_PERIOD_S", "LUFTPAUSE_LOG_FORMAT", "LUFTPAUSE_LOG_LEVEL",
                            "LUFTPAUSE_RUNTIME_URL", "LUFTPAUSE_TOKEN", "LUFTPAUSE_ALLOWED_HOSTS"],
    "luftpause.dataplane": ["LUFTPAUSE_DATAPLANE_HOST", "LUFTPAUSE_DATAPLANE_PORT", "LUFTPAUSE_SCHEDULER_ADDR",
                            "LUFTPAUSE_MAX_BODY_BYTES", "LUFTPAUSE_TOKEN", "LUFTPAUSE_LOG_FORMAT",
                            "LUFTPAUSE_LOG_LEVEL", "LUFTPAUSE_ALLOWED_HOSTS", "LUFTPAUSE_TOOL_CALLS"],
    "luftpause.runtime": ["LUFTPAUSE_RUNTIME_HOST", "LUFTPAUSE_RUNTIME_PORT", "LUFTPAUSE_DATAPLANE_URL",
                          "LUFTPAUSE_TOOLS_FILE", "LUFTPAUSE_STATE_DIR", "LUFTPAUSE_TOKEN",
                          "LUFTPAUSE_LOG_FORMAT", "LUFTPAUSE_LOG_LEVEL", "LUFTPAUSE_ALLOWED_HOSTS",
                          "LUFTPAUSE_SESSION_EVICT_IDLE_S"],
    "luftpause.fakes.engine": ["--max-running", "--tool-calls", "--metrics-format", "--fault", "--idle-close-s"],
    "luftpause.fakes.mcp": ["--delay-s"],
    "luftpause.loadgen": ["--agents", "--spawn"],
    "luftpause.loadgen.proxy_bench": ["--streams", "--no-floor", "--no-envoy", "picker"],
    "luftpause.loadgen.proxy_bench picker": ["--duration", "--concurrency", "--json"],
    "luftpause.loadgen.proxy_bench messages": ["--requests", "--reply-tokens"],
    "luftpause.loadgen.proxy_bench responses": ["--requests", "--repetitions", "--json"],
    "luftpause.loadgen.floor_proxy": ["--engine", "--port"],
    "luftpause.loadgen.scheduler_bench": ["--events"],
    "luftpause.loadgen.body_memory_bench": ["--size-mib", "--concurrency", "--cases", "--json"],
}


def run_side_by_side(commands: dict) -> dict[object, subprocess.CompletedProcess]:
    """Each command (a key's argument list, and its own environment variables) run to its end,
    as many at once as there are CPUs: the interpreters' starts are most of each test."""
    def run(key):
        arguments, extra = commands[key]
        try:
            return subprocess.run(arguments, capture_output=True, text=True, timeout=60, env={**os.environ, **extra})
        except subprocess.TimeoutExpired as expired:  # that command's test fails, naming it
            return subprocess.CompletedProcess(arguments, None, expired.stdout, f"still running after 60 s: {expired}")

    with ThreadPoolExecutor(os.cpu_count() or 1) as pool:
        return dict(zip(commands, pool.map(run, commands), strict=True))


@pytest.fixture(scope="module")
def helps() -> dict[str, subprocess.CompletedProcess]:
    """``python -m <module> [mode] --help`` of every documented entry point."""
    return run_side_by_side({module: ([sys.executable, "-m", *module.split(), "--help"], {}) for module in DOCUMENTED})


@pytest.mark.parametrize("module", sorted(DOCUMENTED))
def test_help_names_what_the_entry_point_reads(helps, module):
    result = helps[module]
    assert result.returncode == 0, result.stderr
    help_text = " ".join(result.stdout.split())  # argparse wraps long names across lines
    missing = [name for name in DOCUMENTED[module] if name not in help_text.replace("- ", "-")]
    assert not missing, f"{module} --help does not mention {missing}"


BAD_ENV_VALUES = [
    ("luftpause.dataplane", "LUFTPAUSE_TOOL_CALLS", "sometimes"),
    ("luftpause.dataplane", "LUFTPAUSE_DATAPLANE_PORT", "eighty"),
    ("luftpause.scheduler", "LUFTPAUSE_DIAGNOSTICS", "yes"),
    ("luftpause.scheduler", "LUFTPAUSE_PROBE_PERIOD_S", "2s"),
    ("luftpause.runtime", "LUFTPAUSE_RUNTIME_PEER_IDENTITY", "cookie"),
    ("luftpause.picker", "LUFTPAUSE_PICKER_GRPC_PORT", "-"),
]


@pytest.fixture(scope="module")
def started_with_bad_env() -> dict[tuple[str, str, str], subprocess.CompletedProcess]:
    """Each service started with one bad value in its environment."""
    return run_side_by_side({(module, name, value): ([sys.executable, "-m", module], {name: value})
                             for module, name, value in BAD_ENV_VALUES})


@pytest.mark.parametrize("module, name, value", BAD_ENV_VALUES)
def test_a_service_refuses_a_bad_value_from_its_env_as_it_would_a_bad_flag(started_with_bad_env, module, name,
                                                                           value):
    # argparse checks a flag's type and choices, not a default read from the environment: a
    # bad value must stop the service with a usage error naming the variable, not a traceback
    # and not a silent switch to another behaviour (an unknown affinity value used to mean off)
    result = started_with_bad_env[(module, name, value)]
    assert result.returncode == 2, result.stderr
    assert f"{name}={value!r}" in result.stderr and "Traceback" not in result.stderr, result.stderr


# Each service's entry point, and its package: every module of it is imported too, so that
# the imports a service makes late (the runtime's app, after its fork) are counted.
SERVICE_ENTRY_POINTS = {
    "luftpause.scheduler.__main__": "luftpause.scheduler",
    "luftpause.picker.__main__": "luftpause.picker",
    "luftpause.dataplane.__main__": "luftpause.dataplane",
    "luftpause.runtime.__main__": "luftpause.runtime",
}
NOT_FOR_SERVICES = ("luftpause.dev", "luftpause.loadgen", "luftpause.fakes")
IMPORTED = """
import importlib, json, pkgutil, sys
entry, package = sys.argv[1], sys.argv[2]
importlib.import_module(entry)
if package:
    for found in pkgutil.walk_packages(importlib.import_module(package).__path__, package + "."):
        importlib.import_module(found.name)
print(json.dumps(sorted(name for name in sys.modules if name.split(".")[0] == "luftpause")))
"""


@pytest.fixture(scope="module")
def imported_by_service() -> dict[str, list[str]]:
    """The luftpause modules each service entry point has loaded, each in a fresh interpreter
    that imports it without starting it."""
    children = {entry: subprocess.Popen([sys.executable, "-c", IMPORTED, entry, package or ""],
                                        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
                for entry, package in SERVICE_ENTRY_POINTS.items()}
    imported = {}
    for entry, child in children.items():
        out, err = child.communicate(timeout=120)
        assert child.returncode == 0, f"importing {entry} failed:\n{err}"
        imported[entry] = json.loads(out)
    return imported


@pytest.mark.parametrize("entry", sorted(SERVICE_ENTRY_POINTS))
def test_a_service_imports_no_development_tooling(imported_by_service, entry):
    modules = imported_by_service[entry]
    assert entry in modules
    tooling = [name for name in modules if name.startswith(NOT_FOR_SERVICES)]
    assert not tooling, f"{entry} imports development or benchmark tooling: {tooling}"


def test_the_shared_package_holds_only_what_the_services_import(imported_by_service):
    shared = {f"luftpause.{path.stem}" for path in Path(luftpause.__file__).parent.glob("*.py")
              if path.stem not in ("__init__", "__main__")}
    used = {name for modules in imported_by_service.values() for name in modules if name in shared}
    assert shared - used == set(), f"luftpause/ holds modules no service imports: {sorted(shared - used)} " \
                                   "(development tooling belongs in luftpause/dev/)"

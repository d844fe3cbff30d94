"""The engine pool file: which replicas exist and what they serve.

YAML, one entry per endpoint::

    endpoints:
      - name: engine-a                 # unique; used in logs, status and 502 messages
        base_url: http://127.0.0.1:9001  # without /v1; ${VAR} is expanded from the environment
        probe_url: ""                  # optional: where the scheduler probes this endpoint (health,
                                       # metrics, server info, openapi, the probe generation),
                                       # when not at base_url (a metrics sidecar, a separate
                                       # network path); without /v1, ${VAR} expanded; "" = base_url.
                                       # Turns always go to base_url.
        models: [fake-llama-1b]        # models this replica serves (${VAR} expanded too)
        kind: generative               # generative | one-pass (classifier, outside run state)
        health_path: /health           # probed every 2 s; a 200 means healthy
        metrics_path: /metrics         # load (SGLang or vLLM names); absent metrics = never capped
        api_key_env: ""                # environment variable holding this replica's API key
        load_from: []                  # for a router: base URLs of the engines whose load it has
        device: ""                     # replicas naming the same device share one accelerator:
                                       # turns fill one of them before the next (each pass of
                                       # each replica reads all weights); "" = its own hardware
        max_batch: 16                  # optional: at most this many turns in flight here, the
                                       # largest batch the engine decodes at full speed (read
                                       # from SGLang's /get_server_info when absent)
        native_apis: [responses]       # optional: client APIs besides chat completions the
                                       # engine serves itself: "messages" (Anthropic
                                       # /v1/messages), "responses" (OpenAI /v1/responses).
                                       # Turns of those APIs pass through unchanged; others
                                       # are translated to and from /v1/chat/completions.
                                       # When absent, read from the engine's /openapi.json
                                       # (vLLM and SGLang publish their routes there) on the
                                       # first healthy probe of each healthy spell; [] = none
        hints:                         # optional: the engine's own agent features luftpause
          priority: lower-first        # drives (docs/engine-hints.md). priority: the order the
          sessions: false              # engine runs a request's top-level `priority` in:
          slots: 0                     # lower-first (vLLM --scheduling-policy priority; SGLang
                                       # with --schedule-low-priority-values-first), higher-first
                                       # (SGLang --enable-priority-scheduling), dynamo (an NVIDIA
                                       # Dynamo frontend: nvext.agent_hints.priority, higher
                                       # first), none. sessions:
                                       # SGLang --enable-session-radix-cache (session_id = the
                                       # run, /close_session when it ends). slots: llama.cpp's
                                       # --parallel (each run's id_slot chosen by the scheduler,
                                       # cache_prompt: true); 0 = none; not on a router entry.
                                       # When absent, read from the engine's /get_server_info
                                       # (SGLang publishes its server arguments there), else
                                       # llama.cpp's /props (total_slots), on the first healthy
                                       # probe of each healthy spell; an engine that publishes
                                       # none gets requests unchanged
"""

from __future__ import annotations

import os
import string
import urllib.parse
from dataclasses import dataclass
from pathlib import Path

import yaml

from luftpause.hints import EngineHints, HintsError
from luftpause.scheduler.core import GENERATIVE, ONE_PASS, Replica
from luftpause.scheduler.errors import SchedulerError


# The client APIs the dataplane serves besides chat completions (a pool entry's native_apis).
NATIVE_APIS = ("messages", "responses")


class PoolError(SchedulerError, ValueError):
    """The pool file is missing, malformed or inconsistent."""


@dataclass(frozen=True)
class Endpoint:
    name: str
    base_url: str
    models: tuple[str, ...]
    kind: str = GENERATIVE
    health_path: str = "/health"
    metrics_path: str = "/metrics"
    api_key_env: str = ""
    load_from: tuple[str, ...] = ()
    device: str = ""
    max_batch: int = 0  # 0 = not set
    native_apis: tuple[str, ...] | None = None  # None: not listed, read from the engine's /openapi.json
    probe_url: str = ""  # where the scheduler probes the engine; "" = base_url
    hints: EngineHints | None = None  # None: not listed, read from the engine's server info

    @property
    def probed_at(self) -> str:
        """The URL (without /v1) the scheduler's probes go to."""
        return self.probe_url or self.base_url

    def replica(self) -> Replica:
        """The core's replica: what its rules read of this entry (not how it is reached)."""
        return Replica(self.name, frozenset(self.models), self.kind, device=self.device, max_batch=self.max_batch)


def _expand(value: str, where: str) -> str:
    try:
        return string.Template(value).substitute(os.environ)
    except (KeyError, ValueError) as exc:
        raise PoolError(f"{where}: cannot expand {value!r}: missing variable {exc}") from None


def _text(entry: dict, key: str, where: str, default: str | None = None) -> str:
    value = entry.get(key, default)
    if not isinstance(value, str) or (default is None and not value):
        raise PoolError(f"{where}: '{key}' must be a non-empty string")
    return value


def _strings(entry: dict, key: str, where: str) -> tuple[str, ...]:
    value = entry.get(key, [])
    if not isinstance(value, list) or not all(isinstance(v, str) and v for v in value):
        raise PoolError(f"{where}: '{key}' must be a list of strings")
    return tuple(value)


def _max_batch(entry: dict, where: str) -> int:
    if "max_batch" not in entry:
        return 0
    value = entry["max_batch"]
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise PoolError(f"{where}: 'max_batch' must be a whole number of turns, at least 1")
    return value


def _native_apis(entry: dict, where: str) -> tuple[str, ...] | None:
    if "native_apis" not in entry:
        return None
    apis = _strings(entry, "native_apis", where)
    unknown = sorted(set(apis) - set(NATIVE_APIS))
    if unknown:
        raise PoolError(f"{where}: native_apis may name only {', '.join(NATIVE_APIS)}, not {', '.join(unknown)}")
    return tuple(dict.fromkeys(apis))


def _hints(entry: dict, where: str) -> EngineHints | None:
    if "hints" not in entry:
        return None
    try:
        hints = EngineHints.from_pool(entry["hints"])
    except HintsError as exc:
        raise PoolError(f"{where}: {exc}") from None
    if hints.slots and entry.get("load_from"):
        raise PoolError(f"{where}: hints.slots are one engine's slots, not a router's (load_from)")
    return hints


def _http_url(url: str) -> bool:
    try:
        parsed = urllib.parse.urlsplit(url)
        parsed.port  # noqa: B018 -- raises on a port that is not a number
    except ValueError:
        return False
    return parsed.scheme in ("http", "https") and bool(parsed.hostname)


def parse_pool(document: object) -> list[Endpoint]:
    if not isinstance(document, dict) or not isinstance(document.get("endpoints"), list):
        raise PoolError("pool file must be a mapping with an 'endpoints' list")
    endpoints: list[Endpoint] = []
    for index, entry in enumerate(document["endpoints"]):
        where = f"endpoints[{index}]"
        if not isinstance(entry, dict):
            raise PoolError(f"{where}: must be a mapping")
        unknown = set(entry) - set(Endpoint.__dataclass_fields__)
        if unknown:
            raise PoolError(f"{where}: unknown field(s) {', '.join(sorted(unknown))}")
        kind = _text(entry, "kind", where, GENERATIVE)
        if kind not in (GENERATIVE, ONE_PASS):
            raise PoolError(f"{where}: kind must be '{GENERATIVE}' or '{ONE_PASS}'")
        models = tuple(_expand(m, where) for m in _strings(entry, "models", where))
        if not models:
            raise PoolError(f"{where}: 'models' must list at least one model")
        endpoint = Endpoint(
            name=_text(entry, "name", where),
            base_url=_expand(_text(entry, "base_url", where), where).rstrip("/"),
            models=models,
            kind=kind,
            health_path=_text(entry, "health_path", where, "/health"),
            metrics_path=_text(entry, "metrics_path", where, "/metrics"),
            api_key_env=_text(entry, "api_key_env", where, ""),
            load_from=tuple(_expand(u, where).rstrip("/") for u in _strings(entry, "load_from", where)),
            device=_text(entry, "device", where, ""),
            max_batch=_max_batch(entry, where),
            native_apis=_native_apis(entry, where),
            probe_url=_expand(_text(entry, "probe_url", where, ""), where).rstrip("/"),
            hints=_hints(entry, where),
        )
        for key in ("base_url", "probe_url"):
            url = getattr(endpoint, key)
            if (url or key == "base_url") and not _http_url(url):
                raise PoolError(f"{where}: {key} must be an http:// or https:// URL with a host, got {url!r}")
        endpoints.append(endpoint)
    names = [e.name for e in endpoints]
    if len(set(names)) != len(names):
        raise PoolError("endpoint names must be unique")
    return endpoints


def load_pool(path: str | Path) -> list[Endpoint]:
    try:
        text = Path(path).read_text()
    except OSError as exc:
        raise PoolError(f"cannot read pool file {path}: {exc.strerror}") from None
    try:
        document = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise PoolError(f"pool file {path} is not valid YAML: {exc}") from None
    return parse_pool(document)

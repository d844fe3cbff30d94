"""Runtime settings (command line + environment) and the upstream tool-servers file.

The tools file is YAML::

    servers:
      - name: fake-mcp                 # streamable HTTP
        url: http://127.0.0.1:9000/mcp
        headers: {Authorization: "Bearer x"}   # optional
      - name: wikipedia                # stdio: the runtime starts the command
        command: wikipedia-mcp
        args: ["--transport", "stdio"]
        env: {WIKI_LANG: en}           # optional, merged over a minimal environment
"""

from __future__ import annotations

import argparse
import socket
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from luftpause.keys import KEY_IDENTITIES_HELP, KeyIdentitiesError, Keys
from luftpause.logs import LOG_SETTINGS_HELP
from luftpause.options import env_option
from luftpause.peer_identity import STYLES
from luftpause.runtime import constants
from luftpause.runtime.stores import is_database_url
from luftpause.runtime.errors import RuntimeServiceError


class ToolsFileError(RuntimeServiceError, ValueError):
    """The tools file exists but does not describe servers the runtime can use."""


@dataclass(frozen=True)
class UpstreamServerConfig:
    """One upstream MCP tool server: either ``url`` (HTTP) or ``command`` (stdio)."""

    name: str
    url: str | None = None
    headers: Mapping[str, str] = field(default_factory=dict)
    command: str | None = None
    args: Sequence[str] = ()
    env: Mapping[str, str] = field(default_factory=dict)
    max_connections: int = constants.UPSTREAM_MAX_CONNECTIONS  # HTTP: tool calls in flight at once

    @property
    def transport(self) -> str:
        return "http" if self.url else "stdio"


@dataclass(frozen=True)
class RuntimeSettings:
    host: str = constants.DEFAULT_HOST
    port: int = constants.DEFAULT_PORT
    dataplane_url: str = constants.DEFAULT_DATAPLANE_URL
    tools_file: Path = Path(constants.DEFAULT_TOOLS_FILE)
    state_dir: Path = Path(constants.DEFAULT_STATE_DIR)
    token: str | None = None
    default_model: str | None = None
    max_runs_per_caller: int = constants.MAX_RUNS_PER_CALLER
    max_sessions: int = constants.MAX_SESSIONS
    max_sessions_per_key: int = 0  # with tenant keys, one tenant's share of max_sessions; 0: half (key_share)
    session_idle_s: float = constants.SESSION_IDLE_S
    peer_identity: str = "none"  # run identity for an agent-aware router in place of the dataplane
    session_evict_idle_s: float = constants.SESSION_EVICT_IDLE_S
    keys: Keys = field(default_factory=Keys)  # tenant keys (luftpause/keys.py); none: no tenants
    journal_url: str | None = None  # PostgreSQL holds the journals; None: files in state_dir
    runtime_id: str = ""  # this runtime among those sharing journal_url ("" = <host name>-<port>: member_id)
    lease_s: float = constants.LEASE_S  # a run's lease, renewed every third of it (fleet.py)
    mcp_sessions: str = "kept"  # "none": every MCP request stands alone (any runtime of a fleet answers it)


def member_id(settings: RuntimeSettings) -> str:
    """This runtime's name among those sharing a journal database."""
    return settings.runtime_id or f"{socket.gethostname()}-{settings.port}"


def parse_settings(argv: Sequence[str] | None = None, environ: Mapping[str, str] | None = None) -> RuntimeSettings:
    """Read settings from ``argv`` with defaults taken from ``environ`` (``os.environ``)."""
    env = os.environ if environ is None else environ
    parser = argparse.ArgumentParser(
        prog="python -m luftpause.runtime",
        description=(
            "luftpause runtime: an MCP server (Streamable HTTP at /mcp) that runs sub-agents "
            "through the dataplane. Secrets come from the environment only: LUFTPAUSE_TOKEN "
            "(bearer token required on /mcp and /status and sent to the dataplane; unset = "
            "open, with a warning) and LUFTPAUSE_DEFAULT_MODEL (model for spawn calls that "
            "name none; unset = the first model the dataplane lists). LUFTPAUSE_ALLOWED_HOSTS: "
            "comma-separated Host names clients may use (host or host:port, * = any; unset = "
            "localhost, 127.0.0.1, [::1]); other Host headers get 421, other Origins 403."
        ),
        epilog=KEY_IDENTITIES_HELP + " " + LOG_SETTINGS_HELP,
    )
    _add_options(parser, env)
    args = parser.parse_args(argv)
    if args.max_runs_per_caller < 1 or args.max_sessions < 1 or not 0 < args.session_idle < float("inf"):
        parser.error("--max-runs-per-caller and --max-sessions must be >= 1, --session-idle > 0")
    if not 0 <= args.session_evict_idle < float("inf"):
        parser.error("--session-evict-idle must be a finite number of seconds >= 0")
    if not 0 <= args.max_sessions_per_key <= args.max_sessions:
        parser.error(f"--max-sessions-per-key must be between 1 and --max-sessions ({args.max_sessions}), "
                     f"or 0 for half of it, not {args.max_sessions_per_key}")
    if not 0.5 <= args.lease < float("inf"):
        parser.error("--lease must be at least 0.5 seconds")
    if args.journal and not is_database_url(args.journal):
        parser.error(f"--journal must be a postgresql:// URL (or empty for files in --state-dir), not {args.journal!r}")
    try:
        keys = Keys.from_env(env, env.get("LUFTPAUSE_TOKEN") or None)
    except KeyIdentitiesError as exc:
        parser.error(str(exc))
    return RuntimeSettings(
        host=args.host,
        port=args.port,
        # Accept the OpenAI-style base (".../v1") too: paths are added by the client.
        dataplane_url=args.dataplane_url.rstrip("/").removesuffix("/v1"),
        tools_file=args.tools_file,
        state_dir=args.state_dir,
        token=env.get("LUFTPAUSE_TOKEN") or None,
        default_model=env.get("LUFTPAUSE_DEFAULT_MODEL") or None,
        max_runs_per_caller=args.max_runs_per_caller,
        max_sessions=args.max_sessions,
        max_sessions_per_key=args.max_sessions_per_key,
        session_idle_s=args.session_idle,
        peer_identity=args.peer_identity,
        session_evict_idle_s=args.session_evict_idle,
        keys=keys,
        journal_url=args.journal or None,
        runtime_id=args.runtime_id,
        lease_s=args.lease,
        mcp_sessions=args.mcp_sessions,
    )


def _add_options(parser: argparse.ArgumentParser, env: Mapping[str, str]) -> None:
    """The runtime's options, each defaulting to its variable in ``env``."""

    def option(flag: str, env_name: str, default: Any, text: str, **extra: Any) -> None:
        env_option(parser, flag, env_name, default, text, environ=env, **extra)

    option("--host", "LUFTPAUSE_RUNTIME_HOST", constants.DEFAULT_HOST, "address to listen on")
    option("--port", "LUFTPAUSE_RUNTIME_PORT", constants.DEFAULT_PORT, "port to listen on", kind=int)
    option("--dataplane-url", "LUFTPAUSE_DATAPLANE_URL", constants.DEFAULT_DATAPLANE_URL,
           "where sub-agent turns go, an OpenAI-compatible base without /v1")
    option("--tools-file", "LUFTPAUSE_TOOLS_FILE", constants.DEFAULT_TOOLS_FILE,
           "YAML list of upstream MCP tool servers; missing file = no tools", kind=Path)
    option("--state-dir", "LUFTPAUSE_STATE_DIR", constants.DEFAULT_STATE_DIR,
           "directory of the run journal runs.jsonl and tasks.jsonl", kind=Path)
    option("--journal", "LUFTPAUSE_JOURNAL", "",
           "where the run journal and the Tasks journal live: a postgresql:// URL (libpq's: the password may "
           "come from PGPASSWORD or ~/.pgpass; the schema is created and upgraded at start), or empty for "
           "runs.jsonl and tasks.jsonl in --state-dir")
    option("--runtime-id", "LUFTPAUSE_RUNTIME_ID", "",
           "this runtime's name among the runtimes sharing a --journal database (it owns runs under it; a "
           "runtime restarted under the same name takes its runs back at once); empty: <host name>-<port>")
    option("--lease", "LUFTPAUSE_LEASE_S", constants.LEASE_S,
           "seconds a runtime on a --journal database holds a run's lease without renewing it; a runtime "
           "that died or lost the database has its runs adopted by the others after this long", kind=float)
    option("--mcp-sessions", "LUFTPAUSE_MCP_SESSIONS", "kept",
           "kept: a handshake-era MCP client's session lives in this runtime, so behind several runtimes it must "
           "keep to one (sticky routing); none: no session is kept, every request stands alone and any runtime "
           "of a fleet answers it (a plain load balancer), but a handshake-era client cannot be asked to approve "
           "a tool call (elicitation: use the approve tool) and is told apart for fair sharing only by its "
           "tenant key or x-luftpause-caller header; clients of the sessionless protocol are served the same either way",
           choices=("kept", "none"))
    option("--max-runs-per-caller", "LUFTPAUSE_MAX_RUNS_PER_CALLER", constants.MAX_RUNS_PER_CALLER,
           "unfinished runs one caller may have; spawn beyond it is refused", kind=int)
    option("--max-sessions", "LUFTPAUSE_MAX_SESSIONS", constants.MAX_SESSIONS,
           "open MCP sessions; at the cap the longest-idle session is closed for a new one if it has been idle "
           "--session-evict-idle seconds, else the new one gets 503 with Retry-After", kind=int)
    option("--max-sessions-per-key", "LUFTPAUSE_MAX_SESSIONS_PER_KEY", 0,
           "with tenant keys: open MCP sessions one tenant (a key's caller) may hold, 0 = half of --max-sessions; "
           "at its share its own longest-idle session is closed for its new one if idle --session-evict-idle "
           "seconds, else the new one gets 429 with Retry-After (the operator's token is not limited)", kind=int)
    option("--session-evict-idle", "LUFTPAUSE_SESSION_EVICT_IDLE_S", constants.SESSION_EVICT_IDLE_S,
           "at the session cap, only a session idle this many seconds may be closed for a new one, so opening "
           "sessions cannot end one in use", kind=float)
    option("--session-idle", "LUFTPAUSE_SESSION_IDLE_S", constants.SESSION_IDLE_S,
           "seconds after which an idle MCP session is closed", kind=float)
    option("--peer-identity", "LUFTPAUSE_RUNTIME_PEER_IDENTITY", "none",
           "when --dataplane-url is an agent-aware router instead of luftpause's dataplane, also put each "
           "turn's run identity where that router reads it: session (session_params.session_id: vllm-router "
           "sticky_least_loaded, kv_aware) or program (vllm_xargs.agentic_context: vllm-router program "
           "scheduling)", choices=STYLES)


def load_tools_file(path: Path) -> list[UpstreamServerConfig] | None:
    """The servers listed in ``path``; ``None`` when the file does not exist."""
    if not path.exists():
        return None
    document = yaml.safe_load(path.read_text()) or {}
    if not isinstance(document, dict) or not isinstance(document.get("servers", []), list):
        raise ToolsFileError(f"{path}: expected a mapping with a 'servers' list")
    servers = [_server_from_entry(path, index, entry) for index, entry in enumerate(document.get("servers") or [])]
    names = [server.name for server in servers]
    duplicates = sorted({name for name in names if names.count(name) > 1})
    if duplicates:
        raise ToolsFileError(f"{path}: duplicate server names {duplicates}")
    return servers


def _server_from_entry(path: Path, index: int, entry: Any) -> UpstreamServerConfig:
    where = f"{path}: servers[{index}]"
    if not isinstance(entry, dict) or not isinstance(entry.get("name"), str) or not entry["name"]:
        raise ToolsFileError(f"{where}: each server needs a 'name'")
    has_url, has_command = bool(entry.get("url")), bool(entry.get("command"))
    if has_url == has_command:
        raise ToolsFileError(f"{where} ({entry['name']}): give exactly one of 'url' or 'command'")
    return UpstreamServerConfig(
        name=entry["name"],
        url=str(entry["url"]) if has_url else None,
        headers=_string_map(where, "headers", entry.get("headers")),
        command=str(entry["command"]) if has_command else None,
        args=[str(arg) for arg in _list(where, "args", entry.get("args"))],
        env=_string_map(where, "env", entry.get("env")),
        max_connections=_max_connections(where, entry.get("max_connections")),
    )


def _max_connections(where: str, value: Any) -> int:
    if value is None:
        return constants.UPSTREAM_MAX_CONNECTIONS
    limit = constants.UPSTREAM_MAX_CONNECTIONS_LIMIT
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= limit:
        raise ToolsFileError(f"{where}: 'max_connections' must be a whole number from 1 to {limit}, not {value!r}")
    return value


def _string_map(where: str, key: str, value: Any) -> dict[str, str]:
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise ToolsFileError(f"{where}: '{key}' must be a mapping")
    return {str(k): str(v) for k, v in value.items()}


def _list(where: str, key: str, value: Any) -> list[Any]:
    if value is None:
        return []
    if not isinstance(value, list):
        raise ToolsFileError(f"{where}: '{key}' must be a list")
    return value

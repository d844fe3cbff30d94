"""What translating a client API costs per turn, against a plain chat completion of the
same conversation, in one run: ``messages`` (the default) measures the Anthropic Messages
API, ``responses`` the OpenAI Responses API. Each starts one stack (an instant fake
engine, scheduler, one dataplane) on loopback and stops it at the end.

``messages``: the same Claude Code-sized turn (a ~12k-character system prompt, 20 tools,
six tool rounds of history: about 60 kB) is sent one request at a time as
``/v1/messages`` and as the chat completion it translates to, so the engine does the same
work for both; streaming and not, the four kinds interleaved in random order. Per kind:
the p50 of the whole request and of the time to the first body byte, and the Messages
API's added p50 over chat completions: the median of the differences of each round's
pair (a chat completion and its Messages twin, sent within milliseconds), which the
machine's slower drifts (other processes) cancel out of. Then the translation alone, in
this process: the request's translation and encoding, and the engine's recorded stream
(or reply) translated back, p50 per turn. Prints a table and writes
``bench-results/translation-<time>.json``.

``responses``: the same conversation is sent as ``POST /v1/responses`` and as the chat
completion it translates to, streaming and not, one request at a time, the two APIs
taking turns in blocks of ten requests so drift on a busy machine falls on both alike.
Two sizes: a short question, and a Codex-sized turn (about 20 kB of developer
instructions, 18 tools, a namespace and ``web_search``, like what Codex 0.171.0 sends).
Reported per API: p50 and p90 latency, p50 time to the first body byte, and the
dataplane's CPU per turn (from /proc, read around each block); and what the Responses
API adds to each: the median of the differences of each pair (the same request sent as
a chat completion and as a Responses request, within one block of each other), which
drift on the machine cancels out of. Then the translation alone, in process:
``to_chat``, the chat body's JSON and the events of a 12-token streamed reply, its p50
over 2000 repetitions (about a minute on 2 cores).

    python -m luftpause.loadgen.translation_bench [messages] [--requests N] [--reply-tokens N]
    python -m luftpause.loadgen.translation_bench responses [--requests N] [--repetitions N] [--json PATH]

``make bench-messages`` and ``make bench-responses``. Benchmarks, not tests.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp
from rich.console import Console

from luftpause.dataplane import messages as messages_api
from luftpause.dataplane import responses_api
from luftpause.dev.procs import tree_cpu_seconds
from luftpause.dev.stack import MODEL, Stack
from luftpause.loadgen.records import new_table, percentile, write_json, write_results

console = Console(width=140)
TARGET_ADDED_P50_MS = 1.0
NO_RUNTIME = frozenset({"runtime", "fake-mcp"})


# --------------------------------------------------------------------- messages
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


async def measure_messages(base: str, requests: int) -> tuple[dict[str, dict[str, list[float]]], dict[str, bytes]]:
    document = claude_code_turn()
    kinds: dict[str, tuple[str, bytes]] = {}
    for stream in (False, True):
        messages = {**document, "stream": stream}
        chat = messages_api.to_chat(messages)
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
            json.dumps(messages_api.to_chat(request), separators=(",", ":")).encode()
            if stream:
                translator = messages_api.MessageStream(MODEL)
                for line in engine_reply.split(b"\n\n"):  # the engine's events, one chunk each
                    translator.feed(line + b"\n\n")
            else:
                messages_api.reply(engine_reply, MODEL)
            times.append(time.perf_counter() - started)
        out[label] = percentile(times, 50) * 1000
    return out


def messages_main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m luftpause.loadgen.translation_bench [messages]",
                                     description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=300, help="requests of each kind (default 300)")
    parser.add_argument("--reply-tokens", type=int, default=64, help="tokens in each reply (default 64)")
    parser.add_argument("--out", default="bench-results", help="directory for the JSON (default bench-results)")
    args = parser.parse_args(argv)

    with tempfile.TemporaryDirectory() as directory:
        stack = Stack.on_free_ports(Path(directory), engines=1, without=NO_RUNTIME,
                                    engine_args=["--latency-ms", "0", "--token-ms", "0", "--reply-tokens",
                                                 str(args.reply_tokens), "--reply-spread", "0"])
        stack.start()
        try:
            samples, engine_replies = asyncio.run(measure_messages(f"http://127.0.0.1:{stack.ports.dataplane}",
                                                                   args.requests))
        finally:
            stack.stop()
    alone = translation_alone(engine_replies, 500)

    table = new_table(f"Messages API vs chat completions, one request at a time ({args.requests} each)",
                      ("kind", "p50 total ms", "p50 first byte ms", "added p50 total ms (paired)",
                       "added p50 first byte ms (paired)", "translation alone p50 ms"), left=("kind",))
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


# --------------------------------------------------------------------- responses
RESPONSES_ENGINE = ["--latency-ms", "0", "--token-ms", "0", "--reply-tokens", "12"]
WARM_UP = 30
BLOCK = 10  # requests in a row to one API between readings of the dataplane's CPU
WORDS = "the agent reads the repository and runs commands in a sandbox before it answers".split()


def text(chars: int, seed: int) -> str:
    words = [WORDS[(seed + i * 7) % len(WORDS)] for i in range(chars // 5)]
    return " ".join(words)[:chars]


def function(name: str, seed: int) -> dict:
    properties = {f"arg_{k}": {"type": "string", "description": text(120, seed + k)} for k in range(6)}
    return {"type": "function", "name": name, "description": text(400, seed), "strict": False,
            "parameters": {"type": "object", "properties": properties, "required": ["arg_0"],
                           "additionalProperties": False}}


def codex_sized(i: int) -> dict:
    """A turn shaped like Codex's: developer text, environment, tools, a namespace."""
    tools = [function(f"tool_{k}", k) for k in range(13)]
    tools.append({"type": "namespace", "name": "agents", "description": "sub-agents",
                  "tools": [function(f"agent_{k}", 50 + k) for k in range(5)]})
    tools.append({"type": "web_search", "external_web_access": False})
    return {"model": MODEL, "store": False, "tool_choice": "none", "parallel_tool_calls": True,
            "reasoning": {"summary": "auto"}, "include": ["reasoning.encrypted_content"],
            "prompt_cache_key": "bench", "tools": tools, "input": [
                {"type": "message", "role": "developer", "content": [{"type": "input_text", "text": text(16000, 1)}]},
                {"type": "message", "role": "developer", "content": [{"type": "input_text", "text": text(3000, 2)}]},
                {"type": "message", "role": "user", "content": [{"type": "input_text", "text": text(600, 3)}]},
                {"type": "message", "role": "user", "content": [{"type": "input_text", "text": f"question {i}"}]}]}


def short(i: int) -> dict:
    return {"model": MODEL, "input": f"question {i}", "max_output_tokens": 16}


SIZES = {"short question": short, "Codex-sized turn": codex_sized}


async def timed_ms(session: aiohttp.ClientSession, url: str, payload: dict, headers: dict) -> tuple[float, float]:
    """(latency, time to the first body byte) in ms."""
    started = time.perf_counter()
    async with session.post(url, json=payload, headers=headers) as response:
        first = None
        async for _ in response.content.iter_any():
            if first is None:
                first = time.perf_counter()
        assert response.status == 200, response.status
    end = time.perf_counter()
    return (end - started) * 1000, ((first or end) - started) * 1000


async def measure_responses(base: str, requests: int, dataplane_pid: int) -> dict:
    """Blocks of BLOCK requests, the two APIs taking turns block by block: each
    request's latency, and the dataplane's CPU over each block, per API."""
    results: dict = {}
    async with aiohttp.ClientSession() as session:
        for size, make in SIZES.items():
            for stream in (True, False):
                samples: dict[str, list[tuple[float, float]]] = {"chat": [], "responses": []}
                cpu = {"chat": 0.0, "responses": 0.0}
                for block in range((WARM_UP + requests) // BLOCK):
                    apis = ("responses", "chat") if block % 2 else ("chat", "responses")
                    for api in apis:
                        before = tree_cpu_seconds(dataplane_pid)
                        for i in range(block * BLOCK, (block + 1) * BLOCK):
                            document = {**make(i), "stream": stream}
                            payload, path = (document, "/v1/responses") if api == "responses" else (
                                responses_api.to_chat(document).body, "/v1/chat/completions")
                            sample = await timed_ms(session, base + path, payload, {})
                            if i >= WARM_UP:
                                samples[api].append(sample)  # the two APIs send request i alike: a pair
                        if block * BLOCK >= WARM_UP:
                            cpu[api] += tree_cpu_seconds(dataplane_pid) - before
                row = summary(samples)
                for api in cpu:
                    row[api]["dataplane_cpu_ms_per_turn"] = cpu[api] * 1000 / max(1, len(samples[api]))
                row["added_cpu_ms_per_turn"] = (row["responses"]["dataplane_cpu_ms_per_turn"]
                                                - row["chat"]["dataplane_cpu_ms_per_turn"])
                results[f"{size}, {'streaming' if stream else 'not streaming'}"] = row
    return results


def summary(samples: dict[str, list[tuple[float, float]]]) -> dict:
    out = {}
    for api, values in samples.items():
        latency = [v[0] for v in values]
        first = [v[1] for v in values]
        out[api] = {"p50_ms": percentile(latency, 50), "p90_ms": percentile(latency, 90),
                    "first_byte_p50_ms": percentile(first, 50), "n": len(values)}
    # The median of the pairs' differences (request i as a chat completion and as a
    # Responses request, sent within one block of each other): a slower spell of the
    # machine falls on both sides of a pair, where it would shift one p50 and not the other.
    pairs = list(zip(samples["chat"], samples["responses"]))
    out["added_p50_ms"] = statistics.median(r[0] - c[0] for c, r in pairs)
    out["added_first_byte_p50_ms"] = statistics.median(r[1] - c[1] for c, r in pairs)
    out["added_p50_unpaired_ms"] = out["responses"]["p50_ms"] - out["chat"]["p50_ms"]
    return out


def chat_stream(words: int) -> bytes:
    chunks = [{"id": "c", "object": "chat.completion.chunk", "model": MODEL,
               "choices": [{"index": 0, "delta": {"content": f" word{k}"}, "finish_reason": None}]}
              for k in range(words)]
    chunks.append({"id": "c", "object": "chat.completion.chunk", "model": MODEL,
                   "choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]})
    chunks.append({"id": "c", "object": "chat.completion.chunk", "model": MODEL, "choices": [],
                   "usage": {"prompt_tokens": 10, "completion_tokens": words, "total_tokens": 10 + words}})
    return b"".join(b"data: " + json.dumps(c).encode() + b"\n\n" for c in chunks) + b"data: [DONE]\n\n"


def in_process(repetitions: int) -> dict:
    """The translation's own CPU per turn: request in, a 12-token streamed reply out."""
    stream = chat_stream(12)
    out = {}
    for size, make in SIZES.items():
        document = json.loads(json.dumps({**make(0), "stream": True}))
        times = []
        for _ in range(repetitions):
            started = time.perf_counter()
            chat = responses_api.to_chat(document)
            json.dumps(chat.body, separators=(",", ":")).encode()  # as the dataplane encodes it
            events = responses_api.EventTranslator(chat.shell)
            events.start()
            for piece in stream.split(b"\n\n"):
                events.feed(piece + b"\n\n")
            times.append((time.perf_counter() - started) * 1000)
        out[size] = {"p50_ms": statistics.median(times), "p90_ms": percentile(times, 90), "n": repetitions}
    return out


def report(console: Console, results: dict) -> None:
    table = new_table("Responses API through luftpause vs the same turn as a chat completion (one at a time, ms)",
                      ("turn", "chat p50", "responses p50", "added p50 (paired)", "chat 1st byte", "responses 1st byte",
                       "added 1st byte (paired)", "dataplane CPU/turn chat", "responses", "added", "n"), left=("turn",))
    for name, row in results["through_the_proxy"].items():
        table.add_row(name, f"{row['chat']['p50_ms']:.2f}", f"{row['responses']['p50_ms']:.2f}",
                      f"{row['added_p50_ms']:+.2f}", f"{row['chat']['first_byte_p50_ms']:.2f}",
                      f"{row['responses']['first_byte_p50_ms']:.2f}", f"{row['added_first_byte_p50_ms']:+.2f}",
                      f"{row['chat']['dataplane_cpu_ms_per_turn']:.2f}",
                      f"{row['responses']['dataplane_cpu_ms_per_turn']:.2f}", f"{row['added_cpu_ms_per_turn']:+.2f}",
                      str(row["chat"]["n"]))
    console.print(table)
    alone = new_table("The translation alone, in process (request + a 12-token streamed reply)",
                      ("turn", "p50 ms", "p90 ms", "n"))
    for name, row in results["translation_alone"].items():
        alone.add_row(name, f"{row['p50_ms']:.3f}", f"{row['p90_ms']:.3f}", str(row["n"]))
    console.print(alone)


def responses_main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m luftpause.loadgen.translation_bench responses",
                                     description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--requests", type=int, default=200, help="measured requests per API, size and mode")
    parser.add_argument("--repetitions", type=int, default=2000, help="repetitions of the in-process translation")
    parser.add_argument("--json", default="state/bench/responses.json", help="where the results go")
    args = parser.parse_args(argv)
    console = Console()
    with tempfile.TemporaryDirectory() as tmp:
        stack = Stack.on_free_ports(Path(tmp), engines=1, without=NO_RUNTIME, engine_args=RESPONSES_ENGINE)
        stack.start()
        try:
            pid = stack.process("dataplane").process.pid
            through = asyncio.run(measure_responses(f"http://127.0.0.1:{stack.ports.dataplane}", args.requests, pid))
        finally:
            stack.stop()
    results = {"through_the_proxy": through, "translation_alone": in_process(args.repetitions)}
    report(console, results)
    console.print(f"written to {write_json(args.json, results)}")
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    mode = argv.pop(0) if argv and argv[0] in ("messages", "responses") else "messages"
    return responses_main(argv) if mode == "responses" else messages_main(argv)


if __name__ == "__main__":
    raise SystemExit(main())

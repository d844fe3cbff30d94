"""What the Responses API's translation adds per turn, against a plain chat completion
of the same conversation, in one run.

One fake engine with instant replies behind a luftpause stack (scheduler and one
dataplane). The same conversation is sent as ``POST /v1/responses`` and as the chat
completion it translates to (so the engine does the same work), streaming and not, one
request at a time, the two APIs taking turns in blocks of ten requests so drift on a
busy machine falls on both alike. Two sizes: a short question, and a Codex-sized turn
(about 20 kB of developer instructions, 18 tools, a namespace and ``web_search``, like
what Codex 0.171.0 sends). Reported per API: p50 and p90 latency, p50 time to the first
body byte, and the dataplane's CPU per turn (from /proc, read around each block); and
what the Responses API adds to each: the median of the differences of each pair (the
same request sent as a chat completion and as a Responses request, within one block of
each other), which drift on the machine cancels out of. Then the translation alone, in process:
``to_chat``, the chat body's JSON and the events of a 12-token streamed reply, its p50
over 2000 repetitions.

    python -m luftpause.loadgen.responses_bench [--requests N] [--repetitions N] [--json PATH]

Everything runs on loopback and stops at the end (about a minute on 2 cores).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import tempfile
import time
from pathlib import Path

import aiohttp
from rich.console import Console
from rich.table import Table

from luftpause.dataplane.responses_api import EventTranslator, to_chat
from luftpause.loadgen.proxy_bench import tree_cpu_seconds
from luftpause.loadgen.records import percentile, write_json
from luftpause.dev.stack import MODEL, Stack

INSTANT = ["--latency-ms", "0", "--token-ms", "0", "--reply-tokens", "12"]
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


async def timed(session: aiohttp.ClientSession, url: str, payload: dict, headers: dict) -> tuple[float, float]:
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


async def measure(base: str, requests: int, dataplane_pid: int) -> dict:
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
                                to_chat(document).body, "/v1/chat/completions")
                            sample = await timed(session, base + path, payload, {})
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
            chat = to_chat(document)
            json.dumps(chat.body, separators=(",", ":")).encode()  # as the dataplane encodes it
            events = EventTranslator(chat.shell)
            events.start()
            for piece in stream.split(b"\n\n"):
                events.feed(piece + b"\n\n")
            times.append((time.perf_counter() - started) * 1000)
        out[size] = {"p50_ms": statistics.median(times), "p90_ms": percentile(times, 90), "n": repetitions}
    return out


def report(console: Console, results: dict) -> None:
    table = Table(title="Responses API through luftpause vs the same turn as a chat completion (one at a time, ms)")
    for column in ("turn", "chat p50", "responses p50", "added p50 (paired)", "chat 1st byte",
                   "responses 1st byte", "added 1st byte (paired)", "dataplane CPU/turn chat", "responses", "added", "n"):
        table.add_column(column, justify="right" if column != "turn" else "left")
    for name, row in results["through_the_proxy"].items():
        table.add_row(name, f"{row['chat']['p50_ms']:.2f}", f"{row['responses']['p50_ms']:.2f}",
                      f"{row['added_p50_ms']:+.2f}", f"{row['chat']['first_byte_p50_ms']:.2f}",
                      f"{row['responses']['first_byte_p50_ms']:.2f}", f"{row['added_first_byte_p50_ms']:+.2f}",
                      f"{row['chat']['dataplane_cpu_ms_per_turn']:.2f}",
                      f"{row['responses']['dataplane_cpu_ms_per_turn']:.2f}", f"{row['added_cpu_ms_per_turn']:+.2f}",
                      str(row["chat"]["n"]))
    console.print(table)
    alone = Table(title="The translation alone, in process (request + a 12-token streamed reply)")
    for column in ("turn", "p50 ms", "p90 ms", "n"):
        alone.add_column(column)
    for name, row in results["translation_alone"].items():
        alone.add_row(name, f"{row['p50_ms']:.3f}", f"{row['p90_ms']:.3f}", str(row["n"]))
    console.print(alone)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--requests", type=int, default=200, help="measured requests per API, size and mode")
    parser.add_argument("--repetitions", type=int, default=2000, help="repetitions of the in-process translation")
    parser.add_argument("--json", default="state/bench/responses.json", help="where the results go")
    args = parser.parse_args(argv)
    console = Console()
    with tempfile.TemporaryDirectory() as tmp:
        stack = Stack.on_free_ports(Path(tmp), engines=1, without=frozenset({"runtime", "fake-mcp"}),
                                    engine_args=INSTANT)
        stack.start()
        try:
            pid = stack.process("dataplane").process.pid
            through = asyncio.run(measure(f"http://127.0.0.1:{stack.ports.dataplane}", args.requests, pid))
        finally:
            stack.stop()
    results = {"through_the_proxy": through, "translation_alone": in_process(args.repetitions)}
    report(console, results)
    console.print(f"written to {write_json(args.json, results)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""The dataplane keeps no request body past its request: large requests that
fail leave its RSS where it was. A memory bound, not a timing: the RSS is read until it is
back within the bound (``eventually``). The figures at 31 MiB x 16 x 3 rounds are
``make bench-body-memory``'s (loadgen/body_memory_bench.py)."""

from __future__ import annotations

import asyncio
import json
import threading

import aiohttp
import pytest

from luftpause.dataplane.heap import TRIMMER, HeapTrimmer
from luftpause.dev.procs import WAIT_S, eventually, rss_bytes
from luftpause.dev.stack import MODEL

MB = 1_000_000
NO_RUNTIME = frozenset({"runtime", "fake-mcp"})
# The size (the fake engine takes 1 MiB at most: it answers these 413). At this size
# glibc no longer maps each body apart (its threshold follows the largest blocks freed) and
# keeps what the requests freed in its heap: without the heap trim (dataplane/heap.py) 8 of
# them left the dataplane about 190 MB larger, whatever the API.
BODY_MIB = 31
CONCURRENT = 8
# Within this of the baseline once the requests are over. Before the fix a Messages request
# also kept its body three times over (about 95 MB each) until the garbage collector ran.
BOUND_MB = 64


def big_request(path: str, model: str, mib: float = BODY_MIB) -> bytes:
    text = ("a harness pasted a whole log into its prompt " * (int(mib * 2**20) // 45 + 1))[: int(mib * 2**20)]
    if path == "/v1/responses":
        document = {"model": model, "max_output_tokens": 16, "input": [
            {"type": "message", "role": "user", "content": [{"type": "input_text", "text": text}]}]}
    else:
        document = {"model": model, "max_tokens": 16, "messages": [
            {"role": "user", "content": [{"type": "text", "text": text}]}]}
    return json.dumps(document).encode()


async def post(session: aiohttp.ClientSession, url: str, body: bytes) -> int:
    async with session.post(url, data=body, headers={"Content-Type": "application/json"}) as response:
        await response.read()
        return response.status


@pytest.mark.skipif(not TRIMMER.available, reason="the C heap is trimmed on glibc only (dataplane/heap.py)")
async def test_large_requests_that_fail_leave_the_dataplanes_memory_where_it_was(make_stack):
    stack = make_stack(without=NO_RUNTIME, engines=1)
    base = f"http://127.0.0.1:{stack.ports.dataplane}"
    pid = stack.process("dataplane").process.pid
    rounds = [("/v1/messages", MODEL, 413), ("/v1/messages", "no-such-model", 404),
              ("/v1/responses", MODEL, 413), ("/v1/chat/completions", MODEL, 413)]
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as session:
        # Every path once on a small request first (the Messages API's SDK is imported on the
        # first; the engine's 413 asked for here): the baseline is a dataplane warmed up for them.
        for path, model, _ in rounds:
            await post(session, base + path, big_request(path, model, 0.001))
            directive = big_request(path, model, 0.001).replace(b"a harness", b"[[fake:status=413]] a harness", 1)
            await post(session, base + path, directive)
        baseline = rss_bytes(pid)
        for path, model, expected in rounds:
            body = big_request(path, model)
            statuses = await asyncio.gather(*(post(session, base + path, body) for _ in range(CONCURRENT)))
            assert statuses == [expected] * CONCURRENT, (path, statuses)
            del body
            await eventually(lambda: rss_bytes(pid) <= baseline + BOUND_MB * MB,
                             what=f"the dataplane's RSS back within {BOUND_MB} MB of its {baseline / MB:.0f} MB "
                                  f"after {CONCURRENT} {path} {expected}s of {BODY_MIB} MiB")


async def test_requests_ending_together_share_one_heap_trim_and_one_ending_during_it_gets_another():
    started, release = [], threading.Event()

    def trim(pad: int) -> int:
        started.append(pad)
        release.wait(WAIT_S)  # under way until the test lets it end
        return 1

    trimmer = HeapTrimmer(trim, delay=0.0)
    for _ in range(5):
        trimmer.request_ended()
    await eventually(lambda: started, what="the burst's trim under way")
    trimmer.request_ended()
    trimmer.request_ended()
    assert len(started) == 1
    release.set()
    await eventually(lambda: trimmer.trims == 2, what="one more trim after the one under way")
    assert started == [0, 0]


async def test_a_body_over_the_limit_is_413_also_when_it_comes_without_a_length(make_stack):
    stack = make_stack(without=NO_RUNTIME, engines=1, env={"LUFTPAUSE_MAX_BODY_BYTES": "2048"})

    async def chunked():  # no Content-Length: the dataplane counts as it reads
        for _ in range(4):
            yield b" " * 1024

    async with aiohttp.ClientSession() as session:
        for path in ("/v1/chat/completions", "/v1/messages"):
            async with session.post(f"http://127.0.0.1:{stack.ports.dataplane}{path}", data=chunked(),
                                    headers={"Content-Type": "application/json"}) as response:
                assert response.status == 413, path
                assert "2048" in json.dumps(await response.json()), path

"""What real engines do to the proxy that the fake engine does not by default, taught to
it here: closing idle keep-alive connections (llama-server and uvicorn after 5 s) and
ending a stream a little after ``[DONE]`` (the openai client has already closed by then)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator

import httpx
import openai
import pytest

from luftpause import vocabulary as h
from luftpause.dataplane.constants import ENGINE_KEEPALIVE_S
from luftpause.dev.procs import WAIT_S, wait_until
from luftpause.dev.stack import MODEL, Stack

IDLE_CLOSE_S = 0.3
# The client's pause between its turns (an agent thinking): longer than the engine keeps an
# idle connection, far shorter than the dataplane does (ENGINE_KEEPALIVE_S). The fake's own
# behaviour, not a wait for something to happen: a loaded machine only lengthens it.
THINK_S = 2 * IDLE_CLOSE_S
assert THINK_S < ENGINE_KEEPALIVE_S / 2
TOOLS = [{"type": "function", "function": {
    "name": "lookup", "description": "Look something up.",
    "parameters": {"type": "object", "properties": {"query": {"type": "string"}}, "required": ["query"]}}}]


@pytest.fixture(scope="module")
def stack(tmp_path_factory) -> Iterator[Stack]:
    """Fake engines that drop a request arriving on a connection idle > 0.3 s, as a real
    engine's server does when its keep-alive timer closes the connection as it is reused."""
    stack = Stack.on_free_ports(tmp_path_factory.mktemp("engine-connections"),
                                without=frozenset({"runtime", "fake-mcp"}),
                                engine_args=["--idle-close-s", str(IDLE_CLOSE_S)])
    stack.start()
    try:
        yield stack
    finally:
        stack.stop()


def stale_dropped(stack: Stack) -> int:
    return sum(httpx.get(f"http://127.0.0.1:{port}/stats").json()["stale_dropped"] for port in stack.ports.engines)


def dataplane_log(stack: Stack) -> str:
    return (stack.state_dir / "logs" / "dataplane.log").read_text()


def turn_lines(stack: Stack, run_id: str) -> list[str]:
    """The dataplane's access log lines of the run's turns."""
    return [line for line in dataplane_log(stack).splitlines()
            if " turn " in line and f" run={run_id} " in line]


@pytest.mark.parametrize("stream", [False, True])
async def test_a_pooled_connection_the_engine_closed_is_not_a_502(stack: Stack, stream: bool):
    url = f"http://127.0.0.1:{stack.ports.dataplane}/v1/chat/completions"
    dropped_before = stale_dropped(stack)
    async with httpx.AsyncClient(timeout=30) as client:
        for i in range(3):
            body = {"model": MODEL, "messages": [{"role": "user", "content": f"turn {i}"}], "stream": stream}
            response = await client.post(url, json=body, headers={h.RUN_ID: f"stale-{stream}"})
            assert response.status_code == 200, response.text
            assert ("[DONE]" in response.text) if stream else response.json()["choices"]
            await asyncio.sleep(THINK_S)  # meanwhile the engine closes the dataplane's pooled connection
    # The race did happen (the engine dropped requests on stale connections) and was absorbed.
    assert stale_dropped(stack) > dropped_before
    assert "engine_connection_stale" in dataplane_log(stack)


def test_a_stream_the_client_closes_right_after_done_is_a_finished_turn(stack: Stack):
    """The openai client closes as soon as it reads [DONE]; the engine ends its response
    half a second later. The turn is complete: its tool-call ids identify the run next time."""
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{stack.ports.dataplane}/v1", api_key="unused", max_retries=0)
    messages = [{"role": "user", "content": "[[fake:linger-after-done=500]] find the weather"}]
    raw = client.chat.completions.with_raw_response.create(
        model=MODEL, messages=messages, tools=TOOLS, stream=True, stream_options={"include_usage": True})
    run_id = raw.headers[h.RUN_ID]
    chunks = list(raw.parse())  # reads up to [DONE], then closes the connection
    calls = [call for chunk in chunks if chunk.choices for call in chunk.choices[0].delta.tool_calls or []]
    assert calls and calls[0].id
    assert [chunk.usage for chunk in chunks if chunk.usage]

    messages += [{"role": "assistant", "content": None, "tool_calls": [
                     {"id": calls[0].id, "type": "function",
                      "function": {"name": "lookup", "arguments": json.dumps({"query": "weather"})}}]},
                 {"role": "tool", "tool_call_id": calls[0].id, "content": "sunny"}]
    again = client.chat.completions.with_raw_response.create(model=MODEL, messages=messages)
    assert again.headers[h.RUN_ID] == run_id
    assert wait_until(lambda: "chat.done" in "".join(
        (stack.state_dir / "logs" / f"{name}.log").read_text() for name in ("engine-a", "engine-b")), WAIT_S)
    # Both turns of the run ended as finished ones (the dataplane's access log line of each).
    assert wait_until(lambda: len(turn_lines(stack, run_id)) == 2, WAIT_S)
    assert all("status=finished" in line for line in turn_lines(stack, run_id)), turn_lines(stack, run_id)

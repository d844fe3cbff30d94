"""A runtime whose turns go straight to an agent-aware peer router (``--peer-identity``)
puts each run's identity where that router reads it, and ends a finished run's session."""

from __future__ import annotations

import json

import httpx
import pytest

from luftpause.runtime.config import parse_settings
from luftpause.runtime.dataplane import DataplaneClient, TurnIdentity
from tests.runtime.runtime_doubles import MODEL, text_reply

TOOLS = [{"type": "function", "function": {"name": "lookup", "parameters": {"type": "object"}}}]


class Router:
    """Records what reaches the router; answers turns with text."""

    def __init__(self) -> None:
        self.requests: list[httpx.Request] = []

    async def handle(self, request: httpx.Request) -> httpx.Response:
        self.requests.append(request)
        if request.url.path == "/finish_session":
            return httpx.Response(200, json={"status": "ok", "session_id": request.url.params["session_id"]})
        return text_reply("done")

    def client(self, style: str) -> DataplaneClient:
        return DataplaneClient("http://router.test", default_model=MODEL, transport=httpx.MockTransport(self.handle),
                               peer_identity=style)


async def test_program_identity_rides_in_the_body_and_says_whether_the_run_resumes() -> None:
    router = Router()
    client = router.client("program")
    identity = TurnIdentity("run-7", "interactive", "alice")
    await client.chat({"model": MODEL, "messages": [], "tools": TOOLS}, identity)
    await client.chat({"model": MODEL, "messages": [], "tools": TOOLS, "tool_choice": "none"}, identity)
    await client.end_run("run-7")
    await client.aclose()
    first, answer = (json.loads(r.content)["vllm_xargs"]["agentic_context"] for r in router.requests[:2])
    assert first["program_id"] == first["session_id"] == "run-7" and first["expected_resume"] is True
    assert first["priority"] > 0  # interactive
    assert answer["expected_resume"] is False  # the answer turn ends the program
    assert router.requests[0].headers["x-luftpause-run-id"] == "run-7"
    assert "x-session-id" not in router.requests[0].headers
    assert router.requests[2].method == "DELETE"  # no session to end: the usual run-end notice


async def test_session_identity_is_the_session_header_and_the_run_end_finishes_the_session() -> None:
    router = Router()
    client = router.client("session")
    await client.chat({"model": MODEL, "messages": []}, TurnIdentity("run/8", "batch", "bob"))
    await client.end_run("run/8")
    await client.aclose()
    turn, finish = router.requests
    assert turn.headers["x-session-id"] == "run/8"
    assert json.loads(turn.content)["session_params"] == {"session_id": "run/8"}
    assert finish.method == "POST" and finish.url.path == "/finish_session"
    assert finish.url.params["session_id"] == "run/8"


async def test_without_a_peer_identity_turns_carry_none() -> None:
    router = Router()
    client = router.client("none")
    await client.chat({"model": MODEL, "messages": [], "tools": TOOLS}, TurnIdentity("run-9", "batch", "c"))
    await client.aclose()
    body = json.loads(router.requests[0].content)
    assert "vllm_xargs" not in body and "session_params" not in body


def test_the_option_and_its_environment_variable() -> None:
    assert parse_settings([], environ={}).peer_identity == "none"
    assert parse_settings([], environ={"LUFTPAUSE_RUNTIME_PEER_IDENTITY": "program"}).peer_identity == "program"
    assert parse_settings(["--peer-identity", "session"], environ={}).peer_identity == "session"
    with pytest.raises(SystemExit):
        parse_settings(["--peer-identity", "everything"], environ={})

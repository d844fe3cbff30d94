"""With tenant keys, one key's caller holds at most its share of the MCP session cap
(``--max-sessions-per-key``, half the cap by default): a key that fills its share gets a
JSON-RPC 429 with Retry-After for its next session, another tenant still gets sessions,
the operator's token is not limited by it, and a key's own session idle for the floor
makes room for its new one. A real runtime process over HTTP; settings in process."""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest
from raw_mcp import INITIALIZE, RawSession
from runtime_doubles import RuntimeProcess

from luftpause.dev.procs import WAIT_S
from luftpause.runtime.config import parse_settings
from luftpause.runtime.sessions import key_share

TOKEN = "operator-s3cret"
KEYS = {"sk-alice": {"caller": "alice"}, "sk-bob": {"caller": "bob"}}
ALICE = {"Authorization": "Bearer sk-alice"}
BOB = {"x-api-key": "sk-bob"}  # as Anthropic clients present a key
OPERATOR = {"Authorization": f"Bearer {TOKEN}"}
CAP = 6  # the default share: 3


def tenants_runtime(start_runtime: Callable[..., RuntimeProcess], state: Path, **env: str) -> RuntimeProcess:
    """No dataplane behind it (no run starts here), no tools."""
    return start_runtime("http://127.0.0.1:9", state / "no-tools.yaml", state,
                         env={"LUFTPAUSE_TOKEN": TOKEN, "LUFTPAUSE_KEY_IDENTITIES": json.dumps(KEYS), **env})


@pytest.fixture
def http() -> Iterator[httpx.Client]:
    with httpx.Client(timeout=WAIT_S) as client:
        yield client


def opens(http: httpx.Client, runtime: RuntimeProcess, headers: dict[str, str]) -> RawSession:
    return RawSession(http, runtime.mcp_url, headers).open()


def works(session: RawSession) -> int:
    response, reply = session.call("tools", {})
    assert response.status_code != 200 or (reply is not None and "result" in reply), response.text
    return response.status_code


def share_refusal(response: httpx.Response) -> tuple[str, int]:
    """The 429's message and Retry-After, checked to be a JSON-RPC error as the cap's 503 is."""
    assert response.status_code == 429, response.text
    assert response.headers["content-type"].startswith("application/json")
    body = response.json()
    assert body["jsonrpc"] == "2.0" and body["error"]["code"] == -32603, body
    assert "mcp-session-id" not in response.headers
    return body["error"]["message"], int(response.headers["Retry-After"])


def test_a_key_holds_its_share_of_the_sessions_and_another_key_still_gets_its_own(
    start_runtime: Callable[..., RuntimeProcess], tmp_path: Path, http: httpx.Client
) -> None:
    # One key used to be able to open every session of the cap (a flood, or abandoned
    # sessions) and lock the other tenants out until its sessions went idle.
    runtime = tenants_runtime(start_runtime, tmp_path / "state",
                              LUFTPAUSE_MAX_SESSIONS=str(CAP), LUFTPAUSE_SESSION_EVICT_IDLE_S="600")
    # The operator's token is not limited by a share: more than half the cap, then closed.
    operator = [opens(http, runtime, OPERATOR) for _ in range(CAP // 2 + 1)]
    assert {works(session) for session in operator} == {200}
    for session in operator:
        session.close()

    alice = [opens(http, runtime, ALICE) for _ in range(CAP // 2)]  # its share: half the cap
    message, wait = share_refusal(RawSession(http, runtime.mcp_url, ALICE).post_json(INITIALIZE))
    assert message.startswith("too many open sessions for caller 'alice'"), message
    assert "share is 3 of the 6 (--max-sessions-per-key)" in message and "none idle for 600 s" in message, message
    assert 1 <= wait <= 600

    bob = [opens(http, runtime, BOB) for _ in range(CAP // 2)]  # the rest of the cap is there for bob
    assert {works(session) for session in alice + bob} == {200}  # no session was closed for anyone
    message, _ = share_refusal(RawSession(http, runtime.mcp_url, BOB).post_json(INITIALIZE))
    assert "caller 'bob'" in message

    alice[0].close()  # a session that ends gives its place in the share back
    alice.append(opens(http, runtime, ALICE))
    assert works(alice[-1]) == 200
    share_refusal(RawSession(http, runtime.mcp_url, ALICE).post_json(INITIALIZE))


def test_at_its_share_a_keys_own_longest_idle_session_makes_room_for_its_new_one(
    start_runtime: Callable[..., RuntimeProcess], tmp_path: Path, http: httpx.Client
) -> None:
    # As at the cap: a session idle for the floor is closed for a newcomer, but only one
    # of the same key's (the floor: far longer than opening the sessions takes).
    runtime = tenants_runtime(start_runtime, tmp_path / "state", LUFTPAUSE_MAX_SESSIONS="10",
                              LUFTPAUSE_MAX_SESSIONS_PER_KEY="2", LUFTPAUSE_SESSION_EVICT_IDLE_S="3")
    bob = opens(http, runtime, BOB)  # idle longest of all, but not alice's to close
    alice = [opens(http, runtime, ALICE) for _ in range(2)]
    message, wait = share_refusal(RawSession(http, runtime.mcp_url, ALICE).post_json(INITIALIZE))
    assert "share is 2 of the 10" in message and 1 <= wait <= 3, (message, wait)
    time.sleep(wait + 0.2)  # comes back when told
    newcomer = opens(http, runtime, ALICE)
    assert works(newcomer) == 200
    assert works(alice[0]) == 404  # its own longest-idle session made room (MCP clients reopen on 404)
    assert works(alice[1]) == 200
    assert works(bob) == 200  # another key's idle session is not alice's to close


def test_the_share_is_half_the_cap_unless_set_and_never_above_it() -> None:
    env = {"LUFTPAUSE_MAX_SESSIONS": "10"}
    settings = parse_settings([], env)
    assert settings.max_sessions_per_key == 0 and key_share(settings.max_sessions, 0) == 5
    assert key_share(1, 0) == 1
    assert parse_settings(["--max-sessions-per-key", "10"], env).max_sessions_per_key == 10
    for bad in ("11", "-1"):
        with pytest.raises(SystemExit):
            parse_settings(["--max-sessions-per-key", bad], env)

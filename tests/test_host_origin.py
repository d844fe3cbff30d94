"""DNS rebinding: the runtime, the dataplane and the scheduler answer only to allowed Host
names and browser Origins, on every route but /health, whatever address they are bound to
and whether a token is set; Host values are parsed strictly (RFC 9110 host[:port]). And the
one bearer check every HTTP surface shares."""

from __future__ import annotations

from collections.abc import AsyncIterator

import httpx
import pytest

from luftpause.origins import AllowedHosts
from luftpause.tokens import presented_matches
from luftpause.runtime.app import build_app
from luftpause.runtime.config import RuntimeSettings
from luftpause.runtime.service import Runtime
from luftpause.runtime.upstream import Toolbox
from luftpause.runtime.dataplane import DataplaneClient

EVIL = "evil.example"


@pytest.fixture
async def runtime_http(tmp_path) -> AsyncIterator[httpx.AsyncClient]:
    """The runtime's ASGI app as if bound to 0.0.0.0 in a container named "runtime"."""
    runtime = Runtime(DataplaneClient("http://127.0.0.1:9"), Toolbox([]))
    app = build_app(RuntimeSettings(host="0.0.0.0", tools_file=tmp_path / "none.yaml"), runtime)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app), base_url="http://runtime:7000") as http:
        yield http
    await runtime.close()


@pytest.mark.parametrize("path", ["/status", "/mcp"])
async def test_runtime_refuses_foreign_hosts_and_origins_on_every_route(
    runtime_http: httpx.AsyncClient, monkeypatch: pytest.MonkeyPatch, path: str
) -> None:
    monkeypatch.delenv("LUFTPAUSE_ALLOWED_HOSTS", raising=False)
    # Unset: loopback names only, even though bound to 0.0.0.0.
    assert (await runtime_http.get(path)).status_code == 421  # Host: runtime:7000
    assert (await runtime_http.get(path, headers={"Host": EVIL})).status_code == 421
    health = await runtime_http.get("/health", headers={"Host": EVIL})
    assert health.status_code == 200 and "runs" not in health.json()
    local = await runtime_http.get("/status", headers={"Host": "localhost:7000"})
    assert local.status_code == 200, local.text
    foreign_origin = await runtime_http.get(path, headers={"Host": "127.0.0.1:7000", "Origin": f"http://{EVIL}"})
    assert foreign_origin.status_code == 403 and foreign_origin.json()["error"]["message"]


async def test_runtime_allowed_hosts_setting_admits_its_names(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LUFTPAUSE_ALLOWED_HOSTS", "runtime, localhost")
    runtime = Runtime(DataplaneClient("http://127.0.0.1:9"), Toolbox([]))
    app = build_app(RuntimeSettings(host="0.0.0.0", tools_file=tmp_path / "none.yaml"), runtime)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app), base_url="http://runtime:7000") as http:
        assert (await http.get("/status")).status_code == 200
        assert (await http.get("/status", headers={"Origin": "http://runtime:7000"})).status_code == 200
        assert (await http.get("/status", headers={"Host": "127.0.0.1:7000"})).status_code == 421
        assert (await http.get("/status", headers={"Origin": "null"})).status_code == 403
    await runtime.close()


@pytest.mark.parametrize(("method", "path"), [("GET", "/v1/models"), ("POST", "/v1/chat/completions"),
                                              ("DELETE", "/v1/runs/r1"), ("POST", "/v1/decide")])
def test_dataplane_refuses_foreign_hosts_and_origins_on_every_route(proxy_stack, method: str, path: str) -> None:
    url = f"http://127.0.0.1:{proxy_stack.ports.dataplane}{path}"
    host = httpx.request(method, url, headers={"Host": EVIL}, json={})
    assert host.status_code == 421 and host.json()["error"]["message"]
    origin = httpx.request(method, url, headers={"Origin": f"http://{EVIL}:8080"}, json={})
    assert origin.status_code == 403
    userinfo = httpx.request(method, url, headers={"Host": "localhost:1@evil.example"}, json={})
    assert userinfo.status_code == 421
    health = f"http://127.0.0.1:{proxy_stack.ports.dataplane}/health"
    assert httpx.get(health, headers={"Host": EVIL}).status_code == 200


@pytest.mark.parametrize(
    ("entries", "host", "allowed"),
    [
        (("localhost", "127.0.0.1", "[::1]"), "localhost:7000", True),
        (("localhost", "127.0.0.1", "[::1]"), "[::1]:7000", True),
        (("localhost", "127.0.0.1", "[::1]"), "127.0.0.1", True),
        (("localhost", "127.0.0.1", "[::1]"), "localhost.evil.example", False),
        (("localhost", "127.0.0.1", "[::1]"), "127.0.0.1.nip.io:7000", False),
        (("api.example:443",), "api.example:443", True),
        (("api.example:443",), "api.example:8443", False),
        (("*",), EVIL, True),
        (("localhost",), None, False),
        (("localhost",), "LOCALHOST:7000", True),
        (("localhost",), "localhost:", True),  # RFC 9110: the port may be empty
        # Not host[:port]: userinfo, paths, a second colon, spaces, a port that is no number.
        (("localhost", "127.0.0.1", "[::1]"), "localhost:1@evil.example", False),
        (("localhost", "127.0.0.1", "[::1]"), "localhost@evil.example", False),
        (("localhost", "127.0.0.1", "[::1]"), "localhost:7000/evil", False),
        (("localhost", "127.0.0.1", "[::1]"), "localhost:7000:1", False),
        (("localhost", "127.0.0.1", "[::1]"), "localhost evil.example", False),
        (("localhost", "127.0.0.1", "[::1]"), "localhost:http", False),
        (("localhost", "127.0.0.1", "[::1]"), "[::1", False),
        (("localhost", "127.0.0.1", "[::1]"), "[::1]evil:7000", False),
        (("localhost", "127.0.0.1", "[::1]"), "[localhost]:7000", False),
        (("localhost", "127.0.0.1", "[::1]"), "localhost:٣", False),  # a digit, but not ASCII
        (("localhost", "127.0.0.1", "[::1]"), "", False),
    ],
)
def test_allowed_hosts_matching(entries: tuple[str, ...], host: str | None, allowed: bool) -> None:
    assert AllowedHosts(entries).allows_host(host) is allowed


@pytest.mark.parametrize(
    ("origin", "allowed"),
    [
        (None, True),
        ("http://localhost:7000", True),
        ("https://[::1]", True),
        ("http://localhost:1@evil.example", False),
        ("http://user@localhost:7000", False),
        ("http://localhost:7000/page", False),
        ("http://evil.example", False),
        ("null", False),
        ("file://localhost", False),
        ("http://[::1", False),
    ],
)
def test_origin_matching_is_strict(origin: str | None, allowed: bool) -> None:
    assert AllowedHosts(("localhost", "127.0.0.1", "[::1]")).allows_origin(origin) is allowed


@pytest.mark.parametrize("entry", ["localhost:1@evil.example", "a b", "host/path"])
def test_an_allowed_hosts_entry_that_is_not_host_or_host_port_is_refused(entry: str) -> None:
    with pytest.raises(ValueError, match="LUFTPAUSE_ALLOWED_HOSTS"):
        AllowedHosts(("localhost", entry))


@pytest.mark.parametrize(
    ("presented", "matches"),
    [
        ("Bearer s3cret", True),
        ("bearer s3cret", True),  # the scheme is case-insensitive (RFC 9110)
        ("BEARER s3cret", True),
        ("Bearer   s3cret ", True),
        (b"bEaReR s3cret", True),
        ("Bearer s3cre", False),
        ("Bearer s3cret2", False),
        ("Basic s3cret", False),
        ("Bearers3cret", False),
        ("s3cret", False),
        ("", False),
        (None, False),
    ],
)
def test_bearer_scheme_is_case_insensitive_and_the_token_exact(presented, matches: bool) -> None:
    assert presented_matches(presented, "s3cret") is matches


async def test_runtime_takes_a_lower_case_bearer_scheme(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("LUFTPAUSE_ALLOWED_HOSTS", raising=False)
    runtime = Runtime(DataplaneClient("http://127.0.0.1:9"), Toolbox([]))
    app = build_app(RuntimeSettings(token="s3cret", tools_file=tmp_path / "none.yaml"), runtime)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app), base_url="http://127.0.0.1:7000") as http:
        assert (await http.get("/status", headers={"Authorization": "bearer s3cret"})).status_code == 200
        refused = await http.get("/status", headers={"Authorization": "bearer wrong"})
        assert refused.status_code == 401 and refused.headers["WWW-Authenticate"] == "Bearer"
        # On /mcp the refusal is a JSON-RPC error body.
        mcp = await http.post("/mcp", json={"jsonrpc": "2.0", "id": 1, "method": "ping"})
        assert mcp.status_code == 401 and mcp.json()["error"]["code"] == -32600 and mcp.json()["id"] is None
    await runtime.close()


async def test_runtime_refuses_userinfo_hosts(runtime_http: httpx.AsyncClient, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("LUFTPAUSE_ALLOWED_HOSTS", raising=False)
    for path in ("/status", "/metrics"):
        response = await runtime_http.get(path, headers={"Host": "localhost:1@evil.example"})
        assert response.status_code == 421, (path, response.text)
    mcp = await runtime_http.post("/mcp", json={}, headers={"Host": "localhost:1@evil.example"})
    assert mcp.status_code == 421 and mcp.json()["jsonrpc"] == "2.0" and "not allowed" in mcp.json()["error"]["message"]
    origin = await runtime_http.post("/mcp", json={}, headers={"Host": "localhost", "Origin": f"http://{EVIL}"})
    assert origin.status_code == 403 and origin.json()["error"]["code"] == -32600


DUPLICATES = [[("Origin", "http://localhost:7000"), ("Origin", f"http://{EVIL}")],
              [("Origin", f"http://{EVIL}"), ("Origin", "http://localhost:7000")]]


@pytest.mark.parametrize("origins", DUPLICATES)
async def test_runtime_refuses_a_duplicated_origin_whichever_comes_first(
    runtime_http: httpx.AsyncClient, monkeypatch: pytest.MonkeyPatch, origins: list[tuple[str, str]]
) -> None:
    # One server reading the first and another the last would let one order through.
    monkeypatch.delenv("LUFTPAUSE_ALLOWED_HOSTS", raising=False)
    response = await runtime_http.get("/status", headers=[("Host", "localhost:7000"), *origins])
    assert response.status_code == 400 and response.json()["error"]["message"] == "more than one Origin header"


@pytest.mark.parametrize("origins", DUPLICATES)
def test_dataplane_and_scheduler_refuse_a_duplicated_origin_whichever_comes_first(
    proxy_stack, origins: list[tuple[str, str]]
) -> None:
    for port, path in ((proxy_stack.ports.dataplane, "/v1/models"), (proxy_stack.ports.scheduler_http, "/status")):
        response = httpx.get(f"http://127.0.0.1:{port}{path}", headers=origins)
        assert response.status_code == 400, (path, response.text)
        assert response.json()["error"]["message"] == "more than one Origin header"

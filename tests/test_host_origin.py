"""DNS rebinding: the runtime and the dataplane answer only to allowed Host names and
browser Origins, on every route but /health, whatever address they are bound to."""

from __future__ import annotations

from collections.abc import AsyncIterator

import httpx
import pytest

from luftpause.origins import AllowedHosts
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
    ],
)
def test_allowed_hosts_matching(entries: tuple[str, ...], host: str | None, allowed: bool) -> None:
    assert AllowedHosts(entries).allows_host(host) is allowed

"""Hostile input, generated: arbitrary JSON as MCP tool arguments and arbitrary headers and
bodies on the proxy. Whatever comes in: no 5xx, every run final after `cancel`, and the
runtime's /status always valid JSON. Wrong types in a turn are a 400 in the API's own
error shape before an engine sees anything; a request no HTTP parser reads (headers too
large, a broken request line) is answered in JSON by every service. And DNS rebinding
against the laptop set-up (no token): a page on a foreign name reads nothing from any
service."""

from __future__ import annotations

import importlib.util
import json
import socket
from pathlib import Path

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from luftpause import vocabulary as h
from luftpause.dev.stack import MODEL


def _raw_mcp():
    """tests/runtime/raw_mcp.py, loaded by path (the test directories are not packages)."""
    spec = importlib.util.spec_from_file_location("raw_mcp", Path(__file__).parents[1] / "runtime" / "raw_mcp.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


RawSession = _raw_mcp().RawSession

SETTINGS = settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))
FINAL = {"Completed", "Failed", "Cancelled"}

json_scalars = (st.none() | st.booleans() | st.integers(min_value=-(2**70), max_value=2**70)
                | st.floats(allow_nan=True, allow_infinity=True) | st.text(max_size=40))
json_values = st.recursive(json_scalars, lambda inner: st.lists(inner, max_size=4)
                           | st.dictionaries(st.text(max_size=10), inner, max_size=4), max_leaves=12)
SPAWN_KEYS = ["task", "model", "serviceClass", "system", "maxToolCalls", "tools", "maxTokens", "parallelToolCalls",
              "parent", "budgetTokens", "budgetToolCalls", "budgetSeconds", "approveTools", "bogus"]
spawn_arguments = st.dictionaries(st.sampled_from(SPAWN_KEYS), json_values, max_size=6).map(
    lambda arguments: {"task": "hostile", **arguments} if "task" not in arguments else arguments
)


def literal_json(value) -> str:
    """JSON as Python writes it: Infinity and NaN stay literals, as a hostile client may send."""
    return json.dumps(value, allow_nan=True)


@pytest.fixture(scope="module")
def runtime_url(full_stack) -> str:
    return f"http://127.0.0.1:{full_stack.ports.runtime}"


@SETTINGS
@given(arguments=spawn_arguments)
def test_spawn_with_arbitrary_arguments_never_breaks_the_runtime(runtime_url: str, arguments: dict) -> None:
    with httpx.Client(timeout=30) as http:
        session = RawSession(http, f"{runtime_url}/mcp").open()
        try:
            response, reply = session.call_text("spawn", literal_json(arguments))
            assert response.status_code < 500 and reply is not None, response.text
            handle = (reply.get("result") or {}).get("structuredContent", {}).get("handle")
            if handle:
                response, reply = session.call("cancel", {"handles": [handle]})
                assert response.status_code < 500 and "result" in reply, reply
                record = reply["result"]["structuredContent"]["runs"][0]
                assert record["status"] in FINAL, record
        finally:
            session.close()
        status = http.get(f"{runtime_url}/status")
        assert status.status_code == 200
        json.loads(status.text, parse_constant=lambda name: pytest.fail(f"{name} in /status"))


@SETTINGS
@given(tool=st.sampled_from(["await", "status", "cancel", "tools", "decide", "run", "nope"]),
       arguments=json_values)
def test_any_tool_with_any_arguments_answers_without_a_server_error(runtime_url: str, tool: str, arguments) -> None:
    with httpx.Client(timeout=30) as http:
        session = RawSession(http, f"{runtime_url}/mcp").open()
        try:
            if tool == "run":  # keep it short: a run that does start is told to finish at once
                arguments = {"task": "t", "maxToolCalls": 0, "maxTokens": 1}
            if tool == "await" and isinstance(arguments, dict):
                arguments["timeout"] = 0
            response, reply = session.call_text(tool, literal_json(arguments))
        finally:
            session.close()
    assert response.status_code < 500, response.text
    assert reply is not None and ("result" in reply or reply["error"]["code"] != 0), reply


# Header values as sent on the wire: UTF-8 text, or any bytes an HTTP parser lets through
# (visible ASCII and obs-text; control characters are refused by the parser itself).
header_text = st.text(alphabet=st.characters(min_codepoint=32, max_codepoint=0x2FF, exclude_characters="\x7f"),
                      max_size=300).map(lambda text: text.encode().strip(b" "))
header_bytes = st.lists(st.integers(0x20, 0xFF).filter(lambda b: b != 0x7F), max_size=300).map(lambda b: bytes(b).strip(b" "))
bodies = st.one_of(
    st.binary(max_size=200),
    json_values.map(lambda value: literal_json(value).encode()),
    st.fixed_dictionaries({"model": st.sampled_from(["fake-llama-1b", "nope", ""]), "messages": json_values},
                          optional={"stream": json_values, "max_tokens": json_values}).map(
        lambda value: literal_json(value).encode()),
)


@SETTINGS
@given(run_id=header_text | header_bytes, caller=header_text | header_bytes,
       service_class=st.sampled_from(["interactive", "batch", "BATCH", "", "urgent"]), body=bodies,
       content_type=st.sampled_from(["application/json", "text/plain", "application/json; charset=utf-8"]))
def test_the_proxy_answers_arbitrary_headers_and_bodies_without_a_server_error(
    proxy_stack, run_id, caller, service_class: str, body: bytes, content_type: str
) -> None:
    url = f"http://127.0.0.1:{proxy_stack.ports.dataplane}/v1/chat/completions"
    request_headers = {"Content-Type": content_type, h.RUN_ID: run_id, h.CALLER: caller,
                       h.SERVICE_CLASS: service_class}
    response = httpx.post(url, content=body, headers=request_headers, timeout=30)
    assert response.status_code < 500, (response.status_code, response.text[:500])
    if response.status_code >= 400:
        assert response.json()["error"]["message"], response.text[:500]


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/messages", "/v1/messages/count_tokens",
                                  "/v1/responses", "/v1/decide"])
def test_json_nested_past_the_parser_depth_is_a_400_with_a_message(proxy_stack, path: str) -> None:
    body = b'{"model": "fake-llama-1b", "messages": ' + b"[" * 5000 + b"]" * 5000 + b"}"
    response = httpx.post(f"http://127.0.0.1:{proxy_stack.ports.dataplane}{path}", content=body,
                          headers={"Content-Type": "application/json"}, timeout=30)
    assert response.status_code == 400, response.text[:300]
    assert response.json()["error"]["message"] == "request body is not valid JSON: nested too deep"


USER = [{"role": "user", "content": "hi"}]
BASES = {"/v1/chat/completions": {"model": MODEL, "messages": USER},
         "/v1/messages": {"model": MODEL, "max_tokens": 16, "messages": USER},
         "/v1/responses": {"model": MODEL, "input": "hi"}}
BAD_BASE64 = "iVBORw0KGgo=!!"


def user_blocks(*blocks: dict) -> dict:
    return {"messages": [{"role": "user", "content": list(blocks)}]}


def responses_parts(*parts: dict) -> dict:
    return {"input": [{"role": "user", "content": list(parts)}]}


def base64_image(data: str, media_type: str = "image/png") -> dict:
    return {"type": "image", "source": {"type": "base64", "media_type": media_type, "data": data}}


WRONG_TYPES = [  # (path, what replaces the base body's fields, words of the message)
    ("/v1/messages", user_blocks({"type": "text", "text": 5}), "content[0].text must be a string"),
    ("/v1/messages", {"temperature": "hot"}, "temperature"),
    ("/v1/messages", {"temperature": 7}, "temperature"),
    ("/v1/messages", {"top_k": 2.5}, "top_k"),
    ("/v1/messages", {"stop_sequences": "x"}, "stop_sequences"),
    ("/v1/messages", {"max_tokens": 1e30}, "max_tokens"),
    ("/v1/messages", {"max_tokens": 10**30}, "max_tokens"),
    ("/v1/messages", {"max_tokens": 8.0}, "max_tokens"),
    ("/v1/messages", user_blocks(base64_image(BAD_BASE64)), "not valid base64"),
    ("/v1/messages", user_blocks(base64_image("iVBORw0KGgo=", "image/bmp")), "media_type"),
    ("/v1/messages", {"messages": [{"role": "assistant", "content": [
        {"type": "tool_use", "id": "t1", "name": "lookup", "input": "q"}]}]}, "input must be an object"),
    ("/v1/messages", {"metadata": {"user_id": 5}}, "metadata.user_id"),
    ("/v1/messages", {"tool_choice": {"type": "auto", "disable_parallel_tool_use": "yes"}},
     "disable_parallel_tool_use"),
    ("/v1/chat/completions", {"messages": [{"role": "wizard", "content": "hi"}]}, "messages[0].role"),
    ("/v1/chat/completions", {"messages": ["hi"]}, "messages[0] must be an object"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": 5}]}, "messages[0].content"),
    ("/v1/responses", responses_parts({"type": "input_text", "text": 5}), "'text' must be a string"),
    ("/v1/responses", {"input": [{"role": "wizard", "content": "hi"}]}, "role"),
    ("/v1/responses", {"temperature": "hot"}, "temperature"),
    ("/v1/responses", {"max_output_tokens": 10**30}, "max_output_tokens"),
    ("/v1/responses", {"include": "reasoning.encrypted_content"}, "include"),
    ("/v1/responses", {"metadata": {"k": 1}}, "metadata"),
    ("/v1/responses", responses_parts({"type": "input_image", "detail": "auto",
                                       "image_url": f"data:image/png;base64,{BAD_BASE64}"}), "not valid base64"),
    ("/v1/responses", {"input": [{"type": "function_call", "call_id": "c1", "name": "f", "arguments": {"a": 1}}]},
     "arguments"),
    ("/v1/responses", {"tools": [{"type": "function", "name": "f", "parameters": "{}"}]}, "parameters"),
]


def engine_requests(stack) -> int:
    """Requests the engines received, valid or not."""
    return sum(httpx.get(f"http://127.0.0.1:{port}/stats", timeout=30).json()["requests"]
               for port in stack.ports.engines)


@pytest.mark.parametrize(("path", "change", "words"), WRONG_TYPES)
def test_a_wrong_type_is_a_400_in_the_apis_shape_before_any_engine_sees_it(proxy_stack, path: str, change: dict,
                                                                              words: str) -> None:
    sent_before = engine_requests(proxy_stack)
    response = httpx.post(f"http://127.0.0.1:{proxy_stack.ports.dataplane}{path}",
                          content=json.dumps({**BASES[path], **change}),
                          headers={"Content-Type": "application/json"}, timeout=30)
    assert response.status_code == 400, response.text[:300]
    body = response.json()
    assert words in body["error"]["message"], body
    if path != "/v1/chat/completions":  # the Messages and Responses APIs name the error's type
        assert body["error"]["type"] == "invalid_request_error", body
    if path == "/v1/messages":
        assert body["type"] == "error", body
    assert engine_requests(proxy_stack) == sent_before


def test_what_harnesses_send_beside_the_wrong_types_is_still_served(proxy_stack) -> None:
    """The checks refuse types, not fields: settings of the right type, unknown fields and
    a real image pass."""
    url = f"http://127.0.0.1:{proxy_stack.ports.dataplane}"
    image = base64_image("iVBORw0KGgo=")
    messages = httpx.post(f"{url}/v1/messages", timeout=30, json={
        **BASES["/v1/messages"], "temperature": 1, "top_p": 0.9, "top_k": 40, "stop_sequences": ["END"],
        "metadata": {"user_id": "u"}, "thinking": {"type": "adaptive"}, "brand_new_field": {"x": [1]},
        **user_blocks({"type": "text", "text": "look", "cache_control": {"type": "ephemeral"}}, image)})
    assert messages.status_code == 200, messages.text[:300]
    responses = httpx.post(f"{url}/v1/responses", timeout=30, json={
        **BASES["/v1/responses"], "temperature": 1.5, "max_output_tokens": 64, "store": False,
        "include": ["reasoning.encrypted_content"], "reasoning": {"effort": "low", "summary": "auto"},
        "parallel_tool_calls": False, "brand_new_field": 1,
        **responses_parts({"type": "input_text", "text": "look"},
                          {"type": "input_image", "detail": "original", "image_url": "data:image/png;base64,AAAA"})})
    assert responses.status_code == 200, responses.text[:300]
    chat = httpx.post(f"{url}/v1/chat/completions", timeout=30, json={
        **BASES["/v1/chat/completions"], "messages": [{"role": "developer", "content": "be brief"}, *USER]})
    assert chat.status_code == 200, chat.text[:300]


def raw_exchange(port: int, request: bytes) -> tuple[int, dict[str, str], bytes]:
    """Send ``request`` as it is (it need not be HTTP) and read the answer to its end (the
    server closes the connection after a refusal of this kind): status, headers, body."""
    with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:
        sock.sendall(request)
        answer = b""
        while chunk := sock.recv(65536):
            answer += chunk
    head, _, body = answer.partition(b"\r\n\r\n")
    status_line, *lines = head.decode("latin-1").split("\r\n")
    headers = {name.strip().lower(): value.strip() for name, _, value in (line.partition(":") for line in lines)}
    return int(status_line.split()[1]), headers, body


# A head still unfinished past every parser's limit (aiohttp: 8190 bytes a header field;
# h11, the runtime's: 16 KiB not yet a whole head), and a request line no parser reads.
UNREADABLE = {"header too large": (b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Big: " + b"a" * 20000, 431,
                                   "request header fields too large"),
              "broken request line": (b"NOT HTTP AT ALL\r\n\r\n", 400, "malformed HTTP request")}


@pytest.mark.parametrize("case", sorted(UNREADABLE))
@pytest.mark.parametrize("service", ["runtime", "dataplane", "scheduler"])
def test_a_request_no_http_parser_reads_is_answered_in_json_by_every_service(full_stack, service: str,
                                                                             case: str) -> None:
    ports = full_stack.ports
    port = {"runtime": ports.runtime, "dataplane": ports.dataplane, "scheduler": ports.scheduler_http}[service]
    request, status, words = UNREADABLE[case]
    got, headers, body = raw_exchange(port, request)
    assert got == status, (service, got, body[:200])
    assert headers["content-type"].startswith("application/json"), (service, headers)
    assert json.loads(body)["error"]["message"].startswith(words), (service, body[:200])
    # The service goes on.
    assert httpx.get(f"http://127.0.0.1:{port}/health", timeout=30).status_code == 200


REBINDING_ROUTES = {
    "runtime": ["GET /status", "POST /mcp", "GET /metrics"],
    "dataplane": ["GET /v1/models", "POST /v1/chat/completions", "GET /metrics"],
    "scheduler": ["GET /runtime-status", "GET /status", "GET /", "GET /metrics"],
}


@pytest.mark.parametrize("service", sorted(REBINDING_ROUTES))
def test_a_rebinding_page_reads_nothing_from_any_service_without_a_token(full_stack, service: str) -> None:
    ports = full_stack.ports
    port = {"runtime": ports.runtime, "dataplane": ports.dataplane, "scheduler": ports.scheduler_http}[service]
    base = f"http://127.0.0.1:{port}"
    with httpx.Client(timeout=30) as http:
        for route in REBINDING_ROUTES[service]:
            method, path = route.split()
            # What a browser sends once evil.example resolves to 127.0.0.1.
            rebound = http.request(method, base + path, json={}, headers={
                "Host": f"evil.example:{port}", "Origin": f"http://evil.example:{port}"})
            assert rebound.status_code == 421, (service, route, rebound.text[:200])
            assert "not allowed" in rebound.json()["error"]["message"] and "run-" not in rebound.text
            userinfo = http.request(method, base + path, json={}, headers={"Host": "localhost:1@evil.example"})
            assert userinfo.status_code == 421, (service, route)
            cross_site = http.request(method, base + path, json={}, headers={"Origin": f"http://evil.example:{port}"})
            assert cross_site.status_code == 403, (service, route)
        assert http.get(base + "/health", headers={"Host": "evil.example"}).status_code == 200
        # The service's own name still answers.
        first_get = REBINDING_ROUTES[service][0].split()[1]
        assert http.get(base + first_get, headers={"Host": f"localhost:{port}"}).status_code == 200

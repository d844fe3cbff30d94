"""A bare JSON-RPC client for MCP over Streamable HTTP, for sending what no SDK client
would: literal ``Infinity``, wrong types, odd headers. Session era (initialize)."""

from __future__ import annotations

import json
import re
from typing import Any

import httpx

PROTOCOL_VERSION = "2025-06-18"
ACCEPT = "application/json, text/event-stream"


def messages(response: httpx.Response) -> list[dict[str, Any]]:
    """The JSON-RPC messages of a response, plain JSON or server-sent events."""
    if response.headers.get("content-type", "").startswith("text/event-stream"):
        # Server-sent events end lines with CR, LF or CRLF only; str.splitlines would also
        # split inside a JSON string that carries U+0085 or U+2028 unescaped.
        lines = re.split(r"\r\n|\r|\n", response.text)
        return [json.loads(line[5:]) for line in lines if line.startswith("data:") and line[5:].strip()]
    return [response.json()] if response.content else []


def initialize(version: str = PROTOCOL_VERSION) -> dict[str, Any]:
    return {"jsonrpc": "2.0", "id": 0, "method": "initialize", "params": {
        "protocolVersion": version, "capabilities": {}, "clientInfo": {"name": "raw", "version": "0"}}}


INITIALIZE = initialize()


class RawSession:
    def __init__(self, http: httpx.Client, url: str, headers: dict[str, str] | None = None) -> None:
        self.http, self.url = http, url
        self.headers = {"Accept": ACCEPT, "Content-Type": "application/json", **(headers or {})}
        self.next_id = 1

    def open(self, version: str = PROTOCOL_VERSION) -> RawSession:
        response = self.post_json(initialize(version))
        response.raise_for_status()
        self.headers["mcp-session-id"] = response.headers["mcp-session-id"]
        if version != "2025-03-26":  # that version's clients send no MCP-Protocol-Version
            self.headers["mcp-protocol-version"] = version
        self.post_json({"jsonrpc": "2.0", "method": "notifications/initialized"})
        return self

    def close(self) -> None:
        if "mcp-session-id" in self.headers:
            self.http.delete(self.url, headers=self.headers)

    def post_json(self, message: dict[str, Any]) -> httpx.Response:
        return self.http.post(self.url, content=json.dumps(message), headers=self.headers)

    def post_text(self, text: str) -> httpx.Response:
        return self.http.post(self.url, content=text.encode(), headers=self.headers)

    def call_text(self, tool: str, arguments_json: str) -> tuple[httpx.Response, dict[str, Any] | None]:
        """`tools/call` with the arguments written as raw JSON text; the response and its reply."""
        self.next_id += 1
        text = (f'{{"jsonrpc":"2.0","id":{self.next_id},"method":"tools/call",'
                f'"params":{{"name":{json.dumps(tool)},"arguments":{arguments_json}}}}}')
        response = self.post_text(text)
        replies = [m for m in messages(response) if m.get("id") == self.next_id]
        return response, (replies[0] if replies else None)

    def call(self, tool: str, arguments: Any) -> tuple[httpx.Response, dict[str, Any] | None]:
        return self.call_text(tool, json.dumps(arguments))

"""What a service answers a request its HTTP server could not read — a header past the
parser's limit, a malformed request line, a broken chunk — and an error of the server
itself: JSON, ``{"error": {"message": ...}}`` as every other refusal (docs/security.md),
never the server library's plain text. Header fields too large are ``431 Request Header
Fields Too Large`` (RFC 6585), what h11 (the runtime's server) suggests for them too; the
rest of what cannot be parsed stays ``400``.

The aiohttp services (dataplane, scheduler, endpoint picker) start their servers with
``luftpause.aiohttp_server.JsonErrorsRunner``; the runtime's uvicorn with
``luftpause.runtime.http_protocol.JsonErrorsH11Protocol``. Both word their answers here; this
module imports neither server, so each service loads only its own.
"""

from __future__ import annotations

import json
from http import HTTPStatus

HEADERS_TOO_LARGE = HTTPStatus.REQUEST_HEADER_FIELDS_TOO_LARGE  # 431
DETAIL_CHARS = 200  # of the parser's own words about a malformed request


def error_json(message: str) -> bytes:
    return json.dumps({"error": {"message": message}}).encode()


def headers_too_large(what: str) -> str:
    return f"request header fields too large: {what}"


def malformed(detail: object) -> str:
    """A request the parser refused, with the parser's words (cut short)."""
    text = str(detail or "").strip()
    return f"malformed HTTP request: {text[:DETAIL_CHARS]}" if text else "malformed HTTP request"


def server_error(status: int) -> str:
    """An error of the server itself (aiohttp's 500 for a handler's exception, 504 for its timeout)."""
    return "the request timed out" if status == HTTPStatus.GATEWAY_TIMEOUT else "internal server error"

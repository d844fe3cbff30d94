"""The aiohttp services' runner: :class:`JsonErrorsRunner` is ``web.AppRunner`` whose
connections answer in JSON what aiohttp answers itself, outside any handler or
middleware (a header over ``max_field_size``, more than ``max_headers`` headers, a request
the parser refuses, a handler's unhandled exception): luftpause/protocol_errors.py.

aiohttp builds those answers in ``RequestHandler.handle_error`` (web_protocol.py), one
``RequestHandler`` per connection, made by the ``web.Server`` the runner sets up; neither
takes another class as a setting. So the runner's server makes :class:`JsonErrorsHandler`,
a ``RequestHandler`` that differs only in ``handle_error``. aiohttp's own
``handle_error`` still runs first, for its logging and its check that no part of a
response went out yet. tests/test_protocol_errors.py pins this against the installed
aiohttp: an upgrade that moves the hook fails there.
"""

from __future__ import annotations

from aiohttp import web
from aiohttp.http_exceptions import BadHttpMessage, LineTooLong
from aiohttp.web_protocol import RequestHandler
from aiohttp.web_request import BaseRequest

from luftpause import protocol_errors


class JsonErrorsHandler(RequestHandler):
    """aiohttp's connection handler, its own error answers in JSON."""

    __slots__ = ()  # the same layout as RequestHandler: the server's handlers are made one of these

    def handle_error(self, request: BaseRequest, status: int = 500, exc: BaseException | None = None,
                     message: str | None = None) -> web.StreamResponse:
        super().handle_error(request, status, exc, message)  # logs; raises if the response has begun
        status, text = self.refusal(status, exc, message)
        response = web.Response(body=protocol_errors.error_json(text), status=status, content_type="application/json")
        response.force_close()
        return response

    def refusal(self, status: int, exc: BaseException | None, message: str | None) -> tuple[int, str]:
        if isinstance(exc, LineTooLong):
            limit = exc.args[1] if len(exc.args) > 1 and isinstance(exc.args[1], int) else self.max_field_size
            what = f"a header field (or the request line) is over {limit} bytes"
            return protocol_errors.HEADERS_TOO_LARGE, protocol_errors.headers_too_large(what)
        if isinstance(exc, BadHttpMessage) and "too many headers" in exc.message.lower():
            what = f"more than {self.max_headers} header fields"
            return protocol_errors.HEADERS_TOO_LARGE, protocol_errors.headers_too_large(what)
        if status >= 500:
            return status, protocol_errors.server_error(status)
        return status, protocol_errors.malformed(message or exc)


class _JsonErrorsServer(web.Server):
    def __call__(self) -> RequestHandler:
        handler = super().__call__()
        handler.__class__ = JsonErrorsHandler  # made by aiohttp as it makes them, answering in JSON
        return handler


class JsonErrorsRunner(web.AppRunner):
    """``web.AppRunner`` (same arguments) whose connections answer protocol errors in JSON."""

    __slots__ = ()

    async def _make_server(self) -> web.Server:
        server = await super()._make_server()
        server.__class__ = _JsonErrorsServer
        return server

"""The runtime's uvicorn protocol: :class:`JsonErrorsH11Protocol` is uvicorn's h11
protocol whose answer to a request h11 cannot read is JSON, worded as the aiohttp
services word theirs (luftpause/protocol_errors.py): 431 for a request line and headers
still unfinished past h11's buffer (16 KiB), 400 with h11's words for the rest.

uvicorn answers those itself in plain text, before the ASGI app sees the request, in
``H11Protocol.send_400_response``, which it calls from inside its ``except
h11.RemoteProtocolError``: the error is read there, with the status h11 suggests for it.
tests/test_protocol_errors.py pins this against the installed uvicorn.
``uvicorn.Config(http=JsonErrorsH11Protocol)`` selects it (uvicorn would pick h11 anyway:
httptools is not a dependency).
"""

from __future__ import annotations

import sys
from http import HTTPStatus

import h11
from h11._connection import DEFAULT_MAX_INCOMPLETE_EVENT_SIZE  # as uvicorn imports it
from uvicorn.protocols.http.h11_impl import H11Protocol

from luftpause import protocol_errors


class JsonErrorsH11Protocol(H11Protocol):
    def send_400_response(self, msg: str) -> None:
        error = sys.exc_info()[1]  # the h11.RemoteProtocolError uvicorn is handling
        status = error.error_status_hint if isinstance(error, h11.RemoteProtocolError) else 400
        if status == protocol_errors.HEADERS_TOO_LARGE:
            limit = self.config.h11_max_incomplete_event_size or DEFAULT_MAX_INCOMPLETE_EVENT_SIZE
            text = protocol_errors.headers_too_large(f"the request line and headers are over {limit} bytes")
        else:
            text = protocol_errors.malformed(error or msg)
        body = protocol_errors.error_json(text)
        headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                   (b"connection", b"close")]
        self.transport.write(self.conn.send(h11.Response(status_code=status, headers=headers,
                                                         reason=HTTPStatus(status).phrase.encode())))
        self.transport.write(self.conn.send(h11.Data(data=body)))
        self.transport.write(self.conn.send(h11.EndOfMessage()))
        self.transport.close()

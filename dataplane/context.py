"""What the dataplane's request handlers share: the application's keys (run book,
scheduler link, engines, metrics, ...), new run and turn ids, and an error response in
the client API's shape."""

from __future__ import annotations

import os

from aiohttp import web
from opentelemetry import trace

from luftpause.dataplane.dialects import Dialect
from luftpause.dataplane.engines import Engines
from luftpause.dataplane.link import SchedulerLink
from luftpause.dataplane.metrics import DataplaneMetrics
from luftpause.dataplane.runs import RunBook
from luftpause.dataplane.suspects import Suspects
from luftpause.keys import Keys

TRACER = trace.get_tracer("luftpause.dataplane")
BOOK = web.AppKey("book", RunBook)
LINK = web.AppKey("link", SchedulerLink)
ENGINES = web.AppKey("engines", Engines)
SUSPECTS = web.AppKey("suspects", Suspects)  # requests that took a replica down (suspects.py)
TOKEN = web.AppKey("token", str)
LOG = web.AppKey("log", object)
METRICS = web.AppKey("metrics", DataplaneMetrics)
KEYS = web.AppKey("keys", Keys)  # tenant keys (luftpause/keys.py)
TENANT = "tenant"  # request key: the KeyIdentity a tenant key authenticated, if one did
HOLD_TOOL_CALLS = web.AppKey("hold_tool_calls", bool)  # False: --tool-calls live
DIALECT = web.RequestKey("dialect", Dialect)  # the client API of a dialect route, for its error shape


def new_id() -> str:
    """A new run or turn id: 128 random bits as 32 hex digits, the form of a uuid4's hex
    (a fifth of its cost, which is the UUID object's)."""
    return os.urandom(16).hex()


def error_response(status: int, message: str, extra: dict[str, str] | None = None,
                   dialect: Dialect | None = None, kind: str = "") -> web.Response:
    """An error as the client's API shapes it: ``{"error": {"message": ...}}`` for chat
    completions, the dialect's own shape for a dialect's route."""
    body = {"error": {"message": message}} if dialect is None else dialect.error_body(status, message, kind)
    return web.json_response(body, status=status, headers=extra)

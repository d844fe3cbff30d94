"""What the dataplane's request handlers share: the application's keys (run book,
scheduler link, engines, metrics, ...) and an error response in the client API's shape
(new run and turn ids: luftpause/runbook.py)."""

from __future__ import annotations

from aiohttp import web
from opentelemetry import trace

from luftpause.dataplane.dialects import Dialect
from luftpause.dataplane.engines import Engines
from luftpause.dataplane.metrics import DataplaneMetrics
from luftpause.dataplane.suspects import Suspects
from luftpause.keys import KeyIdentity, Keys
from luftpause.link import SchedulerLink
from luftpause.runbook import RunBook

TRACER = trace.get_tracer("luftpause.dataplane")
BOOK = web.AppKey("book", RunBook)
LINK = web.AppKey("link", SchedulerLink)
ENGINES = web.AppKey("engines", Engines)
SUSPECTS = web.AppKey("suspects", Suspects)  # requests that took a replica down (suspects.py)
TOKEN = web.AppKey("token", str)
LOG = web.AppKey("log", object)
METRICS = web.AppKey("metrics", DataplaneMetrics)
KEYS = web.AppKey("keys", Keys)  # tenant keys (luftpause/keys.py)
TENANT = web.RequestKey("tenant", KeyIdentity)  # the KeyIdentity a tenant key authenticated, if one did
RUN_ID = web.RequestKey("run_id", str)  # the turn's run, named in its error responses (requests.py)
HOLD_TOOL_CALLS = web.AppKey("hold_tool_calls", bool)  # False: --tool-calls live
DIALECT = web.RequestKey("dialect", Dialect)  # the client API of a dialect route, for its error shape


def error_response(status: int, message: str, extra: dict[str, str] | None = None,
                   dialect: Dialect | None = None, kind: str = "") -> web.Response:
    """An error as the client's API shapes it: ``{"error": {"message": ...}}`` for chat
    completions, the dialect's own shape for a dialect's route."""
    body = {"error": {"message": message}} if dialect is None else dialect.error_body(status, message, kind)
    return web.json_response(body, status=status, headers=extra)

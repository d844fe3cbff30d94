"""The one structlog configuration point shared by every luftpause process.

Settings (every service's ``--help`` names them):

* ``LUFTPAUSE_LOG_FORMAT``: ``console`` (default; ``key=value`` pairs after the event
  name, one line each) or ``json`` (one JSON object per line);
* ``LUFTPAUSE_LOG_LEVEL``: ``debug``, ``info`` (default), ``warning`` or ``error``;
  ``debug`` adds the scheduler's line per admission decision.

Every line carries ``service`` and, while a traced request is being handled,
``trace_id`` and ``span_id``. Keys are snake_case.
"""

from __future__ import annotations

import logging
import os
import sys

import structlog
from opentelemetry import trace

FORMATS = ("console", "json")
LOG_SETTINGS_HELP = ("Logs go to stderr: LUFTPAUSE_LOG_FORMAT=console|json (default console), "
                     "LUFTPAUSE_LOG_LEVEL=debug|info|warning|error (default info).")


def _add_trace_ids(logger, method_name, event_dict):
    """trace_id and span_id of the current span, when there is a valid one."""
    context = trace.get_current_span().get_span_context()
    if context.is_valid:
        event_dict.setdefault("trace_id", format(context.trace_id, "032x"))
        event_dict.setdefault("span_id", format(context.span_id, "016x"))
    return event_dict


def configure(service: str, level: str | None = None) -> structlog.stdlib.BoundLogger:
    """Configure key-value logging to stderr and return the service's logger."""
    level_name = (level or os.environ.get("LUFTPAUSE_LOG_LEVEL", "info")).upper()
    numeric_level = getattr(logging, level_name, logging.INFO)
    log_format = os.environ.get("LUFTPAUSE_LOG_FORMAT", "console").strip().lower()
    renderer: structlog.typing.Processor
    if log_format == "json":
        renderer = structlog.processors.JSONRenderer()
    else:
        renderer = structlog.dev.ConsoleRenderer(colors=False)

    def add_service(logger, method_name, event_dict):
        event_dict.setdefault("service", service)
        return event_dict

    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            add_service,
            _add_trace_ids,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(numeric_level),
        logger_factory=structlog.PrintLoggerFactory(file=sys.stderr),
        cache_logger_on_first_use=True,
    )
    # Libraries (uvicorn, aiohttp, grpc) log through stdlib logging; keep them quiet
    # unless asked and on the same stream.
    logging.basicConfig(level=max(numeric_level, logging.WARNING), stream=sys.stderr)
    log = structlog.get_logger(service=service)
    if log_format not in FORMATS:
        log.warning("unknown_log_format", value=log_format, using="console", choices=list(FORMATS))
    return log

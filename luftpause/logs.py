"""The one structlog configuration point shared by every luftpause process."""

from __future__ import annotations

import logging
import os
import sys

import structlog


def configure(service: str, level: str | None = None) -> structlog.stdlib.BoundLogger:
    """Configure key-value logging to stderr and return the service's logger.

    ``LUFTPAUSE_LOG_FORMAT=json`` switches from the console renderer to JSON lines;
    ``LUFTPAUSE_LOG_LEVEL`` sets the level (default ``info``).
    """
    level_name = (level or os.environ.get("LUFTPAUSE_LOG_LEVEL", "info")).upper()
    numeric_level = getattr(logging, level_name, logging.INFO)
    renderer: structlog.typing.Processor
    if os.environ.get("LUFTPAUSE_LOG_FORMAT", "console") == "json":
        renderer = structlog.processors.JSONRenderer()
    else:
        renderer = structlog.dev.ConsoleRenderer(colors=False)
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
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
    return structlog.get_logger(service=service)

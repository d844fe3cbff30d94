"""`python -m luftpause.runtime`: serve the MCP runtime (see `--help`)."""

from __future__ import annotations

import sys
from collections.abc import Sequence

import uvicorn

from luftpause import logs, tracing
from luftpause.runtime import constants
from luftpause.runtime.app import build_app
from luftpause.runtime.config import ToolsFileError, parse_settings


def main(argv: Sequence[str] | None = None) -> int:
    settings = parse_settings(argv)
    log = logs.configure("runtime")
    tracing.configure("runtime")
    try:
        app = build_app(settings)
    except ToolsFileError as exc:
        log.error("tools_file_invalid", error=str(exc))
        return 2
    log.info(
        "runtime_starting",
        host=settings.host,
        port=settings.port,
        dataplane=settings.dataplane_url,
        tools_file=str(settings.tools_file),
        state_dir=str(settings.state_dir),
        auth=bool(settings.token),
    )
    config = uvicorn.Config(
        app,
        host=settings.host,
        port=settings.port,
        log_level="warning",
        access_log=False,
        lifespan="on",
        timeout_graceful_shutdown=constants.GRACEFUL_SHUTDOWN_S,
    )
    try:
        uvicorn.Server(config).run()
    finally:
        tracing.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())

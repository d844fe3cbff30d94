"""`python -m luftpause.runtime`: serve the MCP runtime (see `--help`).

Start-up order matters for how soon the port answers: the settings are read and a child
process is forked to compact the journal (`compaction.ForkedCompaction`) before the
heavy imports (the MCP SDK, uvicorn: most of a start's CPU), which then run on one core
while the compaction runs on another. Replay waits for the child.
"""

from __future__ import annotations

import time

STARTED = time.monotonic()  # before any import of weight

import gc  # noqa: E402
import resource  # noqa: E402
import sys  # noqa: E402
from collections.abc import Sequence  # noqa: E402
from typing import Any  # noqa: E402

from luftpause import logs, tracing  # noqa: E402
from luftpause.runtime import constants  # noqa: E402
from luftpause.runtime.compaction import ForkedCompaction  # noqa: E402
from luftpause.runtime.config import RuntimeSettings, ToolsFileError, parse_settings  # noqa: E402


def main(argv: Sequence[str] | None = None) -> int:
    settings = parse_settings(argv)
    log = logs.configure("runtime")
    _raise_open_files_limit(log)
    # (A database journal is compacted in the runtime's own start: no file to hand a child.)
    forked = None if settings.journal_url else ForkedCompaction.begin(settings.state_dir / constants.JOURNAL_FILE)
    try:
        return _serve(settings, log, forked)
    finally:
        if forked is not None:
            forked.abandon()  # (done by now unless the runtime exits before replaying)


def _raise_open_files_limit(log: Any) -> None:
    """Each tool call in flight holds a connection, each client session another: a runtime
    with thousands of paused runs needs more files open than the usual soft limit of 1,024,
    so it takes what the hard limit allows (as Go programs do at start)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    wanted = hard if hard != resource.RLIM_INFINITY else max(soft, constants.OPEN_FILES_WANTED)
    if soft != resource.RLIM_INFINITY and soft < wanted:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (wanted, hard))
        except (ValueError, OSError) as exc:
            log.warning("open_files_limit_kept", soft=soft, hard=hard, error=str(exc))
            return
        log.info("open_files_limit_raised", soft=soft, to=wanted)


def _serve(settings: RuntimeSettings, log: Any, forked: ForkedCompaction | None) -> int:
    # The heavy imports, here rather than at the top so that they run while the forked
    # child compacts the journal.
    import uvicorn

    from luftpause.runtime.app import build_app
    from luftpause.runtime.http_protocol import JsonErrorsH11Protocol

    imported = time.monotonic()
    # What the imports made lives as long as the process: the cyclic collector need not
    # walk it again each time the replay's allocations trigger it.
    gc.freeze()
    tracing.configure("runtime")  # (after the fork: an exporting tracer runs a thread)
    from luftpause.runtime.pg_schema import DatabaseUnavailable, SchemaTooNew

    try:
        app = build_app(settings, forked_compaction=forked, process_started=STARTED)
    except ToolsFileError as exc:
        log.error("tools_file_invalid", error=str(exc))
        return 2
    except (DatabaseUnavailable, SchemaTooNew) as exc:
        log.error("journal_database_unusable", error=str(exc))
        return 2
    log.info(
        "runtime_starting",
        host=settings.host,
        port=settings.port,
        dataplane=settings.dataplane_url,
        tools_file=str(settings.tools_file),
        state_dir=str(settings.state_dir),
        journal="postgresql" if settings.journal_url else "files",
        auth=bool(settings.token),
        imports_seconds=round(imported - STARTED, 3),
        compaction_forked=forked is not None,
    )
    config = uvicorn.Config(
        app,
        host=settings.host,
        port=settings.port,
        http=JsonErrorsH11Protocol,  # a request h11 cannot read is answered in JSON (431 / 400)
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

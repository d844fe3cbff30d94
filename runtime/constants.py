"""The runtime's numbers, each with the reason it has that value."""

from __future__ import annotations

# Reply length per turn. SGLang reserves memory for the longest reply a request may
# produce; unbounded replies batched 7x fewer requests in the original. 0 = engine default.
DEFAULT_MAX_TOKENS = 256

# The largest values `spawn` accepts (each also stated in the tool's input schema). They
# are far above any sensible run, and keep absurd numbers (10**20 tokens, 1e308 s)
# from reaching engines, timers and reports.
MAX_TOOL_CALLS_LIMIT = 10_000
MAX_TOKENS_LIMIT = 1_000_000  # per turn; larger than any engine's context today
MAX_BUDGET_TOKENS = 10**12
MAX_BUDGET_TOOL_CALLS = 10**6
MAX_BUDGET_SECONDS = 30 * 24 * 3600.0  # 30 days
# Handles named in one `await`/`cancel`/`status` call.
MAX_HANDLES = 1_000

# Per-client limits. Runs not yet finished per caller (MCP session, x-luftpause-caller or
# client name): far above a real fan-out, low enough that one client cannot fill the
# runtime's memory and the pool's queue. Open MCP sessions: at the limit a session idle
# for SESSION_EVICT_IDLE_S or more makes room for a new one, else the newcomer gets 503
# (runtime/sessions.py); a session idle SESSION_IDLE_S is closed, so abandoned ones free up.
MAX_RUNS_PER_CALLER = 1_000
MAX_SESSIONS = 1_000
SESSION_IDLE_S = 600.0
SESSION_EVICT_IDLE_S = 60.0

# Tool calls per run. Once spent the model must answer (the tools stay listed, with
# tool_choice "none"), which also caps a run at DEFAULT_MAX_TOOL_CALLS + 1 turns.
DEFAULT_MAX_TOOL_CALLS = 8

# `await` waits at most this long by default: within MCP clients' own per-request
# limit (Claude Code over HTTP: 60 s).
DEFAULT_AWAIT_TIMEOUT_S = 60.0
MAX_AWAIT_TIMEOUT_S = 600.0

# One turn through the dataplane, queueing included (same as the OpenAI/Anthropic
# clients' default).
TURN_TIMEOUT_S = 600.0
# Connections to the dataplane: turns in flight at once (httpx's default limit; more wait
# for one), every one kept alive between turns (runtime/aiohttp_transport.py's KEEPALIVE_S).
DATAPLANE_MAX_CONNECTIONS = 100

# Rate-limited turns (429) wait `Retry-After`, else this, and retry until cancelled.
DEFAULT_RETRY_AFTER_S = 1.0

# A dataplane that refuses connections (restarting) is retried this long before the
# run fails, so a proxy restart does not kill every sub-agent.
DATAPLANE_CONNECT_GRACE_S = 30.0
DATAPLANE_CONNECT_RETRY_S = 1.0

# A turn that failed because its engine could not be reached or died before answering
# (the dataplane's 502 marked x-luftpause-engine-failure), or whose connection closed
# before the answer (dataplane or engine restarting), is sent again: the run is idle
# then, so the turn may go to a healthy replica, and a turn has no side effects. At most
# TURN_RETRY_ATTEMPTS sends in all, TURN_RETRY_BACKOFF_S apart (doubling up to
# TURN_RETRY_BACKOFF_MAX_S), none later than TURN_RETRY_WINDOW_S after the first failure.
TURN_RETRY_ATTEMPTS = 5
TURN_RETRY_BACKOFF_S = 0.25
TURN_RETRY_BACKOFF_MAX_S = 4.0
TURN_RETRY_WINDOW_S = 30.0

# Telling the dataplane a run ended is best effort; it must not hold a run open.
RUN_END_NOTICE_TIMEOUT_S = 5.0
# At start the journal's database (--journal postgresql://...) must answer within this
# long, else the runtime exits naming it (a supervisor starts it again).
JOURNAL_DATABASE_WAIT_S = 5.0
# Runtimes sharing a journal database hold each unfinished run under a lease this long,
# renewed every third of it; the runs of one that died are adopted after it (fleet.py).
LEASE_S = 5.0
# A spawn without a parent asks the dataplane which harness run handed out its task (the
# run tree starts at the harness); a dataplane that does not answer by then costs the link,
# not the spawn.
HARNESS_LOOKUP_TIMEOUT_S = 1.0

# Upstream MCP tool servers: one tool call may be slow (deep_search, Wikipedia with
# retries), but not forever. Counted from when the call has a connection to go out on.
UPSTREAM_CALL_TIMEOUT_S = 300.0
# HTTP upstream servers: each tool call in flight holds one connection (the answer comes
# on it), so idle runs waiting on a slow tool need as many; calls beyond the limit queue
# for one. A server's `max_connections` in the tools file replaces it (up to the maximum).
UPSTREAM_MAX_CONNECTIONS = 1024
UPSTREAM_MAX_CONNECTIONS_LIMIT = 65536
# Connections beyond the tool calls' for the MCP session's own requests (initialize, tools
# listing, its event stream), so calls holding every slot never starve them.
UPSTREAM_SESSION_CONNECTIONS = 4
# Files the runtime asks to keep open when the hard limit is unlimited (else: the hard limit).
OPEN_FILES_WANTED = 65536
UPSTREAM_CONNECT_TIMEOUT_S = 30.0
# How long start-up waits for upstream servers before serving without them (they keep
# reconnecting in the background).
UPSTREAM_CONNECT_WAIT_S = 10.0
# Back-off between reconnect attempts to an upstream server (doubling up to the max).
UPSTREAM_RECONNECT_MIN_S = 0.5
UPSTREAM_RECONNECT_MAX_S = 10.0

# How long `cancel` waits for cancelled runs to wind down before answering.
CANCEL_WAIT_S = 5.0

# uvicorn stops waiting for open requests (e.g. a long `await`) after this on shutdown.
GRACEFUL_SHUTDOWN_S = 5.0

# Caller name when the MCP request carries no session (2026-07-28 sessionless clients).
SESSIONLESS_CALLER = "mcp"

JOURNAL_FILE = "runs.jsonl"
# A round or outcome that cannot be journaled is written again this often until it is
# (the run waits, Running, and /health answers 503 meanwhile): reporting the run
# Failed would be contradicted by a restart, which resumes it from the journal.
JOURNAL_RETRY_S = 1.0

# Retention of finished runs: a finished run tree stays (answers `await`, shows in
# `status`, survives restarts) for this long after its last run finished, and at most
# this many finished runs stay, newest first. Compaction applies both.
RETENTION_S = 24 * 3600.0
RETENTION_RUNS = 10_000
# The journal is compacted on start, and while serving when it passes this size and
# twice its size after the last compaction (~3.4 KB a run: some 20,000 runs).
COMPACT_AT_BYTES = 64 * 1024 * 1024

# `status` without handles pages: live runs first, then finished ones, newest first.
STATUS_PAGE_DEFAULT = 100
STATUS_PAGE_MAX = 1000
# `GET /status` pages the same way and cuts each run's task to this many characters
# (`GET /status?handle=<run>` gives the whole text).
STATUS_TASK_PREVIEW_CHARS = 200

# Defaults of the command line, each overridable by the environment variable beside it.
DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 7000
DEFAULT_DATAPLANE_URL = "http://127.0.0.1:8080"
DEFAULT_TOOLS_FILE = "config/tools.yaml"
DEFAULT_STATE_DIR = "state"

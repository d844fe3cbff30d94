"""HTTP header names that carry run identity between agents, runtime and dataplane."""

RUN_ID = "x-luftpause-run-id"
SERVICE_CLASS = "x-luftpause-class"
CALLER = "x-luftpause-caller"

SERVICE_CLASSES = ("interactive", "batch")
DEFAULT_SERVICE_CLASS = "interactive"
ANONYMOUS_CALLER = "anonymous"
MAX_CALLER_BYTES = 128
# Run and turn ids (x-luftpause-run-id, the scheduler's Admit and Resync): far above a
# UUID, far below what would let one client grow the scheduler's state without bound.
MAX_ID_BYTES = 256
REPLICA = "x-luftpause-replica"  # which replica served the turn (responses only)
# On a dataplane's own 502: the engine could not be reached or died before answering;
# the turn had no effect and may be sent again (responses only).
ENGINE_FAILURE = "x-luftpause-engine-failure"

# Headers an agent harness sends with every request of one session, the same across its
# turns (and when the session is resumed): each names the run of a Messages or Responses
# turn that has no x-luftpause-run-id. Checked in this order; the first one present counts.
SESSION_HEADERS = (
    "x-claude-code-session-id",  # Claude Code
    "session-id",                # Codex CLI (its thread-id header carries the same value)
)


class BadIdentity(ValueError):
    """A run-identity header to refuse with a 400; the message names the header and why."""


def identity_text(value: str | None, name: str, limit: int) -> str:
    """A run-identity header's value as text: UTF-8 (aiohttp keeps other bytes as
    surrogates, which no gRPC string can carry) and at most ``limit`` bytes."""
    value = (value or "").strip()
    try:
        size = len(value.encode())
    except UnicodeEncodeError:
        raise BadIdentity(f"{name} must be UTF-8 text") from None
    if size > limit:
        raise BadIdentity(f"{name} must be at most {limit} bytes")
    return value


def service_class(value: str | None) -> str:
    """The x-luftpause-class value, lower-cased; the default when the header is absent."""
    chosen = (DEFAULT_SERVICE_CLASS if value is None else value).strip().lower()
    if chosen not in SERVICE_CLASSES:
        raise BadIdentity(f"{SERVICE_CLASS} must be one of: {', '.join(SERVICE_CLASSES)}")
    return chosen

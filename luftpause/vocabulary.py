"""The words every luftpause service shares: service classes, the HTTP header and gRPC
metadata names that carry run identity, the reasons a turn is refused at admission
(with the gRPC code and HTTP status each one travels as) and the timeouts more than one
service counts with. Defined here once; the scheduler, the dataplane and the runtime
import them. This module imports nothing but the standard library (the runtime starts
without grpc)."""

from __future__ import annotations

from enum import StrEnum
from typing import NamedTuple

from luftpause.errors import LuftpauseError

# ------------------------------------------------------------------- service classes
# interactive: someone waits for the turn (served first); batch: background work.
INTERACTIVE = "interactive"
BATCH = "batch"
SERVICE_CLASSES = (INTERACTIVE, BATCH)
DEFAULT_SERVICE_CLASS = INTERACTIVE

# -------------------------------------------------------------------- HTTP headers
RUN_ID = "x-luftpause-run-id"
SERVICE_CLASS = "x-luftpause-class"
CALLER = "x-luftpause-caller"
REPLICA = "x-luftpause-replica"  # which replica served the turn (responses only)
# On a dataplane's own 502 or 503, why (responses only): ENGINE_UNREACHABLE (502), the
# engine could not be reached or died before answering, the turn had no effect and may
# be sent again; ENGINE_REPEATED (502), the request stalled or dropped two replicas and
# is not sent again for a while (a possible query of death): sending it again gets the
# same answer; ENGINE_NONE_IN_ROTATION (503, with Retry-After), no replica of the model
# was in rotation: send it again after Retry-After.
ENGINE_FAILURE = "x-luftpause-engine-failure"
ENGINE_UNREACHABLE = "unreachable"
ENGINE_REPEATED = "repeated"
ENGINE_NONE_IN_ROTATION = "none-in-rotation"

# Headers an agent harness sends with every request of one session, the same across its
# turns (and when the session is resumed): each names the run of a turn that has no
# x-luftpause-run-id, on every API (chat completions, Messages, Responses). Checked in
# this order; the first one sent with a value counts. docs/harness-apis.md lists which
# client sends which, and how that was verified.
SESSION_HEADERS = (
    "x-claude-code-session-id",  # Claude Code
    "session-id",                # Codex CLI (its thread-id header carries the same value)
    "x-session-id",              # opencode (and vllm-router's sticky-session key)
    "x-session-affinity",        # opencode (the same value as its x-session-id)
    "agent-session-id",          # Goose
    "session_id",                # Roo Code's OpenAI provider (the task id, on /v1/responses)
)

ANONYMOUS_CALLER = "anonymous"
MAX_CALLER_BYTES = 128
# Run and turn ids (x-luftpause-run-id, the scheduler's Admit and Resync): far above a
# UUID, far below what would let one client grow the scheduler's state without bound.
MAX_ID_BYTES = 256

# How a standby scheduler's refusal (FAILED_PRECONDITION) begins: another scheduler leads,
# and a dataplane given several scheduler addresses goes on to the next.
SCHEDULER_STANDBY = "standby scheduler"

# ------------------------------------------------------------------- gRPC metadata
# A dataplane's id on its calls to the scheduler (the Resync snapshot's dataplane_id).
DATAPLANE_METADATA = "x-luftpause-dataplane"

# ------------------------------------------------------------------ shared timeouts
# A run with no turn for this long is forgotten: the scheduler drops its affinity (its
# next turn is placed afresh), the dataplane drops it from its run book and Resync.
RUN_IDLE_TIMEOUT_S = 30 * 60


# ----------------------------------------------------------------- reject reasons


class RejectReason(StrEnum):
    """Why the scheduler refuses a turn at admission (the core's ``Reject.reason``)."""

    UNKNOWN_MODEL = "unknown_model"  # no replica of the turn's kind serves its model
    INVALID = "invalid"  # the admission is malformed (ids, class, caller)
    # A one-pass call whose replicas are all unhealthy, or a turn held past a bound while no
    # replica of its model was in rotation.
    NO_HEALTHY_REPLICA = "no_healthy_replica"
    SATURATED = "saturated"  # a sheddable (batch) turn shed: too many batch turns held already


class RejectCodes(NamedTuple):
    grpc: str  # the unary Admit's status code (a grpc.StatusCode name)
    refusal: str  # the Connect stream's Refusal.reason (a RefusalReason name in the proto)
    http: int  # the status the client gets from the dataplane or the picker
    retry_after_s: int = 0  # the Retry-After sent with it (seconds; 0: none)


# Each reason as it crosses the gRPC contract and reaches the HTTP client.
REJECT_CODES: dict[RejectReason, RejectCodes] = {
    RejectReason.UNKNOWN_MODEL: RejectCodes("NOT_FOUND", "UNKNOWN_MODEL", 404),
    RejectReason.INVALID: RejectCodes("INVALID_ARGUMENT", "MALFORMED", 400),
    # Not UNAVAILABLE: that code means "the scheduler is away" and callers retry it.
    # Retry-After: a replica comes back at a probe (the scheduler probes every 2 s).
    RejectReason.NO_HEALTHY_REPLICA: RejectCodes("FAILED_PRECONDITION", "NO_HEALTHY_REPLICA", 503, 2),
    # Retry-After: the MCP runtime and the openai SDK wait this long and send it again.
    RejectReason.SATURATED: RejectCodes("RESOURCE_EXHAUSTED", "SATURATED", 429, 1),
}


# ------------------------------------------------------------- run-identity values


class BadIdentity(LuftpauseError, ValueError):
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

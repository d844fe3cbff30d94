"""What luftpause tells an engine about a turn's run, in the engine's own request fields,
for the engines started with the features that read them (docs/engine-hints.md).

An engine schedules each request on its own; only luftpause knows which request is an
agent coming back from a tool call, which is a person's first turn and which is batch
work, and when a run is over. Three engine features take that knowledge:

- **Priority** (a request's top-level ``priority``): vLLM's ``--scheduling-policy
  priority`` runs *lower* values first and preempts the lowest-priority running request
  when KV runs out; SGLang's ``--enable-priority-scheduling`` runs *higher* values first
  (lower first with ``--schedule-low-priority-values-first``) and may preempt a running
  request for a waiting one of higher priority. luftpause sends a turn's urgency in the
  engine's direction: a run resuming from a tool call above an interactive turn that
  starts from the user above batch (:func:`urgency`); batch goes at 0, what both engines
  give a request that names none.
- **Sessions** (SGLang's ``--enable-session-radix-cache``): a request's top-level
  ``session_id`` tags its KV with the session, which the cache keeps ahead of unreferenced
  KV until ``POST /close_session`` releases it. luftpause sends the run's id on every
  interactive turn and closes the session on each replica the run used when the run ends
  (a run-end notice, its harness session over, the idle timeout):
  scheduler/engine_sessions.py. Batch turns name no session (a client's own is dropped):
  their KV stays unreferenced, so when live contexts outgrow the pool the engine evicts
  batch prefixes before those of agents a person is waiting on (named all alike, every
  open session would be kept alike and the eviction order would be plain LRU again).
- **Dynamo's agent hints** (an NVIDIA Dynamo frontend): ``nvext.agent_hints.priority``,
  higher first, read by Dynamo's router queue and passed on to engines started with
  priority scheduling. luftpause puts the same urgency there (pool ``priority: dynamo``),
  keeping whatever else the client put in ``nvext``.
- **Slots** (llama.cpp's ``llama-server``, ``--parallel N``): a request's ``id_slot`` runs
  it in that slot (deferred while the slot is busy), and with ``cache_prompt`` the slot's
  KV of the longest common prefix is reused. The scheduler gives each run a slot on each
  replica it uses and keeps it there (scheduler/engine_slots.py); the turn carries it as
  ``id_slot``, with ``cache_prompt: true``.

An engine whose pool entry (or server info) names none of them gets every request byte
for byte as the client's turn was; one that names them gets these fields set by
luftpause, over whatever a client put there (a client does not choose its own priority).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import orjson

from luftpause.errors import LuftpauseError
from luftpause.vocabulary import BATCH

LOWER_FIRST = "lower-first"
HIGHER_FIRST = "higher-first"
DYNAMO = "dynamo"  # a Dynamo frontend: higher first, in the body's nvext.agent_hints.priority
PRIORITY_ORDERS = (LOWER_FIRST, HIGHER_FIRST, DYNAMO)

# A turn's urgency, highest first: what the engine's priority carries.
RESUMING = 2  # an interactive run coming back from a tool call: it held KV and a person waits
FRESH = 1  # an interactive turn from the user
BACKGROUND = 0  # batch

HINT_NAMES = ("priority", "sessions", "slots")  # a pool entry's hints
MAX_SLOTS = 4096  # more slots than any engine runs: a typo, not a --parallel


class HintsError(LuftpauseError, ValueError):
    """A pool entry's ``hints`` is malformed."""


@dataclass(frozen=True)
class EngineHints:
    """What one replica's engine reads of a turn: ``priority`` in which order ("" = it
    does not read one), whether it keeps KV by ``session_id``, and how many slots it
    runs a request in by ``id_slot`` (0 = it does not)."""

    priority: str = ""
    sessions: bool = False
    slots: int = 0

    def __bool__(self) -> bool:
        return bool(self.priority or self.sessions or self.slots)

    @classmethod
    def from_pool(cls, value: Any) -> EngineHints:
        """A pool entry's ``hints`` mapping: ``priority`` (lower-first, higher-first or
        none), ``sessions`` (true or false) and ``slots`` (llama.cpp's ``--parallel``; 0 = none)."""
        if not isinstance(value, Mapping):
            raise HintsError("hints must be a mapping with 'priority', 'sessions' and/or 'slots'")
        unknown = set(value) - set(HINT_NAMES)
        if unknown:
            raise HintsError(f"unknown hints {sorted(unknown)}: use 'priority', 'sessions' and 'slots'")
        priority = value.get("priority", "none")
        if priority not in (*PRIORITY_ORDERS, "none"):
            raise HintsError(f"hints.priority must be one of {', '.join(PRIORITY_ORDERS)} or none, not {priority!r}")
        sessions = value.get("sessions", False)
        if not isinstance(sessions, bool):
            raise HintsError(f"hints.sessions must be true or false, not {sessions!r}")
        slots = value.get("slots", 0)
        if isinstance(slots, bool) or not isinstance(slots, int) or not 0 <= slots <= MAX_SLOTS:
            raise HintsError(f"hints.slots must be a whole number from 0 (none) to {MAX_SLOTS}: the engine's "
                             f"--parallel, not {slots!r}")
        return cls("" if priority == "none" else priority, sessions, slots)

    @classmethod
    def from_server_info(cls, info: Mapping[str, Any]) -> EngineHints:
        """What SGLang's ``/get_server_info`` says it was started with (it publishes its
        server arguments there; vLLM publishes none, so its pool entry says)."""
        priority = ""
        if info.get("enable_priority_scheduling") is True:
            priority = LOWER_FIRST if info.get("schedule_low_priority_values_first") is True else HIGHER_FIRST
        return cls(priority, info.get("enable_session_radix_cache") is True)

    @classmethod
    def from_props(cls, props: Mapping[str, Any]) -> EngineHints:
        """What llama.cpp's ``/props`` says: ``total_slots``, its ``--parallel`` (every
        llama-server reads ``id_slot`` and ``cache_prompt``)."""
        slots = props.get("total_slots")
        valid = isinstance(slots, int) and not isinstance(slots, bool) and 0 < slots <= MAX_SLOTS
        return cls(slots=slots if valid else 0)

    def as_fields(self) -> dict[str, Any]:
        """For logs and status."""
        return {"priority": self.priority or "none", "sessions": self.sessions, "slots": self.slots}


NO_HINTS = EngineHints()


def urgency(service_class: str, resuming: bool) -> int:
    """A run coming back from a tool call above a turn from the user above batch."""
    if service_class == BATCH:
        return BACKGROUND
    return RESUMING if resuming else FRESH


def priority_value(order: str, level: int) -> int:
    """The engine's ``priority`` for an urgency: batch at 0 (what an engine gives a
    request that names none), more urgent turns below it (lower-first) or above it."""
    return -level if order == LOWER_FIRST else level


def resumes_from_tool(chat: Mapping[str, Any]) -> bool:
    """Whether a chat-completions turn comes back from a tool call: its last message is a
    tool result (the agent's loop continuing, not a person's new message)."""
    messages = chat.get("messages")
    return isinstance(messages, list) and bool(messages) and isinstance(messages[-1], dict) \
        and messages[-1].get("role") == "tool"


def hinted(body: bytes, hints: EngineHints, level: int, run_id: str,
           document: Mapping[str, Any] | None = None, slot: int | None = None) -> bytes:
    """The chat-completions body with the engine's fields set over the client's (``body``
    itself for an engine that reads none: byte for byte what it would have been).
    ``slot``: the engine slot the scheduler chose for the run (an engine with slots;
    None: none chosen, the engine picks one itself).
    ``document``: the body already parsed, where the caller has it (not changed here);
    else the body is parsed with orjson, about a quarter of a millisecond for a Claude
    Code-sized turn (60-100 KB) on a busy 2-core machine (splicing the fields in front
    cost as much, since the body has to be searched for the client's own)."""
    if not hints:
        return body
    if document is None:
        try:
            document = orjson.loads(body)
        except orjson.JSONDecodeError:  # what the front door took and orjson does not (a lone surrogate)
            document = json.loads(body)
    fields: dict[str, Any] = {}
    if hints.priority == DYNAMO:
        fields["nvext"] = _with_agent_priority(document.get("nvext"), level)
    elif hints.priority:
        fields["priority"] = priority_value(hints.priority, level)
    if hints.sessions and level != BACKGROUND:
        fields["session_id"] = run_id
    elif hints.sessions:
        document = {key: value for key, value in document.items() if key != "session_id"}
    if hints.slots:
        fields["cache_prompt"] = True
        if slot is not None:
            fields["id_slot"] = slot
    document = {**document, **fields}
    try:
        return orjson.dumps(document)
    except TypeError:  # an integer beyond 64 bits, a lone surrogate
        return json.dumps(document, separators=(",", ":")).encode()


def _with_agent_priority(nvext: Any, level: int) -> dict[str, Any]:
    """The client's ``nvext`` (a mapping, else none) with ``agent_hints.priority`` set to
    the turn's urgency (Dynamo runs higher values first); its other hints kept."""
    nvext = dict(nvext) if isinstance(nvext, Mapping) else {}
    agent_hints = nvext.get("agent_hints")
    nvext["agent_hints"] = {**(agent_hints if isinstance(agent_hints, Mapping) else {}), "priority": level}
    return nvext

"""Failure and misbehaviour directives for the fake engine.

Tests ask the fake engine for a behaviour by writing a directive into any user or
system message, e.g. ``"[[fake:status=503]]"``, so no special engine and no luftpause
header is needed; the same directives can be set engine-wide with ``--fault
status=503``. Pure parsing and planning here; the engine applies them.

Directives (``[[fake:NAME]]`` or ``[[fake:NAME=VALUE]]``):

- ``status=CODE``: answer at once with HTTP CODE (and ``Retry-After`` for 429/503).
- ``status-times=CODE:N``: the first N requests with the same first user message get
  CODE; later ones are served normally.
- ``retry-after=S``: the ``Retry-After`` value sent with 429/503 (default 1).
- ``die-after=N``: stream N chunks after the role chunk, then abort the connection;
  non-streaming requests are aborted without a response.
- ``hang``: accept the request and never answer.
- ``wedge``: a query of death: the request hangs and the whole engine with it, as an
  engine whose loop is stuck on one input: no decode step runs any more (the decode gate
  closes) and every later request is accepted and never answered (engine-wide ``hang``),
  probe generations included, while its health route still says ok. It stays so until
  ``PUT /faults {"faults": []}`` and ``PUT /gate {"open": true}`` (a restart, to a real
  engine).
- ``stall-after=N``: stream N chunks after the role chunk, then send nothing more while
  keeping the connection open (a wedged engine mid-stream); non-streaming requests hang.
  ``die-after`` and ``stall-after`` count the reply's chunks from its start: a request
  that continues a final assistant message (``continue_final_message``) of K words
  starts at chunk K, so one past N streams to its end.
- ``metrics-hang`` (engine-wide with ``--fault``): ``/metrics`` accepts and never answers.
- ``linger-after-done=MS``: a stream keeps its response open MS milliseconds after
  ``data: [DONE]`` before ending it (a client may close first, as the openai one does).
- ``tool-call-as-text``: a tool call is written as JSON text in ``content``.
- ``schema-as-arguments``: a tool call's arguments are the tool's parameter schema.
- ``string-scalars``: integer, number and boolean arguments are rendered as strings.
- ``tool=NAME``: when the reply is a tool call, call the offered tool named NAME rather
  than the first one (a harness such as Codex offers its own tools first). Not a fault,
  but read the same way, from the prompt.
- ``parallel-calls=N``: a tool-call reply holds N calls in one message (indexes 0…N-1),
  the offered tools from the chosen one on, as engines emit parallel calls; one when the
  request sets ``parallel_tool_calls: false`` or names its tool in ``tool_choice``. Not a
  fault either; the default, 1, is the engine's behaviour without it.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, replace
from typing import Any

DIRECTIVE = re.compile(r"\[\[fake:([a-z][a-z-]*)(?:=([^\]]*))?\]\]")
RETRY_AFTER_STATUSES = frozenset({429, 503})
DEFAULT_RETRY_AFTER = "1"
_FLAGS = ("hang", "wedge", "metrics-hang", "tool-call-as-text", "schema-as-arguments", "string-scalars")
_VALUED = ("status", "status-times", "retry-after", "die-after", "stall-after", "linger-after-done", "tool",
           "parallel-calls")
KNOWN = frozenset(_FLAGS + _VALUED)


class FaultError(ValueError):
    """A directive that is not understood (unknown name or malformed value)."""


@dataclass(frozen=True)
class Faults:
    """What a request asks the engine to do wrong; the default asks for nothing."""

    status: int | None = None
    status_times: tuple[int, int] | None = None  # (code, first N requests)
    retry_after: str = DEFAULT_RETRY_AFTER
    die_after: int | None = None
    stall_after: int | None = None
    linger_after_done_ms: int = 0
    hang: bool = False
    wedge: bool = False
    metrics_hang: bool = False
    tool_call_as_text: bool = False
    schema_as_arguments: bool = False
    string_scalars: bool = False
    tool: str | None = None  # the offered tool to call, by name
    parallel_calls: int = 1  # tool calls in one tool-call message

    def merged(self, other: Faults) -> Faults:
        """``other``'s directives on top of ours (a request's over the engine's)."""
        changes = {
            name: value
            for name, value in vars(other).items()
            if value != getattr(Faults(), name)
        }
        return replace(self, **changes)

    def error_headers(self, status: int) -> dict[str, str]:
        return {"Retry-After": self.retry_after} if status in RETRY_AFTER_STATUSES else {}


def _positive_int(name: str, value: str, minimum: int = 0) -> int:
    try:
        number = int(value)
    except ValueError:
        raise FaultError(f"[[fake:{name}]] needs an integer, got {value!r}") from None
    if number < minimum:
        raise FaultError(f"[[fake:{name}]] must be at least {minimum}, got {number}")
    return number


def _status_code(name: str, value: str) -> int:
    code = _positive_int(name, value, 100)
    if code > 599:
        raise FaultError(f"[[fake:{name}]] needs an HTTP status, got {code}")
    return code


def _status_times(name: str, value: str) -> tuple[int, int]:
    """``status-times=CODE:N``'s value as (CODE, N)."""
    code, sep, times = value.partition(":")
    if not sep:
        raise FaultError(f"[[fake:status-times=CODE:N]] expected, got {value!r}")
    return _status_code(name, code), _positive_int(name, times)


# Each directive that takes a value (one entry per name in _VALUED): the Faults field it
# sets, and how its value is read, from (directive name, value text).
_VALUE_READERS: dict[str, tuple[str, Callable[[str, str], Any]]] = {
    "status": ("status", _status_code),
    "status-times": ("status_times", _status_times),
    "retry-after": ("retry_after", lambda name, value: str(_positive_int(name, value))),
    "die-after": ("die_after", _positive_int),
    "stall-after": ("stall_after", _positive_int),
    "linger-after-done": ("linger_after_done_ms", _positive_int),
    "tool": ("tool", lambda name, value: value),
    "parallel-calls": ("parallel_calls", lambda name, value: _positive_int(name, value, 1)),
}


def parse(directives: Iterable[tuple[str, str | None]]) -> Faults:
    """``(name, value)`` pairs to :class:`Faults`; later directives win."""
    fields: dict[str, Any] = {}
    for name, value in directives:
        if name not in KNOWN:
            raise FaultError(f"unknown fake directive {name!r} (known: {', '.join(sorted(KNOWN))})")
        if name in _FLAGS:
            fields[name.replace("-", "_")] = True
            continue
        if value is None or value == "":
            raise FaultError(f"[[fake:{name}=...]] needs a value")
        field, read = _VALUE_READERS[name]
        fields[field] = read(name, value)
    return Faults(**fields)


def parse_option(option: str) -> tuple[str, str | None]:
    """One ``--fault`` value (``status=503``, ``hang``, ``[[fake:hang]]``) as a pair."""
    match = DIRECTIVE.fullmatch(option.strip())
    if match:
        return match.group(1), match.group(2)
    name, sep, value = option.strip().partition("=")
    return name, (value if sep else None)


def _text(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return " ".join(str(p.get("text", "")) for p in content if isinstance(p, dict))
    return ""


def directives_in(messages: Iterable[Mapping[str, Any]]) -> list[tuple[str, str | None]]:
    """Every directive in user and system messages, in conversation order.

    Tool results and assistant turns are not read: a directive must come from whoever
    writes the prompt, not echo back through a tool.
    """
    found: list[tuple[str, str | None]] = []
    for message in messages:
        if message.get("role") in ("user", "system", "developer"):
            found.extend((m.group(1), m.group(2)) for m in DIRECTIVE.finditer(_text(message.get("content"))))
    return found


def from_messages(messages: Iterable[Mapping[str, Any]]) -> Faults:
    return parse(directives_in(messages))


def strip(text: str) -> str:
    """``text`` without directives (so replies do not echo them into tool arguments)."""
    return " ".join(DIRECTIVE.sub(" ", text).split())


def first_user_text(messages: Iterable[Mapping[str, Any]]) -> str:
    for message in messages:
        if message.get("role") == "user":
            return _text(message.get("content"))
    return ""


class StatusCounter:
    """How often each first-user-message text was answered with a ``status-times`` code."""

    def __init__(self) -> None:
        self._served: dict[str, int] = {}

    def should_fail(self, key: str, times: int) -> bool:
        """True for the first ``times`` calls with this ``key``, False afterwards."""
        served = self._served.get(key, 0)
        if served >= times:
            return False
        self._served[key] = served + 1
        return True


def error_status(faults: Faults, messages: list[Mapping[str, Any]], counter: StatusCounter) -> int | None:
    """The HTTP status this request must fail with, if any (``status`` wins)."""
    if faults.status is not None:
        return faults.status
    if faults.status_times is not None:
        code, times = faults.status_times
        if counter.should_fail(first_user_text(messages), times):
            return code
    return None


def error_body(status: int) -> dict[str, Any]:
    return {"error": {"message": f"fake status {status}"}}


# --- tool-call shapes ------------------------------------------------------------------


def stringify_scalars(value: Any) -> Any:
    """Integers, numbers and booleans as strings (``"3"``, ``"true"``), recursively."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return str(value)
    if isinstance(value, dict):
        return {k: stringify_scalars(v) for k, v in value.items()}
    if isinstance(value, list):
        return [stringify_scalars(v) for v in value]
    return value

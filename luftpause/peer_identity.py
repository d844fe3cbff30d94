"""Run identity in the shape an agent-aware peer router reads, for turns sent straight to
that router instead of through luftpause (the benchmarks' peer rows, and a runtime whose
turns go to such a router).

Styles, each the field the router's own source reads (vllm-router 0.1.17):
- ``session``: the ``x-session-id`` header — the sticky session key of its
  ``sticky_least_loaded`` policy and of ``kv_aware``'s session affinity (its source reads the
  header first, then ``session_params.session_id`` in the body; through its HTTP router
  0.1.17 only the header took effect, so both are sent);
  A finished run's session is ended with :func:`finish_path`;
- ``program``: ``vllm_xargs.agentic_context`` in the body — the canonical identity its
  program scheduling (``--enable-program-scheduling``) opts requests in with: the run is
  one program (``program_id`` = ``task_id`` = ``session_id`` = the run), ``expected_resume``
  says whether this turn is followed by another (tools offered and not ``tool_choice``
  none), and interactive runs carry a higher ``priority`` (it orders resumes);
- ``none``: nothing (class-blind routers).
"""

from __future__ import annotations

from typing import Any
from urllib.parse import quote

from luftpause.vocabulary import INTERACTIVE

STYLES = ("none", "session", "program")
INTERACTIVE_PRIORITY = 10  # vllm-router resumes larger priorities first; batch runs stay at 0


def expects_resume(body: dict[str, Any]) -> bool:
    """Whether the agent will come back after this turn: it offers tools it may call."""
    return bool(body.get("tools")) and body.get("tool_choice") != "none"


SESSION_HEADER = "x-session-id"


def add_identity(body: dict[str, Any], style: str, run_id: str, service_class: str
                 ) -> tuple[dict[str, Any], dict[str, str]]:
    """``body`` with the run's identity in ``style`` (a new dict; ``body`` is not changed),
    and the headers to send with it."""
    if style not in STYLES:
        raise ValueError(f"peer identity style must be one of {STYLES}, not {style!r}")
    if style == "session":
        return {**body, "session_params": {"session_id": run_id}}, {SESSION_HEADER: run_id}
    if style == "program":
        context = {"program_id": run_id, "task_id": run_id, "session_id": run_id, "agent_id": "lead",
                   "agent_role": "lead", "expected_resume": expects_resume(body),
                   "priority": INTERACTIVE_PRIORITY if service_class == INTERACTIVE else 0}
        xargs = dict(body.get("vllm_xargs") or {})
        xargs["agentic_context"] = context
        return {**body, "vllm_xargs": xargs}, {}
    return body, {}


def finish_path(style: str, run_id: str) -> str | None:
    """The router path that ends a finished run's session, if the style has one: vllm-router's
    ``POST /finish_session?session_id=…`` frees the run's place in ``sticky_least_loaded``'s
    count of active sessions per replica (else it stays counted until a two-hour expiry)."""
    return f"/finish_session?session_id={quote(run_id, safe='')}" if style == "session" else None

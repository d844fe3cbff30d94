"""What both front doors, the dataplane and the endpoint picker (picker/), check and
answer alike: a request refused (ApiError), a turn's JSON body checked, the tool_call ids
it returns, a one-pass call's inputs and its admission; and what they answer themselves,
without an engine: health and readiness (up = the Connect stream to the scheduler is
up, so turns can be admitted) and the pool's model list."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from aiohttp import web

from luftpause import vocabulary as h
from luftpause.link import AdmitRefused, Placement, SchedulerLink
from luftpause.proto import scheduler_pb2 as pb
from luftpause.runbook import new_id
from luftpause.errors import LuftpauseError


class ApiError(LuftpauseError):
    """A request the front door answers with an error: ``status`` and a message for the client.
    ``kind`` is the error's type where the client API names one (e.g. ``invalid_request_error``);
    ``headers`` go with the answer (a ``Retry-After``)."""

    def __init__(self, status: int, message: str, kind: str = "", headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.kind = kind
        self.headers = headers


# ---------------------------------------------------------------- a turn's body


def json_document(body: bytes) -> tuple[dict, str]:
    """The body's JSON object and its model, or a 400."""
    try:
        document = json.loads(body)
    except (ValueError, UnicodeDecodeError) as exc:
        raise ApiError(400, f"request body is not valid JSON: {exc}") from None
    except RecursionError:
        raise ApiError(400, "request body is not valid JSON: nested too deep") from None
    if not isinstance(document, dict):
        raise ApiError(400, "request body must be a JSON object")
    model = document.get("model")
    if not isinstance(model, str) or not model:
        raise ApiError(400, "'model' is required and must be a non-empty string")
    return document, model


# The roles of openai's ChatCompletionMessageParam (developer, system, user, assistant,
# tool, and the deprecated function), and ipython, which vLLM takes for Llama 3's tool
# results (its chat templates render it).
CHAT_ROLES = frozenset({"developer", "system", "user", "assistant", "tool", "function", "ipython"})


def check_chat(document: dict) -> None:
    """A 400 unless a chat completion's ``messages`` is a list of messages, each an object
    with one of ``ChatCompletionMessageParam``'s roles and a content that is text, a list
    of parts or null, and ``stream`` a boolean. The rest of the body is the engine's to
    judge (engines take settings of their own beyond OpenAI's)."""
    messages = document.get("messages")
    if not isinstance(messages, list):
        raise ApiError(400, "'messages' is required and must be a list")
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise ApiError(400, f"messages[{i}] must be an object")
        role = message.get("role")
        if not isinstance(role, str) or role not in CHAT_ROLES:
            raise ApiError(400, f"messages[{i}].role must be one of {', '.join(sorted(CHAT_ROLES))}")
        content = message.get("content")
        if content is not None and not isinstance(content, str | list):
            raise ApiError(400, f"messages[{i}].content must be a string, a list of content parts or null")
    if not isinstance(document.get("stream", False), bool):
        raise ApiError(400, "'stream' must be a boolean")


def returned_tool_call_ids(document: dict) -> list[str]:
    """The ids of the tool results the request returns (its ``tool`` messages)."""
    messages = document.get("messages")
    if not isinstance(messages, list):
        return []
    return [
        m["tool_call_id"]
        for m in messages
        if isinstance(m, dict) and m.get("role") == "tool" and isinstance(m.get("tool_call_id"), str)
    ]


# -------------------------------------------------------------- one-pass calls


def check_inputs(document: dict) -> None:
    """A 400 unless the call's ``input`` is a string or a non-empty list of strings."""
    inputs = document.get("input")
    if not (isinstance(inputs, str) and inputs) and not (
        isinstance(inputs, list) and inputs and all(isinstance(i, str) for i in inputs)
    ):
        raise ApiError(400, "'input' is required: a string or a non-empty list of strings")


async def admit_one_pass(link: SchedulerLink, model: str, caller: str) -> Placement:
    """A one-pass replica for the call, or its refusal as an ApiError: 404 for a model no
    replica serves, 400 for one the scheduler rejects, 503 when none is healthy."""
    try:
        return await link.admit(new_id(), "", model, h.DEFAULT_SERVICE_CLASS, caller, one_pass=True)
    except AdmitRefused as exc:
        raise ApiError(exc.status, str(exc), headers=exc.headers) from None


# ------------------------------------------------------ answered without an engine

# ``?kind=`` of the model list: which replica kinds' models it names.
MODEL_KINDS = {"generative": ("generative",), "one-pass": ("one-pass",), "all": ("generative", "one-pass")}


def health_body(synced: bool) -> dict[str, str]:
    return {"status": "ok", "scheduler": "connected" if synced else "away"}


def readiness(synced: bool) -> tuple[int, dict[str, Any]]:
    """The ready probe's status code and body."""
    return (200 if synced else 503), {"status": "ready" if synced else "not ready",
                                      "problems": [] if synced else ["scheduler stream down"]}


def probe_routes(synced: Callable[[], bool]) -> list[web.RouteDef]:
    """``GET /health`` (the process answers; is the scheduler stream up) and ``GET /ready``."""

    async def health(request: web.Request) -> web.Response:
        return web.json_response(health_body(synced()))

    async def ready(request: web.Request) -> web.Response:
        status, body = readiness(synced())
        return web.json_response(body, status=status)

    return [web.get("/health", health), web.get("/ready", ready)]


def model_list(status: pb.StatusReply, kinds: tuple[str, ...]) -> dict[str, Any]:
    """The OpenAI model list of the pool's models served by replicas of ``kinds``."""
    models = sorted({m for r in status.replicas if r.kind in kinds for m in r.models})
    return {"object": "list", "data": [{"id": m, "object": "model", "owned_by": "luftpause"} for m in models]}

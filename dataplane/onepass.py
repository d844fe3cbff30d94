"""One-pass calls (``POST /v1/decide``, vLLM's /classify format): sent to a one-pass
(classifier) replica outside run state; such a call takes no generative slot and never
waits. The admission and its refusals are shared with the endpoint picker."""

from __future__ import annotations

import asyncio

import aiohttp
from aiohttp import web

from luftpause import vocabulary as h
from luftpause.dataplane.context import ENGINES, LINK, new_id
from luftpause.dataplane.dialects import ApiError
from luftpause.dataplane.link import AdmitRefused, Placement, SchedulerLink
from luftpause.dataplane.proxy import engine_error, engine_headers, passed_headers
from luftpause.dataplane.requests import json_request, turn_identity


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


async def decide(request: web.Request) -> web.Response:
    """A one-pass call in vLLM's /classify format, sent to a one-pass (classifier)
    replica outside run state: it takes no generative slot and never waits."""
    body, document, model = await json_request(request)
    check_inputs(document)
    _, caller = turn_identity(request)
    placement = await admit_one_pass(request.app[LINK], model, caller)
    headers = engine_headers(placement, request)
    try:
        async with await request.app[ENGINES].post(placement.base_url, "/classify", body, headers) as upstream:
            reply = await upstream.read()
            passed = passed_headers(upstream)
            return web.Response(status=upstream.status, body=reply, headers={**passed, h.REPLICA: placement.replica})
    except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as exc:
        raise ApiError(502, engine_error(placement.replica, exc)) from None

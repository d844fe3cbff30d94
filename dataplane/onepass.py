"""One-pass calls (``POST /v1/decide``, vLLM's /classify format): sent to a one-pass
(classifier) replica outside run state; such a call takes no generative slot and never
waits. The admission and its refusals are shared with the endpoint picker
(luftpause/frontdoor.py)."""

from __future__ import annotations

import asyncio

import aiohttp
from aiohttp import web

from luftpause import vocabulary as h
from luftpause.dataplane.context import ENGINES, LINK
from luftpause.dataplane.proxy import engine_error, engine_headers, passed_headers
from luftpause.dataplane.requests import json_request, turn_identity
from luftpause.frontdoor import ApiError, admit_one_pass, check_inputs


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

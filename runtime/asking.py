"""Asking the human about pending approvals through the MCP client that waits for the runs.

A client that declared elicitation and whose `await` or `run` covers a run with a
pending approval gets a form with one boolean ``allow``:

- in a session (handshake era) as an elicitation request sent while the call waits,
  one at a time, each pending approval once per call;
- in a sessionless 2026-07-28 request, whose server cannot send requests, as an
  input-required result: the call returns the questions at once, and the client
  retries it with the answers (and the echoed request state, which remembers what
  this call already asked and, for `run`, which run it started).

Accept with ``allow: true`` runs the call; ``allow: false`` or decline refuses it; a
dismissed form (cancel) leaves it pending for `approve` or a later call.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Sequence
from typing import Any

import structlog
from mcp.server.elicitation import AcceptedElicitation, DeclinedElicitation, render_elicitation_schema
from mcp.server.mcpserver import Context
from mcp_types import ElicitRequest, ElicitRequestFormParams, InputRequiredResult
from mcp_types.version import MODERN_PROTOCOL_VERSIONS

from luftpause.runtime.approvals import AlreadyAnswered, ApprovalForm, PendingApproval
from luftpause.runtime.runs import Run
from luftpause.runtime.service import Runtime, WaitMode

log = structlog.get_logger(component="asking")


def declares_elicitation(ctx: Context) -> bool:
    try:
        capabilities = ctx.client_capabilities
    except ValueError:
        return False
    return capabilities is not None and capabilities.elicitation is not None


def is_sessionless(ctx: Context) -> bool:
    return ctx.protocol_version in MODERN_PROTOCOL_VERSIONS


def can_send_requests(ctx: Context) -> bool:
    return bool(getattr(ctx.session, "can_send_request", False))


def elicit_request(pending: PendingApproval) -> ElicitRequest:
    schema = render_elicitation_schema(ApprovalForm)
    return ElicitRequest(params=ElicitRequestFormParams(message=pending.message, requested_schema=schema))


def decision_of(response: Any) -> bool | None:
    """allow from an elicitation answer (an ElicitResult or its JSON); None = no decision."""
    if hasattr(response, "model_dump"):
        response = response.model_dump(by_alias=True, mode="json")
    if not isinstance(response, dict):
        return None
    if response.get("action") == "decline":
        return False
    content = response.get("content")
    if response.get("action") == "accept" and isinstance(content, dict) and isinstance(content.get("allow"), bool):
        return content["allow"]
    return None


async def record_answer(runtime: Runtime, approval_id: str, allow: bool | None, by: str) -> None:
    """Take one human's answer to ``approval_id`` (ignored when already answered or gone)."""
    pending = runtime.approvals.get(approval_id)
    if pending is None or allow is None:
        return
    try:
        await runtime.approvals.answer(runtime.runs.get(pending.handle), allow, approval_id, by=by)
    except AlreadyAnswered:
        log.info("approval_answer_ignored", id=approval_id, by=by)


async def wait_asking(
    runtime: Runtime, ctx: Context, runs: Sequence[Run], mode: WaitMode, timeout: float | None
) -> bool:
    """``runtime.wait`` that, for a session client with elicitation, asks about approvals
    of these runs while it waits. True when the timeout came first."""
    if not (declares_elicitation(ctx) and can_send_requests(ctx)):
        return await runtime.wait(runs, mode, timeout)
    handles = [run.handle for run in runs]
    asked: set[str] = set()
    waiting = asyncio.create_task(runtime.wait(runs, mode, timeout))
    questions: asyncio.Queue[PendingApproval] = asyncio.Queue()
    asker = asyncio.create_task(_ask_in_turn(runtime, ctx, questions))
    try:
        while not waiting.done():
            watch = asyncio.create_task(runtime.approvals.next_unasked(handles, asked))
            await asyncio.wait({waiting, watch}, return_when=asyncio.FIRST_COMPLETED)
            if not watch.done():
                watch.cancel()
                continue
            for pending in watch.result():
                asked.add(pending.id)
                pending.asking = True  # claimed now, so a concurrent call does not ask it too
                questions.put_nowait(pending)
        return waiting.result()
    finally:
        for task in (waiting, asker):
            task.cancel()
        await asyncio.gather(waiting, asker, return_exceptions=True)
        while not questions.empty():
            runtime.approvals.released(questions.get_nowait())


async def _ask_in_turn(runtime: Runtime, ctx: Context, questions: asyncio.Queue[PendingApproval]) -> None:
    """Show the queued approvals one after another (a human answers one form at a time)."""
    while True:
        pending = await questions.get()
        try:
            if pending.decision.done() or pending.answering:
                continue
            log.info("approval_elicited", run=pending.handle, id=pending.id)
            answer = await ctx.elicit(pending.message, ApprovalForm)
            if isinstance(answer, AcceptedElicitation):
                await record_answer(runtime, pending.id, answer.data.allow, by="elicitation")
            elif isinstance(answer, DeclinedElicitation):
                await record_answer(runtime, pending.id, False, by="elicitation")
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 - a client that fails to ask leaves it to `approve`
            log.warning("approval_elicitation_failed", run=pending.handle, id=pending.id, error=repr(exc))
        finally:
            runtime.approvals.released(pending)


# --- sessionless (2026-07-28): input-required results ----------------------------------


def read_state(ctx: Context) -> dict[str, Any]:
    """The request state this call echoed back (sealed by the SDK, so it is ours), or {}."""
    try:
        state = json.loads(ctx.request_state or "{}")
    except ValueError:
        return {}
    return state if isinstance(state, dict) else {}


async def take_input_responses(runtime: Runtime, ctx: Context, handles: Sequence[str]) -> None:
    """The answers this call carries to approvals of the runs it waits on (an answer to
    another run's approval, another caller's perhaps, is not this call's to give)."""
    for approval_id, response in (ctx.input_responses or {}).items():
        pending = runtime.approvals.get(approval_id)
        if pending is not None and pending.handle in handles:
            await record_answer(runtime, approval_id, decision_of(response), by="elicitation")


def asks_by_input_required(ctx: Context) -> bool:
    return is_sessionless(ctx) and declares_elicitation(ctx) and not can_send_requests(ctx)


async def wait_or_ask(
    runtime: Runtime, ctx: Context, runs: Sequence[Run], mode: WaitMode, timeout: float | None,
    state: dict[str, Any],
) -> bool | InputRequiredResult:
    """For a sessionless client with elicitation: wait like ``runtime.wait``, but return an
    input-required result as soon as one of ``runs`` has an approval this call has not
    asked about yet. ``state`` (from `read_state`) is extended and sealed into the result."""
    await take_input_responses(runtime, ctx, [run.handle for run in runs])
    asked = set(state.get("asked") or [])
    deadline = state.get("deadline")
    if not isinstance(deadline, int | float):
        deadline = None if timeout is None else time.time() + timeout
    handles = [run.handle for run in runs]
    remaining = None if deadline is None else max(0.0, deadline - time.time())
    waiting = asyncio.create_task(runtime.wait(runs, mode, remaining))
    watch = asyncio.create_task(runtime.approvals.next_unasked(handles, asked))
    try:
        await asyncio.wait({waiting, watch}, return_when=asyncio.FIRST_COMPLETED)
        if waiting.done():
            return waiting.result()
        questions = watch.result()
    finally:
        for task in (waiting, watch):
            task.cancel()
        await asyncio.gather(waiting, watch, return_exceptions=True)
    ids = [pending.id for pending in questions]
    log.info("approval_input_required", ids=ids)
    next_state = {**state, "asked": sorted(asked | set(ids)), "deadline": deadline}
    return InputRequiredResult(
        input_requests={pending.id: elicit_request(pending) for pending in questions},
        request_state=json.dumps(next_state),
    )

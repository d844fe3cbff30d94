"""One request through Envoy's ext_proc protocol (one ``ExternalProcessor/Process`` stream),
as the endpoint picker (picker/__main__.py) answers it.

Per request:

* request headers: the route (``POST /v1/chat/completions`` is a turn; ``/v1/models``,
  ``DELETE /v1/runs/{id}``, ``/health`` and ``/ready`` are answered here; ``/v1/decide``
  goes to a one-pass replica), the bearer token or tenant key and the run identity
  headers (the dataplane's: run id, harness session, class, caller) are checked; a bad
  one is answered at once. A tenant key is its caller, as on the dataplane
  (luftpause/keys.py): a header naming another caller or class is a 403, and so is a run
  id or session header naming another caller's run;
* request body: JSON checked like the dataplane does, the run named (header, session
  header, returned tool_call ids, a tenant's only of its own runs, or new), the turn
  admitted (it may be held: Envoy waits), and the
  answer is the destination: ``x-gateway-destination-endpoint: <ip:port>,<fallback>...``
  as a header and the same under ``envoy.lb`` dynamic metadata. The gateway's subset
  hint (``envoy.lb.subset_hint``) bounds the choice; an unknown model is a 404, no
  eligible replica a 503;
* response headers: ``x-luftpause-run-id`` and ``x-luftpause-replica`` (the engine that
  served it, from Envoy's ``upstream.address``) are added; a status other than 200
  ends the turn as failed;
* response body: watched (first token, usage, finish reason, new tool_call ids) with the
  observer the dataplane uses too (luftpause/observe.py); its end finishes the turn. A
  stream that ends before that is a failed turn (or an abandoned one, if it was still
  held).
"""

from __future__ import annotations

import asyncio
import json
import os
import time
from typing import TYPE_CHECKING

import grpc
from google.protobuf import struct_pb2

from luftpause import envoy as _envoy

_envoy.load_stubs()  # xds-protos lives outside the environment (luftpause/envoy.py says why)
from envoy.config.core.v3 import base_pb2  # noqa: E402
from envoy.service.ext_proc.v3 import external_processor_pb2 as ep  # noqa: E402
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as ep_grpc  # noqa: E402
from envoy.type.v3 import http_status_pb2  # noqa: E402

from luftpause import auth, keys
from luftpause import vocabulary as h
from luftpause.envoy import DESTINATION, LB_NAMESPACE, SUBSET_NAMESPACE
from luftpause.frontdoor import (MODEL_KINDS, ApiError, admit_one_pass, check_chat, check_inputs, health_body,
                                 json_document, model_list, readiness, returned_tool_call_ids)
from luftpause.hints import hinted, resumes_from_tool, urgency
from luftpause.link import AdmitRefused, Placement
from luftpause.observe import TurnObserver, token_pace_us
from luftpause.proto import scheduler_pb2 as pb
from luftpause.runbook import IDLE, PAUSED, InFlightTurn, new_id
from luftpause.vocabulary import REJECT_CODES, RejectReason
from luftpause.picker.errors import PickerError

if TYPE_CHECKING:
    from luftpause.picker.__main__ import Picker

SUBSET_KEY = "x-gateway-destination-endpoint-subset"
CHAT = "/v1/chat/completions"
# Request headers the engine never sees: the client's credentials, a token or tenant key
# (a replica's own key, when the pool names one, replaces them).
STRIPPED = ("authorization", "x-api-key")


class Refused(PickerError):
    """A request answered by the picker itself (status + JSON message)."""

    def __init__(self, status: int, message: str, run_id: str = "", headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.run_id, self.headers = status, message, run_id, headers


def shed(message: str, run_id: str) -> Refused:
    """A batch turn shed (429): the client may send it again after Retry-After."""
    return Refused(429, message, run_id, {"retry-after": str(REJECT_CODES[RejectReason.SATURATED].retry_after_s)})


# --------------------------------------------------------------------- answers


def _header(key: str, value: str) -> base_pb2.HeaderValueOption:
    return base_pb2.HeaderValueOption(header=base_pb2.HeaderValue(key=key, raw_value=value.encode()),
                                      append_action=base_pb2.HeaderValueOption.OVERWRITE_IF_EXISTS_OR_ADD)


def immediate(status: int, body: dict, headers: dict[str, str] | None = None) -> ep.ProcessingResponse:
    mutation = ep.HeaderMutation(set_headers=[_header("content-type", "application/json"),
                                              *(_header(k, v) for k, v in (headers or {}).items())])
    return ep.ProcessingResponse(immediate_response=ep.ImmediateResponse(
        status=http_status_pb2.HttpStatus(code=status), headers=mutation, body=json.dumps(body).encode()))


def error(status: int, message: str, run_id: str = "", headers: dict[str, str] | None = None) -> ep.ProcessingResponse:
    return immediate(status, {"error": {"message": message}}, {**({h.RUN_ID: run_id} if run_id else {}),
                                                             **(headers or {})})


CONTINUE_REQUEST_HEADERS = ep.ProcessingResponse(request_headers=ep.HeadersResponse())
CONTINUE_RESPONSE_BODY = ep.ProcessingResponse(response_body=ep.BodyResponse())
IDENTITY_ENCODING = _header("accept-encoding", "identity")  # the engine's reply is observed as it is


def _headers(message: ep.HttpHeaders) -> dict[str, str]:
    """Envoy sends values as raw bytes (``raw_value``); header names arrive lower-case."""
    return {v.key: (v.raw_value.decode("utf-8", "surrogateescape") if v.raw_value else v.value)
            for v in message.headers.headers}


def _text_header(headers: dict[str, str], name: str, limit: int) -> str:
    try:
        return h.identity_text(headers.get(name), name, limit)
    except h.BadIdentity as exc:
        raise Refused(400, str(exc)) from None


# ------------------------------------------------------------------ one request


class Exchange:
    """One request through Envoy: one Process stream."""

    def __init__(self, picker: Picker) -> None:
        self.picker = picker
        self.route = ""
        self.headers: dict[str, str] = {}
        self.run_id = ""
        self.session = False  # the run is named by a harness's session header (it ends when that idles)
        self.service_class = h.DEFAULT_SERVICE_CLASS
        self.caller = h.ANONYMOUS_CALLER
        self.tenant: keys.KeyIdentity | None = None  # the tenant whose key the request presents, if any
        self.model = ""
        self.subset: set[str] | None = None
        self.turn_id = ""
        self.placement: Placement | None = None
        self.lease: tuple[str, int] | None = None
        self.served = ""
        self.started = 0.0
        self.first_token_at: float | None = None  # monotonic; None until a streamed first token
        self.ended = True  # until a turn is placed there is nothing to end
        self.observer = TurnObserver()
        self.sse = False
        self.body = bytearray()  # a non-streamed response, observed whole at its end

    async def handle(self, message: ep.ProcessingRequest) -> ep.ProcessingResponse | None:
        kind = message.WhichOneof("request")
        try:
            if kind == "request_headers":
                return await self.request_headers(message)
            if kind == "request_body":
                return await self.request_body(message)
        except Refused as refused:
            self.picker.metrics.refused(refused.status)
            return error(refused.status, refused.message, refused.run_id, refused.headers)
        if kind == "response_headers":
            return self.response_headers(message)
        # Response body chunks never come here: ExternalProcessor.Process answers them itself.
        # Trailers are not asked for; answer anything else so Envoy goes on.
        return ep.ProcessingResponse(**{kind: ep.TrailersResponse()}) if kind else None

    # ----------------------------------------------------------- request

    async def request_headers(self, message: ep.ProcessingRequest) -> ep.ProcessingResponse:
        headers = self.headers = _headers(message.request_headers)
        method, path = headers.get(":method", ""), headers.get(":path", "").split("?", 1)[0]
        if path in ("/health", "/ready"):
            synced = self.picker.link.synced
            return immediate(200, health_body(synced)) if path == "/health" else immediate(*readiness(synced))
        if path.startswith("/v1"):
            self.authenticate(headers)
        if method == "GET" and path == "/v1/models":
            return await self.models(headers.get(":path", ""))
        if method == "DELETE" and path.startswith("/v1/runs/") and path.count("/") == 3:
            return self.delete_run(path.rsplit("/", 1)[1])
        if method != "POST" or path not in (CHAT, "/v1/decide"):
            raise Refused(404, f"no route {method} {path}")
        self.route = path
        if path == CHAT:
            self._name_run(headers)
        try:
            service_class = h.service_class(headers.get(h.SERVICE_CLASS))
        except h.BadIdentity as exc:
            raise Refused(400, str(exc), self._run_id()) from None
        caller = _text_header(headers, h.CALLER, h.MAX_CALLER_BYTES) or h.ANONYMOUS_CALLER
        self.service_class, self.caller = keys.turn_identity(self.tenant, service_class, caller)
        if headers.get("content-type", "").split(";", 1)[0].strip().lower() != "application/json":
            raise Refused(415, "Content-Type must be application/json", self._run_id())
        if message.request_headers.end_of_stream:
            raise Refused(400, "a JSON request body is required", self._run_id())
        subset = message.metadata_context.filter_metadata.get(SUBSET_NAMESPACE)
        if subset is not None and SUBSET_KEY in subset.fields:
            self.subset = {v.string_value for v in subset.fields[SUBSET_KEY].list_value.values}
        return CONTINUE_REQUEST_HEADERS

    def delete_run(self, run_id: str) -> ep.ProcessingResponse:
        """``DELETE /v1/runs/{id}``: the run forgotten and reported ended (a 404 for a run the
        caller may not end)."""
        picker = self.picker
        if not keys.may_end(self.tenant, picker.book.runs.get(run_id)):
            raise Refused(404, keys.no_run_of_this_caller(run_id))
        picker.book.forget_run(run_id)
        picker.link.report(pb.TurnEvent(run_id=run_id, run_ended=pb.RunEnded()))
        return immediate(200, {"id": run_id, "deleted": True}, {h.RUN_ID: run_id})

    def _name_run(self, headers: dict[str, str]) -> None:
        """The run a chat turn names: its run id header, else the harness's session header (as
        the dataplane reads it), else none yet; a 403 when it is another caller's run."""
        self.run_id = _text_header(headers, h.RUN_ID, h.MAX_ID_BYTES)
        if not self.run_id:  # else the harness's session header, as the dataplane reads it
            self.run_id = next(filter(None, (_text_header(headers, name, h.MAX_ID_BYTES)
                                             for name in h.SESSION_HEADERS if name in headers)), "")
            self.session = bool(self.run_id)
        if self.run_id and not keys.may_join(self.tenant, self.picker.book.runs.get(self.run_id)):
            which = "the session header" if self.session else h.RUN_ID
            self.run_id, self.session = "", False  # the error names a new run, not the other caller's
            raise Refused(403, keys.named_other_callers_run(which), self._run_id())

    def authenticate(self, headers: dict[str, str]) -> None:
        """A /v1 request's credentials, as the dataplane checks them: a tenant key is its
        caller (its identity headers must agree: else 403); anything else must be the
        token, when one is set, as a bearer token or x-api-key (else 401)."""
        try:
            self.tenant = auth.authenticate(self.picker.keys, self.picker.token, headers)
        except auth.LoginRefused as refused:
            raise Refused(refused.status, refused.message) from None

    def _run_id(self) -> str:
        """The run an error response names (a new one when the request named none)."""
        if self.route == CHAT and not self.run_id:
            self.run_id = new_id()
        return self.run_id

    async def models(self, path: str) -> ep.ProcessingResponse:
        kind = path.partition("kind=")[2].split("&", 1)[0] or "generative"
        if kind not in MODEL_KINDS:
            raise Refused(400, f"kind must be one of: {', '.join(MODEL_KINDS)}")
        try:
            status = await self.picker.link.status()
        except grpc.RpcError as exc:
            raise Refused(503, f"scheduler unavailable: {exc.code().name}") from None
        return immediate(200, model_list(status, MODEL_KINDS[kind]))

    async def request_body(self, message: ep.ProcessingRequest) -> ep.ProcessingResponse:
        try:  # checked as the dataplane checks it
            document, self.model = json_document(message.request_body.body)
            if self.route == CHAT:
                check_chat(document)
        except ApiError as exc:
            raise Refused(exc.status, exc.message, self._run_id()) from None
        model = self.model
        if self.route != CHAT:
            return await self.decide(document)
        picker = self.picker
        if not self.run_id:  # the run whose tool calls it returns (a tenant's: one of its own), or a new one
            known = picker.book.run_for_tool_calls(returned_tool_call_ids(document), time.monotonic())
            self.run_id = known if known and keys.may_join(self.tenant, picker.book.runs.get(known)) else new_id()
        allowed: tuple[str, ...] = ()
        if self.subset is not None:
            # The gateway's subset bounds the scheduler's choice: only its replicas that serve the model.
            allowed = tuple(picker.replicas.named(self.subset, model))
            if not allowed:
                raise Refused(503, "no replica of the gateway's endpoint subset serves the model", self.run_id)
        self.turn_id = new_id()
        self.started = time.monotonic()
        placement = self._on_lease(allowed) or await self._admit(allowed)
        self._placed(placement)
        primary = picker.replicas.key(placement)
        fallbacks = picker.replicas.fallbacks(model, placement.replica)
        if allowed:
            fallbacks = [f for f in fallbacks if f in self.subset]
        picker.metrics.picked(self.service_class, time.monotonic() - self.started)
        body = message.request_body.body
        hinted_body = hinted(body, placement.hints, urgency(self.service_class, resumes_from_tool(document)),
                             self.run_id, document, placement.slot)
        return self._route(placement, ",".join((primary, *fallbacks)), body=None if hinted_body is body else hinted_body)

    async def decide(self, document: dict) -> ep.ProcessingResponse:
        """A one-pass call: to a healthy one-pass replica, its path rewritten to /classify."""
        try:
            check_inputs(document)
            placement = await admit_one_pass(self.picker.link, self.model, self.caller)
        except ApiError as exc:
            raise Refused(exc.status, exc.message) from None
        self.placement = placement
        destination = self.picker.replicas.key(placement)
        if self.subset is not None and destination not in self.subset:
            # One-pass calls take turns over every one-pass replica (no slot to give back).
            raise Refused(503, f"the one-pass replica {placement.replica} is outside the gateway's endpoint subset")
        return self._route(placement, destination, path="/classify")

    def _route(self, placement: Placement, destination: str, path: str = "",
               body: bytes | None = None) -> ep.ProcessingResponse:
        """Envoy's way to the replica; ``body``: the request's body as the engine is to get
        it (the fields its engine reads set, luftpause/hints.py), with its length, which a
        processor replacing a buffered body must set."""
        key = os.environ.get(placement.api_key_env, "") if placement.api_key_env else ""
        mutation = ep.HeaderMutation(set_headers=[_header(DESTINATION, destination), IDENTITY_ENCODING],
                                     remove_headers=() if key else STRIPPED)
        if body is not None:
            mutation.set_headers.append(_header("content-length", str(len(body))))
        if key:
            mutation.set_headers.append(_header("authorization", f"Bearer {key}"))
        if path:
            mutation.set_headers.append(_header(":path", path))
        metadata = struct_pb2.Struct()
        metadata.fields[LB_NAMESPACE].struct_value.fields[DESTINATION].string_value = destination
        common = ep.CommonResponse(header_mutation=mutation)
        if body is not None:
            common.body_mutation.body = body
        return ep.ProcessingResponse(request_body=ep.BodyResponse(response=common), dynamic_metadata=metadata)

    def _on_lease(self, allowed: tuple[str, ...]) -> Placement | None:
        """A lent slot on the run's last replica, as the dataplane takes one (one the
        gateway's subset allows)."""
        record = self.picker.book.runs.get(self.run_id)
        if record is None or not record.replica or (allowed and record.replica not in allowed):
            return None
        leased = self.picker.link.place_on_lease(self.turn_id, self.run_id, self.model, self.service_class,
                                                 self.caller, record.replica)
        if leased is None:
            return None
        placement, self.lease = leased
        return placement

    async def _admit(self, allowed: tuple[str, ...]) -> Placement:
        picker = self.picker
        link = picker.link
        batch = self.service_class == h.BATCH
        admitted = link.admit(self.turn_id, self.run_id, self.model, self.service_class, self.caller,
                              allowed=allowed, shed_batch_held=picker.shed_batch_held if batch else 0)
        picker.metrics.waiting += 1
        try:
            if batch and picker.shed_batch_wait_s:
                return await asyncio.wait_for(admitted, picker.shed_batch_wait_s)
            return await admitted
        except AdmitRefused as exc:
            if exc.reason is RejectReason.SATURATED:
                picker.metrics.shed("held")
                raise shed(str(exc), self.run_id) from None
            headers = {name.lower(): value for name, value in (exc.headers or {}).items()}
            raise Refused(exc.status, str(exc), self.run_id, headers or None) from None
        except TimeoutError:
            # Held past the bound: given up (nothing stays held) and shed.
            link.report(pb.TurnEvent(turn_id=self.turn_id, run_id=self.run_id, abandoned=pb.TurnAbandoned()), True)
            picker.metrics.shed("waited")
            raise shed(f"saturated: held {picker.shed_batch_wait_s:g} s without a free slot; try again later",
                       self.run_id) from None
        except asyncio.CancelledError:
            # Envoy ended the stream (the client left, or the picker stops) while the turn was held.
            link.report(pb.TurnEvent(turn_id=self.turn_id, run_id=self.run_id, abandoned=pb.TurnAbandoned()), True)
            raise
        finally:
            picker.metrics.waiting -= 1

    def _placed(self, placement: Placement) -> None:
        self.placement, self.ended = placement, False
        self.picker.book.turn_placed(InFlightTurn(self.turn_id, self.run_id, placement.replica, self.model,
                                                  self.service_class, self.caller), time.monotonic())
        if self.session:
            self.picker.book.mark_session(self.run_id)

    # ---------------------------------------------------------- response

    def response_headers(self, message: ep.ProcessingRequest) -> ep.ProcessingResponse:
        headers = _headers(message.response_headers)
        status = headers.get(":status", "")
        replicas = self.picker.replicas
        address = ""
        attributes = message.attributes.get("envoy.filters.http.ext_proc")
        if attributes is not None and "upstream.address" in attributes.fields:
            address = attributes.fields["upstream.address"].string_value
        served = replicas.names.get(address, "")
        if not served and self.placement is not None:
            served = self.placement.replica
        self.served = served
        self.sse = headers.get("content-type", "").startswith("text/event-stream")
        added = [*([_header(h.RUN_ID, self.run_id)] if self.route == CHAT and self.run_id else []),
                 *([_header(h.REPLICA, served)] if served else [])]
        if not self.ended:
            if status != "200":
                self._failed(f"engine {served or self.placement.replica}: HTTP {status}")
            elif served != self.placement.replica:
                # Envoy went down the list: the placed replica refused the connection. Its
                # turn failed there (the scheduler probes it at once); the run's next turn
                # asks again, and the run book names where this one ran.
                self._failed(f"engine {self.placement.replica}: unreachable, served by {served}")
                record = self.picker.book.runs.get(self.run_id)
                if record is not None:
                    record.replica = served
            elif message.response_headers.end_of_stream:
                self._finished()
        return ep.ProcessingResponse(response_headers=ep.HeadersResponse(
            response=ep.CommonResponse(header_mutation=ep.HeaderMutation(set_headers=added))))

    def response_body(self, body: ep.HttpBody) -> ep.ProcessingResponse:
        if not self.ended:
            observer = self.observer
            if self.sse:
                if observer.feed_sse(body.body):
                    self.first_token_at = time.monotonic()
                    ttft = int((self.first_token_at - self.started) * 1000)
                    self._event(first_token=pb.FirstToken(ttft_ms=ttft))
                if observer.done or body.end_of_stream:
                    self._finished()
            elif body.end_of_stream and not self.body:  # the whole reply in one message (no copy)
                observer.observe_body(body.body)
                self._finished()
            else:
                self.body += body.body
                if body.end_of_stream:
                    observer.observe_body(bytes(self.body))
                    self._finished()
        return CONTINUE_RESPONSE_BODY

    # ------------------------------------------------------------ turn end

    def _event(self, urgent: bool = False, **kind) -> None:
        self.picker.link.report(pb.TurnEvent(turn_id=self.turn_id, run_id=self.run_id, **kind), urgent,
                                self.lease[0] if self.lease is not None else "")

    def _finished(self) -> None:
        observer = self.observer
        if observer.usage_seen:
            self._event(usage=pb.Usage(prompt_tokens=observer.prompt_tokens,
                                       completion_tokens=observer.completion_tokens,
                                       cached_tokens=observer.cached_tokens))
        reason = observer.finish_reason or "stop"
        now = time.monotonic()
        self.picker.book.remember_tool_calls(self.run_id, observer.tool_call_ids, now)
        self._end(PAUSED if reason == "tool_calls" else IDLE,
                  finished=pb.TurnFinished(finish_reason=reason, tool_call_ids=observer.tool_call_ids,
                                           token_us=token_pace_us(self.first_token_at, now,
                                                                  observer.completion_tokens)))

    def _failed(self, message: str) -> None:
        self.picker.log.info("turn_failed", run=self.run_id, turn=self.turn_id, error=message)
        self._end(failed=pb.TurnFailed(error=message))

    def _end(self, stage: str = IDLE, **kind) -> None:
        if self.ended:
            return
        self.ended = True
        self.picker.book.turn_ended(self.turn_id, stage, time.monotonic())
        self._event(**kind)
        if self.lease is not None:
            self.picker.link.release(self.lease)

    def closed(self) -> None:
        """The stream is over: a turn not seen to its end failed (the client or the engine
        left mid-response, or Envoy gave up)."""
        if not self.ended:
            self._failed("the response ended before its last byte" if self.served else
                         "the request ended before a response")


class ExternalProcessor(ep_grpc.ExternalProcessorServicer):
    def __init__(self, picker: Picker) -> None:
        self.picker = picker

    async def Process(self, request_iterator, context):  # noqa: N802 - the gRPC method's name
        exchange = Exchange(self.picker)
        try:
            async for message in request_iterator:
                if message.HasField("response_body"):  # most messages of a streamed reply: no await, no lookup
                    yield exchange.response_body(message.response_body)
                    continue
                response = await exchange.handle(message)
                if response is not None:
                    yield response
                    if response.HasField("immediate_response"):
                        return
        finally:
            exchange.closed()

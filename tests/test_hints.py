"""The engine fields luftpause sets on a turn (luftpause/hints.py): the urgency order in
each engine's priority direction, the run as the session, and nothing at all for an
engine that reads none."""

from __future__ import annotations

import json

import orjson
import pytest

from luftpause.hints import (BACKGROUND, DYNAMO, FRESH, HIGHER_FIRST, LOWER_FIRST, NO_HINTS, RESUMING, EngineHints, hinted,
                             priority_value, resumes_from_tool, urgency)

CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
TOOL_RESULT = {"model": "m", "messages": [
    {"role": "user", "content": "list the files"},
    {"role": "assistant", "content": None,
     "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "ls", "arguments": "{}"}}]},
    {"role": "tool", "tool_call_id": "c1", "content": "a.py"}]}


def test_a_run_back_from_a_tool_goes_before_a_person_s_new_turn_before_batch_in_either_engine_s_order():
    assert (urgency("interactive", True), urgency("interactive", False), urgency("batch", True)) == (
        RESUMING, FRESH, BACKGROUND)
    levels = (RESUMING, FRESH, BACKGROUND)
    # vLLM (and SGLang with --schedule-low-priority-values-first): lower values run first
    assert sorted(levels, key=lambda level: priority_value(LOWER_FIRST, level)) == list(levels)
    # SGLang --enable-priority-scheduling: higher values first
    assert sorted(levels, key=lambda level: -priority_value(HIGHER_FIRST, level)) == list(levels)
    # batch sits where a request naming no priority sits in both engines
    assert priority_value(LOWER_FIRST, BACKGROUND) == priority_value(HIGHER_FIRST, BACKGROUND) == 0


def test_a_turn_resumes_from_a_tool_when_its_last_message_is_a_tool_result():
    assert resumes_from_tool(TOOL_RESULT)
    assert not resumes_from_tool(CHAT)
    assert not resumes_from_tool({**TOOL_RESULT, "messages": [*TOOL_RESULT["messages"],
                                                             {"role": "user", "content": "and now?"}]})
    assert not resumes_from_tool({"messages": []}) and not resumes_from_tool({"messages": "x"})


def test_an_engine_reading_nothing_gets_the_body_byte_for_byte():
    body = b'{ "model" : "m",\n "priority": 7, "session_id": "theirs", "messages": [] }'
    assert hinted(body, NO_HINTS, RESUMING, "run-1") is body


@pytest.mark.parametrize(("hints", "fields"), [
    (EngineHints(LOWER_FIRST), {"priority": -RESUMING}),
    (EngineHints(HIGHER_FIRST, sessions=True), {"priority": RESUMING, "session_id": "run-1"}),
    (EngineHints(sessions=True), {"priority": 7, "session_id": "run-1"}),
])
def test_the_fields_an_engine_reads_are_set_over_the_client_s_and_the_rest_is_kept(hints, fields):
    document = {**TOOL_RESULT, "priority": 7, "session_id": "theirs", "temperature": 0.2}
    out = json.loads(hinted(orjson.dumps(document), hints, RESUMING, "run-1"))
    assert out == {**document, **fields}


def test_a_batch_turn_names_no_session_so_its_kv_is_evicted_before_interactive_runs():
    document = {**CHAT, "session_id": "theirs"}
    out = json.loads(hinted(orjson.dumps(document), EngineHints(HIGHER_FIRST, sessions=True), BACKGROUND, "job-1"))
    assert out == {**CHAT, "priority": BACKGROUND}  # the client's own session dropped too
    out = json.loads(hinted(orjson.dumps(document), EngineHints(sessions=True), FRESH, "run-1"))
    assert out["session_id"] == "run-1"


def test_a_dynamo_frontend_gets_the_urgency_in_its_agent_hints_beside_the_client_s_own():
    document = {**CHAT, "priority": 7, "nvext": {"agent_hints": {"osl": 512, "priority": 99}, "greed_sampling": True}}
    out = json.loads(hinted(orjson.dumps(document), EngineHints(DYNAMO), RESUMING, "run-1"))
    assert out == {**document, "nvext": {"agent_hints": {"osl": 512, "priority": RESUMING}, "greed_sampling": True}}
    assert json.loads(hinted(orjson.dumps(CHAT), EngineHints(DYNAMO), BACKGROUND, "r"))["nvext"] == {
        "agent_hints": {"priority": BACKGROUND}}
    odd = {**CHAT, "nvext": "not a mapping"}  # what Dynamo would refuse anyway: replaced
    assert json.loads(hinted(orjson.dumps(odd), EngineHints(DYNAMO), FRESH, "r"))["nvext"] == {
        "agent_hints": {"priority": FRESH}}
    assert EngineHints.from_pool({"priority": "dynamo"}) == EngineHints(DYNAMO)


def test_llama_cpp_gets_the_slot_chosen_for_the_run_and_cache_prompt_over_the_client_s():
    document = {**TOOL_RESULT, "id_slot": 5, "cache_prompt": False, "n_keep": 8}
    out = json.loads(hinted(orjson.dumps(document), EngineHints(slots=4), RESUMING, "run-1", slot=2))
    assert out == {**document, "id_slot": 2, "cache_prompt": True}
    # slot 0 is a slot; and priority and sessions go along where the engine reads them too
    out = json.loads(hinted(orjson.dumps(CHAT), EngineHints(HIGHER_FIRST, slots=1), FRESH, "run-1", slot=0))
    assert out == {**CHAT, "priority": FRESH, "id_slot": 0, "cache_prompt": True}
    # none chosen: the engine picks a slot itself, its prefix still reused
    assert json.loads(hinted(orjson.dumps(CHAT), EngineHints(slots=4), FRESH, "r")) == {**CHAT, "cache_prompt": True}
    # an engine without slots gets neither field, whatever slot is passed
    body = orjson.dumps(CHAT)
    assert hinted(body, NO_HINTS, FRESH, "r", slot=3) is body
    assert "id_slot" not in json.loads(hinted(body, EngineHints(sessions=True), FRESH, "r", slot=3))


def test_what_orjson_refuses_is_still_hinted():
    body = b'{"model":"m","messages":[{"role":"user","content":"\\ud800"}],"seed":123456789012345678901234567890}'
    out = json.loads(hinted(body, EngineHints(HIGHER_FIRST), FRESH, "r"))
    assert out["priority"] == FRESH and out["seed"] == 123456789012345678901234567890
    assert out["messages"][0]["content"] == "\ud800"


def test_a_body_already_parsed_is_hinted_the_same_and_left_as_it_was():
    document = {**TOOL_RESULT, "priority": 7}
    body = orjson.dumps(document)
    hints = EngineHints(HIGHER_FIRST, sessions=True)
    assert hinted(body, hints, RESUMING, "r", document) == hinted(body, hints, RESUMING, "r")
    assert document["priority"] == 7 and "session_id" not in document

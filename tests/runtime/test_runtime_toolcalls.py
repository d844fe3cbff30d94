import json

import pytest

from luftpause.runtime.toolcalls import ToolCallArgumentsError, expected_shape, prepare_arguments, recover_text_tool_calls

SCHEMA = {
    "type": "object",
    "properties": {
        "query": {"type": "string"},
        "limit": {"type": "integer"},
        "exact": {"type": "boolean"},
        "score": {"anyOf": [{"type": "number"}, {"type": "null"}]},
    },
    "required": ["query"],
}


def test_scalars_are_coerced_to_the_schema_types() -> None:
    arguments = prepare_arguments('{"query": 42, "limit": "3", "exact": "true", "score": "0.5"}', SCHEMA)
    assert arguments == {"query": "42", "limit": 3, "exact": True, "score": 0.5}


def test_dict_arguments_and_empty_arguments_are_accepted() -> None:
    assert prepare_arguments({"query": "x"}, SCHEMA) == {"query": "x"}
    assert prepare_arguments("", {"type": "object", "properties": {}}) == {}


def test_missing_required_argument_is_rejected_with_the_expected_shape() -> None:
    with pytest.raises(ToolCallArgumentsError) as error:
        prepare_arguments('{"limit": 2}', SCHEMA)
    assert "query" in str(error.value)
    assert json.dumps(expected_shape(SCHEMA)) in str(error.value)


def test_uncoercible_value_is_rejected() -> None:
    with pytest.raises(ToolCallArgumentsError):
        prepare_arguments('{"query": "x", "limit": "three"}', SCHEMA)


def test_schema_passed_as_arguments_is_rejected() -> None:
    with pytest.raises(ToolCallArgumentsError, match="schema instead of arguments"):
        prepare_arguments(json.dumps(SCHEMA), SCHEMA)


@pytest.mark.parametrize("raw", ["{not json", "[1, 2]", '"text"'])
def test_malformed_arguments_are_rejected(raw: str) -> None:
    with pytest.raises(ToolCallArgumentsError):
        prepare_arguments(raw, SCHEMA)


def test_expected_shape_marks_required_fields() -> None:
    assert expected_shape(SCHEMA) == {
        "query": "string (required)",
        "limit": "integer",
        "exact": "boolean",
        "score": "number",
    }


@pytest.mark.parametrize(
    "content",
    [
        '{"name": "lookup", "parameters": {"query": "x"}}',
        '<|python_tag|>{"name": "lookup", "parameters": {"query": "x"}}',
        '```json\n{"name": "lookup", "arguments": {"query": "x"}}\n```',
    ],
)
def test_tool_call_written_as_text_is_recovered(content: str) -> None:
    calls = recover_text_tool_calls(content, {"lookup"})
    assert calls is not None and len(calls) == 1
    assert calls[0]["function"]["name"] == "lookup"
    assert json.loads(calls[0]["function"]["arguments"]) == {"query": "x"}
    assert calls[0]["id"].startswith("call_")


@pytest.mark.parametrize(
    "content",
    ["The answer is 42.", '{"name": "unknown_tool", "parameters": {}}', '{"answer": 1}', "", None],
)
def test_ordinary_text_is_not_a_tool_call(content: str | None) -> None:
    assert recover_text_tool_calls(content, {"lookup"}) is None


def test_no_recovery_when_no_tools_are_offered() -> None:
    assert recover_text_tool_calls('{"name": "lookup", "parameters": {}}', set()) is None

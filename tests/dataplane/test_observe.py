"""The stream observer, fed with plain bytes: what it learns must not depend on how
the stream is cut into chunks."""

from __future__ import annotations

import json

from hypothesis import given
from hypothesis import strategies as st

from luftpause.observe import TurnObserver, token_pace_us


def sse(*chunks: dict) -> bytes:
    return b"".join(b"data: " + json.dumps(c).encode() + b"\n\n" for c in chunks) + b"data: [DONE]\n\n"


STREAM = sse(
    {"choices": [{"index": 0, "delta": {"role": "assistant"}, "finish_reason": None}]},
    {"choices": [{"index": 0, "delta": {"content": "Hel"}, "finish_reason": None}]},
    {"choices": [{"index": 0, "delta": {"content": "lo"}, "finish_reason": None}]},
    {"choices": [{"index": 0, "delta": {"tool_calls": [{"index": 0, "id": "call_1", "type": "function",
                                                        "function": {"name": "lookup", "arguments": ""}}]},
                  "finish_reason": None}]},
    {"choices": [{"index": 0, "delta": {"tool_calls": [{"index": 0, "function": {"arguments": "{}"}}]},
                  "finish_reason": None}]},
    {"choices": [{"index": 0, "delta": {}, "finish_reason": "tool_calls"}]},
    {"choices": [], "usage": {"prompt_tokens": 12, "completion_tokens": 5,
                              "prompt_tokens_details": {"cached_tokens": 8}}},
)


@given(st.lists(st.integers(1, len(STREAM) - 1), max_size=12, unique=True))
def test_observations_do_not_depend_on_chunk_boundaries(cuts):
    observer = TurnObserver()
    first_token_signals = 0
    edges = [0, *sorted(cuts), len(STREAM)]
    for start, end in zip(edges, edges[1:], strict=False):
        first_token_signals += observer.feed_sse(STREAM[start:end])
    assert first_token_signals == 1
    assert observer.done and observer.finish_reason == "tool_calls"
    assert observer.tool_call_ids == ["call_1"]
    assert (observer.prompt_tokens, observer.completion_tokens, observer.cached_tokens) == (12, 5, 8)


def test_a_stream_without_done_is_not_done():
    observer = TurnObserver()
    observer.feed_sse(STREAM[: STREAM.index(b"data: [DONE]")])
    assert not observer.done


def test_whole_body_is_observed():
    observer = TurnObserver()
    observer.observe_body(json.dumps({"choices": [{"message": {"content": None, "tool_calls": [
        {"id": "call_9", "type": "function", "function": {"name": "x", "arguments": "{}"}}]},
        "finish_reason": "tool_calls"}], "usage": {"prompt_tokens": 3, "completion_tokens": 2}}).encode())
    assert observer.tool_call_ids == ["call_9"] and observer.finish_reason == "tool_calls"
    assert observer.first_token and observer.done and observer.prompt_tokens == 3


def _decoded_in_full(body: bytes) -> TurnObserver:
    observer = TurnObserver()
    document = json.loads(body)
    for choice in document["choices"]:
        observer._observe_message(choice["message"], choice.get("finish_reason"))
    observer._observe_usage(document.get("usage"))
    return observer


TRICKY_TEXT = st.lists(st.sampled_from(['"', "\\", '"usage"', '"finish_reason"', ":", "{", "}", " ", "ä", "x"]),
                       max_size=30).map("".join)


@given(TRICKY_TEXT, st.sampled_from(["stop", "length"]), st.integers(0, 10**6), st.booleans(), st.booleans())
def test_a_body_without_tool_calls_is_read_as_a_full_decode_would(content, reason, tokens, usage_first, spaced):
    usage = {"prompt_tokens": tokens, "completion_tokens": 7, "prompt_tokens_details": {"cached_tokens": 3}}
    choices = [{"index": 0, "message": {"role": "assistant", "content": content}, "finish_reason": reason}]
    document = {"usage": usage, "choices": choices} if usage_first else {"choices": choices, "usage": usage}
    body = json.dumps(document, separators=(", ", ": ") if spaced else (",", ":"), ensure_ascii=False).encode()
    observer = TurnObserver()
    observer.observe_body(body)
    expected = _decoded_in_full(body)
    assert observer.done
    assert (observer.finish_reason, observer.prompt_tokens, observer.completion_tokens, observer.cached_tokens,
            observer.usage_seen) == (expected.finish_reason, expected.prompt_tokens, expected.completion_tokens,
                                     expected.cached_tokens, expected.usage_seen)


def test_a_streamed_turns_pace_is_its_time_after_the_first_token_per_token_after_the_first():
    assert token_pace_us(10.0, 10.5, 11) == 50_000  # ten tokens in half a second after the first
    assert token_pace_us(None, 10.5, 11) == 0  # not streamed: no first token was seen
    assert token_pace_us(10.0, 10.5, 1) == 0 and token_pace_us(10.0, 10.5, 0) == 0  # one token, or no usage
    assert token_pace_us(10.0, 10.0002, 40) == 0  # the rest came with the first token: no decode step seen

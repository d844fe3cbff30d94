"""decide: label scoring with plain values, and the tool end to end through
scheduler, dataplane and fake engines (one of them a one-pass classifier)."""

from __future__ import annotations

import json
import math

import httpx
import pytest
from mcp import Client

from luftpause.runtime.classify import ClassifyError, checked_labels, score_labels
from luftpause.dev.stack import MODEL, Stack


def test_labels_are_scored_by_their_first_tokens_log_probability():
    top = [{"token": " pos", "logprob": -0.1}, {"token": "neg", "logprob": -2.0}, {"token": "p", "logprob": -5.0}]
    decision = score_labels(top, ["positive", "negative", "neutral"])
    assert decision["label"] == "positive"
    assert decision["unscored"] == ["neutral"]
    assert math.isclose(sum(decision["probabilities"].values()), 1.0)
    assert decision["probabilities"]["positive"] == pytest.approx(1 / (1 + math.exp(-1.9)))


def test_a_lone_letter_does_not_score_a_longer_label():
    """SmolLM2 on "The server crashed and lost my data." with [apple, banana]: its top token
    was "The"; "A" and "I" are articles and pronouns, not the start of a label."""
    top = [{"token": "The", "logprob": -0.2}, {"token": "A", "logprob": -2.5}, {"token": "I", "logprob": -3.0},
           {"token": " S", "logprob": -3.2}, {"token": " ban", "logprob": -6.0}]
    assert score_labels(top, ["apple", "banana"]) == {"label": "banana", "probabilities": {"banana": 1.0},
                                                       "unscored": ["apple"]}
    assert score_labels(top, ["important", "spam"])["label"] is None
    assert score_labels([{"token": "B", "logprob": -1.0}, {"token": "a", "logprob": -2.0}], ["a", "b"])["label"] == "b"


def test_nothing_scored_means_no_label():
    assert score_labels([{"token": "x", "logprob": -1}], ["a", "b"]) == {
        "label": None, "probabilities": {}, "unscored": ["a", "b"]}


@pytest.mark.parametrize("labels", [["only"], [f"l{i}" for i in range(21)], ["a", " "], ["same", "same"]])
def test_label_count_and_content_are_checked(labels):
    with pytest.raises(ClassifyError):
        checked_labels(labels)


@pytest.fixture(scope="module")
def classifier_stack(tmp_path_factory):
    """One stack for the module's three calls: none of them leaves a run or a turn behind."""
    pool = {"endpoints": [
        {"name": "engine-a", "base_url": "{engine-a}", "models": [MODEL], "kind": "generative"},
        {"name": "engine-b", "base_url": "{engine-b}", "models": ["fake-classifier"], "kind": "one-pass"},
    ]}
    stack = Stack.on_free_ports(tmp_path_factory.mktemp("decide"), pool=pool,
                                engine_args=["--models", f"{MODEL},fake-classifier"],
                                env={"LUFTPAUSE_MESSAGES_WARM_UP": "off"})
    try:
        stack.start()
        yield stack
    finally:
        stack.stop()


async def decide(stack, arguments: dict) -> dict:
    async with Client(f"http://127.0.0.1:{stack.ports.runtime}/mcp") as client:
        result = await client.call_tool("decide", arguments)
    assert not result.is_error, result.content
    return json.loads(result.content[0].text)


async def test_decide_without_labels_uses_the_one_pass_classifier(classifier_stack):
    answer = await decide(classifier_stack, {"input": "what a lovely day"})
    assert answer["model"] == "fake-classifier"
    assert answer["label"] in ("negative", "positive")
    assert len(answer["classProbabilities"]) == 2
    assert math.isclose(sum(answer["classProbabilities"]), 1.0, rel_tol=1e-6)
    served = httpx.get(f"http://127.0.0.1:{classifier_stack.ports.engines[1]}/stats").json()["requests"]
    assert served >= 1


async def test_decide_with_labels_scores_them_with_one_short_turn(classifier_stack):
    labels = ["weather", "sports", "finance"]
    answer = await decide(classifier_stack, {"input": "rain tomorrow in Berlin", "labels": labels})
    assert answer["model"] == MODEL
    assert answer["label"] in labels
    assert set(answer["probabilities"]) | set(answer["unscored"]) == set(labels)
    assert math.isclose(sum(answer["probabilities"].values()), 1.0)
    status = httpx.get(f"http://127.0.0.1:{classifier_stack.ports.scheduler_http}/status").json()
    assert status["in_flight"] == 0 and status["runs"] == []  # the turn's run was ended at once


async def test_decide_rejects_bad_labels(classifier_stack):
    async with Client(f"http://127.0.0.1:{classifier_stack.ports.runtime}/mcp") as client:
        refused = await client.call_tool("decide", {"input": "x", "labels": ["just-one"]})
    assert refused.is_error and "2 to 20" in refused.content[0].text

"""Classifying an input: what the MCP ``decide`` tool does (the scheduler core's ``decide`` is
another thing: its entry point).

Without labels a one-pass classifier replica answers with its own labels. With 2–20
caller labels one interactive generative turn with ``max_tokens: 1`` is asked for the
answer, and each label is scored by the log-probability of its first token among the
turn's ``top_logprobs`` (a token of two characters or more that the label starts with,
never a lone letter of a longer label); labels whose first token is not among them are
``unscored``.
"""

from __future__ import annotations

import math
import uuid
from typing import Any

from luftpause.runtime.dataplane import DataplaneClient, TurnError, TurnIdentity
from luftpause.runtime.errors import RuntimeServiceError
from luftpause.vocabulary import INTERACTIVE

MIN_LABELS, MAX_LABELS = 2, 20
TOP_LOGPROBS = 20  # the most OpenAI-compatible engines return


class ClassifyError(RuntimeServiceError, ValueError):
    """Bad arguments to the decide tool."""


def checked_labels(labels: list[str] | None) -> list[str] | None:
    if labels is None:
        return None
    cleaned = list(dict.fromkeys(label.strip() for label in labels))
    if any(not label for label in cleaned):
        raise ClassifyError("labels must be non-empty strings")
    if not MIN_LABELS <= len(cleaned) <= MAX_LABELS:
        raise ClassifyError(f"give {MIN_LABELS} to {MAX_LABELS} distinct labels, or none to use a classifier's own")
    return cleaned


def decision_messages(text: str, labels: list[str]) -> list[dict[str, str]]:
    return [
        {"role": "system", "content": "Classify the input. Answer with exactly one of the labels, nothing else."},
        {"role": "user", "content": f"Input: {text}\n\nLabels: {', '.join(labels)}"},
    ]


def _scores_label(token: str, label: str) -> bool:
    """Whether ``token`` (stripped, lower case) can be ``label``'s first token: a prefix of
    it of at least two characters, or all of a one-character label. A lone letter such as
    "A" or "I" is far more often an article or a pronoun than the start of "apple" or
    "important", and scoring labels by it answers with whatever label shares its letter."""
    return bool(token) and label.startswith(token) and (len(token) >= 2 or token == label)


def score_labels(top_logprobs: list[dict[str, Any]], labels: list[str]) -> dict[str, Any]:
    """Each label's score is the log-probability of the longest listed token that can be
    its first token (case and surrounding space ignored; see ``_scores_label``); scores
    become probabilities over the scored labels."""
    candidates = [(str(entry.get("token", "")).strip().lower(), float(entry.get("logprob", -math.inf)))
                  for entry in top_logprobs]
    scores: dict[str, float] = {}
    for label in labels:
        matches = [(len(token), logprob) for token, logprob in candidates if _scores_label(token, label.lower())]
        if matches:
            scores[label] = max(matches)[1]
    unscored = [label for label in labels if label not in scores]
    if not scores:
        return {"label": None, "probabilities": {}, "unscored": unscored}
    peak = max(scores.values())
    weights = {label: math.exp(score - peak) for label, score in scores.items()}
    total = sum(weights.values())
    probabilities = {label: weight / total for label, weight in weights.items()}
    return {"label": max(probabilities, key=probabilities.__getitem__), "probabilities": probabilities,
            "unscored": unscored}


async def classify(dataplane: DataplaneClient, text: str, labels: list[str] | None, model: str | None,
                 caller: str) -> dict[str, Any]:
    if labels is None:
        model = model or await dataplane.one_pass_model()
        result = await dataplane.classify(model, text)
        probs = [float(p) for p in result.get("probs") or []]
        label = result.get("label")
        return {"label": label, "probabilities": {label: max(probs)} if probs and label else {},
                "classProbabilities": probs, "unscored": [], "model": model}
    model = model or await dataplane.default_model()
    handle = f"decide-{uuid.uuid4().hex[:16]}"
    body = {"model": model, "messages": decision_messages(text, labels), "max_tokens": 1,
            "logprobs": True, "top_logprobs": TOP_LOGPROBS}
    try:
        reply = await dataplane.chat(body, TurnIdentity(handle, INTERACTIVE, caller))
    finally:
        await dataplane.end_run(handle)
    content = (reply.logprobs or {}).get("content") or []
    if not content:
        raise TurnError("the engine returned no logprobs; it cannot score labels")
    return {**score_labels(content[0].get("top_logprobs") or [], labels), "model": model}

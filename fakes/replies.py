"""What the fake engine answers: pure functions from a chat request to a reply.

Kept free of I/O and clocks so the reply rules (tool call or text, token counts,
``max_tokens`` caps) can be tested with plain values and reused by any server shell.
Tokens are approximated the same way everywhere: about four characters per token for
prompts and tool-call arguments, one token per word of a text reply.

The user's request (the words a tool call's arguments and a text reply are made of) is
read as a model reads its prompt: the last user message that holds words the user typed,
without the blocks a harness adds to user messages (``<system-reminder>`` of Claude Code
and opencode, ``<environment_context>`` and AGENTS.md ``<INSTRUCTIONS>`` of Codex, ...;
see :data:`HARNESS_BLOCK`).
"""

from __future__ import annotations

import hashlib
import json
import math
import re
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, replace
from typing import Any

from luftpause.fakes import faults as fault_directives
from luftpause.fakes.faults import Faults

CHARS_PER_TOKEN = 4

# Words a text reply is made of after the topic words; deterministic, so replies of
# equal length are identical and easy to compare in tests.
_FILLER = (
    "this is a placeholder answer from the fake engine about the topic above "
    "with no real model behind it and every word counts as one token"
).split()


class RequestError(ValueError):
    """A chat request the engine rejects; ``status`` is the HTTP status to answer with."""

    def __init__(self, message: str, status: int = 400, code: str = "invalid_request_error") -> None:
        super().__init__(message)
        self.status = status
        self.code = code

    def body(self) -> dict[str, Any]:
        """The OpenAI-style error body clients (and the ``openai`` SDK) understand."""
        return {"error": {"message": str(self), "type": self.code, "param": None, "code": self.status}}


@dataclass(frozen=True)
class ToolCall:
    id: str
    name: str
    arguments: str  # JSON text, as OpenAI sends it


@dataclass(frozen=True)
class Reply:
    """One planned completion: either ``text`` or ``tool_calls`` (one, or several in one
    message, as engines emit parallel calls), plus its accounting."""

    text: str | None
    tool_calls: tuple[ToolCall, ...]
    finish_reason: str  # "stop" | "tool_calls" | "length"
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0  # prompt tokens found in the prefix cache (set by the engine)

    def usage(self) -> dict[str, Any]:
        """OpenAI ``usage``, with the prefix-cache hit as SGLang and vLLM report it."""
        return {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "total_tokens": self.prompt_tokens + self.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": self.cached_tokens},
        }

    def assistant_message(self) -> dict[str, Any]:
        """The message a client sends back as the next turn's history."""
        message: dict[str, Any] = {"role": "assistant", "content": self.text}
        if self.tool_calls:
            message["tool_calls"] = [
                {"id": call.id, "type": "function", "function": {"name": call.name, "arguments": call.arguments}}
                for call in self.tool_calls
            ]
        return message


@dataclass(frozen=True)
class ReplyRules:
    """The knobs that shape replies (from the engine's CLI)."""

    tool_calls: int = 2  # answer with a tool call while fewer earlier calls than this
    reply_tokens: int = 12  # words in a text reply


def tokens_for_chars(chars: int) -> int:
    return max(1, math.ceil(chars / CHARS_PER_TOKEN))


def content_text(content: Any) -> str:
    """Text of a message ``content``: a string or a list of ``{"type": "text"}`` parts."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return " ".join(part.get("text", "") for part in content if isinstance(part, dict))
    return ""


def message_chars(message: dict[str, Any]) -> int:
    """Characters a message puts into the prompt: its text and any tool calls it made."""
    chars = len(content_text(message.get("content")))
    for call in message.get("tool_calls") or []:
        function = call.get("function") or {}
        chars += len(str(function.get("name", ""))) + len(str(function.get("arguments", "")))
    return chars


def prompt_tokens(messages: list[dict[str, Any]]) -> int:
    return tokens_for_chars(sum(message_chars(m) for m in messages))


def completion_cap(body: dict[str, Any]) -> int | None:
    """The reply's token cap: ``max_completion_tokens`` (newer name) or ``max_tokens``."""
    for key in ("max_completion_tokens", "max_tokens"):
        value = body.get(key)
        if value is not None:
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise RequestError(f"{key} must be a positive integer")
            return value
    return None


def validate(body: Any, models: tuple[str, ...]) -> None:
    """Reject what a real OpenAI-compatible server would reject, with its status codes."""
    if not isinstance(body, dict):
        raise RequestError("request body must be a JSON object")
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise RequestError("model is required")
    if model not in models:
        raise RequestError(f"The model `{model}` does not exist.", status=404, code="model_not_found")
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages or not all(isinstance(m, dict) for m in messages):
        raise RequestError("messages must be a non-empty list of objects")
    tools = body.get("tools")
    if tools is not None and not isinstance(tools, list):
        raise RequestError("tools must be a list")
    completion_cap(body)
    logprobs_request(body)


def render_message(message: dict[str, Any]) -> str:
    """One message as a chat template would lay it out (stable, so prefixes match)."""
    calls = "".join(
        "<|call|>" + str((c.get("function") or {}).get("name", "")) + str((c.get("function") or {}).get("arguments", ""))
        for c in message.get("tool_calls") or []
        if isinstance(c, dict)
    )
    return f"<|{message.get('role', '')}|>{content_text(message.get('content'))}{calls}<|end|>"


def render_prompt(body: dict[str, Any]) -> str:
    """The prompt text the engine "tokenises": offered tools first, then every message.

    A conversation's next turn renders to this text plus the reply and the new
    messages, which is what makes agent turns hit the prefix cache.
    """
    tools = body.get("tools")
    head = "<|tools|>" + json.dumps(tools, sort_keys=True, separators=(",", ":")) if tools else ""
    return head + "".join(render_message(m) for m in body["messages"])


# Blocks a harness writes into user messages beside (or instead of) what the user typed,
# as recorded on the wire from the pinned CLIs (tests/fakes/test_user_request.py):
# - Claude Code 2.1.x: ``<system-reminder>`` blocks before the prompt (attribution, CLAUDE.md
#   context, a background task's ``<task-notification>``), a text block of their own or
#   inline in one string (the dataplane joins a user turn's text blocks);
# - opencode: ``<system-reminder>`` (plan mode, a file the user opened, a moved directory);
#   its own goal extraction drops them the same way (``SYSTEM_REMINDER_RE``);
# - Codex: its contextual user messages, ``<environment_context>``, ``# AGENTS.md
#   instructions for <dir>`` with ``<INSTRUCTIONS>``, ``<user_instructions>`` (older
#   versions), ``<user_shell_command>``, ``<turn_aborted>``, ``<subagent_notification>``.
HARNESS_BLOCK = re.compile(
    r"<(system-reminder|environment_context|user_instructions|user_shell_command|turn_aborted"
    r"|subagent_notification)>.*?</\1>"
    r"|# AGENTS\.md instructions for [^\n]*\s*<INSTRUCTIONS>.*?</INSTRUCTIONS>",
    re.DOTALL,
)


def request_text(text: str) -> str:
    """What the user typed in one user message's ``text``: without harness blocks, and
    without the double quotes ``opencode run`` puts around a message argument that holds
    spaces (``"echo hello"``); "" when the message is harness blocks only."""
    text = " ".join(HARNESS_BLOCK.sub(" ", text).split())
    if len(text) >= 2 and text[0] == text[-1] == '"' and '"' not in text[1:-1]:
        text = text[1:-1].strip()
    return text


def user_request(messages: list[dict[str, Any]]) -> str:
    """The user's request: the text of the last user message that holds any besides what
    a harness adds. A user message of harness blocks only (a reminder sent beside tool
    results, a background task's notification) is not a new request: the one before it
    still stands, as a model reading the conversation takes it."""
    for message in reversed(messages):
        if message.get("role") == "user":
            text = request_text(content_text(message.get("content")))
            if text:
                return text
    return ""


def topic_phrase(messages: list[dict[str, Any]], words: int = 6) -> str:
    """A short phrase from the user's request, so replies visibly relate to the ask."""
    phrase = " ".join(fault_directives.strip(user_request(messages)).split()[:words])
    return phrase or "the question"


def earlier_tool_calls(messages: list[dict[str, Any]]) -> int:
    """Assistant turns that already called tools: the agent loop's progress so far."""
    return sum(1 for m in messages if m.get("role") == "assistant" and m.get("tool_calls"))


def _function_of(tool: Any) -> dict[str, Any] | None:
    if isinstance(tool, dict) and isinstance(tool.get("function"), dict) and tool["function"].get("name"):
        return tool["function"]
    return None


def chosen_tool(body: dict[str, Any], preferred: str | None = None) -> dict[str, Any] | None:
    """The tool to call: the one ``tool_choice`` names, else the ``preferred`` one (the
    prompt's ``[[fake:tool=NAME]]``) when offered, else the first offered.

    ``tool_choice: "none"`` means the client wants text, like a real engine honours it.
    """
    functions = [f for f in map(_function_of, body.get("tools") or []) if f is not None]
    choice = body.get("tool_choice")
    if not functions or choice == "none":
        return None
    wanted = (choice.get("function") or {}).get("name") if isinstance(choice, dict) else preferred
    for function in functions:
        if function["name"] == wanted:
            return function
    return functions[0]


def tools_to_call(body: dict[str, Any], first: dict[str, Any], count: int) -> list[dict[str, Any]]:
    """The ``count`` tools one message calls: ``first``, then the offered tools after it
    in order, round again when fewer are offered (a tool may be called twice). One when
    the request says ``parallel_tool_calls: false`` or names a tool in ``tool_choice``."""
    if count <= 1 or body.get("parallel_tool_calls") is False or isinstance(body.get("tool_choice"), dict):
        return [first]
    functions = [f for f in map(_function_of, body.get("tools") or []) if f is not None]
    start = next(i for i, f in enumerate(functions) if f is first)
    return [functions[(start + i) % len(functions)] for i in range(count)]


def value_for_schema(schema: Any, phrase: str) -> Any:
    """A plausible value of the schema's type; strings carry the user's phrase."""
    if not isinstance(schema, dict):
        return phrase
    if schema.get("enum"):
        return schema["enum"][0]
    kind = schema.get("type", "string")
    if isinstance(kind, list):
        kind = next((k for k in kind if k != "null"), "null")
    simple = {"integer": 1, "number": 1.0, "boolean": True, "array": [], "null": None}
    if kind in simple:
        return simple[kind]
    if kind == "object":
        return arguments_for_schema(schema, phrase)
    return phrase


def arguments_for_schema(schema: Any, phrase: str) -> dict[str, Any]:
    """Arguments that satisfy a JSON schema's ``required`` list (optional ones are left out)."""
    if not isinstance(schema, dict):
        return {}
    properties = schema.get("properties") or {}
    return {name: value_for_schema(properties.get(name), phrase) for name in schema.get("required") or []}


def new_tool_call_id() -> str:
    return "call_" + uuid.uuid4().hex


def text_words(phrase: str, count: int) -> list[str]:
    """``count`` words: the topic phrase first, then filler, cycling as needed."""
    source = [*phrase.split(), *_FILLER]
    return [source[i % len(source)] for i in range(count)]


def tool_arguments(tool: dict[str, Any], phrase: str, faults: Faults) -> dict[str, Any]:
    """The arguments of a call to ``tool``, misshapen as ``faults`` ask."""
    if faults.schema_as_arguments:
        schema = tool.get("parameters")
        arguments = dict(schema) if isinstance(schema, dict) else {}
    else:
        arguments = arguments_for_schema(tool.get("parameters"), phrase)
    return fault_directives.stringify_scalars(arguments) if faults.string_scalars else arguments


def plan_reply(body: dict[str, Any], rules: ReplyRules, faults: Faults | None = None) -> Reply:
    """Decide the whole reply up front; the server then only paces its delivery.

    A tool call is answered while tools are offered and the conversation holds fewer
    than ``rules.tool_calls`` assistant tool-call turns; otherwise text. When the reply
    would exceed the token cap it is cut, like an engine stopping at ``max_tokens``: text
    is truncated, and a tool call that does not fit degrades to capped text, because an
    engine cut off mid-call returns no parseable call. ``faults`` can misshape a tool
    call the way small models do (see :mod:`luftpause.fakes.faults`).
    """
    faults = faults or Faults()
    messages = body["messages"]
    prompt = prompt_tokens(messages)
    cap = completion_cap(body)
    phrase = topic_phrase(messages)
    tool = chosen_tool(body, faults.tool)
    if tool is not None and earlier_tool_calls(messages) < rules.tool_calls:
        if faults.tool_call_as_text:
            arguments = json.dumps(tool_arguments(tool, phrase, faults))
            text = json.dumps({"name": tool["name"], "arguments": json.loads(arguments)})
            tokens = tokens_for_chars(len(text))
            if cap is None or tokens <= cap:
                return Reply(text, (), "stop", prompt, tokens)
        else:
            calls = tuple(ToolCall(id=new_tool_call_id(), name=t["name"],
                                   arguments=json.dumps(tool_arguments(t, phrase, faults)))
                          for t in tools_to_call(body, tool, faults.parallel_calls))
            tokens = sum(tokens_for_chars(len(c.name) + len(c.arguments)) for c in calls)
            if cap is None or tokens <= cap:
                return Reply(None, calls, "tool_calls", prompt, tokens)
        return Reply(" ".join(text_words(phrase, cap)), (), "length", prompt, cap)
    words = max(1, rules.reply_tokens)
    if cap is not None and words > cap:
        return Reply(" ".join(text_words(phrase, cap)), (), "length", prompt, cap)
    return Reply(" ".join(text_words(phrase, words)), (), "stop", prompt, words)


def continuation(body: dict[str, Any]) -> tuple[dict[str, Any], str] | None:
    """A request to continue its final assistant message (``continue_final_message``, as
    vLLM and SGLang take it): the request as it stood before that message (without its
    token cap) and the message's text; None for an ordinary request. Misuse is a 400, as
    vLLM answers it (its ``add_generation_prompt`` defaults to true)."""
    if not body.get("continue_final_message"):
        return None
    if body.get("add_generation_prompt", True):
        raise RequestError("Cannot set both `continue_final_message` and `add_generation_prompt` to True.")
    messages = body["messages"]
    if messages[-1].get("role") != "assistant":
        raise RequestError("continue_final_message needs an assistant message last, to continue")
    before = {k: v for k, v in body.items() if k not in ("max_tokens", "max_completion_tokens")}
    before["messages"] = messages[:-1]
    return before, content_text(messages[-1].get("content"))


def plan_continuation(body: dict[str, Any], before: dict[str, Any], prefix: str, rules: ReplyRules,
                      faults: Faults | None = None) -> tuple[Reply, int]:
    """The reply that continues ``prefix``: the reply the conversation before it gets,
    from the word ``prefix`` reached on (each word after a space), cut at this request's
    own token cap; and how many words ``prefix`` already held. A reply that is a tool
    call is made whole (a model may call a tool after some text)."""
    whole = plan_reply(before, rules, faults)
    prompt = prompt_tokens(body["messages"])
    if whole.text is None:
        return replace(whole, prompt_tokens=prompt), 0
    done = len(prefix.split())
    rest = whole.text.split(" ")[done:]
    cap, finish = completion_cap(body), whole.finish_reason
    if cap is not None and len(rest) > cap:
        rest, finish = rest[:cap], "length"
    return Reply("".join(" " + word for word in rest), (), finish, prompt, len(rest)), done


# --- wire format -------------------------------------------------------------------


@dataclass(frozen=True)
class Envelope:
    """The fields every chunk and completion of one response share."""

    id: str
    model: str
    created: int

    @classmethod
    def new(cls, model: str) -> Envelope:
        return cls(id="chatcmpl-" + uuid.uuid4().hex, model=model, created=int(time.time()))

    def chunk(
        self, delta: dict[str, Any], finish_reason: str | None = None, logprobs: dict[str, Any] | None = None
    ) -> dict[str, Any]:
        return {
            "id": self.id,
            "object": "chat.completion.chunk",
            "created": self.created,
            "model": self.model,
            "choices": [{"index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}],
        }


def stream_pieces(reply: Reply) -> Iterator[dict[str, Any]]:
    """The deltas after the role chunk, one per generated token (roughly).

    Text streams word by word; a tool call first announces id, type and name, then
    streams its arguments in token-sized slices, as OpenAI-compatible engines do; several
    calls in one message follow each other, each under its own ``index``.
    """
    if reply.tool_calls:
        for index, call in enumerate(reply.tool_calls):
            head = {"index": index, "id": call.id, "type": "function",
                    "function": {"name": call.name, "arguments": ""}}
            yield {"tool_calls": [head]}
            args = call.arguments
            for start in range(0, len(args), CHARS_PER_TOKEN):
                yield {"tool_calls": [{"index": index,
                                       "function": {"arguments": args[start : start + CHARS_PER_TOKEN]}}]}
        return
    words = (reply.text or "").split(" ")
    for i, word in enumerate(words):
        if i == 0 and not word and len(words) > 1:
            continue  # a continuation's text starts after a space
        yield {"content": word if i == 0 else " " + word}


def merge_deltas(deltas: list[dict[str, Any]]) -> dict[str, Any]:
    """Several token deltas as one (an engine streaming every N tokens)."""
    if len(deltas) == 1:
        return deltas[0]
    if all("tool_calls" in d for d in deltas):
        merged: list[dict[str, Any]] = []  # one entry per call the deltas touch, in order
        for delta in deltas:
            piece = delta["tool_calls"][0]
            if not merged or merged[-1]["index"] != piece["index"]:
                merged.append(json.loads(json.dumps(piece)))
                merged[-1].setdefault("function", {}).setdefault("arguments", "")
            else:
                merged[-1]["function"]["arguments"] += piece.get("function", {}).get("arguments", "")
        return {"tool_calls": merged}
    return {"content": "".join(d.get("content") or "" for d in deltas)}


def delta_text(delta: dict[str, Any]) -> str:
    """The generated text of one delta (a tool call's name and arguments count too)."""
    if "tool_calls" in delta:
        return "".join(str(call.get("function", {}).get("name", "")) + str(call.get("function", {}).get("arguments", ""))
                       for call in delta["tool_calls"])
    return str(delta.get("content") or "")


def _score(*parts: str) -> float:
    digest = hashlib.blake2b("\x1f".join(parts).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") / 2**64


def logprob_entries(tokens: list[str], candidates: list[str], top: int, seed: str, start: int = 0
                    ) -> list[dict[str, Any]]:
    """OpenAI ``logprobs.content`` for ``tokens`` (at positions ``start``…): each chosen
    token is the most likely; the alternatives are words of the prompt, so a caller
    scoring labels it listed in the prompt finds them among ``top_logprobs``.
    Deterministic per seed and position."""
    entries = []
    for position, token in enumerate(tokens, start):
        chosen = -0.05 - 0.5 * _score(seed, str(position), token)
        alternatives = sorted((c for c in candidates if c != token),
                              key=lambda c: _score(seed, str(position), c), reverse=True)
        top_list = [{"token": token, "logprob": chosen, "bytes": list(token.encode())}]
        for rank, word in enumerate(alternatives[: max(0, top - 1)]):
            logprob = chosen - 1.0 - rank - _score(seed, word)
            top_list.append({"token": word, "logprob": logprob, "bytes": list(word.encode())})
        entries.append({"token": token, "logprob": chosen, "bytes": list(token.encode()),
                        "top_logprobs": top_list[:top]})
    return entries


def logprob_candidates(messages: list[dict[str, Any]]) -> list[str]:
    """Distinct words of the user's request, in order (the likely "vocabulary")."""
    words: list[str] = []
    for raw in fault_directives.strip(user_request(messages)).split():
        word = raw.strip(".,;:!?()[]{}\"'")
        if word and word not in words:
            words.append(word)
    return words


def logprobs_request(body: dict[str, Any]) -> int | None:
    """``top_logprobs`` asked for (0 when only ``logprobs: true``), or None."""
    if not body.get("logprobs"):
        return None
    top = body.get("top_logprobs")
    if top is None:
        return 0
    if isinstance(top, bool) or not isinstance(top, int) or not 0 <= top <= 20:
        raise RequestError("top_logprobs must be an integer from 0 to 20")
    return top


def closing_chunks(reply: Reply, envelope: Envelope, include_usage: bool) -> Iterator[dict[str, Any]]:
    """The chunks after the last token: finish reason, then usage when asked for."""
    yield envelope.chunk({}, reply.finish_reason)
    if include_usage:
        usage_chunk = envelope.chunk({})
        usage_chunk["choices"] = []
        usage_chunk["usage"] = reply.usage()
        yield usage_chunk


def completion_body(reply: Reply, envelope: Envelope, logprobs: dict[str, Any] | None = None) -> dict[str, Any]:
    """The non-streaming ``chat.completion`` object."""
    message = reply.assistant_message()
    return {
        "id": envelope.id,
        "object": "chat.completion",
        "created": envelope.created,
        "model": envelope.model,
        "choices": [{"index": 0, "message": message, "logprobs": logprobs, "finish_reason": reply.finish_reason}],
        "usage": reply.usage(),
    }


def wants_usage_chunk(body: dict[str, Any]) -> bool:
    options = body.get("stream_options")
    return isinstance(options, dict) and bool(options.get("include_usage"))

"""The fake engine reads the user's request as a model reads its prompt: without the blocks a
harness writes into user messages (``<system-reminder>``, ``<environment_context>``, AGENTS.md
``<INSTRUCTIONS>``, ...), so a tool call's arguments are the user's words.

``data/harness_requests.json`` holds chat requests as the fake engine received them from the
dataplane, recorded on 127.0.0.1 (a recording proxy between the dataplane and a fake engine)
while the pinned CLIs of ``tests/e2e`` ran against the stack: Claude Code 2.1.332, Codex CLI
0.171.0 and opencode 1.18.33, each also the newest in the npm registry when recorded. System
and tool messages are cut to their start, and only the first three tools are kept; user
messages are whole. Assistant turns in them are the fake engine's replies from before it
skipped those blocks (hence the reminder text in their tool arguments).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from luftpause.fakes.faults import from_messages
from luftpause.fakes.replies import ReplyRules, plan_reply, user_request

RECORDED = json.loads((Path(__file__).parent / "data" / "harness_requests.json").read_text())

# What each recorded request asks, as the user typed it.
REQUESTS = {
    "claude-code first turn, attribution reminder inline": "echo hello from luftpause",
    "claude-code tool round": "echo hello from luftpause",
    "claude-code CLAUDE.md context reminder": "echo hello from luftpause",
    "claude-code task notifications after the request": "what is in this directory?",
    "codex first turn": "echo hello from codex",
    "codex AGENTS.md, resumed": "and once more",
    "opencode first turn, quoted argument": "echo hello from opencode",
    "opencode title request": "echo hello from opencode",
    "opencode plan mode reminder after the request": "list the files",
}


def test_every_recorded_request_has_its_expectation():
    assert set(RECORDED) == set(REQUESTS)


@pytest.mark.parametrize("name", sorted(REQUESTS))
def test_the_request_read_from_a_recorded_harness_turn_is_what_the_user_typed(name):
    assert user_request(RECORDED[name]["request"]["messages"]) == REQUESTS[name]


@pytest.mark.parametrize("name", [
    "claude-code first turn, attribution reminder inline",
    "claude-code tool round",
    "claude-code CLAUDE.md context reminder",
    "codex first turn",
    "opencode first turn, quoted argument",
    "opencode plan mode reminder after the request",
])
def test_a_harness_shell_tool_is_called_with_the_users_command_not_its_reminders(name):
    """Bash / exec_command / bash is offered first: its command is the user's words (the
    Claude Code and opencode shells would otherwise run ``<system-reminder> Attribution …``
    and ``"echo …"``, quotes included)."""
    body = RECORDED[name]["request"]
    reply = plan_reply(body, ReplyRules())
    (call,) = reply.tool_calls
    assert call.name == body["tools"][0]["function"]["name"]
    arguments = json.loads(call.arguments)
    assert arguments == {"cmd" if call.name == "exec_command" else "command": REQUESTS[name]}


@pytest.mark.parametrize("name", ["claude-code task notifications after the request", "codex AGENTS.md, resumed",
                                  "opencode title request"])
def test_a_text_reply_starts_with_the_users_request(name):
    reply = plan_reply(RECORDED[name]["request"], ReplyRules())
    assert reply.tool_calls == ()
    assert reply.text.startswith(REQUESTS[name] + " this is a placeholder answer")


def test_a_reminder_in_a_text_part_of_its_own_is_skipped():
    """Claude Code's Messages shape, two text blocks, as chat content parts."""
    messages = [{"role": "user", "content": [
        {"type": "text", "text": "<system-reminder>\nAs you answer the user's questions, you can use the following "
                                 "context:\n# claudeMd\nbe brief\n</system-reminder>\n"},
        {"type": "text", "text": "count the lines of README.md"}]}]
    assert user_request(messages) == "count the lines of README.md"


def test_a_user_message_of_reminders_only_leaves_the_earlier_request_standing():
    call = {"id": "call_1", "type": "function", "function": {"name": "Bash", "arguments": "{}"}}
    messages = [
        {"role": "user", "content": "run the tests"},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_1", "content": "ok"},
        {"role": "user", "content": "<system-reminder>The TodoWrite tool hasn't been used recently.</system-reminder>"},
    ]
    assert user_request(messages) == "run the tests"


def test_codex_contextual_blocks_are_skipped_wherever_they_stand():
    text = ("# AGENTS.md instructions for /repo\n\n<INSTRUCTIONS>\nbe brief\n</INSTRUCTIONS>"
            "<environment_context>\n  <cwd>/repo</cwd>\n</environment_context>"
            "<user_instructions>old style</user_instructions>"
            "<turn_aborted>interrupted</turn_aborted> fix the build")
    assert user_request([{"role": "user", "content": text}]) == "fix the build"


def test_only_a_wholly_quoted_request_loses_its_quotes():
    assert user_request([{"role": "user", "content": '"echo hi"'}]) == "echo hi"
    assert user_request([{"role": "user", "content": 'say "hi" now'}]) == 'say "hi" now'
    assert user_request([{"role": "user", "content": '"a b" "c d"'}]) == '"a b" "c d"'


def test_no_request_at_all_is_the_question():
    body = {"model": "m", "messages": [{"role": "user", "content": "<system-reminder>x</system-reminder>"}]}
    assert plan_reply(body, ReplyRules(reply_tokens=2)).text == "the question"


def test_a_directive_still_picks_the_tool_beside_a_reminder():
    tools = [{"type": "function", "function": {"name": name, "parameters": {
        "type": "object", "properties": {"q": {"type": "string"}}, "required": ["q"]}}} for name in ("Agent", "run")]
    body = {"model": "m", "tools": tools, "messages": [{"role": "user", "content": (
        "<system-reminder>\nAttribution …\n</system-reminder>\n\nresearch tides [[fake:tool=run]]")}]}
    (call,) = plan_reply(body, ReplyRules(), from_messages(body["messages"])).tool_calls
    assert (call.name, json.loads(call.arguments)) == ("run", {"q": "research tides"})

"""What a simulated agent run looks like: its prompt, its tools, its tool results. Pure and
seeded, so every row of a benchmark sees the same sequence of runs; durations are model
seconds (the drivers multiply them by the time scale to sleep)."""

from __future__ import annotations

import random
from dataclasses import dataclass

LOOKUP_TOOL = {"type": "function", "function": {
    "name": "lookup", "description": "Look a fact up in the knowledge base and return a short passage.",
    "parameters": {"type": "object", "properties": {"query": {"type": "string", "description": "what to look up"}},
                   "required": ["query"]}}}

# A system prompt every agent of a benchmark shares (tool instructions, house rules),
# as real harnesses send: a cross-run prefix a cache can hold.
SYSTEM_PROMPT = (
    "You are a careful research agent working inside an automated pipeline. Use the "
    "lookup tool when a fact is missing, at most a few times, then answer concisely "
    "with the facts you found. Cite the passages you used. Never invent sources. "
) * 6

_WORDS = (
    "river harbour engine ledger granite orchard signal lantern meadow copper "
    "winter archive compass falcon quarry velvet summit canal thunder maple "
    "beacon saddle glacier mosaic pepper harvest tunnel violet anchor prairie"
).split()


@dataclass(frozen=True)
class Workload:
    """The shape of one class of agent runs."""

    service_class: str = "batch"
    context_chars_min: int = 1000
    context_chars_max: int = 2000
    tool_calls_min: int = 1
    tool_calls_max: int = 3
    tool_delay_s: float = 2.0  # model seconds per tool call (own-loop agents wait locally)
    tool_result_chars: int = 600
    max_tokens: int = 256
    # The answer turn (tool calls spent) lists the tool again with tool_choice "none", as
    # luftpause's runtime does, instead of dropping it (a different prompt prefix).
    answer_keeps_tools: bool = False


@dataclass(frozen=True)
class RunPlan:
    """One run: its task text and how many tool calls it will allow."""

    task: str
    tool_calls: int


def words(rng: random.Random, chars: int) -> str:
    out: list[str] = []
    size = 0
    while size < chars:
        out.append(rng.choice(_WORDS))
        size += len(out[-1]) + 1
    return " ".join(out)[:chars]


def plan_run(workload: Workload, seed: str) -> RunPlan:
    """The run for ``seed`` (e.g. ``"b2:batch:7:3"``): same seed, same run."""
    rng = random.Random(seed)
    chars = rng.randint(workload.context_chars_min, max(workload.context_chars_min, workload.context_chars_max))
    task = f"Task {seed}: investigate and summarise the following notes. " + words(rng, chars)
    calls = rng.randint(workload.tool_calls_min, max(workload.tool_calls_min, workload.tool_calls_max))
    return RunPlan(task=task, tool_calls=calls)


def tool_result(seed: str, call: int, chars: int) -> str:
    rng = random.Random(f"{seed}:tool:{call}")
    return f"Lookup result {call}: " + words(rng, chars)

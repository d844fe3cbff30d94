"""What a simulated agent run looks like: its prompt, its tools, its tool results. Pure and
seeded, so every row of a benchmark sees the same sequence of runs; durations are model
seconds (the drivers multiply them by the time scale to sleep)."""

from __future__ import annotations

import math
import random
from dataclasses import dataclass
from statistics import NormalDist

from luftpause.fakes.replies import CHARS_PER_TOKEN

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
class TruncatedLogNormal:
    """A log-normal through ``median`` with log-spread ``sigma``, kept to [``low``, ``high``]:
    one uniform draw, inverted through the CDF restricted to the interval (seeded, exact)."""

    median: float
    sigma: float
    low: float
    high: float

    def draw(self, rng: random.Random) -> float:
        unit = NormalDist()
        lo, hi = (unit.cdf(math.log(x / self.median) / self.sigma) for x in (self.low, self.high))
        value = self.median * math.exp(self.sigma * unit.inv_cdf(lo + rng.random() * (hi - lo)))
        return min(self.high, max(self.low, value))


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
    # Per-call draws (the regime map's declared cells); unset, every call is the same:
    tool_delay: TruncatedLogNormal | None = None  # each call's pause, model seconds; None: tool_delay_s
    tool_result_chars_max: int = 0  # each result uniform in [tool_result_chars, this]; 0: tool_result_chars
    # The run answers before its conversation would pass this many characters, as a coding
    # harness ends a run whose context is full (SWE-agent's exit_context); 0: no cap
    context_chars_cap: int = 0


@dataclass(frozen=True)
class RunPlan:
    """One run: its task text, how many tool calls it will allow, and each call's pause
    (model seconds) and result size (characters)."""

    task: str
    tool_calls: int
    tool_delays: tuple[float, ...] = ()
    result_chars: tuple[int, ...] = ()


# What a tool call adds to the conversation besides its result, and what every prompt
# carries besides its messages' text, as the fake engine renders them (fakes/replies.py's
# render_prompt: role tags, the call's name and arguments, the offered tools): estimates
# rounded up, so a capped run stays under its cap.
CALL_CHARS = 160
HEAD_CHARS = 400


def words(rng: random.Random, chars: int) -> str:
    out: list[str] = []
    size = 0
    while size < chars:
        out.append(rng.choice(_WORDS))
        size += len(out[-1]) + 1
    return " ".join(out)[:chars]


def plan_run(workload: Workload, seed: str) -> RunPlan:
    """The run for ``seed`` (e.g. ``"b2:batch:7:3"``): same seed, same run. A workload
    without per-call draws takes nothing more from the seed than before."""
    rng = random.Random(seed)
    chars = rng.randint(workload.context_chars_min, max(workload.context_chars_min, workload.context_chars_max))
    task = f"Task {seed}: investigate and summarise the following notes. " + words(rng, chars)
    calls = rng.randint(workload.tool_calls_min, max(workload.tool_calls_min, workload.tool_calls_max))
    delays = tuple(workload.tool_delay.draw(rng) if workload.tool_delay else workload.tool_delay_s
                   for _ in range(calls))
    top = max(workload.tool_result_chars, workload.tool_result_chars_max)
    sizes = tuple(rng.randint(workload.tool_result_chars, top) if workload.tool_result_chars_max
                  else workload.tool_result_chars for _ in range(calls))
    plan = RunPlan(task=task, tool_calls=calls, tool_delays=delays, result_chars=sizes)
    if workload.context_chars_cap:
        fit = sum(1 for size in conversation_chars(plan)[1:] if size <= workload.context_chars_cap)
        plan = RunPlan(task, fit, delays[:fit], sizes[:fit])
    return plan


def conversation_chars(plan: RunPlan) -> list[int]:
    """The prompt's length (characters, as rendered; estimated) at each LLM turn of the run:
    the system prompt and task, then after each tool call and its result."""
    out = [HEAD_CHARS + len(SYSTEM_PROMPT) + len(plan.task)]
    for size in plan.result_chars:
        out.append(out[-1] + CALL_CHARS + size)
    return out


def conversation_tokens(plan: RunPlan) -> list[int]:
    """:func:`conversation_chars` in the fake engine's tokens."""
    return [math.ceil(chars / CHARS_PER_TOKEN) for chars in conversation_chars(plan)]


def tool_result(seed: str, call: int, chars: int) -> str:
    rng = random.Random(f"{seed}:tool:{call}")
    return f"Lookup result {call}: " + words(rng, chars)

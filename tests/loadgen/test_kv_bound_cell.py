"""The regime map's declared KV-bound cell (loadgen/regimes.py, "Declared cells"): its
workload generated without any engine has the declared shape — turns, contexts growing into
the tens of thousands of tokens, tool pauses within 1-30 s, live contexts over the KV pools —
and the cells are selectable without touching the frozen preset. No engine, no luftpause run."""

from __future__ import annotations

import statistics

from luftpause.fakes.engine import PRESETS
from luftpause.fakes.replies import ReplyRules, plan_reply, render_prompt, tokens_for_chars
from luftpause.loadgen import bench, regimes
from luftpause.loadgen.bench import BenchConfig
from luftpause.loadgen.workload import LOOKUP_TOOL, SYSTEM_PROMPT, conversation_tokens, plan_run, tool_result

PRESET = PRESETS["laptop-1b-sglang"]
RUNS = 300


def plans(service_class: str = "batch") -> list:
    workload = regimes.kv_bound_workload(service_class)
    return [plan_run(workload, f"kv-test-{service_class}-{k}") for k in range(RUNS)]


def test_the_declared_cells_are_selectable_and_leave_the_preset_alone(capsys) -> None:
    eager0, preset = (regimes.parse_cell(name) for name in regimes.DECLARED_CELLS)
    assert (eager0.workload, preset.workload) == ("kv-bound", "kv-bound")
    assert dict(eager0.engine_overrides(PRESET)) == {"tool_calls": 64.0, "context_tokens": 32768.0,
                                                     "decode_eager_ms": 0.0}
    assert dict(preset.engine_overrides(PRESET)) == {"tool_calls": 64.0, "context_tokens": 32768.0}
    config = preset.config(BenchConfig(repeats=1))
    assert (config.window_s, config.warmup_s) == (1200.0, 300.0)
    assert preset.config(BenchConfig(), frozenset({"window_s"})).window_s == BenchConfig().window_s
    values = config.engine_values()
    assert values["kv_tokens"] == 36000 and values["decode_eager_ms"] == 20.0 and values["context_tokens"] == 32768
    assert (PRESET["kv_tokens"], PRESET["context_tokens"], PRESET["tool_calls"]) == (36000, 8192, 8)  # frozen
    regimes.main(["--list", "--declared"])
    assert capsys.readouterr().out.split() == list(regimes.DECLARED_CELLS)
    assert "workload=kv-bound" not in [c.name for c in regimes.cell_grid()]  # declared, not in the measured map


def test_runs_have_coding_agent_turns_and_contexts_in_the_tens_of_thousands() -> None:
    batch = plans()
    assert batch == plans()  # seeded: the same seeds, the same runs
    calls = [p.tool_calls for p in batch]
    assert min(calls) >= regimes.KV_BOUND_TOOL_CALLS[0] and max(calls) <= regimes.KV_BOUND_TOOL_CALLS[1]
    assert 25 <= statistics.mean(calls) <= 32  # uniform 10-50, the longest ended by the context cap
    final = [conversation_tokens(p)[-1] for p in batch]
    assert max(final) <= regimes.KV_BOUND_CONTEXT_CAP_TOKENS
    assert statistics.median(final) >= 20_000 and statistics.quantiles(final, n=10)[-1] >= 28_000
    for p in batch:  # the context grows every turn, by each tool result
        steps = [b - a for a, b in zip(conversation_tokens(p), conversation_tokens(p)[1:])]
        assert all(300 <= step <= 900 + 40 for step in steps)
    assert plans("interactive")[0].tool_calls  # the interactive agents run the same shape


def test_tool_pauses_are_drawn_within_one_to_thirty_seconds() -> None:
    pauses = [d for p in plans() for d in p.tool_delays]
    assert len(pauses) > 5000 and min(pauses) >= 1.0 and max(pauses) <= 30.0
    assert 3.0 <= statistics.median(pauses) <= 4.3 and 5.5 <= statistics.mean(pauses) <= 7.5
    assert max(pauses) > 25.0 and min(pauses) < 1.1  # the whole window is drawn from
    assert 0.2 <= sum(d <= 2.0 for d in pauses) / len(pauses) <= 0.4  # short ones too (Continuum's 2 s pin)


def test_the_prompts_the_engine_sees_stay_under_the_served_context() -> None:
    """A run's turns replayed as an own-loop agent builds them, the fake engine's replies and
    rendering without an engine: the prompt tokens it would count reach tens of thousands,
    stay under the served context, and the plan's estimate is close and not below them."""
    workload = regimes.kv_bound_workload("batch")
    rules = ReplyRules(tool_calls=64)
    for seed in ("kv-replay-0", "kv-replay-1"):
        plan = plan_run(workload, seed)
        messages = [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": plan.task}]
        seen = []
        for call in range(plan.tool_calls + 1):
            body = {"messages": messages, "tools": [LOOKUP_TOOL], "max_tokens": 256,
                    **({"tool_choice": "none"} if call == plan.tool_calls else {})}
            seen.append(tokens_for_chars(len(render_prompt(body))))
            reply = plan_reply(body, rules)
            messages = [*messages, reply.assistant_message()]
            if call < plan.tool_calls:
                assert reply.tool_calls
                messages.append({"role": "tool", "tool_call_id": reply.tool_calls[0].id,
                                 "content": tool_result(seed, call + 1, plan.result_chars[call])})
        assert not reply.tool_calls  # the answer turn
        estimate = conversation_tokens(plan)
        assert all(e >= s and e - s <= 0.05 * s for e, s in zip(estimate, seen))
        assert seen[-1] <= 32768 - 256 and seen[-1] >= 10_000


def test_the_live_contexts_exceed_the_kv_pools_at_eager_zero_and_at_the_preset() -> None:
    groups = regimes.kv_bound_groups()
    assert [(g.count, g.workload.service_class) for g in groups] == [(4, "interactive"), (10, "batch")]
    one = regimes.live_context_tokens(groups[0].workload)
    assert 10_000 <= one <= 36_000  # one agent's context fits a replica; fourteen do not fit two
    for name in regimes.DECLARED_CELLS:
        cell = regimes.parse_cell(name)
        kv = cell.config(BenchConfig()).engine_values()["kv_tokens"]
        assert regimes.kv_pressure(groups, kv, cell.replicas) >= regimes.KV_BOUND_PRESSURE


def test_a_declared_cell_runs_its_agents_in_b2s_place() -> None:
    declared = regimes.parse_cell("workload=kv-bound").config(BenchConfig())
    groups = bench._agents(declared, "proxy")
    assert declared.workload == "kv-bound"
    assert [g.count for g in groups] == [4, 10] and groups[0].workload.context_chars_cap == 120_000
    ordinary = regimes.parse_cell("eager=0").config(BenchConfig())
    assert ordinary.workload == "" and bench._agents(ordinary, "proxy") == bench.b2_groups(True, False)

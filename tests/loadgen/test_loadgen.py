"""The load generator against an in-process fake engine: runs, headers, summaries."""

from __future__ import annotations

import argparse
import json
import asyncio
import sys
from pathlib import Path
from collections.abc import AsyncIterator
from dataclasses import replace
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from luftpause.fakes.engine import EngineConfig, create_app
from luftpause.loadgen.__main__ import build_parser, is_luftpause, parse_mix
from luftpause.loadgen.agents import Clock, Live, Target, run_once
from luftpause.loadgen.driver import Group, run_load
from luftpause.loadgen.records import RunRecord, TurnRecord, percentile, summarise
from luftpause.loadgen.workload import Workload, plan_run

MODEL = "fake-llama-1b"
QUICK = Workload(service_class="interactive", context_chars_min=200, context_chars_max=400, tool_calls_min=2,
                 tool_calls_max=2, tool_delay_s=0.01, tool_result_chars=100, max_tokens=64)


@pytest.fixture
async def engine() -> AsyncIterator[tuple[str, list[dict[str, str]]]]:
    """A quick fake engine in process, recording the headers of every chat request and
    its task (the first user message) under the key "task"."""
    seen: list[dict[str, str]] = []

    @web.middleware
    async def record_headers(request: web.Request, handler: Any) -> web.StreamResponse:
        if request.path.endswith("/chat/completions"):
            messages = (await request.json()).get("messages") or [{}, {}]
            seen.append({**request.headers, "task": messages[1].get("content", "")})
        return await handler(request)

    app = create_app(EngineConfig(latency_ms=1, token_ms=0.5, tool_calls=8, reply_tokens=8))
    app.middlewares.append(record_headers)
    server = TestServer(app)
    await server.start_server()
    try:
        yield f"http://127.0.0.1:{server.port}/v1", seen
    finally:
        await server.close()


def test_plans_are_seeded() -> None:
    assert plan_run(QUICK, "a-1") == plan_run(QUICK, "a-1")
    assert plan_run(QUICK, "a-1").task != plan_run(QUICK, "a-2").task
    plan = plan_run(QUICK, "x")
    assert plan.tool_calls == 2 and 200 <= len(plan.task) - len("Task x: investigate and summarise the following notes. ")


def test_percentile_and_summary() -> None:
    assert percentile([], 50) is None
    assert percentile([3.0, 1.0, 2.0], 50) == 2.0 and percentile([1.0, 2.0, 3.0, 4.0], 90) == 4.0
    turn = TurnRecord(started=15, first_token=0.5, duration=2, prompt_tokens=100, cached_tokens=40)
    records = [RunRecord("batch", "a", started=10, ended=20, ok=True, turns=[turn]),
               RunRecord("batch", "b", started=5, ended=8, ok=True),  # before the window
               RunRecord("interactive", "c", started=12, ended=30, ok=False, error="boom")]
    summary = summarise(records, (10, 70))
    assert summary["batch"]["runs"] == 1 and summary["batch"]["runs_per_min"] == 1.0
    assert summary["batch"]["cached_share"] == 0.4 and summary["batch"]["ttft_p50_s"] == 0.5
    assert summary["interactive"]["errors"] == 1 and summary["interactive"]["runs"] == 0


def test_cli_parsing() -> None:
    assert parse_mix("interactive:4,batch:48") == [("interactive", 4), ("batch", 48)]
    with pytest.raises(argparse.ArgumentTypeError):
        parse_mix("urgent:3")
    args = build_parser().parse_args(["--base-url", "http://x/v1", "--agents", "3", "--class", "interactive",
                                      "--duration-s", "10", "--caller", "me"])
    assert args.agents == 3 and args.service_class == "interactive" and args.caller == "me"


async def test_run_once_calls_tools_then_answers_and_sends_headers_only_to_luftpause(engine) -> None:
    url, seen = engine
    async with aiohttp.ClientSession() as session:
        plain = await run_once(session, Target(url, MODEL), QUICK, "run-1", Clock(), Live())
        assert plain.ok, plain.error
        assert plain.tool_calls == 2 and len(plain.turns) == 3
        assert plain.turns[-1].finish_reason == "stop"
        assert plain.turns[1].cached_tokens > 0  # the next turn extends the previous prompt
        assert not any(k.lower().startswith("x-luftpause") for h in seen for k in h)
        seen.clear()
        tagged = await run_once(session, Target(url, MODEL, luftpause=True, caller="me"), QUICK, "run-2",
                                Clock(), Live())
        assert tagged.ok
        assert all(h["x-luftpause-run-id"] == "run-2" and h["x-luftpause-class"] == "interactive"
                   and h["x-luftpause-caller"] == "me" for h in seen)


async def test_an_answer_turn_that_keeps_the_tool_extends_the_cached_prefix(engine) -> None:
    url, _ = engine
    keeps = replace(QUICK, answer_keeps_tools=True)
    async with aiohttp.ClientSession() as session:
        dropped = await run_once(session, Target(url, MODEL), QUICK, "answer-drops", Clock(), Live())
        kept = await run_once(session, Target(url, MODEL), keeps, "answer-keeps", Clock(), Live())
    assert dropped.ok and kept.ok and kept.tool_calls == dropped.tool_calls == 2
    assert kept.turns[-1].finish_reason == "stop"  # tool_choice "none": the model answers
    # Without the tool list the answer's prompt starts differently and misses the
    # conversation; with it the answer reads the whole previous turn from the cache.
    assert dropped.turns[-1].cached_tokens < dropped.turns[1].prompt_tokens // 2
    assert kept.turns[-1].cached_tokens >= kept.turns[1].prompt_tokens - 16


async def test_failed_turns_are_errors(engine) -> None:
    url, _ = engine
    failing = Target(url, "no-such-model")
    async with aiohttp.ClientSession() as session:
        record = await run_once(session, failing, QUICK, "bad", Clock(), Live())
    assert not record.ok and "404" in record.error


async def test_closed_loop_measures_a_window(engine) -> None:
    url, _ = engine
    groups = [Group(2, QUICK), Group(2, Workload(service_class="batch", context_chars_min=100, context_chars_max=200,
                                                tool_calls_max=1, tool_delay_s=0.01, max_tokens=32))]
    result = await run_load(groups, target=Target(url, MODEL), warmup_s=0.2, duration_s=1.0, time_scale=1.0)
    assert set(result.summary) == {"interactive", "batch"}
    for summary in result.summary.values():
        assert summary["runs"] > 0 and summary["errors"] == 0 and summary["latency_p50_s"] > 0
    assert result.cpu["loadgen_cpu_share"] >= 0


async def test_variants_given_one_seed_send_the_same_runs_under_their_own_run_ids(engine) -> None:
    """A benchmark compares variants on the same sequence of runs: the seed decides the
    prompts, the name only the run ids luftpause sees."""
    url, seen = engine
    target = Target(url, MODEL, luftpause=True)

    async def variant(name: str, seed: str) -> dict[str, str]:
        """Each run's task, by the run id luftpause was given."""
        seen.clear()
        await run_load([Group(2, QUICK)], target=target, warmup_s=0.0, duration_s=0.3, time_scale=1.0, name=name,
                       seed=seed)
        return {h["x-luftpause-run-id"]: h["task"] for h in seen}

    router, strict, other = (await variant("b2-router-0", "b2-0"), await variant("b2-strict-0", "b2-0"),
                             await variant("b2-strict-1", "b2-1"))
    assert router and all(k.startswith("b2-router-0-interactive-0-") for k in router)
    assert strict and all(k.startswith("b2-strict-0-interactive-0-") for k in strict)
    # agent i's run k is the same run in both variants
    paired = [k for k in router if k.replace("router", "strict") in strict]
    assert paired and all(router[k] == strict[k.replace("router", "strict")] for k in paired)
    assert not set(router.values()) & set(other.values())  # another seed, other runs


def test_is_luftpause_is_false_for_an_unreachable_or_plain_target() -> None:
    assert not is_luftpause("http://127.0.0.1:9/v1")


async def test_command_without_a_terminal_prints_progress_full_tables_and_fails_on_errors(engine) -> None:
    """Piped (as in CI): progress lines on stderr every few seconds, the result table
    uncut on stdout, and exit status 1 when more runs failed than --max-errors."""
    url, _ = engine
    process = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "luftpause.loadgen", "--base-url", url, "--model", "no-such-model", "--agents", "2",
        "--class", "interactive", "--duration-s", "6", "--tool-delay-s", "0.01", "--headers", "off",
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    stdout, stderr = await asyncio.wait_for(process.communicate(), timeout=60)
    out, err = stdout.decode(), stderr.decode()
    assert process.returncode == 1, (out, err)
    progress = [line for line in err.splitlines() if "runs_done=" in line]
    assert progress and "errors=" in progress[-1]
    assert "more than --max-errors 0" in err
    header = next(line for line in out.splitlines() if "runs/min" in line)
    for column in ("class", "runs/min", "p50 s", "p90 s", "TTFT p50 s", "cached share", "errors"):
        assert column in header, header


def test_interactive_time_splits_a_run_into_first_token_waits_decoding_and_tools() -> None:
    from luftpause.loadgen.bench import interactive_time

    def run(started: float, ended: float, *turns: tuple[float, float, int], ok: bool = True,
            service_class: str = "interactive") -> RunRecord:
        return RunRecord(service_class, "s", started=started, ended=ended, ok=ok, tool_calls=len(turns) - 1,
                         turns=[TurnRecord(started=started, first_token=f, duration=d, completion_tokens=n)
                                for f, d, n in turns])

    records = [run(10, 20, (0.5, 2.5, 20), (1.0, 5.0, 80)),  # 2 s tool call between the turns
               run(30, 36, (1.5, 5.5, 100)),
               run(0, 8, (1.0, 2.0, 10)),  # ended before the window
               run(40, 50, (9.0, 9.5, 5), ok=False),  # failed
               run(12, 18, (0.1, 1.1, 50), service_class="batch")]
    time = interactive_time(records, (10, 70))
    assert time is not None and time["runs"] == 2
    assert time["run_s"] == 8.0 and time["first_token_s"] == 1.5 and time["decode_s"] == 5.0
    assert time["tool_calls"] == 0.5 and time["completion_tokens"] == 100.0
    assert time["decode_ms_per_token"] == 50.0  # 10 s of decoding for 200 tokens
    assert interactive_time(records[2:], (10, 70)) is None


def test_b2_tables_from_earlier_runs_pool_their_repeats(tmp_path, capsys) -> None:
    """``bench b2 --from-json A B`` prints one table over both files' repeats, and
    refuses runs whose windows differ (their rates do not pool)."""
    from luftpause.loadgen import bench

    def variant(interactive: float, batch: float) -> dict[str, Any]:
        record = RunRecord("interactive", "s", started=40, ended=60, ok=True, tool_calls=1,
                           turns=[TurnRecord(started=40, first_token=1.0, duration=3.0, completion_tokens=20),
                                  TurnRecord(started=50, first_token=0.5, duration=8.5, completion_tokens=80)])
        return {"summary": {"interactive": {"runs_per_min": interactive, "latency_p50_s": 60 / interactive},
                            "batch": {"runs_per_min": batch}},
                "engine_cached_share": 0.25, "engine_queue_mean": 0.0, "engine_retractions": 0,
                "engines_over_window": {"held_mean": 3.0}, "same_run": {"same_run_hit_share": 0.1},
                "interactive_time": bench.interactive_time([record], (30.0, 150.0))}

    def write(name: str, window_s: float, router: float, strict: float) -> str:
        payload = {"benchmark": "B2", "bench_config": {"warmup_s": 30.0, "window_s": window_s},
                   "results": {"proxy": {"router": [variant(router, 80)], "roam": [],
                                         "strict": [variant(strict, 76)]}}}
        path = tmp_path / name
        path.write_text(json.dumps(payload))
        return str(path)

    first, second = write("a.json", 120.0, 6.0, 15.0), write("b.json", 120.0, 8.0, 13.0)
    bench.print_b2_tables_from([Path(first), Path(second)])  # what `bench b2 --from-json` runs
    out = capsys.readouterr().out
    assert "2 repeats" in out and "2.00×" in out  # (15 + 13) / (6 + 8)
    assert "0.95×" in out  # batch 76 against 80
    assert "100.0" in out  # decode ms per token: 10 s for 100 tokens
    with pytest.raises(SystemExit, match="different windows"):
        bench.print_b2_tables_from([Path(first), Path(write("c.json", 180.0, 6.0, 15.0))])

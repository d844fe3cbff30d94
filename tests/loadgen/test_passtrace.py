"""The prefill-stall measurement (loadgen/passtrace.py) on hand-made pass traces."""

from __future__ import annotations

import asyncio
import json

from luftpause.dev.procs import eventually
from luftpause.loadgen import passtrace


def _req(rid: int, cls: str = "batch", turn: int = 0, extend: int = 1000, prompt: int = 1000,
         tools: bool | None = True, run: str = "") -> dict:
    return {"id": rid, "cls": cls, "run": run or f"b2-{cls}-{rid}", "turn": turn, "tools": tools,
            "extend": extend, "prompt": prompt}


def _decode(end: float, replica: int, interactive: list[int], ms: float = 20.0,
            ids: list[int] | None = None) -> dict:
    return {"kind": "D", "replica": replica, "ms": ms, "end": end, "ids": ids or interactive, "interactive": interactive}


def _prefill(end: float, replica: int, requests: list[dict], ms: float) -> dict:
    return {"kind": "P", "replica": replica, "ms": ms, "end": end, "requests": requests}


def test_stall_split_charges_prefill_between_an_interactive_requests_steps_by_kind() -> None:
    passes = [
        _decode(20, 0, [7]),
        _prefill(70, 1, [_req(1), _req(2, turn=1, tools=False)], ms=50.0),  # 15 fixed + 35 by tokens
        _decode(90, 1, []),
        _decode(110, 0, [7]),  # interactive 7's next token: 50 ms of prefill and 40 of decode before it
        _decode(130, 0, [7]),  # and this one: nothing but its own step
    ]
    out = passtrace.stall_split(passes)
    assert out["interactive_tokens"] == 2
    assert out["tokens_with_prefill_between"] == 0.5
    per = out["ms_per_interactive_token"]
    assert per["batch-first"] == per["batch-answer"] == round((7.5 + 17.5) / 2, 2)
    assert per["decode"] == (40 + 20) / 2
    assert out["fixed_part_ms_per_token"]["batch-first"] == 7.5 / 2
    assert out["requests_per_pass"] == 2.0


def test_overlap_counts_interactive_requests_decoding_during_batch_prefill() -> None:
    passes = [
        _decode(10, 0, [1, 2], ms=10.0),
        _decode(20, 1, [3], ms=10.0),          # from here three decode
        _prefill(50, 0, [_req(10)], ms=30.0),  # batch prefill while three decode
        _decode(60, 0, [], ms=10.0),           # replica 0's interactive requests are done
        _decode(70, 1, [], ms=10.0),           # and replica 1's: none decodes
        _decode(100, 0, [], ms=30.0),
    ]
    out = passtrace.overlap(passes)
    assert out["batch_prefill_share_by_decoding"] == {3: 1.0}
    assert out["mean_decoding_during_batch_prefill"] == 3.0
    # 40 ms of the 100 had nobody decoding: the 30 ms of batch prefill fit there
    assert out["ideal_mean_during_batch_prefill"] == 0.0
    assert out["batch_prefill_gpu_share"] == 0.3


def test_reuse_tells_later_turns_that_prefilled_their_context_again_by_gap() -> None:
    run = "b2-proxy-0-batch-1-3-0"
    passes = [
        _prefill(100, 0, [_req(1, turn=0, run=run, extend=1000, prompt=1000)], ms=50.0),
        _decode(1000, 0, [], ids=[1]),
        # 2 s later (a tool call): only what the tool result added
        _prefill(3100, 0, [_req(2, turn=1, run=run, extend=150, prompt=1300)], ms=20.0),
        _decode(4000, 0, [], ids=[2]),
        # 10 s later: the whole prompt again
        _prefill(14100, 0, [_req(3, turn=2, run=run, extend=1500, prompt=1500)], ms=70.0),
    ]
    out = passtrace.reuse(passes)
    assert out["batch-tool-result"] == {"<3 s": {"turns": 1, "prefilled_again": 0},
                                        "6-12 s": {"turns": 1, "prefilled_again": 1}}


def test_install_records_the_engines_passes_without_changing_their_cost(tmp_path, monkeypatch) -> None:
    from luftpause.fakes import engine_state, sim

    for owner, name in ((sim.EngineModel, "prefill_ms"), (sim.EngineModel, "decode_ms"),
                        (engine_state.Gpu, "run"), (engine_state.Simulator, "reset")):
        monkeypatch.setattr(owner, name, getattr(owner, name))  # undone after the test
    params = sim.ModelParams(prefill_base_ms=15.0, prefill_ms_per_token=0.035, decode_base_ms=12.0)
    untraced = sim.EngineModel(params)
    untraced.submit("m", "Task b2-proxy-0-interactive-0-0-0: " + "x" * 400, 2, 8)
    expected = untraced.prefill_ms(untraced.admit())
    passtrace.install(str(tmp_path))

    async def drive() -> None:
        simulator = engine_state.Simulator(params, time_scale=0.001)
        request, _ = simulator.submit("m", "Task b2-proxy-0-interactive-0-0-0: " + "x" * 400, 2, 8)
        await eventually(lambda: request.state == "finished", what="the request's passes run")
        await simulator.stop()

    asyncio.run(drive())
    lines = [json.loads(line) for path in tmp_path.glob("passes-*.jsonl") for line in path.read_text().splitlines()]
    prefill = [p for p in lines if p["kind"] == "P"]
    assert prefill and prefill[0]["ms"] == expected
    assert prefill[0]["requests"][0]["cls"] == "interactive"
    assert any(p["kind"] == "D" and p["interactive"] for p in lines)

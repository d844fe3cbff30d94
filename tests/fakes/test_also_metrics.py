"""vLLM-named read-outs beside SGLang's (``--also-metrics-format vllm``), for peer routers
that read only vLLM's names: the same gauges under more names, and not a single step of
the engine model's timing changed by them."""

from __future__ import annotations

from dataclasses import replace

import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from luftpause.fakes.engine import PRESETS, REGISTRY_KEY, STATE_KEY, EngineConfig, create_app, parse_args

PRESET = replace(EngineConfig(), **PRESETS["laptop-1b-sglang"])


def samples(app) -> dict[str, float]:  # type: ignore[no-untyped-def]
    text = generate_latest(app[REGISTRY_KEY]).decode()
    return {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples}


def trace(config: EngineConfig) -> tuple[list[tuple[str, float]], list[dict[str, float]]]:
    """Step kinds and costs of one fixed workload (24 requests, shared and private prefixes,
    enough to queue, chunk and run above the graph size), /metrics scraped after every step."""
    app = create_app(config)
    model = app[STATE_KEY].sim.model
    for i in range(24):
        prompt = "system prompt shared by every run. " * 40 + f"run {i} " * (50 + 37 * i)
        model.submit(config.models[0], prompt, reply_tokens=40 + 7 * (i % 5), max_tokens=256)
    steps: list[tuple[str, float]] = []
    scrapes: list[dict[str, float]] = []
    for _ in range(20_000):
        if not model.busy:
            break
        admitted = model.admit()
        if admitted:
            steps.append(("prefill", model.prefill_ms(admitted)))
            model.finish_prefill(admitted)
        else:
            model.prepare_decode()
            steps.append(("decode", model.decode_ms()))
            model.decode_step()
        scrapes.append(samples(app))
    assert not model.busy
    return steps, scrapes


def test_vllm_names_are_read_outs_that_leave_every_step_time_unchanged() -> None:
    plain_steps, plain = trace(PRESET)
    also_steps, also = trace(replace(PRESET, also_metrics_formats=("vllm",)))
    assert also_steps == plain_steps
    decode_costs = {cost for kind, cost in plain_steps if kind == "decode"}
    assert len(decode_costs) > 3 and max(decode_costs) > PRESET.token_ms + PRESET.decode_eager_ms  # above the graph size
    assert "vllm:num_requests_running" not in plain[0]
    for before, after in zip(plain, also, strict=True):
        assert after["vllm:num_requests_running"] == after["sglang:num_running_reqs"]
        assert after["vllm:num_requests_waiting"] == after["sglang:num_queue_reqs"]
        assert after["vllm:kv_cache_usage_perc"] == after["sglang:token_usage"]
        assert {k: v for k, v in after.items() if not k.startswith("vllm:")} == before
    assert max(s["vllm:num_requests_waiting"] for s in also) > 0  # the workload did queue


def test_option_parses_and_rejects_unknown_names() -> None:
    assert parse_args(["--also-metrics-format", "vllm"]).also_metrics_formats == ("vllm",)
    assert parse_args([]).also_metrics_formats == ()
    with pytest.raises(SystemExit):
        parse_args(["--also-metrics-format", "nonsense"])

"""The peer configurations a user would pick instead of luftpause, a row each (the table of
peer rows in docs/benchmarks.md): router, policy and flags, and the identity its turns carry
(vllm-router 0.1.17 keys sessions by ``x-session-id``, programs by
``vllm_xargs.agentic_context``). The router's durations are wall seconds: model seconds times
the time scale.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from luftpause.loadgen.peers import SGLANG_ROUTER, VLLM_ROUTER, RouterProcess, router_process


@dataclass(frozen=True)
class EngineFacts:
    """What an operator would tell a peer of the engines behind it, in model time."""

    kv_tokens: int
    latency_ms: float  # prefill pass base cost
    prefill_ms_per_token: float
    token_ms: float  # decode step base cost
    decode_ms_per_request: float
    time_scale: float

    @classmethod
    def of(cls, engine: dict[str, Any], time_scale: float) -> EngineFacts:
        return cls(int(engine["kv_tokens"]), float(engine["latency_ms"]), float(engine["prefill_ms_per_token"]),
                   float(engine["token_ms"]), float(engine["decode_ms_per_request"]), time_scale)


@dataclass(frozen=True)
class PeerRow:
    key: str  # the row's key in results and on the command line
    label: str
    binary: str
    policy: str
    identity: str = "none"  # what each turn carries: luftpause.peer_identity.STYLES
    program_scheduling: bool = False
    session_ttl_model_s: float | None = None  # kv_aware's session-affinity TTL

    def args(self, engine: EngineFacts) -> list[str]:
        out: list[str] = []
        if self.session_ttl_model_s is not None:
            ttl = max(1, round(self.session_ttl_model_s * engine.time_scale))
            out += ["--kv-aware-session-affinity-ttl-secs", str(ttl)]
        if self.program_scheduling:
            out += ["--enable-program-scheduling", "--program-scheduling-config-json",
                    json.dumps(program_config(engine), separators=(",", ":"))]
        return out

    def process(self, workers: list[str], log_path: Path, engine: EngineFacts) -> RouterProcess:
        return router_process(self.policy, workers, log_path, self.binary, self.args(engine))


def program_config(engine: EngineFacts) -> dict[str, Any]:
    """vllm-router's program scheduling tuned to the engines, as its docs ask an operator to:
    each replica's KV pool as its token capacity, cost models fitted to the engine's own
    constants, balance by reasoning tokens, periods and TTLs at the benchmark's time scale."""
    s = engine.time_scale
    return {
        "token_capacity_per_dp_rank": engine.kv_tokens, "binding_strategy": "reasoning_token_balance",
        "metrics_interval_seconds": round(1.0 * s, 4), "max_acting_ttl_seconds": round(10.0 * s, 4),
        "paused_retention_ttl_seconds": round(1800.0 * s, 4), "force_resume_timeout_seconds": round(300.0 * s, 4),
        "prefill_cost_model": {"intercept_seconds": engine.latency_ms / 1000 * s,
                               "linear_seconds_per_1k_tokens": engine.prefill_ms_per_token * s,
                               "quadratic_seconds_per_1k_tokens_squared": 0.0, "decode_throughput_alpha": 0.15},
        "decode_throughput_model": {"fixed_step_seconds": engine.token_ms / 1000 * s,
                                    "batch_step_seconds_per_request": engine.decode_ms_per_request / 1000 * s,
                                    "context_step_seconds_per_token": 0.0},
    }


PEER_ROWS: dict[str, PeerRow] = {row.key: row for row in (
    PeerRow("router", "sglang-router cache_aware", SGLANG_ROUTER, "cache_aware"),
    PeerRow("round_robin", "sglang-router round_robin", SGLANG_ROUTER, "round_robin"),
    PeerRow("vllm-cache_aware", "vllm-router cache_aware", VLLM_ROUTER, "cache_aware"),
    PeerRow("vllm-sticky", "vllm-router sticky_least_loaded, sessions", VLLM_ROUTER, "sticky_least_loaded",
            identity="session"),
    PeerRow("vllm-kv_aware", "vllm-router kv_aware, session-affinity TTL 30 s", VLLM_ROUTER, "kv_aware",
            identity="session", session_ttl_model_s=30.0),
    PeerRow("vllm-program", "vllm-router program scheduling + cache_aware", VLLM_ROUTER, "cache_aware",
            identity="program", program_scheduling=True),
)}
# What B1, B2 and B3 run unless told otherwise: every row but round robin (B3 adds it).
DEFAULT_PEERS = ("router", "vllm-cache_aware", "vllm-sticky", "vllm-kv_aware", "vllm-program")
CLASS_BLIND_BASELINE = "router"  # the batch target's reference: the class-blind SGLang router


def parse_peers(text: str) -> tuple[str, ...]:
    """``router,vllm-sticky`` → the row keys, in order; unknown keys are an error."""
    keys = tuple(k.strip() for k in text.split(",") if k.strip())
    unknown = [k for k in keys if k not in PEER_ROWS]
    if unknown or not keys:
        raise ValueError(f"unknown peer rows {unknown or text!r}; known: {', '.join(PEER_ROWS)}")
    return keys


def best_row(values: dict[str, float | None], higher_is_better: bool) -> tuple[str, float] | None:
    """The row with the best value (ties: the first), or None when no row has one."""
    real = [(k, v) for k, v in values.items() if v is not None]
    return (max if higher_is_better else min)(real, key=lambda kv: kv[1]) if real else None


def compare(luftpause: dict[str, dict[str, float | None]], peers: dict[str, dict[str, float | None]],
            metrics: Iterable[tuple[str, bool]]) -> dict[str, Any]:
    """Per metric (name, higher is better), the best peer row and each luftpause row's
    ratio to it (rows map to {metric: mean}): its value over the best row's."""
    out: dict[str, Any] = {}
    for metric, higher in metrics:
        best = best_row({k: v.get(metric) for k, v in peers.items()}, higher)
        ratios = {k: v.get(metric) / best[1] if best and best[1] and v.get(metric) is not None else None
                  for k, v in luftpause.items()}
        out[metric] = {"higher_is_better": higher, "best_row": best[0] if best else None,
                       "best_value": best[1] if best else None, "ratios": ratios}
    return out

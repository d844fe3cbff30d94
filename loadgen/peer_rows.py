"""The peer configurations a user would pick instead of luftpause, each as one row of the
benchmarks: which router, which policy and flags, and which identity its turns carry.

Every row runs in the same invocation, in front of the same engines, as luftpause; the
tables compare luftpause with the best row for each metric (:func:`best_row`).

What each vllm-router (0.1.17) row reads, from its binary and its behaviour (the table of peer
rows in docs/benchmarks.md): ``sticky_least_loaded`` and ``kv_aware``'s session-affinity TTL key a run by
the ``x-session-id`` header; program scheduling opts a request in with
``vllm_xargs.agentic_context`` and sizes each replica with ``token_capacity_per_dp_rank``;
it polls each worker's ``/metrics`` for ``vllm:kv_cache_usage_perc`` and the running and
waiting requests (the fake engines add those names beside SGLang's). All of the router's
durations are wall seconds, so they are given in model seconds times the time scale.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from luftpause.loadgen.peers import SGLANG_ROUTER, VLLM_ROUTER, RouterProcess


@dataclass(frozen=True)
class EngineFacts:
    """What a peer may be told about the engines behind it (as an operator would configure
    it for the hardware): the KV pool per replica and the cost constants, in model time."""

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

    def wall_s(self, model_seconds: float) -> float:
        return model_seconds * self.time_scale


@dataclass(frozen=True)
class PeerRow:
    key: str  # the row's key in results and on the command line
    label: str
    binary: str
    policy: str
    identity: str = "none"  # what each turn carries: luftpause.peer_identity.STYLES
    class_blind: bool = True  # routes without any run or class identity
    program_scheduling: bool = False
    binding: str = "reasoning_token_balance"  # program scheduling's initial placement of a program
    session_ttl_model_s: float | None = None  # kv_aware's session-affinity TTL

    def args(self, engine: EngineFacts) -> list[str]:
        out: list[str] = []
        if self.session_ttl_model_s is not None:
            out += ["--kv-aware-session-affinity-ttl-secs", str(max(1, round(engine.wall_s(self.session_ttl_model_s))))]
        if self.program_scheduling:
            out += ["--enable-program-scheduling",
                    "--program-scheduling-config-json",
                    json.dumps(program_config(engine, self.binding), separators=(",", ":"))]
        return out

    def process(self, workers: list[str], log_path: Path, engine: EngineFacts) -> RouterProcess:
        return RouterProcess(self.policy, workers, log_path, binary=self.binary, extra_args=self.args(engine))


def program_config(engine: EngineFacts, binding: str = "reasoning_token_balance") -> dict[str, Any]:
    """vllm-router's program scheduling tuned to the engines, as its docs ask an operator
    to: each replica's KV pool as its token capacity (token-based admission instead of the
    program-count guard), the prefill and decode cost models fitted to the engine's own
    constants, a binding strategy (by default balance by reasoning tokens, which needs the
    capacity), and its wall-clock periods and TTLs at the benchmark's time scale."""
    s = engine.time_scale
    return {
        "token_capacity_per_dp_rank": engine.kv_tokens,
        "binding_strategy": binding,
        "metrics_interval_seconds": round(1.0 * s, 4),
        "max_acting_ttl_seconds": round(10.0 * s, 4),
        "paused_retention_ttl_seconds": round(1800.0 * s, 4),
        "force_resume_timeout_seconds": round(300.0 * s, 4),
        "prefill_cost_model": {
            "intercept_seconds": engine.latency_ms / 1000 * s,
            "linear_seconds_per_1k_tokens": engine.prefill_ms_per_token * s,
            "quadratic_seconds_per_1k_tokens_squared": 0.0,
            "decode_throughput_alpha": 0.15,
        },
        "decode_throughput_model": {
            "fixed_step_seconds": engine.token_ms / 1000 * s,
            "batch_step_seconds_per_request": engine.decode_ms_per_request / 1000 * s,
            "context_step_seconds_per_token": 0.0,
        },
    }


PEER_ROWS: dict[str, PeerRow] = {row.key: row for row in (
    PeerRow("router", "sglang-router cache_aware", SGLANG_ROUTER, "cache_aware"),
    PeerRow("round_robin", "sglang-router round_robin", SGLANG_ROUTER, "round_robin"),
    PeerRow("vllm-cache_aware", "vllm-router cache_aware", VLLM_ROUTER, "cache_aware"),
    PeerRow("vllm-sticky", "vllm-router sticky_least_loaded, sessions", VLLM_ROUTER, "sticky_least_loaded",
            identity="session", class_blind=False),
    PeerRow("vllm-kv_aware", "vllm-router kv_aware, session-affinity TTL 30 s", VLLM_ROUTER, "kv_aware",
            identity="session", class_blind=False, session_ttl_model_s=30.0),
    PeerRow("vllm-program", "vllm-router program scheduling + cache_aware", VLLM_ROUTER, "cache_aware",
            identity="program", class_blind=False, program_scheduling=True),
    # the other program bindings of 0.1.17, to check which pairs best (not run by default)
    PeerRow("vllm-program-least", "vllm-router program scheduling, least_program_count binding", VLLM_ROUTER,
            "cache_aware", identity="program", class_blind=False, program_scheduling=True,
            binding="least_program_count"),
    PeerRow("vllm-program-hash", "vllm-router program scheduling, consistent_hash binding", VLLM_ROUTER,
            "consistent_hash", identity="program", class_blind=False, program_scheduling=True,
            binding="consistent_hash"),
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
    if not real:
        return None
    pick = max if higher_is_better else min
    return pick(real, key=lambda kv: kv[1])


def compare(luftpause: dict[str, dict[str, float | None]], peers: dict[str, dict[str, float | None]],
            metrics: Iterable[tuple[str, bool]]) -> dict[str, Any]:
    """Per metric, the best peer row and each luftpause variant's ratio to it.

    ``luftpause`` and ``peers`` map a row key to {metric: mean value}; ``metrics`` are
    (name, higher is better). A ratio is luftpause's value over the best row's: above 1
    is more for throughput, and for a time below 1 is faster."""
    out: dict[str, Any] = {}
    for metric, higher in metrics:
        best = best_row({k: v.get(metric) for k, v in peers.items()}, higher)
        entry: dict[str, Any] = {"higher_is_better": higher, "best_row": best[0] if best else None,
                                 "best_value": best[1] if best else None, "ratios": {}}
        for variant, values in luftpause.items():
            mine = values.get(metric)
            entry["ratios"][variant] = (mine / best[1] if best and mine is not None and best[1] else None)
        out[metric] = entry
    return out

"""The peer configurations a user would pick instead of luftpause, a row each (the table of
peer rows in docs/benchmarks.md): router, policy and flags, and the identity its turns carry
(vllm-router 0.1.17 keys sessions by ``x-session-id``, programs by
``vllm_xargs.agentic_context``). The router's durations are wall seconds: model seconds times
the time scale. A row with ``client_hints`` also sends what a user could send an SGLang engine
without luftpause (``agents.client_hints``: ``priority`` by class, ``session_id`` = the run,
``/close_session`` at the end), only where the load generator makes the turns itself (B2's
own-loop parts): a runtime's turns carry its identity style only.
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
    client_hints: bool = False  # the client's own priority and session_id on each own-loop turn

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
    # The same routers with the client's own engine hints: sglang-router, and vllm-router's best mode on B2
    # (program scheduling: the best peer's interactive rate through the proxy and in most regime cells).
    PeerRow("router-hints", "sglang-router cache_aware, client priority + session_id", SGLANG_ROUTER, "cache_aware",
            client_hints=True),
    PeerRow("vllm-program-hints", "vllm-router program scheduling, client priority + session_id", VLLM_ROUTER,
            "cache_aware", identity="program", program_scheduling=True, client_hints=True),
)}
# What B1, B2 and B3 run unless told otherwise: every row but round robin (B3 adds it).
DEFAULT_PEERS = ("router", "vllm-cache_aware", "vllm-sticky", "vllm-kv_aware", "vllm-program")
CLASS_BLIND_BASELINE = "router"  # the batch target's reference: the class-blind SGLang router
HINT_PEERS = tuple(key for key, row in PEER_ROWS.items() if row.client_hints)  # what --peer-hints adds


def with_hint_rows(keys: tuple[str, ...]) -> tuple[str, ...]:
    """``keys`` and the client-hint rows after them (``--peer-hints``)."""
    return (*keys, *(k for k in HINT_PEERS if k not in keys))


def runtime_rows(keys: tuple[str, ...]) -> tuple[str, ...]:
    """The rows a runtime can run straight to (B1, B3, B2's MCP part): a runtime's turns
    carry its identity style, not a client's hints, so the client-hint rows are left out."""
    return tuple(k for k in keys if not PEER_ROWS[k].client_hints)


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


# engine_fields' counts that exist only on engines with the flag that reads the field
FLAGGED = {"with_priority": "requests_with_priority", "with_session": "requests_with_session",
           "session_ids_seen": "session_ids_seen", "sessions_open": "sessions_open"}


def _sum(values: Iterable[int | None]) -> int | None:
    real = [v for v in values if v is not None]
    return sum(real) if real else None


def engine_fields(stats: list[dict[str, Any]]) -> dict[str, Any]:
    """What reached the engines of the agent fields (the fake engine's ``/stats``, summed
    over the replicas): requests, those with ``priority`` (and its values as they arrived)
    and with ``session_id``, the session ids seen and the sessions still open (the rest
    were closed by ``/close_session``). The engines count a field only with the flag that
    reads it (``--engine-features``); without, its counts are None."""
    values: dict[str, int] = {}
    for s in stats:
        for value, n in (s.get("priority_values") or {}).items():
            values[value] = values.get(value, 0) + n
    return {"requests": sum(s.get("requests", 0) for s in stats), "priority_values": values,
            **{key: _sum(s.get(name) for s in stats) for key, name in FLAGGED.items()}}


def merge_fields(figures: Iterable[dict[str, Any]]) -> dict[str, Any]:
    """:func:`engine_fields` of several rows run (repeats, parts) added up; each row's
    open sessions are counted at its end."""
    figures = list(figures)
    out: dict[str, Any] = {"requests": sum(f.get("requests", 0) for f in figures), "priority_values": {},
                           **{key: _sum(f.get(key) for f in figures) for key in FLAGGED}}
    for f in figures:
        for value, n in (f.get("priority_values") or {}).items():
            out["priority_values"][value] = out["priority_values"].get(value, 0) + n
    return out


def _arrived(n: int | None, requests: int) -> str:
    if n is None:
        return "not observable (engines without the flag that reads it: --engine-features)"
    if not requests:
        return "not observed (no request reached the engines)"
    if not n:
        return "dropped"
    return "forwarded" if n >= requests else f"forwarded on {n} of {requests} requests"


def hint_verdict(fields: dict[str, Any], sent_priorities: Iterable[int]) -> dict[str, str]:
    """Whether a router forwarded or dropped a client's ``priority`` and ``session_id``,
    and its ``/close_session``, from what reached the engines behind it (``fields``,
    :func:`merge_fields`, with ``runs_ended``: the runs whose session the client asked the
    router to close, and ``close_session_statuses``: the router's answers; every turn the
    client sent carried both fields)."""
    requests = fields["requests"]
    priority = _arrived(fields["with_priority"], requests)
    changed = sorted(set(fields["priority_values"]) - {json.dumps(v) for v in sent_priorities})
    if fields["with_priority"] and changed:
        priority += f", values changed (arrived: {', '.join(changed)})"
    seen, still_open, ended = fields["session_ids_seen"], fields["sessions_open"], fields.get("runs_ended", 0)
    statuses = fields.get("close_session_statuses") or {}
    if still_open is None or seen is None:  # the engines would answer 404 too
        close = "not observable (engines without --enable-session-radix-cache: --engine-features)"
    elif statuses and all(status in ("404", "405") for status in statuses):
        close = "not forwarded (no such route at the router)"
    elif not seen:
        close = "not observable (no session reached the engines)"
    elif seen - still_open >= ended > 0:
        close = f"forwarded ({seen - still_open} of {seen} sessions closed; {ended} runs ended)"
    elif seen > still_open:  # some closes reached a replica, fewer sessions closed than runs ended
        close = f"forwarded in part ({seen - still_open} of {seen} sessions closed, fewer than the {ended} runs ended)"
    elif not ended:
        close = "not observable (no run ended, so none was closed)"
    else:
        close = f"not forwarded ({ended} runs ended, all {seen} sessions left open)"
    if statuses:
        close += "; the router answered " + ", ".join(f"{status} ×{n}" for status, n in sorted(statuses.items()))
    return {"priority": priority, "session_id": _arrived(fields["with_session"], requests), "close_session": close}

"""Processes a benchmark starts besides luftpause: fake engines, the peer routers
(``sglang-router``, ``vllm-router``; the ``bench`` extra) and a runtime whose turns go
straight to a router, all on loopback, each stopped by the benchmark that started it.

And the peer rows: the configurations a user would pick instead of luftpause (the table of
peer rows in docs/benchmarks.md): router, policy and flags, and the identity its turns carry
(vllm-router 0.1.17 keys sessions by ``x-session-id``, programs by
``vllm_xargs.agentic_context``). The router's durations are wall seconds: model seconds times
the time scale. A row with ``client_hints`` also sends what a user could send an SGLang engine
without luftpause (``agents.client_hints``: ``priority`` by class, ``session_id`` = the run,
``/close_session`` at the end), only where the load generator makes the turns itself (B2's
own-loop parts): a runtime's turns carry its identity style only.
"""

from __future__ import annotations

import contextlib
import json
import shutil
import sys
import tempfile
import urllib.request
from collections import Counter
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from luftpause.dev.procs import ManagedProcess, free_ports, http_ok, start_on_free_ports, wait_until

HOST = "127.0.0.1"
SGLANG_ROUTER, VLLM_ROUTER = "sglang-router", "vllm-router"  # console scripts of the bench extra
PEER_ROUTERS = (SGLANG_ROUTER, VLLM_ROUTER)


def find_router(name: str = SGLANG_ROUTER) -> str | None:
    """The path of a router's console script (beside this Python first), or None."""
    beside = Path(sys.executable).parent / name
    return str(beside) if beside.exists() else shutil.which(name)


@dataclass
class RouterProcess(ManagedProcess):
    """A peer router in front of ``workers``, loopback only: ``sglang-router launch`` or
    ``vllm-router``, which take the same flags; ready once it counts every worker healthy."""

    workers: list[str] = field(default_factory=list)
    port: int = 0
    metrics_port: int = 0

    @property
    def url(self) -> str:
        return f"http://{HOST}:{self.port}"

    def is_ready(self) -> bool:
        with contextlib.suppress(OSError, ValueError), urllib.request.urlopen(f"{self.url}/readiness",
                                                                               timeout=1) as response:
            return json.loads(response.read()).get("healthy_workers") == len(self.workers)
        return False

    def start(self, timeout: float = 60.0) -> None:
        super().start()
        try:
            self.wait_ready(timeout)
        except BaseException:
            self.stop()
            raise


def router_process(policy: str, workers: list[str], log_path: Path, binary: str = SGLANG_ROUTER,
                   extra_args: tuple[str, ...] | list[str] = ()) -> RouterProcess:
    found = find_router(binary)
    if found is None:
        raise SystemExit(f"{binary} is not installed: pip install 'luftpause[bench]' (or pip install {binary})")
    port, metrics_port = free_ports(2)
    log_path.parent.mkdir(parents=True, exist_ok=True)
    command = [found, *(["launch"] if binary == SGLANG_ROUTER else []), "--worker-urls", *workers, "--policy", policy,
               "--host", HOST, "--port", str(port), "--prometheus-host", HOST, "--prometheus-port", str(metrics_port),
               *extra_args]
    return RouterProcess(f"{binary} {policy}", binary, log_path=log_path, command=command, workers=list(workers),
                         port=port, metrics_port=metrics_port)


def engine_process(name: str, port: int, args: list[str], log_dir: Path) -> ManagedProcess:
    return ManagedProcess(name, "luftpause.fakes.engine", ["--host", HOST, "--port", str(port), "--name", name, *args],
                          ready_url=f"http://{HOST}:{port}/health", log_path=log_dir / f"{name}.log")


def start_engine(name: str, args: list[str], log_dir: Path) -> tuple[ManagedProcess, str]:
    """A fake engine serving the stack's model on a free port, ready; it and its URL."""
    from luftpause.dev.stack import MODEL

    engine, (port,) = start_on_free_ports(lambda ports: engine_process(name, ports[0], ["--models", MODEL, *args],
                                                                       log_dir))
    return engine, f"http://{HOST}:{port}"


def runtime_process(name: str, port: int, turns_url: str, tools_file: Path, state_dir: Path,
                    log_dir: Path) -> ManagedProcess:
    """A runtime whose sub-agent turns go to ``turns_url`` (a router, for the baseline)."""
    return ManagedProcess(name, "luftpause.runtime",
                          ["--host", HOST, "--port", str(port), "--dataplane-url", turns_url,
                           "--tools-file", str(tools_file), "--state-dir", str(state_dir)],
                          ready_url=f"http://{HOST}:{port}/health", log_path=log_dir / f"{name}.log")


@contextmanager
def running(thing: Any) -> Iterator[Any]:
    """``thing`` (a stack, a process) started and ready, unless it runs already; stopped after."""
    try:
        if not isinstance(thing, ManagedProcess) or thing.process is None:
            thing.start()
            if isinstance(thing, ManagedProcess):
                thing.wait_ready(60)
        yield thing
    finally:
        thing.stop()


@contextmanager
def engines_stack(engine_args: list[str], engines: int = 1, without: tuple[str, ...] = (), **options: Any
                  ) -> Iterator[Any]:
    """luftpause before ``engines`` fake engines (no runtime, no fake MCP; nor ``without``) on
    free ports in a folder of its own, started; stopped and removed after."""
    from luftpause.dev.stack import Stack

    with tempfile.TemporaryDirectory(prefix="luftpause-bench-") as tmp, running(Stack.on_free_ports(
            Path(tmp), engines=engines, engine_args=engine_args, without=frozenset({"runtime", "fake-mcp", *without}),
            **options)) as stack:
        yield stack


def reset_engines(urls: list[str], timeout: float = 30.0) -> None:
    """Empty every engine's cache and counters once it is idle (between variants)."""
    pending = set(urls)

    def reset() -> bool:
        for url in list(pending):
            with contextlib.suppress(OSError), urllib.request.urlopen(
                    urllib.request.Request(f"{url}/reset", method="POST", data=b""), timeout=2):
                pending.discard(url)
        return not pending

    if not wait_until(reset, timeout, 0.2):
        raise TimeoutError(f"engines still busy after {timeout:.0f} s: {sorted(pending)}")


def engine_stats(urls: list[str], timeout: float = 2.0) -> list[dict]:
    def stats(url: str) -> dict:
        with urllib.request.urlopen(f"{url}/stats", timeout=timeout) as response:
            return json.loads(response.read())
    return [stats(url) for url in urls]


def wait_healthy(url: str, timeout: float = 30.0) -> None:
    if not wait_until(lambda: http_ok(url), timeout, 0.1):
        raise TimeoutError(f"{url} not healthy after {timeout:.0f} s")


# --- the peer rows ----------------------------------------------------------------------------
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


def _added_up(items: list[dict[str, Any]], names: dict[str, str]) -> dict[str, Any]:
    """Requests, priority values and each of ``names`` (key: the item's name for it) summed
    over ``items``; a count no item has is None."""
    values: Counter[str] = Counter()
    for item in items:
        values.update(item.get("priority_values") or {})
    return {"requests": sum(i.get("requests", 0) for i in items), "priority_values": dict(values),
            **{key: sum(real) if (real := [i[name] for i in items if i.get(name) is not None]) else None
               for key, name in names.items()}}


def engine_fields(stats: list[dict[str, Any]]) -> dict[str, Any]:
    """What reached the engines (``/stats`` summed over the replicas): requests, those with
    ``priority`` (its values as they arrived) and ``session_id``, the session ids seen and
    those still open (not closed by ``/close_session``). An engine counts a field only with
    the flag that reads it (``--engine-features``); without, its counts are None."""
    return _added_up(stats, FLAGGED)


def merge_fields(figures: Iterable[dict[str, Any]]) -> dict[str, Any]:
    """:func:`engine_fields` of several rows run (repeats, parts) added up; each row's
    open sessions are counted at its end."""
    return _added_up(list(figures), {key: key for key in FLAGGED})


def _arrived(n: int | None, requests: int) -> str:
    if n is None:
        return "not observable (engines without the flag that reads it: --engine-features)"
    if not requests:
        return "not observed (no request reached the engines)"
    return "dropped" if not n else "forwarded" if n >= requests else f"forwarded on {n} of {requests} requests"


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

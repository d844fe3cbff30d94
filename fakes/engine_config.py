"""The fake engine's configuration: :class:`EngineConfig`, the calibrated presets, and
the command line (each option defaults to ``LUFTPAUSE_FAKE_ENGINE_<OPTION>``, else to the
chosen preset's value)."""

from __future__ import annotations

import argparse
import os
from collections.abc import Sequence
from dataclasses import dataclass, fields, replace
from typing import Any


from luftpause.fakes import faults as fault_directives
from luftpause.fakes.faults import FaultError, Faults
from luftpause.fakes.priority import VLLM_POLICIES
from luftpause.fakes.replies import ReplyRules
from luftpause.fakes.sim import ModelParams

ENV_PREFIX = "LUFTPAUSE_FAKE_ENGINE_"
TRUE = ("1", "true", "yes", "on")


@dataclass(frozen=True)
class EngineConfig:
    """Everything the engine's behaviour depends on (one field per CLI option).

    The defaults make a quick engine for tests (a short request is answered in well
    under 100 ms and nothing queues); ``PRESETS`` hold calibrated engines.
    """

    host: str = "127.0.0.1"
    port: int = 9001
    extra_ports: tuple[int, ...] = ()  # more replicas in this process, sharing one GPU timeline
    name: str = "fake-engine"
    models: tuple[str, ...] = ("fake-llama-1b",)
    tool_calls: int = 2
    latency_ms: float = 20.0  # prefill pass base cost: time to first token of a short prompt
    token_ms: float = 2.0  # decode step base cost: time between tokens
    prefill_ms_per_token: float = 0.0
    decode_ms_per_request: float = 0.0
    max_running: int = 0
    reply_tokens: int = 12
    reply_spread: float = 0.0  # sigma of a log-normal spread of text reply lengths; 0 = fixed
    kv_tokens: int = 65536
    block_tokens: int = 16
    context_tokens: int = 0  # reply reservation without max_tokens: context − prompt; 0 = the planned reply
    max_prefill_tokens: int = 16384
    chunked_prefill_tokens: int = 2048  # SGLang's --chunked-prefill-size on GPUs under 20 GB; 0 = off
    cuda_graph_max_bs: int = 0  # decode batches above this pay --decode-eager-ms; 0 = never
    decode_eager_ms: float = 0.0
    metrics_interval_steps: int = 1  # decode steps between gauge refreshes (SGLang: 40); 1 = every step
    stream_interval: int = 1  # tokens per streamed chunk (SGLang's --stream-interval)
    time_scale: float = 1.0  # every simulated duration is multiplied by this
    seed: int = 0
    labels: tuple[str, ...] = ("negative", "positive")  # /classify labels
    metrics_format: str = "sglang"
    # More name sets for the same gauges, e.g. ("vllm",) beside SGLang's names, for a peer
    # router that reads only vLLM's (vllm-router's program scheduling): read-outs only
    also_metrics_formats: tuple[str, ...] = ()
    faults: tuple[str, ...] = ()  # engine-wide fault directives, e.g. ("status=503",)
    hang_limit_s: float = 3600.0  # a [[fake:hang]] request is dropped after this long
    idle_close_s: float = 0.0  # drop requests on connections idle longer than this (0 = never)
    openapi: bool = False  # publish the routes at /openapi.json, as vLLM and SGLang (FastAPI) do
    # The real engines' agent features, each behind its engine's own flag, all off by default
    # (fakes/priority.py, fakes/prefix_cache.py's SessionRefs); at most one priority scheduling.
    scheduling_policy: str = "fcfs"  # vLLM's --scheduling-policy
    enable_priority_scheduling: bool = False  # SGLang's flags from here on
    schedule_low_priority_values_first: bool = False
    priority_scheduling_preemption_threshold: int = 10
    disable_priority_preemption: bool = False
    enable_session_radix_cache: bool = False

    def engine_faults(self) -> Faults:
        return fault_directives.parse(fault_directives.parse_option(f) for f in self.faults)

    def rules(self) -> ReplyRules:
        return ReplyRules(tool_calls=self.tool_calls, reply_tokens=self.reply_tokens)

    def params(self) -> ModelParams:
        return ModelParams(
            max_running=self.max_running,
            kv_tokens=self.kv_tokens,
            block_tokens=self.block_tokens,
            context_tokens=self.context_tokens,
            max_prefill_tokens=self.max_prefill_tokens,
            chunked_prefill_tokens=self.chunked_prefill_tokens,
            cuda_graph_max_bs=self.cuda_graph_max_bs,
            decode_eager_ms=self.decode_eager_ms,
            metrics_interval_steps=self.metrics_interval_steps,
            prefill_base_ms=self.latency_ms,
            prefill_ms_per_token=self.prefill_ms_per_token,
            decode_base_ms=self.token_ms,
            decode_ms_per_request=self.decode_ms_per_request,
            scheduling_policy=self.scheduling_policy,
            enable_priority_scheduling=self.enable_priority_scheduling,
            schedule_low_priority_values_first=self.schedule_low_priority_values_first,
            priority_scheduling_preemption_threshold=self.priority_scheduling_preemption_threshold,
            disable_priority_preemption=self.disable_priority_preemption,
            enable_session_radix_cache=self.enable_session_radix_cache,
        )


# Calibrated engines. "laptop-1b": the earlier, uncalibrated guess at one of the original
# testbed's replicas (kept for comparison). "laptop-1b-sglang" (what the benchmarks use):
# Llama-3.2-1B FP8 under SGLang's default scheduler, two replicas sharing one 8 GB laptop
# GPU — serve both from one process (--extra-ports) so they share its timeline. Its
# scheduler constants are SGLang's defaults on a GPU under 20 GB (chunked prefill 2048,
# CUDA graphs up to batch 8, metrics every 40 decode steps, no running-request limit
# besides KV); only the physical constants (KV per replica, prefill and decode costs)
# were fitted, to the original's router and sequential figures alone, and then frozen:
# docs/calibration.md has the targets, the fit and the physical reading of each value.
PRESETS: dict[str, dict[str, Any]] = {
    "quick": {},
    "laptop-1b": {
        "max_running": 48,
        "kv_tokens": 24000,
        "block_tokens": 16,
        "context_tokens": 8192,
        "max_prefill_tokens": 8192,
        "chunked_prefill_tokens": 0,
        "latency_ms": 15.0,
        "prefill_ms_per_token": 0.06,
        "token_ms": 20.0,
        "decode_ms_per_request": 0.8,
        "reply_tokens": 150,
        "reply_spread": 0.5,
        "tool_calls": 8,
    },
    "laptop-1b-sglang": {
        "max_running": 0,
        "kv_tokens": 36000,
        "block_tokens": 16,
        "context_tokens": 8192,
        "max_prefill_tokens": 16384,
        "chunked_prefill_tokens": 2048,
        "cuda_graph_max_bs": 8,
        "decode_eager_ms": 20.0,
        "metrics_interval_steps": 40,
        "latency_ms": 15.0,
        "prefill_ms_per_token": 0.035,
        "token_ms": 12.0,
        "decode_ms_per_request": 0.8,
        "reply_tokens": 150,
        "reply_spread": 0.5,
        "tool_calls": 8,
    },
}


METRIC_NAMES: dict[str, dict[str, tuple[str, str]]] = {
    "sglang": {
        "running": ("sglang:num_running_reqs", "The number of running requests."),
        "queued": ("sglang:num_queue_reqs", "The number of requests in the waiting queue."),
        "token_usage": ("sglang:token_usage", "The token usage (share of the KV cache in use)."),
        "cache_hit_rate": ("sglang:cache_hit_rate", "The prefix cache hit rate of the last prefill batch."),
    },
    "vllm": {
        "running": ("vllm:num_requests_running", "Number of requests in model execution batches."),
        "queued": ("vllm:num_requests_waiting", "Number of requests waiting to be processed."),
        "token_usage": ("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage."),
    },
    "llamacpp": {  # llama-server --metrics
        "running": ("llamacpp:requests_processing", "Number of requests processing."),
        "queued": ("llamacpp:requests_deferred", "Number of requests deferred."),
    },
    "tgi": {
        "running": ("tgi_batch_current_size", "Current batch size"),
        "queued": ("tgi_queue_size", "Current queue size"),
    },
    "none": {  # an engine whose /metrics knows nothing of load (token counters only)
        "token_usage": ("engine_kv_cache_usage_ratio", "KV-cache usage."),
    },
}


def _env(name: str, default: object) -> str:
    return os.environ.get(ENV_PREFIX + name, str(default))


def _preset_defaults(argv: Sequence[str] | None) -> tuple[str, EngineConfig]:
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--preset", choices=sorted(PRESETS), default=_env("PRESET", "quick"))
    known, _ = pre.parse_known_args(argv)
    return known.preset, replace(EngineConfig(), **PRESETS[known.preset])


def parse_args(argv: Sequence[str] | None = None) -> EngineConfig:
    """CLI options, each defaulting to ``LUFTPAUSE_FAKE_ENGINE_<OPTION>`` from the
    environment, else to the chosen ``--preset``'s value."""
    preset, d = _preset_defaults(argv)
    p = argparse.ArgumentParser(
        prog="python -m luftpause.fakes.engine",
        description="Fake OpenAI-compatible LLM engine (no model): a continuous-batching simulator with a "
                    "KV budget and prefix cache, /metrics, /classify, fault directives.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    # In the order --help lists them.
    _server_options(p, preset, d)
    _turn_options(p, d)
    _batch_options(p, d)
    _serving_options(p, d)
    _agent_feature_options(p, d)
    p.add_argument("--fault", action="append", default=[], metavar="DIRECTIVE",
                   help="engine-wide fault directive, repeatable: status=503, status-times=429:2, "
                        "retry-after=3, die-after=4, stall-after=4, linger-after-done=500, hang, wedge, metrics-hang, "
                        "tool-call-as-text, schema-as-arguments, string-scalars (the same as [[fake:...]] in a "
                        "message); PUT /faults {\"faults\": [...]} replaces them while it runs")
    return _config(p, p.parse_args(argv))


def _option(p: argparse.ArgumentParser, flag: str, env: str, kind: type, default: object, text: str) -> None:
    """An option of ``kind``, its default from ``LUFTPAUSE_FAKE_ENGINE_<env>``, else ``default``."""
    p.add_argument(flag, type=kind, default=kind(_env(env, default)), help=f"{text} [env {ENV_PREFIX}{env}]")


def _flag(p: argparse.ArgumentParser, name: str, env: str, default: bool, text: str) -> None:
    """A real engine's store_true flag, its default from ``LUFTPAUSE_FAKE_ENGINE_<env>``."""
    p.add_argument(name, action="store_true", default=_env(env, "1" if default else "0").lower() in TRUE,
                   help=f"{text} [env {ENV_PREFIX}{env}]")


def _server_options(p: argparse.ArgumentParser, preset: str, d: EngineConfig) -> None:
    """The preset, where the engine listens and what it calls itself and its models."""
    p.add_argument("--preset", choices=sorted(PRESETS), default=preset,
                   help=f"calibrated defaults for the options below [env {ENV_PREFIX}PRESET]")
    _option(p, "--host", "HOST", str, d.host, "address to listen on")
    _option(p, "--port", "PORT", int, d.port, "TCP port to listen on")
    _option(p, "--name", "NAME", str, d.name, "engine name used in logs and as owned_by in /v1/models")
    _option(p, "--models", "MODELS", str, ",".join(d.models), "comma-separated model names served")


def _turn_options(p: argparse.ArgumentParser, d: EngineConfig) -> None:
    """What a turn answers, and what its passes cost."""
    _option(p, "--tool-calls", "TOOL_CALLS", int, d.tool_calls,
            "answer with a tool call while tools are offered and the conversation has fewer than N "
            "assistant tool-call turns; text afterwards")  # fmt: skip
    _option(p, "--latency-ms", "LATENCY_MS", float, d.latency_ms,
            "base cost of a prefill pass, ms (time to first token of a short prompt)")
    _option(p, "--token-ms", "TOKEN_MS", float, d.token_ms, "base cost of one decode step, ms (time between tokens)")
    _option(p, "--prefill-ms-per-token", "PREFILL_MS_PER_TOKEN", float, d.prefill_ms_per_token,
            "prefill cost per uncached prompt token, ms")
    _option(p, "--decode-ms-per-request", "DECODE_MS_PER_REQUEST", float, d.decode_ms_per_request,
            "decode step cost per running request, ms")
    _option(p, "--max-running", "MAX_RUNNING", int, d.max_running,
            "most requests generating at once; others wait FIFO (reported as queue); 0 = unlimited")  # fmt: skip
    _option(p, "--reply-tokens", "REPLY_TOKENS", int, d.reply_tokens, "tokens (words) in a text reply (median)")
    _option(p, "--reply-spread", "REPLY_SPREAD", float, d.reply_spread,
            "log-normal sigma of text reply lengths (seeded per prompt); 0 = always --reply-tokens")


def _batch_options(p: argparse.ArgumentParser, d: EngineConfig) -> None:
    """The simulated scheduler's KV cache, prefill batches, decode steps and gauges."""
    _option(p, "--kv-tokens", "KV_TOKENS", int, d.kv_tokens, "KV cache size in tokens (admission budget, prefix cache)")
    _option(p, "--block-tokens", "BLOCK_TOKENS", int, d.block_tokens, "prefix-cache block size in tokens")
    _option(p, "--context-tokens", "CONTEXT_TOKENS", int, d.context_tokens,
            "context length: a request without max_tokens reserves context − prompt tokens; "
            "0 = it reserves its planned reply only")
    _option(p, "--max-prefill-tokens", "MAX_PREFILL_TOKENS", int, d.max_prefill_tokens,
            "uncached prompt tokens one prefill batch takes at most")
    _option(p, "--chunked-prefill-tokens", "CHUNKED_PREFILL_TOKENS", int, d.chunked_prefill_tokens,
            "new tokens one prefill pass takes at most; a longer prompt continues in the next pass; 0 = no chunking")
    _option(p, "--cuda-graph-max-bs", "CUDA_GRAPH_MAX_BS", int, d.cuda_graph_max_bs,
            "largest decode batch run as a CUDA graph; larger batches pay --decode-eager-ms more; 0 = no step")
    _option(p, "--decode-eager-ms", "DECODE_EAGER_MS", float, d.decode_eager_ms,
            "extra cost of a decode step above --cuda-graph-max-bs, ms")
    _option(p, "--metrics-interval-steps", "METRICS_INTERVAL_STEPS", int, d.metrics_interval_steps,
            "decode steps between refreshes of the /metrics gauges (SGLang: 40); they also refresh after "
            "every prefill pass and after 30 idle model seconds")


def _serving_options(p: argparse.ArgumentParser, d: EngineConfig) -> None:
    """The replicas this process serves, the pace and randomness of their answers, their
    connections, and what their /metrics and /openapi.json publish."""
    _option(p, "--extra-ports", "EXTRA_PORTS", str, ",".join(map(str, d.extra_ports)),
            "comma-separated ports of more replicas served by this process on the same simulated GPU "
            "(one GPU shared by several SGLang replicas: one replica's pass delays the others'); "
            "replica i is named <name>-<i> when there are several")
    _option(p, "--stream-interval", "STREAM_INTERVAL", int, d.stream_interval, "tokens per streamed chunk")
    _option(p, "--time-scale", "TIME_SCALE", float, d.time_scale,
            "multiplies every simulated duration (0.25 = four times faster than the modelled engine)")
    _option(p, "--seed", "SEED", int, d.seed, "seed of reply lengths and classifier scores")
    _option(p, "--labels", "LABELS", str, ",".join(d.labels), "comma-separated /classify labels")
    _option(p, "--idle-close-s", "IDLE_CLOSE_S", float, d.idle_close_s,
            "a request arriving on a kept-alive connection idle longer than this is dropped unanswered, "
            "as when a server's keep-alive timer closes it just as the request is sent; 0 = never")
    p.add_argument(
        "--metrics-format",
        choices=sorted(METRIC_NAMES),
        default=_env("METRICS_FORMAT", d.metrics_format),
        help=f"Prometheus metric names to expose [env {ENV_PREFIX}METRICS_FORMAT]",
    )
    p.add_argument(
        "--also-metrics-format",
        default=_env("ALSO_METRICS_FORMAT", ",".join(d.also_metrics_formats)),
        help="comma-separated further name sets for the running, queue and token-usage gauges (e.g. vllm, "
             f"for a router that reads only vLLM's names); read-outs only [env {ENV_PREFIX}ALSO_METRICS_FORMAT]",
    )
    p.add_argument("--openapi", action=argparse.BooleanOptionalAction,
                   default=_env("OPENAPI", "0").lower() in ("1", "true", "yes", "on"),
                   help="publish the routes and the chat request's schema at /openapi.json, as vLLM and SGLang "
                        "(FastAPI servers) do; luftpause reads from it which client APIs the engine serves itself "
                        f"and whether it continues a final assistant message [env {ENV_PREFIX}OPENAPI]")


def _agent_feature_options(p: argparse.ArgumentParser, d: EngineConfig) -> None:
    """The real engines' agent features, each behind its engine's own flag."""
    p.add_argument("--scheduling-policy", choices=VLLM_POLICIES, default=_env("SCHEDULING_POLICY", d.scheduling_policy),
                   help="vLLM's flag: priority = the waiting queue by the request's priority (lower first, then "
                        "arrival) and, when a decode step runs out of KV, the lowest-priority running request "
                        f"preempted (fakes/priority.py) [env {ENV_PREFIX}SCHEDULING_POLICY]")
    _flag(p, "--enable-priority-scheduling", "ENABLE_PRIORITY_SCHEDULING", d.enable_priority_scheduling,
          "SGLang's flag: the waiting queue by the request's priority (higher first, then arrival) and, when the "
          "batch is at --max-running, running requests of a priority lower by more than the threshold preempted")
    _flag(p, "--schedule-low-priority-values-first", "SCHEDULE_LOW_PRIORITY_VALUES_FIRST",
          d.schedule_low_priority_values_first, "SGLang's flag: with --enable-priority-scheduling, lower values first")
    _option(p, "--priority-scheduling-preemption-threshold", "PRIORITY_SCHEDULING_PREEMPTION_THRESHOLD", int,
            d.priority_scheduling_preemption_threshold,
            "SGLang's flag: the priority difference above which a waiting request preempts a running one")
    _flag(p, "--disable-priority-preemption", "DISABLE_PRIORITY_PREEMPTION", d.disable_priority_preemption,
          "SGLang's flag: with --enable-priority-scheduling, order the queue only")
    _flag(p, "--enable-session-radix-cache", "ENABLE_SESSION_RADIX_CACHE", d.enable_session_radix_cache,
          "SGLang's flag: KV of a request's top-level session_id is evicted after all unreferenced KV until "
          "POST /close_session {\"session_id\": ...} (fakes/prefix_cache.py)")


def _config(p: argparse.ArgumentParser, a: argparse.Namespace) -> EngineConfig:
    """The parsed options as a config, once checked (a usage error through ``p`` if not)."""
    try:
        fault_directives.parse(fault_directives.parse_option(f) for f in a.fault)
    except FaultError as err:
        p.error(str(err))
    model_names = tuple(m.strip() for m in a.models.split(",") if m.strip())
    if not model_names:
        p.error("--models needs at least one name")
    labels = tuple(x.strip() for x in a.labels.split(",") if x.strip())
    if len(labels) < 2:
        p.error("--labels needs at least two labels")
    if a.time_scale <= 0:
        p.error("--time-scale must be positive")
    if a.scheduling_policy == "priority" and a.enable_priority_scheduling:
        p.error("--scheduling-policy priority (vLLM) and --enable-priority-scheduling (SGLang) model two engines; "
                "choose one")
    values = {f.name: getattr(a, f.name) for f in fields(EngineConfig) if hasattr(a, f.name)}
    try:
        extra_ports = tuple(int(x) for x in a.extra_ports.split(",") if x.strip())
    except ValueError:
        p.error("--extra-ports must be comma-separated port numbers")
    also = tuple(x.strip() for x in a.also_metrics_format.split(",") if x.strip())
    if any(f not in METRIC_NAMES for f in also):
        p.error(f"--also-metrics-format takes names among {sorted(METRIC_NAMES)}")
    values.update(models=model_names, labels=labels, faults=tuple(a.fault), extra_ports=extra_ports,
                  also_metrics_formats=also)
    return EngineConfig(**values)


def replica_configs(config: EngineConfig) -> list[EngineConfig]:
    """One config per replica this process serves (``--port`` and ``--extra-ports``)."""
    if not config.extra_ports:
        return [config]
    ports = (config.port, *config.extra_ports)
    return [replace(config, port=port, extra_ports=(), name=f"{config.name}-{i}") for i, port in enumerate(ports)]

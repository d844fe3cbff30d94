"""``python -m luftpause.loadgen``: closed-loop agents or MCP sub-agents against a target.

Examples::

    # 4 interactive + 48 batch own-loop agents through luftpause's proxy for 3 minutes
    python -m luftpause.loadgen --base-url http://localhost:8080/v1 --mix interactive:4,batch:48 \\
        --duration-s 180 --context-chars 8000 --tool-calls 3

    # the same against an SGLang router (no luftpause headers are sent there)
    python -m luftpause.loadgen --base-url http://localhost:30000/v1 --mix interactive:4,batch:48

    # fan-out: spawn 16 sub-agents on the runtime and await them all
    python -m luftpause.loadgen --runtime-url http://localhost:7000/mcp --spawn 16
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import urllib.request
from collections.abc import Sequence
from pathlib import Path

from rich.console import Console

from luftpause import logs
from luftpause.loadgen.agents import Clock, Live, Target
from luftpause.loadgen.driver import Group, run_load, workload_json
from luftpause.loadgen.records import fmt, new_table, parser, write_json
from luftpause.loadgen.spawn import SpawnTarget, fan_out
from luftpause.loadgen.workload import Workload


def parse_mix(text: str) -> list[tuple[str, int]]:
    mix = []
    for part in text.split(","):
        cls, _, count = part.strip().partition(":")
        if cls not in ("interactive", "batch") or not count.isdigit():
            raise argparse.ArgumentTypeError(f"--mix wants class:count pairs (interactive:4,batch:48), not {part!r}")
        mix.append((cls, int(count)))
    return mix


def is_luftpause(base_url: str) -> bool:
    """Whether ``base_url`` is luftpause's dataplane (its /health reports the scheduler)."""
    try:
        with urllib.request.urlopen(f"{base_url.rstrip('/').removesuffix('/v1')}/health", timeout=2) as response:
            return "scheduler" in json.loads(response.read())
    except (OSError, ValueError):
        return False


def build_parser() -> argparse.ArgumentParser:
    p = parser("", __doc__)
    where = p.add_mutually_exclusive_group(required=True)
    where.add_argument("--base-url", help="OpenAI-compatible base URL ending in /v1 (own-loop agents)")
    where.add_argument("--runtime-url", help="luftpause runtime MCP URL (…/mcp) for sub-agents")
    p.add_argument("--agents", type=int, default=0, help="closed-loop agents of --class")
    p.add_argument("--class", dest="service_class", choices=("interactive", "batch"), default="batch")
    p.add_argument("--mix", type=parse_mix, help="several classes at once: interactive:4,batch:48")
    p.add_argument("--spawn", type=int, default=0, help="with --runtime-url: spawn N sub-agents and await them all "
                                                        "(or N closed-loop slots with --duration-s)")
    p.add_argument("--caller", default="loadgen", help="x-luftpause-caller")
    p.add_argument("--headers", choices=("auto", "on", "off"), default="auto",
                   help="send luftpause headers: auto = only when --base-url is luftpause's dataplane")
    p.add_argument("--model", default="fake-llama-1b")
    p.add_argument("--duration-s", type=float, default=0.0, help="measurement window, model seconds")
    p.add_argument("--warmup-s", type=float, default=0.0, help="warm-up before the window, model seconds")
    p.add_argument("--context-chars", type=int, default=2000, help="task context up to this many characters")
    p.add_argument("--tool-calls", type=int, default=3, help="at most this many tool calls per run")
    p.add_argument("--tool-delay-s", type=float, default=2.0, help="own-loop agents: each tool call takes this long")
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--time-scale", type=float, default=1.0,
                   help="wall seconds per model second (the engines' --time-scale); results are in model seconds")
    p.add_argument("--json", type=Path, help="write the result here")
    p.add_argument("--quiet", action="store_true", help="no progress display")
    p.add_argument("--max-errors", type=int, default=0, help="exit with status 1 when more runs than this failed")
    return p


def workload(args: argparse.Namespace, cls: str) -> Workload:
    return Workload(service_class=cls, context_chars_min=args.context_chars // 2, context_chars_max=args.context_chars,
                    tool_calls_max=args.tool_calls, tool_delay_s=args.tool_delay_s, max_tokens=args.max_tokens)


async def amain(args: argparse.Namespace) -> dict:
    console = Console(stderr=True) if not args.quiet else None  # progress: a live table on a terminal, else lines
    out = Console() if sys.stdout.isatty() else Console(width=200)  # results, never cut to 80 columns in a pipe
    mix = args.mix or ([(args.service_class, args.agents or args.spawn)] if (args.agents or args.spawn) else [])
    if not mix:
        raise SystemExit("nothing to run: give --agents N, --mix … or --spawn N")
    if args.runtime_url and args.spawn and not args.duration_s:
        total, records = await fan_out(SpawnTarget(args.runtime_url, args.model), workload(args, args.service_class),
                                       args.spawn, Clock(args.time_scale), Live())
        ok = sum(r.ok for r in records)
        out.print(f"fan-out: {args.spawn} sub-agents done in {total:.1f} s (model time), {ok} completed")
        return {"mode": "fan-out", "runs": args.spawn, "all_done_s": total, "ok": ok, "errors": len(records) - ok,
                "records": [r.as_json() for r in records]}
    if not args.duration_s:
        raise SystemExit("--duration-s is required for closed-loop runs")
    groups = [Group(count, workload(args, cls)) for cls, count in mix]
    if args.base_url:
        headers = args.headers == "on" or (args.headers == "auto" and is_luftpause(args.base_url))
        where = {"target": Target(args.base_url.rstrip("/"), args.model, luftpause=headers, caller=args.caller)}
    else:
        where = {"spawn_target": SpawnTarget(args.runtime_url, args.model)}
    result = await run_load(groups, **where, warmup_s=args.warmup_s, duration_s=args.duration_s,
                            time_scale=args.time_scale, console=console)
    table = new_table("loadgen result (model seconds)",
                      ("class", "runs", "runs/min", "p50 s", "p90 s", "TTFT p50 s", "cached share", "errors"), left=())
    for cls, s in result.summary.items():
        table.add_row(cls, str(s["runs"]), f"{s['runs_per_min']:.1f}", fmt(s["latency_p50_s"]), fmt(s["latency_p90_s"]),
                      fmt(s["ttft_p50_s"]), f"{100 * s['cached_share']:.1f} %", str(s["errors"]))
    out.print(table)
    busy = result.cpu.get("machine_busy")
    out.print(f"CPU: machine {'?' if busy is None else f'{100 * busy:.0f} %'} busy of {result.cpu.get('cpus')} CPUs; "
              f"loadgen used {100 * result.cpu['loadgen_cpu_share']:.0f} % of one CPU")
    return {"workload": workload_json(groups), **result.as_json(with_records=True),
            "errors": sum(s["errors"] for s in result.summary.values())}


def main(argv: Sequence[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    logs.configure("loadgen", level="warning")
    result = asyncio.run(amain(args))
    if args.json:
        write_json(args.json, result)
    if result["errors"] > args.max_errors:
        print(f"loadgen: {result['errors']} runs failed, more than --max-errors {args.max_errors}", file=sys.stderr)
        sys.exit(1)
    sys.exit(0)


if __name__ == "__main__":
    main()

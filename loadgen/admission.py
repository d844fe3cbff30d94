"""Where does the queue live? (docs/benchmarks.md): two fake engines that run at most
``--max-running`` requests each, ``--batch`` + ``--interactive`` streaming clients (each
request a new run) through luftpause and then direct to the engines (round robin); the
engines' queue and the scheduler's held and in-flight turns sampled every 0.2 s.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

import aiohttp
from rich.console import Console

from luftpause import logs
from luftpause.dev.procs import wait_until
from luftpause.dev.stack import MODEL
from luftpause.loadgen.agents import Clock, Target, TurnFailed, stream_turn
from luftpause.loadgen.peers import engine_stats, engines_stack
from luftpause.loadgen.records import fmt, mean, new_table, parser, percentile, ratio, write_results
from luftpause.loadgen.timeline import Timeline
from luftpause.vocabulary import CALLER, RUN_ID, SERVICE_CLASS

SAMPLE_S = 0.2
PROMPT = "Summarise the incident report in two sentences. " * 8


async def _client(session: aiohttp.ClientSession, urls: list[str], service_class: str, index: int, luftpause: bool,
                  until: float, ttfts: dict[str, list[float]], errors: list[str]) -> None:
    body = {"model": MODEL, "stream": True, "max_tokens": 64,
            "messages": [{"role": "user", "content": f"{PROMPT} (client {service_class}-{index})"}]}
    turn, clock = 0, Clock()
    while time.monotonic() < until:
        headers = {RUN_ID: f"{service_class}-{index}-{turn}", SERVICE_CLASS: service_class,
                   CALLER: f"{service_class}-{index}"} if luftpause else {}
        target = Target(urls[(index + turn) % len(urls)], MODEL)
        turn += 1
        try:
            ttfts[service_class].append((await stream_turn(session, target, body, headers, clock))[1].first_token)
        except (TurnFailed, aiohttp.ClientError) as exc:
            errors.append(repr(exc))
            await asyncio.sleep(0.05)


async def _measure(urls: list[str], engine_urls: list[str], status_url: str | None, args: Any,
                   luftpause: bool) -> dict[str, Any]:
    ttfts: dict[str, list[float]] = {"interactive": [], "batch": []}
    errors: list[str] = []
    until = time.monotonic() + args.seconds
    timeline = Timeline(engine_urls, status_url, period_s=SAMPLE_S)
    sampling = asyncio.create_task(timeline.run())
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0),
                                     timeout=aiohttp.ClientTimeout(total=120)) as session:
        await asyncio.gather(*(_client(session, urls, cls, i, luftpause, until, ttfts, errors)
                               for cls, count in (("batch", args.batch), ("interactive", args.interactive))
                               for i in range(count)))
    sampling.cancel()
    queue = [sum(q) for q in timeline.engines["engine_queued"]]
    samples = {"engine_queue": queue, "held": timeline.held if status_url else [],
               "in_flight": timeline.in_flight if status_url else []}
    return {"engine_queue_mean": mean(queue), "engine_queue_max": max(queue, default=None),
            "held_mean": mean(samples["held"]), "in_flight_mean": mean(samples["in_flight"]),
            "ttft_p50_interactive_s": percentile(ttfts["interactive"], 50),
            "ttft_p50_batch_s": percentile(ttfts["batch"], 50), "turns_interactive": len(ttfts["interactive"]),
            "turns_batch": len(ttfts["batch"]), "errors": len(errors), "error_examples": sorted(set(errors))[:3],
            "samples": samples}


def main(argv: list[str] | None = None) -> int:
    p = parser("admission", __doc__.split("\n\n")[0])
    p.add_argument("--seconds", type=float, default=25.0, help="measurement time per row (default: 25)")
    p.add_argument("--batch", type=int, default=20, help="batch streaming clients (default: 20)")
    p.add_argument("--interactive", type=int, default=2, help="interactive streaming clients (default: 2)")
    p.add_argument("--max-running", type=int, default=3, help="requests each engine runs at once (default: 3)")
    p.add_argument("--token-ms", type=float, default=10.0, help="the engines' decode step, ms (default: 10)")
    p.add_argument("--out-dir", type=Path, default=Path("bench-results"), help="where the JSON goes")
    args = p.parse_args(argv)
    logs.configure("admission-bench")
    with engines_stack(["--max-running", str(args.max_running), "--token-ms", str(args.token_ms)], 2) as stack:
        engine_urls = [f"http://127.0.0.1:{port}" for port in stack.ports.engines]
        # luftpause first: while the direct clients flood the engines the scheduler keeps probing
        # them, and a limit learned from load not its own would start luftpause's row from a wrong place.
        through = asyncio.run(_measure([f"http://127.0.0.1:{stack.ports.dataplane}/v1"], engine_urls,
                                       f"http://127.0.0.1:{stack.ports.scheduler_http}/status", args, luftpause=True))
        # the next row starts on idle engines: none runs or queues anything
        if not wait_until(lambda: all(s["running"] == s["queued"] == 0 for s in engine_stats(engine_urls)), 60, 0.2):
            raise TimeoutError("the engines did not drain between rows")
        results = {"direct to the engines (round robin)": asyncio.run(
            _measure([f"{url}/v1" for url in engine_urls], engine_urls, None, args, luftpause=False)),
            "through luftpause": through}
    table = new_table("Where the queue lives: engines with max-running per replica, streaming clients",
                      ("variant", "engine queue mean / max", "luftpause held mean", "in flight mean",
                       "ttft p50 interactive", "ttft p50 batch", "interactive / batch", "turns i / b", "errors"))
    for name, r in results.items():
        table.add_row(name, f"{r['engine_queue_mean']:.2f} / {r['engine_queue_max']}", fmt(r["held_mean"], 1),
                      fmt(r["in_flight_mean"], 1), fmt(r["ttft_p50_interactive_s"], 3, " s"),
                      fmt(r["ttft_p50_batch_s"], 3, " s"), ratio(r["ttft_p50_interactive_s"], r["ttft_p50_batch_s"]),
                      f"{r['turns_interactive']} / {r['turns_batch']}", str(r["errors"]))
    console = Console(width=200)
    console.print(table)
    write_results(args.out_dir, "admission", {"args": {k: str(v) for k, v in vars(args).items()},
                                              "results": results}, console)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

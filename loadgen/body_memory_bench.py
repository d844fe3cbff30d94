"""The dataplane's memory under large request bodies that fail (docs/benchmarks.md, "Memory
under large bodies"): per case (a client API, and the engine refusing the body: 413, or a
model no replica serves: 404), on a fresh stack of one instant fake engine, ``--rounds``
rounds of ``--concurrency`` requests of ``--size-mib`` MiB sent together after a warm-up
(the baseline), the dataplane's RSS sampled every 20 ms: per round before, peak, at its
end and ``--settle`` s later; per case what it kept and how long it took to come back
within ``--back-mb`` of the baseline (target: at most 300 MB kept, back within 10 s).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import threading
import time
from collections import Counter
from dataclasses import asdict, dataclass, field

import aiohttp
from rich.console import Console

from luftpause.dev.procs import rss_bytes
from luftpause.dev.stack import MODEL
from luftpause.loadgen.peers import engines_stack
from luftpause.loadgen.records import csv_choices, new_table, parser, write_json

INSTANT = ["--latency-ms", "0", "--token-ms", "0", "--reply-tokens", "4"]
UNKNOWN_MODEL = "no-such-model"
MB = 1_000_000
SAMPLE_S = 0.02
WARM_UP = 4  # small requests of the case's kind before its baseline
TARGET_MB, TARGET_S = 300, 10  # kept at most, back within

# case -> (path, model): the engine refuses the body (413), or no replica serves the model (404)
CASES: dict[str, tuple[str, str]] = {
    f"{api}-{code}": (path, MODEL if code == "413" else UNKNOWN_MODEL)
    for api, path in (("messages", "/v1/messages"), ("responses", "/v1/responses"), ("chat", "/v1/chat/completions"))
    for code in ("413", "404")}


def filler(size: int) -> str:
    """ASCII text of ``size`` characters, words a tokenizer would see."""
    words = "the agent pasted a whole log file into its prompt and asked what went wrong ".encode()
    return (words * (size // len(words) + 1))[:size].decode()


def request_body(path: str, model: str, size: int) -> bytes:
    """A request of about ``size`` bytes in the path's API: the bulk as two text parts of
    one user message (what a harness that pastes a file sends)."""
    if path == "/v1/responses":
        content = [{"type": "input_text", "text": filler(size // 2)}] * 2
        return json.dumps({"model": model, "max_output_tokens": 64,
                           "input": [{"type": "message", "role": "user", "content": content}]}).encode()
    content = [{"type": "text", "text": filler(size // 2)}] * 2
    return json.dumps({"model": model, "max_tokens": 64, "messages": [{"role": "user", "content": content}]}).encode()


class RssSampler:
    """The process's RSS every SAMPLE_S in a thread: the peak since the last ``reset``."""

    def __init__(self, pid: int) -> None:
        self.pid, self.peak, self._stop = pid, rss_bytes(pid), threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> RssSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        while not self._stop.wait(SAMPLE_S):
            self.peak = max(self.peak, rss_bytes(self.pid))

    def reset(self) -> int:
        self.peak = rss_bytes(self.pid)
        return self.peak


@dataclass
class Round:
    before_mb: float
    peak_mb: float
    at_end_mb: float
    settled_mb: float
    seconds: float  # from the first request sent to the last answer
    back_s: float | None  # from the end of the round until within --back-mb of the case's baseline
    statuses: dict[str, int] = field(default_factory=dict)


@dataclass
class Case:
    name: str
    path: str
    model: str
    body_bytes: int
    baseline_mb: float
    rounds: list[Round] = field(default_factory=list)

    @property
    def kept_mb(self) -> float:
        """The most the RSS stood above the baseline --settle seconds after a round."""
        return max(r.settled_mb for r in self.rounds) - self.baseline_mb

    @property
    def peak_mb(self) -> float:
        return max(r.peak_mb for r in self.rounds)

    @property
    def back_s(self) -> float | None:
        """The longest a round took to come back near the baseline (None: one did not)."""
        times = [r.back_s for r in self.rounds]
        return None if None in times else max(times)  # type: ignore[type-var]

    def met(self, target_mb: float, within_s: float) -> bool:
        return self.kept_mb <= target_mb and self.back_s is not None and self.back_s <= within_s


async def send(session: aiohttp.ClientSession, url: str, body: bytes) -> str:
    try:
        async with session.post(url, data=body, headers={"Content-Type": "application/json"}) as response:
            await response.read()
            return str(response.status)
    except aiohttp.ClientError as exc:
        return type(exc).__name__


async def one_round(url: str, body: bytes, concurrency: int) -> Counter:
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0),
                                     timeout=aiohttp.ClientTimeout(total=600)) as session:
        return Counter(await asyncio.gather(*(send(session, url, body) for _ in range(concurrency))))


def steady(pid: int, within: int = MB, every: float = 0.5, limit: float = 30.0) -> None:
    """Until two readings of the RSS ``every`` seconds apart differ by less than ``within``."""
    deadline, last = time.monotonic() + limit, rss_bytes(pid)
    while time.monotonic() < deadline:
        time.sleep(every)
        if abs((now := rss_bytes(pid)) - last) < within:
            return
        last = now


def settle(sampler: RssSampler, baseline: int, seconds: float, back: int) -> tuple[int, float | None]:
    """Watch the RSS for ``seconds``: its last value, and when it first came within
    ``back`` bytes of ``baseline`` (None: not within the time)."""
    started, back_s = time.monotonic(), None
    while True:
        now, elapsed = rss_bytes(sampler.pid), time.monotonic() - started
        if back_s is None and now <= baseline + back:
            back_s = elapsed
        if elapsed >= seconds:
            return now, back_s
        time.sleep(SAMPLE_S)


def run_case(name: str, base: str, pid: int, args: argparse.Namespace) -> Case:
    path, model = CASES[name]
    body = request_body(path, model, int(args.size_mib * 2**20))
    # Warm up on small requests of the same kind, and a Messages one (the dataplane imports
    # the Messages API's SDK in the background from its start, which that waits for): the
    # baseline is the dataplane ready, once its RSS holds still.
    asyncio.run(one_round(base + path, request_body(path, model, 1000), WARM_UP))
    asyncio.run(one_round(base + "/v1/messages", request_body("/v1/messages", MODEL, 1000), 1))
    steady(pid)
    with RssSampler(pid) as sampler:
        baseline = sampler.reset()
        case = Case(name, path, model, len(body), baseline / MB)
        for _ in range(args.rounds):
            before, started = sampler.reset(), time.monotonic()
            statuses = asyncio.run(one_round(base + path, body, args.concurrency))
            seconds, at_end = time.monotonic() - started, rss_bytes(pid)
            settled, back_s = settle(sampler, baseline, args.settle, int(args.back_mb * MB))
            case.rounds.append(Round(before / MB, max(sampler.peak, at_end) / MB, at_end / MB, settled / MB, seconds,
                                     back_s, dict(statuses)))
    return case


def report(console: Console, cases: list[Case], args: argparse.Namespace) -> None:
    table = new_table(f"Dataplane RSS (MB): {args.concurrency} concurrent requests of {args.size_mib:g} MiB that "
                      f"fail, {args.rounds} rounds, {args.settle:g} s after each",
                      ("case", "round", "answers", "before", "peak", "end of round", f"+{args.settle:g} s",
                       f"back within {args.back_mb:g} MB", "kept"), left=("case", "answers"))
    for case in cases:
        for i, r in enumerate(case.rounds, start=1):
            answers = ", ".join(f"{n}x {s}" for s, n in sorted(r.statuses.items()))
            table.add_row(case.name if i == 1 else "", str(i), answers, f"{r.before_mb:.0f}", f"{r.peak_mb:.0f}",
                          f"{r.at_end_mb:.0f}", f"{r.settled_mb:.0f}",
                          "no" if r.back_s is None else f"{r.back_s:.1f} s",
                          f"{r.settled_mb - case.baseline_mb:+.0f}")
    console.print(table)
    summary = new_table(f"Per case: target {TARGET_MB} MB kept at most, back within {args.back_mb:g} MB "
                        f"of the baseline in {TARGET_S} s",
                        ("case", "body MiB", "baseline", "peak", f"kept (+{args.settle:g} s, worst round)",
                         "back in (worst round)", "target"), left=("case",))
    for case in cases:
        summary.add_row(case.name, f"{case.body_bytes / 2**20:.1f}", f"{case.baseline_mb:.0f}", f"{case.peak_mb:.0f}",
                        f"{case.kept_mb:+.0f}", "no" if case.back_s is None else f"{case.back_s:.1f} s",
                        "met" if case.met(TARGET_MB, TARGET_S) else "MISSED")
    console.print(summary)


def main(argv: list[str] | None = None) -> int:
    p = parser("body_memory_bench", __doc__)
    p.add_argument("--size-mib", type=float, default=31.0, help="each request's body, in MiB (31)")
    p.add_argument("--concurrency", type=int, default=16, help="requests sent together in a round (16)")
    p.add_argument("--rounds", type=int, default=3, help="rounds per case (3)")
    p.add_argument("--settle", type=float, default=10.0, help="seconds watched after each round (10)")
    p.add_argument("--back-mb", type=float, default=50.0, help="within this of the baseline counts as back (50)")
    p.add_argument("--cases", type=csv_choices(CASES), default=list(CASES),
                   help=f"comma-separated, of: {', '.join(CASES)}")
    p.add_argument("--json", default="bench-results/body-memory.json", help="where the results go")
    args = p.parse_args(argv)
    console, cases = Console(width=160), []
    for name in args.cases:  # each case on a stack of its own: what one kept does not count against the next
        with engines_stack(INSTANT) as stack:
            cases.append(run_case(name, f"http://127.0.0.1:{stack.ports.dataplane}",
                                  stack.process("dataplane").process.pid, args))
        console.print(f"{name}: kept {cases[-1].kept_mb:+.0f} MB after {args.rounds} rounds")
    report(console, cases, args)
    results = {"settings": {k: v for k, v in vars(args).items() if k != "json"},
               "target": {"kept_mb_at_most": TARGET_MB, "back_within_s": TARGET_S},
               "cases": [{**asdict(c), "kept_mb": c.kept_mb, "peak_mb": c.peak_mb, "back_s": c.back_s,
                          "target_met": c.met(TARGET_MB, TARGET_S)} for c in cases]}
    console.print(f"written to {write_json(args.json, results)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

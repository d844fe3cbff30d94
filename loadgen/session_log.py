"""Where the agents' contexts lived: a fake engine's request log read by session.

The fake engine logs every finished request (``chat.done``) with the replica that served
it, the ``session_id`` it was served with (with ``--enable-session-radix-cache``: luftpause
names interactive runs' sessions, the client-hint peer rows every run's), its prompt and
cached tokens and how long it took. Read by session, that says how the runs were spread
over the replicas' KV pools and when a run's context was gone after a tool pause:

- ``sessions``, ``moves``: sessions seen, and turns served on another replica than the
  session's turn before;
- ``pools``: the share of the time (sampled every ``--every-s`` model seconds) with the
  sessions under way (first request's start to last one's end) split over the replicas
  so, largest first: ``"2+2"`` is two on each of two replicas, ``"3+1"`` three on one;
- ``lost``: per tool pause (model seconds, between a session's request ending and its
  next starting), the turns back from it whose prompt was under half cached, and all;
- ``causes``: those lost turns back on the same replica, by what left no room for the
  context (the replica's KV pool from the ``engine_start`` line), each with the tokens of the
  context before the pause computed again: ``agents over the pool`` (its context and the
  other sessions' kept there, each its latest prompt, outgrow the pool), ``a request without
  a session`` (one served there during the pause, such as a batch turn when luftpause names
  interactive runs only, did not fit beside them), split by whether nothing else was running
  on the replica when it started (``alone``), and ``other`` (neither: a partial eviction).

Model seconds are wall seconds over the engine's time scale (its ``engine_start`` line).
``--since`` and ``--until`` pick one row of a benchmark that ran several one after another.

    python -m luftpause.loadgen.session_log work/b2-…/logs/engine.log --since 2026-12-06T04:46:55
    python -m luftpause.loadgen.session_log bench-archive/regimes/kv-bound/spread/engine-strict-….json.gz

``--archive OUT.json.gz`` also writes the summary with the lines it was read from (requests
without a session too, for ``causes``), which this reads again as it read the log.
"""

from __future__ import annotations

import argparse
import gzip
import json
import re
import sys
from collections import Counter, defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import NamedTuple

LINE = re.compile(r"^(\S+) \[\w+\s*\] (chat\.done|engine_start)\s+(.*)$")
FIELD = re.compile(r"(\w+)=(\S+)")
PAUSE_BINS = ((2.0, "<2 s"), (5.0, "2-5 s"), (10.0, "5-10 s"), (float("inf"), ">=10 s"))
LOST_BELOW = 0.5  # a turn back from a pause with less of its prompt cached lost its context
OVER_POOL = "agents over the pool"
UNNAMED_ALONE = "a request without a session, alone on the replica"
UNNAMED_BESIDE = "a request without a session, beside others"
OTHER = "other"


@dataclass(frozen=True)
class Served:
    """One finished request: its session ("" without one), when (wall seconds), where, and
    its tokens."""

    session: str
    replica: str
    start: float
    end: float
    prompt: int
    cached: int


class Log(NamedTuple):
    """What :func:`read` found: the requests in order of start, the engine's time scale (1.0
    when no ``engine_start`` line gives it), its KV pool per replica (0 when none gives it), and
    the lines read for them (what ``--archive`` keeps)."""

    served: list[Served]
    scale: float
    kv_tokens: int
    lines: list[str]


def read(lines: Iterable[str], since: str = "", until: str = "") -> Log:
    """The finished requests stamped from ``since`` to before ``until`` (ISO times; empty: no
    bound), with and without a session."""
    served: list[Served] = []
    kept: list[str] = []
    scale, kv_tokens = 1.0, 0
    for line in lines:
        match = LINE.match(line)
        if match is None:
            continue
        fields = dict(FIELD.findall(match.group(3)))
        if match.group(2) == "engine_start":  # read whatever ``since`` says
            scale = float(fields.get("time_scale", scale))
            kv_tokens = int(fields.get("kv_tokens", kv_tokens))
            kept.append(line.rstrip("\n"))
            continue
        if match.group(1) < since or (until and match.group(1) >= until):
            continue
        end = datetime.fromisoformat(match.group(1).replace("Z", "+00:00")).timestamp()
        session = fields.get("session_id", "None")
        served.append(Served("" if session == "None" else session, fields["replica"],
                             end - float(fields["duration_s"]), end,
                             int(fields["prompt_tokens"]), int(fields["cached_tokens"])))
        kept.append(line.rstrip("\n"))
    return Log(sorted(served, key=lambda s: s.start), scale, kv_tokens, kept)


def log_lines(path: str) -> list[str]:
    """A log's lines: plain or gzipped text, or an ``--archive`` file (its ``engine_log``)."""
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt", encoding="utf-8", errors="replace") as file:
        text = file.read()
    if text.startswith("{"):
        return json.loads(text)["engine_log"]
    return text.splitlines()


def _by_session(served: list[Served]) -> dict[str, list[Served]]:
    sessions: dict[str, list[Served]] = defaultdict(list)
    for request in served:
        if request.session:
            sessions[request.session].append(request)
    return sessions


def pools(sessions: dict[str, list[Served]], scale: float, every_s: float) -> dict[str, float]:
    """Share of the sampled moments by how the sessions under way were split over replicas."""
    spans = [(turns[0].start, turns[-1].end, turns[0].replica) for turns in sessions.values()]
    if not spans:
        return {}
    first, last = min(s[0] for s in spans), max(s[1] for s in spans)
    splits: Counter[str] = Counter()
    moment = first
    while moment <= last:
        counts = Counter(replica for start, end, replica in spans if start <= moment <= end)
        if counts:
            splits["+".join(str(n) for n in sorted(counts.values(), reverse=True))] += 1
        moment += every_s * scale
    total = sum(splits.values())
    return {split: round(n / total, 3) for split, n in splits.most_common()}


def lost(sessions: dict[str, list[Served]], scale: float) -> dict[str, list[int]]:
    """Per pause bin: [turns back whose context was lost, turns back]."""
    counts = {label: [0, 0] for _, label in PAUSE_BINS}
    for turns in sessions.values():
        for before, after in zip(turns, turns[1:]):
            pause = (after.start - before.end) / scale
            label = next(label for bound, label in PAUSE_BINS if pause < bound)
            counts[label][1] += 1
            if after.cached < LOST_BELOW * before.prompt:
                counts[label][0] += 1
    return counts


def causes(served: list[Served], sessions: dict[str, list[Served]], kv_tokens: int) -> dict[str, list[int]]:
    """Per cause, [lost turns back on their replica, tokens of their context before the pause
    computed again] (the module's docstring); empty without the pool's size."""
    if not kv_tokens:
        return {}
    counts = {cause: [0, 0] for cause in (OVER_POOL, UNNAMED_ALONE, UNNAMED_BESIDE, OTHER)}
    for name, turns in sessions.items():
        for before, after in zip(turns, turns[1:]):
            if after.replica != before.replica or after.cached >= LOST_BELOW * before.prompt:
                continue
            count = counts[_cause(served, sessions, name, before, after, kv_tokens)]
            count[0] += 1
            count[1] += max(0, before.prompt - after.cached)
    return counts


def _cause(served: list[Served], sessions: dict[str, list[Served]], name: str, before: Served, after: Served,
           kv_tokens: int) -> str:
    held = before.prompt + _kept_beside(sessions, name, before.replica, before.end, after.start)
    if held > kv_tokens:
        return OVER_POOL
    during = [r for r in served if not r.session and r.replica == before.replica
              and r.start < after.start and r.end > before.end]
    largest = max(during, key=lambda r: r.prompt, default=None)
    if largest is None or held + largest.prompt <= kv_tokens:
        return OTHER
    beside = any(r is not largest and r.replica == largest.replica and r.start <= largest.start < r.end
                 for r in served)
    return UNNAMED_BESIDE if beside else UNNAMED_ALONE


def _kept_beside(sessions: dict[str, list[Served]], name: str, replica: str, start: float, end: float) -> int:
    """The other sessions' contexts on ``replica`` during a pause from ``start`` to ``end``:
    of each under way then whose latest request before ``end`` was served there, its prompt."""
    total = 0
    for other, turns in sessions.items():
        if other == name or turns[0].start >= end or turns[-1].end <= start:
            continue
        latest = [t for t in turns if t.start < end][-1]
        if latest.replica == replica:
            total += latest.prompt
    return total


def summary(served: list[Served], scale: float, every_s: float, kv_tokens: int = 0) -> dict[str, object]:
    sessions = _by_session(served)
    moves = sum(a.replica != b.replica for turns in sessions.values() for a, b in zip(turns, turns[1:]))
    return {"sessions": len(sessions), "moves": moves, "pools": pools(sessions, scale, every_s),
            "lost": lost(sessions, scale), "causes": causes(served, sessions, kv_tokens)}


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="session_log", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("log", help="a fake engine's log (engine.log in a benchmark's work folder; .gz read as such), "
                               "or a file --archive wrote")
    p.add_argument("--since", default="", help="skip lines stamped before this ISO time (one row of several)")
    p.add_argument("--until", default="", help="and those stamped at or after this one")
    p.add_argument("--every-s", type=float, default=2.0, help="sampling step for pools, model seconds")
    p.add_argument("--archive", metavar="OUT.json.gz",
                   help="also write the summary and the log lines it was read from (gzipped JSON), to read again")
    a = p.parse_args(argv)
    log = read(log_lines(a.log), a.since, a.until)
    if not any(s.session for s in log.served):
        print(f"session_log: no request with a session_id in {a.log}", file=sys.stderr)
        return 1
    result = summary(log.served, log.scale, a.every_s, log.kv_tokens)
    print(json.dumps(result))
    if a.archive:
        document = {"source": a.log, "since": a.since, "until": a.until, "summary": result,
                    "engine_log": log.lines}
        with gzip.open(a.archive, "wt", encoding="utf-8") as out:
            json.dump(document, out)
    return 0


if __name__ == "__main__":
    sys.exit(main())

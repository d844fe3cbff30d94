"""Which prefill passes stall interactive decoding on a shared GPU: a measurement tool.

On the testbed both replicas share one simulated GPU, so every prefill pass of either
replica stops both replicas' decoding. For a B2 run this tells:

- per interactive token (from one decode step of an interactive request to its next),
  the time in decode steps and in prefill passes by kind: interactive or batch, a run's
  first turn, a later turn still offered the tool, or a tool-less answer turn; and the
  passes' fixed part (``prefill_base_ms``) of it (:func:`stall_split`);
- how many interactive requests were decoding over the GPU's time and while batch turns
  were prefilled, and the least that count could average over batch prefill if every
  pass went to the moments with the fewest (:func:`overlap`): the bound on what timing
  batch prefills around interactive decoding could take off the stall;
- per kind of later turn, how many prefilled half their prompt or more again, by the
  time since their run's previous turn ran (:func:`reuse`).

It records the fake engine's passes without changing them: :func:`install` wraps the
engine model's cost functions and the GPU's ``run`` to write one JSON line per pass (its
end on the GPU's clock, duration, replica, and its requests' class, run, turn and new
tokens, read from the load generator's prompts). It is installed in the engine process
through ``sitecustomize`` when ``LUFTPAUSE_PASSTRACE`` names a directory;
``--record`` sets both and runs the bench:

    python -m luftpause.loadgen.passtrace DIR --record b2 --b2-parts proxy --peers router --no-envoy
    python -m luftpause.loadgen.passtrace DIR

The second prints the figures per trace file (``passes-*.jsonl``, gzipped or not) and
variant, in the order the bench ran them (the engines are reset between variants; here
router, roam, strict per repeat). Times are model milliseconds.
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import re
import subprocess
import sys
from collections import defaultdict
from pathlib import Path
from typing import Any

ENV = "LUFTPAUSE_PASSTRACE"
_TASK = re.compile(r"Task (\S*-(interactive|batch)-\S*):")


def _describe(request: Any) -> dict[str, Any]:
    """A request of a pass: its class and run (the load generator's task names its seed),
    its turn (tool results so far), whether the tool list was offered, its new tokens."""
    match = _TASK.search(request.prompt_text[:4000])
    return {"id": request.id, "cls": match.group(2) if match else "?", "run": match.group(1) if match else "",
            "turn": request.prompt_text.count("Lookup result "), "tools": request.prompt_text.startswith("<|tools|>"),
            "extend": request.extend_tokens, "prompt": request.prompt_tokens}


def install(directory: str) -> None:
    """Wrap the fake engine's pass costs and GPU to write ``DIR/passes-<pid>.jsonl``."""
    import asyncio

    from luftpause.fakes import engine_state, sim

    out = open(Path(directory) / f"passes-{os.getpid()}.jsonl", "a", buffering=1)  # noqa: SIM115 (process-long)
    pending: dict[int, dict[str, Any]] = {}
    replicas: dict[int, int] = {}  # id(engine model) -> replica number, by first pass (a reset makes a new model)

    def replica(model: Any) -> int:
        return replicas.setdefault(id(model), len(replicas))

    prefill_ms, decode_ms = sim.EngineModel.prefill_ms, sim.EngineModel.decode_ms

    def traced_prefill(self: Any, admitted: Any) -> float:
        ms = prefill_ms(self, admitted)
        pending[id(asyncio.current_task())] = {"kind": "P", "replica": replica(self), "ms": ms,
                                               "requests": [_describe(r) for r in admitted]}
        return ms

    def traced_decode(self: Any) -> float:
        ms = decode_ms(self)
        batch = self._decode_batch if self._decode_batch is not None else self.decoding()
        interactive = [r.id for r in batch if "-interactive-" in r.prompt_text[:4000]]
        pending[id(asyncio.current_task())] = {"kind": "D", "replica": replica(self), "ms": ms,
                                               "ids": [r.id for r in batch], "interactive": interactive}
        return ms

    gpu_run = engine_state.Gpu.run

    async def traced_run(self: Any, model_ms: float, continuing: bool = False) -> None:
        await gpu_run(self, model_ms, continuing)
        record = pending.pop(id(asyncio.current_task()), None)
        if record is not None:
            record["end"] = self._free_at / self.time_scale * 1000  # model ms on the GPU's clock
            out.write(json.dumps(record) + "\n")

    reset = engine_state.Simulator.reset

    def traced_reset(self: Any) -> bool:
        done = reset(self)
        if done:
            out.write(json.dumps({"kind": "reset"}) + "\n")
        return done

    sim.EngineModel.prefill_ms = traced_prefill  # type: ignore[method-assign]
    sim.EngineModel.decode_ms = traced_decode  # type: ignore[method-assign]
    engine_state.Gpu.run = traced_run  # type: ignore[method-assign]
    engine_state.Simulator.reset = traced_reset  # type: ignore[method-assign]


def site_dir() -> Path:
    """A directory whose ``sitecustomize.py`` installs the trace when ``LUFTPAUSE_PASSTRACE`` is set."""
    path = Path(os.environ.get("TMPDIR", "/tmp")) / "luftpause-passtrace-site"
    path.mkdir(parents=True, exist_ok=True)
    (path / "sitecustomize.py").write_text(
        "import os, sys\n"
        f"if os.environ.get({ENV!r}) and any('fakes.engine' in a for a in sys.orig_argv):\n"
        f"    from luftpause.loadgen.passtrace import install\n"
        f"    install(os.environ[{ENV!r}])\n")
    return path


def _kind(request: dict[str, Any]) -> str:
    """first: a run's first turn; tool-result: a later turn still offered the tool (its
    prompt extends the run's last one); answer: a later turn without the tool list, whose
    prompt (tools rendered first) shares no prefix with the run's earlier turns."""
    if request["turn"] == 0:
        return f"{request['cls']}-first"
    tools = request.get("tools")
    return f"{request['cls']}-{'later' if tools is None else 'tool-result' if tools else 'answer'}"


def segments(records: list[dict[str, Any]]) -> list[list[dict[str, Any]]]:
    """The passes of each variant: split where the engines were reset (both replicas)."""
    out: list[list[dict[str, Any]]] = [[]]
    for record in records:
        if record["kind"] == "reset":
            if out[-1]:
                out.append([])
        else:
            out[-1].append(record)
    return [s for s in out if len(s) > 100]


def _split(q: dict[str, Any], base_ms: float) -> list[tuple[dict[str, Any], float, float]]:
    """A prefill pass's time per request: (request, its share, its share of the fixed
    part); the per-token part by new tokens, the fixed part evenly."""
    total = sum(r["extend"] for r in q["requests"]) or 1
    n = len(q["requests"])
    return [(r, (q["ms"] - base_ms) * r["extend"] / total + base_ms / n, base_ms / n) for r in q["requests"]]


def stall_split(passes: list[dict[str, Any]], base_ms: float = 15.0) -> dict[str, Any]:
    """Per interactive token (a decode step that advanced an interactive request, from the
    end of that request's previous decode step): the time in decode steps and in prefill
    passes by kind, and the prefill's share of the GPU's time by kind."""
    passes = sorted(passes, key=lambda p: p["end"])
    last_step: dict[tuple[int, int], int] = {}  # (replica, interactive request id) -> index of its last decode pass
    tokens = overlapped = 0
    between: dict[str, float] = defaultdict(float)
    fixed: dict[str, float] = defaultdict(float)
    for i, p in enumerate(passes):
        if p["kind"] != "D":
            continue
        for rid in p["interactive"]:  # request ids are per replica
            j = last_step.get((p["replica"], rid))
            last_step[(p["replica"], rid)] = i
            if j is None:
                continue
            tokens += 1
            prefilled = False
            for q in passes[j + 1:i + 1]:
                if q["kind"] == "D":
                    between["decode"] += q["ms"]
                    continue
                prefilled = True
                for r, ms, fixed_ms in _split(q, base_ms):
                    between[_kind(r)] += ms
                    fixed[_kind(r)] += fixed_ms
            overlapped += prefilled
    span = passes[-1]["end"] - (passes[0]["end"] - passes[0]["ms"])
    gpu: dict[str, float] = defaultdict(float)
    new_tokens: dict[str, int] = defaultdict(int)
    counts: dict[str, int] = defaultdict(int)
    prefill_passes = 0
    for q in passes:
        if q["kind"] == "D":
            gpu["decode"] += q["ms"]
            continue
        prefill_passes += 1
        for r, ms, _ in _split(q, base_ms):
            gpu[_kind(r)] += ms
            new_tokens[_kind(r)] += r["extend"]
            counts[_kind(r)] += 1
    per = (lambda d: {k: round(v / tokens, 2) for k, v in sorted(d.items())}) if tokens else (lambda d: {})
    return {"interactive_tokens": tokens,
            "tokens_with_prefill_between": round(overlapped / tokens, 3) if tokens else None,
            "ms_per_interactive_token": per(between),
            "fixed_part_ms_per_token": per(fixed),
            "gpu_share": {k: round(v / span, 3) for k, v in sorted(gpu.items())},
            "prefill_passes_per_s": round(prefill_passes / span * 1000, 2),
            "requests_per_pass": round(sum(counts.values()) / prefill_passes, 2) if prefill_passes else None,
            "new_tokens_per_request_pass": {k: round(new_tokens[k] / counts[k]) for k in sorted(counts)}}


def overlap(passes: list[dict[str, Any]]) -> dict[str, Any]:
    """How many interactive requests were decoding (in either replica's latest decode
    step) over the GPU's time, and while batch turns were prefilled. A batch prefill
    pass stalls every interactive request decoding then, so the mean of that count over
    batch prefill time, against its mean over all time, says how well prefill already
    avoids interactive decoding; ``ideal_mean_during_batch_prefill`` is the mean if all
    batch prefill time went to the moments with the fewest decoding (the time they
    had, the passes not lengthening them): the most any timing of these passes could
    take off the stall they cause."""
    passes = sorted(passes, key=lambda p: p["end"])
    latest: dict[int, set[int]] = defaultdict(set)  # replica -> interactive ids of its latest decode step
    by_time: dict[int, float] = defaultdict(float)
    by_prefill: dict[int, float] = defaultdict(float)
    for p in passes:
        k = sum(len(ids) for ids in latest.values())
        by_time[k] += p["ms"]
        if p["kind"] == "P":
            if any(r["cls"] == "batch" for r in p["requests"]):
                by_prefill[k] += p["ms"]
        else:
            latest[p["replica"]] = set(p["interactive"])
    total, prefill = sum(by_time.values()), sum(by_prefill.values())
    if not total or not prefill:
        return {}
    left, weighted = prefill, 0.0
    for k in sorted(by_time):
        take = min(left, by_time[k])
        weighted += k * take
        left -= take
    return {"time_share_by_decoding": {k: round(v / total, 3) for k, v in sorted(by_time.items())},
            "batch_prefill_share_by_decoding": {k: round(v / prefill, 3) for k, v in sorted(by_prefill.items())},
            "batch_prefill_gpu_share": round(prefill / total, 3),
            "mean_decoding_over_time": round(sum(k * v for k, v in by_time.items()) / total, 2),
            "mean_decoding_during_batch_prefill": round(sum(k * v for k, v in by_prefill.items()) / prefill, 2),
            "ideal_mean_during_batch_prefill": round(weighted / prefill, 2)}


def reuse(passes: list[dict[str, Any]]) -> dict[str, Any]:
    """Later turns (after a tool result) by how much of their prompt they prefilled
    again, against the time since their run's previous turn last ran (its last pass):
    a later turn that finds its run's context cached prefills only what was added."""
    passes = sorted(passes, key=lambda p: p["end"])
    Key = tuple[int, int]  # (replica, request id): ids are per replica
    first: dict[Key, tuple[float, dict[str, Any]]] = {}  # request -> (its first pass's start, request)
    extend: dict[Key, int] = defaultdict(int)
    last_end: dict[Key, float] = {}
    for p in passes:
        if p["kind"] == "P":
            for r in p["requests"]:
                key = (p["replica"], r["id"])
                first.setdefault(key, (p["end"] - p["ms"], r))
                extend[key] += r["extend"]
                last_end[key] = p["end"]
        else:
            for rid in p["ids"]:
                last_end[(p["replica"], rid)] = p["end"]
    turns: dict[tuple[str, int], Key] = {}
    for key, (_, r) in first.items():
        turns.setdefault((r.get("run", ""), r["turn"]), key)
    rows: dict[str, dict[str, list[int]]] = defaultdict(lambda: defaultdict(lambda: [0, 0]))
    for key, (started, r) in first.items():
        if r["turn"] == 0 or not r.get("run"):
            continue
        before = turns.get((r["run"], r["turn"] - 1))
        if before is None or before not in last_end:
            continue
        gap_s = (started - last_end[before]) / 1000
        bucket = "<3 s" if gap_s < 3 else "3-6 s" if gap_s < 6 else "6-12 s" if gap_s < 12 else ">=12 s"
        row = rows[_kind(r)][bucket]
        row[0] += 1
        row[1] += extend[key] >= r["prompt"] / 2  # prefilled half its prompt or more: its context was gone
    return {kind: {b: {"turns": n, "prefilled_again": m} for b, (n, m) in sorted(buckets.items())}
            for kind, buckets in sorted(rows.items())}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("directory", type=Path)
    parser.add_argument("--record", nargs=argparse.REMAINDER, metavar="BENCH_ARGS",
                        help="first run python -m luftpause.loadgen.bench BENCH_ARGS with the trace on")
    args = parser.parse_args(argv)
    if args.record is not None:
        args.directory.mkdir(parents=True, exist_ok=True)
        env = {**os.environ, ENV: str(args.directory.resolve()),
               "PYTHONPATH": os.pathsep.join(x for x in (str(site_dir()), os.environ.get("PYTHONPATH", "")) if x)}
        subprocess.run([sys.executable, "-m", "luftpause.loadgen.bench", *args.record], env=env, check=True)
    for path in sorted([*args.directory.glob("passes-*.jsonl"), *args.directory.glob("passes-*.jsonl.gz")]):
        text = gzip.decompress(path.read_bytes()).decode() if path.suffix == ".gz" else path.read_text()
        records = [json.loads(line) for line in text.splitlines() if line.strip()]
        for n, passes in enumerate(segments(records)):
            figures = {"file": path.name, "variant": n, "stall": stall_split(passes), "overlap": overlap(passes),
                       "later_turns": reuse(passes)}
            sys.stdout.write(json.dumps(figures, indent=1) + "\n")


if __name__ == "__main__":
    main()

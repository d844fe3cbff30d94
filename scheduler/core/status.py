"""The status view: a plain-value picture of the state for the status endpoints and the
page (replicas with their capacity and reserve, held turns by class and caller, runs by
stage). It decides nothing.
"""

from __future__ import annotations

from luftpause.scheduler.core.limit import _keeps_slots, batch_reserve
from luftpause.scheduler.core.state import State


def status(state: State, now_ms: int) -> dict:
    """A plain-value picture of the state for the status endpoints (the host adds each
    replica's ``base_url`` from the pool, after its name: SchedulerHost.status)."""
    replicas = [
        {
            "name": r.name,
            "kind": r.kind,
            "models": sorted(r.models),
            "healthy": r.healthy,
            "stalled": r.stalled,
            "silent": len(r.silent_turns),
            "unseen": r.unseen,
            "load_known": r.load_known,
            "running": r.running,
            "queued": r.queued,
            "in_flight": r.in_flight,
            "leased_idle": r.leased_idle,
            "capacity": -1 if r.capacity is None else r.capacity,
            "decode_ceiling": r.ceiling,
            "batch_reserve": batch_reserve(r, _keeps_slots(state)),
            "kv_used_tokens": r.kv_used,
            "kv_total_tokens": r.kv_total,
            "turn_ms": r.turn_ms,
            "token_us": r.token_us,
            "interactive_runs": r.interactive_runs,
        }
        for r in sorted(state.replicas.values(), key=lambda r: r.name)
    ]
    by_class: dict[str, list[int]] = {}
    by_caller: dict[str, list[int]] = {}
    for turn in state.held.values():
        wait = max(0, now_ms - turn.arrived_ms)
        for groups, key in ((by_class, turn.service_class), (by_caller, turn.caller)):
            count, longest = groups.get(key, [0, 0])
            groups[key] = [count + 1, max(longest, wait)]
    runs: dict[tuple[str, str], int] = {}
    for run in state.runs.values():
        key = (run.stage.value, run.service_class)
        runs[key] = runs.get(key, 0) + 1

    def groups(items: dict[str, list[int]]) -> list[dict]:
        return [{"key": k, "count": c, "longest_wait_ms": w} for k, (c, w) in sorted(items.items())]

    return {
        "replicas": replicas,
        "held": len(state.held),
        "held_by_class": groups(by_class),
        "held_by_caller": groups(by_caller),
        "runs": [{"stage": s, "service_class": c, "count": n} for (s, c), n in sorted(runs.items())],
        "in_flight": len(state.turns),
        "resynced": state.resynced,
    }


def run_page(state: State, now_ms: int, limit: int, cursor: int = 0, caller: str | None = None,
             stage: str | None = None, service_class: str | None = None) -> dict:
    """One page of the runs, most recently active first, with what each is doing: its
    stage, class, caller, replica, turns placed, turns held now, its context and the reply
    tokens it was served, its age and how long since its last turn. ``caller``, ``stage``
    and ``service_class`` filter (exact values); ``cursor`` is the offset of the page (the
    last page's ``next_cursor``), None past the last page."""
    runs = [r for r in state.runs.values()
            if (caller is None or r.caller == caller) and (stage is None or r.stage.value == stage)
            and (service_class is None or r.service_class == service_class)]
    runs.sort(key=lambda r: (-r.last_seen_ms, r.run_id))
    page = runs[cursor:cursor + limit]
    end = cursor + len(page)
    return {
        "runs": [
            {
                "run_id": r.run_id,
                "stage": r.stage.value,
                "class": r.service_class,
                "caller": r.caller,
                "replica": r.replica,
                "turns": r.turns,
                "held": len(state.held_by_run.get(r.run_id, ())),
                "context_tokens": r.context_tokens,
                "generated_tokens": r.generated_tokens,
                "age_s": round(max(0, now_ms - (r.started_ms or r.last_seen_ms)) / 1000, 1),
                "idle_s": round(max(0, now_ms - r.last_seen_ms) / 1000, 1),
            }
            for r in page
        ],
        "total": len(runs),
        "next_cursor": end if end < len(runs) else None,
    }

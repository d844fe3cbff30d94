"""What the scheduler refuses before anything reaches its state: Admit and Resync
requests with empty or oversized ids (INVALID_ARGUMENT).

An Admit with an empty turn id would hold a slot nobody can report on or cancel; a
Resync entry with an empty run id describes no run. The caller limit is the dataplane's
header limit; ids are bounded so one request cannot grow the state without limit.
"""

from __future__ import annotations

from luftpause.proto import scheduler_pb2 as pb
from luftpause.vocabulary import MAX_CALLER_BYTES, MAX_ID_BYTES


def _id_problem(name: str, value: str, *, required: bool = True, limit: int = MAX_ID_BYTES) -> str | None:
    if required and not value:
        return f"{name} must not be empty"
    if len(value.encode()) > limit:
        return f"{name} is over {limit} bytes"
    return None


def _first(*problems: str | None) -> str | None:
    return next((problem for problem in problems if problem), None)


def admit_problem(request: pb.AdmitRequest) -> str | None:
    """Why this Admit is malformed, or None. One-pass calls belong to no run."""
    return _first(
        _id_problem("turn_id", request.turn_id),
        _id_problem("run_id", request.run_id, required=not request.one_pass),
        _id_problem("caller", request.caller, required=False, limit=MAX_CALLER_BYTES),
        _id_problem("model", request.model),
    )


def resync_problem(request: pb.ResyncRequest) -> str | None:
    """Why this Resync is malformed, or None (then nothing of it is applied)."""
    for index, run in enumerate(request.runs):
        problem = _first(_id_problem("run_id", run.run_id), _id_problem("caller", run.caller, required=False, limit=MAX_CALLER_BYTES),
                         _id_problem("replica", run.replica, required=False))
        if problem:
            return f"runs[{index}]: {problem}"
    for index, turn in enumerate(request.turns):
        problem = _first(_id_problem("turn_id", turn.turn_id), _id_problem("run_id", turn.run_id),
                         _id_problem("caller", turn.caller, required=False, limit=MAX_CALLER_BYTES),
                         _id_problem("replica", turn.replica), _id_problem("model", turn.model))
        if problem:
            return f"turns[{index}]: {problem}"
    return None

"""The dataplane's run book: what it must hand the scheduler on Resync, and which run a
returned tool_call id belongs to."""

from __future__ import annotations

from dataclasses import dataclass

from luftpause.dataplane.constants import TOOL_CALL_MEMORY_S
from luftpause.vocabulary import RUN_IDLE_TIMEOUT_S

IDLE, GENERATING, PAUSED = "idle", "generating", "paused"


@dataclass
class RunRecord:
    run_id: str
    service_class: str
    caller: str
    replica: str = ""
    stage: str = IDLE
    last_seen: float = 0.0


@dataclass(frozen=True)
class InFlightTurn:
    turn_id: str
    run_id: str
    replica: str
    model: str
    service_class: str
    caller: str


class RunBook:
    """Mutable on purpose: this is the shell, touched only from the event loop."""

    def __init__(self) -> None:
        self.runs: dict[str, RunRecord] = {}
        self.turns: dict[str, InFlightTurn] = {}
        self._tool_calls: dict[str, tuple[str, float]] = {}  # tool_call id -> (run id, seen at)
        self.sessions: set[str] = set()  # runs named by a harness's session header

    def run_for_tool_calls(self, tool_call_ids: list[str], now: float) -> str | None:
        for call_id in tool_call_ids:
            entry = self._tool_calls.get(call_id)
            if entry is not None and now - entry[1] < TOOL_CALL_MEMORY_S:
                return entry[0]
        return None

    def remember_tool_calls(self, run_id: str, tool_call_ids: list[str], now: float) -> None:
        for call_id in tool_call_ids:
            self._tool_calls[call_id] = (run_id, now)

    def touch(self, run_id: str, service_class: str, caller: str, now: float) -> RunRecord:
        record = self.runs.get(run_id)
        if record is None:
            record = self.runs[run_id] = RunRecord(run_id, service_class, caller)
        record.service_class, record.caller, record.last_seen = service_class, caller, now
        return record

    def turn_placed(self, turn: InFlightTurn, now: float) -> None:
        self.turns[turn.turn_id] = turn
        record = self.touch(turn.run_id, turn.service_class, turn.caller, now)
        record.replica, record.stage = turn.replica, GENERATING

    def turn_ended(self, turn_id: str, stage: str, now: float) -> None:
        turn = self.turns.pop(turn_id, None)
        if turn is None:
            return
        record = self.runs.get(turn.run_id)
        if record is not None:
            record.stage, record.last_seen = stage, now

    def mark_session(self, run_id: str) -> None:
        """The run is a harness's session: it ends when the session goes idle."""
        self.sessions.add(run_id)

    def forget_run(self, run_id: str) -> None:
        self.runs.pop(run_id, None)
        self.sessions.discard(run_id)

    def sweep(self, now: float) -> list[str]:
        """Drop idle runs and stale tool_call ids; the harness sessions among the dropped
        runs, which are over."""
        busy = {t.run_id for t in self.turns.values()}
        ended = []
        for run_id in [r for r, rec in self.runs.items() if r not in busy and now - rec.last_seen >= RUN_IDLE_TIMEOUT_S]:
            del self.runs[run_id]
            if run_id in self.sessions:
                self.sessions.discard(run_id)
                ended.append(run_id)
        for call_id in [c for c, (_, seen) in self._tool_calls.items() if now - seen >= TOOL_CALL_MEMORY_S]:
            del self._tool_calls[call_id]
        return ended

"""A front door's run book (the dataplane's, and the endpoint picker's): what it must hand
the scheduler on Resync, and which run a returned tool_call id belongs to; new run and
turn ids."""

from __future__ import annotations

import argparse
import hashlib
import os
from dataclasses import dataclass

from luftpause.options import env_option, positive_float
from luftpause.vocabulary import RUN_IDLE_TIMEOUT_S

# tool_call ids an engine produced identify their run when an agent sends them back.
TOOL_CALL_MEMORY_S = 30 * 60
TOOL_CALL_SWEEP_S = 60
# A harness session (a run named by a session header) whose last turn answered, with no
# tool call pending, is over after this long without a turn: the scheduler is told (the
# run leaves its view) as by DELETE /v1/runs/{id}. Its affinity already ended with the
# answer (a run idle on its user is not pinned); what goes is the run's record. A user
# who comes back later opens the run again under the same id. Paused sessions (a tool
# running) wait the whole run timeout. Set per front door: --harness-session-idle.
SESSION_DONE_IDLE_S = 120.0

IDLE, GENERATING, PAUSED = "idle", "generating", "paused"


def new_id() -> str:
    """A new run or turn id: 128 random bits as 32 hex digits, the form of a uuid4's hex
    (a fifth of its cost, which is the UUID object's)."""
    return os.urandom(16).hex()


def session_idle_option(parser: argparse.ArgumentParser) -> None:
    """--harness-session-idle, for every front door that keeps a RunBook (dataplane, picker)."""
    env_option(parser, "--harness-session-idle", "LUFTPAUSE_HARNESS_SESSION_IDLE_S", SESSION_DONE_IDLE_S,
               "seconds after which a harness session (a run named by a session header) whose last turn "
               "answered is over: its run leaves the scheduler (a session paused on a tool call waits the "
               f"run timeout, {RUN_IDLE_TIMEOUT_S // 60} minutes); its next turn opens it again",
               kind=positive_float)


def task_digest(task: str) -> str:
    """How a task is named when the runtime asks whose it was: the hex SHA-256 of its UTF-8."""
    return hashlib.sha256(task.encode()).hexdigest()


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

    def __init__(self, session_done_idle_s: float = SESSION_DONE_IDLE_S) -> None:
        self.session_done_idle_s = session_done_idle_s
        self.runs: dict[str, RunRecord] = {}
        self.turns: dict[str, InFlightTurn] = {}
        self._tool_calls: dict[str, tuple[str, float]] = {}  # tool_call id -> (run id, seen at)
        self._tasks: dict[str, tuple[str, float]] = {}  # task_digest(a tool call's task) -> (run id, seen at)
        self.sessions: set[str] = set()  # runs named by a harness's session header
        # Sessions that are over whose record stays for its name (sweep): not in a snapshot.
        self.over: set[str] = set()

    def run_for_tool_calls(self, tool_call_ids: list[str], now: float) -> str | None:
        for call_id in tool_call_ids:
            entry = self._tool_calls.get(call_id)
            if entry is not None and now - entry[1] < TOOL_CALL_MEMORY_S:
                return entry[0]
        return None

    def remember_tool_calls(self, run_id: str, tool_call_ids: list[str], now: float) -> None:
        for call_id in tool_call_ids:
            self._tool_calls[call_id] = (run_id, now)

    def remember_tasks(self, run_id: str, tasks: list[str], now: float) -> None:
        """The run's reply handed out these tasks in tool calls (observe.CallTasks)."""
        for task in tasks:
            self._tasks[task_digest(task)] = (run_id, now)

    def run_for_task(self, digest: str, now: float) -> RunRecord | None:
        """The run whose reply most recently handed out the task with this digest (as
        recently as tool_call ids are remembered), if this dataplane still knows it."""
        entry = self._tasks.get(digest)
        if entry is None or now - entry[1] >= TOOL_CALL_MEMORY_S:
            return None
        return self.runs.get(entry[0])

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
        self.over.discard(run_id)

    def forget_run(self, run_id: str) -> None:
        self.runs.pop(run_id, None)
        self.sessions.discard(run_id)
        self.over.discard(run_id)

    def live_runs(self) -> list[RunRecord]:
        """The runs a snapshot for the scheduler carries: not the sessions that are over
        (their record is kept only for the name; the scheduler was told they ended)."""
        return [record for run_id, record in self.runs.items() if run_id not in self.over]

    @property
    def sweep_period_s(self) -> float:
        """How often sweep() runs: often enough that a finished session ends within half
        its idle window more."""
        return min(TOOL_CALL_SWEEP_S, self.session_done_idle_s / 2)

    def sweep(self, now: float) -> list[str]:
        """Drop idle runs and stale tool_call ids; return the harness sessions that are
        over: idle past the run timeout, or past ``session_done_idle_s`` after a turn that
        answered (a finished ``claude -p``, a closed Codex thread, a user who walked away).
        A session paused on a tool call keeps its run for the whole run timeout (tools may
        take long). An answered session's record stays until the run timeout so its caller
        keeps the name (a tenant's session id is not another's to take); its next turn opens
        the run again on the scheduler."""
        busy = {t.run_id for t in self.turns.values()}
        ended = []
        for run_id, record in list(self.runs.items()):
            if run_id in busy:
                continue
            idle = now - record.last_seen
            if idle >= RUN_IDLE_TIMEOUT_S:
                del self.runs[run_id]
                self.over.discard(run_id)
            elif not (record.stage == IDLE and idle >= self.session_done_idle_s):
                continue
            if run_id in self.sessions:
                self.sessions.discard(run_id)
                ended.append(run_id)
                if run_id in self.runs:  # kept for its name
                    self.over.add(run_id)
        for memory in (self._tool_calls, self._tasks):
            for key in [k for k, (_, seen) in memory.items() if now - seen >= TOOL_CALL_MEMORY_S]:
                del memory[key]
        return ended

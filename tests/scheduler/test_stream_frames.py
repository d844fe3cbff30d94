"""A Connect frame applied to the scheduler's host, in process: the items of one frame
in order, and a turn's usage followed by its finish applied as one step."""

from __future__ import annotations

import structlog

from luftpause.proto import scheduler_pb2 as pb
from luftpause.scheduler import core
from luftpause.scheduler.host import SchedulerHost
from luftpause.scheduler.pool import Endpoint
from luftpause.scheduler.stream import DataplaneStream

MODEL = "m"


def host() -> SchedulerHost:
    clock = iter(range(1000, 10**6)).__next__
    return SchedulerHost([Endpoint("a", "http://a", (MODEL,))], structlog.get_logger(), clock=lambda: clock() / 1000,
                         first_probe_wait_s=0)


def item(turn: str, **kind) -> pb.DataplaneItem:
    return pb.DataplaneItem(event=pb.TurnEvent(turn_id=turn, run_id=f"run-{turn}", **kind))


def usage(turn: str, prompt: int, completion: int) -> pb.DataplaneItem:
    return item(turn, usage=pb.Usage(prompt_tokens=prompt, completion_tokens=completion))


def finished(turn: str, reason: str = "tool_calls") -> pb.DataplaneItem:
    return item(turn, finished=pb.TurnFinished(finish_reason=reason))


def admitted(turns: list[str]) -> tuple[SchedulerHost, DataplaneStream, list[core.Event]]:
    """A host with the turns placed through a stream, and a record of the events it applies."""
    h = host()
    h.apply(core.EngineProbed("a", True, 0, 0, h.now_ms()))
    stream = DataplaneStream(h, "dp-1")
    stream.apply(pb.DataplaneFrame(items=[pb.DataplaneItem(admit=pb.AdmitRequest(
        turn_id=t, run_id=f"run-{t}", model=MODEL, service_class=pb.INTERACTIVE, caller="c")) for t in turns]))
    assert set(h.state.turns) == set(turns)
    applied: list[core.Event] = []
    apply = h.apply
    h.apply = lambda event: (applied.append(event), apply(event))[1]
    return h, stream, applied


def test_a_turns_usage_then_its_finish_is_one_step_with_the_same_outcome():
    h, stream, applied = admitted(["t1", "t2"])
    stream.apply(pb.DataplaneFrame(items=[usage("t1", 2900, 100), finished("t1"),
                                          usage("t2", 10, 5), finished("t2", "stop")]))
    assert [type(e).__name__ for e in applied] == ["TurnFinished", "TurnFinished"]
    assert h.state.runs["run-t1"].context_tokens == 3000 and h.state.runs["run-t1"].stage is core.Stage.PAUSED
    assert h.state.runs["run-t2"].context_tokens == 15 and h.state.runs["run-t2"].stage is core.Stage.IDLE
    assert h.state.replicas["a"].paused_interactive_tokens == 3000 and not h.state.turns


def test_usage_not_followed_by_its_turns_finish_is_applied_alone():
    h, stream, applied = admitted(["t1", "t2"])
    stream.apply(pb.DataplaneFrame(items=[usage("t1", 2900, 100), finished("t2"), usage("t2", 1, 1)]))
    assert [type(e).__name__ for e in applied] == ["TurnUsage", "TurnFinished", "TurnUsage"]
    stream.apply(pb.DataplaneFrame(items=[finished("t1")]))  # its finish came in the next frame
    assert h.state.runs["run-t1"].context_tokens == 3000 and h.state.replicas["a"].paused_interactive_tokens == 3000

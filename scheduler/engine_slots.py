"""Each run's engine slot on the replicas whose engines have slots (llama.cpp's
``--parallel``; luftpause/hints.py), chosen by the host for every turn the core places
there and sent with the placement: the dataplane (or the endpoint picker) sets it as the
turn's ``id_slot``, with ``cache_prompt: true``.

llama.cpp runs a request in the slot its ``id_slot`` names (the request waits while that
slot is busy) and reuses the KV that slot holds of the longest common prefix: a run that
comes back to its slot finds its prefix computed. Without ``id_slot`` the engine takes the
idle slot sharing the most of the prompt, else the one used least recently, whoever's KV
it holds: a batch job's new prompt may take the slot of an interactive run paused on a
tool. The scheduler knows which runs are worth their KV; per replica:

* a run keeps its slot there for as long as it holds it;
* a run new to the replica (or whose slot was taken) takes a slot held by no live run
  (its run has left the core's state), the one used last first (its prompt is the
  likeliest to share a prefix with the new run's, which llama.cpp's own choice looks
  for; the scheduler does not see prompts), a slot never used after those;
* else the slot of the least valuable holder: a run whose last turn went to another
  replica, then a batch run, then an interactive one, each class's runs waiting for
  their next message before those paused on a tool (due back), the one idle longest
  first (its last turn here placed or ended earliest), never one in a turn here right
  now;
* when every holder is in a turn here, none: the turn goes without ``id_slot`` and the
  engine runs it in the first slot that frees (its run takes a slot at its next turn).
  Pinned to a busy slot it would wait for that very slot, and llama.cpp, offered a
  freed slot, takes the first task in line unless one is pinned to it: a task pinned to
  another busy slot goes back to waiting and the freed slot idles;
* ties go to the lowest slot: the choice is a function of the core's state and this
  table alone.

Which turns reach a replica is the core's (core/limit.py): batch turns leave a slot for
each interactive run paused there on a tool (at most half the slots), and so does the
first turn of a new run, interactive or not: it would take a paused run's slot and its
KV, so it waits for a batch turn to end.

Runs that left the core's state are let go at the next run end or clock tick
(:meth:`EngineSlots.settle`), as their engine sessions are closed (engine_sessions.py).
Nothing is persisted: a restarted scheduler gives the runs coming back slots anew.
"""

from __future__ import annotations

from dataclasses import dataclass

from luftpause.scheduler.core.state import Stage, State
from luftpause.vocabulary import INTERACTIVE

# A holder's worth, lowest first: the slot of the lowest goes to a run that needs one.
FREE, MOVED, BATCH_RUN, INTERACTIVE_RUN = range(4)


@dataclass
class Holder:
    run_id: str  # "": its run has ended (the slot is free, its KV still there)
    used_ms: int  # when a turn of the run last took the slot


class EngineSlots:
    """Replica -> its slots' holders, by slot number."""

    def __init__(self) -> None:
        self._held: dict[str, list[Holder | None]] = {}

    def take(self, state: State, replica: str, run_id: str, slots: int, now_ms: int) -> int | None:
        """The slot of the run's turn placed on the replica now (the module's rules): its
        own, else one held by no live run, else the least valuable holder's; None while
        every holder is in a turn there."""
        held = self._sized(replica, slots)
        for index, holder in enumerate(held):
            if holder is not None and holder.run_id == run_id:
                holder.used_ms = now_ms
                return index
        index = self.spare(state, replica, slots)
        if index is not None:
            held[index] = Holder(run_id, now_ms)
        return index

    def spare(self, state: State, replica: str, slots: int) -> int | None:
        """The slot a request of no run may take (the scheduler's probe generation): the
        one a run new to the replica would, left as it is; None while every holder is in
        a turn there."""
        held = self._sized(replica, slots)
        least = min((*worth(state, replica, holder), index) for index, holder in enumerate(held))
        return None if least[0] else least[-1]  # in a turn: so is every holder

    def of(self, replica: str, run_id: str) -> int | None:
        """The run's slot on the replica, None when it holds none there."""
        for index, holder in enumerate(self._held.get(replica, ())):
            if holder is not None and holder.run_id == run_id:
                return index
        return None

    def settle(self, state: State) -> None:
        """Let go of the slots of runs no longer in the state."""
        for held in self._held.values():
            for holder in held:
                if holder is not None and holder.run_id and holder.run_id not in state.runs:
                    holder.run_id = ""

    def holders(self, replica: str) -> list[str | None]:
        """The run holding each slot of the replica (None: free), by slot number."""
        return [(holder.run_id or None) if holder is not None else None for holder in self._held.get(replica, ())]

    def _sized(self, replica: str, slots: int) -> list[Holder | None]:
        """The replica's holders, as many as its engine has slots now (an engine started
        again with another --parallel keeps the holders of the slots it still has)."""
        held = self._held.setdefault(replica, [])
        if len(held) != slots:
            del held[slots:]
            held.extend([None] * (slots - len(held)))
        return held


def worth(state: State, replica: str, holder: Holder | None) -> tuple[bool, int, bool, int]:
    """What keeping the holder's KV in its slot on the replica is worth, lowest first: in
    a turn here right now, then FREE (a run that ended, the one used last first; a slot
    never used after them), MOVED, BATCH_RUN or INTERACTIVE_RUN, then paused on a tool,
    then when it was last seen here (idle longest first)."""
    if holder is None:
        return False, FREE, False, 1
    run = state.runs.get(holder.run_id)
    if run is None:
        return False, FREE, False, -holder.used_ms
    if run.replica != replica:
        return False, MOVED, False, holder.used_ms
    tier = INTERACTIVE_RUN if run.service_class == INTERACTIVE else BATCH_RUN
    return run.stage is Stage.GENERATING, tier, run.stage is Stage.PAUSED, run.last_seen_ms
